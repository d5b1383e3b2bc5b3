"""Monocular depth: image/depth-map folders or the built-in ground-plane scenes, a ViT + feature pyramid + dense head
regressing log depth, the NYU/KITTI metrics.

The model is a ``SegmentationModel`` with one output channel, built from the ``seg`` section as segmentation builds
it (``seg.head``: dpt by default in the depth configs, any head of ``linvit.models.SEG_HEADS``; ``seg.neck_dim``,
``seg.head_dim``, ``seg.feature_blocks``) and evaluated the same way (``seg.eval``: whole images, or sliding windows
whose outputs are averaged). Its output is the log of the target: metres (``depth.target=depth``) or inverse metres
(``depth.target=disparity``), so the prediction exp(output) is positive and the scale-invariant log loss (SILog,
``depth.loss=silog``, as BTS, AdaBins and Depth Anything train) reads it directly; ``depth.loss=l1`` is the mean
absolute error of exp(output). Pixels whose depth is 0, NaN, inf or beyond ``data.max_depth`` count in no loss or
metric. Metrics (``linvit.engine.depth``): AbsRel, SqRel, RMSE, RMSE log, log10 and delta < 1.25^i per image over its
valid pixels, averaged over images, on the target space; ``depth.align=true`` adds the same metrics after a
least-squares scale and shift per image (MiDaS's affine-invariant evaluation), under ``aligned_*`` keys.
``tools/predict.py`` writes a run's depth maps at each image's full size (``linvit.predict.depth_images``): the task
declares ``predicts_values`` and says in ``prediction_defaults()['values']`` what they are and how a 16-bit PNG stores
them (value / data.depth_scale).
"""
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from ..config import config_choice, config_section
from ..depth import DEPTH_LOSSES, DepthMeter, valid_depth
from ..metrics import Meter
from .base import picture_indices, register_task
from .segmentation import SegmentationTask, create_segmentation_model

__all__ = ['DepthTask', 'DepthConfig', 'DepthLoss', 'to_target_space']

PICTURE_COUNT = 4


@dataclass
class DepthConfig:
    """The ``depth`` section (task=depth); the model and its evaluation come from ``seg``."""
    target: str = 'depth'  # what the model predicts and the metrics read: 'depth' (metres) or 'disparity' (1/metres)
    loss: str = 'silog'  # linvit.engine.depth.DEPTH_LOSSES: silog (scale-invariant log loss) or l1
    align: bool = False  # also report the metrics after a least-squares scale and shift per image (aligned_* keys)


config_section('depth', DepthConfig)
config_choice('depth.target', ('depth', 'disparity'))
config_choice('depth.loss', DEPTH_LOSSES)


