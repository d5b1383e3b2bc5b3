"""The bounded forward (linvit.models.bounded) against the plain forward of the same model: every option a linvit
model has (local mix, class and register tokens, learnable maps, timm ViTs converted to linear attention), bands of
every size including ones that do not divide the grid, and one-line refusals for what has no state form."""
import pytest
import timm
import torch
from references import rel_err

import linvit
from linvit.models import bounded_forward_features, bounded_forward_intermediates

CASES = {
    'plain-cls': dict(),
    'local-mix': dict(local_mix=True),
    'avg-no-cls': dict(class_token=False, global_pool='avg', local_mix=True),
    'registers': dict(reg_tokens=2, local_mix=True, feature_map='relu'),
    'hedgehog': dict(feature_map='hedgehog'),
    'no-embed-class': dict(no_embed_class=True, feature_map='focused', local_mix=True),
}


def _model(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model('linvit_tiny_patch16_224', depth=3, img_size=64, patch_size=8, dynamic_img_size=True,
                              **kwargs).eval()
    for module in model.modules():  # the local branch starts at zero: give it weights, so it is tested
        if isinstance(module, linvit.layers.LocalMix):
            torch.nn.init.normal_(module.conv.weight, std=0.3)
    return model


@pytest.mark.parametrize('case', list(CASES))
@pytest.mark.parametrize('rows', [1, 3, 16])
def test_bounded_features_equal_the_plain_forward(case, rows):
    model = _model(**CASES[case])
    images = torch.randn(2, 3, 88, 72)  # an 11 x 9 grid: bands of 3 rows leave a band of 2
    with torch.no_grad():
        plain = model.forward_features(images)
    bounded = bounded_forward_features(model, images, rows_per_chunk=rows)
    assert bounded.shape == plain.shape
    assert rel_err(bounded, plain) < 1e-5
    with torch.no_grad():
        assert rel_err(model.forward_head(bounded), model.forward_head(plain)) < 1e-5  # pooling: mean or class


def test_bounded_intermediates_equal_forward_intermediates():
    model = _model(local_mix=True)
    images = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        plain = model.forward_intermediates(images, indices=[0, 2], norm=False, output_fmt='NCHW',
                                            intermediates_only=True)
    bounded = bounded_forward_intermediates(model, images, [0, 2], rows_per_chunk=3)
    assert [tuple(t.shape) for t in bounded] == [tuple(t.shape) for t in plain]
    for got, want in zip(bounded, plain):
        assert rel_err(got, want) < 1e-5


def test_a_converted_timm_vit_runs_bounded():
    vit = timm.create_model('vit_tiny_patch16_224', depth=2, img_size=64, dynamic_img_size=True)
    model = linvit.convert_to_linear(vit, local_mix=True).eval()
    images = torch.randn(1, 3, 80, 80)  # square: the plain forward of a converted timm ViT infers its grid
    with torch.no_grad():
        plain = model.forward_features(images)
    assert rel_err(bounded_forward_features(model, images, rows_per_chunk=2), plain) < 1e-5


@pytest.mark.parametrize('kwargs, words', [
    (dict(softmax_blocks=[1]), 'softmax attention'),
    (dict(attn_family='performer'), "attn_family='performer', which has no state form"),
])
def test_what_has_no_state_form_is_refused_in_one_line(kwargs, words):
    model = _model(**kwargs)
    with pytest.raises(ValueError, match='sliding windows') as error:
        bounded_forward_features(model, torch.randn(1, 3, 64, 64))
    assert words in str(error.value) and '\n' not in str(error.value)


def test_training_mode_and_bad_band_sizes_are_refused():
    model = _model()
    with pytest.raises(ValueError, match='rows_per_chunk'):
        bounded_forward_features(model, torch.randn(1, 3, 64, 64), rows_per_chunk=0)
    with pytest.raises(ValueError, match='model.eval'):
        bounded_forward_features(model.train(), torch.randn(1, 3, 64, 64))
