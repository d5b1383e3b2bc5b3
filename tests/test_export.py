"""linvit.export: every registered model, converted and hybrid ViTs and the segmentation model exported to ONNX with
dynamic height and width, run in onnxruntime (a plain session, not the exporter's own check) against the float32
PyTorch model at three sizes, and at sizes the patch does not divide (217x248 at patch 16) against the model on the
images zero-padded by hand at the bottom and right (what tools/predict.py does), per-pixel logits cropped back;
fp16; metadata; errors that name the module; nothing written when a check fails."""
import json

import onnx
import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import linvit
from linvit.export import ExportCheckError, ExportError, default_check_sizes, export_onnx, input_multiple, read_metadata
from linvit.models.segmentation import SegmentationModel

ort = pytest.importorskip('onnxruntime')

pytestmark = pytest.mark.compiler


def _wake_zero_init(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give zero-initialised parameters (local-mix convolutions, layer-scale-free biases) random values, so every
    path of the model contributes to the output that is compared."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model.eval()


def _run_onnx(path, images: torch.Tensor) -> torch.Tensor:
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    name = session.get_inputs()[0].name
    return torch.from_numpy(session.run(None, {name: images.numpy()})[0])


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def _padded_reference(model: nn.Module, images: torch.Tensor, patch: int) -> torch.Tensor:
    """model on images [B, 3, H, W] zero-padded at the bottom/right to multiples of ``patch``; per-pixel logits
    cropped back to H x W."""
    height, width = images.shape[-2:]
    with torch.no_grad():
        logits = model(F.pad(images, (0, -width % patch, 0, -height % patch)))
    return logits[..., :height, :width] if logits.ndim == 4 else logits


def _assert_matches_torch(model: nn.Module, path, sizes, batch: int = 2, rtol: float = 1e-4, patch: int = 16):
    for index, (height, width) in enumerate(sizes):
        images = torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(100 + index))
        expected = _padded_reference(model, images, patch)
        got = _run_onnx(path, images)
        assert got.shape == expected.shape, (height, width)
        error = _relative_error(got, expected)
        assert error <= rtol, f"{height}x{width}: max relative error {error:.2e}"


#: one registered model per architecture that the registered models build with the test's overrides (2 blocks, 64 px,
#: any size): linvit_tiny_patch16_224, linvit_small_patch16_224 and linvit_base_patch16_224 differ from the large-image
#: models of their width only in their default size and dynamic_img_size, which the overrides set
EXPORTED_MODELS = ['linvit_tiny_patch16_224', 'linvit_small_patch16_512', 'linvit_base_patch16_1024']


def _registered(name: str) -> nn.Module:
    return timm.create_model(name, depth=2, img_size=64, dynamic_img_size=True)


def test_every_registered_model_builds_one_of_the_exported_architectures():
    """Every registered name builds, with the export test's overrides, a model that prints exactly as one of
    EXPORTED_MODELS does (every layer, width, head count, option and the patch grid): the same graph, exported
    there."""
    exported = {repr(_registered(name)): name for name in EXPORTED_MODELS}
    assert len(exported) == len(EXPORTED_MODELS)  # no two of them alike: each export is needed
    for name in timm.list_models('linvit_*'):
        assert repr(_registered(name)) in exported, f"{name} builds a model no test exports: add it to EXPORTED_MODELS"


@pytest.mark.slow
@pytest.mark.parametrize('name', EXPORTED_MODELS)
def test_every_registered_model_exports_with_dynamic_size(name, tmp_path):
    """Each registered configuration (width, heads, patch, attention, position embedding; the names that build the
    same model: the test above) with 2 of its blocks: the blocks are alike, and exporting and checking all 12 of a
    ViT-B took 40 s of the suite for nothing more."""
    model = _wake_zero_init(_registered(name))
    path = tmp_path / f'{name}.onnx'
    report = export_onnx(model, path, img_size=64)
    assert report.ok and len(report.checks) == 3 and path.is_file()
    # sizes the exporter did not check, one of them non-square, and a third batch size
    _assert_matches_torch(model, path, [(64, 64), (48, 96), (112, 80)], batch=3)


