"""No lost work: SIGTERM (a scheduler's, or torchrun's) saves a checkpoint at a step boundary agreed by every process
and ends with the line that continues the run (exit 143); ``torchrun --max-restarts N`` survives the death of a
worker, rank 0's as well as another's, at each of its restarts, and ends where an uninterrupted run ends, with its
metrics. The faults are injected right after the first checkpoint by ``faulty_train.py`` (train.py with a signal to
itself, its agent, or SIGKILL); every run is compared with an uninterrupted run of the same command, never with
itself. The faulted runs are real processes (torchrun and its workers, or one interpreter); the uninterrupted
references and the resumes after a stop run train.py's main in this process, or on forked ranks with the environment
torchrun gives its workers (tests/ranks.py ``run_train_py_ranks``)."""
import csv
import json
import os
import re
import signal
import subprocess
import sys

import pytest
from cli import run_train_py
from ranks import run_train_py_ranks
from session_runs import built_once
from tiny_run import TINY_MODEL, TINY_RUN

from linvit.engine import Checkpoint
from linvit.engine.config import ConfigError, config_to_yaml
from linvit.engine.run import resumed_batch
from linvit.engine.run_dir import RunDir
from linvit.engine.run_files import restart_continues

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTY = os.path.join(ROOT, 'tests', 'engine', 'faulty_train.py')
#: a tiny classification run of 2 epochs x 4 steps (2 processes) or 8 steps (one), a checkpoint every 3 steps
CONFIG = ['--config', 'configs/cls_demo.yaml', *TINY_MODEL, *TINY_RUN, 'train.checkpoint_every=3', 'threads=1']


def _torchrun(*args, restarts=0):
    return ['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', f'--max-restarts={restarts}',
            '--monitor-interval=0.2', *args]


def _run(*args, fault=None, timeout=300):
    env = {**os.environ, 'OMP_NUM_THREADS': '1', **({'FAULT': fault} if fault else {})}
    env.pop('TORCHELASTIC_RESTART_COUNT', None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def _metrics(run_dir):
    return json.loads((run_dir / 'metrics.json').read_text())


def _rows(run_dir):
    """(step, split, loss) of every metrics.csv row, in order."""
    with open(run_dir / 'metrics.csv', newline='') as f:
        return [(int(row['step']), row['split'], float(row['loss'])) for row in csv.DictReader(f)]


def _assert_same_run(got, want):
    """The same rows (no step twice), the same final step and metrics as the uninterrupted run."""
    rows, reference = _rows(got), _rows(want)
    assert [(step, split) for step, split, _ in rows] == [(step, split) for step, split, _ in reference]
    assert [loss for *_, loss in rows] == pytest.approx([loss for *_, loss in reference], rel=1e-4)
    assert Checkpoint.load(got / 'last.pt').progress.step == Checkpoint.load(want / 'last.pt').progress.step
    assert _metrics(got) == pytest.approx(_metrics(want), rel=1e-4)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, worker_id):
    """The reference runs (only read): one process, and two (DDP) with torchrun's environment; trained once per
    session (tests/session_runs.py), however pytest-xdist spreads this module's tests."""
    def build(tmp):
        one = run_train_py(*CONFIG, f'output_dir={tmp / "one"}')
        assert one.returncode == 0, one.stderr[-3000:]
        _assert_finished(run_train_py_ranks(2, *CONFIG, f'output_dir={tmp / "two"}'))

    tmp = built_once(tmp_path_factory, worker_id, 'test_faults', build)
    return {'one': tmp / 'one', 'two': tmp / 'two'}


def _assert_finished(ranks):
    for rank, result in enumerate(ranks):
        assert result.returncode == 0, f"rank {rank}: {result.stderr[-3000:]}"


