"""Causal linear attention (parallel, chunked, recurrent, step) and the bidirectional scans against the float64
references in tests/references.py (explicit products of the multipliers over every pair): outputs, gradients of
the memory-efficient backward (gradcheck and against autograd of the reference), bytes saved for backward at
16k tokens, long sequences with small gates, half precision, torch.compile."""
import importlib

import pytest
import torch
from references import bidirectional_ref, causal_ref, rel_err

from linvit.ops import linear_attention, list_feature_maps
from linvit.ops.causal import (
    CausalState,
    ChunkedCausalScan,
    bidirectional_linear_attention,
    causal_linear_attention,
    causal_linear_attention_step,
    retention_decays,
)


def _qkv(b=2, h=3, n=37, d=8, dv=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, x, generator=g, dtype=torch.float64).to(dtype) for x in (d, d, dv)]


def _gate(b, h, n, dg, seed=1, low=0.5):
    g = torch.Generator().manual_seed(seed)
    return low + (1 - low) * torch.rand(b, h, n, dg, generator=g, dtype=torch.float64)


VARIANTS = {
    'plain': lambda b, h, n, d: {},
    'decay': lambda b, h, n, d: {'decay': 0.9},
    'decay-per-head': lambda b, h, n, d: {'decay': [0.8, 0.95, 1.0][:h]},
    'gate-channel': lambda b, h, n, d: {'gate': _gate(b, h, n, d)},
    'gate-token': lambda b, h, n, d: {'gate': _gate(b, h, n, 1)},
    'decay-gate': lambda b, h, n, d: {'decay': 0.97, 'gate': _gate(b, h, n, d)},
}
@pytest.fixture(params=['matrix', 'scan'])
def state_path(request, monkeypatch):
    """Chunk states from the weighted sum over chunks (short sequences) or the Hillis-Steele scan (long ones)."""
    import linvit.ops.causal.chunk as chunk
    for name in ('MATRIX_MAX_CHUNKS', 'CHANNEL_MATRIX_MAX_CHUNKS'):
        monkeypatch.setattr(chunk, name, 10 ** 9 if request.param == 'matrix' else 0)
    return request.param


SHAPES = [(2, 3, 37, 8, 5, 8), (1, 2, 64, 4, 4, 16), (1, 3, 20, 6, 3, 7)]  # B, H, N, D, Dv, chunk (divides or not)


def _name(shape):
    b, h, n, d, dv, chunk = shape
    return f"B{b}-H{h}-N{n}-D{d}-Dv{dv}-L{chunk}"


@pytest.mark.parametrize('variant', list(VARIANTS))
@pytest.mark.parametrize('shape', SHAPES, ids=_name)
def test_every_form_equals_the_reference(shape, variant, state_path):
    b, h, n, d, dv, chunk = shape
    q, k, v = _qkv(b, h, n, d, dv)
    kw = VARIANTS[variant](b, h, n, d)
    ref = causal_ref(q, k, v, **kw)
    for form in ('parallel', 'chunked', 'recurrent'):
        got = causal_linear_attention(q, k, v, form=form, chunk_size=chunk, **kw)
        assert rel_err(got, ref) < 1e-12, form


@pytest.mark.parametrize('variant', list(VARIANTS))
@pytest.mark.parametrize('chunk', [16, 13, 64, 200])
def test_forms_agree_in_float32(variant, chunk):
    q, k, v = _qkv(2, 3, 150, 16, 16, dtype=torch.float32)
    kw = {key: (val.float() if isinstance(val, torch.Tensor) else val)
          for key, val in VARIANTS[variant](2, 3, 150, 16).items()}
    parallel = causal_linear_attention(q, k, v, form='parallel', **kw)
    chunked = causal_linear_attention(q, k, v, form='chunked', chunk_size=chunk, **kw)
    recurrent = causal_linear_attention(q, k, v, form='recurrent', **kw)
    assert chunked.dtype == torch.float32
    assert (chunked - parallel).abs().max() / parallel.abs().max() <= 1e-5
    assert (recurrent - parallel).abs().max() / parallel.abs().max() <= 1e-5


