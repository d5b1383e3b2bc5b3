"""linvit_* timm models: registry, every model at its default and a non-square size, attention options, sizes,
the timm model API, checkpoints, torchscript / fx / compile. References are timm's own softmax ViT, the quadratic
attention formula, and timm's position-embedding resampler; never the model's own output."""
import logging
import re

import pytest
import timm
import torch
from logs import messages_of
from timm.layers import Attention, resample_abs_pos_embed
from timm.models import create_feature_extractor

import linvit
from linvit import LinearAttention, load_softmax_state_dict
from linvit.models import LinearAttentionBlock, LinearVisionTransformer, SoftmaxAttentionBlock
from linvit.models.linvit import check_image_size
from linvit.ops import list_feature_maps

MODEL_NAMES = timm.list_models('linvit_*')
EXPECTED = {  # name: (embed_dim, num_heads, default size); depth 12 for all
    'linvit_tiny_patch16_224': (192, 3, 224),
    'linvit_small_patch16_224': (384, 6, 224),
    'linvit_base_patch16_224': (768, 12, 224),
    'linvit_small_patch16_512': (384, 6, 512),
    'linvit_base_patch16_1024': (768, 12, 1024),
}
NON_SQUARE = (384, 640)
TINY = 'linvit_tiny_patch16_224'


def _images(b, h, w, seed=0):
    return torch.randn(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


def _tiny(**kwargs) -> LinearVisionTransformer:
    torch.manual_seed(0)
    return timm.create_model(TINY, **kwargs)


def _check_backward(model, x):
    """Backward of the mean logit: every parameter gets a finite gradient, the output is finite."""
    out = model(x)
    assert torch.isfinite(out).all()
    out.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradient for {bad}"
    # the zero-initialised local-mix branch is wired in: its weights get a gradient signal
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith('local_mix.conv.weight'))
    return out


# ---------------------------------------------------------------- registry and every registered model

def test_registry_lists_the_family():
    assert sorted(MODEL_NAMES) == sorted(EXPECTED)
    assert timm.list_models('linvit_*', pretrained=True) == []


@pytest.mark.parametrize('name', MODEL_NAMES)
def test_default_cfg_has_no_weight_source(name):
    cfg = timm.models.get_pretrained_cfg(name)
    assert cfg.url is None and cfg.hf_hub_id is None and cfg.file is None
    size = EXPECTED[name][2]
    assert cfg.input_size == (3, size, size)


@pytest.mark.parametrize('name', MODEL_NAMES)
def test_default_cfg_is_timms_vit_data_config(name):
    """timm's data pipeline (resolve_data_config, create_transform) and its pretrained loading read these fields:
    they match timm's own ViT-S/16 (augreg) config, sized for the model, and name the model's real modules."""
    cfg = timm.models.get_pretrained_cfg(name).to_dict()
    vit = timm.models.get_pretrained_cfg('vit_small_patch16_224.augreg_in21k_ft_in1k').to_dict()
    same = ('num_classes', 'pool_size', 'interpolation', 'mean', 'std', 'first_conv', 'classifier', 'license')
    assert {k: cfg[k] for k in same} == {k: vit[k] for k in same}
    high_res = EXPECTED[name][2] > 224  # dynamic_img_size models: any size, evaluated without a centre crop
    assert (cfg['crop_pct'], cfg['fixed_input_size']) == ((1.0, False) if high_res else (0.9, True))
    model = timm.create_model(name, depth=1, num_classes=7)
    assert isinstance(model.get_submodule(cfg['first_conv']), torch.nn.Conv2d)
    assert model.get_submodule(cfg['classifier']).out_features == 7


@pytest.mark.parametrize('name', MODEL_NAMES)
def test_model_default_size_forward_backward(name):
    """A forward and backward at its default size through 2 of its blocks (the blocks are alike; all 12 of ViT-B at
    1024 px took 26 s of the suite); the whole architecture is checked on the meta device below."""
    size = EXPECTED[name][2]
    torch.manual_seed(0)
    out = _check_backward(timm.create_model(name, num_classes=7, depth=2).train(), _images(1, size, size))
    assert out.shape == (1, 7)


