"""linvit.data.segmentation: image/mask folders (pairing, mask modes, class names from classes.txt / num_classes /
the masks), every bad input with a message naming the file, and build_segmentation_datasets with the real config."""
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from linvit.data import SegFolderDataset, build_seg_transforms, build_segmentation_datasets, load_rgb
from linvit.data.segmentation import check_mask_mode, check_mask_values
from linvit.engine.config import DataConfig

IGNORE = 255
IDENTITY = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


# ---------------------------------------------------------------- helpers

def rgb(seed: int, height: int = 12, width: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def ids(seed: int, height: int = 12, width: int = 16, num_classes: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, num_classes, (height, width)).astype(np.uint8)


def save(path: Path, image: Image.Image | np.ndarray, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(path, fmt)
    return path


def add_pair(root: Path, split: str, name: str, image: np.ndarray, mask, ext: str = '.png') -> tuple[Path, Path]:
    """root/split/images/<name><ext> and root/split/masks/<name>.png (``mask``: array or PIL image)."""
    return (save(root / split / 'images' / f'{name}{ext}', image),
            save(root / split / 'masks' / f'{name}.png', mask))


def make_root(tmp_path: Path, classes: str | None = 'sky\nroad\ncar\n') -> Path:
    """Two train pairs (one in a subfolder, one JPEG) and one val pair, ids 0..2 with some IGNORE."""
    root = tmp_path / 'root'
    train_mask = ids(1)
    train_mask[0, :4] = IGNORE
    add_pair(root, 'train', 'a', rgb(0), train_mask)
    add_pair(root, 'train', 'sub/b', rgb(2, 20, 10), ids(3, 20, 10), ext='.jpg')
    add_pair(root, 'val', 'c', rgb(4, 30, 22), ids(5, 30, 22))
    if classes is not None:
        (root / 'classes.txt').write_text(classes)
    return root


def cfg(root, name='folder', img_size=8, num_classes=None, ignore_index=IGNORE, max_bad_fraction=0.0):
    return SimpleNamespace(name=name, root=None if root is None else str(root), img_size=img_size,
                           ignore_index=ignore_index, num_classes=num_classes, max_bad_fraction=max_bad_fraction,
                           synthetic=SimpleNamespace(train_size=8, val_size=4, seed=0),
                           aug=SimpleNamespace(scale_range=[0.5, 2.0], hflip=0.5, vflip=0.0, color_jitter=0.0))


def val_dataset(split_dir: Path, class_names=None, **kwargs) -> SegFolderDataset:
    transform = build_seg_transforms(None, 8, *IDENTITY, ignore_index=kwargs.get('ignore_index', IGNORE), train=False)
    return SegFolderDataset(split_dir, transform, class_names, **kwargs)


# ---------------------------------------------------------------- reading

def test_pairs_are_found_by_relative_path_and_read_at_full_size(tmp_path):
    root = make_root(tmp_path)
    ds = val_dataset(root / 'train', ['sky', 'road', 'car'])
    assert len(ds) == 2 and ds.num_bad == 0 and ds.targets == []
    assert [Path(p).relative_to(root / 'train/images').as_posix() for p in ds.image_paths] == ['a.png', 'sub/b.jpg']
    assert [Path(p).relative_to(root / 'train/masks').as_posix() for p in ds.mask_paths] == ['a.png', 'sub/b.png']
    image, mask = ds[(1, 0)]
    assert image.shape == (3, 20, 10) and image.dtype == torch.float32 and mask.dtype == torch.int64
    np.testing.assert_array_equal(mask.numpy(), ids(3, 20, 10))
    expected = load_rgb(root / 'train/images/sub/b.jpg').transpose(2, 0, 1) / 255
    torch.testing.assert_close(image, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-6)
    assert ds[0][1][0, :4].tolist() == [IGNORE] * 4
    assert 'seg folder train' in ds.describe() and '2 image/mask pairs' in ds.describe()


@pytest.mark.parametrize('mode', ['L', 'P', 'I;16', '1'])
def test_single_channel_mask_modes_read_as_class_ids(tmp_path, mode):
    values = ids(7, num_classes=2 if mode == '1' else 3)
    if mode == 'P':     # palette index = class id, whatever colours the palette shows (as in Pascal VOC)
        mask = Image.fromarray(values, 'L').convert('P')
        mask.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 759)
        mask.putdata(values.ravel().tolist())
    elif mode == 'I;16':
        mask = Image.fromarray(values.astype(np.uint16))
    elif mode == '1':
        mask = Image.fromarray(values.astype(bool))
    else:
        mask = Image.fromarray(values)
    add_pair(tmp_path, 'train', 'x', rgb(0), mask)
    assert Image.open(tmp_path / 'train/masks/x.png').mode == mode
    ds = val_dataset(tmp_path / 'train', ['a', 'b', 'c'])
    np.testing.assert_array_equal(ds[0][1].numpy(), values)


def test_sixteen_bit_masks_hold_more_than_256_classes(tmp_path):
    values = np.arange(12 * 16, dtype=np.uint16).reshape(12, 16) * 2       # ids 0..382
    add_pair(tmp_path, 'train', 'x', rgb(0), values)
    ds = val_dataset(tmp_path / 'train', [f'c{i}' for i in range(400)], ignore_index=1000)
    np.testing.assert_array_equal(ds[0][1].numpy(), values)


def test_grey_and_rgba_images_are_read_as_rgb(tmp_path):
    grey = np.full((12, 16), 77, dtype=np.uint8)
    add_pair(tmp_path, 'train', 'g', grey, ids(0))
    rgba = np.zeros((12, 16, 4), dtype=np.uint8)
    rgba[..., :3], rgba[..., 3] = 200, 255
    add_pair(tmp_path, 'train', 'h', rgba, ids(1))
    ds = val_dataset(tmp_path / 'train', ['a', 'b', 'c'])
    for index, value in ((0, 77), (1, 200)):
        torch.testing.assert_close(ds[index][0], torch.full((3, 12, 16), value / 255), rtol=0, atol=1e-6)


def test_seeded_keys_give_the_same_augmentation(tmp_path):
    root = make_root(tmp_path)
    train, _, _ = build_segmentation_datasets(cfg(root), *IDENTITY)
    first, again, other = train[(0, 5)], train[(0, 5)], train[(0, 6)]
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert first[0].shape == (3, 8, 8) and first[1].shape == (8, 8)
    assert not torch.equal(first[0], other[0])


def test_masks_without_an_image_are_a_warning_naming_the_count_and_one(tmp_path, caplog):
    root = make_root(tmp_path)
    save(root / 'train/masks/lonely.png', ids(0))
    save(root / 'train/masks/z/other.png', ids(1))
    with caplog.at_level(logging.WARNING, logger='linvit.data.segmentation'):
        ds = val_dataset(root / 'train', ['sky', 'road', 'car'])
    assert len(ds) == 2
    assert '2 masks under' in caplog.text and str(root / 'train/masks/lonely.png') in caplog.text


# ---------------------------------------------------------------- bad inputs

def test_an_image_without_a_mask_names_the_image_and_the_expected_mask(tmp_path):
    root = make_root(tmp_path)
    save(root / 'train/images/sub/orphan.tif', rgb(9), 'TIFF')
    save(root / 'train/images/zz.png', rgb(9))
    with pytest.raises(FileNotFoundError) as err:
        val_dataset(root / 'train')
    message = str(err.value)
    assert str(root / 'train/images/sub/orphan.tif') in message and str(root / 'train/masks/sub/orphan.png') in message
    assert 'and 1 more images without masks' in message


def test_a_mask_of_another_size_names_both_files_and_sizes(tmp_path):
    image, mask = add_pair(tmp_path, 'train', 'x', rgb(0, 12, 16), ids(0, 12, 15))
    ds = val_dataset(tmp_path / 'train', ['a', 'b', 'c'])
    with pytest.raises(ValueError) as err:
        ds[0]
    message = str(err.value)
    assert str(mask) in message and str(image) in message and '15x12' in message and '16x12' in message


def test_a_mask_value_out_of_range_names_the_file_the_values_and_the_valid_range(tmp_path):
    values = ids(0)
    values[0, 0], values[1, 1], values[2, 2] = 7, 3, 254
    _, mask = add_pair(tmp_path, 'val', 'x', rgb(0), values)
    ds = val_dataset(tmp_path / 'val', ['a', 'b', 'c'])
    with pytest.raises(ValueError) as err:
        ds[0]
    message = str(err.value)
    assert str(mask) in message and 'values 3, 7, 254 (3 pixels)' in message
    assert 'class ids 0..2 (3 classes)' in message and 'ignore_index=255' in message


def test_many_bad_values_are_shown_as_the_first_few():
    values = np.arange(20, dtype=np.int32).reshape(4, 5)
    with pytest.raises(ValueError, match=r'm.png has values 2, 3, 4, 5, 6, ... \(18 pixels\)'):
        check_mask_values(values, 'm.png', 2, 255)
    with pytest.raises(ValueError, match=r'values -1 \(1 pixels\)'):        # 32-bit 'I' masks can be negative
        check_mask_values(np.array([[0, -1]], dtype=np.int32), 'm.png', 2, 255)
    check_mask_mode('I', 'm.png')                                               # accepted


@pytest.mark.parametrize('mode', ['RGB', 'RGBA', 'LA'])
def test_colour_masks_are_refused_with_the_file_and_mode(tmp_path, mode):
    channels = {'RGB': 3, 'RGBA': 4, 'LA': 2}[mode]
    _, mask = add_pair(tmp_path, 'train', 'x', rgb(0), np.zeros((12, 16, channels), dtype=np.uint8))
    ds = val_dataset(tmp_path / 'train', ['a', 'b'])
    with pytest.raises(ValueError) as err:
        ds[0]
    message = str(err.value)
    assert str(mask) in message and f"mode {mode!r}" in message and 'single-channel class-id PNGs' in message


def test_two_images_that_would_share_a_mask_are_an_error(tmp_path):
    add_pair(tmp_path, 'train', 'x', rgb(0), ids(0))
    save(tmp_path / 'train/images/x.jpg', rgb(1))
    with pytest.raises(ValueError, match=r'images .*x\.jpg and .*x\.png would share the mask .*masks/x\.png'):
        val_dataset(tmp_path / 'train', ['a', 'b', 'c'])


@pytest.mark.parametrize('missing', ['split', 'images', 'masks'])
def test_missing_folders_are_named(tmp_path, missing):
    add_pair(tmp_path, 'train', 'x', rgb(0), ids(0))
    target = {'split': tmp_path / 'val', 'images': tmp_path / 'train/images', 'masks': tmp_path / 'train/masks'}
    if missing != 'split':
        for f in target[missing].iterdir():
            f.unlink()
        target[missing].rmdir()
    split = tmp_path / ('val' if missing == 'split' else 'train')
    with pytest.raises(FileNotFoundError, match=rf"{target[missing]} is not a folder; expected {split}/images/"):
        val_dataset(split, ['a', 'b', 'c'])


def test_an_images_folder_without_images_is_an_error(tmp_path):
    (tmp_path / 'train/images').mkdir(parents=True)
    (tmp_path / 'train/masks').mkdir()
    (tmp_path / 'train/images/notes.txt').write_text('no images here')
    with pytest.raises(ValueError, match=rf"no images under {tmp_path / 'train/images'}"):
        val_dataset(tmp_path / 'train', ['a'])


def test_missing_or_unset_root_is_an_error(tmp_path):
    with pytest.raises(ValueError, match='data.root must be set'):
        build_segmentation_datasets(cfg(None), *IDENTITY)
    with pytest.raises(FileNotFoundError, match=rf"data.root {tmp_path / 'nope'} is not a folder"):
        build_segmentation_datasets(cfg(tmp_path / 'nope'), *IDENTITY)


def test_unknown_dataset_name_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"unknown data.name 'coco'; known: synthetic, folder"):
        build_segmentation_datasets(cfg(tmp_path, name='coco'), *IDENTITY)


