"""linvit.bench.gpu_check on the CPU: the sections' measurements in this process, the model variants and their
order, the report built from records with known values, and the package's light imports. (The whole quick run, with
its processes and deadlines: tests/tools/test_gpu_check.py.)"""
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from linvit.bench.gpu_check import plan, report, runner, sections
from linvit.precision import PRECISIONS


def settings_for(tmp_path: Path, **changes) -> plan.CheckSettings:
    """The quick CPU settings, resolved, writing under tmp_path."""
    values = dict(device='cpu', quick=True, out=str(tmp_path / 'out'), cache_dir=str(tmp_path / 'cache'))
    return plan.CheckSettings(**{**values, **changes}).resolved()


def emitted(printed: str) -> list:
    return [json.loads(line[len(plan.RESULT_MARK):]) for line in printed.splitlines()
            if line.startswith(plan.RESULT_MARK)]


def test_settings_resolve_their_defaults_and_reject_a_budget_without_room(tmp_path):
    quick, full = settings_for(tmp_path), settings_for(tmp_path, quick=False)
    assert (quick.budget, quick.compile_backend) == (plan.QUICK.budget_s, 'aot_eager')
    assert (full.budget, full.compile_backend) == (plan.FULL.budget_s, 'inductor')
    assert Path(quick.out).is_absolute() and quick.preset is plan.QUICK
    for bad in (dict(budget=plan.REPORT_RESERVE_S), dict(sections=('parity', 'speed')),
                dict(compile_backend='cudagraphs')):
        with pytest.raises(ValueError):
            settings_for(tmp_path, **bad)


def test_parity_and_op_sections_measure_in_process(tmp_path, capsys):
    settings = settings_for(tmp_path)
    settings.deadline = time.time() + 120
    device = torch.device('cpu')
    sections.run_parity(settings, plan.QUICK, device)
    sections.run_op(settings, plan.QUICK, device)
    records = {r['key']: r for r in emitted(capsys.readouterr().out)}
    assert list(records) == plan.plan_keys('parity', plan.QUICK) + plan.plan_keys('op', plan.QUICK)
    for key in plan.plan_keys('parity', plan.QUICK):
        r = records[key]
        if r['status'].startswith('skipped (Triton interpreter'):  # this process runs under TRITON_INTERPRET=1
            continue
        assert r['status'] == 'ok', r
        assert max(r[f"err_{n}"] for n in ('out', 'dq', 'dk', 'dv')) <= plan.TOLERANCES[r['dtype']]
    for key in plan.plan_keys('op', plan.QUICK):
        r = records[key]
        assert r['status'] == 'ok', r
        assert r['sdpa_over_kernel'] == pytest.approx(r['sdpa_ms'] / r['kernel_ms'])
        assert r['torch_over_kernel'] == pytest.approx(r['torch_ms'] / r['kernel_ms'])


def test_model_record_times_a_compiled_step():
    case = plan.ModelCase('small', 32, 'training', 'linvit', 2)
    r = sections.model_record(case, plan.QUICK, torch.device('cpu'), 'aot_eager', time.time() + 120)
    assert (r['tokens'], r['batch'], r['repeats'], r['workload']) == (5, 2, plan.QUICK.train_repeats, 'training')
    assert r['img_per_s'] == pytest.approx(2e3 / r['ms']) and r['peak_mem_mib'] > 0 and r['first_call_s'] > 0


def test_a_linvit_step_whose_kernels_did_not_run_is_a_fail_row_with_its_figures(monkeypatch):
    """A compiled linvit step that fell back to the PyTorch path (no Triton kernel in its profile, as torch 2.11's
    is_exporting made happen) is measured, shown, and FAILs the check, naming the kernels that did not run."""
    assert sections.missing_kernels(lambda: None, torch.device('cpu'), 'training') == []  # nothing to tell on CPU
    monkeypatch.setattr(sections, 'missing_kernels', lambda call, device, workload: ['_key_pass', '_grad_key'])
    case = plan.ModelCase('small', 64, 'training', 'linvit', 2)
    record = sections.guarded('models', case.key, lambda: sections.model_record(
        case, plan.QUICK, torch.device('cpu'), 'aot_eager', time.time() + 120))
    assert record['status'] == 'FAIL' and record['img_per_s'] > 0
    assert report.failed({case.key: record}) == [f"{case.key}: FAIL"]
    row = report.models_rows({case.key: record}, plan.QUICK)[0]
    assert row[4] == f"{record['img_per_s']:,.1f}"
    assert row[-1] == ('linvit: FAIL (_key_pass, _grad_key did not run in a profiled step (the PyTorch path ran '
                       'instead))')


def test_models_are_linvit_its_floor_softmax_and_the_torch_path():
    def build(kind):
        return sections.build_model(plan.ModelCase('small', 32, 'inference', kind, 2), plan.QUICK)

    attention = {kind: {type(m).__name__ for m in build(kind).modules() if hasattr(m, 'qkv')}
                 for kind in (*plan.KINDS, plan.TORCH_PATH)}
    assert attention == {'linvit': {'LinearAttention'}, 'softmax': {'Attention'}, 'floor': {'NoMixingAttention'},
                         plan.TORCH_PATH: {'LinearAttention'}}
    assert {m.attn_backend for m in build(plan.TORCH_PATH).modules() if hasattr(m, 'attn_backend')} == {'torch'}
    # the priority order: ViT-S at its first size, training before inference, linvit before softmax and floor
    order = plan.plan_models(plan.FULL)
    assert [(c.size, c.px, c.workload, c.kind) for c in order[:4]] == [
        ('small', 1024, 'training', 'linvit'), ('small', 1024, 'training', 'softmax'),
        ('small', 1024, 'training', 'floor'), ('small', 1024, 'inference', 'linvit')]