@pytest.mark.parametrize('name', MODEL_NAMES)
def test_model_non_square_forward_backward(name):
    """Through 2 of the model's blocks, as the default-size test: the blocks are alike."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, dynamic_img_size=True, depth=2)
    out = _check_backward(model.train(), _images(1, *NON_SQUARE))
    assert out.shape == (1, 5)


@pytest.mark.parametrize('name', MODEL_NAMES)
def test_model_builds_on_meta_device(name):
    model = timm.create_model(name, device='meta')
    assert {p.device.type for p in model.parameters()} == {'meta'}
    # the architecture its name promises: ViT widths, 12 blocks of linear attention, 16 px patches
    embed_dim, heads, _ = EXPECTED[name]
    assert isinstance(model, LinearVisionTransformer)
    assert (model.embed_dim, len(model.blocks), model.blocks[0].attn.num_heads) == (embed_dim, 12, heads)
    assert all(isinstance(b.attn, LinearAttention) for b in model.blocks)
    assert model.patch_embed.patch_size == (16, 16)


@pytest.mark.parametrize('name', MODEL_NAMES)
def test_model_forward_on_meta_device_gives_meta_outputs_like_timm_vit(name):
    # the attention core's autocast guard has no meta device; timm's shape checks and deferred init need this
    model = timm.create_model(name, device='meta', num_classes=7, depth=2)
    size = model.pretrained_cfg['input_size'][1:]
    out = model(torch.empty(2, 3, *size, device='meta'))
    assert out.device.type == 'meta' and out.shape == (2, 7) and out.dtype == torch.float32
    reference = timm.create_model('vit_tiny_patch16_224', device='meta', num_classes=7, depth=2, img_size=size)
    assert reference(torch.empty(2, 3, *size, device='meta')).shape == out.shape


def test_dtype_argument():
    model = _tiny(dtype=torch.bfloat16, depth=2).eval()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        out = model(_images(1, 224, 224).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


# ---------------------------------------------------------------- attention options

@pytest.mark.parametrize('tokens_kwargs, prefix', [
    (dict(reg_tokens=2), 3),
    (dict(class_token=False, global_pool='avg'), 0),
])
def test_blocks_match_the_quadratic_reference_on_a_non_square_grid(tokens_kwargs, prefix, attention_reference,
                                                                   attention_io, local_mix_randomiser):
    """Each block's attention equals the float64 formula with the conv laid out on the image's true 6x10 grid."""
    model = _tiny(dynamic_img_size=True, depth=3, **tokens_kwargs).eval()
    assert model.num_prefix_tokens == prefix
    local_mix_randomiser(model)
    x = _images(2, 96, 160)
    io = attention_io(model, lambda: model(x))
    assert sorted(io) == [f'blocks.{i}.attn' for i in range(3)]
    for name, (tokens, output) in io.items():
        attn = model.get_submodule(name)
        expected = attention_reference(attn, tokens, grid=(6, 10), num_prefix_tokens=prefix)
        torch.testing.assert_close(output.double(), expected, rtol=1e-4, atol=1e-5)
        transposed = attention_reference(attn, tokens, grid=(10, 6), num_prefix_tokens=prefix)
        assert not torch.allclose(output.double(), transposed, rtol=1e-4, atol=1e-5), "grid layout not checked"


@pytest.mark.parametrize('feature_map', list_feature_maps(learnable=False))
def test_feature_map_option_selects_the_map(feature_map, attention_reference, attention_io):
    model = _tiny(feature_map=feature_map, depth=1).eval()
    assert model.blocks[0].attn.feature_map_name == feature_map
    io = attention_io(model, lambda: model(_images(1, 224, 224)))
    tokens, output = io['blocks.0.attn']
    expected = attention_reference(model.blocks[0].attn, tokens, grid=(14, 14), num_prefix_tokens=1)
    torch.testing.assert_close(output.double(), expected, rtol=1e-4, atol=1e-5)


def test_unknown_feature_map_is_rejected():
    with pytest.raises(ValueError, match="'cosine'"):
        _tiny(feature_map='cosine')


def test_printed_model_shows_what_each_block_computes():
    text = repr(_tiny(feature_map='focused', local_mix=True, local_mix_kernel=5, softmax_blocks=(1,), depth=2))
    assert 'ConfiguredLinearAttention' not in text
    assert "(attn): LinearAttention(\n" in text
    assert "dim=192, num_heads=3, head_dim=64, feature_map='focused', eps=1e-06, local_mix=5x5\n" in text
    assert text.count("feature_map='focused'") == 1  # block 1 keeps softmax attention
    no_local = repr(_tiny(local_mix=False, depth=1))
    assert "feature_map='relu', eps=1e-06, local_mix=off" in no_local  # the models' default map (DEFAULT_FEATURE_MAP)


def test_local_mix_option():
    without = _tiny(local_mix=False, depth=2)
    assert not [n for n, _ in without.named_parameters() if 'local_mix' in n]
    with_mix = _tiny(local_mix=True, depth=2, local_mix_kernel=5)
    names = sorted(n for n, _ in with_mix.named_parameters() if 'local_mix' in n)
    assert names == [f'blocks.{i}.attn.local_mix.conv.{p}' for i in range(2) for p in ('bias', 'weight')]
    assert with_mix.blocks[0].attn.local_mix.conv.kernel_size == (5, 5)
    assert all(torch.count_nonzero(p) == 0 for n, p in with_mix.named_parameters() if 'local_mix' in n)
    with pytest.raises(ValueError, match='local_mix'):
        _tiny(local_mix=1)
    with pytest.raises(ValueError, match='patch_drop_rate'):
        _tiny(patch_drop_rate=0.5)


def test_softmax_blocks_make_a_hybrid():
    model = _tiny(softmax_blocks=(0, 5), depth=6)
    kinds = [type(b.attn) for b in model.blocks]
    assert kinds[0] is Attention and kinds[5] is Attention
    assert all(issubclass(k, LinearAttention) for k in kinds[1:5])
    assert [type(b) for b in model.blocks][:2] == [SoftmaxAttentionBlock, LinearAttentionBlock]
    assert model.softmax_blocks == [0, 5]
    assert torch.isfinite(model(_images(1, 224, 224))).all()


@pytest.mark.parametrize('blocks, message', [
    ((12,), 'index 12 is out of range'),
    ((-1,), 'index -1 is out of range'),
    ((1, 3, 1), r'\[1\] more than once'),
    (('0',), "'0'"),
    ((1.0,), '1.0'),
    ((True,), 'True'),
    ('01', "'01'"),
])
def test_invalid_softmax_blocks_are_rejected(blocks, message):
    with pytest.raises(ValueError, match=message):
        _tiny(softmax_blocks=blocks)


def test_all_softmax_blocks_reproduce_timm_vit_exactly():
    """A linvit model with every block softmax and timm's ViT weights computes timm's logits bit for bit."""
    torch.manual_seed(0)
    vit = timm.create_model('vit_tiny_patch16_224', reg_tokens=4).eval()
    model = _tiny(softmax_blocks=range(12), local_mix=False, reg_tokens=4).eval()
    model.load_state_dict(vit.state_dict(), strict=True)
    x = _images(2, 224, 224)
    with torch.no_grad():
        assert torch.equal(model(x), vit(x))
        # a key mask (second image: its last 50 patch tokens are padding) reaches every softmax block as in timm
        keep = torch.ones(2, 1 + 4 + 196, dtype=torch.bool)
        keep[1, -50:] = False
        mask = keep[:, None, None, :]
        masked = model.forward_features(x, attn_mask=mask)
        assert torch.equal(masked, vit.forward_features(x, attn_mask=mask))
        assert not torch.allclose(masked[1], model.forward_features(x)[1])
        # and a block called on its own (timm's Block API) is not causal unless asked
        tokens = torch.randn(2, 9, 192)
        assert torch.equal(model.blocks[0](tokens), vit.blocks[0](tokens))
        assert not torch.allclose(model.blocks[0](tokens), vit.blocks[0](tokens, is_causal=True))


@pytest.mark.parametrize('options', [
    dict(indices=[0, 2], norm=True, return_prefix_tokens=True),
    dict(indices=1, stop_early=True, intermediates_only=True, output_fmt='NLC'),
    dict(indices=[1], return_prefix_tokens=True, output_dict=True),
    dict(indices=3, masked=True),
    dict(indices=[0, 3], checkpointing=True, norm=True),
    dict(indices=[1], stop_early=True),
    dict(indices=[1, 2], is_causal=True),
    dict(indices=[1], output_dict=True),
    dict(indices=[1, 2], return_prefix_tokens=True, no_prefix=True),
], ids=['norm-prefix', 'stop-early-nlc', 'dict', 'key-mask', 'grad-checkpointing', 'stop-early-final', 'causal',
        'dict-without-prefix', 'no-prefix-tokens'])
def test_forward_intermediates_match_timm_vit(options):
    """With every block softmax, linvit's forward_intermediates must return exactly what timm's ViT returns."""
    options = dict(options)
    masked, checkpointing = options.pop('masked', False), options.pop('checkpointing', False)
    torch.manual_seed(0)
    kwargs = dict(depth=4, reg_tokens=2, dynamic_img_size=True)
    if options.pop('no_prefix', False):
        kwargs.update(reg_tokens=0, class_token=False, global_pool='avg')
    vit = timm.create_model('vit_tiny_patch16_224', **kwargs).eval()
    model = _tiny(softmax_blocks=range(4), local_mix=False, **kwargs).eval()
    model.load_state_dict(vit.state_dict(), strict=True)
    if checkpointing:
        vit.set_grad_checkpointing(True)
        model.set_grad_checkpointing(True)
    x = _images(2, 64, 96)
    if masked:
        keep = torch.ones(2, 1 + 2 + 24, dtype=torch.bool)
        keep[1, -7:] = False
        options['attn_mask'] = keep[:, None, None, :]
    with torch.no_grad():
        got, want = model.forward_intermediates(x, **options), vit.forward_intermediates(x, **options)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if masked:
        unmasked = model.forward_intermediates(x, indices=3)[1][0]
        assert not torch.allclose(got[1][0][1], unmasked[1])


@pytest.mark.parametrize('path', ['forward_features', 'forward_intermediates'])
def test_grad_checkpointing_checkpoints_every_block_only_when_set(monkeypatch, path):
    import linvit.models.linvit as family
    calls = []

    def counting_checkpoint(fn, *args, **kwargs):
        calls.append(fn)
        return fn(*args)

    monkeypatch.setattr(family, 'checkpoint', counting_checkpoint)
    model = _tiny(depth=3)
    getattr(model, path)(_images(1, 224, 224))
    assert calls == []
    model.set_grad_checkpointing(True)
    getattr(model, path)(_images(1, 224, 224))
    assert calls == list(model.blocks)


def _checkpointed_and_plain(model, path, x, **options):
    """(checkpointed, plain) outputs of model.<path>(x, **options): with and without gradient checkpointing."""
    with torch.no_grad():
        model.set_grad_checkpointing(False)
        plain = getattr(model, path)(x, **options)
        model.set_grad_checkpointing(True)
        checkpointed = getattr(model, path)(x, **options)
    return checkpointed, plain


@pytest.mark.parametrize('path', ['forward_features', 'forward_intermediates'])
def test_grad_checkpointing_passes_the_grid_and_mask_to_linear_blocks(path, local_mix_randomiser):
    """Linear blocks with local mixing need the patch grid (a non-square one here) through the checkpoint too."""
    model = _tiny(depth=2, dynamic_img_size=True, reg_tokens=1).eval()
    local_mix_randomiser(model)
    x = _images(2, 64, 96)
    keep = torch.ones(2, 1 + 1 + 24, dtype=torch.bool)
    keep[0, -5:] = False
    mask = keep[:, None, None, :]
    checkpointed, plain = _checkpointed_and_plain(model, path, x, attn_mask=mask)
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)
    unmasked, _ = _checkpointed_and_plain(model, path, x)
    # [0]: the tokens of image 0 (forward_features) or the final tokens (forward_intermediates); both see the mask
    assert not torch.allclose(unmasked[0], checkpointed[0])


@pytest.mark.parametrize('path', ['forward_features', 'forward_intermediates'])
def test_grad_checkpointing_passes_is_causal_to_the_blocks(path):
    """Softmax blocks attend causally through the checkpoint; linear ones with local mixing refuse is_causal there as
    without it (causal linear models: tests/models/test_causal_models.py)."""
    model = _tiny(depth=2, softmax_blocks=(0, 1), dynamic_img_size=True).eval()
    x = _images(1, 64, 96)
    checkpointed, plain = _checkpointed_and_plain(model, path, x, is_causal=True)
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)
    non_causal, _ = _checkpointed_and_plain(model, path, x)
    assert not torch.allclose(checkpointed[0], non_causal[0])
    with pytest.raises(ValueError, match='causal attention needs local_mix=False'):
        _checkpointed_and_plain(_tiny(depth=1).eval(), path, _images(1, 224, 224), is_causal=True)


def test_a_linear_block_called_alone_is_not_causal():
    """timm's Block API: block(x) with the defaults is the non-causal attention (with local mixing, causal calls are
    refused)."""
    block = _tiny(depth=1).eval().blocks[0]
    tokens = torch.randn(2, 1 + 9, 192)
    with torch.no_grad():
        assert torch.equal(block(tokens), block(tokens, attn_mask=None, is_causal=False, feat_size=[3, 3]))
        with pytest.raises(ValueError, match='causal attention needs local_mix=False'):
            block(tokens, is_causal=True)


def test_without_a_depth_the_plan_covers_timms_default_12_blocks():
    kwargs = dict(img_size=32, patch_size=16, embed_dim=32, num_heads=2, num_classes=0)
    model = LinearVisionTransformer(softmax_blocks=(11,), feature_map='relu', local_mix=False, **kwargs)
    assert [type(b.attn) is Attention for b in model.blocks] == [False] * 11 + [True]
    assert model.feature_map == 'relu' and model.local_mix is False and model.softmax_blocks == [11]
    with pytest.raises(ValueError, match=r'softmax_blocks index 12 is out of range.*\(the model has 12 blocks\)'):
        LinearVisionTransformer(softmax_blocks=(12,), **kwargs)


def test_softmax_blocks_are_checked_against_the_given_depth():
    with pytest.raises(ValueError, match=r'softmax_blocks index 4 is out of range.*\(the model has 4 blocks\)'):
        _tiny(depth=4, softmax_blocks=(4,))
    deep = _tiny(depth=13, softmax_blocks=(12,), embed_dim=32, num_heads=2, img_size=32)
    assert [type(b.attn) is Attention for b in deep.blocks] == [False] * 12 + [True]


def test_out_indices_without_features_only_is_accepted_as_by_timms_vit():
    """timm's ViT factory takes out_indices for feature extraction and drops it otherwise; so does linvit's."""
    timm.create_model('vit_tiny_patch16_224', depth=2, out_indices=(1,))
    model = timm.create_model(TINY, depth=2, out_indices=(1,))
    assert len(model.blocks) == 2


def test_block_fn_and_attn_layer_are_chosen_by_linvit():
    for key in ('block_fn', 'attn_layer'):
        with pytest.raises(ValueError, match=key):
            _tiny(**{key: Attention})


# ---------------------------------------------------------------- image sizes

def test_img_size_at_creation_and_size_errors():
    model = _tiny(img_size=(192, 320), depth=2).eval()
    assert model.patch_embed.grid_size == (12, 20) and model.pos_embed.shape[1] == 1 + 12 * 20
    assert model.blocks[0].attn.local_mix.grid_size == (12, 20)
    assert torch.isfinite(model(_images(1, 192, 320))).all()
    with pytest.raises(ValueError, match=r'image size 320x192 .* img_size 192x320'):
        model(_images(1, 320, 192))


def test_dynamic_size_rejects_sizes_the_patch_does_not_divide():
    model = _tiny(dynamic_img_size=True, depth=2)
    with pytest.raises(ValueError, match=r'100x160 is not divisible by the patch size 16x16') as error:
        model(_images(1, 100, 160))
    # the suggested sizes are multiples of the patch that the same model takes
    assert '96x160 or 112x160' in str(error.value) and 'dynamic_img_pad=True' in str(error.value)
    for h, w in ((96, 160), (112, 160)):
        assert model(_images(1, h, w)).shape == (1, 1000)


@pytest.mark.parametrize('size', [(200, 200), (208, 224), (200, 224)])
def test_size_error_on_a_fixed_size_model_suggests_only_fixes_that_work(size):
    model = _tiny(depth=1)
    with pytest.raises(ValueError, match=rf'image size {size[0]}x{size[1]} does not match') as error:
        model(_images(1, *size))
    message = str(error.value)
    assert f"img_size=({size[0]}, {size[1]})" in message
    fixed = _tiny(depth=1, img_size=size).eval()
    # as in timm's ViT, a fixed size keeps floor(size / patch) patches: compare with timm's own model
    reference = timm.create_model('vit_tiny_patch16_224', depth=1, img_size=size).eval()
    assert fixed.forward_features(_images(1, *size)).shape == reference.forward_features(_images(1, *size)).shape
    suggested = dict(dynamic_img_size=True, dynamic_img_pad=True) if 'dynamic_img_pad=True' in message \
        else dict(dynamic_img_size=True)
    assert (size[0] % 16 == 0 and size[1] % 16 == 0) == ('dynamic_img_pad' not in message)
    if 'dynamic_img_pad' in message:  # the pixels a fixed size would lose, as timm's strided convolution does
        assert f"drops the {size[0] % 16} bottom rows and {size[1] % 16} right columns" in message
    assert _tiny(depth=1, **suggested)(_images(1, *size)).shape == (1, 1000)


def test_check_image_size_raises_what_the_forward_raises():
    """linvit.fast checks sizes with it before entering compiled code: same error as the eager forward."""
    for model, size in ((_tiny(depth=1), (200, 224)), (_tiny(depth=1, dynamic_img_size=True), (100, 160))):
        with pytest.raises(ValueError) as eager:
            model(_images(1, *size))
        with pytest.raises(ValueError) as checked:
            check_image_size(model, _images(1, *size))
        assert str(checked.value) == str(eager.value)
        check_image_size(model, _images(1, 224, 224))  # a size the model takes passes
    with pytest.raises(ValueError, match=r"LinearVisionTransformer expects images of shape \[B, C, H, W\], got "
                                         r"\[3, 224, 224\]"):
        check_image_size(_tiny(depth=1), torch.randn(3, 224, 224))
    check_image_size(torch.nn.Linear(2, 2), torch.randn(3, 5))  # no timm patch_embed: nothing to check
    check_image_size(_tiny(depth=1, dynamic_img_size=True, dynamic_img_pad=True), _images(1, 100, 150))  # padded


def _grids_seen_by_blocks(model, x) -> list:
    """The feat_size each block of ``model`` receives in a forward of images x."""
    seen = []
    hooks = [block.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs['feat_size']),
                                             with_kwargs=True) for block in model.blocks]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return seen


def test_patch_grid_with_a_non_square_patch():
    """Rows divide by the patch height (16) and columns by its width (8): the blocks get [H / 16, W / 8]."""
    fixed = _tiny(depth=2, patch_size=(16, 8), img_size=(200, 100)).eval()
    assert _grids_seen_by_blocks(fixed, _images(1, 200, 100)) == [[12, 12]] * 2  # floor, as timm's conv
    dynamic = _tiny(depth=1, patch_size=(16, 8), dynamic_img_size=True).eval()
    assert _grids_seen_by_blocks(dynamic, _images(1, 64, 40)) == [[4, 5]]
    with pytest.raises(ValueError, match=r'64x36 is not divisible by the patch size 16x8; resize it to a multiple of '
                                         r'the patch \(64x32 or 64x40\)'):
        dynamic(_images(1, 64, 36))
    with pytest.raises(ValueError, match=r'70x40 is not divisible .* \(64x40 or 80x40\)'):
        dynamic(_images(1, 70, 40))
    padded = _tiny(depth=1, patch_size=(16, 8), dynamic_img_size=True, dynamic_img_pad=True).eval()
    assert _grids_seen_by_blocks(padded, _images(1, 70, 36)) == [[5, 5]]  # ceil(70 / 16), ceil(36 / 8)
    assert _grids_seen_by_blocks(padded, _images(1, 1, 1)) == [[1, 1]]  # the smallest image: one padded patch
    with pytest.raises(ValueError, match=r'image size 200x99 .* drops the 8 bottom rows and 3 right columns'):
        fixed(_images(1, 200, 99))


@pytest.mark.parametrize('size', [(0, 16), (16, 0)])
def test_an_empty_image_is_rejected_by_name(size):
    model = _tiny(depth=1, dynamic_img_size=True, dynamic_img_pad=True)
    with pytest.raises(ValueError, match=rf'image size {size[0]}x{size[1]} is empty'):
        check_image_size(model, torch.zeros(1, 3, *size))


def test_dynamic_pad_takes_any_size():
    model = _tiny(dynamic_img_size=True, dynamic_img_pad=True, depth=2).eval()
    final, inter = model.forward_intermediates(_images(1, 100, 150))
    assert inter[-1].shape == (1, 192, 7, 10)  # ceil(100 / 16), ceil(150 / 16)
    assert final.shape == (1, 1 + 70, 192)


def test_dynamic_size_resamples_the_position_embedding():
    """At another size the model uses timm's resampled pos_embed: same output as a model built at that size."""
    dynamic = _tiny(dynamic_img_size=True, depth=2).eval()
    fixed = _tiny(img_size=(96, 160), depth=2).eval()
    state = dict(dynamic.state_dict())
    state['pos_embed'] = resample_abs_pos_embed(dynamic.pos_embed, new_size=(6, 10), old_size=(14, 14),
                                                num_prefix_tokens=1)
    fixed.load_state_dict(state)
    x = _images(1, 96, 160)
    with torch.no_grad():
        torch.testing.assert_close(dynamic(x), fixed(x))


