"""Trained models back from disk, for inference and export: a run directory, a training checkpoint, or a
``.safetensors`` weights file next to its run's ``config.yaml``.

    trained = load_trained('runs/demo')                                # the run's final weights, eval mode
    trained = load_trained('runs/demo/best.pt', dynamic_img_size=True) # a classifier that takes any image size
    trained.model, trained.task, trained.class_names, trained.mean, trained.std, trained.cfg

Which weights: a run directory gives ``model.safetensors`` (what the run evaluated last: the EMA weights when
train.ema was on), else ``best.pt``, else ``last.pt``; a checkpoint gives its EMA weights when it has them, else its
model weights. Class names come from the run's checkpoint (``best.pt`` / ``last.pt``); a run without one gets
'0', '1', ... with a warning. The model is rebuilt from the run's saved config (``model.pretrained_file`` is not
read again: the trained weights replace it) and loaded with strict key matching.
"""
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from omegaconf import DictConfig

from .checkpoint import load_checkpoint
from .config import ConfigError, config_from_yaml, load_config
from .tasks import build_task, normalization_of

__all__ = ['TrainedModel', 'load_trained', 'find_run_files', 'evaluated_weights', 'RUN_WEIGHTS', 'TASK_KINDS']

_logger = logging.getLogger(__name__)

#: the weights a run directory offers, in order of preference
RUN_WEIGHTS = ('model.safetensors', 'best.pt', 'last.pt')
_CHECKPOINTS = ('best.pt', 'last.pt')
#: the classifier weight of each task's model (by config task name), whose rows are the classes
_CLASSIFIER_KEYS = {'classification': ('head.weight',), 'seg': ('head.classifier.weight',)}
#: config task name -> what the model does (the word ONNX metadata and tools/predict.py use)
TASK_KINDS = {'classification': 'classification', 'seg': 'segmentation'}


@dataclass
class TrainedModel:
    """A trained model in eval mode with what inference needs to feed it and read its output."""
    model: nn.Module
    cfg: DictConfig
    task: str  # what the model does: 'classification' or 'segmentation' (``TASK_KINDS`` of the config's task)
    class_names: List[str]
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    weights_path: str

    @property
    def img_size(self) -> int:
        """The side of the square images the model was trained on (``data.img_size``)."""
        return int(self.cfg.data.img_size)


@dataclass
class RunFiles:
    config_text: str
    weights_path: str
    checkpoint_path: Optional[str]  # where the class names are read from
    checkpoint: Optional[Dict[str, Any]] = None  # its contents, when already loaded


def _existing(directory: str, names: Sequence[str]) -> Optional[str]:
    return next((os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))), None)


def _read_text(path: str) -> str:
    with open(path, encoding='utf-8') as f:
        return f.read()


def find_run_files(path: str) -> RunFiles:
    """The config, weights and checkpoint that ``path`` (run directory, .pt checkpoint or .safetensors) stands for."""
    if os.path.isdir(path):
        config = os.path.join(path, 'config.yaml')
        weights = _existing(path, RUN_WEIGHTS)
        if not os.path.isfile(config) or weights is None:
            raise FileNotFoundError(f"{path} is not a linvit run directory: it needs config.yaml and one of "
                                    f"{', '.join(RUN_WEIGHTS)}")
        return RunFiles(_read_text(config), weights, _existing(path, _CHECKPOINTS))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist (expected a run directory, a .pt checkpoint or a "
                                f".safetensors file)")
    if path.endswith('.safetensors'):
        config = os.path.join(os.path.dirname(os.path.abspath(path)), 'config.yaml')
        if not os.path.isfile(config):
            raise FileNotFoundError(f"{path} carries no config and there is no config.yaml next to it: pass its run "
                                    f"directory, or a checkpoint (.pt)")
        return RunFiles(_read_text(config), path, _existing(os.path.dirname(config), _CHECKPOINTS))
    state = load_checkpoint(path)
    if 'config' not in state or 'model' not in state:
        raise RuntimeError(f"{path} is not a linvit training checkpoint: it has no 'config' or 'model' entry")
    return RunFiles(state['config'], path, path, checkpoint=state)


def evaluated_weights(state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The weights a training checkpoint's run evaluates: its EMA weights when it has them, else its model's."""
    return state['ema'] if state.get('ema') is not None else state['model']


def _weights(files: RunFiles) -> Dict[str, torch.Tensor]:
    if files.weights_path.endswith('.safetensors'):
        from safetensors.torch import load_file
        return load_file(files.weights_path)
    return evaluated_weights(files.checkpoint if files.checkpoint is not None else load_checkpoint(files.weights_path))


def _class_names(files: RunFiles) -> Optional[List[str]]:
    if files.checkpoint_path is None:
        return None
    state = files.checkpoint if files.checkpoint is not None else load_checkpoint(files.checkpoint_path)
    names = state.get('class_names')
    return [str(n) for n in names] if names is not None else None


def _classes_in_weights(weights: Dict[str, torch.Tensor], task: str, where: str) -> int:
    for key in _CLASSIFIER_KEYS.get(task, ()):
        if key in weights:
            return int(weights[key].shape[0])
    raise RuntimeError(f"{where}: found no classifier weight ({', '.join(_CLASSIFIER_KEYS.get(task, ()))}) to count "
                       f"the classes of this {task} model")


def load_trained(path: str, dynamic_img_size: bool = False, overrides: Sequence[str] = (),
                 device: Any = 'cpu') -> TrainedModel:
    """The trained model that ``path`` (run directory, checkpoint .pt, or .safetensors beside config.yaml) holds.

    dynamic_img_size: build a classifier that takes any image size (timm's ``dynamic_img_size=True``; the weights
        are the same). Segmentation models always take any size whose sides the patch divides.
    overrides: config overrides (``key=value``) applied on top of the run's saved config.
    """
    files = find_run_files(path)
    extra = ['model.pretrained_file=null']
    if dynamic_img_size:
        extra.append('model.kwargs.dynamic_img_size=true')
    try:
        cfg = load_config(None, [*extra, *overrides], base=config_from_yaml(files.config_text))
    except ConfigError as error:
        raise ConfigError(f"the config saved with {path} does not load: {error}") from error
    weights = _weights(files)
    names = _class_names(files)
    if names is None:
        count = _classes_in_weights(weights, cfg.task, files.weights_path)
        _logger.warning("%s: no checkpoint with class names next to the weights; classes are numbered 0..%d",
                        path, count - 1)
        names = [str(i) for i in range(count)]
    model = build_task(cfg).build_model(len(names))
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        raise RuntimeError(f"{files.weights_path} does not fit the model its config builds ({cfg.model.name}, "
                           f"{len(names)} classes): {error}") from error
    mean, std = normalization_of(cfg.model.name)
    return TrainedModel(model=model.to(device).eval(), cfg=cfg, task=TASK_KINDS.get(cfg.task, cfg.task),
                        class_names=names, mean=mean, std=std, weights_path=files.weights_path)
