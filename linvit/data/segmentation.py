"""Semantic segmentation data: image/mask folders and the config -> datasets builder (folders or built-in shapes).

Folder layout (``data.name: folder``)::

    root/classes.txt                      optional: one class name per line, line i = class id i
    root/train/images/<name>.<ext>        any format PIL opens, any mode (read as uint8 RGB, see ``load_rgb``)
    root/train/masks/<name>.png           same relative path (subfolders allowed), extension .png
    root/val/images/...  root/val/masks/...

A mask is a single-channel PNG of class ids: mode 'L' (8-bit), 'P' (palette index = class id, as in Pascal VOC),
'I;16' / 'I' (16-bit) or '1' (two classes). Value ``ignore_index`` (255 by default) marks unlabelled pixels, which no
loss or metric counts. Colour (RGB/RGBA) masks are refused: mapping colours to ids is the user's decision.

Pairing is checked at construction from the file listing (cheap): an image without a mask is an error, a mask
without an image a warning. Before training (``check_pairs``, which train.py runs when it builds the data) every pair
of both splits is opened: a mask that is no class-id mode or has another size than its image is an error naming the
files (read off the headers), and the validation masks are decoded and their values checked too, so that a bad
validation pair stops the run before its first epoch rather than at its first evaluation. The same checks run again
when a sample is loaded. A file that fails to decode at all is logged, counted in ``num_bad`` and replaced by the
next pair, as for classification folders (``max_bad_fraction``).

Class names come from ``root/classes.txt``; else ``data.num_classes`` names them ``class_0`` ...; else the count is
read off the train masks (1 + the largest id that is not ``ignore_index``).
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import albumentations as A
import numpy as np
from PIL import Image, ImageOps

from ..registry import Registry
from .base import DataError, KeyedSegDataset, LayoutError, mask_dtype
from .folder import list_images, load_rgb, readable_extensions, too_many_bad
from .synthetic_seg import SyntheticShapesSeg
from .transforms import build_seg_transforms

__all__ = ['KeyedSegDataset', 'SegFolderDataset', 'SEG_DATASET_BUILDERS', 'build_segmentation_datasets',
           'read_mask', 'read_class_names', 'mask_dtype', 'MASK_MODES']

_logger = logging.getLogger(__name__)

# single-channel modes whose pixel values are class ids ('1' reads as bool: ids 0 and 1)
MASK_MODES = frozenset({'L', 'P', '1', 'I', 'I;16', 'I;16B', 'I;16L', 'I;16N'})
MASK_EXTENSION = '.png'
CLASSES_FILE = 'classes.txt'
_SHOWN_BAD_VALUES = 5

SegDatasets = tuple['KeyedSegDataset', 'KeyedSegDataset', list[str]]


# ---------------------------------------------------------------- masks and class names

def decode_mask(path: str | os.PathLike) -> tuple[str, np.ndarray]:
    """``(PIL mode, pixel values)`` of the file at ``path``, upright (EXIF orientation applied, as for images).
    Values are [H, W] for single-channel modes, [H, W, C] otherwise; nothing is converted."""
    with Image.open(path) as img:
        ImageOps.exif_transpose(img, in_place=True)
        return img.mode, np.asarray(img)


def check_mask_mode(mode: str, path: str | os.PathLike) -> None:
    if mode not in MASK_MODES:
        raise DataError(f"mask {path} has PIL mode {mode!r}; masks must be single-channel class-id PNGs "
                        f"(mode 'L', 'P', 'I;16' or 'I': pixel value = class id, ignore_index = unlabelled), "
                        f"not colour images")


def read_mask(path: str | os.PathLike) -> np.ndarray:
    """A mask file's class ids [H, W] (uint8, uint16, int32 or bool, as stored); ValueError for colour masks."""
    mode, values = decode_mask(path)
    check_mask_mode(mode, path)
    return values


