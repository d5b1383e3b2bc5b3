#!/usr/bin/env python
"""Whole-model training steps in one process, interleaved: a linvit model, its floor and its softmax counterpart.

A step is ``linvit.fast.TrainStep``: forward, cross-entropy and backward (no optimizer), eager or compiled. The
three models (the floor is the linvit model with token mixing removed, ``linvit.fast.make_floor``) are built at each
image size and stepped in turn, one step of each per round, so that the machine's drift hits them alike; the table
gives median milliseconds per step, images/s and the ratios linvit/floor and linvit/softmax (of images/s: above 1
means linvit is faster). Peak memory needs a process per model: ``tools/profile_resolution.py --task train``.

    python tools/bench_train_step.py                                   # ViT-S/16 at 512 px, batch 2, eager and compiled
    python tools/bench_train_step.py --sizes 1024 --batch 2 --mode compiled --repeats 5
    python tools/bench_train_step.py --sizes 2048 --batch 1 --softmax none --csv /tmp/step.csv
    python tools/bench_train_step.py --model linvit_small_patch16_224:feature_map='relu' --dtype bf16

The compiled mode compiles each model's step once per size (the first warm-up step, not timed). On CPU the system
allocator hands large freed buffers back and faults them in again on the next step; ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` (see ``profile_resolution.py --retain-freed-memory``) keep them, for steadier ratios.
"""
import argparse
import sys
from typing import Any, Dict, List, Optional

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from bench_attention import time_interleaved, write_csv
from profile_resolution import ModelSpec, allocator_setting, parse_model_spec, parse_size, size_label
from tool_cli import HelpFormatter

import linvit  # noqa: F401  (registers linvit_* with timm)
from linvit import fast

DTYPES = {'fp32': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}
MODES = ('eager', 'compiled')
KINDS = ('linvit', 'floor', 'softmax')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--model', default='linvit_small_patch16_224:local_mix=False', metavar='SPEC',
                        help="the linvit model, name[:key=value,...] as in profile_resolution.py")
    parser.add_argument('--softmax', default='auto', metavar='NAME',
                        help="the softmax model to compare with: a timm name, 'auto' (vit_<rest> for linvit_<rest>) "
                             "or 'none'")
    parser.add_argument('--sizes', nargs='+', type=parse_size, default=[(512, 512)], metavar='SIZE',
                        help='image sizes, N or HxW')
    parser.add_argument('--batch', type=int, default=2, help='images per step')
    parser.add_argument('--mode', nargs='+', choices=MODES, default=list(MODES), help='eager and/or compiled steps')
    parser.add_argument('--dtype', choices=sorted(DTYPES), default='fp32',
                        help='fp32, or autocast to bf16/fp16 around forward and loss (weights stay float32)')
    parser.add_argument('--warmup', type=int, default=1, help='untimed steps of each model (the first compiles), >= 1')
    parser.add_argument('--repeats', type=int, default=3, help='timed rounds: one step of each model per round')
    parser.add_argument('--device', default='cpu', help="torch device, e.g. 'cpu' or 'cuda'")
    parser.add_argument('--csv', help='also write the table to this CSV file (times in ms)')
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.repeats < 1 or args.batch < 1:
        parser.error('--warmup, --repeats and --batch must be >= 1')
    try:
        args.model = parse_model_spec(args.model)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.model.name.startswith('linvit_'):
        parser.error(f"--model must be a linvit_* model (its floor and softmax counterpart are derived from it), got "
                     f"{args.model.name!r}")
    if args.softmax == 'auto':
        args.softmax = f"vit_{args.model.name[len('linvit_'):]}"
    args.softmax = None if args.softmax == 'none' else args.softmax
    if args.softmax is not None and not timm.is_model(args.softmax):
        parser.error(f"--softmax {args.softmax!r} is not a timm model; name one (e.g. vit_small_patch16_224) or "
                     f"pass --softmax none")
    return args


def build_models(spec: ModelSpec, softmax: Optional[str], height: int, width: int,
                 device: str) -> Dict[str, nn.Module]:
    """linvit, its floor (same weights, token mixing removed) and the softmax model, in train mode on ``device``."""
    torch.manual_seed(0)
    models = {'linvit': timm.create_model(spec.name, img_size=(height, width), **dict(spec.kwargs))}
    floor = timm.create_model(spec.name, img_size=(height, width), **dict(spec.kwargs))
    floor.load_state_dict(models['linvit'].state_dict())
    models['floor'] = fast.make_floor(floor)
    if softmax:
        models['softmax'] = timm.create_model(softmax, img_size=(height, width))
    return {kind: model.to(device).train() for kind, model in models.items()}


def measure_size(args: argparse.Namespace, height: int, width: int, mode: str) -> Dict[str, Any]:
    """One table row: median ms per step of each model at (height, width) in ``mode``, and the ratios."""
    models = build_models(args.model, args.softmax, height, width, args.device)
    images = torch.randn(args.batch, 3, height, width, device=args.device)
    targets = torch.randint(0, models['linvit'].num_classes, (args.batch,), device=args.device)
    steps = {kind: fast.TrainStep(model, F.cross_entropy, compile=mode == 'compiled', amp_dtype=DTYPES[args.dtype])
             for kind, model in models.items()}
    calls = {kind: (lambda step=step: step(images, targets)) for kind, step in steps.items()}
    ms = time_interleaved(calls, args.warmup, args.repeats, args.device)
    row: Dict[str, Any] = {'size': size_label(height, width), 'batch': args.batch, 'mode': mode, 'dtype': args.dtype}
    for kind in KINDS:
        row[f"{kind}_ms"] = ms.get(kind)
        row[f"{kind}_img_per_s"] = args.batch * 1e3 / ms[kind] if kind in ms else None
    row['linvit_over_floor'] = ms['floor'] / ms['linvit']
    row['linvit_over_softmax'] = ms['softmax'] / ms['linvit'] if 'softmax' in ms else None
    return row


def format_row(row: Dict[str, Any]) -> str:
    def cell(value: Optional[float], digits: int, suffix: str = '') -> str:
        return '-' if value is None else f"{value:.{digits}f}{suffix}"

    return (f"{row['size']:>9} {row['batch']:>5} {row['mode']:>9} "
            + ' '.join(f"{cell(row[f'{kind}_ms'], 0):>10}" for kind in KINDS)
            + f" {cell(row['linvit_over_floor'], 2, 'x'):>13} {cell(row['linvit_over_softmax'], 2, 'x'):>15}")


def run(args: argparse.Namespace) -> List[Dict[str, Any]]:
    print(f"# training step (forward, cross-entropy, backward) of {args.model.spec}, its floor and "
          f"{args.softmax or 'no softmax model'}; {args.dtype}, device {args.device}, {torch.get_num_threads()} "
          f"threads, allocator {allocator_setting()}; median of {args.repeats} interleaved rounds after "
          f"{args.warmup} warm-up step(s); ratios of images/s (> 1: linvit faster)")
    print(f"{'size':>9} {'batch':>5} {'mode':>9} " + ' '.join(f"{kind + ' ms':>10}" for kind in KINDS)
          + f" {'linvit/floor':>13} {'linvit/softmax':>15}")
    rows = []
    for height, width in args.sizes:
        for mode in args.mode:
            row = measure_size(args, height, width, mode)
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    if args.csv:
        write_csv(args.csv, rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
