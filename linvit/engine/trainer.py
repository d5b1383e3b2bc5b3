"""The training loop, written once for every task: data order, AMP, accumulation, clipping, EMA, the compiled step,
checkpoints, resume, logging, evaluation and pictures, on one process or under torchrun.

    metrics = train(cfg)                        # a new run into cfg.output_dir (cfg: linvit.engine.load_config)
    metrics = train(cfg, resume=True)           # continue the run in cfg.output_dir (its last.pt, or its stages')
    metrics = train(cfg, resume=checkpoint)     # continue from a Checkpoint of this run (Checkpoint.load)

Read from the top: ``train`` asks the task whether it trains in stages (``Task.staged_run``: linearize), and runs
each stage, or the whole run, through ``_train_run``: set the run up (``linvit.engine.run``), then ``fit``, the
loop, in sections: the data, the loss and the step, the schedules, logging, evaluation, checkpoints.

The run directory (``cfg.output_dir``, written by rank 0 only) is laid out as ``linvit.engine.run_dir`` says: the
loop gets it once, as ``Run.files`` (a ``RunDir``), and asks it for each path (``run.files.last``, ...).

Determinism: the seed fixes model init, data order and augmentation (each sample's augmentation is seeded by its
position in the epoch, see ``sampler``); a checkpoint holds the model, optimizer, scaler, EMA, the step and every
RNG, so a resumed run continues on the same trajectory. Evaluation draws nothing from the training RNGs.
"""
import json
import logging
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple, Union

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from ..data import LayoutError
from .checkpoint import Checkpoint, Progress, atomic_write, save_model_safetensors
from .config import ConfigError, check_runs_here, config_to_yaml, load_config
from .distributed import (
    TERMINATION,
    DistInfo,
    SigtermReceived,
    all_reduce_max,
    all_reduce_mean,
    barrier,
    setup_distributed,
)
from .evaluation import evaluated_meter, save_prediction_picture
from .parallel import save_sharded
from .run import (
    Run,
    Training,
    batch_on_device,
    build_run,
    build_training,
    checkpoint_of,
    evaluated_model,
    learning_rate,
    loader,
    restore,
    resumed_batch,
    seed_everything,
    use_threads,
)
from .run_dir import RunDir
from .run_files import claim_run_dir, mark_launch, remove_unstarted_run, run_entries_in, run_results_in
from .run_log import CSV_BASE_COLUMNS, RunLog, TrainWindow, format_metrics, run_directory, write_config, write_json
from .tasks import StagedRun, Task, build_task

__all__ = ['train', 'fit', 'NonFiniteLossError', 'RunInterrupted', 'RunTerminated', 'RunOutcome']

