"""High-resolution classification and segmentation sets from Fashion-MNIST, in the folder layouts linvit reads.

    spec = FmnistHiresSpec(out=Path('data/fmnist_hires'), task='classification', size=512)
    summary = write_dataset(spec)          # renders every image, writes manifest.csv; returns a one-line summary

task 'classification': each image is one Fashion-MNIST item, upscaled 2x-6x and placed at random on a ``size`` px
canvas (default 512), among fragments of other items (clutter) on a smooth random background. The class is the whole
item's, so a model has to find one object in a large image and not be fooled by pieces of others. ``fragments`` sets the
clutter per image (default ``fragment_count(size)``: 12 at 512 px, as many per area elsewhere, at least 3; 0: none).

task 'segmentation': each image is a ``size`` px canvas (default 1024) with ``items_per_image`` items (3-8), each
upscaled 2x-6x and dropped at random on a smooth background, overlaps allowed (a later item covers an earlier one).
Every pixel an item paints (its upscaled pixels brighter than ``SEG_PAINT_THRESHOLD``: fainter ones are specks and
rims, left transparent) is labelled with its class + 1, everything else 0 (background). There is no fragment clutter
here, so every labelled pixel belongs to a whole item.

Classification writes out/train/<class>/*.png and out/val/<class>/*.png; segmentation writes
out/{train,val}/images/*.png, out/{train,val}/masks/*.png (mode L class ids) and out/classes.txt ('background' then
the 10 classes). All images are 8-bit grey PNGs; train items come from the train IDX files, val items from t10k.
out/manifest.csv has one row per item with its box (classification: per image; segmentation: per item, in drawing
order). The same spec writes the same files, whatever the number of worker processes.

The IDX files come from Debian's package ``dataset-fashion-mnist`` (under ``DEFAULT_IDX_DIR``); ``find_idx_file``
and ``load_split`` read them, gzipped or not. This module needs numpy and PIL only.
"""
import csv
import functools
import gzip
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from PIL import Image

__all__ = ['FmnistHiresSpec', 'write_dataset', 'WRITERS', 'DEFAULT_SIZES', 'DEFAULT_IDX_DIR',
           'CLASS_NAMES', 'BACKGROUND', 'IDX_STEMS', 'find_idx_file', 'read_idx', 'load_split', 'Placement',
           'render_canvas', 'render_seg_canvas', 'fragment_count', 'MIN_SIZE', 'SEG_PAINT_THRESHOLD']

DEFAULT_IDX_DIR = Path('/usr/share/datasets/fashion-mnist')
# Fashion-MNIST's labels 0-9, spelled as folder names ('T-shirt/top' has a slash)
CLASS_NAMES = ('t-shirt_top', 'trouser', 'pullover', 'dress', 'coat', 'sandal', 'shirt', 'sneaker', 'bag',
               'ankle_boot')
