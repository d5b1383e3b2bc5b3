"""linvit models: timm's VisionTransformer with linear attention, registered with timm as ``linvit_*``.

After ``import linvit``, ``timm.create_model(name, **kwargs)`` builds any of ``timm.list_models('linvit_*')``.
Beyond VisionTransformer's arguments (img_size, dynamic_img_size, dynamic_img_pad, reg_tokens, class_token,
qk_norm, init_values, ...), the attention is chosen by:

    attn_family:      the attention family of the linear blocks, a name in ``linvit.list_attention_families()``
                      ('linear', 'performer', 'linformer', 'gated', 'aft', 'bidirectional', 'polar'; default 'linear').
    feature_map:      feature map name from ``linvit.ops.FEATURE_MAPS`` (default 'relu'), for the families that
                      use one (``ATTENTION_FAMILIES[name].family.feature_map``).
    normalizer:       how the similarities become weights, a name in ``linvit.ops.NORMALIZERS`` ('divide', the
                      default; 'inline', 'mala'), for the families that take one (``FamilySpec.normalizer``).
    attn_options:     the family's own options (``ATTENTION_FAMILIES[name].family.options``), e.g.
                      {'num_features': 128} (performer), {'low_rank_size': 8} (linformer).
    local_mix:        add the zero-initialised depthwise-conv branch on V over the patch grid (default True, False for
                      causal models: unlike a drop-in layer or a converted model, these models know their patch grid).
    causal:           causal linear attention in every block (token i sees tokens 0..i in raster order, the class
                      token first): for autoregressive models; ``recurrent_init`` / ``recurrent_step`` then run the
                      model as an RNN, patch by patch. A causal checkpoint loads into a non-causal model unchanged.
    local_mix_kernel: its (odd) kernel size (default 3).
    softmax_blocks:   indices of blocks that keep timm's softmax ``Attention`` (a hybrid; each block's type is
                      'linear' or 'softmax', ``BLOCK_TYPES``); default none.
    attn_backend:     who computes plain linear attention (``linvit.ops.ATTN_BACKENDS``): 'auto' (default: the Triton
                      kernels on CUDA tensors they serve, the PyTorch path elsewhere), 'triton' or 'torch'.

The model hands the patch grid (H, W) of the current image to every block, so local mixing works at any size,
square or not, with ``dynamic_img_size=True``. Parameter names equal timm's ViT, so a softmax ViT checkpoint of the
same width and depth loads strictly apart from the ``local_mix`` tensors (see ``checkpoint_filter_fn``).

``features_only=True`` gives the stride-p block maps, as for timm's ViT; the tag ``.pyramid`` of every name
(``'linvit_small_patch16_224.pyramid'``) gives the simple feature pyramid instead, 4 levels at p/4, p/2, p, 2p: a
hierarchical encoder for timm clients such as segmentation_models_pytorch (``linvit.models.feature_net``).
"""
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn as nn
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.layers import Attention, register_notrace_function
from timm.models import build_model_with_cfg, checkpoint, generate_default_cfgs, register_model, resolve_pretrained_cfg
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import Block, VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as vit_checkpoint_filter_fn

from ..callsite import user_stacklevel
from ..layers import LinearAttention, LocalMix, attention_layer, linear_only_parameter_names
from ..layers.family import resolve_family
from ..layers.linear_attention import causal_call
from ..ops import CausalState
from ..registry import Registry
from .feature_net import PYRAMID_DESCRIPTION, PYRAMID_TAG, features_only_cfg

__all__ = ['LinearVisionTransformer', 'LinearAttentionBlock', 'SoftmaxAttentionBlock', 'BLOCK_TYPES', 'BlockType',
           'RecurrentState', 'resolve_softmax_blocks', 'block_types', 'patch_grid', 'check_image_size',
           'checkpoint_filter_fn', 'DEFAULT_FEATURE_MAP']

