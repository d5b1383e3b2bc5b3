"""A built-in depth task where a pixel's depth depends on content far away in the image: objects on a ground plane.

Each image is seen by a pinhole camera of focal length ``f`` px held level at height ``h`` (1.2-1.8 m) above a flat
ground. The image is an off-centre crop of that camera's view (the principal point sits on the horizon row), so the
horizon falls on a random row ``y_h`` (15% to 45% of the height from the top, as camera pitch would move it) and the
depth of the ground at image row ``y`` (pixel centres at integer rows) is exactly

    Z(y) = f * h / (y - y_h)      for y > y_h, clipped at ``far_depth`` (40 m)

- the sky (rows y <= y_h) has no depth: its pixels are invalid (``INVALID_DEPTH``, 0.0);
- the ground is tiled (tile side 0.5-1.5 m, random brightness per tile) on the ground plane and projected, so its
  pattern shrinks with distance and fades to its mean colour where tiles become smaller than a few pixels;
- 2-5 upright rectangles (random colours, random real heights 0.4-3 m and widths 0.3-1.5 m, so their size in the
  image does not give their depth) stand on the ground: a rectangle whose bottom row is ``y_c`` (its contact row)
  is fronto-parallel at the ground's depth there, Z(y_c), and covers what lies behind it (drawn far to near).

A window that sees only a rectangle's interior (a flat colour with pixel noise) cannot tell near from far; the ground
under it, its contact row and the horizon can. ``sample_params(index)`` gives the geometry of a sample, so tests and
users can recompute every depth from the formula.

Samples are a pure function of (dataset seed, split, index); train and val are different streams. Rendering is
numpy only (a 128 px sample in one or two milliseconds).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import albumentations as A
import numpy as np

from .base import KeyedSegDataset, seed_words

__all__ = ['DEPTH_CLASS_NAMES', 'INVALID_DEPTH', 'FAR_DEPTH', 'GroundObject', 'GroundScene', 'SyntheticGroundDepth',
           'draw_scene', 'render_scene']

#: the class names of every depth dataset: one regressed quantity
DEPTH_CLASS_NAMES = ('depth',)
#: the depth value of pixels that have none (sky, unmeasured, beyond data.max_depth); also what training pads with
INVALID_DEPTH = 0.0

_SPLIT_IDS = {'train': 0, 'val': 1}
_SCENE_STREAM, _TEXTURE_STREAM = 0, 1
_MIN_IMG_SIZE = 32
#: metres: the ground's depth is clipped here (its rows near the horizon would otherwise grow without bound)
FAR_DEPTH = 40.0
_CAMERA_HEIGHT = (1.2, 1.8)          # metres
_HORIZON_FRACTION = (0.15, 0.45)     # of the image height, from the top
_FOCAL_FRACTION = (0.8, 1.2)         # of the image side: horizontal fields of view of about 45 to 65 degrees
_MIN_OBJECTS, _MAX_OBJECTS = 2, 5
_OBJECT_DEPTH = (3.0, 25.0)          # metres: nearer than that a rectangle fills the view, farther it is a few px
_OBJECT_HEIGHT = (0.4, 3.0)          # metres
_OBJECT_WIDTH = (0.3, 1.5)           # metres
_TILE_SIDE = (0.5, 1.5)              # metres
_TILE_TABLE = 64                     # per-tile brightness repeats every 64 tiles: far beyond any visible pattern
_TILE_CONTRAST = 45.0                # grey levels
_FADE_PIXELS = 3.0                   # tiles whose rows span fewer pixels than this fade to the mean colour
_PIXEL_NOISE = 4.0                   # grey levels, everywhere: no region is a perfectly flat colour


@dataclass(frozen=True)
class GroundObject:
    """One upright rectangle: rows ``top .. contact_row`` (inclusive; ``contact_row`` is where it stands on the
    ground) and columns ``left .. right - 1`` of the image, already clipped to it. ``height_m`` and ``width_m`` are
    its real size in metres, ``colour`` its RGB."""
    contact_row: int
    top: int
    left: int
    right: int
    height_m: float
    width_m: float
    colour: tuple[int, int, int]


@dataclass(frozen=True)
class GroundScene:
    """The geometry of one sample: ``camera_height`` (m), ``focal`` (px), ``horizon`` (a real row: ground rows are
    the rows y > horizon), ``far_depth`` (m, where ground depth is clipped) and the objects far to near (their
    drawing order)."""
    camera_height: float
    focal: float
    horizon: float
    far_depth: float
    objects: tuple[GroundObject, ...]

    def ground_depth(self, rows: np.ndarray) -> np.ndarray:
        """float64 depth in metres of the ground at image ``rows`` (any shape): f * h / (y - horizon) clipped at
        ``far_depth``; ``INVALID_DEPTH`` for rows at or above the horizon."""
        rows = np.asarray(rows, dtype=np.float64)
        below = rows > self.horizon
        distance = self.focal * self.camera_height / np.where(below, rows - self.horizon, 1.0)
        return np.where(below, np.minimum(distance, self.far_depth), INVALID_DEPTH)


def draw_scene(rng: np.random.Generator, img_size: int, far_depth: float = FAR_DEPTH) -> GroundScene:
    """Random camera and objects for an image of ``img_size`` px (the module docstring gives the ranges)."""
    size = img_size
    camera_height = float(rng.uniform(*_CAMERA_HEIGHT))
    horizon = float(rng.uniform(*_HORIZON_FRACTION)) * size
    focal = float(rng.uniform(*_FOCAL_FRACTION)) * size
    scene = GroundScene(camera_height, focal, horizon, far_depth, ())
    count = int(rng.integers(_MIN_OBJECTS, _MAX_OBJECTS + 1))
    objects = [_draw_object(rng, scene, size) for _ in range(count)]
    objects.sort(key=lambda obj: obj.contact_row)  # far to near: a higher contact row is farther away
    return GroundScene(camera_height, focal, horizon, far_depth, tuple(objects))


def _draw_object(rng: np.random.Generator, scene: GroundScene, size: int) -> GroundObject:
    """One rectangle standing on a random ground row between the rows of _OBJECT_DEPTH (uniform in the image, so
    uniform in inverse depth, as objects in a photograph are)."""
    far_row = _row_at_depth(scene, min(_OBJECT_DEPTH[1], scene.far_depth))
    near_row = min(size - 1, _row_at_depth(scene, _OBJECT_DEPTH[0]))
    contact_row = int(rng.integers(min(far_row, size - 1), near_row + 1))
    depth = float(scene.ground_depth(contact_row))
    height_m, width_m = float(rng.uniform(*_OBJECT_HEIGHT)), float(rng.uniform(*_OBJECT_WIDTH))
    height_px = max(1, round(height_m * scene.focal / depth))
    width_px = max(1, round(width_m * scene.focal / depth))
    left = int(rng.integers(-(width_px // 2), size - width_px // 2))
    colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
    return GroundObject(contact_row, max(0, contact_row - height_px + 1), max(0, left), min(size, left + width_px),
                        height_m, width_m, colour)


def _row_at_depth(scene: GroundScene, depth: float) -> int:
    """The first whole row whose ground lies at ``depth`` metres or nearer."""
    return math.floor(scene.horizon + scene.focal * scene.camera_height / depth) + 1


def render_scene(scene: GroundScene, rng: np.random.Generator, img_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``scene``: ``(image uint8 [S, S, 3] RGB, depth float32 [S, S] metres, INVALID_DEPTH in the sky)``;
    ``rng`` draws only the colours and textures, never the geometry."""
    size = img_size
    rows = np.arange(size, dtype=np.float64)
    row_depth = scene.ground_depth(rows)
    depth = np.repeat(row_depth.astype(np.float32)[:, None], size, axis=1)
    canvas = np.empty((size, size, 3), dtype=np.float32)
    sky = rows <= scene.horizon
    canvas[sky] = _sky(rng, rows[sky], scene.horizon)
    canvas[~sky] = _ground(rng, scene, rows[~sky], size)
    for obj in scene.objects:
        canvas[obj.top:obj.contact_row + 1, obj.left:obj.right] = obj.colour
        depth[obj.top:obj.contact_row + 1, obj.left:obj.right] = row_depth[obj.contact_row]
    canvas += rng.normal(0.0, _PIXEL_NOISE, size=canvas.shape).astype(np.float32)
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8), depth


