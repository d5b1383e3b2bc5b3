#!/usr/bin/env python
"""Whole models at growing image sizes: linvit vs timm softmax ViTs vs their floors, eager vs compiled.

For every configuration (model, image size, batch, precision, eager|compiled, infer|train) a fresh Python process
builds the model with ``timm.create_model(name, img_size=(H, W), pretrained=False)``, runs warm-up calls (the first
one compiles, its time is reported apart), then times ``--repeats`` calls: median and p90 latency (ms), images/s,
and memory in MiB. Memory: ``base`` is what the process holds right after building the model and its inputs,
``peak`` the most it held during the timed calls (after warm-up: the step's own peak, not the build's or the
compiler's), ``added`` that peak above ``base`` (what the forward or training step costs, with whatever the warm-up
left allocated: gradients, compiled code). On CPU these are the process's resident set size (RSS), so ``base`` and
``peak`` include the interpreter, torch and, when compiled, the compiler; on CUDA they are the tensors torch
allocated (``torch.cuda.memory_allocated``). The floor of a model is the same model with token mixing removed
(``linvit.fast.make_floor``; ``--floors all|linear|none``): what any attention must pay at least. Compiled runs
go through ``linvit.fast`` (static shapes: each configuration compiles its own graph in its own process).
A configuration that runs out of memory or time is recorded as such and the sweep goes on; one that fails with an
error (an unknown model, a size the model rejects) is recorded with the child's exception message, listed at the
end, and makes the exit status 1. ``--rounds R`` runs the sweep R times (round after round) and reports each
configuration's median over rounds: processes differ (memory placement, the machine's other load), so one process
per configuration needs rounds to give steady ratios.
``--retain-freed-memory`` runs every configuration with glibc keeping freed memory (``RETAIN_FREED_MEMORY_ENV``):
by default it hands large freed buffers back to the system and faults fresh pages in when the next call allocates
them again, a per-process cost that moves CPU figures by 10-20% (the ``allocator`` column records the setting).

Rows go to ``OUT/profile.csv`` as they complete; then, per (task, precision, batch, mode), a table per linvit model
(its floor and its softmax counterpart side by side: img/s, ratios linvit/floor and linvit/softmax, added memory),
the crossover size from which linvit beats softmax, the time growth per doubling of the image side, and
compiled/eager ratios; ``OUT/profile_<task>_<dtype>_b<batch>.png`` plots img/s and added memory against the image
size (log-log, floors dashed). ``--summarize CSV`` re-reads a run and writes its PNGs next to the CSV.

    python tools/profile_resolution.py                                    # ViT-S/16: linvit vs vit, 224..2048 px
    python tools/profile_resolution.py --models linvit_small_patch16_224:local_mix=False vit_small_patch16_224 \\
        --sizes 224 512 1024 2048 --mode eager compiled --repeats 3 --out /tmp/prof
    python tools/profile_resolution.py --sizes 384x640 768x1280 --dtype bf16 --task infer train --batch 1 8
    python tools/profile_resolution.py --device cuda --compile-mode reduce-overhead --batch 1 16 --dtype bf16
    python tools/profile_resolution.py --summarize /tmp/prof/profile.csv   # tables and plots of an earlier run

Model specs are ``name`` or ``name:key=value,key=value`` (values as Python literals, e.g. ``local_mix=False``,
``attn_kernel='relu'``, ``softmax_blocks=(0,6)``, ``depth=2``). Precision: inference casts model and input to the
dtype; training keeps float32 weights and runs forward and loss under autocast (forward, loss, backward timed).
"""
import argparse
import ast
import csv
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from tool_cli import HelpFormatter, crossover  # noqa: F401  (crossover: also this tool's API)

DTYPES = ('fp32', 'bf16', 'fp16')
MODES = ('eager', 'compiled')
TASKS = ('infer', 'train')
FLOORS = ('all', 'linear', 'none')
MODE_MARKERS = {'eager': 's', 'compiled': 'o'}
DEFAULT_MODELS = ['linvit_small_patch16_224', 'vit_small_patch16_224']
DEFAULT_SIZES = ['224', '512', '1024', '2048']
DEFAULT_OUT = os.path.join(tempfile.gettempdir(), 'linvit_profile_resolution')
RESULT_MARK = 'PROFILE_RESULT '
# times in ms, memory in MiB (2**20 bytes)
CSV_FIELDS = ['round', 'model', 'name', 'kwargs', 'kind', 'height', 'width', 'tokens', 'batch', 'dtype', 'mode',
              'task', 'device', 'machine', 'compile_mode', 'status', 'median_ms', 'p90_ms', 'img_per_s',
              'peak_mem_mib', 'base_mem_mib', 'added_mem_mib', 'first_call_ms', 'warmup', 'repeats', 'threads',
              'allocator', 'error']
# columns of CSVs written before the units were made explicit: old name -> (new name, factor to the new unit)
LEGACY_COLUMNS = {'peak_mem_mb': ('peak_mem_mib', 1.0), 'base_mem_mb': ('base_mem_mib', 1.0),
                  'first_call_s': ('first_call_ms', 1e3)}
SIZE_WORDS = ('tiny', 'small', 'base', 'large', 'huge', 'giant')


