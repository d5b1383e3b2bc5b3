"""Whole models at growing image sizes, one process per configuration: the library behind
``tools/profile_resolution.py``.

For every configuration (model, image size, batch, precision, eager|compiled, inference|training) a fresh Python
process builds the model with ``timm.create_model(name, img_size=(H, W), pretrained=False)``, runs warm-up calls (the
first one compiles, its time is reported apart), then times ``repeats`` calls: median and p90 latency (ms), images/s
and memory (``memory.MemoryWatch``). A configuration that runs out of memory or time, or fails with an error, gives a
row with its status and the child's message instead of stopping the sweep.

    configs = build_configs(models, sizes, ...)          # size-major
    rows = sweep(configs, csv_path, rounds=3)            # each in its own process, rows written as they complete
    print_report(rows, out_dir)                          # tables, PNGs (linvit.bench.plots), failures
    row = run_config(config, timeout=600)                # one configuration in a fresh interpreter
"""
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from linvit.models.bounded import DEFAULT_ROWS_PER_CHUNK
from linvit.models.segmentation import class_ids
from linvit.timing import CpuLoad, percentile

from . import plots, report
from .machine import describe_machine
from .memory import RETAIN_FREED_MEMORY_ENV, MemoryWatch, allocator_setting
from .specs import MODES, PROFILE_MODES, ModelSpec, parse_model_spec

__all__ = ['FLOORS', 'RESULT_MARK', 'Config', 'build_configs', 'measure', 'child_result', 'child_main', 'base_row',
           'run_config', 'sweep', 'load_columns', 'result_words', 'print_report', 'exit_status']

#: which models also get their floor measured: every model, the linvit ones, or none
FLOORS = ('all', 'linvit', 'none')
#: the line a child prints its result on (one JSON object)
RESULT_MARK = 'PROFILE_RESULT '
# the child: import this module, measure the configuration given as JSON, print RESULT_MARK + the result
_CHILD_CODE = 'import sys; from linvit.bench.profile import child_main; sys.exit(child_main(sys.argv[1]))'


@dataclass(frozen=True)
class Config:
    """One measurement: a model at one size, batch, precision, mode and workload."""
    model: ModelSpec
    height: int
    width: int
    batch: int
    dtype: str
    mode: str
    workload: str
    device: str
    warmup: int
    repeats: int
    threads: Optional[int] = None
    compile_mode: Optional[str] = None
    rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK  # bounded mode: patch rows per band

    def to_json(self) -> str:
        d = {k: getattr(self, k) for k in ('height', 'width', 'batch', 'dtype', 'mode', 'workload', 'device',
                                           'warmup', 'repeats', 'threads', 'compile_mode', 'rows_per_chunk')}
        d.update(spec=self.model.spec, name=self.model.name, kwargs=[list(kv) for kv in self.model.kwargs],
                 floor=self.model.floor)
        return json.dumps(d)

    @staticmethod
    def from_json(text: str) -> 'Config':
        d = json.loads(text)
        spec = ModelSpec(d.pop('spec'), d.pop('name'), tuple((k, _as_tuple(v)) for k, v in d.pop('kwargs')),
                         d.pop('floor'))
        return Config(model=spec, **d)

    def describe(self) -> str:
        return report.describe_row(base_row(self))


