"""task=depth through train.py: the built-in ground-plane scenes and an image/depth folder end to end, metrics.json
against the run's own validation maps scored by hand, --eval-only, disparity and L1, a frozen backbone, pictures, and
the folder's one-line errors before any step."""
import json
import math

import numpy as np
import pytest
import torch
from cli import run_train_py
from PIL import Image
from safetensors.torch import load_file
from tiny_run import TINY_MODEL

from linvit.engine import load_config
from linvit.engine.tasks.depth import DepthTask
from linvit.engine.tasks.segmentation import create_segmentation_model

pytestmark = pytest.mark.integration  # trains

TINY_DEPTH = ['--config', 'configs/depth_demo.yaml', *TINY_MODEL, 'data.img_size=32', 'data.batch_size=4',
              'data.num_workers=0', 'data.synthetic.train_size=8', 'data.synthetic.val_size=3', 'seg.neck_dim=16',
              'seg.head_dim=16', 'train.epochs=1', 'train.log_every=1', 'train.warmup_epochs=0', 'device=cpu']
METRICS = ('abs_rel', 'sq_rel', 'rmse', 'rmse_log', 'log10', 'delta1', 'delta2', 'delta3')


def _train(*args):
    result = run_train_py(*TINY_DEPTH, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _numpy_metrics(pred: np.ndarray, truth: np.ndarray) -> dict:
    """The NYU/KITTI metrics of one image over its valid pixels, written out."""
    valid = np.isfinite(truth) & (truth > 0)
    p, t = pred[valid].astype(np.float64), truth[valid].astype(np.float64)
    ratio = np.maximum(p / t, t / p)
    return {'abs_rel': np.mean(np.abs(p - t) / t), 'sq_rel': np.mean((p - t) ** 2 / t),
            'rmse': np.sqrt(np.mean((p - t) ** 2)), 'rmse_log': np.sqrt(np.mean((np.log(p) - np.log(t)) ** 2)),
            'log10': np.mean(np.abs(np.log10(p) - np.log10(t))),
            **{f'delta{i}': np.mean(ratio < 1.25 ** i) for i in (1, 2, 3)}}


def test_a_synthetic_depth_run_reports_the_metrics_of_its_own_predictions(tmp_path):
    """metrics.json equals the per-image metrics of the saved model's whole-image predictions on the validation
    scenes, averaged over images, computed here with numpy; eval-only gives them again."""
    run = tmp_path / 'run'
    _train(f'output_dir={run}', 'train.pictures=true')
    metrics = json.loads((run / 'metrics.json').read_text())
    assert set(METRICS) <= set(metrics) and metrics['images'] == 3 and math.isfinite(metrics['loss'])
    assert sorted(p.name for p in (run / 'pictures').iterdir()) == ['val_step000002.png']

    cfg = load_config(str(run / 'config.yaml'), [])
    model = create_segmentation_model(cfg.model, cfg.seg, 1, cfg.data.img_size).eval()
    model.load_state_dict(load_file(str(run / 'model.safetensors')))
    task = DepthTask(cfg)
    _, val, names = task.build_datasets(cfg_mean(cfg), cfg_std(cfg), with_train=False)
    assert names == ['depth']
    rows = []
    with torch.no_grad():
        for index in range(len(val)):
            image, depth = val[index]
            pred = model(image[None])[0, 0].exp().numpy()
            rows.append(_numpy_metrics(pred, depth.numpy()))
    for key in METRICS:
        assert metrics[key] == pytest.approx(np.mean([row[key] for row in rows]), rel=1e-4, abs=1e-6), key

    again = run_train_py('--eval-only', str(run / 'best.pt'), '--out', str(tmp_path / 'eval'))
    assert again.returncode == 0, again.stderr[-2000:]
    evaluated = json.loads((tmp_path / 'eval' / 'metrics.json').read_text())
    assert {k: evaluated[k] for k in METRICS} == pytest.approx({k: metrics[k] for k in METRICS}, rel=1e-6)


def cfg_mean(cfg):
    from linvit.engine.tasks import normalization_of
    return normalization_of(cfg.model.name)[0]


def cfg_std(cfg):
    from linvit.engine.tasks import normalization_of
    return normalization_of(cfg.model.name)[1]


def test_disparity_l1_alignment_and_a_frozen_backbone(tmp_path):
    run = tmp_path / 'run'
    _train(f'output_dir={run}', 'depth.target=disparity', 'depth.loss=l1', 'depth.align=true',
           'model.freeze_backbone=true', 'seg.head=linear')
    metrics = json.loads((run / 'metrics.json').read_text())
    assert all(f'aligned_{key}' in metrics for key in METRICS) and metrics['images'] == 3
    trained = load_file(str(run / 'model.safetensors'))
    fresh = load_config(str(run / 'config.yaml'), [])
    torch.manual_seed(fresh.seed)  # train.py seeds before building the model: the same initial backbone
    initial = create_segmentation_model(fresh.model, fresh.seg, 1, fresh.data.img_size).state_dict()
    changed = sorted(k for k in trained if not torch.equal(trained[k], initial[k]))
    assert changed and all(k.startswith('head.') for k in changed), changed


def _write_depth_folder(root, val_size=(40, 48)):
    """Two training pairs and one validation pair: RGB images with 16-bit PNG depths in millimetres."""
    rng = np.random.default_rng(0)
    for split, count, (h, w) in (('train', 2, (48, 40)), ('val', 1, val_size)):
        (root / split / 'images').mkdir(parents=True)
        (root / split / 'depths').mkdir(parents=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / split / 'images' /
                                                                                  f'{i}.png')
            depth_mm = rng.integers(500, 9000, (h, w)).astype(np.uint16)
            depth_mm[:4] = 0  # no depth
            Image.fromarray(depth_mm).save(root / split / 'depths' / f'{i}.png')


def test_a_depth_folder_trains_and_a_bad_validation_pair_stops_the_run_before_any_step(tmp_path):
    root = tmp_path / 'data'
    _write_depth_folder(root)
    args = ['--config', 'configs/depth_folder.yaml', *TINY_DEPTH[2:], f'data.root={root}']
    result = run_train_py(*args, f'output_dir={tmp_path / "run"}', 'train.max_steps=1', 'data.batch_size=2')
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / 'run' / 'metrics.json').read_text())
    assert metrics['images'] == 1 and 0 <= metrics['delta1'] <= 1

    bad = tmp_path / 'bad'
    _write_depth_folder(bad, val_size=(40, 48))
    Image.fromarray(np.full((30, 48), 1000, np.uint16)).save(bad / 'val' / 'depths' / '0.png')  # not its image's size
    result = run_train_py(*args, f'data.root={bad}', f'output_dir={tmp_path / "bad_run"}', 'data.batch_size=2')
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert str(bad / 'val' / 'depths' / '0.png') in last and '48x30' in last, last
    assert not (tmp_path / 'bad_run' / 'last.pt').exists()
