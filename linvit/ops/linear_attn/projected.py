"""Linear attention followed by its output projection, with the projection folded into the key-side state.

A layer's output is proj(concat_h out_h) = sum_h out_h W_h^T + b, with W_h [C, Dv] the projection's columns of head h
and out_h = (A_h S_h) / den_h, A_h = phi(Q_h) [Nq, F], S_h = phi(K_h)^T V_h [F, Dv], den_h = A_h z_h + eps * count
(z_h = phi(K_h)^T 1, see ``linvit.ops.linear_attn.pytorch``). By associativity

    proj(out) = sum_h (A_h / den_h) (S_h W_h^T) + b = P M + b,   P = [A_1 / den_1 | ... | A_H / den_H]  [Nq, H F]
                                                                  M = [S_1 W_1^T ; ... ; S_H W_H^T]     [H F, C]

so the query-side matmul A_h S_h (Nq F Dv multiply-adds per head) and the pass that divides and transposes its
result disappear: M costs H F Dv C, nothing next to Nq, and P M is exactly as large as the projection it replaces.
Only the key side (S and z) remains as work that softmax-free token mixing adds to a ViT block. In a profile of the
compiled ViT-S at 4,097 tokens on a 2-core CPU, each of the two per-head matmuls took ~1.5 ms per block before the
fold, the elementwise kernels of the attention ~1.2 ms in all.

When V is itself a projection of the layer input, V_h = X W_{v,h}^T + 1 b_{v,h}^T (X [N, C_in], the value rows
W_{v,h} [Dv, C_in] of the layer's qkv projection), the key-side state needs no V either:

    S_h = phi(K_h)^T V_h = (phi(K_h)^T X) W_{v,h}^T + z_h b_{v,h}^T

and phi(K_h)^T X for all heads is one matmul, [H F, N] x [N, C_in], as large as the value projection it replaces
when F = Dv (the fixed maps). So ``projected_linear_attention_from_inputs`` drops the per-head key-side matmuls
(N F Dv multiply-adds per head, narrow and slower per FLOP than the large ones) and the pass that writes V: what
linear attention then adds to a ViT block is the feature-map pass and the normaliser. ViT-S at 1024 px on a 2-core
CPU: the attention layer eager 43.5 -> 40.6 ms, the whole model compiled 2% faster (docs/benchmarks.md).

Inference only (no autograd formula of its own; training takes the fused Function of
``linvit.ops.linear_attn.function``). Runs in the dtype of its inputs, which must be the attention core's compute
dtype (float32 or float64) with autocast off: the projection then runs in that dtype too, as it does after the
unfolded core.
"""
from typing import Optional, Union

import torch

from ..common import autocast_off
from .function import _divide_token_major, _eps_count, _key_weight_column, _mapped_keys
from .pytorch import check_attention_inputs

__all__ = ['projected_linear_attention_from_features', 'projected_linear_attention_from_inputs']


