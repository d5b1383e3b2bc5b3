"""How linear attention turns similarities into weights: the normaliser, declared once per name in ``NORMALIZERS``.

With per-key similarities s_ij = phi(q_i)^T phi(k_j) >= 0 and the means over the kept keys (weights w_j, count
C = sum_j w_j)

    a_i = sum_j w_j s_ij v_j / C,    s_i = sum_j w_j s_ij / C,    v_bar = sum_j w_j v_j / C,

each normaliser is a closed form of (a_i, s_i, v_bar), so every one of them costs what plain linear attention costs
(one more mean over the values):

- ``divide`` (Katharopoulos et al. 2020): a_i / (s_i + eps). The weights s_ij / sum_j s_ij do not change when q_i is
  scaled: the normaliser cancels the query's magnitude. What the op, its Triton kernels, the projection folds, the
  state form and the rotary form compute.
- ``inline`` (InLine, Han et al. 2024, "Bridging the Divide"): weights s_ij / C - s_i / C + 1 / C, i.e. subtract the
  mean similarity and add 1 / N: out = v_bar + a_i - s_i v_bar. The map from similarities to weights is injective
  (two queries with different similarity rows get different weights), which dividing is not; the weights sum to 1
  and may be negative.
- ``mala`` (MALA, Fan et al. 2025, "Rectifying Magnitude Neglect in Linear Attention"): weights beta_i s_ij / C -
  gamma_i / C with beta_i = 1 + 1 / s_i and gamma_i = s_i: out = a_i / (s_i + eps) + a_i - s_i v_bar. The weights sum
  to 1, and their spread grows with s_i, i.e. with the query's magnitude, as softmax's does.

``inline`` and ``mala`` add a_i - s_i v_bar = phi(q_i)^T (sum_j w_j phi(k_j) (v_j - v_bar)^T / C), a mean: it stays
in range in float32 at any number of tokens. They need v_bar, which the attention state (``AttentionState``) does not
hold, and they run on the PyTorch path only (``NormalizerSpec.fast_paths``).
"""
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from ...registry import Registry

__all__ = ['NormalizerSpec', 'NORMALIZERS', 'DEFAULT_NORMALIZER', 'normalizer_spec', 'list_normalizers',
           'divide', 'inline', 'mala']

#: combine(a [..., Nq, Dv], s [..., Nq, 1], v_bar [..., 1, Dv], eps) -> out [..., Nq, Dv]
Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def divide(a: torch.Tensor, s: torch.Tensor, v_bar: torch.Tensor, eps: float) -> torch.Tensor:
    """a / (s + eps): plain linear attention. a [..., Nq, Dv], s [..., Nq, 1], v_bar [..., 1, Dv] (unused)."""
    return a / (s + eps)


def inline(a: torch.Tensor, s: torch.Tensor, v_bar: torch.Tensor, eps: float) -> torch.Tensor:
    """InLine's injective normaliser: v_bar + a - s v_bar (eps unused: nothing is divided). Shapes as ``divide``."""
    return v_bar + (a - s * v_bar)


def mala(a: torch.Tensor, s: torch.Tensor, v_bar: torch.Tensor, eps: float) -> torch.Tensor:
    """MALA's magnitude-aware normaliser: a / (s + eps) + a - s v_bar. Shapes as ``divide``."""
    return a / (s + eps) + (a - s * v_bar)


@dataclass(frozen=True)
class NormalizerSpec:
    """What a normaliser declares once, in ``NORMALIZERS``.

    name: the value of the ``normalizer`` option (LinearAttention, the linvit models, ``attn_options``).
    combine: (a, s, v_bar, eps) -> the attention output, as the module docstring defines them.
    fast_paths: whether the registered op, its Triton kernels, the projection folds, the state form (bounded and
        context-parallel inference) and the rotary form compute it. Those keep only a and s (the state has no v_bar),
        so a normaliser without them takes the PyTorch path, and the state and rotary forms refuse it.
    """
    name: str
    combine: Combine
    fast_paths: bool = False


#: normaliser name -> NormalizerSpec, in registration order
NORMALIZERS: Registry[NormalizerSpec] = Registry('normalizer')
DEFAULT_NORMALIZER = 'divide'


def normalizer_spec(name: str) -> NormalizerSpec:
    """The spec of normaliser ``name``; ValueError naming the known ones for an unknown name."""
    return NORMALIZERS.get(name)


def list_normalizers() -> List[str]:
    """Every name the ``normalizer`` option accepts, the default first."""
    return NORMALIZERS.names()


def value_mean(v: torch.Tensor, key_weights: Optional[torch.Tensor], count: torch.Tensor) -> torch.Tensor:
    """v_bar: v [B, H, N, Dv] averaged over the kept keys -> [B, H, 1, Dv]. key_weights [B, H|1, N] (None: all
    keys, weight 1), count [B, H, 1, 1] their sum (clamped above 0). Masked keys count nothing, even non-finite."""
    if key_weights is None:
        return v.sum(dim=-2, keepdim=True) / count
    w = key_weights.unsqueeze(-1)
    return torch.where(w > 0, v * w, 0.0).sum(dim=-2, keepdim=True) / count


for _spec in (NormalizerSpec('divide', divide, fast_paths=True), NormalizerSpec('inline', inline),
              NormalizerSpec('mala', mala)):
    NORMALIZERS.register(_spec.name, _spec)
