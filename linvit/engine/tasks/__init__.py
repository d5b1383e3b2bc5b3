"""Tasks: what differs between classification, segmentation and autoregressive pretraining; the loop is written once.

    task = build_task(cfg)                 # TASKS[cfg.task](cfg)
    train, val, class_names = task.build_datasets(mean, std)
    model = task.build_model(len(class_names))

Each task is one module here (``base.Task`` subclass decorated with ``@register_task``), imported below, so
``TASKS`` holds every built-in task once ``linvit.engine`` is imported. Adding a task: one module that registers its
class, plus one import line here.
"""
from . import autoregressive, classification, linearize, segmentation
from .base import TASKS, Task, build_task, create_model_from_config, list_tasks, normalization_of, register_task

__all__ = ['Task', 'TASKS', 'register_task', 'list_tasks', 'build_task', 'create_model_from_config', 'normalization_of',
           'classification', 'segmentation', 'autoregressive', 'linearize']