def _as_tuple(value: Any) -> Any:
    """JSON turns tuples into lists; model kwargs such as softmax_blocks and img_size expect tuples back."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def build_configs(models: Sequence[str], sizes: Sequence[Tuple[int, int]], floors: str = 'all',
                  workloads: Sequence[str] = ('inference',), dtypes: Sequence[str] = ('float32',),
                  batches: Sequence[int] = (1,), modes: Sequence[str] = ('eager', 'compiled'), device: str = 'cpu',
                  warmup: int = 2, repeats: int = 5, threads: Optional[int] = None,
                  compile_mode: Optional[str] = None, rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK) -> List[Config]:
    """Every configuration of a sweep, size-major so that an interrupted run has whole comparisons; ``floors``
    (``FLOORS``) adds the floor of every model, of the linvit ones, or of none. The bounded mode is measured for
    the inference of linvit models only (softmax attention and floors have no state form); the detection workload
    eagerly only (``measured_modes``)."""
    specs = [parse_model_spec(m) for m in models]
    if floors != 'none':
        specs = specs + [s.as_floor() for s in specs if floors == 'all' or s.kind == 'linvit']
    sizes = sorted(dict.fromkeys(sizes), key=lambda hw: (hw[0] * hw[1], hw))
    return [Config(spec, height, width, batch, dtype, mode, workload, device, warmup, repeats, threads, compile_mode,
                   rows_per_chunk)
            for workload in workloads for dtype in dtypes for batch in batches for height, width in sizes
            for mode in modes for spec in specs
            if mode in measured_modes(workload) and (mode != 'bounded' or spec.kind == 'linvit')]


def measured_modes(workload: str) -> Tuple[str, ...]:
    """The modes a workload is measured in: detection eagerly (torchvision's detectors pick proposals and boxes
    with data-dependent shapes, which a compiled graph and the bounded forward do not hold), training eagerly and
    compiled, inference and segmentation in every mode."""
    if workload == 'detection':
        return ('eager',)
    return MODES if workload == 'training' else PROFILE_MODES


# ------------------------------------------------------------------------------------------------------------------
# the child process: one configuration

#: classes of the segmentation workload's head
SEGMENTATION_CLASSES = 11
#: object classes of the detection workload's detector (COCO's 80)
DETECTION_CLASSES = 80


def _build_model(config: Config) -> Tuple[torch.nn.Module, Optional[int]]:
    """The model of ``config`` (its floor when asked) and its token count per image (None without a patch grid);
    for the segmentation workload, a ``SegmentationModel`` on it (default neck and head); for detection,
    torchvision's Faster R-CNN on it and its pyramid (``build_detector``: 256 channels, ViTDet's)."""
    import timm

    from linvit.layers import make_floor
    from linvit.models import SegmentationModel

    kwargs = dict(config.model.kwargs)
    if config.workload in ('segmentation', 'detection'):  # a dense model on the backbone's patch features
        kwargs = {'num_classes': 0, 'dynamic_img_size': True, **kwargs}
    backbone = timm.create_model(config.model.name, pretrained=False, img_size=(config.height, config.width), **kwargs)
    if config.model.floor:
        make_floor(backbone)
    grid = getattr(getattr(backbone, 'patch_embed', None), 'grid_size', None)
    tokens = (grid[0] * grid[1] + getattr(backbone, 'num_prefix_tokens', 0)) if grid else None
    if config.workload == 'segmentation':
        return SegmentationModel(backbone, num_classes=SEGMENTATION_CLASSES), tokens
    if config.workload == 'detection':
        from linvit.models.detection import build_detector
        return build_detector(backbone, DETECTION_CLASSES), tokens
    return backbone, tokens


def _forward(config: Config, model: torch.nn.Module) -> Callable[[torch.Tensor], Any]:
    """What one inference call runs: the model (compiled in compiled mode) or its bounded forward; segmentation
    ends in class ids, as predictions do."""
    from linvit import fast
    from linvit.models import bounded_forward_features, bounded_segment

    segmentation = config.workload == 'segmentation'
    if config.mode == 'bounded' and segmentation:
        return lambda images: bounded_segment(model, images, config.rows_per_chunk)
    if config.mode == 'bounded':
        return lambda images: model.forward_head(bounded_forward_features(model, images, config.rows_per_chunk))
    forward = fast.compile_model(model, mode=config.compile_mode) if config.mode == 'compiled' else model
    return (lambda images: class_ids(forward(images))) if segmentation else forward


def _inference_call(config: Config, model: torch.nn.Module, device: torch.device) -> Callable[[], Any]:
    """A forward under inference_mode: model and images cast to the precision (``_forward``)."""
    from linvit.precision import PRECISIONS

    dtype = PRECISIONS[config.dtype]
    model = model.to(device=device, dtype=dtype).eval()
    images = torch.randn(config.batch, 3, config.height, config.width, device=device).to(dtype)
    forward = _forward(config, model)

    def call() -> Any:
        with torch.inference_mode():
            return forward(images)
    return call


def _training_call(config: Config, model: torch.nn.Module, device: torch.device) -> Callable[[], Any]:
    """A training step (forward, cross-entropy, backward): float32 weights, autocast to the precision."""
    import torch.nn.functional as F

    from linvit.engine.step import TrainStep
    from linvit.precision import PRECISIONS

    model = model.to(device).train()
    images = torch.randn(config.batch, 3, config.height, config.width, device=device)
    targets = torch.randint(0, getattr(model, 'num_classes', 1000), (config.batch,), device=device)
    amp_dtype = None if config.dtype == 'float32' else PRECISIONS[config.dtype]
    step = TrainStep(model, F.cross_entropy, compile=config.mode == 'compiled', mode=config.compile_mode,
                     amp_dtype=amp_dtype)
    return lambda: step(images, targets)


def measure(config: Config) -> Dict[str, Any]:
    """Build, warm up and time one configuration in this process; returns the result fields of a row."""
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(0)
    device = torch.device(config.device)
    model, tokens = _build_model(config)
    build_call = _training_call if config.workload == 'training' else _inference_call
    call = build_call(config, model, device)
    cuda = device.type == 'cuda'

    def timed() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    memory = MemoryWatch(device)
    memory.start()
    first_call = timed()  # the first warm-up call: compiles in compiled mode
    for _ in range(config.warmup - 1):
        timed()
    memory.steady()
    times = [timed() for _ in range(config.repeats)]
    median = statistics.median(times)
    return {
        'tokens': tokens,
        'median_ms': median * 1e3,
        'p90_ms': percentile(times, 90) * 1e3,
        'img_per_s': config.batch / median,
        **memory.result(),
        'first_call_ms': first_call * 1e3,
        'machine': describe_machine(device),
        'threads': torch.get_num_threads(),
        'allocator': allocator_setting(),
    }


def child_result(config: Config) -> Dict[str, Any]:
    """The result fields of one configuration measured in this process; a failure gives its status and the
    exception's type and first line as ``error``."""
    try:
        return {'status': 'ok', **measure(config)}
    except Exception as exc:  # noqa: BLE001  (any failure becomes a row, not a crashed sweep)
        message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        oom = type(exc).__name__ == 'OutOfMemoryError' or 'out of memory' in str(exc).lower()
        return {'status': 'oom' if oom else 'error', 'error': message[:500]}


