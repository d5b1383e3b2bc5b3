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
import contextlib
import csv
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
from omegaconf import DictConfig
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from ..fast import TrainStep
from .checkpoint import (
    atomic_write,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    save_model_safetensors,
)
from .config import config_to_yaml
from .distributed import DistInfo, all_reduce_mean, barrier, setup_distributed
from .loading import evaluated_weights
from .sampler import ResumableSampler, ShardSampler
from .tasks import Task, build_task, normalization_of

__all__ = ['train', 'evaluate', 'NonFiniteLossError', 'CSV_BASE_COLUMNS']

_logger = logging.getLogger('linvit.train')

CSV_BASE_COLUMNS = ('epoch', 'step', 'split', 'loss', 'lr', 'img_per_s', 'data_wait_frac', 'peak_mem_mib')
AMP_DTYPES = {'none': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}
CHECKPOINT_VERSION = 1


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the message names the step and the checkpoint that is kept."""


# ---------------------------------------------------------------------------------------------------- run state

@dataclass
class Progress:
    """Where the run is: completed optimizer steps, the epoch, and the batch to start that epoch at."""
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed (a multiple of accum_steps)
    best: float = -math.inf
    best_step: int = -1


@dataclass
class Components:
    """Everything a run builds from its config."""
    task: Task
    info: DistInfo
    model: nn.Module  # the bare model
    wrapped: nn.Module  # what the step runs (DDP around the model when distributed)
    class_names: List[str]
    train_set: Dataset
    val_set: Dataset
    mean: Sequence[float]
    std: Sequence[float]
    amp_dtype: Optional[torch.dtype] = None
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    ema: Any = None
    sampler: Any = None
    steps_per_epoch: int = 0


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def _autocast_factory(device: torch.device, amp_dtype: Optional[torch.dtype]) -> Callable:
    return lambda: torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=amp_dtype is not None)


def _check_amp(amp: str, device: torch.device) -> Optional[torch.dtype]:
    if amp == 'fp16' and device.type != 'cuda':
        raise ValueError(f"train.amp=fp16 needs CUDA (a gradient scaler guards float16 there); on {device.type} use "
                         f"train.amp=bf16")
    return AMP_DTYPES[amp]


def _build_components(cfg: DictConfig, info: DistInfo, for_training: bool) -> Components:
    task = build_task(cfg)
    mean, std = normalization_of(cfg.model.name)
    train_set, val_set, class_names = task.build_datasets(mean, std)
    if info.is_main:
        _logger.info("train data: %s", train_set.describe())
        _logger.info("val data: %s", val_set.describe())
        bad = getattr(train_set, 'num_bad', 0) + getattr(val_set, 'num_bad', 0)
        if bad:
            _logger.warning("%d unreadable image file(s) skipped (named in the warnings above)", bad)
    _seed_everything(cfg.seed)  # the same initial weights on every rank
    model = task.build_model(len(class_names)).to(info.device)
    amp_dtype = _check_amp(cfg.train.amp, info.device)
    wrapped = model
    if info.distributed and for_training:
        wrapped = DistributedDataParallel(model, device_ids=[info.device.index] if info.device.type == 'cuda' else None)
    return Components(task=task, info=info, model=model, wrapped=wrapped, class_names=class_names,
                      train_set=train_set, val_set=val_set, mean=mean, std=std, amp_dtype=amp_dtype)


def _loader(dataset: Dataset, sampler: Any, batch_size: int, cfg: DictConfig, info: DistInfo,
            drop_last: bool) -> DataLoader:
    # a private generator: creating a loader iterator draws its worker base seed from it, not from torch's global
    # generator, whose stream (dropout, drop path) must be the same whether or not a run was resumed
    workers = cfg.data.num_workers
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=info.device.type == 'cuda', drop_last=drop_last,
                      persistent_workers=False, generator=torch.Generator().manual_seed(cfg.seed),
                      prefetch_factor=4 if workers > 0 else None)


def _add_training_parts(cfg: DictConfig, c: Components) -> None:
    train = cfg.train
    if train.accum_steps < 1:
        raise ValueError(f"train.accum_steps must be >= 1, got {train.accum_steps}")
    c.sampler = ResumableSampler(len(c.train_set), cfg.data.batch_size, seed=cfg.seed, shuffle=True,
                                 rank=c.info.rank, world_size=c.info.world_size)
    c.steps_per_epoch = c.sampler.batches_per_epoch // train.accum_steps
    if c.steps_per_epoch < 1:
        raise ValueError(f"an epoch has {c.sampler.batches_per_epoch} batches per process, fewer than "
                         f"train.accum_steps={train.accum_steps}")
    c.optimizer = create_optimizer_v2(c.model, opt=train.opt, lr=train.lr, weight_decay=train.weight_decay,
                                      layer_decay=train.layer_decay)
    c.scheduler, _ = create_scheduler_v2(c.optimizer, sched=train.sched, num_epochs=train.epochs,
                                         warmup_epochs=train.warmup_epochs, warmup_lr=train.warmup_lr,
                                         min_lr=train.min_lr, step_on_epochs=False,
                                         updates_per_epoch=c.steps_per_epoch)
    c.scaler = torch.amp.GradScaler(c.info.device.type) if c.amp_dtype == torch.float16 else None
    c.ema = ModelEmaV3(c.model, decay=train.ema_decay) if train.ema else None


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
        for key, value in values.items():
            if key not in ('epoch', 'step', 'split') and isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(f"{values['split']}/{key}", value, values['step'])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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

def _checkpoint_state(cfg: DictConfig, c: Components, progress: Progress) -> Dict[str, Any]:
    return {
        'version': CHECKPOINT_VERSION,
        'config': config_to_yaml(cfg),
        'class_names': list(c.class_names),
        'model': c.model.state_dict(),
        'ema': c.ema.module.state_dict() if c.ema is not None else None,
        'optimizer': c.optimizer.state_dict(),
        'scheduler': c.scheduler.state_dict(),
        'scaler': c.scaler.state_dict() if c.scaler is not None else None,
        'progress': {'step': progress.step, 'epoch': progress.epoch, 'batch_in_epoch': progress.batch_in_epoch,
                     'best': progress.best, 'best_step': progress.best_step},
        'rng': capture_rng_state(),
        'world_size': c.info.world_size,
    }


def _restore(c: Components, state: Dict[str, Any]) -> Progress:
    c.model.load_state_dict(state['model'])
    if c.ema is not None:
        if state.get('ema') is None:
            raise ValueError("the checkpoint has no EMA weights but train.ema=true; resume with train.ema=false")
        c.ema.module.load_state_dict(state['ema'])
    c.optimizer.load_state_dict(state['optimizer'])
    c.scheduler.load_state_dict(state['scheduler'])
    if c.scaler is not None and state.get('scaler') is not None:
        c.scaler.load_state_dict(state['scaler'])
    if state.get('world_size', 1) != c.info.world_size:
        _logger.warning("resuming a run of %d process(es) on %d: the data order differs from here on",
                        state.get('world_size', 1), c.info.world_size)
    restore_rng_state(state['rng'])
    return Progress(**state['progress'])


def evaluated_model(c: Components) -> nn.Module:
    """The weights that are evaluated and exported: the EMA copy when train.ema is on, else the model."""
    return c.ema.module if c.ema is not None else c.model


# ---------------------------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def _evaluate(cfg: DictConfig, c: Components, model: nn.Module) -> Dict[str, float]:
    loader = _loader(c.val_set, ShardSampler(len(c.val_set), c.info.rank, c.info.world_size),
                     c.task.eval_batch_size(), cfg, c.info,
                     drop_last=False)
    meter = c.task.new_meter(c.info.device)
    was_training = model.training
    model.eval()
    autocast = _autocast_factory(c.info.device, c.amp_dtype)
    try:
        for images, targets in loader:
            images = images.to(c.info.device, non_blocking=True)
            targets = targets.to(c.info.device, non_blocking=True)
            with autocast():
                c.task.evaluate_batch(model, images, targets, meter)
    finally:
        model.train(was_training)
    meter.reduce_()
    return meter.compute()


def _save_pictures(cfg: DictConfig, c: Components, model: nn.Module, step: int) -> None:
    if not (cfg.train.pictures and c.info.is_main):
        return
    from .plots import plot_curves
    pictures = os.path.join(cfg.output_dir, 'pictures')
    os.makedirs(pictures, exist_ok=True)
    was_training = model.training
    model.eval()
    try:
        c.task.save_pictures(model, c.val_set, c.class_names, os.path.join(pictures, f'val_step{step:06d}.png'),
                             c.mean, c.std, c.info.device, _autocast_factory(c.info.device, c.amp_dtype))
    finally:
        model.train(was_training)
    csv_path = os.path.join(cfg.output_dir, 'metrics.csv')
    if os.path.exists(csv_path):
        plot_curves(csv_path, os.path.join(cfg.output_dir, 'curves.png'), title=f"{cfg.model.name} on {cfg.data.name}")


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


def _first_bad_step(flag: torch.Tensor, loss: torch.Tensor, step: int) -> torch.Tensor:
    """Record the first step whose loss is not finite, on the device (read only at log and checkpoint points)."""
    bad = ~torch.isfinite(loss.detach())
    return torch.where(bad & (flag < 0), torch.full_like(flag, step), flag)


def _bad_step_everywhere(flag: torch.Tensor) -> int:
    """The largest recorded bad step over all ranks (-1: every loss was finite). One host sync."""
    import torch.distributed as dist
    flag = flag.clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _check_finite(flag: torch.Tensor, out_dir: str, saved_step: Optional[int]) -> None:
    bad_step = _bad_step_everywhere(flag)
    if bad_step < 0:
        return
    kept = (f"the last good checkpoint {os.path.join(out_dir, 'last.pt')} (step {saved_step}) is kept"
            if saved_step is not None else "no checkpoint was written by this run")
    raise NonFiniteLossError(f"non-finite training loss at step {bad_step}: the run stopped and {kept}. Lower "
                             f"train.lr, set train.clip_grad, or use train.amp=bf16 instead of fp16")


def _optimizer_step(cfg: DictConfig, c: Components) -> None:
    """Unscale (float16), clip, step and clear the gradients of one accumulated step."""
    clip = cfg.train.clip_grad
    if c.scaler is not None:
        if clip:
            c.scaler.unscale_(c.optimizer)
            torch.nn.utils.clip_grad_norm_(c.model.parameters(), clip)
        c.scaler.step(c.optimizer)
        c.scaler.update()
    else:
        if clip:
            torch.nn.utils.clip_grad_norm_(c.model.parameters(), clip)
        c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)


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


def _train_row(window: _Window, progress: Progress, c: Components) -> Dict[str, Any]:
    elapsed = max(time.perf_counter() - window.start, 1e-9)
    loss = all_reduce_mean(window.loss_sum / max(window.micro_batches, 1)).item()
    return {'epoch': progress.epoch, 'step': progress.step, 'split': 'train', 'loss': loss,
            'lr': _learning_rate(c.optimizer), 'img_per_s': window.images / elapsed,
            'data_wait_frac': window.data_wait / elapsed, 'peak_mem_mib': peak_memory_mib(c.info.device)}


def _evaluate_and_record(cfg: DictConfig, c: Components, progress: Progress,
                         log: RunLog) -> Tuple[Dict[str, float], bool]:
    """Evaluate, log a val row, update the best score and draw the pictures; returns (metrics, improved)."""
    model = evaluated_model(c)
    metrics = _evaluate(cfg, c, model)
    log.row({'epoch': progress.epoch, 'step': progress.step, 'split': 'val', **metrics})
    if c.info.is_main:
        _logger.info("evaluation at step %d: %s", progress.step,
                     ', '.join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()))
    main = metrics[c.task.main_metric]
    improved = main > progress.best
    if improved:
        progress.best, progress.best_step = main, progress.step
    _save_pictures(cfg, c, model, progress.step)
    return metrics, improved


def _save_last(cfg: DictConfig, c: Components, progress: Progress, also_best: bool = False) -> None:
    if c.info.is_main:
        state = _checkpoint_state(cfg, c, progress)
        save_checkpoint(os.path.join(cfg.output_dir, 'last.pt'), state)
        if also_best:
            save_checkpoint(os.path.join(cfg.output_dir, 'best.pt'), state)
    barrier()


def _finish(cfg: DictConfig, c: Components, metrics: Dict[str, float]) -> Dict[str, float]:
    final = c.task.final_metrics(metrics)
    if c.info.is_main:
        _write_json(os.path.join(cfg.output_dir, 'metrics.json'), final)
        save_model_safetensors(evaluated_model(c), os.path.join(cfg.output_dir, 'model.safetensors'))
    return final


def _run_epoch(cfg: DictConfig, c: Components, step_fn: TrainStep, mixer: Optional[Callable], progress: Progress,
               log: RunLog, stop_at: int, state: Dict[str, Any]) -> None:
    """Train from progress.batch_in_epoch to the end of the epoch or to step ``stop_at``; updates ``progress``."""
    from tqdm import tqdm

    info, train = c.info, cfg.train
    accum = train.accum_steps
    c.sampler.set_epoch(progress.epoch, progress.batch_in_epoch)
    batches = iter(_loader(c.train_set, c.sampler, cfg.data.batch_size, cfg, info, drop_last=True))
    window = _Window(info.device)
    bar = tqdm(total=c.steps_per_epoch, initial=progress.batch_in_epoch // accum, disable=not info.is_main,
               desc=f"epoch {progress.epoch + 1}/{train.epochs}", unit='step', dynamic_ncols=True,
               mininterval=2.0)
    c.wrapped.train()
    try:
        for micro in range(progress.batch_in_epoch, c.steps_per_epoch * accum):
            waited = time.perf_counter()
            images, targets = next(batches)
            window.data_wait += time.perf_counter() - waited
            images = images.to(info.device, non_blocking=True)
            targets = targets.to(info.device, non_blocking=True)
            if mixer is not None:
                images, targets = mixer(images, targets)
            boundary = (micro + 1) % accum == 0
            no_sync = c.wrapped.no_sync() if info.distributed and not boundary else contextlib.nullcontext()
            with no_sync:
                loss = step_fn.loss(images, targets)
                scaled = loss / accum
                (c.scaler.scale(scaled) if c.scaler is not None else scaled).backward()
            window.loss_sum += loss.detach().double()
            window.micro_batches += 1
            window.images += images.shape[0] * info.world_size
            state['bad_step'] = _first_bad_step(state['bad_step'], loss, progress.step + 1)
            if not boundary:
                continue
            _optimizer_step(cfg, c)
            progress.step += 1
            progress.batch_in_epoch = micro + 1
            c.scheduler.step_update(progress.step)
            if c.ema is not None:
                c.ema.update(c.model, step=progress.step)
            bar.update(1)
            if progress.step % train.log_every == 0 or progress.step == stop_at:
                _check_finite(state['bad_step'], cfg.output_dir, state['saved_step'])
                row = _train_row(window, progress, c)
                log.row(row)
                bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", img_s=f"{row['img_per_s']:.1f}")
                window.reset()
            if train.checkpoint_every and progress.step % train.checkpoint_every == 0:
                _check_finite(state['bad_step'], cfg.output_dir, state['saved_step'])
                _save_last(cfg, c, progress)
                state['saved_step'] = progress.step
            if progress.step >= stop_at:
                break
    finally:
        bar.close()
        del batches  # stops the loader's workers before evaluation starts its own
    if progress.batch_in_epoch == c.steps_per_epoch * accum:
        progress.epoch += 1
        progress.batch_in_epoch = 0


def _prepare_run_dir(cfg: DictConfig, info: DistInfo) -> Optional[logging.Handler]:
    if not info.is_main:
        return None
    os.makedirs(cfg.output_dir, exist_ok=True)
    handler = _add_file_log(cfg.output_dir)
    with atomic_write(os.path.join(cfg.output_dir, 'config.yaml'), mode='w') as f:
        f.write(config_to_yaml(cfg))
    return handler


def train(cfg: DictConfig, resume: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
    """Train and evaluate as ``cfg`` says; returns the final evaluation (what metrics.json holds).

    resume: the contents of a 'last' checkpoint of this run (``load_checkpoint``): training continues from its step
    with its weights, optimizer, scheduler, scaler, EMA and RNG states. ``train.max_steps`` stops the run early
    (resumably: a checkpoint is written, then the final evaluation runs). Raises NonFiniteLossError when the loss
    stops being finite, leaving the last good checkpoint in place.
    """
    info = setup_distributed(cfg.device)
    handler = _prepare_run_dir(cfg, info)
    log = None
    try:
        c = _build_components(cfg, info, for_training=True)
        _add_training_parts(cfg, c)
        _seed_everything(cfg.seed + 1 + info.rank)  # per-rank dropout / drop-path / mixup streams
        progress = Progress()
        log = RunLog(cfg.output_dir, CSV_BASE_COLUMNS + tuple(c.task.metric_columns), info.is_main)
        state: Dict[str, Any] = {'saved_step': None,
                                 'bad_step': torch.full((), -1, dtype=torch.int64, device=info.device)}
        if resume is not None:
            progress = _restore(c, resume)
            state['saved_step'] = progress.step
            log.truncate_after(progress.step)
            if info.is_main:
                _logger.info("resumed at step %d (epoch %d, batch %d)", progress.step, progress.epoch,
                             progress.batch_in_epoch)
        step_fn = TrainStep(c.wrapped, c.task.train_loss(), compile=cfg.train.compile, amp_dtype=c.amp_dtype)
        mixer = c.task.batch_mixer(len(c.class_names))
        total = cfg.train.epochs * c.steps_per_epoch
        stop_at = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
        metrics: Optional[Dict[str, float]] = None
        evaluated_step = -1
        while progress.step < stop_at:
            _run_epoch(cfg, c, step_fn, mixer, progress, log, stop_at, state)
            _check_finite(state['bad_step'], cfg.output_dir, state['saved_step'])
            epoch_done = progress.batch_in_epoch == 0
            improved = False
            if epoch_done and (progress.epoch % cfg.train.eval_every == 0 or progress.step >= stop_at):
                metrics, improved = _evaluate_and_record(cfg, c, progress, log)
                evaluated_step = progress.step
            _save_last(cfg, c, progress, also_best=improved)
            state['saved_step'] = progress.step
        if evaluated_step != progress.step:
            metrics, improved = _evaluate_and_record(cfg, c, progress, log)
            if improved:
                _save_last(cfg, c, progress, also_best=True)
        if progress.step < total and info.is_main:
            _logger.info("stopped at train.max_steps=%d of %d steps; continue with --resume %s", progress.step, total,
                         cfg.output_dir)
        return _finish(cfg, c, metrics)
    finally:
        if log is not None:
            log.close()
        if handler is not None:
            for name in ('linvit', 'timm', 'py.warnings'):
                logging.getLogger(name).removeHandler(handler)
            handler.close()


def _load_weights(path: str) -> Dict[str, Any]:
    """(state_dict, class names or None, saved config text or None) from a checkpoint .pt or a .safetensors file."""
    if path.endswith('.safetensors'):
        from safetensors.torch import load_file
        if not os.path.isfile(path):
            raise FileNotFoundError(f"weights file {path} does not exist")
        return {'weights': load_file(path), 'class_names': None}
    state = load_checkpoint(path)
    if 'model' not in state:
        raise RuntimeError(f"{path} is not a linvit training checkpoint: it has no 'model' entry")
    return {'weights': evaluated_weights(state), 'class_names': state.get('class_names')}


def evaluate(cfg: DictConfig, weights_path: str, out_dir: str) -> Dict[str, float]:
    """Evaluate saved weights (a linvit checkpoint, its EMA weights when it has them, or a .safetensors file) on the
    validation set of ``cfg``; writes metrics.json (and a picture) into ``out_dir``; returns the metrics."""
    info = setup_distributed(cfg.device)
    loaded = _load_weights(weights_path)
    c = _build_components(cfg, info, for_training=False)
    if loaded['class_names'] is not None and list(loaded['class_names']) != list(c.class_names):
        raise ValueError(f"{weights_path} was trained on classes {loaded['class_names']} but the validation data has "
                         f"{c.class_names}")
    c.model.load_state_dict(loaded['weights'])
    metrics = c.task.final_metrics(_evaluate(cfg, c, c.model))
    if info.is_main:
        os.makedirs(out_dir, exist_ok=True)
        _write_json(os.path.join(out_dir, 'metrics.json'), metrics)
        if cfg.train.pictures:
            c.model.eval()
            c.task.save_pictures(c.model, c.val_set, c.class_names, os.path.join(out_dir, 'val_predictions.png'),
                                 c.mean, c.std, info.device, _autocast_factory(info.device, c.amp_dtype))
    return metrics