_logger = logging.getLogger(__name__)
#: the feature map of ``linvit_*`` models built without one, chosen by the quality grid (docs/attention-families.md:
#: relu led elu1 by 9 top-1 points on 3 seeds, and keeps every fast path: the Triton kernels, the projection folds,
#: the state form of bounded and context-parallel inference; inline and mala led it by 2-3 points but have no state
#: form). Layers, ops and convert_to_linear keep elu1, which the table does not measure for converted weights.
DEFAULT_FEATURE_MAP = 'relu'


def _size_fixes(height: int, width: int, ph: int, pw: int) -> str:
    """The model options that make a model take images of height x width (only ones that work for that size)."""
    if height % ph == 0 and width % pw == 0:
        return f"img_size=({height}, {width}) or dynamic_img_size=True"
    return (f"img_size=({height}, {width}) (as in timm's ViT, the patch embedding then drops the {height % ph} "
            f"bottom rows and {width % pw} right columns of pixels that fill no whole patch) or dynamic_img_size=True, "
            f"dynamic_img_pad=True (pads them)")


def patch_grid(x: torch.Tensor, patch_size: Tuple[int, int], img_size: Tuple[int, int], fixed_size: bool,
               pad: bool) -> List[int]:
    """Patch grid [H', W'] for images x [B, C, H, W]; ValueError for a size the model cannot take.

    fixed_size: the model takes only ``img_size`` (created without dynamic_img_size); as in timm, the patch
        embedding's strided convolution then drops the pixels of a partial last patch (grid = floor(size / patch)).
    pad: sizes that the patch does not divide are padded up (dynamic_img_pad=True); otherwise a dynamic-size model
        rejects them.
    """
    height = x.shape[-2]
    width = x.shape[-1]
    ph = patch_size[0]
    pw = patch_size[1]
    if height < 1 or width < 1:
        raise ValueError(f"image size {height}x{width} is empty")
    if fixed_size:
        if height != img_size[0] or width != img_size[1]:
            expected_h = img_size[0]
            expected_w = img_size[1]
            raise ValueError(f"image size {height}x{width} does not match the model's img_size "
                             f"{expected_h}x{expected_w}; create the model with "
                             f"{_size_fixes(height, width, ph, pw)}")
        if not pad:
            return [height // ph, width // pw]
    elif not pad and (height % ph != 0 or width % pw != 0):
        raise ValueError(f"image size {height}x{width} is not divisible by the patch size {ph}x{pw}; resize it to a "
                         f"multiple of the patch ({height // ph * ph}x{width // pw * pw} or "
                         f"{(height + ph - 1) // ph * ph}x{(width + pw - 1) // pw * pw}) or create the model with "
                         f"dynamic_img_pad=True to pad it")
    # ceil division keeps integer arithmetic, so the grid stays symbolic under fx and torch.compile
    return [(height + ph - 1) // ph, (width + pw - 1) // pw]


def check_image_size(model: nn.Module, images: torch.Tensor) -> None:
    """ValueError (as the eager forward raises it) if a timm-style ViT ``model`` cannot take ``images`` [B, C, H, W].

    For callers that must fail before entering compiled code (where dynamo would bury the error); a model without
    timm's ``patch_embed`` (img_size, patch_size, strict_img_size, dynamic_img_pad) is not checked.
    """
    patch_embed = getattr(model, 'patch_embed', None)
    if not all(hasattr(patch_embed, a) for a in ('img_size', 'patch_size', 'strict_img_size', 'dynamic_img_pad')):
        return
    if images.dim() != 4:
        raise ValueError(f"{type(model).__name__} expects images of shape [B, C, H, W], got {list(images.shape)}")
    patch_grid(images, patch_embed.patch_size, patch_embed.img_size, patch_embed.strict_img_size,
               patch_embed.dynamic_img_pad)


# a leaf for torch.fx (plain symbolic_trace and timm's feature extraction): it branches on sizes
torch.fx.wrap('patch_grid')
register_notrace_function(patch_grid)


class LinearAttentionBlock(Block):
    """timm's pre-norm ``Block`` whose attention also receives the patch grid.

    forward: x [B, N, C] -> [B, N, C]; feat_size (H, W) with N = prefix tokens + H * W.
    """

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
            feat_size: Optional[List[int]] = None,
    ) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(
            self.norm1(x), attn_mask=attn_mask, is_causal=is_causal, feat_size=feat_size)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x

    @torch.jit.unused
    def step(self, x_t: torch.Tensor, state: Optional[CausalState]) -> Tuple[torch.Tensor, CausalState]:
        """The block as an RNN cell: one token x_t [B, C] after those summarised by ``state`` -> ([B, C], state)."""
        y, state = self.attn.step(self.norm1(x_t), state)
        x_t = x_t + self.drop_path1(self.ls1(y))
        return x_t + self.drop_path2(self.ls2(self.mlp(self.norm2(x_t)))), state


class SoftmaxAttentionBlock(Block):
    """timm's ``Block`` with softmax ``Attention``; takes (and ignores) feat_size so every block has one signature.

    forward: x [B, N, C] -> [B, N, C].
    """

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
            feat_size: Optional[List[int]] = None,
    ) -> torch.Tensor:
        # written out rather than super().forward(): TorchScript does not compile super() calls
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


