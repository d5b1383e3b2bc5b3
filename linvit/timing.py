"""Timing that survives a noisy machine: several calls interleaved round by round, medians, nearest-rank
percentiles; how busy other processes keep the CPUs (``cpu_load``); and the CSV every benchmark writes its rows to.

A leaf of the package (torch and the standard library only): the engine's linearization report, the ONNX export's
latency and the benchmark tools all time their calls here, and train.py's thread warning and the benchmark tools'
busy-machine warning read the same ``cpu_load``.
"""
import csv
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch

__all__ = ['synchronize', 'time_interleaved', 'percentile', 'CpuLoad', 'cpu_load', 'write_csv']


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


@dataclass(frozen=True)
class CpuLoad:
    """The cores this process may run on and the 1-minute load average: what other processes leave free.

    Threads beyond the free cores share a core with another process; torch's threads meet at every op, so the whole
    op then waits for the thread that shares a core, and times grow by whatever the other processes do.
    """
    cores: int
    load_average: float

    @property
    def others(self) -> float:
        """The load of other processes: the load average less this process (about one core while it runs)."""
        return max(0.0, self.load_average - 1.0)

    @property
    def free_cores(self) -> int:
        """Cores other processes leave free (0 when they keep all of them busy)."""
        return max(0, self.cores - round(self.others))

    @property
    def fair_threads(self) -> int:
        """The most threads that do not wait for busy cores: the free cores, at least one."""
        return max(1, self.free_cores)

    def busy(self, threads: int) -> bool:
        """Whether ``threads`` threads share cores with other processes (more threads than free cores)."""
        return threads > self.free_cores

    def describe(self) -> str:
        """'other processes keep about 2 of the 4 cores busy (load average 3.0)'."""
        return (f"other processes keep about {self.others:.0f} of the {self.cores} cores busy (load average "
                f"{self.load_average:.1f})")


def cpu_load() -> Optional[CpuLoad]:
    """The load now: the cores of this process's affinity mask (every core where there is none) and the 1-minute
    load average; None where the system has no load average (Windows)."""
    if not hasattr(os, 'getloadavg'):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)
    return CpuLoad(cores, os.getloadavg()[0])


def write_csv(path: str, rows: Iterable[Dict[str, object]], fieldnames: Optional[Sequence[str]] = None) -> None:
    """Write dict rows as CSV (None as an empty cell); columns ``fieldnames`` (others ignored), else the first
    row's keys."""
    rows = list(rows)
    columns = list(fieldnames) if fieldnames is not None else list(rows[0]) if rows else []
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction='ignore')
        writer.writeheader()
        writer.writerows(rows)
