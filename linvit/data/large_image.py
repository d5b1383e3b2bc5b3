"""Huge image files in and out: images read lazily in bands of rows, class and value maps written as tiled BigTIFF.

Usage (prediction of an image far larger than memory)::

    with open_image('slide.svs', downsample=4) as source:        # the pyramid level of downsample <= 4
        print(source.description)   # 'BigTIFF 12000 x 10000, level 1 of 3 (downsample 2; 4 requested), ...'
        with ClassMapWriter('classes.tif', source.height, source.width, num_classes=5,
                            georef=source.georef) as out:
            for y0 in range(0, source.height, 512):
                rows = source.read(y0, min(y0 + 512, source.height))    # uint8 [n, width, 3] RGB
                out.write_rows(y0, predict(rows))                        # class ids [n, width]
        write_preview_png(out.preview, 'classes.png', palette)           # palette [num_classes, 3]
        write_overlay_png(source, out.preview, 'overlay.png', palette)

Reading (``open_image``; the file's content decides, not its extension):

- TIFF, BigTIFF, pyramidal TIFF (SubIFDs or reduced-resolution pages), OME-TIFF, and the TIFF-based slide formats
  (Aperio .svs, Hamamatsu .ndpi, Leica .scn, Ventana .bif) through tifffile, lazily: a read decodes only the tiles
  (or strips) of the rows asked for, and keeps the last decoded row of tiles for the next read. JPEG, LZW,
  JPEG 2000, ... compressed files need ``imagecodecs`` (a one-line error at open names it); zlib/deflate,
  PackBits and uncompressed need nothing more. The first image series of the file is read; of a series of several
  pages (a stack, channels as pages) the first page, which the description says.
- Pyramid level: the level whose downsample (level-0 size / level size, the mean of both axes, as OpenSlide counts)
  is the largest not exceeding the requested one (1% tolerance for the rounding of odd level sizes). The image is
  not resampled further: ``height``/``width`` are the level's, ``downsample`` is the level's actual downsample,
  and the description names the requested one when they differ (a file without levels is read at full size).
- Other formats tifffile cannot read: MIRAX .mrxs, Hamamatsu .vms/.vmu (and a TIFF-based slide tifffile fails on)
  through OpenSlide, an optional extra (``pip install openslide-python openslide-bin``; a one-line ImportError
  names it when missing). Everything else (PNG, JPEG, ...) through PIL, read whole (PIL cannot read rows of a
  PNG or JPEG lazily), upright by EXIF orientation; PIL's decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``)
  is lifted for that one open since the user named the file, restored afterwards, and the description says so.
- Pixels become uint8 RGB by the rules of ``linvit.data.folder.to_rgb_array``: 16-bit scaled v * 255 / 65535
  (per channel, also for 16-bit RGB), except that data of fewer bits in 16-bit samples (TIFF, and 16-bit grey
  PNGs) is scaled from its own range (12-bit: 0..4095 when the largest sample of the level is below 4096; likewise
  8, 10 and 14 bits) with one warning line; other integer and float data stretched from the min-max of the whole
  level (for these and 16-bit TIFF samples one extra pass over the level on the first read, so that every band is
  scaled alike), grey repeated, alpha
  composited on black (associated alpha is already), CMYK and palette images converted, min-is-white inverted.
  OpenSlide's transparent (empty) regions thus read black too.
- GeoTIFF: the georeferencing tags (ModelPixelScale, ModelTiepoint, ModelTransformation, GeoKeyDirectory,
  GeoDoubleParams, GeoAsciiParams) are kept as ``source.georef`` (a ``GeoReference``) and written into the class
  map, scaled to its size: a pyramid level, or a class map of another size than the image, stays in place on the
  map (PixelIsArea and PixelIsPoint both). No rasterio: tifffile reads and writes these tags itself, and the
  formats only GDAL/rasterio reads (JPEG 2000 with GeoJP2 boxes, ERDAS .img, ...) are not supported; PIL still
  reads a .jp2 without its georeferencing.

Writing (``MapWriter``: ``ClassMapWriter`` for class ids, uint8 up to 256 classes and uint16 above;
``ValueMapWriter`` for float32 values such as depth): a tiled (tile x tile), zlib-compressed BigTIFF (always
BigTIFF: every current reader takes it, and a map's final size is not known to be under 4 GB before it is
compressed), written as the rows arrive, strictly top to bottom, holding one row of tiles at a time (the tiles are
compressed on a thread), with a GeoTIFF's georeferencing and the level's downsample. A nearest-neighbour preview
(``NearestPreview``, longer side <= ``preview_side``) is gathered on the way; ``write_preview_png`` colours a class
map's, ``write_overlay_png`` lays it over the image, which it reads band by band and box-averages to the preview's
size.

Errors are one line naming the file: ``ValueError`` for a file that cannot be read or written as asked,
``ImportError`` for a missing optional library (naming the pip command). A file that opens but fails while its rows
are decoded (truncated, damaged tiles) raises ``ImageReadError`` (a ``ValueError``) from ``read``, whatever the
decoder raised, so that a batch can skip that one image and go on.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from PIL import Image, ImageOps

from .folder import composite_on_black, load_rgb, readable_extensions, to_rgb_array, to_uint8

__all__ = ['ImageSource', 'ImageReadError', 'open_image', 'large_image_extensions', 'MapWriter', 'ClassMapWriter',
           'ValueMapWriter', 'NearestPreview', 'GeoReference', 'write_preview_png', 'write_overlay_png']

_logger = logging.getLogger(__name__)

_TIFF_MAGIC = (b'II*\x00', b'MM\x00*', b'II+\x00', b'MM\x00+')
#: extensions of TIFF files PIL does not list (BigTIFF and slide variants); tifffile reads them
_TIFF_EXTENSIONS = frozenset({'.tif', '.tiff', '.btf', '.tf2', '.tf8', '.bigtiff', '.svs', '.ndpi', '.scn', '.bif'})
#: slide formats that are not TIFF: OpenSlide only
_OPENSLIDE_ONLY = frozenset({'.mrxs', '.vms', '.vmu'})
_OPENSLIDE_EXTENSIONS = frozenset({'.svs', '.ndpi', '.scn', '.bif', '.tif', '.tiff'}) | _OPENSLIDE_ONLY
_OPENSLIDE_INSTALL = 'pip install openslide-python openslide-bin'
_LEVEL_TOLERANCE = 1.01       # a level of downsample 4.03 serves a request of 4 (odd level sizes round)
_OPENSLIDE_COLUMNS = 8192     # read_region width per call (its buffer is w * h * 4 bytes)
_OVERLAY_BAND_BYTES = 16 << 20
_GEOTIFF_TAGS = {33550: 'ModelPixelScale', 33922: 'ModelTiepoint', 34264: 'ModelTransformation',
                 34735: 'GeoKeyDirectory', 34736: 'GeoDoubleParams', 34737: 'GeoAsciiParams'}

# TIFF photometric interpretations (tifffile.PHOTOMETRIC)
_MINISWHITE, _MINISBLACK, _RGB, _PALETTE, _SEPARATED, _YCBCR = 0, 1, 2, 3, 5, 6
_JPEG_COMPRESSIONS = frozenset({6, 7, 33007, 34892})
#: bit depths that 16-bit samples may hold (the fewest that hold the largest sample is taken)
_CONTAINED_BITS = (8, 10, 12, 14, 16)
#: PIL's modes of 16-bit grey images ('I': PNG and TIFF reads of older Pillow versions)
_PIL_16_BIT_GREY = frozenset({'I', 'I;16', 'I;16B', 'I;16L', 'I;16N'})


def large_image_extensions() -> frozenset[str]:
    """Lower-case extensions (with the dot) that ``open_image`` reads beyond those PIL opens."""
    return (_TIFF_EXTENSIONS | _OPENSLIDE_ONLY) - readable_extensions()


# ---------------------------------------------------------------------------------------------------- georeferencing

@dataclass(frozen=True)
class GeoReference:
    """The GeoTIFF tags of an image of ``width`` x ``height`` pixels: ``(code, tiff type, count, value)`` each."""
    width: int
    height: int
    tags: tuple[tuple[int, int, int, Any], ...]

    def _value(self, code: int) -> Any:
        return next((value for c, _, _, value in self.tags if c == code), None)

    def _pixel_is_point(self) -> bool:
        keys = self._value(34735)
        if not keys or len(keys) < 4:
            return False
        entries = np.asarray(keys[4:4 + 4 * int(keys[3])]).reshape(-1, 4)
        raster_type = [int(e[3]) for e in entries if int(e[0]) == 1025 and int(e[1]) == 0]   # GTRasterTypeGeoKey
        return raster_type == [2]

    def for_size(self, width: int, height: int) -> GeoReference:
        """The same place on the ground for a raster of ``width`` x ``height`` pixels (a level, a class map)."""
        if (width, height) == (self.width, self.height):
            return self
        sx, sy = self.width / width, self.height / height        # source pixels per new pixel
        # new raster (i, j) -> source raster (sx * i + ox, sy * j + oy): corners scale (PixelIsArea); centres shift
        ox, oy = ((sx - 1) / 2, (sy - 1) / 2) if self._pixel_is_point() else (0.0, 0.0)
        tags = []
        for code, dtype, count, value in self.tags:
            if code == 33550:                                     # ModelPixelScale (x, y, z)
                value = (value[0] * sx, value[1] * sy, *value[2:])
            elif code == 33922:                                   # ModelTiepoint (i, j, k, x, y, z) each
                points = np.asarray(value, dtype=np.float64).reshape(-1, 6).copy()
                points[:, 0] = (points[:, 0] - ox) / sx
                points[:, 1] = (points[:, 1] - oy) / sy
                value = tuple(points.ravel().tolist())
            elif code == 34264:                                   # ModelTransformation, 4 x 4, raster -> model
                to_source = np.array([[sx, 0, 0, ox], [0, sy, 0, oy], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=np.float64)
                value = tuple((np.asarray(value, dtype=np.float64).reshape(4, 4) @ to_source).ravel().tolist())
            tags.append((code, dtype, count, value))
        return GeoReference(width, height, tuple(tags))

    def extratags(self) -> list[tuple[int, int, int | None, Any, bool]]:
        """The tags as tifffile's ``extratags`` of ``TiffWriter.write``."""
        return [(code, dtype, None if dtype == 2 else count, value, True) for code, dtype, count, value in self.tags]


