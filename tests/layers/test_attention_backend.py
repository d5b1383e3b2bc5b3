"""attn_backend: who computes plain linear attention in layers and models ('auto', 'triton', 'torch').

Without a GPU the Triton kernels run under the interpreter (tests/conftest.py), so a model forced onto them is
compared with the same model on the PyTorch path (outputs and every parameter's gradient) and with the float64
layer reference; the op compiles as one graph inside a layer; errors name the reason.
"""
import copy
import importlib

import pytest
import timm
import torch
from references import linear_attention_layer_ref, rel_err
from torch.utils._python_dispatch import TorchDispatchMode

import linvit
from linvit.fast import check_graph_breaks
from linvit.layers import LinearAttention, attention_layer
from linvit.ops import kernels_serve, triton_interpreting

needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreting()),
                                   reason="the Triton kernels need CUDA or TRITON_INTERPRET=1")


def _set_backend(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, LinearAttention):
            module.attn_backend = backend
    return model


def _output_and_grads(model, images):
    out = model(images)
    out.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


@needs_kernels
@pytest.mark.parametrize('kwargs', [dict(), dict(qk_norm=True, feature_map='relu', local_mix=False)],
                         ids=['packed-elu1-local-mix', 'qk-norm-relu'])
def test_model_on_the_kernels_equals_the_pytorch_path(kwargs):
    torch.manual_seed(0)
    model = timm.create_model('linvit_tiny_patch16_224', img_size=64, num_classes=7, depth=2, attn_backend='torch',
                              **kwargs)
    for p in model.parameters():  # local mixing starts at zero; give every parameter a value that matters
        p.data.add_(0.02 * torch.randn_like(p))
    images = torch.randn(2, 3, 64, 64)
    ref_out, ref_grads = _output_and_grads(model, images)
    kernel_out, kernel_grads = _output_and_grads(_set_backend(copy.deepcopy(model), 'triton'), images)
    assert rel_err(kernel_out, ref_out) < 1e-5
    assert ref_grads.keys() == kernel_grads.keys() and len(ref_grads) == len(list(model.parameters()))
    for name in ref_grads:
        assert rel_err(kernel_grads[name], ref_grads[name]) < 1e-4, name


@needs_kernels
def test_layer_on_the_kernels_against_the_float64_reference_with_a_key_mask():
    torch.manual_seed(1)
    layer = LinearAttention(64, num_heads=2, qkv_bias=True, attn_backend='triton')
    x = torch.randn(2, 90, 64)
    keep = torch.rand(2, 90) > 0.4
    out = layer(x, attn_mask=keep)
    state = {k: v.double() for k, v in layer.state_dict().items()}
    ref = linear_attention_layer_ref(state, x.double(), 2, 'elu1', key_mask=keep)
    assert rel_err(out, ref) < 1e-5


