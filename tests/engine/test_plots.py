"""Curves from metrics.csv, the prediction grid and the confusion matrix: valid PNGs, the right panels and series,
the right pixels; the tasks' evaluation pictures."""
import csv

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from matplotlib import colormaps
from PIL import Image
from tiny_run import TINY_MODEL, TINY_SEG

from linvit.engine import load_config
from linvit.engine.plots import (
    CORRECT_COLOUR,
    WRONG_COLOUR,
    _centred_moving_average,
    _compact_count,
    _curve_panels,
    _read_metrics_csv,
    plot_confusion_matrix,
    plot_curves,
    plot_prediction_grid,
)
from linvit.engine.tasks.base import Task
from linvit.engine.tasks.classification import CONFUSION_UP_TO, ClassificationTask
from linvit.engine.tasks.segmentation import SegmentationTask

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


# --- confusion matrix ---------------------------------------------------------------------------------------------

def cell_colour(picture, ax, row, col) -> np.ndarray:
    """The PNG's RGB inside cell (row, col) of the matrix shown in ``ax``, off its centre where the count is written."""
    x, y = ax.transData.transform((col + 0.3, row - 0.3))
    return picture[picture.shape[0] - 1 - int(y), int(x)]


def cell_texts(ax) -> dict:
    """{(row, col): (text, colour)} of the counts written in the cells."""
    return {(int(t.get_position()[1]), int(t.get_position()[0])): (t.get_text(), t.get_color()) for t in ax.texts}


def blues(fraction) -> np.ndarray:
    return np.array([round(255 * c) for c in colormaps['Blues'](fraction)[:3]])


def test_confusion_matrix_rows_are_true_classes_coloured_by_their_fraction(tmp_path, saved_figures):
    matrix = torch.tensor([[2, 6],     # true cat: 2 called cat, 6 called dog
                           [0, 8]])    # true dog: all 8 called dog
    plot_confusion_matrix(matrix, ['cat', 'dog'], tmp_path / 'confusion.png')
    assert sorted(p.name for p in tmp_path.iterdir()) == ['confusion.png']
    picture = read_png(tmp_path / 'confusion.png')
    fig, = saved_figures
    ax = fig.axes[0]
    # fractions of each row, by hand: 2/8, 6/8 and 0/8, 8/8 (a transposed or column-normalised picture differs)
    for (row, col), fraction in {(0, 0): 0.25, (0, 1): 0.75, (1, 0): 0.0, (1, 1): 1.0}.items():
        assert np.abs(cell_colour(picture, ax, row, col) - blues(fraction)).max() <= 1, (row, col)
    assert cell_texts(ax) == {(0, 0): ('2', 'black'), (0, 1): ('6', 'white'),
                              (1, 0): ('0', 'black'), (1, 1): ('8', 'white')}
    assert [t.get_text() for t in ax.get_xticklabels()] == ['cat', 'dog']
    assert [t.get_text() for t in ax.get_yticklabels()] == ['cat', 'dog']
    assert (ax.get_xlabel(), ax.get_ylabel()) == ('predicted class', 'true class')
    assert ax.get_title() == 'confusion matrix (16 counted, accuracy 62.5%)'


def test_large_confusion_matrix_is_not_annotated_and_empty_rows_are_grey(tmp_path, saved_figures):
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randint(1, 50, (30, 30), generator=generator)
    matrix[4] = 0                                   # class 4 has no samples
    plot_confusion_matrix(matrix.numpy(), [f'class {i}' for i in range(30)], tmp_path / 'thirty.png')
    picture = read_png(tmp_path / 'thirty.png')
    ax = saved_figures[-1].axes[0]
    assert len(ax.texts) == 0 and len(ax.get_xticklabels()) == 30
    assert cell_colour(picture, ax, 4, 7).tolist() == [217, 217, 217]
    plot_confusion_matrix(torch.ones(60, 60, dtype=torch.long), None, tmp_path / 'sixty.png')
    assert saved_figures[-1].axes[0].get_xticklabels()[0].get_text() != '0', 'no class names above 50 classes'
    assert read_png(tmp_path / 'sixty.png').shape[0] < 1500


