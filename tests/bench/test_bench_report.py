"""linvit.bench.report: the comparison tables on hand-made rows, rounds merged into medians, the CSV round trip."""
import pytest
from profile_rows import hand_rows, row

from linvit.bench import report


def test_summary_ratios_crossover_growth_and_modes():
    text = '\n'.join(report.summarize(hand_rows()))
    assert '## linvit_small_patch16_224 vs vit_small_patch16_224' in text
    eager = text.split('# inference, float32, batch 1, eager')[1].split('# inference, float32, batch 1, compiled')[0]
    lines = {line.split()[0]: line.split() for line in eager.splitlines() if line.strip()[:1].isdigit()}
    # size tokens linvit floor softmax linvit/floor linvit/softmax +MiB +MiB
    assert lines['224'][1] == '197' and lines['224'][5:7] == ['0.91x', '0.80x']
    assert lines['2048'][5:7] == ['0.91x', '10.00x']
    assert 'crossover: linvit_small_patch16_224 beats vit_small_patch16_224 from 512 px (1025 tokens) on' in eager
    assert 'speedup linvit_small_patch16_224 / vit_small_patch16_224 (img/s): 224: 0.80x, 512: 1.25x' in eager
    assert 'time growth 512 -> 1024 px (4x tokens): linvit 4.00x, floor 4.23x, softmax 8.00x' in eager
    assert 'time growth 1024 -> 2048 px (4x tokens): linvit 5.00x, floor 4.73x, softmax 20.00x' in eager
    compiled = text.split('# inference, float32, batch 1, compiled')[1].split('compiled / eager')[0]
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


def test_rounds_merge_into_medians_and_failed_rounds_drop_out():
    rounds = []
    for r, (a, b, status) in enumerate([(10., 8., 'ok'), (20., 4., 'ok'), (12., 5., 'timeout')]):
        for one in (row('linvit_small_patch16_224', 'linvit', 512, a),
                    row('vit_small_patch16_224', 'softmax', 512, b, status=status)):
            ok = one['status'] == 'ok'
            rounds.append({**one, 'round': r, 'first_call_ms': float(r) if ok else None,
                           'p90_ms': 2e3 / one['img_per_s'] if ok else None})
    merged = {one['model']: one for one in report.aggregate_rounds(rounds)}
    lin, soft = merged['linvit_small_patch16_224'], merged['vit_small_patch16_224']
    assert lin['rounds'] == 3 and lin['img_per_s'] == pytest.approx(12.) and lin['median_ms'] == pytest.approx(1e3 / 12)
    assert lin['p90_ms'] == pytest.approx(2e3 / 12) and lin['first_call_ms'] == 1.0 and lin['peak_mem_mib'] == 1212.
    assert soft['rounds'] == 2 and soft['median_ms'] == pytest.approx((125. + 250.) / 2)  # the timeout is dropped
    assert soft['img_per_s'] == pytest.approx(1e3 / 187.5)
    assert 'median over 3 rounds' in '\n'.join(report.summarize(rounds))
    only_failures = [{**row('vit_small_patch16_224', 'softmax', 512, 1., status='oom'), 'round': r} for r in (0, 1)]
    assert [(r['status'], r['rounds']) for r in report.aggregate_rounds(only_failures)] == [('oom', 0)]


def test_csv_round_trip_parses_numbers_and_empty_cells(tmp_path):
    path = str(tmp_path / 'profile.csv')
    rows = hand_rows()
    report.write_csv(path, rows)
    back = report.read_csv(path)
    assert [(r['model'], r['height'], r['img_per_s'], r['added_mem_mib']) for r in back] == [
        (r['model'], r['height'], r['img_per_s'], r['added_mem_mib']) for r in rows]
    assert report.summarize(back) == report.summarize(rows)


def test_failures_are_listed_errors_first():
    rows = [row('a', 'softmax', 32, 1.), {**row('b', 'softmax', 32, 1., status='oom'), 'error': 'CUDA OOM'},
            {**row('c', 'softmax', 32, 1., status='error'), 'error': 'ValueError: no'}]
    assert report.failure_lines(rows) == [
        '\n# 1 of 3 configurations failed:', 'c 32 b1 float32 eager inference: ERROR ValueError: no',
        '\n# 1 of 3 configurations out of memory or time:', 'b 32 b1 float32 eager inference: OOM CUDA OOM']


def test_memory_table_gives_peak_and_time_per_token_with_the_status_where_a_model_ran_out():
    rows = [r for r in hand_rows() if r['mode'] == 'compiled']
    lines = report.memory_summary(report.aggregate_rounds(rows))
    peak = {line.split()[0]: line.split()[2:] for line in lines[:4]}
    assert lines[0].split() == ['peak', 'MiB', '224', '512', '1024', '2048']
    assert peak['vit_small_patch16_224'] == ['924', '1212', '1724', 'oom']  # 700 + side; out of memory at 2048
    per_token = {line.split()[0]: line.split()[2:] for line in lines[4:]}
    # linvit compiled at 224 px: 80 img/s -> 12.5 ms over 197 tokens = 63.452 us per token
    assert per_token['linvit_small_patch16_224'][0] == f"{12.5e3 / 197:.3f}"
