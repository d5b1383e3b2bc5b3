"""The registered attention ops (``linvit.ops.linear_attn.op``) and their Triton kernels against autograd of the
float64 quadratic reference.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on CPU tensors:
forward and gradients at several N (block multiples and not), D, Dv, masks (bool, per head, float weights, every key
of a sample masked, non-finite padding), eps values, float32 and float16; bfloat16 through the PyTorch path's
upcast (the interpreter's bfloat16 is unreliable); determinism; the errors. The op under torch.compile(fullgraph)
and TorchScript. CUDA-only tests (skipped without a GPU, run by a GPU session): bfloat16 at 64k tokens, CUDA-graph
capture and replay, no host syncs.
"""
import pytest
import torch
from references import rel_err

from linvit.ops import (
    ATTN_BACKENDS,
    kernel_unsupported_reason,
    linear_attention,
    linear_attention_op,
    linear_attention_qkv_op,
    quadratic_linear_attention,
    triton_interpreting,
)

CUDA = torch.cuda.is_available()
DEVICE = 'cuda' if CUDA else 'cpu'
KERNEL_MAPS = ['elu1', 'relu']
needs_kernels = pytest.mark.skipif(not (CUDA or triton_interpreting()),
                                   reason="the Triton kernels need CUDA or TRITON_INTERPRET=1")
cuda_only = pytest.mark.skipif(not CUDA, reason="CUDA-only check (a GPU session runs it)")

# (B, H, Nq, N, D, Dv): one token, below / at / past a 64-token block, Dv != D, cross attention, widths 32-128
SHAPES = [
    (1, 1, 1, 1, 32, 32),
    (2, 3, 63, 63, 32, 48),
    (1, 2, 64, 64, 64, 64),
    (2, 2, 130, 130, 48, 32),
    (1, 2, 70, 200, 128, 64),
    (1, 1, 40, 1000, 64, 128),
]
MASKS = ['none', 'bool', 'per-head', 'float', 'all-masked']


def _shape_id(shape) -> str:
    return 'B{}-H{}-Nq{}-N{}-D{}-Dv{}'.format(*shape)


def _inputs(shape, dtype=torch.float32, seed=0):
    b, h, nq, n, d, dv = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)
    return [t.to(device=DEVICE, dtype=dtype).requires_grad_() for t in (q, k, v)]


def _mask(kind: str, b: int, h: int, n: int):
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(b, n, generator=g) > 0.3
    keep[:, 0] = True
    if kind == 'none':
        return None
    if kind == 'bool':
        return keep.to(DEVICE)
    if kind == 'per-head':
        return (torch.rand(b, h, n, generator=g) > 0.5).to(DEVICE)
    if kind == 'float':
        return (torch.rand(b, n, generator=g) * 2.0 * keep).to(DEVICE)
    keep[0] = False  # the first sample keeps no key: its rows are exactly 0
    return keep.to(DEVICE)


def _reference(q, k, v, feature_map, eps, key_mask, grad):
    """(out, dq, dk, dv) from autograd of the float64 quadratic formula."""
    q64, k64, v64 = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    mask = None if key_mask is None else key_mask.cpu()
    out = quadratic_linear_attention(q64, k64, v64, feature_map, eps, mask)
    return (out, *torch.autograd.grad(out, (q64, k64, v64), grad.cpu().double()))


def _check(got, ref, tol, what):
    got, ref = got.cpu(), ref.cpu()  # (a GPU run compares CUDA results with CUDA references)
    if ref.double().abs().max() < 1e-6:
        # a gradient that is zero in exact arithmetic (one key: out = v whatever q is): compare absolutely
        err = (got.cpu().double() - ref.double()).abs().max().item()
        assert err < 1e-5, f"{what}: absolute error {err:.2e} where the reference is ~0"
        return
    err = rel_err(got.cpu(), ref)
    assert err < tol, f"{what}: relative error {err:.2e} (tolerance {tol:.0e})"


