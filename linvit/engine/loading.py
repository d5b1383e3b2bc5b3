"""Trained models back from disk, for inference and export: a run directory, a training checkpoint, or a
``.safetensors`` weights file next to its run's ``config.yaml``.

    trained = load_trained('runs/cls_demo')                                # the run's final weights, eval mode
    trained = load_trained('runs/cls_demo/best.pt', dynamic_img_size=True) # a classifier that takes any image size
    trained.model, trained.task, trained.class_names, trained.mean, trained.std, trained.cfg
    load_weights(model, weights, 'best.pt')   # strict; position embeddings resampled to the model's grid

Which weights: a run directory gives ``model.safetensors`` (what the run evaluated last: the EMA weights when
train.ema was on), else ``best.pt``, else ``last.pt``; a checkpoint gives its EMA weights when it has them, else its
model weights. Class names come from the run's checkpoint (``best.pt`` / ``last.pt``); a run without one gets
'0', '1', ... with a warning. The model is rebuilt from the run's saved config (``model.pretrained_file`` is not
read again: the trained weights replace it) and loaded with strict key matching. A model built for another image
size gets the position embeddings resampled to its grid, as timm's ``checkpoint_filter_fn`` does for pretrained
weights (``timm.layers.resample_abs_pos_embed``, bicubic); any other difference is a WeightsMismatchError whose
one line names the first differing key.
"""
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from omegaconf import DictConfig
from timm.layers import resample_abs_pos_embed

from ..deprecation import module_getattr
from .checkpoint import CheckpointError, load_checkpoint, load_safetensors
from .config import ConfigError, config_from_yaml, load_config
from .tasks import build_task, normalization_of

__all__ = ['TrainedModel', 'load_trained', 'find_run_files', 'saved_config_text', 'read_weights',
           'evaluated_weights', 'load_weights', 'resample_position_embeddings', 'WeightsMismatchError', 'RUN_WEIGHTS']

_logger = logging.getLogger(__name__)

#: the weights a run directory offers, in order of preference
RUN_WEIGHTS = ('model.safetensors', 'best.pt', 'last.pt')
_CHECKPOINTS = ('best.pt', 'last.pt')
#: the classifier weight of each task's model (by config task name), whose rows are the classes
_CLASSIFIER_KEYS = {'classification': ('head.weight',), 'segmentation': ('head.classifier.weight',)}
#: how many differing keys a WeightsMismatchError names before '(and N more)'
_NAMED_KEYS = 3


class WeightsMismatchError(CheckpointError):
    """Weights whose keys or shapes differ from the model's; the one-line message names the first keys."""


#: old public names, kept for one release: TASK_KINDS mapped the config's task to what the model does, which are
#: now the same word
_RENAMED = {'TASK_KINDS': ("the config's task (cfg.task, TrainedModel.task)",
                           lambda: {'classification': 'classification', 'seg': 'segmentation',
                                    'segmentation': 'segmentation'})}


def __getattr__(name: str) -> Any:
    return module_getattr(__name__, _RENAMED, name)


@dataclass
class TrainedModel:
    """A trained model in eval mode with what inference needs to feed it and read its output."""
    model: nn.Module
    cfg: DictConfig
    task: str  # the config's task: 'classification', 'segmentation' (or 'autoregressive')
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
        raise CheckpointError(f"{path} is not a linvit training checkpoint: it has no 'config' or 'model' entry")
    return RunFiles(state['config'], path, path, checkpoint=state)


def _training_checkpoint(path: str) -> Dict[str, Any]:
    """The contents of a checkpoint train.py wrote (CheckpointError for another torch file)."""
    state = load_checkpoint(path)
    if not isinstance(state.get('model'), dict):
        raise CheckpointError(f"{path} is not a linvit training checkpoint: it has no 'model' weights (expected a "
                              f"best.pt / last.pt that train.py wrote, or a .safetensors weights file)")
    return state


def saved_config_text(path: str) -> Optional[str]:
    """The config a weights file was trained with (YAML text), or None when it carries none.

    A checkpoint (.pt) holds its config; a .safetensors file has it in the ``config.yaml`` beside it, if any.
    """
    if path.endswith('.safetensors'):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"weights file {path} does not exist")
        config = os.path.join(os.path.dirname(os.path.abspath(path)), 'config.yaml')
        return _read_text(config) if os.path.isfile(config) else None
    return _training_checkpoint(path).get('config')


