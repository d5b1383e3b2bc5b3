"""linvit.bench.specs: image sizes, model specs and the softmax counterpart of a linvit model."""
import argparse

import pytest

from linvit.bench.profile import Config
from linvit.bench.specs import counterpart, parse_model_spec, parse_size, size_label


def test_sizes_accept_square_and_height_by_width():
    assert parse_size('224') == (224, 224)
    assert parse_size('384x640') == (384, 640)
    for bad in ('', 'x', '0', '224x', '1x2x3', 'abc'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
    assert (size_label(224, 224), size_label(384, 640)) == ('224', '384x640')


def test_model_specs_parse_kwargs_as_literals():
    spec = parse_model_spec("linvit_small_patch16_224:local_mix=False,softmax_blocks=(0, 6),feature_map=relu")
    assert spec.name == 'linvit_small_patch16_224' and spec.kind == 'linvit'
    assert dict(spec.kwargs) == {'local_mix': False, 'softmax_blocks': (0, 6), 'feature_map': 'relu'}
    assert spec.as_floor().label == f"floor({spec.spec})" and spec.as_floor().kind == 'floor'
    assert parse_model_spec('vit_small_patch16_224').kind == 'softmax'
    with pytest.raises(ValueError):
        parse_model_spec('vit_small_patch16_224:depth')
    # tuples survive the trip to the child process as tuples
    config = Config(spec, 384, 640, 2, 'bfloat16', 'compiled', 'training', 'cpu', 1, 3)
    assert Config.from_json(config.to_json()) == config


def test_counterpart_pairs_linvit_with_its_softmax_model():
    softmax = ['vit_base_patch16_224', 'vit_small_patch16_224']
    assert counterpart('linvit_small_patch16_224', softmax) == 'vit_small_patch16_224'
    assert counterpart('linvit_small_patch16_512', softmax) == 'vit_small_patch16_224'
    assert counterpart('linvit_tiny_patch16_224', ['deit_tiny_patch16_224']) == 'deit_tiny_patch16_224'
    assert counterpart('linvit_tiny_patch16_224', softmax) is None
    assert counterpart('linvit_tiny_patch16_224', []) is None
