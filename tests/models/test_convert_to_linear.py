"""convert_to_linear on timm softmax models: tensors kept bit for bit, the converted math against the quadratic
reference and against the linvit model, hybrids, token layouts, and clear errors for what cannot be converted."""
import logging

import pytest
import timm
import torch
import torch.nn as nn
from logs import messages_of
from timm.layers import Attention, AttentionRope

from linvit import LinearAttention, convert_to_linear
from linvit.models.convert import attention_sites, linear_attention_from_softmax


def _images(b, h, w, seed=0):
    return torch.randn(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


def _create(name, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, **kwargs).eval()


def _snapshot(model):
    """{key: (tensor object, cloned values)} of the state_dict, to check identity and values after conversion."""
    return {k: (v, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()}


def _assert_kept(model, before, new_keys=()):
    after = model.state_dict(keep_vars=True)
    assert set(after) == set(before) | set(new_keys)
    for key, (tensor, values) in before.items():
        assert after[key] is tensor, f"{key} is no longer the same tensor"
        assert torch.equal(after[key].detach(), values), f"{key} changed"


def _local_mix_keys(paths):
    return {f"{p}.local_mix.conv.{n}" for p in paths for n in ('weight', 'bias')}


def test_vit_tiny_keeps_every_tensor_bit_identical():
    model = _create('vit_tiny_patch16_224')
    before = _snapshot(model)
    x = _images(2, 224, 224)
    with torch.no_grad():
        softmax_logits = model(x)
    assert convert_to_linear(model, local_mix=True) is model
    _assert_kept(model, before, _local_mix_keys(f'blocks.{i}.attn' for i in range(12)))
    assert all(isinstance(b.attn, LinearAttention) for b in model.blocks)
    assert {b.attn.local_mix.grid_size for b in model.blocks} == {(14, 14)}
    with torch.no_grad():
        logits = model(x)
    assert torch.isfinite(logits).all() and not torch.allclose(logits, softmax_logits)


def test_softmax_blocks_covering_all_blocks_keep_the_logits():
    reference = _create('vit_tiny_patch16_224')
    model = _create('vit_tiny_patch16_224')
    convert_to_linear(model, local_mix=True, softmax_blocks=range(12))
    assert all(type(b.attn) is Attention for b in model.blocks)
    x = _images(2, 224, 224)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_converted_attention_matches_the_quadratic_reference(attention_reference, attention_io):
    model = _create('vit_tiny_patch16_224', depth=3, reg_tokens=2)
    convert_to_linear(model, feature_map='relu')
    io = attention_io(model, lambda: model(_images(2, 224, 224)))
    assert sorted(io) == [f'blocks.{i}.attn' for i in range(3)]
    for name, (tokens, output) in io.items():
        expected = attention_reference(model.get_submodule(name), tokens, grid=(14, 14), num_prefix_tokens=3)
        torch.testing.assert_close(output.double(), expected, rtol=1e-4, atol=1e-5)


def test_converted_vit_equals_linvit_model_with_the_same_weights():
    """Two independent paths: timm's VisionTransformer.forward with converted layers, and the linvit model."""
    vit = _create('vit_tiny_patch16_224', depth=4)
    convert_to_linear(vit, softmax_blocks=(2,))
    model = _create('linvit_tiny_patch16_224', depth=4, local_mix=False, softmax_blocks=(2,), feature_map='elu1')
    model.load_state_dict(vit.state_dict(), strict=True)
    x = _images(2, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model(x), vit(x), rtol=0, atol=0)


@pytest.mark.parametrize('name, kwargs, prefix', [
    ('deit_tiny_patch16_224', {}, 1),
    ('deit_tiny_distilled_patch16_224', {}, 2),
    ('deit3_small_patch16_224', {'depth': 2}, 1),  # layer scale, no_embed_class
    ('vit_tiny_patch16_224', {'depth': 2, 'reg_tokens': 4, 'qk_norm': True, 'init_values': 1e-5}, 5),
])
def test_deit_deit3_registers_qk_norm_layer_scale(name, kwargs, prefix):
    model = _create(name, **kwargs)
    before = _snapshot(model)
    convert_to_linear(model, local_mix=True, feature_map='focused')
    paths = [f'blocks.{i}.attn' for i in range(len(model.blocks))]
    _assert_kept(model, before, _local_mix_keys(paths))
    for block in model.blocks:
        assert isinstance(block.attn, LinearAttention) and block.attn.feature_map_name == 'focused'
        assert block.attn.local_mix.num_prefix_tokens == prefix
    if kwargs.get('qk_norm'):
        assert isinstance(model.blocks[0].attn.q_norm, nn.LayerNorm)
    out = model(_images(1, 224, 224))
    out = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(out).all()


def test_hybrid_conversion_and_already_linear_models():
    model = _create('vit_tiny_patch16_224', depth=4)
    convert_to_linear(model, softmax_blocks=(0, 3))
    assert [type(b.attn) is Attention for b in model.blocks] == [True, False, False, True]
    converted = [b.attn for b in model.blocks]
    convert_to_linear(model, softmax_blocks=(0, 3))  # converting again changes nothing
    assert [b.attn for b in model.blocks] == converted
    with pytest.raises(ValueError, match=r'index 1 \(blocks.1.attn\) is already linear'):
        convert_to_linear(model, softmax_blocks=(1,))
    assert [b.attn for b in model.blocks] == converted, "a failed conversion changed the model"
    convert_to_linear(model)  # the already-linear blocks are skipped, and the softmax ones after them converted
    assert all(isinstance(b.attn, LinearAttention) for b in model.blocks)
    assert [b.attn for b in model.blocks][1:3] == converted[1:3]


def test_a_failed_conversion_leaves_every_block_as_it_was():
    model = _create('vit_tiny_patch16_224', depth=3)
    model.blocks[2].attn.attn_drop.p = 0.1
    with pytest.raises(ValueError, match=r'cannot convert blocks.2.attn: attention dropout p=0.1'):
        convert_to_linear(model)
    assert all(type(b.attn) is Attention for b in model.blocks)


def test_an_attention_given_as_the_model_is_pointed_to_the_single_layer_function():
    with pytest.raises(ValueError, match=r'the model itself is an Attention, use linear_attention_from_softmax'):
        convert_to_linear(Attention(32, num_heads=4))
    with pytest.raises(ValueError, match=r'the model itself is an Attention, use linear_attention_from_softmax'):
        convert_to_linear(AttentionRope(32, num_heads=4))
    from timm.models.swin_transformer import WindowAttention
    with pytest.raises(ValueError, match=r'cannot convert <model> \(timm.models.swin_transformer.WindowAttention\): '
                                         r'supported are timm.layers.Attention'):
        convert_to_linear(WindowAttention(32, num_heads=4, window_size=2))


def test_gated_attention_shares_the_gate():
    attn = Attention(32, num_heads=4, qkv_bias=True, gated=True)
    linear = linear_attention_from_softmax(attn)
    assert linear.gate is attn.gate and linear.qkv is attn.qkv and linear.proj is attn.proj
    assert all(p.device.type == 'cpu' for p in linear.parameters())


def test_device_dtype_and_training_mode_follow_the_model():
    meta = timm.create_model('vit_tiny_patch16_224', depth=2, device='meta')
    convert_to_linear(meta, local_mix=True)
    assert {p.device.type for p in meta.parameters()} == {'meta'}
    half = _create('vit_tiny_patch16_224', depth=2).to(torch.bfloat16).train()
    convert_to_linear(half, local_mix=True)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert all(m.training for m in half.modules())


@pytest.mark.compiler
def test_torchscript_of_a_converted_model():
    model = _create('vit_tiny_patch16_224', depth=2)
    convert_to_linear(model, local_mix=True, softmax_blocks=(1,))
    x = _images(1, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.script(model)(x), model(x))


def test_local_mix_on_a_host_without_grid_passing_is_limited_to_known_grids():
    """Documented limitation: timm's forward does not pass the grid, so non-square sizes other than the
    construction grid cannot be resolved (square ones and the construction grid can)."""
    model = _create('vit_tiny_patch16_224', depth=2, dynamic_img_size=True)
    convert_to_linear(model, local_mix=True)
    assert torch.isfinite(model(_images(1, 224, 224))).all()
    assert torch.isfinite(model(_images(1, 160, 160))).all()
    with pytest.raises(ValueError, match='feat_size'):
        model(_images(1, 96, 160))


@pytest.mark.parametrize('build, path, cls', [
    (lambda: _create('vit_tiny_patch16_224', depth=2, attn_layer='diff'), 'blocks.0.attn', 'DiffAttention'),
    (lambda: _create('swin_tiny_patch4_window7_224', depths=(1, 1, 1, 1)), 'layers.0.blocks.0.attn',
     'WindowAttention'),
    (lambda: _create('beit_base_patch16_224', depth=1, img_size=64), 'blocks.0.attn', 'beit.Attention'),
])
def test_other_attention_is_rejected_by_path_and_class(build, path, cls):
    model = build()
    with pytest.raises(ValueError, match=rf'cannot convert {path} \(.*{cls}\)'):
        convert_to_linear(model)
    assert not any(isinstance(m, LinearAttention) for m in model.modules()), "model changed before the error"


class Mixer(nn.Module):
    """Token mixing under a name no rule knows: only its place (a block's ``attn``) tells what it is."""

    def forward(self, x):
        return x


class CrossAttention(Mixer):
    pass


class WindowAttn(Mixer):
    pass


class AttentionWithRelPos(Mixer):
    pass


@pytest.mark.parametrize('path, module', [
    ('blocks.0.attn', Mixer()), ('blocks.0.cross', CrossAttention()), ('mixer', WindowAttn()),
    ('pool', AttentionWithRelPos())])
def test_attention_is_recognised_by_its_place_or_any_of_its_class_name_patterns(path, module):
    model = _create('vit_tiny_patch16_224', depth=1)
    parent, _, child = path.rpartition('.')
    setattr(model.get_submodule(parent) if parent else model, child, module)
    with pytest.raises(ValueError, match=rf'cannot convert {path} \(.*{type(module).__name__}\)'):
        convert_to_linear(model)


def test_models_without_attention_are_rejected():
    with pytest.raises(ValueError, match=r'no timm.layers.Attention in timm.models.convnext.ConvNeXt'):
        convert_to_linear(_create('convnext_atto'))


def test_attention_dropout_is_rejected_by_path():
    model = timm.create_model('vit_tiny_patch16_224', depth=2, attn_drop_rate=0.1)
    with pytest.raises(ValueError, match=r'cannot convert blocks.0.attn: attention dropout p=0.1'):
        convert_to_linear(model)


@pytest.mark.parametrize('kwargs, message', [
    ({'softmax_blocks': (12,)}, 'index 12 is out of range'),
    ({'softmax_blocks': (0, 0)}, r'\[0\] more than once'),
    ({'feature_map': 'softmax'}, "unknown feature_map 'softmax'"),
    ({'local_mix': 'yes'}, 'local_mix'),
])
def test_invalid_options_are_rejected(kwargs, message):
    model = _create('vit_tiny_patch16_224')
    with pytest.raises(ValueError, match=message):
        convert_to_linear(model, **kwargs)
    assert len(attention_sites(model)) == 12 and all(type(b.attn) is Attention for b in model.blocks)


def test_local_mix_needs_a_token_layout():
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention(32, num_heads=4)

    with pytest.raises(ValueError, match='local_mix needs the token layout, but Mixer has no num_prefix_tokens'):
        convert_to_linear(Mixer(), local_mix=True)
    with_prefix_only = Mixer()
    with_prefix_only.num_prefix_tokens = 1  # but no patch_embed.grid_size
    with pytest.raises(ValueError, match='local_mix needs the token layout'):
        convert_to_linear(with_prefix_only, local_mix=True)
    model = convert_to_linear(Mixer())
    assert isinstance(model.attn, LinearAttention)


def test_local_mix_takes_the_models_non_square_grid_and_warns_only_for_dynamic_sizes(caplog):
    fixed = _create('vit_tiny_patch16_224', depth=1, img_size=(32, 48))
    with caplog.at_level(logging.WARNING, logger='linvit.models.convert'):
        convert_to_linear(fixed, local_mix=True)
    assert fixed.blocks[0].attn.local_mix.grid_size == (2, 3) and messages_of(caplog, 'linvit.models.convert') == []
    dynamic = _create('vit_tiny_patch16_224', depth=1, img_size=(32, 48), dynamic_img_size=True)
    with caplog.at_level(logging.WARNING, logger='linvit.models.convert'):
        convert_to_linear(dynamic, local_mix=True)
    assert messages_of(caplog, 'linvit.models.convert') == [
        "local_mix on a converted VisionTransformer finds the patch grid from grid_size (2, 3) or a square token "
        "count; other non-square sizes raise. Load the weights into a linvit_* model for those."]


def test_a_token_layout_without_dynamic_sizes_converts_without_a_warning(caplog):
    """A ViT-like model that has the layout but no dynamic_img_size attribute is a fixed-size model."""
    class Tokens(nn.Module):
        num_prefix_tokens = 1

        def __init__(self):
            super().__init__()
            self.patch_embed = nn.Identity()
            self.patch_embed.grid_size = (2, 3)
            self.attn = Attention(32, num_heads=4)

    with caplog.at_level(logging.WARNING, logger='linvit.models.convert'):
        model = convert_to_linear(Tokens(), local_mix=True)
    assert model.attn.local_mix.grid_size == (2, 3) and messages_of(caplog, 'linvit.models.convert') == []


def test_converted_to_linear_is_a_timm_model_that_loads_its_own_folder(tmp_path):
    """timm.create_model('converted_to_linear', base=...) builds timm's model and converts it (the same tensors as
    convert_to_linear by hand); a timm folder of it (save_for_hf) loads back through local-dir: with equal outputs."""
    from timm.models import save_for_hf

    kwargs = dict(depth=2, embed_dim=48, num_heads=3, patch_size=8, img_size=32, num_classes=5)
    torch.manual_seed(0)
    by_hand = convert_to_linear(timm.create_model('vit_small_patch16_dinov3', **kwargs), feature_map='hedgehog')
    model = timm.create_model('converted_to_linear', base='vit_small_patch16_dinov3',
                              convert={'feature_map': 'hedgehog'}, **kwargs)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in by_hand.state_dict().items()}
    model.load_state_dict(by_hand.state_dict())
    save_for_hf(model, tmp_path, model_args=dict(base='vit_small_patch16_dinov3', convert={'feature_map': 'hedgehog'},
                                                 **kwargs), safe_serialization=True)
    loaded = timm.create_model(f'local-dir:{tmp_path}', pretrained=True).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), by_hand.eval()(images), rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs base=<the timm model it converts>, got base='vit_nope'"):
        timm.create_model('converted_to_linear', base='vit_nope')
