"""Causal linear attention's forms, forward + backward, interleaved in one process: the chunked form (its
memory-efficient autograd Function) against the masked quadratic parallel form and against non-causal linear
attention (the fused training Function), plain, with a decay and with per-channel gates. The library behind
``tools/bench_causal.py``.

Each call is one attention core on q, k, v [B, H, N, D] (elu1 map) plus the backward of the output's sum of
squares. Besides median milliseconds it reports the bytes each form saves for backward, as a multiple of q, k, v
(``torch.autograd.graph.saved_tensors_hooks``), and a recurrent run (the step API) whose state does not grow.

    rows = run(CausalBench(tokens=[1024, 4096], variants=('plain', 'gate')))
"""
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from linvit.ops import causal_linear_attention, causal_linear_attention_step, fused_linear_attention, retention_decays
from linvit.timing import time_interleaved

from .cli import measurement_threads

__all__ = ['VARIANTS', 'CausalBench', 'forms', 'run', 'recurrent']

#: 'plain' (Katharopoulos et al.), 'decay' (RetNet's per-head decays), 'gate' (a data-dependent gate per token and
#: channel, GLA)
VARIANTS = ('plain', 'decay', 'gate')
GIB = 2 ** 30


@dataclass(frozen=True)
class CausalBench:
    """What to measure; ``chunk_size`` None is the op's default (64, or 16 with per-channel gates); the parallel form
    is skipped where its quadratic tensors would exceed ``max_parallel_gib``; ``recurrent_tokens`` 0 skips the
    recurrent run; ``threads`` is a number or 'auto' (``cli.measurement_threads``: the free cores)."""
    tokens: Sequence[int] = (1024, 4096, 16384)
    batch: int = 1
    heads: int = 6
    head_dim: int = 64
    variants: Sequence[str] = VARIANTS
    chunk_size: Optional[int] = None
    max_parallel_gib: float = 8.0
    warmup: int = 1
    repeats: int = 3
    recurrent_tokens: int = 1024
    threads: Union[str, int] = 'auto'

    def __post_init__(self) -> None:
        if min(self.tokens) < 1 or self.batch < 1 or self.heads < 1 or self.head_dim < 1 or (self.chunk_size or 1) < 1:
            raise ValueError('--tokens, --batch, --heads, --head-dim and --chunk-size must be >= 1')
        if self.warmup < 0 or self.repeats < 1 or self.recurrent_tokens < 0:
            raise ValueError('--warmup and --recurrent-tokens must be >= 0 and --repeats >= 1')


def _inputs(bench: CausalBench, n: int, variant: str) -> Dict[str, torch.Tensor]:
    """q, k, v [B, H, n, D] (and log_gate [B, H, n, D] for 'gate'), seeded by n."""
    g = torch.Generator().manual_seed(n)
    shape = (bench.batch, bench.heads, n, bench.head_dim)
    inputs = {name: torch.randn(shape, generator=g) for name in 'qkv'}
    if variant == 'gate':
        inputs['log_gate'] = torch.nn.functional.logsigmoid(torch.randn(shape, generator=g) + 4.0)
    return inputs


def _options(bench: CausalBench, variant: str) -> Dict[str, object]:
    return {'decay': retention_decays(bench.heads).tolist()} if variant == 'decay' else {}


def _parallel_bytes(bench: CausalBench, n: int, variant: str) -> int:
    """A rough peak of the parallel form: ~4 live [B, H, N, N] (x D for per-channel gates) float32 tensors."""
    per_pair = bench.head_dim if variant == 'gate' else 1
    return 4 * bench.batch * bench.heads * n * n * per_pair * 4


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


def forms(bench: CausalBench, n: int, variant: str) -> Dict[str, Optional[Callable[..., torch.Tensor]]]:
    """Attention calls by form name; None for a parallel form that would not fit."""
    options = _options(bench, variant)

    def chunked(q, k, v, log_gate=None):
        return causal_linear_attention(q, k, v, log_gate=log_gate, chunk_size=bench.chunk_size, **options)

    def parallel(q, k, v, log_gate=None):
        return causal_linear_attention(q, k, v, log_gate=log_gate, form='parallel', **options)

    def noncausal(q, k, v, log_gate=None):
        return fused_linear_attention(q, k, v, 'elu1')

    fits = _parallel_bytes(bench, n, variant) <= bench.max_parallel_gib * GIB
    return {'chunked': chunked, 'parallel': parallel if fits else None, 'noncausal': noncausal}


def _measure(bench: CausalBench, n: int, variant: str) -> Dict[str, object]:
    """One table row: median ms of each form that fits, and the bytes the causal forms save for backward."""
    inputs = _inputs(bench, n, variant)
    calls = forms(bench, n, variant)
    steps = {name: _step_fn(fn, inputs) for name, fn in calls.items() if fn is not None}
    ms = time_interleaved(steps, bench.warmup, bench.repeats, 'cpu')
    saved = {name: _saved_multiple(fn, inputs) for name, fn in calls.items()
             if fn is not None and name != 'noncausal'}
    return {'variant': variant, 'tokens': n, 'chunked_ms': ms['chunked'], 'parallel_ms': ms.get('parallel'),
            'noncausal_ms': ms['noncausal'], 'saved_chunked_x_qkv': saved['chunked'],
            'saved_parallel_x_qkv': saved.get('parallel')}


def run(bench: CausalBench) -> List[Dict[str, object]]:
    """Print the table (a row per variant and N as it completes) and the recurrent run; return the table's rows."""
    threads = measurement_threads(bench.threads, 'cpu').apply()
    chunk = bench.chunk_size or 'auto (64; 16 with per-channel gates)'
    print(f"# causal linear attention, forward + backward: B{bench.batch} H{bench.heads} D{bench.head_dim}, elu1, "
          f"chunk {chunk}, float32, {threads.note()}; median of {bench.repeats} after {bench.warmup} warm-up, "
          f"interleaved")
    for line in threads.warning_lines():
        print(line)
    print(f"{'variant':>8} {'N':>6} {'chunked ms':>11} {'parallel ms':>12} {'noncausal ms':>13} "
          f"{'parallel/chunked':>17} {'chunked/noncausal':>18} {'saved chunked':>14} {'saved parallel':>15}")
    rows = []
    for variant in bench.variants:
        for n in bench.tokens:
            row = _measure(bench, n, variant)
            rows.append(row)
            print(_format_row(row))
            sys.stdout.flush()
    if bench.recurrent_tokens:
        recurrent(bench)
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
def recurrent(bench: CausalBench) -> Dict[str, float]:
    """Time the step API over ``recurrent_tokens`` tokens (with the RetNet decays) and report the state's size."""
    n = bench.recurrent_tokens
    inputs = _inputs(bench, n, 'plain')
    options = _options(bench, 'decay')
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
