"""What every linvit image dataset shares: keys that carry an augmentation seed, the transform call, image sizes.

A key is an ``int`` index or an ``(index, seed)`` pair. With a seed, the augmentation of that sample is drawn from
``SeedSequence([seed, index])`` (``sample_seed``), so it depends only on the pair: not on the DataLoader worker
that loads it, nor on what that worker loaded before. That is what lets a resumed run reproduce an uninterrupted
one. A plain ``int`` draws its seed from torch's global generator, which DataLoader seeds differently in every
worker.

An image size (``data.img_size``) is one side (a square) or ``[height, width]``, timm's order; ``image_size`` reads
either as ``(height, width)``, the form every size takes inside linvit.
"""
from __future__ import annotations

import numbers
import operator
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    import albumentations as A

__all__ = ['DataError', 'LayoutError', 'KeyedImageDataset', 'KeyedSegDataset', 'mask_dtype', 'sample_seed',
           'seed_words', 'seed_transform', 'image_size', 'size_text', 'named']

_WORD = 2 ** 32


class DataError(ValueError, RuntimeError):
    """Data that cannot be used as given (no class folders, too many unreadable files, ...); the one-line message
    names the folder or file and what was expected. A ValueError; also a RuntimeError, the type that unreadable-file
    errors had in earlier releases (like io.UnsupportedOperation, which is both OSError and ValueError)."""


class LayoutError(DataError):
    """A data folder laid out for another task (images/ + masks/ given to classification, class folders given to
    segmentation); the message names the config that reads it. A mistake in the command, not in the data."""


def image_size(value: Any, key: str = 'data.img_size') -> tuple[int, int]:
    """``(height, width)`` of an image size given as one side (a square) or a pair ``[height, width]`` (timm's order);
    a ValueError naming ``key`` for anything else (a string, a float, a bool, a side below 1, three values)."""
    sides = list(value) if _is_sequence(value) else [value, value]
    if len(sides) != 2 or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= 1
                                  for s in sides):
        shown = list(value) if _is_sequence(value) else value
        raise ValueError(f"{key}={shown!r} is not an image size: give one side in pixels ({key}=224) or [height, "
                         f"width], two positive ints ({key}=[224,320])")
    return int(sides[0]), int(sides[1])


def size_text(size: tuple[int, int]) -> str:
    """'224' for a square size, '224x320' (height x width) otherwise: how logs and file names show a size."""
    height, width = size
    return str(height) if height == width else f"{height}x{width}"


