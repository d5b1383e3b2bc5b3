"""The quality check's probe: seconds per training step of every model, measured alone on the device before any
run, in its own process while the data is rendered:

    python -m linvit.bench.quality.probe SETTINGS_JSON DEADLINE    # a result line per case, until the deadline

The step is the engine's ``TrainStep`` with AdamW on a random batch, the recipe's batch, autocast and clipping; its
seconds plan the runs' steps (``plan.plan_group``).
"""
import dataclasses
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Sequence

from linvit.timing import synchronize

from ..processes import child_env
from .plan import Preset, ProbeCase, QualitySettings, probe_cases
from .recipe import CLIP_GRAD, LABEL_SMOOTHING

__all__ = ['PROBE_MARK', 'probe_step_s', 'run_probe', 'read_probe', 'start_probe', 'probe_main']

PROBE_MARK = 'QUALITY_PROBE '  # starts a result line of the probe's output


def probe_step_s(case: ProbeCase, preset: Preset, device_name: str) -> float:
    """Median seconds of one training step (forward, loss, backward, clipping, AdamW; bfloat16 autocast on CUDA) of
    the case's model on a random batch [batch, 3, px, px], after ``probe_warmup`` steps."""
    import timm
    import torch
    from timm.optim import create_optimizer_v2

    from linvit.engine.step import TrainStep
    from linvit.models import convert_to_linear

    device = torch.device(device_name)
    torch.manual_seed(0)
    model = timm.create_model(case.model, img_size=case.px, num_classes=10, **dict(preset.model_kwargs))
    if case.convert:
        convert_to_linear(model, feature_map=case.convert)
    model = model.to(device).train()
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-4, weight_decay=0.05)
    loss = torch.nn.CrossEntropyLoss(label_smoothing=LABEL_SMOOTHING)
    step = TrainStep(model, loss, optimizer, amp_dtype=torch.bfloat16 if device.type == 'cuda' else None,
                     clip_grad=CLIP_GRAD)
    images = torch.randn(case.batch, 3, case.px, case.px, device=device)
    targets = torch.randint(0, 10, (case.batch,), device=device)
    for _ in range(preset.probe_warmup):
        step(images, targets)
    times = []
    for _ in range(preset.probe_repeats):
        synchronize(device)
        begin = time.perf_counter()
        step(images, targets)
        synchronize(device)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def probe_meta(device_name: str) -> Dict[str, Any]:
    """The probe's first record: the machine and the versions the report names."""
    import timm
    import torch

    from ..machine import describe_machine
    return {'key': 'meta', 'machine': describe_machine(torch.device(device_name)), 'torch': torch.__version__,
            'timm': timm.__version__}


def run_probe(settings: QualitySettings, deadline: float) -> None:
    """The probe's process: a result line per case (step_s, or a status saying why not) until the deadline."""
    import torch
    print(PROBE_MARK + json.dumps(probe_meta(settings.device)), flush=True)
    for case in probe_cases(settings.preset):
        if time.time() > deadline:
            break
        try:
            record = {'key': case.key, 'step_s': probe_step_s(case, settings.preset, settings.device), 'status': 'ok'}
        except Exception as exc:  # noqa: BLE001  (one model that does not fit is a row, not a failed check)
            oom = isinstance(exc, torch.OutOfMemoryError) or 'out of memory' in str(exc).lower()
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ''
            record = {'key': case.key, 'status': 'oom' if oom else f"error: {type(exc).__name__}: {text}"[:200]}
        print(PROBE_MARK + json.dumps(record), flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def read_probe(log: Path) -> Dict[str, Dict[str, Any]]:
    """The probe's records by key ('meta' and the cases it finished)."""
    if not log.is_file():
        return {}
    lines = log.read_text(errors='replace').splitlines()
    return {r['key']: r for r in (json.loads(line[len(PROBE_MARK):]) for line in lines if line.startswith(PROBE_MARK))}


def start_probe(settings: QualitySettings, deadline: float) -> subprocess.Popen:
    """The probe's process (``python -m linvit.bench.quality.probe SETTINGS_JSON DEADLINE``), output in
    logs/probe.log."""
    argv = [sys.executable, '-m', __name__, json.dumps(dataclasses.asdict(settings)), repr(deadline)]
    with open(Path(settings.out) / 'logs' / 'probe.log', 'w') as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)


def probe_main(argv: Sequence[str]) -> int:
    """``python -m linvit.bench.quality.probe SETTINGS_JSON DEADLINE``: the probe's process."""
    config, deadline = argv
    run_probe(QualitySettings(**json.loads(config)), float(deadline))
    return 0


if __name__ == '__main__':
    sys.exit(probe_main(sys.argv[1:]))
