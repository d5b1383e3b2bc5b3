"""linvit.data.large_image: huge images read lazily in bands of rows, class maps written as tiled BigTIFF.

Every file is written by tifffile or PIL from a known array and read back by the module; every class map is read back
by tifffile and compared with the array written. Expected pixel conversions come from to_rgb_array on a PIL image of
the same data, or from the formula by hand.
"""
import importlib.util
import sys
import tracemalloc
import types

import numpy as np
import pytest
from PIL import Image

import linvit.data.large_image as large_image
from linvit.data.folder import to_rgb_array
from linvit.data.large_image import (
    ClassMapWriter,
    GeoReference,
    large_image_extensions,
    open_image,
    write_overlay_png,
    write_preview_png,
)

tifffile = pytest.importorskip('tifffile')

PALETTE = np.array([[0, 0, 0], [255, 0, 0], [0, 255, 0], [0, 0, 255]], dtype=np.uint8)


def noise(shape, seed=0, dtype=np.uint8, high=256):
    return np.random.default_rng(seed).integers(0, high, shape).astype(dtype)


def read_in_bands(source, band):
    return np.concatenate([source.read(y, min(y + band, source.height)) for y in range(0, source.height, band)])


def one_line(err) -> str:
    text = str(err.value)
    assert '\n' not in text, text
    return text


# ------------------------------------------------------------------------------------------------ reading TIFF

@pytest.mark.parametrize('layout', [dict(tile=(64, 48)), dict(rowsperstrip=37), dict(rowsperstrip=1000),
                                    dict(tile=(32, 32), planarconfig='separate')])
def test_tiff_rows_equal_the_array_written(tmp_path, layout):
    """Tiled (edge tiles partial), striped (last strip short, one strip), planar: any band equals the array."""
    image = noise((301, 203, 3), seed=1)
    data = image.transpose(2, 0, 1) if layout.get('planarconfig') == 'separate' else image
    tifffile.imwrite(tmp_path / 'a.tif', data, photometric='rgb', compression='zlib', **layout)
    with open_image(tmp_path / 'a.tif') as source:
        assert (source.height, source.width, source.downsample, source.georef) == (301, 203, 1.0, None)
        assert ('tiled' if 'tile' in layout else 'striped') in source.description
        for y0, y1 in [(0, 1), (0, 301), (63, 65), (64, 128), (100, 299), (300, 301), (5, 5)]:
            rows = source.read(y0, y1)
            assert rows.dtype == np.uint8 and rows.shape == (y1 - y0, 203, 3)
            np.testing.assert_array_equal(rows, image[y0:y1])
        np.testing.assert_array_equal(read_in_bands(source, 50), image)


def test_a_read_decodes_only_the_tiles_of_its_rows(tmp_path, monkeypatch):
    tifffile.imwrite(tmp_path / 'a.tif', noise((256, 320, 3)), tile=(64, 64), photometric='rgb')
    decoded = []
    with open_image(tmp_path / 'a.tif') as source:
        decode = source._page.decode
        monkeypatch.setattr(source, '_page', types.SimpleNamespace(
            decode=lambda data, index, **kw: decoded.append(index) or decode(data, index, **kw),
            dataoffsets=source._page.dataoffsets, databytecounts=source._page.databytecounts,
            extrasamples=source._page.extrasamples, compression=source._page.compression))
        source.read(70, 100)                      # tile row 1: tiles 5 .. 9 of 4 x 5
        assert sorted(decoded) == [5, 6, 7, 8, 9]
        source.read(100, 128)                     # the same tile row again: kept, not decoded again
        assert len(decoded) == 5
        source.read(120, 190)                     # tile rows 1 and 2: only row 2 is new
        assert sorted(decoded[5:]) == [10, 11, 12, 13, 14]


