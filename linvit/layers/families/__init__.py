"""Every attention family linvit offers, one module each, as drop-ins for ``timm.layers.Attention``; importing this
package registers them in ``ATTENTION_FAMILIES`` (plain ``linear`` is ``LinearAttention`` itself).

Each family subclasses ``LinearAttention``, replaces only its token mixing (``mix``) and declares itself once in its
class body (``linvit.layers.family.FamilySpec``): the qkv projection, the optional q/k norms, local mixing, output
norm and gate and the output projection stay timm's, with timm's parameter names, so a softmax checkpoint loads into
any of them (the family's declared tensors keep their initial values).

    layer = attention_layer('performer', num_features=128)(dim=384, num_heads=6)
    model = timm.create_model('linvit_small_patch16_224', attn_family='linformer', attn_options={'low_rank_size': 8})

| attn_family | mixing | cost per block | own tensors |
|---|---|---|---|
| linear (feature_map: elu1, relu, focused) | phi(q)(phi(k)^T v) / normaliser | O(N d^2) | none |
| performer | FAVOR+ random features ~ softmax | O(N m d) | buffer ``projection`` [m, d] |
| linformer | softmax over keys/values pooled to r x r | O(N r^2 d) | none |
| gated | linear attention, keys gated per token and channel, output gated | O(N d^2) | ``key_gate``, ``gate`` |
| aft | sigmoid(q) * sum_n softmax_n(k) v_n (AFT-simple) | O(N C) | none |
| bidirectional | linear attention weighted by decay^distance, forward + backward scans | O(N d^2) | ``scan_gate`` |

Adding a family is one module here (a ``LinearAttention`` subclass with ``family = FamilySpec(...)`` and
``@register_family``), imported below, plus its test file.
"""
from typing import Any, Dict, Tuple, Type

from ...deprecation import module_getattr, warn_renamed
from ...ops import list_feature_maps
from ..family import ATTENTION_FAMILIES, attention_kinds_list, family_class, resolve_attn_kernel
from ..linear_attention import LINEAR_OPTIONS, LinearAttention, configured_layer
from .aft import AFTAttention
from .bidirectional import BidirectionalAttention
from .gated import GatedLinearAttention
from .linformer import LinformerAttention
from .performer import PerformerAttention, redraw_random_features

__all__ = ['PerformerAttention', 'LinformerAttention', 'GatedLinearAttention', 'AFTAttention',
           'BidirectionalAttention', 'attention_layer', 'redraw_random_features']


def attention_layer(attn_family: str = 'linear', **options: Any) -> Type[LinearAttention]:
    """A subclass of ``ATTENTION_FAMILIES[attn_family]`` whose options default to ``options`` (timm's blocks take the
    attention as a class): LinearAttention's options (feature_map, eps, local_mix, ...) and the options the family
    declares (``FamilySpec.options``). Unknown families and options raise ValueError."""
    if 'family' in options:
        warn_renamed('attention_layer(family=...)', 'attention_layer(attn_family=...)')
        attn_family = options.pop('family')
    cls = family_class(attn_family)
    allowed = LINEAR_OPTIONS + tuple(cls.family.options)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {attn_family} attention options {unknown}; known: {list(allowed)}")
    if options.get('feature_map') is not None and options['feature_map'] not in list_feature_maps():
        raise ValueError(f"unknown feature map {options['feature_map']!r}; known: {list_feature_maps()}")
    defaults = {k: v for k, v in options.items() if not (k == 'feature_map' and v is None)}
    return configured_layer(cls, defaults)


def _family_options() -> Dict[str, Tuple[str, ...]]:
    return {name: tuple(cls.family.options) for name, cls in ATTENTION_FAMILIES.items()}


def _families_with_feature_map() -> Tuple[str, ...]:
    return tuple(name for name, cls in ATTENTION_FAMILIES.items() if cls.family.feature_map)


# old public names: each warns (FutureWarning) naming the new one, and keeps its old meaning
_RENAMED = {
    'LowRankAttention': ('LinformerAttention', lambda: LinformerAttention),
    'list_attention_kinds': ('linvit.list_attention_families', lambda: attention_kinds_list),
    'resolve_attention_kind': ('linvit.layers.resolve_family', lambda: resolve_attn_kernel),
    'FAMILY_OPTIONS': ('linvit.ATTENTION_FAMILIES[name].family.options', _family_options),
    'FAMILIES_WITH_FEATURE_MAP': ('linvit.ATTENTION_FAMILIES[name].family.feature_map', _families_with_feature_map),
}


def __getattr__(name: str) -> Any:
    return module_getattr(__name__, _RENAMED, name)
