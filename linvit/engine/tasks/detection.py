"""Object detection: COCO-format or built-in data, a ViT + simple feature pyramid under torchvision's detectors
(ViTDet's recipe: ``linvit.models.detection``), COCO box AP.

Training runs on ``data.img_size`` squares (the longer side resized, large-scale jitter by ``data.aug.scale_range``,
a random crop, flips: ``linvit.data.detection``); the detector computes its own losses from the targets
(``takes_targets``), and the loss is their sum. Evaluation resizes the longer side to ``data.img_size`` and scores
the detections with pycocotools (``DetectionMeter``): AP, AP50, AP75, by object size and per class; Mask R-CNN's
masks the same way (``mask_ap``, ...). A COCO-format set is scored against its annotation file itself: the
detections are mapped back to each image's own pixels (``linvit.data.detection.to_original_pixels``) and COCOeval
reads the file's crowds (ignore regions), 'area' fields and ids, so the numbers are what pycocotools gives for the
file and those detections. ``detection.detections_per_image`` is both the detector's cap per image and COCOeval's
maxDets[-1].

The set's category ids: label i is category ``detection.category_ids[i - 1]``. For a COCO-format set the key
defaults to the ids of its val annotation file (an OmegaConf resolver, ``coco_category_ids``, read when the config
is resolved), so the run's config.yaml and checkpoints record them; the data read later must have those ids, and
prediction writes detections.json in them (``prediction_defaults``). The built-in shapes keep 1..K.
"""
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from omegaconf import II, DictConfig, OmegaConf
from torch.utils.data import Dataset

from ...data import image_size
from ..config import ConfigError, config_choice, config_section
from ..metrics import COCO_BOX_METRICS, MASK_PREFIX, DetectionMeter
from .base import Task, create_model_from_config, picture_indices, register_task

__all__ = ['DetectionTask', 'DetectionConfig', 'summed_losses']

#: validation images drawn in each evaluation's picture
PICTURE_COUNT = 4


#: the OmegaConf resolver that gives detection.category_ids its default: a COCO-format set's category ids
CATEGORY_IDS_RESOLVER = 'linvit.coco_category_ids'


def coco_category_ids(data_name: str, root: Optional[str]) -> List[int]:
    """The category ids, in increasing order, of the val annotation file of the COCO-format set at ``root`` when
    ``data_name`` is 'folder'; [] otherwise, and for a file that is not there or does not read (``build_datasets``
    reports it, with its layout)."""
    if data_name != 'folder' or not root:
        return []
    from ...data import DataError
    from ...data.coco import annotation_file, read_coco_categories
    path = annotation_file(os.path.expanduser(str(root)), 'val')
    try:
        return [category_id for category_id, _ in read_coco_categories(path)] if path.is_file() else []
    except DataError:
        return []


def _register_resolver(name: str, resolver: Callable[..., Any]) -> None:
    """omegaconf 2.4 calls register_new_resolver register_resolver (2.3's register_resolver is the old string-only
    form)."""
    modern = 'annotation_validation' in inspect.signature(OmegaConf.register_resolver).parameters
    (OmegaConf.register_resolver if modern else OmegaConf.register_new_resolver)(name, resolver, replace=True)


_register_resolver(CATEGORY_IDS_RESOLVER, coco_category_ids)


