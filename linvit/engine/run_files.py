"""Run files and weights: which files a run directory, checkpoint or weights file stands for, the weights and
config they hold, and loading weights into a model strictly (position embeddings resampled to its grid).

The names of a run folder's files are ``RunDir``'s (``linvit.engine.run_dir``, the layout; exported here too).
These need no model registry or task, so everything that builds models (the tasks, the trainer,
``linvit.engine.loading``'s ``load_trained``) can use them without importing each other.
"""
import fnmatch
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from timm.layers import resample_abs_pos_embed

from ..data import image_size
from .checkpoint import Checkpoint, CheckpointError, atomic_write, load_safetensors
from .config import ConfigError, config_from_yaml
from .distributed import elastic_attempt, elastic_launch
from .run_dir import RunDir

__all__ = ['RunDir', 'RUN_WEIGHTS', 'RUN_DERIVED', 'RUN_STAGES', 'RUN_ENTRIES', 'RUN_RESULTS', 'RunExistsError',
           'run_entries_in', 'run_results_in', 'claim_run_dir', 'remove_unstarted_run', 'mark_launch',
           'restart_continues', 'RunFiles',
           'find_run_files', 'saved_config_text', 'SavedWeights', 'read_weights', 'load_weights',
           'resample_position_embeddings', 'trained_img_size', 'WeightsMismatchError']

_logger = logging.getLogger(__name__)

#: the weights a run directory offers, in order of preference
RUN_WEIGHTS = RunDir.WEIGHT_FILES
#: what other commands write into a run directory from its weights, by default: the ONNX files of
#: tools/export_onnx.py (the model's, its feature pyramid's), the hub folder of tools/export_hub.py and the
#: evaluations of train.py --eval-only (eval_<weights name>/). They describe the run's weights, so they go with them:
#: a run replaced by --overwrite takes them along.
RUN_DERIVED = (RunDir.ONNX, RunDir.FEATURES_ONNX, RunDir.HUB, f'{RunDir.EVALUATION_PREFIX}*')
#: the folders of a run trained in stages (a linearization), each a run directory of its own
RUN_STAGES = RunDir.STAGES
#: what train.py writes into a run directory (a staged run adds its stage folders and its state <task>.json), and
#: what is derived from it: the entries a replaced run takes along. Names or fnmatch patterns.
RUN_ENTRIES = (RunDir.CONFIG, RunDir.LAUNCH, RunDir.LOG, RunDir.METRICS_CSV, RunDir.METRICS_JSON, RunDir.LAST,
               RunDir.LAST_SHARDS, RunDir.BEST, RunDir.WEIGHTS, RunDir.CURVES, RunDir.PICTURES, RunDir.TENSORBOARD,
               'linearize.json', *RUN_STAGES, *RUN_DERIVED)
#: the entries that make a folder hold a run: something to resume or a result, of its own or in a stage folder (the
#: rest alone, a staged run's state included, is what a run that stopped before its first checkpoint leaves:
#: nothing that --resume could continue)
RUN_RESULTS = (RunDir.LAST, RunDir.BEST, RunDir.WEIGHTS, RunDir.METRICS_JSON, *RUN_DERIVED)
#: how many differing keys a WeightsMismatchError names before '(and N more)'
_NAMED_KEYS = 3


class WeightsMismatchError(CheckpointError):
    """Weights whose keys or shapes differ from the model's; the one-line message names the first keys."""


class RunExistsError(ConfigError):
    """A new run was pointed at a folder that already holds a run; the message offers the three ways on."""


def _present(directory: str, patterns: Sequence[str]) -> List[str]:
    """The entries of ``directory`` that match ``patterns`` (names or fnmatch patterns), in the patterns' order."""
    if not os.path.isdir(directory):
        return []
    names = sorted(os.listdir(directory))
    return [name for pattern in patterns for name in fnmatch.filter(names, pattern)]


def run_entries_in(directory: str) -> List[str]:
    """The RUN_ENTRIES present in ``directory`` (none when it does not exist)."""
    return _present(directory, RUN_ENTRIES)


