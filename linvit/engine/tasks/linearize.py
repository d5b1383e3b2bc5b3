"""Linearization (``task: linearize``): a trained softmax ViT (the teacher) becomes linear attention (the student) in
two stages, each a whole run in a folder of the run directory, and a report of how much of the teacher's accuracy
comes back.

    cfg = load_config('configs/linearize_cls_fmnist.yaml', ['linearize.teacher=runs/teacher', 'data.root=...'])
    report = train(cfg)                  # linvit.engine.train: both stages, then the report (metrics.json)
    report = train(cfg, resume=True)     # continue an interrupted linearization in cfg.output_dir (either stage)

The task trains in stages (``staged_run``: the engine runs each stage through its loop, keeps what it measured in
``linearize.json`` and asks the task for the report); a stage's run is this task with ``linearize.stage``:

- ``attention`` (stage 1, attention transfer, ``stage1/``): the student is the teacher converted with
  ``linearize.convert``. Only the tensors the conversion added (a learnable feature map, local mixing, a family's
  gates) train, plus the q / k projections with ``linearize.train_qk``. The frozen teacher runs once per batch (in
  the batch mixer, outside the trained graph); forward hooks keep each attention layer's input and output, and every
  student layer is trained to map the teacher's input to the teacher's output: the layers learn independently, on the
  hidden states the teacher itself produces (``distillation.AttentionTransfer``). Optionally
  (``linearize.attention_weights_loss``) the student's attention weights on a few queries are also pulled towards
  softmax's. Trained with linearize.attention_* (no weight decay, no warmup, no EMA, eager).
- ``finetune`` (stage 2, ``stage2/``): every tensor of the student trains on the task's own loss plus distillation
  from the teacher (logits at temperature T; per-pixel class distributions for segmentation), with the whole engine
  (AMP, EMA, resume, torchrun, compiled step, pictures). The teacher's outputs are computed in the batch mixer too.
  ``linearize.feature_weight`` adds the alignment of the last block's output tokens with the teacher's (patch
  features, what a dense head reads: ``distillation.FeatureAlignment``).

Evaluation and pictures are the underlying task's (``linearize.task``, classification or segmentation), on the
student. The teacher sees the student's images at its own training size when its model has a fixed size
(``teacher_input`` in the report), at the student's size when it takes any size (segmentation backbones).

The run directory holds ``config.yaml`` (the config with the teacher's architecture filled in), ``stage1/`` and
``stage2/`` (each a complete run directory), ``model.safetensors`` (the final student, the converted timm model's
keys), ``metrics.json`` (the report) and ``metrics.csv`` (the report as rows: split = teacher / converted / stage1 /
final, then the speed rows). The report: ``teacher_<metric>`` (the teacher on this validation set, fed as during
training), ``converted_<metric>`` (the student right after conversion, before any training), ``stage1_<metric>``,
the final metrics (``<metric>`` ...), each stage's steps and wall time, the teacher's own training steps when its
run directory has them, ``teacher_input``, and img/s of student and teacher at the training size and at twice the
side (4x the tokens): inference, float32, eval mode, batch ``SPEED_BATCH``, the median of interleaved rounds.
"""
import csv
import functools
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.utils.data import Dataset

from ...data import image_size
from ...layers import LinearAttention, linear_only_parameter_names
from ...models.convert import convert_to_linear
from ...precision import PRECISIONS
from ...timing import time_interleaved
from ..checkpoint import atomic_write, load_checkpoint
from ..config import CHOICES, ConfigError, config_choice, config_from_yaml, config_schema, config_section, load_config
from ..distributed import setup_distributed
from ..metrics import Meter
from ..run_dir import RunDir
from ..run_files import find_run_files, load_weights, read_weights, saved_config_text
from .base import TASKS, Stage, StagedRun, Task, model_source, register_task
from .distillation import (
    AttentionTransfer,
    DistillationLoss,
    FeatureAlignment,
    HiddenStates,
    ResizedInput,
    attention_transfer_loss,
    last_block,
    query_positions,
    rotary_embeddings,
    row_mask_hook,
    softmax_attention_weights,
    student_of,
    transfer_pairs,
    vit_of,
)
from .segmentation import SegmentationTask

__all__ = ['LinearizeTask', 'LinearizeConfig', 'STAGE_DIRS', 'NO_TEACHER', 'teacher_weights_path', 'resolve_teacher',
           'pretrained_teacher', 'teacher_name', 'teacher_training_steps', 'SPEED_BATCH']

