"""The backbone over an image whose activations do not fit at once: exactly the plain forward, in bands of patch rows.

    tokens = bounded_forward_features(model, images, rows_per_chunk=16)     # == model.forward_features(images)
    maps = bounded_forward_intermediates(model, images, [2, 5, 8, 11])      # == forward_intermediates(..., 'NCHW')

What the plain forward holds per block (qkv, the MLP's 4x hidden layer, the attention output, each as large as the
image) is here held for one band of ``rows_per_chunk`` patch rows at a time; only the residual stream (and the
intermediates asked for) exist for the whole image. Each block makes two passes over the bands:

1. every band's keys and values are summed into the attention state (``LinearAttention.attention_state``; states
   of parts add up, ``linvit.ops.add_states``), the prefix tokens (class, registers) as one more part;
2. each band's queries attend to that state (``attend_state``), with the halo of rows the local-mix convolution
   reads, and the MLP runs on the band; its new rows are written into the residual stream one band late, once the
   next band has read its halo of old rows.

The patch embedding runs per band (a stride-p convolution needs no halo); the position embeddings are resampled
once for the whole grid by the model's own ``_pos_embed``. This needs blocks whose attention has the state form
(``FamilySpec.state``): a hybrid with softmax blocks, or a family without it, is refused in one line; sliding
windows (``linvit.inference``) serve those. Inference only: gradients are not kept.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block

from ..layers import LinearAttention
from ..ops import add_states
from .linvit import LinearAttentionBlock, patch_grid

__all__ = ['bounded_forward_features', 'bounded_forward_intermediates', 'bounded_unsupported_reason']

#: blocks of timm's pre-norm form x + ls1(attn(norm1(x))), then x + ls2(mlp(norm2(x))), which the bands reproduce
_PRE_NORM_BLOCKS = (Block, LinearAttentionBlock)


def bounded_unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot run the bounded forward (one line), or None when it can."""
    name = type(model).__name__
    if not isinstance(getattr(model, 'patch_embed', None), PatchEmbed) or not hasattr(model, 'blocks'):
        return f"{name} is not a timm ViT with a PatchEmbed and blocks"
    for index, block in enumerate(model.blocks):
        attn = getattr(block, 'attn', None)
        if not isinstance(attn, LinearAttention):
            return (f"block {index} has {type(attn).__name__} (softmax attention), whose tokens cannot attend a "
                    f"part at a time; use sliding windows")
        if not type(attn).family.state or attn.causal:
            kind = 'causal attention' if attn.causal else f"attn_family={type(attn).family.name!r}"
            return f"block {index} has {kind}, which has no state form (FamilySpec.state); use sliding windows"
        if type(block) not in _PRE_NORM_BLOCKS:
            return f"block {index} is a {type(block).__name__}, not timm's pre-norm Block"
    return None


def _check(model: nn.Module, rows_per_chunk: int) -> None:
    reason = bounded_unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"the bounded forward cannot run this model: {reason}")
    if isinstance(rows_per_chunk, bool) or not isinstance(rows_per_chunk, int) or rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be an int >= 1 (patch rows per band), got {rows_per_chunk!r}")
    if model.training:
        raise ValueError("the bounded forward is inference: call model.eval() first")


def _bands(rows: int, rows_per_chunk: int) -> List[Tuple[int, int]]:
    return [(r, min(r + rows_per_chunk, rows)) for r in range(0, rows, rows_per_chunk)]


def _embed(model: nn.Module, images: torch.Tensor, rows_per_chunk: int) -> Tuple[torch.Tensor, List[int]]:
    """images [B, C, H, W] -> tokens [B, prefix + gh * gw, dim] as the model's ``_embed`` makes them, band by band."""
    pe = model.patch_embed
    gh, gw = patch_grid(images, pe.patch_size, pe.img_size, pe.strict_img_size, pe.dynamic_img_pad)
    ph = pe.patch_size[0]
    B, dim, prefix = images.shape[0], model.embed_dim, model.num_prefix_tokens
    # the model's own position-embedding code on zero patch features gives prefix tokens and resampled positions
    # exactly as it adds them (0 + pos == pos): once for the whole grid
    zeros = images.new_zeros((1, gh, gw, dim) if model.dynamic_img_size else (1, gh * gw, dim))
    offsets = model._pos_embed(zeros)  # [1, prefix + gh * gw, dim]
    tokens = images.new_empty(B, prefix + gh * gw, dim)
    tokens[:, :prefix] = model.norm_pre(offsets[:, :prefix].expand(B, -1, -1))
    for r0, r1 in _bands(gh, rows_per_chunk):
        strip = images[:, :, r0 * ph:r1 * ph, :gw * pe.patch_size[1]]
        patches = pe.norm(pe.proj(strip).flatten(2).transpose(1, 2))  # [B, rows * gw, dim]
        span = slice(prefix + r0 * gw, prefix + r1 * gw)
        tokens[:, span] = model.norm_pre(patches + offsets[:, span])
    return tokens, [gh, gw]


