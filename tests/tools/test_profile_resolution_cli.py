"""tools/profile_resolution.py: options, failure rows and the exit status, --summarize, and tiny end-to-end sweeps:
one whose configurations run in their children (subprocesses), the others with the children's measurement run in
this process (``scripted_clock.in_process``; against a scripted clock where the numbers are checked)."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest
from profile_rows import hand_rows
from scripted_clock import ScriptedClock, float_cells, in_process

from linvit.bench import profile, report
from linvit.bench.profile_cli import build_configs, parse_args

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def test_sizes_accept_square_and_height_by_width():
    assert parse_args(['--sizes', '2048', '384x640']).sizes == [(2048, 2048), (384, 640)]


def test_sweep_is_size_major_with_floors():
    args = parse_args(['--models', 'linvit_tiny_patch16_224', 'vit_tiny_patch16_224', '--sizes', '512', '224',
                               '--mode', 'eager', '--floors', 'linvit'])
    configs = build_configs(args)
    assert [(c.height, c.model.label) for c in configs] == [
        (224, 'linvit_tiny_patch16_224'), (224, 'vit_tiny_patch16_224'), (224, 'floor(linvit_tiny_patch16_224)'),
        (512, 'linvit_tiny_patch16_224'), (512, 'vit_tiny_patch16_224'), (512, 'floor(linvit_tiny_patch16_224)')]
    assert len(build_configs(parse_args(['--floors', 'all']))) == 4 * 4 * 2
    for bad in (['--rounds', '0'], ['--warmup', '0'], ['--models', 'vit_small_patch16_224:depth']):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_workloads_and_precisions_have_one_word_each(capsys):
    args = parse_args(['--workload', 'training', 'inference', '--dtype', 'bfloat16'])
    assert (args.workload, args.dtype) == (['training', 'inference'], ['bfloat16'])
    assert parse_args([]).workload == ['inference']
    for other_word in (['--task', 'train'], ['--workload', 'train'], ['--dtype', 'bf16']):
        with pytest.raises(SystemExit):
            parse_args(other_word)
        assert 'error:' in capsys.readouterr().err


def test_failed_configurations_are_listed_and_make_the_exit_status_1(prof, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(profile, 'run_config', in_process(profile))  # a child's row, without its interpreter
    out = tmp_path / 'prof'
    status = prof.main(['--models', 'nope_model', '--sizes', '32', '--floors', 'none', '--mode', 'eager',
                        '--warmup', '1', '--repeats', '1', '--out', str(out)])
    printed = capsys.readouterr().out
    assert status == 1
    failures = printed.split('# 1 of 1 configurations failed:')[1].strip().splitlines()
    assert len(failures) == 1 and failures[0].startswith('nope_model 32 b1 float32 eager inference: ERROR ')
    assert 'nope_model' in failures[0][len('nope_model 32 b1 float32 eager inference: ERROR '):]  # the child's message
    rows = list(csv.DictReader((out / 'profile.csv').open()))
    assert [(r['model'], r['status']) for r in rows] == [('nope_model', 'error')] and 'nope_model' in rows[0]['error']


def _runs_nothing(status, error):
    """A stand-in for run_config: every configuration ends with ``status`` at once, no process started."""
    def run_config(config, timeout, retain_freed_memory=False):
        return {**profile.base_row(config), 'status': status, 'error': error}
    return run_config


def test_running_out_of_memory_or_time_is_a_result_not_a_failure(prof, tmp_path, capsys, monkeypatch):
    argv = ['--models', 'vit_tiny_patch16_224', '--sizes', '32', '--floors', 'none', '--mode', 'eager',
            '--out', str(tmp_path)]
    monkeypatch.setattr(profile, 'run_config', _runs_nothing('timeout', 'no result within 1 s'))
    assert prof.main(argv) == 0
    listed = capsys.readouterr().out.split('# 1 of 1 configurations out of memory or time:')[1].strip()
    assert listed == 'vit_tiny_patch16_224 32 b1 float32 eager inference: TIMEOUT no result within 1 s'
    monkeypatch.setattr(profile, 'run_config', _runs_nothing('error', 'RuntimeError: boom'))
    assert prof.main(argv) == 1
    assert 'vit_tiny_patch16_224 32 b1 float32 eager inference: ERROR RuntimeError: boom' in capsys.readouterr().out


def test_summarize_writes_the_png_next_to_the_csv_unless_out_is_given(prof, tmp_path, capsys):
    run = tmp_path / 'run'
    run.mkdir()
    report.write_csv(str(run / 'profile.csv'), hand_rows())
    assert prof.main(['--summarize', str(run / 'profile.csv')]) == 0
    assert f"wrote {run / 'profile_inference_float32_b1.png'}" in capsys.readouterr().out
    assert (run / 'profile_inference_float32_b1.png').read_bytes()[:8] == PNG_MAGIC
    (run / 'profile_inference_float32_b1.png').unlink()
    assert prof.main(['--summarize', str(run / 'profile.csv'), '--out', str(tmp_path / 'elsewhere')]) == 0
    assert (tmp_path / 'elsewhere' / 'profile_inference_float32_b1.png').exists()
    assert not (run / 'profile_inference_float32_b1.png').exists()


def test_profile_runs_end_to_end(prof, tmp_path, capsys):
    """Each configuration in its own interpreter, glibc keeping freed memory there when asked (one size: a child
    costs ~5 s of CPU; the order of several sizes and the time growth between them are the scripted sweep's; a child
    without --retain-freed-memory: tests/bench/test_bench_profile.py)."""
    out = tmp_path / 'prof'
    models = ['linvit_tiny_patch16_224:depth=1,local_mix=False', 'vit_tiny_patch16_224:depth=1']
    assert prof.main(['--models', *models, '--sizes', '32x48', '--mode', 'eager', '--floors', 'linvit',
                      '--warmup', '1', '--repeats', '1', '--retain-freed-memory', '--out', str(out)]) == 0
    printed = capsys.readouterr().out
    assert 'linvit/floor' in printed and 'crossover: ' in printed and 'time growth' not in printed
    rows = list(csv.DictReader((out / 'profile.csv').open()))
    assert [(r['model'], r['height'], r['width'], r['status']) for r in rows] == [
        (models[0], '32', '48', 'ok'), (models[1], '32', '48', 'ok'), (f"floor({models[0]})", '32', '48', 'ok')]
    assert [r['tokens'] for r in rows] == ['7'] * 3  # class token + 2x3 patches
    assert [r['allocator'] for r in rows] == ['retain'] * 3  # what each child ran with
    for r in rows:
        assert float(r['img_per_s']) == pytest.approx(1e3 / float(r['median_ms']))
        assert float(r['p90_ms']) >= float(r['median_ms']) > 0 and float(r['peak_mem_mib']) > 50
        assert float(r['base_mem_mib']) > 50 and 0 <= float(r['added_mem_mib']) < float(r['peak_mem_mib'])
    assert list(rows[0]) == report.CSV_FIELDS
    assert (out / 'profile_inference_float32_b1.png').read_bytes()[:8] == PNG_MAGIC
    # the summary of a finished run can be re-printed from its CSV
    assert prof.main(['--summarize', str(out / 'profile.csv'), '--out', str(tmp_path / 'again')]) == 0
    assert 'linvit/floor' in capsys.readouterr().out


# milliseconds of one forward by (model, floor, image side); warm-up calls take 1 s, timed calls vary around these
TABLE_MS = {('linvit_tiny_patch16_224', False, 32): 20., ('linvit_tiny_patch16_224', True, 32): 10.,
            ('vit_tiny_patch16_224', False, 32): 10., ('linvit_tiny_patch16_224', False, 64): 60.,
            ('linvit_tiny_patch16_224', True, 64): 40., ('vit_tiny_patch16_224', False, 64): 100.}


def table_forward_ms(name, floor, height, width, call):
    return 1e3 if call == 0 else TABLE_MS[name, floor, height] * [1.2, 1.0, 0.8][(call - 1) % 3]


def test_printed_table_and_csv_are_the_scripted_throughputs(prof, tmp_path, capsys, monkeypatch):
    ScriptedClock(table_forward_ms).install(monkeypatch, profile)
    monkeypatch.setattr(profile, 'run_config', in_process(profile))
    models = ['linvit_tiny_patch16_224:depth=1,local_mix=False', 'vit_tiny_patch16_224:depth=1']
    assert prof.main(['--models', *models, '--sizes', '32', '64', '--mode', 'eager', '--floors', 'linvit',
                      '--warmup', '1', '--repeats', '3', '--out', str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rows = {(r['model'], int(r['height'])): r for r in csv.DictReader((tmp_path / 'profile.csv').open())}
    assert list(rows) == [(label, side) for side in (32, 64)  # size-major, each size's floor after its models
                          for label in (*models, f"floor({models[0]})")]
    for (name, floor, side), ms in TABLE_MS.items():
        label = next(m for m in models if m.startswith(name))
        row = rows[f"floor({label})" if floor else label, side]
        assert int(row['tokens']) == (side // 16) ** 2 + 1
        assert [float(row[k]) for k in ('median_ms', 'p90_ms', 'img_per_s', 'first_call_ms')] == pytest.approx(
            [ms, 1.2 * ms, 1e3 / ms, 1e3])
    table = printed.split(f"## {models[0]} vs {models[1]}")[1]
    lines = {line.split()[0]: line for line in table.splitlines() if line.strip()[:1].isdigit()}
    # size, tokens, img/s of linvit, floor, softmax; linvit/floor, linvit/softmax; memory added (MiB); peak ratio
    assert float_cells(lines['32'])[:7] == pytest.approx([32, 5, 50., 100., 100., 0.5, 0.5], abs=5e-3)
    assert float_cells(lines['64'])[:7] == pytest.approx([64, 17, 1e3 / 60, 25., 10., 40 / 60, 100 / 60], abs=5e-3)
    for side in ('32', '64'):
        assert float_cells(lines[side])[7:9] == [round(float(rows[m, int(side)]['added_mem_mib'])) for m in models]
        peaks = [float(rows[m, int(side)]['peak_mem_mib']) for m in (models[0], f"floor({models[0]})")]
        assert float_cells(lines[side])[9] == pytest.approx(peaks[0] / peaks[1], abs=5e-3)
    assert f"crossover: {models[0]} beats {models[1]} from 64 px (17 tokens) on" in table
    assert 'time growth 32 -> 64 px (4x tokens): linvit 3.00x, floor 4.00x, softmax 10.00x' in table
    # time growth is printed between sizes whose sides double only (32 x 48 has 1.5x the tokens of 32)
    assert report.doublings([(32, 32), (32, 48), (64, 64)]) == [((32, 32), (64, 64))]


@pytest.mark.integration
def test_the_preset_tool_runs_as_a_script(tmp_path):
    """profile_forward.py starts as a script from any folder (it imports only linvit, profile_resolution.py's options
    included) and explains itself; the other tools' imports are checked by loading them in test_tool_help.py."""
    tool = Path(__file__).resolve().parents[2] / 'tools' / 'profile_forward.py'
    done = subprocess.run([sys.executable, str(tool), '--help'], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0 and '--sizes SIZE' in done.stdout, done.stderr[-2000:]


def test_segmentation_plain_and_bounded_with_peak_memory_and_time_per_token(prof, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(profile, 'run_config', in_process(profile))  # the children's rows, measured here
    out = tmp_path / 'prof'
    models = ['linvit_tiny_patch16_224:depth=2', 'vit_tiny_patch16_224:depth=2']
    assert prof.main(['--models', *models, '--sizes', '64', '--workload', 'segmentation', '--mode', 'eager',
                      'bounded', '--rows-per-chunk', '2', '--floors', 'none', '--warmup', '1', '--repeats', '1',
                      '--out', str(out)]) == 0
    printed = capsys.readouterr().out
    rows = list(csv.DictReader((out / 'profile.csv').open()))
    # the softmax ViT has no state form: no bounded row for it
    assert [(r['model'], r['mode'], r['status'], r['rows_per_chunk']) for r in rows] == [
        (models[0], 'eager', 'ok', ''), (models[1], 'eager', 'ok', ''), (models[0], 'bounded', 'ok', '2')]
    assert '# segmentation, float32, batch 1: bounded / eager img/s' in printed
    memory = printed.split('peak memory during the calls (MiB, process RSS)')[1].splitlines()
    peaks = {' '.join(line.split()[:2]): line.split()[2] for line in memory[2:5]}
    assert peaks == {f"{r['model']} [{r['mode']}]": str(round(float(r['peak_mem_mib']))) for r in rows}
    assert (out / 'profile_segmentation_float32_b1.png').read_bytes()[:8] == PNG_MAGIC


def test_detection_is_measured_eagerly_for_linvit_and_softmax_backbones(prof, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(profile, 'run_config', in_process(profile))  # the children's rows, measured here
    out = tmp_path / 'prof'
    models = ['linvit_tiny_patch16_224:depth=2', 'vit_tiny_patch16_224:depth=2']
    assert prof.main(['--models', *models, '--sizes', '64', '96x128', '--workload', 'detection', '--mode', 'eager',
                      'compiled', '--floors', 'none', '--warmup', '1', '--repeats', '1', '--out', str(out)]) == 0
    rows = list(csv.DictReader((out / 'profile.csv').open()))
    # torchvision's detectors pick boxes with data-dependent shapes: no compiled rows
    assert [(r['model'], r['height'], r['width'], r['mode'], r['status']) for r in rows] == [
        (models[0], '64', '64', 'eager', 'ok'), (models[1], '64', '64', 'eager', 'ok'),
        (models[0], '96', '128', 'eager', 'ok'), (models[1], '96', '128', 'eager', 'ok')]
    assert '# detection, float32, batch 1' in capsys.readouterr().out
    assert (out / 'profile_detection_float32_b1.png').read_bytes()[:8] == PNG_MAGIC
