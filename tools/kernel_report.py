#!/usr/bin/env python
"""What linvit's Triton kernels compile to on Hopper (sm_90) and Ampere (sm_80), without a GPU.

Every kernel (the forward's key and query passes, the backward's query and key passes) at every head width and
input dtype is compiled ahead of time by the installed Triton, exactly as the launcher would specialise it. The
table gives, per variant: registers per thread and spilled bytes (ptxas), shared memory per block, the operand type
of the dot instructions in the PTX (bf16 / f16 tensor-core dots for half inputs; tf32 would mean float32 operands)
and the global-memory bytes the pass moves per token and head, against which a measured kernel time reads as a
share of the memory bandwidth. The library is ``linvit.bench.kernel_report``; ``make triton-compat`` runs the test
that holds these figures with the GPU machine's Triton.

    python tools/kernel_report.py                          # sm_90 and sm_80; D = 32, 64, 128; fp32, bf16, fp16
    python tools/kernel_report.py --targets 90 --widths 64 --dtypes bfloat16
    python tools/kernel_report.py --key-weights            # the masked variants (HAS_W) of the key-side kernels
"""
import argparse
import os
import sys
from typing import List, Optional

from linvit.bench.cli import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--targets', type=int, nargs='+', default=[90, 80], metavar='SM',
                        help='compute capabilities to compile for')
    parser.add_argument('--widths', type=int, nargs='+', default=[32, 64, 128], metavar='D',
                        help='head widths (D = Dv)')
    parser.add_argument('--dtypes', nargs='+', default=['float32', 'bfloat16', 'float16'],
                        choices=['float32', 'bfloat16', 'float16'], help='input dtypes')
    parser.add_argument('--key-weights', action='store_true', help='compile the key-weighted (masked) variants')
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get('TRITON_INTERPRET', '0') == '1':
        print("kernel_report.py: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    from linvit.bench.kernel_report import markdown, report
    rows = report(args.targets, args.widths, args.dtypes, args.key_weights)
    print(markdown(rows))
    spilling = [r for r in rows if r.spill_stores or r.spill_loads]
    print(f"\n{len(rows)} variants; {len(spilling)} spill" + (': ' + ', '.join(
        f"{r.kernel} {r.dtype} D{r.width} sm_{r.target}" for r in spilling) if spilling else ''))
    return 0


if __name__ == '__main__':
    sys.exit(main())
