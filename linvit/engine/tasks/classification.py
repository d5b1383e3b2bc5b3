"""Image classification: ImageFolder or built-in data, any timm / linvit classifier, top-1 / top-5."""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch.utils.data import Dataset

from ..metrics import ClassificationMeter, Meter
from ..plots import plot_confusion_matrix, plot_prediction_grid
from .base import Task, create_model_from_config, picture_indices, register_task

__all__ = ['ClassificationTask']

PICTURE_COUNT = 16
#: the evaluation keeps a confusion matrix up to this many classes: C x C int64 counters, 8 MB at 1000 classes,
#: summed over processes (ImageNet-21k's 21841 classes would take 3.8 GB)
CONFUSION_UP_TO = 1000


@register_task
class ClassificationTask(Task):
    name = 'classification'
    main_metric = 'top1'
    metric_columns = ('top1', 'top5')
    classifier_key = 'head.weight'
    logits_rank = 2
    non_square = True  # data.img_size [height, width]: the model is built at (H, W), an H/p x W/p patch grid

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        self.num_classes: Optional[int] = None   # known from build_model (the classifier's width)

    def build_datasets(self, mean: Sequence[float], std: Sequence[float],
                       with_train: bool = True) -> Tuple[Optional[Dataset], Dataset, List[str]]:
        from ...data import build_classification_datasets  # here: albumentations is a heavy import
        return build_classification_datasets(self.cfg.data, mean, std, with_train)

    def build_model(self, num_classes: int) -> nn.Module:
        self.num_classes = num_classes   # the logits' width (config refuses model.kwargs.num_classes): sizes the meter
        return create_model_from_config(self.cfg.model, num_classes, self.cfg.data.img_size)

    def _mixing(self) -> bool:
        aug = self.cfg.data.aug
        return aug.mixup > 0 or aug.cutmix > 0

    def train_loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        smoothing = self.cfg.data.aug.label_smoothing
        if self._mixing():
            return SoftTargetCrossEntropy()  # Mixup turns labels into smoothed soft targets
        if smoothing > 0:
            return LabelSmoothingCrossEntropy(smoothing=smoothing)
        return nn.CrossEntropyLoss()

    def batch_mixer(self, num_classes: int) -> Optional[Callable]:
        if not self._mixing():
            return None
        aug = self.cfg.data.aug
        return Mixup(mixup_alpha=aug.mixup, cutmix_alpha=aug.cutmix, label_smoothing=aug.label_smoothing,
                     num_classes=num_classes)

    def new_meter(self, device: torch.device) -> ClassificationMeter:
        confusion = self.num_classes is not None and self.num_classes <= CONFUSION_UP_TO
        return ClassificationMeter(ks=(1, 5), device=device, num_classes=self.num_classes if confusion else None)

    def evaluate_batch(self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
                       meter: ClassificationMeter) -> None:
        logits = model(images).float()
        meter.update(logits, targets, F.cross_entropy(logits, targets, reduction='sum'))

    def final_metrics(self, computed: Dict[str, float]) -> Dict[str, float]:
        return {'top1': computed['top1'], 'top5': computed['top5'], 'loss': computed['loss'],
                'count': computed['count']}

    @torch.no_grad()
    def save_pictures(self, model: nn.Module, dataset: Dataset, class_names: List[str], png_path: str,
                      mean: Sequence[float], std: Sequence[float], device: torch.device, autocast: Any) -> None:
        # evenly spread over the set: folder datasets are sorted by class, so the first images share one class
        indices = picture_indices(len(dataset), PICTURE_COUNT)
        samples = [dataset[(index, 0)] for index in indices]
        images = torch.stack([image for image, _ in samples])
        labels = torch.tensor([label for _, label in samples])
        with autocast():
            probs = model(images.to(device)).float().softmax(dim=-1).cpu()
        plot_prediction_grid(images, mean, std, labels, probs.argmax(dim=-1), class_names, png_path, probs=probs,
                             max_images=len(indices))

    def plot_evaluation(self, meter: Meter, class_names: List[str], png_path: str) -> bool:
        """The confusion matrix of the evaluation (rows: true class, columns: top-1 prediction); False when the
        meter kept none (built before ``build_model``, or more than ``CONFUSION_UP_TO`` classes)."""
        if not isinstance(meter, ClassificationMeter) or meter.num_classes is None:
            return False
        plot_confusion_matrix(meter.confusion(), class_names, png_path)
        return True
