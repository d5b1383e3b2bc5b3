"""Causal LinearAttention (causal=True, is_causal=True, step) and BidirectionalAttention against the float64
references of tests/references.py, computed from the layers' own weights written out."""
import pytest
import torch
from references import bidirectional_ref, causal_ref, layer_qkv_ref, random_layer

from linvit.layers import BidirectionalAttention, LinearAttention, PerformerAttention, attention_layer
from linvit.ops import list_feature_maps

DIM, HEADS = 32, 4


def _tokens(n=1 + 12, seed=0):
    return torch.randn(2, n, DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _random_layer(cls, **options):
    return random_layer(cls, DIM, HEADS, **options)


def _project(layer, out):
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d) @ layer.proj.weight.T + layer.proj.bias


@pytest.mark.parametrize('feature_map', list_feature_maps(learnable=False))
def test_causal_layer_equals_its_reference(feature_map):
    layer = _random_layer(LinearAttention, feature_map=feature_map, causal=True, causal_chunk_size=4)
    x = _tokens(n=19)
    q, k, v = layer_qkv_ref(layer, x)
    expected = _project(layer, causal_ref(q, k, v, feature_map))
    assert torch.allclose(layer(x), expected, rtol=1e-10, atol=1e-12)
    # a non-causal layer with the same weights: causal for one call with is_causal=True, else all-to-all
    plain = _random_layer(LinearAttention, feature_map=feature_map)
    plain.load_state_dict(layer.state_dict())
    assert torch.allclose(plain(x, is_causal=True), expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(plain(x), expected, rtol=1e-3)


def test_causal_layer_with_qk_norm_and_gate_trains():
    layer = LinearAttention(DIM, num_heads=HEADS, qk_norm=True, norm_layer=torch.nn.LayerNorm, gated=True,
                            causal=True)
    x = torch.randn(2, 70, DIM, requires_grad=True)
    layer(x).square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_step_equals_the_causal_forward_rows():
    layer = _random_layer(LinearAttention, causal=True, gated=True).float()
    x = _tokens(n=30).float()
    full = layer(x)
    state = None
    for t in range(x.shape[1]):
        out_t, state = layer.step(x[:, t], state)
        assert torch.allclose(out_t, full[:, t], rtol=1e-5, atol=1e-6), t
    assert state.kv.shape == (2, HEADS, DIM // HEADS, DIM // HEADS + 1) and state.steps == 30


def test_causal_errors_name_the_problem():
    with pytest.raises(ValueError, match='causal attention needs local_mix=False'):
        LinearAttention(DIM, num_heads=HEADS, causal=True, local_mix=True)
    with pytest.raises(ValueError, match='causal_chunk_size must be an int >= 1'):
        LinearAttention(DIM, num_heads=HEADS, causal_chunk_size=0)
    with pytest.raises(ValueError, match='PerformerAttention has no causal form'):
        PerformerAttention(DIM, num_heads=HEADS, causal=True)
    with pytest.raises(ValueError, match='PerformerAttention has no causal form'):
        PerformerAttention(DIM, num_heads=HEADS)(torch.randn(1, 5, DIM), is_causal=True)
    with pytest.raises(ValueError, match='takes no attn_mask'):
        LinearAttention(DIM, num_heads=HEADS)(torch.randn(1, 5, DIM), attn_mask=torch.ones(1, 5, dtype=torch.bool),
                                              is_causal=True)
    with pytest.raises(ValueError, match='needs local_mix=False'):
        LinearAttention(DIM, num_heads=HEADS, local_mix=True, grid_size=(2, 2))(torch.randn(1, 5, DIM),
                                                                                 is_causal=True)
    with pytest.raises(ValueError, match=r'one token per sample \[B, 32\]'):
        LinearAttention(DIM, num_heads=HEADS, causal=True).step(torch.randn(1, 3, DIM))


def _grid_orders(h, w, prefix):
    raster = torch.arange(prefix + h * w)
    column = torch.cat([torch.arange(prefix), prefix + torch.arange(h * w).reshape(h, w).T.reshape(-1)])
    return [raster, column]


@pytest.mark.parametrize('orders', ['raster', 'raster+column'])
def test_bidirectional_layer_equals_its_reference(orders):
    layer = _random_layer(BidirectionalAttention, data_gate=True, decay=[0.9, 0.8, 0.95, 1.0], scan_orders=orders,
                          scan_chunk_size=5)
    x = _tokens(n=1 + 3 * 4)
    q, k, v = layer_qkv_ref(layer, x)
    z = x @ layer.scan_gate.weight.T + layer.scan_gate.bias
    gate = torch.sigmoid(z) ** (1 / 16)
    gate = gate.reshape(2, -1, HEADS, DIM // HEADS).transpose(1, 2)
    token_orders = _grid_orders(3, 4, 1) if orders == 'raster+column' else None
    expected = _project(layer, bidirectional_ref(q, k, v, decay=[0.9, 0.8, 0.95, 1.0], gate=gate,
                                                 orders=token_orders))
    assert torch.allclose(layer(x, feat_size=[3, 4]), expected, rtol=1e-9, atol=1e-12)


def test_bidirectional_retnet_decays_and_no_decay():
    layer = _random_layer(BidirectionalAttention)
    assert layer.decays == pytest.approx([1 - 2 ** -5, 1 - 2 ** -6, 1 - 2 ** -7, 1 - 2 ** -8])
    assert layer.scan_gate is None and 'decays' not in layer.state_dict()
    # without decay or gate the scans give plain linear attention (weights all 1), with the same parameters
    undecayed = _random_layer(BidirectionalAttention, decay=None, scan_orders='raster')
    plain = _random_layer(LinearAttention)
    plain.load_state_dict(undecayed.state_dict())
    x = _tokens(n=1 + 16)
    assert torch.allclose(undecayed(x), plain(x), rtol=1e-10, atol=1e-12)


def test_bidirectional_gate_starts_near_one_and_options_are_checked():
    layer = BidirectionalAttention(DIM, num_heads=HEADS, data_gate=True)
    gate = torch.sigmoid(layer.scan_gate(torch.randn(3, DIM))) ** (1 / 16)
    assert (gate > 0.998).all()
    with pytest.raises(ValueError, match='scan_orders must be one of'):
        BidirectionalAttention(DIM, num_heads=HEADS, scan_orders='spiral')
    with pytest.raises(ValueError, match=r'decay must hold one value in \(0, 1\]'):
        BidirectionalAttention(DIM, num_heads=HEADS, decay=[0.9, 0.9])
    with pytest.raises(ValueError, match="decay must be 'retnet'"):
        BidirectionalAttention(DIM, num_heads=HEADS, decay='alibi')
    with pytest.raises(ValueError, match='unknown bidirectional attention options'):
        attention_layer('bidirectional', num_features=3)
    layer = attention_layer('bidirectional', decay=0.5, feature_map='relu')(DIM, num_heads=HEADS)
    assert layer.decays == (0.5,) * HEADS and layer.feature_map_name == 'relu'
    with pytest.raises(ValueError, match='cannot apply a key mask'):
        layer(torch.randn(1, 5, DIM), attn_mask=torch.ones(1, 5, dtype=torch.bool))
