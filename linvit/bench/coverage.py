"""Which timm ViTs ``convert_to_linear`` converts: every model of timm's ViT families, built at tiny depth with
random weights, converted, loaded with its own softmax checkpoint and run (what ``tools/vit_coverage.py`` prints and
writes into docs/models.md).

Per model (``ModelRow``): whether it builds at tiny depth; ``converts`` (``convert_to_linear`` succeeds, the state
dict keeps its keys and the softmax state dict loads strictly into the converted model); ``runs`` (the converted
model's forward on a random image is finite). A refusal or failure keeps the first line of its error (the reason).
Per family (a timm module, ``FamilyRow``): the counts, and the family checks (``torch.compile(fullgraph=True)``
through ``linvit.fast.compile_model`` matching eager; the caller's ONNX check) on one representative, the converted
model with the fewest parameters at tiny depth.

    families, models = survey(['deit', 'eva'], family_checks={'compiles': compiles})
    print(markdown(families))

Why the models are built the way they are: building a timm model on the CPU spends most of its time drawing its
initial weights (0.4 s for a depth-1 ViT-B), which would make a survey of ~390 models take minutes. So each model
is built on the meta device (shapes only, 0.03 s), materialised on the CPU with ``to_empty``, its computed buffers
recomputed by timm (``reinit_non_persistent_buffers``: rotary frequencies, position indices), its normalisation
statistics reset, and every parameter and other buffer filled from one seeded table of Gaussian noise (std 0.02),
tiled. Conversion and the checks only need finite, deterministic values, not timm's initialisation. On the meta device
timm's initialisers still cost most of a build (``trunc_normal_``'s ``clamp_`` and ``erfinv_`` go through PyTorch's
Python reference decompositions, 0.05 s a model), though a meta tensor holds no values for them to write: the build
skips those value-only in-place calls (``_MetaInitSkipped``).

The ONNX check lives with the caller (``tools/vit_coverage.py``): ``linvit.export`` sits above ``linvit.bench`` in the
import layers, so this module takes family checks as callables instead of importing it.
"""
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import timm
import torch
import torch.nn as nn
from timm.models._manipulate import reinit_non_persistent_buffers

from ..fast import compile_model, retain_freed_memory
from ..models import convert_to_linear
from .tables import md_table

__all__ = ['FAMILIES', 'TINY_DEPTH', 'TINY_IMG_SIZE', 'PER_BLOCK_KWARGS', 'TOLERANCE', 'COLUMNS', 'ModelRow',
           'FamilyRow', 'FamilyCheck', 'family_models', 'build_tiny', 'check_model', 'check_family', 'survey',
           'compiles', 'cells', 'markdown', 'parse_markdown', 'replace_block', 'read_block', 'DOCS_START', 'DOCS_END']

#: the timm modules surveyed: the plain ViTs (one stack of global-attention blocks over patch tokens) and their
#: close variants; hierarchical or windowed backbones (Swin, Hiera, MViT, ...) are not ViTs convert_to_linear targets
FAMILIES = ('vision_transformer', 'deit', 'eva', 'beit', 'vision_transformer_sam', 'vision_transformer_relpos',
            'vision_transformer_hybrid', 'naflexvit', 'cait', 'xcit', 'convit', 'crossvit', 'tnt', 'deepseek_vit',
            'gemma4_vit', 'qwen3_vit')
TINY_DEPTH = 1
TINY_IMG_SIZE = 64
#: constructor arguments some timm models take as one entry per block, and where a built block keeps its entry:
#: when a model does not build at tiny depth, its full-depth model is built on the meta device and these are passed
#: with the entries of blocks spread evenly over the depth, each in the middle of its share (Sapiens2's grouped
#: key/value heads: full heads in the first and last blocks, grouped ones between)
PER_BLOCK_KWARGS = {'num_kv_heads': 'attn.num_kv_heads'}
#: the largest max |compiled - eager| / max |eager| the compile check accepts (ONNX uses linvit.export's own)
TOLERANCE = 1e-4
#: the table's columns, in order
COLUMNS = ('family', 'models', 'converts', 'runs', 'checked on', 'compiles', 'ONNX', 'why not')
DOCS_START = '<!-- coverage:start -->'
DOCS_END = '<!-- coverage:end -->'

#: a family check: raises (with a one-line reason first) unless the converted model passes, given a random batch
FamilyCheck = Callable[[nn.Module, torch.Tensor], None]

_NOISE_SIZE = 1_000_003  # prime, so that the tiling does not line up with rows of any width
_noise: Optional[torch.Tensor] = None


@dataclass
class ModelRow:
    """One model's result. ``reason``: the first line of the error that stopped it (None when it converts and runs)."""
    name: str
    family: str
    built: bool = False
    converts: bool = False
    runs: bool = False
    params: int = 0
    reason: Optional[str] = None