# ----------------------------------------------------------------------------------------------------------------
# specs and configurations

@dataclass(frozen=True)
class ModelSpec:
    """A model to profile: timm name + create_model kwargs, or the floor of such a model."""
    spec: str
    name: str
    kwargs: Tuple[Tuple[str, Any], ...] = ()
    floor: bool = False

    @property
    def label(self) -> str:
        return f"floor({self.spec})" if self.floor else self.spec

    @property
    def kind(self) -> str:
        """'floor', 'linear' (linvit_*, hybrids included) or 'softmax' (any other timm ViT)."""
        if self.floor:
            return 'floor'
        return 'linear' if self.name.startswith('linvit_') else 'softmax'

    def as_floor(self) -> 'ModelSpec':
        return ModelSpec(self.spec, self.name, self.kwargs, floor=True)


def parse_model_spec(text: str) -> ModelSpec:
    """'name' or 'name:key=value,...' -> ModelSpec; values are Python literals, anything else a string."""
    name, _, rest = text.partition(':')
    if not name:
        raise ValueError(f"model spec {text!r} has no model name")
    kwargs = []
    for item in filter(None, (part.strip() for part in _split_top_level(rest))):
        key, eq, value = item.partition('=')
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"model spec {text!r}: expected key=value, got {item!r}")
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            parsed = value.strip()
        kwargs.append((key.strip(), parsed))
    return ModelSpec(text, name, tuple(kwargs))


def _split_top_level(text: str) -> List[str]:
    """Split on commas that are not inside brackets: 'a=1,b=(0,6)' -> ['a=1', 'b=(0,6)']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in '([{'
        depth -= ch in ')]}'
        if ch == ',' and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_size(text: str) -> Tuple[int, int]:
    """'224' -> (224, 224); '384x640' -> (384, 640) as (height, width)."""
    parts = text.lower().split('x')
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"image size must be N or HxW with positive integers, got {text!r}")
    return values[0], values[1]


def size_label(height: int, width: int) -> str:
    return str(height) if height == width else f"{height}x{width}"


@dataclass(frozen=True)
class Config:
    """One measurement: a model at one size, batch, precision, mode and task."""
    model: ModelSpec
    height: int
    width: int
    batch: int
    dtype: str
    mode: str
    task: str
    device: str
    warmup: int
    repeats: int
    threads: Optional[int] = None
    compile_mode: Optional[str] = None

    def to_json(self) -> str:
        d = {k: getattr(self, k) for k in ('height', 'width', 'batch', 'dtype', 'mode', 'task', 'device', 'warmup',
                                           'repeats', 'threads', 'compile_mode')}
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
        return describe_row(base_row(self))


def _as_tuple(value: Any) -> Any:
    """JSON turns tuples into lists; model kwargs such as softmax_blocks and img_size expect tuples back."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def build_configs(args: argparse.Namespace) -> List[Config]:
    """Every configuration of the sweep, size-major so that an interrupted run has whole comparisons."""
    specs = [parse_model_spec(m) for m in args.models]
    if args.floors != 'none':
        specs = specs + [s.as_floor() for s in specs if args.floors == 'all' or s.kind == 'linear']
    sizes = sorted(dict.fromkeys(args.sizes), key=lambda hw: (hw[0] * hw[1], hw))
    configs = []
    for task in args.task:
        for dtype in args.dtype:
            for batch in args.batch:
                for height, width in sizes:
                    for mode in args.mode:
                        for spec in specs:
                            configs.append(Config(spec, height, width, batch, dtype, mode, task, args.device,
                                                  args.warmup, args.repeats, args.threads, args.compile_mode))
    return configs


# ----------------------------------------------------------------------------------------------------------------
# the child process: one configuration

def _proc_status_mib(key: str) -> Optional[float]:
    """A ``Vm*`` line of /proc/self/status (VmRSS: resident now, VmHWM: peak since start or reset), MiB; None where
    there is no /proc (macOS)."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) / 1024  # reported in kB
    except OSError:
        pass
    return None


def lifetime_peak_rss_mib() -> float:
    import resource

    # ru_maxrss is in KiB on Linux, bytes on macOS
    scale = 1 / 1024 ** 2 if sys.platform == 'darwin' else 1 / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak_rss() -> bool:
    """Restart the process's peak RSS at its current RSS (Linux, /proc/self/clear_refs); False where unsupported."""
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return True
    except OSError:
        return False


class MemoryWatch:
    """Memory around the calls of one configuration, MiB: ``start()`` after building the model and inputs (the base),
    ``steady()`` after the warm-up calls, ``result()`` after the timed calls. The peak is the timed calls' own: the
    build, the first call (which compiles) and the warm-up allocate caches and compiler state whose peaks are not a
    step's. CPU: RSS of the process; CUDA: tensors allocated by torch on the device."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.cuda = device.type == 'cuda'
        self.base = self.build_peak = 0.0
        self.peak_was_reset = False

    def start(self) -> None:
        import torch

        if self.cuda:
            self.base = torch.cuda.memory_allocated(self.device) / 2 ** 20
            return
        self.build_peak = lifetime_peak_rss_mib()
        self.base = _proc_status_mib('VmRSS') or self.build_peak

    def steady(self) -> None:
        """Restart the peak: what follows are steady-state calls. Without /proc the peak read by ``result`` falls
        back to the process's lifetime peak (an upper bound)."""
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.peak_was_reset = reset_peak_rss()

    def result(self) -> Dict[str, float]:
        import torch

        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device) / 2 ** 20
            return {'peak_mem_mib': peak, 'base_mem_mib': self.base, 'added_mem_mib': max(0.0, peak - self.base)}
        peak = (_proc_status_mib('VmHWM') if self.peak_was_reset else None) or lifetime_peak_rss_mib()
        return {'peak_mem_mib': peak, 'base_mem_mib': self.base, 'added_mem_mib': max(0.0, peak - self.base)}