def child_main(config_json: str) -> int:
    """Run one configuration and print its result as one JSON line (errors too: the parent records them)."""
    print(RESULT_MARK + json.dumps(child_result(Config.from_json(config_json))), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------------------------
# the parent: run configurations in subprocesses

def base_row(config: Config) -> Dict[str, Any]:
    """The columns of a row that the configuration itself fixes."""
    return {
        'model': config.model.label, 'name': config.model.name,
        'kwargs': ','.join(f"{k}={v!r}" for k, v in config.model.kwargs), 'kind': config.model.kind,
        'height': config.height, 'width': config.width, 'batch': config.batch, 'dtype': config.dtype,
        'mode': config.mode, 'workload': config.workload, 'device': config.device, 'warmup': config.warmup,
        'repeats': config.repeats, 'compile_mode': config.compile_mode if config.mode == 'compiled' else None,
        'rows_per_chunk': config.rows_per_chunk if config.mode == 'bounded' else None,
    }


def _child_env(retain_freed_memory: bool) -> Dict[str, str]:
    """The child's environment: this linvit importable (also when run from a checkout that is not installed), and
    glibc keeping freed memory when asked."""
    import linvit

    root = os.path.dirname(os.path.dirname(os.path.abspath(linvit.__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get('PYTHONPATH')]))
    return {**os.environ, 'PYTHONPATH': path, **(RETAIN_FREED_MEMORY_ENV if retain_freed_memory else {})}


def run_config(config: Config, timeout: float, retain_freed_memory: bool = False) -> Dict[str, Any]:
    """Measure ``config`` in a fresh interpreter; a timeout, a kill (OOM killer) or an error gives a marked row."""
    row = base_row(config)
    cmd = [sys.executable, '-c', _CHILD_CODE, config.to_json()]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=_child_env(retain_freed_memory))
    except subprocess.TimeoutExpired:
        row.update(status='timeout', error=f"no result within {timeout:g} s")
        return row
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            row.update(json.loads(line[len(RESULT_MARK):]))
            return row
    if proc.returncode < 0:
        # SIGKILL without a result is what the kernel's OOM killer does
        row.update(status='oom' if proc.returncode == -9 else 'error', error=f"killed by signal {-proc.returncode}")
    else:
        tail = (proc.stderr.strip().splitlines() or ['no output'])[-1]
        row.update(status='error', error=f"exit {proc.returncode}: {tail[:500]}")
    return row