#: split -> (images file stem, labels file stem); each file may also be gzipped (stem.gz)
IDX_STEMS = {'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
             'val': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte')}
IDX_UBYTE = 0x08
ITEM_SIDE = 28
MIN_SIZE = 64
MIN_SCALE, MAX_SCALE = 2.0, 6.0
SPLIT_IDS = {'train': 0, 'val': 1}
DEFAULT_SIZES = {'classification': 512, 'segmentation': 1024}
BACKGROUND = 'background'   # segmentation: mask value 0; item classes are 1 + their Fashion-MNIST label
# numpy stream ids under (seed, split): classification chooses items on stream 0 and renders image i on (1, i);
# segmentation renders image i on (2, i)
_SEG_STREAM = 2
# segmentation: item pixels at or below this grey are transparent (neither painted nor labelled). 6% of
# Fashion-MNIST's non-zero pixels are <= 10, nearly all specks and the faint rim around an item, not the garment.
SEG_PAINT_THRESHOLD = 10

Splits = Dict[str, Tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Placement:
    """Where the item landed on its canvas: top-left corner and side of the upscaled square, in pixels."""
    top: int
    left: int
    side: int


@dataclass(frozen=True)
class FmnistHiresSpec:
    """What ``write_dataset`` writes. ``size=None``: ``DEFAULT_SIZES[task]``. The per-class counts are the
    classification task's, the image counts and ``items_per_image`` (MIN, MAX) the segmentation task's."""
    out: Path
    task: str = 'classification'
    size: Optional[int] = None
    train_per_class: int = 600          # <= 6000
    val_per_class: int = 100            # <= 1000
    train_images: int = 2000
    val_images: int = 200
    items_per_image: Tuple[int, int] = (3, 8)
    fragments: Optional[int] = None     # classification: clutter pieces per image (None: fragment_count(size))
    seed: int = 0                       # fixes the choice of items and every image
    workers: int = 1                    # processes rendering and saving PNGs (the output does not depend on it)
    idx_dir: Path = DEFAULT_IDX_DIR

    @property
    def canvas_size(self) -> int:
        return DEFAULT_SIZES[self.task] if self.size is None else self.size

    def check(self) -> None:
        """ValueError naming the first setting out of range (nothing is read or written before this passes)."""
        if self.task not in WRITERS:
            raise ValueError(f"task={self.task!r} is not a task; expected one of {list(WRITERS)}")
        if self.canvas_size < MIN_SIZE:
            raise ValueError(f'size must be >= {MIN_SIZE}, got {self.canvas_size}')
        if self.seed < 0:
            raise ValueError(f'seed must be >= 0, got {self.seed}')
        if self.fragments is not None and self.fragments < 0:
            raise ValueError(f'fragments must be >= 0 (or None for the size\'s default), got {self.fragments}')
        if self.train_per_class < 1 or self.val_per_class < 1:
            raise ValueError('train_per_class and val_per_class must be >= 1')
        if self.train_images < 1 or self.val_images < 1:
            raise ValueError('train_images and val_images must be >= 1')
        low, high = self.items_per_image
        if not 1 <= low <= high:
            raise ValueError(f'items_per_image (MIN, MAX) needs 1 <= MIN <= MAX, got {low} {high}')


# ---------------------------------------------------------------- IDX files

def find_idx_file(idx_dir: Path, stem: str) -> Path:
    """``idx_dir/stem`` or ``idx_dir/stem.gz``; FileNotFoundError saying how to install them."""
    for candidate in (idx_dir / stem, idx_dir / f'{stem}.gz'):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem}[.gz] not found in {idx_dir}. Install the data with "
        f"`sudo apt-get install dataset-fashion-mnist` (files under {DEFAULT_IDX_DIR}), "
        f"or point --idx-dir at a folder holding the IDX files.")


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes as a uint8 array with ``ndim`` dimensions.

    IDX: two zero bytes, a type byte (0x08 = uint8), a byte with the number of dimensions, one big-endian uint32
    per dimension, then the values in C order.
    """
    with (gzip.open if path.suffix == '.gz' else open)(path, 'rb') as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number {raw[:4].hex()}; expected 0000 then type, ndim)")
    if raw[2] != IDX_UBYTE or raw[3] != ndim:
        raise ValueError(f"{path}: IDX magic {raw[:4].hex()} says type 0x{raw[2]:02x} with {raw[3]} dimensions; "
                         f"expected unsigned bytes (0x08) with {ndim} dimensions")
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype='>u4', count=ndim, offset=4))
    if len(raw) - header != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape} ({int(np.prod(shape))} values) but the file holds "
                         f"{len(raw) - header}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def load_split(idx_dir: Path, split: str) -> Tuple[np.ndarray, np.ndarray]:
    """Images uint8 [N, 28, 28] and labels uint8 [N] of ``split`` ('train' -> train files, 'val' -> t10k)."""
    image_stem, label_stem = IDX_STEMS[split]
    images = read_idx(find_idx_file(idx_dir, image_stem), ndim=3)
    labels = read_idx(find_idx_file(idx_dir, label_stem), ndim=1)
    if images.shape[1:] != (ITEM_SIDE, ITEM_SIDE) or len(images) != len(labels):
        raise ValueError(f"{idx_dir}: {split} images {images.shape} and labels {labels.shape} don't match "
                         f"(expected [N, {ITEM_SIDE}, {ITEM_SIDE}] and [N])")
    if labels.size and labels.max() >= len(CLASS_NAMES):
        raise ValueError(f"{idx_dir}: {split} labels go up to {labels.max()}, expected 0-{len(CLASS_NAMES) - 1}")
    return images, labels


def choose_items(labels: np.ndarray, per_class: int, rng: np.random.Generator, split: str) -> np.ndarray:
    """``per_class`` distinct indices of each class, class by class, sorted within a class."""
    chosen = []
    for label in range(len(CLASS_NAMES)):
        pool = np.flatnonzero(labels == label)
        if len(pool) < per_class:
            raise ValueError(f"{split}: class {CLASS_NAMES[label]} has {len(pool)} items, fewer than the "
                             f"{per_class} asked for")
        chosen.append(np.sort(rng.choice(pool, per_class, replace=False)))
    return np.concatenate(chosen)


# ---------------------------------------------------------------- rendering

def scale_range(size: int) -> Tuple[float, float]:
    """Upscaling factors that keep the item inside the canvas with a margin."""
    return MIN_SCALE, max(MIN_SCALE, min(MAX_SCALE, 0.9 * size / ITEM_SIDE))


def upscale(item: np.ndarray, side: int) -> np.ndarray:
    """uint8 [h, w] -> uint8 [side, side] (bilinear; the black surround stays 0)."""
    return np.asarray(Image.fromarray(item).resize((side, side), Image.Resampling.BILINEAR))


def paste(canvas: np.ndarray, patch: np.ndarray, top: int, left: int, threshold: int = 0) -> np.ndarray:
    """Put ``patch``'s pixels above ``threshold`` on ``canvas``: Fashion-MNIST items are drawn on black, so 0 is
    transparent. Returns where it painted: bool, ``patch``'s shape."""
    region = canvas[top:top + patch.shape[0], left:left + patch.shape[1]]
    painted = patch > threshold
    np.copyto(region, patch, where=painted)
    return painted


