"""Context parallelism: one image's patch rows split over the ranks of a process group, for training and inference.

    shards = RowShards(group)                          # the context ranks (None: this process alone)
    cp = ContextParallel(model, shards)                # model: a linvit ViT classifier or a SegmentationModel
    out = cp(images)                                   # every rank passes the same images [B, C, H, W]
    # classifier: logits [B, K], the same on every rank; segmentation: logits [B, K, y1 - y0, W] of the image rows
    # cp.pixel_rows(H) = (y0, y1) this rank scores

What each rank holds is its own band of patch rows (``RowShards.bounds``: as even as the rows allow; the first ranks
take one row more when they do not divide), never the whole token sequence:

- patch embedding, position embeddings, norms, the MLPs: per token, on the rank's rows; the prefix tokens (class,
  registers) live on rank 0;
- attention: each rank sums its tokens' keys and values into the attention state (``LinearAttention.attention_state``,
  [B, H, Dv + 1, D] and a count per head, whatever the token count); one all-reduce over the group makes it the
  state of the whole image, and each rank's queries attend to it (``attend_state``). The all-reduce is
  differentiable: its backward all-reduces the state's gradient, since every rank's queries read the whole state;
- the local-mix convolution reads a halo of patch rows from the neighbouring ranks (``exchange_rows``, point to point,
  whose backward sends the halo's gradient back);
- classification pools over the group (the class token from rank 0, or the mean of all patch tokens); segmentation
  exchanges the halo of backbone rows its levels and head read (the head's ``halos``) and each rank computes the
  logits of its own image rows exactly as ``linvit.models.bounded`` computes a tile; a head's global context
  (UPerNet's pooling) is each rank's part summed over the group, as the attention state is.

Gradients: every rank's parameters get the gradient of the loss terms it computed (its pixels, or, for the pooled
classifier, the whole loss divided over the group: see ``linvit.engine.parallel``); the gradients summed over the
context ranks are the one-process gradients. With a group of one rank the same code runs and no collective is made.
The blocks run as ``ContextBlock`` modules (one per backbone block, owning no parameters of its own), so that FSDP
and activation checkpointing wrap them as they wrap plain blocks; no layer's forward knows about the group.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from timm.layers import PatchEmbed

from ..ops import AttentionState
from .bounded import _as_map, _head_tile, bounded_unsupported_reason, context_part
from .linvit import patch_grid
from .segmentation import SegmentationModel

__all__ = ['RowShards', 'ContextParallel', 'ContextBlock', 'context_unsupported_reason', 'split_rows']

#: global pools the classifier can take over a group: the class token (rank 0's) or the mean over tokens
_POOLS = ('token', 'avg')


def split_rows(rows: int, parts: int) -> List[Tuple[int, int]]:
    """rows 0..rows-1 in ``parts`` contiguous bands [(r0, r1), ...], as even as they divide: the first
    ``rows % parts`` bands take one row more."""
    if parts > rows:
        raise ValueError(f"{parts} context ranks need at least {parts} patch rows, the image has {rows}")
    base, extra = divmod(rows, parts)
    bounds, start = [], 0
    for part in range(parts):
        stop = start + base + (part < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


class _HaloExchange(torch.autograd.Function):
    """rows [B, n, ...] of this rank -> [B, top + n + bottom, ...] with the rows of other ranks above and below, as
    ``plan`` says; the backward sends each received row's gradient back to its owner and adds the gradients of the
    rows others received from here."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, shards: 'RowShards', plan: '_Plan') -> torch.Tensor:  # type: ignore
        ctx.shards, ctx.plan = shards, plan
        rows = rows.contiguous()
        sends = [(peer, rows[:, a:b]) for peer, a, b in plan.sends]
        received = [(peer, rows.new_empty((rows.shape[0], b - a) + rows.shape[2:])) for peer, a, b in plan.receives]
        shards.point_to_point(sends, received)
        above = [t for (_, t), (_, a, _) in zip(received, plan.receives) if a < 0]
        below = [t for (_, t), (_, a, _) in zip(received, plan.receives) if a >= 0]
        return torch.cat(above + [rows] + below, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore
        plan: _Plan = ctx.plan
        grad = grad.contiguous()
        n = grad.shape[1] - plan.top - plan.bottom
        # what this rank received, at its place in the output (receives are ordered top to bottom)
        returned = [(peer, grad[:, plan.top + a:plan.top + b]) for peer, a, b in plan.receives]
        incoming = [(peer, grad.new_empty((grad.shape[0], b - a) + grad.shape[2:])) for peer, a, b in plan.sends]
        ctx.shards.point_to_point(returned, incoming)
        grad_rows = grad[:, plan.top:plan.top + n].clone()
        for (_, a, b), (_, g) in zip(plan.sends, incoming):
            grad_rows[:, a:b] += g
        return grad_rows, None, None


class _SumOverGroup(torch.autograd.Function):
    """The sum of a tensor over a group; its backward sums the gradient over the group (every rank's output is the
    same sum, and each rank's loss reads it)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore
        ctx.group = group
        total = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore
        return _SumOverGroup.apply(grad, ctx.group), None


@dataclass(frozen=True)
class _Plan:
    """Who sends which of its rows to whom: sends/receives [(peer, a, b)], rows a..b-1 relative to this rank's first
    row (negative: above it); top/bottom: the rows received above and below."""
    sends: Tuple[Tuple[int, int, int], ...]
    receives: Tuple[Tuple[int, int, int], ...]
    top: int
    bottom: int


class RowShards:
    """The context ranks of one image: a process group (None or a group of one: this process alone), the rank's
    index in it, and the collectives the context forward makes over it."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        alone = group is None or not dist.is_initialized()
        self.group = None if alone else group
        self.size = 1 if alone else dist.get_world_size(group)
        self.rank = 0 if alone else dist.get_rank(group)

    def bounds(self, rows: int) -> List[Tuple[int, int]]:
        """Every rank's band of the ``rows`` patch rows [(r0, r1)], in rank order."""
        return split_rows(rows, self.size)

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the group, differentiably (the backward sums the gradient over the group)."""
        if self.size == 1:
            return tensor
        return _SumOverGroup.apply(tensor, self.group)

    def reduce_state(self, state: AttentionState) -> AttentionState:
        """The attention state of the whole image from each rank's: one all-reduce of sums and count together."""
        if self.size == 1:
            return state
        sums, count = state.sums, state.count.to(state.sums.dtype)
        flat = self.reduce(torch.cat([sums.flatten(), count.flatten()]))
        return AttentionState(flat[:sums.numel()].view(sums.shape), flat[sums.numel():].view(state.count.shape))

    def exchange_rows(self, rows: torch.Tensor, total: int, top: int, bottom: int) -> Tuple[torch.Tensor, int, int]:
        """This rank's rows [B, n, ...] (its band of ``total`` rows) -> (rows [B, t + n + b, ...] with up to ``top``
        rows above and ``bottom`` below from the other ranks, t, b): fewer at the image's edges."""
        plan = self._plan(total, top, bottom)
        if not plan.sends and not plan.receives:
            return rows, 0, 0
        return _HaloExchange.apply(rows, self, plan), plan.top, plan.bottom

    def _plan(self, total: int, top: int, bottom: int) -> _Plan:
        bounds = self.bounds(total)

        def window(rank: int) -> Tuple[int, int]:
            r0, r1 = bounds[rank]
            return max(r0 - top, 0), min(r1 + bottom, total)

        mine = bounds[self.rank]
        sends, receives = [], []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            lo, hi = max(mine[0], window(peer)[0]), min(mine[1], window(peer)[1])
            if lo < hi:
                sends.append((peer, lo - mine[0], hi - mine[0]))
            lo, hi = max(bounds[peer][0], window(self.rank)[0]), min(bounds[peer][1], window(self.rank)[1])
            if lo < hi:
                receives.append((peer, lo - mine[0], hi - mine[0]))
        receives.sort(key=lambda item: item[1])
        first, last = window(self.rank)
        return _Plan(tuple(sends), tuple(receives), mine[0] - first, last - mine[1])

    def point_to_point(self, sends: Sequence[Tuple[int, torch.Tensor]],
                       receives: Sequence[Tuple[int, torch.Tensor]]) -> None:
        """Send and receive tensors to / from the group's ranks (indices in the group), all posted before any wait."""
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), group=self.group, group_peer=peer)
               for peer, tensor in sends]
        ops += [dist.P2POp(dist.irecv, tensor, group=self.group, group_peer=peer) for peer, tensor in receives]
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()


