"""linvit.predict with stand-in models (no training): inputs found in folders and named uniquely, top-k rows against
softmax computed here, a fixed-batch model fed in chunks, masks at the input's size against a threshold computed
here, unreadable images skipped with a reason, and the errors that stop a prediction."""
import csv

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

import linvit.predict
from linvit.data.large_image import write_overlay_png
from linvit.predict import (
    PREDICTION_FIELDS,
    PredictionInterrupted,
    Predictor,
    choose_mode,
    classify_images,
    collect_inputs,
    load_predictor,
    segment_images,
    write_predictions,
)

MEAN = STD = (0.5, 0.5, 0.5)


def save_image(path, rgb: np.ndarray):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(path)
    return path


def solid(height: int, width: int, rgb) -> np.ndarray:
    return np.broadcast_to(np.array(rgb, dtype=np.uint8), (height, width, 3)).copy()


def channel_means_classifier(batches: list) -> Predictor:
    """Logits [B, 3] = the mean of each normalised channel; records every batch size it is called with."""
    def run(images: torch.Tensor) -> torch.Tensor:
        batches.append(images.shape[0])
        return images.mean(dim=(2, 3))
    return Predictor(run=run, task='classification', class_names=['red', 'green', 'blue'], mean=MEAN, std=STD,
                     img_size=(16, 16), multiple=1)


def test_inputs_from_files_and_folders_get_unique_names(tmp_path):
    a = save_image(tmp_path / 'in' / 'a.png', solid(4, 4, (0, 0, 0)))
    b = save_image(tmp_path / 'in' / 'sub' / 'b.png', solid(4, 4, (0, 0, 0)))
    (tmp_path / 'in' / 'notes.txt').write_text('not an image')
    again = save_image(tmp_path / 'other' / 'a.png', solid(4, 4, (0, 0, 0)))
    items, missing = collect_inputs([str(tmp_path / 'in'), str(again), str(tmp_path / 'nowhere')])
    assert [(item.path, item.name) for item in items] == [(str(a), 'a'), (str(b), 'sub/b'), (str(again), 'a_1')]
    assert missing == [(str(tmp_path / 'nowhere'), 'no such file or folder')]


def test_top_k_rows_match_softmax_and_an_unreadable_image_is_skipped(tmp_path):
    colours = {'reddish.png': (250, 40, 10), 'bluish.png': (20, 90, 240), 'greenish.png': (60, 200, 100)}
    paths = [save_image(tmp_path / name, solid(20, 30, rgb)) for name, rgb in colours.items()]
    (tmp_path / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\n not really a png')
    items, _ = collect_inputs([str(p) for p in paths] + [str(tmp_path / 'broken.png')])
    batches: list = []
    rows, skipped = classify_images(channel_means_classifier(batches), items, top_k=2, batch_size=2)
    assert [path for path, _ in skipped] == [str(tmp_path / 'broken.png')] and 'Error' in skipped[0][1]
    assert batches == [2, 1]
    for path, rgb in zip(paths, colours.values()):
        expected = ((torch.tensor(rgb, dtype=torch.float64) / 255 - 0.5) / 0.5).softmax(0).topk(2)
        mine = [row for row in rows if row['file'] == str(path)]
        assert [row['rank'] for row in mine] == [1, 2]
        assert [row['class_index'] for row in mine] == expected.indices.tolist()
        assert [row['class_name'] for row in mine] == [['red', 'green', 'blue'][i] for i in expected.indices]
        assert [row['probability'] for row in mine] == pytest.approx(expected.values.tolist(), abs=1e-5)
    written = write_predictions(rows, str(tmp_path / 'out'))
    with open(written, newline='') as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == PREDICTION_FIELDS and len(list(reader)) == 6


def test_a_fixed_batch_model_is_fed_exactly_its_batch(tmp_path):
    paths = [save_image(tmp_path / f'{i}.png', solid(8, 8, (10 * i, 0, 0))) for i in range(5)]
    items, _ = collect_inputs([str(p) for p in paths])
    batches: list = []
    predictor = channel_means_classifier(batches)
    predictor.max_batch = 2
    rows, _ = classify_images(predictor, items, top_k=1, batch_size=4)
    assert batches == [2, 2, 1] and len(rows) == 5


def red_threshold_segmenter(window_sizes: list) -> Predictor:
    """Logits [B, 2, H, W]: class 1 where the normalised red channel is positive (red > 127.5), class 0 elsewhere;
    records the (height, width) of every call."""
    def run(images: torch.Tensor) -> torch.Tensor:
        window_sizes.append(tuple(images.shape[-2:]))
        red = images[:, :1]
        return torch.cat([-red, red], dim=1)
    return Predictor(run=run, task='segmentation', class_names=['dark', 'red'], mean=MEAN, std=STD, img_size=(16, 16),
                     multiple=8)


@pytest.mark.parametrize('mode', ['whole', 'slide'])
def test_masks_and_overlays_have_the_input_size(tmp_path, mode):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (21, 35, 3), dtype=np.uint8)
    path = save_image(tmp_path / 'in' / 'deep' / 'scan.png', image)
    items, _ = collect_inputs([str(tmp_path / 'in')])
    calls: list = []
    written, skipped = segment_images(red_threshold_segmenter(calls), items, str(tmp_path / 'out'), mode=mode,
                                      window=16, stride=8)
    assert (written, skipped) == (1, [])
    mask = np.asarray(Image.open(tmp_path / 'out' / 'deep' / 'scan_mask.png'))
    assert mask.dtype == np.uint8
    np.testing.assert_array_equal(mask, (image[..., 0] > 127.5).astype(np.uint8))
    assert Image.open(tmp_path / 'out' / 'deep' / 'scan_overlay.png').size == Image.open(path).size
    if mode == 'whole':
        assert calls == [(24, 40)]                          # padded to the multiple of 8
    else:
        assert set(calls) == {(16, 16)}


