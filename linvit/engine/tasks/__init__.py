"""Tasks: what differs between classification, segmentation, autoregressive pretraining and linearization; the loop
is written once.

    task = build_task(cfg)                 # TASKS.get(cfg.task)(cfg)
    train, val, class_names = task.build_datasets(mean, std)
    model = task.build_model(len(class_names))

Each task is one module here (``base.Task`` subclass decorated with ``@register_task``); importing this package
imports every module in it, so ``TASKS`` holds every task once ``linvit.engine`` is imported (``distillation`` holds
the teacher-student pieces the linearization trains with). Adding a task: one module that registers its class, and
its test.
"""
import importlib
import pkgutil

from . import autoregressive, classification, detection, linearize, segmentation
from .base import (
    TASKS,
    Stage,
    StagedRun,
    Task,
    architecture_keys,
    build_task,
    create_model_from_config,
    list_tasks,
    normalization_of,
    predicted_tasks,
    register_task,
    task_of_logits,
)

__all__ = ['Task', 'Stage', 'StagedRun', 'TASKS', 'register_task', 'list_tasks', 'build_task', 'architecture_keys',
           'task_of_logits', 'predicted_tasks', 'create_model_from_config', 'normalization_of', 'classification',
           'segmentation', 'autoregressive', 'linearize', 'detection']


def _import_every_task_module() -> None:
    """Import (and so register) every module of this package, the ones added after this file was written too."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_every_task_module()
