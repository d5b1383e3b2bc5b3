#!/usr/bin/env python
"""Why whole-image inference matters: one model, the whole image against sliding windows, on a task whose answer
lies far away: segmentation (mIoU) or depth (AbsRel, RMSE, delta1).

Segmentation (the default, make demo-context): the built-in shapes task (``linvit.data.synthetic_seg``) gives every
grey shape the class of one key square's colour (red or blue), and the key sits anywhere along the image's top or
left border: the class of a shape's pixels is decided up to a whole image side away. A model that sees the whole
image can relate the two (linear attention makes seeing the whole image cheap at any size: ``tools/predict.py`` runs
it in bounded memory); a sliding window that does not hold the key cannot, and guesses. This tool trains such a model
(``configs/seg_context_demo.yaml``: make demo's model at 64 px, about 3 minutes on 2 CPU cores) unless given a run.

Depth (``--config configs/depth_demo.yaml``, make demo-depth: 384 training steps, minutes on 2 CPU cores): the built-in
ground-plane scenes (``linvit.data.synthetic_depth``), where a box's depth is the ground's at the row it stands on, so
a window that sees the box but not its contact row and the horizon cannot tell near from far. Besides both ways it
scores the training set's mean depth predicted everywhere (what knowing nothing of the image gives), and says which
way is better on AbsRel.

Both ways are the run's own evaluation with the same model and weights (its task's ``evaluate_batch`` and meter, as
``train.py --eval-only`` runs it): ``seg.eval.mode=whole``, then ``seg.eval.mode=slide`` with windows of half the
image side every quarter side, outputs averaged where they overlap (``linvit.inference.segment``). The tool prints
the scores of each and draws the first validation images both ways (RUN/context_whole.png, RUN/context_windows.png:
image | ground truth | prediction, and for depth the relative error, where the windows' seams show).

    python tools/context_demo.py                                   # train runs/seg_context_demo, then compare
    python tools/context_demo.py --run runs/seg_context_demo       # compare only, with a trained run
    python tools/context_demo.py --window 48 --stride 16           # other windows
    python tools/context_demo.py --config configs/depth_demo.yaml  # train runs/depth_context_demo, then compare
    python tools/context_demo.py --run runs/depth_demo             # a depth run train.py trained
    python tools/context_demo.py --config configs/depth_demo.yaml train.epochs=1   # overrides for the new run

Windows of half the side are already larger than a shape, so each window holds whole shapes; what it misses is the
key, unless the key lies inside it (depth: the horizon and the row a box stands on). Larger images do not change
that: the answer is as far away as the image is large, so any window smaller than the image loses it for the objects
far from it.
"""
import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from linvit.bench.cli import HelpFormatter
from linvit.engine import load_config, train
from linvit.engine.distributed import setup_distributed
from linvit.engine.evaluation import evaluated_meter
from linvit.engine.loading import TrainedModel, load_trained
from linvit.engine.plots import plot_depth_grid, plot_segmentation_grid
from linvit.engine.run import Run, autocast_factory, build_run
from linvit.engine.tasks.base import input_multiple
from linvit.engine.tasks.depth import to_target_space
from linvit.models.segmentation import class_ids

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, 'configs', 'seg_context_demo.yaml')

#: a meter's ``compute()``: the scores of one way of predicting the validation images
Scores = Dict[str, Any]


# ---------------------------------------------------------------------------------------------------- per task

def segmentation_scores(scores: Scores, run: Run) -> str:
    per_class = ', '.join(f"{n} {v:.3f}" for n, v in zip(run.class_names, scores['per_class_iou']))
    return f"mIoU {scores['miou']:.3f} (per class: {per_class})"


def depth_unit(run: Run) -> str:
    return 'm' if run.cfg.depth.target == 'depth' else '1/m'


def depth_scores(scores: Scores, run: Run) -> str:
    return (f"AbsRel {scores['abs_rel']:.3f}  RMSE {scores['rmse']:.2f} {depth_unit(run)}  "
            f"delta1 {scores['delta1']:.3f}")


def depth_verdict(whole: Scores, windows: Scores) -> str:
    """Which way is better on AbsRel (lower is better), with delta1 beside it (higher is better)."""
    pair = f"{whole['abs_rel']:.3f} whole against {windows['abs_rel']:.3f} in windows (delta1 " \
           f"{whole['delta1']:.3f} against {windows['delta1']:.3f})"
    if f"{whole['abs_rel']:.3f}" == f"{windows['abs_rel']:.3f}":
        return f"whole image and sliding windows tie on AbsRel: {pair}"
    if whole['abs_rel'] < windows['abs_rel']:
        return f"whole image beats sliding windows on AbsRel: {pair}"
    return f"sliding windows beat the whole image on AbsRel: {pair}"


