"""linear_attention against the float64 quadratic formula: outputs, gradients, masks, eps, half precision.

The reference (tests/references.py) writes the feature maps and the mean normaliser from their formulas without
importing linvit, so these tests also check the library's feature maps and its eps semantics.
"""

import pytest
import torch
from references import FEATURE_MAP_REFS, key_weights_ref, rel_err

from linvit.ops import (
    get_feature_map,
    linear_attention,
    list_feature_maps,
    quadratic_linear_attention,
)

MAPS = list_feature_maps(learnable=False)
EPS_VALUES = [1e-6, 1e-2, 0.5, 2.0]

# (B, H, Nq, N, D, Dv): N=1, odd N, Dv != D, Nq != N (cross attention)
SHAPES = [
    (1, 1, 1, 1, 8, 8),
    (2, 3, 17, 17, 16, 16),
    (2, 2, 33, 33, 8, 24),
    (1, 4, 5, 129, 32, 12),
    (3, 6, 196, 196, 64, 64),
]


def _shape_id(shape) -> str:
    b, h, nq, n, d, dv = shape
    return f"B{b}-H{h}-Nq{nq}-N{n}-D{d}-Dv{dv}"


def _qkv(shape, dtype=torch.float32, scale=1.0, seed=0):
    b, h, nq, n, d, dv = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=torch.float64) * scale
    k = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * scale
    v = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64) * scale
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _random_key_mask(b, n, seed=1, heads=None):
    g = torch.Generator().manual_seed(seed)
    shape = (b, n) if heads is None else (b, heads, n)
    mask = torch.rand(shape, generator=g) > 0.3
    mask[..., 0] = True  # at least one kept key per row
    return mask


def _check_against_reference(shape, feature_map, key_mask=None, tol=1e-5):
    """Output and q/k/v gradients of the fp32 op against the independent float64 reference (rel err <= tol)."""
    q, k, v = _qkv(shape)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_leaves = [t.double().clone().requires_grad_(True) for t in (q, k, v)]
    out = linear_attention(*leaves, feature_map=feature_map, key_mask=key_mask)
    ref = quadratic_linear_attention(*ref_leaves, feature_map=feature_map, key_mask=key_mask)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    err = rel_err(out, ref)
    assert err <= tol, f"output rel err {err:.2e} > {tol:.0e}"
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out.backward(grad_out.float())
    ref.backward(grad_out)
    # dq and dk can be ~0 where the output hardly depends on them (N=1: out = v up to eps); measure their error
    # against the scale of dv, which is always of the order of the upstream gradient
    floor = ref_leaves[2].grad.norm().item()
    for name, leaf, ref_leaf in zip('qkv', leaves, ref_leaves):
        err = (leaf.grad.double() - ref_leaf.grad).norm().item() / max(ref_leaf.grad.norm().item(), floor)
        assert err <= tol, f"d{name} rel err {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize('feature_map', MAPS)
@pytest.mark.parametrize('shape', SHAPES, ids=_shape_id)
def test_fp32_matches_quadratic_reference(shape, feature_map):
    _check_against_reference(shape, feature_map)


@pytest.mark.parametrize('feature_map', MAPS)
@pytest.mark.parametrize('per_head', [False, True], ids=['mask-BN', 'mask-BHN'])
def test_fp32_with_key_mask_matches_reference(feature_map, per_head):
    shape = (2, 3, 19, 19, 16, 8)
    mask = _random_key_mask(2, 19, heads=3 if per_head else None)
    _check_against_reference(shape, feature_map, key_mask=mask)


@pytest.mark.parametrize('feature_map', MAPS)
def test_float_key_weights_match_reference(feature_map):
    shape = (2, 2, 11, 23, 8, 8)
    weights = torch.rand(2, 23, generator=torch.Generator().manual_seed(3))
    weights[:, ::4] = 0.0
    _check_against_reference(shape, feature_map, key_mask=weights)


def test_light_key_weights_scale_eps_by_their_sum_below_one():
    """Weights summing to 0.3 with eps = 0.5: the normaliser is sum + eps * 0.3 (the weights' own count), not a
    count clamped to one key."""
    q, k, v = _qkv((1, 2, 5, 6, 4, 4))
    weights = torch.full((1, 6), 0.05)
    out = linear_attention(q, k, v, eps=0.5, key_mask=weights)
    ref = quadratic_linear_attention(q.double(), k.double(), v.double(), eps=0.5, key_mask=weights)
    assert rel_err(out, ref) <= 1e-6


