"""LinearAttention as a drop-in for timm's Attention: math, options, masks, errors, timm integration."""
import logging

import pytest
import torch
import torch.nn as nn
from logs import messages_of
from references import linear_attention_layer_ref, rel_err
from timm.layers import Attention
from timm.models.vision_transformer import VisionTransformer

from linvit import LinearAttention, linear_attention_layer, load_softmax_state_dict
from linvit.ops import list_feature_maps

DIM, HEADS = 48, 4



def _tokens(b=2, n=17, dim=DIM, seed=0) -> torch.Tensor:
    return torch.randn(b, n, dim, generator=torch.Generator().manual_seed(seed))


def _randomise(module: nn.Module, seed=0) -> nn.Module:
    """Give every parameter (incl. zero-initialised branches) random values so that no branch is a no-op."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def _reference(layer: LinearAttention, x: torch.Tensor, num_heads: int = HEADS, **kwargs) -> torch.Tensor:
    """The independent float64 forward (tests/references.py) from the layer's state_dict and the test's config.

    x: [B, N, DIM] -> [B, N, dim_out] float64; kwargs: feature_map, eps, key_mask, grid, num_prefix_tokens.
    """
    return linear_attention_layer_ref(layer.state_dict(), x, num_heads, **kwargs)


@pytest.mark.parametrize('qk_norm', [False, True], ids=['plain', 'qk-norm'])
@pytest.mark.parametrize('feature_map', list_feature_maps(learnable=False))
def test_layer_matches_float64_reference(feature_map, qk_norm):
    layer = _randomise(LinearAttention(DIM, HEADS, qkv_bias=True, feature_map=feature_map, qk_norm=qk_norm,
                                       norm_layer=nn.LayerNorm))
    x = _tokens()
    ref = _reference(layer, x, feature_map=feature_map)
    err = ((layer(x).double() - ref).norm() / ref.norm()).item()
    assert err <= 1e-5, f"rel err {err:.2e}"
    # without autograd the feature map is written in place into the qkv output: same result
    with torch.inference_mode():
        err = ((layer(x).double() - ref).norm() / ref.norm()).item()
    assert err <= 1e-5, f"inference-mode rel err {err:.2e}"


@pytest.mark.compiler
@pytest.mark.parametrize('qk_norm', [False, True], ids=['plain', 'qk-norm'])
@pytest.mark.parametrize('feature_map', list_feature_maps(learnable=False))
def test_scripted_layer_matches_float64_reference(feature_map, qk_norm):
    layer = _randomise(LinearAttention(DIM, HEADS, qkv_bias=True, feature_map=feature_map, qk_norm=qk_norm,
                                       norm_layer=nn.LayerNorm))
    x = _tokens()
    ref = _reference(layer, x, feature_map=feature_map)
    with torch.no_grad():
        scripted = torch.jit.script(layer)
        err = ((scripted(x).double() - ref).norm() / ref.norm()).item()
    assert err <= 1e-5, f"torchscript no-grad rel err {err:.2e}"


# every option that changes the math, alone and together; parameters are random so no branch is a no-op
# (LayerNorm weights/biases, gate and local-mix weights all far from identity / zero)
OPTION_SETS = {
    'plain': dict(),
    'qk-norm': dict(qk_norm=True),
    'scale-norm': dict(scale_norm=True),
    'gated': dict(gated=True),
    'local-mix': dict(local_mix=True),
    'all': dict(qk_norm=True, scale_norm=True, gated=True, local_mix=True),
}
GRID, PREFIX = [3, 5], 1
LAYER_TOL = 1e-5


def _option_layer(feature_map: str, options: dict, eps: float = 1e-6, seed: int = 0) -> LinearAttention:
    layer = LinearAttention(DIM, HEADS, qkv_bias=True, norm_layer=nn.LayerNorm, feature_map=feature_map, eps=eps,
                            num_prefix_tokens=PREFIX, **options)
    return _randomise(layer, seed=seed)


def _assert_layer_close(layer: LinearAttention, x: torch.Tensor, ref: torch.Tensor, **forward_kwargs) -> None:
    """Autograd path and no-grad path (in-place feature map / local-mix add) both within LAYER_TOL of ref."""
    err = rel_err(layer(x, feat_size=GRID, **forward_kwargs), ref)
    assert err <= LAYER_TOL, f"rel err {err:.2e} > {LAYER_TOL:.0e}"
    with torch.no_grad():
        err = rel_err(layer(x, feat_size=GRID, **forward_kwargs), ref)
    assert err <= LAYER_TOL, f"no-grad rel err {err:.2e} > {LAYER_TOL:.0e}"


@pytest.mark.parametrize('options', OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize('feature_map', list_feature_maps(learnable=False))
def test_layer_options_match_float64_reference(feature_map, options):
    layer = _option_layer(feature_map, options)
    x = _tokens(n=PREFIX + GRID[0] * GRID[1])
    ref = _reference(layer, x, feature_map=feature_map, grid=GRID, num_prefix_tokens=PREFIX)
    _assert_layer_close(layer, x, ref)


@pytest.mark.parametrize('mask_kind', ['nomask', 'bool-BN', 'additive-B11N'])
@pytest.mark.parametrize('feature_map', list_feature_maps(learnable=False))
def test_layer_with_all_options_and_large_eps_matches_reference(feature_map, mask_kind):
    """eps = 0.5 (mean semantics visible at layer level), with and without a key mask, through every option."""
    layer = _option_layer(feature_map, OPTION_SETS['all'], eps=0.5, seed=1)
    x = _tokens(n=PREFIX + GRID[0] * GRID[1], seed=1)
    keep = torch.rand(2, x.shape[1], generator=torch.Generator().manual_seed(2)) > 0.3
    keep[:, 0] = True
    if mask_kind == 'nomask':
        attn_mask, key_weights = None, None
    elif mask_kind == 'bool-BN':
        attn_mask, key_weights = keep, keep
    else:  # an additive logit mask: finite log-weights on kept keys, -inf on dropped ones
        log_w = torch.randn(keep.shape, generator=torch.Generator().manual_seed(3)) * 0.5
        attn_mask = log_w.masked_fill(~keep, -torch.inf)[:, None, None, :]
        key_weights = torch.where(keep, log_w.double().exp(), 0.0)
    ref = _reference(layer, x, feature_map=feature_map, eps=0.5, key_mask=key_weights, grid=GRID,
                     num_prefix_tokens=PREFIX)
    _assert_layer_close(layer, x, ref, attn_mask=attn_mask)


@pytest.mark.parametrize('masked', [False, True], ids=['nomask', 'mask'])
@pytest.mark.parametrize('options', ['plain', 'qk-norm', 'all'])
@pytest.mark.parametrize('feature_map', list_feature_maps(learnable=False))
def test_layer_gradients_match_float64_reference(feature_map, options, masked):
    """Training runs through the fused Function (packed qkv, or q_norm/k_norm between projection and map): the
    gradients of the tokens and of every parameter against autograd of the float64 reference layer."""
    layer = _option_layer(feature_map, OPTION_SETS[options], seed=4)
    x = _tokens(n=PREFIX + GRID[0] * GRID[1], seed=4).requires_grad_(True)
    keep = torch.rand(2, x.shape[1], generator=torch.Generator().manual_seed(5)) > 0.3 if masked else None
    if keep is not None:
        keep[:, 0] = True
    out = layer(x, attn_mask=keep, feat_size=GRID)
    assert out.grad_fn is not None
    state = {name: p.detach().double().requires_grad_(True) for name, p in layer.named_parameters()}
    x_ref = x.detach().double().requires_grad_(True)
    ref = linear_attention_layer_ref(state, x_ref, HEADS, feature_map=feature_map, key_mask=keep, grid=GRID,
                                     num_prefix_tokens=PREFIX)
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    out.backward(upstream.float())
    ref.backward(upstream)
    assert rel_err(x.grad, x_ref.grad) <= LAYER_TOL, 'tokens'
    for name, p in layer.named_parameters():
        err = rel_err(p.grad, state[name].grad)
        assert err <= LAYER_TOL, f"{name}: rel err {err:.2e}"


def test_layer_key_padding_mask_matches_unpadded():
    layer = _randomise(LinearAttention(DIM, HEADS, qkv_bias=True))
    x = _tokens(b=1, n=12)
    padded = torch.cat([x, torch.randn(1, 5, DIM)], dim=1)
    keep = torch.cat([torch.ones(1, 12, dtype=torch.bool), torch.zeros(1, 5, dtype=torch.bool)], dim=1)
    expected = layer(x)
    for mask in (keep, keep[:, None, None, :], torch.zeros(1, 1, 1, 17).masked_fill(~keep[:, None, None], -torch.inf)):
        torch.testing.assert_close(layer(padded, attn_mask=mask)[:, :12], expected, rtol=1e-5, atol=1e-6)


def test_layer_rejects_full_attention_mask():
    # (is_causal=True is the causal form: tests/layers/test_causal_attention.py)
    layer = LinearAttention(DIM, HEADS)
    x = _tokens(n=6)
    with pytest.raises(ValueError, match=r'key-padding masks only.*got \[2, 1, 6, 6\]'):
        layer(x, attn_mask=torch.ones(2, 1, 6, 6, dtype=torch.bool))


def test_layer_rejects_bad_token_shapes():
    layer = LinearAttention(DIM, HEADS)
    with pytest.raises(ValueError, match=r'\[B, N, 48\], got \[2, 17, 40\]'):
        layer(torch.zeros(2, 17, 40))
    with pytest.raises(ValueError, match=r'got \[17, 48\]'):
        layer(torch.zeros(17, DIM))


def test_constructor_errors():
    with pytest.raises(ValueError, match="unknown feature_map 'nope'"):
        LinearAttention(DIM, HEADS, feature_map='nope')
    with pytest.raises(ValueError, match='attn_drop'):
        LinearAttention(DIM, HEADS, attn_drop=0.1)
    with pytest.raises(ValueError, match='divisible'):
        LinearAttention(50, HEADS)
    with pytest.raises(ValueError, match="unknown LinearAttention options \\['kernel'\\]"):
        linear_attention_layer(kernel='relu')
    with pytest.raises(ValueError, match="unknown feature_map"):
        linear_attention_layer(feature_map='nope')


def test_timm_options_carry_over():
    """qk_norm, scale_norm, gated, attn_head_dim and dim_out build the same parameters as timm's Attention."""
    kwargs = dict(qkv_bias=True, qk_norm=True, scale_norm=True, gated=True, attn_head_dim=16, dim_out=32,
                  norm_layer=nn.LayerNorm)
    ours, theirs = LinearAttention(DIM, HEADS, **kwargs), Attention(DIM, HEADS, **kwargs)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    out = _randomise(ours)(_tokens())
    assert out.shape == (2, 17, 32) and torch.isfinite(out).all()


