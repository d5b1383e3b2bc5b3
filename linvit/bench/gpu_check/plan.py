"""What the GPU check runs: its settings, the presets (full for a GPU, quick for a CPU) and the plan of each section,
one case per row. The parent process and each section's process read the same plan, so a row the section did not
report is known by its key.
"""
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from linvit.precision import PRECISIONS

from ..specs import WORKLOADS

__all__ = ['SECTIONS', 'LINVIT_KERNELS', 'TOLERANCES', 'FEATURE_MAP', 'EPS', 'REPORT_RESERVE_S', 'RESULT_MARK',
           'SKIPPED', 'MODEL_LABELS', 'KINDS', 'TORCH_PATH', 'COMPILE_BACKENDS', 'CheckSettings',
           'Preset', 'FULL', 'QUICK', 'ParityCase', 'OpCase', 'ModelCase', 'plan_parity', 'plan_op', 'plan_models',
           'plan_keys']

SECTIONS = ('parity', 'op', 'models')  # the report's order, and what runs without --sections
#: the Triton kernels a compiled linvit step must launch, per workload (their absence is a silent fallback: a FAIL)
LINVIT_KERNELS = {'training': ('_key_pass', '_query_pass', '_grad_query', '_grad_key'),
                  'inference': ('_key_pass', '_query_pass')}
# relative max error allowed against float64, per input precision (outputs and gradients alike)
TOLERANCES = {'float32': 1e-4, 'bfloat16': 2e-2, 'float16': 5e-3}
FEATURE_MAP, EPS = 'elu1', 1e-6
REPORT_RESERVE_S = 8.0   # kept at the end: the last section's kill grace, then the tables and the plot
RESULT_MARK = 'GPU_CHECK_RESULT '  # starts a section's result line on its stdout
SKIPPED = 'skipped (time budget)'
MODEL_LABELS = {'small': 'ViT-S', 'base': 'ViT-B'}
KINDS = ('linvit', 'softmax', 'floor')   # measured in this order at each (model, size, workload)
TORCH_PATH = 'linvit_torch'              # linvit with attn_backend='torch', measured last
COMPILE_BACKENDS = ('inductor', 'aot_eager', 'eager')


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
    """Forward, then forward+backward, at each token count, smallest first."""
    return [OpCase(n, backward) for n in preset.op_tokens for backward in (False, True)]


def plan_models(preset: Preset) -> List[ModelCase]:
    """linvit, softmax, floor; in WORKLOADS' order (training first); at each (model size, px) in priority order.
    Last: linvit on the PyTorch path (attn_backend='torch') at the first (most important) size."""
    cases = [ModelCase(size, px, workload, kind, preset.batches[size][px])
             for size, px in preset.models for workload in WORKLOADS for kind in KINDS]
    size, px = preset.models[0]
    return cases + [ModelCase(size, px, workload, TORCH_PATH, preset.batches[size][px]) for workload in WORKLOADS]


def plan_keys(section: str, preset: Preset) -> List[str]:
    """The keys of a section's planned rows, in the order it measures them."""
    if section == 'parity':
        return [case.key for case in plan_parity(preset)]
    if section == 'op':
        return [case.key for case in plan_op(preset)]
    return [case.key for case in plan_models(preset)]
