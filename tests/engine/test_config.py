"""The config system: schema defaults, _base_ files, dotted overrides, strict keys with suggestions, types."""
import os

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

from linvit.engine.config import ConfigError, config_from_yaml, config_to_yaml, load_config

CONFIGS = os.path.join(os.path.dirname(__file__), '..', '..', 'configs')


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_layers_merge_in_order_base_file_then_overrides(tmp_path):
    _write(tmp_path / 'base.yaml', "data:\n  img_size: 96\n  batch_size: 8\ntrain:\n  epochs: 7\n")
    exp = _write(tmp_path / 'exp.yaml', "_base_: base.yaml\ndata:\n  batch_size: 4\n")
    cfg = load_config(exp, ['train.epochs=2', 'model.kwargs.feature_map=relu', 'model.kwargs.softmax_blocks=[1]'])
    assert cfg.data.img_size == 96            # from the base file
    assert cfg.data.batch_size == 4           # the experiment overrides the base
    assert cfg.train.epochs == 2              # the command line overrides both
    assert cfg.train.lr == 1e-3               # the schema's default
    assert OmegaConf.to_container(cfg.model.kwargs) == {'feature_map': 'relu', 'softmax_blocks': [1]}


@pytest.mark.parametrize('override, key, suggestion', [
    ('train.epochz=3', 'train.epochz', 'train.epochs'),
    ('trian.epochs=3', 'trian', 'train'),
    ('data.aug.hflp=0.1', 'data.aug.hflp', 'data.aug.hflip'),
    ('output_dri=x', 'output_dri', 'output_dir'),
])
def test_unknown_key_names_the_closest_valid_key(override, key, suggestion):
    with pytest.raises(ConfigError, match=rf"command line: unknown config key '{key}'; did you mean '{suggestion}'"):
        load_config(None, [override])


def test_unknown_key_in_a_file_names_the_file(tmp_path):
    path = _write(tmp_path / 'bad.yaml', "train:\n  warmup_epoch: 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown config key 'train\.warmup_epoch'; did you mean "
                                          r"'train\.warmup_epochs'"):
        load_config(path)


@pytest.mark.parametrize('override, key', [('train.epochs=abc', 'train.epochs'), ('data.img_size=1.5', 'data.img_size'),
                                           ('train.compile=maybe', 'train.compile')])
def test_wrong_type_names_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"bad value for '{key}'"):
        load_config(None, [override])


@pytest.mark.parametrize('override', ['train.amp=fp8', 'data.name=imagenet'])
def test_choices_are_checked(override):
    key, value = override.split('=')
    with pytest.raises(ConfigError, match=rf"{key}='{value}' is not one of"):
        load_config(None, [override])


def test_required_value_and_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"\['data.root'\] have no value.*data.root=..."):
        load_config(os.path.join(CONFIGS, 'cls_folder.yaml'))
    with pytest.raises(ConfigError, match="'train.epochs' is not key=value"):
        load_config(None, ['train.epochs'])
    with pytest.raises(ConfigError, match='nope.yaml.* does not exist'):
        load_config(str(tmp_path / 'nope.yaml'))


def test_base_cycle_is_an_error(tmp_path):
    _write(tmp_path / 'a.yaml', "_base_: b.yaml\n")
    _write(tmp_path / 'b.yaml', "_base_: a.yaml\n")
    with pytest.raises(ConfigError, match='cycle'):
        load_config(str(tmp_path / 'a.yaml'))


def test_yaml_is_read_safely(tmp_path):
    path = _write(tmp_path / 'evil.yaml', "output_dir: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError, match='not valid YAML'):
        load_config(path)


def test_saved_yaml_round_trips_and_is_read_only():
    cfg = load_config(None, ['train.epochs=3', 'model.kwargs.depth=2'])
    again = load_config(None, base=config_from_yaml(config_to_yaml(cfg)))
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)
    with pytest.raises(ReadonlyConfigError):
        cfg.train.epochs = 5


@pytest.mark.parametrize('name', sorted(f for f in os.listdir(CONFIGS) if f.endswith('.yaml')))
def test_every_shipped_config_resolves(name):
    cfg = load_config(os.path.join(CONFIGS, name), ['data.root=/data/x'])
    expected_task = {'cls': 'classification', 'seg': 'seg', 'ar': 'ar'}[name.split('_')[0]]
    assert cfg.task == expected_task