def _check_projection_bias(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """bias None or [C] for a projection weight [C, H * Dv]: a [1] bias would broadcast silently over C."""
    if bias is not None and list(bias.shape) != [weight.shape[0]]:
        raise ValueError(f"the projection bias must have shape [C] = [{weight.shape[0]}], got {list(bias.shape)}")


def _check_projection(v: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    h, dv = v.shape[1], v.shape[3]
    if weight.dim() != 2 or weight.shape[1] != h * dv:
        raise ValueError(f"the projection weight must have shape [C, H * Dv] = [C, {h * dv}] for v of shape "
                         f"{list(v.shape)}, got {list(weight.shape)}")
    _check_projection_bias(weight, bias)


def projected_linear_attention_from_features(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                                             weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                                             eps: float = 1e-6,
                                             key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(linear_attention_from_features(phi_q, phi_k, v, eps, key_mask) as [B, Nq, H * Dv], weight, bias)``
    computed as P M + b (module docstring).

    phi_q [B, H, Nq, F], phi_k [B, H, N, F] (non-negative features, any strides), v [B, H, N, Dv], weight [C, H * Dv],
    bias [C] or None, key_mask None, [B, N] or [B, H, N] (bool keeps a key, float weighs it), all in one dtype
    (float32 or float64) -> [B, Nq, C] in that dtype.
    """
    check_attention_inputs(phi_q, phi_k, v, key_mask)
    _check_projection(v, weight, bias)
    with autocast_off(v.device.type):
        return _projected(phi_q, phi_k, v, weight, bias, eps, key_mask)


def _normalised_queries(phi_q: torch.Tensor, z: torch.Tensor,
                        eps_count: Union[float, torch.Tensor]) -> torch.Tensor:
    """P = [A_1 / den_1 | ... | A_H / den_H] token-major: phi_q [B, H, Nq, F], z [B, H, F], eps_count a float or
    [B, H|1, 1, 1] -> [B, Nq, H F] (the matmul after it reads this without a copy)."""
    b, h, nq, f = phi_q.shape
    if torch.compiler.is_compiling():
        # token-major throughout, the normaliser as a multiply-sum over F: inductor writes phi(q) token-major with
        # the feature-map kernel and divides it in place, where the matmul reads P (a head-major quotient cost a
        # transposing copy per block)
        a = phi_q.transpose(1, 2)  # [B, Nq, H, F]
        if isinstance(eps_count, torch.Tensor):
            eps_count = eps_count.transpose(1, 2)  # [B, 1, H|1, 1]
        den = (a * z.unsqueeze(1)).sum(dim=-1, keepdim=True) + eps_count  # [B, Nq, H, 1]
        return (a / den).reshape(b, nq, h * f)
    den = phi_q @ z.unsqueeze(-1) + eps_count  # [B, H, Nq, 1]: one matrix-vector product per head
    return _divide_token_major(phi_q, den, phi_q.dtype).transpose(1, 2).reshape(b, nq, h * f)


def _projected(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor,
               bias: Optional[torch.Tensor], eps: float, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    w = _key_weight_column(key_mask, phi_k.dtype)
    eps_count = _eps_count(eps, phi_k.shape[-2], w)
    phi_k, v = _mapped_keys(phi_k, v, w)
    kv_t = v.transpose(-2, -1) @ phi_k  # [B, H, Dv, F]: S_h^T
    p = _normalised_queries(phi_q, phi_k.sum(dim=-2), eps_count)  # [B, Nq, H F]
    return _project_state(p, kv_t.transpose(-2, -1), weight, bias)


def _project_state(p: torch.Tensor, s: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """P M + b: p [B, Nq, H F], the key-side states s [B, H, F, Dv], weight [C, H Dv], bias [C] or None ->
    [B, Nq, C]."""
    b, h, f, dv = s.shape
    m = s @ weight.t().reshape(h, dv, weight.shape[0])  # [B, H, F, C]: S_h W_h^T
    out = p @ m.reshape(b, h * f, -1)
    if bias is None:
        return out
    if torch.compiler.is_compiling():
        # functional: inductor writes the sum into a buffer it plans; an in-place add made it place the product
        # elsewhere, and ViT-S at 1024 px then refaulted 61k pages (240 MB) per call from glibc's trimmed heap
        return out + bias
    return out.add_(bias)  # eager: no second [B, Nq, C] buffer


def _check_value_projection(phi_k: torch.Tensor, x: torch.Tensor, value_weight: torch.Tensor,
                            value_bias: Optional[torch.Tensor], weight: torch.Tensor,
                            bias: Optional[torch.Tensor]) -> None:
    b, h, n, _ = phi_k.shape
    if x.dim() != 3 or x.shape[0] != b or x.shape[1] != n:
        raise ValueError(f"the layer input x must have shape [B, N, C_in] = [{b}, {n}, C_in] for keys of shape "
                         f"{list(phi_k.shape)}, got {list(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] % h != 0:
        raise ValueError(f"the projection weight must have shape [C, H * Dv] with H = {h}, got {list(weight.shape)}")
    expected = [weight.shape[1], x.shape[2]]
    if list(value_weight.shape) != expected:
        raise ValueError(f"the value weight must have shape [H * Dv, C_in] = {expected} for x of shape "
                         f"{list(x.shape)} and a projection weight of shape {list(weight.shape)}, got "
                         f"{list(value_weight.shape)}")
    if value_bias is not None and list(value_bias.shape) != expected[:1]:
        raise ValueError(f"the value bias must have shape [H * Dv] = {expected[:1]}, got {list(value_bias.shape)}")
    _check_projection_bias(weight, bias)


def projected_linear_attention_from_inputs(phi_q: torch.Tensor, phi_k: torch.Tensor, x: torch.Tensor,
                                           value_weight: torch.Tensor, value_bias: Optional[torch.Tensor],
                                           weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                                           eps: float = 1e-6) -> torch.Tensor:
    """``projected_linear_attention_from_features(phi_q, phi_k, v, weight, bias, eps)`` for the values
    v = ``F.linear(x, value_weight, value_bias)`` split into H heads of width Dv, without forming v (module
    docstring). No key mask: a masked key's token may hold values that are not finite, which v would zero and
    phi(K)^T X cannot; masked calls take ``projected_linear_attention_from_features``.

    phi_q [B, H, Nq, F], phi_k [B, H, N, F] (non-negative features, any strides; token-major phi_k, as a view of
    the layer's qk projection, is read without a copy), x [B, N, C_in], value_weight [H * Dv, C_in], value_bias
    [H * Dv] or None, weight [C, H * Dv], bias [C] or None, all in one dtype (float32 or float64) -> [B, Nq, C].
    """
    check_attention_inputs(phi_q, phi_k, phi_k)
    _check_value_projection(phi_k, x, value_weight, value_bias, weight, bias)
    with autocast_off(x.device.type):
        return _projected_from_inputs(phi_q, phi_k, x, value_weight, value_bias, weight, bias, eps)


def _projected_from_inputs(phi_q: torch.Tensor, phi_k: torch.Tensor, x: torch.Tensor, value_weight: torch.Tensor,
                           value_bias: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
                           eps: float) -> torch.Tensor:
    b, h, n, f = phi_k.shape
    dv = weight.shape[1] // h
    keys = phi_k.transpose(1, 2).reshape(b, n, h * f)  # [B, N, H F]
    kx = (keys.transpose(1, 2) @ x).reshape(b, h, f, -1)  # [B, H, F, C_in]: phi(K_h)^T X, all heads in one matmul
    z = phi_k.sum(dim=-2)  # [B, H, F]
    s = kx @ value_weight.reshape(h, dv, -1).transpose(1, 2)  # [B, H, F, Dv]
    if value_bias is not None:
        s = s + z.unsqueeze(-1) * value_bias.reshape(h, 1, dv)
    p = _normalised_queries(phi_q, z, _eps_count(eps, n, None))
    return _project_state(p, s, weight, bias)
