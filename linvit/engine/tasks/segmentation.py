"""Semantic segmentation: image/mask folders or built-in data, a ViT + feature pyramid + head, mIoU.

Training runs on ``data.img_size`` crops (random scale, crop, flips, colour jitter: ``linvit.data``); evaluation runs
on full-resolution validation images, one image at a time, as a whole (``seg.eval.mode=whole``, refused above
``seg.eval.max_pixels``) or in overlapping windows whose logits are averaged (``seg.eval.mode=slide``;
``linvit.inference``). The metrics come from a confusion matrix summed over processes: mIoU, per-class IoU, pixel
accuracy, and the mean cross-entropy per labelled pixel.
"""
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils.data import Dataset

from ...inference import segment
from ...models import SEG_HEADS
from ...models.segmentation import SegmentationModel, class_ids
from ..config import ConfigError, config_choice, config_section
from ..metrics import Meter, SegmentationMeter
from ..plots import plot_confusion_matrix, plot_segmentation_grid
from .base import Task, create_model_from_config, input_multiple, nearest_multiples, picture_indices, register_task

__all__ = ['SegmentationTask', 'SegmentationLoss', 'SegConfig', 'SegEvalConfig', 'dice_loss',
           'create_segmentation_model']


@dataclass
class SegEvalConfig:
    mode: str = 'whole'  # 'whole' (one forward per full image) or 'slide' (windows, logits averaged where they overlap)
    window: Optional[int] = None  # slide: window side in pixels (default: data.img_size)
    stride: Optional[int] = None  # slide: step between windows (default: 2/3 of the window)
    max_pixels: int = 4194304  # whole: refuse larger images (H * W) with an error instead of running out of memory


@dataclass
class SegConfig:
    """The ``seg`` section of every run config: the segmentation model, loss and evaluation (task=segmentation;
    the linearization reads a segmentation teacher's architecture from it)."""
    head: str = 'mlp'  # decoder head (linvit.models.SEG_HEADS)
    neck_dim: int = 128  # channels of every feature-pyramid level
    head_dim: int = 128  # channels of the head's fused features
    feature_blocks: List[int] = field(default_factory=list)  # backbone blocks feeding the pyramid ([]: 4 evenly spaced)
    dice_weight: float = 0.0  # loss = cross-entropy + dice_weight * dice
    eval: SegEvalConfig = field(default_factory=SegEvalConfig)


config_section('seg', SegConfig)
config_choice('seg.head', SEG_HEADS)
config_choice('seg.eval.mode', ('whole', 'slide'))

_logger = logging.getLogger(__name__)

PICTURE_COUNT = 4


def dice_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, smooth: float = 1.0) -> torch.Tensor:
    """Soft Dice loss averaged over classes: logits [B, K, H, W], targets [B, H, W] int64 -> 0-dim float32.

    1 - (2 sum(p * t) + smooth) / (sum(p) + sum(t) + smooth) per class, over the pixels whose target is not
    ``ignore_index`` (p: softmax probabilities in float32, t: one-hot targets); ``smooth`` keeps a class absent
    from both at loss 0 instead of 0/0.
    """
    num_classes = logits.shape[1]
    valid = (targets != ignore_index).unsqueeze(1)                                  # [B, 1, H, W]
    probs = logits.float().softmax(dim=1) * valid
    one_hot = F.one_hot(targets.masked_fill(~valid.squeeze(1), 0), num_classes)    # [B, H, W, K]
    one_hot = one_hot.permute(0, 3, 1, 2).to(probs.dtype) * valid
    dims = (0, 2, 3)
    intersection = (probs * one_hot).sum(dims)
    cardinality = probs.sum(dims) + one_hot.sum(dims)
    return (1 - (2 * intersection + smooth) / (cardinality + smooth)).mean()


class SegmentationLoss(nn.Module):
    """Cross-entropy over the labelled pixels (mean), plus ``dice_weight`` x ``dice_loss`` when it is positive.

    logits [B, K, H, W], targets [B, H, W] int64 (``ignore_index`` = unlabelled) -> 0-dim loss.
    """

    def __init__(self, ignore_index: int = 255, dice_weight: float = 0.0) -> None:
        super().__init__()
        if dice_weight < 0:
            raise ValueError(f"seg.dice_weight must be >= 0, got {dice_weight}")
        self.ignore_index = ignore_index
        self.dice_weight = dice_weight

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.float(), targets, ignore_index=self.ignore_index)
        if self.dice_weight > 0:
            loss = loss + self.dice_weight * dice_loss(logits, targets, self.ignore_index)
        return loss


