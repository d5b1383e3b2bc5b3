"""Object detection data: samples ``(image float32 [3, H, W], {'boxes': float32 [N, 4] x1, y1, x2, y2 pixels,
'labels': int64 [N] 1..K})`` for torchvision's detectors (``linvit.models.detection``), from a COCO-format set
(``CocoDetectionSet``, ``linvit.data.coco``) or the built-in shapes (``SyntheticShapesDetection``). A set made with
``masks=True`` adds each object's instance mask, ``'masks': uint8 [N, H, W]`` (Mask R-CNN's targets), transformed
with the image and kept or dropped with its box.

Augmentation is albumentations' with its box parameters (``A.BboxParams`` in pixels, boxes clipped to the image and
dropped only when the crop leaves none of them): training resizes the longer side to ``img_size``, applies ViTDet's
large-scale jitter (a random rescale by ``scale_range``, then a random ``img_size`` crop of the padded result) and a
horizontal flip; evaluation only resizes the longer side and pads to a square at the bottom and the right, so a
detection maps back to the original image by the resize's scale in each axis (``evaluation_size``,
``to_original_pixels``).

A COCO set's targets also carry the image's id in its annotation file, 'image_id' (int64 []), and its size there,
'orig_size' (int64 [2]: height, width): evaluation scores the detections, mapped back to those pixels, against the
annotation file itself (``linvit.engine.metrics.coco_file_metrics``). COCO's crowd regions (``iscrowd``) are not
objects to find: they are left out of the training targets, as torchvision's reference scripts do, and stay in the
annotation file that evaluation reads, where COCOeval ignores the detections that fall on them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import albumentations as A
import cv2
import numpy as np
import torch
from albumentations.pytorch import ToTensorV2

from ..registry import Registry
from .base import KeyedImageDataset, sample_seed, seed_transform, seed_words
from .coco import CocoSplit, check_same_categories, instance_masks, read_coco_split
from .folder import load_rgb
from .synthetic_seg import SHAPE_KINDS, ShapesLayout, render_shapes, shape_pixels

__all__ = ['build_detection_transforms', 'KeyedDetectionDataset', 'CocoDetectionSet', 'SyntheticShapesDetection',
           'DETECTION_SHAPE_CLASSES', 'DETECTION_DATASET_BUILDERS', 'build_detection_datasets', 'evaluation_size',
           'to_original_pixels']

Target = dict[str, torch.Tensor]

#: the built-in set's classes (label i names entry i - 1): a shape's kind
DETECTION_SHAPE_CLASSES = list(SHAPE_KINDS)
#: ViTDet's large-scale jitter: the image is rescaled by a factor drawn from this range before the crop
DEFAULT_SCALE_RANGE = (0.1, 2.0)


def build_detection_transforms(img_size: int, mean: Sequence[float], std: Sequence[float], train: bool,
                               scale_range: Sequence[float] = DEFAULT_SCALE_RANGE, hflip: float = 0.5) -> A.Compose:
    """The albumentations pipeline of a split (module docstring): images to normalised float tensors [3, S, S],
    boxes (pascal_voc: x1, y1, x2, y2 pixels) and their ``labels`` carried along."""
    low, high = scale_range
    jitter = [A.RandomScale(scale_limit=(low - 1.0, high - 1.0), p=1.0)] if train else []
    crop = [A.RandomCrop(img_size, img_size), A.HorizontalFlip(p=hflip)] if train else []
    steps = [A.LongestMaxSize(max_size=img_size), *jitter,
             A.PadIfNeeded(img_size, img_size, position='top_left', border_mode=cv2.BORDER_CONSTANT, fill=0,
                           fill_mask=0),
             *crop, A.Normalize(mean=mean, std=std), ToTensorV2()]
    # 'objects' numbers the boxes, so that the masks of the boxes a crop drops are dropped with them
    return A.Compose(steps, bbox_params=A.BboxParams(format='pascal_voc', label_fields=['labels', 'objects'],
                                                     clip=True, min_area=1.0))


def evaluation_size(height: int, width: int, img_size: int) -> tuple[int, int]:
    """(height, width) of a height x width image after evaluation's resize of its longer side to ``img_size``,
    before the padding: albumentations' ``LongestMaxSize`` rounding."""
    scale = img_size / max(height, width)
    return max(1, round(height * scale)), max(1, round(width * scale))


