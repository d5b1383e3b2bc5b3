"""The quality check's report: quality_check.md (the table of runs, the comparisons with their targets: linvit within
1 top-1 point of softmax at equal steps and ahead at equal seconds, the linearized model at 98% of its teacher or
more, ViT-Tiny at 85% or more; the probe's step times; also printed), quality_check.csv (one row per run) and
quality_check.png (top-1 against optimizer steps and against training seconds).
"""
from pathlib import Path
from typing import Any, Dict, List, Optional

from linvit.timing import write_csv

from ..tables import fmt, md_table
from .plan import CUT, PIPELINES, RUNS, SKIPPED, Preset, QualitySettings, RunSpec, probe_cases, run_dir
from .results import run_curve

__all__ = ['TABLE_HEADER', 'CSV_FIELDS', 'COMPARISONS', 'table_rows', 'finished_top1', 'comparison_rows', 'markdown',
           'plot_curves', 'report']


def percent(value: Optional[float]) -> Optional[float]:
    """A fraction as percent (None stays None: not measured)."""
    return None if value is None else 100 * value


TABLE_HEADER = ('model', 'px', 'compared', 'top-1 %', 'steps', 'train s', 'wall s', 'img/s', 'peak MiB', 'status')
CSV_FIELDS = ('key', 'model', 'timm_model', 'px', 'batch', 'compared', 'top1', 'steps', 'train_s', 'wall_s',
              'img_per_s', 'peak_mem_mib', 'data_wait_frac', 'status', 'planned_steps', 'planned_s', 'probe_step_s',
              'epochs', 'teacher_resized_top1', 'converted_top1', 'stage1_top1', 'teacher_input', 'run_dir')


def table_rows(records: Dict[str, Dict[str, Any]]) -> List[List[str]]:
    """The runs' table, one row per run in RUNS' order."""
    rows = []
    for spec in RUNS:
        r = records[spec.key]
        rows.append([r['model'], str(r['px']), r['compared'], fmt(percent(r.get('top1')), '.1f'),
                     fmt(r.get('steps'), ','), fmt(r.get('train_s'), '.1f'), fmt(r.get('wall_s'), '.0f'),
                     fmt(r.get('img_per_s'), ',.0f'), fmt(r.get('peak_mem_mib'), ',.0f'), r['status']])
    return rows


def finished_top1(record: Dict[str, Any]) -> Optional[float]:
    """A run's top-1 if it finished ('ok'), else None: comparisons read finished runs only."""
    return record.get('top1') if record.get('status') == 'ok' else None


#: (title, run compared, run it is compared with, how: 'points' = difference in top-1 points, 'ratio' = %, target)
COMPARISONS = (
    ('Tiny, equal steps', 'tiny/base/linvit', 'tiny/base/softmax', 'points', 'linvit within 1 point'),
    ('Small, equal steps', 'small/base/linvit', 'small/base/softmax', 'points', 'linvit within 1 point'),
    ('Tiny, equal seconds', 'tiny/high/linvit', 'tiny/high/softmax', 'points', 'linvit ahead'),
    ('Small, equal seconds', 'small/high/linvit', 'small/high/softmax', 'points', 'linvit ahead'),
    ('linearized vs its teacher at the same size', 'linearized', 'teacher/high', 'ratio', '>= 98%'),
)


