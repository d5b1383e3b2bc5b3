"""Causal linvit models: the causal forward against the non-causal model's forward with is_causal=True and against
perturbations of later patches; recurrent inference patch by patch (1,024 tokens) equal to the parallel causal
forward with a state that does not grow; a compiled training step without graph breaks; checkpoints shared with
non-causal models."""
import pytest
import timm
import torch
import torch.nn.functional as F

import linvit  # noqa: F401  (registers linvit_*)
from linvit import fast
from linvit.engine import TrainStep


def _model(**kwargs):
    options = dict(depth=2, img_size=32, patch_size=8, embed_dim=32, num_heads=2, num_classes=0, causal=True)
    options.update(kwargs)
    torch.manual_seed(0)
    return timm.create_model('linvit_tiny_patch16_224', **options).eval()


def _patches(images, p):
    """[B, C, H, W] -> list of [B, C, p, p] in raster order (written out)."""
    return [images[:, :, i:i + p, j:j + p] for i in range(0, images.shape[2], p) for j in range(0, images.shape[3], p)]


def test_causal_model_is_the_noncausal_model_with_the_mask():
    causal = _model()
    assert causal.causal and causal.blocks[0].attn.causal and causal.blocks[0].attn.local_mix is None
    plain = _model(causal=False, local_mix=False)
    plain.load_state_dict(causal.state_dict())  # same keys: a causal checkpoint loads into a non-causal model
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = causal.forward_features(images)
        assert torch.equal(out, plain.forward_features(images, is_causal=True))
        assert (out - plain.forward_features(images)).abs().max() > 1e-2
        _, inter = causal.forward_intermediates(images, output_fmt='NLC')
        _, inter_plain = plain.forward_intermediates(images, output_fmt='NLC', is_causal=True)
        assert torch.equal(inter[-1], inter_plain[-1])


def test_no_token_sees_a_later_patch():
    model = _model()
    images = torch.randn(1, 3, 32, 32)
    changed = images.clone()
    changed[:, :, 16:24, 8:16] += 3.0  # patch (2, 1): token 1 + 2 * 4 + 1 = 10
    with torch.no_grad():
        before, after = model.forward_features(images), model.forward_features(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert (before[:, 10:] - after[:, 10:]).abs().amax(dim=-1).min() > 0


@pytest.mark.parametrize('options', [dict(),
                                     dict(reg_tokens=2, class_token=False, no_embed_class=True, global_pool='avg'),
                                     dict(dynamic_img_size=True, qk_norm=True, init_values=0.1)])
def test_recurrent_steps_equal_the_parallel_forward(options):
    model = _model(**options)
    size = (24, 40) if options.get('dynamic_img_size') else (32, 32)
    images = torch.randn(2, 3, *size)
    with torch.no_grad():
        parallel = model.forward_features(images)
        prefix, state = model.recurrent_init(2, feat_size=(size[0] // 8, size[1] // 8))
        rows = [prefix]
        for patch in _patches(images, 8):
            out, state = model.recurrent_step(patch, state)
            rows.append(out[:, None])
    assert prefix.shape[1] == model.num_prefix_tokens
    recurrent = torch.cat(rows, 1)
    assert (recurrent - parallel).abs().max() <= 1e-5 * parallel.abs().max()


def test_recurrent_generation_of_1024_tokens_holds_constant_memory():
    model = _model(img_size=128, patch_size=4, dynamic_img_size=True)  # 32 x 32 = 1,024 patch tokens
    images = torch.randn(1, 3, 128, 128)
    with torch.no_grad():
        parallel = model.forward_features(images)
        prefix, state = model.recurrent_init(1)
        sizes = set()
        rows = [prefix]
        for patch in _patches(images, 4):
            out, state = model.recurrent_step(patch, state)
            rows.append(out[:, None])
            sizes.add(sum(s.kv.numel() * s.kv.element_size() for s in state.layers))
    assert state.position == 1025
    assert sizes == {2 * 1 * 2 * 16 * 17 * 4}  # 2 blocks x [B=1, H=2, D=16, D+1] float32, at every step
    recurrent = torch.cat(rows, 1)
    assert (recurrent - parallel).abs().max() <= 1e-5 * parallel.abs().max()
    with pytest.raises(ValueError, match='every one of the 1024 patches'):
        model.recurrent_step(torch.zeros(1, 3, 4, 4), state)


def test_recurrent_inference_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match='causal=True needs local_mix=False'):
        _model(local_mix=True)
    hybrid = _model(softmax_blocks=(1,))
    with pytest.raises(ValueError, match=r'blocks \[1\] use softmax attention'):
        hybrid.recurrent_init(1)
    model = _model()
    _, state = model.recurrent_init(2)
    with pytest.raises(ValueError, match=r'one patch per sample of shape \[2, 3, 8, 8\]'):
        model.recurrent_step(torch.zeros(2, 3, 16, 16), state)
    with pytest.raises(ValueError, match='takes only its'):
        model.recurrent_init(1, feat_size=(2, 2))


def test_causal_hybrid_passes_the_mask_to_softmax_blocks():
    model = _model(softmax_blocks=(1,))
    images = torch.randn(1, 3, 32, 32)
    changed = images.clone()
    changed[:, :, 24:, 24:] += 3.0  # the last patch
    with torch.no_grad():
        assert torch.equal(model.forward_features(images)[:, :-1], model.forward_features(changed)[:, :-1])


@pytest.mark.compiler
def test_causal_training_step_compiles_without_graph_breaks():
    model = _model(num_classes=5, causal=True).train()
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 3])
    torch._dynamo.reset()
    report = fast.check_graph_breaks(TrainStep(model, F.cross_entropy).forward_loss, images, labels)
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)
    torch._dynamo.reset()
    eager = F.cross_entropy(model(images), labels)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    # AOTAutograd's forward and backward graphs of the causal op, run without inductor's code generation (a cold
    # inductor compile of this step costs ~20 s of CPU; inductor itself is tested on the non-causal steps)
    compiled = TrainStep(model, F.cross_entropy, compile=True, backend='aot_eager').loss(images, labels)
    compiled_grads = torch.autograd.grad(compiled, list(model.parameters()))  # the compiled backward graph
    assert torch.allclose(compiled, eager, rtol=1e-4)
    for (name, _), a, b in zip(model.named_parameters(), eager_grads, compiled_grads):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5), name
    torch._dynamo.reset()



def test_fx_tracing_keeps_the_models_own_mode():
    causal = _model()
    traced = torch.fx.symbolic_trace(causal)
    images = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(traced(images), causal(images))
    plain = torch.fx.symbolic_trace(_model(causal=False, local_mix=False))
    with pytest.raises(ValueError, match='traced non-causal'):
        plain(images, is_causal=True)