_logger = logging.getLogger('linvit.train')


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the message names the step and the checkpoint that is kept."""


class RunInterrupted(KeyboardInterrupt):
    """Training stopped by Ctrl-C (SIGINT); the one-line message says what is kept and the command that continues."""


class RunTerminated(RunInterrupted):
    """Training stopped by SIGTERM (a scheduler's or torchrun's): at a step boundary with a checkpoint of that step,
    or, where none could be written, saying why; the one-line message says what is kept and how to continue."""


@dataclass(frozen=True)
class RunOutcome:
    """How one run ended."""
    metrics: Dict[str, Any]  # its final evaluation (what metrics.json holds)
    step: int  # optimizer steps done
    planned_steps: int  # train.epochs x steps per epoch
    stopped_early: bool = False  # train.max_steps stopped it before train.epochs (resumably)


def train(cfg: DictConfig, resume: Union[bool, Checkpoint] = False, overwrite: bool = False) -> Dict[str, Any]:
    """Train and evaluate as ``cfg`` says; returns the final evaluation (what metrics.json holds).

    resume: True continues the run in ``cfg.output_dir`` from its last.pt (a task trained in stages: each stage from
    its own; finished stages are kept); a ``Checkpoint`` of the run continues from it. Its weights, optimizer,
    scaler, EMA and RNG states come back; the learning-rate schedule follows the config, so more train.epochs
    re-plan it. A run with nothing left to train returns its metrics.json and writes nothing.
    Without resume, ``cfg.output_dir`` must not hold a run (RunExistsError) unless ``overwrite``, which deletes that
    run's files first. ``train.max_steps`` stops the run early, resumably (a checkpoint is written, then the final
    evaluation runs). Raises NonFiniteLossError when the loss stops being finite, leaving the last good checkpoint.
    """
    check_runs_here(cfg)
    try:
        with TERMINATION.handling():  # SIGTERM: a checkpoint at the next step boundary (fit), then RunTerminated
            staged = build_task(cfg).staged_run()
            if staged is not None:
                return _train_stages(staged, resume=bool(resume), overwrite=overwrite)
            checkpoint = Checkpoint.load(RunDir(cfg.output_dir).last) if resume is True else resume or None
            outcome = _train_run(cfg, checkpoint, overwrite)
    except RunInterrupted:
        raise
    except SigtermReceived as why:
        raise RunTerminated(f"terminated by {why}: no checkpoint was written then; "
                            f"{_interrupted(cfg.output_dir).partition(': ')[2]}") from None
    except KeyboardInterrupt:
        raise RunInterrupted(_interrupted(cfg.output_dir)) from None
    if setup_distributed(cfg.device).is_main:
        if outcome.stopped_early:
            _logger.info("stopped at train.max_steps=%d of %d steps; continue with: train.py --resume %s "
                         "train.max_steps=null", outcome.step, outcome.planned_steps, cfg.output_dir)
        _logger.info("run directory %s: metrics.json, curves.png, pictures/, last.pt, best.pt, model.safetensors, tb/ "
                     "(%s --logdir %s)", cfg.output_dir, _tensorboard_command(), cfg.output_dir)
    return outcome.metrics


def _interrupted(output_dir: str) -> str:
    """What an interrupted run keeps and how to go on, in one line."""
    if run_results_in(output_dir):
        return (f"interrupted: {output_dir} keeps its checkpoints up to the last one written; continue with: "
                f"train.py --resume {output_dir}")
    return (f"interrupted before the first checkpoint: nothing to resume in {output_dir}; the same command starts "
            f"the run again in that folder")


def _tensorboard_command() -> str:
    """The tensorboard of this interpreter's environment (its bin/ is not on PATH unless the venv is active)."""
    here = os.path.join(os.path.dirname(sys.executable), 'tensorboard')
    return os.path.relpath(here) if os.path.isfile(here) else 'tensorboard'


# ---------------------------------------------------------------------------------------------------- a staged task

def _train_stages(staged: StagedRun, resume: bool, overwrite: bool) -> Dict[str, Any]:
    """Train a task's stages one after the other, each a run of its own in its folder (a resumed one continues
    where it stopped; finished ones are kept), then the task's report: metrics.json, its own files, and the last
    stage's weights as the run's model.safetensors. What was measured is kept in <task>.json."""
    cfg, files = staged.config, RunDir(staged.config.output_dir)
    info = setup_distributed(cfg.device)
    created = not os.path.exists(cfg.output_dir)
    if not resume:
        _claim_run_dir(cfg.output_dir, info, overwrite)
    task = build_task(cfg)
    state_path = files.state(task.name)
    with _nothing_left_if_refused(cfg.output_dir, info, created):
        state = _train_each_stage(staged, task, state_path, info, resume)
    report = task.report(state, info.is_main)
    barrier()
    if info.is_main:
        _write_state(state_path, state, info)
        shutil.copyfile(RunDir(staged.stages[-1].config.output_dir).weights, files.weights)
        write_json(files.metrics_json, report)
        task.write_report(cfg.output_dir, report)
        _logger.info("run directory %s: metrics.json (the report), model.safetensors (the final model), %s (each a "
                     "run directory: checkpoints, curves, pictures, tb/)", cfg.output_dir,
                     ', '.join(f"{stage.folder}/" for stage in staged.stages))
    return report


