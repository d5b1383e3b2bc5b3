"""The 2025 linear-attention recipe: the normalisers (InLine's injective one, MALA's magnitude-aware one), the
norm-times-direction map (``nala``) and polarity-aware attention (``polar``), each against a float64 reference
written from its formula in tests/references.py; in half precision at 64k tokens; compiled as one graph; linear in
the number of tokens; and refused, with a reason, where a fast path or form does not compute it."""
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from references import (
    elu1_ref,
    layer_projection_ref,
    layer_qkv_ref,
    norm_direction_ref,
    normalized_attention_ref,
    normalized_weights_ref,
    polarity_ref,
    random_layer,
    rel_err,
)
from torch.utils.flop_counter import FlopCounterMode

import linvit
from linvit import fast
from linvit.engine import TrainStep
from linvit.layers import ATTENTION_FAMILIES, LinearAttention
from linvit.layers.feature_map import NormDirectionFeatureMap
from linvit.ops import list_normalizers, norm_direction, normalized_attention_from_features

NEW_NORMALIZERS = [name for name in list_normalizers() if name != 'divide']
DIM, HEADS = 32, 4
#: a layer of each new kind, by the options a user passes
KINDS = {'inline': dict(normalizer='inline'), 'mala': dict(normalizer='mala'), 'nala': dict(feature_map='nala'),
         'polar': dict(attn_family='polar')}


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


def _qkv(b=2, h=3, nq=7, n=11, d=8, seed=0):
    g = _generator(seed)
    return (torch.randn(b, h, nq, d, generator=g, dtype=torch.float64),
            torch.randn(b, h, n, d, generator=g, dtype=torch.float64),
            torch.randn(b, h, n, 5, generator=g, dtype=torch.float64))


def _layer(kind, seed=0, **options):
    """A float64 layer of ``kind`` with every parameter drawn at random."""
    options = {**KINDS[kind], **options}
    return random_layer(ATTENTION_FAMILIES[options.pop('attn_family', 'linear')], DIM, HEADS, seed, **options)


def _layer_ref(layer, kind, x):
    """The layer's forward in float64 from the references (no local branch, norm or gate)."""
    q, k, v = layer_qkv_ref(layer, x)
    if kind == 'polar':
        power = 1.0 + layer.alpha * torch.sigmoid(layer.power.double())
        out = polarity_ref(q, k, v, power, F.softplus(layer.scale.double()), layer.normalizer, layer.eps)
    elif kind == 'nala':
        sharpness = F.softplus(layer.feature_map.sharpness.double())
        out = normalized_attention_ref(norm_direction_ref(q, sharpness), norm_direction_ref(k, sharpness), v,
                                       'divide', eps=layer.eps)
    else:
        out = normalized_attention_ref(elu1_ref(q), elu1_ref(k), v, kind, eps=layer.eps)
    return layer_projection_ref(layer, out)


# ---- the normalisers


def test_the_shipped_normalizers():
    """The one place that pins the shipped set, on purpose: the other tests take the names from the registry."""
    assert list_normalizers() == ['divide', 'inline', 'mala']


@pytest.mark.parametrize('normalizer', list_normalizers())
@pytest.mark.parametrize('masked', [False, True])
def test_each_normalizer_equals_its_weight_formula(normalizer, masked):
    q, k, v = _qkv()
    phi_q, phi_k = elu1_ref(q), elu1_ref(k)
    weights = None
    if masked:  # float weights, one key dropped whose value is not finite, and a per-head mask
        weights = torch.rand(2, 3, 11, generator=_generator(1), dtype=torch.float64) + 0.5
        weights[:, :, 4] = 0.0
        v[:, :, 4] = float('nan')
    got = normalized_attention_from_features(phi_q, phi_k, v, normalizer, 1e-6, weights)
    assert rel_err(got, normalized_attention_ref(phi_q, phi_k, v, normalizer, weights)) < 1e-12


