"""Feature maps phi for linear attention: sim(q, k) = phi(q)^T phi(k).

Every map takes a tensor of shape [..., D] and returns a non-negative tensor, so that phi(q)^T phi(k) >= 0 and the
normaliser phi(q)^T sum_k phi(k) is a sum of non-negative terms. A map declares itself once, as a
``FeatureMapSpec`` in the registry ``FEATURE_MAPS``: its function, and the optional forms the fast paths use (its
vector-Jacobian product for the fused training Function, an in-place form for inference, its derivative read off
its output, the id under which the Triton kernels compute it) or, for a learnable map, the nn.Module class that
holds its parameters. Every consumer reads the spec; a map without a form simply takes the general path.

Fixed maps are plain functions ``phi(x: Tensor) -> Tensor`` so that TorchScript can compile them when a layer holds
one as an attribute. They are called by the attention core on float32 (or float64) tensors.
"""
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..registry import Registry

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


def elu1_derivative_from_output(phi: torch.Tensor) -> torch.Tensor:
    """elu1'(x) from phi = elu1(x): min(phi, 1) (phi = exp(x) <= 1 for x <= 0, where the derivative is exp(x);
    phi > 1 for x > 0, where it is 1). phi: [..., D] -> [..., D]."""
    return phi.clamp(max=1.0)


def relu_derivative_from_output(phi: torch.Tensor) -> torch.Tensor:
    """relu'(x) from phi = relu(x): 1 where phi > 0, else 0 (as autograd's at 0). phi: [..., D] -> bool [..., D]."""
    return phi > 0


def elu1_inplace(x: torch.Tensor) -> torch.Tensor:
    """``elu1`` written into x (which must be a fresh intermediate, e.g. a projection output); returns x."""
    e = x.clamp(max=0.0).exp_()
    return F.relu_(x).add_(e)


def relu_inplace(x: torch.Tensor) -> torch.Tensor:
    """``relu`` written into x (which must be a fresh intermediate); returns x."""
    return F.relu_(x)


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


def norm_direction(x: torch.Tensor, sharpness: torch.Tensor) -> torch.Tensor:
    """The norm-times-direction map after NaLaFormer (Meng et al. 2025, "Norm-Aware Linear Attention"):

        phi(x) = ||x|| * psi(x / ||x||) ** (1 + sharpness_h * ||x|| / sqrt(D)),
        psi(u) = [cos(pi / 4 (1 + u)), sin(pi / 4 (1 + u))]   (entries of u in [-1, 1], so angles in [0, pi / 2])

    psi is non-negative by construction and psi(u)^T psi(w) = sum_i cos(pi / 4 (u_i - w_i)): each direction entry
    adds most when the two agree and nothing when they are opposite, so negative q.k interactions are kept as low
    similarity instead of being clipped. The power grows with the norm: a longer vector gets sharper direction
    features, which restores the link between a query's magnitude and the spikiness of its weights that dividing by
    the normaliser removes (its factor ||q|| cancels). Entries of psi lie in [0, 1], so the power cannot overflow.

    x: [..., H, N, D], sharpness: [H] (>= 0) -> [..., H, N, 2 D], values in [0, ||x||]; a zero row maps to zeros.
    """
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    angle = (math.pi / 4) * (1.0 + x / norm.clamp_min(1e-30))
    # cos(pi / 2) rounds to a tiny negative number: clamped, so that the power of a non-integer exponent stays real
    psi = torch.cat([torch.cos(angle), torch.sin(angle)], dim=-1).clamp_min(0.0)
    exponent = 1.0 + sharpness[:, None, None] * norm / math.sqrt(x.shape[-1])
    return norm * psi ** exponent


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, relu(x) ** 2 (So et al. 2021, "Primer"; used as a linear-attention map by Hua et al. 2022,
    "Transformer Quality in Linear Time"): sparse like relu, and the square makes large entries dominate the
    similarity, a step towards softmax's peaked weights. x: [..., D] -> [..., D], values in [0, inf)."""
    return F.relu(x).square()


def relu2_with_vjp(x: torch.Tensor) -> Tuple[torch.Tensor, FeatureMapVJP]:
    """(relu2(x), vjp) with vjp(grad) = grad * 2 relu(x). x: [..., D] -> [..., D]; vjp writes into its argument."""
    r = F.relu_(x.clone(memory_format=torch.contiguous_format))  # contiguous: see elu1_with_vjp
    return r.square(), lambda grad: grad.mul_(r).mul_(2.0)


def relu2_derivative_from_output(phi: torch.Tensor) -> torch.Tensor:
    """relu2'(x) from phi = relu(x) ** 2: 2 sqrt(phi). phi: [..., D] -> [..., D]."""
    return phi.sqrt().mul_(2.0)


def relu2_inplace(x: torch.Tensor) -> torch.Tensor:
    """``relu2`` written into x (which must be a fresh intermediate); returns x."""
    return F.relu_(x).square_()


