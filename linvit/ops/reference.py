"""Quadratic references for the linear-attention ops: slow, obviously correct, used by the tests.

They build the full [Nq, N] similarity matrix in float64, so they share no code path with the O(N) ops except
the feature-map functions (which the tests check separately against their closed forms).
"""
from typing import Callable, Optional, Union

import torch

from .feature_maps import get_feature_map


def quadratic_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               feature_map: Union[str, Callable[[torch.Tensor], torch.Tensor]] = 'elu1',
                               eps: float = 1e-6, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """phi(Q) phi(K)^T V / (phi(Q) phi(K)^T 1 + eps) with sums taken as means over the kept keys, in float64.

    q: [B, H, Nq, D], k: [B, H, N, D], v: [B, H, N, Dv], key_mask: [B, N] or [B, H, N] -> [B, H, Nq, Dv] float64.
    """
    phi = get_feature_map(feature_map) if isinstance(feature_map, str) else feature_map
    q, k, v = q.double(), k.double(), v.double()
    sim = phi(q) @ phi(k).transpose(-2, -1)  # [B, H, Nq, N]
    if key_mask is None:
        weights = torch.ones_like(k[..., 0])  # [B, H, N]
    else:
        weights = key_mask.double()
        weights = weights.unsqueeze(1).expand_as(k[..., 0]) if weights.dim() == 2 else weights
    sim = sim * weights.unsqueeze(-2)
    v = torch.where(weights.unsqueeze(-1) > 0, v, 0.0)
    count = weights.sum(-1).clamp_min(1e-300)[..., None, None]
    numerator = (sim @ v) / count
    normaliser = sim.sum(-1, keepdim=True) / count
    return numerator / (normaliser + eps)
