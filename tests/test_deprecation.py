"""Warnings about old names and ignored arguments point at the user's line, not at a line inside linvit or timm.

Python shows a warning with the file and line it names (and its default filter shows it once per such location), so
a warning named inside the library tells the user nothing about which of their calls to change.
"""
import os
import warnings

import pytest
import timm
import torch

import linvit
import linvit.fast
from linvit.deprecation import warn_renamed
from linvit.models.linvit import LinearVisionTransformer
from linvit.precision import resolve_precision

TINY = 'linvit_tiny_patch16_224'


def _warned_at(category, call):
    """(filename, line number) the one warning of ``category`` that ``call()`` raised names."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        call()
    ours = [w for w in caught if issubclass(w.category, category)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    return ours[0].filename, ours[0].lineno


def _line_of(marker: str) -> int:
    """The line of this file that ends with ``# marker``."""
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f'# {marker}'))


def test_attn_kernel_through_timm_create_model_names_the_callers_line():
    def build():
        return timm.create_model('linvit_tiny_patch16_224', attn_kernel='relu', depth=1)  # create_model
    where = _warned_at(FutureWarning, build)
    assert where == (__file__, _line_of('create_model'))


def test_attn_kernel_on_the_model_class_names_the_callers_line():
    def build():
        return LinearVisionTransformer(attn_kernel='relu', depth=1, embed_dim=64, num_heads=2)  # class
    where = _warned_at(FutureWarning, build)
    assert where == (__file__, _line_of('class'))


def test_attn_kernel_in_convert_to_linear_names_the_callers_line():
    vit = timm.create_model('vit_tiny_patch16_224', depth=1)
    where = _warned_at(FutureWarning, lambda: linvit.convert_to_linear(vit, attn_kernel='gated'))  # convert
    assert where == (__file__, _line_of('convert'))


def test_a_moved_name_names_the_line_that_reads_it():
    where = _warned_at(FutureWarning, lambda: linvit.fast.make_floor)  # moved
    assert where == (__file__, _line_of('moved'))


def test_a_moved_name_imported_with_from_names_the_import_line():
    """``from package import old_name`` looks the name up inside importlib first (frozen frames), then again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        from linvit.fast import make_floor  # noqa: F401  # from-import
    places = {(w.filename, w.lineno) for w in caught if issubclass(w.category, FutureWarning)}
    assert places == {(__file__, _line_of('from-import'))}


def test_an_old_precision_alias_names_the_callers_line():
    where = _warned_at(FutureWarning, lambda: resolve_precision('bf16', '--dtype'))  # alias
    assert where == (__file__, _line_of('alias'))


def test_an_ignored_overlay_file_names_the_callers_line(tmp_path):
    path = tmp_path / 'w.pth'
    torch.save({}, path)
    overlay = dict(file=str(path))
    where = _warned_at(UserWarning, lambda: timm.create_model(TINY, depth=1, pretrained_cfg_overlay=overlay))  # overlay
    assert where == (__file__, _line_of('overlay'))


@pytest.mark.parametrize('depth', [0, 1, 3])
def test_the_users_line_is_found_through_any_number_of_library_frames(depth):
    """user_stacklevel walks past every linvit frame: the same warning raised from deeper library code still names
    the line in this file."""
    library = _library_function('def nested(level):\n'
                                '    return warn_renamed("old", "new") if level == 0 else nested(level - 1)\n')
    where = _warned_at(FutureWarning, lambda: library(depth))  # nested
    assert where == (__file__, _line_of('nested'))


def _library_function(source: str):
    """The one function ``source`` defines, compiled as if its file were inside the linvit package."""
    namespace = {'warn_renamed': warn_renamed}
    exec(compile(source, os.path.join(os.path.dirname(linvit.__file__), 'fake_library_module.py'), 'exec'), namespace)
    return next(v for k, v in namespace.items() if k != 'warn_renamed' and callable(v))