@pytest.mark.parametrize('feature_map', list_feature_maps(learnable=False))
def test_feature_maps_and_the_last_row_is_noncausal_attention(feature_map):
    q, k, v = _qkv(1, 2, 30, 8, 8)
    got = causal_linear_attention(q, k, v, feature_map=feature_map, chunk_size=8)
    assert rel_err(got, causal_ref(q, k, v, feature_map)) < 1e-12
    # without decay the last token sees every key: the non-causal core (eps relative to the mean) over all of them
    full = linear_attention(q, k, v, feature_map)
    assert rel_err(got[:, :, -1], full[:, :, -1]) < 1e-12


def test_no_token_sees_the_future():
    q, k, v = _qkv(1, 2, 40, 8, 8)
    kw = {'gate': _gate(1, 2, 40, 8), 'decay': 0.9}
    before = causal_linear_attention(q, k, v, chunk_size=16, **kw)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 25:] += 5.0
    v2[:, :, 25:] -= 3.0
    kw['gate'][:, :, 25:] = 0.1
    after = causal_linear_attention(q, k2, v2, chunk_size=16, **kw)
    assert torch.equal(before[:, :, :25], after[:, :, :25])
    assert (before[:, :, 25:] - after[:, :, 25:]).abs().max() > 0.1


def _reference_grads(fn, tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    g = torch.Generator().manual_seed(5)
    grad = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, leaves, grad)


@pytest.mark.parametrize('chunk', [8, 20])  # per-channel gates: float64 factors (<= 17 tokens) or [L, L, D] weights
@pytest.mark.parametrize('variant', ['plain', 'decay-per-head', 'gate-channel', 'gate-token'])
def test_chunked_backward_equals_autograd_of_the_reference(variant, chunk, state_path):
    b, h, n, d, dv = 2, 3, 29, 6, 4
    q, k, v = _qkv(b, h, n, d, dv)
    kw = VARIANTS[variant](b, h, n, d)
    tensors = [q, k, v]
    if 'gate' in kw:
        tensors.append(kw.pop('gate'))
    if 'decay' in kw:
        tensors.append(torch.tensor(kw.pop('decay'), dtype=torch.float64))

    def call(fn, *args):
        extra = dict(zip(['gate', 'decay'] if 'gate' in VARIANTS[variant](b, h, n, d) else ['decay'], args[3:]))
        return fn(args[0], args[1], args[2], **extra)

    got = _reference_grads(lambda *t: call(lambda *a, **e: causal_linear_attention(*a, chunk_size=chunk, **e), *t),
                           tensors)
    ref = _reference_grads(lambda *t: call(causal_ref, *t), tensors)
    for name, x, y in zip(['q', 'k', 'v', 'extra'], got, ref):
        assert rel_err(x, y) < 1e-10, name


