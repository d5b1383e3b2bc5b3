"""Whole-model steps in one process, interleaved: a linvit model, its floor and its softmax counterpart.
The library behind ``tools/bench_train_step.py``.

A training step is ``linvit.engine.step.TrainStep``: forward, cross-entropy and backward (no optimizer); an
inference step is a forward under ``torch.inference_mode`` of the model in eval mode, cast to the precision; either
eager or compiled (``linvit.fast``). The three models (the floor is the linvit model with token mixing removed) are
built at each image size and stepped in turn, one step of each per round, so that the machine's drift hits them
alike: on a shared machine the same matmul can run 2-4x slower for seconds at a time, which a process per model
(``tools/profile_resolution.py``) meets in some processes and not in others. Peak memory needs a process per model:
``linvit.bench.profile`` (``tools/profile_resolution.py``).

    rows = run(TrainStepBench(model=parse_model_spec('linvit_small_patch16_224'), softmax='vit_small_patch16_224'))
"""
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

from linvit.engine.step import TrainStep
from linvit.fast import compile_model
from linvit.layers import make_floor
from linvit.precision import PRECISIONS
from linvit.timing import time_interleaved

from .cli import measurement_threads
from .memory import allocator_setting
from .op_profile import StepProfile, enable_compiled_kernel_names, format_profile, profile_steps
from .specs import MODES, WORKLOADS, ModelSpec, size_label

__all__ = ['KINDS', 'TrainStepBench', 'softmax_counterpart', 'build_models', 'measure_size', 'format_row', 'run']

#: the models of a row, in stepping order
KINDS = ('linvit', 'floor', 'softmax')


def softmax_counterpart(spec: ModelSpec, softmax: Optional[str] = 'auto') -> Optional[str]:
    """The softmax model to compare ``spec`` with: a timm name, 'auto' (vit_<rest> for linvit_<rest>) or None /
    'none' for no softmax model. Raises ValueError for a model that is not linvit_* or a name timm does not know."""
    if not spec.name.startswith('linvit_'):
        raise ValueError(f"--model must be a linvit_* model (its floor and softmax counterpart are derived from it), "
                         f"got {spec.name!r}")
    if softmax == 'auto':
        softmax = f"vit_{spec.name[len('linvit_'):]}"
    if softmax in (None, 'none'):
        return None
    if not timm.is_model(softmax):
        raise ValueError(f"--softmax {softmax!r} is not a timm model; name one (e.g. vit_small_patch16_224) or pass "
                         f"--softmax none")
    return softmax


@dataclass(frozen=True)
class TrainStepBench:
    """What to measure: ``model`` a linvit spec, ``softmax`` the timm name to compare with (None: no softmax
    model; see ``softmax_counterpart``), ``dtype`` the precision (training: autocast around forward and loss,
    'float32' none, weights stay float32; inference: model and images cast to it), ``warmup`` >= 1 (the first step
    compiles), ``workload`` what a step is ('training' or 'inference', see the module docstring), ``profile_ops``
    steps of each model to profile after the timing (0: none; ``linvit.bench.op_profile``), ``profile_top`` the
    ops of linvit listed, ``threads`` a number or 'auto' (``cli.measurement_threads``: the free cores)."""
    model: ModelSpec
    softmax: Optional[str] = None
    sizes: Sequence[Tuple[int, int]] = ((512, 512),)
    batch: int = 2
    mode: Sequence[str] = MODES
    dtype: str = 'float32'
    warmup: int = 1
    repeats: int = 3
    device: str = 'cpu'
    workload: str = 'training'
    profile_ops: int = 0
    profile_top: int = 10
    threads: Union[str, int] = 'auto'

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.repeats < 1 or self.batch < 1:
            raise ValueError('--warmup, --repeats and --batch must be >= 1')
        if self.profile_ops < 0 or self.profile_top < 0:
            raise ValueError('--profile-ops and --profile-top must be >= 0')
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {list(WORKLOADS)}, got {self.workload!r}")


def build_models(spec: ModelSpec, softmax: Optional[str], height: int, width: int,
                 device: str, train: bool = True) -> Dict[str, nn.Module]:
    """linvit, its floor (same weights, token mixing removed) and the softmax model on ``device``, in train mode
    (``train``) or eval mode."""
    torch.manual_seed(0)
    models = {'linvit': timm.create_model(spec.name, img_size=(height, width), **dict(spec.kwargs))}
    floor = timm.create_model(spec.name, img_size=(height, width), **dict(spec.kwargs))
    floor.load_state_dict(models['linvit'].state_dict())
    models['floor'] = make_floor(floor)
    if softmax:
        models['softmax'] = timm.create_model(softmax, img_size=(height, width))
    return {kind: model.to(device).train(train) for kind, model in models.items()}


