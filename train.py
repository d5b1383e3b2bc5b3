"""Train or evaluate a linvit (or any timm) model: the command line of ``linvit.engine``.

    python train.py --config configs/cls_demo.yaml [key=value ...]    # train into runs/cls_demo; key=value overrides
    python train.py --config configs/cls_demo.yaml --overwrite         # the same, replacing the run already there
    python train.py --resume runs/cls_demo [key=value ...]             # continue runs/cls_demo from its last.pt
    python train.py --resume runs/cls_demo train.epochs=20             # train a finished run longer (re-planned lr)
    python train.py --eval-only runs/cls_demo/best.pt [key=value ...]  # evaluate saved weights -> metrics.json
    python train.py --eval-only runs/cls_demo                          # ... the run's model.safetensors
    python train.py --eval-only best.pt --config configs/seg_folder.yaml data.root=photos/   # on other data
    torchrun --nproc_per_node 2 train.py --config ...                  # several processes (DDP)

Saved weights are rebuilt as they were trained: with --resume / --eval-only the model keys (model.*), the task and
its head (seg.head, ...) and the training size (data.img_size) come from the checkpoint unless set on the command
line; a --config file then only says where the data lives and how to evaluate. Evaluating at another
data.img_size resamples the position embedding (as timm does for pretrained weights).

A new run never writes into a folder that holds another run: train.py refuses, and offers --resume, another
output_dir or --overwrite (which deletes that run's files first). Resuming a finished run says so and writes nothing.

Exit status: 0 done; 2 the command line or a config file is wrong (unknown key, model or task, a bad value, an
architecture change the weights do not fit); 1 a file or the data is wrong (missing, not a checkpoint, unreadable
images) or the training loss diverged. Each of these ends with one line on stderr; a traceback means a bug.
"""
import argparse
import logging
import os
import sys
from typing import Optional

from omegaconf import DictConfig

import linvit  # noqa: F401  (registers the linvit_* models with timm)
from linvit.data import DataError, LayoutError
from linvit.engine import (
    TASKS,
    ConfigError,
    NonFiniteLossError,
    config_from_yaml,
    evaluate,
    linearize,
    load_config,
    train,
)
from linvit.engine.checkpoint import CheckpointError, load_checkpoint
from linvit.engine.config import ARCHITECTURE_KEYS, differing_keys
from linvit.engine.loading import WeightsMismatchError, find_run_files, saved_config_text

#: exit status of an expected failure: the command line or a config is wrong / a file, the data or the run is
EXIT_CONFIG, EXIT_FAILURE = 2, 1
#: what the weights replace when they are loaded (not read again, so it may have moved since training)
_UNUSED_WITH_WEIGHTS = ['model.pretrained_file=null']


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


def _setup_logging() -> None:
    rank0 = os.environ.get('RANK', '0') == '0'
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING, stream=sys.stderr,
                        format='%(asctime)s %(levelname)s %(message)s', datefmt='%H:%M:%S')


def _resume_checkpoint(path: str) -> str:
    return os.path.join(path, 'last.pt') if os.path.isdir(path) else path


def _config_of_weights(config_file: Optional[str], overrides: list, saved: Optional[str]) -> DictConfig:
    """The run config for saved weights: the saved config (architecture keys kept), the file, then the overrides."""
    return load_config(config_file, overrides, base=config_from_yaml(saved) if saved else None,
                       keep_from_base=ARCHITECTURE_KEYS)


def _check_task(cfg: DictConfig) -> None:
    if cfg.task not in TASKS:
        raise ConfigError(f"task={cfg.task!r} is not one of {sorted(TASKS)}")


def _explained_mismatch(error: WeightsMismatchError, cfg: DictConfig, saved: Optional[str]) -> Exception:
    """A ConfigError naming the architecture keys the command line changed from the saved config, if any (those
    are why the weights do not fit); else the error itself."""
    if not saved:
        return error
    trained = load_config(None, _UNUSED_WITH_WEIGHTS, base=config_from_yaml(saved))
    changed = differing_keys(cfg, trained, ARCHITECTURE_KEYS)
    if not changed:
        return error
    names = ', '.join(f"{key}={new!r} (trained with {old!r})" for key, new, old in changed)
    return ConfigError(f"{error}; the command line sets {names}: drop it to use the weights as trained")


def load_checkpoint_of_run(path: str) -> dict:
    """A 'last' checkpoint's contents (CheckpointError for a file train.py did not write)."""
    state = load_checkpoint(path)
    if not isinstance(state.get('config'), str) or 'model' not in state:
        raise CheckpointError(f"{path} is not a linvit training checkpoint: it has no 'config' or 'model' entry "
                              f"(--resume takes a run directory or its last.pt)")
    return state


