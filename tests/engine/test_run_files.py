"""The run folder's one owner: ``RunDir`` names every file a finished run wrote (and nothing it did not), and the
run_files lists are made of its names."""
import csv
import fnmatch
import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from linvit.engine import RunDir, train
from linvit.engine.run_files import RUN_DERIVED, RUN_ENTRIES, RUN_RESULTS, RUN_STAGES, RUN_WEIGHTS, run_entries_in


def _val_steps(csv_path):
    with open(csv_path, newline='') as f:
        return [int(row['step']) for row in csv.DictReader(f) if row['split'] == 'val']


@pytest.mark.integration
def test_a_finished_run_holds_exactly_the_files_its_run_dir_names(tiny_config, tmp_path):
    cfg = tiny_config('train.pictures=true', 'train.epochs=1')
    # under a process group of the caller's (one gloo rank): train() uses it and leaves it up, since a caller may
    # train several runs in one group (train.py's main is what ends it)
    dist.init_process_group('gloo', init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        train(cfg)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
    files = RunDir(cfg.output_dir)
    assert files == RunDir(str(tmp_path / 'run'))
    for path in (files.config, files.log, files.metrics_csv, files.metrics_json, files.last, files.best, files.weights,
                 files.curves):
        assert os.path.isfile(path), path
    assert os.path.isdir(files.tensorboard) and os.listdir(files.tensorboard)
    steps = _val_steps(files.metrics_csv)
    assert steps
    drawn = {files.picture(name, step) for name in ('val', 'confusion') for step in steps}
    assert {os.path.join(files.pictures, name) for name in os.listdir(files.pictures)} == drawn
    for path in drawn:
        assert os.path.isfile(path), path
    # nothing in the folder that RunDir does not name, and all of it is what a replaced run takes along
    named = {files.config, files.log, files.metrics_csv, files.metrics_json, files.last, files.best, files.weights,
             files.curves, files.tensorboard, files.pictures}
    assert {files.join(name) for name in os.listdir(files.path)} == named
    assert sorted(files.join(name) for name in run_entries_in(files.path)) == sorted(named)


def test_the_run_files_lists_are_made_of_run_dir_names():
    files = RunDir(os.path.join('runs', 'lin'))
    assert files.last == os.path.join('runs', 'lin', 'last.pt')
    assert files.picture('val', 40) == os.path.join('runs', 'lin', 'pictures', 'val_step000040.png')
    assert files.stage('stage1').weights == os.path.join('runs', 'lin', 'stage1', 'model.safetensors')
    assert files.state('linearize') == os.path.join('runs', 'lin', 'linearize.json')
    assert files.evaluation('best') == os.path.join('runs', 'lin', 'eval_best')
    assert RUN_WEIGHTS == (RunDir.WEIGHTS, RunDir.BEST, RunDir.LAST) and RUN_STAGES == RunDir.STAGES
    for path in (files.config, files.log, files.metrics_csv, files.metrics_json, files.last, files.best, files.weights,
                 files.tensorboard, files.curves, files.pictures, files.state('linearize'), files.onnx, files.hub,
                 files.evaluation('last'), *(files.stage(stage).path for stage in RunDir.STAGES)):
        name = os.path.basename(path)
        assert any(fnmatch.fnmatch(name, pattern) for pattern in RUN_ENTRIES), name
    results = (files.last, files.best, files.weights, files.metrics_json, files.onnx, files.hub,
               files.evaluation('best'))
    assert all(any(fnmatch.fnmatch(os.path.basename(path), p) for p in RUN_RESULTS) for path in results)
    assert any(fnmatch.fnmatch(os.path.basename(files.evaluation('best')), p) for p in RUN_DERIVED)
    assert files.hub == os.path.join('runs', 'lin', 'hub') and RunDir.HUB in RUN_DERIVED
