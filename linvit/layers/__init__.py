"""nn.Modules built on linvit.ops: drop-ins for timm's attention and their optional branches."""
from .families import (
    ATTENTION_FAMILIES,
    FAMILY_OPTIONS,
    AFTAttention,
    BidirectionalAttention,
    GatedLinearAttention,
    LowRankAttention,
    PerformerAttention,
    attention_layer,
    list_attention_kinds,
    redraw_random_features,
    resolve_attention_kind,
)
from .linear_attention import LinearAttention, attn_mask_to_key_mask, linear_attention_layer
from .local_mix import LocalMix, resolve_token_grid
from .no_mixing import NoMixingAttention
from .weights import load_softmax_state_dict

__all__ = ['LinearAttention', 'linear_attention_layer', 'LocalMix', 'attn_mask_to_key_mask',
           'resolve_token_grid', 'load_softmax_state_dict', 'NoMixingAttention', 'ATTENTION_FAMILIES',
           'FAMILY_OPTIONS', 'PerformerAttention', 'LowRankAttention', 'GatedLinearAttention', 'AFTAttention',
           'BidirectionalAttention',
           'attention_layer', 'list_attention_kinds', 'redraw_random_features', 'resolve_attention_kind']
