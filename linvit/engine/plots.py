"""PNG pictures for a run directory: training curves from ``metrics.csv``, a grid of predictions, segmentation masks
in solid class colours beside their images, and a confusion matrix.

Figures are drawn on ``matplotlib.figure.Figure`` objects, never through pyplot (``linvit.plotting`` holds the
helpers this module shares with the benchmarks' plots). Files are written atomically
(``linvit.engine.checkpoint.atomic_write``), so a viewer never sees half a PNG.
"""
import csv
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from ..plotting import cycle_colour, save_png
from .checkpoint import atomic_write

__all__ = ['CORRECT_COLOUR', 'WRONG_COLOUR', 'IGNORE_COLOUR', 'plot_curves', 'plot_prediction_grid', 'class_palette',
           'ignore_colour', 'colour_mask', 'overlay_mask', 'plot_segmentation_grid', 'plot_confusion_matrix',
           'plot_detection_grid', 'PICTURE_MIN_SCORE', 'plot_depth_grid', 'depth_colours', 'depth_colour_range']

CORRECT_COLOUR = '#1a7f37'
WRONG_COLOUR = '#cf222e'

#: columns of metrics.csv that locate a row rather than measure something
_KEY_COLUMNS = ('epoch', 'step', 'split')
#: smoothed series (train loss) longer than this get a moving average drawn over the raw values
_SMOOTH_ABOVE = 20
_MAX_NAME_CHARS = 22


@dataclass
class _Series:
    label: str
    steps: np.ndarray         # [P] x values
    values: np.ndarray        # [P] y values
    markers: bool = False     # points matter (few, e.g. one per epoch) rather than the trend of many
    smooth: bool = False      # noisy per-step values: draw a moving average over the faint raw line


@dataclass
class _Panel:
    title: str
    ylabel: str
    series: List[_Series] = field(default_factory=list)


def _read_metrics_csv(csv_path: os.PathLike) -> Tuple[List[str], List[Dict[str, str]]]:
    with open(csv_path, newline='', encoding='utf-8') as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def _to_float(cell: Optional[str]) -> float:
    try:
        return float(cell)
    except (TypeError, ValueError):
        return math.nan


def _column(rows: List[Dict[str, str]], split: str, column: str) -> Tuple[np.ndarray, np.ndarray]:
    """(steps [P], values [P]) of ``column`` over the rows of ``split`` whose step and value are numbers."""
    pairs = [(_to_float(row.get('step')), _to_float(row.get(column))) for row in rows if row.get('split') == split]
    pairs = [(s, v) for s, v in pairs if math.isfinite(s) and math.isfinite(v)]
    steps, values = zip(*pairs) if pairs else ((), ())
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def _is_fraction(values: np.ndarray) -> bool:
    return values.size > 0 and bool(np.all((values >= 0) & (values <= 1)))


def _loss_panel(rows: List[Dict[str, str]]) -> _Panel:
    panel = _Panel('loss', 'loss')
    for split in ('train', 'val'):
        steps, values = _column(rows, split, 'loss')
        if steps.size:
            panel.series.append(_Series(f'{split} loss', steps, values, markers=split == 'val' or steps.size == 1,
                                        smooth=split == 'train'))
    return panel


def _val_metrics_panel(rows: List[Dict[str, str]], metric_columns: List[str]) -> _Panel:
    columns = [(c, *_column(rows, 'val', c)) for c in metric_columns if c != 'loss']
    columns = [(c, steps, values) for c, steps, values in columns if steps.size]
    # accuracies (top-k, IoU, ...) arrive as fractions; people read them as percent
    as_percent = bool(columns) and all(_is_fraction(values) for _, _, values in columns)
    panel = _Panel('validation metrics', 'percent' if as_percent else 'value')
    for column, steps, values in columns:
        label = f'{column} (%)' if as_percent else column
        panel.series.append(_Series(label, steps, values * 100 if as_percent else values, markers=True))
    return panel


def _lr_panel(rows: List[Dict[str, str]]) -> _Panel:
    panel = _Panel('learning rate', 'learning rate')
    steps, values = _column(rows, 'train', 'lr')
    if steps.size:
        panel.series.append(_Series('lr', steps, values, markers=steps.size == 1))
    return panel


def _curve_panels(fieldnames: List[str], rows: List[Dict[str, str]]) -> List[_Panel]:
    """The panels worth drawing: loss (train and val), every other val metric, the train learning rate; a panel
    without data is left out."""
    metric_columns = [c for c in fieldnames if c not in _KEY_COLUMNS]
    panels = [_loss_panel(rows), _val_metrics_panel(rows, metric_columns), _lr_panel(rows)]
    return [p for p in panels if p.series]