def test_set_input_size_changes_the_patch_size_too():
    model = _tiny(depth=2).eval()
    model.set_input_size(img_size=(64, 96), patch_size=(8, 8))
    assert model.patch_embed.patch_size == (8, 8) and model.patch_embed.proj.weight.shape[-2:] == (8, 8)
    assert model.pos_embed.shape[1] == 1 + 8 * 12
    assert {b.attn.local_mix.grid_size for b in model.blocks} == {(8, 12)}
    assert model.forward_features(_images(1, 64, 96)).shape == (1, 1 + 8 * 12, 192)


def test_set_input_size_updates_grid_and_position_embedding():
    model = _tiny(depth=2).eval()
    model.set_input_size(img_size=(256, 320))
    assert model.pos_embed.shape[1] == 1 + 16 * 20
    assert {b.attn.local_mix.grid_size for b in model.blocks} == {(16, 20)}
    assert torch.isfinite(model(_images(1, 256, 320))).all()


# ---------------------------------------------------------------- timm model API

def test_forward_features_head_and_classifier():
    model = _tiny(dynamic_img_size=True, depth=2, reg_tokens=4).eval()
    x = _images(2, 96, 160)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (2, 5 + 60, 192)
        pre = model.forward_head(feats, pre_logits=True)
        assert pre.shape == (2, 192)
        torch.testing.assert_close(model(x), model.head(pre))
        model.reset_classifier(10)
        assert model(x).shape == (2, 10)
        model.reset_classifier(0, 'avg')
        torch.testing.assert_close(model(x), feats[:, 5:].mean(1))
        model.reset_classifier(0, '')
        assert model(x).shape == (2, 65, 192)
    assert {'pos_embed', 'cls_token', 'reg_token'} <= model.no_weight_decay()
    groups = model.group_matcher()
    assert 'stem' in groups and 'blocks' in groups


