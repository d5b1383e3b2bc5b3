"""The training engine: config, tasks, the loop, checkpoints, metrics, pictures, distribution (``train.py``'s body).

    cfg = load_config('configs/cls_demo.yaml', ['train.epochs=3'])
    metrics = train(cfg)                                  # writes the run directory cfg.output_dir
    metrics = evaluate(cfg, 'runs/x/best.pt', 'runs/x/eval')

Where things live: ``config`` (the typed config), ``tasks/`` (one module per task, registered in ``TASKS`` on
import), ``trainer`` (the loop: ``Run`` / ``Training`` built from the config, ``TrainingLoop``), ``step`` (the step
runner: backward, accumulation, loss scaling, clipping, the optimizer step), ``metrics`` (the meters),
``checkpoint`` / ``loading`` (files), ``sampler`` and ``distributed`` (data order and processes), ``plots``.

Needs the ``train`` extra (albumentations, omegaconf, tensorboard, tqdm, matplotlib); ``import linvit`` alone
does not import this package.
"""
from .config import ConfigError, RunConfig, config_from_yaml, config_to_yaml, load_config
from .linearize import linearize  # noqa: E402  (after trainer, which it runs)
from .step import TrainStep
from .tasks import TASKS, Task, build_task, list_tasks, register_task
from .trainer import NonFiniteLossError, evaluate, train

__all__ = ['ConfigError', 'RunConfig', 'load_config', 'config_to_yaml', 'config_from_yaml', 'TASKS', 'Task',
           'build_task', 'register_task', 'list_tasks', 'TrainStep', 'NonFiniteLossError', 'train', 'evaluate', 'linearize']