def test_an_undecodable_pair_is_skipped_and_counted_up_to_max_bad_fraction(tmp_path, caplog):
    add_pair(tmp_path, 'train', 'a', rgb(0), ids(0))
    add_pair(tmp_path, 'train', 'b', rgb(1), ids(1))
    broken = tmp_path / 'train/images/a.png'
    broken.write_bytes(broken.read_bytes()[:60])                         # truncated PNG
    ds = val_dataset(tmp_path / 'train', ['a', 'b', 'c'], max_bad_fraction=0.5)
    with caplog.at_level(logging.WARNING, logger='linvit.data.segmentation'):
        _, mask = ds[0]                                                  # the next pair instead
    np.testing.assert_array_equal(mask.numpy(), ids(1))
    assert ds.num_bad == 1 and str(broken) in caplog.text
    strict = val_dataset(tmp_path / 'train', ['a', 'b', 'c'], max_bad_fraction=0.0)
    with pytest.raises(RuntimeError, match=r'1 of 2 image/mask pairs .* could not be decoded'):
        strict[0]


# ---------------------------------------------------------------- class names

def test_class_names_come_from_classes_txt(tmp_path):
    root = make_root(tmp_path, classes='  sky \nroad\ncar\n\n\n')
    train, val, names = build_segmentation_datasets(cfg(root), *IDENTITY)
    assert names == train.class_names == val.class_names == ['sky', 'road', 'car']
    assert val[0][1].shape == (30, 22)                                   # validation at full size


