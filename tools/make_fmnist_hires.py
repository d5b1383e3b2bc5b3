"""Write a high-resolution classification or segmentation set from Fashion-MNIST, in the layouts linvit reads.

--task cls (default): each image is one Fashion-MNIST item, upscaled 2x-6x and placed at random on a --size px
canvas (default 512), among fragments of other items (clutter) on a smooth random background. The class is the whole
item's, so the model has to find one object in a large image and not be fooled by pieces of others.

--task seg: each image is a --size px canvas (default 1024) with --items-per-image items (3-8), each upscaled 2x-6x
and dropped at random on a smooth background, overlaps allowed (a later item covers an earlier one). Every pixel an
item paints (its upscaled pixels brighter than 10: fainter ones are specks and rims, left transparent) is labelled
with its class + 1, everything else 0 (background). There is no fragment clutter here, so every labelled pixel
belongs to a whole item.

    sudo apt-get install dataset-fashion-mnist     # IDX files under /usr/share/datasets/fashion-mnist/
    python tools/make_fmnist_hires.py --out data/fmnist_hires --size 512 --train-per-class 600 --val-per-class 100
    python tools/make_fmnist_hires.py --task seg --out data/fmnist_seg --size 1024 --train-images 2000 --val-images 200

cls writes out/train/<class>/*.png and out/val/<class>/*.png; seg writes out/{train,val}/images/*.png,
out/{train,val}/masks/*.png (mode L class ids) and out/classes.txt ('background' then the 10 classes). All images
are 8-bit grey PNGs; train items come from the train IDX files, val items from t10k. out/manifest.csv has one row per
item with its box (cls: per image; seg: per item, in drawing order). The same arguments write the same files.
"""
import argparse
import csv
import functools
import gzip
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from PIL import Image
from tool_cli import HelpFormatter

DEFAULT_IDX_DIR = Path('/usr/share/datasets/fashion-mnist')
# Fashion-MNIST's labels 0-9, spelled as folder names ('T-shirt/top' has a slash)
CLASS_NAMES = ('t-shirt_top', 'trouser', 'pullover', 'dress', 'coat', 'sandal', 'shirt', 'sneaker', 'bag',
               'ankle_boot')
