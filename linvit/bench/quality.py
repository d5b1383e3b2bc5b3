"""The quality check: linvit against timm's softmax ViT at high resolution, trained by train.py on a GPU in minutes.

    settings = QualitySettings(device='cuda:0').resolved()     # or QualitySettings(device='cpu', quick=True)
    status = run_quality_check(settings, start=time.time())   # writes settings.out/quality_check.{md,csv,png}

What it trains (every run a train.py process with a deadline, on a GPU one after the other, so that each run's
seconds, img/s and peak memory are its own; a run cut by a deadline is a row that says so, never estimated):

1. linvit-Tiny against timm's ViT-Tiny, then linvit-Small against ViT-Small, at 512 px: the same recipe and the same
   number of optimizer steps;
2. the same two pairs at 1024 px for the same training seconds: train.py has no time budget, so each model's steps
   are its share of seconds divided by its own step time, measured alone on the device before any run (the probe:
   ``linvit.engine.step.TrainStep`` with AdamW on a random batch, the recipe's batch, autocast and clipping), then
   rounded to whole epochs so that every run ends its own cosine schedule. The table shows the seconds each run
   really trained (from its metrics.csv), which is what the comparison is read against;
3. linearization at high resolution: a softmax ViT-Small teacher trained at 256 px, linearized with
   configs/linearize_cls_fmnist.yaml (stage 1 attention transfer, stage 2 fine-tuning with distillation) at 1024 px,
   against the teacher itself run at 1024 px (``train.py --eval-only TEACHER data.img_size=1024``: its position
   embedding resampled).

The probe's step times also size everything else: the budget (``budget_s``, 5 minutes on a GPU), less the
prepare step (rendering, the decoded-image caches, the probe) and an allowance per process start, is split between
the groups above by ``Preset.shares``, each group's when its first run starts (so that runs quicker or slower than
planned move the later groups' seconds), and each run's epochs follow from its seconds and step time. The largest
share goes to the Tiny pair at 512 px, where issue 42 sets the recipe's bar (ViT-Tiny at 85% top-1 or more).

The data: Fashion-MNIST items (the IDX files in ``fmnist_dir``, which ``make gpu-prep`` packs) upscaled 2x-6x at a
random place on a smooth background (``linvit.data.fmnist_hires``, ``fragments=0``: no clutter), one set per canvas
size (256, 512 and 1024 px), rendered once into ``cache_dir`` and reused by later runs, as are their decoded-image
caches. train.py reads them through the input pipeline ``pipeline`` names: ``cached`` (``data.cache=true``: decoded
once, augmented in batches on the device) or ``albumentations`` (per-image decoding in loader workers).

The recipe (configs/cls_fmnist_quality.yaml, the same for every model compared; chosen by reasoning, to be judged on
a GPU: the old one, 5 epochs at batch 32 and lr 5e-4 on cluttered canvases, reached 12-16% top-1 after 2-3 epochs):

- no clutter (``fragments=0``): the old sets pasted 12 pieces of other items on each 512 px canvas, so a model first
  had to learn which of a dozen garment-like shapes carries the label; with one item per canvas the task is finding
  and classifying one object, which a short run can learn, and it still needs the whole canvas (the item can be
  anywhere, 56-168 px wide in a 512 or 1024 px image);
- batch 128 at 256 and 512 px (32 at 1024 px, where the activations of ViT-Small are 4x larger): many more images
  per second from the GPU, and a less noisy gradient for the higher learning rate;
- AdamW, lr 1e-3 at batch 128, scaled with the square root of the batch (5e-4 at batch 32; the rule for Adam-type
  optimizers): the equivalent of 5e-4 at batch 64 under linear scaling, the best of three one-epoch pilots on the
  64 px Fashion-MNIST canvases (docs/linearize.md, configs/cls_fmnist64_teacher.yaml);
- warmup over the first 10% of the steps, then cosine to zero over whole epochs (a ViT trained from scratch at a high
  learning rate is unstable without warmup; the old recipe warmed up for a fifth of its run), gradient clipping at 1.0
  against the loss spikes of early ViT training, weight decay 0.05;
- label smoothing 0.1 (the ViT/DeiT default: no saturated logits under the higher lr), no flips (Fashion-MNIST's shoes
  all point the same way), no random crops (a crop can cut the one item out of its canvas), no mixup (it slows short
  runs);
- bfloat16 autocast on CUDA, eager steps (compiling would cost more of a five-minute budget than it saves).

Output in ``out``: quality_check.md (the table, the comparisons against issue 42's targets and the probe's step
times; also printed), quality_check.csv (one row per run), quality_check.png (top-1 against optimizer steps and
against training seconds), logs/ (each process's output) and runs/ (the train.py run folders). ``run_quality_check``
returns 1 when a run failed with an error (not when it was cut or skipped for time), else 0.

Imports at module level are the standard library only; the prepare step imports linvit's data and engine (the
training stack train.py needs anyway), the probe process torch and timm, the report matplotlib.
"""
import csv
import dataclasses
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]  # the repository: train.py and configs/
RECIPE_CONFIG = ROOT / 'configs' / 'cls_fmnist_quality.yaml'
LINEARIZE_CONFIG = ROOT / 'configs' / 'linearize_cls_fmnist.yaml'
DEFAULT_FMNIST_DIR = os.environ.get('FMNIST_DIR', '/usr/share/datasets/fashion-mnist')
#: train.py overrides of each input pipeline: the decoded-image cache with batched augmentation on the device, or
#: per-image decoding and albumentations in the loader's workers. Every train.py command and the cache warm-up of
#: the prepare step take theirs from here.
PIPELINES = {'cached': ('data.cache=true',), 'albumentations': ('data.cache=false',)}
REPORT_RESERVE_S = 5.0   # kept at the end of the budget for the tables and the plot
WARMUP_FRACTION = 0.1    # of each run's steps
CLIP_GRAD = 1.0          # the recipe's train.clip_grad (the probe clips as the runs do)
LABEL_SMOOTHING = 0.1    # the recipe's data.aug.label_smoothing
STAGE1_FRACTION = 0.2    # of the linearization's seconds: attention transfer; the rest fine-tunes
PROBE_MARK = 'QUALITY_PROBE '
SKIPPED = 'skipped (time budget)'
CUT = 'cut by the time budget'
MODEL_LABELS = {'linvit_tiny_patch16_224': 'linvit-Ti', 'vit_tiny_patch16_224': 'ViT-Ti',
                'linvit_small_patch16_224': 'linvit-S', 'vit_small_patch16_224': 'ViT-S'}
