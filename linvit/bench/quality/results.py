"""What a run left behind, read back: its metrics.csv (training seconds from the train rows, top-1 from the val
rows), its metrics.json, and its row in the report (finished, failed or cut by its deadline).
"""
import csv
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .plan import CUT, Preset, QualitySettings, RunPlan, RunSpec, run_dir

__all__ = ['Curve', 'read_curve', 'run_curve', 'describe', 'last_line', 'run_record', 'cut_fields']


@dataclass
class Curve:
    """What a run's metrics.csv holds: (step, training seconds, top-1 or the run's metric) at each evaluation, the
    training totals."""
    points: List[Tuple[int, float, float]] = dataclasses.field(default_factory=list)
    steps: int = 0
    train_s: float = 0.0
    images: int = 0
    peak_mem_mib: Optional[float] = None
    data_wait_s: float = 0.0

    def extend(self, other: 'Curve') -> 'Curve':
        """This curve followed by ``other`` (a later stage), its steps and seconds counted on from this one's."""
        shifted = [(step + self.steps, seconds + self.train_s, top1) for step, seconds, top1 in other.points]
        peaks = [p for p in (self.peak_mem_mib, other.peak_mem_mib) if p is not None]
        return Curve(self.points + shifted, self.steps + other.steps, self.train_s + other.train_s,
                     self.images + other.images, max(peaks) if peaks else None, self.data_wait_s + other.data_wait_s)


def read_curve(path: Path, batch: int, metric: str = 'top1') -> Curve:
    """A run's Curve from its metrics.csv. A train row covers the steps since the row before it (the engine logs at
    every epoch's end, so no row spans an epoch boundary and its evaluation): its seconds are those steps' images
    over its img_per_s. Evaluations are not training seconds; their ``metric`` column (top1, or a segmentation's
    miou) gives the points."""
    curve = Curve()
    if not path.is_file():
        return curve
    with open(path, newline='') as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        step = int(row['step'])
        if row['split'] == 'train' and row.get('img_per_s'):
            images = (step - curve.steps) * batch
            seconds = images / float(row['img_per_s'])
            curve.steps, curve.train_s, curve.images = step, curve.train_s + seconds, curve.images + images
            curve.data_wait_s += seconds * float(row.get('data_wait_frac') or 0.0)
            if row.get('peak_mem_mib'):
                curve.peak_mem_mib = max(curve.peak_mem_mib or 0.0, float(row['peak_mem_mib']))
        elif row['split'] == 'val' and row.get(metric):
            curve.points.append((step, curve.train_s, float(row[metric])))
    return curve


def run_curve(settings: QualitySettings, preset: Preset, spec: RunSpec) -> Curve:
    """The run's curve; the linearization's is stage 1's followed by stage 2's."""
    from linvit.engine.run_dir import RunDir
    batch = preset.canvases[spec.canvas].batch
    files = RunDir(str(run_dir(settings, spec)))
    if spec.job == 'linearize':
        first, second = (Path(files.stage(stage).metrics_csv) for stage in RunDir.STAGES)
        return read_curve(first, batch).extend(read_curve(second, batch))
    return read_curve(Path(files.metrics_csv), batch)


def describe(spec: RunSpec, preset: Preset, plans: Dict[str, Any]) -> Dict[str, Any]:
    """The fields of a run's record known before it runs."""
    canvas = preset.canvases[spec.canvas]
    plan = plans.get(spec.key)
    fields = {'key': spec.key, 'model': spec.label, 'timm_model': spec.model, 'px': canvas.px, 'batch': canvas.batch,
              'compared': spec.compared, 'run_dir': f"runs/{spec.folder}"}
    if isinstance(plan, RunPlan) and plan.step_s is not None:
        fields.update(planned_steps=plan.steps + plan.stage1_steps, planned_s=plan.planned_s, probe_step_s=plan.step_s,
                      epochs=plan.epochs)
    return fields


def last_line(log: Path) -> str:
    """The last non-empty line of a log (a run's process ends a failure with one line saying why), or ''."""
    if not log.is_file():
        return ''
    lines = [line.strip() for line in log.read_text(errors='replace').splitlines() if line.strip()]
    return lines[-1][:200] if lines else ''


def run_record(settings: QualitySettings, preset: Preset, spec: RunSpec, plans: Dict[str, Any],
               records: Dict[str, Dict[str, Any]], code: Optional[int], wall_s: float) -> Dict[str, Any]:
    """A finished, failed or cut run's row: top-1 (a fraction), steps, seconds, img/s, peak memory, status."""
    from linvit.engine.run_dir import RunDir
    record = {**describe(spec, preset, plans), 'wall_s': wall_s}
    folder = run_dir(settings, spec)
    if spec.job == 'eval':
        record['steps'] = records['teacher'].get('steps')
    else:
        curve = run_curve(settings, preset, spec)
        record.update(steps=curve.steps, train_s=curve.train_s or None,
                      img_per_s=curve.images / curve.train_s if curve.train_s else None,
                      peak_mem_mib=curve.peak_mem_mib,
                      data_wait_frac=curve.data_wait_s / curve.train_s if curve.train_s else None)
    if code is None:
        return {**record, **cut_fields(settings, preset, spec, wall_s)}
    metrics_path = Path(RunDir(str(folder)).metrics_json)
    if code != 0 or not metrics_path.is_file():
        why = last_line(Path(settings.out) / 'logs' / f"{spec.folder}.log")
        return {**record, 'status': f"error: the run exited {code} (logs/{spec.folder}.log: {why})"[:300]}
    metrics = json.loads(metrics_path.read_text())
    record['top1'] = metrics['top1']
    if spec.job == 'linearize':
        record.update(teacher_resized_top1=metrics.get('teacher_top1'), converted_top1=metrics.get('converted_top1'),
                      stage1_top1=metrics.get('stage1_top1'), teacher_input=metrics.get('teacher_input'))
    return {**record, 'status': 'ok'}


def cut_fields(settings: QualitySettings, preset: Preset, spec: RunSpec, wall_s: float) -> Dict[str, Any]:
    """A run stopped at its deadline: the status says so, and its top-1 is its last evaluation's, if it had one."""
    points = [] if spec.job == 'eval' else run_curve(settings, preset, spec).points
    if not points:
        return {'status': f"{CUT} after {wall_s:.0f} s, before any evaluation"}
    step, _, top1 = points[-1]
    return {'top1': top1, 'status': f"{CUT} after {wall_s:.0f} s; top-1 of its last evaluation, at step {step}"}
