"""The attention families as layers and inside models: each layer against its float64 reference, and for every
family a linvit model that builds (hybrid, local mixing), trains a step, compiles as one graph and exports to ONNX;
Performer's features as state; the low-rank family at several resolutions; conversion of timm ViTs; and each layer's
own contract: key masks, its patch grid without feat_size, its option checks and defaults."""
import re

import pytest
import timm
import torch
import torch.nn.functional as F
from references import (
    aft_simple_ref,
    gated_ref,
    layer_projection_ref,
    layer_qkv_ref,
    low_rank_ref,
    performer_ref,
    random_layer,
)

import linvit
from linvit import fast
from linvit.engine import TrainStep
from linvit.layers import (
    ATTENTION_FAMILIES,
    AFTAttention,
    BidirectionalAttention,
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


def _random_layer(cls, **options):
    return random_layer(cls, DIM, HEADS, **options)


def test_performer_layer_equals_its_reference():
    layer = _random_layer(PerformerAttention, num_features=16, eps=1e-30)
    x = _tokens()
    q, k, v = layer_qkv_ref(layer, x)
    expected = layer_projection_ref(layer, performer_ref(q, k, v, layer.projection, eps=0.0))
    assert torch.allclose(layer(x), expected, rtol=1e-9, atol=1e-12)


def test_low_rank_layer_equals_its_reference_on_the_given_grid():
    layer = _random_layer(LinformerAttention, low_rank_size=2)
    x = _tokens(n=1 + 3 * 4)
    q, k, v = layer_qkv_ref(layer, x)
    expected = layer_projection_ref(layer, low_rank_ref(q, k, v, (3, 4), 1, 2))
    assert torch.allclose(layer(x, feat_size=[3, 4]), expected, rtol=1e-10, atol=1e-12)


def test_gated_layer_equals_its_reference_with_both_gates():
    layer = _random_layer(GatedLinearAttention, feature_map='relu')
    x = _tokens()
    q, k, v = layer_qkv_ref(layer, x)
    key_gate = torch.sigmoid(x @ layer.key_gate.weight.T + layer.key_gate.bias)
    key_gate = key_gate.reshape(2, -1, HEADS, DIM // HEADS).transpose(1, 2)
    mixed = gated_ref(q, k, v, key_gate, 'relu').transpose(1, 2).reshape(2, -1, DIM)
    mixed = mixed * torch.sigmoid(x @ layer.gate.weight.T + layer.gate.bias)
    expected = mixed @ layer.proj.weight.T + layer.proj.bias
    assert torch.allclose(layer(x), expected, rtol=1e-9, atol=1e-12)


def test_aft_layer_equals_its_reference():
    layer = _random_layer(AFTAttention)
    x = _tokens()
    q, k, v = (t.transpose(1, 2).reshape(2, -1, DIM) for t in layer_qkv_ref(layer, x))
    expected = aft_simple_ref(q, k, v) @ layer.proj.weight.T + layer.proj.bias
    assert torch.allclose(layer(x), expected, rtol=1e-10, atol=1e-12)


def _model(family, **kwargs):
    options = dict(depth=2, img_size=32, patch_size=8, num_classes=5, attn_family=family, local_mix=True,
                   softmax_blocks=(1,), dynamic_img_size=True)
    options.update(kwargs)
    return timm.create_model('linvit_tiny_patch16_224', **options)


#: a family's own options where the defaults miss its risk: the bidirectional scan's data-dependent gate
FAMILY_OPTIONS = {'bidirectional': dict(attn_options=dict(data_gate=True))}
#: ONNX check sizes: the bidirectional scan runs over chunks of 64 tokens, and a graph specialised to the export
#: size's chunk count (1 + 16 tokens: 2 chunks) would fail 1 + 320 (6 chunks) and a padded 1 + 225 (4 chunks)
EXPORT_CHECK_SIZES = [(32, 32), (128, 160), (199, 65)]


@pytest.mark.compiler
@pytest.mark.parametrize('family', FAMILIES)
def test_every_family_builds_trains_and_compiles(family):
    model = _model(family, **FAMILY_OPTIONS.get(family, {}))
    assert isinstance(model.blocks[0].attn, ATTENTION_FAMILIES[family])
    images = torch.randn(2, 3, 32, 40)
    loss = F.cross_entropy(model(images), torch.tensor([1, 3]))
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    torch._dynamo.reset()
    for report in (fast.check_graph_breaks(model.eval(), images),
                   fast.check_graph_breaks(TrainStep(model.train(), F.cross_entropy).forward_loss, images,
                                           torch.tensor([1, 3]))):
        assert report.graph_count == 1 and report.graph_break_count == 0, str(report)
    torch._dynamo.reset()


@pytest.mark.compiler
def test_a_model_with_a_block_of_every_family_exports_with_onnxruntime_parity(tmp_path):
    """One export (each costs seconds of tracing) of a model whose block i is family i, local mixing on."""
    model = _model(FAMILIES[0], depth=len(FAMILIES) + 1, softmax_blocks=(len(FAMILIES),))
    for block, family in zip(model.blocks, FAMILIES):
        block.attn = _model(family, **FAMILY_OPTIONS.get(family, {})).blocks[0].attn
    assert all(isinstance(block.attn, ATTENTION_FAMILIES[f]) for block, f in zip(model.blocks, FAMILIES))
    with torch.no_grad():  # every zero-initialised tensor (local mixing) takes part
        for block in model.blocks:
            if getattr(block.attn, 'local_mix', None) is not None:
                block.attn.local_mix.conv.weight.normal_(0, 0.05)
    from linvit.export import export_onnx
    report = export_onnx(model.eval(), tmp_path / 'families.onnx', img_size=32, check_sizes=EXPORT_CHECK_SIZES)
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
    own = {'performer': ['projection'], 'gated': ['gate.bias', 'gate.weight', 'key_gate.bias', 'key_gate.weight'],
           'polar': ['power', 'scale']}
    assert kept == sorted(f'blocks.{i}.attn.{name}' for i in range(2) for name in own.get(family, []))


def test_an_unknown_family_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown attn_family 'softmax'"):
        _model('softmax')


# ---- each family layer's own contract: key masks against the float64 references over the kept keys (or the error
# that says why a family cannot apply one), its patch grid without feat_size, its options as print(model) shows them

HEAD_DIM = DIM // HEADS
GRID = (3, 4)
N = 1 + GRID[0] * GRID[1]
# keys each batch element drops: a different set per element, the class token among them in the second
DROPPED = ([3, 7, 8], [0, 12])


def _key_mask():
    """bool [2, N], True attends, False at DROPPED."""
    mask = torch.ones(2, N, dtype=torch.bool)
    for b, dropped in enumerate(DROPPED):
        mask[b, dropped] = False
    return mask


def _merge_heads(out):
    """[B, H, N, D] -> [B, N, H * D]."""
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def _per_element(layer, x, mixed_over_kept):
    """The layer's output [B, N, dim] from float64 references: for each batch element b, mixed_over_kept(q, k, v,
    x, kept) mixes all of its queries over its kept keys only; then the layer's output projection."""
    mask = _key_mask()
    q, k, v = layer_qkv_ref(layer, x)
    rows = []
    for b in range(x.shape[0]):
        kept = mask[b].nonzero().flatten()
        rows.append(mixed_over_kept(q[b:b + 1], k[b:b + 1], v[b:b + 1], x[b:b + 1], kept))
    return torch.cat(rows) @ layer.proj.weight.T + layer.proj.bias


def test_performer_applies_a_key_mask_as_if_the_masked_keys_were_absent():
    layer = _random_layer(PerformerAttention, num_features=16, eps=1e-30)

    def mixed(q, k, v, x, kept):
        return _merge_heads(performer_ref(q, k[:, :, kept], v[:, :, kept], layer.projection, eps=0.0))

    expected = _per_element(layer, _tokens(), mixed)
    assert torch.allclose(layer(_tokens(), attn_mask=_key_mask()), expected, rtol=1e-9, atol=1e-12)


def test_gated_attention_applies_a_key_mask_as_if_the_masked_keys_were_absent():
    layer = _random_layer(GatedLinearAttention, feature_map='relu', eps=1e-30)

    def mixed(q, k, v, x, kept):
        key_gate = torch.sigmoid(x @ layer.key_gate.weight.T + layer.key_gate.bias)
        key_gate = key_gate.reshape(1, N, HEADS, HEAD_DIM).transpose(1, 2)
        out = _merge_heads(gated_ref(q, k[:, :, kept], v[:, :, kept], key_gate[:, :, kept], 'relu', eps=0.0))
        return out * torch.sigmoid(x @ layer.gate.weight.T + layer.gate.bias)

    expected = _per_element(layer, _tokens(), mixed)
    assert torch.allclose(layer(_tokens(), attn_mask=_key_mask()), expected, rtol=1e-9, atol=1e-12)


def test_aft_applies_a_per_token_key_mask_and_refuses_one_per_head():
    layer = _random_layer(AFTAttention)

    def mixed(q, k, v, x, kept):
        q, k, v = (_merge_heads(t) for t in (q, k, v))
        return aft_simple_ref(q, k[:, kept], v[:, kept])

    expected = _per_element(layer, _tokens(), mixed)
    assert torch.allclose(layer(_tokens(), attn_mask=_key_mask()), expected, rtol=1e-10, atol=1e-12)
    per_head = _key_mask()[:, None, None, :].expand(2, HEADS, 1, N)
    message = "aft attention takes a key mask per token [B, N], not per head"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        layer(_tokens(), attn_mask=per_head)


@pytest.mark.parametrize('cls, message', [
    (LinformerAttention, "linformer attention pools keys over the patch grid and cannot apply a key mask"),
    (BidirectionalAttention, "bidirectional attention scans the patch grid and cannot apply a key mask"),
])
def test_families_that_mix_over_the_grid_refuse_a_key_mask_and_say_why(cls, message):
    layer = cls(DIM, num_heads=HEADS, grid_size=GRID)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        layer(_tokens().float(), attn_mask=_key_mask())


@pytest.mark.parametrize('cls', [LinformerAttention, BidirectionalAttention])
def test_a_layer_without_feat_size_mixes_over_its_own_non_square_grid(cls):
    layer = _random_layer(cls, grid_size=GRID)
    x = _tokens()
    given = layer(x, feat_size=list(GRID))
    assert torch.equal(layer(x), given)
    assert not torch.allclose(layer(x, feat_size=[GRID[1], GRID[0]]), given)


def test_linformer_on_its_own_grid_equals_its_reference():
    layer = _random_layer(LinformerAttention, grid_size=GRID, low_rank_size=2)
    x = _tokens()
    q, k, v = layer_qkv_ref(layer, x)
    expected = _merge_heads(low_rank_ref(q, k, v, GRID, 1, 2)) @ layer.proj.weight.T + layer.proj.bias
    assert torch.allclose(layer(x), expected, rtol=1e-10, atol=1e-12)


# each family's options: their checks, and their values or defaults as print(model) shows them


def test_bidirectional_checks_its_decays_and_chunk_size():
    assert BidirectionalAttention(DIM, num_heads=HEADS, decay=1.0).decays == (1.0,) * HEADS
    for decay in (0.0, 1.5, [0.5] * (HEADS - 1)):
        with pytest.raises(ValueError, match=re.escape("decay must hold one value in (0, 1]")):
            BidirectionalAttention(DIM, num_heads=HEADS, decay=decay)
    assert BidirectionalAttention(DIM, num_heads=HEADS, scan_chunk_size=1).scan_chunk_size == 1
    for size in (0, -2, 1.5, True, '4'):
        message = f"scan_chunk_size must be an int >= 1 or None, got {size!r}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            BidirectionalAttention(DIM, num_heads=HEADS, scan_chunk_size=size)


@pytest.mark.parametrize('cls, options, shown', [
    (BidirectionalAttention, dict(decay=0.5, data_gate=True, scan_orders='raster', scan_chunk_size=4),
     "family='bidirectional', dim=32, num_heads=4, head_dim=8, decay=0.5, data_gate=True, scan_orders='raster', "
     "scan_chunk_size=4, feature_map='elu1'"),
    (BidirectionalAttention, dict(data_gate=1),
     "decay='retnet', data_gate=True, scan_orders='raster+column', scan_chunk_size=None"),
    (PerformerAttention, dict(),
     "family='performer', dim=32, num_heads=4, head_dim=8, num_features=8, orthogonal=True"),
    (PerformerAttention, dict(num_features=12, orthogonal=False), "num_features=12, orthogonal=False"),
    (LinformerAttention, dict(), "family='linformer', dim=32, num_heads=4, head_dim=8, low_rank_size=16"),
])
def test_print_shows_each_declared_option_with_its_value_or_default(cls, options, shown):
    assert shown in repr(cls(DIM, num_heads=HEADS, **options))


def test_linformer_refuses_a_low_rank_size_below_one():
    assert LinformerAttention(DIM, num_heads=HEADS, low_rank_size=1).low_rank_size == 1
    with pytest.raises(ValueError, match="^low_rank_size must be >= 1, got 0$"):
        LinformerAttention(DIM, num_heads=HEADS, low_rank_size=0)


def test_performer_features_are_orthogonal_by_default_and_iid_on_request():
    torch.manual_seed(0)
    orthogonal = PerformerAttention(DIM, num_heads=HEADS).projection.double()       # [8, 8]: one block
    gram = orthogonal @ orthogonal.T
    assert torch.allclose(gram - torch.diag(gram.diagonal()), torch.zeros_like(gram), atol=1e-5)
    iid = PerformerAttention(DIM, num_heads=HEADS, orthogonal=False).projection.double()
    gram = iid @ iid.T
    assert (gram - torch.diag(gram.diagonal())).abs().max() > 0.5


def test_a_new_bidirectional_gate_starts_at_weight_zero_and_bias_four():
    gate = BidirectionalAttention(DIM, num_heads=HEADS, data_gate=True).scan_gate
    assert torch.equal(gate.weight, torch.zeros(DIM, DIM)) and torch.equal(gate.bias, torch.full((DIM,), 4.0))
