#!/usr/bin/env python
"""Predict with a trained model or an exported ONNX file on images of any size: one file, a list, or folders.

The model is a run directory of ``train.py``, a checkpoint (.pt), a .safetensors file beside its run's config.yaml,
or an ONNX file written by ``tools/export_onnx.py`` (onnxruntime; its task, class names and normalisation are read
from the file). Folders are searched recursively for the image formats PIL opens.

Classification: each image is resized to the model's training size and normalised as in validation; the top-k
classes with their probabilities are printed and, with ``--out``, written to ``OUT/predictions.csv``.

Segmentation: each image runs at full resolution, whole (padded to the patch multiple) or in overlapping windows
whose logits are averaged (``--mode slide``; ``linvit.inference``); ``OUT/<name>_mask.png`` holds the class id of
every pixel (8-bit, 16-bit above 256 classes) and ``OUT/<name>_overlay.png`` the image with the classes coloured
(the palette of the run's pictures). Names mirror the input's path below the folder it was found in.

    python tools/predict.py runs/demo photo.jpg more/ --top-k 3 --out preds/
    python tools/predict.py runs/demo_seg scans/ --out masks/ --mode slide --window 512
    python tools/predict.py seg.onnx big.png --out masks/

An image that cannot be read is reported by name and skipped; the others are still predicted. Exit status: 0 when
every image was predicted, 1 when some were skipped, 2 when nothing could run (no model, no images).
"""
import argparse
import csv
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image
from tool_cli import HelpFormatter
from tqdm import tqdm

import linvit  # noqa: F401  (registers linvit_* with timm)
from linvit.data.folder import list_images, load_rgb, readable_extensions
from linvit.data.transforms import build_seg_transforms, build_transforms
from linvit.engine.plots import class_palette, overlay_mask
from linvit.inference import SEGMENT_MODES, segment

Logits = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Predictor:
    """What predictions need from a model, whichever runtime holds it."""
    run: Logits  # normalised images float32 [B, 3, H, W] -> logits float32 [B, K] or [B, K, H, W]
    task: str
    class_names: List[str]
    mean: Sequence[float]
    std: Sequence[float]
    img_size: Tuple[int, int]  # classification: images are resized to this; segmentation: the default window
    multiple: int  # image sides the model takes are multiples of this
    max_batch: Optional[int] = None  # a file exported for a fixed batch takes exactly this many images
    seg_defaults: Dict[str, object] = field(default_factory=dict)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('model', help='run directory, checkpoint .pt, .safetensors (beside config.yaml) or .onnx')
    parser.add_argument('inputs', nargs='+', help='image files and/or folders (searched recursively)')
    parser.add_argument('--out', help='output folder (segmentation: required; classification: predictions.csv)')
    parser.add_argument('--top-k', type=int, default=5, help='classification: classes listed per image')
    parser.add_argument('--mode', choices=SEGMENT_MODES,
                        help="segmentation: 'whole' image or 'slide' windows (default: the run's seg.eval.mode, "
                             "'whole' for ONNX files)")
    parser.add_argument('--window', type=int, help="slide: window side in pixels (default: the run's, else the "
                                                   "training size)")
    parser.add_argument('--stride', type=int, help='slide: step between windows (default: 2/3 of the window)')
    parser.add_argument('--batch-size', type=int, default=8, help='images (classification) or windows (slide) per '
                                                                  'forward')
    parser.add_argument('--alpha', type=float, default=0.5, help='segmentation: opacity of the class colours')
    parser.add_argument('--device', default='cpu', help="PyTorch models: torch device, e.g. 'cpu' or 'cuda'")
    parser.add_argument('--threads', type=int, help="threads for PyTorch or onnxruntime (default: torch's)")
    return parser


# ---------------------------------------------------------------------------------------------------- models

def torch_predictor(path: str, device: str) -> Predictor:
    from linvit.engine.loading import load_trained
    trained = load_trained(path, device=device)
    if trained.task not in ('classification', 'segmentation'):
        raise ValueError(f"{path} is a task={trained.task!r} run; predict.py takes classification and segmentation "
                         f"runs (an 'ar' model predicts next patches: run it with model.recurrent_init / "
                         f"recurrent_step, or fine-tune it for classification, see configs/cls_from_ar_demo.yaml)")
    model = trained.model

    @torch.no_grad()
    def run(images: torch.Tensor) -> torch.Tensor:
        return model(images.to(device)).float().cpu()

    seg = trained.cfg.seg.eval if trained.task == 'segmentation' else None
    multiple = getattr(model, 'input_multiple', None) or max(model.patch_embed.patch_size)
    defaults = {'mode': seg.mode, 'window': seg.window, 'stride': seg.stride} if seg is not None else {}
    return Predictor(run=run, task=trained.task, class_names=trained.class_names, mean=trained.mean, std=trained.std,
                     img_size=(trained.img_size, trained.img_size), multiple=int(multiple), seg_defaults=defaults)