def test_float64_key_weights_leave_float32_attention_in_float32():
    q, k, v = _qkv((1, 2, 5, 6, 4, 4))
    weights = torch.rand(1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = linear_attention(q, k, v, key_mask=weights)
    assert out.dtype == torch.float32
    assert rel_err(out, quadratic_linear_attention(q.double(), k.double(), v.double(), key_mask=weights)) <= 1e-5


# ---- eps: added to the MEAN normaliser (eps * count on the key sum), for every map and mask kind ----

EPS_SHAPE = (2, 3, 9, 17, 16, 8)
EPS_TOL = 1e-5
MASK_KINDS = ['nomask', 'mask-BN', 'mask-BHN', 'weights']


def _eps_key_mask(kind: str):
    """None, bool [B, N], bool [B, H, N] or float weights [B, N] (some 0) for EPS_SHAPE."""
    b, h, _, n, _, _ = EPS_SHAPE
    if kind == 'nomask':
        return None
    if kind == 'weights':
        weights = torch.rand(b, n, generator=torch.Generator().manual_seed(5)) * 2
        weights[:, 1::5] = 0.0
        return weights
    return _random_key_mask(b, n, seed=4, heads=h if kind == 'mask-BHN' else None)


@pytest.mark.parametrize('mask_kind', MASK_KINDS)
@pytest.mark.parametrize('eps', EPS_VALUES)
@pytest.mark.parametrize('feature_map', MAPS)
def test_eps_is_added_to_the_mean_normaliser(feature_map, eps, mask_kind):
    # small q, k (scale 0.5) keep the mean similarity ~1 so that eps moves the output visibly
    q, k, v = _qkv(EPS_SHAPE, scale=0.5, seed=2)
    mask = _eps_key_mask(mask_kind)
    out = linear_attention(q, k, v, feature_map=feature_map, eps=eps, key_mask=mask)
    ref = quadratic_linear_attention(q, k, v, feature_map=feature_map, eps=eps, key_mask=mask)
    err = rel_err(out, ref)
    assert err <= EPS_TOL, f"eps={eps} {mask_kind}: rel err {err:.2e} > {EPS_TOL:.0e}"


@pytest.mark.parametrize('mask_kind', MASK_KINDS)
@pytest.mark.parametrize('eps', [e for e in EPS_VALUES if e >= 1e-2])
@pytest.mark.parametrize('feature_map', MAPS)
def test_eps_inputs_tell_mean_from_sum_normaliser(feature_map, eps, mask_kind):
    """The inputs above are sensitive: eps on the plain key sum would miss the tolerance by >= 10x."""
    q, k, v = _qkv(EPS_SHAPE, scale=0.5, seed=2)
    mask = _eps_key_mask(mask_kind)
    mean_ref = quadratic_linear_attention(q, k, v, feature_map=feature_map, eps=eps, key_mask=mask)
    # sum / (sum + eps) = mean / (mean + eps / count): the sum normaliser is the mean one with eps / count
    count = key_weights_ref(mask, q.shape[0], q.shape[1], k.shape[2]).sum(-1)[..., None, None]
    sum_ref = quadratic_linear_attention(q, k, v, feature_map=feature_map, eps=eps / count, key_mask=mask)
    margin = rel_err(sum_ref, mean_ref) / EPS_TOL
    assert margin >= 10, f"eps={eps} {mask_kind}: sum vs mean differ by only {margin:.1f}x the tolerance"


def _formula(q, k, v, feature_map='elu1', eps=1e-6, key_mask=None):
    """out_i = (sum_j w_j phi(q_i).phi(k_j) v_j / W) / (sum_j w_j phi(q_i).phi(k_j) / W + eps), W = sum_j w_j, term
    by term in float64 with the formula-only maps of tests/references.py (keys of weight 0 skipped)."""
    phi = FEATURE_MAP_REFS[feature_map]
    b, h, n = k.shape[0], k.shape[1], k.shape[2]
    w = key_weights_ref(key_mask, b, h, n)
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kept = [j for j in range(n) if w[bi, hi, j] > 0]
            total = float(sum(w[bi, hi, j] for j in kept)) or 1.0
            for i in range(q.shape[2]):
                sims = [float(w[bi, hi, j] * (phi(q[bi, hi, i].double()) @ phi(k[bi, hi, j].double()))) for j in kept]
                num = sum((s * v[bi, hi, j].double() for s, j in zip(sims, kept)), torch.zeros(v.shape[-1],
                                                                                          dtype=torch.float64))
                out[bi, hi, i] = (num / total) / (sum(sims) / total + eps)
    return out


@pytest.mark.parametrize('eps', [1e-6, 0.5])
@pytest.mark.parametrize('feature_map', MAPS)
def test_the_reference_is_the_formula(feature_map, eps):
    """linvit.ops.quadratic_linear_attention (what the other tests compare with) is the formula written term by
    term with the formula-only maps."""
    q, k, v = _qkv(EPS_SHAPE, dtype=torch.float64, seed=3)
    for mask_kind in MASK_KINDS:
        mask = _eps_key_mask(mask_kind)
        got = quadratic_linear_attention(q, k, v, feature_map=feature_map, eps=eps, key_mask=mask)
        ref = _formula(q, k, v, feature_map=feature_map, eps=eps, key_mask=mask)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12, msg=lambda m, kind=mask_kind: f"{kind}: {m}")


