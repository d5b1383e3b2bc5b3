"""linvit.engine.loading: a trained model back from a run directory, a checkpoint (EMA weights first) or a
.safetensors file beside config.yaml, with its class names and normalisation; clear errors for what is not a run."""
import os
import shutil

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from timm.models.vision_transformer import checkpoint_filter_fn
from tiny_run import TINY_MODEL, TINY_SEG

from linvit.engine import load_config
from linvit.engine.checkpoint import load_checkpoint
from linvit.engine.loading import WeightsMismatchError, load_trained, load_weights, resample_position_embeddings
from linvit.engine.tasks.segmentation import create_segmentation_model


@pytest.fixture(scope='module')
def ema_run(tmp_path_factory, shared_run):
    """A finished tiny classification run with EMA weights (so model and EMA weights differ)."""
    return shared_run('cls_ema', tmp_path_factory.mktemp('loading') / 'run')


def _same_weights(model, weights):
    state = model.state_dict()
    assert set(state) == set(weights)
    return all(torch.equal(state[k], weights[k]) for k in weights)


def test_a_run_directory_gives_its_final_weights_class_names_and_normalisation(ema_run):
    trained = load_trained(str(ema_run))
    assert trained.weights_path == os.path.join(str(ema_run), 'model.safetensors')
    assert _same_weights(trained.model, load_file(ema_run / 'model.safetensors'))
    assert trained.class_names == [str(n) for n in load_checkpoint(ema_run / 'last.pt')['class_names']]
    assert trained.task == 'classification' and not trained.model.training
    cfg = timm.models.get_pretrained_cfg('linvit_tiny_patch16_224')
    assert trained.mean == tuple(cfg.mean) and trained.std == tuple(cfg.std)
    assert trained.img_size == (32, 32)


def test_a_checkpoint_gives_its_ema_weights(ema_run):
    state = load_checkpoint(ema_run / 'last.pt')
    assert not all(torch.equal(state['ema'][k], state['model'][k]) for k in state['model'])
    trained = load_trained(str(ema_run / 'last.pt'))
    assert _same_weights(trained.model, state['ema'])


def test_dynamic_img_size_keeps_the_weights_and_takes_other_sizes(ema_run):
    fixed = load_trained(str(ema_run))
    dynamic = load_trained(str(ema_run), dynamic_img_size=True)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(dynamic.model(images), fixed.model(images))
        assert dynamic.model(torch.randn(1, 3, 48, 64)).shape == (1, len(fixed.class_names))
    with pytest.raises(ValueError, match='img_size'):
        fixed.model(torch.randn(1, 3, 48, 64))


def test_safetensors_beside_its_config_and_numbered_classes_without_a_checkpoint(ema_run, tmp_path, caplog):
    run = tmp_path / 'weights_only'
    run.mkdir()
    shutil.copy(ema_run / 'config.yaml', run / 'config.yaml')
    weights = load_file(ema_run / 'model.safetensors')
    save_file(weights, run / 'model.safetensors')
    trained = load_trained(str(run / 'model.safetensors'))
    classes = weights['head.weight'].shape[0]
    assert trained.class_names == [str(i) for i in range(classes)]
    assert 'numbered' in caplog.text


def test_what_is_not_a_run_is_named(ema_run, tmp_path):
    with pytest.raises(FileNotFoundError, match='does not exist'):
        load_trained(str(tmp_path / 'missing'))
    (tmp_path / 'empty').mkdir()
    with pytest.raises(FileNotFoundError, match='not a linvit run directory'):
        load_trained(str(tmp_path / 'empty'))
    save_file({'x': torch.zeros(1)}, tmp_path / 'lonely.safetensors')
    with pytest.raises(FileNotFoundError, match='no config.yaml next to it'):
        load_trained(str(tmp_path / 'lonely.safetensors'))
    torch.save({'model': {}}, tmp_path / 'bare.pt')
    with pytest.raises(RuntimeError, match="no 'config'"):
        load_trained(str(tmp_path / 'bare.pt'))
    run = tmp_path / 'wrong_weights'
    run.mkdir()
    shutil.copy(ema_run / 'config.yaml', run / 'config.yaml')
    weights = load_file(ema_run / 'model.safetensors')
    weights['head.weight'] = weights['head.weight'][:, :5].contiguous()
    save_file(weights, run / 'model.safetensors')
    with pytest.raises(RuntimeError, match='does not fit the model'):
        load_trained(str(run))


def test_another_image_size_resamples_the_position_embedding_as_timm_does(ema_run):
    at48 = load_trained(str(ema_run), overrides=['data.img_size=48'])
    assert at48.img_size == (48, 48) and at48.model.pos_embed.shape[1] == 1 + 6 * 6
    weights = load_file(ema_run / 'model.safetensors')
    reference = timm.create_model('linvit_tiny_patch16_224', depth=2, embed_dim=48, num_heads=3, patch_size=8,
                                  img_size=48, num_classes=weights['head.weight'].shape[0])
    reference.load_state_dict(checkpoint_filter_fn(dict(weights), reference))  # timm's pretrained-weights path
    assert _same_weights(at48.model, reference.state_dict())


def _tiny_seg_model(img_size):
    cfg = load_config(None, [*TINY_MODEL, *TINY_SEG])
    return create_segmentation_model(cfg.model, cfg.seg, num_classes=3, img_size=img_size)


def test_a_nested_position_embedding_is_resampled_with_its_own_grid():
    weights, bigger = _tiny_seg_model(32).state_dict(), _tiny_seg_model(48)
    fitted = resample_position_embeddings(bigger, weights)
    backbone = {k[len('backbone.'):]: v for k, v in weights.items() if k.startswith('backbone.')}
    expected = checkpoint_filter_fn(backbone, bigger.backbone)['pos_embed']
    assert fitted['backbone.pos_embed'].shape == bigger.backbone.pos_embed.shape == expected.shape
    torch.testing.assert_close(fitted['backbone.pos_embed'], expected, rtol=0, atol=0)
    assert all(fitted[k] is v for k, v in weights.items() if k != 'backbone.pos_embed')


def test_weights_that_do_not_fit_are_one_line_naming_the_keys():
    trained, wider = _tiny_seg_model(32), _tiny_seg_model(32)
    weights = dict(trained.state_dict())
    weights['head.classifier.weight'] = weights['head.classifier.weight'][:2]
    del weights['head.classifier.bias']
    weights['extra.weight'] = torch.zeros(1)
    with pytest.raises(WeightsMismatchError) as info:
        load_weights(wider, weights, 'seg.pt')
    message = str(info.value)
    assert len(message.splitlines()) == 1 and message.startswith('seg.pt does not fit the model')
    assert 'head.classifier.weight is [2, 16, 1, 1] in the weights, [3, 16, 1, 1] in the model' in message
    assert 'head.classifier.bias is missing from the weights' in message
    assert 'extra.weight is in the weights but not in the model' in message
    with pytest.raises(WeightsMismatchError, match='backbone.pos_embed is'):
        load_weights(_tiny_seg_model(48), trained.state_dict(), 'seg.pt', resample_pos_embed=False)
