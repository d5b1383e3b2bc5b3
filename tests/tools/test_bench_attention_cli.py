"""tools/bench_attention.py: options, end-to-end runs, and every printed and CSV column against a scripted clock
(linvit.timing's clock, linvit.bench.attention's layers)."""
import csv

import pytest
import torch
from scripted_clock import ScriptedClock

from linvit import timing
from linvit.bench import attention
from linvit.fast import CompiledModel


def test_bench_runs_end_to_end(bench, tmp_path, capsys):
    out = tmp_path / 'bench.csv'
    assert bench.main(['--tokens', '16', '64', '--dim', '32', '--heads', '2', '--warmup', '0', '--repeats', '1',
                       '--local-mix', '--csv', str(out)]) == 0
    printed = capsys.readouterr().out
    assert 'linear/floor' in printed and 'linear attention' in printed
    rows = list(csv.DictReader(out.open()))
    assert [int(r['tokens']) for r in rows] == [16, 64]
    for r in rows:
        ratio = float(r['linear_ms']) / float(r['floor_ms'])
        assert abs(ratio - float(r['linear_over_floor'])) < 1e-9


def test_quick_sets_defaults_but_explicit_options_win(bench):
    full, quick = bench.parse_args([]), bench.parse_args(['--quick'])
    assert (full.tokens, full.warmup, full.repeats) == (attention.FULL[0], 2, 7)
    assert (quick.tokens, quick.warmup, quick.repeats) == (attention.QUICK[0], 1, 3)
    explicit = bench.parse_args(['--quick', '--warmup', '0', '--repeats', '5', '--tokens', '64'])
    assert (explicit.tokens, explicit.warmup, explicit.repeats) == ([64], 0, 5)
    assert bench.parse_args(['--repeats', '4']).warmup == 2


def test_quick_run_says_what_the_floor_is_and_what_to_run_next(bench, capsys):
    assert bench.main(['--quick', '--tokens', '16', '--dim', '32', '--heads', '2', '--repeats', '1']) == 0
    lines = capsys.readouterr().out.splitlines()
    assert '# floor = the same layer with token mixing removed: qkv + proj only' in lines[1]
    assert lines[-1].startswith('next: the full sweep: make bench; whole models vs their floors across image sizes: '
                                'python tools/profile_resolution.py ')
    assert 'median of 1 after 1 warm-up' in lines[0]


def test_bench_rejects_non_square_tokens_with_local_mix(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(['--tokens', '50', '--local-mix'])


def test_bench_compiled_layers_end_to_end(bench, capsys):
    assert bench.main(['--tokens', '16', '--dim', '32', '--heads', '2', '--warmup', '0', '--repeats', '1',
                       '--compile']) == 0
    printed = capsys.readouterr().out
    assert 'compiled (inductor)' in printed and '1 warm-up' in printed  # a compiling call is never timed
    layers = attention.build_layers(bench.parse_args(['--dim', '32', '--heads', '2', '--compile']).bench)
    assert all(isinstance(layer, CompiledModel) for layer in layers.values())


# milliseconds of one timed call per (layer, N); warm-up calls take 100x longer, the timed ones vary around these
BASE_MS = {('softmax', 16): 1.0, ('linear', 16): 2.0, ('floor', 16): 0.5,
           ('softmax', 64): 8.0, ('linear', 64): 4.0, ('floor', 64): 2.0}
REPEAT_FACTORS = [1.5, 1.0, 0.75]  # median 1.0; with the warm-up (100) counted in, the median would be 1.25


class ScriptedLayer(torch.nn.Module):
    """Runs the real layer, records its input shape and moves the clock by the scripted time of this call."""

    def __init__(self, name, layer, clock, warmup, shapes):
        super().__init__()
        self.name, self.layer, self.clock, self.warmup, self.shapes = name, layer, clock, warmup, shapes
        self.calls_at = {}

    def forward(self, x):
        out = self.layer(x)
        assert out.shape == x.shape, f"{self.name}: {tuple(out.shape)} from {tuple(x.shape)}"
        n = x.shape[1]
        i = self.calls_at.get(n, 0)
        self.calls_at[n] = i + 1
        self.shapes.append((self.name, tuple(x.shape)))
        factor = 100.0 if i < self.warmup else REPEAT_FACTORS[(i - self.warmup) % len(REPEAT_FACTORS)]
        self.clock.now += BASE_MS[self.name, n] * factor / 1e3
        return out


def _table_rows(printed: str):
    """The numeric rows of the printed table: {N: [softmax ms, linear ms, floor ms, linear/floor, softmax/linear]}."""
    rows = {}
    for line in printed.splitlines():
        cells = line.split()
        if cells and cells[0].isdigit() and len(cells) == 6:
            rows[int(cells[0])] = [float(c.rstrip('x')) for c in cells[1:]]
    return rows


def test_table_and_csv_report_the_median_of_the_timed_calls_of_each_layer(bench, tmp_path, capsys, monkeypatch):
    """Times come from a scripted clock, so every column has a value computed here without timing anything."""
    clock, shapes, warmup = ScriptedClock(), [], 1
    real_build_layers = attention.build_layers
    monkeypatch.setattr(timing, 'time', clock)
    monkeypatch.setattr(attention, 'build_layers', lambda args: {
        name: ScriptedLayer(name, layer, clock, warmup, shapes) for name, layer in real_build_layers(args).items()})
    out = tmp_path / 'bench.csv'
    assert bench.main(['--tokens', '16', '64', '--dim', '32', '--heads', '2', '--batch', '3', '--warmup', str(warmup),
                       '--repeats', '3', '--csv', str(out)]) == 0
    printed = capsys.readouterr().out
    # every layer saw [batch, N, dim] tokens, warm-up + repeats times per N, interleaved layer by layer
    assert shapes == [(name, (3, n, 32)) for n in (16, 64) for _ in range(4) for name in ('softmax', 'linear', 'floor')]
    expected = {n: [BASE_MS['softmax', n], BASE_MS['linear', n], BASE_MS['floor', n],
                    BASE_MS['linear', n] / BASE_MS['floor', n], BASE_MS['softmax', n] / BASE_MS['linear', n]]
                for n in (16, 64)}
    assert _table_rows(printed) == {n: pytest.approx(v, abs=5e-3) for n, v in expected.items()}
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == ['tokens', 'softmax_ms', 'linear_ms', 'floor_ms', 'linear_over_floor',
                             'softmax_over_linear']
    for row, n in zip(rows, (16, 64)):
        assert int(row['tokens']) == n
        assert [float(row[k]) for k in list(row)[1:]] == pytest.approx(expected[n], rel=1e-9)
    # linear attention is slower at 16 tokens and faster at 64
    assert 'linear attention beats softmax from N = 64 tokens on' in printed


def test_crossover_line_says_when_linear_never_wins(bench, capsys, monkeypatch):
    clock = ScriptedClock()
    real_build_layers = attention.build_layers
    monkeypatch.setattr(timing, 'time', clock)
    monkeypatch.setattr(attention, 'build_layers', lambda args: {
        name: ScriptedLayer(name, layer, clock, 0, []) for name, layer in real_build_layers(args).items()})
    assert bench.main(['--tokens', '16', '--dim', '32', '--heads', '2', '--warmup', '0', '--repeats', '1']) == 0
    assert 'linear attention does not beat softmax at the largest N measured' in capsys.readouterr().out