@pytest.mark.parametrize('how', ['subifds', 'pages'])
def test_pyramid_level_is_the_largest_downsample_not_above_the_request(tmp_path, how):
    base = noise((400, 600, 3), seed=2)
    levels = [base, base[::2, ::2], base[::4, ::4]]
    with tifffile.TiffWriter(tmp_path / 'p.tif', bigtiff=True) as writer:
        writer.write(levels[0], tile=(64, 64), photometric='rgb', compression='zlib',
                     subifds=2 if how == 'subifds' else None)
        for level in levels[1:]:
            writer.write(level, tile=(64, 64), photometric='rgb', compression='zlib', subfiletype=1)
    for requested, chosen in [(1, 0), (1.9, 0), (2, 1), (3.5, 1), (4, 2), (3.99, 2), (100, 2)]:
        with open_image(tmp_path / 'p.tif', downsample=requested) as source:
            expected = levels[chosen]
            assert (source.height, source.width) == expected.shape[:2]
            assert source.downsample == 2 ** chosen
            assert f'level {chosen} of 3 (downsample {2 ** chosen}' in source.description
            assert source.description.startswith('BigTIFF 600 x 400')
            assert (f'{requested:g} requested' in source.description) == (requested != 2 ** chosen)
            np.testing.assert_array_equal(read_in_bands(source, 33), expected)


def test_downsample_of_a_file_without_levels_reads_full_size(tmp_path):
    tifffile.imwrite(tmp_path / 'a.tif', noise((40, 30, 3)), photometric='rgb')
    with open_image(tmp_path / 'a.tif', downsample=4) as source:
        assert (source.height, source.width, source.downsample) == (40, 30, 1.0)
        assert 'no pyramid levels (downsample 4 requested; read at full size)' in source.description
    with pytest.raises(ValueError, match='downsample must be >= 1'):
        open_image(tmp_path / 'a.tif', downsample=0.5)


# ------------------------------------------------------------------------------------------------ pixel conversion

def test_16_bit_grey_as_to_rgb_array(tmp_path):
    grey = noise((90, 70), seed=3, dtype=np.uint16, high=65536)
    tifffile.imwrite(tmp_path / 'g.tif', grey, tile=(32, 32))
    with open_image(tmp_path / 'g.tif') as source:
        np.testing.assert_array_equal(read_in_bands(source, 40), to_rgb_array(Image.fromarray(grey)))
    # by hand: v -> round(v * 255 / 65535), grey repeated
    assert to_rgb_array(Image.fromarray(np.array([[65535, 257, 128]], dtype=np.uint16)))[0].tolist() == \
        [[255] * 3, [1] * 3, [0] * 3]


@pytest.mark.parametrize('bits', [12, 10, 14])
def test_fewer_bits_in_16_bit_samples_are_scaled_by_their_own_range_with_one_warning(tmp_path, caplog, bits):
    grey = noise((90, 70), seed=4, dtype=np.uint16, high=2 ** bits)
    grey[5, 7] = 2 ** bits - 1 - 100 * (bits == 14)   # largest sample below 2 ** bits, above 2 ** (bits - 2)
    tifffile.imwrite(tmp_path / 'g.tif', grey, tile=(32, 32))
    with caplog.at_level('WARNING', logger='linvit.data.large_image'), open_image(tmp_path / 'g.tif') as source:
        rows = read_in_bands(source, 40)
    expected = np.floor(grey.astype(np.float64) * 255 / (2 ** bits - 1) + 0.5).astype(np.uint8)  # by hand
    np.testing.assert_array_equal(rows, np.repeat(expected[..., None], 3, axis=2))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == 'WARNING']
    assert len(warnings) == 1 and f'read as {bits}-bit data' in warnings[0] and 'g.tif' in warnings[0]


