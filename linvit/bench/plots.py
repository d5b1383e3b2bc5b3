"""Figures of a profile run: images/s, memory added by the calls and their peak memory against the image size,
log-log, one line per model and mode (floors dashed). Drawn with matplotlib's object API
(``matplotlib.figure.Figure``, no pyplot).

    paths = plot(rows, out_dir)          # one PNG per (workload, dtype, batch): profile_inference_float32_b1.png
    fig = throughput_figure(group)       # the Figure of one such group of successful rows
"""
import math
import os
from typing import Any, Dict, List, Sequence, Tuple

from linvit.plotting import cycle_colour, plain_log_y, save_png

from .report import aggregate_rounds, group_key
from .specs import PROFILE_MODES, size_label

__all__ = ['MODE_MARKERS', 'plot', 'throughput_figure', 'legend_entries', 'image_side', 'size_tick_labels',
           'plain_log_y', 'memory_axis_label', 'peak_axis_label', 'figure_title']

MODE_MARKERS = {'eager': 's', 'compiled': 'o', 'bounded': '^'}


def plot(rows: List[Dict[str, Any]], out_dir: str) -> List[str]:
    """One PNG per (workload, dtype, batch): img/s, added and peak memory vs image size, log-log; a line per model
    and mode. Rounds are merged first (``report.aggregate_rounds``). Returns the paths written."""
    paths = []
    rows = aggregate_rounds(rows)
    for workload, dtype, batch in sorted({group_key(r) for r in rows}):
        group = [r for r in rows if group_key(r) == (workload, dtype, batch) and r['status'] == 'ok' and r['tokens']]
        if not group:
            continue
        path = os.path.join(out_dir, f"profile_{workload}_{dtype}_b{batch}.png")
        save_png(throughput_figure(group), path, dpi=120)
        paths.append(path)
    return paths


def throughput_figure(group: List[Dict[str, Any]]) -> Any:
    """The Figure of one (workload, dtype, batch) group of successful rows: img/s, added memory and peak memory per
    image size (the peak is what must fit the device: the model, its input and the calls' own memory)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(18, 6), layout='constrained')
    ax_speed, ax_mem, ax_peak = fig.subplots(1, 3)
    base_labels = list(dict.fromkeys(_base_label(r) for r in group))
    colors = {label: cycle_colour(i) for i, label in enumerate(base_labels)}
    modes = [m for m in PROFILE_MODES if any(r['mode'] == m for r in group)]
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
            ax_peak.plot(sides, [r.get('peak_mem_mib') for r in line], **style)
    ax_speed.set_ylabel('images / s (higher is better)')
    ax_mem.set_ylabel(memory_axis_label(group))
    ax_peak.set_ylabel(peak_axis_label(group))
    for ax in (ax_speed, ax_mem, ax_peak):
        _label_image_sizes(ax, group)
        plain_log_y(ax)
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
    ax.xaxis.set_major_formatter(FixedFormatter(staggered(ticks)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.tick_params(axis='x', labelsize=8)
    ax.set_xlabel('image size (tokens per image, class token included)')


def staggered(ticks: Dict[float, str], min_ratio: float = 1.35) -> List[str]:
    """Tick labels in axis order, each one pushed below its left neighbour when the two sit too close to be read
    side by side (sizes such as 384x640 and 512)."""
    labels, previous, lowered = [], None, False
    for side, label in ticks.items():
        lowered = previous is not None and side / previous < min_ratio and not lowered
        labels.append('\n\n' + label if lowered else label)
        previous = side
    return labels


def memory_axis_label(rows: Sequence[Dict[str, Any]]) -> str:
    step = 'training step' if rows[0]['workload'] == 'training' else 'forward'
    if str(rows[0].get('device', '')).startswith('cuda'):
        return f"MiB added by the {step}\n(GPU memory allocated above the built model)"
    return f"MiB added by the {step}\n(process RSS above the built model)"


def peak_axis_label(rows: Sequence[Dict[str, Any]]) -> str:
    if str(rows[0].get('device', '')).startswith('cuda'):
        return "peak MiB during the calls\n(GPU memory allocated: model, input, calls)"
    return "peak MiB during the calls\n(process RSS: interpreter, model, input, calls)"


def figure_title(rows: Sequence[Dict[str, Any]], modes: Sequence[str]) -> str:
    """What was measured and where: workload, dtype, batch, modes; machine, threads, device."""
    first = rows[0]
    workload = {'training': 'training step', 'segmentation': 'segmentation inference'}.get(first['workload'],
                                                                                         'inference')
    machine = next((r['machine'] for r in rows if r.get('machine')), None)
    threads = next((r['threads'] for r in rows if r.get('threads')), None)
    parts = (machine, f"{threads} threads" if threads else None, f"device {first['device']}" if first.get('device')
             else None)
    where = ', '.join(part for part in parts if part)
    return f"{workload}, {first['dtype']}, batch {first['batch']}, {' and '.join(modes)}\n{where}"
