"""tools/quality_check.py over linvit.bench.quality: the quick run on the CPU end to end (probe, data, the process of
a run of every kind: a pair at equal steps, a pair at equal seconds, the teacher, its evaluation and its
linearization; one of them cut by its deadline, two pairs without a step time, the report files), from a folder that
is not the checkout; and its parts in this process: the plan (equal steps, equal seconds, whole epochs), the timing
read back from metrics.csv, the rows of cut and failed runs, the runs' jobs and the recipes in code, and the
rendered data."""
import csv
import gzip
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_tool
from omegaconf import OmegaConf

from linvit.bench.quality import data, plan, recipe, report, results, runner
from linvit.bench.quality.job import Job
from linvit.engine import config_to_yaml, load_config

pytestmark = pytest.mark.integration  # trains or starts interpreters

CONFIGS = Path(__file__).resolve().parents[2] / 'configs'  # train.py's recipes, in the checkout
CUT_RUN = 'small/high/softmax'  # the quick run stops this one a second after it started
# The quick run plans these groups as if the probe had measured none of their models: their rows say so and no process
# starts for them. Each fresh interpreter costs ~5 s of CPU, and these pairs run the code of the pairs that do run at
# other sizes (tiny/base: equal steps; small/high: equal seconds).
UNMEASURED = ('tiny/high', 'small/base')


@pytest.fixture(scope='module')
def tool():
    return load_tool('quality_check')


def write_idx(folder: Path, per_class: int) -> None:
    """Tiny Fashion-MNIST IDX files (gzip): a solid bar per item whose position gives its class."""
    folder.mkdir(parents=True)
    labels = np.repeat(np.arange(10, dtype=np.uint8), per_class)
    images = np.zeros((len(labels), 28, 28), dtype=np.uint8)
    for i, label in enumerate(labels):
        images[i, 4 + label:14 + label, 6:22] = 200
    for prefix in ('train', 't10k'):
        for stem, array in ((f'{prefix}-images-idx3-ubyte', images), (f'{prefix}-labels-idx1-ubyte', labels)):
            header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f'>{array.ndim}I', *array.shape)
            (folder / f'{stem}.gz').write_bytes(gzip.compress(header + array.tobytes()))


def settings_for(tmp_path: Path, **changes) -> plan.QualitySettings:
    values = dict(device='cpu', quick=True, out=str(tmp_path / 'out'), cache_dir=str(tmp_path / 'cache'),
                  fmnist_dir=str(tmp_path / 'idx'))
    return plan.QualitySettings(**{**values, **changes}).resolved()


def test_quick_run_reports_every_run_and_the_one_its_deadline_cut(tool, tmp_path, monkeypatch, capsys):
    write_idx(tmp_path / 'idx', per_class=4)
    planned_deadline = runner.run_deadline

    def cut_one(spec, run_plan, started, end, preset):
        return started + 1.0 if spec.key == CUT_RUN else planned_deadline(spec, run_plan, started, end, preset)

    planned_group = runner.plan_group

    def without_step_times(group, seconds, step_s, preset):
        return planned_group(group, seconds, {} if group in UNMEASURED else step_s, preset)

    monkeypatch.setattr(runner, 'run_deadline', cut_one)
    monkeypatch.setattr(runner, 'plan_group', without_step_times)
    monkeypatch.chdir(tmp_path)  # no checkout here: no train.py, no configs/
    out = tmp_path / 'out'
    code = tool.main(['--device', 'cpu', '--quick', '--out', str(out), '--cache-dir', str(tmp_path / 'cache'),
                      '--fmnist-dir', str(tmp_path / 'idx')])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert (out / 'quality_check.md').read_text().strip() in printed
    assert (out / 'quality_check.png').stat().st_size > 0
    rows = {row['key']: row for row in csv.DictReader((out / 'quality_check.csv').open())}
    assert list(rows) == [spec.key for spec in plan.RUNS]
    cut = rows.pop(CUT_RUN)
    assert cut['status'].startswith(plan.CUT) and cut['top1'] == ''
    for spec in plan.RUNS:  # planned without a step time: no process, a row that says why
        if spec.group in UNMEASURED:
            row = rows.pop(spec.key)
            assert row['status'].startswith('skipped (no step time measured for ') and row['top1'] == '', row
            assert not (out / 'logs' / f"{spec.folder}.log").exists()
    for key, row in rows.items():  # every other run finished: trained, evaluated, timed
        assert row['status'] == 'ok', (key, row['status'])
        assert 0 <= float(row['top1']) <= 1 and int(row['steps']) >= 1, (key, row)
        if key != 'teacher/high':
            assert float(row['train_s']) > 0 and float(row['img_per_s']) > 0 and float(row['peak_mem_mib']) > 0
            assert (out / row['run_dir']).is_dir()
    assert rows['tiny/base/linvit']['steps'] == rows['tiny/base/softmax']['steps']  # equal steps at the base size
    assert int(rows['linearized']['steps']) == 2 * plan.QUICK.max_steps  # stage 1 + stage 2
    assert rows['teacher/high']['steps'] == rows['teacher']['steps']
    table = [line for line in printed.splitlines() if line.startswith('| ')]
    assert f"| {plan.CUT} after" in next(line for line in table if line.startswith('| ViT-S | 128 |'))
    assert next(line for line in table if line.startswith('| Small, equal seconds')).endswith('| - | linvit ahead |')
    assert any(line.startswith('| Tiny, equal steps (64 px) |') and 'points |' in line for line in table)


