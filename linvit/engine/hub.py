"""A trained run as a timm / Hugging Face model folder, its upload to the Hub, and whether the Hub answers at all.

    export = export_hub_folder('runs/cls_demo')          # -> runs/cls_demo/hub/: config.json, model.safetensors,
                                                         #    README.md; checked by loading it back
    model = timm.create_model('local-dir:runs/cls_demo/hub', pretrained=True)   # after `import linvit`
    push_hub_folder('runs/cls_demo/hub', 'me/linvit-demo', private=True)        # huggingface_hub upload

The folder is what timm's own ``save_for_hf`` / ``push_to_hf_hub`` write, and is written by ``save_for_hf``:
``config.json`` (``architecture``, ``num_classes``, ``num_features``, ``global_pool``, ``label_names``,
``model_args``: the keywords ``timm.create_model`` rebuilds the run's model with, ``pretrained_cfg``: the run's
normalisation and validation resize) and ``model.safetensors`` (the weights the run evaluated last, as
``linvit.engine.loading.load_trained`` rebuilds them). ``README.md`` is a model card: YAML front matter for the Hub
(``library_name: timm``, tags; the license is left for the owner of the weights to set), the run's final metrics
(``metrics.json``) and a summary of its training config, the whole resolved config included.

Which runs: those whose model is a timm model predicting one label per image (classification). A linearization's
model is a converted timm model (``vit_*`` with linear attention), which its own timm name does not rebuild; it is
exported as the equal ``linvit_*`` model where one reproduces it (same weights, same keys: ``model_args`` carry the
ViT's shape and the conversion's options), else as ``converted_to_linear`` (``linvit.models.convert``: ``model_args``
name the timm model and the conversion's options; DINOv3, EVA02, PE). A segmentation run's model (a
``SegmentationModel``: backbone, pyramid and head) is not a timm model and is refused in one line that points to
ONNX export. Every folder is loaded back through ``timm.create_model('local-dir:...')`` and compared with the run's
model on random images before it replaces anything: a folder that does not rebuild the run is never written.

Pretrained weights from the Hub (``model.pretrained=true``): huggingface_hub retries a request that cannot connect
with backoff, about a minute before it gives up. ``hub_unreachable_reason`` asks the Hub once, with a short timeout,
and ``cache_only_if_unreachable`` then loads from the Hugging Face cache alone (as HF_HUB_OFFLINE=1 does): weights in
the cache load at once, missing ones fail in seconds with the one-line error.
"""
import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import timm
import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from timm.layers import LayerScale
from timm.models import save_for_hf

from ..layers import LinearAttention, resolve_family
from ..models import LinearVisionTransformer
from .loading import TrainedModel, load_trained
from .run_dir import RunDir
from .tasks import TASKS

__all__ = ['HubExport', 'HubExportError', 'HubPushError', 'export_hub_folder', 'push_hub_folder', 'model_card',
           'HUB_FILES', 'LINEAR_HOST', 'hub_unreachable_reason', 'cache_only_if_unreachable', 'HUB_ANSWER_TIMEOUT_S']

_logger = logging.getLogger('linvit.train')

#: how long the Hub has to answer one request before pretrained weights are taken from the cache only
HUB_ANSWER_TIMEOUT_S = 3.0

#: the files a hub folder holds (what ``save_for_hf`` writes with safetensors, and the model card)
CONFIG_JSON, WEIGHTS, MODEL_CARD = 'config.json', 'model.safetensors', 'README.md'
HUB_FILES = (CONFIG_JSON, WEIGHTS, MODEL_CARD)
#: the linvit model that hosts a converted ViT whose own name has no ``linvit_*`` twin (model_args set its shape)
LINEAR_HOST = 'linvit_base_patch16_224'
#: the round trip's tolerance: the same weights through the same modules, so any real difference is far above it
_ROUND_TRIP_TOLERANCE = 1e-5
#: images of the round-trip check
_CHECK_BATCH = 2
#: how the validation images are resized (linvit.data's Resize(H, W): bilinear, aspect not kept, no crop), in timm's
#: pretrained_cfg words
_VALIDATION_RESIZE = dict(crop_pct=1.0, crop_mode='squash', interpolation='bilinear')
#: what the way to the Hub needs when it fails
_LOGIN_HINT = ("log in with `hf auth login` (`huggingface-cli login` in older huggingface_hub) or set HF_TOKEN to a "
               "token with write access (https://huggingface.co/settings/tokens)")


