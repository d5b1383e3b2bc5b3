"""Linearize a trained softmax ViT: stage 1 (attention transfer) then stage 2 (fine-tune with distillation), and
the report of how much of the teacher's accuracy comes back.

    cfg = load_config('configs/linearize_cls_fmnist.yaml', ['linearize.teacher=runs/teacher', 'data.root=...'])
    report = train(cfg)              # task: linearize -> linearize(cfg)
    report = linearize(cfg, resume=True)   # continue an interrupted run in cfg.output_dir (either stage)

The run directory ``cfg.output_dir`` holds ``config.yaml`` (this config), ``stage1/`` and ``stage2/`` (each a
complete train.py run directory: checkpoints, curves, pictures, TensorBoard), ``model.safetensors`` (the final
student, the converted timm model's keys), ``metrics.json`` (the report) and ``metrics.csv`` (the report as rows:
split = teacher / converted / stage1 / final, then the speed rows). ``linearize.json`` keeps what was measured
before the stages, so a resumed run does not measure it again.

The report: ``teacher_<metric>`` (the teacher on this validation set, fed as it is during training),
``converted_<metric>`` (the student right after conversion, before any training), ``stage1_<metric>``, the final
metrics (``<metric>`` ...), each stage's steps and wall time, the teacher's own training steps when its run
directory has them, ``teacher_input`` (how the teacher sees the images), and img/s of student and teacher at the
training size and at twice the side (4x the tokens): inference, float32, eval mode, batch ``SPEED_BATCH``, the
median of interleaved rounds.
"""
import csv
import functools
import json
import logging
import math
import os
import shutil
import time
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from ..bench.timing import time_interleaved
from .checkpoint import atomic_write, load_checkpoint
from .config import ConfigError, RunConfig, check_runs_here, config_from_yaml, config_to_yaml, load_config
from .distributed import barrier, setup_distributed
from .run_files import find_run_files, saved_config_text
from .tasks import TASKS, build_task
from .tasks.linearize import NO_TEACHER, ResizedInput, student_of, teacher_weights_path
from .trainer import _build_run, _evaluate, prepare_new_run, train

__all__ = ['linearize', 'resolve_teacher', 'teacher_training_steps', 'SPEED_BATCH',
           'STAGE_DIRS']

_logger = logging.getLogger('linvit.linearize')

#: the stages' run directories inside the linearization's own
STAGE_DIRS = {'attention': 'stage1', 'finetune': 'stage2'}
#: images per call when the report measures speed
SPEED_BATCH = 4
#: untimed and timed interleaved rounds of that measurement: 5 timed rounds at batch 4 left the reported img/s
#: moving by up to 2x between runs on a 2-core machine; 15 keep each model's median within about 15%
SPEED_WARMUP, SPEED_REPEATS = 3, 15
#: the teacher's architecture keys its saved config supplies (with the task and the training size)
_TEACHER_SEG_KEYS = ('head', 'neck_dim', 'head_dim', 'feature_blocks')


# ---------------------------------------------------------------------------------------------------- the teacher

def _teacher_config_text(teacher: str) -> Optional[str]:
    """The config a teacher was trained with (YAML), when it says: a run directory's, a train.py checkpoint's, or
    the config.yaml beside a .safetensors file; None for a bare weights file."""
    teacher_weights_path(teacher)  # FileNotFoundError for a path that holds no weights
    if os.path.isdir(teacher):
        return find_run_files(teacher).config_text
    if teacher.endswith('.safetensors'):
        return saved_config_text(teacher)
    state = load_checkpoint(teacher)
    return state.get('config') if isinstance(state, dict) and isinstance(state.get('config'), str) else None


def teacher_training_steps(teacher: str) -> Optional[int]:
    """The optimizer steps the teacher was trained for, when its run directory records them (the last train row of
    metrics.csv); None otherwise."""
    path = os.path.join(teacher, 'metrics.csv')
    if not (os.path.isdir(teacher) and os.path.isfile(path)):
        return None
    with open(path, newline='') as f:
        steps = [int(row['step']) for row in csv.DictReader(f) if row.get('split') == 'train' and row.get('step')]
    return max(steps) if steps else None


