"""Who computes a call of the registered linear-attention ops: the Triton kernels or the PyTorch path.

``backend`` (the layers' and models' ``attn_backend``; one of ``ATTN_BACKENDS``) is decided inside the ops, at run
time, from the tensors they get:

    'auto'    the Triton kernels for CUDA tensors they can serve, the PyTorch path otherwise
    'triton'  the kernels always (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``); a ValueError says
              why when they cannot serve a call (``kernel_unsupported_reason``)
    'torch'   the PyTorch path (float32 core, autocast off) on every device
"""
import functools
import importlib.util
import os
from typing import Optional, Tuple

import torch

from ..feature_maps import FEATURE_MAPS, feature_map_spec
from .pytorch import _key_weights

__all__ = ['ATTN_BACKENDS', 'KERNEL_FEATURE_MAPS', 'check_attn_backend', 'check_kernel_feature_maps',
           'kernel_feature_map', 'kernel_unsupported_reason', 'kernels_serve', 'triton_interpreting']

#: the values of ``attn_backend`` (layer option, model kwarg, config key ``model.kwargs.attn_backend``)
ATTN_BACKENDS = ('auto', 'triton', 'torch')

_TRITON_INSTALLED = importlib.util.find_spec('triton') is not None
# what the kernels of linvit.ops.linear_attn.kernels serve (that module is imported only when a kernel runs, so
# `import linvit` stays light and works without Triton); the maps they compute declare their FeatureMapSpec.kernel_id
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_HEAD_DIM = 128
#: the feature maps the kernels compute: ``FeatureMapSpec.kernel_id`` -> the branch of ``_feature`` and
#: ``_feature_derivative`` in linvit.ops.linear_attn.kernels (their constexpr MAP; they refuse to compile any other)
KERNEL_FEATURE_MAPS = {'elu1': 0, 'relu': 1}


def triton_interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (``TRITON_INTERPRET=1``): then on CPU tensors."""
    return os.environ.get('TRITON_INTERPRET', '0') == '1'


def check_attn_backend(backend: str) -> str:
    """Return ``backend`` if it is one of ``ATTN_BACKENDS``, else raise ValueError naming the choices."""
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"attn_backend must be one of {list(ATTN_BACKENDS)}, got {backend!r}")
    return backend


def kernel_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str,
                              key_mask: Optional[torch.Tensor] = None) -> Optional[str]:
    """None when the Triton kernels can compute this call, else why not (one sentence for an error message).
    q [B, H, Nq, D], k [B, H, N, D], v [B, H, N, Dv], key_mask None, [B, N] or [B, H, N]. Decided once per
    combination of devices, dtypes, head widths, map and mask kind (a cached function of those), not per call."""
    mask_device = None if key_mask is None else key_mask.device
    reason = _unsupported_reason((q.device, k.device, v.device, mask_device), (q.dtype, k.dtype, v.dtype),
                                 (q.shape[-1], v.shape[-1]), key_mask is not None and key_mask.requires_grad,
                                 triton_interpreting())
    return reason or _unsupported_map_reason(feature_map)


def kernel_feature_map(kernel_id: str) -> int:
    """The kernels' branch (their constexpr MAP) for a ``FeatureMapSpec.kernel_id``; ValueError for a name they
    have no branch for (never a silent fallback to another map)."""
    branch = KERNEL_FEATURE_MAPS.get(kernel_id) if isinstance(kernel_id, str) else None
    if branch is None:
        raise ValueError(f"kernel_id {kernel_id!r} names no feature map of the Triton kernels (they have "
                         f"{list(KERNEL_FEATURE_MAPS)}): add its branch to linvit.ops.linear_attn.kernels and "
                         f"KERNEL_FEATURE_MAPS, or declare kernel_id=None (the PyTorch path)")
    return branch


def check_kernel_feature_maps() -> None:
    """ValueError unless every registered map's ``kernel_id`` (if any) has a branch in the kernels."""
    for spec in FEATURE_MAPS.values():
        if spec.kernel_id is not None:
            kernel_feature_map(spec.kernel_id)


