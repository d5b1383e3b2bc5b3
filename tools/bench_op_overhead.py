#!/usr/bin/env python
"""The attention op's per-call overhead: the registered op against a plain torch.autograd.Function running the same
PyTorch math, forward+backward on tiny tensors, medians of interleaved calls. On CUDA the op runs its Triton kernels
and the table adds their GPU time per call (wall time far above it is host overhead). The library is
``linvit.bench.op_overhead``.

    python tools/bench_op_overhead.py                           # CPU, 16 tokens, one 16-wide head
    python tools/bench_op_overhead.py --tokens 16 256 --repeats 1000
    python tools/bench_op_overhead.py --device cuda --batch 8 --heads 16 --head-dim 64 --dtype bfloat16 --tokens 1024
"""
import argparse
import sys
from typing import List, Optional

from linvit.bench.cli import HelpFormatter, precision_arg
from linvit.precision import PRECISIONS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--device', default='cpu', help="torch device: 'cpu' or 'cuda'")
    parser.add_argument('--tokens', type=int, nargs='+', default=[16], metavar='N', help='token counts')
    parser.add_argument('--batch', type=int, default=1, help='sequences per call')
    parser.add_argument('--heads', type=int, default=1, help='attention heads')
    parser.add_argument('--head-dim', type=int, default=16, help='width of a head')
    parser.add_argument('--dtype', type=precision_arg, choices=list(PRECISIONS), default='float32',
                        help='precision of q, k, v')
    parser.add_argument('--repeats', type=int, default=300, help='timed calls of each, interleaved')
    parser.add_argument('--warmup', type=int, default=50, help='untimed calls of each first')
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from linvit.bench.cli import measurement_threads
    from linvit.bench.op_overhead import markdown, measure
    # the host work is single-threaded; threads would only add noise to tiny math
    threads = measurement_threads(1, args.device).apply()
    rows = measure(args.device, args.tokens, args.batch, args.heads, args.head_dim, PRECISIONS[args.dtype],
                   args.repeats, args.warmup)
    print('\n'.join([*threads.warning_lines(), markdown(rows)]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
