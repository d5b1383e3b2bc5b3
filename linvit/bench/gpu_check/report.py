"""The GPU check's report: markdown tables (also printed), one CSV row per record, and img/s against image size.

    text = report(records, settings, preset, sections, wall_s)   # writes gpu_check.md, .csv and _throughput.png
"""
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Protocol, Sequence

from linvit.timing import write_csv

from ..specs import WORKLOADS
from ..tables import fmt, md_table
from .plan import (
    KINDS,
    MODEL_LABELS,
    SECTIONS,
    SKIPPED,
    TOLERANCES,
    TORCH_PATH,
    CheckSettings,
    Preset,
    plan_op,
    plan_parity,
)

__all__ = ['PARITY_HEADER', 'OP_HEADER', 'MODELS_HEADER', 'SectionTimes', 'markdown', 'report', 'failed',
           'models_rows', 'csv_fields']


class SectionTimes(Protocol):
    """What the report reads of a section's process (``runner.Section``): when it ran and whether it was stopped."""
    name: str
    started: float
    ended: Optional[float]
    killed: bool


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, or None when either is missing (or b is 0)."""
    return None if a is None or b is None or b == 0 else a / b


PARITY_HEADER = ('dtype', 'tokens', 'shape', 'kernel', 'out', 'dq', 'dk', 'dv', 'tol', 'status')
OP_HEADER = ('tokens', 'pass', 'kernel', 'kernel ms', 'torch ms', 'SDPA ms', 'SDPA/kernel', 'torch/kernel',
             'kernel GPU ms', 'launches', 'status')
MODELS_HEADER = ('model', 'px (tokens)', 'workload', 'batch', 'linvit img/s', 'softmax img/s', 'floor img/s',
                 'linvit/softmax', 'linvit/floor', 'linvit/torch-path', 'peak GiB linvit, softmax, floor',
                 'first call s linvit', 'status')


def parity_rows(records: Dict[str, Dict[str, Any]], preset: Preset) -> List[List[str]]:
    """The parity table's rows, in the plan's order."""
    rows = []
    for case in plan_parity(preset):
        r = records[case.key]
        b, h, d = preset.parity_shape
        errors = [fmt(r.get(f"err_{name}"), '.1e') for name in ('out', 'dq', 'dk', 'dv')]
        rows.append([case.dtype + (' + mask' if case.mask else ''), str(case.tokens), f"B{b}-H{h}-D{d}",
                     r.get('kernel', '-'), *errors, fmt(TOLERANCES[case.dtype], '.0e'), r['status']])
    return rows


def op_rows(records: Dict[str, Dict[str, Any]], preset: Preset) -> List[List[str]]:
    """The op table's rows, in the plan's order."""
    rows = []
    for case in plan_op(preset):
        r = records[case.key]
        rows.append([str(case.tokens), 'fwd+bwd' if case.backward else 'fwd', r.get('kernel', '-'),
                     fmt(r.get('kernel_ms'), '.3f'), fmt(r.get('torch_ms'), '.3f'), fmt(r.get('sdpa_ms'), '.3f'),
                     fmt(r.get('sdpa_over_kernel'), '.2f'), fmt(r.get('torch_over_kernel'), '.2f'),
                     fmt(r.get('gpu_ms'), '.3f'), fmt(r.get('launches'), '.0f'), r['status']])
    return rows


def _ok(record: Optional[Dict[str, Any]], field: str) -> Optional[float]:
    # a FAIL row (a linvit step that fell back to the PyTorch path) was measured: its figures are shown
    return record.get(field) if record is not None and record.get('status') in ('ok', 'FAIL') else None


def models_rows(records: Dict[str, Dict[str, Any]], preset: Preset) -> List[List[str]]:
    """One row per (model, px, workload): img/s of each kind, their ratios, peaks, problems."""
    rows = []
    for size, px in preset.models:
        for workload in WORKLOADS:
            got = {kind: records.get(f"models/{size}/{px}/{workload}/{kind}") for kind in (*KINDS, TORCH_PATH)}
            speed = {kind: _ok(record, 'img_per_s') for kind, record in got.items()}
            peaks = '/'.join(fmt(None if _ok(got[k], 'peak_mem_mib') is None else got[k]['peak_mem_mib'] / 1024,
                                 '.1f') for k in KINDS)
            tokens = next((r['tokens'] for r in got.values() if r and r.get('tokens')), None)
            problems = [f"{kind}: {r['status']}" + (f" ({r['problem']})" if r.get('problem') else '')
                        for kind, r in got.items() if r is not None and r['status'] != 'ok']
            rows.append([MODEL_LABELS[size], f"{px} ({fmt(tokens, ',')})", workload,
                         str(preset.batches[size][px]), *(fmt(speed[k], ',.1f') for k in KINDS),
                         fmt(ratio(speed['linvit'], speed['softmax']), '.2f'),
                         fmt(ratio(speed['linvit'], speed['floor']), '.2f'),
                         fmt(ratio(speed['linvit'], speed[TORCH_PATH]), '.2f'), peaks,
                         fmt(_ok(got['linvit'], 'first_call_s'), '.1f'), '; '.join(problems) or 'ok'])
    return rows


def header_lines(records: Dict[str, Dict[str, Any]], settings: CheckSettings, sections: Sequence[SectionTimes],
                 wall_s: float) -> List[str]:
    """The title, the machine and versions, the preset, budget and the seconds each section took."""
    meta = next((r for k, r in records.items() if k.startswith('meta/')), None)
    lines = ['# linvit GPU check', '']
    if meta is not None:
        lines.append(f"{meta['machine']} ({meta['device']}); torch {meta['torch']}, triton {meta['triton']}, "
                     f"timm {meta['timm']}; kernel: linvit.ops.linear_attention_op.")
    spent = ', '.join(f"{s.name} {(s.ended or time.time()) - s.started:.0f} s"
                      f"{' (stopped at its deadline)' if s.killed else ''}" for s in sections)
    lines += [f"{'quick' if settings.quick else 'full'} preset, budget {settings.budget:.0f} s, wall {wall_s:.0f} s "
              f"({spent}); '{SKIPPED}' marks rows that did not fit their section's budget.", '']
    return lines


SECTION_TITLES = {
    'parity': ('1. Kernel parity against float64', 'relative max error max|x - ref| / max|ref| of the output and '
               'the gradients, against linvit.ops.linear_attention on float64 copies of the same inputs'),
    'op': ('2. Op time', 'median ms, bfloat16 inputs; ratios above 1: the kernel is faster'),
    'models': ('3. Whole models', 'training: compiled step (forward, cross-entropy, backward; bfloat16 autocast); '
               "inference: compiled forward, bfloat16 weights, mode='reduce-overhead' (CUDA graphs); ratios of "
               'img/s; floor = linvit without token mixing; torch-path = linvit with attn_backend=torch; peak = '
               'timed steps'),
}
SECTION_TABLES = {'parity': (PARITY_HEADER, parity_rows), 'op': (OP_HEADER, op_rows),
                  'models': (MODELS_HEADER, models_rows)}


def markdown(records: Dict[str, Dict[str, Any]], settings: CheckSettings, preset: Preset,
             sections: Sequence[SectionTimes], wall_s: float) -> str:
    """The report's text: the header, then each chosen section's title, words and table."""
    lines = header_lines(records, settings, sections, wall_s)
    for name in SECTIONS:
        if name not in settings.sections:
            continue
        title, words = SECTION_TITLES[name]
        header, rows = SECTION_TABLES[name]
        lines += [f"## {title}", '', words + '.', '', *md_table(header, rows(records, preset)), '']
    return '\n'.join(lines)


def csv_fields(records: Iterable[Dict[str, Any]]) -> List[str]:
    """The union of the records' fields, first seen first: gpu_check.csv's columns."""
    fields: Dict[str, None] = {}
    for record in records:
        fields.update(dict.fromkeys(record))
    return list(fields)


def plot_throughput(records: Dict[str, Dict[str, Any]], path: Path, title: str, cuda: bool) -> None:
    """img/s against the image side, log-log: training (left) and inference (right); a line per model and kind."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    from linvit.plotting import plain_log_y, save_png

    colors = {'linvit': 'tab:blue', 'softmax': 'tab:red', 'floor': 'tab:gray', TORCH_PATH: 'tab:cyan'}
    styles = {'small': '-', 'base': '--'}
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    ok = [r for r in records.values() if r['section'] == 'models' and r['status'] == 'ok']
    for ax, workload in zip(axes, WORKLOADS):
        for size in styles:
            for kind, color in colors.items():
                points = sorted((r['px'], r['img_per_s']) for r in ok
                                if r['workload'] == workload and r['size'] == size and r['kind'] == kind)
                if points:
                    ax.plot(*zip(*points), styles[size], color=color, marker='o',
                            label=f"{MODEL_LABELS[size]} {kind.replace('linvit_torch', 'linvit torch-path')}")
        if ax.lines:
            sides = sorted({r['px'] for r in ok})
            ax.set_xscale('log')
            ax.xaxis.set_major_locator(FixedLocator(sides))
            ax.xaxis.set_major_formatter(FixedFormatter([str(side) for side in sides]))
            ax.xaxis.set_minor_locator(NullLocator())
            plain_log_y(ax)
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, 'no measurements', ha='center', va='center', transform=ax.transAxes)
        ax.set_xlabel('image side (px)')
        ax.set_ylabel('images / s')
        ax.set_title('training step' if workload == 'training' else f"inference{' (CUDA graphs)' if cuda else ''}")
        ax.grid(True, which='both', alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def failed(records: Dict[str, Dict[str, Any]]) -> List[str]:
    """'key: status' of every row that FAILed or errored: what makes the check's exit status 1."""
    return [f"{key}: {r['status']}" for key, r in records.items() if r['status'] == 'FAIL'
            or r['status'].startswith('error')]


def report(records: Dict[str, Dict[str, Any]], settings: CheckSettings, preset: Preset,
           sections: Sequence[SectionTimes], wall_s: float) -> str:
    """Write gpu_check.md, gpu_check.csv and gpu_check_throughput.png into settings.out; returns the markdown."""
    out = Path(settings.out)
    text = markdown(records, settings, preset, sections, wall_s)
    (out / 'gpu_check.md').write_text(text + '\n')
    write_csv(str(out / 'gpu_check.csv'), records.values(), csv_fields(records.values()))
    meta = next((r for k, r in records.items() if k.startswith('meta/')), {})
    plot_throughput(records, out / 'gpu_check_throughput.png',
                    f"linvit GPU check: {meta.get('machine', settings.device)}, bfloat16",
                    settings.device.startswith('cuda'))
    return text