def read_weights(path: str) -> Tuple[Dict[str, torch.Tensor], Optional[List[str]]]:
    """(the weights a run evaluates, its class names or None) from a checkpoint .pt or a .safetensors file."""
    if path.endswith('.safetensors'):
        return load_safetensors(path), None
    state = _training_checkpoint(path)
    names = state.get('class_names')
    return evaluated_weights(state), [str(n) for n in names] if names is not None else None


def evaluated_weights(state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The weights a training checkpoint's run evaluates: its EMA weights when it has them, else its model's."""
    return state['ema'] if state.get('ema') is not None else state['model']


def _weights(files: RunFiles) -> Dict[str, torch.Tensor]:
    if files.weights_path.endswith('.safetensors'):
        return load_safetensors(files.weights_path)
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
    raise CheckpointError(f"{where}: found no classifier weight ({', '.join(_CLASSIFIER_KEYS.get(task, ()))}) to "
                          f"count the classes of this {task} model")


def _owner(model: nn.Module, key: str) -> nn.Module:
    """The module that holds the parameter ``key`` (``backbone.pos_embed`` -> model.backbone)."""
    return model.get_submodule(key.rpartition('.')[0])


def _resampled_pos_embed(owner: nn.Module, pos_embed: torch.Tensor) -> torch.Tensor:
    """``pos_embed`` [1, prefix + old grid, C] resampled to the owner's patch grid, as timm's checkpoint_filter_fn."""
    prefix = 0 if getattr(owner, 'no_embed_class', False) else getattr(owner, 'num_prefix_tokens', 1)
    return resample_abs_pos_embed(pos_embed, new_size=list(owner.patch_embed.grid_size), num_prefix_tokens=prefix)


def _is_resized_grid(model: nn.Module, key: str, value: torch.Tensor, wanted: torch.Size) -> bool:
    """Whether ``value`` is a ViT's absolute position embedding [1, tokens, C] for another number of patches."""
    return (key.rpartition('.')[2] == 'pos_embed' and value.ndim == 3 and len(wanted) == 3
            and value.shape[1] != wanted[1] and value.shape[2] == wanted[2]
            and hasattr(_owner(model, key), 'patch_embed'))


def resample_position_embeddings(model: nn.Module, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``weights`` with every ``*pos_embed`` made for another patch grid resampled to the model's grid (the old grid
    is square: linvit trains at data.img_size x data.img_size); other tensors as given (a different width is a
    mismatch for load_weights to report, not a size change)."""
    state = model.state_dict()
    fitted = dict(weights)
    for key, value in weights.items():
        if key in state and _is_resized_grid(model, key, value, state[key].shape):
            fitted[key] = _resampled_pos_embed(_owner(model, key), value)
            _logger.info("%s resampled from %d to %d tokens (the model's image size differs from the training size)",
                         key, value.shape[1], fitted[key].shape[1])
    return fitted


def _mismatches(state: Dict[str, torch.Tensor], weights: Dict[str, torch.Tensor]) -> List[str]:
    """What differs between a model's state_dict and weights, one short phrase per key, in the model's key order."""
    found = [f"{key} is {list(weights[key].shape)} in the weights, {list(value.shape)} in the model"
             for key, value in state.items() if key in weights and weights[key].shape != value.shape]
    found += [f"{key} is missing from the weights" for key in state if key not in weights]
    found += [f"{key} is in the weights but not in the model" for key in weights if key not in state]
    return found


def load_weights(model: nn.Module, weights: Dict[str, torch.Tensor], source: str,
                 resample_pos_embed: bool = True) -> None:
    """Load ``weights`` into ``model`` with strict key matching.

    resample_pos_embed: a model built for another image size gets the position embeddings resampled to its grid
        (``resample_position_embeddings``); False (resuming training, whose optimizer state has the old shape)
        treats a different size as a mismatch.
    Raises WeightsMismatchError naming ``source`` and the first differing keys, in one line.
    """
    if resample_pos_embed:
        weights = resample_position_embeddings(model, weights)
    found = _mismatches(model.state_dict(), weights)
    if found:
        more = f" (and {len(found) - _NAMED_KEYS} more)" if len(found) > _NAMED_KEYS else ''
        raise WeightsMismatchError(f"{source} does not fit the model its config builds: "
                                   f"{'; '.join(found[:_NAMED_KEYS])}{more}")
    model.load_state_dict(weights)


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
    load_weights(model, weights, f"{files.weights_path} ({cfg.model.name}, {len(names)} classes)")
    mean, std = normalization_of(cfg.model.name)
    return TrainedModel(model=model.to(device).eval(), cfg=cfg, task=cfg.task,
                        class_names=names, mean=mean, std=std, weights_path=files.weights_path)