@needs_kernels
@pytest.mark.parametrize('shape', SHAPES, ids=_shape_id)
@pytest.mark.parametrize('feature_map', KERNEL_MAPS)
def test_kernel_forward_and_gradients_float32(shape, feature_map):
    q, k, v = _inputs(shape)
    out = linear_attention_op(q, k, v, feature_map, backend='triton')
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    ref = _reference(q, k, v, feature_map, 1e-6, None, grad)
    for name, got, want in zip(('out', 'dq', 'dk', 'dv'), (out, dq, dk, dv), ref):
        _check(got, want, 1e-5, f"{_shape_id(shape)} {feature_map} {name}")
    assert out.dtype == torch.float32 and out.shape == shape[:3] + (shape[5],)


@needs_kernels
@pytest.mark.parametrize('mask', MASKS)
@pytest.mark.parametrize('feature_map', KERNEL_MAPS)
def test_kernel_masks(mask, feature_map):
    shape = (2, 3, 70, 70, 32, 40)
    q, k, v = _inputs(shape)
    key_mask = _mask(mask, shape[0], shape[1], shape[3])
    out = linear_attention_op(q, k, v, feature_map, key_mask=key_mask, backend='triton')
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    ref = _reference(q, k, v, feature_map, 1e-6, key_mask, grad)
    for name, g, want in zip(('out', 'dq', 'dk', 'dv'), got, ref):
        if want.abs().max() == 0:
            assert g.abs().max() == 0, f"{mask} {name}: expected exact zeros"
        else:
            _check(g, want, 1e-5, f"{mask} {feature_map} {name}")
    if mask == 'all-masked':
        assert out[0].abs().max() == 0 and torch.isfinite(out).all()


@needs_kernels
def test_kernel_drops_non_finite_padding_exactly():
    """Masked keys holding nan / inf give the output of the unpadded sequence and exactly zero gradients."""
    shape = (1, 2, 20, 90, 32, 32)
    q, k, v = _inputs(shape)
    keep = torch.ones(1, 90, dtype=torch.bool, device=DEVICE)
    keep[:, 60:] = False
    k_pad, v_pad = k.detach().clone(), v.detach().clone()
    k_pad[:, :, 60:] = float('nan')
    v_pad[:, :, 60:] = float('inf')
    k_pad.requires_grad_(), v_pad.requires_grad_()
    out = linear_attention_op(q, k_pad, v_pad, key_mask=keep, backend='triton')
    dk, dv = torch.autograd.grad(out.sum(), (k_pad, v_pad))
    short = linear_attention(q.detach().double(), k.detach()[:, :, :60].double(), v.detach()[:, :, :60].double())
    _check(out, short.cpu(), 1e-5, "padded output")
    assert dk[:, :, 60:].abs().max() == 0 and dv[:, :, 60:].abs().max() == 0
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@needs_kernels
@pytest.mark.parametrize('eps', [1e-6, 1e-2, 1.0])
def test_kernel_eps_relative_to_the_mean_normaliser(eps):
    """relu rows with no positive entry have zero similarity to every key: they output exactly 0 for any eps;
    the other rows depend on eps as the float64 formula does."""
    shape = (1, 2, 50, 80, 32, 32)
    q, k, v = _inputs(shape)
    with torch.no_grad():
        q[:, :, :5] = -q[:, :, :5].abs()  # five queries map to zeros under relu
    out = linear_attention_op(q, k, v, 'relu', eps=eps, backend='triton')
    grad = torch.ones_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    ref = _reference(q, k, v, 'relu', eps, None, grad)
    for name, g, want in zip(('out', 'dq', 'dk', 'dv'), got, ref):
        _check(g, want, 1e-5, f"eps={eps} {name}")
    assert out[:, :, :5].abs().max() == 0


