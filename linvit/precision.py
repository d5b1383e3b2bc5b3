"""One name per numeric precision, for configs, command lines and reports: torch's own dtype names.

    PRECISIONS['bfloat16'] -> torch.bfloat16
    resolve_precision('bf16') -> 'bfloat16' (with a FutureWarning naming the new word)

What a precision applies to is the caller's to say: the trainer's ``train.precision`` is the autocast dtype
('float32' runs without autocast), the benchmarks' ``--dtype`` is the dtype of weights and inputs.
"""
from typing import Dict

import torch

from .deprecation import warn_renamed

__all__ = ['PRECISIONS', 'PRECISION_ALIASES', 'resolve_precision', 'precision_dtype']

#: precision name -> torch dtype
PRECISIONS: Dict[str, torch.dtype] = {
    'float32': torch.float32,
    'bfloat16': torch.bfloat16,
    'float16': torch.float16,
}

#: names older releases used (``train.amp``, the tools' ``--dtype``), kept for one release
PRECISION_ALIASES: Dict[str, str] = {'none': 'float32', 'fp32': 'float32', 'bf16': 'bfloat16', 'fp16': 'float16'}


def resolve_precision(name: str, what: str = 'precision') -> str:
    """The precision name for ``name``: a key of PRECISIONS, or an old alias (FutureWarning naming the new word).

    what: how the caller's users set it (e.g. 'train.precision', '--dtype'), for the messages.
    Raises ValueError for anything else, listing the names.
    """
    if name in PRECISIONS:
        return name
    if name in PRECISION_ALIASES:
        new = PRECISION_ALIASES[name]
        warn_renamed(f"{what}={name!r}", f"{what}={new!r}")
        return new
    raise ValueError(f"{what}={name!r} is not a precision; expected one of {list(PRECISIONS)}")


def precision_dtype(name: str, what: str = 'precision') -> torch.dtype:
    """torch dtype of a precision name (old aliases warn, as ``resolve_precision``)."""
    return PRECISIONS[resolve_precision(name, what)]
