"""convert_to_linear on timm's Eva family (EvaAttention, AttentionRope: EVA02, DINOv3, Perception Encoder, the RoPE
ViTs, Sapiens2) and its refusals (BEiT, SAM, parallel blocks).

The reference is timm's own model: its attention modules run as timm wrote them (their projections, biases, q/k
norms, grouped key/value heads, rotary embeddings, output norm and gate), with only the softmax core replaced by the
float64 quadratic formula of rotary linear attention (linvit/ops/rotary/naive.py), fed the un-rotated queries and
keys. The converted model must give the same outputs.
"""
from typing import Dict

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import AttentionRope
from timm.models.eva import EvaAttention

from linvit import convert_to_linear
from linvit.layers.eva_attention import EvaLinearAttention
from linvit.ops.rotary import quadratic_rotary_linear_attention
from linvit.ops.rotary.naive import _rotate_pairs

#: one model per projection / rotary layout
LAYOUTS = {
    'eva02_tiny_patch14_224': {},  # EvaAttention: fused qkv, separate q / v bias, interleaved rope, SwiGLU
    'vit_small_patch16_dinov3': {},  # rotate-half rope, 4 registers, layer scale
    'vit_small_patch16_dinov3_qkvb': {},  # AttentionRope fused qkv with bias
    'vit_pe_core_tiny_patch16_384': {},  # Perception Encoder: class token, attention pooling
    'vit_small_patch16_rope_mixed_224': {},  # per-head (mixed) rope, one per block
    'vit_base_patch16_sapiens2': {'num_kv_heads': (12, 6)},  # AttentionRope with grouped key/value heads
    'eva_giant_patch14_224': {},  # EvaAttention without rope
}


class _LinearCore:
    """Replaces F.scaled_dot_product_attention inside timm's attention modules by the float64 rotary formula; a
    forward pre-hook on each module hands over that call's rope, prefix count and layout."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.current: Dict = {}
        self.calls = 0
        for module in model.modules():
            if isinstance(module, (EvaAttention, AttentionRope)):
                module.register_forward_pre_hook(self._remember, with_kwargs=True)

    def _remember(self, module, args, kwargs) -> None:
        self.current = dict(rope=kwargs.get('rope'), prefix=module.num_prefix_tokens,
                            half=bool(getattr(module, 'rotate_half', False)))

    def _angles(self, n: int, pairs: int, like: torch.Tensor) -> torch.Tensor:
        rope, prefix, half = self.current['rope'], self.current['prefix'], self.current['half']
        if rope is None:
            return like.new_zeros(n, pairs)
        sin, cos = rope.double().chunk(2, dim=-1)
        angle = torch.atan2(sin, cos)
        angle = angle[..., :pairs] if half else angle[..., 0::2]
        return torch.cat([angle.new_zeros(*angle.shape[:-2], prefix, pairs), angle], dim=-2)

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        assert attn_mask is None and not is_causal
        self.calls += 1
        angle = self._angles(q.shape[2], q.shape[-1] // 2, q.double())
        half = self.current['half']
        q, k = (_rotate_pairs(t.double(), -angle.expand(*t.shape[:-1], angle.shape[-1]), half) for t in (q, k))
        return quadratic_rotary_linear_attention(q, k, v, angle, 'elu1', half=half).to(v.dtype)


def _tiny(name: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = {'depth': 2, 'img_size': 64, **kwargs}
    model = timm.create_model(name, **kwargs).eval()
    for p in model.parameters():  # timm zero-initialises some biases and scales; random values test them
        torch.nn.init.normal_(p, std=0.05) if p.dim() == 1 and p.abs().sum() == 0 else None
    return model


@pytest.mark.parametrize('name', list(LAYOUTS))
def test_converted_model_is_timms_model_with_the_rotary_linear_core(name, monkeypatch):
    softmax = _tiny(name, **LAYOUTS[name])
    converted = _tiny(name, **LAYOUTS[name])
    convert_to_linear(converted)
    assert all(isinstance(m, EvaLinearAttention) for m in converted.modules() if 'Attention' in type(m).__name__
               and m is not converted and not type(m).__name__.startswith('AttentionPool'))
    x = torch.randn(2, 3, 64, 64)
    core = _LinearCore(softmax)
    monkeypatch.setattr(F, 'scaled_dot_product_attention', core)
    with torch.no_grad():
        want = softmax.forward_features(x)
    monkeypatch.undo()
    assert core.calls == 2
    with torch.no_grad():
        got = converted.forward_features(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('name', list(LAYOUTS))
def test_the_softmax_checkpoint_loads_and_the_timm_api_stays(name):
    softmax = _tiny(name, **LAYOUTS[name])
    keys = set(softmax.state_dict())
    converted = convert_to_linear(_tiny(name, **LAYOUTS[name]), local_mix=True)
    new = set(converted.state_dict()) - keys
    assert keys <= set(converted.state_dict()) and new and all('.local_mix.conv.' in key for key in new)
    missing, unexpected = converted.load_state_dict(softmax.state_dict(), strict=False)
    assert not unexpected and set(missing) == new
    x = torch.randn(1, 3, 64, 64)
    final, intermediates = converted.forward_intermediates(x, indices=[0, 1])
    assert len(intermediates) == 2 and intermediates[0].shape[-2:] == (64 // converted.patch_embed.patch_size[0],) * 2
    logits = converted(x)
    logits.sum().backward()
    assert all(p.grad is not None for n, p in converted.named_parameters() if '.attn.' in n and p.requires_grad)


def test_other_families_refuse_rotary_attention_in_one_line():
    model = _tiny('vit_small_patch16_dinov3')
    with pytest.raises(ValueError, match=r"blocks.0.attn: attn_family='performer'.*converts to attn_family='linear'"):
        convert_to_linear(model, attn_family='performer')
    assert isinstance(model.blocks[0].attn, (EvaAttention, AttentionRope))  # nothing changed


@pytest.mark.parametrize('name, why', [('beit_base_patch16_224', 'relative position bias'),
                                       ('samvit_base_patch16', 'windows'),
                                       ('vit_pwee_patch16_reg1_gap_256', 'one fused projection')])
def test_beit_sam_and_parallel_blocks_are_refused_with_the_reason(name, why):
    kwargs = {'img_size': 64, 'window_size': 2} if name.startswith('sam') else {'img_size': 64}
    model = timm.create_model(name, depth=1, **kwargs)
    with pytest.raises(ValueError, match=why) as error:
        convert_to_linear(model)
    assert '\n' not in str(error.value)
