"""Feature maps phi for linear attention: sim(q, k) = phi(q)^T phi(k).

Every map takes a tensor of shape [..., D] and returns a non-negative tensor of the same shape, so that
phi(q)^T phi(k) >= 0 and the normaliser phi(q)^T sum_k phi(k) is a sum of non-negative terms. Maps are plain
functions with the signature ``phi(x: Tensor) -> Tensor`` so that TorchScript can compile them when a layer holds
one as an attribute. They are called by the attention core on float32 (or float64) tensors.
"""
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

FeatureMap = Callable[[torch.Tensor], torch.Tensor]




def elu1(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 (Katharopoulos et al. 2020): positive everywhere, linear for x > 0.

    x: [..., D] -> [..., D], values in (0, inf).
    """
    # in place on elu's fresh output saves a pass; elu's backward reads its input, not its output
    return F.elu(x).add_(1.0)


def elu(x: torch.Tensor) -> torch.Tensor:
    """elu(x), the shape of ``elu1`` without its constant offset (see ``split_feature_map``).

    x: [..., D] -> [..., D], values in (-1, inf).
    """
    return F.elu(x)


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


def elu_inplace(x: torch.Tensor) -> torch.Tensor:
    """``elu`` written into x (which must be a fresh intermediate, e.g. a projection output); returns x."""
    return F.elu_(x)


def relu_inplace(x: torch.Tensor) -> torch.Tensor:
    """``relu`` written into x (which must be a fresh intermediate); returns x."""
    return F.relu_(x)


@dataclass(frozen=True)
class FeatureMapParts:
    """phi(x) = psi(x) + offset, with an in-place psi for inference.

    The attention core adds ``offset`` analytically (a rank-one correction on the small kv matrix), which saves a
    full pass over q and k; ``psi_inplace`` overwrites the projection output instead of allocating a new tensor.
    Both matter because at image-scale token counts the feature map is pure memory traffic: one pass over q|k at
    16k tokens costs as much as the feature-map arithmetic itself.
    """
    psi: FeatureMap
    psi_inplace: FeatureMap
    offset: float = 0.0


# maps without an entry are used whole: psi = psi_inplace = phi, offset 0
FEATURE_MAP_PARTS: Dict[str, FeatureMapParts] = {
    'elu1': FeatureMapParts(elu, elu_inplace, 1.0),
    'relu': FeatureMapParts(relu, relu_inplace, 0.0),
}


def list_feature_maps() -> List[str]:
    """Names accepted wherever a feature map is chosen by name."""
    return sorted(FEATURE_MAPS)


def get_feature_map(name: str) -> FeatureMap:
    """Resolve a feature map name from ``FEATURE_MAPS``; unknown names raise ValueError listing the known ones."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; known feature maps: {', '.join(list_feature_maps())}")
    return FEATURE_MAPS[name]


def split_feature_map(name: str) -> FeatureMapParts:
    """The parts of feature map ``name``: phi(x) = psi(x) + offset, and psi's in-place form."""
    phi = get_feature_map(name)
    return FEATURE_MAP_PARTS.get(name, FeatureMapParts(phi, phi, 0.0))


def register_feature_map(name: str, fn: FeatureMap) -> FeatureMap:
    """Add a feature map under ``name`` (it must map [..., D] to non-negative [..., D]); returns ``fn``."""
    if name in FEATURE_MAPS:
        raise ValueError(f"feature map {name!r} is already registered")
    FEATURE_MAPS[name] = fn
    return fn
