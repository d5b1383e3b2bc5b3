"""The training loop, written once for every task: data order, AMP, accumulation, clipping, EMA, the compiled step,
checkpoints, resume, logging, evaluation and pictures, on one process or under torchrun.

    metrics = train(cfg)                         # a resolved config (linvit.engine.load_config)
    metrics = train(cfg, resume=checkpoint)      # continue from a 'last' checkpoint's contents
    metrics = evaluate(cfg, checkpoint, out_dir) # evaluate saved weights, write metrics.json

The run directory (``cfg.output_dir``, written by rank 0 only): ``config.yaml``, ``train.log``, ``metrics.csv``,
``metrics.json`` (the final evaluation), ``last.pt`` / ``best.pt`` (atomic), ``model.safetensors`` (the evaluated
weights), ``tb/`` (TensorBoard events), ``curves.png`` and ``pictures/val_stepNNNNNN.png``.

Determinism: the seed fixes model init, data order and augmentation (each sample's augmentation is seeded by its
position in the epoch, see ``sampler``); a checkpoint holds the model, optimizer, scheduler, scaler, EMA, the step
and every RNG, so a resumed run continues on the same trajectory. Evaluation draws nothing from the training RNGs.
"""
import csv
import json
import logging
import math
import os
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm import tqdm

from ..data import DataError
from ..precision import PRECISIONS
from .checkpoint import (
    atomic_write,
    capture_rng_state,
    restore_rng_state,
    save_checkpoint,
    save_model_safetensors,
)
from .config import ConfigError, check_runs_here, config_from_yaml, config_to_yaml, differing_keys
from .distributed import DistInfo, all_reduce_max, all_reduce_mean, barrier, setup_distributed
from .plots import plot_curves
from .run_files import claim_run_dir, load_weights, read_weights, run_entries_in
from .sampler import ResumableSampler, ShardSampler
from .step import TrainStep
from .tasks import Task, build_task, normalization_of

__all__ = ['train', 'evaluate', 'NonFiniteLossError', 'CSV_BASE_COLUMNS']

_logger = logging.getLogger('linvit.train')

CSV_BASE_COLUMNS = ('epoch', 'step', 'split', 'loss', 'lr', 'img_per_s', 'data_wait_frac', 'peak_mem_mib')
CHECKPOINT_VERSION = 1

