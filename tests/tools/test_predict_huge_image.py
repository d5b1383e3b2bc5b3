"""tools/predict.py on images too large for the plain forward: a 10,000 x 10,000 px BigTIFF through the bounded
forward into a tiled class map of the same size with its preview and overlay; a small GeoTIFF whose class map
equals the plain forward of the model rebuilt by hand and keeps its georeferencing; the mode chosen and logged per
image; a missing optional reader named in one line."""
import numpy as np
import pytest
import tifffile
import torch
from PIL import Image
from tiny_run import TINY_MODEL, TINY_SEG

from linvit.engine import load_config, train
from linvit.engine.loading import load_trained
from linvit.inference import whole_inference

pytestmark = [pytest.mark.compiler, pytest.mark.integration]  # integration: trains or starts interpreters

#: patch 32 keeps the 10,000 px image at 313 x 313 tokens and its finest pyramid level at 1250 x 1250
SEG_RUN = [*TINY_MODEL, *TINY_SEG, 'model.kwargs.patch_size=32', 'data.img_size=64', 'train.epochs=1']
GEO_TAGS = [(33550, 12, 3, (0.5, 0.25, 0.0), True), (33922, 12, 6, (0, 0, 0, 500000.0, 4000000.0, 0), True)]


@pytest.fixture(scope='module')
def seg_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('seg') / 'run'
    train(load_config(None, [*SEG_RUN, f'output_dir={out}']))
    return out


def _big_tiff(path, side=10_000, tile=512):
    """A BigTIFF of side x side px written tile by tile (never whole in memory): bright squares on a dark ramp."""
    def tiles():
        for ty in range(0, side, tile):
            for tx in range(0, side, tile):
                y, x = np.arange(ty, min(ty + tile, side)), np.arange(tx, min(tx + tile, side))
                square = ((y[:, None] // 700) % 3 == 0) & ((x[None, :] // 900) % 2 == 0)
                grey = np.where(square, 230, (x[None, :] * 80) // side).astype(np.uint8)
                yield np.repeat(grey[..., None], 3, axis=-1)
    tifffile.imwrite(path, tiles(), shape=(side, side, 3), dtype=np.uint8, tile=(tile, tile), photometric='rgb',
                     compression='zlib', compressionargs={'level': 1}, bigtiff=True)  # level 1: 5x faster to write
    return path


def test_a_ten_thousand_pixel_bigtiff_becomes_a_tiled_class_map(seg_run, predict_tool, tmp_path, capsys):
    image = _big_tiff(tmp_path / 'scene.tif')
    assert predict_tool.main([str(seg_run), str(image), '--out', str(tmp_path / 'out'), '--threads', '2']) == 0
    log = capsys.readouterr().err
    assert 'bounded: the whole image in bands of 8 patch rows' in log
    with tifffile.TiffFile(tmp_path / 'out' / 'scene_mask.tif') as tif:
        page = tif.pages[0]
        assert tif.is_bigtiff and page.is_tiled and page.shape == (10_000, 10_000)
        assert page.dtype == np.uint8 and page.compression == tifffile.COMPRESSION.ADOBE_DEFLATE
        classes = page.asarray()
    assert classes.max() < len(load_trained(str(seg_run)).class_names)
    preview = np.asarray(Image.open(tmp_path / 'out' / 'scene_preview.png'))
    overlay = np.asarray(Image.open(tmp_path / 'out' / 'scene_overlay.png'))
    assert preview.shape == overlay.shape == (1024, 1024, 3)


def test_a_geotiff_class_map_equals_the_plain_forward_and_keeps_its_place(seg_run, predict_tool, tmp_path):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (150, 230, 3), dtype=np.uint8)  # sides the patch (32) does not divide
    tifffile.imwrite(tmp_path / 'geo.tif', pixels, photometric='rgb', extratags=GEO_TAGS, tile=(32, 32))
    assert predict_tool.main([str(seg_run), str(tmp_path / 'geo.tif'), '--out', str(tmp_path / 'out'),
                              '--rows-per-chunk', '2']) == 0  # bands and tiles of 2 patch rows
    with tifffile.TiffFile(tmp_path / 'out' / 'geo_mask.tif') as tif:
        classes = tif.pages[0].asarray()
        assert tif.pages[0].tags[33550].value == (0.5, 0.25, 0.0)
        assert tif.pages[0].tags[33922].value == (0, 0, 0, 500000.0, 4000000.0, 0)
    trained = load_trained(str(seg_run))
    mean, std = torch.tensor(trained.mean).view(3, 1, 1), torch.tensor(trained.std).view(3, 1, 1)
    images = ((torch.from_numpy(pixels).permute(2, 0, 1).float() / 255 - mean) / std).unsqueeze(0)
    with torch.no_grad():
        logits = whole_inference(trained.model.eval(), images, pad_multiple=32)[0]
    expected = logits.argmax(0).numpy()
    top2 = logits.topk(2, dim=0).values
    differ = classes != expected
    assert not differ.any() or bool(((top2[0] - top2[1]).numpy()[differ] < 1e-4).all())  # only near-ties


def test_modes_are_chosen_and_logged_and_a_missing_reader_is_one_line(seg_run, predict_tool, tmp_path, capsys):
    Image.fromarray(np.zeros((40, 70, 3), np.uint8)).save(tmp_path / 'small.png')
    (tmp_path / 'slide.mrxs').write_bytes(b'not a slide')
    out = str(tmp_path / 'out')
    code = predict_tool.main([str(seg_run), str(tmp_path / 'small.png'), str(tmp_path / 'slide.mrxs'), '--out', out,
                              '--mode', 'slide', '--window', '64'])
    err = capsys.readouterr().err
    assert code == 1
    assert f"{tmp_path / 'small.png'}: " in err and '; slide: --mode' in err
    assert (tmp_path / 'out' / 'small_mask.png').is_file() and (tmp_path / 'out' / 'small_overlay.png').is_file()
    skipped = [line for line in err.splitlines() if line.startswith(f"skipped {tmp_path / 'slide.mrxs'}")]
    assert len(skipped) == 1 and 'pip install openslide-python openslide-bin' in skipped[0]
