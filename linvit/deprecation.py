"""Old public names that keep working for one release, each raising a FutureWarning that names the new word.

A module keeps its old names in one dict and hands attribute lookups to ``module_getattr``:

    _RENAMED = {'ATTENTION_KINDS': ('BLOCK_TYPES', lambda: BLOCK_TYPES)}
    def __getattr__(name): return module_getattr(__name__, _RENAMED, name)

Arguments and values (an old keyword, an old config value) warn through ``warn_renamed``.
"""
import os
import sys
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ['warn_renamed', 'module_getattr', 'user_stacklevel']

_LINVIT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _is_importlib_frame(filename: str) -> bool:
    """importlib's own frames, which ``warnings.warn`` passes over without counting them in ``stacklevel``."""
    return 'importlib' in filename and '_bootstrap' in filename


def _is_library_frame(filename: str) -> bool:
    """Code the user did not write: linvit, timm (``timm.create_model`` builds linvit models), importlib."""
    if filename.startswith(_LINVIT_DIR) or _is_importlib_frame(filename):
        return True
    timm = sys.modules.get('timm')
    timm_file = getattr(timm, '__file__', None)
    return bool(timm_file) and filename.startswith(os.path.dirname(os.path.abspath(timm_file)) + os.sep)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function that calls this one so that the warning names the
    first line outside linvit and timm: the user's call, however many library frames lie between (a model built
    directly or through ``timm.create_model``, a function called directly or through a wrapper)."""
    frame, level = sys._getframe(1), 1  # level 1: the caller's own frame, as warnings.warn counts
    while frame.f_back is not None and _is_library_frame(frame.f_code.co_filename):
        frame = frame.f_back
        level += not _is_importlib_frame(frame.f_code.co_filename)
    return level


def warn_renamed(old: str, new: str, stacklevel: Optional[int] = None) -> None:
    """FutureWarning: ``old`` is deprecated, use ``new`` (both as the user writes them). stacklevel None: the
    warning names the user's line (``user_stacklevel``)."""
    if stacklevel is None:
        stacklevel = user_stacklevel()
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", FutureWarning,
                  stacklevel=stacklevel)


def module_getattr(module: str, renamed: Dict[str, Tuple[str, Callable[[], Any]]], name: str) -> Any:
    """A module ``__getattr__``: ``renamed[name] = (new name, getter)`` warns and returns the getter's value;
    other names raise AttributeError as Python does."""
    if name in renamed:
        new, getter = renamed[name]
        warn_renamed(f"{module}.{name}", f"{module}.{new}" if '.' not in new else new)
        return getter()
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
