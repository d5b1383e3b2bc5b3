"""The registries: one behaviour for every set of names (``linvit.registry.Registry``), and the shipped sets.

Each ``test_the_shipped_*`` pins one registry's names on purpose; every other test takes names from the registries,
so adding a family, map, task, head or data builder breaks only these lines.
"""
from dataclasses import dataclass

import pytest

import linvit
from linvit.data import DATASET_BUILDERS, SEG_DATASET_BUILDERS
from linvit.engine import TASKS, list_tasks, load_config
from linvit.engine.config import CHOICES, CONFIG_SECTIONS, ConfigError, config_section
from linvit.models import BLOCK_TYPES, SEG_HEADS
from linvit.registry import Registry, UnknownNameError


def test_register_refuses_a_taken_name_and_keeps_the_first_entry():
    heads = Registry('seg.head')
    first, second = object(), object()
    assert heads.register('mlp', first) is first
    assert heads.register('mlp', first) is first  # the same entry again (a module imported twice): no change
    with pytest.raises(ValueError, match=r"seg\.head 'mlp' is already registered"):
        heads.register('mlp', second)
    assert heads.get('mlp') is first and heads.names() == ['mlp']


def test_get_names_the_closest_and_the_known_names():
    heads = Registry('seg.head')
    for name in ('mlp', 'fpn', 'upernet'):
        heads.register(name, name.upper())
    with pytest.raises(UnknownNameError) as info:
        heads.get('mpl')
    assert str(info.value) == "unknown seg.head 'mpl'; did you mean 'mlp'? known: mlp, fpn, upernet"
    assert isinstance(info.value, ValueError) and isinstance(info.value, KeyError)
    with pytest.raises(ValueError, match=r"^unknown seg\.head 'zzz'; known: mlp, fpn, upernet$"):
        heads['zzz']


def test_names_keep_registration_order_and_unregister_removes_one():
    blocks = Registry('block type')
    for name in ('softmax', 'linear', 'hybrid'):
        blocks.register(name, name)
    assert blocks.names() == list(blocks) == ['softmax', 'linear', 'hybrid'] and len(blocks) == 3
    assert blocks.unregister('linear') == 'linear'
    assert 'linear' not in blocks and blocks.names() == ['softmax', 'hybrid']
    with pytest.raises(ValueError, match="unknown block type 'linear'"):
        blocks.unregister('linear')


@pytest.mark.parametrize('registry', [linvit.ATTENTION_FAMILIES, linvit.ops.FEATURE_MAPS, TASKS, SEG_HEADS,
                                      BLOCK_TYPES, DATASET_BUILDERS, SEG_DATASET_BUILDERS, CONFIG_SECTIONS],
                         ids=lambda registry: registry.key)
def test_every_name_set_is_a_registry(registry):
    assert isinstance(registry, Registry) and registry.names()


@pytest.mark.parametrize('key', [key for key, choices in CHOICES.items() if isinstance(choices, Registry)])
def test_config_choices_are_the_registry_names(key):
    """A name registered after import is a valid config value at once; removing it makes it an error again."""
    registry = CHOICES[key]
    registry.register('test_entry', registry.get(registry.names()[0]))
    try:
        assert load_config(None, [f'{key}=test_entry'])
    finally:
        registry.unregister('test_entry')
    with pytest.raises(ConfigError, match=f"unknown {key} 'test_entry'"):
        load_config(None, [f'{key}=test_entry'])


def test_the_config_checks_tasks_heads_and_data_builders_by_their_registries():
    assert CHOICES['task'] is TASKS and CHOICES['seg.head'] is SEG_HEADS and CHOICES['data.name'] is DATASET_BUILDERS
    assert DATASET_BUILDERS.names() == SEG_DATASET_BUILDERS.names()  # one data.name for both kinds of task


def test_a_task_s_config_section_joins_every_run_config():
    """A task module declares its own keys (``config_section``); they load, with defaults and type checks, until the
    section is removed."""
    @dataclass
    class ToySection:
        width: int = 3

    config_section('toy', ToySection)
    try:
        assert load_config(None).toy.width == 3 and load_config(None, ['toy.width=5']).toy.width == 5
        with pytest.raises(ConfigError, match="unknown config key 'toy.widht'; did you mean 'toy.width'"):
            load_config(None, ['toy.widht=5'])
    finally:
        CONFIG_SECTIONS.unregister('toy')
    with pytest.raises(ConfigError, match="unknown config key 'toy'"):
        load_config(None, ['toy.width=5'])


def test_the_shipped_tasks_and_their_sections():
    assert sorted(list_tasks()) == ['autoregressive', 'classification', 'depth', 'detection', 'linearize',
                                   'segmentation']
    sections = CONFIG_SECTIONS.names()  # the engine's own first, then the tasks' in the order they are imported
    assert sections[0] == 'parallel' and sorted(sections[1:]) == ['depth', 'detection', 'linearize', 'seg']


def test_the_shipped_heads_block_types_and_data_builders():
    assert SEG_HEADS.names() == ['mlp', 'upernet', 'dpt', 'linear']
    assert BLOCK_TYPES.names() == ['linear', 'softmax']
    assert DATASET_BUILDERS.names() == ['synthetic', 'folder']