def create_segmentation_model(model_cfg: DictConfig, seg_cfg: DictConfig, num_classes: int,
                              img_size: int) -> SegmentationModel:
    """A SegmentationModel from the run config: ``model.*`` makes the backbone (any timm ViT, linvit_* included,
    created at ``img_size`` with ``dynamic_img_size=True`` and no classifier; ``model.pretrained_file`` loads
    classification weights into it, ``model.pretrained`` timm's weights of model.name), ``seg.*`` chooses the
    pyramid's blocks and width and the head; ``model.freeze_backbone`` keeps the backbone as loaded."""
    not_a_vit = (f"model.name={model_cfg.name!r} is not a plain ViT (patch_embed, blocks, forward_intermediates, "
                 f"dynamic_img_size); segmentation takes linvit_* or timm's vit_* backbones")
    try:
        backbone = create_model_from_config(model_cfg, num_classes=0, img_size=img_size,
                                            extra_kwargs={'dynamic_img_size': True})
    except TypeError as error:
        if 'dynamic_img_size' in str(error):
            raise ValueError(not_a_vit) from error
        raise
    if not all(hasattr(backbone, a) for a in ('forward_intermediates', 'blocks', 'patch_embed')):
        raise ValueError(not_a_vit)
    model = SegmentationModel(backbone, num_classes, head=seg_cfg.head, neck_dim=seg_cfg.neck_dim,
                              head_dim=seg_cfg.head_dim, feature_blocks=list(seg_cfg.feature_blocks))
    if model_cfg.get('freeze_backbone', False):
        model.freeze_backbone()
    return model


