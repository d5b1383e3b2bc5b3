"""Predictions on image files of any size, from a trained run or an exported ONNX file: what ``tools/predict.py`` runs.

    predictor = load_predictor('runs/demo')               # a run directory, .pt, .safetensors or .onnx
    items, missing = collect_inputs(['photo.jpg', 'more/'])
    rows, skipped = classify_images(predictor, items, top_k=3)          # classification: top-k rows per image
    written, skipped = segment_images(predictor, items, 'masks/', mode='slide', window=512)   # segmentation
    written, skipped = depth_images(predictor, items, 'depth/')                                # depth maps
    written, skipped = detect_images(predictor, items, 'boxes/', mode='slide', window=512)    # detection

A ``Predictor`` hides the runtime: PyTorch (``linvit.engine.loading.load_trained``: the run's model, classes,
normalisation and seg.eval settings) or onnxruntime (``linvit.export.ort_session``; the file's ``linvit.*`` metadata
says its task, classes and normalisation). Classification resizes each image to the training size and normalises
it as validation does.

Segmentation runs each image at full resolution. Images are read by ``linvit.data.large_image.open_image``: PNG,
JPEG, ... through PIL; TIFF, BigTIFF, pyramidal TIFF and slide formats lazily, band by band (``downsample`` picks a
pyramid level). The mode is chosen per image (``choose_mode``) unless named: 'bounded' (the whole image in bands of
patch rows, ``linvit.models.iter_bounded_segment``: memory bounded, class ids made band by band, for a PyTorch model
whose attention has the state form), 'whole' (one forward) or 'slide' (windows; ``linvit.inference.segment``); the
log names the mode and why. TIFF and slide inputs give ``<name>_mask.tif`` (class ids, a tiled zlib BigTIFF that
keeps a GeoTIFF's georeferencing), ``<name>_preview.png`` and ``<name>_overlay.png`` (both downsampled to 1024 px);
other inputs ``<name>_mask.png`` (class ids, 8-bit; 16-bit above 256 classes) and ``<name>_overlay.png`` (the
classes coloured with the run's palette) at full size. An image that cannot be read (a missing optional reader
included) is skipped and reported as (path, reason); the others are still predicted; an image's files are complete or
absent (``_all_or_nothing``), and Ctrl-C raises ``PredictionInterrupted``.

Depth (a task whose models predict values per pixel, ``Task.predicts_values``; ``Predictor.values`` says which, from
the run's config or the ONNX file's metadata) goes through the same machinery (``_predict_maps``: the modes, their
choice, skipping, all-or-nothing files): the bands yield exp of the output (values float32) instead of class ids.
TIFF and slide inputs give ``<name>_depth.tif`` (float32 metres, or ``<name>_disparity.tif`` in 1/metres: a tiled zlib
BigTIFF written band by band, ``ValueMapWriter``, keeping a GeoTIFF's georeferencing), other inputs
``<name>_depth.png`` (16-bit, round(value / the run's data.depth_scale) clipped to 1..65535, 0 for a value that is not
finite: it reads back as the run's training maps do); both with ``<name>_preview.png`` (the depth colour map of the
run's pictures, near warm, downsampled to 1024 px).

Progress goes to stderr (tqdm): one line per image, and a bar over the bounded forward's blocks and tiles.

Detection (a PyTorch run) also runs each image at its own resolution, read by ``load_rgb``: 'whole' (one forward) up
to ``max_pixels``, else 'slide': overlapping tiles whose boxes are merged (``linvit.inference.detect_tiled``: each
tile keeps the boxes centred in the part it owns, then class-wise NMS), with a bar over the tiles. Tiles are the
largest within ``max_pixels`` (``detection_tile``) unless a ``window`` is given. Each forward keeps at most
``max_detections`` boxes (the run's detection.detections_per_image by default), and a forward that reaches the cap
is reported in one line. It writes ``detections.json``, a COCO-format file: images by file name, or by their id and
file_name in the set's annotation file (``annotations``); the run's classes as categories under the data set's own
ids (the run's detection.category_ids; 1..K for the built-in shapes); every detection as an annotation with its
score, boxes in the image's pixels (``pycocotools.coco.COCO`` and annotation tools read it, and
``COCO(annotation file).loadRes(its 'annotations')`` scores it), and ``<name>_overlay.png``, the boxes scored at
least ``min_score`` drawn in their class colours.
"""
import csv
import json
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from .data.folder import list_images, load_rgb, readable_extensions
from .data.large_image import (
    ClassMapWriter,
    ImageReadError,
    ImageSource,
    NearestPreview,
    ValueMapWriter,
    large_image_extensions,
    open_image,
    write_overlay_png,
    write_preview_png,
)
from .data.transforms import build_seg_transforms, build_transforms
from .engine.plots import class_palette, depth_colour_range, depth_colours, overlay_mask
from .inference import detect_tiled, segment
from .models.bounded import (
    DEFAULT_ROWS_PER_CHUNK,
    bounded_segment_unsupported_reason,
    iter_bounded_segment,
)
from .models.segmentation import class_ids

__all__ = ['Predictor', 'torch_predictor', 'onnx_predictor', 'load_predictor', 'Item', 'collect_inputs',
           'classify_images', 'write_predictions', 'segment_image', 'segment_images', 'save_mask_png',
           'PREDICTION_FIELDS', 'PREDICT_MODES', 'MASK_FORMATS', 'choose_mode', 'bounded_unavailable',
           'detect_images', 'detect_image', 'choose_detection_mode', 'DETECTIONS_FILE', 'OVERLAY_MIN_SCORE',
           'PredictionInterrupted', 'detection_tile', 'ValueMap', 'depth_images']

Logits = Callable[[torch.Tensor], torch.Tensor]
Skipped = List[Tuple[str, str]]  # (path, reason)

#: segmentation modes (--mode): 'auto' chooses one of the others per image (``choose_mode``)
PREDICT_MODES = ('auto', 'bounded', 'whole', 'slide')
#: class and value map formats (--mask-format): 'auto' writes tiff for the inputs in TIFF_INPUTS, png for the others
MASK_FORMATS = ('auto', 'tiff', 'png')
TIFF_INPUTS = large_image_extensions() | {'.tif', '.tiff'}
#: 'auto' runs a model without the state form whole up to this many pixels (2048 x 2048), in windows above
DEFAULT_MAX_PIXELS = 2048 * 2048
#: rows of a full-size overlay (PNG outputs) blended at a time
_OVERLAY_ROWS = 256

