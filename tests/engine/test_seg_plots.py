"""Segmentation pictures: the palette, overlay values by hand, a grid PNG with the right colours, legend and size."""
import numpy as np
import pytest
import torch
from PIL import Image

from linvit.engine.plots import (
    _display_size,
    _shrink_mask,
    class_palette,
    overlay_mask,
    plot_segmentation_grid,
)

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
I = 255  # noqa: E741  (ignore_index)


def read_png(path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.format == 'PNG'
        return np.asarray(image.convert('RGB')).astype(int)


def pixels_near(picture: np.ndarray, rgb, tolerance: int) -> int:
    return int((np.abs(picture - np.asarray(rgb)) <= tolerance).all(axis=-1).sum())


def normalised_grey(height, width, level=0.5):
    """A [3, H, W] image of one grey ``level`` in [0, 1], normalised with MEAN / STD."""
    return torch.full((3, height, width), (level - MEAN[0]) / STD[0])


# --- palette -------------------------------------------------------------------------------------------------------

def test_palette_is_fixed():
    palette = class_palette(5)
    assert palette.dtype == np.uint8 and palette.shape == (5, 3)
    # black, then tab10's blue, orange, green, red
    assert palette.tolist() == [[0, 0, 0], [31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40]]
    # light partners after the ten strong colours: class 11 is tab20's light blue
    assert class_palette(21)[11].tolist() == [174, 199, 232]
    # beyond 20: PASCAL VOC's colour of id - 20 (1 -> (128, 0, 0), 2 -> (0, 128, 0), 3 -> (128, 128, 0),
    # 8 -> (64, 0, 0): the fourth bit is the second-highest bit of red)
    palette = class_palette(29)
    assert palette[21].tolist() == [128, 0, 0] and palette[22].tolist() == [0, 128, 0]
    assert palette[23].tolist() == [128, 128, 0] and palette[28].tolist() == [64, 0, 0]


def test_palette_is_distinct_and_a_prefix_of_larger_palettes():
    palette = class_palette(600)
    assert len({tuple(colour) for colour in palette.tolist()}) == 600
    for size in (0, 1, 20, 21, 150):
        np.testing.assert_array_equal(class_palette(size), palette[:size])


# --- overlay -------------------------------------------------------------------------------------------------------

def test_overlay_values_by_hand():
    image = np.array([[[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]],
                      [[0.2, 0.4, 0.6], [0.5, 0.5, 0.5]]])
    mask = np.array([[1, 0], [I, 2]])
    palette = np.array([[0, 0, 0], [255, 0, 0], [0, 51, 255]], dtype=np.uint8)
    result = overlay_mask(image, mask, palette, alpha=0.25, ignore_index=I)
    expected = np.array([
        [[0.75 * 0 + 0.25 * 1.0, 0.0, 0.0],                 # class 1 (red) over black
         [0.75 * 1.0, 0.75 * 1.0, 0.75 * 1.0]],             # class 0 (black) over white
        [[0.2, 0.4, 0.6],                                   # ignored: unchanged
         [0.75 * 0.5, 0.75 * 0.5 + 0.25 * 0.2, 0.75 * 0.5 + 0.25 * 1.0]],   # class 2: 51 / 255 = 0.2
    ])
    np.testing.assert_allclose(result, expected, rtol=1e-12, atol=1e-12)
    # alpha 1 paints the palette colour; tensors work too
    solid = overlay_mask(torch.tensor(image), torch.tensor(mask), palette, alpha=1.0, ignore_index=I)
    np.testing.assert_allclose(solid[0, 0], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(solid[1, 0], image[1, 0])


def test_overlay_rejects_a_mask_value_outside_the_palette():
    with pytest.raises(ValueError, match='mask value 7 is outside 0..2'):
        overlay_mask(np.zeros((2, 2, 3)), np.array([[0, 7], [1, 1]]), class_palette(3), 0.5, I)
    with pytest.raises(ValueError, match='same size'):
        overlay_mask(np.zeros((2, 2, 3)), np.zeros((2, 3), dtype=int), class_palette(3), 0.5, I)


def test_shrink_mask_is_nearest_at_pixel_centres():
    mask = np.arange(16).reshape(4, 4)
    # output pixel centres at 1 and 3 of the input
    assert _shrink_mask(mask, (2, 2)).tolist() == [[5, 7], [13, 15]]
    assert _shrink_mask(mask, (4, 4)).tolist() == mask.tolist()
    assert _display_size(2048, 2048) == (512, 512) and _display_size(1024, 2048) == (256, 512)
    assert _display_size(300, 200) == (300, 200)


# --- the grid ------------------------------------------------------------------------------------------------------

CLASS_NAMES = ['background', 'shirt', 'trouser']


def half_and_half(height, width, left, right):
    mask = torch.full((height, width), left, dtype=torch.long)
    mask[:, width // 2:] = right
    return mask


def test_grid_of_images_of_different_sizes(tmp_path):
    sizes = [(48, 64), (80, 40), (33, 33)]
    images = [normalised_grey(h, w) for h, w in sizes]
    true_masks = [half_and_half(h, w, 1, 2) for h, w in sizes]
    true_masks[2][:10] = I
    pred_masks = [torch.ones(h, w, dtype=torch.long) for h, w in sizes]
    labels = plot_segmentation_grid(images, MEAN, STD, true_masks, pred_masks, CLASS_NAMES, tmp_path / 'seg.png')
    assert labels == CLASS_NAMES, 'K <= 20: every class in the legend'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['seg.png']

    picture = read_png(tmp_path / 'seg.png')
    assert 400 < picture.shape[1] < 1200 and 600 < picture.shape[0] < 1400
    # grey 0.5 under class 1 (tab10 blue) and class 2 (orange) at alpha 0.5
    blended_blue = [0.5 * 127.5 + 0.5 * c for c in (31, 119, 180)]
    blended_orange = [0.5 * 127.5 + 0.5 * c for c in (255, 127, 14)]
    assert pixels_near(picture, blended_blue, 3) > 3000, 'ground truth left halves and all predictions'
    assert pixels_near(picture, blended_orange, 3) > 1000, 'ground truth right halves'


def test_grid_legend_lists_only_present_classes_when_there_are_many(tmp_path):
    names = [f'class {i}' for i in range(30)]
    images = torch.stack([normalised_grey(16, 16), normalised_grey(16, 16, 0.2)])
    true_masks = torch.stack([half_and_half(16, 16, 3, 25), half_and_half(16, 16, 3, I)])
    pred_masks = torch.stack([half_and_half(16, 16, 3, 7), half_and_half(16, 16, 29, 3)])
    labels = plot_segmentation_grid(images, MEAN, STD, true_masks, pred_masks, names, tmp_path / 'seg.png')
    assert labels == ['class 3', 'class 7', 'class 25', 'class 29']
    # max_images: only the first image's classes count
    labels = plot_segmentation_grid(images, MEAN, STD, true_masks, pred_masks, names, tmp_path / 'one.png',
                                    max_images=1)
    assert labels == ['class 3', 'class 7', 'class 25']
    assert read_png(tmp_path / 'one.png').shape[0] < read_png(tmp_path / 'seg.png').shape[0]


def test_grid_of_large_images_stays_small(tmp_path):
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 2048, 2048, generator=generator)
    true_masks = torch.randint(0, 3, (2, 2048, 2048), generator=generator)
    true_masks[:, :64] = I
    pred_masks = torch.randint(0, 3, (2, 2048, 2048), generator=generator)
    labels = plot_segmentation_grid(images, MEAN, STD, true_masks, pred_masks, CLASS_NAMES, tmp_path / 'big.png')
    assert labels == CLASS_NAMES
    picture = read_png(tmp_path / 'big.png')
    assert picture.shape[0] < 1000 and picture.shape[1] < 1000
    assert (tmp_path / 'big.png').stat().st_size < 3_000_000


def test_grid_edge_cases(tmp_path):
    grey = torch.rand(1, 1, 12, 10)
    mask = torch.zeros(1, 12, 10, dtype=torch.long)
    mask[0, 0, 0] = 4
    # no class names: ids as names, K from the largest id
    assert plot_segmentation_grid(grey, [0.5], [0.25], mask, mask, None, tmp_path / 'grey.png') == list('01234')
    assert read_png(tmp_path / 'grey.png').size > 0
    assert plot_segmentation_grid([], MEAN, STD, [], [], CLASS_NAMES, tmp_path / 'empty.png') == CLASS_NAMES
    assert read_png(tmp_path / 'empty.png').size > 0
    with pytest.raises(ValueError, match='masks are'):
        plot_segmentation_grid([normalised_grey(8, 8)], MEAN, STD, [torch.zeros(8, 9, dtype=torch.long)],
                               [torch.zeros(8, 9, dtype=torch.long)], CLASS_NAMES, tmp_path / 'bad.png')