def check_mask_values(mask: np.ndarray, path: str | os.PathLike, num_classes: int, ignore_index: int) -> None:
    """ValueError naming ``path`` and up to a few offending values if ``mask`` holds anything but 0..num_classes-1
    and ``ignore_index``."""
    valid = ((mask >= 0) & (mask < num_classes)) | (mask == ignore_index)
    if valid.all():
        return
    bad = np.unique(mask[~valid])
    shown = ', '.join(str(v) for v in bad[:_SHOWN_BAD_VALUES]) + (', ...' if len(bad) > _SHOWN_BAD_VALUES else '')
    raise DataError(f"mask {path} has values {shown} ({int((~valid).sum())} pixels) that are neither class ids "
                    f"0..{num_classes - 1} ({num_classes} classes) nor ignore_index={ignore_index}")


def read_class_names(root: Path, num_classes: int | None) -> list[str] | None:
    """Class names from ``root/classes.txt`` or ``num_classes``; None when neither is given (infer from masks).

    ValueError when both are given and disagree, or when the file is malformed (a blank line before the last
    name, a repeated name, no names)."""
    if num_classes is not None and num_classes < 1:
        raise ValueError(f"data.num_classes must be >= 1, got {num_classes}")
    path = root / CLASSES_FILE
    if not path.is_file():
        return None if num_classes is None else [f'class_{i}' for i in range(num_classes)]
    names = _parse_classes_file(path)
    if num_classes is not None and num_classes != len(names):
        raise DataError(f"{path} names {len(names)} classes but data.num_classes={num_classes}; make them agree "
                        f"(or unset data.num_classes)")
    return names


def _parse_classes_file(path: Path) -> list[str]:
    names = [line.strip() for line in path.read_text(encoding='utf-8').splitlines()]
    while names and not names[-1]:
        names.pop()
    if not names:
        raise DataError(f"{path} names no classes; write one class name per line (line 1 = class id 0)")
    if '' in names:
        raise DataError(f"{path} line {names.index('') + 1} is blank; write one class name per line "
                        f"(line 1 = class id 0), blank lines only at the end")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise DataError(f"{path} repeats class names {repeated}; each line must name a different class")
    return names


def infer_num_classes(mask_paths: Sequence[str], ignore_index: int, num_threads: int = 8) -> int:
    """1 + the largest mask value that is not ``ignore_index`` over ``mask_paths`` (read on a few threads)."""
    with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
        largest = max(pool.map(lambda p: _largest_id(p, ignore_index), mask_paths), default=-1)
    if largest < 0:
        raise DataError(f"the {len(mask_paths)} train masks hold no labelled pixel (all ignore_index={ignore_index}"
                        f" or undecodable), so the class count cannot be read off them; write classes.txt or set "
                        f"data.num_classes")
    return largest + 1


def _largest_id(path: str, ignore_index: int) -> int:
    """The largest non-ignore value of one mask; -1 if it has none or cannot be decoded (skipped with a warning:
    the dataset logs and counts it again when it loads it)."""
    try:
        mode, values = decode_mask(path)
    except Exception as err:  # PIL raises many types; see folder.verify_image
        _logger.warning("could not decode mask %s (%s: %s) while counting classes", path, type(err).__name__, err)
        return -1
    check_mask_mode(mode, path)
    labelled = values[values != ignore_index]
    return int(labelled.max()) if labelled.size else -1


# ---------------------------------------------------------------- folders

def _check_not_class_folders(split_dir: Path) -> None:
    """LayoutError when ``split_dir`` is an ImageFolder split (class folders of images, no images/ or masks/)."""
    if not split_dir.is_dir() or (split_dir / 'images').is_dir() or (split_dir / 'masks').is_dir():
        return
    folders = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith('.'))
    if folders and all(list_images(split_dir / name, readable_extensions()) for name in folders[:3]):
        shown = ', '.join(folders[:3]) + (', ...' if len(folders) > 3 else '')
        raise LayoutError(f"{split_dir} holds class folders of images ({shown}), a classification folder, not "
                          f"images/ and masks/: train it with --config configs/cls_folder.yaml (task=classification)")


