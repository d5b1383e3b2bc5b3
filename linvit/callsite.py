"""Where a warning should point: the first line of the user's own code, past linvit's and timm's frames.

    warnings.warn(message, UserWarning, stacklevel=user_stacklevel())
"""
import os
import sys

__all__ = ['user_stacklevel']

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
