"""COCO box AP (linvit.engine.metrics.coco_box_metrics, DetectionMeter) on cases whose AP is derived by hand, and
against pycocotools run the documented way (COCO json files on disk, loadRes of a results file)."""
import json
import math

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from linvit.engine.metrics import DetectionMeter, coco_box_metrics

#: COCO interpolates precision at 101 recall points 0, 0.01, ..., 1
RECALL_POINTS = 101


def _boxes(rows, labels, scores=None):
    """One image's objects; labels count from 1, as the detectors give them."""
    found = {'boxes': torch.tensor(rows, dtype=torch.float32).reshape(-1, 4), 'labels': torch.tensor(labels).long()}
    if scores is not None:
        found['scores'] = torch.tensor(scores, dtype=torch.float32)
    return found


def test_a_false_positive_after_a_hit_halves_recall_and_ap_is_51_of_101_points():
    """Two 40 px cells (medium); detections: one exact (score 0.9), one on empty ground (0.8). Recall stops at 0.5
    with precision 1 up to there: the recall points 0 .. 0.50 (51 of 101) score 1, the rest 0, at every IoU."""
    targets = [_boxes([[10, 10, 50, 50], [100, 100, 140, 140]], [1, 1])]
    detections = [_boxes([[10, 10, 50, 50], [200, 10, 240, 50]], [1, 1], [0.9, 0.8])]
    metrics = coco_box_metrics(detections, targets, ['cell'])
    expected = 51 / RECALL_POINTS
    for name in ('ap', 'ap50', 'ap75', 'ap_medium'):
        assert metrics[name] == pytest.approx(expected, abs=1e-9), name
    assert math.isnan(metrics['ap_small']) and math.isnan(metrics['ap_large'])  # no ground truth of those sizes
    assert metrics['per_class_ap'] == {'cell': pytest.approx(expected, abs=1e-9)} and metrics['images'] == 1


def test_a_box_at_iou_062_counts_at_three_of_the_ten_thresholds():
    """A 100 x 62 box inside a 100 x 100 one: IoU 0.62, a hit at IoU 0.50, 0.55, 0.60 (AP 1 each) and a miss at
    0.65 .. 0.95 (AP 0): AP 3/10, AP50 1, AP75 0; the ground truth is large (10,000 px^2 >= 96^2)."""
    targets = [_boxes([[0, 0, 100, 100]], [1])]
    detections = [_boxes([[0, 0, 100, 62]], [1], [0.7])]
    metrics = coco_box_metrics(detections, targets, ['ship'])
    assert metrics['ap'] == pytest.approx(0.3, abs=1e-9)
    assert metrics['ap50'] == pytest.approx(1.0) and metrics['ap75'] == 0.0
    assert metrics['ap_large'] == pytest.approx(0.3, abs=1e-9) and math.isnan(metrics['ap_medium'])


def test_a_wrong_label_is_a_miss_for_one_class_and_a_late_false_positive_for_the_other():
    """cat found exactly (0.9) and the dog boxed but called a cat (0.5): cat reaches recall 1 at precision 1 before
    its false positive (AP 1); dog is never found (AP 0); the mean over classes is 0.5."""
    targets = [_boxes([[0, 0, 60, 60], [100, 0, 160, 60]], [1, 2])]
    detections = [_boxes([[0, 0, 60, 60], [100, 0, 160, 60]], [1, 1], [0.9, 0.5])]
    metrics = coco_box_metrics(detections, targets, ['cat', 'dog'])
    assert metrics['per_class_ap'] == {'cat': pytest.approx(1.0), 'dog': 0.0}
    assert metrics['ap'] == pytest.approx(0.5)


def test_no_detections_score_zero_where_there_is_ground_truth():
    targets = [_boxes([[0, 0, 60, 60]], [1]), _boxes([], [])]
    detections = [_boxes([], [], []), _boxes([], [], [])]
    metrics = coco_box_metrics(detections, targets, ['cell'])
    assert metrics['ap'] == 0.0 and metrics['per_class_ap'] == {'cell': 0.0} and metrics['images'] == 2


def _random_case(generator, images=6, classes=3):
    """Ground truth and noisy detections (jittered copies, misses, spurious boxes) as xyxy tensors."""
    targets, detections = [], []
    for _ in range(images):
        count = int(generator.integers(0, 6))
        xy = generator.uniform(0, 400, (count, 2))
        wh = generator.uniform(8, 150, (count, 2))
        boxes = np.concatenate([xy, xy + wh], axis=1)
        labels = generator.integers(1, classes + 1, count)
        keep = generator.random(count) > 0.2
        jitter = boxes[keep] + generator.normal(0, 6, (int(keep.sum()), 4))
        spurious_xy = generator.uniform(0, 400, (2, 2))
        spurious = np.concatenate([spurious_xy, spurious_xy + generator.uniform(8, 100, (2, 2))], axis=1)
        found = np.concatenate([jitter, spurious])
        found_labels = np.concatenate([labels[keep], generator.integers(1, classes + 1, 2)])
        targets.append(_boxes(boxes.tolist(), labels.tolist()))
        detections.append(_boxes(found.tolist(), found_labels.tolist(), generator.random(len(found)).tolist()))
    return targets, detections


