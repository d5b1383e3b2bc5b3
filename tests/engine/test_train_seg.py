"""task=segmentation through the engine: built-in and folder data, metrics.json, pictures, eval-only, resume, compile,
errors."""
import csv
import json
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from tiny_run import TINY_MODEL, TINY_SEG

from linvit.engine import evaluate, load_config, train
from linvit.engine.tasks.segmentation import create_segmentation_model

pytestmark = pytest.mark.integration  # trains or starts interpreters


@pytest.fixture
def seg_config(tmp_path):
    def make(*overrides, out='run'):
        return load_config(None, [*TINY_MODEL, *TINY_SEG, f'output_dir={tmp_path / out}', *overrides])
    return make


def _rows(run_dir, split):
    with open(os.path.join(run_dir, 'metrics.csv'), newline='') as f:
        return [row for row in csv.DictReader(f) if row['split'] == split]


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def _assert_seg_metrics(metrics, class_names):
    assert set(metrics) == {'miou', 'pixel_acc', 'per_class_iou', 'loss', 'pixels'}
    assert 0 <= metrics['miou'] <= 1 and 0 <= metrics['pixel_acc'] <= 1 and math.isfinite(metrics['loss'])
    assert list(metrics['per_class_iou']) == list(class_names)
    present = [v for v in metrics['per_class_iou'].values() if v is not None]
    assert present and all(0 <= v <= 1 for v in present)
    assert metrics['miou'] == pytest.approx(sum(present) / len(present), rel=1e-9)


def _assert_same_metrics(got, expected):
    assert got['per_class_iou'] == pytest.approx(expected['per_class_iou'], rel=1e-6)
    flat = {k: v for k, v in expected.items() if k != 'per_class_iou'}
    assert {k: v for k, v in got.items() if k != 'per_class_iou'} == pytest.approx(flat, rel=1e-6)


def test_a_short_seg_run_writes_metrics_pictures_and_weights(seg_config):
    cfg = seg_config('train.pictures=true')
    metrics = train(cfg)
    run = cfg.output_dir
    for name in ('config.yaml', 'metrics.csv', 'metrics.json', 'last.pt', 'best.pt', 'model.safetensors',
                 'curves.png'):
        assert os.path.isfile(os.path.join(run, name)), name
    assert sorted(os.listdir(os.path.join(run, 'pictures'))) == ['confusion_step000004.png', 'confusion_step000008.png',
                                                                 'val_step000004.png', 'val_step000008.png']
    written = _read_json(os.path.join(run, 'metrics.json'))
    assert written == metrics
    _assert_seg_metrics(written, ['background', 'red-key', 'blue-key'])
    assert written['pixels'] == 6 * 32 * 32  # the synthetic masks label every pixel
    val = _rows(run, 'val')
    assert [int(r['step']) for r in val] == [4, 8]
    assert float(val[-1]['miou']) == pytest.approx(metrics['miou'], abs=1e-6)
    train_rows = _rows(run, 'train')
    assert all(float(r['peak_mem_mib']) > 50 for r in train_rows)
    # model.safetensors loads into a segmentation model built from the same config
    model = create_segmentation_model(cfg.model, cfg.seg, num_classes=3, img_size=32)
    model.load_state_dict(load_file(os.path.join(run, 'model.safetensors')))


@pytest.mark.parametrize('head', ['upernet', 'dpt', 'linear'])
def test_every_head_trains_and_its_weights_reload_from_the_config(seg_config, head):
    cfg = seg_config(f'seg.head={head}', 'seg.head_dim=24', 'train.max_steps=2')
    metrics = train(cfg)
    _assert_seg_metrics(metrics, ['background', 'red-key', 'blue-key'])
    weights = load_file(os.path.join(cfg.output_dir, 'model.safetensors'))
    model = create_segmentation_model(cfg.model, cfg.seg, num_classes=3, img_size=32)
    model.load_state_dict(weights)  # the saved config builds the same head
    assert type(model.head).__name__.lower().startswith(head) and weights['head.classifier.weight'].shape[0] == 3
    if head != 'linear':  # seg.head_dim sets the head's width; the linear probe has none
        assert weights['head.classifier.weight'].shape[1] == 24