def resolve_teacher(cfg: DictConfig) -> DictConfig:
    """``cfg`` with the teacher's architecture filled in from its saved config, when it has one: model.* (without
    pretrained_file), seg.head / neck_dim / head_dim / feature_blocks, linearize.task and linearize.teacher_img_size
    (its data.img_size, unless set). A bare weights file keeps the config's model.* and linearize.task."""
    lin = cfg.linearize
    if not lin.teacher:
        raise ConfigError(NO_TEACHER)
    text = _teacher_config_text(lin.teacher)
    if text is None:
        return cfg
    saved = load_config(None, [], base=config_from_yaml(text))
    if saved.task not in ('classification', 'segmentation'):
        raise ConfigError(f"linearize.teacher {lin.teacher} was trained with task={saved.task!r}; linearization "
                          f"takes a classification or segmentation teacher")
    values = OmegaConf.to_container(cfg)
    # the teacher's model replaces the config's whole model section (its kwargs are the architecture)
    values['model'] = {**OmegaConf.to_container(saved.model), 'pretrained_file': None}
    values['seg'].update({key: OmegaConf.to_container(saved.seg)[key] for key in _TEACHER_SEG_KEYS})
    values['linearize'].update(task=saved.task, teacher_img_size=lin.teacher_img_size or saved.data.img_size)
    resolved = OmegaConf.merge(OmegaConf.structured(RunConfig), values)
    OmegaConf.set_readonly(resolved, OmegaConf.is_readonly(cfg))
    return resolved


# ---------------------------------------------------------------------------------------------------- the stages

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


def _stage_done(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, 'metrics.json')) and \
        os.path.isfile(os.path.join(run_dir, 'model.safetensors'))


def _run_stage(stage_cfg: DictConfig, resume: bool, state: Dict[str, Any], key: str) -> Dict[str, Any]:
    """Train one stage (continuing its last.pt when resuming); its metrics, steps and wall time go into state."""
    run_dir = stage_cfg.output_dir
    if resume and _stage_done(run_dir) and key in state:
        return state[key]
    checkpoint_path = os.path.join(run_dir, 'last.pt')
    checkpoint = load_checkpoint(checkpoint_path) if resume and os.path.isfile(checkpoint_path) else None
    start = time.perf_counter()
    # the stage folders belong to this linearization (its own folder was claimed when it started): a stage that
    # stopped before its first checkpoint starts again in its folder
    metrics = train(stage_cfg, resume=checkpoint, overwrite=True)
    last = load_checkpoint(checkpoint_path)
    # the wall time of the call that finished the stage (an interrupted attempt records nothing)
    state[key] = {'metrics': metrics, 'steps': int(last['progress']['step']), 'wall_s': time.perf_counter() - start,
                  'resumed_from_step': int(checkpoint['progress']['step']) if checkpoint is not None else 0}
    return state[key]


# ---------------------------------------------------------------------------------------------------- measurements

def _evaluate_before_training(stage_cfg: DictConfig) -> Dict[str, Any]:
    """The teacher's and the converted student's metrics on the validation set, and how the teacher sees images."""
    run = _build_run(stage_cfg, setup_distributed(stage_cfg.device))
    task = run.task
    size = task.teacher_size()
    teacher = task.teacher.to(run.info.device)
    fed = teacher if size is None or size == stage_cfg.data.img_size else ResizedInput(teacher, size)
    return {'teacher': _evaluate(run, fed), 'converted': _evaluate(run, student_of(run.model)),
            'num_classes': len(run.class_names),
            'teacher_input': (f"resized to {size} px (its training size)" if fed is not teacher
                              else "the student's images as they are")}


def _speed(cfg: DictConfig, num_classes: int) -> Dict[str, float]:
    """img/s of the student and the teacher architectures at data.img_size and at twice the side (inference,
    float32, eval mode, interleaved rounds on this process's device)."""
    device = setup_distributed(cfg.device).device
    task = build_task(OmegaConf.merge(cfg, {'linearize': {'stage': 'finetune'}}))
    speed: Dict[str, float] = {}
    for size in (cfg.data.img_size, 2 * cfg.data.img_size):
        models = {'student': task.build_student(num_classes, size, with_weights=False).to(device).eval(),
                  'teacher': task.base_model(num_classes, size).to(device).eval()}
        images = torch.randn(SPEED_BATCH, 3, size, size, device=device)
        with torch.no_grad():
            ms = time_interleaved({name: functools.partial(model, images) for name, model in models.items()},
                                  warmup=SPEED_WARMUP, repeats=SPEED_REPEATS, device=str(device))
        for name, value in ms.items():
            speed[f"{name}_img_per_s@{size}px"] = SPEED_BATCH * 1e3 / value
        speed[f"student_over_teacher@{size}px"] = ms['teacher'] / ms['student']
    return speed


# ---------------------------------------------------------------------------------------------------- the report

