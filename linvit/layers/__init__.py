"""nn.Modules built on linvit.ops: drop-ins for timm's attention (one module per attention family, each declaring
itself once: ``linvit.layers.family``) and their optional branches."""
from .families import (
    AFTAttention,
    BidirectionalAttention,
    GatedLinearAttention,
    LinformerAttention,
    PerformerAttention,
    attention_layer,
    redraw_random_features,
)
from .family import (
    ATTENTION_FAMILIES,
    FamilySpec,
    list_attention_families,
    register_family,
    resolve_family,
    unregister_family,
)
from .feature_map import HedgehogFeatureMap, LearnableFeatureMap
from .linear_attention import LinearAttention, attn_mask_to_key_mask, linear_attention_layer
from .local_mix import LocalMix, resolve_token_grid
from .no_mixing import NoMixingAttention, make_floor
from .weights import linear_only_parameter_names, load_softmax_state_dict

__all__ = ['LinearAttention', 'linear_attention_layer', 'LocalMix', 'attn_mask_to_key_mask',
           'resolve_token_grid', 'load_softmax_state_dict', 'linear_only_parameter_names', 'NoMixingAttention',
           'ATTENTION_FAMILIES', 'FamilySpec', 'register_family', 'unregister_family', 'list_attention_families',
           'resolve_family', 'PerformerAttention', 'LinformerAttention', 'GatedLinearAttention', 'AFTAttention',
           'BidirectionalAttention', 'attention_layer', 'redraw_random_features', 'make_floor', 'LearnableFeatureMap',
           'HedgehogFeatureMap']
