"""train.py's contract with its users: every expected failure ends with one line on stderr and exit status 2 (the
command line or a config is wrong) or 1 (a file or the data is wrong); saved weights load into the architecture
they were trained with, whatever --config file says where the data lives; another data.img_size resamples the
position embedding exactly as timm does for pretrained weights."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
import torch.nn as nn
from PIL import Image
from safetensors.torch import save_file
from timm.models.vision_transformer import checkpoint_filter_fn
from tiny_run import TINY_MODEL, TINY_RUN
from torch.utils.data import DataLoader, Dataset

from linvit.data import DataError
from linvit.engine import config_from_yaml, evaluate, load_config
from linvit.engine.checkpoint import load_checkpoint

pytestmark = pytest.mark.integration  # trains or starts interpreters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLS_DEMO = os.path.join(ROOT, 'configs', 'cls_demo.yaml')


def _load_cli():
    spec = importlib.util.spec_from_file_location('train_cli', os.path.join(ROOT, 'train.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = _load_cli()


def _main(capsys, *argv):
    """(exit status, stderr lines) of train.py's main() run in this process."""
    status = cli.main([str(a) for a in argv])
    return status, capsys.readouterr().err.strip().splitlines()


def _metrics(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope='module')
def cls_run(tmp_path_factory, shared_run):
    """A finished tiny classification run (32 px, patch 8: a 4x4 grid of position embeddings)."""
    return shared_run('cls', tmp_path_factory.mktemp('contract') / 'cls')


@pytest.fixture(scope='module')
def seg_run(tmp_path_factory, shared_run):
    """A finished tiny segmentation run trained at data.img_size=32 on the built-in shapes."""
    return shared_run('seg', tmp_path_factory.mktemp('contract') / 'seg')


# ------------------------------------------------------------------------------------------- one-line failures

def _write_bad_files(folder):
    folder.mkdir(exist_ok=True)
    (folder / 'random.pt').write_bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    (folder / 'text.pt').write_text('epoch,step\n1,2\n')
    torch.save(torch.zeros(3), folder / 'tensor.pt')
    torch.save({'weights': torch.zeros(3)}, folder / 'other_dict.pt')
    torch.save({'model': nn.Linear(2, 2)}, folder / 'module.pt')
    (folder / 'random.safetensors').write_bytes(b'\x00' * 64)


@pytest.mark.parametrize('name', ['random.pt', 'text.pt', 'tensor.pt', 'other_dict.pt', 'module.pt',
                                  'random.safetensors'])
def test_eval_only_of_a_file_that_is_not_weights_is_one_line(capsys, tmp_path, name):
    _write_bad_files(tmp_path)
    extra = ['--config', CLS_DEMO] if name.endswith('.safetensors') else []
    status, err = _main(capsys, '--eval-only', tmp_path / name, *extra)
    assert status == 1
    assert len(err) == 1 and err[0].startswith('train.py: error: ')
    assert str(tmp_path / name) in err[0]
    assert 'is not a linvit' in err[0] or 'is not a .safetensors weights file' in err[0]
    assert 'weights_only' not in err[0]


@pytest.mark.parametrize('argv, status, expected', [
    (['--config', CLS_DEMO, 'model.name=linvit_huge'], 2, "config error: model.name='linvit_huge' is not a timm model"),
    (['--config', CLS_DEMO, 'task=pose'], 2, "config error: unknown task 'pose'"),
    (['--config', CLS_DEMO, 'train.epoch=3'], 2, "unknown config key 'train.epoch'"),
    (['--config', '{tmp}/nope.yaml'], 2, "config file '{tmp}/nope.yaml' does not exist"),
    (['--eval-only', '{tmp}/best.pt'], 1, 'error: checkpoint {tmp}/best.pt does not exist'),
    (['--eval-only', '{tmp}/model.safetensors'], 1, 'error: weights file {tmp}/model.safetensors does not exist'),
    (['--resume', '{tmp}'], 1, 'error: checkpoint {tmp}/last.pt does not exist'),
    (['--config', CLS_DEMO, 'model.kwargs.bogus=1', 'output_dir={tmp}/run'], 2,
     "config error: model.name='linvit_tiny_patch16_224' does not take model.kwargs.bogus ("),
    (['--config', CLS_DEMO, 'model.kwargs.attn_family=nope', 'output_dir={tmp}/run'], 2,
     "config error: cannot build model.name='linvit_tiny_patch16_224' from the config: unknown attn_family 'nope'"),
])
def test_bad_command_lines_are_one_line(capsys, tmp_path, argv, status, expected):
    got, err = _main(capsys, *(a.format(tmp=tmp_path) for a in argv))
    expected = expected.format(tmp=tmp_path)
    assert got == status
    assert len(err) == 1 and expected in err[0]


