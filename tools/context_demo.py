#!/usr/bin/env python
"""Why whole-image inference matters: one model, the whole image against sliding windows, on a task whose answer
lies far away.

The built-in shapes task (``linvit.data.synthetic_seg``) gives every grey shape the class of one key square's colour
(red or blue), and the key sits anywhere along the image's top or left border: the class of a shape's pixels is
decided up to a whole image side away. A model that sees the whole image can relate the two (linear attention makes
seeing the whole image cheap at any size: ``tools/predict.py`` runs it in bounded memory); a sliding window that
does not hold the key cannot, and guesses. This tool trains such a model (``configs/seg_context_demo.yaml``:
make demo's model at 64 px, about 3 minutes on 2 CPU cores) unless given a run, then segments the validation images
both ways with the same model (``linvit.inference.segment``: 'whole', and 'slide' with windows of half the image
side every quarter side, logits averaged where they overlap), prints the mIoU and per-class IoU of each, and draws
the same images both ways (RUN/context_whole.png, RUN/context_windows.png: image | ground truth | prediction).

    python tools/context_demo.py                               # train runs/seg_context_demo, then compare
    python tools/context_demo.py --run runs/seg_context_demo   # compare only, with a trained run
    python tools/context_demo.py --window 48 --stride 16       # other windows

Windows of half the side are already larger than a shape, so each window holds whole shapes; what it misses is the
key, unless the key lies inside it. Larger images do not change that: the answer is as far away as the image is
large, so any window smaller than the image loses it for the shapes far from the key.
"""
import argparse
import os
import sys
from typing import Dict, List, Optional

import torch

from linvit.bench.cli import HelpFormatter
from linvit.data.segmentation import build_segmentation_datasets
from linvit.engine import load_config, train
from linvit.engine.loading import load_trained
from linvit.engine.metrics import SegmentationMeter
from linvit.engine.plots import plot_segmentation_grid
from linvit.inference import segment

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, 'configs', 'seg_context_demo.yaml')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--run', help='a trained segmentation run on the shapes task (default: train '
                                      'configs/seg_context_demo.yaml into --out first)')
    parser.add_argument('--out', default='runs/seg_context_demo', help='where a new run is trained (replaced)')
    parser.add_argument('--window', type=int, help='sliding window side in px (default: half the image side)')
    parser.add_argument('--stride', type=int, help='step between windows in px (default: a quarter of the side)')
    parser.add_argument('--batch-size', type=int, default=16, help='images per forward')
    parser.add_argument('--pictures', type=int, default=6, help='images drawn in each picture')
    return parser


def compare(run: str, window: Optional[int], stride: Optional[int], batch_size: int,
            pictures: int) -> Dict[str, Dict[str, object]]:
    """{'whole': scores, 'windows': scores} (``SegmentationMeter.compute``) of the run's model on its validation
    images; draws RUN/context_whole.png and RUN/context_windows.png."""
    trained = load_trained(run)
    model, cfg = trained.model.eval(), trained.cfg
    _, val, class_names = build_segmentation_datasets(cfg.data, trained.mean, trained.std, with_train=False)
    side = trained.img_size[0]
    multiple = model.input_multiple
    window = window or side // 2
    stride = stride or max(side // 4 // multiple * multiple, multiple)
    modes = {'whole': dict(mode='whole'), 'windows': dict(mode='slide', window=window, stride=stride)}
    meters = {name: SegmentationMeter(len(class_names), cfg.data.ignore_index) for name in modes}
    drawn: Dict[str, List[torch.Tensor]] = {name: [] for name in modes}
    images_drawn, masks_drawn = [], []
    for start in range(0, len(val), batch_size):
        samples = [val[i] for i in range(start, min(start + batch_size, len(val)))]
        images, masks = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
        for name, how in modes.items():
            with torch.no_grad():
                logits = segment(model, images, batch_size=batch_size, pad_multiple=multiple, **how)
            meters[name].update(logits, masks, torch.zeros((), dtype=torch.float64))
            drawn[name] += list(logits.argmax(1)[:pictures - len(drawn[name])])
        images_drawn += list(images[:pictures - len(images_drawn)])
        masks_drawn += list(masks[:pictures - len(masks_drawn)])
    scores = {name: meter.compute() for name, meter in meters.items()}
    for name in modes:
        plot_segmentation_grid(images_drawn, trained.mean, trained.std, masks_drawn, drawn[name], class_names,
                               os.path.join(run, f'context_{name}.png'), cfg.data.ignore_index, pictures,
                               getattr(val, 'palette', None))
    print(f"{len(val)} validation images of {side} px, model {cfg.model.name} (patch {multiple}):")
    for name in modes:
        what = 'whole image' if name == 'whole' else f"sliding windows of {window} px every {stride} px"
        per_class = ', '.join(f"{n} {v:.3f}" for n, v in zip(class_names, scores[name]['per_class_iou']))
        print(f"  {what:<36} mIoU {scores[name]['miou']:.3f} (per class: {per_class})")
    print(f"pictures (image | ground truth | prediction): {os.path.join(run, 'context_whole.png')}, "
          f"{os.path.join(run, 'context_windows.png')}")
    return scores


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    run = args.run
    try:
        if run is None:
            train(load_config(CONFIG, [f'output_dir={args.out}']), overwrite=True)
            run = args.out
        compare(run, args.window, args.stride, args.batch_size, args.pictures)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
