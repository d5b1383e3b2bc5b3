#!/usr/bin/env python
"""Is training input-bound? Images/s of the per-image input path (decode + albumentations, one worker), of the
cached path (``data.cache``: read a decoded uint8 image and draw its augmentation, one worker; the batched
augmentation on the device), and of the model's training step on a batch already on the device, at each size; the
pipeline rates with ``--workers`` workers and which of input or model bounds training. The library is
``linvit.bench.data``.

    python tools/bench_data.py                                   # CPU, 512 / 1024 / 2048 px, linvit-Tiny
    python tools/bench_data.py --device cuda --workers 6 --batch 32
    python tools/bench_data.py --sizes 512 --samples 64 --csv runs/bench_data.csv
"""
import argparse
import sys
from typing import List, Optional


def build_parser() -> argparse.ArgumentParser:
    from linvit.bench.cli import HelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--device', default='cpu', help="torch device of the augmentation and the model: cpu, cuda")
    parser.add_argument('--sizes', type=int, nargs='+', default=[512, 1024, 2048], metavar='PX', help='image sizes')
    parser.add_argument('--workers', type=int, default=6, help='DataLoader workers the pipeline rates assume')
    parser.add_argument('--images', type=int, default=16, help='source PNGs per size (twice the size, like photos)')
    parser.add_argument('--samples', type=int, default=32, help='timed samples per worker-side path')
    parser.add_argument('--batch', type=int, default=16, help='batch of the device augmentation and the model step')
    parser.add_argument('--model', default='linvit_tiny_patch16_224', help='timm model of the training step')
    parser.add_argument('--repeats', type=int, default=3, help='timed calls of the batched steps (the best counts)')
    parser.add_argument('--threads', type=int, default=1, help="torch CPU threads (1: one worker's share)")
    parser.add_argument('--csv', help='also write the rows to this CSV file')
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import linvit  # noqa: F401  (registers linvit_* with timm)
    from linvit.bench.cli import measurement_threads
    from linvit.bench.data import DataBench, markdown, measure
    from linvit.timing import write_csv
    threads = measurement_threads(args.threads, args.device).apply()
    bench = DataBench(sizes=args.sizes, device=args.device, workers=args.workers, images=args.images,
                      samples=args.samples, batch=args.batch, model=args.model, repeats=args.repeats)
    rows = measure(bench)
    print('\n'.join([f"# torch: {threads.note()}", *threads.warning_lines(), markdown(rows, args.workers)]))
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == '__main__':
    sys.exit(main())
