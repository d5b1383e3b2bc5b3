"""convert_to_linear, checked by values: a converted timm model against an independent float64 reference.

The reference is a float64 copy of the original timm model (made before conversion) whose every
``timm.layers.Attention`` forward is replaced by linear attention written out here from that module's own
submodules (qkv, q_norm, k_norm, norm, gate, proj) and the shared float64 references of tests/references.py
(``quadratic_linear_attention`` with phi = elu1 = where(x > 0, x + 1, exp(x)), ``local_mix_ref`` as shifted sums):

    out_i = mean_j s_ij v_j / (mean_j s_ij + eps),   s_ij = phi(q_i)^T phi(k_j),   means over the (kept) keys.

Everything else (patch embedding, prefix tokens, blocks, layer scale, pooling, heads) is timm's own code in both
models, so a difference can only come from how the converted attention computes or what conversion carried over.
Every norm, bias, layer-scale gamma and prefix token is randomised first, so none of them is an identity map.
"""
import copy
import types
from functools import partial
from typing import Dict, Optional, Tuple

import pytest
import timm
import torch
import torch.nn as nn
from references import local_mix_ref
from timm.layers import Attention, AttentionPoolLatent, LayerScale
from timm.models.vision_transformer import ParallelThingsBlock, ResPostBlock, VisionTransformer

from linvit import LinearAttention, convert_to_linear
from linvit.models.convert import linear_attention_from_softmax
from linvit.ops import quadratic_linear_attention

EPS = 1e-6  # LinearAttention's documented default eps
RTOL = 1e-5  # float32 model vs float64 reference: max |error| <= RTOL * max |reference|
IMG = 32
TINY = dict(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)



def gated(model: VisionTransformer) -> VisionTransformer:
    """``model`` with each block's attention replaced by a gated timm Attention (VisionTransformer has no option
    for it: attn_layer must be a class, and a subclass would not be timm's exact Attention)."""
    for block in model.blocks:
        block.attn = Attention(model.embed_dim, num_heads=block.attn.num_heads, qkv_bias=True, gated=True)
    return model


# name -> builder of a tiny softmax timm model; every option that changes what the attention holds or where its
# output goes, alone and combined
CONFIGS = {
    'class_token': lambda: VisionTransformer(**TINY),
    'avg_pool_no_class_token': lambda: VisionTransformer(class_token=False, global_pool='avg', **TINY),
    'registers': lambda: VisionTransformer(reg_tokens=4, **TINY),
    'qk_norm': lambda: VisionTransformer(qk_norm=True, **TINY),
    'scale_attn_norm': lambda: VisionTransformer(scale_attn_norm=True, **TINY),
    'layer_scale': lambda: VisionTransformer(init_values=1e-1, **TINY),
    'no_qkv_bias_no_proj_bias': lambda: VisionTransformer(qkv_bias=False, proj_bias=False, **TINY),
    'gated': lambda: gated(VisionTransformer(**TINY)),
    'deit3_no_embed_class': lambda: VisionTransformer(no_embed_class=True, init_values=1e-1, **TINY),
    'pre_norm_fc_norm': lambda: VisionTransformer(pre_norm=True, global_pool='avg', fc_norm=True, **TINY),
    'map_pool_kept_softmax': lambda: VisionTransformer(global_pool='map', **TINY),
    'res_post_block': lambda: VisionTransformer(block_fn=ResPostBlock, init_values=1e-1, **TINY),
    'parallel_block': lambda: VisionTransformer(block_fn=ParallelThingsBlock, **TINY),
    'everything': lambda: VisionTransformer(reg_tokens=4, qk_norm=True, scale_attn_norm=True, init_values=1e-1,
                                            qkv_bias=False, no_embed_class=True, **TINY),
    'distilled': lambda: timm.create_model('deit_tiny_distilled_patch16_224', pretrained=False, **TINY),
    'deit3_registry': lambda: timm.create_model('deit3_small_patch16_224', pretrained=False, **TINY),
}


# ---------------------------------------------------------------------------------------------- reference


