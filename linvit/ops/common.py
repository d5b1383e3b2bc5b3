"""What every core of linvit.ops shares: the dtype it computes in, autocast switched off around it, and whether
torch.export's non-strict tracing runs the call (then the cores take their export form)."""
import contextlib

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

__all__ = ['compute_dtype', 'autocast_off', 'export_tracing']


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the attention cores run in: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def export_tracing() -> bool:
    """Whether torch.export's non-strict tracing (what ``linvit.export`` uses) runs this call: then the code takes
    its export form (aten ops every runtime knows, no loop over a symbolic size).

    ``torch.compiler.is_exporting()`` alone is not enough: torch 2.11's dynamo reads it as True under a plain
    ``torch.compile`` (measured on the GPU machine), which sent every compiled linvit layer down its export path, with
    no Triton kernel. Under dynamo (torch.compile, strict export) this is False."""
    return is_exporting() and not is_dynamo_compiling()


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """autocast disabled on ``device_type``, for the float32 cores. autocast has no meta device ("unsupported
    scalarType"); meta tensors carry shapes only and the cores cast to their compute dtype themselves, so nothing is
    lost by skipping it there."""
    if device_type == 'meta':
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)
