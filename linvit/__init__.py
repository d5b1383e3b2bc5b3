"""linvit: linear-attention Vision Transformers for large images, built on timm.

Public API:
    linvit.ops.linear_attention(q, k, v, feature_map='elu1', eps=1e-6, key_mask=None)   # [B, H, N, D] tensors
    linvit.LinearAttention(dim, num_heads, ...)   # drop-in for timm.layers.Attention
    linvit.load_softmax_state_dict(model, state_dict)   # softmax checkpoint -> linear model, reports new keys
    timm.create_model('linvit_small_patch16_224', ...)   # registered by importing linvit (timm.list_models('linvit_*'))
    linvit.convert_to_linear(model, attn_family='linear', feature_map='elu1', softmax_blocks=())   # timm ViT, in place
    linvit.list_attention_families()   # every attn_family: 'linear', 'aft', 'bidirectional', 'gated', 'linformer',
                                       # 'performer' (linvit.ATTENTION_FAMILIES: name -> layer class)
    linvit.attention_layer('performer', num_features=64)   # a family's layer class with its options (attn_options)
    linvit.redraw_random_features(model, generator=g)   # Performer: new random features (never inside forward)
    linvit.causal_linear_attention(q, k, v, decay=None, gate=None, form='chunked')   # the RNN view (linvit.ops)
    timm.create_model('linvit_small_patch16_224', causal=True).recurrent_init(1)   # recurrent inference
"""
from . import fast as fast  # the compiled fast path (linvit.fast)
from . import models, ops
from .layers import (
    ATTENTION_FAMILIES,
    LinearAttention,
    LocalMix,
    attention_layer,
    linear_attention_layer,
    list_attention_families,
    load_softmax_state_dict,
    redraw_random_features,
)
from .models import LinearVisionTransformer, convert_to_linear
from .ops import FEATURE_MAPS, causal_linear_attention, linear_attention, list_feature_maps

__version__ = '0.1.0'

__all__ = ['models', 'ops', 'LinearAttention', 'linear_attention_layer', 'LocalMix', 'load_softmax_state_dict',
           'FEATURE_MAPS', 'linear_attention', 'causal_linear_attention',
           'LinearVisionTransformer', 'convert_to_linear',
           'list_feature_maps', 'ATTENTION_FAMILIES', 'attention_layer', 'list_attention_families',
           'redraw_random_features', '__version__']
