"""Dense prediction on full-size images: the whole image at once, or overlapping windows whose logits are averaged;
and detection on images too large for one pass, in overlapping tiles whose boxes are merged (``detect_tiled``).

The model contract: ``model(images [b, 3, h, w]) -> logits [b, K, h, w]``, the same spatial size as its input. Patch
models need h and w divisible by their patch size: ``pad_multiple`` pads the input at the bottom/right and the
padding is cropped from the logits.

    logits = segment(model, images, 'slide', window=512, stride=341, pad_multiple=16)   # [B, K, H, W]

Sliding windows follow mmsegmentation's ``slide_inference``: per dimension n = max(ceil((H - win) / stride), 0) + 1
windows starting at y0 = min(i * stride, H - win), so the last window ends at the bottom/right edge; an image smaller
than the window is padded up to it. Logits are summed in an accumulator of at least float32 and divided by the
number of windows covering each pixel.

Gradients and ``torch.no_grad()`` are the caller's business; everything here works either way, on any device.
"""
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torchvision.ops import batched_nms

__all__ = ['pad_to_multiple', 'whole_inference', 'sliding_window_inference', 'segment', 'SEGMENT_MODES',
           'window_starts', 'detect_tiled', 'tile_cores']

Size2 = Union[int, Tuple[int, int], Sequence[int]]
Model = Callable[[torch.Tensor], torch.Tensor]


def _pair(value: Size2, name: str) -> Tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) for v in pair):
        raise ValueError(f'{name} must be an int or a pair of ints (height, width), got {value!r}')
    return pair[0], pair[1]