def test_without_the_idx_files_every_row_says_so(tool, tmp_path, capsys):
    code = tool.main(['--device', 'cpu', '--quick', '--out', str(tmp_path / 'out'), '--cache-dir',
                      str(tmp_path / 'cache'), '--fmnist-dir', str(tmp_path / 'nothing')])
    assert code == 0
    rows = list(csv.DictReader((tmp_path / 'out' / 'quality_check.csv').open()))
    assert len(rows) == len(plan.RUNS)
    assert all(row['status'].startswith('skipped (no Fashion-MNIST IDX files') for row in rows)
    assert (tmp_path / 'out' / 'quality_check.png').stat().st_size > 0
    capsys.readouterr()


def test_options_become_resolved_settings(tool, tmp_path):
    settings = tool.parse_args(['--device', 'cpu', '--quick', '--out', str(tmp_path / 'o')])
    assert (settings.budget_s, settings.pipeline, settings.out) == (plan.QUICK.budget_s, 'cached',
                                                                    str(tmp_path / 'o'))
    assert tool.parse_args(['--device', 'cpu']).budget_s == plan.FULL.budget_s == 300
    assert tool.parse_args(['--device', 'cpu', '--pipeline', 'albumentations']).pipeline == 'albumentations'
    for bad in (['--budget-s', '10'], ['--pipeline', 'dali']):
        with pytest.raises(SystemExit):
            tool.parse_args(['--device', 'cpu', *bad])