@dataclass(frozen=True)
class BlockType:
    """A type of block (softmax or linear attention): its block class, and its attention layer for given options."""
    block: Type[Block]
    layer: Callable[[Dict[str, Any]], Type[nn.Module]]


#: block type -> how to build it: 'linear' (the model's attention family) or 'softmax' (timm's Attention)
BLOCK_TYPES: Registry[BlockType] = Registry('block type')
BLOCK_TYPES.register('linear', BlockType(LinearAttentionBlock, lambda options: attention_layer(**options)))
BLOCK_TYPES.register('softmax', BlockType(SoftmaxAttentionBlock, lambda options: Attention))


def resolve_softmax_blocks(softmax_blocks: Iterable[int], num_blocks: int) -> Tuple[int, ...]:
    """Validate block indices: ints in [0, num_blocks), each once. Returns them sorted; ValueError otherwise."""
    if isinstance(softmax_blocks, (str, bytes)) or not isinstance(softmax_blocks, Iterable):
        raise ValueError(f"softmax_blocks must be a sequence of block indices, got {softmax_blocks!r}")
    indices = list(softmax_blocks)
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"softmax_blocks must hold int block indices, got {index!r} in {indices}")
        if not 0 <= index < num_blocks:
            raise ValueError(f"softmax_blocks index {index} is out of range: expected 0 <= index < {num_blocks} "
                             f"(the model has {num_blocks} blocks)")
    duplicates = sorted({index for index in indices if indices.count(index) > 1})
    if duplicates:
        raise ValueError(f"softmax_blocks lists block indices {duplicates} more than once: {indices}")
    return tuple(sorted(indices))


def block_types(num_blocks: int, softmax_blocks: Iterable[int] = ()) -> Tuple[str, ...]:
    """Block type (a key of BLOCK_TYPES) of each block: 'softmax' for softmax_blocks, 'linear' for the rest."""
    softmax = set(resolve_softmax_blocks(softmax_blocks, num_blocks))
    return tuple('softmax' if index in softmax else 'linear' for index in range(num_blocks))


class BlockPlan:
    """``block_fn`` for VisionTransformer: block ``depth`` is built as ``BLOCK_TYPES[types[depth]]`` says.

    VisionTransformer passes every block the same ``attn_layer``; the plan replaces it by the layer of that
    block's type, resolved once here from the linear-attention options.
    """

    def __init__(self, types: Sequence[str], linear_options: Dict[str, Any]) -> None:
        self.types = tuple(types)
        self.layers = {name: BLOCK_TYPES[name].layer(linear_options) for name in set(self.types)}

    def __call__(self, *, depth: int, attn_layer: Any = None, **block_kwargs) -> Block:
        name = self.types[depth]
        return BLOCK_TYPES[name].block(depth=depth, attn_layer=self.layers[name], **block_kwargs)


