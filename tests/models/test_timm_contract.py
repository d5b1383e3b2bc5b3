"""timm's own fx and TorchScript model tests, run on every ``linvit_*`` model as an upstream pull request adding the
family would see them.

The four tests below reproduce ``tests/test_models.py`` of huggingface/pytorch-image-models (the version that ships
with timm 1.0.x: ``test_model_forward_torchscript``, ``test_model_forward_fx``, ``test_model_backward_fx``,
``test_model_forward_fx_torchscript``): the same model construction (``set_scriptable``, ``num_classes=42``,
train / eval mode), filters, tracer settings (timm's notrace modules and functions, ``param_shapes_constant``),
feature-extractor construction with train and eval return nodes, grad modes (``inference_mode`` where timm uses it),
batch sizes and assertions, copied unchanged. Two changes, so that the module runs in a minute on two cores: the
images are 64 px (``TEST_SIZE``; fixed-size models are built for it), where timm's targets are 128 px and its
fixed-size models run at 224 px, and the models have 2 of their 12 blocks (``TEST_DEPTH``: the blocks are alike; all
12 cost 30 s of the suite more). On top of timm's assertions each test compares with an independent reference:
the eager model on the same input (outputs, and for the backward test every parameter's gradient).

After them, the same four paths for every attention kind linvit offers and a softmax hybrid, on a small model with
the zero-initialised tensors (local mixing) given random values, so that every branch reaches the compared output.
"""
import copy
from typing import Callable, Iterator

import pytest
import timm
import torch
import torch.nn as nn
from timm import create_model, get_pretrained_cfg_value, list_models, set_scriptable
from timm.models import get_notrace_functions, get_notrace_modules
from torchvision.models.feature_extraction import NodePathTracer, create_feature_extractor, get_graph_node_names

import linvit

pytestmark = pytest.mark.compiler

# ---------------------------------------------------------------- timm's settings (tests/test_models.py)

# filters outside GitHub Actions; none of them matches a linvit model, they are kept so the selection is timm's
EXCLUDE_FILTERS = ['*enormous*', '*_7b_*']
EXCLUDE_JIT_FILTERS = [
    'hiera_*', '*naflex*', '*_7b_*', 'hrnet*', 'dpn*', 'densenet*', 'selecsls*',
    'gemma4_vit*',
]
EXCLUDE_FX_FILTERS = ['vit_gi*', 'hiera*', 'gemma4_vit*']
EXCLUDE_FX_JIT_FILTERS = [
    'deit_*_distilled_patch16_224',
    'levit*',
    'pit_*_distilled_224',
] + EXCLUDE_FX_FILTERS

TARGET_JIT_SIZE = 128
MAX_JIT_SIZE = 320
TARGET_FWD_FX_SIZE = 128
MAX_FWD_FX_SIZE = 256
TARGET_BWD_FX_SIZE = 128
MAX_BWD_FX_SIZE = 224

FAMILY = 'linvit_*'
#: the image size of these tests: timm's targets above are 128 px (and it runs fixed-size models at their own size)
TEST_SIZE = 64
#: the blocks of the models these tests build (timm builds all 12)
TEST_DEPTH = 2


def _models(exclude_filters, name_matches_cfg=False):
    return list_models(FAMILY, exclude_filters=exclude_filters, name_matches_cfg=name_matches_cfg)


JIT_MODELS = _models(EXCLUDE_FILTERS + EXCLUDE_JIT_FILTERS, name_matches_cfg=True)
FX_MODELS = _models(EXCLUDE_FILTERS + EXCLUDE_FX_FILTERS)
FX_BWD_MODELS = _models(EXCLUDE_FILTERS + EXCLUDE_FX_FILTERS, name_matches_cfg=True)
FX_JIT_MODELS = _models(EXCLUDE_FILTERS + EXCLUDE_JIT_FILTERS + EXCLUDE_FX_JIT_FILTERS, name_matches_cfg=True)


