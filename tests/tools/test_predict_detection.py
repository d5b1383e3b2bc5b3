"""tools/predict.py on a detection run: detections.json is a COCO-format file whose boxes are the detector's own on
the image normalised by hand (whole mode), tiles are used above --max-pixels, overlays are drawn, and the wrong
mode, a missing --out and an unreadable image each get one line."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools.coco import COCO

from linvit.data.synthetic_seg import render_shapes
from linvit.engine.loading import load_trained

pytestmark = pytest.mark.integration  # trains or starts interpreters


@pytest.fixture(scope='module')
def det_run(tmp_path_factory, shared_run):
    return shared_run('det', tmp_path_factory.mktemp('det') / 'run')


def _scene(path, height, width, seed):
    pixels = render_shapes(np.random.default_rng(seed), max(height, width), key_colour=0)[0][:height, :width].copy()
    Image.fromarray(pixels).save(path)
    return pixels


def _by_hand(run, pixels):
    """The trained detector on the image normalised by hand, (x / 255 - mean) / std, in one forward."""
    trained = load_trained(str(run))
    mean, std = torch.tensor(trained.mean).view(3, 1, 1), torch.tensor(trained.std).view(3, 1, 1)
    image = (torch.from_numpy(pixels).permute(2, 0, 1).float() / 255 - mean) / std
    with torch.no_grad():
        return trained.model(image[None])[0]


def test_whole_image_detections_are_the_detectors_in_a_coco_file(det_run, tmp_path, predict_tool, capsys):
    pixels = _scene(tmp_path / 'scene.png', 70, 90, seed=1)
    assert predict_tool.main([str(det_run), str(tmp_path / 'scene.png'), '--out', str(tmp_path / 'out'),
                              '--min-score', '0']) == 0
    assert 'whole (6,300 pixels <= --max-pixels' in capsys.readouterr().err
    coco = COCO(str(tmp_path / 'out' / 'detections.json'))
    assert [c['name'] for c in coco.loadCats(coco.getCatIds())] == ['circle', 'square']
    assert coco.imgs[1]['file_name'] == str(tmp_path / 'scene.png') and coco.imgs[1]['width'] == 90
    expected = _by_hand(det_run, pixels)
    annotations = coco.loadAnns(coco.getAnnIds(imgIds=[1]))
    assert len(annotations) == len(expected['boxes']) > 0
    boxes = torch.tensor([a['bbox'] for a in annotations])
    torch.testing.assert_close(boxes[:, :2], expected['boxes'][:, :2], atol=0.01, rtol=0)
    torch.testing.assert_close(boxes[:, :2] + boxes[:, 2:], expected['boxes'][:, 2:], atol=0.02, rtol=0)
    assert [a['category_id'] for a in annotations] == expected['labels'].tolist()
    torch.testing.assert_close(torch.tensor([a['score'] for a in annotations]), expected['scores'], atol=1e-5, rtol=0)
    assert Image.open(tmp_path / 'out' / 'scene_overlay.png').size == (90, 70)


def test_large_images_go_in_tiles_and_bad_input_gets_one_line(det_run, tmp_path, predict_tool, capsys):
    _scene(tmp_path / 'big.png', 150, 200, seed=2)
    (tmp_path / 'broken.png').write_bytes(b'not a png')
    out = tmp_path / 'out'
    assert predict_tool.main([str(det_run), str(tmp_path / 'big.png'), str(tmp_path / 'broken.png'), '--out',
                              str(out), '--max-pixels', '10000']) == 1
    err = capsys.readouterr().err
    assert 'slide (30,000 pixels > --max-pixels 10,000; 96x96 px tiles overlapping by 32 px)' in err
    assert 'skipped' in err and 'broken.png' in err
    detections = json.loads((out / 'detections.json').read_text())
    assert [image['file_name'] for image in detections['images']] == [str(tmp_path / 'big.png')]
    for annotation in detections['annotations']:
        x, y, w, h = annotation['bbox']
        assert 0 <= x and 0 <= y and x + w <= 200.01 and y + h <= 150.01 and annotation['image_id'] == 1

    assert predict_tool.main([str(det_run), str(tmp_path / 'big.png'), '--out', str(out), '--mode', 'bounded']) == 2
    assert "--mode bounded is segmentation's" in capsys.readouterr().err
    assert predict_tool.main([str(det_run), str(tmp_path / 'big.png')]) == 2
    assert 'detection writes detections.json and overlays: give --out FOLDER' in capsys.readouterr().err
