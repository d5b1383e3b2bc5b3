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
from typing import Dict, List, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import LayerNorm2d

from .heads import SEG_HEADS, MLPHead

__all__ = ['SimpleFeaturePyramid', 'BlockMaps', 'MLPHead', 'ViTPyramid', 'SegmentationModel', 'SEG_HEADS',
           'default_feature_blocks', 'pyramid_strides', 'class_ids']

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


def _resolve_map_blocks(blocks: Sequence[int], depth: int) -> List[int]:
    """The distinct blocks whose raw maps a head without the pyramid reads, in order ([]: the last block)."""
    blocks = list(blocks) or [-1]
    for block in blocks:
        if not -depth <= block < depth:
            raise ValueError(f"seg.feature_blocks: block {block} does not exist in a backbone of depth {depth} "
                             f"(valid: 0..{depth - 1} or -{depth}..-1)")
    resolved = [block % depth for block in blocks]
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"seg.feature_blocks={list(blocks)} names a block twice (blocks {resolved})")
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

    scales = PYRAMID_SCALES

    def level(self, index: int, maps: List[torch.Tensor]) -> torch.Tensor:
        """Pyramid level ``index`` (finest first) from its one backbone map, maps = [x [B, C, h, w]]."""
        (x,) = maps
        return self.projections[index](self.rescales[index](self.input_norms[index](x)))

    def forward(self, features: List[torch.Tensor]) -> List[torch.Tensor]:
        """The 4 levels from their backbone maps (finest first)."""
        return [self.level(index, [x]) for index, x in enumerate(features)]


class BlockMaps(nn.Module):
    """No neck: one level at stride p, the blocks' maps [B, C, h, w] concatenated over channels (heads whose
    ``pyramid`` is False, the linear probe)."""

    scales = (1.0,)

    def level(self, index: int, maps: List[torch.Tensor]) -> torch.Tensor:
        return maps[0] if len(maps) == 1 else torch.cat(maps, dim=1)


class ViTPyramid(nn.Module):
    """A plain ViT and its simple feature pyramid: images [B, 3, H, W] -> 4 maps [B, neck_dim, H/s, W/s] at strides
    s = p/4, p/2, p, 2p (``forward_features``), for H and W that the backbone's patch size p divides. What dense
    heads share: the segmentation model adds its decoder head, the detection backbone hands the maps to
    torchvision's detectors (``linvit.models.detection``); the same weights give both the same maps.

    backbone: a timm ViT (``LinearVisionTransformer`` or timm's ``VisionTransformer``) with ``forward_intermediates``
        and ``prune_intermediate_layers``; blocks after the last one used, its final norm and its classifier are
        removed (they would get no gradient, which DistributedDataParallel rejects).
    feature_blocks: backbone block(s) feeding the pyramid (see ``_resolve_feature_blocks``); [] = 4 evenly spaced.
    pyramid: False: no neck; one level, the raw maps of ``feature_blocks`` (default: the last block) concatenated
        (``BlockMaps``), for heads that read the blocks themselves (the linear probe).
    """

    def __init__(self, backbone: nn.Module, neck_dim: int = 128, feature_blocks: Sequence[int] = (),
                 pyramid: bool = True) -> None:
        super().__init__()
        depth = len(backbone.blocks)
        if pyramid:
            self.level_blocks = _resolve_feature_blocks(feature_blocks, depth)
            self.level_inputs = [[block] for block in self.level_blocks]
        else:
            self.level_blocks = _resolve_map_blocks(feature_blocks, depth)
            self.level_inputs = [list(self.level_blocks)]
        self.take_blocks = sorted(set(self.level_blocks))
        backbone.prune_intermediate_layers(self.take_blocks, prune_norm=True, prune_head=True)
        self.backbone = backbone
        self.neck = SimpleFeaturePyramid(backbone.embed_dim, neck_dim) if pyramid else BlockMaps()

    def freeze_backbone(self) -> None:
        """Keep the backbone's weights as they are and the backbone in eval mode (no dropout, drop path or
        statistics updates) whatever ``train()`` says: only the neck and the head train."""
        self.backbone.requires_grad_(False)
        self.backbone_frozen = True
        self.backbone.eval()

    def train(self, mode: bool = True) -> 'ViTPyramid':
        super().train(mode)
        if getattr(self, 'backbone_frozen', False):
            self.backbone.eval()
        return self

    @property
    def level_dim(self) -> int:
        """Channels of the levels the head reads."""
        if isinstance(self.neck, BlockMaps):
            return self.backbone.embed_dim * len(self.level_blocks)
        return self.neck.projections[0][0].out_channels

    @property
    def level_scales(self) -> Sequence[float]:
        """Each level's scale relative to the patch stride, finest first (4, 2, 1, 1/2; or 1 without the neck)."""
        return self.neck.scales

    def level(self, index: int, maps: Dict[int, torch.Tensor]) -> torch.Tensor:
        """Level ``index`` from the backbone maps by block (each [B, C, h, w]; rows of the same span)."""
        return self.neck.level(index, [maps[block] for block in self.level_inputs[index]])

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
        """The levels' strides in pixels, finest first: p/4, p/2, p, 2p (p without the neck)."""
        return [self.input_multiple / scale for scale in self.level_scales]

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)

    def block_maps(self, images: torch.Tensor) -> Dict[int, torch.Tensor]:
        """The backbone maps the levels read, by block: each [B, C, H/p, W/p] (before the final norm)."""
        taken = self.backbone.forward_intermediates(images, indices=self.take_blocks, norm=False, output_fmt='NCHW',
                                                    intermediates_only=True)
        return dict(zip(self.take_blocks, taken))

    def forward_features(self, images: torch.Tensor) -> List[torch.Tensor]:
        """The levels: 4 maps [B, neck_dim, H/s, W/s], strides p/4, p/2, p, 2p (one map at stride p without the
        neck)."""
        by_block = self.block_maps(images)
        return [self.level(index, by_block) for index in range(len(self.level_inputs))]


class SegmentationModel(ViTPyramid):
    """images [B, 3, H, W] -> logits [B, num_classes, H, W], for H and W that the backbone's patch size divides: the
    levels of ``ViTPyramid`` (its pyramid, or the blocks' raw maps for a head whose ``pyramid`` is False) and a
    decoder head (``SEG_HEADS``: mlp, upernet, dpt, linear)."""

    def __init__(self, backbone: nn.Module, num_classes: int, head: str = 'mlp', neck_dim: int = 128,
                 head_dim: int = 128, feature_blocks: Sequence[int] = ()) -> None:
        head_class = SEG_HEADS.get(head)  # an unknown name: ValueError naming the known heads
        if num_classes < 1:
            raise ValueError(f"a segmentation model needs num_classes >= 1, got {num_classes}")
        super().__init__(backbone, neck_dim, feature_blocks, pyramid=head_class.pyramid)
        self.num_classes = num_classes
        self.head = head_class(self.level_dim, head_dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.forward_features(images))
        return F.interpolate(logits, size=images.shape[-2:], mode='bilinear', align_corners=False)
