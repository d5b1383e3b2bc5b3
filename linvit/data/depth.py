"""Monocular depth data: image/depth-map folders and the config -> datasets builder (folders or the built-in ground).

Folder layout (``data.name: folder``)::

    root/train/images/<name>.<ext>                 any format PIL opens, any mode (read as uint8 RGB, see ``load_rgb``)
    root/train/depths/<name>.{png,tif,tiff,npy}    same relative path (subfolders allowed), one of these extensions
    root/val/images/...  root/val/depths/...

A depth map is one channel of the image's size: a 16-bit PNG (PIL mode 'I;16' or 'I', integers), a TIFF (read with
tifffile; float32 as a rule) or a ``.npy`` (a 2-D float or integer array). The stored value times ``depth_scale`` is
the depth in metres; ``depth_scale=None`` takes the field's default per file: 0.001 for integer files (millimetres,
as NYU Depth v2 stores its PNGs) and 1.0 for float files (metres). KITTI's PNGs store metres x 256: set
``data.depth_scale=0.00390625`` for them. 8-bit and colour PNGs are refused: 256 levels are too few for depth.

Pixels without a depth are invalid and read 0.0 (``INVALID_DEPTH``): a stored 0, a negative value, NaN, inf, and
anything deeper than ``max_depth`` metres (None = no cap). A map without one valid pixel is an error.

Pairing is checked at construction from the file listing (cheap): an image without a depth map, or with two (a.png
and a.npy), is an error; a depth map without an image a warning. Before training (``check_pairs``, which the builder
runs) every pair of both splits is opened: a depth map that is not one channel with enough levels, or has another
size than its image, is an error naming the files (read off the headers); the validation maps are decoded and their
values checked too, so that a bad validation pair stops the run before its first epoch rather than at its first
evaluation. The same checks run again when a sample is loaded. A file that fails to decode at all is logged, counted
in ``num_bad`` and replaced by the next pair, as for segmentation folders (``max_bad_fraction``).

Samples: ``dataset[key] -> (image float32 [3, H, W], depth float32 [H, W] metres)``, keys as for every
``KeyedSegDataset``. The depth map travels through albumentations as the ``mask`` target: crops and flips move it
with the image, resizing is nearest-neighbour only (no value that was not in the file, or 0) and padding is 0, i.e.
invalid. Training samples are augmented crops of ``img_size`` (the steps of ``build_seg_transforms``; a random
scale resizes the image but leaves the depth values as they were); validation samples are full size.
"""
from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import albumentations as A
import numpy as np
import tifffile
from albumentations.pytorch import ToTensorV2
from PIL import Image

from ..registry import Registry
from .base import DataError, KeyedSegDataset, LayoutError, image_size
from .folder import list_images, load_rgb, readable_extensions, too_many_bad
from .segmentation import SegFolderDataset, _upright_size, check_unique_targets, decode_mask
from .synthetic_depth import DEPTH_CLASS_NAMES, INVALID_DEPTH, SyntheticGroundDepth
from .transforms import _seg_train_steps

__all__ = ['DepthFolderDataset', 'DEPTH_DATASET_BUILDERS', 'build_depth_datasets', 'build_depth_transforms',
           'read_depth', 'decode_depth', 'depth_in_metres', 'depth_map_size', 'pair_images_with_depths',
           'DEPTH_EXTENSIONS', 'DEPTH_CLASS_NAMES', 'INVALID_DEPTH']

_logger = logging.getLogger(__name__)

DEPTH_EXTENSIONS = ('.png', '.tif', '.tiff', '.npy')
#: depth_scale=None: integer files hold millimetres, float files metres
INTEGER_DEPTH_SCALE = 1e-3
FLOAT_DEPTH_SCALE = 1.0
# PNG modes with 16 or more bits per pixel ('I' is how PIL opens some 16-bit PNGs)
_DEPTH_PNG_MODES = frozenset({'I', 'I;16', 'I;16B', 'I;16L', 'I;16N'})
_TIFF_EXTENSIONS = frozenset({'.tif', '.tiff'})
_FORMATS_HINT = "write a 16-bit PNG (millimetres), a float32 TIFF or a .npy (metres)"

DepthDatasets = tuple['KeyedSegDataset | None', 'KeyedSegDataset', list[str]]


# ---------------------------------------------------------------- depth files