def comparison_rows(records: Dict[str, Dict[str, Any]]) -> List[List[str]]:
    """One row per comparison with its target (``COMPARISONS``, then ViT-Tiny's own bar), from finished runs only (a
    cut or skipped run gives '-')."""
    rows = []
    for title, first, second, how, target in COMPARISONS:
        a, b = finished_top1(records[first]), finished_top1(records[second])
        if a is None or b is None:
            result = '-'
        elif how == 'points':
            result = f"{100 * (a - b):+.1f} points"
        else:
            result = f"{100 * a / b:.1f}%" if b > 0 else '-'
        px = records[first]['px']
        rows.append([f"{title} ({px} px)", f"{records[first]['model']} {fmt(percent(a), '.1f')}",
                     f"{records[second]['model']} {fmt(percent(b), '.1f')}", result, target])
    vit_tiny = records['tiny/base/softmax']
    top1 = percent(finished_top1(vit_tiny))
    rows.append([f"ViT-Ti alone ({vit_tiny['px']} px)", '', f"ViT-Ti {fmt(top1, '.1f')}",
                 '-' if top1 is None else f"{top1:.1f}%", '>= 85% (the recipe learns)'])
    return rows


def header_lines(settings: QualitySettings, preset: Preset, meta: Dict[str, Any], prepare_s: float,
                 wall_s: float) -> List[str]:
    """The title, the machine, preset, budget and pipeline, and how the data, recipe and steps were chosen."""
    sets = ', '.join(f"{c.px} px {10 * c.train_per_class:,} / {10 * c.val_per_class:,}"
                     for c in {c.px: c for c in preset.canvases.values()}.values())
    machine = f"{meta.get('machine', settings.device)} ({settings.device})"
    together = 'Runs ran one at a time' if preset.lanes == 1 else f"Up to {preset.lanes} runs ran side by side"
    versions = f"; torch {meta['torch']}, timm {meta['timm']}" if 'torch' in meta else ''
    return ['# linvit quality check', '',
            f"{machine}{versions}; {'quick' if settings.quick else 'full'} preset, budget {settings.budget_s:.0f} s, "
            f"wall {wall_s:.0f} s (prepare: data and probe {prepare_s:.0f} s); input pipeline "
            f"'{settings.pipeline}' ({' '.join(PIPELINES[settings.pipeline])}).", '',
            f"Data: Fashion-MNIST items alone (no clutter), upscaled 2-6x at a random place on canvases of {sets} "
            f"train / val images, from {settings.fmnist_dir}. Recipe: linvit.bench.quality.recipe.RECIPE "
            f"(configs/cls_fmnist_quality.yaml) for every trained model (lr scaled with the square root of the "
            f"batch); the linearization: LINEARIZE_RECIPE (configs/linearize_cls_fmnist.yaml). Steps: a group's "
            f"share of the time left when its first run starts, over each model's step time measured alone (below), "
            f"in whole epochs; equal steps: one schedule for both models; equal seconds: the same planned training "
            f"seconds for both, and 'train s' is what each trained (metrics.csv's train rows). {together}; '{CUT}' "
            f"and '{SKIPPED}' mark rows the budget did not hold, never estimated.", '']


def probe_rows(probe: Dict[str, Dict[str, Any]], preset: Preset) -> List[List[str]]:
    """The probe's table: ms per step and img/s of each case, or why it has none."""
    rows = []
    for case in probe_cases(preset):
        r = probe.get(case.key, {'status': 'not measured (the probe stopped at its deadline)'})
        step_s = r.get('step_s')
        rows.append([case.model + (f" + {case.convert}" if case.convert else ''), str(case.px), str(case.batch),
                     fmt(None if step_s is None else step_s * 1e3, ',.1f'),
                     fmt(None if step_s is None else case.batch / step_s, ',.0f'), r['status']])
    return rows


