"""Setting a run up from its config, before the loop: the task, its data and model (``Run``), then what training
adds (``Training``: data order, optimizer, schedule, loss scaling, EMA, the step runner), and the two directions
between these and a ``Checkpoint``.

    run = build_run(cfg, info)                         # task, datasets, model on info.device (seeded with cfg.seed)
    training = build_training(run)                     # sampler, optimizer, scheduler, scaler, EMA, TrainStep
    progress = restore(run, training, checkpoint)      # a resumed run: weights, states, RNGs and where it was
    checkpoint = checkpoint_of(run, training, progress)
"""
import contextlib
import logging
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler
from timm.utils import ModelEmaV3
from torch.utils.data import DataLoader, Dataset, Sampler

from ..precision import PRECISIONS
from ..registry import suggestion
from ..timing import cpu_load
from .checkpoint import Checkpoint, Progress, capture_rng_state, restore_rng_state
from .config import ConfigError, config_from_yaml, config_to_yaml, differing_keys
from .distributed import DistInfo
from .parallel import Layout, context_loss, full_weights, load_sharded, parallel_module, plan_layout
from .run_dir import RunDir
from .run_files import load_weights
from .sampler import ResumableSampler
from .step import TrainStep
from .tasks import Task, build_task, normalization_of
from .tasks.base import model_keywords

__all__ = ['Run', 'Training', 'BatchMixer', 'build_run', 'build_training', 'loader', 'batch_on_device', 'use_threads',
           'seed_everything', 'autocast_factory', 'learning_rate', 'evaluated_model', 'restore', 'checkpoint_of',
           'GlobalBatch', 'resumed_batch']

_logger = logging.getLogger('linvit.train')

#: a task's batch mixing: (images, targets) -> (images, targets), e.g. Mixup
BatchMixer = Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
#: fewer optimizer steps than this in a whole run rarely learn anything: say so
_FEW_STEPS = 100
#: the keys that shape the learning-rate schedule
_SCHEDULE_KEYS = ('train.epochs', 'train.sched', 'train.lr', 'train.min_lr', 'train.warmup_epochs',
                  'train.warmup_lr')
