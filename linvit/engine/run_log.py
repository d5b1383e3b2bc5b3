"""What a run records as it trains (rank 0 only): the run directory's ``config.yaml`` and ``train.log``,
``metrics.csv`` and TensorBoard (``RunLog``), ``metrics.json``, and the window of training each train row sums up.

    with run_directory(cfg, info):                 # train.log receives linvit's and timm's log
        write_config(cfg, info)                    # config.yaml, once the run is set up
        log = RunLog(RunDir(cfg.output_dir), CSV_BASE_COLUMNS + ('top1', 'top5'), enabled=info.is_main)
        log.row({'epoch': 0, 'step': 10, 'split': 'train', 'loss': 0.7, ...})     # metrics.csv + TensorBoard
        log.picture('val/predictions', RunDir(cfg.output_dir).picture('val', 10), 10)
"""
import contextlib
import csv
import json
import logging
import math
import os
import sys
import time
from typing import Any, Dict, Iterator, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig

from .checkpoint import atomic_write
from .config import config_to_yaml
from .distributed import DistInfo
from .run_dir import RunDir

__all__ = ['RunLog', 'CSV_BASE_COLUMNS', 'TrainWindow', 'run_directory', 'write_config', 'write_json', 'format_metrics',
           'peak_memory_mib']

#: the columns of metrics.csv before the task's metric columns
CSV_BASE_COLUMNS = ('epoch', 'step', 'split', 'loss', 'lr', 'img_per_s', 'data_wait_frac', 'peak_mem_mib')
#: the loggers whose records train.log keeps
_LOGGERS = ('linvit', 'timm', 'py.warnings')


class RunLog:
    """metrics.csv, TensorBoard and the log file of one run; does nothing on ranks other than 0."""

    def __init__(self, files: RunDir, columns: Sequence[str], enabled: bool) -> None:
        self.files = files
        self.columns = list(columns)
        self.enabled = enabled
        self.csv_path = files.metrics_csv
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(files.tensorboard)

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after ``step`` (by a run that crashed after its last checkpoint), before resuming."""
        if not self.enabled or not os.path.exists(self.csv_path):
            return
        with open(self.csv_path, newline='') as f:
            rows = [row for row in csv.DictReader(f) if _step_of(row) <= step]
        with atomic_write(self.csv_path, mode='w') as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows({k: row.get(k, '') for k in self.columns} for row in rows)

    def row(self, values: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        new_file = not os.path.exists(self.csv_path)
        with open(self.csv_path, 'a', newline='') as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction='ignore')
            if new_file:
                writer.writeheader()
            writer.writerow({k: _format_cell(values.get(k)) for k in self.columns})
        for key, value in _scalars(values).items():
            if key not in ('epoch', 'step', 'split'):
                self.writer.add_scalar(f"{values['split']}/{key}", value, values['step'])
        self.writer.flush()

    def picture(self, tag: str, png_path: str, step: int) -> None:
        """Show a PNG the run drew (predictions, confusion matrix) in TensorBoard's images tab."""
        if not self.enabled or not os.path.isfile(png_path):
            return
        from PIL import Image
        with Image.open(png_path) as image:
            pixels = np.asarray(image.convert('RGB'))
        self.writer.add_image(tag, pixels, step, dataformats='HWC')
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _step_of(row: Dict[str, Any]) -> float:
    """The step of a metrics.csv row; infinite for a row a killed process left unfinished (dropped on resume)."""
    try:
        return int(row['step'])
    except (TypeError, ValueError):
        return math.inf


class TrainWindow:
    """Loss, throughput and data wait between two train rows; the loss stays on the device (no host sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.micro_batches = 0
        self.images = 0
        self.data_wait = 0.0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, images: int) -> None:
        """One micro-batch: its 0-dim loss and the images it held over all processes."""
        self.loss_sum += loss.double()
        self.micro_batches += 1
        self.images += images

    def mean_loss(self) -> torch.Tensor:
        """The mean loss of the window's micro-batches, float64 [] on the device."""
        return self.loss_sum / max(self.micro_batches, 1)

    def rates(self, device: torch.device) -> Dict[str, float]:
        """img_per_s, data_wait_frac (of the window's wall time) and peak_mem_mib, for a train row."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return {'img_per_s': self.images / elapsed, 'data_wait_frac': self.data_wait / elapsed,
                'peak_mem_mib': peak_memory_mib(device)}


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process so far, in MiB: CUDA tensors on ``device`` (the caching allocator's peak of
    allocated bytes), else the resident set size of the whole process (``ru_maxrss``: model, data and Python)."""
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    import resource
    # ru_maxrss is in KiB on Linux and in bytes on macOS
    scale = 2 ** 20 if sys.platform == 'darwin' else 2 ** 10
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


@contextlib.contextmanager
def run_directory(cfg: DictConfig, info: DistInfo) -> Iterator[None]:
    """On rank 0: create ``cfg.output_dir`` and send linvit's, timm's and Python's warnings' log records to its
    train.log while the block runs. Other ranks write nothing. Its config.yaml is written by ``write_config`` once
    the run is set up: a run refused on the way (a resumed one too) leaves the config.yaml it found."""
    if not info.is_main:
        yield
        return
    files = RunDir(cfg.output_dir)
    os.makedirs(files.path, exist_ok=True)
    handler = logging.FileHandler(files.log)
    handler.setFormatter(logging.Formatter('%(asctime)s %(levelname)s %(name)s: %(message)s'))
    logging.captureWarnings(True)
    for name in _LOGGERS:
        logging.getLogger(name).addHandler(handler)
    try:
        yield
    finally:
        for name in _LOGGERS:
            logging.getLogger(name).removeHandler(handler)
        handler.close()


def write_config(cfg: DictConfig, info: DistInfo) -> None:
    """The resolved config as the run directory's config.yaml (rank 0; atomic)."""
    if info.is_main:
        with atomic_write(RunDir(cfg.output_dir).config, mode='w') as f:
            f.write(config_to_yaml(cfg))


def write_json(path: str, values: Dict[str, Any]) -> None:
    """``values`` as indented JSON, written atomically (metrics.json)."""
    with atomic_write(path, mode='w') as f:
        json.dump(values, f, indent=2)
        f.write('\n')


def format_metrics(metrics: Dict[str, Any]) -> str:
    """'miou=0.8123, pixel_acc=0.9345, per_class_iou: road 0.9012, car 0.7234' (4 decimals; None: absent)."""
    items = []
    for key, value in metrics.items():
        if isinstance(value, dict):
            items.append(f"{key}: " + ', '.join(f"{name} {_four(v)}" for name, v in value.items()))
        else:
            items.append(f"{key}={_four(value)}")
    return ', '.join(items)


def _scalars(values: Dict[str, Any], prefix: str = '') -> Dict[str, float]:
    """The finite numbers of ``values``, nested mappings flattened with '/' (per_class_iou/road)."""
    found = {}
    for key, value in values.items():
        if isinstance(value, dict):
            found.update(_scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            found[f"{prefix}{key}"] = value
    return found


def _four(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _format_cell(value: Any) -> Optional[Any]:
    if value is None:
        return ''
    if isinstance(value, float):
        return f"{value:.6g}"
    return value
