"""task=detection through train(): the built-in shapes and a COCO-format folder train end to end; the report's AP
is what the saved weights give when evaluated by hand (the detector rebuilt from its parts, COCO AP of its boxes);
pictures are drawn."""
import json

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from safetensors.torch import load_file
from tiny_run import TINY_DET, TINY_MODEL

import linvit  # noqa: F401  (registers linvit_*)
from linvit.data.detection import SyntheticShapesDetection, build_detection_transforms
from linvit.engine import ConfigError, load_config, train
from linvit.engine.loading import load_trained
from linvit.engine.metrics import coco_box_metrics
from linvit.models.detection import build_detector
from linvit.predict import collect_inputs, detect_images, torch_predictor

pytestmark = pytest.mark.integration  # trains or starts interpreters


def test_the_shapes_train_end_to_end_and_the_report_is_the_saved_detectors_ap(tmp_path):
    out = tmp_path / 'run'
    metrics = train(load_config(None, [*TINY_MODEL, *TINY_DET, f'output_dir={out}']))
    assert set(metrics) >= {'ap', 'ap50', 'ap75', 'ap_small', 'per_class_ap', 'images'}
    assert metrics['images'] == 6 and set(metrics['per_class_ap']) == {'circle', 'square'}
    assert json.loads((out / 'metrics.json').read_text())['ap'] == metrics['ap']
    assert sorted(p.name for p in (out / 'pictures').iterdir())[-1] == 'val_step000008.png'
    # the saved weights, in a detector built by hand, scored by hand on the same validation images
    vit = timm.create_model('linvit_tiny_patch16_224', depth=2, embed_dim=48, num_heads=3, patch_size=8, img_size=64,
                            num_classes=0, dynamic_img_size=True)
    detector = build_detector(vit, 2, neck_dim=32, box_score_thresh=0.0).eval()
    detector.load_state_dict(load_file(out / 'model.safetensors'))
    cfg = timm.data.resolve_data_config({}, model=vit)
    val = SyntheticShapesDetection(6, 64, seed=0, split='val',
                                   transform=build_detection_transforms(64, cfg['mean'], cfg['std'], train=False))
    samples = [val[(i, 0)] for i in range(6)]
    with torch.no_grad():
        found = detector(torch.stack([image for image, _ in samples]))
    by_hand = coco_box_metrics(found, [t for _, t in samples], ['circle', 'square'])
    assert metrics['ap'] == pytest.approx(by_hand['ap'], abs=1e-9)
    assert metrics['ap50'] == pytest.approx(by_hand['ap50'], abs=1e-9)


#: the set's categories: ids with a gap, listed out of order (labels follow the sorted ids: hole 1, panel 2)
CATEGORIES = [{'id': 7, 'name': 'panel'}, {'id': 3, 'name': 'hole'}]


def _coco_folder(root):
    """Images of 70 x 50 px (evaluated at 64: another scale) with a bright panel (id 7) and a dark hole (id 3)."""
    rng = np.random.default_rng(0)
    (root / 'annotations').mkdir(parents=True)
    for split, count in (('train', 8), ('val', 3)):
        (root / split).mkdir()
        images, annotations = [], []
        for index in range(count):
            pixels = rng.integers(60, 120, (50, 70, 3)).astype(np.uint8)
            x, y = int(rng.integers(0, 40)), int(rng.integers(0, 25))
            pixels[y:y + 20, x:x + 25] = 250
            pixels[40:48, 2:12] = 0
            Image.fromarray(pixels).save(root / split / f'{index}.png')
            images.append({'id': 10 + index, 'file_name': f'{index}.png', 'width': 70, 'height': 50})
            for category, (bx, by, bw, bh) in ((7, (x, y, 25, 20)), (3, (2, 40, 10, 8))):
                annotations.append({'id': len(annotations) + 1, 'image_id': 10 + index, 'category_id': category,
                                    'bbox': [bx, by, bw, bh], 'area': bw * bh, 'iscrowd': 0,
                                    'segmentation': [[bx, by, bx + bw, by, bx + bw, by + bh, bx, by + bh]]})
        (root / 'annotations' / f'instances_{split}.json').write_text(json.dumps(
            {'images': images, 'annotations': annotations, 'categories': CATEGORIES}))


def _cocoeval_of_saved_weights(run, data):
    """The run's model.safetensors on the val images at 64 px (evaluation's pipeline), its boxes scaled back to the
    images' 70 x 50 pixels by hand, labels turned into the file's ids by hand, and COCOeval against the file."""
    trained = load_trained(str(run))
    transform = build_detection_transforms(64, trained.mean, trained.std, train=False)
    results = []
    for index in range(3):
        pixels = np.asarray(Image.open(data / 'val' / f'{index}.png').convert('RGB'))
        with torch.no_grad():
            found = trained.model(transform(image=pixels, bboxes=np.zeros((0, 4)), labels=[], objects=[])['image']
                                  [None])[0]
        for (x1, y1, x2, y2), label, score in zip(found['boxes'].tolist(), found['labels'].tolist(),
                                                  found['scores'].tolist()):
            x1, x2, y1, y2 = x1 * 70 / 64, x2 * 70 / 64, y1 * 50 / 46, y2 * 50 / 46  # 70 x 50 was resized to 64 x 46
            results.append({'image_id': 10 + index, 'category_id': [3, 7][label - 1], 'score': score,
                            'bbox': [x1, y1, x2 - x1, y2 - y1]})
    ground_truth = COCO(str(data / 'annotations' / 'instances_val.json'))
    evaluation = COCOeval(ground_truth, ground_truth.loadRes(results), 'bbox')
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    return evaluation.stats


