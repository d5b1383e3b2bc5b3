"""Segmentation pictures: the palette, solid masks and overlay values by hand, a grid PNG whose mask regions have
exactly their legend patch's colour (read back from the PNG), the built-in demo in its classes' colours, size."""
import contextlib

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image
from tiny_run import TINY_MODEL, TINY_SEG

from linvit.data.synthetic import MARK_COLOURS
from linvit.engine import load_config
from linvit.engine.plots import (
    IGNORE_COLOUR,
    _display_size,
    _shrink_mask,
    class_palette,
    colour_mask,
    ignore_colour,
    overlay_mask,
    plot_segmentation_grid,
)
from linvit.engine.tasks.segmentation import SegmentationTask

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


def png_pixel(picture: np.ndarray, display_xy) -> list:
    """The PNG's RGB at a matplotlib display point (pixels from the bottom left; the figure is saved at its own dpi)."""
    x, y = display_xy
    return picture[picture.shape[0] - 1 - int(y), int(x)].tolist()


def mask_pixel_in_png(picture, ax, row, col) -> list:
    """The PNG's RGB at the centre of mask pixel (row, col) of the image shown in ``ax``."""
    return png_pixel(picture, ax.transData.transform((col, row)))


def legend_colours(picture, fig) -> dict:
    """{legend label: the PNG's RGB at the centre of its patch}."""
    legend = fig.legends[0]
    return {text.get_text(): png_pixel(picture, patch.get_window_extent().get_points().mean(axis=0))
            for text, patch in zip(legend.get_texts(), legend.get_patches())}


# --- palette -------------------------------------------------------------------------------------------------------

def test_palette_is_fixed():
    palette = class_palette(5)
    assert palette.dtype == np.uint8 and palette.shape == (5, 3)
    # black, then tab10's blue, orange, green, red
    assert palette.tolist() == [[0, 0, 0], [31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40]]
    # light partners after the ten strong colours: class 11 is tab20's light blue
    assert class_palette(21)[11].tolist() == [174, 199, 232]
    # beyond 20: the colours farthest from all earlier ones (tests/engine/test_palette.py measures how far)
    assert class_palette(24)[21:].tolist() == [[0, 0, 255], [255, 34, 255], [0, 255, 0]]


def test_palette_is_distinct_and_a_prefix_of_larger_palettes():
    palette = class_palette(600)
    assert len({tuple(colour) for colour in palette.tolist()}) == 600
    for size in (0, 1, 20, 21, 150):
        np.testing.assert_array_equal(class_palette(size), palette[:size])


def test_ignore_colour_is_a_grey_that_no_class_uses():
    assert ignore_colour(class_palette(600)) == IGNORE_COLOUR == (255, 255, 255)
    assert ignore_colour(np.array([[255, 255, 255], [1, 2, 3]])) == (0, 0, 0)
    assert ignore_colour(np.array([[255, 255, 255], [0, 0, 0]])) == (254, 254, 254)


# --- solid masks and overlay ---------------------------------------------------------------------------------------

def test_colour_mask_by_hand():
    mask = np.array([[1, 0], [I, 2]])
    palette = np.array([[0, 0, 0], [255, 0, 0], [0, 51, 255]], dtype=np.uint8)
    painted = colour_mask(torch.tensor(mask), palette, ignore_index=I)
    assert painted.dtype == np.uint8
    assert painted.tolist() == [[[255, 0, 0], [0, 0, 0]], [[255, 255, 255], [0, 51, 255]]]
    # a palette that uses white: the ignored pixel takes the next neutral, black
    white_class = np.array([[255, 255, 255], [255, 0, 0], [0, 51, 255]], dtype=np.uint8)
    assert colour_mask(mask, white_class, I)[1, 0].tolist() == [0, 0, 0]
    assert colour_mask(mask, palette, I, ignored_rgb=(9, 9, 9))[1, 0].tolist() == [9, 9, 9]
    with pytest.raises(ValueError, match='mask value 7 is outside 0..2'):
        colour_mask(np.array([[0, 7]]), palette, I)


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
    assert labels == CLASS_NAMES + ['ignored (255)'], 'K <= 20: every class in the legend, then the ignored pixels'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['seg.png']

    picture = read_png(tmp_path / 'seg.png')
    assert 400 < picture.shape[1] < 1200 and 600 < picture.shape[0] < 1400
    # solid class 1 (tab10 blue) and class 2 (orange), not blended with the grey images
    assert pixels_near(picture, (31, 119, 180), 0) > 3000, 'ground truth left halves and all predictions'
    assert pixels_near(picture, (255, 127, 14), 0) > 1000, 'ground truth right halves'
    blended_blue = [0.5 * 127.5 + 0.5 * c for c in (31, 119, 180)]
    assert pixels_near(picture, blended_blue, 3) == 0