@pytest.fixture(scope='module', autouse=True)
def timm_jit_executor() -> Iterator[None]:
    """timm's test module switches TorchScript to the profiling executor without profiling ("legacy executor is too
    slow to compile large models for unit tests") at import; here for this module only, restored afterwards."""
    executor = torch._C._jit_set_profiling_executor(True)
    mode = torch._C._jit_set_profiling_mode(False)
    yield
    torch._C._jit_set_profiling_executor(executor)
    torch._C._jit_set_profiling_mode(mode)


def _get_input_size(model=None, model_name='', target=None):
    """timm's, unchanged."""
    if model is None:
        assert model_name, "One of model or model_name must be provided"
        input_size = get_pretrained_cfg_value(model_name, 'input_size')
        fixed_input_size = get_pretrained_cfg_value(model_name, 'fixed_input_size')
        min_input_size = get_pretrained_cfg_value(model_name, 'min_input_size')
    else:
        default_cfg = model.default_cfg
        input_size = default_cfg['input_size']
        fixed_input_size = default_cfg.get('fixed_input_size', None)
        min_input_size = default_cfg.get('min_input_size', None)
    assert input_size is not None

    if fixed_input_size:
        return input_size

    if min_input_size:
        if target and max(input_size) > target:
            input_size = min_input_size
    else:
        if target and max(input_size) > target:
            input_size = tuple([min(x, target) for x in input_size])
    return input_size


def _small_input_size(model_name, target):
    """timm's input size for the test (``_get_input_size``) at TEST_SIZE: fixed-size models are built for it
    (``img_size``), where timm would run them at their own 224 px; every model with TEST_DEPTH blocks. The same code
    on fewer tokens and blocks. Returns (input_size, create_model kwargs)."""
    input_size = _get_input_size(model_name=model_name, target=min(target, TEST_SIZE))
    if get_pretrained_cfg_value(model_name, 'fixed_input_size') and max(input_size) > TEST_SIZE:
        input_size = tuple([input_size[0]] + [min(x, TEST_SIZE) for x in input_size[1:]])
        return input_size, dict(img_size=input_size[1:], depth=TEST_DEPTH)
    return input_size, dict(depth=TEST_DEPTH)


def _create_fx_model(model, train=False):
    """timm's, unchanged: torchvision's feature extractor with timm's tracer settings; in train mode the return
    nodes are those feeding the graph's output."""
    tracer_kwargs = dict(
        leaf_modules=get_notrace_modules(),
        autowrap_functions=get_notrace_functions(),
        param_shapes_constant=True
    )
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)

    eval_return_nodes = [eval_nodes[-1]]
    train_return_nodes = [train_nodes[-1]]
    if train:
        tracer = NodePathTracer(**tracer_kwargs)
        graph = tracer.trace(model)
        graph_nodes = list(reversed(graph.nodes))
        output_node_names = [n.name for n in graph_nodes[0]._input_nodes.keys()]
        graph_node_names = [n.name for n in graph_nodes]
        output_node_indices = [-graph_node_names.index(node_name) for node_name in output_node_names]
        train_return_nodes = [train_nodes[ix] for ix in output_node_indices]

    fx_model = create_feature_extractor(
        model,
        train_return_nodes=train_return_nodes,
        eval_return_nodes=eval_return_nodes,
        tracer_kwargs=tracer_kwargs,
    )
    return fx_model


def _eager(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs)


def _assert_close_to_eager(outputs: torch.Tensor, expected: torch.Tensor) -> None:
    """Scripted code runs the attention core without the fused Function and in-place maps of eager inference: the
    same float32 function, summed in another order."""
    torch.testing.assert_close(outputs, expected, rtol=1e-4, atol=1e-5)


def _assert_grads_match(traced: nn.Module, eager: nn.Module) -> None:
    grads = {n: p.grad for n, p in eager.named_parameters()}
    for n, p in traced.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


# ---------------------------------------------------------------- timm's tests, on every linvit_* model

