"""Write a high-resolution classification or segmentation set from Fashion-MNIST, in the layouts linvit reads.

--task classification (default): each image is one Fashion-MNIST item, upscaled 2x-6x and placed at random on a
--img-size px canvas (default 512), among fragments of other items (clutter) on a smooth random background. The class is
the whole item's, so the model has to find one object in a large image and not be fooled by pieces of others.
--fragments sets the number of clutter pieces (default 12 per 512 x 512 px, at least 3); --fragments 0 leaves only
the item on the background.

--task segmentation: each image is a --img-size px canvas (default 1024) with --items-per-image items (3-8), each
upscaled 2x-6x and dropped at random on a smooth background, overlaps allowed (a later item covers an earlier one).
Every pixel an item paints (its upscaled pixels brighter than 10: fainter ones are specks and rims, left transparent)
is labelled with its class + 1, everything else 0 (background). There is no fragment clutter here, so every labelled
pixel belongs to a whole item.

    sudo apt-get install dataset-fashion-mnist     # IDX files under /usr/share/datasets/fashion-mnist/
    python tools/make_fmnist_hires.py --out data/fmnist_hires --img-size 512 --train-per-class 600 --val-per-class 100
    python tools/make_fmnist_hires.py --task segmentation --out data/fmnist_seg --img-size 1024 --train-images 2000 \\
        --val-images 200

classification writes out/train/<class>/*.png and out/val/<class>/*.png; segmentation writes
out/{train,val}/images/*.png, out/{train,val}/masks/*.png (mode L class ids) and out/classes.txt ('background' then
the 10 classes). All images are 8-bit grey PNGs; train items come from the train IDX files, val items from t10k.
out/manifest.csv has one row per item with its box (classification: per image; segmentation: per item, in drawing
order). The same arguments write the same files. The library: linvit.data.fmnist_hires.
"""
import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

from linvit.bench.cli import HelpFormatter
from linvit.data.fmnist_hires import (
    DEFAULT_IDX_DIR,
    DEFAULT_SIZES,
    MIN_SIZE,
    WRITERS,
    FmnistHiresSpec,
    write_dataset,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument('--out', type=Path, required=True, help='output folder (must be empty or absent)')
    p.add_argument('--task', choices=list(WRITERS),
                   default='classification',
                   help='classification: one item per image, ImageFolder layout; segmentation: several items per '
                        'image, images/ + masks/')
    p.add_argument('--img-size', type=int, default=None, metavar='PX',
                   help=f"canvas side in pixels (>= {MIN_SIZE}; default: {DEFAULT_SIZES['classification']} for "
                        f"classification, {DEFAULT_SIZES['segmentation']} for segmentation)")
    p.add_argument('--train-per-class', type=int, default=600, help='classification: train images per class (<= 6000)')
    p.add_argument('--val-per-class', type=int, default=100, help='classification: val images per class (<= 1000)')
    p.add_argument('--train-images', type=int, default=2000, help='segmentation: train images')
    p.add_argument('--val-images', type=int, default=200, help='segmentation: val images')
    p.add_argument('--items-per-image', type=int, nargs=2, default=[3, 8], metavar=('MIN', 'MAX'),
                   help='segmentation: items on each image, drawn uniformly from MIN..MAX')
    p.add_argument('--fragments', type=int, default=None,
                   help='classification: pieces of other items cluttering each image (default: 12 per 512 x 512 px, '
                        'at least 3; 0 gives a clean background)')
    p.add_argument('--seed', type=int, default=0, help='fixes the choice of items and every image (>= 0)')
    p.add_argument('--workers', type=int, default=min(8, os.cpu_count() or 1),
                   help='processes rendering and saving PNGs (the output does not depend on it)')
    p.add_argument('--idx-dir', type=Path, default=DEFAULT_IDX_DIR,
                   help='folder with the Fashion-MNIST IDX files (.gz or not)')
    return p


def spec_of(args: argparse.Namespace) -> FmnistHiresSpec:
    return FmnistHiresSpec(out=args.out, task=args.task, size=args.img_size, train_per_class=args.train_per_class,
                           val_per_class=args.val_per_class, train_images=args.train_images,
                           val_images=args.val_images, items_per_image=tuple(args.items_per_image),
                           fragments=args.fragments, seed=args.seed,
                           workers=args.workers, idx_dir=args.idx_dir)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The arguments, with --img-size set to the task's default when not given; a bad value ends in a usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.img_size = DEFAULT_SIZES[args.task] if args.img_size is None else args.img_size
    try:
        spec_of(args).check()
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        print(write_dataset(spec_of(args)))
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    return 0


if __name__ == '__main__':
    sys.exit(main())
