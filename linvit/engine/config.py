"""The training configuration: one typed schema (dataclasses), YAML files and dotted command-line overrides.

    cfg = load_config('configs/cls_demo.yaml', ['train.epochs=3', 'model.name=linvit_tiny_patch16_224'])

OmegaConf merges the layers in order: the schema's defaults, the YAML file's ``_base_`` files (paths relative to
the file, merged first to last), the file itself, then the overrides. Every key is checked against the schema
before merging, so an unknown or misspelt key is an error that names the key, where it came from, and the closest
valid key; a value of the wrong type is an error naming the key and the expected type. ``model.kwargs`` is the one
free-form mapping: it is passed to ``timm.create_model`` as keyword arguments. YAML is read with ``safe_load``.

``output_dir`` defaults to ``runs/<config file stem>`` (``configs/seg_demo.yaml`` -> ``runs/seg_demo``) when no
layer sets it. Saved weights are rebuilt as they were trained: ``load_config(file, overrides, base=saved,
keep_from_base=ARCHITECTURE_KEYS)`` takes the model, the task and the training size from the saved config unless
the overrides set them, so the file only says where data lives and how to evaluate.
"""
import dataclasses
import difflib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import timm
import torch
import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from timm.models._hub import load_model_config_from_path  # timm's reader of a local-dir: folder (1.0.31)

from ..data import DATASET_BUILDERS, image_size
from ..precision import PRECISIONS
from ..registry import Registry
from .run_dir import RunDir

__all__ = ['RunConfig', 'ModelConfig', 'DataConfig', 'AugConfig', 'SyntheticConfig', 'TrainConfig', 'CONFIG_SECTIONS',
           'config_section', 'config_schema', 'config_choice', 'ConfigError', 'ARCHITECTURE_KEYS', 'differing_keys',
           'check_runs_here', 'load_config', 'config_to_yaml', 'config_from_yaml', 'MISSING']

_logger = logging.getLogger(__name__)

BASE_KEY = '_base_'
#: the run directory of a config file that sets no output_dir: runs/<file stem>
DEFAULT_RUNS_DIR = 'runs'
#: what saved weights of every task were built with: loading them (--eval-only, --resume) takes these keys from the
#: saved config unless the command line sets them (the model, its task, and the size its position embedding was made
#: for); a task adds its own (``Task.architecture_keys``: segmentation's head; ``tasks.architecture_keys(name)``)
ARCHITECTURE_KEYS = ('task', 'model', 'data.img_size')


@dataclass
class ModelConfig:
    name: str = 'linvit_tiny_patch16_224'  # any timm classifier; linvit_* after `import linvit`
    kwargs: Dict[str, Any] = field(default_factory=dict)  # extra timm.create_model keywords (feature_map, depth, ...)
    pretrained_file: Optional[str] = None  # local weights (.pth / .safetensors), loaded with pretrained=True
    # timm's pretrained weights of model.name: a tag (vit_base_patch16_224.augreg2_in21k_ft_in1k), hf-hub:org/name
    # (downloaded once into the Hugging Face cache) or local-dir:/folder (config.json + model.safetensors)
    pretrained: bool = False
    # convert_to_linear keywords (feature_map, attn_family, local_mix, softmax_blocks, ...): a timm softmax ViT (vit_*,
    # deit*, DINOv2, DINOv3, EVA02, PE, ...) turned into linear attention after its weights load ({}: the defaults);
    # null keeps the model as built
    convert: Optional[Dict[str, Any]] = None
    drop_path_rate: float = 0.0
    grad_checkpointing: bool = False
    # dense tasks (segmentation): the backbone's weights stay as loaded, in eval mode; only the neck and head train
    # (with seg.head=linear: DINOv2's linear probe of a frozen backbone)
    freeze_backbone: bool = False
    floor: bool = False  # benchmarks: replace attention by the no-mixing floor (linvit.fast.make_floor)


@dataclass
class SyntheticConfig:
    train_size: int = 2048
    val_size: int = 512
    seed: int = 0


