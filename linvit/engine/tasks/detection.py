"""Object detection: COCO-format or built-in data, a ViT + simple feature pyramid under torchvision's detectors
(ViTDet's recipe: ``linvit.models.detection``), COCO box AP.

Training runs on ``data.img_size`` squares (the longer side resized, large-scale jitter by ``data.aug.scale_range``,
a random crop, flips: ``linvit.data.detection``); the detector computes its own losses from the targets
(``takes_targets``), and the loss is their sum. Evaluation resizes the longer side to ``data.img_size`` and scores
the detections with pycocotools (``DetectionMeter``): AP, AP50, AP75, by object size and per class; Mask R-CNN's
masks the same way (``mask_ap``, ...).
"""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from omegaconf import DictConfig
from torch.utils.data import Dataset

from ..config import ConfigError, config_choice, config_section
from ..metrics import COCO_BOX_METRICS, MASK_PREFIX, DetectionMeter
from .base import Task, create_model_from_config, register_task

__all__ = ['DetectionTask', 'DetectionConfig', 'summed_losses']

#: validation images drawn in each evaluation's picture
PICTURE_COUNT = 4


@dataclass
class DetectionConfig:
    """The ``detection`` section of every run config (task=detection): the detector and its outputs."""
    detector: str = 'faster_rcnn'  # torchvision's detector on the pyramid (linvit.models.detection.DETECTORS);
    # mask_rcnn also learns instance masks: its data loads them (COCO segmentations) and evaluation adds mask AP
    neck_dim: int = 128  # channels of every feature-pyramid level
    feature_blocks: List[int] = field(default_factory=list)  # backbone blocks feeding the pyramid ([]: 4 evenly spaced)
    score_thresh: float = 0.05  # detections scored below this are not returned
    detections_per_image: int = 100  # at most this many detections per image (COCO's AP counts 100)


#: the detectors that learn instance masks: their data loads masks and evaluation adds mask AP
MASK_DETECTORS = ('mask_rcnn',)

config_section('detection', DetectionConfig)
config_choice('detection.detector', ('faster_rcnn', 'mask_rcnn', 'retinanet', 'fcos'))


def summed_losses(losses: Dict[str, torch.Tensor], targets: Any) -> torch.Tensor:
    """The training loss of a torchvision detector: the sum of the losses it returns (classification, box
    regression, the RPN's objectness and boxes, ...)."""
    return sum(losses.values())


def _detector_kwargs(detector: str, cfg: DictConfig) -> Dict[str, Any]:
    """The score threshold and detection count under each detector's own keyword names."""
    if detector in ('faster_rcnn', 'mask_rcnn'):
        return {'box_score_thresh': cfg.score_thresh, 'box_detections_per_img': cfg.detections_per_image}
    return {'score_thresh': cfg.score_thresh, 'detections_per_img': cfg.detections_per_image}


@register_task
class DetectionTask(Task):
    name = 'detection'
    main_metric = 'ap'
    metric_columns = ('ap', 'ap50', 'ap75')
    architecture_keys = ('detection.detector', 'detection.neck_dim', 'detection.feature_blocks')
    predicts_boxes = True

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        if cfg.train.compile:
            raise ConfigError("task=detection trains eagerly: torchvision's detectors choose their proposals and "
                              "boxes by data-dependent shapes, which one compiled graph cannot hold; set "
                              "train.compile=false")
        if cfg.data.cache:
            raise ConfigError("data.cache=true does not serve task=detection: the decoded-image cache stores images "
                              "stretched to one size for batched augmentation on the device, while detection's "
                              "box-aware jitter keeps each image's aspect and runs per sample; set data.cache=false "
                              "(data.num_workers decode in parallel)")
        self.class_names: Optional[List[str]] = None

    def build_datasets(self, mean: Sequence[float], std: Sequence[float],
                       with_train: bool = True) -> Tuple[Optional[Dataset], Dataset, List[str]]:
        from ...data.detection import build_detection_datasets  # here: albumentations is a heavy import
        train, val, self.class_names = build_detection_datasets(self.cfg.data, mean, std, with_train,
                                                                masks=self.cfg.detection.detector in MASK_DETECTORS)
        return train, val, self.class_names

    def build_model(self, num_classes: int) -> nn.Module:
        from ...models.detection import build_detector  # torchvision's detection models: imported when used
        det = self.cfg.detection
        backbone = create_model_from_config(self.cfg.model, num_classes=0, img_size=self.cfg.data.img_size,
                                            extra_kwargs={'dynamic_img_size': True})
        return build_detector(backbone, num_classes, det.detector, det.neck_dim, list(det.feature_blocks),
                              **_detector_kwargs(det.detector, det))

    def train_loss(self) -> Callable[[Dict[str, torch.Tensor], Any], torch.Tensor]:
        return summed_losses

    def new_meter(self, device: torch.device) -> DetectionMeter:
        return DetectionMeter(self.class_names or [])

    def describe_evaluation(self) -> str:
        return f"validation images with the longer side at {self.cfg.data.img_size} px, COCO box AP"

    def evaluate_batch(self, model: nn.Module, images: torch.Tensor, targets: List[Dict[str, torch.Tensor]],
                       meter: DetectionMeter) -> None:
        meter.update(model(images), targets)

    def final_metrics(self, computed: Dict[str, Any]) -> Dict[str, Any]:
        # COCO has no AP where there is nothing to average (no object of a size): null in JSON, not NaN
        def plain(value: float) -> Optional[float]:
            return None if value != value else value
        prefixes = ('', MASK_PREFIX) if MASK_PREFIX + 'ap' in computed else ('',)
        metrics: Dict[str, Any] = {}
        for prefix in prefixes:  # boxes, and masks when the detector has them
            metrics.update({prefix + name: plain(computed[prefix + name]) for name in COCO_BOX_METRICS})
            metrics[prefix + 'per_class_ap'] = {name: plain(value)
                                                for name, value in computed[prefix + 'per_class_ap'].items()}
        metrics['images'] = computed['images']
        return metrics

    @torch.no_grad()
    def save_pictures(self, model: nn.Module, dataset: Dataset, class_names: List[str], png_path: str,
                      mean: Sequence[float], std: Sequence[float], device: torch.device, autocast: Any) -> None:
        from ..plots import plot_detection_grid
        count = min(PICTURE_COUNT, len(dataset))
        samples = [dataset[(round(i * (len(dataset) - 1) / max(count - 1, 1)), 0)] for i in range(count)]
        images = torch.stack([image for image, _ in samples])
        with autocast():
            found = model(images.to(device))
        plot_detection_grid(images, mean, std, [target for _, target in samples],
                            [{key: value.cpu() for key, value in result.items()} for result in found],
                            class_names, png_path)