def _geo_reference(page, width: int, height: int) -> GeoReference | None:
    tags = tuple((code, int(page.tags[code].dtype), int(page.tags[code].count), page.tags[code].value)
                 for code in sorted(_GEOTIFF_TAGS) if code in page.tags)
    return GeoReference(width, height, tags) if tags else None


# ---------------------------------------------------------------------------------------------------- sources

class ImageReadError(ValueError):
    """Rows of an opened image could not be read: a truncated file, damaged tiles, a failing decoder."""


class ImageSource:
    """A readable image, possibly far larger than memory, read lazily in bands of rows.

    Attributes: ``path``; ``height``, ``width`` of the level read; ``downsample`` of that level (1.0: full size);
    ``description``, one phrase for logs; ``georef``, a ``GeoReference`` for a GeoTIFF, else None.
    """
    path: str
    height: int
    width: int
    downsample: float = 1.0
    description: str
    georef: GeoReference | None = None

    def read(self, y0: int, y1: int) -> np.ndarray:
        """uint8 [y1 - y0, width, 3] RGB: rows y0 .. y1 - 1 of the level."""
        integers = isinstance(y0, (int, np.integer)) and isinstance(y1, (int, np.integer))
        if not (integers and 0 <= y0 <= y1 <= self.height):
            raise ValueError(f"rows {y0}..{y1} of {self.path} are out of range: expected integers "
                             f"0 <= y0 <= y1 <= {self.height} (its height)")
        if y0 == y1:
            return np.zeros((0, self.width, 3), dtype=np.uint8)
        try:
            return self._read(int(y0), int(y1))
        except (ImageReadError, MemoryError):
            raise
        except Exception as err:  # decoders raise many types on damaged data (zlib.error, OSError, ...)
            raise ImageReadError(f"cannot read rows {y0}..{y1} of {self.path}: {type(err).__name__}: {err}") from None

    def _read(self, y0: int, y1: int) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        """Release the file."""

    def __enter__(self) -> ImageSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description})"


