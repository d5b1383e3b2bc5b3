#!/usr/bin/env python
"""One attention layer at growing token counts: timm's softmax Attention (SDPA), LinearAttention, and the floor.

The floor is the same layer with token mixing removed (qkv + proj only): what any attention must pay at least.
All layers run in one process, interleaved per repeat so that machine noise hits them alike; the table reports
median milliseconds and ratios, and the crossover N from which linear attention beats softmax.

    python tools/bench_attention.py                  # N = 49 .. 16384, width 384, 6 heads, float32, batch 1
    python tools/bench_attention.py --quick          # fewer sizes and repeats (the `make demo` run)
    python tools/bench_attention.py --tokens 256 1024 4096 --feature-map relu --csv bench.csv
    python tools/bench_attention.py --compile         # all three layers through linvit.fast.compile_model
    python tools/bench_attention.py --threads 1       # one thread, whatever the machine's load

On a CPU ``--threads auto`` (the default) uses the cores other processes leave free when the run starts; the heading
says how many threads ran and the load, and a line starting 'WARNING busy machine' says when the threads share cores
with other processes (then the times and ratios are noise).

With ``--compile`` each layer is compiled (inductor, static shapes, one graph per N; the first warm-up call of each
N compiles and is not timed), so the comparison is compiled linear attention against compiled SDPA attention.
The library is ``linvit.bench.attention``.
"""
import argparse
import sys
from typing import List, Optional

from linvit.bench.attention import FULL, QUICK, AttentionBench, run
from linvit.bench.cli import THREADS_HELP, HelpFormatter, precision_arg, threads_arg
from linvit.ops import list_feature_maps
from linvit.precision import PRECISIONS
from linvit.timing import write_csv


def _words(values: List[int]) -> str:
    return ' '.join(map(str, values))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--tokens', type=int, nargs='+', metavar='N',
                        help=f'token counts (default: {_words(FULL[0])}; with --quick: {_words(QUICK[0])})')
    parser.add_argument('--dim', type=int, default=384, help='width of the layer (channels per token)')
    parser.add_argument('--heads', type=int, default=6, help='attention heads (dim must divide by them)')
    parser.add_argument('--batch', type=int, default=1, help='sequences per call')
    parser.add_argument('--dtype', type=precision_arg, choices=list(PRECISIONS), default='float32',
                        help='precision of weights and input')
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
    parser.add_argument('--threads', type=threads_arg, default='auto', help=THREADS_HELP)
    parser.add_argument('--compile', action='store_true',
                        help='time the layers compiled by linvit.fast.compile_model (torch.compile, inductor)')
    parser.add_argument('--csv', help='also write the table to this CSV file (times in ms)')
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse, fill the defaults of the full or --quick run, and check (``args.bench`` is what to measure)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    tokens, warmup, repeats = QUICK if args.quick else FULL
    args.tokens = args.tokens or tokens
    args.warmup = warmup if args.warmup is None else args.warmup
    args.repeats = repeats if args.repeats is None else args.repeats
    if args.compile:
        args.warmup = max(args.warmup, 1)  # the first call of each N compiles: never time it
    try:
        args.bench = AttentionBench(args.tokens, args.dim, args.heads, args.batch, args.dtype, args.feature_map,
                                    args.local_mix, args.warmup, args.repeats, args.device, args.compile, args.quick,
                                    args.threads)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rows = run(args.bench)
    if args.csv:
        write_csv(args.csv, rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
