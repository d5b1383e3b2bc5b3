"""Without a GPU, run linvit's Triton kernels through Triton's interpreter (CPU tensors, numpy), so the kernel tests
check the same kernel code a GPU compiles. Set before any kernel module is imported: Triton reads it when it
decorates a kernel. On a machine with CUDA the kernels compile for the GPU and the CUDA-only tests run too."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')

# Under pytest-xdist (make test runs one worker per core) each worker gets its share of the cores: torch's default of
# one intra-op thread per core in every worker would oversubscribe them. The environment carries the share to the
# train.py processes a test starts, so a resumed run computes with the same thread count as the run it continues.
_XDIST_WORKERS = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
if _XDIST_WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)
    os.environ['OMP_NUM_THREADS'] = str(_THREADS)
    torch.set_num_threads(_THREADS)