def test_a_frozen_backbone_keeps_its_weights_and_only_the_head_trains(seg_config, monkeypatch):
    from linvit.engine.tasks.segmentation import SegmentationTask
    built = {}
    build = SegmentationTask.build_model

    def keep_initial(self, num_classes):
        model = build(self, num_classes)
        built.update({k: v.clone() for k, v in model.state_dict().items()})
        return model

    monkeypatch.setattr(SegmentationTask, 'build_model', keep_initial)
    cfg = seg_config('seg.head=linear', 'model.freeze_backbone=true', 'model.drop_path_rate=0.1',
                     'train.max_steps=2')
    train(cfg)
    trained = load_file(os.path.join(cfg.output_dir, 'model.safetensors'))
    changed = sorted(k for k in trained if not torch.equal(trained[k], built[k]))
    assert changed and all(k.startswith('head.') for k in changed), changed
    assert {'head.classifier.weight', 'head.norm.running_mean'} <= set(changed)
    with pytest.raises(ValueError, match='model.freeze_backbone=true: task=classification trains its model whole'):
        train(load_config(None, [*TINY_MODEL, 'model.freeze_backbone=true', f'output_dir={cfg.output_dir}x']))


def test_eval_only_reproduces_the_final_metrics_and_slide_mode_runs(seg_config, tmp_path):
    cfg = seg_config()
    metrics = train(cfg)
    again = evaluate(cfg, os.path.join(cfg.output_dir, 'last.pt'), str(tmp_path / 'eval'))
    _assert_same_metrics(again, metrics)
    slide = load_config(None, [*TINY_MODEL, *TINY_SEG, f'output_dir={tmp_path / "x"}', 'seg.eval.mode=slide',
                               'seg.eval.window=16', 'seg.eval.stride=8'])
    slid = evaluate(slide, os.path.join(cfg.output_dir, 'last.pt'), str(tmp_path / 'slide'))
    assert slid['pixels'] == metrics['pixels'] and slid['miou'] != pytest.approx(metrics['miou'], abs=1e-9)


def test_whole_image_mode_refuses_images_above_max_pixels(seg_config):
    with pytest.raises(ValueError, match=r'seg.eval.mode=slide.*seg.eval.max_pixels|seg.eval.max_pixels'):
        train(seg_config('seg.eval.max_pixels=1000', 'train.max_steps=1'))


def test_seg_resume_follows_the_same_trajectory(seg_config):
    extra = ['model.drop_path_rate=0.1', 'seg.dice_weight=0.5', 'data.num_workers=1']
    whole = seg_config(*extra, out='whole')
    full = train(whole)
    cut = seg_config(*extra, 'train.max_steps=3', out='cut')
    train(cut)
    resumed = train(seg_config(*extra, out='cut'), resume=True)  # from its last.pt
    losses = [float(r['loss']) for r in _rows(whole.output_dir, 'train')]
    np.testing.assert_allclose([float(r['loss']) for r in _rows(cut.output_dir, 'train')], losses, rtol=1e-5)
    _assert_same_metrics(resumed, full)


