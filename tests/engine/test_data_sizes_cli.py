"""train.py on classification data that cannot give a silently wrong answer, and at non-square sizes (issue 48,
items 2, 6c, 6d): one class, or a class folder without images, is refused in one line naming the folder; every
refusal on unreadable files names data.max_bad_fraction; data.img_size=[H, W] trains, resumes, evaluates, predicts
and exports at H x W, with an H/p x W/p patch grid."""
import csv
import importlib.util
import json
import logging
import os

import cv2
import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from tiny_run import TINY_MODEL, TINY_RUN, TINY_SEG

from linvit.engine.loading import WeightsMismatchError, load_trained, resample_position_embeddings
from linvit.export import load_export_source

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLS_FOLDER = os.path.join(ROOT, 'configs', 'cls_folder.yaml')
#: H x W = 32 x 48 with patch 8: a 4 x 6 grid; images 300 wide, 200 high have that aspect
NON_SQUARE = 'data.img_size=[32,48]'


def _script(path):
    """A command-line script (train.py, tools/predict.py) loaded as a module, to call its main() in this process."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_py, predict_py = _script('train.py'), _script('tools/predict.py')


def _train(capsys, *argv):
    """(exit status, stderr lines) of train.py's main() run in this process."""
    status = train_py.main([str(a) for a in argv])
    return status, capsys.readouterr().err.strip().splitlines()


def _one_line(err, prefix):
    """The single train.py line of ``err``, which starts with ``prefix`` (no traceback)."""
    lines = [line for line in err if line.startswith('train.py:')]
    assert len(lines) == 1 and lines[0].startswith(prefix) and not any('Traceback' in line for line in err), err
    return lines[0]


def _write_folder(root, per_class, classes=('a', 'b'), size=(200, 300), splits=('train', 'val')):
    """root/<split>/<class>/<i>.png of ``size`` (height, width): each class has its own mean colour, plus noise."""
    rng = np.random.default_rng(0)
    for split in splits:
        for label, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = rng.integers(0, 60, (*size, 3)) + np.array([180, 20, 20]) * (label % 2) + 30
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f'{i}.png')
    return root


def _folder_run(tmp_path, data, *overrides):
    return ['--config', CLS_FOLDER, f'data.root={data}', *TINY_MODEL, *TINY_RUN, 'train.epochs=1',
            f'output_dir={tmp_path / "run"}', *overrides]


# ---------------------------------------------------------------------------------------------------- item 2

@pytest.mark.parametrize('cache', ['false', 'true'])
def test_a_folder_of_one_class_is_refused_in_one_line(capsys, tmp_path, cache):
    data = _write_folder(tmp_path / 'data', per_class=2, classes=('cats',))
    status, err = _train(capsys, *_folder_run(tmp_path, data, f'data.cache={cache}'))
    line = _one_line(err, 'train.py: error: ')
    assert status == 1
    assert f"{data / 'train'} has 1 class folder (cats)" in line and 'at least 2 classes' in line
    assert 'add a folder of images for each other class' in line
    assert not (tmp_path / 'run' / 'last.pt').exists() and not (tmp_path / 'run' / 'metrics.json').exists()


@pytest.mark.parametrize('cache', ['false', 'true'])
def test_a_training_class_folder_without_images_is_refused_in_one_line(capsys, tmp_path, cache):
    data = _write_folder(tmp_path / 'data', per_class=2, classes=('a', 'b'))
    (data / 'train' / 'c').mkdir()
    (data / 'train' / 'c' / 'notes.txt').write_text('no images yet')
    (data / 'val' / 'c').mkdir()
    status, err = _train(capsys, *_folder_run(tmp_path, data, f'data.cache={cache}'))
    line = _one_line(err, 'train.py: error: ')
    assert status == 1
    assert f"class folders without images under {data / 'train'}: {data / 'train' / 'c'};" in line
    assert 'add images to them or remove them' in line
    assert not (tmp_path / 'run' / 'last.pt').exists()


def test_a_class_absent_from_validation_only_trains_with_a_warning(capsys, caplog, tmp_path):
    # a validation split need not hold every class: that class is then not evaluated (nothing is wrong with the run)
    data = _write_folder(tmp_path / 'data', per_class=4, classes=('a', 'b', 'c'), size=(16, 16))
    for image in (data / 'val' / 'c').iterdir():
        image.unlink()
    with caplog.at_level(logging.WARNING, logger='linvit.data'):
        status, err = _train(capsys, *_folder_run(tmp_path, data, 'train.max_steps=1'))
    assert status == 0, err[-3:]
    assert any(f"class folder {data / 'val' / 'c'} has no images: its class is not evaluated" in r.getMessage()
               for r in caplog.records)