@pytest.mark.parametrize('normalizer', NEW_NORMALIZERS)
def test_the_new_normalizers_weights_sum_to_one_and_track_the_query_magnitude(normalizer):
    """What each paper claims of its weights, read off the reference: they sum to 1 for every query; InLine's are
    not all positive; MALA's spread grows with the query's magnitude, which dividing cancels."""
    q, k, _ = _qkv()
    sim = elu1_ref(q) @ elu1_ref(k).transpose(-2, -1)
    ones = torch.ones(2, 3, 11, dtype=torch.float64)
    weights = normalized_weights_ref(sim, ones, normalizer)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 3, 7, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(normalized_weights_ref(3 * sim, ones, 'divide'), normalized_weights_ref(sim, ones, 'divide'))
    if normalizer == 'mala':
        assert (normalized_weights_ref(3 * sim, ones, 'mala').std(-1) > weights.std(-1)).all()


@pytest.mark.parametrize('normalizer', NEW_NORMALIZERS)
def test_normalizer_gradients_equal_the_references(normalizer):
    q, k, v = (t.requires_grad_() for t in _qkv(seed=2))
    upstream = torch.randn(2, 3, 7, 5, generator=_generator(3), dtype=torch.float64)
    got = torch.autograd.grad((normalized_attention_from_features(
        linvit.ops.elu1(q), linvit.ops.elu1(k), v, normalizer) * upstream).sum(), (q, k, v))
    expected = torch.autograd.grad((normalized_attention_ref(elu1_ref(q), elu1_ref(k), v, normalizer)
                                    * upstream).sum(), (q, k, v))
    for g, e in zip(got, expected):
        assert rel_err(g, e) < 1e-10


# ---- the norm-times-direction map


def test_nala_features_give_the_cosine_of_the_direction_differences():
    """With the power at 1, phi(x)^T phi(y) = ||x|| ||y|| sum_i cos(pi / 4 (x_i / ||x|| - y_i / ||y||)): the
    identity that makes the map keep negative interactions as low similarity (non-negative features)."""
    g = _generator(4)
    x, y = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    zero = torch.zeros(2, dtype=torch.float64)
    got = norm_direction(x, zero) @ norm_direction(y, zero).transpose(-2, -1)
    nx, ny = x.norm(dim=-1, keepdim=True), y.norm(dim=-1, keepdim=True)
    cosines = torch.cos(math.pi / 4 * ((x / nx).unsqueeze(-2) - (y / ny).unsqueeze(-3))).sum(-1)
    assert rel_err(got, nx * ny.transpose(-2, -1) * cosines) < 1e-12
    assert (norm_direction(x, zero) >= 0).all()


def test_nala_map_equals_its_reference_with_finite_gradients_at_the_edges():
    x = torch.randn(2, 3, 5, 4, generator=_generator(5), dtype=torch.float64)
    x[0, 0, 0] = 0.0                        # a zero row
    x[0, 0, 1] = torch.tensor([2.0, 0.0, 0.0, 0.0])   # a direction entry at 1 (cos(pi / 2) rounds below 0)
    x.requires_grad_()
    feature_map = NormDirectionFeatureMap(3, 4, dtype=torch.float64)
    with torch.no_grad():
        feature_map.sharpness.copy_(torch.tensor([-1.0, 0.0, 2.0]))
    got = feature_map(x)
    expected = norm_direction_ref(x, F.softplus(feature_map.sharpness))
    assert got.shape == (2, 3, 5, 8) and rel_err(got, expected) < 1e-12
    assert torch.equal(got[0, 0, 0], torch.zeros(8, dtype=torch.float64))
    got.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(feature_map.sharpness.grad).all()


# ---- every new kind as a layer


@pytest.mark.parametrize('kind', list(KINDS))
def test_each_new_layer_equals_its_reference(kind):
    layer = _layer(kind, local_mix=False)
    x = torch.randn(2, 13, DIM, generator=_generator(6), dtype=torch.float64)
    assert rel_err(layer(x), _layer_ref(layer, kind, x)) < 1e-10
    with torch.no_grad():  # inference takes the same path: the folds that only divide stay off
        assert rel_err(layer(x), _layer_ref(layer, kind, x)) < 1e-10


@pytest.mark.parametrize('normalizer', NEW_NORMALIZERS)
def test_polar_attention_applies_a_normalizer_to_each_stream(normalizer):
    layer = _layer('polar', normalizer=normalizer)
    x = torch.randn(2, 9, DIM, generator=_generator(7), dtype=torch.float64)
    assert rel_err(layer(x), _layer_ref(layer, 'polar', x)) < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize('kind', list(KINDS))