def _sky(rng: np.random.Generator, rows: np.ndarray, horizon: float) -> np.ndarray:
    """float32 [len(rows), 1, 3]: a vertical blend from a zenith colour to a paler one at the horizon."""
    zenith = rng.uniform([40, 90, 160], [110, 160, 240])
    at_horizon = rng.uniform([170, 180, 190], [230, 235, 250])
    weight = (rows / max(horizon, 1.0))[:, None, None]
    return (zenith * (1 - weight) + at_horizon * weight).astype(np.float32)


def _ground(rng: np.random.Generator, scene: GroundScene, rows: np.ndarray, size: int) -> np.ndarray:
    """float32 [len(rows), size, 3]: tiles of the ground plane projected into the image rows below the horizon."""
    base = rng.uniform([70, 60, 40], [160, 150, 120])
    tile = float(rng.uniform(*_TILE_SIDE))
    brightness = rng.uniform(-1.0, 1.0, size=(_TILE_TABLE, _TILE_TABLE))
    offset = rng.uniform(0.0, _TILE_TABLE, size=2)
    # unclipped: the texture goes on shrinking beyond far_depth, only the depth target is clipped
    forward = scene.focal * scene.camera_height / (rows - scene.horizon)
    lateral = (np.arange(size) - (size - 1) / 2)[None, :] * forward[:, None] / scene.focal
    along = np.floor(forward / tile + offset[0]).astype(np.int64) % _TILE_TABLE
    across = np.floor(lateral / tile + offset[1]).astype(np.int64) % _TILE_TABLE
    # rows of pixels a tile spans at that distance: sub-pixel tiles would alias into moire, so they blend away
    fade = np.clip(scene.focal * scene.camera_height * tile / forward ** 2 / _FADE_PIXELS, 0.0, 1.0)
    shade = _TILE_CONTRAST * fade[:, None] * brightness[along[:, None], across]
    return (base[None, None, :] + shade[:, :, None]).astype(np.float32)


