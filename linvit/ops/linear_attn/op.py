"""Non-causal linear attention as ``torch.library`` custom ops: the Triton kernels on GPU, the PyTorch path elsewhere.

Eight ops in the ``linvit`` namespace, each with a fake (meta) implementation so ``torch.compile``, ``torch.export``
and CUDA graphs see one opaque node per call, and the four forward ops with a registered autograd formula:

    linvit::linear_attention(q, k, v, feature_map, eps, key_mask, backend) -> (out, S, den)
    linvit::linear_attention_backward(grad, q, k, v, out, S, den, key_mask, feature_map, backend) -> (dq, dk, dv)
    linvit::linear_attention_qkv(qkv, feature_map, eps, key_mask, backend) -> (out, S, den)
    linvit::linear_attention_qkv_backward(grad, qkv, out, S, den, key_mask, feature_map, backend) -> grad_qkv

and the two halves of the first (``linear_attention_state`` / ``linear_attention_apply``):

    linvit::linear_attention_state(k, v, feature_map, key_mask, backend) -> (sums, count)
    linvit::linear_attention_state_backward(grad_sums, k, v, key_mask, feature_map, backend) -> (dk, dv)
    linvit::linear_attention_apply(q, sums, count, feature_map, eps, out_dtype, backend) -> (out, den)
    linvit::linear_attention_apply_backward(grad, q, sums, count, out, den, feature_map, eps, count_grad, backend)
        -> (dq, grad_sums, grad_count)

with q [B, H, Nq, D], k [B, H, N, D], v [B, H, N, Dv] (any strides), qkv timm's packed projection [B, N, 3, H, D],
key_mask None, [B, N] or [B, H, N] (bool keeps a key, float weighs it; a constant), out [B, H, Nq, Dv] (token-major
memory) or [B, N, H, D] for the packed op, and for the backward the state S^T = [V | 1]^T phi(K) [B, H, Dv + 1, D]
(rows of D floats: aligned loads in the kernels) and the normaliser den [B, H, Nq, 1], both float32 sums (float64
for float64 inputs). The Triton backward reads neither ``out`` nor a feature map's output: the op keeps ``out``
only because the PyTorch path's backward reads it (the projection after attention keeps it alive anyway). The
function is ``linvit.ops.linear_attention``'s; the backward is the closed form of
``linvit.ops.linear_attn.function``. The state is ``AttentionState``'s: sums = S^T, count [B, H] the kept keys'
weight; the apply op's den is what its backward reads (the kernels keep it divided by max(count, 1), the scale
their half-precision dots take the state in); the gradient at count is returned only when asked (count_grad).

``backend`` (the layers' and models' ``attn_backend``; one of ``ATTN_BACKENDS``) is decided inside each op, at run
time, from the tensors it gets (``linvit.ops.linear_attn.backend``). The public entry points are
``linear_attention_op``, ``linear_attention_qkv_op`` and, for maps given by name, ``linear_attention_state`` and
``linear_attention_apply``.

Because the op is registered, TorchScript can call it too: an fx-traced linvit model (timm's model tests trace with
fx, then script the graph) keeps one scriptable node per attention.
"""
from typing import Callable, Optional, Tuple, Union

import torch

from ..common import autocast_off, compute_dtype
from ..feature_maps import feature_map_spec
from .backend import _kernel_weights, _uses_kernel, _uses_kernel_for_state, check_attn_backend, kernel_feature_map
from .function import _attend, _backward, _grad_keys, _grad_queries, _key_weight_column, _map
from .pytorch import (
    AttentionState,
    check_apply_inputs,
    check_attention_inputs,
    check_state_features,
    check_state_inputs,
    pytorch_apply,
    pytorch_state,
    state_from_features,
)

__all__ = ['linear_attention_op', 'linear_attention_qkv_op', 'linear_attention_state', 'linear_attention_apply']

# ---------------------------------------------------------------- registration

_LIBRARY = torch.library.Library('linvit', 'FRAGMENT')


