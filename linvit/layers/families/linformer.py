"""The ``linformer`` family: Linformer-style low-rank attention made resolution-agnostic (keys and values pooled on
the patch grid to r x r tokens, exact softmax over them); O(N r^2 d) per block, no own tensors."""
from typing import List, Optional

import torch

from ...ops.families import low_rank_attention
from ..family import FamilySpec, register_family
from ..linear_attention import LinearAttention
from ..local_mix import resolve_token_grid
from .common import check_no_key_mask, split_heads, tokens_last

__all__ = ['LinformerAttention']

# leaves for torch.fx: they branch on shapes and masks
torch.fx.wrap('low_rank_attention')
torch.fx.wrap('resolve_token_grid')
torch.fx.wrap('check_no_key_mask')


@register_family
class LinformerAttention(LinearAttention):
    """Linformer-style low-rank attention made resolution-agnostic: keys and values are average-pooled on the 2D
    patch grid to ``low_rank_size`` x ``low_rank_size`` tokens (prefix tokens kept), then every query attends to
    them with exact softmax. One set of weights runs at any image size. Needs the patch grid (``feat_size`` from
    linvit models, else ``grid_size`` / a square token count, as ``LocalMix``). Key-padding masks are refused:
    padded tokens would be pooled with real ones.
    """

    family = FamilySpec('linformer', options={'low_rank_size': 16}, token_grid=True)

    def __init__(self, dim: int, low_rank_size: int = 16, **kwargs) -> None:
        super().__init__(dim, **kwargs)
        if low_rank_size < 1:
            raise ValueError(f"low_rank_size must be >= 1, got {low_rank_size}")
        self.low_rank_size = low_rank_size

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        check_no_key_mask(key_mask, 'linformer', 'pools keys over the patch grid')
        grid = resolve_token_grid(qkv.shape[1], self.num_prefix_tokens, self.grid_size, feat_size)
        q, k, v = split_heads(qkv)
        return tokens_last(low_rank_attention(self.q_norm(q), self.k_norm(k), v, grid, self.num_prefix_tokens,
                                              self.low_rank_size))