@pytest.mark.compiler
def test_compiled_seg_step_with_activation_checkpointing_trains_like_the_eager_step(seg_config):
    """train.py's ``train.compile=true`` (the trainer's step, the same for every task) in a run that recomputes
    every block's activations in the backward (``parallel.checkpoint_every=1``): one inductor compile for both claims,
    which cost ~30 s of CPU each on a machine without inductor's cache."""
    eager = seg_config('train.max_steps=2', 'seg.dice_weight=0.5', out='eager')
    compiled = seg_config('train.max_steps=2', 'seg.dice_weight=0.5', 'train.compile=true',
                          'parallel.checkpoint_every=1', out='compiled')
    train(eager)
    train(compiled)
    np.testing.assert_allclose([float(r['loss']) for r in _rows(compiled.output_dir, 'train')],
                               [float(r['loss']) for r in _rows(eager.output_dir, 'train')], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- folders

def write_seg_folder(root, sizes=((40, 48), (32, 32), (56, 40), (48, 64)), val_sizes=((72, 40), (40, 40))):
    """Images of several sizes whose masks follow their content (class = brightest channel, ignore on dark pixels),
    grey and RGBA images among them, and classes.txt."""
    rng = np.random.default_rng(0)
    for split, split_sizes in (('train', sizes), ('val', val_sizes)):
        (root / split / 'images').mkdir(parents=True)
        (root / split / 'masks').mkdir(parents=True)
        for i, (h, w) in enumerate(split_sizes):
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            mask = pixels.argmax(axis=2).astype(np.uint8)
            mask[pixels.max(axis=2) < 40] = 255
            image = Image.fromarray(pixels)
            if i == 1:
                image = image.convert('RGBA')
            image.save(root / split / 'images' / f'{split}{i}.png')
            Image.fromarray(mask, mode='L').save(root / split / 'masks' / f'{split}{i}.png')
    (root / 'classes.txt').write_text('red\ngreen\nblue\n')


def test_training_on_image_and_mask_folders(seg_config, tmp_path):
    root = tmp_path / 'data'
    write_seg_folder(root)
    cfg = seg_config('data.name=folder', f'data.root={root}', 'data.batch_size=2', 'seg.eval.mode=slide',
                     'seg.eval.window=32', 'seg.eval.stride=16')
    metrics = train(cfg)
    _assert_seg_metrics(metrics, ['red', 'green', 'blue'])
    with Image.open(root / 'val' / 'masks' / 'val0.png') as a, Image.open(root / 'val' / 'masks' / 'val1.png') as b:
        labelled = sum(int((np.asarray(m) != 255).sum()) for m in (a, b))
    assert metrics['pixels'] == labelled  # full-resolution validation, unlabelled pixels not counted


def test_a_mask_of_the_wrong_size_stops_the_run_naming_the_file(seg_config, tmp_path):
    root = tmp_path / 'data'
    write_seg_folder(root)
    Image.fromarray(np.zeros((10, 10), np.uint8), mode='L').save(root / 'val' / 'masks' / 'val1.png')
    with pytest.raises(ValueError, match='val1.png'):
        train(seg_config('data.name=folder', f'data.root={root}', 'data.batch_size=2', 'train.max_steps=1'))


def test_unknown_seg_task_keys_are_named(seg_config):
    from linvit.engine import ConfigError
    with pytest.raises(ConfigError, match="did you mean 'seg.eval.mode'"):
        seg_config('seg.eval.mod=slide')
    with pytest.raises(ConfigError, match=r"seg.eval.mode='tiles' is not one of \['whole', 'slide'\]"):
        seg_config('seg.eval.mode=tiles')


def test_a_classifier_name_that_is_not_a_vit_is_refused():
    cfg = load_config(None, ['task=segmentation', 'model.name=resnet18'])
    with pytest.raises(ValueError, match="model.name='resnet18' is not a plain ViT"):
        create_segmentation_model(cfg.model, cfg.seg, num_classes=3, img_size=32)


def test_the_segmentation_model_is_trained_through_torch_autocast_bf16(seg_config):
    metrics = train(seg_config('train.precision=bfloat16', 'train.max_steps=2', 'model.grad_checkpointing=true'))
    assert math.isfinite(metrics['loss'])
    assert torch.isfinite(torch.tensor(metrics['miou']))


def test_pretrained_classifier_weights_load_into_the_backbone(tmp_path):
    import timm
    from safetensors.torch import save_file
    torch.manual_seed(1)
    classifier = timm.create_model('linvit_tiny_patch16_224', depth=2, embed_dim=48, num_heads=3, patch_size=8,
                                   img_size=32, num_classes=7)
    path = tmp_path / 'cls.safetensors'
    save_file({k: v.contiguous() for k, v in classifier.state_dict().items()}, str(path))
    cfg = load_config(None, [*TINY_MODEL, *TINY_SEG, f'model.pretrained_file={path}'])
    model = create_segmentation_model(cfg.model, cfg.seg, num_classes=3, img_size=64)  # a larger grid than saved
    for name, value in classifier.blocks.state_dict().items():
        torch.testing.assert_close(model.backbone.blocks.state_dict()[name], value, rtol=0, atol=0)
    assert model.backbone.pos_embed.shape[1] == classifier.pos_embed.shape[1] - 16 + 64  # 4x4 -> 8x8 grid (+cls)