def test_meta_device_construction():
    layer = LinearAttention(DIM, HEADS, local_mix=True, device='meta', dtype=torch.bfloat16)
    assert all(p.device.type == 'meta' and p.dtype == torch.bfloat16 for p in layer.parameters())


# ---- local mixing ----

def _local_mix_reference(layer: LinearAttention, x: torch.Tensor, grid, prefix) -> torch.Tensor:
    """Per-token neighbourhood sum in float64, written without convolution: what the branch adds before proj."""
    b, n, _ = x.shape
    qkv = (x.double() @ layer.qkv.weight.double().T + layer.qkv.bias.double())
    v = qkv[..., 2 * layer.attn_dim:]  # [B, N, C], channel = head * head_dim + d
    weight = layer.local_mix.conv.weight.double()[:, 0]  # [C, k, k]
    bias = layer.local_mix.conv.bias.double()
    r = weight.shape[-1] // 2
    gh, gw = grid
    out = torch.zeros(b, n, layer.attn_dim, dtype=torch.float64)
    for i in range(gh):
        for j in range(gw):
            acc = bias.expand(b, -1).clone()
            for di in range(-r, r + 1):
                for dj in range(-r, r + 1):
                    ii, jj = i + di, j + dj
                    if 0 <= ii < gh and 0 <= jj < gw:
                        acc = acc + weight[:, di + r, dj + r] * v[:, prefix + ii * gw + jj]
            out[:, prefix + i * gw + j] = acc
    return out


