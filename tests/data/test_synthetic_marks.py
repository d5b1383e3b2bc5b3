"""linvit.data.synthetic: a fixed set, labels that match what is drawn (read back from pixels), flips that swap
the label, and the config path."""
import logging
from collections import Counter

import numpy as np
import pytest
import torch

from linvit.data import SyntheticMarks, build_classification_datasets, build_transforms
from linvit.data.synthetic import MARK_COLOURS, class_names

ZERO_MEAN, UNIT_STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)


def marks_dataset(make_cfg, n=64, img_size=48, seed=0, split='train', **aug):
    cfg = make_cfg(img_size=img_size, **aug)
    transform = build_transforms(cfg.aug, img_size, ZERO_MEAN, UNIT_STD, train=bool(aug), save_applied_params=True)
    return SyntheticMarks(n, img_size, seed, split, transform)


def colours_in(region: np.ndarray) -> set[str]:
    """Mark colours present in a uint8 [h, w, 3] region, from pixel values alone: strongly red or strongly blue
    pixels (grey clutter and grey noise have R == G == B, so they never count)."""
    r, b = region[..., 0].astype(int), region[..., 2].astype(int)
    found = set()
    if ((r - b) > 80).sum() >= 4:
        found.add('red')
    if ((b - r) > 80).sum() >= 4:
        found.add('blue')
    return found


def test_labels_match_the_drawn_marks(make_cfg):
    ds = marks_dataset(make_cfg, n=40, img_size=48)
    names = ds.class_names
    assert names == ['red-red', 'red-blue', 'blue-red', 'blue-blue'] == class_names()
    third = 48 // 3
    for index in range(len(ds)):
        image, layout = ds.render(index)
        assert image.dtype == np.uint8 and image.shape == (48, 48, 3)
        left, right = colours_in(image[:, :third]), colours_in(image[:, -third:])
        assert len(left) == 1 and len(right) == 1, (index, left, right)
        assert names[ds.targets[index]] == f'{left.pop()}-{right.pop()}'
        # the layout points at the marks: their centre pixels carry the mark colour (within jitter)
        for (top, col), colour in ((layout.left, layout.left_colour), (layout.right, layout.right_colour)):
            centre = image[top + layout.mark_size // 2, col + layout.mark_size // 2].astype(int)
            expected = np.array(MARK_COLOURS[('red', 'blue')[colour]])
            assert np.abs(centre - expected).max() <= 25
        assert layout.decoy is not None and third - 1 <= layout.decoy[1] <= 48 - third


def test_the_set_is_fixed_balanced_and_splits_differ(make_cfg):
    a, b = marks_dataset(make_cfg, n=100), marks_dataset(make_cfg, n=100)
    assert a.targets == b.targets
    assert all(np.array_equal(a.render(i)[0], b.render(i)[0]) for i in (0, 37, 99))
    assert Counter(a.targets) == {0: 25, 1: 25, 2: 25, 3: 25}
    val = marks_dataset(make_cfg, n=100, split='val')
    other_seed = marks_dataset(make_cfg, n=100, seed=1)
    for other in (val, other_seed):
        assert other.targets != a.targets
        assert not np.array_equal(other.render(0)[0], a.render(0)[0])
    # the same seed and index always give the same tensor (val transforms: deterministic anyway)
    assert torch.equal(a[(5, 3)][0], b[(5, 3)][0]) and torch.equal(a[5][0], a[5][0])


def test_decoy_defeats_colour_counts(make_cfg):
    # red-blue and blue-red samples with the same number of red squares exist: counts can't tell them apart
    ds = marks_dataset(make_cfg, n=64)
    seen = {}
    for index in range(len(ds)):
        layout = ds.render(index)[1]
        reds = [layout.left_colour, layout.right_colour, layout.decoy_colour].count(0)
        seen.setdefault(reds, set()).add(ds.targets[index])
    assert any(len(labels) >= 3 for labels in seen.values())


def test_horizontal_flip_swaps_the_label(make_cfg):
    ds = marks_dataset(make_cfg, n=8, img_size=48, hflip=1.0)
    index = ds.targets.index(1)                                 # red-blue
    image, label = ds[(index, 0)]
    assert ds.class_names[label] == 'blue-red'
    pixels = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    assert colours_in(pixels[:, :16]) == {'blue'} and colours_in(pixels[:, -16:]) == {'red'}
    same_colour = ds.targets.index(3)                           # blue-blue: unchanged
    assert ds[(same_colour, 0)][1] == 3


def test_flip_without_applied_params_is_refused(make_cfg):
    cfg = make_cfg(img_size=32, hflip=0.5)
    transform = build_transforms(cfg.aug, 32, ZERO_MEAN, UNIT_STD, train=True)
    with pytest.raises(ValueError, match='save_applied_params'):
        SyntheticMarks(8, 32, 0, 'train', transform)
    with pytest.raises(ValueError, match='img_size >= 32'):
        SyntheticMarks(8, 16, 0, 'train', transform)


def test_build_synthetic_from_config(make_cfg, caplog):
    cfg = make_cfg('synthetic', img_size=32, random_resized_crop=True, scale=[0.3, 1.0], hflip=0.5)
    with caplog.at_level(logging.WARNING, logger='linvit.data'):
        train, val, names = build_classification_datasets(cfg, (0.5,) * 3, (0.5,) * 3)
    assert any('cut a mark off' in r.getMessage() for r in caplog.records)
    assert names == train.class_names and len(train) == 64 and len(val) == 16
    image, label = train[(3, 11)]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and 0 <= label < 4
    again = train[(3, 11)]
    assert torch.equal(image, again[0]) and label == again[1]
    assert 'synthetic marks train' in train.describe() and '64 images' in train.describe()
    assert train.num_bad == 0 and len(train.targets) == 64


def test_augmentation_does_not_depend_on_the_loading_worker(make_cfg):
    # the engine's sampler yields (index, seed) keys; two worker processes must produce what one process does
    cfg = make_cfg('synthetic', img_size=32, random_resized_crop=True, scale=[0.6, 1.0], hflip=0.5, color_jitter=0.3)
    train = build_classification_datasets(cfg, (0.5,) * 3, (0.5,) * 3)[0]
    keys = [(index, 1000 + position) for position, index in enumerate([5, 3, 5, 0, 9, 9, 1, 2])]

    def load(workers: int) -> tuple[torch.Tensor, torch.Tensor]:
        loader = torch.utils.data.DataLoader(train, batch_size=2, sampler=keys, num_workers=workers)
        batches = list(loader)
        return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])

    (single, labels), (parallel, parallel_labels) = load(0), load(2)
    assert torch.equal(single, parallel) and torch.equal(labels, parallel_labels)
    assert not torch.equal(single[0], single[2])               # index 5 twice, different seeds: different views
