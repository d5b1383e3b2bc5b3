"""task=autoregressive: patch targets, next-patch alignment and metrics against hand computations; a causal run end
to end whose weights then fine-tune a (non-causal) classifier; the config refuses models and options that cannot be
causal."""
import json
import os

import numpy as np
import pytest
import torch
from ranks import run_two_ranks

from linvit.engine import train
from linvit.engine.config import ConfigError, load_config
from linvit.engine.metrics import NextPatchMeter
from linvit.engine.tasks import create_model_from_config
from linvit.engine.tasks.autoregressive import (
    AutoregressiveTask,
    align_next_patch,
    next_patch_loss,
    next_patch_predictions,
    normalized_patch_targets,
    patchify,
    unpatchify,
)
from linvit.engine.tasks.classification import ClassificationTask

pytestmark = pytest.mark.integration  # trains or starts interpreters

CONFIGS = os.path.join(os.path.dirname(__file__), '..', '..', 'configs')
AR = ['task=autoregressive', 'data.aug.hflip=0', 'train.epochs=1', 'train.max_steps=3']


def test_patchify_and_normalised_targets_follow_the_patches_in_raster_order():
    p = 8
    images = torch.randn(2, 3, 16, 24)
    expected, normalised = [], []
    for b in range(2):
        rows, norm_rows = [], []
        for gy in range(2):                 # raster order: left to right, then top to bottom
            for gx in range(3):
                values = [float(images[b, ch, gy * p + r, gx * p + c])
                          for r in range(p) for c in range(p) for ch in range(3)]   # (row, column, channel)
                v = np.asarray(values, dtype=np.float64)
                rows.append(v)
                norm_rows.append((v - v.mean()) / np.sqrt(v.var() + 1e-6))
        expected.append(rows)
        normalised.append(norm_rows)
    patches = patchify(images, p)
    assert patches.shape == (2, 6, 192)
    np.testing.assert_array_equal(patches.double().numpy(), np.asarray(expected))
    targets = normalized_patch_targets(images, p)
    assert targets.dtype == torch.float32
    np.testing.assert_allclose(targets.double().numpy(), np.asarray(normalised), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unpatchify(patches, p, 16, 24), images, rtol=0, atol=0)
    with pytest.raises(ValueError, match='not a multiple of the patch size'):
        patchify(torch.zeros(1, 3, 20, 24), p)


@pytest.mark.parametrize('npt, used, first_target', [(1, [0, 1, 2, 3, 4, 5], 0), (0, [0, 1, 2, 3, 4], 1),
                                                     (2, [1, 2, 3, 4, 5, 6], 0)])
def test_the_output_before_a_patch_predicts_it(npt, used, first_target):
    num_patches, width = 6, 4
    positions = torch.arange(npt + num_patches, dtype=torch.float32)
    outputs = positions[None, :, None].expand(2, -1, width)         # the value at position t is t
    assert next_patch_predictions(outputs, npt, num_patches)[0, :, 0].tolist() == used
    targets = (100 + torch.arange(num_patches, dtype=torch.float32))[None, :, None].expand(2, -1, width)
    predictions, aligned = align_next_patch(outputs, targets)
    assert predictions[0, :, 0].tolist() == used
    assert aligned[0, :, 0].tolist() == [100 + j for j in range(first_target, num_patches)]
    # the loss compares position t with patch t - npt + 1: targets j + npt are one above it, an error of exactly 1
    one_above = (torch.arange(num_patches, dtype=torch.float32) + npt)[None, :, None].expand(2, -1, width)
    assert next_patch_loss(outputs, one_above).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match='prefix'):
        next_patch_predictions(outputs, npt + 1, num_patches)


def test_the_meter_sums_squared_errors_over_batches():
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 6, 5, generator=generator), torch.randn(2, 6, 5, generator=generator)),
               (torch.randn(3, 6, 5, generator=generator), torch.randn(3, 6, 5, generator=generator))]
    meter = NextPatchMeter(device=torch.device('cpu'))
    for predictions, targets in batches:
        meter.update(predictions, targets)
    meter.reduce_()   # no process group: a no-op
    result = meter.compute()
    p = np.concatenate([b[0].numpy().reshape(-1) for b in batches]).astype(np.float64)
    t = np.concatenate([b[1].numpy().reshape(-1) for b in batches]).astype(np.float64)
    assert result['count'] == 5
    assert result['loss'] == pytest.approx(np.mean((p - t) ** 2), rel=1e-12)
    assert result['r2'] == pytest.approx(1 - np.sum((p - t) ** 2) / np.sum(t ** 2), rel=1e-12)
    with pytest.raises(RuntimeError, match='after reduce_'):
        meter.update(*batches[0])
    assert np.isnan(NextPatchMeter().compute()['r2'])


def _reduce_on_rank(rank, shards):
    meter = NextPatchMeter()
    for predictions, targets in shards[rank]:
        meter.update(torch.tensor(predictions), torch.tensor(targets))
    meter.reduce_()
    return meter.compute()


