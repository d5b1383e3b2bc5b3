"""tools/predict.py on a depth run (linvit.predict.depth_images) and on its ONNX file: the 16-bit PNG and the float32
TIFF against exp of the plain forward of the model rebuilt by hand, the bounded forward against the whole one at a
size the patch does not divide, a disparity run's file names and its data.depth_scale, a GeoTIFF's tags kept, the
previews' sizes, unreadable and half-readable images skipped without files, Ctrl-C, the ONNX file's metadata and
predictions, and the hub export's one-line refusal."""
import shutil

import numpy as np
import pytest
import tifffile
import timm
import torch
import torch.nn.functional as F
from cli import load_tool
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import load_file
from session_runs import built_once
from tiny_run import TINY_MODEL

import linvit.predict
from linvit.engine import load_config, train
from linvit.engine.hub import HubExportError, export_hub_folder
from linvit.engine.tasks.segmentation import create_segmentation_model
from linvit.export import read_metadata
from linvit.predict import PredictionInterrupted, collect_inputs, depth_images, load_predictor

pytestmark = pytest.mark.integration  # trains, exports

#: one step of a 2-block linvit at 32 px; the linear head exports to ONNX in a few seconds (dpt: twice as long)
TINY_DEPTH = [*TINY_MODEL, 'data.img_size=32', 'data.batch_size=4', 'data.num_workers=0',
              'data.synthetic.train_size=4', 'data.synthetic.val_size=2', 'seg.head=linear', 'seg.neck_dim=16',
              'seg.head_dim=16', 'train.max_steps=1', 'train.warmup_epochs=0', 'train.log_every=1',
              'train.pictures=false', 'device=cpu']
PATCH = 8
#: the PNGs' unit: data.depth_scale is null in the demo config, so the integer files' millimetres
MILLIMETRE = 1e-3
GEO_TAGS = [(33550, 12, 3, (0.5, 0.25, 0.0), True), (33922, 12, 6, (0, 0, 0, 500000.0, 4000000.0, 0), True)]


@pytest.fixture(scope='module')
def depth_run(tmp_path_factory, worker_id):
    def build(folder):
        train(load_config('configs/depth_demo.yaml', [*TINY_DEPTH, f'output_dir={folder / "run"}']))
    return built_once(tmp_path_factory, worker_id, 'predict_depth', build) / 'run'


@pytest.fixture(scope='module')
def predict_tool():
    return load_tool('predict')


@pytest.fixture(scope='module')
def images(tmp_path_factory):
    """a.png 37 x 45 and b.tif 41 x 53 (a GeoTIFF), sides the patch does not divide; random pixels."""
    folder = tmp_path_factory.mktemp('images')
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (37, 45, 3), dtype=np.uint8)).save(folder / 'a.png')
    tifffile.imwrite(folder / 'b.tif', rng.integers(0, 256, (41, 53, 3), dtype=np.uint8), photometric='rgb',
                     extratags=GEO_TAGS)
    return folder


def _reference(run, path) -> np.ndarray:
    """exp of the plain forward of the run's model rebuilt by hand from config.yaml and model.safetensors, on the
    image normalised with timm's statistics and zero-padded to the patch, the padding cropped off: float64 [H, W]."""
    cfg = load_config(str(run / 'config.yaml'), [])
    model = create_segmentation_model(cfg.model, cfg.seg, 1, cfg.data.img_size).eval()
    model.load_state_dict(load_file(str(run / 'model.safetensors')))
    pixels = tifffile.imread(path) if path.suffix == '.tif' else np.asarray(Image.open(path).convert('RGB'))
    stats = timm.models.get_pretrained_cfg(cfg.model.name)
    x = torch.from_numpy(pixels.copy()).float().permute(2, 0, 1) / 255
    x = ((x - torch.tensor(stats.mean).view(3, 1, 1)) / torch.tensor(stats.std).view(3, 1, 1))[None]
    height, width = pixels.shape[:2]
    with torch.no_grad():
        log_depth = model(F.pad(x, (0, -width % PATCH, 0, -height % PATCH)))[0, 0, :height, :width]
    return log_depth.double().exp().numpy()


def _png(path) -> np.ndarray:
    image = Image.open(path)
    assert image.mode.startswith('I;16') or image.mode == 'I', image.mode   # 16 bits
    return np.asarray(image).astype(np.float64)


def _size(path):
    return Image.open(path).size


def _truncated_tiff(path, pixels: np.ndarray):
    """A tiled TIFF cut after 60% of its bytes: it opens, its top rows decode, its lower tiles are missing."""
    tifffile.imwrite(path, pixels, photometric='rgb', tile=(16, 16), compression='zlib')
    path.write_bytes(path.read_bytes()[:int(path.stat().st_size * 0.6)])