def test_gradcheck_of_the_chunked_function(state_path):
    g = torch.Generator().manual_seed(0)
    phi_q = torch.rand(1, 2, 11, 3, generator=g, dtype=torch.float64, requires_grad=True)
    phi_k = torch.rand(1, 2, 11, 3, generator=g, dtype=torch.float64, requires_grad=True)
    va = torch.randn(1, 2, 11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    for a in (None, -torch.rand(1, 2, 11, 3, generator=g, dtype=torch.float64),
              -torch.rand(1, 2, 11, 1, generator=g, dtype=torch.float64),
              -torch.rand(1, 2, 1, 1, generator=g, dtype=torch.float64)):
        inputs = (phi_q, phi_k, va, None if a is None else a.requires_grad_())
        assert torch.autograd.gradcheck(lambda *t: ChunkedCausalScan.apply(*t, 4), inputs)


def test_gradcheck_through_the_feature_map_and_log_gate():
    q, k, v = [t[:, :, :13].requires_grad_() for t in _qkv(1, 2, 13, 3, 2)]
    log_gate = torch.nn.functional.logsigmoid(torch.randn(1, 2, 13, 3, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v, lg: causal_linear_attention(q, k, v, log_gate=lg, chunk_size=5), (q, k, v, log_gate))


def _saved_bytes(fn):
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(total), out


@pytest.mark.parametrize('with_gate', [False, True])
def test_saved_bytes_stay_a_small_multiple_of_qkv_at_16k_tokens(with_gate):
    b, h, n, d = 1, 2, 16384, 64
    q, k, v = [t.requires_grad_() for t in _qkv(b, h, n, d, d, dtype=torch.float32)]
    log_gate = None
    if with_gate:
        log_gate = torch.nn.functional.logsigmoid(torch.randn(b, h, n, d) + 4).requires_grad_()
    saved, out = _saved_bytes(lambda: causal_linear_attention(q, k, v, log_gate=log_gate, chunk_size=64))
    input_bytes = (4 if with_gate else 3) * q.numel() * q.element_size()  # q, k, v (and the gate: one more)
    # phi(q), phi(k), [v | 1], the map's own input, the output and normaliser (the gate and its log): ~2.5x the
    # inputs; one [D, Dv] state per token would be 16x more than all of them, one per chunk a quarter
    assert saved <= 3 * input_bytes, saved / input_bytes
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_long_sequence_with_small_gates_neither_underflows_nor_overflows(state_path):
    # a cumulative product of 4096 gates near 0.5 is 2^-4096: 0 in float32 (and float64); the scans never form it
    q, k, v = _qkv(1, 2, 4096, 8, 8, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    gate = 0.3 + 0.4 * torch.rand(1, 2, 4096, 8, generator=g)
    gate[:, :, 1000] = 0.0  # a full forget: tokens after it see nothing before it
    chunked = causal_linear_attention(q, k, v, gate=gate, chunk_size=64)
    recurrent = causal_linear_attention(q, k, v, gate=gate, form='recurrent')
    assert torch.isfinite(chunked).all()
    assert (chunked - recurrent).abs().max() / recurrent.abs().max() <= 1e-5
    # after a full forget the output depends only on tokens from the forget on; eps counts every key seen since
    # the start, so compare with eps ~ 0 to make the two normalisers equal
    full0 = causal_linear_attention(q, k, v, gate=gate, eps=1e-30, chunk_size=64)[:, :, 1000:1100]
    tail0 = causal_linear_attention(q[:, :, 1000:1100], k[:, :, 1000:1100], v[:, :, 1000:1100],
                                    gate=gate[:, :, 1000:1100], eps=1e-30, chunk_size=64)
    assert (full0 - tail0).abs().max() <= 1e-5 * tail0.abs().max()


@pytest.mark.parametrize('chunk', [16, 17, 32])
def test_gates_of_zero_in_every_chunk_stay_finite(chunk):
    # every gate 0: log multipliers at their floor (-40) all along, the most extreme factors a chunk can hold
    q, k, v = _qkv(1, 2, 100, 8, 8, dtype=torch.float32)
    gate = torch.zeros(1, 2, 100, 8)
    chunked = causal_linear_attention(q, k, v, gate=gate, chunk_size=chunk)
    recurrent = causal_linear_attention(q, k, v, gate=gate, form='recurrent')
    assert torch.isfinite(chunked).all()
    assert (chunked - recurrent).abs().max() <= 1e-5 * recurrent.abs().max()


def test_step_api_equals_the_chunked_form_with_a_constant_state():
    b, h, n, d, dv = 2, 3, 50, 8, 6
    q, k, v = _qkv(b, h, n, d, dv, dtype=torch.float32)
    gate = _gate(b, h, n, d).float()
    decay = retention_decays(h)
    full = causal_linear_attention(q, k, v, decay=decay, gate=gate, chunk_size=16)
    state = None
    rows = []
    for t in range(n):
        out_t, state = causal_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, decay=decay,
                                                    gate_t=gate[:, :, t])
        assert isinstance(state, CausalState) and state.kv.shape == (b, h, d, dv + 1) and state.steps == t + 1
        rows.append(out_t)
    assert (torch.stack(rows, 2) - full).abs().max() <= 1e-5 * full.abs().max()


def test_retention_decays():
    gammas = retention_decays(4)
    assert torch.allclose(gammas, torch.tensor([1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128, 1 - 1 / 256], dtype=torch.float64))
    many = retention_decays(12)
    assert many.shape == (12,) and many[0] == 1 - 2 ** -5 and many[-1] == 1 - 2 ** -12
    assert (many[1:] > many[:-1]).all()


@pytest.mark.parametrize('kwargs, message', [
    ({'form': 'scan'}, 'form must be one of'),
    ({'chunk_size': 0}, 'chunk_size must be an int >= 1 or None'),
    ({'decay': 1.5}, r'decay values must lie in \(0, 1\]'),
    ({'decay': [0.9, 0.9]}, 'one value per head'),
    ({'gate': torch.ones(1, 3, 10, 5)}, r'gate must have shape \[B, H, N, D\]'),
    ({'gate': torch.ones(1, 3, 10, 8), 'log_gate': torch.zeros(1, 3, 10, 8)}, 'not both'),
])
def test_bad_arguments_are_named(kwargs, message):
    q, k, v = _qkv(1, 3, 10, 8, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        causal_linear_attention(q, k, v, **kwargs)


def test_half_precision_at_16k_tokens():
    q, k, v = _qkv(1, 2, 16384, 32, 32, dtype=torch.float32)
    gate = torch.sigmoid(torch.randn(1, 2, 16384, 32) + 3)
    ref = causal_linear_attention(q, k, v, gate=gate, decay=0.999)
    got = causal_linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), gate=gate.bfloat16(), decay=0.999)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert (got.float() - ref).abs().max() / ref.abs().max() <= 2e-2


@pytest.mark.compiler
def test_chunked_function_compiles_as_one_graph():
    q, k, v = _qkv(1, 2, 100, 8, 8, dtype=torch.float32)
    log_gate = torch.nn.functional.logsigmoid(torch.randn(1, 2, 100, 8))

    def loss(q, k, v, lg):
        return causal_linear_attention(q, k, v, log_gate=lg, decay=0.95, chunk_size=32).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend='aot_eager')
    eager_in = [t.clone().requires_grad_() for t in (q, k, v, log_gate)]
    comp_in = [t.clone().requires_grad_() for t in (q, k, v, log_gate)]
    loss(*eager_in).backward()
    compiled(*comp_in).backward()
    for a, b in zip(eager_in, comp_in):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5)