def _reads_token_grid(module: nn.Module) -> bool:
    """Whether ``module`` reads the patch grid: local mixing, and attention families that declare ``token_grid``."""
    return isinstance(module, LocalMix) or (isinstance(module, LinearAttention) and type(module).family.token_grid)


@dataclass
class RecurrentState:
    """Where recurrent inference stands: ``position`` tokens fed (prefix tokens first), each block's attention
    state (``linvit.ops.CausalState``: [B, H, D, D + 1], whatever the position) and ``inputs`` [B, prefix + H * W, C],
    the prefix tokens and every position's embedding for the grid being read."""
    inputs: torch.Tensor
    position: int
    layers: List[Optional[CausalState]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.inputs.shape[1]


class LinearVisionTransformer(VisionTransformer):
    """timm's VisionTransformer with linear attention (optionally hybrid with softmax blocks).

    Everything of VisionTransformer's API is kept (forward_features, forward_head, forward_intermediates,
    prune_intermediate_layers, set_input_size, reset_classifier, ...); the forward paths also compute the patch
    grid of the image and pass it to each block, and reject image sizes the model cannot take with a ValueError.

    Args:
        attn_family: the attention family of the linear blocks (``linvit.list_attention_families()``; None:
            'linear').
        feature_map: feature map (a name in ``linvit.ops.FEATURE_MAPS``) of the families that use one.
        normalizer: a name in ``linvit.ops.NORMALIZERS`` (None: 'divide'), for the families that take one.
        attn_options: the family's own options (``ATTENTION_FAMILIES[attn_family].family.options``).
        local_mix: add the zero-initialised depthwise-conv branch on V over the patch grid (default: not causal).
        local_mix_kernel: odd kernel size of that branch.
        softmax_blocks: indices of blocks that keep timm's softmax Attention.
        causal: causal attention in every block (see the module docstring); forward_features(x, is_causal=True)
            does the same for one call.
        attn_backend: 'auto', 'triton' or 'torch' (``linvit.layers.LinearAttention``'s option of that name).
        **kwargs: VisionTransformer's arguments, except block_fn and attn_layer (chosen by the above).
    """

    def __init__(
            self,
            feature_map: Optional[str] = None,
            local_mix: Optional[bool] = None,
            local_mix_kernel: int = 3,
            softmax_blocks: Sequence[int] = (),
            attn_family: Optional[str] = None,
            attn_options: Optional[Dict[str, Any]] = None,
            causal: bool = False,
            attn_backend: str = 'auto',
            normalizer: Optional[str] = None,
            **kwargs,
    ) -> None:
        family, feature_map = resolve_family(attn_family, feature_map, DEFAULT_FEATURE_MAP)
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be True or False, got {causal!r}")
        if causal and local_mix:
            raise ValueError("causal=True needs local_mix=False: the local branch convolves over neighbouring "
                             "patches, later ones included")
        local_mix = not causal if local_mix is None else local_mix
        for name in ('block_fn', 'attn_layer'):
            if name in kwargs:
                raise ValueError(f"{name}={kwargs[name]!r}: linvit chooses blocks and attention from attn_family, "
                                 f"feature_map, local_mix and softmax_blocks")
        if not isinstance(local_mix, bool):
            raise ValueError(f"local_mix must be True or False, got {local_mix!r}")
        if local_mix and kwargs.get('patch_drop_rate', 0.) > 0:
            raise ValueError(f"patch_drop_rate={kwargs['patch_drop_rate']} drops patches from the grid that "
                             f"local_mix convolves over; use local_mix=False with patch dropout")
        types = block_types(kwargs.get('depth', 12), softmax_blocks)
        linear_options = dict(attn_family=family, feature_map=feature_map, local_mix=local_mix,
                              local_mix_kernel=local_mix_kernel, attn_backend=attn_backend,
                              **dict(attn_options or {}))
        if causal:
            linear_options['causal'] = True
        if normalizer is not None:
            linear_options['normalizer'] = normalizer
        attention_layer(**linear_options)  # unknown options fail here, naming them
        super().__init__(block_fn=BlockPlan(types, linear_options), **kwargs)
        self.attn_family = family
        self.feature_map = feature_map
        self.local_mix = local_mix
        self.causal = causal
        self.softmax_blocks = [index for index, name in enumerate(types) if name == 'softmax']
        self._set_token_layout()

    def _set_token_layout(self) -> None:
        """Give each module that reads the patch grid (local mixing, the families that declare ``token_grid``) the
        prefix-token count and the construction grid (its no-feat_size fallback)."""
        grid_size = self.patch_embed.grid_size
        for module in self.modules():
            if _reads_token_grid(module):
                module.num_prefix_tokens = self.num_prefix_tokens
                module.grid_size = None if grid_size is None else (int(grid_size[0]), int(grid_size[1]))

    def set_input_size(
            self,
            img_size: Optional[Tuple[int, int]] = None,
            patch_size: Optional[Tuple[int, int]] = None,
    ) -> None:
        """Change the construction image size / patch size (position embeddings are resampled by timm)."""
        super().set_input_size(img_size=img_size, patch_size=patch_size)
        self._set_token_layout()

    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
        """Images [B, C, H, W] -> tokens [B, prefix + H' * W', C'] and the patch grid [H', W']."""
        feat_size = patch_grid(x, self.patch_embed.patch_size, self.patch_embed.img_size,
                               self.patch_embed.strict_img_size, self.patch_embed.dynamic_img_pad)
        x = self.patch_embed(x)
        x = self._pos_embed(x)
        x = self.patch_drop(x)
        x = self.norm_pre(x)
        return x, feat_size

    def forward_features(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        """Images [B, C, H, W] -> normalised tokens [B, prefix + H' * W', C'] (H' = H / patch, rounded up if padded);
        causal in raster order when is_causal or the model is causal."""
        is_causal = causal_call(is_causal, self.causal)
        x, feat_size = self._embed(x)
        for blk in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, attn_mask, is_causal, feat_size)
            else:
                x = blk(x, attn_mask=attn_mask, is_causal=is_causal, feat_size=feat_size)
        return self.norm(x)

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            return_prefix_tokens: bool = False,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
            output_dict: bool = False,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]], Dict[str, Any]]:
        """Forward that also returns the outputs of the blocks selected by ``indices`` (timm's semantics).

        indices: the last n blocks if int, all if None, else these block indices. Intermediates are
        [B, C', H', W'] for output_fmt='NCHW' or [B, H' * W', C'] for 'NLC' (prefix tokens split off; with
        return_prefix_tokens each is paired with its [B, prefix, C'] tokens). Returns (final normalised tokens,
        intermediates), the intermediates only, or a dict with 'image_intermediates' (+ '_prefix') and
        'image_features'.
        """
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        is_causal = causal_call(is_causal, self.causal)
        x, feat_size = self._embed(x)
        blocks = self.blocks if torch.jit.is_scripting() or not stop_early else self.blocks[:max_index + 1]
        intermediates = []
        for i, blk in enumerate(blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, attn_mask, is_causal, feat_size)
            else:
                x = blk(x, attn_mask=attn_mask, is_causal=is_causal, feat_size=feat_size)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)

        npt = self.num_prefix_tokens
        prefix_tokens = [y[:, :npt] for y in intermediates] if npt else None
        intermediates = [y[:, npt:] for y in intermediates]
        if output_fmt == 'NCHW':
            batch = x.shape[0]
            intermediates = [y.reshape(batch, feat_size[0], feat_size[1], -1).permute(0, 3, 1, 2).contiguous()
                             for y in intermediates]

        if output_dict:
            result: Dict[str, Any] = {'image_intermediates': intermediates}
            if prefix_tokens is not None and return_prefix_tokens:
                result['image_intermediates_prefix'] = prefix_tokens
            if not intermediates_only:
                result['image_features'] = self.norm(x)
            return result
        if return_prefix_tokens and prefix_tokens is not None:
            intermediates = list(zip(intermediates, prefix_tokens))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    # ---- recurrent inference: the causal model as an RNN over patches in raster order

    @torch.jit.unused
    def recurrent_init(self, batch_size: int, feat_size: Optional[Sequence[int]] = None
                       ) -> Tuple[torch.Tensor, RecurrentState]:
        """Start reading (or generating) an image patch by patch: feeds the prefix tokens (class / register tokens)
        and returns their output features [B, prefix, C] (after the final norm, as forward_features) and the state.

        feat_size: the patch grid (H', W') of the image (position embeddings are resampled for it as for an image of
        that size; a fixed-size model takes only its own grid); default the model's grid. Every block must be
        linear; the model runs as it is (call ``eval()`` first for inference).
        """
        softmax = [i for i, blk in enumerate(self.blocks) if not isinstance(blk, LinearAttentionBlock)]
        if softmax:
            raise ValueError(f"recurrent inference needs linear attention in every block; blocks {softmax} use "
                             f"softmax attention")
        grid = tuple(int(g) for g in (feat_size if feat_size is not None else self.patch_embed.grid_size))
        if not self.dynamic_img_size and grid != tuple(self.patch_embed.grid_size):
            raise ValueError(f"this model takes only its {tuple(self.patch_embed.grid_size)} patch grid, got "
                             f"feat_size={grid}; create it with dynamic_img_size=True for other sizes")
        weight = self.patch_embed.proj.weight
        shape = (batch_size, grid[0], grid[1], self.embed_dim) if self.dynamic_img_size else \
            (batch_size, grid[0] * grid[1], self.embed_dim)
        # timm's own _pos_embed on zero patch tokens gives the prefix tokens and every position's embedding
        inputs = self._pos_embed(torch.zeros(shape, dtype=weight.dtype, device=weight.device))
        state = RecurrentState(inputs, 0, [None] * len(self.blocks))
        outputs = []
        for _ in range(self.num_prefix_tokens):
            out, state = self._recurrent_token(inputs[:, state.position], state)
            outputs.append(out)
        prefix = torch.stack(outputs, 1) if outputs else inputs.new_zeros(batch_size, 0, self.embed_dim)
        return prefix, state

    @torch.jit.unused
    def recurrent_step(self, patch: torch.Tensor, state: RecurrentState) -> Tuple[torch.Tensor, RecurrentState]:
        """Feed the next patch in raster order: patch [B, C_in, p, p] -> its output features [B, C] (equal to
        forward_features(image, is_causal=True)[:, prefix + t]) and the new state; the memory it holds does not
        grow with the number of patches fed."""
        ph, pw = self.patch_embed.patch_size
        expected = [state.inputs.shape[0], self.patch_embed.proj.in_channels, ph, pw]
        if list(patch.shape) != expected:
            raise ValueError(f"recurrent_step expects one patch per sample of shape {expected}, got "
                             f"{list(patch.shape)}")
        if state.position >= state.num_tokens:
            raise ValueError(f"every one of the {state.num_tokens - self.num_prefix_tokens} patches of the grid has "
                             f"been fed; start again with recurrent_init")
        token = self.patch_embed.norm(self.patch_embed.proj(patch).flatten(1))
        return self._recurrent_token(token + state.inputs[:, state.position], state)

    @torch.jit.unused
    def _recurrent_token(self, token: torch.Tensor, state: RecurrentState) -> Tuple[torch.Tensor, RecurrentState]:
        """One embedded token [B, C] through norm_pre, every block's recurrent step and the final norm."""
        x = self.norm_pre(token)
        layers = []
        for blk, layer_state in zip(self.blocks, state.layers):
            x, layer_state = blk.step(x, layer_state)
            layers.append(layer_state)
        return self.norm(x), RecurrentState(state.inputs, state.position + 1, layers)


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor],
                         model: LinearVisionTransformer) -> Dict[str, torch.Tensor]:
    """Adapt a linvit or timm softmax-ViT checkpoint to ``model`` (used for pretrained=True loading).

    timm's ViT filter runs first (unwraps 'model' / 'state_dict', resamples position embeddings to the model's
    grid and patch embeddings to its patch size, maps deit3 layer-scale names). A checkpoint without any
    linear-only tensor is a softmax checkpoint: the model keeps its initial (zero) local-mix tensors, which are
    logged by name, so the strict load still checks every other key. A linvit checkpoint must be complete.
    """
    out = vit_checkpoint_filter_fn(state_dict, model, adapt_layer_scale=True)
    linear_only = linear_only_parameter_names(model)
    if linear_only and not any(name in out for name in linear_only):
        own = model.state_dict()
        out.update({name: own[name] for name in linear_only})
        _logger.info("checkpoint without this model's linear-only tensors (a softmax ViT, or a linvit model without "
                     "them, e.g. causal): kept their initial values: %s", ', '.join(linear_only))
    return out


