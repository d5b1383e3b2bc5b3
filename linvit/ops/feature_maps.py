"""Feature maps phi for linear attention: sim(q, k) = phi(q)^T phi(k).

Every map takes a tensor of shape [..., D] and returns a non-negative tensor of the same shape, so that
phi(q)^T phi(k) >= 0 and the normaliser phi(q)^T sum_k phi(k) is a sum of non-negative terms. Maps are plain
functions with the signature ``phi(x: Tensor) -> Tensor`` so that TorchScript can compile them when a layer holds
one as an attribute. They are called by the attention core on float32 (or float64) tensors.

The fused attention Function (``linvit.ops.fused``) applies a map's derivative itself in backward: each map has a
``with_vjp(x) -> (phi(x), vjp)`` in ``FEATURE_MAP_VJPS``, where ``vjp(grad)`` is the gradient of x.
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

FeatureMap = Callable[[torch.Tensor], torch.Tensor]
FeatureMapVJP = Callable[[torch.Tensor], torch.Tensor]
FeatureMapWithVJP = Callable[[torch.Tensor], Tuple[torch.Tensor, FeatureMapVJP]]


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


def elu1_with_vjp(x: torch.Tensor) -> Tuple[torch.Tensor, FeatureMapVJP]:
    """(elu1(x), vjp) with vjp(grad) = grad * exp(min(x, 0)): elu1's derivative (1 for x >= 0, as its autograd).

    x is copied once into a fresh contiguous tensor and mapped in place there: q and k arrive as strided views of
    the qkv projection, on which elementwise ops ran 3-6x slower (and matmuls 2x slower) at 16k tokens. The
    derivative exp(min(x, 0)) is the term the map adds, so it costs nothing more. x: [..., D] -> [..., D]; vjp
    writes into its argument.
    """
    phi = x.clone(memory_format=torch.contiguous_format)
    derivative = phi.clamp(max=0.0).exp_()
    return F.relu_(phi).add_(derivative), lambda grad: grad.mul_(derivative)


def relu_with_vjp(x: torch.Tensor) -> Tuple[torch.Tensor, FeatureMapVJP]:
    """(relu(x), vjp) with vjp(grad) = grad where x > 0, else 0 (relu's derivative is 0 at 0, as autograd's).

    x: [..., D] -> [..., D]; vjp writes into its argument.
    """
    phi = F.relu_(x.clone(memory_format=torch.contiguous_format))  # contiguous: see elu1_with_vjp
    return phi, lambda grad: grad.masked_fill_(phi <= 0, 0.0)


def focused_vjp(x: torch.Tensor, grad: torch.Tensor, power: float = 3.0) -> torch.Tensor:
    """The gradient of x for ``focused``: with r = relu(x), u = (r / max r)^p, f = ||r|| u / ||u||,

        grad_r = (g . u^) r / ||r|| + (||r|| / ||u||) p (r / max r)^(p - 1) / max r (g - (g . u^) u^)

    (u^ = u / ||u||; f does not depend on max r, which only keeps the power in range, so its path adds nothing),
    and grad_x = grad_r where x > 0, else 0. Rows with no positive entry get zeros, as from ``focused``'s autograd.

    x, grad: [..., D] -> [..., D].
    """
    r = F.relu(x)
    r_max = r.amax(dim=-1, keepdim=True).clamp_min(1e-30)
    scaled = r / r_max
    u = scaled ** power
    u_norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp_min(1e-30)
    r_norm = torch.linalg.vector_norm(r, dim=-1, keepdim=True).clamp_min(1e-30)
    u_hat = u / u_norm
    g_dot_u_hat = (grad * u_hat).sum(dim=-1, keepdim=True)
    du_dr = power * scaled ** (power - 1) / r_max
    grad_r = g_dot_u_hat * r / r_norm + (r_norm / u_norm) * du_dr * (grad - g_dot_u_hat * u_hat)
    return torch.where(x > 0, grad_r, 0.0)


def focused_with_vjp(x: torch.Tensor) -> Tuple[torch.Tensor, FeatureMapVJP]:
    """(focused(x), vjp) with vjp(grad) = ``focused_vjp(x, grad)`` (its Jacobian is not diagonal: the row norms
    couple the entries). x: [..., D] -> [..., D]."""
    return focused(x), lambda grad: focused_vjp(x, grad)


FEATURE_MAPS: Dict[str, FeatureMap] = {
    'elu1': elu1,
    'relu': relu,
    'focused': focused,
}


# each map with its derivative, for the fused attention Function (linvit.ops.fused): with_vjp(x) returns phi(x)
# and a function vjp(grad) -> the gradient of x (grad and the result [..., D]; vjp may overwrite grad, which the
# Function owns). A map without an entry trains through plain autograd.
FEATURE_MAP_VJPS: Dict[str, FeatureMapWithVJP] = {
    'elu1': elu1_with_vjp,
    'relu': relu_with_vjp,
    'focused': focused_with_vjp,
}


def elu1_derivative_from_output(phi: torch.Tensor) -> torch.Tensor:
    """elu1'(x) from phi = elu1(x): min(phi, 1) (phi = exp(x) <= 1 for x <= 0, where the derivative is exp(x);
    phi > 1 for x > 0, where it is 1). phi: [..., D] -> [..., D]."""
    return phi.clamp(max=1.0)


def relu_derivative_from_output(phi: torch.Tensor) -> torch.Tensor:
    """relu'(x) from phi = relu(x): 1 where phi > 0, else 0 (as autograd's at 0). phi: [..., D] -> bool [..., D]."""
    return phi > 0


# maps whose derivative is a function of their output: the fused Function keeps phi(q) and phi(k) for backward (as
# many bytes as q and k) instead of recomputing them there; others (focused: row norms) recompute from q and k
FEATURE_MAP_OUTPUT_DERIVATIVES: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    'elu1': elu1_derivative_from_output,
    'relu': relu_derivative_from_output,
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


def hedgehog(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The learnable map of Hedgehog (Zhang et al. 2024): phi(x) = [softmax(z), softmax(-z)], z = x W_h + b_h.

    A per-head linear projection of the feature, then softmax over the features of z and of -z: positive, each half
    sums to 1, and the two signs let phi(q)^T phi(k) grow both with aligned and with opposed large entries, which is
    how it learns the spiky, monotone weights of softmax attention. softmax subtracts the row maximum, so it cannot
    overflow. Its derivative is softmax's (autograd's); the attention core then takes phi as features.

    x: [..., H, N, D], weight: [H, D, F], bias: [H, F] -> [..., H, N, 2F], values in (0, 1).
    """
    z = torch.matmul(x, weight) + bias.unsqueeze(-2)
    return torch.cat([z.softmax(dim=-1), (-z).softmax(dim=-1)], dim=-1)


