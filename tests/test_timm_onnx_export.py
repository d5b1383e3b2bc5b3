"""timm's ONNX export script on linvit models: ``onnx_export.py`` of huggingface/pytorch-image-models, which builds
the model with ``timm.create_model(..., exportable=True)`` and calls ``timm.utils.onnx.onnx_export`` with its
defaults (opset None: the exporter's own; dynamic batch axis 'batch', fixed height and width; initializers not kept
as inputs; eval mode; ``check_forward``: timm's own onnx.checker full check and a comparison of onnxruntime with the
PyTorch output to 3 decimals), through the TorchScript exporter (the default, ``dynamo=False``) and the dynamo one
(``--dynamo``), once as the script calls it (autograd on) and once under ``torch.no_grad()``.

Each file is then run as ``onnx_validate.py`` runs it (an onnxruntime session with all graph optimisations) at batch
1 and 3 (the dynamic batch) on new images and compared with the eager float32 model (rtol 1e-3, atol 1e-5). The
zero-initialised tensors (local mixing) get random values first, so every branch reaches the compared logits. The
models are built for 64 px images with 2 of their 12 blocks to keep the exports fast (the dynamo exporter took
25 s per file for all 12); the default 224 px export of the whole model is the same graph with more tokens and
more of the same blocks. Last, every attention kind through the default (TorchScript) exporter, in one small model
with a block of each kind.
"""
import contextlib

import onnx
import onnxruntime as ort
import pytest
import timm
import torch
import torch.nn as nn
from timm.utils.onnx import onnx_export

import linvit
from linvit.models.linvit import DEFAULT_FEATURE_MAP

pytestmark = pytest.mark.compiler

IMG_SIZE = 64
DEPTH = 2
MODELS = ['linvit_tiny_patch16_224', 'linvit_small_patch16_512']  # a fixed-size and a dynamic-size model


def _create(name: str) -> nn.Module:
    """onnx_export.py's model: create_model(name, num_classes=1000, in_chans=3, exportable=True), pretrained=False
    (linvit publishes no weights: the script's --checkpoint path), here for IMG_SIZE images and with DEPTH blocks."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=1000, in_chans=3, pretrained=False, exportable=True,
                              img_size=IMG_SIZE, depth=DEPTH)
    return _wake(model)


def _wake(model: nn.Module) -> nn.Module:
    """Random values in the zero-initialised tensors."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def _export(model: nn.Module, path, dynamo: bool) -> None:
    """onnx_export.py's call with its argument defaults (and --check-forward, --dynamo as given)."""
    onnx_export(
        model,
        str(path),
        opset=None,
        dynamic_size=False,
        aten_fallback=False,
        keep_initializers=False,
        check_forward=True,
        training=False,
        verbose=False,
        input_size=(3, IMG_SIZE, IMG_SIZE),
        batch_size=1,
        use_dynamo=dynamo,
    )


def _session(path) -> ort.InferenceSession:
    """onnx_validate.py's session."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=['CPUExecutionProvider'])


def _check_against_eager(model: nn.Module, path) -> None:
    session = _session(path)
    (graph_input,) = session.get_inputs()
    assert graph_input.name == 'input0' and session.get_outputs()[0].name == 'output0'
    assert isinstance(graph_input.shape[0], str) and graph_input.shape[1:] == [3, IMG_SIZE, IMG_SIZE]
    for batch in (1, 3):
        images = torch.randn(batch, 3, IMG_SIZE, IMG_SIZE, generator=torch.Generator().manual_seed(10 + batch))
        with torch.no_grad():
            expected = model(images)
        got = torch.from_numpy(session.run(None, {graph_input.name: images.numpy()})[0])
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5, msg=lambda m, b=batch: f"batch {b}: {m}")


# both exporters in both grad modes for the fixed-size model; the dynamic-size one as the script calls the exporters
CASES = [(MODELS[0], exporter, grad) for exporter in ('torchscript', 'dynamo') for grad in ('autograd', 'no_grad')]
CASES += [(MODELS[1], exporter, 'autograd') for exporter in ('torchscript', 'dynamo')]


@pytest.mark.parametrize('name, exporter, grad', CASES)
def test_timm_onnx_export_matches_the_model_in_onnxruntime(name, exporter, grad, tmp_path):
    model = _create(name)
    path = tmp_path / f'{name}.onnx'
    with torch.no_grad() if grad == 'no_grad' else contextlib.nullcontext():
        _export(model, path, dynamo=exporter == 'dynamo')
    assert not model.training  # onnx_export exports in eval mode
    onnx.checker.check_model(str(path), full_check=True)
    _check_against_eager(model, path)


#: every kind of attention: plain linear attention with each feature map and each normaliser, and every other
#: attention family
ATTENTION_VARIANTS = {
    **{name: dict(feature_map=name) for name in linvit.list_feature_maps()},
    **{name: dict(normalizer=name) for name in linvit.ops.list_normalizers() if name != 'divide'},
    **{name: dict(attn_family=name) for name in linvit.list_attention_families() if name != 'linear'},
}


def _every_kind_model() -> nn.Module:
    """A dynamic-size model (MODELS[1], IMG_SIZE) whose blocks are one of each ATTENTION_VARIANTS kind, in order, each
    the block of a model onnx_export.py's create_model call builds for that kind."""
    kinds = list(ATTENTION_VARIANTS)

    def create(kind: str, depth: int) -> nn.Module:
        return timm.create_model(MODELS[1], num_classes=1000, in_chans=3, pretrained=False, exportable=True,
                                 img_size=IMG_SIZE, depth=depth, **ATTENTION_VARIANTS[kind])

    torch.manual_seed(0)
    model = create(kinds[0], len(kinds))
    for index, kind in enumerate(kinds[1:], start=1):
        model.blocks[index] = create(kind, 1).blocks[0]
    return _wake(model)


def test_every_attention_kind_exports_through_the_torchscript_exporter(tmp_path):
    """Every attention kind through onnx_export.py's default exporter, in one dynamic-size model with a block of each
    kind: one export and one check instead of one per kind (each export's fixed part dominated them)."""
    model = _every_kind_model()
    # the map where the options name one, the models' default for plain linear attention with another normaliser
    assert [(block.attn.family.name, block.attn.normalizer) for block in model.blocks] == [
        (options.get('attn_family', 'linear'), options.get('normalizer', 'divide'))
        for options in ATTENTION_VARIANTS.values()]
    plain = [(block, options) for block, options in zip(model.blocks, ATTENTION_VARIANTS.values())
             if 'attn_family' not in options]
    assert [block.attn.feature_map_name for block, options in plain] == [
        options.get('feature_map', DEFAULT_FEATURE_MAP) for block, options in plain]
    path = tmp_path / 'every_kind.onnx'
    _export(model, path, dynamo=False)
    _check_against_eager(model, path)
