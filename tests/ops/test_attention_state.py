"""linear_attention_state / linear_attention_apply: the key half and the query half of linear attention.

Checked against the float64 quadratic formula (tests/references.py, no linvit code), against today's
``linear_attention``, and for what makes them useful: the states of chunks of the keys add up to the state of all
of them, so a sequence read chunk by chunk attends exactly as it would at once.
"""
import pytest
import torch
from references import rel_err

from linvit.ops import (
    AttentionState,
    add_states,
    linear_attention,
    linear_attention_apply,
    linear_attention_state,
    list_feature_maps,
    quadratic_linear_attention,
)

MAPS = list_feature_maps(learnable=False)


def _qkv(b=2, h=3, nq=17, n=40, d=16, dv=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, nq, d, generator=g), torch.randn(b, h, n, d, generator=g),
            torch.randn(b, h, n, dv, generator=g))


def _mask(b, n, heads=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand((b, n) if heads is None else (b, heads, n), generator=g) > 0.3
    mask[..., 0] = True
    return mask


@pytest.mark.parametrize('feature_map', MAPS)
@pytest.mark.parametrize('masked', ['none', 'B-N', 'B-H-N', 'weights'])
def test_apply_of_state_matches_the_float64_formula(feature_map, masked):
    q, k, v = _qkv()
    key_mask = {'none': None, 'B-N': _mask(2, 40), 'B-H-N': _mask(2, 40, heads=3),
                'weights': torch.rand(2, 40, generator=torch.Generator().manual_seed(3)) * 2}[masked]
    state = linear_attention_state(k, v, feature_map, key_mask=key_mask)
    assert state.sums.shape == (2, 3, 13, 16) and state.count.shape == (2, 3)
    assert state.sums.dtype == torch.float32
    out = linear_attention_apply(q, state, feature_map)
    ref = quadratic_linear_attention(q.double(), k.double(), v.double(), feature_map=feature_map, key_mask=key_mask)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(out, linear_attention(q, k, v, feature_map, key_mask=key_mask))


@pytest.mark.parametrize('feature_map', MAPS)
def test_states_of_chunks_add_up_to_the_state_of_all_keys(feature_map):
    q, k, v = _qkv(n=101)
    whole = linear_attention_state(k, v, feature_map)
    bounds = [0, 7, 40, 41, 101]
    parts = [linear_attention_state(k[:, :, a:b], v[:, :, a:b], feature_map) for a, b in zip(bounds, bounds[1:])]
    summed = parts[0]
    for part in parts[1:]:
        summed = add_states(summed, part)
    assert rel_err(summed.sums, whole.sums) < 1e-6 and torch.equal(summed.count, whole.count)
    ref = quadratic_linear_attention(q.double(), k.double(), v.double(), feature_map=feature_map)
    # queries too can come in chunks: each chunk's rows are the rows of the whole output
    out = torch.cat([linear_attention_apply(q[:, :, a:a + 5], summed, feature_map) for a in range(0, 17, 5)], dim=2)
    assert rel_err(out, ref) < 1e-5


def test_masked_keys_contribute_nothing_even_when_not_finite():
    q, k, v = _qkv()
    mask = _mask(2, 40)
    keep = mask[:, None, :, None]
    k_bad, v_bad = torch.where(keep, k, float('nan')), torch.where(keep, v, float('inf'))
    state = linear_attention_state(k_bad, v_bad, 'relu', key_mask=mask)
    assert torch.isfinite(state.sums).all()
    kept = linear_attention_state(k, v, 'relu', key_mask=mask)
    assert torch.equal(state.sums, kept.sums)
    all_masked = linear_attention_state(k, v, 'relu', key_mask=torch.zeros(2, 40, dtype=torch.bool))
    assert torch.equal(linear_attention_apply(q, all_masked, 'relu'), torch.zeros(2, 3, 17, 12))


def test_gradients_flow_through_both_halves_to_the_float64_formula():
    q, k, v = (t.double().requires_grad_(True) for t in _qkv(n=9, nq=5))
    out = linear_attention_apply(q, linear_attention_state(k, v, 'elu1'), 'elu1')
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = quadratic_linear_attention(*ref_leaves, feature_map='elu1')
    grad = torch.randn_like(ref)
    torch.autograd.backward(out, grad)
    torch.autograd.backward(ref, grad)
    for got, want in zip((q, k, v), ref_leaves):
        assert rel_err(got.grad, want.grad) < 1e-10


def test_pre_mapped_features_and_half_precision():
    q, k, v = _qkv()
    phi = torch.nn.functional.elu
    state = linear_attention_state(phi(k) + 1, v, None)
    out = linear_attention_apply(phi(q) + 1, state, None)
    assert rel_err(out, linear_attention(q, k, v, 'elu1')) < 1e-6
    half = linear_attention_apply(q.half(), linear_attention_state(k.half(), v.half(), 'elu1'), 'elu1')
    assert half.dtype == torch.float16
    assert rel_err(half, linear_attention(q, k, v, 'elu1')) < 1e-2


def test_mismatched_shapes_are_one_line_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match='same B, H, N'):
        linear_attention_state(k, v[:, :, :5])
    state = linear_attention_state(k, v)
    with pytest.raises(ValueError, match='same B, H'):
        linear_attention_apply(q[:, :2], state)
    with pytest.raises(ValueError, match='same feature map'):
        linear_attention_apply(q[..., :8], state)
    assert isinstance(state, AttentionState)
