"""What the registered attention op costs per call beyond its math: the op (``torch.ops.linvit.linear_attention_qkv``
forward and its registered backward) against a plain ``torch.autograd.Function`` that runs the same PyTorch math
(the op's own forward and backward implementations) with none of the dispatch, on tiny tensors where the math is
small and the host work shows. On CUDA the op's Triton kernels run, and the report adds the GPU time of the kernels
per call (torch.profiler) against the wall time: the host overhead the kernels wait behind.

    rows = measure(device='cpu', tokens=(16,), repeats=200)
"""
from typing import Callable, Dict, List, Optional, Sequence

import torch

from linvit.ops import linear_attention_qkv_op
from linvit.ops.linear_attn import op as attention_op
from linvit.timing import time_interleaved

__all__ = ['PlainFunction', 'measure', 'markdown']


class PlainFunction(torch.autograd.Function):
    """apply(qkv [B, N, 3, H, D]) -> [B, N, H, D]: the op's PyTorch forward and backward (elu1, eps 1e-6, no mask)
    in a plain autograd.Function, the reference for the op's per-call overhead."""

    @staticmethod
    def forward(ctx, qkv):
        q, k, v = attention_op._unpack(qkv)
        out, s, den = attention_op._forward_torch(q, k, v, 'elu1', 1e-6, None)
        ctx.save_for_backward(qkv, out, s, den)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        qkv, out, s, den = ctx.saved_tensors
        q, k, v = attention_op._unpack(qkv)
        dq, dk, dv = attention_op._backward_torch(grad.transpose(1, 2), q, k, v, out, s, den, None, 'elu1')
        return torch.stack([dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)], dim=2).to(qkv.dtype)


def _kernel_ms(fn, calls: int = 5) -> float:
    """GPU kernel time per call of fn (torch.profiler, CUDA activity), in ms."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.self_device_time_total for e in events) / calls / 1e3


def _calls(qkv: torch.Tensor, grad: torch.Tensor) -> Dict[str, Callable[[], object]]:
    """Forward+backward of the plain Function, the op and the public entry point on the same inputs."""
    return {'plain': lambda: torch.autograd.grad(PlainFunction.apply(qkv), qkv, grad),
            'op': lambda: torch.autograd.grad(torch.ops.linvit.linear_attention_qkv(qkv, 'elu1', 1e-6, None,
                                                                                     'auto')[0], qkv, grad),
            'entry': lambda: torch.autograd.grad(linear_attention_qkv_op(qkv), qkv, grad)}


def measure(device: str = 'cpu', tokens: Sequence[int] = (16,), batch: int = 1, heads: int = 1, head_dim: int = 16,
            dtype: torch.dtype = torch.float32, repeats: int = 300,
            warmup: int = 50) -> List[Dict[str, Optional[float]]]:
    """One row per token count: median microseconds per forward+backward call of the plain Function, the op and the
    public entry point (which checks its arguments), their ratios to the plain Function, and on CUDA the kernels'
    GPU time per op call."""
    rows = []
    for n in tokens:
        qkv = torch.randn(batch, n, 3, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
        calls = _calls(qkv, torch.randn(batch, n, heads, head_dim, device=device, dtype=dtype))
        ms = time_interleaved(calls, warmup, repeats, device)
        rows.append({'tokens': n, 'plain_us': ms['plain'] * 1e3, 'op_us': ms['op'] * 1e3,
                     'entry_us': ms['entry'] * 1e3, 'op_over_plain': ms['op'] / ms['plain'],
                     'entry_over_plain': ms['entry'] / ms['plain'],
                     'kernel_us': _kernel_ms(calls['op']) * 1e3 if str(device).startswith('cuda') else None})
    return rows


def markdown(rows: Sequence[Dict[str, Optional[float]]]) -> str:
    lines = ['| tokens | plain Function us | op us | op / plain | entry point us | entry / plain | op GPU kernels us |',
             '|---|---|---|---|---|---|---|']
    for r in rows:
        kernel = '-' if r['kernel_us'] is None else f"{r['kernel_us']:.1f}"
        lines.append(f"| {r['tokens']} | {r['plain_us']:.1f} | {r['op_us']:.1f} | {r['op_over_plain']:.2f} | "
                     f"{r['entry_us']:.1f} | {r['entry_over_plain']:.2f} | {kernel} |")
    return '\n'.join(lines)