def test_class_names_from_num_classes(tmp_path):
    root = make_root(tmp_path, classes=None)
    _, _, names = build_segmentation_datasets(cfg(root, num_classes=4), *IDENTITY)
    assert names == ['class_0', 'class_1', 'class_2', 'class_3']


def test_class_count_is_read_off_the_train_masks(tmp_path, caplog):
    root = make_root(tmp_path, classes=None)
    big = np.full((12, 16), IGNORE, dtype=np.uint8)                     # ignore_index is not a class
    big[3, 3] = 5
    add_pair(root, 'train', 'c', rgb(8), big)
    with caplog.at_level(logging.INFO, logger='linvit.data.segmentation'):
        _, val, names = build_segmentation_datasets(cfg(root), *IDENTITY)
    assert names == [f'class_{i}' for i in range(6)] and val.class_names == names
    assert '6 classes' in caplog.text and str(root / 'classes.txt') in caplog.text


def test_masks_with_no_labelled_pixel_cannot_give_a_class_count(tmp_path):
    add_pair(tmp_path, 'train', 'x', rgb(0), np.full((12, 16), IGNORE, dtype=np.uint8))
    with pytest.raises(ValueError, match='hold no labelled pixel.*write classes.txt or set data.num_classes'):
        val_dataset(tmp_path / 'train')