def _train_each_stage(staged: StagedRun, task: Task, state_path: str, info: DistInfo,
                      resume: bool) -> Dict[str, Any]:
    """The staged run's config.yaml, its baselines, then each stage not yet finished; returns the state (what
    ``state_path``, <task>.json, holds: the baselines' metrics and each stage's)."""
    cfg = staged.config
    if info.is_main:
        os.makedirs(cfg.output_dir, exist_ok=True)
        with atomic_write(RunDir(cfg.output_dir).config, mode='w') as f:
            f.write(config_to_yaml(cfg))
    state = _read_state(state_path) if resume else {}
    if 'before' not in state:
        state['before'] = _evaluate_baselines(task, staged.stages[0].config, info)
        _write_state(state_path, state, info)
    for stage in staged.stages:
        if resume and stage.folder in state and _finished(stage.config.output_dir):
            continue
        state[stage.folder] = _train_stage(stage.config, resume)
        _write_state(state_path, state, info)
    return state


def _evaluate_baselines(task: Task, first_stage: DictConfig, info: DistInfo) -> Dict[str, Any]:
    """The metrics of the task's baselines (``Task.baselines``) on the validation set, next to the first stage's
    model as built (before any training), and the class count."""
    run = build_run(first_stage, info)
    baselines = task.baselines(run.task, run.model)
    return {**{name: evaluated_meter(run, model).compute() for name, model in baselines.items()},
            'num_classes': len(run.class_names)}


def _train_stage(stage_cfg: DictConfig, resume: bool) -> Dict[str, Any]:
    """Train one stage (continuing its last.pt when resuming): its metrics, steps and wall time."""
    last = RunDir(stage_cfg.output_dir).last
    checkpoint = Checkpoint.load(last) if resume and os.path.isfile(last) else None
    start = time.perf_counter()
    # the stage folders belong to this run (its own folder was claimed when it started): a stage that stopped before
    # its first checkpoint starts again in its folder
    outcome = _train_run(stage_cfg, checkpoint, overwrite=True)
    # the wall time of the call that finished the stage (an interrupted attempt records nothing)
    return {'metrics': outcome.metrics, 'steps': outcome.step, 'wall_s': time.perf_counter() - start,
            'resumed_from_step': checkpoint.progress.step if checkpoint is not None else 0}


def _finished(run_dir: str) -> bool:
    files = RunDir(run_dir)
    return os.path.isfile(files.metrics_json) and os.path.isfile(files.weights)


def _read_state(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding='utf-8') as f:
        return json.load(f)


def _write_state(path: str, state: Dict[str, Any], info: DistInfo) -> None:
    if info.is_main:
        write_json(path, state)


# ---------------------------------------------------------------------------------------------------- one run

def _train_run(cfg: DictConfig, checkpoint: Optional[Checkpoint], overwrite: bool) -> RunOutcome:
    """One run into cfg.output_dir: claim the folder (a new run) or find the run finished (a resumed one), set the
    run up from its config, and ``fit``."""
    info = setup_distributed(cfg.device)
    created = not os.path.exists(cfg.output_dir)
    if checkpoint is None:
        _claim_run_dir(cfg.output_dir, info, overwrite)
    else:
        finished = _finished_metrics(cfg, checkpoint.progress)
        if finished is not None:
            return RunOutcome(finished, checkpoint.progress.step, checkpoint.progress.step)
        cfg = _with_resumed_batch(cfg, checkpoint, info)
    use_threads(cfg.threads, info.device)
    with _nothing_left_if_refused(cfg.output_dir, info, created), run_directory(cfg, info):
        run = build_run(cfg, info)
        training = build_training(run)
        # per-rank dropout / drop-path / mixup streams; a context group's ranks share one (drop path masks a sample
        # on every rank that holds a part of it)
        seed_everything(cfg.seed + 1 + training.layout.data_rank)
        log = RunLog(run.files, CSV_BASE_COLUMNS + tuple(run.task.metric_columns), info.is_main)
        try:
            progress = Progress() if checkpoint is None else _resume(run, training, log, checkpoint)
            write_config(cfg, info)  # the run is set up: a refused one (resumed too) keeps the config.yaml it found
            return fit(run, training, log, progress)
        finally:
            log.close()


