"""What the causal forms share: the recurrence they compute, its per-step multipliers (decay, gates), the ones
column of the values and the normaliser.

With features Q = phi(q), K = phi(k) [N, D], values with a ones column Va = [v | 1] [N, Dv + 1] and per-step log
multipliers a [N, Dg] (Dg = D: a gate per channel; Dg = 1: one per token; a_t = log(decay) + log(gate_t)):

    S_t = diag(exp(a_t)) S_{t-1} + K_t Va_t^T          [D, Dv + 1], S_0 = 0
    [num_t | den_t] = Q_t^T S_t,   out_t = num_t / (den_t + eps (t + 1))

i.e. out_t = sum_{j<=t} sum_c Q_tc K_jc w_tjc v_j / (same with 1 for v_j, + eps (t + 1)), with weights
w_tjc = exp(sum_{l=j+1}^{t} a_lc) <= 1. eps is relative to the mean similarity over the t + 1 keys seen, as the
non-causal core's: without decay or gate, the last row equals non-causal linear attention over the whole sequence.

Numerics: every weight is formed as exp of a sum of log multipliers that are <= 0: cumulative products are never
taken over the sequence (they underflow after a few thousand gates of 0.99). Log multipliers below
``LOG_MULTIPLIER_MIN`` (gates below exp(-40) ~ 4e-18) count as that value, so a gate of exactly 0 stays finite.
Cores run in float32 (float64 for float64 inputs) with autocast off; outputs take the dtype of ``v``.
"""
from typing import Optional, Sequence, Tuple, Union

import torch

from ..common import compute_dtype
from ..feature_maps import FeatureMap, get_feature_map

__all__ = ['CAUSAL_FORMS', 'Decay', 'LOG_MULTIPLIER_MIN', 'log_multipliers', 'retention_decays']


Decay = Union[None, float, Sequence[float], torch.Tensor]


CAUSAL_FORMS = ('parallel', 'chunked', 'recurrent')


LOG_MULTIPLIER_MIN = -40.0


def retention_decays(num_heads: int) -> torch.Tensor:
    """RetNet's per-head decays gamma_h = 1 - 2^(-5 - h) for h < 8 heads, spread over the same range (1/32 .. 1/4096
    forgetting per step) for more heads: [num_heads] float64, from short-range to long-range heads."""
    exponents = torch.linspace(5.0, 12.0, num_heads, dtype=torch.float64) if num_heads > 8 else \
        torch.arange(5, 5 + num_heads, dtype=torch.float64)
    return 1.0 - torch.pow(2.0, -exponents)


def _decay_logs(decay: Decay, num_heads: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    """decay None, a float or per-head values in (0, 1] -> log(decay) as [1, H, 1, 1] (None for no decay).

    Python numbers are checked here; tensors only on the CPU (checking a GPU tensor would wait for the device)."""
    if decay is None:
        return None
    if isinstance(decay, torch.Tensor):
        gamma = decay.to(device=device, dtype=dtype)
        check = gamma.device.type == 'cpu' and not gamma.requires_grad and not torch.compiler.is_compiling()
        values = gamma.reshape(-1).tolist() if check else []
    else:
        values = [float(decay)] if isinstance(decay, (int, float)) else [float(d) for d in decay]
        gamma = torch.tensor(values, dtype=dtype, device=device)
    if not all(0.0 < value <= 1.0 for value in values):
        raise ValueError(f"decay values must lie in (0, 1], got {values}")
    if gamma.dim() == 0 or gamma.numel() == 1:
        gamma = gamma.reshape(1).expand(num_heads)
    if gamma.shape != (num_heads,):
        raise ValueError(f"decay must be a float or hold one value per head ({num_heads}), got shape "
                         f"{list(gamma.shape)}")
    return torch.log(gamma).view(1, num_heads, 1, 1)


def log_multipliers(q: torch.Tensor, decay: Decay = None, gate: Optional[torch.Tensor] = None,
                    log_gate: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The per-step log multipliers a = log(decay) + log(gate) in the compute dtype, or None without either.

    q: [B, H, N, D] (for shapes, dtype and device). decay: None, a float or [H] values in (0, 1]. gate: values in
    [0, 1] of shape [B, H, N, D] (per channel) or [B, H, N, 1] (per token); or log_gate: its log (<= 0), same shapes.
    Returns [B|1, H, N|1, D|1], clamped below at LOG_MULTIPLIER_MIN.
    """
    if gate is not None and log_gate is not None:
        raise ValueError("pass gate or log_gate, not both")
    dtype = compute_dtype(q.dtype)
    b, h, n, d = q.shape
    out = _decay_logs(decay, h, dtype, q.device)
    if gate is not None or log_gate is not None:
        name, given = ('gate', gate) if gate is not None else ('log_gate', log_gate)
        if given.dim() != 4 or list(given.shape[:3]) != [b, h, n] or given.shape[3] not in (1, d):
            raise ValueError(f"{name} must have shape [B, H, N, D] = {[b, h, n, d]} or [B, H, N, 1], got "
                             f"{list(given.shape)}")
        given = given.to(dtype)
        logs = torch.log(given) if gate is not None else given
        out = logs if out is None else out + logs
    if out is None:
        return None
    return out.clamp_min(LOG_MULTIPLIER_MIN)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (('q', q), ('k', k), ('v', v)):
        if t.dim() != 4:
            raise ValueError(f"causal linear attention expects {name} of shape [B, H, N, D], got {list(t.shape)}")
    if q.shape != k.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q and k must be [B, H, N, D] and v [B, H, N, Dv] with the same B, H, N: got q "
                         f"{list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """v [..., N, Dv] -> [v | 1] [..., N, Dv + 1]: one matmul gives numerator and normaliser."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def _normalize(out1: torch.Tensor, eps: float, count: Union[torch.Tensor, int]) -> torch.Tensor:
    """[num | den] [..., Dv + 1] -> num / (den + eps * count), count the keys each row has seen ([N, 1] or a number)."""
    return out1[..., :-1] / (out1[..., -1:] + eps * count)


def _steps_seen(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[N, 1]: 1, ..., N (keys each causal row has seen)."""
    return torch.arange(1, n + 1, dtype=dtype, device=device).unsqueeze(-1)


def _features(q: torch.Tensor, k: torch.Tensor, feature_map: Union[str, FeatureMap]
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    phi = get_feature_map(feature_map) if isinstance(feature_map, str) else feature_map
    dtype = compute_dtype(q.dtype)
    return phi(q.to(dtype)), phi(k.to(dtype))


def _check_form(form: str, chunk_size: Optional[int]) -> None:
    if form not in CAUSAL_FORMS:
        raise ValueError(f"form must be one of {list(CAUSAL_FORMS)}, got {form!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")
