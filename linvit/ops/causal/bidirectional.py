"""Bidirectional scans for images (Vision-RWKV, ViG style): non-causal decayed / gated linear attention as a
forward and a backward chunked causal scan over one or more token orders of the patch grid.
"""
from typing import List, Optional, Tuple, Union

import torch

from ..common import autocast_off, compute_dtype
from ..feature_maps import FeatureMap
from .chunk import chunked_scan
from .common import Decay, _check_form, _check_qkv, _features, _with_ones, log_multipliers

__all__ = ['bidirectional_linear_attention', 'bidirectional_linear_attention_op', 'grid_scan_orders', 'SCAN_ORDERS']


SCAN_ORDERS = ('raster', 'raster+column')


def _bidirectional_scan(phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor, a: Optional[torch.Tensor],
                        chunk_size: Optional[int]) -> torch.Tensor:
    """[num | den] of a forward and a backward causal scan over one token order, the diagonal counted once.

    The backward scan runs the causal scan on the reversed sequence (its multipliers reversed too), so the weight
    between tokens i and j is the product of the multipliers of the tokens passed going from j to i, i included
    and j not, in either direction."""
    forward = chunked_scan(phi_q, phi_k, va, a, chunk_size)
    a_rev = a if a is None or a.shape[2] == 1 else a.flip(2)
    backward = chunked_scan(phi_q.flip(2), phi_k.flip(2), va.flip(2), a_rev, chunk_size).flip(2)
    diagonal = (phi_q * phi_k).sum(dim=-1, keepdim=True) * va
    return forward + backward - diagonal


def _check_scan_orders(orders: str) -> None:
    if orders not in SCAN_ORDERS:
        raise ValueError(f"scan orders must be one of {list(SCAN_ORDERS)}, got {orders!r}")


def grid_scan_orders(grid: Tuple[int, int], num_prefix_tokens: int, orders: str = 'raster+column',
                     device: Optional[torch.device] = None) -> List[torch.Tensor]:
    """Token orders over prefix tokens + an H x W patch grid: 'raster' (row by row, the sequence order) and, with
    'raster+column', also column by column; prefix tokens come first in both. Each a LongTensor [prefix + H * W]."""
    # an fx leaf of the bidirectional layers that TorchScript compiles: it cannot read the global SCAN_ORDERS (the
    # layers check their scan orders when they are built)
    if not torch.jit.is_scripting():
        _check_scan_orders(orders)
    h, w = grid[0], grid[1]
    raster = torch.arange(num_prefix_tokens + h * w, device=device)
    if orders == 'raster':
        return [raster]
    column = torch.arange(h * w, device=device).reshape(h, w).transpose(0, 1).reshape(-1) + num_prefix_tokens
    return [raster, torch.cat([raster[:num_prefix_tokens], column])]


def _take_tokens(t: Optional[torch.Tensor], order: torch.Tensor) -> Optional[torch.Tensor]:
    if t is None or t.shape[2] == 1:
        return t
    return t.index_select(2, order)