def _folder_with_unreadable_images(root, good=3, bad=2):
    for name in ('a', 'b'):
        for split in ('train', 'val'):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(good):
                Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(folder / f'{i}.png')
    for i in range(bad):
        (root / 'train' / 'a' / f'broken{i}.jpg').write_bytes(b'\xff\xd8\xff not really a jpeg')


def test_a_folder_with_too_many_unreadable_images_is_one_line(capsys, tmp_path):
    _folder_with_unreadable_images(tmp_path / 'data')
    status, err = _main(capsys, '--config', os.path.join(ROOT, 'configs', 'cls_folder.yaml'),
                        f'data.root={tmp_path / "data"}', *TINY_MODEL, *TINY_RUN, f'output_dir={tmp_path / "run"}')
    assert status == 1
    lines = [line for line in err if line.startswith('train.py:')]
    assert lines == [err[-1]] and '2 of 8 image files' in err[-1] and 'unreadable' in err[-1]
    assert not any('Traceback' in line for line in err)


class _FailingDataset(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        raise DataError('3 of 4 image files under /data/train are unreadable')


def test_a_data_error_raised_in_a_loader_worker_is_still_one_line():
    with pytest.raises(DataError) as info:
        next(iter(DataLoader(_FailingDataset(), num_workers=1)))
    assert 'Original Traceback' in str(info.value)  # what torch hands over: the worker's whole traceback
    assert cli.one_line(info.value) == '3 of 4 image files under /data/train are unreadable'


def test_one_line_and_exit_status_in_a_real_process(tmp_path):
    result = subprocess.run([sys.executable, 'train.py', '--config', CLS_DEMO, 'model.name=linvit_huge',
                             f'output_dir={tmp_path}'], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("train.py: config error: model.name='linvit_huge' is not a timm model; did you mean")


# --------------------------------------------------------------------------- weights in their own architecture

def _write_seg_folder(root, class_names, sizes=((40, 48), (56, 32), (32, 64))):
    """images/ + masks/ for train and val (random pixels and class ids), with the run's classes.txt."""
    rng = np.random.default_rng(0)
    for split in ('train', 'val'):
        (root / split / 'images').mkdir(parents=True)
        (root / split / 'masks').mkdir(parents=True)
        for i, (h, w) in enumerate(sizes):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / split / 'images' / f'{i}.png')
            mask = rng.integers(0, len(class_names), (h, w), dtype=np.uint8)
            Image.fromarray(mask).save(root / split / 'masks' / f'{i}.png')
    (root / 'classes.txt').write_text(''.join(f'{name}\n' for name in class_names))


def test_eval_only_with_a_config_file_keeps_the_trained_architecture(capsys, seg_run, tmp_path):
    # seg_folder.yaml's base asks for linvit_small at 512 px: the weights (linvit_tiny, 48 wide, 32 px) decide
    checkpoint = seg_run / 'best.pt'
    data = tmp_path / 'photos'
    _write_seg_folder(data, load_checkpoint(checkpoint)['class_names'])
    status, err = _main(capsys, '--eval-only', checkpoint, '--config', os.path.join(ROOT, 'configs', 'seg_folder.yaml'),
                        f'data.root={data}',
                        'device=cpu', 'data.num_workers=0', 'train.pictures=false', '--out', tmp_path / 'with_config')
    assert status == 0, err[-3:]
    status, err = _main(capsys, '--eval-only', checkpoint, 'data.name=folder', f'data.root={data}',
                        'seg.eval.mode=slide', '--out', tmp_path / 'without_config')
    assert status == 0, err[-3:]
    with_config, without = (_metrics(tmp_path / out / 'metrics.json') for out in ('with_config', 'without_config'))
    assert with_config.pop('per_class_iou') == pytest.approx(without.pop('per_class_iou'), rel=1e-6)
    assert with_config == pytest.approx(without, rel=1e-6)
    assert with_config['pixels'] == 40 * 48 + 56 * 32 + 32 * 64


def test_eval_at_another_size_resamples_the_position_embedding_as_timm_does(capsys, cls_run, tmp_path):
    status, err = _main(capsys, '--eval-only', cls_run / 'best.pt', 'data.img_size=48', '--out', tmp_path / 'at48')
    assert status == 0, err[-3:]
    # the reference: timm's own pretrained-weights filter, into a model timm creates at 48 px, then evaluated as is
    state = load_checkpoint(cls_run / 'best.pt')
    kwargs = dict(depth=2, embed_dim=48, num_heads=3, patch_size=8, img_size=48, num_classes=len(state['class_names']))
    reference = timm.create_model('linvit_tiny_patch16_224', **kwargs)
    resampled = checkpoint_filter_fn(dict(state['model']), reference)
    assert resampled['pos_embed'].shape == reference.pos_embed.shape != state['model']['pos_embed'].shape
    reference.load_state_dict(resampled)
    save_file(reference.state_dict(), tmp_path / 'reference.safetensors')
    cfg = load_config(None, ['data.img_size=48'], base=config_from_yaml(state['config']))
    expected = evaluate(cfg, str(tmp_path / 'reference.safetensors'), str(tmp_path / 'reference'))
    assert _metrics(tmp_path / 'at48' / 'metrics.json') == pytest.approx(expected, rel=1e-6)


def test_a_safetensors_file_is_rebuilt_from_the_config_beside_it(capsys, cls_run, tmp_path):
    # one epoch, one evaluation: best.pt and model.safetensors hold the same weights
    for weights in ('best.pt', 'model.safetensors'):
        status, err = _main(capsys, '--eval-only', cls_run / weights, '--out', tmp_path / weights)
        assert status == 0, err[-3:]
    assert _metrics(tmp_path / 'model.safetensors' / 'metrics.json') == _metrics(tmp_path / 'best.pt' / 'metrics.json')


def test_an_architecture_the_weights_do_not_fit_is_one_line_naming_the_key(capsys, cls_run, tmp_path):
    status, err = _main(capsys, '--eval-only', cls_run / 'best.pt', 'model.kwargs.embed_dim=96', '--out', tmp_path)
    assert status == 2
    assert len(err) == 1 and err[0].startswith('train.py: config error: ')
    assert 'does not fit the model' in err[0]
    assert 'patch_embed.proj.weight is [48, 3, 8, 8] in the weights, [96, 3, 8, 8] in the model' in err[0]
    assert 'model.kwargs.embed_dim=96 (trained with 48)' in err[0]


def test_resume_changing_the_architecture_is_one_line(capsys, cls_run, tmp_path):
    run = tmp_path / 'run'
    shutil.copytree(cls_run, run)
    status, err = _main(capsys, '--resume', run, 'model.kwargs.depth=3', 'train.epochs=2')
    assert status == 2
    assert len(err) == 1 and 'model.kwargs.depth=3 (trained with 2)' in err[0]
    assert 'blocks.2' in err[0] and 'is missing from the weights' in err[0]


def test_a_run_directory_is_named_after_its_config(capsys, tmp_path, monkeypatch):
    config = tmp_path / 'tiny_demo.yaml'
    config.write_text(f"_base_: {CLS_DEMO}\n")
    monkeypatch.chdir(tmp_path)
    status, err = _main(capsys, '--config', config, *TINY_MODEL, *TINY_RUN, 'train.epochs=1', 'train.max_steps=1')
    assert status == 0, err[-3:]
    assert (tmp_path / 'runs' / 'tiny_demo' / 'last.pt').is_file()