def named(names: Sequence[str], shown: int) -> str:
    """'a, b, c' naming at most ``shown`` of ``names``, then 'and N more': how a message lists classes or folders."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ''
    return ', '.join(names[:shown]) + more


def _is_sequence(value: Any) -> bool:
    """A list, tuple or OmegaConf ListConfig (not a string)."""
    return hasattr(value, '__len__') and hasattr(value, '__iter__') and not isinstance(value, (str, bytes))


def seed_words(seed: int) -> list[int]:
    """A seed as two 32-bit words (any int, taken modulo 2**64).

    SeedSequence reads each int as a variable number of words and ignores trailing zero words, so entropy lists of
    different shapes can collide; fixed-width words keep every key distinct.
    """
    seed %= _WORD * _WORD
    return [seed % _WORD, seed // _WORD]


def seed_transform(transform: A.Compose, seed: int) -> None:
    """Seed ``transform`` for one sample, each of its steps with its own seed drawn from ``seed``.

    albumentations' ``Compose.set_random_seed`` gives every step the same seed, so each step's first random number is
    the same: reseeded per sample, a flip with p=0.5 and ColorJitter's brightness factor would always move together
    (flipped images darker), and so would RandomResizedCrop's scale. Separate seeds keep the steps independent.
    """
    transform.set_random_seed(seed)
    words = np.random.SeedSequence(seed_words(seed)).generate_state(len(transform.transforms))
    for step, word in zip(transform.transforms, words):
        step.set_random_seed(int(word))


def sample_seed(index: int, seed: int) -> int:
    """The albumentations seed for one sample, a function of ``(index, seed)`` only (a 32-bit int)."""
    return int(np.random.SeedSequence([*seed_words(seed), index]).generate_state(1)[0])


class KeyedImageDataset(Dataset):
    """Base class: ``dataset[key] -> (image float32 [3, S, S], label int)`` for ``key`` = index or (index, seed).

    Subclasses implement ``load(index) -> (image uint8 [H, W, 3] RGB, label)`` and ``describe()``, and may override
    ``label_after_transform`` when an augmentation changes the class.

    Attributes:
        class_names: ``list[str]``, position = label.
        targets: ``list[int]``, the label of every index (before augmentation).
        num_bad: files found unreadable so far (0 for generated data). Load-time failures are counted in the process
            that loads them, so with DataLoader workers the main process sees only the construction-time count.
        transform: the ``A.Compose`` applied to every sample; it is reseeded per call, so one dataset object must not
            be read from several threads at once (DataLoader workers are processes: fine).
    """

    def __init__(self, transform: A.Compose, class_names: Sequence[str], targets: Sequence[int]):
        self.transform = transform
        self.class_names = list(class_names)
        self.targets = [int(t) for t in targets]
        self.num_bad = 0

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, seed = self._parse_key(key)
        image, label = self.load(index)
        seed_transform(self.transform, sample_seed(index, seed))
        out = self.transform(image=image)
        return out['image'], self.label_after_transform(label, out)

    def load(self, index: int) -> tuple[np.ndarray, int]:
        """The raw sample ``(image uint8 [H, W, 3] RGB, label)`` at a valid, non-negative ``index``."""
        raise NotImplementedError

    def label_after_transform(self, label: int, transform_output: dict[str, Any]) -> int:
        """The label of the augmented image; the identity unless an augmentation can change the class."""
        return label

    def describe(self) -> str:
        raise NotImplementedError

    def _parse_key(self, key: Any) -> tuple[int, int]:
        if isinstance(key, (tuple, list)):
            if len(key) != 2:
                raise TypeError(f"a dataset key is an index or an (index, seed) pair, got {key!r}")
            index, seed = operator.index(key[0]), operator.index(key[1])
        else:
            # torch's generator, not numpy's: DataLoader reseeds torch per worker, so workers don't repeat each other.
            index, seed = operator.index(key), int(torch.randint(0, 2 ** 62, ()).item())
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} samples")
        return index % n, seed


def mask_dtype(num_classes: int, ignore_index: int) -> np.dtype:
    """The smallest mask dtype holding ids 0..num_classes-1 and ``ignore_index`` (uint8 usually, else int32):
    masks are resized by cv2 in this dtype, and uint8 is the fastest."""
    if num_classes <= 256 and 0 <= ignore_index <= 255:
        return np.dtype(np.uint8)
    return np.dtype(np.int32)


class KeyedSegDataset(KeyedImageDataset):
    """Base class: ``dataset[key] -> (image float32 [3, H, W], mask int64 [H, W])`` for ``key`` = index or
    (index, seed); the transform is seeded by ``sample_seed(index, seed)`` exactly as for classification.

    Subclasses implement ``load(index) -> (image uint8 [H, W, 3] RGB, mask integer [H, W] class ids)`` and
    ``describe()``, and may override ``label_after_transform(mask, transform_output)`` to edit the transformed mask.

    Attributes:
        class_names: ``list[str]``, position = class id.
        ignore_index: the mask value of unlabelled pixels.
        palette: ``np.ndarray`` uint8 [K, 3], the RGB colour in which pictures draw each class id (as the PALETTE
            of mmsegmentation's dataset metainfo), or None: pictures use ``linvit.engine.plots.class_palette(K)``.
            A subclass whose class names are colours sets matching ones (the built-in shapes: red-key in red).
        targets: empty (a segmentation sample has no single label).
        num_bad: files found undecodable so far.
    """

    def __init__(self, transform: A.Compose, class_names: Sequence[str], num_samples: int, ignore_index: int,
                 palette: np.ndarray | None = None):
        super().__init__(transform, class_names, targets=())
        self.num_samples = int(num_samples)
        self.ignore_index = int(ignore_index)
        self.palette = None if palette is None else _checked_palette(palette, len(self.class_names))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        index, seed = self._parse_key(key)
        image, mask = self.load(index)
        seed_transform(self.transform, sample_seed(index, seed))
        out = self.transform(image=image, mask=mask)
        return out['image'], self.label_after_transform(out['mask'], out)

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The raw sample ``(image uint8 [H, W, 3] RGB, mask [H, W] class ids)`` at a valid, non-negative index."""
        raise NotImplementedError


def _checked_palette(palette: np.ndarray, num_classes: int) -> np.ndarray:
    """palette [num_classes, 3] of integers in 0..255 -> a read-only uint8 copy; ValueError otherwise."""
    array = np.asarray(palette)
    if array.shape != (num_classes, 3) or not np.issubdtype(array.dtype, np.integer) or \
            (array.size and (array.min() < 0 or array.max() > 255)):
        raise ValueError(f"palette must be uint8 [K={num_classes}, 3] RGB, one colour per class, got {array.dtype} "
                         f"{array.shape}")
    array = array.astype(np.uint8)
    array.flags.writeable = False   # shared by every picture of the run
    return array