def test_mask_regions_have_exactly_their_legend_colour(tmp_path, saved_figures):
    # a noisy image: any blending of the masks with it would show as colours that are neither image nor legend
    image = torch.randn(3, 40, 60, generator=torch.Generator().manual_seed(0))
    truth = torch.full((40, 60), I, dtype=torch.long)       # columns 40..59 stay ignored
    truth[:, :20], truth[:, 20:40] = 1, 2
    prediction = torch.zeros(40, 60, dtype=torch.long)
    prediction[:, :30] = 1
    palette = np.array([[10, 20, 30], [200, 30, 40], [20, 40, 220]], dtype=np.uint8)
    names = ['background', 'red thing', 'blue thing']
    labels = plot_segmentation_grid([image], MEAN, STD, [truth], [prediction], names, tmp_path / 'seg.png',
                                    palette=palette)
    assert labels == names + ['ignored (255)']

    picture = read_png(tmp_path / 'seg.png')
    fig, = saved_figures
    _, truth_ax, prediction_ax = fig.axes
    legend = legend_colours(picture, fig)
    assert legend == {'background': [10, 20, 30], 'red thing': [200, 30, 40], 'blue thing': [20, 40, 220],
                      'ignored (255)': [255, 255, 255]}
    # the centre of each ground-truth region (row 20; columns 10, 30, 50) against the legend patch of its class
    assert mask_pixel_in_png(picture, truth_ax, 20, 10) == legend['red thing']
    assert mask_pixel_in_png(picture, truth_ax, 20, 30) == legend['blue thing']
    assert mask_pixel_in_png(picture, truth_ax, 20, 50) == legend['ignored (255)']
    assert mask_pixel_in_png(picture, prediction_ax, 20, 15) == legend['red thing']
    assert mask_pixel_in_png(picture, prediction_ax, 20, 45) == legend['background']
    # labelled columns 0..39: right in 0..19 only
    assert prediction_ax.get_title() == 'prediction (pixel acc 50.0%)'


def test_grid_refuses_a_palette_that_does_not_fit(tmp_path):
    masks = [torch.zeros(8, 8, dtype=torch.long)]
    with pytest.raises(ValueError, match='palette'):
        plot_segmentation_grid([normalised_grey(8, 8)], MEAN, STD, masks, masks, CLASS_NAMES, tmp_path / 'a.png',
                               palette=class_palette(2))
    with pytest.raises(ValueError, match='0..255'):
        plot_segmentation_grid([normalised_grey(8, 8)], MEAN, STD, masks, masks, CLASS_NAMES, tmp_path / 'b.png',
                               palette=[[0, 0, 0], [300, 0, 0], [0, 0, 1]])


def test_grid_legend_lists_only_present_classes_when_there_are_many(tmp_path):
    names = [f'class {i}' for i in range(30)]
    images = torch.stack([normalised_grey(16, 16), normalised_grey(16, 16, 0.2)])
    true_masks = torch.stack([half_and_half(16, 16, 3, 25), half_and_half(16, 16, 3, I)])
    pred_masks = torch.stack([half_and_half(16, 16, 3, 7), half_and_half(16, 16, 29, 3)])
    labels = plot_segmentation_grid(images, MEAN, STD, true_masks, pred_masks, names, tmp_path / 'seg.png')
    assert labels == ['class 3', 'class 7', 'class 25', 'class 29', 'ignored (255)']
    # max_images: only the first image's classes count, and it has no ignored pixels
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
    assert labels == CLASS_NAMES + ['ignored (255)']
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


# --- the built-in demo, through the task ---------------------------------------------------------------------------

class AlwaysClass(nn.Module):
    """A stand-in segmentation model: logits [B, K, H, W] that pick ``label`` at every pixel."""

    def __init__(self, label: int, num_classes: int = 3):
        super().__init__()
        self.label, self.num_classes = label, num_classes

    def forward(self, images):
        logits = torch.zeros(images.shape[0], self.num_classes, *images.shape[-2:])
        logits[:, self.label] = 1.0
        return logits


def inner_pixel_of(mask: torch.Tensor, label: int):
    """(row, col) of a pixel of ``label`` whose 3x3 neighbourhood is all ``label``, away from region edges."""
    same = mask == label
    inner = same[1:-1, 1:-1] & same[:-2, 1:-1] & same[2:, 1:-1] & same[1:-1, :-2] & same[1:-1, 2:]
    rows, cols = torch.nonzero(inner, as_tuple=True)
    return int(rows[0]) + 1, int(cols[0]) + 1


def test_the_demo_draws_red_key_in_red_and_blue_key_in_blue(tmp_path, saved_figures):
    task = SegmentationTask(load_config(None, [*TINY_MODEL, *TINY_SEG, 'data.synthetic.val_size=4']))
    _, val, names = task.build_datasets(MEAN, STD)
    assert names == ['background', 'red-key', 'blue-key']
    red_key = names.index('red-key')
    task.save_pictures(AlwaysClass(red_key), val, names, str(tmp_path / 'val.png'), MEAN, STD, torch.device('cpu'),
                       contextlib.nullcontext)

    picture = read_png(tmp_path / 'val.png')
    fig, = saved_figures
    legend = legend_colours(picture, fig)
    for name, (r, g, b) in legend.items():
        if name == 'red-key':
            assert r > 150 and g < 100 and b < 100, name
        if name == 'blue-key':
            assert b > 150 and r < 100 and g < 100, name
    assert legend['red-key'] == list(MARK_COLOURS['red']) and legend['blue-key'] == list(MARK_COLOURS['blue'])
    # every prediction panel is all red-key, in the legend's red
    for prediction_ax in fig.axes[2::3]:
        assert mask_pixel_in_png(picture, prediction_ax, 16, 16) == legend['red-key']
    # each drawn sample's shapes, in its ground-truth panel, in the colour of their class
    shown_classes = set()
    for index, truth_ax in zip(range(len(val)), fig.axes[1::3]):
        mask = val[(index, 0)][1]
        for label in set(mask.unique().tolist()) - {I}:
            assert mask_pixel_in_png(picture, truth_ax, *inner_pixel_of(mask, label)) == legend[names[label]]
            shown_classes.add(label)
    assert shown_classes == {0, 1, 2}, 'the drawn samples have keys of both colours'
