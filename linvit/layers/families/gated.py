"""The ``gated`` family: non-causal gated linear attention, keys gated per token and channel and the output gated;
O(N d^2) per block. Own tensors: the key gate ``key_gate`` and timm's output gate ``gate``."""
from typing import List, Optional

import torch
import torch.nn as nn

from ...ops.families import gated_linear_attention_from_features
from ..family import FamilySpec, register_family
from ..linear_attention import LinearAttention, to_compute_dtype
from .common import heads_first, split_heads, tokens_last

__all__ = ['GatedLinearAttention']

# leaves for torch.fx: the op branches on shapes and masks
torch.fx.wrap('gated_linear_attention_from_features')
torch.fx.wrap('to_compute_dtype')


@register_family
class GatedLinearAttention(LinearAttention):
    """Non-causal gated linear attention: a data-dependent gate per token and channel on the keys,
    sigmoid(key_gate(x)), and timm's output gate (``gated=True``: out * sigmoid(gate(x))), around linear attention
    with ``feature_map``. With a constant key gate it is plain linear attention (the constant cancels)."""

    # 'gate' too: a softmax checkpoint of a model without timm's output gate has none to give
    family = FamilySpec('gated', feature_map=True, tensors=('key_gate', 'gate'))

    def __init__(self, dim: int, **kwargs) -> None:
        kwargs['gated'] = True
        super().__init__(dim, **kwargs)
        self.key_gate = nn.Linear(dim, self.attn_dim, device=self.qkv.weight.device, dtype=self.qkv.weight.dtype)

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        B, N = qkv.shape[0], qkv.shape[1]
        q, k, v = split_heads(qkv)
        gate = heads_first(torch.sigmoid(self.key_gate(x)).reshape(B, N, self.num_heads, self.head_dim))
        # the layer applies its map (a function TorchScript compiles), as LinearAttention does; the op
        # gated_linear_attention(..., feature_map name) computes the same
        phi_q = self.feature_map(to_compute_dtype(self.q_norm(q)))
        phi_k = self.feature_map(to_compute_dtype(self.k_norm(k)))
        return tokens_last(gated_linear_attention_from_features(phi_q, phi_k, v, gate, self.eps, key_mask))
