"""Semantic segmentation: a plain ViT backbone -> a simple feature pyramid -> a light head, logits at input size.

    model = SegmentationModel(backbone, num_classes=11)            # any timm ViT with forward_intermediates
    logits = model(images)                                          # [B, 3, H, W] -> [B, num_classes, H, W]

The design follows ViTDet (Li et al. 2022): a non-hierarchical ViT needs no multi-stage backbone for dense
prediction; deconvolutions and pooling of its stride-p maps (p = patch size) give a 4-level pyramid at strides
p/4, p/2, p and 2p. The pyramid is fed either from one block (ViTDet: every level from the last block) or from
four blocks, one per level (finest from the earliest, as mmsegmentation's ViT + MultiLevelNeck does). The
default head is SegFormer's all-MLP decoder (Xie et al. 2021): per-level 1x1 projections, upsampled to the
finest level, concatenated, fused and classified; logits are upsampled bilinearly to the input size inside the
model, so ``model(images)`` matches the mask resolution.

Why not segmentation_models_pytorch's decoders: the pyramid and the head are ~150 lines here, they work with any
timm ViT (linvit or softmax) unchanged, they compile with zero graph breaks and they use no BatchNorm (which would
need SyncBatchNorm under torchrun and misbehaves with the small batches large images force).

Backbones are created with ``dynamic_img_size=True``, so one model trains on ``img_size`` crops and evaluates full
images of any size whose sides the patch size divides (``linvit.inference`` pads the rest).
"""
import math
from typing import Callable, List, Optional, Sequence, Type

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import LayerNorm2d

from ..registry import Registry

__all__ = ['SimpleFeaturePyramid', 'MLPHead', 'ViTPyramid', 'SegmentationModel', 'SEG_HEADS', 'default_feature_blocks',
           'pyramid_strides', 'class_ids']

PYRAMID_SCALES = (4.0, 2.0, 1.0, 0.5)  # relative to the backbone's patch stride, finest first


def pyramid_strides(patch_size: int) -> List[float]:
    """The pyramid levels' strides in pixels for a backbone of patch size ``patch_size`` (finest first)."""
    return [patch_size / scale for scale in PYRAMID_SCALES]


