#!/usr/bin/env python
"""One attention layer at growing token counts: timm's softmax Attention (SDPA), LinearAttention, and the floor.

The floor is the same layer with token mixing removed (qkv + proj only): what any attention must pay at least.
All layers run in one process, interleaved per repeat so that machine noise hits them alike; the table reports
median milliseconds and ratios, and the crossover N from which linear attention beats softmax.

    python tools/bench_attention.py                  # N = 49 .. 16384, width 384, 6 heads, fp32, batch 1
    python tools/bench_attention.py --quick          # fewer sizes and repeats (the `make demo` run)
    python tools/bench_attention.py --tokens 256 1024 4096 --feature-map relu --csv bench.csv
    python tools/bench_attention.py --compile         # all three layers through linvit.fast.compile_model

With ``--compile`` each layer is compiled (inductor, static shapes, one graph per N; the first warm-up call of each
N compiles and is not timed), so the comparison is compiled linear attention against compiled SDPA attention.
"""
import argparse
import csv
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
from timm.layers import Attention
from tool_cli import HelpFormatter
from tool_cli import crossover as shared_crossover

from linvit.fast import compile_model
from linvit.layers import LinearAttention, NoMixingAttention
from linvit.ops import list_feature_maps

# (token counts, warm-up calls, timed calls) of the full run and of --quick; explicit options override either
FULL = ([49, 196, 256, 576, 1024, 2304, 4096, 9216, 16384], 2, 7)
QUICK = ([49, 196, 256, 576, 1024, 4096], 1, 3)
DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}
FLOOR_WORDS = 'floor = the same layer with token mixing removed: qkv + proj only (what any attention pays at least)'


def _words(values: List[int]) -> str:
    return ' '.join(map(str, values))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--tokens', type=int, nargs='+', metavar='N',
                        help=f'token counts (default: {_words(FULL[0])}; with --quick: {_words(QUICK[0])})')
    parser.add_argument('--dim', type=int, default=384, help='width of the layer (channels per token)')
    parser.add_argument('--heads', type=int, default=6, help='attention heads (dim must divide by them)')
    parser.add_argument('--batch', type=int, default=1, help='sequences per call')
    parser.add_argument('--dtype', choices=sorted(DTYPES), default='fp32', help='precision of weights and input')
    parser.add_argument('--feature-map', default='elu1', choices=list_feature_maps(),
                        help='feature map phi of linear attention (linvit.ops.FEATURE_MAPS)')
    parser.add_argument('--local-mix', action='store_true', help='add the depthwise-conv branch (square grids)')
    parser.add_argument('--warmup', type=int,
                        help=f'untimed calls per N before timing (default: {FULL[1]}; with --quick: {QUICK[1]}; '
                             f'at least 1 with --compile, whose first call compiles)')
    parser.add_argument('--repeats', type=int,
                        help=f'timed calls per N (default: {FULL[2]}; with --quick: {QUICK[2]})')
    parser.add_argument('--quick', action='store_true',
                        help=f'fewer tokens and calls: N = {_words(QUICK[0])}, {QUICK[1]} warm-up, {QUICK[2]} repeats '
                             f'(--tokens, --warmup, --repeats still win)')
    parser.add_argument('--device', default='cpu', help="torch device to run on, e.g. 'cpu', 'cuda'")
    parser.add_argument('--compile', action='store_true',
                        help='time the layers compiled by linvit.fast.compile_model (torch.compile, inductor)')
    parser.add_argument('--csv', help='also write the table to this CSV file (times in ms)')
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    tokens, warmup, repeats = QUICK if args.quick else FULL
    args.tokens = args.tokens or tokens
    args.warmup = warmup if args.warmup is None else args.warmup
    args.repeats = repeats if args.repeats is None else args.repeats
    if args.compile:
        args.warmup = max(args.warmup, 1)  # the first call of each N compiles: never time it
    if args.warmup < 0 or args.repeats < 1:
        parser.error('--warmup must be >= 0 and --repeats >= 1')
    if args.local_mix:
        bad = [n for n in args.tokens if int(round(n ** 0.5)) ** 2 != n]
        if bad:
            parser.error(f'--local-mix needs square token counts (no prefix tokens), got {bad}')
    return args


