"""albumentations pipelines: HWC uint8 RGB numpy in, normalised float32 CHW tensor out.

The pipelines are built from the data config's ``aug`` section. They are plain ``A.Compose`` objects, so a dense task
can pass masks through the same geometry (``transform(image=img, mask=mask)``; crops resize masks with nearest
neighbour, colour and normalisation leave them alone) and name extra targets with ``additional_targets``.
"""
from __future__ import annotations

from typing import Any, Sequence

import albumentations as A
import cv2
import numpy as np
from albumentations.pytorch import ToTensorV2

from .base import image_size

__all__ = ['build_transforms', 'build_seg_transforms', 'to_pair']


def to_pair(values: Sequence[float], name: str) -> tuple[float, float]:
    """Read a two-element config list (OmegaConf ListConfig, list or tuple) as a tuple of floats."""
    pair = tuple(float(v) for v in values)
    if len(pair) != 2:
        raise ValueError(f"{name} must have 2 values, got {list(values)!r}")
    return pair


def build_transforms(aug_cfg: Any, img_size: int | Sequence[int], mean: Sequence[float], std: Sequence[float],
                     train: bool, additional_targets: dict[str, str] | None = None, **compose_kwargs: Any) -> A.Compose:
    """The train or validation pipeline for one image size.

    Args:
        aug_cfg: object with ``random_resized_crop`` (bool), ``scale`` (2 floats, area fraction of the crop),
            ``hflip`` and ``vflip`` (probabilities), ``color_jitter`` (brightness/contrast/saturation strength,
            0 = off). Ignored when ``train`` is False.
        img_size: the output size: one side (a square) or (height, width).
        mean, std: per-channel statistics in [0, 1] (the model's ``pretrained_cfg``).
        train: random augmentation if True; otherwise a deterministic resize to (height, width), aspect not kept.
        additional_targets: forwarded to ``A.Compose`` (e.g. ``{'mask2': 'mask'}``) for dense tasks.
        compose_kwargs: other ``A.Compose`` arguments (``save_applied_params``, ``seed``, ...).

    Returns:
        ``A.Compose`` mapping ``image`` [H, W, 3] uint8 RGB (any H, W) to a float32 tensor [3, height, width],
        ``(x / 255 - mean) / std``. A ``mask`` [H, W] comes back as a tensor [height, width].
    """
    height, width = image_size(img_size, 'img_size')
    steps = _train_steps(aug_cfg, height, width) if train else [A.Resize(height, width)]
    steps += [A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0), ToTensorV2()]
    return A.Compose(steps, additional_targets=additional_targets, **compose_kwargs)


def _train_steps(aug_cfg: Any, height: int, width: int) -> list[A.BasicTransform]:
    if aug_cfg.random_resized_crop:
        steps = [A.RandomResizedCrop((height, width), scale=to_pair(aug_cfg.scale, 'aug.scale'))]
    else:
        steps = [A.Resize(height, width)]
    return steps + _flip_and_colour_steps(aug_cfg)


def build_seg_transforms(aug_cfg: Any, img_size: int, mean: Sequence[float], std: Sequence[float], ignore_index: int,
                         train: bool, **compose_kwargs: Any) -> A.Compose:
    """The train or validation pipeline for segmentation: an image and its class-id mask through the same geometry.

    Args:
        aug_cfg: object with ``scale_range`` (2 floats: random resize factor, relative to the image's own size),
            ``hflip`` and ``vflip`` (probabilities), ``color_jitter`` (brightness/contrast/saturation, 0 = off).
            Ignored when ``train`` is False.
        img_size: side of the square training crop.
        mean, std: per-channel statistics in [0, 1] (the backbone's ``pretrained_cfg``).
        ignore_index: mask value of padding (pixels that no loss or metric counts).
        train: random resize, pad, crop, flips and colour jitter if True; otherwise no geometry at all
            (validation is evaluated at full resolution).
        compose_kwargs: other ``A.Compose`` arguments (``save_applied_params``, ``seed``, ...).

    Returns:
        ``A.Compose`` mapping ``image`` uint8 [H, W, 3] RGB and ``mask`` [H, W] integer class ids to ``image`` float32
        [3, S, S] (``(x / 255 - mean) / std``) and ``mask`` int64 [S, S], with S = img_size in training and
        (S, S) = (H, W) in validation. Masks are only ever resized with nearest neighbour, so they hold no value that
        was not in the input, besides ``ignore_index`` where training padded a small image.
    """
    steps = _seg_train_steps(aug_cfg, img_size, ignore_index) if train else []
    steps += [A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0),
              A.Lambda(mask=_mask_to_int64, name='mask_to_int64'), ToTensorV2()]
    return A.Compose(steps, **compose_kwargs)


def _seg_train_steps(aug_cfg: Any, img_size: int, ignore_index: int) -> list[A.BasicTransform]:
    low, high = to_pair(aug_cfg.scale_range, 'aug.scale_range')
    if not 0 < low <= high:
        raise ValueError(f"aug.scale_range must be two factors 0 < min <= max, got {[low, high]}")
    steps: list[A.BasicTransform] = []
    if (low, high) != (1.0, 1.0):
        # RandomScale draws the factor as 1 + uniform(scale_limit). NEAREST_EXACT samples pixel centres as the linear
        # image resize does (plain INTER_NEAREST is shifted by half a pixel), so mask and image stay aligned.
        steps.append(A.RandomScale(scale_limit=(low - 1.0, high - 1.0), interpolation=cv2.INTER_LINEAR,
                                   mask_interpolation=cv2.INTER_NEAREST_EXACT, p=1.0))
    # a small image is padded at a random place, so its content is not always in the centre of the crop
    steps += [A.PadIfNeeded(img_size, img_size, position='random', border_mode=cv2.BORDER_CONSTANT, fill=0,
                            fill_mask=ignore_index),
              A.RandomCrop(img_size, img_size)]
    return steps + _flip_and_colour_steps(aug_cfg)


def _flip_and_colour_steps(aug_cfg: Any) -> list[A.BasicTransform]:
    steps: list[A.BasicTransform] = []
    if aug_cfg.hflip > 0:
        steps.append(A.HorizontalFlip(p=float(aug_cfg.hflip)))
    if aug_cfg.vflip > 0:
        steps.append(A.VerticalFlip(p=float(aug_cfg.vflip)))
    if aug_cfg.color_jitter > 0:
        strength = float(aug_cfg.color_jitter)
        # hue fixed, as for classification: colour can carry the meaning (the synthetic key's colour)
        steps.append(A.ColorJitter(brightness=strength, contrast=strength, saturation=strength, hue=0.0, p=1.0))
    return steps


def _mask_to_int64(mask: np.ndarray, **params: Any) -> np.ndarray:
    """Masks travel as compact integers (cv2 resizes them); losses index with int64."""
    return mask.astype(np.int64, copy=False)