class _LinvitOps(TorchDispatchMode):
    """Records the linvit ops a block of code dispatches (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith('linvit.'):
            self.names.append(str(func).split('.')[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('backend', ['auto', pytest.param('triton', marks=needs_kernels), 'torch'])
def test_every_mode_calls_the_op_which_picks_the_implementation(backend):
    """Training and inference, packed and q/k-normed layers: one op call per direction whatever the backend; the
    op (not the layer) decides that CPU tensors on 'auto' take its PyTorch path."""
    packed = LinearAttention(32, num_heads=2, attn_backend=backend, local_mix=True, grid_size=(3, 3))
    normed = LinearAttention(32, num_heads=2, attn_backend=backend, qk_norm=True, norm_layer=torch.nn.LayerNorm,
                             local_mix=True, grid_size=(3, 3))  # (without a local branch CPU inference folds proj)
    x = torch.randn(1, 10, 32, requires_grad=True)
    for layer, op in ((packed, 'linear_attention_qkv'), (normed, 'linear_attention')):
        with _LinvitOps() as training:
            layer(x).sum().backward()
        assert training.names == [op, op + '_backward']
        with torch.no_grad(), _LinvitOps() as inference:
            layer(x)
        assert inference.names == [op]
    assert kernels_serve(backend, x, x, x, 'elu1') == (backend == 'triton')


def test_the_inference_fold_asks_the_op_about_head_wide_tensors(monkeypatch):
    """CPU inference folds the projections into the PyTorch core unless the op would run its kernels; the question is
    asked before qkv exists, and must be asked of head-wide tensors (the kernels take heads up to 128 wide: a layer
    width of 384 would read as unsupported and fold on a GPU too)."""
    import linvit.layers.linear_attention as layer_module
    seen = []

    def spy(backend, q, k, v, feature_map, key_mask=None):
        seen.append((backend, q.shape[-1], q.dtype, q.device.type))
        return False

    monkeypatch.setattr(layer_module, 'kernels_serve', spy)
    layer = LinearAttention(384, num_heads=6).eval()
    with torch.no_grad():
        layer(torch.randn(1, 10, 384))
    assert seen and all(entry == ('auto', 64, torch.float32, 'cpu') for entry in seen)


@pytest.mark.compiler
@pytest.mark.parametrize('exporting_under_dynamo', [False, True], ids=['torch', 'torch-2.11-is-exporting'])
@pytest.mark.parametrize('training', [True, False], ids=['training', 'inference'])
def test_compiled_model_graph_holds_the_op_once_per_attention_block(monkeypatch, training, exporting_under_dynamo):
    """A plain torch.compile of a default model (attn_backend='auto'): dynamo's graph holds linvit's op once per
    block, so the op (Triton on a GPU) is what runs compiled, in training and in inference. Also where dynamo reads
    torch.compiler.is_exporting() as True under a plain compile (torch 2.11, the GPU machine's)."""
    if exporting_under_dynamo:
        core_module = importlib.import_module('linvit.ops.common')
        monkeypatch.setattr(core_module, 'is_exporting', lambda: True)
    model = timm.create_model('linvit_tiny_patch16_224', img_size=32, depth=3, num_classes=4)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    images = torch.randn(2, 3, 32, 32)
    with torch.set_grad_enabled(training):
        compiled(images)
    (graph,) = graphs
    ops = [str(node.target) for node in graph.graph.nodes if node.op == 'call_function']
    assert [op for op in ops if op.startswith('linvit.')] == ['linvit.linear_attention_qkv'] * 3


@pytest.mark.compiler
@needs_kernels
def test_kernel_layer_compiles_as_one_graph_equal_to_eager():
    torch.manual_seed(2)
    layer = LinearAttention(64, num_heads=2, attn_backend='triton')
    x = torch.randn(2, 70, 64, requires_grad=True)
    report = check_graph_breaks(layer, x)
    assert report.graph_break_count == 0 and report.graph_count == 1, report
    compiled = torch.compile(layer, fullgraph=True)
    for fn in (layer, compiled):
        out = fn(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
        if fn is layer:
            eager = (out, grad)
    torch.testing.assert_close(out, eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, eager[1], rtol=1e-5, atol=1e-6)


@pytest.mark.compiler
def test_fx_traced_model_scripts_and_matches_eager():
    """timm's contract: a traced linvit model (training mode, grad on: the fused path's graph) scripts."""
    torch.manual_seed(3)
    model = timm.create_model('linvit_tiny_patch16_224', img_size=64, num_classes=5, depth=2)
    traced = torch.fx.symbolic_trace(model)
    assert any('linvit.linear_attention_qkv' in str(node.target) for node in traced.graph.nodes)
    scripted = torch.jit.script(traced)
    images = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(scripted(images), model(images), rtol=1e-5, atol=1e-6)


def test_backend_option_reaches_every_layer_and_errors_name_the_reason():
    model = timm.create_model('linvit_tiny_patch16_224', img_size=64, depth=2, attn_backend='torch')
    layers = [m for m in model.modules() if isinstance(m, LinearAttention)]
    assert layers and all(m.attn_backend == 'torch' for m in layers)
    assert "attn_backend='torch'" in repr(layers[0])
    converted = linvit.convert_to_linear(timm.create_model('vit_tiny_patch16_224', img_size=64, depth=2),
                                         attn_backend='triton')
    assert all(m.attn_backend == 'triton' for m in converted.modules() if isinstance(m, LinearAttention))
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        timm.create_model('linvit_tiny_patch16_224', img_size=64, depth=2, attn_backend='cuda')
    with pytest.raises(ValueError, match="mixes tokens its own way"):
        attention_layer('gated', attn_backend='triton')(64, num_heads=2)
    with pytest.raises(ValueError, match="non-causal"):
        LinearAttention(64, num_heads=2, causal=True, attn_backend='triton')
    layer = LinearAttention(64, num_heads=2, feature_map='focused', attn_backend='triton')
    with pytest.raises(ValueError, match="feature map 'focused' is not computed inside the kernels"):
        layer(torch.randn(1, 5, 64, requires_grad=True))


def test_a_model_forced_onto_the_kernels_exports_through_the_pytorch_path(tmp_path):
    """Exporters see the aten graph of the PyTorch path, whatever attn_backend says; onnxruntime agrees with eager."""
    from linvit.export import export_onnx

    torch.manual_seed(4)
    # one block: what is checked is where each attention layer sends the export, not how blocks chain
    model = timm.create_model('linvit_tiny_patch16_224', img_size=64, depth=1, num_classes=3, attn_backend='triton',
                              dynamic_img_size=True).eval()
    report = export_onnx(model, tmp_path / 'kernel_model.onnx', img_size=64)
    assert report.checks and all(check.max_rel < 1e-4 for check in report.checks)