def test_a_12_bit_grey_png_is_scaled_by_its_range_with_one_warning(tmp_path, caplog):
    grey = noise((30, 20), seed=6, dtype=np.uint16, high=4096)
    grey[0, 0] = 4000
    Image.fromarray(grey).save(tmp_path / 'g.png')
    with caplog.at_level('WARNING', logger='linvit.data.large_image'), open_image(tmp_path / 'g.png') as source:
        rows = source.read(0, 30)
    np.testing.assert_array_equal(rows[..., 1], np.floor(grey.astype(np.float64) * 255 / 4095 + 0.5).astype(np.uint8))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == 'WARNING']
    assert len(warnings) == 1 and 'read as 12-bit data' in warnings[0]


def test_full_range_16_bit_is_not_rescaled_nor_warned_about(tmp_path, caplog):
    grey = noise((40, 30), seed=5, dtype=np.uint16, high=65536)
    grey[0, 0] = 40000
    tifffile.imwrite(tmp_path / 'g.tif', grey, tile=(16, 16))
    with caplog.at_level('WARNING', logger='linvit.data.large_image'), open_image(tmp_path / 'g.tif') as source:
        rows = source.read(0, 40)
    np.testing.assert_array_equal(rows[..., 0], ((grey.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8))
    assert not [r for r in caplog.records if r.levelname == 'WARNING']


def test_float_is_stretched_by_the_range_of_the_whole_image(tmp_path):
    """A band holding only part of the range scales as the whole image does (not by its own min-max)."""
    values = np.linspace(-5, 20, 80 * 50, dtype=np.float32).reshape(80, 50)
    tifffile.imwrite(tmp_path / 'f.tif', values, rowsperstrip=8)
    expected = to_rgb_array(Image.fromarray(values, 'F'))
    with open_image(tmp_path / 'f.tif') as source:
        np.testing.assert_array_equal(source.read(40, 48), expected[40:48])
        np.testing.assert_array_equal(read_in_bands(source, 16), expected)
    assert expected[0, 0, 0] == 0 and expected[-1, -1, 0] == 255


def test_rgba_and_16_bit_rgb_and_min_is_white_and_palette(tmp_path):
    rgba = noise((30, 40, 4), seed=4)
    tifffile.imwrite(tmp_path / 'rgba.tif', rgba, photometric='rgb', extrasamples=['unassalpha'], tile=(16, 16))
    with open_image(tmp_path / 'rgba.tif') as source:
        np.testing.assert_array_equal(source.read(0, 30), to_rgb_array(Image.fromarray(rgba, 'RGBA')))
    rgb16 = noise((20, 10, 3), seed=5, dtype=np.uint16, high=65536)
    tifffile.imwrite(tmp_path / 'rgb16.tif', rgb16, photometric='rgb')
    with open_image(tmp_path / 'rgb16.tif') as source:
        np.testing.assert_array_equal(source.read(0, 20), (rgb16.astype(np.int64) * 255 + 32767) // 65535)
    grey = noise((12, 9), seed=6)
    tifffile.imwrite(tmp_path / 'white.tif', grey, photometric='miniswhite')
    with open_image(tmp_path / 'white.tif') as source:
        np.testing.assert_array_equal(source.read(0, 12)[..., 1], 255 - grey)
    index = noise((20, 30), seed=7, high=4)
    colormap = np.zeros((3, 256), dtype=np.uint16)
    colormap[:, :4] = [[0, 65535, 1000, 30000], [0, 0, 65535, 2000], [0, 257, 0, 40000]]
    tifffile.imwrite(tmp_path / 'palette.tif', index, photometric='palette', colormap=colormap)
    by_hand = np.array([[0, 0, 0], [255, 0, 1], [4, 255, 0], [117, 8, 156]], dtype=np.uint8)
    with open_image(tmp_path / 'palette.tif') as source:
        np.testing.assert_array_equal(source.read(0, 20), by_hand[index])


# ------------------------------------------------------------------------------------------------ errors

def test_errors_are_one_line_naming_the_file(tmp_path):
    tifffile.imwrite(tmp_path / 'a.tif', noise((10, 10, 3)), photometric='rgb')
    with open_image(tmp_path / 'a.tif') as source:
        for y0, y1 in [(-1, 3), (5, 11), (6, 5), (0.5, 2)]:
            with pytest.raises(ValueError) as err:
                source.read(y0, y1)
            assert 'a.tif' in one_line(err) and '0 <= y0 <= y1 <= 10' in str(err.value)
    (tmp_path / 'broken.tif').write_bytes(b'II*\x00' + bytes(range(200)))
    (tmp_path / 'broken.png').write_bytes(b'not a png at all')
    for name, phrase in [('broken.tif', 'not a TIFF image tifffile can read'), ('broken.png', 'cannot read'),
                         ('missing.tif', 'cannot read')]:
        with pytest.raises(ValueError) as err:
            open_image(tmp_path / name)
        assert name in one_line(err) and phrase in str(err.value)
    tifffile.imwrite(tmp_path / 'cut.tif', noise((256, 256, 3)), photometric='rgb', tile=(64, 64))
    data = (tmp_path / 'cut.tif').read_bytes()
    (tmp_path / 'cut.tif').write_bytes(data[:len(data) // 2])          # tiles of the lower half are gone
    with open_image(tmp_path / 'cut.tif') as source:
        source.read(0, 64)
        with pytest.raises(ValueError) as err:
            source.read(192, 256)
    assert 'cut.tif' in one_line(err) and 'truncated' in str(err.value)
    tifffile.imwrite(tmp_path / 'volume.tif', np.zeros((4, 32, 48), np.uint8), volumetric=True, tile=(4, 16, 16),
                     photometric='minisblack')
    with pytest.raises(ValueError) as err:
        open_image(tmp_path / 'volume.tif')
    assert 'volume.tif' in one_line(err) and 'not 2-D image data' in str(err.value)


@pytest.mark.skipif(importlib.util.find_spec('imagecodecs') is not None, reason='imagecodecs is installed: LZW decodes')
def test_lzw_without_imagecodecs_names_it(tmp_path):
    tifffile.imwrite(tmp_path / 'lzw.tif', noise((16, 16, 3)), photometric='rgb')
    with tifffile.TiffFile(tmp_path / 'lzw.tif', mode='r+b') as tif:
        tif.pages[0].tags['Compression'].overwrite(5)            # claims LZW
    with pytest.raises(ImportError) as err:
        open_image(tmp_path / 'lzw.tif')
    assert 'lzw.tif' in one_line(err) and 'pip install imagecodecs' in str(err.value)


# ------------------------------------------------------------------------------------------------ OpenSlide

def test_missing_openslide_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, 'openslide', None)
    (tmp_path / 'slide.mrxs').write_bytes(b'MIRAX index')
    with pytest.raises(ImportError) as err:
        open_image(tmp_path / 'slide.mrxs')
    assert 'slide.mrxs needs OpenSlide' in one_line(err)
    assert 'pip install openslide-python openslide-bin' in str(err.value)
    assert {'.svs', '.ndpi', '.mrxs', '.scn', '.vms', '.vmu', '.bif', '.btf'} <= large_image_extensions()
    assert '.png' not in large_image_extensions() and '.tif' not in large_image_extensions()


class FakeSlide:
    """openslide.OpenSlide over numpy levels (RGBA, level-0 coordinates as OpenSlide takes them)."""
    def __init__(self, path):
        base = noise((300, 500, 4), seed=8)
        base[..., 3] = 255
        base[:10, :10, 3] = 0                          # transparent: no tissue scanned there
        self.levels = [base, base[::4, ::4], base[::16, ::16]]
        self.level_downsamples = [1.0, 4.0, 16.0]
        self.level_dimensions = [(lv.shape[1], lv.shape[0]) for lv in self.levels]
        self.properties = {'openslide.vendor': 'fake'}
        self.calls = []

    def read_region(self, location, level, size):
        self.calls.append((location, level, size))
        d = int(self.level_downsamples[level])
        x, y = location[0] // d, location[1] // d
        return Image.fromarray(np.ascontiguousarray(self.levels[level][y:y + size[1], x:x + size[0]]), 'RGBA')

    def close(self):
        pass


def test_openslide_levels_and_rows(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, 'openslide', types.SimpleNamespace(OpenSlide=FakeSlide))
    monkeypatch.setattr(large_image, '_OPENSLIDE_COLUMNS', 48)        # several read_region calls per band
    (tmp_path / 's.vms').write_bytes(b'[Virtual Microscope Specimen]')
    with open_image(tmp_path / 's.vms', downsample=5) as source:
        assert (source.height, source.width, source.downsample) == (75, 125, 4.0)
        assert 'OpenSlide fake 500 x 300, level 1 of 3 (downsample 4; 5 requested)' in source.description
        expected = to_rgb_array(Image.fromarray(source._slide.levels[1], 'RGBA'))
        np.testing.assert_array_equal(source.read(20, 50), expected[20:50])
        assert source._slide.calls[0] == ((0, 80), 1, (48, 30))        # location in level-0 pixels
    with open_image(tmp_path / 's.vms') as source:
        rows = source.read(0, 12)
        assert rows[:10, :10].max() == 0 and rows[10:, 10:].max() > 0   # transparent reads black


# ------------------------------------------------------------------------------------------------ PIL formats

def test_pil_pixel_limit_is_lifted_for_the_file_and_restored(tmp_path, monkeypatch):
    image = noise((60, 50, 3), seed=9)
    Image.fromarray(image).save(tmp_path / 'big.png')
    monkeypatch.setattr(Image, 'MAX_IMAGE_PIXELS', 1000)             # 3000 px: above twice the limit
    with pytest.raises(Image.DecompressionBombError):
        Image.open(tmp_path / 'big.png')
    with open_image(tmp_path / 'big.png', downsample=2) as source:
        np.testing.assert_array_equal(read_in_bands(source, 7), image)
        assert 'decompression-bomb limit of 1000 px lifted for a file given by the user' in source.description
        assert source.description.startswith('PNG 50 x 60')
    assert Image.MAX_IMAGE_PIXELS == 1000
    with pytest.raises(Image.DecompressionBombError):
        Image.open(tmp_path / 'big.png')
    monkeypatch.setattr(Image, 'MAX_IMAGE_PIXELS', 10 ** 6)
    with open_image(tmp_path / 'big.png') as source:
        assert 'lifted' not in source.description


def test_pil_exif_orientation_is_applied(tmp_path):
    image = noise((20, 30, 3), seed=10)
    exif = Image.Exif()
    exif[0x0112] = 6                                                   # rotate 90 degrees clockwise to view
    Image.fromarray(image).save(tmp_path / 'o.png', exif=exif)
    with open_image(tmp_path / 'o.png') as source:
        assert (source.height, source.width) == (30, 20)
        np.testing.assert_array_equal(source.read(0, 30), np.rot90(image, k=-1))


# ------------------------------------------------------------------------------------------------ class maps

def test_class_map_is_tiled_compressed_bigtiff_equal_to_the_rows_written(tmp_path):
    classes = noise((1000, 700), seed=11, high=4)
    classes[:, 350:] = 2                                             # compressible half
    with ClassMapWriter(tmp_path / 'm.tif', 1000, 700, num_classes=4, tile=128, preview_side=100) as writer:
        y = 0
        for n in [0, 1, 127, 300, 5, 0, 567]:                          # any band heights, crossing tile rows
            writer.write_rows(y, classes[y:y + n].astype(np.int64))
            y += n
    np.testing.assert_array_equal(tifffile.imread(tmp_path / 'm.tif'), classes)
    with tifffile.TiffFile(tmp_path / 'm.tif') as tif:
        page = tif.pages[0]
        assert tif.is_bigtiff and page.is_tiled and (page.tilelength, page.tilewidth) == (128, 128)
        assert page.compression != 1 and page.dtype == np.uint8
    assert writer.preview.shape == (100, 70) and writer.preview.dtype == np.uint8
    np.testing.assert_array_equal(writer.preview, np.asarray(Image.fromarray(classes).resize((70, 100), Image.NEAREST)))


def test_class_map_above_256_classes_is_uint16_and_preview_nearest(tmp_path):
    classes = (np.arange(37)[:, None] * 100 + np.arange(53)[None, :]).astype(np.uint16)   # ids up to 3652
    with ClassMapWriter(tmp_path / 'm.tif', 37, 53, num_classes=4000, tile=16, preview_side=20) as writer:
        writer.write_rows(0, classes[:20])
        writer.write_rows(20, classes[20:])
    stored = tifffile.imread(tmp_path / 'm.tif')
    assert stored.dtype == np.uint16
    np.testing.assert_array_equal(stored, classes)
    preview = writer.preview
    assert max(preview.shape) <= 20 and preview.shape == (14, 20)
    rows, cols = preview // 100, preview % 100                        # every sample is the pixel under its centre
    np.testing.assert_array_equal(rows[:, 0], ((np.arange(14) + 0.5) * 37 / 14).astype(int))
    np.testing.assert_array_equal(cols[0], ((np.arange(20) + 0.5) * 53 / 20).astype(int))


def test_class_map_refusals_and_removal_of_an_incomplete_file(tmp_path):
    path = tmp_path / 'm.tif'
    writer = ClassMapWriter(path, 50, 40, num_classes=3, tile=16)
    writer.write_rows(0, np.zeros((10, 40), np.uint8))
    for y0, rows, phrase in [(20, np.zeros((5, 40), np.uint8), 'expected y0 = 10'),
                             (10, np.zeros((5, 41), np.uint8), 'expected class ids [n, 40]'),
                             (10, np.full((5, 40), 3, np.uint8), 'class ids must be in 0 .. 2'),
                             (10, np.zeros((5, 40), np.float32), 'must be integers')]:
        with pytest.raises(ValueError) as err:
            writer.write_rows(y0, rows)
        assert 'm.tif' in one_line(err) and phrase in str(err.value)
    with pytest.raises(ValueError) as err:
        writer.close()
    assert 'only 10 of 50 rows were written' in one_line(err)
    assert not path.exists()
    with pytest.raises(RuntimeError, match='model failed'):
        with ClassMapWriter(path, 50, 40, num_classes=3, tile=16) as writer:
            writer.write_rows(0, np.zeros((20, 40), np.uint8))
            raise RuntimeError('model failed')
    assert not path.exists()
    with pytest.raises(ValueError, match='multiple of 16'):
        ClassMapWriter(path, 50, 40, num_classes=3, tile=100)
    with pytest.raises(ValueError, match='cannot write the class map'):
        ClassMapWriter(tmp_path / 'no' / 'such' / 'm.tif', 50, 40, num_classes=3)


# ------------------------------------------------------------------------------------------------ GeoTIFF

GEO_KEYS = (1, 1, 0, 3, 1024, 0, 1, 1, 1025, 0, 1, 1, 3072, 0, 1, 32633)       # projected, PixelIsArea, UTM 33N
GEO_TAGS = [(33550, 12, 3, (0.5, 0.25, 0.0), True), (33922, 12, 6, (0, 0, 0, 500000.0, 4000000.0, 0), True),
            (34735, 3, 16, GEO_KEYS, True), (34737, 2, None, 'WGS 84 / UTM zone 33N|', True)]


def geo_tags(path):
    with tifffile.TiffFile(path) as tif:
        return {code: tif.pages[0].tags[code].value for code in (33550, 33922, 34735, 34737)
                if code in tif.pages[0].tags}


def test_geotiff_tags_survive_into_the_class_map(tmp_path):
    tifffile.imwrite(tmp_path / 'geo.tif', noise((64, 80, 3)), photometric='rgb', extratags=GEO_TAGS, tile=(32, 32))
    with open_image(tmp_path / 'geo.tif') as source:
        assert 'GeoTIFF' in source.description
        with ClassMapWriter(tmp_path / 'm.tif', source.height, source.width, 2, tile=32, georef=source.georef) as w:
            w.write_rows(0, np.zeros((64, 80), np.uint8))
    assert geo_tags(tmp_path / 'm.tif') == geo_tags(tmp_path / 'geo.tif') == {
        33550: (0.5, 0.25, 0.0), 33922: (0, 0, 0, 500000.0, 4000000.0, 0), 34735: GEO_KEYS,
        34737: 'WGS 84 / UTM zone 33N|'}


def test_georeference_of_a_level_stays_on_the_same_ground(tmp_path):
    base = noise((64, 80, 3))
    with tifffile.TiffWriter(tmp_path / 'geo.tif') as writer:
        writer.write(base, photometric='rgb', tile=(32, 32), extratags=GEO_TAGS, subifds=1)
        writer.write(base[::2, ::2], photometric='rgb', tile=(32, 32), subfiletype=1)
    with open_image(tmp_path / 'geo.tif', downsample=2) as source, \
            ClassMapWriter(tmp_path / 'm.tif', source.height, source.width, 2, tile=16, georef=source.georef) as w:
        w.write_rows(0, np.zeros((32, 40), np.uint8))
    tags = geo_tags(tmp_path / 'm.tif')
    assert tags[33550] == (1.0, 0.5, 0.0) and tags[33922] == (0, 0, 0, 500000.0, 4000000.0, 0)
    # PixelIsPoint, halved across, quartered down: pixel (u, v) centred on source pixels 2u .. 2u + 1, 4v .. 4v + 3
    point_keys = GEO_KEYS[:8] + (1025, 0, 1, 2) + GEO_KEYS[12:]
    georef = GeoReference(80, 64, ((33550, 12, 3, (0.5, 0.25, 0.0)), (33922, 12, 6, (0, 0, 0, 1000.0, 2000.0, 0)),
                                   (34735, 3, 16, point_keys)))
    half = dict((code, value) for code, _, _, value in georef.for_size(40, 16).tags)
    (i, j, _, x, y, _), (sx, sy, _) = half[33922], half[33550]
    for u, v in [(0, 0), (3, 7)]:                                        # x = x0 + (u - i) * sx; y = y0 - (v - j) * sy
        assert x + (u - i) * sx == pytest.approx(1000.0 + (2 * u + 0.5) * 0.5)
        assert y - (v - j) * sy == pytest.approx(2000.0 - (4 * v + 1.5) * 0.25)
    # ModelTransformation: level raster (u, v) -> the model point of source raster (2u, 2v)
    matrix = np.array([[0.5, 0.1, 0, 10], [0.2, -0.25, 0, 20], [0, 0, 1, 0], [0, 0, 0, 1]])
    scaled = GeoReference(80, 64, ((34264, 12, 16, tuple(matrix.ravel())),)).for_size(40, 32).tags[0][3]
    np.testing.assert_allclose(np.reshape(scaled, (4, 4)) @ [3, 5, 0, 1], matrix @ [6, 10, 0, 1])


# ------------------------------------------------------------------------------------------------ PNGs

def test_preview_and_overlay_pngs(tmp_path, monkeypatch):
    image = noise((400, 300, 3), seed=12)
    tifffile.imwrite(tmp_path / 'a.tif', image, photometric='rgb', tile=(64, 64))
    preview = noise((100, 75), seed=13, high=4)
    write_preview_png(preview, tmp_path / 'p.png', PALETTE.astype(np.float32) / 255)
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / 'p.png')), PALETTE[preview])
    monkeypatch.setattr(large_image, '_OVERLAY_BAND_BYTES', 3 * 300 * 50)      # bands of at most 50 rows
    with open_image(tmp_path / 'a.tif') as source:
        bands = []
        read = source.read
        monkeypatch.setattr(source, 'read', lambda y0, y1: bands.append(y1 - y0) or read(y0, y1))
        write_overlay_png(source, preview, tmp_path / 'o.png', PALETTE, alpha=0.25)
    assert max(bands) <= 50 and sum(bands) == 400
    mean = image.reshape(100, 4, 75, 4, 3).mean(axis=(1, 3))                     # 4 x 4 boxes
    expected = np.rint(0.75 * mean + 0.25 * PALETTE[preview]).astype(np.uint8)
    overlay = np.asarray(Image.open(tmp_path / 'o.png')).astype(int)
    assert np.abs(overlay - expected).max() <= 1
    with pytest.raises(ValueError, match='no colour'):
        write_preview_png(preview + 1, tmp_path / 'p.png', PALETTE)