def to_target_space(depth: torch.Tensor, target: str, max_depth: Optional[float] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(values, valid) of depth maps [B, H, W] in metres (0 where unknown) in the space the model predicts: metres,
    or their inverse for ``target='disparity'``; invalid pixels hold 1.0 (never read: ``valid`` is False there)."""
    valid = valid_depth(depth, max_depth)
    safe = torch.where(valid, depth, torch.ones_like(depth))
    return (safe.reciprocal() if target == 'disparity' else safe), valid


class DepthLoss(nn.Module):
    """outputs [B, 1, H, W] (log of the target space), depth maps [B, H, W] in metres -> 0-dim loss over the batch's
    valid pixels (``depth.loss``)."""

    def __init__(self, loss: str = 'silog', target: str = 'depth', max_depth: Optional[float] = None) -> None:
        super().__init__()
        self.loss = DEPTH_LOSSES.get(loss)
        self.target, self.max_depth = target, max_depth

    def forward(self, outputs: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        values, valid = to_target_space(depth.float(), self.target, self.max_depth)
        return self.loss(outputs[:, 0].float(), values, valid)


@register_task
class DepthTask(SegmentationTask):
    """task=depth: the segmentation model's architecture and evaluation, one output channel, depth losses and
    metrics."""
    name = 'depth'
    main_metric = 'delta1'
    metric_columns = ('abs_rel', 'rmse', 'delta1')
    # values, not labels: no per-pixel cross-entropy for context parallelism; prediction writes maps of values
    logits_rank = 0
    predicts_values = True

    def build_datasets(self, mean: Sequence[float], std: Sequence[float],
                       with_train: bool = True) -> Tuple[Optional[Dataset], Dataset, List[str]]:
        from ...data.depth import build_depth_datasets  # here: albumentations is a heavy import
        train, val, names = build_depth_datasets(self.cfg.data, mean, std, with_train)
        if train is not None:
            self._warn_small_images(train)
        self.class_names = names
        return train, val, names

    def build_model(self, num_classes: int) -> nn.Module:
        self.num_classes = 1
        return create_segmentation_model(self.cfg.model, self.cfg.seg, 1, self.cfg.data.img_size)

    def train_loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        depth = self.cfg.depth
        return DepthLoss(depth.loss, depth.target, self.cfg.data.max_depth)

    def new_meter(self, device: torch.device) -> DepthMeter:
        return DepthMeter(aligned=self.cfg.depth.align, device=device)

    def describe_evaluation(self) -> str:
        return super().describe_evaluation() + f", {self.cfg.depth.target} metrics"

    def prediction_defaults(self) -> Dict[str, Any]:
        """seg.eval's mode, window and stride, and the values: depth in metres or disparity in 1/metres
        (``depth.target``); a 16-bit PNG stores value / data.depth_scale (the integer files' 0.001 when null), so it
        reads back as the run's training maps do."""
        from ...data.depth import INTEGER_DEPTH_SCALE  # here: albumentations is a heavy import
        target, scale = self.cfg.depth.target, self.cfg.data.depth_scale
        values = {'name': target, 'unit': 'm' if target == 'depth' else '1/m',
                  'png_scale': INTEGER_DEPTH_SCALE if scale is None else float(scale),
                  'larger_is_nearer': target == 'disparity'}
        return {**super().prediction_defaults(), 'values': values}

    def predict_target(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """The predicted depth (or disparity) [B, H, W] float32 of images [B, 3, H, W], as ``seg.eval`` says."""
        return self.predict(model, images)[:, 0].exp()

    def evaluate_batch(self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
                       meter: Meter) -> None:
        outputs = self.predict(model, images)  # [B, 1, H, W]: log of the target space
        values, valid = to_target_space(targets.float(), self.cfg.depth.target, self.cfg.data.max_depth)
        loss = DEPTH_LOSSES.get(self.cfg.depth.loss)
        loss_sum = sum(loss(outputs[i:i + 1, 0], values[i:i + 1], valid[i:i + 1]) for i in range(len(outputs)))
        meter.update(outputs[:, 0].exp(), values, valid, loss_sum)

    def final_metrics(self, computed: Dict[str, Any]) -> Dict[str, Any]:
        # no image with a valid pixel: NaN means, null in JSON
        return {key: (None if isinstance(value, float) and math.isnan(value) else value)
                for key, value in computed.items()}

    @torch.no_grad()
    def save_pictures(self, model: nn.Module, dataset: Dataset, class_names: List[str], png_path: str,
                      mean: Sequence[float], std: Sequence[float], device: torch.device, autocast: Any) -> None:
        from ..plots import plot_depth_grid
        indices = picture_indices(len(dataset), PICTURE_COUNT)
        images, truths, predictions = [], [], []
        for index in indices:
            image, depth = dataset[(index, 0)]
            with autocast():
                predicted = self.predict_target(model, image[None].to(device))
            values, valid = to_target_space(depth[None].float(), self.cfg.depth.target, self.cfg.data.max_depth)
            images.append(image)
            truths.append(torch.where(valid, values, torch.full_like(values, float('nan')))[0])
            predictions.append(predicted[0].float().cpu())
        plot_depth_grid(images, mean, std, truths, predictions, png_path, label=self.cfg.depth.target)

    def plot_evaluation(self, meter: Meter, class_names: List[str], png_path: str) -> bool:
        return False