@dataclass
class AugConfig:
    random_resized_crop: bool = True
    scale: List[float] = field(default_factory=lambda: [0.5, 1.0])
    hflip: float = 0.5
    vflip: float = 0.0
    color_jitter: float = 0.0
    mixup: float = 0.0  # timm Mixup alpha; 0 = off
    cutmix: float = 0.0  # timm CutMix alpha; 0 = off
    label_smoothing: float = 0.0
    scale_range: List[float] = field(default_factory=lambda: [0.5, 2.0])  # seg, detection: resize factor, then crop


@dataclass
class DataConfig:
    name: str = 'synthetic'  # 'synthetic' (built in, no files) or 'folder' (ImageFolder tree / images+masks at root)
    root: Optional[str] = None
    # classification: the model's input, one side (224) or [height, width] (timm's order; linvit.data.image_size reads
    # either as (H, W)); seg: the training crop's side (validation is full size)
    img_size: Any = 224
    ignore_index: int = 255  # seg: mask value that no loss or metric counts
    num_classes: Optional[int] = None  # seg folders without classes.txt: the class count (ids 0..num_classes-1)
    # depth: stored value x depth_scale = metres (null: 0.001 for 16-bit PNG, i.e. millimetres; 1.0 for float files)
    depth_scale: Optional[float] = None
    max_depth: Optional[float] = None  # depth: pixels beyond it (metres) count in no loss or metric, as KITTI's cap
    batch_size: int = 32  # per process
    eval_batch_size: Optional[int] = None  # default: batch_size
    num_workers: int = 2
    max_bad_fraction: float = 0.01
    # folder data: decode every image once at data.img_size into a memory-mapped cache, augment batches on the
    # training device (linvit.data.cache, linvit.data.batch_augment); segmentation: the training split
    cache: bool = False
    cache_dir: Optional[str] = None  # where the caches live (default: <data.root>/.linvit_cache)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    aug: AugConfig = field(default_factory=AugConfig)


@dataclass
class TrainConfig:
    epochs: int = 10
    max_steps: Optional[int] = None  # stop (resumably) after this many optimizer steps in total
    opt: str = 'adamw'  # timm optimizer name
    lr: float = 1e-3
    weight_decay: float = 0.05
    layer_decay: Optional[float] = None  # layer-wise lr decay for fine-tuning (timm), e.g. 0.75
    sched: str = 'cosine'  # timm scheduler name
    warmup_epochs: float = 1.0
    warmup_lr: float = 1e-6
    min_lr: float = 1e-6
    precision: str = 'float32'  # autocast dtype: 'float32' (no autocast), 'bfloat16', 'float16' (CUDA, grad scaler)
    accum_steps: int = 1
    clip_grad: Optional[float] = None  # max gradient norm
    ema: bool = False
    ema_decay: float = 0.9998
    compile: bool = False  # run forward + loss through linvit.engine.compile_train_step
    eval_every: int = 1  # epochs
    log_every: int = 10  # optimizer steps
    checkpoint_every: int = 0  # optimizer steps between 'last' checkpoints (0: at the end of each epoch only)
    pictures: bool = True  # PNG of curves and of validation predictions at each evaluation


@dataclass
class RunConfig:
    """The keys every run has; each task that needs keys of its own adds its section (``config_section``:
    segmentation's ``seg``, linearization's ``linearize``), and ``config_schema`` joins them."""
    task: str = 'classification'  # a key of linvit.engine.TASKS: classification, segmentation, autoregressive
    output_dir: str = 'runs/default'  # with a config file: runs/<file stem> unless a layer sets it
    seed: int = 0
    device: str = 'auto'  # 'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1', ...
    threads: Optional[int] = None  # torch's CPU threads per process (None: torch's default, one per core)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


class ConfigError(ValueError):
    """A configuration file or override that does not fit the schema; the message names the key and the fix."""


#: config sections beyond RunConfig (the tasks', the engine's parallel): name -> dataclass, in registration order
CONFIG_SECTIONS: Registry[type] = Registry('config section')


def config_section(name: str, section: type) -> type:
    """Add a task's own section ``name`` (a dataclass of its keys and defaults) to every run config; returns the
    dataclass. The task module calls it when it is imported, so a task and its keys live in one file."""
    if not dataclasses.is_dataclass(section):
        raise TypeError(f"config section {name!r} must be a dataclass, got {section!r}")
    return CONFIG_SECTIONS.register(name, section)


