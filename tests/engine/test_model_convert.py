"""model.convert: a timm softmax ViT (RoPE backbones and patch-14 DINOv2 included) converted to linear attention in
train.py, for classification and as a segmentation backbone at any size the patch divides; checked against models
built by hand from timm and convert_to_linear with the run's weights."""
import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from tiny_run import TINY_RUN, TINY_SEG

import linvit
from linvit.engine import ConfigError, load_config, train
from linvit.engine.loading import load_trained
from linvit.layers import LinearAttention
from linvit.models import SegmentationModel

SMALL = ['model.kwargs.depth=2', 'model.kwargs.embed_dim=48', 'model.kwargs.num_heads=3']


@pytest.mark.parametrize('name, patch, size, other', [('vit_small_patch16_dinov3', 8, 32, (40, 56)),
                                                      ('vit_small_patch14_dinov2', 7, 35, (42, 28))])
@pytest.mark.integration
def test_a_converted_backbone_segments_at_any_multiple_of_its_patch(tmp_path, name, patch, size, other):
    out = tmp_path / 'run'
    train(load_config(None, [f'model.name={name}', *SMALL, f'model.kwargs.patch_size={patch}',
                             'model.convert.feature_map=relu', *TINY_SEG, f'data.img_size={max(size, 32)}',
                             'train.epochs=1', f'output_dir={out}']))
    backbone = timm.create_model(name, depth=2, embed_dim=48, num_heads=3, patch_size=patch, num_classes=0,
                                 img_size=max(size, 32), dynamic_img_size=True)
    linvit.convert_to_linear(backbone, feature_map='relu')
    weights = load_file(out / 'model.safetensors')
    by_hand = SegmentationModel(backbone, num_classes=3, neck_dim=16, head_dim=16)
    by_hand.load_state_dict(weights)  # strict: the run's model is this one
    loaded = load_trained(str(out)).model
    assert sum(isinstance(m, LinearAttention) for m in loaded.modules()) == 2
    images = torch.randn(2, 3, *other)
    with torch.no_grad():
        want = by_hand.eval()(images)
        got = loaded(images)
    assert got.shape == (2, 3, *other)
    torch.testing.assert_close(got, want)


@pytest.mark.integration
def test_softmax_weights_load_before_the_conversion(tmp_path):
    """model.pretrained_file holds a softmax checkpoint; the converted model keeps every tensor of it."""
    softmax = timm.create_model('vit_small_patch16_dinov3', depth=2, embed_dim=48, num_heads=3, patch_size=8,
                                img_size=32, num_classes=4)
    save_file(softmax.state_dict(), tmp_path / 'softmax.safetensors')
    cfg = load_config(None, ['model.name=vit_small_patch16_dinov3', *SMALL, 'model.kwargs.patch_size=8',
                             f'model.pretrained_file={tmp_path / "softmax.safetensors"}', 'model.convert={}',
                             *TINY_RUN, 'train.epochs=1', 'train.lr=0', 'train.warmup_lr=0', 'train.min_lr=0',
                             f'output_dir={tmp_path / "run"}'])
    train(cfg)
    trained = load_file(tmp_path / 'run' / 'model.safetensors')
    assert set(trained) == set(softmax.state_dict())
    assert sum(isinstance(m, LinearAttention) for m in load_trained(str(tmp_path / 'run')).model.modules()) == 2
    for key, value in softmax.state_dict().items():
        torch.testing.assert_close(trained[key], value, msg=key)


@pytest.mark.integration
def test_bad_conversions_are_one_line_config_errors(tmp_path):
    base = ['model.name=vit_small_patch16_dinov3', *SMALL, 'model.kwargs.patch_size=8', *TINY_RUN,
            f'output_dir={tmp_path / "run"}']
    for option, match in (('model.convert.attn_family=performer', r"model.convert=\{'attn_family': 'performer'\}: "
                                                                  r".*converts to attn_family='linear'"),
                          ('model.convert.feature_map=nope', r"model.convert=\{'feature_map': 'nope'\}: .*nope")):
        with pytest.raises(ConfigError, match=match) as error:
            train(load_config(None, [*base, option]))
        assert '\n' not in str(error.value)