_logger = logging.getLogger('linvit.linearize')


@dataclass
class LinearizeConfig:
    """The ``linearize`` section of every run config. ``task: linearize``: turn a trained softmax ViT (the teacher)
    into linear attention (the student) in two stages (trained by ``linvit.engine.train``). model.* and seg.*
    describe the teacher's architecture; a teacher run directory supplies them (and its task and training size)."""
    # a run directory of this toolkit, or a weights file (.pth / .pt / .safetensors); null with model.pretrained=true:
    # model.name with its pretrained weights (a timm tag, hf-hub: or local-dir:, whose head has the data's classes)
    teacher: Optional[str] = None
    task: str = 'classification'  # the teacher's task (a weights file); a run directory says its own
    teacher_img_size: Optional[int] = None  # a weights file's training size (default data.img_size)
    convert: Dict[str, Any] = field(default_factory=lambda: {'feature_map': 'hedgehog'})  # convert_to_linear keywords
    # stage 1, attention transfer: attention-side tensors learn to imitate each frozen teacher layer
    attention_epochs: int = 1  # 0 skips stage 1
    attention_max_steps: Optional[int] = None  # stop stage 1 after this many steps
    attention_lr: float = 1.0e-3
    train_qk: bool = False  # also train the q and k projections in stage 1
    attention_weights_loss: float = 0.0  # weight of the attention-distribution term (cross-entropy on a few queries)
    attention_queries: int = 16  # queries (evenly spaced tokens) that term compares per layer
    # stage 2, fine-tune: every tensor, the task loss plus distillation from the teacher (train.* as any run)
    distill_weight: float = 0.5  # loss = (1 - w) task loss + w T^2 KL(teacher / T || student / T)
    temperature: float = 2.0
    # + feature_weight x the relative squared error of the last block's output tokens to the teacher's (patch
    # features: what a dense head reads; the teacher must see the student's images at their size)
    feature_weight: float = 0.0
    speed: bool = True  # measure student and teacher img/s at the training size and at 4x the tokens for the report
    # start the student from these weights (a linearized run's model.safetensors) instead of the teacher's: continue
    # a linearization at another data.img_size (with attention_epochs=0); the engine sets it for stage 2
    student_weights: Optional[str] = None
    # which stage a run is: 'all' (both, and the report), or the engine's run of one stage ('attention', 'finetune')
    stage: str = 'all'


config_section('linearize', LinearizeConfig)
config_choice('linearize.task', ('classification', 'segmentation'))
config_choice('linearize.stage', ('all', 'attention', 'finetune'))

#: the error of a linearization without a teacher
NO_TEACHER = ("task=linearize needs linearize.teacher: a run directory of train.py or a weights file (.pth / .pt / "
              ".safetensors) of a softmax timm ViT; or model.pretrained=true for model.name with its pretrained "
              "weights (a timm tag, hf-hub:org/name or local-dir:FOLDER)")
#: the stages' run directories inside the linearization's own
STAGE_DIRS = dict(zip(('attention', 'finetune'), RunDir.STAGES))
#: images per call when the report measures speed
SPEED_BATCH = 4
#: untimed and timed interleaved rounds of that measurement: 5 timed rounds at batch 4 left the reported img/s
#: moving by up to 2x between runs on a 2-core machine; 15 keep each model's median within about 15%
SPEED_WARMUP, SPEED_REPEATS = 3, 15


# ---------------------------------------------------------------------------------------------------- the teacher

def pretrained_teacher(cfg: DictConfig) -> bool:
    """Whether the teacher is model.name with its pretrained weights (linearize.teacher null, model.pretrained=true):
    timm loads them, from its registry's source, the Hugging Face hub (or cache) or a local-dir: folder."""
    return not cfg.linearize.teacher and bool(cfg.model.pretrained)


def teacher_name(cfg: DictConfig) -> str:
    """The teacher as messages name it: linearize.teacher's path, or model.name with its pretrained weights."""
    return cfg.linearize.teacher or f"model.name={cfg.model.name} (model.pretrained=true)"


