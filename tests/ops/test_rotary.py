"""Rotary linear attention (``linvit.ops.rotary``) against the float64 quadratic reference of its definition
(``linvit/ops/rotary/naive.py``: the rotations written as 2 x 2 matrices on feature pairs), and against timm's own
rotation of its RoPE models."""
import math

import pytest
import torch
from references import rel_err
from timm.layers.pos_embed_sincos import apply_rot_embed_cat

from linvit.ops import add_states, list_feature_maps
from linvit.ops.rotary import (
    Rotation,
    quadratic_rotary_linear_attention,
    rotary_apply,
    rotary_linear_attention,
    rotary_state,
    rotate,
    rotation_from_timm,
)

MAPS = list_feature_maps(learnable=False)


def _inputs(b=2, h=3, n=21, d=8, dv=6, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(b, h, n, dv, generator=g, dtype=dtype)
    return q, k, v


def _angles(n, pairs, prefix=1, seed=1, heads=None):
    """Angles [(H,) N, pairs] with the first ``prefix`` tokens unturned, as timm leaves class tokens."""
    g = torch.Generator().manual_seed(seed)
    shape = (n - prefix, pairs) if heads is None else (heads, n - prefix, pairs)
    angle = torch.rand(shape, generator=g, dtype=torch.float64) * 4 * math.pi - 2 * math.pi
    return torch.cat([angle.new_zeros(*angle.shape[:-2], prefix, pairs), angle], dim=-2)


def _timm_rope(angle, prefix, half):
    """timm's concatenated [sin | cos] of the patch tokens for these angles: each angle twice, interleaved
    (a0 a0 a1 a1 ...) or as halves (a0 a1 ... a0 a1 ...)."""
    patch = angle[..., prefix:, :]
    doubled = torch.cat([patch, patch], dim=-1) if half else patch.repeat_interleave(2, dim=-1)
    return torch.cat([doubled.sin(), doubled.cos()], dim=-1)


@pytest.mark.parametrize('feature_map', MAPS)
@pytest.mark.parametrize('half', [False, True])
@pytest.mark.parametrize('masked', ['none', 'B-N', 'weights'])
def test_rotary_attention_matches_the_float64_formula(feature_map, half, masked):
    q, k, v = _inputs()
    angle = _angles(21, 4, prefix=1)
    key_mask = {'none': None, 'B-N': torch.rand(2, 21, generator=torch.Generator().manual_seed(5)) > 0.3,
                'weights': torch.rand(2, 21, generator=torch.Generator().manual_seed(5)) * 2}[masked]
    rotation = rotation_from_timm(_timm_rope(angle, 1, half).float(), num_prefix_tokens=1, half=half)
    out = rotary_linear_attention(q, k, v, rotation, feature_map, key_mask=key_mask)
    ref = quadratic_rotary_linear_attention(q, k, v, angle, feature_map, key_mask=key_mask, half=half)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert rel_err(out, ref) < 1e-5


def test_gradients_match_the_float64_formula():
    q, k, v = (t.double().requires_grad_() for t in _inputs(n=13))
    angle = _angles(13, 4, prefix=2, heads=3)  # per-head angles, as timm's mixed RoPE gives them
    rotation = rotation_from_timm(_timm_rope(angle, 2, False), num_prefix_tokens=2)
    grad = torch.randn(2, 3, 13, 6, dtype=torch.float64)
    got = torch.autograd.grad((rotary_linear_attention(q, k, v, rotation, 'elu1') * grad).sum(), (q, k, v))
    want = torch.autograd.grad((quadratic_rotary_linear_attention(q, k, v, angle, 'elu1') * grad).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-10


def test_the_rotation_is_timms():
    """rotate() on the patch tokens equals timm's apply_rot_embed_cat, both layouts; prefix tokens stay as they are."""
    x = torch.randn(2, 3, 11, 8, dtype=torch.float64)
    angle = _angles(11, 4, prefix=1)
    for half in (False, True):
        rope = _timm_rope(angle, 1, half)
        got = rotate(x, rotation_from_timm(rope, 1, half))
        assert torch.equal(got[:, :, :1], x[:, :, :1])
        torch.testing.assert_close(got[:, :, 1:], apply_rot_embed_cat(x[:, :, 1:], rope, half=half))


def test_offsets_not_positions_set_the_numerator():
    """Shifting every angle by the same amount leaves the attention unchanged: RoPE's relative property."""
    q, k, v = (t.double() for t in _inputs(n=9))
    angle = _angles(9, 4, prefix=0)
    shift = torch.rand(4, dtype=torch.float64) * 3
    outs = [rotary_linear_attention(q, k, v, Rotation(torch.repeat_interleave(a, 2, -1).sin(),
                                                      torch.repeat_interleave(a, 2, -1).cos()), 'relu')
            for a in (angle, angle + shift)]
    assert rel_err(outs[0], outs[1]) < 1e-12
    assert rel_err(outs[0], quadratic_rotary_linear_attention(q, k, v, angle * 0, 'relu')) > 1e-3  # it does turn


def test_states_of_parts_add_up_and_apply_to_any_queries():
    q, k, v = _inputs(n=30)
    angle = _angles(30, 4, prefix=1)
    rotation = rotation_from_timm(_timm_rope(angle, 1, False).float(), 1)
    whole = rotary_state(k, v, rotation, 'elu1')
    part = lambda a, b: Rotation(rotation.sin[a:b], rotation.cos[a:b])  # noqa: E731
    state = add_states(rotary_state(k[:, :, :11], v[:, :, :11], part(0, 11), 'elu1'),
                       rotary_state(k[:, :, 11:], v[:, :, 11:], part(11, 30), 'elu1'))
    assert rel_err(state.sums, whole.sums) < 1e-6
    rows = rotary_apply(q[:, :, 5:17], state, part(5, 17), 'elu1')
    ref = quadratic_rotary_linear_attention(q, k, v, angle, 'elu1')[:, :, 5:17]
    assert rel_err(rows, ref) < 1e-5


def test_wider_features_turn_block_by_block():
    """A map with 2 D features (as hedgehog's) is turned per D-wide block: the reference turns each block alike."""
    def doubled(x):
        return torch.cat([torch.nn.functional.elu(x) + 1, torch.nn.functional.elu(-x) + 1], dim=-1)
    q, k, v = (t.double() for t in _inputs(n=10))
    angle = _angles(10, 4, prefix=1)
    out = rotary_linear_attention(q, k, v, rotation_from_timm(_timm_rope(angle, 1, True), 1, True), doubled)
    ref = quadratic_rotary_linear_attention(q, k, v, angle, doubled, half=True)
    assert rel_err(out, ref) < 1e-12


def test_a_rotation_that_does_not_fit_is_one_line():
    q, k, v = _inputs(d=8)
    rope = _timm_rope(_angles(21, 3, prefix=0), 0, False).float()  # width 6 for 8 features
    with pytest.raises(ValueError, match='width 6 .* cannot turn 8 features'):
        rotary_linear_attention(q, k, v, rotation_from_timm(rope), 'elu1')