def _training_steps(models: Dict[str, nn.Module], images: torch.Tensor, mode: str,
                    dtype: str) -> Dict[str, Callable[[], object]]:
    """A training step of each model on ``images`` (random targets)."""
    targets = torch.randint(0, models['linvit'].num_classes, (images.shape[0],), device=images.device)
    amp_dtype = None if dtype == 'float32' else PRECISIONS[dtype]
    steps = {kind: TrainStep(model, F.cross_entropy, compile=mode == 'compiled', amp_dtype=amp_dtype)
             for kind, model in models.items()}
    return {kind: (lambda step=step: step(images, targets)) for kind, step in steps.items()}


def _inference_steps(models: Dict[str, nn.Module], images: torch.Tensor, mode: str,
                     dtype: str) -> Dict[str, Callable[[], object]]:
    """A forward of each model (cast to ``dtype``) on ``images`` (cast alike) under inference_mode."""
    images = images.to(PRECISIONS[dtype])
    forwards = {kind: model.to(PRECISIONS[dtype]) for kind, model in models.items()}
    if mode == 'compiled':
        forwards = {kind: compile_model(model) for kind, model in forwards.items()}

    def infer(forward: Callable[[torch.Tensor], object]) -> object:
        with torch.inference_mode():
            return forward(images)
    return {kind: (lambda forward=forward: infer(forward)) for kind, forward in forwards.items()}


def measure_size(bench: TrainStepBench, height: int, width: int, mode: str
                 ) -> Tuple[Dict[str, Any], Optional[Dict[str, StepProfile]]]:
    """One table row: median ms per step of each model at (height, width) in ``mode``, and the ratios of img/s;
    and, with ``bench.profile_ops``, each model's profiled steps (else None)."""
    training = bench.workload == 'training'
    models = build_models(bench.model, bench.softmax, height, width, bench.device, train=training)
    images = torch.randn(bench.batch, 3, height, width, device=bench.device)
    calls = (_training_steps if training else _inference_steps)(models, images, mode, bench.dtype)
    ms = time_interleaved(calls, bench.warmup, bench.repeats, bench.device)
    profiles = profile_steps(calls, bench.profile_ops, bench.device) if bench.profile_ops else None
    row: Dict[str, Any] = {'workload': bench.workload, 'size': size_label(height, width), 'batch': bench.batch,
                           'mode': mode, 'dtype': bench.dtype}
    for kind in KINDS:
        row[f"{kind}_ms"] = ms.get(kind)
        row[f"{kind}_img_per_s"] = bench.batch * 1e3 / ms[kind] if kind in ms else None
    row['linvit_over_floor'] = ms['floor'] / ms['linvit']
    row['linvit_over_softmax'] = ms['softmax'] / ms['linvit'] if 'softmax' in ms else None
    return row, profiles


def format_row(row: Dict[str, Any]) -> str:
    def cell(value: Optional[float], digits: int, suffix: str = '') -> str:
        return '-' if value is None else f"{value:.{digits}f}{suffix}"

    return (f"{row['size']:>9} {row['batch']:>5} {row['mode']:>9} "
            + ' '.join(f"{cell(row[f'{kind}_ms'], 0):>10}" for kind in KINDS)
            + f" {cell(row['linvit_over_floor'], 2, 'x'):>13} {cell(row['linvit_over_softmax'], 2, 'x'):>15}")


def run(bench: TrainStepBench) -> List[Dict[str, Any]]:
    """Print the table (a row per size and mode as it completes); return its rows."""
    step = ('training step (forward, cross-entropy, backward)' if bench.workload == 'training'
            else 'inference step (forward under inference_mode)')
    threads = measurement_threads(bench.threads, bench.device).apply()
    print(f"# {step} of {bench.model.spec}, its floor and "
          f"{bench.softmax or 'no softmax model'}; {bench.dtype}, device {bench.device}, {threads.note()}; median of "
          f"{bench.repeats} interleaved rounds after {bench.warmup} warm-up step(s); ratios of images/s (> 1: linvit "
          f"faster)")
    for line in threads.warning_lines():
        print(line)
    print(f"{'size':>9} {'batch':>5} {'mode':>9} " + ' '.join(f"{kind + ' ms':>10}" for kind in KINDS)
          + f" {'linvit/floor':>13} {'linvit/softmax':>15}")
    if bench.profile_ops and 'compiled' in bench.mode:
        enable_compiled_kernel_names()  # before anything compiles
    rows = []
    for height, width in bench.sizes:
        for mode in bench.mode:
            row, profiles = measure_size(bench, height, width, mode)
            rows.append(row)
            print(format_row(row), flush=True)
            if profiles is not None:
                print(f"## where a step's time goes, {row['size']} {mode}: ms per step over {bench.profile_ops} "
                      f"profiled step(s) ({'kernel time' if str(bench.device).startswith('cuda') else 'op self time'})")
                print('\n'.join(format_profile(profiles, bench.profile_top)), flush=True)
    # read after the steps: training steps and compiled models make glibc keep freed memory on CPU
    # (linvit.fast.allocator)
    print(f"# allocator {allocator_setting()}")
    return rows
