"""Timing that survives a noisy machine: several calls interleaved round by round, medians, nearest-rank
percentiles; and the CSV every benchmark writes its rows to.

A leaf of the package (torch and the standard library only): the engine's linearization report, the ONNX export's
latency and the benchmark tools all time their calls here.
"""
import csv
import math
import statistics
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch

__all__ = ['synchronize', 'time_interleaved', 'percentile', 'write_csv']


def synchronize(device: Union[str, torch.device]) -> None:
    """Wait for the work queued on ``device`` ('cuda:1', a torch.device), so that a clock read after it measures the
    work; nothing to wait for on CPU."""
    if str(device).startswith('cuda'):
        torch.cuda.synchronize(device)


def time_interleaved(fns: Dict[str, Callable[[], object]], warmup: int, repeats: int,
                     device: str) -> Dict[str, float]:
    """Median milliseconds per call of each function; one call of each per round so drift hits all alike. The
    first ``warmup`` rounds are not timed."""
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


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100]) of a non-empty sequence: an observed value, no interpolation."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def write_csv(path: str, rows: Iterable[Dict[str, object]], fieldnames: Optional[Sequence[str]] = None) -> None:
    """Write dict rows as CSV (None as an empty cell); columns ``fieldnames`` (others ignored), else the first
    row's keys."""
    rows = list(rows)
    columns = list(fieldnames) if fieldnames is not None else list(rows[0]) if rows else []
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction='ignore')
        writer.writeheader()
        writer.writerows(rows)
