"""linvit.fast: zero graph breaks, no host tensors, CUDA-graph-safe forwards, compiled == eager, the resolution
policy, and the floor.

Graph checks use dynamo alone (torch._dynamo.explain / a capturing backend: no inductor), so they run over every
registered linvit model and every attention option; inductor compiles (slow on CPU) run on depth-2, width-48 models.
"""
import copy
from typing import Any, Callable, Dict, List

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import linvit
from linvit import fast
from linvit.engine.step import TrainStep, compile_train_step
from linvit.fast.compiler import _UNFUSE_CPU_BIAS_ADD, _inductor_options
from linvit.layers import LinearAttention
from linvit.ops import list_feature_maps

IMG = 64
LINVIT_MODELS = timm.list_models('linvit_*')
TINY = dict(img_size=IMG, depth=2, embed_dim=48, num_heads=3, num_classes=10)

# every attention variant: each feature map with and without local mixing, and hybrids with softmax blocks
OPTIONS: List[Dict[str, Any]] = [dict(feature_map=fm, local_mix=lm)
                                 for fm in list_feature_maps() for lm in (False, True)]
OPTIONS += [dict(local_mix=True, softmax_blocks=(1,)), dict(feature_map='relu', local_mix=False, softmax_blocks=(0,))]


def option_id(options: Dict[str, Any]) -> str:
    return '-'.join(f"{k}={v}" for k, v in options.items()).replace(' ', '')


def tiny_linvit(**kwargs) -> nn.Module:
    """A depth-2, width-48 model of the registered linvit family, with every parameter (local mix too) non-zero."""
    assert LINVIT_MODELS, "no linvit_* model is registered with timm: `import linvit` must register them"
    name = 'linvit_tiny_patch16_224' if 'linvit_tiny_patch16_224' in LINVIT_MODELS else LINVIT_MODELS[0]
    model = timm.create_model(name, **{**TINY, **kwargs})
    randomize(model)
    return model


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random parameters everywhere: zero-initialised branches (local mix) would hide a wrong compiled path."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def images(batch: int = 2, height: int = IMG, width: int = IMG, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def targets(batch: int = 2) -> torch.Tensor:
    return torch.arange(batch) % 10


def assert_one_graph(report: fast.GraphReport) -> None:
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)


