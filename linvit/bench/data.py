"""Input-pipeline throughput against the model's: is training at a resolution input-bound, and where?

For each image size: images/s of the per-image path in one worker (decode + albumentations train pipeline, what a
DataLoader worker does per sample), of the cached path's worker side (read a cached uint8 image + draw its
augmentation), of the cached path's batched augmentation on the device, and of a training step of the model on a
batch already on the device. With W workers the pipeline delivers W x the per-worker rate (the cached path also at
most the device augmentation's rate); the bottleneck is the smallest of that and the model's rate.

    rows = measure(DataBench(sizes=(512, 1024), device='cuda', workers=6))
    print(markdown(rows))
"""
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from linvit.timing import synchronize

__all__ = ['DataBench', 'measure', 'markdown', 'write_images']

AUG = dict(random_resized_crop=True, scale=[0.5, 1.0], hflip=0.5, vflip=0.0, color_jitter=0.3)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass
class DataBench:
    sizes: Sequence[int] = (512, 1024, 2048)
    device: str = 'cpu'
    workers: int = 6  # DataLoader workers the pipeline rates are scaled to
    images: int = 16  # distinct source images per size (PNG, twice the training size, as photos usually are)
    samples: int = 32  # timed samples per worker-side path
    batch: int = 16  # batch of the device augmentation and of the model step
    model: str = 'linvit_tiny_patch16_224'
    precision: str = 'bfloat16'  # autocast of the model step on CUDA (float32 on CPU)
    repeats: int = 3  # timed model steps / augmentation calls after one untimed


def write_images(folder: Path, count: int, size: int) -> None:
    """``count`` PNGs of ``size`` px in two class folders: smooth gradients with noise (compress like photos)."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    for i in range(count):
        (folder / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        base = np.stack([x * rng.uniform(50, 250), y * rng.uniform(50, 250), (x + y) * rng.uniform(20, 120)], -1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"c{i % 2}" / f"{i}.png")


def _per_second(count: int, seconds: float) -> float:
    return count / max(seconds, 1e-9)


def _worker_rate(dataset, samples: int) -> float:
    """Samples per second of ``dataset[(i, seed)]`` in this process (what one DataLoader worker does)."""
    dataset[(0, 0)]
    start = time.perf_counter()
    for i in range(samples):
        dataset[(i % len(dataset), i)]
    return _per_second(samples, time.perf_counter() - start)


def _timed(fn, repeats: int, device: str) -> float:
    """Seconds per call of ``fn`` after one untimed call (the best of ``repeats``: a quiet-machine figure)."""
    fn()
    best = float('inf')
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _model_rate(bench: DataBench, size: int) -> float:
    """Images per second of forward + backward of the model on a batch already on the device."""
    import timm
    model = timm.create_model(bench.model, img_size=size, num_classes=10).to(bench.device)
    images = torch.randn(bench.batch, 3, size, size, device=bench.device)
    labels = torch.randint(0, 10, (bench.batch,), device=bench.device)
    dtype = torch.bfloat16 if bench.device.startswith('cuda') and bench.precision == 'bfloat16' else None

    def step() -> None:
        with torch.autocast(device_type=torch.device(bench.device).type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(images).float(), labels)
        loss.backward()
    return _per_second(bench.batch, _timed(step, bench.repeats, bench.device))


def _size_row(bench: DataBench, size: int, root: Path) -> Dict[str, Any]:
    from types import SimpleNamespace

    from ..data.batch_augment import augment_batch
    from ..data.cache import CachedImageDataset, DecodedCache
    from ..data.folder import ImageFolderDataset
    from ..data.transforms import build_transforms
    aug = SimpleNamespace(**AUG)
    folder = root / f"{size}px" / 'train'
    write_images(folder, bench.images, 2 * size)
    per_image = ImageFolderDataset(folder, build_transforms(aug, size, MEAN, STD, train=True), verify=False)
    start = time.perf_counter()
    cache = DecodedCache.open_or_build(ImageFolderDataset(folder, None, verify=False), size, root / 'cache', 'train')
    build_s = time.perf_counter() - start
    cached = CachedImageDataset(cache, aug, MEAN, STD, train=True)
    batch = [cached[(i % len(cached), i)] for i in range(bench.batch)]
    images = torch.stack([b[0] for b in batch]).to(bench.device)
    params = torch.stack([b[2] for b in batch])
    augment_s = _timed(lambda: augment_batch(images, params, size, MEAN, STD), bench.repeats, bench.device)
    row = {'px': size, 'per_image_worker': _worker_rate(per_image, bench.samples),
           'cached_worker': _worker_rate(cached, bench.samples), 'device_augment': _per_second(bench.batch, augment_s),
           'model': _model_rate(bench, size), 'cache_build_img_s': _per_second(len(cache), build_s)}
    return {**row, **_verdict(row, bench.workers)}


def _verdict(row: Dict[str, float], workers: int) -> Dict[str, Any]:
    """Each path's delivered rate with ``workers`` workers, the speed-up per worker, and the bottleneck."""
    per_image = workers * row['per_image_worker']
    cached = min(workers * row['cached_worker'], row['device_augment'])
    return {'per_image_pipeline': per_image, 'cached_pipeline': cached,
            'cached_vs_per_image_per_worker': row['cached_worker'] / row['per_image_worker'],
            'per_image_bound': 'input' if per_image < row['model'] else 'model',
            'cached_bound': 'input' if cached < row['model'] else 'model'}


def measure(bench: DataBench) -> List[Dict[str, Any]]:
    """One row per size (images per second; see the module docstring), the data in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix='bench_data_') as tmp:
        return [_size_row(bench, size, Path(tmp)) for size in bench.sizes]


def markdown(rows: Sequence[Dict[str, Any]], workers: int) -> str:
    """The table: per-worker and pipeline rates (img/s), the model's, and what bounds training."""
    lines = [f"| px | per-image path, 1 worker | cached path, 1 worker | cached / per-image | device augment | "
             f"model step | per-image path, {workers} workers | cached path, {workers} workers | bound (per-image) | "
             f"bound (cached) |", '|' + '---|' * 10]
    for r in rows:
        lines.append(f"| {r['px']} | {r['per_image_worker']:.1f} | {r['cached_worker']:.1f} | "
                     f"{r['cached_vs_per_image_per_worker']:.1f}x | {r['device_augment']:.1f} | {r['model']:.1f} | "
                     f"{r['per_image_pipeline']:.1f} | {r['cached_pipeline']:.1f} | {r['per_image_bound']} | "
                     f"{r['cached_bound']} |")
    return '\n'.join(lines)