def teacher_weights_path(teacher: str) -> str:
    """The weights file of ``linearize.teacher``: a run directory's evaluated weights (model.safetensors, best.pt or
    last.pt), or the file itself. FileNotFoundError when there is none."""
    if os.path.isdir(teacher):
        return find_run_files(teacher).weights_path
    if not os.path.isfile(teacher):
        raise FileNotFoundError(f"linearize.teacher {teacher!r} does not exist (expected a run directory of train.py "
                                f"or a weights file .pth / .pt / .safetensors)")
    return teacher


def _teacher_config_text(teacher: str) -> Optional[str]:
    """The config a teacher was trained with (YAML), when it says: a run directory's, a train.py checkpoint's, or
    the config.yaml beside a .safetensors file; None for a bare weights file."""
    teacher_weights_path(teacher)  # FileNotFoundError for a path that holds no weights
    if os.path.isdir(teacher):
        return find_run_files(teacher).config_text
    if teacher.endswith('.safetensors'):
        return saved_config_text(teacher)
    state = load_checkpoint(teacher)  # a train.py checkpoint holds its config; another weights file, none
    return state.get('config') if isinstance(state.get('config'), str) else None


def teacher_training_steps(teacher: Optional[str]) -> Optional[int]:
    """The optimizer steps the teacher was trained for, when its run directory records them (the last train row of
    metrics.csv); None otherwise (a weights file, or pretrained weights: teacher None)."""
    if not teacher:
        return None
    path = RunDir(teacher).metrics_csv
    if not (os.path.isdir(teacher) and os.path.isfile(path)):
        return None
    with open(path, newline='') as f:
        steps = [int(row['step']) for row in csv.DictReader(f) if row.get('split') == 'train' and row.get('step')]
    return max(steps) if steps else None


def resolve_teacher(cfg: DictConfig) -> DictConfig:
    """``cfg`` with the teacher's architecture filled in from its saved config, when it has one: model.* (without
    pretrained_file), its task's architecture keys (segmentation's head), linearize.task and
    linearize.teacher_img_size (its data.img_size, unless set). A bare weights file keeps the config's model.* and
    linearize.task. A pretrained teacher (``pretrained_teacher``) keeps the config as it is: model.* is its
    architecture."""
    lin = cfg.linearize
    if pretrained_teacher(cfg):
        _check_pretrained_teacher(cfg)
        return cfg
    if not lin.teacher:
        raise ConfigError(NO_TEACHER)
    text = _teacher_config_text(lin.teacher)
    if text is None:
        return cfg
    saved = load_config(None, [], base=config_from_yaml(text))
    if saved.task not in CHOICES['linearize.task']:
        raise ConfigError(f"linearize.teacher {lin.teacher} was trained with task={saved.task!r}; linearization "
                          f"takes a {' or '.join(CHOICES['linearize.task'])} teacher")
    height, width = image_size(saved.data.img_size)
    if height != width:  # linearize.teacher_img_size, the teacher's input and the speed figures are one side
        raise ConfigError(f"linearize.teacher {lin.teacher} was trained at data.img_size=[{height}, {width}]; "
                          f"task=linearize takes teachers trained at one side (square images): train one at "
                          f"data.img_size={max(height, width)}")
    values = OmegaConf.to_container(cfg)
    # the teacher's model replaces the config's whole model section (its kwargs are the architecture)
    values['model'] = {**OmegaConf.to_container(saved.model), 'pretrained_file': None, 'pretrained': False}
    for key in TASKS.get(saved.task).architecture_keys:
        _copy_key(values, saved, key)
    values['linearize'].update(task=saved.task, teacher_img_size=lin.teacher_img_size or saved.data.img_size)
    resolved = OmegaConf.merge(config_schema(), values)
    OmegaConf.set_readonly(resolved, OmegaConf.is_readonly(cfg))
    return resolved


def _check_pretrained_teacher(cfg: DictConfig) -> None:
    """ConfigError for a pretrained teacher that cannot teach this task: pretrained weights are a classifier's (a
    segmentation teacher is a run of this toolkit)."""
    if cfg.linearize.task != 'classification':
        raise ConfigError(f"linearize.task={cfg.linearize.task}: a teacher from model.pretrained=true is a classifier; "
                          f"a segmentation teacher is a run directory (linearize.teacher=runs/...)")


