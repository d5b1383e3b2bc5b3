"""Causal linear attention and its bidirectional scans, laid out by form (as fla's ops are):

    common.py         the recurrence, its multipliers (decay, gates) and normaliser, shared by every form
    naive.py          the parallel form: the masked quadratic [N, N] form, exact, O(N^2)
    chunk.py          the chunked form and its memory-efficient autograd Function (``ChunkedCausalScan``)
    recurrent.py      the recurrent form, one token at a time (``causal_linear_attention_step``)
    attention.py      ``causal_linear_attention(form=...)``: the one function in any of the three forms
    bidirectional.py  forward + backward chunked scans over token orders of the patch grid, and their registered op
"""
from .attention import causal_linear_attention
from .bidirectional import (
    SCAN_ORDERS,
    bidirectional_linear_attention,
    bidirectional_linear_attention_op,
    grid_scan_orders,
)
from .chunk import ChunkedCausalScan
from .common import CAUSAL_FORMS, retention_decays
from .recurrent import CausalState, causal_linear_attention_step

__all__ = ['causal_linear_attention', 'causal_linear_attention_step', 'CausalState', 'ChunkedCausalScan',
           'bidirectional_linear_attention', 'bidirectional_linear_attention_op', 'grid_scan_orders', 'SCAN_ORDERS',
           'retention_decays', 'CAUSAL_FORMS']
