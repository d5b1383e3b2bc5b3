"""ONNX export of linvit models (and timm ViTs, converted or hybrid, and segmentation models), verified in
onnxruntime at several image sizes.

    report = export_onnx(model, 'model.onnx', img_size=(512, 512))     # dynamic batch, height and width
    print(report.table())                                               # max abs / rel error per checked size
    session = ort_session('model.onnx')                                 # onnxruntime, this module's settings
    logits = session.run(None, {'images': images.numpy()})[0]
    meta = read_metadata('model.onnx')                                  # task, class names, mean/std, multiple
    check_source_weights('model.onnx')                  # StaleExportError if the run's weights changed since

How: ``torch.export.export`` (non-strict) traces the model in eval mode with torch's inference path (no autograd),
and ``torch.onnx.export`` translates the ExportedProgram (PyTorch's dynamo-based exporter; the TorchScript one
cannot keep height and width dynamic through timm's position-embedding resampling). With ``dynamic_size`` the
image height and width are symbolic and the graph pads them to the model's patch size (``input_multiple``) itself,
zeros at the bottom and right as ``tools/predict.py`` pads, cropping per-pixel logits back to the input's size
(``PadToMultiple``): one file takes any size, square or not, and a direct onnxruntime user gets predict.py's answer;
``dynamic_batch`` makes the batch symbolic too. The file is written atomically and only
after the check passes: a failed export or a failed check leaves no file behind (and an earlier file intact).

The check runs the ONNX file in onnxruntime (CPU) and the float32 PyTorch model on the same seeded random images at
the export size and at two more sizes (one non-square, one that the patch does not divide, see
``default_check_sizes``; the PyTorch model gets the same padding); the error per size is
``max_abs = max |onnx - torch|`` and ``max_rel = max_abs / max |torch|`` (relative to the largest reference value,
so that outputs near zero do not make it meaningless). Tolerances: 1e-4 (float32), 1e-2 (float16).

float16 export: weights and activations are float16, the linear-attention core stays float32 inside the graph (the
layer casts to float32 and back, see ``linvit.ops.linear_attention``), and the reference stays the float32 model.

The file carries its own description in ONNX ``metadata_props`` (``read_metadata``): the task (a run's, or the one
whose logits have the model's output rank: ``Task.logits_rank``), class names, input normalisation (mean, std), the
input multiple, whether the graph pads to it (``pads_to_multiple``), the export size and, for a model of values per
pixel (depth: its output is their log), what they are (``values``), so ``tools/predict.py`` needs nothing else. A
file exported from a run also records the weights file it was made from and its sha256: ``check_source_weights``
(which ``linvit.predict`` calls) refuses the file once those weights have changed, e.g. a run trained again into the
same folder; a file whose weights file is gone stands alone.

A torchvision detector (``linvit.models.detection``) exports whole at one image size: its heads pick boxes with
data-dependent shapes that ``torch.export`` cannot trace, so it goes through torchvision's own route, the TorchScript
exporter, which fixes the backbone's position-embedding size (``dynamic_size=False``; the outputs ``boxes``,
``labels``, ``scores`` and Mask R-CNN's ``masks``, for one image [1, 3, H, W] normalised as in training). The check
runs two seeded images through both and compares every detection. At any size, a dense model's backbone and feature
pyramid export alone (``PyramidFeatures``: outputs ``features_0`` .. ``features_3``, finest first;
``tools/export_onnx.py RUN --features``); a detector's heads then run in PyTorch on the file's maps.

Something that cannot be exported raises ``ExportError`` naming the module that was running when tracing failed (or
the op that has no ONNX translation), with the original error chained; nothing falls back to another exporter.

What ``tools/export_onnx.py`` exports and times (the library behind the command line):

    source = load_export_source('runs/demo')             # or 'linvit_small_patch16_224:img_size=512' (random weights)
    report = export_onnx(source.model, source.default_out, img_size=source.img_size, dtype='float16',
                         metadata=source.metadata)
    rows = measure_latency(source.model, report.path, [(c.height, c.width) for c in report.checks], 'float16')
    print(format_latency(rows, report.dtype))             # eager, compiled and onnxruntime ms per image
"""
import contextlib
import copy
import hashlib
import inspect
import json
import logging
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .precision import precision_dtype

__all__ = ['export_onnx', 'ExportReport', 'SizeCheck', 'ExportError', 'ExportCheckError', 'default_check_sizes',
           'input_multiple', 'ort_session', 'read_metadata', 'METADATA_PREFIX', 'TOLERANCES', 'EXPORT_PRECISIONS',
           'INPUT_NAME', 'OUTPUT_NAME', 'ExportSource', 'load_export_source', 'is_trained_source', 'measure_latency',
           'format_latency', 'PadToMultiple', 'StaleExportError', 'file_sha256', 'check_source_weights',
           'PyramidFeatures', 'FEATURE_OUTPUT_NAMES']

_logger = logging.getLogger(__name__)