def _seg_folder_with_undecodable_images(root, good=3, bad=1):
    for split in ('train', 'val'):
        for folder in ('images', 'masks'):
            (root / split / folder).mkdir(parents=True)
        for i in range(good + bad):
            Image.fromarray(np.zeros((32, 32), np.uint8)).save(root / split / 'masks' / f'{i}.png')
            if i < good:
                Image.fromarray(np.full((32, 32, 3), 40 * i, np.uint8)).save(root / split / 'images' / f'{i}.png')
            else:
                (root / split / 'images' / f'{i}.png').write_bytes(b'\x89PNG\r\n\x1a\n not really a png')
    (root / 'classes.txt').write_text('background\nthing\n')
    return root


@pytest.mark.parametrize('task', ['classification', 'segmentation'])
def test_too_many_unreadable_files_name_data_max_bad_fraction(capsys, tmp_path, task):
    if task == 'classification':
        data = _write_folder(tmp_path / 'data', per_class=3, size=(16, 16))
        (data / 'train' / 'a' / 'broken.jpg').write_bytes(b'\xff\xd8\xff not really a jpeg')
        argv = _folder_run(tmp_path, data, 'data.max_bad_fraction=0.05')
    else:
        data = _seg_folder_with_undecodable_images(tmp_path / 'data')
        argv = ['--config', os.path.join(ROOT, 'configs', 'seg_folder.yaml'), f'data.root={data}', *TINY_MODEL,
                *TINY_SEG, 'data.batch_size=2', 'data.max_bad_fraction=0.05',
                f'output_dir={tmp_path / "run"}']
    status, err = _train(capsys, *argv)
    line = _one_line(err, 'train.py: error: ')
    assert status == 1
    assert 'more than data.max_bad_fraction=0.05 (5.00%)' in line and 'or raise data.max_bad_fraction' in line


# ---------------------------------------------------------------------------------------------------- item 6: sizes

@pytest.mark.parametrize('value', ['[32,48,64]', '32x48', '[32,0]', '1.5'])
def test_an_image_size_that_is_no_side_or_pair_is_one_config_line(capsys, tmp_path, value):
    status, err = _train(capsys, '--config', os.path.join(ROOT, 'configs', 'cls_demo.yaml'), *TINY_MODEL, *TINY_RUN,
                         f'data.img_size={value}', f'output_dir={tmp_path / "run"}')
    line = _one_line(err, "train.py: config error: bad value for 'data.img_size': ")
    assert status == 2 and 'data.img_size=[224,320]' in line


@pytest.mark.parametrize('overrides, phrase', [
    ([*TINY_SEG, NON_SQUARE], 'task=segmentation takes one side'),
    (['task=linearize', 'linearize.teacher=nowhere', NON_SQUARE], 'task=linearize takes one side'),
    ([*TINY_RUN, 'data.img_size=[32,44]'], 'data.img_size=[32, 44]: the width 44 is not a multiple of the patch '
                                           'size 8'),
])
def test_a_pair_a_task_cannot_take_is_one_config_line(capsys, tmp_path, overrides, phrase):
    status, err = _train(capsys, '--config', os.path.join(ROOT, 'configs', 'cls_demo.yaml'), *TINY_MODEL, *overrides,
                         f'output_dir={tmp_path / "run"}')
    assert status == 2 and phrase in _one_line(err, 'train.py: config error: ')


@pytest.fixture(scope='module')
def non_square_run(tmp_path_factory):
    """A tiny classification run at data.img_size=[32,48] on 300 x 200 px images (two colours), stopped after 2 steps
    and resumed to 4; its data folder."""
    base = tmp_path_factory.mktemp('non_square')
    data = _write_folder(base / 'data', per_class=8, size=(200, 300))
    run = base / 'run'
    argv = ['--config', CLS_FOLDER, f'data.root={data}', *TINY_MODEL, *TINY_RUN, NON_SQUARE, 'train.epochs=2',
            'train.max_steps=2', f'output_dir={run}']
    assert train_py.main(argv) == 0
    assert train_py.main(['--resume', str(run), 'train.max_steps=4']) == 0
    return run, data


def test_a_non_square_run_trains_and_resumes_at_its_size(non_square_run):
    run, _ = non_square_run
    trained = load_trained(str(run))
    assert trained.img_size == (32, 48)
    assert tuple(trained.model.patch_embed.grid_size) == (4, 6)                 # H/p x W/p
    assert trained.model.pos_embed.shape == (1, 1 + 4 * 6, 48)
    with open(run / 'metrics.csv', newline='') as f:
        steps = [int(row['step']) for row in csv.DictReader(f) if row['split'] == 'train']
    assert steps == [1, 2, 3, 4]                                                 # stopped at 2, resumed to 4
    assert yaml.safe_load((run / 'config.yaml').read_text())['data']['img_size'] == [32, 48]


