"""The ``aft`` family: AFT-simple (Zhai et al. 2021), sigmoid(q) * sum_n softmax_n(k) v_n with no dot product;
O(N C) per block, no own tensors."""
from typing import List, Optional

import torch

from ...ops.families import aft_simple
from ..family import FamilySpec, register_family
from ..linear_attention import LinearAttention

__all__ = ['AFTAttention']


def check_token_key_mask(key_mask: Optional[torch.Tensor]) -> None:
    """ValueError for a per-head key mask [B, H, N], which AFT cannot apply (an fx leaf: under tracing the mask is
    a graph value, checked when the graph runs)."""
    if key_mask is not None and key_mask.dim() == 3:
        raise ValueError("aft attention takes a key mask per token [B, N], not per head")


# leaves for torch.fx: they branch on shapes and masks
torch.fx.wrap('aft_simple')
torch.fx.wrap('check_token_key_mask')


@register_family
class AFTAttention(LinearAttention):
    """AFT-simple: no dot product; each channel of the output is sigmoid(q) times the average of v over the tokens
    weighted by softmax over tokens of k (``linvit.ops.families.aft_simple``). Heads only group the channels for the
    optional q/k norms."""

    family = FamilySpec('aft')

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        B, N = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.unbind(2)                                                            # [B, N, H, D]
        check_token_key_mask(key_mask)
        q = self.q_norm(q).reshape(B, N, self.attn_dim)
        k = self.k_norm(k).reshape(B, N, self.attn_dim)
        return aft_simple(q, k, v.reshape(B, N, self.attn_dim), key_mask)
