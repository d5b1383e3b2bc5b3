"""projected_linear_attention_from_features and _from_inputs against the float64 quadratic formula followed by the
projection.

Features go in already mapped (non-negative), so the reference runs them through the relu reference, the identity
on them; the projections are written as x W^T + b in float64.
"""
import pytest
import torch
from references import rel_err

from linvit.ops import (
    projected_linear_attention_from_features,
    projected_linear_attention_from_inputs,
    quadratic_linear_attention,
)

# (B, H, Nq, N, F, Dv, C): one token, cross attention (Nq != N), Dv != F (a learnable map's width), odd sizes
SHAPES = [
    (1, 1, 1, 1, 8, 8, 5),
    (2, 3, 17, 17, 16, 16, 48),
    (2, 2, 9, 33, 24, 8, 7),
    (1, 4, 64, 129, 32, 12, 40),
]


def _inputs(shape, dtype=torch.float64, seed=0):
    b, h, nq, n, f, dv, c = shape
    g = torch.Generator().manual_seed(seed)
    phi_q = torch.rand(b, h, nq, f, generator=g, dtype=torch.float64)
    phi_k = torch.rand(b, h, n, f, generator=g, dtype=torch.float64)
    phi_k[..., ::3, : f // 2] = 0.0  # some features exactly 0, as relu maps give
    v = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)
    weight = torch.randn(c, h * dv, generator=g, dtype=torch.float64) / (h * dv) ** 0.5
    bias = torch.randn(c, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (phi_q, phi_k, v, weight, bias)]


def _reference(phi_q, phi_k, v, weight, bias, eps, key_mask=None) -> torch.Tensor:
    """[B, Nq, C] float64: the quadratic attention of the features, heads concatenated, then x W^T + b."""
    b, h, nq, _ = phi_q.shape
    out = quadratic_linear_attention(phi_q, phi_k, v, 'relu', eps, key_mask)  # relu: the identity on features
    out = out.transpose(1, 2).reshape(b, nq, h * v.shape[-1])
    out = out @ weight.double().t()
    return out if bias is None else out + bias.double()


def _key_mask(kind: str, b: int, h: int, n: int):
    g = torch.Generator().manual_seed(7)
    if kind == 'none':
        return None
    keep = torch.rand(b, n, generator=g) > 0.4
    keep[:, 0] = True
    if kind == 'bool':
        return keep
    weights = torch.rand(b, h, n, generator=g, dtype=torch.float64) * 2
    return torch.where(keep[:, None, :], weights, 0.0)  # float weights per head, zeros drop keys


@pytest.mark.parametrize('mask', ['none', 'bool', 'per-head-weights'])
@pytest.mark.parametrize('eps', [1e-6, 0.5])
@pytest.mark.parametrize('shape', SHAPES, ids=lambda s: 'B{}-H{}-Nq{}-N{}-F{}-Dv{}-C{}'.format(*s))
def test_matches_attention_then_projection_in_float64(shape, eps, mask):
    phi_q, phi_k, v, weight, bias = _inputs(shape)
    key_mask = _key_mask(mask, shape[0], shape[1], shape[3])
    got = projected_linear_attention_from_features(phi_q, phi_k, v, weight, bias, eps, key_mask)
    ref = _reference(phi_q, phi_k, v, weight, bias, eps, key_mask)
    assert got.shape == ref.shape and got.dtype == torch.float64
    assert rel_err(got, ref) <= 1e-12


@pytest.mark.parametrize('shape', SHAPES[1:], ids=lambda s: 'B{}-H{}-Nq{}-N{}-F{}-Dv{}-C{}'.format(*s))
def test_float32_is_close_and_bias_is_optional(shape):
    phi_q, phi_k, v, weight, _ = _inputs(shape, torch.float32, seed=1)
    got = projected_linear_attention_from_features(phi_q, phi_k, v, weight, None)
    assert got.dtype == torch.float32
    assert rel_err(got, _reference(phi_q, phi_k, v, weight, None, 1e-6)) <= 1e-5


def test_strided_features_and_all_masked_keys():
    """q and k as views of a packed projection (the layer's layout); a sample whose keys are all masked gives the
    projection's bias alone (its attention output is 0), as the reference does."""
    b, h, n, f, c = 2, 3, 11, 8, 10
    g = torch.Generator().manual_seed(2)
    packed = torch.rand(b, n, 3, h, f, generator=g, dtype=torch.float64)
    phi_q, phi_k, v = packed.permute(2, 0, 3, 1, 4).unbind(0)
    weight = torch.randn(c, h * f, generator=g, dtype=torch.float64)
    bias = torch.randn(c, generator=g, dtype=torch.float64)
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[1] = False
    got = projected_linear_attention_from_features(phi_q, phi_k, v, weight, bias, 1e-6, keep)
    assert rel_err(got, _reference(phi_q, phi_k, v, weight, bias, 1e-6, keep)) <= 1e-12
    assert torch.equal(got[1], bias.expand(n, c))


