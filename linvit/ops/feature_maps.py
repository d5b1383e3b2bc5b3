"""Feature maps phi for linear attention: sim(q, k) = phi(q)^T phi(k).

Every map takes a tensor of shape [..., D] and returns a non-negative tensor of the same shape, so that
phi(q)^T phi(k) >= 0 and the normaliser phi(q)^T sum_k phi(k) is a sum of non-negative terms. Maps are plain
functions with the signature ``phi(x: Tensor) -> Tensor`` so that TorchScript can compile them when a layer holds
one as an attribute. They are called by the attention core on float32 (or float64) tensors.
"""
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

FeatureMap = Callable[[torch.Tensor], torch.Tensor]


def elu1(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 (Katharopoulos et al. 2020): positive everywhere, linear for x > 0.

    Computed as exp(x - r) + r with r = relu(x) (x - r = min(x, 0) exactly), the same function: ATen's CPU elu
    (and inductor's lowering of it) evaluate expm1, which measured ~8x slower than exp on AVX-512, and the "+ 1"
    would be one more pass. Writing min(x, 0) as x - relu(x) keeps the derivative at x = 0 equal to 1, as elu's
    (clamp's and relu's gradients are both 0 there).

    x: [..., D] -> [..., D], values in (0, inf).
    """
    r = F.relu(x)
    return torch.exp(x - r) + r


def relu(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0): sparse and scale-equivariant. A row whose entries are all <= 0 maps to zeros, so its
    similarity to every key is 0; the attention core's ``eps`` keeps that 0 / 0 finite (the output row is 0).

    x: [..., D] -> [..., D], values in [0, inf).
    """
    return F.relu(x)


def focused(x: torch.Tensor, power: float = 3.0) -> torch.Tensor:
    """Focused map of FLatten Transformer (Han et al. 2023): relu(x) ** p rescaled to keep the norm of relu(x).

    f(x) = ||r|| * r^p / ||r^p|| with r = relu(x). Raising to p > 1 sharpens the direction of r towards its
    largest entries, which makes the attention distribution more peaked, as softmax is. r is divided by its
    row maximum before the power so that r^p cannot overflow; the ratio is unchanged by that scaling.

    x: [..., D] -> [..., D], values in [0, inf); rows with no positive entry map to zeros.
    """
    r = F.relu(x)
    r_max = r.amax(dim=-1, keepdim=True)
    u = (r / r_max.clamp_min(1e-30)) ** power
    u_norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp_min(1e-30)
    return u * (torch.linalg.vector_norm(r, dim=-1, keepdim=True) / u_norm)


FEATURE_MAPS: Dict[str, FeatureMap] = {
    'elu1': elu1,
    'relu': relu,
    'focused': focused,
}


def elu1_inplace(x: torch.Tensor) -> torch.Tensor:
    """``elu1`` written into x (which must be a fresh intermediate, e.g. a projection output); returns x."""
    e = x.clamp(max=0.0).exp_()
    return F.relu_(x).add_(e)


def relu_inplace(x: torch.Tensor) -> torch.Tensor:
    """``relu`` written into x (which must be a fresh intermediate); returns x."""
    return F.relu_(x)


# in-place forms for inference: writing phi into the projection output saves a large allocation (fresh pages are
# faulted in on every call) and a pass of memory traffic; maps without one are applied out of place
INPLACE_FEATURE_MAPS: Dict[str, FeatureMap] = {
    'elu1': elu1_inplace,
    'relu': relu_inplace,
}


def list_feature_maps() -> List[str]:
    """Names accepted wherever a feature map is chosen by name."""
    return sorted(FEATURE_MAPS)


def get_feature_map(name: str) -> FeatureMap:
    """Resolve a feature map name from ``FEATURE_MAPS``; unknown names raise ValueError listing the known ones."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; known feature maps: {', '.join(list_feature_maps())}")
    return FEATURE_MAPS[name]


def get_inplace_feature_map(name: str) -> Optional[FeatureMap]:
    """The in-place form of feature map ``name`` (see ``INPLACE_FEATURE_MAPS``), or None if it has none."""
    get_feature_map(name)
    return INPLACE_FEATURE_MAPS.get(name)


def register_feature_map(name: str, fn: FeatureMap) -> FeatureMap:
    """Add a feature map under ``name`` (it must map [..., D] to non-negative [..., D]); returns ``fn``."""
    if name in FEATURE_MAPS:
        raise ValueError(f"feature map {name!r} is already registered")
    FEATURE_MAPS[name] = fn
    return fn