def markdown(records: Dict[str, Dict[str, Any]], probe: Dict[str, Dict[str, Any]], settings: QualitySettings,
             preset: Preset, prepare_s: float, wall_s: float) -> str:
    """The report's text: header, runs, comparisons, the linearization's own report, the probe."""
    lines = header_lines(settings, preset, probe.get('meta', {}), prepare_s, wall_s)
    lines += [*md_table(TABLE_HEADER, table_rows(records)), '', '## Comparisons with the targets', '',
              *md_table(('comparison', 'linvit / student top-1 %', 'softmax / teacher top-1 %', 'result', 'target'),
                        comparison_rows(records)), '']
    linearized = records['linearized']
    if linearized.get('teacher_resized_top1') is not None:
        lines += [f"The linearization's own report: teacher {fmt(percent(linearized['teacher_resized_top1']), '.1f')}% "
                  f"fed {linearized.get('teacher_input')}, converted before training "
                  f"{fmt(percent(linearized.get('converted_top1')), '.1f')}%, after stage 1 "
                  f"{fmt(percent(linearized.get('stage1_top1')), '.1f')}%.", '']
    lines += ['## Step times measured alone (the probe)', '',
              'One training step (forward, loss, backward, clipping, AdamW) on a random batch, median of '
              f"{preset.probe_repeats} after {preset.probe_warmup} warm-up steps; they plan the runs' steps.", '',
              *md_table(('model', 'px', 'batch', 'ms / step', 'img/s', 'status'), probe_rows(probe, preset)), '']
    return '\n'.join(lines)


CURVE_COLORS = {'linvit': 'tab:blue', 'softmax': 'tab:red', 'teacher': 'tab:gray', 'linearized': 'tab:green'}


def curve_style(spec: RunSpec) -> Dict[str, Any]:
    """linvit blue, softmax red, teacher grey, the linearized student green; Tiny circles, Small squares; solid at
    the base size, dashed at the high one."""
    kind = spec.key.rsplit('/', 1)[-1] if spec.group.endswith(('/base', '/high')) else spec.key
    marker = 'o' if 'tiny' in spec.model else 's'
    return {'color': CURVE_COLORS[kind], 'marker': marker, 'linestyle': '--' if spec.canvas == 'high' else '-'}


def plot_curves(settings: QualitySettings, preset: Preset, records: Dict[str, Dict[str, Any]], path: Path,
                title: str) -> None:
    """Top-1 against optimizer steps (left) and against training seconds (right): a line per run through its
    evaluations; the teacher evaluated at the high size as a horizontal line."""
    from matplotlib.figure import Figure

    from linvit.plotting import save_png

    fig = Figure(figsize=(12, 4.6))
    axes = fig.subplots(1, 2)
    for spec in RUNS:
        record = records[spec.key]
        if spec.job == 'eval':
            if record.get('top1') is not None:
                for ax in axes:
                    ax.axhline(100 * record['top1'], color=CURVE_COLORS['teacher'], linestyle=':',
                               label=f"{record['model']} at {record['px']} px (eval only)")
            continue
        points = run_curve(settings, preset, spec).points if run_dir(settings, spec).is_dir() else []
        if not points:
            continue
        steps, seconds, top1 = zip(*points)
        label = f"{record['model']} {record['px']} px"
        for ax, x in zip(axes, (steps, seconds)):
            ax.plot(x, [100 * t for t in top1], label=label, markersize=4, **curve_style(spec))
    for ax, xlabel in zip(axes, ('optimizer steps', "training seconds (metrics.csv's train rows)")):
        if not ax.lines:
            ax.text(0.5, 0.5, 'no evaluations', ha='center', va='center', transform=ax.transAxes)
        else:
            ax.legend(fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel('top-1 (%)')
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def report(settings: QualitySettings, preset: Preset, records: Dict[str, Dict[str, Any]],
           probe: Dict[str, Dict[str, Any]], prepare_s: float, wall_s: float) -> str:
    """Write quality_check.md, quality_check.csv and quality_check.png into settings.out; returns the markdown."""
    out = Path(settings.out)
    text = markdown(records, probe, settings, preset, prepare_s, wall_s)
    (out / 'quality_check.md').write_text(text + '\n')
    write_csv(str(out / 'quality_check.csv'), (records[spec.key] for spec in RUNS), CSV_FIELDS)
    machine = probe.get('meta', {}).get('machine', settings.device)
    plot_curves(settings, preset, records, out / 'quality_check.png',
                f"linvit quality check on {machine}: Fashion-MNIST items on large canvases")
    return text