INPUT_NAME = 'images'
OUTPUT_NAME = 'logits'
#: the outputs of a feature-pyramid file (``PyramidFeatures``), finest level first: torchvision's level names '0'..'3'
FEATURE_OUTPUT_NAMES = ('features_0', 'features_1', 'features_2', 'features_3')
METADATA_PREFIX = 'linvit.'
#: default max_rel allowed by the check, per export dtype
TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2}
#: the precisions a file can be exported in (``linvit.precision`` names)
EXPORT_PRECISIONS = ('float32', 'float16')
#: the largest image side, in patches, that a dynamic-size file declares (16,384 px at patch 16)
MAX_SIDE_PATCHES = 1024

Size2 = Tuple[int, int]


class ExportError(RuntimeError):
    """The model could not be exported; the message names the module or op and the original error is chained."""


class ExportCheckError(RuntimeError):
    """The exported file disagrees with PyTorch beyond the tolerance at some size (no file was written)."""


class StaleExportError(RuntimeError):
    """An ONNX file's weights file has changed since the export: the file no longer holds that run's model."""


@dataclass
class SizeCheck:
    """onnxruntime vs the float32 PyTorch model on one batch of images [batch, 3, height, width]."""
    height: int
    width: int
    batch: int
    max_abs: float
    max_rel: float
    tolerance: float
    finite: bool

    @property
    def ok(self) -> bool:
        return self.finite and self.max_rel <= self.tolerance


@dataclass
class ExportReport:
    """What ``export_onnx`` wrote and how the file compared with PyTorch."""
    path: str
    img_size: Size2
    dtype: str
    opset: int
    dynamic_size: bool
    dynamic_batch: bool
    checks: List[SizeCheck] = field(default_factory=list)
    metadata: Dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def table(self) -> str:
        """The parity table: one row per checked size."""
        lines = [f"{self.path}: {self.dtype}, opset {self.opset}, exported at {self.img_size[0]}x{self.img_size[1]}, "
                 f"dynamic size {self.dynamic_size}, dynamic batch {self.dynamic_batch}",
                 f"{'size':>11} {'batch':>5} {'max abs err':>12} {'max rel err':>12} {'tolerance':>10}  result"]
        for c in self.checks:
            verdict = 'ok' if c.ok else ('NOT FINITE' if not c.finite else 'FAILED')
            lines.append(f"{c.height:>5}x{c.width:<5} {c.batch:>5} {c.max_abs:>12.3e} {c.max_rel:>12.3e} "
                         f"{c.tolerance:>10.0e}  {verdict}")
        return '\n'.join(lines)


# ---------------------------------------------------------------------------------------------------- the model

def _patch_embed(model: nn.Module) -> Optional[nn.Module]:
    return getattr(model, 'patch_embed', None)


def input_multiple(model: nn.Module) -> int:
    """Image sides must be multiples of this: the model's ``input_multiple`` (segmentation models), else the
    largest side of its patch embedding's patch, else 1."""
    multiple = getattr(model, 'input_multiple', None)
    if isinstance(multiple, int):
        return multiple
    patch = getattr(_patch_embed(model), 'patch_size', None)
    if patch is None:
        return 1
    return int(max(patch)) if isinstance(patch, (tuple, list)) else int(patch)


def _takes_only_its_size(model: nn.Module) -> bool:
    """A timm ViT created without ``dynamic_img_size`` checks every image against its img_size."""
    return bool(getattr(_patch_embed(model), 'strict_img_size', False))


class PadToMultiple(nn.Module):
    """``model`` taking any image size: images [B, 3, H, W] are zero-padded at the bottom and right to the next
    multiple of ``multiple`` (as ``linvit.inference`` pads for whole-image prediction), and per-pixel logits
    [B, K, H', W'] are cropped back to [B, K, H, W]; logits per image [B, K] pass as they are.

    The pads are written so that torch.export keeps H and W symbolic: the padded side as a ceil division (with
    ``-H % multiple`` it cannot prove that the padded grid has 2 patches or more) and the crop as a negative pad (a
    slice ``[:H]`` needs a proof that H is at most the padded side)."""

    def __init__(self, model: nn.Module, multiple: int) -> None:
        super().__init__()
        self.model = model
        self.multiple = multiple

    def forward(self, images: torch.Tensor) -> Any:
        height, width = images.shape[-2], images.shape[-1]
        pad_h = (height + self.multiple - 1) // self.multiple * self.multiple - height
        pad_w = (width + self.multiple - 1) // self.multiple * self.multiple - width
        logits = self.model(F.pad(images, (0, pad_w, 0, pad_h)))
        if isinstance(logits, torch.Tensor) and logits.ndim == 4:
            return F.pad(logits, (0, -pad_w, 0, -pad_h))
        return logits  # logits per image, or a pyramid's maps (which cover the padded image)


