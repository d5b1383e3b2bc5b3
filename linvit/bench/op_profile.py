"""Where a step's time goes, by kind of operation: matmuls, the attention core, convolutions (linvit's local-mix
branch), normalisation, copies and casts (layouts, dtypes), compiled fused kernels and the rest, per model, from
``torch.profiler``. The library behind ``tools/bench_train_step.py --profile-ops``.

On CUDA the time of an operation is its kernels' device time; on a CPU it is the self time of the profiled ops
(what each op ran itself, not its children), so the categories add up to the profiled steps' time on the calling
thread. The functions are profiled one call each per round, so that a machine's drift hits them alike. Compiled CPU
code shows its fused kernels by name only with inductor's kernel profiling on
(``enable_compiled_kernel_names``, before the first compile). A category is read off the op's or kernel's name
(``categorize``): kernels are named by their library (cuBLAS, cuDNN, Triton) or by the ops inductor fused into them,
so read the top list next to the categories.

    shares = profile_steps({'linvit': step, 'floor': floor_step}, steps=3, device='cuda')
    print('\\n'.join(format_profile(shares, top=10)))
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from linvit.timing import synchronize

__all__ = ['CATEGORIES', 'OpTime', 'StepProfile', 'categorize', 'enable_compiled_kernel_names', 'profile_steps',
           'format_profile']

#: the kinds of operation a step's time is split into, in the table's order
CATEGORIES = ('matmul', 'attention', 'convolution', 'normalisation', 'copies and casts', 'fused (compiled)', 'other')

# (category, lower-case name fragments): the first rule with a fragment in the name wins. Compiled kernels come
# first, since inductor names a fused kernel after every op it fused (a clone fused into a kernel that also adds)
_RULES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ('fused (compiled)', ('cpp_fused', 'triton_poi', 'triton_red', 'triton_per', 'triton_tem')),
    ('attention', ('linvit::', '_key_pass', '_query_pass', '_grad_query', '_grad_key', 'scaled_dot_product',
                   'flash', 'fmha', 'efficient_attention', 'cudnn_attention')),
    ('convolution', ('conv',)),
    ('matmul', ('aten::mm', 'addmm', 'bmm', 'matmul', 'aten::linear', 'gemm', 'xmma', 'cutlass', 'nvjet', 'cublas')),
    ('normalisation', ('layer_norm', 'group_norm', 'batch_norm', 'rms_norm')),
    ('copies and casts', ('copy', 'clone', 'contiguous', 'aten::cat', 'constant_pad', 'aten::pad', 'memset')),
)


def categorize(name: str) -> str:
    """The category (one of CATEGORIES) of an op or kernel name, e.g. 'aten::bmm' -> 'matmul',
    'aten::mkldnn_convolution' -> 'convolution', 'aten::_to_copy' -> 'copies and casts'."""
    lowered = name.lower()
    for category, fragments in _RULES:
        if any(fragment in lowered for fragment in fragments):
            return category
    return 'other'


def enable_compiled_kernel_names() -> None:
    """Make inductor's CPU kernels appear in profiles under their names (process-wide, for graphs compiled after
    the call); without it their time counts as the self time of the compiled graph's call ('other')."""
    import torch._inductor.config as inductor_config  # imported here: only profiling needs it
    inductor_config.cpp.enable_kernel_profile = True


@dataclass
class OpTime:
    name: str
    category: str
    ms: float      # per step
    calls: float   # per step


@dataclass
class StepProfile:
    """One model's profiled steps: ``ops`` by time (ms per step, largest first)."""
    ops: List[OpTime]

    @property
    def by_category(self) -> Dict[str, float]:
        """ms per step of each of CATEGORIES."""
        totals = dict.fromkeys(CATEGORIES, 0.0)
        for op in self.ops:
            totals[op.category] += op.ms
        return totals

    @property
    def total_ms(self) -> float:
        return sum(op.ms for op in self.ops)


def _profiled_call(call: Callable[[], object], activities: List[ProfilerActivity],
                   device: str) -> Dict[str, Tuple[float, int]]:
    """One profiled call -> {op or kernel name: (microseconds, calls)}: kernels' device time on CUDA (not the ops
    that launched them, which would count it twice), ops' self time on a CPU."""
    on_cuda = str(device).startswith('cuda')
    synchronize(device)
    with profile(activities=activities) as prof:
        call()
        synchronize(device)
    times = {}
    for event in prof.key_averages():
        if on_cuda and event.device_type != DeviceType.CUDA:
            continue
        us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
        if us > 0:
            times[event.key] = (us, event.count)
    return times


def profile_steps(calls: Dict[str, Callable[[], object]], steps: int, device: str) -> Dict[str, StepProfile]:
    """Profile ``steps`` calls of each function (warmed up already: compiled ones compiled) -> a StepProfile per
    name. One call of each function per round, each call its own profiler session, so that the machine's drift hits
    the functions alike and each one's ops are its own."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    activities = [ProfilerActivity.CPU]
    if str(device).startswith('cuda'):
        activities.append(ProfilerActivity.CUDA)
    totals: Dict[str, Dict[str, List[float]]] = {name: {} for name in calls}
    for _ in range(steps):
        for name, call in calls.items():
            for key, (us, count) in _profiled_call(call, activities, device).items():
                total = totals[name].setdefault(key, [0.0, 0.0])
                total[0] += us
                total[1] += count
    return {name: StepProfile(sorted((OpTime(key, categorize(key), us / 1e3 / steps, count / steps)
                                      for key, (us, count) in ops_us.items()), key=lambda op: op.ms, reverse=True))
            for name, ops_us in totals.items()}


def format_profile(profiles: Dict[str, StepProfile], top: int = 10, base: Sequence[str] = ('linvit', 'floor')
                   ) -> List[str]:
    """Lines: ms per step by category for each profiled model (and the first of ``base`` minus the second, where
    both were profiled), then the ``top`` ops of the first model."""
    names = list(profiles)
    first, second = base
    diff = first in profiles and second in profiles
    header = f"{'category':<18}" + ''.join(f"{name + ' ms':>14}" for name in names)
    header += f"{first + '-' + second:>16}" if diff else ''
    lines = [header]
    by_category = {name: {**p.by_category, 'total': p.total_ms} for name, p in profiles.items()}
    for category in (*CATEGORIES, 'total'):
        ms = {name: by_category[name][category] for name in names}
        line = f"{category:<18}" + ''.join(f"{ms[name]:>14.2f}" for name in names)
        lines.append(line + (f"{ms[first] - ms[second]:>+16.2f}" if diff else ''))
    lead = names[0]
    lines.append(f"top {top} ops of {lead} (ms per step, calls per step, category):")
    for op in profiles[lead].ops[:top]:
        lines.append(f"  {op.ms:9.3f} {op.calls:7.1f}  {op.category:<17} {op.name[:100]}")
    return lines
