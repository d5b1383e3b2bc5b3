"""EvaLinearAttention: linear attention that holds the projections of timm's RoPE attention modules.

timm's Eva family (EVA02, DINOv3, Perception Encoder, the RoPE ViTs, Sapiens2) projects queries, keys and values in
layouts timm's ``Attention`` does not have: ``EvaAttention`` a fused weight with separate q and v biases (the key
has none) or three projections; ``AttentionRope`` a fused projection, or three with fewer key/value heads (grouped
queries). This layer keeps those very tensors under their names, so the softmax checkpoint loads, and otherwise is
``LinearAttention``: its rotary form takes the ``rope`` these models pass (``linvit.ops.rotary``).
"""
from typing import Optional

import torch
import torch.nn as nn

from .linear_attention import LinearAttention

__all__ = ['EvaLinearAttention', 'ROPE_PROJECTIONS']

#: the projection tensors of timm's EvaAttention / AttentionRope this layer adopts (None where the module has none)
ROPE_PROJECTIONS = ('qkv', 'q_proj', 'k_proj', 'v_proj', 'q_bias', 'v_bias')


class EvaLinearAttention(LinearAttention):
    """``LinearAttention`` (family 'linear') with the projection layout of timm's ``EvaAttention`` /
    ``AttentionRope``; built by ``linvit.convert_to_linear`` from such a module (``adopt``).

    qkv: a fused nn.Linear [3 H D, dim] (its own bias, or ``q_bias`` / ``v_bias`` beside it and a zero key bias), or
    None with q_proj [H D, dim], k_proj and v_proj [Hkv D, dim] (Hkv divides H: each key/value head serves H / Hkv
    query heads, as timm repeats them).
    """

    def __init__(self, dim: int, num_kv_heads: Optional[int] = None, **kwargs) -> None:
        super().__init__(dim, **kwargs)
        self.num_kv_heads = num_kv_heads or self.num_heads
        self.q_proj = self.k_proj = self.v_proj = None
        self.q_bias: Optional[nn.Parameter] = None
        self.v_bias: Optional[nn.Parameter] = None

    def adopt(self, attn: nn.Module) -> 'EvaLinearAttention':
        """Take ``attn``'s own projection, norm, gate and output tensors (the same objects); returns self."""
        for name in ROPE_PROJECTIONS + ('q_norm', 'k_norm', 'norm', 'gate', 'proj', 'proj_drop'):
            setattr(self, name, getattr(attn, name, None))
        self.num_kv_heads = getattr(attn, 'num_kv_heads', self.num_heads)
        return self

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, dim] -> [B, N, 3, H, D], in the module's layout (key/value heads repeated for grouped queries)."""
        B, N, _ = x.shape
        H, D = self.num_heads, self.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)
            if self.q_bias is not None:  # EvaAttention's biases: q and v learned, k none
                qkv = qkv + torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))
            return qkv.reshape(B, N, 3, H, D)
        q = self.q_proj(x).reshape(B, N, H, D)
        k = self.k_proj(x).reshape(B, N, self.num_kv_heads, D)
        v = self.v_proj(x).reshape(B, N, self.num_kv_heads, D)
        if self.num_kv_heads != H:
            k = k.repeat_interleave(H // self.num_kv_heads, dim=2)
            v = v.repeat_interleave(H // self.num_kv_heads, dim=2)
        return torch.stack([q, k, v], dim=2)

    def _projection(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """x [B, n, dim] -> q (part 0), k (1) or v (2) [B, H, n, D]."""
        return self.project_qkv(x)[:, :, part].transpose(1, 2)

    @torch.jit.unused
    def _projects_values_in_core(self, x: torch.Tensor, key_mask: Optional[torch.Tensor]) -> bool:
        return False  # the fold reads one plain qkv weight and bias, which this layout does not have
