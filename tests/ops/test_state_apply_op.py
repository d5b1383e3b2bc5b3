"""The registered halves of linear attention, ``linvit::linear_attention_state`` and ``linvit::linear_attention_apply``
(``linvit.ops.linear_attention_state`` / ``linear_attention_apply`` route named maps through them): their fake
implementations (torch.library.opcheck, real strides equal to fake ones), torch.compile(fullgraph=True) with one
node per half, their autograd formulas (gradcheck in float64, equal to plain autograd of the PyTorch composition),
and the Triton key and query passes under TRITON_INTERPRET=1 against the float64 reference.
"""
import pytest
import torch
from references import rel_err

from linvit.ops import (
    AttentionState,
    add_states,
    linear_attention_apply,
    linear_attention_op,
    linear_attention_state,
    list_feature_maps,
    quadratic_linear_attention,
    triton_interpreting,
)
from linvit.ops.linear_attn.pytorch import pytorch_apply, pytorch_state

CUDA = torch.cuda.is_available()
DEVICE = 'cuda' if CUDA else 'cpu'
needs_kernels = pytest.mark.skipif(not (CUDA or triton_interpreting()),
                                   reason="the Triton kernels need CUDA or TRITON_INTERPRET=1")
OP_MAPS = list_feature_maps(learnable=False)  # every fixed map declares its vector-Jacobian product
KERNEL_MAPS = ['elu1', 'relu']
MASKS = ['none', 'bool', 'per-head', 'float', 'all-masked']


def _inputs(b=2, h=3, nq=11, n=13, d=8, dv=5, dtype=torch.float64, seed=0, device='cpu'):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, m, w, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
            for m, w in ((nq, d), (n, d), (n, dv))]


def _mask(kind, b, h, n, device='cpu'):
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(b, n, generator=g) > 0.3
    keep[:, 0] = True
    if kind == 'none':
        return None
    if kind == 'per-head':
        return (torch.rand(b, h, n, generator=g) > 0.5).to(device)
    if kind == 'float':
        return (torch.rand(b, n, generator=g, dtype=torch.float64) * 2.0 * keep).to(device)
    if kind == 'all-masked':
        keep[0] = False
    return keep.to(device)


def _state_op(k, v, feature_map='elu1', key_mask=None, backend='torch'):
    return AttentionState(*torch.ops.linvit.linear_attention_state(k, v, feature_map, key_mask, backend))


def _apply_op(q, state, feature_map='elu1', eps=1e-6, out_dtype=None, backend='torch'):
    return torch.ops.linvit.linear_attention_apply(q, state.sums, state.count, feature_map, eps, out_dtype,
                                                   backend)[0]


# ---- autograd formulas (float64, PyTorch path) ----


@pytest.mark.parametrize('mask_kind', MASKS)
@pytest.mark.parametrize('feature_map', OP_MAPS)
def test_gradcheck_of_the_state_and_apply_ops(feature_map, mask_kind):
    q, k, v = (t.requires_grad_() for t in _inputs(b=2, h=2, nq=4, n=6, d=4, dv=3))
    mask = _mask(mask_kind, 2, 2, 6)
    assert torch.autograd.gradcheck(lambda k, v: _state_op(k, v, feature_map, mask).sums, (k, v))
    state = pytorch_state(k.detach(), v.detach(), feature_map, mask)
    sums, count = state.sums.requires_grad_(), state.count.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, s, c: _apply_op(q, AttentionState(s, c), feature_map, eps=0.3), (q, sums, count))
    assert torch.autograd.gradcheck(lambda q, k, v: _apply_op(q, _state_op(k, v, feature_map, mask), feature_map),
                                    (q, k, v))


