"""train(): a few real steps end to end, resume on the same trajectory, non-finite losses, eval-only, folders."""
import csv
import json
import math
import os

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from linvit.engine import TASKS, Checkpoint, evaluate, register_task, train
from linvit.engine.checkpoint import load_checkpoint
from linvit.engine.tasks.classification import ClassificationTask
from linvit.engine.trainer import NonFiniteLossError

pytestmark = pytest.mark.integration  # trains or starts interpreters


def _rows(run_dir, split):
    with open(os.path.join(run_dir, 'metrics.csv'), newline='') as f:
        return [row for row in csv.DictReader(f) if row['split'] == split]


def test_a_short_run_writes_everything_a_person_needs(tiny_config):
    cfg = tiny_config('train.pictures=true')
    metrics = train(cfg)
    run = cfg.output_dir
    for name in ('config.yaml', 'train.log', 'metrics.csv', 'metrics.json', 'last.pt', 'best.pt', 'model.safetensors',
                 'curves.png'):
        assert os.path.isfile(os.path.join(run, name)), name
    assert os.listdir(os.path.join(run, 'tb')) and sorted(os.listdir(os.path.join(run, 'pictures'))) == [
        'confusion_step000008.png', 'confusion_step000016.png', 'val_step000008.png', 'val_step000016.png']
    with open(os.path.join(run, 'metrics.json')) as f:
        written = json.load(f)
    assert written == metrics and set(written) == {'top1', 'top5', 'loss', 'count'}
    assert written['count'] == 24 and 0 <= written['top1'] <= written['top5'] == 1.0  # 4 classes: top-5 is all
    train_rows = _rows(run, 'train')
    assert [int(r['step']) for r in train_rows] == list(range(1, 17))
    assert all(math.isfinite(float(r['loss'])) and float(r['img_per_s']) > 0 for r in train_rows)
    # warmup then cosine: the lr rises over the first 4 steps (half an epoch), then falls
    lrs = [float(r['lr']) for r in train_rows]
    assert lrs[3] > lrs[0] and lrs[-1] < max(lrs)
    val_rows = _rows(run, 'val')
    assert [int(r['step']) for r in val_rows] == [8, 16]
    assert float(val_rows[-1]['top1']) == pytest.approx(metrics['top1'], abs=1e-6)
    # the exported weights are the evaluated ones, and load into timm by name with the saved head
    state = load_checkpoint(os.path.join(run, 'last.pt'))
    model = timm.create_model('linvit_tiny_patch16_224', pretrained=True, depth=2, embed_dim=48, num_heads=3,
                              patch_size=8, img_size=32, num_classes=4,
                              pretrained_cfg_overlay=dict(file=os.path.join(run, 'model.safetensors'), num_classes=4))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state['model'][key], rtol=0, atol=0)


def test_eval_only_reproduces_the_final_metrics(tiny_config, tmp_path):
    cfg = tiny_config()
    metrics = train(cfg)
    again = evaluate(cfg, os.path.join(cfg.output_dir, 'last.pt'), str(tmp_path / 'eval'))
    assert again == pytest.approx(metrics, rel=1e-6)
    with open(tmp_path / 'eval' / 'metrics.json') as f:
        assert json.load(f) == pytest.approx(metrics, rel=1e-6)


def test_resume_after_an_interruption_follows_the_same_trajectory(tiny_config):
    # drop path, mixup (numpy RNG), EMA, accumulation and a data-loader worker all have to be restored exactly
    extra = ['model.drop_path_rate=0.1', 'data.aug.mixup=0.4', 'train.ema=true', 'train.ema_decay=0.9',
             'train.accum_steps=2', 'data.num_workers=1', 'data.synthetic.train_size=96', 'train.clip_grad=1.0']
    whole = tiny_config(*extra, out='whole')
    full_metrics = train(whole)
    interrupted = tiny_config(*extra, 'train.max_steps=5', out='cut')
    train(interrupted)
    checkpoint = Checkpoint.load(os.path.join(interrupted.output_dir, 'last.pt'))
    assert checkpoint.progress.step == 5 and checkpoint.progress.batch_in_epoch == 10
    resumed_cfg = tiny_config(*extra, out='cut')
    resumed = train(resumed_cfg, resume=checkpoint)
    whole_losses = [float(r['loss']) for r in _rows(whole.output_dir, 'train')]
    cut_rows = _rows(interrupted.output_dir, 'train')
    assert [int(r['step']) for r in cut_rows] == list(range(1, 13))  # no duplicated or missing steps
    np.testing.assert_allclose([float(r['loss']) for r in cut_rows], whole_losses, rtol=1e-5, atol=1e-6)
    assert resumed == pytest.approx(full_metrics, rel=1e-5)


