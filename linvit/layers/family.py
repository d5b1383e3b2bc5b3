"""The attention family as a declaration: what a family states once, and the one registry that names the families.

An attention family is the token-mixing algorithm of a linear block (``linear``, ``performer``, ``linformer``,
``gated``, ``aft``, ``bidirectional``, ...). Each is a ``LinearAttention`` subclass in its own module that declares
itself in its class body and registers itself on import::

    @register_family
    class PerformerAttention(LinearAttention):
        family = FamilySpec('performer', options={'num_features': None, 'orthogonal': True},
                            tensors=('projection',))

Everything that needs to know about a family reads that declaration and nothing else: option checking
(``attention_layer``), the models' and ``convert_to_linear``'s ``attn_family`` / ``feature_map`` arguments
(``resolve_family``), conversion, softmax-checkpoint loading (``linvit.layers.weights``) and ``print(model)``.
"""
import inspect
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

import torch
import torch.nn as nn

from ..ops import feature_map_spec, list_feature_maps
from ..registry import Registry

__all__ = ['FamilySpec', 'ATTENTION_FAMILIES', 'register_family', 'unregister_family', 'list_attention_families',
           'family_class', 'resolve_family', 'declared_state_keys']


@dataclass(frozen=True)
class FamilySpec:
    """What an attention family declares once, as the class attribute ``family`` of its layer.

    name: its name in ``ATTENTION_FAMILIES`` (the value of ``attn_family``).
    options: its own constructor options beyond LinearAttention's, name -> default (``attn_options``). The layer
        keeps each as an attribute of the same name (``print(model)`` shows them from there), and its constructor
        takes each as a keyword with exactly this default (``register_family`` checks both).
    feature_map: whether its mixing uses a feature map (``feature_map`` applies to it).
    causal: whether it has a causal form (``causal=True``, ``forward(..., is_causal=True)``, ``step``).
    tensors: the state-dict entries it adds beyond timm's ``Attention``, as attribute names of the layer: a module
        stands for all its entries (``'key_gate'`` -> ``key_gate.weight``, ``key_gate.bias``), a buffer or parameter
        for its own key (``'projection'``). An attribute that is None adds nothing, so an optional branch (a gate
        built only with some option) is declared like any other. A softmax checkpoint lacks these tensors: loading
        one keeps their initial values.
    state: whether its mixing has the state form (``attention_state`` / ``attend_state``: the keys summed into a
        state that adds up over parts of the tokens, then applied to the queries), which bounded-memory inference
        (``linvit.models.bounded``) needs.
    rotary: whether its mixing takes rotary position embeddings (``forward(x, rope=...)``, as timm's RoPE models
        pass them: DINOv3, EVA02, PE), which converting those models needs (``linvit.ops.rotary``).
    normalizer: whether its mixing takes the ``normalizer`` option (``linvit.ops.NORMALIZERS``) beyond the default
        'divide'.
    token_grid: whether its mixing reads the patch grid; the layer then keeps ``num_prefix_tokens`` and
        ``grid_size`` (its fallback without ``feat_size``), which linvit models and ``convert_to_linear`` fill in.
    """
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    feature_map: bool = False
    causal: bool = False
    tensors: Tuple[str, ...] = ()
    token_grid: bool = False
    state: bool = False
    rotary: bool = False
    normalizer: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"an attention family's name must be an identifier, got {self.name!r}")
        # read-only copies: a declaration cannot change after the class is defined
        object.__setattr__(self, 'options', MappingProxyType(dict(self.options)))
        object.__setattr__(self, 'tensors', tuple(self.tensors))


#: attention family name -> layer class (a ``LinearAttention`` subclass declaring ``family = FamilySpec(...)``);
#: filled by ``register_family`` when ``linvit.layers`` is imported
ATTENTION_FAMILIES: Registry[Type[nn.Module]] = Registry('attn_family')


