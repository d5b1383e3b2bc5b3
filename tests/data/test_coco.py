"""linvit.data.coco: COCO-format detection sets as mmdetection and torchvision's CocoDetection read them. Boxes and
labels against the annotation file written here by hand; each layout or annotation mistake is one line naming the
file and the entry."""
import json

import numpy as np
import pytest
from PIL import Image

from linvit.data.base import DataError
from linvit.data.coco import check_same_categories, read_coco_split


def _write_set(root, annotations=None, categories=None, images=('a.png', 'sub/b.png'), split='val'):
    (root / 'annotations').mkdir(parents=True, exist_ok=True)
    for name in images:
        (root / split / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new('RGB', (40, 30)).save(root / split / name)
    content = {
        'images': [{'id': 10 + i, 'file_name': name, 'width': 40, 'height': 30} for i, name in enumerate(images)],
        'annotations': annotations if annotations is not None else [
            {'id': 1, 'image_id': 10, 'category_id': 5, 'bbox': [2, 3, 10, 20], 'iscrowd': 0},
            {'id': 2, 'image_id': 10, 'category_id': 1, 'bbox': [0.5, 0, 4.5, 6], 'iscrowd': 1},
            {'id': 3, 'image_id': 11, 'category_id': 5, 'bbox': [5, 5, 0, 8]}],
        'categories': categories if categories is not None else [{'id': 5, 'name': 'ship'},
                                                                 {'id': 1, 'name': 'car'}]}
    path = root / 'annotations' / f'instances_{split}.json'
    path.write_text(json.dumps(content))
    return path


def test_boxes_labels_and_crowds_are_read_as_written(tmp_path):
    _write_set(tmp_path)
    split = read_coco_split(tmp_path, 'val')
    assert split.class_names == ['car', 'ship'] and split.category_ids == [1, 5]  # labels follow the category ids
    first, second = split.images
    assert first.path == str(tmp_path / 'val' / 'a.png') and (first.width, first.height) == (40, 30)
    np.testing.assert_array_equal(first.boxes, np.array([[2, 3, 12, 23], [0.5, 0, 5, 6]], dtype=np.float32))
    np.testing.assert_array_equal(first.labels, [2, 1])
    np.testing.assert_array_equal(first.crowd, [False, True])
    assert second.boxes.shape == (0, 4) and second.labels.shape == (0,)  # its only box has zero width
    assert split.degenerate == [3]


def test_the_splits_must_share_their_categories(tmp_path):
    _write_set(tmp_path, split='train')
    _write_set(tmp_path, split='val', categories=[{'id': 5, 'name': 'boat'}, {'id': 1, 'name': 'car'}])
    with pytest.raises(DataError, match='list different categories'):
        check_same_categories(read_coco_split(tmp_path, 'train'), read_coco_split(tmp_path, 'val'), tmp_path)


ANNOTATION = {'id': 1, 'image_id': 10, 'category_id': 5, 'bbox': [2, 3, 10, 20]}


@pytest.mark.parametrize('change, words', [
    (lambda root, path: path.unlink(), r'instances_val.json does not exist: a COCO-format set has .*annotations'),
    (lambda root, path: path.write_text('{"images": [}'), r'instances_val.json is not JSON \(.* line 1'),
    (lambda root, path: path.write_text('{"images": []}'), r"has no 'annotations' list"),
    (lambda root, path: (root / 'val' / 'a.png').unlink(), r"1 image\(s\) of .*json are not in .*: a.png"),
])
def test_layout_mistakes_are_one_line(tmp_path, change, words):
    path = _write_set(tmp_path)
    change(tmp_path, path)
    with pytest.raises(DataError, match=words) as error:
        read_coco_split(tmp_path, 'val')
    assert '\n' not in str(error.value)


def test_a_missing_image_folder_is_one_line(tmp_path):
    _write_set(tmp_path)
    (tmp_path / 'val' / 'a.png').unlink()
    (tmp_path / 'val' / 'sub' / 'b.png').unlink()
    (tmp_path / 'val' / 'sub').rmdir()
    (tmp_path / 'val').rmdir()
    with pytest.raises(DataError, match=r'val is not a folder: a COCO-format set'):
        read_coco_split(tmp_path, 'val')


@pytest.mark.parametrize('annotation, words', [
    ({**ANNOTATION, 'image_id': 99}, r"annotation id 1 names image_id 99, which 'images' does not list"),
    ({**ANNOTATION, 'category_id': 7}, r"annotation id 1 names category_id 7, which 'categories' does not list"),
    ({**ANNOTATION, 'bbox': [1, 2, 3]}, r"annotation id 1 has bbox \[1, 2, 3\]; expected \[x, y, width, height\]"),
    ({**ANNOTATION, 'bbox': [1, 2, 3, float('nan')]}, r"four finite numbers"),
    ({**ANNOTATION, 'bbox': [1, 2, -3, 4]}, r"negative width or height"),
    ({key: value for key, value in ANNOTATION.items() if key != 'bbox'}, r"annotations\[0\] has no 'bbox'"),
])
def test_annotation_mistakes_name_the_annotation(tmp_path, annotation, words):
    _write_set(tmp_path, annotations=[annotation])
    with pytest.raises(DataError, match=words) as error:
        read_coco_split(tmp_path, 'val')
    assert 'instances_val.json' in str(error.value) and '\n' not in str(error.value)


def test_repeated_ids_and_no_categories_are_refused(tmp_path):
    _write_set(tmp_path, annotations=[ANNOTATION, ANNOTATION])
    with pytest.raises(DataError, match=r"annotations\[1\] repeats id 1"):
        read_coco_split(tmp_path, 'val')
    _write_set(tmp_path, annotations=[], categories=[])
    with pytest.raises(DataError, match='has no categories'):
        read_coco_split(tmp_path, 'val')


@pytest.mark.parametrize('size', [(80, 60), (20, 15)])
def test_an_image_whose_size_is_not_the_annotations_is_one_line_naming_both(tmp_path, size):
    """Twice as large (boxes would land on the wrong pixels) or half as large (the boxes leave the image): refused
    when the split is read, naming the image, the annotation file and both sizes."""
    path = _write_set(tmp_path)
    Image.new('RGB', size).save(tmp_path / 'val' / 'sub' / 'b.png')
    with pytest.raises(DataError) as error:
        read_coco_split(tmp_path, 'val')
    message = str(error.value)
    assert '\n' not in message and str(tmp_path / 'val' / 'sub' / 'b.png') in message and str(path) in message
    assert 'width 40, height 30' in message and f'width {size[0]}, height {size[1]}' in message


def test_exif_rotated_images_are_measured_upright(tmp_path):
    """A JPEG stored 30 x 40 with EXIF orientation 6 (rotated 90 degrees) is 40 x 30 as it loads: it matches."""
    _write_set(tmp_path, images=('a.png', 'sub/b.jpg'))
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new('RGB', (30, 40)).save(tmp_path / 'val' / 'sub' / 'b.jpg', exif=exif)
    assert [(i.width, i.height) for i in read_coco_split(tmp_path, 'val').images] == [(40, 30), (40, 30)]