def _centred_moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Mean over ``window`` values centred on each one, [P] -> [P]; the window shrinks at both ends.

    Centred rather than trailing: a trailing mean lags the raw curve and draws a fast early drop late."""
    cumulative = np.concatenate([[0.0], np.cumsum(values)])
    centres = np.arange(values.size)
    starts = np.maximum(centres - window // 2, 0)
    ends = np.minimum(centres + window // 2 + 1, values.size)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def _draw_series(ax, series: _Series, colour: str) -> None:
    if series.markers:
        ax.plot(series.steps, series.values, marker='o', markersize=4, linewidth=1.5, color=colour, label=series.label)
    elif series.smooth and series.steps.size > _SMOOTH_ABOVE:
        window = max(series.steps.size // 25, 5) | 1
        ax.plot(series.steps, series.values, linewidth=0.8, alpha=0.3, color=colour)
        ax.plot(series.steps, _centred_moving_average(series.values, window), linewidth=1.8, color=colour,
                label=f'{series.label} (mean of {window})')
    else:
        ax.plot(series.steps, series.values, linewidth=1.5, color=colour, label=series.label)


def _draw_panel(ax, panel: _Panel) -> None:
    from matplotlib.ticker import MaxNLocator

    for i, series in enumerate(panel.series):
        _draw_series(ax, series, cycle_colour(i))
    ax.set_title(panel.title, fontsize=11, loc='left')
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    # offsets and scientific notation ("1e-3" in a corner) are easy to misread on a curve
    ax.ticklabel_format(axis='both', style='plain', useOffset=False)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc='upper left', bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=9, frameon=False)


def _widen_a_single_step(ax, panels: List[_Panel]) -> None:
    # matplotlib pads one x value by +-5%, which labels a lone step 1 as 0.945 ... 1.05
    steps = np.concatenate([series.steps for panel in panels for series in panel.series])
    if steps.max() - steps.min() < 2:
        ax.set_xlim(steps.min() - 1, steps.max() + 1)


def _save_png(fig, png_path: os.PathLike, dpi: int) -> None:
    with atomic_write(png_path) as f:
        save_png(fig, f, dpi)


def plot_curves(csv_path: os.PathLike, png_path: os.PathLike, title: str = '') -> None:
    """Draw the training curves of a ``metrics.csv`` into ``png_path`` (written atomically).

    The CSV has columns ``epoch, step, split`` (split 'train' or 'val') and numeric metric columns, empty where a
    row has no value (train rows: loss, lr, img_per_s, ...; val rows: loss, top1, top5, ...). Panels, all against
    the global step: train and val loss; every other val metric (shown in percent when all are fractions in [0, 1]);
    the learning rate. Panels without data are left out, so a CSV with only train rows, one row, or no rows draws.
    """
    from matplotlib.figure import Figure

    fieldnames, rows = _read_metrics_csv(csv_path)
    panels = _curve_panels(fieldnames, rows)
    fig = Figure(figsize=(8.5, 0.6 + 2.9 * max(len(panels), 1)), layout='constrained')
    if not panels:
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, f'no metrics yet in {os.path.basename(csv_path)}', ha='center', va='center')
        ax.set_axis_off()
    else:
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        for ax, panel in zip(axes, panels):
            _draw_panel(ax, panel)
        axes[-1].set_xlabel('step')
        _widen_a_single_step(axes[-1], panels)
    if title:
        fig.suptitle(title, fontsize=12)
    _save_png(fig, png_path, dpi=110)


def _unnormalise(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """images [N, C, H, W] normalised as (x - mean) / std -> numpy [N, H, W, C] in [0, 1] (C is 1 or 3)."""
    images = images.detach().to('cpu', torch.float32)
    mean = torch.as_tensor(mean, dtype=torch.float32).reshape(1, -1, 1, 1)
    std = torch.as_tensor(std, dtype=torch.float32).reshape(1, -1, 1, 1)
    return (images * std + mean).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def _class_name(class_names: Optional[Sequence[str]], index: int) -> str:
    name = str(class_names[index]) if class_names is not None and 0 <= index < len(class_names) else str(index)
    return name if len(name) <= _MAX_NAME_CHARS else name[:_MAX_NAME_CHARS - 1] + '…'


def _predicted_probability(probs: Optional[torch.Tensor], i: int, predicted: int) -> Optional[float]:
    if probs is None:
        return None
    return float(probs[i, predicted]) if probs.ndim == 2 else float(probs[i])


def _prediction_titles(true_labels: Sequence[int], pred_labels: Sequence[int], class_names: Optional[Sequence[str]],
                       probs: Optional[torch.Tensor]) -> List[Tuple[str, str]]:
    titles = []
    for i, (true, predicted) in enumerate(zip(true_labels, pred_labels)):
        title = f'true: {_class_name(class_names, true)}\npred: {_class_name(class_names, predicted)}'
        probability = _predicted_probability(probs, i, predicted)
        if probability is not None:
            title += f' (p={probability:.2f})'
        titles.append((title, CORRECT_COLOUR if true == predicted else WRONG_COLOUR))
    return titles


def plot_prediction_grid(images: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                         true_labels: Sequence[int], pred_labels: Sequence[int], class_names: Optional[Sequence[str]],
                         png_path: os.PathLike, probs: Optional[torch.Tensor] = None,
                         max_images: int = 16) -> List[Tuple[str, str]]:
    """Draw the first ``max_images`` images with their true and predicted classes into ``png_path`` (atomically).

    images [N, C, H, W] float, normalised as (x - mean) / std with per-channel ``mean`` and ``std`` (C = 3, or 1 for
    grey); true_labels, pred_labels: [N] class indices (tensors or sequences); class_names: index -> name (None:
    indices are shown); probs: optional [N] probability of the predicted class, or [N, num_classes] probabilities.
    Each image is titled "true: X / pred: Y (p=0.93)" on two lines, green (``CORRECT_COLOUR``) when the prediction
    is right, red (``WRONG_COLOUR``) when wrong. Returns [(title, colour)] for the images drawn, in grid order.
    """
    from matplotlib.figure import Figure

    count = min(int(images.shape[0]), max_images)
    true_labels = [int(t) for t in true_labels[:count]]
    pred_labels = [int(p) for p in pred_labels[:count]]
    probs = torch.as_tensor(probs[:count]).detach().cpu().float() if probs is not None else None
    titles = _prediction_titles(true_labels, pred_labels, class_names, probs)
    pictures = _unnormalise(images[:count], mean, std)

    columns = max(math.ceil(math.sqrt(count)), 1)
    rows = max(math.ceil(count / columns), 1)
    fig = Figure(figsize=(2.3 * columns, 2.6 * rows), layout='constrained')
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes:
        ax.set_axis_off()
    for ax, picture, (title, colour) in zip(axes, pictures, titles):
        grey = picture.shape[-1] == 1
        ax.imshow(picture[..., 0] if grey else picture, cmap='gray' if grey else None, vmin=0, vmax=1,
                  interpolation='nearest')
        ax.set_title(title, color=colour, fontsize=9, fontweight='bold')
    if count == 0:
        axes[0].text(0.5, 0.5, 'no images', ha='center', va='center')
    _save_png(fig, png_path, dpi=100)
    return titles


# --- semantic segmentation ---------------------------------------------------------------------------------------

#: matplotlib's tab20, its ten strong colours first and then their light partners, so that a few classes get
#: clearly different hues (tab20 itself alternates strong and light versions of one hue)
_TAB20_REORDERED = (
    '#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22', '#17becf',
    '#aec7e8', '#ffbb78', '#98df8a', '#ff9896', '#c5b0d5', '#c49c94', '#f7b6d2', '#c7c7c7', '#dbdb8d', '#9edae5',
)
#: images and masks larger than this (pixels, longer side) are shrunk for display: the PNG stays small and fast
_MAX_DISPLAY_SIDE = 512
#: above this many classes the legend lists only the classes present in the drawn masks
_LEGEND_ALL_UP_TO = 20
#: the colour of ignore_index pixels in the mask panels: a neutral that ``class_palette`` never gives a class (its
#: channels are never all 255); ``ignore_colour`` picks another grey when a dataset's own palette uses white
IGNORE_COLOUR = (255, 255, 255)


#: classes up to this many get colours chosen to be far apart (CIELAB); above, the extra ones are only distinct
_SPREAD_CLASSES = 256
#: the colours the spread ones are chosen from: every 17th level of each channel (16 ** 3 candidates)
_CANDIDATE_LEVELS = np.arange(0, 256, 17)


def _bit_interleaved_colour(index: int) -> Tuple[int, int, int]:
    """PASCAL VOC's colour map: the bits of ``index`` dealt round-robin to R, G, B from the high bit down. A
    bijection on 0..2**24 - 1, so distinct ids give distinct colours."""
    r = g = b = 0
    for shift in range(8):
        r |= ((index >> (3 * shift)) & 1) << (7 - shift)
        g |= ((index >> (3 * shift + 1)) & 1) << (7 - shift)
        b |= ((index >> (3 * shift + 2)) & 1) << (7 - shift)
    return r, g, b


def srgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """sRGB uint8 [..., 3] -> CIELAB (D65) float64 [..., 3]: Euclidean distance there is the perceived difference
    (CIE76 delta E; about 2.3 is just noticeable)."""
    c = np.asarray(rgb, dtype=np.float64) / 255
    linear = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    to_xyz = np.array([[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750],
                       [0.0193339, 0.1191920, 0.9503041]])
    xyz = linear @ to_xyz.T / np.array([0.95047, 1.0, 1.08883])  # relative to the D65 white
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], axis=-1)


_spread: Optional[np.ndarray] = None


def _spread_colours() -> np.ndarray:
    """uint8 [_SPREAD_CLASSES - 21, 3]: the colours of classes 21 .. _SPREAD_CLASSES - 1, each the candidate
    farthest (CIELAB) from black, white (the ignore colour), the tab20 colours and the colours before it: greedy
    farthest-point sampling, so every prefix is as spread as this greedy choice makes it. Computed once."""
    global _spread
    if _spread is None:
        grid = np.stack(np.meshgrid(_CANDIDATE_LEVELS, _CANDIDATE_LEVELS, _CANDIDATE_LEVELS, indexing='ij'), -1)
        candidates = grid.reshape(-1, 3)
        lab = srgb_to_lab(candidates)
        taken = [(0, 0, 0), (255, 255, 255)] + [_hex_rgb(h) for h in _TAB20_REORDERED]
        nearest = np.linalg.norm(lab[:, None] - srgb_to_lab(np.array(taken))[None], axis=-1).min(axis=1)
        chosen = []
        for _ in range(_SPREAD_CLASSES - len(taken) + 1):  # + 1: white is not a class
            pick = int(nearest.argmax())
            chosen.append(candidates[pick])
            nearest = np.minimum(nearest, np.linalg.norm(lab - lab[pick], axis=-1))
        _spread = np.asarray(chosen, dtype=np.uint8)
    return _spread


def _hex_rgb(colour: str) -> Tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def class_palette(num_classes: int) -> np.ndarray:
    """Fixed colours per class id, the same in every run: uint8 [num_classes, 3] RGB.

    Class 0 is black (often the background); classes 1..20 get matplotlib's tab20 colours (the ten strong ones
    first); classes 21..255 get colours chosen far from black, white and every earlier colour in CIELAB (greedy
    farthest-point: the smallest difference between any two of the first 256 is delta E 13.3, between neighbours
    18.9; up to 100 classes it is tab20's own 16.6; never white, the ignore colour). Classes from 256 on get PASCAL
    VOC's bit-interleaved colours in id order, skipping those already used: all distinct up to 2 ** 24 - 257
    classes, though no longer far apart. The default of a dataset without a ``palette`` of its own (see
    ``plot_segmentation_grid``).
    """
    if num_classes < 0:
        raise ValueError(f'num_classes must be >= 0, got {num_classes}')
    colours = [(0, 0, 0)] + [_hex_rgb(h) for h in _TAB20_REORDERED]
    colours += [tuple(int(v) for v in c) for c in _spread_colours()[:max(0, num_classes - len(colours))]]
    used, index = set(colours) | {IGNORE_COLOUR}, 1
    while len(colours) < num_classes:
        colour = _bit_interleaved_colour(index)
        index += 1
        if colour not in used:
            colours.append(colour)
            used.add(colour)
    return np.asarray(colours[:num_classes], dtype=np.uint8).reshape(num_classes, 3)


def ignore_colour(palette: np.ndarray) -> Tuple[int, int, int]:
    """The neutral colour for ignore_index pixels next to ``palette`` (uint8 [K, 3]): white, else black, else the
    brightest grey that no class uses (white again in the unlikely case that every grey is a class colour)."""
    used = {tuple(int(v) for v in colour) for colour in np.asarray(palette).reshape(-1, 3)}
    for level in (255, 0, *range(254, 0, -1)):
        if (level, level, level) not in used:
            return level, level, level
    return IGNORE_COLOUR


def _as_numpy(array: Union[np.ndarray, torch.Tensor]) -> np.ndarray:
    return array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)


def _check_palette(palette: Union[np.ndarray, Sequence], num_classes: int) -> np.ndarray:
    """palette [P, 3] with integer values 0..255 (array, tensor or nested lists), P >= num_classes -> uint8 [P, 3]."""
    array = _as_numpy(palette)
    if array.ndim != 2 or array.shape[1] != 3 or array.shape[0] < num_classes:
        raise ValueError(f'palette must be [K >= {num_classes}, 3] RGB colours, one per class, got shape {array.shape}')
    if array.size and (array.min() < 0 or array.max() > 255 or not np.all(array == np.round(array))):
        raise ValueError('palette values must be integers in 0..255 (uint8 RGB)')
    return array.astype(np.uint8)


def _check_mask_values(mask: np.ndarray, num_colours: int, ignore_index: int) -> np.ndarray:
    """bool [H, W], True where ``mask`` is labelled (not ``ignore_index``); ValueError naming a labelled value
    outside 0..num_colours-1."""
    labelled = mask != ignore_index
    bad = labelled & ((mask < 0) | (mask >= num_colours))
    if bad.any():
        raise ValueError(f'mask value {int(mask[bad][0])} is outside 0..{num_colours - 1} and is not ignore_index='
                         f'{ignore_index}')
    return labelled


def colour_mask(mask: Union[np.ndarray, torch.Tensor], palette: np.ndarray, ignore_index: int = 255,
                ignored_rgb: Optional[Sequence[int]] = None) -> np.ndarray:
    """Paint class ids in solid colours: mask int [H, W], palette uint8 [K, 3] -> uint8 [H, W, 3], a pixel of class
    c exactly ``palette[c]``, an ``ignore_index`` pixel ``ignored_rgb`` (default ``ignore_colour(palette)``). A mask
    value outside 0..K-1 (and not ``ignore_index``) raises ValueError naming it."""
    mask = _as_numpy(mask).astype(np.int64, copy=False)
    if mask.ndim != 2:
        raise ValueError(f'mask must be [H, W] class ids, got shape {mask.shape}')
    palette = np.asarray(palette, dtype=np.uint8)
    labelled = _check_mask_values(mask, len(palette), ignore_index)
    ignored_rgb = ignore_colour(palette) if ignored_rgb is None else ignored_rgb
    colours = palette[np.where(labelled, mask, 0)] if len(palette) else np.zeros(mask.shape + (3,), np.uint8)
    return np.where(labelled[..., None], colours, np.asarray(ignored_rgb, dtype=np.uint8))


def overlay_mask(image_rgb: Union[np.ndarray, torch.Tensor], mask: Union[np.ndarray, torch.Tensor],
                 palette: np.ndarray, alpha: float = 0.5, ignore_index: int = 255) -> np.ndarray:
    """Blend class colours into an image (``linvit.predict``'s overlay files): image_rgb float [H, W, 3] in [0, 1],
    mask int [H, W] class ids, palette uint8 [K, 3] -> float [H, W, 3]. A pixel of class c becomes
    (1 - alpha) * image + alpha * palette[c] / 255; pixels whose mask is ``ignore_index`` keep the image unchanged.
    A mask value outside 0..K-1 (and not ``ignore_index``) raises ValueError naming it."""
    image = _as_numpy(image_rgb)
    mask = _as_numpy(mask).astype(np.int64, copy=False)
    if image.ndim != 3 or image.shape[-1] != 3 or mask.shape != image.shape[:2]:
        raise ValueError(f'image_rgb must be [H, W, 3] and mask [H, W] of the same size, got {image.shape} and '
                         f'{mask.shape}')
    palette = np.asarray(palette)
    labelled = _check_mask_values(mask, len(palette), ignore_index)
    image = image.astype(np.result_type(image.dtype, np.float32), copy=False)
    colours = palette[np.where(labelled, mask, 0)].astype(image.dtype) / 255
    return np.where(labelled[..., None], (1 - alpha) * image + alpha * colours, image)


def _display_size(height: int, width: int) -> Tuple[int, int]:
    scale = min(1.0, _MAX_DISPLAY_SIDE / max(height, width, 1))
    return max(round(height * scale), 1), max(round(width * scale), 1)


def _shrink_mask(mask: np.ndarray, size: Tuple[int, int]) -> np.ndarray:
    """Nearest-neighbour resize of mask [H, W] to ``size``: class ids are never blended into ids that aren't there.
    Samples at the centres of the output pixels."""
    rows = ((np.arange(size[0]) + 0.5) * mask.shape[0] / size[0]).astype(np.int64)
    cols = ((np.arange(size[1]) + 0.5) * mask.shape[1] / size[1]).astype(np.int64)
    return mask[rows[:, None], cols[None, :]]


def _display_image(image: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                   size: Tuple[int, int]) -> np.ndarray:
    """image [C, H, W] normalised -> RGB float [h, w, 3] in [0, 1] at ``size`` (area-averaged when shrunk)."""
    image = torch.as_tensor(image).detach().to('cpu', torch.float32)[None]
    if tuple(image.shape[-2:]) != size:
        image = F.interpolate(image, size=size, mode='area')
    picture = _unnormalise(image, mean, std)[0]
    return np.repeat(picture, 3, axis=-1) if picture.shape[-1] == 1 else picture


def _pixel_accuracy_text(true_mask: np.ndarray, pred_mask: np.ndarray, ignore_index: int) -> str:
    labelled = true_mask != ignore_index
    if not labelled.any():
        return 'no labelled pixels'
    return f'pixel acc {100 * float((pred_mask[labelled] == true_mask[labelled]).mean()):.1f}%'


def _present_classes(masks: List[np.ndarray], num_classes: int, ignore_index: int) -> List[int]:
    counts = np.zeros(num_classes, dtype=np.int64)
    for mask in masks:
        labels = mask[(mask != ignore_index) & (mask >= 0) & (mask < num_classes)]
        counts += np.bincount(labels.reshape(-1), minlength=num_classes)[:num_classes]
    return np.flatnonzero(counts).tolist()


def _count_classes(class_names: Optional[Sequence[str]], masks: List[np.ndarray], ignore_index: int) -> int:
    if class_names is not None:
        return len(class_names)
    labels = [int(m[m != ignore_index].max()) for m in masks if (m != ignore_index).any()]
    return max(labels, default=0) + 1


@dataclass
class _SegRow:
    """One row of the grid: the image and its two masks, painted at display size (all [h, w, 3])."""
    image: np.ndarray        # float in [0, 1]
    truth: np.ndarray        # uint8, solid class colours
    prediction: np.ndarray   # uint8, solid class colours
    accuracy_text: str


def _segmentation_row(row: int, image: torch.Tensor, true_mask: np.ndarray, pred_mask: np.ndarray,
                      mean: Sequence[float], std: Sequence[float], palette: np.ndarray, ignore_index: int,
                      ignored_rgb: Tuple[int, int, int]) -> _SegRow:
    if true_mask.shape != tuple(image.shape[-2:]) or pred_mask.shape != true_mask.shape:
        raise ValueError(f'image {row} is {tuple(image.shape[-2:])} but its masks are {true_mask.shape} (truth) '
                         f'and {pred_mask.shape} (prediction)')
    size = _display_size(*true_mask.shape)
    return _SegRow(_display_image(image, mean, std, size),
                   colour_mask(_shrink_mask(true_mask, size), palette, ignore_index, ignored_rgb),
                   colour_mask(_shrink_mask(pred_mask, size), palette, ignore_index, ignored_rgb),
                   # from the full-size masks: shrinking would drop thin structures
                   _pixel_accuracy_text(true_mask, pred_mask, ignore_index))


def _show_panel(ax, pixels: np.ndarray, title: str) -> None:
    # a thin frame instead of no axes: a mask region in the page's own white (ignored pixels) keeps its edge
    ax.set_axis_on()
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_linewidth(0.5)
    # nearest: every screen pixel is one mask pixel's colour, exactly the legend's patch
    ax.imshow(pixels, interpolation='nearest', resample=False)
    ax.set_title(title, fontsize=9)


def _legend_entries(class_names: Optional[Sequence[str]], masks: List[np.ndarray], num_classes: int,
                    palette: np.ndarray, ignore_index: int,
                    ignored_rgb: Tuple[int, int, int]) -> List[Tuple[str, np.ndarray]]:
    """(label, uint8 RGB) per legend patch: every class when K <= 20, else those in ``masks``; then 'ignored (255)'
    when a drawn mask has ignore_index pixels."""
    shown = range(num_classes) if num_classes <= _LEGEND_ALL_UP_TO else _present_classes(masks, num_classes,
                                                                                         ignore_index)
    entries = [(_class_name(class_names, c), palette[c]) for c in shown]
    if any((mask == ignore_index).any() for mask in masks):
        entries.append((f'ignored ({ignore_index})', np.asarray(ignored_rgb, dtype=np.uint8)))
    return entries


def plot_segmentation_grid(images: Union[torch.Tensor, Sequence[torch.Tensor]], mean: Sequence[float],
                           std: Sequence[float], true_masks: Union[torch.Tensor, Sequence], pred_masks:
                           Union[torch.Tensor, Sequence], class_names: Optional[Sequence[str]],
                           png_path: os.PathLike, ignore_index: int = 255, max_images: int = 4,
                           palette: Optional[Union[np.ndarray, Sequence]] = None) -> List[str]:
    """Draw the first ``max_images`` images with their ground truth and predicted masks into ``png_path``
    (atomically).

    images: [N, C, H, W] tensor or a list of [C, H, W] tensors (sizes may differ), normalised as (x - mean) / std
    (C = 3, or 1 for grey); true_masks, pred_masks: [N, H, W] or lists of [H, W] integer class ids (tensors or
    arrays), each the size of its image; class_names: id -> name (None: ids, K from the largest id); palette: uint8
    [K, 3] RGB per class id, e.g. a dataset's ``palette`` attribute (None: ``class_palette(K)``).

    One row per image: the image | the ground truth | the prediction, titled with its pixel accuracy. The two mask
    panels are solid class colours, not blended with the image, so a region's colour is exactly its legend patch;
    ground-truth ``ignore_index`` pixels are painted ``ignore_colour(palette)`` (white unless the palette uses it).
    Images with a side above 512 px are shrunk for display (area average; masks nearest). The legend below the grid
    shows a patch and name per class (every class when K <= 20, else those present in the drawn masks), then
    'ignored (<ignore_index>)' when a drawn ground truth has such pixels. Returns the legend labels, in order.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    count = min(len(images), max_images)
    true_list = [_as_numpy(true_masks[i]).astype(np.int64, copy=False) for i in range(count)]
    pred_list = [_as_numpy(pred_masks[i]).astype(np.int64, copy=False) for i in range(count)]
    num_classes = _count_classes(class_names, true_list + pred_list, ignore_index)
    palette = class_palette(num_classes) if palette is None else _check_palette(palette, num_classes)
    ignored_rgb = ignore_colour(palette)

    fig = Figure(figsize=(3 * 2.6, 0.9 + 2.6 * max(count, 1)), layout='constrained')
    axes = fig.subplots(max(count, 1), 3, squeeze=False)
    for ax in axes.ravel():
        ax.set_axis_off()
    for row in range(count):
        drawn = _segmentation_row(row, images[row], true_list[row], pred_list[row], mean, std, palette, ignore_index,
                                  ignored_rgb)
        _show_panel(axes[row, 0], np.clip(drawn.image, 0, 1), 'image')
        _show_panel(axes[row, 1], drawn.truth, 'ground truth')
        _show_panel(axes[row, 2], drawn.prediction, f'prediction ({drawn.accuracy_text})')
    if count == 0:
        axes[0, 1].text(0.5, 0.5, 'no images', ha='center', va='center')

    entries = _legend_entries(class_names, true_list + pred_list, num_classes, palette, ignore_index, ignored_rgb)
    if entries:
        handles = [Patch(facecolor=rgb / 255, edgecolor='black', linewidth=0.5, label=label) for label, rgb in entries]
        fig.legend(handles=handles, loc='outside lower center', ncol=min(len(handles), 5), fontsize=8, frameon=False,
                   title='classes', title_fontsize=8)
    _save_png(fig, png_path, dpi=100)
    return [label for label, _ in entries]


# --- depth -------------------------------------------------------------------------------------------------------

#: one colour map for ground truth and prediction (near: bright, far: dark, as depth papers draw them), and the
#: relative error's (0: white)
_DEPTH_CMAP = 'magma_r'
_ERROR_CMAP = 'Reds'


def depth_colour_range(truth: np.ndarray) -> Tuple[float, float]:
    """(vmin, vmax) of a row's colour map: the 2nd and 98th percentiles of the ground truth's valid (finite, > 0)
    pixels, so that a few outliers do not wash the map out; (1, 2) without any."""
    valid = truth[np.isfinite(truth) & (truth > 0)]
    if valid.size == 0:
        return 1.0, 2.0
    low, high = np.percentile(valid, [2, 98])
    return float(low), float(max(high, low + 1e-6))


def depth_colours(values: np.ndarray, low: float, high: float) -> np.ndarray:
    """RGBA float [..., 4] of positive values [...] (depths) in the depth colour map, near (small) bright, on a log
    scale from ``low`` to ``high`` (values outside are clipped to them): near pixels, which most images are full of,
    get most of the colours. NaN stays the colour map's 'bad' colour."""
    from matplotlib import colormaps
    span = np.log(high) - np.log(low)
    return colormaps[_DEPTH_CMAP]((np.log(np.clip(values, low, high)) - np.log(low)) / span)


def plot_depth_grid(images: Sequence[torch.Tensor], mean: Sequence[float], std: Sequence[float],
                    truths: Sequence[Union[np.ndarray, torch.Tensor]],
                    predictions: Sequence[Union[np.ndarray, torch.Tensor]], png_path: os.PathLike,
                    label: str = 'depth', max_images: int = 4) -> None:
    """Draw the first ``max_images`` images with their depth maps into ``png_path`` (atomically): per row the image |
    the ground truth | the prediction | the relative error |prediction - truth| / truth, ground truth and prediction
    in one colour map over the ground truth's range (``depth_colour_range``, log scale), titled with the row's
    AbsRel.

    images: [C, H, W] tensors normalised as (x - mean) / std; truths: [H, W] with NaN where the pixel is invalid
    (drawn white); predictions: [H, W], each its image's size; label: what the maps hold ('depth', 'disparity')."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    count = min(len(images), max_images)
    fig = Figure(figsize=(4 * 2.6, 0.5 + 2.6 * max(count, 1)), layout='constrained')
    axes = fig.subplots(max(count, 1), 4, squeeze=False)
    for ax in axes.ravel():
        ax.set_axis_off()
    for row in range(count):
        truth = _as_numpy(truths[row]).astype(np.float64)
        predicted = _as_numpy(predictions[row]).astype(np.float64)
        if truth.shape != tuple(images[row].shape[-2:]) or predicted.shape != truth.shape:
            raise ValueError(f'image {row} is {tuple(images[row].shape[-2:])} but its depth maps are {truth.shape} '
                             f'(truth) and {predicted.shape} (prediction)')
        size = _display_size(*truth.shape)
        low, high = depth_colour_range(truth)
        error = np.abs(predicted - truth) / truth
        colours = [depth_colours(m, low, high) for m in (truth, predicted)]
        colours.append(colormaps[_ERROR_CMAP](np.clip(np.nan_to_num(error, nan=0.0), 0, 1)))
        for colour, source in zip(colours, (truth, predicted, error)):
            colour[~np.isfinite(source)] = 1.0  # invalid ground truth: white
        abs_rel = float(np.nanmean(error)) if np.isfinite(error).any() else math.nan
        _show_panel(axes[row, 0], np.clip(_display_image(images[row], mean, std, size), 0, 1), 'image')
        _show_panel(axes[row, 1], _shrink_mask(colours[0], size), f'ground truth ({low:.3g}-{high:.3g})')
        _show_panel(axes[row, 2], _shrink_mask(colours[1], size), f'prediction ({label})')
        _show_panel(axes[row, 3], _shrink_mask(colours[2], size), f'relative error (AbsRel {abs_rel:.3f})')
    if count == 0:
        axes[0, 1].text(0.5, 0.5, 'no images', ha='center', va='center')
    _save_png(fig, png_path, dpi=100)


# --- confusion matrix --------------------------------------------------------------------------------------------

#: counts are written into the cells up to this many classes, class names on the axes up to _NAMED_UP_TO
_ANNOTATED_UP_TO = 20
_NAMED_UP_TO = 50
#: the colour map of the row fractions (0: near white, 1: dark blue), and of rows without samples
_CONFUSION_CMAP = 'Blues'
_EMPTY_ROW_COLOUR = '#d9d9d9'


def _row_fractions(matrix: np.ndarray) -> np.ndarray:
    """counts [K, K] -> float64 [K, K], each row divided by its sum (the diagonal is each class's recall); NaN in a
    row without samples."""
    totals = matrix.sum(axis=1, keepdims=True)
    with np.errstate(invalid='ignore', divide='ignore'):
        return np.where(totals > 0, matrix / np.maximum(totals, 1), math.nan)


def _compact_count(count: int) -> str:
    """12, 3.4k, 56M: a pixel count of segmentation must fit in a cell."""
    for limit, suffix in ((10 ** 9, 'G'), (10 ** 6, 'M'), (10 ** 3, 'k')):
        if count >= limit:
            value = count / limit
            return f'{value:.1f}{suffix}' if value < 10 else f'{value:.0f}{suffix}'
    return str(count)


def _annotate_counts(ax, matrix: np.ndarray, fractions: np.ndarray) -> None:
    size = 9 if len(matrix) <= 10 else 7
    for (true, predicted), count in np.ndenumerate(matrix):
        # white on dark cells, black on light ones and on the grey of empty rows
        dark = fractions[true, predicted] > 0.5
        ax.text(predicted, true, _compact_count(int(count)), ha='center', va='center', fontsize=size,
                color='white' if dark else 'black')


def _name_axes(ax, class_names: Optional[Sequence[str]], num_classes: int) -> None:
    ax.set_xlabel('predicted class')
    ax.set_ylabel('true class')
    if num_classes > _NAMED_UP_TO:
        return
    names = [_class_name(class_names, c) for c in range(num_classes)]
    ax.set_xticks(range(num_classes), names, rotation=45, ha='right', rotation_mode='anchor', fontsize=8)
    ax.set_yticks(range(num_classes), names, fontsize=8)


def plot_confusion_matrix(matrix: Union[np.ndarray, torch.Tensor], class_names: Optional[Sequence[str]],
                          png_path: os.PathLike) -> None:
    """Draw a confusion matrix into ``png_path`` (atomically).

    matrix: int [K, K] counts (tensor or array), row = true class, column = predicted class (as
    ``ClassificationMeter.confusion()`` and ``SegmentationMeter.confusion()`` give it); class_names: K names (None:
    ids). A cell's colour is its fraction of the row (of the true class's samples: the diagonal is each class's
    recall), so rare classes read as well as common ones; a row without samples is grey. The counts are written in
    the cells when K <= 20, the class names on the axes when K <= 50.
    """
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    matrix = _as_numpy(matrix)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f'matrix must be a square [K, K] of counts, got shape {matrix.shape}')
    num_classes = matrix.shape[0]
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(f'{len(class_names)} class names for a {num_classes} x {num_classes} matrix')
    matrix = matrix.astype(np.int64)
    fractions = _row_fractions(matrix)

    side = min(max(2.5 + 0.45 * num_classes, 4.5), 14.0)
    fig = Figure(figsize=(side + 1.2, side), layout='constrained')
    ax = fig.add_subplot()
    cmap = colormaps[_CONFUSION_CMAP].with_extremes(bad=_EMPTY_ROW_COLOUR)
    shown = ax.imshow(fractions, cmap=cmap, vmin=0, vmax=1, interpolation='nearest')
    fig.colorbar(shown, ax=ax, shrink=0.8, label='fraction of the true class')
    if 0 < num_classes <= _ANNOTATED_UP_TO:
        _annotate_counts(ax, matrix, fractions)
    _name_axes(ax, class_names, num_classes)
    total = int(matrix.sum())
    accuracy = f', accuracy {100 * np.trace(matrix) / total:.1f}%' if total else ''
    ax.set_title(f'confusion matrix ({_compact_count(total)} counted{accuracy})', fontsize=11)
    _save_png(fig, png_path, dpi=100)


#: detections scored below this are not drawn (an evaluation scores them all; a picture shows the confident ones)
PICTURE_MIN_SCORE = 0.3


def _draw_boxes(ax, boxes: torch.Tensor, labels: torch.Tensor, class_names: Optional[Sequence[str]], colour: str,
                scores: Optional[torch.Tensor] = None) -> None:
    """Rectangles for boxes [N, 4] x1, y1, x2, y2 pixels, each named by its label (1..K: class_names[label - 1])."""
    from matplotlib.patches import Rectangle
    for index, ((x1, y1, x2, y2), label) in enumerate(zip(boxes.tolist(), labels.tolist())):
        ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, edgecolor=colour, linewidth=1.2))
        text = _class_name(class_names, int(label) - 1)
        if scores is not None:
            text = f"{text} {scores[index]:.2f}"
        ax.text(x1, y1, text, fontsize=6, color='white', va='bottom',
                bbox=dict(facecolor=colour, edgecolor='none', pad=0.5, alpha=0.8))


def plot_detection_grid(images: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                        targets: Sequence[Dict[str, torch.Tensor]], detections: Sequence[Dict[str, torch.Tensor]],
                        class_names: Optional[Sequence[str]], png_path: os.PathLike,
                        min_score: float = PICTURE_MIN_SCORE) -> None:
    """Draw images [N, 3, H, W] (normalised as (x - mean) / std) with their ground-truth boxes (green, left) and
    the detections scored at least ``min_score`` (red with their scores, right) into ``png_path`` (atomically).
    targets / detections: per image {'boxes' [M, 4] pixels, 'labels' [M] 1..K(, 'scores' [M])}."""
    from matplotlib.figure import Figure

    pixels = _unnormalise(images, mean, std)
    count = len(pixels)
    fig = Figure(figsize=(2 * 3.0, 0.4 + 3.0 * max(count, 1)), layout='constrained')
    axes = fig.subplots(max(count, 1), 2, squeeze=False)
    for row in range(count):
        kept = detections[row]['scores'] >= min_score
        found = {key: value[kept] for key, value in detections[row].items() if key in ('boxes', 'labels', 'scores')}
        truth = targets[row]
        for ax, title in zip(axes[row], (f"ground truth ({len(truth['boxes'])})",
                                         f"detections >= {min_score:g} ({len(found['boxes'])})")):
            ax.imshow(pixels[row])
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(title, fontsize=9)
        _draw_boxes(axes[row, 0], truth['boxes'], truth['labels'], class_names, CORRECT_COLOUR)
        _draw_boxes(axes[row, 1], found['boxes'], found['labels'], class_names, WRONG_COLOUR, found['scores'])
    _save_png(fig, png_path, dpi=110)