class PyramidFeatures(nn.Module):
    """The backbone and simple feature pyramid of a dense model (a ``ViTPyramid``: a segmentation model, or a
    torchvision detector's ``backbone``): images [B, 3, H, W] -> a tuple of 4 maps [B, neck_dim, H/s, W/s] at
    strides s = p/4, p/2, p, 2p (outputs ``FEATURE_OUTPUT_NAMES``). It is what a detector exports: torchvision's heads
    pick proposals and boxes with data-dependent shapes (NMS), which ``torch.export`` cannot trace, so they stay in
    PyTorch and take these maps as ``detector.backbone``'s. Image sides are multiples of 2p (``input_multiple``), as
    the detector's own transform pads them, so every level's grid is exact."""

    output_names = FEATURE_OUTPUT_NAMES

    def __init__(self, pyramid: nn.Module) -> None:
        super().__init__()
        self.pyramid = pyramid
        self.strides = pyramid.strides  # finest first
        self.input_multiple = int(max(self.strides))  # the coarsest level's stride

    @classmethod
    def of(cls, model: nn.Module, name: str) -> 'PyramidFeatures':
        """The pyramid of ``model`` (a ``ViTPyramid``, or a model whose ``backbone`` is one); ValueError naming
        ``name`` (where the model came from) for a model without one."""
        from .models.segmentation import ViTPyramid
        for candidate in (model, getattr(model, 'backbone', None)):
            if isinstance(candidate, ViTPyramid):
                return cls(candidate)
        raise ValueError(f"{name} has no feature pyramid to export ({type(model).__name__}): --features takes a "
                         f"segmentation or detection run")

    def forward(self, images: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(self.pyramid.forward_features(images))


def _pair(size: Union[int, Sequence[int]], name: str) -> Size2:
    pair = (size, size) if isinstance(size, int) else tuple(size)
    if len(pair) != 2 or not all(isinstance(s, int) and s > 0 for s in pair):
        raise ValueError(f"{name} must be a positive int or (height, width), got {size!r}")
    return int(pair[0]), int(pair[1])


def _check_size(size: Size2, multiple: int, name: str) -> None:
    if size[0] % multiple or size[1] % multiple:
        raise ValueError(f"{name} {size[0]}x{size[1]} is not a multiple of the model's patch size {multiple}; use "
                         f"{_round_to(size[0], multiple)}x{_round_to(size[1], multiple)}")
    if min(size) < 2 * multiple:
        raise ValueError(f"{name} {size[0]}x{size[1]} is below 2 patches ({2 * multiple} px) on a side")


def _check_padded_size(size: Size2, multiple: int, name: str) -> None:
    """A size a dynamic-size file takes: any, as long as each side pads to 2 patches or more."""
    if min(size) <= multiple:
        raise ValueError(f"{name} {size[0]}x{size[1]} is too small: the model needs 2 patches on a side, so each side "
                         f"must be above {multiple} px (it is padded to the next multiple of {multiple})")


def _round_to(value: float, multiple: int) -> int:
    return max(2, round(value / multiple)) * multiple


def default_check_sizes(img_size: Size2, multiple: int, dynamic_size: bool) -> List[Size2]:
    """The export size, then (when the size is dynamic) a smaller non-square size (1/2 x 3/4 of it, rounded to the
    input multiple) and a larger one (5/4 x 1 of it, rounded, then 1 px lower and 1 px wider) that the multiple
    does not divide: the file pads it (by 1 and by multiple - 1 px) as it pads any size."""
    sizes = [img_size]
    if dynamic_size:
        height, width = img_size
        smaller = (_round_to(height * 0.5, multiple), _round_to(width * 0.75, multiple))
        if smaller[0] == smaller[1]:  # keep one size non-square whatever the export size is
            smaller = (smaller[0], smaller[1] + multiple)
        larger = (_round_to(height * 1.25, multiple) - 1, _round_to(width, multiple) + 1)
        sizes += [size for size in (smaller, larger) if size != img_size]
    return sizes


def _model_metadata(model: nn.Module, example: torch.Tensor, dtype: torch.dtype, pads: bool,
                    extra: Optional[Dict[str, Any]]) -> Dict[str, str]:
    """What the file says about itself (``read_metadata``): values are JSON text. ``extra`` (a run's task, class
    names, ...) wins; a model no run describes is read as the task whose logits have its output's rank. ``pads``:
    the graph pads images to the input multiple itself (``PadToMultiple``)."""
    extra = extra or {}
    values: Dict[str, Any] = {'input_multiple': input_multiple(model), 'pads_to_multiple': pads,
                              'img_size': list(example.shape[-2:]), 'dtype': str(dtype).replace('torch.', ''),
                              'num_classes': int(getattr(model, 'num_classes', 0) or 0)}
    if 'task' not in extra:
        values['task'] = _task_of_outputs(model, example)
    pretrained = getattr(model, 'pretrained_cfg', None) or getattr(getattr(model, 'backbone', None),
                                                                    'pretrained_cfg', None) or {}
    if 'mean' in pretrained and 'std' in pretrained:
        values.update(mean=list(pretrained['mean']), std=list(pretrained['std']))
    values.update(extra)
    return {METADATA_PREFIX + key: json.dumps(value) for key, value in values.items()}


def _task_of_outputs(model: nn.Module, example: torch.Tensor) -> Optional[str]:
    """The task (``linvit.engine.tasks.task_of_logits``) whose models' logits have the rank of ``model``'s output on
    ``example`` [B, 3, H, W] (float32, eval mode): [B, K] classification, [B, K, H, W] segmentation."""
    from .engine.tasks import task_of_logits
    with torch.no_grad():
        return task_of_logits(model(example).ndim)


# ---------------------------------------------------------------------------------------------------- tracing

@contextlib.contextmanager
def _module_stack(model: nn.Module) -> Iterator[List[str]]:
    """The names of the modules whose forward is running, innermost last (left as they were when an exception
    escaped: the module that failed is the last one)."""
    stack: List[str] = []

    def enter(label: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            stack.append(label)
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:  # returns None: the output stays as it is
        if stack:
            stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(f"{name or '(the model)'} ({type(module).__name__})")))
        handles.append(module.register_forward_hook(leave))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


