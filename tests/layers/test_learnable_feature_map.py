"""The learnable (Hedgehog) feature map: its formula, the layer that holds it against a float64 quadratic reference
(outputs and gradients, the map's own parameters included), the fused Function on features, its initialisation,
conversion and loading of softmax checkpoints, and the errors where it does not apply."""
import copy

import pytest
import timm
import torch

import linvit
from linvit.layers import HedgehogFeatureMap, LinearAttention, linear_only_parameter_names, load_softmax_state_dict
from linvit.ops import (
    feature_map_spec,
    fused_linear_attention_from_features,
    get_feature_map,
    hedgehog,
    list_feature_maps,
)

H, D = 2, 8


def hedgehog_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Hedgehog's map written out per head in float64: z = x W_h + b_h, [exp(z) / sum exp(z), exp(-z) / sum exp(-z)]."""
    x, weight, bias = x.double(), weight.double(), bias.double()
    heads = []
    for h in range(x.shape[1]):
        z = torch.einsum('bnd,df->bnf', x[:, h], weight[h]) + bias[h]
        pos, neg = torch.exp(z - z.amax(-1, keepdim=True)), torch.exp(-z - (-z).amax(-1, keepdim=True))
        heads.append(torch.cat([pos / pos.sum(-1, keepdim=True), neg / neg.sum(-1, keepdim=True)], dim=-1))
    return torch.stack(heads, dim=1)


def quadratic_layer_reference(layer: LinearAttention, x: torch.Tensor, key_mask=None) -> torch.Tensor:
    """The layer's output from the N x N similarity matrix phi(q) phi(k)^T in float64 (independent of the O(N) core):
    out_i = sum_j w_j A_ij v_j / (sum_j w_j A_ij + eps * sum_j w_j), then the output projection."""
    B, N, C = x.shape
    qkv = torch.nn.functional.linear(x.double(), layer.qkv.weight.double(), layer.qkv.bias.double())
    q, k, v = qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
    weight, bias = layer.feature_map.weight, layer.feature_map.bias
    sims = hedgehog_reference(q, weight, bias) @ hedgehog_reference(k, weight, bias).transpose(-2, -1)
    w = torch.ones(B, N, dtype=torch.float64) if key_mask is None else key_mask.double()
    sims = sims * w[:, None, None, :]
    out = (sims @ v) / (sims.sum(-1, keepdim=True) + layer.eps * w.sum(-1)[:, None, None, None])
    out = out.transpose(1, 2).reshape(B, N, H * D)
    return torch.nn.functional.linear(out, layer.proj.weight.double(), layer.proj.bias.double())


def _layer(dtype=torch.float64, seed=0) -> LinearAttention:
    torch.manual_seed(seed)
    layer = LinearAttention(H * D, num_heads=H, qkv_bias=True, feature_map='hedgehog').to(dtype)
    with torch.no_grad():  # away from the identity start, so the projection is tested too
        layer.feature_map.weight.add_(0.4 * torch.randn_like(layer.feature_map.weight))
        layer.feature_map.bias.normal_(0, 0.3)
    return layer


def test_hedgehog_op_equals_the_written_out_formula():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, H, 5, D) * 3, torch.randn(H, D, 6), torch.randn(H, 6)
    got = hedgehog(x.double(), weight.double(), bias.double())
    assert got.shape == (2, H, 5, 12) and (got > 0).all()
    torch.testing.assert_close(got, hedgehog_reference(x, weight, bias), rtol=1e-12, atol=1e-12)
    big = hedgehog(x * 1e3, weight, bias)  # softmax subtracts the maximum: no overflow at large inputs
    assert torch.isfinite(big).all()


def test_hedgehog_is_registered_as_a_learnable_map():
    assert list_feature_maps(learnable=True) == ['hedgehog', 'nala'] and feature_map_spec('hedgehog').learnable
    assert feature_map_spec('hedgehog').module is HedgehogFeatureMap
    assert not feature_map_spec('elu1').learnable
    with pytest.raises(ValueError, match="'hedgehog' is learnable"):
        get_feature_map('hedgehog')