def smooth_background(rng: np.random.Generator, size: int) -> np.ndarray:
    """uint8 [size, size]: a dim random grid upscaled bilinearly (smooth, so the PNGs stay small)."""
    grid = rng.integers(0, 70, size=(4, 4), dtype=np.uint8)
    return np.array(Image.fromarray(grid).resize((size, size), Image.Resampling.BILINEAR))


def fragment_count(size: int) -> int:
    """The default clutter of a ``size`` px canvas: 12 pieces at 512 px, as many per area elsewhere, at least 3."""
    return max(3, round(12 * (size / 512) ** 2))


def add_fragments(canvas: np.ndarray, rng: np.random.Generator, pool: np.ndarray, count: Optional[int] = None) -> None:
    """Clutter: ``count`` (default ``fragment_count``) small crops of random other items, upscaled like items are,
    pasted anywhere."""
    size = canvas.shape[0]
    low, high = scale_range(size)
    for _ in range(fragment_count(size) if count is None else count):
        crop = int(rng.integers(6, 13))
        y, x = rng.integers(2, ITEM_SIDE - crop - 1, size=2)
        fragment = pool[rng.integers(len(pool))][y:y + crop, x:x + crop]
        side = max(1, min(size, round(crop * rng.uniform(low, high))))
        top, left = rng.integers(0, size - side + 1, size=2)
        paste(canvas, upscale(fragment, side), int(top), int(left))


def render_canvas(item: np.ndarray, pool: np.ndarray, size: int, rng: np.random.Generator,
                  fragments: Optional[int] = None) -> Tuple[np.ndarray, Placement]:
    """One classification image uint8 [size, size]: ``item`` [28, 28] upscaled at a random place over ``fragments``
    pieces of clutter from ``pool`` [N, 28, 28] (default ``fragment_count(size)``). The item is pasted last, so all
    of its non-zero pixels are on the canvas unchanged."""
    canvas = smooth_background(rng, size)
    add_fragments(canvas, rng, pool, fragments)
    side = round(ITEM_SIDE * rng.uniform(*scale_range(size)))
    top, left = (int(v) for v in rng.integers(0, size - side + 1, size=2))
    paste(canvas, upscale(item, side), top, left)
    return canvas, Placement(top, left, side)