def _first_lines(error: BaseException, count: int = 6) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return '\n'.join(lines[:count])


def _dynamic_dims(multiple: int, dynamic_size: bool, dynamic_batch: bool) -> Dict[int, Any]:
    """{dimension of the images: its torch.export Dim} for what stays symbolic in the file."""
    dims: Dict[int, Any] = {}
    if dynamic_batch:
        dims[0] = torch.export.Dim('batch', min=1, max=4096)
    if dynamic_size:
        # any side that pads to 2 patches or more (PadToMultiple). DYNAMIC rather than a named Dim: torch.export may
        # narrow the range where a model needs more patches (a segmentation neck's stride-2p level), but must not
        # fix the size
        for axis in (2, 3):
            dims[axis] = torch.export.Dim.DYNAMIC(min=multiple + 1, max=MAX_SIDE_PATCHES * multiple)
    return dims


def _trace(model: nn.Module, example: torch.Tensor, multiple: int, dynamic_size: bool,
           dynamic_batch: bool) -> torch.export.ExportedProgram:
    """The ExportedProgram of ``model`` (``PadToMultiple(model)`` with ``dynamic_size``) on ``example``; a failure
    names the module of ``model`` whose forward was running."""
    traced = PadToMultiple(model, multiple) if dynamic_size else model
    dims = _dynamic_dims(multiple, dynamic_size, dynamic_batch)
    # torch.export names dynamic inputs by the forward's argument name
    shapes = {_first_argument_name(traced): dims} if dims else None
    with _module_stack(model) as stack, torch.no_grad():
        try:
            return torch.export.export(traced, (example,), dynamic_shapes=shapes, strict=False)
        except Exception as error:
            where = f"in module {stack[-1]}" if stack else "outside any module's forward"
            raise ExportError(f"torch.export could not trace {type(model).__name__} {where} at input "
                              f"{list(example.shape)} {example.dtype}:\n{_first_lines(error)}") from error


def _first_argument_name(model: nn.Module) -> str:
    parameters = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not parameters:
        raise ExportError(f"{type(model).__name__}.forward takes no positional argument for the images")
    return parameters[0].name


def _output_names(model: nn.Module) -> List[str]:
    """The file's output names: the model's ``output_names`` (several outputs), else ``OUTPUT_NAME``."""
    return list(getattr(model, 'output_names', (OUTPUT_NAME,)))


def _to_onnx(program: torch.export.ExportedProgram, model_name: str, opset: Optional[int],
             output_names: Sequence[str]) -> Any:
    try:
        return torch.onnx.export(program, (), input_names=[INPUT_NAME], output_names=list(output_names),
                                 opset_version=opset, dynamo=True, optimize=True, verbose=False)
    except Exception as error:
        raise ExportError(f"the ONNX translation of {model_name} failed (an op without an ONNX translation is "
                          f"named below):\n{_first_lines(error, 12)}") from error


# ---------------------------------------------------------------------------------------------------- checking

def ort_session(path: Union[str, os.PathLike], threads: Optional[int] = None) -> Any:
    """An onnxruntime CPU session for a linvit ONNX file: every graph optimisation on, ``threads`` intra-op
    threads (default: as many as torch uses), sequential execution (the graph is one chain of blocks)."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), sess_options=options, providers=['CPUExecutionProvider'])


def _compare(session: Any, reference: nn.Module, size: Size2, batch: int, dtype: torch.dtype, tolerance: float,
             seed: int) -> SizeCheck:
    """Every output of the file against the reference's on one seeded batch: the largest error over all of them,
    relative to the largest reference value of all of them."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, *size, generator=generator)
    with torch.no_grad():
        expected = reference(images)
    expected = [t.float() for t in (expected if isinstance(expected, (tuple, list)) else (expected,))]
    got = [torch.from_numpy(out).float() for out in session.run(None, {INPUT_NAME: images.to(dtype).numpy()})]
    if [list(t.shape) for t in got] != [list(t.shape) for t in expected]:
        raise ExportCheckError(f"at {size[0]}x{size[1]} the ONNX outputs have shapes {[list(t.shape) for t in got]}, "
                               f"PyTorch's {[list(t.shape) for t in expected]}")
    max_abs = max((g - e).abs().max().item() for g, e in zip(got, expected))
    scale = max(e.abs().max().item() for e in expected)
    return SizeCheck(height=size[0], width=size[1], batch=batch, max_abs=max_abs,
                     max_rel=max_abs / scale if scale > 0 else max_abs, tolerance=tolerance,
                     finite=all(bool(torch.isfinite(g).all()) for g in got))