@pytest.mark.parametrize('detector', ['retinanet', 'mask_rcnn'])
def test_a_coco_folder_trains_end_to_end(tmp_path, detector):
    """A single-stage detector on boxes, and Mask R-CNN on the polygons: its report adds mask AP. The report's box AP
    is COCOeval's on the annotation file for the saved weights' boxes in the images' own pixels; the run records the
    set's category ids, and its detections.json speaks them (with the file's image ids). The Mask R-CNN run then
    exports whole (``_exports_whole_and_onnxruntime_finds_its_boxes``): one Mask R-CNN trained for both."""
    data, run = tmp_path / 'data', tmp_path / 'run'
    _coco_folder(data)
    metrics = train(load_config(None, [*TINY_MODEL, *TINY_DET, 'data.name=folder', f'data.root={data}',
                                       f'detection.detector={detector}', f'output_dir={run}']))
    assert metrics['images'] == 3 and list(metrics['per_class_ap']) == ['hole', 'panel']
    assert 0 <= metrics['ap'] <= 1
    masks = detector == 'mask_rcnn'
    assert ('mask_ap' in metrics) == masks and (not masks or 0 <= metrics['mask_ap'] <= 1)
    assert ('mask_per_class_ap' in json.loads((run / 'metrics.json').read_text())) == masks
    assert 'category_ids:\n  - 3\n  - 7\n' in (run / 'config.yaml').read_text()
    if masks:
        _exports_whole_and_onnxruntime_finds_its_boxes(run, masks=True)
        return
    stats = _cocoeval_of_saved_weights(run, data)
    assert metrics['ap'] == pytest.approx(stats[0], abs=1e-6) and metrics['ap50'] == pytest.approx(stats[1], abs=1e-6)

    items, _ = collect_inputs([str(data / 'val')])
    detect_images(torch_predictor(str(run)), items, str(tmp_path / 'boxes'),
                  annotations=str(data / 'annotations' / 'instances_val.json'))
    written = json.loads((tmp_path / 'boxes' / 'detections.json').read_text())
    assert sorted((c['id'], c['name']) for c in written['categories']) == [(3, 'hole'), (7, 'panel')]
    assert sorted(image['id'] for image in written['images']) == [10, 11, 12]
    assert {a['category_id'] for a in written['annotations']} <= {3, 7} and written['annotations']


def test_an_unknown_detector_a_compiled_step_and_the_cache_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match='detection.detector'):
        load_config(None, [*TINY_MODEL, *TINY_DET, 'detection.detector=yolo'])
    with pytest.raises(ConfigError, match='task=detection trains eagerly.*train.compile=false'):
        train(load_config(None, [*TINY_MODEL, *TINY_DET, 'train.compile=true', f'output_dir={tmp_path}']))
    with pytest.raises(ConfigError, match='data.cache=true does not serve task=detection.*set data.cache=false'):
        train(load_config(None, [*TINY_MODEL, *TINY_DET, 'data.cache=true', f'output_dir={tmp_path / "c"}']))


def test_a_detection_run_exports_its_pyramid_and_the_heads_on_the_onnx_maps_find_the_same_boxes(tmp_path, shared_run):
    """The exported part: onnxruntime's maps (checked by export_onnx at three sizes) fed to the trained detector's
    own RPN and box heads give the boxes the PyTorch detector gives, on an image the patch does not divide. The hub
    export and predict.py's reading of a features file are refused in one line."""
    from torchvision.models.detection.image_list import ImageList

    from linvit.engine.hub import HubExportError, export_hub_folder
    from linvit.export import export_onnx, load_export_source, ort_session, read_metadata
    from linvit.predict import load_predictor

    run = shared_run('det', tmp_path / 'run')
    source = load_export_source(str(run), features=True)
    assert source.default_out == str(run / 'features.onnx')
    report = export_onnx(source.model, source.default_out, img_size=source.img_size, metadata=source.metadata)
    assert report.ok and len(report.checks) == 3 and {(c.height, c.width) for c in report.checks} >= {(64, 64)}
    meta = read_metadata(source.default_out)
    assert meta['part'] == 'features' and meta['strides'] == [2.0, 4.0, 8.0, 16.0] and meta['input_multiple'] == 16
    assert meta['class_names'] == ['circle', 'square'] and meta['task'] == 'detection'

    detector = build_detector(timm.create_model('linvit_tiny_patch16_224', depth=2, embed_dim=48, num_heads=3,
                                                patch_size=8, img_size=64, num_classes=0, dynamic_img_size=True),
                              2, neck_dim=32, box_score_thresh=0.0).eval()
    detector.load_state_dict(load_file(run / 'model.safetensors'))
    image = torch.randn(1, 3, 60, 70, generator=torch.Generator().manual_seed(3))
    maps = ort_session(source.default_out).run(None, {'images': image.numpy()})
    assert [m.shape for m in maps] == [(1, 32, 32, 40), (1, 32, 16, 20), (1, 32, 8, 10), (1, 32, 4, 5)]
    with torch.no_grad():
        expected = detector(image)[0]
        features = {str(level): torch.from_numpy(m) for level, m in enumerate(maps)}
        padded = ImageList(torch.nn.functional.pad(image, (0, 10, 0, 4)), [(60, 70)])
        proposals, _ = detector.rpn(padded, features)
        got = detector.roi_heads(features, proposals, padded.image_sizes)[0][0]
    assert len(expected['boxes']) > 0 and got['boxes'].shape == expected['boxes'].shape
    torch.testing.assert_close(got['boxes'], expected['boxes'], atol=1e-3, rtol=0)
    assert torch.equal(got['labels'], expected['labels'])

    with pytest.raises(ValueError, match='feature pyramid .* not its predictions: predict with the run'):
        load_predictor(source.default_out)
    with pytest.raises(HubExportError, match='is not a timm model') as error:
        export_hub_folder(str(run))
    assert 'ONNX' not in str(error.value) and '\n' not in str(error.value)


