"""Non-causal linear attention as one autograd Function: the feature map inside, a closed-form backward.

With A = phi(Q) [Nq, D], K' = phi(K) [N, D] (masked keys zeroed, kept keys weighted), S = K'^T [V | 1]
[D, Dv + 1] and [num | den0] = A S, the forward is out = num / den with den = den0 + eps * count (see
``linvit.ops.linear_attn.pytorch`` for the mean normaliser). For an upstream gradient G [Nq, Dv]:

    G' = [G / den | -rowsum(G * out) / den]      the gradient at A S: the division's backward, fused
    dA = G' S^T,   dS = A^T G',   dK' = [V | 1] dS^T,   dV = K' dS[:, :Dv]
    dQ = phi'(Q) dA,   dK = phi'(K) (weight * dK')   (the feature map's vector-Jacobian product)

a handful of [N, D] x [D, Dv + 1] matmuls and one elementwise pass per tensor. Saved for backward: the small
S [D, Dv + 1], the normaliser den [Nq] per head, the output (the tensor the layer's projection saves anyway) and
either phi(q), phi(k) and v (maps whose derivative is read off their output, ``FeatureMapSpec.derivative_from_output``:
nothing is recomputed) or q, k and v (other maps: phi is recomputed in backward). Both are as many bytes as the
qkv projection; plain autograd of the same forward also keeps the map's intermediates, [num | den] and the
quotient, and runs a backward op per forward op.

The backward is two halves, as the forward is (``linvit.ops.linear_attention_state`` and ``_apply``): the query
half (``_grad_queries``: dQ and dS from G') and the key half (``_grad_keys``: dK and dV from dS), which the
registered state and apply ops (``linvit.ops.linear_attn.op``) run on their own.

Entry points: ``fused_linear_attention(q, k, v, ...)`` for any q [B, H, Nq, D], k [B, H, N, D], v [B, H, N, Dv],
and ``fused_linear_attention_from_features`` for features a learnable map made. Both compute in float32 (float64
for float64 inputs) with autocast off and return the input's dtype, the output token-major [B, N, H, Dv] in memory
(so the projection that follows reads it without a transpose copy).

The feature map needs a vector-Jacobian product (``FeatureMapSpec.with_vjp``); ``has_fused_backward(name)`` tells.
Under ``torch.compile`` dynamo traces forward and backward into the graph (no graph break), and inductor fuses
their elementwise parts with the surrounding kernels.
"""
from typing import Callable, Optional, Tuple, Union

import torch

from ..common import autocast_off, compute_dtype
from ..feature_maps import feature_map_spec
from .pytorch import _key_weights, check_attention_inputs, state_from_features

__all__ = ['fused_linear_attention', 'fused_linear_attention_from_features', 'has_fused_backward',
           'LinearAttentionFunction']


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


def _grad_queries(grad: torch.Tensor, q: Optional[torch.Tensor], feature_map: Optional[str], s: torch.Tensor,
                  den: torch.Tensor, out: torch.Tensor, phi_q: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query half of the backward: (dq, dS^T [B, H, Dv + 1, F], G' [B, H, Nq, Dv + 1]) in the compute dtype.
    grad and out [B, H, Nq, Dv], s = S [B, H, F, Dv + 1], den [B, H, Nq, 1]; phi_q: the features the forward kept
    (maps with derivative_from_output), else None (q is mapped again). G'[..., Dv] is the gradient at den."""
    grad_over_den = grad / den
    # the gradient at [num | den0]: the quotient rule of out = num / den, one extra column for the normaliser
    grad_num_den = torch.cat([grad_over_den, -(grad_over_den * out).sum(dim=-1, keepdim=True)], dim=-1)
    del grad_over_den
    phi_q, vjp_q = _features_for_backward(feature_map, q, phi_q)
    # dS^T [B, H, Dv + 1, D] rather than dS: the key-sum gradient dS[:, Dv] is then a contiguous row, which the
    # compiled kernel adding it to every key's gradient reads vectorised (a column, stride Dv + 1, made it scalar)
    grad_s_t = grad_num_den.transpose(-2, -1) @ phi_q
    dq = vjp_q(grad_num_den @ s.transpose(-2, -1))
    return dq, grad_s_t, grad_num_den


def _grad_keys(grad_s_t: torch.Tensor, k: Optional[torch.Tensor], v: torch.Tensor, feature_map: Optional[str],
               w: Optional[torch.Tensor], phi_k: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The key half of the backward: (dk, dv) in the compute dtype from the gradient at the state
    dS^T [B, H, Dv + 1, F]; k [B, H, N, D] (None when phi_k, the features the forward kept, is given), v
    [B, H, N, Dv], w None or key weights [B, H|1, N, 1]. Masked keys get exactly zero gradients."""
    dv = v.shape[-1]
    phi_k, vjp_k = _features_for_backward(feature_map, k, phi_k)
    # a contiguous v: the [N, Dv] x [Dv, D] matmul below ran 2x slower on the strided view of the qkv projection
    phi_k, v_kept = _mapped_keys(phi_k, v.contiguous(), w)
    # the gradient at K' of sum(K'^T [V | 1] * dS): [V | 1] dS^T = V dS[:, :Dv]^T + dS[:, Dv] (every key)
    grad_phi_k = (v_kept @ grad_s_t[..., :dv, :]).add_(grad_s_t[..., dv:, :])
    grad_v = phi_k @ grad_s_t[..., :dv, :].transpose(-2, -1)
    del phi_k
    if w is None:
        return vjp_k(grad_phi_k), grad_v
    keep = w > 0
    # masked keys get exactly zero gradients, also where padding holds non-finite values (0 * nan would leak)
    dk = torch.where(keep, vjp_k(grad_phi_k.mul_(w)), 0.0)
    return dk, torch.where(keep, grad_v, 0.0)


def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str,
              w: Optional[torch.Tensor], s: torch.Tensor, den: torch.Tensor, out: torch.Tensor,
              phi_q: Optional[torch.Tensor] = None,
              phi_k: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) in the compute dtype, shapes of q, k, v; grad and out [B, H, Nq, Dv]: the query
    half, then the key half. phi_q and phi_k: the features the forward kept (maps with derivative_from_output),
    else None (q and k are mapped again; then q and k must be given, otherwise they may be None)."""
    dq, grad_s_t, _ = _grad_queries(grad, q, feature_map, s, den, out, phi_q)
    dk, dv = _grad_keys(grad_s_t, k, v, feature_map, w, phi_k)
    return dq, dk, dv


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


def _check_fused_map(feature_map: str) -> None:
    # feature_map_spec raises a ValueError listing the known maps for an unknown name
    if feature_map_spec(feature_map).with_vjp is None:
        raise ValueError(f"feature map {feature_map!r} declares no vector-Jacobian product: declare one with "
                         f"FeatureMapSpec(name, fn, with_vjp=...) or use linvit.ops.linear_attention")
