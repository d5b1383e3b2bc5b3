"""Memory of a measured call: the peak of the timed calls alone (CPU: the process's resident set size, CUDA: the
tensors torch allocated), and the allocator setting that moves CPU figures."""
import os
import sys
from typing import Dict, Optional

import torch

from ..fast.allocator import GLIBC_THRESHOLD_ENV, retaining_freed_memory

__all__ = ['MemoryWatch', 'RETAIN_FREED_MEMORY_ENV', 'allocator_setting', 'lifetime_peak_rss_mib', 'reset_peak_rss']

# glibc returns large freed blocks to the system and faults fresh pages in when they are allocated again; these
# thresholds (bytes) keep freed memory in the process, as jemalloc or tcmalloc would
RETAIN_FREED_MEMORY_ENV = {name: str(2 ** 34) for name in GLIBC_THRESHOLD_ENV}


def allocator_setting() -> str:
    """'retain' under ``RETAIN_FREED_MEMORY_ENV`` or once linvit's fast path made glibc retain freed memory
    (``linvit.fast.allocator``: compiled models and training steps on CPU), 'custom' for other values of those
    variables, else 'system'."""
    if all(os.environ.get(k) == v for k, v in RETAIN_FREED_MEMORY_ENV.items()):
        return 'retain'
    if any(k in os.environ for k in RETAIN_FREED_MEMORY_ENV):
        return 'custom'
    return 'retain' if retaining_freed_memory() else 'system'


def _proc_status_mib(key: str) -> Optional[float]:
    """A ``Vm*`` line of /proc/self/status (VmRSS: resident now, VmHWM: peak since start or reset), MiB; None where
    there is no /proc (macOS)."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) / 1024  # reported in kB
    except OSError:
        pass
    return None


def lifetime_peak_rss_mib() -> float:
    """The most this process has held resident since it started, MiB."""
    import resource

    # ru_maxrss is in KiB on Linux, bytes on macOS
    scale = 1 / 1024 ** 2 if sys.platform == 'darwin' else 1 / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak_rss() -> bool:
    """Restart the process's peak RSS at its current RSS (Linux, /proc/self/clear_refs); False where unsupported."""
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return True
    except OSError:
        return False


class MemoryWatch:
    """Memory around the calls of one configuration, MiB: ``start()`` after building the model and inputs (the base),
    ``steady()`` after the warm-up calls, ``result()`` after the timed calls. The peak is the timed calls' own: the
    build, the first call (which compiles) and the warm-up allocate caches and compiler state whose peaks are not a
    step's. CPU: RSS of the process; CUDA: tensors allocated by torch on the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == 'cuda'
        self.base = self.build_peak = 0.0
        self.peak_was_reset = False

    def start(self) -> None:
        if self.cuda:
            self.base = torch.cuda.memory_allocated(self.device) / 2 ** 20
            return
        self.build_peak = lifetime_peak_rss_mib()
        self.base = _proc_status_mib('VmRSS') or self.build_peak

    def steady(self) -> None:
        """Restart the peak: what follows are steady-state calls. Without /proc the peak read by ``result`` falls
        back to the process's lifetime peak (an upper bound)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.peak_was_reset = reset_peak_rss()

    def result(self) -> Dict[str, float]:
        """{'peak_mem_mib', 'base_mem_mib', 'added_mem_mib'}: the timed calls' peak, the base, and the peak above it."""
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device) / 2 ** 20
        else:
            peak = (_proc_status_mib('VmHWM') if self.peak_was_reset else None) or lifetime_peak_rss_mib()
        return {'peak_mem_mib': peak, 'base_mem_mib': self.base, 'added_mem_mib': max(0.0, peak - self.base)}
