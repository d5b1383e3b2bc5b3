"""tools/bench_attention.py: the crossover rule, the floor layer and an end-to-end run."""
import csv

import pytest
import torch
from timm.layers import Attention

from linvit.fast import CompiledModel
from linvit.layers import NoMixingAttention


def _rows(pairs):
    return [{'tokens': n, 'softmax_ms': s, 'linear_ms': lin} for n, s, lin in pairs]


def test_crossover_is_the_start_of_the_final_winning_run(bench):
    assert bench.crossover(_rows([(49, 1, 2), (196, 2, 1), (256, 3, 4), (576, 9, 5), (1024, 30, 9)])) == 576
    assert bench.crossover(_rows([(49, 1, 0.5), (196, 2, 1)])) == 49
    assert bench.crossover(_rows([(49, 1, 2), (196, 2, 3)])) is None


def test_floor_returns_projected_values():
    torch.manual_seed(0)
    softmax = Attention(32, 4, qkv_bias=True)
    floor = NoMixingAttention(32, 4, qkv_bias=True)
    floor.load_state_dict(softmax.state_dict())
    x = torch.randn(2, 9, 32)
    v = x @ softmax.qkv.weight[64:].T + softmax.qkv.bias[64:]
    torch.testing.assert_close(floor(x), v @ softmax.proj.weight.T + softmax.proj.bias)


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
    assert (full.tokens, full.warmup, full.repeats) == (bench.FULL[0], 2, 7)
    assert (quick.tokens, quick.warmup, quick.repeats) == (bench.QUICK[0], 1, 3)
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
    layers = bench.build_layers(bench.parse_args(['--dim', '32', '--heads', '2', '--compile']))
    assert all(isinstance(layer, CompiledModel) for layer in layers.values())