def test_eval_only_of_a_non_square_run_rebuilds_its_size(capsys, non_square_run, tmp_path):
    run, _ = non_square_run
    status, err = _train(capsys, '--eval-only', run, '--out', tmp_path / 'again')   # model.safetensors
    assert status == 0, err[-3:]
    with open(tmp_path / 'again' / 'metrics.json') as f, open(run / 'metrics.json') as g:
        assert json.load(f) == pytest.approx(json.load(g), rel=1e-6)          # the run's own last evaluation


def test_eval_only_at_another_size_resamples_the_non_square_grid(capsys, caplog, non_square_run, tmp_path):
    run, _ = non_square_run
    with caplog.at_level(logging.INFO, logger='linvit.engine'):
        status, err = _train(capsys, '--eval-only', run / 'best.pt', 'data.img_size=[48,64]', '--out', tmp_path)
    assert status == 0, err[-3:]
    assert any('pos_embed resampled from 25 to 49 tokens' in r.getMessage() for r in caplog.records)  # 4x6 -> 6x8


def test_the_non_square_grid_is_resampled_as_a_grid_of_its_own_shape():
    old = timm.create_model('linvit_tiny_patch16_224', depth=1, embed_dim=48, num_heads=3, patch_size=8,
                            img_size=(32, 48), num_classes=2)
    new = timm.create_model('linvit_tiny_patch16_224', depth=1, embed_dim=48, num_heads=3, patch_size=8,
                            img_size=(48, 64), num_classes=2)
    fitted = resample_position_embeddings(new, old.state_dict(), trained_size=(32, 48))
    # by hand: the 4 x 6 patch grid as an image, bicubic to 6 x 8 (timm's resample: antialiased), class token kept
    pos = old.pos_embed.detach()
    grid = pos[:, 1:].reshape(1, 4, 6, 48).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(6, 8), mode='bicubic', antialias=True, align_corners=False)
    expected = torch.cat([pos[:, :1], expected.permute(0, 2, 3, 1).reshape(1, 48, 48)], dim=1)
    torch.testing.assert_close(fitted['pos_embed'], expected, rtol=1e-5, atol=1e-6)
    # a square reading of those 24 positions does not exist: without the training size that is one line, not a guess
    with pytest.raises(WeightsMismatchError, match=r'^pos_embed holds 24 patch positions, no square grid'):
        resample_position_embeddings(new, old.state_dict())


def test_predict_resizes_a_300x200_image_to_the_trained_height_and_width(capsys, non_square_run, tmp_path):
    run, data = non_square_run
    image = data / 'val' / 'b' / '0.png'
    assert Image.open(image).size == (300, 200)                                   # width x height
    assert predict_py.main([str(run), str(image), '--out', str(tmp_path), '--top-k', '2']) == 0
    with open(tmp_path / 'predictions.csv', newline='') as f:
        rows = list(csv.DictReader(f))
    # the reference: the file resized to 48 wide, 32 high by cv2 (albumentations' Resize), normalised, classified
    trained = load_trained(str(run))
    pixels = cv2.resize(np.asarray(Image.open(image).convert('RGB')), (48, 32), interpolation=cv2.INTER_LINEAR)
    x = (torch.from_numpy(pixels).permute(2, 0, 1).float() / 255 - torch.tensor(trained.mean)[:, None, None]) \
        / torch.tensor(trained.std)[:, None, None]
    with torch.no_grad():
        probs = trained.model(x[None]).softmax(-1)[0]
    assert [row['class_name'] for row in rows] == [trained.class_names[i] for i in probs.argsort(descending=True)]
    assert [float(row['probability']) for row in rows] == pytest.approx(probs.sort(descending=True).values.tolist(),
                                                                        abs=1e-5)


def test_export_traces_a_non_square_run_at_its_size(non_square_run):
    run, _ = non_square_run
    assert load_export_source(str(run)).img_size == (32, 48)


def test_a_non_square_teacher_is_refused_by_linearize_in_one_line(capsys, non_square_run, tmp_path):
    run, _ = non_square_run
    status, err = _train(capsys, '--config', os.path.join(ROOT, 'configs', 'cls_demo.yaml'), *TINY_RUN,
                         'task=linearize', f'linearize.teacher={run}', f'output_dir={tmp_path / "lin"}')
    line = _one_line(err, 'train.py: config error: ')
    assert status == 2 and f"linearize.teacher {run} was trained at data.img_size=[32, 48]" in line
