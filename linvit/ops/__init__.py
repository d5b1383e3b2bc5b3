"""Pure tensor functions for linear attention. Shapes are [B, H, N, D]; nothing here holds parameters."""
from .attention_op import (
    ATTN_BACKENDS,
    check_attn_backend,
    kernel_unsupported_reason,
    kernels_serve,
    linear_attention_op,
    linear_attention_qkv_op,
    triton_interpreting,
)
from .causal import (
    CAUSAL_FORMS,
    CausalState,
    ChunkedCausalScan,
    bidirectional_linear_attention,
    causal_linear_attention,
    causal_linear_attention_step,
    causal_linear_scan,
    grid_scan_orders,
    retention_decays,
)
from .feature_maps import (
    FEATURE_MAPS,
    FeatureMap,
    FeatureMapSpec,
    elu1,
    feature_map_spec,
    focused,
    get_feature_map,
    hedgehog,
    list_feature_maps,
    register_feature_map,
    relu,
    relu2,
    unregister_feature_map,
)
from .fused import (
    fused_linear_attention,
    fused_linear_attention_from_features,
    fused_linear_attention_qkv,
    has_fused_backward,
)
from .linear_attention import (
    AttentionState,
    add_states,
    check_attention_inputs,
    compute_dtype,
    export_tracing,
    linear_attention,
    linear_attention_apply,
    linear_attention_from_features,
    linear_attention_state,
)
from .projected import projected_linear_attention_from_features, projected_linear_attention_from_inputs
from .reference import quadratic_linear_attention

__all__ = [
    'FEATURE_MAPS', 'FeatureMapSpec', 'FeatureMap', 'elu1', 'relu', 'relu2', 'focused', 'hedgehog',
    'feature_map_spec', 'get_feature_map', 'list_feature_maps', 'register_feature_map', 'unregister_feature_map',
    'fused_linear_attention_from_features', 'check_attention_inputs', 'compute_dtype', 'export_tracing',
    'linear_attention', 'linear_attention_state', 'linear_attention_apply', 'AttentionState', 'add_states',
    'linear_attention_from_features', 'projected_linear_attention_from_features',
    'projected_linear_attention_from_inputs', 'quadratic_linear_attention',
    'fused_linear_attention',
    'fused_linear_attention_qkv', 'has_fused_backward', 'causal_linear_attention', 'causal_linear_attention_step',
    'causal_linear_scan', 'CausalState', 'ChunkedCausalScan', 'bidirectional_linear_attention', 'retention_decays',
    'CAUSAL_FORMS', 'grid_scan_orders', 'ATTN_BACKENDS', 'check_attn_backend', 'kernel_unsupported_reason',
    'kernels_serve',
    'linear_attention_op', 'linear_attention_qkv_op', 'triton_interpreting',
]
