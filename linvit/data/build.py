"""From the data config to (train dataset, val dataset, class names): one builder per ``data.name``."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Sequence

from torch.utils.data import Dataset

from ..registry import Registry
from .base import DataError
from .cache import CachedImageDataset, DecodedCache
from .folder import ImageFolderDataset, check_same_classes, class_folders
from .synthetic import SyntheticMarks
from .transforms import build_transforms, to_pair

__all__ = ['DATASET_BUILDERS', 'build_classification_datasets']

_logger = logging.getLogger(__name__)
_SAFE_MARK_CROP_SCALE = 0.6   # below this area fraction a random crop often cuts a synthetic mark off

Datasets = tuple[Dataset, Dataset, list[str]]


def build_classification_datasets(cfg: Any, mean: Sequence[float], std: Sequence[float],
                                  with_train: bool = True) -> Datasets:
    """Train and validation datasets for classification, and the class names.

    Args:
        cfg: the data config (OmegaConf DictConfig or dataclass): ``name`` ('synthetic' | 'folder'), ``root``,
            ``img_size`` (a side, or [height, width]), ``max_bad_fraction``, ``synthetic.{train_size, val_size, seed}``,
            ``aug.{random_resized_crop, scale, hflip, vflip, color_jitter}``.
        mean, std: per-channel normalisation in [0, 1] (the model's ``pretrained_cfg``).
        with_train: False builds the validation set only (evaluating saved weights): train is then None and its
            files are not read.

    Returns:
        ``(train, val, class_names)``; ``dataset[index]`` or ``dataset[(index, seed)]`` ->
        ``(image float32 [3, H, W], label int)`` at ``img_size`` (H, W). Train is augmented per ``cfg.aug``; val is
        resized only. A folder whose training split has fewer than 2 classes, or a class folder without images,
        is a DataError.
    """
    return DATASET_BUILDERS.get(cfg.name)(cfg, mean, std, with_train)


def build_synthetic(cfg: Any, mean: Sequence[float], std: Sequence[float], with_train: bool = True) -> Datasets:
    """The two-marks task (``linvit.data.synthetic``) rendered at ``cfg.img_size`` (a side, or [height, width])."""
    if getattr(cfg, 'cache', False):
        _logger.warning("data.cache=true: synthetic data is rendered, not decoded; it keeps the per-image path")
    if cfg.aug.random_resized_crop and to_pair(cfg.aug.scale, 'aug.scale')[0] < _SAFE_MARK_CROP_SCALE:
        _logger.warning("data.aug.scale=%s on synthetic marks: small random crops can cut a mark off the image and "
                        "make its label unlearnable; a minimum of %.1f or more keeps most marks", list(cfg.aug.scale),
                        _SAFE_MARK_CROP_SCALE)
    # the synthetic dataset swaps red-blue <-> blue-red when the image was flipped, so it must see which were applied
    train_tf = build_transforms(cfg.aug, cfg.img_size, mean, std, train=True, save_applied_params=True)
    val_tf = build_transforms(cfg.aug, cfg.img_size, mean, std, train=False)
    syn = cfg.synthetic
    train = SyntheticMarks(syn.train_size, cfg.img_size, syn.seed, 'train', train_tf) if with_train else None
    val = SyntheticMarks(syn.val_size, cfg.img_size, syn.seed, 'val', val_tf)
    return train, val, val.class_names


def build_folder(cfg: Any, mean: Sequence[float], std: Sequence[float], with_train: bool = True) -> Datasets:
    """ImageFolder datasets from ``cfg.root/train`` and ``cfg.root/val`` (same class folders in both; without
    the train set, the class names are the val folders')."""
    if not cfg.root:
        raise ValueError("data.root must be set when data.name is 'folder': a folder holding train/<class>/ and "
                         "val/<class>/")
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data.root {root} is not a folder; expected {root}/train/<class>/<images> and "
                                f"{root}/val/<class>/<images>")
    train_dir, val_dir = root / 'train', root / 'val'
    for split_dir in (train_dir, val_dir) if with_train else (val_dir,):
        if not split_dir.is_dir():
            raise FileNotFoundError(f"{split_dir} is missing; expected {split_dir}/<class>/<images> under data.root")
    class_names = class_folders(train_dir if with_train else val_dir)
    if with_train:
        _check_several_classes(class_names, train_dir)
        check_same_classes(class_names, class_folders(val_dir), val_dir)
    if getattr(cfg, 'cache', False):
        return _cached_folder(cfg, root, class_names, mean, std, with_train)
    train_tf = build_transforms(cfg.aug, cfg.img_size, mean, std, train=True)
    val_tf = build_transforms(cfg.aug, cfg.img_size, mean, std, train=False)
    train = ImageFolderDataset(train_dir, train_tf, class_names, cfg.max_bad_fraction) if with_train else None
    # a class may be absent from validation (it is then not evaluated); one absent from training is refused above
    val = ImageFolderDataset(val_dir, val_tf, class_names, cfg.max_bad_fraction, allow_empty_classes=True)
    return train, val, class_names


def _check_several_classes(class_names: list[str], train_dir: Path) -> None:
    """DataError for a training split of fewer than two classes: one class is always predicted right (top-1 1.0,
    loss 0.0 from the first step), so the run would measure nothing."""
    if len(class_names) < 2:
        raise DataError(f"{train_dir} has {len(class_names)} class folder ({class_names[0]}); classification needs "
                        f"at least 2 classes (with one, every prediction is right): add a folder of images for each "
                        f"other class, {train_dir}/<class name>/<images>")


def _cached_folder(cfg: Any, root: Path, class_names: list[str], mean: Sequence[float], std: Sequence[float],
                   with_train: bool) -> Datasets:
    """The ImageFolder splits through decoded-image caches (``data.cache``): no per-image decoding after the first
    pass, augmentation batched on the training device."""
    cache_dir = Path(cfg.cache_dir).expanduser() if getattr(cfg, 'cache_dir', None) else root / '.linvit_cache'
    splits = {}
    for split, train in (('train', True), ('val', False)):
        if split == 'train' and not with_train:
            splits[split] = None
            continue
        # listed, not verified: the cache's one decoding pass replaces unreadable files as loading does
        folder = ImageFolderDataset(root / split, None, class_names, cfg.max_bad_fraction, verify=False,
                                    allow_empty_classes=not train)
        cache = DecodedCache.open_or_build(folder, cfg.img_size, cache_dir, split)
        splits[split] = CachedImageDataset(cache, cfg.aug, mean, std, train=train, source=str(root / split))
    return splits['train'], splits['val'], class_names


#: data.name -> builder(data config, mean, std, with_train) -> (train, val, class names), for classification
DATASET_BUILDERS: Registry[Callable[[Any, Sequence[float], Sequence[float], bool], Datasets]] = Registry('data.name')
DATASET_BUILDERS.register('synthetic', build_synthetic)
DATASET_BUILDERS.register('folder', build_folder)
