"""A built-in segmentation task where a pixel's class depends on content far away in the image.

Each image has, on a noisy grey background:

- one coloured *key* square (red or blue, side ~img_size/8) somewhere in a band along the top or the left border;
- 2-4 grey *shapes*, filled circles or squares (side img_size/6 .. img_size/4, dark or bright grey), placed anywhere
  else without touching the key or each other.

Classes: 0 ``background``, 1 ``red-key``, 2 ``blue-key``: every shape's pixels take the class shown by the KEY's
colour (far away), whatever the shape's kind, grey level or place; key and background pixels are class 0. So the
pixels of a shape look the same in both classes: a model that sees only the neighbourhood of a pixel finds the
shapes but is right about their class half of the time. Each shape must be related to a distant patch.

Flips change no label. A random zoom-in crop can cut the key off the image, and then the colour half of every shape's
class is unknowable: training samples whose key left the crop get their shape pixels set to ``ignore_index``
(``SyntheticShapesSeg.label_after_transform``), so the loss never asks for a guess.

Samples are a pure function of (dataset seed, split, index); train and val are different streams, and the key
colours are exactly balanced (a seeded permutation). Rendering is numpy only (well under 1 ms at 128 px).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import albumentations as A
import numpy as np
import torch

from .base import KeyedSegDataset, mask_dtype, seed_words
from .synthetic import MARK_COLOURS, _noisy_background

__all__ = ['SHAPE_KINDS', 'KEY_COLOURS', 'Shape', 'ShapesLayout', 'SyntheticShapesSeg', 'seg_class_names',
           'seg_palette', 'render_shapes', 'shape_label', 'shape_pixels']

SHAPE_KINDS = ('circle', 'square')
KEY_COLOURS = tuple(MARK_COLOURS)          # ('red', 'blue'): far from any grey, like the classification marks
NUM_CLASSES = 1 + len(KEY_COLOURS)
_KEY_RGB = np.array(list(MARK_COLOURS.values()), dtype=np.int16)
_SPLIT_IDS = {'train': 0, 'val': 1}
_KEY_STREAM, _SAMPLE_STREAM = 0, 1
_COLOUR_JITTER = 25       # per channel: a colour is a category, not one exact value
_MIN_SHAPES, _MAX_SHAPES = 2, 4
_PLACEMENT_TRIES = 30     # per shape; a shape that finds no free place is left out
# shape greys avoid the background's range ([60, 190], see synthetic._noisy_background) so shapes always stand out
_DARK_GREYS, _BRIGHT_GREYS = (0, 40), (215, 255)
_MIN_IMG_SIZE = 32
#: the colour of class 0 in pictures: darker than any background pixel, and neither a key colour nor white (which
#: pictures use for ignore_index)
_BACKGROUND_RGB = (64, 64, 64)


@dataclass(frozen=True)
class Shape:
    """One grey shape: ``kind`` indexes ``SHAPE_KINDS``; the shape fills (circle: is inscribed in) the square of
    side ``side`` pixels whose top-left corner is ``(top, left)``."""
    kind: int
    top: int
    left: int
    side: int
    grey: int


@dataclass(frozen=True)
class ShapesLayout:
    """What one image holds: the key square (top-left corner, side, colour index into ``KEY_COLOURS``) and the
    shapes in drawing order."""
    key: tuple[int, int]
    key_size: int
    key_colour: int
    shapes: tuple[Shape, ...]


def seg_class_names() -> list[str]:
    """``['background', 'red-key', 'blue-key']``."""
    return ['background'] + [f'{colour}-key' for colour in KEY_COLOURS]


def seg_palette() -> np.ndarray:
    """uint8 [3, 3]: the picture colour of each class, background dark grey and each ``<colour>-key`` class the
    colour its key is drawn in (``MARK_COLOURS``), so that red-key reads red in a picture's masks and legend."""
    return np.array([_BACKGROUND_RGB, *(MARK_COLOURS[colour] for colour in KEY_COLOURS)], dtype=np.uint8)


def shape_label(key_colour: int) -> int:
    """The class id of a shape's pixels: 1 + the key's colour (the kind does not matter)."""
    return 1 + key_colour


def shape_pixels(side: int, kind: int) -> np.ndarray:
    """bool [side, side]: the pixels a shape covers in its square (a circle: centre distance <= side / 2)."""
    if SHAPE_KINDS[kind] == 'square':
        return np.ones((side, side), dtype=bool)
    centre = (side - 1) / 2
    yy, xx = np.ogrid[:side, :side]
    return (yy - centre) ** 2 + (xx - centre) ** 2 <= (side / 2) ** 2


def render_shapes(rng: np.random.Generator, img_size: int, key_colour: int
                  ) -> tuple[np.ndarray, np.ndarray, ShapesLayout]:
    """Draw one image: ``(image uint8 [S, S, 3] RGB, mask uint8 [S, S] class ids, layout)`` with S = img_size.

    The random draws do not depend on ``key_colour``: the same ``rng`` state with the other colour gives the same
    picture with the other key, and shape labels moved to the other colour.
    """
    size = img_size
    image = _noisy_background(rng, size, size)
    key_size = max(3, round(size / 8))
    key = _key_corner(rng, size, key_size)
    key_rgb = _KEY_RGB[key_colour] + rng.integers(-_COLOUR_JITTER, _COLOUR_JITTER + 1, size=3, dtype=np.int16)
    image[key[0]:key[0] + key_size, key[1]:key[1] + key_size] = key_rgb.astype(np.uint8)
    mask = np.zeros((size, size), dtype=np.uint8)
    shapes = _place_shapes(rng, size, (*key, key_size))
    for shape in shapes:
        inside = shape_pixels(shape.side, shape.kind)
        rows, cols = slice(shape.top, shape.top + shape.side), slice(shape.left, shape.left + shape.side)
        image[rows, cols][inside] = shape.grey
        mask[rows, cols][inside] = shape_label(key_colour)
    return image, mask, ShapesLayout(key, key_size, key_colour, tuple(shapes))