def test_without_cuda_the_default_device_is_one_line_before_anything_runs(tool, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    with pytest.raises(SystemExit) as exited:
        tool.main(['--out', str(tmp_path / 'out'), '--cache-dir', str(tmp_path / 'cache')])  # --device cuda:0
    captured = capsys.readouterr()
    assert exited.value.code == 2 and captured.out == '' and captured.err.count('\n') == 1, captured.err
    assert captured.err.split(': error: ')[1].startswith('--device cuda:0: there is no CUDA device on this machine')
    assert captured.err.rstrip().endswith('--device cpu --quick')
    assert not (tmp_path / 'out').exists() and not (tmp_path / 'cache').exists()  # no data, no run, no log


def test_user_facing_text_speaks_of_targets_not_issue_numbers(tool, tmp_path, capsys):
    root = Path(__file__).resolve().parents[2]
    pages = [root / 'README.md', *(root / 'docs').glob('*.md'), *(root / 'tools').glob('*.py'),
             *(root / 'linvit').rglob('*.py')]
    assert not [f"{page.relative_to(root)}: {match.group()}" for page in pages
                for match in re.finditer(r'[Ii]ssue \d+', page.read_text())]
    assert tool.main(['--device', 'cpu', '--quick', '--out', str(tmp_path / 'out'), '--cache-dir',
                      str(tmp_path / 'cache'), '--fmnist-dir', str(tmp_path / 'nothing')]) == 0
    report_text = (tmp_path / 'out' / 'quality_check.md').read_text()
    assert '## Comparisons with the targets' in report_text and 'linvit within 1 point' in report_text
    capsys.readouterr()


def test_schedule_is_whole_epochs_unless_less_than_half_of_one():
    assert plan.schedule(620, 78) == (8, None, 624)
    assert plan.schedule(40, 78) == (1, None, 78)
    assert plan.schedule(38, 78) == (1, 38, 38)  # below half an epoch: stopped inside the first


STEP_S = {'linvit_tiny_patch16_224@512x128': 0.03, 'vit_tiny_patch16_224@512x128': 0.05,
          'linvit_small_patch16_224@1024x32': 0.05, 'vit_small_patch16_224@1024x32': 0.15,
          'vit_small_patch16_224@256x128': 0.02, 'vit_small_patch16_224+hedgehog@1024x32': 0.06}


def test_a_base_pair_gets_equal_steps_and_a_high_pair_equal_seconds():
    full = plan.FULL
    base = plan.plan_group('tiny/base', 40.0, STEP_S, full)
    linvit, softmax = base['tiny/base/linvit'], base['tiny/base/softmax']
    assert (linvit.epochs, linvit.max_steps, linvit.steps) == (softmax.epochs, softmax.max_steps, softmax.steps)
    assert linvit.steps == 6 * 78  # 40 s / (0.03 + 0.05) s = 500 steps: the nearest whole epochs of 78
    assert (linvit.planned_s, softmax.planned_s) == pytest.approx((468 * 0.03, 468 * 0.05))
    high = plan.plan_group('small/high', 30.0, STEP_S, full)
    linvit, softmax = high['small/high/linvit'], high['small/high/softmax']
    assert linvit.steps > 2 * softmax.steps  # the same seconds buy a third of the step time three times the steps
    epoch_s = [full.canvases['high'].steps_per_epoch * t for t in (0.05, 0.15)]
    assert linvit.planned_s == pytest.approx(15.0, abs=epoch_s[0] / 2)
    assert softmax.planned_s == pytest.approx(15.0, abs=epoch_s[1] / 2)
    lin = plan.plan_group('linearized', 20.0, STEP_S, full)
    assert lin['linearized'].stage1_steps == int(plan.STAGE1_FRACTION * 20.0 / 0.06)
    assert lin['teacher/high'].step_s is None  # an evaluation: no steps, no share
    assert plan.plan_group('tiny/high', 30.0, {}, full)['tiny/high/linvit'].startswith('skipped (no step time')
    assert plan.plan_group('teacher', 0.001, STEP_S, full)['teacher'] == plan.SKIPPED


def test_a_group_gets_its_share_of_the_time_the_runs_not_started_can_train():
    full = plan.FULL
    left = [spec for spec in plan.RUNS if spec.group not in ('teacher', 'tiny/base')]
    starts = len(left) + 1  # the linearization starts two stages
    seconds = plan.group_seconds(full, 'small/base', left, time_left=200.0)
    shares = sum(full.shares[g] for g in plan.GROUPS if g not in ('teacher', 'tiny/base'))
    assert seconds == pytest.approx(full.shares['small/base'] / shares
                                    * (200.0 - plan.REPORT_RESERVE_S - starts * full.startup_s))
    assert plan.group_seconds(full, 'small/base', left, time_left=10.0) == 0.0


def write_metrics(folder: Path, rows) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / 'metrics.csv', 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=['epoch', 'step', 'split', 'loss', 'img_per_s', 'data_wait_frac',
                                               'peak_mem_mib', 'top1'])
        writer.writeheader()
        writer.writerows(rows)