def test_inputs_are_not_modified():
    phi_q, phi_k, v, weight, bias = _inputs(SHAPES[1])
    before = [t.clone() for t in (phi_q, phi_k, v, weight, bias)]
    projected_linear_attention_from_features(phi_q, phi_k, v, weight, bias)
    assert all(torch.equal(a, b) for a, b in zip(before, (phi_q, phi_k, v, weight, bias)))


@pytest.mark.parametrize('weight_shape, bias_shape, message', [
    ((5, 47), (5,), r"the projection weight must have shape \[C, H \* Dv\] = \[C, 48\] for v of shape "
                    r"\[2, 3, 17, 16\], got \[5, 47\]"),
    ((48,), None, r"the projection weight must have shape \[C, H \* Dv\] = \[C, 48\] .* got \[48\]"),
    ((5, 48), (4,), r"the projection bias must have shape \[C\] = \[5\], got \[4\]"),
])
def test_bad_projection_shapes_are_named(weight_shape, bias_shape, message):
    phi_q, phi_k, v, _, _ = _inputs(SHAPES[1])
    weight = torch.zeros(weight_shape, dtype=torch.float64)
    bias = None if bias_shape is None else torch.zeros(bias_shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        projected_linear_attention_from_features(phi_q, phi_k, v, weight, bias)


def test_bad_attention_shapes_are_named():
    phi_q, phi_k, v, weight, bias = _inputs(SHAPES[1])
    with pytest.raises(ValueError, match='q and k must share the feature width D'):
        projected_linear_attention_from_features(phi_q[..., :-1], phi_k, v, weight, bias)


@pytest.mark.compiler
@pytest.mark.parametrize('mask', ['none', 'bool', 'per-head-weights', 'all-masked-row'])
def test_compiled_matches_the_reference_in_one_graph(mask):
    """Compiled code normalises token-major with its own formula (not the eager one): every mask kind, an eps large
    enough to move the result (a per-head eps count broadcast over the wrong axis would show), a batch element
    whose keys are all masked (its attention is 0, so the output is the bias)."""
    shape = SHAPES[2]
    phi_q, phi_k, v, weight, bias = _inputs(shape, torch.float32, seed=3)
    key_mask = _key_mask('per-head-weights' if mask == 'all-masked-row' else mask, shape[0], shape[1], shape[3])
    if mask == 'all-masked-row':
        key_mask[1] = 0.0
    compiled = torch.compile(projected_linear_attention_from_features, fullgraph=True)
    got = compiled(phi_q, phi_k, v, weight, bias, 0.5, key_mask)
    assert rel_err(got, _reference(phi_q, phi_k, v, weight, bias, 0.5, key_mask)) <= 1e-5
    if mask == 'all-masked-row':
        assert torch.allclose(got[1], bias.expand_as(got[1]), atol=1e-6)


# ---- projected_linear_attention_from_inputs: v = x W_v^T + b_v, never formed ----


def _value_inputs(shape, c_in, dtype=torch.float64, seed=0):
    """(phi_q, phi_k, x, value_weight, value_bias, weight, bias) for ``shape`` (B, H, Nq, N, F, Dv, C)."""
    b, h, _, n, _, dv, _ = shape
    phi_q, phi_k, _, weight, bias = _inputs(shape, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(b, n, c_in, generator=g, dtype=torch.float64)
    value_weight = torch.randn(h * dv, c_in, generator=g, dtype=torch.float64) / c_in ** 0.5
    value_bias = torch.randn(h * dv, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (phi_q, phi_k, x, value_weight, value_bias, weight, bias)]


def _values(x, value_weight, value_bias, h):
    """The float64 values the reference attends over: x W_v^T + b_v split into heads -> [B, H, N, Dv]."""
    v = x.double() @ value_weight.double().t()
    if value_bias is not None:
        v = v + value_bias.double()
    return v.reshape(x.shape[0], x.shape[1], h, -1).transpose(1, 2)


@pytest.mark.parametrize('eps', [1e-6, 0.5])
@pytest.mark.parametrize('c_in', [5, 48])
@pytest.mark.parametrize('shape', SHAPES, ids=lambda s: 'B{}-H{}-Nq{}-N{}-F{}-Dv{}-C{}'.format(*s))
def test_from_inputs_matches_projected_values_in_float64(shape, c_in, eps):
    phi_q, phi_k, x, value_weight, value_bias, weight, bias = _value_inputs(shape, c_in)
    got = projected_linear_attention_from_inputs(phi_q, phi_k, x, value_weight, value_bias, weight, bias, eps)
    ref = _reference(phi_q, phi_k, _values(x, value_weight, value_bias, shape[1]), weight, bias, eps)
    assert got.shape == ref.shape and got.dtype == torch.float64
    assert rel_err(got, ref) <= 1e-12


@pytest.mark.parametrize('biases', ['none', 'value-only', 'output-only'])
def test_from_inputs_float32_is_close_and_biases_are_optional(biases):
    shape = SHAPES[3]
    phi_q, phi_k, x, value_weight, value_bias, weight, bias = _value_inputs(shape, 24, torch.float32, seed=4)
    value_bias = value_bias if biases == 'value-only' else None
    bias = bias if biases == 'output-only' else None
    got = projected_linear_attention_from_inputs(phi_q, phi_k, x, value_weight, value_bias, weight, bias)
    assert got.dtype == torch.float32
    ref = _reference(phi_q, phi_k, _values(x, value_weight, value_bias, shape[1]), weight, bias, 1e-6)
    assert rel_err(got, ref) <= 1e-5


def test_from_inputs_reads_the_layers_strided_features_and_modifies_nothing():
    """phi(q) and phi(k) as views of a packed [B, N, 2, H, F] projection (the layer's layout, read without a copy)
    and as head-major tensors give the same result, and no input changes."""
    b, h, n, f, c_in, c = 2, 3, 13, 8, 10, 7
    g = torch.Generator().manual_seed(5)
    packed = torch.rand(b, n, 2, h, f, generator=g, dtype=torch.float64)
    phi_q, phi_k = packed.permute(2, 0, 3, 1, 4).unbind(0)
    x = torch.randn(b, n, c_in, generator=g, dtype=torch.float64)
    value_weight = torch.randn(h * f, c_in, generator=g, dtype=torch.float64)
    value_bias = torch.randn(h * f, generator=g, dtype=torch.float64)
    weight = torch.randn(c, h * f, generator=g, dtype=torch.float64)
    inputs = (phi_q, phi_k, x, value_weight, value_bias, weight, None)
    before = [t.clone() for t in inputs if t is not None]
    got = projected_linear_attention_from_inputs(*inputs)
    assert all(torch.equal(a, t) for a, t in zip(before, [t for t in inputs if t is not None]))
    ref = _reference(phi_q, phi_k, _values(x, value_weight, value_bias, h), weight, None, 1e-6)
    assert rel_err(got, ref) <= 1e-12
    contiguous = projected_linear_attention_from_inputs(phi_q.contiguous(), phi_k.contiguous(), *inputs[2:])
    assert rel_err(contiguous, ref) <= 1e-12


@pytest.mark.parametrize('change, message', [
    ('x-tokens', r"the layer input x must have shape \[B, N, C_in\] = \[2, 17, C_in\] for keys of shape "
                 r"\[2, 3, 17, 16\], got \[2, 16, 5\]"),
    ('x-dims', r"the layer input x must have shape \[B, N, C_in\] .* got \[34, 5\]"),
    ('weight-heads', r"the projection weight must have shape \[C, H \* Dv\] with H = 3, got \[48, 47\]"),
    ('value-weight', r"the value weight must have shape \[H \* Dv, C_in\] = \[48, 5\] for x of shape "
                     r"\[2, 17, 5\] and a projection weight of shape \[48, 48\], got \[48, 6\]"),
    ('value-bias', r"the value bias must have shape \[H \* Dv\] = \[48\], got \[47\]"),
    # a [1] bias would broadcast over C without this check
    ('bias', r"the projection bias must have shape \[C\] = \[48\], got \[1\]"),
])
def test_from_inputs_bad_shapes_are_named(change, message):
    phi_q, phi_k, x, value_weight, value_bias, weight, bias = _value_inputs(SHAPES[1], 5)
    if change == 'x-tokens':
        x = x[:, 1:]
    elif change == 'x-dims':
        x = x.reshape(-1, 5)
    elif change == 'weight-heads':
        weight = weight[:, 1:]
    elif change == 'value-weight':
        value_weight = torch.zeros(48, 6, dtype=torch.float64)
    elif change == 'value-bias':
        value_bias = value_bias[1:]
    else:
        bias = bias[:1]
    with pytest.raises(ValueError, match=message):
        projected_linear_attention_from_inputs(phi_q, phi_k, x, value_weight, value_bias, weight, bias)


@pytest.mark.compiler
def test_from_inputs_compiled_matches_the_reference_in_one_graph():
    shape = SHAPES[2]
    phi_q, phi_k, x, value_weight, value_bias, weight, bias = _value_inputs(shape, 9, torch.float32, seed=6)
    compiled = torch.compile(projected_linear_attention_from_inputs, fullgraph=True)
    got = compiled(phi_q, phi_k, x, value_weight, value_bias, weight, bias, 0.5)
    ref = _reference(phi_q, phi_k, _values(x, value_weight, value_bias, shape[1]), weight, bias, 0.5)
    assert rel_err(got, ref) <= 1e-5
