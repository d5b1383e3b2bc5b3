"""COCO-format detection data, laid out as mmdetection and torchvision's ``CocoDetection`` read it::

    root/annotations/instances_train.json    COCO's format: 'images', 'annotations', 'categories'
    root/annotations/instances_val.json
    root/train/<file_name>                   file_name as the annotation file gives it (subfolders allowed)
    root/val/<file_name>

``read_coco_split(root, 'val')`` reads one split into plain arrays per image: boxes [N, 4] float32 x1, y1, x2, y2 in
pixels (COCO's [x, y, w, h] converted), labels [N] int64 counting from 1 in the order of the category ids (COCO's
ids 1, 2, 3, 5, ... become 1, 2, 3, 4, ...: the label torchvision's detectors take, 0 being their background), and
the crowd flags. Everything the annotation file promises is checked when it is read, each problem one line naming
the file, the entry and what was expected: the file and folder, the JSON, the three lists, duplicate ids,
annotations of unknown images or categories, boxes that are not four finite numbers or have negative sides, and
image files that are not there or whose size (read from the file's header, EXIF orientation applied, without
decoding the pixels) is not the ``width`` and ``height`` the file gives them: the boxes are in those pixels. Boxes of
zero width or height (COCO has a few) are kept out of training and listed in ``CocoSplit.degenerate`` for the caller
to report, never dropped silently.

``CocoSplit.annotation_file`` is where the split was read from: evaluation scores against that file itself
(``linvit.engine.metrics.coco_file_metrics``: its crowds, areas and ids), and ``category_ids`` maps labels back to
the file's category ids. ``read_coco_categories`` and ``read_coco_images`` read just the categories or the image
entries of an annotation file (a run's recorded ids; prediction with ``--annotations``).

Instance masks (Mask R-CNN): ``read_coco_split(root, split, masks=True)`` also checks every object's
``segmentation`` (polygons: lists of at least 3 x, y points; or a run-length encoding of the image's size), and
``instance_masks(image)`` decodes them with pycocotools into uint8 [N, H, W].
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .base import DataError

__all__ = ['CocoImage', 'CocoSplit', 'read_coco_split', 'annotation_file', 'check_same_categories',
           'instance_masks', 'read_coco_categories', 'read_coco_images', 'upright_size']

#: the keys every entry of each list must have
_IMAGE_KEYS = ('id', 'file_name', 'width', 'height')
_ANNOTATION_KEYS = ('id', 'image_id', 'category_id', 'bbox')
_CATEGORY_KEYS = ('id', 'name')
#: how many missing files a message names before it counts the rest
_NAMED = 3
#: the EXIF tag of the image's orientation
_EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True)
class CocoImage:
    """One image of a split: its file, size and objects (boxes [N, 4] float32 xyxy pixels, labels [N] int64 1..K,
    crowd [N] bool, and each object's COCO ``segmentation`` as the file gives it, None where it has none)."""
    path: str
    image_id: int
    width: int
    height: int
    boxes: np.ndarray
    labels: np.ndarray
    crowd: np.ndarray
    segmentations: tuple[Any, ...] = ()


@dataclass(frozen=True)
class CocoSplit:
    """A split: its images (in the annotation file's order), the class names (label i names class_names[i - 1]),
    the COCO category id of each label (label i is category_ids[i - 1]), the annotation ids of zero-size boxes left
    out, and the annotation file it was read from."""
    images: list[CocoImage]
    class_names: list[str]
    category_ids: list[int]
    degenerate: list[int] = field(default_factory=list)
    annotation_file: str = ''


def annotation_file(root: str | os.PathLike, split: str) -> Path:
    return Path(root) / 'annotations' / f'instances_{split}.json'


def _layout_hint(root: Path) -> str:
    return (f"a COCO-format set has {root}/annotations/instances_{{train,val}}.json and its images under "
            f"{root}/{{train,val}}/ (the layout of mmdetection and torchvision's CocoDetection)")


def _load_json(path: Path, root: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DataError(f"{path} does not exist: {_layout_hint(root)}")
    try:
        with open(path, encoding='utf-8') as f:
            content = json.load(f)
    except json.JSONDecodeError as error:
        raise DataError(f"{path} is not JSON ({error.msg} at line {error.lineno}, column {error.colno})") from None
    if not isinstance(content, dict):
        raise DataError(f"{path} holds a {type(content).__name__}; expected a COCO object with 'images', "
                        f"'annotations' and 'categories'")
    missing = [key for key in ('images', 'annotations', 'categories') if not isinstance(content.get(key), list)]
    if missing:
        raise DataError(f"{path} has no {missing[0]!r} list; a COCO annotation file has 'images', 'annotations' and "
                        f"'categories' lists")
    return content


def _check_entries(path: Path, name: str, entries: list[Any], keys: tuple[str, ...]) -> None:
    """Every entry a dict with ``keys``, and unique ids."""
    seen: set[Any] = set()
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or any(key not in entry for key in keys):
            lacking = [key for key in keys if not isinstance(entry, dict) or key not in entry]
            raise DataError(f"{path}: {name}[{index}] has no {lacking[0]!r}; each entry of {name!r} needs "
                            f"{', '.join(repr(k) for k in keys)}")
        if entry['id'] in seen:
            raise DataError(f"{path}: {name}[{index}] repeats id {entry['id']!r}; ids must be unique")
        seen.add(entry['id'])


def _xyxy(path: Path, annotation: dict[str, Any]) -> tuple[float, float, float, float]:
    box = annotation['bbox']
    if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                              and math.isfinite(v) for v in box)):
        raise DataError(f"{path}: annotation id {annotation['id']} has bbox {box!r}; expected [x, y, width, height], "
                        f"four finite numbers")
    x, y, width, height = (float(v) for v in box)
    if width < 0 or height < 0:
        raise DataError(f"{path}: annotation id {annotation['id']} has bbox {box!r} with a negative width or height")
    return x, y, x + width, y + height