def test_converted_timm_vit_and_hybrid_export(tmp_path):
    """Two blocks each: a converted ViT with a linear block before a softmax one, and a hybrid with the softmax block
    first, so that tokens pass from each kind of block to the other."""
    vit = timm.create_model('vit_small_patch16_224', depth=2, img_size=64, dynamic_img_size=True)
    linvit.convert_to_linear(vit, feature_map='relu', softmax_blocks=(1,))
    _wake_zero_init(vit)
    export_onnx(vit, tmp_path / 'converted.onnx', img_size=64)
    _assert_matches_torch(vit, tmp_path / 'converted.onnx', [(32, 80), (96, 64), (217, 248)])
    hybrid = _wake_zero_init(timm.create_model('linvit_tiny_patch16_224', depth=2, softmax_blocks=(0,),
                                               img_size=64, dynamic_img_size=True, feature_map='focused'))
    export_onnx(hybrid, tmp_path / 'hybrid.onnx', img_size=64)
    _assert_matches_torch(hybrid, tmp_path / 'hybrid.onnx', [(48, 32), (80, 112)])


def test_segmentation_model_outputs_logits_at_input_size(tmp_path):
    # 2 blocks: the pyramid's levels read blocks 0, 0, 1, 1 (forward_intermediates of two blocks, each level its own
    # neck branch)
    backbone = timm.create_model('linvit_tiny_patch16_224', depth=2, num_classes=0, img_size=64,
                                 dynamic_img_size=True)
    model = _wake_zero_init(SegmentationModel(backbone, num_classes=5, neck_dim=32, head_dim=32))
    path = tmp_path / 'seg.onnx'
    report = export_onnx(model, path, img_size=64)
    assert report.metadata['task'] == 'segmentation' and report.metadata['num_classes'] == 5
    assert report.metadata['pads_to_multiple'] is True and read_metadata(path)['pads_to_multiple'] is True
    assert [(c.height, c.width) for c in report.checks] == [(64, 64), (32, 48), (79, 65)]   # the last one padded
    for height, width in [(64, 64), (48, 112), (96, 32), (217, 248)]:
        out = _run_onnx(path, torch.randn(1, 3, height, width))
        assert out.shape == (1, 5, height, width)
    _assert_matches_torch(model, path, [(48, 112), (96, 32), (217, 248), (17, 33)])