def _unsupported_map_reason(feature_map: str) -> Optional[str]:
    """None when the kernels compute ``feature_map`` (its spec declares a ``kernel_id`` they have a branch for: a
    ValueError if they have none), else why not."""
    kernel_id = feature_map_spec(feature_map).kernel_id
    if kernel_id is not None:
        kernel_feature_map(kernel_id)
        return None
    kernel_maps = [name for name, spec in FEATURE_MAPS.items() if spec.kernel_id is not None]
    return f"feature map {feature_map!r} is not computed inside the kernels (they have {kernel_maps})"


@functools.lru_cache(maxsize=1024)
def _unsupported_reason(devices: Tuple[torch.device, ...], dtypes: Tuple[torch.dtype, ...], widths: Tuple[int, int],
                        mask_requires_grad: bool, interpreting: bool) -> Optional[str]:
    if not _TRITON_INSTALLED:
        return "Triton is not installed"
    if devices[0].type != 'cuda' and not interpreting:
        return f"the tensors are on {devices[0].type}, and the kernels need CUDA (or TRITON_INTERPRET=1)"
    if len(set(dtypes)) != 1 or dtypes[0] not in _KERNEL_DTYPES:
        return (f"the kernels take q, k, v of one dtype among float32, bfloat16 and float16, got "
                f"{', '.join(map(str, dtypes))}")
    if max(widths) > _MAX_HEAD_DIM:
        return f"head widths D={widths[0]}, Dv={widths[1]} exceed the kernels' {_MAX_HEAD_DIM}"
    if mask_requires_grad:
        return "key_mask requires grad, and the kernels take it as a constant"
    if len({device for device in devices if device is not None}) != 1:
        return "q, k, v and key_mask are on different devices"
    return None


def kernels_serve(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str,
                  key_mask: Optional[torch.Tensor] = None) -> bool:
    """Whether the op runs the Triton kernels for a call with these arguments: backend 'triton' always (it raises
    when they cannot), 'auto' on CUDA tensors they serve, 'torch' never."""
    if backend == 'torch':
        return False
    return backend == 'triton' or (q.device.type == 'cuda'
                                   and kernel_unsupported_reason(q, k, v, feature_map, key_mask) is None)


def _uses_kernel(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str,
                 key_mask: Optional[torch.Tensor]) -> bool:
    """``kernels_serve``, and a ValueError for backend='triton' when the kernels cannot serve this call."""
    if backend == 'triton':
        reason = kernel_unsupported_reason(q, k, v, feature_map, key_mask)
        if reason is not None:
            raise ValueError(f"attn_backend='triton' cannot serve this call: {reason}; use attn_backend='auto' or "
                             f"'torch'")
    return kernels_serve(backend, q, k, v, feature_map, key_mask)


def state_unsupported_reason(q: torch.Tensor, sums: torch.Tensor, count: torch.Tensor,
                             feature_map: str) -> Optional[str]:
    """``kernel_unsupported_reason`` for queries q [B, H, Nq, D] attending to a state (sums [B, H, Dv + 1, D], count
    [B, H]): the kernels take float32 states, q in one of their dtypes."""
    if sums.dtype != torch.float32 or count.dtype != torch.float32:
        return f"the state holds {sums.dtype} sums, and the kernels take float32 states"
    reason = _unsupported_reason((q.device, sums.device, count.device, None), (q.dtype,),
                                 (q.shape[-1], sums.shape[-2] - 1), False, triton_interpreting())
    return reason or _unsupported_map_reason(feature_map)


def _uses_kernel_for_state(backend: str, q: torch.Tensor, sums: torch.Tensor, count: torch.Tensor,
                           feature_map: str) -> bool:
    """``_uses_kernel`` for a call that reads a state (``linvit::linear_attention_apply`` and its backward)."""
    if backend == 'torch':
        return False
    if backend == 'triton':
        reason = state_unsupported_reason(q, sums, count, feature_map)
        if reason is not None:
            raise ValueError(f"attn_backend='triton' cannot serve this call: {reason}; use attn_backend='auto' or "
                             f"'torch'")
        return True
    return q.device.type == 'cuda' and state_unsupported_reason(q, sums, count, feature_map) is None


def _kernel_weights(key_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """key_mask None, [B, N] or [B, H, N] -> None or float32 key weights [B, H|1, N] for the kernels."""
    return None if key_mask is None else _key_weights(key_mask, torch.float32)


check_kernel_feature_maps()  # the built-in maps; a map registered later is checked when a call would use it
