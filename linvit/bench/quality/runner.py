"""The quality check's parent process: the probe and the data first, then every run in its own process under its
deadline (``job``), each group planned when its first run starts, then the report.

    settings = QualitySettings(device='cuda:0').resolved()     # or QualitySettings(device='cpu', quick=True)
    status = run_quality_check(settings, start=time.time())   # writes settings.out/quality_check.{md,csv,png}

On a GPU the runs go one after the other, so that each run's seconds, img/s and peak memory are its own; a run cut
by its deadline is a row that says so, never estimated. The budget (``budget_s``), less the prepare step and an
allowance per process start, is split between the groups by ``Preset.shares``, each group's when its first run
starts (so that runs quicker or slower than planned move the later groups' seconds).
"""
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from ..processes import Running, child_env, wait_or_kill
from .data import data_unavailable, prepare_data
from .job import Job
from .plan import (
    NEEDS_TEACHER,
    REPORT_RESERVE_S,
    RUNS,
    SKIPPED,
    Preset,
    QualitySettings,
    RunPlan,
    RunSpec,
    group_seconds,
    plan_group,
    run_dir,
)
from .probe import read_probe, start_probe
from .recipe import job_of
from .report import report
from .results import describe, run_record

__all__ = ['run_deadline', 'blocked', 'start_run', 'start_job', 'run_all', 'prepare', 'run_quality_check']


def run_deadline(spec: RunSpec, plan: RunPlan, started: float, end: float, preset: Preset) -> float:
    """When a run is stopped: its startups (two for the linearization's stages, and for the evaluation, whose plan
    has no seconds) and ``slack`` times its planned training seconds (evaluations, checkpoints, a slower step than
    probed) after it started, and never after ``end``."""
    starts = 1 if spec.job == 'train' else 2
    return min(end, started + starts * preset.startup_s + preset.slack * plan.planned_s)


