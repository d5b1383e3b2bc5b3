"""train.py as a new user meets it (issue 41): run folders that are never mixed, one line and exit 2 for every expected
mistake, warnings for plans that small data sets make useless, resume that does what it says, readable logs."""
import csv
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from cli import load_tool, run_train_py
from PIL import Image
from tiny_run import TINY_MODEL, TINY_RUN, TINY_SEG

pytestmark = pytest.mark.integration  # trains or starts interpreters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [*TINY_MODEL, *TINY_RUN]
CLS = ['--config', 'configs/cls_demo.yaml', *TINY]
SEG = ['--config', 'configs/seg_demo.yaml', *TINY_MODEL, *TINY_SEG]


def _run(*args):
    """train.py ARGS as a user runs it (in this process: tests/cli.py)."""
    return run_train_py(*args)


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _one_config_error(result, *phrases):
    """The run ended with exit 2 and exactly one line on stderr (no traceback) holding every phrase."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith('train.py: config error: ')]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors) == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
    for phrase in phrases:
        assert phrase in errors[0], errors[0]
    return errors[0]


def _contents(folder):
    """{relative path: sha256} of every file under ``folder``."""
    found = {}
    for here, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(here, name)
            with open(path, 'rb') as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def _csv_rows(run):
    with open(os.path.join(run, 'metrics.csv'), newline='') as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A finished tiny classification run (2 epochs of 8 steps) and its untouched file contents."""
    run = str(tmp_path_factory.mktemp('first_hour') / 'run')
    _ok(_run(*CLS, 'train.pictures=true', f'output_dir={run}'))
    return run, _contents(run)


# ---------------------------------------------------------------------------------------------------- run folders

def test_a_second_run_into_a_run_folder_is_refused_and_the_first_is_untouched(trained):
    run, before = trained
    result = _run(*CLS, f'output_dir={run}')
    _one_config_error(result, f'{run} already holds a run', f'--resume {run}', f'output_dir={run}_2', '--overwrite')
    assert _contents(run) == before


def test_overwrite_replaces_the_run_without_mixing(tmp_path, trained, capsys):
    run = str(tmp_path / 'run')
    shutil.copytree(trained[0], run)
    open(os.path.join(run, 'notes.txt'), 'w').write('mine')
    _ok(_run('--eval-only', run))  # -> run/eval_model/
    assert load_tool('export_onnx').main([run]) == 0 and os.path.isfile(os.path.join(run, 'model.onnx'))
    replaced = _ok(_run(*CLS, 'train.epochs=1', f'output_dir={run}', '--overwrite'))
    assert 'model.onnx, eval_model' in replaced.stderr  # the log names what went with the replaced run
    rows = [row for row in _csv_rows(run) if row['split'] == 'train']
    assert [int(row['step']) for row in rows] == list(range(1, 9))  # one run's steps, once
    assert not os.path.exists(os.path.join(run, 'pictures'))  # the replaced run's pictures went with it
    assert len(os.listdir(os.path.join(run, 'tb'))) == 1
    assert open(os.path.join(run, 'notes.txt')).read() == 'mine'
    # the replaced run's export and evaluation describe weights that are gone: they went with them
    assert not os.path.exists(os.path.join(run, 'eval_model'))
    _save_png(str(tmp_path / 'images' / 'a.png'), np.zeros((32, 32, 3), dtype=np.uint8))
    capsys.readouterr()
    status = load_tool('predict').main([os.path.join(run, 'model.onnx'), str(tmp_path / 'images'), '--out',
                                        str(tmp_path / 'p.csv')])
    said = capsys.readouterr().err
    assert status != 0 and 'Traceback' not in said and 'model.onnx' in said
    assert not os.path.exists(tmp_path / 'p.csv')