def test_the_reference_takes_defaults_callables_light_weights_and_non_finite_padding():
    """The reference's defaults (elu1, eps 1e-6), a feature map passed as a function, key weights that sum to less
    than 1 (the mean divides by that sum, not by max(sum, 1)), and inf values under zero-weight keys."""
    q, k, v = _qkv(EPS_SHAPE, dtype=torch.float64, seed=6)
    torch.testing.assert_close(quadratic_linear_attention(q, k, v), _formula(q, k, v), rtol=1e-12, atol=1e-12)
    relu_fn = get_feature_map('relu')
    torch.testing.assert_close(quadratic_linear_attention(q, k, v, feature_map=relu_fn, eps=0.5),
                               _formula(q, k, v, feature_map='relu', eps=0.5), rtol=1e-12, atol=1e-12)
    weights = torch.full((EPS_SHAPE[0], EPS_SHAPE[3]), 0.02, dtype=torch.float64)  # 17 keys: total weight 0.34
    weights[:, ::4] = 0.0
    k_padded, v_padded = k.clone(), v.clone()
    k_padded[:, :, ::4] = float('nan')  # what padded tokens may hold; a zero weight must drop them
    v_padded[:, :, ::4] = float('inf')
    got = quadratic_linear_attention(q, k_padded, v_padded, eps=0.5, key_mask=weights)
    torch.testing.assert_close(got, _formula(q, k, v, eps=0.5, key_mask=weights), rtol=1e-12, atol=1e-12)


def test_every_feature_map_has_an_independent_reference():
    assert set(MAPS) <= set(FEATURE_MAP_REFS), "add the new map's formula to tests/references.py"