@dataclass
class DetectionConfig:
    """The ``detection`` section of every run config (task=detection): the detector and its outputs."""
    detector: str = 'faster_rcnn'  # torchvision's detector on the pyramid (linvit.models.detection.DETECTORS);
    # mask_rcnn also learns instance masks: its data loads them (COCO segmentations) and evaluation adds mask AP
    neck_dim: int = 128  # channels of every feature-pyramid level
    feature_blocks: List[int] = field(default_factory=list)  # backbone blocks feeding the pyramid ([]: 4 evenly spaced)
    score_thresh: float = 0.05  # detections scored below this are not returned
    detections_per_image: int = 100  # the detector keeps at most this many detections per image, and COCOeval's AP
    # counts at most this many per image and class (its maxDets[-1]; COCO's is 100)
    category_ids: List[int] = II(f'{CATEGORY_IDS_RESOLVER}:${{data.name}},${{data.root}}')  # the data set's
    # category id of each label (label i is category_ids[i - 1]); by default a COCO-format set's own (its val
    # annotation file's, recorded in config.yaml), [] for the built-in shapes: 1..K


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
        if cfg.detection.detections_per_image < 1:
            raise ConfigError(f"detection.detections_per_image={cfg.detection.detections_per_image}: the detector "
                              f"keeps and COCOeval counts at least 1 detection per image (COCO's count is 100)")
        self.class_names: Optional[List[str]] = None
        self.annotation_file: Optional[str] = None  # a COCO-format val set's: evaluation scores against it

    def build_datasets(self, mean: Sequence[float], std: Sequence[float],
                       with_train: bool = True) -> Tuple[Optional[Dataset], Dataset, List[str]]:
        from ...data.detection import build_detection_datasets  # here: albumentations is a heavy import
        train, val, self.class_names = build_detection_datasets(self.cfg.data, mean, std, with_train,
                                                                masks=self.cfg.detection.detector in MASK_DETECTORS)
        self._check_category_ids(val)
        self.annotation_file = val.annotation_file
        return train, val, self.class_names

    def _check_category_ids(self, val: Any) -> None:
        """DataError unless a COCO-format set's category ids are detection.category_ids (a label must mean the
        category the run's config records for it)."""
        recorded = list(self.cfg.detection.category_ids)
        if val.annotation_file and recorded != val.category_ids:
            from ...data import DataError
            raise DataError(f"{val.annotation_file} has category ids {val.category_ids}, but "
                            f"detection.category_ids={recorded} (the ids the run's labels stand for); use data with "
                            f"those categories, or a new run on this set")

    def build_model(self, num_classes: int) -> nn.Module:
        from ...models.detection import build_detector  # torchvision's detection models: imported when used
        det = self.cfg.detection
        backbone = create_model_from_config(self.cfg.model, num_classes=0, img_size=self.cfg.data.img_size,
                                            extra_kwargs={'dynamic_img_size': True})
        return build_detector(backbone, num_classes, det.detector, det.neck_dim, list(det.feature_blocks),
                              **_detector_kwargs(det.detector, det))

    def train_loss(self) -> Callable[[Dict[str, torch.Tensor], Any], torch.Tensor]:
        return summed_losses

    def prediction_defaults(self) -> Dict[str, Any]:
        """The data set's category id of each label, for detections.json (none recorded: 1..K)."""
        ids = list(self.cfg.detection.category_ids)
        return {'category_ids': ids} if ids else {}

    def new_meter(self, device: torch.device) -> DetectionMeter:
        ids = list(self.cfg.detection.category_ids) if self.annotation_file else None
        return DetectionMeter(self.class_names or [], self.cfg.detection.detections_per_image, self.annotation_file,
                              ids)

    def describe_evaluation(self) -> str:
        against = (f", COCOeval against {self.annotation_file} (detections in each image's own pixels)"
                   if self.annotation_file else ", COCO box AP")
        return f"validation images with the longer side at {self.cfg.data.img_size} px{against}"

    def evaluate_batch(self, model: nn.Module, images: torch.Tensor, targets: List[Dict[str, torch.Tensor]],
                       meter: DetectionMeter) -> None:
        found = model(images)
        if self.annotation_file:  # scored in the annotation file's pixels
            from ...data.detection import to_original_pixels
            size = image_size(self.cfg.data.img_size)[0]
            found = [to_original_pixels(image, *(int(v) for v in target['orig_size']), size)
                     for image, target in zip(found, targets)]
        meter.update(found, targets)

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
        samples = [dataset[(index, 0)] for index in picture_indices(len(dataset), PICTURE_COUNT)]
        images = torch.stack([image for image, _ in samples])
        with autocast():
            found = model(images.to(device))
        plot_detection_grid(images, mean, std, [target for _, target in samples],
                            [{key: value.cpu() for key, value in result.items()} for result in found],
                            class_names, png_path)
