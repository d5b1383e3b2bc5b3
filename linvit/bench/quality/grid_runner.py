"""The quality grid's parent process: the sets rendered (and their caches warmed), then every run in its own process,
one after another (so that each run's seconds and img/s are its own), each stopped at the preset's deadline, then
the report.

    settings = GridSettings(grid='cpu', device='cpu').resolved()
    status = run_quality_grid(settings, start=time.time())    # writes settings.out/quality_grid.{md,csv,png}
"""
import json
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from ..processes import wait_or_kill
from .data import data_unavailable, render_canvas_set, render_seg_set, warm_decoded_caches
from .grid import TASK_BY_NAME, TASKS, GridPreset, GridRun, GridSettings, grid_job, grid_run_dir, grid_runs
from .grid_report import grid_report
from .results import last_line, read_curve
from .runner import start_job

__all__ = ['prepare_grid_data', 'describe_run', 'grid_record', 'run_grid', 'run_quality_grid']

RENDERERS = {'classification': render_canvas_set, 'segmentation': render_seg_set}


def prepare_grid_data(settings: GridSettings, preset: GridPreset) -> Tuple[Dict[str, Path], str]:
    """({task: set folder}, '') or ({}, why not): each task's set rendered once and its caches warmed."""
    folders: Dict[str, Path] = {}
    try:
        for task in TASKS:
            dataset = preset.dataset(task.name)
            folders[task.name] = RENDERERS[task.name](settings, dataset)
            warm_decoded_caches(settings, dataset, folders[task.name], task.name)
    except (FileNotFoundError, ValueError) as err:
        return {}, f"error: preparing the data failed: {err}"[:300]
    return folders, ''


def describe_run(preset: GridPreset, run: GridRun) -> Dict[str, Any]:
    """The fields of a run's record known before it runs."""
    dataset = preset.dataset(run.task)
    return {'config': run.config.label, 'task': run.task, 'local_mix': run.local_mix, 'seed': run.seed,
            'model': run.config.model, 'kwargs': ' '.join(f"{k}={v}" for k, v in run.model_kwargs(preset)),
            'px': dataset.px, 'batch': dataset.batch, 'planned_steps': preset.steps[run.task],
            'variant': run.variant, 'run_dir': f"runs/{run.folder}"}


def grid_record(settings: GridSettings, preset: GridPreset, run: GridRun, code: Any, wall_s: float) -> Dict[str, Any]:
    """A finished, failed or cut run's row: its metric (a fraction), steps, training seconds and img/s from its
    metrics.csv, wall seconds, status (an error quotes the last line of the run's log)."""
    from linvit.engine.run_dir import RunDir
    task = TASK_BY_NAME[run.task]
    files = RunDir(str(grid_run_dir(settings, run)))
    curve = read_curve(Path(files.metrics_csv), preset.dataset(run.task).batch, task.metric)
    record = {**describe_run(preset, run), 'steps': curve.steps, 'seconds': wall_s, 'train_s': curve.train_s or None,
              'img_per_s': curve.images / curve.train_s if curve.train_s else None}
    if code is None:
        return {**record, 'status': f"cut after {wall_s:.0f} s (the preset's deadline per run)"}
    if code != 0 or not Path(files.metrics_json).is_file():
        why = last_line(Path(settings.out) / 'logs' / f"{run.folder}.log")
        return {**record, 'status': f"error: the run exited {code} (logs/{run.folder}.log: {why})"[:300]}
    return {**record, 'metric': json.loads(Path(files.metrics_json).read_text())[task.metric], 'status': 'ok'}


def run_grid(settings: GridSettings, preset: GridPreset, runs: List[GridRun],
             data: Dict[str, Path]) -> List[Dict[str, Any]]:
    """Every run in its own process, one at a time, each stopped after ``preset.run_timeout_s``; a record each."""
    records = []
    for i, run in enumerate(runs, 1):
        log = Path(settings.out) / 'logs' / f"{run.folder}.log"
        proc = start_job(grid_job(settings, preset, run, data[run.task]), grid_run_dir(settings, run), log)
        code, wall_s = wait_or_kill([proc], [time.time() + preset.run_timeout_s])[0]
        records.append(grid_record(settings, preset, run, code, wall_s))
        print(f"[grid {i}/{len(runs)}] {run.folder}: {records[-1]['status']} ({wall_s:.0f} s)", flush=True)
    return records


def run_quality_grid(settings: GridSettings, start: float) -> int:
    """The whole grid of the resolved ``settings``: data, runs, report; prints the progress and the tables. Returns
    1 when a run failed with an error or was cut, else 0."""
    preset = settings.grid_preset
    out = Path(settings.out)
    shutil.rmtree(out / 'runs', ignore_errors=True)
    (out / 'logs').mkdir(parents=True, exist_ok=True)
    Path(settings.cache_dir).mkdir(parents=True, exist_ok=True)
    runs = grid_runs(preset, settings.seeds)
    print(f"# quality grid '{preset.name}' on {settings.device}: {len(runs)} runs; logs in {out / 'logs'}", flush=True)
    data: Dict[str, Path] = {}
    why = data_unavailable(settings.fmnist_dir)
    if why is None:
        data, why = prepare_grid_data(settings, preset)
    if why:
        records = [{**describe_run(preset, run), 'status': why} for run in runs]
    else:
        records = run_grid(settings, preset, runs, data)
    text = grid_report(settings, preset, records, time.time() - start)
    print(text)
    print(f"wrote {out / 'quality_grid.md'}, {out / 'quality_grid.csv'}, {out / 'quality_grid.png'}; "
          f"runs in {out / 'runs'}")
    failed = [f"{r['run_dir']}: {r['status']}" for r in records if r['status'].startswith(('error', 'cut'))]
    for line in failed:
        print(f"FAILED {line}")
    return 1 if failed else 0
