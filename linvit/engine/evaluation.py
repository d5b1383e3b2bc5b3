"""Evaluation on the validation set, written once for every task: a model into the task's meter (summed over every
process), the prediction picture of a step, and evaluating saved weights (``train.py --eval-only``).

    meter = evaluated_meter(run, model)                 # the task's meter, reduced over processes
    metrics = meter.compute()
    metrics = evaluate(cfg, 'runs/x/best.pt', 'runs/x/eval_best')   # saved weights -> metrics.json
"""
import os
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from ..data import DataError
from ..data.base import named
from .config import check_runs_here
from .distributed import setup_distributed
from .metrics import Meter
from .plots import plot_curves
from .run import Run, autocast_factory, batch_on_device, build_run, loader, use_threads
from .run_dir import RunDir
from .run_files import load_weights, read_weights, trained_img_size
from .run_log import write_json
from .sampler import ShardSampler

__all__ = ['evaluated_meter', 'save_prediction_picture', 'evaluate']

#: how many validation classes a class-count mismatch names
_NAMED_CLASSES = 8


@torch.no_grad()
def evaluated_meter(run: Run, model: nn.Module) -> Meter:
    """The task's meter after evaluating ``model`` on the validation set, reduced over every process. Evaluation
    draws nothing from the training RNGs (the shard sampler and the loader's generator are their own)."""
    info = run.info
    batches = loader(run, run.val_set, ShardSampler(len(run.val_set), info.rank, info.world_size),
                     run.task.eval_batch_size(), drop_last=False)
    meter = run.task.new_meter(info.device)
    autocast = autocast_factory(run)
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            images, targets = batch_on_device(run.val_set, batch, info.device)
            with autocast():
                run.task.evaluate_batch(model, images, targets, meter)
    finally:
        model.train(was_training)
    meter.reduce_()
    return meter


def save_prediction_picture(run: Run, model: nn.Module, step: int) -> str:
    """Draw the task's prediction picture of ``step`` (pictures/val_stepNNNNNN.png) and the curves so far
    (curves.png, from metrics.csv); returns the picture's path. Rank 0 only."""
    cfg, files = run.cfg, run.files
    os.makedirs(files.pictures, exist_ok=True)
    png_path = files.picture('val', step)
    was_training = model.training
    model.eval()
    try:
        run.task.save_pictures(model, run.val_set, run.class_names, png_path, run.mean, run.std, run.info.device,
                               autocast_factory(run))
    finally:
        model.train(was_training)
    if os.path.exists(files.metrics_csv):
        plot_curves(files.metrics_csv, files.curves, title=f"{cfg.model.name} on {cfg.data.name}")
    return png_path


def _check_classes(run: Run, weights: Dict[str, torch.Tensor], class_names: Optional[List[str]],
                   weights_path: str) -> None:
    """DataError when the weights were trained on other classes than the validation data has: by name when the
    weights carry their class names (a checkpoint), else by count (the rows of the task's classifier weight)."""
    if class_names is not None:
        if list(class_names) != list(run.class_names):
            raise DataError(f"{weights_path} was trained on classes {class_names} but the validation data has "
                            f"{run.class_names}")
        return
    key = run.task.classifier_key
    trained = int(weights[key].shape[0]) if key in weights else len(run.class_names)
    if trained != len(run.class_names):
        raise DataError(f"{weights_path} was trained on {trained} classes ({key} has {trained} rows) but the "
                        f"validation data has {len(run.class_names)}: {named(run.class_names, _NAMED_CLASSES)}; "
                        f"evaluate it on data with the classes it was trained on")


def evaluate(cfg: DictConfig, weights_path: str, out_dir: str) -> Dict[str, Any]:
    """Evaluate saved weights (a linvit checkpoint, its EMA weights when it has them, or a .safetensors file) on the
    validation set of ``cfg``; writes metrics.json (and a picture) into ``out_dir``; returns the metrics.

    Only the validation set is built (the training images are not read). A model built for another image size than
    the weights' gets their position embeddings resampled (as timm's checkpoint_filter_fn); weights that do not fit
    otherwise raise WeightsMismatchError naming the first keys."""
    check_runs_here(cfg)
    info = setup_distributed(cfg.device)
    use_threads(cfg.threads, info.device)
    weights, class_names, saved_config = read_weights(weights_path)
    if class_names is not None and cfg.data.num_classes is None:
        # the class count the weights were trained with: a segmentation folder without classes.txt need not read
        # its train masks to find it
        cfg = OmegaConf.merge(cfg, {'data': {'num_classes': len(class_names)}})
    run = build_run(cfg, info, with_train=False)
    _check_classes(run, weights, class_names, weights_path)
    load_weights(run.model, weights, weights_path, trained_size=trained_img_size(saved_config))
    metrics = run.task.final_metrics(evaluated_meter(run, run.model).compute())
    if info.is_main:
        os.makedirs(out_dir, exist_ok=True)
        write_json(RunDir(out_dir).metrics_json, metrics)
        if cfg.train.pictures:
            run.model.eval()
            run.task.save_pictures(run.model, run.val_set, run.class_names, os.path.join(out_dir,
                                   'val_predictions.png'), run.mean, run.std, info.device, autocast_factory(run))
    return metrics
