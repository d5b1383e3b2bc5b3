"""What the family layers share: moving heads between the token-major and head-major layouts, and the key-mask
checks of the families that cannot apply one.

Each family module that calls a check wraps it for torch.fx itself (``torch.fx.wrap`` patches the calling module's
globals): the checks raise on values that are graph inputs under tracing, so they must stay leaves.
"""
from typing import Optional, Tuple

import torch

__all__ = ['heads_first', 'split_heads', 'tokens_last', 'check_no_key_mask']


def heads_first(t: torch.Tensor) -> torch.Tensor:
    """[B, N, H, D] -> [B, H, N, D] (a view)."""
    return t.transpose(1, 2)


def split_heads(qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, N, 3, H, D] -> q, k, v, each [B, H, N, D] (views; the layer applies its q/k norms)."""
    q, k, v = qkv.unbind(2)
    return heads_first(q), heads_first(k), heads_first(v)


def tokens_last(out: torch.Tensor) -> torch.Tensor:
    """[B, H, N, D] -> [B, N, H * D]."""
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


def check_no_key_mask(key_mask: Optional[torch.Tensor], family: str, reason: str) -> None:
    """ValueError for a key mask where ``family`` cannot apply one (an fx leaf: under tracing the mask is a graph
    value, checked when the graph runs)."""
    if key_mask is not None:
        raise ValueError(family + " attention " + reason + " and cannot apply a key mask")