class CountingBackend:
    """A torch.compile backend that runs graphs eagerly and counts how many were compiled."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        self.graphs += 1
        return gm.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------------
# zero graph breaks: every registered model, every attention option, forward and training step

def test_linvit_models_are_registered():
    # the parametrised tests below iterate this list: an empty one must fail here, not pass silently
    assert LINVIT_MODELS, "no linvit_* model is registered with timm"


@pytest.mark.parametrize('name', LINVIT_MODELS)
def test_registered_model_compiles_as_one_graph(name):
    """Each registered configuration through 2 of its blocks: dynamo traces every block alike (all 12 of ViT-B took
    13 s to trace)."""
    model = timm.create_model(name, img_size=IMG, num_classes=10, depth=2)
    x = images(1)
    assert_one_graph(fast.check_graph_breaks(model.eval(), x))
    step = TrainStep(model.train(), F.cross_entropy)
    assert_one_graph(fast.check_graph_breaks(step.forward_loss, x, targets(1)))


@pytest.mark.parametrize('options', OPTIONS, ids=option_id)
def test_attention_option_compiles_as_one_graph(options):
    model = tiny_linvit(**options)
    x = images()
    assert_one_graph(fast.check_graph_breaks(model.eval(), x))
    step = TrainStep(model.train(), F.cross_entropy)
    assert_one_graph(fast.check_graph_breaks(step.forward_loss, x, targets()))


def test_converted_timm_vit_compiles_as_one_graph():
    vit = timm.create_model('vit_tiny_patch16_224', **TINY)
    model = randomize(linvit.convert_to_linear(vit, local_mix=True))
    assert any(isinstance(m, LinearAttention) for m in model.modules())
    assert_one_graph(fast.check_graph_breaks(model.eval(), images()))
    step = TrainStep(model.train(), F.cross_entropy)
    assert_one_graph(fast.check_graph_breaks(step.forward_loss, images(), targets()))


def test_non_square_dynamic_size_compiles_as_one_graph():
    model = tiny_linvit(local_mix=True, dynamic_img_size=True).eval()
    assert_one_graph(fast.check_graph_breaks(model, images(2, 48, 96)))


def test_graph_break_report_finds_item_and_value_branches():
    def syncs(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        if y.sum() > 0:  # a Python branch on a tensor value
            y = y + 1
        return y * y.max().item()  # a device-to-host read

    report = fast.check_graph_breaks(syncs, torch.randn(8))
    assert report.graph_break_count >= 2 and report.graph_count >= 2
    assert len(report.break_reasons) >= 2 and 'graph break' in str(report)


# ---------------------------------------------------------------------------------------------------------------
# no host tensors (traced on a fake CUDA device: no GPU needed) and no side effects in forward (CUDA graphs)

needs_cuda_build = pytest.mark.skipif(not torch.backends.cuda.is_built(),
                                      reason='fake CUDA tensors need a CUDA build of torch')


@needs_cuda_build
@pytest.mark.parametrize('options', OPTIONS, ids=option_id)
def test_forward_and_loss_create_no_host_tensors(options):
    model = tiny_linvit(**options)
    assert fast.find_host_tensors(model.eval(), images()) == []
    assert fast.find_host_tensors(model.train(), images(), loss_fn=F.cross_entropy, targets=targets()) == []


@needs_cuda_build
def test_host_tensor_check_finds_a_cpu_tensor():
    class MakesCpuTensor(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.arange(x.shape[-1]).to(x)  # no device=: made on the CPU, then copied host-to-device

    found = fast.find_host_tensors(MakesCpuTensor(), torch.randn(2, 4))
    assert found and all('cpu' in line for line in found)


@pytest.mark.parametrize('options', OPTIONS, ids=option_id)
def test_eval_forward_has_no_side_effects(options):
    assert fast.find_forward_side_effects(tiny_linvit(**options).eval(), images()) == []


def test_side_effect_check_finds_writes_counters_and_rng():
    class Impure(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0
            self.drop = nn.Dropout(0.5)
            self.register_buffer('running', torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            self.running.add_(x.mean(0))
            x.mul_(2)
            return self.drop(x)

    effects = fast.find_forward_side_effects(Impure().train(), torch.randn(3, 4))
    assert set(effects) == {'input 0 written in place', 'buffer running written in place',
                            'CPU random generator advanced', 'attribute calls changed'}


# ---------------------------------------------------------------------------------------------------------------
# compiled (inductor) == eager in fp32

@pytest.mark.parametrize('kwargs, size', [(dict(), (200, 200)), (dict(dynamic_img_size=True), (100, 160))],
                         ids=['fixed-size', 'dynamic-not-divisible'])
def test_compiled_model_and_step_raise_the_eager_value_error_for_a_bad_size(kwargs, size, fresh_dynamo):
    model = tiny_linvit(**kwargs)
    x = images(1, *size)
    with pytest.raises(ValueError) as eager_error:
        model(x)
    with pytest.raises(ValueError) as compiled_error:
        fast.compile_model(model, backend='eager')(x)
    assert str(compiled_error.value) == str(eager_error.value)
    step = compile_train_step(model, F.cross_entropy, backend='eager')
    with pytest.raises(ValueError) as step_error:
        step(x, targets(1))
    assert str(step_error.value) == str(eager_error.value)


def test_compiled_inference_matches_eager():
    model = tiny_linvit(feature_map='focused', local_mix=True, softmax_blocks=(1,)).eval()
    compiled = fast.compile_model(model)
    assert compiled.module is model
    assert [p.data_ptr() for p in compiled.parameters()] == [p.data_ptr() for p in model.parameters()]
    x = images()
    with torch.inference_mode():
        expected = model(x)
        for _ in range(2):
            torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-5)
    assert x.equal(images())  # input untouched


class _LinearGeluLinear(nn.Module):
    """[N, 8] -> [N, 8]: fc1 feeds a pointwise GELU, fc2's output is returned (a non-pointwise use)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def test_cpu_bias_add_is_split_off_into_the_following_pointwise_kernel():
    from torch._inductor.utils import run_and_get_code
    model = _LinearGeluLinear().eval()
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    compiled = fast.compile_model(model)
    with torch.inference_mode():
        out, (code, *_) = run_and_get_code(compiled, x)
        expected = (F.gelu(x.double() @ model.fc1.weight.double().T + model.fc1.bias.double())
                    @ model.fc2.weight.double().T + model.fc2.bias.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    # fc1 (GELU follows) becomes mm + a fused bias add; fc2 (its output is the graph's output) stays addmm
    assert code.count('extern_kernels.mm(') == 1 and code.count('extern_kernels.addmm(') == 1, code


def test_inductor_options_respect_a_mode_and_the_users_own_pass():
    assert _inductor_options(None, 'inductor') == {'layout_optimization': False,
                                                        'post_grad_custom_post_pass': _UNFUSE_CPU_BIAS_ADD}
    assert _inductor_options('max-autotune', 'inductor') is None  # torch.compile takes mode or options
    assert _inductor_options(None, 'aot_eager') is None
    with torch._inductor.config.patch(post_grad_custom_post_pass=fast.UnfuseCpuBiasAdd()):
        assert _inductor_options(None, 'inductor') == {'layout_optimization': False}


def test_compiled_local_mix_inference_calls_the_attention_op_next_to_the_convolutions():
    """With local mixing the compiled graph holds depthwise convolutions and, for the attention core, linvit's
    registered op (its PyTorch path on CPU), not inductor's own matmuls of the features; equal to eager."""
    from torch._inductor.utils import run_and_get_code
    model = tiny_linvit(local_mix=True).eval()
    x = images(batch=1)
    with torch.inference_mode():
        out, (code, *_) = run_and_get_code(fast.compile_model(model), x)
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    assert code.count('torch.ops.linvit.linear_attention_qkv.default(') == len(model.blocks), code
    assert 'extern_kernels.bmm(' not in code


def test_train_step_autocast_follows_the_input_device():
    seen = []

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(logits.dtype)
        return F.cross_entropy(logits.float(), y)

    model = tiny_linvit(local_mix=True).train()
    eager = TrainStep(model, loss_fn, amp_dtype=torch.bfloat16)
    loss = eager(images(), targets())
    assert seen == [torch.bfloat16] and torch.isfinite(loss)
    grads = [p.grad.clone() for p in model.parameters()]
    compiled = compile_train_step(model, loss_fn, amp_dtype=torch.bfloat16, backend='aot_eager')
    torch.testing.assert_close(compiled(images(), targets()), loss, rtol=2e-2, atol=2e-2)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=5e-2, atol=5e-2)