def test_an_export_or_evaluation_alone_makes_a_folder_hold_a_run(tmp_path):
    from linvit.engine.run_files import run_results_in
    (tmp_path / 'eval_best').mkdir()
    (tmp_path / 'stage1').mkdir()
    (tmp_path / 'stage1' / 'train.log').write_text('')
    assert run_results_in(str(tmp_path)) == ['eval_best']
    (tmp_path / 'model.onnx').write_text('')
    (tmp_path / 'stage1' / 'last.pt').write_text('')
    assert run_results_in(str(tmp_path)) == ['model.onnx', 'eval_best', 'stage1']


def test_a_folder_left_by_a_run_that_stopped_before_its_first_checkpoint_is_reused(tmp_path):
    run = str(tmp_path / 'run')
    failed = _run(*CLS, 'data.img_size=36', f'output_dir={run}')  # refused once the model is built
    assert failed.returncode == 2
    _ok(_run(*CLS, 'train.epochs=1', 'train.max_steps=1', f'output_dir={run}'))
    assert [row['step'] for row in _csv_rows(run)] == ['1', '1']


# ---------------------------------------------------------------------------------------------------- mistakes

@pytest.mark.parametrize('overrides, phrases', [
    (['device=gpu'], ["device='gpu' is not a device", 'use auto, cpu, cuda or cuda:N']),
    (['device=cuda:99'], ["device='cuda:99'"]),
    (['device=cpu', 'train.precision=float16'], ['train.precision=float16 needs CUDA', 'bfloat16']),
    (['model.kwargs.pretrained=true'], ['model.kwargs.pretrained', 'model.pretrained_file=PATH']),
    (['data.img_size=36'], ['data.img_size=36 is not a multiple of the patch size 8', 'use 32 or 40']),
    (['data.batch_size=100'], ['64 samples', 'data.batch_size=100', 'lower data.batch_size']),
    (['threads=0'], ['threads=0 must be >= 1']),
    (['model.name=linvit_tiny'], ["model.name='linvit_tiny' is not a timm model", "'linvit_tiny_patch16_224'"]),
    (['model.kwargs.dept=2'], ["does not take model.kwargs.dept; did you mean 'depth'?"]),
])
def test_an_expected_mistake_is_one_line_and_exit_2(tmp_path, overrides, phrases):
    _one_config_error(_run(*CLS, *overrides, f'output_dir={tmp_path / "run"}'), *phrases)
    assert not os.path.exists(tmp_path / 'run')  # refused: no config.yaml, no empty train.log, no folder


def test_a_refused_run_keeps_a_folder_it_did_not_create_and_the_files_it_did_not_write(tmp_path):
    run = tmp_path / 'run'
    run.mkdir()
    (run / 'notes.txt').write_text('mine')
    _one_config_error(_run(*CLS, 'data.batch_size=100', f'output_dir={run}'), 'lower data.batch_size')
    assert os.listdir(run) == ['notes.txt']


