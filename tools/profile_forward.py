#!/usr/bin/env python
"""Forward time and memory of linvit vs timm's softmax ViT-S at one image size (or a few): a preset of
profile_resolution.py.

    python tools/profile_forward.py --sizes 1024 --repeats 5
    python tools/profile_forward.py --sizes 768x1280 --threads 2 --rounds 3   # other options go to profile_resolution

It runs profile_resolution's sweep with these models at ``--sizes`` (as profile_resolution's), eager, float32,
batch 1, inference:
    linvit_small_patch16_512                    linear attention + local mixing
    linvit_small_patch16_512:local_mix=False    linear attention only
    vit_small_patch16_224                       timm's softmax ViT-S (built at each size)
    and the floor of each linvit model: the same model with token mixing removed
Each configuration runs in its own process; see profile_resolution.py for what is measured and printed. Any option
not listed below (--floors, --threads, --rounds, --device, --mode, --models, ...) is one of profile_resolution.py's
and overrides the preset. A configuration that fails (e.g. a size the patch does not divide) prints the model's
error message and makes the exit status 1.
"""
import argparse
import os
import sys
import tempfile
from typing import List, Optional, Sequence

from linvit.bench import profile_cli
from linvit.bench.cli import HelpFormatter

PRESET_MODELS = ['linvit_small_patch16_512', 'linvit_small_patch16_512:local_mix=False', 'vit_small_patch16_224']
DEFAULT_OUT = os.path.join(tempfile.gettempdir(), 'linvit_profile_forward')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--sizes', nargs='+', default=['1024'], metavar='SIZE', help='image sizes, N or HxW')
    parser.add_argument('--warmup', type=int, default=1, help='untimed forwards before timing, >= 1')
    parser.add_argument('--repeats', type=int, default=5, help='timed forwards per model')
    parser.add_argument('--out', default=DEFAULT_OUT, help='directory for profile.csv and the PNG')
    return parser


def preset_argv(sizes: Sequence[str], warmup: int, repeats: int, out: str, passed_on: List[str]) -> List[str]:
    """profile_resolution's arguments for this preset; ``passed_on`` comes last, so its options win."""
    return ['--models', *PRESET_MODELS, '--floors', 'linvit', '--sizes', *sizes, '--mode', 'eager', '--dtype',
            'float32', '--batch', '1', '--workload', 'inference', '--warmup', str(warmup), '--repeats', str(repeats),
            '--out', out, *passed_on]


def main(argv: Optional[List[str]] = None) -> int:
    args, passed_on = build_parser().parse_known_args(argv)
    return profile_cli.main(preset_argv(args.sizes, args.warmup, args.repeats, args.out, passed_on))


if __name__ == '__main__':
    sys.exit(main())