def decode_depth(path: str | os.PathLike) -> np.ndarray:
    """The values stored in a depth file, [H, W] integer or float as stored (a PNG upright, EXIF orientation applied
    as for its image). DataError for a file that is no single-channel map with enough levels; decoding errors (a
    truncated or foreign file) propagate as the reading library raises them."""
    suffix = Path(path).suffix.lower()
    if suffix == '.npy':
        with open(path, 'rb') as file:  # not np.load: it takes any file without the .npy header for a pickle
            values = np.lib.format.read_array(file, allow_pickle=False)
    elif suffix in _TIFF_EXTENSIONS:
        values = tifffile.imread(path)
    else:
        mode, values = decode_mask(path)
        check_png_depth_mode(mode, path)
    check_depth_array(values.shape, values.dtype, path)
    return values


def depth_map_size(path: str | os.PathLike) -> tuple[int, int]:
    """(width, height) of a depth file once upright, from its header (nothing decoded), after checking from that
    header too that it is one channel with enough levels (PNG mode, TIFF or .npy shape and dtype)."""
    suffix = Path(path).suffix.lower()
    if suffix == '.npy':
        header = np.lib.format.open_memmap(path, mode='r')  # a memory map: only the header is read
        shape, dtype = header.shape, header.dtype
        del header
    elif suffix in _TIFF_EXTENSIONS:
        with tifffile.TiffFile(path) as tif:
            shape, dtype = tif.series[0].shape, tif.series[0].dtype
    else:
        with Image.open(path) as img:
            check_png_depth_mode(img.mode, path)
        return _upright_size(str(path))
    check_depth_array(shape, dtype, path)
    return shape[1], shape[0]


def check_png_depth_mode(mode: str, path: str | os.PathLike) -> None:
    if mode not in _DEPTH_PNG_MODES:
        bands = Image.getmodebands(mode)
        kind = f"{bands} channels" if bands > 1 else '8-bit' if mode in ('L', 'P') else 'not 16-bit'
        raise DataError(f"depth map {path} has PIL mode {mode!r} ({kind}); depth needs one channel of 16 bits or "
                        f"more (8 bits are too few levels): {_FORMATS_HINT}")


def check_depth_array(shape: tuple[int, ...], dtype: np.dtype, path: str | os.PathLike) -> None:
    """DataError naming ``path`` unless ``shape`` is [H, W] and ``dtype`` float or an integer of 16 bits or more."""
    if len(shape) != 2:
        raise DataError(f"depth map {path} has shape {list(shape)}; expected one channel [height, width]")
    dtype = np.dtype(dtype)
    if dtype.kind in 'ui' and dtype.itemsize >= 2 or dtype.kind == 'f':
        return
    if dtype.kind in 'uib':
        raise DataError(f"depth map {path} holds {dtype} values: too few levels for depth; {_FORMATS_HINT}")
    raise DataError(f"depth map {path} holds {dtype} values; expected integers or floats ({_FORMATS_HINT})")


def default_depth_scale(dtype: np.dtype) -> float:
    """Metres per stored unit when ``depth_scale`` is None: 0.001 for integer files (mm), 1.0 for float files (m)."""
    return INTEGER_DEPTH_SCALE if np.dtype(dtype).kind in 'ui' else FLOAT_DEPTH_SCALE


def depth_in_metres(stored: np.ndarray, depth_scale: float | None = None,
                    max_depth: float | None = None) -> np.ndarray:
    """Stored values [H, W] (any integer or float dtype) -> float32 [H, W] metres, ``stored * depth_scale`` (None:
    ``default_depth_scale``), with ``INVALID_DEPTH`` wherever the result is not finite, not positive or beyond
    ``max_depth`` (None = no cap)."""
    scale = default_depth_scale(stored.dtype) if depth_scale is None else depth_scale
    if scale == 1.0:
        metres = stored.astype(np.float32)
    else:  # through float64, so 1500 mm reads 1.5 m (float32 arithmetic gives 1500 * 0.001 = 1.5000001)
        metres = np.multiply(stored, scale, dtype=np.float64).astype(np.float32)
    valid = np.isfinite(metres) & (metres > 0)
    if max_depth is not None:
        valid &= metres <= max_depth
    metres[~valid] = INVALID_DEPTH
    return metres


