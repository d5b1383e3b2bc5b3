#!/usr/bin/env python
"""Export a model to ONNX, check it in onnxruntime at several sizes, and time it against PyTorch.

The source is a timm model spec (a name, optionally with create_model options: ``name:key=value,...``; random
weights, for testing and benchmarking) or a trained model: a run directory of ``train.py``, a checkpoint (.pt) or a
.safetensors file beside its run's config.yaml. ``linvit.export.export_onnx`` writes the file (dynamic batch,
height and width by default) only after onnxruntime agrees with the float32 PyTorch model at every check size;
the parity table gives the max absolute and relative error per size. Then, unless ``--no-latency``, each check size
is timed (batch 1, medians of interleaved calls after warm-up): PyTorch eager, PyTorch compiled
(``linvit.fast.compile_model``, one static graph per size) and onnxruntime (``linvit.export.ort_session``).

    python tools/export_onnx.py linvit_small_patch16_224 --img-size 512 --check-sizes 512,768x1024
    python tools/export_onnx.py runs/demo_seg --out seg.onnx                   # a trained segmentation run
    python tools/export_onnx.py runs/demo/best.pt --fp16 --out cls_fp16.onnx
    python tools/export_onnx.py vit_small_patch16_224 --img-size 1024 --no-latency   # timm's softmax ViT alike

The file records its task, class names, normalisation and input multiple (``linvit.export.read_metadata``), which
``tools/predict.py`` reads. A run's classifier is exported with ``dynamic_img_size=True`` (same weights) unless
``--no-dynamic-size``; a model spec gets it too.
"""
import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import timm
import torch
import torch.nn as nn
from bench_attention import time_interleaved
from profile_resolution import parse_model_spec, parse_size, size_label
from tool_cli import HelpFormatter

import linvit  # noqa: F401  (registers linvit_* with timm)
from linvit.export import INPUT_NAME, ExportCheckError, ExportError, export_onnx, ort_session

