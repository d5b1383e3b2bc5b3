"""tools/export_onnx.py and tools/predict.py (over linvit.export and linvit.predict) on tiny trained runs
(classification and segmentation): the export from a run directory, the parity table and the opt-in latency table,
predictions from PyTorch and from ONNX against the model run directly, masks at the input's size, a corrupt file
named and skipped, the precision flag."""
import csv
import hashlib

import albumentations as A
import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import load_file
from tiny_run import TINY_MODEL, TINY_RUN

from linvit.engine import load_config, train
from linvit.engine.tasks.segmentation import create_segmentation_model
from linvit.export import read_metadata

pytestmark = [pytest.mark.compiler, pytest.mark.integration]  # integration: trains or starts interpreters


@pytest.fixture(scope='module')
def cls_run(tmp_path_factory, shared_run):
    """A tiny classification run trained for one epoch (tiny_run's SHARED_RUNS['cls']), a copy for this module."""
    return shared_run('cls', tmp_path_factory.mktemp('cls') / 'run')


def _write_images(folder, sizes, seed=0):
    """Random RGB PNGs of the given (height, width) sizes, one in a subfolder; returns their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    for i, (height, width) in enumerate(sizes):
        path = folder / ('nested' if i == 0 else '') / f'img{i}.png'
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def _run_config(run_dir):
    return OmegaConf.load(run_dir / 'config.yaml')


def _normalise(image: np.ndarray, model_name: str) -> torch.Tensor:
    cfg = timm.models.get_pretrained_cfg(model_name)
    x = torch.from_numpy(np.array(image)).float().permute(2, 0, 1) / 255
    return ((x - torch.tensor(cfg.mean).view(3, 1, 1)) / torch.tensor(cfg.std).view(3, 1, 1)).unsqueeze(0)


def _classifier_from_run(run_dir):
    """The run's classifier rebuilt by hand from its config and model.safetensors (not through linvit.engine)."""
    cfg = _run_config(run_dir)
    kwargs = dict(OmegaConf.to_container(cfg.model.kwargs))
    weights = load_file(run_dir / 'model.safetensors')
    model = timm.create_model(cfg.model.name, img_size=cfg.data.img_size,
                              num_classes=weights['head.weight'].shape[0], **kwargs)
    model.load_state_dict(weights)
    return model.eval(), cfg


def _expected_probabilities(run_dir, path):
    model, cfg = _classifier_from_run(run_dir)
    image = np.asarray(Image.open(path).convert('RGB'))
    resized = A.Resize(cfg.data.img_size, cfg.data.img_size)(image=image)['image']
    with torch.no_grad():
        return model(_normalise(resized, cfg.model.name)).softmax(-1)[0]


def _read_predictions(out):
    with open(out / 'predictions.csv', newline='') as f:
        return list(csv.DictReader(f))


