"""What the quality check runs: its settings, the presets (full for a GPU, quick for a CPU), the runs and their
groups, the probe's cases, and each group's plan: steps from its share of the budget and each model's step time.
"""
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ['DEFAULT_FMNIST_DIR', 'PIPELINES', 'REPORT_RESERVE_S', 'WARMUP_FRACTION', 'STAGE1_FRACTION', 'SKIPPED',
           'CUT', 'MODEL_LABELS', 'TEACHER_MODEL', 'STUDENT_FEATURE_MAP', 'QualitySettings', 'Canvas', 'SegSet',
           'Preset', 'RunSpec', 'RUNS', 'RUN_BY_KEY', 'GROUPS', 'NEEDS_TEACHER', 'FULL', 'QUICK', 'ProbeCase',
           'probe_case', 'probe_cases', 'RunPlan', 'schedule', 'training_seconds', 'group_seconds', 'planned',
           'plan_group', 'run_dir']

DEFAULT_FMNIST_DIR = os.environ.get('FMNIST_DIR', '/usr/share/datasets/fashion-mnist')
#: config overrides of each input pipeline: the decoded-image cache with batched augmentation on the device, or
#: per-image decoding and albumentations in the loader's workers. Every run and the cache warm-up of the prepare
#: step take theirs from here.
PIPELINES = {'cached': ('data.cache=true',), 'albumentations': ('data.cache=false',)}
REPORT_RESERVE_S = 5.0   # kept at the end of the budget for the tables and the plot
WARMUP_FRACTION = 0.1    # of each run's steps
STAGE1_FRACTION = 0.2    # of the linearization's seconds: attention transfer; the rest fine-tunes
SKIPPED = 'skipped (time budget)'
CUT = 'cut by the time budget'
MODEL_LABELS = {'linvit_tiny_patch16_224': 'linvit-Ti', 'vit_tiny_patch16_224': 'ViT-Ti',
                'linvit_small_patch16_224': 'linvit-S', 'vit_small_patch16_224': 'ViT-S'}
TEACHER_MODEL = 'vit_small_patch16_224'
STUDENT_FEATURE_MAP = 'hedgehog'  # the linearization recipe's linearize.convert (recipe.LINEARIZE_RECIPE)


@dataclass
class QualitySettings:
    """What ``tools/quality_check.py`` asks for; ``resolved()`` fills the budget and makes the paths absolute."""
    device: str = 'cuda:0'
    quick: bool = False                        # tiny sizes, the same code: for a CPU
    out: str = 'runs/quality_check'            # tables, CSV, plot, logs, the runs' folders
    budget_s: Optional[float] = None           # total seconds (default: the preset's)
    fmnist_dir: str = DEFAULT_FMNIST_DIR       # the Fashion-MNIST IDX files
    cache_dir: str = 'build/quality_check_cache'  # rendered sets and their decoded-image caches, kept for reruns
    pipeline: str = 'cached'                   # a key of PIPELINES

    @property
    def preset(self) -> 'Preset':
        return QUICK if self.quick else FULL

    def resolved(self) -> 'QualitySettings':
        """A copy with the budget filled and absolute paths; ValueError for an unknown pipeline or a budget that
        leaves no time for one process."""
        budget = self.preset.budget_s if self.budget_s is None else float(self.budget_s)
        if budget <= REPORT_RESERVE_S + self.preset.startup_s:
            raise ValueError(f"the budget must be more than {REPORT_RESERVE_S + self.preset.startup_s:.0f} s, "
                             f"got {budget:g}")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline {self.pipeline!r} is not one of {list(PIPELINES)}")
        return dataclasses.replace(self, budget_s=budget, out=str(Path(self.out).resolve()),
                                   cache_dir=str(Path(self.cache_dir).resolve()),
                                   fmnist_dir=str(Path(self.fmnist_dir).resolve()))


@dataclass(frozen=True)
class Canvas:
    """One rendered set: canvas side (px) and Fashion-MNIST items per class in each split."""
    px: int
    train_per_class: int
    val_per_class: int
    batch: int                  # the recipe's batch at this size

    @property
    def steps_per_epoch(self) -> int:
        return (10 * self.train_per_class) // self.batch  # training drops the last partial batch


@dataclass(frozen=True)
class SegSet:
    """One rendered segmentation set (the quality grid's): canvas side (px), train and val images, and the batch."""
    px: int
    train_images: int
    val_images: int
    batch: int

    @property
    def steps_per_epoch(self) -> int:
        return self.train_images // self.batch  # training drops the last partial batch