@pytest.mark.parametrize('mask_kind', MASKS)
@pytest.mark.parametrize('feature_map', OP_MAPS)
def test_the_ops_equal_plain_autograd_of_the_pytorch_composition(feature_map, mask_kind):
    """Outputs, states and every gradient (q, k, v and the count) of the public entry points, which run the ops,
    against the PyTorch path differentiated by autograd."""
    ins = [t.requires_grad_() for t in _inputs()]
    ref_ins = [t.detach().clone().requires_grad_() for t in ins]
    mask = _mask(mask_kind, 2, 3, 13)
    grad = torch.randn(2, 3, 11, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    state = linear_attention_state(ins[1], ins[2], feature_map, mask)
    count = state.count.detach().clone().requires_grad_()
    out = linear_attention_apply(ins[0], AttentionState(state.sums, count), feature_map, eps=0.1)
    ref_state = pytorch_state(ref_ins[1], ref_ins[2], feature_map, mask)
    ref_count = ref_state.count.detach().clone().requires_grad_()
    ref = pytorch_apply(ref_ins[0], AttentionState(ref_state.sums, ref_count), feature_map, eps=0.1)
    assert 'linear_attention' not in type(ref.grad_fn).__name__.lower()  # the reference is plain autograd
    torch.testing.assert_close(state.sums, ref_state.sums, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.count, ref_state.count, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out, [*ins, count], grad)
    want = torch.autograd.grad(ref, [*ref_ins, ref_count], grad)
    for name, g, w in zip(['dq', 'dk', 'dv', 'dcount'], got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_the_entry_points_run_the_ops_for_named_maps_only():
    q, k, v = _inputs(dtype=torch.float32)
    k.requires_grad_()
    assert 'StateGrad' in type(linear_attention_state(k, v).sums.grad_fn).__name__
    assert 'StateGrad' not in type(linear_attention_state(k, v, torch.relu).sums.grad_fn).__name__
    weights = torch.rand(2, 13, requires_grad=True)  # a differentiable mask: plain autograd
    state = linear_attention_state(k, v, 'elu1', weights)
    assert 'StateGrad' not in type(state.sums.grad_fn).__name__ and state.count.requires_grad
    q.requires_grad_()
    out = linear_attention_apply(q, state)  # a count that requires grad: the op gives its gradient too
    assert 'ApplyGrad' in type(out.grad_fn).__name__
    out.sum().backward()
    assert weights.grad is not None and torch.isfinite(weights.grad).all()


# ---- fake implementations and torch.compile ----


@pytest.mark.parametrize('mask_kind', ['none', 'float'])
def test_opcheck_of_the_state_and_apply_ops(mask_kind):
    q, k, v = (t.float().requires_grad_() for t in _inputs())
    mask = _mask(mask_kind, 2, 3, 13)
    mask = None if mask is None else mask.float()
    state = _state_op(k.detach(), v.detach(), 'elu1', mask)
    torch.library.opcheck(torch.ops.linvit.linear_attention_state.default, (k, v, 'elu1', mask, 'torch'))
    torch.library.opcheck(torch.ops.linvit.linear_attention_apply.default,
                          (q, state.sums.requires_grad_(), state.count, 'elu1', 1e-6, None, 'torch'))
    torch.library.opcheck(torch.ops.linvit.linear_attention_apply.default,
                          (q.detach(), state.sums.detach(), state.count, 'relu', 0.5, torch.float64, 'torch'))


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=needs_kernels)])
def test_real_outputs_have_the_strides_and_dtypes_the_fake_implementations_promise(backend):
    from torch._subclasses.fake_tensor import FakeTensorMode

    qkv = torch.randn(2, 37, 3, 2, 16).to(DEVICE)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # strided views of a packed projection
    mask = torch.rand(2, 37, device=DEVICE) > 0.2
    grad = torch.randn(2, 2, 37, 16, device=DEVICE)
    ops = torch.ops.linvit

    def calls(q, k, v, mask, grad):
        sums, count = ops.linear_attention_state(k, v, 'elu1', mask, backend)
        out, den = ops.linear_attention_apply(q, sums, count, 'elu1', 1e-6, None, backend)
        out16, _ = ops.linear_attention_apply(q, sums, count, 'elu1', 1e-6, torch.float16, backend)
        return [sums, count, out, den, out16,
                *ops.linear_attention_state_backward(grad[..., :17, :].transpose(-2, -1)[..., :16].contiguous()
                                                     .new_ones(sums.shape), k, v, mask, 'elu1', backend),
                *ops.linear_attention_apply_backward(grad, q, sums, count, out, den, 'elu1', 1e-6, True, backend),
                *ops.linear_attention_apply_backward(grad, q, sums, count, out, den, 'elu1', 1e-6, False, backend)]

    real = calls(q, k, v, mask, grad)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = calls(*(mode.from_tensor(t) for t in (q, k, v, mask, grad)))
    for i, (r, f) in enumerate(zip(real, fake)):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), f"output {i}"


@pytest.mark.compiler
def test_compile_fullgraph_holds_one_node_per_half_and_matches_eager():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def attend(q, k, v, mask):
        first = linear_attention_state(k[:, :, :7], v[:, :, :7], 'elu1', mask[:, :7])
        second = linear_attention_state(k[:, :, 7:], v[:, :, 7:], 'elu1', mask[:, 7:])
        return linear_attention_apply(q, add_states(first, second), 'elu1')

    q, k, v = (t.float().requires_grad_() for t in _inputs())
    mask = _mask('bool', 2, 3, 13)
    torch._dynamo.reset()
    out = torch.compile(attend, backend=backend, fullgraph=True)(q, k, v, mask)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    torch._dynamo.reset()
    assert len(graphs) == 1
    code = graphs[0].code
    assert code.count('linvit.linear_attention_state') == 2 and code.count('linvit.linear_attention_apply') == 1
    ref_ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = attend(*ref_ins, mask)
    torch.testing.assert_close(out, ref)
    for g, w in zip(grads, torch.autograd.grad(ref.square().sum(), ref_ins)):
        torch.testing.assert_close(g, w)


