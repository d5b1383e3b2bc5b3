"""The backbone over an image whose activations do not fit at once: exactly the plain forward, in bands of patch rows.

    tokens = bounded_forward_features(model, images, rows_per_chunk=8)     # == model.forward_features(images)
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
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block

from ..layers import LinearAttention
from ..ops import add_states
from .linvit import LinearAttentionBlock, patch_grid
from .segmentation import SegmentationModel, class_ids

__all__ = ['bounded_forward_features', 'bounded_forward_intermediates', 'bounded_unsupported_reason',
           'iter_bounded_segment', 'bounded_segment', 'bounded_segment_unsupported_reason', 'DEFAULT_ROWS_PER_CHUNK']

#: patch rows per band (and per head tile): at 4096 px, linvit-S segmentation peaks below 2 GiB with 8 and runs as
#: fast as the plain forward (docs/benchmarks.md); fewer rows, less memory
DEFAULT_ROWS_PER_CHUNK = 8

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


#: read_band(r0, r1) -> the input pixels of patch rows r0..r1-1: [B, C, (r1 - r0) * patch height, W' * patch width]
BandReader = Callable[[int, int], torch.Tensor]


def _embed(model: nn.Module, read_band: BandReader, batch: int, grid: List[int], rows_per_chunk: int
           ) -> torch.Tensor:
    """Tokens [B, prefix + gh * gw, dim] as the model's ``_embed`` makes them, band by band from ``read_band``."""
    pe = model.patch_embed
    gh, gw = grid
    dim, prefix = model.embed_dim, model.num_prefix_tokens
    weight = pe.proj.weight
    # the model's own position-embedding code on zero patch features gives prefix tokens and resampled positions
    # exactly as it adds them (0 + pos == pos): once for the whole grid
    zeros = weight.new_zeros((1, gh, gw, dim) if model.dynamic_img_size else (1, gh * gw, dim))
    offsets = model._pos_embed(zeros)  # [1, prefix + gh * gw, dim]
    del zeros
    tokens = weight.new_empty(batch, prefix + gh * gw, dim)
    tokens[:, :prefix] = model.norm_pre(offsets[:, :prefix].expand(batch, -1, -1))
    for r0, r1 in _bands(gh, rows_per_chunk):
        patches = pe.norm(pe.proj(read_band(r0, r1)).flatten(2).transpose(1, 2))  # [B, rows * gw, dim]
        span = slice(prefix + r0 * gw, prefix + r1 * gw)
        tokens[:, span] = model.norm_pre(patches + offsets[:, span])
    return tokens


def _image_bands(model: nn.Module, images: torch.Tensor) -> Tuple[BandReader, List[int]]:
    """(band reader, grid) over a whole image tensor [B, C, H, W], with the grid the plain forward takes."""
    pe = model.patch_embed
    grid = patch_grid(images, pe.patch_size, pe.img_size, pe.strict_img_size, pe.dynamic_img_pad)
    ph, pw = pe.patch_size
    return (lambda r0, r1: images[:, :, r0 * ph:r1 * ph, :grid[1] * pw]), grid


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


