"""The performance floor: timm's attention interface with token mixing removed, and the surgery that puts it in a model.

    floor = make_floor(timm.create_model('linvit_small_patch16_224'))   # in place: every attention returns proj(v)
"""
from typing import List, Optional, Type

import torch
import torch.nn as nn
from timm.layers import Attention

from .linear_attention import LinearAttention

__all__ = ['NoMixingAttention', 'make_floor']


class NoMixingAttention(nn.Module):
    """Attention without attention: returns proj(v), with the same qkv and proj projections as timm's Attention.

    Benchmarks use it as the physical floor of any attention variant at a given token count: the projections cost
    the same, token mixing costs nothing. It accepts the constructor arguments of ``timm.layers.Attention`` and
    carries its parameter names, so it drops into ``VisionTransformer(attn_layer=...)`` and loads its weights.

    forward: x [B, N, dim] -> [B, N, dim_out].
    """

    def __init__(self, dim: int, num_heads: int = 8, attn_head_dim: Optional[int] = None,
                 dim_out: Optional[int] = None, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, gated: bool = False, attn_drop: float = 0.,
                 proj_drop: float = 0., norm_layer: Optional[Type[nn.Module]] = None, device=None,
                 dtype=None) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        head_dim = attn_head_dim if attn_head_dim is not None else dim // num_heads
        self.attn_dim = num_heads * head_dim
        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out or dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                feat_size: Optional[List[int]] = None) -> torch.Tensor:
        # the full qkv projection is kept so the floor pays the same projection cost as real attention
        v = self.qkv(x)[..., 2 * self.attn_dim:]
        out = self.norm(v)
        if self.gate is not None:
            out = out * self.gate(x).sigmoid()
        return self.proj_drop(self.proj(out))


def _is_attention(module: nn.Module) -> bool:
    """timm's own softmax ``Attention`` (exactly: subclasses may compute something else) or a linvit LinearAttention."""
    return type(module) is Attention or isinstance(module, LinearAttention)


def make_floor(model: nn.Module) -> nn.Module:
    """Turn ``model`` into its performance floor, in place: every attention layer becomes a NoMixingAttention.

    Each timm ``Attention`` and linvit ``LinearAttention`` (softmax, linear and hybrid models alike) is replaced by
    a ``NoMixingAttention`` that reuses its qkv / norm / gate / proj / proj_drop modules (same Parameter objects),
    so the floor keeps the full projection cost and drops token mixing (and any local-mixing branch). Returns
    ``model``; ValueError if it has no such attention layer.
    """
    targets = [(name, module) for name, module in model.named_modules() if _is_attention(module)]
    if not targets:
        raise ValueError(f"make_floor found no timm Attention or linvit LinearAttention in {type(model).__name__}")
    if targets[0][0] == '':
        raise ValueError("make_floor replaces attention layers inside a model; got an attention layer itself")
    for name, attn in targets:
        qkv = attn.qkv
        # built on the meta device (no allocation); its projections are then replaced by the attention's own
        floor = NoMixingAttention(qkv.in_features, num_heads=attn.num_heads, attn_head_dim=attn.head_dim,
                                  device='meta')
        floor.attn_dim = qkv.out_features // 3
        floor.qkv, floor.norm, floor.gate, floor.proj, floor.proj_drop = \
            qkv, attn.norm, attn.gate, attn.proj, attn.proj_drop
        floor.train(attn.training)
        parent_name, _, child = name.rpartition('.')
        setattr(model.get_submodule(parent_name) if parent_name else model, child, floor)
    return model