def context_unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot run split over context ranks (one line), or None when it can."""
    if isinstance(model, SegmentationModel):
        from .bounded import bounded_segment_unsupported_reason
        return bounded_segment_unsupported_reason(model)
    reason = bounded_unsupported_reason(model)
    if reason is not None:
        return reason
    if getattr(model, 'attn_pool', None) is not None or model.global_pool not in _POOLS:
        return f"global_pool={model.global_pool!r}: the context forward pools with {' or '.join(_POOLS)}"
    return _per_token_embedding_reason(model)


def _per_token_embedding_reason(model: nn.Module) -> Optional[str]:
    drop = getattr(model, 'pos_drop', None)
    if isinstance(drop, nn.Dropout) and drop.p > 0:
        return f"pos_drop_rate={drop.p}: position dropout draws over the whole sequence; use pos_drop_rate=0"
    if not isinstance(getattr(model, 'patch_drop', nn.Identity()), nn.Identity):
        return "patch_drop_rate > 0 drops tokens of the whole sequence; use patch_drop_rate=0"
    return None


class ContextBlock(nn.Module):
    """One backbone block over this rank's tokens [B, p + n * gw, dim] (p prefix tokens on rank 0, else 0): the state
    all-reduced over the group, the local-mix halo exchanged. Holds the block (its parameters stay the block's)."""

    def __init__(self, block: nn.Module, shards: RowShards) -> None:
        super().__init__()
        self.block = block
        self.shards = shards

    def forward(self, x: torch.Tensor, prefix: int, grid: Tuple[int, int]) -> torch.Tensor:
        """x [B, prefix + n * gw, dim] -> the block's output for the same tokens; grid = (gh, gw) the whole image's."""
        block, attn = self.block, self.block.attn
        gh, gw = grid
        h = block.norm1(x)
        state = self.shards.reduce_state(attn.attention_state(h))
        halo = attn.local_mix.kernel_size // 2 if attn.local_mix is not None else 0
        patches = h[:, prefix:]
        rows = patches.shape[1] // gw
        extended, top, bottom = self.shards.exchange_rows(patches.unflatten(1, (rows, gw)), gh, halo, halo)
        y = attn.attend_state(extended.flatten(1, 2), state, band=(top + rows + bottom, top, bottom))
        if prefix:
            y = torch.cat([attn.attend_state(h[:, :prefix], state), y], dim=1)
        x = x + block.drop_path1(block.ls1(y))
        return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))


