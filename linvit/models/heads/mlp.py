"""SegFormer's all-MLP decoder (Xie et al. 2021), the default head (``seg.head=mlp``)."""
from typing import List, Optional

import torch
import torch.nn as nn
from timm.layers import LayerNorm2d

from .common import LevelResize, whole_level_resize

__all__ = ['MLPHead']


class MLPHead(nn.Module):
    """Levels [B, in_dim, h_i, w_i] (finest first) -> logits [B, K, h_0, w_0]: per-level 1x1 projections, upsampled to
    the finest level, concatenated, fused and classified. Every layer is per pixel, so in the bounded forward a
    level needs only the rows its own resampling reads."""

    #: takes the simple feature pyramid's 4 levels (not the blocks' raw maps)
    pyramid = True
    #: bounded forward: patch rows of backbone map each level reads beyond a tile, and rows of the finest level
    #: beyond those the logits read (``linvit.models.bounded``). Stride p/4 and p/2 read one patch row beyond (the
    #: neck's 3x3 convolution loses a row at the crop's edges, resampling reads one more); stride p two; stride 2p (one
    #: row per two patch rows) loses its edge row and reads one more, four patch rows, and one more when the grid has
    #: an odd number of rows (max pooling drops the last one, which stretches the level upwards; a tile's first row
    #: there is rounded down to pair rows). Each is the smallest that is exact (tests/models/test_heads.py takes one
    #: row off each).
    halos = (1, 1, 2, 5)
    finest_halo = 0

    def __init__(self, in_dim: int, head_dim: int, num_classes: int, num_levels: int = 4,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.projections = nn.ModuleList(nn.Conv2d(in_dim, head_dim, 1) for _ in range(num_levels))
        self.fuse = nn.Sequential(nn.Conv2d(num_levels * head_dim, head_dim, 1, bias=False), LayerNorm2d(head_dim),
                                  nn.GELU())
        self.dropout = nn.Dropout2d(dropout)
        self.classifier = nn.Conv2d(head_dim, num_classes, 1)

    def forward(self, levels: List[torch.Tensor], resize: Optional[LevelResize] = None) -> torch.Tensor:
        resize = resize or whole_level_resize(levels)
        projected = [project(x) for x, project in zip(levels, self.projections)]
        projected = [projected[0]] + [resize(x, level, 0) for level, x in enumerate(projected[1:], start=1)]
        return self.classifier(self.dropout(self.fuse(torch.cat(projected, dim=1))))