def _copy_key(values: Dict[str, Any], source: DictConfig, key: str) -> None:
    """values[a][b] = source.a.b for the dotted key 'a.b', as plain python."""
    *parents, leaf = key.split('.')
    for part in parents:
        values = values[part]
    value = OmegaConf.select(source, key)
    values[leaf] = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def _stage_config(cfg: DictConfig, stage: str, student_weights: Optional[str]) -> DictConfig:
    """The run config of one stage: its own run directory; stage 1 trains with linearize.attention_* (no weight
    decay, no warmup, no EMA, eager: a short imitation of fixed targets), stage 2 with train.* as it is."""
    lin = cfg.linearize
    values: Dict[str, Any] = {'output_dir': os.path.join(cfg.output_dir, STAGE_DIRS[stage]),
                              'linearize': {'stage': stage, 'student_weights': student_weights}}
    if stage == 'attention':
        values['train'] = {'epochs': lin.attention_epochs, 'max_steps': lin.attention_max_steps,
                           'lr': lin.attention_lr, 'weight_decay': 0.0, 'warmup_epochs': 0.0, 'layer_decay': None,
                           'ema': False, 'compile': False, 'eval_every': max(1, lin.attention_epochs)}
    return OmegaConf.merge(cfg, values)


def _log_report(report: Dict[str, Any], main: str) -> None:
    stage1 = report[f"stage1_{main}"]
    _logger.info("linearized: teacher %s=%.4f, converted %.4f, after stage 1 %s, final %.4f (%.1f%% of the teacher); "
                 "steps %d + %d (teacher %s)", main, report[f"teacher_{main}"], report[f"converted_{main}"],
                 'skipped' if stage1 is None else f"{stage1:.4f}", report[main],
                 100 * report[main] / max(report[f"teacher_{main}"], 1e-12), report['stage1_steps'],
                 report['stage2_steps'], report['teacher_steps'])
    for key, value in report.get('speed', {}).items():
        _logger.info("speed %s: %.2f", key, value)
    if not math.isfinite(report[main]):
        _logger.warning("the final %s is not finite", main)


