"""linvit.timing: nearest-rank percentiles, interleaved medians, CSV rows."""
import csv

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