class ConstantOutput(nn.Module):
    """A model that ignores the image: images [B, C, H, W] -> [B, 1, H, W] all ``value``, one output channel as a
    depth model gives (the log of its target)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = float(value)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.new_full((images.shape[0], 1, *images.shape[-2:]), self.value)


def mean_depth_baseline(run: Run) -> Tuple[str, nn.Module]:
    """(name, model) of the training set's mean target (depth, or disparity) over its valid pixels predicted at
    every pixel: the score of knowing nothing of the image. Reads every training depth map once, unaugmented."""
    cfg = run.cfg
    train_set, _, _ = run.task.build_datasets(run.mean, run.std, with_train=True)
    total, pixels = 0.0, 0
    for index in range(len(train_set)):
        depth = torch.from_numpy(train_set.load(index)[1]).float()[None]
        values, valid = to_target_space(depth, cfg.depth.target, cfg.data.max_depth)
        total += float(values[valid].double().sum())
        pixels += int(valid.sum())
    mean = total / pixels  # every depth map has a valid pixel: the readers refuse one without
    name = f"the training set's mean {cfg.depth.target} ({mean:.2f} {depth_unit(run)}) everywhere"
    return name, ConstantOutput(math.log(mean))  # the model's output is the log of its target


def first_validation_samples(run: Run, count: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The first ``count`` validation (images [3, H, W], targets [H, W]), as the run's evaluation reads them."""
    samples = [run.val_set[i] for i in range(min(count, len(run.val_set)))]
    return [s[0] for s in samples], [s[1] for s in samples]


@torch.no_grad()
def predictions(run: Run, images: Sequence[torch.Tensor],
                predict: Callable[[torch.Tensor], torch.Tensor]) -> List[torch.Tensor]:
    """``predict(image [1, 3, H, W])`` [1, H, W] of each image under the run's autocast, on the CPU: [H, W] each."""
    with autocast_factory(run)():
        return [predict(image[None].to(run.info.device))[0].cpu() for image in images]


def draw_segmentation(run: Run, model: nn.Module, count: int, png_path: str) -> None:
    images, masks = first_validation_samples(run, count)
    predicted = predictions(run, images, lambda x: class_ids(run.task.predict(model, x)))
    plot_segmentation_grid(images, run.mean, run.std, masks, predicted, run.class_names, png_path,
                           run.cfg.data.ignore_index, count, getattr(run.val_set, 'palette', None))


def draw_depth(run: Run, model: nn.Module, count: int, png_path: str) -> None:
    images, depths = first_validation_samples(run, count)
    predicted = predictions(run, images, lambda x: run.task.predict_target(model, x))
    truths = []
    for depth in depths:
        values, valid = to_target_space(depth[None].float(), run.cfg.depth.target, run.cfg.data.max_depth)
        truths.append(torch.where(valid, values, math.nan)[0])  # NaN: drawn white, no depth there
    plot_depth_grid(images, run.mean, run.std, truths, predicted, png_path, label=run.cfg.depth.target,
                    max_images=count)


@dataclass(frozen=True)
class Report:
    """What the tool trains, prints and draws for the runs of one task."""
    out: str  # where a new run of this task is trained unless --out says
    scores: Callable[[Scores, Run], str]  # one way's scores as printed after its name
    draw: Callable[[Run, nn.Module, int, str], None]  # (run, model, count, png): the first images as run.task predicts
    columns: str  # what the pictures show, left to right
    baseline: Optional[Callable[[Run], Tuple[str, nn.Module]]] = None  # (name, model): a reference without the image
    verdict: Optional[Callable[[Scores, Scores], str]] = None  # (whole, windows) -> which is better, one line


#: the task of a run (``TrainedModel.task``) -> its report; other tasks are refused
REPORTS: Dict[str, Report] = {
    'segmentation': Report('runs/seg_context_demo', segmentation_scores, draw_segmentation,
                           'image | ground truth | prediction'),
    'depth': Report('runs/depth_context_demo', depth_scores, draw_depth,
                    'image | ground truth | prediction | relative error', mean_depth_baseline, depth_verdict),
}


def report_for(task: str, where: str) -> Report:
    if task not in REPORTS:
        raise ValueError(f"{where}: task={task}; the tool compares {' and '.join(REPORTS)} runs")
    return REPORTS[task]


# ---------------------------------------------------------------------------------------------------- the comparison

def default_windows(side: int, multiple: int) -> Tuple[int, int]:
    """(window, stride): half the image side, every quarter side rounded down to the patch (at least one patch)."""
    return side // 2, max(side // 4 // multiple * multiple, multiple)


