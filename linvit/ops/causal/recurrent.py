"""The recurrent form of causal linear attention: one token at a time through the state S [B, H, D, Dv + 1], O(D Dv)
memory whatever the length (``causal_linear_attention_step`` for a caller that feeds tokens one by one).
"""
from typing import NamedTuple, Optional, Tuple, Union

import torch

from ..common import autocast_off, compute_dtype
from ..feature_maps import FeatureMap
from .common import Decay, _features, _normalize, _with_ones, log_multipliers

__all__ = ['CausalState', 'causal_linear_attention_step']


def _recurrent_scan(phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor,
                    a: Optional[torch.Tensor]) -> torch.Tensor:
    """One token at a time through the state S [B, H, D, E]: the RNN form, O(D E) memory per step."""
    b, h, n, d = phi_q.shape
    state = phi_q.new_zeros(b, h, d, va.shape[-1])
    outs = []
    for t in range(n):
        a_t = None if a is None else a[:, :, min(t, a.shape[2] - 1)]
        state = _advance(state, phi_k[:, :, t], va[:, :, t], a_t)
        outs.append((phi_q[:, :, t].unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outs, dim=2)


def _advance(state: torch.Tensor, phi_k_t: torch.Tensor, va_t: torch.Tensor,
             a_t: Optional[torch.Tensor]) -> torch.Tensor:
    """S <- diag(exp(a_t)) S + K_t Va_t^T: state [B, H, D, E], phi_k_t [B, H, D], va_t [B, H, E], a_t [B|1, H, Dg]."""
    if a_t is not None:
        state = state * torch.exp(a_t).unsqueeze(-1)
    return state + phi_k_t.unsqueeze(-1) * va_t.unsqueeze(-2)


class CausalState(NamedTuple):
    """The recurrent state after ``steps`` tokens: kv = sum_j w_j phi(k_j) [v_j | 1]^T, [B, H, D, Dv + 1], in the
    compute dtype. Its size does not depend on how many tokens it has seen."""
    kv: torch.Tensor
    steps: int


def causal_linear_attention_step(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
                                 state: Optional[CausalState] = None,
                                 feature_map: Union[str, FeatureMap] = 'elu1', decay: Decay = None,
                                 gate_t: Optional[torch.Tensor] = None, eps: float = 1e-6,
                                 log_gate_t: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, CausalState]:
    """One step of the recurrent form: (out_t, new state) for the next token.

    q_t, k_t: [B, H, D]; v_t: [B, H, Dv]; state: None before the first token; gate_t / log_gate_t: [B, H, D] or
    [B, H, 1]. Feeding tokens 0..N-1 in order gives causal_linear_attention's rows. Returns out_t [B, H, Dv] in the
    dtype of ``v_t`` and the state (constant size).
    """
    if q_t.dim() != 3 or k_t.shape != q_t.shape or v_t.dim() != 3 or v_t.shape[:2] != q_t.shape[:2]:
        raise ValueError(f"a step takes q_t, k_t [B, H, D] and v_t [B, H, Dv] with the same B, H: got q_t "
                         f"{list(q_t.shape)}, k_t {list(k_t.shape)}, v_t {list(v_t.shape)}")
    dtype = compute_dtype(v_t.dtype)
    b, h, d = q_t.shape
    with autocast_off(v_t.device.type):
        gate = None if gate_t is None else gate_t.unsqueeze(2)
        log_gate = None if log_gate_t is None else log_gate_t.unsqueeze(2)
        a = log_multipliers(q_t.unsqueeze(2), decay, gate, log_gate)
        phi_q, phi_k = _features(q_t, k_t, feature_map)
        kv = state.kv if state is not None else torch.zeros(b, h, d, v_t.shape[-1] + 1, dtype=dtype,
                                                                device=v_t.device)
        steps = state.steps if state is not None else 0
        kv = _advance(kv, phi_k, _with_ones(v_t.to(dtype)), None if a is None else a[:, :, 0])
        out = _normalize((phi_q.unsqueeze(-2) @ kv).squeeze(-2), eps, steps + 1)
    return out.to(v_t.dtype), CausalState(kv, steps + 1)
