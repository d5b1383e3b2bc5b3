"""Instance masks for Mask R-CNN: COCO polygons and run-length encodings decode to the pixels they outline, masks
follow their pixels through the training jitter and leave with their boxes, the built-in shapes' masks are the
painted pixels, and a missing or malformed segmentation is one line."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils

from linvit.data.base import DataError, seed_words
from linvit.data.coco import instance_masks, read_coco_split
from linvit.data.detection import CocoDetectionSet, SyntheticShapesDetection, build_detection_transforms
from linvit.data.synthetic_seg import render_shapes

ZERO_MEAN, UNIT_STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)


def _write_set(root, annotations, image=None):
    (root / 'annotations').mkdir(parents=True, exist_ok=True)
    (root / 'train').mkdir(exist_ok=True)
    if image is None:
        image = np.zeros((60, 80, 3), dtype=np.uint8)
        image[10:30, 20:50] = 255  # the white object: x 20..50, y 10..30
        image[40:56, 60:76] = 255  # the second: x 60..76, y 40..56
    Image.fromarray(image).save(root / 'train' / 'one.png')
    (root / 'annotations' / 'instances_train.json').write_text(json.dumps({
        'images': [{'id': 1, 'file_name': 'one.png', 'width': 80, 'height': 60}], 'annotations': annotations,
        'categories': [{'id': 3, 'name': 'panel'}]}))


def _white(index, x, y, w, h, segmentation):
    return {'id': index, 'image_id': 1, 'category_id': 3, 'bbox': [x, y, w, h], 'iscrowd': 0,
            'segmentation': segmentation}


def _rle_of(x, y, w, h):
    pixels = np.zeros((60, 80), dtype=np.uint8, order='F')
    pixels[y:y + h, x:x + w] = 1
    rle = mask_utils.encode(pixels)
    return {'size': rle['size'], 'counts': rle['counts'].decode()}  # as a JSON file holds it


def test_polygons_and_run_lengths_decode_to_the_pixels_they_outline(tmp_path):
    _write_set(tmp_path, [_white(1, 20, 10, 30, 20, [[20, 10, 50, 10, 50, 30, 20, 30]]),
                          _white(2, 60, 40, 16, 16, _rle_of(60, 40, 16, 16))])
    image = read_coco_split(tmp_path, 'train', masks=True).images[0]
    masks = instance_masks(image)
    assert masks.shape == (2, 60, 80) and masks.dtype == np.uint8
    expected = np.zeros((2, 60, 80), dtype=np.uint8)
    expected[1, 40:56, 60:76] = 1
    assert np.array_equal(masks[1], expected[1])
    # pycocotools rasterises a polygon's edge pixels by their centres: the 30 x 20 rectangle covers x 20..50, y 10..30
    # give or take its right and bottom edge
    inside = np.zeros((60, 80), dtype=bool)
    inside[10:30, 20:50] = True
    assert masks[0][inside].all() and not masks[0][~np.pad(inside, ((0, 1), (0, 1)))[:60, :80]].any()


def test_masks_follow_their_pixels_through_the_jitter_and_leave_with_their_boxes(tmp_path):
    _write_set(tmp_path, [_white(1, 20, 10, 30, 20, _rle_of(20, 10, 30, 20)),
                          _white(2, 60, 40, 16, 16, _rle_of(60, 40, 16, 16))])
    dataset = CocoDetectionSet(read_coco_split(tmp_path, 'train', masks=True),
                               build_detection_transforms(48, ZERO_MEAN, UNIT_STD, train=True, scale_range=(0.8, 2.0)),
                               masks=True)
    counts = set()
    for seed in range(25):
        image, target = dataset[(0, seed)]
        masks = target['masks']
        assert masks.dtype == torch.uint8 and masks.shape == (len(target['boxes']), 48, 48)
        counts.add(len(masks))
        # the image is resized with interpolation, the masks with nearest neighbours (twice: LongestMaxSize, the jitter)
        bright = image.max(dim=0).values > 0.5
        covered = masks.amax(dim=0).bool() if len(masks) else torch.zeros_like(bright)
        assert (bright & covered).sum() >= 0.8 * (bright | covered).sum()
        for mask, box in zip(masks, target['boxes'].tolist()):
            ys, xs = torch.nonzero(mask, as_tuple=True)
            extent = [xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1]
            assert np.abs(np.subtract(extent, box)).max() <= 2.0, (extent, box)
    assert {1, 2} <= counts  # crops that kept one of the two objects, and both


def test_the_shapes_masks_are_the_painted_pixels():
    dataset = SyntheticShapesDetection(3, 64, seed=0, split='val', masks=True,
                                       transform=build_detection_transforms(64, ZERO_MEAN, UNIT_STD, train=False))
    for index in range(3):
        _, target = dataset[(index, 0)]
        rng = np.random.default_rng([*seed_words(0), 1, index])
        _, painted, _ = render_shapes(rng, 64, key_colour=int(rng.integers(2)))  # class ids: shapes > 0
        masks = target['masks']
        assert len(masks) == len(target['boxes']) >= 2 and masks.sum(dim=(1, 2)).min() > 0
        assert torch.equal(masks.sum(dim=0), torch.from_numpy(painted > 0).to(torch.uint8))  # disjoint, all painted


@pytest.mark.parametrize('segmentation, words', [
    (None, "annotation id 1 has segmentation None; Mask R-CNN needs each object's mask"),
    ([[20, 10, 50, 10]], 'has segmentation [[20, 10, 50, 10]]; Mask R-CNN needs'),
    ({'size': [10, 10], 'counts': 'abc'}, "run-length segmentation with size [10, 10]; expected {'size': [60, 80]"),
])
def test_a_missing_or_malformed_segmentation_is_one_line(tmp_path, segmentation, words):
    _write_set(tmp_path, [_white(1, 20, 10, 30, 20, segmentation)])
    read_coco_split(tmp_path, 'train')  # boxes alone need no masks
    with pytest.raises(DataError, match='instances_train.json: ') as error:
        read_coco_split(tmp_path, 'train', masks=True)
    assert words in str(error.value) and '\n' not in str(error.value)
