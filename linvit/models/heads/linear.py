"""The linear probe of DINOv2 / DINOv3 (``seg.head=linear``): BatchNorm and a 1x1 convolution on the patch tokens of
the last block, or of several blocks concatenated (``seg.feature_blocks=[-4,-3,-2,-1]``), upsampled to the image by
the model. It reads the blocks' raw maps at stride p, not the feature pyramid; with ``model.freeze_backbone=true``
only this head trains, which is how those papers measure a frozen backbone.

Its BatchNorm keeps per-process statistics under torchrun (timm's default without SyncBatchNorm); in evaluation it
is a per-channel affine map, so the bounded forward computes it per tile exactly.
"""
from typing import List, Optional

import torch
import torch.nn as nn

from .common import LevelResize

__all__ = ['LinearHead']


class LinearHead(nn.Module):
    """One level, the blocks' maps concatenated, [B, in_dim, h, w] at stride p -> logits [B, K, h, w]. ``head_dim``
    is not used (a linear probe has no hidden width)."""

    #: takes the blocks' raw maps (``ViTPyramid`` without its neck), not the simple feature pyramid
    pyramid = False
    #: bounded forward: the logits' bilinear upsampling from stride p reads one patch row beyond a tile
    halos = (1,)
    finest_halo = 0

    def __init__(self, in_dim: int, head_dim: int, num_classes: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(in_dim)
        self.dropout = nn.Dropout2d(dropout)
        self.classifier = nn.Conv2d(in_dim, num_classes, 1)

    def forward(self, levels: List[torch.Tensor], resize: Optional[LevelResize] = None) -> torch.Tensor:
        return self.classifier(self.dropout(self.norm(levels[0])))
