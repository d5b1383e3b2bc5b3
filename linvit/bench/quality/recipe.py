"""The recipes of the quality check, as config values built here (the check needs no checkout: no train.py, no
configs/), and the job of each run: the recipe, the run's overrides, and how it runs.

    job = train_job(settings, preset, RUN_BY_KEY['tiny/base/linvit'], plan, data_folder)
    cfg = job.config()                          # the RunConfig the run trains with (linvit.engine.load_config)

``RECIPE`` is the same for every model compared; ``configs/cls_fmnist_quality.yaml`` writes it as a file for train.py
(a test holds the two equal). It was chosen by reasoning, to be judged on a GPU (the old one, 5 epochs at batch 32
and lr 5e-4 on cluttered canvases, reached 12-16% top-1 after 2-3 epochs):

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

``SEG_RECIPE`` is the quality grid's segmentation recipe (``grid``): RECIPE's optimizer, warmup, cosine, clipping and lr
rule on the Fashion-MNIST segmentation canvases, with configs/seg_fmnist_hires.yaml's augmentation (random scale
0.75-1.5 and crop; no flips, as for classification) and the mlp head evaluated on whole images.

``LINEARIZE_RECIPE`` (``configs/linearize_cls_fmnist.yaml`` as a file) linearizes the trained teacher: stage 1
trains each layer's hedgehog feature map to imitate the teacher's attention, stage 2 fine-tunes every tensor with
the task loss plus distillation; the check sets its steps, data and size.
"""
import math
from pathlib import Path
from typing import Any, Dict, List

from .job import Job
from .plan import (
    PIPELINES,
    RUN_BY_KEY,
    STUDENT_FEATURE_MAP,
    WARMUP_FRACTION,
    Canvas,
    Preset,
    QualitySettings,
    RunPlan,
    RunSpec,
    run_dir,
)

__all__ = ['RECIPE', 'SEG_RECIPE', 'LINEARIZE_RECIPE', 'CLIP_GRAD', 'LABEL_SMOOTHING', 'learning_rate',
           'common_overrides', 'schedule_overrides', 'train_job', 'linearize_job', 'eval_job', 'job_of']

_FOLDER_DATA = {'name': 'folder', 'root': '???', 'num_workers': 2}
_NO_CROPS_NO_FLIPS = {'random_resized_crop': False, 'scale': [0.5, 1.0], 'hflip': 0.0}
_ADAMW_COSINE = {'opt': 'adamw', 'weight_decay': 0.05, 'sched': 'cosine', 'log_every': 10}

#: linvit and timm's softmax ViT from scratch on Fashion-MNIST items alone on large canvases (RunConfig's keys)
RECIPE: Dict[str, Any] = {
    'task': 'classification', 'seed': 0, 'device': 'auto',
    'model': {'name': 'linvit_tiny_patch16_224', 'drop_path_rate': 0.0},
    'data': {**_FOLDER_DATA, 'img_size': 512, 'batch_size': 128,
             'aug': {**_NO_CROPS_NO_FLIPS, 'label_smoothing': 0.1}},
    'train': {**_ADAMW_COSINE, 'epochs': 8, 'lr': 1.0e-3, 'warmup_epochs': 0.8, 'clip_grad': 1.0, 'pictures': False},
}
#: the quality grid's segmentation runs: linvit or timm's softmax ViT as the backbone of the mlp head (RunConfig's keys)
SEG_RECIPE: Dict[str, Any] = {
    'task': 'segmentation', 'seed': 0, 'device': 'auto',
    'model': {'name': 'linvit_tiny_patch16_224', 'drop_path_rate': 0.0},
    'data': {**_FOLDER_DATA, 'img_size': 512, 'batch_size': 32, 'ignore_index': 255,
             'aug': {'scale_range': [0.75, 1.5], 'hflip': 0.0, 'color_jitter': 0.0}},
    'seg': {'head': 'mlp', 'neck_dim': 128, 'head_dim': 128, 'eval': {'mode': 'whole'}},
    # RECIPE's lr rule at batch 32 (5e-4, also configs/seg_fmnist_hires.yaml's lr)
    'train': {**_ADAMW_COSINE, 'epochs': 8, 'lr': 5.0e-4, 'warmup_epochs': 0.8, 'clip_grad': 1.0, 'pictures': False},
}
#: the teacher (a softmax ViT trained by RECIPE) turned into linear attention, both stages (RunConfig's keys)
LINEARIZE_RECIPE: Dict[str, Any] = {
    'task': 'linearize', 'seed': 0, 'device': 'auto',
    'model': {'name': 'linvit_tiny_patch16_224', 'drop_path_rate': 0.0},
    'data': {**_FOLDER_DATA, 'img_size': 64, 'batch_size': 64, 'aug': dict(_NO_CROPS_NO_FLIPS)},
    'train': {**_ADAMW_COSINE, 'epochs': 1, 'lr': 2.0e-4, 'warmup_epochs': 0.05},
    'linearize': {'teacher': '???', 'convert': {'feature_map': STUDENT_FEATURE_MAP}, 'attention_epochs': 1,
                  'attention_max_steps': 100, 'attention_lr': 1.0e-2, 'distill_weight': 0.5, 'temperature': 2.0},
}
CLIP_GRAD = RECIPE['train']['clip_grad']  # the probe clips as the runs do
LABEL_SMOOTHING = RECIPE['data']['aug']['label_smoothing']