def test_forward_intermediates():
    model = _tiny(dynamic_img_size=True, depth=4, reg_tokens=2).eval()
    x = _images(1, 96, 160)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        assert [t.shape for t in inter] == [(1, 192, 6, 10)] * 4
        nlc = model.forward_intermediates(x, indices=[1, 3], output_fmt='NLC', intermediates_only=True)
        assert [t.shape for t in nlc] == [(1, 60, 192)] * 2
        torch.testing.assert_close(nlc[1], inter[3].flatten(2).transpose(1, 2))
        # NCHW is the row-major token grid
        torch.testing.assert_close(inter[1][0, :, 2, 7], nlc[0][0, 2 * 10 + 7])
        with_prefix = model.forward_intermediates(x, indices=1, return_prefix_tokens=True, intermediates_only=True)
        assert with_prefix[0][1].shape == (1, 3, 192)
        as_dict = model.forward_intermediates(x, indices=2, output_dict=True, return_prefix_tokens=True)
        assert set(as_dict) == {'image_intermediates', 'image_intermediates_prefix', 'image_features'}
        early = model.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
        torch.testing.assert_close(early[0], inter[0])
        layers = model.get_intermediate_layers(x, n=2, reshape=True)
        torch.testing.assert_close(layers[1], inter[3])
    with pytest.raises(ValueError, match='output_fmt'):
        model.forward_intermediates(x, output_fmt='NHWC')