@needs_kernels
@pytest.mark.parametrize('feature_map', KERNEL_MAPS)
def test_packed_qkv_kernel_and_its_one_gradient(feature_map):
    """The packed op reads q, k, v inside timm's [B, N, 3, H, D] projection and writes its gradient as one tensor."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 77, 3, 4, 32, generator=g).to(DEVICE).requires_grad_()
    key_mask = _mask('bool', 2, 4, 77)
    out = linear_attention_qkv_op(qkv, feature_map, key_mask=key_mask, backend='triton')
    assert out.shape == (2, 77, 4, 32) and out.is_contiguous()
    grad = torch.randn(out.shape, generator=g).to(DEVICE)
    (grad_qkv,) = torch.autograd.grad(out, qkv, grad)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    ref = _reference(q, k, v, feature_map, 1e-6, key_mask, grad.transpose(1, 2))
    _check(out.transpose(1, 2), ref[0], 1e-5, "packed out")
    ref_grad = torch.stack([r.transpose(1, 2) for r in ref[1:]], dim=2)
    _check(grad_qkv, ref_grad, 1e-5, "packed grad")
    assert grad_qkv.shape == qkv.shape and grad_qkv.is_contiguous()


@needs_kernels
@pytest.mark.parametrize('n', [1000, 4100])
def test_kernel_float16_against_float64(n):
    """float16 inputs, float32 sums: finite, within 1e-2 of float64, output and gradients in float16."""
    shape = (1, 2, n, n, 64, 64)
    q, k, v = _inputs(shape, torch.float16)
    out = linear_attention_op(q, k, v, backend='triton')
    assert out.dtype == torch.float16
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    ref = _reference(q, k, v, 'elu1', 1e-6, None, grad)
    for name, g, want in zip(('out', 'dq', 'dk', 'dv'), got, ref):
        assert g.dtype == torch.float16 and torch.isfinite(g).all()
        _check(g, want, 1e-2, f"fp16 N={n} {name}")


def test_bfloat16_through_the_upcast_path():
    """bfloat16 on CPU: 'auto' takes the PyTorch path, which upcasts to float32; within 1e-2 of float64 at 16k
    tokens, gradients too (the GPU kernel's bfloat16 is checked by the CUDA-only test)."""
    shape = (1, 2, 16384, 16384, 32, 32)
    q, k, v = [t.detach().cpu().requires_grad_() for t in _inputs(shape, torch.bfloat16)]
    out = linear_attention_op(q, k, v, backend='auto')
    assert out.dtype == torch.bfloat16
    got = (out, *torch.autograd.grad(out.float().sum(), (q, k, v)))
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = linear_attention(*ref_inputs)
    ref = (ref_out, *torch.autograd.grad(ref_out.sum(), ref_inputs))
    for name, g, want in zip(('out', 'dq', 'dk', 'dv'), got, ref):
        _check(g, want, 1e-2, f"bf16 {name}")


@needs_kernels
@pytest.mark.parametrize('mask', ['none', 'per-head', 'all-masked'])
@pytest.mark.parametrize('shape', [(2, 2, 70, 1000, 32, 48), (1, 1, 1000, 130, 64, 64)], ids=_shape_id)
def test_kernel_programs_split_the_tokens(monkeypatch, shape, mask):
    """A GPU splits every pass into several programs per head, whose partial sums the next pass reduces: forced
    here (the interpreter's default is one program per head), up to the cap, with keys and queries split apart."""
    from linvit.ops.linear_attn import kernels as triton_kernels
    monkeypatch.setattr(triton_kernels, '_program_target', lambda device: 1000)
    b, h, nq, n, _, _ = shape
    assert triton_kernels._split(n, b * h, 32, torch.device('cpu'))[1] == min(triton_kernels.MAX_CHUNKS, -(-n // 32))
    q, k, v = _inputs(shape)
    key_mask = _mask(mask, b, h, n)
    out = linear_attention_op(q, k, v, 'elu1', key_mask=key_mask, backend='triton')
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    for name, g, want in zip(('out', 'dq', 'dk', 'dv'), got, _reference(q, k, v, 'elu1', 1e-6, key_mask, grad)):
        _check(g, want, 1e-5, f"{_shape_id(shape)} {mask} {name}")


@needs_kernels
def test_kernel_float16_relu_rows_without_features_stay_finite():
    """Under relu a query with no positive coordinate has den = eps: its gradient must not pass through g / eps in
    float16 (which overflows); its output is 0 and every gradient finite and right."""
    shape = (1, 2, 100, 100, 32, 32)
    q, k, v = _inputs(shape)
    with torch.no_grad():
        q[:, :, :10] = -q[:, :, :10].abs() - 0.1  # no feature survives relu
    q, k, v = [t.detach().half().requires_grad_() for t in (q, k, v)]
    out = linear_attention_op(q, k, v, 'relu', backend='triton')
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE).half()
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    assert out[:, :, :10].abs().max() == 0
    for name, g, want in zip(('out', 'dq', 'dk', 'dv'), got, _reference(q, k, v, 'relu', 1e-6, None, grad)):
        assert torch.isfinite(g).all(), name
        _check(g.float(), want, 5e-3, f"float16 relu {name}")


@needs_kernels
def test_kernel_is_deterministic():
    """Fixed chunking and fixed-order sums: two calls give bitwise-equal outputs and gradients."""
    shape = (2, 2, 300, 300, 32, 32)
    results = []
    for _ in range(2):
        q, k, v = _inputs(shape)
        out = linear_attention_op(q, k, v, backend='triton')
        results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize('backend', ['torch', 'auto'])
def test_torch_backends_match_the_reference(backend):
    """The op's PyTorch implementation (CPU's 'auto') is the same function, gradients too."""
    shape = (2, 3, 33, 45, 16, 24)
    q, k, v = [t.detach().cpu().requires_grad_() for t in _inputs(shape)]
    key_mask = _mask('float', 2, 3, 45).cpu()
    out = linear_attention_op(q, k, v, 'elu1', key_mask=key_mask, backend=backend)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    for name, g, want in zip(('out', 'dq', 'dk', 'dv'), got, _reference(q, k, v, 'elu1', 1e-6, key_mask, grad)):
        _check(g, want, 1e-5, f"{backend} {name}")


def test_backend_choice_and_reasons(monkeypatch):
    q = torch.randn(1, 1, 4, 32)
    assert ATTN_BACKENDS == ('auto', 'triton', 'torch')
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        linear_attention_op(q, q, q, backend='cuda')
    monkeypatch.setenv('TRITON_INTERPRET', '0')
    assert 'need CUDA' in kernel_unsupported_reason(q, q, q, 'elu1')
    with pytest.raises(ValueError, match="attn_backend='triton' cannot serve this call: the tensors are on cpu"):
        linear_attention_op(q, q, q, backend='triton')
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    assert kernel_unsupported_reason(q, q, q, 'elu1') is None
    assert 'focused' in kernel_unsupported_reason(q, q, q, 'focused')
    assert 'float64' in kernel_unsupported_reason(q.double(), q.double(), q.double(), 'elu1')
    wide = torch.randn(1, 1, 4, 256)
    assert 'exceed' in kernel_unsupported_reason(wide, wide, wide, 'elu1')
    with pytest.raises(ValueError, match="focused"):
        linear_attention_op(q, q, q, 'focused', backend='triton')
    mask = torch.ones(1, 4, requires_grad=True)
    with pytest.raises(ValueError, match="key_mask as a constant"):
        linear_attention_op(q, q, q, key_mask=mask)
    with pytest.raises(ValueError, match=r"\[B, N, 3, H, D\]"):
        linear_attention_qkv_op(q)


@pytest.mark.compiler
@pytest.mark.parametrize('backend', ['auto', pytest.param('triton', marks=needs_kernels)])
def test_op_compiles_as_one_graph(backend):
    """torch.compile(fullgraph=True) keeps the op as one node, forward and backward, equal to eager."""
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 50, 3, 2, 32, generator=g).to(DEVICE)
    weight = torch.randn(50, 2, 32, generator=g).to(DEVICE)

    def loss(t):
        return (linear_attention_qkv_op(t, 'elu1', backend=backend) * weight).sum()

    compiled = torch.compile(loss, fullgraph=True)
    results = []
    for fn in (loss, compiled):
        x = qkv.clone().requires_grad_()
        value = fn(x)
        results.append((value, *torch.autograd.grad(value, x)))
    for eager, fast in zip(*results):
        torch.testing.assert_close(fast, eager, rtol=1e-5, atol=1e-5)


def test_op_is_callable_from_torchscript():
    """TorchScript calls the registered op (what an fx-traced model's scripted graph does)."""

    @torch.jit.script
    def attend(qkv: torch.Tensor) -> torch.Tensor:
        return torch.ops.linvit.linear_attention_qkv(qkv, 'elu1', 1e-6, None, 'torch')[0]

    qkv = torch.randn(1, 9, 3, 2, 16, dtype=torch.float64)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    _check(attend(qkv).transpose(1, 2), quadratic_linear_attention(q, k, v), 1e-10, "scripted op")


# ---------------------------------------------------------------- CUDA only (a GPU session runs these)

@cuda_only
def test_cuda_bfloat16_at_64k_tokens_within_1e2_of_float32():
    shape = (1, 4, 65536, 65536, 64, 64)
    q, k, v = _inputs(shape)
    out32 = linear_attention_op(q, k, v, backend='triton')
    grads32 = torch.autograd.grad(out32.sum(), (q, k, v))
    q16, k16, v16 = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    out16 = linear_attention_op(q16, k16, v16, backend='triton')
    grads16 = torch.autograd.grad(out16.float().sum(), (q16, k16, v16))
    for name, g, want in zip(('out', 'dq', 'dk', 'dv'), (out16, *grads16), (out32, *grads32)):
        assert torch.isfinite(g).all()
        _check(g.float(), want.detach().double(), 1e-2, f"bf16 vs fp32 {name}")


@cuda_only
def test_cuda_graph_capture_and_replay_equal_eager():
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 1000, 3, 6, 64, generator=g).cuda().bfloat16().requires_grad_()
    eager = linear_attention_qkv_op(qkv)
    (eager_grad,) = torch.autograd.grad(eager.float().sum(), qkv)
    static = qkv.detach().clone().requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (kernel compilation) outside the capture
        linear_attention_qkv_op(static).float().sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    static.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_attention_qkv_op(static)
        (grad,) = torch.autograd.grad(out.float().sum(), static)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(grad, eager_grad)