def render_seg_canvas(items: np.ndarray, labels: np.ndarray, size: int, rng: np.random.Generator
                      ) -> Tuple[np.ndarray, np.ndarray, List[Placement]]:
    """One image uint8 [size, size] with ``items`` [k, 28, 28] upscaled at random places, drawn in order, and its
    mask uint8 [size, size]: ``labels[i] + 1`` where item i painted last, 0 (background) elsewhere. An item paints
    its upscaled pixels brighter than ``SEG_PAINT_THRESHOLD``."""
    canvas = smooth_background(rng, size)
    mask = np.zeros((size, size), dtype=np.uint8)
    low, high = scale_range(size)
    placements = []
    for item, label in zip(items, labels):
        side = round(ITEM_SIDE * rng.uniform(low, high))
        top, left = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        painted = paste(canvas, upscale(item, side), top, left, SEG_PAINT_THRESHOLD)
        mask[top:top + side, left:left + side][painted] = label + 1
        placements.append(Placement(top, left, side))
    return canvas, mask, placements


# ---------------------------------------------------------------- writing

def write_item(out: Path, split: str, images: np.ndarray, labels: np.ndarray, index: int, size: int,
               seed: int, fragments: Optional[int] = None) -> dict:
    """Render and save classification item ``index`` of ``images``; returns its manifest row."""
    # one stream per item: an image depends on (seed, split, item) only, not on order or worker
    rng = np.random.default_rng([seed, SPLIT_IDS[split], 1, index])
    canvas, at = render_canvas(images[index], images, size, rng, fragments)
    name = CLASS_NAMES[labels[index]]
    path = Path(split) / name / f'{split}-{index:05d}.png'
    Image.fromarray(canvas).save(out / path)
    return {'split': split, 'path': path.as_posix(), 'class_name': name, 'label': int(labels[index]),
            'source_index': index, 'top': at.top, 'left': at.left, 'side': at.side}


def write_split(out: Path, split: str, images: np.ndarray, labels: np.ndarray, chosen: np.ndarray, size: int,
                seed: int, workers: int = 1, fragments: Optional[int] = None) -> List[dict]:
    """Render and save the items ``chosen`` (indices into ``images``) of one split; returns its manifest rows."""
    for name in CLASS_NAMES:
        (out / split / name).mkdir(parents=True, exist_ok=True)
    job = functools.partial(write_item, out, split, images, labels, size=size, seed=seed, fragments=fragments)
    return map_jobs(job, [int(i) for i in chosen], workers)


def write_seg_image(out: Path, split: str, images: np.ndarray, labels: np.ndarray, index: int, size: int, seed: int,
                    items_per_image: Tuple[int, int]) -> List[dict]:
    """Render and save segmentation image ``index`` and its mask; returns one manifest row per item."""
    # one stream per image: it depends on (seed, split, index) only, not on order or worker
    rng = np.random.default_rng([seed, SPLIT_IDS[split], _SEG_STREAM, index])
    count = int(rng.integers(items_per_image[0], items_per_image[1] + 1))
    sources = rng.integers(0, len(images), size=count)
    canvas, mask, placements = render_seg_canvas(images[sources], labels[sources], size, rng)
    name = f'{split}-{index:05d}.png'
    image_path, mask_path = Path(split) / 'images' / name, Path(split) / 'masks' / name
    Image.fromarray(canvas).save(out / image_path)
    Image.fromarray(mask).save(out / mask_path)           # uint8 [H, W]: mode L
    return [{'split': split, 'path': image_path.as_posix(), 'mask_path': mask_path.as_posix(), 'item': order,
             'class_name': CLASS_NAMES[labels[source]], 'label': int(labels[source]),
             'mask_value': int(labels[source]) + 1, 'source_index': int(source), 'top': at.top, 'left': at.left,
             'side': at.side}
            for order, (source, at) in enumerate(zip(sources, placements))]


def write_seg_split(out: Path, split: str, images: np.ndarray, labels: np.ndarray, num_images: int, size: int,
                    seed: int, items_per_image: Tuple[int, int], workers: int = 1) -> List[dict]:
    """Render and save ``num_images`` segmentation images of one split; returns its manifest rows (per item)."""
    for folder in ('images', 'masks'):
        (out / split / folder).mkdir(parents=True, exist_ok=True)
    job = functools.partial(write_seg_image, out, split, images, labels, size=size, seed=seed,
                            items_per_image=tuple(items_per_image))
    return [row for rows in map_jobs(job, list(range(num_images)), workers) for row in rows]


