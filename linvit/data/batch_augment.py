"""Augmentation of uint8 image batches on the training device: the cached path's counterpart of ``build_transforms``.

The per-image path decodes and augments in DataLoader workers; a GPU that trains a small ViT faster than the CPU
augments waits. Here a worker only reads a cached uint8 image and draws its augmentation parameters (a few floats,
seeded by the sample's key as the per-image path is, so runs and resumes are reproducible); one batched call on the
device then crops, resizes, flips, jitters and normalises the whole batch.

    params = draw_params(aug_cfg, rng, height, width)                  # float32 [PARAM_COUNT], in a worker
    images = augment_batch(uint8_images, params, (H, W), mean, std)    # uint8 [B, 3, h, w] -> float32 [B, 3, H, W]

The keys and their meaning are the per-image path's (``linvit.data.transforms``): ``random_resized_crop`` with
``scale`` (area fraction) and the aspect ratios 3/4..4/3 of albumentations' RandomResizedCrop, drawn the same way (10
tries, then the central crop); ``hflip``, ``vflip`` (probabilities); ``color_jitter`` (brightness, contrast and
saturation factors uniform in [1 - s, 1 + s], hue unchanged, in a random order per image as albumentations draws
it: with clipping the three do not commute). The crop is resampled bilinearly (no antialiasing, as cv2's
INTER_LINEAR). Colour runs in float: albumentations rounds down to uint8 after each colour step (about 1.5 grey
levels darker on average).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .base import image_size
from .transforms import to_pair

__all__ = ['PARAM_COUNT', 'draw_params', 'draw_seg_params', 'augment_batch', 'augment_seg_batch', 'crop_box',
           'normalise']

#: top, left, height, width (fractions of the image), flip x, flip y (0/1), brightness, contrast, saturation, the
#: index into COLOUR_ORDERS
PARAM_COUNT = 10
#: the orders the colour steps can run in (0 brightness, 1 contrast, 2 saturation)
COLOUR_ORDERS = ((0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0))
_RATIO = (3 / 4, 4 / 3)
_TRIES = 10


def crop_box(rng: np.random.Generator, height: int, width: int, scale: tuple[float, float]) -> tuple[int, ...]:
    """(top, left, h, w) in pixels of a random-resized crop: area fraction in ``scale``, log-uniform aspect ratio in
    3/4..4/3, up to 10 tries, then the central crop of the clamped ratio (albumentations' and torchvision's rule)."""
    area = height * width
    log_ratio = (math.log(_RATIO[0]), math.log(_RATIO[1]))
    for _ in range(_TRIES):
        target = area * rng.uniform(*scale)
        ratio = math.exp(rng.uniform(*log_ratio))
        w, h = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    ratio = width / height
    if ratio < _RATIO[0]:
        w, h = width, int(round(width / _RATIO[0]))
    elif ratio > _RATIO[1]:
        h, w = height, int(round(height * _RATIO[1]))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def draw_params(aug_cfg: Any, rng: np.random.Generator, height: int, width: int, train: bool = True) -> np.ndarray:
    """One image's augmentation, float32 [PARAM_COUNT] (see PARAM_COUNT); ``train=False`` gives the identity."""
    params = np.array([0, 0, 1, 1, 0, 0, 1, 1, 1, 0], dtype=np.float32)
    if not train:
        return params
    if aug_cfg.random_resized_crop:
        top, left, h, w = crop_box(rng, height, width, to_pair(aug_cfg.scale, 'aug.scale'))
        params[:4] = (top / height, left / width, h / height, w / width)
    return _flips_and_colour(aug_cfg, rng, params)


def draw_seg_params(aug_cfg: Any, rng: np.random.Generator) -> np.ndarray:
    """One segmentation crop's augmentation, float32 [PARAM_COUNT], as the per-image path's RandomScale (factor f
    uniform in ``scale_range``), PadIfNeeded at a random place and RandomCrop of the image's own size: the crop sees
    1/f of the image side at a random offset (beyond the image where f < 1: padding, ignored in the mask)."""
    low, high = to_pair(aug_cfg.scale_range, 'aug.scale_range')
    extent = 1 / rng.uniform(low, high)
    top, left = (rng.uniform(min(0.0, 1 - extent), max(0.0, 1 - extent)) for _ in range(2))
    params = np.array([top, left, extent, extent, 0, 0, 1, 1, 1, 0], dtype=np.float32)
    return _flips_and_colour(aug_cfg, rng, params)


def _flips_and_colour(aug_cfg: Any, rng: np.random.Generator, params: np.ndarray) -> np.ndarray:
    """``params`` with the flips and colour factors drawn (``hflip``, ``vflip``, ``color_jitter``)."""
    params[4] = rng.random() < float(aug_cfg.hflip)
    params[5] = rng.random() < float(aug_cfg.vflip)
    strength = float(aug_cfg.color_jitter)
    if strength > 0:
        params[6:9] = rng.uniform(max(0.0, 1 - strength), 1 + strength, size=3)
        params[9] = rng.integers(len(COLOUR_ORDERS))
    return params