def run_results_in(directory: str) -> List[str]:
    """The entries of ``directory`` that make it hold a run (RUN_RESULTS, and stage folders that hold a run)."""
    stages = [name for name in _present(directory, RUN_STAGES) if run_results_in(os.path.join(directory, name))]
    return _present(directory, RUN_RESULTS) + stages


def _free_sibling(directory: str) -> str:
    """``directory`` with the first suffix _2, _3, ... that names no existing path."""
    base = directory.rstrip(os.sep)
    return next(f"{base}_{n}" for n in range(2, 10 ** 6) if not os.path.exists(f"{base}_{n}"))


def _remove_entries(directory: str, names: Sequence[str]) -> None:
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def claim_run_dir(directory: str, found: Sequence[str], results: Sequence[str], overwrite: bool,
                  is_main: bool) -> None:
    """Make ``directory`` ready for a new run whose check found the entries ``found`` (``run_entries_in``) and the
    results ``results`` (``run_results_in``), both read by every process before any of them wrote: RunExistsError
    when it holds a run (a result), unless ``overwrite``. The main process then deletes the entries found (other
    files in the folder stay): those of the run replaced and what was derived from it (an ONNX export, evaluations),
    or what a run that stopped before its first checkpoint left. A second run never mixes its checkpoints, CSV rows,
    logs, events or pictures with the first's, nor leaves the first's export beside its own weights."""
    if results and not overwrite:
        raise RunExistsError(f"{directory} already holds a run ({', '.join(results[:4])}): continue it with "
                             f"--resume {directory}, start a new one with output_dir={_free_sibling(directory)}, or "
                             f"replace it with --overwrite")
    if not (found and is_main):
        return
    _remove_entries(directory, found)
    why = "--overwrite" if results else "a run that stopped before its first checkpoint"
    _logger.info("%s: removed the previous run's %s from %s", why, ', '.join(found), directory)


def remove_unstarted_run(directory: str, created: bool) -> None:
    """What a run refused by a check before its first result wrote into ``directory`` (config.yaml, an empty
    train.log, ...): removed, and the folder too when the run ``created`` it and it is left empty. A folder that holds
    a run (``run_results_in``) is left as it is."""
    if not os.path.isdir(directory) or run_results_in(directory):
        return
    _remove_entries(directory, run_entries_in(directory))
    if created and not os.listdir(directory):
        os.rmdir(directory)


def mark_launch(directory: str) -> None:
    """Record in ``directory`` (launch.json) the torchrun launch that started its run (``elastic_launch``), so that
    the launch's restarts continue the run instead of refusing the folder; nothing outside torchrun."""
    launch = elastic_launch()
    if launch is None:
        return
    os.makedirs(directory, exist_ok=True)
    with atomic_write(RunDir(directory).launch, mode='w') as f:
        json.dump({'launch': launch}, f)
        f.write('\n')


def _launch_of(directory: str) -> Optional[str]:
    """The launch launch.json names (None: no file, or one a crash left unreadable)."""
    try:
        with open(RunDir(directory).launch, encoding='utf-8') as f:
            return json.load(f).get('launch')
    except (OSError, ValueError, AttributeError):
        return None


def restart_continues(directory: str) -> Tuple[bool, str]:
    """(whether this new run is torchrun restarting the launch that started the run in ``directory``, which then
    continues from its latest checkpoint; why). torchrun's elastic agent starts the same command again after a
    worker died (TORCHELASTIC_RESTART_COUNT > 0) and expects it to continue its own run; any other run in the folder
    is refused as before. Rank 0's answer is the one to follow (``broadcast_from_main``)."""
    attempt = elastic_attempt()
    if not attempt:
        return False, 'not a torchrun restart'
    if _launch_of(directory) != elastic_launch():
        return False, (f"torchrun restart {attempt}, but {directory} holds the run of another launch (its "
                       f"{RunDir.LAUNCH} names {_launch_of(directory)!r}, this launch is {elastic_launch()!r})")
    if not run_results_in(directory):
        return False, f"torchrun restart {attempt}: the run stopped before its first checkpoint, it starts again"
    return True, (f"torchrun restart {attempt} of launch {elastic_launch()}: the run in {directory} continues from "
                  f"its latest checkpoint")


