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
"""
import argparse
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
from bench_attention import time_interleaved, write_csv
from tool_cli import HelpFormatter

from linvit.ops import causal_linear_attention, causal_linear_attention_step, fused_linear_attention, retention_decays

VARIANTS = ('plain', 'decay', 'gate')
GIB = 2 ** 30


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
    parser.add_argument('--csv', help='also write the table to this CSV file (times in ms)')
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.tokens) < 1 or args.batch < 1 or args.heads < 1 or args.head_dim < 1 or (args.chunk_size or 1) < 1:
        parser.error('--tokens, --batch, --heads, --head-dim and --chunk-size must be >= 1')
    if args.warmup < 0 or args.repeats < 1 or args.recurrent_tokens < 0:
        parser.error('--warmup and --recurrent-tokens must be >= 0 and --repeats >= 1')
    return args


def _inputs(args: argparse.Namespace, n: int, variant: str) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    shape = (args.batch, args.heads, n, args.head_dim)
    inputs = {name: torch.randn(shape, generator=g) for name in 'qkv'}
    if variant == 'gate':
        inputs['log_gate'] = torch.nn.functional.logsigmoid(torch.randn(shape, generator=g) + 4.0)
    return inputs


def _options(args: argparse.Namespace, variant: str) -> Dict[str, object]:
    return {'decay': retention_decays(args.heads).tolist()} if variant == 'decay' else {}


def _parallel_bytes(args: argparse.Namespace, n: int, variant: str) -> int:
    """A rough peak of the parallel form: ~4 live [B, H, N, N] (x D for per-channel gates) float32 tensors."""
    per_pair = args.head_dim if variant == 'gate' else 1
    return 4 * args.batch * args.heads * n * n * per_pair * 4


def _step_fn(attend: Callable[..., torch.Tensor], inputs: Dict[str, torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        leaves = {name: t.detach().requires_grad_() for name, t in inputs.items()}
        attend(**leaves).square().sum().backward()
    return step


def _saved_multiple(fn: Callable[..., torch.Tensor], inputs: Dict[str, torch.Tensor]) -> float:
    """Bytes saved for backward by one call of ``fn`` on ``inputs`` (as leaves that need gradients), as a multiple
    of the bytes of q, k and v together."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    leaves = {name: t.detach().requires_grad_() for name, t in inputs.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(**leaves)
    qkv = sum(inputs[name].numel() * inputs[name].element_size() for name in 'qkv')
    return sum(saved) / qkv


def forms(args: argparse.Namespace, n: int, variant: str) -> Dict[str, Optional[Callable[..., torch.Tensor]]]:
    """Attention calls by form name; None for a parallel form that would not fit."""
    options = _options(args, variant)

    def chunked(q, k, v, log_gate=None):
        return causal_linear_attention(q, k, v, log_gate=log_gate, chunk_size=args.chunk_size, **options)

    def parallel(q, k, v, log_gate=None):
        return causal_linear_attention(q, k, v, log_gate=log_gate, form='parallel', **options)

    def noncausal(q, k, v, log_gate=None):
        return fused_linear_attention(q, k, v, 'elu1')

    fits = _parallel_bytes(args, n, variant) <= args.max_parallel_gib * GIB
    return {'chunked': chunked, 'parallel': parallel if fits else None, 'noncausal': noncausal}


def run(args: argparse.Namespace) -> List[Dict[str, object]]:
    chunk = args.chunk_size or 'auto (64; 16 with per-channel gates)'
    print(f"# causal linear attention, forward + backward: B{args.batch} H{args.heads} D{args.head_dim}, elu1, "
          f"chunk {chunk}, float32, {torch.get_num_threads()} threads; median of {args.repeats} after "
          f"{args.warmup} warm-up, interleaved")
    print(f"{'variant':>8} {'N':>6} {'chunked ms':>11} {'parallel ms':>12} {'noncausal ms':>13} "
          f"{'parallel/chunked':>17} {'chunked/noncausal':>18} {'saved chunked':>14} {'saved parallel':>15}")
    rows = []
    for variant in args.variants:
        for n in args.tokens:
            inputs = _inputs(args, n, variant)
            calls = forms(args, n, variant)
            steps = {name: _step_fn(fn, inputs) for name, fn in calls.items() if fn is not None}
            ms = time_interleaved(steps, args.warmup, args.repeats, 'cpu')
            saved = {name: _saved_multiple(fn, inputs) for name, fn in calls.items()
                     if fn is not None and name != 'noncausal'}
            row = {'variant': variant, 'tokens': n, 'chunked_ms': ms['chunked'], 'parallel_ms': ms.get('parallel'),
                   'noncausal_ms': ms['noncausal'], 'saved_chunked_x_qkv': saved['chunked'],
                   'saved_parallel_x_qkv': saved.get('parallel')}
            rows.append(row)
            print(_format_row(row))
            sys.stdout.flush()
    if args.recurrent_tokens:
        recurrent(args)
    return rows


def _format_row(row: Dict[str, object]) -> str:
    parallel = row['parallel_ms']
    speedup = f"{parallel / row['chunked_ms']:.2f}x" if parallel is not None else 'skipped'
    parallel_text = f"{parallel:.1f}" if parallel is not None else 'too big'
    saved_parallel = f"{row['saved_parallel_x_qkv']:.2f}x" if row['saved_parallel_x_qkv'] is not None else '-'
    return (f"{row['variant']:>8} {row['tokens']:>6} {row['chunked_ms']:>11.1f} {parallel_text:>12} "
            f"{row['noncausal_ms']:>13.1f} {speedup:>17} {row['chunked_ms'] / row['noncausal_ms']:>17.2f}x "
            f"{row['saved_chunked_x_qkv']:>13.2f}x {saved_parallel:>15}")


@torch.no_grad()
def recurrent(args: argparse.Namespace) -> Dict[str, float]:
    """Time the step API over --recurrent-tokens tokens (with the RetNet decays) and report the state's size."""
    n = args.recurrent_tokens
    inputs = _inputs(args, n, 'plain')
    options = _options(args, 'decay')
    state = None
    sizes = set()
    start = time.perf_counter()
    for t in range(n):
        _, state = causal_linear_attention_step(inputs['q'][:, :, t], inputs['k'][:, :, t], inputs['v'][:, :, t],
                                                state, **options)
        sizes.add(state.kv.numel() * state.kv.element_size())
    per_token = (time.perf_counter() - start) * 1e3 / n
    print(f"# recurrent (step API, decay): {n} tokens, {per_token:.3f} ms per token, state "
          f"{' / '.join(f'{s / 1024:.1f} KiB' for s in sorted(sizes))} at every step (q, k, v of the whole "
          f"sequence: {3 * inputs['q'].numel() * 4 / 1024:.0f} KiB)")
    return {'ms_per_token': per_token, 'state_bytes': max(sizes)}


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == '__main__':
    sys.exit(main())
