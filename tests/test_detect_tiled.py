"""linvit.inference.detect_tiled: detection in overlapping tiles equals the whole image's for a detector that sees
only an object's own pixels (a connected-components box finder), with objects cut by tile borders and lying in
overlaps; the tile cores partition the image."""
import cv2
import numpy as np
import pytest
import torch

from linvit.inference import detect_tiled, tile_cores, window_starts


def box_finder(images):
    """A local detector: one box per bright connected region (its class: 1 for squares, 2 for wider shapes),
    scored by its mean brightness."""
    results = []
    for image in images:
        bright = (image[0].numpy() > 0.5).astype(np.uint8)
        count, _, stats, _ = cv2.connectedComponentsWithStats(bright, connectivity=4)
        boxes, scores, labels = [], [], []
        for x, y, w, h, _ in stats[1:count]:
            boxes.append([x, y, x + w, y + h])
            scores.append(float(image[0, y:y + h, x:x + w].mean()))
            labels.append(1 if w == h else 2)
        results.append({'boxes': torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                        'scores': torch.tensor(scores), 'labels': torch.tensor(labels, dtype=torch.int64)})
    return results


def _scene(seed, height=230, width=300, objects=14, largest=30):
    """Non-touching bright rectangles (sides 6..largest) of different brightness on black."""
    rng = np.random.default_rng(seed)
    image = torch.zeros(3, height, width)
    taken = torch.zeros(height, width, dtype=torch.bool)
    placed = 0
    while placed < objects:
        h, w = (int(v) for v in rng.integers(6, largest + 1, 2))
        y, x = int(rng.integers(0, height - h)), int(rng.integers(0, width - w))
        if taken[max(y - 2, 0):y + h + 2, max(x - 2, 0):x + w + 2].any():
            continue
        taken[y:y + h, x:x + w] = True
        image[:, y:y + h, x:x + w] = float(rng.uniform(0.6, 1.0))
        placed += 1
    return image


def _sorted(found):
    order = sorted(range(len(found['boxes'])), key=lambda i: found['boxes'][i].tolist())
    return {key: value[order] for key, value in found.items()}


@pytest.mark.parametrize('seed', range(4))
def test_tiled_detection_finds_the_whole_images_boxes(seed):
    image = _scene(seed)
    whole = _sorted(box_finder(image[None])[0])
    tiled = _sorted(detect_tiled(box_finder, image, tile=96, overlap=40, batch_size=3))
    assert len(tiled['boxes']) == len(whole['boxes']) == 14
    torch.testing.assert_close(tiled['boxes'], whole['boxes'], atol=1.0, rtol=0)  # matched within a pixel
    assert torch.equal(tiled['labels'], whole['labels'])
    torch.testing.assert_close(tiled['scores'], whole['scores'])


def test_objects_cut_by_a_tile_border_are_found_once_whole():
    image = torch.zeros(3, 100, 160)
    image[:, 40:60, 45:75] = 0.9  # crosses the border of the first 64 px tile (columns 0..64)
    found = detect_tiled(box_finder, image, tile=64, overlap=32)
    assert found['boxes'].tolist() == [[45.0, 40.0, 75.0, 60.0]]


def test_an_image_smaller_than_a_tile_is_one_tile_and_bad_overlaps_are_refused():
    image = _scene(0, height=60, width=80, objects=3, largest=12)
    assert len(detect_tiled(box_finder, image, tile=96, overlap=16)['boxes']) == 3
    with pytest.raises(ValueError, match='overlap must be in 0..95'):
        detect_tiled(box_finder, image, tile=96, overlap=96)
    with pytest.raises(ValueError, match=r'one image \[C, H, W\]'):
        detect_tiled(box_finder, image[None], tile=96, overlap=16)


@pytest.mark.parametrize('size, window, overlap', [(300, 96, 40), (97, 96, 10), (96, 96, 0), (1000, 128, 64)])
def test_tile_cores_partition_the_dimension_inside_their_windows(size, window, overlap):
    starts = window_starts(size, window, window - overlap)
    cores = tile_cores(size, window, starts)
    assert cores[0][0] == 0 and cores[-1][1] == size
    assert all(hi == lo for (_, hi), (lo, _) in zip(cores, cores[1:]))
    assert all(start <= lo < hi <= start + window for start, (lo, hi) in zip(starts, cores))