def onnx_predictor(path: str, threads: Optional[int]) -> Predictor:
    from linvit.export import INPUT_NAME, ort_session, read_metadata
    meta = read_metadata(path)
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
    return Predictor(run=run, task=meta.get('task', 'classification'), class_names=names, mean=mean, std=std,
                     img_size=(int(size[0]), int(size[1])), multiple=int(meta.get('input_multiple', 1)),
                     max_batch=fixed_batch)


def load_predictor(args: argparse.Namespace) -> Predictor:
    if args.model.endswith('.onnx'):
        if not os.path.isfile(args.model):
            raise FileNotFoundError(f"ONNX file {args.model} does not exist")
        return onnx_predictor(args.model, args.threads)
    return torch_predictor(args.model, args.device)


# ---------------------------------------------------------------------------------------------------- inputs

@dataclass
class Item:
    path: str
    name: str  # output name: the path below the folder it was found in, without extension


def collect_inputs(inputs: Sequence[str]) -> Tuple[List[Item], List[Tuple[str, str]]]:
    """(images to predict, [(path, reason)] for inputs that do not exist). Output names are made unique."""
    items: List[Item] = []
    missing: List[Tuple[str, str]] = []
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
    if not max_batch or images.shape[0] == max_batch:
        return run(images)
    return torch.cat([run(images[i:i + max_batch]) for i in range(0, images.shape[0], max_batch)])


# ---------------------------------------------------------------------------------------------------- tasks

def classify(predictor: Predictor, items: List[Item], args: argparse.Namespace,
             skipped: List[Tuple[str, str]]) -> List[Dict[str, object]]:
    """Top-k rows (file, rank, class_index, class_name, probability) for every readable image."""
    if predictor.img_size[0] != predictor.img_size[1]:
        raise ValueError(f"classification resizes to a square training size; this model was made for "
                         f"{predictor.img_size}")
    transform = build_transforms(None, predictor.img_size[0], predictor.mean, predictor.std, train=False)
    k = max(1, min(args.top_k, len(predictor.class_names)))
    rows: List[Dict[str, object]] = []
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
        try:
            image = load_rgb(item.path)
        except Exception as error:  # PIL raises many types for unreadable files
            report_skip(item.path, error, skipped)
            continue
        pending.append((item, transform(image=image)['image']))
        if len(pending) >= args.batch_size:
            flush()
    flush()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, 'predictions.csv'), 'w', newline='', encoding='utf-8') as f:
            writer = csv.DictWriter(f, fieldnames=['file', 'rank', 'class_index', 'class_name', 'probability'])
            writer.writeheader()
            writer.writerows(rows)
    return rows


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


def segment_all(predictor: Predictor, items: List[Item], args: argparse.Namespace,
                skipped: List[Tuple[str, str]]) -> int:
    """Writes OUT/<name>_mask.png and OUT/<name>_overlay.png per readable image; returns how many were written."""
    if not args.out:
        raise ValueError('segmentation writes masks: give --out FOLDER')
    mode = args.mode or predictor.seg_defaults.get('mode') or 'whole'
    window = args.window or predictor.seg_defaults.get('window') or predictor.img_size[0]
    stride = args.stride or predictor.seg_defaults.get('stride')
    palette = class_palette(len(predictor.class_names))
    # validation's pipeline: normalisation only, at full resolution
    transform = build_seg_transforms(None, predictor.img_size[0], predictor.mean, predictor.std, ignore_index=255,
                                     train=False)
    written = 0
    for item in tqdm(items, desc=f'segment ({mode})', unit='img', file=sys.stderr):
        try:
            image = load_rgb(item.path)
        except Exception as error:  # PIL raises many types for unreadable files
            report_skip(item.path, error, skipped)
            continue
        images = transform(image=image)['image'].unsqueeze(0)
        mask = segment_image(predictor, images, mode, window, stride, args.batch_size)
        stem = os.path.join(args.out, item.name)
        os.makedirs(os.path.dirname(stem) or '.', exist_ok=True)
        save_mask_png(mask, f"{stem}_mask.png", len(predictor.class_names))
        overlay = overlay_mask(image.astype(np.float32) / 255, mask, palette, alpha=args.alpha)
        Image.fromarray((overlay * 255).round().clip(0, 255).astype(np.uint8)).save(f"{stem}_overlay.png")
        present = ', '.join(predictor.class_names[c] for c in np.unique(mask))
        tqdm.write(f"{item.path}: {stem}_mask.png, {stem}_overlay.png (classes: {present})")
        written += 1
    return written


def report_skip(path: str, error: BaseException, skipped: List[Tuple[str, str]]) -> None:
    reason = f"{type(error).__name__}: {error}"
    skipped.append((path, reason))
    tqdm.write(f"skipped {path}: cannot read it as an image ({reason})", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------- main

def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    items, skipped = collect_inputs(args.inputs)
    for path, reason in skipped:
        print(f"skipped {path}: {reason}", file=sys.stderr)
    if not items:
        print(f"error: no images found in {' '.join(args.inputs)}", file=sys.stderr)
        return 2
    predictor = load_predictor(args)
    if predictor.task == 'segmentation':
        segment_all(predictor, items, args, skipped)
    else:
        classify(predictor, items, args, skipped)
    if skipped:
        print(f"{len(skipped)} input(s) skipped: {', '.join(p for p, _ in skipped)}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