_WEIGHT_SOURCES = ('file', 'state_dict', 'url', 'hf_hub_id')


def _check_pretrained_source(variant: str, kwargs: Dict[str, Any]) -> None:
    """RuntimeError unless pretrained=True has weights to load (linvit publishes none); FileNotFoundError naming
    a local weights file that does not exist."""
    cfg = resolve_pretrained_cfg(variant, pretrained_cfg=kwargs.get('pretrained_cfg'),
                                 pretrained_cfg_overlay=kwargs.get('pretrained_cfg_overlay'))
    if not any(getattr(cfg, key, None) for key in _WEIGHT_SOURCES):
        raise RuntimeError(
            f"no pretrained weights are published for {variant}: use pretrained=False, or load local weights with "
            f"pretrained=True, pretrained_cfg_overlay=dict(file='weights.pth') (a linvit or timm softmax-ViT "
            f"checkpoint, .pth or .safetensors; position embeddings are resampled), or checkpoint_path='weights.pth' "
            f"(a linvit checkpoint of this exact model, loaded with or without pretrained=True)")
    if getattr(cfg, 'source', None) != 'local-dir':  # timm.create_model('local-dir:PATH'): a folder, timm reads it
        _check_file_exists(getattr(cfg, 'file', None), 'pretrained_cfg_overlay file')