def test_ctrl_c_is_one_line_with_the_command_that_continues(tmp_path):
    run = tmp_path / 'run'
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    # a terminal's Ctrl-C: Python turns SIGINT into KeyboardInterrupt only when it starts with SIGINT not ignored,
    # and a suite started in the background by a non-interactive shell (`make test &`) passes SIGINT ignored on
    process = subprocess.Popen([sys.executable, 'train.py', *CLS, 'train.epochs=100', f'output_dir={run}'], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        waited = 0.0
        while not (run / 'last.pt').exists() and process.poll() is None and waited < 300:
            time.sleep(0.2)
            waited += 0.2
        process.send_signal(signal.SIGINT)  # what Ctrl-C sends
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr[-3000:]
    assert 'Traceback' not in stderr and 'KeyboardInterrupt' not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last == (f"train.py: interrupted: {run} keeps its checkpoints up to the last one written; continue "
                    f"with: train.py --resume {run}")
    _ok(_run('--resume', str(run), 'train.epochs=2'))  # the command it printed, with a shorter plan


@pytest.mark.parametrize('overrides, phrases', [
    (['data.img_size=36'], ['data.img_size=36 is not a multiple of the patch size 8']),
    (['seg.eval.mode=slide', 'seg.eval.window=44'], ['seg.eval.window=44 is not a multiple of the patch size 8',
                                                     'use 40 or 48']),
    (['seg.eval.mode=slide', 'seg.eval.stride=40'], ['seg.eval.stride=40 must be between 1 and the window (32 px)']),
])
def test_segmentation_sizes_off_the_patch_are_one_line_and_exit_2(tmp_path, overrides, phrases):
    _one_config_error(_run(*SEG, *overrides, f'output_dir={tmp_path / "run"}'), *phrases)


def test_pretrained_weights_that_do_not_fit_name_the_first_keys_and_shapes(tmp_path, trained):
    weights = os.path.join(trained[0], 'model.safetensors')
    result = _run(*CLS, 'model.kwargs.embed_dim=96', f'model.pretrained_file={weights}', f'output_dir={tmp_path}/r')
    _one_config_error(result, 'does not fit', 'cls_token is [1, 1, 48] in the file, [1, 1, 96] in the model',
                      'more)')


def test_a_run_folder_as_pretrained_file_names_the_file_to_use(tmp_path, trained):
    result = _run(*CLS, f'model.pretrained_file={trained[0]}', f'output_dir={tmp_path}/r')
    _one_config_error(result, 'is a folder', f"model.pretrained_file={trained[0]}/model.safetensors")


def _save_png(path, pixels):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(pixels).save(path)


def _seg_folder(root, size=16, count=4):
    rng = np.random.default_rng(0)
    for split in ('train', 'val'):
        for i in range(count):
            _save_png(f'{root}/{split}/images/{i}.png', rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
            _save_png(f'{root}/{split}/masks/{i}.png', rng.integers(0, 2, (size, size), dtype=np.uint8))
    return str(root)


def _class_folder(root, classes=('cat', 'dog'), count=8, size=32):
    rng = np.random.default_rng(1)
    for split in ('train', 'val'):
        for name in classes:
            for i in range(count):
                _save_png(f'{root}/{split}/{name}/{i}.png', rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    return str(root)


def test_a_segmentation_folder_given_to_classification_names_the_segmentation_config(tmp_path):
    root = _seg_folder(tmp_path / 'seg')
    result = _run('--config', 'configs/cls_folder.yaml', *TINY, f'data.root={root}', f'output_dir={tmp_path}/r')
    _one_config_error(result, 'a segmentation folder', '--config configs/seg_folder.yaml')


def test_a_class_folder_given_to_segmentation_names_the_classification_config(tmp_path):
    root = _class_folder(tmp_path / 'cls')
    result = _run('--config', 'configs/seg_folder.yaml', *TINY_MODEL, *TINY_SEG, 'data.name=folder',
                  f'data.root={root}', f'output_dir={tmp_path}/r')
    _one_config_error(result, 'a classification folder', '--config configs/cls_folder.yaml')


def test_eval_only_on_data_with_another_class_count_names_both_counts(tmp_path, trained):
    root = _class_folder(tmp_path / 'cls', classes=('cat', 'dog', 'eel'), count=2)
    result = _run('--eval-only', trained[0], '--config', 'configs/cls_folder.yaml', f'data.root={root}',
                  '--out', str(tmp_path / 'eval'))
    errors = [line for line in result.stderr.splitlines() if line.startswith('train.py: error: ')]
    assert result.returncode == 1 and len(errors) == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
    assert (f"{trained[0]}/model.safetensors was trained on 4 classes (head.weight has 4 rows) but the validation "
            f"data has 3: cat, dog, eel") in errors[0]
    assert not os.path.exists(tmp_path / 'eval')


# ---------------------------------------------------------------------------------------------------- small data

def test_small_data_warns_about_steps_logging_and_small_images(tmp_path):
    root = _seg_folder(tmp_path / 'seg', size=16, count=4)
    result = _ok(_run('--config', 'configs/seg_folder.yaml', *TINY_MODEL, *TINY_SEG, 'data.name=folder',
                      f'data.root={root}', 'data.batch_size=2', 'train.log_every=10', 'train.epochs=2',
                      'threads=1', f'output_dir={tmp_path}/r'))
    assert '4 training samples make 2 step(s) per epoch at data.batch_size=2, 4 in all' in result.stderr
    assert 'too few to learn much' in result.stderr and 'docs/training.md: small data sets' in result.stderr
    assert 'fewer than train.log_every=10: a train row is logged at each epoch' in result.stderr
    assert '4 of 4 training images checked are smaller than the data.img_size=32 crop' in result.stderr
    assert 'CPU: 1 torch thread(s)' in result.stderr
    # each epoch's end is logged although 2 steps never reach log_every=10: the curves are not empty
    assert [row['step'] for row in _csv_rows(f'{tmp_path}/r') if row['split'] == 'train'] == ['2', '4']


def test_busy_cores_warn_with_the_threads_setting(monkeypatch, caplog):
    from linvit.engine.run import use_threads
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, 'getloadavg', lambda: (3.0, 3.0, 3.0))  # this process and 2 others
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        with caplog.at_level(logging.INFO, logger='linvit'):
            use_threads(None, torch.device('cpu'))
        assert 'keep about 2 of the 4 cores busy' in caplog.text and 'set threads=2' in caplog.text
        caplog.clear()
        with caplog.at_level(logging.INFO, logger='linvit'):
            use_threads(2, torch.device('cpu'))
        assert torch.get_num_threads() == 2 and 'busy' not in caplog.text
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------- resume

def _cosine_lr(step, total, warmup, lr=2e-3, warmup_lr=1e-6, min_lr=1e-6):
    """timm's cosine schedule with linear warmup, by hand (t_initial = all steps, warmup inside it)."""
    if step < warmup:
        return warmup_lr + step * (lr - warmup_lr) / warmup
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * step / total))


