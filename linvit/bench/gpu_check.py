"""The GPU check: the linear-attention kernel's parity and speed, and whole-model speed, in one short run.

    settings = CheckSettings(device='cuda:0').resolved()      # or CheckSettings(device='cpu', quick=True)
    status = run_check(settings, start=time.time())         # writes settings.out/gpu_check.{md,csv} and the plot

Three sections, each in its own process under a hard time budget; whatever does not fit in its budget is written as
'skipped (time budget)', never estimated (quality, linvit against softmax ViTs trained by train.py, is the command of
its own ``linvit.bench.quality``, ``make gpu-quality``):

1. parity: ``linvit.ops.linear_attention_op`` (the Triton kernel, ``backend='triton'``) in float32, bfloat16 and
   float16, output and gradients dq, dk, dv, against ``linvit.ops.linear_attention`` on float64 copies of the same
   inputs, at 1k, 16k and 64k tokens (q, k, v [1, 4, N, 64]; one more float32 row with a key mask): relative max
   error max|x - ref| / max|ref|, ok or FAIL against a tolerance per precision;
2. op: median time of the op's forward and forward+backward (bfloat16 q, k, v [8, 16, N, 64], N = 1k to 32k)
   against torch's SDPA (``scaled_dot_product_attention``, flash attention on Hopper) and against the op's PyTorch
   path (``backend='torch'``); ratios SDPA/kernel and torch/kernel (above 1: the kernel is faster);
3. models: ViT-S and ViT-B at 512, 1024 and 2048 px, linvit (``linvit_{small,base}_patch16_224``, default
   options: local mixing on), its floor (``linvit.layers.make_floor``: attention without token mixing) and timm's
   softmax ViT (``vit_*``), for two workloads: training (compiled training steps, ``linvit.fast.compile_train_step``:
   forward, cross-entropy, backward under bfloat16 autocast, no optimizer; img/s and peak memory) and inference
   (CUDA-graph inference, ``linvit.fast.compile_model``, mode='reduce-overhead', bfloat16 weights; img/s). One batch
   size per resolution, static shapes, the most important rows first (ViT-S at 1024 px); last, linvit with
   ``attn_backend='torch'`` (the kernel's whole-model gain). Compilation is most of this section's time: a compile
   cache (``cache_dir``) makes a rerun on the same machine reach further down the list.

The sections run one after the other. Section budgets are shares of the budget (parity 14%, op 14%, models the
rest, minus a few seconds to write the report); what parity and op leave unused goes to the models. A section's
process runs this module (``python -m linvit.bench.gpu_check SETTINGS_JSON``) and prints one result line per row,
which the parent collects. Output in ``out``: gpu_check.csv (one row per measurement), gpu_check.md (the tables, also
printed), gpu_check_throughput.png (img/s against image size), logs/<section>.log. ``run_check`` returns 1 when a
parity row FAILs or a measurement errors, else 0.

Imports at module level are torch, timm and linvit's model core only, so that the kernel sections run on a machine
where the training stack (albumentations, omegaconf, ...) did not install; the compiled training step imports it when
it runs.
"""
import csv
import dataclasses
import functools
import gc
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

from linvit import fast, ops  # importing linvit registers linvit_* with timm
from linvit.bench.machine import describe_machine
from linvit.bench.memory import MemoryWatch
from linvit.layers import make_floor
from linvit.precision import PRECISIONS

ROOT = Path(__file__).resolve().parents[2]  # the repository (on the sections' PYTHONPATH)
SECTIONS = ('parity', 'op', 'models')  # the report's order, and what runs without --sections
#: the Triton kernels a compiled linvit step must launch, per workload (their absence is a silent fallback: a FAIL)
LINVIT_KERNELS = {'training': ('_key_pass', '_query_pass', '_grad_query', '_grad_key'),
                  'inference': ('_key_pass', '_query_pass')}
# relative max error allowed against float64, per input precision (outputs and gradients alike)
TOLERANCES = {'float32': 1e-4, 'bfloat16': 2e-2, 'float16': 5e-3}
FEATURE_MAP, EPS = 'elu1', 1e-6
REPORT_RESERVE_S = 8.0   # kept at the end: the last section's kill grace, then the tables and the plot
KILL_GRACE_S = 2.0       # a section's process is killed this long after its deadline
RESULT_MARK = 'GPU_CHECK_RESULT '
SKIPPED = 'skipped (time budget)'
MODEL_LABELS = {'small': 'ViT-S', 'base': 'ViT-B'}
KINDS = ('linvit', 'softmax', 'floor')   # measured in this order at each (model, size, workload)
TORCH_PATH = 'linvit_torch'              # linvit with attn_backend='torch', measured last
WORKLOADS = ('training', 'inference')    # measured in this order
COMPILE_BACKENDS = ('inductor', 'aot_eager', 'eager')


# ----------------------------------------------------------------------------------------------------------------
# what to run: settings, presets and plans (the parent and the section's process read the same plan)