@register_task
class LinearizeTask(Task):
    """A linearization: with ``linearize.stage: all`` the two stages and the report (``staged_run``), else one stage
    ('attention' or 'finetune'), trained as any run. The data, metrics and pictures are those of the task
    ``linearize.task``; ``staged_run`` resolves the teacher into the stages' configs (model.*, its head,
    linearize.task, linearize.teacher_img_size)."""
    name = 'linearize'
    architecture_keys = SegmentationTask.architecture_keys  # the student may be a segmentation model

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        lin = cfg.linearize
        if not lin.teacher and not cfg.model.pretrained and lin.stage != 'all':
            # stage 'all' needs its teacher only to train (staged_run says so): a finished run rebuilds without it
            raise ConfigError(NO_TEACHER)
        self.base = TASKS[lin.task](cfg)
        self.main_metric = self.base.main_metric
        self.metric_columns = self.base.metric_columns
        self.teacher: Optional[nn.Module] = None
        self.paths: List[str] = []
        self._teacher_state: Optional[Dict[str, torch.Tensor]] = None

    # ---------------------------------------------------------------- the stages and their report

    def staged_run(self) -> Optional[StagedRun]:
        """Stage 1 (attention transfer, unless linearize.attention_epochs is 0) then stage 2 (fine-tuning from stage
        1's weights), in stage1/ and stage2/; None for a run of one stage."""
        if self.cfg.linearize.stage != 'all':
            return None
        cfg = resolve_teacher(self.cfg)
        student_weights = cfg.linearize.student_weights  # None: the teacher's, converted
        stages = []
        if cfg.linearize.attention_epochs > 0:
            stages.append(Stage(STAGE_DIRS['attention'], _stage_config(cfg, 'attention', student_weights)))
            student_weights = RunDir(cfg.output_dir).stage(STAGE_DIRS['attention']).weights
        stages.append(Stage(STAGE_DIRS['finetune'], _stage_config(cfg, 'finetune', student_weights)))
        return StagedRun(config=cfg, stages=tuple(stages))

    def baselines(self, first_stage: Task, model: nn.Module) -> Dict[str, nn.Module]:
        """The teacher (the first stage built it), fed as during training, and the student right after conversion
        (``model``, before any training)."""
        size = self.teacher_size()
        teacher = first_stage.teacher.to(next(model.parameters()).device)
        fed = teacher if size is None or size == self.cfg.data.img_size else ResizedInput(teacher, size)
        return {'teacher': fed, 'converted': student_of(model)}

    def report(self, state: Dict[str, Any], is_main: bool) -> Dict[str, Any]:
        """The report (see the module docstring); rank 0 measures the speeds once (kept in ``state``)."""
        cfg, main = self.cfg, self.main_metric
        if is_main and cfg.linearize.speed and 'speed' not in state:
            state['speed'] = self._speed(state['before']['num_classes'])
        before, stage1, stage2 = state['before'], state.get(STAGE_DIRS['attention']), state[STAGE_DIRS['finetune']]
        size = self.teacher_size()
        report: Dict[str, Any] = {
            f"teacher_{main}": before['teacher'][main],
            f"converted_{main}": before['converted'][main],
            f"stage1_{main}": stage1['metrics'][main] if stage1 else None,
            **stage2['metrics'],
            'teacher_steps': teacher_training_steps(cfg.linearize.teacher),
            'stage1_steps': stage1['steps'] if stage1 else 0,
            'stage1_wall_s': stage1['wall_s'] if stage1 else 0.0,
            'stage2_steps': stage2['steps'],
            'stage2_wall_s': stage2['wall_s'],
            'teacher_input': (f"resized to {size} px (its training size)" if size not in (None, cfg.data.img_size)
                              else "the student's images as they are"),
            'teacher_img_size': cfg.linearize.teacher_img_size or cfg.data.img_size,
            'img_size': cfg.data.img_size,
        }
        if report['teacher_steps']:
            steps = report['stage1_steps'] + report['stage2_steps']
            report['student_steps_fraction'] = steps / report['teacher_steps']
        if 'speed' in state:
            report['speed'] = state['speed']
        return report

    def write_report(self, out_dir: str, report: Dict[str, Any]) -> None:
        """metrics.csv: the report as rows (split = teacher / converted / stage1 / final, then the speed rows); and
        its summary in the log."""
        main = self.main_metric
        rows = [{'split': 'teacher', 'step': report['teacher_steps'], main: report[f"teacher_{main}"]},
                {'split': 'converted', 'step': 0, main: report[f"converted_{main}"]},
                {'split': 'stage1', 'step': report['stage1_steps'], main: report[f"stage1_{main}"]},
                {'split': 'final', 'step': report['stage1_steps'] + report['stage2_steps'], main: report[main]}]
        for key, value in report.get('speed', {}).items():
            if '_img_per_s@' in key:
                rows.append({'split': f"speed_{key.replace('_img_per_s@', '@')}", 'img_per_s': value})
        fields = ['split', 'step', *self.metric_columns, 'loss', 'img_per_s']
        with atomic_write(RunDir(out_dir).metrics_csv, mode='w') as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction='ignore')
            writer.writeheader()
            writer.writerows({k: ('' if v is None else v) for k, v in row.items()} for row in rows)
        _log_report(report, main)

    def _speed(self, num_classes: int) -> Dict[str, float]:
        """img/s of the student and the teacher architectures at data.img_size and at twice the side (inference,
        float32, eval mode, interleaved rounds on this process's device)."""
        device = setup_distributed(self.cfg.device).device
        builder = LinearizeTask(OmegaConf.merge(self.cfg, {'linearize': {'stage': 'finetune'}}))
        speed: Dict[str, float] = {}
        for size in (self.cfg.data.img_size, 2 * self.cfg.data.img_size):
            models = {'student': builder.build_student(num_classes, size, with_weights=False).to(device).eval(),
                      'teacher': builder.base_model(num_classes, size).to(device).eval()}
            images = torch.randn(SPEED_BATCH, 3, size, size, device=device)
            with torch.no_grad():
                ms = time_interleaved({name: functools.partial(model, images) for name, model in models.items()},
                                      warmup=SPEED_WARMUP, repeats=SPEED_REPEATS, device=str(device))
            for name, value in ms.items():
                speed[f"{name}_img_per_s@{size}px"] = SPEED_BATCH * 1e3 / value
            speed[f"student_over_teacher@{size}px"] = ms['teacher'] / ms['student']
        return speed

    # ---------------------------------------------------------------- the trained student, for prediction and export

    def inference_task(self) -> Task:
        return self.base

    def prediction_defaults(self) -> Dict[str, Any]:
        return self.base.prediction_defaults()

    def final_run_dir(self, run_dir: str) -> str:
        return os.path.join(run_dir, STAGE_DIRS['finetune']) if self.cfg.linearize.stage == 'all' else run_dir

    # ---------------------------------------------------------------- data and models

    def build_datasets(self, mean: Sequence[float], std: Sequence[float],
                       with_train: bool = True) -> Tuple[Optional[Dataset], Dataset, List[str]]:
        return self.base.build_datasets(mean, std, with_train)

    def teacher_size(self) -> Optional[int]:
        """The size the teacher is fed at: its training size when its model has a fixed size; None when it takes
        any size (it then sees the student's images as they are)."""
        if self.cfg.linearize.task == 'segmentation':
            return None  # segmentation backbones are built with dynamic_img_size
        return self.cfg.linearize.teacher_img_size or self.cfg.data.img_size

    def base_model(self, num_classes: int, img_size: int, pretrained: bool = False) -> nn.Module:
        """The underlying task's model (the teacher's architecture) for ``img_size`` px images, without weights;
        ``pretrained``: with model.name's pretrained weights (a pretrained teacher's)."""
        model = {'pretrained_file': None, 'pretrained': pretrained}
        with_size = OmegaConf.merge(self.cfg, {'data': {'img_size': img_size}, 'model': model})
        builder = type(self.base)(with_size)
        model = builder.build_model(num_classes)
        # what building taught the task (segmentation: its class count, which its meter needs) holds for this size too
        vars(self.base).update({key: value for key, value in vars(builder).items() if key != 'cfg'})
        return model

    def build_teacher(self, num_classes: int) -> nn.Module:
        """The frozen teacher in eval mode, its weights loaded from ``linearize.teacher`` (or model.name's pretrained
        weights: ``pretrained_teacher``)."""
        lin = self.cfg.linearize
        size = lin.teacher_img_size or self.cfg.data.img_size
        if pretrained_teacher(self.cfg):
            self._check_teacher_classes(num_classes)
            teacher = self.base_model(num_classes, size, pretrained=True)
        else:
            teacher = self.base_model(num_classes, size)
            load_weights(teacher, self._teacher_weights(), f"teacher {teacher_weights_path(lin.teacher)}")
        if any(isinstance(module, LinearAttention) for module in teacher.modules()):
            converted = " (model.convert converts it: leave model.convert null, linearize.convert converts the " \
                "student)" if self.cfg.model.convert is not None else ''
            raise ConfigError(f"linearize.teacher {teacher_name(self.cfg)} already uses linear attention{converted}; "
                              f"the teacher must be a softmax ViT")
        for parameter in teacher.parameters():
            parameter.requires_grad_(False)
        return teacher.eval()

    def _check_teacher_classes(self, num_classes: int) -> None:
        """ConfigError when pretrained weights' classifier has another class count than the data: timm would give the
        teacher a new random head, and distillation would teach noise."""
        pretrained = model_source(self.cfg.model.name).pretrained_cfg.get('num_classes')
        if pretrained != num_classes:
            raise ConfigError(f"the teacher {teacher_name(self.cfg)} was pretrained with {pretrained} classes and the "
                              f"data has {num_classes}: a teacher must be trained on these classes (fine-tune it with "
                              f"train.py first, then linearize.teacher=<its run directory>)")

    def build_student(self, num_classes: int, img_size: Optional[int] = None, with_weights: bool = True) -> nn.Module:
        """The teacher's architecture at ``img_size`` (default data.img_size) with the teacher's weights (position
        embeddings resampled), converted with ``linearize.convert``; with ``linearize.student_weights`` (stage 2
        after stage 1) those weights instead; ``with_weights=False``: the converted architecture only."""
        lin = self.cfg.linearize
        from_teacher = with_weights and lin.student_weights is None
        # a pretrained teacher's weights load as the teacher's did (timm resamples them to this size)
        hub = from_teacher and pretrained_teacher(self.cfg)
        student = self.base_model(num_classes, img_size or self.cfg.data.img_size, pretrained=hub)
        if from_teacher and not hub:
            load_weights(student, self._teacher_weights(), f"teacher {lin.teacher} (into the student)")
        options = OmegaConf.to_container(lin.convert) if isinstance(lin.convert, DictConfig) else dict(lin.convert)
        try:
            convert_to_linear(vit_of(student), **options)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"linearize.convert={options}: {error}") from error
        if with_weights and lin.student_weights is not None:
            weights = read_weights(lin.student_weights).weights
            load_weights(student, weights, lin.student_weights)
        return student

    def _teacher_weights(self) -> Dict[str, torch.Tensor]:
        """The teacher's weights, read from its file once (the teacher and the student both start from them)."""
        if self._teacher_state is None:
            self._teacher_state = read_weights(teacher_weights_path(self.cfg.linearize.teacher)).weights
        return self._teacher_state

    def build_model(self, num_classes: int) -> nn.Module:
        """Stage 'attention': the AttentionTransfer wrapper around the student; 'finetune': the student itself;
        'all' (a finished linearization's saved config): the student's architecture only, for its trained weights
        (evaluation, prediction, export: the teacher is not needed)."""
        if self.cfg.linearize.stage == 'all':
            return self.build_student(num_classes, with_weights=False)
        self.teacher = self.build_teacher(num_classes)
        student = self.build_student(num_classes)
        self._teacher_state = None  # both models hold their copies now
        if self.cfg.linearize.stage != 'attention':
            return self._aligned_features(student)
        self.paths = transfer_pairs(self.teacher, student)
        if not self.paths:
            raise ConfigError("linearize: the student has no linear attention layer to train in stage 1 (every block "
                              "kept softmax attention)")
        self._freeze_for_attention_transfer(student)
        queries = self.cfg.linearize.attention_queries if self.cfg.linearize.attention_weights_loss > 0 else 0
        return AttentionTransfer(student, self.paths, queries, self._teacher_ropes())

    def _aligned_features(self, student: nn.Module) -> nn.Module:
        """Stage 2's model: the student, or with linearize.feature_weight > 0 the student that also gives its last
        block's tokens (``FeatureAlignment``), which the teacher's must match token for token."""
        if self.cfg.linearize.feature_weight <= 0:
            return student
        size, img_size = self.teacher_size(), image_size(self.cfg.data.img_size)
        if size is not None and (size, size) != img_size:
            raise ConfigError(f"linearize.feature_weight aligns the student's tokens with the teacher's, but the "
                              f"teacher sees these {img_size[0]}x{img_size[1]} px images resized to its {size} px: set "
                              f"linearize.feature_weight=0 or data.img_size={size}")
        return FeatureAlignment(student, last_block(student))

    def _teacher_ropes(self) -> List[Optional[torch.Tensor]]:
        """The rotary embeddings the teacher's layers at ``self.paths`` receive on a training batch's images (None
        each for a model without RoPE), read from one forward of a blank image of data.img_size."""
        height, width = image_size(self.cfg.data.img_size)
        parameter = next(self.teacher.parameters())
        blank = torch.zeros(1, 3, height, width, device=parameter.device, dtype=parameter.dtype)
        resized = ResizedInput(self.teacher, self.teacher_size())
        return rotary_embeddings(self.teacher, self.paths, lambda: resized(blank))

    def _freeze_for_attention_transfer(self, student: nn.Module) -> None:
        """Stage 1 trains what the conversion added (``linear_only_parameter_names``: learnable maps, local mixing,
        gates) and, with linearize.train_qk, the q and k rows of each trained layer's qkv projection (a gradient
        mask keeps the v rows fixed); everything else is frozen."""
        added = set(linear_only_parameter_names(student))
        for name, parameter in student.named_parameters():
            parameter.requires_grad_(name in added)
        if self.cfg.linearize.train_qk:
            for path in self.paths:
                self._train_qk_rows(student.get_submodule(path))
        if not any(parameter.requires_grad for parameter in student.parameters()):
            convert = dict(self.cfg.linearize.convert)
            raise ConfigError(f"linearize stage 1 has nothing to train: linearize.convert={convert} adds no tensors "
                              f"(use feature_map: hedgehog or local_mix: true) and linearize.train_qk is off; or skip "
                              f"stage 1 with linearize.attention_epochs=0")

    @staticmethod
    def _train_qk_rows(attn: LinearAttention) -> None:
        if getattr(attn, 'qkv', None) is None:
            raise ConfigError(f"linearize.train_qk trains the q and k rows of a fused qkv projection; "
                              f"{type(attn).__name__} projects q, k and v separately: set linearize.train_qk=false")
        rows = attn.qkv.out_features
        keep = torch.ones(rows, device=attn.qkv.weight.device)
        keep[2 * rows // 3:] = 0  # the v projection: its outputs feed the teacher-identical values
        for parameter in attn.qkv.parameters():
            parameter.requires_grad_(True)
            parameter.register_hook(row_mask_hook(keep.view((-1,) + (1,) * (parameter.dim() - 1))))

    # ---------------------------------------------------------------- losses and the teacher's targets

    def train_loss(self) -> Callable:
        lin = self.cfg.linearize
        if lin.stage == 'attention':
            return attention_transfer_loss(lin.attention_weights_loss)
        ignore = self.cfg.data.ignore_index if lin.task == 'segmentation' else None
        return DistillationLoss(self.base.train_loss(), lin.distill_weight, lin.temperature, ignore,
                                lin.feature_weight)

    def _autocast(self, device: torch.device) -> Any:
        precision = self.cfg.train.precision
        dtype = None if precision == 'float32' else PRECISIONS[precision]
        return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None)

    def _teacher_on(self, device: torch.device) -> nn.Module:
        teacher = self.teacher
        if next(teacher.parameters()).device != device:
            teacher.to(device)
        return teacher

    def batch_mixer(self, num_classes: int) -> Optional[Callable]:
        if self.cfg.linearize.stage == 'attention':
            return self._attention_targets()
        return self._distillation_targets(self.base.batch_mixer(num_classes))

    def _attention_targets(self) -> Callable:
        """images -> (the teacher's attention inputs [B, L, N, C], (its outputs, its weights on the queries))."""
        hidden = HiddenStates(self.teacher, self.paths)
        resized = ResizedInput(self.teacher, self.teacher_size())
        lin = self.cfg.linearize

        @torch.no_grad()
        def mix(images: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, Tuple]:
            self._teacher_on(images.device)
            with self._autocast(images.device):
                resized(images)
            inputs, outputs = hidden.take()
            weights = None
            if lin.attention_weights_loss > 0:
                positions = query_positions(inputs.shape[2], lin.attention_queries, inputs.device)
                weights = torch.stack([softmax_attention_weights(module, inputs[:, i], positions)
                                       for i, module in enumerate(hidden.modules)], dim=1)
            return inputs.float(), (outputs.float(), weights)

        return mix

    def _distillation_targets(self, base_mixer: Optional[Callable]) -> Callable:
        """(images, targets) -> (images, (targets, the teacher's logits on those images[, its last block's tokens
        with linearize.feature_weight > 0])), after the task's own mixing (Mixup: the teacher sees the mixed images)."""
        resized = ResizedInput(self.teacher, self.teacher_size())
        hidden = HiddenStates(self.teacher, [last_block(self.teacher)]) if self.cfg.linearize.feature_weight > 0 \
            else None

        @torch.no_grad()
        def mix(images: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, Tuple]:
            if base_mixer is not None:
                images, targets = base_mixer(images, targets)
            self._teacher_on(images.device)
            with self._autocast(images.device):
                teacher = resized(images).float()
            if teacher.dim() == 4 and teacher.shape[-2:] != images.shape[-2:]:
                teacher = F.interpolate(teacher, size=images.shape[-2:], mode='bilinear', align_corners=False)
            if hidden is None:
                return images, (targets, teacher)
            _, tokens = hidden.take()
            return images, (targets, teacher, tokens[:, 0].float())

        return mix

    # ---------------------------------------------------------------- evaluation: the underlying task's, on the student

    def eval_batch_size(self) -> int:
        return self.base.eval_batch_size()

    def new_meter(self, device: torch.device) -> Meter:
        return self.base.new_meter(device)

    def evaluate_batch(self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor, meter: Meter) -> None:
        self.base.evaluate_batch(student_of(model), images, targets, meter)

    def final_metrics(self, computed: Dict[str, float]) -> Dict[str, float]:
        return self.base.final_metrics(computed)

    def save_pictures(self, model: nn.Module, dataset: Dataset, class_names: List[str], png_path: str,
                      mean: Sequence[float], std: Sequence[float], device: torch.device, autocast: Callable) -> None:
        self.base.save_pictures(student_of(model), dataset, class_names, png_path, mean, std, device, autocast)

    def describe_evaluation(self) -> str:
        return self.base.describe_evaluation()

    def plot_evaluation(self, meter: Meter, class_names: List[str], png_path: str) -> bool:
        return self.base.plot_evaluation(meter, class_names, png_path)
