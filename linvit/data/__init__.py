"""Datasets for training: user folders, built-in synthetic tasks, albumentations pipelines.

Classification (ImageFolder layout, or the two-marks task):
    build_classification_datasets(cfg, mean, std) -> (train_dataset, val_dataset, class_names)
    dataset[index] or dataset[(index, seed)] -> (image float32 [3, H, W], label int)   # (H, W) = image_size(img_size)
    build_transforms(aug_cfg, img_size, mean, std, train) -> A.Compose   # HWC uint8 RGB -> normalised CHW tensor

Semantic segmentation (images/ + masks/ folders, or the shapes-and-key task):
    build_segmentation_datasets(cfg, mean, std) -> (train_dataset, val_dataset, class_names)
    dataset[index] or dataset[(index, seed)] -> (image float32 [3, H, W], mask int64 [H, W])  # train: H = W = img_size
    build_seg_transforms(aug_cfg, img_size, mean, std, ignore_index, train) -> A.Compose
"""
import os

# albumentations asks PyPI for a newer version when it is first imported; linvit downloads nothing at run time.
# Set before any submodule imports it (every submodule import runs this file first).
os.environ.setdefault('NO_ALBUMENTATIONS_UPDATE', '1')

from .base import DataError, KeyedImageDataset, LayoutError, image_size, sample_seed, size_text  # noqa: E402
from .build import DATASET_BUILDERS, build_classification_datasets  # noqa: E402
from .folder import ImageFolderDataset, load_rgb  # noqa: E402
from .segmentation import (  # noqa: E402
    SEG_DATASET_BUILDERS,
    KeyedSegDataset,
    SegFolderDataset,
    build_segmentation_datasets,
    read_mask,
)
from .synthetic import SyntheticMarks, render_marks  # noqa: E402
from .synthetic_seg import SyntheticShapesSeg, render_shapes  # noqa: E402
from .transforms import build_seg_transforms, build_transforms  # noqa: E402

__all__ = ['build_classification_datasets', 'DATASET_BUILDERS', 'build_transforms', 'ImageFolderDataset', 'load_rgb',
           'DataError', 'LayoutError', 'SyntheticMarks', 'render_marks', 'KeyedImageDataset', 'sample_seed',
           'build_segmentation_datasets', 'SEG_DATASET_BUILDERS', 'build_seg_transforms', 'KeyedSegDataset',
           'SegFolderDataset', 'read_mask', 'SyntheticShapesSeg', 'render_shapes', 'image_size', 'size_text']
