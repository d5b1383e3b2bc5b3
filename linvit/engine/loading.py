"""Trained models back from disk, for inference and export: a run directory, a training checkpoint, or a
``.safetensors`` weights file next to its run's ``config.yaml``.

    trained = load_trained('runs/cls_demo')                                # the run's final weights, eval mode
    trained = load_trained('runs/cls_demo/best.pt', dynamic_img_size=True) # a classifier that takes any image size
    trained.model, trained.task, trained.class_names, trained.mean, trained.std, trained.cfg
    trained.img_size                          # (height, width) it was trained at: data.img_size
    load_weights(model, weights, 'best.pt')   # strict; position embeddings resampled to the model's grid

Which weights: a run directory gives ``model.safetensors`` (what the run evaluated last: the EMA weights when
train.ema was on), else ``best.pt``, else ``last.pt``; a checkpoint gives its EMA weights when it has them, else its
model weights. Class names come from the run's checkpoint (``best.pt`` / ``last.pt``); a run without one gets
'0', '1', ... with a warning. The model is rebuilt from the run's saved config (``model.pretrained_file`` and
``model.pretrained`` are not read again: the trained weights replace them; an ``hf-hub:`` model.name still reads its
config.json, from the Hugging Face cache offline) and loaded with strict key matching. A model built for another image
size gets the position embeddings resampled to its grid, as timm's ``checkpoint_filter_fn`` does for pretrained
weights (``timm.layers.resample_abs_pos_embed``, bicubic, from the grid of the saved config's data.img_size, square
or not); any other difference is a WeightsMismatchError whose
one line names the first differing key.
"""
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from omegaconf import DictConfig

from ..data import image_size
from .checkpoint import Checkpoint, CheckpointError, load_safetensors
from .config import ConfigError, config_from_yaml, load_config

# the file-level functions live in run_files (no task imports, so the tasks can use them); re-exported here
from .run_files import (
    RUN_WEIGHTS,
    RunFiles,
    WeightsMismatchError,
    find_run_files,
    load_weights,
    read_weights,
    resample_position_embeddings,
    saved_config_text,
    trained_img_size,
)
from .tasks import Task, build_task, normalization_of

__all__ = ['TrainedModel', 'load_trained', 'find_run_files', 'saved_config_text', 'read_weights', 'load_weights',
           'resample_position_embeddings', 'WeightsMismatchError', 'RUN_WEIGHTS']

_logger = logging.getLogger(__name__)


@dataclass
class TrainedModel:
    """A trained model in eval mode with what inference needs to feed it and read its output."""
    model: nn.Module
    cfg: DictConfig
    task: str  # the task whose model it is (a linearization's: the task it linearized), a key of TASKS
    class_names: List[str]
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    weights_path: str
    prediction_defaults: Dict[str, Any] = field(default_factory=dict)  # the task's (segmentation: seg.eval's)

    @property
    def img_size(self) -> Tuple[int, int]:
        """(height, width) of the images the model takes: its ``data.img_size`` (one side is a square)."""
        return image_size(self.cfg.data.img_size)


def _weights(files: RunFiles) -> Dict[str, torch.Tensor]:
    if files.weights_path.endswith('.safetensors'):
        return load_safetensors(files.weights_path)
    checkpoint = files.checkpoint if files.checkpoint is not None else Checkpoint.load(files.weights_path)
    return checkpoint.evaluated_weights()


def _class_names(checkpoint_path: Optional[str]) -> Optional[List[str]]:
    return Checkpoint.load(checkpoint_path).class_names if checkpoint_path is not None else None


def _classes_in_weights(weights: Dict[str, torch.Tensor], task: Task, where: str) -> int:
    if task.classifier_key in weights:
        return int(weights[task.classifier_key].shape[0])
    raise CheckpointError(f"{where}: found no classifier weight ({task.classifier_key or 'none'}) to count the "
                          f"classes of this {task.name} model")


def load_trained(path: str, dynamic_img_size: bool = False, overrides: Sequence[str] = (),
                 device: Any = 'cpu') -> TrainedModel:
    """The trained model that ``path`` (run directory, checkpoint .pt, or .safetensors beside config.yaml) holds.

    dynamic_img_size: build a classifier that takes any image size (timm's ``dynamic_img_size=True``; the weights
        are the same). Segmentation models always take any size whose sides the patch divides.
    overrides: config overrides (``key=value``) applied on top of the run's saved config.
    """
    files = find_run_files(path)
    extra = ['model.pretrained_file=null', 'model.pretrained=false']
    if dynamic_img_size:
        extra.append('model.kwargs.dynamic_img_size=true')
    try:
        cfg = load_config(None, [*extra, *overrides], base=config_from_yaml(files.config_text))
    except ConfigError as error:
        raise ConfigError(f"the config saved with {path} does not load: {error}") from error
    weights = _weights(files)
    task = build_task(cfg)
    served = task.inference_task()  # a linearization predicts as the task it linearized
    names = files.checkpoint.class_names if files.checkpoint is not None else _class_names(files.checkpoint_path)
    run_dir = os.path.dirname(os.path.abspath(files.weights_path))
    if names is None and task.final_run_dir(run_dir) != run_dir:
        # a run trained in stages keeps its checkpoints in its last stage's folder
        names = _class_names(find_run_files(task.final_run_dir(run_dir)).checkpoint_path)
    if names is None:
        count = _classes_in_weights(weights, served, files.weights_path)
        _logger.warning("%s: no checkpoint with class names next to the weights; classes are numbered 0..%d",
                        path, count - 1)
        names = [str(i) for i in range(count)]
    model = task.build_model(len(names))
    load_weights(model, weights, f"{files.weights_path} ({cfg.model.name}, {len(names)} classes)",
                 trained_size=trained_img_size(files.config_text))
    mean, std = normalization_of(cfg.model.name)
    return TrainedModel(model=model.to(device).eval(), cfg=cfg, task=served.name, class_names=names, mean=mean,
                        std=std, weights_path=files.weights_path, prediction_defaults=served.prediction_defaults())