def to_original_pixels(found: Target, height: int, width: int, img_size: int) -> Target:
    """One image's detections on its evaluation input (``build_detection_transforms(train=False)`` at ``img_size``)
    in the pixels of the height x width original: 'boxes' [N, 4] scaled in each axis by original / resized (float64
    on the way, so a box maps back as exactly as the resize mapped it), 'masks' [N, 1, S, S] probabilities cropped to
    the resized part and resized bilinearly to [N, 1, height, width]; 'labels' and 'scores' as they are."""
    resized_h, resized_w = evaluation_size(height, width, img_size)
    scale = torch.tensor([width / resized_w, height / resized_h] * 2, dtype=torch.float64, device=found['boxes'].device)
    mapped = {**found, 'boxes': (found['boxes'].double() * scale).to(found['boxes'].dtype)}
    if 'masks' in found:
        masks = found['masks'][:, :, :resized_h, :resized_w].float()
        mapped['masks'] = (torch.nn.functional.interpolate(masks, size=(height, width), mode='bilinear',
                                                           align_corners=False) if len(masks) else
                           masks.new_zeros(0, 1, height, width))
    return mapped


class KeyedDetectionDataset(KeyedImageDataset):
    """Base class: ``dataset[key] -> (image float32 [3, S, S], {'boxes': float32 [N, 4], 'labels': int64 [N]})``
    for ``key`` = index or (index, seed); the transform is seeded by ``sample_seed(index, seed)`` as for the other
    tasks. Subclasses implement ``load(index) -> (image uint8 [H, W, 3], boxes float32 [N, 4] xyxy pixels, labels
    int64 [N] 1..K, masks uint8 [N, H, W] or None)`` and ``describe()``; ``masks``: they load the masks and the
    targets carry them. ``annotation_file``: the COCO file the set was read from (None: the targets are the whole
    ground truth), ``category_ids``: the category id of each label (label i is category_ids[i - 1])."""

    annotation_file: str | None = None

    def __init__(self, transform: A.Compose, class_names: Sequence[str], num_samples: int, masks: bool = False
                 ) -> None:
        super().__init__(transform, class_names, targets=())
        self.num_samples = int(num_samples)
        self.masks = bool(masks)
        self.category_ids = list(range(1, len(class_names) + 1))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        index, seed = self._parse_key(key)
        image, boxes, labels, masks = self.load(index)
        seed_transform(self.transform, sample_seed(index, seed))
        extra = {} if masks is None else {'masks': list(masks)}
        out = self.transform(image=image, bboxes=boxes, labels=labels, objects=np.arange(len(boxes)), **extra)
        target = {'boxes': torch.as_tensor(np.asarray(out['bboxes'], dtype=np.float32).reshape(-1, 4)),
                  'labels': torch.as_tensor(np.asarray(out['labels'], dtype=np.int64).reshape(-1))}
        if masks is not None:
            kept = np.asarray(out['objects'], dtype=np.int64).reshape(-1)
            all_masks = torch.stack([torch.as_tensor(m) for m in out['masks']]) if len(out['masks']) else \
                torch.zeros(0, *out['image'].shape[-2:], dtype=torch.uint8)
            target['masks'] = all_masks[torch.as_tensor(kept)].to(torch.uint8)
        return out['image'], {**target, **self.identity(index)}

    def identity(self, index: int) -> Target:
        """What a target carries besides its objects (a COCO set: the image's id and size in its annotation file)."""
        return {}

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        raise NotImplementedError

    @staticmethod
    def collate(samples: Sequence[tuple[torch.Tensor, Target]]) -> tuple[torch.Tensor, list[Target]]:
        """A loader batch: images stacked [B, 3, S, S], targets a list (each image has its own number of boxes)."""
        return torch.stack([image for image, _ in samples]), [target for _, target in samples]

    @staticmethod
    def on_device(batch: tuple[torch.Tensor, list[Target]], device: torch.device
                  ) -> tuple[torch.Tensor, list[Target]]:
        images, targets = batch
        return images.to(device, non_blocking=True), [{key: value.to(device, non_blocking=True)
                                                       for key, value in target.items()} for target in targets]


class CocoDetectionSet(KeyedDetectionDataset):
    """A split read by ``linvit.data.coco.read_coco_split`` (with ``masks=True`` for a set that loads masks); crowd
    regions left out of the targets."""

    def __init__(self, split: CocoSplit, transform: A.Compose, masks: bool = False) -> None:
        super().__init__(transform, split.class_names, len(split.images), masks)
        self.split = split
        self.annotation_file = split.annotation_file or None
        self.category_ids = list(split.category_ids)

    def identity(self, index: int) -> Target:
        """'image_id' (int64 []) and 'orig_size' (int64 [2]: height, width), as the annotation file gives them."""
        entry = self.split.images[index]
        return {'image_id': torch.tensor(entry.image_id, dtype=torch.int64),
                'orig_size': torch.tensor([entry.height, entry.width], dtype=torch.int64)}

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        entry = self.split.images[index]
        objects = ~entry.crowd
        masks = instance_masks(entry, objects) if self.masks else None
        return load_rgb(entry.path), entry.boxes[objects], entry.labels[objects], masks

    def describe(self) -> str:
        boxes = sum(int((~image.crowd).sum()) for image in self.split.images)
        return f"COCO-format detection: {len(self)} images, {boxes} boxes, {len(self.class_names)} classes"