def describe_machine(device: Any) -> str:
    """'NVIDIA H200' for a CUDA device; 'AMD EPYC, 2 CPUs' (the CPU model, else the architecture) otherwise."""
    import torch

    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    processor = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            processor = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')),
                             processor)
    except OSError:
        pass
    return f"{processor}, {os.cpu_count()} CPUs"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100]) of a non-empty sequence: an observed value, no interpolation."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def measure(config: Config) -> Dict[str, Any]:
    """Build, warm up and time one configuration in this process; returns the result fields of a row."""
    import timm
    import torch
    import torch.nn.functional as F

    import linvit  # noqa: F401  (registers linvit_* with timm)
    from linvit import fast

    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(0)
    device = torch.device(config.device)
    dtype = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}[config.dtype]
    model = timm.create_model(config.model.name, pretrained=False, img_size=(config.height, config.width),
                              **dict(config.model.kwargs))
    if config.model.floor:
        fast.make_floor(model)
    grid = getattr(getattr(model, 'patch_embed', None), 'grid_size', None)
    tokens = (grid[0] * grid[1] + getattr(model, 'num_prefix_tokens', 0)) if grid else None
    images = torch.randn(config.batch, 3, config.height, config.width, device=device)
    if config.task == 'infer':
        model = model.to(device=device, dtype=dtype).eval()
        images = images.to(dtype)
        forward = fast.compile_model(model, mode=config.compile_mode) if config.mode == 'compiled' else model

        def call() -> Any:
            with torch.inference_mode():
                return forward(images)
    else:
        model = model.to(device).train()
        targets = torch.randint(0, getattr(model, 'num_classes', 1000), (config.batch,), device=device)
        step = fast.TrainStep(model, F.cross_entropy, compile=config.mode == 'compiled', mode=config.compile_mode,
                              amp_dtype=None if dtype == torch.float32 else dtype)

        def call() -> Any:
            return step(images, targets)

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


# glibc returns large freed blocks to the system and faults fresh pages in when they are allocated again; these
# thresholds (bytes) keep freed memory in the process, as jemalloc or tcmalloc would
RETAIN_FREED_MEMORY_ENV = {'MALLOC_MMAP_THRESHOLD_': str(2 ** 34), 'MALLOC_TRIM_THRESHOLD_': str(2 ** 34)}


def allocator_setting() -> str:
    """'retain' under ``RETAIN_FREED_MEMORY_ENV``, 'system' without those variables, 'custom' for other values."""
    if all(os.environ.get(k) == v for k, v in RETAIN_FREED_MEMORY_ENV.items()):
        return 'retain'
    return 'custom' if any(k in os.environ for k in RETAIN_FREED_MEMORY_ENV) else 'system'


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


# ----------------------------------------------------------------------------------------------------------------
# the parent: run configurations in subprocesses

def base_row(config: Config) -> Dict[str, Any]:
    return {
        'model': config.model.label, 'name': config.model.name,
        'kwargs': ','.join(f"{k}={v!r}" for k, v in config.model.kwargs), 'kind': config.model.kind,
        'height': config.height, 'width': config.width, 'batch': config.batch, 'dtype': config.dtype,
        'mode': config.mode, 'task': config.task, 'device': config.device, 'warmup': config.warmup,
        'repeats': config.repeats, 'compile_mode': config.compile_mode if config.mode == 'compiled' else None,
    }


def run_config(config: Config, timeout: float, retain_freed_memory: bool = False) -> Dict[str, Any]:
    """Measure ``config`` in a fresh interpreter; a timeout, a kill (OOM killer) or an error gives a marked row."""
    row = base_row(config)
    cmd = [sys.executable, os.path.abspath(__file__), '--child', config.to_json()]
    env = {**os.environ, **RETAIN_FREED_MEMORY_ENV} if retain_freed_memory else None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
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


# ----------------------------------------------------------------------------------------------------------------
# rows: CSV, comparisons, tables

def write_csv(path: str, rows: Iterable[Dict[str, Any]]) -> None:
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction='ignore')
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: str) -> List[Dict[str, Any]]:
    """Rows of a profile CSV with numbers parsed (empty fields become None); CSVs of earlier versions (MB and s
    columns, no added memory) are read into the current columns."""
    ints = ('round', 'height', 'width', 'tokens', 'batch', 'warmup', 'repeats', 'threads')
    floats = ('median_ms', 'p90_ms', 'img_per_s', 'peak_mem_mib', 'base_mem_mib', 'added_mem_mib', 'first_call_ms')
    rows = []
    with open(path, newline='') as f:
        for raw in csv.DictReader(f):
            row = _upgrade_legacy_columns(dict(raw))
            for key in ints + floats:
                value = row.get(key)
                row[key] = None if value in (None, '') else (int(float(value)) if key in ints else float(value))
            if row['added_mem_mib'] is None and row['peak_mem_mib'] is not None and row['base_mem_mib'] is not None:
                # old base: the peak RSS before the first call, so this is the calls' growth of the peak
                row['added_mem_mib'] = max(0.0, row['peak_mem_mib'] - row['base_mem_mib'])
            rows.append(row)
    return rows