def test_prune_intermediate_layers():
    model = _tiny(depth=6).eval()
    kept = model.prune_intermediate_layers([1, 3])
    assert kept == [1, 3] and len(model.blocks) == 4 and model.num_classes == 0
    inter = model.forward_intermediates(_images(1, 224, 224), indices=kept, intermediates_only=True)
    assert [t.shape for t in inter] == [(1, 192, 14, 14)] * 2


@pytest.mark.parametrize('name', MODEL_NAMES)
def test_features_only_returns_stride_16_maps(name):
    embed_dim = EXPECTED[name][0]
    model = timm.create_model(name, features_only=True, dynamic_img_size=True, out_indices=(2, 5, 11)).eval()
    assert model.feature_info.reduction() == [16, 16, 16]
    assert model.feature_info.channels() == [embed_dim] * 3
    with torch.no_grad():
        outputs = model(_images(1, 64, 96))
    assert [o.shape for o in outputs] == [(1, embed_dim, 4, 6)] * 3


def test_features_only_takes_the_last_three_blocks_by_default_as_timms_vit():
    model = timm.create_model(TINY, features_only=True, depth=5).eval()
    full = timm.create_model(TINY, depth=5).eval()
    # the feature model holds the backbone under 'model.' and has pruned the final norm and head
    missing, unexpected = full.load_state_dict(
        {k.removeprefix('model.'): v for k, v in model.state_dict().items()}, strict=False)
    assert unexpected == [] and set(missing) == {'norm.weight', 'norm.bias', 'head.weight', 'head.bias'}
    vit = timm.create_model('vit_tiny_patch16_224', features_only=True, depth=5)
    assert model.feature_info.out_indices == vit.feature_info.out_indices == (2, 3, 4)
    with torch.no_grad():
        outputs = model(_images(1, 224, 224))
        expected = full.forward_intermediates(_images(1, 224, 224), indices=[2, 3, 4], intermediates_only=True)
    torch.testing.assert_close(outputs, expected, rtol=0, atol=0)


