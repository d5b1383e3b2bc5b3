"""tools/bench_train_step.py: interleaved training steps of linvit, its floor and softmax, against a scripted clock
(linvit.bench.train_step over linvit.timing)."""
import csv

import pytest
import timm
import torch
from scripted_clock import ScriptedClock, float_cells

from linvit import timing

STEP_MS = {('linvit_tiny_patch16_224', False): 40., ('linvit_tiny_patch16_224', True): 30.,
           ('vit_tiny_patch16_224', False): 120.}


def scripted_step_ms(name, is_floor, height, width, call):
    # the first (warm-up) step is slow and must not count; timed steps alternate around the median
    return 1e4 if call == 0 else STEP_MS[name, is_floor] * [1.1, 1.0, 0.9][call % 3]


def test_table_and_csv_are_the_scripted_step_times(step_bench, tmp_path, capsys, monkeypatch):
    clock = ScriptedClock(scripted_step_ms)
    clock.install(monkeypatch, timing)  # the steps are timed by linvit.timing's interleaving
    out = tmp_path / 'steps.csv'
    assert step_bench.main(['--model', 'linvit_tiny_patch16_224:depth=1', '--sizes', '32', '32x48', '--batch', '2',
                            '--mode', 'eager', '--repeats', '3', '--csv', str(out)]) == 0
    printed = capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    assert [(r['size'], r['mode']) for r in rows] == [('32', 'eager'), ('32x48', 'eager')]
    for r in rows:
        assert [float(r[k]) for k in ('linvit_ms', 'floor_ms', 'softmax_ms')] == pytest.approx([40., 30., 120.])
        assert float(r['linvit_img_per_s']) == pytest.approx(2e3 / 40)
        assert float(r['linvit_over_floor']) == pytest.approx(0.75)
        assert float(r['linvit_over_softmax']) == pytest.approx(3.0)
    lines = [line for line in printed.splitlines() if line.split()[:1] in (['32'], ['32x48'])]
    assert float_cells(lines[0].replace('eager', ''))[2:] == pytest.approx([40, 30, 120, 0.75, 3.0])
    # interleaved: every round steps linvit, its floor, softmax in turn (1 warm-up + 3 timed rounds per size)
    order = [(name, floor) for name, floor, _ in clock.inputs]
    assert order == [('linvit_tiny_patch16_224', False), ('linvit_tiny_patch16_224', True),
                     ('vit_tiny_patch16_224', False)] * 8
    assert {shape for _, _, shape in clock.inputs} == {(2, 3, 32, 32), (2, 3, 32, 48)}


def test_runs_end_to_end_compiled_without_softmax(step_bench, tmp_path, capsys):
    out = tmp_path / 'steps.csv'
    assert step_bench.main(['--model', 'linvit_tiny_patch16_224:depth=1,embed_dim=48,num_heads=3', '--softmax',
                            'none', '--sizes', '32', '--batch', '1', '--mode', 'compiled', '--repeats', '1',
                            '--csv', str(out)]) == 0
    (row,) = list(csv.DictReader(out.open()))
    assert row['softmax_ms'] == '' and row['linvit_over_softmax'] == ''
    assert float(row['linvit_over_floor']) == pytest.approx(float(row['floor_ms']) / float(row['linvit_ms']))