_UNEXPECTED_KEYWORD = re.compile(r"unexpected keyword argument '(\w+)'")
_SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[.*?\])\) from "
                            r"checkpoint, the shape in current model is torch\.Size\((\[.*?\])\)\.?")


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
    files: RunDir  # the run folder cfg.output_dir: where each of its files goes


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
    step: TrainStep  # around the model as parallel_module wraps it (context split, checkpointing, DDP / FSDP2)
    mixer: Optional[BatchMixer]  # the task's batch mixing (e.g. Mixup); None: off
    layout: Layout  # the processes: mesh, context group, how gradients are synchronised (cfg.parallel)

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per epoch: steps_per_epoch x train.accum_steps (a last partial step's are not drawn)."""
        return self.steps_per_epoch * self.step.accum_steps


# ---------------------------------------------------------------------------------------------------- the run

def build_run(cfg: DictConfig, info: DistInfo, with_train: bool = True) -> Run:
    """The task, its datasets and its model (seeded with cfg.seed, so every rank starts from the same weights);
    with_train=False (evaluating saved weights) builds no training set (``Run.train_set`` is None)."""
    task = build_task(cfg)
    with _from_cache_if_hub_unreachable(cfg.model):  # the model's config and weights, when the Hub has them
        mean, std = normalization_of(cfg.model.name)
        train_set, val_set, class_names = task.build_datasets(mean, std, with_train)
        if info.is_main:
            if train_set is not None:
                _logger.info("train data: %s", train_set.describe())
            _logger.info("val data: %s", val_set.describe())
            bad = getattr(train_set, 'num_bad', 0) + getattr(val_set, 'num_bad', 0)
            if bad:
                _logger.warning("%d unreadable image file(s) skipped (named in the warnings above)", bad)
        seed_everything(cfg.seed)  # the same initial weights on every rank
        model = _build_model(task, len(class_names)).to(info.device)
    amp_dtype = None if cfg.train.precision == 'float32' else PRECISIONS[cfg.train.precision]
    return Run(cfg=cfg, info=info, task=task, model=model, class_names=class_names, train_set=train_set,
               val_set=val_set, mean=mean, std=std, amp_dtype=amp_dtype, files=RunDir(cfg.output_dir))


def _build_model(task: Task, num_classes: int) -> nn.Module:
    """The task's model; a ValueError of the model's own argument checks, or a keyword the model does not take, is
    a ConfigError (train.py's one line): those come from the config's model.* / task keys, not from a bug."""
    model_cfg = task.cfg.model
    try:
        model = task.build_model(num_classes)
    except ConfigError:
        raise
    except RuntimeError as error:
        weights = _pretrained_weights(model_cfg)
        if not (weights and 'loading state_dict' in str(error)):
            raise
        raise ConfigError(f"{weights} does not fit model.name={model_cfg.name!r} with this config's model.kwargs: "
                          f"{_first_load_errors(str(error))}") from error
    except ValueError as error:
        raise ConfigError(f"cannot build model.name={model_cfg.name!r} from the config: {error}") from error
    except TypeError as error:
        unknown = _UNEXPECTED_KEYWORD.search(str(error))
        if unknown is None:
            raise
        close = suggestion(unknown.group(1), sorted(model_keywords(model_cfg.name)))
        raise ConfigError(f"model.name={model_cfg.name!r} does not take model.kwargs.{unknown.group(1)}"
                          f"{'; ' + close if close else ''} ({error})") from error
    task.check_input_size(model)
    return model


@contextlib.contextmanager
def _from_cache_if_hub_unreachable(model_cfg: DictConfig) -> Iterator[None]:
    """While the block builds a model whose config or weights may come from the Hub (model.pretrained=true, an
    hf-hub: name), ask the Hub once, quickly; if it does not answer, read them from the Hugging Face cache only
    (``linvit.engine.hub.cache_only_if_unreachable``), so that what is missing fails in seconds, in one line, rather
    than after a minute of huggingface_hub's retries."""
    name = str(model_cfg.name)
    if not (model_cfg.pretrained or name.startswith('hf-hub:')) or name.startswith('local-dir:'):
        yield
        return
    from .hub import cache_only_if_unreachable
    with cache_only_if_unreachable(f"the config and weights of model.name={name!r}") as unreachable:
        try:
            yield
        except ConfigError as error:
            if unreachable and 'cannot be loaded' in str(error):  # weights_errors' line for what it could not get
                raise ConfigError(_not_cached_message(name, unreachable)) from error
            raise


def _not_cached_message(model_name: str, unreachable: str) -> str:
    """One line: the Hub does not answer and the weights are not in the cache; what to do."""
    from huggingface_hub import constants
    return (f"model.name={model_name!r}: what it needs from the Hub (config.json, weights) is not in the Hugging Face "
            f"cache ({constants.HF_HUB_CACHE}) and {unreachable}: connect once to fill the cache (then "
            f"HF_HUB_OFFLINE=1 works offline), or use local weights: model.pretrained_file=PATH or "
            f"model.name=local-dir:FOLDER")


def _pretrained_weights(model_cfg: DictConfig) -> str:
    """The config key that loads pretrained weights into the model, as the user set it ('' when none does)."""
    if model_cfg.pretrained_file:
        return f"model.pretrained_file={model_cfg.pretrained_file!r}"
    return "model.pretrained=true (the weights of model.name)" if model_cfg.pretrained else ''


def _first_load_errors(message: str, count: int = 3) -> str:
    """The first problems of torch's load_state_dict error, shortened, on one line: 'pos_embed is [1, 65, 48] in
    the file, [1, 65, 96] in the model; ...'."""
    lines = [line.strip() for line in message.splitlines()[1:] if line.strip()]
    lines = [_SIZE_MISMATCH.sub(r"\1 is \2 in the file, \3 in the model", line) for line in lines]
    more = f" (and {len(lines) - count} more)" if len(lines) > count else ''
    return '; '.join(lines[:count]) + more


def loader(run: Run, dataset: Dataset, sampler: Sampler, batch_size: int, drop_last: bool) -> DataLoader:
    """A DataLoader of ``dataset`` in the sampler's order, with data.num_workers workers."""
    # a private generator: creating a loader iterator draws its worker base seed from it, not from torch's global
    # generator, whose stream (dropout, drop path) must be the same whether or not a run was resumed
    workers = run.cfg.data.num_workers
    # a dataset whose targets do not stack (detection: boxes per image) brings its own collate
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      collate_fn=getattr(dataset, 'collate', None),
                      pin_memory=run.info.device.type == 'cuda', drop_last=drop_last,
                      persistent_workers=False, generator=torch.Generator().manual_seed(run.cfg.seed),
                      prefetch_factor=4 if workers > 0 else None)


