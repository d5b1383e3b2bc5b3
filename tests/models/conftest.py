"""Shared references for the model tests: attention written out in float64, independent of linvit's O(N) path."""
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from linvit import LinearAttention
from linvit.ops import quadratic_linear_attention


def reference_linear_attention(attn: LinearAttention, x: torch.Tensor, grid: Tuple[int, int],
                               num_prefix_tokens: int) -> torch.Tensor:
    """LinearAttention's output for tokens x [B, N, C] in float64: the quadratic attention formula, plus (when the
    layer has local mixing) a depthwise conv over V laid out row-major on ``grid`` after the prefix tokens.

    Supports the options the models use (qkv bias, qk_norm=False, no scale_norm / gate); returns [B, N, C_out].
    """
    x = x.double()
    b, n, _ = x.shape
    heads, head_dim = attn.num_heads, attn.head_dim
    qkv = F.linear(x, attn.qkv.weight.double(), attn.qkv.bias.double())
    q, k, v = qkv.reshape(b, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    out = quadratic_linear_attention(q, k, v, feature_map=attn.feature_map_name, eps=attn.eps)
    out = out.transpose(1, 2).reshape(b, n, heads * head_dim)
    if attn.local_mix is not None:
        conv = attn.local_mix.conv
        gh, gw = grid
        patches = v[:, :, num_prefix_tokens:].permute(0, 1, 3, 2).reshape(b, heads * head_dim, gh, gw)
        local = F.conv2d(patches, conv.weight.double(), conv.bias.double(), padding=conv.padding,
                         groups=conv.groups)
        out = out + F.pad(local.flatten(2).transpose(1, 2), (0, 0, num_prefix_tokens, 0))
    return F.linear(out, attn.proj.weight.double(), attn.proj.bias.double())


def capture_attention_io(model: nn.Module, run: Callable[[], object]) -> Dict[str, List[torch.Tensor]]:
    """Run ``run()`` and return {attention module path: [input tokens, output tokens]} of every LinearAttention."""
    captured: Dict[str, List[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, LinearAttention):
            def hook(mod, args, output, name=name):
                captured[name] = [args[0].detach(), output.detach()]
            handles.append(module.register_forward_hook(hook))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return captured


def randomise_local_mix(model: nn.Module, seed: int = 0) -> None:
    """Give the zero-initialised local-mix convolutions random values, so a wrong grid changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if '.local_mix.' in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.fixture
def attention_reference():
    return reference_linear_attention


@pytest.fixture
def attention_io():
    return capture_attention_io


@pytest.fixture
def local_mix_randomiser():
    return randomise_local_mix