DTYPES = {'fp32': torch.float32, 'fp16': torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('source', help='a timm model spec name[:key=value,...], a run directory, a .pt checkpoint '
                                       'or a .safetensors file (beside config.yaml)')
    parser.add_argument('--out', help='the .onnx file to write (default: <model name>.onnx here, or model.onnx in '
                                      'the run directory)')
    parser.add_argument('--img-size', type=parse_size, metavar='SIZE',
                        help="the traced image size, N or HxW (default: the model's img_size, or the run's "
                             "data.img_size)")
    parser.add_argument('--dynamic-size', action=argparse.BooleanOptionalAction, default=True,
                        help='a file that takes any image size whose sides the patch divides; --no-dynamic-size: '
                             'the traced size only')
    parser.add_argument('--dynamic-batch', action=argparse.BooleanOptionalAction, default=True,
                        help='a file that takes any batch size; --no-dynamic-batch: batch 1 only')
    parser.add_argument('--opset', type=int, help="ONNX opset (default: the exporter's)")
    parser.add_argument('--fp16', action='store_true',
                        help='float16 weights and activations (the attention core stays float32 in the graph)')
    parser.add_argument('--check-sizes', type=parse_size_list, metavar='SIZES',
                        help='comma-separated sizes to check and time, e.g. 512x512,768x1024 (default: the export '
                             'size and, when dynamic, a smaller non-square and a larger size)')
    parser.add_argument('--tolerance', type=float, help='largest max relative error accepted (default: 1e-4 fp32, '
                                                        '1e-2 fp16)')
    parser.add_argument('--no-latency', action='store_true', help='skip the latency table')
    parser.add_argument('--warmup', type=int, default=2, help='untimed calls of each runtime per size (the first '
                                                              'compiles)')
    parser.add_argument('--repeats', type=int, default=5, help='timed rounds: one call of each runtime per round')
    parser.add_argument('--threads', type=int, help='threads for PyTorch and onnxruntime (default: torch\'s)')
    return parser


def parse_size_list(text: str) -> List[Tuple[int, int]]:
    """'512,768x1024' -> [(512, 512), (768, 1024)]."""
    return [parse_size(part) for part in text.split(',') if part.strip()]


def is_trained_source(source: str) -> bool:
    return os.path.isdir(source) or source.endswith(('.pt', '.pth', '.safetensors'))


def load_source(args: argparse.Namespace) -> Tuple[nn.Module, Tuple[int, int], Dict[str, Any], str]:
    """(model in eval mode, export size, metadata, default output path) for a model spec or a trained run."""
    dynamic = args.dynamic_size
    if is_trained_source(args.source):
        from linvit.engine.loading import load_trained
        trained = load_trained(args.source, dynamic_img_size=dynamic)
        size = args.img_size or (trained.img_size, trained.img_size)
        metadata = {'task': trained.task, 'class_names': trained.class_names, 'mean': list(trained.mean),
                    'std': list(trained.std), 'model_name': trained.cfg.model.name, 'source': args.source}
        run_dir = args.source if os.path.isdir(args.source) else os.path.dirname(os.path.abspath(args.source))
        return trained.model, size, metadata, os.path.join(run_dir, 'model.onnx')
    spec = parse_model_spec(args.source)
    kwargs = dict(spec.kwargs)
    if args.img_size:
        kwargs.setdefault('img_size', args.img_size)
    if dynamic:
        kwargs.setdefault('dynamic_img_size', True)
    model = timm.create_model(spec.name, pretrained=False, **kwargs).eval()
    size = args.img_size or tuple(model.patch_embed.img_size)
    return model, size, {'model_name': spec.name, 'source': args.source}, f"{spec.name}.onnx"


def _runtimes(model: nn.Module, compiled: nn.Module, session: Any, images: torch.Tensor,
              dtype: torch.dtype) -> Dict[str, Any]:
    """The three ways to run one image batch, as calls for ``time_interleaved``."""
    feed = {INPUT_NAME: images.to(dtype).numpy()}

    @torch.no_grad()
    def eager() -> Any:
        return model(images)

    @torch.no_grad()
    def fast() -> Any:
        return compiled(images)

    return {'eager': eager, 'compiled': fast, 'onnxruntime': lambda: session.run(None, feed)}


def measure_latency(model: nn.Module, path: str, sizes: List[Tuple[int, int]], dtype: torch.dtype, warmup: int,
                    repeats: int) -> List[Dict[str, Any]]:
    """Median ms per image (batch 1) of PyTorch eager, PyTorch compiled and onnxruntime at each size."""
    from linvit.fast import compile_model
    session = ort_session(path)
    compiled = compile_model(model)
    rows = []
    for height, width in sizes:
        images = torch.randn(1, 3, height, width)
        ms = time_interleaved(_runtimes(model, compiled, session, images, dtype), warmup=max(1, warmup),
                              repeats=repeats, device='cpu')
        rows.append({'height': height, 'width': width, **ms})
    return rows


def format_latency(rows: List[Dict[str, Any]], dtype_label: str) -> str:
    lines = [f"# latency per image (batch 1, median ms; PyTorch fp32, onnxruntime {dtype_label}, "
             f"{torch.get_num_threads()} threads); ratios above 1: onnxruntime faster",
             f"{'size':>11} {'eager ms':>9} {'compiled ms':>12} {'onnxruntime ms':>15} {'eager/ort':>10} "
             f"{'compiled/ort':>13}"]
    for r in rows:
        lines.append(f"{size_label(r['height'], r['width']):>11} {r['eager']:>9.1f} {r['compiled']:>12.1f} "
                     f"{r['onnxruntime']:>15.1f} {r['eager'] / r['onnxruntime']:>9.2f}x "
                     f"{r['compiled'] / r['onnxruntime']:>12.2f}x")
    return '\n'.join(lines)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    model, size, metadata, default_out = load_source(args)
    out = args.out or default_out
    dtype = DTYPES['fp16' if args.fp16 else 'fp32']
    try:
        report = export_onnx(model, out, img_size=size, dynamic_size=args.dynamic_size,
                             dynamic_batch=args.dynamic_batch, opset=args.opset, dtype=dtype,
                             check_sizes=args.check_sizes, tolerance=args.tolerance, metadata=metadata)
    except ExportCheckError as error:
        print(error, file=sys.stderr)
        return 1
    print(report.table())
    if not args.no_latency:
        sizes = [(c.height, c.width) for c in report.checks]
        print(format_latency(measure_latency(model, out, sizes, dtype, args.warmup, args.repeats), report.dtype))
    print(f"wrote {out} (onnxruntime: linvit.export.ort_session; metadata: linvit.export.read_metadata; "
          f"predictions: python tools/predict.py {out} IMAGES...)")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ExportError, ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
