"""What every task shares: the ``Task`` interface, the ``TASKS`` registry, and building a timm model from the config.

A task builds its datasets, model, training loss, batch mixing and metrics from the run config, evaluates one
batch into a meter, and draws its pictures; the loop in ``linvit.engine.trainer`` is written once for all of them.
It also says what the rest of linvit needs to know about it, so that nothing outside the task tests its name: the
config keys its weights are built with (``architecture_keys``), the weight whose rows are its classes
(``classifier_key``), what prediction and ONNX export read from its models (``logits_rank``, ``predicts_boxes``,
``predicts_values``, ``prediction_defaults``), and whether it trains in stages (``staged_run``: linearize).
A task is one module of this package that subclasses ``Task`` and decorates it with ``@register_task``; the
package's ``__init__`` imports every such module, so ``TASKS`` is complete as soon as ``linvit.engine`` is imported.
"""
import contextlib
import functools
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type, Union

import timm
import torch
import torch.nn as nn
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import EntryNotFoundError
from omegaconf import DictConfig, OmegaConf
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models._hub import load_model_config_from_hf, load_model_config_from_path  # timm 1.0.31's readers
from torch.utils.data import Dataset

from ...data import image_size, size_text
from ...layers import make_floor
from ...models import convert_to_linear
from ...registry import Registry
from ..config import ARCHITECTURE_KEYS, ConfigError, config_choice
from ..metrics import Meter

__all__ = ['Task', 'Stage', 'StagedRun', 'TASKS', 'register_task', 'list_tasks', 'input_multiple',
           'nearest_multiples', 'build_task', 'architecture_keys', 'task_of_logits', 'predicted_tasks',
           'create_model_from_config', 'picture_indices',
           'normalization_of', 'model_keywords', 'ModelSource', 'model_source']

_logger = logging.getLogger('linvit.train')


@dataclass(frozen=True)
class Stage:
    """One run of a task trained in stages: a whole run (checkpoints, resume, curves) in its own folder of the run
    directory, with its own config."""
    folder: str  # its folder in the run directory ('stage1'), and its key in the run's state file
    config: DictConfig  # its run config: output_dir is <run directory>/<folder>


@dataclass(frozen=True)
class StagedRun:
    """How a task trained in stages runs (``Task.staged_run``): its stages in order, and the run's own config (what
    config.yaml keeps: it rebuilds the final model, as any run's does)."""
    config: DictConfig
    stages: Tuple[Stage, ...]


