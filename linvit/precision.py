"""One name per numeric precision, for configs, command lines and reports: torch's own dtype names.

    PRECISIONS['bfloat16'] -> torch.bfloat16
    resolve_precision('bfloat16', '--dtype') -> 'bfloat16'; 'bf16' is a ValueError listing the names

What a precision applies to is the caller's to say: the trainer's ``train.precision`` is the autocast dtype
('float32' runs without autocast), the benchmarks' ``--dtype`` is the dtype of weights and inputs.
"""
from typing import Dict

import torch

__all__ = ['PRECISIONS', 'resolve_precision', 'precision_dtype']

#: precision name -> torch dtype
PRECISIONS: Dict[str, torch.dtype] = {
    'float32': torch.float32,
    'bfloat16': torch.bfloat16,
    'float16': torch.float16,
}


def resolve_precision(name: str, what: str = 'precision') -> str:
    """``name`` if it is a key of PRECISIONS.

    what: how the caller's users set it (e.g. 'train.precision', '--dtype'), for the messages.
    Raises ValueError for anything else, listing the names.
    """
    if name in PRECISIONS:
        return name
    raise ValueError(f"{what}={name!r} is not a precision; expected one of {list(PRECISIONS)}")


def precision_dtype(name: str, what: str = 'precision') -> torch.dtype:
    """torch dtype of a precision name; ValueError for other names (``resolve_precision``)."""
    return PRECISIONS[resolve_precision(name, what)]
