#!/usr/bin/env python
"""Which timm ViTs linvit.convert_to_linear converts: every model of timm's ViT families (timm modules), built at
tiny depth with random weights, converted, loaded with its own softmax state dict and run; per family, one
representative (the smallest that converts) compiled with torch.compile(fullgraph=True) and exported to ONNX, each
against eager PyTorch. Refusals and failures give the first line of their error.

    python tools/vit_coverage.py                               # all families: the markdown table (~1 min + checks)
    python tools/vit_coverage.py --write-docs                  # and rewrite the table in docs/models.md
    python tools/vit_coverage.py --families deit eva --json coverage.json --no-compile --no-onnx

The library is ``linvit.bench.coverage``; the ONNX check is here because ``linvit.export`` sits above
``linvit.bench`` in the import layers.
"""
import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

import torch

from linvit.bench import coverage
from linvit.bench.cli import HelpFormatter

DOCS = Path(__file__).resolve().parents[1] / 'docs' / 'models.md'


def exports_to_onnx(model: torch.nn.Module, images: torch.Tensor) -> None:
    """linvit's exporter writes the converted model and checks onnxruntime against PyTorch at the model's fixed
    image size (the tiny models are built for one size); raises with the reason otherwise."""
    from linvit.export import export_onnx
    with tempfile.TemporaryDirectory(prefix='vit-coverage-') as folder:
        export_onnx(model, os.path.join(folder, 'model.onnx'), img_size=tuple(images.shape[-2:]), dynamic_size=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--families', nargs='+', default=list(coverage.FAMILIES), metavar='MODULE',
                        help='timm modules to survey (timm.list_modules())')
    parser.add_argument('--depth', type=int, default=coverage.TINY_DEPTH, help='blocks per model')
    parser.add_argument('--img-size', type=int, default=coverage.TINY_IMG_SIZE,
                        help='image side (rounded to each model\'s patch size)')
    parser.add_argument('--no-compile', action='store_true', help='skip the compile check')
    parser.add_argument('--no-onnx', action='store_true', help='skip the ONNX check')
    parser.add_argument('--json', metavar='PATH', help='write the per-family and per-model rows as JSON')
    parser.add_argument('--write-docs', action='store_true',
                        help=f'rewrite the table between the coverage markers of {DOCS.relative_to(DOCS.parents[1])}')
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    checks = {}
    if not args.no_compile:
        checks['compiles'] = coverage.compiles
    if not args.no_onnx:
        checks['ONNX'] = exports_to_onnx
    families, models = coverage.survey(
        args.families, args.depth, args.img_size, checks,
        on_family=lambda row: print(f"{row.family}: {row.converts}/{row.models} convert", file=sys.stderr))
    table = coverage.markdown(families)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({'families': [asdict(r) for r in families],
                                               'models': [asdict(r) for r in models]}, indent=1) + '\n')
    if args.write_docs:
        DOCS.write_text(coverage.replace_block(DOCS.read_text(encoding='utf-8'), table), encoding='utf-8')
        print(f"wrote the table into {DOCS}", file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(main())