class HubExportError(ValueError):
    """A run that cannot be published as a timm model, or a folder that cannot take it; one line says why and what
    to do instead."""


class HubPushError(RuntimeError):
    """The upload to the Hub failed (no token, no network, no access); one line names the repository and the fix."""


@dataclass
class HubExport:
    """What ``export_hub_folder`` wrote and how it checked it."""
    folder: str
    architecture: str
    model_args: Dict[str, Any]
    class_names: List[str]
    converted_from: Optional[str]  # a linearization: the timm name of the converted ViT, else None
    max_abs_difference: float  # |folder's model - run's model| on the check images: 0.0 when bit-exact

    @property
    def model_name(self) -> str:
        """What ``timm.create_model`` takes to load the folder."""
        return f"local-dir:{self.folder}"


# ---------------------------------------------------------------------------------------------------- which model

def _refuse_other_tasks(trained: TrainedModel, run_dir: str) -> None:
    """HubExportError unless the run's model is a timm classifier (a timm model, one label per image)."""
    task = TASKS.get(trained.task)
    if getattr(trained.model, 'pretrained_cfg', None) is None:
        exports = task.logits_rank or task.predicts_values  # a dense model: the ONNX file takes any image size
        onnx = f", or export it to ONNX: python tools/export_onnx.py {run_dir}" if exports else ''
        raise HubExportError(
            f"{run_dir}: the model of this {trained.task} run ({type(trained.model).__name__}) is not a timm model, "
            f"so timm.create_model cannot rebuild it from a hub folder; share the run directory{onnx}")
    if task.logits_rank != 2:
        what = task.not_predicted or f"its logits have {task.logits_rank} dimensions"
        raise HubExportError(f"{run_dir}: the model of this {trained.task} run is not an image classifier ({what}); "
                             f"only runs that predict one label per image export as timm models")


def _is_converted(model: nn.Module) -> bool:
    """A timm softmax model given linear attention by ``convert_to_linear`` (a linearization's student): its timm
    name builds softmax attention, so the name alone does not rebuild it."""
    linear = any(isinstance(module, LinearAttention) for module in model.modules())
    return linear and not isinstance(model, LinearVisionTransformer)


def _patch_size(model: nn.Module) -> Any:
    height, width = model.patch_embed.patch_size
    return height if height == width else [height, width]


#: the VisionTransformer keywords that fix a ViT's tensors, read off a built model (what its timm entrypoint chose)
_VIT_SHAPE: Dict[str, Callable[[nn.Module], Any]] = {
    'patch_size': _patch_size,
    'embed_dim': lambda m: m.embed_dim,
    'depth': lambda m: len(m.blocks),
    'num_heads': lambda m: m.blocks[0].attn.num_heads,
    'mlp_ratio': lambda m: m.blocks[0].mlp.fc1.out_features / m.embed_dim,
    'qkv_bias': lambda m: m.blocks[0].attn.qkv.bias is not None,
    'qk_norm': lambda m: not isinstance(m.blocks[0].attn.q_norm, nn.Identity),
    'init_values': lambda m: 1e-5 if isinstance(m.blocks[0].ls1, LayerScale) else None,  # the weights set it
    'class_token': lambda m: m.cls_token is not None,
    'reg_tokens': lambda m: m.num_reg_tokens,
    'no_embed_class': lambda m: m.no_embed_class,
    'pre_norm': lambda m: not isinstance(m.norm_pre, nn.Identity),
    'fc_norm': lambda m: not isinstance(m.fc_norm, nn.Identity),
    'global_pool': lambda m: m.global_pool,
}


def _vit_shape(model: nn.Module) -> Optional[Dict[str, Any]]:
    """The VisionTransformer keywords of ``model``, or None for a model that is no timm VisionTransformer."""
    try:
        shape = {key: read(model) for key, read in _VIT_SHAPE.items()}
    except (AttributeError, IndexError, TypeError):
        return None
    return {key: value for key, value in shape.items() if value is not None}


