"""linvit.models.detection: the ViT pyramid as torchvision's detector backbone. Its maps are the segmentation
model's for the same weights; each registered detector trains a step (gradients reach the ViT) and detects boxes
in input pixels; the transform leaves images as the data pipeline made them."""
import pytest
import timm
import torch

import linvit  # noqa: F401  (registers linvit_*)
from linvit.models.detection import DETECTORS, PyramidBackbone, build_detector, pyramid_strides
from linvit.models.segmentation import SegmentationModel

KWARGS = dict(depth=4, embed_dim=48, num_heads=3, patch_size=8, img_size=64, dynamic_img_size=True)


def _vit(seed=0):
    torch.manual_seed(seed)
    return timm.create_model('linvit_tiny_patch16_224', **KWARGS)


def _targets():
    return [{'boxes': torch.tensor([[4.0, 6.0, 30.0, 40.0], [36.0, 10.0, 60.0, 28.0]]), 'labels': torch.tensor([1, 2])},
            {'boxes': torch.tensor([[10.0, 12.0, 50.0, 44.0]]), 'labels': torch.tensor([3])}]


def test_the_pyramid_maps_are_the_segmentation_models_for_the_same_weights():
    segmentation = SegmentationModel(_vit(), num_classes=5, neck_dim=32).eval()
    backbone = PyramidBackbone(_vit(seed=1), neck_dim=32).eval()
    shared = {k: v for k, v in segmentation.state_dict().items() if k.startswith(('backbone.', 'neck.'))}
    backbone.load_state_dict(shared, strict=True)  # a segmentation checkpoint's backbone and neck load as they are
    images = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        maps = backbone(images)
        expected = segmentation.forward_features(images)
    assert list(maps) == ['0', '1', '2', '3'] and backbone.out_channels == 32
    for got, want, stride in zip(maps.values(), expected, pyramid_strides(8)):
        assert got.shape == (2, 32, int(64 / stride), int(96 / stride))
        assert torch.equal(got, want)


#: each detector's keyword that keeps every scored box (an untrained detector's scores are low)
KEEP_ALL = {'faster_rcnn': {'box_score_thresh': 0.0}, 'mask_rcnn': {'box_score_thresh': 0.0},
            'retinanet': {'score_thresh': 0.0}, 'fcos': {'score_thresh': 0.0}}


@pytest.mark.parametrize('name', DETECTORS.names())
def test_each_detector_trains_a_step_and_detects_in_input_pixels(name):
    detector = build_detector(_vit(), num_classes=3, detector=name, neck_dim=32, **KEEP_ALL[name])
    targets = _targets()
    if name == 'mask_rcnn':
        for target in targets:
            masks = torch.zeros(len(target['boxes']), 64, 64, dtype=torch.uint8)
            for mask, (x1, y1, x2, y2) in zip(masks, target['boxes'].long().tolist()):
                mask[y1:y2, x1:x2] = 1
            target['masks'] = masks
    images = [torch.randn(3, 64, 64), torch.randn(3, 48, 64)]  # sizes differ: the transform pads, never resizes
    detector.train()
    losses = detector(images, targets)
    assert losses and all(torch.isfinite(loss) for loss in losses.values())
    sum(losses.values()).backward()
    assert detector.backbone.backbone.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    detector.eval()
    with torch.no_grad():
        found = detector(images)
    for image, result in zip(images, found):
        boxes = result['boxes']
        assert len(boxes) > 0 and len(boxes) == len(result['scores']) == len(result['labels'])
        height, width = image.shape[1:]
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all()
        assert ((result['labels'] >= 1) & (result['labels'] <= 3)).all()


def test_the_transform_pads_to_the_coarsest_stride_and_keeps_pixels_and_boxes():
    detector = build_detector(_vit(), num_classes=2, neck_dim=32)
    image = torch.randn(3, 40, 56)
    batch, targets = detector.transform([image], [{'boxes': torch.tensor([[1.0, 2.0, 30.0, 33.0]]),
                                                   'labels': torch.tensor([1])}])
    assert batch.tensors.shape == (1, 3, 48, 64) and batch.image_sizes == [(40, 56)]  # multiples of 16 = 2 x patch
    assert torch.equal(batch.tensors[0, :, :40, :56], image) and batch.tensors[0, :, 40:].abs().sum() == 0
    assert torch.equal(targets[0]['boxes'], torch.tensor([[1.0, 2.0, 30.0, 33.0]]))


def test_unknown_detectors_and_class_counts_are_refused():
    with pytest.raises(ValueError, match="unknown detection.detector 'faster-rcnn'"):
        build_detector(_vit(), num_classes=2, detector='faster-rcnn')
    with pytest.raises(ValueError, match='num_classes >= 1'):
        build_detector(_vit(), num_classes=0)


def test_a_detector_runs_tiled_on_an_image_larger_than_its_tiles():
    from linvit.inference import detect_tiled

    detector = build_detector(_vit(), num_classes=3, neck_dim=32, box_score_thresh=0.0).eval()
    image = torch.randn(3, 100, 130)
    with torch.no_grad():
        found = detect_tiled(detector, image, tile=64, overlap=16)
    boxes = found['boxes']
    assert len(boxes) > 0 and (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= 130).all() and (boxes[:, 3] <= 100).all()
    assert (found['scores'][:-1] >= found['scores'][1:]).all()  # by descending score