def _op(schema: str) -> Callable:
    """Decorator: define ``linvit::<schema>`` with the function as its implementation on every device, registered
    straight with the dispatcher. ``torch.library.custom_op`` wraps every call in Python that checks the outputs for
    aliasing: 0.47 ms a call on the GPU machine's torch 2.11 (a cProfile there), four times the kernels' own time
    at 1k tokens. These implementations return fresh tensors (the tests compare them with the fake ones)."""
    def register(fn: Callable) -> Callable:
        _LIBRARY.define(schema)
        _LIBRARY.impl(schema.split('(')[0], fn, 'CompositeExplicitAutograd')
        return fn
    return register


def _fake(name: str) -> Callable:
    """Decorator: the op's fake (meta) implementation, which torch.compile and torch.export trace with."""
    return torch.library.register_fake(f'linvit::{name}', lib=_LIBRARY)


def _kernel_map(feature_map: str) -> int:
    """The kernels' branch of map ``feature_map`` (ValueError when they have none)."""
    return kernel_feature_map(feature_map_spec(feature_map).kernel_id)


# ---------------------------------------------------------------- the forward ops

def _forward_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str, eps: float,
                   key_mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PyTorch path: (out [B, H, Nq, Dv] token-major in v's dtype, S^T [B, H, Dv + 1, D], den) in the
    compute dtype."""
    dtype = compute_dtype(v.dtype)
    with autocast_off(v.device.type):
        w = _key_weight_column(key_mask, dtype)
        out, s, den = _attend(_map(feature_map, q.to(dtype)), _map(feature_map, k.to(dtype)), v.to(dtype), eps, w,
                              v.dtype)
    return out, s.transpose(-2, -1), den  # S is a transposed view of contiguous S^T: no copy


def _forward_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, feature_map: str,
                    eps: float, key_mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels: write out (shape of the result, any strides); return (S^T, den)."""
    from . import kernels
    return kernels.forward(q, k, v, out, _kernel_map(feature_map), eps, _kernel_weights(key_mask))


@_op('linear_attention(Tensor q, Tensor k, Tensor v, str feature_map, float eps, Tensor? key_mask, str backend) '
     '-> (Tensor, Tensor, Tensor)')
def _linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str, eps: float,
                      key_mask: Optional[torch.Tensor], backend: str) -> Tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    if not _uses_kernel(backend, q, k, v, feature_map, key_mask):
        return _forward_torch(q, k, v, feature_map, eps, key_mask)
    out = _token_major(q.shape[0], q.shape[1], q.shape[2], v.shape[3], q)
    s, den = _forward_kernel(q, k, v, out, feature_map, eps, key_mask)
    return out, s, den


def _token_major(b: int, h: int, n: int, dv: int, like: torch.Tensor) -> torch.Tensor:
    """An empty [B, H, N, Dv] tensor as a view of [B, N, H, Dv] memory (what the projection after attention reads)."""
    return torch.empty(b, n, h, dv, dtype=like.dtype, device=like.device).transpose(1, 2)


