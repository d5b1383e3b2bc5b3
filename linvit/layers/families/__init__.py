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
``@register_family``) plus its test file: importing this package imports every module in it.
"""
import importlib
import pkgutil
from typing import Any, Type

from ...ops import feature_map_spec
from ..family import family_class
from ..linear_attention import LINEAR_OPTIONS, LinearAttention, configured_layer
from .aft import AFTAttention
from .bidirectional import BidirectionalAttention
from .gated import GatedLinearAttention
from .linformer import LinformerAttention
from .performer import PerformerAttention, redraw_random_features

__all__ = ['PerformerAttention', 'LinformerAttention', 'GatedLinearAttention', 'AFTAttention',
           'BidirectionalAttention', 'attention_layer', 'redraw_random_features']


def _import_every_family_module() -> None:
    """Import (and so register) every module of this package, the ones added after this file was written too."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_every_family_module()


def attention_layer(attn_family: str = 'linear', **options: Any) -> Type[LinearAttention]:
    """A subclass of ``ATTENTION_FAMILIES[attn_family]`` whose options default to ``options`` (timm's blocks take the
    attention as a class): LinearAttention's options (feature_map, eps, local_mix, ...) and the options the family
    declares (``FamilySpec.options``). Unknown families and options raise ValueError."""
    cls = family_class(attn_family)
    allowed = LINEAR_OPTIONS + tuple(cls.family.options)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {attn_family} attention options {unknown}; known: {list(allowed)}")
    if options.get('feature_map') is not None:
        feature_map_spec(options['feature_map'])  # unknown names: a ValueError naming the known maps
    defaults = {k: v for k, v in options.items() if not (k == 'feature_map' and v is None)}
    return configured_layer(cls, defaults)