def test_what_stops_a_prediction(tmp_path):
    predictor = red_threshold_segmenter([])
    with pytest.raises(ValueError, match='give --out FOLDER'):
        segment_images(predictor, [], None)
    with pytest.raises(FileNotFoundError, match='nothing.onnx does not exist'):
        load_predictor(str(tmp_path / 'nothing.onnx'))


def _seg_predictor(**backbone_kwargs) -> Predictor:
    import timm

    from linvit.models import SegmentationModel
    backbone = timm.create_model('linvit_tiny_patch16_224', num_classes=0, depth=2, embed_dim=48, num_heads=3,
                                 patch_size=8, dynamic_img_size=True, **backbone_kwargs)
    predictor = red_threshold_segmenter([])
    predictor.model = SegmentationModel(backbone, num_classes=2, neck_dim=16, head_dim=16).eval()
    return predictor


def test_auto_mode_is_bounded_when_the_model_allows_it_else_whole_or_windows_by_size():
    mode, why = choose_mode(_seg_predictor(), 5000, 5000, 'auto', max_pixels=100, rows_per_chunk=8)
    assert mode == 'bounded' and 'bands of 8 patch rows' in why
    hybrid = _seg_predictor(softmax_blocks=[1])
    mode, why = choose_mode(hybrid, 10, 10, 'auto', max_pixels=100, rows_per_chunk=8)
    assert mode == 'whole' and 'softmax attention' in why and 'within --max-pixels 100' in why
    mode, why = choose_mode(hybrid, 10, 11, 'auto', max_pixels=100, rows_per_chunk=8)
    assert mode == 'slide' and 'above --max-pixels 100' in why
    onnx = red_threshold_segmenter([])  # no PyTorch model: an ONNX file
    assert choose_mode(onnx, 10, 11, 'auto', max_pixels=100, rows_per_chunk=8)[0] == 'slide'
    assert choose_mode(onnx, 10, 11, 'whole', max_pixels=100, rows_per_chunk=8) == ('whole', '--mode')
    with pytest.raises(ValueError, match='--mode bounded cannot run this model: block 1 has') as error:
        choose_mode(hybrid, 10, 10, 'bounded', max_pixels=100, rows_per_chunk=8)
    assert '\n' not in str(error.value)
    with pytest.raises(ValueError, match='ONNX file runs whole or in windows'):
        choose_mode(onnx, 10, 10, 'bounded', max_pixels=100, rows_per_chunk=8)



