"""tools/bench_data.py: every row and column from a real run at tiny sizes, and the bottleneck named from the rates."""
import csv

import torch
from conftest import load_tool

from linvit.bench.data import _verdict


def test_the_tool_measures_every_path_at_every_size(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, 'set_num_threads', lambda n: None)  # the tool sets one thread: not for this worker
    out = tmp_path / 'rows.csv'
    assert load_tool('bench_data').main(['--sizes', '32', '48', '--images', '4', '--samples', '4', '--batch', '2',
                                         '--repeats', '1', '--workers', '3', '--csv', str(out)]) == 0
    printed = capsys.readouterr().out
    assert 'cached path, 3 workers' in printed and printed.count('\n| 32 |') == 1 and '\n| 48 |' in printed
    rows = list(csv.DictReader(open(out)))
    assert [int(r['px']) for r in rows] == [32, 48]
    for row in rows:
        rates = {key: float(row[key]) for key in ('per_image_worker', 'cached_worker', 'device_augment', 'model')}
        assert all(rate > 0 for rate in rates.values())
        assert float(row['per_image_pipeline']) == 3 * rates['per_image_worker']


def test_the_bottleneck_is_the_slowest_stage():
    row = {'per_image_worker': 10.0, 'cached_worker': 100.0, 'device_augment': 250.0, 'model': 200.0}
    verdict = _verdict(row, workers=6)
    assert verdict['per_image_pipeline'] == 60 and verdict['per_image_bound'] == 'input'
    assert verdict['cached_pipeline'] == 250 and verdict['cached_bound'] == 'model'  # min(600, 250) > 200
    assert verdict['cached_vs_per_image_per_worker'] == 10
    slow_device = _verdict({**row, 'device_augment': 150.0}, workers=6)
    assert slow_device['cached_pipeline'] == 150 and slow_device['cached_bound'] == 'input'