@dataclass(frozen=True)
class FeatureMapSpec:
    """What a feature map declares once, in ``FEATURE_MAPS`` (``register_feature_map``).

    name: its name (the value of ``feature_map`` in layers, models, ``convert_to_linear`` and configs).
    fn: a fixed map, [..., D] -> non-negative [..., D]. Exactly one of ``fn`` and ``module``.
    with_vjp: ``with_vjp(x) -> (fn(x), vjp)``, ``vjp(grad)`` the gradient of x for an upstream ``grad`` (x, grad
        [..., D]; vjp may overwrite grad). With it, layers train through the fused attention Function
        (``linvit.ops.linear_attn.function``); without, through plain autograd of ``fn``.
    inplace: ``fn`` written into its argument (a fresh intermediate), returning it: inference then maps the qkv
        projection output in place instead of allocating phi.
    derivative_from_output: fn'(x) computed from phi = fn(x) (an elementwise map only): the fused Function then
        keeps phi(q), phi(k) for backward instead of recomputing them from q, k.
    kernel_id: the name of the map's branch in the Triton kernels (a key of
        ``linvit.ops.linear_attn.backend.KERNEL_FEATURE_MAPS``) if they compute it; a name they have no branch for
        is a ValueError when a call would use it. None: calls with this map take the PyTorch path
        (``kernel_unsupported_reason`` says so).
    module: a learnable map: an nn.Module class built per layer as ``module(num_heads, head_dim, device=,
        dtype=)``, mapping [B, H, N, head_dim] to non-negative [B, H, N, F] (F may differ from D); its parameters
        train through autograd, the attention core through the fused Function on its features. Layers own it
        (``linvit.layers.feature_map``), since ops hold no parameters.
    """
    name: str
    fn: Optional[FeatureMap] = None
    with_vjp: Optional[FeatureMapWithVJP] = None
    inplace: Optional[FeatureMap] = None
    derivative_from_output: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    kernel_id: Optional[str] = None
    module: Optional[Any] = None

    def __post_init__(self) -> None:
        if (self.fn is None) == (self.module is None):
            raise ValueError(f"feature map {self.name!r} declares fn (a fixed map) or module (a learnable one): "
                             f"exactly one of them")
        forms = [form for form in ('with_vjp', 'inplace', 'derivative_from_output', 'kernel_id')
                 if getattr(self, form) is not None]
        if self.module is not None and forms:
            raise ValueError(f"learnable feature map {self.name!r} cannot declare {forms}: those are forms of a fixed "
                             f"map")
        if self.derivative_from_output is not None and self.with_vjp is None:
            raise ValueError(f"feature map {self.name!r} declares derivative_from_output, which the fused Function "
                             f"uses only with with_vjp")

    @property
    def learnable(self) -> bool:
        """Whether the map has parameters (``module``), which a layer builds and holds."""
        return self.module is not None


#: feature map name -> its FeatureMapSpec, in registration order
FEATURE_MAPS: Registry[FeatureMapSpec] = Registry('feature_map')


def register_feature_map(spec: FeatureMapSpec) -> FeatureMapSpec:
    """Add ``spec`` to ``FEATURE_MAPS`` under ``spec.name``; returns it. ValueError if another map has that name."""
    if not isinstance(spec, FeatureMapSpec):
        raise TypeError(f"register_feature_map takes a FeatureMapSpec, got {type(spec).__name__}")
    return FEATURE_MAPS.register(spec.name, spec)


def unregister_feature_map(name: str) -> FeatureMapSpec:
    """Remove map ``name`` (e.g. one a test registered) and return its spec; ValueError if unknown."""
    return FEATURE_MAPS.unregister(name)


def list_feature_maps(learnable: Optional[bool] = None) -> List[str]:
    """Names accepted wherever a feature map is chosen by name, in registration order: all of them, or only the
    learnable (``learnable=True``) or only the fixed ones (``learnable=False``)."""
    return [name for name, spec in FEATURE_MAPS.items() if learnable is None or spec.learnable == learnable]


def feature_map_spec(name: str) -> FeatureMapSpec:
    """The spec of map ``name``; ValueError naming the closest and all known maps for an unknown name."""
    return FEATURE_MAPS.get(name)


def get_feature_map(name: str) -> FeatureMap:
    """The function of fixed map ``name``; a learnable one (which has parameters) is a ValueError saying where it is
    used, an unknown one a ValueError listing the known maps."""
    spec = feature_map_spec(name)
    if spec.learnable:
        raise ValueError(f"feature map {name!r} is learnable: it has parameters, which a layer holds "
                         f"(LinearAttention(feature_map={name!r}), a linvit model or convert_to_linear); the ops take "
                         f"its output as features (linvit.ops.linear_attention_from_features)")
    return spec.fn


for _spec in (
    FeatureMapSpec('elu1', elu1, with_vjp=elu1_with_vjp, inplace=elu1_inplace,
                   derivative_from_output=elu1_derivative_from_output, kernel_id='elu1'),
    FeatureMapSpec('relu', relu, with_vjp=relu_with_vjp, inplace=relu_inplace,
                   derivative_from_output=relu_derivative_from_output, kernel_id='relu'),
    FeatureMapSpec('focused', focused, with_vjp=focused_with_vjp),
    FeatureMapSpec('relu2', relu2, with_vjp=relu2_with_vjp, inplace=relu2_inplace,
                   derivative_from_output=relu2_derivative_from_output),
):
    register_feature_map(_spec)