@pytest.mark.parametrize('argv, message', [
    (['--model', 'vit_small_patch16_224'], 'must be a linvit_'),
    (['--softmax', 'vit_nonexistent'], "'vit_nonexistent' is not a timm model"),
    (['--repeats', '0'], 'must be >= 1'),
])
def test_bad_options_are_refused_with_the_reason(step_bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        step_bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_inference_workload_times_eval_forwards_under_inference_mode(step_bench, tmp_path, capsys, monkeypatch):
    """--workload inference: one forward per model and round (no backward: the clock would see no difference, so
    the test records how each forward ran), models in eval mode, inference_mode on, images in the model's dtype."""
    clock = ScriptedClock(scripted_step_ms)
    clock.install(monkeypatch, timing)
    seen = []
    scripted_create = timm.create_model

    def create_model(name, *args, **kwargs):
        model = scripted_create(name, *args, **kwargs)
        model.register_forward_pre_hook(lambda module, inputs: seen.append(
            (module.training, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), inputs[0].dtype)))
        return model

    monkeypatch.setattr(timm, 'create_model', create_model)
    out = tmp_path / 'infer.csv'
    assert step_bench.main(['--workload', 'inference', '--model', 'linvit_tiny_patch16_224:depth=1', '--sizes', '32',
                            '--batch', '1', '--mode', 'eager', '--repeats', '3', '--csv', str(out)]) == 0
    printed = capsys.readouterr().out
    (row,) = list(csv.DictReader(out.open()))
    assert row['workload'] == 'inference'
    assert [float(row[k]) for k in ('linvit_ms', 'floor_ms', 'softmax_ms')] == pytest.approx([40., 30., 120.])
    assert float(row['linvit_over_floor']) == pytest.approx(0.75)
    assert float(row['linvit_img_per_s']) == pytest.approx(1e3 / 40)
    assert '# inference step (forward under inference_mode)' in printed
    assert seen and set(seen) == {(False, True, False, torch.float32)}
    assert len(clock.inputs) == 3 * 4  # three models, 1 warm-up + 3 timed rounds, one forward each


def test_an_unknown_workload_is_refused_by_the_library():
    from linvit.bench.specs import parse_model_spec
    from linvit.bench.train_step import TrainStepBench
    with pytest.raises(ValueError, match=r"--workload must be one of \['training', 'inference'\], got 'serving'"):
        TrainStepBench(parse_model_spec('linvit_tiny_patch16_224'), workload='serving')


def test_compiled_bfloat16_inference_runs_end_to_end_and_profile_ops_prints_where_its_step_goes(step_bench, capsys,
                                                                                              tmp_path):
    import torch._inductor.config as inductor_config
    out = tmp_path / 'infer.csv'
    # the tool turns kernel profiling on for the process: restore it with the config's own patch (pytest's
    # monkeypatch deletes the key of inductor's config on undo, and every later compile in the worker then fails)
    with inductor_config.patch({'cpp.enable_kernel_profile': False}):
        assert step_bench.main(['--workload', 'inference', '--model', 'linvit_tiny_patch16_224:depth=1,embed_dim=48,'
                                'num_heads=3', '--softmax', 'none', '--sizes', '32', '--batch', '1', '--mode',
                                'compiled', '--dtype', 'bfloat16', '--repeats', '1', '--profile-ops', '2',
                                '--profile-top', '80', '--csv', str(out)]) == 0
    (row,) = list(csv.DictReader(out.open()))
    assert (row['workload'], row['mode'], row['dtype']) == ('inference', 'compiled', 'bfloat16')
    assert float(row['linvit_over_floor']) == pytest.approx(float(row['floor_ms']) / float(row['linvit_ms']))
    printed = capsys.readouterr().out.splitlines()
    start = printed.index("## where a step's time goes, 32 compiled: ms per step over 2 profiled step(s) "
                          "(op self time)")
    assert printed[start + 1].split() == ['category', 'linvit', 'ms', 'floor', 'ms', 'linvit-floor']
    rows = {line[:18].strip(): [float(cell) for cell in line[18:].split()] for line in printed[start + 2:start + 10]}
    assert list(rows) == [*step_bench_categories(), 'total']
    for linvit, floor, diff in rows.values():
        assert diff == pytest.approx(linvit - floor, abs=0.011)
    assert rows['total'][0] == pytest.approx(sum(row[0] for name, row in rows.items() if name != 'total'), abs=0.05)
    assert printed[start + 10] == 'top 80 ops of linvit (ms per step, calls per step, category):'
    top = [line.split() for line in printed[start + 11:] if line.startswith('  ')]
    assert 10 <= len(top) <= 80
    # compiled CPU code shows its fused kernels by name (inductor's kernel profiling, turned on before compiling);
    # at this tiny size they take microseconds, below the attention op's own aten calls

    assert any(cells[2:4] == ['fused', '(compiled)'] and cells[4].startswith('graph_') for cells in top)


def step_bench_categories():
    from linvit.bench.op_profile import CATEGORIES
    return list(CATEGORIES)


def test_negative_profile_options_are_refused(step_bench, capsys):
    with pytest.raises(SystemExit):
        step_bench.parse_args(['--profile-ops', '-1'])
    assert '--profile-ops and --profile-top must be >= 0' in capsys.readouterr().err