def test_training_seconds_come_from_the_train_rows_and_top1_from_the_val_rows(tmp_path):
    write_metrics(tmp_path, [
        {'epoch': 0, 'step': 10, 'split': 'train', 'img_per_s': 40.0, 'data_wait_frac': 0.5, 'peak_mem_mib': 100},
        {'epoch': 0, 'step': 12, 'split': 'train', 'img_per_s': 8.0, 'data_wait_frac': 0.0, 'peak_mem_mib': 120},
        {'epoch': 1, 'step': 12, 'split': 'val', 'top1': 0.5},
        {'epoch': 1, 'step': 20, 'split': 'train', 'img_per_s': 16.0, 'peak_mem_mib': 110},
        {'epoch': 2, 'step': 20, 'split': 'val', 'top1': 0.75}])
    curve = results.read_curve(tmp_path / 'metrics.csv', batch=4)
    # 10 steps of 4 images at 40 img/s = 1 s; 2 steps at 8 img/s = 1 s; 8 steps at 16 img/s = 2 s
    assert curve.points == [(12, pytest.approx(2.0), 0.5), (20, pytest.approx(4.0), 0.75)]
    assert (curve.steps, curve.images, curve.peak_mem_mib) == (20, 80, 120)
    assert curve.train_s == pytest.approx(4.0) and curve.data_wait_s == pytest.approx(0.5)
    later = results.Curve([(5, 1.0, 0.8)], steps=5, train_s=1.0, images=20, peak_mem_mib=130.0)
    assert curve.extend(later).points[-1] == (25, pytest.approx(5.0), 0.8)


def test_rows_of_a_cut_and_of_a_failed_run(tmp_path):
    settings = settings_for(tmp_path)
    preset = settings.preset
    spec = plan.RUN_BY_KEY['tiny/base/linvit']
    write_metrics(plan.run_dir(settings, spec), [
        {'epoch': 0, 'step': 3, 'split': 'train', 'img_per_s': 12.0, 'peak_mem_mib': 100},
        {'epoch': 1, 'step': 3, 'split': 'val', 'top1': 0.3},
        {'epoch': 1, 'step': 5, 'split': 'train', 'img_per_s': 12.0, 'peak_mem_mib': 100}])
    cut = results.run_record(settings, preset, spec, {}, {}, None, 61.4)
    assert cut['status'] == f"{plan.CUT} after 61 s; top-1 of its last evaluation, at step 3"
    assert (cut['top1'], cut['steps']) == (0.3, 5)
    assert report.finished_top1(cut) is None  # comparisons read finished runs only
    log = Path(settings.out) / 'logs' / f"{spec.folder}.log"
    log.parent.mkdir(parents=True)
    log.write_text('train: ...\nConfigError: unknown config key data.cache\n')
    failed = results.run_record(settings, preset, spec, {}, {}, 2, 3.0)
    assert failed['status'] == (f"error: the run exited 2 (logs/{spec.folder}.log: ConfigError: unknown config key "
                                f"data.cache)")
    early = results.run_record(settings, preset, plan.RUN_BY_KEY['tiny/base/softmax'], {}, {}, None, 1.0)
    assert early['status'] == f"{plan.CUT} after 1 s, before any evaluation"


