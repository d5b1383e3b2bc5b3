"""Rotary linear attention on the PyTorch path (the package docstring's definition), in O(N D Dv).

The rotation is the sin/cos form timm's RoPE models use (``timm.layers.apply_rot_embed``): R x = x cos + turn(x) sin,
where turn swaps each feature pair (a, b) to (-b, a). Features wider than the rotation (a learnable map's 2 D
features, say) are turned block by block, each block of the rotation's width alike, which keeps
(R_i x)^T (R_j y) a function of the offset of i and j. Everything runs in float32 (float64 for float64 inputs) with
autocast off, differentiated by plain autograd; the Triton kernels do not rotate (``kernel_unsupported_reason``).
"""
from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from ..common import autocast_off, compute_dtype
from ..linear_attn.pytorch import (
    AttentionState,
    _phi,
    apply_to_features,
    check_apply_inputs,
    check_attention_inputs,
    check_state_features,
    state_from_features,
)

__all__ = ['Rotation', 'rotate', 'rotation_from_timm', 'rotary_state', 'rotary_apply', 'rotary_linear_attention']

FeatureMapArg = Union[str, Callable[[torch.Tensor], torch.Tensor], None]


class Rotation(NamedTuple):
    """The rotation of every token's features.

    sin, cos: [..., N, W] broadcastable to [B, H, N, W]: per token and feature, the sine and cosine of its angle,
        each angle written twice, once per feature of its pair (a token that is not turned, such as a class token,
        has sin 0 and cos 1).
    half: the pair layout: False pairs features (0, 1), (2, 3), ... (interleaved); True pairs (i, i + W / 2).
    """
    sin: torch.Tensor
    cos: torch.Tensor
    half: bool = False


def rotation_from_timm(rope: torch.Tensor, num_prefix_tokens: int = 0, half: bool = False) -> Rotation:
    """The Rotation of timm's concatenated rotary embedding ``rope`` [..., N - P, 2 W] ([sin | cos] of the patch
    tokens, as timm's RoPE models pass it to their attention) for N tokens of which the first P =
    ``num_prefix_tokens`` (class and register tokens) are not turned, as timm leaves them."""
    sin, cos = rope.chunk(2, dim=-1)
    if num_prefix_tokens:
        sin = F.pad(sin, (0, 0, num_prefix_tokens, 0), value=0.0)
        cos = F.pad(cos, (0, 0, num_prefix_tokens, 0), value=1.0)
    return Rotation(sin, cos, half)


def _turn(x: torch.Tensor, half: bool) -> torch.Tensor:
    """Each feature pair (a, b) of x [..., W] -> (-b, a)."""
    if half:
        first, second = x.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)
    return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).reshape(x.shape)


def rotate(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """x [B, H, N, F] turned by ``rotation`` (sin, cos broadcastable to [B, H, N, W]; F a multiple of W: each block
    of W features is turned alike), in x's dtype."""
    width, features = rotation.sin.shape[-1], x.shape[-1]
    if width % 2 or features % width:
        raise ValueError(f"a rotation of width {width} (its sin / cos [..., N, W]) cannot turn {features} features: "
                         f"the features must be a multiple of an even width")
    sin, cos = rotation.sin.to(x.dtype), rotation.cos.to(x.dtype)
    if features != width:
        blocks = x.reshape(*x.shape[:-1], features // width, width)
        turned = blocks * cos.unsqueeze(-2) + _turn(blocks, rotation.half) * sin.unsqueeze(-2)
        return turned.reshape(x.shape)
    return x * cos + _turn(x, rotation.half) * sin


def rotary_state(k: torch.Tensor, v: torch.Tensor, rotation: Rotation, feature_map: FeatureMapArg = 'elu1',
                 key_mask: Optional[torch.Tensor] = None) -> AttentionState:
    """The state of the keys k [B, H, N, D] at the positions ``rotation`` gives them and values v [B, H, N, Dv]:
    value rows summing R phi(k) v^T, the normaliser row phi(k) (``AttentionState``, float32 sums [B, H, Dv + 1, F]).
    States of disjoint sets of keys add up (``linvit.ops.add_states``)."""
    check_attention_inputs(k, k, v, key_mask)
    dtype = compute_dtype(v.dtype)
    with autocast_off(v.device.type):
        phi_k = _phi(feature_map)(k.to(dtype))
        return state_from_features(phi_k, v.to(dtype), key_mask, value_features=rotate(phi_k, rotation))


def rotary_apply(q: torch.Tensor, state: AttentionState, rotation: Rotation, feature_map: FeatureMapArg = 'elu1',
                 eps: float = 1e-6, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Queries q [B, H, Nq, D] at the positions ``rotation`` gives them, attending to the keys of ``state``
    (``rotary_state``) -> [B, H, Nq, Dv] in ``out_dtype`` (default q's dtype)."""
    check_apply_inputs(q, state)
    with autocast_off(q.device.type):
        phi_q = _phi(feature_map)(q.to(state.sums.dtype))
        check_state_features(phi_q, state.sums)
        out = apply_to_features(phi_q, state, eps, value_features=rotate(phi_q, rotation))
    return out.to(out_dtype or q.dtype)


def rotary_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation: Rotation,
                            feature_map: FeatureMapArg = 'elu1', eps: float = 1e-6,
                            key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Self-attention of N tokens with rotary positions: q, k [B, H, N, D], v [B, H, N, Dv], ``rotation`` of the N
    tokens (``rotation_from_timm`` reads timm's embedding), feature_map a name, a function or None (q and k are
    features already), key_mask None, [B, N] or [B, H, N] -> [B, H, N, Dv] in v's dtype."""
    check_attention_inputs(q, k, v, key_mask)
    return rotary_apply(q, rotary_state(k, v, rotation, feature_map, key_mask), rotation, feature_map, eps, v.dtype)