def blocked(spec: RunSpec, plans: Dict[str, Any], records: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """Why a run cannot start (no plan, or the teacher it needs did not finish), else None."""
    plan = plans.get(spec.key, SKIPPED)
    if not isinstance(plan, RunPlan):
        return plan
    teacher = records.get('teacher', {})
    if spec.key in NEEDS_TEACHER and teacher.get('status') != 'ok':
        return f"skipped (the teacher did not finish: {teacher.get('status', 'not run')})"
    return None


def start_run(settings: QualitySettings, spec: RunSpec, job: Job) -> subprocess.Popen:
    """The run's process (``start_job``), its log in out/logs/."""
    return start_job(job, run_dir(settings, spec), Path(settings.out) / 'logs' / f"{spec.folder}.log")


def start_job(job: Job, folder: Path, log_path: Path) -> subprocess.Popen:
    """A job's process (``python -m linvit.bench.quality.job``) in its own process group (killed whole at its
    deadline), a fresh run ``folder``, its output in ``log_path`` after the job it runs."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, 'w') as log:
        log.write(f"{job.kind}: {' '.join(job.overrides)}\n")
        log.flush()
        return subprocess.Popen(job.argv(), stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)


def plan_when_first(spec: RunSpec, plans: Dict[str, Any], pending: Sequence[RunSpec], step_s: Dict[str, float],
                    preset: Preset, time_left: float) -> None:
    """Plan the group of ``spec`` if none of its runs is planned yet (``pending``: the runs not started, ``spec``
    first among its group's)."""
    if any(other.key in plans for other in RUNS if other.group == spec.group):
        return
    plans.update(plan_group(spec.group, group_seconds(preset, spec.group, pending, time_left), step_s, preset))


def run_all(settings: QualitySettings, preset: Preset, step_s: Dict[str, float], data: Dict[str, Path],
            end: float) -> Dict[str, Dict[str, Any]]:
    """Every run, ``preset.lanes`` at a time: the teacher first (two runs wait for it), then in RUNS' order, each
    group planned when its first run starts, the teacher's evaluation and linearization once it has finished; a
    record per run."""
    records: Dict[str, Dict[str, Any]] = {}
    plans: Dict[str, Any] = {}
    pending = sorted(RUNS, key=lambda spec: spec.key != 'teacher')
    running: Dict[str, Tuple[RunSpec, Running]] = {}
    while pending or running:
        for spec in list(pending):
            if len(running) >= preset.lanes:
                break
            if spec.key in NEEDS_TEACHER and 'teacher' not in records:
                continue  # the teacher still runs
            plan_when_first(spec, plans, pending, step_s, preset, end + REPORT_RESERVE_S - time.time())
            pending.remove(spec)
            why = blocked(spec, plans, records)
            if why is None and time.time() + preset.startup_s > end:
                why = SKIPPED
            if why is not None:
                records[spec.key] = {**describe(spec, preset, plans), 'status': why}
                continue
            proc = start_run(settings, spec, job_of(settings, preset, spec, plans[spec.key], data))
            now = time.time()
            running[spec.key] = spec, Running(proc, now, run_deadline(spec, plans[spec.key], now, end, preset))
            print(f"[quality] {spec.key}: started ({plan_words(plans[spec.key])})", flush=True)
        time.sleep(0.2)
        for key, (spec, run) in list(running.items()):
            outcome = run.outcome()
            if outcome is not None:
                del running[key]
                records[key] = run_record(settings, preset, spec, plans, records, *outcome)
                print(f"[quality] {key}: {records[key]['status']}", flush=True)
    return records


def plan_words(plan: RunPlan) -> str:
    """How a started run is announced: 'evaluation', or its steps and planned seconds."""
    if plan.step_s is None:
        return 'evaluation'
    stages = f"{plan.stage1_steps} + " if plan.stage1_steps else ''
    return f"{stages}{plan.steps} steps, {plan.planned_s:.0f} s planned"


def records_without_runs(preset: Preset, status: str) -> Dict[str, Dict[str, Any]]:
    """Every run's row with one status: why none could start."""
    return {spec.key: {**describe(spec, preset, {}), 'status': status} for spec in RUNS}


def prepare(settings: QualitySettings, preset: Preset, start: float,
            end: float) -> Tuple[Dict[str, Path], Dict[str, Dict[str, Any]], str]:
    """The probe on the device while the data is rendered and cached: (set folders, probe records, why not)."""
    probe = start_probe(settings, min(end, start + preset.probe_s))
    data, why = prepare_data(settings, preset)
    wait_or_kill([probe], [min(end, start + preset.probe_s + 5.0)])  # its own deadline first, then a grace
    return data, read_probe(Path(settings.out) / 'logs' / 'probe.log'), why


def run_quality_check(settings: QualitySettings, start: float) -> int:
    """Everything within the resolved ``settings``' budget counted from ``start`` (a time.time()): prepare, plan,
    run, report; prints the progress and the tables. Returns 1 when a run failed with an error, else 0."""
    preset = settings.preset
    out = Path(settings.out)
    shutil.rmtree(out / 'runs', ignore_errors=True)
    (out / 'logs').mkdir(parents=True, exist_ok=True)
    Path(settings.cache_dir).mkdir(parents=True, exist_ok=True)
    end = start + settings.budget_s - REPORT_RESERVE_S
    print(f"# quality_check on {settings.device}: budget {settings.budget_s:.0f} s, pipeline {settings.pipeline}; "
          f"logs in {out / 'logs'}", flush=True)
    data: Dict[str, Path] = {}
    probe: Dict[str, Dict[str, Any]] = {}
    why = data_unavailable(settings.fmnist_dir)
    if why is None:
        data, probe, why = prepare(settings, preset, start, end)
    prepare_s = time.time() - start
    if why:
        records = records_without_runs(preset, why)
    else:
        step_s = {key: r['step_s'] for key, r in probe.items() if r.get('status') == 'ok'}
        records = run_all(settings, preset, step_s, data, end)
    text = report(settings, preset, records, probe, prepare_s, time.time() - start)
    print(text)
    print(f"wrote {out / 'quality_check.md'}, {out / 'quality_check.csv'}, {out / 'quality_check.png'}; "
          f"runs in {out / 'runs'}")
    errors = [f"{key}: {r['status']}" for key, r in records.items() if r['status'].startswith('error')]
    for line in errors:
        print(f"FAILED {line}")
    return 1 if errors else 0
