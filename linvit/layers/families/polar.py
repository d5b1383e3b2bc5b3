"""The ``polar`` family: PolaFormer's polarity-aware linear attention (Meng et al. 2025), O(N d^2) per block.

q and k are split by sign and raised to a learnable per-channel power (``linvit.ops.families.polarity_features``);
the first half of each head's value channels is mixed by the same-sign similarities, the second half by the
opposite-sign ones, each normalised on its own, and the two halves are concatenated. It is a family rather than a
feature map because it splits the values into two streams with two different similarities, which one map
[..., D] -> [..., F] applied to q and k cannot express. Own tensors: ``power`` and ``scale`` (per head and channel).
"""
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...ops.families import polarity_features
from ..family import FamilySpec, register_family
from ..linear_attention import LinearAttention, to_compute_dtype
from .common import split_heads, tokens_last

__all__ = ['PolarityAttention']

torch.fx.wrap('polarity_features')
torch.fx.wrap('to_compute_dtype')


@register_family
class PolarityAttention(LinearAttention):
    """Polarity-aware linear attention: out = [attend(same(q), same(k), v_1), attend(opposite(q), same(k), v_2)]
    with v = [v_1 | v_2] split at half the head width (which must be even).

    Options: ``alpha`` (the power is 1 + alpha * sigmoid(power), in (1, 1 + alpha); PolaFormer's 4). Tensors:
    ``power`` [H, D] (starts at 0: p = 1 + alpha / 2) and ``scale`` [H, D] (the inputs are divided by
    softplus(scale), which starts at log 2). ``normalizer`` applies to each stream.
    """

    family = FamilySpec('polar', options={'alpha': 4.0}, tensors=('power', 'scale'), normalizer=True)

    def __init__(self, dim: int, alpha: float = 4.0, **kwargs) -> None:
        super().__init__(dim, **kwargs)
        if self.head_dim % 2:
            raise ValueError(f"polar attention splits each head's values in two halves: head_dim must be even, got "
                             f"{self.head_dim}")
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        self.alpha = alpha
        placement = dict(device=self.qkv.weight.device, dtype=self.qkv.weight.dtype)
        self.power = nn.Parameter(torch.zeros(self.num_heads, self.head_dim, **placement))
        self.scale = nn.Parameter(torch.zeros(self.num_heads, self.head_dim, **placement))

    def _feature_width(self) -> int:
        return 2 * self.head_dim

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        """qkv [B, N, 3, H, D] -> [B, N, H * D]."""
        q, k, v = split_heads(qkv)
        q, k, v = to_compute_dtype(self.q_norm(q)), to_compute_dtype(self.k_norm(k)), to_compute_dtype(v)
        # elementwise in the compute dtype (autocast lowers matmuls only); the core then runs with autocast off
        power = 1.0 + self.alpha * torch.sigmoid(self.power.to(q.dtype))
        scale = F.softplus(self.scale.to(q.dtype))
        same_q, opposite_q = polarity_features(q, power, scale)
        same_k = polarity_features(k, power, scale)[0]
        half = self.head_dim // 2
        out = torch.cat([self._attend_features(same_q, same_k, v[..., :half], key_mask),
                         self._attend_features(opposite_q, same_k, v[..., half:], key_mask)], dim=-1)
        return tokens_last(out.to(qkv.dtype))