def _check_file_exists(path: Optional[str], what: str) -> None:
    if path and not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path!r} does not exist (working directory {os.getcwd()!r})")


def _warn_ignored_overlay_file(variant: str, kwargs: Dict[str, Any]) -> None:
    """timm loads pretrained_cfg_overlay's weights only with pretrained=True; say so instead of silently ignoring."""
    overlay = kwargs.get('pretrained_cfg_overlay') or {}
    given = [key for key in ('file', 'state_dict') if overlay.get(key)]
    if given:
        warnings.warn(f"{variant}: pretrained_cfg_overlay {given[0]}= is ignored without pretrained=True (timm loads "
                      f"it only then), so the model keeps random weights; pass pretrained=True to load it",
                      UserWarning, stacklevel=user_stacklevel())


def _create_linvit(variant: str, pretrained: bool = False, **kwargs) -> LinearVisionTransformer:
    if pretrained:
        _check_pretrained_source(variant, kwargs)
    else:
        _warn_ignored_overlay_file(variant, kwargs)
    feature_cfg = features_only_cfg(variant, kwargs)  # the plain names: timm's ViT; '.pyramid': the pyramid
    return build_model_with_cfg(
        LinearVisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=feature_cfg,
        **kwargs,
    )


def _cfg(**kwargs) -> Dict[str, Any]:
    # no url / hf_hub_id: there are no published weights (pretrained=True needs a local file)
    return {
        'num_classes': 1000,
        'input_size': (3, 224, 224),
        'pool_size': None,
        'crop_pct': 0.9,
        'interpolation': 'bicubic',
        'fixed_input_size': True,
        'mean': IMAGENET_INCEPTION_MEAN,
        'std': IMAGENET_INCEPTION_STD,
        'first_conv': 'patch_embed.proj',
        'classifier': 'head',
        'license': 'apache-2.0',
        **kwargs,
    }