@pytest.mark.parametrize('masked', [False, True], ids=['no-mask', 'key-mask'])
def test_layer_matches_the_quadratic_reference_with_gradients(masked):
    """float64: the layer (training path: the fused Function on features, autograd through the map) equals the
    N x N reference, outputs and gradients of the input, qkv and the map's own weight and bias."""
    layer = _layer()
    x = torch.randn(2, 11, H * D, dtype=torch.float64, requires_grad=True)
    key_mask = None
    if masked:
        key_mask = torch.ones(2, 11, dtype=torch.bool)
        key_mask[0, 7:] = False
    out = layer(x, attn_mask=key_mask)
    ref = quadratic_layer_reference(layer, x, key_mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(out)
    params = [x, layer.qkv.weight, layer.feature_map.weight, layer.feature_map.bias]
    got = torch.autograd.grad(out, params, grad)
    want = torch.autograd.grad(ref, params, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_layer_in_float32_and_without_autograd_is_close_to_float64():
    layer64 = _layer()
    layer32 = copy.deepcopy(layer64).float()
    x = torch.randn(2, 64, H * D, dtype=torch.float64)
    ref = quadratic_layer_reference(layer64, x)
    with torch.no_grad():
        inference = layer32(x.float())
    training = layer32(x.float())
    for got in (inference, training):
        assert (got.double() - ref).abs().max() / ref.abs().max() < 1e-5


def test_the_fused_function_on_features_has_the_reference_gradients():
    torch.manual_seed(1)
    phi_q = torch.rand(1, H, 6, 5, dtype=torch.float64, requires_grad=True)
    phi_k = torch.rand(1, H, 9, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, H, 9, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda a, b, c: fused_linear_attention_from_features(a, b, c, 1e-3, mask),
                                    (phi_q, phi_k, v))
    sims = (phi_q @ phi_k.transpose(-2, -1)) * mask[:, None, None, :]
    ref = (sims @ v) / (sims.sum(-1, keepdim=True) + 1e-3 * mask.sum())
    torch.testing.assert_close(fused_linear_attention_from_features(phi_q, phi_k, v, 1e-3, mask), ref)


def test_the_training_path_uses_the_fused_function():
    """With autograd the core runs as one autograd Function (closed-form backward), found in the output's graph."""
    layer = _layer(dtype=torch.float32)
    out = layer(torch.randn(1, 5, H * D))
    # every node stays referenced: the Python wrappers of autograd nodes can be transient (torch 2.11), so the id of
    # a freed one may be reused by the next and a visited-by-id set would skip it
    names, seen, stack = set(), [], [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        seen.append(node)
        names.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    assert any('LinearAttentionFunction' in name for name in names), names


def test_map_starts_at_identity_in_models_and_on_meta():
    model = timm.create_model('linvit_tiny_patch16_224', feature_map='hedgehog', img_size=32, depth=2)
    fmap = model.blocks[1].attn.feature_map
    assert torch.equal(fmap.weight, torch.eye(64).expand(3, 64, 64)) and not fmap.bias.any()
    meta = timm.create_model('linvit_tiny_patch16_224', feature_map='hedgehog', img_size=32, depth=2, device='meta')
    assert meta.blocks[0].attn.feature_map.weight.is_meta


def test_convert_to_linear_adds_the_map_and_keeps_every_softmax_tensor():
    torch.manual_seed(0)
    vit = timm.create_model('vit_tiny_patch16_224', img_size=32, depth=2, num_classes=5)
    softmax_state = {k: v.clone() for k, v in vit.state_dict().items()}
    linvit.convert_to_linear(vit, feature_map='hedgehog')
    state = vit.state_dict()
    for key, value in softmax_state.items():
        assert torch.equal(state[key], value), key
    added = sorted(set(state) - set(softmax_state))
    assert added == sorted(f'blocks.{i}.attn.feature_map.{p}' for i in range(2) for p in ('weight', 'bias'))
    assert added == linear_only_parameter_names(vit)
    fresh = timm.create_model('vit_tiny_patch16_224', img_size=32, depth=2, num_classes=5)
    linvit.convert_to_linear(fresh, feature_map='hedgehog')
    assert load_softmax_state_dict(fresh, softmax_state) == added
    assert isinstance(fresh.blocks[0].attn, LinearAttention)


def test_where_a_learnable_map_does_not_apply_the_error_says_why():
    with pytest.raises(ValueError, match='causal attention needs a fixed feature map'):
        LinearAttention(16, num_heads=2, feature_map='hedgehog', causal=True)
    layer = LinearAttention(16, num_heads=2, feature_map='hedgehog')
    with pytest.raises(ValueError, match='causal attention needs a fixed feature map'):
        layer(torch.randn(1, 4, 16), is_causal=True)
    with pytest.raises(ValueError, match='learnable'):
        timm.create_model('linvit_tiny_patch16_224', img_size=32, depth=1, attn_family='gated',
                          feature_map='hedgehog')
    with pytest.raises(ValueError, match="attn_backend='triton'"):
        LinearAttention(16, num_heads=2, feature_map='hedgehog', attn_backend='triton')


def test_unknown_map_names_list_the_learnable_one():
    with pytest.raises(ValueError, match="unknown feature_map 'softmax'"):
        LinearAttention(16, num_heads=2, feature_map='softmax')
    with pytest.raises(ValueError, match='hedgehog'):
        linvit.convert_to_linear(timm.create_model('vit_tiny_patch16_224', img_size=32, depth=1), feature_map='soft')
