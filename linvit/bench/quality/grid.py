"""The quality grid: every linear-attention configuration against timm's softmax ViT, on the same recipe, number of
steps and seeds, for classification and segmentation (``tools/quality_check.py --grid cpu|gpu``).

    settings = GridSettings(grid='cpu', device='cpu').resolved()
    runs = grid_runs(settings.grid_preset, settings.seeds)      # every (task, configuration, local mix, seed)
    job = grid_job(settings, settings.grid_preset, runs[0], data_folder)

What this module holds: the configurations (``CONFIGS``, one line each: edit it to add one), the tasks (the metric
each reports, which local-mix variants it trains), the presets (``cpu``, ``gpu``, ``quick``: sizes, steps, seeds)
and each run's job. ``grid_runner`` runs them, ``grid_report`` writes the tables.
"""
import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .job import Job
from .plan import Canvas, QualitySettings, RunPlan, SegSet
from .recipe import RECIPE, SEG_RECIPE, common_overrides, learning_rate, schedule_overrides

__all__ = ['GridConfig', 'SOFTMAX', 'CONFIGS', 'GridTask', 'TASKS', 'TASK_BY_NAME', 'GridPreset', 'CPU_GRID',
           'GPU_GRID', 'QUICK_GRID', 'GRID_PRESETS', 'GridSettings', 'GridRun', 'grid_runs', 'grid_run_dir',
           'override_value', 'grid_job']

LINVIT_TINY = 'linvit_tiny_patch16_224'


@dataclass(frozen=True)
class GridConfig:
    """One configuration of the grid: its label in the tables, the timm model, its ``model.kwargs`` overrides."""
    label: str
    model: str
    kwargs: Tuple[Tuple[str, Any], ...] = ()

    @property
    def linear(self) -> bool:
        """A linvit model: trained with its local-mix branch on and off (the softmax ViT has none)."""
        return self.model.startswith('linvit_')


SOFTMAX = GridConfig('softmax', 'vit_tiny_patch16_224')
#: the configurations compared, softmax first (the gaps are read against it); a linear one the model does not know
#: yet fails with an error row
CONFIGS: Tuple[GridConfig, ...] = (
    SOFTMAX,
    GridConfig('elu1', LINVIT_TINY, (('feature_map', 'elu1'),)),
    GridConfig('relu', LINVIT_TINY, (('feature_map', 'relu'),)),
    GridConfig('focused', LINVIT_TINY, (('feature_map', 'focused'),)),
    GridConfig('inline', LINVIT_TINY, (('feature_map', 'elu1'), ('normalizer', 'inline'))),
    GridConfig('mala', LINVIT_TINY, (('feature_map', 'elu1'), ('normalizer', 'mala'))),
    GridConfig('nala', LINVIT_TINY, (('feature_map', 'nala'),)),
    GridConfig('polar', LINVIT_TINY, (('attn_family', 'polar'),)),
)


@dataclass(frozen=True)
class GridTask:
    """A task of the grid: the recipe, the metric of its metrics.json, the local-mix variants of linear models."""
    name: str
    metric: str                       # key of the run's metrics.json and of metrics.csv's val rows
    metric_label: str                 # its column in the tables (a fraction shown in percent)
    local_mix: Tuple[bool, ...]       # segmentation: local mix on only, to keep the CPU grid within the hour
    recipe: Dict[str, Any] = dataclasses.field(compare=False)


TASKS: Tuple[GridTask, ...] = (
    GridTask('classification', 'top1', 'top-1 %', (True, False), RECIPE),
    GridTask('segmentation', 'miou', 'mIoU %', (True,), SEG_RECIPE),
)
TASK_BY_NAME = {task.name: task for task in TASKS}