def _constructor_parameters(cls: type) -> Dict[str, inspect.Parameter]:
    """The keyword parameters of ``cls(dim, ...)``, without dim and ``**kwargs``."""
    parameters = list(inspect.signature(cls).parameters.values())[1:]
    return {p.name: p for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _check_declared_options(cls: type, spec: FamilySpec) -> None:
    """TypeError unless the constructor takes exactly the declared options, with the declared defaults (a family
    whose constructor passes ``**kwargs`` on to LinearAttention; the plain family's own arguments are the base's).
    A constructor that shows no named parameter (wrapped as ``(*args, **kwargs)``) cannot be read and is not
    checked."""
    parameters = _constructor_parameters(cls)
    if not parameters:
        return
    for name, default in spec.options.items():
        if name not in parameters or parameters[name].default != default:
            found = 'no such keyword' if name not in parameters else f"default {parameters[name].default!r}"
            raise TypeError(f"{cls.__name__} declares option {name}={default!r} in its FamilySpec, but its "
                            f"constructor has {found}")
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values())
    undeclared = sorted(set(parameters) - set(spec.options)) if takes_kwargs else []
    if undeclared:
        raise TypeError(f"{cls.__name__}'s constructor takes {undeclared}, which its FamilySpec does not declare "
                        f"(add them to options)")


def register_family(cls: type) -> type:
    """Class decorator: put ``cls`` (which declares ``family = FamilySpec(...)`` in its own body) into
    ``ATTENTION_FAMILIES`` under ``cls.family.name``; returns ``cls``. ValueError if another class has that name."""
    spec = cls.__dict__.get('family')
    if not isinstance(spec, FamilySpec):
        raise TypeError(f"{cls.__name__} must declare its attention family in its class body: "
                        f"family = FamilySpec(name, ...)")
    _check_declared_options(cls, spec)
    return ATTENTION_FAMILIES.register(spec.name, cls)


def unregister_family(name: str) -> None:
    """Remove family ``name`` from ``ATTENTION_FAMILIES`` (e.g. a family a test registered); ValueError if unknown."""
    ATTENTION_FAMILIES.unregister(name)


def list_attention_families() -> List[str]:
    """Every name ``attn_family`` accepts, in registration order ('linear' first)."""
    return ATTENTION_FAMILIES.names()


def family_class(attn_family: str) -> Type[nn.Module]:
    """The layer class of ``attn_family``; ValueError naming the known families if there is none."""
    if attn_family not in ATTENTION_FAMILIES and attn_family in list_feature_maps():
        hint = f"{attn_family!r} is a feature map: attn_family='linear', feature_map={attn_family!r}"
        raise ValueError(ATTENTION_FAMILIES.unknown_message(attn_family, hint))
    return ATTENTION_FAMILIES.get(attn_family)


def _checked_feature_map(feature_map: Optional[str], default: str) -> str:
    name = feature_map or default
    feature_map_spec(name)  # unknown names: a ValueError naming the closest and the known maps
    return name


def resolve_family(attn_family: Optional[str], feature_map: Optional[str],
                   default_feature_map: str = 'elu1') -> Tuple[str, Optional[str]]:
    """(family, feature map or None) from the ``attn_family`` and ``feature_map`` arguments.

    attn_family: a name in ``ATTENTION_FAMILIES`` (None: 'linear'). feature_map: for the families that declare
    one (None: ``default_feature_map``); passing one to a family without raises ValueError, as do unknown names.
    """
    family = 'linear' if attn_family is None else attn_family
    spec = family_class(family).family
    if spec.feature_map:
        return family, _checked_feature_map(feature_map, default_feature_map)
    if feature_map is not None:
        raise ValueError(f"attn_family={family!r} uses no feature map; drop feature_map={feature_map!r}")
    return family, None


def declared_state_keys(module: nn.Module, names: Tuple[str, ...]) -> List[str]:
    """State-dict keys (relative to ``module``) of the attributes ``names`` that ``module`` declares as its own:
    all entries of a submodule, the key of a tensor, nothing for None (a branch that was not built)."""
    keys: List[str] = []
    for name in names:
        if not hasattr(module, name):
            raise AttributeError(f"{type(module).__name__} declares the tensor {name!r}, but has no attribute "
                                 f"of that name")
        value = getattr(module, name)
        if isinstance(value, nn.Module):
            keys.extend(f"{name}.{key}" for key in value.state_dict())
        elif isinstance(value, torch.Tensor):
            keys.append(name)
        elif value is not None:
            raise TypeError(f"{type(module).__name__}.{name} is declared as a tensor but is a "
                            f"{type(value).__name__}")
    return keys