@dataclass(frozen=True)
class Preset:
    budget_s: float
    canvases: Dict[str, Canvas]        # 'teacher' (256 px), 'base' (512 px), 'high' (1024 px)
    shares: Dict[str, float]           # of the training seconds, per group (GROUPS)
    lanes: int                         # runs side by side at most (the teacher's evaluation and linearization wait)
    startup_s: float                   # allowance per run's process: imports, device, data, model, final files
    slack: float                       # a run's deadline: startups + slack x its planned training seconds
    probe_s: float                     # the probe's deadline after the start
    probe_warmup: int
    probe_repeats: int
    workers: int                       # data.num_workers of every run
    threads: Optional[int] = None      # torch threads per run (CPU: several runs share the cores)
    max_steps: Optional[int] = None    # a cap on every run's steps (quick)
    model_kwargs: Tuple[Tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class RunSpec:
    key: str              # 'tiny/base/linvit', ..., 'teacher', 'teacher/high', 'linearized'
    group: str            # the budget share it belongs to
    model: str            # timm name (the teacher's for 'teacher/high' and 'linearized')
    canvas: str           # a key of Preset.canvases
    job: str              # 'train', 'eval' (the trained teacher evaluated) or 'linearize'
    compared: str         # how its row is compared, for the table

    @property
    def label(self) -> str:
        if self.job == 'eval':
            return 'ViT-S teacher'
        if self.job == 'linearize':
            return f"ViT-S linearized ({STUDENT_FEATURE_MAP})"
        return ('ViT-S teacher' if self.key == 'teacher' else MODEL_LABELS[self.model])

    @property
    def folder(self) -> str:
        return self.key.replace('/', '_')


def pair_runs(size: str, res: str) -> Tuple[RunSpec, RunSpec]:
    """linvit and timm's softmax ViT of one size ('tiny', 'small') at one canvas ('base': equal steps, 'high':
    equal seconds)."""
    compared = 'equal steps' if res == 'base' else 'equal seconds'
    return tuple(RunSpec(f"{size}/{res}/{kind}", f"{size}/{res}", f"{prefix}_{size}_patch16_224", res, 'train',
                         compared) for kind, prefix in (('linvit', 'linvit'), ('softmax', 'vit')))


RUNS: Tuple[RunSpec, ...] = (
    *pair_runs('tiny', 'base'), *pair_runs('small', 'base'), *pair_runs('tiny', 'high'), *pair_runs('small', 'high'),
    RunSpec('teacher', 'teacher', TEACHER_MODEL, 'teacher', 'train', 'teacher, trained'),
    RunSpec('teacher/high', 'linearized', TEACHER_MODEL, 'high', 'eval', 'teacher, evaluated'),
    RunSpec('linearized', 'linearized', TEACHER_MODEL, 'high', 'linearize', 'linearized teacher'),
)
RUN_BY_KEY = {spec.key: spec for spec in RUNS}
GROUPS = ('tiny/base', 'small/base', 'tiny/high', 'small/high', 'teacher', 'linearized')
NEEDS_TEACHER = ('teacher/high', 'linearized')

FULL = Preset(
    budget_s=300.0,
    canvases={'teacher': Canvas(256, 2000, 100, 128), 'base': Canvas(512, 1000, 100, 128),
              'high': Canvas(1024, 200, 50, 32)},
    shares={'tiny/base': 0.28, 'small/base': 0.22, 'tiny/high': 0.14, 'small/high': 0.14, 'teacher': 0.12,
            'linearized': 0.10},
    lanes=1,
    startup_s=12.0, slack=2.0, probe_s=45.0, probe_warmup=2, probe_repeats=4, workers=8)
QUICK = Preset(
    # on 2 CPU cores a run's process spends ~5 s of CPU importing; 4 side by side took ~10 s each and 45 s in all
    # (more side by side took longer: memory and page-table work). Allowance and budget are generous caps.
    budget_s=300.0,
    canvases={'teacher': Canvas(64, 2, 2, 8), 'base': Canvas(64, 2, 2, 8), 'high': Canvas(128, 2, 2, 8)},
    shares=FULL.shares,
    lanes=4,
    startup_s=60.0, slack=2.0, probe_s=40.0, probe_warmup=1, probe_repeats=1, workers=0, threads=1, max_steps=2,
    model_kwargs=(('depth', 2),))


@dataclass(frozen=True)
class ProbeCase:
    model: str
    px: int
    batch: int
    convert: Optional[str] = None  # convert_to_linear's feature map (the linearization's student)

    @property
    def key(self) -> str:
        return f"{self.model}{'+' + self.convert if self.convert else ''}@{self.px}x{self.batch}"


def probe_case(spec: RunSpec, preset: Preset) -> Optional[ProbeCase]:
    """The training step a run repeats (None for an evaluation): the student's for the linearization."""
    if spec.job == 'eval':
        return None
    canvas = preset.canvases[spec.canvas]
    convert = STUDENT_FEATURE_MAP if spec.job == 'linearize' else None
    return ProbeCase(spec.model, canvas.px, canvas.batch, convert)


def probe_cases(preset: Preset) -> List[ProbeCase]:
    """Each distinct case once, in the runs' order (a probe cut by its deadline has measured the first runs)."""
    cases: Dict[str, ProbeCase] = {}
    for spec in RUNS:
        case = probe_case(spec, preset)
        if case is not None:
            cases.setdefault(case.key, case)
    return list(cases.values())


@dataclass(frozen=True)
class RunPlan:
    epochs: int                 # train.epochs (the cosine schedule's length)
    max_steps: Optional[int]    # train.max_steps (None: the whole schedule)
    steps: int                  # optimizer steps it will train (stage 2's for the linearization)
    planned_s: float            # training seconds at the probe's step time (both stages)
    step_s: Optional[float]     # the probe's seconds per step
    stage1_steps: int = 0       # the linearization's attention-transfer steps


def schedule(steps: int, steps_per_epoch: int) -> Tuple[int, Optional[int], int]:
    """(train.epochs, train.max_steps, steps trained) for about ``steps`` optimizer steps: the nearest whole number
    of epochs, so that the cosine schedule ends with the run; below half an epoch, one epoch stopped at ``steps``
    (its schedule unfinished)."""
    epochs = round(steps / steps_per_epoch)
    if epochs >= 1:
        return epochs, None, epochs * steps_per_epoch
    return 1, steps, steps


def training_seconds(preset: Preset, runs_left: Sequence[RunSpec], time_left: float) -> float:
    """Seconds of training the runs not yet started can share: what is left, less the report's reserve and their
    startup allowances (two for the linearization, which starts two stages), ``lanes`` of them at a time."""
    starts = sum(2 if spec.job == 'linearize' else 1 for spec in runs_left) / preset.lanes
    return max(0.0, time_left - REPORT_RESERVE_S - starts * preset.startup_s)


def group_seconds(preset: Preset, group: str, runs_left: Sequence[RunSpec], time_left: float) -> float:
    """A group's training seconds, planned when its first run starts: its share of what the runs not yet started
    can train in the time left (so that a run quicker or slower than planned moves the later groups' budgets)."""
    groups_left = dict.fromkeys(spec.group for spec in runs_left)
    share = preset.shares[group] / sum(preset.shares[g] for g in groups_left)
    return share * training_seconds(preset, runs_left, time_left)


def planned(steps_wanted: float, step_s: float, canvas: Canvas, preset: Preset) -> Optional[RunPlan]:
    """The schedule of ``steps_wanted`` steps (capped by ``preset.max_steps``); None when not even one fits."""
    steps = int(steps_wanted)
    if preset.max_steps is not None:
        steps = min(steps, preset.max_steps)
    if steps < 1:
        return None
    epochs, max_steps, trained = schedule(steps, canvas.steps_per_epoch)
    return RunPlan(epochs, max_steps, trained, trained * step_s, step_s)


def plan_group(group: str, seconds: float, step_s: Dict[str, float], preset: Preset) -> Dict[str, Any]:
    """{run key: RunPlan, or a status saying why it has none} for the runs of one group sharing ``seconds``."""
    specs = [spec for spec in RUNS if spec.group == group]
    times = {spec.key: step_s.get(probe_case(spec, preset).key) for spec in specs if spec.job != 'eval'}
    # the teacher's evaluation needs no step time and no share: it runs beside the linearization
    plans: Dict[str, Any] = {spec.key: RunPlan(0, None, 0, 0.0, None) for spec in specs if spec.job == 'eval'}
    missing = [key for key, t in times.items() if t is None]
    if missing:
        return {**plans, **{key: f"skipped (no step time measured for {', '.join(missing)})" for key in times}}
    canvas = preset.canvases[specs[0].canvas]
    if group.endswith('/base'):  # equal steps: the pair's seconds buy each step of both models
        plan = planned(seconds / sum(times.values()), 1.0, canvas, preset)
        plans.update({key: plan and dataclasses.replace(plan, planned_s=plan.steps * t, step_s=t)
                      for key, t in times.items()})
    elif group.endswith('/high'):  # equal seconds: half each, at its own step time
        plans.update({key: planned(seconds / 2 / t, t, canvas, preset) for key, t in times.items()})
    elif group == 'teacher':
        plans.update({key: planned(seconds / t, t, canvas, preset) for key, t in times.items()})
    else:  # the linearization: stage 1 then stage 2, both at the student's step time
        t = times['linearized']
        stage1 = max(1, int(STAGE1_FRACTION * seconds / t))
        if preset.max_steps is not None:
            stage1 = min(stage1, preset.max_steps)
        plan = planned((1 - STAGE1_FRACTION) * seconds / t, t, canvas, preset)
        plans['linearized'] = plan and dataclasses.replace(plan, stage1_steps=stage1,
                                                           planned_s=(plan.steps + stage1) * t)
    return {key: plan if plan is not None else SKIPPED for key, plan in plans.items()}


def run_dir(settings: QualitySettings, spec: RunSpec) -> Path:
    """The run's folder (its output_dir): out/runs/<key with '_' for '/'>."""
    return Path(settings.out) / 'runs' / spec.folder

