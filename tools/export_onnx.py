#!/usr/bin/env python
"""Export a model to ONNX, check it in onnxruntime at several sizes and, with ``--latency``, time it against PyTorch.

The source is a timm model spec (a name, optionally with create_model options: ``name:key=value,...``; random
weights, for testing and benchmarking) or a trained model: a run directory of ``train.py``, a checkpoint (.pt) or a
.safetensors file beside its run's config.yaml. ``linvit.export.export_onnx`` writes the file (dynamic batch,
height and width by default) only after onnxruntime agrees with the float32 PyTorch model at every check size;
the parity table gives the max absolute and relative error per size. With ``--latency``, each check size is then
timed (batch 1, medians of interleaved calls after warm-up): PyTorch eager, PyTorch compiled
(``linvit.fast.compile_model``, one static graph per size) and onnxruntime (``linvit.export.ort_session``). The timing
is opt-in because compiling one graph per size takes about a minute even for a tiny model.

    python tools/export_onnx.py linvit_small_patch16_224 --img-size 512 --check-sizes 512,768x1024 --latency
    python tools/export_onnx.py runs/seg_demo --out seg.onnx                   # a trained segmentation run
    python tools/export_onnx.py runs/cls_demo/best.pt --dtype float16 --out cls_fp16.onnx
    python tools/export_onnx.py vit_small_patch16_224 --img-size 1024          # timm's softmax ViT alike
    python tools/export_onnx.py runs/det_demo --no-dynamic-size --no-dynamic-batch   # a whole detector, one size
    python tools/export_onnx.py runs/det_demo --features                       # its backbone + pyramid, any size

The file records its task, class names, normalisation and input multiple (``linvit.export.read_metadata``), which
``tools/predict.py`` reads. A run's classifier is exported with ``dynamic_img_size=True`` (same weights) unless
``--no-dynamic-size``; a model spec gets it too. A dynamic-size file takes any image size: the graph pads it to the
patch multiple (zeros at the bottom and right) and crops segmentation logits back to the input's size. A file
exported from a run records the weights file it was made from and its sha256; ``tools/predict.py`` refuses the
file once those weights change (the run trained again) and names the command that exports it anew.
The library: linvit.export.
"""
import argparse
import sys
from typing import List, Optional, Tuple

import torch

from linvit.bench.cli import HelpFormatter, precision_arg
from linvit.bench.specs import parse_size
from linvit.export import (
    EXPORT_PRECISIONS,
    ExportCheckError,
    ExportError,
    export_onnx,
    format_latency,
    load_export_source,
    measure_latency,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('source', help='a timm model spec name[:key=value,...], a run directory, a .pt checkpoint '
                                       'or a .safetensors file (beside config.yaml)')
    parser.add_argument('--out', help='the .onnx file to write (default: <model name>.onnx here, or model.onnx in '
                                      'the run directory)')
    parser.add_argument('--img-size', type=parse_size, metavar='SIZE',
                        help="the traced image size, N or HxW (default: the model's img_size, or the run's "
                             "data.img_size)")
    parser.add_argument('--features', action='store_true',
                        help="a segmentation or detection run's backbone and feature pyramid alone (4 maps, finest "
                             "first; default out: features.onnx in the run directory): all of a detector that "
                             "exports, its heads run in PyTorch")
    parser.add_argument('--dynamic-size', action=argparse.BooleanOptionalAction, default=True,
                        help='a file that takes any image size whose sides the patch divides; --no-dynamic-size: '
                             'the traced size only')
    parser.add_argument('--dynamic-batch', action=argparse.BooleanOptionalAction, default=True,
                        help='a file that takes any batch size; --no-dynamic-batch: batch 1 only')
    parser.add_argument('--opset', type=int, help="ONNX opset (default: the exporter's)")
    parser.add_argument('--dtype', type=precision_arg, choices=EXPORT_PRECISIONS, default='float32',
                        help='weights and activations of the file (float16: the attention core stays float32 in the '
                             'graph)')
    parser.add_argument('--check-sizes', type=parse_size_list, metavar='SIZES',
                        help='comma-separated sizes to check and time, e.g. 512x512,768x1000 (any size: the file '
                             'pads to the patch multiple; default: the export size and, when dynamic, a smaller '
                             'non-square size and a larger one that the patch does not divide)')
    parser.add_argument('--tolerance', type=float, help='largest max relative error accepted (default: 1e-4 float32, '
                                                        '1e-2 float16)')
    parser.add_argument('--latency', action=argparse.BooleanOptionalAction, default=False,
                        help='time PyTorch eager, PyTorch compiled and onnxruntime at each check size (compiles one '
                             'graph per size: minutes); --no-latency: parity only')
    parser.add_argument('--warmup', type=int, default=2, help='untimed calls of each runtime per size (the first '
                                                              'compiles)')
    parser.add_argument('--repeats', type=int, default=5, help='timed rounds: one call of each runtime per round')
    parser.add_argument('--threads', type=int, help='threads for PyTorch and onnxruntime (default: torch\'s)')
    return parser


def parse_size_list(text: str) -> List[Tuple[int, int]]:
    """'512,768x1024' -> [(512, 512), (768, 1024)]."""
    return [parse_size(part) for part in text.split(',') if part.strip()]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    source = load_export_source(args.source, args.img_size, args.dynamic_size, args.features)
    out = args.out or source.default_out
    try:
        report = export_onnx(source.model, out, img_size=source.img_size, dynamic_size=args.dynamic_size,
                             dynamic_batch=args.dynamic_batch, opset=args.opset, dtype=args.dtype,
                             check_sizes=args.check_sizes, tolerance=args.tolerance, metadata=source.metadata)
    except ExportCheckError as error:
        print(error, file=sys.stderr)
        return 1
    print(report.table())
    if args.latency:
        sizes = [(c.height, c.width) for c in report.checks]
        rows = measure_latency(source.model, out, sizes, args.dtype, args.warmup, args.repeats)
        print(format_latency(rows, report.dtype))
    part = report.metadata.get('part')
    predictions = {'features': "the feature maps of a detector's or segmentation model's heads",
                   'detector': f"a detector for {report.img_size[0]}x{report.img_size[1]} images"
                   }.get(part, f"predictions: python tools/predict.py {out} IMAGES...")
    print(f"wrote {out} (onnxruntime: linvit.export.ort_session; metadata: linvit.export.read_metadata; "
          f"{predictions})")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ExportError, ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