def pair_images_with_masks(split_dir: Path) -> tuple[list[str], list[str]]:
    """``(image paths, mask paths)`` of ``split_dir/images`` and ``split_dir/masks``, matched by relative path
    (mask extension .png), sorted. FileNotFoundError for an image without a mask; masks without an image are
    logged and left out."""
    images_dir, masks_dir = split_dir / 'images', split_dir / 'masks'
    _check_not_class_folders(split_dir)
    for folder in (split_dir, images_dir, masks_dir):
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder; expected {split_dir}/images/<name>.<ext> and "
                                    f"{split_dir}/masks/<name>.png")
    extensions = readable_extensions()
    images = list_images(images_dir, extensions)
    if not images:
        raise DataError(f"no images under {images_dir} (looked for files PIL opens: "
                        f"{', '.join(sorted(extensions)[:12])}, ...)")
    masks = [_expected_mask(images_dir, masks_dir, image) for image in images]
    check_unique_targets(images, masks)
    existing = set(list_images(masks_dir, frozenset({MASK_EXTENSION})))
    missing = [(image, mask) for image, mask in zip(images, masks) if mask not in existing]
    if missing:
        more = f" (and {len(missing) - 1} more images without masks)" if len(missing) > 1 else ''
        raise FileNotFoundError(f"image {missing[0][0]} has no mask: expected {missing[0][1]}{more}; every image "
                                f"needs a mask with the same relative path under {masks_dir}, extension .png")
    orphans = sorted(existing - set(masks))
    if orphans:
        _logger.warning("%d masks under %s have no image (e.g. %s); they are not used", len(orphans), masks_dir,
                        orphans[0])
    return images, masks


def _expected_mask(images_dir: Path, masks_dir: Path, image: str) -> str:
    relative = Path(os.path.relpath(image, images_dir))
    return os.path.join(masks_dir, relative.with_suffix(MASK_EXTENSION))


def check_unique_targets(images: Sequence[str], targets: Sequence[str], kind: str = 'mask') -> None:
    """a.jpg and a.png would share masks/a.png (or depths/a.npy, ``kind='depth map'``): refuse rather than guess
    which image the file belongs to."""
    owner: dict[str, str] = {}
    for image, target in zip(images, targets):
        if target in owner:
            raise DataError(f"images {owner[target]} and {image} would share the {kind} {target}; give them "
                            f"different names")
        owner[target] = image


