"""linvit.data.fmnist_hires, segmentation, on tiny IDX files written here: the images/ + masks/ layout, classes.txt,
the manifest, every item's pixels labelled class + 1 in drawing order (recomputed here from the manifest),
determinism, and reading the result back with linvit's segmentation folder dataset."""
import csv
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from PIL import Image

from linvit.data import build_segmentation_datasets
from linvit.data import fmnist_hires as hires
from linvit.data.fmnist_hires import FmnistHiresSpec, write_dataset

THRESHOLD = 10          # the documented paint threshold: item pixels <= 10 are transparent
ITEMS_PER_CLASS = 2


def fake_items() -> tuple[np.ndarray, np.ndarray]:
    """uint8 [20, 28, 28] items and their labels [20]: class c is a square of grey 60 + 19 c whose size depends
    on c, with a faint 5-grey rim (below the paint threshold) around it."""
    labels = np.repeat(np.arange(10, dtype=np.uint8), ITEMS_PER_CLASS)
    images = np.zeros((len(labels), 28, 28), dtype=np.uint8)
    for i, label in enumerate(labels):
        lo, hi = 4 + label // 2 + i % 2, 24 - label // 3
        images[i, lo - 1:hi + 1, lo - 1:hi + 1] = 5
        images[i, lo:hi, lo:hi] = 60 + 19 * label
    return images, labels


def write_idx(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = fake_items()
    for prefix in ('train', 't10k'):
        for stem, array in ((f'{prefix}-images-idx3-ubyte', images), (f'{prefix}-labels-idx1-ubyte', labels)):
            header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f'>{array.ndim}I', *array.shape)
            (folder / stem).write_bytes(header + array.tobytes())


def write_seg_set(tmp_path, out_name='out', workers=1):
    """3 train and 2 val images of 96 px with 2-4 items each."""
    write_idx(tmp_path / 'idx')
    out = tmp_path / out_name
    spec = FmnistHiresSpec(out=out, task='segmentation', idx_dir=tmp_path / 'idx', size=96, train_images=3,
                           val_images=2, items_per_image=(2, 4), workers=workers)
    write_dataset(spec, log=lambda line: None)
    return out


def read_manifest(out: Path) -> list[dict]:
    with open(out / 'manifest.csv') as f:
        return list(csv.DictReader(f))


def expected_mask(rows: list[dict], size: int) -> np.ndarray:
    """Paint the manifest's items in drawing order: each labels its upscaled pixels above THRESHOLD."""
    images, _ = fake_items()
    mask = np.zeros((size, size), dtype=np.uint8)
    for row in sorted(rows, key=lambda r: int(r['item'])):
        side, top, left = int(row['side']), int(row['top']), int(row['left'])
        item = Image.fromarray(images[int(row['source_index'])])
        patch = np.asarray(item.resize((side, side), Image.Resampling.BILINEAR))
        mask[top:top + side, left:left + side][patch > THRESHOLD] = int(row['label']) + 1
    return mask


def test_writes_images_masks_classes_and_a_manifest_of_items(tmp_path):
    out = write_seg_set(tmp_path)
    assert (out / 'classes.txt').read_text().splitlines() == ['background', *hires.CLASS_NAMES]
    rows = read_manifest(out)
    _, labels = fake_items()
    for split, count in (('train', 3), ('val', 2)):
        names = sorted(p.name for p in (out / split / 'images').iterdir())
        assert names == sorted(p.name for p in (out / split / 'masks').iterdir()) and len(names) == count
        for name in names:
            image = Image.open(out / split / 'images' / name)
            mask_file = Image.open(out / split / 'masks' / name)
            assert image.mode == 'L' and mask_file.mode == 'L' and image.size == mask_file.size == (96, 96)
            mask, canvas = np.asarray(mask_file), np.asarray(image)
            items = [r for r in rows if r['path'] == f'{split}/images/{name}']
            assert 2 <= len(items) <= 4 and all(r['mask_path'] == f'{split}/masks/{name}' for r in items)
            assert mask.max() <= 10
            np.testing.assert_array_equal(mask, expected_mask(items, 96))
            for row in items:
                label = int(row['label'])
                assert row['class_name'] == hires.CLASS_NAMES[label] and int(row['mask_value']) == label + 1
                assert labels[int(row['source_index'])] == label
            # the last item is on top: its solid square's inside shows its grey and its label
            last = max(items, key=lambda r: int(r['item']))
            top, left, side = int(last['top']), int(last['left']), int(last['side'])
            centre = (top + side // 2, left + side // 2)
            assert mask[centre] == int(last['label']) + 1 and canvas[centre] == 60 + 19 * int(last['label'])
            # background outside every item's box
            boxes = np.zeros((96, 96), dtype=bool)
            for r in items:
                boxes[int(r['top']):int(r['top']) + int(r['side']), int(r['left']):int(r['left']) + int(r['side'])] = 1
            assert np.all(mask[~boxes] == 0) and (mask[boxes] == 0).any()     # the items' black surround is background


def test_the_paint_threshold_is_the_documented_one():
    assert hires.SEG_PAINT_THRESHOLD == THRESHOLD


def test_the_same_spec_writes_the_same_files_with_any_worker_count(tmp_path):
    out = write_seg_set(tmp_path)
    again = write_seg_set(tmp_path, 'again', workers=2)
    for split_file in ('train/images/train-00001.png', 'train/masks/train-00001.png', 'val/masks/val-00000.png'):
        assert (out / split_file).read_bytes() == (again / split_file).read_bytes()
    assert (out / 'manifest.csv').read_bytes() == (again / 'manifest.csv').read_bytes()


def test_output_reads_back_as_a_segmentation_folder(tmp_path):
    out = write_seg_set(tmp_path)
    aug = SimpleNamespace(scale_range=[0.75, 1.5], hflip=0.5, vflip=0.0, color_jitter=0.0)
    cfg = SimpleNamespace(name='folder', root=str(out), img_size=64, ignore_index=255, num_classes=None,
                          max_bad_fraction=0.0, aug=aug)
    train, val, names = build_segmentation_datasets(cfg, (0.5,) * 3, (0.5,) * 3)
    assert names == ['background', *hires.CLASS_NAMES] and len(train) == 3 and len(val) == 2
    image, mask = train[(0, 0)]
    assert image.shape == (3, 64, 64) and mask.shape == (64, 64)
    _, val_mask = val[0]
    np.testing.assert_array_equal(val_mask.numpy(), np.asarray(Image.open(out / 'val/masks/val-00000.png')))
