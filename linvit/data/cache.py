"""A decoded-image cache: a split's images decoded once, resized to the training size, kept as a uint8 memory map.

Decoding a PNG or JPEG and resizing it costs more CPU time than a small ViT spends on the image on a GPU. The cache
pays that once per split, image size and file listing; every later epoch and run reads uint8 rows from a
memory-mapped ``.npy`` file (no decode), and the augmentation runs batched on the training device
(``linvit.data.batch_augment``).

    cache = DecodedCache.open_or_build(folder_dataset, size=512, cache_dir='data/x/.linvit_cache', name='train')
    cache.images      # uint8 [N, H, W, 3] RGB (np.memmap), resized as albumentations' Resize(H, W) does
    cache.labels      # int64 [N]
    cache.size        # (H, W): the size given, one side (512: 512 x 512) or (height, width)

The folder name holds a key: a hash of the file listing (relative paths, sizes and modification times), the class
names and labels, the size and the resize rule. A changed folder (a file added, removed, replaced or touched) has
another key, so stale data is never read; ``meta.json``, written last, marks a finished cache, so a build cut short
is rebuilt. Unreadable files are replaced by the next readable image, as the per-image path does at load time.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import cv2
import numpy as np
import torch

from .base import KeyedImageDataset, KeyedSegDataset, image_size, sample_seed, size_text
from .batch_augment import augment_batch, augment_seg_batch, draw_params, draw_seg_params, normalise

__all__ = ['DecodedCache', 'CachedImageDataset', 'CachedSegDataset', 'cache_key', 'RESIZE_RULE']

_logger = logging.getLogger(__name__)

#: how an image becomes H x W: the same call as albumentations' Resize(H, W) (bilinear, aspect not kept), so the
#: cached validation images equal the per-image path's (the words are part of every cache key: changing them
#: rebuilds every cache)
RESIZE_RULE = 'cv2.resize INTER_LINEAR to S x S'
CACHE_VERSION = 1
_META = 'meta.json'
#: images decoded per task of the thread pool (PIL and cv2 release the GIL while they decode and resize)
_CHUNK = 64


def _listing(paths: Sequence[str], root: Path) -> list[list]:
    """[relative path, size in bytes, modification time in ns] of every file: what makes two listings the same."""
    entries = []
    for path in paths:
        stat = os.stat(path)
        entries.append([os.path.relpath(path, root), stat.st_size, stat.st_mtime_ns])
    return entries


def cache_key(paths: Sequence[str], root: Path, labels: Sequence[int], class_names: Sequence[str],
              size: int | Sequence[int]) -> str:
    """The hex digest naming a cache of ``paths`` at ``size`` (a side or (H, W)): it changes with any file, label,
    class, size or rule (a square size is keyed by its side, as before non-square sizes existed)."""
    height, width = image_size(size, 'size')
    described = {'version': CACHE_VERSION, 'rule': RESIZE_RULE, 'classes': list(class_names),
                 'size': height if height == width else [height, width],
                 'labels': [int(label) for label in labels], 'files': _listing(paths, root)}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _resized(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 [h, w, 3] -> uint8 [H, W, 3] for ``size`` = (H, W), as albumentations' Resize(H, W)."""
    if image.shape[:2] == size:
        return image
    return cv2.resize(image, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)