def class_ids(logits: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Each pixel's class: the index of its largest logit along ``dim`` (logits [B, K, H, W] -> int64 [B, H, W] with
    ``dim=1``), the first on ties, as ``argmax`` gives it. ``max(dim).indices`` rather than ``argmax``: on the CPU
    torch's argmax over a dimension other than the last is 2-6x slower (0.56 s against 0.10 s for [1, 4, 256, 10000]
    on one thread), and a whole-image prediction takes it over every pixel."""
    return logits.max(dim=dim).indices


def default_feature_blocks(depth: int) -> List[int]:
    """Four evenly spaced block indices ending at the last block: depth 12 -> [2, 5, 8, 11]."""
    return [math.ceil((i + 1) * depth / 4) - 1 for i in range(4)]


def _resolve_feature_blocks(blocks: Sequence[int], depth: int) -> List[int]:
    """The block index feeding each of the 4 pyramid levels (finest first); negative indices count from the end."""
    blocks = list(blocks) or default_feature_blocks(depth)
    if len(blocks) == 1:
        blocks = blocks * len(PYRAMID_SCALES)
    if len(blocks) != len(PYRAMID_SCALES):
        raise ValueError(f"seg.feature_blocks must name 1 block (ViTDet: every pyramid level from it) or "
                         f"{len(PYRAMID_SCALES)} (one per level, finest first), got {list(blocks)}")
    resolved = []
    for block in blocks:
        if not -depth <= block < depth:
            raise ValueError(f"seg.feature_blocks: block {block} does not exist in a backbone of depth {depth} "
                             f"(valid: 0..{depth - 1} or -{depth}..-1)")
        resolved.append(block % depth)
    return resolved


def _rescale_layers(scale: float, dim: int) -> nn.Module:
    """ViTDet's resampling of a stride-p map: 2x2 transposed convolutions up, max pooling down."""
    if scale == 4.0:
        return nn.Sequential(nn.ConvTranspose2d(dim, dim // 2, 2, stride=2), LayerNorm2d(dim // 2), nn.GELU(),
                             nn.ConvTranspose2d(dim // 2, dim // 4, 2, stride=2))
    if scale == 2.0:
        return nn.ConvTranspose2d(dim, dim // 2, 2, stride=2)
    if scale == 1.0:
        return nn.Identity()
    if scale == 0.5:
        return nn.MaxPool2d(kernel_size=2, stride=2)
    raise ValueError(f"pyramid scale {scale} is not one of {PYRAMID_SCALES}")


def _rescaled_dim(scale: float, dim: int) -> int:
    return {4.0: dim // 4, 2.0: dim // 2}.get(scale, dim)


class SimpleFeaturePyramid(nn.Module):
    """Four maps [B, out_dim, H/s, W/s] at strides s = p/4, p/2, p, 2p from four backbone maps [B, C, H/p, W/p].

    Each input is layer-normalised first (block outputs are un-normalised residual streams), resampled, then
    projected by a 1x1 and a 3x3 convolution, each followed by a LayerNorm (ViTDet's neck).
    """

    def __init__(self, embed_dim: int, out_dim: int) -> None:
        super().__init__()
        self.input_norms = nn.ModuleList(LayerNorm2d(embed_dim) for _ in PYRAMID_SCALES)
        self.rescales = nn.ModuleList(_rescale_layers(s, embed_dim) for s in PYRAMID_SCALES)
        self.projections = nn.ModuleList(
            nn.Sequential(nn.Conv2d(_rescaled_dim(s, embed_dim), out_dim, 1, bias=False), LayerNorm2d(out_dim),
                          nn.Conv2d(out_dim, out_dim, 3, padding=1, bias=False), LayerNorm2d(out_dim))
            for s in PYRAMID_SCALES)

    def level(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Pyramid level ``index`` (finest first) from its backbone map x [B, C, h, w]."""
        return self.projections[index](self.rescales[index](self.input_norms[index](x)))

    def forward(self, features: List[torch.Tensor]) -> List[torch.Tensor]:
        return [self.level(index, x) for index, x in enumerate(features)]


#: resize(map [B, C, h_i, w_i], level i) -> [B, C, h_0, w_0]: how a head brings coarser levels to the finest one
LevelResize = Callable[[torch.Tensor, int], torch.Tensor]


class MLPHead(nn.Module):
    """SegFormer's all-MLP decoder: pyramid [B, in_dim, h_i, w_i] (finest first) -> logits [B, K, h_0, w_0].

    ``resize`` brings the coarser levels to the finest one's size: bilinear over the whole maps by default; the
    bounded forward (``linvit.models.bounded``) passes one that samples a band of rows at its place in the image.
    """

    def __init__(self, in_dim: int, head_dim: int, num_classes: int, num_levels: int = len(PYRAMID_SCALES),
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.projections = nn.ModuleList(nn.Conv2d(in_dim, head_dim, 1) for _ in range(num_levels))
        self.fuse = nn.Sequential(nn.Conv2d(num_levels * head_dim, head_dim, 1, bias=False), LayerNorm2d(head_dim),
                                  nn.GELU())
        self.dropout = nn.Dropout2d(dropout)
        self.classifier = nn.Conv2d(head_dim, num_classes, 1)

    def forward(self, pyramid: List[torch.Tensor], resize: Optional[LevelResize] = None) -> torch.Tensor:
        size = pyramid[0].shape[-2:]
        levels = [project(x) for x, project in zip(pyramid, self.projections)]
        resize = resize or (lambda x, level: F.interpolate(x, size=size, mode='bilinear', align_corners=False))
        levels = [levels[0]] + [resize(x, level) for level, x in enumerate(levels[1:], start=1)]
        return self.classifier(self.dropout(self.fuse(torch.cat(levels, dim=1))))


#: decoder heads by name (``seg.head``): class(in_dim, head_dim, num_classes)
SEG_HEADS: Registry[Type[nn.Module]] = Registry('seg.head')
SEG_HEADS.register('mlp', MLPHead)


class ViTPyramid(nn.Module):
    """A plain ViT and its simple feature pyramid: images [B, 3, H, W] -> 4 maps [B, neck_dim, H/s, W/s] at strides
    s = p/4, p/2, p, 2p (``forward_features``), for H and W that the backbone's patch size p divides. What dense
    heads share: the segmentation model adds its decoder head, the detection backbone hands the maps to
    torchvision's detectors (``linvit.models.detection``); the same weights give both the same maps.

    backbone: a timm ViT (``LinearVisionTransformer`` or timm's ``VisionTransformer``) with ``forward_intermediates``
        and ``prune_intermediate_layers``; blocks after the last one used, its final norm and its classifier are
        removed (they would get no gradient, which DistributedDataParallel rejects).
    feature_blocks: backbone block(s) feeding the pyramid (see ``_resolve_feature_blocks``); [] = 4 evenly spaced.
    """

    def __init__(self, backbone: nn.Module, neck_dim: int = 128, feature_blocks: Sequence[int] = ()) -> None:
        super().__init__()
        self.level_blocks = _resolve_feature_blocks(feature_blocks, len(backbone.blocks))
        self.take_blocks = sorted(set(self.level_blocks))
        backbone.prune_intermediate_layers(self.take_blocks, prune_norm=True, prune_head=True)
        self.backbone = backbone
        self.neck = SimpleFeaturePyramid(backbone.embed_dim, neck_dim)

    @property
    def patch_embed(self) -> nn.Module:
        """The backbone's patch embedding (read by ``linvit.fast`` to check image sizes before compiled code)."""
        return self.backbone.patch_embed

    @property
    def input_multiple(self) -> int:
        """Image sides must be multiples of this (the patch size); ``linvit.inference`` pads to it."""
        patch = self.backbone.patch_embed.patch_size
        return max(patch) if isinstance(patch, (tuple, list)) else int(patch)

    @property
    def strides(self) -> List[float]:
        """The levels' strides in pixels, finest first: p/4, p/2, p, 2p."""
        return pyramid_strides(self.input_multiple)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)

    def forward_features(self, images: torch.Tensor) -> List[torch.Tensor]:
        """The pyramid: 4 maps [B, neck_dim, H/s, W/s], strides p/4, p/2, p, 2p."""
        taken = self.backbone.forward_intermediates(images, indices=self.take_blocks, norm=False, output_fmt='NCHW',
                                                    intermediates_only=True)
        by_block = dict(zip(self.take_blocks, taken))
        return self.neck([by_block[block] for block in self.level_blocks])


class SegmentationModel(ViTPyramid):
    """images [B, 3, H, W] -> logits [B, num_classes, H, W], for H and W that the backbone's patch size divides: the
    pyramid of ``ViTPyramid`` and a decoder head (``SEG_HEADS``)."""

    def __init__(self, backbone: nn.Module, num_classes: int, head: str = 'mlp', neck_dim: int = 128,
                 head_dim: int = 128, feature_blocks: Sequence[int] = ()) -> None:
        head_class = SEG_HEADS.get(head)  # an unknown name: ValueError naming the known heads
        if num_classes < 1:
            raise ValueError(f"a segmentation model needs num_classes >= 1, got {num_classes}")
        super().__init__(backbone, neck_dim, feature_blocks)
        self.num_classes = num_classes
        self.head = head_class(neck_dim, head_dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.forward_features(images))
        return F.interpolate(logits, size=images.shape[-2:], mode='bilinear', align_corners=False)
