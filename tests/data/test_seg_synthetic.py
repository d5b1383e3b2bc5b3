"""linvit.data.synthetic_seg: label semantics checked against the drawn layout and the pixels (areas, colours, the
key's colour), determinism and streams, the key's far-away effect, and keys cropped away becoming ignore_index."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from linvit.data import (
    KeyedSegDataset,
    SyntheticShapesSeg,
    build_seg_transforms,
    build_segmentation_datasets,
    render_shapes,
)

IGNORE = 255
IDENTITY = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
# written out by hand: the class id of every shape's pixels, by the key's colour (not the shape's kind)
EXPECTED_CLASS = {'red': 1, 'blue': 2}
KINDS, COLOURS = ('circle', 'square'), ('red', 'blue')


def transform(train=False, scale_range=(1.0, 1.0), img_size=64):
    aug = SimpleNamespace(scale_range=list(scale_range), hflip=0.5, vflip=0.5, color_jitter=0.0)
    return build_seg_transforms(aug, img_size, *IDENTITY, ignore_index=IGNORE, train=train)


def dataset(split='train', seed=0, size=64, n=16, **kwargs):
    return SyntheticShapesSeg(n, size, seed, split, transform(**kwargs))


def test_class_names():
    assert dataset().class_names == ['background', 'red-key', 'blue-key']


def test_palette_colours_each_class_as_its_name_says():
    palette = dataset().palette
    assert palette.dtype == np.uint8 and palette.shape == (3, 3)
    (r, g, b), (r_red, g_red, b_red), (r_blue, g_blue, b_blue) = palette.astype(int).tolist()
    assert r_red > 150 and g_red < 100 and b_red < 100, 'red-key is red'
    assert b_blue > 150 and r_blue < 100 and g_blue < 100, 'blue-key is blue'
    assert r == g == b and r < 128, 'background is a dark grey'
    # the very colours the keys are drawn in (before jitter)
    for colour, label in EXPECTED_CLASS.items():
        image, _, layout = render_shapes(np.random.default_rng(0), 64, COLOURS.index(colour))
        top, left = layout.key
        key_pixel = image[top + layout.key_size // 2, left + layout.key_size // 2].astype(int)
        assert np.abs(key_pixel - palette[label]).max() <= 25, colour


def test_a_segmentation_dataset_without_colours_of_its_own_has_no_palette():
    assert KeyedSegDataset(transform(), ['a', 'b'], 1, IGNORE).palette is None   # pictures use class_palette(K)
    given = KeyedSegDataset(transform(), ['a', 'b'], 1, IGNORE, palette=[[1, 2, 3], [4, 5, 6]])
    assert given.palette.dtype == np.uint8 and given.palette.tolist() == [[1, 2, 3], [4, 5, 6]]
    for bad in ([[1, 2, 3]], [[1, 2, 3], [4, 5, 256]], [[0.5, 0, 0], [0, 0, 0]]):
        with pytest.raises(ValueError, match='palette'):
            KeyedSegDataset(transform(), ['a', 'b'], 1, IGNORE, palette=bad)


@pytest.mark.parametrize('size', [32, 64, 128])
def test_each_shape_is_labelled_by_the_key_colour(size):
    for seed in range(12):
        image, mask, layout = render_shapes(np.random.default_rng(seed), size, seed % 2)
        assert image.shape == (size, size, 3) and image.dtype == np.uint8 and mask.shape == (size, size)
        assert 1 <= len(layout.shapes) <= 4
        colour = COLOURS[layout.key_colour]
        total_area = 0
        for shape in layout.shapes:
            box = mask[shape.top:shape.top + shape.side, shape.left:shape.left + shape.side]
            label = EXPECTED_CLASS[colour]
            area = int((box == label).sum())
            total_area += area
            assert set(np.unique(box).tolist()) <= {0, label}
            if KINDS[shape.kind] == 'square':
                assert area == shape.side ** 2
            else:   # a filled disc of diameter side: area pi side^2 / 4 within a pixel rim, corners empty
                assert abs(area - math.pi * shape.side ** 2 / 4) < 1.6 * shape.side
                assert box[0, 0] == box[-1, -1] == 0 and box[shape.side // 2, shape.side // 2] == label
            # the painted pixels are exactly the labelled ones, in the shape's grey
            pixels = image[shape.top:shape.top + shape.side, shape.left:shape.left + shape.side][box == label]
            assert np.all(pixels == shape.grey)
        # nothing else is labelled: labelled pixels = sum of the shapes' areas (they don't overlap)
        assert int((mask > 0).sum()) == total_area


def test_the_key_is_a_coloured_class_0_square_on_the_top_or_left_border_band():
    for seed in range(20):
        size = 64
        image, mask, layout = render_shapes(np.random.default_rng(seed), size, seed % 2)
        (top, left), side = layout.key, layout.key_size
        assert side == 8 and min(top, left) <= size // 16
        key = image[top:top + side, left:left + side].reshape(-1, 3).astype(int)
        assert np.all(key == key[0]) and np.all(mask[top:top + side, left:left + side] == 0)
        r, _, b = key[0]
        assert (r > b + 100) if layout.key_colour == 0 else (b > r + 100)
        # everything that is neither key nor shape is grey (R = G = B) background
        outside = np.ones((size, size), dtype=bool)
        outside[top:top + side, left:left + side] = False
        outside &= mask == 0
        assert np.all(image[outside].max(axis=1) == image[outside].min(axis=1))


def test_shapes_keep_clear_of_the_key_and_of_each_other():
    counts = []
    for seed in range(40):
        _, _, layout = render_shapes(np.random.default_rng(seed), 64, 0)
        boxes = [(*layout.key, layout.key_size)] + [(s.top, s.left, s.side) for s in layout.shapes]
        for i, (t1, l1, s1) in enumerate(boxes):
            for t2, l2, s2 in boxes[i + 1:]:
                assert t1 + s1 < t2 or t2 + s2 < t1 or l1 + s1 < l2 or l2 + s2 < l1
        counts.append(len(layout.shapes))
    assert min(counts) >= 2 and max(counts) == 4


def test_changing_only_the_key_colour_changes_every_shape_label():
    for seed in range(8):
        image_red, mask_red, layout_red = render_shapes(np.random.default_rng(seed), 64, 0)
        image_blue, mask_blue, layout_blue = render_shapes(np.random.default_rng(seed), 64, 1)
        assert layout_red.shapes == layout_blue.shapes and layout_red.key == layout_blue.key
        (top, left), side = layout_red.key, layout_red.key_size
        differs = np.any(image_red != image_blue, axis=2)
        assert differs[top:top + side, left:left + side].all() and differs.sum() == side * side  # only the key
        swap = {0: 0, 1: 2}                                       # red key -> blue key
        np.testing.assert_array_equal(mask_blue, np.vectorize(swap.get)(mask_red))
        assert (mask_red > 0).any()


def test_samples_are_deterministic_and_splits_and_seeds_differ():
    a, b = dataset(), dataset()
    for i in (0, 5):
        assert all(np.array_equal(x, y) for x, y in zip(a.render(i)[:2], b.render(i)[:2]))
        assert torch.equal(a[(i, 3)][0], b[(i, 3)][0]) and torch.equal(a[(i, 3)][1], b[(i, 3)][1])
    val, other_seed = dataset('val'), dataset(seed=1)
    assert not np.array_equal(a.render(0)[0], val.render(0)[0])
    assert not np.array_equal(a.render(0)[0], other_seed.render(0)[0])
    assert not np.array_equal(a.render(0)[0], a.render(1)[0])


def test_key_colours_are_exactly_balanced():
    ds = dataset(n=31)
    assert sum(ds.key_colours) == 15 and set(ds.key_colours) == {0, 1}
    assert [ds.render(i)[2].key_colour for i in range(31)] == ds.key_colours


def test_validation_sample_is_the_rendered_one():
    ds = dataset('val')
    image, mask = ds[(3, 0)]
    raw_image, raw_mask, _ = ds.render(3)
    assert image.shape == (3, 64, 64) and mask.dtype == torch.int64
    np.testing.assert_array_equal(mask.numpy(), raw_mask)          # key pixels back to class 0
    np.testing.assert_array_equal(np.rint(image.numpy() * 255).astype(np.uint8).transpose(1, 2, 0), raw_image)


def test_shapes_become_ignore_index_when_the_crop_loses_the_key():
    ds = dataset('train', n=48, train=True, scale_range=(1.5, 2.0))
    lost = kept = 0
    for i in range(len(ds)):
        image, mask = ds[(i, 0)]
        assert set(mask.unique().tolist()) <= {0, 1, 2, IGNORE}              # the key's marker never leaks
        rgb = image * 255
        coloured = (rgb.max(dim=0).values - rgb.min(dim=0).values) > 60     # key pixels; all else is grey
        shape_labels = ((mask >= 1) & (mask <= 2)).any()
        if shape_labels:
            kept += 1
            assert coloured.any(), i                                          # a label implies a visible key
        if not coloured.any():
            lost += 1
            assert not shape_labels, i
    assert lost >= 3 and kept >= 3                                           # both cases happened


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="split must be one of"):
        dataset('test')
    with pytest.raises(ValueError, match='img_size >= 32'):
        dataset(size=16)
    with pytest.raises(ValueError, match='ignore_index=2 is a class id'):
        SyntheticShapesSeg(4, 64, 0, 'train', transform(), ignore_index=2)


def test_built_from_the_data_config():
    aug = SimpleNamespace(scale_range=[0.75, 1.25], hflip=0.5, vflip=0.0, color_jitter=0.0)
    cfg = SimpleNamespace(name='synthetic', root=None, img_size=48, ignore_index=IGNORE, num_classes=None,
                          max_bad_fraction=0.0, synthetic=SimpleNamespace(train_size=10, val_size=4, seed=2), aug=aug)
    train, val, names = build_segmentation_datasets(cfg, *IDENTITY)
    assert len(train) == 10 and len(val) == 4 and names[0] == 'background' and val.split == 'val'
    assert train[(0, 0)][0].shape == (3, 48, 48) and val[0][1].shape == (48, 48)
    assert 'synthetic shapes train' in train.describe()
    # the validation set the engine's pictures receive carries the class colours
    np.testing.assert_array_equal(val.palette, train.palette)