@pytest.mark.parametrize('feature_map', MAPS)
def test_key_mask_drops_padding_exactly(feature_map):
    """A padded batch with a key mask gives the unpadded result, even if the padding holds NaN."""
    q, k, v = _qkv((1, 2, 13, 13, 8, 8))
    pad = 7
    k_pad = torch.cat([k, torch.full((1, 2, pad, 8), float('nan'))], dim=2)
    v_pad = torch.cat([v, torch.full((1, 2, pad, 8), float('inf'))], dim=2)
    mask = torch.cat([torch.ones(1, 13, dtype=torch.bool), torch.zeros(1, pad, dtype=torch.bool)], dim=1)
    unpadded = linear_attention(q, k, v, feature_map=feature_map)
    padded = linear_attention(q, k_pad, v_pad, feature_map=feature_map, key_mask=mask)
    torch.testing.assert_close(padded, unpadded, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('feature_map', MAPS)
@pytest.mark.parametrize('masked', [False, True], ids=['nomask', 'mask'])
def test_gradcheck_float64(feature_map, masked):
    q, k, v = (t.requires_grad_(True) for t in _qkv((1, 2, 5, 6, 4, 3), dtype=torch.float64))
    mask = _random_key_mask(1, 6) if masked else None
    assert torch.autograd.gradcheck(
        lambda q_, k_, v_: linear_attention(q_, k_, v_, feature_map=feature_map, key_mask=mask), (q, k, v))


def test_eps_keeps_all_zero_similarity_rows_finite():
    """relu maps a query with no positive entry to zeros: 0 / (0 + eps) must give a zero row, not NaN."""
    q, k, v = _qkv((1, 1, 4, 9, 8, 8))
    q[..., 1, :] = -q[..., 1, :].abs()
    q.requires_grad_(True)
    out = linear_attention(q, k, v, feature_map='relu', eps=1e-6)
    assert torch.isfinite(out).all()
    assert out[..., 1, :].abs().max() == 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_all_keys_masked_gives_zeros():
    q, k, v = _qkv((1, 1, 4, 5, 8, 8))
    out = linear_attention(q, k, v, key_mask=torch.zeros(1, 5, dtype=torch.bool))
    assert torch.isfinite(out).all() and out.abs().max() == 0


def test_non_finite_inputs_are_not_masked():
    q, k, v = _qkv((1, 1, 4, 5, 8, 8))
    q[0, 0, 2, 3] = float('nan')
    out = linear_attention(q, k, v)
    assert torch.isnan(out[0, 0, 2]).all()
    assert torch.isfinite(out[0, 0, [0, 1, 3]]).all()
    k[0, 0, 1, 0] = float('nan')
    assert torch.isnan(linear_attention(q, k, v)).all()


@pytest.mark.parametrize('bad, match', [
    (dict(q=torch.zeros(2, 3, 8)), r'q of shape \[B, H, N, D\], got \[2, 3, 8\]'),
    (dict(k=torch.zeros(2, 3, 5, 7)), r'share the feature width D'),
    (dict(v=torch.zeros(2, 3, 6, 8)), r'same number of tokens N'),
    (dict(k=torch.zeros(1, 3, 5, 8), v=torch.zeros(1, 3, 5, 8)), r'share \[B, H\]'),
    (dict(key_mask=torch.ones(2, 4, dtype=torch.bool)), r'key_mask must have shape \[B, N\] = \[2, 5\]'),
])
def test_bad_shapes_raise_value_error_naming_them(bad, match):
    args = dict(q=torch.zeros(2, 3, 5, 8), k=torch.zeros(2, 3, 5, 8), v=torch.zeros(2, 3, 5, 8), key_mask=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        linear_attention(args['q'], args['k'], args['v'], key_mask=args['key_mask'])


def test_unknown_feature_map_raises():
    q, k, v = _qkv((1, 1, 2, 2, 4, 4))
    with pytest.raises(ValueError, match=f"unknown feature_map 'cosine'; known: {', '.join(list_feature_maps())}"):
        linear_attention(q, k, v, feature_map='cosine')


# ---- half precision at image scale: 65,536 tokens, values ~ N(0, 3) ----

HALF_N = 65536
HALF_SHAPE = (1, 2, HALF_N, HALF_N, 32, 32)


@pytest.fixture(scope='module')
def big_qkv():
    return _qkv(HALF_SHAPE, scale=3.0, seed=11)


def _naive_half_normaliser_overflows(k: torch.Tensor) -> bool:
    """What an implementation without the float32 mean core computes: z = phi(K)^T 1 summed in float16."""
    phi_k = torch.nn.functional.elu(k.half()) + 1
    z = phi_k.transpose(-2, -1) @ torch.ones(phi_k.shape[:-1] + (1,), dtype=torch.float16)
    return not bool(torch.isfinite(z).all())


@pytest.mark.slow
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['fp16', 'bf16'])
@pytest.mark.parametrize('feature_map', MAPS)
def test_half_precision_at_65k_tokens(big_qkv, feature_map, dtype):
    q, k, v = (t.to(dtype) for t in big_qkv)
    ref = linear_attention(q.float(), k.float(), v.float(), feature_map=feature_map)
    out = linear_attention(q, k, v, feature_map=feature_map)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err <= 1e-2, f"B1-H2-N{HALF_N}-D32-{dtype}: rel err {err:.2e} vs fp32"


@pytest.mark.slow
def test_naive_fp16_sum_would_overflow(big_qkv):
    """The inputs above are hard enough: summing the normaliser in float16 overflows, which the core avoids."""
    _, k, _ = big_qkv
    assert _naive_half_normaliser_overflows(k)


@pytest.mark.slow
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['fp16', 'bf16'])
@pytest.mark.parametrize('feature_map', MAPS)
def test_half_precision_under_cpu_autocast(big_qkv, feature_map, dtype):
    q, k, v = (t.to(dtype) for t in big_qkv)
    outside = linear_attention(q, k, v, feature_map=feature_map)
    with torch.autocast('cpu', dtype=dtype):
        inside = linear_attention(q, k, v, feature_map=feature_map)
        inside_fp32_inputs = linear_attention(q.float(), k.float(), v.float(), feature_map=feature_map)
    # autocast must not reach the core: the results are the same as outside autocast
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    ref = linear_attention(q.float(), k.float(), v.float(), feature_map=feature_map)
    assert inside_fp32_inputs.dtype == torch.float32
    torch.testing.assert_close(inside_fp32_inputs, ref, rtol=0, atol=0)
    assert torch.isfinite(inside).all()
    assert rel_err(inside, ref) <= 1e-2


@pytest.mark.parametrize('which', ['k', 'v'])
def test_each_input_is_named_in_shape_errors(which):
    q, k, v = _qkv((2, 3, 5, 5, 4, 4), dtype=torch.float64)
    shapes = {'q': q, 'k': k, 'v': v}
    with pytest.raises(ValueError, match=rf"expects {which} of shape \[B, H, N, D\], got \[3, 5, 4\]"):
        linear_attention(**{**shapes, which: shapes[which][0]})
    other_heads = shapes[which][:, :2]  # only this input has 2 heads
    with pytest.raises(ValueError, match=r"q, k, v must share \[B, H\]"):
        linear_attention(**{**shapes, which: other_heads})


def test_a_feature_map_function_is_used_as_given():
    q, k, v = _qkv(EPS_SHAPE, dtype=torch.float64, seed=7)
    got = linear_attention(q, k, v, feature_map=get_feature_map('relu'), eps=0.5)
    expected = quadratic_linear_attention(q, k, v, feature_map='relu', eps=0.5)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