class DecodedCache:
    """One split decoded at one size (H, W): ``images`` uint8 [N, H, W, 3] and ``labels`` int64 [N], memory-mapped."""

    def __init__(self, folder: Path) -> None:
        meta = json.loads((folder / _META).read_text())
        self.folder = folder
        self.key = meta['key']
        self.size = image_size(meta['size'], f"{folder / _META} size")  # (H, W); older caches wrote the side
        self.class_names = list(meta['class_names'])
        self.labels = np.load(folder / 'labels.npy')
        self.has_masks = bool(meta.get('masks', False))
        self._images: np.ndarray | None = None
        self._masks: np.ndarray | None = None

    @property
    def images(self) -> np.ndarray:
        """uint8 [N, H, W, 3], mapped on first use in each process (a DataLoader worker maps the file itself
        rather than receiving a pickled copy of it)."""
        if self._images is None:
            self._images = np.load(self.folder / 'images.npy', mmap_mode='r')
        return self._images

    @property
    def masks(self) -> np.ndarray:
        """The class-id masks [N, H, W] of a segmentation split (nearest-neighbour resized), mapped on first use."""
        if self._masks is None:
            self._masks = np.load(self.folder / 'masks.npy', mmap_mode='r')
        return self._masks

    def __getstate__(self) -> dict:
        return {**self.__dict__, '_images': None, '_masks': None}

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def open_or_build(cls, source, size: int | Sequence[int], cache_dir: str | os.PathLike, name: str,
                      workers: int | None = None) -> DecodedCache:
        """The cache of ``source`` at ``size`` (a side, or (height, width)), built (decoding every image once)
        unless a finished cache with the same key exists in ``cache_dir``. ``source``: an ``ImageFolderDataset``
        (``paths``, ``targets``) or a ``SegFolderDataset`` (``image_paths``, ``mask_paths``: its masks are cached
        too), with ``class_names``, ``split_dir`` and ``load(i)``."""
        size = image_size(size, 'size')
        files, labels = _files_and_labels(source)
        key = cache_key(files, source.split_dir, labels, source.class_names, size)
        folder = Path(cache_dir) / f"{name}-{size_text(size)}px-{key[:16]}"
        if _finished(folder, key):
            _logger.info("decoded-image cache %s: %d images of %s px (no decoding)", folder, len(source),
                         size_text(size))
            return cls(folder)
        _build_into(source, size, folder, key, workers or min(8, os.cpu_count() or 1))
        return cls(folder)


def _finished(folder: Path, key: str) -> bool:
    """Whether ``folder`` holds a finished cache with this key (its meta.json is written last)."""
    meta = folder / _META
    return meta.is_file() and json.loads(meta.read_text()).get('key') == key


def _files_and_labels(source) -> tuple[list[str], list[int]]:
    """What a cache key covers: every file read (images, and masks for segmentation) and the labels."""
    if hasattr(source, 'mask_paths'):
        return [*source.image_paths, *source.mask_paths], []
    return list(source.paths), list(source.targets)


def _build_into(source, size: tuple[int, int], folder: Path, key: str, workers: int) -> None:
    """Build the cache in a folder of this process's own, then rename it to ``folder``: two processes building the
    same cache at once each finish a complete one, and the first rename wins (a partial build is never visible)."""
    own = folder.with_name(f"{folder.name}.building-{os.getpid()}")
    _build(source, size, own, key, workers)
    if _finished(folder, key):  # another process was quicker: keep its cache, which it may be reading
        shutil.rmtree(own, ignore_errors=True)
        return
    shutil.rmtree(folder, ignore_errors=True)  # an unfinished cache of an earlier, killed build
    try:
        os.rename(own, folder)
    except OSError:  # another process renamed its finished build first
        shutil.rmtree(own, ignore_errors=True)