def _with_resumed_batch(cfg: DictConfig, checkpoint: Checkpoint, info: DistInfo) -> DictConfig:
    """``cfg`` with the data.batch_size and train.accum_steps that keep the resumed run's global batch on these
    processes (``resumed_batch``), said in the log when they change."""
    batch, why = resumed_batch(cfg, checkpoint, info.world_size)
    if (batch.batch_size, batch.accum_steps) == (cfg.data.batch_size, cfg.train.accum_steps):
        if info.is_main and why.startswith('the command line'):
            _logger.warning("resuming: %s", why)
        return cfg
    if info.is_main:
        _logger.info("resuming on %d process(es): %s", info.world_size, why)
    return load_config(None, [f'data.batch_size={batch.batch_size}', f'train.accum_steps={batch.accum_steps}'],
                       base=OmegaConf.to_container(cfg))


def _claim_run_dir(output_dir: str, info: DistInfo, overwrite: bool) -> None:
    """Refuse (or, with ``overwrite``, clear) an output_dir that holds a run, before any process writes to it."""
    found, results = run_entries_in(output_dir), run_results_in(output_dir)
    barrier()  # every process has looked before the main one writes
    claim_run_dir(output_dir, found, results, overwrite, info.is_main)
    if info.is_main:
        mark_launch(output_dir)  # under torchrun: its restarts continue this run (commands.start_run)


@contextmanager
def _nothing_left_if_refused(output_dir: str, info: DistInfo, created: bool) -> Iterator[None]:
    """A run refused by a check of its config or data layout (ConfigError, LayoutError) before its first result
    leaves no files behind (config.yaml, an empty train.log), and no folder it ``created`` (looked at before the
    folder was claimed): only the one-line error."""
    try:
        yield
    except (ConfigError, LayoutError):
        if info.is_main:
            remove_unstarted_run(output_dir, created)
        raise


def _finished_metrics(cfg: DictConfig, progress: Progress) -> Optional[Dict[str, Any]]:
    """The saved final metrics of a resumed run with nothing left to train (its epochs, or train.max_steps, are
    done and metrics.json was written); None when there is training or a final evaluation left."""
    epochs_done = progress.epoch >= cfg.train.epochs and progress.batch_in_epoch == 0
    budget_done = cfg.train.max_steps is not None and progress.step >= cfg.train.max_steps
    path = RunDir(cfg.output_dir).metrics_json
    if not ((epochs_done or budget_done) and os.path.isfile(path)):
        return None
    with open(path, encoding='utf-8') as f:
        metrics = json.load(f)
    longer = (f"train.epochs={cfg.train.epochs + max(1, cfg.train.epochs // 2)} (the learning-rate schedule is "
              f"re-planned over the new length)" if epochs_done else "train.max_steps=null")
    _logger.info("%s is finished at step %d (train.epochs=%d, train.max_steps=%s): nothing was trained or written; "
                 "to train on: train.py --resume %s %s", cfg.output_dir, progress.step, cfg.train.epochs,
                 cfg.train.max_steps, cfg.output_dir, longer)
    return metrics


def _resume(run: Run, training: Training, log: RunLog, checkpoint: Checkpoint) -> Progress:
    """Continue from a 'last' checkpoint of this run: its weights, states and progress; later CSV rows dropped."""
    progress = restore(run, training, checkpoint)
    log.truncate_after(progress.step)
    if run.info.is_main:
        _logger.info("resumed at step %d (epoch %d, batch %d)", progress.step, progress.epoch,
                     progress.batch_in_epoch)
    return progress


