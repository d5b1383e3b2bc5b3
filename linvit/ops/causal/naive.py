"""The parallel form of causal linear attention: the masked quadratic [N, N] (per-channel gates: [N, N, D]) form of
the recurrence in ``common``; exact, O(N^2), for short sequences and as the reference the other forms meet. Its
pair weights also weigh the pairs inside a chunk of the chunked form.
"""
import math
from typing import Optional

import torch


def _tril(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] bool, True where j <= t (row t, column j)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def _pair_weights(b: torch.Tensor) -> torch.Tensor:
    """Cumulative log multipliers b [..., L, Dg] -> w [..., L, L, Dg], w[t, j] = exp(b_t - b_j) for j <= t, else 0.

    The difference is masked before exp, so the j > t entries (positive exponents) never overflow."""
    diff = b.unsqueeze(-2) - b.unsqueeze(-3)  # [..., t, j, Dg]
    return torch.exp(diff.masked_fill(~_tril(b.shape[-2], b.device).unsqueeze(-1), -math.inf))


def _weighted_scores(phi_q: torch.Tensor, phi_k: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
    """sum_c Q_tc K_jc w_tjc -> [..., L, L] (w None: causal mask only; w [..., L, L, 1]: scalar weights)."""
    if w is None:
        return (phi_q @ phi_k.transpose(-2, -1)).masked_fill(~_tril(phi_q.shape[-2], phi_q.device), 0.0)
    if w.shape[-1] == 1:
        return (phi_q @ phi_k.transpose(-2, -1)) * w.squeeze(-1)
    return torch.einsum('...tc,...jc,...tjc->...tj', phi_q, phi_k, w)


def _parallel_scan(phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor,
                   a: Optional[torch.Tensor]) -> torch.Tensor:
    """The masked quadratic form: [B, H, N, D] x2, va [B, H, N, E], a [B|1, H, N|1, Dg] or None -> [B, H, N, E]."""
    w = None
    if a is not None:
        n = phi_q.shape[-2]
        w = _pair_weights(torch.cumsum(a.expand(*a.shape[:2], n, a.shape[-1]), dim=-2))
    return _weighted_scores(phi_q, phi_k, w) @ va