class Task:
    """The interface the training loop uses. Subclasses set ``name``, ``main_metric`` and ``metric_columns``."""
    name: str = ''
    main_metric: str = ''  # a key of evaluate()'s result; larger is better
    metric_columns: Sequence[str] = ()  # the CSV / TensorBoard metric names of an evaluation besides 'loss'
    #: config keys beyond ARCHITECTURE_KEYS (task, model.*, data.img_size) that shape its model's weights: loading
    #: saved weights takes them from the saved config unless the command line sets them
    architecture_keys: Tuple[str, ...] = ()
    #: the state-dict key of its model's classifier weight, whose rows are the classes ('' when it has none)
    classifier_key: str = ''
    #: the rank of its model's logits, which prediction and ONNX files are read by: 2 ([B, K], one label per image),
    #: 4 ([B, K, H, W], one per pixel); 0 when its models predict no labels (a detector's boxes, a next patch)
    logits_rank: int = 0
    #: whether its models predict boxes (a detector: per image {'boxes', 'scores', 'labels'}) rather than logits
    predicts_boxes: bool = False
    #: whether its models predict a value per pixel rather than labels: one output channel [B, 1, H, W], the log of
    #: the value; ``prediction_defaults()['values']`` says which value and how it is stored (depth)
    predicts_values: bool = False
    #: why tools/predict.py does not take its runs ('' when it does: ``predicted_tasks``)
    not_predicted: str = ''
    #: whether data.img_size may be [height, width] (non-square images); a task that takes one side refuses a pair
    #: when it is built (``check_square_size``)
    non_square: bool = False
    #: whether its model has a backbone and a head apart, so that ``model.freeze_backbone=true`` trains the head only
    frozen_backbone: bool = False

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.check_square_size()
        if cfg.model.get('freeze_backbone', False) and not self.frozen_backbone:
            takers = ', '.join(name for name, task in TASKS.items() if task.frozen_backbone)
            raise ConfigError(f"model.freeze_backbone=true: task={self.name} trains its model whole; a frozen "
                              f"backbone with a trained head is for task={takers}")

    def check_square_size(self) -> None:
        """ConfigError for a non-square data.img_size [height, width] when the task takes one side only."""
        height, width = image_size(self.cfg.data.img_size)
        if height != width and not self.non_square:
            takers = ', '.join(name for name, task in TASKS.items() if task.non_square)
            raise ConfigError(f"data.img_size=[{height}, {width}]: task={self.name} takes one side (square images, "
                              f"e.g. data.img_size={max(height, width)}); [height, width] is for task={takers}")

    def build_datasets(self, mean: Sequence[float], std: Sequence[float],
                       with_train: bool = True) -> Tuple[Optional[Dataset], Dataset, List[str]]:
        """(train, val, class names); samples are keyed by (index, seed) (see ``linvit.data``). with_train=False
        (evaluating saved weights) builds val only: train is None and its files are not read."""
        raise NotImplementedError

    def build_model(self, num_classes: int) -> nn.Module:
        raise NotImplementedError

    def train_loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """loss_fn(outputs, targets) -> mean loss of the batch (targets as the batch mixer leaves them)."""
        raise NotImplementedError

    def batch_mixer(self, num_classes: int) -> Optional[Callable]:
        """Optional (images, targets) -> (images, targets) applied to training batches (e.g. Mixup); None: off."""
        return None

    def eval_batch_size(self) -> int:
        """Validation samples per loader batch."""
        return self.cfg.data.eval_batch_size or self.cfg.data.batch_size

    #: the file stem and TensorBoard tag of ``plot_evaluation``'s picture (pictures/<stem>_stepNNNNNN.png)
    evaluation_picture: str = 'confusion'

    def describe_evaluation(self) -> str:
        """How the validation images are evaluated, for the log line of each evaluation."""
        return f"validation images at {size_text(image_size(self.cfg.data.img_size))} px"

    def check_input_size(self, model: nn.Module) -> None:
        """ConfigError when a side of data.img_size (or another size the task feeds the model) is not a multiple of
        the model's patch; called once the model is built, before any step."""
        multiple = input_multiple(model)
        height, width = image_size(self.cfg.data.img_size)
        model_name = f"model.name={self.cfg.model.name!r}"
        if height == width and height % multiple:
            raise ConfigError(f"data.img_size={height} is not a multiple of the patch size {multiple} of "
                              f"{model_name}: use {nearest_multiples(height, multiple)}")
        for side, size in (('height', height), ('width', width)):
            if size % multiple:
                raise ConfigError(f"data.img_size=[{height}, {width}]: the {side} {size} is not a multiple of the "
                                  f"patch size {multiple} of {model_name}: use {nearest_multiples(size, multiple)}")

    def new_meter(self, device: torch.device) -> Meter:
        """The task's meter: ``update`` per batch, ``reduce_()`` (sum over processes), ``compute() -> dict``."""
        raise NotImplementedError

    def evaluate_batch(self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor, meter: Meter) -> None:
        """Add one validation batch (images [B, C, H, W] and its targets, on the device) to ``meter``."""
        raise NotImplementedError

    def final_metrics(self, computed: Dict[str, float]) -> Dict[str, float]:
        """What metrics.json holds, from the meter's ``compute()``."""
        return dict(computed)

    def save_pictures(self, model: nn.Module, dataset: Dataset, class_names: List[str], png_path: str,
                      mean: Sequence[float], std: Sequence[float], device: torch.device,
                      autocast: Callable) -> None:
        """Draw a PNG of predictions on the first validation samples (rank 0 only)."""

    def plot_evaluation(self, meter: Meter, class_names: List[str], png_path: str) -> bool:
        """Draw a picture of a whole evaluation from its reduced meter (classification: the confusion matrix) into
        png_path; False when the task has none. Called after ``meter.reduce_()`` (on rank 0); draws nothing and
        returns False when this task, or this meter, has no such picture."""
        return False

    # ---------------------------------------------------------------- the trained model, for prediction and export

    def inference_task(self) -> 'Task':
        """The task whose model a finished run of this task is (prediction, export, its classes): itself; a
        linearization, the task it linearized."""
        return self

    def prediction_defaults(self) -> Dict[str, Any]:
        """How prediction runs its model unless told otherwise (segmentation: seg.eval's mode, window, stride), and
        what it writes: a ``predicts_values`` task's 'values' are {'name': the value (file names, messages), 'unit',
        'png_scale': the value of one unit of a 16-bit PNG} (JSON, as ONNX files record them)."""
        return {}

    def final_run_dir(self, run_dir: str) -> str:
        """The run directory whose checkpoints hold the final model's class names: ``run_dir``; a task trained in
        stages, its last stage's folder."""
        return run_dir

    # ---------------------------------------------------------------- tasks trained in stages

    def staged_run(self) -> Optional[StagedRun]:
        """The stages of a task trained as several runs, one after the other (each resumable on its own; the last
        one's weights are the run's), or None for a task trained as one run (the default)."""
        return None

    def baselines(self, first_stage: 'Task', model: nn.Module) -> Dict[str, nn.Module]:
        """A staged task's reference models, evaluated on the validation set before its first stage trains
        (``first_stage`` built ``model``, that stage's model, and has not trained it); their metrics go to
        ``report``."""
        return {}

    def report(self, state: Dict[str, Any], is_main: bool) -> Dict[str, Any]:
        """A staged task's final metrics (metrics.json) from ``state``: 'baselines' (name -> metrics, and
        'num_classes') and per stage folder {'metrics', 'steps', 'wall_s', 'resumed_from_step'}. Runs on every
        process; measurements a resumed run need not repeat can be kept in ``state``."""
        raise NotImplementedError(f"{type(self).__name__} trains in stages but has no report")

    def write_report(self, out_dir: str, report: Dict[str, Any]) -> None:
        """Files and log lines of a staged task's report besides metrics.json (rank 0 only)."""


