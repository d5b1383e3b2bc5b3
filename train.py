"""Train or evaluate a linvit (or any timm) model: the command line of ``linvit.engine``.

    python train.py --config configs/cls_demo.yaml [key=value ...]        # train; key=value overrides any config key
    python train.py --resume runs/demo [key=value ...]                     # continue runs/demo from its last.pt
    python train.py --eval-only runs/demo/best.pt [key=value ...]          # evaluate saved weights -> metrics.json
    torchrun --nproc_per_node 2 train.py --config ...                      # several processes (DDP)
"""
import argparse
import logging
import os
import sys

import linvit  # noqa: F401  (registers the linvit_* models with timm)
from linvit.engine import ConfigError, NonFiniteLossError, config_from_yaml, evaluate, load_config, train
from linvit.engine.checkpoint import load_checkpoint


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--config', help='YAML config file (configs/*.yaml); with --resume or --eval-only it is '
                                         'applied on top of the config saved in the checkpoint')
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument('--resume', metavar='RUN_DIR', help="continue the run in RUN_DIR from RUN_DIR/last.pt (or a "
                                                          "checkpoint file's run)")
    mode.add_argument('--eval-only', metavar='WEIGHTS', help='evaluate a checkpoint (.pt; its EMA weights when it '
                                                             'has them) or a .safetensors file, then exit')
    parser.add_argument('--out', help='--eval-only: directory for metrics.json (default: next to WEIGHTS, in '
                                      'eval_<name>/)')
    parser.add_argument('overrides', nargs='*', metavar='key=value', help='config overrides, e.g. train.epochs=3')
    args = parser.parse_args(argv)
    if not (args.config or args.resume or args.eval_only):
        parser.error('give --config FILE, --resume RUN_DIR or --eval-only WEIGHTS')
    return args


def _setup_logging() -> None:
    rank0 = os.environ.get('RANK', '0') == '0'
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING, stream=sys.stderr,
                        format='%(asctime)s %(levelname)s %(message)s', datefmt='%H:%M:%S')


def _resume_checkpoint(path: str) -> str:
    return os.path.join(path, 'last.pt') if os.path.isdir(path) else path


def run_resume(args: argparse.Namespace) -> dict:
    checkpoint_path = _resume_checkpoint(args.resume)
    state = load_checkpoint(checkpoint_path)
    run_dir = os.path.dirname(os.path.abspath(checkpoint_path))
    cfg = load_config(args.config, [f'output_dir={run_dir}', *args.overrides],
                      base=config_from_yaml(state['config']))
    return train(cfg, resume=state)


def run_eval_only(args: argparse.Namespace) -> dict:
    saved = None if args.eval_only.endswith('.safetensors') else load_checkpoint(args.eval_only).get('config')
    if saved is None and not args.config:
        raise ConfigError(f"{args.eval_only} carries no config: pass --config with the model and data it was "
                          f"trained with")
    cfg = load_config(args.config, args.overrides, base=config_from_yaml(saved) if saved else None)
    stem = os.path.splitext(os.path.basename(args.eval_only))[0]
    out_dir = args.out or os.path.join(os.path.dirname(os.path.abspath(args.eval_only)), f'eval_{stem}')
    metrics = evaluate(cfg, args.eval_only, out_dir)
    logging.info("evaluation written to %s", os.path.join(out_dir, 'metrics.json'))
    return metrics


def main(argv=None) -> int:
    args = parse_args(argv)
    _setup_logging()
    try:
        if args.resume:
            metrics = run_resume(args)
        elif args.eval_only:
            metrics = run_eval_only(args)
        else:
            cfg = load_config(args.config, args.overrides)
            metrics = train(cfg)
            logging.info("run directory %s: metrics.json, curves.png, pictures/, last.pt, best.pt, "
                         "model.safetensors, tb/ (tensorboard --logdir %s)", cfg.output_dir, cfg.output_dir)
    except ConfigError as error:
        print(f"train.py: config error: {error}", file=sys.stderr)
        return 2
    except (NonFiniteLossError, FileNotFoundError) as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return 1
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
