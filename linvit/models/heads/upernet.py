"""UPerNet (Xiao et al. 2018) on the simple feature pyramid, as mmsegmentation's ViT-UPerNet builds it
(``seg.head=upernet``): a pooling pyramid module on the coarsest level, an FPN that fuses every level top-down, and a
3x3 fusion of all levels at the finest one.

The pooling pyramid averages the coarsest level over 1x1, 2x2, 3x3 and 6x6 grids of bins (``adaptive_avg_pool2d``'s
bins: rows floor(i R / s) to ceil((i + 1) R / s)), which needs every row of the image. It is written as "sum, then
apply", like the attention state: ``context_sums`` adds up any set of rows into each bin's sum, the sums of parts add
up to the whole, and ``forward`` divides them by the bins' sizes. The plain forward sums the whole level at once; the
bounded forward sums it band by band before the tiles run, and context-parallel ranks add their sums.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .common import LevelResize, conv_norm_act, whole_level_resize

__all__ = ['UPerNetHead', 'pooled_bin_sums', 'bin_sizes']

POOL_SCALES = (1, 2, 3, 6)


def _bin_membership(scale: int, size: int, start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
    """[scale, stop - start] of 0/1: whether index start + j of a side of ``size`` lies in bin i of ``scale`` bins
    (adaptive average pooling's bins, which overlap when ``scale`` does not divide ``size``)."""
    bins = torch.arange(scale, device=like.device)
    low = torch.div(bins * size, scale, rounding_mode='floor')
    high = torch.div((bins + 1) * size + scale - 1, scale, rounding_mode='floor')
    index = torch.arange(start, stop, device=like.device)
    return ((index[None] >= low[:, None]) & (index[None] < high[:, None])).to(like.dtype)


def bin_sizes(scale: int, size: int) -> torch.Tensor:
    """[scale]: how many indices of a side of ``size`` each adaptive-pooling bin holds."""
    bins = torch.arange(scale)
    return ((bins + 1) * size + scale - 1) // scale - bins * size // scale


def pooled_bin_sums(x: torch.Tensor, rows: Tuple[int, int], height: int, scales: Sequence[int] = POOL_SCALES
                    ) -> List[torch.Tensor]:
    """Per scale s, [B, C, s, s]: the sums over each adaptive-pooling bin of a map of ``height`` rows of its rows
    rows[0]..rows[1]-1, held in x [B, C, rows[1] - rows[0], W]. Sums of disjoint row ranges add up to the whole
    map's; divided by the bins' sizes they are ``F.adaptive_avg_pool2d(whole, s)``."""
    start, stop = rows
    width = x.shape[-1]
    sums = []
    for scale in scales:
        by_column = torch.einsum('bchw,jw->bchj', x, _bin_membership(scale, width, 0, width, x))
        sums.append(torch.einsum('bchj,ih->bcij', by_column, _bin_membership(scale, height, start, stop, x)))
    return sums


class UPerNetHead(nn.Module):
    """Levels [B, in_dim, h_i, w_i] (finest first) -> logits [B, K, h_0, w_0]: pooling pyramid on the coarsest level,
    lateral 1x1 convolutions, top-down sums, 3x3 FPN convolutions, all levels upsampled to the finest, concatenated,
    a 3x3 fusion and the classifier. Channels: head_dim everywhere (mmsegmentation's ``channels``)."""

    pyramid = True
    #: bounded forward (``linvit.models.bounded``): patch rows each level reads beyond a tile, and rows of the finest
    #: level beyond those the logits read (its FPN convolution and the fusion, two 3x3 convolutions). The coarser
    #: levels' halos cover the FPN's 3x3 convolutions and the bottleneck at their own strides, and every top-down
    #: resampling on the way down. Each is the smallest that is exact (tests/models/test_heads.py).
    halos = (1, 2, 3, 8)
    finest_halo = 2
    #: the level whose pooled bins every output pixel reads (``context_sums``)
    context_level = 3

    def __init__(self, in_dim: int, head_dim: int, num_classes: int, num_levels: int = 4,
                 pool_scales: Sequence[int] = POOL_SCALES, dropout: float = 0.1) -> None:
        super().__init__()
        self.pool_scales = tuple(pool_scales)
        self.pooled = nn.ModuleList(conv_norm_act(in_dim, head_dim, 1) for _ in self.pool_scales)
        self.bottleneck = conv_norm_act(in_dim + len(self.pool_scales) * head_dim, head_dim, 3)
        self.laterals = nn.ModuleList(conv_norm_act(in_dim, head_dim, 1) for _ in range(num_levels - 1))
        self.fpn_convs = nn.ModuleList(conv_norm_act(head_dim, head_dim, 3) for _ in range(num_levels - 1))
        self.fuse = conv_norm_act(num_levels * head_dim, head_dim, 3)
        self.dropout = nn.Dropout2d(dropout)
        self.classifier = nn.Conv2d(head_dim, num_classes, 1)

    def context_sums(self, coarsest: torch.Tensor, rows: Tuple[int, int], height: int) -> List[torch.Tensor]:
        """The pooling pyramid's bin sums ([B, in_dim, s, s] per scale) of rows rows[0]..rows[1]-1 of the coarsest
        level (``height`` rows in all), held in coarsest [B, in_dim, n, W]."""
        return pooled_bin_sums(coarsest, rows, height, self.pool_scales)

    def _pooling_pyramid(self, coarsest: torch.Tensor, sums: List[torch.Tensor], height: int, width: int,
                         resize: LevelResize) -> torch.Tensor:
        """The pyramid module's output [B, head_dim, n, W] on the coarsest level's rows in ``coarsest``."""
        outputs = [coarsest]
        for scale, total, conv in zip(self.pool_scales, sums, self.pooled):
            count = bin_sizes(scale, height)[:, None] * bin_sizes(scale, width)[None]
            mean = total / count.to(total.device, total.dtype)
            outputs.append(resize(conv(mean), None, len(self.laterals)))
        return self.bottleneck(torch.cat(outputs, dim=1))

    def forward(self, levels: List[torch.Tensor], resize: Optional[LevelResize] = None,
                context: Optional[List[torch.Tensor]] = None, context_rows: Optional[int] = None) -> torch.Tensor:
        """context: the coarsest level's bin sums over all its rows (``context_sums``) and its row count, given when
        ``levels`` hold tiles of rows; computed from levels[-1] otherwise."""
        resize = resize or whole_level_resize(levels)
        coarsest = levels[-1]
        if context is None:
            context_rows = coarsest.shape[-2]
            context = self.context_sums(coarsest, (0, context_rows), context_rows)
        top = self._pooling_pyramid(coarsest, context, context_rows, coarsest.shape[-1], resize)
        laterals = [lateral(x) for x, lateral in zip(levels, self.laterals)] + [top]
        for level in range(len(laterals) - 1, 0, -1):
            laterals[level - 1] = laterals[level - 1] + resize(laterals[level], level, level - 1)
        outputs = [conv(x) for x, conv in zip(laterals, self.fpn_convs)] + [top]
        outputs = [outputs[0]] + [resize(x, level, 0) for level, x in enumerate(outputs[1:], start=1)]
        return self.classifier(self.dropout(self.fuse(torch.cat(outputs, dim=1))))