def read_metadata(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """The ``linvit.*`` metadata of an ONNX file written by ``export_onnx`` (keys without the prefix, values
    decoded): task, num_classes, class_names (if given), mean, std, input_multiple, img_size, dtype; a depth run's
    file also ``values`` (what its output is the log of: name, unit, png_scale, larger_is_nearer)."""
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    return {prop.key[len(METADATA_PREFIX):]: json.loads(prop.value) for prop in model.metadata_props
            if prop.key.startswith(METADATA_PREFIX)}


# ---------------------------------------------------------------------------------------------------- export

def export_onnx(model: nn.Module, path: Union[str, os.PathLike], img_size: Union[int, Sequence[int]] = (224, 224),
                dynamic_size: bool = True, dynamic_batch: bool = True, opset: Optional[int] = None,
                dtype: Union[torch.dtype, str] = torch.float32, check_sizes: Optional[Sequence[Size2]] = None,
                tolerance: Optional[float] = None, metadata: Optional[Dict[str, Any]] = None,
                verbose: bool = False) -> ExportReport:
    """Export ``model`` (images [B, 3, H, W] -> logits) to the ONNX file ``path`` and check it in onnxruntime.

    img_size: the example image size (height, width) traced, a multiple of the patch size. With ``dynamic_size``
        the file takes any size up to ``MAX_SIDE_PATCHES`` patches on a side: the graph pads images to the patch
        multiple itself and crops per-pixel logits back (``PadToMultiple``; metadata ``pads_to_multiple``), so a
        side must only be above one patch. The model must take any multiple of its patch
        (``dynamic_img_size=True`` for timm ViTs; segmentation models always do).
    dtype: torch.float32 or torch.float16, or its precision name 'float32' / 'float16' (weights and activations; the
        attention core runs in float32).
    check_sizes: (height, width) sizes to check (default ``default_check_sizes``: the export size and, when dynamic,
        two more, one non-square and one the patch does not divide), against the PyTorch model on the same padded
        images; each runs a batch of 2 (1 when the batch is static).
    tolerance: the largest max_rel accepted (default ``TOLERANCES[dtype]``); beyond it ``ExportCheckError`` is
        raised and no file is written.
    metadata: extra JSON-able values stored as ``linvit.<key>`` (e.g. class_names, model_name).
    Returns the ``ExportReport``; ``verbose`` prints its table. The model itself is not modified.
    """
    if isinstance(dtype, str):
        dtype = precision_dtype(dtype, 'dtype')
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype must be one of {[str(d) for d in TOLERANCES]}, got {dtype}")
    img_size = _pair(img_size, 'img_size')
    if getattr(model, 'takes_targets', False):  # a torchvision detector: its own route (module docstring)
        return _export_detector(model, path, img_size, dynamic_size, dynamic_batch, opset, dtype, tolerance, metadata,
                                verbose)
    multiple = input_multiple(model)
    _check_size(img_size, multiple, 'img_size')
    if dynamic_size and _takes_only_its_size(model):
        raise ValueError(f"{type(model).__name__} takes only its img_size {tuple(_patch_embed(model).img_size)}: "
                         f"create it with dynamic_img_size=True (timm.create_model(name, dynamic_img_size=True)) to "
                         f"export a file that takes any size, or pass dynamic_size=False")
    sizes = [_pair(s, 'check size') for s in (check_sizes or default_check_sizes(img_size, multiple, dynamic_size))]
    for size in sizes:
        if not dynamic_size and size != img_size:
            raise ValueError(f"check size {size[0]}x{size[1]}: a file exported with dynamic_size=False takes only "
                             f"{img_size[0]}x{img_size[1]}")
        _check_padded_size(size, multiple, 'check size')
    tolerance = TOLERANCES[dtype] if tolerance is None else tolerance

    reference = copy.deepcopy(model).float().eval()
    exported = copy.deepcopy(reference).to(dtype)
    batch = 2 if dynamic_batch else 1
    example = torch.randn(batch, 3, *img_size, dtype=dtype)
    program = _trace(exported, example, multiple, dynamic_size, dynamic_batch)
    onnx_program = _to_onnx(program, type(model).__name__, opset, _output_names(model))
    props = _model_metadata(reference, example.float(), dtype, dynamic_size, metadata)
    onnx_program.model.metadata_props.update(props)
    opset_used = int(onnx_program.model.opset_imports.get('', opset or 0))

    report = ExportReport(path=str(path), img_size=img_size, dtype=str(dtype).replace('torch.', ''), opset=opset_used,
                          dynamic_size=dynamic_size, dynamic_batch=dynamic_batch,
                          metadata={k[len(METADATA_PREFIX):]: json.loads(v) for k, v in props.items()})
    # written next to ``path`` and renamed onto it only after the check passes (same filesystem: an atomic rename)
    destination = os.path.abspath(path)
    with tempfile.TemporaryDirectory(prefix='.export-', dir=os.path.dirname(destination)) as scratch:
        tmp = os.path.join(scratch, os.path.basename(destination))
        onnx_program.save(tmp, external_data=False)
        padded = PadToMultiple(reference, multiple) if dynamic_size else reference  # what the graph computes
        _place_when_checked(tmp, destination, report, type(model).__name__, tolerance, verbose, lambda session: [
            _compare(session, padded, size, batch, dtype, tolerance, seed=index) for index, size in enumerate(sizes)])
    return report


def _place_when_checked(tmp: str, destination: str, report: ExportReport, name: str, tolerance: float,
                        verbose: bool, checks: Callable[[Any], List[SizeCheck]]) -> None:
    """Run ``checks(session)`` on the file ``tmp`` in onnxruntime, record them in ``report``, and move the file onto
    ``destination`` only when every one passes (else ``ExportCheckError``: no file is written)."""
    session = ort_session(tmp)
    report.checks.extend(checks(session))
    del session
    if verbose:
        print(report.table())
    if not report.ok:
        raise ExportCheckError(f"the ONNX export of {name} disagrees with PyTorch beyond max_rel {tolerance:.0e}; no "
                               f"file was written:\n{report.table()}")
    os.replace(tmp, destination)


# ---------------------------------------------------------------------------------------------------- detectors

#: the ONNX opset of a whole detector's file (torchvision exports its detectors from opset 11 on)
DETECTOR_OPSET = 17


def _refuse_detector_options(model: nn.Module, dynamic_size: bool, dynamic_batch: bool, dtype: torch.dtype) -> None:
    name = type(model).__name__
    if dynamic_size:
        raise ValueError(f"a whole {name} exports at one image size (torchvision's detectors export through the "
                         f"TorchScript exporter, which fixes the position embedding's size): pass --no-dynamic-size "
                         f"(and --img-size), or --features for the backbone and pyramid at any size")
    if dynamic_batch or dtype != torch.float32:
        raise ValueError(f"a whole {name} exports for one float32 image at a time: pass --no-dynamic-batch and "
                         f"--dtype float32, or --features for the backbone and pyramid")


#: scores this close to the lowest one kept may be cut or ordered differently by two runtimes (NMS, the top-k cut)
SCORE_TIE = 1e-4


def _detection_error(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> float:
    """The largest difference between two lists of detections, free of order: the sorted scores, and each detection's
    box (and mask) against the nearest one of the same label in ``expected``. Detections scored within ``SCORE_TIE``
    of the lowest kept score are matched by score only: near-ties may be ordered or cut differently."""
    if not len(expected['scores']):
        return 0.0
    error = float((got['scores'].sort().values - expected['scores'].sort().values).abs().max())
    floor = float(expected['scores'].min()) + SCORE_TIE
    for index in torch.nonzero(got['scores'] > floor).flatten().tolist():
        same = torch.nonzero(expected['labels'] == got['labels'][index]).flatten()
        if not len(same):
            return math.inf
        distances = (expected['boxes'][same] - got['boxes'][index]).abs().amax(dim=1)
        nearest = int(same[distances.argmin()])
        error = max(error, float(distances.min()))
        if 'masks' in expected:
            error = max(error, float((got['masks'][index] - expected['masks'][nearest]).abs().max()))
    return error


def _compare_detections(session: Any, model: nn.Module, size: Size2, seed: int, tolerance: float) -> SizeCheck:
    """onnxruntime's detections against PyTorch's on one seeded image [1, 3, H, W]: the same count, and
    ``_detection_error`` relative to the largest box coordinate (scores and mask probabilities are at most 1, so
    this is the strictest scale)."""
    images = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = model(images)[0]
    names = [output.name for output in session.get_outputs()]
    got = {name: torch.from_numpy(value) for name, value in zip(names, session.run(None, {INPUT_NAME: images.numpy()}))}
    if len(got['boxes']) != len(expected['boxes']):
        raise ExportCheckError(f"at {size[0]}x{size[1]} onnxruntime found {len(got['boxes'])} detections, PyTorch "
                               f"{len(expected['boxes'])}; no file was written")
    max_abs = _detection_error(got, expected)
    scale = max(float(expected['boxes'].abs().max()) if len(expected['boxes']) else 0.0, 1.0)
    return SizeCheck(height=size[0], width=size[1], batch=1, max_abs=max_abs, max_rel=max_abs / scale,
                     tolerance=tolerance, finite=all(bool(value.float().isfinite().all()) for value in got.values()))


def _at_size(detector: nn.Module, img_size: Size2) -> nn.Module:
    """A copy of ``detector`` whose ViT's position embedding is resampled once for ``img_size`` (timm's
    ``set_input_size``, the same resampling its forward does at another size): the traced graph then needs no
    antialiased bicubic resize, which the TorchScript exporter cannot translate."""
    detector = copy.deepcopy(detector)
    vit = getattr(getattr(detector, 'backbone', None), 'backbone', None)
    if hasattr(vit, 'set_input_size'):
        vit.set_input_size(img_size=img_size)
    return detector


def _export_detector(model: nn.Module, path: Union[str, os.PathLike], img_size: Size2, dynamic_size: bool,
                     dynamic_batch: bool, opset: Optional[int], dtype: torch.dtype, tolerance: Optional[float],
                     metadata: Optional[Dict[str, Any]], verbose: bool) -> ExportReport:
    """``export_onnx`` for a torchvision detector: the whole model through the TorchScript exporter at
    ``img_size``, checked in onnxruntime on two seeded images, the file written only when they agree."""
    import onnx
    _refuse_detector_options(model, dynamic_size, dynamic_batch, dtype)
    _check_size(img_size, input_multiple(model), 'img_size')
    reference = copy.deepcopy(model).float().eval()
    example = torch.randn(1, 3, *img_size)
    with torch.no_grad():  # the traced outputs are the values of the detector's dict, in its order
        outputs = list(reference(example)[0])
    tolerance = TOLERANCES[torch.float32] if tolerance is None else tolerance
    opset = opset or DETECTOR_OPSET
    props = {METADATA_PREFIX + key: json.dumps(value) for key, value in
             {'input_multiple': input_multiple(reference), 'pads_to_multiple': True, 'img_size': list(img_size),
              'dtype': 'float32', 'part': 'detector', 'outputs': outputs, **(metadata or {})}.items()}
    report = ExportReport(path=str(path), img_size=img_size, dtype='float32', opset=opset, dynamic_size=False,
                          dynamic_batch=False, metadata={k[len(METADATA_PREFIX):]: json.loads(v)
                                                         for k, v in props.items()})
    destination = os.path.abspath(path)
    with tempfile.TemporaryDirectory(prefix='.export-', dir=os.path.dirname(destination)) as scratch:
        tmp = os.path.join(scratch, os.path.basename(destination))
        with warnings.catch_warnings():  # the tracer warns about every data-dependent step torchvision takes
            warnings.simplefilter('ignore')
            try:
                torch.onnx.export(_at_size(reference, img_size), (example,), tmp, opset_version=opset, dynamo=False,
                                  input_names=[INPUT_NAME], output_names=outputs)
            except Exception as error:
                raise ExportError(f"the TorchScript export of {type(model).__name__} failed:\n"
                                  f"{_first_lines(error, 12)}") from error
        file = onnx.load(tmp)
        for key, value in props.items():
            file.metadata_props.add(key=key, value=value)
        onnx.save(file, tmp)
        _place_when_checked(tmp, destination, report, type(model).__name__, tolerance, verbose, lambda session: [
            _compare_detections(session, reference, img_size, seed, tolerance) for seed in (0, 1)])
    return report


# ---------------------------------------------------------------------------------------------------- sources

@dataclass
class ExportSource:
    """A model to export, with what the file should record about it."""
    model: nn.Module  # in eval mode
    img_size: Size2  # the size to trace: the given one, else the model's img_size or the run's data.img_size
    metadata: Dict[str, Any]  # for ``export_onnx(metadata=...)``: model_name, source; a run adds its task,
    # class_names, mean and std, and the weights file it loaded (absolute path) with its weights_sha256
    default_out: str  # model.onnx in the run directory, or <model name>.onnx here for a model spec


def is_trained_source(source: str) -> bool:
    """A run directory, a checkpoint (.pt, .pth) or a .safetensors file, rather than a timm model spec."""
    return os.path.isdir(source) or source.endswith(('.pt', '.pth', '.safetensors'))


def load_export_source(source: str, img_size: Optional[Size2] = None, dynamic_size: bool = True,
                       features: bool = False) -> ExportSource:
    """A trained model (``is_trained_source``: loaded by ``linvit.engine.loading.load_trained``) or a timm model
    spec ``name[:key=value,...]`` (random weights). With ``dynamic_size`` a classifier is built with
    ``dynamic_img_size=True`` (same weights), so the file can take any image size. ``features``: a segmentation or
    detection run's backbone and feature pyramid alone (``PyramidFeatures``; metadata ``part: features``, the
    levels' ``outputs`` and ``strides``), at any size; without it a detection run's whole detector exports, at one
    size (``export_onnx`` with ``dynamic_size=False``). A run whose model predicts values per pixel (depth) records
    what they are (metadata ``values``: name, unit, png_scale, larger_is_nearer, from ``Task.prediction_defaults``)."""
    if is_trained_source(source):
        from .engine.loading import load_trained
        from .engine.run_dir import RunDir
        trained = load_trained(source, dynamic_img_size=dynamic_size)
        metadata = {'task': trained.task, 'class_names': trained.class_names, 'mean': list(trained.mean),
                    'std': list(trained.std), 'model_name': trained.cfg.model.name, 'source': source,
                    'weights': os.path.abspath(trained.weights_path),
                    'weights_sha256': file_sha256(trained.weights_path)}
        if 'values' in trained.prediction_defaults:  # a model of values per pixel (depth): which, and their unit
            metadata['values'] = trained.prediction_defaults['values']
        run_dir = RunDir(source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source)))
        if features:
            model = PyramidFeatures.of(trained.model, source)
            metadata.update(part='features', outputs=list(model.output_names), strides=model.strides)
            return ExportSource(model, img_size or trained.img_size, metadata, run_dir.features_onnx)
        return ExportSource(trained.model, img_size or trained.img_size, metadata, run_dir.onnx)
    if features:
        raise ValueError(f"--features takes a segmentation or detection run (its feature pyramid), not the model spec "
                         f"{source!r}")
    import timm

    from .bench.specs import parse_model_spec
    spec = parse_model_spec(source)
    kwargs = dict(spec.kwargs)
    if img_size:
        kwargs.setdefault('img_size', img_size)
    if dynamic_size:
        kwargs.setdefault('dynamic_img_size', True)
    model = timm.create_model(spec.name, pretrained=False, **kwargs).eval()
    size = img_size or tuple(model.patch_embed.img_size)
    return ExportSource(model, size, {'model_name': spec.name, 'source': source}, f"{spec.name}.onnx")