def config_schema() -> DictConfig:
    """The schema every config is checked against: RunConfig's keys, then each task's section."""
    sections = [(name, section, field(default_factory=section)) for name, section in CONFIG_SECTIONS.items()]
    return OmegaConf.structured(dataclasses.make_dataclass('RunConfig', sections, bases=(RunConfig,)))


def _free_form(schema: DictConfig, key: str) -> bool:
    """True for mappings whose keys the schema does not fix (``model.kwargs``)."""
    node = OmegaConf.select(schema, key)
    return isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict


def _closest(key: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(candidates))}"


def _check_keys(values: Dict[str, Any], schema: DictConfig, source: str, prefix: str = '') -> None:
    """ConfigError for the first key of ``values`` (nested dict) that the schema lacks, with the closest key."""
    for key, value in values.items():
        full = f"{prefix}{key}"
        if not isinstance(key, str) or key not in schema:
            valid = [f"{prefix}{k}" for k in schema.keys()]
            raise ConfigError(f"{source}: unknown config key '{full}'{_closest(full, valid)}")
        child = schema[key]
        if isinstance(value, dict) and isinstance(child, DictConfig) and not _free_form(schema, key):
            _check_keys(value, child, source, prefix=f"{full}.")


def _read_yaml(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path, encoding='utf-8') as f:
        try:
            values = yaml.safe_load(f)
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level, got {type(values).__name__}")
    return values


