"""Non-causal linear attention as one autograd Function: the feature map inside, a closed-form backward.

With A = phi(Q) [Nq, D], K' = phi(K) [N, D] (masked keys zeroed, kept keys weighted), S = K'^T [V | 1]
[D, Dv + 1] and [num | den0] = A S, the forward is out = num / den with den = den0 + eps * count (see
``linvit.ops.linear_attention`` for the mean normaliser). For an upstream gradient G [Nq, Dv]:

    G' = [G / den | -rowsum(G * out) / den]      the gradient at A S: the division's backward, fused
    dA = G' S^T,   dS = A^T G',   dK' = [V | 1] dS^T,   dV = K' dS[:, :Dv]
    dQ = phi'(Q) dA,   dK = phi'(K) (weight * dK')   (the feature map's vector-Jacobian product)

a handful of [N, D] x [D, Dv + 1] matmuls and one elementwise pass per tensor. Saved for backward: the small
S [D, Dv + 1], the normaliser den [Nq] per head, the output (the tensor the layer's projection saves anyway) and
either phi(q), phi(k) and v (maps whose derivative is read off their output, ``FeatureMapSpec.derivative_from_output``:
nothing is recomputed) or q, k and v (other maps: phi is recomputed in backward). Both are as many bytes as the
qkv projection; plain autograd of the same forward also keeps the map's intermediates, [num | den] and the
quotient, and runs a backward op per forward op.

Two entry points: ``fused_linear_attention(q, k, v, ...)`` for any q [B, H, Nq, D], k [B, H, N, D],
v [B, H, N, Dv]; ``fused_linear_attention_qkv(qkv, ...)`` for self-attention on timm's packed projection
qkv [B, N, 3, H, D], whose gradient is written as one [B, N, 3, H, D] tensor (no zero-filled slice gradients to
sum) and whose output is token-major [B, N, H, D], so the projection that follows reads it without a transpose
copy. Both compute in float32 (float64 for float64 inputs) with autocast off and return the input's dtype.

The feature map needs a vector-Jacobian product (``FeatureMapSpec.with_vjp``); ``has_fused_backward(name)`` tells.
Under ``torch.compile`` dynamo traces forward and backward into the graph (no graph break), and inductor fuses
their elementwise parts with the surrounding kernels.
"""
from typing import Callable, Optional, Tuple, Union

import torch

from .feature_maps import feature_map_spec
from .linear_attention import _key_weights, autocast_off, check_attention_inputs, compute_dtype, state_from_features

__all__ = ['fused_linear_attention', 'fused_linear_attention_from_features',
           'fused_linear_attention_qkv', 'has_fused_backward', 'LinearAttentionFunction',
           'PackedLinearAttentionFunction']


def has_fused_backward(feature_map: str) -> bool:
    """True when feature map ``feature_map`` declares a vector-Jacobian product (the fused path can run)."""
    return feature_map_spec(feature_map).with_vjp is not None


