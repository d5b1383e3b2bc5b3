"""Pure tensor functions for linear attention. Shapes are [B, H, N, D]; nothing here holds parameters.

One package per op, laid out by form (as fla's ``fla/ops/<op>/``): ``linear_attn`` (non-causal linear attention:
its float64 reference, PyTorch path, autograd Function, Triton kernels and registered ops), ``causal`` (the causal
forms and the bidirectional scans), ``rotary`` (linear attention with rotary position embeddings); beside them the
feature maps (``FEATURE_MAPS``), the other families' math (``families``) and what every core shares (``common``).
"""
from .causal import (
    CausalState,
    ChunkedCausalScan,
    bidirectional_linear_attention,
    causal_linear_attention,
    causal_linear_attention_step,
    grid_scan_orders,
    retention_decays,
)
from .common import autocast_off, compute_dtype, export_tracing
from .feature_maps import (
    FEATURE_MAPS,
    FeatureMapSpec,
    elu1,
    feature_map_spec,
    focused,
    get_feature_map,
    hedgehog,
    list_feature_maps,
    norm_direction,
    register_feature_map,
    relu,
    relu2,
    unregister_feature_map,
)
from .linear_attn import (
    ATTN_BACKENDS,
    DEFAULT_NORMALIZER,
    NORMALIZERS,
    AttentionState,
    NormalizerSpec,
    add_states,
    check_attn_backend,
    fused_linear_attention,
    fused_linear_attention_from_features,
    has_fused_backward,
    kernel_unsupported_reason,
    kernels_serve,
    linear_attention,
    linear_attention_apply,
    linear_attention_from_features,
    linear_attention_op,
    linear_attention_qkv_op,
    linear_attention_state,
    list_normalizers,
    normalized_attention_from_features,
    normalizer_spec,
    projected_linear_attention_from_features,
    projected_linear_attention_from_inputs,
    quadratic_linear_attention,
    triton_interpreting,
)
from .rotary import (
    Rotation,
    quadratic_rotary_linear_attention,
    rotary_apply,
    rotary_linear_attention,
    rotary_state,
    rotation_from_timm,
)

__all__ = [
    'FEATURE_MAPS', 'FeatureMapSpec', 'elu1', 'relu', 'relu2', 'focused', 'hedgehog', 'norm_direction',
    'feature_map_spec',
    'get_feature_map', 'list_feature_maps', 'register_feature_map', 'unregister_feature_map',
    'compute_dtype', 'autocast_off', 'export_tracing',
    'linear_attention', 'linear_attention_state', 'linear_attention_apply', 'AttentionState', 'add_states',
    'linear_attention_from_features', 'fused_linear_attention', 'fused_linear_attention_from_features',
    'has_fused_backward', 'linear_attention_op', 'linear_attention_qkv_op', 'quadratic_linear_attention',
    'projected_linear_attention_from_features', 'projected_linear_attention_from_inputs',
    'ATTN_BACKENDS', 'check_attn_backend', 'kernel_unsupported_reason', 'kernels_serve', 'triton_interpreting',
    'causal_linear_attention', 'causal_linear_attention_step', 'CausalState', 'ChunkedCausalScan',
    'bidirectional_linear_attention', 'retention_decays', 'grid_scan_orders',
    'rotary_linear_attention', 'rotary_state', 'rotary_apply', 'Rotation', 'rotation_from_timm',
    'quadratic_rotary_linear_attention',
    'NORMALIZERS', 'NormalizerSpec', 'DEFAULT_NORMALIZER', 'normalizer_spec', 'list_normalizers',
    'normalized_attention_from_features',
]
