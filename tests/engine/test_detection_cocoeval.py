"""Training-time evaluation of a COCO-format folder set against the reference: the same detections scored through
linvit (task=detection's datasets and meter, images evaluated at data.img_size, detections as the detector gives
them at that scale) and through pycocotools as its README runs it (COCO(annotation file), loadRes of a results file
in the images' own pixels, COCOeval). The set has what implementations disagree on: crowd regions, gaps and an
unsorted order in the category ids, 'area' fields that are not the boxes' areas (objects small by area but medium by
box), images of other sizes than the evaluation's and objects of every COCO size in their own pixels."""
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from tiny_run import TINY_MODEL

from linvit.engine import build_task, load_config

#: (width, height) of the validation images in their own pixels; evaluation resizes the longer side to EVAL_SIZE
IMAGE_SIZES = ((310, 230), (190, 410), (470, 170), (255, 255))  # resized sides that round: 47, 30, 23
EVAL_SIZE = 64
#: the file's categories, unsorted and with gaps: labels follow the sorted ids (3 -> 1, 7 -> 2, 12 -> 3)
CATEGORIES = [{'id': 12, 'name': 'green'}, {'id': 3, 'name': 'blue'}, {'id': 7, 'name': 'red'}]
COCO_NAMES = ('ap', 'ap50', 'ap75', 'ap_small', 'ap_medium', 'ap_large')


def _objects(rng, width, height, count):
    """``count`` boxes [x, y, w, h] of sides 12..150 px inside the image."""
    sides = rng.uniform(12, min(150, width - 2, height - 2), (count, 2))
    xy = rng.uniform(0, 1, (count, 2)) * (np.array([width, height]) - sides)
    return np.concatenate([xy, sides], axis=1)


def _write_set(root, seed=0, with_area=True):
    """A val split on disk (images of IMAGE_SIZES, their objects, one crowd region each) and noisy detections in the
    images' own pixels: COCO results rows {image_id, category_id, bbox, score}."""
    rng = np.random.default_rng(seed)
    (root / 'annotations').mkdir(parents=True)
    (root / 'val').mkdir()
    images, annotations, results = [], [], []
    for index, (width, height) in enumerate(IMAGE_SIZES):
        image_id = 100 + 7 * index  # ids that are not positions
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(root / 'val' / f'{index}.png')
        images.append({'id': image_id, 'file_name': f'{index}.png', 'width': width, 'height': height})
        boxes = _objects(rng, width, height, 7)
        boxes[0, 2:] = 36  # 1,296 px^2 as a box (medium), 907 by its area field (small)
        categories = rng.choice([c['id'] for c in CATEGORIES], len(boxes))
        for box, category in zip(boxes, categories):
            annotation = {'id': len(annotations) + 1, 'image_id': image_id, 'category_id': int(category),
                          'bbox': [float(v) for v in box], 'iscrowd': 0}
            if with_area:
                annotation['area'] = float(box[2] * box[3] * 0.7)  # a polygon's area is less than its box's
            annotations.append(annotation)
        crowd = [0.0, 0.0, width / 2, height / 2]  # the top-left quarter: one region of many objects
        annotations.append({'id': len(annotations) + 1, 'image_id': image_id, 'category_id': int(categories[0]),
                            'bbox': crowd, 'iscrowd': 1, **({'area': crowd[2] * crowd[3]} if with_area else {})})
        for box, category in zip(boxes, categories):
            if rng.random() < 0.8:  # found, a little off, sometimes under another class
                found = box + rng.normal(0, 0.06 * box[2:].mean(), 4)
                label = category if rng.random() < 0.85 else int(rng.choice([c['id'] for c in CATEGORIES]))
                results.append({'image_id': image_id, 'category_id': int(label), 'score': float(rng.random()),
                                'bbox': [float(v) for v in found]})
        for box in _objects(rng, width / 2, height / 2, 3):  # inside the crowd: ignored by COCOeval, not misses
            results.append({'image_id': image_id, 'category_id': int(categories[0]), 'score': float(rng.random()),
                            'bbox': [float(v) for v in box]})
        for box in _objects(rng, width, height, 2):  # anywhere
            results.append({'image_id': image_id, 'category_id': int(rng.choice([c['id'] for c in CATEGORIES])),
                            'score': float(rng.random()), 'bbox': [float(v) for v in box]})
    path = root / 'annotations' / 'instances_val.json'
    path.write_text(json.dumps({'images': images, 'annotations': annotations, 'categories': CATEGORIES}))
    return path, results