TEACHER_MODEL = 'vit_small_patch16_224'
STUDENT_FEATURE_MAP = 'hedgehog'  # configs/linearize_cls_fmnist.yaml's linearize.convert


# ----------------------------------------------------------------------------------------------------------------
# what to run: settings, presets, runs

@dataclass
class QualitySettings:
    """What ``tools/quality_check.py`` asks for; ``resolved()`` fills the budget and makes the paths absolute."""
    device: str = 'cuda:0'
    quick: bool = False                        # tiny sizes, the same code: for a CPU
    out: str = 'runs/quality_check'            # tables, CSV, plot, logs, train.py runs
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
        return (10 * self.train_per_class) // self.batch  # train.py drops the last partial batch


@dataclass(frozen=True)
class Preset:
    budget_s: float
    canvases: Dict[str, Canvas]        # 'teacher' (256 px), 'base' (512 px), 'high' (1024 px)
    shares: Dict[str, float]           # of the training seconds, per group (GROUPS)
    lanes: int                         # runs side by side at most (the teacher's evaluation and linearization wait)
    startup_s: float                   # allowance per train.py process: imports, device, data, model, final files
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
    job: str              # 'train', 'eval' (train.py --eval-only) or 'linearize'
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
    return tuple(RunSpec(f"{size}/{res}/{kind}", f"{size}/{res}", f"{family}_{size}_patch16_224", res, 'train',
                         compared) for kind, family in (('linvit', 'linvit'), ('softmax', 'vit')))


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
    # on 2 CPU cores a train.py process spends ~5 s of CPU importing; 4 side by side took ~10 s each and 45 s in all
    # (more side by side took longer: memory and page-table work). Allowance and budget are generous caps.
    budget_s=300.0,
    canvases={'teacher': Canvas(64, 2, 2, 8), 'base': Canvas(64, 2, 2, 8), 'high': Canvas(128, 2, 2, 8)},
    shares=FULL.shares,
    lanes=4,
    startup_s=60.0, slack=2.0, probe_s=40.0, probe_warmup=1, probe_repeats=1, workers=0, threads=1, max_steps=2,
    model_kwargs=(('depth', 2),))


# ----------------------------------------------------------------------------------------------------------------
# the data: Fashion-MNIST sets rendered once, their decoded-image caches warmed

def missing_idx_files(idx_dir: Path) -> List[str]:
    """The Fashion-MNIST IDX stems not found (as stem or stem.gz) in idx_dir."""
    from linvit.data.fmnist_hires import IDX_STEMS, find_idx_file
    missing = []
    for stems in IDX_STEMS.values():
        for stem in stems:
            try:
                find_idx_file(idx_dir, stem)
            except FileNotFoundError:
                missing.append(stem)
    return missing


def data_unavailable(fmnist_dir: str) -> Optional[str]:
    """Why no run can start, known before anything starts (the status of every row), or None."""
    try:
        missing = missing_idx_files(Path(fmnist_dir))
    except ImportError as exc:
        return f"error: the training stack does not import ({type(exc).__name__}: {exc})"
    if missing:
        return f"skipped (no Fashion-MNIST IDX files in {fmnist_dir}: set FMNIST_DIR)"
    return None