def test_confusion_matrix_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match='square'):
        plot_confusion_matrix(np.zeros((2, 3), dtype=int), None, tmp_path / 'a.png')
    with pytest.raises(ValueError, match='3 class names'):
        plot_confusion_matrix(np.zeros((2, 2), dtype=int), ['a', 'b', 'c'], tmp_path / 'b.png')
    assert not list(tmp_path.iterdir())


def test_compact_counts_fit_a_cell():
    assert [_compact_count(n) for n in (0, 999, 1000, 1234, 56_000, 3_400_000, 56_000_000, 7 * 10 ** 9)] == \
        ['0', '999', '1.0k', '1.2k', '56k', '3.4M', '56M', '7.0G']


# --- the tasks' evaluation pictures -------------------------------------------------------------------------------

CONFUSION_LOGITS = torch.tensor([[2.0, 0.1, 0.3], [0.2, 1.5, 0.1], [0.0, 0.1, 3.0], [1.0, 0.0, 0.5]])
CONFUSION_TARGETS = torch.tensor([0, 0, 2, 1])   # -> confusion [[1, 1, 0], [1, 0, 0], [0, 0, 1]] (rows: target)


def test_classification_task_draws_its_confusion_matrix(tmp_path, tiny_config, saved_figures):
    task, png = ClassificationTask(tiny_config()), tmp_path / 'confusion.png'
    names = ['a', 'b', 'c']
    # before build_model the task does not know the class count: its meter keeps no matrix, so no picture
    assert task.plot_evaluation(task.new_meter(torch.device('cpu')), names, str(png)) is False and not png.exists()

    task.build_model(3)
    meter = task.new_meter(torch.device('cpu'))
    task.evaluate_batch(lambda images: CONFUSION_LOGITS, None, CONFUSION_TARGETS, meter)
    meter.reduce_()
    assert task.plot_evaluation(meter, names, str(png)) is True and png.exists()
    texts = {cell: text for cell, (text, _) in cell_texts(saved_figures[-1].axes[0]).items()}
    assert texts == {(0, 0): '1', (0, 1): '1', (0, 2): '0', (1, 0): '1', (1, 1): '0', (1, 2): '0',
                     (2, 0): '0', (2, 1): '0', (2, 2): '1'}
    assert task.final_metrics(meter.compute()) == {'top1': 0.5, 'top5': 1.0, 'count': 4, 'loss': pytest.approx(
        F.cross_entropy(CONFUSION_LOGITS, CONFUSION_TARGETS).item())}

    task.num_classes = CONFUSION_UP_TO + 1   # ImageNet-21k sized: no C x C counters
    assert task.new_meter(torch.device('cpu')).num_classes is None


def test_segmentation_task_draws_its_pixel_confusion_matrix(tmp_path, saved_figures):
    task = SegmentationTask(load_config(None, [*TINY_MODEL, *TINY_SEG]))
    task.build_model(3)
    meter = task.new_meter(torch.device('cpu'))
    logits = CONFUSION_LOGITS.T.reshape(1, 3, 2, 2)            # pixels in the same order as the rows above
    targets = CONFUSION_TARGETS.reshape(1, 2, 2).clone()
    targets[0, 1, 1] = 255                                    # the last pixel (target 1 -> 0) is ignored
    meter.update(logits, targets, torch.tensor(1.0))
    meter.reduce_()
    png = tmp_path / 'pixels.png'
    assert task.plot_evaluation(meter, ['background', 'x', 'y'], str(png)) is True and png.exists()
    texts = {cell: text for cell, (text, _) in cell_texts(saved_figures[-1].axes[0]).items()}
    assert texts == {(0, 0): '1', (0, 1): '1', (0, 2): '0', (1, 0): '0', (1, 1): '0', (1, 2): '0',
                     (2, 0): '0', (2, 1): '0', (2, 2): '1'}
    ax = saved_figures[-1].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ['background', 'x', 'y']


def test_tasks_without_an_evaluation_picture_draw_nothing(tmp_path, tiny_config):
    assert Task(tiny_config()).plot_evaluation(object(), [], str(tmp_path / 'none.png')) is False
    task = ClassificationTask(tiny_config())
    assert task.plot_evaluation(object(), [], str(tmp_path / 'none.png')) is False
    assert not list(tmp_path.iterdir())