def test_grad_checkpointing_keeps_outputs_and_gradients():
    model = _tiny(dynamic_img_size=True, depth=3, drop_path_rate=0.0).train()
    x = _images(2, 64, 96)
    reference = model(x)
    reference.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    out = model(x)
    out.sum().backward()
    torch.testing.assert_close(out, reference)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=n)


# ---------------------------------------------------------------- torchscript, fx, compile

@pytest.mark.compiler
def test_torchscript_at_a_non_square_size():
    model = _tiny(dynamic_img_size=True, softmax_blocks=(1,), reg_tokens=2).eval()
    scripted = torch.jit.script(model)
    x = _images(1, 96, 160)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))


@pytest.mark.compiler
def test_fx_traces_static_and_dynamic_models():
    static = _tiny(depth=2, softmax_blocks=(0,)).eval()
    traced = torch.fx.symbolic_trace(static)
    x = _images(1, 224, 224)
    with torch.no_grad():
        assert torch.equal(traced(x), static(x))
    # dynamic sizes trace with timm's tracer (resample_abs_pos_embed is a leaf there, as for timm's own ViT)
    dynamic = _tiny(dynamic_img_size=True, depth=2).eval()
    extractor = create_feature_extractor(dynamic, return_nodes=['blocks.1', 'head'])
    y = _images(1, 96, 160)
    with torch.no_grad():
        features = extractor(y)
        assert torch.equal(features['head'], dynamic(y))
        assert features['blocks.1'].shape == (1, 1 + 60, 192)