def file_sha256(path: Union[str, os.PathLike], chunk_bytes: int = 1 << 20) -> str:
    """The hex sha256 of a file's content, read in chunks (weights files can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(chunk_bytes), b''):
            digest.update(chunk)
    return digest.hexdigest()


def check_source_weights(path: Union[str, os.PathLike], metadata: Optional[Dict[str, Any]] = None) -> None:
    """Refuse an ONNX file whose weights have changed since it was exported (``StaleExportError``, one line that
    says how to export it again). A file exported from a run records the weights file it was made from and its
    sha256 (``load_export_source``); when that file is gone the ONNX file stands alone and is used; a file without
    them (a model spec, an export from before they were recorded) is not checked. ``metadata``: ``read_metadata``'s
    answer, when the caller has it."""
    metadata = read_metadata(path) if metadata is None else metadata
    weights, recorded = metadata.get('weights'), metadata.get('weights_sha256')
    if not weights or not recorded:
        return
    if not os.path.isfile(weights):
        _logger.info("%s: the weights it was exported from (%s) are gone; using the file as it is", path, weights)
        return
    if file_sha256(weights) != recorded:
        dtype = '' if metadata.get('dtype', 'float32') == 'float32' else f" --dtype {metadata['dtype']}"
        raise StaleExportError(f"{path} was exported from {weights}, which has changed since the export (its sha256 "
                               f"differs): export it again with python tools/export_onnx.py {weights} "
                               f"--out {path}{dtype}")


# ---------------------------------------------------------------------------------------------------- latency

def _runtimes(model: nn.Module, compiled: nn.Module, session: Any, images: torch.Tensor,
              dtype: torch.dtype) -> Dict[str, Callable[[], Any]]:
    """The three ways to run one image batch [1, 3, H, W], as calls for ``time_interleaved``."""
    feed = {INPUT_NAME: images.to(dtype).numpy()}

    @torch.no_grad()
    def eager() -> Any:
        return model(images)

    @torch.no_grad()
    def fast() -> Any:
        return compiled(images)

    return {'eager': eager, 'compiled': fast, 'onnxruntime': lambda: session.run(None, feed)}


def measure_latency(model: nn.Module, path: Union[str, os.PathLike], sizes: Sequence[Size2],
                    dtype: Union[torch.dtype, str] = torch.float32, warmup: int = 2,
                    repeats: int = 5) -> List[Dict[str, Any]]:
    """Median ms per image (batch 1, CPU) of the float32 PyTorch model eager and compiled
    (``linvit.fast.compile_model``, one static graph per size) and of the ONNX file at ``path`` in onnxruntime
    (inputs in ``dtype``, the file's), at each (height, width): rows {height, width, eager, compiled, onnxruntime}.
    The PyTorch model pads images to its patch multiple as the file does (``PadToMultiple``). The three run
    interleaved round by round after ``warmup`` untimed rounds (at least 1: the first compiles)."""
    from .fast import compile_model
    from .timing import time_interleaved
    if getattr(model, 'takes_targets', False):
        raise ValueError(f"--latency times models that compile into one graph; {type(model).__name__} picks its "
                         f"boxes with data-dependent shapes (time it with tools/profile_resolution.py --workload "
                         f"detection)")
    dtype = precision_dtype(dtype, 'dtype') if isinstance(dtype, str) else dtype
    session = ort_session(path)
    model = PadToMultiple(model, input_multiple(model))  # as the file does, at sizes the patch does not divide
    compiled = compile_model(model)
    rows = []
    for height, width in sizes:
        images = torch.randn(1, 3, height, width)
        ms = time_interleaved(_runtimes(model, compiled, session, images, dtype), warmup=max(1, warmup),
                              repeats=repeats, device='cpu')
        rows.append({'height': height, 'width': width, **ms})
    return rows


def format_latency(rows: Sequence[Dict[str, Any]], dtype_label: str) -> str:
    """The latency table of ``measure_latency``'s rows; ``dtype_label``: the file's precision (ExportReport.dtype)."""
    from .bench.specs import size_label
    lines = [f"# latency per image (batch 1, median ms; PyTorch float32, onnxruntime {dtype_label}, "
             f"{torch.get_num_threads()} threads); ratios above 1: onnxruntime faster",
             f"{'size':>11} {'eager ms':>9} {'compiled ms':>12} {'onnxruntime ms':>15} {'eager/ort':>10} "
             f"{'compiled/ort':>13}"]
    for r in rows:
        lines.append(f"{size_label(r['height'], r['width']):>11} {r['eager']:>9.1f} {r['compiled']:>12.1f} "
                     f"{r['onnxruntime']:>15.1f} {r['eager'] / r['onnxruntime']:>9.2f}x "
                     f"{r['compiled'] / r['onnxruntime']:>12.2f}x")
    return '\n'.join(lines)