def _block(block: nn.Module, tokens: torch.Tensor, grid: List[int], prefix: int, rows_per_chunk: int) -> None:
    """One block over the residual stream tokens [B, prefix + gh * gw, dim], in place, band by band."""
    gh, gw = grid
    attn = block.attn
    bands = _bands(gh, rows_per_chunk)
    rows_of = lambda a, b: tokens[:, prefix + a * gw:prefix + b * gw]  # noqa: E731
    state = attn.attention_state(block.norm1(tokens[:, :prefix])) if prefix else None
    for r0, r1 in bands:
        part = attn.attention_state(block.norm1(rows_of(r0, r1)))
        state = part if state is None else add_states(state, part)
    halo = attn.local_mix.kernel_size // 2 if attn.local_mix is not None else 0

    def mlp(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + block.drop_path1(block.ls1(y))
        return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))

    new_prefix = mlp(tokens[:, :prefix], attn.attend_state(block.norm1(tokens[:, :prefix]), state)) if prefix else None
    pending: Optional[Tuple[int, int, torch.Tensor]] = None
    for r0, r1 in bands:
        a, b = max(r0 - halo, 0), min(r1 + halo, gh)
        y = attn.attend_state(block.norm1(rows_of(a, b)), state, band=(b - a, r0 - a, b - r1))
        out = mlp(rows_of(r0, r1), y)
        if pending is not None:  # written once this band has read its halo of the previous band's old rows
            rows_of(pending[0], pending[1]).copy_(pending[2])
        pending = (r0, r1, out)
    if pending is not None:
        rows_of(pending[0], pending[1]).copy_(pending[2])
    if new_prefix is not None:
        tokens[:, :prefix] = new_prefix


def _blocks(model: nn.Module, images: torch.Tensor, take: Sequence[int], rows_per_chunk: int
            ) -> Tuple[torch.Tensor, List[int], List[torch.Tensor]]:
    """Run blocks 0..max(take) (all without ``take``): (tokens, grid, copies of the tokens after each block in
    ``take``)."""
    tokens, grid = _embed(model, images, rows_per_chunk)
    prefix = model.num_prefix_tokens
    last = max(take) if take else len(model.blocks) - 1
    taken = []
    for index, block in enumerate(model.blocks[:last + 1]):
        _block(block, tokens, grid, prefix, rows_per_chunk)
        if index in take:
            taken.append(tokens if index == last else tokens.clone())
    return tokens, grid, taken


@torch.no_grad()
def bounded_forward_features(model: nn.Module, images: torch.Tensor, rows_per_chunk: int = 16) -> torch.Tensor:
    """``model.forward_features(images)`` in bands of ``rows_per_chunk`` patch rows: images [B, C, H, W] ->
    normalised tokens [B, prefix + H' * W', dim]. The final norm runs in place, band by band."""
    _check(model, rows_per_chunk)
    tokens, grid, _ = _blocks(model, images, (), rows_per_chunk)
    for start in range(0, tokens.shape[1], rows_per_chunk * grid[1]):
        span = slice(start, start + rows_per_chunk * grid[1])
        tokens[:, span] = model.norm(tokens[:, span])
    return tokens


@torch.no_grad()
def bounded_forward_intermediates(model: nn.Module, images: torch.Tensor, indices: Sequence[int],
                                  rows_per_chunk: int = 16) -> List[torch.Tensor]:
    """``model.forward_intermediates(images, indices, norm=False, output_fmt='NCHW', intermediates_only=True)`` in
    bands: the outputs of blocks ``indices`` (sorted, distinct, >= 0) as maps [B, dim, H', W']; blocks after the
    last one asked for do not run."""
    _check(model, rows_per_chunk)
    take = sorted(set(int(i) for i in indices))
    if not take or take[0] < 0 or take[-1] >= len(model.blocks):
        raise ValueError(f"indices must name blocks 0..{len(model.blocks) - 1}, got {list(indices)}")
    _, (gh, gw), taken = _blocks(model, images, take, rows_per_chunk)
    prefix = model.num_prefix_tokens
    return [t[:, prefix:].reshape(t.shape[0], gh, gw, -1).permute(0, 3, 1, 2) for t in taken]
