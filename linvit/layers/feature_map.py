"""Learnable feature maps: the modules that hold a map's parameters, one per attention layer.

A learnable map is chosen by name like the fixed ones (``feature_map='hedgehog'`` in ``LinearAttention``, the
``linvit_*`` models, ``convert_to_linear`` and configs) and registered in ``linvit.ops.FEATURE_MAPS`` as
``FeatureMapSpec(name, module=cls)``.
The layer builds it as ``cls(num_heads, head_dim, device=, dtype=)`` under the attribute ``feature_map``, so its
tensors are ``<layer>.feature_map.*`` in the state dict; a softmax checkpoint lacks them (they are declared as
``linear_only_tensors`` and keep their initial values when one is loaded).

The map runs in float32 (float64 for float64 inputs) with autocast off, as the attention core does.
"""
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import FeatureMapSpec, autocast_off, hedgehog, norm_direction, register_feature_map

__all__ = ['LearnableFeatureMap', 'HedgehogFeatureMap', 'NormDirectionFeatureMap']


class LearnableFeatureMap(nn.Module):
    """Base of the learnable maps: forward(x [B, H, N, D]) -> non-negative [B, H, N, F] in x's dtype (the compute
    dtype). ``linear_only_tensors`` names the state-dict entries a softmax checkpoint cannot provide."""
    linear_only_tensors: Tuple[str, ...] = ()
    num_features: int  # F, the width of the map's output


class HedgehogFeatureMap(LearnableFeatureMap):
    """Hedgehog's map (``linvit.ops.hedgehog``): per head h, phi(x) = [softmax(x W_h + b_h), softmax(-(x W_h + b_h))].

    W_h [D, D] starts at the identity and b_h at 0, so an untrained map is softmax over the features of [x, -x].
    Trained to imitate softmax attention (``task: linearize``), it learns the spiky weights fixed maps miss.
    Output width F = 2 D.
    """
    linear_only_tensors = ('weight', 'bias')

    def __init__(self, num_heads: int, head_dim: int, device=None, dtype=None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_features = 2 * head_dim
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, head_dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_heads, head_dim, device=device, dtype=dtype))
        if self.weight.device.type != 'meta':
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Identity projection, zero bias (timm's ``init_weights`` calls this for modules that define it)."""
        self.weight.copy_(torch.eye(self.head_dim, dtype=self.weight.dtype).expand_as(self.weight))
        self.bias.zero_()

    def reset_parameters(self) -> None:
        self.init_weights()

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, num_features={self.num_features}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H, N, D] -> [..., H, N, 2 D] in x's dtype."""
        if torch.jit.is_scripting():
            return hedgehog(x, self.weight.to(x.dtype), self.bias.to(x.dtype))
        if torch.fx._symbolic_trace.is_fx_symbolic_tracing():
            # fx records the ops themselves (TorchScript then compiles the traced graph); a graph run under AMP
            # computes the map at autocast's precision
            return hedgehog(x, self.weight.to(x.dtype), self.bias.to(x.dtype))
        return self._map_without_autocast(x)

    @torch.jit.unused
    def _map_without_autocast(self, x: torch.Tensor) -> torch.Tensor:
        # the map is part of the float32 core: under AMP its matmul must not run in bfloat16
        with autocast_off(x.device.type):
            return hedgehog(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class NormDirectionFeatureMap(LearnableFeatureMap):
    """The norm-times-direction map after NaLaFormer (``linvit.ops.norm_direction``): phi(x) = ||x|| times cosine
    direction features raised to 1 + a_h ||x|| / sqrt(D), with one learnable sharpness a_h = softplus(w_h) >= 0 per
    head (w_h starts at 0: a_h = log 2). Output width F = 2 D.
    """
    linear_only_tensors = ('sharpness',)

    def __init__(self, num_heads: int, head_dim: int, device=None, dtype=None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_features = 2 * head_dim
        self.sharpness = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))

    @torch.no_grad()
    def init_weights(self) -> None:
        """w_h = 0 (timm's ``init_weights`` calls this for modules that define it)."""
        self.sharpness.zero_()

    def reset_parameters(self) -> None:
        self.init_weights()

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, num_features={self.num_features}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H, N, D] -> [..., H, N, 2 D] in x's dtype."""
        if torch.jit.is_scripting():  # alone in its condition: TorchScript drops the branches below only then
            return norm_direction(x, F.softplus(self.sharpness.to(x.dtype)))
        if torch.fx._symbolic_trace.is_fx_symbolic_tracing():
            return norm_direction(x, F.softplus(self.sharpness.to(x.dtype)))
        return self._map_without_autocast(x)

    @torch.jit.unused
    def _map_without_autocast(self, x: torch.Tensor) -> torch.Tensor:
        with autocast_off(x.device.type):  # part of the float32 core, as the hedgehog map
            return norm_direction(x, F.softplus(self.sharpness.to(x.dtype)))


register_feature_map(FeatureMapSpec('hedgehog', module=HedgehogFeatureMap))
register_feature_map(FeatureMapSpec('nala', module=NormDirectionFeatureMap))
