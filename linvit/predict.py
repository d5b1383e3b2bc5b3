"""Predictions on image files of any size, from a trained run or an exported ONNX file: what ``tools/predict.py`` runs.

    predictor = load_predictor('runs/demo')               # a run directory, .pt, .safetensors or .onnx
    items, missing = collect_inputs(['photo.jpg', 'more/'])
    rows, skipped = classify_images(predictor, items, top_k=3)          # classification: top-k rows per image
    written, skipped = segment_images(predictor, items, 'masks/', mode='slide', window=512)   # segmentation

A ``Predictor`` hides the runtime: PyTorch (``linvit.engine.loading.load_trained``: the run's model, classes,
normalisation and seg.eval settings) or onnxruntime (``linvit.export.ort_session``; the file's ``linvit.*`` metadata
says its task, classes and normalisation). Classification resizes each image to the training size and normalises
it as validation does; segmentation runs each image at full resolution, whole or in sliding windows
(``linvit.inference.segment``), and writes ``<name>_mask.png`` (class ids, 8-bit; 16-bit above 256 classes) and
``<name>_overlay.png`` (the classes coloured with the run's palette). An image that cannot be read is skipped and
reported as (path, reason); the others are still predicted. Progress goes to stderr (tqdm), one line per image.
"""
import csv
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from .data.folder import list_images, load_rgb, readable_extensions
from .data.transforms import build_seg_transforms, build_transforms
from .engine.plots import class_palette, overlay_mask
from .inference import segment

__all__ = ['Predictor', 'torch_predictor', 'onnx_predictor', 'load_predictor', 'Item', 'collect_inputs',
           'classify_images', 'write_predictions', 'segment_image', 'segment_images', 'save_mask_png',
           'PREDICTION_FIELDS']

Logits = Callable[[torch.Tensor], torch.Tensor]
Skipped = List[Tuple[str, str]]  # (path, reason)

#: the columns of predictions.csv
PREDICTION_FIELDS = ['file', 'rank', 'class_index', 'class_name', 'probability']


@dataclass
class Predictor:
    """What predictions need from a model, whichever runtime holds it."""
    run: Logits  # normalised images float32 [B, 3, H, W] -> logits float32 [B, K] or [B, K, H, W]
    task: str  # the task whose model it is (linvit.engine.TASKS): its logits_rank says how to read the output
    class_names: List[str]
    mean: Sequence[float]
    std: Sequence[float]
    img_size: Tuple[int, int]  # classification: images are resized to this; segmentation: the default window
    multiple: int  # image sides the model takes are multiples of this
    max_batch: Optional[int] = None  # a file exported for a fixed batch takes exactly this many images
    seg_defaults: Dict[str, object] = field(default_factory=dict)  # a run's task's (seg.eval: mode, window, stride)


# ---------------------------------------------------------------------------------------------------- models

def torch_predictor(path: str, device: str = 'cpu') -> Predictor:
    """A trained run (directory, .pt or .safetensors beside config.yaml) on ``device``; ValueError for a run whose
    task's models predict no labels (``Task.logits_rank`` 0: autoregressive)."""
    from .engine.loading import load_trained
    from .engine.tasks import TASKS
    trained = load_trained(path, device=device)
    task = TASKS.get(trained.task)
    if not task.logits_rank:
        predicted = ' and '.join(name for name, other in TASKS.items() if other.logits_rank)
        raise ValueError(f"{path} is a task={trained.task!r} run; predict.py takes {predicted} runs "
                         f"({task.not_predicted})")
    model = trained.model

    @torch.no_grad()
    def run(images: torch.Tensor) -> torch.Tensor:
        return model(images.to(device)).float().cpu()

    multiple = getattr(model, 'input_multiple', None) or max(model.patch_embed.patch_size)
    return Predictor(run=run, task=trained.task, class_names=trained.class_names, mean=trained.mean, std=trained.std,
                     img_size=trained.img_size, multiple=int(multiple),
                     seg_defaults=dict(trained.prediction_defaults))


def onnx_predictor(path: str, threads: Optional[int] = None) -> Predictor:
    """An ONNX file written by ``linvit.export.export_onnx``, in onnxruntime with ``threads`` threads;
    ``linvit.export.StaleExportError`` when the run's weights it was exported from have changed since
    (``check_source_weights``)."""
    from .export import INPUT_NAME, check_source_weights, ort_session, read_metadata
    meta = read_metadata(path)
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
    # padded here as the run's PyTorch model is (linvit.inference), whether or not the graph pads too (a file's
    # pads_to_multiple): the same windows and strides for both, and files exported before the graph padded work
    return Predictor(run=run, task=meta.get('task') or _task_of_output(session), class_names=names, mean=mean,
                     std=std, img_size=(int(size[0]), int(size[1])), multiple=int(meta.get('input_multiple', 1)),
                     max_batch=fixed_batch)


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
    extensions = readable_extensions()
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


def segment_image(predictor: Predictor, images: torch.Tensor, mode: str, window: int, stride: Optional[int],
                  batch_size: int) -> np.ndarray:
    """Normalised images [1, 3, H, W] -> class ids int64 [H, W] (argmax of the full-resolution logits)."""
    logits = segment(lambda x: _batches(predictor.run, x, predictor.max_batch), images, mode, window=window,
                     stride=stride, batch_size=batch_size, pad_multiple=predictor.multiple)
    return logits[0].argmax(dim=0).numpy()


def segment_images(predictor: Predictor, items: Sequence[Item], out: Optional[str], mode: Optional[str] = None,
                   window: Optional[int] = None, stride: Optional[int] = None, batch_size: int = 8,
                   alpha: float = 0.5) -> Tuple[int, Skipped]:
    """Write OUT/<name>_mask.png and OUT/<name>_overlay.png per readable image; returns (how many were written,
    [(path, reason)] for the unreadable ones). ``mode``, ``window`` and ``stride`` default to the run's seg.eval
    ('whole' and the training size for an ONNX file); ``alpha`` is the opacity of the class colours."""
    if not out:
        raise ValueError('segmentation writes masks: give --out FOLDER')
    mode = mode or predictor.seg_defaults.get('mode') or 'whole'
    window = window or predictor.seg_defaults.get('window') or predictor.img_size[0]
    stride = stride or predictor.seg_defaults.get('stride')
    palette = class_palette(len(predictor.class_names))
    # validation's pipeline: normalisation only, at full resolution
    transform = build_seg_transforms(None, predictor.img_size[0], predictor.mean, predictor.std, ignore_index=255,
                                     train=False)
    written = 0
    skipped: Skipped = []
    for item in tqdm(items, desc=f'segment ({mode})', unit='img', file=sys.stderr):
        image = _read_or_skip(item, skipped)
        if image is None:
            continue
        images = transform(image=image)['image'].unsqueeze(0)
        mask = segment_image(predictor, images, mode, window, stride, batch_size)
        stem = os.path.join(out, item.name)
        os.makedirs(os.path.dirname(stem) or '.', exist_ok=True)
        save_mask_png(mask, f"{stem}_mask.png", len(predictor.class_names))
        overlay = overlay_mask(image.astype(np.float32) / 255, mask, palette, alpha=alpha)
        Image.fromarray((overlay * 255).round().clip(0, 255).astype(np.uint8)).save(f"{stem}_overlay.png")
        present = ', '.join(predictor.class_names[c] for c in np.unique(mask))
        tqdm.write(f"{item.path}: {stem}_mask.png, {stem}_overlay.png (classes: {present})")
        written += 1
    return written, skipped
