"""The float64 quadratic reference of rotary linear attention (the package docstring's definition): slow, obviously
correct, sharing no code with the O(N) path except the feature-map functions. The rotation is written out here as
the 2 x 2 rotations of feature pairs it is, not with the path's sin/cos arithmetic."""
from typing import Callable, Optional, Union

import torch

from ..feature_maps import get_feature_map

__all__ = ['quadratic_rotary_linear_attention']


def _pairs(width: int, half: bool) -> torch.Tensor:
    """Index pairs (a, b) [width / 2, 2] that each rotation turns together: (0, 1), (2, 3), ... interleaved;
    (0, width / 2), (1, width / 2 + 1), ... for the half layout."""
    first = torch.arange(width // 2)
    return torch.stack([first, first + width // 2], 1) if half else torch.stack([2 * first, 2 * first + 1], 1)


def _rotate_pairs(x: torch.Tensor, angle: torch.Tensor, half: bool) -> torch.Tensor:
    """x [..., N, F] with every pair of features turned by its angle [..., N, F / 2] (radians), as a matrix product
    [[cos, -sin], [sin, cos]] per pair; F a multiple of the rotation's width 2 * angle.shape[-1]: each block of that
    width is turned alike."""
    width = 2 * angle.shape[-1]
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // width, width)
    pairs = _pairs(width, half)
    a, b = blocks[..., pairs[:, 0]], blocks[..., pairs[:, 1]]
    cos, sin = angle.cos().unsqueeze(-2), angle.sin().unsqueeze(-2)
    out = blocks.clone()
    out[..., pairs[:, 0]] = cos * a - sin * b
    out[..., pairs[:, 1]] = sin * a + cos * b
    return out.reshape(x.shape)


def quadratic_rotary_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, angle: torch.Tensor,
                                      feature_map: Union[str, Callable[[torch.Tensor], torch.Tensor]] = 'elu1',
                                      eps: float = 1e-6, key_mask: Optional[torch.Tensor] = None,
                                      half: bool = False) -> torch.Tensor:
    """(R phi(Q)) (R phi(K))^T V / (phi(Q) phi(K)^T 1 + eps), both sums as means over the kept keys, in float64.

    q [B, H, N, D], k [B, H, N, D], v [B, H, N, Dv]; angle [..., N, F / 2] broadcastable to [B, H, N, F / 2]: the
    rotation angle of each token's feature pairs (0 for tokens that are not turned, such as class tokens);
    key_mask [B, N] or [B, H, N] (bool keeps a key, a float weighs it) -> [B, H, N, Dv] float64.
    """
    phi = get_feature_map(feature_map) if isinstance(feature_map, str) else feature_map
    q, k, v, angle = q.double(), k.double(), v.double(), angle.double()
    w = torch.ones_like(k[..., 0]) if key_mask is None else key_mask.double()
    w = (w.unsqueeze(1) if w.dim() == 2 else w).expand_as(k[..., 0])
    kept = (w > 0).unsqueeze(-1)
    phi_q, phi_k = phi(q), torch.where(kept, phi(torch.where(kept, k, 0.0)), 0.0)
    v = torch.where(kept, v, 0.0)
    angle = angle.expand(*q.shape[:-1], angle.shape[-1])
    numerator = (_rotate_pairs(phi_q, angle, half) @ _rotate_pairs(phi_k, angle, half).transpose(-2, -1))
    denominator = phi_q @ phi_k.transpose(-2, -1)
    count = w.sum(-1)[..., None, None]
    count = torch.where(count > 0, count, torch.ones_like(count))
    numerator, denominator = numerator * w.unsqueeze(-2), denominator * w.unsqueeze(-2)
    return ((numerator @ v) / count) / (denominator.sum(-1, keepdim=True) / count + eps)