# ---------------------------------------------------------------------------------------------------- the loop

def fit(run: Run, training: Training, log: RunLog, progress: Progress) -> RunOutcome:
    """Train from ``progress`` (a new run's, or a resumed one's) to ``training.stop_at``: a train row every
    train.log_every steps, a checkpoint every train.checkpoint_every steps and after every epoch, an evaluation
    every train.eval_every epochs and at the end. Returns the outcome, with the final evaluation."""
    watch = _LossWatch(run.info.device, run.files.last, saved_step=progress.step or None)
    with TERMINATION.deferred():  # SIGTERM from here on: agreed at a step boundary, a checkpoint, RunTerminated
        metrics, evaluated_step = _steps(run, training, log, progress, watch)
    if evaluated_step != progress.step:
        metrics, improved = _evaluate_and_record(run, training, log, progress)
        if improved:
            _save_checkpoint(run, training, progress, also_best=True)
    final = _finish(run, training, progress, metrics)
    return RunOutcome(final, progress.step, training.total_steps, stopped_early=progress.step < training.total_steps)


def _steps(run: Run, training: Training, log: RunLog, progress: Progress,
           watch: '_LossWatch') -> Tuple[Optional[Dict[str, Any]], int]:
    """The epochs of ``fit`` up to ``training.stop_at``; returns the last evaluation's metrics and its step (None,
    -1 when none ran)."""
    cfg, info, every = run.cfg, run.info, run.cfg.train
    evaluated_step, metrics = -1, None
    while progress.step < training.stop_at:
        # ------------------------------------------------------------ data: this epoch, from where it stopped
        training.sampler.set_epoch(progress.epoch, progress.batch_in_epoch)
        batches = iter(loader(run, run.train_set, training.sampler, cfg.data.batch_size, drop_last=True))
        window = TrainWindow(info.device)
        bar = tqdm(total=training.steps_per_epoch, initial=progress.batch_in_epoch // training.step.accum_steps,
                   disable=not info.is_main, desc=f"epoch {progress.epoch + 1}/{every.epochs}", unit='step',
                   dynamic_ncols=True, mininterval=2.0)
        training.step.model.train()
        try:
            for index in range(progress.batch_in_epoch, training.batches_per_epoch):  # micro-batches
                images, targets = _next_batch(run, training, batches, window)
                # ---------------------------------------------------- loss and step (every accum_steps batches)
                steps_now = (index + 1) % training.step.accum_steps == 0
                loss = training.step.accumulate(images, targets, last=steps_now)
                window.add(loss, images.shape[0] * info.world_size)
                watch.record(loss, progress.step + 1)
                if not steps_now:
                    continue
                training.step.optimizer_step()
                progress.step += 1
                progress.batch_in_epoch = index + 1  # the epoch turns over below, once its rows are logged
                bar.update(1)
                # ---------------------------------------------------- schedules: the lr and the EMA follow the step
                training.scheduler.step_update(progress.step)
                if training.ema is not None:
                    training.ema.update(run.model, step=progress.step)
                # ---------------------------------------------------- logging (and at each epoch's end)
                epoch_end = progress.batch_in_epoch == training.batches_per_epoch
                if progress.step % every.log_every == 0 or progress.step == training.stop_at or epoch_end:
                    watch.raise_if_diverged()
                    row = _log_train_row(run, training, log, window, progress)
                    bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", img_s=f"{row['img_per_s']:.1f}")
                    window.reset()
                # ---------------------------------------------------- a checkpoint inside the epoch
                if every.checkpoint_every and progress.step % every.checkpoint_every == 0:
                    watch.raise_if_diverged()
                    _save_checkpoint(run, training, progress)
                    watch.saved_step = progress.step
                # ---------------------------------------------------- SIGTERM: every process stops at this step
                if TERMINATION.agreed():
                    _stop_terminated(run, training, progress, watch)
                if progress.step >= training.stop_at:
                    break
        finally:
            bar.close()
            del batches  # stops the loader's workers before evaluation starts its own
        # ------------------------------------------------------------ the epoch ends with its last batch
        if progress.batch_in_epoch == training.batches_per_epoch:
            progress.epoch += 1
            progress.batch_in_epoch = 0
        watch.raise_if_diverged()
        # ------------------------------------------------------------ evaluation: every eval_every epochs, the end
        improved = False
        epoch_done = progress.batch_in_epoch == 0
        if epoch_done and (progress.epoch % every.eval_every == 0 or progress.step >= training.stop_at):
            metrics, improved = _evaluate_and_record(run, training, log, progress)
            evaluated_step = progress.step
        # ------------------------------------------------------------ the checkpoint of the epoch (or the stop)
        _save_checkpoint(run, training, progress, also_best=improved)
        watch.saved_step = progress.step
        if TERMINATION.agreed():  # a SIGTERM during the evaluation: this checkpoint is the one to continue from
            _stop_terminated(run, training, progress, watch)
    return metrics, evaluated_step


