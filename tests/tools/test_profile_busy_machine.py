"""The profilers on a busy CPU: ``--threads auto`` (the default) runs on the cores other processes leave free, and
threads that share cores with other processes give one warning line before the table and next to the results (the
table's heading, the profile CSV). The load is simulated: os.getloadavg and the affinity mask are monkeypatched."""
import csv
import os

import pytest
import torch
from conftest import load_tool

from linvit.bench import profile, profile_cli

TINY_PROFILE = ['--models', 'vit_tiny_patch16_224:depth=1', '--sizes', '32', '--floors', 'none', '--mode', 'eager',
                '--warmup', '1', '--repeats', '1']


def simulate_load(monkeypatch, cores: int, load_average: float, torch_default: int = None) -> None:
    """This process may run on ``cores`` cores and the 1-minute load average is ``load_average`` (this process counts
    for one); ``torch_default`` stands in for torch's default thread count (one per core)."""
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: set(range(cores)))
    monkeypatch.setattr(os, 'getloadavg', lambda: (load_average, load_average, load_average))
    if torch_default is not None:
        monkeypatch.setattr(torch, 'get_num_threads', lambda: torch_default)


def busy_line(others: int, cores: int, load_average: float, threads: int, advice: str) -> str:
    """The warning as the issue asks for it: the load, the threads, what to do (written out here, not imported)."""
    return (f"WARNING busy machine: other processes keep about {others} of the {cores} cores busy (load average "
            f"{load_average:.1f}) and this measurement uses {threads} thread(s), more than the {cores - others} free "
            f"core(s): its times and ratios are noise; {advice}")


def test_profile_resolution_warns_before_the_sweep_and_in_its_table_and_csv(prof, tmp_path, capsys, monkeypatch):
    simulate_load(monkeypatch, cores=4, load_average=3.0)  # this process and about 2 others
    measured = []
    def run_config(config, timeout, retain_freed_memory=False):
        measured.append(config.threads)
        return {**profile.base_row(config), **profile.child_result(config)}  # the child's code, in this process

    monkeypatch.setattr(profile, 'run_config', run_config)
    assert prof.main([*TINY_PROFILE, '--threads', '4', '--out', str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    warning = busy_line(2, 4, 3.0, 4, 'rerun with --threads 2 or free the cores')
    assert lines[0] == warning  # before the sweep starts
    heading = next(i for i, line in enumerate(lines) if line.startswith('# inference, float32, batch 1, eager'))
    assert ', 4 threads (load average 3.0 on 4 cores before the sweep)' in lines[heading]
    assert lines[heading + 1] == f"# {warning}"
    (row,) = csv.DictReader((tmp_path / 'profile.csv').open())
    assert (row['threads'], row['load_average'], row['cores'], row['status']) == ('4', '3.0', '4', 'ok')
    assert measured == [4]
    # the CSV keeps the load: --summarize prints the same warning next to the table
    assert prof.main(['--summarize', str(tmp_path / 'profile.csv')]) == 0
    assert f"# {warning}" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize('cores, load_average, chosen, warning', [
    (4, 0.4, 4, None),                                              # an idle machine: torch's one thread per core
    (4, 3.0, 2, None),                                              # 2 cores taken: the 2 free ones
    (2, 3.0, 1, busy_line(2, 2, 3.0, 1, 'free the cores (none is free)')),  # none free: one thread, and a warning
])
def test_threads_auto_runs_every_configuration_on_the_free_cores(prof, tmp_path, capsys, monkeypatch, cores,
                                                                  load_average, chosen, warning):
    simulate_load(monkeypatch, cores, load_average, torch_default=cores)
    measured = []

    def run_config(config, timeout, retain_freed_memory=False):
        measured.append(config.threads)
        return {**profile.base_row(config), 'status': 'ok', 'median_ms': 10.0, 'p90_ms': 11.0, 'img_per_s': 100.0,
                'peak_mem_mib': 300.0, 'base_mem_mib': 290.0, 'added_mem_mib': 10.0, 'first_call_ms': 20.0,
                'tokens': 5, 'threads': config.threads}

    monkeypatch.setattr(profile, 'run_config', run_config)
    assert prof.main([*TINY_PROFILE[:-4], '--rounds', '2', '--out', str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert measured == [chosen, chosen]  # read once: both rounds alike
    assert f", {chosen} threads (load average {load_average:.1f} on {cores} cores before the sweep)" in printed
    assert (printed.count(warning) == 2) if warning else ('WARNING' not in printed)  # before the sweep, in the table


IN_PROCESS_TOOLS = {
    'bench_attention': (['--tokens', '16', '--dim', '32', '--heads', '2', '--warmup', '0', '--repeats', '1'],
                        'softmax/linear'),
    'bench_causal': (['--tokens', '16', '--heads', '1', '--head-dim', '4', '--variants', 'plain', '--warmup', '0',
                      '--repeats', '1', '--recurrent-tokens', '0'], 'parallel/chunked'),
    'bench_train_step': (['--model', 'linvit_tiny_patch16_224:depth=1', '--softmax', 'none', '--sizes', '32',
                          '--batch', '1', '--mode', 'eager', '--repeats', '1'], 'linvit/floor'),
}


@pytest.mark.parametrize('tool', list(IN_PROCESS_TOOLS))
def test_in_process_profilers_warn_in_their_heading_before_the_table(tool, capsys, monkeypatch):
    simulate_load(monkeypatch, cores=4, load_average=3.0)
    argv, columns = IN_PROCESS_TOOLS[tool]
    assert load_tool(tool).main([*argv, '--threads', '3']) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if columns in line and not line.startswith('#'))  # the columns
    assert f"# {busy_line(2, 4, 3.0, 3, 'rerun with --threads 2 or free the cores')}" in lines[:header]
    assert '3 thread(s), load average 3.0 on 4 cores' in lines[0]
    assert torch.get_num_threads() == 3  # what the measurement ran with (the fixture restores it afterwards)


def test_a_one_thread_profiler_warns_when_no_core_is_free(capsys, monkeypatch):
    simulate_load(monkeypatch, cores=2, load_average=3.5)  # this process and about 2.5 others on 2 cores
    assert load_tool('bench_op_overhead').main(['--tokens', '8', '--repeats', '2', '--warmup', '1']) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"# {busy_line(2, 2, 3.5, 1, 'free the cores (none is free)')}"
    assert lines[1].startswith('| tokens |')


def test_threads_must_be_auto_or_a_positive_number(capsys):
    for bad in ('0', 'many'):
        with pytest.raises(SystemExit):
            profile_cli.parse_args(['--threads', bad])
        assert "expected 'auto' or a number of threads >= 1" in capsys.readouterr().err
