"""Fixtures for the data tests: a data config like the engine's DataConfig, and ImageFolder trees on disk.

(Test modules here share basenames' namespace with the rest of tests/, so helpers are fixtures, not imports.)"""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image


def data_cfg(name: str = 'synthetic', root=None, img_size: int = 32, max_bad_fraction: float = 0.01, **aug):
    """A DataConfig-like object (attribute access, as OmegaConf gives); ``aug`` keys override the defaults below."""
    aug_defaults = dict(random_resized_crop=False, scale=[0.5, 1.0], hflip=0.0, vflip=0.0, color_jitter=0.0)
    return SimpleNamespace(name=name, root=None if root is None else str(root), img_size=img_size,
                           max_bad_fraction=max_bad_fraction,
                           synthetic=SimpleNamespace(train_size=64, val_size=16, seed=0),
                           aug=SimpleNamespace(**{**aug_defaults, **aug}))


@pytest.fixture
def make_cfg():
    """``make_cfg(name='synthetic', root=None, img_size=32, max_bad_fraction=0.01, **aug_overrides)``."""
    return data_cfg


def save_rgb(path: Path, rgb: np.ndarray, fmt: str = 'PNG') -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(path, fmt)
    return path


def noise_rgb(seed: int, height: int = 40, width: int = 48) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.fixture
def make_tree(tmp_path):
    """A function building root/<split>/<class>/<n>.png of random RGB images; returns the root."""
    def build(classes_per_split=None, per_class: int = 3) -> Path:
        classes_per_split = classes_per_split or {'train': ['dog', 'cat'], 'val': ['cat', 'dog']}
        root = tmp_path / 'root'
        seed = 0
        for split, classes in classes_per_split.items():
            for name in classes:
                for i in range(per_class):
                    save_rgb(root / split / name / f'{i}.png', noise_rgb(seed))
                    seed += 1
        return root
    return build