def test_the_jobs_of_a_pair_resolve_to_one_recipe(tmp_path):
    settings = settings_for(tmp_path, quick=False, device='cuda:0')
    plans = plan.plan_group('small/high', 30.0, STEP_S, settings.preset)
    configs = {}
    for key in ('small/high/linvit', 'small/high/softmax'):
        job = recipe.train_job(settings, settings.preset, plan.RUN_BY_KEY[key], plans[key], tmp_path / 'data')
        assert job.kind == 'train' and job.recipe is recipe.RECIPE
        assert 'train.precision=bfloat16' in job.overrides and 'data.cache=true' in job.overrides
        assert job.argv()[1:3] == ['-m', 'linvit.bench.quality.job']
        configs[key] = OmegaConf.to_container(job.config(), resolve=True)
    linvit, softmax = configs.values()
    assert (linvit['model']['name'], softmax['model']['name']) == ('linvit_small_patch16_224', 'vit_small_patch16_224')
    assert linvit['data']['img_size'] == 1024 and linvit['data']['batch_size'] == 32
    assert linvit['train']['lr'] == pytest.approx(recipe.RECIPE['train']['lr'] * (32 / 128) ** 0.5)
    assert linvit['data']['aug']['label_smoothing'] == recipe.LABEL_SMOOTHING
    assert linvit['train']['clip_grad'] == recipe.CLIP_GRAD
    for cfg in (linvit, softmax):  # equal seconds: the epochs differ; everything else is the same
        del cfg['model']['name'], cfg['output_dir'], cfg['train']['epochs'], cfg['train']['warmup_epochs']
    assert linvit == softmax
    teacher = tmp_path / 'teacher'
    lin = recipe.linearize_job(settings, settings.preset, plan.RUN_BY_KEY['linearized'],
                               plan.plan_group('linearized', 20.0, STEP_S, settings.preset)['linearized'],
                               tmp_path / 'data', teacher)
    cfg = lin.config()
    assert cfg.task == 'linearize' and cfg.linearize.teacher == str(teacher) and cfg.data.img_size == 1024
    assert cfg.linearize.attention_max_steps == int(plan.STAGE1_FRACTION * 20.0 / 0.06)
    evaluation = recipe.eval_job(settings, settings.preset, plan.RUN_BY_KEY['teacher/high'], tmp_path / 'data',
                                 teacher)
    assert (evaluation.kind, evaluation.weights, evaluation.out) == ('eval', str(teacher),
                                                                      str(Path(settings.out) / 'runs/teacher_high'))
    assert 'data.img_size=1024' in evaluation.overrides
    albumentations = settings_for(tmp_path, pipeline='albumentations')
    assert 'data.cache=false' in recipe.common_overrides(albumentations, albumentations.preset)


@pytest.mark.parametrize('name, config_file', [('RECIPE', 'cls_fmnist_quality.yaml'),
                                                ('LINEARIZE_RECIPE', 'linearize_cls_fmnist.yaml')])
def test_the_recipes_in_code_are_the_config_files_of_train_py(name, config_file):
    """The check builds its configs in code (an installed package has no configs/); the files train.py reads say the
    same, so that a run of the check can be repeated with train.py."""
    overrides = ['data.root=/data', 'linearize.teacher=/teacher', 'output_dir=/out']
    in_code = load_config(None, overrides, base=getattr(recipe, name))
    from_file = load_config(str(CONFIGS / config_file), overrides)
    assert OmegaConf.to_container(in_code) == OmegaConf.to_container(from_file)


def test_an_eval_job_evaluates_a_run_folder_with_the_config_saved_beside_its_weights(tmp_path):
    """The teacher's evaluation reads the architecture from the run folder, not from a recipe or a config file."""
    saved = load_config(None, ['model.name=vit_small_patch16_224', 'model.kwargs.depth=2', 'data.img_size=256',
                               'data.root=/train'], base=recipe.RECIPE)
    teacher = tmp_path / 'teacher'
    teacher.mkdir()
    (teacher / 'config.yaml').write_text(config_to_yaml(saved))
    (teacher / 'model.safetensors').write_bytes(b'')
    job = Job('eval', ('data.root=/high', 'data.img_size=1024'), weights=str(teacher), out=str(tmp_path / 'eval'))
    cfg = job.config()
    assert (cfg.model.name, cfg.model.kwargs.depth, cfg.data.img_size, cfg.data.root) == (
        'vit_small_patch16_224', 2, 1024, '/high')


def test_the_data_is_rendered_once_and_reused(tmp_path):
    settings = settings_for(tmp_path)
    assert len(data.missing_idx_files(Path(settings.fmnist_dir))) == 4
    write_idx(Path(settings.fmnist_dir), per_class=4)
    assert data.data_unavailable(settings.fmnist_dir) is None
    canvas = plan.QUICK.canvases['high']
    folder = data.render_canvas_set(settings, canvas)
    assert len(list((folder / 'train').rglob('*.png'))) == 10 * canvas.train_per_class
    assert len(list((folder / 'val').rglob('*.png'))) == 10 * canvas.val_per_class
    stamp = os.stat(folder / 'manifest.csv').st_mtime_ns
    assert data.render_canvas_set(settings, canvas) == folder  # reused: nothing rendered again
    assert os.stat(folder / 'manifest.csv').st_mtime_ns == stamp