@dataclass
class RunFiles:
    config_text: str
    weights_path: str
    checkpoint_path: Optional[str]  # where the class names are read from
    checkpoint: Optional[Checkpoint] = None  # its contents, when already loaded


def _existing(directory: str, names: Sequence[str]) -> Optional[str]:
    return next((os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))), None)


def _beside(path: str) -> RunDir:
    """The run folder a weights file lies in."""
    return RunDir(os.path.dirname(os.path.abspath(path)))


def _read_text(path: str) -> str:
    with open(path, encoding='utf-8') as f:
        return f.read()


def find_run_files(path: str) -> RunFiles:
    """The config, weights and checkpoint that ``path`` (run directory, .pt checkpoint or .safetensors) stands for."""
    if os.path.isdir(path):
        config = RunDir(path).config
        weights = _existing(path, RUN_WEIGHTS)
        if not os.path.isfile(config) or weights is None:
            raise FileNotFoundError(f"{path} is not a linvit run directory: it needs {RunDir.CONFIG} and one of "
                                    f"{', '.join(RUN_WEIGHTS)}")
        return RunFiles(_read_text(config), weights, _existing(path, RunDir.CHECKPOINTS))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist (expected a run directory, a .pt checkpoint or a "
                                f".safetensors file)")
    if path.endswith('.safetensors'):
        config = _beside(path).config
        if not os.path.isfile(config):
            raise FileNotFoundError(f"{path} carries no config and there is no {RunDir.CONFIG} next to it: pass its "
                                    f"run directory, or a checkpoint (.pt)")
        return RunFiles(_read_text(config), path, _existing(os.path.dirname(config), RunDir.CHECKPOINTS))
    checkpoint = Checkpoint.load(path)
    if checkpoint.config is None:
        raise CheckpointError(f"{path} is not a linvit training checkpoint: it has no 'config' entry")
    return RunFiles(checkpoint.config, path, path, checkpoint=checkpoint)


def saved_config_text(path: str) -> Optional[str]:
    """The config a weights file was trained with (YAML text), or None when it carries none.

    A checkpoint (.pt) holds its config; a .safetensors file has it in the ``config.yaml`` beside it, if any.
    """
    if path.endswith('.safetensors'):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"weights file {path} does not exist")
        config = _beside(path).config
        return _read_text(config) if os.path.isfile(config) else None
    return Checkpoint.load(path).config


class SavedWeights(NamedTuple):
    """What a weights file gives evaluation: the weights, its class names and its training config (YAML text)."""
    weights: Dict[str, torch.Tensor]  # the weights a run evaluates (a checkpoint's EMA weights when it has them)
    class_names: Optional[List[str]]  # a checkpoint's; None for a .safetensors file
    config_text: Optional[str]  # a checkpoint's config, or the config.yaml beside a .safetensors file; None: none


def read_weights(path: str) -> SavedWeights:
    """The weights, class names and config of a checkpoint .pt or a .safetensors file, read once."""
    if path.endswith('.safetensors'):
        return SavedWeights(load_safetensors(path), None, saved_config_text(path))
    checkpoint = Checkpoint.load(path)
    return SavedWeights(checkpoint.evaluated_weights(), checkpoint.class_names, checkpoint.config)


def trained_img_size(config_text: Optional[str]) -> Optional[Tuple[int, int]]:
    """(height, width) of the data.img_size in a saved config's YAML text (a run's config.yaml, a checkpoint's
    config): the size its weights were trained at, which resampling their position embeddings needs; None without
    a config."""
    size = (config_from_yaml(config_text).get('data') or {}).get('img_size') if config_text else None
    return None if size is None else image_size(size)


def _owner(model: nn.Module, key: str) -> nn.Module:
    """The module that holds the parameter ``key`` (``backbone.pos_embed`` -> model.backbone)."""
    return model.get_submodule(key.rpartition('.')[0])