#: detection: the COCO-format file of every image's detections, in the output folder
DETECTIONS_FILE = 'detections.json'
#: detection overlays draw the boxes scored at least this (detections.json keeps every one with its score)
OVERLAY_MIN_SCORE = 0.3

#: the columns of predictions.csv
PREDICTION_FIELDS = ['file', 'rank', 'class_index', 'class_name', 'probability']


@dataclass(frozen=True)
class ValueMap:
    """What a model that predicts a value per pixel (a task's ``predicts_values``: depth) writes: its one output
    channel is the log of ``name`` (depth, disparity) in ``unit``; a 16-bit PNG stores value / ``png_scale``."""
    name: str
    unit: str
    png_scale: float
    larger_is_nearer: bool = False  # disparity: the preview colours its reciprocal, so that near is warm as for depth

    @classmethod
    def of(cls, record: Dict[str, object]) -> 'ValueMap':
        """From the task's record (``prediction_defaults()['values']``, an ONNX file's ``values`` metadata)."""
        return cls(str(record['name']), str(record['unit']), float(record['png_scale']),
                   bool(record.get('larger_is_nearer', False)))


@dataclass
class Predictor:
    """What predictions need from a model, whichever runtime holds it."""
    run: Logits  # normalised images float32 [B, 3, H, W] -> logits float32 [B, K] or [B, K, H, W]; a detector's:
    # per image {'boxes' [N, 4] xyxy pixels, 'scores' [N], 'labels' [N] 1..K} on the CPU
    task: str  # the task whose model it is (linvit.engine.TASKS): its logits_rank says how to read the output
    class_names: List[str]
    mean: Sequence[float]
    std: Sequence[float]
    img_size: Tuple[int, int]  # classification: images are resized to this; segmentation: the default window
    multiple: int  # image sides the model takes are multiples of this
    max_batch: Optional[int] = None  # a file exported for a fixed batch takes exactly this many images
    seg_defaults: Dict[str, object] = field(default_factory=dict)  # a run's task's (seg.eval: mode, window, stride)
    model: Optional[torch.nn.Module] = None  # the PyTorch model (None for ONNX): the bounded forward runs it
    device: str = 'cpu'
    values: Optional[ValueMap] = None  # a model that predicts values per pixel (depth): what they are


# ---------------------------------------------------------------------------------------------------- models

def torch_predictor(path: str, device: str = 'cpu') -> Predictor:
    """A trained run (directory, .pt or .safetensors beside config.yaml) on ``device``; ValueError for a run whose
    task's models predict neither labels, boxes nor values (``Task.not_predicted``: autoregressive)."""
    from .engine.loading import load_trained
    from .engine.tasks import TASKS, predicted_tasks
    trained = load_trained(path, device=device)
    task = TASKS.get(trained.task)
    if task.not_predicted:
        names = predicted_tasks()
        predicted = ' and '.join([', '.join(names[:-1]), names[-1]] if len(names) > 1 else names)
        raise ValueError(f"{path} is a task={trained.task!r} run; predict.py takes {predicted} runs "
                         f"({task.not_predicted})")
    model = trained.model

    @torch.no_grad()
    def logits(images: torch.Tensor) -> torch.Tensor:
        return model(images.to(device)).float().cpu()

    @torch.no_grad()
    def detections(images: torch.Tensor) -> List[Dict[str, torch.Tensor]]:
        return [{key: value.cpu() for key, value in found.items()} for found in model(images.to(device))]

    run = detections if task.predicts_boxes else logits

    multiple = getattr(model, 'input_multiple', None) or max(model.patch_embed.patch_size)
    values = ValueMap.of(trained.prediction_defaults['values']) if task.predicts_values else None
    return Predictor(run=run, task=trained.task, class_names=trained.class_names, mean=trained.mean, std=trained.std,
                     img_size=trained.img_size, multiple=int(multiple),
                     seg_defaults=dict(trained.prediction_defaults), model=model, device=device, values=values)


def onnx_predictor(path: str, threads: Optional[int] = None) -> Predictor:
    """An ONNX file written by ``linvit.export.export_onnx``, in onnxruntime with ``threads`` threads;
    ``linvit.export.StaleExportError`` when the run's weights it was exported from have changed since
    (``check_source_weights``)."""
    from .export import INPUT_NAME, check_source_weights, ort_session, read_metadata
    meta = read_metadata(path)
    parts = {'features': "a model's feature pyramid (exported with --features), not its predictions",
             'detector': "a whole detector for one image size (outputs boxes, labels, scores)"}
    if meta.get('part') in parts:
        raise ValueError(f"{path} holds {parts[meta['part']]}: predict with the run it was exported from "
                         f"({meta.get('source', 'its run directory')}), at any image size")
    check_source_weights(path, meta)
    session = ort_session(path, threads)
    declared = session.get_inputs()[0]
    input_dtype = np.float16 if 'float16' in declared.type else np.float32
    fixed_batch = declared.shape[0] if isinstance(declared.shape[0], int) else None

    def run(images: torch.Tensor) -> torch.Tensor:
        out = session.run(None, {INPUT_NAME: images.numpy().astype(input_dtype)})[0]
        return torch.from_numpy(out).float()

    num_classes = int(meta.get('num_classes') or 0) or int(session.get_outputs()[0].shape[1])
    names = [str(n) for n in meta.get('class_names') or range(num_classes)]
    mean, std = meta.get('mean', (0.5, 0.5, 0.5)), meta.get('std', (0.5, 0.5, 0.5))
    size = meta.get('img_size', [224, 224])
    task = meta.get('task') or _task_of_output(session)
    # padded here as the run's PyTorch model is (linvit.inference), whether or not the graph pads too (a file's
    # pads_to_multiple): the same windows and strides for both, and files exported before the graph padded work
    return Predictor(run=run, task=task, class_names=names, mean=mean, std=std, img_size=(int(size[0]), int(size[1])),
                     multiple=int(meta.get('input_multiple', 1)), max_batch=fixed_batch,
                     values=_values_of_file(path, task, meta))


