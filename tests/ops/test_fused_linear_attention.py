"""The fused linear-attention Function against autograd of the float64 quadratic reference.

Outputs and gradients of q, k, v for every feature map with a registered derivative, with
and without masks, in float64 (gradcheck and a direct comparison) and float32; half precision at 65,536 tokens;
what the Function keeps for backward; and the errors it raises.
"""
import pytest
import torch
from references import FEATURE_MAP_REFS, rel_err

from linvit.ops import (
    FeatureMapSpec,
    feature_map_spec,
    fused_linear_attention,
    get_feature_map,
    has_fused_backward,
    list_feature_maps,
    quadratic_linear_attention,
    register_feature_map,
    unregister_feature_map,
)

FIXED_MAPS = list_feature_maps(learnable=False)
#: the maps the fused Function trains (they declare with_vjp), and those whose features it keeps for backward
MAPS = [name for name in FIXED_MAPS if feature_map_spec(name).with_vjp is not None]
KEEPING_MAPS = [name for name in MAPS if feature_map_spec(name).derivative_from_output is not None]

# (B, H, Nq, N, D, Dv): one token, odd N, Dv != D, Nq != N (cross attention)
SHAPES = [
    (1, 1, 1, 1, 8, 8),
    (2, 3, 17, 17, 16, 16),
    (2, 2, 33, 33, 8, 24),
    (1, 4, 5, 129, 32, 12),
]
MASKS = ['none', 'bool', 'per-head', 'float']


def _shape_id(shape) -> str:
    return 'B{}-H{}-Nq{}-N{}-D{}-Dv{}'.format(*shape)


def _qkv(shape, dtype=torch.float64, scale=1.0, seed=0):
    b, h, nq, n, d, dv = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=torch.float64) * scale
    k = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * scale
    v = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64) * scale
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _mask(kind, b, h, n, seed=3):
    """None, bool [B, N], bool [B, H, N] or float weights [B, N] with some zeros; key 0 is always kept."""
    if kind == 'none':
        return None
    g = torch.Generator().manual_seed(seed)
    if kind == 'float':
        w = torch.rand(b, n, generator=g, dtype=torch.float64) * 2
        w[w < 0.5] = 0.0
        w[:, 0] = 1.0
        return w
    mask = torch.rand((b, h, n) if kind == 'per-head' else (b, n), generator=g) > 0.3
    mask[..., 0] = True
    return mask


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize('mask_kind', MASKS)
@pytest.mark.parametrize('feature_map', MAPS)
def test_gradcheck_float64(feature_map, mask_kind):
    q, k, v = (t.requires_grad_(True) for t in _qkv((2, 2, 5, 6, 4, 3)))
    mask = _mask(mask_kind, 2, 2, 6)
    assert torch.autograd.gradcheck(lambda *a: fused_linear_attention(*a, feature_map, 1e-6, mask), (q, k, v))


@pytest.mark.parametrize('mask_kind', MASKS)
@pytest.mark.parametrize('feature_map', MAPS)
@pytest.mark.parametrize('shape', SHAPES, ids=_shape_id)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['fp64', 'fp32'])
def test_outputs_and_gradients_match_the_quadratic_reference(dtype, shape, feature_map, mask_kind):
    """Autograd of the float64 quadratic formula (tests/references.py) is the reference for the closed-form
    backward: q, k, v gradients within 1e-10 in float64 and 1e-5 in float32."""
    b, h, nq, n, d, dv = shape
    mask = _mask(mask_kind, b, h, n)
    ref_in = [t.requires_grad_(True) for t in _qkv(shape)]
    ins = [t.detach().to(dtype).requires_grad_(True) for t in ref_in]
    ref = quadratic_linear_attention(*ref_in, feature_map=feature_map, eps=1e-6, key_mask=mask)
    out = fused_linear_attention(*ins, feature_map=feature_map, eps=1e-6, key_mask=mask)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) <= tol
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ref_grads = _grads(ref, ref_in, grad_out)
    grads = _grads(out, ins, grad_out.to(dtype))
    # dq, dk can be ~0 where the output hardly depends on them (N=1): measure against the scale of dv as well
    scale = ref_grads[2].norm().item()
    for name, got, want in zip('qkv', grads, ref_grads):
        assert got.dtype == dtype
        err = (got.double() - want).norm().item() / max(want.norm().item(), scale)
        assert err <= tol, f"{_shape_id(shape)} d{name}: rel err {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize('feature_map', MAPS)
