"""albumentations pipelines: HWC uint8 RGB numpy in, normalised float32 CHW tensor out.

The pipelines are built from the data config's ``aug`` section. They are plain ``A.Compose`` objects, so a dense task
can pass masks through the same geometry (``transform(image=img, mask=mask)``; crops resize masks with nearest
neighbour, colour and normalisation leave them alone) and name extra targets with ``additional_targets``.
"""
from __future__ import annotations

from typing import Any, Sequence

import albumentations as A
from albumentations.pytorch import ToTensorV2

__all__ = ['build_transforms', 'to_pair']


def to_pair(values: Sequence[float], name: str) -> tuple[float, float]:
    """Read a two-element config list (OmegaConf ListConfig, list or tuple) as a tuple of floats."""
    pair = tuple(float(v) for v in values)
    if len(pair) != 2:
        raise ValueError(f"{name} must have 2 values, got {list(values)!r}")
    return pair


def build_transforms(aug_cfg: Any, img_size: int, mean: Sequence[float], std: Sequence[float], train: bool,
                     additional_targets: dict[str, str] | None = None, **compose_kwargs: Any) -> A.Compose:
    """The train or validation pipeline for one image size.

    Args:
        aug_cfg: object with ``random_resized_crop`` (bool), ``scale`` (2 floats, area fraction of the crop),
            ``hflip`` and ``vflip`` (probabilities), ``color_jitter`` (brightness/contrast/saturation strength,
            0 = off). Ignored when ``train`` is False.
        img_size: side of the square output.
        mean, std: per-channel statistics in [0, 1] (the model's ``pretrained_cfg``).
        train: random augmentation if True; otherwise a deterministic resize.
        additional_targets: forwarded to ``A.Compose`` (e.g. ``{'mask2': 'mask'}``) for dense tasks.
        compose_kwargs: other ``A.Compose`` arguments (``save_applied_params``, ``seed``, ...).

    Returns:
        ``A.Compose`` mapping ``image`` [H, W, 3] uint8 RGB (any H, W) to a float32 tensor [3, img_size, img_size],
        ``(x / 255 - mean) / std``. A ``mask`` [H, W] comes back as a tensor [img_size, img_size].
    """
    steps = _train_steps(aug_cfg, img_size) if train else [A.Resize(img_size, img_size)]
    steps += [A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0), ToTensorV2()]
    return A.Compose(steps, additional_targets=additional_targets, **compose_kwargs)


def _train_steps(aug_cfg: Any, img_size: int) -> list[A.BasicTransform]:
    if aug_cfg.random_resized_crop:
        steps = [A.RandomResizedCrop((img_size, img_size), scale=to_pair(aug_cfg.scale, 'aug.scale'))]
    else:
        steps = [A.Resize(img_size, img_size)]
    if aug_cfg.hflip > 0:
        steps.append(A.HorizontalFlip(p=float(aug_cfg.hflip)))
    if aug_cfg.vflip > 0:
        steps.append(A.VerticalFlip(p=float(aug_cfg.vflip)))
    if aug_cfg.color_jitter > 0:
        strength = float(aug_cfg.color_jitter)
        # Hue stays fixed: for colour-coded content (the synthetic marks, medical stains) a hue shift changes meaning.
        steps.append(A.ColorJitter(brightness=strength, contrast=strength, saturation=strength, hue=0.0, p=1.0))
    return steps