def load_columns(load: Optional[CpuLoad]) -> Dict[str, Any]:
    """The CSV columns of the CPU load before the sweep (none when it was not read: a GPU, no load average)."""
    return {'load_average': round(load.load_average, 2), 'cores': load.cores} if load else {}


def result_words(row: Dict[str, Any]) -> str:
    """One row's outcome in words, for the progress line."""
    if row['status'] != 'ok':
        return f"{row['status'].upper()} {row.get('error', '')}"
    return (f"{row['img_per_s']:.3f} img/s, median {row['median_ms']:.1f} ms, p90 {row['p90_ms']:.1f} ms, "
            f"peak {row['peak_mem_mib']:.0f} MiB (+{row['added_mem_mib']:.0f} MiB by the calls), "
            f"first call {row['first_call_ms']:.0f} ms")


def sweep(configs: Sequence[Config], csv_path: str, rounds: int = 1, timeout: float = 1800.,
          retain_freed_memory: bool = False, load: Optional[CpuLoad] = None) -> List[Dict[str, Any]]:
    """Run every configuration ``rounds`` times (round-major), each in its own process, writing rows to
    ``csv_path`` as they complete; ``load`` (the CPU load before the sweep) goes into every row, for the tables'
    busy-machine warning."""
    import csv

    from tqdm import tqdm

    rows = []
    with open(csv_path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=report.CSV_FIELDS, extrasaction='ignore')
        writer.writeheader()
        # round-major: a slow drift of the machine hits every configuration of a round alike
        runs = [(r, config) for r in range(rounds) for config in configs]
        progress = tqdm(runs, unit='config', dynamic_ncols=True)
        for round_index, config in progress:
            progress.set_description(config.describe())
            row = {'round': round_index, **run_config(config, timeout, retain_freed_memory), **load_columns(load)}
            rows.append(row)
            writer.writerow(row)
            f.flush()  # rows survive an interrupted sweep
            progress.write(f"{config.describe()}: {result_words(row)}")
    return rows


def print_report(rows: List[Dict[str, Any]], out_dir: str) -> None:
    """Tables, plots (PNGs in ``out_dir``), then the configurations that did not succeed (last, where a reader looks
    first)."""
    for line in report.summarize(rows):
        print(line)
    for path in plots.plot(rows, out_dir):
        print(f"wrote {path}")
    for line in report.failure_lines(rows):
        print(line)


def exit_status(rows: Sequence[Dict[str, Any]]) -> int:
    """0 when every configuration ran (or ran out of memory or time), 1 when any failed with an error."""
    return 1 if any(row['status'] == 'error' for row in rows) else 0
