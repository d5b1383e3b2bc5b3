"""Tiny, fast training configurations for the engine tests (a 2-block, 48-wide linvit at 32 px)."""
import pytest
from tiny_run import TINY_MODEL, TINY_RUN

import linvit  # noqa: F401  (registers linvit_* with timm)
from linvit.engine import load_config, plots


@pytest.fixture
def tiny_config(tmp_path):
    """load_config for a tiny synthetic run in tmp_path/run, plus any extra overrides."""
    def make(*overrides, out='run'):
        return load_config(None, [*TINY_MODEL, *TINY_RUN, f'output_dir={tmp_path / out}', *overrides])
    return make


@pytest.fixture
def saved_figures(monkeypatch):
    """The figures the plots module saves, in order: their axes (and legend) say where a cell, panel or patch is in
    the PNG."""
    figures = []
    save = plots._save_png

    def save_and_keep(fig, png_path, dpi):
        save(fig, png_path, dpi)
        figures.append(fig)

    monkeypatch.setattr(plots, '_save_png', save_and_keep)
    return figures
