#!/usr/bin/env python
"""Causal linear attention's forms, forward + backward, interleaved in one process: the chunked form (its
memory-efficient autograd Function) against the masked quadratic parallel form and against non-causal linear
attention (the fused training Function), at several token counts, plain, with a decay and with per-channel gates.

Each call is one attention core on q, k, v [B, H, N, D] (elu1 map) plus the backward of the output's sum of
squares; the table gives median milliseconds, the ratios parallel/chunked (above 1: the chunked form is faster) and
chunked/non-causal (the price of causality), and the bytes each form saves for backward as a multiple of q, k, v
(measured with torch.autograd.graph.saved_tensors_hooks). The parallel form is skipped where its N x N (x D with
gates) tensors would not fit ``--max-parallel-gib``. Then a recurrent run (the step API, ``--recurrent-tokens``
tokens) reports milliseconds per token and the state's bytes, which do not depend on how many tokens it has seen.

    python tools/bench_causal.py                                  # N = 1k, 4k, 16k; B1 H6 D64 (ViT-S heads)
    python tools/bench_causal.py --tokens 1024 4096 --variants plain gate --repeats 5 --csv /tmp/causal.csv

The library is ``linvit.bench.causal``.
"""
import argparse
import sys
from typing import List, Optional

from linvit.bench.causal import VARIANTS, CausalBench, run
from linvit.bench.cli import THREADS_HELP, HelpFormatter, threads_arg
from linvit.timing import write_csv


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--tokens', nargs='+', type=int, default=[1024, 4096, 16384], metavar='N',
                        help='sequence lengths')
    parser.add_argument('--batch', type=int, default=1, help='sequences per call')
    parser.add_argument('--heads', type=int, default=6, help='attention heads')
    parser.add_argument('--head-dim', type=int, default=64, help='width of q, k and v per head')
    parser.add_argument('--variants', nargs='+', choices=VARIANTS, default=list(VARIANTS),
                        help="'plain' (Katharopoulos et al.), 'decay' (RetNet's per-head decays) and/or 'gate' "
                             "(a data-dependent gate per token and channel, GLA)")
    parser.add_argument('--chunk-size', type=int, default=None,
                        help="tokens per chunk of the chunked form (default: the op's, 64, or 16 with per-channel "
                             "gates)")
    parser.add_argument('--max-parallel-gib', type=float, default=8.0,
                        help="skip the parallel form where its quadratic tensors would exceed this many GiB")
    parser.add_argument('--warmup', type=int, default=1, help='untimed rounds')
    parser.add_argument('--repeats', type=int, default=3, help='timed rounds: one call of each form per round')
    parser.add_argument('--recurrent-tokens', type=int, default=1024,
                        help='tokens of the recurrent (step API) run; 0 skips it')
    parser.add_argument('--threads', type=threads_arg, default='auto', help=THREADS_HELP)
    parser.add_argument('--csv', help='also write the table to this CSV file (times in ms)')
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and check (``args.bench`` is what to measure)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.bench = CausalBench(args.tokens, args.batch, args.heads, args.head_dim, args.variants, args.chunk_size,
                                 args.max_parallel_gib, args.warmup, args.repeats, args.recurrent_tokens,
                                 args.threads)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rows = run(args.bench)
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == '__main__':
    sys.exit(main())
