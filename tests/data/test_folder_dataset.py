"""linvit.data.folder: ImageFolder trees with odd and bad files, pixel conversions checked by hand, errors."""
import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from linvit.data import (
    DataError,
    ImageFolderDataset,
    build_classification_datasets,
    build_transforms,
    load_rgb,
    sample_seed,
)
from linvit.data.folder import to_rgb_array

ZERO_MEAN, UNIT_STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)   # images come out as v / 255: easy to compare


def save(path, image: Image.Image, fmt: str = 'PNG'):
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, fmt)
    return path


def truncated_jpeg(seed: int = 0) -> bytes:
    """A JPEG cut in half: PIL opens and verifies it (headers only) but cannot decode it."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, 'JPEG')
    return buf.getvalue()[: len(buf.getvalue()) // 2]


def val_transform(size: int = 8):
    return build_transforms(None, size, ZERO_MEAN, UNIT_STD, train=False)


# ---------------------------------------------------------------- pixel conversions

def test_16bit_grey_is_scaled_not_clipped(tmp_path):
    values = np.array([[0, 65535], [32896, 257]], dtype=np.uint16)   # 32896 = 128 * 257, 257 = 1 * 257
    path = save(tmp_path / 'g16.png', Image.fromarray(values))
    assert Image.open(path).mode == 'I;16'
    rgb = load_rgb(path)
    assert rgb.dtype == np.uint8 and rgb.shape == (2, 2, 3)
    np.testing.assert_array_equal(rgb[..., 0], [[0, 255], [128, 1]])
    assert np.all(rgb[..., 0:1] == rgb)                                     # grey in all three channels


def test_16bit_big_endian_and_int32_modes(tmp_path):
    values = np.array([[0, 65535], [32896, 128]], dtype=np.uint16)         # 128 / 257 = 0.498 -> 0
    big = Image.frombytes('I;16B', (2, 2), values.astype('>u2').tobytes())
    np.testing.assert_array_equal(to_rgb_array(big)[..., 1], [[0, 255], [128, 0]])
    as_int32 = save(tmp_path / 'i32.tif', Image.fromarray(values.astype(np.int32)), 'TIFF')
    assert Image.open(as_int32).mode == 'I'
    np.testing.assert_array_equal(load_rgb(as_int32)[..., 2], [[0, 255], [128, 0]])
    # outside the 16-bit range: stretched from min..max, so -100 -> 0 and 1100 -> 255, 500 -> 127.5 -> 128
    wide = Image.fromarray(np.array([[-100, 1100], [500, 500]], dtype=np.int32))
    np.testing.assert_array_equal(to_rgb_array(wide)[..., 0], [[0, 255], [128, 128]])


def test_float_mode_in_unit_range_scales_by_255():
    image = Image.fromarray(np.array([[0.0, 1.0], [0.5, 0.2]], dtype=np.float32))
    assert image.mode == 'F'
    np.testing.assert_array_equal(to_rgb_array(image)[..., 0], [[0, 255], [128, 51]])


def test_grey_palette_and_alpha_modes(tmp_path):
    grey = save(tmp_path / 'l.png', Image.fromarray(np.full((3, 3), 77, dtype=np.uint8)))
    np.testing.assert_array_equal(load_rgb(grey), np.full((3, 3, 3), 77))

    palette = Image.new('P', (2, 1))
    palette.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    palette.putdata([0, 1])
    np.testing.assert_array_equal(load_rgb(save(tmp_path / 'p.png', palette)), [[[10, 20, 30], [200, 100, 50]]])

    # alpha composited on black: out = rgb * alpha / 255; 200 * 128 / 255 = 100.4 -> 100, 100 -> 50.2, 50 -> 25.1
    rgba = np.array([[[200, 100, 50, 255], [200, 100, 50, 128], [200, 100, 50, 0]]], dtype=np.uint8)
    out = load_rgb(save(tmp_path / 'rgba.png', Image.fromarray(rgba, 'RGBA')))
    np.testing.assert_array_equal(out, [[[200, 100, 50], [100, 50, 25], [0, 0, 0]]])
    la = np.array([[[90, 255], [90, 0]]], dtype=np.uint8)
    np.testing.assert_array_equal(load_rgb(save(tmp_path / 'la.png', Image.fromarray(la, 'LA'))),
                                  [[[90, 90, 90], [0, 0, 0]]])


def test_exif_orientation_is_applied(tmp_path):
    pixels = np.zeros((2, 4, 3), dtype=np.uint8)
    pixels[0, 0] = 255                                           # top-left marker in a 2x4 (h x w) picture
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = 6                                             # "rotate 90 CW to display"
    path = tmp_path / 'rot.jpg'
    image.save(path, 'JPEG', exif=exif, quality=100)
    out = load_rgb(path)
    assert out.shape == (4, 2, 3) and out[0, 1].min() > 200      # marker now at the top-right


# ---------------------------------------------------------------- the dataset

@pytest.fixture
def odd_tree(tmp_path):
    """train/{cat,dog} with grey, RGBA, 16-bit and palette files, a corrupt file, a nested folder and a non-image;
    val/{cat,dog} with plain RGB files."""
    root = tmp_path / 'odd'
    train = root / 'train'
    rng = np.random.default_rng(0)
    for name in ('cat', 'dog'):
        for i in range(4):
            save(train / name / f'rgb{i}.png', Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)))
            save(root / 'val' / name / f'v{i}.jpg', Image.fromarray(rng.integers(0, 256, (9, 9, 3), dtype=np.uint8)),
                 'JPEG')
    save(train / 'cat' / 'grey.png', Image.fromarray(np.full((10, 10), 77, dtype=np.uint8)))
    save(train / 'cat' / 'nested' / 'deep.png', Image.fromarray(np.full((10, 10, 3), 9, dtype=np.uint8)))
    save(train / 'dog' / 'alpha.png', Image.fromarray(np.full((10, 10, 4), 200, dtype=np.uint8), 'RGBA'))
    save(train / 'dog' / 'g16.tif', Image.fromarray(np.full((10, 10), 32896, dtype=np.uint16)), 'TIFF')
    (train / 'dog' / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\n' + b'not really a png' * 10)
    (train / 'dog' / 'notes.txt').write_text('not an image, not counted')
    (train / 'dog' / '.hidden.png').write_bytes(b'ignored')
    return root


def test_tree_with_odd_files(odd_tree, caplog, make_cfg):
    with caplog.at_level(logging.WARNING, logger='linvit.data'):
        ds = ImageFolderDataset(odd_tree / 'train', val_transform(), max_bad_fraction=0.2)
    assert ds.class_names == ['cat', 'dog']
    assert ds.num_bad == 1 and len(ds) == 12                  # 13 image files, the corrupt one skipped
    assert any('broken.png' in r.getMessage() for r in caplog.records)
    assert ds.targets == [0] * 6 + [1] * 6
    names = [p.rsplit('/', 1)[-1] for p in ds.paths]
    assert 'deep.png' in names and 'notes.txt' not in names and '.hidden.png' not in names
    by_name = dict(zip(names, range(len(ds))))
    grey, _ = ds[by_name['grey.png']]
    assert grey.dtype == torch.float32 and grey.shape == (3, 8, 8)
    torch.testing.assert_close(grey, torch.full((3, 8, 8), 77 / 255))
    sixteen, label = ds[by_name['g16.tif']]
    assert label == 1
    torch.testing.assert_close(sixteen, torch.full((3, 8, 8), 128 / 255))
    alpha, _ = ds[by_name['alpha.png']]
    torch.testing.assert_close(alpha, torch.full((3, 8, 8), 157 / 255))   # 200 * 200 / 255 = 156.9
    assert 'train' in ds.describe() and '12 images' in ds.describe() and '2 classes' in ds.describe()


def test_too_many_bad_files_is_an_error_with_the_count(odd_tree):
    with pytest.raises(DataError, match=r'1 of 13 image files .* \(7.69%\).*data.max_bad_fraction=0.01 \(1.00%\)'):
        ImageFolderDataset(odd_tree / 'train', val_transform(), max_bad_fraction=0.01)


def test_decode_failure_at_load_time_gives_the_next_sample(tmp_path, caplog):
    root = tmp_path / 'trunc'
    for i, value in enumerate((10, 20, 30)):
        save(root / 'a' / f'{i}.png', Image.fromarray(np.full((6, 6, 3), value, dtype=np.uint8)))
    (root / 'a' / '1.jpg').write_bytes(truncated_jpeg())      # sorts between 1.png and 2.png; passes verify
    ds = ImageFolderDataset(root, val_transform(4), max_bad_fraction=0.5)
    assert ds.num_bad == 0 and len(ds) == 4 and ds.paths[1].endswith('1.jpg')
    with caplog.at_level(logging.WARNING, logger='linvit.data'):
        image, label = ds[(1, 5)]
    assert ds.num_bad == 1 and any('1.jpg' in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(image, torch.full((3, 4, 4), 20 / 255))   # index 2: the image of 1.png
    assert label == 0
    again, _ = ds[1]                                           # known bad now: substituted without a new warning
    assert torch.equal(again, image) and ds.num_bad == 1
    # two failures of 4 files exceed a 30% limit
    strict = ImageFolderDataset(root, val_transform(4), max_bad_fraction=0.3)
    (root / 'a' / '0.png').write_bytes(truncated_jpeg(1))     # broken after construction
    with pytest.raises(DataError, match='2 of 4'):
        strict[0]                                              # 0.png fails, then its substitute 1.jpg


def test_seeded_keys_fix_the_augmentation(tmp_path, make_cfg):
    save(tmp_path / 's' / 'a' / 'x.png', Image.fromarray(
        np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    aug = make_cfg(random_resized_crop=True, scale=[0.05, 0.3], hflip=0.5).aug
    ds = ImageFolderDataset(tmp_path / 's', build_transforms(aug, 16, ZERO_MEAN, UNIT_STD, train=True))
    first, same, other = ds[(0, 7)], ds[(0, 7)], ds[(0, 8)]
    assert torch.equal(first[0], same[0]) and not torch.equal(first[0], other[0])
    # a fresh copy (think: another DataLoader worker, or a resumed run) gives the same sample for the same key
    fresh = ImageFolderDataset(tmp_path / 's', build_transforms(aug, 16, ZERO_MEAN, UNIT_STD, train=True))
    ds[(0, 1)]                                                  # history must not matter
    assert torch.equal(fresh[(0, 7)][0], first[0])
    # plain int keys draw from torch's generator: reproducible under torch.manual_seed, different otherwise
    torch.manual_seed(0)
    a = ds[0][0]
    torch.manual_seed(0)
    b, c = ds[0][0], ds[0][0]
    assert torch.equal(a, b) and not torch.equal(b, c)
    assert torch.equal(ds[(-1, 7)][0], first[0])               # negative indices count from the end
    with pytest.raises(IndexError):
        ds[1]
    with pytest.raises(TypeError):
        ds[(0, 1, 2)]


def test_sample_seed_depends_on_index_and_seed_only():
    seeds = {sample_seed(i, s) for i in range(50) for s in (0, 1, 2 ** 40, 2 ** 64 - 1)}
    assert len(seeds) == 200
    assert sample_seed(3, 9) == sample_seed(3, 9) and sample_seed(3, -1) == sample_seed(3, 2 ** 64 - 1)


# ---------------------------------------------------------------- building from the config, and its errors

def test_build_folder_datasets(make_tree, make_cfg):
    root = make_tree()
    train, val, names = build_classification_datasets(make_cfg('folder', root, img_size=16), (0.5,) * 3, (0.5,) * 3)
    assert names == ['cat', 'dog'] == train.class_names == val.class_names
    assert len(train) == len(val) == 6 and train.targets == [0, 0, 0, 1, 1, 1]
    image, label = val[(4, 0)]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32 and label == 1
    assert -1 <= image.min() < image.max() <= 1


def test_val_with_other_classes_names_them(make_tree, make_cfg):
    root = make_tree({'train': ['cat', 'dog'], 'val': ['cat', 'bird']})
    with pytest.raises(DataError, match=r"missing \['dog'\], extra \['bird'\]"):
        build_classification_datasets(make_cfg('folder', root), (0.5,) * 3, (0.5,) * 3)


def test_missing_folders_are_named(tmp_path, make_tree, make_cfg):
    missing = tmp_path / 'nowhere'
    with pytest.raises(FileNotFoundError, match=str(missing)):
        build_classification_datasets(make_cfg('folder', missing), (0.5,) * 3, (0.5,) * 3)
    root = make_tree({'train': ['cat']})
    with pytest.raises(FileNotFoundError, match=str(root / 'val')):
        build_classification_datasets(make_cfg('folder', root), (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(ValueError, match='data.root must be set'):
        build_classification_datasets(make_cfg('folder', None), (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(ValueError, match="unknown data.name 'imagenet'"):
        build_classification_datasets(make_cfg('imagenet'), (0.5,) * 3, (0.5,) * 3)


def test_empty_trees_are_errors(tmp_path):
    (tmp_path / 'e' / 'train').mkdir(parents=True)
    with pytest.raises(DataError, match='no class folders in .*train'):
        ImageFolderDataset(tmp_path / 'e' / 'train', val_transform())
    (tmp_path / 'e' / 'train' / 'cat').mkdir()
    (tmp_path / 'e' / 'train' / 'cat' / 'readme.txt').write_text('x')
    with pytest.raises(DataError, match='no images under .*train'):
        ImageFolderDataset(tmp_path / 'e' / 'train', val_transform())


def test_data_errors_are_value_errors_and_runtime_errors():
    # ValueError: the data does not fit; RuntimeError: what unreadable-file errors were before DataError
    assert issubclass(DataError, ValueError) and issubclass(DataError, RuntimeError)
