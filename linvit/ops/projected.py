"""Linear attention followed by its output projection, with the projection folded into the key-side state.

A layer's output is proj(concat_h out_h) = sum_h out_h W_h^T + b, with W_h [C, Dv] the projection's columns of head h
and out_h = (A_h S_h) / den_h, A_h = phi(Q_h) [Nq, F], S_h = phi(K_h)^T V_h [F, Dv], den_h = A_h z_h + eps * count
(z_h = phi(K_h)^T 1, see ``linvit.ops.linear_attention``). By associativity

    proj(out) = sum_h (A_h / den_h) (S_h W_h^T) + b = P M + b,   P = [A_1 / den_1 | ... | A_H / den_H]  [Nq, H F]
                                                                  M = [S_1 W_1^T ; ... ; S_H W_H^T]     [H F, C]

so the query-side matmul A_h S_h (Nq F Dv multiply-adds per head) and the pass that divides and transposes its
result disappear: M costs H F Dv C, nothing next to Nq, and P M is exactly as large as the projection it replaces.
Only the key side (S and z) remains as work that softmax-free token mixing adds to a ViT block. In a profile of the
compiled ViT-S at 4,097 tokens on a 2-core CPU, each of the two per-head matmuls took ~1.5 ms per block before the
fold, the elementwise kernels of the attention ~1.2 ms in all.

Inference only (no autograd formula of its own; training takes the fused Function of ``linvit.ops.fused``). Runs in
the dtype of its inputs, which must be the attention core's compute dtype (float32 or float64) with autocast off:
the projection then runs in that dtype too, as it does after the unfolded core.
"""
from typing import Optional, Union

import torch

from .fused import _divide_token_major, _eps_count, _key_weight_column, _mapped_keys
from .linear_attention import autocast_off, check_attention_inputs

__all__ = ['projected_linear_attention_from_features']


def _check_projection(v: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    h, dv = v.shape[1], v.shape[3]
    if weight.dim() != 2 or weight.shape[1] != h * dv:
        raise ValueError(f"the projection weight must have shape [C, H * Dv] = [C, {h * dv}] for v of shape "
                         f"{list(v.shape)}, got {list(weight.shape)}")
    if bias is not None and list(bias.shape) != [weight.shape[0]]:
        raise ValueError(f"the projection bias must have shape [C] = [{weight.shape[0]}], got {list(bias.shape)}")


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
    b, h, _, f = phi_q.shape
    w = _key_weight_column(key_mask, phi_k.dtype)
    eps_count = _eps_count(eps, phi_k.shape[-2], w)
    phi_k, v = _mapped_keys(phi_k, v, w)
    kv_t = v.transpose(-2, -1) @ phi_k  # [B, H, Dv, F]: S_h^T
    p = _normalised_queries(phi_q, phi_k.sum(dim=-2), eps_count)  # [B, Nq, H F]
    m = kv_t.transpose(-2, -1) @ weight.t().reshape(h, -1, weight.shape[0])  # [B, H, F, C]: S_h W_h^T
    out = p @ m.reshape(b, h * f, -1)
    if bias is None:
        return out
    if torch.compiler.is_compiling():
        # functional: inductor writes the sum into a buffer it plans; an in-place add made it place the product
        # elsewhere, and ViT-S at 1024 px then refaulted 61k pages (240 MB) per call from glibc's trimmed heap
        return out + bias
    return out.add_(bias)  # eager: no second [B, Nq, C] buffer
