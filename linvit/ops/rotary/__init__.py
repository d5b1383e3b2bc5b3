"""Linear attention with rotary position embeddings (RoPE), laid out as the other ops:

    naive.py      the float64 quadratic reference of the definition below
    pytorch.py    the O(N) PyTorch path: the rotation, the state and apply halves, the whole attention

The RoFormer formulation for linear attention (Su et al. 2021, eq. 19): the rotation R_i of token i's position
turns the mapped queries and keys in the numerator, and the normaliser stays rotation-free, so it stays positive:

    out_i = sum_j (R_i phi(q_i))^T (R_j phi(k_j)) v_j / (sum_j phi(q_i)^T phi(k_j) + eps)      (sums as means)

(R_i x)^T (R_j y) = x^T R_{j-i} y: the numerator's similarity depends on the offset of the two positions, as
softmax attention's does in a RoPE model. The state of the keys keeps its shape (``AttentionState``): its value rows
sum the rotated features, its normaliser row the plain ones, so states of parts of the tokens still add up.
"""
from .naive import quadratic_rotary_linear_attention
from .pytorch import Rotation, rotary_apply, rotary_linear_attention, rotary_state, rotate, rotation_from_timm

__all__ = ['Rotation', 'rotate', 'rotation_from_timm', 'rotary_state', 'rotary_apply', 'rotary_linear_attention',
           'quadratic_rotary_linear_attention']