def read_depth(path: str | os.PathLike, depth_scale: float | None = None,
               max_depth: float | None = None) -> np.ndarray:
    """The depth map at ``path`` as float32 [H, W] metres, invalid pixels ``INVALID_DEPTH`` (``depth_in_metres``).
    DataError if it is no single-channel map with enough levels, or has no valid pixel."""
    stored = decode_depth(path)
    metres = depth_in_metres(stored, depth_scale, max_depth)
    check_has_valid_pixels(metres, stored, path, max_depth)
    return metres


def check_has_valid_pixels(metres: np.ndarray, stored: np.ndarray, path: str | os.PathLike,
                           max_depth: float | None) -> None:
    if metres.any():
        return
    finite = stored[np.isfinite(stored)] if stored.dtype.kind == 'f' else stored
    stored_range = f"{finite.min()}..{finite.max()}" if finite.size else 'none finite'
    cap = '' if max_depth is None else f" or deeper than data.max_depth={max_depth:g} m"
    raise DataError(f"depth map {path} has no valid pixel: every value is 0, negative, NaN or inf{cap} (stored "
                    f"values {stored_range}, {stored.dtype}); check data.depth_scale and data.max_depth, or remove "
                    f"the pair")


def check_depth_settings(depth_scale: float | None, max_depth: float | None) -> None:
    """ValueError naming the config key unless each setting is None or a positive finite number."""
    for key, value in (('data.depth_scale', depth_scale), ('data.max_depth', max_depth)):
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and math.isfinite(value) and value > 0):
            raise ValueError(f"{key}={value!r} must be a positive number of metres (per stored unit for "
                             f"depth_scale) or null")


