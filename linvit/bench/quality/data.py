"""The quality check's data: Fashion-MNIST items (the IDX files in ``fmnist_dir``, which ``make gpu-prep`` packs)
upscaled 2x-6x at a random place on a smooth background (``linvit.data.fmnist_hires``, ``fragments=0``: no clutter),
one ImageFolder set per canvas size, rendered once into ``cache_dir`` and reused by later runs, as are their
decoded-image caches; the quality grid's segmentation sets (several items an image, every item pixel labelled with
its class) the same way.
"""
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .plan import PIPELINES, Canvas, Preset, QualitySettings, SegSet
from .recipe import RECIPE, SEG_RECIPE

__all__ = ['missing_idx_files', 'data_unavailable', 'canvas_folder', 'render_once', 'render_canvas_set', 'seg_folder',
           'render_seg_set', 'warm_decoded_caches', 'prepare_data']


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
    """Where the set of one canvas is rendered: its size, items per class and seed in the name (reused by reruns)."""
    return Path(settings.cache_dir) / (f"fmnist_hires_{canvas.px}px_{canvas.train_per_class}x"
                                       f"{canvas.val_per_class}_clean_seed0")


def render_once(data: Path, spec_for: Callable[[Path], Any]) -> Path:
    """``data``, the rendered set of ``spec_for(folder)`` (a ``FmnistHiresSpec`` writing into ``folder``), rendered
    unless a finished one (manifest.csv) is there; a render cut short leaves only a .partial folder. ValueError /
    FileNotFoundError from the renderer."""
    from linvit.data.fmnist_hires import write_dataset
    if (data / 'manifest.csv').is_file():
        return data
    partial = data.with_name(data.name + '.partial')
    shutil.rmtree(partial, ignore_errors=True)
    print(write_dataset(spec_for(partial), log=lambda line: print(line, flush=True)), flush=True)
    shutil.rmtree(data, ignore_errors=True)  # a folder without manifest.csv is not a finished set
    partial.rename(data)
    return data


def render_workers(images: int) -> int:
    """Rendering processes: a pool pays off from a few hundred images; two cores are left to the probe's kernel
    launches."""
    return max(1, min((os.cpu_count() or 1) - 2, images // 300))


def render_canvas_set(settings: QualitySettings, canvas: Canvas) -> Path:
    """The folder of the rendered ImageFolder set of one canvas (train/ and val/), rendered once."""
    from linvit.data.fmnist_hires import FmnistHiresSpec
    workers = render_workers(10 * (canvas.train_per_class + canvas.val_per_class))
    return render_once(canvas_folder(settings, canvas), lambda out: FmnistHiresSpec(
        out=out, task='classification', size=canvas.px, fragments=0, seed=0, train_per_class=canvas.train_per_class,
        val_per_class=canvas.val_per_class, workers=workers, idx_dir=Path(settings.fmnist_dir)))


def seg_folder(settings: QualitySettings, seg: SegSet) -> Path:
    """Where a segmentation set is rendered: its size, image counts and seed in the name (reused by reruns)."""
    return Path(settings.cache_dir) / f"fmnist_seg_{seg.px}px_{seg.train_images}x{seg.val_images}_seed0"


def render_seg_set(settings: QualitySettings, seg: SegSet) -> Path:
    """The folder of the rendered segmentation set (train/ and val/ images and masks, classes.txt: 'background'
    and the 10 classes; 3-8 items an image, as tools/make_fmnist_hires.py --task segmentation), rendered once."""
    from linvit.data.fmnist_hires import FmnistHiresSpec
    workers = render_workers(seg.train_images + seg.val_images)
    return render_once(seg_folder(settings, seg), lambda out: FmnistHiresSpec(
        out=out, task='segmentation', size=seg.px, seed=0, train_images=seg.train_images,
        val_images=seg.val_images, workers=workers, idx_dir=Path(settings.fmnist_dir)))


def warm_decoded_caches(settings: QualitySettings, canvas: Union[Canvas, SegSet], folder: Path,
                        task: str = 'classification') -> None:
    """Build the set's decoded-image caches at the canvas size as a run of ``task`` would (classification: train
    and val; segmentation: train), so that no run pays for the decoding and no two runs build one cache at the same
    time. Nothing to do for a pipeline without a cache."""
    if settings.pipeline != 'cached':
        return
    from linvit.data import build_classification_datasets, build_segmentation_datasets
    from linvit.engine import load_config
    build, recipe = {'classification': (build_classification_datasets, RECIPE),
                     'segmentation': (build_segmentation_datasets, SEG_RECIPE)}[task]
    cfg = load_config(None, [f"data.root={folder}", f"data.img_size={canvas.px}", *PIPELINES[settings.pipeline]],
                      base=recipe)
    build(cfg.data, (0.5,) * 3, (0.5,) * 3, with_train=True)


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