@dataclass
class FamilyRow:
    """One timm module's counts, its representative and the family checks' cells ('yes', 'no: <reason>', '-')."""
    family: str
    models: int = 0
    converts: int = 0
    runs: int = 0
    representative: Optional[str] = None
    checks: Dict[str, str] = field(default_factory=dict)
    reasons: Dict[str, int] = field(default_factory=dict)


def first_line(error: BaseException) -> str:
    """The reason an error gives: its message's first line (ValueError is convert_to_linear's refusal; other types
    are named, since they are not a documented refusal)."""
    lines = str(error).strip().splitlines()
    text = lines[0].strip() if lines else ''
    if isinstance(error, ValueError):
        return text or 'ValueError'
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def family_models(family: str) -> List[str]:
    """The timm model names of one timm module, sorted."""
    return sorted(timm.list_models(module=family))


# ---------------------------------------------------------------------------------------------------- building

def _noise_table() -> torch.Tensor:
    """The seeded Gaussian values (std 0.02) every materialised model is filled from, made once per process."""
    global _noise
    if _noise is None:
        _noise = torch.randn(_NOISE_SIZE, generator=torch.Generator().manual_seed(0)) * 0.02
    return _noise


def _fill(tensor: torch.Tensor, offset: int) -> None:
    """Fill ``tensor`` with the noise table tiled from ``offset``: copies only, ~50x faster than timm's initialisers."""
    noise, flat = _noise_table(), tensor.view(-1)
    start = offset % noise.numel()
    done = 0
    while done < flat.numel():
        count = min(noise.numel() - start, flat.numel() - done)
        flat[done:done + count].copy_(noise[start:start + count])
        done, start = done + count, 0