def _one_line(err: BaseException) -> str:
    """``type: message`` on one line (PIL and tifffile messages can span several)."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


# ---------------------------------------------------------------- folders

def pair_images_with_depths(split_dir: Path) -> tuple[list[str], list[str]]:
    """``(image paths, depth paths)`` of ``split_dir/images`` and ``split_dir/depths``, matched by relative path
    without extension, sorted. FileNotFoundError for an image without a depth map; DataError for an image with two,
    or two images sharing one; depth maps without an image are logged and left out."""
    images_dir, depths_dir = split_dir / 'images', split_dir / 'depths'
    if (split_dir / 'masks').is_dir() and not depths_dir.is_dir():
        raise LayoutError(f"{split_dir} holds images/ and masks/, a segmentation folder, not images/ and depths/: "
                          f"train it with --config configs/seg_folder.yaml (task=segmentation)")
    for folder in (split_dir, images_dir, depths_dir):
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder; expected {split_dir}/images/<name>.<ext> and "
                                    f"{split_dir}/depths/<name>.png (or .tif, .tiff, .npy)")
    extensions = readable_extensions()
    images = list_images(images_dir, extensions)
    if not images:
        raise DataError(f"no images under {images_dir} (looked for files PIL opens: "
                        f"{', '.join(sorted(extensions)[:12])}, ...)")
    by_stem = _depths_by_stem(depths_dir)
    depths = [_the_depth_of(image, images_dir, depths_dir, by_stem) for image in images]
    missing = [(image, stem) for image, stem in zip(images, depths) if stem is None]
    if missing:
        expected = _stem(missing[0][0], images_dir, depths_dir)
        more = f" (and {len(missing) - 1} more images without depth maps)" if len(missing) > 1 else ''
        raise FileNotFoundError(f"image {missing[0][0]} has no depth map: expected {expected}.png (or .tif, .tiff, "
                                f".npy){more}; every image needs a depth map with the same relative path under "
                                f"{depths_dir}")
    check_unique_targets(images, depths, kind='depth map')
    orphans = sorted({path for found in by_stem.values() for path in found} - set(depths))
    if orphans:
        _logger.warning("%d depth maps under %s have no image (e.g. %s); they are not used", len(orphans),
                        depths_dir, orphans[0])
    return images, depths


def _stem(image: str, images_dir: Path, depths_dir: Path) -> str:
    """depths_dir/<relative path of image without its extension>."""
    return os.path.join(depths_dir, Path(os.path.relpath(image, images_dir)).with_suffix(''))


def _depths_by_stem(depths_dir: Path) -> dict[str, list[str]]:
    """depth files under ``depths_dir`` grouped by their path without extension."""
    grouped: dict[str, list[str]] = {}
    for path in list_images(depths_dir, frozenset(DEPTH_EXTENSIONS)):
        grouped.setdefault(os.path.splitext(path)[0], []).append(path)
    return grouped


def _the_depth_of(image: str, images_dir: Path, depths_dir: Path, by_stem: dict[str, list[str]]) -> str | None:
    """The one depth file of ``image``, None if it has none; DataError if it has several (which one is meant?)."""
    found = by_stem.get(_stem(image, images_dir, depths_dir), [])
    if len(found) > 1:
        raise DataError(f"image {image} has {len(found)} depth maps, {' and '.join(found)}; keep one")
    return found[0] if found else None


class DepthFolderDataset(KeyedSegDataset):
    """One split of a depth folder: ``dataset[key] -> (image float32 [3, H, W], depth float32 [H, W] metres)``,
    invalid pixels ``INVALID_DEPTH`` (0.0), which is also ``ignore_index``.

    Args:
        split_dir: ``root/train`` or ``root/val``, holding ``images/`` and ``depths/``.
        transform: ``A.Compose`` from ``build_depth_transforms`` (train: [3, S, S] crops; val: full size).
        depth_scale: metres per stored unit; None: 0.001 for integer files, 1.0 for float files.
        max_depth: metres beyond which pixels are invalid; None: no cap.
        max_bad_fraction: the largest tolerated fraction of undecodable pairs.
    """

    def __init__(self, split_dir: str | os.PathLike, transform: A.Compose, depth_scale: float | None = None,
                 max_depth: float | None = None, max_bad_fraction: float = 0.01):
        check_depth_settings(depth_scale, max_depth)
        self.split_dir = Path(split_dir)
        self.image_paths, self.depth_paths = pair_images_with_depths(self.split_dir)
        super().__init__(transform, DEPTH_CLASS_NAMES, len(self.image_paths), ignore_index=int(INVALID_DEPTH))
        self.depth_scale, self.max_depth = depth_scale, max_depth
        self.max_bad_fraction = float(max_bad_fraction)
        self._failed_at_load: set[int] = set()

    # reads only image_paths: the same sizes the segmentation task warns about small images with
    image_sizes = SegFolderDataset.image_sizes

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The pair at ``index``: image uint8 [H, W, 3] RGB, depth float32 [H, W] metres. If a file cannot be
        decoded, the next pair that can (deterministic, so a seeded key still gives the same output). DataError if
        the depth map is no single-channel map with enough levels, has another size than the image, or has no valid
        pixel."""
        for offset in range(len(self)):
            candidate = (index + offset) % len(self)
            if candidate in self._failed_at_load:
                continue
            try:
                image = load_rgb(self.image_paths[candidate])
                stored = decode_depth(self.depth_paths[candidate])
            except DataError:
                raise
            except Exception as err:  # decoding fails in many ways (see folder.verify_image)
                self._record_load_failure(candidate, err)
                continue
            return image, self._checked_depth(candidate, image, stored)
        raise DataError(f"no image/depth pair under {self.split_dir} could be decoded")

    def check_pairs(self, decode: bool, num_threads: int = 8) -> None:
        """Check every image/depth pair now rather than when it is first loaded: the files open, the depth map is
        one channel with enough levels and has its image's size (headers only); ``decode`` also decodes each depth
        map and checks that it has a valid pixel (and verifies the image file's checksums), which costs a pass over
        the maps. A DataError names the first wrong pair; pairs that do not open are skipped and counted as
        ``load`` does (max_bad_fraction)."""
        def check(index: int) -> Exception | None:
            try:
                self._check_pair(index, decode)
            except Exception as err:  # noqa: BLE001 (decoding fails in many ways: see folder.verify_image)
                return err
            return None

        with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
            found = list(pool.map(check, range(len(self))))
        wrong = next((problem for problem in found if isinstance(problem, DataError)), None)
        if wrong is not None:
            raise DataError(f"{wrong} (found before training, checking every pair under {self.split_dir})")
        for index, problem in enumerate(found):
            if problem is not None and index not in self._failed_at_load:
                self._record_load_failure(index, problem)

    def describe(self) -> str:
        scale = 'per file (0.001 integer, 1.0 float)' if self.depth_scale is None else f"{self.depth_scale:g}"
        cap = 'none' if self.max_depth is None else f"{self.max_depth:g} m"
        return (f"depth folder {self.split_dir.name}: root={self.split_dir}, {len(self)} image/depth pairs "
                f"({self.num_bad} bad skipped), depth_scale={scale}, max_depth={cap}")

    def _check_pair(self, index: int, decode: bool) -> None:
        """What ``load`` checks of the pair at ``index``, from the file headers (and the depth values with
        ``decode``)."""
        image_size = _upright_size(self.image_paths[index], verify=decode)
        if decode:
            stored = decode_depth(self.depth_paths[index])
            depth_size = stored.shape[1], stored.shape[0]
        else:
            depth_size = depth_map_size(self.depth_paths[index])
        self._check_size(index, image_size, depth_size)
        if decode:
            metres = depth_in_metres(stored, self.depth_scale, self.max_depth)
            check_has_valid_pixels(metres, stored, self.depth_paths[index], self.max_depth)

    def _check_size(self, index: int, image_size: tuple[int, int], depth_size: tuple[int, int]) -> None:
        """Sizes as (width, height)."""
        if depth_size != image_size:
            raise DataError(f"depth map {self.depth_paths[index]} is {depth_size[0]}x{depth_size[1]} (width x height) "
                            f"but its image {self.image_paths[index]} is {image_size[0]}x{image_size[1]}; a depth "
                            f"map must have its image's size")

    def _checked_depth(self, index: int, image: np.ndarray, stored: np.ndarray) -> np.ndarray:
        self._check_size(index, (image.shape[1], image.shape[0]), (stored.shape[1], stored.shape[0]))
        metres = depth_in_metres(stored, self.depth_scale, self.max_depth)
        check_has_valid_pixels(metres, stored, self.depth_paths[index], self.max_depth)
        return metres

    def _record_load_failure(self, index: int, err: Exception) -> None:
        self._failed_at_load.add(index)
        self.num_bad += 1
        _logger.warning("could not decode %s or its depth map %s (%s); using the next pair instead",
                        self.image_paths[index], self.depth_paths[index], _one_line(err))
        fraction = self.num_bad / len(self)
        if fraction > self.max_bad_fraction:
            raise DataError(f"{self.num_bad} of {len(self)} image/depth pairs under {self.split_dir} could not be "
                            f"decoded ({fraction:.2%}; the last: {self.image_paths[index]} or "
                            f"{self.depth_paths[index]}, {_one_line(err)}), {too_many_bad(self.max_bad_fraction)}")


