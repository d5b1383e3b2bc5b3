"""The float64 quadratic reference of non-causal linear attention: slow, obviously correct, what the tests compare
every other form of the op with (the PyTorch path, the fused Function, the registered ops, the Triton kernels, the
state / apply halves).

It builds the full [Nq, N] similarity matrix in float64, so it shares no code path with the O(N) forms except the
feature-map functions (which the tests check separately against their closed forms; a test may pass its own
function instead of a name).
"""
from typing import Callable, Optional, Union

import torch

from ..feature_maps import get_feature_map

__all__ = ['quadratic_linear_attention']


def quadratic_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               feature_map: Union[str, Callable[[torch.Tensor], torch.Tensor]] = 'elu1',
                               eps: float = 1e-6, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """phi(Q) phi(K)^T V / (phi(Q) phi(K)^T 1 + eps) with both sums taken as means over the kept keys, in float64.

    q: [B, H, Nq, D], k: [B, H, N, D], v: [B, H, N, Dv], key_mask: [B, N] or [B, H, N] (bool keeps a key, a float
    weighs its similarity; the mean divides by the total weight) -> [B, H, Nq, Dv] float64. Keys of weight 0 are
    dropped before they touch the sums, so non-finite padding cannot leak in; with every key dropped the row is 0.
    """
    phi = get_feature_map(feature_map) if isinstance(feature_map, str) else feature_map
    q, k, v = q.double(), k.double(), v.double()
    if key_mask is None:
        w = torch.ones_like(k[..., 0])  # [B, H, N]
    else:
        w = key_mask.double()
        w = (w.unsqueeze(1) if w.dim() == 2 else w).expand_as(k[..., 0])
    kept = (w > 0).unsqueeze(-1)
    phi_k = torch.where(kept, phi(torch.where(kept, k, 0.0)), 0.0)
    v = torch.where(kept, v, 0.0)
    sim = (phi(q) @ phi_k.transpose(-2, -1)) * w.unsqueeze(-2)  # [B, H, Nq, N]
    count = w.sum(-1)[..., None, None]
    count = torch.where(count > 0, count, torch.ones_like(count))  # every key dropped: num = den = 0 anyway
    return ((sim @ v) / count) / (sim.sum(-1, keepdim=True) / count + eps)