def _values_of_file(path: str, task: str, meta: Dict[str, object]) -> Optional[ValueMap]:
    """What an ONNX file's values are (its ``values`` metadata), None for a task that predicts none; ValueError for
    a file of such a task that does not record them (exported before they were recorded)."""
    from .engine.tasks import TASKS
    known = TASKS.find(task)
    if known is None or not known.predicts_values:
        return None
    if not meta.get('values'):
        run = meta.get('weights') or meta.get('source') or 'RUN'
        raise ValueError(f"{path} holds a task={task!r} model but does not record what its values are (metadata "
                         f"'values'): export it again with python tools/export_onnx.py {run} --out {path}")
    return ValueMap.of(meta['values'])


def _task_of_output(session: object) -> str:
    """What an ONNX file without linvit's metadata is read as: the task whose logits have its output's rank."""
    from .engine.tasks import task_of_logits
    return task_of_logits(len(session.get_outputs()[0].shape)) or ''


def load_predictor(model: str, device: str = 'cpu', threads: Optional[int] = None) -> Predictor:
    """``onnx_predictor`` for a .onnx path (FileNotFoundError when it is missing), else ``torch_predictor``."""
    if model.endswith('.onnx'):
        if not os.path.isfile(model):
            raise FileNotFoundError(f"ONNX file {model} does not exist")
        return onnx_predictor(model, threads)
    return torch_predictor(model, device)


# ---------------------------------------------------------------------------------------------------- inputs

@dataclass
class Item:
    path: str
    name: str  # output name: the path below the folder it was found in, without extension


def collect_inputs(inputs: Sequence[str]) -> Tuple[List[Item], Skipped]:
    """(images to predict, [(path, reason)] for inputs that do not exist). Folders are searched recursively for
    the formats PIL opens; output names are made unique."""
    items: List[Item] = []
    missing: Skipped = []
    extensions = readable_extensions() | large_image_extensions()
    for given in inputs:
        if os.path.isdir(given):
            for path in list_images(Path(given), extensions):
                items.append(Item(path, os.path.splitext(os.path.relpath(path, given))[0]))
        elif os.path.isfile(given):
            items.append(Item(given, os.path.splitext(os.path.basename(given))[0]))
        else:
            missing.append((given, 'no such file or folder'))
    seen: Dict[str, int] = {}
    for item in items:
        count = seen.get(item.name, 0)
        seen[item.name] = count + 1
        if count:
            item.name = f"{item.name}_{count}"
    return items, missing


def _batches(run: Logits, images: torch.Tensor, max_batch: Optional[int]) -> torch.Tensor:
    """run(images [B, ...]) in chunks of ``max_batch`` when the model takes exactly that many."""
    if not max_batch or images.shape[0] == max_batch:
        return run(images)
    return torch.cat([run(images[i:i + max_batch]) for i in range(0, images.shape[0], max_batch)])


def _read_or_skip(item: Item, skipped: Skipped) -> Optional[np.ndarray]:
    """The image uint8 [H, W, 3], or None after noting why it cannot be read."""
    try:
        return load_rgb(item.path)
    except Exception as error:  # PIL raises many types for unreadable files
        reason = f"{type(error).__name__}: {error}"
        skipped.append((item.path, reason))
        tqdm.write(f"skipped {item.path}: cannot read it as an image ({reason})", file=sys.stderr)
        return None


# ---------------------------------------------------------------------------------------------------- tasks

def classify_images(predictor: Predictor, items: Sequence[Item], top_k: int = 5,
                    batch_size: int = 8) -> Tuple[List[Dict[str, object]], Skipped]:
    """(top-k rows {file, rank, class_index, class_name, probability} for every readable image, [(path, reason)]
    for the unreadable ones). Images are resized to the training size (height, width), ``batch_size`` per forward."""
    transform = build_transforms(None, predictor.img_size, predictor.mean, predictor.std, train=False)
    k = max(1, min(top_k, len(predictor.class_names)))
    rows: List[Dict[str, object]] = []
    skipped: Skipped = []
    pending: List[Tuple[Item, torch.Tensor]] = []

    def flush() -> None:
        if not pending:
            return
        logits = _batches(predictor.run, torch.stack([t for _, t in pending]), predictor.max_batch)
        probs, classes = logits.float().softmax(dim=-1).topk(k, dim=-1)
        for (item, _), p, c in zip(pending, probs, classes):
            for rank, (prob, index) in enumerate(zip(p.tolist(), c.tolist()), start=1):
                rows.append({'file': item.path, 'rank': rank, 'class_index': index,
                             'class_name': predictor.class_names[index], 'probability': prob})
            best = ', '.join(f"{predictor.class_names[i]} {q:.3f}" for q, i in zip(p.tolist(), c.tolist()))
            tqdm.write(f"{item.path}: {best}")
        pending.clear()

    for item in tqdm(items, desc='classify', unit='img', file=sys.stderr):
        image = _read_or_skip(item, skipped)
        if image is None:
            continue
        pending.append((item, transform(image=image)['image']))
        if len(pending) >= batch_size:
            flush()
    flush()
    return rows, skipped


