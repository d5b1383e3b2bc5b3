"""The bounded forward (linvit.models.bounded) against the plain forward of the same model: every option a linvit
model has (local mix, class and register tokens, learnable maps, timm ViTs converted to linear attention), bands of
every size including ones that do not divide the grid, and one-line refusals for what has no state form."""
import pytest
import timm
import torch
from references import rel_err

import linvit
from linvit.inference import whole_inference
from linvit.models import (
    SegmentationModel,
    bounded_forward_features,
    bounded_forward_intermediates,
    bounded_segment,
    iter_bounded_segment,
)

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


# --- segmentation: backbone bands, head tiles with their halo, class ids per band --------------------------------

def _seg_model(patch: int = 8, **kwargs) -> SegmentationModel:
    torch.manual_seed(0)
    backbone = timm.create_model('linvit_tiny_patch16_224', num_classes=0, depth=4, embed_dim=48, num_heads=3,
                                 img_size=64, patch_size=patch, dynamic_img_size=True, **kwargs)
    model = SegmentationModel(backbone, num_classes=5, neck_dim=16, head_dim=16).eval()
    for module in model.modules():  # nonzero local branch; LayerNorm2d with weights, so every level matters
        if isinstance(module, linvit.layers.LocalMix):
            torch.nn.init.normal_(module.conv.weight, std=0.3)
    return model


def _bounded_logits(model, images, rows):
    height, width = images.shape[-2:]
    bands = list(iter_bounded_segment(model, lambda a, b: images[:, :, a:b], images.shape[0], (height, width), rows))
    assert [y0 for y0, _ in bands] == sorted(y0 for y0, _ in bands)
    return torch.cat([logits for _, logits in bands], dim=2)


SEG_CASES = {
    'plain-cls': dict(),
    'local-mix-registers': dict(local_mix=True, reg_tokens=2),
    'avg-no-cls': dict(class_token=False, global_pool='avg', local_mix=True, feature_map='relu'),
}


@pytest.mark.parametrize('case', list(SEG_CASES))
@pytest.mark.parametrize('patch, size', [(8, (88, 72)), (8, (100, 61)), (16, (200, 120)), (12, (150, 100))])
@pytest.mark.parametrize('rows', [1, 3, 6])
def test_bounded_segmentation_equals_whole_inference(case, patch, size, rows):
    model = _seg_model(patch, **SEG_CASES[case])
    images = torch.randn(2, 3, *size)  # sides the patch does not divide are padded, as whole_inference pads them
    with torch.no_grad():
        plain = whole_inference(model, images, pad_multiple=patch)
    bounded = _bounded_logits(model, images, rows)
    assert bounded.shape == plain.shape
    assert rel_err(bounded, plain) < 1e-5


def test_bounded_segmentation_at_1024_px():
    model = _seg_model(16, local_mix=True)
    images = torch.randn(1, 3, 1024, 1024)
    with torch.no_grad():
        plain = whole_inference(model, images, pad_multiple=16)
    assert rel_err(_bounded_logits(model, images, 8), plain) < 1e-5


def test_class_ids_are_the_argmax_of_the_plain_logits():
    model = _seg_model(8, local_mix=True)
    images = torch.randn(1, 3, 96, 80)
    with torch.no_grad():
        plain = whole_inference(model, images, pad_multiple=8)
    classes = bounded_segment(model, images, rows_per_chunk=2)
    assert classes.dtype == torch.uint8 and classes.shape == (1, 96, 80)
    top2 = plain.topk(2, dim=1).values
    disagree = classes.long() != plain.argmax(1)
    assert not disagree.any() or bool(((top2[:, 0] - top2[:, 1])[disagree] < 1e-5).all())  # only exact ties


def test_bounded_segmentation_refuses_in_one_line():
    with pytest.raises(ValueError, match='softmax attention') as error:
        bounded_segment(_seg_model(8, softmax_blocks=[1]), torch.randn(1, 3, 64, 64))
    assert '\n' not in str(error.value)
    with pytest.raises(ValueError, match='not a linvit SegmentationModel'):
        bounded_segment(_model(), torch.randn(1, 3, 64, 64))
    model = _seg_model(8)
    with pytest.raises(ValueError, match=r'read_rows\(0, 8\) must return \[B, C, 8, 64\]'):
        list(iter_bounded_segment(model, lambda a, b: torch.zeros(1, 3, b - a, 60), 1, (64, 64), 1))
