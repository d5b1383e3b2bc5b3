"""linvit.data.fmnist_hires, classification, on tiny IDX files written here (no Debian package needed): IDX parsing
and its errors, the ImageFolder layout, counts, sizes, the item's pixels on the canvas, and reading the result back
with linvit."""
import csv
import gzip
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from linvit.data import build_classification_datasets
from linvit.data import fmnist_hires as hires
from linvit.data.fmnist_hires import FmnistHiresSpec, write_dataset

ITEM_VALUE = 200          # every test item is a solid square of this grey, on black
ITEM_ROWS = slice(6, 22)  # ... over rows/cols 6..21 of the 28x28 item


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of a uint8 array: 0, 0, type 0x08, ndim, big-endian dims, values."""
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f'>{array.ndim}I', *array.shape) + array.tobytes()


def write_fake_fmnist(folder: Path, per_class: int = 3, gz: bool = True) -> None:
    """Train and t10k IDX files with ``per_class`` items of each of the 10 classes."""
    folder.mkdir(parents=True, exist_ok=True)
    labels = np.repeat(np.arange(10, dtype=np.uint8), per_class)
    images = np.zeros((len(labels), 28, 28), dtype=np.uint8)
    images[:, ITEM_ROWS, ITEM_ROWS] = ITEM_VALUE
    for prefix in ('train', 't10k'):
        for stem, array in ((f'{prefix}-images-idx3-ubyte', images), (f'{prefix}-labels-idx1-ubyte', labels)):
            data = idx_bytes(array)
            if gz:
                (folder / f'{stem}.gz').write_bytes(gzip.compress(data))
            else:
                (folder / stem).write_bytes(data)


def small_set(out: Path, idx_dir: Path, workers: int = 1, **counts) -> FmnistHiresSpec:
    """A 64 px classification spec: 2 train and 1 val image per class unless ``counts`` says otherwise."""
    counts = {'train_per_class': 2, 'val_per_class': 1, **counts}
    return FmnistHiresSpec(out=out, idx_dir=idx_dir, size=64, workers=workers, **counts)


@pytest.mark.parametrize('gz', [True, False])
def test_read_idx_round_trip(tmp_path, gz):
    write_fake_fmnist(tmp_path, per_class=2, gz=gz)
    images, labels = hires.load_split(tmp_path, 'val')
    assert images.shape == (20, 28, 28) and images.dtype == np.uint8 and images[0, 10, 10] == ITEM_VALUE
    np.testing.assert_array_equal(labels, np.repeat(np.arange(10), 2))


def test_read_idx_rejects_bad_headers(tmp_path):
    bad_magic = tmp_path / 'a'
    bad_magic.write_bytes(b'\x01\x02\x08\x01' + b'\x00' * 8)
    with pytest.raises(ValueError, match='bad magic number 01020801'):
        hires.read_idx(bad_magic, ndim=1)
    wrong_ndim = tmp_path / 'b'
    wrong_ndim.write_bytes(idx_bytes(np.zeros((2, 3), dtype=np.uint8)))
    with pytest.raises(ValueError, match='2 dimensions; expected unsigned bytes .* with 3 dimensions'):
        hires.read_idx(wrong_ndim, ndim=3)
    short = tmp_path / 'c'
    short.write_bytes(idx_bytes(np.zeros((4,), dtype=np.uint8))[:-1])
    with pytest.raises(ValueError, match=r'shape \(4,\) \(4 values\) but the file holds 3'):
        hires.read_idx(short, ndim=1)


def test_missing_idx_files_say_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        hires.find_idx_file(tmp_path / 'none', hires.IDX_STEMS['train'][0])
    message = str(error.value)
    assert 'sudo apt-get install dataset-fashion-mnist' in message and '--idx-dir' in message
    assert str(tmp_path / 'none') in message
    with pytest.raises(FileNotFoundError, match='dataset-fashion-mnist'):
        write_dataset(small_set(tmp_path / 'out', tmp_path / 'none'))


def test_writes_the_imagefolder_layout_with_the_items_on_the_canvas(tmp_path):
    idx_dir, out = tmp_path / 'idx', tmp_path / 'out'
    write_fake_fmnist(idx_dir, per_class=3)
    assert 'data.root=' in write_dataset(small_set(out, idx_dir), log=lambda line: None)
    for split, per_class in (('train', 2), ('val', 1)):
        assert sorted(p.name for p in (out / split).iterdir()) == sorted(hires.CLASS_NAMES)
        for name in hires.CLASS_NAMES:
            assert len(list((out / split / name).glob('*.png'))) == per_class
    with open(out / 'manifest.csv') as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 30
    for row in rows:
        canvas = np.asarray(Image.open(out / row['path']))
        assert canvas.shape == (64, 64) and canvas.dtype == np.uint8
        assert row['class_name'] == hires.CLASS_NAMES[int(row['label'])] and f"/{row['class_name']}/" in row['path']
        top, left, side = int(row['top']), int(row['left']), int(row['side'])
        assert 56 <= side <= 58 and 0 <= top <= 64 - side and 0 <= left <= 64 - side   # 2x-2.06x at 64 px
        # the item's square (rows 6..21 of 28) lands at a known place; its inside is exactly the item's grey
        inner = slice(round(side * 8 / 28), round(side * 20 / 28))
        box = canvas[top:top + side, left:left + side]
        assert np.all(box[inner, inner] == ITEM_VALUE), row['path']
    # the same spec writes the same files, whatever the worker count; a second run refuses a non-empty out
    again = tmp_path / 'again'
    write_dataset(small_set(again, idx_dir, workers=2), log=lambda line: None)
    first = rows[0]['path']
    assert (out / first).read_bytes() == (again / first).read_bytes()
    with pytest.raises(ValueError, match='not empty'):
        write_dataset(small_set(out, idx_dir))


def test_asking_for_more_items_than_exist_is_an_error(tmp_path):
    write_fake_fmnist(tmp_path / 'idx', per_class=1)
    with pytest.raises(ValueError, match='has 1 items, fewer than the 2 asked for'):
        write_dataset(small_set(tmp_path / 'out', tmp_path / 'idx'))
    assert not (tmp_path / 'out').exists()                     # checked before anything is written


@pytest.mark.parametrize('bad', [dict(size=32), dict(seed=-1), dict(train_per_class=0), dict(val_images=0),
                                 dict(items_per_image=(0, 3)), dict(items_per_image=(5, 3)), dict(task='seg'),
                                 dict(fragments=-1)])
def test_a_bad_spec_is_an_error_before_anything_is_read(tmp_path, bad):
    spec = FmnistHiresSpec(**{'out': tmp_path / 'out', 'idx_dir': tmp_path / 'none', **bad})
    with pytest.raises(ValueError):
        write_dataset(spec)
    assert not (tmp_path / 'out').exists()


def clutter_outside_the_item(fragments, seeds=range(20)) -> int:
    """Pixels of the item's grey outside the item's own box, over 64 px canvases of a solid-square item: only
    clutter (crops of other squares) puts them there; the smooth background is below 70."""
    item = np.zeros((28, 28), np.uint8)
    item[ITEM_ROWS, ITEM_ROWS] = ITEM_VALUE
    pool = np.stack([item] * 4)
    count = 0
    for seed in seeds:
        canvas, at = hires.render_canvas(item, pool, 64, np.random.default_rng(seed), fragments)
        outside = np.ones(canvas.shape, bool)
        outside[at.top:at.top + at.side, at.left:at.left + at.side] = False
        count += int(np.sum(canvas[outside] == ITEM_VALUE))
    return count


def test_fragments_set_the_clutter_and_zero_gives_a_clean_background():
    assert hires.fragment_count(64) == 3 and hires.fragment_count(512) == 12 and hires.fragment_count(1024) == 48
    assert clutter_outside_the_item(0) == 0
    default, many = clutter_outside_the_item(None), clutter_outside_the_item(12)
    assert 0 < default < many


def test_task_names_and_their_default_sizes():
    assert list(hires.WRITERS) == ['classification', 'segmentation']  # the shipped set, pinned on purpose
    assert FmnistHiresSpec(out=Path('x')).canvas_size == 512
    assert FmnistHiresSpec(out=Path('x'), task='segmentation').canvas_size == 1024
    with pytest.raises(ValueError, match="task='seg' is not a task"):
        FmnistHiresSpec(out=Path('x'), task='seg').check()


def test_output_reads_back_as_a_folder_dataset(tmp_path):
    write_fake_fmnist(tmp_path / 'idx', per_class=1)
    write_dataset(small_set(tmp_path / 'out', tmp_path / 'idx', train_per_class=1), log=lambda line: None)
    aug = SimpleNamespace(random_resized_crop=False, scale=[0.5, 1.0], hflip=0.5, vflip=0.0, color_jitter=0.0)
    cfg = SimpleNamespace(name='folder', root=str(tmp_path / 'out'), img_size=32, max_bad_fraction=0.0, aug=aug)
    train, val, names = build_classification_datasets(cfg, (0.5,) * 3, (0.5,) * 3)
    assert names == sorted(hires.CLASS_NAMES) and len(train) == len(val) == 10 and train.num_bad == 0
    assert train[(0, 0)][0].shape == (3, 32, 32)

