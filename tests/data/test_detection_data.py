"""linvit.data.detection: detection samples through albumentations' box-aware pipeline. Boxes follow the pixels
they frame (checked on drawn rectangles), evaluation maps back by one scale, crowds are left out, samples are a
function of (index, seed)."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from linvit.data.coco import read_coco_split
from linvit.data.detection import (
    DETECTION_SHAPE_CLASSES,
    CocoDetectionSet,
    SyntheticShapesDetection,
    build_detection_transforms,
)

ZERO_MEAN, UNIT_STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)


def _bright_box(image):
    """x1, y1, x2, y2 of the pixels above half brightness in a [3, H, W] image whose pixels are in [0, 1]."""
    ys, xs = np.nonzero(image.numpy().max(axis=0) > 0.5)
    return [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]


def _coco_set(root, crowd=False):
    (root / 'annotations').mkdir(parents=True)
    (root / 'train').mkdir()
    image = np.zeros((60, 80, 3), dtype=np.uint8)
    image[10:30, 20:50] = 255  # a white 30 x 20 object at x 20..50, y 10..30
    Image.fromarray(image).save(root / 'train' / 'one.png')
    annotations = [{'id': 1, 'image_id': 1, 'category_id': 3, 'bbox': [20, 10, 30, 20], 'iscrowd': 0}]
    if crowd:
        annotations.append({'id': 2, 'image_id': 1, 'category_id': 3, 'bbox': [0, 40, 80, 20], 'iscrowd': 1})
    (root / 'annotations' / 'instances_train.json').write_text(json.dumps({
        'images': [{'id': 1, 'file_name': 'one.png', 'width': 80, 'height': 60}], 'annotations': annotations,
        'categories': [{'id': 3, 'name': 'panel'}]}))
    return read_coco_split(root, 'train')


def test_evaluation_resizes_the_longer_side_and_boxes_scale_with_the_pixels(tmp_path):
    dataset = CocoDetectionSet(_coco_set(tmp_path), build_detection_transforms(160, ZERO_MEAN, UNIT_STD, train=False))
    image, target = dataset[0]
    assert image.shape == (3, 160, 160)  # 80 x 60 -> 160 x 120, padded below to a square
    torch.testing.assert_close(target['boxes'], torch.tensor([[40.0, 20.0, 100.0, 60.0]]))  # x 2
    assert target['labels'].tolist() == [1]
    assert _bright_box(image) == [40, 20, 100, 60] and image[:, 120:].abs().sum() == 0


def test_training_jitter_moves_boxes_with_the_pixels_they_frame(tmp_path):
    dataset = CocoDetectionSet(_coco_set(tmp_path), build_detection_transforms(64, ZERO_MEAN, UNIT_STD, train=True,
                                                                               scale_range=(0.5, 2.0)))
    checked = 0
    for seed in range(20):
        image, target = dataset[(0, seed)]
        assert image.shape == (3, 64, 64)
        if len(target['boxes']) == 0:  # the crop left the object out
            assert image.max() <= 0.5
            continue
        box = target['boxes'][0].tolist()
        assert np.allclose(box, _bright_box(image), atol=1.5), (seed, box, _bright_box(image))
        checked += 1
    assert checked >= 5


def test_crowd_regions_are_not_training_targets(tmp_path):
    dataset = CocoDetectionSet(_coco_set(tmp_path, crowd=True),
                               build_detection_transforms(80, ZERO_MEAN, UNIT_STD, train=False))
    _, target = dataset[0]
    assert len(target['boxes']) == 1 and '1 boxes' in dataset.describe()


def test_the_built_in_shapes_are_boxed_by_kind_and_repeat_for_a_key():
    dataset = SyntheticShapesDetection(8, 64, seed=3, split='train',
                                       transform=build_detection_transforms(64, ZERO_MEAN, UNIT_STD, train=False))
    assert dataset.class_names == DETECTION_SHAPE_CLASSES == ['circle', 'square']
    for index in range(8):
        raw, boxes, labels, masks = dataset.load(index)
        assert 2 <= len(boxes) <= 4 and set(labels.tolist()) <= {1, 2} and masks is None  # masks=False
        for (x1, y1, x2, y2), label in zip(boxes.astype(int), labels):
            inside = raw[y1:y2, x1:x2].max(axis=2)
            grey = inside[(y2 - y1) // 2, (x2 - x1) // 2]
            covered = (inside == grey).mean()
            # a square fills its box; a circle pi / 4 of it
            assert covered == pytest.approx(1.0 if label == 2 else np.pi / 4, abs=0.08)
    first, again = dataset[(2, 7)], dataset[(2, 7)]
    assert torch.equal(first[0], again[0]) and torch.equal(first[1]['boxes'], again[1]['boxes'])
    other = SyntheticShapesDetection(8, 64, seed=3, split='val',
                                     transform=build_detection_transforms(64, ZERO_MEAN, UNIT_STD, train=False))
    assert not np.array_equal(other.load(0)[0], dataset.load(0)[0])


@pytest.mark.parametrize('height, width', [(240, 320), (400, 200), (180, 480), (101, 37), (7, 999), (64, 64)])
def test_the_evaluation_size_is_the_pipelines_and_detections_map_back_to_the_original(height, width):
    """evaluation_size against albumentations' own resize of an image; a box on the evaluation image, mapped back,
    frames the same pixels of the original; masks come back at the original size."""
    import albumentations as A

    from linvit.data.detection import evaluation_size, to_original_pixels
    resized = A.LongestMaxSize(max_size=64)(image=np.zeros((height, width, 3), dtype=np.uint8))['image']
    assert evaluation_size(height, width, 64) == resized.shape[:2]
    rh, rw = resized.shape[:2]
    found = {'boxes': torch.tensor([[0.0, 0.0, rw, rh], [rw / 4, rh / 2, rw / 2, rh]]), 'labels': torch.tensor([1, 2]),
             'scores': torch.tensor([0.9, 0.5]), 'masks': torch.zeros(2, 1, 64, 64)}
    found['masks'][0, 0, :rh, :rw] = 1  # the whole image, none of the padding
    back = to_original_pixels(found, height, width, 64)
    torch.testing.assert_close(back['boxes'], torch.tensor([[0.0, 0.0, width, height],
                                                            [width / 4, height / 2, width / 2, height]]))
    assert back['masks'].shape == (2, 1, height, width) and bool((back['masks'][0] >= 0.5).all())
    assert back['labels'].tolist() == [1, 2]