#: a task's batch mixing: (images, targets) -> (images, targets), e.g. Mixup
BatchMixer = Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the message names the step and the checkpoint that is kept."""


# ---------------------------------------------------------------------------------------------------- run state

@dataclass
class Progress:
    """Where the run is: completed optimizer steps, the epoch, and the batch to start that epoch at (checkpointed)."""
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed (a multiple of accum_steps)
    best: float = -math.inf
    best_step: int = -1


@dataclass(frozen=True)
class Run:
    """What a run builds from its config before training or evaluating: the task, its data and its model."""
    cfg: DictConfig
    info: DistInfo
    task: Task
    model: nn.Module  # the bare model, on info.device
    class_names: List[str]
    train_set: Optional[Dataset]  # None when only evaluating
    val_set: Dataset
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    amp_dtype: Optional[torch.dtype]  # autocast dtype of train.precision; None: float32, no autocast


@dataclass(frozen=True)
class Training:
    """What training adds to a Run: data order, optimizer, schedule, loss scaling, EMA and the step runner."""
    sampler: ResumableSampler
    steps_per_epoch: int  # optimizer steps per epoch (each accumulates train.accum_steps micro-batches)
    total_steps: int  # train.epochs * steps_per_epoch
    stop_at: int  # the step training stops at: total_steps, or train.max_steps when smaller
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler
    scaler: Optional[torch.amp.GradScaler]  # float16 only
    ema: Optional[ModelEmaV3]
    step: TrainStep  # around the model (DistributedDataParallel around it when distributed)
    mixer: Optional[BatchMixer]  # the task's batch mixing (e.g. Mixup); None: off


@dataclass
class LoopState:
    """What the loop tracks besides the checkpointed Progress."""
    bad_step: torch.Tensor  # int64 [] on the device: the first step whose loss was not finite, -1 while none was
    saved_step: Optional[int] = None  # the step of the last checkpoint of this run, None before the first
    evaluated_step: int = -1  # the step of the last evaluation
    metrics: Optional[Dict[str, float]] = None  # that evaluation's metrics


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def _autocast_factory(device: torch.device, amp_dtype: Optional[torch.dtype]) -> Callable:
    return lambda: torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=amp_dtype is not None)


def _autocast_dtype(precision: str) -> Optional[torch.dtype]:
    """The autocast dtype of train.precision (None for float32: no autocast; float16 off CUDA was refused when the
    run started, ``check_runs_here``)."""
    return None if precision == 'float32' else PRECISIONS[precision]


def _build_model(task: Task, num_classes: int) -> nn.Module:
    """The task's model; a ValueError of the model's own argument checks, or a keyword the model does not take, is
    a ConfigError (train.py's one line): those come from the config's model.* / task keys, not from a bug."""
    try:
        model = task.build_model(num_classes)
    except ConfigError:
        raise
    except RuntimeError as error:
        if not (task.cfg.model.pretrained_file and 'loading state_dict' in str(error)):
            raise
        raise ConfigError(f"model.pretrained_file={task.cfg.model.pretrained_file!r} does not fit model.name="
                          f"{task.cfg.model.name!r} with this config's model.kwargs: "
                          f"{_first_load_errors(str(error))}") from error
    except ValueError as error:
        raise ConfigError(f"cannot build model.name={task.cfg.model.name!r} from the config: {error}") from error
    except TypeError as error:
        if 'unexpected keyword argument' not in str(error):
            raise
        raise ConfigError(f"model.name={task.cfg.model.name!r} does not take an argument of model.kwargs: "
                          f"{error}") from error
    task.check_input_size(model)
    return model


_SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[.*?\])\) from "
                            r"checkpoint, the shape in current model is torch\.Size\((\[.*?\])\)\.?")


def _first_load_errors(message: str, count: int = 3) -> str:
    """The first problems of torch's load_state_dict error, shortened, on one line: 'pos_embed is [1, 65, 48] in
    the file, [1, 65, 96] in the model; ...'."""
    lines = [line.strip() for line in message.splitlines()[1:] if line.strip()]
    lines = [_SIZE_MISMATCH.sub(r"\1 is \2 in the file, \3 in the model", line) for line in lines]
    more = f" (and {len(lines) - count} more)" if len(lines) > count else ''
    return '; '.join(lines[:count]) + more


def _build_run(cfg: DictConfig, info: DistInfo, with_train: bool = True) -> Run:
    """The task, its datasets and its model (seeded with cfg.seed, so every rank starts from the same weights);
    with_train=False (evaluating saved weights) builds no training set (``Run.train_set`` is None)."""
    task = build_task(cfg)
    mean, std = normalization_of(cfg.model.name)
    train_set, val_set, class_names = task.build_datasets(mean, std, with_train)
    if info.is_main:
        if train_set is not None:
            _logger.info("train data: %s", train_set.describe())
        _logger.info("val data: %s", val_set.describe())
        bad = getattr(train_set, 'num_bad', 0) + getattr(val_set, 'num_bad', 0)
        if bad:
            _logger.warning("%d unreadable image file(s) skipped (named in the warnings above)", bad)
    _seed_everything(cfg.seed)  # the same initial weights on every rank
    model = _build_model(task, len(class_names)).to(info.device)
    return Run(cfg=cfg, info=info, task=task, model=model, class_names=class_names, train_set=train_set,
               val_set=val_set, mean=mean, std=std, amp_dtype=_autocast_dtype(cfg.train.precision))


def _loader(run: Run, dataset: Dataset, sampler: Sampler, batch_size: int, drop_last: bool) -> DataLoader:
    # a private generator: creating a loader iterator draws its worker base seed from it, not from torch's global
    # generator, whose stream (dropout, drop path) must be the same whether or not a run was resumed
    workers = run.cfg.data.num_workers
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=run.info.device.type == 'cuda', drop_last=drop_last,
                      persistent_workers=False, generator=torch.Generator().manual_seed(run.cfg.seed),
                      prefetch_factor=4 if workers > 0 else None)


def _build_training(run: Run) -> Training:
    """Sampler, optimizer, scheduler, scaler, EMA and the step runner of ``run``, as cfg.train says."""
    train, info = run.cfg.train, run.info
    if train.accum_steps < 1:
        raise ValueError(f"train.accum_steps must be >= 1, got {train.accum_steps}")
    wrapped = run.model
    if info.distributed:
        wrapped = DistributedDataParallel(run.model, device_ids=[info.device.index] if info.device.type == 'cuda'
                                          else None)
    sampler = ResumableSampler(len(run.train_set), run.cfg.data.batch_size, seed=run.cfg.seed, shuffle=True,
                               rank=info.rank, world_size=info.world_size)
    steps_per_epoch = sampler.batches_per_epoch // train.accum_steps
    if steps_per_epoch < 1:
        raise ConfigError(f"an epoch of the {len(run.train_set)} training samples has {sampler.batches_per_epoch} "
                          f"full batch(es) of data.batch_size={run.cfg.data.batch_size} per process, fewer than "
                          f"train.accum_steps={train.accum_steps}: lower data.batch_size")
    optimizer = create_optimizer_v2(run.model, opt=train.opt, lr=train.lr, weight_decay=train.weight_decay,
                                    layer_decay=train.layer_decay)
    scheduler, _ = create_scheduler_v2(optimizer, sched=train.sched, num_epochs=train.epochs,
                                       warmup_epochs=train.warmup_epochs, warmup_lr=train.warmup_lr,
                                       min_lr=train.min_lr, step_on_epochs=False, updates_per_epoch=steps_per_epoch)
    scaler = torch.amp.GradScaler(info.device.type) if run.amp_dtype == torch.float16 else None
    ema = ModelEmaV3(run.model, decay=train.ema_decay) if train.ema else None
    step = TrainStep(wrapped, run.task.train_loss(), optimizer, compile=train.compile, amp_dtype=run.amp_dtype,
                     grad_scaler=scaler, accum_steps=train.accum_steps, clip_grad=train.clip_grad)
    total_steps = train.epochs * steps_per_epoch
    stop_at = min(total_steps, train.max_steps) if train.max_steps else total_steps
    if info.is_main:
        _warn_small_data(run, steps_per_epoch, total_steps)
    return Training(sampler=sampler, steps_per_epoch=steps_per_epoch, total_steps=total_steps, stop_at=stop_at,
                    optimizer=optimizer, scheduler=scheduler, scaler=scaler, ema=ema, step=step,
                    mixer=run.task.batch_mixer(len(run.class_names)))


