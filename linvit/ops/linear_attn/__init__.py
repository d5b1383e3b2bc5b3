"""Non-causal linear attention, one op laid out by form (as fla's ``fla/ops/linear_attn/``):

    naive.py      the float64 quadratic reference every other form is tested against
    pytorch.py    the PyTorch path: the float32 core as two halves, the keys' state and its use by the queries
    function.py   the autograd Function with the closed-form backward (the PyTorch path of the registered ops)
    kernels.py    the Triton kernels: a key pass and a query pass each way
    backend.py    who computes a call: the kernels or the PyTorch path (``attn_backend``)
    op.py         the registered torch.library ops and their entry points
    projected.py  the core with its output projection folded into the key-side state (inference)
    normalizers.py  how similarities become weights (``NORMALIZERS``: divide, inline, mala)
"""
from .backend import ATTN_BACKENDS, check_attn_backend, kernel_unsupported_reason, kernels_serve, triton_interpreting
from .function import fused_linear_attention, fused_linear_attention_from_features, has_fused_backward
from .naive import quadratic_linear_attention
from .normalizers import DEFAULT_NORMALIZER, NORMALIZERS, NormalizerSpec, list_normalizers, normalizer_spec
from .op import linear_attention_apply, linear_attention_op, linear_attention_qkv_op, linear_attention_state
from .projected import projected_linear_attention_from_features, projected_linear_attention_from_inputs
from .pytorch import (
    AttentionState,
    add_states,
    linear_attention,
    linear_attention_from_features,
    normalized_attention_from_features,
)

__all__ = ['linear_attention', 'linear_attention_from_features', 'linear_attention_state', 'linear_attention_apply',
           'AttentionState', 'add_states', 'fused_linear_attention', 'fused_linear_attention_from_features',
           'has_fused_backward', 'linear_attention_op', 'linear_attention_qkv_op', 'quadratic_linear_attention',
           'projected_linear_attention_from_features', 'projected_linear_attention_from_inputs', 'ATTN_BACKENDS',
           'check_attn_backend', 'kernel_unsupported_reason', 'kernels_serve', 'triton_interpreting',
           'NORMALIZERS', 'NormalizerSpec', 'DEFAULT_NORMALIZER', 'normalizer_spec', 'list_normalizers',
           'normalized_attention_from_features']
