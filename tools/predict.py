#!/usr/bin/env python
"""Predict with a trained model or an exported ONNX file on images of any size: one file, a list, or folders.

The model is a run directory of ``train.py``, a checkpoint (.pt), a .safetensors file beside its run's config.yaml,
or an ONNX file written by ``tools/export_onnx.py`` (onnxruntime; its task, class names and normalisation are read
from the file). An ONNX file exported from a run whose weights have changed since (the run trained again) is
refused with the command that exports it anew. Folders are searched recursively for the image formats PIL opens
and for TIFF and slide files.

Classification: each image is resized to the model's training size and normalised as in validation; the top-k
classes with their probabilities are printed and, with ``--out``, written to ``OUT/predictions.csv``.

Segmentation: each image runs at full resolution. ``--mode auto`` (the default) chooses per image and logs why:
the whole image in bands of patch rows when the model's attention has the state form (memory bounded by
``--rows-per-chunk``: a 10,000 px image on a laptop; ``linvit.models.iter_bounded_segment``), else the whole image
in one forward up to ``--max-pixels`` and overlapping windows above (``--mode slide``; ``linvit.inference``). Images
are read with ``linvit.data.large_image``: PNG/JPEG through PIL (its pixel limit lifted for the files named), TIFF,
BigTIFF, pyramidal TIFF and SVS/NDPI lazily through tifffile (``--downsample`` picks a pyramid level), MIRAX and the
rest through OpenSlide (``pip install openslide-python openslide-bin``). TIFF and slide inputs give
``OUT/<name>_mask.tif`` (class ids, tiled compressed BigTIFF, a GeoTIFF's georeferencing kept) with
``<name>_preview.png`` and ``<name>_overlay.png`` (downsampled); other inputs ``OUT/<name>_mask.png`` (8-bit,
16-bit above 256 classes) and ``<name>_overlay.png`` at full size (``--mask-format`` overrides). Names mirror the
input's path below the folder it was found in.

    python tools/predict.py runs/demo photo.jpg more/ --top-k 3 --out preds/
    python tools/predict.py runs/demo_seg scans/ --out masks/                         # auto: bounded when it can
    python tools/predict.py runs/demo_seg slide.svs --out masks/ --downsample 4        # a pyramid level
    python tools/predict.py seg.onnx big.png --out masks/ --mode slide --window 512

Depth (a run directory, .pt, .safetensors or its ONNX file): each image runs at full resolution through the same
modes and the same choice as segmentation; the value of a pixel is exp of the model's output (metres for a
depth.target=depth run, 1/metres for disparity). TIFF and slide inputs give ``OUT/<name>_depth.tif`` (float32, tiled
compressed BigTIFF, a GeoTIFF's georeferencing kept; ``<name>_disparity.tif`` for a disparity run), other inputs
``OUT/<name>_depth.png`` (16-bit: value / the run's data.depth_scale, 0.001 when null, so it reads back as the run's
training maps do; 0 means no value), each with ``<name>_preview.png`` (coloured, near warm, longer side at most
1024 px). ``--mask-format tiff|png`` overrides the choice.

    python tools/predict.py runs/depth_demo photos/ --out depth/                      # <name>_depth.png, 16-bit mm
    python tools/predict.py runs/depth_demo/model.onnx aerial.tif --out depth/        # <name>_depth.tif, metres

Detection (a run directory, .pt or .safetensors): each image runs at its own resolution, whole up to
``--max-pixels`` and in overlapping tiles above (``--mode slide``: the largest tiles within ``--max-pixels``, or
``--window`` px tiles every ``--stride`` px; each tile keeps the boxes centred in the part it owns, then class-wise
NMS), with a bar over the tiles. A forward keeps at most ``--max-detections`` boxes (default: the run's
detection.detections_per_image) and says so in one line when it reaches that cap. ``OUT/detections.json`` is
COCO-format (images by file name, or with ``--annotations FILE`` by their id in that COCO file; the categories with
the data set's own ids, as the run recorded them; each detection an annotation with its score, in the image's
pixels) and ``OUT/<name>_overlay.png`` draws the boxes scored at least ``--min-score``. The ONNX file of a detection
run holds its feature pyramid only (``export_onnx.py --features``): predict with the run.

    python tools/predict.py runs/det_demo scenes/ --out boxes/                         # auto: tiles above 4 MP
    python tools/predict.py runs/det_demo aerial.png --out boxes/ --mode slide --window 1024 --stride 768
    python tools/predict.py runs/coco data/coco/val --out boxes/ --annotations data/coco/annotations/instances_val.json

An image that cannot be read is reported by name and skipped, also one that opens but fails half way through its
rows (a truncated TIFF; its partial files are removed): the others are still predicted and the skipped ones are
listed at the end. Exit status: 0 when every image was predicted, 1 when some were skipped, 2 when nothing could
run (no model, a stale ONNX file, no images), 130 after Ctrl-C (one line: how many images were written; the one in
progress leaves no files).
The library: linvit.predict.
"""
import argparse
import sys
from typing import List, Optional

from linvit.bench.cli import HelpFormatter, measurement_threads, threads_arg
from linvit.models.bounded import DEFAULT_ROWS_PER_CHUNK
from linvit.predict import (
    DEFAULT_MAX_PIXELS,
    MASK_FORMATS,
    OVERLAY_MIN_SCORE,
    PREDICT_MODES,
    PredictionInterrupted,
    classify_images,
    collect_inputs,
    depth_images,
    detect_images,
    load_predictor,
    segment_images,
    write_predictions,
)

