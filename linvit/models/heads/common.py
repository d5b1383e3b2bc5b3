"""What every dense head shares: how it brings a map from one level's rows to another's, and its conv blocks.

A head reads a list of levels (finest first) and resizes maps between them only through ``resize(x, src, dst)``.
In the plain forward that is bilinear interpolation of whole maps; the bounded forward (``linvit.models.bounded``)
passes one that samples the rows of a tile at their place in the whole map, so the same head code runs on tiles of
rows. ``src=None`` means ``x`` is a whole small map of its own (a pooled grid), resized to level ``dst``.
"""
from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import LayerNorm2d

__all__ = ['LevelResize', 'whole_level_resize', 'conv_norm_act']

#: resize(x [B, C, h, w] at level src (or a whole map of its own when src is None), src, dst) -> [B, C, h_dst, w_dst]
LevelResize = Callable[[torch.Tensor, Optional[int], int], torch.Tensor]


def whole_level_resize(levels: List[torch.Tensor]) -> LevelResize:
    """The plain forward's resize: bilinear interpolation (align_corners=False) to level ``dst``'s whole size."""
    def resize(x: torch.Tensor, src: Optional[int], dst: int) -> torch.Tensor:
        return F.interpolate(x, size=levels[dst].shape[-2:], mode='bilinear', align_corners=False)
    return resize


def conv_norm_act(in_dim: int, out_dim: int, kernel_size: int) -> nn.Sequential:
    """A convolution without bias (padding keeps the size), LayerNorm2d over channels, ReLU: mmsegmentation's
    ConvModule with a per-pixel norm instead of BatchNorm, which the small batches of large images make unreliable
    and which would need SyncBatchNorm under torchrun."""
    return nn.Sequential(nn.Conv2d(in_dim, out_dim, kernel_size, padding=kernel_size // 2, bias=False),
                         LayerNorm2d(out_dim), nn.ReLU(inplace=True))
