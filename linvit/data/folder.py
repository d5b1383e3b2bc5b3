"""Classification from folders: ``root/train/<class>/...`` and ``root/val/<class>/...`` (ImageFolder layout).

Class names are the sorted folder names of ``train/``; images may sit in nested folders below a class folder. Any
format PIL opens, any size and mode; every image is read as uint8 RGB (``load_rgb``).

Bad files are expected in real collections. Construction opens and verifies every file (headers and, for PNG,
chunk checksums; no decoding) on a few threads, skips the bad ones with a warning and counts them in ``num_bad``.
A file that passes that check but fails to decode later (a truncated JPEG) is logged, counted, and replaced by the
next good sample, so a batch is never short. More bad files than ``max_bad_fraction`` is an error. Data that
cannot be used (no class folders, no images, a class folder without images, too many unreadable files) raises
``DataError``; a split may allow class folders without images (``allow_empty_classes``: validation, where a class
may be absent).
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import albumentations as A
import numpy as np
from PIL import Image, ImageOps

from .base import DataError, KeyedImageDataset, LayoutError, named

__all__ = ['ImageFolderDataset', 'class_folders', 'check_same_classes', 'list_images', 'load_rgb', 'to_rgb_array',
           'to_uint8', 'composite_on_black', 'readable_extensions', 'too_many_bad']

_logger = logging.getLogger(__name__)
_NAMED_BAD_FILES = 20        # warnings name this many bad files one by one, then summarise
_NAMED_EMPTY = 5             # the refusal of class folders without images names this many
_VERIFY_CHUNK = 256          # files per thread-pool task: per-file futures would cost more than a PNG check
_HIGH_DEPTH_MODES = frozenset({'I', 'I;16', 'I;16B', 'I;16L', 'I;16N', 'I;16S', 'F'})
_ALPHA_MODES = frozenset({'RGBA', 'RGBa', 'LA', 'La', 'PA'})


#: the sub-folders of a segmentation split (linvit.data.segmentation), sorted
SEGMENTATION_FOLDERS = ('images', 'masks')


def readable_extensions() -> frozenset[str]:
    """Lower-case file extensions (with the dot) of the formats PIL can open (not those it can only write)."""
    Image.init()
    return frozenset(ext.lower() for ext, fmt in Image.EXTENSION.items() if fmt in Image.OPEN)


def class_folders(split_dir: Path) -> list[str]:
    """Sorted names of the class folders in ``split_dir`` (hidden folders skipped)."""
    if not split_dir.is_dir():
        raise FileNotFoundError(f"{split_dir} is not a folder; expected the ImageFolder layout "
                                f"{split_dir}/<class name>/<images>")
    names = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith('.'))
    if names == list(SEGMENTATION_FOLDERS):
        raise LayoutError(f"{split_dir} holds images/ and masks/, a segmentation folder, not one folder per class: "
                          f"train it with --config configs/seg_folder.yaml (task=segmentation)")
    if not names:
        raise DataError(f"no class folders in {split_dir}; expected one folder of images per class, "
                         f"{split_dir}/<class name>/<images>")
    return names


def check_same_classes(train_classes: Sequence[str], val_classes: Sequence[str], val_dir: Path) -> None:
    """A DataError naming the folders that ``val_dir`` has in excess or lacks, compared with train."""
    missing, extra = sorted(set(train_classes) - set(val_classes)), sorted(set(val_classes) - set(train_classes))
    if missing or extra:
        raise DataError(f"{val_dir} must have the same class folders as train/: missing {missing}, extra {extra}")


def list_images(folder: Path, extensions: frozenset[str]) -> list[str]:
    """Paths of the files with an image extension under ``folder`` (recursive, sorted, hidden entries skipped)."""
    found = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith('.'):
            continue
        if entry.is_dir():
            found += list_images(Path(entry.path), extensions)
        elif os.path.splitext(entry.name)[1].lower() in extensions:
            found.append(entry.path)
    return found


def verify_image(path: str) -> str | None:
    """None if PIL can open and verify ``path``, else the reason it cannot. Cheap: headers and checksums only."""
    try:
        with Image.open(path) as img:
            img.verify()
    except Exception as err:  # PIL raises many types (OSError, SyntaxError, ValueError, DecompressionBombError)
        return f"{type(err).__name__}: {err}"
    return None


def load_rgb(path: str | os.PathLike) -> np.ndarray:
    """Decode ``path`` to uint8 [H, W, 3] RGB, upright (EXIF orientation applied). See ``to_rgb_array``."""
    with Image.open(path) as img:
        ImageOps.exif_transpose(img, in_place=True)
        return to_rgb_array(img)


def to_rgb_array(img: Image.Image) -> np.ndarray:
    """uint8 [H, W, 3] RGB from a PIL image of any mode.

    - 16-bit grey ('I;16', 'I;16B', ...) is scaled to 8 bits, v -> round(v * 255 / 65535), not clipped.
    - 32-bit integer grey ('I') in [0, 65535] is taken as 16-bit (PIL's mode for 16-bit TIFF and older PNG reads);
      other ranges, and float ('F') outside [0, 1], are stretched from their min-max to [0, 255].
    - Alpha (RGBA, LA, PA, palette with transparency) is composited on black: transparent pixels then read 0
      whatever colour the file stores under them, which is arbitrary (often stale pixels from an editor).
    - Everything else (L, P, 1, CMYK, YCbCr, ...) goes through PIL's own conversion to RGB.
    """
    if img.mode in _HIGH_DEPTH_MODES:
        return _grey_to_rgb(to_uint8(np.asarray(img)))
    if img.mode in _ALPHA_MODES or (img.mode == 'P' and 'transparency' in img.info):
        return composite_on_black(np.asarray(img.convert('RGBA')))
    return np.asarray(img.convert('RGB'))


def to_uint8(values: np.ndarray, value_range: tuple[float, float] | None = None) -> np.ndarray:
    """Grey values of any depth [H, W] -> uint8 [H, W], by scaling the full range (never clipping).

    ``value_range``: the (min, max) of the whole image when ``values`` is only a part of it (rows of a large image,
    linvit.data.large_image), so that every part is scaled alike; by default the min and max of ``values``.
    """
    low, high = (values.min(), values.max()) if value_range is None else value_range
    if values.dtype.kind in 'ui' and low >= 0 and high <= 65535:
        return ((values.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
    if values.dtype.kind == 'f' and low >= 0 and high <= 1:
        return np.rint(values * 255).astype(np.uint8)
    values = values.astype(np.float64)
    span = float(high) - float(low)
    return np.rint((values - low) * (255 / span if span > 0 else 0)).astype(np.uint8)


def _grey_to_rgb(grey: np.ndarray) -> np.ndarray:
    return np.repeat(grey[:, :, None], 3, axis=2)


def composite_on_black(rgba: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 4] RGBA -> uint8 [H, W, 3] RGB composited on black (the alpha rule of ``to_rgb_array``)."""
    alpha = rgba[:, :, 3:].astype(np.uint16)
    return ((rgba[:, :, :3] * alpha + 127) // 255).astype(np.uint8)


class ImageFolderDataset(KeyedImageDataset):
    """One split of an ImageFolder tree: ``dataset[key] -> (image float32 [3, S, S], label int)``.

    Args:
        split_dir: ``root/train`` or ``root/val``, holding one folder per class.
        transform: ``A.Compose`` from ``build_transforms`` (uint8 [H, W, 3] -> float32 [3, S, S]).
        class_names: class folders to read, position = label; default: the sorted folders of ``split_dir``.
        max_bad_fraction: the largest tolerated fraction of unreadable files (construction and load time together).
        verify: open and verify every file at construction (recommended; set False for trusted, huge trees).
        num_threads: threads for that check.
        allow_empty_classes: accept class folders without images (a DataError by default, as torchvision's
            ImageFolder: a class with no training image can never be predicted). Validation allows them: a class
            absent from the validation split is simply not evaluated.

    Bad files are reported through ``logging`` (logger ``linvit.data.folder``), never printed.
    """

    def __init__(self, split_dir: str | os.PathLike, transform: A.Compose, class_names: Sequence[str] | None = None,
                 max_bad_fraction: float = 0.01, verify: bool = True, num_threads: int = 8,
                 allow_empty_classes: bool = False):
        self.split_dir = Path(split_dir)
        class_names = list(class_names) if class_names is not None else class_folders(self.split_dir)
        paths, targets = self._scan(class_names, allow_empty_classes)
        self.max_bad_fraction = float(max_bad_fraction)
        self._num_files = len(paths)
        bad = self._find_bad(paths, num_threads) if verify else {}
        self._check_bad_fraction(len(bad))
        self.paths = [p for p in paths if p not in bad]
        if not self.paths:
            raise DataError(f"all {len(paths)} image files under {self.split_dir} are unreadable")
        super().__init__(transform, class_names, [t for p, t in zip(paths, targets) if p not in bad])
        self.num_bad = len(bad)
        self._failed_at_load: set[int] = set()

    def load(self, index: int) -> tuple[np.ndarray, int]:
        """The image at ``index`` as uint8 [H, W, 3] RGB and its label; if it cannot be decoded, the next sample
        that can (deterministic, so a seeded key still gives the same output)."""
        for offset in range(len(self)):
            candidate = (index + offset) % len(self)
            if candidate in self._failed_at_load:
                continue
            try:
                return load_rgb(self.paths[candidate]), self.targets[candidate]
            except Exception as err:  # decoding can fail in as many ways as verifying (see verify_image)
                self._record_load_failure(candidate, err)
        raise DataError(f"no image under {self.split_dir} could be decoded")

    def describe(self) -> str:
        shown = ', '.join(self.class_names[:5]) + (', ...' if len(self.class_names) > 5 else '')
        return (f"folder {self.split_dir.name}: root={self.split_dir}, {len(self)} images ({self.num_bad} bad "
                f"skipped), {len(self.class_names)} classes ({shown})")

    def _scan(self, class_names: Sequence[str], allow_empty_classes: bool) -> tuple[list[str], list[int]]:
        extensions = readable_extensions()
        paths, targets, empty = [], [], []
        for label, name in enumerate(class_names):
            class_dir = self.split_dir / name
            if not class_dir.is_dir():
                raise FileNotFoundError(f"class folder {class_dir} is missing")
            found = list_images(class_dir, extensions)
            empty += [] if found else [str(class_dir)]
            paths += found
            targets += [label] * len(found)
        if not paths:
            raise DataError(f"no images under {self.split_dir}/<class>/ (looked for files PIL opens: "
                            f"{', '.join(sorted(extensions)[:12])}, ...)")
        if empty and not allow_empty_classes:
            raise DataError(f"class folders without images under {self.split_dir}: {named(empty, _NAMED_EMPTY)}; a "
                            f"class with no training image can never be predicted: add images to them or remove them")
        for class_dir in empty:
            _logger.warning("class folder %s has no images: its class is not evaluated", class_dir)
        return paths, targets

    def _find_bad(self, paths: list[str], num_threads: int) -> dict[str, str]:
        chunks = [paths[i:i + _VERIFY_CHUNK] for i in range(0, len(paths), _VERIFY_CHUNK)]
        with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
            reasons = [r for chunk in pool.map(_verify_chunk, chunks) for r in chunk]
        bad = {path: reason for path, reason in zip(paths, reasons) if reason is not None}
        for path, reason in list(bad.items())[:_NAMED_BAD_FILES]:
            _logger.warning("skipping unreadable image %s (%s)", path, reason)
        if len(bad) > _NAMED_BAD_FILES:
            _logger.warning("skipping %d more unreadable images under %s", len(bad) - _NAMED_BAD_FILES,
                            self.split_dir)
        return bad

    def _record_load_failure(self, index: int, err: Exception) -> None:
        self._failed_at_load.add(index)
        self.num_bad += 1
        _logger.warning("could not decode %s (%s: %s); using the next image instead", self.paths[index],
                        type(err).__name__, err)
        self._check_bad_fraction(self.num_bad)

    def _check_bad_fraction(self, num_bad: int) -> None:
        fraction = num_bad / self._num_files
        if fraction > self.max_bad_fraction:
            raise DataError(f"{num_bad} of {self._num_files} image files under {self.split_dir} are unreadable "
                            f"({fraction:.2%}), {too_many_bad(self.max_bad_fraction)}")


def too_many_bad(max_bad_fraction: float) -> str:
    """The end of every refusal on the bad-file fraction: the config key, its value, and what to do."""
    return (f"more than data.max_bad_fraction={max_bad_fraction:g} ({max_bad_fraction:.2%}): replace or remove "
            f"the files the warnings name, or raise data.max_bad_fraction")


def _verify_chunk(paths: list[str]) -> list[str | None]:
    return [verify_image(p) for p in paths]