def _host_name(model_name: str) -> str:
    """The linvit_* name of a converted ``vit_*`` (vit_tiny_patch16_224 -> linvit_tiny_patch16_224), else
    LINEAR_HOST; either way model_args set every shape keyword."""
    twin = f"lin{model_name.split('.')[0]}"
    return twin if model_name.startswith('vit_') and timm.is_model(twin) else LINEAR_HOST


def _conversion_options(cfg: DictConfig) -> Dict[str, Any]:
    """The run's ``convert_to_linear`` keywords, which are LinearVisionTransformer's too: a linearization's
    linearize.convert, another run's model.convert (local_mix off unless it says so: the conversion's default, not
    linvit_*'s)."""
    section = cfg.get('linearize') if cfg.get('task') == 'linearize' else cfg.get('model')
    convert = section.get('convert') if section is not None else None
    options = {'local_mix': False, **dict(_plain(convert) or {})}
    # the map by name: a linvit_* twin left without one would take the models' default, not the conversion's
    feature_map = resolve_family(options.get('attn_family'), options.get('feature_map'))[1]
    return options if feature_map is None else {**options, 'feature_map': feature_map}


def _rebuilt(name: str, args: Dict[str, Any], model: nn.Module) -> Optional[nn.Module]:
    """``timm.create_model(name, **args)`` with ``model``'s weights loaded strictly, or None when its tensors
    differ (the keywords do not describe ``model``)."""
    rebuilt = timm.create_model(name, **args)
    try:
        rebuilt.load_state_dict(model.state_dict(), strict=True)
    except RuntimeError:
        return None
    return rebuilt.eval()


def _linvit_twin(trained: TrainedModel) -> Optional[Tuple[nn.Module, Dict[str, Any]]]:
    """The linvit_* model equal to a converted ViT, created by timm from model_args, with its model_args; None for
    a conversion linvit_* cannot express (another architecture, or tensors that differ)."""
    model = trained.model
    shape = _vit_shape(model)
    if shape is None:
        return None
    args = {**getattr(model, '_model_args', {}), **shape, **_conversion_options(trained.cfg)}
    twin = _rebuilt(_host_name(trained.cfg.model.name), args, model)
    return (twin, args) if twin is not None else None


def _converted_to_linear(trained: TrainedModel, run_dir: str) -> Tuple[nn.Module, Dict[str, Any]]:
    """The run's model as ``converted_to_linear`` (its timm model with the run's keywords, converted with the run's
    options), with its model_args. HubExportError when that does not rebuild its tensors."""
    args = {**_config_model_args(trained), 'img_size': list(trained.img_size), 'base': trained.cfg.model.name,
            'convert': _conversion_options(trained.cfg)}  # img_size: its pretrained config does not fix the size
    rebuilt = _rebuilt('converted_to_linear', args, trained.model)
    if rebuilt is None:
        raise HubExportError(f"{run_dir}: timm.create_model('converted_to_linear', base={trained.cfg.model.name!r}, "
                             f"...) does not rebuild the tensors of this run's converted model; share the run "
                             f"directory, or export it to ONNX: python tools/export_onnx.py {run_dir}")
    return rebuilt, args


def _config_model_args(trained: TrainedModel) -> Dict[str, Any]:
    """model.kwargs of the run's config and the class count (timm adds img_size, in_chans and global_pool from the
    model itself); a linvit_* model's feature map by name, so that the folder keeps meaning the same model when the
    models' default map changes."""
    args = {**_plain(trained.cfg.model.kwargs), 'num_classes': len(trained.class_names)}
    feature_map = trained.model.feature_map if isinstance(trained.model, LinearVisionTransformer) else None
    return args if feature_map is None else {'feature_map': feature_map, **args}


def _timm_model(trained: TrainedModel, run_dir: str) -> Tuple[nn.Module, Dict[str, Any], Optional[str]]:
    """(the model to save, its model_args, the converted ViT's name or None)."""
    if _is_converted(trained.model):
        twin, args = _linvit_twin(trained) or _converted_to_linear(trained, run_dir)
        return twin, args, trained.cfg.model.name
    return trained.model, _config_model_args(trained), None