def _sampling_grid(params: torch.Tensor, size: int | Sequence[int]) -> torch.Tensor:
    """The grid_sample grid [B, H, W, 2] for ``size`` = side or (H, W) that reads each image's crop box, flipped as
    its params say."""
    top, left, h, w, flip_x, flip_y = params[:, :6].unbind(1)
    # output x in [-1, 1] maps to the box [left, left + w] (fractions of the image) in grid_sample's coordinates
    scale_x, scale_y = w * (1 - 2 * flip_x), h * (1 - 2 * flip_y)
    shift_x, shift_y = 2 * left + w - 1, 2 * top + h - 1
    zero = torch.zeros_like(w)
    theta = torch.stack([torch.stack([scale_x, zero, shift_x], 1), torch.stack([zero, scale_y, shift_y], 1)], 1)
    return F.affine_grid(theta, [params.shape[0], 1, *image_size(size, 'size')], align_corners=False)


def _grey(images: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma of [B, 3, H, W] images in [0, 1] -> [B, 1, H, W] (what ColorJitter blends towards)."""
    weights = images.new_tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
    return (images * weights).sum(1, keepdim=True)


def _colour_steps(images: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """The three colour steps of [B, 3, H, W] images in [0, 1] with factors [B, 3, 1, 1, 1] (brightness, contrast,
    saturation), each clipped as on uint8 images -> [3, B, 3, H, W]."""
    brightness, contrast, saturation = factors.unbind(1)
    grey = _grey(images)
    mean = grey.mean(dim=(2, 3), keepdim=True)
    return torch.stack([images * brightness, (images - mean) * contrast + mean,
                        (images - grey) * saturation + grey]).clamp(0, 1)


def _jitter(images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Brightness, contrast and saturation applied to [B, 3, H, W] images in [0, 1], in each image's order: at every
    stage all three steps are computed and each image keeps the one its order names (cheap next to the model)."""
    factors = params[:, 6:9].view(-1, 3, 1, 1, 1)
    orders = images.new_tensor(COLOUR_ORDERS, dtype=torch.long)[params[:, 9].long()]   # [B, 3]
    picked = torch.arange(images.shape[0], device=images.device)
    for stage in range(3):
        images = _colour_steps(images, factors)[orders[:, stage], picked]
    return images


def augment_batch(images: torch.Tensor, params: torch.Tensor, size: int | Sequence[int], mean: Sequence[float],
                  std: Sequence[float], jitter: bool = True) -> torch.Tensor:
    """uint8 [B, 3, h, w] images and float32 [B, PARAM_COUNT] params (``draw_params``), on one device -> float32
    [B, 3, H, W] for ``size`` = side or (H, W), cropped, resized, flipped, jittered (unless ``jitter`` is False:
    data.aug.color_jitter=0) and normalised as ``(x / 255 - mean) / std``."""
    params = params.to(images.device, torch.float32)
    return _augmented(images, params, _sampling_grid(params, size), mean, std, jitter)


def _augmented(images: torch.Tensor, params: torch.Tensor, grid: torch.Tensor, mean: Sequence[float],
               std: Sequence[float], jitter: bool) -> torch.Tensor:
    """uint8 images [B, 3, h, w] read through ``grid`` [B, H, W, 2], jittered by ``params``, normalised."""
    # outside the image (a zoomed-out segmentation crop) the image is black, as the per-image path pads it
    pixels = F.grid_sample(images.float() / 255, grid, mode='bilinear', padding_mode='zeros', align_corners=False)
    if jitter:
        pixels = _jitter(pixels, params)
    return _normalised(pixels, mean, std)


def augment_seg_batch(images: torch.Tensor, masks: torch.Tensor, params: torch.Tensor, size: int | Sequence[int],
                      mean: Sequence[float], std: Sequence[float], ignore_index: int,
                      jitter: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``augment_batch`` for images uint8 [B, 3, h, w] with their class-id masks [B, h, w] (``draw_seg_params``):
    the masks take the same geometry with nearest-neighbour sampling, ``ignore_index`` where the crop leaves the
    image -> (float32 [B, 3, H, W], int64 [B, H, W]) for ``size`` = side or (H, W)."""
    params = params.to(images.device, torch.float32)
    grid = _sampling_grid(params, size)
    augmented = _augmented(images, params, grid, mean, std, jitter)
    # shifted by one so that grid_sample's zero padding stands for 'outside', then mapped to ignore_index
    shifted = F.grid_sample(masks.float()[:, None] + 1, grid, mode='nearest', padding_mode='zeros',
                            align_corners=False)[:, 0].long() - 1
    return augmented, torch.where(shifted < 0, torch.full_like(shifted, ignore_index), shifted)


def normalise(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float32 ``(x / 255 - mean) / std``, as albumentations' Normalize."""
    return _normalised(images.float() / 255, mean, std)


def _normalised(pixels: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    mean_t = pixels.new_tensor(mean).view(1, -1, 1, 1)
    std_t = pixels.new_tensor(std).view(1, -1, 1, 1)
    return (pixels - mean_t) / std_t