# ---- bidirectional ----


def _grid_orders(h, w, prefix=0):
    raster = torch.arange(prefix + h * w)
    column = torch.cat([torch.arange(prefix), prefix + torch.arange(h * w).reshape(h, w).T.reshape(-1)])
    return [raster, column]


@pytest.mark.parametrize('variant', ['plain', 'decay-per-head', 'gate-channel', 'decay-gate'])
@pytest.mark.parametrize('two_orders', [False, True])
def test_bidirectional_equals_the_reference(variant, two_orders):
    b, h, n, d, dv = 2, 3, 1 + 4 * 5, 6, 4
    q, k, v = _qkv(b, h, n, d, dv)
    kw = VARIANTS[variant](b, h, n, d)
    orders = _grid_orders(4, 5, prefix=1) if two_orders else None
    got = bidirectional_linear_attention(q, k, v, chunk_size=8, orders=orders, **kw)
    assert rel_err(got, bidirectional_ref(q, k, v, orders=orders, **kw)) < 1e-12


def test_bidirectional_without_decay_is_noncausal_linear_attention():
    q, k, v = _qkv(1, 2, 24, 8, 8)
    # every weight is 1 except the diagonal... also 1: plain linear attention (eps scaled the same way)
    got = bidirectional_linear_attention(q, k, v, chunk_size=5)
    assert rel_err(got, linear_attention(q, k, v)) < 1e-12


def test_bidirectional_gradients_equal_the_reference(state_path):
    b, h, n, d = 1, 2, 12, 4
    q, k, v = _qkv(b, h, n, d, 3)
    gate = _gate(b, h, n, d)
    orders = _grid_orders(3, 4)
    got = _reference_grads(lambda q, k, v, g: bidirectional_linear_attention(q, k, v, gate=g, decay=0.9,
                                                                             chunk_size=5, orders=orders),
                           [q, k, v, gate])
    ref = _reference_grads(lambda q, k, v, g: bidirectional_ref(q, k, v, gate=g, decay=0.9, orders=orders),
                           [q, k, v, gate])
    for name, x, y in zip('qkvg', got, ref):
        assert rel_err(x, y) < 1e-10, name


@pytest.mark.parametrize('variant', ['plain', 'decay-per-head', 'gate-channel', 'gate-token'])
def test_the_export_path_states_equal_the_scan(variant, monkeypatch):
    # under torch.export the chunk states come from one weighted sum over chunks (no loop over the chunk count)
    q, k, v = _qkv(2, 3, 150, 8, 5)
    kw = VARIANTS[variant](2, 3, 150, 8)
    scanned = causal_linear_attention(q, k, v, chunk_size=16, **kw)
    common = importlib.import_module('linvit.ops.common')
    monkeypatch.setattr(common, 'is_exporting', lambda: True)
    exported = causal_linear_attention(q, k, v, chunk_size=16, **kw)
    assert rel_err(exported, scanned) < 1e-12
    assert rel_err(exported, causal_ref(q, k, v, **kw)) < 1e-12