def _key_corner(rng: np.random.Generator, size: int, key_size: int) -> tuple[int, int]:
    """(top, left) of the key: anywhere along the top or the left border, at most size/16 px in from it."""
    along, inward = int(rng.integers(0, size - key_size + 1)), int(rng.integers(0, size // 16 + 1))
    return (inward, along) if rng.integers(2) == 0 else (along, inward)


def _place_shapes(rng: np.random.Generator, size: int, key_box: tuple[int, int, int]) -> list[Shape]:
    """2-4 shapes at random free places: boxes keep a 1 px gap from the key and from each other."""
    low, high = max(3, round(size / 6)), max(3, round(size / 4))
    taken = [key_box]
    shapes = []
    for _ in range(int(rng.integers(_MIN_SHAPES, _MAX_SHAPES + 1))):
        kind, side = int(rng.integers(len(SHAPE_KINDS))), int(rng.integers(low, high + 1))
        dark = rng.integers(2) == 0
        grey = int(rng.integers(*(_DARK_GREYS if dark else _BRIGHT_GREYS), endpoint=True))
        for _ in range(_PLACEMENT_TRIES):
            top, left = (int(v) for v in rng.integers(0, size - side + 1, size=2))
            if not any(_boxes_touch((top, left, side), box) for box in taken):
                taken.append((top, left, side))
                shapes.append(Shape(kind, top, left, side, grey))
                break
    return shapes


def _boxes_touch(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    """True if squares (top, left, side) overlap or are less than 1 px apart."""
    return (a[0] <= b[0] + b[2] and b[0] <= a[0] + a[2]) and (a[1] <= b[1] + b[2] and b[1] <= a[1] + a[2])


class SyntheticShapesSeg(KeyedSegDataset):
    """The shapes-and-key task (module docstring): ``num_samples`` images of ``img_size`` px.

    ``dataset[key] -> (image float32 [3, H, W], mask int64 [H, W])`` after ``transform`` (from
    ``build_seg_transforms``). If the transform cropped the key out, shape pixels become ``ignore_index``.
    ``palette`` (``seg_palette()``) colours each class as its name says.
    """

    def __init__(self, num_samples: int, img_size: int, seed: int, split: str, transform: A.Compose,
                 ignore_index: int = 255):
        if split not in _SPLIT_IDS:
            raise ValueError(f"split must be one of {sorted(_SPLIT_IDS)}, got {split!r}")
        if img_size < _MIN_IMG_SIZE:
            raise ValueError(f"synthetic shapes need img_size >= {_MIN_IMG_SIZE} (the key is img_size/8), "
                             f"got {img_size}")
        if num_samples < 1:
            raise ValueError(f"synthetic {split} size must be >= 1, got {num_samples}")
        if 0 <= ignore_index < NUM_CLASSES:
            raise ValueError(f"ignore_index={ignore_index} is a class id of the synthetic shapes (0..{NUM_CLASSES - 1})"
                             f"; use a value outside, e.g. 255")
        super().__init__(transform, seg_class_names(), num_samples, ignore_index, palette=seg_palette())
        self.img_size, self.seed, self.split = img_size, seed, split
        self._entropy = [*seed_words(seed), _SPLIT_IDS[split]]
        key_rng = np.random.default_rng([*self._entropy, _KEY_STREAM, 0])
        self.key_colours = key_rng.permutation(np.arange(num_samples) % len(KEY_COLOURS)).tolist()
        # key pixels travel through the transform with this id, to tell whether the crop kept the key
        self._key_id = NUM_CLASSES if ignore_index != NUM_CLASSES else NUM_CLASSES + 1
        self._mask_dtype = mask_dtype(self._key_id + 1, ignore_index)

    def render(self, index: int) -> tuple[np.ndarray, np.ndarray, ShapesLayout]:
        """The untransformed sample at ``index``: image uint8 [S, S, 3], mask uint8 [S, S], layout."""
        rng = np.random.default_rng([*self._entropy, _SAMPLE_STREAM, index])
        return render_shapes(rng, self.img_size, self.key_colours[index])

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Image uint8 [S, S, 3] and mask [S, S] where the key's pixels hold a marker id (class 0 after
        ``label_after_transform``)."""
        image, mask, layout = self.render(index)
        mask = mask.astype(self._mask_dtype)
        (top, left), side = layout.key, layout.key_size
        mask[top:top + side, left:left + side] = self._key_id
        return image, mask

    def label_after_transform(self, mask: torch.Tensor, transform_output: dict[str, Any]) -> torch.Tensor:
        """Key pixels back to class 0; all shape pixels to ``ignore_index`` if no key pixel is left."""
        on_key = mask == self._key_id
        key_visible = bool(on_key.any())
        mask[on_key] = 0
        if not key_visible:
            mask[(mask > 0) & (mask != self.ignore_index)] = self.ignore_index
        return mask

    def describe(self) -> str:
        return (f"synthetic shapes {self.split}: seed={self.seed}, {len(self)} images of {self.img_size} px, "
                f"{len(self.class_names)} classes ({', '.join(self.class_names)})")