def evaluation_runs(trained: TrainedModel, window: int, stride: int, batch_size: int) -> Dict[str, Run]:
    """{'whole': the run's evaluation with seg.eval.mode=whole, 'windows': with seg.eval.mode=slide} built from its
    saved config (task, validation set, meter), as the task its model serves (a linearization's: the one it
    linearized)."""
    info = setup_distributed(trained.cfg.device)
    common = [f'task={trained.task}', f'data.eval_batch_size={batch_size}']
    modes = {'whole': ['seg.eval.mode=whole'],
             'windows': ['seg.eval.mode=slide', f'seg.eval.window={window}', f'seg.eval.stride={stride}']}
    return {mode: build_run(load_config(None, [*common, *overrides], base=trained.cfg), info, with_train=False)
            for mode, overrides in modes.items()}


def compare(run: str, window: Optional[int], stride: Optional[int], batch_size: int,
            pictures: int) -> Dict[str, Scores]:
    """{'whole': scores, 'windows': scores} (the task meter's ``compute()``; a depth run adds 'baseline', the
    training set's mean depth everywhere) of the run's model on its validation images; prints them and draws
    context_whole.png and context_windows.png into the run's folder."""
    trained = load_trained(run)
    report = report_for(trained.task, run)
    side, multiple = trained.img_size[0], input_multiple(trained.model)
    default_window, default_stride = default_windows(side, multiple)
    window, stride = window or default_window, stride or default_stride
    runs = evaluation_runs(trained, window, stride, batch_size)
    model = trained.model.to(runs['whole'].info.device)
    scores = {mode: evaluated_meter(evaluation, model).compute() for mode, evaluation in runs.items()}
    names = {'whole': 'whole image', 'windows': f"sliding windows of {window} px every {stride} px"}
    if report.baseline is not None:
        names['baseline'], baseline = report.baseline(runs['whole'])
        scores['baseline'] = evaluated_meter(runs['whole'], baseline).compute()
    folder = run if os.path.isdir(run) else os.path.dirname(os.path.abspath(run))
    drawn = {mode: os.path.join(folder, f'context_{mode}.png') for mode in runs}
    for mode, evaluation in runs.items():
        report.draw(evaluation, model, pictures, drawn[mode])

    print(f"{len(runs['whole'].val_set)} validation images of {side} px, model {trained.cfg.model.name} "
          f"(patch {multiple}):")
    width = max(36, *(len(name) for name in names.values()))
    for mode, name in names.items():
        print(f"  {name:<{width}} {report.scores(scores[mode], runs['whole'])}")
    if report.verdict is not None:
        print(report.verdict(scores['whole'], scores['windows']))
    print(f"pictures ({report.columns}): {drawn['whole']}, {drawn['windows']}")
    return scores


def train_new_run(config: str, out: Optional[str], overrides: Sequence[str]) -> str:
    """Train ``config`` with the overrides into ``out`` (default: its task's folder, ``REPORTS``), replacing a run
    there; returns the run's folder. An unsupported task is refused before training."""
    task = load_config(config, overrides).task
    out = out or report_for(task, config).out
    train(load_config(config, [*overrides, f'output_dir={out}']), overwrite=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--run', help='a trained segmentation or depth run (a folder or its best.pt) to compare '
                                      '(default: train --config into --out first)')
    parser.add_argument('--config', help='the config a new run is trained with, of a segmentation or a depth task '
                                         '(default: configs/seg_context_demo.yaml; the depth demo: '
                                         'configs/depth_demo.yaml)')
    parser.add_argument('--out', help='where a new run is trained, replacing a run there (default: '
                                      f"{REPORTS['segmentation'].out} for segmentation, "
                                      f"{REPORTS['depth'].out} for depth)")
    parser.add_argument('--window', type=int, help='sliding window side in px (default: half the image side)')
    parser.add_argument('--stride', type=int, help='step between windows in px (default: a quarter of the side)')
    parser.add_argument('--batch-size', type=int, default=16, help='windows per forward')
    parser.add_argument('--pictures', type=int, default=6, help='validation images drawn in each picture')
    parser.add_argument('overrides', nargs='*', metavar='key=value',
                        help='config overrides of a new run, as train.py takes them (default: none)')
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.run is not None and args.overrides:
            raise ValueError(f"{' '.join(args.overrides)}: overrides configure a new run; --run {args.run} is "
                             f"compared as it was trained")
        run = args.run if args.run is not None else train_new_run(args.config or CONFIG, args.out, args.overrides)
        compare(run, args.window, args.stride, args.batch_size, args.pictures)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