def truncated_tiff(path, pixels: np.ndarray, keep: float = 0.6):
    """A tiled zlib TIFF of ``pixels`` cut after ``keep`` of its bytes: it opens (the header and tile table come
    first) and its top rows decode, its lower tiles are missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tifffile.imwrite(path, pixels, photometric='rgb', tile=(16, 16), compression='zlib')
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    return path


def test_an_image_that_fails_half_way_is_skipped_without_files_and_the_next_is_predicted(tmp_path):
    rng = np.random.default_rng(1)
    truncated_tiff(tmp_path / 'in' / 'a_broken.tif', rng.integers(0, 256, (128, 96, 3), dtype=np.uint8))
    tifffile.imwrite(tmp_path / 'in' / 'b_good.tif', rng.integers(0, 256, (40, 56, 3), dtype=np.uint8),
                     photometric='rgb', tile=(16, 16))
    items, _ = collect_inputs([str(tmp_path / 'in')])
    assert [item.name for item in items] == ['a_broken', 'b_good']   # the broken one first: the batch goes on
    written, skipped = segment_images(_seg_predictor(), items, str(tmp_path / 'out'), mode='bounded',
                                      rows_per_chunk=2)              # its top bands are predicted and written
    assert written == 1
    assert [path for path, _ in skipped] == [str(tmp_path / 'in' / 'a_broken.tif')]
    assert 'truncated' in skipped[0][1] and 'a_broken.tif' in skipped[0][1]
    assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == ['b_good_mask.tif', 'b_good_overlay.png',
                                                                   'b_good_preview.png']   # nothing of a_broken
    with tifffile.TiffFile(tmp_path / 'out' / 'b_good_mask.tif') as tif:
        assert tif.pages[0].shape == (40, 56)


def test_ctrl_c_leaves_the_complete_images_and_nothing_of_the_one_in_progress(tmp_path, monkeypatch):
    for name in ('a', 'b', 'c'):
        (tmp_path / 'in').mkdir(exist_ok=True)
        tifffile.imwrite(tmp_path / 'in' / f'{name}.tif', solid(16, 16, (200, 0, 0)), photometric='rgb')
    items, _ = collect_inputs([str(tmp_path / 'in')])
    overlays: list = []

    def interrupted_in_the_second_overlay(source, preview, path, palette, alpha):
        overlays.append(path)
        if len(overlays) == 2:   # b's mask and preview are written by now
            raise KeyboardInterrupt
        return write_overlay_png(source, preview, path, palette, alpha)
    monkeypatch.setattr(linvit.predict, 'write_overlay_png', interrupted_in_the_second_overlay)
    with pytest.raises(PredictionInterrupted, match='1 of 3 image') as stop:
        segment_images(red_threshold_segmenter([]), items, str(tmp_path / 'out'), mode='whole')
    assert isinstance(stop.value, KeyboardInterrupt) and stop.value.written == 1
    assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == ['a_mask.tif', 'a_overlay.png', 'a_preview.png']


def test_a_mask_of_a_pyramid_level_records_its_downsample(tmp_path):
    rng = np.random.default_rng(2)
    full = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    with tifffile.TiffWriter(tmp_path / 'pyramid.tif') as tif:   # level 0 and a level of downsample 2 (SubIFD)
        tif.write(full, photometric='rgb', tile=(16, 16), subifds=1)
        tif.write(full[::2, ::2], photometric='rgb', tile=(16, 16), subfiletype=1)
    items, _ = collect_inputs([str(tmp_path / 'pyramid.tif')])
    for downsample in (2.0, 1.0):
        segment_images(red_threshold_segmenter([]), items, str(tmp_path / f'out{downsample:g}'), mode='whole',
                       downsample=downsample)
        with tifffile.TiffFile(tmp_path / f'out{downsample:g}' / 'pyramid_mask.tif') as tif:
            page = tif.pages[0]
            assert page.shape == (64 // downsample, 96 // downsample)
            numerator, denominator = page.tags['XResolution'].value
            assert numerator / denominator == page.tags['YResolution'].value[0] / page.tags['YResolution'].value[1]
            assert numerator / denominator == pytest.approx(1 / downsample)   # map pixels per full-size pixel
            assert page.tags['ResolutionUnit'].value == 1                      # none: the unit is a full-size pixel
            assert page.description.endswith(f'downsample {downsample:g}')


def test_a_full_size_overlay_is_blended_band_by_band_as_a_whole_one(tmp_path, monkeypatch):
    image = np.random.default_rng(3).integers(0, 256, (21, 35, 3), dtype=np.uint8)
    items, _ = collect_inputs([str(save_image(tmp_path / 'scan.png', image))])
    monkeypatch.setattr(linvit.predict, '_OVERLAY_ROWS', 8)                 # bands of 8, 8 and 5 rows
    segment_images(red_threshold_segmenter([]), items, str(tmp_path / 'out'), mode='whole', alpha=0.25)
    classes = (image[..., 0] > 127.5).astype(int)
    palette = np.array([[0, 0, 0], [31, 119, 180]], dtype=np.float64)     # class_palette(2): black, tab10 blue
    expected = 0.75 * image + 0.25 * palette[classes]
    overlay = np.asarray(Image.open(tmp_path / 'out' / 'scan_overlay.png')).astype(np.float64)
    assert np.abs(overlay - expected).max() <= 0.5 + 1e-6