def _old_grid(owner: nn.Module, key: str, patches: int, trained_size: Optional[Tuple[int, int]]) -> List[int]:
    """[rows, columns] of the patch grid a position embedding of ``patches`` patch positions was made for: the
    training size (H, W) over the owner's patch when it is known, else the square grid of that many patches."""
    if trained_size is not None:
        grid = [side // patch for side, patch in zip(trained_size, owner.patch_embed.patch_size)]
        if grid[0] * grid[1] == patches:
            return grid
        raise WeightsMismatchError(f"{key} holds {patches} patch positions, not the {grid[0]}x{grid[1]} grid of the "
                                   f"training size {trained_size[0]}x{trained_size[1]} its config names")
    side = math.isqrt(patches)
    if side * side != patches:
        raise WeightsMismatchError(f"{key} holds {patches} patch positions, no square grid, and the size the weights "
                                   f"were trained at is unknown: load them with their run's config.yaml")
    return [side, side]


def _resampled_pos_embed(owner: nn.Module, key: str, pos_embed: torch.Tensor,
                         trained_size: Optional[Tuple[int, int]]) -> torch.Tensor:
    """``pos_embed`` [1, prefix + old grid, C] resampled to the owner's patch grid, as timm's checkpoint_filter_fn
    (bicubic, ``resample_abs_pos_embed``), from the old grid ``_old_grid`` finds."""
    prefix = 0 if getattr(owner, 'no_embed_class', False) else getattr(owner, 'num_prefix_tokens', 1)
    old = _old_grid(owner, key, pos_embed.shape[1] - prefix, trained_size)
    return resample_abs_pos_embed(pos_embed, new_size=list(owner.patch_embed.grid_size), old_size=old,
                                  num_prefix_tokens=prefix)


def _is_resized_grid(model: nn.Module, key: str, value: torch.Tensor, wanted: torch.Size) -> bool:
    """Whether ``value`` is a ViT's absolute position embedding [1, tokens, C] for another number of patches."""
    return (key.rpartition('.')[2] == 'pos_embed' and value.ndim == 3 and len(wanted) == 3
            and value.shape[1] != wanted[1] and value.shape[2] == wanted[2]
            and hasattr(_owner(model, key), 'patch_embed'))


def resample_position_embeddings(model: nn.Module, weights: Dict[str, torch.Tensor],
                                 trained_size: Optional[Tuple[int, int]] = None) -> Dict[str, torch.Tensor]:
    """``weights`` with every ``*pos_embed`` made for another patch grid resampled to the model's grid; other tensors
    as given (a different width is a mismatch for load_weights to report, not a size change).

    trained_size: (height, width) of the images the weights were trained on (their data.img_size), which gives the
        old grid; without it the old grid is taken as square, and a patch count that is no square is a
        WeightsMismatchError.
    """
    state = model.state_dict()
    fitted = dict(weights)
    for key, value in weights.items():
        if key in state and _is_resized_grid(model, key, value, state[key].shape):
            fitted[key] = _resampled_pos_embed(_owner(model, key), key, value, trained_size)
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
                 resample_pos_embed: bool = True, trained_size: Optional[Tuple[int, int]] = None) -> None:
    """Load ``weights`` into ``model`` with strict key matching.

    resample_pos_embed: a model built for another image size gets the position embeddings resampled to its grid
        (``resample_position_embeddings``, from the grid of ``trained_size`` (H, W) when given); False (resuming
        training, whose optimizer state has the old shape) treats a different size as a mismatch.
    Raises WeightsMismatchError naming ``source`` and the first differing keys, in one line.
    """
    if resample_pos_embed:
        try:
            weights = resample_position_embeddings(model, weights, trained_size)
        except WeightsMismatchError as error:
            raise WeightsMismatchError(f"{source}: {error}") from None
    found = _mismatches(model.state_dict(), weights)
    if found:
        more = f" (and {len(found) - _NAMED_KEYS} more)" if len(found) > _NAMED_KEYS else ''
        raise WeightsMismatchError(f"{source} does not fit the model its config builds: "
                                   f"{'; '.join(found[:_NAMED_KEYS])}{more}")
    model.load_state_dict(weights)