#: fewer optimizer steps than this in a whole run rarely learn anything: say so
_FEW_STEPS = 100


def _warn_small_data(run: Run, steps_per_epoch: int, total_steps: int) -> None:
    """Warnings for a plan that a small data set makes useless: too few steps to learn, or to log."""
    cfg = run.cfg
    plan = (f"{len(run.train_set)} training samples make {steps_per_epoch} step(s) per epoch at data.batch_size="
            f"{cfg.data.batch_size}")
    if total_steps < _FEW_STEPS:
        _logger.warning("%s, %d in all over train.epochs=%d: too few to learn much; lower data.batch_size and raise "
                        "train.epochs (docs/training.md: small data sets)", plan, total_steps, cfg.train.epochs)
    if steps_per_epoch < cfg.train.log_every:
        _logger.warning("%s, fewer than train.log_every=%d: a train row is logged at each epoch's end instead; set "
                        "train.log_every=%d for finer curves", plan, cfg.train.log_every,
                        max(1, steps_per_epoch // 4))


def _use_threads(threads: Optional[int], device: torch.device) -> None:
    """Apply ``threads`` (torch's intra-op CPU threads); on CPU, warn when other processes keep cores busy, where
    torch's default of one thread per core makes every step wait for the slowest, shared core."""
    if threads is not None:
        torch.set_num_threads(threads)
    if device.type != 'cpu' or not hasattr(os, 'getloadavg'):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)
    # the 1-minute load counts this process too (about one core while it started up)
    others = max(0.0, os.getloadavg()[0] - 1.0)
    free = max(1, cores - round(others))
    used = torch.get_num_threads()
    _logger.info("CPU: %d torch thread(s) on %d core(s) (threads=%s)", used, cores, threads)
    if used > free:
        _logger.warning("other processes keep about %.0f of the %d cores busy (load average %.1f) and torch uses %d "
                        "threads, which then wait for the busy cores: set threads=%d (or free the cores)",
                        others, cores, os.getloadavg()[0], used, free)


# ---------------------------------------------------------------------------------------------------- run directory

class RunLog:
    """metrics.csv, TensorBoard and the log file of one run; does nothing on ranks other than 0."""

    def __init__(self, out_dir: str, columns: Sequence[str], enabled: bool) -> None:
        self.out_dir = out_dir
        self.columns = list(columns)
        self.enabled = enabled
        self.csv_path = os.path.join(out_dir, 'metrics.csv')
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(out_dir, 'tb'))

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after ``step`` (by a run that crashed after its last checkpoint), before resuming."""
        if not self.enabled or not os.path.exists(self.csv_path):
            return
        with open(self.csv_path, newline='') as f:
            rows = [row for row in csv.DictReader(f) if int(row['step']) <= step]
        with atomic_write(self.csv_path, mode='w') as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows({k: row.get(k, '') for k in self.columns} for row in rows)

    def row(self, values: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        new_file = not os.path.exists(self.csv_path)
        with open(self.csv_path, 'a', newline='') as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction='ignore')
            if new_file:
                writer.writeheader()
            writer.writerow({k: _format_cell(values.get(k)) for k in self.columns})
        for key, value in _scalars(values).items():
            if key not in ('epoch', 'step', 'split'):
                self.writer.add_scalar(f"{values['split']}/{key}", value, values['step'])
        self.writer.flush()

    def picture(self, tag: str, png_path: str, step: int) -> None:
        """Show a PNG the run drew (predictions, confusion matrix) in TensorBoard's images tab."""
        if not self.enabled or not os.path.isfile(png_path):
            return
        from PIL import Image
        with Image.open(png_path) as image:
            pixels = np.asarray(image.convert('RGB'))
        self.writer.add_image(tag, pixels, step, dataformats='HWC')
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _scalars(values: Dict[str, Any], prefix: str = '') -> Dict[str, float]:
    """The finite numbers of ``values``, nested mappings flattened with '/' (per_class_iou/road)."""
    found = {}
    for key, value in values.items():
        if isinstance(value, dict):
            found.update(_scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            found[f"{prefix}{key}"] = value
    return found


def format_metrics(metrics: Dict[str, Any]) -> str:
    """'miou=0.8123, pixel_acc=0.9345, per_class_iou: road 0.9012, car 0.7234' (4 decimals; None: absent)."""
    items = []
    for key, value in metrics.items():
        if isinstance(value, dict):
            items.append(f"{key}: " + ', '.join(f"{name} {_four(v)}" for name, v in value.items()))
        else:
            items.append(f"{key}={_four(value)}")
    return ', '.join(items)


def _four(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _format_cell(value: Any) -> Any:
    if value is None:
        return ''
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def _write_json(path: str, values: Dict[str, Any]) -> None:
    with atomic_write(path, mode='w') as f:
        json.dump(values, f, indent=2)
        f.write('\n')


def _add_file_log(out_dir: str) -> logging.Handler:
    handler = logging.FileHandler(os.path.join(out_dir, 'train.log'))
    handler.setFormatter(logging.Formatter('%(asctime)s %(levelname)s %(name)s: %(message)s'))
    for name in ('linvit', 'timm'):
        logging.getLogger(name).addHandler(handler)
    logging.captureWarnings(True)
    logging.getLogger('py.warnings').addHandler(handler)
    return handler


# ---------------------------------------------------------------------------------------------------- checkpoints

def _checkpoint_state(run: Run, training: Training, progress: Progress) -> Dict[str, Any]:
    return {
        'version': CHECKPOINT_VERSION,
        'config': config_to_yaml(run.cfg),
        'class_names': list(run.class_names),
        'model': run.model.state_dict(),
        'ema': training.ema.module.state_dict() if training.ema is not None else None,
        'optimizer': training.optimizer.state_dict(),
        'scheduler': training.scheduler.state_dict(),
        'scaler': training.scaler.state_dict() if training.scaler is not None else None,
        'progress': {'step': progress.step, 'epoch': progress.epoch, 'batch_in_epoch': progress.batch_in_epoch,
                     'best': progress.best, 'best_step': progress.best_step},
        'rng': capture_rng_state(),
        'world_size': run.info.world_size,
    }


def _restore(run: Run, training: Training, state: Dict[str, Any]) -> Progress:
    """Load a 'last' checkpoint's weights, optimizer, scheduler, scaler, EMA and RNG states; returns its Progress."""
    load_weights(run.model, state['model'], 'the resumed checkpoint', resample_pos_embed=False)
    if training.ema is not None:
        if state.get('ema') is None:
            raise ValueError("the checkpoint has no EMA weights but train.ema=true; resume with train.ema=false")
        training.ema.module.load_state_dict(state['ema'])
    training.optimizer.load_state_dict(state['optimizer'])
    if training.scaler is not None and state.get('scaler') is not None:
        training.scaler.load_state_dict(state['scaler'])
    if state.get('world_size', 1) != run.info.world_size:
        _logger.warning("resuming a run of %d process(es) on %d: the data order differs from here on",
                        state.get('world_size', 1), run.info.world_size)
    restore_rng_state(state['rng'])
    progress = Progress(**state['progress'])
    _schedule_from_config(run, training, state['config'], progress.step)
    return progress


#: the keys that shape the learning-rate schedule
_SCHEDULE_KEYS = ('train.epochs', 'train.sched', 'train.lr', 'train.min_lr', 'train.warmup_epochs',
                  'train.warmup_lr')


def _schedule_from_config(run: Run, training: Training, saved_config: str, step: int) -> None:
    """Set the learning rate of ``step`` from this run's config. The schedule is a function of the step and the
    config, so it is rebuilt rather than restored: a resume with more train.epochs re-plans it over the new length
    instead of training on at the old schedule's final learning rate."""
    before = _learning_rate(training.optimizer)
    training.scheduler.step_update(step)
    changed = differing_keys(run.cfg, OmegaConf.create(config_from_yaml(saved_config)), _SCHEDULE_KEYS)
    if changed and run.info.is_main:
        _logger.info("the learning-rate schedule is re-planned for %s: lr at step %d %.3g -> %.3g",
                     ', '.join(f"{key}={new} (was {old})" for key, new, old in changed), step, before,
                     _learning_rate(training.optimizer))


def _evaluated_model(run: Run, training: Training) -> nn.Module:
    """The weights that are evaluated and exported: the EMA copy when train.ema is on, else the model."""
    return training.ema.module if training.ema is not None else run.model


# ---------------------------------------------------------------------------------------------------- evaluation

def _evaluate(run: Run, model: nn.Module) -> Dict[str, float]:
    """The task's metrics of ``model`` on the validation set, summed over every process (``meter.compute()``)."""
    return _evaluated_meter(run, model).compute()


@torch.no_grad()
def _evaluated_meter(run: Run, model: nn.Module) -> Any:
    """The task's meter after evaluating ``model`` on the validation set, reduced over every process."""
    info = run.info
    loader = _loader(run, run.val_set, ShardSampler(len(run.val_set), info.rank, info.world_size),
                     run.task.eval_batch_size(), drop_last=False)
    meter = run.task.new_meter(info.device)
    was_training = model.training
    model.eval()
    autocast = _autocast_factory(info.device, run.amp_dtype)
    try:
        for images, targets in loader:
            images = images.to(info.device, non_blocking=True)
            targets = targets.to(info.device, non_blocking=True)
            with autocast():
                run.task.evaluate_batch(model, images, targets, meter)
    finally:
        model.train(was_training)
    meter.reduce_()
    return meter


def _save_pictures(run: Run, model: nn.Module, step: int) -> str:
    """Draw the task's prediction picture of ``step`` and the curves so far; returns the picture's path."""
    cfg = run.cfg
    pictures = os.path.join(cfg.output_dir, 'pictures')
    os.makedirs(pictures, exist_ok=True)
    png_path = os.path.join(pictures, f'val_step{step:06d}.png')
    was_training = model.training
    model.eval()
    try:
        run.task.save_pictures(model, run.val_set, run.class_names, png_path, run.mean, run.std, run.info.device,
                               _autocast_factory(run.info.device, run.amp_dtype))
    finally:
        model.train(was_training)
    csv_path = os.path.join(cfg.output_dir, 'metrics.csv')
    if os.path.exists(csv_path):
        plot_curves(csv_path, os.path.join(cfg.output_dir, 'curves.png'), title=f"{cfg.model.name} on {cfg.data.name}")
    return png_path


# ---------------------------------------------------------------------------------------------------- the loop

class _Window:
    """Loss, throughput and data-wait accumulated between two log lines; the loss stays on the device (no sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.micro_batches = 0
        self.images = 0
        self.data_wait = 0.0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, images: int) -> None:
        """One micro-batch: its 0-dim loss and the images it held over all processes."""
        self.loss_sum += loss.double()
        self.micro_batches += 1
        self.images += images


def _first_bad_step(flag: torch.Tensor, loss: torch.Tensor, step: int) -> torch.Tensor:
    """Record the first step whose loss is not finite, on the device (read only at log and checkpoint points)."""
    bad = ~torch.isfinite(loss.detach())
    return torch.where(bad & (flag < 0), torch.full_like(flag, step), flag)


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process so far, in MiB: CUDA tensors on ``device`` (the caching allocator's peak of
    allocated bytes), else the resident set size of the whole process (``ru_maxrss``: model, data and Python)."""
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    import resource
    import sys
    # ru_maxrss is in KiB on Linux and in bytes on macOS
    scale = 2 ** 20 if sys.platform == 'darwin' else 2 ** 10
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def _learning_rate(optimizer: torch.optim.Optimizer) -> float:
    # with layer-wise decay the groups differ; the largest is the configured lr's schedule (the head's group)
    return max(group['lr'] for group in optimizer.param_groups)


def _on_device(dataset: Dataset, batch: Sequence[torch.Tensor], device: torch.device) -> Tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """A loader batch on the device: the dataset's ``on_device`` when it has one (a cached dataset augments the
    batch there), else (images, targets) copied."""
    on_device = getattr(dataset, 'on_device', None)
    if on_device is not None:
        return on_device(batch, device)
    images, targets = batch
    return images.to(device, non_blocking=True), targets.to(device, non_blocking=True)


class TrainingLoop:
    """Epochs of accumulated optimizer steps with logging, checkpoints and evaluations, from ``progress`` (a fresh
    run, or ``resume``'s checkpoint) to ``training.stop_at``; ``fit()`` returns the final evaluation."""

    def __init__(self, run: Run, training: Training, log: RunLog) -> None:
        self.run = run
        self.training = training
        self.log = log
        self.progress = Progress()
        self.state = LoopState(bad_step=torch.full((), -1, dtype=torch.int64, device=run.info.device))

    def resume(self, checkpoint: Dict[str, Any]) -> None:
        """Continue from a 'last' checkpoint of this run: its weights, states and progress; later CSV rows dropped."""
        self.progress = _restore(self.run, self.training, checkpoint)
        self.state.saved_step = self.progress.step
        self.log.truncate_after(self.progress.step)
        if self.run.info.is_main:
            _logger.info("resumed at step %d (epoch %d, batch %d)", self.progress.step, self.progress.epoch,
                         self.progress.batch_in_epoch)

    def fit(self) -> Dict[str, float]:
        """Train to ``stop_at``: a checkpoint after every epoch, an evaluation every train.eval_every epochs and at
        the end; returns the final metrics (what metrics.json holds)."""
        cfg, progress, stop_at = self.run.cfg, self.progress, self.training.stop_at
        while progress.step < stop_at:
            self._run_epoch()
            self._check_finite()
            epoch_done = progress.batch_in_epoch == 0
            improved = False
            if epoch_done and (progress.epoch % cfg.train.eval_every == 0 or progress.step >= stop_at):
                improved = self._evaluate_and_record()
            self._save_last(also_best=improved)
        if self.state.evaluated_step != progress.step and self._evaluate_and_record():
            self._save_last(also_best=True)
        # (a stage of a linearization stops at its own step budget: linvit.engine.linearize continues the run)
        if progress.step < self.training.total_steps and self.run.info.is_main and cfg.linearize.stage == 'all':
            _logger.info("stopped at train.max_steps=%d of %d steps; continue with: train.py --resume %s "
                         "train.max_steps=null", progress.step, self.training.total_steps, cfg.output_dir)
        return self._finish()

    def _run_epoch(self) -> None:
        """Train from progress.batch_in_epoch to the end of the epoch or to step ``stop_at``; updates ``progress``."""
        run, training, progress = self.run, self.training, self.progress
        train, accum = run.cfg.train, training.step.accum_steps
        training.sampler.set_epoch(progress.epoch, progress.batch_in_epoch)
        batches = iter(_loader(run, run.train_set, training.sampler, run.cfg.data.batch_size, drop_last=True))
        window = _Window(run.info.device)
        bar = tqdm(total=training.steps_per_epoch, initial=progress.batch_in_epoch // accum,
                   disable=not run.info.is_main, desc=f"epoch {progress.epoch + 1}/{train.epochs}", unit='step',
                   dynamic_ncols=True, mininterval=2.0)
        training.step.model.train()
        try:
            for micro in range(progress.batch_in_epoch, training.steps_per_epoch * accum):
                images, targets = self._next_batch(batches, window)
                last = (micro + 1) % accum == 0
                loss = training.step.accumulate(images, targets, last=last)
                window.add(loss, images.shape[0] * run.info.world_size)
                self.state.bad_step = _first_bad_step(self.state.bad_step, loss, progress.step + 1)
                if not last:
                    continue
                self._optimizer_step(batch_in_epoch=micro + 1)
                bar.update(1)
                epoch_end = micro + 1 == training.steps_per_epoch * accum
                if progress.step % train.log_every == 0 or progress.step == training.stop_at or epoch_end:
                    self._check_finite()
                    row = self._log_train_row(window)
                    bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", img_s=f"{row['img_per_s']:.1f}")
                    window.reset()
                if train.checkpoint_every and progress.step % train.checkpoint_every == 0:
                    self._check_finite()
                    self._save_last()
                if progress.step >= training.stop_at:
                    break
        finally:
            bar.close()
            del batches  # stops the loader's workers before evaluation starts its own
        if progress.batch_in_epoch == training.steps_per_epoch * accum:
            progress.epoch += 1
            progress.batch_in_epoch = 0

    def _next_batch(self, batches: Iterator, window: _Window) -> Tuple[torch.Tensor, torch.Tensor]:
        """The next training batch on the device, mixed by the task's mixer; the wait for it counts as data wait."""
        device = self.run.info.device
        waited = time.perf_counter()
        batch = next(batches)
        window.data_wait += time.perf_counter() - waited
        images, targets = _on_device(self.run.train_set, batch, device)
        if self.training.mixer is not None:
            images, targets = self.training.mixer(images, targets)
        return images, targets

    def _optimizer_step(self, batch_in_epoch: int) -> None:
        """Apply the accumulated gradients, count the step, and advance the schedule and the EMA."""
        training, progress = self.training, self.progress
        training.step.optimizer_step()
        progress.step += 1
        progress.batch_in_epoch = batch_in_epoch
        training.scheduler.step_update(progress.step)
        if training.ema is not None:
            training.ema.update(self.run.model, step=progress.step)

    def _log_train_row(self, window: _Window) -> Dict[str, Any]:
        """Log the window's mean loss (over all processes), learning rate, throughput and memory as a train row."""
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        loss = all_reduce_mean(window.loss_sum / max(window.micro_batches, 1)).item()
        row = {'epoch': self.progress.epoch, 'step': self.progress.step, 'split': 'train', 'loss': loss,
               'lr': _learning_rate(self.training.optimizer), 'img_per_s': window.images / elapsed,
               'data_wait_frac': window.data_wait / elapsed, 'peak_mem_mib': peak_memory_mib(self.run.info.device)}
        self.log.row(row)
        return row

    def _check_finite(self) -> None:
        """NonFiniteLossError if any process saw a non-finite loss (one host sync)."""
        bad_step = int(all_reduce_max(self.state.bad_step).item())
        if bad_step < 0:
            return
        out_dir, saved_step = self.run.cfg.output_dir, self.state.saved_step
        kept = (f"the last good checkpoint {os.path.join(out_dir, 'last.pt')} (step {saved_step}) is kept"
                if saved_step is not None else "no checkpoint was written by this run")
        raise NonFiniteLossError(f"non-finite training loss at step {bad_step}: the run stopped and {kept}. Lower "
                                 f"train.lr, set train.clip_grad, or use train.precision=bfloat16 instead of float16")

    def _evaluate_and_record(self) -> bool:
        """Evaluate, log a val row, update the best score and draw the pictures; returns whether it improved."""
        run, progress = self.run, self.progress
        model = _evaluated_model(run, self.training)
        meter = _evaluated_meter(run, model)
        metrics = meter.compute()
        named = run.task.final_metrics(metrics)
        self.log.row({'epoch': progress.epoch, 'step': progress.step, 'split': 'val', **named})
        main_metric = run.task.main_metric
        improved = metrics[main_metric] > progress.best
        if improved:
            progress.best, progress.best_step = metrics[main_metric], progress.step
        if run.info.is_main:
            _logger.info("evaluation at step %d (%s): %s; best %s %.4f at step %d%s", progress.step,
                         run.task.describe_evaluation(), format_metrics(named), main_metric, progress.best,
                         progress.best_step, " (best.pt)" if improved else "")
        self._draw(model, meter)
        self.state.evaluated_step, self.state.metrics = progress.step, metrics
        return improved

    def _draw(self, model: nn.Module, meter: Any) -> None:
        """The evaluation's pictures and the curves (rank 0, train.pictures), also sent to TensorBoard."""
        run, step = self.run, self.progress.step
        if not (run.cfg.train.pictures and run.info.is_main):
            return
        pictures = os.path.join(run.cfg.output_dir, 'pictures')
        predictions = _save_pictures(run, model, step)
        self.log.picture('val/predictions', predictions, step)
        summary = os.path.join(pictures, f'{run.task.evaluation_picture}_step{step:06d}.png')
        if run.task.plot_evaluation(meter, run.class_names, summary):
            self.log.picture(f'val/{run.task.evaluation_picture}', summary, step)

    def _save_last(self, also_best: bool = False) -> None:
        """Checkpoint the run as last.pt (and best.pt) on rank 0; every rank waits for it."""
        if self.run.info.is_main:
            state = _checkpoint_state(self.run, self.training, self.progress)
            save_checkpoint(os.path.join(self.run.cfg.output_dir, 'last.pt'), state)
            if also_best:
                save_checkpoint(os.path.join(self.run.cfg.output_dir, 'best.pt'), state)
        barrier()
        self.state.saved_step = self.progress.step

    def _finish(self) -> Dict[str, float]:
        """metrics.json and model.safetensors of the last evaluation (rank 0); returns the final metrics."""
        run = self.run
        final = run.task.final_metrics(self.state.metrics)
        if run.info.is_main:
            _write_json(os.path.join(run.cfg.output_dir, 'metrics.json'), final)
            save_model_safetensors(_evaluated_model(run, self.training),
                                   os.path.join(run.cfg.output_dir, 'model.safetensors'))
            progress = self.progress
            _logger.info("metrics.json and model.safetensors: step %d; best.pt: step %d (%s %.4f)", progress.step,
                         progress.best_step, run.task.main_metric, progress.best)
        return final


def _prepare_run_dir(cfg: DictConfig, info: DistInfo) -> Optional[logging.Handler]:
    if not info.is_main:
        return None
    os.makedirs(cfg.output_dir, exist_ok=True)
    handler = _add_file_log(cfg.output_dir)
    with atomic_write(os.path.join(cfg.output_dir, 'config.yaml'), mode='w') as f:
        f.write(config_to_yaml(cfg))
    return handler


def _finished_metrics(cfg: DictConfig, progress: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The saved final metrics of a resumed run with nothing left to train (its epochs, or train.max_steps, are
    done and metrics.json was written); None when there is training or a final evaluation left."""
    epochs_done = progress['epoch'] >= cfg.train.epochs and progress['batch_in_epoch'] == 0
    budget_done = cfg.train.max_steps is not None and progress['step'] >= cfg.train.max_steps
    path = os.path.join(cfg.output_dir, 'metrics.json')
    if not ((epochs_done or budget_done) and os.path.isfile(path)):
        return None
    with open(path, encoding='utf-8') as f:
        metrics = json.load(f)
    longer = (f"train.epochs={cfg.train.epochs + max(1, cfg.train.epochs // 2)} (the learning-rate schedule is "
              f"re-planned over the new length)" if epochs_done else "train.max_steps=null")
    _logger.info("%s is finished at step %d (train.epochs=%d, train.max_steps=%s): nothing was trained or written; "
                 "to train on: train.py --resume %s %s", cfg.output_dir, progress['step'], cfg.train.epochs,
                 cfg.train.max_steps, cfg.output_dir, longer)
    return metrics


def prepare_new_run(output_dir: str, info: DistInfo, overwrite: bool) -> None:
    """Refuse (or, with ``overwrite``, clear) an output_dir that holds a run, before any process writes to it."""
    found = run_entries_in(output_dir)
    barrier()  # every process has looked before the main one writes
    claim_run_dir(output_dir, found, overwrite, info.is_main)


def train(cfg: DictConfig, resume: Optional[Dict[str, Any]] = None, overwrite: bool = False) -> Dict[str, float]:
    """Train and evaluate as ``cfg`` says; returns the final evaluation (what metrics.json holds).

    resume: the contents of a 'last' checkpoint of this run (``load_checkpoint``): training continues from its step
    with its weights, optimizer, scaler, EMA and RNG states (the learning-rate schedule follows the config, so more
    train.epochs re-plan it); a run with nothing left to train returns its metrics.json and writes nothing.
    Without resume, ``cfg.output_dir`` must not hold a run (RunExistsError) unless ``overwrite``, which deletes that
    run's files first. ``task: linearize`` runs both stages
    (``linvit.engine.linearize``, which calls this function once per stage). ``train.max_steps`` stops the run early
    (resumably: a checkpoint is written, then the final evaluation runs). Raises NonFiniteLossError when the loss
    stops being finite, leaving the last good checkpoint in place.
    """
    if cfg.task == 'linearize' and cfg.linearize.stage == 'all':
        raise ConfigError("task=linearize runs two stages and a report: call linvit.engine.linearize(cfg) (train.py "
                          "does), which runs each stage through train()")
    check_runs_here(cfg)
    info = setup_distributed(cfg.device)
    if resume is None:
        prepare_new_run(cfg.output_dir, info, overwrite)
    else:
        finished = _finished_metrics(cfg, resume['progress'])
        if finished is not None:
            return finished
    _use_threads(cfg.threads, info.device)
    handler = _prepare_run_dir(cfg, info)
    log = None
    try:
        run = _build_run(cfg, info)
        training = _build_training(run)
        _seed_everything(cfg.seed + 1 + info.rank)  # per-rank dropout / drop-path / mixup streams
        log = RunLog(cfg.output_dir, CSV_BASE_COLUMNS + tuple(run.task.metric_columns), info.is_main)
        loop = TrainingLoop(run, training, log)
        if resume is not None:
            loop.resume(resume)
        return loop.fit()
    finally:
        if log is not None:
            log.close()
        if handler is not None:
            for name in ('linvit', 'timm', 'py.warnings'):
                logging.getLogger(name).removeHandler(handler)
            handler.close()


def _load_weights(path: str) -> Dict[str, Any]:
    """{'weights': state_dict, 'class_names': list or None} from a checkpoint .pt (its EMA weights when it has them)
    or a .safetensors file; FileNotFoundError or CheckpointError (one line) for a file that is neither."""
    weights, class_names = read_weights(path)
    return {'weights': weights, 'class_names': class_names}


def evaluate(cfg: DictConfig, weights_path: str, out_dir: str) -> Dict[str, float]:
    """Evaluate saved weights (a linvit checkpoint, its EMA weights when it has them, or a .safetensors file) on the
    validation set of ``cfg``; writes metrics.json (and a picture) into ``out_dir``; returns the metrics.

    A model built for another image size than the weights' gets their position embeddings resampled (as timm's
    checkpoint_filter_fn); weights that do not fit otherwise raise WeightsMismatchError naming the first keys."""
    check_runs_here(cfg)
    info = setup_distributed(cfg.device)
    _use_threads(cfg.threads, info.device)
    loaded = _load_weights(weights_path)
    if loaded['class_names'] is not None and cfg.data.num_classes is None:
        # the class count the weights were trained with: a segmentation folder without classes.txt need not read
        # its train masks to find it
        cfg = OmegaConf.merge(cfg, {'data': {'num_classes': len(loaded['class_names'])}})
    c = _build_run(cfg, info, with_train=False)
    if loaded['class_names'] is not None and list(loaded['class_names']) != list(c.class_names):
        raise DataError(f"{weights_path} was trained on classes {loaded['class_names']} but the validation data has "
                        f"{c.class_names}")
    load_weights(c.model, loaded['weights'], weights_path)
    metrics = c.task.final_metrics(_evaluate(c, c.model))
    if info.is_main:
        os.makedirs(out_dir, exist_ok=True)
        _write_json(os.path.join(out_dir, 'metrics.json'), metrics)
        if cfg.train.pictures:
            c.model.eval()
            c.task.save_pictures(c.model, c.val_set, c.class_names, os.path.join(out_dir, 'val_predictions.png'),
                                 c.mean, c.std, info.device, _autocast_factory(info.device, c.amp_dtype))
    return metrics