@pytest.mark.slow
def test_fp16_export_at_4096_tokens_is_finite_and_near_fp32(tmp_path):
    model = _wake_zero_init(timm.create_model('linvit_small_patch16_224', depth=2, img_size=1024,
                                              dynamic_img_size=True))
    path = tmp_path / 'fp16.onnx'
    # one image per batch: the export's own forward and check run one image of 4096 tokens instead of two
    report = export_onnx(model, path, img_size=1024, dtype=torch.float16, check_sizes=[(1024, 1024)],
                         dynamic_batch=False)
    assert [(c.height, c.width, c.batch) for c in report.checks] == [(1024, 1024, 1)]
    assert report.dtype == 'float16'
    graph = onnx.load(str(path)).graph
    assert {init.data_type for init in graph.initializer if len(init.dims) == 2} == {onnx.TensorProto.FLOAT16}
    cast_targets = {attr.i for node in graph.node if node.op_type == 'Cast' for attr in node.attribute}
    assert onnx.TensorProto.FLOAT in cast_targets, "the attention core must run in float32 inside the fp16 graph"
    images = torch.randn(1, 3, 1024, 1024, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = model(images)
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    got = torch.from_numpy(session.run(None, {'images': images.half().numpy()})[0]).float()
    assert torch.isfinite(got).all()
    assert _relative_error(got, expected) <= 1e-2


def test_static_export_takes_its_size_and_batch_only_and_its_metadata_travels_with_the_file(tmp_path):
    """A file for one size and batch, and what every file says about itself (read back from the file; the
    dynamic-size files' ``pads_to_multiple``: the segmentation test). The tolerance given is the one each check
    applies (a check that fails it: test_a_file_that_differs_from_the_model_fails_the_check)."""
    model = timm.create_model('linvit_tiny_patch16_224', depth=1, img_size=32, patch_size=8, num_classes=3)
    path = tmp_path / 'static.onnx'
    report = export_onnx(model, path, img_size=32, dynamic_size=False, dynamic_batch=False, tolerance=2e-4,
                         metadata={'class_names': ['cat', 'dog', 'émeu']})
    assert [(c.height, c.width, c.batch, c.tolerance) for c in report.checks] == [(32, 32, 1, 2e-4)]
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    assert session.get_inputs()[0].shape == [1, 3, 32, 32]
    assert report.metadata['pads_to_multiple'] is False
    meta = read_metadata(path)
    assert meta['class_names'] == ['cat', 'dog', 'émeu']
    assert meta['task'] == 'classification' and meta['num_classes'] == 3
    assert meta['input_multiple'] == 8 and meta['img_size'] == [32, 32] and meta['dtype'] == 'float32'
    assert meta['pads_to_multiple'] is False and 'weights' not in meta   # a model, not a run's weights file
    assert meta['mean'] == list(model.pretrained_cfg['mean'])
    raw = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert json.loads(raw['linvit.class_names']) == ['cat', 'dog', 'émeu']


def test_a_model_that_takes_one_size_is_refused_for_dynamic_export(tmp_path):
    model = timm.create_model('linvit_tiny_patch16_224', depth=1)
    with pytest.raises(ValueError, match='dynamic_img_size=True'):
        export_onnx(model, tmp_path / 'x.onnx', img_size=224)
    assert not (tmp_path / 'x.onnx').exists()


class _BranchesOnValues(nn.Module):
    def forward(self, x):
        if x.mean() > 0:  # data-dependent control flow: torch.export cannot trace it
            return x * 2
        return x


def test_an_untraceable_module_is_named(tmp_path):
    model = timm.create_model('linvit_tiny_patch16_224', depth=2, img_size=32, patch_size=8, dynamic_img_size=True)
    model.blocks[1].ls1 = _BranchesOnValues()
    with pytest.raises(ExportError, match=r'blocks\.1\.ls1 \(_BranchesOnValues\)'):
        export_onnx(model, tmp_path / 'bad.onnx', img_size=32)
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_differs_from_the_model_fails_the_check(tmp_path, monkeypatch):
    """The check compares with the model as given: a graph traced from a slightly different model is caught. A
    failed check writes nothing and keeps the file that was there."""
    model = timm.create_model('linvit_tiny_patch16_224', depth=1, img_size=32, patch_size=8, dynamic_img_size=True)
    original_trace = linvit.export._trace

    def trace_a_perturbed_copy(exported, *args):
        with torch.no_grad():
            exported.head.bias.add_(1e-2)
        return original_trace(exported, *args)

    monkeypatch.setattr(linvit.export, '_trace', trace_a_perturbed_copy)
    path = tmp_path / 'model.onnx'
    path.write_bytes(b'the previous export')
    with pytest.raises(ExportCheckError, match='(?s)no file was written.*FAILED'):
        export_onnx(model, path, img_size=32)
    assert path.read_bytes() == b'the previous export'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['model.onnx']


def test_default_check_sizes_include_a_non_square_size_and_one_the_patch_does_not_divide():
    assert default_check_sizes((64, 64), 16, dynamic_size=True) == [(64, 64), (32, 48), (79, 65)]
    assert default_check_sizes((64, 96), 8, dynamic_size=True) == [(64, 96), (32, 72), (79, 97)]
    assert default_check_sizes((64, 64), 16, dynamic_size=False) == [(64, 64)]


def test_input_multiple_reads_the_patch_or_the_model():
    assert input_multiple(timm.create_model('linvit_tiny_patch16_224', depth=1, patch_size=8)) == 8
    backbone = timm.create_model('linvit_tiny_patch16_224', depth=1, num_classes=0, dynamic_img_size=True)
    assert input_multiple(SegmentationModel(backbone, num_classes=2, neck_dim=8, head_dim=8)) == 16


def test_bad_arguments_are_refused_with_the_reason(tmp_path):
    model = timm.create_model('linvit_tiny_patch16_224', depth=1, img_size=32, patch_size=8, dynamic_img_size=True)
    with pytest.raises(ValueError, match='not a multiple of the model.s patch size 8'):
        export_onnx(model, tmp_path / 'x.onnx', img_size=(32, 36))
    with pytest.raises(ValueError, match='dtype must be one of'):
        export_onnx(model, tmp_path / 'x.onnx', img_size=32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match='takes only 32x32'):
        export_onnx(model, tmp_path / 'x.onnx', img_size=32, dynamic_size=False, check_sizes=[(32, 48)])
    with pytest.raises(ValueError, match='check size 8x40 is too small: .* above 8 px'):
        export_onnx(model, tmp_path / 'x.onnx', img_size=32, check_sizes=[(8, 40)])
    assert list(tmp_path.iterdir()) == []
