"""tools/quality_check.py --grid over linvit.bench.quality.grid: the grid's runs (every linear configuration with local
mix on and off for classification, softmax once, the same seeds and steps for all), one run's overrides, the report's
aggregation against numbers worked out by hand, a failed run's row, and the quick grid end to end on the CPU."""
import csv
import json
import math
from pathlib import Path

import pytest
from conftest import load_tool

from linvit.bench.quality import grid, grid_report, grid_runner
from linvit.engine import load_config


@pytest.fixture(scope='module')
def tool():
    return load_tool('quality_check')


def cpu_settings(tmp_path: Path, **changes) -> grid.GridSettings:
    values = dict(grid='cpu', device='cpu', out=str(tmp_path / 'out'), cache_dir=str(tmp_path / 'cache'))
    return grid.GridSettings(**{**values, **changes}).resolved()


@pytest.mark.parametrize('preset', [grid.CPU_GRID, grid.GPU_GRID])
def test_the_grid_trains_every_configuration_on_the_same_steps_and_seeds(preset):
    runs = grid.grid_runs(preset)
    linear = [config for config in grid.CONFIGS if config.linear]
    assert {c.label for c in linear} == {'elu1', 'relu', 'focused', 'inline', 'mala', 'nala', 'polar'}
    cls = [run for run in runs if run.task == 'classification']
    seg = [run for run in runs if run.task == 'segmentation']
    for config in linear:
        for local_mix in (True, False):
            assert sorted(r.seed for r in cls if r.config == config and r.local_mix is local_mix) == [0, 1, 2]
        assert sorted(r.seed for r in seg if r.config == config and r.local_mix is True) == [0, 1, 2]
        assert not [r for r in seg if r.config == config and r.local_mix is False]  # segmentation: on only
    for task in (cls, seg):
        assert sorted(r.seed for r in task if r.config == grid.SOFTMAX) == [0, 1, 2]
        assert all(r.local_mix is None for r in task if r.config == grid.SOFTMAX)
    assert (len(cls), len(seg)) == (45, 24)
    assert len({run.folder for run in runs}) == len(runs)  # every run its own folder and log
    settings = cpu_settings(Path('/tmp/unused'), grid=preset.name)
    for task in grid.TASKS:  # one step cap for every run of a task, and it is whole epochs of its set
        caps = {next(o for o in grid.grid_job(settings, preset, run, Path('/d')).overrides
                     if o.startswith('train.max_steps=')) for run in runs if run.task == task.name}
        assert caps == {f"train.max_steps={preset.steps[task.name]}"}
        assert preset.steps[task.name] % preset.dataset(task.name).steps_per_epoch == 0
    assert grid.grid_runs(preset, seeds=1) == [run for run in runs if run.seed == 0]


def test_a_run_is_its_recipe_with_its_kwargs_seed_and_step_cap(tmp_path):
    settings = cpu_settings(tmp_path)
    preset = settings.grid_preset
    mala = next(c for c in grid.CONFIGS if c.label == 'mala')
    run = grid.GridRun('classification', mala, False, 2)
    job = grid.grid_job(settings, preset, run, tmp_path / 'data')
    assert {'model.name=linvit_tiny_patch16_224', 'model.kwargs.feature_map=elu1', 'model.kwargs.normalizer=mala',
            'model.kwargs.local_mix=false', 'model.kwargs.depth=4', 'seed=2', 'train.max_steps=540',
            'train.epochs=6', 'data.img_size=128', 'data.batch_size=32', 'device=cpu',
            'train.lr=0.001'} <= set(job.overrides)
    cfg = load_config(None, job.overrides, base=job.recipe)
    assert (cfg.seed, cfg.train.max_steps, cfg.train.epochs, cfg.task) == (2, 540, 6, 'classification')
    assert dict(cfg.model.kwargs) == {'depth': 4, 'embed_dim': 96, 'num_heads': 3, 'feature_map': 'elu1',
                                      'normalizer': 'mala', 'local_mix': False}
    assert cfg.train.warmup_epochs == pytest.approx(0.1 * 6)  # 10% of the steps
    assert cfg.output_dir == str(tmp_path / 'out' / 'runs' / 'classification_mala_lm-off_seed2')
    softmax = grid.grid_job(settings, preset, grid.GridRun('segmentation', grid.SOFTMAX, None, 0), tmp_path)
    cfg = load_config(None, softmax.overrides, base=softmax.recipe)
    assert (cfg.task, cfg.model.name, dict(cfg.model.kwargs)) == ('segmentation', 'vit_tiny_patch16_224',
                                                                  {'depth': 4, 'embed_dim': 96, 'num_heads': 3})
    assert (cfg.train.max_steps, cfg.seg.head, cfg.train.clip_grad, cfg.train.opt) == (144, 'mlp', 1.0, 'adamw')
    polar = next(c for c in grid.CONFIGS if c.label == 'polar')
    assert dict(polar.kwargs) == {'attn_family': 'polar'}  # no feature_map key


def record(config, local_mix, seed, metric, img_per_s, status='ok', task='classification'):
    return {'config': config, 'task': task, 'local_mix': local_mix, 'seed': seed, 'status': status,
            'metric': metric if status == 'ok' else None, 'img_per_s': img_per_s if status == 'ok' else None}


FAKE = [record('softmax', None, 0, 0.80, 100.0), record('softmax', None, 1, 0.70, 110.0),
        record('softmax', None, 2, 0.75, 120.0),
        record('elu1', True, 0, 0.60, 200.0), record('elu1', True, 1, 0.90, 220.0),
        record('elu1', True, 2, None, None, status='error: the run exited 1 (logs/x.log: ValueError: no)'),
        record('nala', True, 0, None, None, status='error: the run exited 1 (logs/y.log: KeyError: nala)'),
        record('softmax', None, 0, 0.40, 50.0, task='segmentation')]