class _NanAfterThree(ClassificationTask):
    name = 'test_nan_after_three'

    def train_loss(self):
        calls = []

        def loss(logits, targets):
            calls.append(1)
            value = torch.nn.functional.cross_entropy(logits, targets)
            return value * float('nan') if len(calls) > 3 else value
        return loss


@pytest.fixture
def nan_after_three_task():
    register_task(_NanAfterThree)
    yield
    TASKS.unregister(_NanAfterThree.name)  # the registry is global: later tests see only the shipped tasks


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tiny_config, nan_after_three_task):
    cfg = tiny_config('task=test_nan_after_three', 'train.checkpoint_every=2', 'train.log_every=3')
    with pytest.raises(NonFiniteLossError, match=r'non-finite training loss at step 4: .*last\.pt \(step 2\) is kept'):
        train(cfg)
    state = load_checkpoint(os.path.join(cfg.output_dir, 'last.pt'))
    assert state['progress']['step'] == 2
    assert all(torch.isfinite(v).all() for v in state['model'].values())


def _write_folder(root, corrupt=True):
    """4 + 2 images per class in 2 classes, in assorted modes: RGB JPEG, grayscale, RGBA, 16-bit PNG; one corrupt."""
    rng = np.random.default_rng(0)
    for split, count in (('train', 8), ('val', 4)):
        for label, name in enumerate(('cats', 'dogs')):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                base = rng.integers(0, 80, (40, 48)) + 150 * label
                kind = i % 4
                if kind == 0:
                    Image.fromarray(np.stack([base] * 3, -1).astype(np.uint8)).save(folder / f'{i}.jpg')
                elif kind == 1:
                    Image.fromarray(base.astype(np.uint8), mode='L').save(folder / f'{i}.png')
                elif kind == 2:
                    rgba = np.concatenate([np.stack([base] * 3, -1), np.full((40, 48, 1), 255)], -1)
                    Image.fromarray(rgba.astype(np.uint8), mode='RGBA').save(folder / f'{i}.png')
                else:
                    Image.fromarray((base * 257).astype(np.uint16)).save(folder / f'{i}.png')
    if corrupt:
        (root / 'train' / 'cats' / 'broken.jpg').write_bytes(b'\xff\xd8\xff not really a jpeg')


def test_training_on_a_folder_with_odd_and_corrupt_files(tiny_config, tmp_path):
    _write_folder(tmp_path / 'data')
    cfg = tiny_config('data.name=folder', f'data.root={tmp_path / "data"}', 'data.max_bad_fraction=0.2',
                      'data.batch_size=4')
    metrics = train(cfg)
    assert metrics['count'] == 8
    with open(os.path.join(cfg.output_dir, 'train.log')) as f:
        log = f.read()
    assert 'broken.jpg' in log and '1 unreadable image file(s) skipped' in log
    state = load_checkpoint(os.path.join(cfg.output_dir, 'last.pt'))
    assert state['class_names'] == ['cats', 'dogs']
    too_strict = tiny_config('data.name=folder', f'data.root={tmp_path / "data"}', 'data.max_bad_fraction=0.01',
                             out='strict')
    with pytest.raises(RuntimeError, match='1 of 17'):
        train(too_strict)


def test_bf16_autocast_grad_checkpointing_and_layer_decay_on_cpu(tiny_config):
    cfg = tiny_config('train.precision=bfloat16', 'model.grad_checkpointing=true', 'train.layer_decay=0.75',
                      'train.max_steps=3')
    train(cfg)
    losses = [float(r['loss']) for r in _rows(cfg.output_dir, 'train')]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    state = load_checkpoint(os.path.join(cfg.output_dir, 'last.pt'))
    # layer-wise decay: one optimizer group per depth (and decay / no decay), lrs scaled by 0.75 per layer
    lrs = sorted({group['lr'] for group in state['optimizer']['param_groups']})
    assert len(lrs) >= 3 and lrs[-2] / lrs[-1] == pytest.approx(0.75, rel=1e-6)


def test_fp16_on_cpu_is_refused_with_the_alternative(tiny_config):
    with pytest.raises(ValueError, match='train.precision=float16 needs CUDA.*train.precision=bfloat16'):
        train(tiny_config('train.precision=float16'))