def _report(cfg: DictConfig, state: Dict[str, Any], main: str) -> Dict[str, Any]:
    final = dict(state['stage2']['metrics'])
    report: Dict[str, Any] = {
        f"teacher_{main}": state['before']['teacher'][main],
        f"converted_{main}": state['before']['converted'][main],
        f"stage1_{main}": state['stage1']['metrics'][main] if 'stage1' in state else None,
        **final,
        'teacher_steps': teacher_training_steps(cfg.linearize.teacher),
        'stage1_steps': state['stage1']['steps'] if 'stage1' in state else 0,
        'stage1_wall_s': state['stage1']['wall_s'] if 'stage1' in state else 0.0,
        'stage2_steps': state['stage2']['steps'],
        'stage2_wall_s': state['stage2']['wall_s'],
        'teacher_input': state['before']['teacher_input'],
        'teacher_img_size': cfg.linearize.teacher_img_size or cfg.data.img_size,
        'img_size': cfg.data.img_size,
    }
    if report['teacher_steps']:
        report['student_steps_fraction'] = (report['stage1_steps'] + report['stage2_steps']) / report['teacher_steps']
    if 'speed' in state:
        report['speed'] = state['speed']
    return report


def _write_report(out_dir: str, report: Dict[str, Any], main: str, columns: tuple) -> None:
    with atomic_write(os.path.join(out_dir, 'metrics.json'), mode='w') as f:
        json.dump(report, f, indent=2)
        f.write('\n')
    rows = [{'split': 'teacher', 'step': report['teacher_steps'], main: report[f"teacher_{main}"]},
            {'split': 'converted', 'step': 0, main: report[f"converted_{main}"]},
            {'split': 'stage1', 'step': report['stage1_steps'], main: report[f"stage1_{main}"]},
            {'split': 'final', 'step': report['stage1_steps'] + report['stage2_steps'], main: report[main]}]
    for key, value in report.get('speed', {}).items():
        if '_img_per_s@' in key:
            rows.append({'split': f"speed_{key.replace('_img_per_s@', '@')}", 'img_per_s': value})
    fields = ['split', 'step', *columns]
    with atomic_write(os.path.join(out_dir, 'metrics.csv'), mode='w') as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction='ignore')
        writer.writeheader()
        writer.writerows({k: ('' if v is None else v) for k, v in row.items()} for row in rows)


def _load_state(path: str, resume: bool) -> Dict[str, Any]:
    if resume and os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return {}


def _save_state(path: str, state: Dict[str, Any], is_main: bool) -> None:
    if not is_main:
        return
    with atomic_write(path, mode='w') as f:
        json.dump(state, f, indent=2)


def linearize(cfg: DictConfig, resume: bool = False, overwrite: bool = False) -> Dict[str, Any]:
    """Run both stages of ``cfg`` (task: linearize) and write the report; returns it (what metrics.json holds).

    resume: continue the run in cfg.output_dir: finished stages are kept, an interrupted one continues from its
    last.pt (the same losses as an uninterrupted run), and what was measured before the stages is read back.
    Without resume, cfg.output_dir must not hold a run (RunExistsError) unless ``overwrite`` (its files deleted)."""
    check_runs_here(cfg)
    cfg = resolve_teacher(cfg)
    out_dir = cfg.output_dir
    info = setup_distributed(cfg.device)
    if not resume:
        prepare_new_run(out_dir, info, overwrite)
    if info.is_main:
        os.makedirs(out_dir, exist_ok=True)
        with atomic_write(os.path.join(out_dir, 'config.yaml'), mode='w') as f:
            f.write(config_to_yaml(OmegaConf.merge(cfg, {'linearize': {'stage': 'all'}})))
    state_path = os.path.join(out_dir, 'linearize.json')
    state = _load_state(state_path, resume)
    with_stage1 = cfg.linearize.attention_epochs > 0
    student_weights = cfg.linearize.student_weights  # None: the teacher's, converted
    first = _stage_config(cfg, 'attention' if with_stage1 else 'finetune', student_weights)
    if 'before' not in state:
        state['before'] = _evaluate_before_training(first)
        _save_state(state_path, state, info.is_main)
    if with_stage1:
        _run_stage(first, resume, state, 'stage1')
        _save_state(state_path, state, info.is_main)
        student_weights = os.path.join(first.output_dir, 'model.safetensors')
    _run_stage(_stage_config(cfg, 'finetune', student_weights), resume, state, 'stage2')
    base = TASKS[cfg.linearize.task]
    if info.is_main and cfg.linearize.speed and 'speed' not in state:
        state['speed'] = _speed(cfg, state['before']['num_classes'])
    barrier()
    report = _report(cfg, state, base.main_metric)
    if info.is_main:
        _save_state(state_path, state, True)
        shutil.copyfile(os.path.join(out_dir, STAGE_DIRS['finetune'], 'model.safetensors'),
                        os.path.join(out_dir, 'model.safetensors'))
        _write_report(out_dir, report, base.main_metric, tuple(base.metric_columns) + ('loss', 'img_per_s'))
        _log_report(report, base.main_metric)
    return report


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