def _exports_whole_and_onnxruntime_finds_its_boxes(run, masks: bool):
    """torchvision's route (the TorchScript exporter) at the training size: on a shapes image the file finds the
    PyTorch detector's boxes, labels and scores (and Mask R-CNN's file has masks). Any size or batch, float16 or
    --latency get one line each."""
    from linvit.export import export_onnx, load_export_source, measure_latency, ort_session, read_metadata
    from linvit.predict import load_predictor

    source = load_export_source(str(run))
    path = str(run / 'model.onnx')
    with pytest.raises(ValueError, match='exports at one image size .*--no-dynamic-size .*or --features'):
        export_onnx(source.model, path, img_size=source.img_size, metadata=source.metadata)
    with pytest.raises(ValueError, match='one float32 image at a time: pass --no-dynamic-batch'):
        export_onnx(source.model, path, img_size=source.img_size, dynamic_size=False, metadata=source.metadata)
    report = export_onnx(source.model, path, img_size=source.img_size, dynamic_size=False, dynamic_batch=False,
                         metadata=source.metadata)
    assert report.ok and [(c.height, c.width) for c in report.checks] == [(64, 64), (64, 64)]
    outputs = {name: index for index, name in enumerate(read_metadata(path)['outputs'])}
    assert read_metadata(path)['part'] == 'detector'
    assert set(outputs) == {'boxes', 'labels', 'scores', *({'masks'} if masks else ())}
    image, _ = SyntheticShapesDetection(1, 64, seed=5, split='val', transform=build_detection_transforms(
        64, source.metadata['mean'], source.metadata['std'], train=False))[(0, 0)]
    with torch.no_grad():
        expected = source.model(image[None])[0]
    found = ort_session(path).run(None, {'images': image[None].numpy()})
    boxes, labels, scores = (found[outputs[name]] for name in ('boxes', 'labels', 'scores'))
    # a barely trained detector scores many boxes alike: two runtimes may order (or cut) near-equal scores apart, so
    # the sorted scores agree, and every box scored clearly above the lowest is one of PyTorch's with its label
    assert len(boxes) == len(expected['boxes']) > 0
    torch.testing.assert_close(torch.from_numpy(scores).sort().values, expected['scores'].sort().values, atol=1e-4,
                               rtol=0)
    clear = scores > float(expected['scores'].min()) + 1e-3
    assert clear.sum() >= 3
    for box, label in zip(boxes[clear], labels[clear]):
        same = expected['boxes'][expected['labels'] == int(label)]
        assert (same - torch.from_numpy(box)).abs().amax(dim=1).min() < 1e-3
    with pytest.raises(ValueError, match='--latency times models that compile'):
        measure_latency(source.model, path, [(64, 64)])
    with pytest.raises(ValueError, match='a whole detector for one image size .*predict with the run'):
        load_predictor(path)
    return source


def test_a_whole_detector_exports_at_one_size_and_onnxruntime_finds_its_boxes(tmp_path, shared_run):
    """Faster R-CNN, the default detector (the session's shapes run): ``_exports_whole_and_onnxruntime_finds_its_boxes``
    (Mask R-CNN: on its COCO-folder run, test_a_coco_folder_trains_end_to_end), and another size than the training
    one: the position embedding is resampled for it before the trace (the same step for every detector)."""
    from linvit.export import export_onnx

    source = _exports_whole_and_onnxruntime_finds_its_boxes(shared_run('det', tmp_path / 'run'), masks=False)
    other = export_onnx(source.model, tmp_path / 'other.onnx', img_size=(48, 80), dynamic_size=False,
                        dynamic_batch=False)
    assert other.ok and [(c.height, c.width) for c in other.checks] == [(48, 80), (48, 80)]