def test_with_vjp_gives_the_map_and_the_gradient_of_the_reference_map(feature_map):
    """Each registered derivative against autograd of the independent float64 map, zeros and all-negative rows
    included (relu's and focused's derivative at 0, rows that map to zeros)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 7, 16, generator=g, dtype=torch.float64)
    x[0, 0, :4] = 0.0
    x[1, 2] = -x[1, 2].abs()
    upstream = torch.randn(x.shape, generator=g, dtype=torch.float64)
    x_before = x.clone()
    leaf = x.clone().requires_grad_(True)
    ref = FEATURE_MAP_REFS[feature_map](leaf)
    (ref_grad,) = torch.autograd.grad(ref, leaf, upstream)
    phi, vjp = feature_map_spec(feature_map).with_vjp(x)
    torch.testing.assert_close(phi, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(vjp(upstream.clone()), ref_grad, rtol=1e-10, atol=1e-12)
    assert x.equal(x_before)  # the input itself is not mapped in place (q and k are views of the projection)


@pytest.mark.parametrize('feature_map', KEEPING_MAPS)
def test_derivative_read_off_the_output_is_the_reference_derivative(feature_map):
    """For the maps whose features the Function keeps: phi'(x) from phi(x) equals autograd's derivative of the
    independent reference map, 0 and values near it included."""
    x = torch.cat([torch.randn(200, dtype=torch.float64), torch.tensor([0.0, 1e-9, -1e-9, 30.0, -30.0])])
    leaf = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(FEATURE_MAP_REFS[feature_map](leaf).sum(), leaf)
    spec = feature_map_spec(feature_map)
    got = spec.derivative_from_output(spec.fn(x))
    torch.testing.assert_close(got.double(), expected, rtol=1e-8, atol=1e-12)


def test_every_feature_map_has_a_registered_derivative():
    # the layers train every built-in map through the Function: a new map without one must be a decision
    assert MAPS == FIXED_MAPS


def test_all_keys_masked_gives_zero_outputs_and_gradients():
    q, k, v = (t.float().requires_grad_(True) for t in _qkv((1, 2, 4, 5, 8, 8)))
    mask = torch.zeros(1, 5, dtype=torch.bool)
    out = fused_linear_attention(q, k, v, key_mask=mask)
    out.sum().backward()
    assert out.eq(0).all()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all() and t.grad.eq(0).all()


def test_non_finite_padding_reaches_neither_outputs_nor_gradients():
    q, k, v = (t.float() for t in _qkv((1, 2, 4, 7, 8, 8)))
    mask = torch.tensor([[True] * 5 + [False] * 2])
    k[..., 5:, :] = float('nan')
    v[..., 6:, :] = float('inf')
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = fused_linear_attention(q, k, v, key_mask=mask)
    out.backward(torch.ones_like(out))
    expected = quadratic_linear_attention(q.detach(), k.detach()[..., :5, :], v.detach()[..., :5, :])
    assert rel_err(out, expected) <= 1e-5
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert k.grad[..., 5:, :].eq(0).all() and v.grad[..., 5:, :].eq(0).all()


def test_relu_rows_with_no_positive_entry_stay_finite():
    q, k, v = (t.float() for t in _qkv((1, 1, 4, 9, 8, 8)))
    q[..., 1, :] = -q[..., 1, :].abs()
    q.requires_grad_(True)
    out = fused_linear_attention(q, k, v, 'relu', eps=1e-6)
    out.sum().backward()
    assert out[..., 1, :].eq(0).all() and torch.isfinite(q.grad).all()


# ---- what is kept for backward ----


def _saved_storages(fn) -> dict:
    """{storage address: bytes} of what autograd keeps for backward while ``fn()`` builds its graph."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return storages


