"""Causal linear attention as an RNN (Katharopoulos et al. 2020), with a decay (RetNet) and data-dependent gates
(GLA): one function (``common``), three forms (``form=``):

    parallel:  ``naive``, the masked quadratic form; exact, O(N^2), for short sequences.
    chunked:   ``chunk``, quadratic inside chunks, states between them; trains with the memory-efficient backward.
    recurrent: ``recurrent``, one step at a time, O(D Dv) memory whatever the length.
"""
from typing import Optional, Union

import torch

from ..common import autocast_off, compute_dtype
from ..feature_maps import FeatureMap
from .chunk import chunked_scan
from .common import Decay, _check_form, _check_qkv, _features, _normalize, _steps_seen, _with_ones, log_multipliers
from .naive import _parallel_scan
from .recurrent import _recurrent_scan

__all__ = ['causal_linear_attention', 'causal_linear_scan']


def causal_linear_scan(phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor, a: Optional[torch.Tensor] = None,
                       form: str = 'chunked', chunk_size: Optional[int] = None) -> torch.Tensor:
    """The unnormalised causal scan on features, in one dtype with autocast off: out_t = Q_t^T S_t.

    phi_q, phi_k: [B, H, N, D] (non-negative); va: [B, H, N, E] (values, usually with a ones column);
    a: log multipliers [B|1, H, N|1, Dg] (Dg in {1, D}, <= 0) or None. Returns [B, H, N, E].
    """
    _check_form(form, chunk_size)
    if form == 'parallel':
        return _parallel_scan(phi_q, phi_k, va, a)
    if form == 'recurrent':
        return _recurrent_scan(phi_q, phi_k, va, a)
    return chunked_scan(phi_q, phi_k, va, a, chunk_size)


def causal_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            feature_map: Union[str, FeatureMap] = 'elu1', decay: Decay = None,
                            gate: Optional[torch.Tensor] = None, eps: float = 1e-6, form: str = 'chunked',
                            chunk_size: Optional[int] = None, log_gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal linear attention: token t attends to tokens 0..t (see the module docstring for the formula).

    Args:
        q, k: [B, H, N, D]; v: [B, H, N, Dv].
        feature_map: a name in ``FEATURE_MAPS`` or a function [..., D] -> non-negative [..., D].
        decay: None, a float or [H] per-head values in (0, 1] (RetNet's gamma; may require grad).
        gate: data-dependent forget gate in [0, 1], [B, H, N, D] (per channel, GLA) or [B, H, N, 1] (per token);
            or ``log_gate``, its log (<= 0, e.g. logsigmoid of a projection), which keeps tiny gates exact.
        eps: added to the normaliser times the number of keys seen.
        form: 'parallel', 'chunked' or 'recurrent' (same function; see the module docstring).
        chunk_size: tokens per chunk of the chunked form (any N; the last chunk is padded); None: 64, or 16 with
            per-channel gates (``default_chunk_size``).

    Returns:
        [B, H, N, Dv] in the dtype of ``v``, computed in float32 (float64 for float64 inputs).
    """
    _check_qkv(q, k, v)
    _check_form(form, chunk_size)
    dtype = compute_dtype(v.dtype)
    with autocast_off(v.device.type):
        a = log_multipliers(q, decay, gate, log_gate)
        phi_q, phi_k = _features(q, k, feature_map)
        out1 = causal_linear_scan(phi_q, phi_k, _with_ones(v.to(dtype)), a, form, chunk_size)
        out = _normalize(out1, eps, _steps_seen(q.shape[2], dtype, v.device))
    return out.to(v.dtype)