def test_resume_continues_a_step_budget_stops_on_a_finished_run_and_replans_more_epochs(tmp_path):
    run = str(tmp_path / 'run')
    first = _ok(_run(*CLS, 'train.max_steps=3', f'output_dir={run}'))
    hint = re.search(r'continue with: train\.py (--resume \S+ \S+)', first.stderr).group(1).split()
    stopped = _contents(run)
    again = _ok(_run('--resume', run))  # the budget is the run's: it is finished, and says how to go on
    assert 'is finished at step 3' in again.stderr and 'train.max_steps=null' in again.stderr
    assert _contents(run) == stopped
    _ok(_run(*hint))  # the printed command trains on to the end of train.epochs=2 (16 steps)
    assert json.load(open(os.path.join(run, 'metrics.json')))['count'] == 24
    assert max(int(row['step']) for row in _csv_rows(run)) == 16
    done = _contents(run)
    finished = _ok(_run('--resume', run))
    assert 'is finished at step 16' in finished.stderr and 'train.epochs=3' in finished.stderr
    assert _contents(run) == done  # nothing written: no duplicate rows
    longer = _ok(_run('--resume', run, 'train.epochs=4'))
    assert 'schedule is re-planned for train.epochs=4 (was 2)' in longer.stderr
    lrs = {int(row['step']): float(row['lr']) for row in _csv_rows(run) if row['split'] == 'train'}
    # the lr logged after step s is the one set for step s + 1; warmup_epochs=0.5 -> 4 steps, now 32 in all
    for step in (17, 24, 31):
        assert lrs[step] == pytest.approx(_cosine_lr(step, 32, 4), rel=1e-4)


def test_eval_only_takes_a_run_folder_and_reads_only_the_validation_data(tmp_path):
    root = _class_folder(tmp_path / 'data')
    run = str(tmp_path / 'run')
    _ok(_run('--config', 'configs/cls_folder.yaml', *TINY, 'train.epochs=1', f'data.root={root}',
             f'output_dir={run}'))
    shutil.rmtree(os.path.join(root, 'train'))  # evaluating must not need the training images
    result = _ok(_run('--eval-only', run))
    metrics = json.load(open(os.path.join(run, 'eval_model', 'metrics.json')))
    assert metrics['count'] == 16 and f"top1={metrics['top1']:.4f}" in result.stdout
    again = _ok(_run('--eval-only', run))
    assert 'eval_model holds an earlier evaluation: its metrics.json is replaced' in again.stderr