def _stop_terminated(run: Run, training: Training, progress: Progress, watch: '_LossWatch') -> None:
    """Every process agreed to stop for SIGTERM at this step: checkpoint it (unless it just was), then
    RunTerminated with the line that continues the run."""
    watch.raise_if_diverged()  # a diverged run keeps its last good checkpoint instead
    if watch.saved_step != progress.step:
        _save_checkpoint(run, training, progress)
    folder = run.cfg.output_dir
    raise RunTerminated(f"terminated by SIGTERM at step {progress.step}: {run.files.last} holds it; continue with: "
                        f"train.py --resume {folder} (under torchrun --max-restarts, a restart continues by itself)")


class _LossWatch:
    """The first step whose training loss was not finite, kept on the device (no host sync per step) and checked
    at log and checkpoint points (one all-reduce over the processes)."""

    def __init__(self, device: torch.device, checkpoint_path: str, saved_step: Optional[int]) -> None:
        self.bad_step = torch.full((), -1, dtype=torch.int64, device=device)  # int64 []: -1 while every loss was
        self.checkpoint_path = checkpoint_path  # the run's last.pt
        self.saved_step = saved_step  # the step of this run's last checkpoint, None before the first

    def record(self, loss: torch.Tensor, step: int) -> None:
        bad = ~torch.isfinite(loss.detach())
        self.bad_step = torch.where(bad & (self.bad_step < 0), torch.full_like(self.bad_step, step), self.bad_step)

    def raise_if_diverged(self) -> None:
        """NonFiniteLossError if any process saw a non-finite loss, naming the step and the checkpoint kept."""
        bad_step = int(all_reduce_max(self.bad_step).item())
        if bad_step < 0:
            return
        kept = (f"the last good checkpoint {self.checkpoint_path} (step {self.saved_step}) is kept"
                if self.saved_step is not None else "no checkpoint was written by this run")
        raise NonFiniteLossError(f"non-finite training loss at step {bad_step}: the run stopped and {kept}. Lower "
                                 f"train.lr, set train.clip_grad, or use train.precision=bfloat16 instead of float16")


def _next_batch(run: Run, training: Training, batches: Iterator,
                window: TrainWindow) -> Tuple[torch.Tensor, torch.Tensor]:
    """The next training batch on the device, mixed by the task's mixer; the wait for it counts as data wait."""
    waited = time.perf_counter()
    batch = next(batches)
    window.data_wait += time.perf_counter() - waited
    images, targets = batch_on_device(run.train_set, batch, run.info.device)
    if training.mixer is not None:
        images, targets = training.mixer(images, targets)
    return images, targets


