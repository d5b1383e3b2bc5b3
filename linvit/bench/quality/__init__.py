"""The quality check: linvit against timm's softmax ViT at high resolution, trained through the engine on a GPU in
minutes (``tools/quality_check.py``, ``make gpu-quality``).

    settings = QualitySettings(device='cuda:0').resolved()     # or QualitySettings(device='cpu', quick=True)
    status = run_quality_check(settings, start=time.time())   # writes settings.out/quality_check.{md,csv,png}

What it trains (every run its own process with a deadline, through ``linvit.engine``'s ``train`` and ``evaluate``;
nothing of a checkout is needed: no train.py, no configs/):

1. linvit-Tiny against timm's ViT-Tiny, then linvit-Small against ViT-Small, at 512 px: the same recipe and the same
   number of optimizer steps;
2. the same two pairs at 1024 px for the same training seconds: a run has no time budget, so each model's steps are
   its share of seconds divided by its own step time, measured alone on the device before any run (the probe), then
   rounded to whole epochs so that every run ends its own cosine schedule. The table shows the seconds each run
   really trained (from its metrics.csv), which is what the comparison is read against;
3. linearization at high resolution: a softmax ViT-Small teacher trained at 256 px, linearized (stage 1 attention
   transfer, stage 2 fine-tuning with distillation) at 1024 px, against the teacher itself evaluated at 1024 px (its
   position embedding resampled).

The largest share of the budget goes to the Tiny pair at 512 px, where the recipe's own bar is set (ViT-Tiny at 85%
top-1 or more: the recipe learns). The targets of the comparisons: linvit within 1 top-1 point of softmax at equal
steps, ahead of it at equal seconds, and the linearized model at 98% or more of its teacher's top-1. The modules:

    plan     settings, presets, the runs and their groups, the probe's cases, each group's steps
    recipe   the recipes as config values (RECIPE, LINEARIZE_RECIPE, with the reasons for each choice), each run's job
    job      a run's process (``python -m linvit.bench.quality.job JOB_JSON``): the engine's train or evaluate
    data     the Fashion-MNIST canvases, rendered once, and their decoded-image caches
    probe    the probe's process: seconds per training step of every model
    runner   the parent: probe and data, the runs under their deadlines, ``run_quality_check``
    results  a run's metrics.csv and metrics.json read back into its row
    report   quality_check.md (also printed), quality_check.csv, quality_check.png

The quality grid (``tools/quality_check.py --grid cpu|gpu``) trains every linear configuration (local mix on and
off) and the softmax ViT on the same recipe, steps and seeds, for classification and segmentation, and reports each
configuration's mean and spread over the seeds and its gap to softmax:

    settings = GridSettings(grid='cpu', device='cpu').resolved()   # or grid='gpu', device='cuda:0'; quick=True
    status = run_quality_grid(settings, start=time.time())       # writes settings.out/quality_grid.{md,csv,png}

    grid         the configurations (CONFIGS), tasks, presets (cpu, gpu, quick), the runs and their jobs
    grid_runner  the sets, every run in its own process one after another, ``run_quality_grid``
    grid_report  quality_grid.md (also printed), quality_grid.csv, quality_grid.png

Output in ``out``: those three files, logs/ (each process's output) and runs/ (the run folders).
``run_quality_check`` returns 1 when a run failed with an error (not when it was cut or skipped for time), else 0.

Imports at module level are the standard library and linvit's light modules; the prepare step imports linvit's data
and engine (the training stack), the probe and the runs' processes torch and timm, the report matplotlib.
"""
from .grid import CONFIGS, GRID_PRESETS, QUICK_GRID, GridSettings
from .grid_runner import run_quality_grid
from .plan import DEFAULT_FMNIST_DIR, FULL, PIPELINES, QUICK, QualitySettings
from .runner import run_quality_check

__all__ = ['DEFAULT_FMNIST_DIR', 'FULL', 'PIPELINES', 'QUICK', 'QualitySettings', 'run_quality_check', 'CONFIGS',
           'GRID_PRESETS', 'QUICK_GRID', 'GridSettings', 'run_quality_grid']