@pytest.mark.parametrize('feature_map', MAPS)
def test_function_keeps_as_many_bytes_as_q_k_v_and_its_output(feature_map):
    """At 4,096 tokens: q, k, v (or phi(q), phi(k) and v, as many bytes) and the output (which the projection after
    it keeps anyway), plus S [D, D + 1] and the normaliser per token and head; plain autograd of the same math keeps
    several more [N, D] tensors. Maps whose derivative is read off their output keep phi, not q and k."""
    b, n, h, d = 1, 4096, 6, 64
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    kept = _saved_storages(lambda: fused_linear_attention(q, k, v, feature_map))
    qkv_bytes, out_bytes = 3 * q.numel() * 4, b * n * h * d * 4
    small = b * h * (d * (d + 1) + n) * 4
    assert sum(kept.values()) <= qkv_bytes + out_bytes + small
    keeps_phi = feature_map in KEEPING_MAPS
    assert (q.untyped_storage().data_ptr() in kept) is not keeps_phi
    plain = sum(_saved_storages(lambda: quadratic_free_plain_autograd(q, k, v)).values())
    assert plain >= sum(kept.values()) + 2 * out_bytes  # the Function's saving is real, not a measuring artefact


def quadratic_free_plain_autograd(q, k, v):
    """elu1 linear attention in O(N) written with plain autograd ops (what the layer ran before the Function)."""
    phi_q, phi_k = get_feature_map('elu1')(q), get_feature_map('elu1')(k)
    kv = phi_k.transpose(-2, -1) @ v
    z = phi_k.sum(dim=-2, keepdim=True).transpose(-2, -1)
    return (phi_q @ kv) / (phi_q @ z + 1e-6 * k.shape[-2])


# ---- half precision at image scale ----

HALF_N = 65536


@pytest.fixture(scope='module')
def big_qkv():
    return _qkv((1, 2, HALF_N, HALF_N, 32, 32), dtype=torch.float32, scale=3.0, seed=11)


