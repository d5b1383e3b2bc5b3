"""The ``features_only`` forms of the linvit models: timm's block maps, or the simple feature pyramid by its tag.

    timm.create_model('linvit_small_patch16_224', features_only=True)          # stride-p block maps, as timm's ViT
    timm.create_model('linvit_small_patch16_224.pyramid', features_only=True)  # 4 levels at p/4, p/2, p, 2p

A plain ViT's ``features_only`` model has every level at the patch stride p, which clients built for hierarchical
backbones refuse: segmentation_models_pytorch's ``tu-`` encoders accept only reductions (4, 8, 16, 32) or (2, 4, ...,
32), and so refuse every plain ViT, timm's own included. The ``.pyramid`` tag of every ``linvit_*`` name makes
``features_only=True`` build ``PyramidFeatureNet`` instead: the backbone and ViTDet's simple feature pyramid
(``ViTPyramid``, what linvit's segmentation models and detectors use) with timm's feature-net contract, so that
``smp.UPerNet(encoder_name='tu-linvit_small_patch16_224.pyramid', encoder_weights=None)`` works.

Why a pretrained tag and not more registered names: smp builds a probe ``timm.create_model(name, features_only=True)``
with no other argument, so the choice must travel in the name, and a tag is the part of a name timm and smp carry
for a configuration of one architecture (smp documents ``tu-<model_name>.<pretrained_tag>``). The tagged model is
the same architecture with the same weights (without ``features_only`` it is the plain classifier), so
``timm.list_models('linvit_*')`` and every test that iterates it stay as they are, and the plain names'
``features_only`` keeps timm's ViT behaviour exactly (timm's own tests and smp's DPT read it).
"""
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn
from timm.models import resolve_pretrained_cfg
from timm.models._features import FeatureInfo, feature_take_indices

from .segmentation import ViTPyramid

__all__ = ['PyramidFeatureNet', 'PYRAMID_TAG', 'PYRAMID_OPTIONS', 'features_only_cfg']

#: the pretrained tag (``linvit_*.pyramid``) whose ``features_only`` model is ``PyramidFeatureNet``
PYRAMID_TAG = 'pyramid'
#: ``PyramidFeatureNet``'s own keyword arguments, taken out of the model's
PYRAMID_OPTIONS = ('neck_dim', 'feature_blocks')
#: what the tag's pretrained cfg says about it (``model.pretrained_cfg['description']``)
PYRAMID_DESCRIPTION = ("features_only=True gives the simple feature pyramid (linvit.models.PyramidFeatureNet): "
                       "4 levels at strides p/4, p/2, p, 2p")
#: timm's number for a ViT's ``features_only`` when no ``out_indices`` is given: its last 3 blocks
LAST_BLOCKS = 3


def _reduction(stride: float) -> Union[int, float]:
    """A level's stride as timm's ``feature_info`` states it: an int when whole (4, not 4.0)."""
    return int(stride) if float(stride).is_integer() else stride