@pytest.mark.parametrize('grad', [True, False], ids=['autograd', 'no-grad'])  # no-grad adds the term in place
@pytest.mark.parametrize('heads', [HEADS, 1], ids=['heads4', 'heads1'])  # one head: the output is a view
@pytest.mark.parametrize('prefix, grid', [(1, (3, 5)), (5, (4, 4)), (0, (2, 7))])
def test_local_mix_adds_depthwise_neighbourhood(prefix, grid, heads, grad):
    base = _randomise(LinearAttention(DIM, heads, qkv_bias=True, local_mix=True, num_prefix_tokens=prefix))
    no_mix = LinearAttention(DIM, heads, qkv_bias=True, num_prefix_tokens=prefix)
    no_mix.load_state_dict(base.state_dict(), strict=False)
    x = _tokens(n=prefix + grid[0] * grid[1])
    # undo the output projection to compare the pre-projection sum
    w_proj = base.proj.weight.double()
    with torch.set_grad_enabled(grad):
        difference = base(x, feat_size=list(grid)).double() - no_mix(x).double()
    got = difference.detach() @ torch.linalg.pinv(w_proj.T)
    expected = _local_mix_reference(base, x, grid, prefix)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_local_mix_starts_as_identity():
    with_mix = _randomise(LinearAttention(DIM, HEADS, qkv_bias=True))
    mixed = LinearAttention(DIM, HEADS, qkv_bias=True, local_mix=True)
    kept = load_softmax_state_dict(mixed, with_mix.state_dict())
    assert kept == ['local_mix.conv.bias', 'local_mix.conv.weight']
    x = _tokens(n=1 + 16)
    torch.testing.assert_close(mixed(x), with_mix(x), rtol=0, atol=0)


