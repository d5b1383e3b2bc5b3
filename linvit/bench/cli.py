"""What the benchmark command lines share: the help formatter that shows every default, ``--dtype`` parsing, and
the crossover of two speed curves."""
import argparse
from typing import Any, Optional, Sequence, Tuple

__all__ = ['HelpFormatter', 'crossover', 'precision_arg']


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the docstring's layout and ends every option's help with its default: '(default: float32)'. Options
    whose default is None say what that means in their own help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ''
        default = action.default
        if default is None or default is argparse.SUPPRESS or '(default' in text:
            return text
        if default is False:  # a flag
            return f"{text} (default: off)"
        shown = ' '.join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def precision_arg(text: str) -> str:
    """argparse ``type`` of ``--dtype``: a precision name of ``linvit.precision`` (float32, bfloat16, float16);
    anything else is a usage error listing them."""
    from linvit.precision import resolve_precision

    try:
        return resolve_precision(text, '--dtype')
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def crossover(points: Sequence[Tuple[Any, Optional[float], Optional[float]]]) -> Optional[Any]:
    """First key from which ``a`` beats ``b`` at that and every later key; points = (key, a speed, b speed) sorted by
    size, larger speed is better. A missing ``b`` (out of memory or time) counts as a win for ``a``, a missing ``a``
    as a loss."""
    result = None
    for key, a, b in reversed(points):
        if a is None or (b is not None and a <= b):
            break
        result = key
    return result
