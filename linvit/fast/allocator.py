"""Keep freed memory in the process on CPU: glibc's heap trimming makes a compiled ViT refault its buffers.

torch's CPU tensors come from the C library's malloc. glibc returns freed memory to the system: blocks above a
dynamic mmap threshold are unmapped on free, and the top of the heap is trimmed once more than twice that threshold
lies free there. A model that allocates and frees the same large activations on every call then faults their pages
in afresh (and the kernel zeroes them) on every call, in amounts that depend on the heap's history rather than on
the code. Measured on a 2-core CPU with ViT-S at 1024 px, compiled, batch 1: the same linvit graph refaulted 0,
12,547 or 61,295 pages (up to 240 MB) per call in three processes, and its floor 0; eager training swings
similarly. jemalloc and tcmalloc keep freed memory, and PyTorch's CPU launcher (``torch.backends.xeon.run_cpu``)
preloads one of them for this reason.

``retain_freed_memory()`` gives glibc the same behaviour in a running process (``mallopt``: no trimming, no mmap
below 2 GiB). linvit's CPU fast path calls it (``compile_model`` on a CPU call, ``TrainStep`` on a CPU step, except
for models that take targets: a detector's data-dependent shapes fragment a heap that is never trimmed), unless
told not to (their ``retain_freed_memory=False``) or the environment already sets glibc's thresholds
(``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_``: the user's choice wins). The cost: the process keeps
its peak heap mapped instead of returning it between calls, as a server's allocator does anyway.
"""
import ctypes
import ctypes.util
import os
import sys
from typing import Optional

__all__ = ['GLIBC_THRESHOLD_ENV', 'retain_freed_memory', 'retaining_freed_memory']

#: the environment variables through which glibc reads its thresholds at start-up (the user's setting wins)
GLIBC_THRESHOLD_ENV = ('MALLOC_TRIM_THRESHOLD_', 'MALLOC_MMAP_THRESHOLD_')

# mallopt's parameter numbers (malloc.h) and the largest value it takes (an int)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LARGEST = 2 ** 31 - 1

_retaining = False


def _glibc() -> Optional[ctypes.CDLL]:
    """The C library when it is glibc (has mallopt and gnu_get_libc_version), else None (musl, macOS, Windows)."""
    if not sys.platform.startswith('linux'):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    except OSError:
        return None
    if not (hasattr(libc, 'mallopt') and hasattr(libc, 'gnu_get_libc_version')):
        return None
    return libc


def retain_freed_memory() -> bool:
    """Make glibc keep freed memory in this process (no heap trimming, no mmap for blocks under 2 GiB).

    Process-wide and idempotent. Returns True when glibc retains freed memory after the call, False where this does
    nothing: another C library, or thresholds the environment set (``GLIBC_THRESHOLD_ENV``), which are left alone.
    """
    global _retaining
    if _retaining:
        return True
    if any(name in os.environ for name in GLIBC_THRESHOLD_ENV):
        return False
    libc = _glibc()
    if libc is None:
        return False
    # the mmap threshold first: setting either one stops glibc's dynamic thresholds, and a trim threshold set alone
    # would leave every block above the default 128 KiB to mmap
    _retaining = bool(libc.mallopt(_M_MMAP_THRESHOLD, _LARGEST)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _LARGEST))
    return _retaining


def retaining_freed_memory() -> bool:
    """Whether ``retain_freed_memory`` put glibc's retention in effect in this process."""
    return _retaining