@dataclass(frozen=True)
class GridPreset:
    """The sizes of one grid: the sets, the steps per task (the same for every configuration and seed), the seeds."""
    name: str
    classification: Canvas            # the rendered classification set and its batch
    segmentation: SegSet              # the rendered segmentation set and its batch
    steps: Dict[str, int]             # task -> optimizer steps of each run: whole epochs of its set
    seeds: Tuple[int, ...]
    workers: int                      # data.num_workers of every run
    run_timeout_s: float              # a run still going after this is stopped: a 'cut' row
    threads: Optional[int] = None     # torch threads per run (None: torch's default)
    model_kwargs: Tuple[Tuple[str, Any], ...] = ()   # every model, softmax too (CPU: shallower and narrower)
    lr: Optional[float] = None        # every run's lr (None: the recipe's, scaled to the batch)
    configs: Tuple[GridConfig, ...] = CONFIGS

    def __post_init__(self) -> None:
        for task, steps in self.steps.items():  # whole epochs: each cosine schedule ends with its run
            if steps % self.dataset(task).steps_per_epoch:
                raise ValueError(f"{self.name}: {task} steps {steps} are not whole epochs of "
                                 f"{self.dataset(task).steps_per_epoch}")

    def dataset(self, task: str) -> Any:
        """The set of ``task``: a Canvas (classification) or a SegSet (both have px, batch, steps_per_epoch)."""
        return getattr(self, task)


# CPU: 128 px, depth 4, width 96 (3 heads of 32), batch 32, on 2 cores, float32, cached pipeline, no workers. At
# width 192 (ViT-Ti's) one step took 0.19 s and 180 steps (2 epochs) left every model near 20% top-1: too early to
# tell configurations apart. At width 96 a step costs a third, and 540 steps (6 epochs of the 2,880 images) took 47 s
# (ViT) and 61 s (linvit elu1, local mix) with the process start, reaching 51% and 45% top-1 at lr 1e-3 (46% for ViT
# at the recipe's 5e-4): 45 classification runs ~ 42 min, 24 segmentation runs of 144 steps (4 epochs of 1,152
# images) ~ 20 min, about an hour one run at a time; measured: 82 min (nala, polar and segmentation ran slower).
CPU_GRID = GridPreset(
    'cpu', classification=Canvas(128, 288, 50, 32), segmentation=SegSet(128, 1152, 100, 32),
    steps={'classification': 540, 'segmentation': 144}, seeds=(0, 1, 2), workers=0, run_timeout_s=600.0, threads=2,
    model_kwargs=(('depth', 4), ('embed_dim', 96), ('num_heads', 3)), lr=1e-3)
# GPU: 512 px, full depth, batch 64, bfloat16, one run at a time. A run's process starts in ~7 s (imports, CUDA, the
# decoded-image cache), and ViT-Ti at 512 px (1,024 tokens) trains at roughly 30-50 ms a step eager, so a run is
# ~15 s: ~6 s of training (156 steps: one epoch of the quality check's own 512 px set, reused with its caches; 120
# segmentation steps: 4 epochs of 1,920 images) and its start and evaluations. The 3-seed grid (69 runs) is then
# ~17 minutes; make gpu-quality runs it with --seeds 1 (23 runs, ~6 minutes) after the 5-minute check, ~11 minutes in
# all: process starts, not steps, are most of a GPU run, so fewer steps would not buy the seeds back.
GPU_GRID = GridPreset(
    'gpu', classification=Canvas(512, 1000, 100, 64), segmentation=SegSet(512, 1920, 100, 64),
    steps={'classification': 156, 'segmentation': 120}, seeds=(0, 1, 2), workers=8, run_timeout_s=180.0)
# the same code at tiny sizes: 2 configurations (softmax and elu1), 1 seed, 2 steps a run (5 runs)
QUICK_GRID = GridPreset(
    'quick', classification=Canvas(64, 2, 2, 8), segmentation=SegSet(64, 16, 4, 8),
    steps={'classification': 2, 'segmentation': 2}, seeds=(0,), workers=0, run_timeout_s=120.0, threads=1,
    model_kwargs=(('depth', 2),), configs=CONFIGS[:2])
GRID_PRESETS = {'cpu': CPU_GRID, 'gpu': GPU_GRID}