def _state_like(q: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Empty (S^T [B, H, Dv + 1, D], den [B, H, Nq, 1]) in the compute dtype of v."""
    dtype = compute_dtype(v.dtype)
    b, h, nq, d = q.shape
    s = torch.empty(b, h, v.shape[3] + 1, d, dtype=dtype, device=q.device)
    return s, torch.empty(b, h, nq, 1, dtype=dtype, device=q.device)


@_fake('linear_attention')
def _(q, k, v, feature_map, eps, key_mask, backend):
    return (_token_major(q.shape[0], q.shape[1], q.shape[2], v.shape[3], v), *_state_like(q, v))


def _unpack(qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, N, 3, H, D] -> q, k, v as [B, H, N, D] views."""
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


@_op('linear_attention_qkv(Tensor qkv, str feature_map, float eps, Tensor? key_mask, str backend) '
     '-> (Tensor, Tensor, Tensor)')
def _linear_attention_qkv(qkv: torch.Tensor, feature_map: str, eps: float, key_mask: Optional[torch.Tensor],
                          backend: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _unpack(qkv)
    if not _uses_kernel(backend, q, k, v, feature_map, key_mask):
        out, s, den = _forward_torch(q, k, v, feature_map, eps, key_mask)
        return out.transpose(1, 2), s, den
    b, n, _, h, d = qkv.shape
    out = torch.empty(b, n, h, d, dtype=qkv.dtype, device=qkv.device)
    s, den = _forward_kernel(q, k, v, out.transpose(1, 2), feature_map, eps, key_mask)
    return out, s, den


@_fake('linear_attention_qkv')
def _(qkv, feature_map, eps, key_mask, backend):
    b, n, _, h, d = qkv.shape
    q, _k, v = _unpack(qkv)
    return (qkv.new_empty(b, n, h, d), *_state_like(q, v))


# ---------------------------------------------------------------- the backward ops

def _backward_torch(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    s: torch.Tensor, den: torch.Tensor, key_mask: Optional[torch.Tensor],
                    feature_map: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PyTorch path's closed-form backward: (dq, dk, dv) in the compute dtype (s's)."""
    dtype = s.dtype
    with autocast_off(v.device.type):
        w = _key_weight_column(key_mask, dtype)
        return _backward(grad.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), feature_map, w,
                         s.transpose(-2, -1), den, out.to(dtype))


def _backward_kernel(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
                     den: torch.Tensor, key_mask: Optional[torch.Tensor], feature_map: str, dq: torch.Tensor,
                     dk: torch.Tensor, dv: torch.Tensor) -> None:
    """The Triton kernels: write dq, dk, dv (shapes of q, k, v, any strides); they read neither out nor phi."""
    from . import kernels
    kernels.backward(grad, q, k, v, s.contiguous(), den.contiguous(), dq, dk, dv,
                            _kernel_map(feature_map), _kernel_weights(key_mask))


@_op('linear_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor s, Tensor den, '
     'Tensor? key_mask, str feature_map, str backend) -> (Tensor, Tensor, Tensor)')
def _linear_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, s: torch.Tensor, den: torch.Tensor,
                               key_mask: Optional[torch.Tensor], feature_map: str,
                               backend: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # the strides the fake promises
    if not _uses_kernel(backend, q, k, v, feature_map, key_mask):
        grads = _backward_torch(grad, q, k, v, out, s, den, key_mask, feature_map)
        return dq.copy_(grads[0]), dk.copy_(grads[1]), dv.copy_(grads[2])
    _backward_kernel(grad, q, k, v, s, den, key_mask, feature_map, dq, dk, dv)
    return dq, dk, dv


@_fake('linear_attention_backward')
def _(grad, q, k, v, out, s, den, key_mask, feature_map, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@_op('linear_attention_qkv_backward(Tensor grad, Tensor qkv, Tensor out, Tensor s, Tensor den, Tensor? key_mask, '
     'str feature_map, str backend) -> Tensor')
def _linear_attention_qkv_backward(grad: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, s: torch.Tensor,
                                   den: torch.Tensor, key_mask: Optional[torch.Tensor], feature_map: str,
                                   backend: str) -> torch.Tensor:
    # one [B, N, 3, H, D] gradient: the layout of the projection's output, which its backward reads
    q, k, v = _unpack(qkv)
    grad, out = grad.transpose(1, 2), out.transpose(1, 2)  # [B, H, N, D] views
    if not _uses_kernel(backend, q, k, v, feature_map, key_mask):
        dq, dk, dv = _backward_torch(grad, q, k, v, out, s, den, key_mask, feature_map)
        return torch.stack([dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)], dim=2).to(qkv.dtype)
    grad_qkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    dq, dk, dv = _unpack(grad_qkv)
    _backward_kernel(grad, q, k, v, s, den, key_mask, feature_map, dq, dk, dv)
    return grad_qkv


@_fake('linear_attention_qkv_backward')
def _(grad, qkv, out, s, den, key_mask, feature_map, backend):
    return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)


# ---------------------------------------------------------------- autograd

def _setup_context(ctx, inputs, output) -> None:
    *tensors, feature_map, eps, key_mask, backend = inputs
    out, s, den = output
    ctx.save_for_backward(*tensors, out, s, den, key_mask)
    ctx.feature_map, ctx.backend = feature_map, backend
    ctx.mark_non_differentiable(s, den)
    # S and den are never differentiated: no zero-filled gradients for them (two fill kernels per call)
    ctx.set_materialize_grads(False)


def _forward_below_autograd(ctx, op, inputs: tuple) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward op's (out, S, den) computed below autograd, with what its backward needs kept on ctx."""
    with torch._C._AutoDispatchBelowAutograd():
        output = op(*inputs)
    _setup_context(ctx, inputs, output)
    return output


class _AttentionGrad(torch.autograd.Function):
    """The autograd formula of linvit::linear_attention: the forward op below autograd, the backward op."""

    @staticmethod
    def forward(ctx, *inputs):
        return _forward_below_autograd(ctx, torch.ops.linvit.linear_attention, inputs)

    @staticmethod
    def backward(ctx, grad, _grad_s, _grad_den):
        if grad is None:  # the output took no part in the loss
            return None, None, None, None, None, None, None
        q, k, v, out, s, den, key_mask = ctx.saved_tensors
        dq, dk, dv = torch.ops.linvit.linear_attention_backward(grad, q, k, v, out, s, den, key_mask,
                                                                ctx.feature_map, ctx.backend)
        return dq, dk, dv, None, None, None, None


class _PackedAttentionGrad(torch.autograd.Function):
    """The autograd formula of linvit::linear_attention_qkv: one [B, N, 3, H, D] gradient."""

    @staticmethod
    def forward(ctx, *inputs):
        return _forward_below_autograd(ctx, torch.ops.linvit.linear_attention_qkv, inputs)

    @staticmethod
    def backward(ctx, grad, _grad_s, _grad_den):
        if grad is None:
            return None, None, None, None, None
        qkv, out, s, den, key_mask = ctx.saved_tensors
        grad_qkv = torch.ops.linvit.linear_attention_qkv_backward(grad, qkv, out, s, den, key_mask, ctx.feature_map,
                                                                  ctx.backend)
        return grad_qkv, None, None, None, None


def _autograd_kernel(function: type, op_name: str) -> Callable:
    """The op's Autograd-key kernel: ``function`` when a gradient is wanted, else the op below autograd. Registered
    straight (not through torch.library.register_autograd, whose generated wrapper re-reads the schema's defaults and
    checks its results on every call: on CPU it took the op from 1.35x to 1.23x of a plain Function doing the same
    math, tools/bench_op_overhead.py at 16 tokens)."""
    op = getattr(torch.ops.linvit, op_name)

    def kernel(*inputs):
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs[:3]):
            return function.apply(*inputs)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*inputs)
    return kernel


