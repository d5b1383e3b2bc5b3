"""The training engine: config, tasks, the loop, checkpoints, metrics, pictures, distribution (``train.py``'s body).

    cfg = load_config('configs/cls_demo.yaml', ['train.epochs=3'])
    metrics = train(cfg)                                  # writes the run directory cfg.output_dir
    metrics = evaluate(cfg, 'runs/x/best.pt', 'runs/x/eval')

Where things live: ``config`` (the typed config), ``tasks/`` (one module per task, registered in ``TASKS`` on
import), ``trainer`` (``train`` and the loop, ``fit``), ``run`` (a run set up from its config: ``Run``,
``Training``), ``evaluation`` (the validation set into a task's meter; ``evaluate`` for saved weights), ``step``
(the step runner: backward, accumulation, loss scaling, clipping, the optimizer step), ``run_log`` (metrics.csv,
TensorBoard, train.log), ``metrics`` (the meters), ``checkpoint`` (``Checkpoint``, crash-safe files),
``run_dir`` (``RunDir``: the run folder's layout, the name of each file), ``run_files`` / ``loading`` (run folders
and trained models back from disk), ``hub`` (a run as a timm / Hugging Face model folder: ``export_hub_folder``),
``commands`` (what train.py's modes do), ``sampler`` and ``distributed`` (data order and processes), ``plots``.

Needs the ``train`` extra (albumentations, omegaconf, tensorboard, tqdm, matplotlib); ``import linvit`` alone
does not import this package.
"""
from .checkpoint import Checkpoint
from .config import ConfigError, RunConfig, config_from_yaml, config_to_yaml, load_config
from .evaluation import evaluate
from .hub import export_hub_folder
from .run_dir import RunDir
from .step import TrainStep, compile_train_step
from .tasks import TASKS, Task, build_task, list_tasks, register_task
from .trainer import NonFiniteLossError, RunInterrupted, train

__all__ = ['ConfigError', 'RunConfig', 'load_config', 'config_to_yaml', 'config_from_yaml', 'TASKS', 'Task',
           'build_task', 'register_task', 'list_tasks', 'TrainStep', 'compile_train_step', 'NonFiniteLossError',
           'RunInterrupted', 'Checkpoint', 'RunDir', 'train', 'evaluate', 'export_hub_folder']