def picture_indices(length: int, count: int) -> List[int]:
    """The indices of the ``min(count, length)`` samples of a data set of ``length`` that a task's pictures show:
    spread evenly from the first to the last, the same ones at every evaluation."""
    count = min(count, length)
    return [round(i * (length - 1) / max(count - 1, 1)) for i in range(count)]


def input_multiple(model: nn.Module) -> int:
    """What an input side must be a multiple of: the model's own ``input_multiple``, a ViT's patch, else 1."""
    if hasattr(model, 'input_multiple'):
        return int(model.input_multiple)
    patch = getattr(getattr(model, 'patch_embed', None), 'patch_size', 1)
    return max(patch) if isinstance(patch, (tuple, list)) else int(patch)


def nearest_multiples(size: int, multiple: int) -> str:
    below, above = size // multiple * multiple, (size // multiple + 1) * multiple
    return f"{below} or {above}" if below > 0 else str(above)


#: the config's ``task:`` value -> the Task class
TASKS: Registry[Type[Task]] = Registry('task')
config_choice('task', TASKS)


def register_task(cls: Type[Task]) -> Type[Task]:
    """Class decorator: register ``cls`` in ``TASKS`` under ``cls.name`` (the config's ``task:`` value); a second
    class of the same name is a ValueError."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name: set the class attribute name = '<task>'")
    return TASKS.register(cls.name, cls)


def list_tasks() -> List[str]:
    """Every ``task:`` value, in registration order."""
    return TASKS.names()


def build_task(cfg: DictConfig) -> Task:
    """The task ``cfg.task`` names, built from the run config."""
    return TASKS.get(cfg.task)(cfg)


def architecture_keys(task_name: str) -> Tuple[str, ...]:
    """The config keys that saved weights of a ``task_name`` run were built with: ``ARCHITECTURE_KEYS`` and the
    task's own ``architecture_keys`` (none for a name no task has: building it fails later, with its own message)."""
    task = TASKS.find(task_name)
    return tuple(ARCHITECTURE_KEYS) + (tuple(task.architecture_keys) if task is not None else ())


