"""One attention layer at growing token counts: timm's softmax Attention (SDPA), LinearAttention, and the floor (the
same layer with token mixing removed: qkv + proj only). The library behind ``tools/bench_attention.py``.

All layers run in one process, interleaved per repeat so that machine noise hits them alike; the table reports
median milliseconds and ratios, and the crossover N from which linear attention beats softmax.

    rows = run(AttentionBench(tokens=[256, 1024], dim=384, heads=6))   # prints the table, returns its rows
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn
from timm.layers import Attention

from linvit.fast import compile_model
from linvit.layers import LinearAttention, NoMixingAttention
from linvit.precision import PRECISIONS
from linvit.timing import time_interleaved

from .cli import MeasurementThreads, measurement_threads
from .cli import crossover as speed_crossover

__all__ = ['FULL', 'QUICK', 'FLOOR_WORDS', 'AttentionBench', 'build_layers', 'crossover', 'run', 'next_steps']

# (token counts, warm-up calls, timed calls) of the full run and of the quick one
FULL = ([49, 196, 256, 576, 1024, 2304, 4096, 9216, 16384], 2, 7)
QUICK = ([49, 196, 256, 576, 1024, 4096], 1, 3)
FLOOR_WORDS = 'floor = the same layer with token mixing removed: qkv + proj only (what any attention pays at least)'


@dataclass(frozen=True)
class AttentionBench:
    """What to measure. ``dtype`` is a precision name (``linvit.precision``) of weights and input; ``compile`` times
    the layers compiled by ``linvit.fast.compile_model`` (its first warm-up call per N compiles); ``threads`` is a
    number or 'auto' (``cli.measurement_threads``: the free cores); ``quick`` only changes the advice printed at the
    end."""
    tokens: Sequence[int] = tuple(FULL[0])
    dim: int = 384
    heads: int = 6
    batch: int = 1
    dtype: str = 'float32'
    feature_map: str = 'elu1'
    local_mix: bool = False
    warmup: int = FULL[1]
    repeats: int = FULL[2]
    device: str = 'cpu'
    compile: bool = False
    quick: bool = False
    threads: Union[str, int] = 'auto'

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError('--warmup must be >= 0 and --repeats >= 1')
        if self.local_mix:
            bad = [n for n in self.tokens if int(round(n ** 0.5)) ** 2 != n]
            if bad:
                raise ValueError(f'--local-mix needs square token counts (no prefix tokens), got {bad}')


def build_layers(bench: AttentionBench) -> Dict[str, nn.Module]:
    """The three layers with identical projection weights, in eval mode on the target device and dtype (compiled
    by ``linvit.fast.compile_model`` when ``bench.compile``)."""
    common = dict(dim=bench.dim, num_heads=bench.heads, qkv_bias=True)
    layers = {
        'softmax': Attention(**common),
        'linear': LinearAttention(**common, feature_map=bench.feature_map, local_mix=bench.local_mix,
                                  num_prefix_tokens=0),
        'floor': NoMixingAttention(**common),
    }
    state = layers['softmax'].state_dict()
    for layer in layers.values():
        layer.load_state_dict(state, strict=False)
    layers = {name: layer.to(bench.device, PRECISIONS[bench.dtype]).eval() for name, layer in layers.items()}
    if bench.compile:
        return {name: compile_model(layer) for name, layer in layers.items()}
    return layers


def crossover(rows: List[Dict[str, float]]) -> Optional[int]:
    """Smallest N from which linear attention is faster than softmax at that and every larger N."""
    return speed_crossover([(int(r['tokens']), 1 / r['linear_ms'], 1 / r['softmax_ms']) for r in rows])


def _heading(bench: AttentionBench, threads: MeasurementThreads) -> List[str]:
    return [f"# one attention layer: width {bench.dim}, {bench.heads} heads, batch {bench.batch}, {bench.dtype}, "
            f"feature map {bench.feature_map}{', local mix' if bench.local_mix else ''}, device {bench.device}, "
            f"{'compiled (inductor)' if bench.compile else 'eager'}, "
            f"{threads.note()}; median of {bench.repeats} after {bench.warmup} warm-up",
            f"# {FLOOR_WORDS}", *threads.warning_lines(),
            f"{'N':>7} {'softmax ms':>11} {'linear ms':>10} {'floor ms':>9} {'linear/floor':>13} "
            f"{'softmax/linear':>15}"]


def _measure(bench: AttentionBench, layers: Dict[str, nn.Module], n: int) -> Dict[str, float]:
    """One table row: median ms of each layer on [batch, n, dim] tokens, and the ratios."""
    x = torch.randn(bench.batch, n, bench.dim, device=bench.device, dtype=PRECISIONS[bench.dtype])
    fns = {name: (lambda layer=layer: layer(x)) for name, layer in layers.items()}
    ms = time_interleaved(fns, bench.warmup, bench.repeats, bench.device)
    return {'tokens': n, 'softmax_ms': ms['softmax'], 'linear_ms': ms['linear'], 'floor_ms': ms['floor'],
            'linear_over_floor': ms['linear'] / ms['floor'], 'softmax_over_linear': ms['softmax'] / ms['linear']}


def run(bench: AttentionBench) -> List[Dict[str, float]]:
    """Print the table (a row per N as it completes), the crossover and what to run next; return the rows."""
    threads = measurement_threads(bench.threads, bench.device).apply()
    torch.manual_seed(0)
    layers = build_layers(bench)
    print('\n'.join(_heading(bench, threads)))
    rows = []
    with torch.inference_mode():
        for n in bench.tokens:
            row = _measure(bench, layers, n)
            rows.append(row)
            print(f"{n:>7} {row['softmax_ms']:>11.3f} {row['linear_ms']:>10.3f} {row['floor_ms']:>9.3f} "
                  f"{row['linear_over_floor']:>12.2f}x {row['softmax_over_linear']:>14.2f}x", flush=True)
    n_cross = crossover(rows)
    if n_cross is None:
        print("linear attention does not beat softmax at the largest N measured")
    else:
        print(f"linear attention beats softmax from N = {n_cross} tokens on (every larger N measured)")
    print(next_steps(bench.quick))
    return rows


def next_steps(quick: bool) -> str:
    """Where to go from one layer: the full sweep (after a quick run) and whole models across image sizes."""
    full = 'the full sweep: make bench; ' if quick else ''
    return (f"next: {full}whole models vs their floors across image sizes: python tools/profile_resolution.py "
            f"--sizes 224 512 1024 --mode eager")