def _key_weight_column(key_mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """key_mask None, [B, N] or [B, H, N] (bool keeps a key, float weighs it) -> None or weights [B, H|1, N, 1]."""
    return None if key_mask is None else _key_weights(key_mask, dtype).unsqueeze(-1)


def _mapped_keys(phi_k: torch.Tensor, v: torch.Tensor, w: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weight * phi_k, v) with masked keys (weight 0) zeroed exactly, even where k or v are not finite."""
    if w is None:
        return phi_k, v
    keep = w > 0
    return torch.where(keep, phi_k * w, 0.0), torch.where(keep, v, 0.0)


def _eps_count(eps: float, n_keys: int, w: Optional[torch.Tensor]) -> Union[torch.Tensor, float]:
    """eps times the number (total weight) of kept keys: eps relative to the mean normaliser."""
    if w is None:
        return eps * n_keys
    # with every key masked, num and den are exactly 0: a tiny count keeps 0 / (0 + eps * count) at 0
    return eps * w.sum(dim=-2, keepdim=True).clamp_min(1e-30)  # [B, H|1, 1, 1]


def _divide_token_major(num: torch.Tensor, den: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """num [B, H, N, Dv] / den [B, H, N, 1] cast to ``dtype``, as a [B, H, N, Dv] view of [B, N, H, Dv] memory."""
    b, h, n, dv = num.shape
    if torch.compiler.is_compiling():
        # functional form: inductor writes the quotient token-major in the kernel that divides
        return (num / den).to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.empty(b, n, h, dv, dtype=dtype, device=num.device).transpose(1, 2)
    if dtype == num.dtype:
        return torch.div(num, den, out=out)
    return out.copy_(num / den)


def _map(feature_map: Optional[str], x: torch.Tensor) -> torch.Tensor:
    """phi(x) as a fresh contiguous tensor (x [..., D] may be a strided view); feature_map None: x holds features
    already (the identity map)."""
    if feature_map is None:
        return x.contiguous()
    return feature_map_spec(feature_map).with_vjp(x)[0]


def _attend(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, eps: float, w: Optional[torch.Tensor],
            out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """phi_q [B, H, Nq, D], phi_k [B, H, N, D], v [B, H, N, Dv] in the compute dtype -> (out [B, H, Nq, Dv]
    token-major in ``out_dtype``, S [B, H, D, Dv + 1], den [B, H, Nq, 1])."""
    phi_k, v = _mapped_keys(phi_k, v, w)
    s = state_from_features(phi_k, v).sums.transpose(-2, -1)  # [B, H, D, Dv + 1], keys already weighted
    dv = v.shape[-1]
    num_den = phi_q @ s
    den = num_den[..., dv:] + _eps_count(eps, phi_k.shape[-2], w)
    return _divide_token_major(num_den[..., :dv], den, out_dtype), s, den


def _features_for_backward(feature_map: str, x: torch.Tensor,
                           phi: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(phi(x), vjp): from the kept phi when the forward kept it (the derivative read off phi), else recomputed;
    feature_map None: x is phi (the identity map, whose vjp is the gradient itself)."""
    if feature_map is None:
        return x, lambda grad: grad
    if phi is None:
        return feature_map_spec(feature_map).with_vjp(x)
    derivative = feature_map_spec(feature_map).derivative_from_output
    return phi, lambda grad: grad.mul_(derivative(phi))


def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str,
              w: Optional[torch.Tensor], s: torch.Tensor, den: torch.Tensor, out: torch.Tensor,
              phi_q: Optional[torch.Tensor] = None,
              phi_k: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) in the compute dtype, shapes of q, k, v; grad and out [B, H, Nq, Dv]. phi_q and
    phi_k: the features the forward kept (maps with derivative_from_output), else None (q and k are mapped
    again; then q and k must be given, otherwise they may be None)."""
    dv = v.shape[-1]
    grad_over_den = grad / den
    # the gradient at [num | den0]: the quotient rule of out = num / den, one extra column for the normaliser
    grad_num_den = torch.cat([grad_over_den, -(grad_over_den * out).sum(dim=-1, keepdim=True)], dim=-1)
    del grad_over_den
    phi_q, vjp_q = _features_for_backward(feature_map, q, phi_q)
    # dS^T [B, H, Dv + 1, D] rather than dS: the key-sum gradient dS[:, Dv] is then a contiguous row, which the
    # compiled kernel adding it to every key's gradient reads vectorised (a column, stride Dv + 1, made it scalar)
    grad_s_t = grad_num_den.transpose(-2, -1) @ phi_q
    dq = vjp_q(grad_num_den @ s.transpose(-2, -1))
    del phi_q, grad_num_den
    phi_k, vjp_k = _features_for_backward(feature_map, k, phi_k)
    # a contiguous v: the [N, Dv] x [Dv, D] matmul below ran 2x slower on the strided view of the qkv projection
    phi_k, v_kept = _mapped_keys(phi_k, v.contiguous(), w)
    # the gradient at K' of sum(K'^T [V | 1] * dS): [V | 1] dS^T = V dS[:, :Dv]^T + dS[:, Dv] (every key)
    grad_phi_k = (v_kept @ grad_s_t[..., :dv, :]).add_(grad_s_t[..., dv:, :])
    grad_v = phi_k @ grad_s_t[..., :dv, :].transpose(-2, -1)
    del phi_k
    if w is None:
        return dq, vjp_k(grad_phi_k), grad_v
    keep = w > 0
    # masked keys get exactly zero gradients, also where padding holds non-finite values (0 * nan would leak)
    dk = torch.where(keep, vjp_k(grad_phi_k.mul_(w)), 0.0)
    return dq, dk, torch.where(keep, grad_v, 0.0)


def _keeps_features(feature_map: Optional[str], dtype: torch.dtype) -> bool:
    """Whether the forward keeps phi(q), phi(k) (same bytes as q and k: only when they already hold the compute
    dtype) rather than q and k (for the identity map, None, those are the features)."""
    return feature_map is not None and feature_map_spec(feature_map).derivative_from_output is not None \
        and dtype == compute_dtype(dtype)


def _check_differentiable_mask(key_mask: Optional[torch.Tensor]) -> None:
    if key_mask is not None and key_mask.requires_grad:
        raise ValueError("fused linear attention takes key_mask as a constant; a key_mask that requires grad needs "
                         "linvit.ops.linear_attention (plain autograd)")


class LinearAttentionFunction(torch.autograd.Function):
    """apply(q [B, H, Nq, D], k [B, H, N, D], v [B, H, N, Dv], feature_map name or None, eps, key_mask or None)
    -> [B, H, Nq, Dv] in v's dtype (token-major memory). Gradients flow to q, k and v. feature_map None: q and k
    are features already (a learnable map's output, which trains through autograd before this Function)."""

    @staticmethod
    def forward(ctx, q, k, v, feature_map, eps, key_mask):
        dtype = compute_dtype(v.dtype)
        w = _key_weight_column(key_mask, dtype)
        phi_q, phi_k = _map(feature_map, q.to(dtype)), _map(feature_map, k.to(dtype))
        out, s, den = _attend(phi_q, phi_k, v.to(dtype), eps, w, v.dtype)
        ctx.keeps_features = _keeps_features(feature_map, q.dtype) and _keeps_features(feature_map, k.dtype)
        if ctx.keeps_features:
            ctx.save_for_backward(phi_q, phi_k, v, s, den, out, key_mask)
        else:
            ctx.save_for_backward(q, k, v, s, den, out, key_mask)
        ctx.feature_map = feature_map
        return out

    @staticmethod
    def backward(ctx, grad):
        first, second, v, s, den, out, key_mask = ctx.saved_tensors
        dtype = s.dtype
        w = _key_weight_column(key_mask, dtype)
        if ctx.keeps_features:  # phi(q), phi(k): q and k held the compute dtype, as these do
            dq, dk, dv = _backward(grad.to(dtype), None, None, v.to(dtype), ctx.feature_map, w, s, den,
                                   out.to(dtype), phi_q=first, phi_k=second)
        else:  # q, k
            dq, dk, dv = _backward(grad.to(dtype), first.to(dtype), second.to(dtype), v.to(dtype), ctx.feature_map,
                                   w, s, den, out.to(dtype))
        return dq.to(first.dtype), dk.to(second.dtype), dv.to(v.dtype), None, None, None


def _unpack_qkv(qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, N, 3, H, D] -> q, k, v as [B, H, N, D] views."""
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


class PackedLinearAttentionFunction(torch.autograd.Function):
    """apply(qkv [B, N, 3, H, D], feature_map name, eps, key_mask or None) -> out [B, N, H, D] in qkv's dtype.
    The gradient of qkv is one [B, N, 3, H, D] tensor.

    Kept for backward: phi(q), phi(k) and a contiguous copy of v when the map's derivative is a function of its
    output (then nothing holds the projection's output any more), else qkv itself; the same bytes either way.
    """

    @staticmethod
    def forward(ctx, qkv, feature_map, eps, key_mask):
        dtype = compute_dtype(qkv.dtype)
        w = _key_weight_column(key_mask, dtype)
        q, k, v = _unpack_qkv(qkv.to(dtype))
        phi_q, phi_k = _map(feature_map, q), _map(feature_map, k)
        out, s, den = _attend(phi_q, phi_k, v, eps, w, qkv.dtype)
        out = out.transpose(1, 2)  # [B, N, H, D], contiguous
        ctx.keeps_features = _keeps_features(feature_map, qkv.dtype)
        if ctx.keeps_features:
            # the backward's matmuls read v contiguous anyway; copying it here frees the projection's output
            ctx.save_for_backward(phi_q, phi_k, v.contiguous(), s, den, out, key_mask)
        else:
            ctx.save_for_backward(qkv, None, None, s, den, out, key_mask)
        ctx.feature_map = feature_map
        ctx.qkv_dtype = qkv.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        first, second, third, s, den, out, key_mask = ctx.saved_tensors
        dtype = s.dtype
        w = _key_weight_column(key_mask, dtype)
        grad, out = grad.to(dtype).transpose(1, 2), out.to(dtype).transpose(1, 2)
        if ctx.keeps_features:
            dq, dk, dv = _backward(grad, None, None, third, ctx.feature_map, w, s, den, out, phi_q=first,
                                   phi_k=second)
        else:
            q, k, v = _unpack_qkv(first.to(dtype))
            dq, dk, dv = _backward(grad, q, k, v, ctx.feature_map, w, s, den, out)
        # one contiguous [B, N, 3, H, D] write: the layout of the projection's output, which its backward reads
        grad_qkv = torch.stack([dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)], dim=2)
        return grad_qkv.to(ctx.qkv_dtype), None, None, None


def fused_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str = 'elu1',
                           eps: float = 1e-6, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``linvit.ops.linear_attention`` (same arguments and result, a feature map given by name) with the fused
    backward. q [B, H, Nq, D], k [B, H, N, D], v [B, H, N, Dv], key_mask [B, N] or [B, H, N] -> [B, H, Nq, Dv]."""
    check_attention_inputs(q, k, v, key_mask)
    _check_fused_map(feature_map)
    _check_differentiable_mask(key_mask)
    with autocast_off(v.device.type):
        return LinearAttentionFunction.apply(q, k, v, feature_map, eps, key_mask)


def fused_linear_attention_from_features(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                                         eps: float = 1e-6, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``linvit.ops.linear_attention_from_features`` with the closed-form backward: the core on features that a
    map already produced (a learnable map, whose own parameters train through autograd up to here).

    phi_q [B, H, Nq, F], phi_k [B, H, N, F] (non-negative), v [B, H, N, Dv], key_mask [B, N] or [B, H, N]
    -> [B, H, Nq, Dv] in v's dtype; computed in float32 (float64 for float64 inputs), gradients to all three."""
    check_attention_inputs(phi_q, phi_k, v, key_mask)
    _check_differentiable_mask(key_mask)
    with autocast_off(v.device.type):
        return LinearAttentionFunction.apply(phi_q, phi_k, v, None, eps, key_mask)


def fused_linear_attention_qkv(qkv: torch.Tensor, feature_map: str = 'elu1', eps: float = 1e-6,
                               key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Self-attention on a packed projection: qkv [B, N, 3, H, D] -> out [B, N, H, D] (token-major, qkv's dtype),
    key_mask [B, N] or [B, H, N]. The same function as ``linear_attention(q, k, v)`` on the unpacked q, k, v."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"fused_linear_attention_qkv expects qkv of shape [B, N, 3, H, D], got {list(qkv.shape)}")
    q, k, v = _unpack_qkv(qkv)
    check_attention_inputs(q, k, v, key_mask)
    _check_fused_map(feature_map)
    _check_differentiable_mask(key_mask)
    with autocast_off(qkv.device.type):
        return PackedLinearAttentionFunction.apply(qkv, feature_map, eps, key_mask)


def _check_fused_map(feature_map: str) -> None:
    # feature_map_spec raises a ValueError listing the known maps for an unknown name
    if feature_map_spec(feature_map).with_vjp is None:
        raise ValueError(f"feature map {feature_map!r} declares no vector-Jacobian product: declare one with "
                         f"FeatureMapSpec(name, fn, with_vjp=...) or use linvit.ops.linear_attention")