def materialise(model: nn.Module) -> nn.Module:
    """A meta-device model on the CPU with deterministic random weights (see the module docstring)."""
    model.to_empty(device='cpu')
    reinit_non_persistent_buffers(model)
    stats = set()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            module.reset_running_stats()  # a random running variance could be negative
            stats.update(id(t) for t in (module.running_mean, module.running_var, module.num_batches_tracked))
    persistent = set(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for index, (name, tensor) in enumerate(model.state_dict(keep_vars=True).items()):
            if id(tensor) in stats or name not in persistent:
                continue
            if tensor.is_floating_point():
                _fill(tensor, index * 7919)
            else:
                tensor.zero_()
    return model


#: in-place tensor methods that write values and keep the shape: on a meta tensor they do nothing but cost time
_VALUE_ONLY_INPLACE = frozenset({'normal_', 'uniform_', 'trunc_normal_', 'clamp_', 'clamp_min_', 'clamp_max_',
                                 'erfinv_', 'mul_', 'add_', 'sub_', 'div_', 'zero_', 'fill_', 'copy_', 'exponential_',
                                 'log_normal_', 'bernoulli_', 'random_', 'sqrt_', 'exp_', 'neg_', 'abs_'})


class _MetaInitSkipped(torch.overrides.TorchFunctionMode):
    """Value-only in-place calls on meta tensors return their tensor unchanged (what they would leave on the meta
    device anyway) without running PyTorch's decompositions; every other call runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, '__name__', '')
        if name in _VALUE_ONLY_INPLACE and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]
        return func(*args, **(kwargs or {}))


def _create_on_meta(name: str, **kwargs) -> nn.Module:
    """``timm.create_model(name, device='meta', **kwargs)`` without running its initialisers' arithmetic."""
    with _MetaInitSkipped():
        return timm.create_model(name, device='meta', **kwargs)


def _block_entries(name: str, depth: int, img_size: int) -> Dict[str, tuple]:
    """The PER_BLOCK_KWARGS of ``name``'s full-depth model (built on the meta device), at ``depth`` evenly spaced
    blocks; {} when its blocks have none of them."""
    full = _create_on_meta(name, img_size=img_size)
    blocks = list(getattr(full, 'blocks', ()))
    picked = [blocks[(2 * i + 1) * len(blocks) // (2 * depth)] for i in range(depth)] if len(blocks) >= depth else []
    found = {}
    for kwarg, path in PER_BLOCK_KWARGS.items():
        try:
            found[kwarg] = tuple(_attribute(block, path) for block in picked)
        except AttributeError:
            continue
    return {k: v for k, v in found.items() if v}


def _attribute(obj: object, path: str) -> object:
    for part in path.split('.'):
        obj = getattr(obj, part)
    return obj


def _create(name: str, depth: int, img_size: int) -> nn.Module:
    """timm's ``name`` on the meta device at ``depth``, with the per-block arguments of its full model when it does
    not build otherwise (the first error is raised if that does not help either)."""
    try:
        return _create_on_meta(name, depth=depth, img_size=img_size)
    except Exception as error:
        entries = _block_entries(name, depth, img_size)
        if not entries:
            raise
        try:
            return _create_on_meta(name, depth=depth, img_size=img_size, **entries)
        except Exception:
            raise error from None


def _patch_embed(model: nn.Module) -> Optional[nn.Module]:
    """The model's patch embedding: its first module called ``patch_embed`` (some sit inside an ``encoder``)."""
    return next((module for path, module in model.named_modules() if path.rsplit('.', 1)[-1] == 'patch_embed'), None)


def _patch_multiple(model: nn.Module, img_size: int) -> int:
    """``img_size`` rounded to the model's patch size (a patch-14 model cannot take 64 px), at least two patches."""
    patch = getattr(_patch_embed(model), 'patch_size', None)
    patch = patch[0] if isinstance(patch, (tuple, list)) else patch
    if not isinstance(patch, int) or patch <= 0 or img_size % patch == 0:
        return img_size
    return max(2, round(img_size / patch)) * patch


def build_tiny(name: str, depth: int = TINY_DEPTH, img_size: int = TINY_IMG_SIZE) -> nn.Module:
    """timm's ``name`` with ``depth`` blocks at ``img_size`` (rounded to its patch size), random weights, eval mode."""
    model = _create(name, depth, img_size)
    fitted = _patch_multiple(model, img_size)
    if fitted != img_size:
        model = _create(name, depth, fitted)
    return materialise(model).eval()


def _images(model: nn.Module, img_size: int, batch: int = 1) -> torch.Tensor:
    """A seeded random batch at the model's input size (its img_size, or ``img_size`` without one)."""
    size = getattr(_patch_embed(model), 'img_size', None) or (img_size, img_size)
    size = (size, size) if isinstance(size, int) else tuple(size)
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(0))


def _outputs(value: object) -> List[torch.Tensor]:
    """The tensors of a forward's output (a tensor, or a tuple / list / dict of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _outputs(item)]
    return []


# ---------------------------------------------------------------------------------------------------- checks

def _convert_and_load(model: nn.Module) -> None:
    """convert_to_linear, then the keys stay and the softmax state dict (taken before) loads strictly. It is loaded
    with ``assign=True``: the same key and shape checks as a copy, without copying a 3B model's weights onto
    themselves (conversion keeps every tensor, so they are the same tensors)."""
    softmax_state = model.state_dict()
    convert_to_linear(model)
    keys = set(model.state_dict())
    if keys != set(softmax_state):
        changed = sorted(keys ^ set(softmax_state))
        raise ValueError(f"the converted state dict has other keys: {len(changed)} differ, e.g. {changed[0]}")
    model.load_state_dict(softmax_state, strict=True, assign=True)


def _run(model: nn.Module, img_size: int) -> None:
    """A forward on a random image; ValueError unless every output is finite."""
    with torch.no_grad():
        outputs = _outputs(model(_images(model, img_size)))
    if not outputs or not all(bool(torch.isfinite(t).all()) for t in outputs if t.is_floating_point()):
        raise ValueError("the converted model's output is not finite")


def check_model(name: str, family: str, depth: int = TINY_DEPTH,
                img_size: int = TINY_IMG_SIZE) -> Tuple[ModelRow, Optional[nn.Module]]:
    """One model's row, and the converted model when it converts and runs (else None)."""
    row = ModelRow(name, family)
    try:
        model = build_tiny(name, depth, img_size)
    except Exception as error:  # any failure to build is a row with its reason, never a skipped model
        row.reason = f"does not build at tiny depth: {first_line(error)}"
        return row, None
    row.built, row.params = True, sum(p.numel() for p in model.parameters())
    try:
        _convert_and_load(model)
    except Exception as error:
        row.reason = first_line(error)
        return row, None
    row.converts = True
    try:
        _run(model, img_size)
    except Exception as error:
        row.reason = f"does not run: {first_line(error)}"
        return row, None
    row.runs = True
    return row, model


def compiles(model: nn.Module, images: torch.Tensor) -> None:
    """``linvit.fast.compile_model`` (torch.compile, fullgraph=True, inductor) runs ``images`` and matches eager
    within TOLERANCE (max abs error over the largest eager value); raises otherwise."""
    with torch.no_grad():
        want = _outputs(model(images))
        got = _outputs(compile_model(model, retain_freed_memory=False)(images))
    torch._dynamo.reset()  # the next family's graphs should not count against this one's recompile limit
    for reference, value in zip(want, got):
        error = float((value - reference).abs().max() / reference.abs().max().clamp_min(1e-12))
        if error > TOLERANCE:
            raise ValueError(f"compiled output differs from eager: max_rel {error:.1e} > {TOLERANCE:.0e}")


def _run_check(check: FamilyCheck, model: nn.Module, images: torch.Tensor) -> str:
    try:
        check(model, images)
    except Exception as error:  # a failed check is a cell with its reason
        return f"no: {first_line(error)}"
    return 'yes'


def check_family(family: str, depth: int = TINY_DEPTH, img_size: int = TINY_IMG_SIZE,
                 family_checks: Optional[Dict[str, FamilyCheck]] = None,
                 names: Optional[Sequence[str]] = None) -> Tuple[FamilyRow, List[ModelRow]]:
    """Every model of one timm module (or ``names`` of it), then the family checks on its representative."""
    rows = [check_model(name, family, depth, img_size)[0] for name in (names or family_models(family))]
    result = FamilyRow(family, models=len(rows), converts=sum(r.converts for r in rows), runs=sum(r.runs for r in rows),
                       reasons=dict(Counter(r.reason for r in rows if r.reason)))
    working = [r for r in rows if r.runs]
    if working:
        result.representative = min(working, key=lambda r: (r.params, r.name)).name
    for column, check in (family_checks or {}).items():
        if result.representative is None:
            result.checks[column] = '-'
            continue
        _, model = check_model(result.representative, family, depth, img_size)
        result.checks[column] = _run_check(check, model, _images(model, img_size, batch=2))
    return result, rows


def survey(families: Iterable[str] = FAMILIES, depth: int = TINY_DEPTH, img_size: int = TINY_IMG_SIZE,
           family_checks: Optional[Dict[str, FamilyCheck]] = None,
           on_family: Optional[Callable[[FamilyRow], None]] = None) -> Tuple[List[FamilyRow], List[ModelRow]]:
    """``check_family`` for each family; ``on_family`` sees each family's row as it is done (progress).

    Makes glibc keep freed memory in the process (``linvit.fast.retain_freed_memory``, process-wide): every model
    allocates and frees its weights once, and returning them to the system made each next model fault its pages in
    afresh (a survey took ~25% longer)."""
    retain_freed_memory()
    family_rows, model_rows = [], []
    for family in families:
        row, rows = check_family(family, depth, img_size, family_checks)
        family_rows.append(row)
        model_rows.extend(rows)
        if on_family is not None:
            on_family(row)
    return family_rows, model_rows


# ---------------------------------------------------------------------------------------------------- the table

def _escape(text: str) -> str:
    return text.replace('|', '\\|')


def cells(row: FamilyRow) -> Dict[str, str]:
    """The table cells of one family, by COLUMNS name ('-' for a check that was not run or had no model)."""
    reasons = sorted(row.reasons.items(), key=lambda item: (-item[1], item[0]))
    return {
        'family': f"`{row.family}`",
        'models': str(row.models),
        'converts': f"{row.converts}/{row.models}",
        'runs': f"{row.runs}/{row.models}",
        'checked on': f"`{row.representative}`" if row.representative else '-',
        'compiles': row.checks.get('compiles', '-'),
        'ONNX': row.checks.get('ONNX', '-'),
        'why not': '<br>'.join(f"{count} x {reason}" for reason, count in reasons) or '-',
    }


def markdown(rows: Sequence[FamilyRow]) -> str:
    """The coverage table: one line per family, COLUMNS."""
    return '\n'.join(md_table(COLUMNS, [[_escape(cells(row)[column]) for column in COLUMNS] for row in rows]))


def parse_markdown(table: str) -> Dict[str, Dict[str, str]]:
    """The cells of a coverage table by family name, as ``cells`` gives them (to check a written table)."""
    lines = [line.strip() for line in table.strip().splitlines() if line.strip().startswith('|')]
    if len(lines) < 2:
        raise ValueError("no markdown table found")
    split = [[cell.strip().replace('\\|', '|') for cell in re.split(r'(?<!\\)\|', line)[1:-1]] for line in lines]
    header, body = split[0], split[2:]
    return {row['family'].strip('`'): row for row in (dict(zip(header, values)) for values in body)}


def _markers(text: str) -> Tuple[int, int]:
    start, end = text.find(DOCS_START), text.find(DOCS_END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {DOCS_START} ... {DOCS_END} block")
    return start + len(DOCS_START), end


def read_block(text: str) -> str:
    """The text between the coverage markers of a page."""
    start, end = _markers(text)
    return text[start:end].strip()


def replace_block(text: str, table: str) -> str:
    """``text`` with the coverage block replaced by ``table``."""
    start, end = _markers(text)
    return f"{text[:start]}\n{table}\n{text[end:]}"

