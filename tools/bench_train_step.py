#!/usr/bin/env python
"""Whole-model steps in one process, interleaved: a linvit model, its floor and its softmax counterpart.

A training step is forward, cross-entropy and backward (no optimizer); with ``--workload inference`` a step is a
forward under inference_mode (eval mode, model and images cast to ``--dtype``). Eager or compiled. The three models
(the floor is the linvit model with token mixing removed) are built at each image size and stepped in turn, one step
of each per round, so that the machine's drift hits them alike; the table gives median milliseconds per step,
images/s and the ratios linvit/floor and linvit/softmax (of images/s: above 1 means linvit is faster). On a shared
machine whose speed drifts for seconds at a time these ratios hold steadier than those of a process per
configuration (``tools/profile_resolution.py``), which also measures peak memory.

    python tools/bench_train_step.py                                   # ViT-S/16 at 512 px, batch 2, eager and compiled
    python tools/bench_train_step.py --sizes 1024 --batch 2 --mode compiled --repeats 5
    python tools/bench_train_step.py --sizes 2048 --batch 1 --softmax none --csv /tmp/step.csv
    python tools/bench_train_step.py --model linvit_small_patch16_224:feature_map='relu' --dtype bfloat16
    python tools/bench_train_step.py --workload inference --sizes 1024 --batch 1 --mode compiled --softmax none \
        --repeats 30
    python tools/bench_train_step.py --model linvit_small_patch16_224 --sizes 1024 --batch 16 --mode compiled \
        --dtype bfloat16 --device cuda --profile-ops 3     # and where each model's step time goes

``--profile-ops S`` then profiles S more steps of each model (``torch.profiler``; kernel time on CUDA, op self time
on a CPU) and prints ms per step by kind of operation (matmul, attention, convolution, normalisation, copies and
casts, compiled fused kernels, other), linvit minus its floor per kind, and linvit's top ops
(``linvit.bench.op_profile``). With compiled steps on a CPU it turns on inductor's kernel profiling for the whole
run, so that fused kernels show by name (every model's timed steps then carry its small cost alike).

The compiled mode compiles each model's step once per size (the first warm-up step, not timed). On CPU training
steps and compiled models make glibc keep freed memory (``linvit.fast.allocator``: otherwise large freed buffers go
back to the system and are faulted in again on the next step, by amounts that vary from process to process); the
last line says the allocator setting in effect. The library is ``linvit.bench.train_step``.
"""
import argparse
import sys
from typing import List, Optional

from linvit.bench.cli import THREADS_HELP, HelpFormatter, precision_arg, threads_arg
from linvit.bench.specs import MODES, WORKLOADS, parse_model_spec, parse_size
from linvit.bench.train_step import TrainStepBench, run, softmax_counterpart
from linvit.precision import PRECISIONS
from linvit.timing import write_csv


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--model', default='linvit_small_patch16_224:local_mix=False', metavar='SPEC',
                        help="the linvit model, name[:key=value,...] as in profile_resolution.py")
    parser.add_argument('--softmax', default='auto', metavar='NAME',
                        help="the softmax model to compare with: a timm name, 'auto' (vit_<rest> for linvit_<rest>) "
                             "or 'none'")
    parser.add_argument('--sizes', nargs='+', type=parse_size, default=[(512, 512)], metavar='SIZE',
                        help='image sizes, N or HxW')
    parser.add_argument('--workload', choices=WORKLOADS, default='training',
                        help='training steps, or inference forwards (eval mode, inference_mode)')
    parser.add_argument('--batch', type=int, default=2, help='images per step')
    parser.add_argument('--mode', nargs='+', choices=MODES, default=list(MODES), help='eager and/or compiled steps')
    parser.add_argument('--dtype', type=precision_arg, choices=list(PRECISIONS), default='float32',
                        help='training: float32, or autocast to bfloat16/float16 around forward and loss (weights '
                             'stay float32); inference: model and images cast to it')
    parser.add_argument('--warmup', type=int, default=1, help='untimed steps of each model (the first compiles), >= 1')
    parser.add_argument('--repeats', type=int, default=3, help='timed rounds: one step of each model per round')
    parser.add_argument('--device', default='cpu', help="torch device, e.g. 'cpu' or 'cuda'")
    parser.add_argument('--threads', type=threads_arg, default='auto', help=THREADS_HELP)
    parser.add_argument('--csv', help='also write the table to this CSV file (times in ms)')
    parser.add_argument('--profile-ops', type=int, default=0, metavar='STEPS',
                        help='after the timing, profile this many steps of each model and print where the time '
                             'goes, by kind of operation (0: no profile)')
    parser.add_argument('--profile-top', type=int, default=10, metavar='N',
                        help="the profile lists linvit's N most expensive ops")
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and check (``args.bench`` is what to measure)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.model = parse_model_spec(args.model)
        args.softmax = softmax_counterpart(args.model, args.softmax)
        args.bench = TrainStepBench(args.model, args.softmax, args.sizes, args.batch, args.mode, args.dtype,
                                    args.warmup, args.repeats, args.device, args.workload, args.profile_ops,
                                    args.profile_top, args.threads)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rows = run(args.bench)
    if args.csv:
        write_csv(args.csv, rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