# ---------------------------------------------------------------------------------------------------- the folder

def _data_config(trained: TrainedModel) -> Dict[str, Any]:
    """The preprocessing the run validated with: its size, normalisation and resize."""
    height, width = trained.img_size
    return dict(input_size=(3, height, width), mean=tuple(trained.mean), std=tuple(trained.std),
                **_VALIDATION_RESIZE)


def _check_images(img_size: Tuple[int, int]) -> torch.Tensor:
    """Seeded random images (the global RNG is left alone)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(_CHECK_BATCH, 3, *img_size, generator=generator)


@torch.no_grad()
def _round_trip_difference(folder: str, reference: nn.Module, img_size: Tuple[int, int], run_dir: str) -> float:
    """max |folder's model - reference| on the check images, the folder loaded as users will; HubExportError above
    the tolerance."""
    loaded = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    images = _check_images(img_size)
    expected, got = reference.eval()(images), loaded(images)
    difference = (got - expected).abs().max().item()
    if difference > _ROUND_TRIP_TOLERANCE * max(expected.abs().max().item(), 1.0):
        raise HubExportError(f"{run_dir}: the exported folder does not rebuild the run's model (max abs difference "
                             f"{difference:.3g} on random images), so nothing was written; share the run directory, "
                             f"or export it to ONNX: python tools/export_onnx.py {run_dir}")
    return difference


def _check_out_dir(out_dir: str) -> None:
    """An export replaces only an earlier export: the folder must be new, empty or hold HUB_FILES alone."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise HubExportError(f"{out_dir} is a file: the export writes a folder")
    others = sorted(set(os.listdir(out_dir)) - set(HUB_FILES)) if os.path.isdir(out_dir) else []
    if others:
        raise HubExportError(f"{out_dir} holds files a hub export does not write ({', '.join(others[:3])}): export "
                             f"into an empty or new folder (--out)")


def _move_into(staging: str, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for name in HUB_FILES:
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))