def _cocoeval(annotation_file, results_file, category_ids=None, fill_area=False):
    """COCOeval's stats on the files (the box AP of the categories ``category_ids``, or all)."""
    ground_truth = COCO(str(annotation_file))
    if fill_area:  # what COCO's loadRes gives a detection without one: its box's area
        for annotation in ground_truth.dataset['annotations']:
            annotation['area'] = annotation['bbox'][2] * annotation['bbox'][3]
    evaluation = COCOeval(ground_truth, ground_truth.loadRes(str(results_file)), 'bbox')
    if category_ids is not None:
        evaluation.params.catIds = category_ids
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    return [math.nan if value < 0 else float(value) for value in evaluation.stats[:6]]


def _linvit(root, results, overrides=()):
    """task=detection's evaluation: its val set at EVAL_SIZE, a stand-in detector that gives the detections at the
    evaluation scale (labels 1..K in the sorted category ids), the task's evaluate_batch, meter and final metrics."""
    cfg = load_config(None, [*TINY_MODEL, 'task=detection', 'data.name=folder', f'data.root={root}',
                             f'data.img_size={EVAL_SIZE}', 'device=cpu', *overrides])
    task = build_task(cfg)
    _, val, class_names = task.build_datasets((0.5,) * 3, (0.5,) * 3, with_train=False)
    label_of = {category: label for label, category in enumerate(sorted(c['id'] for c in CATEGORIES), start=1)}
    meter = task.new_meter(torch.device('cpu'))
    for index, (width, height) in enumerate(IMAGE_SIZES):
        image, target = val[(index, 0)]
        scale = EVAL_SIZE / max(width, height)
        sx, sy = round(width * scale) / width, round(height * scale) / height  # the resized image's pixels
        rows = [r for r in results if r['image_id'] == 100 + 7 * index]
        boxes = torch.tensor([[x * sx, y * sy, (x + w) * sx, (y + h) * sy] for x, y, w, h in
                              (r['bbox'] for r in rows)], dtype=torch.float32).reshape(-1, 4)
        found = {'boxes': boxes, 'labels': torch.tensor([label_of[r['category_id']] for r in rows]).long(),
                 'scores': torch.tensor([r['score'] for r in rows], dtype=torch.float32)}
        task.evaluate_batch(lambda images, found=found: [found], image[None], [target], meter)  # found these
    meter.reduce_()
    return task.final_metrics(meter.compute()), class_names


@pytest.mark.parametrize('seed', [0, 1])
def test_the_evaluation_of_a_coco_folder_is_cocoeval_on_its_annotation_file(tmp_path, seed):
    annotation_file, results = _write_set(tmp_path / 'set', seed)
    (tmp_path / 'results.json').write_text(json.dumps(results))
    expected = _cocoeval(annotation_file, tmp_path / 'results.json')
    ours, class_names = _linvit(tmp_path / 'set', results)
    for name, value in zip(COCO_NAMES, expected):
        assert (math.nan if ours[name] is None else ours[name]) == pytest.approx(value, abs=1e-12, nan_ok=True), name
    assert not math.isnan(expected[4]) and 0 < expected[0] < 1  # medium objects in their own pixels; not trivial
    assert class_names == ['blue', 'red', 'green']
    for category in CATEGORIES:  # each class's AP: COCOeval restricted to its category
        alone = _cocoeval(annotation_file, tmp_path / 'results.json', [category['id']])[0]
        assert ours['per_class_ap'][category['name']] == pytest.approx(alone, abs=1e-12), category