def write_predictions(rows: Sequence[Dict[str, object]], out: str) -> str:
    """Write ``classify_images``' rows to OUT/predictions.csv (the folder is created); returns the file's path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, 'predictions.csv')
    with open(path, 'w', newline='', encoding='utf-8') as f:
        writer = csv.DictWriter(f, fieldnames=PREDICTION_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def save_mask_png(mask: np.ndarray, path: str, num_classes: int) -> None:
    """Class ids as an 8-bit PNG (16-bit above 256 classes), pixel value = class id."""
    dtype = np.uint8 if num_classes <= 256 else np.uint16
    Image.fromarray(mask.astype(dtype)).save(path)


def _png_units(values: np.ndarray, png_scale: float) -> np.ndarray:
    """uint16 [H, W] round(values / png_scale), clipped to 1..65535: 0 means 'no value' to the readers of such maps,
    so a positive value below half a unit stays 1; a value that is not finite (NaN, an overflowed exp) is 0."""
    units = np.clip(np.rint(np.divide(values, png_scale, dtype=np.float64)), 1, 65535)
    units[~np.isfinite(values)] = 0
    return units.astype(np.uint16)


def _full_logits(predictor: Predictor, images: torch.Tensor, mode: str, window: int, stride: Optional[int],
                 batch_size: int) -> torch.Tensor:
    """Normalised images [1, 3, H, W] -> full-resolution logits float32 [K, H, W], 'whole' or 'slide'
    (``linvit.inference.segment``: the windows' logits averaged)."""
    return segment(lambda x: _batches(predictor.run, x, predictor.max_batch), images, mode, window=window,
                   stride=stride, batch_size=batch_size, pad_multiple=predictor.multiple)[0]


def segment_image(predictor: Predictor, images: torch.Tensor, mode: str, window: int, stride: Optional[int],
                  batch_size: int) -> np.ndarray:
    """Normalised images [1, 3, H, W] -> class ids int64 [H, W] (argmax of the full-resolution logits), 'whole' or
    'slide' (``linvit.inference.segment``)."""
    return _class_ids(_full_logits(predictor, images, mode, window, stride, batch_size))


def _class_ids(logits: torch.Tensor) -> np.ndarray:
    """Logits [K, n, W] -> class ids int64 [n, W] (a band of a class map)."""
    return class_ids(logits, dim=0).cpu().numpy()


def _values(logits: torch.Tensor) -> np.ndarray:
    """Logits [1, n, W], the log of the values -> values float32 [n, W] (a band of a value map)."""
    return logits[0].float().exp().cpu().numpy()


def bounded_unavailable(predictor: Predictor) -> Optional[str]:
    """Why the predictor cannot run the bounded whole-image forward (one phrase), or None when it can."""
    if predictor.model is None:
        return 'an ONNX file runs whole or in windows (the bounded forward needs the PyTorch model)'
    return bounded_segment_unsupported_reason(predictor.model)


def choose_mode(predictor: Predictor, height: int, width: int, requested: str, max_pixels: int,
                rows_per_chunk: int) -> Tuple[str, str]:
    """(mode, why) for an image of height x width: ``requested`` unless it is 'auto', which takes 'bounded' (the
    whole image, memory bounded) when the model has the state form, else 'whole' up to ``max_pixels`` pixels and
    'slide' above. ValueError for 'bounded' asked of a model without it."""
    if requested not in PREDICT_MODES:
        raise ValueError(f"unknown segmentation mode {requested!r} (--mode); choose one of: {', '.join(PREDICT_MODES)}")
    reason = bounded_unavailable(predictor)
    if requested == 'bounded' and reason is not None:
        raise ValueError(f"--mode bounded cannot run this model: {reason}; use --mode whole or slide")
    if requested != 'auto':
        return requested, '--mode'
    if reason is None:
        return 'bounded', (f"the whole image in bands of {rows_per_chunk} patch rows (--rows-per-chunk): the model "
                           f"has the state form, so memory stays bounded")
    pixels = height * width
    if pixels <= max_pixels:
        return 'whole', f"{reason}; {pixels} pixels are within --max-pixels {max_pixels}"
    return 'slide', f"{reason}; {pixels} pixels are above --max-pixels {max_pixels}"


def _open_or_skip(item: Item, skipped: Skipped, downsample: float) -> Optional[ImageSource]:
    """``linvit.data.large_image.open_image``, or None after noting why the file cannot be read (a missing
    optional reader included: its message names the pip command)."""
    try:
        return open_image(item.path, downsample)
    except Exception as error:  # PIL, tifffile and OpenSlide raise many types for unreadable files
        reason = f"{type(error).__name__}: {error}"
        skipped.append((item.path, reason))
        tqdm.write(f"skipped {item.path}: cannot read it as an image ({reason})", file=sys.stderr)
        return None


#: full-resolution logits [K, n, W] of a band of rows -> those rows of the map [n, W] (class ids, values)
Reduce = Callable[[torch.Tensor], np.ndarray]
Bands = Iterator[Tuple[int, np.ndarray]]


def _map_bands(predictor: Predictor, source: ImageSource, mode: str, normalise: Callable[[np.ndarray], torch.Tensor],
               window: int, stride: Optional[int], batch_size: int, rows_per_chunk: int, label: str,
               reduce: Reduce) -> Bands:
    """(y0, reduce(logits) [n, W]) for the rows of ``source``, top to bottom: band by band for 'bounded' (with a
    progress bar over its blocks and tiles), the whole image at once for 'whole' and 'slide'."""
    if mode != 'bounded':
        images = normalise(source.read(0, source.height)).unsqueeze(0)
        yield 0, reduce(_full_logits(predictor, images, mode, window, stride, batch_size))
        return
    device = predictor.device

    def read_rows(y0: int, y1: int) -> torch.Tensor:
        return normalise(source.read(y0, y1)).unsqueeze(0).to(device)

    with tqdm(desc=label, unit='step', leave=False, file=sys.stderr) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        for y0, logits in iter_bounded_segment(predictor.model, read_rows, 1, (source.height, source.width),
                                               rows_per_chunk, progress):
            yield y0, reduce(logits[0])


def _mask_format(path: str, requested: str) -> str:
    """The format of an image's map: ``requested`` ('tiff', 'png'), or for 'auto' tiff for TIFF and slide inputs."""
    if requested not in MASK_FORMATS:
        raise ValueError(f"unknown mask format {requested!r} (--mask-format); choose one of: {', '.join(MASK_FORMATS)}")
    if requested != 'auto':
        return requested
    return 'tiff' if os.path.splitext(path)[1].lower() in TIFF_INPUTS else 'png'


def _partial_path(path: str) -> str:
    """Where ``path`` is written until its image is complete: a hidden name beside it, same extension (PIL and
    tifffile choose the format by it)."""
    folder, name = os.path.split(path)
    base, ext = os.path.splitext(name)
    return os.path.join(folder, f".{base}.partial{ext}")


@contextmanager
def _all_or_nothing(paths: Sequence[str]) -> Iterator[List[str]]:
    """Temporary paths to write ``paths`` into: renamed to ``paths`` when the block completes, removed when it
    does not (an unreadable band, an error, Ctrl-C), so that an image that failed half way never leaves outputs
    that look complete."""
    partial = [_partial_path(path) for path in paths]
    try:
        yield partial
    except BaseException:
        for path in partial:
            if os.path.exists(path):
                os.remove(path)
        raise
    for path, final in zip(partial, paths):
        os.replace(path, final)


def _write_tiff(bands: Iterator[Tuple[int, np.ndarray]], source: ImageSource, paths: Sequence[str],
                num_classes: int, palette: np.ndarray, alpha: float) -> np.ndarray:
    """paths = (mask .tif: tiled BigTIFF with the source's georeferencing and downsample, preview .png, overlay .png:
    both downsampled); returns the preview's class ids."""
    with ClassMapWriter(paths[0], source.height, source.width, num_classes, georef=source.georef,
                        downsample=source.downsample) as writer:
        for y0, ids in bands:
            writer.write_rows(y0, ids)
    write_preview_png(writer.preview, paths[1], palette)
    write_overlay_png(source, writer.preview, paths[2], palette, alpha)
    return writer.preview


def _write_png(bands: Iterator[Tuple[int, np.ndarray]], source: ImageSource, paths: Sequence[str],
               num_classes: int, palette: np.ndarray, alpha: float) -> np.ndarray:
    """paths = (mask .png: class ids, overlay .png) at the image's size; returns the mask."""
    mask = np.empty((source.height, source.width), dtype=np.uint8 if num_classes <= 256 else np.uint16)
    for y0, ids in bands:
        mask[y0:y0 + len(ids)] = ids
    save_mask_png(mask, paths[0], num_classes)
    overlay = np.empty((source.height, source.width, 3), dtype=np.uint8)
    for y0 in range(0, source.height, _OVERLAY_ROWS):  # blended in floats a band at a time: 60 bytes a pixel
        rows = slice(y0, min(y0 + _OVERLAY_ROWS, source.height))
        blended = overlay_mask(source.read(rows.start, rows.stop).astype(np.float32) / 255, mask[rows], palette,
                               alpha=alpha)
        overlay[rows] = (blended * 255).round().clip(0, 255).astype(np.uint8)
    Image.fromarray(overlay).save(paths[1])
    return mask


#: the files each mask format writes per image, as suffixes of the output name
_OUTPUT_SUFFIXES = {'tiff': ('_mask.tif', '_preview.png', '_overlay.png'), 'png': ('_mask.png', '_overlay.png')}


class _ValueRange:
    """The smallest and largest finite value of the bands that pass through ``watch``: what the log line says."""

    def __init__(self) -> None:
        self.low, self.high = math.inf, -math.inf

    def watch(self, bands: Bands) -> Bands:
        for y0, values in bands:
            finite = values[np.isfinite(values)]
            if finite.size:
                self.low, self.high = min(self.low, float(finite.min())), max(self.high, float(finite.max()))
            yield y0, values

    def __str__(self) -> str:
        return f"{self.low:.4g}..{self.high:.4g}" if self.low <= self.high else 'no finite value'


def _write_value_tiff(bands: Bands, source: ImageSource, paths: Sequence[str], values: ValueMap) -> None:
    """paths = (map .tif: float32 values, a tiled BigTIFF with the source's georeferencing and downsample, preview
    .png: coloured, downsampled)."""
    with ValueMapWriter(paths[0], source.height, source.width, values.name, values.unit, georef=source.georef,
                        downsample=source.downsample) as writer:
        for y0, rows in bands:
            writer.write_rows(y0, rows)
    _write_value_preview(writer.preview, paths[1], values)


def _write_value_png(bands: Bands, source: ImageSource, paths: Sequence[str], values: ValueMap) -> None:
    """paths = (map .png: 16-bit, value / png_scale, at the image's size; preview .png: coloured, downsampled)."""
    units = np.empty((source.height, source.width), dtype=np.uint16)
    preview = NearestPreview(source.height, source.width, np.float32)
    for y0, rows in bands:
        units[y0:y0 + len(rows)] = _png_units(rows, values.png_scale)
        preview.add(y0, rows)
    Image.fromarray(units).save(paths[0])
    _write_value_preview(preview.image, paths[1], values)


def _write_value_preview(preview: np.ndarray, path: str, values: ValueMap) -> None:
    """Values [ph, pw] in the depth colour map of the run's pictures (``linvit.engine.plots.depth_colours``: near
    warm, log scale over the 2nd..98th percentiles), pixels without a finite positive value white."""
    depth = np.reciprocal(preview, where=preview > 0, out=np.zeros_like(preview)) if values.larger_is_nearer \
        else preview
    colours = depth_colours(depth, *depth_colour_range(depth))[..., :3]
    colours[~(np.isfinite(depth) & (depth > 0))] = 1.0
    Image.fromarray(np.rint(colours * 255).astype(np.uint8)).save(path)


class PredictionInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``segment_images`` or ``depth_images``: ``written`` of ``total`` images were complete and their
    files are in ``out``; the image in progress left none."""

    def __init__(self, written: int, total: int, out: str):
        super().__init__(f"{written} of {total} image(s) written to {out}; the image in progress left no files")
        self.written, self.total, self.out = written, total, out


@dataclass
class _MapOutput:
    """One kind of map that ``_predict_maps`` writes per image: how a band of full-resolution logits becomes the map's
    rows, and how an image's files are named and written."""
    label: str  # the progress bar's
    needs_out: str  # the error without --out
    reduce: Reduce
    suffixes: Dict[str, Tuple[str, ...]]  # per map format: the files of an image, as suffixes of its output name
    # (format, bands, source, paths) -> what the image's log line says about its map
    write: Callable[[str, Bands, ImageSource, Sequence[str]], str]


def segment_images(predictor: Predictor, items: Sequence[Item], out: Optional[str], mode: Optional[str] = None,
                   window: Optional[int] = None, stride: Optional[int] = None, batch_size: int = 8,
                   alpha: float = 0.5, rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK,
                   max_pixels: int = DEFAULT_MAX_PIXELS, mask_format: str = 'auto',
                   downsample: float = 1.0) -> Tuple[int, Skipped]:
    """Write each readable image's class map and overlay under OUT (see the module docstring); returns (how many
    were written, [(path, reason)] for the unreadable ones: those that do not open and those whose rows fail to
    decode half way, ``ImageReadError``; the others are still predicted). An image's files are written under
    temporary names and renamed once all are complete: a failed or interrupted image leaves none. Ctrl-C raises
    ``PredictionInterrupted`` (a KeyboardInterrupt) saying how many images were written.

    mode: 'auto' (default: ``choose_mode``), 'bounded', 'whole' or 'slide'; ``window`` and ``stride`` default to the
        run's seg.eval (the training size for an ONNX file). ``rows_per_chunk``: patch rows per band of the bounded
        forward (its memory budget). ``max_pixels``: 'auto' runs a model without the state form whole up to this.
    mask_format: 'tiff' (tiled BigTIFF + preview), 'png', or 'auto': tiff for TIFF and slide inputs.
    downsample: the pyramid level of a pyramidal input (``open_image``). ``alpha``: opacity of the class colours.
    """
    num_classes = len(predictor.class_names)
    palette = class_palette(num_classes)

    def write(fmt: str, bands: Bands, source: ImageSource, paths: Sequence[str]) -> str:
        writer = _write_tiff if fmt == 'tiff' else _write_png
        classes = writer(bands, source, paths, num_classes, palette, alpha)
        return f"classes: {', '.join(predictor.class_names[c] for c in np.unique(classes))}"

    output = _MapOutput('segment', 'segmentation writes masks', _class_ids, _OUTPUT_SUFFIXES, write)
    return _predict_maps(predictor, items, out, output, mode, window, stride, batch_size, rows_per_chunk, max_pixels,
                         mask_format, downsample)


def depth_images(predictor: Predictor, items: Sequence[Item], out: Optional[str], mode: Optional[str] = None,
                 window: Optional[int] = None, stride: Optional[int] = None, batch_size: int = 8,
                 rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK, max_pixels: int = DEFAULT_MAX_PIXELS,
                 mask_format: str = 'auto', downsample: float = 1.0) -> Tuple[int, Skipped]:
    """Write each readable image's map of predicted values (a depth run's: depth or disparity, ``predictor.values``)
    under OUT, at the image's size, as ``segment_images`` writes class maps (the same modes, their choice, skipped
    images, all-or-nothing files and Ctrl-C): OUT/<name>_<value>.tif (float32 values, tiled BigTIFF) for
    ``mask_format`` 'tiff', OUT/<name>_<value>.png (16-bit, value / png_scale) for 'png' ('auto': tiff for TIFF and
    slide inputs), and OUT/<name>_preview.png (coloured, near warm, longer side <= 1024 px). The value of a pixel is
    exp of the model's output there (of the windows' mean output for 'slide'). ValueError for a predictor whose
    model predicts no values."""
    values = predictor.values
    if values is None:
        raise ValueError(f"a task={predictor.task!r} model predicts no values per pixel: its images are predicted "
                         f"by its own task's function")

    def write(fmt: str, bands: Bands, source: ImageSource, paths: Sequence[str]) -> str:
        seen = _ValueRange()
        (_write_value_tiff if fmt == 'tiff' else _write_value_png)(seen.watch(bands), source, paths, values)
        return f"{values.name} {seen} {values.unit}"

    suffixes = {'tiff': (f'_{values.name}.tif', '_preview.png'), 'png': (f'_{values.name}.png', '_preview.png')}
    output = _MapOutput(values.name, f'{values.name} prediction writes maps', _values, suffixes, write)
    return _predict_maps(predictor, items, out, output, mode, window, stride, batch_size, rows_per_chunk, max_pixels,
                         mask_format, downsample)


def _predict_maps(predictor: Predictor, items: Sequence[Item], out: Optional[str], output: _MapOutput,
                  mode: Optional[str], window: Optional[int], stride: Optional[int], batch_size: int,
                  rows_per_chunk: int, max_pixels: int, mask_format: str, downsample: float) -> Tuple[int, Skipped]:
    """What ``segment_images`` and ``depth_images`` share: each image opened (or skipped), its mode chosen
    (``choose_mode``), its bands of logits made into the map's rows and written as ``output`` says, all its files
    or none (``_all_or_nothing``); Ctrl-C raises ``PredictionInterrupted``."""
    if not out:
        raise ValueError(f'{output.needs_out}: give --out FOLDER')
    mode = mode or 'auto'
    window = window or predictor.seg_defaults.get('window') or predictor.img_size[0]
    stride = stride or predictor.seg_defaults.get('stride')
    # validation's pipeline: normalisation only, at full resolution; per pixel, so a band of rows at a time
    transform = build_seg_transforms(None, predictor.img_size[0], predictor.mean, predictor.std, ignore_index=255,
                                     train=False)

    def normalise(rows: np.ndarray) -> torch.Tensor:
        return transform(image=rows)['image']

    written = 0
    skipped: Skipped = []
    try:
        for item in tqdm(items, desc=output.label, unit='img', file=sys.stderr):
            source = _open_or_skip(item, skipped, downsample)
            if source is None:
                continue
            with source:
                chosen, why = choose_mode(predictor, source.height, source.width, mode, max_pixels, rows_per_chunk)
                tqdm.write(f"{item.path}: {source.description}; {chosen}: {why}", file=sys.stderr)
                fmt = _mask_format(item.path, mask_format)
                paths = [os.path.join(out, item.name + suffix) for suffix in output.suffixes[fmt]]
                os.makedirs(os.path.dirname(paths[0]) or '.', exist_ok=True)
                bands = _map_bands(predictor, source, chosen, normalise, window, stride, batch_size, rows_per_chunk,
                                   item.name, output.reduce)
                try:
                    with _all_or_nothing(paths) as partial:
                        said = output.write(fmt, bands, source, partial)
                except ImageReadError as error:
                    skipped.append((item.path, str(error)))
                    tqdm.write(f"skipped {item.path}: {error}; no files written for it", file=sys.stderr)
                    continue
            tqdm.write(f"{item.path}: {', '.join(paths)} ({said})")
            written += 1
    except KeyboardInterrupt:
        raise PredictionInterrupted(written, len(items), out) from None
    return written, skipped


# ---------------------------------------------------------------------------------------------------- detection

def choose_detection_mode(height: int, width: int, requested: str, max_pixels: int) -> Tuple[str, str]:
    """(mode, why) for one image: ``requested`` ('whole' or 'slide') as it is, 'auto': 'whole' up to
    ``max_pixels`` pixels, 'slide' (tiles) above. 'bounded' is segmentation's: ValueError in one line."""
    if requested == 'bounded':
        raise ValueError("--mode bounded is segmentation's band-by-band forward; detection runs 'whole', 'slide' "
                         "(overlapping tiles) or 'auto' (whole up to --max-pixels, tiles above)")
    if requested != 'auto':
        return requested, 'as asked'
    if height * width <= max_pixels:
        return 'whole', f"{height * width:,} pixels <= --max-pixels {max_pixels:,}"
    return 'slide', f"{height * width:,} pixels > --max-pixels {max_pixels:,}"


def detection_tile(height: int, width: int, max_pixels: int, multiple: int) -> Tuple[int, int]:
    """(tile height, tile width) for an image of height x width when no --window is given: the largest tile whose
    forward, like a whole image's, stays within ``max_pixels`` pixels, so that tiles are few and large. A square of
    the largest multiple of ``multiple`` whose area fits; a side of the image shorter than that square is taken
    whole, and the other side grows as far as the budget allows (a strip). Never larger than the image."""
    side = max(multiple, math.isqrt(max_pixels) // multiple * multiple)
    if height >= side and width >= side:
        return side, side
    if height < side:
        return height, min(width, max(multiple, max_pixels // height // multiple * multiple))
    return min(height, max(multiple, max_pixels // width // multiple * multiple)), width


def detect_image(predictor: Predictor, image: torch.Tensor, mode: str, tile: Tuple[int, int], overlap: int,
                 batch_size: int = 8, progress: Optional[Callable[[int], None]] = None) -> Dict[str, torch.Tensor]:
    """The detections on one normalised image [3, H, W]: {'boxes' [N, 4] xyxy pixels, 'scores' [N], 'labels' [N]
    1..K}. 'whole': one forward; 'slide': tiles of ``tile`` (height, width) px sharing ``overlap`` px with their
    neighbours (``detect_tiled``), ``batch_size`` tiles per forward, ``progress(tiles)`` after each forward."""
    if mode == 'whole':
        found = predictor.run(image[None])[0]
        if progress:
            progress(1)
        return found
    return detect_tiled(predictor.run, image, tile, overlap=overlap, batch_size=batch_size, progress=progress)


def _coco_annotations(found: Dict[str, torch.Tensor], image_id: object, first_id: int,
                      category_ids: Sequence[int]) -> List[Dict[str, object]]:
    """One image's detections as COCO annotations: bbox [x, y, width, height] pixels, category_id the data set's id
    of the label (label i is ``category_ids[i - 1]``)."""
    annotations = []
    for offset, (box, score, label) in enumerate(zip(found['boxes'].tolist(), found['scores'].tolist(),
                                                     found['labels'].tolist())):
        x1, y1, x2, y2 = box
        annotations.append({'id': first_id + offset, 'image_id': image_id, 'category_id': int(category_ids[label - 1]),
                            'bbox': [round(x1, 2), round(y1, 2), round(x2 - x1, 2), round(y2 - y1, 2)],
                            'area': round((x2 - x1) * (y2 - y1), 2), 'score': round(score, 5), 'iscrowd': 0})
    return annotations


def _write_json_atomically(value: object, path: str) -> None:
    with open(path + '.tmp', 'w', encoding='utf-8') as f:
        json.dump(value, f)
    os.replace(path + '.tmp', path)


def _draw_detections(image: np.ndarray, found: Dict[str, torch.Tensor], class_names: Sequence[str],
                     min_score: float, path: str) -> int:
    """Write ``image`` uint8 [H, W, 3] with the boxes scored at least ``min_score`` (class colours, 'name score')
    to ``path``; returns how many were drawn."""
    from torchvision.utils import draw_bounding_boxes
    keep = found['scores'] >= min_score
    boxes, labels, scores = found['boxes'][keep], found['labels'][keep], found['scores'][keep]
    palette = class_palette(len(class_names) + 1)
    pixels = torch.from_numpy(image.copy()).permute(2, 0, 1)  # a copy: the overlay must not write into the image
    if len(boxes):
        width = max(1, round(max(image.shape[:2]) / 400))
        pixels = draw_bounding_boxes(pixels, boxes, labels=[f"{class_names[c - 1]} {p:.2f}" for c, p in
                                                             zip(labels.tolist(), scores.tolist())],
                                     colors=[tuple(int(v) for v in palette[c]) for c in labels.tolist()], width=width)
    Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(path)
    return len(boxes)


def _category_ids(predictor: Predictor) -> List[int]:
    """The data set's category id of each of the run's labels (its task's record; 1..K when it has none)."""
    ids = [int(i) for i in predictor.seg_defaults.get('category_ids') or range(1, len(predictor.class_names) + 1)]
    if len(ids) != len(predictor.class_names):
        raise ValueError(f"the run records {len(ids)} category ids (detection.category_ids={ids}) for its "
                         f"{len(predictor.class_names)} classes {predictor.class_names}")
    return ids


def _annotated_images(annotations: str, items: Sequence[Item], categories: Sequence[Tuple[int, str]]
                      ) -> Dict[str, Dict[str, object]]:
    """Each input's entry in the COCO annotation file ``annotations`` (by path: the file's 'file_name' is the end of
    the input's path), after checking that the file's categories are the run's ``categories`` (id, name); ValueError
    (one line) for other categories or an input the file does not list."""
    from .data.coco import read_coco_categories, read_coco_images
    listed = read_coco_categories(annotations)
    if listed != sorted(categories):
        raise ValueError(f"{annotations} lists categories {listed} (id, name) but the run was trained on "
                         f"{sorted(categories)}: its detections would be scored as other classes")
    by_name: Dict[str, List[Dict[str, object]]] = {}
    for entry in read_coco_images(annotations):
        by_name.setdefault(os.path.basename(str(entry['file_name'])), []).append(entry)
    found = {}
    for item in items:
        path = Path(os.path.abspath(item.path)).as_posix()
        entry = next((e for e in by_name.get(os.path.basename(item.path), ())
                      if path.endswith('/' + Path(str(e['file_name'])).as_posix())), None)
        if entry is None:
            raise ValueError(f"{item.path} is not among the images of {annotations} (no 'file_name' ends its path); "
                             f"with --annotations, predict that file's images")
        found[item.path] = entry
    return found


def _check_annotated_size(item: Item, entry: Dict[str, object], annotations: str, height: int, width: int) -> None:
    """DataError unless the image is the size its annotation entry gives (its boxes are in those pixels)."""
    if (width, height) != (entry['width'], entry['height']):
        from .data import DataError
        raise DataError(f"{item.path} is width {width}, height {height}, but {annotations} gives it width "
                        f"{entry['width']}, height {entry['height']}: its detections would not be in the "
                        f"annotations' pixels")


@contextmanager
def _detection_cap(predictor: Predictor, count: Optional[int]) -> Iterator[int]:
    """The cap on detections per forward while the block runs: ``count``, else the run's own (its model's
    ``detections_per_img``: detection.detections_per_image); the run's own is back afterwards."""
    from .models.detection import detection_cap, set_detection_cap
    model = predictor.model
    if model is None:
        yield count or 0
        return
    own = detection_cap(model)
    set_detection_cap(model, count or own)
    try:
        yield count or own
    finally:
        set_detection_cap(model, own)


class _CapCounter:
    """``predictor.run`` that counts the forwards' images (tiles) and those whose detections reached ``cap``."""

    def __init__(self, run: Callable[[torch.Tensor], List[Dict[str, torch.Tensor]]], cap: int) -> None:
        self.run, self.cap = run, cap
        self.images = self.capped = 0

    def __call__(self, images: torch.Tensor) -> List[Dict[str, torch.Tensor]]:
        found = self.run(images)
        self.images += len(found)
        self.capped += sum(bool(self.cap) and len(f['boxes']) >= self.cap for f in found)
        return found


def _tiles(height: int, width: int, window: Optional[int], stride: Optional[int], max_pixels: int,
           multiple: int) -> Tuple[Tuple[int, int], int]:
    """(tile (height, width), overlap) of 'slide': ``window`` px squares every ``stride`` px when given, else the
    largest tile within ``max_pixels`` (``detection_tile``); the stride defaults to 2/3 of the tile's shorter side."""
    tile = (window, window) if window else detection_tile(height, width, max_pixels, multiple)
    shorter = min(tile)
    stride = stride or max(1, shorter * 2 // 3)
    if not 0 < stride <= shorter:
        raise ValueError(f"--stride {stride} must be in 1..{shorter} (the tile's side): tiles must overlap or touch")
    return tile, shorter - stride


def detect_images(predictor: Predictor, items: Sequence[Item], out: Optional[str], mode: str = 'auto',
                  window: Optional[int] = None, stride: Optional[int] = None, batch_size: int = 8,
                  max_pixels: int = DEFAULT_MAX_PIXELS, min_score: float = OVERLAY_MIN_SCORE,
                  max_detections: Optional[int] = None, annotations: Optional[str] = None) -> Tuple[int, Skipped]:
    """Detect objects in each readable image at its own resolution and write OUT/detections.json (COCO format) and
    OUT/<name>_overlay.png (see the module docstring); returns (how many images were written, [(path, reason)] for
    the unreadable ones).

    mode: 'auto' (``choose_detection_mode``), 'whole' or 'slide'; ``window`` and ``stride`` place square tiles
        (default: the largest tile within ``max_pixels``, ``detection_tile``, every 2/3 of its shorter side).
    max_detections: the most detections one forward (a whole image or a tile) returns (default: the run's
        detection.detections_per_image); a forward that returns that many is reported in one line on stderr.
    annotations: the images' COCO annotation file: detections.json then names each image by its id and file_name
        there (a set scored by COCOeval with that file), after checking the categories and image sizes agree.
    min_score: the overlays' threshold.
    """
    if not out:
        raise ValueError('detection writes detections.json and overlays: give --out FOLDER')
    category_ids = _category_ids(predictor)
    annotated = (_annotated_images(annotations, items, list(zip(category_ids, predictor.class_names)))
                 if annotations else {})
    transform = build_seg_transforms(None, predictor.img_size[0], predictor.mean, predictor.std, ignore_index=255,
                                     train=False)  # validation's normalisation, at full resolution
    os.makedirs(out, exist_ok=True)
    images: List[Dict[str, object]] = []
    detections: List[Dict[str, object]] = []
    skipped: Skipped = []
    with _detection_cap(predictor, max_detections) as cap:
        for item in tqdm(items, desc='detect', unit='img', file=sys.stderr):
            image = _read_or_skip(item, skipped)
            if image is None:
                continue
            height, width = image.shape[:2]
            entry = annotated.get(item.path)
            if entry is not None:
                _check_annotated_size(item, entry, str(annotations), height, width)
            chosen, why = choose_detection_mode(height, width, mode, max_pixels)
            tile, overlap = _tiles(height, width, window, stride, max_pixels, predictor.multiple)
            counted = _CapCounter(predictor.run, cap)
            where = f"{tile[0]}x{tile[1]} px tiles overlapping by {overlap} px" if chosen == 'slide' else 'one forward'
            with tqdm(desc=f'{item.name} ({chosen})', unit='tile', leave=False, file=sys.stderr) as bar:
                found = detect_image(replace(predictor, run=counted), transform(image=image)['image'], chosen, tile,
                                     overlap, batch_size, bar.update)
            if counted.capped:
                tqdm.write(f"{item.path}: {counted.capped} of {counted.images} forward(s) returned the cap of {cap} "
                           f"detections (--max-detections): there may be more objects; raise --max-detections",
                           file=sys.stderr)
            image_id = entry['id'] if entry is not None else len(images) + 1
            images.append({'id': image_id, 'file_name': entry['file_name'] if entry is not None else item.path,
                           'width': width, 'height': height})
            detections += _coco_annotations(found, image_id, len(detections) + 1, category_ids)
            overlay = os.path.join(out, f"{item.name}_overlay.png")
            os.makedirs(os.path.dirname(overlay), exist_ok=True)
            drawn = _draw_detections(image, found, predictor.class_names, min_score, overlay)
            tqdm.write(f"{item.path}: {width}x{height}, {chosen} ({why}; {where}); {len(found['boxes'])} detections, "
                       f"{drawn} scored >= {min_score:g} drawn in {overlay}", file=sys.stderr)
    categories = [{'id': category_id, 'name': name} for category_id, name in zip(category_ids, predictor.class_names)]
    _write_json_atomically({'images': images, 'annotations': detections, 'categories': categories},
                           os.path.join(out, DETECTIONS_FILE))
    return len(images), skipped