#: the exit status after Ctrl-C (128 + SIGINT, as shells report it)
INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('model', help='run directory, checkpoint .pt, .safetensors (beside config.yaml) or .onnx')
    parser.add_argument('inputs', nargs='+', help='image files and/or folders (searched recursively)')
    parser.add_argument('--out', help='output folder (segmentation, depth and detection: required; classification: '
                                      'predictions.csv)')
    parser.add_argument('--top-k', type=int, default=5, help='classification: classes listed per image')
    parser.add_argument('--mode', choices=PREDICT_MODES, default='auto',
                        help="segmentation, depth and detection: 'auto' chooses per image; 'bounded' the whole "
                             "image in bands (segmentation and depth models with the state form), 'whole' one "
                             "forward, 'slide' overlapping windows (detection: tiles whose boxes are merged)")
    parser.add_argument('--rows-per-chunk', type=int, default=DEFAULT_ROWS_PER_CHUNK,
                        help='bounded: patch rows per band (its memory budget: fewer rows, less memory)')
    parser.add_argument('--max-pixels', type=int, default=DEFAULT_MAX_PIXELS,
                        help='auto, for detection and for a segmentation model without the state form: whole '
                             'images up to this many pixels, windows above')
    parser.add_argument('--mask-format', choices=MASK_FORMATS, default='auto',
                        help="segmentation and depth maps: 'tiff' (tiled BigTIFF + preview; depth: float32), "
                             "'png' (class ids; depth: 16-bit, value / the run's data.depth_scale), or 'auto' (tiff "
                             "for TIFF and slide inputs)")
    parser.add_argument('--downsample', type=float, default=1.0,
                        help='segmentation and depth: the pyramid level of a pyramidal TIFF/slide (the largest '
                             'downsample not above this)')
    parser.add_argument('--window', type=int, help="slide: window side in pixels (default: segmentation: the run's, "
                                                   "else the training size; detection: the largest tile within "
                                                   "--max-pixels)")
    parser.add_argument('--stride', type=int, help='slide: step between windows (default: 2/3 of the window)')
    parser.add_argument('--batch-size', type=int, default=8, help='images (classification) or windows (slide) per '
                                                                  'forward')
    parser.add_argument('--max-detections', type=int,
                        help="detection: the most boxes one forward (a whole image or a tile) keeps (default: the "
                             "run's detection.detections_per_image); a forward that reaches it is reported")
    parser.add_argument('--annotations', metavar='FILE',
                        help="detection: the images' COCO annotation file: detections.json names each image by its "
                             "id there, ready for COCOeval against that file")
    parser.add_argument('--min-score', type=float, default=OVERLAY_MIN_SCORE,
                        help='detection: overlays draw the boxes scored at least this (detections.json keeps every '
                             'detection with its score)')
    parser.add_argument('--alpha', type=float, default=0.5, help='segmentation: opacity of the class colours')
    parser.add_argument('--device', default='cpu', help="PyTorch models: torch device, e.g. 'cpu' or 'cuda'")
    parser.add_argument('--threads', type=threads_arg, default='auto',
                        help="threads for PyTorch or onnxruntime: a number, or 'auto': the cores other processes "
                             "leave free when it starts (1-minute load average), at most one per core, as the "
                             "profiler chooses them. More threads than free cores wait for the busy ones at every op")
    return parser


def run(args: argparse.Namespace) -> int:
    threads = measurement_threads(args.threads, args.device).apply()
    items, skipped = collect_inputs(args.inputs)
    for path, reason in skipped:
        print(f"skipped {path}: {reason}", file=sys.stderr)
    if not items:
        print(f"error: no images found in {' '.join(args.inputs)}", file=sys.stderr)
        return 2
    predictor = load_predictor(args.model, args.device, threads.threads)
    print(f"torch threads: {threads.note()}", file=sys.stderr)  # after the checks: an expected error is one line
    if predictor.task == 'detection':
        _, unreadable = detect_images(predictor, items, args.out, args.mode, args.window, args.stride,
                                      args.batch_size, args.max_pixels, args.min_score,
                                      max_detections=args.max_detections, annotations=args.annotations)
    elif predictor.values is not None:  # a depth run's: a map of values per pixel
        _, unreadable = depth_images(predictor, items, args.out, args.mode, args.window, args.stride,
                                     args.batch_size, args.rows_per_chunk, args.max_pixels, args.mask_format,
                                     args.downsample)
    elif predictor.task == 'segmentation':
        _, unreadable = segment_images(predictor, items, args.out, args.mode, args.window, args.stride,
                                       args.batch_size, args.alpha, args.rows_per_chunk, args.max_pixels,
                                       args.mask_format, args.downsample)
    else:
        rows, unreadable = classify_images(predictor, items, args.top_k, args.batch_size)
        if args.out:
            write_predictions(rows, args.out)
    skipped += unreadable
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
    except PredictionInterrupted as stop:  # Ctrl-C in a segmentation or depth batch: what is complete stays
        print(f"\ninterrupted: {stop}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:
        print(f"\ninterrupted before the predictions were complete; files already in {args.out or 'place'} stay",
              file=sys.stderr)
        return INTERRUPTED


if __name__ == '__main__':
    sys.exit(main())