def canvas_folder(settings: QualitySettings, canvas: Canvas) -> Path:
    return Path(settings.cache_dir) / (f"fmnist_hires_{canvas.px}px_{canvas.train_per_class}x"
                                       f"{canvas.val_per_class}_clean_seed0")


def render_canvas_set(settings: QualitySettings, canvas: Canvas) -> Path:
    """The folder of the rendered ImageFolder set (train/ and val/), rendered unless a finished one (manifest.csv)
    is there; a render cut short leaves only a .partial folder. ValueError / FileNotFoundError from the renderer."""
    from linvit.data.fmnist_hires import FmnistHiresSpec, write_dataset
    data = canvas_folder(settings, canvas)
    if (data / 'manifest.csv').is_file():
        return data
    partial = data.with_name(data.name + '.partial')
    shutil.rmtree(partial, ignore_errors=True)
    images = 10 * (canvas.train_per_class + canvas.val_per_class)
    # a process pool pays off from a few hundred images; leave two cores to the probe's kernel launches
    workers = max(1, min((os.cpu_count() or 1) - 2, images // 300))
    spec = FmnistHiresSpec(out=partial, task='classification', size=canvas.px, fragments=0, seed=0,
                           train_per_class=canvas.train_per_class, val_per_class=canvas.val_per_class,
                           workers=workers, idx_dir=Path(settings.fmnist_dir))
    print(write_dataset(spec, log=lambda line: print(line, flush=True)), flush=True)
    shutil.rmtree(data, ignore_errors=True)  # a folder without manifest.csv is not a finished set
    partial.rename(data)
    return data


def warm_decoded_caches(settings: QualitySettings, canvas: Canvas, folder: Path) -> None:
    """Build the set's decoded-image caches at the canvas size (train and val) as train.py would, so that no run
    pays for the decoding and no two runs build one cache at the same time. Nothing to do for a pipeline without
    a cache."""
    if settings.pipeline != 'cached':
        return
    from linvit.data import build_classification_datasets
    from linvit.engine import load_config
    cfg = load_config(str(RECIPE_CONFIG), [f"data.root={folder}", f"data.img_size={canvas.px}",
                                           *PIPELINES[settings.pipeline]])
    build_classification_datasets(cfg.data, (0.5,) * 3, (0.5,) * 3, with_train=True)


def prepare_data(settings: QualitySettings, preset: Preset) -> Tuple[Dict[str, Path], str]:
    """({canvas role: set folder}, '') or ({}, why not): every set rendered and its caches warmed."""
    folders: Dict[str, Path] = {}
    try:
        for role, canvas in preset.canvases.items():
            folders[role] = render_canvas_set(settings, canvas)
            warm_decoded_caches(settings, canvas, folders[role])
    except (FileNotFoundError, ValueError) as err:
        return {}, f"error: preparing the data failed: {err}"[:300]
    return folders, ''


# ----------------------------------------------------------------------------------------------------------------
# the probe: seconds per training step of every model, measured alone on the device before any run

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


def probe_step_s(case: ProbeCase, preset: Preset, device_name: str) -> float:
    """Median seconds of one training step (forward, loss, backward, clipping, AdamW; bfloat16 autocast on CUDA) of
    the case's model on a random batch [batch, 3, px, px], after ``probe_warmup`` steps."""
    import timm
    import torch
    from timm.optim import create_optimizer_v2

    import linvit
    from linvit.engine.step import TrainStep

    device = torch.device(device_name)
    torch.manual_seed(0)
    model = timm.create_model(case.model, img_size=case.px, num_classes=10, **dict(preset.model_kwargs))
    if case.convert:
        linvit.convert_to_linear(model, feature_map=case.convert)
    model = model.to(device).train()
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-4, weight_decay=0.05)
    loss = torch.nn.CrossEntropyLoss(label_smoothing=LABEL_SMOOTHING)
    step = TrainStep(model, loss, optimizer, amp_dtype=torch.bfloat16 if device.type == 'cuda' else None,
                     clip_grad=CLIP_GRAD)
    images = torch.randn(case.batch, 3, case.px, case.px, device=device)
    targets = torch.randint(0, 10, (case.batch,), device=device)
    for _ in range(preset.probe_warmup):
        step(images, targets)
    times = []
    for _ in range(preset.probe_repeats):
        if device.type == 'cuda':
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        step(images, targets)
        if device.type == 'cuda':
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def probe_meta(device_name: str) -> Dict[str, Any]:
    import timm
    import torch

    from linvit.bench.machine import describe_machine
    return {'key': 'meta', 'machine': describe_machine(torch.device(device_name)), 'torch': torch.__version__,
            'timm': timm.__version__}


def run_probe(settings: QualitySettings, deadline: float) -> None:
    """The probe's process: a result line per case (step_s, or a status saying why not) until the deadline."""
    import torch
    print(PROBE_MARK + json.dumps(probe_meta(settings.device)), flush=True)
    for case in probe_cases(settings.preset):
        if time.time() > deadline:
            break
        try:
            record = {'key': case.key, 'step_s': probe_step_s(case, settings.preset, settings.device), 'status': 'ok'}
        except Exception as exc:  # noqa: BLE001  (one model that does not fit is a row, not a failed check)
            oom = isinstance(exc, torch.OutOfMemoryError) or 'out of memory' in str(exc).lower()
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ''
            record = {'key': case.key, 'status': 'oom' if oom else f"error: {type(exc).__name__}: {text}"[:200]}
        print(PROBE_MARK + json.dumps(record), flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def read_probe(log: Path) -> Dict[str, Dict[str, Any]]:
    """The probe's records by key ('meta' and the cases it finished)."""
    if not log.is_file():
        return {}
    lines = log.read_text(errors='replace').splitlines()
    return {r['key']: r for r in (json.loads(line[len(PROBE_MARK):]) for line in lines if line.startswith(PROBE_MARK))}


# ----------------------------------------------------------------------------------------------------------------
# the plan: each run's steps from its share of the budget and its step time

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


# ----------------------------------------------------------------------------------------------------------------
# the train.py commands

def learning_rate(batch: int, recipe_lr: float, recipe_batch: int) -> float:
    """The recipe's lr scaled with the square root of the batch (Adam-type optimizers)."""
    return recipe_lr * math.sqrt(batch / recipe_batch)


def common_overrides(settings: QualitySettings, preset: Preset) -> List[str]:
    """What every train.py process of the check sets: the device and its precision, the input pipeline, workers,
    threads, no pictures (they cost seconds of the budget), the seed."""
    precision = 'bfloat16' if settings.device.startswith('cuda') else 'float32'
    overrides = [f"device={settings.device}", f"train.precision={precision}", f"data.num_workers={preset.workers}",
                 *PIPELINES[settings.pipeline], 'train.pictures=false', 'seed=0']
    return overrides + ([f"threads={preset.threads}"] if preset.threads else [])


def run_dir(settings: QualitySettings, spec: RunSpec) -> Path:
    return Path(settings.out) / 'runs' / spec.folder


def schedule_overrides(plan: RunPlan, canvas: Canvas) -> List[str]:
    warmup = WARMUP_FRACTION * plan.steps / canvas.steps_per_epoch
    return [f"train.epochs={plan.epochs}", f"train.max_steps={plan.max_steps if plan.max_steps else 'null'}",
            f"train.warmup_epochs={warmup:.4g}"]


def train_command(settings: QualitySettings, preset: Preset, spec: RunSpec, plan: RunPlan, data: Path,
                  recipe: Tuple[float, int]) -> List[str]:
    """train.py with the recipe (configs/cls_fmnist_quality.yaml) for one model at one canvas size."""
    canvas = preset.canvases[spec.canvas]
    overrides = [f"model.name={spec.model}", f"data.root={data}", f"output_dir={run_dir(settings, spec)}",
                 f"data.img_size={canvas.px}", f"data.batch_size={canvas.batch}",
                 f"train.lr={learning_rate(canvas.batch, *recipe):.4g}", *schedule_overrides(plan, canvas),
                 *common_overrides(settings, preset)]
    overrides += [f"model.kwargs.{key}={value}" for key, value in preset.model_kwargs]
    return [sys.executable, str(ROOT / 'train.py'), '--config', str(RECIPE_CONFIG), *overrides]


def linearize_command(settings: QualitySettings, preset: Preset, spec: RunSpec, plan: RunPlan, data: Path,
                      teacher: Path) -> List[str]:
    """train.py with configs/linearize_cls_fmnist.yaml: the teacher's run folder, the high-resolution set, its
    stages' steps; the config's lr and distillation as they are."""
    canvas = preset.canvases[spec.canvas]
    overrides = [f"linearize.teacher={teacher}", f"data.root={data}", f"output_dir={run_dir(settings, spec)}",
                 f"data.img_size={canvas.px}", f"data.batch_size={canvas.batch}", *schedule_overrides(plan, canvas),
                 f"linearize.attention_max_steps={plan.stage1_steps}", 'linearize.speed=false',
                 *common_overrides(settings, preset)]
    return [sys.executable, str(ROOT / 'train.py'), '--config', str(LINEARIZE_CONFIG), *overrides]


def eval_command(settings: QualitySettings, preset: Preset, spec: RunSpec, data: Path, teacher: Path) -> List[str]:
    """train.py --eval-only of the teacher's run at the high-resolution size (position embedding resampled)."""
    canvas = preset.canvases[spec.canvas]
    overrides = [f"data.root={data}", f"data.img_size={canvas.px}", f"data.batch_size={canvas.batch}",
                 *common_overrides(settings, preset)]
    return [sys.executable, str(ROOT / 'train.py'), '--eval-only', str(teacher), '--out',
            str(run_dir(settings, spec)), *overrides]


def read_recipe() -> Tuple[float, int]:
    """(lr, batch) of configs/cls_fmnist_quality.yaml: the point the lr is scaled from."""
    from linvit.engine import load_config
    cfg = load_config(str(RECIPE_CONFIG), ['data.root=unused'])
    return float(cfg.train.lr), int(cfg.data.batch_size)


# ----------------------------------------------------------------------------------------------------------------
# running the processes under their deadlines

@dataclass
class Running:
    """A started process and when it must have ended (a time.time())."""
    proc: subprocess.Popen
    started: float
    deadline: float

    def outcome(self) -> Optional[Tuple[Optional[int], float]]:
        """None while it runs; once it exited (its return code, seconds since it started); at its deadline it is
        killed with its process group (DataLoader workers included) and gives (None, seconds)."""
        if self.proc.poll() is not None:
            return self.proc.returncode, time.time() - self.started
        if time.time() < self.deadline:
            return None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return None, time.time() - self.started


def wait_or_kill(procs: Sequence[subprocess.Popen], deadlines: Sequence[float]) -> List[Tuple[Optional[int], float]]:
    """(return code, seconds until it exited) of each proc once all exited; one still running at its deadline (a
    time.time()) is killed with its process group and gives (None, seconds until then)."""
    running = [Running(proc, time.time(), deadline) for proc, deadline in zip(procs, deadlines)]
    outcomes: Dict[int, Tuple[Optional[int], float]] = {}
    while len(outcomes) < len(running):
        for i, run in enumerate(running):
            if i not in outcomes and (outcome := run.outcome()) is not None:
                outcomes[i] = outcome
        time.sleep(0.2)
    return [outcomes[i] for i in range(len(running))]


def run_deadline(spec: RunSpec, plan: RunPlan, started: float, end: float, preset: Preset) -> float:
    """When a run is stopped: its startups (two for the linearization's stages, and for the evaluation, whose plan
    has no seconds) and ``slack`` times its planned training seconds (evaluations, checkpoints, a slower step than
    probed) after it started, and never after ``end``."""
    starts = 1 if spec.job == 'train' else 2
    return min(end, started + starts * preset.startup_s + preset.slack * plan.planned_s)


def command_of(settings: QualitySettings, preset: Preset, spec: RunSpec, plan: RunPlan, data: Dict[str, Path],
               recipe: Tuple[float, int]) -> List[str]:
    teacher = run_dir(settings, RUN_BY_KEY['teacher'])
    if spec.job == 'eval':
        return eval_command(settings, preset, spec, data[spec.canvas], teacher)
    if spec.job == 'linearize':
        return linearize_command(settings, preset, spec, plan, data[spec.canvas], teacher)
    return train_command(settings, preset, spec, plan, data[spec.canvas], recipe)


def blocked(spec: RunSpec, plans: Dict[str, Any], records: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """Why a run cannot start (no plan, or the teacher it needs did not finish), else None."""
    plan = plans.get(spec.key, SKIPPED)
    if not isinstance(plan, RunPlan):
        return plan
    teacher = records.get('teacher', {})
    if spec.key in NEEDS_TEACHER and teacher.get('status') != 'ok':
        return f"skipped (the teacher did not finish: {teacher.get('status', 'not run')})"
    return None


def start_run(settings: QualitySettings, spec: RunSpec, command: List[str]) -> subprocess.Popen:
    """The run's train.py process in its own process group (killed whole at its deadline), output in its log."""
    shutil.rmtree(run_dir(settings, spec), ignore_errors=True)
    run_dir(settings, spec).parent.mkdir(parents=True, exist_ok=True)
    with open(Path(settings.out) / 'logs' / f"{spec.folder}.log", 'w') as log:
        log.write(' '.join(command) + '\n')
        log.flush()
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def plan_when_first(spec: RunSpec, plans: Dict[str, Any], pending: Sequence[RunSpec], step_s: Dict[str, float],
                    preset: Preset, time_left: float) -> None:
    """Plan the group of ``spec`` if none of its runs is planned yet (``pending``: the runs not started, ``spec``
    first among its group's)."""
    if any(other.key in plans for other in RUNS if other.group == spec.group):
        return
    plans.update(plan_group(spec.group, group_seconds(preset, spec.group, pending, time_left), step_s, preset))


def run_all(settings: QualitySettings, preset: Preset, step_s: Dict[str, float], data: Dict[str, Path],
            recipe: Tuple[float, int], end: float) -> Dict[str, Dict[str, Any]]:
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
            proc = start_run(settings, spec, command_of(settings, preset, spec, plans[spec.key], data, recipe))
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
    if plan.step_s is None:
        return 'evaluation'
    stages = f"{plan.stage1_steps} + " if plan.stage1_steps else ''
    return f"{stages}{plan.steps} steps, {plan.planned_s:.0f} s planned"


# ----------------------------------------------------------------------------------------------------------------
# reading a run: metrics.csv's train rows (timing) and val rows (top-1)

@dataclass
class Curve:
    """What a run's metrics.csv holds: (step, training seconds, top-1) at each evaluation, the training totals."""
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


def read_curve(path: Path, batch: int) -> Curve:
    """A run's Curve from its metrics.csv. A train row covers the steps since the row before it (train.py logs at
    every epoch's end, so no row spans an epoch boundary and its evaluation): its seconds are those steps' images
    over its img_per_s. Evaluations are not training seconds."""
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
        elif row['split'] == 'val' and row.get('top1'):
            curve.points.append((step, curve.train_s, float(row['top1'])))
    return curve


def run_curve(settings: QualitySettings, preset: Preset, spec: RunSpec) -> Curve:
    """The run's curve; the linearization's is stage 1's followed by stage 2's."""
    batch = preset.canvases[spec.canvas].batch
    folder = run_dir(settings, spec)
    if spec.job == 'linearize':
        return read_curve(folder / 'stage1' / 'metrics.csv', batch).extend(
            read_curve(folder / 'stage2' / 'metrics.csv', batch))
    return read_curve(folder / 'metrics.csv', batch)


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
    """The last non-empty line of a log (train.py ends an expected failure with one line saying why), or ''."""
    if not log.is_file():
        return ''
    lines = [line.strip() for line in log.read_text(errors='replace').splitlines() if line.strip()]
    return lines[-1][:200] if lines else ''


def run_record(settings: QualitySettings, preset: Preset, spec: RunSpec, plans: Dict[str, Any],
               records: Dict[str, Dict[str, Any]], code: Optional[int], wall_s: float) -> Dict[str, Any]:
    """A finished, failed or cut run's row: top-1 (a fraction), steps, seconds, img/s, peak memory, status."""
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
    metrics_path = folder / 'metrics.json'
    if code != 0 or not metrics_path.is_file():
        why = last_line(Path(settings.out) / 'logs' / f"{spec.folder}.log")
        return {**record, 'status': f"error: train.py exited {code} (logs/{spec.folder}.log: {why})"[:300]}
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


# ----------------------------------------------------------------------------------------------------------------
# the report: markdown, CSV, curves

def fmt(value: Optional[float], spec: str) -> str:
    return '-' if value is None else format(value, spec)


def percent(value: Optional[float]) -> Optional[float]:
    return None if value is None else 100 * value


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    return lines + ['| ' + ' | '.join(row) + ' |' for row in rows]


TABLE_HEADER = ('model', 'px', 'compared', 'top-1 %', 'steps', 'train s', 'wall s', 'img/s', 'peak MiB', 'status')
CSV_FIELDS = ('key', 'model', 'timm_model', 'px', 'batch', 'compared', 'top1', 'steps', 'train_s', 'wall_s',
              'img_per_s', 'peak_mem_mib', 'data_wait_frac', 'status', 'planned_steps', 'planned_s', 'probe_step_s',
              'epochs', 'teacher_resized_top1', 'converted_top1', 'stage1_top1', 'teacher_input', 'run_dir')


def table_rows(records: Dict[str, Dict[str, Any]]) -> List[List[str]]:
    rows = []
    for spec in RUNS:
        r = records[spec.key]
        rows.append([r['model'], str(r['px']), r['compared'], fmt(percent(r.get('top1')), '.1f'),
                     fmt(r.get('steps'), ','), fmt(r.get('train_s'), '.1f'), fmt(r.get('wall_s'), '.0f'),
                     fmt(r.get('img_per_s'), ',.0f'), fmt(r.get('peak_mem_mib'), ',.0f'), r['status']])
    return rows


def finished_top1(record: Dict[str, Any]) -> Optional[float]:
    return record.get('top1') if record.get('status') == 'ok' else None


#: (title, run compared, run it is compared with, how: 'points' = difference in top-1 points, 'ratio' = %, target)
COMPARISONS = (
    ('Tiny, equal steps', 'tiny/base/linvit', 'tiny/base/softmax', 'points', 'linvit within 1 point'),
    ('Small, equal steps', 'small/base/linvit', 'small/base/softmax', 'points', 'linvit within 1 point'),
    ('Tiny, equal seconds', 'tiny/high/linvit', 'tiny/high/softmax', 'points', 'linvit ahead'),
    ('Small, equal seconds', 'small/high/linvit', 'small/high/softmax', 'points', 'linvit ahead'),
    ('linearized vs its teacher at the same size', 'linearized', 'teacher/high', 'ratio', '>= 98%'),
)


def comparison_rows(records: Dict[str, Dict[str, Any]]) -> List[List[str]]:
    """One row per comparison of issue 42, from finished runs only (a cut or skipped run gives '-')."""
    rows = []
    for title, first, second, how, target in COMPARISONS:
        a, b = finished_top1(records[first]), finished_top1(records[second])
        if a is None or b is None:
            result = '-'
        elif how == 'points':
            result = f"{100 * (a - b):+.1f} points"
        else:
            result = f"{100 * a / b:.1f}%" if b > 0 else '-'
        px = records[first]['px']
        rows.append([f"{title} ({px} px)", f"{records[first]['model']} {fmt(percent(a), '.1f')}",
                     f"{records[second]['model']} {fmt(percent(b), '.1f')}", result, target])
    vit_tiny = records['tiny/base/softmax']
    top1 = percent(finished_top1(vit_tiny))
    rows.append([f"ViT-Ti alone ({vit_tiny['px']} px)", '', f"ViT-Ti {fmt(top1, '.1f')}",
                 '-' if top1 is None else f"{top1:.1f}%", '>= 85% (the recipe learns)'])
    return rows


def header_lines(settings: QualitySettings, preset: Preset, meta: Dict[str, Any], prepare_s: float,
                 wall_s: float) -> List[str]:
    sets = ', '.join(f"{c.px} px {10 * c.train_per_class:,} / {10 * c.val_per_class:,}"
                     for c in {c.px: c for c in preset.canvases.values()}.values())
    machine = f"{meta.get('machine', settings.device)} ({settings.device})"
    together = 'Runs ran one at a time' if preset.lanes == 1 else f"Up to {preset.lanes} runs ran side by side"
    versions = f"; torch {meta['torch']}, timm {meta['timm']}" if 'torch' in meta else ''
    return ['# linvit quality check', '',
            f"{machine}{versions}; {'quick' if settings.quick else 'full'} preset, budget {settings.budget_s:.0f} s, "
            f"wall {wall_s:.0f} s (prepare: data and probe {prepare_s:.0f} s); input pipeline "
            f"'{settings.pipeline}' ({' '.join(PIPELINES[settings.pipeline])}).", '',
            f"Data: Fashion-MNIST items alone (no clutter), upscaled 2-6x at a random place on canvases of {sets} "
            f"train / val images, from {settings.fmnist_dir}. Recipe: {RECIPE_CONFIG.relative_to(ROOT)} for every "
            f"trained model (lr scaled with the square root of the batch); the linearization: "
            f"{LINEARIZE_CONFIG.relative_to(ROOT)}. Steps: a group's share of the time left when its first run "
            f"starts, over each model's step time measured alone (below), in whole epochs; equal steps: one "
            f"schedule for both models; equal seconds: the same planned training seconds for both, and 'train s' "
            f"is what each trained (metrics.csv's train rows). {together}; '{CUT}' and "
            f"'{SKIPPED}' mark rows the budget did not hold, never estimated.", '']


def probe_rows(probe: Dict[str, Dict[str, Any]], preset: Preset) -> List[List[str]]:
    rows = []
    for case in probe_cases(preset):
        r = probe.get(case.key, {'status': 'not measured (the probe stopped at its deadline)'})
        step_s = r.get('step_s')
        rows.append([case.model + (f" + {case.convert}" if case.convert else ''), str(case.px), str(case.batch),
                     fmt(None if step_s is None else step_s * 1e3, ',.1f'),
                     fmt(None if step_s is None else case.batch / step_s, ',.0f'), r['status']])
    return rows


def markdown(records: Dict[str, Dict[str, Any]], probe: Dict[str, Dict[str, Any]], settings: QualitySettings,
             preset: Preset, prepare_s: float, wall_s: float) -> str:
    lines = header_lines(settings, preset, probe.get('meta', {}), prepare_s, wall_s)
    lines += [*md_table(TABLE_HEADER, table_rows(records)), '', '## Comparisons (issue 42)', '',
              *md_table(('comparison', 'linvit / student top-1 %', 'softmax / teacher top-1 %', 'result', 'target'),
                        comparison_rows(records)), '']
    linearized = records['linearized']
    if linearized.get('teacher_resized_top1') is not None:
        lines += [f"The linearization's own report: teacher {fmt(percent(linearized['teacher_resized_top1']), '.1f')}% "
                  f"fed {linearized.get('teacher_input')}, converted before training "
                  f"{fmt(percent(linearized.get('converted_top1')), '.1f')}%, after stage 1 "
                  f"{fmt(percent(linearized.get('stage1_top1')), '.1f')}%.", '']
    lines += ['## Step times measured alone (the probe)', '',
              'One training step (forward, loss, backward, clipping, AdamW) on a random batch, median of '
              f"{preset.probe_repeats} after {preset.probe_warmup} warm-up steps; they plan the runs' steps.", '',
              *md_table(('model', 'px', 'batch', 'ms / step', 'img/s', 'status'), probe_rows(probe, preset)), '']
    return '\n'.join(lines)


def write_csv(path: Path, records: Dict[str, Dict[str, Any]]) -> None:
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction='ignore')
        writer.writeheader()
        writer.writerows(records[spec.key] for spec in RUNS)


CURVE_COLORS = {'linvit': 'tab:blue', 'softmax': 'tab:red', 'teacher': 'tab:gray', 'linearized': 'tab:green'}


def curve_style(spec: RunSpec) -> Dict[str, Any]:
    """linvit blue, softmax red, teacher grey, the linearized student green; Tiny circles, Small squares; solid at
    the base size, dashed at the high one."""
    kind = spec.key.rsplit('/', 1)[-1] if spec.group.endswith(('/base', '/high')) else spec.key
    marker = 'o' if 'tiny' in spec.model else 's'
    return {'color': CURVE_COLORS[kind], 'marker': marker, 'linestyle': '--' if spec.canvas == 'high' else '-'}


def plot_curves(settings: QualitySettings, preset: Preset, records: Dict[str, Dict[str, Any]], path: Path,
                title: str) -> None:
    """Top-1 against optimizer steps (left) and against training seconds (right): a line per run through its
    evaluations; the teacher evaluated at the high size as a horizontal line."""
    from matplotlib.figure import Figure

    from linvit.plotting import save_png

    fig = Figure(figsize=(12, 4.6))
    axes = fig.subplots(1, 2)
    for spec in RUNS:
        record = records[spec.key]
        if spec.job == 'eval':
            if record.get('top1') is not None:
                for ax in axes:
                    ax.axhline(100 * record['top1'], color=CURVE_COLORS['teacher'], linestyle=':',
                               label=f"{record['model']} at {record['px']} px (eval only)")
            continue
        points = run_curve(settings, preset, spec).points if run_dir(settings, spec).is_dir() else []
        if not points:
            continue
        steps, seconds, top1 = zip(*points)
        label = f"{record['model']} {record['px']} px"
        for ax, x in zip(axes, (steps, seconds)):
            ax.plot(x, [100 * t for t in top1], label=label, markersize=4, **curve_style(spec))
    for ax, xlabel in zip(axes, ('optimizer steps', "training seconds (metrics.csv's train rows)")):
        if not ax.lines:
            ax.text(0.5, 0.5, 'no evaluations', ha='center', va='center', transform=ax.transAxes)
        else:
            ax.legend(fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel('top-1 (%)')
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def report(settings: QualitySettings, preset: Preset, records: Dict[str, Dict[str, Any]],
           probe: Dict[str, Dict[str, Any]], prepare_s: float, wall_s: float) -> str:
    """Write quality_check.md, quality_check.csv and quality_check.png into settings.out; returns the markdown."""
    out = Path(settings.out)
    text = markdown(records, probe, settings, preset, prepare_s, wall_s)
    (out / 'quality_check.md').write_text(text + '\n')
    write_csv(out / 'quality_check.csv', records)
    machine = probe.get('meta', {}).get('machine', settings.device)
    plot_curves(settings, preset, records, out / 'quality_check.png',
                f"linvit quality check on {machine}: Fashion-MNIST items on large canvases")
    return text


# ----------------------------------------------------------------------------------------------------------------
# the whole check

def start_probe(settings: QualitySettings, deadline: float) -> subprocess.Popen:
    """The probe's process (``python -m linvit.bench.quality SETTINGS_JSON DEADLINE``), output in logs/probe.log."""
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    env['PYTHONPATH'] = os.pathsep.join([str(ROOT)] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
    argv = [sys.executable, '-m', __name__, json.dumps(dataclasses.asdict(settings)), repr(deadline)]
    with open(Path(settings.out) / 'logs' / 'probe.log', 'w') as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)


def records_without_runs(preset: Preset, status: str) -> Dict[str, Dict[str, Any]]:
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
        records = run_all(settings, preset, step_s, data, read_recipe(), end)
    text = report(settings, preset, records, probe, prepare_s, time.time() - start)
    print(text)
    print(f"wrote {out / 'quality_check.md'}, {out / 'quality_check.csv'}, {out / 'quality_check.png'}; "
          f"runs in {out / 'runs'}")
    errors = [f"{key}: {r['status']}" for key, r in records.items() if r['status'].startswith('error')]
    for line in errors:
        print(f"FAILED {line}")
    return 1 if errors else 0


def probe_main(argv: Sequence[str]) -> int:
    """``python -m linvit.bench.quality SETTINGS_JSON DEADLINE``: the probe's process."""
    config, deadline = argv
    run_probe(QualitySettings(**json.loads(config)), float(deadline))
    return 0


if __name__ == '__main__':
    sys.exit(probe_main(sys.argv[1:]))
