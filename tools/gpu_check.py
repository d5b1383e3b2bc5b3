#!/usr/bin/env python
"""The GPU check: the linear-attention kernel's parity and speed, and whole-model speed, in one short run.

Three sections, each in its own process under a hard time budget; whatever does not fit in its budget is written as
'skipped (time budget)', never estimated (quality, training through the engine, is tools/quality_check.py:
make gpu-quality):

1. parity: ``linvit.ops.linear_attention_op`` (the Triton kernel) in float32, bfloat16 and float16, output and
   gradients, against ``linvit.ops.linear_attention`` on float64 copies of the same inputs, at 1k, 16k and 64k
   tokens: relative max error, ok or FAIL against a tolerance per precision;
2. op: median time of the op's forward and forward+backward (bfloat16, 1k to 32k tokens) against torch's SDPA and
   against the op's PyTorch path;
3. models: ViT-S and ViT-B at 512, 1024 and 2048 px, linvit, its floor (attention without token mixing) and timm's
   softmax ViT: compiled training steps (img/s, peak memory) and CUDA-graph inference (img/s); last, linvit with
   attn_backend='torch'. A compile cache (--cache-dir) makes a rerun on the same machine reach further down the list.

The sections run one after the other; their budgets are shares of --budget. Output in --out: gpu_check.csv (one row
per measurement), gpu_check.md (the tables, also printed), gpu_check_throughput.png (img/s against image size),
logs/<section>.log. The exit status is 1 when a parity row FAILs or a measurement errors, else 0. The library, with
the details: linvit.bench.gpu_check.

    make gpu-check                                       # the first CUDA device, about 6 minutes
    python tools/gpu_check.py --device cuda:0
    python tools/gpu_check.py --device cpu --quick       # the same code at tiny sizes (two minutes on 2 cores)
    python tools/gpu_check.py --sections parity op --budget 120
"""
import argparse
import sys
import time
from typing import List, Optional

from linvit.bench.cli import HelpFormatter, exit_without_cuda_device
from linvit.bench.gpu_check import COMPILE_BACKENDS, FULL, QUICK, SECTIONS, CheckSettings, run_check
from linvit.bench.processes import process_age_s


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--device', default='cuda:0', help="torch device: the first CUDA device, or 'cpu'")
    parser.add_argument('--quick', action='store_true',
                        help='tiny sizes (one-block models, a few tokens, a few images), the same code: for a CPU')
    parser.add_argument('--out', default='runs/gpu_check', help='output folder: tables, CSV, plot, logs')
    parser.add_argument('--budget', type=float,
                        help=f'total seconds (default: {FULL.budget_s:.0f}; with --quick: {QUICK.budget_s:.0f})')
    parser.add_argument('--sections', nargs='+', choices=SECTIONS, default=list(SECTIONS), help='what to run')
    parser.add_argument('--cache-dir', default='build/gpu_check_cache',
                        help='compile caches (inductor, Triton), kept for reruns')
    parser.add_argument('--compile-backend', choices=COMPILE_BACKENDS,
                        help="torch.compile backend of section 3 (default: inductor; with --quick: aot_eager, which "
                             "traces the same forward and backward graphs without generating code: inductor's C++ "
                             "compile takes about a minute per graph on a 2-core CPU)")
    return parser


def parse_args(argv: Optional[List[str]] = None) -> CheckSettings:
    """The resolved settings (budget and backend defaults filled, absolute paths); a bad value is a usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_without_cuda_device(parser, args.device)  # before anything runs
    settings = CheckSettings(device=args.device, quick=args.quick, out=args.out, budget=args.budget,
                             sections=tuple(args.sections), cache_dir=args.cache_dir,
                             compile_backend=args.compile_backend)
    try:
        return settings.resolved()
    except ValueError as err:
        parser.error(str(err))


def main(argv: Optional[List[str]] = None) -> int:
    settings = parse_args(argv)
    # run as a script, the budget counts this process's start and imports too
    start = time.time() - (process_age_s() if argv is None else 0.0)
    return run_check(settings, start)


if __name__ == '__main__':
    sys.exit(main())