def test_the_family_is_selected():
    """timm's filters keep every linvit model in every test (they exclude other families only)."""
    assert JIT_MODELS == FX_MODELS == FX_BWD_MODELS == FX_JIT_MODELS == timm.list_models(FAMILY)
    assert len(FX_MODELS) == 5
    assert len(_models(['linvit_small*'])) == 3  # the helper applies exclusions


@pytest.mark.parametrize('model_name', JIT_MODELS)
@pytest.mark.parametrize('batch_size', [1])
def test_model_forward_torchscript(model_name, batch_size):
    """Run a single forward pass with each model"""
    input_size, small = _small_input_size(model_name, TARGET_JIT_SIZE)
    if max(input_size) > MAX_JIT_SIZE:
        pytest.skip("Fixed input size model > limit.")

    with set_scriptable(True):
        model = create_model(model_name, pretrained=False, **small)
    model.eval()
    eager = model

    model = torch.jit.script(model)
    inputs = torch.randn((batch_size, *input_size))
    outputs = model(inputs)

    assert outputs.shape[0] == batch_size
    assert not torch.isnan(outputs).any(), 'Output included NaNs'
    _assert_close_to_eager(outputs, _eager(eager, inputs))


@pytest.mark.parametrize('model_name', FX_MODELS)
@pytest.mark.parametrize('batch_size', [1])
def test_model_forward_fx(model_name, batch_size):
    """
    Symbolically trace each model and run single forward pass through the resulting GraphModule
    Also check that the output of a forward pass through the GraphModule is the same as that from the original Module
    """
    input_size, small = _small_input_size(model_name, TARGET_FWD_FX_SIZE)
    model = create_model(model_name, pretrained=False, **small)
    model.eval()

    if max(input_size) > MAX_FWD_FX_SIZE:
        pytest.skip("Fixed input size model > limit.")
    with torch.inference_mode():
        inputs = torch.randn((batch_size, *input_size))
        outputs = model(inputs)
        if isinstance(outputs, tuple):
            outputs = torch.cat(outputs)

        model = _create_fx_model(model)
        fx_outputs = tuple(model(inputs).values())
        if isinstance(fx_outputs, tuple):
            fx_outputs = torch.cat(fx_outputs)

    assert torch.all(fx_outputs == outputs)
    assert outputs.shape[0] == batch_size
    assert not torch.isnan(outputs).any(), 'Output included NaNs'


@pytest.mark.parametrize('model_name', FX_BWD_MODELS)
@pytest.mark.parametrize('batch_size', [2])
def test_model_backward_fx(model_name, batch_size):
    """Symbolically trace each model and run single backward pass through the resulting GraphModule"""
    input_size, small = _small_input_size(model_name, TARGET_BWD_FX_SIZE)
    if max(input_size) > MAX_BWD_FX_SIZE:
        pytest.skip("Fixed input size model > limit.")

    model = create_model(model_name, pretrained=False, num_classes=42, **small)
    model.train()
    num_params = sum([x.numel() for x in model.parameters()])
    eager = copy.deepcopy(model)

    model = _create_fx_model(model, train=True)
    inputs = torch.randn((batch_size, *input_size))
    outputs = tuple(model(inputs).values())
    if isinstance(outputs, tuple):
        outputs = torch.cat(outputs)
    outputs.mean().backward()
    for n, x in model.named_parameters():
        assert x.grad is not None, f'No gradient for {n}'
    num_grad = sum([x.grad.numel() for x in model.parameters() if x.grad is not None])

    assert outputs.shape[-1] == 42
    assert num_params == num_grad, 'Some parameters are missing gradients'
    assert not torch.isnan(outputs).any(), 'Output included NaNs'

    expected = eager(inputs)
    expected.mean().backward()
    torch.testing.assert_close(outputs, expected)
    _assert_grads_match(model, eager)


