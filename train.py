"""Train or evaluate a linvit (or any timm) model: the command line of ``linvit.engine``.

    python train.py --config configs/cls_demo.yaml [key=value ...]    # train into runs/cls_demo; key=value overrides
    python train.py --config configs/cls_demo.yaml --overwrite         # the same, replacing the run already there
    python train.py --resume runs/cls_demo [key=value ...]             # continue runs/cls_demo from its last.pt
    python train.py --resume runs/cls_demo train.epochs=20             # train a finished run longer (re-planned lr)
    python train.py --eval-only runs/cls_demo/best.pt [key=value ...]  # evaluate saved weights -> metrics.json
    python train.py --eval-only runs/cls_demo                          # ... the run's model.safetensors
    python train.py --eval-only best.pt --config configs/seg_folder.yaml data.root=photos/   # on other data
    torchrun --nproc_per_node 2 train.py --config ...                  # several processes (DDP)
    torchrun --standalone --nproc_per_node 2 --max-restarts 1 train.py ...   # a worker dies: the run continues

Saved weights are rebuilt as they were trained: --resume / --eval-only take the model keys (model.*), the task, its
head (seg.head, ...) and data.img_size from the checkpoint unless the command line sets them (a --config file says
where the data lives; another data.img_size resamples the position embedding, as timm does).

A new run refuses a folder that holds another run (offering --resume, another output_dir or --overwrite), except
torchrun's restarts of the launch that started it, which continue it. Resuming a finished run writes nothing. SIGTERM
saves a checkpoint at the next step boundary, the same step on every process (docs/training.md: several processes).

Exit status: 0 done; 2 the command line or a config file is wrong (unknown key, model or task, a bad value, weights
that do not fit); 1 a file or the data is wrong (missing, not a checkpoint, unreadable images) or the loss diverged;
130 Ctrl-C and 143 SIGTERM, saying what is kept and how to go on. Each ends with one line; a traceback means a bug.
"""
import argparse
import logging
import os
import sys

import linvit  # noqa: F401  (registers the linvit_* models with timm)
from linvit.data import DataError, LayoutError
from linvit.engine import ConfigError, NonFiniteLossError, RunInterrupted
from linvit.engine.checkpoint import CheckpointError
from linvit.engine.commands import evaluate_saved, resume_run, start_run
from linvit.engine.distributed import cleanup_distributed
from linvit.engine.trainer import RunTerminated

#: exit status: the command line or a config is wrong / a file, the data or the run is; after Ctrl-C and SIGTERM
#: (128 + the signal's number, as shells report a process the signal ended)
EXIT_CONFIG, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_TERMINATED = 2, 1, 130, 143


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--config', help='YAML config file (configs/*.yaml); with --resume or --eval-only it is '
                                         'applied on top of the config saved in the checkpoint, except the model, '
                                         'task and data.img_size, which only the command line changes')
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument('--resume', metavar='RUN_DIR', help="continue the run in RUN_DIR from RUN_DIR/last.pt (or a "
                                                          "checkpoint file's run)")
    mode.add_argument('--eval-only', metavar='WEIGHTS', help='evaluate a checkpoint (.pt; its EMA weights when it '
                                                             'has them) or a .safetensors file, then exit')
    parser.add_argument('--overwrite', action='store_true', help="a new run into an output_dir that holds a run: "
                                                                 "delete that run's files first (default: refuse)")
    parser.add_argument('--out', help='--eval-only: directory for metrics.json (default: next to WEIGHTS, in '
                                      'eval_<name>/)')
    parser.add_argument('overrides', nargs='*', metavar='key=value', help='config overrides, e.g. train.epochs=3')
    # intermixed: options may follow the key=value overrides (train.py --eval-only RUN data.img_size=512 --out DIR)
    args = parser.parse_intermixed_args(argv)
    if not (args.config or args.resume or args.eval_only):
        parser.error('give --config FILE, --resume RUN_DIR or --eval-only WEIGHTS')
    if args.overwrite and (args.resume or args.eval_only):
        parser.error('--overwrite starts a new run: it does not go with --resume or --eval-only')
    return args


def one_line(error: BaseException) -> str:
    """An error's message on one line. An error raised in a DataLoader worker arrives with the worker's traceback
    in its message: its last line holds the original message."""
    text = str(error).strip()
    if 'Original Traceback' in text:
        text = text.splitlines()[-1]  # 'linvit.data.base.DataError: 2 of 4 image files ...'
        raised_as, _, message = text.partition(': ')
        if raised_as.rpartition('.')[2] == type(error).__name__:
            text = message
    return ' '.join(line.strip() for line in text.splitlines() if line.strip())


def summary_line(metrics: dict, prefix: str = '') -> str:
    """'top1=0.8110 loss=0.5123 ...'; nested results (per-class IoU) as 'per_class_iou.road=0.9012'."""
    items = []
    for key, value in metrics.items():
        if isinstance(value, dict):
            items.append(summary_line(value, f"{prefix}{key}."))
        else:
            items.append(f"{prefix}{key}={value:.4f}" if isinstance(value, float) else f"{prefix}{key}={value}")
    return ' '.join(items)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank0 = os.environ.get('RANK', '0') == '0'
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING, stream=sys.stderr,
                        format='%(asctime)s %(levelname)s %(message)s', datefmt='%H:%M:%S')
    try:
        if args.resume:
            metrics = resume_run(args.resume, args.config, args.overrides)
        elif args.eval_only:
            metrics = evaluate_saved(args.eval_only, args.config, args.overrides, args.out)
        else:
            metrics = start_run(args.config, args.overrides, overwrite=args.overwrite)
    except (ConfigError, LayoutError) as error:
        print(f"train.py: config error: {one_line(error)}", file=sys.stderr)
        return EXIT_CONFIG
    except (DataError, CheckpointError, NonFiniteLossError, FileNotFoundError) as error:
        print(f"train.py: error: {one_line(error)}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM: where the run stands instead of a traceback
        said = one_line(interrupt) if isinstance(interrupt, RunInterrupted) else 'interrupted'
        print(f"train.py: {said}", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(interrupt, RunTerminated) else EXIT_INTERRUPTED
    finally:  # the process group (torchrun) ends with the run, whatever the outcome
        cleanup_distributed()
    if rank0:
        print(summary_line(metrics))
    return 0


if __name__ == '__main__':
    sys.exit(main())