# ---- the Triton key and query passes ----


@needs_kernels
@pytest.mark.parametrize('mask_kind', MASKS)
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16], ids=['fp32', 'fp16'])
@pytest.mark.parametrize('shape', [(2, 3, 9, 70, 16, 24), (1, 2, 130, 40, 32, 32)],
                         ids=lambda s: 'B{}-H{}-Nq{}-N{}-D{}-Dv{}'.format(*s))
@pytest.mark.parametrize('feature_map', KERNEL_MAPS)
def test_kernel_halves_against_the_float64_reference(feature_map, shape, dtype, mask_kind):
    """The state from the key pass, the output from the query pass and dq, dk, dv through both backward passes."""
    b, h, nq, n, d, dv = shape
    q, k, v = (t.requires_grad_() for t in _inputs(*shape, dtype=dtype, seed=5, device=DEVICE))
    mask = _mask(mask_kind, b, h, n, DEVICE)
    state = _state_op(k, v, feature_map, mask, 'triton')
    out = _apply_op(q, state, feature_map, 1e-6, None, 'triton')
    assert state.sums.dtype == torch.float32 and out.dtype == dtype
    ref_ins = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    cpu_mask = None if mask is None else mask.cpu()
    ref_state = pytorch_state(ref_ins[1].detach(), ref_ins[2].detach(), feature_map, cpu_mask)
    ref = quadratic_linear_attention(*ref_ins, feature_map, 1e-6, cpu_mask)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert rel_err(state.sums.cpu(), ref_state.sums) < tol
    torch.testing.assert_close(state.count.cpu().double(), ref_state.count, rtol=1e-6, atol=0)
    assert rel_err(out.cpu(), ref) < tol
    got = torch.autograd.grad(out, (q, k, v), grad.to(device=DEVICE, dtype=dtype))
    want = torch.autograd.grad(ref, ref_ins, grad)
    for name, g, w in zip(['dq', 'dk', 'dv'], got, want):
        if w.abs().max() < 1e-9:  # every key masked: zero gradients, exactly
            assert g.abs().max() == 0, name
        else:
            assert rel_err(g.cpu(), w) < 2 * tol, name


@needs_kernels
def test_the_plain_op_is_the_composition_of_the_halves():
    q, k, v = _inputs(2, 2, 50, 90, 32, 32, dtype=torch.float32, seed=7, device=DEVICE)
    mask = _mask('float', 2, 2, 90, DEVICE).float()
    halves = _apply_op(q, _state_op(k, v, 'elu1', mask, 'triton'), 'elu1', 1e-6, None, 'triton')
    torch.testing.assert_close(halves, linear_attention_op(q, k, v, 'elu1', key_mask=mask, backend='triton'),
                               rtol=1e-5, atol=1e-6)


@needs_kernels
def test_kernel_states_of_chunks_add_up_and_a_float_count_grad_flows():
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 20, 60, 16, 16, dtype=torch.float32, device=DEVICE))
    parts = [_state_op(k[:, :, i:i + 20], v[:, :, i:i + 20], 'relu', None, 'triton') for i in (0, 20, 40)]
    state = add_states(add_states(parts[0], parts[1]), parts[2])
    count = state.count.detach().requires_grad_()
    out = _apply_op(q, AttentionState(state.sums, count), 'relu', 0.2, torch.float32, 'triton')
    ref_count = count.detach().cpu().double().requires_grad_()
    ref_state = pytorch_state(k.detach().cpu().double(), v.detach().cpu().double(), 'relu')
    ref = pytorch_apply(q.detach().cpu().double(), AttentionState(ref_state.sums, ref_count), 'relu', 0.2)
    assert rel_err(out.cpu(), ref) < 1e-5
    (g,) = torch.autograd.grad(out.sum(), count)
    (w,) = torch.autograd.grad(ref.sum(), ref_count)
    assert rel_err(g.cpu(), w) < 1e-4


def test_errors_name_what_is_wrong():
    q, k, v = _inputs()
    state = linear_attention_state(k, v)  # float64: the PyTorch path
    with pytest.raises(ValueError, match="cannot serve this call: the state holds torch.float64 sums"):
        _apply_op(q.float(), state, backend='triton')
    with pytest.raises(ValueError, match='the same feature map'):
        linear_attention_apply(q[..., :4], state)
    with pytest.raises(ValueError, match=r'k \[B, H, N, D\] and v \[B, H, N, Dv\]'):
        linear_attention_state(k, v[:, :, :3])
