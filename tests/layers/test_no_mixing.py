"""NoMixingAttention, the performance floor: timm's Attention parameters and interface, output proj(v) (with the
attention's norm and gate), checked against a float64 computation from its state dict; and make_floor, which puts it
in place of every attention layer of a softmax, linear or hybrid model."""
import pytest
import timm
import torch
import torch.nn as nn
from references import layer_norm_ref, linear_ref
from timm.layers import Attention
from timm.models.vision_transformer import VisionTransformer

from linvit import fast
from linvit.layers import LinearAttention, LocalMix, NoMixingAttention, make_floor

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


# ---------------------------------------------------------------------------------------------------------------
# make_floor: the surgery (a depth-2, width-48 model of the registered family, every parameter non-zero)

IMG = 64
TINY = dict(img_size=IMG, depth=2, embed_dim=48, num_heads=3, num_classes=10)


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random parameters everywhere: zero-initialised branches (local mix) would hide a wrong floor."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def tiny_linvit(**kwargs) -> nn.Module:
    return randomize(timm.create_model('linvit_tiny_patch16_224', **{**TINY, **kwargs}))


def images(batch: int = 2, height: int = IMG, width: int = IMG, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def assert_one_graph(report: fast.GraphReport) -> None:
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)


def test_floor_of_a_softmax_vit_is_the_no_mixing_vit():
    config = dict(img_size=32, patch_size=16, embed_dim=48, depth=2, num_heads=3, num_classes=10)
    vit = randomize(VisionTransformer(**config)).eval()
    reference = VisionTransformer(**config, attn_layer=NoMixingAttention).eval()
    reference.load_state_dict(vit.state_dict())
    qkv_weights = [blk.attn.qkv.weight for blk in vit.blocks]
    floor = make_floor(vit)
    assert floor is vit
    assert all(type(blk.attn) is NoMixingAttention for blk in floor.blocks)
    assert all(blk.attn.qkv.weight is w for blk, w in zip(floor.blocks, qkv_weights))  # shared, not copied
    x = images(2, 32, 32)
    torch.testing.assert_close(floor(x), reference(x))
    # one layer against the formula: proj(v), v the last third of qkv
    attn, tokens = floor.blocks[0].attn, torch.randn(2, 5, 48)
    v = tokens @ attn.qkv.weight[96:].T + attn.qkv.bias[96:]
    torch.testing.assert_close(attn(tokens), v @ attn.proj.weight.T + attn.proj.bias)


def test_floor_of_a_hybrid_linvit_drops_all_mixing():
    model = tiny_linvit(local_mix=True, softmax_blocks=(1,)).eval()
    state = {k: v for k, v in model.state_dict().items() if 'local_mix' not in k}
    reference = VisionTransformer(**{**TINY, 'patch_size': 16}, attn_layer=NoMixingAttention).eval()
    reference.load_state_dict(state)
    floor = make_floor(model)
    assert all(type(blk.attn) is NoMixingAttention for blk in floor.blocks)
    assert not any(isinstance(m, (LocalMix, LinearAttention)) for m in floor.modules())
    x = images()
    torch.testing.assert_close(floor(x), reference(x))


@pytest.mark.compiler
def test_floor_of_a_hybrid_linvit_compiles_as_one_graph():
    floor = make_floor(tiny_linvit(local_mix=True, softmax_blocks=(1,)).eval())
    assert_one_graph(fast.check_graph_breaks(floor, images()))


def test_floor_keeps_training_mode_and_rejects_models_without_attention():
    model = make_floor(tiny_linvit().train())
    assert all(blk.attn.training for blk in model.blocks)
    with pytest.raises(ValueError, match='no timm Attention'):
        make_floor(nn.Sequential(nn.Linear(4, 4)))


def test_make_floor_names_a_model_without_attention_and_refuses_a_bare_attention_layer():
    with pytest.raises(ValueError, match=r"^make_floor found no timm Attention or linvit LinearAttention in "
                                         r"Sequential$"):
        make_floor(nn.Sequential(nn.Linear(4, 4)))
    for layer in (Attention(DIM, num_heads=HEADS), LinearAttention(DIM, num_heads=HEADS)):
        with pytest.raises(ValueError, match="^make_floor replaces attention layers inside a model; got an "
                                             "attention layer itself$"):
            make_floor(layer)