# ---------------------------------------------------------------- config -> datasets

def build_depth_transforms(aug_cfg: Any, img_size: int, mean: Sequence[float], std: Sequence[float], train: bool,
                           **compose_kwargs: Any) -> A.Compose:
    """The train or validation pipeline for depth: an image and its depth map through the same geometry.

    Args:
        aug_cfg: as for ``build_seg_transforms``: ``scale_range``, ``hflip``, ``vflip``, ``color_jitter``; ignored
            when ``train`` is False.
        img_size: side of the square training crop.
        mean, std: per-channel statistics in [0, 1] (the backbone's ``pretrained_cfg``).
        train: random resize, pad, crop, flips and colour jitter if True (segmentation's steps); otherwise no
            geometry at all (validation is evaluated at full resolution).
        compose_kwargs: other ``A.Compose`` arguments (``save_applied_params``, ``seed``, ...).

    Returns:
        ``A.Compose`` mapping ``image`` uint8 [H, W, 3] RGB and ``mask`` float32 [H, W] metres to ``image`` float32
        [3, S, S] (``(x / 255 - mean) / std``) and ``mask`` float32 [S, S]. The depth map is only resized with
        nearest neighbour and padded with ``INVALID_DEPTH``, so it holds no value that was not in the input or 0.
    """
    steps = _seg_train_steps(aug_cfg, img_size, INVALID_DEPTH) if train else []
    steps += [A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0), ToTensorV2()]
    return A.Compose(steps, **compose_kwargs)