def learning_rate(batch: int, recipe: Dict[str, Any] = RECIPE) -> float:
    """The recipe's lr scaled from its batch to ``batch`` with the square root (Adam-type optimizers)."""
    return recipe['train']['lr'] * math.sqrt(batch / recipe['data']['batch_size'])


def common_overrides(settings: QualitySettings, preset: Preset, seed: int = 0) -> List[str]:
    """What every run of the check (and of the grid, whose presets also have ``workers`` and ``threads``) sets: the
    device and its precision, the input pipeline, workers, threads, no pictures (they cost seconds of the budget),
    the seed."""
    precision = 'bfloat16' if settings.device.startswith('cuda') else 'float32'
    overrides = [f"device={settings.device}", f"train.precision={precision}", f"data.num_workers={preset.workers}",
                 *PIPELINES[settings.pipeline], 'train.pictures=false', f"seed={seed}"]
    return overrides + ([f"threads={preset.threads}"] if preset.threads else [])


def schedule_overrides(plan: RunPlan, canvas: Canvas) -> List[str]:
    """The run's epochs, step cap and warmup (WARMUP_FRACTION of its steps, in epochs); ``canvas``: any set with
    ``steps_per_epoch`` (the grid's segmentation sets too)."""
    warmup = WARMUP_FRACTION * plan.steps / canvas.steps_per_epoch
    return [f"train.epochs={plan.epochs}", f"train.max_steps={plan.max_steps if plan.max_steps else 'null'}",
            f"train.warmup_epochs={warmup:.4g}"]


def train_job(settings: QualitySettings, preset: Preset, spec: RunSpec, plan: RunPlan, data: Path) -> Job:
    """RECIPE for one model at one canvas size: its batch, the lr scaled to it, the planned schedule."""
    canvas = preset.canvases[spec.canvas]
    overrides = [f"model.name={spec.model}", f"data.root={data}", f"output_dir={run_dir(settings, spec)}",
                 f"data.img_size={canvas.px}", f"data.batch_size={canvas.batch}",
                 f"train.lr={learning_rate(canvas.batch):.4g}", *schedule_overrides(plan, canvas),
                 *common_overrides(settings, preset)]
    overrides += [f"model.kwargs.{key}={value}" for key, value in preset.model_kwargs]
    return Job('train', tuple(overrides), recipe=RECIPE)


def linearize_job(settings: QualitySettings, preset: Preset, spec: RunSpec, plan: RunPlan, data: Path,
                  teacher: Path) -> Job:
    """LINEARIZE_RECIPE on the teacher's run folder at the high-resolution size: its stages' steps; the recipe's lr
    and distillation as they are, no speed measurement (it costs seconds of the budget)."""
    canvas = preset.canvases[spec.canvas]
    overrides = [f"linearize.teacher={teacher}", f"data.root={data}", f"output_dir={run_dir(settings, spec)}",
                 f"data.img_size={canvas.px}", f"data.batch_size={canvas.batch}", *schedule_overrides(plan, canvas),
                 f"linearize.attention_max_steps={plan.stage1_steps}", 'linearize.speed=false',
                 *common_overrides(settings, preset)]
    return Job('linearize', tuple(overrides), recipe=LINEARIZE_RECIPE)


def eval_job(settings: QualitySettings, preset: Preset, spec: RunSpec, data: Path, teacher: Path) -> Job:
    """The teacher's run evaluated at the high-resolution size (its position embedding resampled), as trained."""
    canvas = preset.canvases[spec.canvas]
    overrides = [f"data.root={data}", f"data.img_size={canvas.px}", f"data.batch_size={canvas.batch}",
                 *common_overrides(settings, preset)]
    return Job('eval', tuple(overrides), weights=str(teacher), out=str(run_dir(settings, spec)))


def job_of(settings: QualitySettings, preset: Preset, spec: RunSpec, plan: RunPlan, data: Dict[str, Path]) -> Job:
    """The job of any run: the teacher's evaluation and linearization read its run folder."""
    teacher = run_dir(settings, RUN_BY_KEY['teacher'])
    if spec.job == 'eval':
        return eval_job(settings, preset, spec, data[spec.canvas], teacher)
    if spec.job == 'linearize':
        return linearize_job(settings, preset, spec, plan, data[spec.canvas], teacher)
    return train_job(settings, preset, spec, plan, data[spec.canvas])
