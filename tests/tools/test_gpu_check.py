"""tools/gpu_check.py, the command line over linvit.bench.gpu_check (tested in tests/bench): the quick run on the CPU
end to end under a short budget (its processes, deadlines and report files), and the options' help."""
import argparse
import csv
import runpy
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from linvit.bench.gpu_check import plan, report

E2E_BUDGET_S = 24.0
TOOL = Path(__file__).resolve().parents[2] / 'tools' / 'gpu_check.py'


@pytest.fixture(scope='module')
def gpu_check():
    """The script's functions (build_parser, parse_args, main), run as a file the way python runs it."""
    return SimpleNamespace(**runpy.run_path(str(TOOL)))


def table_header(header) -> str:
    return '| ' + ' | '.join(header) + ' |'


def test_quick_run_reports_every_planned_row_within_its_budget(gpu_check, tmp_path, capsys):
    out = tmp_path / 'out'
    start = time.time()
    code = gpu_check.main(['--device', 'cpu', '--quick', '--budget', str(E2E_BUDGET_S), '--out', str(out),
                           '--cache-dir', str(tmp_path / 'cache'), '--sections', *plan.SECTIONS])
    elapsed = time.time() - start
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert elapsed < E2E_BUDGET_S + 5  # a hard budget: sections are stopped at their deadlines
    for header in (report.PARITY_HEADER, report.OP_HEADER, report.MODELS_HEADER):
        assert table_header(header) in printed
    assert (out / 'gpu_check.md').read_text().strip() in printed
    assert (out / 'gpu_check_throughput.png').stat().st_size > 0
    rows = {row['key']: row for row in csv.DictReader((out / 'gpu_check.csv').open())}
    for section in plan.SECTIONS:
        for key in plan.plan_keys(section, plan.QUICK):
            status = rows[key]['status']
            # measured, or not reached in time: never an estimate and never an error
            assert status == 'ok' or status.startswith('skipped ('), (key, status)
    for key in plan.plan_keys('parity', plan.QUICK):
        row = rows[key]
        if row['status'] == 'ok':
            assert max(float(row[f"err_{n}"]) for n in ('out', 'dq', 'dk', 'dv')) <= float(row['tol'])


def test_options_become_resolved_settings(gpu_check, tmp_path):
    settings = gpu_check.parse_args(['--device', 'cpu', '--quick', '--out', str(tmp_path / 'o'),
                                     '--sections', 'parity', 'op'])
    assert (settings.budget, settings.compile_backend, settings.sections) == (plan.QUICK.budget_s, 'aot_eager',
                                                                             ('parity', 'op'))
    assert settings.out == str(tmp_path / 'o')
    assert gpu_check.parse_args(['--device', 'cpu']).sections == ('parity', 'op', 'models')
    with pytest.raises(SystemExit):  # quality is tools/quality_check.py
        gpu_check.parse_args(['--device', 'cpu', '--sections', 'quality'])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(['--device', 'cpu', '--budget', '5'])


@pytest.mark.parametrize('device, available, count, missing', [
    ('cuda:0', False, 0, 'there is no CUDA device on this machine'),   # the default, without CUDA
    ('cuda', False, 0, 'there is no CUDA device on this machine'),
    ('cuda:1', True, 1, 'there is no CUDA device 1 on this machine (torch sees 1)'),
])
def test_a_cuda_device_the_machine_lacks_is_one_line_before_anything_runs(gpu_check, tmp_path, capsys, monkeypatch,
                                                                          device, available, count, missing):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: available)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: count)
    argv = [] if device == 'cuda:0' else ['--device', device]  # cuda:0 is the default
    with pytest.raises(SystemExit) as exited:
        gpu_check.main([*argv, '--out', str(tmp_path / 'out')])
    assert exited.value.code == 2  # a usage error
    captured = capsys.readouterr()
    assert captured.out == '' and captured.err.count('\n') == 1, captured.err
    assert captured.err.split(': error: ')[1].startswith(f"--device {device}: {missing}")  # after argparse's prog
    assert captured.err.rstrip().endswith('--device cpu --quick')
    assert not (tmp_path / 'out').exists()  # no section ran, no log was written


def test_every_option_has_help_that_shows_its_default(gpu_check):
    parser = gpu_check.build_parser()
    formatter = parser.formatter_class('gpu_check')
    for action in parser._actions[1:]:
        if action.help == argparse.SUPPRESS:
            continue
        shown = formatter._get_help_string(action)
        assert action.help and (action.default is None or '(default: ' in shown), action.option_strings
    assert parser.format_help()