class SegFolderDataset(KeyedSegDataset):
    """One split of a segmentation folder: ``dataset[key] -> (image float32 [3, H, W], mask int64 [H, W])``.

    Args:
        split_dir: ``root/train`` or ``root/val``, holding ``images/`` and ``masks/``.
        transform: ``A.Compose`` from ``build_seg_transforms`` (train: [3, S, S] crops; val: full size).
        class_names: position = class id; default: ``class_i`` for i < 1 + the largest id in this split's masks.
        ignore_index: mask value of unlabelled pixels.
        max_bad_fraction: the largest tolerated fraction of undecodable pairs.
        num_threads: threads for reading the masks when the class count is inferred.
    """

    def __init__(self, split_dir: str | os.PathLike, transform: A.Compose, class_names: Sequence[str] | None = None,
                 ignore_index: int = 255, max_bad_fraction: float = 0.01, num_threads: int = 8):
        self.split_dir = Path(split_dir)
        self.image_paths, self.mask_paths = pair_images_with_masks(self.split_dir)
        if class_names is None:
            class_names = self._infer_class_names(ignore_index, num_threads)
        super().__init__(transform, class_names, len(self.image_paths), ignore_index)
        self.max_bad_fraction = float(max_bad_fraction)
        self.mask_dtype = mask_dtype(len(self.class_names), self.ignore_index)
        self._failed_at_load: set[int] = set()

    def image_sizes(self, limit: int = 32) -> list[tuple[str, int, int]]:
        """``(path, width, height)`` of up to ``limit`` images spread over the split, read from the file headers
        (nothing decoded; unreadable files are left out)."""
        count = min(limit, len(self.image_paths))
        picked = [self.image_paths[i * len(self.image_paths) // count] for i in range(count)]
        sizes = []
        for path in picked:
            try:
                with Image.open(path) as img:
                    sizes.append((path, *img.size))
            except Exception:  # noqa: BLE001 (PIL raises many types; load() reports unreadable files)
                continue
        return sizes

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The pair at ``index``: image uint8 [H, W, 3] RGB, mask [H, W] class ids (``mask_dtype``). If a file
        cannot be decoded, the next pair that can (deterministic, so a seeded key still gives the same output).
        ValueError if the mask is not single-channel, has another size than the image, or holds a value that is
        neither a class id nor ``ignore_index``."""
        for offset in range(len(self)):
            candidate = (index + offset) % len(self)
            if candidate in self._failed_at_load:
                continue
            try:
                image = load_rgb(self.image_paths[candidate])
                mode, values = decode_mask(self.mask_paths[candidate])
            except Exception as err:  # decoding fails in many ways (see folder.verify_image)
                self._record_load_failure(candidate, err)
                continue
            return image, self._checked_mask(candidate, image, mode, values)
        raise DataError(f"no image/mask pair under {self.split_dir} could be decoded")

    def check_pairs(self, decode_masks: bool, num_threads: int = 8) -> None:
        """Check every image/mask pair now rather than when it is first loaded: the files open, the mask's mode is
        a class-id mode and its size its image's (headers only); ``decode_masks`` also decodes each mask and checks
        its values (and verifies the image file's checksums), which costs a pass over the masks. A DataError names
        the first wrong pair; pairs that do not open are skipped and counted as ``load`` does (max_bad_fraction)."""
        def check(index: int) -> Exception | None:
            try:
                self._check_pair(index, decode_masks)
            except DataError as wrong:
                return wrong
            except Exception as err:  # noqa: BLE001 (decoding fails in many ways: see folder.verify_image)
                return _Undecodable(f"{type(err).__name__}: {err}")
            return None

        with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
            found = list(pool.map(check, range(len(self))))
        wrong = next((problem for problem in found if isinstance(problem, DataError)), None)
        if wrong is not None:
            raise DataError(f"{wrong} (found before training, checking every pair under {self.split_dir})")
        for index, problem in enumerate(found):
            if problem is not None and index not in self._failed_at_load:
                self._record_load_failure(index, problem)

    def _check_pair(self, index: int, decode_masks: bool) -> None:
        """What ``load`` checks of the pair at ``index``, from the file headers (and the mask's pixels with
        ``decode_masks``)."""
        image_size = _upright_size(self.image_paths[index], verify=decode_masks)
        if decode_masks:
            mode, values = decode_mask(self.mask_paths[index])
            check_mask_mode(mode, self.mask_paths[index])
            mask_size = values.shape[1], values.shape[0]
        else:
            with Image.open(self.mask_paths[index]) as mask:
                check_mask_mode(mask.mode, self.mask_paths[index])
            mask_size = _upright_size(self.mask_paths[index])
        if mask_size != image_size:
            raise DataError(f"mask {self.mask_paths[index]} is {mask_size[0]}x{mask_size[1]} (width x height) but its "
                            f"image {self.image_paths[index]} is {image_size[0]}x{image_size[1]}; a mask must have "
                            f"its image's size")
        if decode_masks:
            check_mask_values(values, self.mask_paths[index], len(self.class_names), self.ignore_index)

    def describe(self) -> str:
        shown = ', '.join(self.class_names[:5]) + (', ...' if len(self.class_names) > 5 else '')
        return (f"seg folder {self.split_dir.name}: root={self.split_dir}, {len(self)} image/mask pairs "
                f"({self.num_bad} bad skipped), {len(self.class_names)} classes ({shown}), "
                f"ignore_index={self.ignore_index}")

    def _checked_mask(self, index: int, image: np.ndarray, mode: str, values: np.ndarray) -> np.ndarray:
        mask_path = self.mask_paths[index]
        check_mask_mode(mode, mask_path)
        if values.shape != image.shape[:2]:
            (ih, iw), (mh, mw) = image.shape[:2], values.shape
            raise DataError(f"mask {mask_path} is {mw}x{mh} (width x height) but its image "
                            f"{self.image_paths[index]} is {iw}x{ih}; a mask must have its image's size")
        check_mask_values(values, mask_path, len(self.class_names), self.ignore_index)
        return values.astype(self.mask_dtype, copy=False)

    def _infer_class_names(self, ignore_index: int, num_threads: int) -> list[str]:
        count = infer_num_classes(self.mask_paths, ignore_index, num_threads)
        _logger.info("%d classes (class_0 ... class_%d) read off the largest id in %d masks under %s; write %s "
                     "(one name per line) to name them, or set data.num_classes if some class is missing there",
                     count, count - 1, len(self.mask_paths), self.split_dir, self.split_dir.parent / CLASSES_FILE)
        return [f'class_{i}' for i in range(count)]

    def _record_load_failure(self, index: int, err: Exception) -> None:
        self._failed_at_load.add(index)
        self.num_bad += 1
        _logger.warning("could not decode %s or its mask %s (%s: %s); using the next pair instead",
                        self.image_paths[index], self.mask_paths[index], type(err).__name__, err)
        fraction = self.num_bad / len(self)
        if fraction > self.max_bad_fraction:
            raise DataError(f"{self.num_bad} of {len(self)} image/mask pairs under {self.split_dir} could not be "
                            f"decoded ({fraction:.2%}), {too_many_bad(self.max_bad_fraction)}")


class _Undecodable(Exception):
    """A file of a pair that PIL cannot open or verify (the reason is the message)."""


#: EXIF orientations that turn an image by 90 degrees (its width and height swap once upright)
_TURNED = frozenset({5, 6, 7, 8})


def _upright_size(path: str, verify: bool = False) -> tuple[int, int]:
    """(width, height) of the image file at ``path`` once upright (EXIF orientation applied, as ``load`` applies
    it), from its header; ``verify`` also checks the file's checksums (PIL's verify)."""
    if verify:  # on a file of its own: PIL reads nothing else from a verified image
        with Image.open(path) as img:
            img.verify()
    with Image.open(path) as img:
        width, height = img.size
        turned = img.getexif().get(0x0112) in _TURNED
    return (height, width) if turned else (width, height)


# ---------------------------------------------------------------- config -> datasets

def build_segmentation_datasets(cfg: Any, mean: Sequence[float], std: Sequence[float],
                                with_train: bool = True) -> SegDatasets:
    """Train and validation datasets for semantic segmentation, and the class names.

    Args:
        cfg: the data config (OmegaConf DictConfig or any attribute object): ``name`` ('synthetic' | 'folder'),
            ``root``, ``img_size`` (training crop), ``ignore_index``, ``num_classes``, ``max_bad_fraction``,
            ``synthetic.{train_size, val_size, seed}``, ``aug.{scale_range, hflip, vflip, color_jitter}``.
        mean, std: per-channel normalisation in [0, 1] (the backbone's ``pretrained_cfg``).
        with_train: False builds the validation set only (evaluating saved weights): train is then None and its
            images are not read (its masks only when neither classes.txt nor num_classes gives the classes).

    Returns:
        ``(train, val, class_names)``; ``dataset[index]`` or ``dataset[(index, seed)]`` -> ``(image float32
        [3, H, W], mask int64 [H, W])``: train samples are augmented crops of ``img_size``, val samples full size.
    """
    return SEG_DATASET_BUILDERS.get(cfg.name)(cfg, mean, std, with_train)


def build_seg_folder(cfg: Any, mean: Sequence[float], std: Sequence[float], with_train: bool = True) -> SegDatasets:
    """Datasets from ``cfg.root/{train,val}/{images,masks}``; class names as the module docstring says."""
    if not cfg.root:
        raise ValueError("data.root must be set when data.name is 'folder': a folder holding train/images/, "
                         "train/masks/, val/images/ and val/masks/")
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data.root {root} is not a folder; expected {root}/train/images/<name>.<ext>, "
                                f"{root}/train/masks/<name>.png and the same under {root}/val/")
    class_names = read_class_names(root, cfg.num_classes)
    train_tf = build_seg_transforms(cfg.aug, cfg.img_size, mean, std, cfg.ignore_index, train=True)
    val_tf = build_seg_transforms(cfg.aug, cfg.img_size, mean, std, cfg.ignore_index, train=False)
    train = None
    if with_train or class_names is None:  # the class count is read off the train masks
        train = SegFolderDataset(root / 'train', train_tf, class_names, cfg.ignore_index, cfg.max_bad_fraction)
        class_names = train.class_names
    val = SegFolderDataset(root / 'val', val_tf, class_names, cfg.ignore_index, cfg.max_bad_fraction)
    if with_train:  # before training, not at the first evaluation an epoch later (evaluating alone loads them all)
        train.check_pairs(decode_masks=False)
        val.check_pairs(decode_masks=True)
    if with_train and getattr(cfg, 'cache', False):
        train = _cached_train(cfg, root, train, mean, std)
    return (train if with_train else None), val, class_names


def _cached_train(cfg: Any, root: Path, train: SegFolderDataset, mean: Sequence[float],
                  std: Sequence[float]) -> KeyedSegDataset:
    """The training split through the decoded-image cache (``data.cache``): images and masks decoded once at
    data.img_size, augmented on the training device. Validation stays at full resolution, from the files."""
    from .cache import CachedSegDataset, DecodedCache
    cache_dir = Path(cfg.cache_dir).expanduser() if getattr(cfg, 'cache_dir', None) else root / '.linvit_cache'
    cache = DecodedCache.open_or_build(train, cfg.img_size, cache_dir, 'train')
    return CachedSegDataset(cache, cfg.aug, mean, std, cfg.ignore_index, source=str(root / 'train'))


def build_seg_synthetic(cfg: Any, mean: Sequence[float], std: Sequence[float], with_train: bool = True) -> SegDatasets:
    """The built-in shapes-and-key task (``linvit.data.synthetic_seg``) rendered at ``cfg.img_size``."""
    train_tf = build_seg_transforms(cfg.aug, cfg.img_size, mean, std, cfg.ignore_index, train=True)
    val_tf = build_seg_transforms(cfg.aug, cfg.img_size, mean, std, cfg.ignore_index, train=False)
    syn = cfg.synthetic
    train = SyntheticShapesSeg(syn.train_size, cfg.img_size, syn.seed, 'train', train_tf, cfg.ignore_index) \
        if with_train else None
    val = SyntheticShapesSeg(syn.val_size, cfg.img_size, syn.seed, 'val', val_tf, cfg.ignore_index)
    return train, val, val.class_names


#: data.name -> builder(data config, mean, std, with_train) -> (train, val, class names), for segmentation
SEG_DATASET_BUILDERS: Registry[Callable[[Any, Sequence[float], Sequence[float], bool], SegDatasets]] = \
    Registry('data.name')
SEG_DATASET_BUILDERS.register('synthetic', build_seg_synthetic)
SEG_DATASET_BUILDERS.register('folder', build_seg_folder)
