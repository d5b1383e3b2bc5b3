"""NoMixingAttention, the performance floor: timm's Attention parameters and interface, output proj(v) (with the
attention's norm and gate), checked against a float64 computation from its state dict."""
import pytest
import torch
import torch.nn as nn
from references import layer_norm_ref, linear_ref
from timm.layers import Attention
from timm.models.vision_transformer import VisionTransformer

from linvit.layers import NoMixingAttention

DIM, HEADS = 24, 3
OPTIONS = {
    'plain': dict(),
    'qkv-bias': dict(qkv_bias=True),
    'no-proj-bias': dict(proj_bias=False),
    'scale-norm': dict(scale_norm=True, norm_layer=nn.LayerNorm),
    'gated': dict(gated=True, qkv_bias=True),
    'gated-no-bias': dict(gated=True),
    'head-dim-and-dim-out': dict(attn_head_dim=5, dim_out=10),
    'all': dict(qkv_bias=True, scale_norm=True, norm_layer=nn.LayerNorm, gated=True, attn_head_dim=6, dim_out=7),
}


def floor_ref(state, x, attn_dim):
    """proj(norm(v) * sigmoid(gate(x))), v = the last third of qkv(x), float64; norm and gate only if present."""
    x = x.double()
    out = linear_ref(x, state, 'qkv')[..., 2 * attn_dim:]
    if 'norm.weight' in state:
        out = layer_norm_ref(out, state['norm.weight'], state['norm.bias'], 1e-5)
    if 'gate.weight' in state:
        out = out * torch.sigmoid(linear_ref(x, state, 'gate'))
    return linear_ref(out, state, 'proj')


@pytest.mark.parametrize('options', list(OPTIONS.values()), ids=list(OPTIONS))
def test_floor_is_the_projected_values(options):
    torch.manual_seed(0)
    floor = NoMixingAttention(DIM, HEADS, **options)
    with torch.no_grad():
        for p in floor.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # LayerNorm far from identity
    head_dim = options.get('attn_head_dim', DIM // HEADS)
    assert floor.attn_dim == HEADS * head_dim
    x = torch.randn(2, 11, DIM)
    out = floor(x, attn_mask=None, is_causal=False, feat_size=[3, 3])
    assert out.shape == (2, 11, options.get('dim_out', DIM))
    torch.testing.assert_close(out.double(), floor_ref(floor.state_dict(), x, floor.attn_dim), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('options', list(OPTIONS.values()), ids=list(OPTIONS))
def test_floor_has_timms_attention_parameters(options):
    floor, softmax = NoMixingAttention(DIM, HEADS, **options), Attention(DIM, HEADS, **options)
    assert {k: v.shape for k, v in floor.state_dict().items()} == {k: v.shape for k, v in softmax.state_dict().items()}
    floor.load_state_dict(softmax.state_dict(), strict=True)


def test_floor_defaults_are_timms():
    """Built with timm Attention's defaults (8 heads), the floor has its parameters."""
    floor, softmax = NoMixingAttention(32), Attention(32)
    assert floor.attn_dim == 32 and floor.qkv.bias is None and floor.gate is None
    floor.load_state_dict(softmax.state_dict(), strict=True)


def test_floor_drops_into_a_vision_transformer_and_dropout_applies():
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=DIM, depth=2, num_heads=HEADS,
                              attn_layer=NoMixingAttention, proj_drop_rate=0.5, num_classes=4)
    assert all(isinstance(b.attn, NoMixingAttention) for b in model.blocks)
    assert model.blocks[0].attn.proj_drop.p == 0.5
    model.eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4)


def test_floor_builds_on_another_device_and_dtype():
    floor = NoMixingAttention(DIM, HEADS, qkv_bias=True, scale_norm=True, norm_layer=nn.LayerNorm, gated=True,
                              device='meta', dtype=torch.float64)
    assert {(p.device.type, p.dtype) for p in floor.parameters()} == {('meta', torch.float64)}
