"""linvit.timing: nearest-rank percentiles, interleaved medians, CSV rows."""
import csv
import os

import pytest
from scripted_clock import ScriptedClock

from linvit import timing


def test_percentile_is_nearest_rank():
    assert timing.percentile([5.0], 90) == 5.0
    assert timing.percentile(list(range(1, 11)), 90) == 9
    assert timing.percentile([3, 1, 2], 50) == 2


def test_interleaved_medians_leave_out_the_warm_up(monkeypatch):
    clock = ScriptedClock()
    monkeypatch.setattr(timing, 'time', clock)
    order, costs = [], {'a': iter([100., 3., 1., 2.]), 'b': iter([100., 10., 30., 20.])}

    def call(name):
        order.append(name)
        clock.now += next(costs[name]) / 1e3

    ms = timing.time_interleaved({'a': lambda: call('a'), 'b': lambda: call('b')}, 1, 3, 'cpu')
    assert ms == {'a': pytest.approx(2.0), 'b': pytest.approx(20.0)}
    assert order == ['a', 'b'] * 4  # one call of each per round


def test_csv_rows_leave_none_empty(tmp_path):
    path = tmp_path / 'rows.csv'
    timing.write_csv(str(path), [{'tokens': 16, 'ms': 1.5, 'other': None}])
    assert list(csv.DictReader(path.open())) == [{'tokens': '16', 'ms': '1.5', 'other': ''}]


@pytest.mark.parametrize('cores, load_average, free, fair, busy_at', [
    (4, 0.5, 4, 4, 5),     # idle: this process alone
    (4, 3.0, 2, 2, 3),     # this process and 2 others
    (2, 3.5, 0, 1, 1),     # 2.5 others on 2 cores: none free, even one thread shares a core
])
def test_cpu_load_is_the_load_average_less_this_process_against_the_affinity_mask(monkeypatch, cores, load_average,
                                                                                   free, fair, busy_at):
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: set(range(cores)))
    monkeypatch.setattr(os, 'getloadavg', lambda: (load_average, 0.0, 0.0))  # the 1-minute average counts
    load = timing.cpu_load()
    assert (load.cores, load.load_average, load.free_cores, load.fair_threads) == (cores, load_average, free, fair)
    assert [load.busy(n) for n in range(1, busy_at + 1)] == [False] * (busy_at - 1) + [True]
    assert load.describe() == (f"other processes keep about {max(0, load_average - 1):.0f} of the {cores} cores busy "
                               f"(load average {load_average:.1f})")


def test_cpu_load_is_unknown_without_a_load_average(monkeypatch):
    monkeypatch.delattr(os, 'getloadavg')
    assert timing.cpu_load() is None