@pytest.mark.compiler
def test_torch_compile_fullgraph():
    model = _tiny(dynamic_img_size=True, depth=2, softmax_blocks=(1,)).eval()
    compiled = torch.compile(model, backend='eager', fullgraph=True)
    x = _images(1, 96, 160)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


# ---------------------------------------------------------------- checkpoints

def test_pretrained_without_weights_fails_clearly():
    with pytest.raises(RuntimeError, match='no pretrained weights are published for linvit_tiny_patch16_224'):
        timm.create_model(TINY, pretrained=True)


def test_overlay_file_without_pretrained_warns_that_it_is_ignored(tmp_path):
    path = tmp_path / 'w.pth'
    torch.save(_tiny(depth=1).state_dict(), path)
    with pytest.warns(UserWarning, match='ignored without pretrained=True'):
        timm.create_model(TINY, depth=1, pretrained_cfg_overlay=dict(file=str(path)))
    with pytest.warns(UserWarning, match=r'^linvit_tiny_patch16_224: pretrained_cfg_overlay state_dict= is ignored '
                                         r'without pretrained=True'):
        timm.create_model(TINY, depth=1, pretrained_cfg_overlay=dict(state_dict=_tiny(depth=1).state_dict()))


@pytest.mark.parametrize('size, suggested', [((97, 161), '96x160 or 112x176'), ((111, 175), '96x160 or 112x176')])
def test_the_suggested_multiples_of_the_patch_round_down_and_up(size, suggested):
    with pytest.raises(ValueError, match=rf'resize it to a multiple of the patch \({suggested}\)'):
        _tiny(depth=1, dynamic_img_size=True)(_images(1, *size))


