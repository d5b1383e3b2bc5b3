"""Old public names that keep working for one release, each raising a FutureWarning that names the new word.

A module keeps its old names in one dict and hands attribute lookups to ``module_getattr``:

    _RENAMED = {'ATTENTION_KINDS': ('BLOCK_TYPES', lambda: BLOCK_TYPES)}
    def __getattr__(name): return module_getattr(__name__, _RENAMED, name)

Arguments and values (an old keyword, an old config value) warn through ``warn_renamed``.
"""
import warnings
from typing import Any, Callable, Dict, Tuple

__all__ = ['warn_renamed', 'module_getattr']


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """FutureWarning: ``old`` is deprecated, use ``new`` (both as the user writes them)."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", FutureWarning,
                  stacklevel=stacklevel)


def module_getattr(module: str, renamed: Dict[str, Tuple[str, Callable[[], Any]]], name: str) -> Any:
    """A module ``__getattr__``: ``renamed[name] = (new name, getter)`` warns and returns the getter's value;
    other names raise AttributeError as Python does."""
    if name in renamed:
        new, getter = renamed[name]
        warn_renamed(f"{module}.{name}", f"{module}.{new}" if '.' not in new else new, stacklevel=4)
        return getter()
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