def test_local_mix_grid_resolution():
    layer = LinearAttention(DIM, HEADS, local_mix=True, num_prefix_tokens=1, grid_size=(3, 5))
    assert layer(_tokens(n=1 + 15)).shape == (2, 16, DIM)  # construction grid
    assert layer(_tokens(n=1 + 36)).shape == (2, 37, DIM)  # square fallback
    assert layer(_tokens(n=1 + 6 * 10), feat_size=[6, 10]).shape == (2, 61, DIM)  # explicit, non-square
    with pytest.raises(ValueError, match=r'cannot infer the token grid of 61 tokens .*feat_size'):
        layer(_tokens(n=61))
    with pytest.raises(ValueError, match=r'feat_size=\[5, 10\] does not match 61 tokens'):
        layer(_tokens(n=61), feat_size=[5, 10])
    with pytest.raises(ValueError, match='odd'):
        LinearAttention(DIM, HEADS, local_mix=True, local_mix_kernel=4)


# ---- inside timm's VisionTransformer ----

def _vit(attn_layer, **kwargs) -> VisionTransformer:
    cfg = dict(img_size=64, patch_size=16, embed_dim=DIM, depth=2, num_heads=HEADS, num_classes=10, qkv_bias=True)
    cfg.update(kwargs)
    return VisionTransformer(attn_layer=attn_layer, **cfg)


@pytest.mark.parametrize('options', [dict(), dict(feature_map='focused', local_mix=True)], ids=['plain', 'focused-mix'])
def test_vit_with_linear_attention_forward_backward(options):
    # average pooling: with a class-token head the last block's patch tokens (and its local branch) are unused
    model = _vit(linear_attention_layer(**options), global_pool='avg')
    _randomise(model)
    out = model(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 10)
    out.square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"