def _blocks(model: nn.Module, read_band: BandReader, batch: int, grid: List[int], take: Sequence[int],
            rows_per_chunk: int, tick: Optional[Callable[[], None]] = None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Run blocks 0..max(take) (all without ``take``): (tokens, copies of the tokens after each block in ``take``).
    ``tick()`` is called after each block."""
    tokens = _embed(model, read_band, batch, grid, rows_per_chunk)
    prefix = model.num_prefix_tokens
    last = max(take) if take else len(model.blocks) - 1
    taken = []
    for index, block in enumerate(model.blocks[:last + 1]):
        _block(block, tokens, grid, prefix, rows_per_chunk)
        if index in take:
            taken.append(tokens if index == last else tokens.clone())
        if tick is not None:
            tick()
    return tokens, taken


@torch.no_grad()
def bounded_forward_features(model: nn.Module, images: torch.Tensor,
                             rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK) -> torch.Tensor:
    """``model.forward_features(images)`` in bands of ``rows_per_chunk`` patch rows: images [B, C, H, W] ->
    normalised tokens [B, prefix + H' * W', dim]. The final norm runs in place, band by band."""
    _check(model, rows_per_chunk)
    read_band, grid = _image_bands(model, images)
    tokens, _ = _blocks(model, read_band, images.shape[0], grid, (), rows_per_chunk)
    for start in range(0, tokens.shape[1], rows_per_chunk * grid[1]):
        span = slice(start, start + rows_per_chunk * grid[1])
        tokens[:, span] = model.norm(tokens[:, span])
    return tokens


@torch.no_grad()
def bounded_forward_intermediates(model: nn.Module, images: torch.Tensor, indices: Sequence[int],
                                  rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK) -> List[torch.Tensor]:
    """``model.forward_intermediates(images, indices, norm=False, output_fmt='NCHW', intermediates_only=True)`` in
    bands: the outputs of blocks ``indices`` (sorted, distinct, >= 0) as maps [B, dim, H', W']; blocks after the
    last one asked for do not run."""
    _check(model, rows_per_chunk)
    take = sorted(set(int(i) for i in indices))
    if not take or take[0] < 0 or take[-1] >= len(model.blocks):
        raise ValueError(f"indices must name blocks 0..{len(model.blocks) - 1}, got {list(indices)}")
    read_band, grid = _image_bands(model, images)
    _, taken = _blocks(model, read_band, images.shape[0], grid, take, rows_per_chunk)
    return [_as_map(t, model.num_prefix_tokens, grid) for t in taken]


def _as_map(tokens: torch.Tensor, prefix: int, grid: List[int]) -> torch.Tensor:
    """tokens [B, prefix + gh * gw, dim] -> the patch tokens as a map [B, dim, gh, gw] (a view)."""
    return tokens[:, prefix:].reshape(tokens.shape[0], grid[0], grid[1], -1).permute(0, 3, 1, 2)


# --- segmentation: the backbone in bands, then the levels and the head in tiles of rows, class ids per tile ---------

#: read_rows(y0, y1) -> image rows y0..y1-1 as the model takes them (normalised floats): [B, C, y1 - y0, W]
RowReader = Callable[[int, int], torch.Tensor]
#: progress(steps done, steps in all), called after each block and each head tile
Progress = Callable[[int, int], None]


def bounded_segment_unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot run ``iter_bounded_segment`` (one line), or None when it can."""
    if not isinstance(model, SegmentationModel):
        return f"{type(model).__name__} is not a linvit SegmentationModel"
    head = type(model.head)
    if len(getattr(head, 'halos', ())) != len(model.level_scales) or not hasattr(head, 'finest_halo'):
        return (f"its head {head.__name__} declares no halo per level (halos, finest_halo: linvit.models.heads), "
                f"which tiles of rows need")
    return bounded_unsupported_reason(model.backbone)


def _padded_band_reader(read_rows: RowReader, size: Tuple[int, int], patch: Tuple[int, int], grid: List[int]
                        ) -> BandReader:
    """A band reader over ``read_rows`` with the image padded with zeros at the bottom/right to the patch grid, as
    ``linvit.inference.whole_inference`` pads it."""
    height, width = size
    ph, pw = patch

    def read_band(r0: int, r1: int) -> torch.Tensor:
        y0, y1 = r0 * ph, min(r1 * ph, height)
        rows = read_rows(y0, y1)
        if rows.ndim != 4 or tuple(rows.shape[-2:]) != (y1 - y0, width):
            raise ValueError(f"read_rows({y0}, {y1}) must return [B, C, {y1 - y0}, {width}], got "
                             f"{tuple(rows.shape)}")
        return F.pad(rows, (0, grid[1] * pw - width, 0, r1 * ph - y1))
    return read_band


def _source_coords(rows_in: int, rows_out: int, start: int, stop: int) -> Tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """(low rows, high rows, weights of high) that bilinear resampling (align_corners=False) of ``rows_in`` rows to
    ``rows_out`` reads for output rows start..stop-1, in the whole map's coordinates as ``F.interpolate`` takes
    them: row = low * (1 - weight) + high * weight."""
    src = ((torch.arange(start, stop, dtype=torch.float64) + 0.5) * (rows_in / rows_out) - 0.5).clamp_(min=0)
    low = src.floor()
    weight = src - low
    low = low.long()
    return low, (low + 1).clamp_(max=rows_in - 1), weight


def _resample(x: torch.Tensor, offset: int, rows_in: int, rows_out: int, start: int, stop: int, width: int
              ) -> torch.Tensor:
    """Rows start..stop-1 of the bilinear resampling of a map [B, C, rows_in, w] to [B, C, rows_out, width], from
    x [B, C, n, w] holding its rows offset..offset+n-1 -> [B, C, stop - start, width]: the rows at their place in
    the whole map, then the columns as ``F.interpolate`` resamples whole rows."""
    low, high, weight = _source_coords(rows_in, rows_out, start, stop)
    low, high = low - offset, high - offset
    if len(low) and (int(low.min()) < 0 or int(high.max()) >= x.shape[-2]):
        raise RuntimeError(f"rows {start}..{stop - 1} read source rows outside the tile's "
                           f"{offset}..{offset + x.shape[-2] - 1}: the head halo is too small")
    weight = weight.to(x.device, x.dtype).view(-1, 1)
    rows = x[:, :, low.to(x.device)] * (1 - weight) + x[:, :, high.to(x.device)] * weight
    return F.interpolate(rows, size=(stop - start, width), mode='bilinear', align_corners=False)


def _level_rows(r0: int, r1: int, halo: int, scale: float, rows: int) -> Tuple[int, int]:
    """Patch rows [a, b) of backbone map that a level reads for the tile r0..r1-1: its halo each side, ``a`` a
    multiple of the rows a coarser level pools together, so that its rows pair as in the whole map."""
    pooled = round(1 / scale) if scale < 1 else 1
    a = max(r0 - halo, 0)
    return a - a % pooled, min(r1 + halo, rows)


def _level_tile(model: SegmentationModel, maps: Dict[int, torch.Tensor], level: int, rows: Tuple[int, int],
                map_offset: int) -> torch.Tensor:
    """Level ``level`` computed from patch rows rows[0]..rows[1]-1 of its backbone maps, which hold patch rows
    map_offset..map_offset+n-1."""
    a, b = rows
    blocks = model.level_inputs[level]
    if a < map_offset or any(b - map_offset > maps[block].shape[-2] for block in blocks):
        raise RuntimeError(f"patch rows {a}..{b - 1} are not all in the maps' rows {map_offset}.."
                           f"{map_offset + maps[blocks[0]].shape[-2] - 1}: the head halo is too small")
    return model.level(level, {block: maps[block][:, :, a - map_offset:b - map_offset] for block in blocks})


class _TileResize:
    """The head's ``LevelResize`` on tiles: level i's tile holds rows offsets[i]..offsets[i]+n_i of a level of
    level_rows[i] rows; a map resized to level dst has the rows dst's tile holds, each sampled at its place in the
    whole map (a map of its own, src None, is whole). A row whose source lies outside the tile reads the tile's edge
    row instead: wrong, and among the rows the halos cut away."""

    def __init__(self, offsets: List[int], level_rows: List[int], tiles: List[torch.Tensor]) -> None:
        self.offsets, self.level_rows = offsets, level_rows
        self.shapes = [tuple(tile.shape[-2:]) for tile in tiles]

    def __call__(self, x: torch.Tensor, src: Optional[int], dst: int) -> torch.Tensor:
        rows_in, offset = (x.shape[-2], 0) if src is None else (self.level_rows[src], self.offsets[src])
        start = self.offsets[dst]
        low, high, weight = _source_coords(rows_in, self.level_rows[dst], start, start + self.shapes[dst][0])
        last = x.shape[-2] - 1
        low, high = (low - offset).clamp(0, last).to(x.device), (high - offset).clamp(0, last).to(x.device)
        weight = weight.to(x.device, x.dtype).view(-1, 1)
        rows = x[:, :, low] * (1 - weight) + x[:, :, high] * weight
        return F.interpolate(rows, size=self.shapes[dst], mode='bilinear', align_corners=False)


def context_part(model: SegmentationModel, maps: Dict[int, torch.Tensor], grid: List[int], rows: Tuple[int, int],
                 map_offset: int = 0) -> Optional[List[torch.Tensor]]:
    """What patch rows rows[0]..rows[1]-1 add to the head's global context (``context_sums`` of its
    ``context_level``; None for a head without one): the parts of tiles that cover the grid add up to the whole
    image's. maps: block -> [B, dim, n, gw] holding patch rows map_offset..map_offset+n-1."""
    head = model.head
    level = getattr(head, 'context_level', None)
    if level is None:
        return None
    scale, halo = model.level_scales[level], type(head).halos[level]
    total = int(grid[0] * scale)
    a, b = _level_rows(*rows, halo, scale, grid[0])
    tile = _level_tile(model, maps, level, (a, b), map_offset)
    own = (int(rows[0] * scale), min(int(rows[1] * scale), total))
    start = int(a * scale)
    return head.context_sums(tile[:, :, own[0] - start:own[1] - start], own, total)


def _head_tile(model: SegmentationModel, maps: Dict[int, torch.Tensor], grid: List[int], r0: int, r1: int,
               out_rows: Tuple[int, int], out_width: int, map_offset: int = 0,
               context: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
    """Logits [B, K, y1 - y0, out_width] of image rows out_rows = (y0, y1), within patch rows r0..r1-1: each level from
    its backbone maps' rows with the head's halo for it (``halos``), the finest level cut to the rows the logits
    read and the head's ``finest_halo`` around them, the head on these tiles with a resize that samples rows at their
    place in the whole map. maps: block -> [B, dim, n, gw] holding patch rows map_offset..map_offset+n-1 (0: the
    whole map); context: the head's global context summed over the whole image (``context_part``), if it has one."""
    gh = grid[0]
    ph, pw = model.backbone.patch_embed.patch_size
    head = model.head
    scales = model.level_scales
    tiles, offsets = [], []
    for level, (scale, halo) in enumerate(zip(scales, type(head).halos)):
        a, b = _level_rows(r0, r1, halo, scale, gh)
        tiles.append(_level_tile(model, maps, level, (a, b), map_offset))
        offsets.append(int(a * scale))
    level_rows = [int(gh * scale) for scale in scales]  # max pooling floors an odd row count
    low, high, _ = _source_coords(level_rows[0], ph * gh, *out_rows)
    first = max(int(low.min()) - head.finest_halo, 0)  # the finest level's rows the logits read, and the halo
    last = min(int(high.max()) + head.finest_halo, level_rows[0] - 1)
    if first < offsets[0] or last + 1 - offsets[0] > tiles[0].shape[-2]:
        raise RuntimeError(f"rows {first}..{last} of the finest level are outside the tile's: the head halo is too "
                           f"small")
    tiles[0] = tiles[0][:, :, first - offsets[0]:last + 1 - offsets[0]]
    offsets[0] = first
    extra = {} if context is None else {'context': context, 'context_rows': level_rows[head.context_level]}
    logits = head(tiles, _TileResize(offsets, level_rows, tiles), **extra)  # [B, K, last + 1 - first, w_0]
    return _resample(logits, first, level_rows[0], ph * gh, *out_rows, grid[1] * pw)[..., :out_width]


def _whole_context(model: SegmentationModel, maps: Dict[int, torch.Tensor], grid: List[int],
                   tiles: List[Tuple[int, int]]) -> Optional[List[torch.Tensor]]:
    """The head's global context over the whole image, summed tile by tile (None for a head without one)."""
    total = None
    for rows in tiles:
        part = context_part(model, maps, grid, rows)
        if part is None:
            return None
        total = part if total is None else [t + p for t, p in zip(total, part)]
    return total


@torch.no_grad()
def iter_bounded_segment(model: nn.Module, read_rows: RowReader, batch: int, size: Tuple[int, int],
                         rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK, progress: Optional[Progress] = None
                         ) -> Iterator[Tuple[int, torch.Tensor]]:
    """``linvit.inference.whole_inference(model, images, pad_multiple=patch)`` of a SegmentationModel, a band of rows
    at a time: yields (y0, logits [B, K, n, W] of image rows y0..y0+n-1), top to bottom, covering the image of
    ``size`` = (H, W) read through ``read_rows``.

    The backbone runs in bands of ``rows_per_chunk`` patch rows (``bounded_forward_intermediates``); the levels and
    the head run on tiles of as many patch rows (rounded up to even, so max pooling pairs rows as in the whole map),
    each level with the head's halo of patch rows for it (``halos``), resampled at its place in the whole map. A
    head's global context (UPerNet's pooling) is summed over the tiles first, then applied in each. What exists for
    the whole image: the residual stream and the backbone maps the levels read; never a whole level, nor full-size
    logits. The image is read once, band by band."""
    reason = bounded_segment_unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"the bounded forward cannot run this model: {reason}")
    backbone = model.backbone
    _check(backbone, rows_per_chunk)
    height, width = size
    patch = tuple(backbone.patch_embed.patch_size)
    grid = [-(-height // patch[0]), -(-width // patch[1])]
    pe = backbone.patch_embed  # the plain forward's size rules (a fixed-size model takes only img_size)
    patch_grid(torch.empty(1, 1, grid[0] * patch[0], grid[1] * patch[1], device='meta'), pe.patch_size, pe.img_size,
               pe.strict_img_size, pe.dynamic_img_pad)
    step = rows_per_chunk + rows_per_chunk % 2
    tiles = _bands(grid[0], step)
    done, total = 0, max(model.take_blocks) + 1 + len(tiles)

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    read_band = _padded_band_reader(read_rows, (height, width), patch, grid)
    _, taken = _blocks(backbone, read_band, batch, grid, model.take_blocks, rows_per_chunk, tick)
    maps = {block: _as_map(t, backbone.num_prefix_tokens, grid) for block, t in zip(model.take_blocks, taken)}
    context = _whole_context(model, maps, grid, tiles)
    for r0, r1 in tiles:
        y0, y1 = r0 * patch[0], min(r1 * patch[0], height)
        if y0 < y1:
            yield y0, _head_tile(model, maps, grid, r0, r1, (y0, y1), width, context=context)
        tick()


@torch.no_grad()
def bounded_segment(model: nn.Module, images: torch.Tensor,
                    rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK) -> torch.Tensor:
    """Class ids [B, H, W] (uint8 for up to 256 classes, else int32) of ``model(images)`` for images [B, C, H, W]
    of any size (padded to the patch as ``whole_inference`` pads), computed by ``iter_bounded_segment``: the argmax
    is taken per band, so full-size float logits never exist."""
    if images.ndim != 4:
        raise ValueError(f"images must be [B, C, H, W], got shape {tuple(images.shape)}")
    batch, _, height, width = images.shape
    dtype = torch.uint8 if model.num_classes <= 256 else torch.int32
    classes = torch.empty(batch, height, width, dtype=dtype, device=images.device)
    for y0, logits in iter_bounded_segment(model, lambda a, b: images[:, :, a:b], batch, (height, width),
                                           rows_per_chunk):
        classes[:, y0:y0 + logits.shape[-2]] = class_ids(logits).to(dtype)
    return classes