IDX_STEMS = {'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
             'val': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte')}
IDX_UBYTE = 0x08
ITEM_SIDE = 28
MIN_SIZE = 64
MIN_SCALE, MAX_SCALE = 2.0, 6.0
SPLIT_IDS = {'train': 0, 'val': 1}
DEFAULT_SIZES = {'cls': 512, 'seg': 1024}
BACKGROUND = 'background'   # seg: mask value 0; item classes are 1 + their Fashion-MNIST label
# numpy stream ids under (seed, split): cls chooses items on stream 0 and renders image i on (1, i); seg renders
# image i on (2, i)
_SEG_STREAM = 2
# seg: item pixels at or below this grey are transparent (neither painted nor labelled). 6% of Fashion-MNIST's
# non-zero pixels are <= 10, nearly all specks and the faint rim around an item, not parts of the garment.
SEG_PAINT_THRESHOLD = 10


@dataclass(frozen=True)
class Placement:
    """Where the item landed on its canvas: top-left corner and side of the upscaled square, in pixels."""
    top: int
    left: int
    side: int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument('--out', type=Path, required=True, help='output folder (must be empty or absent)')
    p.add_argument('--task', choices=sorted(TASKS), default='cls',
                   help='cls: one item per image, ImageFolder layout; seg: several items per image, images/ + masks/')
    p.add_argument('--size', type=int, default=None,
                   help=f"canvas side in pixels (>= {MIN_SIZE}; default: {DEFAULT_SIZES['cls']} for cls, "
                        f"{DEFAULT_SIZES['seg']} for seg)")
    p.add_argument('--train-per-class', type=int, default=600, help='cls: train images per class (<= 6000)')
    p.add_argument('--val-per-class', type=int, default=100, help='cls: val images per class (<= 1000)')
    p.add_argument('--train-images', type=int, default=2000, help='seg: train images')
    p.add_argument('--val-images', type=int, default=200, help='seg: val images')
    p.add_argument('--items-per-image', type=int, nargs=2, default=[3, 8], metavar=('MIN', 'MAX'),
                   help='seg: items on each image, drawn uniformly from MIN..MAX')
    p.add_argument('--seed', type=int, default=0, help='fixes the choice of items and every image (>= 0)')
    p.add_argument('--workers', type=int, default=min(8, os.cpu_count() or 1),
                   help='processes rendering and saving PNGs (the output does not depend on it)')
    p.add_argument('--idx-dir', type=Path, default=DEFAULT_IDX_DIR,
                   help='folder with the Fashion-MNIST IDX files (.gz or not)')
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.size is None:
        args.size = DEFAULT_SIZES[args.task]
    if args.size < MIN_SIZE:
        p.error(f'--size must be >= {MIN_SIZE}, got {args.size}')
    if args.seed < 0:
        p.error(f'--seed must be >= 0, got {args.seed}')
    if args.train_per_class < 1 or args.val_per_class < 1:
        p.error('--train-per-class and --val-per-class must be >= 1')
    if args.train_images < 1 or args.val_images < 1:
        p.error('--train-images and --val-images must be >= 1')
    low, high = args.items_per_image
    if not 1 <= low <= high:
        p.error(f'--items-per-image MIN MAX needs 1 <= MIN <= MAX, got {low} {high}')
    return args


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


def load_split(idx_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
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

def scale_range(size: int) -> tuple[float, float]:
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


def add_fragments(canvas: np.ndarray, rng: np.random.Generator, pool: np.ndarray) -> None:
    """Clutter: small crops of random other items, upscaled like items are, pasted anywhere."""
    size = canvas.shape[0]
    low, high = scale_range(size)
    for _ in range(max(3, round(12 * (size / 512) ** 2))):
        crop = int(rng.integers(6, 13))
        y, x = rng.integers(2, ITEM_SIDE - crop - 1, size=2)
        fragment = pool[rng.integers(len(pool))][y:y + crop, x:x + crop]
        side = max(1, min(size, round(crop * rng.uniform(low, high))))
        top, left = rng.integers(0, size - side + 1, size=2)
        paste(canvas, upscale(fragment, side), int(top), int(left))


def render_canvas(item: np.ndarray, pool: np.ndarray, size: int, rng: np.random.Generator
                  ) -> tuple[np.ndarray, Placement]:
    """One image uint8 [size, size]: ``item`` [28, 28] upscaled at a random place over clutter from ``pool``
    [N, 28, 28]. The item is pasted last, so all of its non-zero pixels are on the canvas unchanged."""
    canvas = smooth_background(rng, size)
    add_fragments(canvas, rng, pool)
    side = round(ITEM_SIDE * rng.uniform(*scale_range(size)))
    top, left = (int(v) for v in rng.integers(0, size - side + 1, size=2))
    paste(canvas, upscale(item, side), top, left)
    return canvas, Placement(top, left, side)


def render_seg_canvas(items: np.ndarray, labels: np.ndarray, size: int, rng: np.random.Generator
                      ) -> tuple[np.ndarray, np.ndarray, list[Placement]]:
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
               seed: int) -> dict:
    """Render and save item ``index`` of ``images``; returns its manifest row."""
    # one stream per item: an image depends on (seed, split, item) only, not on order or worker
    rng = np.random.default_rng([seed, SPLIT_IDS[split], 1, index])
    canvas, at = render_canvas(images[index], images, size, rng)
    name = CLASS_NAMES[labels[index]]
    path = Path(split) / name / f'{split}-{index:05d}.png'
    Image.fromarray(canvas).save(out / path)
    return {'split': split, 'path': path.as_posix(), 'class_name': name, 'label': int(labels[index]),
            'source_index': index, 'top': at.top, 'left': at.left, 'side': at.side}


def write_split(out: Path, split: str, images: np.ndarray, labels: np.ndarray, chosen: np.ndarray, size: int,
                seed: int, workers: int = 1) -> list[dict]:
    """Render and save the items ``chosen`` (indices into ``images``) of one split; returns its manifest rows."""
    for name in CLASS_NAMES:
        (out / split / name).mkdir(parents=True, exist_ok=True)
    job = functools.partial(write_item, out, split, images, labels, size=size, seed=seed)
    return map_jobs(job, [int(i) for i in chosen], workers)


def write_seg_image(out: Path, split: str, images: np.ndarray, labels: np.ndarray, index: int, size: int, seed: int,
                    items_per_image: tuple[int, int]) -> list[dict]:
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
                    seed: int, items_per_image: tuple[int, int], workers: int = 1) -> list[dict]:
    """Render and save ``num_images`` segmentation images of one split; returns its manifest rows (per item)."""
    for folder in ('images', 'masks'):
        (out / split / folder).mkdir(parents=True, exist_ok=True)
    job = functools.partial(write_seg_image, out, split, images, labels, size=size, seed=seed,
                            items_per_image=tuple(items_per_image))
    return [row for rows in map_jobs(job, list(range(num_images)), workers) for row in rows]


