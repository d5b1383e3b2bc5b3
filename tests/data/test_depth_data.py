"""linvit.data.depth and linvit.data.synthetic_depth: depth files of every format read to the same metres (default
and explicit depth_scale, invalid pixels, max_depth), training crops that move the depth with the image and never
interpolate it, every bad input with a one-line message naming the file, check_pairs before training, the builder,
and the synthetic ground's depths against the pinhole formula recomputed from each sample's parameters."""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from linvit.data.base import DataError
from linvit.data.depth import (
    DEPTH_DATASET_BUILDERS,
    DepthFolderDataset,
    build_depth_datasets,
    build_depth_transforms,
    read_depth,
)
from linvit.data.synthetic_depth import SyntheticGroundDepth

IDENTITY = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
NAN, INF = float('nan'), float('inf')


# ---------------------------------------------------------------- helpers

def rgb(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def write_depth(path: Path, values: np.ndarray) -> Path:
    """``values`` in the format of ``path``'s extension: .npy, .tif/.tiff (tifffile), else PIL (uint16 -> 16-bit
    PNG, uint8 -> 8-bit, [H, W, 3] uint8 -> colour)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == '.npy':
        np.save(path, values)
    elif path.suffix in ('.tif', '.tiff'):
        tifffile.imwrite(path, values)
    else:
        Image.fromarray(values).save(path)
    return path


def add_pair(root: Path, split: str, name: str, depth: np.ndarray, ext: str = '.npy',
             image: np.ndarray | None = None) -> tuple[Path, Path]:
    """root/split/images/<name>.png (random, the depth map's size unless given) and root/split/depths/<name><ext>."""
    image = rgb(len(name), *depth.shape[:2]) if image is None else image
    image_path = root / split / 'images' / f'{name}.png'
    image_path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(image_path)
    return image_path, write_depth(root / split / 'depths' / f'{name}{ext}', depth)


def cfg(root, name='folder', img_size=8, max_bad_fraction=0.0, **extra):
    """A data config as the engine's; ``extra`` adds depth_scale / max_depth (absent by default, as in a config
    schema that does not have them yet)."""
    return SimpleNamespace(name=name, root=None if root is None else str(root), img_size=img_size,
                           max_bad_fraction=max_bad_fraction,
                           synthetic=SimpleNamespace(train_size=4, val_size=2, seed=0),
                           aug=SimpleNamespace(scale_range=[0.5, 2.0], hflip=0.5, vflip=0.0, color_jitter=0.0),
                           **extra)


def val_dataset(split_dir: Path, **kwargs) -> DepthFolderDataset:
    return DepthFolderDataset(split_dir, build_depth_transforms(None, 8, *IDENTITY, train=False), **kwargs)


def train_dataset(split_dir: Path, img_size: int, scale_range, hflip=0.5, vflip=0.5, **kwargs) -> DepthFolderDataset:
    aug = SimpleNamespace(scale_range=list(scale_range), hflip=hflip, vflip=vflip, color_jitter=0.0)
    return DepthFolderDataset(split_dir, build_depth_transforms(aug, img_size, *IDENTITY, train=True), **kwargs)


def assert_one_line(error: pytest.ExceptionInfo, *named) -> str:
    """The message of ``error``: one line that contains every one of ``named`` (paths or words)."""
    message = str(error.value)
    assert '\n' not in message, message
    for part in named:
        assert str(part) in message, (part, message)
    return message


# ---------------------------------------------------------------- formats and values

# 16-bit PNG in millimetres; the same depths written out by hand in metres
MILLIMETRES = np.array([[1500, 250, 4000], [1, 65535, 2000]], dtype=np.uint16)
METRES = [[1.5, 0.25, 4.0], [0.001, 65.535, 2.0]]


def test_png_millimetres_tiff_and_npy_metres_read_to_the_same_metres(tmp_path):
    root = tmp_path / 'root'
    _, png = add_pair(root, 'val', 'a', MILLIMETRES, '.png')
    _, tif = add_pair(root, 'val', 'b', np.array(METRES, dtype=np.float32), '.tif')
    _, npy = add_pair(root, 'val', 'c', np.array(METRES, dtype=np.float64), '.npy')
    with Image.open(png) as img:
        assert img.mode == 'I;16'    # the test writes what it means to: a 16-bit PNG
    for path in (png, tif, npy):
        depth = read_depth(path)
        assert depth.dtype == np.float32 and depth.shape == (2, 3)
        np.testing.assert_allclose(depth, METRES, rtol=1e-6)
    ds = val_dataset(root / 'val')
    assert ds.class_names == ['depth'] and len(ds) == 3
    for index in range(3):
        image, depth = ds[(index, 0)]
        assert image.shape == (3, 2, 3) and image.dtype == torch.float32
        assert depth.shape == (2, 3) and depth.dtype == torch.float32
        np.testing.assert_allclose(depth.numpy(), METRES, rtol=1e-6)


def test_depth_scale_overrides_the_per_file_default(tmp_path):
    root = tmp_path / 'root'
    _, png = add_pair(root, 'val', 'a', np.array([[384, 512]], dtype=np.uint16), '.png')   # KITTI: metres x 256
    _, npy = add_pair(root, 'val', 'b', np.array([[1500.0, 250.0]], dtype=np.float32))      # millimetres as floats
    np.testing.assert_allclose(read_depth(png, depth_scale=1 / 256), [[1.5, 2.0]], rtol=1e-6)
    np.testing.assert_allclose(read_depth(npy, depth_scale=0.001), [[1.5, 0.25]], rtol=1e-6)
    np.testing.assert_allclose(read_depth(npy), [[1500.0, 250.0]], rtol=1e-6)    # float default: metres
    ds = val_dataset(root / 'val', depth_scale=0.001)
    np.testing.assert_allclose(ds[(0, 0)][1].numpy(), [[0.384, 0.512]], rtol=1e-6)
    np.testing.assert_allclose(ds[(1, 0)][1].numpy(), [[1.5, 0.25]], rtol=1e-6)


def test_zero_negative_nan_inf_and_beyond_max_depth_are_zero_in_the_sample(tmp_path):
    root = tmp_path / 'root'
    add_pair(root, 'val', 'a', np.array([[0.0, NAN, INF, -INF], [-1.0, 5.0, 10.0, 10.5]], dtype=np.float32))
    add_pair(root, 'val', 'b', np.array([[0, 9000, 10000, 10001]], dtype=np.uint16), '.png')
    add_pair(root, 'val', 'c', np.array([[-5, 700]], dtype=np.int16))     # signed integers: millimetres too
    ds = val_dataset(root / 'val', max_depth=10)
    np.testing.assert_array_equal(ds[(0, 0)][1].numpy(), [[0, 0, 0, 0], [0, 5, 10, 0]])
    np.testing.assert_allclose(ds[(1, 0)][1].numpy(), [[0, 9, 10, 0]], rtol=1e-6)
    np.testing.assert_allclose(ds[(2, 0)][1].numpy(), [[0, 0.7]], rtol=1e-6)
    uncapped = val_dataset(root / 'val')
    np.testing.assert_array_equal(uncapped[(0, 0)][1].numpy(), [[0, 0, 0, 0], [0, 5, 10, 10.5]])


# ---------------------------------------------------------------- training crops

def test_training_crops_hold_only_the_input_depths_and_pad_with_zero(tmp_path):
    """Random scale 0.5-2 of a 12x20 map into 16 px crops: nearest neighbour keeps every value one of the file's
    (a linear resize would make values between columns), and where the scaled map is smaller than the crop the
    padding is 0."""
    rows, cols = np.mgrid[:12, :20]
    depth = (1 + 0.37 * cols + 0.01 * rows).astype(np.float32)
    root = tmp_path / 'root'
    add_pair(root, 'train', 'a', depth)
    ds = train_dataset(root / 'train', 16, (0.5, 2.0))
    allowed = np.append(depth.ravel(), 0.0)
    padded = 0
    for seed in range(16):
        image, crop = ds[(0, seed)]
        assert image.shape == (3, 16, 16) and crop.shape == (16, 16) and crop.dtype == torch.float32
        assert np.isin(crop.numpy(), allowed).all()
        padded += int((crop == 0).any())
    assert 0 < padded < 16     # some crops padded (scaled below 16 px high), some not


def test_a_flip_moves_the_depth_with_the_image(tmp_path):
    """Image columns and depth both encode the column (grey 10 * x, depth 1 + x metres); after an always-on
    horizontal flip and a random crop, every pixel still pairs the same column, and the columns run backwards."""
    cols = np.broadcast_to(np.arange(20), (12, 20))
    image = np.repeat((10 * cols).astype(np.uint8)[:, :, None], 3, axis=2)
    root = tmp_path / 'root'
    add_pair(root, 'train', 'a', (1.0 + cols).astype(np.float32), image=image)
    ds = train_dataset(root / 'train', 8, (1.0, 1.0), hflip=1.0, vflip=0.0)
    for seed in range(6):
        crop_image, crop_depth = ds[(0, seed)]
        image_column = np.rint(crop_image[0].numpy() * 255 / 10)
        depth_column = crop_depth.numpy() - 1
        np.testing.assert_array_equal(image_column, depth_column)
        assert (np.diff(depth_column, axis=1) == -1).all()


# ---------------------------------------------------------------- bad input, one line each

def test_an_image_without_a_depth_map_names_the_expected_file(tmp_path):
    root = tmp_path / 'root'
    add_pair(root, 'val', 'a', np.ones((4, 4), np.float32))
    lonely = root / 'val' / 'images' / 'sub' / 'b.png'
    lonely.parent.mkdir()
    Image.fromarray(rgb(0, 4, 4)).save(lonely)
    with pytest.raises(FileNotFoundError) as error:
        val_dataset(root / 'val')
    assert_one_line(error, lonely, root / 'val' / 'depths' / 'sub' / 'b.png', '.npy')


def test_an_image_with_two_depth_maps_is_refused(tmp_path):
    root = tmp_path / 'root'
    add_pair(root, 'val', 'a', np.full((4, 4), 1000, np.uint16), '.png')
    second = write_depth(root / 'val' / 'depths' / 'a.npy', np.ones((4, 4), np.float32))
    with pytest.raises(DataError) as error:
        val_dataset(root / 'val')
    assert_one_line(error, root / 'val' / 'images' / 'a.png', root / 'val' / 'depths' / 'a.png', second)


@pytest.mark.parametrize('ext', ['.png', '.tif', '.npy'])
def test_a_depth_map_of_another_size_names_both_sizes(tmp_path, ext):
    root = tmp_path / 'root'
    depth = np.full((10, 16), 1000, np.uint16) if ext == '.png' else np.ones((10, 16), np.float32)
    image_path, depth_path = add_pair(root, 'val', 'a', depth, ext, image=rgb(0, 12, 16))
    ds = val_dataset(root / 'val')
    for decode in (False, True):     # from the headers, and decoded
        with pytest.raises(DataError) as error:
            ds.check_pairs(decode=decode)
        assert_one_line(error, depth_path, image_path, '16x10', '16x12', 'found before training')
    with pytest.raises(DataError) as error:
        ds[(0, 0)]
    assert_one_line(error, depth_path, image_path, '16x10', '16x12')


def test_an_unreadable_depth_file_is_named(tmp_path):
    root = tmp_path / 'root'
    _, depth_path = add_pair(root, 'val', 'a', np.ones((4, 4), np.float32))
    depth_path.write_bytes(b'not a numpy file\nsecond line')
    with pytest.raises(DataError) as error:
        val_dataset(root / 'val', max_bad_fraction=0.0)[(0, 0)]
    assert_one_line(error, depth_path, 'could not be decoded', 'data.max_bad_fraction')
    with pytest.raises(DataError) as error:
        val_dataset(root / 'val', max_bad_fraction=0.0).check_pairs(decode=False)
    assert_one_line(error, depth_path, 'could not be decoded')


def test_an_unreadable_pair_within_max_bad_fraction_is_replaced_by_the_next(tmp_path):
    root = tmp_path / 'root'
    _, bad = add_pair(root, 'val', 'a', np.ones((4, 4), np.float32))
    add_pair(root, 'val', 'b', np.full((4, 4), 2.5, np.float32))
    bad.write_bytes(b'garbage')
    ds = val_dataset(root / 'val', max_bad_fraction=0.5)
    np.testing.assert_array_equal(ds[(0, 0)][1].numpy(), np.full((4, 4), 2.5))
    assert ds.num_bad == 1


LOW_LEVEL_DEPTHS = {
    '8-bit PNG': ('.png', np.full((4, 4), 200, np.uint8)),
    'colour PNG': ('.png', np.full((4, 4, 3), 200, np.uint8)),
    'uint8 npy': ('.npy', np.full((4, 4), 200, np.uint8)),
    'uint8 TIFF': ('.tif', np.full((4, 4), 200, np.uint8)),
}


@pytest.mark.parametrize('kind', LOW_LEVEL_DEPTHS)
def test_a_depth_map_with_too_few_levels_says_which_formats_to_write(tmp_path, kind):
    ext, values = LOW_LEVEL_DEPTHS[kind]
    root = tmp_path / 'root'
    _, depth_path = add_pair(root, 'val', 'a', values, ext)
    ds = val_dataset(root / 'val')
    for decode in (False, True):
        with pytest.raises(DataError) as error:
            ds.check_pairs(decode=decode)
        assert_one_line(error, depth_path, '16-bit PNG', 'float32 TIFF', '.npy', 'too few levels')
    with pytest.raises(DataError) as error:
        ds[(0, 0)]
    assert_one_line(error, depth_path, '16-bit PNG', 'float32 TIFF', '.npy')


def test_a_map_of_several_channels_is_refused(tmp_path):
    root = tmp_path / 'root'
    _, depth_path = add_pair(root, 'val', 'a', np.ones((4, 4, 2), np.float32))
    with pytest.raises(DataError) as error:
        val_dataset(root / 'val')[(0, 0)]
    assert_one_line(error, depth_path, '[4, 4, 2]', 'one channel')


def test_an_all_invalid_depth_map_is_refused_once_decoded(tmp_path):
    root = tmp_path / 'root'
    _, depth_path = add_pair(root, 'val', 'a', np.array([[50.0, 0.0], [NAN, 60.0]], np.float32))
    ds = val_dataset(root / 'val', max_depth=10)
    ds.check_pairs(decode=False)     # its header is fine
    with pytest.raises(DataError) as error:
        ds.check_pairs(decode=True)
    assert_one_line(error, depth_path, 'no valid pixel', 'data.max_depth=10')
    with pytest.raises(DataError) as error:
        ds[(0, 0)]
    assert_one_line(error, depth_path, 'no valid pixel')
    assert val_dataset(root / 'val')[(0, 0)][1].max() == 60    # without the cap it has valid pixels


def test_the_builder_finds_a_wrong_validation_pair_before_any_sample_is_loaded(tmp_path, monkeypatch):
    root = tmp_path / 'root'
    add_pair(root, 'train', 'a', np.full((12, 12), 2000, np.uint16), '.png')
    _, wrong = add_pair(root, 'val', 'b', np.zeros((12, 12), np.float32))
    monkeypatch.setattr(DepthFolderDataset, 'load', lambda self, index: pytest.fail('a sample was loaded'))
    with pytest.raises(DataError) as error:
        build_depth_datasets(cfg(root), *IDENTITY)
    assert_one_line(error, wrong, 'no valid pixel', 'found before training')


def test_the_builder_finds_a_wrong_training_pair_from_its_headers(tmp_path):
    root = tmp_path / 'root'
    _, wrong = add_pair(root, 'train', 'a', np.full((12, 12), 200, np.uint8), '.png')
    add_pair(root, 'val', 'b', np.ones((12, 12), np.float32))
    with pytest.raises(DataError) as error:
        build_depth_datasets(cfg(root), *IDENTITY)
    assert_one_line(error, wrong, '16-bit PNG', 'found before training')


# ---------------------------------------------------------------- builder

def test_the_folder_builder_gives_train_crops_full_size_validation_and_the_depth_class(tmp_path):
    root = tmp_path / 'root'
    add_pair(root, 'train', 'a', np.full((12, 20), 1500, np.uint16), '.png')
    add_pair(root, 'train', 'b', np.full((9, 14), 2.0, np.float32), '.tiff')
    halves = np.repeat(np.array([[2.0] * 3 + [3.0] * 3], np.float32), 10, axis=0)     # [10, 6]: 2 m | 3 m
    add_pair(root, 'val', 'c', halves)
    assert DEPTH_DATASET_BUILDERS.names() == ['folder', 'synthetic']
    train, val, names = build_depth_datasets(cfg(root), *IDENTITY)    # no depth_scale / max_depth keys: defaults
    assert names == ['depth'] and train.class_names == val.class_names == ['depth']
    image, depth = train[(0, 3)]
    assert image.shape == (3, 8, 8) and depth.shape == (8, 8)
    assert set(np.unique(depth.numpy())) <= {0.0, 1.5}
    image, depth = val[(0, 0)]
    assert image.shape == (3, 10, 6)
    np.testing.assert_array_equal(depth.numpy(), halves)
    no_train, capped, _ = build_depth_datasets(cfg(root, max_depth=2.5, depth_scale=None), *IDENTITY,
                                               with_train=False)
    assert no_train is None
    np.testing.assert_array_equal(capped[(0, 0)][1].numpy(), np.where(halves > 2.5, 0.0, halves))


@pytest.mark.parametrize('key, value', [('depth_scale', 0), ('depth_scale', -1.0), ('max_depth', float('nan'))])
def test_the_builder_refuses_settings_that_are_not_positive_metres(tmp_path, key, value):
    root = tmp_path / 'root'
    add_pair(root, 'val', 'a', np.ones((4, 4), np.float32))
    with pytest.raises(ValueError, match=f'data.{key}'):
        build_depth_datasets(cfg(root, **{key: value}), *IDENTITY, with_train=False)


def test_the_builder_refuses_a_rectangular_crop_and_a_depth_scale_for_synthetic_data():
    with pytest.raises(ValueError, match='square'):
        build_depth_datasets(cfg(None, name='synthetic', img_size=[32, 48]), *IDENTITY)
    with pytest.raises(ValueError, match='data.depth_scale'):
        build_depth_datasets(cfg(None, name='synthetic', img_size=32, depth_scale=0.001), *IDENTITY)


def test_the_synthetic_builder_renders_both_splits(tmp_path):
    train, val, names = build_depth_datasets(cfg(None, name='synthetic', img_size=32, max_depth=20.0), *IDENTITY)
    assert names == ['depth'] and (len(train), len(val)) == (4, 2)
    image, depth = train[(1, 7)]
    assert image.shape == (3, 32, 32) and depth.shape == (32, 32) and depth.dtype == torch.float32
    assert depth.max() <= 20.0 and val.split == 'val' and train.split == 'train'


# ---------------------------------------------------------------- the synthetic ground

def synthetic(split='train', seed=0, size=64, n=8, **kwargs) -> SyntheticGroundDepth:
    return SyntheticGroundDepth(n, size, seed, split, build_depth_transforms(None, size, *IDENTITY, train=False),
                                **kwargs)


def object_boxes(scene) -> list[tuple[slice, slice]]:
    """(rows, cols) slices of every object's rectangle, from the parameters alone."""
    return [(slice(obj.top, obj.contact_row + 1), slice(obj.left, obj.right)) for obj in scene.objects]


def test_the_camera_and_horizon_lie_in_their_ranges():
    ds = synthetic(n=16)
    for index in range(16):
        scene = ds.sample_params(index)
        assert 1.2 <= scene.camera_height <= 1.8 and 0.15 * 64 <= scene.horizon <= 0.45 * 64
        assert 2 <= len(scene.objects) <= 5


def test_uncovered_ground_has_the_pinhole_depth_and_the_sky_none():
    ds = synthetic()
    for index in range(len(ds)):
        _, depth, _ = ds.render(index)
        scene = ds.sample_params(index)
        covered = np.zeros((64, 64), bool)
        for rows, cols in object_boxes(scene):
            covered[rows, cols] = True
        for y in range(64):
            free = ~covered[y]
            if y > scene.horizon:
                expected = min(scene.focal * scene.camera_height / (y - scene.horizon), scene.far_depth)
                np.testing.assert_allclose(depth[y, free], expected, rtol=1e-6)
            else:
                assert (depth[y, free] == 0).all()


def test_every_visible_object_pixel_carries_its_contact_rows_ground_depth():
    ds = synthetic()
    for index in range(len(ds)):
        _, depth, _ = ds.render(index)
        scene = ds.sample_params(index)
        expected = np.full((64, 64), np.nan)
        # painter's order written here: far (contact row near the horizon) first, nearer ones cover it
        for obj in sorted(scene.objects, key=lambda obj: obj.contact_row):
            expected[obj.top:obj.contact_row + 1, obj.left:obj.right] = \
                scene.focal * scene.camera_height / (obj.contact_row - scene.horizon)
        on_object = ~np.isnan(expected)
        assert on_object.any()
        np.testing.assert_allclose(depth[on_object], expected[on_object], rtol=1e-6)


def test_the_ground_is_textured():
    image, depth, scene = synthetic().render(0)
    rows = slice(int(scene.horizon) + 2, 64)
    covered = np.zeros((64, 64), bool)
    for box in object_boxes(scene):
        covered[box] = True
    ground = image[rows][~covered[rows]].astype(float)
    assert ground.std() > 10    # more than the pixel noise: tiles


def test_samples_are_deterministic_and_differ_between_indices_and_splits():
    first, again = synthetic().render(3), synthetic().render(3)
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    other_index, other_split = synthetic().render(4), synthetic('val').render(3)
    other_seed = synthetic(seed=1).render(3)
    for other in (other_index, other_split, other_seed):
        assert not np.array_equal(first[0], other[0]) and not np.array_equal(first[1], other[1])
    image, depth = synthetic()[(3, 0)]
    np.testing.assert_allclose(depth.numpy(), first[1])
    np.testing.assert_allclose(image.numpy(), first[0].transpose(2, 0, 1) / 255, atol=1e-6)


def test_max_depth_makes_deeper_synthetic_pixels_invalid():
    ds, capped = synthetic(), synthetic(max_depth=8.0)
    full = ds.render(2)[1]
    _, depth = capped.load(2)
    np.testing.assert_array_equal(depth, np.where(full > 8.0, 0.0, full))
    assert (full > 8.0).any() and (depth > 0).any()