def predicted_tasks() -> List[str]:
    """The tasks whose runs tools/predict.py takes, in registration order: their models predict labels
    (``logits_rank``), boxes or values per pixel, and they give no ``not_predicted`` reason."""
    return [name for name, task in TASKS.items()
            if (task.logits_rank or task.predicts_boxes or task.predicts_values) and not task.not_predicted]


def task_of_logits(rank: int) -> Optional[str]:
    """The name of the first registered task whose models' logits have ``rank`` dimensions (2: labels per image, 4:
    per pixel), or None: what an ONNX file of a model that no run describes is read as."""
    return next((name for name, task in TASKS.items() if rank and task.logits_rank == rank), None)


@dataclass(frozen=True)
class ModelSource:
    """What timm reads for a model name before building it: the registered architecture, the pretrained config of
    its weights (timm's ``pretrained_cfg`` as a dict: mean, std, input_size, num_classes, classifier, ...) and the
    saved model arguments of an ``hf-hub:`` / ``local-dir:`` model (its config.json's ``model_args``)."""
    architecture: str  # 'vit_base_patch16_224' for 'vit_base_patch16_224.augreg2_in21k_ft_in1k' or a hub name
    pretrained_cfg: Dict[str, Any]
    model_args: Dict[str, Any]
    from_hub: bool  # an hf-hub: or local-dir: name (its config.json is read, from the hub's cache or the folder)


def model_source(model_name: str) -> ModelSource:
    """The ``ModelSource`` of ``model_name`` as ``timm.create_model`` reads it: a registry name with or without a
    pretrained tag, ``hf-hub:org/name`` (config.json from the hub or its cache) or ``local-dir:FOLDER`` (its
    config.json). ValueError for a name timm does not know; ConfigError (one line) when a hub config cannot be had."""
    source, model_id = timm.models.parse_model_name(model_name)
    if source == 'hf-hub':
        return _hub_source(model_name, model_id)
    if source == 'local-dir':
        with weights_errors(model_name):
            return _saved_source(*load_model_config_from_path(model_id))
    architecture = timm.models.split_model_name_tag(model_name)[0]
    if not timm.is_model(architecture):
        raise ValueError(f"model.name={model_name!r} is not a timm model (after `import linvit`); see "
                         f"timm.list_models() or timm.list_models('linvit_*')")
    pretrained_cfg = timm.models.get_pretrained_cfg(model_name)
    return ModelSource(architecture, pretrained_cfg.to_dict() if pretrained_cfg else {}, {}, False)


@functools.lru_cache(maxsize=16)
def _hub_source(model_name: str, repo_id: str) -> ModelSource:
    """An hf-hub: name's source, read once per process: every caller (normalization, keywords, the model) asks for
    it, and each read online asks the hub again. (A local-dir: folder is read each time: it may be rewritten.)"""
    with weights_errors(model_name):
        return _saved_source(*load_model_config_from_hf(repo_id))


def _saved_source(pretrained_cfg: Dict[str, Any], architecture: str, model_args: Dict[str, Any]) -> ModelSource:
    return ModelSource(architecture, dict(pretrained_cfg), dict(model_args or {}), True)


def normalization_of(model_name: str) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """(mean, std) the model was (or would be) pretrained with, from timm's pretrained config of ``model_name`` (an
    ``hf-hub:`` / ``local-dir:`` model's config.json holds it)."""
    cfg = model_source(model_name).pretrained_cfg
    mean = cfg.get('mean') or IMAGENET_DEFAULT_MEAN
    std = cfg.get('std') or IMAGENET_DEFAULT_STD
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def model_keywords(model_name: str) -> Set[str]:
    """The keyword arguments the classes of the model's timm module take (``depth``, ``img_size``, ...): what
    ``model.kwargs`` can name, read from their signatures."""
    entrypoint = timm.models.model_entrypoint(model_source(model_name).architecture)
    # timm's entrypoints take **kwargs and forward them to the model class named in their module; look there
    module = inspect.getmodule(entrypoint)
    return {name for obj in vars(module).values() if isinstance(obj, type) and issubclass(obj, nn.Module)
            for name, parameter in inspect.signature(obj).parameters.items()
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)}