def test_classifier_predictions_match_the_model_and_a_corrupt_file_is_named(predict_tool, cls_run, tmp_path,
                                                                             capsys):
    images = _write_images(tmp_path / 'in', [(40, 50), (32, 32), (100, 64)])
    (tmp_path / 'in' / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\n not really a png')
    out = tmp_path / 'out'
    status = predict_tool.main([str(cls_run), str(tmp_path / 'in'), '--out', str(out), '--top-k', '2'])
    assert status == 1
    err = capsys.readouterr().err
    assert 'broken.png' in err and 'skipped' in err
    rows = _read_predictions(out)
    assert sorted({row['file'] for row in rows}) == sorted(str(p) for p in images)
    names = read_class_names(cls_run)
    for path in images:
        expected = _expected_probabilities(cls_run, path)
        mine = [row for row in rows if row['file'] == str(path)]
        assert [int(r['rank']) for r in mine] == [1, 2]
        top = expected.topk(2)
        assert [int(r['class_index']) for r in mine] == top.indices.tolist()
        assert [r['class_name'] for r in mine] == [names[i] for i in top.indices.tolist()]
        assert [float(r['probability']) for r in mine] == pytest.approx(top.values.tolist(), abs=1e-5)


def read_class_names(run_dir):
    return [str(n) for n in torch.load(run_dir / 'last.pt', weights_only=True)['class_names']]


def test_export_of_a_trained_classifier_and_onnx_predictions(export_tool, predict_tool, cls_run, tmp_path, capsys):
    onnx_path = tmp_path / 'cls.onnx'
    status = export_tool.main([str(cls_run), '--out', str(onnx_path), '--check-sizes', '32,24x40', '--latency',
                               '--repeats', '1', '--warmup', '1'])
    captured = capsys.readouterr()
    out = captured.out
    assert status == 0, out + captured.err
    assert out.count(' ok') == 2 and '24x40' in out
    assert 'onnxruntime ms' in out and 'eager/ort' in out
    meta = read_metadata(onnx_path)
    assert meta['class_names'] == read_class_names(cls_run) and meta['task'] == 'classification'
    weights = cls_run / 'model.safetensors'   # a run folder's export is tied to its weights file (test_stale_onnx_cli)
    assert meta['weights'] == str(weights.resolve())
    assert meta['weights_sha256'] == hashlib.sha256(weights.read_bytes()).hexdigest()
    images = _write_images(tmp_path / 'in', [(45, 61)], seed=3)
    status = predict_tool.main([str(onnx_path), str(images[0]), '--out', str(tmp_path / 'pred'), '--top-k', '3'])
    assert status == 0
    rows = _read_predictions(tmp_path / 'pred')
    expected = _expected_probabilities(cls_run, images[0]).topk(3)
    assert [int(r['class_index']) for r in rows] == expected.indices.tolist()
    assert [float(r['probability']) for r in rows] == pytest.approx(expected.values.tolist(), abs=1e-4)


def _segmenter_from_run(run_dir):
    cfg = _run_config(run_dir)
    weights = load_file(run_dir / 'model.safetensors')
    model = create_segmentation_model(cfg.model, cfg.seg, weights['head.classifier.weight'].shape[0],
                                      cfg.data.img_size)
    model.load_state_dict(weights)
    return model.eval(), cfg


def _expected_mask(run_dir, path):
    """Whole-image argmax: the normalised image zero-padded to the patch multiple, the padding cropped off."""
    model, cfg = _segmenter_from_run(run_dir)
    image = np.asarray(Image.open(path).convert('RGB'))
    x = _normalise(image, cfg.model.name)
    height, width = x.shape[-2:]
    padded = F.pad(x, (0, -width % 8, 0, -height % 8))
    with torch.no_grad():
        return model(padded)[0, :, :height, :width].argmax(0).numpy()


def test_segmentation_masks_and_overlays_at_the_input_size(predict_tool, seg_run, tmp_path):
    images = _write_images(tmp_path / 'in', [(37, 50), (64, 40)], seed=5)
    out = tmp_path / 'out'
    assert predict_tool.main([str(seg_run), str(tmp_path / 'in'), '--out', str(out)]) == 0
    for path, name in zip(images, ['nested/img0', 'img1']):
        mask = np.asarray(Image.open(out / f'{name}_mask.png'))
        overlay = Image.open(out / f'{name}_overlay.png')
        assert mask.shape == np.asarray(Image.open(path)).shape[:2] and mask.dtype == np.uint8
        assert overlay.size == Image.open(path).size and overlay.mode == 'RGB'
        np.testing.assert_array_equal(mask, _expected_mask(seg_run, path))


def test_onnx_segmentation_slides_like_pytorch(export_tool, predict_tool, seg_run, tmp_path):
    onnx_path = tmp_path / 'seg.onnx'
    assert export_tool.main([str(seg_run), '--out', str(onnx_path), '--no-latency']) == 0
    assert read_metadata(onnx_path)['task'] == 'segmentation'
    images = _write_images(tmp_path / 'in', [(70, 90)], seed=9)
    window = ['--mode', 'slide', '--window', '32', '--stride', '16']
    assert predict_tool.main([str(seg_run), str(images[0]), '--out', str(tmp_path / 'torch'), *window]) == 0
    assert predict_tool.main([str(onnx_path), str(images[0]), '--out', str(tmp_path / 'onnx'), *window]) == 0
    by_torch = np.asarray(Image.open(tmp_path / 'torch' / 'img0_mask.png'))
    by_onnx = np.asarray(Image.open(tmp_path / 'onnx' / 'img0_mask.png'))
    assert by_onnx.shape == (70, 90)
    assert (by_torch == by_onnx).mean() >= 0.999


def test_export_tool_from_a_model_spec_times_latency_only_when_asked_and_its_errors(export_tool, tmp_path, capsys,
                                                                                    monkeypatch):
    """A model spec exports (static batch, dynamic height); the latency table compiles a graph per check size
    (about a minute for a tiny model): --latency asks for it. One export checks both."""
    def no_timing(*args, **kwargs):
        raise AssertionError('measure_latency was called without --latency')

    monkeypatch.setattr(export_tool, 'measure_latency', no_timing)
    path = tmp_path / 'tiny.onnx'
    status = export_tool.main(['linvit_tiny_patch16_224:depth=1,patch_size=8,num_classes=4', '--img-size', '32',
                               '--check-sizes', '32', '--out', str(path), '--no-dynamic-batch'])
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    assert path.is_file() and 'latency per image' not in captured.out  # format_latency's title
    assert read_metadata(path)['model_name'] == 'linvit_tiny_patch16_224'
    import onnxruntime
    declared = onnxruntime.InferenceSession(str(path), providers=['CPUExecutionProvider']).get_inputs()[0].shape
    assert declared[0] == 1 and isinstance(declared[2], str)  # static batch, dynamic height
    assert export_tool.parse_args(['m']).latency is False
    assert export_tool.parse_args(['m', '--latency']).latency is True
    assert export_tool.parse_args(['m', '--no-latency']).latency is False  # the old spelling still parses

    assert export_tool.main(['no_such_model_xyz', '--out', str(tmp_path / 'x.onnx')]) == 2
    assert 'no_such_model_xyz' in capsys.readouterr().err
    assert export_tool.main([str(tmp_path / 'missing_run'), '--out', str(tmp_path / 'y.onnx')]) == 2


def test_predict_without_images_or_model_fails_with_a_reason(predict_tool, cls_run, tmp_path, capsys):
    (tmp_path / 'empty').mkdir()
    assert predict_tool.main([str(cls_run), str(tmp_path / 'empty')]) == 2
    assert 'no images found' in capsys.readouterr().err
    _write_images(tmp_path / 'in', [(32, 32)])
    assert predict_tool.main([str(tmp_path / 'nothing.onnx'), str(tmp_path / 'in')]) == 2
    assert 'nothing.onnx' in capsys.readouterr().err


def test_predict_refuses_an_autoregressive_run(predict_tool, tmp_path, capsys):
    out = tmp_path / 'ar'
    train(load_config(None, [*TINY_MODEL, *TINY_RUN, 'task=autoregressive', 'data.aug.hflip=0',
                             'train.max_steps=1', f'output_dir={out}']))
    _write_images(tmp_path / 'in', [(32, 32)])
    assert predict_tool.main([str(out), str(tmp_path / 'in')]) == 2
    assert ("task='autoregressive' run; predict.py takes classification, detection, segmentation and depth runs"
            in capsys.readouterr().err)


def test_export_precision_flags(export_tool):
    assert export_tool.parse_args(['m']).dtype == 'float32'
    assert export_tool.parse_args(['m', '--dtype', 'float16']).dtype == 'float16'
    for removed in (['--fp16'], ['--dtype', 'fp16']):  # the short words of earlier drafts are usage errors
        with pytest.raises(SystemExit):
            export_tool.parse_args(['m', *removed])
    with pytest.raises(SystemExit):  # a precision, but not one an ONNX file is exported in
        export_tool.parse_args(['m', '--dtype', 'bfloat16'])
