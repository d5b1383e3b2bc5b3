"""The ``performer`` family: Performer FAVOR+ (Choromanski et al. 2021), softmax attention approximated by positive
orthogonal random features; O(N m d) per block. Own tensor: the buffer ``projection`` [m, d]."""
from typing import List, Optional

import torch
import torch.nn as nn

from ...ops.families import gaussian_projection, performer_attention
from ..family import FamilySpec, register_family
from ..linear_attention import LinearAttention
from .common import split_heads, tokens_last

__all__ = ['PerformerAttention', 'redraw_random_features']

# a leaf for torch.fx: the op branches on shapes and masks (it also compiles with TorchScript, which timm's model
# tests run on the traced graph)
torch.fx.wrap('performer_attention')


@register_family
class PerformerAttention(LinearAttention):
    """Performer FAVOR+: softmax attention approximated by positive orthogonal random features. ``projection``
    [num_features, head_dim] is a buffer (saved in the state_dict, shared by the heads), drawn at construction from
    torch's RNG and redrawn only by ``redraw`` / ``linvit.redraw_random_features``, never in forward (so compile,
    export and resumed runs see the same features).

    num_features: m, random features per head (default: head_dim). orthogonal: orthogonal blocks (else i.i.d.).
    """

    family = FamilySpec('performer', options={'num_features': None, 'orthogonal': True}, tensors=('projection',))

    def __init__(self, dim: int, num_features: Optional[int] = None, orthogonal: bool = True, **kwargs) -> None:
        super().__init__(dim, **kwargs)
        self.num_features = num_features or self.head_dim
        self.orthogonal = orthogonal
        device = self.qkv.weight.device
        self.register_buffer('projection', gaussian_projection(self.num_features, self.head_dim, orthogonal,
                                                               device=device))

    @torch.no_grad()
    def redraw(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw a new projection (on the buffer's device), from ``generator`` or torch's default CPU RNG."""
        fresh = gaussian_projection(self.num_features, self.head_dim, self.orthogonal, generator=generator)
        if self.projection.device.type == 'meta':
            self.projection = fresh
        else:
            self.projection.copy_(fresh)

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        q, k, v = split_heads(qkv)
        return tokens_last(performer_attention(self.q_norm(q), self.k_norm(k), v, self.projection, self.eps,
                                               key_mask))


def redraw_random_features(model: nn.Module, generator: Optional[torch.Generator] = None) -> int:
    """Draw new random features in every Performer layer of ``model`` (call it between steps, e.g. every K
    steps; forward never does). Returns how many layers were redrawn."""
    layers = [m for m in model.modules() if isinstance(m, PerformerAttention)]
    for layer in layers:
        layer.redraw(generator)
    return len(layers)