def _check_files(images: list[CocoImage], folder: Path, path: Path) -> None:
    missing = [image.path for image in images if not os.path.isfile(image.path)]
    if missing:
        named = ', '.join(os.path.relpath(p, folder) for p in missing[:_NAMED])
        more = f" and {len(missing) - _NAMED} more" if len(missing) > _NAMED else ''
        raise DataError(f"{len(missing)} image(s) of {path} are not in {folder}: {named}{more}")


def upright_size(path: str | os.PathLike) -> tuple[int, int]:
    """(width, height) of the image file as ``linvit.data.folder.load_rgb`` decodes it (EXIF orientation applied),
    read from its header only."""
    from PIL import Image
    with Image.open(path) as image:
        width, height = image.size
        # orientations 5..8 turn the stored image by 90 degrees
        return (height, width) if image.getexif().get(_EXIF_ORIENTATION, 1) in (5, 6, 7, 8) else (width, height)


def _check_sizes(images: list[CocoImage], path: Path) -> None:
    """DataError naming the first image whose file is not the size the annotation file gives it (its boxes are in
    the annotation's pixels: a larger file would train on misplaced boxes, a smaller one loses them)."""
    wrong = [(image, size) for image in images
             if (size := upright_size(image.path)) != (image.width, image.height)]
    if wrong:
        image, (width, height) = wrong[0]
        more = f" ({len(wrong) - 1} more image(s) differ too)" if len(wrong) > 1 else ''
        raise DataError(f"{image.path} is width {width}, height {height}, but {path} gives it width {image.width}, "
                        f"height {image.height} (image id {image.image_id!r}); its boxes are in the annotation's "
                        f"pixels: fix the entry or the file{more}")


def _check_segmentation(path: Path, annotation: dict[str, Any], image: dict[str, Any]) -> None:
    """A mask the decoder takes: polygons (a list of lists of x, y numbers, at least 3 points each) or a
    run-length encoding {'size': [height, width] of the image, 'counts': a list or a string}."""
    segmentation = annotation.get('segmentation')
    where = f"{path}: annotation id {annotation['id']}"
    if isinstance(segmentation, dict):
        size = [image['height'], image['width']]
        if segmentation.get('size') != size or not isinstance(segmentation.get('counts'), (list, str)):
            raise DataError(f"{where} has a run-length segmentation with size {segmentation.get('size')!r}; expected "
                            f"{{'size': {size} (its image's height, width), 'counts': a list or string}}")
        return
    polygons_ok = isinstance(segmentation, list) and bool(segmentation) and all(
        isinstance(polygon, list) and len(polygon) >= 6 and len(polygon) % 2 == 0
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in polygon)
        for polygon in segmentation)
    if not polygons_ok:
        shown = repr(segmentation) if len(repr(segmentation)) <= 60 else repr(segmentation)[:57] + '...'
        raise DataError(f"{where} has segmentation {shown}; Mask R-CNN needs each object's mask: polygons "
                        f"[[x1, y1, x2, y2, x3, y3, ...], ...] (3 points or more) or a run-length encoding")