def bidirectional_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   feature_map: Union[str, FeatureMap] = 'elu1', decay: Decay = None,
                                   gate: Optional[torch.Tensor] = None, eps: float = 1e-6,
                                   chunk_size: Optional[int] = None,
                                   orders: Optional[List[torch.Tensor]] = None,
                                   log_gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Non-causal decayed / gated linear attention as forward + backward scans (Vision-RWKV, ViG style):

        out_i = sum_j w_ij phi(q_i)^T phi(k_j) v_j / (sum_j w_ij phi(q_i)^T phi(k_j) + eps N |orders|)

    with w_ij (per channel for per-channel gates) summed over the token orders: in one order, the product of the
    multipliers (decay times gate) of the tokens passed going from j to i, i included and j not (decay only:
    gamma^|i - j|); the diagonal counts once per order. Every token sees every other at linear cost, with more
    weight nearby: locality without a window.

    Args:
        q, k: [B, H, N, D]; v: [B, H, N, Dv]; feature_map, decay, gate / log_gate, eps: as causal_linear_attention.
        orders: token orders to scan, each a permutation LongTensor [N] (e.g. raster and column order of a patch
            grid); None: the given order only.

    Returns:
        [B, H, N, Dv] in the dtype of ``v``.
    """
    _check_qkv(q, k, v)
    _check_form('chunked', chunk_size)
    n = q.shape[2]
    orders = orders if orders is not None else [torch.arange(n, device=q.device)]
    for order in orders:
        if order.shape != (n,):
            raise ValueError(f"each order must be a permutation of the N = {n} tokens, got shape {list(order.shape)}")
    dtype = compute_dtype(v.dtype)
    with autocast_off(v.device.type):
        a = log_multipliers(q, decay, gate, log_gate)
        phi_q, phi_k = _features(q, k, feature_map)
        va = _with_ones(v.to(dtype))
        total = None
        for order in orders:
            scanned = _bidirectional_scan(_take_tokens(phi_q, order), _take_tokens(phi_k, order),
                                          _take_tokens(va, order), _take_tokens(a, order), chunk_size)
            back = scanned.index_select(2, torch.argsort(order))
            total = back if total is None else total + back
        out = total[..., :-1] / (total[..., -1:] + eps * n * len(orders))
    return out.to(v.dtype)


# ---------------------------------------------------------------------------------------------- TorchScript


@torch.library.custom_op('linvit::bidirectional_linear_attention', mutates_args=())
def _bidirectional_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str,
                      decay: Optional[List[float]], log_gate: Optional[torch.Tensor], eps: float,
                      chunk_size: Optional[int], orders: List[torch.Tensor]) -> torch.Tensor:
    return bidirectional_linear_attention(q, k, v, feature_map, decay=decay, eps=eps, chunk_size=chunk_size,
                                          orders=orders, log_gate=log_gate)


@_bidirectional_op.register_fake
def _(q, k, v, feature_map, decay, log_gate, eps, chunk_size, orders):
    return v.new_empty(v.shape)


def _bidirectional_op_setup(ctx, inputs, output):
    q, k, v, feature_map, decay, log_gate, eps, chunk_size, orders = inputs
    ctx.save_for_backward(q, k, v, log_gate, *orders)
    ctx.options = (feature_map, decay, eps, chunk_size)


def _bidirectional_op_backward(ctx, grad):
    """Recomputes the forward with autograd on (its chunked scans keep only their inputs anyway) and differentiates
    it: the op serves TorchScript, where it is one node; eager and fx code call the Python function directly."""
    q, k, v, log_gate, *orders = ctx.saved_tensors
    feature_map, decay, eps, chunk_size = ctx.options
    needs = ctx.needs_input_grad
    tensors = [q, k, v, log_gate]
    wanted = [i for i, t in enumerate(tensors) if t is not None and needs[(0, 1, 2, 5)[i]]]
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(i in wanted) if t is not None else None for i, t in enumerate(tensors)]
        out = bidirectional_linear_attention(leaves[0], leaves[1], leaves[2], feature_map, decay=decay, eps=eps,
                                             chunk_size=chunk_size, orders=orders, log_gate=leaves[3])
        grads = torch.autograd.grad(out, [leaves[i] for i in wanted], grad) if wanted else ()
    result: List[Optional[torch.Tensor]] = [None] * 4
    for i, g in zip(wanted, grads):
        result[i] = g
    # one entry per input, a list for the list of orders (they get no gradient)
    return result[0], result[1], result[2], None, None, result[3], None, None, [None] * len(orders)


_bidirectional_op.register_autograd(_bidirectional_op_backward, setup_context=_bidirectional_op_setup)


def bidirectional_linear_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str,
                                      decay: Optional[List[float]], log_gate: Optional[torch.Tensor], eps: float,
                                      chunk_size: Optional[int], orders: List[torch.Tensor]) -> torch.Tensor:
    """``bidirectional_linear_attention`` with arguments TorchScript takes (a feature-map name, decays as a list of
    floats or None, the token orders): the layers' call, an fx leaf. Eager and fx-traced code run the Python
    function (its chunked scans train with the memory-efficient backward); TorchScript, which compiles neither an
    autograd Function nor the Python function's argument unions, calls the registered op
    ``torch.ops.linvit.bidirectional_linear_attention`` (the same function; its backward recomputes the forward)."""
    if torch.jit.is_scripting():
        return torch.ops.linvit.bidirectional_linear_attention(q, k, v, feature_map, decay, log_gate, eps, chunk_size,
                                                               orders)
    return bidirectional_linear_attention(q, k, v, feature_map, decay=decay, eps=eps, chunk_size=chunk_size,
                                          orders=orders, log_gate=log_gate)