@pytest.mark.integration
def test_sigterm_on_one_process_saves_its_step_and_resumes_to_the_same_end(uninterrupted, tmp_path):
    run = tmp_path / 'run'
    stopped = _run(FAULTY, *CONFIG, f'output_dir={run}', fault='term:0')
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"train.py: terminated by SIGTERM at step 3: {run}/last.pt holds it; continue with: train.py --resume {run} "
        f"(under torchrun --max-restarts, a restart continues by itself)")
    assert Checkpoint.load(run / 'last.pt').progress.step == 3
    resumed = run_train_py('--resume', str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_run(run, uninterrupted['one'])


@pytest.mark.integration
def test_sigterm_to_torchrun_stops_every_worker_at_one_step_and_the_run_resumes(uninterrupted, tmp_path):
    run = tmp_path / 'run'
    stopped = _run(*_torchrun(FAULTY, *CONFIG, f'output_dir={run}'), fault='term-agent:1')
    assert stopped.returncode != 0
    # the agent forwards its SIGTERM to both workers when it gets to it: a step after the first checkpoint (3)
    steps = re.findall(rf"train\.py: terminated by SIGTERM at step (\d+): {run}/last\.pt holds it", stopped.stderr)
    assert len(steps) == 2 and steps[0] == steps[1] and int(steps[0]) >= 3, stopped.stderr[-3000:]
    assert Checkpoint.load(run / 'last.pt').progress.step == int(steps[0])
    _assert_finished(run_train_py_ranks(2, '--resume', str(run)))  # what torchrun train.py --resume RUN runs
    _assert_same_run(run, uninterrupted['two'])


@pytest.mark.integration
def test_torchrun_restarts_after_a_worker_dies_and_ends_as_an_uninterrupted_run(uninterrupted, tmp_path):
    # one launch, two deaths: rank 0 after the first checkpoint (step 3), then rank 1 in the restarted group after
    # its first (the epoch's end, step 4); each restart continues from the last checkpoint
    run = tmp_path / 'run'
    result = _run(*_torchrun(FAULTY, *CONFIG, f'output_dir={run}', restarts=2), fault='kill:0,kill:1')
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.count('failed (exitcode: -9)') == 2  # each worker did die, the agent restarted the group
    assert 'torchrun restart 1 of launch' in result.stderr and 'resumed at step 3' in result.stderr
    assert 'torchrun restart 2 of launch' in result.stderr and 'resumed at step 4' in result.stderr
    _assert_same_run(run, uninterrupted['two'])


def test_only_a_restart_of_the_launch_that_started_the_run_continues_it(tmp_path, monkeypatch):
    run = tmp_path / 'run'
    run.mkdir()
    (run / RunDir.LAST).write_bytes(b'')
    monkeypatch.delenv('TORCHELASTIC_RESTART_COUNT', raising=False)
    assert restart_continues(str(run)) == (False, 'not a torchrun restart')
    monkeypatch.setenv('TORCHELASTIC_RUN_ID', 'job-a')
    monkeypatch.setenv('TORCHELASTIC_RESTART_COUNT', '1')
    (run / RunDir.LAUNCH).write_text(json.dumps({'launch': 'job-b'}))
    continues, why = restart_continues(str(run))
    assert not continues and "holds the run of another launch (its launch.json names 'job-b'" in why
    (run / RunDir.LAUNCH).write_text(json.dumps({'launch': 'job-a'}))
    assert restart_continues(str(run))[0]
    monkeypatch.setenv('TORCHELASTIC_RESTART_COUNT', '0')  # the first attempt of a launch never continues a run
    assert not restart_continues(str(run))[0]
    os.remove(run / RunDir.LAST)
    monkeypatch.setenv('TORCHELASTIC_RESTART_COUNT', '1')
    assert restart_continues(str(run)) == (False, 'torchrun restart 1: the run stopped before its first checkpoint, '
                                                  'it starts again')


def test_sigterm_outside_the_steps_stops_at_once_and_says_no_checkpoint_was_written(tiny_config, monkeypatch):
    from linvit.engine import trainer
    from linvit.engine.trainer import RunTerminated

    def build_and_terminate(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # during setup: there is no step to save
        raise AssertionError('SIGTERM did not stop the run')

    monkeypatch.setattr(trainer, 'build_run', build_and_terminate)
    cfg = tiny_config()
    with pytest.raises(RunTerminated) as stopped:
        trainer.train(cfg)
    assert str(stopped.value) == (f"terminated by SIGTERM outside the training steps (setup or an evaluation): no "
                                  f"checkpoint was written then; nothing to resume in {cfg.output_dir}; the same "
                                  f"command starts the run again in that folder")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is train's only


@pytest.mark.integration
def test_sigterm_to_one_worker_stops_them_all_and_the_fsdp_run_resumed_on_one_keeps_its_global_batch(uninterrupted,
                                                                                                      tmp_path):
    run = tmp_path / 'run'
    stopped = _run(*_torchrun(FAULTY, *CONFIG, 'parallel.fsdp=true', f'output_dir={run}'), fault='term:1')
    assert stopped.returncode != 0
    # rank 0 got no signal: the all-reduced flag stopped it at the step rank 1 did, after writing last.pt (one
    # all-reduce over the default group, whatever the layout: DDP's stop is the same)
    assert stopped.stderr.count(f"train.py: terminated by SIGTERM at step 3: {run}/last.pt holds it") == 2, \
        stopped.stderr[-3000:]
    assert Checkpoint.load(run / 'last.pt').progress.step == 3
    assert Checkpoint.load(run / 'last.pt').sharded == 'last.dcp/step000003'
    resumed = run_train_py('--resume', str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ('resuming on 1 process(es): keeps the global batch of 2 data process(es) x data.batch_size=8 x '
            'train.accum_steps=1 (global batch 16) as 1 data process(es) x data.batch_size=8 x train.accum_steps=2 '
            '(global batch 16)') in resumed.stderr
    assert 'differs' not in resumed.stderr and 're-planned' not in resumed.stderr
    _assert_same_run(run, uninterrupted['two'])  # FSDP steps equal DDP's (test_parallel)


@pytest.mark.parametrize('saved, world, overrides, kept', [
    ((2, 8, 1), 2, [], (8, 1)),                                        # the same processes: as configured
    ((2, 8, 1), 1, [], (8, 2)),                                        # fewer: accumulation keeps 16
    ((4, 8, 1), 1, [], (8, 4)),
    ((1, 8, 2), 2, [], (8, 1)),                                        # more: less accumulation
    ((1, 8, 1), 2, [], (4, 1)),                                        # more, none to drop: a smaller batch
    ((2, 8, 1), 1, ['data.batch_size=4'], (4, 1)),                     # the command line wins
])
def test_a_resumed_run_keeps_its_global_batch_on_other_processes(tiny_config, saved, world, overrides, kept):
    data, batch, accum = saved
    run_cfg = tiny_config(f'data.batch_size={batch}', f'train.accum_steps={accum}')
    checkpoint = Checkpoint(model={}, config=config_to_yaml(run_cfg), world_size=data)
    cfg = tiny_config(f'data.batch_size={batch}', f'train.accum_steps={accum}', *overrides)
    got, why = resumed_batch(cfg, checkpoint, world)
    assert (got.batch_size, got.accum_steps) == kept, why
    if not overrides:
        assert got.data * got.batch_size * got.accum_steps == data * batch * accum


def test_a_global_batch_no_whole_numbers_keep_is_refused_with_the_command_that_keeps_it(tiny_config):
    run_cfg = tiny_config('data.batch_size=3')
    checkpoint = Checkpoint(model={}, config=config_to_yaml(run_cfg), world_size=1)
    with pytest.raises(ConfigError) as refused:
        resumed_batch(run_cfg, checkpoint, 2)
    assert str(refused.value) == (
        f"resuming a run of 1 data process(es) x data.batch_size=3 x train.accum_steps=1 (global batch 3) on 2 data "
        f"process(es): no whole data.batch_size and train.accum_steps keep its global batch; resume it on 1 "
        f"process(es) (train.py --resume {run_cfg.output_dir}), or choose data.batch_size and train.accum_steps on "
        f"the command line (a new global batch re-plans the schedule)")


@pytest.mark.integration
def test_a_refused_resume_leaves_the_runs_config_yaml_as_it_was(tiny_config):
    from linvit.engine import train

    cfg = tiny_config('train.max_steps=2')
    train(cfg)
    saved = (RunDir(cfg.output_dir).config, RunDir(cfg.output_dir).metrics_csv)
    before = [open(path, encoding='utf-8').read() for path in saved]
    with pytest.raises(ConfigError, match='parallel.context=2 does not divide the 1 process'):
        train(tiny_config('train.max_steps=null', 'parallel.context=2'), resume=True)  # refused by the layout check
    assert [open(path, encoding='utf-8').read() for path in saved] == before
