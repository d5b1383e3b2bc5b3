"""Turn a timm softmax model into linear attention, in place.

Works on every model whose token mixing is timm's ``Attention`` (``VisionTransformer`` and its subclasses:
vit_*, deit_*, deit3_*, with class / register / distillation tokens, qk_norm, layer scale, gating) or the RoPE
attention of timm's Eva family (``EvaAttention``, ``AttentionRope``: EVA02, DINOv3, Perception Encoder, the RoPE
ViTs). Each becomes a ``LinearAttention`` (an ``EvaLinearAttention`` for the Eva layouts) that holds the very same
submodules (qkv or q/k/v projections and biases, q_norm, k_norm, norm, gate, proj), so every pretrained tensor is
kept bit for bit and the state_dict keys do not change; only the optional local-mix branch adds tensors
(``<path>.local_mix.conv.weight/bias``, zero-initialised). The rotary embeddings the Eva models pass turn the
mapped queries and keys (``linvit.ops.rotary``). BEiT's and SAM's attention are refused with the reason
(``REFUSED_ATTENTION``).

A converted model is also a registered timm model, ``converted_to_linear``: ``timm.create_model(
'converted_to_linear', base='vit_small_patch16_dinov3', convert={'feature_map': 'hedgehog'}, num_classes=10)``
builds ``base`` with the other keywords and converts it, and ``pretrained=True`` then loads that model's own weights
(a ``local-dir:`` / ``hf-hub:`` folder whose config.json names the architecture: how linvit.engine.hub publishes a
linearization that no ``linvit_*`` model rebuilds).

Limitation: the host model's forward does not pass the patch grid to its blocks, so a converted model's local-mix
branch finds the grid from the model's construction grid (``patch_embed.grid_size``) or a square token count.
Non-square inputs of another size (``dynamic_img_size=True``) then raise a ValueError; for those, load the
converted (or the original) weights into the ``linvit_*`` model of the same width, which passes the grid.
"""
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import timm
import torch.nn as nn
from timm.layers import Attention, AttentionPoolLatent, AttentionPoolPrr, AttentionRope
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.beit import Attention as BeitAttention
from timm.models.eva import EvaAttention
from timm.models.vision_transformer import DiffParallelScalingBlock, ParallelScalingBlock
from timm.models.vision_transformer_sam import Attention as SamAttention

from ..layers import LinearAttention, LocalMix, attention_layer
from ..layers.eva_attention import EvaLinearAttention
from ..layers.family import family_class, resolve_family
from ..ops import feature_map_spec
from .linvit import resolve_softmax_blocks

__all__ = ['convert_to_linear', 'linear_attention_from_softmax', 'attention_sites', 'converted_to_linear',
           'CONVERTIBLE_ATTENTION', 'REFUSED_ATTENTION']

_logger = logging.getLogger(__name__)

# Attention-like modules left as they are: already linear, or pooling through a few learned queries (O(N) already)
_KEPT_AS_IS = (LinearAttention, AttentionPoolLatent, AttentionPoolPrr)
# LinearAttention has timm Attention's submodules under the same names; these are moved over, not copied
_SHARED_SUBMODULES = ('qkv', 'q_norm', 'k_norm', 'norm', 'gate', 'proj', 'proj_drop')
#: the softmax attention classes conversion turns into linear attention (exact types: a subclass may compute more)
CONVERTIBLE_ATTENTION = (Attention, EvaAttention, AttentionRope)
_FUSED_BLOCK = ("this block computes attention and its MLP from one fused projection (in_proj) and holds no attention "
                "module to replace; convert a ViT whose blocks hold their own attention")
#: attention that conversion refuses (no well-defined linear form, or no attention module to replace), with the reason
REFUSED_ATTENTION = {
    ParallelScalingBlock: _FUSED_BLOCK,
    DiffParallelScalingBlock: _FUSED_BLOCK,
    BeitAttention: "BEiT adds a learned relative position bias to every query-key logit, an N x N term that linear "
                   "attention cannot factor; train a linvit_* or convert a ViT without it",
    SamAttention: "SAM's ViT attends inside 14 x 14 windows with decomposed relative position terms in most blocks; "
                  "windowed attention is already linear in the image size, and the relative terms have no linear "
                  "form",
}


