"""Image sizes as one side or (height, width) through the data layer (issue 48, item 6c): the per-image pipelines, the
decoded-image cache and its batched augmentation, and the synthetic marks all produce H x W; class folders without
images are refused in a training split and allowed in validation."""
import logging
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from linvit.data import DataError, image_size, size_text
from linvit.data.batch_augment import augment_batch, draw_params
from linvit.data.cache import CachedImageDataset, DecodedCache, cache_key
from linvit.data.folder import ImageFolderDataset
from linvit.data.synthetic import SyntheticMarks, render_marks
from linvit.data.transforms import build_transforms

ZERO_MEAN, UNIT_STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
AUG = SimpleNamespace(random_resized_crop=True, scale=[0.5, 1.0], hflip=0.5, vflip=0.0, color_jitter=0.2)


def _save(path, pixels):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def _noise(seed, height=40, width=60):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize('value, expected', [(224, (224, 224)), ([128, 192], (128, 192)), ((64, 32), (64, 32)),
                                             (np.int64(96), (96, 96))])
def test_a_size_is_a_side_or_height_and_width(value, expected):
    assert image_size(value) == expected


@pytest.mark.parametrize('value', ['224', '128x192', 12.5, True, 0, [128], [128, 192, 3], [128, -1], [128.0, 192]])
def test_anything_else_is_a_value_error_naming_the_key(value):
    with pytest.raises(ValueError, match=r"^data\.img_size=.* is not an image size: give one side"):
        image_size(value)


def test_sizes_show_as_a_side_or_height_x_width():
    assert (size_text((224, 224)), size_text((128, 192))) == ('224', '128x192')


def test_validation_resizes_to_height_and_width_as_cv2_does():
    pixels = _noise(0, 200, 300)
    out = build_transforms(AUG, (32, 48), ZERO_MEAN, UNIT_STD, train=False)(image=pixels)['image']
    expected = cv2.resize(pixels, (48, 32), interpolation=cv2.INTER_LINEAR)      # cv2 takes (width, height)
    torch.testing.assert_close(out, torch.from_numpy(expected).permute(2, 0, 1).float() / 255)


def test_training_crops_come_out_at_height_and_width():
    transform = build_transforms(AUG, [32, 48], ZERO_MEAN, UNIT_STD, train=True)
    assert {tuple(transform(image=_noise(seed, 50, 70))['image'].shape) for seed in range(4)} == {(3, 32, 48)}


@pytest.fixture
def folder(tmp_path):
    for split in ('train', 'val'):
        for label, name in enumerate(('cat', 'dog')):
            for i in range(3):
                _save(tmp_path / 'data' / split / name / f'{i}.png', _noise(10 * label + i))
    return tmp_path / 'data'


def test_the_cache_holds_height_x_width_images_and_keys_a_square_by_its_side(folder, tmp_path):
    source = ImageFolderDataset(folder / 'train', None, verify=False)
    cache = DecodedCache.open_or_build(source, (32, 48), tmp_path / 'cache', 'train')
    assert cache.size == (32, 48) and cache.images.shape == (6, 32, 48, 3)
    assert cache.folder.name.startswith('train-32x48px-')
    expected = cv2.resize(np.asarray(Image.open(folder / 'train' / 'cat' / '0.png')), (48, 32),
                          interpolation=cv2.INTER_LINEAR)
    assert np.array_equal(cache.images[0], expected)
    # a square size is named and keyed by its side, whichever form it comes in: caches built before pairs stay valid
    keys = [cache_key(source.paths, source.split_dir, source.targets, source.class_names, size)
            for size in (32, (32, 32), (32, 48), (48, 32))]
    assert keys[0] == keys[1] and len(set(keys[1:])) == 3


def test_the_cached_path_gives_height_x_width_batches_equal_to_the_per_image_path(folder, tmp_path):
    val_cache = DecodedCache.open_or_build(ImageFolderDataset(folder / 'val', None, verify=False), (32, 48),
                                           tmp_path / 'cache', 'val')
    cached_val = CachedImageDataset(val_cache, AUG, ZERO_MEAN, UNIT_STD, train=False)
    per_image = ImageFolderDataset(folder / 'val', build_transforms(AUG, (32, 48), ZERO_MEAN, UNIT_STD, train=False))
    torch.testing.assert_close(cached_val[(1, 0)][0], per_image[(1, 0)][0])
    train_cache = DecodedCache.open_or_build(ImageFolderDataset(folder / 'train', None, verify=False), (32, 48),
                                             tmp_path / 'cache', 'train')
    cached_train = CachedImageDataset(train_cache, AUG, ZERO_MEAN, UNIT_STD, train=True)
    samples = [cached_train[(i, 3)] for i in range(4)]
    batch = [torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples]),
             torch.stack([s[2] for s in samples])]
    images, labels = cached_train.on_device(batch, torch.device('cpu'))
    assert images.shape == (4, 3, 32, 48) and labels.tolist() == [0, 0, 0, 1]


def test_an_identity_augmentation_of_a_cached_non_square_image_returns_it():
    image = torch.from_numpy(_noise(3, 32, 48)).permute(2, 0, 1)[None]
    params = torch.from_numpy(draw_params(AUG, np.random.default_rng(0), 32, 48, train=False))[None]
    out = augment_batch(image, params, (32, 48), ZERO_MEAN, UNIT_STD, jitter=False)
    torch.testing.assert_close(out, image.float() / 255, rtol=0, atol=1e-5)   # grid_sample's float arithmetic


def test_synthetic_marks_render_at_height_and_width_with_marks_in_the_thirds_of_the_width():
    for seed in range(8):
        image, layout = render_marks(np.random.default_rng(seed), (40, 96), seed % 2, 1 - seed % 2)
        assert image.shape == (40, 96, 3) and layout.mark_size == 5                # min(40, 96) / 8
        (top, left), (right_top, right_left) = layout.left, layout.right
        assert left + 5 <= 32 and right_left >= 64 and top + 5 <= 40 and right_top + 5 <= 40
        assert 32 <= layout.decoy[1] and layout.decoy[1] + 5 <= 64
    transform = build_transforms(SimpleNamespace(random_resized_crop=False, hflip=0.0, vflip=0.0, color_jitter=0.0),
                                 (40, 96), ZERO_MEAN, UNIT_STD, train=False)
    marks = SyntheticMarks(4, (40, 96), 0, 'val', transform)
    assert marks[0][0].shape == (3, 40, 96) and '40x96 px' in marks.describe()
    with pytest.raises(ValueError, match='img_size >= 32 on each side'):
        SyntheticMarks(4, (24, 96), 0, 'val', transform)


def test_a_class_folder_without_images_is_refused_unless_the_split_allows_it(folder, caplog):
    (folder / 'train' / 'bird').mkdir()
    with pytest.raises(DataError, match=rf"class folders without images under {folder / 'train'}: "
                                        rf"{folder / 'train' / 'bird'}; a class with no training image"):
        ImageFolderDataset(folder / 'train', None, verify=False)
    with caplog.at_level(logging.WARNING, logger='linvit.data'):
        allowed = ImageFolderDataset(folder / 'train', None, verify=False, allow_empty_classes=True)
    assert allowed.class_names == ['bird', 'cat', 'dog'] and sorted(set(allowed.targets)) == [1, 2]
    assert 'bird has no images: its class is not evaluated' in caplog.text