_LIBRARY.impl('linear_attention', _autograd_kernel(_AttentionGrad, 'linear_attention'), 'Autograd')
_LIBRARY.impl('linear_attention_qkv', _autograd_kernel(_PackedAttentionGrad, 'linear_attention_qkv'), 'Autograd')


# ---------------------------------------------------------------- the two halves: state and apply
#
# linvit::linear_attention is their composition (state, then apply) fused into one op: its Triton forward is the
# state op's key pass followed by the apply op's query pass without the state leaving the kernels' buffers, and its
# backward the apply op's query gradient pass followed by the state op's key gradient pass.

def _state_torch(k: torch.Tensor, v: torch.Tensor, feature_map: str,
                 key_mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path: (sums [B, H, Dv + 1, F], count [B, H]) in the compute dtype, fresh tensors."""
    dtype = compute_dtype(v.dtype)
    with autocast_off(v.device.type):
        sums, count = state_from_features(_map(feature_map, k.to(dtype)), v.to(dtype), key_mask)
    return sums, count.contiguous()  # a [B, 1] mask's count is expanded over the heads


@_op('linear_attention_state(Tensor k, Tensor v, str feature_map, Tensor? key_mask, str backend) -> (Tensor, Tensor)')
def _linear_attention_state(k: torch.Tensor, v: torch.Tensor, feature_map: str, key_mask: Optional[torch.Tensor],
                            backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    if not _uses_kernel(backend, k, k, v, feature_map, key_mask):
        return _state_torch(k, v, feature_map, key_mask)
    from . import kernels
    sums = kernels.state(k, v, _kernel_map(feature_map), _kernel_weights(key_mask))
    b, h, n = k.shape[0], k.shape[1], k.shape[2]
    if key_mask is None:
        return sums, torch.full((b, h), float(n), dtype=torch.float32, device=k.device)
    return sums, _kernel_weights(key_mask).sum(dim=-1).expand(b, h).contiguous()


@_fake('linear_attention_state')
def _(k, v, feature_map, key_mask, backend):
    dtype = compute_dtype(v.dtype)  # a fixed map keeps the width: F = D
    b, h, _, d = k.shape
    return k.new_empty(b, h, v.shape[3] + 1, d, dtype=dtype), k.new_empty(b, h, dtype=dtype)


@_op('linear_attention_state_backward(Tensor grad_sums, Tensor k, Tensor v, Tensor? key_mask, str feature_map, '
     'str backend) -> (Tensor, Tensor)')
def _linear_attention_state_backward(grad_sums: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     key_mask: Optional[torch.Tensor], feature_map: str,
                                     backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    dk, dv = torch.empty_like(k), torch.empty_like(v)  # the strides the fake promises
    if not _uses_kernel(backend, k, k, v, feature_map, key_mask):
        dtype = compute_dtype(v.dtype)
        with autocast_off(v.device.type):
            grads = _grad_keys(grad_sums.to(dtype), k.to(dtype), v.to(dtype), feature_map,
                               _key_weight_column(key_mask, dtype))
        return dk.copy_(grads[0]), dv.copy_(grads[1])
    from . import kernels
    kernels.state_backward(grad_sums.float(), k, v, dk, dv, _kernel_map(feature_map), _kernel_weights(key_mask))
    return dk, dv


@_fake('linear_attention_state_backward')
def _(grad_sums, k, v, key_mask, feature_map, backend):
    return torch.empty_like(k), torch.empty_like(v)


@_op('linear_attention_apply(Tensor q, Tensor sums, Tensor count, str feature_map, float eps, ScalarType? out_dtype, '
     'str backend) -> (Tensor, Tensor)')
def _linear_attention_apply(q: torch.Tensor, sums: torch.Tensor, count: torch.Tensor, feature_map: str, eps: float,
                            out_dtype: Optional[torch.dtype], backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    dtype = q.dtype if out_dtype is None else out_dtype
    b, h, nq = q.shape[0], q.shape[1], q.shape[2]
    dv = sums.shape[2] - 1
    if not _uses_kernel_for_state(backend, q, sums, count, feature_map):
        with autocast_off(q.device.type):
            num_den = _map(feature_map, q.to(sums.dtype)) @ sums.transpose(-2, -1)
            den = num_den[..., dv:] + eps * count.clamp_min(1e-30)[..., None, None]
            return (num_den[..., :dv] / den).to(dtype), den
    from . import kernels
    out = torch.empty(b, h, nq, dv, dtype=dtype, device=q.device)
    return out, kernels.apply(q, sums, count, out, _kernel_map(feature_map), eps)


@_fake('linear_attention_apply')
def _(q, sums, count, feature_map, eps, out_dtype, backend):
    b, h, nq = q.shape[0], q.shape[1], q.shape[2]
    dtype = q.dtype if out_dtype is None else out_dtype
    return q.new_empty(b, h, nq, sums.shape[2] - 1, dtype=dtype), q.new_empty(b, h, nq, 1, dtype=sums.dtype)


@_op('linear_attention_apply_backward(Tensor grad, Tensor q, Tensor sums, Tensor count, Tensor out, Tensor den, '
     'str feature_map, float eps, bool count_grad, str backend) -> (Tensor, Tensor, Tensor)')
def _linear_attention_apply_backward(grad: torch.Tensor, q: torch.Tensor, sums: torch.Tensor, count: torch.Tensor,
                                     out: torch.Tensor, den: torch.Tensor, feature_map: str, eps: float,
                                     count_grad: bool, backend: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, the gradient at sums, the gradient at count: empty unless count_grad). den is the forward's, as its
    implementation keeps it (the kernels: divided by max(count, 1))."""
    dq = torch.empty_like(q)  # the strides the fake promises
    dtype = sums.dtype
    dv = sums.shape[2] - 1
    if not _uses_kernel_for_state(backend, q, sums, count, feature_map):
        with autocast_off(q.device.type):
            grads = _grad_queries(grad.to(dtype), q.to(dtype), feature_map, sums.transpose(-2, -1), den,
                                  out.to(dtype))
        # den = den0 + eps * count: the gradient at count is eps times the column of the gradient at den
        grad_count = eps * grads[2][..., dv].sum(dim=-1) if count_grad else count.new_empty(0)
        return dq.copy_(grads[0]), grads[1], grad_count
    from . import kernels
    grad_sums = kernels.apply_backward(grad, q, sums, count, den, dq, _kernel_map(feature_map))
    grad_count = count.new_empty(0)
    if count_grad:  # den here is den / max(count, 1)
        true_den = den * count.clamp_min(1.0)[..., None, None]
        grad_count = -eps * ((grad.to(dtype) * out.to(dtype)).sum(dim=-1, keepdim=True) / true_den).sum(dim=(-2, -1))
    return dq, grad_sums, grad_count


@_fake('linear_attention_apply_backward')
def _(grad, q, sums, count, out, den, feature_map, eps, count_grad, backend):
    return torch.empty_like(q), torch.empty_like(sums), count.new_empty(count.shape if count_grad else (0,))


class _StateGrad(torch.autograd.Function):
    """The autograd formula of linvit::linear_attention_state: dk, dv from the gradient at the sums (the count, a
    sum of constant key weights, has none)."""

    @staticmethod
    def forward(ctx, k, v, feature_map, key_mask, backend):
        with torch._C._AutoDispatchBelowAutograd():
            sums, count = torch.ops.linvit.linear_attention_state(k, v, feature_map, key_mask, backend)
        ctx.save_for_backward(k, v, key_mask)
        ctx.feature_map, ctx.backend = feature_map, backend
        ctx.mark_non_differentiable(count)
        ctx.set_materialize_grads(False)
        return sums, count

    @staticmethod
    def backward(ctx, grad_sums, _grad_count):
        if grad_sums is None:
            return None, None, None, None, None
        k, v, key_mask = ctx.saved_tensors
        dk, dv = torch.ops.linvit.linear_attention_state_backward(grad_sums, k, v, key_mask, ctx.feature_map,
                                                                  ctx.backend)
        return dk, dv, None, None, None


class _ApplyGrad(torch.autograd.Function):
    """The autograd formula of linvit::linear_attention_apply: dq and the gradients at the state's sums and count."""

    @staticmethod
    def forward(ctx, q, sums, count, feature_map, eps, out_dtype, backend):
        with torch._C._AutoDispatchBelowAutograd():
            out, den = torch.ops.linvit.linear_attention_apply(q, sums, count, feature_map, eps, out_dtype, backend)
        ctx.save_for_backward(q, sums, count, out, den)
        ctx.feature_map, ctx.eps, ctx.backend = feature_map, eps, backend
        ctx.mark_non_differentiable(den)
        ctx.set_materialize_grads(False)
        return out, den

    @staticmethod
    def backward(ctx, grad, _grad_den):
        if grad is None:
            return None, None, None, None, None, None, None
        q, sums, count, out, den = ctx.saved_tensors
        count_grad = ctx.needs_input_grad[2]
        dq, grad_sums, grad_count = torch.ops.linvit.linear_attention_apply_backward(
            grad, q, sums, count, out, den, ctx.feature_map, ctx.eps, count_grad, ctx.backend)
        return dq, grad_sums, grad_count if count_grad else None, None, None, None, None


_LIBRARY.impl('linear_attention_state', _autograd_kernel(_StateGrad, 'linear_attention_state'), 'Autograd')
_LIBRARY.impl('linear_attention_apply', _autograd_kernel(_ApplyGrad, 'linear_attention_apply'), 'Autograd')


# ---------------------------------------------------------------- entry points

def _check_op_arguments(feature_map: str, key_mask: Optional[torch.Tensor], backend: str) -> None:
    check_attn_backend(backend)
    if feature_map_spec(feature_map).with_vjp is None:  # unknown names raise here, listing the known maps
        raise ValueError(f"feature map {feature_map!r} declares no vector-Jacobian product, which the "
                         f"attention op's backward needs: use linvit.ops.linear_attention")
    if key_mask is not None and key_mask.requires_grad:
        raise ValueError("the attention op takes key_mask as a constant; a key_mask that requires grad needs "
                         "linvit.ops.linear_attention (plain autograd)")


def linear_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str = 'elu1',
                        eps: float = 1e-6, key_mask: Optional[torch.Tensor] = None,
                        backend: str = 'auto') -> torch.Tensor:
    """``linvit.ops.linear_attention`` as the registered op (Triton kernels on GPU, see the module docstring).

    q [B, H, Nq, D], k [B, H, N, D], v [B, H, N, Dv] (any strides), key_mask None, [B, N] or [B, H, N] (a constant)
    -> [B, H, Nq, Dv] in v's dtype (token-major memory). Differentiable in q, k and v."""
    check_attention_inputs(q, k, v, key_mask)
    _check_op_arguments(feature_map, key_mask, backend)
    return torch.ops.linvit.linear_attention(q, k, v, feature_map, eps, key_mask, backend)[0]


