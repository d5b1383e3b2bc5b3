"""Local mixing on the 2D token grid: a depthwise convolution over V, added to the attention output.

Linear attention's kv summary has rank <= D per head, which blurs fine spatial detail; a depthwise convolution on
the values of neighbouring patches restores it (EfficientViT, FLatten). The branch needs the token grid, which a
flat [B, N, C] sequence does not carry. It is resolved per call, from the first of:

1. ``feat_size=(H, W)`` passed to ``forward`` (linvit models pass the grid of the current image, so non-square and
   dynamic sizes work);
2. ``grid_size=(H, W)`` given at construction, when it matches the token count;
3. a square grid, when N - num_prefix_tokens is a perfect square;

otherwise a ValueError says what to pass. ``num_prefix_tokens`` leading tokens (class / register tokens) are not
on the grid and receive no local term. Resolution reads only shapes, so it costs nothing under torch.compile and
is a leaf (wrapped) call under torch.fx.
"""
import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


def resolve_token_grid(n_tokens: int, num_prefix_tokens: int, grid_size: Optional[Tuple[int, int]],
                       feat_size: Optional[List[int]]) -> Tuple[int, int]:
    """(H, W) of the patch tokens in a sequence of ``n_tokens`` = num_prefix_tokens + H * W tokens."""
    n_patches = n_tokens - num_prefix_tokens
    if feat_size is not None:
        if len(feat_size) != 2 or feat_size[0] * feat_size[1] != n_patches:
            raise ValueError(f"feat_size={feat_size} does not match {n_tokens} tokens with {num_prefix_tokens} "
                             f"prefix tokens: expected (H, W) with H * W = {n_patches}")
        return feat_size[0], feat_size[1]
    if grid_size is not None and grid_size[0] * grid_size[1] == n_patches:
        return grid_size[0], grid_size[1]
    side = int(math.sqrt(float(max(n_patches, 0))) + 0.5)
    if n_patches > 0 and side * side == n_patches:
        return side, side
    raise ValueError(f"local mixing cannot infer the token grid of {n_tokens} tokens ({num_prefix_tokens} prefix + "
                     f"{n_patches} patch tokens) with grid_size={grid_size}: pass feat_size=(H, W) to forward() or "
                     f"grid_size=(H, W) / num_prefix_tokens at construction")


torch.fx.wrap('resolve_token_grid')


class LocalMix(nn.Module):
    """Depthwise k x k convolution over the values of patch tokens, zero-initialised (starts as a no-op).

    forward: v [B, H, N, Dv] -> [B, N, H * Dv], channels ordered head-major like the attention output; the
    ``num_prefix_tokens`` leading tokens get zeros. ``add_to(out, v)`` adds that term to an attention output.
    """
    grid_size: Optional[Tuple[int, int]]
    #: its state-dict entries, none of which softmax attention has (``linvit.layers.weights``)
    linear_only_tensors = ('conv',)

    def __init__(self, channels: int, kernel_size: int = 3, num_prefix_tokens: int = 1,
                 grid_size: Optional[Tuple[int, int]] = None, device=None, dtype=None) -> None:
        super().__init__()
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"local mixing kernel_size must be a positive odd number, got {kernel_size}")
        if num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
        self.num_prefix_tokens = num_prefix_tokens
        self.kernel_size = kernel_size
        self.grid_size = None if grid_size is None else (int(grid_size[0]), int(grid_size[1]))
        self.conv = nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels,
                              device=device, dtype=dtype)
        self.init_weights()

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, num_prefix_tokens={self.num_prefix_tokens}, grid_size={self.grid_size}"

    def init_weights(self) -> None:
        """Zero weights and bias: a model that gains this branch computes exactly what it did before."""
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)

    def patch_term(self, v: torch.Tensor, feat_size: Optional[List[int]] = None,
                   num_prefix_tokens: Optional[int] = None) -> torch.Tensor:
        """v [B, H, N, Dv] -> the local term of the patch tokens, [B, HW, H * Dv] (prefix tokens left out).
        num_prefix_tokens: how many lead v (default: the layer's; 0 for a band of patch rows without them)."""
        B, H, N, Dv = v.shape
        prefix = self.num_prefix_tokens if num_prefix_tokens is None else num_prefix_tokens
        gh, gw = resolve_token_grid(N, prefix, self.grid_size, feat_size)
        channels = H * Dv
        # the qkv projection stores v token-major, so a channels-last grid is one dense copy and the convolution's
        # channels-last output is already token-major; the channels-first grid cost a transpose each way and ran
        # 6x slower at 16k tokens (62 ms vs 9.5 ms per layer, eager)
        tokens = v.transpose(1, 2).reshape(B, N, channels)[:, prefix:]
        grid = tokens.reshape(B, gh, gw, channels).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        return self.conv(grid).permute(0, 2, 3, 1).reshape(B, gh * gw, channels)

    def forward(self, v: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        return F.pad(self.patch_term(v, feat_size), (0, 0, self.num_prefix_tokens, 0))

    def add_to(self, out: torch.Tensor, v: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        """out [B, N, H * Dv] + forward(v).

        Without autograd (outside torch.compile, which fuses the out-of-place sum, and outside fx tracing) the term
        is added in place into out's patch rows: ``out`` must then be a tensor the caller owns.
        """
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or _fx_tracing():
            return out + self.forward(v, feat_size)
        out[:, self.num_prefix_tokens:].add_(self.patch_term(v, feat_size))
        return out


def _fx_tracing() -> bool:
    """Whether torch.fx is tracing (False under TorchScript, which cannot ask). An fx graph must get the
    out-of-place sum: the in-place add into a slice of out returns a value nothing reads, and the dead-code
    elimination of torchvision's (and timm's) feature extraction removes it with the convolution, silently dropping
    the local term from graphs traced without autograd."""
    if torch.jit.is_scripting():
        return False
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing()