def attention_forward_reference(attn: Attention, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                                is_causal: bool = False, local=None) -> torch.Tensor:
    """Stand-in for ``Attention.forward`` (float64): x [B, N, C] -> [B, N, C_out] with linear attention.

    attn_mask: None or a bool key mask [B, 1, 1, N] (True keeps the key). local: None or
    (conv weight, conv bias, num_prefix_tokens, grid) for the local-mix branch, added before ``attn.norm``.
    """
    assert not is_causal
    b, n, _ = x.shape
    qkv = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    key_mask = None if attn_mask is None else attn_mask.reshape(b, n)
    out = quadratic_linear_attention(q, k, v, 'elu1', EPS, key_mask).transpose(1, 2).reshape(b, n, attn.attn_dim)
    if local is not None:
        weight, bias, num_prefix_tokens, grid = local
        v_tokens = v.transpose(1, 2).reshape(b, n, attn.attn_dim)  # channels head-major, as LinearAttention's
        out = out + local_mix_ref(v_tokens, weight, bias, grid, num_prefix_tokens)
    out = attn.norm(out)
    if attn.gate is not None:
        out = out * attn.gate(x).sigmoid()
    return attn.proj_drop(attn.proj(out))


def float64_reference(model: nn.Module, local: Optional[Dict[str, tuple]] = None) -> nn.Module:
    """A float64 deep copy of the softmax ``model`` whose timm Attention modules compute linear attention.

    local: {attention path: (conv weight, conv bias, num_prefix_tokens, grid)} for a local-mix branch.
    """
    reference = copy.deepcopy(model).double()
    for path, module in reference.named_modules():
        if type(module) is Attention:
            extra = None
            if local is not None:
                weight, bias, prefix, grid = local[path]
                extra = (weight.detach().double(), bias.detach().double(), prefix, grid)
            module.forward = types.MethodType(partial(attention_forward_reference, local=extra), module)
    return reference