def open_image(path: str | os.PathLike, downsample: float = 1.0) -> ImageSource:
    """An ``ImageSource`` for ``path``, at the pyramid level chosen for ``downsample`` (see the module docstring)."""
    path = os.fspath(path)
    if not downsample >= 1:
        raise ValueError(f"downsample must be >= 1 (1: full size), got {downsample} for {path}")
    try:
        with open(path, 'rb') as file:
            magic = file.read(4)
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    ext = os.path.splitext(path)[1].lower()
    if magic in _TIFF_MAGIC:
        try:
            return _TiffSource(path, downsample)
        except _TiffUnreadable as err:
            if ext not in _OPENSLIDE_EXTENSIONS - {'.tif', '.tiff'}:
                raise ValueError(str(err)) from None
            return _OpenSlideSource(path, downsample, why=f" (tifffile cannot: {err.reason})")
    if ext in _OPENSLIDE_ONLY:
        return _OpenSlideSource(path, downsample)
    return _PilSource(path, downsample)


def _choose_level(downsamples: list[float], requested: float) -> int:
    """The index of the largest level downsample not exceeding ``requested`` (1% tolerance); level 0 at least."""
    fitting = [i for i, d in enumerate(downsamples) if d <= requested * _LEVEL_TOLERANCE]
    return max(fitting, key=lambda i: downsamples[i]) if fitting else 0


def _level_phrase(level: int, count: int, downsample: float, requested: float) -> str:
    if count == 1:
        text = 'no pyramid levels'
        return text + (f' (downsample {requested:g} requested; read at full size)' if requested != 1 else '')
    text = f'level {level} of {count} (downsample {downsample:.3g}'
    return text + (f'; {requested:g} requested)' if abs(downsample - requested) > 1e-3 * requested else ')')


class _TiffUnreadable(ValueError):
    def __init__(self, path: str, reason: str):
        super().__init__(f"{path} is not a TIFF image tifffile can read: {reason}")
        self.reason = reason


def _import_tifffile(path: str):
    try:
        import tifffile
    except ImportError:
        raise ImportError(f"reading or writing {path} needs tifffile: pip install tifffile "
                          f"(or pip install linvit[train])") from None
    return tifffile


def _codec_error(path: str, err: Exception) -> Exception:
    text = str(err).strip().replace('\n', ' ')
    if 'imagecodecs' in text:
        return ImportError(f"{path} is compressed with a codec that needs imagecodecs ({text.strip(chr(39))}): "
                           f"pip install imagecodecs")
    return ImageReadError(f"cannot decode {path}: {type(err).__name__}: {text}")


def _contained_bits(path: str, high: int) -> int:
    """The fewest bits of ``_CONTAINED_BITS`` that hold ``high``, the largest 16-bit sample of ``path``; said in one
    warning line when fewer than 16 (cameras and scanners store 10 to 14-bit data in 16-bit samples, which scaled as
    16-bit data would read nearly black)."""
    bits = next(b for b in _CONTAINED_BITS if high < 2 ** b)
    if bits < 16:
        _logger.warning("%s: its 16-bit samples are all below %d (largest %d): read as %d-bit data, 0..%d scaled to "
                        "0..255", path, 2 ** bits, high, bits, 2 ** bits - 1)
    return bits


