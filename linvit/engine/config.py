"""The training configuration: one typed schema (dataclasses), YAML files and dotted command-line overrides.

    cfg = load_config('configs/cls_demo.yaml', ['train.epochs=3', 'model.name=linvit_tiny_patch16_224'])

OmegaConf merges the layers in order: the schema's defaults, the YAML file's ``_base_`` files (paths relative to
the file, merged first to last), the file itself, then the overrides. Every key is checked against the schema
before merging, so an unknown or misspelt key is an error that names the key, where it came from, and the closest
valid key; a value of the wrong type is an error naming the key and the expected type. ``model.kwargs`` is the one
free-form mapping: it is passed to ``timm.create_model`` as keyword arguments. YAML is read with ``safe_load``.
"""
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ['RunConfig', 'ModelConfig', 'DataConfig', 'AugConfig', 'SyntheticConfig', 'TrainConfig', 'SegConfig',
           'SegEvalConfig', 'ConfigError',
           'load_config', 'config_to_yaml', 'config_from_yaml', 'MISSING']

BASE_KEY = '_base_'


@dataclass
class ModelConfig:
    name: str = 'linvit_tiny_patch16_224'  # any timm classifier; linvit_* after `import linvit`
    kwargs: Dict[str, Any] = field(default_factory=dict)  # extra timm.create_model keywords (feature_map, depth, ...)
    pretrained_file: Optional[str] = None  # local weights (.pth / .safetensors), loaded with pretrained=True
    drop_path_rate: float = 0.0
    grad_checkpointing: bool = False
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
    scale_range: List[float] = field(default_factory=lambda: [0.5, 2.0])  # seg: random resize factor before the crop


@dataclass
class DataConfig:
    name: str = 'synthetic'  # 'synthetic' (built in, no files) or 'folder' (ImageFolder tree / images+masks at root)
    root: Optional[str] = None
    img_size: int = 224  # classification: the model's input; seg: the training crop (validation is full size)
    ignore_index: int = 255  # seg: mask value that no loss or metric counts
    num_classes: Optional[int] = None  # seg folders without classes.txt: the class count (ids 0..num_classes-1)
    batch_size: int = 32  # per process
    eval_batch_size: Optional[int] = None  # default: batch_size
    num_workers: int = 2
    max_bad_fraction: float = 0.01
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
    amp: str = 'none'  # 'none', 'bf16' (CPU or CUDA), 'fp16' (CUDA, with a gradient scaler)
    accum_steps: int = 1
    clip_grad: Optional[float] = None  # max gradient norm
    ema: bool = False
    ema_decay: float = 0.9998
    compile: bool = False  # run forward + loss through linvit.fast.compile_train_step
    eval_every: int = 1  # epochs
    log_every: int = 10  # optimizer steps
    checkpoint_every: int = 0  # optimizer steps between 'last' checkpoints (0: at the end of each epoch only)
    pictures: bool = True  # PNG of curves and of validation predictions at each evaluation


@dataclass
class SegEvalConfig:
    mode: str = 'whole'  # 'whole' (one forward per full image) or 'slide' (windows, logits averaged where they overlap)
    window: Optional[int] = None  # slide: window side in pixels (default: data.img_size)
    stride: Optional[int] = None  # slide: step between windows (default: 2/3 of the window)
    max_pixels: int = 4194304  # whole: refuse larger images (H * W) with an error instead of running out of memory


@dataclass
class SegConfig:
    """Segmentation model, loss and evaluation (used when task=seg)."""
    head: str = 'mlp'  # decoder head (linvit.models.segmentation.SEG_HEADS)
    neck_dim: int = 128  # channels of every feature-pyramid level
    head_dim: int = 128  # channels of the head's fused features
    feature_blocks: List[int] = field(default_factory=list)  # backbone blocks feeding the pyramid ([]: 4 evenly spaced)
    dice_weight: float = 0.0  # loss = cross-entropy + dice_weight * dice
    eval: SegEvalConfig = field(default_factory=SegEvalConfig)


@dataclass
class RunConfig:
    task: str = 'classification'
    output_dir: str = 'runs/default'
    seed: int = 0
    device: str = 'auto'  # 'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1', ...
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seg: SegConfig = field(default_factory=SegConfig)


class ConfigError(ValueError):
    """A configuration file or override that does not fit the schema; the message names the key and the fix."""


def _schema() -> DictConfig:
    return OmegaConf.structured(RunConfig)


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


#: keys whose string value must be one of a few names (the task names are checked where tasks are built)
CHOICES: Dict[str, Sequence[str]] = {
    'data.name': ('synthetic', 'folder'),
    'train.amp': ('none', 'bf16', 'fp16'),
    'seg.eval.mode': ('whole', 'slide'),
}


def _check_choices(cfg: DictConfig) -> None:
    for key, choices in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (),
                base: Optional[Union[DictConfig, Dict[str, Any]]] = None) -> DictConfig:
    """The resolved run configuration (a read-only DictConfig with RunConfig's keys).

    path: a YAML file (may name ``_base_`` files); None uses the schema's defaults. base: an already resolved
    config (e.g. the one saved in a checkpoint) to start from instead of the defaults. overrides: 'a.b=value' items.
    Raises ConfigError naming the file or override, the key, and the closest valid key or the expected type;
    also for a required value (``???`` in a YAML file) that nothing set.
    """
    cfg = _schema()
    if base is not None:
        cfg = _merge(cfg, 'saved config', OmegaConf.to_container(OmegaConf.create(base)))
    layers = _file_layers(path) if path is not None else []
    if overrides:
        layers.append(_override_layer(overrides))
    required = set()
    for source, values in layers:
        required.update(_required_keys(values))
        cfg = _merge(cfg, source, values)
    missing = sorted(set(OmegaConf.missing_keys(cfg))
                     | {key for key in required if OmegaConf.select(cfg, key, default=None) in (None, MISSING)})
    if missing:
        raise ConfigError(f"config keys {missing} have no value: set them in the YAML file or on the command line "
                          f"(e.g. {missing[0]}=...)")
    _check_choices(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def config_to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML text (what the run directory's config.yaml holds)."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def config_from_yaml(text: str) -> Dict[str, Any]:
    """A plain dict from config_to_yaml's text (for load_config(base=...))."""
    values = yaml.safe_load(text)
    return values if isinstance(values, dict) else {}