def _pycocotools_on_files(tmp_path, targets, detections):
    """pycocotools as its README runs it: an annotation file, a results file, COCOeval.stats."""
    annotations, results = [], []
    for image_id, (target, found) in enumerate(zip(targets, detections), start=7):
        for (x1, y1, x2, y2), label in zip(target['boxes'].tolist(), target['labels'].tolist()):
            annotations.append({'id': len(annotations) + 1, 'image_id': image_id, 'category_id': 10 * label,
                                'bbox': [x1, y1, x2 - x1, y2 - y1], 'area': (x2 - x1) * (y2 - y1), 'iscrowd': 0})
        for (x1, y1, x2, y2), label, score in zip(found['boxes'].tolist(), found['labels'].tolist(),
                                                  found['scores'].tolist()):
            results.append({'image_id': image_id, 'category_id': 10 * label, 'bbox': [x1, y1, x2 - x1, y2 - y1],
                            'score': score})
    dataset = {'images': [{'id': i, 'width': 600, 'height': 600} for i in range(7, 7 + len(targets))],
               'annotations': annotations, 'categories': [{'id': 10 * (c + 1), 'name': f'c{c}'} for c in range(3)]}
    (tmp_path / 'instances_val.json').write_text(json.dumps(dataset))
    (tmp_path / 'results.json').write_text(json.dumps(results))
    ground_truth = COCO(str(tmp_path / 'instances_val.json'))
    evaluation = COCOeval(ground_truth, ground_truth.loadRes(str(tmp_path / 'results.json')), 'bbox')
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    return evaluation.stats[:6]


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_the_metrics_are_pycocotools_own_on_random_boxes(tmp_path, seed):
    targets, detections = _random_case(np.random.default_rng(seed))
    ours = coco_box_metrics(detections, targets, ['c0', 'c1', 'c2'])
    stats = _pycocotools_on_files(tmp_path, targets, detections)
    names = ('ap', 'ap50', 'ap75', 'ap_small', 'ap_medium', 'ap_large')
    for name, value in zip(names, stats):
        expected = math.nan if value < 0 else value
        assert ours[name] == pytest.approx(expected, abs=1e-12, nan_ok=True), name
    assert 0 < ours['ap'] < 1
    # COCO's AP is the mean of the classes' APs (the classes with ground truth)
    assert np.nanmean(list(ours['per_class_ap'].values())) == pytest.approx(ours['ap'], abs=1e-12)


def test_the_meter_leaves_out_padded_duplicates_and_gathers_nothing_on_one_process():
    meter = DetectionMeter(['cell'])
    hit = (_boxes([[10, 10, 50, 50]], [1], [0.9]), _boxes([[10, 10, 50, 50]], [1]))
    miss = (_boxes([], [], []), _boxes([[100, 100, 140, 140]], [1]))
    meter.update([hit[0], miss[0]], [hit[1], miss[1]], valid=[True, False])  # the miss is a duplicate: left out
    meter.reduce_()
    assert meter.compute()['ap'] == pytest.approx(1.0) and meter.compute()['images'] == 1
    with pytest.raises(RuntimeError, match='after reduce_'):
        meter.update([hit[0]], [hit[1]])
    meter.reset()
    assert meter.compute()['images'] == 0 and math.isnan(meter.compute()['ap'])


def test_mask_ap_matches_the_masks_not_the_boxes():
    """Box and ground truth coincide (box AP 1), but of the object's 50 x 50 pixels the detector's mask holds the top
    31 rows (probability 0.7; the rest of its box 0.2, below the 0.5 threshold): mask IoU 1550 / 2500 = 0.62, a hit at
    IoU 0.50, 0.55, 0.60 and a miss above, so mask AP 0.3, AP50 1, AP75 0; the object is medium by its mask's area."""
    truth = torch.zeros(1, 80, 80, dtype=torch.uint8)
    truth[0, 10:60, 20:70] = 1
    probabilities = torch.zeros(1, 1, 80, 80)
    probabilities[0, 0, 10:60, 20:70] = 0.2
    probabilities[0, 0, 10:41, 20:70] = 0.7
    meter = DetectionMeter(['cell'])
    meter.update([{**_boxes([[20, 10, 70, 60]], [1], [0.9]), 'masks': probabilities}],
                 [{**_boxes([[20, 10, 70, 60]], [1]), 'masks': truth}])
    meter.reduce_()
    metrics = meter.compute()
    assert metrics['ap'] == pytest.approx(1.0) and metrics['mask_ap'] == pytest.approx(0.3, abs=1e-9)
    assert metrics['mask_ap50'] == pytest.approx(1.0) and metrics['mask_ap75'] == 0.0
    assert metrics['mask_ap_medium'] == pytest.approx(0.3, abs=1e-9) and math.isnan(metrics['mask_ap_small'])
    assert metrics['mask_per_class_ap'] == {'cell': pytest.approx(0.3, abs=1e-9)}


def test_no_mask_metrics_without_masks():
    meter = DetectionMeter(['cell'])
    meter.update([_boxes([[0, 0, 9, 9]], [1], [0.5])], [_boxes([[0, 0, 9, 9]], [1])])
    meter.reduce_()
    assert not [name for name in meter.compute() if name.startswith('mask_')]
