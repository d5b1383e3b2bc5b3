"""The attention families as layers and inside models: each layer against its float64 reference, and for every
family a linvit model that builds (hybrid, local mixing), trains a step, compiles as one graph and exports to ONNX;
Performer's features as state; the low-rank family at several resolutions; conversion of timm ViTs."""
import pytest
import timm
import torch
import torch.nn.functional as F
from references import aft_simple_ref, gated_ref, low_rank_ref, performer_ref

import linvit
from linvit import fast
from linvit.layers import (
    ATTENTION_FAMILIES,
    AFTAttention,
    GatedLinearAttention,
    LinformerAttention,
    PerformerAttention,
    attention_layer,
    load_softmax_state_dict,
)

FAMILIES = [name for name in ATTENTION_FAMILIES if name != 'linear']
DIM, HEADS = 32, 4


def _tokens(n=1 + 12, seed=0):
    return torch.randn(2, n, DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _split(layer, x):
    """q, k, v [B, H, N, D] in float64 from the layer's own qkv weights, written out."""
    qkv = x @ layer.qkv.weight.double().T + layer.qkv.bias.double()
    b, n = x.shape[:2]
    return qkv.reshape(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)


def _project(layer, out):
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d) @ layer.proj.weight.double().T + layer.proj.bias.double()


def _random_layer(cls, **options):
    torch.manual_seed(0)
    layer = cls(DIM, num_heads=HEADS, qkv_bias=True, **options).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer


def test_performer_layer_equals_its_reference():
    layer = _random_layer(PerformerAttention, num_features=16, eps=1e-30)
    x = _tokens()
    q, k, v = _split(layer, x)
    expected = _project(layer, performer_ref(q, k, v, layer.projection, eps=0.0))
    assert torch.allclose(layer(x), expected, rtol=1e-9, atol=1e-12)


def test_low_rank_layer_equals_its_reference_on_the_given_grid():
    layer = _random_layer(LinformerAttention, low_rank_size=2)
    x = _tokens(n=1 + 3 * 4)
    q, k, v = _split(layer, x)
    expected = _project(layer, low_rank_ref(q, k, v, (3, 4), 1, 2))
    assert torch.allclose(layer(x, feat_size=[3, 4]), expected, rtol=1e-10, atol=1e-12)