def _log_train_row(run: Run, training: Training, log: RunLog, window: TrainWindow,
                   progress: Progress) -> Dict[str, Any]:
    """Log the window's mean loss (over all processes), learning rate, throughput and memory as a train row."""
    rates = window.rates(run.info.device)
    row = {'epoch': progress.epoch, 'step': progress.step, 'split': 'train',
           'loss': all_reduce_mean(window.mean_loss()).item(), 'lr': learning_rate(training.optimizer), **rates}
    log.row(row)
    return row


def _evaluate_and_record(run: Run, training: Training, log: RunLog,
                         progress: Progress) -> Tuple[Dict[str, Any], bool]:
    """Evaluate, log a val row, update the best score and draw the pictures; returns (the meter's metrics, whether
    they improved on the best)."""
    model = evaluated_model(run, training)
    meter = evaluated_meter(run, model)
    metrics = meter.compute()
    named = run.task.final_metrics(metrics)
    log.row({'epoch': progress.epoch, 'step': progress.step, 'split': 'val', **named})
    main_metric = run.task.main_metric
    improved = metrics[main_metric] > progress.best
    if improved:
        progress.best, progress.best_step = metrics[main_metric], progress.step
    if not run.info.is_main:
        return metrics, improved
    _logger.info("evaluation at step %d (%s): %s; best %s %.4f at step %d%s", progress.step,
                 run.task.describe_evaluation(), format_metrics(named), main_metric, progress.best,
                 progress.best_step, " (best.pt)" if improved else "")
    if run.cfg.train.pictures:
        _draw(run, log, model, meter, progress.step)
    return metrics, improved


def _draw(run: Run, log: RunLog, model: nn.Module, meter: Any, step: int) -> None:
    """The evaluation's pictures and the curves, also sent to TensorBoard (rank 0)."""
    log.picture('val/predictions', save_prediction_picture(run, model, step), step)
    summary = run.files.picture(run.task.evaluation_picture, step)
    if run.task.plot_evaluation(meter, run.class_names, summary):
        log.picture(f'val/{run.task.evaluation_picture}', summary, step)


def _save_checkpoint(run: Run, training: Training, progress: Progress, also_best: bool = False) -> None:
    """Checkpoint the run as last.pt (and best.pt) on rank 0; every rank waits for it.

    A sharded run's ranks first write their model and optimizer shards into a folder of this step
    (last.dcp/stepNNNNNN), which last.pt then names; the older step folders go once last.pt is written, so a crash
    at any moment leaves a last.pt whose shards are whole."""
    shards = None
    if training.layout.fsdp:
        shards = os.path.join(RunDir.LAST_SHARDS, f'step{progress.step:06d}')
        if not os.path.isfile(os.path.join(run.files.join(shards), '.metadata')):  # this step's are written already
            save_sharded(run.files.join(shards), run.model, training.optimizer)
    checkpoint = checkpoint_of(run, training, progress, shards) if run.info.is_main or shards else None
    if run.info.is_main:
        checkpoint.save(run.files.last)
        if also_best:
            checkpoint.save(run.files.best)
        if shards:
            _remove_older_shards(run.files.last_shards, os.path.basename(shards))
    barrier()


def _remove_older_shards(folder: str, keep: str) -> None:
    """Delete the step folders in ``folder`` (last.dcp/) other than ``keep``: last.pt no longer names them."""
    for name in os.listdir(folder):
        if name != keep:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def _finish(run: Run, training: Training, progress: Progress, metrics: Dict[str, Any]) -> Dict[str, Any]:
    """metrics.json and model.safetensors of the last evaluation (rank 0); returns the final metrics."""
    final = run.task.final_metrics(metrics)
    model = evaluated_model(run, training)  # every rank: a sharded model is gathered
    if run.info.is_main:
        write_json(run.files.metrics_json, final)
        save_model_safetensors(model, run.files.weights)
        _logger.info("metrics.json and model.safetensors: step %d; best.pt: step %d (%s %.4f)", progress.step,
                     progress.best_step, run.task.main_metric, progress.best)
    return final
