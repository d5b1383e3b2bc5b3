"""Without a GPU, run linvit's Triton kernels through Triton's interpreter (CPU tensors, numpy), so the kernel tests
check the same kernel code a GPU compiles. Set before any kernel module is imported: Triton reads it when it
decorates a kernel. On a machine with CUDA the kernels compile for the GPU and the CUDA-only tests run too."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')
