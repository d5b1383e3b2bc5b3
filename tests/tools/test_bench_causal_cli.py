"""tools/bench_causal.py: every form and variant runs and is reported, the parallel form is skipped where it would not
fit, saved bytes and the recurrent state's size are what the shapes say."""
import csv

import pytest


def test_table_covers_every_variant_and_size(causal_bench, tmp_path, capsys):
    out = tmp_path / 'causal.csv'
    causal_bench.main(['--tokens', '40', '100', '--heads', '2', '--head-dim', '8', '--warmup', '0', '--repeats', '1',
                       '--recurrent-tokens', '20', '--csv', str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [(r['variant'], int(r['tokens'])) for r in rows] == [
        (v, n) for v in ('plain', 'decay', 'gate') for n in (40, 100)]
    for row in rows:
        assert float(row['chunked_ms']) > 0 and float(row['parallel_ms']) > 0 and float(row['noncausal_ms']) > 0
        # the chunked Function keeps ~2.5-3.5x the bytes of q, k, v whatever N; the parallel form's N x N grows
        assert 1.0 < float(row['saved_chunked_x_qkv']) < 4.0
    plain = {int(r['tokens']): float(r['saved_parallel_x_qkv']) for r in rows if r['variant'] == 'plain'}
    assert plain[100] > plain[40]
    text = capsys.readouterr().out
    # B1 H2 state [D=8, Dv+1=9] float32 = 576 bytes, the same at every step
    assert '20 tokens' in text and 'state 0.6 KiB at every step' in text


def test_parallel_is_skipped_where_it_would_not_fit(causal_bench, tmp_path, capsys):
    out = tmp_path / 'causal.csv'
    causal_bench.main(['--tokens', '64', '--heads', '1', '--head-dim', '4', '--variants', 'gate', '--warmup', '0',
                       '--repeats', '1', '--recurrent-tokens', '0', '--max-parallel-gib', '1e-6', '--csv', str(out)])
    row = next(csv.DictReader(out.open()))
    assert row['parallel_ms'] == '' and float(row['chunked_ms']) > 0
    assert 'too big' in capsys.readouterr().out


def test_bad_options_are_refused(causal_bench):
    with pytest.raises(SystemExit):
        causal_bench.parse_args(['--tokens', '0'])
    with pytest.raises(SystemExit):
        causal_bench.parse_args(['--repeats', '0'])