def test_the_report_aggregates_the_seeds_that_finished():
    rows = {(r.config, r.local_mix): r for r in grid_report.summarize(FAKE, 'classification')}
    assert list(rows) == [('softmax', None), ('elu1', True), ('nala', True)]
    softmax, elu1, nala = rows.values()
    # by hand: softmax (0.80 + 0.70 + 0.75) / 3 = 0.75, deviations 0.05, -0.05, 0: std sqrt(0.005 / 2) = 0.05
    assert softmax.mean == pytest.approx(0.75) and softmax.std == pytest.approx(0.05)
    assert softmax.img_per_s == pytest.approx(110.0) and softmax.gap_points == pytest.approx(0.0)
    # elu1: two of three seeds, (0.60 + 0.90) / 2 = 0.75; std sqrt((0.15^2 + 0.15^2) / 1) = 0.2121; gap 0 points
    assert (len(elu1.values), elu1.runs) == (2, 3)
    assert elu1.mean == pytest.approx(0.75) and elu1.std == pytest.approx(math.sqrt(0.045))
    assert elu1.img_per_s == pytest.approx(210.0) and elu1.gap_points == pytest.approx(0.0)
    assert (nala.mean, nala.std, nala.gap_points, nala.runs) == (None, None, None, 1)
    table = grid_report.summary_rows(list(rows.values()))
    assert table[0] == ['softmax', '-', '3/3', '75.0', '5.0', '70.0-80.0', '110', '(reference)']
    assert table[1] == ['elu1', 'on', '2/3', '75.0', '21.2', '60.0-90.0', '210', '+0.0']
    assert table[2] == ['nala', 'on', '0/1', '-', '-', '-', '-', '-']
    seg = grid_report.summarize([*FAKE, record('elu1', True, 0, 0.43, 40.0, task='segmentation')], 'segmentation')
    assert seg[1].gap_points == pytest.approx(3.0)  # 100 x (0.43 - 0.40), against the segmentation softmax only


def test_a_failed_run_is_a_row_with_its_error(tmp_path):
    settings = cpu_settings(tmp_path)
    preset = settings.grid_preset
    nala = next(c for c in grid.CONFIGS if c.label == 'nala')
    run = grid.GridRun('classification', nala, True, 1)
    log = tmp_path / 'out' / 'logs' / f"{run.folder}.log"
    log.parent.mkdir(parents=True)
    log.write_text("train: ...\nValueError: feature_map 'nala' is not one of ['elu1', 'relu']\n")
    failed = grid_runner.grid_record(settings, preset, run, 1, 4.2)
    assert failed['status'] == (f"error: the run exited 1 (logs/{run.folder}.log: ValueError: feature_map 'nala' is "
                                f"not one of ['elu1', 'relu'])")
    assert (failed['config'], failed['local_mix'], failed['seed'], failed.get('metric')) == ('nala', True, 1, None)
    cut = grid_runner.grid_record(settings, preset, run, None, 601.0)
    assert cut['status'].startswith('cut after 601 s')
    finished = {**failed, 'status': 'ok', 'metric': 0.5, 'config': 'softmax', 'local_mix': None}
    text = grid_report.markdown(settings, preset, [finished, failed], 10.0)
    assert '| nala | on | 0/1 | - |' in text  # the table counts it
    assert f"| classification | nala | on | 1 | {failed['status']} |" in text  # and says why
    assert text.splitlines()[5] == settings.command()  # the command that reproduces it, at the top
    assert settings.command().startswith('python tools/quality_check.py --grid cpu --device cpu ')


def test_grid_options(tool, tmp_path):
    settings = tool.parse_args(['--grid', 'cpu', '--device', 'cpu'])
    assert isinstance(settings, grid.GridSettings) and settings.out == str(Path('runs/quality_grid').resolve())
    assert settings.grid_preset is grid.CPU_GRID and settings.seeds is None
    quick = tool.parse_args(['--grid', 'gpu', '--device', 'cpu', '--quick', '--seeds', '1'])
    assert quick.grid_preset is grid.QUICK_GRID and quick.seeds == 1
    assert not isinstance(tool.parse_args(['--device', 'cpu']), grid.GridSettings)
    for bad in (['--seeds', '2'], ['--grid', 'cpu', '--budget-s', '100'], ['--grid', 'cpu', '--seeds', '0'],
                ['--grid', 'tpu']):
        with pytest.raises(SystemExit):
            tool.parse_args(['--device', 'cpu', *bad])


@pytest.mark.integration  # five training processes, ~40 s on 2 cores
def test_quick_grid_end_to_end(tool, tmp_path, capsys):
    out = tmp_path / 'out'
    code = tool.main(['--grid', 'cpu', '--device', 'cpu', '--quick', '--out', str(out), '--cache-dir',
                      str(tmp_path / 'cache')])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert (out / 'quality_grid.md').read_text().strip() in printed
    assert (out / 'quality_grid.png').stat().st_size > 0
    rows = list(csv.DictReader((out / 'quality_grid.csv').open()))
    expected = grid.grid_runs(grid.QUICK_GRID)
    assert [(r['task'], r['config'], r['seed']) for r in rows] == [(r.task, r.config.label, str(r.seed))
                                                                   for r in expected]
    for row in rows:
        assert row['status'] == 'ok', row
        assert 0 <= float(row['metric']) <= 1 and float(row['img_per_s']) > 0 and int(row['steps']) == 2
        metrics = json.loads((out / row['run_dir'] / 'metrics.json').read_text())
        assert metrics[grid.TASK_BY_NAME[row['task']].metric] == pytest.approx(float(row['metric']))