def test_missing_weights_file_is_named(tmp_path):
    missing = tmp_path / 'missing.pth'
    with pytest.raises(FileNotFoundError, match=f"pretrained_cfg_overlay file {re.escape(repr(str(missing)))} does "
                                                f"not exist"):
        timm.create_model(TINY, depth=1, pretrained=True, pretrained_cfg_overlay=dict(file=str(missing)))
    # timm's other way to give the source: a whole pretrained_cfg
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        timm.create_model(TINY, depth=1, pretrained=True, pretrained_cfg=dict(file=str(missing)))


def test_deit3_checkpoint_layer_scale_names_are_adapted(tmp_path):
    """Older DeiT-III / BEiT checkpoints name layer scale 'gamma_1' / 'gamma_2'; timm maps them to ls1/ls2."""
    torch.manual_seed(0)
    source = timm.create_model('vit_tiny_patch16_224', depth=2, init_values=0.1).state_dict()
    for key in [k for k in source if '.ls' in k]:
        source[key.replace('ls1.gamma', 'gamma_1').replace('ls2.gamma', 'gamma_2')] = source.pop(key) + 0.5
    path = tmp_path / 'deit3.pth'
    torch.save(source, path)
    model = timm.create_model(TINY, depth=2, init_values=0.1, pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(path)))
    torch.testing.assert_close(model.blocks[1].ls2.gamma, source['blocks.1.gamma_2'], rtol=0, atol=0)


def test_softmax_vit_small_state_dict_loads_strictly_except_local_mix():
    torch.manual_seed(0)
    vit = timm.create_model('vit_small_patch16_224')
    model = timm.create_model('linvit_small_patch16_224')
    source = vit.state_dict()
    kept = load_softmax_state_dict(model, source)
    assert kept == sorted(f'blocks.{i}.attn.local_mix.conv.{p}' for i in range(12) for p in ('bias', 'weight'))
    state = model.state_dict()
    assert set(state) == set(source) | set(kept)
    assert all(torch.equal(state[k], v) for k, v in source.items())


def test_softmax_checkpoint_file_loads_with_resampled_pos_embed(tmp_path, caplog):
    """pretrained=True with a timm softmax-ViT file: strict apart from local_mix (logged by name), pos_embed
    resampled from the checkpoint's 14x14 grid to the 512 model's 32x32 grid."""
    torch.manual_seed(0)
    source = timm.create_model('vit_small_patch16_224').state_dict()
    path = tmp_path / 'vit_small.pth'
    torch.save(source, path)
    with caplog.at_level(logging.INFO, logger='linvit.models.linvit'):
        model = timm.create_model('linvit_small_patch16_512', pretrained=True,
                                  pretrained_cfg_overlay=dict(file=str(path)))
    assert messages_of(caplog, 'linvit.models.linvit') == [
        "checkpoint without this model's linear-only tensors (a softmax ViT, or a linvit model without them, e.g. "
        "causal): kept their initial values: " + ', '.join(sorted(k for k in model.state_dict() if 'local_mix' in k))]
    state = model.state_dict()
    expected_pos = resample_abs_pos_embed(source['pos_embed'], new_size=(32, 32), old_size=(14, 14),
                                          num_prefix_tokens=1, antialias=True)
    torch.testing.assert_close(state['pos_embed'], expected_pos)
    assert all(torch.equal(state[k], v) for k, v in source.items() if k != 'pos_embed')
    assert all(torch.count_nonzero(v) == 0 for k, v in state.items() if 'local_mix' in k)


def test_linvit_checkpoint_loads_by_file_and_checkpoint_path(tmp_path, local_mix_randomiser):
    original = _tiny(depth=2, reg_tokens=1)
    local_mix_randomiser(original)
    path = tmp_path / 'linvit_tiny.pth'
    torch.save(original.state_dict(), path)
    by_file = timm.create_model(TINY, depth=2, reg_tokens=1, pretrained=True,
                                pretrained_cfg_overlay=dict(file=str(path)))
    by_path = timm.create_model(TINY, depth=2, reg_tokens=1, checkpoint_path=str(path))
    for model in (by_file, by_path):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in original.state_dict().items())
    # a linvit checkpoint that lacks part of its local-mix tensors is not mistaken for a softmax one
    partial = {k: v for k, v in original.state_dict().items() if k != 'blocks.1.attn.local_mix.conv.bias'}
    torch.save(partial, path)
    with pytest.raises(RuntimeError, match='blocks.1.attn.local_mix.conv.bias'):
        timm.create_model(TINY, depth=2, reg_tokens=1, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))


def test_public_api_names():
    assert linvit.convert_to_linear is linvit.models.convert_to_linear
    assert linvit.LinearVisionTransformer is LinearVisionTransformer