@dataclass
class CheckSettings:
    """What ``tools/gpu_check.py`` asks for. ``resolved()`` fills the defaults that depend on ``quick`` and makes
    the paths absolute; a section's process gets the resolved settings and its ``deadline`` (a time.time())."""
    device: str = 'cuda:0'
    quick: bool = False                  # tiny sizes, the same code: for a CPU
    out: str = 'runs/gpu_check'          # tables, CSV, plot, logs
    budget: Optional[float] = None       # total seconds (default: the preset's)
    sections: Tuple[str, ...] = SECTIONS
    cache_dir: str = 'build/gpu_check_cache'  # compile caches (inductor, Triton), kept for reruns
    compile_backend: Optional[str] = None  # section 3's torch.compile backend (default: inductor; quick: aot_eager)
    deadline: Optional[float] = None     # a section's process: when it stops

    @property
    def preset(self) -> 'Preset':
        return QUICK if self.quick else FULL

    def resolved(self) -> 'CheckSettings':
        """A copy with the budget and backend defaults filled and absolute paths; ValueError for a budget that
        leaves no time to measure, a section or backend that does not exist."""
        budget = self.preset.budget_s if self.budget is None else float(self.budget)
        if budget <= REPORT_RESERVE_S:
            raise ValueError(f'the budget must be more than {REPORT_RESERVE_S:.0f} s, got {budget:g}')
        unknown = [name for name in self.sections if name not in SECTIONS]
        if unknown:
            raise ValueError(f'unknown sections {unknown}; expected some of {list(SECTIONS)}')
        backend = self.compile_backend or ('aot_eager' if self.quick else 'inductor')
        if backend not in COMPILE_BACKENDS:
            raise ValueError(f'compile backend {backend!r} is not one of {list(COMPILE_BACKENDS)}')
        return dataclasses.replace(self, budget=budget, sections=tuple(self.sections), compile_backend=backend,
                                   out=str(Path(self.out).resolve()), cache_dir=str(Path(self.cache_dir).resolve()))


@dataclass(frozen=True)
class Preset:
    budget_s: float
    shares: Dict[str, float]                   # of the budget: parity, op; models: the rest
    parity_tokens: Tuple[int, ...]
    parity_shape: Tuple[int, int, int]         # B, H, D
    op_tokens: Tuple[int, ...]
    op_shape: Tuple[int, int, int]             # B, H, D
    op_warmup: int
    op_repeats: int
    op_max_s: float                            # timed calls stop after this long (at least 3)
    models: Tuple[Tuple[str, int], ...]        # (model size, image px), most important first
    batches: Dict[str, Dict[int, int]]         # model size -> px -> batch
    model_kwargs: Tuple[Tuple[str, Any], ...]
    train_warmup: int
    train_repeats: int
    infer_warmup: int
    infer_repeats: int


FULL = Preset(
    budget_s=360.0, shares={'parity': 0.14, 'op': 0.14},
    parity_tokens=(1024, 16384, 65536), parity_shape=(1, 4, 64),
    op_tokens=(1024, 4096, 16384, 32768), op_shape=(8, 16, 64), op_warmup=3, op_repeats=20, op_max_s=1.0,
    models=(('small', 1024), ('small', 512), ('small', 2048), ('base', 1024), ('base', 2048), ('base', 512)),
    batches={'small': {512: 64, 1024: 16, 2048: 4}, 'base': {512: 32, 1024: 8, 2048: 2}}, model_kwargs=(),
    train_warmup=2, train_repeats=8, infer_warmup=3, infer_repeats=10)
QUICK = Preset(
    # on a CPU the sections' imports take a good part of their budget (5-10 s each on 2 busy cores)
    budget_s=120.0, shares={'parity': 0.35, 'op': 0.2},
    parity_tokens=(64, 200), parity_shape=(1, 2, 32),
    op_tokens=(64, 256), op_shape=(1, 2, 32), op_warmup=1, op_repeats=3, op_max_s=0.2,
    models=(('small', 64), ('base', 32)), batches={'small': {64: 2}, 'base': {32: 2}}, model_kwargs=(('depth', 1),),
    train_warmup=1, train_repeats=2, infer_warmup=1, infer_repeats=2)


@dataclass(frozen=True)
class ParityCase:
    dtype: str  # a precision name
    tokens: int
    mask: bool = False

    @property
    def key(self) -> str:
        return f"parity/{self.dtype}/{self.tokens}{'/mask' if self.mask else ''}"


@dataclass(frozen=True)
class OpCase:
    tokens: int
    backward: bool

    @property
    def key(self) -> str:
        return f"op/{self.tokens}/{'fwd+bwd' if self.backward else 'fwd'}"


@dataclass(frozen=True)
class ModelCase:
    size: str
    px: int
    workload: str
    kind: str
    batch: int

    @property
    def key(self) -> str:
        return f"models/{self.size}/{self.px}/{self.workload}/{self.kind}"


def plan_parity(preset: Preset) -> List[ParityCase]:
    """Every precision at each token count, smallest first, then float32 with a key mask at the smallest."""
    return [ParityCase(dtype, n) for n in preset.parity_tokens for dtype in PRECISIONS] + \
        [ParityCase('float32', preset.parity_tokens[0], mask=True)]


