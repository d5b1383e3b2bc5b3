"""Object detection: a plain ViT and its simple feature pyramid (``ViTPyramid``, ViTDet: Li et al. 2022) as the
backbone of torchvision's detectors, through torchvision's backbone contract (``backbone(images)`` -> an ordered
dict of maps, ``backbone.out_channels``), so their heads, losses and box decoding are torchvision's own.

    detector = build_detector(backbone, num_classes=3, detector='faster_rcnn')  # 3 object classes
    losses = detector(images, targets)    # train mode; targets: [{'boxes': [N, 4] xyxy pixels, 'labels': [N] 1..3}]
    found = detector.eval()(images)       # [{'boxes': [M, 4], 'labels': [M] 1..3, 'scores': [M]}] per image

Labels count from 1 for every detector: index 0 is the two-stage detectors' background class; RetinaNet and FCOS
have no background class and score classes 1..K in their K outputs (``_LabelsFromOne``). Images arrive normalised
and sized by the data pipeline (ViTDet trains with large-scale jitter there): the detectors' transform neither
normalises nor resizes, it only pads a batch to a multiple of twice the patch size (the coarsest level's stride).

The pyramid's maps are the segmentation model's: a ``SegmentationModel``'s ``backbone.*`` and ``neck.*`` tensors
load into ``detector.backbone`` as they are.
"""
import math
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torchvision.models.detection import FCOS, FasterRCNN, MaskRCNN, RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import MultiScaleRoIAlign

from ..registry import Registry
from .segmentation import PYRAMID_SCALES, ViTPyramid, pyramid_strides

__all__ = ['PyramidBackbone', 'build_detector', 'DETECTORS', 'pyramid_strides', 'detection_cap', 'set_detection_cap']

#: the pyramid levels' names in the ordered dict torchvision's heads read (finest first)
LEVEL_NAMES = tuple(str(index) for index in range(len(PYRAMID_SCALES)))
#: anchor side per level, in strides of that level (torchvision's FPN anchors: 32 px at stride 4 ... 256 at 32)
ANCHOR_STRIDES = 8
ASPECT_RATIOS = (0.5, 1.0, 2.0)


class PyramidBackbone(ViTPyramid):
    """images [B, 3, H, W] -> OrderedDict {'0': stride p/4, '1': p/2, '2': p, '3': 2p} of [B, out_channels, H/s,
    W/s]: torchvision's detector backbone contract on ``ViTPyramid``."""

    def __init__(self, backbone: nn.Module, neck_dim: int = 256, feature_blocks: Sequence[int] = ()) -> None:
        super().__init__(backbone, neck_dim, feature_blocks)
        self.out_channels = neck_dim

    def forward(self, images: torch.Tensor) -> Dict[str, torch.Tensor]:
        return OrderedDict(zip(LEVEL_NAMES, self.forward_features(images)))


class _PaddingOnly(GeneralizedRCNNTransform):
    """torchvision's detector transform without its resize and normalisation (the data pipeline did both): it
    batches images of different sizes by padding to ``size_divisible`` and leaves boxes in input pixels."""

    def __init__(self, size_divisible: int) -> None:
        super().__init__(min_size=1, max_size=1, image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0],
                         size_divisible=size_divisible)

    def normalize(self, image: torch.Tensor) -> torch.Tensor:
        return image

    def resize(self, image: torch.Tensor, target: Optional[Dict[str, torch.Tensor]] = None
               ) -> Tuple[torch.Tensor, Optional[Dict[str, torch.Tensor]]]:
        return image, target


def _anchors(backbone: PyramidBackbone, ratios: Sequence[float]) -> AnchorGenerator:
    sizes = tuple((int(round(ANCHOR_STRIDES * stride)),) for stride in backbone.strides)
    return AnchorGenerator(sizes=sizes, aspect_ratios=(tuple(ratios),) * len(sizes))


def _roi_pool(output_size: int) -> MultiScaleRoIAlign:
    return MultiScaleRoIAlign(featmap_names=list(LEVEL_NAMES), output_size=output_size, sampling_ratio=2)


def _faster_rcnn(backbone: PyramidBackbone, num_classes: int, **kwargs: Any) -> nn.Module:
    return FasterRCNN(backbone, num_classes, rpn_anchor_generator=_anchors(backbone, ASPECT_RATIOS),
                      box_roi_pool=_roi_pool(7), **kwargs)