def _accepts_img_size(model_name: str) -> bool:
    """Whether the model's class takes ``img_size`` (ViTs do, CNNs don't)."""
    return 'img_size' in model_keywords(model_name)


#: what timm's and linvit's loaders raise when a name has no weights at all (not a missing download)
_NO_WEIGHTS = ('No pretrained weights exist', 'no pretrained weights are published', 'No suitable checkpoints found')


@contextlib.contextmanager
def weights_errors(model_name: str) -> Iterator[None]:
    """Turn what timm and huggingface_hub raise when pretrained weights (or an hf-hub config) cannot be had --
    offline without a cache, no network, an unknown repository, a name without weights -- into one-line
    ConfigErrors that name the model, HF_HUB_OFFLINE and the local alternatives; anything else passes through."""
    try:
        yield
    except (OSError, EntryNotFoundError) as error:
        raise ConfigError(_unavailable_message(model_name, error)) from error
    except RuntimeError as error:
        if not any(words in str(error) for words in _NO_WEIGHTS):
            raise
        raise ConfigError(f"model.pretrained=true but no pretrained weights exist for model.name={model_name!r} "
                          f"({_first_line(error)}): use model.pretrained_file=PATH (local weights), a "
                          f"local-dir:FOLDER or hf-hub:org/name model.name, or model.pretrained=false") from error


def _unavailable_message(model_name: str, error: BaseException) -> str:
    """One line: which weights could not be had, why, and what to do (online once, or local weights)."""
    if hf_constants.is_offline_mode():
        why = (f"HF_HUB_OFFLINE=1 and they are not in the Hugging Face cache ({hf_constants.HF_HUB_CACHE}"
               f"): download them once with HF_HUB_OFFLINE unset")
    else:
        why = "downloading failed: connect once to fill the cache (then HF_HUB_OFFLINE=1 works offline)"
    return (f"model.name={model_name!r}: its pretrained weights cannot be loaded ({type(error).__name__}: "
            f"{_first_line(error)}); {why}, or use local weights: model.pretrained_file=PATH or "
            f"model.name=local-dir:FOLDER")


def _first_line(error: BaseException, limit: int = 160) -> str:
    """The first line of an error's message, shortened: the libraries' messages run over many lines."""
    line = next((text.strip() for text in str(error).splitlines() if text.strip()), '')
    return line if len(line) <= limit else line[:limit - 3] + '...'


def _log_pretrained_size(model_name: str, img_size: Union[int, Sequence[int]]) -> None:
    """INFO when the weights were pretrained at another input size than data.img_size (which is what the model is
    built for: timm resamples the position embedding), so that the user sees the checkpoint's own size."""
    input_size = model_source(model_name).pretrained_cfg.get('input_size')
    if input_size and tuple(input_size[1:]) != image_size(img_size):
        _logger.info("%s was pretrained at %s px; the model is built for data.img_size=%s (the position embedding is "
                     "resampled)", model_name, size_text(tuple(input_size[1:])), size_text(image_size(img_size)))


def _head_classes(path: str, model_name: str) -> Optional[int]:
    """Rows of the classifier weight stored in a weights file (None when it has none): read from the header of a
    .safetensors file, or a memory-mapped weights-only load of a torch file."""
    head = model_source(model_name).pretrained_cfg.get('classifier') or 'head'
    key = f"{head}.weight"
    if path.endswith('.safetensors'):
        from safetensors import safe_open
        with safe_open(path, framework='pt') as f:
            return f.get_slice(key).get_shape()[0] if key in f.keys() else None
    state = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
    state = state.get('model', state.get('state_dict', state)) if isinstance(state, dict) else {}
    weight = state.get(key) if isinstance(state, dict) else None
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else None