# ---------------------------------------------------------------------------------------------------- outputs

def test_the_log_names_classes_the_best_step_and_how_it_evaluated(tmp_path):
    run = str(tmp_path / 'run')
    _ok(_run(*SEG, 'seg.eval.mode=slide', 'seg.eval.stride=16', 'train.epochs=1', f'output_dir={run}'))
    log = open(os.path.join(run, 'train.log')).read()
    line = next(line for line in log.splitlines() if 'evaluation at step 4' in line)
    assert '(sliding 32 px windows, stride 16 px)' in line
    iou = json.load(open(os.path.join(run, 'metrics.json')))['per_class_iou']
    assert f"per_class_iou: background {iou['background']:.4f}, red-key " in line
    assert 'best miou' in line and 'at step 4 (best.pt)' in line
    assert 'best.pt: step 4' in log


def test_tensorboard_gets_the_pictures_and_the_scalars(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(os.path.join(trained[0], 'tb'), size_guidance={'images': 0}).Reload()
    assert {'val/predictions', 'val/confusion'} <= set(events.Tags()['images'])
    assert {'val/top1', 'train/loss'} <= set(events.Tags()['scalars'])
    steps = [event.step for event in events.Images('val/predictions')]
    assert steps == [8, 16]


def test_make_demo_prints_commands_that_run_from_the_venv():
    shown = subprocess.run(['make', '-n', 'demo'], cwd=ROOT, capture_output=True, text=True).stdout
    assert '.venv/bin/python train.py --config configs/seg_demo.yaml --overwrite' in shown
    assert 'python train.py --config configs/seg_folder.yaml' not in shown.replace('.venv/bin/python train.py', '')


@pytest.mark.parametrize('target, variable', [('demo', 'DEMO_VERDICT'), ('demo-cls', 'DEMO_CLS_VERDICT')])
def test_each_demo_ends_with_what_its_numbers_mean(tmp_path, target, variable):
    """The last command of each demo prints its numbers against chance; run here on a hand-written metrics.json."""
    # --no-print-directory: under make test, the sub-make would add 'Leaving directory' lines
    shown = subprocess.run(['make', '-n', '--no-print-directory', target], cwd=ROOT, capture_output=True,
                           text=True).stdout
    assert f'-c "${variable}" runs/' in shown.strip().splitlines()[-1]
    makefile = open(os.path.join(ROOT, 'Makefile')).read()
    script = re.search(rf'^define {variable}\n(.*?)^endef', makefile, re.S | re.M).group(1)
    metrics = {'top1': 0.771, 'count': 512} if target == 'demo-cls' else \
        {'miou': 0.96, 'per_class_iou': {'background': 0.99, 'red-key': 0.94, 'blue-key': 0.95}}
    (tmp_path / 'metrics.json').write_text(json.dumps(metrics))
    said = subprocess.run([sys.executable, '-c', script, str(tmp_path / 'metrics.json')], capture_output=True,
                          text=True, check=True).stdout
    assert ('top-1 0.77 on 512 validation images' in said and 'chance is 0.25' in said) if target == 'demo-cls' \
        else ('mIoU 0.96' in said and 'about 0.5' in said)


def test_a_config_saved_on_a_gpu_machine_loads_anywhere_and_is_checked_when_it_runs():
    from linvit.engine.config import ConfigError, check_runs_here, load_config
    cfg = load_config(None, ['device=cuda:99', 'train.precision=float16'])  # e.g. to predict with its weights
    with pytest.raises(ConfigError, match="device='cuda:99'"):
        check_runs_here(cfg)
