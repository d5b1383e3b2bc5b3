"""Curves from metrics.csv and the prediction grid: valid PNGs, the right panels and series, the right pixels."""
import csv

import numpy as np
import pytest
import torch
from PIL import Image

from linvit.engine.plots import (
    CORRECT_COLOUR,
    WRONG_COLOUR,
    _centred_moving_average,
    _curve_panels,
    _read_metrics_csv,
    plot_curves,
    plot_prediction_grid,
)

COLUMNS = ['epoch', 'step', 'split', 'loss', 'lr', 'img_per_s', 'top1', 'top5']
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def write_csv(path, rows, columns=COLUMNS):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, '') for c in columns})
    return path


def training_rows(epochs=3, steps_per_epoch=40, with_val=True):
    rows, step = [], 0
    for epoch in range(epochs):
        for _ in range(steps_per_epoch):
            step += 1
            rows.append({'epoch': epoch, 'step': step, 'split': 'train', 'loss': 2.3 * 0.99 ** step + 0.05 * (step % 3),
                         'lr': 1e-3 * min(1.0, step / 30), 'img_per_s': 850.0 + step % 7})
        if with_val:
            rows.append({'epoch': epoch, 'step': step, 'split': 'val', 'loss': 2.0 - 0.4 * epoch,
                         'top1': 0.30 + 0.6 * (1 - 0.5 ** epoch), 'top5': 0.70 + 0.25 * (1 - 0.5 ** epoch)})
    return rows