def plan_op(preset: Preset) -> List[OpCase]:
    return [OpCase(n, backward) for n in preset.op_tokens for backward in (False, True)]


def plan_models(preset: Preset) -> List[ModelCase]:
    """linvit, softmax, floor; training then inference; at each (model size, px) in priority order. Last: linvit on
    the PyTorch path (attn_backend='torch') at the first (most important) size."""
    cases = [ModelCase(size, px, workload, kind, preset.batches[size][px])
             for size, px in preset.models for workload in WORKLOADS for kind in KINDS]
    size, px = preset.models[0]
    return cases + [ModelCase(size, px, workload, TORCH_PATH, preset.batches[size][px]) for workload in WORKLOADS]


def plan_keys(section: str, preset: Preset) -> List[str]:
    if section == 'parity':
        return [case.key for case in plan_parity(preset)]
    if section == 'op':
        return [case.key for case in plan_op(preset)]
    return [case.key for case in plan_models(preset)]


# ----------------------------------------------------------------------------------------------------------------
# shared by the sections' processes

def emit(record: Dict[str, Any]) -> None:
    """One result line on stdout, read by the parent process."""
    print(RESULT_MARK + json.dumps(record), flush=True)


def guarded(section: str, key: str, measure: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """measure()'s fields as a record; an exception becomes status 'oom' or 'error: <type>: <first line>'."""
    try:
        fields = measure()
    except Exception as exc:  # noqa: BLE001  (one failed measurement is a row, not a crashed section)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ''
        oom = isinstance(exc, torch.OutOfMemoryError) or 'out of memory' in text.lower()
        fields = {'status': 'oom' if oom else f"error: {type(exc).__name__}: {text}"[:300]}
    return {'section': section, 'key': key, 'status': 'ok', **fields}


def synchronize(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Drop compiled graphs (and their CUDA-graph pools) and cached blocks between measurements."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == 'cuda':
        torch.cuda.empty_cache()


def kernel_op(device: torch.device, timing: bool = False) -> Tuple[Callable[..., torch.Tensor], str]:
    """(fn(q, k, v, key_mask=None) -> out, label) for the kernel column: the Triton kernel on CUDA (and on CPU
    under TRITON_INTERPRET=1, except for timing); the op's 'auto' path otherwise."""
    if device.type == 'cuda' or (not timing and ops.triton_interpreting()):
        label = 'triton' if device.type == 'cuda' else 'triton (interpreter)'
        return functools.partial(ops.linear_attention_op, feature_map=FEATURE_MAP, eps=EPS, backend='triton'), label
    return (functools.partial(ops.linear_attention_op, feature_map=FEATURE_MAP, eps=EPS, backend='auto'),
            f"auto ({device.type})")


def torch_path_op() -> Tuple[Callable[..., torch.Tensor], str]:
    """The op's PyTorch path (backend='torch')."""
    return functools.partial(ops.linear_attention_op, feature_map=FEATURE_MAP, eps=EPS, backend='torch'), 'torch'


def meta_record(section: str, device: torch.device) -> Dict[str, Any]:
    triton_version = None
    if importlib.util.find_spec('triton') is not None:
        import triton
        triton_version = triton.__version__
    return {'section': 'meta', 'key': f"meta/{section}", 'status': 'ok', 'device': str(device),
            'machine': describe_machine(device), 'torch': torch.__version__, 'triton': triton_version,
            'timm': timm.__version__}


# ----------------------------------------------------------------------------------------------------------------
# 1. parity

def relative_max_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max|x - ref| / max|ref| (inf when x is not finite); x any dtype, ref float64, same shape."""
    x = x.detach().double()
    if not torch.isfinite(x).all():
        return float('inf')
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def parity_inputs(case: ParityCase, shape: Tuple[int, int, int],
                  device: torch.device) -> Tuple[List[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    """([q, k, v] [B, H, N, D] in the case's precision, requiring grad; the upstream gradient [B, H, N, D];
    key_mask [B, N] bool (10% of the keys dropped) or None), drawn from a seed fixed by the case."""
    b, h, d = shape
    gen = torch.Generator(device=device).manual_seed(case.tokens)
    dtype = PRECISIONS[case.dtype]
    q, k, v, grad = (torch.randn(b, h, case.tokens, d, device=device, generator=gen).to(dtype) for _ in range(4))
    mask = torch.rand(b, case.tokens, device=device, generator=gen) > 0.1 if case.mask else None
    return [t.requires_grad_() for t in (q, k, v)], grad, mask


def parity_record(case: ParityCase, preset: Preset, device: torch.device) -> Dict[str, Any]:
    """Relative max errors of out, dq, dk, dv of the kernel against float64 ``linear_attention``."""
    fn, label = kernel_op(device)
    inputs, grad, mask = parity_inputs(case, preset.parity_shape, device)
    out = fn(*inputs, key_mask=mask)
    grads = torch.autograd.grad(out, inputs, grad)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = ops.linear_attention(*ref_inputs, feature_map=FEATURE_MAP, eps=EPS, key_mask=mask)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad.double())
    errors = {'err_out': relative_max_error(out, ref)}
    errors.update({f"err_d{name}": relative_max_error(g, r) for name, g, r in zip('qkv', grads, ref_grads)})
    tol = TOLERANCES[case.dtype]
    b, h, d = preset.parity_shape
    return {'dtype': case.dtype, 'tokens': case.tokens, 'shape': f"B{b}-H{h}-D{d}", 'mask': case.mask,
            'kernel': label, **errors, 'tol': tol, 'status': 'ok' if max(errors.values()) <= tol else 'FAIL'}


def run_parity(settings: CheckSettings, preset: Preset, device: torch.device) -> None:
    interpreted = device.type != 'cuda' and ops.triton_interpreting()
    for case in plan_parity(preset):
        if time.time() > settings.deadline:
            break
        if interpreted and case.dtype == 'bfloat16':
            emit({'section': 'parity', 'key': case.key, 'dtype': case.dtype, 'tokens': case.tokens,
                  'status': "skipped (Triton interpreter: its bfloat16 dot is unreliable)"})
            continue
        emit(guarded('parity', case.key, lambda case=case: parity_record(case, preset, device)))


# ----------------------------------------------------------------------------------------------------------------
# 2. op time

def time_op(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int, max_s: float) -> float:
    """Median milliseconds of fn() after ``warmup`` calls: CUDA events on CUDA, perf_counter elsewhere; at least 3
    and at most ``repeats`` timed calls, fewer than ``repeats`` once ``max_s`` seconds have passed."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: List[float] = []
    stop = time.perf_counter() + max_s
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() < stop):
        if device.type == 'cuda':
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def kernel_profile(call: Callable[[], Any], device: torch.device, calls: int = 3) -> Dict[str, Tuple[float, float]]:
    """{CUDA kernel name: (GPU ms per call, launches per call)} over ``calls`` profiled calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    call()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        synchronize(device)
    return {e.key: (e.self_device_time_total / 1e3 / calls, e.count / calls) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA}


def op_call(fn: Callable[..., torch.Tensor], qkv: List[torch.Tensor], grad: torch.Tensor,
            backward: bool) -> Callable[[], Any]:
    """fn(q, k, v) without autograd, or fn(q, k, v) and its gradients with respect to q, k, v."""
    if not backward:
        def forward() -> Any:
            with torch.no_grad():
                return fn(*qkv)
        return forward
    return lambda: torch.autograd.grad(fn(*qkv), qkv, grad)


def op_record(case: OpCase, preset: Preset, device: torch.device) -> Dict[str, Any]:
    """Median ms of the kernel, the PyTorch path and SDPA on bfloat16 q, k, v [B, H, N, D]; the ratios."""
    b, h, d = preset.op_shape
    gen = torch.Generator(device=device).manual_seed(case.tokens)
    qkv = [torch.randn(b, h, case.tokens, d, device=device, generator=gen, dtype=torch.bfloat16)
           .requires_grad_(case.backward) for _ in range(3)]
    grad = torch.randn(b, h, case.tokens, d, device=device, generator=gen, dtype=torch.bfloat16)
    kernel, label = kernel_op(device, timing=True)
    torch_fn, torch_label = torch_path_op()
    impls = {'kernel': kernel, 'torch': torch_fn, 'sdpa': F.scaled_dot_product_attention}
    ms = {name: time_op(op_call(fn, qkv, grad, case.backward), device, preset.op_warmup, preset.op_repeats,
                        preset.op_max_s) for name, fn in impls.items()}
    # the GPU time of the op's own kernels and their launches per call: wall far above it is host overhead
    kernels = kernel_profile(op_call(kernel, qkv, grad, case.backward), device) if device.type == 'cuda' else {}
    return {'tokens': case.tokens, 'shape': f"B{b}-H{h}-D{d}", 'pass': 'fwd+bwd' if case.backward else 'fwd',
            'kernel': label, 'torch_path': torch_label, 'kernel_ms': ms['kernel'], 'torch_ms': ms['torch'],
            'sdpa_ms': ms['sdpa'], 'sdpa_over_kernel': ms['sdpa'] / ms['kernel'],
            'torch_over_kernel': ms['torch'] / ms['kernel'],
            'gpu_ms': sum(t for t, _ in kernels.values()) if kernels else None,
            'launches': sum(n for _, n in kernels.values()) if kernels else None}


def run_op(settings: CheckSettings, preset: Preset, device: torch.device) -> None:
    for case in plan_op(preset):
        if time.time() > settings.deadline:
            break
        emit(guarded('op', case.key, lambda case=case: op_record(case, preset, device)))
        release_memory(device)


# ----------------------------------------------------------------------------------------------------------------
# 3. whole models

def build_model(case: ModelCase, preset: Preset) -> nn.Module:
    """The case's model at img_size=px on the CPU: linvit_<size>, its floor, vit_<size> or linvit on the torch
    path."""
    kwargs = dict(preset.model_kwargs)
    if case.kind == TORCH_PATH:
        kwargs['attn_backend'] = 'torch'
    family = 'vit' if case.kind == 'softmax' else 'linvit'
    torch.manual_seed(0)
    model = timm.create_model(f"{family}_{case.size}_patch16_224", img_size=case.px, **kwargs)
    return make_floor(model) if case.kind == 'floor' else model


def compiled_call(case: ModelCase, model: nn.Module, device: torch.device, backend: str) -> Callable[[], Any]:
    """A no-argument call of one step: the compiled training step (bfloat16 autocast, float32 weights) or the
    compiled inference forward (bfloat16 weights, CUDA graphs with inductor on CUDA), on a fixed random batch."""
    images = torch.randn(case.batch, 3, case.px, case.px, device=device)
    if case.workload == 'training':
        model = model.to(device).train()
        targets = torch.randint(0, model.num_classes, (case.batch,), device=device)
        step = fast.compile_train_step(model, F.cross_entropy, amp_dtype=torch.bfloat16, backend=backend)
        return lambda: step(images, targets)
    model = model.to(device, torch.bfloat16).eval()
    images = images.to(torch.bfloat16)
    forward = fast.compile_model(model, mode='reduce-overhead' if backend == 'inductor' else None, backend=backend)

    def infer() -> Any:
        with torch.inference_mode():
            return forward(images)
    return infer


def timed_call(call: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call, the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - start


def model_record(case: ModelCase, preset: Preset, device: torch.device, backend: str,
                 deadline: float) -> Dict[str, Any]:
    """img/s (median over the timed steps), peak memory of the timed steps and the first (compiling) call's time."""
    model = build_model(case, preset)
    tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    call = compiled_call(case, model, device, backend)
    warmup, repeats = ((preset.train_warmup, preset.train_repeats) if case.workload == 'training'
                       else (preset.infer_warmup, preset.infer_repeats))
    memory = MemoryWatch(device)
    memory.start()
    first_s = timed_call(call, device)
    for _ in range(warmup - 1):
        timed_call(call, device)
    memory.steady()
    times: List[float] = []
    while len(times) < repeats and (not times or time.time() < deadline):
        times.append(timed_call(call, device))
    median = statistics.median(times)
    missing = missing_kernels(call, device, case.workload) if case.kind == 'linvit' else []
    checked = {'status': 'FAIL', 'problem': f"{', '.join(missing)} did not run in a profiled step (the PyTorch path "
                                            f"ran instead)"} if missing else {}
    return {**checked, 'model': MODEL_LABELS[case.size], 'size': case.size, 'kind': case.kind, 'px': case.px,
            'tokens': tokens, 'workload': case.workload, 'batch': case.batch, 'img_per_s': case.batch / median,
            'ms': median * 1e3, 'peak_mem_mib': memory.result()['peak_mem_mib'], 'first_call_s': first_s,
            'repeats': len(times), 'compile_backend': backend}


def missing_kernels(call: Callable[[], Any], device: torch.device, workload: str) -> List[str]:
    """The linvit Triton kernels (``LINVIT_KERNELS``) that one profiled call of a compiled linvit step did not
    launch; [] off CUDA, or where the profile saw no kernel at all (nothing to tell from)."""
    if device.type != 'cuda':
        return []
    names = kernel_profile(call, device, calls=1)
    return [name for name in LINVIT_KERNELS[workload] if name not in names] if names else []


def run_models(settings: CheckSettings, preset: Preset, device: torch.device) -> None:
    """Every planned case in order; a case is skipped when the quickest measurement of its workload so far
    (compiling dominates, and changes little with size and model; the first one also pays the compiler's start) no
    longer fits before the deadline, so that a later case that may fit still gets its chance."""
    quickest: Dict[str, float] = {}
    for case in plan_models(preset):
        described = {'model': MODEL_LABELS[case.size], 'kind': case.kind, 'px': case.px, 'workload': case.workload,
                     'batch': case.batch}
        if time.time() + quickest.get(case.workload, 0.0) > settings.deadline:
            emit({'section': 'models', 'key': case.key, **described, 'status': SKIPPED})
            continue
        start = time.time()
        record = guarded('models', case.key, lambda case=case: model_record(
            case, preset, device, settings.compile_backend, settings.deadline))
        emit({**described, **record})
        quickest[case.workload] = min(quickest.get(case.workload, float('inf')), time.time() - start)
        release_memory(device)


SECTION_RUNNERS = {'parity': run_parity, 'op': run_op, 'models': run_models}


def run_section(settings: CheckSettings, section: str) -> int:
    """A section's process: its meta record, then one record per planned row, until done or the deadline."""
    device = torch.device(settings.device)
    emit(meta_record(section, device))
    SECTION_RUNNERS[section](settings, settings.preset, device)
    return 0


# ----------------------------------------------------------------------------------------------------------------
# the parent: start the sections' processes under their deadlines, collect their records

@dataclass
class Section:
    name: str
    proc: subprocess.Popen
    log: Path
    deadline: float
    started: float
    offset: int = 0
    code: Optional[int] = None
    killed: bool = False
    ended: Optional[float] = None


def section_argv(settings: CheckSettings, section: str, deadline: float) -> List[str]:
    """The command of a section's process: this module with the settings (and the section's deadline) as JSON."""
    config = dataclasses.asdict(dataclasses.replace(settings, deadline=deadline))
    return [sys.executable, '-m', __name__, json.dumps(config), section]


def section_env(settings: CheckSettings, section: str) -> Dict[str, str]:
    """The environment of a section's process: the repository importable, caches in cache_dir, and on a CPU the
    Triton interpreter for the parity section (so that the kernel itself runs there)."""
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    env['PYTHONPATH'] = os.pathsep.join([str(ROOT)] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
    env.setdefault('TORCHINDUCTOR_CACHE_DIR', str(Path(settings.cache_dir) / 'inductor'))
    env.setdefault('TRITON_CACHE_DIR', str(Path(settings.cache_dir) / 'triton'))
    if section == 'parity' and not settings.device.startswith('cuda') and importlib.util.find_spec('triton'):
        env.setdefault('TRITON_INTERPRET', '1')
    return env


def start_section(settings: CheckSettings, name: str, deadline: float) -> Section:
    log = Path(settings.out) / 'logs' / f"{name}.log"
    with open(log, 'w') as f:
        proc = subprocess.Popen(section_argv(settings, name, deadline), stdout=f, stderr=subprocess.STDOUT,
                                cwd=ROOT, env=section_env(settings, name), start_new_session=True)
    return Section(name, proc, log, deadline, time.time())


def read_records(section: Section) -> List[Dict[str, Any]]:
    """The complete result lines the section's process wrote since the last read."""
    with open(section.log, 'rb') as f:
        f.seek(section.offset)
        data = f.read()
    end = data.rfind(b'\n') + 1
    section.offset += end
    lines = data[:end].decode('utf-8', 'replace').splitlines()
    return [json.loads(line[len(RESULT_MARK):]) for line in lines if line.startswith(RESULT_MARK)]


def wait_sections(sections: Sequence[Section], records: Dict[str, Dict[str, Any]]) -> None:
    """Collect records until every section exited, killing each one KILL_GRACE_S after its deadline."""
    running = list(sections)
    while running:
        time.sleep(0.2)
        for section in list(running):
            done = section.proc.poll() is not None
            for record in read_records(section):
                records[record['key']] = record
                print(progress_line(record), flush=True)
            if done:
                section.code, section.ended = section.proc.returncode, time.time()
                running.remove(section)
            elif time.time() > section.deadline + KILL_GRACE_S:
                os.killpg(section.proc.pid, signal.SIGKILL)
                section.proc.wait()
                section.killed = True


def progress_line(record: Dict[str, Any]) -> str:
    return f"[{record['section']}] {record['key'].split('/', 1)[-1]}: {record['status']}"


def fill_missing(section: Section, keys: Iterable[str], records: Dict[str, Dict[str, Any]]) -> None:
    """Rows a section did not report: skipped when it ran out of time, an error when its process failed."""
    if section.killed or section.code == 0:
        status = SKIPPED
    else:
        status = f"error: the {section.name} process exited {section.code} (logs/{section.name}.log)"
    for key in keys:
        records.setdefault(key, {'section': section.name, 'key': key, 'status': status})


def run_sections(settings: CheckSettings, preset: Preset, start: float) -> Tuple[Dict[str, Dict[str, Any]],
                                                                                  List[Section]]:
    """parity, then op, then models; each under its deadline."""
    budget, chosen = settings.budget, set(settings.sections)
    records: Dict[str, Dict[str, Any]] = {}
    done: List[Section] = []
    final = start + budget - REPORT_RESERVE_S
    for name in SECTIONS:
        if name not in chosen:
            continue
        deadline = final if name == 'models' else min(final, time.time() + preset.shares[name] * budget)
        section = start_section(settings, name, deadline)
        wait_sections([section], records)
        done.append(section)
    for section in done:
        fill_missing(section, plan_keys(section.name, preset), records)
    return records, done


# ----------------------------------------------------------------------------------------------------------------
# the report: markdown tables, CSV, plot

def fmt(value: Optional[float], spec: str) -> str:
    return '-' if value is None else format(value, spec)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    return lines + ['| ' + ' | '.join(row) + ' |' for row in rows]


PARITY_HEADER = ('dtype', 'tokens', 'shape', 'kernel', 'out', 'dq', 'dk', 'dv', 'tol', 'status')
OP_HEADER = ('tokens', 'pass', 'kernel', 'kernel ms', 'torch ms', 'SDPA ms', 'SDPA/kernel', 'torch/kernel',
             'kernel GPU ms', 'launches', 'status')
MODELS_HEADER = ('model', 'px (tokens)', 'workload', 'batch', 'linvit img/s', 'softmax img/s', 'floor img/s',
                 'linvit/softmax', 'linvit/floor', 'linvit/torch-path', 'peak GiB linvit, softmax, floor',
                 'first call s linvit', 'status')


def parity_rows(records: Dict[str, Dict[str, Any]], preset: Preset) -> List[List[str]]:
    rows = []
    for case in plan_parity(preset):
        r = records[case.key]
        b, h, d = preset.parity_shape
        errors = [fmt(r.get(f"err_{name}"), '.1e') for name in ('out', 'dq', 'dk', 'dv')]
        rows.append([case.dtype + (' + mask' if case.mask else ''), str(case.tokens), f"B{b}-H{h}-D{d}",
                     r.get('kernel', '-'), *errors, fmt(TOLERANCES[case.dtype], '.0e'), r['status']])
    return rows


def op_rows(records: Dict[str, Dict[str, Any]], preset: Preset) -> List[List[str]]:
    rows = []
    for case in plan_op(preset):
        r = records[case.key]
        rows.append([str(case.tokens), 'fwd+bwd' if case.backward else 'fwd', r.get('kernel', '-'),
                     fmt(r.get('kernel_ms'), '.3f'), fmt(r.get('torch_ms'), '.3f'), fmt(r.get('sdpa_ms'), '.3f'),
                     fmt(r.get('sdpa_over_kernel'), '.2f'), fmt(r.get('torch_over_kernel'), '.2f'),
                     fmt(r.get('gpu_ms'), '.3f'), fmt(r.get('launches'), '.0f'), r['status']])
    return rows


def _ok(record: Optional[Dict[str, Any]], field: str) -> Optional[float]:
    # a FAIL row (a linvit step that fell back to the PyTorch path) was measured: its figures are shown
    return record.get(field) if record is not None and record.get('status') in ('ok', 'FAIL') else None


def models_rows(records: Dict[str, Dict[str, Any]], preset: Preset) -> List[List[str]]:
    rows = []
    for size, px in preset.models:
        for workload in WORKLOADS:
            got = {kind: records.get(f"models/{size}/{px}/{workload}/{kind}") for kind in (*KINDS, TORCH_PATH)}
            speed = {kind: _ok(record, 'img_per_s') for kind, record in got.items()}
            peaks = '/'.join(fmt(None if _ok(got[k], 'peak_mem_mib') is None else got[k]['peak_mem_mib'] / 1024,
                                 '.1f') for k in KINDS)
            tokens = next((r['tokens'] for r in got.values() if r and r.get('tokens')), None)
            problems = [f"{kind}: {r['status']}" + (f" ({r['problem']})" if r.get('problem') else '')
                        for kind, r in got.items() if r is not None and r['status'] != 'ok']
            rows.append([MODEL_LABELS[size], f"{px} ({fmt(tokens, ',')})", workload,
                         str(preset.batches[size][px]), *(fmt(speed[k], ',.1f') for k in KINDS),
                         fmt(ratio(speed['linvit'], speed['softmax']), '.2f'),
                         fmt(ratio(speed['linvit'], speed['floor']), '.2f'),
                         fmt(ratio(speed['linvit'], speed[TORCH_PATH]), '.2f'), peaks,
                         fmt(_ok(got['linvit'], 'first_call_s'), '.1f'), '; '.join(problems) or 'ok'])
    return rows


def header_lines(records: Dict[str, Dict[str, Any]], settings: CheckSettings, sections: Sequence[Section],
                 wall_s: float) -> List[str]:
    meta = next((r for k, r in records.items() if k.startswith('meta/')), None)
    lines = ['# linvit GPU check', '']
    if meta is not None:
        lines.append(f"{meta['machine']} ({meta['device']}); torch {meta['torch']}, triton {meta['triton']}, "
                     f"timm {meta['timm']}; kernel: linvit.ops.linear_attention_op.")
    spent = ', '.join(f"{s.name} {(s.ended or time.time()) - s.started:.0f} s"
                      f"{' (stopped at its deadline)' if s.killed else ''}" for s in sections)
    lines += [f"{'quick' if settings.quick else 'full'} preset, budget {settings.budget:.0f} s, wall {wall_s:.0f} s "
              f"({spent}); '{SKIPPED}' marks rows that did not fit their section's budget.", '']
    return lines


SECTION_TITLES = {
    'parity': ('1. Kernel parity against float64', 'relative max error max|x - ref| / max|ref| of the output and '
               'the gradients, against linvit.ops.linear_attention on float64 copies of the same inputs'),
    'op': ('2. Op time', 'median ms, bfloat16 inputs; ratios above 1: the kernel is faster'),
    'models': ('3. Whole models', 'training: compiled step (forward, cross-entropy, backward; bfloat16 autocast); '
               "inference: compiled forward, bfloat16 weights, mode='reduce-overhead' (CUDA graphs); ratios of "
               'img/s; floor = linvit without token mixing; torch-path = linvit with attn_backend=torch; peak = '
               'timed steps'),
}
SECTION_TABLES = {'parity': (PARITY_HEADER, parity_rows), 'op': (OP_HEADER, op_rows),
                  'models': (MODELS_HEADER, models_rows)}


def markdown(records: Dict[str, Dict[str, Any]], settings: CheckSettings, preset: Preset,
             sections: Sequence[Section], wall_s: float) -> str:
    lines = header_lines(records, settings, sections, wall_s)
    for name in SECTIONS:
        if name not in settings.sections:
            continue
        title, words = SECTION_TITLES[name]
        header, rows = SECTION_TABLES[name]
        lines += [f"## {title}", '', words + '.', '', *md_table(header, rows(records, preset)), '']
    return '\n'.join(lines)


def write_csv(path: Path, records: Iterable[Dict[str, Any]]) -> None:
    """One row per record, the union of their fields (first seen first)."""
    records = list(records)
    fields: Dict[str, None] = {}
    for record in records:
        fields.update(dict.fromkeys(record))
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(records)


def plot_throughput(records: Dict[str, Dict[str, Any]], path: Path, title: str, cuda: bool) -> None:
    """img/s against the image side, log-log: training (left) and inference (right); a line per model and kind."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    from linvit.plotting import plain_log_y, save_png

    colors = {'linvit': 'tab:blue', 'softmax': 'tab:red', 'floor': 'tab:gray', TORCH_PATH: 'tab:cyan'}
    styles = {'small': '-', 'base': '--'}
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    ok = [r for r in records.values() if r['section'] == 'models' and r['status'] == 'ok']
    for ax, workload in zip(axes, WORKLOADS):
        for size in styles:
            for kind, color in colors.items():
                points = sorted((r['px'], r['img_per_s']) for r in ok
                                if r['workload'] == workload and r['size'] == size and r['kind'] == kind)
                if points:
                    ax.plot(*zip(*points), styles[size], color=color, marker='o',
                            label=f"{MODEL_LABELS[size]} {kind.replace('linvit_torch', 'linvit torch-path')}")
        if ax.lines:
            sides = sorted({r['px'] for r in ok})
            ax.set_xscale('log')
            ax.xaxis.set_major_locator(FixedLocator(sides))
            ax.xaxis.set_major_formatter(FixedFormatter([str(side) for side in sides]))
            ax.xaxis.set_minor_locator(NullLocator())
            plain_log_y(ax)
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, 'no measurements', ha='center', va='center', transform=ax.transAxes)
        ax.set_xlabel('image side (px)')
        ax.set_ylabel('images / s')
        ax.set_title('training step' if workload == 'training' else f"inference{' (CUDA graphs)' if cuda else ''}")
        ax.grid(True, which='both', alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def failed(records: Dict[str, Dict[str, Any]]) -> List[str]:
    return [f"{key}: {r['status']}" for key, r in records.items() if r['status'] == 'FAIL'
            or r['status'].startswith('error')]


def report(records: Dict[str, Dict[str, Any]], settings: CheckSettings, preset: Preset,
           sections: Sequence[Section], wall_s: float) -> str:
    """Write gpu_check.md, gpu_check.csv and gpu_check_throughput.png into settings.out; returns the markdown."""
    out = Path(settings.out)
    text = markdown(records, settings, preset, sections, wall_s)
    (out / 'gpu_check.md').write_text(text + '\n')
    write_csv(out / 'gpu_check.csv', records.values())
    meta = next((r for k, r in records.items() if k.startswith('meta/')), {})
    plot_throughput(records, out / 'gpu_check_throughput.png',
                    f"linvit GPU check: {meta.get('machine', settings.device)}, bfloat16",
                    settings.device.startswith('cuda'))
    return text


# ----------------------------------------------------------------------------------------------------------------
# the whole check

def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0 elsewhere): the budget counts the imports too."""
    try:
        with open('/proc/self/stat') as f:
            start_ticks = int(f.read().rsplit(')', 1)[1].split()[19])
        with open('/proc/uptime') as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf('SC_CLK_TCK'))
    except (OSError, ValueError, IndexError):
        return 0.0


def run_check(settings: CheckSettings, start: float) -> int:
    """Run the chosen sections of the resolved ``settings`` within its budget counted from ``start`` (a
    time.time()), print the progress and the tables, write the report files; 1 when a row FAILed or errored."""
    preset = settings.preset
    out = Path(settings.out)
    (out / 'logs').mkdir(parents=True, exist_ok=True)
    Path(settings.cache_dir).mkdir(parents=True, exist_ok=True)
    print(f"# gpu_check on {settings.device}: sections {' '.join(settings.sections)}, budget {settings.budget:.0f} s; "
          f"logs in {out / 'logs'}", flush=True)
    records, sections = run_sections(settings, preset, start)
    text = report(records, settings, preset, sections, time.time() - start)
    print(text)
    print(f"wrote {out / 'gpu_check.md'}, {out / 'gpu_check.csv'}, {out / 'gpu_check_throughput.png'}")
    problems = failed(records)
    for line in problems:
        print(f"FAILED {line}")
    return 1 if problems else 0


def section_main(argv: Sequence[str]) -> int:
    """``python -m linvit.bench.gpu_check SETTINGS_JSON SECTION``: one section's process (see ``section_argv``)."""
    config, section = argv
    values = json.loads(config)
    values['sections'] = tuple(values['sections'])
    return run_section(CheckSettings(**values), section)


if __name__ == '__main__':
    sys.exit(section_main(sys.argv[1:]))
