"""Rows of a profile run (one dict per configuration and round): the CSV they are kept in, rounds merged into
medians, and the printed tables (per linvit model: its floor and softmax counterpart side by side, the crossover
size, the time growth per doubling of the side; compiled / eager and bounded / eager ratios; peak memory and time
per token of every model and mode), then the configurations that failed.

Times are in ms, memory in MiB (2**20 bytes).
"""
import csv
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from linvit import timing
from linvit.timing import CpuLoad

from .cli import busy_warning, crossover
from .specs import PROFILE_MODES, counterpart, size_label

__all__ = ['CSV_FIELDS', 'write_csv', 'read_csv', 'describe_row', 'failure_lines', 'aggregate_rounds', 'group_key',
           'sweep_load', 'Table', 'model_summary', 'doublings', 'plain_summary', 'mode_summary', 'memory_summary',
           'summarize']

CSV_FIELDS = ['round', 'model', 'name', 'kwargs', 'kind', 'height', 'width', 'tokens', 'batch', 'dtype', 'mode',
              'workload', 'device', 'machine', 'compile_mode', 'rows_per_chunk', 'status', 'median_ms', 'p90_ms',
              'img_per_s', 'peak_mem_mib', 'base_mem_mib', 'added_mem_mib', 'first_call_ms', 'warmup', 'repeats',
              'threads', 'load_average', 'cores', 'allocator', 'error']
_INT_FIELDS = ('round', 'height', 'width', 'tokens', 'batch', 'warmup', 'repeats', 'threads', 'cores',
               'rows_per_chunk')
_FLOAT_FIELDS = ('median_ms', 'p90_ms', 'img_per_s', 'peak_mem_mib', 'base_mem_mib', 'added_mem_mib', 'first_call_ms',
                 'load_average')


# ------------------------------------------------------------------------------------------------------------------
# the CSV

def write_csv(path: str, rows: Iterable[Dict[str, Any]]) -> None:
    """Profile rows as CSV with the columns ``CSV_FIELDS``."""
    timing.write_csv(path, rows, CSV_FIELDS)


def read_csv(path: str) -> List[Dict[str, Any]]:
    """Rows of a profile CSV with numbers parsed (empty fields become None)."""
    rows = []
    with open(path, newline='') as f:
        for row in csv.DictReader(f):
            for key in _INT_FIELDS + _FLOAT_FIELDS:
                value = row.get(key)
                row[key] = None if value in (None, '') else (int(float(value)) if key in _INT_FIELDS else float(value))
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------------------
# failures

def describe_row(row: Dict[str, Any]) -> str:
    """'model size bBATCH dtype mode workload', e.g. 'vit_tiny_patch16_224 32 b1 float32 eager inference'."""
    return (f"{row['model']} {size_label(row['height'], row['width'])} b{row['batch']} {row['dtype']} {row['mode']} "
            f"{row['workload']}")


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


# ------------------------------------------------------------------------------------------------------------------
# rounds and groups

