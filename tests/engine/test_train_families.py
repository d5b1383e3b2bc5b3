"""Every attention family is selectable from a training config (model.kwargs.attn_family) and trains there."""
import json
import math
import os

import pytest

import linvit
from linvit.engine import train
from linvit.layers import ATTENTION_FAMILIES

pytestmark = pytest.mark.integration  # trains or starts interpreters


@pytest.mark.parametrize('family', [name for name in linvit.list_attention_families() if name != 'linear'])
def test_a_config_selects_the_family_and_trains(tiny_config, family):
    cfg = tiny_config(f'model.kwargs.attn_family={family}', 'train.max_steps=2', out=family)
    if family == 'linformer':
        cfg = tiny_config(f'model.kwargs.attn_family={family}', 'model.kwargs.attn_options.low_rank_size=2',
                          'train.max_steps=2', out=family)
    metrics = train(cfg)
    assert math.isfinite(metrics['loss'])
    with open(os.path.join(cfg.output_dir, 'config.yaml')) as f:
        assert f'attn_family: {family}' in f.read()
    with open(os.path.join(cfg.output_dir, 'metrics.json')) as f:
        assert json.load(f)['loss'] == pytest.approx(metrics['loss'])
    from linvit.engine.loading import load_trained
    trained = load_trained(cfg.output_dir)
    assert isinstance(trained.model.blocks[0].attn, ATTENTION_FAMILIES[family])
