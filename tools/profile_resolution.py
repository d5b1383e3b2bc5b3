#!/usr/bin/env python
"""Whole models at growing image sizes: linvit vs timm softmax ViTs vs their floors, eager vs compiled.

For every configuration (model, image size, batch, precision, eager|compiled, infer|train) a fresh Python process
builds the model with ``timm.create_model(name, img_size=(H, W), pretrained=False)``, runs warm-up calls (the first
one compiles, its time is reported apart), then times ``--repeats`` calls: median and p90 latency, images/s, and
peak memory (CPU: the process's peak RSS, which includes the interpreter and, when compiled, the compiler; CUDA:
``torch.cuda.max_memory_allocated``). The floor of a model is the same model with token mixing removed
(``linvit.fast.make_floor``; ``--floors all|linear|none``): what any attention must pay at least. Compiled runs
go through ``linvit.fast`` (static shapes: each configuration compiles its own graph in its own process).
A configuration that runs out of memory or time is recorded as such and the sweep goes on. ``--rounds R`` runs
the sweep R times (round after round) and reports each configuration's median over rounds: processes differ (memory
placement, the machine's other load), so one process per configuration needs rounds to give steady ratios.
``--retain-freed-memory`` runs every configuration with glibc keeping freed memory (``RETAIN_FREED_MEMORY_ENV``):
by default it hands large freed buffers back to the system and faults fresh pages in when the next call allocates
them again, a per-process cost that moves CPU figures by 10-20% (the ``allocator`` column records the setting).

Rows go to ``OUT/profile.csv`` as they complete; then, per (task, precision, batch, mode), a table per linvit model
(its floor and its softmax counterpart side by side: img/s, ratios linvit/floor and linvit/softmax), the crossover
size from which linvit beats softmax, the time growth per doubling of the image side, and compiled/eager ratios;
``OUT/profile_<task>_<dtype>_b<batch>.png`` plots img/s and peak memory against tokens (log-log, floors dashed).

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
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

DTYPES = ('fp32', 'bf16', 'fp16')
MODES = ('eager', 'compiled')
TASKS = ('infer', 'train')
FLOORS = ('all', 'linear', 'none')
DEFAULT_MODELS = ['linvit_small_patch16_224', 'vit_small_patch16_224']
DEFAULT_SIZES = ['224', '512', '1024', '2048']
RESULT_MARK = 'PROFILE_RESULT '
CSV_FIELDS = ['round', 'model', 'name', 'kwargs', 'kind', 'height', 'width', 'tokens', 'batch', 'dtype', 'mode',
              'task', 'device', 'compile_mode', 'status', 'median_ms', 'p90_ms', 'img_per_s', 'peak_mem_mb',
              'base_mem_mb', 'first_call_s', 'warmup', 'repeats', 'threads', 'allocator', 'error']
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
        return (f"{self.model.label} {size_label(self.height, self.width)} b{self.batch} {self.dtype} {self.mode} "
                f"{self.task}")


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

def _peak_rss_mb() -> float:
    import resource

    # ru_maxrss is in KiB on Linux, bytes on macOS
    scale = 1 / 1024 ** 2 if sys.platform == 'darwin' else 1 / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


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

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base_mem = torch.cuda.memory_allocated(device) / 2 ** 20 if cuda else _peak_rss_mb()
    first_call = timed()  # the first warm-up call: compiles in compiled mode
    for _ in range(config.warmup - 1):
        timed()
    times = [timed() for _ in range(config.repeats)]
    median = statistics.median(times)
    return {
        'tokens': tokens,
        'median_ms': median * 1e3,
        'p90_ms': percentile(times, 90) * 1e3,
        'img_per_s': config.batch / median,
        'peak_mem_mb': torch.cuda.max_memory_allocated(device) / 2 ** 20 if cuda else _peak_rss_mb(),
        'base_mem_mb': base_mem,
        'first_call_s': first_call,
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


def child_main(config_json: str) -> int:
    """Run one configuration and print its result as one JSON line (errors too: the parent records them)."""
    config = Config.from_json(config_json)
    try:
        result = {'status': 'ok', **measure(config)}
    except Exception as exc:  # noqa: BLE001  (any failure becomes a row, not a crashed sweep)
        message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        oom = type(exc).__name__ == 'OutOfMemoryError' or 'out of memory' in str(exc).lower()
        result = {'status': 'oom' if oom else 'error', 'error': message[:300]}
    print(RESULT_MARK + json.dumps(result), flush=True)
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
        row.update(status='error', error=f"exit {proc.returncode}: {tail[:300]}")
    return row


# ----------------------------------------------------------------------------------------------------------------
# rows: CSV, comparisons, tables

def write_csv(path: str, rows: Iterable[Dict[str, Any]]) -> None:
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction='ignore')
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: str) -> List[Dict[str, Any]]:
    """Rows of a profile CSV with numbers parsed (empty fields become None)."""
    ints = ('round', 'height', 'width', 'tokens', 'batch', 'warmup', 'repeats', 'threads')
    floats = ('median_ms', 'p90_ms', 'img_per_s', 'peak_mem_mb', 'base_mem_mb', 'first_call_s')
    rows = []
    with open(path, newline='') as f:
        for raw in csv.DictReader(f):
            row: Dict[str, Any] = dict(raw)
            for key in ints + floats:
                value = row.get(key)
                row[key] = None if value in (None, '') else (int(float(value)) if key in ints else float(value))
            rows.append(row)
    return rows


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


def crossover(points: Sequence[Tuple[Any, Optional[float], Optional[float]]]) -> Optional[Any]:
    """First key from which ``a`` beats ``b`` at that and every later key; points = (key, a img/s, b img/s) sorted by
    size. A missing ``b`` (softmax out of memory or time) counts as a win for ``a``, a missing ``a`` as a loss."""
    result = None
    for key, a, b in reversed(points):
        if a is None or (b is not None and a <= b):
            break
        result = key
    return result


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
    lines = [f"## {linear}" + (f" vs {soft}" if soft else " (no softmax counterpart in this run)")]
    header = f"{'size':>10} {'tokens':>7} " + ' '.join(f"{title + ' img/s':>15}" for _, title in columns)
    header += f" {'linvit/floor':>13} {'linvit/softmax':>15} {'linvit MiB':>11}"
    header += f" {'softmax MiB':>12}" if soft else ''
    lines.append(header)
    points = []
    for hw in table.sizes():
        lin, fl, sm = table.value(linear, hw), table.value(floor, hw), table.value(soft, hw)
        points.append((hw, lin, sm))
        line = f"{size_label(*hw):>10} {table.tokens(hw) or '-':>7} "
        line += ' '.join(f"{table.cell(label, hw):>15}" for label, _ in columns)
        line += f" {_fmt_ratio(_ratio(lin, fl)):>13} {_fmt_ratio(_ratio(lin, sm)):>15}"
        line += f" {table.cell(linear, hw, 'peak_mem_mb', 0):>11}"
        if soft:
            line += f" {table.cell(soft, hw, 'peak_mem_mb', 0):>12}"
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
    recomputed from the median), the largest peak memory; a configuration that never succeeded keeps its first
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
            row['first_call_s'] = statistics.median(r['first_call_s'] for r in ok)
            row['peak_mem_mb'] = max(r['peak_mem_mb'] for r in ok)
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
            threads = next((r['threads'] for r in table.rows if r.get('threads')), None)
            allocator = next((r['allocator'] for r in table.rows if r.get('allocator')), None)
            lines.append(f"\n# {task}, {dtype}, batch {batch}, {mode}, {device}"
                         + (f", {threads} threads" if threads else '')
                         + (f", allocator {allocator}" if allocator else '') + "; img/s = batch / median latency"
                         + (f" (median over {rounds} rounds)" if rounds > 1 else ''))
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
    """One PNG per (task, dtype, batch): img/s and peak memory vs tokens, log-log; a line per model and mode."""
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    paths = []
    rows = aggregate_rounds(rows)
    for task, dtype, batch in sorted({group_key(r) for r in rows}):
        group = [r for r in rows if group_key(r) == (task, dtype, batch) and r['status'] == 'ok' and r['tokens']]
        if not group:
            continue
        fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(13, 5))
        base_labels = list(dict.fromkeys(r['model'][len('floor('):-1] if r['kind'] == 'floor' else r['model']
                                         for r in group))
        colors = {label: f"C{i % 10}" for i, label in enumerate(base_labels)}
        modes = sorted({r['mode'] for r in group})
        for label in dict.fromkeys(r['model'] for r in group):
            for mode in modes:
                line = sorted((r for r in group if r['model'] == label and r['mode'] == mode),
                              key=lambda r: r['tokens'])
                if not line:
                    continue
                is_floor = line[0]['kind'] == 'floor'
                style = dict(color=colors[label[len('floor('):-1] if is_floor else label],
                             linestyle='--' if is_floor else '-', marker='o' if mode == 'compiled' else 's',
                             alpha=1.0 if mode == 'compiled' or len(modes) == 1 else 0.6,
                             label=label + (f" [{mode}]" if len(modes) > 1 else ''))
                tokens = [r['tokens'] for r in line]
                ax_speed.plot(tokens, [r['img_per_s'] for r in line], **style)
                ax_mem.plot(tokens, [r['peak_mem_mb'] for r in line], **style)
        device = group[0].get('device', '')
        mem_name = 'peak GPU memory allocated' if str(device).startswith('cuda') else 'peak process RSS'
        for ax, ylabel in ((ax_speed, 'images / s'), (ax_mem, f"{mem_name} (MiB)")):
            ax.set_xscale('log')
            ax.set_yscale('log')
            ax.set_xlabel('tokens per image')
            ax.set_ylabel(ylabel)
            ax.grid(True, which='both', alpha=0.3)
        ax_speed.legend(fontsize=7)
        fig.suptitle(f"{task}, {dtype}, batch {batch}, {device} (floors dashed)")
        fig.tight_layout()
        path = os.path.join(out_dir, f"profile_{task}_{dtype}_b{batch}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------------------------------
# CLI

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', nargs='+', default=DEFAULT_MODELS,
                        help=f'timm model specs, name[:key=value,...] (default {" ".join(DEFAULT_MODELS)})')
    parser.add_argument('--floors', choices=FLOORS, default='all',
                        help='also profile the floor of every model (all), of the linvit models only, or none')
    parser.add_argument('--sizes', nargs='+', type=parse_size, default=[parse_size(s) for s in DEFAULT_SIZES],
                        help=f'image sizes, N or HxW (default {" ".join(DEFAULT_SIZES)})')
    parser.add_argument('--batch', nargs='+', type=int, default=[1])
    parser.add_argument('--dtype', nargs='+', choices=DTYPES, default=['fp32'])
    parser.add_argument('--mode', nargs='+', choices=MODES, default=list(MODES))
    parser.add_argument('--task', nargs='+', choices=TASKS, default=['infer'])
    parser.add_argument('--warmup', type=int, default=2, help='untimed calls before timing, >= 1 (the first compiles)')
    parser.add_argument('--repeats', type=int, default=5, help='timed calls per configuration')
    parser.add_argument('--compile-mode', help="torch.compile mode of compiled runs, e.g. 'reduce-overhead' (CUDA "
                        "graphs) or 'max-autotune' (default: torch's default)")
    parser.add_argument('--rounds', type=int, default=1,
                        help='run the whole sweep this many times (fresh processes each time) and report, per '
                             'configuration, the median over rounds: steadier ratios on a noisy machine')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--threads', type=int, help='torch.set_num_threads in each configuration (default: torch\'s)')
    parser.add_argument('--retain-freed-memory', action='store_true',
                        help='run each configuration with glibc keeping freed memory (MALLOC_MMAP_THRESHOLD_ and '
                             'MALLOC_TRIM_THRESHOLD_ = 2**34), as jemalloc/tcmalloc would: no page faults for '
                             'buffers re-allocated every call (default: the system allocator settings)')
    parser.add_argument('--timeout', type=float, default=1800., help='seconds per configuration before it is marked')
    parser.add_argument('--out', default=os.path.join(tempfile.gettempdir(), 'linvit_profile_resolution'),
                        help='directory for profile.csv and the PNGs')
    parser.add_argument('--summarize', metavar='CSV', help='print tables and plot an earlier run\'s CSV, run nothing')
    parser.add_argument('--child', help=argparse.SUPPRESS)
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
    return args


def report(rows: List[Dict[str, Any]], out_dir: str) -> None:
    for line in summarize(rows):
        print(line)
    for path in plot(rows, out_dir):
        print(f"wrote {path}")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    os.makedirs(args.out, exist_ok=True)
    if args.summarize:
        report(read_csv(args.summarize), args.out)
        return 0
    from tqdm import tqdm

    configs = build_configs(args)
    csv_path = os.path.join(args.out, 'profile.csv')
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
            if row['status'] == 'ok':
                result = (f"{row['img_per_s']:.3f} img/s, median {row['median_ms']:.1f} ms, "
                          f"p90 {row['p90_ms']:.1f} ms, peak {row['peak_mem_mb']:.0f} MiB, "
                          f"first call {row['first_call_s']:.1f} s")
            else:
                result = f"{row['status'].upper()} {row.get('error', '')}"
            progress.write(f"{config.describe()}: {result}")
    print(f"wrote {csv_path}")
    report(rows, args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
