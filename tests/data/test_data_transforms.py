"""linvit.data.transforms: normalisation values, output shapes, flips and masks through the same geometry."""
import albumentations as A
import numpy as np
import pytest
import torch

from linvit.data import build_transforms

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def expected_constant(rgb, mean=MEAN, std=STD) -> torch.Tensor:
    """(v / 255 - mean) / std per channel: float32 [3]."""
    return ((torch.tensor(rgb, dtype=torch.float64) / 255 - torch.tensor(mean)) / torch.tensor(std)).float()


@pytest.mark.parametrize('train', [False, True])
def test_constant_image_gives_normalised_constant(train, make_cfg):
    rgb = (10, 128, 250)
    image = np.empty((50, 70, 3), dtype=np.uint8)
    image[:] = rgb
    aug = make_cfg(random_resized_crop=True, scale=[0.3, 1.0], hflip=0.5, vflip=0.5).aug
    out = build_transforms(aug, 24, MEAN, STD, train=train)(image=image)['image']
    assert out.dtype == torch.float32 and out.shape == (3, 24, 24)
    torch.testing.assert_close(out, expected_constant(rgb)[:, None, None].expand(3, 24, 24), rtol=0, atol=1e-5)


def test_val_resizes_without_cropping(make_cfg):
    # a left/right split image keeps its halves under a plain resize; a crop would move the boundary
    image = np.zeros((30, 60, 3), dtype=np.uint8)
    image[:, 30:] = 255
    out = build_transforms(make_cfg().aug, 16, (0, 0, 0), (1, 1, 1), train=False)(image=image)['image']
    assert out.shape == (3, 16, 16)
    assert torch.all(out[:, :, :7] == 0) and torch.all(out[:, :, 9:] == 1)


def test_train_hflip_and_vflip_move_pixels(make_cfg):
    image = np.zeros((16, 16, 3), dtype=np.uint8)
    image[:8, :8] = 255                                      # bright top-left quadrant
    aug = make_cfg(hflip=1.0, vflip=1.0).aug
    out = build_transforms(aug, 16, (0, 0, 0), (1, 1, 1), train=True)(image=image)['image']
    assert torch.all(out[:, 8:, 8:] == 1) and torch.all(out[:, :8, :] == 0)   # now bottom-right


def test_color_jitter_keeps_grey_grey_and_hue_fixed(make_cfg):
    aug = make_cfg(color_jitter=0.4).aug
    pipeline = build_transforms(aug, 8, (0.5,) * 3, (0.5,) * 3, train=True)
    jitter = [t for t in pipeline.transforms if isinstance(t, A.ColorJitter)]
    assert len(jitter) == 1 and tuple(jitter[0].hue) == (0.0, 0.0)
    image = np.full((8, 8, 3), 100, dtype=np.uint8)
    outs = []
    for seed in range(4):
        pipeline.set_random_seed(seed)
        out = pipeline(image=image)['image']
        assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])   # grey in, grey out
        outs.append(out[0, 0, 0].item())
    assert len(set(outs)) > 1                                                 # but brightness/contrast vary


def test_no_color_jitter_when_zero(make_cfg):
    pipeline = build_transforms(make_cfg(color_jitter=0.0).aug, 8, MEAN, STD, train=True)
    assert not any(isinstance(t, A.ColorJitter) for t in pipeline.transforms)


def test_seeded_random_crop_is_reproducible_and_varies_with_seed(make_cfg):
    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    pipeline = build_transforms(make_cfg(random_resized_crop=True, scale=[0.1, 0.5]).aug, 16, MEAN, STD, True)
    results = []
    for seed in (3, 3, 4):
        pipeline.set_random_seed(seed)
        results.append(pipeline(image=image)['image'])
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], results[2])


def test_masks_follow_the_image_geometry(make_cfg):
    # dense tasks reuse the pipeline: the mask is flipped/cropped with the image and never normalised
    image = np.zeros((20, 20, 3), dtype=np.uint8)
    mask = np.zeros((20, 20), dtype=np.uint8)
    image[:, :10] = 255
    mask[:, :10] = 3
    pipeline = build_transforms(make_cfg(hflip=1.0).aug, 10, (0, 0, 0), (1, 1, 1), train=True)
    out = pipeline(image=image, mask=mask)
    assert out['mask'].shape == (10, 10)
    assert torch.all(out['mask'][:, 5:] == 3) and torch.all(out['mask'][:, :5] == 0)
    assert torch.all(out['image'][:, :, 5:] == 1)


def test_scale_must_have_two_values(make_cfg):
    with pytest.raises(ValueError, match='aug.scale'):
        build_transforms(make_cfg(random_resized_crop=True, scale=[0.5]).aug, 8, MEAN, STD, train=True)