class ContextParallel(nn.Module):
    """``model`` with each image's patch rows split over ``shards`` (module docstring). Every rank calls it with the
    same images [B, C, H, W]: a classifier returns logits [B, K] (the same on every rank), a SegmentationModel the
    logits [B, K, y1 - y0, W] of image rows ``pixel_rows(H)``. ``blocks`` are the ``ContextBlock`` modules that run
    the backbone's blocks (wrap them, not the backbone's, with FSDP or activation checkpointing)."""

    def __init__(self, model: nn.Module, shards: Optional[RowShards] = None) -> None:
        super().__init__()
        reason = context_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the context-parallel forward cannot run this model: {reason}")
        self.model = model
        self.shards = shards or RowShards(None)
        self.segmentation = isinstance(model, SegmentationModel)
        self.backbone = model.backbone if self.segmentation else model
        last = max(model.take_blocks) if self.segmentation else len(self.backbone.blocks) - 1
        self.blocks = nn.ModuleList(ContextBlock(block, self.shards) for block in self.backbone.blocks[:last + 1])

    def grid(self, images: torch.Tensor) -> List[int]:
        """The patch grid [gh, gw] the plain forward takes for images [B, C, H, W] (ValueError for a bad size)."""
        pe: PatchEmbed = self.backbone.patch_embed
        return patch_grid(images, pe.patch_size, pe.img_size, pe.strict_img_size, pe.dynamic_img_pad)

    def rows(self, images: torch.Tensor) -> Tuple[int, int]:
        """The patch rows (r0, r1) of this rank for images [B, C, H, W]."""
        return self.shards.bounds(self.grid(images)[0])[self.shards.rank]

    def pixel_rows(self, images: torch.Tensor) -> Tuple[int, int]:
        """The image rows (y0, y1) whose logits this rank returns (segmentation)."""
        r0, r1 = self.rows(images)
        ph = self.backbone.patch_embed.patch_size[0]
        return r0 * ph, min(r1 * ph, images.shape[-2])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        grid = self.grid(images)
        r0, r1 = self.rows(images)
        prefix = self.backbone.num_prefix_tokens if self.shards.rank == 0 else 0
        x = self._embed(images, grid, (r0, r1), prefix)
        taken = {}
        for index, block in enumerate(self.blocks):
            x = block(x, prefix, tuple(grid))
            if self.segmentation and index in self.model.take_blocks:
                taken[index] = x
        if self.segmentation:
            return self._segment(taken, grid, (r0, r1), prefix, images)
        return self._classify(x, grid, prefix)

    def _embed(self, images: torch.Tensor, grid: List[int], rows: Tuple[int, int], prefix: int) -> torch.Tensor:
        """Tokens [B, prefix + n * gw, dim] of patch rows r0..r1-1 as the model's ``_embed`` and ``_pos_embed`` make
        them: the position embeddings resampled for the whole grid by the model's own code, then this rank's."""
        model, pe = self.backbone, self.backbone.patch_embed
        gh, gw = grid
        (ph, pw), (r0, r1) = pe.patch_size, rows
        all_prefix = model.num_prefix_tokens
        pixels = images[:, :, r0 * ph:r1 * ph, :gw * pw]
        if pixels.shape[-2] < (r1 - r0) * ph or pixels.shape[-1] < gw * pw:  # dynamic_img_pad: pad as timm does
            pixels = nn.functional.pad(pixels, (0, gw * pw - pixels.shape[-1], 0, (r1 - r0) * ph - pixels.shape[-2]))
        patches = pe.norm(pe.proj(pixels).flatten(2).transpose(1, 2))  # [B, n * gw, dim]
        zeros = patches.new_zeros((1, gh, gw, model.embed_dim) if model.dynamic_img_size else (1, gh * gw,
                                                                                             model.embed_dim))
        offsets = model._pos_embed(zeros)  # [1, all_prefix + gh * gw, dim]: 0 + pos == pos, as the model adds it
        tokens = patches + offsets[:, all_prefix + r0 * gw:all_prefix + r1 * gw]
        if prefix:
            tokens = torch.cat([offsets[:, :prefix].expand(tokens.shape[0], -1, -1), tokens], dim=1)
        return model.norm_pre(tokens)

    def _classify(self, x: torch.Tensor, grid: List[int], prefix: int) -> torch.Tensor:
        """The model's head on the pool over all ranks' tokens: logits [B, K] on every rank."""
        model = self.backbone
        x = model.norm(x)
        if model.global_pool == 'token':
            # rank 0's class token; the others add an empty sum, which keeps them in the backward's all-reduce
            pooled = self.shards.reduce(x[:, :1 if prefix else 0].sum(1))
        else:
            include = model.pool_include_prefix
            tokens = x if include else x[:, prefix:]
            count = grid[0] * grid[1] + (model.num_prefix_tokens if include else 0)
            pooled = self.shards.reduce(tokens.sum(1)) / count
        return model.head(model.head_drop(model.fc_norm(pooled)))

    def _segment(self, taken: dict, grid: List[int], rows: Tuple[int, int], prefix: int,
                 images: torch.Tensor) -> torch.Tensor:
        """Logits [B, K, y1 - y0, W] of this rank's image rows: each backbone map with the halo of rows the pyramid
        and head read from the other ranks, then the rows as ``bounded`` computes a tile."""
        r0, r1 = rows
        halo = max(type(self.model.head).halos) + 1  # + 1: a coarse level's pooled pairs may start a row above it
        maps = {}
        for index, tokens in taken.items():
            local = tokens[:, prefix:].unflatten(1, (r1 - r0, grid[1]))  # [B, n, gw, dim]
            extended, top, _ = self.shards.exchange_rows(local, grid[0], halo, halo)
            maps[index] = _as_map(extended.flatten(1, 2), 0, [extended.shape[1], grid[1]])
        context = context_part(self.model, maps, grid, rows, map_offset=r0 - top)
        if context is not None:
            context = [self.shards.reduce(part) for part in context]
        y0, y1 = self.pixel_rows(images)
        return _head_tile(self.model, maps, grid, r0, r1, (y0, y1), images.shape[-1], map_offset=r0 - top,
                          context=context)