def test_overlay_memory_is_a_few_bands_not_eight_times_one(tmp_path, monkeypatch):
    image = noise((1200, 1000, 3), seed=14)
    tifffile.imwrite(tmp_path / 'a.tif', image, photometric='rgb', tile=(64, 64))
    band_bytes = 3 * 1000 * 240
    monkeypatch.setattr(large_image, '_OVERLAY_BAND_BYTES', band_bytes)          # bands of 240 rows, 720 kB
    preview = noise((100, 83), seed=15, high=4)                                  # boxes of 12 x 12 pixels
    with open_image(tmp_path / 'a.tif') as source:
        source.read(0, 64)                                                       # the reader's cached tile row
        tracemalloc.start()
        try:
            write_overlay_png(source, preview, tmp_path / 'o.png', PALETTE)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    # the band, its row sums (uint64, one row per 12), the reader's tile row (64 rows), the preview-sized arrays;
    # summing the band as uint64 at once would take 8 band sizes
    assert peak < 4 * band_bytes, f"{peak / band_bytes:.1f} band sizes"


# ------------------------------------------------------------------------------------------------ 10,000 x 10,000

def big_pixels(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """uint8 [len(y), len(x), 3]: tile-coordinate code, row and column: any misplaced tile or row shows."""
    code = ((y[:, None] // 256) * 41 + (x[None, :] // 256) * 7) % 251
    return np.stack([code, np.broadcast_to(y[:, None] % 256, code.shape),
                     np.broadcast_to(x[None, :] % 253, code.shape)], axis=-1).astype(np.uint8)


def test_ten_thousand_pixel_bigtiff_read_band_by_band(tmp_path):
    side, tile = 10_000, 512

    def tiles():
        for ty in range(0, side, tile):
            for tx in range(0, side, tile):
                yield big_pixels(np.arange(ty, min(ty + tile, side)), np.arange(tx, min(tx + tile, side)))

    tifffile.imwrite(tmp_path / 'big.tif', tiles(), shape=(side, side, 3), dtype=np.uint8, tile=(tile, tile),
                     photometric='rgb', compression='zlib', compressionargs={'level': 1}, bigtiff=True)
    with open_image(tmp_path / 'big.tif') as source:
        assert (source.height, source.width) == (side, side)
        assert source.description.startswith('BigTIFF 10000 x 10000')
        peak = 0
        tracemalloc.start()
        try:
            for y0 in range(0, side, 1000):
                y1 = min(y0 + 1000, side)
                tracemalloc.reset_peak()
                band = source.read(y0, y1)
                peak = max(peak, tracemalloc.get_traced_memory()[1])
                for a in range(0, y1 - y0, 250 if y0 % 3000 == 0 or y1 == side else 997):   # all rows of some bands
                    rows = np.arange(y0 + a, min(y0 + a + 50, y1))
                    np.testing.assert_array_equal(band[a:a + 50], big_pixels(rows, np.arange(side)))
                del band
        finally:
            tracemalloc.stop()
    assert peak < 100e6, f'{peak / 1e6:.0f} MB to read a band of 30 MB of a 300 MB image'
