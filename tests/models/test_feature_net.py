"""The ``features_only`` forms of the linvit models (linvit/models/feature_net.py): the ``.pyramid`` tag gives
``PyramidFeatureNet``, ``ViTPyramid``'s levels with timm's feature-net contract, even through a client's kwarg-less
probe; the plain names keep timm's ViT form (tests/models/test_linvit_models.py checks it against timm's ViT)."""
import pytest
import timm
import torch

import linvit
from linvit.models import PyramidFeatureNet
from linvit.models.segmentation import ViTPyramid

TINY = 'linvit_tiny_patch16_224'
PYRAMID = f'{TINY}.{linvit.models.PYRAMID_TAG}'
NECK_DIM = 32


def _pyramid_features(**kwargs) -> PyramidFeatureNet:
    return timm.create_model(PYRAMID, features_only=True, depth=2, neck_dim=NECK_DIM, dynamic_img_size=True,
                             **kwargs).eval()


def test_pyramid_features_are_vit_pyramids_levels_with_timms_feature_info():
    torch.manual_seed(0)
    features = _pyramid_features()
    assert isinstance(features, PyramidFeatureNet)
    assert features.feature_info.reduction() == [4, 8, 16, 32]
    assert all(type(reduction) is int for reduction in features.feature_info.reduction())
    assert features.feature_info.channels() == [NECK_DIM] * 4
    assert features.feature_info.module_name() == [f'neck.projections.{index}' for index in range(4)]
    assert all(name in dict(features.named_modules()) for name in features.feature_info.module_name())
    pyramid = ViTPyramid(timm.create_model(TINY, depth=2, dynamic_img_size=True), neck_dim=NECK_DIM).eval()
    pyramid.load_state_dict(features.state_dict())  # strict: the same tensors under the same names
    images = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        levels = features(images)
        expected = pyramid.forward_features(images)
    assert [tuple(level.shape) for level in levels] == [(2, NECK_DIM, 64 // s, 96 // s) for s in (4, 8, 16, 32)]
    torch.testing.assert_close(levels, expected, rtol=0, atol=0)


def test_out_indices_pick_levels_and_in_chans_reaches_the_backbone():
    features = _pyramid_features(out_indices=(1, -1), in_chans=1)
    assert features.feature_info.out_indices == (1, 3) and features.feature_info.reduction() == [8, 32]
    with torch.no_grad():
        levels = features(torch.randn(1, 1, 128, 64))
    assert [tuple(level.shape) for level in levels] == [(1, NECK_DIM, 16, 8), (1, NECK_DIM, 4, 2)]
    assert [tuple(level.shape) for level in _pyramid_features(out_indices=1)(torch.randn(1, 3, 32, 32))] == \
        [(1, NECK_DIM, 1, 1)]  # an int: the last n levels, timm's meaning


def test_a_kwargless_probe_sees_the_tag_as_a_hierarchical_encoder_and_the_plain_name_as_timms_vit():
    """What segmentation_models_pytorch builds to choose its encoder's layout: the name and features_only only."""
    with torch.device('meta'):
        pyramid = timm.create_model(PYRAMID, features_only=True)
        plain = timm.create_model(TINY, features_only=True)
    assert pyramid.feature_info.reduction() == [4, 8, 16, 32] and pyramid.feature_info.channels() == [256] * 4
    assert plain.feature_info.reduction() == [16, 16, 16] and plain.feature_info.out_indices == (9, 10, 11)
    assert pyramid.pretrained_cfg['tag'] == 'pyramid' and 'tag' not in plain.pretrained_cfg


def test_the_tag_without_features_only_is_the_plain_classifier():
    model = timm.create_model(PYRAMID, depth=1)
    assert type(model) is linvit.LinearVisionTransformer and model.num_classes == 1000
    assert timm.models.get_pretrained_cfg(TINY).tag is None  # the plain cfg stays the name's default
    assert PYRAMID in timm.list_models('linvit_*', include_tags=True) and PYRAMID not in timm.list_models('linvit_*')


def test_pyramid_options_where_nothing_reads_them_are_errors_naming_the_tag():
    with pytest.raises(ValueError, match=r"^neck_dim: options of the simple feature pyramid, which "
                                         r"timm.create_model\('linvit_tiny_patch16_224.pyramid', features_only=True\)"):
        timm.create_model(TINY, features_only=True, neck_dim=64)
    with pytest.raises(ValueError, match=r"^neck_dim, feature_blocks: options of the simple feature pyramid, which "
                                         r"only features_only=True builds"):
        timm.create_model(PYRAMID, neck_dim=64, feature_blocks=[-1])