def _records():
    """Known records for part of the quick plan: the report's arithmetic, its skipped rows and its failures."""
    parity_keys = plan.plan_keys('parity', plan.QUICK)
    records = {
        parity_keys[0]: {'section': 'parity', 'key': parity_keys[0], 'status': 'ok', 'kernel': 'triton',
                         'err_out': 1e-7, 'err_dq': 2e-7, 'err_dk': 3e-7, 'err_dv': 4e-7},
        parity_keys[2]: {'section': 'parity', 'key': parity_keys[2], 'status': 'FAIL', 'kernel': 'triton',
                         'err_out': 1e-2, 'err_dq': 2e-7, 'err_dk': 3e-7, 'err_dv': 4e-7},
        'op/64/fwd': {'section': 'op', 'key': 'op/64/fwd', 'status': 'ok', 'kernel': 'triton', 'kernel_ms': 2.0,
                      'torch_ms': 5.0, 'sdpa_ms': 8.0, 'sdpa_over_kernel': 4.0, 'torch_over_kernel': 2.5,
                      'gpu_ms': 0.5, 'launches': 4.0},
    }
    for kind, speed in (('linvit', 30.0), ('softmax', 10.0), ('floor', 40.0), (plan.TORCH_PATH, 20.0)):
        key = f"models/small/64/training/{kind}"
        records[key] = {'section': 'models', 'key': key, 'status': 'ok', 'size': 'small', 'kind': kind, 'px': 64,
                        'workload': 'training', 'tokens': 17, 'img_per_s': speed, 'peak_mem_mib': 2048.0,
                        'first_call_s': 12.0}
    return records


def test_report_from_known_records(tmp_path):
    settings = settings_for(tmp_path, sections=plan.SECTIONS)
    records = _records()
    killed = runner.Section('models', None, tmp_path / 'models.log', 0.0, 0.0, killed=True)
    crashed = runner.Section('op', None, tmp_path / 'op.log', 0.0, 0.0, code=1)
    for name, section in (('parity', killed), ('op', crashed), ('models', killed)):
        runner.fill_missing(section, plan.plan_keys(name, plan.QUICK), records)
    Path(settings.out).mkdir(parents=True)
    lines = report.report(records, settings, plan.QUICK, [killed], 99.0).splitlines()
    parity = [line for line in lines if line[2:].split(' ', 1)[0] in PRECISIONS]
    assert parity[0].endswith('| 1.0e-07 | 2.0e-07 | 3.0e-07 | 4.0e-07 | 1e-04 | ok |')
    assert parity[1].endswith(f"| - | - | - | - | 2e-02 | {plan.SKIPPED} |")
    assert parity[2].endswith('| 1.0e-02 | 2.0e-07 | 3.0e-07 | 4.0e-07 | 5e-03 | FAIL |')
    assert '| 64 | fwd | triton | 2.000 | 5.000 | 8.000 | 4.00 | 2.50 | 0.500 | 4 | ok |' in lines
    assert any(line.startswith('| 64 | fwd+bwd |') and '| error: the op process exited 1 (logs/op.log) |' in line
               for line in lines)
    (train,) = [line for line in lines if line.startswith('| ViT-S | 64 (17) | training |')]
    assert '| 30.0 | 10.0 | 40.0 | 3.00 | 0.75 | 1.50 | 2.0/2.0/2.0 | 12.0 | ok |' in train
    (infer,) = [line for line in lines if line.startswith('| ViT-S | 64 (-) | inference |')]
    assert infer.endswith(f"| -/-/- | - | linvit: {plan.SKIPPED}; softmax: {plan.SKIPPED}; floor: "
                          f"{plan.SKIPPED}; linvit_torch: {plan.SKIPPED} |")
    assert sorted(report.failed(records)) == sorted(
        [f"{plan.plan_keys('parity', plan.QUICK)[2]}: FAIL"]
        + [f"{key}: error: the op process exited 1 (logs/op.log)" for key in plan.plan_keys('op', plan.QUICK)
           if key != 'op/64/fwd'])
    csv_rows = list(csv.DictReader((Path(settings.out) / 'gpu_check.csv').open()))
    assert {row['key'] for row in csv_rows} == set(records)
    assert (Path(settings.out) / 'gpu_check_throughput.png').stat().st_size > 0


def test_a_section_process_reads_the_settings_it_is_given(tmp_path):
    settings = settings_for(tmp_path, sections=('op',))
    argv = runner.section_argv(settings, 'op', deadline=123.5)
    assert argv[:3] == [sys.executable, '-m', 'linvit.bench.gpu_check.sections'] and argv[4] == 'op'
    given = plan.CheckSettings(**{**json.loads(argv[3]), 'sections': ('op',)})
    assert given == plan.CheckSettings(**{**vars(settings), 'deadline': 123.5})


@pytest.mark.integration
def test_the_module_imports_without_the_training_stack():
    """The kernel sections must run where albumentations, omegaconf or pydantic failed to install."""
    code = ("import sys; import linvit.bench.gpu_check; "
            "print(sorted(m for m in ('albumentations', 'omegaconf', 'pydantic', 'matplotlib') if m in sys.modules))")
    printed = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
    assert printed.strip() == '[]'