@pytest.mark.parametrize('empty_rank', [False, True])
def test_the_meter_sums_over_processes(tmp_path, empty_rank):
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(b, 4, 3, generator=generator).tolist(), torch.randn(b, 4, 3, generator=generator).tolist())
               for b in (2, 3)]
    shards = [batches, []] if empty_rank else [batches[:1], batches[1:]]
    results = run_two_ranks(tmp_path, _reduce_on_rank, shards)
    p = np.concatenate([np.asarray(b[0]).reshape(-1) for b in batches])
    t = np.concatenate([np.asarray(b[1]).reshape(-1) for b in batches])
    for result in results:
        assert result['count'] == 5
        assert result['loss'] == pytest.approx(np.mean((p - t) ** 2), rel=1e-6)
        assert result['r2'] == pytest.approx(1 - np.sum((p - t) ** 2) / np.sum(t ** 2), rel=1e-6)


def test_ar_refuses_models_and_options_that_cannot_predict_the_next_patch(tiny_config):
    with pytest.raises(ConfigError, match=r"model\.name='vit_tiny_patch16_224'.*linvit_\*"):
        train(tiny_config(*AR, 'model.name=vit_tiny_patch16_224', out='vit'))
    for override, key in [('model.kwargs.causal=false', 'causal'), ('model.kwargs.local_mix=true', 'local_mix'),
                          ('model.kwargs.global_pool=token', 'global_pool')]:
        with pytest.raises(ConfigError, match=rf"model\.kwargs\.{key}=.* does not fit task=autoregressive"):
            AutoregressiveTask(tiny_config(*AR, override)).build_model(4)


def test_the_demo_configs_pretrain_then_fine_tune():
    ar = load_config(os.path.join(CONFIGS, 'ar_demo.yaml'))
    assert ar.task == 'autoregressive' and ar.data.aug.hflip == 0 and ar.model.kwargs.patch_size == 8
    cls = load_config(os.path.join(CONFIGS, 'cls_from_ar_demo.yaml'))
    assert cls.task == 'classification'
    assert cls.model.pretrained_file == os.path.join(ar.output_dir, 'model.safetensors')
    assert dict(cls.model.kwargs) == dict(ar.model.kwargs) and cls.data.img_size == ar.data.img_size


def _last_patch_changed(images, p):
    changed = images.clone()
    changed[:, :, -p:, -p:] += 1.0
    return changed


def test_ar_pretraining_end_to_end_then_classification_from_its_weights(tiny_config):
    from safetensors.torch import load_file

    from linvit.engine.loading import load_trained
    from linvit.layers.weights import linear_only_parameter_names

    cfg = tiny_config(*AR, 'train.pictures=true', out='ar')
    metrics = train(cfg)
    run = cfg.output_dir
    for name in ('model.safetensors', 'metrics.json', 'last.pt', 'curves.png'):
        assert os.path.isfile(os.path.join(run, name)), name
    assert os.listdir(os.path.join(run, 'pictures'))
    with open(os.path.join(run, 'metrics.json')) as f:
        written = json.load(f)
    assert written == metrics and set(written) == {'loss', 'r2', 'count'}
    assert written['count'] == 24 and np.isfinite(written['loss']) and written['r2'] <= 1

    # causal: changing the last patch changes no output before its token; with full attention it would
    weights = load_file(os.path.join(run, 'model.safetensors'))
    model = AutoregressiveTask(cfg).build_model(4).eval()
    model.load_state_dict(weights)
    assert model.head.out_features == 8 * 8 * 3 and model.num_prefix_tokens == 1
    images = torch.randn(2, 3, 32, 32)
    last = 1 + 16 - 1   # the last patch's token: after the class token and 15 patches
    with torch.no_grad():
        before, after = model(images), model(_last_patch_changed(images, 8))
        assert before.shape == (2, 17, 192)
        torch.testing.assert_close(after[:, :last], before[:, :last], rtol=1e-5, atol=1e-6)
        assert (after[:, last] - before[:, last]).abs().max() > 1e-3
        full = create_model_from_config(cfg.model, 192, 32, extra_kwargs=dict(global_pool='', local_mix=False)).eval()
        full.load_state_dict(weights)
        changed = full(_last_patch_changed(images, 8))[:, :last] - full(images)[:, :last]
        assert changed.abs().max() > 1e-3
    assert load_trained(run).model.head.out_features == 192

    # fine-tune: the classifier starts from the AR weights (all but the head and the local mixing it lacked)
    cls_cfg = tiny_config('train.epochs=1', 'train.max_steps=1', f"model.pretrained_file={run}/model.safetensors",
                          out='cls')
    classifier = ClassificationTask(cls_cfg).build_model(4)
    state = classifier.state_dict()
    assert state['head.weight'].shape == (4, 48)
    for key, value in weights.items():
        if not key.startswith('head.'):
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    torch.testing.assert_close(state['blocks.0.attn.qkv.weight'], weights['blocks.0.attn.qkv.weight'], rtol=0, atol=0)
    assert set(state) - set(weights) == set(linear_only_parameter_names(classifier))
    assert np.isfinite(train(cls_cfg)['top1'])