def test_depth_maps_are_exp_of_the_plain_forward_bounded_or_whole(predict_tool, depth_run, images, tmp_path, capsys):
    inputs = tmp_path / 'in'
    shutil.copytree(images, inputs)
    (inputs / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\n not really a png')
    _truncated_tiff(inputs / 'c_half.tif', np.random.default_rng(1).integers(0, 256, (128, 96, 3), dtype=np.uint8))
    auto, whole = tmp_path / 'auto', tmp_path / 'whole'
    assert predict_tool.main([str(depth_run), str(inputs), '--out', str(auto), '--rows-per-chunk', '2']) == 1
    err = capsys.readouterr().err
    assert 'bounded: the whole image in bands' in err                         # auto: the model has the state form
    assert 'skipped' in err and 'broken.png' in err and 'c_half.tif' in err
    assert f"2 input(s) skipped: {inputs / 'broken.png'}, {inputs / 'c_half.tif'}" in err
    assert sorted(p.name for p in auto.iterdir()) == ['a_depth.png', 'a_preview.png', 'b_depth.tif', 'b_preview.png']
    assert predict_tool.main([str(depth_run), str(inputs / 'a.png'), str(inputs / 'b.tif'), '--out', str(whole),
                              '--mode', 'whole', '--mask-format', 'tiff']) == 0

    expected_a, expected_b = _reference(depth_run, inputs / 'a.png'), _reference(depth_run, inputs / 'b.tif')
    # PNG: millimetres, rounded
    assert np.abs(_png(auto / 'a_depth.png') * MILLIMETRE - expected_a).max() <= MILLIMETRE / 2 + 1e-6
    # TIFF: metres in float32, bounded (band by band) and whole alike
    for path, expected in ((auto / 'b_depth.tif', expected_b), (whole / 'b_depth.tif', expected_b),
                           (whole / 'a_depth.tif', expected_a)):
        stored = tifffile.imread(path)
        assert stored.dtype == np.float32 and stored.shape == expected.shape
        np.testing.assert_allclose(stored, expected, rtol=1e-5, err_msg=str(path))
    np.testing.assert_allclose(tifffile.imread(auto / 'b_depth.tif'), tifffile.imread(whole / 'b_depth.tif'),
                               rtol=1e-5)
    with tifffile.TiffFile(auto / 'b_depth.tif') as tif:   # a GeoTIFF's georeferencing stays with the map
        page = tif.pages[0]
        assert tif.is_bigtiff and page.is_tiled and page.description.startswith('linvit depth map (m)')
        assert page.tags[33550].value == (0.5, 0.25, 0.0) and page.tags[33922].value[3:5] == (500000.0, 4000000.0)
    assert _size(auto / 'a_preview.png') == (45, 37) and _size(auto / 'b_preview.png') == (53, 41)
    assert Image.open(auto / 'a_preview.png').mode == 'RGB'


def test_a_disparity_run_names_its_maps_and_stores_its_own_depth_scale(predict_tool, depth_run, images, tmp_path):
    """The same weights under a config that says disparity with data.depth_scale=0.002: the output is read as the
    log of 1/metres, written as <name>_disparity.png in units of 0.002."""
    run = tmp_path / 'disparity'
    shutil.copytree(depth_run, run)
    cfg = OmegaConf.load(run / 'config.yaml')
    cfg.depth.target, cfg.data.depth_scale = 'disparity', 0.002
    OmegaConf.save(cfg, run / 'config.yaml')
    out = tmp_path / 'out'
    assert predict_tool.main([str(run), str(images / 'a.png'), '--out', str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ['a_disparity.png', 'a_preview.png']
    expected = _reference(depth_run, images / 'a.png')
    assert np.abs(_png(out / 'a_disparity.png') * 0.002 - expected).max() <= 0.002 / 2 + 1e-6


def test_ctrl_c_leaves_the_complete_images_and_nothing_of_the_one_in_progress(depth_run, images, tmp_path,
                                                                            monkeypatch):
    items, _ = collect_inputs([str(images / 'a.png'), str(images / 'b.tif')])
    previews: list = []
    write_preview = linvit.predict._write_value_preview

    def interrupted_in_the_second_preview(preview, path, values):
        previews.append(path)
        if len(previews) == 2:   # b's map is written by now
            raise KeyboardInterrupt
        return write_preview(preview, path, values)
    monkeypatch.setattr(linvit.predict, '_write_value_preview', interrupted_in_the_second_preview)
    with pytest.raises(PredictionInterrupted, match='1 of 2 image') as stop:
        depth_images(load_predictor(str(depth_run)), items, str(tmp_path / 'out'), mode='whole')
    assert stop.value.written == 1
    assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == ['a_depth.png', 'a_preview.png']


def test_the_onnx_file_of_a_depth_run_predicts_what_pytorch_does(depth_run, images, tmp_path, predict_tool, capsys):
    onnx_path = tmp_path / 'depth.onnx'
    assert load_tool('export_onnx').main([str(depth_run), '--out', str(onnx_path)]) == 0
    assert 'predictions: python tools/predict.py' in capsys.readouterr().out
    meta = read_metadata(onnx_path)
    assert meta['task'] == 'depth' and meta['values'] == {'name': 'depth', 'unit': 'm', 'png_scale': MILLIMETRE,
                                                          'larger_is_nearer': False}
    out = tmp_path / 'onnx'
    assert predict_tool.main([str(onnx_path), str(images), '--out', str(out)]) == 0
    assert 'whole: an ONNX file runs whole or in windows' in capsys.readouterr().err
    expected_a, expected_b = _reference(depth_run, images / 'a.png'), _reference(depth_run, images / 'b.tif')
    np.testing.assert_allclose(tifffile.imread(out / 'b_depth.tif'), expected_b, rtol=1e-4)
    assert np.abs(_png(out / 'a_depth.png') * MILLIMETRE - expected_a).max() <= MILLIMETRE / 2 + 1e-4


def test_the_hub_export_of_a_depth_run_refuses_in_one_line(depth_run, tmp_path):
    with pytest.raises(HubExportError) as error:
        export_hub_folder(str(depth_run), str(tmp_path / 'hub'))
    message = str(error.value)
    assert '\n' not in message and 'not a timm model' in message and 'tools/export_onnx.py' in message
