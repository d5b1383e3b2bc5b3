"""linvit.data.build_seg_transforms: crop size and dtypes, nearest-neighbour masks, image/mask alignment through
scale, pad, crop and flips, ignore_index padding, full-size validation."""
from types import SimpleNamespace

import albumentations as A
import numpy as np
import pytest
import torch

from linvit.data import build_seg_transforms

IGNORE = 255
IDENTITY = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))     # mean 0, std 1: the output image is x / 255
# one distinct RGB colour per class id (no channel 0 everywhere, so a padded pixel is the only all-zero one)
PALETTE = np.array([[10, 200, 30], [250, 5, 100], [60, 60, 255], [128, 255, 1], [7, 90, 180], [222, 222, 20]],
                   dtype=np.uint8)


def aug(scale_range=(1.0, 1.0), hflip=0.0, vflip=0.0, color_jitter=0.0):
    return SimpleNamespace(scale_range=list(scale_range), hflip=hflip, vflip=vflip, color_jitter=color_jitter)


def pipeline(aug_cfg, img_size, train=True, ignore_index=IGNORE, mean_std=IDENTITY):
    return build_seg_transforms(aug_cfg, img_size, *mean_std, ignore_index=ignore_index, train=train)


def block_mask(height: int, width: int, block: int, seed: int) -> np.ndarray:
    """uint8 [height, width]: a grid of block x block cells, each a random class id 0..5."""
    cells = np.random.default_rng(seed).integers(0, len(PALETTE), size=(-(-height // block), -(-width // block)))
    return np.kron(cells, np.ones((block, block), dtype=np.int64))[:height, :width].astype(np.uint8)


def run(transform, image, mask, seed=0):
    transform.set_random_seed(seed)
    out = transform(image=image, mask=mask)
    return out['image'], out['mask']


def test_train_gives_crops_of_img_size_float32_and_int64():
    mask = block_mask(50, 70, 5, seed=0)
    image, out_mask = run(pipeline(aug((0.5, 2.0), hflip=0.5, vflip=0.5, color_jitter=0.3), 24), PALETTE[mask], mask)
    assert image.dtype == torch.float32 and image.shape == (3, 24, 24)
    assert out_mask.dtype == torch.int64 and out_mask.shape == (24, 24)


def test_normalisation_uses_mean_and_std():
    mask = np.zeros((16, 16), dtype=np.uint8)
    image = np.full((16, 16, 3), (51, 102, 204), dtype=np.uint8)
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 0.2)
    out, _ = run(pipeline(aug(), 16, mean_std=(mean, std)), image, mask)
    expected = [(51 / 255 - 0.1) / 0.5, (102 / 255 - 0.2) / 0.25, (204 / 255 - 0.3) / 0.2]
    torch.testing.assert_close(out[:, 5, 5], torch.tensor(expected), rtol=0, atol=1e-5)


def test_augmented_masks_hold_only_input_values_or_ignore():
    # nearest neighbour never blends two ids into a third (3 and 7 would give 5 under linear interpolation)
    mask = np.random.default_rng(1).choice(np.array([0, 3, 7], dtype=np.uint8), size=(40, 40))
    transform = pipeline(aug((0.5, 2.0), hflip=0.5, vflip=0.5), 32)
    seen = set()
    for seed in range(12):
        _, out = run(transform, PALETTE[mask % 6], mask, seed)
        seen |= set(out.unique().tolist())
    assert seen <= {0, 3, 7, IGNORE}
    assert {0, 3, 7} <= seen and IGNORE in seen        # scale 0.5 makes a 20 px image: padded with IGNORE


def test_image_and_mask_stay_aligned_through_scale_pad_crop_and_flips():
    transform = pipeline(aug((0.5, 2.0), hflip=0.5, vflip=0.5), 32)
    checked = 0
    for seed in range(16):
        mask = block_mask(48, 40, 4, seed)
        image, out = run(transform, PALETTE[mask], mask, seed)
        out, rgb = out.numpy(), np.rint(image.numpy().transpose(1, 2, 0) * 255).astype(np.int64)
        padded = out == IGNORE
        # padding: exactly where the image was filled with 0
        np.testing.assert_array_equal(padded, np.all(rgb == 0, axis=2))
        # a pixel whose 3x3 mask neighbourhood is one class lies inside one block of the source, where linear
        # interpolation gives exactly that block's colour: the image there is PALETTE[mask]
        windows = np.lib.stride_tricks.sliding_window_view(out, (3, 3))
        uniform = np.zeros_like(padded)
        uniform[1:-1, 1:-1] = (windows == windows[:, :, 1:2, 1:2]).all(axis=(2, 3))
        inside = uniform & ~padded
        np.testing.assert_array_equal(rgb[inside], PALETTE[out[inside]].astype(np.int64))
        checked += int(inside.sum())
    assert checked > 16 * 32 * 32 * 0.2                # the check covered a good part of the pixels


def test_scale_is_relative_to_the_image_size():
    # vertical stripes 4 px wide: a factor of 2 makes them 8 px wide in the crop, a factor of 0.5 2 px wide
    stripes = (np.arange(64) // 4 % 2).astype(np.uint8)
    mask = np.tile(stripes, (64, 1))
    for factor, width in ((2.0, 8), (0.5, 2)):
        _, out = run(pipeline(aug((factor, factor)), 32), PALETTE[mask], mask, seed=3)
        row = out[16].numpy()
        edges = np.flatnonzero(np.diff(row) != 0)
        assert set(np.diff(edges).tolist()) == {width}, (factor, row)


def test_a_small_image_is_padded_with_ignore_index_in_the_mask_and_zero_in_the_image():
    mask = block_mask(10, 12, 3, seed=5)
    image, out = run(pipeline(aug(), 32, ignore_index=200), PALETTE[mask], mask)
    labelled = np.argwhere(out.numpy() != 200)
    (top, left), (bottom, right) = labelled.min(axis=0), labelled.max(axis=0) + 1
    assert (bottom - top, right - left) == (10, 12) and len(labelled) == 120
    np.testing.assert_array_equal(out[top:bottom, left:right].numpy(), mask)      # unchanged, just placed
    assert torch.all(image[:, out == 200] == 0)


def test_hflip_and_vflip_move_mask_and_image_together():
    mask = block_mask(16, 16, 2, seed=7)
    image, out = run(pipeline(aug(hflip=1.0, vflip=1.0), 16), PALETTE[mask], mask)
    np.testing.assert_array_equal(out.numpy(), mask[::-1, ::-1])
    np.testing.assert_array_equal(np.rint(image.numpy() * 255).astype(np.uint8).transpose(1, 2, 0),
                                  PALETTE[mask[::-1, ::-1]])


def test_validation_keeps_the_full_size_and_the_mask_unchanged():
    mask = block_mask(37, 53, 3, seed=9)
    mask[0, 0] = IGNORE
    transform = pipeline(aug((0.5, 2.0), hflip=1.0, vflip=1.0, color_jitter=0.5), 16, train=False)
    image, out = run(transform, PALETTE[mask % 6], mask)
    assert image.shape == (3, 37, 53) and out.dtype == torch.int64
    np.testing.assert_array_equal(out.numpy(), mask)
    np.testing.assert_array_equal(np.rint(image.numpy() * 255).astype(np.uint8).transpose(1, 2, 0), PALETTE[mask % 6])
    assert not any(isinstance(t, (A.RandomScale, A.RandomCrop, A.HorizontalFlip)) for t in transform.transforms)


def test_color_jitter_keeps_hue_and_leaves_the_mask_alone():
    transform = pipeline(aug(color_jitter=0.4), 16)
    jitter = [t for t in transform.transforms if isinstance(t, A.ColorJitter)]
    assert len(jitter) == 1 and tuple(jitter[0].hue) == (0.0, 0.0)
    mask = block_mask(16, 16, 4, seed=2)
    _, out = run(transform, PALETTE[mask], mask)
    np.testing.assert_array_equal(out.numpy(), mask)


@pytest.mark.parametrize('scale_range', [(0.0, 2.0), (2.0, 1.0), (-1.0, 1.0)])
def test_scale_range_must_be_increasing_positive_factors(scale_range):
    with pytest.raises(ValueError, match=r'aug.scale_range must be two factors 0 < min <= max'):
        pipeline(aug(scale_range), 16)


def test_scale_range_needs_two_values():
    with pytest.raises(ValueError, match=r'aug.scale_range must have 2 values, got \[0.5, 1.0, 2.0\]'):
        build_seg_transforms(SimpleNamespace(scale_range=[0.5, 1.0, 2.0], hflip=0, vflip=0, color_jitter=0), 16,
                             *IDENTITY, ignore_index=IGNORE, train=True)