@pytest.mark.parametrize('model_name', FX_JIT_MODELS)
@pytest.mark.parametrize('batch_size', [1])
def test_model_forward_fx_torchscript(model_name, batch_size):
    """Symbolically trace each model, script it, and run single forward pass"""
    input_size, small = _small_input_size(model_name, TARGET_JIT_SIZE)
    if max(input_size) > MAX_JIT_SIZE:
        pytest.skip("Fixed input size model > limit.")

    with set_scriptable(True):
        model = create_model(model_name, pretrained=False, **small)
    model.eval()
    eager = model

    model = torch.jit.script(_create_fx_model(model))
    inputs = torch.randn((batch_size, *input_size))
    with torch.inference_mode():
        outputs = tuple(model(inputs).values())
        if isinstance(outputs, tuple):
            outputs = torch.cat(outputs)

    assert outputs.shape[0] == batch_size
    assert not torch.isnan(outputs).any(), 'Output included NaNs'
    _assert_close_to_eager(outputs, _eager(eager, inputs))


# ---------------------------------------------------------------- the same paths for every kind of attention

SMALL = 'linvit_small_patch16_512'  # dynamic_img_size: a small non-square input keeps these fast
SMALL_SIZE = (3, 48, 80)
#: every kind of attention: plain linear attention with each feature map, and every other attention family
ATTENTION_VARIANTS = [*linvit.list_feature_maps(),
                      *[name for name in linvit.list_attention_families() if name != 'linear']]
VARIANTS = {
    **{name: dict(feature_map=name) for name in linvit.list_feature_maps()},
    **{name: dict(attn_family=name) for name in linvit.list_attention_families() if name != 'linear'},
    # RetNet decays and the data-dependent gate: every argument of the bidirectional op
    'bidirectional': dict(attn_family='bidirectional', attn_options={'data_gate': True}),
    'hybrid-registers-qknorm': dict(softmax_blocks=(1,), reg_tokens=2, qk_norm=True),
}


def _variant(options: dict, **kwargs) -> nn.Module:
    """A 2-block model of the variant with random values in the zero-initialised tensors (local mixing)."""
    torch.manual_seed(0)
    with set_scriptable(True):
        model = create_model(SMALL, depth=2, **options, **kwargs)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def _images(batch: int) -> torch.Tensor:
    return torch.randn((batch, *SMALL_SIZE), generator=torch.Generator().manual_seed(2))


def test_every_attention_kind_has_a_variant():
    assert set(ATTENTION_VARIANTS) <= set(VARIANTS)


def _outputs(graph: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.cat(tuple(graph(x).values()))


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_every_attention_kind_scripts_and_traces(variant):
    """TorchScript, fx and fx + TorchScript (timm's constructions) of the eval model against its eager output."""
    model = _variant(VARIANTS[variant]).eval()
    x = _images(2)
    expected = _eager(model, x)
    with torch.no_grad():
        _assert_close_to_eager(torch.jit.script(model)(x), expected)
    with torch.inference_mode():
        assert torch.equal(_outputs(_create_fx_model(model))(x), model(x))
    scripted_graph = torch.jit.script(_create_fx_model(model))
    with torch.inference_mode():
        _assert_close_to_eager(_outputs(scripted_graph)(x), expected)


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_every_attention_kind_trains_through_fx(variant):
    """timm's fx backward: outputs and every parameter's gradient equal the eager model's."""
    model = _variant(VARIANTS[variant], num_classes=42).train()
    eager = copy.deepcopy(model)
    traced = _create_fx_model(model, train=True)
    x = _images(2)
    outputs = _outputs(traced)(x)
    outputs.mean().backward()
    expected = eager(x)
    expected.mean().backward()
    torch.testing.assert_close(outputs, expected)
    assert all(p.grad is not None for p in traced.parameters())
    _assert_grads_match(traced, eager)


def test_scripted_bidirectional_attention_trains():
    """TorchScript runs bidirectional attention through the registered op; its backward (recomputing the forward)
    gives the eager model's gradients."""
    model = _variant(VARIANTS['bidirectional'], num_classes=42).train()
    eager = copy.deepcopy(model)
    scripted = torch.jit.script(model)
    x = _images(2)
    scripted(x).square().mean().backward()
    eager(x).square().mean().backward()
    _assert_grads_match(model, eager)