class SyntheticShapesDetection(KeyedDetectionDataset):
    """``num_samples`` images of ``img_size`` px with 2-4 grey circles and squares on a noisy background (and a
    coloured square near the border that is no object): each shape is boxed and labelled by its kind
    (``DETECTION_SHAPE_CLASSES``). A sample is a pure function of (seed, split, index)."""

    def __init__(self, num_samples: int, img_size: int, seed: int, split: str, transform: A.Compose,
                 masks: bool = False) -> None:
        super().__init__(transform, DETECTION_SHAPE_CLASSES, num_samples, masks)
        self.img_size = int(img_size)
        self.seed = int(seed)
        self.split_id = {'train': 0, 'val': 1}[split]

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        rng = np.random.default_rng([*seed_words(self.seed), self.split_id, index])
        image, _, layout = render_shapes(rng, self.img_size, key_colour=int(rng.integers(2)))
        boxes = np.array([[s.left, s.top, s.left + s.side, s.top + s.side] for s in layout.shapes],
                         dtype=np.float32).reshape(-1, 4)
        labels = np.array([s.kind + 1 for s in layout.shapes], dtype=np.int64)
        return image, boxes, labels, self._masks(layout) if self.masks else None

    def _masks(self, layout: ShapesLayout) -> np.ndarray:
        """Each shape's pixels (the ones ``render_shapes`` painted), uint8 [N, S, S]."""
        masks = np.zeros((len(layout.shapes), self.img_size, self.img_size), dtype=np.uint8)
        for mask, shape in zip(masks, layout.shapes):
            mask[shape.top:shape.top + shape.side, shape.left:shape.left + shape.side] = shape_pixels(shape.side,
                                                                                                     shape.kind)
        return masks

    def describe(self) -> str:
        return f"built-in shapes detection: {len(self)} images of {self.img_size} px, classes {self.class_names}"


Datasets = tuple[KeyedDetectionDataset | None, KeyedDetectionDataset, list[str]]


def _transforms(cfg: Any, mean: Sequence[float], std: Sequence[float]) -> tuple[A.Compose, A.Compose]:
    """(train, val) pipelines from ``data.img_size`` and ``data.aug.{scale_range, hflip}``."""
    train = build_detection_transforms(cfg.img_size, mean, std, train=True, scale_range=tuple(cfg.aug.scale_range),
                                       hflip=cfg.aug.hflip)
    return train, build_detection_transforms(cfg.img_size, mean, std, train=False)


def build_detection_synthetic(cfg: Any, mean: Sequence[float], std: Sequence[float], with_train: bool = True,
                              masks: bool = False) -> Datasets:
    """The built-in shapes detection set at ``cfg.img_size`` (``data.synthetic.{train_size, val_size, seed}``)."""
    train_tf, val_tf = _transforms(cfg, mean, std)
    syn = cfg.synthetic
    train = (SyntheticShapesDetection(syn.train_size, cfg.img_size, syn.seed, 'train', train_tf, masks)
             if with_train else None)
    val = SyntheticShapesDetection(syn.val_size, cfg.img_size, syn.seed, 'val', val_tf, masks)
    return train, val, val.class_names


def build_detection_folder(cfg: Any, mean: Sequence[float], std: Sequence[float], with_train: bool = True,
                           masks: bool = False) -> Datasets:
    """A COCO-format set at ``cfg.root`` (``linvit.data.coco``)."""
    if not cfg.root:
        raise ValueError("data.root must be set when data.name is 'folder': for detection, a COCO-format set with "
                         "annotations/instances_{train,val}.json and the images under train/ and val/")
    root = Path(cfg.root).expanduser()
    train_tf, val_tf = _transforms(cfg, mean, std)
    val_split = read_coco_split(root, 'val', masks)
    train = None
    if with_train:
        train_split = read_coco_split(root, 'train', masks)
        check_same_categories(train_split, val_split, root)
        train = CocoDetectionSet(train_split, train_tf, masks)
    return train, CocoDetectionSet(val_split, val_tf, masks), val_split.class_names


#: data.name -> builder(data config, mean, std, with_train, masks) -> (train, val, class names), for detection
DETECTION_DATASET_BUILDERS: Registry[Callable[[Any, Sequence[float], Sequence[float], bool, bool], Datasets]] = \
    Registry('data.name')
DETECTION_DATASET_BUILDERS.register('synthetic', build_detection_synthetic)
DETECTION_DATASET_BUILDERS.register('folder', build_detection_folder)


def build_detection_datasets(cfg: Any, mean: Sequence[float], std: Sequence[float], with_train: bool = True,
                             masks: bool = False) -> Datasets:
    """Train and validation detection datasets and the class names (label i names entry i - 1); ``masks``: their
    targets carry instance masks (Mask R-CNN)."""
    return DETECTION_DATASET_BUILDERS.get(cfg.name)(cfg, mean, std, with_train, masks)