def map_jobs(job: Callable[[int], Any], indices: List[int], workers: int) -> list:
    """``[job(i) for i in indices]``, on ``workers`` processes when more than one (the order is kept)."""
    if workers <= 1:
        return [job(index) for index in indices]
    with ProcessPoolExecutor(workers, initializer=_set_job, initargs=(job,)) as pool:
        return list(pool.map(_run_job, indices, chunksize=32))


_JOB: Optional[Callable[[int], Any]] = None   # set once per worker process, so the images are sent once, not per item


def _set_job(job: Callable[[int], Any]) -> None:
    global _JOB
    _JOB = job


def _run_job(index: int) -> Any:
    return _JOB(index)


def write_manifest(path: Path, rows: List[dict]) -> None:
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


Log = Callable[[str], None]


def make_classification(spec: FmnistHiresSpec, splits: Splits, log: Log) -> Tuple[List[dict], str]:
    """The ImageFolder set; returns the manifest rows (one per image) and a summary line."""
    per_class = {'train': spec.train_per_class, 'val': spec.val_per_class}
    # every split's items are chosen before any file is written: too few items is an error that writes nothing
    chosen = {split: choose_items(labels, per_class[split],
                                  np.random.default_rng([spec.seed, SPLIT_IDS[split], 0]), split)
              for split, (_, labels) in splits.items()}
    rows = []
    for split, (images, labels) in splits.items():
        start = time.perf_counter()
        rows += write_split(spec.out, split, images, labels, chosen[split], spec.canvas_size, spec.seed,
                            spec.workers, spec.fragments)
        log(f"{split}: {len(chosen[split])} images of {spec.canvas_size} px in {time.perf_counter() - start:.1f} s "
            f"-> {spec.out / split}")
    return rows, (f"wrote {len(rows)} images and {spec.out / 'manifest.csv'}; train with data.name=folder "
                  f"data.root={spec.out}")


def make_segmentation(spec: FmnistHiresSpec, splits: Splits, log: Log) -> Tuple[List[dict], str]:
    """The images/ + masks/ set and classes.txt; returns the manifest rows (one per item) and a summary line."""
    counts = {'train': spec.train_images, 'val': spec.val_images}
    for split, (images, _) in splits.items():
        if len(images) == 0:
            raise ValueError(f"{spec.idx_dir}: the {split} IDX files hold no items")
    spec.out.mkdir(parents=True, exist_ok=True)
    (spec.out / 'classes.txt').write_text('\n'.join([BACKGROUND, *CLASS_NAMES]) + '\n')
    rows = []
    for split, (images, labels) in splits.items():
        start = time.perf_counter()
        rows += write_seg_split(spec.out, split, images, labels, counts[split], spec.canvas_size, spec.seed,
                                spec.items_per_image, spec.workers)
        log(f"{split}: {counts[split]} images and masks of {spec.canvas_size} px in "
            f"{time.perf_counter() - start:.1f} s -> {spec.out / split}")
    return rows, (f"wrote {sum(counts.values())} images with {len(rows)} items, {spec.out / 'classes.txt'} and "
                  f"{spec.out / 'manifest.csv'}; train with --config configs/seg_folder.yaml data.root={spec.out}")


#: task name -> writer(spec, splits, log) -> (manifest rows, summary line): what a set for that task holds
WRITERS: Dict[str, Callable[[FmnistHiresSpec, Splits, Log], Tuple[List[dict], str]]] = {
    'classification': make_classification,
    'segmentation': make_segmentation,
}


def write_dataset(spec: FmnistHiresSpec, log: Log = print) -> str:
    """Write the spec's set into ``spec.out`` (which must be empty or absent) and its manifest.csv; ``log`` gets a
    line per split. Returns a summary line saying how to train on it.

    Raises ValueError for a bad spec, a non-empty ``out``, malformed IDX files or too few items of a class, and
    FileNotFoundError (saying how to install them) for missing IDX files; every check runs before a file is written.
    """
    spec.check()
    if spec.out.exists() and any(spec.out.iterdir()):
        raise ValueError(f"{spec.out} is not empty; choose a new output folder (old files would mix with new ones)")
    splits = {split: load_split(spec.idx_dir, split) for split in IDX_STEMS}
    rows, summary = WRITERS[spec.task](spec, splits, log)
    write_manifest(spec.out / 'manifest.csv', rows)
    return summary