def _upgrade_legacy_columns(row: Dict[str, Any]) -> Dict[str, Any]:
    for old, (new, factor) in LEGACY_COLUMNS.items():
        value = row.pop(old, None)
        if new not in row:
            row[new] = float(value) * factor if value not in (None, '') else None
    return row


def failure_lines(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """The configurations that failed with an error, then those that ran out of memory or time, with the reason
    (the child's exception message); no lines when every configuration succeeded."""
    several_rounds = len({r.get('round') for r in rows}) > 1
    lines = []
    for statuses, title in ((('error',), 'failed'), (('oom', 'timeout'), 'out of memory or time')):
        failed = [r for r in rows if r['status'] in statuses]
        if failed:
            lines.append(f"\n# {len(failed)} of {len(rows)} configurations {title}:")
        for r in failed:
            where = f" (round {r['round']})" if several_rounds else ''
            lines.append(f"{describe_row(r)}{where}: {r['status'].upper()} {r.get('error') or ''}".rstrip())
    return lines


def describe_row(row: Dict[str, Any]) -> str:
    """The same words as ``Config.describe`` for a CSV row."""
    return (f"{row['model']} {size_label(row['height'], row['width'])} b{row['batch']} {row['dtype']} {row['mode']} "
            f"{row['task']}")


def counterpart(linear_name: str, softmax_names: Sequence[str]) -> Optional[str]:
    """The softmax model to compare a linvit model with: vit_<rest> for linvit_<rest>, else the one of the same
    size word and patch (e.g. 'small', 'patch16'), else the only one; None if ambiguous or absent."""
    if not softmax_names:
        return None
    rest = linear_name[len('linvit_'):] if linear_name.startswith('linvit_') else linear_name
    for name in softmax_names:
        if name == f"vit_{rest}":
            return name
    tokens = set(rest.split('_'))
    keys = {t for t in tokens if t in SIZE_WORDS or t.startswith('patch')}
    matches = [n for n in softmax_names if keys and keys <= set(n.split('_'))]
    if len(matches) == 1:
        return matches[0]
    return softmax_names[0] if len(set(softmax_names)) == 1 else None


def _fmt(value: Optional[float], status: Optional[str] = None, digits: int = 2) -> str:
    if value is None:
        return status or '-'
    return f"{value:.{digits}f}"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _fmt_ratio(value: Optional[float]) -> str:
    return '-' if value is None else f"{value:.2f}x"


@dataclass
class Table:
    """Measurements of one (task, dtype, batch, mode) group, indexed by model label and (height, width)."""
    rows: List[Dict[str, Any]]
    by_key: Dict[Tuple[str, int, int], Dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_key = {(r['model'], r['height'], r['width']): r for r in self.rows}

    def sizes(self) -> List[Tuple[int, int]]:
        return sorted({(r['height'], r['width']) for r in self.rows}, key=lambda hw: (hw[0] * hw[1], hw))

    def labels(self, kind: str) -> List[str]:
        return list(dict.fromkeys(r['model'] for r in self.rows if r['kind'] == kind))

    def value(self, label: Optional[str], hw: Tuple[int, int], key: str = 'img_per_s') -> Optional[float]:
        row = self.by_key.get((label, hw[0], hw[1])) if label else None
        return row.get(key) if row and row.get('status') == 'ok' else None

    def status(self, label: Optional[str], hw: Tuple[int, int]) -> str:
        row = self.by_key.get((label, hw[0], hw[1])) if label else None
        return row['status'] if row else '-'

    def tokens(self, hw: Tuple[int, int]) -> Optional[int]:
        return next((r['tokens'] for r in self.rows if (r['height'], r['width']) == hw and r.get('tokens')), None)

    def cell(self, label: Optional[str], hw: Tuple[int, int], key: str = 'img_per_s', digits: int = 2) -> str:
        return _fmt(self.value(label, hw, key), self.status(label, hw), digits)


def family_summary(table: Table, linear: str) -> List[str]:
    """Lines for one linvit model: img/s of it, its floor, its softmax counterpart and that one's floor; the ratios
    linvit/floor and linvit/softmax at each size; the crossover size; the time growth per doubling of the side."""
    softmax_by_name = {r['name']: r['model'] for r in table.rows if r['kind'] == 'softmax'}
    linear_name = next(r['name'] for r in table.rows if r['model'] == linear)
    soft_name = counterpart(linear_name, list(softmax_by_name))
    soft = softmax_by_name.get(soft_name) if soft_name else None
    floor, soft_floor = f"floor({linear})", f"floor({soft})" if soft else None
    columns = [(linear, 'linvit'), (floor, 'floor'), (soft, 'softmax'), (soft_floor, 'sm floor')]
    columns = [(label, title) for label, title in columns if label and any(k[0] == label for k in table.by_key)]
    lines = [f"## {linear}" + (f" vs {soft}" if soft else " (no softmax counterpart in this run)")
             + "; peak linvit/floor = ratio of the timed calls' peak memory"]
    header = f"{'size':>10} {'tokens':>7} " + ' '.join(f"{title + ' img/s':>15}" for _, title in columns)
    header += f" {'linvit/floor':>13} {'linvit/softmax':>15} {'linvit +MiB':>12}"
    header += f" {'softmax +MiB':>13}" if soft else ''
    header += f" {'peak linvit/floor':>18}"
    lines.append(header)
    points = []
    for hw in table.sizes():
        lin, fl, sm = table.value(linear, hw), table.value(floor, hw), table.value(soft, hw)
        points.append((hw, lin, sm))
        line = f"{size_label(*hw):>10} {table.tokens(hw) or '-':>7} "
        line += ' '.join(f"{table.cell(label, hw):>15}" for label, _ in columns)
        line += f" {_fmt_ratio(_ratio(lin, fl)):>13} {_fmt_ratio(_ratio(lin, sm)):>15}"
        line += f" {table.cell(linear, hw, 'added_mem_mib', 0):>12}"
        if soft:
            line += f" {table.cell(soft, hw, 'added_mem_mib', 0):>13}"
        peak_ratio = _ratio(table.value(linear, hw, 'peak_mem_mib'), table.value(floor, hw, 'peak_mem_mib'))
        line += f" {_fmt_ratio(peak_ratio):>18}"
        lines.append(line)
    if soft:
        cross = crossover(points)
        if cross is None:
            lines.append(f"crossover: {linear} does not beat {soft} at the largest size measured")
        else:
            lines.append(f"crossover: {linear} beats {soft} from {size_label(*cross)} px ({table.tokens(cross)} "
                         f"tokens) on, at every larger size measured")
        speedups = []
        for hw, lin, sm in points:
            both = lin is not None and sm is not None
            speedups.append(f"{size_label(*hw)}: " + (_fmt_ratio(_ratio(lin, sm)) if both else
                                                      f"linvit {table.status(linear, hw)}, "
                                                      f"softmax {table.status(soft, hw)}"))
        lines.append(f"speedup {linear} / {soft} (img/s): " + ', '.join(speedups))
    for small, large in doublings(table.sizes()):
        growth = []
        for label, title in columns:
            t_small, t_large = table.value(label, small, 'median_ms'), table.value(label, large, 'median_ms')
            growth.append(f"{title} {_fmt_ratio(_ratio(t_large, t_small))}")
        lines.append(f"time growth {size_label(*small)} -> {size_label(*large)} px (4x tokens): " + ', '.join(growth))
    return lines


def doublings(sizes: Sequence[Tuple[int, int]]) -> List[Tuple[Tuple[int, int], Tuple[int, int]]]:
    """Pairs of measured sizes where the second doubles both sides of the first (4x the patch tokens)."""
    present = set(sizes)
    return [(hw, (2 * hw[0], 2 * hw[1])) for hw in sizes if (2 * hw[0], 2 * hw[1]) in present]


def plain_summary(table: Table) -> List[str]:
    """img/s of every model at every size (used when the run has no linvit model)."""
    labels = list(dict.fromkeys(r['model'] for r in table.rows))
    lines = [f"{'size':>10} {'tokens':>7} " + ' '.join(f"{label[:28]:>28}" for label in labels)]
    for hw in table.sizes():
        lines.append(f"{size_label(*hw):>10} {table.tokens(hw) or '-':>7} "
                     + ' '.join(f"{table.cell(label, hw):>28}" for label in labels))
    return lines


def mode_summary(rows: List[Dict[str, Any]]) -> List[str]:
    """compiled / eager img/s of each model at each size, for rows of one (task, dtype, batch) measured both ways."""
    eager = Table([r for r in rows if r['mode'] == 'eager'])
    compiled = Table([r for r in rows if r['mode'] == 'compiled'])
    labels = list(dict.fromkeys(r['model'] for r in rows))
    width = max(len(label) for label in labels)
    lines = [f"{'compiled/eager':>{width}} " + ' '.join(f"{size_label(*hw):>9}" for hw in eager.sizes())]
    for label in labels:
        cells = [_fmt_ratio(_ratio(compiled.value(label, hw), eager.value(label, hw))) for hw in eager.sizes()]
        lines.append(f"{label:>{width}} " + ' '.join(f"{c:>9}" for c in cells))
    return lines


def aggregate_rounds(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per configuration: over its successful rounds, the median of the median and p90 latencies (img/s
    recomputed from the median), the largest peak and added memory; a configuration that never succeeded keeps its first
    failure. ``rounds`` counts the rounds that went into a row."""
    groups: Dict[Tuple[Any, ...], List[Dict[str, Any]]] = {}
    for row in rows:
        key = tuple(row[k] for k in ('model', 'height', 'width', 'batch', 'dtype', 'mode', 'task'))
        groups.setdefault(key, []).append(row)
    merged = []
    for group in groups.values():
        ok = [r for r in group if r['status'] == 'ok']
        row = dict(ok[0] if ok else group[0])
        row['rounds'] = len(ok)
        if len(ok) > 1:
            row['median_ms'] = statistics.median(r['median_ms'] for r in ok)
            row['p90_ms'] = statistics.median(r['p90_ms'] for r in ok)
            row['img_per_s'] = row['batch'] * 1e3 / row['median_ms']
            row['first_call_ms'] = statistics.median(r['first_call_ms'] for r in ok)
            for key in ('peak_mem_mib', 'added_mem_mib'):
                row[key] = max((r[key] for r in ok if r.get(key) is not None), default=None)
        merged.append(row)
    return merged


def group_key(row: Dict[str, Any]) -> Tuple[str, str, int]:
    return row['task'], row['dtype'], row['batch']


def summarize(rows: List[Dict[str, Any]]) -> List[str]:
    """All printed tables of a run, grouped by (task, dtype, batch) and then mode (rounds merged by median)."""
    rounds = len({r.get('round') for r in rows})
    rows = aggregate_rounds(rows)
    lines = []
    for task, dtype, batch in sorted({group_key(r) for r in rows}):
        group = [r for r in rows if group_key(r) == (task, dtype, batch)]
        modes = [m for m in MODES if any(r['mode'] == m for r in group)]
        for mode in modes:
            table = Table([r for r in group if r['mode'] == mode])
            device = table.rows[0].get('device', '')
            machine = next((r['machine'] for r in table.rows if r.get('machine')), None)
            threads = next((r['threads'] for r in table.rows if r.get('threads')), None)
            allocator = next((r['allocator'] for r in table.rows if r.get('allocator')), None)
            lines.append(f"\n# {task}, {dtype}, batch {batch}, {mode}, {device}"
                         + (f" ({machine})" if machine else '')
                         + (f", {threads} threads" if threads else '')
                         + (f", allocator {allocator}" if allocator else '')
                         + "; img/s = batch / median latency"
                         + (f" (median over {rounds} rounds)" if rounds > 1 else '')
                         + ", +MiB = memory added by the calls")
            linear = table.labels('linear')
            for label in linear:
                lines.extend(family_summary(table, label))
            if not linear:
                lines.extend(plain_summary(table))
        if len(modes) == 2:
            lines.append(f"\n# {task}, {dtype}, batch {batch}: compiled / eager img/s")
            lines.extend(mode_summary(group))
    return lines


# ----------------------------------------------------------------------------------------------------------------
# the plot

def plot(rows: List[Dict[str, Any]], out_dir: str) -> List[str]:
    """One PNG per (task, dtype, batch): img/s and added memory vs image size, log-log; a line per model and mode."""
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    paths = []
    rows = aggregate_rounds(rows)
    for task, dtype, batch in sorted({group_key(r) for r in rows}):
        group = [r for r in rows if group_key(r) == (task, dtype, batch) and r['status'] == 'ok' and r['tokens']]
        if not group:
            continue
        fig = throughput_figure(group)
        path = os.path.join(out_dir, f"profile_{task}_{dtype}_b{batch}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def throughput_figure(group: List[Dict[str, Any]]) -> Any:
    """The figure of one (task, dtype, batch) group of successful rows: img/s and added memory per image size."""
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(13, 6), layout='constrained')
    base_labels = list(dict.fromkeys(_base_label(r) for r in group))
    colors = {label: f"C{i % 10}" for i, label in enumerate(base_labels)}
    modes = [m for m in MODES if any(r['mode'] == m for r in group)]
    for label in dict.fromkeys(r['model'] for r in group):
        for mode in modes:
            line = sorted((r for r in group if r['model'] == label and r['mode'] == mode), key=image_side)
            if not line:
                continue
            style = dict(color=colors[_base_label(line[0])], linestyle='--' if line[0]['kind'] == 'floor' else '-',
                         marker=MODE_MARKERS[mode], alpha=1.0 if mode == 'compiled' or len(modes) == 1 else 0.6,
                         label=f"{label} [{mode}]")
            sides = [image_side(r) for r in line]
            ax_speed.plot(sides, [r['img_per_s'] for r in line], **style)
            ax_mem.plot(sides, [r.get('added_mem_mib') for r in line], **style)
    ax_speed.set_ylabel('images / s (higher is better)')
    ax_mem.set_ylabel(memory_axis_label(group))
    for ax in (ax_speed, ax_mem):
        _label_image_sizes(ax, group)
        _plain_log_y(ax)
        ax.grid(True, which='both', alpha=0.3)
    handles, labels, columns = legend_entries(group, colors, modes)
    fig.legend(handles, labels, loc='outside lower center', ncols=columns, fontsize=8,
               title='dashed: floor of the model (token mixing removed)', title_fontsize=8)
    fig.suptitle(figure_title(group, modes))
    return fig


def legend_entries(group: Sequence[Dict[str, Any]], colors: Dict[str, str],
                   modes: Sequence[str]) -> Tuple[List[Any], List[str], int]:
    """(handles, labels, columns) of the figure's legend: models on the left, each one's floor on its right (same
    row, same color); with both modes measured, a last row gives each mode's marker instead of listing every line
    twice."""
    from matplotlib.lines import Line2D

    present = {r['model'] for r in group}
    marker = MODE_MARKERS[modes[0]] if len(modes) == 1 else None
    left, right = [], []
    for base, color in colors.items():
        left.append((Line2D([], [], color=color, marker=marker), base) if base in present else None)
        floor = f"floor({base})"
        right.append((Line2D([], [], color=color, linestyle='--', marker=marker), floor) if floor in present else None)
    if not any(right):
        right = []
    if len(modes) > 1:
        mode_keys = [(Line2D([], [], color='gray', linestyle='none', marker=MODE_MARKERS[m]), m) for m in modes]
        left.append(mode_keys[0])
        (right if right else left).extend(mode_keys[1:])
    # matplotlib fills a legend column by column, so the left column goes first; blanks keep the rows paired
    entries = [e or (Line2D([], [], linestyle='none'), '') for e in left + right]
    return [h for h, _ in entries], [label for _, label in entries], 2 if right else 1


def _base_label(row: Dict[str, Any]) -> str:
    """A floor's model label without 'floor(...)': a model and its floor share a color."""
    return row['model'][len('floor('):-1] if row['kind'] == 'floor' else row['model']


def image_side(row: Dict[str, Any]) -> float:
    """Where a row sits on the size axis: the side of the square with its pixel count (= the side when square)."""
    return math.sqrt(row['height'] * row['width'])


def size_tick_labels(rows: Sequence[Dict[str, Any]]) -> Dict[float, str]:
    """Axis position -> tick label, e.g. '1024 px' above '4,097 tok', for every measured size (a token range where
    the models differ)."""
    labels: Dict[float, List[str]] = {}
    for height, width in sorted({(r['height'], r['width']) for r in rows}, key=lambda hw: hw[0] * hw[1]):
        tokens = sorted({r['tokens'] for r in rows if (r['height'], r['width']) == (height, width)})
        counts = f"{tokens[0]:,}" if len(tokens) == 1 else f"{tokens[0]:,}-{tokens[-1]:,}"
        labels.setdefault(math.sqrt(height * width), []).append(f"{size_label(height, width)} px\n{counts} tok")
    return {side: '\n'.join(texts) for side, texts in labels.items()}


def _label_image_sizes(ax: Any, rows: Sequence[Dict[str, Any]]) -> None:
    """Log x axis with a tick at each measured size, labelled with pixels and tokens instead of powers of ten."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    ticks = size_tick_labels(rows)
    ax.set_xscale('log')
    ax.xaxis.set_major_locator(FixedLocator(list(ticks)))
    ax.xaxis.set_major_formatter(FixedFormatter(_staggered(ticks)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.tick_params(axis='x', labelsize=8)
    ax.set_xlabel('image size (tokens per image, class token included)')


def _plain_log_y(ax: Any) -> None:
    """Log y axis whose labels read 0.6, 2, 300 (matplotlib's default writes 6x10^-1 on short ranges)."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        # LogFormatter decides which ticks get a label (fewer minor ones on long ranges); this only writes them plainly
        def __call__(self, x: float, pos: Optional[int] = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ''

    ax.set_yscale('log')
    ax.yaxis.set_major_formatter(PlainLogFormatter(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.tick_params(axis='y', which='minor', labelsize=7)


def _staggered(ticks: Dict[float, str], min_ratio: float = 1.35) -> List[str]:
    """Tick labels in axis order, each one pushed below its left neighbour when the two sit too close to be read
    side by side (sizes such as 384x640 and 512)."""
    labels, previous, lowered = [], None, False
    for side, label in ticks.items():
        lowered = previous is not None and side / previous < min_ratio and not lowered
        labels.append('\n\n' + label if lowered else label)
        previous = side
    return labels


def memory_axis_label(rows: Sequence[Dict[str, Any]]) -> str:
    step = 'training step' if rows[0]['task'] == 'train' else 'forward'
    if str(rows[0].get('device', '')).startswith('cuda'):
        return f"MiB added by the {step}\n(GPU memory allocated above the built model)"
    return f"MiB added by the {step}\n(process RSS above the built model)"


def figure_title(rows: Sequence[Dict[str, Any]], modes: Sequence[str]) -> str:
    """What was measured and where: task, dtype, batch, modes; machine, threads, device."""
    first = rows[0]
    task = 'training step' if first['task'] == 'train' else 'inference'
    machine = next((r['machine'] for r in rows if r.get('machine')), None)
    threads = next((r['threads'] for r in rows if r.get('threads')), None)
    parts = (machine, f"{threads} threads" if threads else None, f"device {first['device']}" if first.get('device')
             else None)
    where = ', '.join(part for part in parts if part)
    return f"{task}, {first['dtype']}, batch {first['batch']}, {' and '.join(modes)}\n{where}"


# ----------------------------------------------------------------------------------------------------------------
# CLI

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--models', nargs='+', default=DEFAULT_MODELS, metavar='SPEC',
                        help='timm model specs, name[:key=value,...]')
    parser.add_argument('--floors', choices=FLOORS, default='all',
                        help='also profile the floor of every model (all), of the linvit models only, or none')
    parser.add_argument('--sizes', nargs='+', type=parse_size, metavar='SIZE',
                        help=f'image sizes, N or HxW (default: {" ".join(DEFAULT_SIZES)})')
    parser.add_argument('--batch', nargs='+', type=int, default=[1], help='batch sizes')
    parser.add_argument('--dtype', nargs='+', choices=DTYPES, default=['fp32'],
                        help='precisions: inference casts model and input, training runs under autocast')
    parser.add_argument('--mode', nargs='+', choices=MODES, default=list(MODES),
                        help='eager PyTorch, or compiled through linvit.fast (torch.compile, static shapes)')
    parser.add_argument('--task', nargs='+', choices=TASKS, default=['infer'],
                        help='infer: a forward under inference_mode; train: forward, loss and backward')
    parser.add_argument('--warmup', type=int, default=2, help='untimed calls before timing, >= 1 (the first compiles)')
    parser.add_argument('--repeats', type=int, default=5, help='timed calls per configuration')
    parser.add_argument('--compile-mode', help="torch.compile mode of compiled runs, e.g. 'reduce-overhead' (CUDA "
                        "graphs) or 'max-autotune' (default: torch's default)")
    parser.add_argument('--rounds', type=int, default=1,
                        help='run the whole sweep this many times (fresh processes each time) and report, per '
                             'configuration, the median over rounds: steadier ratios on a noisy machine')
    parser.add_argument('--device', default='cpu', help="torch device to run on, e.g. 'cpu', 'cuda', 'cuda:1'")
    parser.add_argument('--threads', type=int, help='torch.set_num_threads in each configuration (default: torch\'s)')
    parser.add_argument('--retain-freed-memory', action='store_true',
                        help='run each configuration with glibc keeping freed memory (MALLOC_MMAP_THRESHOLD_ and '
                             'MALLOC_TRIM_THRESHOLD_ = 2**34), as jemalloc/tcmalloc would: no page faults for '
                             'buffers re-allocated every call (default: the system allocator settings)')
    parser.add_argument('--timeout', type=float, default=1800.,
                        help="seconds one configuration may take (its process: build, warm-up and timed calls) "
                             "before it is stopped and recorded as 'timeout'")
    parser.add_argument('--out', help=f'directory for profile.csv and the PNGs (default: {DEFAULT_OUT}; with '
                                      f'--summarize: the folder of the CSV)')
    parser.add_argument('--summarize', metavar='CSV',
                        help="print the tables of an earlier run's CSV and plot it, run nothing")
    parser.add_argument('--child', help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.repeats < 1 or args.rounds < 1:
        parser.error('--warmup, --repeats and --rounds must be >= 1')
    if min(args.batch) < 1:
        parser.error('--batch sizes must be >= 1')
    try:
        for text in args.models:
            parse_model_spec(text)
    except ValueError as exc:
        parser.error(str(exc))
    args.sizes = args.sizes or [parse_size(s) for s in DEFAULT_SIZES]
    args.out = args.out or (os.path.dirname(os.path.abspath(args.summarize)) if args.summarize else DEFAULT_OUT)
    return args


def report(rows: List[Dict[str, Any]], out_dir: str) -> None:
    """Tables, plots, then the configurations that did not succeed (last, where a reader looks first)."""
    for line in summarize(rows):
        print(line)
    for path in plot(rows, out_dir):
        print(f"wrote {path}")
    for line in failure_lines(rows):
        print(line)


def sweep(args: argparse.Namespace, csv_path: str) -> List[Dict[str, Any]]:
    """Run every configuration (round-major) in its own process, writing rows to ``csv_path`` as they complete."""
    from tqdm import tqdm

    configs = build_configs(args)
    rows = []
    with open(csv_path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction='ignore')
        writer.writeheader()
        # round-major: a slow drift of the machine hits every configuration of a round alike
        runs = [(r, config) for r in range(args.rounds) for config in configs]
        progress = tqdm(runs, unit='config', dynamic_ncols=True)
        for round_index, config in progress:
            progress.set_description(config.describe())
            row = {'round': round_index, **run_config(config, args.timeout, args.retain_freed_memory)}
            rows.append(row)
            writer.writerow(row)
            f.flush()  # rows survive an interrupted sweep
            progress.write(f"{config.describe()}: {result_words(row)}")
    return rows


def result_words(row: Dict[str, Any]) -> str:
    if row['status'] != 'ok':
        return f"{row['status'].upper()} {row.get('error', '')}"
    return (f"{row['img_per_s']:.3f} img/s, median {row['median_ms']:.1f} ms, p90 {row['p90_ms']:.1f} ms, "
            f"peak {row['peak_mem_mib']:.0f} MiB (+{row['added_mem_mib']:.0f} MiB by the calls), "
            f"first call {row['first_call_ms']:.0f} ms")


def main(argv: Optional[List[str]] = None) -> int:
    """0 when every configuration ran (or ran out of memory or time), 1 when any failed with an error."""
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    os.makedirs(args.out, exist_ok=True)
    if args.summarize:
        report(read_csv(args.summarize), args.out)
        return 0
    csv_path = os.path.join(args.out, 'profile.csv')
    rows = sweep(args, csv_path)
    print(f"wrote {csv_path}")
    report(rows, args.out)
    return 1 if any(row['status'] == 'error' for row in rows) else 0


if __name__ == '__main__':
    sys.exit(main())