def pretrained_overlay(path: str, model_name: str, num_classes: int) -> Dict[str, Any]:
    """timm's ``pretrained_cfg_overlay`` that loads the local file ``path``.

    timm keeps the file's classifier only when the overlay's num_classes equals the model's, so it is set to
    num_classes when the file's head has that many classes (e.g. this toolkit's own model.safetensors) and left to
    the default otherwise (an ImageNet head is then dropped and re-initialised). ``custom_load=False``: the
    file is a state dict, not the original .npz release that some configs name.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model.pretrained_file {path!r} does not exist")
    overlay: Dict[str, Any] = dict(file=path, custom_load=False)
    if model_source(model_name).from_hub:
        overlay['source'] = None  # timm loads an hf-hub: / local-dir: source before a file: the file is what's asked
    if _head_classes(path, model_name) == num_classes:
        overlay['num_classes'] = num_classes
    return overlay


def convert_backbone(model: nn.Module, options: Any) -> None:
    """``convert_to_linear(model, **options)`` (model.convert), its errors as one-line ConfigErrors."""
    options = OmegaConf.to_container(options) if isinstance(options, DictConfig) else dict(options)
    try:
        convert_to_linear(model, **options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"model.convert={options}: {error}") from None


def create_model_from_config(model_cfg: DictConfig, num_classes: int, img_size: Union[int, Sequence[int]],
                             extra_kwargs: Optional[Dict[str, Any]] = None) -> nn.Module:
    """``timm.create_model(model.name, num_classes, img_size, drop_path_rate, **model.kwargs)``.

    img_size (``data.img_size``: a side, or [height, width]) is passed to models that take it (ViTs, as a side or
    an (H, W) tuple), so position embeddings are sized for it: an (H, W) model has an H/p x W/p patch grid.
    ``model.pretrained_file`` loads local weights (timm's pretrained=True with a file overlay, see
    ``pretrained_overlay``: the classifier is kept when its class count is this task's, else re-initialised).
    ``model.pretrained`` loads timm's weights of model.name (a pretrained tag, ``hf-hub:`` or ``local-dir:``; timm
    re-initialises the classifier when its class count differs); a weights source that cannot be had is a one-line
    ConfigError (``weights_errors``).
    """
    kwargs: Dict[str, Any] = OmegaConf.to_container(model_cfg.kwargs) if isinstance(model_cfg.kwargs, DictConfig) \
        else dict(model_cfg.kwargs)
    kwargs = {key: tuple(value) if isinstance(value, list) else value for key, value in kwargs.items()}
    kwargs = {**(extra_kwargs or {}), **kwargs}
    kwargs.setdefault('num_classes', num_classes)
    if model_cfg.drop_path_rate:
        kwargs.setdefault('drop_path_rate', model_cfg.drop_path_rate)
    if _accepts_img_size(model_cfg.name):
        height, width = image_size(img_size)
        kwargs.setdefault('img_size', height if height == width else (height, width))
    if model_cfg.pretrained_file:
        kwargs.update(pretrained=True, pretrained_cfg_overlay=pretrained_overlay(model_cfg.pretrained_file,
                                                                                 model_cfg.name, num_classes))
    if model_cfg.pretrained:
        kwargs['pretrained'] = True
        _log_pretrained_size(model_cfg.name, img_size)
    # weights from timm's sources (and an hf-hub: name's config, even without weights) may need the hub
    reads_hub = model_cfg.pretrained or model_source(model_cfg.name).from_hub
    with weights_errors(model_cfg.name) if reads_hub else contextlib.nullcontext():
        model = timm.create_model(model_cfg.name, **kwargs)
    if model_cfg.convert is not None:
        convert_backbone(model, model_cfg.convert)
    if model_cfg.floor:
        # the performance floor: same projections and MLPs, no token mixing (for train-speed ratios, not accuracy)
        make_floor(model)
    if model_cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model