def aggregate_rounds(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per configuration: over its successful rounds, the median of the median and p90 latencies (img/s
    recomputed from the median), the largest peak and added memory; a configuration that never succeeded keeps its
    first failure. ``rounds`` counts the rounds that went into a row."""
    groups: Dict[Tuple[Any, ...], List[Dict[str, Any]]] = {}
    for row in rows:
        key = tuple(row[k] for k in ('model', 'height', 'width', 'batch', 'dtype', 'mode', 'workload'))
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
    """(workload, dtype, batch): rows that share a table and a figure."""
    return row['workload'], row['dtype'], row['batch']


# ------------------------------------------------------------------------------------------------------------------
# tables

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
    """Measurements of one (workload, dtype, batch, mode) group, indexed by model label and (height, width)."""
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


def _compared_columns(table: Table, linear: str) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """(softmax counterpart label or None, [(label, title)] of the columns present: linvit, floor, softmax, its
    floor)."""
    softmax_by_name = {r['name']: r['model'] for r in table.rows if r['kind'] == 'softmax'}
    linear_name = next(r['name'] for r in table.rows if r['model'] == linear)
    soft_name = counterpart(linear_name, list(softmax_by_name))
    soft = softmax_by_name.get(soft_name) if soft_name else None
    columns = [(linear, 'linvit'), (f"floor({linear})", 'floor'), (soft, 'softmax'),
               (f"floor({soft})" if soft else None, 'sm floor')]
    return soft, [(label, title) for label, title in columns if label and any(k[0] == label for k in table.by_key)]


def _compared_row(table: Table, linear: str, soft: Optional[str], columns: List[Tuple[str, str]],
                hw: Tuple[int, int]) -> str:
    floor = f"floor({linear})"
    lin, fl, sm = table.value(linear, hw), table.value(floor, hw), table.value(soft, hw)
    line = f"{size_label(*hw):>10} {table.tokens(hw) or '-':>7} "
    line += ' '.join(f"{table.cell(label, hw):>15}" for label, _ in columns)
    line += f" {_fmt_ratio(_ratio(lin, fl)):>13} {_fmt_ratio(_ratio(lin, sm)):>15}"
    line += f" {table.cell(linear, hw, 'added_mem_mib', 0):>12}"
    if soft:
        line += f" {table.cell(soft, hw, 'added_mem_mib', 0):>13}"
    peak_ratio = _ratio(table.value(linear, hw, 'peak_mem_mib'), table.value(floor, hw, 'peak_mem_mib'))
    return line + f" {_fmt_ratio(peak_ratio):>18}"


def _versus_softmax(table: Table, linear: str, soft: str) -> List[str]:
    """The crossover line and the speedup line of a linvit model against its softmax counterpart."""
    points = [(hw, table.value(linear, hw), table.value(soft, hw)) for hw in table.sizes()]
    cross = crossover(points)
    if cross is None:
        lines = [f"crossover: {linear} does not beat {soft} at the largest size measured"]
    else:
        lines = [f"crossover: {linear} beats {soft} from {size_label(*cross)} px ({table.tokens(cross)} tokens) on, "
                 f"at every larger size measured"]
    speedups = []
    for hw, lin, sm in points:
        both = lin is not None and sm is not None
        missing = f"linvit {table.status(linear, hw)}, softmax {table.status(soft, hw)}"
        speedups.append(f"{size_label(*hw)}: " + (_fmt_ratio(_ratio(lin, sm)) if both else missing))
    lines.append(f"speedup {linear} / {soft} (img/s): " + ', '.join(speedups))
    return lines


def model_summary(table: Table, linear: str) -> List[str]:
    """Lines for one linvit model: img/s of it, its floor, its softmax counterpart and that one's floor; the ratios
    linvit/floor and linvit/softmax at each size; the crossover size; the time growth per doubling of the side."""
    soft, columns = _compared_columns(table, linear)
    lines = [f"## {linear}" + (f" vs {soft}" if soft else " (no softmax counterpart in this run)")
             + "; peak linvit/floor = ratio of the timed calls' peak memory"]
    header = f"{'size':>10} {'tokens':>7} " + ' '.join(f"{title + ' img/s':>15}" for _, title in columns)
    header += f" {'linvit/floor':>13} {'linvit/softmax':>15} {'linvit +MiB':>12}"
    header += f" {'softmax +MiB':>13}" if soft else ''
    lines.append(header + f" {'peak linvit/floor':>18}")
    lines.extend(_compared_row(table, linear, soft, columns, hw) for hw in table.sizes())
    if soft:
        lines.extend(_versus_softmax(table, linear, soft))
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


def mode_summary(rows: List[Dict[str, Any]], mode: str = 'compiled') -> List[str]:
    """``mode`` / eager img/s of each model at each size, for rows of one (workload, dtype, batch) measured both
    ways (models without ``mode`` rows, e.g. softmax ones in bounded mode, are left out)."""
    eager = Table([r for r in rows if r['mode'] == 'eager'])
    other = Table([r for r in rows if r['mode'] == mode])
    labels = [label for label in dict.fromkeys(r['model'] for r in rows) if any(k[0] == label for k in other.by_key)]
    width = max([len(label) for label in labels] + [len(mode) + 6])
    lines = [f"{mode + '/eager':>{width}} " + ' '.join(f"{size_label(*hw):>9}" for hw in eager.sizes())]
    for label in labels:
        cells = [_fmt_ratio(_ratio(other.value(label, hw), eager.value(label, hw))) for hw in eager.sizes()]
        lines.append(f"{label:>{width}} " + ' '.join(f"{c:>9}" for c in cells))
    return lines


def _time_per_token_us(row: Optional[Dict[str, Any]]) -> Optional[float]:
    if not row or row.get('status') != 'ok' or not row.get('tokens'):
        return None
    return row['median_ms'] * 1e3 / (row['batch'] * row['tokens'])


def memory_summary(rows: List[Dict[str, Any]]) -> List[str]:
    """Peak memory (MiB) and time per token (us) of every model and mode at every size, for rows of one (workload,
    dtype, batch): what fits a device, and what the bounded forward's bands cost against the plain forward. A size
    where a model ran out of memory or time shows its status."""
    sizes = Table(rows).sizes()
    lines = []
    for title, value in (('peak MiB', lambda r: r.get('peak_mem_mib')), ('us/token', _time_per_token_us)):
        keys = [(label, mode) for label in dict.fromkeys(r['model'] for r in rows) for mode in PROFILE_MODES
                if any(r['model'] == label and r['mode'] == mode for r in rows)]
        names = [f"{label} [{mode}]" for label, mode in keys]
        width = max(len(name) for name in names + [title])
        lines.append(f"{title:>{width}} " + ' '.join(f"{size_label(*hw):>9}" for hw in sizes))
        for name, (label, mode) in zip(names, keys):
            by_size = {(r['height'], r['width']): r for r in rows if r['model'] == label and r['mode'] == mode}
            cells = []
            for hw in sizes:
                row = by_size.get(hw)
                number = value(row) if row and row.get('status') == 'ok' else None
                cells.append(_fmt(number, row['status'] if row else '-', 0 if title == 'peak MiB' else 3))
            lines.append(f"{name:>{width}} " + ' '.join(f"{c:>9}" for c in cells))
    return lines


def _first(rows: Sequence[Dict[str, Any]], key: str) -> Any:
    """The first non-empty value of a column (rows of one table share their machine, threads, allocator)."""
    return next((r[key] for r in rows if r.get(key)), None)


def sweep_load(rows: Sequence[Dict[str, Any]]) -> Optional[CpuLoad]:
    """The CPU load before the sweep, as its rows recorded it (None for a GPU sweep or an older CSV)."""
    row = next((r for r in rows if r.get('cores') is not None and r.get('load_average') is not None), None)
    return CpuLoad(int(row['cores']), float(row['load_average'])) if row else None


def _table_heading(table: Table, group: Tuple[str, str, int], mode: str, rounds: int) -> List[str]:
    """The table's heading line (what was measured, where, with how many threads at what load), then the
    busy-machine warning when the threads shared cores with other processes."""
    workload, dtype, batch = group
    machine, threads, allocator = (_first(table.rows, key) for key in ('machine', 'threads', 'allocator'))
    load = sweep_load(table.rows)
    heading = (f"\n# {workload}, {dtype}, batch {batch}, {mode}, {table.rows[0].get('device', '')}"
               + (f" ({machine})" if machine else '')
               + (f", {threads} threads" if threads else '')
               + (f" (load average {load.load_average:.1f} on {load.cores} cores before the sweep)" if load else '')
               + (f", allocator {allocator}" if allocator else '')
               + "; img/s = batch / median latency"
               + (f" (median over {rounds} rounds)" if rounds > 1 else '')
               + ", +MiB = memory added by the calls")
    warning = busy_warning(load, threads) if threads else None
    return [heading] + ([f"# {warning}"] if warning else [])


def summarize(rows: List[Dict[str, Any]]) -> List[str]:
    """All printed tables of a run, grouped by (workload, dtype, batch) and then mode (rounds merged by median)."""
    rounds = len({r.get('round') for r in rows})
    rows = aggregate_rounds(rows)
    lines = []
    for key in sorted({group_key(r) for r in rows}):
        group = [r for r in rows if group_key(r) == key]
        modes = [m for m in PROFILE_MODES if any(r['mode'] == m for r in group)]
        for mode in modes:
            table = Table([r for r in group if r['mode'] == mode])
            lines.extend(_table_heading(table, key, mode, rounds))
            linvit = table.labels('linvit')
            for label in linvit:
                lines.extend(model_summary(table, label))
            if not linvit:
                lines.extend(plain_summary(table))
        workload, dtype, batch = key
        for mode in modes[1:] if modes[0] == 'eager' else ():
            lines.append(f"\n# {workload}, {dtype}, batch {batch}: {mode} / eager img/s")
            lines.extend(mode_summary(group, mode))
        memory = 'GPU memory allocated' if str(group[0].get('device', '')).startswith('cuda') else 'process RSS'
        lines.append(f"\n# {workload}, {dtype}, batch {batch}: peak memory during the calls (MiB, {memory}) and "
                     f"time per token (us, median latency / (batch x tokens))")
        lines.extend(memory_summary(group))
    return lines