def test_crowd_regions_are_ignore_regions_not_deleted_objects(tmp_path):
    """With the crowds deleted from the file, the detections inside them become false positives: COCOeval's AP
    drops, and so does linvit's, to the same number."""
    annotation_file, results = _write_set(tmp_path / 'set')
    (tmp_path / 'results.json').write_text(json.dumps(results))
    with_crowds = _linvit(tmp_path / 'set', results)[0]['ap']
    content = json.loads(annotation_file.read_text())
    content['annotations'] = [a for a in content['annotations'] if not a['iscrowd']]
    annotation_file.write_text(json.dumps(content))
    without = _linvit(tmp_path / 'set', results)[0]['ap']
    assert without == pytest.approx(_cocoeval(annotation_file, tmp_path / 'results.json')[0], abs=1e-12)
    assert without < with_crowds - 0.01


def test_without_area_fields_objects_are_sized_by_their_boxes(tmp_path):
    """An annotation file without 'area' (COCOeval itself needs it): sizes are the boxes' areas, what COCO's loadRes
    gives results without one."""
    annotation_file, results = _write_set(tmp_path / 'set', with_area=False)
    (tmp_path / 'results.json').write_text(json.dumps(results))
    expected = _cocoeval(annotation_file, tmp_path / 'results.json', fill_area=True)
    ours, _ = _linvit(tmp_path / 'set', results)
    for name, value in zip(COCO_NAMES, expected):
        assert (math.nan if ours[name] is None else ours[name]) == pytest.approx(value, abs=1e-12, nan_ok=True), name


def test_max_detections_is_cocoevals_max_dets(tmp_path):
    """detection.detections_per_image is COCOeval's maxDets[-1] too: with 3, the 3 best detections of each image and
    class count. The reference keeps those in the results file and runs COCOeval as it is (its stats[0] reads
    maxDets=100 whatever params.maxDets says)."""
    annotation_file, results = _write_set(tmp_path / 'set')
    best = []
    for key in sorted({(r['image_id'], r['category_id']) for r in results}):
        rows = [r for r in results if (r['image_id'], r['category_id']) == key]
        best += sorted(rows, key=lambda r: -r['score'])[:3]
    assert len(best) < len(results)
    (tmp_path / 'results.json').write_text(json.dumps(best))
    expected = _cocoeval(annotation_file, tmp_path / 'results.json')
    ours, _ = _linvit(tmp_path / 'set', results, ['detection.detections_per_image=3'])
    for name, value in zip(COCO_NAMES, expected):
        assert (math.nan if ours[name] is None else ours[name]) == pytest.approx(value, abs=1e-12, nan_ok=True), name
    assert ours['ap'] < _linvit(tmp_path / 'set', results)[0]['ap']


def test_the_config_records_the_sets_category_ids_and_refuses_other_ones(tmp_path):
    """detection.category_ids defaults to the annotation file's ids (config.yaml holds them resolved); a run whose
    recorded ids are not the data's is refused in one line (its labels would be scored as other classes)."""
    from linvit.data import DataError
    from linvit.engine import config_to_yaml
    _write_set(tmp_path / 'set')
    cfg = load_config(None, [*TINY_MODEL, 'task=detection', 'data.name=folder', f'data.root={tmp_path / "set"}'])
    assert list(cfg.detection.category_ids) == [3, 7, 12] and 'category_ids:\n  - 3\n  - 7\n  - 12\n' in \
        config_to_yaml(cfg)
    assert list(load_config(None, [*TINY_MODEL, 'task=detection']).detection.category_ids) == []  # built-in shapes
    with pytest.raises(DataError, match=r"instances_val.json has category ids \[3, 7, 12\], but "
                                         r"detection.category_ids=\[1, 2, 3\]") as error:
        _linvit(tmp_path / 'set', [], ['detection.category_ids=[1,2,3]'])
    assert '\n' not in str(error.value)
