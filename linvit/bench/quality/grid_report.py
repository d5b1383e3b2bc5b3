"""The quality grid's report: quality_grid.md (the command that reproduces it, then one table per task: a row per
configuration and local mix with the mean and spread of its metric over the seeds that finished, its training img/s
and its gap to softmax; the runs that did not finish and why; also printed), quality_grid.csv (one row per run) and
quality_grid.png (a bar per row with the seeds' standard deviation as error bars, a panel per task).
"""
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from linvit.timing import write_csv

from ..tables import fmt, md_table
from .grid import TASKS, GridPreset, GridSettings, GridTask

__all__ = ['CSV_FIELDS', 'Summary', 'summarize', 'summary_rows', 'markdown', 'plot_grid', 'grid_report']

CSV_FIELDS = ('config', 'task', 'local_mix', 'seed', 'metric', 'img_per_s', 'seconds', 'status', 'model', 'kwargs',
              'px', 'batch', 'planned_steps', 'steps', 'train_s', 'run_dir')


@dataclass(frozen=True)
class Summary:
    """One row of a task's table: a configuration and local mix over its seeds (metric values as fractions)."""
    config: str
    local_mix: Optional[bool]
    values: Sequence[float]          # the metric of every run that finished
    runs: int                        # runs started (finished or not)
    img_per_s: Optional[float]       # mean over the finished runs
    softmax_mean: Optional[float]    # the softmax row's mean on the same task

    @property
    def mean(self) -> Optional[float]:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> Optional[float]:
        """The sample standard deviation over the seeds (None below two)."""
        return statistics.stdev(self.values) if len(self.values) >= 2 else None

    @property
    def gap_points(self) -> Optional[float]:
        """mean - softmax's mean, in points (percent of the metric); None when either has no finished run."""
        if self.mean is None or self.softmax_mean is None:
            return None
        return 100 * (self.mean - self.softmax_mean)


def summarize(records: Sequence[Dict[str, Any]], task: str) -> List[Summary]:
    """The rows of ``task``'s table in the runs' order, from its records (a failed run counts in ``runs`` only)."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for record in records:
        if record['task'] == task:
            groups.setdefault((record['config'], record['local_mix']), []).append(record)
    finished = {key: [r for r in rows if r['status'] == 'ok'] for key, rows in groups.items()}
    softmax = [r['metric'] for r in finished.get(('softmax', None), [])]
    softmax_mean = statistics.fmean(softmax) if softmax else None
    rows = []
    for key, runs in groups.items():
        speeds = [r['img_per_s'] for r in finished[key] if r.get('img_per_s') is not None]
        rows.append(Summary(key[0], key[1], [r['metric'] for r in finished[key]], len(runs),
                            statistics.fmean(speeds) if speeds else None, softmax_mean))
    return rows


def local_mix_words(local_mix: Optional[bool]) -> str:
    return '-' if local_mix is None else ('on' if local_mix else 'off')


def percent(value: Optional[float]) -> Optional[float]:
    return None if value is None else 100 * value


def summary_rows(rows: Sequence[Summary]) -> List[List[str]]:
    """A task's table: metric mean, std and min-max in percent, img/s, gap to softmax in points."""
    table = []
    for row in rows:
        spread = (f"{100 * min(row.values):.1f}-{100 * max(row.values):.1f}" if row.values else '-')
        gap = '(reference)' if row.config == 'softmax' else fmt(row.gap_points, '+.1f')
        table.append([row.config, local_mix_words(row.local_mix), f"{len(row.values)}/{row.runs}",
                      fmt(percent(row.mean), '.1f'), fmt(percent(row.std), '.1f'), spread,
                      fmt(row.img_per_s, ',.0f'), gap])
    return table


