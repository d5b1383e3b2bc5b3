"""A section's process of the GPU check: ``python -m linvit.bench.gpu_check.sections SETTINGS_JSON SECTION`` measures
the section's planned rows one after the other until its deadline and prints one result line per row (``emit``),
which the parent (``runner``) collects.

1. parity: ``linvit.ops.linear_attention_op`` (the Triton kernel, ``backend='triton'``) in float32, bfloat16 and
   float16, output and gradients dq, dk, dv, against ``linvit.ops.linear_attention`` on float64 copies of the same
   inputs (q, k, v [B, H, N, D]; one more float32 row with a key mask [B, N]): relative max error
   max|x - ref| / max|ref|, ok or FAIL against a tolerance per precision;
2. op: median time of the op's forward and forward+backward (bfloat16 q, k, v [B, H, N, D]) against torch's SDPA
   (``scaled_dot_product_attention``, flash attention on Hopper) and against the op's PyTorch path
   (``backend='torch'``); ratios SDPA/kernel and torch/kernel (above 1: the kernel is faster);
3. models: linvit, its floor (``linvit.layers.make_floor``) and timm's softmax ViT, compiled training steps
   (``linvit.engine.compile_train_step``: forward, cross-entropy, backward under bfloat16 autocast, no optimizer;
   img/s and peak memory) and compiled inference (``linvit.fast.compile_model``, CUDA graphs with inductor, bfloat16
   weights; img/s); last, linvit with ``attn_backend='torch'`` (the kernel's whole-model gain).

Imports at module level are torch, timm and linvit's model core only, so that the kernel sections run on a machine
where the training stack (albumentations, omegaconf, ...) did not install; the compiled training step imports the
engine when it runs.
"""
import functools
import gc
import importlib.util
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

from linvit import fast, ops  # importing linvit registers linvit_* with timm
from linvit.layers import make_floor
from linvit.precision import PRECISIONS
from linvit.timing import synchronize

from ..machine import describe_machine
from ..memory import MemoryWatch
from .plan import (
    EPS,
    FEATURE_MAP,
    LINVIT_KERNELS,
    MODEL_LABELS,
    RESULT_MARK,
    SKIPPED,
    TOLERANCES,
    TORCH_PATH,
    CheckSettings,
    ModelCase,
    OpCase,
    ParityCase,
    Preset,
    plan_models,
    plan_op,
    plan_parity,
)

__all__ = ['emit', 'guarded', 'run_parity', 'run_op', 'run_models', 'run_section', 'section_main']


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
    """The section's first record: the device, machine and versions the report names."""
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
    """Every parity row until the deadline; bfloat16 rows are skipped under the Triton interpreter."""
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
    """Every op row until the deadline, memory released between rows."""
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
    prefix = 'vit' if case.kind == 'softmax' else 'linvit'
    torch.manual_seed(0)
    model = timm.create_model(f"{prefix}_{case.size}_patch16_224", img_size=case.px, **kwargs)
    return make_floor(model) if case.kind == 'floor' else model


def compiled_call(case: ModelCase, model: nn.Module, device: torch.device, backend: str) -> Callable[[], Any]:
    """A no-argument call of one step: the compiled training step (bfloat16 autocast, float32 weights) or the
    compiled inference forward (bfloat16 weights, CUDA graphs with inductor on CUDA), on a fixed random batch."""
    images = torch.randn(case.batch, 3, case.px, case.px, device=device)
    if case.workload == 'training':
        model = model.to(device).train()
        targets = torch.randint(0, model.num_classes, (case.batch,), device=device)
        from linvit.engine.step import compile_train_step  # the training stack: only where this runs

        step = compile_train_step(model, F.cross_entropy, amp_dtype=torch.bfloat16, backend=backend)
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


def section_main(argv: Sequence[str]) -> int:
    """``python -m linvit.bench.gpu_check.sections SETTINGS_JSON SECTION``: one section's process (the runner's
    ``section_argv``)."""
    config, section = argv
    values = json.loads(config)
    values['sections'] = tuple(values['sections'])
    return run_section(CheckSettings(**values), section)


if __name__ == '__main__':
    sys.exit(section_main(sys.argv[1:]))