def _qualified_name(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _is_other_attention(path: str, module: nn.Module) -> bool:
    """For a module that is not timm's exact ``Attention``: True for attention that conversion does not support, a
    block's ``attn`` child or an *Attention / *Attn / Attention* class that is not in _KEPT_AS_IS."""
    if isinstance(module, _KEPT_AS_IS):
        return False
    name = type(module).__name__
    return path.rsplit('.', 1)[-1] == 'attn' or name.endswith(('Attention', 'Attn')) or name.startswith('Attention')


def attention_sites(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(path, module) of every timm ``Attention`` and ``LinearAttention`` in ``model``, in module order.

    Raises ValueError naming the first other attention module (e.g. DiffAttention, Swin's WindowAttention, BEiT's
    Attention, a ParallelScalingBlock) and why: converting only some of a model's attention would hide softmax cost.
    """
    sites = []
    for path, module in model.named_modules():
        if type(module) in CONVERTIBLE_ATTENTION or isinstance(module, LinearAttention):
            sites.append((path, module))
        elif type(module) in REFUSED_ATTENTION:
            raise ValueError(f"convert_to_linear cannot convert {path or '<model>'} ({_qualified_name(module)}): "
                             f"{REFUSED_ATTENTION[type(module)]}")
        elif _is_other_attention(path, module):
            raise ValueError(f"convert_to_linear cannot convert {path or '<model>'} ({_qualified_name(module)}): "
                             f"supported are timm.layers.Attention (VisionTransformer) and the Eva family's "
                             f"EvaAttention / AttentionRope")
    return sites


def linear_attention_from_softmax(
        attn: Attention,
        feature_map: str = 'elu1',
        local_mix: bool = False,
        local_mix_kernel: int = 3,
        num_prefix_tokens: int = 1,
        grid_size: Optional[Tuple[int, int]] = None,
        attn_family: str = 'linear',
        attn_options: Optional[Dict[str, Any]] = None,
) -> LinearAttention:
    """A LinearAttention (or a layer of another ``attn_family`` of ``linvit.ATTENTION_FAMILIES``, with its
    ``attn_options``) that holds ``attn``'s own submodules (same tensors, device, dtype, requires_grad).

    ``attn`` must be exactly ``timm.layers.Attention`` with attention dropout 0. The optional local-mix branch is
    new: zero-initialised, on ``attn``'s device and dtype, with the given token layout (see ``LocalMix``); so are
    the tensors the family declares (``FamilySpec.tensors``: the gated family's gates, Performer's random
    features), freshly initialised.
    """
    if type(attn) in (EvaAttention, AttentionRope):
        return _eva_linear_attention(attn, feature_map, local_mix, local_mix_kernel, grid_size, attn_family,
                                     attn_options)
    if type(attn) is not Attention:
        raise ValueError(f"expected timm.layers.Attention, got {_qualified_name(attn)}")
    if attn.attn_drop.p > 0:
        raise ValueError(f"attention dropout p={attn.attn_drop.p}: linear attention forms no attention matrix to "
                         f"drop out; create the model with attn_drop_rate=0")
    weight = attn.qkv.weight
    cls = family_class(attn_family)
    options = dict(attn_options or {})
    if cls.family.token_grid:
        options.update(num_prefix_tokens=num_prefix_tokens, grid_size=grid_size)
    # a family that declares no tensors of its own (plain linear attention, ...) gets its shell built on the meta
    # device: every tensor is then attn's own submodule; the others build theirs where attn lives
    own_tensors = cls.family.tensors or feature_map_spec(feature_map or 'elu1').learnable
    placement = dict(device='meta') if not own_tensors else dict(device=weight.device, dtype=weight.dtype)
    linear = cls(
        attn.qkv.in_features,
        num_heads=attn.num_heads,
        attn_head_dim=attn.head_dim,
        dim_out=attn.proj.out_features,
        qkv_bias=attn.qkv.bias is not None,
        proj_bias=attn.proj.bias is not None,
        gated=attn.gate is not None,
        proj_drop=attn.proj_drop.p,
        feature_map=feature_map or 'elu1',
        **placement,
        **options,
    )
    for name in _SHARED_SUBMODULES:
        if name == 'gate' and attn.gate is None and linear.gate is not None:
            continue  # the gated family's own output gate, which the softmax layer did not have
        setattr(linear, name, getattr(attn, name))
    if local_mix:
        linear.local_mix = LocalMix(linear.attn_dim, local_mix_kernel, num_prefix_tokens, grid_size,
                                    device=weight.device, dtype=weight.dtype)
    return linear.train(attn.training)


def _eva_linear_attention(attn: nn.Module, feature_map: Optional[str], local_mix: bool, local_mix_kernel: int,
                          grid_size: Optional[Tuple[int, int]], attn_family: str,
                          attn_options: Optional[Dict[str, Any]]) -> EvaLinearAttention:
    """An EvaLinearAttention holding ``attn``'s tensors (timm's EvaAttention or AttentionRope), with its prefix-token
    count and rotary layout (``rotate_half``)."""
    if attn_family != 'linear':
        raise ValueError(f"attn_family={attn_family!r}: {type(attn).__name__} (rotary position embeddings) converts to "
                         f"attn_family='linear', the family with a rotary form")
    if attn.attn_drop.p > 0:
        raise ValueError(f"attention dropout p={attn.attn_drop.p}: linear attention forms no attention matrix to "
                         f"drop out; create the model with attn_drop_rate=0")
    weight = attn.proj.weight
    map_name = feature_map or 'elu1'
    placement = dict(device=weight.device, dtype=weight.dtype) if feature_map_spec(map_name).learnable \
        else dict(device='meta')
    linear = EvaLinearAttention(
        (attn.qkv if attn.qkv is not None else attn.q_proj).in_features,
        num_heads=attn.num_heads,
        attn_head_dim=attn.head_dim,
        dim_out=attn.proj.out_features,
        proj_drop=attn.proj_drop.p,
        feature_map=map_name,
        num_prefix_tokens=attn.num_prefix_tokens,
        grid_size=grid_size,
        rotate_half=bool(getattr(attn, 'rotate_half', False)),
        **placement,
        **dict(attn_options or {}),
    ).adopt(attn)
    if local_mix:
        linear.local_mix = LocalMix(linear.attn_dim, local_mix_kernel, attn.num_prefix_tokens, grid_size,
                                    device=weight.device, dtype=weight.dtype)
    return linear.train(attn.training)


def _token_layout(model: nn.Module, needed_by: str = 'local_mix') -> Tuple[int, Tuple[int, int]]:
    """(num_prefix_tokens, patch grid) of a ViT-like model, which local mixing and low-rank attention need;
    ValueError if it has none."""
    num_prefix_tokens = getattr(model, 'num_prefix_tokens', None)
    grid_size = getattr(getattr(model, 'patch_embed', None), 'grid_size', None)
    if num_prefix_tokens is None or grid_size is None:
        raise ValueError(f"{needed_by} needs the token layout, but {type(model).__name__} has no num_prefix_tokens "
                         f"and patch_embed.grid_size")
    if getattr(model, 'dynamic_img_size', False):
        _logger.warning("%s on a converted %s finds the patch grid from grid_size %s or a square token count; "
                        "other non-square sizes raise. Load the weights into a linvit_* model for those.",
                        needed_by, type(model).__name__, tuple(grid_size))
    return int(num_prefix_tokens), (int(grid_size[0]), int(grid_size[1]))


def convert_to_linear(
        model: nn.Module,
        feature_map: Optional[str] = None,
        local_mix: bool = False,
        local_mix_kernel: int = 3,
        softmax_blocks: Sequence[int] = (),
        attn_family: Optional[str] = None,
        attn_options: Optional[Dict[str, Any]] = None,
        attn_backend: str = 'auto',
) -> nn.Module:
    """Replace the softmax attention of a timm model by linear attention, in place; returns ``model``.

    Args:
        model: a timm model whose attention is ``timm.layers.Attention`` (vit_*, deit_*, deit3_*, ...).
        attn_family: the attention family (``linvit.list_attention_families()``: 'linear', 'performer',
            'linformer', 'gated', 'aft', 'bidirectional'); default 'linear'.
        feature_map: feature map name from ``linvit.ops.FEATURE_MAPS`` (default 'elu1') of the families that use one.
        attn_options: the family's own options (``ATTENTION_FAMILIES[attn_family].family.options``), e.g.
            {'low_rank_size': 8}.
        attn_backend: 'auto', 'triton' or 'torch': who computes plain linear attention (``linvit.ops.ATTN_BACKENDS``).
        local_mix: add the zero-initialised depthwise-conv branch (see the module docstring for its grid). Off by
            default, unlike the ``linvit_*`` models: a converted model's forward does not pass the patch grid, so
            the branch only works at the construction grid or square grids.
        local_mix_kernel: its odd kernel size.
        softmax_blocks: indices of attention modules, counted in module order (the block index for
            VisionTransformer), that keep softmax attention. Out-of-range or repeated indices: ValueError.

    Every existing tensor stays the same object; the converted model's state_dict has the original keys plus
    ``*.local_mix.conv.*`` when local_mix. Modules that are already LinearAttention are left as they are.
    Raises ValueError naming the module for models with other attention (or none at all).
    """
    family, feature_map = resolve_family(attn_family, feature_map)
    attn_options = {**dict(attn_options or {}), 'attn_backend': attn_backend}
    attention_layer(family, **attn_options)  # unknown options fail before anything changes
    if not isinstance(local_mix, bool):
        raise ValueError(f"local_mix must be True or False, got {local_mix!r}")
    sites = attention_sites(model)
    if not sites:
        raise ValueError(f"convert_to_linear found no timm.layers.Attention in {_qualified_name(model)}: "
                         f"nothing to convert")
    keep_softmax = set(resolve_softmax_blocks(softmax_blocks, len(sites)))
    needs_grid = local_mix or family_class(family).family.token_grid
    num_prefix_tokens, grid_size = _token_layout(model, 'local_mix' if local_mix else family) if needs_grid \
        else (0, None)
    # every replacement is built (and every error raised) before the first one is put in: a failed conversion
    # leaves the model as it was
    replacements = []
    for index, (path, attn) in enumerate(sites):
        if isinstance(attn, LinearAttention):
            if index in keep_softmax:
                raise ValueError(f"softmax_blocks index {index} ({path}) is already linear attention; "
                                 f"conversion cannot restore softmax attention")
            continue
        if index in keep_softmax:
            continue
        if not path:
            raise ValueError("convert_to_linear converts attention inside a model; the model itself is an "
                             "Attention, use linear_attention_from_softmax")
        try:
            linear = linear_attention_from_softmax(attn, feature_map, local_mix, local_mix_kernel,
                                                   num_prefix_tokens, grid_size, family, attn_options)
        except ValueError as error:
            raise ValueError(f"convert_to_linear cannot convert {path}: {error}") from error
        replacements.append((path, linear))
    for path, linear in replacements:
        model.set_submodule(path, linear)
    return model


# ---------------------------------------------------------------------------------------------------- as a timm model

default_cfgs = generate_default_cfgs({
    # no weights of its own: pretrained=True loads a folder's (local-dir: / hf-hub:), whose config replaces this one
    'converted_to_linear': {'num_classes': 1000, 'input_size': (3, 224, 224), 'license': None},
})


def _convert_base(base: str, convert: Dict[str, Any]) -> Any:
    """The model class build_model_with_cfg calls: keywords -> timm's ``base`` with them, converted."""
    def build(**kwargs: Any) -> nn.Module:
        return convert_to_linear(timm.create_model(base, **kwargs), **convert)
    return build


@register_model
def converted_to_linear(pretrained: bool = False, base: Optional[str] = None,
                        convert: Optional[Dict[str, Any]] = None, **kwargs: Any) -> nn.Module:
    """timm's softmax model ``base`` built with ``kwargs`` (num_classes, img_size, ...) and converted by
    ``convert_to_linear(model, **convert)``; ``pretrained``: then load the weights of the converted model from the
    pretrained config (a ``local-dir:`` or ``hf-hub:`` folder, or ``pretrained_cfg_overlay=dict(file=...)``)."""
    if not base or not timm.is_model(base):
        raise ValueError(f"converted_to_linear needs base=<the timm model it converts>, got base={base!r}")
    return build_model_with_cfg(_convert_base(base, dict(convert or {})), 'converted_to_linear', pretrained,
                                **kwargs)