def _build(source, size: tuple[int, int], folder: Path, key: str, workers: int) -> None:
    """Decode every image (and mask) of ``source`` into the new folder ``folder``."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    count, with_masks = len(source), hasattr(source, 'mask_paths')
    _logger.info("building the decoded-image cache %s: %d images at %s px (once per listing and size)", folder,
                 count, size_text(size))
    images = np.lib.format.open_memmap(folder / 'images.npy', mode='w+', dtype=np.uint8, shape=(count, *size, 3))
    masks = np.lib.format.open_memmap(folder / 'masks.npy', mode='w+', dtype=source.mask_dtype,
                                      shape=(count, *size)) if with_masks else None
    labels = np.zeros(count, dtype=np.int64)

    def fill(start: int) -> None:
        for index in range(start, min(start + _CHUNK, count)):
            image, target = source.load(index)
            images[index] = _resized(image, size)
            if with_masks:
                # pixel centres sampled as the image's bilinear resize does, so mask and image stay aligned
                masks[index] = cv2.resize(target, (size[1], size[0]), interpolation=cv2.INTER_NEAREST_EXACT)
            else:
                labels[index] = target

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(fill, range(0, count, _CHUNK)))
    images.flush()
    if with_masks:
        masks.flush()
    np.save(folder / 'labels.npy', labels)
    meta = {'key': key, 'size': list(size), 'count': count, 'rule': RESIZE_RULE,
            'class_names': list(source.class_names), 'source': str(source.split_dir), 'masks': with_masks}
    (folder / _META).write_text(json.dumps(meta, indent=1))  # last: marks the cache finished


class CachedImageDataset(KeyedImageDataset):
    """A classification split read from a DecodedCache, keyed as every linvit dataset (index or (index, seed)).

    train: ``dataset[key] -> (image uint8 [3, H, W], label, params float32 [PARAM_COUNT])``: the augmentation is
    drawn here (seeded by the key) and applied batched on the device by ``on_device``. Validation:
    ``dataset[key] -> (image float32 [3, H, W] normalised, label)``, equal to the per-image path's Resize + Normalize.
    """

    def __init__(self, cache: DecodedCache, aug_cfg: Any, mean: Sequence[float], std: Sequence[float], train: bool,
                 source: str = '') -> None:
        super().__init__(None, cache.class_names, cache.labels.tolist())
        self.cache, self.aug_cfg, self.train = cache, aug_cfg, train
        self.mean, self.std = tuple(mean), tuple(std)
        self.source = source

    def __getitem__(self, key: int | tuple[int, int]) -> tuple:
        index, seed = self._parse_key(key)
        image = torch.from_numpy(np.array(self.cache.images[index])).permute(2, 0, 1)  # a copy: the map is read-only
        label = self.targets[index]
        if not self.train:
            return normalise(image[None], self.mean, self.std)[0], label
        rng = np.random.default_rng(sample_seed(index, seed))
        params = draw_params(self.aug_cfg, rng, *self.cache.size)
        return image, label, torch.from_numpy(params)

    def on_device(self, batch: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A collated training batch (uint8 images, labels, params) -> (float32 images [B, 3, H, W], labels) on
        ``device``, augmented there in one batched call; a validation batch (images, labels) is only moved."""
        if not self.train:
            images, labels = batch
            return images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        images, labels, params = batch
        images = images.to(device, non_blocking=True)
        augmented = augment_batch(images, params, self.cache.size, self.mean, self.std,
                                  jitter=float(self.aug_cfg.color_jitter) > 0)
        return augmented, labels.to(device, non_blocking=True)

    def describe(self) -> str:
        size = size_text(self.cache.size)
        return (f"cached {self.source or self.cache.folder}: {len(self)} images of {size} px decoded once "
                f"({self.cache.folder}), {len(self.class_names)} classes, augmented on the training device"
                if self.train else f"cached {self.source or self.cache.folder}: {len(self)} images of {size} px "
                f"({self.cache.folder})")


class CachedSegDataset(KeyedSegDataset):
    """A segmentation training split read from a DecodedCache with masks: ``dataset[key] -> (image uint8
    [3, H, W], mask [H, W], params float32 [PARAM_COUNT])``, the random scale, crop, flips and colour drawn here
    (seeded by the key) and applied batched on the device by ``on_device``. Validation stays on the per-image path
    (full-resolution images)."""

    def __init__(self, cache: DecodedCache, aug_cfg: Any, mean: Sequence[float], std: Sequence[float],
                 ignore_index: int, palette: np.ndarray | None = None, source: str = '') -> None:
        super().__init__(None, cache.class_names, len(cache), ignore_index, palette)
        self.cache, self.aug_cfg = cache, aug_cfg
        self.mean, self.std = tuple(mean), tuple(std)
        self.source = source

    def __getitem__(self, key: int | tuple[int, int]) -> tuple:
        index, seed = self._parse_key(key)
        image = torch.from_numpy(np.array(self.cache.images[index])).permute(2, 0, 1)  # a copy: the map is read-only
        mask = torch.from_numpy(np.array(self.cache.masks[index]))
        params = draw_seg_params(self.aug_cfg, np.random.default_rng(sample_seed(index, seed)))
        return image, mask, torch.from_numpy(params)

    def on_device(self, batch: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A collated batch (uint8 images, masks, params) -> (float32 images [B, 3, H, W], int64 masks [B, H, W])
        on ``device``, augmented there in one batched call."""
        images, masks, params = batch
        return augment_seg_batch(images.to(device, non_blocking=True), masks.to(device, non_blocking=True), params,
                                 self.cache.size, self.mean, self.std, self.ignore_index,
                                 jitter=float(self.aug_cfg.color_jitter) > 0)

    def describe(self) -> str:
        return (f"cached {self.source or self.cache.folder}: {len(self)} image/mask pairs of "
                f"{size_text(self.cache.size)} px "
                f"decoded once ({self.cache.folder}), {len(self.class_names)} classes, augmented on the training "
                f"device")
