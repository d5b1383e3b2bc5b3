#!/usr/bin/env python
"""Training steps over several processes, per rank: peak memory, step time and the bytes each collective moves, for
context parallelism (one image's patch rows over 1, 2, 4 ranks) and for DDP against FSDP2, with timm's softmax ViT
on one process as the comparison.

    python tools/bench_distributed.py                                  # linvit-S, 2048 px, batch 1: context 1 2 4,
                                                                       # DDP vs FSDP2 at 2 ranks, ViT-S on one
    python tools/bench_distributed.py --context 1 2 --sync --softmax none --img-size 512 --steps 2
    python tools/bench_distributed.py --task seg --context 1 2 4 --sync --json /tmp/dist.json
    python tools/bench_distributed.py --model linvit_tiny_patch16_224:depth=2,patch_size=8 --img-size 64 \
        --softmax none --steps 1                                       # a tiny run, seconds
    python tools/bench_distributed.py --device cuda                    # nccl, one GPU per rank

The tool starts the processes itself (``torch.multiprocessing`` spawn; gloo on CPU, nccl on CUDA), a fresh set per
configuration. The context sweep runs each image over ``--context`` ranks (world = context; DDP over them keeps the
replicas equal, as a run with ``parallel.context`` does); the sync sweep runs ``--sync`` at ``--world`` ranks and
context 1 (FSDP2: ``fully_shard`` on every block and the root), AdamW in both. Each rank takes one counted warm-up
step (the bytes saved for backward, every collective by category) and ``--steps`` timed ones.

Columns: act = bytes saved for backward during the forward (exact, per storage, parameters left out); peak = the
timed steps' RSS (CPU) or allocated memory (CUDA); step = median ms of forward + backward + optimizer step (the
worst rank); state / halo B/layer = bytes per attention layer, forward + backward, of the attention state
all-reduce and of the local-mix halos; formula = 2 x 4 x (B H (Dv + 1) D + B H); ring K/V = what ring attention
would send: 3 x (context - 1) x 2 x B x (N / context) x H x D x 4 (forward K and V, backward K, V, dK, dV); wire =
bytes a rank sends with ring algorithms; opt-state = AdamW's state per rank; loss - ddp = the last step's loss
against DDP's (FSDP2's step should equal it). Ratios are against context 1 / DDP of the same run. The library is
``linvit.bench.distributed``.
"""
import argparse
import json
import sys
from typing import List, Optional

from linvit.bench.cli import HelpFormatter
from linvit.bench.distributed import SYNCS, TASKS, DistBench, launch, plan, report, softmax_spec
from linvit.bench.specs import parse_model_spec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--model', default='linvit_small_patch16_224', metavar='SPEC',
                        help="the linvit model, name[:key=value,...] as in profile_resolution.py")
    parser.add_argument('--img-size', type=int, default=2048, help='image side in px')
    parser.add_argument('--batch', type=int, default=1, help='images per step (every context rank passes the same)')
    parser.add_argument('--task', choices=TASKS, default='cls',
                        help='cls: the classifier; seg: a SegmentationModel on the backbone')
    parser.add_argument('--context', type=int, nargs='*', default=[1, 2, 4], metavar='N',
                        help='context sizes of the context sweep (world = context); none: no context sweep')
    parser.add_argument('--sync', nargs='*', choices=SYNCS, default=list(SYNCS),
                        help='the sync sweep at --world ranks and context 1; none: no sync sweep')
    parser.add_argument('--world', type=int, default=2, help='processes of the sync sweep')
    parser.add_argument('--softmax', default='auto', metavar='SPEC',
                        help="softmax model on one process: a model spec, 'auto' (vit_<rest> for linvit_<rest>, with "
                             "the linvit spec's ViT arguments) or 'none'")
    parser.add_argument('--steps', type=int, default=3, help='timed steps after one counted warm-up step')
    parser.add_argument('--threads', type=int, help='torch threads per process (default: cores // world, >= 1)')
    parser.add_argument('--device', default='cpu', choices=['cpu', 'cuda'], help='cpu (gloo) or cuda (nccl)')
    parser.add_argument('--json', metavar='PATH', help='also write every rank\'s raw row to this JSON file')
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and check (``args.bench`` is what to measure)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model = parse_model_spec(args.model)
        if args.steps < 1 or args.batch < 1 or args.world < 1 or min(args.context, default=1) < 1:
            raise ValueError('--steps, --batch, --world and --context must be >= 1')
        args.bench = DistBench(model, args.img_size, args.batch, args.task, tuple(args.context), tuple(args.sync),
                               args.world, softmax_spec(model, args.softmax), args.steps, args.threads, args.device)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rows = []
    for config in plan(args.bench):
        print(f"running {config.label} ({config.threads} thread(s) per process)", flush=True)
        rows += launch(config)
        if 'traceback' in rows[-1]:
            print(rows[-1]['traceback'], file=sys.stderr)
    print(report(rows, args.bench.device))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if not any('error' in row for row in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