def _mask_rcnn(backbone: PyramidBackbone, num_classes: int, **kwargs: Any) -> nn.Module:
    return MaskRCNN(backbone, num_classes, rpn_anchor_generator=_anchors(backbone, ASPECT_RATIOS),
                    box_roi_pool=_roi_pool(7), mask_roi_pool=_roi_pool(14), **kwargs)


class _LabelsFromOne:
    """For a single-stage detector (sigmoid scores, no background output) of K classes: labels 1..K in targets and
    detections, as the two-stage detectors give them, mapped to and from its outputs 0..K-1."""

    def forward(self, images: List[torch.Tensor], targets: Optional[List[Dict[str, torch.Tensor]]] = None) -> Any:
        if targets is not None:
            targets = [{**target, 'labels': target['labels'] - 1} for target in targets]
        output = super().forward(images, targets)
        if self.training:
            return output  # the losses
        return [{**found, 'labels': found['labels'] + 1} for found in output]


class _RetinaNet(_LabelsFromOne, RetinaNet):
    pass


class _FCOS(_LabelsFromOne, FCOS):
    pass


def _retinanet(backbone: PyramidBackbone, num_classes: int, **kwargs: Any) -> nn.Module:
    return _RetinaNet(backbone, num_classes - 1, anchor_generator=_anchors(backbone, ASPECT_RATIOS), **kwargs)


def _fcos(backbone: PyramidBackbone, num_classes: int, **kwargs: Any) -> nn.Module:  # one anchor point per cell
    return _FCOS(backbone, num_classes - 1, anchor_generator=_anchors(backbone, (1.0,)), **kwargs)


#: torchvision detectors by name (``detection.detector``): builder(backbone, K + 1 (the object classes and the
#: background), **kwargs)
DETECTORS: Registry[Callable[..., nn.Module]] = Registry('detection.detector')
DETECTORS.register('faster_rcnn', _faster_rcnn)
DETECTORS.register('mask_rcnn', _mask_rcnn)
DETECTORS.register('retinanet', _retinanet)
DETECTORS.register('fcos', _fcos)


def build_detector(backbone: nn.Module, num_classes: int, detector: str = 'faster_rcnn', neck_dim: int = 256,
                   feature_blocks: Sequence[int] = (), **kwargs: Any) -> nn.Module:
    """torchvision's ``detector`` on ``backbone`` (a timm ViT, as for ``SegmentationModel``) and its pyramid, for
    ``num_classes`` object classes (labels 1..num_classes; 0 is the background). ``kwargs`` go to the detector
    (e.g. ``box_detections_per_img``, ``box_score_thresh``)."""
    build = DETECTORS.get(detector)  # an unknown name: ValueError naming the known detectors
    if num_classes < 1:
        raise ValueError(f"a detector needs num_classes >= 1 object classes, got {num_classes}")
    pyramid = PyramidBackbone(backbone, neck_dim, feature_blocks)
    model = build(pyramid, num_classes + 1, **kwargs)
    # the coarsest level's stride: padded sides it divides keep every level's grid exact
    model.transform = _PaddingOnly(size_divisible=int(math.ceil(max(pyramid.strides))))
    model.takes_targets = True  # training computes the losses from the targets (linvit.fast.LossGraph)
    model.input_multiple = pyramid.input_multiple  # what image sides the task checks against
    return model


def _cap_holder(detector: nn.Module) -> Any:
    """The module whose ``detections_per_img`` caps a detector's output: the two-stage detectors' box heads
    (``roi_heads``), the single-stage detector itself."""
    holder = getattr(detector, 'roi_heads', detector)
    if not hasattr(holder, 'detections_per_img'):
        raise ValueError(f"{type(detector).__name__} has no detections_per_img (torchvision's cap on the detections "
                         f"per image)")
    return holder


def detection_cap(detector: nn.Module) -> int:
    """How many detections per image ``detector`` returns at most (torchvision's ``detections_per_img``)."""
    return int(_cap_holder(detector).detections_per_img)


def set_detection_cap(detector: nn.Module, count: int) -> None:
    """Let ``detector`` return up to ``count`` detections per image (the weights are unchanged)."""
    if count < 1:
        raise ValueError(f"a detector returns at least 1 detection per image, got a cap of {count}")
    _cap_holder(detector).detections_per_img = int(count)