@register_task
class SegmentationTask(Task):
    name = 'segmentation'
    main_metric = 'miou'
    metric_columns = ('miou', 'pixel_acc')
    architecture_keys = ('seg.head', 'seg.neck_dim', 'seg.head_dim', 'seg.feature_blocks')
    classifier_key = 'head.classifier.weight'
    logits_rank = 4
    frozen_backbone = True

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        self.num_classes: Optional[int] = None
        self.class_names: Optional[List[str]] = None

    def build_datasets(self, mean: Sequence[float], std: Sequence[float],
                       with_train: bool = True) -> Tuple[Optional[Dataset], Dataset, List[str]]:
        from ...data import build_segmentation_datasets  # here: albumentations is a heavy import
        train, val, self.class_names = build_segmentation_datasets(self.cfg.data, mean, std, with_train)
        if train is not None:
            self._warn_small_images(train)
        return train, val, self.class_names

    def _warn_small_images(self, train: Dataset) -> None:
        """Warn when the training images are mostly smaller than the crop: each crop is then largely padding that
        no loss counts, at the full cost of a data.img_size step."""
        sizes = train.image_sizes() if hasattr(train, 'image_sizes') else []
        crop = self.cfg.data.img_size
        small = [(path, w, h) for path, w, h in sizes if min(w, h) < crop]
        if len(small) * 2 > len(sizes):
            path, w, h = small[0]
            _logger.warning("%d of %d training images checked are smaller than the data.img_size=%d crop (e.g. %s, "
                            "%dx%d): crops are mostly padding; set data.img_size to about %d (a multiple of the "
                            "patch)", len(small), len(sizes), crop, path, w, h, min(min(w, h) for _, w, h in small))

    def build_model(self, num_classes: int) -> nn.Module:
        self.num_classes = num_classes
        return create_segmentation_model(self.cfg.model, self.cfg.seg, num_classes, self.cfg.data.img_size)

    def train_loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return SegmentationLoss(self.cfg.data.ignore_index, self.cfg.seg.dice_weight)

    def eval_batch_size(self) -> int:
        # validation images keep their own sizes, so they cannot be stacked; windows are batched instead
        return 1

    def new_meter(self, device: torch.device) -> SegmentationMeter:
        return SegmentationMeter(self.num_classes, ignore_index=self.cfg.data.ignore_index, device=device)

    def describe_evaluation(self) -> str:
        ev = self.cfg.seg.eval
        if ev.mode == 'whole':
            return "whole validation images, one forward each"
        window = ev.window or self.cfg.data.img_size
        stride = f"{ev.stride} px" if ev.stride else "2/3 of the window"
        return f"sliding {window} px windows, stride {stride}"

    def check_input_size(self, model: nn.Module) -> None:
        """The training crop and the sliding window must be multiples of the patch; the stride must fit the window
        (whole-mode images of any size are padded to the patch)."""
        super().check_input_size(model)
        ev, multiple = self.cfg.seg.eval, input_multiple(model)
        if ev.mode != 'slide':
            return
        window = ev.window or self.cfg.data.img_size
        if window % multiple:
            raise ConfigError(f"seg.eval.window={window} is not a multiple of the patch size {multiple}: use "
                              f"{nearest_multiples(window, multiple)}")
        if ev.stride is not None and not 0 < ev.stride <= window:
            raise ConfigError(f"seg.eval.stride={ev.stride} must be between 1 and the window ({window} px)")

    def prediction_defaults(self) -> Dict[str, Any]:
        ev = self.cfg.seg.eval
        return {'mode': ev.mode, 'window': ev.window, 'stride': ev.stride}

    def predict(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """Full-resolution logits float32 [B, K, H, W] for images [B, 3, H, W], as ``seg.eval`` says."""
        ev = self.cfg.seg.eval
        multiple = input_multiple(model)
        window = ev.window or self.cfg.data.img_size
        return segment(model, images, ev.mode, window=window, stride=ev.stride,
                       batch_size=self.cfg.data.eval_batch_size or self.cfg.data.batch_size,
                       max_pixels=ev.max_pixels, pad_multiple=multiple)

    def evaluate_batch(self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
                       meter: SegmentationMeter) -> None:
        logits = self.predict(model, images)
        loss_sum = F.cross_entropy(logits, targets, ignore_index=self.cfg.data.ignore_index, reduction='sum')
        meter.update(logits, targets, loss_sum)

    def final_metrics(self, computed: Dict[str, Any]) -> Dict[str, Any]:
        names = self._class_names(len(computed['per_class_iou']))
        # a class absent from both the masks and the predictions has no IoU: null in JSON, not NaN
        per_class = {name: (None if math.isnan(iou) else iou) for name, iou in zip(names, computed['per_class_iou'])}
        return {'miou': computed['miou'], 'pixel_acc': computed['pixel_acc'], 'per_class_iou': per_class,
                'loss': computed['loss'], 'pixels': computed['pixels']}

    def _class_names(self, count: int) -> List[str]:
        names = self.class_names
        return list(names) if names is not None and len(names) == count else [f'class_{i}' for i in range(count)]

    @torch.no_grad()
    def save_pictures(self, model: nn.Module, dataset: Dataset, class_names: List[str], png_path: str,
                      mean: Sequence[float], std: Sequence[float], device: torch.device, autocast: Any) -> None:
        indices = picture_indices(len(dataset), PICTURE_COUNT)
        images, masks, predictions = [], [], []
        for index in indices:
            image, mask = dataset[(index, 0)]
            with autocast():
                logits = self.predict(model, image[None].to(device))
            images.append(image)
            masks.append(mask)
            predictions.append(class_ids(logits[0], dim=0).cpu())
        # a dataset may bring colours that match its class names (the built-in shapes: red-key in red)
        plot_segmentation_grid(images, mean, std, masks, predictions, class_names, png_path,
                               ignore_index=self.cfg.data.ignore_index, max_images=len(indices),
                               palette=getattr(dataset, 'palette', None))

    def plot_evaluation(self, meter: Meter, class_names: List[str], png_path: str) -> bool:
        """The pixel confusion matrix of the evaluation (rows: ground truth, columns: prediction; a row's colours
        are fractions of that class's pixels, the diagonal its recall)."""
        if not isinstance(meter, SegmentationMeter):
            return False
        names = class_names if class_names is not None and len(class_names) == meter.num_classes \
            else self._class_names(meter.num_classes)
        plot_confusion_matrix(meter.confusion().cpu(), names, png_path)
        return True