@pytest.mark.compiler
def test_vit_torchscript_and_fx_match_eager():
    model = _randomise(_vit(linear_attention_layer(local_mix=True))).eval()
    x = torch.randn(2, 3, 64, 64)
    expected = model(x)
    scripted = torch.jit.script(model)
    torch.testing.assert_close(scripted(x), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the in-place local-mix add
        torch.testing.assert_close(scripted(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.fx.symbolic_trace(model)(x), expected, rtol=0, atol=0)


@pytest.mark.compiler
def test_vit_compiles_without_graph_breaks():
    model = _randomise(_vit(linear_attention_layer(local_mix=True))).eval()
    x = torch.randn(2, 3, 64, 64)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.testing.assert_close(torch.compile(model, fullgraph=True)(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('local_mix', [False, True], ids=['plain', 'local-mix'])
def test_vit_loads_softmax_state_dict(local_mix):
    softmax = _randomise(_vit(Attention, reg_tokens=2, qk_norm=True, init_values=1e-2))
    linear = _vit(linear_attention_layer(local_mix=local_mix, num_prefix_tokens=3), reg_tokens=2, qk_norm=True,
                  init_values=1e-2)
    kept = load_softmax_state_dict(linear, softmax.state_dict())
    expected_kept = sorted(f'blocks.{i}.attn.local_mix.conv.{p}' for i in range(2) for p in ('weight', 'bias'))
    assert kept == (expected_kept if local_mix else [])
    linear_sd = linear.state_dict()
    for key, tensor in softmax.state_dict().items():
        assert torch.equal(linear_sd[key], tensor), key
    # the attention-free parts are shared, so the patch embedding sees identical features
    x = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(linear.patch_embed(x), softmax.patch_embed(x), rtol=0, atol=0)


def test_softmax_state_dict_with_wrong_keys_is_rejected():
    linear = _vit(LinearAttention)
    sd = _vit(Attention).state_dict()
    sd['blocks.0.attn.extra'] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"unexpected keys \['blocks.0.attn.extra'\]"):
        load_softmax_state_dict(linear, sd)
    # a key the softmax model does have is never optional
    sd = {k: v for k, v in _vit(Attention).state_dict().items() if k != 'blocks.1.attn.qkv.weight'}
    with pytest.raises(RuntimeError, match=r"missing keys \['blocks.1.attn.qkv.weight'\], unexpected keys \[\]"):
        load_softmax_state_dict(linear, sd)


def test_kept_linear_only_parameters_are_logged_by_name(caplog):
    linear = _vit(linear_attention_layer(local_mix=True))
    with caplog.at_level(logging.INFO, logger='linvit.layers.weights'):
        kept = load_softmax_state_dict(linear, _vit(Attention).state_dict())
    assert messages_of(caplog, 'linvit.layers.weights') == [
        "kept initial values of linear-attention-only parameters: " + ", ".join(kept)]


def test_autocast_bf16_layer_is_finite_and_close():
    layer = _randomise(LinearAttention(DIM, HEADS, qkv_bias=True)).eval()
    x = torch.randn(1, 4096, DIM) * 3
    ref = layer(x)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 3e-2, err  # bf16 projections (8-bit mantissa) dominate; the core itself runs in float32


def test_prefix_tokens_get_no_local_term():
    """Prefix tokens get attention output but no local term: compare against the branch-free layer."""
    base = _randomise(LinearAttention(DIM, HEADS, qkv_bias=True, local_mix=True, num_prefix_tokens=2))
    no_mix = LinearAttention(DIM, HEADS, qkv_bias=True, num_prefix_tokens=2)
    no_mix.load_state_dict(base.state_dict(), strict=False)
    x = _tokens(n=2 + 9)
    torch.testing.assert_close(base(x)[:, :2], no_mix(x)[:, :2], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(base(x)[:, 2:], no_mix(x)[:, 2:])


def test_local_mix_gradients_match_finite_differences():
    """Gradients through the channels-last grid copy and the in-grid slice, checked by finite differences."""
    layer = _randomise(LinearAttention(8, 2, qkv_bias=True, local_mix=True, num_prefix_tokens=1)).double()
    x = torch.randn(1, 1 + 2 * 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: layer(t, feat_size=[2, 3]), (x,))


def test_per_head_key_masks_weight_each_heads_keys():
    """A [B, H, 1, N] mask weights the keys of each head on its own (2 heads: the head axis is neither 1 nor
    collapsed onto head 0); a bool one keeps per-head key sets."""
    layer = _randomise(LinearAttention(DIM, 2, qkv_bias=True))
    x = _tokens(n=9)
    g = torch.Generator().manual_seed(4)
    log_w = torch.randn(2, 2, 9, generator=g) * 0.5
    keep = torch.rand(2, 2, 9, generator=g) > 0.3
    keep[..., 0] = True
    additive = log_w.masked_fill(~keep, -torch.inf)[:, :, None, :]
    weights = torch.where(keep, log_w.double().exp(), 0.0)
    assert not torch.allclose(weights[:, 0], weights[:, 1])
    _assert_layer_close(layer, x, _reference(layer, x, num_heads=2, key_mask=weights), attn_mask=additive)
    _assert_layer_close(layer, x, _reference(layer, x, num_heads=2, key_mask=keep), attn_mask=keep[:, :, None, :])


@pytest.mark.parametrize('dtype, weights_dtype', [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.float64, torch.float64)])
def test_additive_masks_become_weights_in_the_cores_dtype(dtype, weights_dtype):
    """exp(mask) is taken in the core's dtype (float32, float64 for float64): a half-precision exp would round the
    weights to 3 significant digits."""
    from linvit.layers.linear_attention import attn_mask_to_key_mask
    log_w = torch.linspace(-3, 3, 10, dtype=torch.float64).reshape(1, 1, 1, 10)
    weights = attn_mask_to_key_mask(log_w.to(dtype), 1, 10)
    assert weights.dtype == weights_dtype and weights.shape == (1, 10)
    torch.testing.assert_close(weights.double(), log_w.to(dtype).double().exp().reshape(1, 10), rtol=1e-6, atol=0)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_half_precision_tokens_meet_the_core_in_float32(monkeypatch, dtype):
    """The op's PyTorch path (CPU) sees float32 features and values, in training and in inference."""
    import linvit.ops.linear_attn.op as op_module
    seen = []

    def spy(phi_q, phi_k, v, *args):
        seen.append((phi_q.dtype, phi_k.dtype, v.dtype))
        return core(phi_q, phi_k, v, *args)

    core = op_module._attend
    monkeypatch.setattr(op_module, '_attend', spy)
    layer = LinearAttention(DIM, HEADS, dtype=dtype)
    out = layer(_tokens().to(dtype))
    out.float().sum().backward()
    with torch.no_grad():
        layer(_tokens().to(dtype))
    assert out.dtype == dtype and layer.qkv.weight.grad.dtype == dtype
    assert seen == [(torch.float32,) * 3] * 2


def test_a_causal_call_with_local_mixing_says_what_is_supported():
    with pytest.raises(ValueError, match=r'^causal attention needs local_mix=False: the local branch convolves over '
                                         r'neighbouring patches, later ones included$'):
        LinearAttention(DIM, HEADS, local_mix=True, grid_size=(4, 4))(_tokens(), is_causal=True)


def test_defaults_and_biases_build_timms_parameters():
    """Same parameters (names, shapes, bias or not) as timm's Attention for its defaults and each bias switch."""
    for kwargs in ({}, dict(qkv_bias=True), dict(proj_bias=False), dict(gated=True), dict(gated=True, qkv_bias=True),
                   dict(qk_norm=True, scale_norm=True, norm_layer=nn.LayerNorm)):
        ours = {k: v.shape for k, v in LinearAttention(64, **kwargs).state_dict().items()}
        timms = {k: v.shape for k, v in Attention(64, **kwargs).state_dict().items()}
        assert ours == timms, kwargs
    assert LinearAttention(64).num_heads == 8


def test_every_parameter_is_built_on_the_given_device_and_dtype():
    layer = LinearAttention(DIM, HEADS, qkv_bias=True, gated=True, qk_norm=True, scale_norm=True,
                            norm_layer=nn.LayerNorm, local_mix=True, device='meta', dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in layer.parameters()} == {('meta', torch.bfloat16)}


@pytest.mark.parametrize('kwargs, message', [
    (dict(qk_norm=True), r'^qk_norm and scale_norm need a norm_layer$'),
    (dict(scale_norm=True), r'^qk_norm and scale_norm need a norm_layer$'),
    (dict(eps=0.0), r'^eps must be > 0, got 0.0$'),
    (dict(eps=-1e-6), r'^eps must be > 0, got -1e-06$'),
])
def test_options_that_cannot_work_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LinearAttention(DIM, HEADS, **kwargs)


def test_configured_layer_class_names_its_options():
    cls = linear_attention_layer(feature_map='relu', local_mix=True)
    assert cls.__qualname__ == "LinearAttention[feature_map='relu', local_mix=True]"


@pytest.mark.compiler
def test_scripted_layer_applies_key_masks_and_eps():
    """TorchScript runs its own branch of the core (no autocast): masks and eps must reach it too."""
    layer = _randomise(LinearAttention(DIM, HEADS, qkv_bias=True, eps=0.5))
    x = _tokens()
    keep = torch.rand(2, 17, generator=torch.Generator().manual_seed(5)) > 0.3
    keep[:, 0] = True
    scripted = torch.jit.script(layer)
    with torch.no_grad():
        err = rel_err(scripted(x, attn_mask=keep), _reference(layer, x, eps=0.5, key_mask=keep))
    assert err <= LAYER_TOL, f"scripted masked rel err {err:.2e}"


def _spy_on_projected_core(monkeypatch) -> list:
    """Record each call of the folded cores the layer makes: 'features' for
    ``projected_linear_attention_from_features`` (output projection folded), 'inputs' for
    ``projected_linear_attention_from_inputs`` (value and output projections folded)."""
    import linvit.layers.linear_attention as layer_module
    calls = []
    for kind in ('features', 'inputs'):
        name = f'projected_linear_attention_from_{kind}'
        real = getattr(layer_module, name)

        def spy(*args, _kind=kind, _real=real, **kwargs):
            calls.append(_kind)
            return _real(*args, **kwargs)

        monkeypatch.setattr(layer_module, name, spy)
    return calls


@pytest.mark.parametrize('masked', [False, True], ids=['nomask', 'mask'])
@pytest.mark.parametrize('options', ['plain', 'qk-norm'])
def test_inference_folds_the_projection_into_the_core(monkeypatch, options, masked):
    """Without autograd a plain layer whose output goes straight into proj computes proj(attention) as one matmul
    with the projection folded into the key-side state, and without a key mask the value projection too (V is never
    formed): the float64 reference, and the folded core ran once."""
    calls = _spy_on_projected_core(monkeypatch)
    layer = _option_layer('elu1', OPTION_SETS[options], seed=8)
    x = _tokens(n=PREFIX + GRID[0] * GRID[1], seed=8)
    keep = torch.rand(2, x.shape[1], generator=torch.Generator().manual_seed(9)) > 0.3 if masked else None
    ref = _reference(layer, x, feature_map='elu1', key_mask=keep, grid=GRID, num_prefix_tokens=PREFIX)
    with torch.no_grad():
        assert rel_err(layer(x, attn_mask=keep), ref) <= LAYER_TOL
    assert calls == ['features' if masked else 'inputs']
    layer(x, attn_mask=keep)  # with autograd: the fused Function, unfolded
    assert len(calls) == 1


@pytest.mark.parametrize('qkv_bias', [True, False])
@pytest.mark.parametrize('feature_map', list_feature_maps(learnable=False))
def test_value_fold_in_float64_matches_the_reference_tightly(monkeypatch, feature_map, qkv_bias):
    """In float64 the folded layer equals the quadratic reference to rounding: a value bias read from the wrong rows
    of qkv's bias, the key sum times b_v left out or a head's value rows misassigned would all show (each head
    gets its own random weights, so heads are not interchangeable)."""
    calls = _spy_on_projected_core(monkeypatch)
    layer = _randomise(LinearAttention(DIM, HEADS, qkv_bias=qkv_bias, feature_map=feature_map, eps=0.25), seed=3)
    layer = layer.double()
    x = _tokens(n=23, seed=3).double()
    with torch.no_grad():
        got = layer(x)
    assert calls == ['inputs']
    assert rel_err(got, _reference(layer, x, feature_map=feature_map, eps=0.25)) <= 1e-12


def _bf16_layer() -> LinearAttention:
    return LinearAttention(DIM, HEADS).to(torch.bfloat16)


@pytest.mark.parametrize('make_layer, context', [
    (lambda: LinearAttention(DIM, HEADS, local_mix=True, grid_size=GRID, num_prefix_tokens=PREFIX), None),
    (lambda: LinearAttention(DIM, HEADS, gated=True), None),
    (lambda: LinearAttention(DIM, HEADS, scale_norm=True, norm_layer=nn.LayerNorm), None),
    (lambda: LinearAttention(DIM, HEADS), 'autocast'),
    (_bf16_layer, None),
    (lambda: __import__('linvit').layers.attention_layer('performer')(DIM, num_heads=HEADS), None),
    (lambda: LinearAttention(DIM, HEADS), 'jit-trace'),
    (lambda: LinearAttention(DIM, HEADS, attn_backend='triton'), None),
], ids=['local-mix', 'timm-gate', 'scale-norm', 'autocast', 'bfloat16', 'family-with-its-own-mix', 'exporting',
        'triton-kernels'])
def test_inference_keeps_the_projection_apart_where_it_cannot_fold(monkeypatch, make_layer, context):
    """A local branch, an output norm or gate sit between the attention and proj; under autocast or in bfloat16 the
    projection runs in lower precision than the core; other families mix tokens their own way; exporters and
    tracers get the graph every runtime knows; attn_backend='triton' runs the kernels (here under Triton's
    interpreter, which tests/conftest.py turns on)."""
    calls = _spy_on_projected_core(monkeypatch)
    layer = _randomise(make_layer())
    x = _tokens(n=PREFIX + GRID[0] * GRID[1]).to(layer.qkv.weight.dtype)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16, enabled=context == 'autocast'):
        out = torch.jit.trace(layer, x, check_trace=False)(x) if context == 'jit-trace' else layer(x, feat_size=GRID)
    assert calls == [] and torch.isfinite(out).all()


class _ScaledLinear(nn.Linear):
    """A projection whose forward is not F.linear of its weight (as LoRA or quantised wrappers have)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


@pytest.mark.parametrize('change', ['forward-hook', 'pre-hook', 'subclass'])
@pytest.mark.parametrize('target, folded', [('proj', []), ('qkv', ['features'])])
def test_a_projection_with_its_own_forward_is_called_not_folded(monkeypatch, target, folded, change):
    """The folds read proj's (and the value fold qkv's) weight and bias; a hook or a subclass's forward must still
    run. With proj changed the layer keeps the projection apart; with qkv changed it calls qkv and folds only the
    output projection. Either way the no-grad output equals the autograd path's (which calls both)."""
    calls = _spy_on_projected_core(monkeypatch)
    layer = _randomise(LinearAttention(DIM, HEADS, qkv_bias=True))
    module = getattr(layer, target)
    if change == 'forward-hook':
        module.register_forward_hook(lambda module, args, out: out * 3.0)
    elif change == 'pre-hook':
        module.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    else:
        scaled = _ScaledLinear(module.in_features, module.out_features)
        scaled.load_state_dict(module.state_dict())
        setattr(layer, target, scaled)
    x = _tokens()
    expected = layer(x).detach()
    with torch.no_grad():
        got = layer(x)
    assert calls == folded
    assert rel_err(got, expected) <= 1e-5


def test_features_wider_than_the_values_fold_only_the_output_projection(monkeypatch):
    """Hedgehog's features are 2 D wide: phi(K)^T X would cost twice the value projection, so the layer projects V
    and folds the output projection alone; the result equals the autograd path's."""
    calls = _spy_on_projected_core(monkeypatch)
    layer = _randomise(LinearAttention(DIM, HEADS, qkv_bias=True, feature_map='hedgehog'))
    x = _tokens()
    expected = layer(x).detach()
    with torch.no_grad():
        got = layer(x)
    assert calls == ['features']
    assert rel_err(got, expected) <= 1e-5