def read_png(path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.format == 'PNG'
        return np.asarray(image.convert('RGB')).astype(int)


def panels_of(path):
    return _curve_panels(*_read_metrics_csv(path))


def test_curves_of_a_full_run(tmp_path):
    csv_path = write_csv(tmp_path / 'metrics.csv', training_rows())
    png_path = tmp_path / 'curves.png'
    plot_curves(csv_path, png_path, title='linvit_tiny on fashion-mnist')
    assert read_png(png_path).shape[0] > 500
    assert sorted(p.name for p in tmp_path.iterdir()) == ['curves.png', 'metrics.csv']

    loss, val, lr = panels_of(csv_path)
    assert [s.label for s in loss.series] == ['train loss', 'val loss']
    assert loss.series[0].steps.size == 120 and loss.series[0].smooth and not loss.series[0].markers
    np.testing.assert_allclose(loss.series[1].values, [2.0, 1.6, 1.2])
    np.testing.assert_allclose(loss.series[1].steps, [40, 80, 120])
    # top-k arrive as fractions and are shown in percent; img_per_s has no val values and is left out
    assert val.ylabel == 'percent' and [s.label for s in val.series] == ['top1 (%)', 'top5 (%)']
    np.testing.assert_allclose(val.series[0].values, [30.0, 60.0, 75.0])
    assert [s.label for s in lr.series] == ['lr'] and lr.series[0].values.max() == pytest.approx(1e-3)
    assert not lr.series[0].smooth, 'the schedule is exact: averaging would blur the warm-up'


def test_centred_moving_average_by_hand():
    values = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    np.testing.assert_allclose(_centred_moving_average(values, 3), [1.5, 2.0, 3.0, 17 / 3, 7.0])
    np.testing.assert_allclose(_centred_moving_average(values, 1), values)


def test_metrics_that_are_not_fractions_stay_as_they_are(tmp_path):
    rows = [{'epoch': 0, 'step': 10, 'split': 'val', 'loss': 1.0, 'top1': 0.5, 'mae': 3.25}]
    csv_path = write_csv(tmp_path / 'metrics.csv', rows, ['epoch', 'step', 'split', 'loss', 'top1', 'mae'])
    _, val = panels_of(csv_path)
    assert val.ylabel == 'value' and [s.label for s in val.series] == ['top1', 'mae']
    assert val.series[1].values.tolist() == [3.25]


@pytest.mark.parametrize('rows, panel_names', [
    (training_rows(with_val=False), ['loss', 'learning rate']),
    (training_rows(epochs=1, steps_per_epoch=1, with_val=False), ['loss', 'learning rate']),
    ([{'epoch': 0, 'step': 5, 'split': 'val', 'loss': 1.5, 'top1': 0.4}], ['loss', 'validation metrics']),
    ([], []),
], ids=['train-only', 'one-row', 'one-val-row', 'header-only'])
def test_curves_of_partial_csvs(tmp_path, rows, panel_names):
    csv_path = write_csv(tmp_path / 'metrics.csv', rows)
    assert [p.title for p in panels_of(csv_path)] == panel_names
    plot_curves(csv_path, tmp_path / 'curves.png')
    assert read_png(tmp_path / 'curves.png').size > 0


def test_more_panels_make_a_taller_picture(tmp_path):
    plot_curves(write_csv(tmp_path / 'full.csv', training_rows()), tmp_path / 'full.png')
    plot_curves(write_csv(tmp_path / 'train.csv', training_rows(with_val=False)), tmp_path / 'train.png')
    assert read_png(tmp_path / 'full.png').shape[0] > read_png(tmp_path / 'train.png').shape[0]


def normalise(images):
    mean = torch.tensor(IMAGENET_MEAN).reshape(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).reshape(1, 3, 1, 1)
    return (images - mean) / std


def solid(rgb, size=8):
    return torch.tensor(rgb, dtype=torch.float32).reshape(3, 1, 1).expand(3, size, size)


def pixels_near(picture: np.ndarray, rgb, tolerance: int) -> np.ndarray:
    """Bool [H, W]: pixels within ``tolerance`` of ``rgb`` in every channel."""
    return (np.abs(picture - np.asarray(rgb)) <= tolerance).all(axis=-1)


def hex_to_rgb(colour: str):
    return [int(colour[i:i + 2], 16) for i in (1, 3, 5)]


CLASS_NAMES = ['t-shirt', 'trouser', 'pullover', 'dress', 'coat']


def fake_predictions(count=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.stack([solid([1.0, 0.0, 0.0]), solid([0.0, 0.0, 1.0])]
                         + [torch.rand(3, 8, 8, generator=generator) for _ in range(count - 2)])
    true_labels = torch.tensor([0, 1, 2, 3, 4][:count])
    pred_labels = torch.tensor([0, 2, 2, 1, 4][:count])
    probs = torch.softmax(torch.randn(count, 5, generator=generator) * 3, dim=1)
    return normalise(images), true_labels, pred_labels, probs


def test_prediction_grid_titles_and_colours(tmp_path):
    images, true_labels, pred_labels, probs = fake_predictions()
    titles = plot_prediction_grid(images, IMAGENET_MEAN, IMAGENET_STD, true_labels, pred_labels, CLASS_NAMES,
                                  tmp_path / 'pred.png', probs=probs)
    p = probs[torch.arange(5), pred_labels].tolist()
    assert titles == [
        (f'true: t-shirt\npred: t-shirt (p={p[0]:.2f})', CORRECT_COLOUR),
        (f'true: trouser\npred: pullover (p={p[1]:.2f})', WRONG_COLOUR),
        (f'true: pullover\npred: pullover (p={p[2]:.2f})', CORRECT_COLOUR),
        (f'true: dress\npred: trouser (p={p[3]:.2f})', WRONG_COLOUR),
        (f'true: coat\npred: coat (p={p[4]:.2f})', CORRECT_COLOUR),
    ]
    assert sorted(path.name for path in tmp_path.iterdir()) == ['pred.png']


def test_prediction_grid_shows_the_unnormalised_images_in_order(tmp_path):
    images, true_labels, pred_labels, probs = fake_predictions()
    plot_prediction_grid(images, IMAGENET_MEAN, IMAGENET_STD, true_labels, pred_labels, CLASS_NAMES,
                         tmp_path / 'pred.png', probs=probs)
    picture = read_png(tmp_path / 'pred.png')
    red = pixels_near(picture, [255, 0, 0], tolerance=3)
    blue = pixels_near(picture, [0, 0, 255], tolerance=3)
    # each solid image fills a panel of roughly 2 x 2 inches at 100 dpi
    assert red.sum() > 5000 and blue.sum() > 5000
    red_y, red_x = np.argwhere(red).mean(axis=0)
    blue_y, blue_x = np.argwhere(blue).mean(axis=0)
    assert red_x < blue_x and abs(red_y - blue_y) < 5, 'image 0 and image 1 side by side, 0 first'
    assert red_y < picture.shape[0] / 2, 'both in the top row of a 3 x 2 grid'


def test_prediction_grid_title_colours_reach_the_png(tmp_path):
    images, true_labels, pred_labels, probs = fake_predictions()
    plot_prediction_grid(images, IMAGENET_MEAN, IMAGENET_STD, true_labels, pred_labels, CLASS_NAMES,
                         tmp_path / 'mixed.png')
    plot_prediction_grid(images, IMAGENET_MEAN, IMAGENET_STD, true_labels, true_labels, CLASS_NAMES,
                         tmp_path / 'all_right.png')
    mixed, all_right = read_png(tmp_path / 'mixed.png'), read_png(tmp_path / 'all_right.png')
    green_rgb, red_rgb = hex_to_rgb(CORRECT_COLOUR), hex_to_rgb(WRONG_COLOUR)
    assert pixels_near(mixed, green_rgb, 10).sum() > 50 and pixels_near(mixed, red_rgb, 10).sum() > 50
    assert pixels_near(all_right, green_rgb, 10).sum() > 50 and pixels_near(all_right, red_rgb, 10).sum() == 0


def test_prediction_grid_edge_cases(tmp_path):
    generator = torch.Generator().manual_seed(0)
    grey = torch.rand(20, 1, 6, 6, generator=generator)
    labels = torch.arange(20) % 3
    titles = plot_prediction_grid(grey, [0.5], [0.25], labels, labels, None, tmp_path / 'grey.png',
                                  probs=torch.full((20,), 0.5), max_images=9)
    assert len(titles) == 9 and titles[4] == ('true: 1\npred: 1 (p=0.50)', CORRECT_COLOUR)
    assert read_png(tmp_path / 'grey.png').size > 0
    assert plot_prediction_grid(grey[:0], [0.5], [0.25], [], [], None, tmp_path / 'empty.png') == []
    assert read_png(tmp_path / 'empty.png').size > 0