def task_section(task: GridTask, preset: GridPreset, records: Sequence[Dict[str, Any]]) -> List[str]:
    """A task's heading, its sizes and steps, its table."""
    dataset = preset.dataset(task.name)
    local_mix = ('every linear configuration with local mix on and off' if len(task.local_mix) > 1
                 else 'linear configurations with local mix on only (the CPU grid stays within the hour)')
    header = ('configuration', 'local mix', 'seeds finished', f"{task.metric_label} mean", 'std', 'min-max', 'img/s',
              'gap to softmax (points)')
    return [f"## {task.name.capitalize()}", '',
            f"{dataset.px} px, batch {dataset.batch}, {preset.steps[task.name]} steps a run; {local_mix}. "
            f"std: over the seeds that finished (sample standard deviation); img/s: training images per second "
            f"(metrics.csv's train rows), mean over those seeds.", '',
            *md_table(header, summary_rows(summarize(records, task.name))), '']


def markdown(settings: GridSettings, preset: GridPreset, records: Sequence[Dict[str, Any]], wall_s: float) -> str:
    """The report's text: the command, what was trained, a table per task, the runs that did not finish."""
    seeds = sorted({r['seed'] for r in records})
    kwargs = ', '.join(f"{k}={v}" for k, v in preset.model_kwargs) or 'none'
    lines = ['# linvit quality grid', '', 'Reproduce:', '', '```bash', settings.command(), '```', '',
             f"Grid '{preset.name}' on {settings.device}, {len(records)} runs in {wall_s:.0f} s, one at a time, each "
             f"its own process (stopped after {preset.run_timeout_s:.0f} s). Seeds {', '.join(map(str, seeds))}; "
             f"kwargs of every model: {kwargs}. The same recipe, steps and seeds for every configuration "
             f"(classification: linvit.bench.quality.recipe.RECIPE; segmentation: SEG_RECIPE, the mlp head), "
             f"Fashion-MNIST canvases from {settings.fmnist_dir}. linvit-Ti with model.kwargs per configuration "
             f"against timm's vit_tiny_patch16_224 ('softmax').", '']
    for task in TASKS:
        lines += task_section(task, preset, records)
    failed = [r for r in records if r['status'] != 'ok']
    if failed:
        lines += ['## Runs that did not finish', '',
                  *md_table(('task', 'configuration', 'local mix', 'seed', 'status'),
                            [[r['task'], r['config'], local_mix_words(r['local_mix']), str(r['seed']), r['status']]
                             for r in failed]), '']
    return '\n'.join(lines)


BAR_COLORS = {None: 'tab:red', True: 'tab:blue', False: 'lightsteelblue'}


def plot_grid(records: Sequence[Dict[str, Any]], path: Path, title: str) -> None:
    """A panel per task: a bar per configuration and local mix at its mean (percent), the seeds' standard deviation
    as its error bar; softmax red, local mix on blue, off light blue; a row with no finished run has no bar."""
    from matplotlib.figure import Figure

    from linvit.plotting import save_png

    fig = Figure(figsize=(13, 4.8))
    for ax, task in zip(fig.subplots(1, len(TASKS)), TASKS):
        rows = summarize(records, task.name)
        x = range(len(rows))
        means = [percent(r.mean) if r.mean is not None else 0.0 for r in rows]
        errors = [percent(r.std) or 0.0 for r in rows]
        ax.bar(x, means, yerr=errors, capsize=3, color=[BAR_COLORS[r.local_mix] for r in rows])
        ax.set_xticks(list(x), [f"{r.config}{'' if r.local_mix is None else ' ' + local_mix_words(r.local_mix)}"
                                f"{'' if r.values else ' (failed)'}" for r in rows], rotation=60, ha='right',
                      fontsize=7)
        ax.set_ylabel(task.metric_label)
        ax.set_title(task.name, fontsize=9)
        ax.grid(True, axis='y', alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def grid_report(settings: GridSettings, preset: GridPreset, records: Sequence[Dict[str, Any]], wall_s: float) -> str:
    """Write quality_grid.md, quality_grid.csv and quality_grid.png into settings.out; returns the markdown."""
    out = Path(settings.out)
    text = markdown(settings, preset, records, wall_s)
    (out / 'quality_grid.md').write_text(text + '\n')
    write_csv(str(out / 'quality_grid.csv'), records, CSV_FIELDS)
    plot_grid(records, out / 'quality_grid.png',
              f"linvit quality grid '{preset.name}' on {settings.device}: mean over seeds, error bars: std")
    return text