def map_jobs(job: Callable[[int], Any], indices: list[int], workers: int) -> list:
    """``[job(i) for i in indices]``, on ``workers`` processes when more than one (the order is kept)."""
    if workers <= 1:
        return [job(index) for index in indices]
    with ProcessPoolExecutor(workers, initializer=_set_job, initargs=(job,)) as pool:
        return list(pool.map(_run_job, indices, chunksize=32))


_JOB: Callable[[int], Any] | None = None   # set once per worker process, so the images are sent once, not per item


def _set_job(job: Callable[[int], Any]) -> None:
    global _JOB
    _JOB = job


def _run_job(index: int) -> Any:
    return _JOB(index)


def write_manifest(path: Path, rows: list[dict]) -> None:
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


Splits = dict[str, tuple[np.ndarray, np.ndarray]]


def make_classification(args: argparse.Namespace, splits: Splits) -> tuple[list[dict], str]:
    """The ImageFolder set; returns the manifest rows (one per image) and a summary line."""
    per_class = {'train': args.train_per_class, 'val': args.val_per_class}
    chosen = {split: choose_items(labels, per_class[split],
                                  np.random.default_rng([args.seed, SPLIT_IDS[split], 0]), split)
              for split, (_, labels) in splits.items()}
    rows = []
    for split, (images, labels) in splits.items():
        start = time.perf_counter()
        rows += write_split(args.out, split, images, labels, chosen[split], args.size, args.seed, args.workers)
        print(f"{split}: {len(chosen[split])} images of {args.size} px in {time.perf_counter() - start:.1f} s "
              f"-> {args.out / split}")
    return rows, (f"wrote {len(rows)} images and {args.out / 'manifest.csv'}; train with data.name=folder "
                  f"data.root={args.out}")


def make_segmentation(args: argparse.Namespace, splits: Splits) -> tuple[list[dict], str]:
    """The images/ + masks/ set and classes.txt; returns the manifest rows (one per item) and a summary line."""
    counts = {'train': args.train_images, 'val': args.val_images}
    for split, (images, _) in splits.items():
        if len(images) == 0:
            raise ValueError(f"{args.idx_dir}: the {split} IDX files hold no items")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / 'classes.txt').write_text('\n'.join([BACKGROUND, *CLASS_NAMES]) + '\n')
    rows = []
    for split, (images, labels) in splits.items():
        start = time.perf_counter()
        rows += write_seg_split(args.out, split, images, labels, counts[split], args.size, args.seed,
                                args.items_per_image, args.workers)
        print(f"{split}: {counts[split]} images and masks of {args.size} px in {time.perf_counter() - start:.1f} s "
              f"-> {args.out / split}")
    return rows, (f"wrote {sum(counts.values())} images with {len(rows)} items, {args.out / 'classes.txt'} and "
                  f"{args.out / 'manifest.csv'}; train with --config configs/seg_folder.yaml data.root={args.out}")


TASKS: dict[str, Callable[[argparse.Namespace, Splits], tuple[list[dict], str]]] = {
    'cls': make_classification,
    'seg': make_segmentation,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"error: {args.out} is not empty; choose a new --out (old files would mix with new ones)")
    try:
        splits = {split: load_split(args.idx_dir, split) for split in IDX_STEMS}
        rows, summary = TASKS[args.task](args, splits)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    write_manifest(args.out / 'manifest.csv', rows)
    print(summary)
    return 0


if __name__ == '__main__':
    sys.exit(main())
