"""linvit.predict.detect_images with a stand-in detector (no training): detections.json speaks the data set's own
category ids (and its image ids with --annotations), a forward that hits the detection cap says so in one line, and
tiles are chosen from the pixel budget rather than the training size."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from tiny_run import TINY_MODEL

from linvit.engine import build_task, load_config
from linvit.predict import Item, Predictor, detect_images, detection_tile

MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
#: the set's categories as its file lists them: ids with a gap, not in name order
CATEGORIES = [{'id': 7, 'name': 'red'}, {'id': 3, 'name': 'blue'}]


class StandIn(torch.nn.Module):
    """A detector with torchvision's cap attribute: per image, ``per_image`` boxes (at most ``detections_per_img``)
    on a diagonal of 10 px squares, label 1 (the first class) on even ones and 2 on odd ones; records input sizes."""

    def __init__(self, per_image=2, cap=100):
        super().__init__()
        self.per_image, self.detections_per_img, self.sizes = per_image, cap, []

    def forward(self, images):
        self.sizes += [tuple(images.shape[-2:])] * len(images)
        count = min(self.per_image, self.detections_per_img)
        steps = torch.arange(count, dtype=torch.float32)
        boxes = torch.stack([steps * 3, steps * 2, steps * 3 + 10, steps * 2 + 10], dim=1)
        return [{'boxes': boxes, 'scores': 1 - steps / 1000, 'labels': (steps.long() % 2) + 1} for _ in images]


def _predictor(model, class_names=('blue', 'red'), defaults=None):
    return Predictor(run=lambda images: model(images), task='detection', class_names=list(class_names), mean=MEAN,
                     std=STD, img_size=(64, 64), multiple=8, seg_defaults=dict(defaults or {}), model=model)


def _coco_set(root):
    """A val split whose categories are CATEGORIES, images with ids 100 and 107."""
    (root / 'annotations').mkdir(parents=True)
    (root / 'val').mkdir()
    images = []
    for index, image_id in enumerate((100, 107)):
        Image.fromarray(np.full((48, 56, 3), 90, dtype=np.uint8)).save(root / 'val' / f'{index}.png')
        images.append({'id': image_id, 'file_name': f'{index}.png', 'width': 56, 'height': 48})
    annotations = [{'id': 1, 'image_id': 100, 'category_id': 3, 'bbox': [0, 0, 10, 10], 'area': 100, 'iscrowd': 0},
                   {'id': 2, 'image_id': 107, 'category_id': 7, 'bbox': [3, 2, 10, 10], 'area': 100, 'iscrowd': 0}]
    path = root / 'annotations' / 'instances_val.json'
    path.write_text(json.dumps({'images': images, 'annotations': annotations, 'categories': CATEGORIES}))
    return path


def _trained_defaults(root):
    """What a run trained on the set at ``root`` tells prediction (its task's prediction_defaults, the classes)."""
    task = build_task(load_config(None, [*TINY_MODEL, 'task=detection', 'data.name=folder', f'data.root={root}',
                                         'data.img_size=64', 'device=cpu']))
    _, _, class_names = task.build_datasets(MEAN, STD, with_train=False)
    return task.prediction_defaults(), class_names


def test_detections_json_uses_the_sets_category_ids(tmp_path):
    _coco_set(tmp_path / 'set')
    defaults, class_names = _trained_defaults(tmp_path / 'set')
    assert class_names == ['blue', 'red']  # labels follow the sorted ids: 1 -> 3 (blue), 2 -> 7 (red)
    items = [Item(str(tmp_path / 'set' / 'val' / '0.png'), '0')]
    detect_images(_predictor(StandIn(), class_names, defaults), items, str(tmp_path / 'out'))
    written = json.loads((tmp_path / 'out' / 'detections.json').read_text())
    assert sorted((c['id'], c['name']) for c in written['categories']) == [(3, 'blue'), (7, 'red')]
    assert [a['category_id'] for a in written['annotations']] == [3, 7]  # labels 1, 2
    assert written['images'][0]['file_name'] == items[0].path  # no annotation file: images by file name


def test_with_the_annotation_file_images_take_the_sets_ids_and_cocoeval_reads_the_file(tmp_path):
    annotation_file = _coco_set(tmp_path / 'set')
    defaults, class_names = _trained_defaults(tmp_path / 'set')
    items = [Item(str(tmp_path / 'set' / 'val' / f'{i}.png'), str(i)) for i in (1, 0)]
    detect_images(_predictor(StandIn(), class_names, defaults), items, str(tmp_path / 'out'),
                  annotations=str(annotation_file))
    written = json.loads((tmp_path / 'out' / 'detections.json').read_text())
    assert [(i['id'], i['file_name']) for i in written['images']] == [(107, '1.png'), (100, '0.png')]
    ground_truth = COCO(str(annotation_file))
    evaluation = COCOeval(ground_truth, ground_truth.loadRes(written['annotations']), 'bbox')
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    assert evaluation.stats[8] == pytest.approx(1.0)  # recall: image 100's blue box and image 107's red one found


def test_images_the_annotation_file_does_not_list_and_other_categories_are_one_line(tmp_path):
    annotation_file = _coco_set(tmp_path / 'set')
    defaults, class_names = _trained_defaults(tmp_path / 'set')
    stray = tmp_path / 'stray.png'
    Image.new('RGB', (20, 20)).save(stray)
    with pytest.raises(ValueError, match=r"stray.png is not among the images of .*instances_val.json"):
        detect_images(_predictor(StandIn(), class_names, defaults), [Item(str(stray), 'stray')],
                      str(tmp_path / 'out'), annotations=str(annotation_file))
    with pytest.raises(ValueError, match=r"instances_val.json lists categories .*the run was trained on"):
        detect_images(_predictor(StandIn(), ['circle', 'square']), [Item(str(stray), 'stray')],
                      str(tmp_path / 'out'), annotations=str(annotation_file))


def test_a_forward_that_returns_the_cap_says_so(tmp_path, capsys):
    Image.new('RGB', (40, 30)).save(tmp_path / 'many.png')
    model = StandIn(per_image=300, cap=100)
    detect_images(_predictor(model), [Item(str(tmp_path / 'many.png'), 'many')], str(tmp_path / 'out'))
    err = capsys.readouterr().err
    assert 'returned the cap of 100 detections (--max-detections)' in err
    detect_images(_predictor(model), [Item(str(tmp_path / 'many.png'), 'many')], str(tmp_path / 'out'),
                  max_detections=500)
    assert 'cap' not in capsys.readouterr().err
    assert len(json.loads((tmp_path / 'out' / 'detections.json').read_text())['annotations']) == 300
    assert model.detections_per_img == 100  # the run's own cap is back


def test_tiles_come_from_the_pixel_budget_not_the_training_size(tmp_path):
    Image.new('RGB', (200, 150)).save(tmp_path / 'big.png')
    model = StandIn()
    detect_images(_predictor(model), [Item(str(tmp_path / 'big.png'), 'big')], str(tmp_path / 'out'),
                  max_pixels=10_000)
    assert set(model.sizes) == {(96, 96)}  # the largest square of multiples of 8 within 10,000 pixels
    assert len(model.sizes) == 6  # 2 rows x 3 columns of 96 px tiles overlapping by a third


@pytest.mark.parametrize('height, width, max_pixels, tile', [
    (2400, 2400, 2048 * 2048, (2048, 2048)),
    (150, 200, 10_000, (96, 96)),
    (60, 1000, 10_000, (60, 160)),  # a strip: its full height, as wide as the budget allows
    (1000, 50, 10_000, (200, 50)),
    (40, 40, 10_000, (40, 40)),  # the whole image fits
])
def test_detection_tile_is_the_largest_tile_within_the_budget(height, width, max_pixels, tile):
    assert detection_tile(height, width, max_pixels, multiple=8) == tile
    assert tile[0] * tile[1] <= max_pixels
