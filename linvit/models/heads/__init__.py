"""Dense decoder heads by name (``seg.head``), each in its own file: levels of a ``ViTPyramid`` (finest first) ->
logits at the finest level's stride.

A head is a module ``cls(in_dim, head_dim, num_classes)`` whose ``forward(levels, resize=None)`` resizes maps
between levels only through ``resize`` (``common.LevelResize``), with three class attributes the models read:
``pyramid`` (True: the simple feature pyramid's 4 levels; False: the blocks' raw maps concatenated, one level at
stride p), ``halos`` (per level, the patch rows of backbone map it reads beyond a tile of rows) and ``finest_halo``
(rows of the finest level beyond those the logits read): with them the bounded forward (``linvit.models.bounded``)
runs any head on tiles of rows, exactly. A head that needs every row (a global pooling) names its
``context_level`` and sums it with ``context_sums`` (``upernet.UPerNetHead``).
"""
from typing import Type

import torch.nn as nn

from ...registry import Registry
from .common import LevelResize, conv_norm_act, whole_level_resize
from .dpt import DPTHead
from .linear import LinearHead
from .mlp import MLPHead
from .upernet import UPerNetHead

__all__ = ['SEG_HEADS', 'MLPHead', 'UPerNetHead', 'DPTHead', 'LinearHead', 'LevelResize', 'whole_level_resize',
           'conv_norm_act']

#: decoder heads by name (``seg.head``): class(in_dim, head_dim, num_classes)
SEG_HEADS: Registry[Type[nn.Module]] = Registry('seg.head')
SEG_HEADS.register('mlp', MLPHead)
SEG_HEADS.register('upernet', UPerNetHead)
SEG_HEADS.register('dpt', DPTHead)
SEG_HEADS.register('linear', LinearHead)
