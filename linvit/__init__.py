"""linvit: linear-attention Vision Transformers for large images, built on timm.

Public API:
    linvit.ops.linear_attention(q, k, v, feature_map='elu1', eps=1e-6, key_mask=None)   # [B, H, N, D] tensors
    linvit.LinearAttention(dim, num_heads, ...)   # drop-in for timm.layers.Attention
    linvit.load_softmax_state_dict(model, state_dict)   # softmax checkpoint -> linear model, reports new keys
"""
from . import ops
from .layers import LinearAttention, LocalMix, linear_attention_layer, load_softmax_state_dict
from .ops import FEATURE_MAPS, linear_attention, list_feature_maps

__version__ = '0.1.0'

__all__ = ['ops', 'LinearAttention', 'linear_attention_layer', 'LocalMix', 'load_softmax_state_dict',
           'FEATURE_MAPS', 'linear_attention',
           'list_feature_maps', '__version__']