def read_coco_split(root: str | os.PathLike, split: str, masks: bool = False) -> CocoSplit:
    """The split ``split`` ('train' or 'val') of the COCO-format set at ``root``; DataError (one line) for anything
    the layout or the annotation file gets wrong (module docstring). ``masks``: every object (crowds included) must
    have a segmentation ``instance_masks`` can decode."""
    root = Path(root)
    path = annotation_file(root, split)
    content = _load_json(path, root)
    folder = root / split
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder: {_layout_hint(root)}")
    _check_entries(path, 'images', content['images'], _IMAGE_KEYS)
    _check_entries(path, 'annotations', content['annotations'], _ANNOTATION_KEYS)
    _check_entries(path, 'categories', content['categories'], _CATEGORY_KEYS)
    categories = sorted(content['categories'], key=lambda c: c['id'])
    if not categories:
        raise DataError(f"{path} has no categories; a detection set needs at least one class")
    label_of = {category['id']: label for label, category in enumerate(categories, start=1)}
    image_of = {image['id']: image for image in content['images']}
    objects: dict[Any, list[tuple[tuple[float, ...], int, bool, Any]]] = {key: [] for key in image_of}
    degenerate = []
    for annotation in content['annotations']:
        if annotation['image_id'] not in objects:
            raise DataError(f"{path}: annotation id {annotation['id']} names image_id {annotation['image_id']!r}, "
                            f"which 'images' does not list")
        if annotation['category_id'] not in label_of:
            raise DataError(f"{path}: annotation id {annotation['id']} names category_id "
                            f"{annotation['category_id']!r}, which 'categories' does not list")
        box = _xyxy(path, annotation)
        if box[2] == box[0] or box[3] == box[1]:
            degenerate.append(annotation['id'])
            continue
        if masks:
            _check_segmentation(path, annotation, image_of[annotation['image_id']])
        objects[annotation['image_id']].append((box, label_of[annotation['category_id']],
                                                bool(annotation.get('iscrowd', 0)), annotation.get('segmentation')))
    images = [_image(folder, image, objects[image['id']]) for image in content['images']]
    _check_files(images, folder, path)
    _check_sizes(images, path)
    return CocoSplit(images, [str(c['name']) for c in categories], [c['id'] for c in categories], degenerate,
                     str(path))


def read_coco_categories(path: str | os.PathLike) -> list[tuple[int, str]]:
    """(id, name) of every category of the annotation file ``path``, by id; DataError (one line) for a file that is
    not a COCO annotation file or has no categories."""
    path = Path(path)
    content = _load_json(path, path.parent.parent)
    _check_entries(path, 'categories', content['categories'], _CATEGORY_KEYS)
    if not content['categories']:
        raise DataError(f"{path} has no categories; a detection set needs at least one class")
    return sorted((category['id'], str(category['name'])) for category in content['categories'])


def read_coco_images(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The 'images' entries ({'id', 'file_name', 'width', 'height', ...}) of the annotation file ``path``, checked
    as ``read_coco_split`` checks them."""
    path = Path(path)
    content = _load_json(path, path.parent.parent)
    _check_entries(path, 'images', content['images'], _IMAGE_KEYS)
    return content['images']


def _image(folder: Path, entry: dict[str, Any], found: list[tuple[tuple[float, ...], int, bool, Any]]
           ) -> CocoImage:
    boxes = np.array([box for box, _, _, _ in found], dtype=np.float32).reshape(-1, 4)
    labels = np.array([label for _, label, _, _ in found], dtype=np.int64)
    crowd = np.array([is_crowd for _, _, is_crowd, _ in found], dtype=bool)
    return CocoImage(str(folder / entry['file_name']), entry['id'], int(entry['width']), int(entry['height']), boxes,
                     labels, crowd, tuple(segmentation for _, _, _, segmentation in found))


def instance_masks(image: CocoImage, keep: np.ndarray | None = None) -> np.ndarray:
    """The objects' masks uint8 [N, height, width] (1 inside), decoded from their polygons or run-length encodings
    by pycocotools (the objects ``keep`` selects, bool [N], or all). The split must have been read with
    ``masks=True``, which checked them."""
    from pycocotools import mask as mask_utils
    chosen = list(image.segmentations) if keep is None else [s for s, kept in zip(image.segmentations, keep) if kept]
    masks = np.zeros((len(chosen), image.height, image.width), dtype=np.uint8)
    for index, segmentation in enumerate(chosen):
        if isinstance(segmentation, dict) and isinstance(segmentation['counts'], str):
            rle = segmentation  # compressed, as pycocotools writes it
        else:  # polygons, or an uncompressed run-length encoding (COCO's crowds)
            rle = mask_utils.frPyObjects(segmentation, image.height, image.width)
            rle = mask_utils.merge(rle) if isinstance(rle, list) else rle
        masks[index] = mask_utils.decode(rle)
    return masks


def check_same_categories(train: CocoSplit, val: CocoSplit, root: str | os.PathLike) -> None:
    """DataError unless both splits name the same categories with the same ids (a label must mean one class)."""
    if list(zip(train.category_ids, train.class_names)) != list(zip(val.category_ids, val.class_names)):
        raise DataError(f"{annotation_file(root, 'val')} and {annotation_file(root, 'train')} list different "
                        f"categories (id, name); both splits must use the same ones")