def _scale_16_bit(values: np.ndarray, top: int) -> np.ndarray:
    """uint16 samples of range 0..top -> uint8, v -> round(v * 255 / top) (``to_uint8``'s rounding for top 65535)."""
    return ((np.minimum(values, top).astype(np.uint32) * 255 + top // 2) // top).astype(np.uint8)


class _TiffSource(ImageSource):
    """A TIFF page read a row of tiles (or a strip) at a time through tifffile's segment decoder."""

    def __init__(self, path: str, downsample: float):
        tifffile = _import_tifffile(path)
        self.path = path
        try:
            self._tif = tifffile.TiffFile(path)
        except Exception as err:  # TiffFileError, struct.error, ValueError on broken files
            raise _TiffUnreadable(path, f"{type(err).__name__}: {err}") from None
        try:
            self._open_level(downsample)
        except BaseException:
            self._tif.close()
            raise

    def _open_level(self, requested: float) -> None:
        path, tif = self.path, self._tif
        try:
            series = tif.series[0]
            levels = list(series.levels)
            base = levels[0].pages[0].aspage()
        except Exception as err:
            raise _TiffUnreadable(path, f"no image series ({type(err).__name__}: {err})") from None
        full_h, full_w = int(base.imagelength), int(base.imagewidth)
        sizes = [(int(lv.keyframe.imagelength), int(lv.keyframe.imagewidth)) for lv in levels]
        downsamples = [(full_h / max(h, 1) + full_w / max(w, 1)) / 2 for h, w in sizes]
        level = _choose_level(downsamples, requested)
        page = levels[level].pages[0].aspage()
        self._page = page
        self.height, self.width = int(page.imagelength), int(page.imagewidth)
        self.downsample = downsamples[level]
        if int(page.imagedepth) != 1 or page.samplesperpixel < 1 or self.height < 1 or self.width < 1:
            raise ValueError(f"{path}: the image page is not 2-D image data (shape {page.shape}, "
                             f"depth {page.imagedepth}); expected rows x columns (x samples)")
        self._samples = int(page.samplesperpixel)
        self._photometric = int(page.photometric)
        self._planar = int(page.planarconfig) == 2
        if page.dtype is None:
            raise ValueError(f"{path}: unsupported sample type ({page.bitspersample}-bit, sample format "
                             f"{int(page.sampleformat)}); expected 1 to 64-bit integer or float samples")
        self._dtype = np.dtype(page.dtype)
        if page.is_tiled:
            self._seg_h, self._seg_w = int(page.tilelength), int(page.tilewidth)
        else:
            self._seg_h, self._seg_w = min(int(page.rowsperstrip or self.height), self.height), self.width
        self._seg_rows = -(-self.height // self._seg_h)
        self._seg_cols = -(-self.width // self._seg_w)
        planes = self._samples if self._planar else 1
        if len(page.dataoffsets) < planes * self._seg_rows * self._seg_cols:
            raise ValueError(f"{path}: {len(page.dataoffsets)} tiles or strips for an image that needs "
                             f"{planes * self._seg_rows * self._seg_cols}; the file is damaged")
        self._decode_args = {}
        if page.compression in _JPEG_COMPRESSIONS:
            self._decode_args = {'jpegtables': page.jpegtables, 'jpegheader': getattr(page, 'jpegheader', None)}
        try:
            page.decode(None, 0, **self._decode_args)    # raises now for a codec or sample type it cannot decode
        except Exception as err:
            raise _codec_error(path, err) from None
        self._colormap = None
        if self._photometric == _PALETTE:
            if page.colormap is None:
                raise ValueError(f"{path}: a palette image without a colour map")
            self._colormap = np.ascontiguousarray(np.asarray(page.colormap).reshape(3, -1).T)    # [entries, 3]
        self._value_range: tuple[float, float] | None = None
        self._cached: tuple[int, np.ndarray] | None = None
        self.georef = None
        geo = _geo_reference(base, full_w, full_h)
        if geo is not None:
            self.georef = geo.for_size(self.width, self.height)
        kind = 'BigTIFF' if tif.is_bigtiff else 'TIFF'
        flavour = next((name for name in ('svs', 'ndpi', 'scn', 'ome', 'bif') if getattr(tif, f'is_{name}', False)),
                       None)
        parts = [f"{kind}{' (' + flavour.upper() + ')' if flavour else ''} {full_w} x {full_h}",
                 _level_phrase(level, len(levels), self.downsample, requested)]
        if len(levels) > 1:
            parts.append(f"read {self.width} x {self.height}")
        parts.append(f"{'tiled' if page.is_tiled else 'striped'}, {self._samples} x {self._dtype.name}")
        if len(series.pages) > 1:
            parts.append(f"first of {len(series.pages)} pages")
        if self.georef is not None:
            parts.append('GeoTIFF')
        self.description = ', '.join(parts)

    def close(self) -> None:
        self._cached = None
        self._tif.close()

    # ---- decoding

    def _segment_row_raw(self, row: int) -> np.ndarray:
        """Native samples [rows, width, samples] of segment row ``row`` (one row of tiles, or one strip)."""
        page, h0 = self._page, row * self._seg_h
        rows = min(self._seg_h, self.height - h0)
        out = np.zeros((rows, self.width, self._samples), dtype=self._dtype)
        per_plane = self._seg_rows * self._seg_cols
        planes = self._samples if self._planar else 1
        indices = [plane * per_plane + row * self._seg_cols + col for plane in range(planes)
                   for col in range(self._seg_cols)]
        try:
            for index in sorted(indices, key=lambda i: page.dataoffsets[i]):     # in file order
                data = self._read_segment(page.dataoffsets[index], page.databytecounts[index])
                segment, (plane, _, y, x, _), _ = page.decode(data, index, **self._decode_args)
                if segment is None:      # an empty tile (offset 0): stays zero
                    continue
                segment = segment[0]                                   # [h, w, contig samples]
                sh, sw = min(segment.shape[0], self.height - y), min(segment.shape[1], self.width - x)
                target = slice(plane, plane + 1) if self._planar else slice(None)
                out[y - h0:y - h0 + sh, x:x + sw, target] = segment[:sh, :sw]
        except ImageReadError:
            raise
        except (ImportError, ValueError) as err:
            raise _codec_error(self.path, err) from None
        except Exception as err:  # zlib.error, TiffFileError, ... on damaged data
            raise ImageReadError(f"cannot decode rows {h0}..{h0 + rows} of {self.path}: {type(err).__name__}: "
                                 f"{err}") from None
        return out

    def _read_segment(self, offset: int, count: int) -> bytes | None:
        if not offset or not count:
            return None                   # an empty tile or strip
        fh = self._tif.filehandle
        with fh.lock:
            fh.seek(offset)
            data = fh.read(count)
        if len(data) != count:
            raise ImageReadError(f"{self.path} is truncated: {count} bytes expected at offset {offset}, got "
                                 f"{len(data)}")
        return data

    def _colour_samples(self) -> int:
        return {_RGB: 3, _YCBCR: 3, _SEPARATED: 4}.get(self._photometric, 1) if self._photometric != _PALETTE else 1

    def _level_value_range(self) -> tuple[float, float] | None:
        """The range the colour samples are scaled from to 0..255 (the same for every band); None for 8-bit data.

        16-bit integers: 0 .. 2 ** bits - 1 for the fewest bits (8, 10, 12, 14 or 16) that hold the level's largest
        sample, said in one warning line when fewer than 16: cameras and scanners store 10 to 14-bit data in 16-bit
        samples, which scaled as 16-bit would read nearly black. Other integer and float data: the level's min-max.
        Either way one extra pass over the level, on the first read."""
        if self._dtype in (np.uint8, np.bool_) or self._colormap is not None:
            return None
        if self._value_range is None:
            low, high = self._level_min_max()
            if self._dtype == np.uint16:
                self._value_range = (0.0, float(2 ** _contained_bits(self.path, high) - 1))
            else:
                self._value_range = (low, high) if low <= high else (0.0, 0.0)
        return self._value_range

    def _level_min_max(self) -> tuple[float, float]:
        """(min, max) of the finite colour samples of the whole level ((inf, -inf) when there are none)."""
        low, high, colour = np.inf, -np.inf, self._colour_samples()
        for row in range(self._seg_rows):
            values = self._segment_row_raw(row)[..., :colour]
            if values.dtype.kind == 'f':
                values = values[np.isfinite(values)]
            if values.size:
                low, high = min(low, values.min().item()), max(high, values.max().item())
        return low, high

    def _to_rgb(self, raw: np.ndarray) -> np.ndarray:
        """uint8 [h, w, 3] RGB from native samples [h, w, samples], by the rules of ``to_rgb_array``."""
        if self._colormap is not None:                       # palette: uint16 colours per index
            colours = self._colormap[np.clip(raw[..., 0].astype(np.int64), 0, len(self._colormap) - 1)]
            return to_uint8(colours, (0, 65535)) if colours.dtype != np.uint8 else colours
        colour_samples = self._colour_samples()
        if raw.dtype == np.bool_:
            raw = raw.astype(np.uint8) * 255
        value_range = self._level_value_range()
        colour = raw[..., :colour_samples]
        if colour.dtype != np.uint8:
            if colour.dtype.kind == 'f' and value_range is not None:     # NaN, inf: the lowest value
                colour = np.where(np.isfinite(colour), colour, value_range[0])
            colour = _scale_16_bit(colour, int(value_range[1])) if colour.dtype == np.uint16 else \
                to_uint8(colour, value_range)
        if self._photometric == _MINISWHITE:
            colour = 255 - colour
        if self._photometric == _SEPARATED:
            rgb = np.asarray(Image.fromarray(np.ascontiguousarray(colour), 'CMYK').convert('RGB'))
        elif self._photometric == _YCBCR and self._page.compression not in _JPEG_COMPRESSIONS:
            rgb = np.asarray(Image.fromarray(np.ascontiguousarray(colour), 'YCbCr').convert('RGB'))
        elif colour_samples == 1:
            rgb = np.repeat(colour, 3, axis=2)
        else:
            rgb = colour
        extras = tuple(int(e) for e in (self._page.extrasamples or ()))
        if raw.shape[2] > colour_samples and extras and extras[0] == 2:     # unassociated alpha: composite on black
            alpha = raw[..., colour_samples:colour_samples + 1]
            if alpha.dtype != np.uint8:
                alpha = to_uint8(np.clip(alpha, 0, 1) if alpha.dtype.kind == 'f' else alpha,
                                 (0, 1) if alpha.dtype.kind == 'f' else (0, 65535))
            rgb = composite_on_black(np.concatenate([rgb, alpha], axis=2))
        # associated alpha (1) is premultiplied, i.e. already composited on black; unspecified extras (0) are ignored
        return np.ascontiguousarray(rgb, dtype=np.uint8)

    def _segment_row(self, row: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != row:
            self._cached = (row, self._to_rgb(self._segment_row_raw(row)))
        return self._cached[1]

    def _read(self, y0: int, y1: int) -> np.ndarray:
        out = np.empty((y1 - y0, self.width, 3), dtype=np.uint8)
        for row in range(y0 // self._seg_h, (y1 - 1) // self._seg_h + 1):
            block, top = self._segment_row(row), row * self._seg_h
            a, b = max(y0, top), min(y1, top + block.shape[0])
            out[a - y0:b - y0] = block[a - top:b - top]
        return out


def _fewer_bits_grey(path: str) -> np.ndarray | None:
    """uint8 [H, W, 3] of a 16-bit grey image whose samples hold fewer bits (``_contained_bits``), scaled from
    their own range; None for full-range 16-bit data, which ``load_rgb`` scales as such."""
    with Image.open(path) as img:
        ImageOps.exif_transpose(img, in_place=True)
        values = np.asarray(img)
    if values.size == 0 or values.min() < 0 or values.max() > 65535:
        return None                                   # not 16-bit data: load_rgb stretches it
    bits = _contained_bits(path, int(values.max()))
    if bits == 16:
        return None
    return np.repeat(_scale_16_bit(values.astype(np.uint16), 2 ** bits - 1)[..., None], 3, axis=2)


class _PilSource(ImageSource):
    """A PNG, JPEG, ... decoded whole by PIL (which cannot read their rows lazily), served in bands of rows."""

    def __init__(self, path: str, downsample: float):
        self.path = path
        limit = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None     # the user named this file: no decompression-bomb refusal for it
        try:
            with Image.open(path) as img:
                fmt = img.format or 'image'
                grey_16_bit = img.mode in _PIL_16_BIT_GREY
            pixels = _fewer_bits_grey(path) if grey_16_bit else None
            self._pixels = load_rgb(path) if pixels is None else pixels
        except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ...
            raise ValueError(f"cannot read {path} as an image: {type(err).__name__}: {err}") from None
        finally:
            Image.MAX_IMAGE_PIXELS = limit
        self.height, self.width = self._pixels.shape[:2]
        parts = [f"{fmt} {self.width} x {self.height}", _level_phrase(0, 1, 1.0, downsample),
                 'decoded whole (PIL reads no rows lazily)']
        if limit is not None and self.width * self.height > limit:
            parts.append(f"decompression-bomb limit of {limit} px lifted for a file given by the user")
            _logger.info("%s: %d px, above PIL's decompression-bomb limit of %d px; lifted for this file, which "
                         "the user asked to predict", path, self.width * self.height, limit)
        self.description = ', '.join(parts)

    def _read(self, y0: int, y1: int) -> np.ndarray:
        return self._pixels[y0:y1].copy()

    def close(self) -> None:
        self._pixels = np.zeros((0, self.width, 3), dtype=np.uint8)


def _import_openslide(path: str, why: str = ''):
    try:
        import openslide
    except (ImportError, OSError) as err:   # OSError: openslide-python without the OpenSlide library
        raise ImportError(f"reading {path} needs OpenSlide{why}: {_OPENSLIDE_INSTALL} "
                          f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'missing'})") from None
    return openslide


class _OpenSlideSource(ImageSource):
    """A whole-slide image through OpenSlide (optional extra), read by ``read_region`` in bands of rows."""

    def __init__(self, path: str, downsample: float, why: str = ''):
        openslide = _import_openslide(path, why)
        self.path = path
        try:
            self._slide = openslide.OpenSlide(path)
        except Exception as err:  # OpenSlideUnsupportedFormatError, OpenSlideError
            raise ValueError(f"cannot read {path} as a whole-slide image: {type(err).__name__}: {err}") from None
        downsamples = [float(d) for d in self._slide.level_downsamples]
        self._level = _choose_level(downsamples, downsample)
        self.downsample = downsamples[self._level]
        self.width, self.height = (int(v) for v in self._slide.level_dimensions[self._level])
        full_w, full_h = (int(v) for v in self._slide.level_dimensions[0])
        vendor = self._slide.properties.get('openslide.vendor', 'slide')
        self.description = ', '.join([
            f"OpenSlide {vendor} {full_w} x {full_h}",
            _level_phrase(self._level, len(downsamples), self.downsample, downsample),
            *([f"read {self.width} x {self.height}"] if len(downsamples) > 1 else [])])

    def _read(self, y0: int, y1: int) -> np.ndarray:
        out = np.empty((y1 - y0, self.width, 3), dtype=np.uint8)
        for x0 in range(0, self.width, _OPENSLIDE_COLUMNS):
            x1 = min(x0 + _OPENSLIDE_COLUMNS, self.width)
            location = (int(x0 * self.downsample), int(y0 * self.downsample))     # level-0 coordinates
            region = self._slide.read_region(location, self._level, (x1 - x0, y1 - y0))
            out[:, x0:x1] = to_rgb_array(region)
        return out

    def close(self) -> None:
        self._slide.close()


# ---------------------------------------------------------------------------------------------------- maps

def _preview_indices(size: int, preview: int) -> np.ndarray:
    """Nearest source index (pixel centres) of each of ``preview`` samples over ``size``."""
    return np.minimum(((np.arange(preview) + 0.5) * size / preview).astype(np.int64), size - 1)


def _preview_shape(height: int, width: int, side: int) -> tuple[int, int]:
    if max(height, width) <= side:
        return height, width
    scale = side / max(height, width)
    return max(1, min(side, round(height * scale))), max(1, min(side, round(width * scale)))


class NearestPreview:
    """A map of ``height`` x ``width`` sampled to a longer side <= ``side`` (nearest, the pixel under each sample's
    centre) as its rows arrive, so that the whole map never needs to exist: ``add(y0, rows)`` keeps the samples of
    rows [n, width] y0 .. y0 + n - 1, ``image`` [ph, pw] of ``dtype`` holds them (zeros where no row was added)."""

    def __init__(self, height: int, width: int, dtype: np.dtype, side: int = 1024):
        ph, pw = _preview_shape(height, width, side)
        self._rows, self._cols = _preview_indices(height, ph), _preview_indices(width, pw)
        self.image = np.zeros((ph, pw), dtype=dtype)

    def add(self, y0: int, rows: np.ndarray) -> None:
        picked = np.nonzero((self._rows >= y0) & (self._rows < y0 + rows.shape[0]))[0]
        if picked.size:
            self.image[picked] = rows[self._rows[picked] - y0][:, self._cols]


class _Abort(Exception):
    pass


class MapWriter:
    """A map of one sample per pixel written as a tiled, zlib-compressed BigTIFF, rows strictly top to bottom, in
    bounded memory: what ``ClassMapWriter`` (class ids) and ``ValueMapWriter`` (float32 values: depth) share.

    Args:
        path: the .tif to write (overwritten).
        height, width: the map's size.
        dtype: the stored sample type; ``description``: the file's ImageDescription (', downsample D' is added).
        tile: the TIFF tile side (a multiple of 16, as TIFF requires).
        georef: ``source.georef`` of a GeoTIFF input; written scaled to this map's size.
        downsample: ``source.downsample`` of the level the map was predicted on: one map pixel covers downsample x
            downsample pixels of the full-size image. Recorded in the file, so that the map can be placed on the
            full-resolution image: as its resolution (XResolution = YResolution = 1 / downsample pixels per
            full-size pixel, ResolutionUnit none) and in its ImageDescription ('..., downsample 4').
        preview_side: the longer side of ``preview`` at most.

    ``write_rows(y0, rows)`` takes samples [n, width] for rows y0 .. y0 + n - 1, any n, y0 the first row not yet
    written. ``close()`` (or leaving the ``with`` block) finishes the file; an incomplete map is a ValueError and
    its file is removed, as it is when the ``with`` block is left by an exception. After closing, ``preview`` is
    the map sampled (``NearestPreview``) to a longer side <= ``preview_side``: [ph, pw] of ``dtype``.
    """
    #: what the map and its samples are called in messages
    kind, samples = 'map', 'values'

    def __init__(self, path: str | os.PathLike, height: int, width: int, dtype: np.dtype, description: str,
                 tile: int = 256, georef: GeoReference | None = None, downsample: float = 1.0,
                 preview_side: int = 1024):
        path = os.fspath(path)
        tifffile = _import_tifffile(path)
        if height < 1 or width < 1:
            raise ValueError(f"{path}: a {self.kind} must be at least 1 x 1 pixels, got {width} x {height}")
        if tile < 16 or tile % 16:
            raise ValueError(f"{path}: the tile side must be a positive multiple of 16 (TIFF), got {tile}")
        if preview_side < 1:
            raise ValueError(f"{path}: preview_side must be >= 1, got {preview_side}")
        if not downsample >= 1:
            raise ValueError(f"{path}: downsample must be >= 1 (1: full size), got {downsample}")
        if georef is not None and not isinstance(georef, GeoReference):
            raise ValueError(f"{path}: georef must be an ImageSource's georef (a GeoReference) or None, "
                             f"got {type(georef).__name__}")
        try:
            open(path, 'wb').close()
        except OSError as err:
            raise ValueError(f"cannot write the {self.kind} {path}: {err.strerror or err}") from None
        self.path, self.height, self.width, self.tile = path, height, width, tile
        self.dtype = np.dtype(dtype)
        self._next = 0
        self._pending = np.zeros((0, width), dtype=self.dtype)
        self._preview = NearestPreview(height, width, self.dtype, preview_side)
        self._closed = False
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        extratags = georef.for_size(width, height).extratags() if georef is not None else []
        options = dict(shape=(height, width), dtype=self.dtype, tile=(tile, tile), compression='zlib',
                       photometric='minisblack', metadata=None, extratags=extratags,
                       resolution=(1 / downsample, 1 / downsample), resolutionunit='NONE',
                       description=f'{description}, downsample {downsample:g}')
        self._thread = threading.Thread(target=self._write, args=(tifffile, options), daemon=True,
                                        name=type(self).__name__)
        self._thread.start()

    @property
    def preview(self) -> np.ndarray:
        if not self._closed:
            raise ValueError(f"{self.path}: the preview is complete only after close()")
        return self._preview.image

    def _tiles(self) -> Iterator[np.ndarray]:
        while True:
            band = self._queue.get()
            if band is None:
                return
            if band is _Abort:
                raise _Abort
            for x0 in range(0, self.width, self.tile):
                yield np.ascontiguousarray(band[:, x0:x0 + self.tile])   # tifffile zero-pads edge tiles

    def _write(self, tifffile, options: dict) -> None:
        try:
            with tifffile.TiffWriter(self.path, bigtiff=True) as writer:
                writer.write(self._tiles(), **options)
        except _Abort:
            pass
        except BaseException as err:  # reported to the caller by the next write_rows or close
            self._error = err
            while True:               # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break

    def _put(self, item) -> None:
        while True:
            self._raise_writer_error()
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            err = self._error
            raise ValueError(f"writing {self.path} failed: {type(err).__name__}: {err}") from err

    def _check_values(self, y0: int, rows: np.ndarray) -> None:
        """ValueError naming the file when ``rows`` hold samples the map cannot store (a subclass's rule)."""

    def write_rows(self, y0: int, rows: np.ndarray) -> None:
        """Samples [n, width] of rows y0 .. y0 + n - 1; y0 must be the first row not yet written."""
        if self._closed:
            raise ValueError(f"{self.path}: write_rows after close()")
        rows = np.asarray(rows)
        if y0 != self._next:
            raise ValueError(f"{self.path}: rows must be written in order, top to bottom: expected y0 = {self._next}, "
                             f"got {y0}")
        if rows.ndim != 2 or rows.shape[1] != self.width or y0 + rows.shape[0] > self.height:
            raise ValueError(f"{self.path}: expected {self.samples} [n, {self.width}] with y0 + n <= {self.height}, "
                             f"got shape {tuple(rows.shape)} at y0 = {y0}")
        self._check_values(y0, rows)
        n = rows.shape[0]
        rows = rows.astype(self.dtype, copy=False)
        self._preview.add(y0, rows)
        self._pending = np.concatenate([self._pending, rows]) if self._pending.shape[0] else rows.copy()
        self._next += n
        while self._pending.shape[0] >= self.tile or (self._next == self.height and self._pending.shape[0]):
            self._put(self._pending[:self.tile])
            self._pending = self._pending[self.tile:]
        if self._next == self.height:
            self._put(None)

    def close(self) -> None:
        """Finish the file; a ValueError (and no file) if fewer than ``height`` rows were written."""
        if self._closed:
            return
        self._closed = True
        if self._next < self.height:
            self._abort()
            raise ValueError(f"{self.path}: only {self._next} of {self.height} rows were written; the {self.kind} "
                             f"is incomplete and was removed")
        self._thread.join()
        self._raise_writer_error()

    def _abort(self) -> None:
        self._closed = True
        if self._thread.is_alive() and self._error is None:
            try:
                self._queue.put(_Abort, timeout=60)
            except queue.Full:
                pass
        self._thread.join()
        try:
            os.remove(self.path)
        except OSError:
            pass

    def __enter__(self) -> MapWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            if not self._closed:
                self._abort()
            return
        self.close()


class ClassMapWriter(MapWriter):
    """A class map (``MapWriter``): class ids 0 .. num_classes - 1, stored as uint8 up to 256 classes, else uint16
    (<= 65536); ``write_rows`` refuses other ids. Its ImageDescription: 'linvit class map, K classes, downsample D'."""
    kind, samples = 'class map', 'class ids'

    def __init__(self, path: str | os.PathLike, height: int, width: int, num_classes: int, tile: int = 256,
                 georef: GeoReference | None = None, downsample: float = 1.0, preview_side: int = 1024):
        if not 1 <= num_classes <= 65536:
            raise ValueError(f"{os.fspath(path)}: num_classes must be in 1 .. 65536, got {num_classes}")
        self.num_classes = num_classes
        super().__init__(path, height, width, np.uint8 if num_classes <= 256 else np.uint16,
                         f'linvit class map, {num_classes} classes', tile, georef, downsample, preview_side)

    def _check_values(self, y0: int, rows: np.ndarray) -> None:
        if rows.dtype.kind not in 'uib':
            raise ValueError(f"{self.path}: class ids must be integers, got {rows.dtype}")
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_classes):
            raise ValueError(f"{self.path}: class ids must be in 0 .. {self.num_classes - 1}, got values in "
                             f"{rows.min()} .. {rows.max()} in rows {y0}..{y0 + rows.shape[0]}")


class ValueMapWriter(MapWriter):
    """A map of float32 values (``MapWriter``): a depth map in metres, say. ``name`` and ``unit`` go into its
    ImageDescription: 'linvit depth map (m), downsample D'; ``write_rows`` takes float rows."""
    kind = 'value map'

    def __init__(self, path: str | os.PathLike, height: int, width: int, name: str, unit: str, tile: int = 256,
                 georef: GeoReference | None = None, downsample: float = 1.0, preview_side: int = 1024):
        self.kind = f'{name} map'
        super().__init__(path, height, width, np.float32, f'linvit {name} map ({unit})', tile, georef, downsample,
                         preview_side)

    def _check_values(self, y0: int, rows: np.ndarray) -> None:
        if rows.dtype.kind != 'f':
            raise ValueError(f"{self.path}: the values of a {self.kind} must be floats, got {rows.dtype}")


# ---------------------------------------------------------------------------------------------------- PNGs

def _palette_uint8(palette: np.ndarray, preview: np.ndarray, path: str) -> np.ndarray:
    palette = np.asarray(palette)
    if palette.ndim != 2 or palette.shape[1] != 3 or not len(palette):
        raise ValueError(f"{path}: the palette must be [num_classes, 3] RGB, got shape {tuple(palette.shape)}")
    if palette.dtype.kind == 'f':
        palette = palette * 255 if palette.max() <= 1 else palette
        palette = np.clip(np.rint(palette), 0, 255)
    palette = palette.astype(np.uint8)
    if preview.size and (preview.min() < 0 or preview.max() >= len(palette)):
        raise ValueError(f"{path}: class id {preview.max()} has no colour in a palette of {len(palette)}")
    return palette


def write_preview_png(preview: np.ndarray, path: str | os.PathLike, palette: np.ndarray) -> None:
    """The preview (class ids [ph, pw]) coloured by ``palette`` ([num_classes, 3], uint8 or float in [0, 1])."""
    path = os.fspath(path)
    preview = np.asarray(preview)
    if preview.ndim != 2:
        raise ValueError(f"{path}: the preview must be class ids [h, w], got shape {tuple(preview.shape)}")
    Image.fromarray(_palette_uint8(palette, preview, path)[preview.astype(np.int64)]).save(path)


def _box_bounds(size: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Source ranges [start, end) of ``samples`` boxes over ``size`` (at least one pixel each)."""
    starts = (np.arange(samples) * size) // samples
    ends = np.maximum((np.arange(1, samples + 1) * size) // samples, starts + 1)
    return starts, ends


def _box_sums(values: np.ndarray, samples: int, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Sums over ``samples`` boxes along ``axis`` (uint64) and the box sizes; nearest pixel when upsampling."""
    starts, ends = _box_bounds(values.shape[axis], samples)
    if samples > values.shape[axis]:
        return np.take(values, starts, axis=axis).astype(np.uint64), np.ones(samples, dtype=np.int64)
    return np.add.reduceat(values, starts, axis=axis, dtype=np.uint64), ends - starts


def write_overlay_png(source: ImageSource, preview: np.ndarray, path: str | os.PathLike, palette: np.ndarray,
                      alpha: float = 0.5) -> None:
    """The image of ``source`` at the preview's size (box average, read band by band), classes blended in.

    Each pixel is (1 - alpha) * image + alpha * class colour. Memory: a band of source rows (about 16 MB), its
    row sums (as large) and the preview-sized result; the image is never read whole.
    """
    path = os.fspath(path)
    preview = np.asarray(preview)
    if preview.ndim != 2 or not preview.size:
        raise ValueError(f"{path}: the preview must be class ids [h, w], got shape {tuple(preview.shape)}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"{path}: alpha must be in [0, 1], got {alpha}")
    colours = _palette_uint8(palette, preview, path)[preview.astype(np.int64)].astype(np.float32)
    ph, pw = preview.shape
    starts, ends = _box_bounds(source.height, ph)
    image = np.empty((ph, pw, 3), dtype=np.float32)
    rows_per_band = max(1, _OVERLAY_BAND_BYTES // (3 * source.width))
    i = 0
    while i < ph:        # preview rows i .. j - 1 from one band of source rows
        j = i + 1
        while j < ph and ends[j] - starts[i] <= rows_per_band:
            j += 1
        band = source.read(int(starts[i]), int(ends[j - 1]))
        # a sum per preview row: a reduction casts to uint64 in small buffers, where reduceat would cast the band
        # (8 bytes per sample: 8x the band's memory)
        row_sums = np.stack([band[a:b].sum(axis=0, dtype=np.uint64) for a, b in
                             zip(starts[i:j] - starts[i], ends[i:j] - starts[i])])    # [j - i, width, 3]
        row_counts = ends[i:j] - starts[i:j]
        sums, col_counts = _box_sums(row_sums, pw, axis=1)
        image[i:j] = sums / (row_counts[:, None, None] * col_counts[None, :, None])
        i = j
    blended = (1 - alpha) * image + alpha * colours
    Image.fromarray(np.clip(np.rint(blended), 0, 255).astype(np.uint8)).save(path)