@pytest.mark.slow
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['fp16', 'bf16'])
@pytest.mark.parametrize('feature_map', MAPS)
def test_half_precision_at_65k_tokens_forward_and_backward(big_qkv, feature_map, dtype):
    """B1-H2-N65536-D32 in fp16/bf16 (values ~ N(0, 3): a float16 sum of phi(k) overflows): outputs and gradients
    finite, within 1e-2 of the float32 computation."""
    grad_out = torch.randn(big_qkv[2].shape, generator=torch.Generator().manual_seed(8))
    ref_in = [t.to(dtype).float().requires_grad_(True) for t in big_qkv]
    ref = fused_linear_attention(*ref_in, feature_map=feature_map)
    ref_grads = _grads(ref, ref_in, grad_out)
    ins = [t.to(dtype).requires_grad_(True) for t in big_qkv]
    out = fused_linear_attention(*ins, feature_map=feature_map)
    grads = _grads(out, ins, grad_out.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-2
    for name, got, want in zip('qkv', grads, ref_grads):
        assert got.dtype == dtype and torch.isfinite(got).all(), f"d{name} not finite"
        assert rel_err(got, want) <= 1e-2, f"d{name}: rel err {rel_err(got, want):.2e}"


@pytest.mark.slow
def test_half_precision_under_autocast_is_finite(big_qkv):
    q, k, v = (t.to(torch.bfloat16).requires_grad_(True) for t in big_qkv)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = fused_linear_attention(q, k, v)
    out.float().square().mean().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# ---- errors ----


@pytest.fixture
def square_map():
    """Registers 'test_square' (x * x) for one test: a fixture's spec; the test may replace it."""
    register_feature_map(FeatureMapSpec('test_square', lambda x: x * x))
    yield
    unregister_feature_map('test_square')


def test_a_map_without_a_derivative_is_refused_by_name(square_map):
    assert not has_fused_backward('test_square')
    q, k, v = _qkv((1, 1, 3, 3, 4, 4))
    with pytest.raises(ValueError, match="'test_square' declares no vector-Jacobian product"):
        fused_linear_attention(q, k, v, 'test_square')
    with pytest.raises(ValueError, match='softmaxish'):
        fused_linear_attention(q, k, v, 'softmaxish')


def test_a_declared_derivative_is_used(square_map):
    def square_with_vjp(x):
        return x * x, lambda grad: grad * 2 * x

    unregister_feature_map('test_square')
    register_feature_map(FeatureMapSpec('test_square', lambda x: x * x, with_vjp=square_with_vjp))
    q, k, v = (t.requires_grad_(True) for t in _qkv((1, 2, 3, 4, 4, 4)))
    assert torch.autograd.gradcheck(lambda *a: fused_linear_attention(*a, 'test_square'), (q, k, v))


def test_a_key_mask_that_requires_grad_is_refused():
    q, k, v = _qkv((1, 1, 3, 3, 4, 4))
    with pytest.raises(ValueError, match='key_mask'):
        fused_linear_attention(q, k, v, key_mask=torch.ones(1, 3, dtype=torch.float64, requires_grad=True))


def test_bad_shapes_name_the_input():
    q, k, v = _qkv((1, 1, 3, 3, 4, 4))
    with pytest.raises(ValueError, match='k and v must hold the same number of tokens'):
        fused_linear_attention(q, k, v[..., :2, :])


# ---- compilers: dynamo traces the Function; export takes its forward ----


class _PackedAttention(torch.nn.Module):
    """qkv [B, N, 3, H, D] -> fused attention output [B, N, H, D], feature map chosen at construction."""

    def __init__(self, feature_map: str) -> None:
        super().__init__()
        self.feature_map = feature_map

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return fused_linear_attention(q, k, v, self.feature_map).transpose(1, 2)


@pytest.mark.compiler
@pytest.mark.parametrize('feature_map', MAPS)
def test_dynamo_traces_the_function_forward_and_backward_in_one_graph(feature_map):
    """fullgraph=True with the Function's own backward: one graph, and gradients equal the float64 reference."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    qkv = torch.randn(2, 9, 3, 2, 4, generator=torch.Generator().manual_seed(9), requires_grad=True)
    compiled = torch.compile(_PackedAttention(feature_map), backend=backend, fullgraph=True)
    out = compiled(qkv)
    out.square().sum().backward()
    torch._dynamo.reset()
    assert len(graphs) == 1
    assert 'autograd_function_apply' in str(graphs[0].graph)  # the Function itself, not a decomposed fallback
    ref_qkv = qkv.detach().double().requires_grad_(True)
    q, k, v = ref_qkv.permute(2, 0, 3, 1, 4).unbind(0)
    ref = quadratic_linear_attention(q, k, v, feature_map=feature_map).transpose(1, 2)
    ref.square().sum().backward()
    assert rel_err(out, ref) <= 1e-5 and rel_err(qkv.grad, ref_qkv.grad) <= 1e-5


@pytest.mark.compiler
def test_onnx_export_of_the_function_runs_in_onnxruntime(tmp_path):
    """Exported with autograd on (the training path): the forward runs in onnxruntime at the float64 reference."""
    ort = pytest.importorskip('onnxruntime')
    qkv = torch.randn(1, 33, 3, 2, 8, generator=torch.Generator().manual_seed(10))
    path = tmp_path / 'fused.onnx'
    with torch.enable_grad():
        torch.onnx.export(_PackedAttention('elu1').eval(), (qkv,), str(path), dynamo=True)
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    (got,) = session.run(None, {session.get_inputs()[0].name: qkv.numpy()})
    q, k, v = qkv.double().permute(2, 0, 3, 1, 4).unbind(0)
    ref = quadratic_linear_attention(q, k, v).transpose(1, 2)
    assert rel_err(torch.from_numpy(got), ref) <= 1e-5
