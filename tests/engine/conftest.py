"""Tiny, fast training configurations for the engine tests (a 2-block, 48-wide linvit at 32 px)."""
import pytest
from tiny_run import TINY_MODEL, TINY_RUN

import linvit  # noqa: F401  (registers linvit_* with timm)
from linvit.engine import load_config


@pytest.fixture
def tiny_config(tmp_path):
    """load_config for a tiny synthetic run in tmp_path/run, plus any extra overrides."""
    def make(*overrides, out='run'):
        return load_config(None, [*TINY_MODEL, *TINY_RUN, f'output_dir={tmp_path / out}', *overrides])
    return make
