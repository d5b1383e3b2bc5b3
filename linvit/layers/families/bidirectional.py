"""The ``bidirectional`` family: linear attention weighted by decay^distance along forward and backward scans of the
patch grid (Vision-RWKV, ViG style); O(N d^2) per block. Own tensor, with ``data_gate=True`` only: ``scan_gate``."""
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...ops.causal import SCAN_ORDERS, bidirectional_linear_attention_op, grid_scan_orders, retention_decays
from ..family import FamilySpec, register_family
from ..linear_attention import LinearAttention
from ..local_mix import resolve_token_grid
from .common import check_no_key_mask, heads_first, split_heads, tokens_last

__all__ = ['BidirectionalAttention', 'resolve_decays', 'GATE_TEMPERATURE', 'GATE_INIT_BIAS']

# leaves for torch.fx: they branch on shapes and masks; every one also compiles with TorchScript
torch.fx.wrap('bidirectional_linear_attention_op')
torch.fx.wrap('grid_scan_orders')
torch.fx.wrap('resolve_token_grid')
torch.fx.wrap('check_no_key_mask')

#: gates are sigmoid(z) ** (1 / GATE_TEMPERATURE) as in GLA (near 1: slow forgetting); the gate projection starts
#: at weight 0 and bias GATE_INIT_BIAS, a gate of 0.9989 per token, so a new layer starts as the decay alone
GATE_TEMPERATURE = 16.0
GATE_INIT_BIAS = 4.0


def resolve_decays(decay: Any, num_heads: int) -> Optional[Tuple[float, ...]]:
    """decay option -> per-head decays (H floats) or None: 'retnet' (RetNet's schedule, ``retention_decays``),
    None (no decay), a float, or one float per head, each in (0, 1]."""
    if decay is None:
        return None
    if isinstance(decay, str):
        if decay != 'retnet':
            raise ValueError(f"decay must be 'retnet', None, a float or one float per head, got {decay!r}")
        return tuple(retention_decays(num_heads).tolist())
    values = [float(decay)] * num_heads if isinstance(decay, (int, float)) else [float(d) for d in decay]
    if len(values) != num_heads or not all(0.0 < value <= 1.0 for value in values):
        raise ValueError(f"decay must hold one value in (0, 1] (or one per head: {num_heads}), got {decay!r}")
    return tuple(values)


def _check_chunk_size(scan_chunk_size: Optional[int]) -> None:
    if scan_chunk_size is not None and (isinstance(scan_chunk_size, bool) or not isinstance(scan_chunk_size, int)
                                        or scan_chunk_size < 1):
        raise ValueError(f"scan_chunk_size must be an int >= 1 or None, got {scan_chunk_size!r}")


@register_family
class BidirectionalAttention(LinearAttention):
    """Bidirectional decayed / gated linear attention over the patch grid: the sum of a forward and a backward
    causal scan (``linvit.ops.bidirectional_linear_attention``), along raster order and, with
    ``scan_orders='raster+column'``, also column order, so a token weighs another by decay^distance along rows and
    along columns: locality at linear cost, no window.

    decay: 'retnet' (per-head RetNet decays 1 - 2^-5 .. ), None, a float or one per head (fixed, not trained).
    data_gate: add a data-dependent per-token, per-channel gate sigmoid(scan_gate(x)) ** (1 / 16) (GLA); its
        projection starts near a gate of 1. scan_chunk_size: tokens per chunk of the scans (None: 64, 16 with the
        per-channel gate; see ``linvit.ops.causal.chunk.default_chunk_size``).
    Prefix tokens come first in every order (the class token sits next to the first patches).
    """

    family = FamilySpec('bidirectional', feature_map=True, token_grid=True, tensors=('scan_gate',),
                        options={'decay': 'retnet', 'data_gate': False, 'scan_orders': 'raster+column',
                                 'scan_chunk_size': None})

    def __init__(self, dim: int, decay: Any = 'retnet', data_gate: bool = False, scan_orders: str = 'raster+column',
                 scan_chunk_size: Optional[int] = None, **kwargs) -> None:
        super().__init__(dim, **kwargs)
        if scan_orders not in SCAN_ORDERS:
            raise ValueError(f"scan_orders must be one of {list(SCAN_ORDERS)}, got {scan_orders!r}")
        _check_chunk_size(scan_chunk_size)
        decays = resolve_decays(decay, self.num_heads)
        self.decay = decay
        self.data_gate = bool(data_gate)
        self.scan_orders = scan_orders
        self.scan_chunk_size = scan_chunk_size
        device = self.qkv.weight.device
        # python floats, not a buffer: a fixed hyperparameter that model.half() must not round (1 - 2^-12 is 1.0
        # in bfloat16) and that the state_dict need not carry
        self.decays = decays
        self.scan_gate: Optional[nn.Linear] = None
        self.gate_temperature = GATE_TEMPERATURE  # an attribute: TorchScript reads no global floats
        if data_gate:
            self.scan_gate = nn.Linear(dim, self.attn_dim, device=device, dtype=self.qkv.weight.dtype)
            if device.type != 'meta':
                nn.init.zeros_(self.scan_gate.weight)
                nn.init.constant_(self.scan_gate.bias, GATE_INIT_BIAS)

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        check_no_key_mask(key_mask, 'bidirectional', 'scans the patch grid')
        B, N = qkv.shape[0], qkv.shape[1]
        grid = resolve_token_grid(N, self.num_prefix_tokens, self.grid_size, feat_size)
        orders = grid_scan_orders(grid, self.num_prefix_tokens, self.scan_orders, qkv.device)
        q, k, v = split_heads(qkv)
        q, k = self.q_norm(q), self.k_norm(k)
        log_gate = None
        if self.scan_gate is not None:
            log_gate = heads_first(F.logsigmoid(self.scan_gate(x)).reshape(B, N, self.num_heads, self.head_dim))
            log_gate = log_gate / self.gate_temperature
        decays: Optional[List[float]] = None
        if self.decays is not None:
            decays = [float(d) for d in self.decays]  # a list: TorchScript's type for the op's argument
        out = bidirectional_linear_attention_op(q, k, v, self.feature_map_name, decays, log_gate, self.eps,
                                                self.scan_chunk_size, orders)
        return tokens_last(out)