def batch_on_device(dataset: Dataset, batch: Sequence[Any], device: torch.device) -> Tuple[torch.Tensor, Any]:
    """A loader batch (images, targets) on the device: the dataset's ``on_device`` when it has one (a cached dataset
    augments the batch there; targets that are not one tensor move their own way), else both copied."""
    on_device = getattr(dataset, 'on_device', None)
    if on_device is not None:
        return on_device(batch, device)
    images, targets = batch
    return images.to(device, non_blocking=True), targets.to(device, non_blocking=True)


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def autocast_factory(run: Run) -> Callable:
    """A function returning the autocast context of train.precision on the run's device (off for float32)."""
    device, dtype = run.info.device, run.amp_dtype
    return lambda: torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None)


def use_threads(threads: Optional[int], device: torch.device) -> None:
    """Apply ``threads`` (torch's intra-op CPU threads); on CPU, warn when other processes keep cores busy, where
    torch's default of one thread per core makes every step wait for the slowest, shared core."""
    if threads is not None:
        torch.set_num_threads(threads)
    load = cpu_load() if device.type == 'cpu' else None
    if load is None:
        return
    used = torch.get_num_threads()
    _logger.info("CPU: %d torch thread(s) on %d core(s) (threads=%s)", used, load.cores, threads)
    if used > load.fair_threads:
        _logger.warning("%s and torch uses %d threads, which then wait for the busy cores: set threads=%d (or free "
                        "the cores)", load.describe(), used, load.fair_threads)


# ---------------------------------------------------------------------------------------------------- training

def build_training(run: Run) -> Training:
    """Sampler, optimizer, scheduler, scaler, EMA and the step runner of ``run``, as cfg.train says."""
    train, info = run.cfg.train, run.info
    if train.accum_steps < 1:
        raise ValueError(f"train.accum_steps must be >= 1, got {train.accum_steps}")
    layout = plan_layout(run.cfg, info, run.model, run.task.logits_rank)
    wrapped = parallel_module(run.model, layout, run.amp_dtype, info.device)
    if info.is_main and info.distributed:
        _logger.info("processes: %s", layout.describe())
    # a context group draws the same batches: the data order follows the data index, not the rank
    sampler = ResumableSampler(len(run.train_set), run.cfg.data.batch_size, seed=run.cfg.seed, shuffle=True,
                               rank=layout.data_rank, world_size=layout.data)
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
    loss = context_loss(run.task.train_loss(), wrapped, layout, run.task.logits_rank, run.cfg.data.ignore_index)
    step = TrainStep(wrapped, loss, optimizer, compile=train.compile, amp_dtype=run.amp_dtype,
                     grad_scaler=scaler, accum_steps=train.accum_steps, clip_grad=train.clip_grad)
    total_steps = train.epochs * steps_per_epoch
    stop_at = min(total_steps, train.max_steps) if train.max_steps else total_steps
    if info.is_main:
        _warn_small_data(run, steps_per_epoch, total_steps)
    return Training(sampler=sampler, steps_per_epoch=steps_per_epoch, total_steps=total_steps, stop_at=stop_at,
                    optimizer=optimizer, scheduler=scheduler, scaler=scaler, ema=ema, step=step,
                    mixer=run.task.batch_mixer(len(run.class_names)), layout=layout)


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


