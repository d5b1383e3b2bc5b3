"""What train.py's three modes do, as library functions: start a run from a config file, resume a run, evaluate
saved weights. train.py parses its command line, calls one of them, and turns the expected errors into one line.

    metrics = start_run('configs/cls_demo.yaml', ['train.epochs=3'])           # a new run (overwrite=True replaces)
    metrics = resume_run('runs/cls_demo', None, ['train.epochs=20'])           # continue it (a longer schedule)
    metrics = evaluate_saved('runs/cls_demo/best.pt', None, ['data.root=photos/'])   # -> runs/cls_demo/eval_best/

Saved weights are rebuilt as they were trained: with ``resume_run`` and ``evaluate_saved`` the architecture keys
(``config_for_weights``: the task, model.*, data.img_size and the task's own, e.g. seg.head) come from the saved
config unless the overrides set them, so a config file only says where the data lives and how to evaluate. Weights
that do not fit the model the overrides ask for raise a ConfigError naming the keys the overrides changed.
"""
import logging
import os
from typing import Any, Dict, Optional, Sequence

from omegaconf import DictConfig

from .checkpoint import Checkpoint, CheckpointError
from .config import ConfigError, RunConfig, check_runs_here, config_from_yaml, differing_keys, load_config
from .distributed import broadcast_from_main, elastic_attempt, setup_distributed
from .evaluation import evaluate
from .run_dir import RunDir
from .run_files import WeightsMismatchError, find_run_files, restart_continues, saved_config_text
from .tasks import architecture_keys
from .trainer import train

__all__ = ['start_run', 'resume_run', 'evaluate_saved', 'config_for_weights', 'explained_mismatch']

_logger = logging.getLogger('linvit.train')

#: what the weights replace when they are loaded (not read again, so it may have moved since training)
_UNUSED_WITH_WEIGHTS = ('model.pretrained_file=null', 'model.pretrained=false')


def start_run(config_file: Optional[str], overrides: Sequence[str], overwrite: bool = False) -> Dict[str, Any]:
    """A new run of the config file with the overrides (``overwrite``: replace a run in its output_dir). Under
    ``torchrun --max-restarts``, a restart of the launch that started the run in output_dir continues that run from
    its latest checkpoint, as torchrun's elastic agent expects (``restart_continues``: rank 0 decides for all)."""
    cfg = load_config(config_file, overrides)
    if elastic_attempt():
        check_runs_here(cfg)
        info = setup_distributed(cfg.device)
        continues, why = broadcast_from_main(restart_continues(cfg.output_dir) if info.is_main else None)
        if info.is_main:
            _logger.info("%s", why)
        if continues:
            return resume_run(cfg.output_dir, config_file, overrides)
    return train(cfg, overwrite=overwrite)


def resume_run(path: str, config_file: Optional[str], overrides: Sequence[str]) -> Dict[str, Any]:
    """Continue the run in ``path`` (a run directory, or a checkpoint file of one) with the overrides."""
    files = RunDir(path)
    if _keeps_checkpoints_in_stages(path):  # train finds where each stage stopped
        cfg = config_for_weights(config_file, [f'output_dir={os.path.abspath(path)}', *overrides],
                                 _read_text(files.config))
        return train(cfg, resume=True)
    checkpoint_path = files.last if os.path.isdir(path) else path
    checkpoint = Checkpoint.load(checkpoint_path)
    if checkpoint.config is None:
        raise CheckpointError(f"{checkpoint_path} is not a linvit training checkpoint: it has no 'config' or 'model' "
                              f"entry (--resume takes a run directory or its last.pt)")
    run_dir = os.path.dirname(os.path.abspath(checkpoint_path))
    cfg = config_for_weights(config_file, [f'output_dir={run_dir}', *overrides], checkpoint.config)
    try:
        return train(cfg, resume=checkpoint)
    except WeightsMismatchError as error:
        raise explained_mismatch(error, cfg, checkpoint.config) from error


def evaluate_saved(path: str, config_file: Optional[str], overrides: Sequence[str],
                   out: Optional[str] = None) -> Dict[str, Any]:
    """Evaluate a weights file (a run directory: its preferred weights) on the validation data of its saved config,
    the config file and the overrides; metrics.json goes to ``out`` (default: eval_<weights name>/ beside it)."""
    weights = find_run_files(path).weights_path if os.path.isdir(path) else path
    saved = saved_config_text(weights)
    if saved is None and not config_file:
        raise ConfigError(f"{weights} carries no config: pass --config with the model and data it was trained with")
    cfg = config_for_weights(config_file, [*_UNUSED_WITH_WEIGHTS, *overrides], saved)
    stem = os.path.splitext(os.path.basename(weights))[0]
    out_dir = out or RunDir(os.path.dirname(os.path.abspath(weights))).evaluation(stem)
    metrics_path = RunDir(out_dir).metrics_json
    if os.path.isfile(metrics_path):
        _logger.warning("%s holds an earlier evaluation: its metrics.json is replaced (--out DIR keeps both)", out_dir)
    try:
        metrics = evaluate(cfg, weights, out_dir)
    except WeightsMismatchError as error:
        raise explained_mismatch(error, cfg, saved) from error
    _logger.info("evaluation written to %s", metrics_path)
    return metrics


def config_for_weights(config_file: Optional[str], overrides: Sequence[str], saved: Optional[str]) -> DictConfig:
    """The run config for saved weights: the saved config (YAML text; its architecture keys kept), the file, then
    the overrides."""
    base = config_from_yaml(saved) if saved else None
    keys = architecture_keys(base.get('task', RunConfig.task)) if base is not None else ()
    return load_config(config_file, overrides, base=base, keep_from_base=keys)


def explained_mismatch(error: WeightsMismatchError, cfg: DictConfig, saved: Optional[str]) -> Exception:
    """A ConfigError naming the architecture keys the command line changed from the saved config, if any (those
    are why the weights do not fit); else the error itself."""
    if not saved:
        return error
    trained = load_config(None, _UNUSED_WITH_WEIGHTS, base=config_from_yaml(saved))
    changed = differing_keys(cfg, trained, architecture_keys(trained.task))
    if not changed:
        return error
    names = ', '.join(f"{key}={new!r} (trained with {old!r})" for key, new, old in changed)
    return ConfigError(f"{error}; the command line sets {names}: drop it to use the weights as trained")


def _keeps_checkpoints_in_stages(path: str) -> bool:
    """A run directory with its config but no last.pt of its own: a run trained in stages keeps its checkpoints in
    its stages' folders (a run of one stage without last.pt is refused by ``train``, naming the missing file)."""
    files = RunDir(path)
    return os.path.isdir(path) and os.path.isfile(files.config) and not os.path.isfile(files.last)


def _read_text(path: str) -> str:
    with open(path, encoding='utf-8') as f:
        return f.read()