def linear_attention_qkv_op(qkv: torch.Tensor, feature_map: str = 'elu1', eps: float = 1e-6,
                            key_mask: Optional[torch.Tensor] = None, backend: str = 'auto') -> torch.Tensor:
    """Self-attention on timm's packed projection as the registered op: qkv [B, N, 3, H, D] -> [B, N, H, D] in
    qkv's dtype; its gradient is one [B, N, 3, H, D] tensor. key_mask None, [B, N] or [B, H, N] (a constant)."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"linear_attention_qkv_op expects qkv of shape [B, N, 3, H, D], got {list(qkv.shape)}")
    check_attention_inputs(*_unpack(qkv), key_mask)
    _check_op_arguments(feature_map, key_mask, backend)
    return torch.ops.linvit.linear_attention_qkv(qkv, feature_map, eps, key_mask, backend)[0]


def _op_serves(feature_map, key_mask: Optional[torch.Tensor]) -> bool:
    """Whether a state or apply call goes through the registered ops: a map given by name that declares its
    vector-Jacobian product, and a constant key mask; else the PyTorch path with plain autograd."""
    return isinstance(feature_map, str) and feature_map_spec(feature_map).with_vjp is not None \
        and not (key_mask is not None and key_mask.requires_grad)


def linear_attention_state(k: torch.Tensor, v: torch.Tensor,
                           feature_map: Union[str, Callable[[torch.Tensor], torch.Tensor], None] = 'elu1',
                           key_mask: Optional[torch.Tensor] = None) -> AttentionState:
    """The state of the keys k [B, H, N, D] and values v [B, H, N, Dv] (``AttentionState``: float32 sums
    [B, H, Dv + 1, F] and count [B, H]; float64 for float64 inputs).

    feature_map: a name from ``FEATURE_MAPS``, a function, or None when k already holds mapped features.
    key_mask: optional [B, N] or [B, H, N], as ``linear_attention`` takes it.
    ``linear_attention(q, k, v) == linear_attention_apply(q, linear_attention_state(k, v))``, and states of
    chunks of the keys add up (``add_states``) to the state of all of them.

    A map named in ``FEATURE_MAPS`` with a vector-Jacobian product and a constant key mask run the registered op
    ``linvit::linear_attention_state`` (the Triton key pass on CUDA, the PyTorch path elsewhere; one node under
    torch.compile); other maps and masks that require grad run the PyTorch path with plain autograd.
    """
    check_state_inputs(k, v, key_mask)
    if not _op_serves(feature_map, key_mask):
        return pytorch_state(k, v, feature_map, key_mask)
    return AttentionState(*torch.ops.linvit.linear_attention_state(k, v, feature_map, key_mask, 'auto'))


def linear_attention_apply(q: torch.Tensor, state: AttentionState,
                           feature_map: Union[str, Callable[[torch.Tensor], torch.Tensor], None] = 'elu1',
                           eps: float = 1e-6, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Queries q [B, H, Nq, D] attending to the keys summarised by ``state`` -> [B, H, Nq, Dv] in ``out_dtype``
    (default: q's dtype). feature_map as for ``linear_attention_state`` (the same map on both sides); a named map
    with a vector-Jacobian product runs the registered op ``linvit::linear_attention_apply`` (the Triton query pass
    on CUDA for float32 states), differentiable in q and in the state."""
    check_apply_inputs(q, state)
    if not _op_serves(feature_map, None):
        return pytorch_apply(q, state, feature_map, eps, out_dtype)
    if q.shape[-1] != state.sums.shape[-1]:  # the named maps keep the width: phi(q) has D features
        check_state_features(q, state.sums)
    return torch.ops.linvit.linear_attention_apply(q, state.sums, state.count, feature_map, eps, out_dtype, 'auto')[0]