def build_layers(args: argparse.Namespace) -> Dict[str, nn.Module]:
    """The three layers with identical projection weights, in eval mode on the target device and dtype (compiled
    by ``linvit.fast.compile_model`` with ``--compile``)."""
    common = dict(dim=args.dim, num_heads=args.heads, qkv_bias=True)
    layers = {
        'softmax': Attention(**common),
        'linear': LinearAttention(**common, feature_map=args.feature_map, local_mix=args.local_mix,
                                  num_prefix_tokens=0),
        'floor': NoMixingAttention(**common),
    }
    state = layers['softmax'].state_dict()
    for layer in layers.values():
        layer.load_state_dict(state, strict=False)
    layers = {name: layer.to(args.device, DTYPES[args.dtype]).eval() for name, layer in layers.items()}
    if args.compile:
        return {name: compile_model(layer) for name, layer in layers.items()}
    return layers


def synchronize(device: str) -> None:
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def time_interleaved(fns: Dict[str, Callable[[], torch.Tensor]], warmup: int, repeats: int,
                     device: str) -> Dict[str, float]:
    """Median milliseconds per call of each function; one call of each per round so drift hits all alike."""
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for round_idx in range(warmup + repeats):
        for name, fn in fns.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            if round_idx >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def crossover(rows: List[Dict[str, float]]) -> Optional[int]:
    """Smallest N from which linear attention is faster than softmax at that and every larger N."""
    return shared_crossover([(int(r['tokens']), 1 / r['linear_ms'], 1 / r['softmax_ms']) for r in rows])


def run(args: argparse.Namespace) -> List[Dict[str, float]]:
    torch.manual_seed(0)
    layers = build_layers(args)
    rows = []
    print(f"# one attention layer: width {args.dim}, {args.heads} heads, batch {args.batch}, {args.dtype}, "
          f"feature map {args.feature_map}{', local mix' if args.local_mix else ''}, device {args.device}, "
          f"{'compiled (inductor)' if args.compile else 'eager'}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} after {args.warmup} warm-up")
    print(f"# {FLOOR_WORDS}")
    print(f"{'N':>7} {'softmax ms':>11} {'linear ms':>10} {'floor ms':>9} {'linear/floor':>13} "
          f"{'softmax/linear':>15}")
    with torch.inference_mode():
        for n in args.tokens:
            x = torch.randn(args.batch, n, args.dim, device=args.device, dtype=DTYPES[args.dtype])
            fns = {name: (lambda layer=layer, x=x: layer(x)) for name, layer in layers.items()}
            ms = time_interleaved(fns, args.warmup, args.repeats, args.device)
            row = {'tokens': n, 'softmax_ms': ms['softmax'], 'linear_ms': ms['linear'], 'floor_ms': ms['floor'],
                   'linear_over_floor': ms['linear'] / ms['floor'], 'softmax_over_linear': ms['softmax'] / ms['linear']}
            rows.append(row)
            print(f"{n:>7} {row['softmax_ms']:>11.3f} {row['linear_ms']:>10.3f} {row['floor_ms']:>9.3f} "
                  f"{row['linear_over_floor']:>12.2f}x {row['softmax_over_linear']:>14.2f}x", flush=True)
    n_cross = crossover(rows)
    if n_cross is None:
        print("linear attention does not beat softmax at the largest N measured")
    else:
        print(f"linear attention beats softmax from N = {n_cross} tokens on (every larger N measured)")
    print(next_steps(args.quick))
    return rows


def next_steps(quick: bool) -> str:
    """Where to go from one layer: the full sweep (after --quick) and whole models across image sizes."""
    full = 'the full sweep: make bench; ' if quick else ''
    return (f"next: {full}whole models vs their floors across image sizes: python tools/profile_resolution.py "
            f"--sizes 224 512 1024 --mode eager")


def write_csv(path: str, rows: List[Dict[str, float]]) -> None:
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    if args.csv:
        write_csv(args.csv, rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