# ---------------------------------------------------------------------------------------------- helpers


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every LayerNorm, Linear, layer-scale gamma and prefix / position token random values, so that no norm
    is an identity, no token is ~0 (timm initialises those to 1 / 0 / 1e-6) and attention (Linear weights of std
    fan_in ** -0.5, not timm's 0.02) contributes at the scale of the residual stream. Returns ``model``."""
    g = torch.Generator().manual_seed(seed)

    def rand_(t: torch.Tensor, mean: float, std: float) -> None:
        t.copy_(mean + std * torch.randn(t.shape, generator=g))

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                rand_(module.weight, 1.0, 0.3)
                rand_(module.bias, 0.0, 0.2)
            elif isinstance(module, nn.Linear):
                rand_(module.weight, 0.0, module.in_features ** -0.5)
                if module.bias is not None:
                    rand_(module.bias, 0.0, 0.1)
            elif isinstance(module, LayerScale):
                rand_(module.gamma, 0.0, 0.5)
        for name, p in model.named_parameters():
            if name.split('.')[-1] in ('cls_token', 'reg_token', 'dist_token', 'pos_embed', 'latent'):
                rand_(p, 0.0, 0.5)
    return model


def build(config: str, seed: int = 0) -> nn.Module:
    """The tiny softmax model of ``config`` (TINY sizes), randomised, in eval mode."""
    torch.manual_seed(seed)
    return randomise(CONFIGS[config](), seed).eval()


def images(b: int = 2, seed: int = 1) -> torch.Tensor:
    """Random images [b, 3, IMG, IMG]."""
    return torch.randn(b, 3, IMG, IMG, generator=torch.Generator().manual_seed(seed))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (out float32, ref float64), over tensors of any shape."""
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """Assert the float32 output is within RTOL (relative to the output scale) of the float64 reference."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    assert ref.abs().max() > 1e-2, f"{what}: degenerate reference output"
    err = relative_error(out, ref)
    assert err <= RTOL, f"{what}: relative error {err:.3g} > {RTOL}"
    return err


def convert_with_reference(config: str, **convert_options) -> Tuple[nn.Module, nn.Module, nn.Module]:
    """(softmax original float32, converted float32, float64 linear reference) of one config."""
    softmax = build(config)
    reference = float64_reference(softmax)
    converted = convert_to_linear(copy.deepcopy(softmax), **convert_options)
    return softmax, converted, reference


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize('config', list(CONFIGS))
def test_converted_model_matches_float64_linear_reference(config):
    """forward_features and logits of the converted model equal the reference in eval mode, and attention
    matters: the softmax model is far (> 1000 x tolerance) from the linear reference."""
    softmax, converted, reference = convert_with_reference(config)
    n_attn = sum(type(m) is Attention for m in softmax.modules())
    assert sum(isinstance(m, LinearAttention) for m in converted.modules()) == n_attn > 0
    x = images()
    with torch.no_grad():
        ref_features = reference.forward_features(x.double())
        assert_matches(converted.forward_features(x), ref_features, 'forward_features')
        ref_logits = reference(x.double())
        assert_matches(converted(x), ref_logits, 'logits')
        assert relative_error(softmax.forward_features(x), ref_features) > 1000 * RTOL


@pytest.mark.parametrize('config', ['everything', 'distilled', 'parallel_block', 'gated'])
def test_train_mode_outputs_and_gradients_match_the_reference(config):
    """In train mode (dropout and drop_path 0) the outputs and every parameter's gradient match the reference;
    parameter names are unchanged by conversion, so they pair up by name."""
    softmax, converted, reference = convert_with_reference(config)
    converted.train()
    reference.train()
    x = images()
    out, ref = converted(x), reference(x.double())
    if isinstance(out, tuple):  # a distilled model in distilled-training mode: (head, head_dist)
        out, ref = torch.cat(out, -1), torch.cat(ref, -1)
    assert_matches(out, ref.detach(), 'train-mode logits')
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (out * weights.float()).sum().backward()
    (ref * weights).sum().backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    grads = {n: p.grad for n, p in converted.named_parameters()}
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        if ref_grads[name] is None or ref_grads[name].abs().max() == 0:
            continue  # e.g. the distillation head when not trained, unused tokens
        err = relative_error(grad, ref_grads[name])
        assert err <= 2 * RTOL, f"gradient of {name}: relative error {err:.3g}"


def test_distilled_training_mode_returns_both_heads_matching_the_reference():
    """deit distilled with distilled_training=True returns (head, head_dist) in train mode; both match."""
    softmax, converted, reference = convert_with_reference('distilled')
    for model in (converted, reference):
        model.set_distilled_training(True)
        model.train()
    x = images()
    with torch.no_grad():
        out, ref = converted(x), reference(x.double())
    assert isinstance(out, tuple) and len(out) == 2
    for o, r in zip(out, ref):
        assert_matches(o, r, 'distilled head')


@pytest.mark.parametrize('mode', ['eval', 'train'])
def test_every_converted_module_keeps_the_models_mode(mode):
    """A model converted in eval mode has every module in eval mode (the new LinearAttention shells included);
    one converted in train mode has every module in train mode."""
    model = build('everything')
    model.train(mode == 'train')
    convert_to_linear(model, local_mix=True)
    flags = {name: m.training for name, m in model.named_modules()}
    wrong = [name for name, flag in flags.items() if flag != (mode == 'train')]
    assert not wrong, f"modules not in {mode} mode after conversion: {wrong}"


def test_proj_dropout_is_carried_and_follows_the_mode():
    """proj_drop_rate > 0: in eval mode the converted model is deterministic and equals the reference; in train
    mode the dropout is active (two calls differ)."""
    torch.manual_seed(0)
    softmax = randomise(VisionTransformer(proj_drop_rate=0.3, **TINY)).eval()
    reference = float64_reference(softmax)
    converted = convert_to_linear(copy.deepcopy(softmax))
    assert all(b.attn.proj_drop.p == 0.3 for b in converted.blocks)
    x = images()
    with torch.no_grad():
        assert_matches(converted(x), reference(x.double()), 'eval logits with proj_drop')
        converted.train()
        assert not torch.equal(converted(x), converted(x))


def test_hybrid_keeps_softmax_where_asked():
    """softmax_blocks=(1,): block 0 linear, block 1 the original softmax; the reference patches only block 0."""
    softmax = build('everything')
    reference = copy.deepcopy(softmax).double()
    attn0 = reference.blocks[0].attn
    attn0.forward = types.MethodType(attention_forward_reference, attn0)
    converted = convert_to_linear(copy.deepcopy(softmax), softmax_blocks=(1,))
    assert type(converted.blocks[1].attn) is Attention and isinstance(converted.blocks[0].attn, LinearAttention)
    x = images()
    with torch.no_grad():
        assert_matches(converted.forward_features(x), reference.forward_features(x.double()), 'hybrid features')


@pytest.mark.parametrize('config', ['registers', 'everything', 'avg_pool_no_class_token'])
def test_local_mix_with_random_weights_matches_the_reference(config, local_mix_randomiser):
    """local_mix=True with random conv weights through a whole converted model: the depthwise conv over V on the
    patch grid (prefix tokens excluded) is added before the attention's norm, as in the reference."""
    softmax = build(config)
    converted = convert_to_linear(copy.deepcopy(softmax), local_mix=True)
    local_mix_randomiser(converted, seed=3)
    grid = tuple(softmax.patch_embed.grid_size)
    local = {}
    for path, m in converted.named_modules():
        if isinstance(m, LinearAttention):
            assert m.local_mix.num_prefix_tokens == softmax.num_prefix_tokens
            local[path] = (m.local_mix.conv.weight, m.local_mix.conv.bias, softmax.num_prefix_tokens, grid)
    reference = float64_reference(softmax, local)
    without_local = float64_reference(softmax)
    x = images()
    with torch.no_grad():
        ref = reference.forward_features(x.double())
        assert_matches(converted.forward_features(x), ref, 'features with local mix')
        assert relative_error(without_local.forward_features(x.double()), ref) > 1000 * RTOL
        converted.train()
        assert_matches(converted.forward_features(x), ref, 'train-mode features with local mix')


def test_key_padding_mask_through_the_whole_model():
    """forward_features(x, attn_mask=[B, 1, 1, N] bool) masks the same keys in every converted block as the
    reference's mean over kept keys; masking changes the output."""
    softmax, converted, reference = convert_with_reference('registers')
    n = softmax.num_prefix_tokens + softmax.patch_embed.num_patches
    keep = torch.rand(2, n, generator=torch.Generator().manual_seed(4)) > 0.4
    keep[:, 0] = True
    mask = keep[:, None, None, :]
    x = images()
    with torch.no_grad():
        ref = reference.forward_features(x.double(), attn_mask=mask)
        assert_matches(converted.forward_features(x, attn_mask=mask), ref, 'masked features')
        assert relative_error(reference.forward_features(x.double()), ref) > 1000 * RTOL


def test_map_pool_stays_softmax_and_is_not_converted():
    """global_pool='map' pools with AttentionPoolLatent, which conversion leaves as it is (same object)."""
    softmax = build('map_pool_kept_softmax')
    pool = softmax.attn_pool
    convert_to_linear(softmax)
    assert softmax.attn_pool is pool and isinstance(pool, AttentionPoolLatent)


def test_dynamic_img_size_at_a_non_square_size_and_intermediates():
    """dynamic_img_size=True at 48 x 40 px (a 6 x 5 grid, not the construction one): features and every block's
    intermediate output match the reference."""
    torch.manual_seed(0)
    softmax = randomise(VisionTransformer(dynamic_img_size=True, reg_tokens=2, init_values=1e-1, **TINY)).eval()
    reference = float64_reference(softmax)
    converted = convert_to_linear(copy.deepcopy(softmax))
    x = torch.randn(2, 3, 48, 40, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert_matches(converted.forward_features(x), reference.forward_features(x.double()), 'features 48x40')
        outs = converted.forward_intermediates(x, intermediates_only=True)
        refs = reference.forward_intermediates(x.double(), intermediates_only=True)
    assert len(outs) == len(refs) == TINY['depth']
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.shape[-2:] == (6, 5)
        assert_matches(out, ref, f'intermediate {i}')


def test_one_attention_with_its_own_head_dim_output_width_and_no_biases():
    """linear_attention_from_softmax on a timm Attention whose head dim is not dim / heads and whose output width
    differs from its input; its defaults add no local mixing."""
    torch.manual_seed(0)
    attn = Attention(32, num_heads=2, attn_head_dim=8, dim_out=24, qkv_bias=False, proj_bias=False, gated=True)
    reference = copy.deepcopy(attn).double()
    reference.forward = types.MethodType(attention_forward_reference, reference)
    linear = linear_attention_from_softmax(attn)
    assert linear.local_mix is None and linear.training  # the mode of attn (a new module trains)
    x = torch.randn(2, 7, 32)
    out = linear.eval()(x)
    assert out.shape == (2, 7, 24)
    torch.testing.assert_close(out.double(), reference(x.double()), rtol=1e-5, atol=1e-5)
    mixed = linear_attention_from_softmax(copy.deepcopy(attn), local_mix=True, grid_size=(2, 3))
    assert (mixed.local_mix.conv.kernel_size, mixed.local_mix.num_prefix_tokens) == ((3, 3), 1)
    with pytest.raises(ValueError, match=r'expected timm.layers.Attention, got torch.nn.modules.linear.Linear'):
        linear_attention_from_softmax(nn.Linear(2, 2))