def _check_images(images: torch.Tensor) -> None:
    if images.ndim != 4:
        raise ValueError(f'images must be [B, C, H, W], got shape {tuple(images.shape)}')


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float16 / bfloat16 / float32 logits (no fp16 overflow, no bf16 rounding of the sum); float64
    stays float64."""
    return torch.promote_types(dtype, torch.float32)


def pad_to_multiple(images: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    """images [B, C, H, W] -> [B, C, H', W'] with H' and W' the next multiples of ``multiple``, padded with ``value``
    at the bottom and right (the top-left pixels keep their coordinates). Returns ``images`` itself when nothing is
    padded."""
    _check_images(images)
    if multiple < 1:
        raise ValueError(f'multiple must be >= 1, got {multiple}')
    height, width = images.shape[-2:]
    pad_h, pad_w = -height % multiple, -width % multiple
    if pad_h == 0 and pad_w == 0:
        return images
    return F.pad(images, (0, pad_w, 0, pad_h), value=value)


def _run(model: Model, images: torch.Tensor) -> torch.Tensor:
    """model(images [b, C, h, w]) with the contract checked: logits [b, K, h, w]."""
    logits = model(images)
    if logits.ndim != 4 or logits.shape[0] != images.shape[0] or logits.shape[-2:] != images.shape[-2:]:
        raise ValueError(f'the model must return logits [b, K, h, w] for images [b, C, h, w]; got '
                         f'{tuple(logits.shape)} for {tuple(images.shape)}')
    return logits


def whole_inference(model: Model, images: torch.Tensor, pad_multiple: int = 1) -> torch.Tensor:
    """Run the model once on the whole images: images [B, C, H, W] -> logits [B, K, H, W] in float32 (float64 if
    the model returns float64). The input is padded at the bottom/right to a multiple of ``pad_multiple`` and the
    padding cropped from the logits."""
    _check_images(images)
    height, width = images.shape[-2:]
    logits = _run(model, pad_to_multiple(images, pad_multiple))
    return logits[..., :height, :width].to(_accumulator_dtype(logits.dtype))


def window_starts(size: int, window: int, stride: int) -> List[int]:
    """Start offsets of the windows along one dimension of ``size`` pixels (mmsegmentation's rule):
    n = max(ceil((size - window) / stride), 0) + 1 windows at min(i * stride, size - window), clamped at 0.
    The last window ends at the edge; a size below the window gives the single start 0."""
    count = max(math.ceil((size - window) / stride), 0) + 1
    return [max(min(i * stride, size - window), 0) for i in range(count)]


def _coverage(size: int, window: int, starts: List[int]) -> torch.Tensor:
    """How many windows cover each of ``size`` pixels: int64 [size]."""
    count = torch.zeros(size, dtype=torch.int64)
    for start in starts:
        count[start:start + window] += 1
    return count


def _check_window(window: Tuple[int, int], stride: Tuple[int, int], pad_multiple: int) -> None:
    if pad_multiple < 1:
        raise ValueError(f'pad_multiple must be >= 1, got {pad_multiple}')
    for w, s in zip(window, stride):
        if w < 1:
            raise ValueError(f'window must be >= 1, got {window}')
        if w % pad_multiple:
            raise ValueError(f'window {window} must be divisible by pad_multiple={pad_multiple} (the model needs '
                             f'inputs that are multiples of {pad_multiple})')
        if not 1 <= s <= w:
            raise ValueError(f'stride {stride} must be in 1..window {window}: a larger stride leaves pixels that no '
                             'window covers')


def sliding_window_inference(model: Model, images: torch.Tensor, window: Size2, stride: Size2, batch_size: int = 8,
                             pad_multiple: int = 1) -> torch.Tensor:
    """Average the logits of overlapping windows: images [B, C, H, W] -> logits [B, K, H, W] in float32 (float64 if
    the model returns float64).

    ``window`` and ``stride``: int, or (height, width). Window positions follow ``window_starts`` per dimension (the
    last row/column aligned to the bottom/right edge); an image smaller than the window in a dimension is padded
    (zeros, bottom/right) up to the window, and the padding cropped from the result. The windows of all B images
    go through the model ``batch_size`` at a time; their logits are summed in a float32 accumulator [B, K, H, W]
    and divided by the number of windows covering each pixel (at least 1 everywhere). ``window`` must be divisible
    by ``pad_multiple``; ``stride`` must be in 1..window.
    """
    _check_images(images)
    window_hw, stride_hw = _pair(window, 'window'), _pair(stride, 'stride')
    _check_window(window_hw, stride_hw, pad_multiple)
    if batch_size < 1:
        raise ValueError(f'batch_size must be >= 1, got {batch_size}')
    (win_h, win_w), (stride_h, stride_w) = window_hw, stride_hw
    height, width = images.shape[-2:]
    padded = F.pad(images, (0, max(win_w - width, 0), 0, max(win_h - height, 0)))
    padded_h, padded_w = padded.shape[-2:]
    starts_y, starts_x = window_starts(padded_h, win_h, stride_h), window_starts(padded_w, win_w, stride_w)

    # [padded_h, padded_w] = coverage of rows x coverage of columns; computed on the CPU so the check costs no sync
    count = _coverage(padded_h, win_h, starts_y)[:, None] * _coverage(padded_w, win_w, starts_x)[None, :]
    assert int(count.min()) >= 1, 'every pixel is covered by at least one window'

    crops = [(b, y, x) for b in range(images.shape[0]) for y in starts_y for x in starts_x]
    total: Optional[torch.Tensor] = None
    # an empty batch still runs the model once, on no windows, to learn K and the dtype
    for first in range(0, max(len(crops), 1), batch_size):
        chunk = crops[first:first + batch_size]
        windows = [padded[b, :, y:y + win_h, x:x + win_w] for b, y, x in chunk]
        logits = _run(model, torch.stack(windows) if windows else padded[:0, :, :win_h, :win_w])
        if total is None:
            total = logits.new_zeros((images.shape[0], logits.shape[1], padded_h, padded_w),
                                     dtype=_accumulator_dtype(logits.dtype))
        for (b, y, x), crop_logits in zip(chunk, logits):
            total[b, :, y:y + win_h, x:x + win_w] += crop_logits
    average = total / count.to(device=total.device, dtype=total.dtype)
    return average[..., :height, :width]


def _segment_whole(model: Model, images: torch.Tensor, window: Optional[Size2], stride: Optional[Size2],
                   batch_size: int, max_pixels: Optional[int], pad_multiple: int) -> torch.Tensor:
    height, width = images.shape[-2:]
    if max_pixels is not None and height * width > max_pixels:
        raise ValueError(f'image of {height} x {width} = {height * width} pixels is above seg.eval.max_pixels='
                         f'{max_pixels} for whole-image inference; use seg.eval.mode=slide (windows) or raise '
                         'seg.eval.max_pixels')
    return whole_inference(model, images, pad_multiple)


def _default_stride(window: int, pad_multiple: int) -> int:
    """2/3 of the window, rounded down to a multiple of ``pad_multiple`` (at least ``pad_multiple``)."""
    return max(window * 2 // 3 // pad_multiple * pad_multiple, pad_multiple)


def _segment_slide(model: Model, images: torch.Tensor, window: Optional[Size2], stride: Optional[Size2],
                   batch_size: int, max_pixels: Optional[int], pad_multiple: int) -> torch.Tensor:
    if window is None:
        raise ValueError('seg.eval.mode=slide needs a window size (seg.eval.window)')
    window_hw = _pair(window, 'window')
    if stride is None:
        stride = tuple(_default_stride(w, pad_multiple) for w in window_hw)
    return sliding_window_inference(model, images, window_hw, stride, batch_size, pad_multiple)


#: mode name -> implementation, for ``segment``
SEGMENT_MODES: Dict[str, Callable[..., torch.Tensor]] = {'whole': _segment_whole, 'slide': _segment_slide}


def segment(model: Model, images: torch.Tensor, mode: str, window: Optional[Size2] = None,
            stride: Optional[Size2] = None, batch_size: int = 8, max_pixels: Optional[int] = None,
            pad_multiple: int = 1) -> torch.Tensor:
    """Full-resolution logits for images [B, C, H, W] -> [B, K, H, W] float32 (float64 for a float64 model).

    mode 'whole': one forward pass per batch (``whole_inference``); an image with H * W above ``max_pixels`` raises
    ValueError before the model runs. mode 'slide': ``sliding_window_inference`` with ``window`` (required) and
    ``stride`` (default: 2/3 of the window rounded down to a multiple of ``pad_multiple``, at least
    ``pad_multiple``), ``batch_size`` windows per forward pass.
    """
    if mode not in SEGMENT_MODES:
        raise ValueError(f'unknown segmentation inference mode {mode!r} (seg.eval.mode); choose one of: '
                         f'{", ".join(SEGMENT_MODES)}')
    _check_images(images)
    return SEGMENT_MODES[mode](model, images, window, stride, batch_size, max_pixels, pad_multiple)


# ---------------------------------------------------------------------------------------------------- detection

#: a detector: images [b, 3, h, w] -> per image {'boxes': [N, 4] x1, y1, x2, y2 pixels, 'scores': [N], 'labels': [N]}
Detector = Callable[[torch.Tensor], List[Dict[str, torch.Tensor]]]


def tile_cores(size: int, window: int, starts: List[int]) -> List[Tuple[int, int]]:
    """The part [lo, hi) of one dimension each window owns: neighbours split their overlap in the middle, the first
    owns from 0 and the last up to ``size``, so every pixel has exactly one owner."""
    bounds = [0] + [(start + previous + window) // 2 for previous, start in zip(starts, starts[1:])] + [size]
    return list(zip(bounds[:-1], bounds[1:]))


def _owned(found: Dict[str, torch.Tensor], top: int, left: int, rows: Tuple[int, int], cols: Tuple[int, int]
           ) -> Dict[str, torch.Tensor]:
    """A tile's detections in image pixels, those whose centre lies in the part of the image the tile owns."""
    boxes = found['boxes'] + torch.tensor([left, top, left, top], dtype=found['boxes'].dtype,
                                          device=found['boxes'].device)
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    keep = (cx >= cols[0]) & (cx < cols[1]) & (cy >= rows[0]) & (cy < rows[1])
    return {'boxes': boxes[keep], 'scores': found['scores'][keep], 'labels': found['labels'][keep]}


def detect_tiled(detector: Detector, image: torch.Tensor, tile: Size2, overlap: int, iou_threshold: float = 0.5,
                 batch_size: int = 4, max_detections: Optional[int] = None,
                 progress: Optional[Callable[[int], None]] = None) -> Dict[str, torch.Tensor]:
    """Detections on one image [3, H, W] from overlapping tiles of ``tile`` pixels (``overlap`` pixels shared by
    neighbours; window starts as ``window_starts``): each tile's boxes are moved to image pixels and kept when
    their centre lies in the part of the image the tile owns (``tile_cores``), then class-wise NMS at
    ``iou_threshold`` (torchvision's ``batched_nms``) merges what two tiles both found near their border.

    An object no larger than ``overlap`` lies whole inside the tile that owns its centre, so a detector that sees only
    an object's own pixels finds the same boxes tiled as on the whole image. Returns {'boxes' [M, 4], 'scores' [M],
    'labels' [M]} by descending score, at most ``max_detections``. An image no larger than a tile is one tile.
    ``progress(count)`` is called after each forward with the number of tiles it ran (a progress bar's update).
    """
    if image.ndim != 3:
        raise ValueError(f'detect_tiled takes one image [C, H, W], got shape {tuple(image.shape)}')
    tile_h, tile_w = _pair(tile, 'tile')
    if not 0 <= overlap < min(tile_h, tile_w):
        raise ValueError(f'overlap must be in 0..{min(tile_h, tile_w) - 1} (less than the tile {tile_h}x{tile_w}), '
                         f'got {overlap}')
    height, width = image.shape[-2:]
    row_starts = window_starts(height, tile_h, tile_h - overlap)
    col_starts = window_starts(width, tile_w, tile_w - overlap)
    places = [(top, left, rows, cols)
              for top, rows in zip(row_starts, tile_cores(height, tile_h, row_starts))
              for left, cols in zip(col_starts, tile_cores(width, tile_w, col_starts))]
    parts = []
    for first in range(0, len(places), batch_size):
        chunk = places[first:first + batch_size]
        crops = torch.stack([image[:, top:top + tile_h, left:left + tile_w] for top, left, _, _ in chunk])
        for found, (top, left, rows, cols) in zip(detector(crops), chunk):
            parts.append(_owned(found, top, left, rows, cols))
        if progress:
            progress(len(chunk))
    merged = {key: torch.cat([part[key] for part in parts]) for key in ('boxes', 'scores', 'labels')}
    keep = batched_nms(merged['boxes'].float(), merged['scores'].float(), merged['labels'], iou_threshold)
    keep = keep[:max_detections] if max_detections is not None else keep
    return {key: value[keep] for key, value in merged.items()}