def _file_layers(path: str, seen: Sequence[str] = ()) -> List[tuple]:
    """(source, values) of ``path``'s ``_base_`` files (recursively, first to last) and of ``path`` itself."""
    path = os.path.abspath(path)
    if path in seen:
        raise ConfigError(f"{path}: _base_ files include each other in a cycle: {' -> '.join(seen)} -> {path}")
    values = _read_yaml(path)
    bases = values.pop(BASE_KEY, [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: {BASE_KEY} must be a file name or a list of file names, got {bases!r}")
    layers = []
    for base in bases:
        layers += _file_layers(os.path.join(os.path.dirname(path), base), [*seen, path])
    layers.append((path, values))
    return layers


def _override_layer(overrides: Sequence[str]) -> tuple:
    for item in overrides:
        if '=' not in item or item.startswith('='):
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.epochs=3 data.root=/data/x)")
    try:
        return 'command line', OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as error:
        raise ConfigError(f"command-line overrides {list(overrides)}: {error}") from error


def _required_keys(values: Dict[str, Any], prefix: str = '') -> List[str]:
    """Keys a file marks as required with ``???`` (OmegaConf's MISSING, which a merge never writes over a default)."""
    keys = []
    for key, value in values.items():
        if isinstance(value, dict):
            keys += _required_keys(value, f"{prefix}{key}.")
        elif value == MISSING:
            keys.append(f"{prefix}{key}")
    return keys


def _merge(schema: DictConfig, source: str, values: Dict[str, Any]) -> DictConfig:
    _check_keys(values, schema, source)
    try:
        return OmegaConf.merge(schema, values)
    except OmegaConfBaseException as error:
        key = getattr(error, 'full_key', None) or '?'
        raise ConfigError(f"{source}: bad value for '{key}': {str(error).splitlines()[0]}") from error


#: keys whose string value must be one of a few names: a registry's or a fixed set; the tasks add the task registry
#: and their own sections' keys when they are imported (``config_choice``); classification and segmentation data
#: builders share their names
CHOICES: Dict[str, Union[Registry, Sequence[str]]] = {
    'data.name': DATASET_BUILDERS,
    'train.precision': tuple(PRECISIONS),
}


def config_choice(key: str, choices: Union[Registry, Sequence[str]]) -> None:
    """Make ``key``'s values the names of ``choices`` (a registry, or a fixed set): for keys of a task's own section
    and for registries that live above the config (the tasks)."""
    CHOICES[key] = choices


def _check_choices(cfg: DictConfig) -> None:
    for key, choices in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value in choices:
            continue
        if isinstance(choices, Registry):
            raise ConfigError(choices.unknown_message(value))
        raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")


def _similar_model_names(name: str) -> List[str]:
    """Up to three registered names close to ``name``: those it begins (linvit_tiny -> linvit_tiny_patch16_224)
    first, then the closest spellings."""
    names = timm.list_models()
    extending = [n for n in names if n.startswith(name)]
    return (extending + [n for n in difflib.get_close_matches(name, names, n=3, cutoff=0.6) if n not in extending])[:3]


def _check_model_name(cfg: DictConfig) -> None:
    """ConfigError unless model.name is in timm's registry (linvit_* are there once linvit is imported), with or
    without a pretrained tag, or names a source timm reads: ``local-dir:FOLDER`` (its config.json names a registered
    architecture) or ``hf-hub:org/name`` (checked when the model is built: that needs the hub or its cache)."""
    name = cfg.model.name
    try:
        source, model_id = timm.models.parse_model_name(name)
    except ValueError as error:
        raise ConfigError(f"model.name={name!r}: {error}") from None
    if source == 'local-dir':
        _check_local_dir(name, model_id)
    if source is not None or timm.is_model(timm.models.split_model_name_tag(name)[0]):
        return
    close = _similar_model_names(name)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ''
    raise ConfigError(f"model.name={name!r} is not a timm model; {hint}(timm.list_models('linvit_*') lists linvit's, "
                      f"timm.list_models() all; hf-hub:org/name and local-dir:FOLDER name saved timm models)")


def _check_local_dir(name: str, folder: str) -> None:
    """ConfigError unless ``folder`` holds timm's config.json naming a registered architecture (what
    ``timm.models.push_to_hf_hub`` uploads and ``save_for_hf`` writes)."""
    path = os.path.join(folder, 'config.json')
    if not os.path.isfile(path):
        raise ConfigError(f"model.name={name!r}: {path} does not exist; a local-dir: folder holds timm's config.json "
                          f"and weights (timm.models.save_for_hf(model, folder, safe_serialization=True) writes them)")
    try:
        _, architecture, _ = load_model_config_from_path(folder)
    except (ValueError, KeyError, TypeError) as error:  # a JSON error is a ValueError
        raise ConfigError(f"model.name={name!r}: {path} is not timm's model config ({error!r})") from None
    if not timm.is_model(architecture):
        raise ConfigError(f"model.name={name!r}: {path} names architecture {architecture!r}, which timm does not "
                          f"know (linvit_* are registered by `import linvit`)")


def _check_pretrained(cfg: DictConfig) -> None:
    """ConfigError for model.pretrained=true beside model.pretrained_file, and for a registry name that timm has no
    weights for (linvit publishes none: they come from a file or a local-dir: folder)."""
    model = cfg.model
    if not model.pretrained:
        return
    if model.pretrained_file:
        raise ConfigError(f"model.pretrained=true and model.pretrained_file={model.pretrained_file!r} both name "
                          f"weights: set one (pretrained: timm's weights of model.name; pretrained_file: a local file)")
    if timm.models.parse_model_name(model.name)[0] is not None:
        return  # hf-hub: / local-dir: name their weights
    try:
        pretrained_cfg = timm.models.get_pretrained_cfg(model.name)
    except RuntimeError as error:  # an unknown tag
        raise ConfigError(f"model.name={model.name!r}: {error} (timm.list_pretrained() lists the tags)") from None
    if not any(getattr(pretrained_cfg, key, None) for key in ('url', 'hf_hub_id', 'file', 'state_dict')):
        raise ConfigError(f"model.pretrained=true but no pretrained weights exist for model.name={model.name!r}: "
                          f"use model.pretrained_file=PATH (local weights), a local-dir:FOLDER or hf-hub:org/name "
                          f"model.name, or model.pretrained=false")


def check_runs_here(cfg: DictConfig) -> None:
    """ConfigError for a device word torch does not know or a device this machine lacks, and for train.precision=
    float16 off CUDA (its gradient scaler is CUDA's). Asked when a run starts, not when a config loads: a config
    saved on a GPU machine still loads on a laptop (to predict, export or look at)."""
    device = cfg.device
    if device != 'auto':
        try:
            resolved = torch.device(device)
        except RuntimeError:
            raise ConfigError(f"device={device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
        _check_available(resolved, device)
    kind = torch.device(device).type if device != 'auto' else ('cuda' if torch.cuda.is_available() else 'cpu')
    if cfg.train.precision == 'float16' and kind != 'cuda':
        raise ConfigError(f"train.precision=float16 needs CUDA (a gradient scaler guards float16 there); on {kind} "
                          f"use train.precision=bfloat16 or float32")


def _check_available(device: torch.device, word: str) -> None:
    if device.type == 'cpu':
        return
    if device.type != 'cuda':
        raise ConfigError(f"device={word!r}: train.py runs on cpu or cuda; use device=auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError(f"device={word!r} but this machine has no usable CUDA device "
                          f"(torch.cuda.is_available() is False); use device=cpu or device=auto")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device={word!r} but this machine has {torch.cuda.device_count()} CUDA device(s) "
                          f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")


#: model.kwargs that have their own config key (the pretrained weights: one key each for timm's and a local file's)
_KWARGS_WITH_KEYS = {'pretrained': "model.pretrained=true (timm's weights of model.name: a pretrained tag, "
                                   "hf-hub:org/name or local-dir:FOLDER) or model.pretrained_file=PATH (local weights: "
                                   ".pth / .safetensors)",
                     'pretrained_cfg_overlay': 'model.pretrained_file=PATH',
                     'num_classes': 'the data (its class folders, classes.txt or data.num_classes)',
                     'img_size': 'data.img_size', 'drop_path_rate': 'model.drop_path_rate'}


def _check_model_keys(cfg: DictConfig) -> None:
    """ConfigError for model.kwargs that another key owns, a model.pretrained_file that is a folder, and threads
    below 1."""
    for key in cfg.model.kwargs:
        if key in _KWARGS_WITH_KEYS:
            raise ConfigError(f"model.kwargs.{key} is not passed to timm by linvit: set {_KWARGS_WITH_KEYS[key]} "
                              f"instead")
    path = cfg.model.pretrained_file
    if path and os.path.isdir(path):
        inside = [RunDir(path).join(name) for name in RunDir.WEIGHT_FILES if os.path.isfile(RunDir(path).join(name))]
        hint = f"; e.g. model.pretrained_file={inside[0]}" if inside else ''
        raise ConfigError(f"model.pretrained_file={path!r} is a folder; it takes a weights file (.safetensors, .pth, "
                          f".pt){hint}")
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"threads={cfg.threads} must be >= 1 (or null: torch's default)")


def _check_img_size(cfg: DictConfig) -> None:
    """ConfigError unless data.img_size is one positive side or [height, width] of two (OmegaConf types it Any, so
    that both forms load from YAML and from a dotted override such as data.img_size=[128,192])."""
    try:
        image_size(cfg.data.img_size)
    except ValueError as error:
        raise ConfigError(f"bad value for 'data.img_size': {error}") from None


def _leaves(value: Any, prefix: str) -> Dict[str, Any]:
    """{'model.kwargs.depth': 2, ...}: the leaf values under ``prefix`` of a plain nested container."""
    if not isinstance(value, dict) or not value:
        return {prefix: value}
    leaves = {}
    for key, child in value.items():
        leaves.update(_leaves(child, f"{prefix}.{key}"))
    return leaves


def _plain(cfg: DictConfig, key: str) -> Any:
    """The value at a dotted key as plain python (dicts and lists instead of OmegaConf nodes)."""
    value = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def differing_keys(first: DictConfig, second: DictConfig, keys: Sequence[str]) -> List[Tuple[str, Any, Any]]:
    """(dotted key, value in first, value in second) for every leaf under ``keys`` where the two configs differ."""
    differ = []
    for key in keys:
        a, b = _leaves(_plain(first, key), key), _leaves(_plain(second, key), key)
        for leaf in sorted(set(a) | set(b)):
            if a.get(leaf) != b.get(leaf):
                differ.append((leaf, a.get(leaf), b.get(leaf)))
    return differ


def _keep_from_base(cfg: DictConfig, base: DictConfig, keys: Sequence[str], source: str) -> DictConfig:
    """cfg with the values of ``keys`` set back to base's (what the config files set for them is not used)."""
    ignored = differing_keys(cfg, base, keys)
    if ignored:
        _logger.info("%s: not using %s: the saved weights were built with %s (set these keys on the command line "
                     "to change them)", source, ', '.join(f"{k}={a!r}" for k, a, _ in ignored),
                     ', '.join(f"{k}={b!r}" for k, _, b in ignored))
    for key in keys:
        value = OmegaConf.select(base, key)
        # a typed node (model: ModelConfig) replaces the file's whole subtree, model.kwargs included
        OmegaConf.update(cfg, key, value.copy() if isinstance(value, (DictConfig, ListConfig)) else value, merge=False)
    return cfg


def _sets_output_dir(layers: Sequence[tuple]) -> bool:
    return any('output_dir' in values for _, values in layers)


def _default_output_dir(path: str) -> str:
    """runs/<file stem>: configs/seg_demo.yaml -> runs/seg_demo."""
    return os.path.join(DEFAULT_RUNS_DIR, os.path.splitext(os.path.basename(path))[0])


def _layers(base: Optional[Union[DictConfig, Dict[str, Any]]], path: Optional[str],
            overrides: Sequence[str]) -> Tuple[List[tuple], List[tuple], List[tuple]]:
    """(source, values) of the saved config, of the file chain and of the overrides."""
    saved = [('saved config', OmegaConf.to_container(OmegaConf.create(base)))] if base is not None else []
    files = _file_layers(path) if path is not None else []
    command_line = [_override_layer(overrides)] if overrides else []
    return saved, files, command_line


def _merged(cfg: DictConfig, layers: Sequence[tuple]) -> DictConfig:
    for source, values in layers:
        cfg = _merge(cfg, source, values)
    return cfg


def _check_required(cfg: DictConfig, layers: Sequence[tuple]) -> None:
    """ConfigError for keys without a value: MISSING in the schema, or marked ``???`` by a file."""
    required = {key for _, values in layers for key in _required_keys(values)}
    missing = sorted(set(OmegaConf.missing_keys(cfg))
                     | {key for key in required if OmegaConf.select(cfg, key, default=None) in (None, MISSING)})
    if missing:
        raise ConfigError(f"config keys {missing} have no value: set them in the YAML file or on the command line "
                          f"(e.g. {missing[0]}=...)")


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (),
                base: Optional[Union[DictConfig, Dict[str, Any]]] = None,
                keep_from_base: Sequence[str] = ()) -> DictConfig:
    """The resolved run configuration (a read-only DictConfig with RunConfig's keys).

    path: a YAML file (may name ``_base_`` files); None uses the schema's defaults. base: an already resolved
    config (e.g. the one saved in a checkpoint) to start from instead of the defaults. overrides: 'a.b=value' items.
    keep_from_base: keys (e.g. ARCHITECTURE_KEYS) whose value comes from ``base`` even where the file sets them;
    only the overrides change them. output_dir, when no layer sets it, is runs/<stem of path>.
    Raises ConfigError naming the file or override, the key, and the closest valid key or the expected type;
    also for a required value (``???`` in a YAML file) that nothing set, and for a model.name timm does not know.
    """
    saved, files, command_line = _layers(base, path, overrides)
    cfg = _merged(config_schema(), saved)
    saved_cfg = cfg.copy()
    cfg = _merged(cfg, files)
    if saved and files and keep_from_base:
        cfg = _keep_from_base(cfg, saved_cfg, keep_from_base, path)
    cfg = _merged(cfg, command_line)
    if path is not None and not _sets_output_dir([*saved, *files, *command_line]):
        cfg.output_dir = _default_output_dir(path)
    _check_required(cfg, [*files, *command_line])
    _check_choices(cfg)
    _check_model_name(cfg)
    _check_model_keys(cfg)
    _check_pretrained(cfg)
    _check_img_size(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def config_to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML text (what the run directory's config.yaml holds)."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def config_from_yaml(text: str) -> Dict[str, Any]:
    """A plain dict from config_to_yaml's text (for load_config(base=...))."""
    values = yaml.safe_load(text)
    return values if isinstance(values, dict) else {}