class PyramidFeatureNet(ViTPyramid):
    """The ``features_only`` model of a ``linvit_*.pyramid`` name: ``ViTPyramid`` (a ViT and its simple feature
    pyramid) with timm's feature-net contract. images [B, in_chans, H, W] -> a list with the levels ``out_indices``
    names, finest first, each [B, neck_dim, H/s, W/s] at s = p/4, p/2, p, 2p (4, 8, 16, 32 for patch 16), for any
    size the backbone takes (with ``dynamic_img_size=True`` every size the patch divides, non-square too).

    ``feature_info`` is timm's: channels ``neck_dim``, reductions s, and the module that gives each level
    (``neck.projections.i``). The state dict is ``ViTPyramid``'s (``backbone.*``, ``neck.*``), so the backbone and
    neck of a linvit segmentation model or detector load into it as they are. Levels outside ``out_indices`` are
    not computed; their neck weights stay, so that the state dict stays ``ViTPyramid``'s.

    Args:
        model: the linvit model (timm's ``build_model_with_cfg`` hands it over, weights loaded).
        out_indices: the levels returned, timm's way: an int n, the last n; or level indices 0..3 (negative ones
            count from the end); None, all 4.
        neck_dim: the levels' channels; default 256, ViTDet's width and that of the decoders which read it
            (smp's UPerNet and FPN, torchvision's detectors).
        feature_blocks: the backbone blocks feeding the levels (``ViTPyramid``): 1 (ViTDet: every level from it) or
            4 (one per level, finest first); default 4 evenly spaced blocks ending at the last.
    """

    #: the levels' layout, read by clients (smp permutes 'NHWC' maps)
    output_fmt = 'NCHW'

    def __init__(self, model: nn.Module, out_indices: Optional[Union[int, Sequence[int]]] = None,
                 neck_dim: int = 256, feature_blocks: Sequence[int] = ()) -> None:
        super().__init__(model, neck_dim, feature_blocks)
        self.out_indices = tuple(feature_take_indices(len(self.level_scales), out_indices)[0])
        self.feature_info = FeatureInfo(self._level_info(), self.out_indices)

    def _level_info(self) -> List[Dict[str, Any]]:
        """timm's description of every level (finest first), whichever ``out_indices`` returns."""
        return [dict(num_chs=self.level_dim, reduction=_reduction(stride), module=f'neck.projections.{index}')
                for index, stride in enumerate(self.strides)]

    def forward(self, images: torch.Tensor) -> List[torch.Tensor]:
        """images [B, in_chans, H, W] -> the levels of ``out_indices``, each [B, neck_dim, H/s, W/s]."""
        maps = self.block_maps(images)
        return [self.level(index, maps) for index in self.out_indices]


def _has_pyramid_tag(variant: str, kwargs: Dict[str, Any]) -> bool:
    """Whether the model's pretrained cfg is the ``.pyramid`` tag's: timm hands the tag of ``name.tag`` over as
    ``pretrained_cfg='tag'``, resolved here as ``build_model_with_cfg`` resolves it."""
    cfg = resolve_pretrained_cfg(variant, pretrained_cfg=kwargs.get('pretrained_cfg'),
                                 pretrained_cfg_overlay=kwargs.get('pretrained_cfg_overlay'))
    return cfg.tag == PYRAMID_TAG


def features_only_cfg(variant: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """timm's ``feature_cfg`` for the linvit model ``variant``: what ``features_only=True`` wraps it in. Takes
    ``out_indices`` and ``PYRAMID_OPTIONS`` out of ``kwargs`` (the model's keyword arguments, changed in place;
    ``out_indices`` without ``features_only`` is accepted and ignored, as by timm's ViT).

    The pretrained cfg decides: the ``.pyramid`` tag's gives ``PyramidFeatureNet`` (``out_indices`` picks levels,
    default all 4); every other gives timm's ``FeatureGetterNet`` over ``forward_intermediates``, exactly as for
    timm's ViT (``out_indices`` picks blocks, default the last 3). ValueError for pyramid options the model would
    not use, naming the name that takes them.
    """
    out_indices = kwargs.pop('out_indices', None)
    options = {name: kwargs.pop(name) for name in PYRAMID_OPTIONS if name in kwargs}
    if not _has_pyramid_tag(variant, kwargs):
        if options:
            raise ValueError(f"{', '.join(options)}: options of the simple feature pyramid, which "
                             f"timm.create_model('{variant}.{PYRAMID_TAG}', features_only=True) builds")
        return dict(out_indices=LAST_BLOCKS if out_indices is None else out_indices, feature_cls='getter')
    if options and not kwargs.get('features_only', False):
        raise ValueError(f"{', '.join(options)}: options of the simple feature pyramid, which only "
                         f"features_only=True builds ({variant}.{PYRAMID_TAG} without it is the classifier)")
    return dict(out_indices=out_indices, feature_cls=PyramidFeatureNet, **options)
