"""DPT's decoder (Ranftl et al. 2021; the head of MiDaS and Depth Anything) on the simple feature pyramid
(``seg.head=dpt``).

DPT reassembles the tokens of 4 blocks into maps at 4 scales (a 1x1 projection, then transposed convolutions up and a
strided convolution down); the simple feature pyramid (``ViTPyramid``, fed from 4 blocks by default) does exactly that
job, with ViTDet's resampling, so this head starts where DPT's reassembled maps do: a 3x3 convolution per level to
the head's width, then fusion blocks from the coarsest level to the finest, each two residual convolution units
around the sum with the coarser path, a 1x1 output convolution, and bilinear upsampling to the next level
(align_corners=False, where DPT uses True: the bounded forward samples rows at their place in the whole map with one
convention). The output is a 3x3 convolution and the 1x1 classifier at the finest level (one channel for depth).
"""
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import LayerNorm2d

from .common import LevelResize, whole_level_resize

__all__ = ['DPTHead', 'ResidualConvUnit', 'FusionBlock']


class ResidualConvUnit(nn.Module):
    """x + conv(relu(conv(relu(x)))), two 3x3 convolutions with bias (DPT's unit without BatchNorm)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, 3, padding=1)
        self.conv2 = nn.Conv2d(dim, dim, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.relu(self.conv1(F.relu(x))))


class FusionBlock(nn.Module):
    """DPT's feature fusion: lateral [B, C, h, w] and the coarser path resized to it (or None at the coarsest
    level) -> [B, C, h, w]: path + unit(lateral), a second unit, a 1x1 output convolution."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lateral_unit = ResidualConvUnit(dim)
        self.unit = ResidualConvUnit(dim)
        self.out_conv = nn.Conv2d(dim, dim, 1)

    def forward(self, lateral: torch.Tensor, path: Optional[torch.Tensor] = None) -> torch.Tensor:
        fused = lateral if path is None else path + self.lateral_unit(lateral)
        return self.out_conv(self.unit(fused))


class DPTHead(nn.Module):
    """Levels [B, in_dim, h_i, w_i] (finest first) -> logits [B, K, h_0, w_0]."""

    pyramid = True
    #: bounded forward (``linvit.models.bounded``): patch rows each level reads beyond a tile, and rows of the finest
    #: level beyond those the logits read (the last fusion block's four 3x3 convolutions on the lateral and two on
    #: the sum, and the output convolution). A coarser level's halo covers its own projection and fusion block, and
    #: the finer levels' blocks that its path feeds, at their strides. Each is the smallest that is exact
    #: (tests/models/test_heads.py).
    halos = (2, 5, 9, 15)
    finest_halo = 6

    def __init__(self, in_dim: int, head_dim: int, num_classes: int, num_levels: int = 4,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.projections = nn.ModuleList(nn.Conv2d(in_dim, head_dim, 3, padding=1, bias=False)
                                         for _ in range(num_levels))
        self.fusions = nn.ModuleList(FusionBlock(head_dim) for _ in range(num_levels))
        self.output = nn.Sequential(nn.Conv2d(head_dim, head_dim, 3, padding=1, bias=False), LayerNorm2d(head_dim),
                                    nn.ReLU(inplace=True))
        self.dropout = nn.Dropout2d(dropout)
        self.classifier = nn.Conv2d(head_dim, num_classes, 1)

    def forward(self, levels: List[torch.Tensor], resize: Optional[LevelResize] = None) -> torch.Tensor:
        resize = resize or whole_level_resize(levels)
        laterals = [project(x) for x, project in zip(levels, self.projections)]
        path = self.fusions[-1](laterals[-1])
        for level in range(len(laterals) - 2, -1, -1):
            path = self.fusions[level](laterals[level], resize(path, level + 1, level))
        return self.classifier(self.dropout(self.output(path)))