class SyntheticGroundDepth(KeyedSegDataset):
    """The ground-plane depth task (module docstring): ``num_samples`` images of ``img_size`` px.

    ``dataset[key] -> (image float32 [3, H, W], depth float32 [H, W] metres, INVALID_DEPTH where there is none)``
    after ``transform`` (``linvit.data.depth.build_depth_transforms``). ``max_depth`` (metres, None = no cap) makes
    deeper pixels invalid, as ``data.max_depth`` does for depth folders.
    """

    def __init__(self, num_samples: int, img_size: int, seed: int, split: str, transform: A.Compose,
                 max_depth: float | None = None, far_depth: float = FAR_DEPTH):
        if split not in _SPLIT_IDS:
            raise ValueError(f"split must be one of {sorted(_SPLIT_IDS)}, got {split!r}")
        if img_size < _MIN_IMG_SIZE:
            raise ValueError(f"synthetic ground depth needs img_size >= {_MIN_IMG_SIZE}, got {img_size}")
        if num_samples < 1:
            raise ValueError(f"synthetic {split} size must be >= 1, got {num_samples}")
        if not far_depth > _OBJECT_DEPTH[0]:
            raise ValueError(f"far_depth must exceed {_OBJECT_DEPTH[0]} m (the nearest object), got {far_depth}")
        super().__init__(transform, DEPTH_CLASS_NAMES, num_samples, ignore_index=int(INVALID_DEPTH))
        self.img_size, self.seed, self.split = img_size, seed, split
        self.max_depth, self.far_depth = max_depth, float(far_depth)
        self._entropy = [*seed_words(seed), _SPLIT_IDS[split]]

    def sample_params(self, index: int) -> GroundScene:
        """The geometry of the sample at ``index`` (camera, horizon, objects), without rendering it."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        return draw_scene(np.random.default_rng([*self._entropy, _SCENE_STREAM, index]), self.img_size,
                          self.far_depth)

    def render(self, index: int) -> tuple[np.ndarray, np.ndarray, GroundScene]:
        """The untransformed sample at ``index``: image uint8 [S, S, 3], depth float32 [S, S] metres (no
        ``max_depth`` cap), and its geometry."""
        scene = self.sample_params(index)
        image, depth = render_scene(scene, np.random.default_rng([*self._entropy, _TEXTURE_STREAM, index]),
                                    self.img_size)
        return image, depth, scene

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Image uint8 [S, S, 3] and depth float32 [S, S] metres, pixels beyond ``max_depth`` invalid."""
        image, depth, _ = self.render(index)
        if self.max_depth is not None:
            depth[depth > self.max_depth] = INVALID_DEPTH
        return image, depth

    def describe(self) -> str:
        cap = 'no max_depth' if self.max_depth is None else f"max_depth={self.max_depth:g} m"
        return (f"synthetic ground depth {self.split}: seed={self.seed}, {len(self)} images of {self.img_size} px, "
                f"ground clipped at {self.far_depth:g} m, {cap}")
