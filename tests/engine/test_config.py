"""The config system: schema defaults, _base_ files, dotted overrides, strict keys with suggestions, types."""
import os
import warnings

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

from linvit.engine.config import ConfigError, config_from_yaml, config_to_yaml, load_config
from linvit.engine.tasks import architecture_keys

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


@pytest.mark.parametrize('override, message', [
    ('train.precision=fp8', r"train\.precision='fp8' is not one of \['float32', 'bfloat16', 'float16'\]"),
    ('data.name=imagenet', r"unknown data\.name 'imagenet'; known: synthetic, folder"),
    ('data.name=foldr', r"unknown data\.name 'foldr'; did you mean 'folder'\?"),
    ('seg.head=mpl', r"unknown seg\.head 'mpl'; did you mean 'mlp'\?"),
    ('task=segmentaton', r"unknown task 'segmentaton'; did you mean 'segmentation'\?"),
])
def test_choices_are_checked_against_the_registries(override, message):
    with pytest.raises(ConfigError, match=message):
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
    # the saved YAML holds resolved values (a default from a resolver, e.g. detection.category_ids, as a list)
    assert OmegaConf.to_container(again, resolve=True) == OmegaConf.to_container(cfg, resolve=True)
    with pytest.raises(ReadonlyConfigError):
        cfg.train.epochs = 5


@pytest.mark.parametrize('name', sorted(f for f in os.listdir(CONFIGS) if f.endswith('.yaml')))
def test_every_shipped_config_resolves(name):
    cfg = load_config(os.path.join(CONFIGS, name), ['data.root=/data/x', 'linearize.teacher=runs/x'])
    expected_task = {'cls': 'classification', 'seg': 'segmentation', 'ar': 'autoregressive',
                     'linearize': 'linearize', 'det': 'detection', 'depth': 'depth'}[name.split('_')[0]]
    assert cfg.task == expected_task
    assert cfg.output_dir == f"runs/{name[:-len('.yaml')]}"  # the run directory is named after the config


def test_run_directory_defaults_to_the_config_stem_unless_a_file_or_the_command_line_sets_it(tmp_path):
    _write(tmp_path / 'base.yaml', "train:\n  epochs: 7\n")
    child = _write(tmp_path / 'my_exp.yaml', "_base_: base.yaml\n")
    assert load_config(child).output_dir == 'runs/my_exp'
    assert load_config(child, ['output_dir=/tmp/elsewhere']).output_dir == '/tmp/elsewhere'
    _write(tmp_path / 'placed.yaml', "output_dir: runs/shared\n")
    assert load_config(_write(tmp_path / 'other.yaml', "_base_: placed.yaml\n")).output_dir == 'runs/shared'
    assert load_config(None).output_dir == 'runs/default'
    assert load_config(os.path.join(CONFIGS, 'seg_demo.yaml')).output_dir == 'runs/seg_demo'


def _leaves(values, prefix=''):
    """{'data.aug.hflip': 0.5, ...} of a nested dict."""
    leaves = {}
    for key, value in values.items():
        leaves.update(_leaves(value, f'{prefix}{key}.') if isinstance(value, dict) and value else
                      {f'{prefix}{key}': value})
    return leaves


def test_ar_demo_is_cls_demo_with_its_task_and_no_mirroring():
    ar, cls = (_leaves(OmegaConf.to_container(load_config(os.path.join(CONFIGS, f'{name}_demo.yaml'))))
               for name in ('ar', 'cls'))
    assert set(ar) == set(cls)
    assert {key for key in ar if ar[key] != cls[key]} == {'task', 'output_dir', 'data.aug.hflip', 'train.epochs'}
    assert (ar['task'], ar['output_dir'], ar['data.aug.hflip'], ar['train.epochs']) == \
        ('autoregressive', 'runs/ar_demo', 0.0, 2)


@pytest.mark.parametrize('override, message', [
    ('task=seg', r"unknown task 'seg'"),
    ('train.amp=bf16', r"unknown config key 'train\.amp'"),
    ('train.precision=bf16', r"train\.precision='bf16' is not one of"),
])
def test_words_of_earlier_drafts_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_new_words_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        cfg = load_config(os.path.join(CONFIGS, 'seg_demo.yaml'), ['train.precision=bfloat16'])
    assert cfg.train.precision == 'bfloat16'




def test_unknown_model_name_is_a_config_error_with_the_closest_names():
    with pytest.raises(ConfigError, match=r"model\.name='linvit_tiny_patch16_22' is not a timm model; did you mean "
                                          r"'linvit_tiny_patch16_224'"):
        load_config(None, ['model.name=linvit_tiny_patch16_22'])
    assert load_config(None, ['model.name=vit_tiny_patch16_224.augreg_in21k']).model.name.startswith('vit_tiny')


def test_keep_from_base_takes_the_architecture_from_the_saved_config_unless_the_command_line_sets_it(tmp_path):
    saved = load_config(None, ['task=segmentation', 'model.kwargs.depth=2', 'model.kwargs.embed_dim=48',
                               'data.img_size=192', 'seg.neck_dim=16', 'seg.feature_blocks=[0,1]'])
    other = _write(tmp_path / 'eval.yaml', "task: classification\nmodel:\n  name: vit_small_patch16_224\n"
                                           "  kwargs:\n    num_heads: 6\ndata:\n  img_size: 512\n  root: photos\n"
                                           "seg:\n  neck_dim: 128\n  dice_weight: 0.5\n  eval:\n    mode: slide\n")
    cfg = load_config(other, ['model.kwargs.depth=3'], base=config_from_yaml(config_to_yaml(saved)),
                      keep_from_base=architecture_keys('segmentation'))
    assert cfg.task == 'segmentation' and cfg.model.name == saved.model.name
    assert OmegaConf.to_container(cfg.model.kwargs) == {'depth': 3, 'embed_dim': 48}  # the file's num_heads: gone
    assert cfg.data.img_size == 192 and cfg.seg.neck_dim == 16 and list(cfg.seg.feature_blocks) == [0, 1]
    # what the file may say: where the data lives and how to evaluate (and the rest of the recipe)
    assert cfg.data.root == 'photos' and cfg.seg.eval.mode == 'slide' and cfg.seg.dice_weight == 0.5
    assert load_config(other, ['data.img_size=256'], base=config_from_yaml(config_to_yaml(saved)),
                       keep_from_base=architecture_keys('segmentation')).data.img_size == 256