def learning_rate(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate a train row shows."""
    # with layer-wise decay the groups differ; the largest is the configured lr's schedule (the head's group)
    return max(group['lr'] for group in optimizer.param_groups)


def evaluated_model(run: Run, training: Training) -> nn.Module:
    """The weights that are evaluated and exported: the EMA copy when train.ema is on, else the model; a sharded
    model (parallel.fsdp) as a whole copy on every rank (every rank calls this: the shards are gathered)."""
    if training.ema is not None:
        return training.ema.module
    if not training.layout.fsdp:
        return run.model
    device = run.info.device
    with torch.random.fork_rng(devices=[device] if device.type == 'cuda' else []):  # initialising draws nothing from
        whole = _build_model(run.task, len(run.class_names)).to(device)  # the training streams (dropout, drop path)
    whole.load_state_dict(full_weights(run.model))
    return whole


# ---------------------------------------------------------------------------------------------------- checkpoints

def checkpoint_of(run: Run, training: Training, progress: Progress, shards: Optional[str] = None) -> Checkpoint:
    """Everything that continues this run exactly from ``progress``: weights, optimizer, scaler, EMA, RNGs. A
    sharded run's (parallel.fsdp) holds the consolidated weights and names the folder of its model and optimizer
    shards (``shards``, relative to the run folder, written by ``save_sharded``; every rank calls this then, as it
    gathers the weights)."""
    sharded = training.layout.fsdp
    return Checkpoint(
        config=config_to_yaml(run.cfg), class_names=list(run.class_names),
        model=full_weights(run.model) if sharded else run.model.state_dict(),
        progress=Progress(**vars(progress)), optimizer=None if sharded else training.optimizer.state_dict(),
        scheduler=training.scheduler.state_dict(),
        scaler=training.scaler.state_dict() if training.scaler is not None else None,
        ema=training.ema.module.state_dict() if training.ema is not None else None,
        rng=capture_rng_state(), world_size=run.info.world_size, sharded=shards if sharded else None)


def restore(run: Run, training: Training, checkpoint: Checkpoint) -> Progress:
    """Load a 'last' checkpoint's weights, optimizer, scaler, EMA and RNG states; returns where it was. A sharded
    checkpoint's model and optimizer come from its shards, at this run's world size, sharded or not."""
    if checkpoint.sharded:
        load_sharded(run.files.join(checkpoint.sharded), run.model, training.optimizer)
    elif training.layout.fsdp:
        raise ConfigError("this checkpoint was not written by a sharded run (parallel.fsdp=false): resume it with "
                          "parallel.fsdp=false")
    else:
        load_weights(run.model, checkpoint.model, 'the resumed checkpoint', resample_pos_embed=False)
    if training.ema is not None:
        if checkpoint.ema is None:
            raise ValueError("the checkpoint has no EMA weights but train.ema=true; resume with train.ema=false")
        training.ema.module.load_state_dict(checkpoint.ema)
    if not checkpoint.sharded:
        training.optimizer.load_state_dict(checkpoint.optimizer)
    if training.scaler is not None and checkpoint.scaler is not None:
        training.scaler.load_state_dict(checkpoint.scaler)
    saved = _saved_batch(checkpoint)
    now = GlobalBatch(training.layout.data, run.cfg.data.batch_size, training.step.accum_steps)
    saved_steps = (-(-len(run.train_set) // saved.data) // saved.batch_size) // saved.accum_steps
    if run.info.is_main and saved.samples != now.samples:  # each step's samples follow from the global batch alone
        _logger.warning("resuming a run of %s as %s: the data order differs from here on", saved.describe(),
                        now.describe())
    if run.info.is_main and saved_steps != training.steps_per_epoch:
        _logger.warning("resuming a run of %d step(s) per epoch with %d: the learning-rate schedule is re-planned "
                        "over the new steps", saved_steps, training.steps_per_epoch)
    restore_rng_state(checkpoint.rng)
    progress = Progress(**vars(checkpoint.progress))
    # the sampler counts micro-batches: the steps done in this epoch, in this run's micro-batches
    steps_in_epoch = progress.batch_in_epoch // saved.accum_steps
    progress.batch_in_epoch = min(steps_in_epoch * now.accum_steps, training.batches_per_epoch)
    _schedule_from_config(run, training, checkpoint.config, progress.step)
    return progress


@dataclass(frozen=True)
class GlobalBatch:
    """How a run's optimizer step gathers its samples: data processes x data.batch_size x train.accum_steps."""
    data: int  # data-parallel processes (world size / parallel.context)
    batch_size: int  # per process and micro-batch
    accum_steps: int

    @property
    def samples(self) -> int:
        return self.data * self.batch_size * self.accum_steps

    def describe(self) -> str:
        return (f"{self.data} data process(es) x data.batch_size={self.batch_size} x train.accum_steps="
                f"{self.accum_steps} (global batch {self.samples})")


def _saved_batch(checkpoint: Checkpoint) -> GlobalBatch:
    """The global batch of the run that wrote ``checkpoint``, from its config and world size."""
    values = config_from_yaml(checkpoint.config) if checkpoint.config else {}
    data, train = values.get('data') or {}, values.get('train') or {}
    return GlobalBatch(checkpoint.world_size // _saved_context(checkpoint.config), int(data.get('batch_size', 32)),
                       int(train.get('accum_steps', 1)))


def resumed_batch(cfg: DictConfig, checkpoint: Checkpoint, world: int) -> Tuple[GlobalBatch, str]:
    """(the data.batch_size and train.accum_steps a resumed run trains with on ``world`` processes, why).

    A run resumed on another number of data processes keeps its global batch, and with it its steps per epoch,
    learning-rate schedule and the samples of each step (the sampler hands out each step's samples by their place
    in the epoch, whoever draws them): by gradient accumulation (train.accum_steps), else by a smaller per-process
    batch. Set on the command line, data.batch_size or train.accum_steps win (the schedule is then re-planned, as
    the log says). A global batch that no whole numbers keep is a ConfigError giving the commands that do."""
    saved = _saved_batch(checkpoint)
    data = world // max(1, cfg.parallel.context)
    asked = GlobalBatch(data, cfg.data.batch_size, cfg.train.accum_steps)
    if data == saved.data or world % max(1, cfg.parallel.context):  # (a layout that cannot run is refused later)
        return asked, 'the same data processes'
    if (asked.batch_size, asked.accum_steps) != (saved.batch_size, saved.accum_steps):
        return asked, (f"the command line sets data.batch_size / train.accum_steps: {asked.describe()}, the run had "
                       f"{saved.describe()}; the schedule follows the new steps per epoch")
    if saved.samples % (data * saved.batch_size) == 0:
        kept = GlobalBatch(data, saved.batch_size, saved.samples // (data * saved.batch_size))
        return kept, f"keeps the global batch of {saved.describe()} as {kept.describe()}"
    if saved.samples % (data * saved.accum_steps) == 0:
        kept = GlobalBatch(data, saved.samples // (data * saved.accum_steps), saved.accum_steps)
        return kept, f"keeps the global batch of {saved.describe()} as {kept.describe()}"
    processes = saved.data * max(1, cfg.parallel.context)
    launch = f"torchrun --nproc_per_node {processes} " if processes > 1 else ''
    raise ConfigError(f"resuming a run of {saved.describe()} on {data} data process(es): no whole data.batch_size "
                      f"and train.accum_steps keep its global batch; resume it on {processes} process(es) "
                      f"({launch}train.py --resume {cfg.output_dir}), or choose "
                      f"data.batch_size and train.accum_steps on the command line (a new global batch re-plans the "
                      f"schedule)")


def _saved_context(saved_config: Optional[str]) -> int:
    """parallel.context of a checkpoint's config (1 for configs from before it): the processes that shared an image,
    which drew the same batches."""
    values = config_from_yaml(saved_config) if saved_config else {}
    return int((values.get('parallel') or {}).get('context', 1))


def _schedule_from_config(run: Run, training: Training, saved_config: str, step: int) -> None:
    """Set the learning rate of ``step`` from this run's config. The schedule is a function of the step and the
    config, so it is rebuilt rather than restored: a resume with more train.epochs re-plans it over the new length
    instead of training on at the old schedule's final learning rate."""
    before = learning_rate(training.optimizer)
    training.scheduler.step_update(step)
    changed = differing_keys(run.cfg, OmegaConf.create(config_from_yaml(saved_config)), _SCHEDULE_KEYS)
    if changed and run.info.is_main:
        _logger.info("the learning-rate schedule is re-planned for %s: lr at step %d %.3g -> %.3g",
                     ', '.join(f"{key}={new} (was {old})" for key, new, old in changed), step, before,
                     learning_rate(training.optimizer))
