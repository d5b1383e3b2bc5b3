"""The attention families in linvit.ops.families against their float64 references in tests/references.py: outputs
and gradients; Performer's estimator (error falls with m, orthogonal beats i.i.d.); masks; half precision."""
import pytest
import torch
from references import aft_simple_ref, gated_ref, low_rank_ref, performer_ref, softmax_attention_ref

from linvit.ops import list_feature_maps
from linvit.ops.families import (
    aft_simple,
    gated_linear_attention,
    gaussian_projection,
    low_rank_attention,
    performer_attention,
)


def _qkv(b=2, h=3, n=17, d=8, dv=None, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * scale
    k = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * scale
    v = torch.randn(b, h, n, dv or d, generator=g, dtype=torch.float64)
    return q, k, v


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _grads(fn, *inputs):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*inputs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    (out * weight).sum().backward()
    return out.detach(), [x.grad for x in inputs]


def _assert_same_outputs_and_grads(fn, ref, inputs, tol):
    out, grads = _grads(fn, *inputs)
    expected, expected_grads = _grads(ref, *inputs)
    assert _rel(out, expected) < tol
    for got, want in zip(grads, expected_grads):
        assert _rel(got, want) < tol


# ------------------------------------------------------------------------------------------------ Performer

@pytest.mark.parametrize('m', [8, 24])
def test_performer_equals_its_quadratic_estimator(m):
    q, k, v = _qkv(dv=5)
    w = gaussian_projection(m, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # eps=0: the op adds eps to its stabilised normaliser, the reference has no stabiliser (float64 needs none)
    _assert_same_outputs_and_grads(lambda q, k, v: performer_attention(q, k, v, w, eps=0.0),
                                   lambda q, k, v: performer_ref(q, k, v, w, eps=0.0), (q, k, v), 1e-12)


def test_performer_in_float32_against_float64():
    q, k, v = _qkv(n=64)
    w = gaussian_projection(16, 8, generator=torch.Generator().manual_seed(2))
    out = performer_attention(q.float(), k.float(), v.float(), w, eps=0.0)
    assert out.dtype == torch.float32
    assert _rel(out.double(), performer_ref(q, k, v, w, eps=0.0)) < 1e-5


def _softmax_error(m, orthogonal, seeds, d=16, n=64):
    """Mean over seeds of ||performer - softmax||_F / ||softmax||_F (float64, fresh features per seed)."""
    errors = []
    for seed in seeds:
        q, k, v = _qkv(b=1, h=1, n=n, d=d, seed=seed)
        q, k = q * 0.5, k * 0.5
        w = gaussian_projection(m, d, orthogonal, generator=torch.Generator().manual_seed(1000 + seed),
                                dtype=torch.float64)
        expected = softmax_attention_ref(q, k, v)
        errors.append(((performer_attention(q, k, v, w, eps=0.0) - expected).norm() / expected.norm()).item())
    return sum(errors) / len(errors)


def test_performer_error_against_softmax_falls_as_features_grow():
    errors = [_softmax_error(m, True, range(50)) for m in (16, 64, 256, 1024)]
    assert errors[0] > errors[1] > errors[2] > errors[3], errors
    assert errors[3] < 0.5 * errors[0]


def test_orthogonal_features_beat_iid_features_at_the_same_count():
    # the Performer paper's claim (section 2.4): same m, lower mean error with orthogonal blocks (300 draws each:
    # the estimator is heavy-tailed, fewer draws leave the comparison to chance at m > d)
    for m in (16, 32, 64):
        assert _softmax_error(m, True, range(300)) < _softmax_error(m, False, range(300)), m


def test_orthogonal_projection_rows_are_orthogonal_within_a_block():
    w = gaussian_projection(24, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    block = w[:8] / w[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(8, dtype=torch.float64), atol=1e-12, rtol=0)


def test_performer_masked_keys_do_not_count_even_when_they_are_huge():
    q, k, v = _qkv(b=2, n=12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[:, 9:] = False
    k_pad = k.clone()
    k_pad[:, :, 9:] = 1e4  # would dominate the key stabiliser if it were counted
    w = gaussian_projection(16, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = performer_attention(q, k_pad, v, w, eps=0.0, key_mask=mask)
    expected = performer_ref(q, k[:, :, :9], v[:, :, :9], w, eps=0.0)
    assert _rel(out, expected) < 1e-9


def test_performer_half_precision_at_16k_tokens_is_finite():
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(b=1, h=2, n=16384, d=32, seed=4))
    w = gaussian_projection(32, 32, generator=torch.Generator().manual_seed(5))
    out = performer_attention(q, k, v, w)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    full = performer_attention(q.float(), k.float(), v.float(), w)  # N x N float64 would need 4 GB here
    assert _rel(out.double(), full.double()) < 1e-2


# ------------------------------------------------------------------------------------------------ low rank

@pytest.mark.parametrize('grid,size,prefix', [((4, 6), 3, 1), ((5, 5), 2, 0), ((3, 4), 5, 2)])
def test_low_rank_equals_softmax_over_pooled_keys(grid, size, prefix):
    n = prefix + grid[0] * grid[1]
    q, k, v = _qkv(n=n, dv=8)
    _assert_same_outputs_and_grads(lambda q, k, v: low_rank_attention(q, k, v, grid, prefix, size),
                                   lambda q, k, v: low_rank_ref(q, k, v, grid, prefix, size), (q, k, v), 1e-10)


def test_low_rank_with_the_full_grid_is_exact_softmax():
    q, k, v = _qkv(n=1 + 16)
    out = low_rank_attention(q, k, v, (4, 4), 1, 4)
    assert _rel(out, softmax_attention_ref(q, k, v)) < 1e-12


# ------------------------------------------------------------------------------------------------ gated

@pytest.mark.parametrize('feature_map', list_feature_maps(learnable=False))
def test_gated_linear_attention_equals_its_quadratic_form(feature_map):
    q, k, v = _qkv(dv=6)
    gate = torch.sigmoid(torch.randn(q.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64))
    _assert_same_outputs_and_grads(
        lambda q, k, v, g: gated_linear_attention(q, k, v, g, feature_map),
        lambda q, k, v, g: gated_ref(q, k, v, g, feature_map), (q, k, v, gate), 1e-9)


def test_a_constant_gate_is_plain_linear_attention():
    q, k, v = _qkv()
    plain = gated_ref(q, k, v, torch.ones_like(k), eps=0.0)
    gated = gated_linear_attention(q, k, v, torch.full_like(k, 0.3), eps=0.0)
    assert _rel(gated, plain) < 1e-12


# ------------------------------------------------------------------------------------------------ AFT

def test_aft_simple_equals_its_formula():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 11, 12, generator=g, dtype=torch.float64) for _ in range(3))
    _assert_same_outputs_and_grads(aft_simple, aft_simple_ref, (q, k, v), 1e-10)


def test_aft_simple_is_stable_for_large_keys_and_ignores_masked_tokens():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out = aft_simple(q, k + 1000.0, v)  # exp(1000) overflows without the max subtraction
    assert _rel(out, aft_simple_ref(q, k, v)) < 1e-12
    mask = torch.ones(1, 9, dtype=torch.bool)
    mask[:, 6:] = False
    k_pad, v_pad = k.clone(), v.clone()
    k_pad[:, 6:], v_pad[:, 6:] = float('inf'), float('nan')
    masked = aft_simple(q, k_pad, v_pad, key_mask=mask)
    assert _rel(masked, aft_simple_ref(q, k[:, :6], v[:, :6])) < 1e-12