@dataclass
class GridSettings(QualitySettings):
    """What ``tools/quality_check.py --grid`` asks for: the quality check's settings (device, data, cache, pipeline;
    its budget is not used), the grid and how many seeds."""
    out: str = 'runs/quality_grid'
    grid: str = 'cpu'                    # a key of GRID_PRESETS; quick: QUICK_GRID whatever the grid
    seeds: Optional[int] = None          # seeds 0..seeds-1 (default: the preset's)

    @property
    def grid_preset(self) -> GridPreset:
        return QUICK_GRID if self.quick else GRID_PRESETS[self.grid]

    def resolved(self) -> 'GridSettings':
        """A copy with absolute paths; ValueError for an unknown grid or fewer than one seed."""
        if self.grid not in GRID_PRESETS:
            raise ValueError(f"grid {self.grid!r} is not one of {list(GRID_PRESETS)}")
        if self.seeds is not None and self.seeds < 1:
            raise ValueError(f"seeds must be 1 or more, got {self.seeds}")
        return super().resolved()

    def command(self) -> str:
        """The command line that reproduces this grid's table."""
        args = ['python', 'tools/quality_check.py', '--grid', self.grid, '--device', self.device,
                *(['--quick'] if self.quick else []), *(['--seeds', str(self.seeds)] if self.seeds else []),
                '--fmnist-dir', self.fmnist_dir, '--pipeline', self.pipeline, '--out', self.out]
        return shlex.join(args)


@dataclass(frozen=True)
class GridRun:
    """One training run of the grid."""
    task: str
    config: GridConfig
    local_mix: Optional[bool]     # None: the softmax ViT, which has no local-mix branch
    seed: int

    @property
    def variant(self) -> str:
        """The row of the tables it belongs to: its configuration and local mix."""
        return self.config.label + ('' if self.local_mix is None else f" lm-{'on' if self.local_mix else 'off'}")

    @property
    def folder(self) -> str:
        """Its run folder's and log's name: 'classification_elu1_lm-on_seed0'."""
        return f"{self.task}_{self.variant.replace(' ', '_')}_seed{self.seed}"

    def model_kwargs(self, preset: GridPreset) -> Tuple[Tuple[str, Any], ...]:
        """The preset's kwargs (depth), the configuration's, and local_mix for a linear model."""
        local_mix = () if self.local_mix is None else (('local_mix', self.local_mix),)
        return (*preset.model_kwargs, *self.config.kwargs, *local_mix)


def grid_runs(preset: GridPreset, seeds: Optional[int] = None) -> List[GridRun]:
    """Every run in the order they go: task by task, configuration by configuration (local mix on, then off),
    seed by seed; ``seeds``: the first that many of 0, 1, 2, ... (default: the preset's)."""
    chosen = preset.seeds if seeds is None else tuple(range(seeds))
    return [GridRun(task.name, config, local_mix, seed)
            for task in TASKS for config in preset.configs
            for local_mix in (task.local_mix if config.linear else (None,)) for seed in chosen]


def grid_run_dir(settings: GridSettings, run: GridRun) -> Path:
    """The run's folder (its output_dir): out/runs/<run.folder>."""
    return Path(settings.out) / 'runs' / run.folder


def override_value(value: Any) -> str:
    """A kwargs value as a dotted override writes it (YAML: true/false for booleans)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def grid_job(settings: GridSettings, preset: GridPreset, run: GridRun, data: Path) -> Job:
    """The task's recipe for one run: the set at its size and batch, the lr scaled to it, the preset's steps as
    whole epochs and as the step cap, the run's seed, the model and its kwargs."""
    task = TASK_BY_NAME[run.task]
    dataset = preset.dataset(run.task)
    steps = preset.steps[run.task]
    plan = RunPlan(epochs=steps // dataset.steps_per_epoch, max_steps=steps, steps=steps, planned_s=0.0, step_s=None)
    overrides = [f"model.name={run.config.model}", f"data.root={data}", f"output_dir={grid_run_dir(settings, run)}",
                 f"data.img_size={dataset.px}", f"data.batch_size={dataset.batch}",
                 f"train.lr={preset.lr or learning_rate(dataset.batch, task.recipe):.4g}",
                 *schedule_overrides(plan, dataset),
                 *common_overrides(settings, preset, run.seed)]
    overrides += [f"model.kwargs.{key}={override_value(value)}" for key, value in run.model_kwargs(preset)]
    return Job('train', tuple(overrides), recipe=task.recipe)