_PLAIN_CFGS = {
    'linvit_tiny_patch16_224': _cfg(),
    'linvit_small_patch16_224': _cfg(),
    'linvit_base_patch16_224': _cfg(),
    # high-resolution defaults: dynamic_img_size=True, so any size (non-square too) is accepted
    'linvit_small_patch16_512': _cfg(input_size=(3, 512, 512), crop_pct=1.0, fixed_input_size=False),
    'linvit_base_patch16_1024': _cfg(input_size=(3, 1024, 1024), crop_pct=1.0, fixed_input_size=False),
}
# every name also as 'name.pyramid', the same model whose features_only form is the simple feature pyramid
# (linvit.models.feature_net); listed after the plain cfgs, so that the plain cfg stays each name's default
default_cfgs = generate_default_cfgs({
    **_PLAIN_CFGS,
    **{f'{name}.{PYRAMID_TAG}': dict(cfg, description=PYRAMID_DESCRIPTION) for name, cfg in _PLAIN_CFGS.items()},
})


def _tiny(**kwargs) -> Dict[str, Any]:
    return dict(patch_size=16, embed_dim=192, depth=12, num_heads=3, **kwargs)


def _small(**kwargs) -> Dict[str, Any]:
    return dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, **kwargs)


def _base(**kwargs) -> Dict[str, Any]:
    return dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, **kwargs)