def test_gated_layer_equals_its_reference_with_both_gates():
    layer = _random_layer(GatedLinearAttention, feature_map='relu')
    x = _tokens()
    q, k, v = _split(layer, x)
    key_gate = torch.sigmoid(x @ layer.key_gate.weight.T + layer.key_gate.bias)
    key_gate = key_gate.reshape(2, -1, HEADS, DIM // HEADS).transpose(1, 2)
    mixed = gated_ref(q, k, v, key_gate, 'relu').transpose(1, 2).reshape(2, -1, DIM)
    mixed = mixed * torch.sigmoid(x @ layer.gate.weight.T + layer.gate.bias)
    expected = mixed @ layer.proj.weight.T + layer.proj.bias
    assert torch.allclose(layer(x), expected, rtol=1e-9, atol=1e-12)


def test_aft_layer_equals_its_reference():
    layer = _random_layer(AFTAttention)
    x = _tokens()
    q, k, v = (t.transpose(1, 2).reshape(2, -1, DIM) for t in _split(layer, x))
    expected = aft_simple_ref(q, k, v) @ layer.proj.weight.T + layer.proj.bias
    assert torch.allclose(layer(x), expected, rtol=1e-10, atol=1e-12)


def _model(family, **kwargs):
    options = dict(depth=2, img_size=32, patch_size=8, num_classes=5, attn_family=family, local_mix=True,
                   softmax_blocks=(1,), dynamic_img_size=True)
    options.update(kwargs)
    return timm.create_model('linvit_tiny_patch16_224', **options)


@pytest.mark.compiler
@pytest.mark.parametrize('family', FAMILIES)
def test_every_family_builds_trains_compiles_and_exports(family, tmp_path):
    model = _model(family)
    assert isinstance(model.blocks[0].attn, ATTENTION_FAMILIES[family])
    images = torch.randn(2, 3, 32, 40)
    loss = F.cross_entropy(model(images), torch.tensor([1, 3]))
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    torch._dynamo.reset()
    for report in (fast.check_graph_breaks(model.eval(), images),
                   fast.check_graph_breaks(fast.TrainStep(model.train(), F.cross_entropy).forward_loss, images,
                                           torch.tensor([1, 3]))):
        assert report.graph_count == 1 and report.graph_break_count == 0, str(report)
    torch._dynamo.reset()
    from linvit.export import export_onnx
    with torch.no_grad():  # every zero-initialised tensor (local mixing) takes part
        for block in model.blocks:
            if getattr(block.attn, 'local_mix', None) is not None:
                block.attn.local_mix.conv.weight.normal_(0, 0.05)
    report = export_onnx(model.eval(), tmp_path / f'{family}.onnx', img_size=32)
    assert report.ok and len(report.checks) == 3


def test_performer_features_are_state_and_change_only_on_redraw():
    model = _model('performer', softmax_blocks=()).eval()
    images = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        first, second = model(images), model(images)
    assert torch.equal(first, second)
    state = model.state_dict()
    assert 'blocks.0.attn.projection' in state and state['blocks.0.attn.projection'].shape == (64, 64)
    assert linvit.redraw_random_features(model, generator=torch.Generator().manual_seed(1)) == 2
    with torch.no_grad():
        redrawn = model(images)
    assert not torch.allclose(first, redrawn)
    reloaded = _model('performer', softmax_blocks=()).eval()
    reloaded.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(reloaded(images), redrawn)
    linvit.redraw_random_features(reloaded, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(reloaded.blocks[0].attn.projection, model.blocks[0].attn.projection)


def test_performer_num_features_option():
    layer = attention_layer('performer', num_features=24)(DIM, num_heads=HEADS)
    assert layer.projection.shape == (24, DIM // HEADS)


@pytest.mark.parametrize('size', [(224, 224), (512, 512), (384, 640)])
def test_low_rank_runs_at_any_size_with_one_set_of_weights(size):
    torch.manual_seed(0)
    model = timm.create_model('linvit_tiny_patch16_224', depth=2, attn_family='linformer', dynamic_img_size=True,
                              attn_options={'low_rank_size': 8}).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, *size))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()


@pytest.mark.parametrize('family', FAMILIES)
def test_convert_to_linear_keeps_the_weights_for_every_family(family):
    vit = timm.create_model('vit_tiny_patch16_224', depth=2, img_size=32, patch_size=8)
    softmax_state = {k: v.clone() for k, v in vit.state_dict().items()}
    linvit.convert_to_linear(vit, attn_family=family)
    assert isinstance(vit.blocks[0].attn, ATTENTION_FAMILIES[family])
    for key, value in softmax_state.items():
        assert torch.equal(vit.state_dict()[key], value), key
    assert torch.isfinite(vit(torch.randn(1, 3, 32, 32))).all()
    fresh = _model(family, softmax_blocks=(), local_mix=False, num_classes=1000, dynamic_img_size=False)
    kept = load_softmax_state_dict(fresh, softmax_state)
    own = {'performer': ['projection'], 'gated': ['gate.bias', 'gate.weight', 'key_gate.bias', 'key_gate.weight']}
    assert kept == sorted(f'blocks.{i}.attn.{name}' for i in range(2) for name in own.get(family, []))


def test_families_are_listed_in_one_registry():
    kinds = linvit.list_attention_kinds()
    maps = linvit.ops.list_feature_maps()
    assert kinds[:len(maps)] == maps and 'hedgehog' in maps
    assert set(kinds[len(maps):]) == {'performer', 'linformer', 'gated', 'aft', 'bidirectional'}
    with pytest.raises(ValueError, match="unknown attn_family 'softmax'"):
        _model('softmax')
