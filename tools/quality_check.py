#!/usr/bin/env python
"""The quality check: linvit against timm's softmax ViT at high resolution, trained through the engine in minutes on a
GPU.

Every run is its own process with a deadline (``linvit.engine``'s train, evaluate or linearize; no train.py, no
configs/ needed); a run the budget cuts is a row that says so, never estimated:

1. linvit-Tiny vs ViT-Tiny and linvit-Small vs ViT-Small at 512 px, the same recipe and number of steps;
2. the same pairs at 1024 px for the same training seconds (each model's steps from its own step time, measured
   alone on the device before any run);
3. a softmax ViT-Small teacher trained at 256 px, linearized and fine-tuned at 1024 px, against the teacher itself
   evaluated at 1024 px.

The data: Fashion-MNIST items alone on 256, 512 and 1024 px canvases, rendered once from the IDX files in
--fmnist-dir into --cache-dir (with their decoded-image caches) and reused by later runs. The recipes:
linvit.bench.quality.recipe (configs/cls_fmnist_quality.yaml and configs/linearize_cls_fmnist.yaml say the same for
train.py). Output in --out: quality_check.md (the table; the comparisons with their targets: linvit within 1 top-1
point of softmax at equal steps and ahead at equal seconds, the linearized model at 98% of its teacher or more,
ViT-Tiny at 85% or more; the measured step times; also printed), quality_check.csv (one row per run),
quality_check.png (top-1 against steps and against training seconds), logs/ and runs/ (the run folders). The exit
status is 1 when a run failed with an error, else 0. The library, with the recipe's reasons: linvit.bench.quality.

    make gpu-quality                                     # the first CUDA device, at most 5 minutes (then the grid)
    python tools/quality_check.py --device cuda:0 --fmnist-dir .gpudata/fashion-mnist
    python tools/quality_check.py --device cpu --quick   # the same code at tiny sizes (under a minute on 2 cores)

--grid cpu|gpu trains the quality grid instead: timm's softmax ViT-Tiny and linvit-Tiny in every linear configuration
(elu1, relu, focused, inline, mala, nala, polar; linvit.bench.quality.grid.CONFIGS), each with local mix on and off,
on the same recipe, number of steps and seeds (0, 1, 2), for classification (Fashion-MNIST items on canvases) and
segmentation (several items a canvas, mIoU; local mix on only). cpu: 128 px, depth-4 models, batch 32, 69 runs one
after another, about an hour on 2 cores; gpu: 512 px, full depth, batch 64, bfloat16, ~15 s a run. Output in --out
(default runs/quality_grid): quality_grid.md (the command that reproduces it, then per task a row per configuration:
mean and spread of top-1 or mIoU over the seeds that finished, img/s, gap to softmax in points; also printed),
quality_grid.csv (one row per run, a failed run with its error) and quality_grid.png (bars with error bars).

    make quality-grid                                    # the CPU grid (about an hour)
    python tools/quality_check.py --grid gpu --device cuda:0 --fmnist-dir .gpudata/fashion-mnist
    python tools/quality_check.py --grid cpu --device cpu --quick   # 2 configurations, 1 seed, 2 steps a run
"""
import argparse
import sys
import time
from typing import List, Optional

from linvit.bench.cli import HelpFormatter, exit_without_cuda_device
from linvit.bench.processes import process_age_s
from linvit.bench.quality import (
    DEFAULT_FMNIST_DIR,
    FULL,
    GRID_PRESETS,
    PIPELINES,
    QUICK,
    GridSettings,
    QualitySettings,
    run_quality_check,
    run_quality_grid,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--device', default='cuda:0', help="torch device: the first CUDA device, or 'cpu'")
    parser.add_argument('--quick', action='store_true',
                        help='tiny sizes (64 and 128 px canvases, 20 images a set, depth-2 models, 1-2 steps a run), '
                             'the same code: for a CPU')
    parser.add_argument('--grid', choices=list(GRID_PRESETS),
                        help='train the quality grid instead of the check: every linear configuration (local mix on '
                             'and off) and softmax on one recipe, steps and seeds, classification and segmentation; '
                             'cpu: 128 px, depth 4, about an hour on 2 cores; gpu: 512 px, full depth (default: the '
                             'check, no grid)')
    parser.add_argument('--seeds', type=int,
                        help="with --grid: train seeds 0..SEEDS-1 (default: the grid's 3; with --quick 1)")
    parser.add_argument('--out',
                        help='output folder: table, CSV, plot, logs and the run folders (default: runs/quality_check; '
                             'with --grid: runs/quality_grid)')
    parser.add_argument('--budget-s', type=float,
                        help=f'total seconds, everything included (default: {FULL.budget_s:.0f}; with --quick: '
                             f'{QUICK.budget_s:.0f})')
    parser.add_argument('--fmnist-dir', default=DEFAULT_FMNIST_DIR,
                        help='folder of the Fashion-MNIST IDX files (train-*-ubyte[.gz], t10k-*-ubyte[.gz]); the '
                             'environment variable FMNIST_DIR sets the default')
    parser.add_argument('--cache-dir', default='build/quality_check_cache',
                        help='the rendered sets and their decoded-image caches, kept for reruns')
    parser.add_argument('--pipeline', choices=list(PIPELINES), default='cached',
                        help="the runs' input pipeline: 'cached' (data.cache=true: decoded once, augmented in batches "
                             "on the device) or 'albumentations' (per-image decoding in the loader's workers)")
    return parser


def parse_args(argv: Optional[List[str]] = None) -> QualitySettings:
    """The resolved settings (budget filled, absolute paths), GridSettings with --grid; a bad value is a usage
    error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_without_cuda_device(parser, args.device)  # before anything runs
    if args.grid is None and args.seeds is not None:
        parser.error('--seeds needs --grid')
    if args.grid is not None and args.budget_s is not None:
        parser.error('--budget-s is the check\'s; a grid has a fixed number of steps per run (--seeds sets its size)')
    common = dict(device=args.device, quick=args.quick, fmnist_dir=args.fmnist_dir, cache_dir=args.cache_dir,
                  pipeline=args.pipeline, **({'out': args.out} if args.out else {}))
    if args.grid is not None:
        settings = GridSettings(grid=args.grid, seeds=args.seeds, **common)
    else:
        settings = QualitySettings(budget_s=args.budget_s, **common)
    try:
        return settings.resolved()
    except ValueError as err:
        parser.error(str(err))


def main(argv: Optional[List[str]] = None) -> int:
    settings = parse_args(argv)
    # run as a script, the budget counts this process's start and imports too
    start = time.time() - (process_age_s() if argv is None else 0.0)
    if isinstance(settings, GridSettings):
        return run_quality_grid(settings, start)
    return run_quality_check(settings, start)


if __name__ == '__main__':
    sys.exit(main())