# learnable maps: name -> the nn.Module class that holds a map's parameters (registered by linvit.layers, which owns
# parameters; ops stays pure). Built per layer as cls(num_heads, head_dim, device=, dtype=); called on
# [B, H, N, D] in the compute dtype, it returns non-negative [B, H, N, F] (F may differ from D).
LEARNABLE_FEATURE_MAPS: Dict[str, Any] = {}


def list_feature_maps() -> List[str]:
    """Names accepted wherever a feature map is chosen by name: the fixed maps and the learnable ones."""
    return sorted(set(FEATURE_MAPS) | set(LEARNABLE_FEATURE_MAPS))


def is_learnable_feature_map(name: str) -> bool:
    """Whether ``name`` is a learnable map (``LEARNABLE_FEATURE_MAPS``: it has parameters, layers build it)."""
    return name in LEARNABLE_FEATURE_MAPS


def check_feature_map(name: str) -> str:
    """``name`` if it names a fixed or a learnable map; else ValueError listing the known ones."""
    if name not in FEATURE_MAPS and name not in LEARNABLE_FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; known feature maps: {', '.join(list_feature_maps())}")
    return name


def get_feature_map(name: str) -> FeatureMap:
    """Resolve a fixed feature map name from ``FEATURE_MAPS``; unknown names raise ValueError listing the known ones,
    learnable ones (which have parameters) a ValueError saying where they are used."""
    check_feature_map(name)
    if name in LEARNABLE_FEATURE_MAPS:
        raise ValueError(f"feature map {name!r} is learnable: it has parameters, which a layer holds "
                         f"(LinearAttention(feature_map={name!r}), a linvit model or convert_to_linear); the ops take "
                         f"its output as features (linvit.ops.linear_attention_from_features)")
    return FEATURE_MAPS[name]


def register_learnable_feature_map(name: str, cls: Any = None) -> Any:
    """Add a learnable map under ``name``: ``cls(num_heads, head_dim, device=None, dtype=None)`` is an nn.Module
    mapping [B, H, N, head_dim] to non-negative [B, H, N, F]; returns ``cls``. Without ``cls``, a class decorator:
    ``@register_learnable_feature_map('name')``."""
    if name in FEATURE_MAPS or name in LEARNABLE_FEATURE_MAPS:
        raise ValueError(f"feature map {name!r} is already registered")
    if cls is None:
        return lambda decorated: register_learnable_feature_map(name, decorated)
    LEARNABLE_FEATURE_MAPS[name] = cls
    return cls


def get_inplace_feature_map(name: str) -> Optional[FeatureMap]:
    """The in-place form of feature map ``name`` (see ``INPLACE_FEATURE_MAPS``), or None if it has none."""
    check_feature_map(name)
    return INPLACE_FEATURE_MAPS.get(name)


def get_feature_map_vjp(name: str) -> Optional[FeatureMapWithVJP]:
    """Feature map ``name`` with its vector-Jacobian product (see ``FEATURE_MAP_VJPS``), or None if it has none
    (learnable maps have none: their parameters train through autograd, the core through the fused Function on
    their features, ``linvit.ops.fused_linear_attention_from_features``)."""
    check_feature_map(name)
    return FEATURE_MAP_VJPS.get(name)


def register_feature_map(name: str, fn: FeatureMap, with_vjp: Optional[FeatureMapWithVJP] = None) -> FeatureMap:
    """Add a feature map under ``name`` (it must map [..., D] to non-negative [..., D]); returns ``fn``.

    with_vjp: optional ``with_vjp(x) -> (fn(x), vjp)`` with ``vjp(grad)`` the gradient of x for an upstream
    ``grad`` (x, grad [..., D]; vjp may overwrite grad); with it, layers train through the fused attention Function
    (``linvit.ops.fused``), without it through plain autograd of ``fn``.
    """
    if name in FEATURE_MAPS or name in LEARNABLE_FEATURE_MAPS:
        raise ValueError(f"feature map {name!r} is already registered")
    FEATURE_MAPS[name] = fn
    if with_vjp is not None:
        FEATURE_MAP_VJPS[name] = with_vjp
    return fn