def test_classes_txt_and_num_classes_must_agree(tmp_path):
    root = make_root(tmp_path)
    with pytest.raises(ValueError, match=rf"{root / 'classes.txt'} names 3 classes but data.num_classes=5"):
        build_segmentation_datasets(cfg(root, num_classes=5), *IDENTITY)


@pytest.mark.parametrize('text, match', [('sky\n\nroad\n', 'line 2 is blank'), ('sky\nroad\nsky\n', "repeats class "
                                         r"names \['sky'\]"), ('\n \n', 'names no classes')])
def test_malformed_classes_txt_is_an_error_naming_it(tmp_path, text, match):
    root = make_root(tmp_path, classes=text)
    with pytest.raises(ValueError, match=rf"{root / 'classes.txt'} .*{match}"):
        build_segmentation_datasets(cfg(root), *IDENTITY)


def test_works_with_the_engine_data_config(tmp_path):
    root = make_root(tmp_path)
    data = OmegaConf.structured(DataConfig)
    data.name, data.root, data.img_size = 'folder', str(root), 8
    train, val, names = build_segmentation_datasets(data, *IDENTITY)
    assert names == ['sky', 'road', 'car'] and len(train) == 2 and len(val) == 1
    image, mask = train[(0, 0)]
    assert image.shape == (3, 8, 8) and set(mask.unique().tolist()) <= {0, 1, 2, IGNORE}


# ---------------------------------------------------------------- checked before training

@pytest.mark.parametrize('fault, words', [
    ('size', ['is 15x12 (width x height) but its image', '16x12']),
    ('values', ['has values 7 (1 pixels) that are neither class ids 0..2']),
    ('mode', ["has PIL mode 'RGB'"]),
])
def test_a_bad_validation_pair_is_refused_when_the_data_is_built(tmp_path, fault, words):
    """Before training starts, not at the first evaluation an epoch later."""
    root = make_root(tmp_path)
    values = ids(7)
    values[2, 3] = 7
    mask = {'size': ids(7, 12, 15), 'values': values, 'mode': rgb(8)}[fault]
    _, bad = add_pair(root, 'val', 'zz', rgb(9), mask)
    with pytest.raises(RuntimeError) as err:
        build_segmentation_datasets(cfg(root), *IDENTITY)
    message = str(err.value)
    assert str(bad) in message and all(word in message for word in words), message
    assert f'found before training, checking every pair under {root / "val"}' in message
    build_segmentation_datasets(cfg(root), *IDENTITY, with_train=False)  # evaluating alone checks as it loads


def test_a_train_mask_of_another_size_is_refused_when_the_data_is_built(tmp_path):
    root = make_root(tmp_path)
    _, bad = add_pair(root, 'train', 'zz', rgb(9), ids(7, 12, 15))
    with pytest.raises(RuntimeError, match=rf'mask {bad} is 15x12 .*\(found before training'):
        build_segmentation_datasets(cfg(root), *IDENTITY)


def test_undecodable_validation_pairs_count_against_max_bad_fraction_before_training(tmp_path, caplog):
    root = make_root(tmp_path)
    broken, _ = add_pair(root, 'val', 'zz', rgb(9), ids(9))
    broken.write_bytes(broken.read_bytes()[:60])  # truncated PNG
    with pytest.raises(RuntimeError, match=r'1 of 2 image/mask pairs .* could not be decoded'):
        build_segmentation_datasets(cfg(root), *IDENTITY)
    with caplog.at_level(logging.WARNING, logger='linvit.data.segmentation'):
        _, val, _ = build_segmentation_datasets(cfg(root, max_bad_fraction=0.5), *IDENTITY)
    assert val.num_bad == 1 and str(broken) in caplog.text