def build_depth_datasets(cfg: Any, mean: Sequence[float], std: Sequence[float],
                         with_train: bool = True) -> DepthDatasets:
    """Train and validation datasets for monocular depth, and the class names ``['depth']``.

    Args:
        cfg: the data config (OmegaConf DictConfig or any attribute object): ``name`` ('folder' | 'synthetic'),
            ``root``, ``img_size`` (one side: the square training crop), ``depth_scale`` and ``max_depth`` (absent
            = None), ``max_bad_fraction``, ``synthetic.{train_size, val_size, seed}``,
            ``aug.{scale_range, hflip, vflip, color_jitter}``.
        mean, std: per-channel normalisation in [0, 1] (the backbone's ``pretrained_cfg``).
        with_train: False builds the validation set only (evaluating saved weights): train is then None.

    Returns:
        ``(train, val, ['depth'])``; ``dataset[index]`` or ``dataset[(index, seed)]`` -> ``(image float32
        [3, H, W], depth float32 [H, W] metres, 0.0 where invalid)``: train samples are augmented crops of
        ``img_size``, val samples full size.
    """
    return DEPTH_DATASET_BUILDERS.get(cfg.name)(cfg, mean, std, with_train)


def build_depth_folder(cfg: Any, mean: Sequence[float], std: Sequence[float], with_train: bool = True
                       ) -> DepthDatasets:
    """Datasets from ``cfg.root/{train,val}/{images,depths}``; pairs checked before training (module docstring)."""
    if not cfg.root:
        raise ValueError("data.root must be set when data.name is 'folder': a folder holding train/images/, "
                         "train/depths/, val/images/ and val/depths/")
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data.root {root} is not a folder; expected {root}/train/images/<name>.<ext>, "
                                f"{root}/train/depths/<name>.png (or .tif, .tiff, .npy) and the same under {root}/val/")
    if getattr(cfg, 'cache', False):
        raise ValueError("data.cache holds class-id masks and does not apply to depth maps; set data.cache=false "
                         "for task=depth")
    side = _crop_side(cfg.img_size)
    depth_scale, max_depth = getattr(cfg, 'depth_scale', None), getattr(cfg, 'max_depth', None)
    train = None
    if with_train:
        train = DepthFolderDataset(root / 'train', build_depth_transforms(cfg.aug, side, mean, std, train=True),
                                   depth_scale, max_depth, cfg.max_bad_fraction)
    val = DepthFolderDataset(root / 'val', build_depth_transforms(cfg.aug, side, mean, std, train=False),
                             depth_scale, max_depth, cfg.max_bad_fraction)
    if with_train:  # before training, not at the first evaluation an epoch later (evaluating alone loads them all)
        train.check_pairs(decode=False)
        val.check_pairs(decode=True)
    return train, val, list(DEPTH_CLASS_NAMES)


def build_depth_synthetic(cfg: Any, mean: Sequence[float], std: Sequence[float], with_train: bool = True
                          ) -> DepthDatasets:
    """The built-in ground-plane task (``linvit.data.synthetic_depth``) rendered at ``cfg.img_size``."""
    if getattr(cfg, 'depth_scale', None) is not None:
        raise ValueError(f"data.depth_scale={cfg.depth_scale!r} converts stored depth files to metres; the synthetic "
                         f"set renders metres: unset data.depth_scale for data.name=synthetic")
    max_depth = getattr(cfg, 'max_depth', None)
    check_depth_settings(None, max_depth)
    side = _crop_side(cfg.img_size)
    syn = cfg.synthetic
    train = None
    if with_train:
        train = SyntheticGroundDepth(syn.train_size, side, syn.seed, 'train',
                                     build_depth_transforms(cfg.aug, side, mean, std, train=True), max_depth)
    val = SyntheticGroundDepth(syn.val_size, side, syn.seed, 'val',
                               build_depth_transforms(cfg.aug, side, mean, std, train=False), max_depth)
    return train, val, list(DEPTH_CLASS_NAMES)


def _crop_side(img_size: Any) -> int:
    """data.img_size as one side: depth trains on square crops."""
    height, width = image_size(img_size)
    if height != width:
        raise ValueError(f"data.img_size={list(img_size)!r} is not square; depth trains on square crops: give one "
                         f"side (data.img_size={height})")
    return height


#: data.name -> builder(data config, mean, std, with_train) -> (train, val, ['depth']), for depth
DEPTH_DATASET_BUILDERS: Registry[Callable[[Any, Sequence[float], Sequence[float], bool], DepthDatasets]] = \
    Registry('data.name')
DEPTH_DATASET_BUILDERS.register('folder', build_depth_folder)
DEPTH_DATASET_BUILDERS.register('synthetic', build_depth_synthetic)