# ---------------------------------------------------------------------------------------------------------------
# resolution policy

def test_static_policy_compiles_each_new_resolution_once():
    model = tiny_linvit(local_mix=True, dynamic_img_size=True).eval()
    backend = CountingBackend()
    compiled = fast.compile_model(model, backend=backend)
    counts = []
    with torch.inference_mode():
        for hw in [(64, 64), (96, 64), (64, 64), (128, 128), (96, 64)]:
            x = images(2, *hw)
            torch.testing.assert_close(compiled(x), model(x))
            counts.append(backend.graphs)
    assert counts == [1, 2, 2, 3, 3]


def test_static_policy_holds_more_resolutions_than_dynamos_default():
    model = tiny_linvit(dynamic_img_size=True).eval()
    backend = CountingBackend()
    compiled = fast.compile_model(model, backend=backend)
    sizes = [(16 * h, 16 * w) for h in (1, 2, 3, 4) for w in (1, 2, 3)]  # 12 > dynamo's default limit of 8
    with torch.inference_mode():
        for hw in sizes:
            compiled(images(1, *hw))
    assert backend.graphs == len(sizes) <= fast.RECOMPILE_LIMIT


def test_dynamic_policy_serves_every_size_from_one_graph():
    model = tiny_linvit(local_mix=True, dynamic_img_size=True, dynamic_img_pad=True).eval()
    backend = CountingBackend()
    compiled = fast.compile_model(model, dynamic=True, backend=backend)
    with torch.inference_mode():
        for hw in [(96, 64), (128, 128), (48, 80), (160, 96)]:
            x = images(2, *hw)
            torch.testing.assert_close(compiled(x), model(x))
        assert backend.graphs == 1
        # the construction grid takes timm's unresampled position-embedding branch: at most one more graph
        torch.testing.assert_close(compiled(images(2)), model(images(2)))
        assert backend.graphs <= 2


def dynamic_train_step_matches_eager(freeze_pos_embed: bool = False, **kwargs) -> None:
    # AOTAutograd traces forward and backward with symbolic H and W: what inductor receives
    model = tiny_linvit(local_mix=True, dynamic_img_size=True, dynamic_img_pad=True, **kwargs).train()
    if freeze_pos_embed:
        model.pos_embed.requires_grad_(False)
    reference = copy.deepcopy(model)
    step = compile_train_step(model, F.cross_entropy, dynamic=True, backend='aot_eager')
    ref_step = TrainStep(reference, F.cross_entropy)
    for hw in [(96, 64), (128, 80)]:
        x = images(2, *hw)
        torch.testing.assert_close(step(x, targets()), ref_step(x, targets()))
        for p, q in zip(model.parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad)