def export_hub_folder(run_dir: str, out_dir: Optional[str] = None, repo_id: Optional[str] = None) -> HubExport:
    """Write the run ``run_dir`` as a timm / Hugging Face folder ``out_dir`` (default: ``hub/`` in the run
    directory, ``RunDir.hub``) and return what was written.

    repo_id: the Hub repository the folder is meant for (``user/name``): the model card's example loads it from
        there (``hf-hub:user/name``) instead of from the folder.

    The folder is written beside ``out_dir`` first, loaded back through ``timm.create_model('local-dir:...')``
    and compared with the run's model; only then does it replace ``out_dir``'s files. Raises HubExportError (a run
    that is no timm classifier, a folder holding other files) and load_trained's errors (FileNotFoundError for what
    is not a run directory).
    """
    if os.path.isfile(run_dir):
        raise HubExportError(f"{run_dir} is a file: export the run directory that holds it "
                             f"({os.path.dirname(os.path.abspath(run_dir))})")
    out_dir = out_dir or RunDir(run_dir).hub
    _check_out_dir(out_dir)
    trained = load_trained(run_dir)
    _refuse_other_tasks(trained, run_dir)
    model, model_args, converted_from = _timm_model(trained, run_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix='.hub-', dir=parent)
    try:
        # license: the weights' owner chooses it (the architecture's default cfg names the code's license)
        save_for_hf(model, staging, model_config={'label_names': list(trained.class_names),
                                                  'pretrained_cfg': {'license': None}},
                    model_args=model_args, data_config=_data_config(trained), safe_serialization=True)
        difference = _round_trip_difference(staging, trained.model, trained.img_size, run_dir)
        saved = _saved_config(staging)
        export = HubExport(folder=out_dir, architecture=saved['architecture'], model_args=saved.get('model_args', {}),
                           class_names=list(trained.class_names), converted_from=converted_from,
                           max_abs_difference=difference)
        with open(os.path.join(staging, MODEL_CARD), 'w', encoding='utf-8') as f:
            f.write(model_card(export, trained, run_dir, repo_id))
        _move_into(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return export


def _saved_config(folder: str) -> Dict[str, Any]:
    with open(os.path.join(folder, CONFIG_JSON), encoding='utf-8') as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------- the card

#: the config keys the card's training table shows (the whole config follows it)
CARD_KEYS = ('task', 'model.name', 'model.kwargs', 'data.name', 'data.img_size', 'data.batch_size', 'train.epochs',
             'train.opt', 'train.lr', 'train.weight_decay', 'train.sched', 'train.precision', 'train.ema')
#: the model card's YAML front matter (the Hub's metadata); the license is the weights' owner's to choose
FRONT_MATTER = """---
library_name: timm
pipeline_tag: image-classification
tags:
- image-classification
- timm
- linvit
- linear-attention
# license: choose the license of these weights (e.g. apache-2.0, cc-by-4.0, other) and uncomment this line
---"""


def _read_text(path: str) -> str:
    with open(path, encoding='utf-8') as f:
        return f.read()


def _read_metrics(run_dir: str) -> Dict[str, Any]:
    path = RunDir(run_dir).metrics_json
    return json.loads(_read_text(path)) if os.path.isfile(path) else {}


def _flat(values: Dict[str, Any], prefix: str = '') -> List[Tuple[str, Any]]:
    """Nested metrics (a per-class table, ...) as dotted keys."""
    rows = []
    for key, value in values.items():
        if isinstance(value, dict):
            rows.extend(_flat(value, f"{prefix}{key}."))
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def _format_metric(value: Any) -> str:
    """How the card writes a metric: floats to 4 decimals, the rest as they are."""
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _plain(value: Any) -> Any:
    """A config node as plain Python (lists and dicts), anything else as it is."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _config_value(value: Any) -> str:
    """A config value as the card shows it: strings as they are, the rest as JSON (lists, dicts, true, null)."""
    return value if isinstance(value, str) else json.dumps(_plain(value))


def _table(rows: List[Tuple[str, Any]], header: Tuple[str, str]) -> str:
    return '\n'.join([f"| {header[0]} | {header[1]} |", "|---|---|", *(f"| {key} | {value} |" for key, value in rows)])


def _intro(export: HubExport, trained: TrainedModel) -> str:
    height, width = trained.img_size
    text = (f"A `{export.architecture}` image classifier ({len(export.class_names)} classes, {height}x{width} px "
            f"input) trained with linvit (linear-attention Vision Transformers on timm).")
    if export.converted_from:
        text += (f" It was linearized from the softmax ViT `{export.converted_from}` (task: linearize) and is saved "
                 f"as the equal `{export.architecture}` (same weights and keys).")
    return text


def _usage(source: str, class_names: List[str]) -> str:
    return '\n'.join([
        '## Use', '',
        '```python',
        'import timm, torch',
        'import linvit  # registers the linvit_* models with timm', '',
        f"model = timm.create_model({source!r}, pretrained=True).eval()",
        'transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))',
        'labels = model.pretrained_cfg["label_names"]',
        '```', '',
        f"Classes: {', '.join(class_names)}.",
    ])


def _evaluation(run_dir: str) -> str:
    rows = [(key, _format_metric(value)) for key, value in _flat(_read_metrics(run_dir))]
    if not rows:
        return f"## Evaluation\n\nThe run has no `{RunDir.METRICS_JSON}`."
    return '\n'.join(['## Evaluation', '',
                      f"The run's final evaluation on its validation set (`{RunDir.METRICS_JSON}`):", '',
                      _table(rows, ('metric', 'value'))])


def _training(trained: TrainedModel, run_dir: str) -> str:
    rows = [(key, f"`{_config_value(OmegaConf.select(trained.cfg, key))}`") for key in CARD_KEYS]
    return '\n'.join([
        '## Training', '',
        _table(rows, ('config key', 'value')), '',
        'To train it again, save the resolved config below as `config.yaml` and run `python train.py --config '
        'config.yaml output_dir=runs/again` in a linvit checkout (data.root, if any, must point to the data).', '',
        '<details><summary>The resolved config (config.yaml of the run)</summary>', '',
        '```yaml', _read_text(RunDir(run_dir).config).rstrip(), '```', '',
        '</details>',
    ])


def model_card(export: HubExport, trained: TrainedModel, run_dir: str, repo_id: Optional[str] = None) -> str:
    """README.md of a hub folder: front matter for the Hub, how to load it (from ``repo_id`` on the Hub when given,
    else from the folder), the run's metrics and its training config."""
    source = f"hf-hub:{repo_id}" if repo_id else export.model_name
    name = repo_id.split('/')[-1] if repo_id else os.path.basename(os.path.abspath(run_dir))
    sections = [FRONT_MATTER, f"# Model card for {name}", _intro(export, trained), _usage(source, export.class_names),
                _evaluation(run_dir), _training(trained, run_dir)]
    return '\n\n'.join(sections) + '\n'


# ---------------------------------------------------------------------------------------------------- the Hub

def push_hub_folder(folder: str, repo_id: str, private: bool = False, token: Optional[str] = None,
                    commit_message: str = 'Add linvit model') -> str:
    """Upload the hub folder ``folder`` to the model repository ``repo_id`` (created when missing, ``private`` then)
    with huggingface_hub; returns the URL of the commit. HubPushError, in one line naming the repository, without a
    token or when the Hub cannot be reached."""
    from huggingface_hub import HfApi, get_token  # only the upload needs it (timm already depends on it)

    missing = [name for name in HUB_FILES if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise HubPushError(f"{folder} is not a hub folder (no {', '.join(missing)}): write it with "
                           f"python tools/export_hub.py RUN --out {folder}")
    token = token or get_token()
    if not token:
        raise HubPushError(f"pushing to {repo_id} needs a Hugging Face token: {_LOGIN_HINT}; the folder {folder} is "
                           f"written and can be pushed later")
    api = HfApi(token=token, library_name='timm', library_version=timm.__version__)
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(repo_id=repo.repo_id, folder_path=folder, commit_message=commit_message)
    except (OSError, ValueError) as error:  # huggingface_hub's HTTP, offline and token errors are OSErrors
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise HubPushError(f"could not push {folder} to {repo_id} ({reason}): {_LOGIN_HINT}, check the network and "
                           f"that you may write to {repo_id}, then run again") from error
    return str(getattr(commit, 'commit_url', commit))


# ---------------------------------------------------------------------------------------------------- reachability

def hub_unreachable_reason(timeout_s: float = HUB_ANSWER_TIMEOUT_S) -> Optional[str]:
    """Why the Hugging Face Hub (huggingface_hub's endpoint, HF_ENDPOINT) cannot be reached now, or None when it
    answered one request (any HTTP status) within ``timeout_s`` or HF_HUB_OFFLINE is set (nothing is asked then).
    The request goes through huggingface_hub's own session (its proxies and headers), in a thread bounded by the
    timeout, so that a name lookup that hangs bounds it too."""
    from huggingface_hub import constants, get_session

    if constants.is_offline_mode():
        return None
    outcome: Dict[str, Any] = {}

    def ask() -> None:
        try:
            get_session().head(constants.ENDPOINT, timeout=timeout_s)
            outcome['answered'] = True
        except Exception as error:  # noqa: BLE001 (httpx, ssl and socket errors: any of them means no answer)
            outcome['error'] = error

    thread = threading.Thread(target=ask, name='linvit-hub-check', daemon=True)
    thread.start()
    thread.join(timeout_s + 0.5)
    if outcome.get('answered'):
        return None
    error = outcome.get('error')
    detail = f" ({type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''})" if error else ''
    return f"the Hugging Face Hub {constants.ENDPOINT} did not answer within {timeout_s:g} s{detail}"


@contextlib.contextmanager
def cache_only_if_unreachable(what: str) -> Iterator[Optional[str]]:
    """While the block runs, huggingface_hub reads from its cache only (HF_HUB_OFFLINE) if the Hub does not answer
    (``hub_unreachable_reason``); yields that reason (None: the Hub answered, or offline mode was on already)."""
    from huggingface_hub import constants

    reason = hub_unreachable_reason()
    if reason is None:
        yield None
        return
    _logger.warning("%s: %s come from the Hugging Face cache only (as with HF_HUB_OFFLINE=1)", reason, what)
    previous = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield reason
    finally:
        constants.HF_HUB_OFFLINE = previous
