"""train.py as users run it: config errors, a run, --resume, --eval-only, torchrun with 2 gloo processes, and the
process group ended with the run."""
import importlib.util
import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist
from cli import run_train_py
from tiny_run import TINY_MODEL, TINY_RUN

pytestmark = pytest.mark.integration  # trains or starts interpreters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [*TINY_MODEL, *TINY_RUN]


def _run(*args, env=None, timeout=600):
    full_env = {**os.environ, 'OMP_NUM_THREADS': '1', **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def _metrics(path):
    with open(path) as f:
        return json.load(f)


def test_config_typo_exits_2_with_the_suggestion(tmp_path):
    result = run_train_py('--config', 'configs/cls_demo.yaml', 'train.epoch=3', f'output_dir={tmp_path}')
    assert result.returncode == 2
    assert "unknown config key 'train.epoch'; did you mean 'train.epochs'?" in result.stderr
    assert not os.listdir(tmp_path)  # nothing was started


def test_run_stop_resume_and_eval_only_from_the_command_line(tmp_path):
    run = tmp_path / 'run'
    first = run_train_py('--config', 'configs/cls_demo.yaml', *TINY, f'output_dir={run}', 'train.max_steps=3')
    assert first.returncode == 0, first.stderr[-3000:]
    assert f'continue with: train.py --resume {run} train.max_steps=null' in first.stderr
    resumed = run_train_py('--resume', str(run), 'train.max_steps=null')  # the command the stop printed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert 'resumed at step 3' in resumed.stderr
    final = _metrics(run / 'metrics.json')
    assert f"top1={final['top1']:.4f}" in resumed.stdout
    evaluated = run_train_py('--eval-only', str(run / 'best.pt'), '--out', str(tmp_path / 'eval'))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert set(_metrics(tmp_path / 'eval' / 'metrics.json')) == {'top1', 'top5', 'loss', 'count'}


def test_torchrun_two_gloo_processes_match_a_single_process_evaluation(tmp_path):
    """torchrun itself, 2 train.py workers meeting in its store, trains one run whose evaluation counts each image
    once and equals one process's (the real launch: test_parallel's forked ranks get its environment without it)."""
    run = tmp_path / 'ddp'
    result = _run('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2', 'train.py',
                  '--config', 'configs/cls_demo.yaml', *TINY, 'data.synthetic.val_size=23', f'output_dir={run}')
    assert result.returncode == 0, result.stderr[-4000:]
    ddp = _metrics(run / 'metrics.json')
    assert ddp['count'] == 23  # the odd sample is counted once: evaluation shards are not padded
    single = run_train_py('--eval-only', str(run / 'last.pt'), '--out', str(tmp_path / 'single'))
    assert single.returncode == 0, single.stderr[-3000:]
    assert _metrics(tmp_path / 'single' / 'metrics.json') == pytest.approx(ddp, rel=1e-6)
    # 2 processes x 4 steps per epoch (64 samples / 2 ranks / batch 8) x 2 epochs
    with open(run / 'metrics.csv') as f:
        assert [line.split(',')[1] for line in f.read().splitlines()[1:] if ',train,' in line] == \
            [str(s) for s in range(1, 9)]


def test_train_py_parses_and_calls_the_engine():
    """train.py stays a command line (parse, call, one line per expected error): the rest is linvit.engine's."""
    with open(os.path.join(ROOT, 'train.py')) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 120, f"train.py has {len(lines)} lines: move library logic into linvit.engine"


def _train_py():
    """train.py loaded as a module, to call its main() in this process."""
    spec = importlib.util.spec_from_file_location('train', os.path.join(ROOT, 'train.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize('outcome, status', [('done', 0), ('config error', 2), ('interrupted', 130)])
def test_train_py_ends_the_process_group_with_the_run_whatever_the_outcome(tmp_path, monkeypatch, outcome, status):
    train_py = _train_py()
    if outcome == 'done':
        monkeypatch.setattr(train_py, 'start_run', lambda *args, **kwargs: {'top1': 1.0})
    elif outcome == 'interrupted':
        monkeypatch.setattr(train_py, 'start_run', _interrupted)
    argv = ['--config', 'configs/cls_demo.yaml', f'output_dir={tmp_path / "run"}']
    if outcome == 'config error':
        argv.append('train.epoch=3')
    # the group torchrun's processes have (one gloo rank here)
    dist.init_process_group('gloo', init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        monkeypatch.chdir(ROOT)
        assert train_py.main(argv) == status
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