@cuda_only
def test_cuda_training_step_has_no_host_sync():
    import timm

    import linvit  # noqa: F401  (registers linvit_*)
    model = timm.create_model('linvit_tiny_patch16_224', img_size=128, num_classes=10).cuda()
    images = torch.randn(2, 3, 128, 128, device='cuda')
    with torch.autocast('cuda', dtype=torch.bfloat16):
        model(images).float().sum().backward()  # warm-up: kernels compile, the allocator fills
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        with torch.autocast('cuda', dtype=torch.bfloat16):
            model(images).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode('default')


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=needs_kernels)])
def test_real_outputs_have_the_strides_the_fake_implementations_promise(backend):
    """Inductor lays out buffers from the fake implementations: the real ones must return the same strides, for
    q, k, v that are strided views of a packed projection."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    qkv = torch.randn(2, 37, 3, 2, 32).to(DEVICE)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    grad = torch.randn(2, 2, 37, 32).to(DEVICE)
    real_fwd = torch.ops.linvit.linear_attention(q, k, v, 'elu1', 1e-6, None, backend)
    real_bwd = torch.ops.linvit.linear_attention_backward(grad, q, k, v, real_fwd[0], real_fwd[1], real_fwd[2], None,
                                                          'elu1', backend)
    real_packed = torch.ops.linvit.linear_attention_qkv(qkv, 'elu1', 1e-6, None, backend)
    real_packed_bwd = torch.ops.linvit.linear_attention_qkv_backward(
        grad.transpose(1, 2), qkv, *real_packed, None, 'elu1', backend)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv, fg, fqkv = (mode.from_tensor(t) for t in (q, k, v, grad, qkv))
        fake_fwd = torch.ops.linvit.linear_attention(fq, fk, fv, 'elu1', 1e-6, None, backend)
        fake_bwd = torch.ops.linvit.linear_attention_backward(fg, fq, fk, fv, *fake_fwd, None, 'elu1', backend)
        fake_packed = torch.ops.linvit.linear_attention_qkv(fqkv, 'elu1', 1e-6, None, backend)
        fake_packed_bwd = torch.ops.linvit.linear_attention_qkv_backward(fg.transpose(1, 2), fqkv, *fake_packed,
                                                                         None, 'elu1', backend)
    pairs = [*zip(real_fwd, fake_fwd), *zip(real_bwd, fake_bwd), *zip(real_packed, fake_packed),
             (real_packed_bwd, fake_packed_bwd)]
    for real, fake in pairs:
        assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype)
