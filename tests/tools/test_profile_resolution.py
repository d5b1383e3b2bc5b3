"""tools/profile_resolution.py: argument parsing, the comparison logic on hand-made rows, failure rows and the exit
status, the plot's labels, and tiny end-to-end sweeps in subprocesses that write the CSV and the PNG."""
import argparse
import csv
import json
import os
from pathlib import Path

import pytest
from scripted_clock import ScriptedClock, float_cells, in_process

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def test_sizes_accept_square_and_height_by_width(prof):
    assert prof.parse_size('224') == (224, 224)
    assert prof.parse_size('384x640') == (384, 640)
    for bad in ('', 'x', '0', '224x', '1x2x3', 'abc'):
        with pytest.raises(argparse.ArgumentTypeError):
            prof.parse_size(bad)
    assert prof.parse_args(['--sizes', '2048', '384x640']).sizes == [(2048, 2048), (384, 640)]


def test_model_specs_parse_kwargs_as_literals(prof):
    spec = prof.parse_model_spec("linvit_small_patch16_224:local_mix=False,softmax_blocks=(0, 6),attn_kernel=relu")
    assert spec.name == 'linvit_small_patch16_224' and spec.kind == 'linear'
    assert dict(spec.kwargs) == {'local_mix': False, 'softmax_blocks': (0, 6), 'attn_kernel': 'relu'}
    assert spec.as_floor().label == f"floor({spec.spec})" and spec.as_floor().kind == 'floor'
    assert prof.parse_model_spec('vit_small_patch16_224').kind == 'softmax'
    with pytest.raises(ValueError):
        prof.parse_model_spec('vit_small_patch16_224:depth')
    # tuples survive the trip to the child process as tuples
    config = prof.Config(spec, 384, 640, 2, 'bf16', 'compiled', 'train', 'cpu', 1, 3)
    assert prof.Config.from_json(config.to_json()) == config


def test_sweep_is_size_major_with_floors(prof):
    args = prof.parse_args(['--models', 'linvit_tiny_patch16_224', 'vit_tiny_patch16_224', '--sizes', '512', '224',
                            '--mode', 'eager', '--floors', 'linear'])
    configs = prof.build_configs(args)
    assert [(c.height, c.model.label) for c in configs] == [
        (224, 'linvit_tiny_patch16_224'), (224, 'vit_tiny_patch16_224'), (224, 'floor(linvit_tiny_patch16_224)'),
        (512, 'linvit_tiny_patch16_224'), (512, 'vit_tiny_patch16_224'), (512, 'floor(linvit_tiny_patch16_224)')]
    assert len(prof.build_configs(prof.parse_args(['--floors', 'all']))) == 4 * 4 * 2
    for bad in (['--rounds', '0'], ['--warmup', '0'], ['--models', 'vit_small_patch16_224:depth']):
        with pytest.raises(SystemExit):
            prof.parse_args(bad)


def test_counterpart_pairs_linvit_with_its_softmax_model(prof):
    softmax = ['vit_base_patch16_224', 'vit_small_patch16_224']
    assert prof.counterpart('linvit_small_patch16_224', softmax) == 'vit_small_patch16_224'
    assert prof.counterpart('linvit_small_patch16_512', softmax) == 'vit_small_patch16_224'
    assert prof.counterpart('linvit_tiny_patch16_224', ['deit_tiny_patch16_224']) == 'deit_tiny_patch16_224'
    assert prof.counterpart('linvit_tiny_patch16_224', softmax) is None
    assert prof.counterpart('linvit_tiny_patch16_224', []) is None


def test_crossover_is_the_start_of_the_final_winning_run(prof):
    assert prof.crossover([(224, 1, 2), (512, 3, 2), (768, 1, 2), (1024, 5, 2), (2048, 9, 1)]) == 1024
    assert prof.crossover([(224, 2, 1), (512, 3, 2)]) == 224
    assert prof.crossover([(224, 1, 2), (512, 2, 2)]) is None  # a tie is no win
    assert prof.crossover([(224, 1, 2), (512, 3, None)]) == 512  # softmax out of memory: linvit wins
    assert prof.crossover([(224, 3, 2), (512, None, 1)]) is None