def test_dynamic_policy_train_step_matches_eager():
    dynamic_train_step_matches_eager(pos_embed='none')


def test_dynamic_train_step_rejects_a_trained_resampled_position_embedding_up_front():
    # torch 2.14 cannot compile the backward of timm's antialiased bicubic pos-embed resampling for symbolic sizes:
    # the step must refuse at construction, naming the parameter and the ways out, not crash inside inductor
    model = tiny_linvit(dynamic_img_size=True, dynamic_img_pad=True)
    with pytest.raises(ValueError, match=r'pos_embed.*dynamic=False.*requires_grad_\(False\).*pos_embed=.none.'):
        compile_train_step(model, F.cross_entropy, dynamic=True)
    compile_train_step(model, F.cross_entropy, dynamic=False)  # static shapes stay allowed
    TrainStep(model, F.cross_entropy, dynamic=True)  # and so does the eager step


def test_dynamic_train_step_with_a_frozen_resampled_position_embedding_matches_eager():
    # the way out the error names really works: without a gradient for pos_embed there is no resampling backward
    dynamic_train_step_matches_eager(freeze_pos_embed=True)


# non-square sizes up to 3,072 tokens (768 x 1024 px at patch 16): the grid, padding and resampling arithmetic of
# real inputs, through inductor's generated code rather than a backend that replays the graph eagerly
INDUCTOR_SIZES = [(768, 1024), (560, 400), (336, 624)]


def test_inductor_dynamic_inference_matches_eager_at_thousands_of_non_square_tokens():
    model = tiny_linvit(local_mix=True, dynamic_img_size=True, dynamic_img_pad=True).eval()
    compiled = fast.compile_model(model, dynamic=True)
    with torch.inference_mode():
        for hw in INDUCTOR_SIZES:
            x = images(1, *hw)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_inductor_dynamic_train_step_matches_eager_at_thousands_of_non_square_tokens():
    """Two optimizer steps (SGD with momentum) at two sizes from one dynamic graph: the loss (detached), every
    gradient and every updated weight equal the eager step's. The static policy's compiled step is train.py's
    default, tested through it (tests/engine/test_train_seg.py)."""
    model = tiny_linvit(feature_map='focused', local_mix=True, dynamic_img_size=True, dynamic_img_pad=True).train()
    model.pos_embed.requires_grad_(False)  # see test_dynamic_train_step_rejects_..._up_front
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    step = compile_train_step(model, F.cross_entropy, opt, dynamic=True)
    ref_step = TrainStep(reference, F.cross_entropy, ref_opt)
    for i, hw in enumerate(INDUCTOR_SIZES[:2]):  # two sizes: each backward compile costs about a minute here
        x, y = images(1, *hw, seed=20 + i), targets(1)
        loss, ref_loss = step(x, y), ref_step(x, y)
        assert loss.requires_grad is False and loss.shape == ()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, n=name: f"{n}: {m}")
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize('kwargs', [dict(), dict(dynamic_img_size=True)], ids=['fixed-size', 'no-pad'])
def test_dynamic_policy_rejects_models_that_specialise_sizes(kwargs):
    model = tiny_linvit(**kwargs)
    with pytest.raises(ValueError, match='dynamic_img_pad=True'):
        fast.compile_model(model, dynamic=True)
    with pytest.raises(ValueError, match='dynamic_img_pad=True'):
        compile_train_step(model, F.cross_entropy, dynamic=True)


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs (mode="reduce-overhead"): only where a GPU is present

@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cuda_graphs_inference_and_train_step_match_eager():
    from torch._dynamo.utils import counters

    model = tiny_linvit(local_mix=True).cuda().eval()
    x = images().cuda()
    compiled = fast.compile_model(model, mode='reduce-overhead')
    with torch.inference_mode():
        expected = model(x)
        for _ in range(3):  # warm-up, record, replay
            torch.testing.assert_close(compiled(x).clone(), expected, rtol=1e-4, atol=1e-5)
    assert counters['inductor']['cudagraph_skips'] == 0

    model.train()
    reference = copy.deepcopy(model)
    step = compile_train_step(model, F.cross_entropy, mode='reduce-overhead')
    ref_step = TrainStep(reference, F.cross_entropy)
    for _ in range(3):
        torch.testing.assert_close(step(x, targets().cuda()), ref_step(x, targets().cuda()), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)
    assert counters['inductor']['cudagraph_skips'] == 0