def _linearization_config(run_dir: str) -> Optional[str]:
    """The saved config of a linearization run directory (task: linearize, both stages), else None."""
    path = os.path.join(run_dir, 'config.yaml')
    if not (os.path.isdir(run_dir) and os.path.isfile(path)):
        return None
    with open(path, encoding='utf-8') as f:
        text = f.read()
    saved = config_from_yaml(text)
    stage = (saved.get('linearize') or {}).get('stage', 'all')
    return text if saved.get('task') == 'linearize' and stage == 'all' else None


def run_resume(args: argparse.Namespace) -> dict:
    saved = _linearization_config(args.resume)
    if saved is not None:  # its stages keep their own last.pt: linearize() finds where it stopped
        cfg = _config_of_weights(args.config, [f'output_dir={os.path.abspath(args.resume)}', *args.overrides], saved)
        return linearize(cfg, resume=True)
    checkpoint_path = _resume_checkpoint(args.resume)
    state = load_checkpoint_of_run(checkpoint_path)
    run_dir = os.path.dirname(os.path.abspath(checkpoint_path))
    cfg = _config_of_weights(args.config, [f'output_dir={run_dir}', *args.overrides], state['config'])
    _check_task(cfg)
    try:
        return train(cfg, resume=state)
    except WeightsMismatchError as error:
        raise _explained_mismatch(error, cfg, state['config']) from error


def _weights_of(path: str) -> str:
    """The weights file --eval-only evaluates: ``path`` itself, or a run directory's preferred weights."""
    return find_run_files(path).weights_path if os.path.isdir(path) else path


def run_eval_only(args: argparse.Namespace) -> dict:
    weights = _weights_of(args.eval_only)
    saved = saved_config_text(weights)
    if saved is None and not args.config:
        raise ConfigError(f"{weights} carries no config: pass --config with the model and data it was trained with")
    cfg = _config_of_weights(args.config, [*_UNUSED_WITH_WEIGHTS, *args.overrides], saved)
    _check_task(cfg)
    stem = os.path.splitext(os.path.basename(weights))[0]
    out_dir = args.out or os.path.join(os.path.dirname(os.path.abspath(weights)), f'eval_{stem}')
    if os.path.isfile(os.path.join(out_dir, 'metrics.json')):
        logging.warning("%s holds an earlier evaluation: its metrics.json is replaced (--out DIR keeps both)", out_dir)
    try:
        metrics = evaluate(cfg, weights, out_dir)
    except WeightsMismatchError as error:
        raise _explained_mismatch(error, cfg, saved) from error
    logging.info("evaluation written to %s", os.path.join(out_dir, 'metrics.json'))
    return metrics


def run_training(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config, args.overrides)
    _check_task(cfg)
    if cfg.task == 'linearize':
        metrics = linearize(cfg, overwrite=args.overwrite)
        logging.info("run directory %s: metrics.json and metrics.csv (the report), model.safetensors (the student), "
                     "stage1/ and stage2/ (each a run directory: checkpoints, curves, pictures, tb/)", cfg.output_dir)
        return metrics
    metrics = train(cfg, overwrite=args.overwrite)
    logging.info("run directory %s: metrics.json, curves.png, pictures/, last.pt, best.pt, "
                 "model.safetensors, tb/ (%s --logdir %s)", cfg.output_dir, _tensorboard_command(), cfg.output_dir)
    return metrics


def _tensorboard_command() -> str:
    """The tensorboard of this interpreter's environment (its bin/ is not on PATH unless the venv is active)."""
    here = os.path.join(os.path.dirname(sys.executable), 'tensorboard')
    return os.path.relpath(here) if os.path.isfile(here) else 'tensorboard'


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


def main(argv=None) -> int:
    args = parse_args(argv)
    _setup_logging()
    try:
        if args.resume:
            metrics = run_resume(args)
        elif args.eval_only:
            metrics = run_eval_only(args)
        else:
            metrics = run_training(args)
    except (ConfigError, LayoutError) as error:
        print(f"train.py: config error: {one_line(error)}", file=sys.stderr)
        return EXIT_CONFIG
    except (DataError, CheckpointError, NonFiniteLossError, FileNotFoundError) as error:
        print(f"train.py: error: {one_line(error)}", file=sys.stderr)
        return EXIT_FAILURE
    if os.environ.get('RANK', '0') == '0':
        print(summary_line(metrics))
    return 0


def summary_line(metrics: dict, prefix: str = '') -> str:
    """'top1=0.8110 loss=0.5123 ...'; nested results (per-class IoU) as 'per_class_iou.road=0.9012'."""
    items = []
    for key, value in metrics.items():
        if isinstance(value, dict):
            items.append(summary_line(value, f"{prefix}{key}."))
        else:
            items.append(f"{prefix}{key}={value:.4f}" if isinstance(value, float) else f"{prefix}{key}={value}")
    return ' '.join(items)


if __name__ == '__main__':
    sys.exit(main())