def test_percentile_is_nearest_rank(prof):
    assert prof.percentile([5.0], 90) == 5.0
    assert prof.percentile(list(range(1, 11)), 90) == 9
    assert prof.percentile([3, 1, 2], 50) == 2


def _row(model, kind, size, img_per_s, mode='eager', status='ok', name=None):
    ok = status == 'ok'
    return {'model': model, 'name': name or model.replace('floor(', '').rstrip(')'), 'kind': kind, 'height': size,
            'width': size, 'tokens': (size // 16) ** 2 + 1, 'batch': 1, 'dtype': 'fp32', 'mode': mode,
            'task': 'infer', 'device': 'cpu', 'status': status, 'img_per_s': img_per_s if ok else None,
            'median_ms': 1e3 / img_per_s if ok else None,
            'peak_mem_mib': (700.0 + size) * (0.8 if kind == 'floor' else 1.0) if ok else None,
            'added_mem_mib': size / 8 if ok else None, 'threads': 2, 'machine': 'Test CPU, 2 CPUs'}


def hand_rows():
    """linvit / its floor / softmax img/s at 4 sizes; softmax runs out of memory at 2048 in compiled mode."""
    lin, fl, sm = 'linvit_small_patch16_224', 'floor(linvit_small_patch16_224)', 'vit_small_patch16_224'
    table = {224: (40., 44., 50.), 512: (10., 11., 8.), 1024: (2.5, 2.6, 1.), 2048: (0.5, 0.55, 0.05)}
    rows = []
    for size, (a, b, c) in table.items():
        rows += [_row(lin, 'linear', size, a), _row(fl, 'floor', size, b), _row(sm, 'softmax', size, c)]
        rows += [_row(lin, 'linear', size, 2 * a, 'compiled'), _row(fl, 'floor', size, 2 * b, 'compiled'),
                 _row(sm, 'softmax', size, c, 'compiled', status='oom' if size == 2048 else 'ok')]
    return rows


def test_summary_ratios_crossover_growth_and_modes(prof):
    text = '\n'.join(prof.summarize(hand_rows()))
    assert '## linvit_small_patch16_224 vs vit_small_patch16_224' in text
    eager = text.split('# infer, fp32, batch 1, eager')[1].split('# infer, fp32, batch 1, compiled')[0]
    lines = {line.split()[0]: line.split() for line in eager.splitlines() if line.strip()[:1].isdigit()}
    # size tokens linvit floor softmax linvit/floor linvit/softmax +MiB +MiB
    assert lines['224'][1] == '197' and lines['224'][5:7] == ['0.91x', '0.80x']
    assert lines['2048'][5:7] == ['0.91x', '10.00x']
    assert 'crossover: linvit_small_patch16_224 beats vit_small_patch16_224 from 512 px (1025 tokens) on' in eager
    assert 'speedup linvit_small_patch16_224 / vit_small_patch16_224 (img/s): 224: 0.80x, 512: 1.25x' in eager
    assert 'time growth 512 -> 1024 px (4x tokens): linvit 4.00x, floor 4.23x, softmax 8.00x' in eager
    assert 'time growth 1024 -> 2048 px (4x tokens): linvit 5.00x, floor 4.73x, softmax 20.00x' in eager
    compiled = text.split('# infer, fp32, batch 1, compiled')[1].split('compiled / eager')[0]
    lines = {line.split()[0]: line.split() for line in compiled.splitlines() if line.strip()[:1].isdigit()}
    # memory added by the calls, then the ratio of the calls' peaks (floor rows hold 0.8x)
    assert lines['2048'][2:] == ['1.00', '1.10', 'oom', '0.91x', '-', '256', 'oom', '1.25x']
    # softmax out of memory at the largest size counts as a win for linvit
    assert 'beats vit_small_patch16_224 from 224 px (197 tokens) on' in compiled
    assert '1024: 5.00x, 2048: linvit ok, softmax oom' in compiled
    modes = text.split('compiled / eager img/s')[1].splitlines()
    assert modes[1].split() == ['compiled/eager', '224', '512', '1024', '2048']
    assert modes[2].split() == ['linvit_small_patch16_224', '2.00x', '2.00x', '2.00x', '2.00x']
    assert modes[4].split() == ['vit_small_patch16_224', '1.00x', '1.00x', '1.00x', '-']


def test_rounds_merge_into_medians_and_failed_rounds_drop_out(prof):
    rounds = []
    for r, (a, b, status) in enumerate([(10., 8., 'ok'), (20., 4., 'ok'), (12., 5., 'timeout')]):
        for row in (_row('linvit_small_patch16_224', 'linear', 512, a),
                    _row('vit_small_patch16_224', 'softmax', 512, b, status=status)):
            ok = row['status'] == 'ok'
            rounds.append({**row, 'round': r, 'first_call_ms': float(r) if ok else None,
                           'p90_ms': 2e3 / row['img_per_s'] if ok else None})
    merged = {row['model']: row for row in prof.aggregate_rounds(rounds)}
    lin, soft = merged['linvit_small_patch16_224'], merged['vit_small_patch16_224']
    assert lin['rounds'] == 3 and lin['img_per_s'] == pytest.approx(12.) and lin['median_ms'] == pytest.approx(1e3 / 12)
    assert lin['p90_ms'] == pytest.approx(2e3 / 12) and lin['first_call_ms'] == 1.0 and lin['peak_mem_mib'] == 1212.
    assert soft['rounds'] == 2 and soft['median_ms'] == pytest.approx((125. + 250.) / 2)  # the timeout is dropped
    assert soft['img_per_s'] == pytest.approx(1e3 / 187.5)
    assert 'median over 3 rounds' in '\n'.join(prof.summarize(rounds))
    only_failures = [{**_row('vit_small_patch16_224', 'softmax', 512, 1., status='oom'), 'round': r} for r in (0, 1)]
    assert [(r['status'], r['rounds']) for r in prof.aggregate_rounds(only_failures)] == [('oom', 0)]


def test_training_step_is_measured_in_process(prof):
    spec = prof.parse_model_spec('linvit_tiny_patch16_224:depth=1')
    config = prof.Config(spec, 32, 48, 2, 'bf16', 'eager', 'train', 'cpu', 1, 2)
    result = prof.measure(config)
    assert result['tokens'] == 7 and result['img_per_s'] == pytest.approx(2e3 / result['median_ms'])
    assert result['p90_ms'] >= result['median_ms'] > 0 and result['first_call_ms'] > 0
    # the calls' own peak sits on top of the memory held after building, within the process's peak
    assert result['added_mem_mib'] >= 0 and result['base_mem_mib'] > 50
    assert result['peak_mem_mib'] >= result['base_mem_mib'] + result['added_mem_mib'] - 1e-6
    assert result['machine'].endswith(f"{os.cpu_count()} CPUs")


def test_close_sizes_get_their_tick_labels_one_below_the_other(prof):
    assert prof._staggered({224.0: 'a', 495.8: 'b', 512.0: 'c', 540.0: 'd', 1024.0: 'e'}) == [
        'a', 'b', '\n\nc', 'd', 'e']


def test_plot_writes_one_png_per_task_dtype_batch(prof, tmp_path):
    paths = prof.plot(hand_rows(), str(tmp_path))
    assert [Path(p).name for p in paths] == ['profile_infer_fp32_b1.png']
    assert Path(paths[0]).read_bytes()[:8] == PNG_MAGIC


def test_failures_become_rows(prof, capsys):
    spec = prof.parse_model_spec('no_such_model_anywhere')
    config = prof.Config(spec, 32, 32, 1, 'fp32', 'eager', 'infer', 'cpu', 1, 1)
    row = prof.run_config(config, timeout=0.01)
    assert row['status'] == 'timeout' and row['model'] == 'no_such_model_anywhere'
    assert prof.child_main(config.to_json()) == 0  # in this process: an unknown model is an error row
    result = json.loads(capsys.readouterr().out.strip().split(prof.RESULT_MARK)[1])
    assert result['status'] == 'error' and 'no_such_model_anywhere' in result['error']


def test_failed_configurations_are_listed_and_make_the_exit_status_1(prof, tmp_path, capsys):
    out = tmp_path / 'prof'
    status = prof.main(['--models', 'nope_model', '--sizes', '32', '--floors', 'none', '--mode', 'eager',
                        '--warmup', '1', '--repeats', '1', '--out', str(out)])
    printed = capsys.readouterr().out
    assert status == 1
    failures = printed.split('# 1 of 1 configurations failed:')[1].strip().splitlines()
    assert len(failures) == 1 and failures[0].startswith('nope_model 32 b1 fp32 eager infer: ERROR ')
    assert 'nope_model' in failures[0][len('nope_model 32 b1 fp32 eager infer: ERROR '):]  # the child's message
    rows = list(csv.DictReader((out / 'profile.csv').open()))
    assert [(r['model'], r['status']) for r in rows] == [('nope_model', 'error')] and 'nope_model' in rows[0]['error']


def _runs_nothing(prof, status, error):
    """A stand-in for run_config: every configuration ends with ``status`` at once, no process started."""
    def run_config(config, timeout, retain_freed_memory=False):
        return {**prof.base_row(config), 'status': status, 'error': error}
    return run_config


def test_running_out_of_memory_or_time_is_a_result_not_a_failure(prof, tmp_path, capsys, monkeypatch):
    argv = ['--models', 'vit_tiny_patch16_224', '--sizes', '32', '--floors', 'none', '--mode', 'eager',
            '--out', str(tmp_path)]
    monkeypatch.setattr(prof, 'run_config', _runs_nothing(prof, 'timeout', 'no result within 1 s'))
    assert prof.main(argv) == 0
    listed = capsys.readouterr().out.split('# 1 of 1 configurations out of memory or time:')[1].strip()
    assert listed == 'vit_tiny_patch16_224 32 b1 fp32 eager infer: TIMEOUT no result within 1 s'
    monkeypatch.setattr(prof, 'run_config', _runs_nothing(prof, 'error', 'RuntimeError: boom'))
    assert prof.main(argv) == 1
    assert 'vit_tiny_patch16_224 32 b1 fp32 eager infer: ERROR RuntimeError: boom' in capsys.readouterr().out


def test_summarize_writes_the_png_next_to_the_csv_unless_out_is_given(prof, tmp_path, capsys):
    run = tmp_path / 'run'
    run.mkdir()
    prof.write_csv(str(run / 'profile.csv'), hand_rows())
    assert prof.main(['--summarize', str(run / 'profile.csv')]) == 0
    assert f"wrote {run / 'profile_infer_fp32_b1.png'}" in capsys.readouterr().out
    assert (run / 'profile_infer_fp32_b1.png').read_bytes()[:8] == PNG_MAGIC
    (run / 'profile_infer_fp32_b1.png').unlink()
    assert prof.main(['--summarize', str(run / 'profile.csv'), '--out', str(tmp_path / 'elsewhere')]) == 0
    assert (tmp_path / 'elsewhere' / 'profile_infer_fp32_b1.png').exists()
    assert not (run / 'profile_infer_fp32_b1.png').exists()


def test_summarize_reads_csvs_with_the_old_unit_columns(prof, tmp_path):
    old = tmp_path / 'old.csv'
    fields = ['model', 'kind', 'height', 'width', 'tokens', 'batch', 'status', 'median_ms', 'peak_mem_mb',
              'base_mem_mb', 'first_call_s']
    with old.open('w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerow(dict(zip(fields, ['m', 'linear', 224, 224, 197, 1, 'ok', 12.5, 900.5, 820.0, 1.25])))
        writer.writerow(dict(zip(fields, ['m', 'linear', 512, 512, 1025, 1, 'oom', '', '', '', ''])))
    ok, oom = prof.read_csv(str(old))
    assert (ok['peak_mem_mib'], ok['base_mem_mib'], ok['first_call_ms']) == (900.5, 820.0, 1250.0)
    assert ok['added_mem_mib'] == pytest.approx(80.5)  # old CSVs had no such column: peak - base
    assert all(key not in ok for key in ('peak_mem_mb', 'base_mem_mb', 'first_call_s'))
    assert (oom['peak_mem_mib'], oom['added_mem_mib'], oom['first_call_ms']) == (None, None, None)


def test_plot_labels_sizes_in_pixels_and_tokens_with_the_legend_outside(prof):
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    group = [r for r in prof.aggregate_rounds(hand_rows()) if r['status'] == 'ok']
    fig = prof.throughput_figure(group)
    try:
        ax_speed, ax_mem = fig.axes
        fig.canvas.draw()
        for ax in (ax_speed, ax_mem):
            assert [t.get_text() for t in ax.get_xticklabels()] == [
                '224 px\n197 tok', '512 px\n1,025 tok', '1024 px\n4,097 tok', '2048 px\n16,385 tok']
            assert ax.get_legend() is None
            y_labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
            assert y_labels and not any('10^' in t or 'e-' in t or 'e+' in t for t in y_labels)
        assert ax_speed.get_yscale() == 'log' and 'added by the forward' in ax_mem.get_ylabel()
        [mem_line] = [line for line in ax_mem.get_lines() if line.get_label() == 'vit_small_patch16_224 [eager]']
        assert list(mem_line.get_ydata()) == [224 / 8, 512 / 8, 1024 / 8, 2048 / 8]  # added_mem_mib, not the peak
        [legend] = fig.legends  # one legend, below the panels: models left, their floors right, mode markers last
        assert [t.get_text() for t in legend.get_texts()] == [
            'linvit_small_patch16_224', 'vit_small_patch16_224', 'eager',
            'floor(linvit_small_patch16_224)', '', 'compiled']
        title = fig._suptitle.get_text()
        assert title.startswith('inference, fp32, batch 1, eager and compiled') and 'Test CPU, 2 CPUs' in title
    finally:
        plt.close(fig)


def test_profile_runs_end_to_end(prof, tmp_path, capsys):
    out = tmp_path / 'prof'
    models = ['linvit_tiny_patch16_224:depth=1,local_mix=False', 'vit_tiny_patch16_224:depth=1']
    assert prof.main(['--models', *models, '--sizes', '32', '32x48', '--mode', 'eager', '--floors', 'linear',
                      '--warmup', '1', '--repeats', '1', '--out', str(out)]) == 0
    printed = capsys.readouterr().out
    assert 'linvit/floor' in printed and 'crossover: ' in printed and 'time growth' not in printed
    rows = list(csv.DictReader((out / 'profile.csv').open()))
    assert [(r['model'], r['height'], r['width'], r['status']) for r in rows] == [
        (models[0], '32', '32', 'ok'), (models[1], '32', '32', 'ok'), (f"floor({models[0]})", '32', '32', 'ok'),
        (models[0], '32', '48', 'ok'), (models[1], '32', '48', 'ok'), (f"floor({models[0]})", '32', '48', 'ok')]
    assert [r['tokens'] for r in rows] == ['5'] * 3 + ['7'] * 3  # class token + 2x2 / 2x3 patches
    for r in rows:
        assert float(r['img_per_s']) == pytest.approx(1e3 / float(r['median_ms']))
        assert float(r['p90_ms']) >= float(r['median_ms']) > 0 and float(r['peak_mem_mib']) > 50
        assert float(r['base_mem_mib']) > 50 and 0 <= float(r['added_mem_mib']) < float(r['peak_mem_mib'])
    assert list(rows[0]) == prof.CSV_FIELDS
    assert (out / 'profile_infer_fp32_b1.png').read_bytes()[:8] == PNG_MAGIC
    # the summary of a finished run can be re-printed from its CSV
    assert prof.main(['--summarize', str(out / 'profile.csv'), '--out', str(tmp_path / 'again')]) == 0
    assert 'linvit/floor' in capsys.readouterr().out


def test_retain_freed_memory_reaches_the_child_and_the_csv(prof):
    spec = prof.parse_model_spec('linvit_tiny_patch16_224:depth=1')
    config = prof.Config(spec, 32, 32, 1, 'fp32', 'eager', 'infer', 'cpu', 1, 1)
    retained = prof.run_config(config, timeout=300, retain_freed_memory=True)
    inherited = prof.run_config(config, timeout=300)
    assert (retained['status'], retained['allocator']) == ('ok', 'retain')
    assert (inherited['status'], inherited['allocator']) == ('ok', prof.allocator_setting())  # the parent's own
    assert 'allocator' in prof.CSV_FIELDS


# ---------------------------------------------------------------- measured values against a scripted clock

# 2 warm-up calls, then 10 timed: median (30 + 35) / 2, nearest-rank p90 the 9th smallest (50, not the largest)
FORWARD_MS = [500., 50., 30., 10., 20., 50., 40., 35., 25., 15., 45., 60.]


@pytest.mark.parametrize('task', ['infer', 'train'])
@pytest.mark.parametrize('spec, floor, tokens', [
    ('linvit_tiny_patch16_224:depth=1,reg_tokens=4', False, 1 + 4 + 2 * 3),  # class token, registers, 2x3 patches
    ('linvit_tiny_patch16_224:depth=1,reg_tokens=4', True, 1 + 4 + 2 * 3),
    ('vit_tiny_patch16_224:depth=1,class_token=False,global_pool=avg', False, 2 * 3),
])
def test_measure_reports_the_forward_times_per_image_and_the_token_count(prof, monkeypatch, spec, floor, tokens,
                                                                         task):
    clock = ScriptedClock(lambda name, is_floor, h, w, i: FORWARD_MS[i])
    clock.install(monkeypatch, prof)
    model = prof.parse_model_spec(spec)
    config = prof.Config(model.as_floor() if floor else model, 32, 48, 2, 'fp32', 'eager', task, 'cpu', 2, 10)
    result = prof.child_result(config)
    assert result['status'] == 'ok', result.get('error')
    assert result['tokens'] == tokens
    assert (result['first_call_ms'], result['median_ms'], result['p90_ms']) == pytest.approx((500., 32.5, 50.))
    assert result['img_per_s'] == pytest.approx(2 / 0.0325)  # batch 2 in 32.5 ms
    # the model (its floor when asked) saw [batch, 3, H, W] images, warm-up + repeats times
    assert clock.inputs == [(model.name, floor, (2, 3, 32, 48))] * 12


# milliseconds of one forward by (model, floor, image side); warm-up calls take 1 s, timed calls vary around these
TABLE_MS = {('linvit_tiny_patch16_224', False, 32): 20., ('linvit_tiny_patch16_224', True, 32): 10.,
            ('vit_tiny_patch16_224', False, 32): 10., ('linvit_tiny_patch16_224', False, 64): 60.,
            ('linvit_tiny_patch16_224', True, 64): 40., ('vit_tiny_patch16_224', False, 64): 100.}


def table_forward_ms(name, floor, height, width, call):
    return 1e3 if call == 0 else TABLE_MS[name, floor, height] * [1.2, 1.0, 0.8][(call - 1) % 3]


def test_printed_table_and_csv_are_the_scripted_throughputs(prof, tmp_path, capsys, monkeypatch):
    ScriptedClock(table_forward_ms).install(monkeypatch, prof)
    monkeypatch.setattr(prof, 'run_config', in_process(prof))
    models = ['linvit_tiny_patch16_224:depth=1,local_mix=False', 'vit_tiny_patch16_224:depth=1']
    assert prof.main(['--models', *models, '--sizes', '32', '64', '--mode', 'eager', '--floors', 'linear',
                      '--warmup', '1', '--repeats', '3', '--out', str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rows = {(r['model'], int(r['height'])): r for r in csv.DictReader((tmp_path / 'profile.csv').open())}
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


@pytest.mark.skipif(not os.path.exists('/proc/self/clear_refs'), reason='needs Linux /proc to restart the peak')
def test_the_peak_is_the_timed_calls_own_not_the_warm_ups(prof):
    """A warm-up that held 400 MiB (a compile, a first-call cache) and freed it leaves no trace in the peak."""
    import torch

    watch = prof.MemoryWatch(torch.device('cpu'))
    watch.start()
    big = torch.ones(400 * 2 ** 20 // 4)  # touched pages: resident
    del big
    watch.steady()
    small = torch.ones(8 * 2 ** 20 // 4)
    result = watch.result()
    del small
    assert result['peak_mem_mib'] < watch.base + 200
    assert result['added_mem_mib'] == pytest.approx(max(0.0, result['peak_mem_mib'] - watch.base))


def test_measure_restarts_the_peak_between_warm_up_and_timed_calls(prof, monkeypatch):
    events = []

    class SpyWatch(prof.MemoryWatch):
        def start(self) -> None:
            events.append('start')
            super().start()

        def steady(self) -> None:
            events.append('steady')
            super().steady()

    monkeypatch.setattr(prof, 'MemoryWatch', SpyWatch)
    spec = prof.parse_model_spec('linvit_tiny_patch16_224:depth=1')
    prof.measure(prof.Config(spec, 32, 32, 1, 'fp32', 'eager', 'train', 'cpu', 1, 1))
    assert events == ['start', 'steady']