def test_each_new_layer_is_finite_and_accurate_in_half_precision_at_64k_tokens(kind):
    """float16 weights and tokens, 65,536 tokens: the core runs in float32 on means, so nothing overflows; the
    output agrees with the float32 layer to the precision of float16's inputs."""
    layer = _layer(kind, local_mix=False).float()
    x = torch.randn(1, 65536, DIM, generator=_generator(8))
    with torch.no_grad():
        expected = layer(x)
        got = layer.half()(x.half())
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    assert rel_err(got, expected) < 1e-2


@pytest.mark.parametrize('kind', list(KINDS))
def test_each_new_layer_costs_linear_time_in_tokens(kind):
    """Floating-point operations of a forward and backward at N and 4 N tokens: 4x (linear), where softmax
    attention's similarity matrix would make it 16x."""
    layer = _layer(kind, local_mix=False).float()

    def flops(n):
        x = torch.randn(1, n, DIM, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            layer(x).sum().backward()
        return counter.get_total_flops()

    assert flops(4096) / flops(1024) == pytest.approx(4.0, rel=0.02)


@pytest.mark.compiler
@pytest.mark.parametrize('kind', ['inline', 'mala', 'nala'])
def test_each_new_map_and_normalizer_compiles_as_one_graph(kind):
    """polar is a family: tests/layers/test_attention_families.py compiles it with every other family."""
    model = timm.create_model('linvit_tiny_patch16_224', depth=2, img_size=32, patch_size=8, num_classes=5,
                              dynamic_img_size=True, **KINDS[kind])
    images, labels = torch.randn(2, 3, 32, 40), torch.tensor([1, 3])
    torch._dynamo.reset()
    for report in (fast.check_graph_breaks(model.eval(), images),
                   fast.check_graph_breaks(TrainStep(model.train(), F.cross_entropy).forward_loss, images, labels)):
        assert report.graph_count == 1 and report.graph_break_count == 0, str(report)
    torch._dynamo.reset()


# ---- where a fast path or form does not compute them: refused, with the reason


@pytest.mark.parametrize('normalizer', NEW_NORMALIZERS)
def test_the_new_normalizers_are_refused_where_only_dividing_is_computed(normalizer):
    layer = LinearAttention(DIM, num_heads=HEADS, normalizer=normalizer)
    x = torch.randn(1, 5, DIM)
    with pytest.raises(ValueError, match='no state form'):
        layer.attention_state(x)
    with pytest.raises(ValueError, match='no rotary form'):
        layer(x, rope=torch.zeros(4, 2 * DIM // HEADS))
    with pytest.raises(ValueError, match='no causal form'):
        layer(x, is_causal=True)
    with pytest.raises(ValueError, match='no causal form'):
        LinearAttention(DIM, num_heads=HEADS, normalizer=normalizer, causal=True)
    with pytest.raises(ValueError, match="Triton kernels divide"):
        LinearAttention(DIM, num_heads=HEADS, normalizer=normalizer, attn_backend='triton')
    with pytest.raises(ValueError, match="attn_family='aft' mixes tokens its own way and takes no normalizer"):
        timm.create_model('linvit_tiny_patch16_224', depth=1, img_size=32, attn_family='aft', normalizer=normalizer)
    with pytest.raises(torch.jit.Error, match="scripted LinearAttention divides"):
        torch.jit.script(layer)(x)
    assert not layer.fused_backward  # the op's closed-form backward divides: plain autograd of the closed form


def test_the_new_kinds_say_why_the_kernels_and_state_form_do_not_serve_them():
    with pytest.raises(ValueError, match="feature_map='nala' is learnable"):
        LinearAttention(DIM, num_heads=HEADS, feature_map='nala', attn_backend='triton')
    with pytest.raises(ValueError, match='mixes tokens its own way'):
        ATTENTION_FAMILIES['polar'](DIM, num_heads=HEADS, attn_backend='triton')
    with pytest.raises(ValueError, match="no state form"):
        ATTENTION_FAMILIES['polar'](DIM, num_heads=HEADS).attention_state(torch.randn(1, 5, DIM))
    with pytest.raises(ValueError, match='head_dim must be even'):
        ATTENTION_FAMILIES['polar'](12, num_heads=4)
    assert ATTENTION_FAMILIES['polar'].family.normalizer and not ATTENTION_FAMILIES['polar'].family.state