@register_model
def linvit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> LinearVisionTransformer:
    """linvit-Tiny/16 at 224 px: ViT-Ti/16 widths (192 wide, 12 blocks, 3 heads) with linear attention."""
    return _create_linvit('linvit_tiny_patch16_224', pretrained, **dict(_tiny(), **kwargs))


@register_model
def linvit_small_patch16_224(pretrained: bool = False, **kwargs) -> LinearVisionTransformer:
    """linvit-Small/16 at 224 px: ViT-S/16 widths (384 wide, 12 blocks, 6 heads) with linear attention."""
    return _create_linvit('linvit_small_patch16_224', pretrained, **dict(_small(), **kwargs))


@register_model
def linvit_base_patch16_224(pretrained: bool = False, **kwargs) -> LinearVisionTransformer:
    """linvit-Base/16 at 224 px: ViT-B/16 widths (768 wide, 12 blocks, 12 heads) with linear attention."""
    return _create_linvit('linvit_base_patch16_224', pretrained, **dict(_base(), **kwargs))


@register_model
def linvit_small_patch16_512(pretrained: bool = False, **kwargs) -> LinearVisionTransformer:
    """linvit-Small/16 for large images: 512 px default (32x32 grid), dynamic_img_size=True."""
    return _create_linvit('linvit_small_patch16_512', pretrained,
                          **dict(_small(img_size=512, dynamic_img_size=True), **kwargs))


@register_model
def linvit_base_patch16_1024(pretrained: bool = False, **kwargs) -> LinearVisionTransformer:
    """linvit-Base/16 for large images: 1024 px default (64x64 grid), dynamic_img_size=True."""
    return _create_linvit('linvit_base_patch16_1024', pretrained,
                          **dict(_base(img_size=1024, dynamic_img_size=True), **kwargs))
