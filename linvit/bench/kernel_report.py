"""What the Triton kernels of ``linvit.ops.linear_attn.kernels`` compile to on real GPUs, found without one.

Every kernel variant (head width x input dtype, the launch options ``launch_meta`` gives) is compiled ahead of time
for a target (sm_90 Hopper, sm_80 Ampere) by the installed Triton; ptxas (Triton's own) reports the registers a
thread needs, the bytes spilled to local memory and the shared memory a block needs, and the PTX names the dot
instructions' operand types (``mma`` / ``wgmma`` on bf16 or f16 for half inputs, where tf32 would mean the operands
stayed float32). ``bytes_per_token`` is what each pass moves through global memory per token and head: the figure
to hold a measured kernel time against the memory bandwidth.

    rows = report(targets=(90, 80), widths=(64, 128), dtypes=('bfloat16',))

Run it without ``TRITON_INTERPRET=1`` (the interpreter compiles nothing); ``tools/kernel_report.py`` prints the
table.
"""
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence, Tuple

import torch

__all__ = ['KernelRow', 'bytes_per_token', 'compile_variant', 'dot_operand_types', 'ptxas_usage', 'report',
           'variants']

#: Triton's names for the dtypes of the inputs
TRITON_DTYPES = {'float32': 'fp32', 'bfloat16': 'bf16', 'float16': 'fp16'}
# the pointers each kernel reads or writes in the inputs' dtype (the others are float32 buffers)
_INPUT_POINTERS = {'_key_pass': ('k_ptr', 'v_ptr'), '_query_pass': ('q_ptr', 'out_ptr'),
                   '_grad_query': ('q_ptr', 'g_ptr', 'dq_ptr'),
                   '_grad_key': ('k_ptr', 'v_ptr', 'dk_ptr', 'dv_ptr')}
_FLOAT_ARGS = ('eps_count', 'inv_n')
# the tile-size parameter of each kernel, and whether it takes key weights (HAS_W)
_TILE_ARG = {'_key_pass': 'BLOCK_N', '_query_pass': 'BLOCK_M', '_grad_query': 'BLOCK_M', '_grad_key': 'BLOCK_N'}


@dataclass
class KernelRow:
    """One compiled variant: what ptxas and the PTX say about it."""
    kernel: str
    dtype: str
    width: int
    target: int
    warps: int
    stages: int
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    dots: Tuple[str, ...]
    bytes_per_token: int


def bytes_per_token(kernel: str, d: int, dv: int, dtype: str) -> int:
    """Global-memory bytes a pass moves per token of one head: its token tiles read and written (q, k, v, g in,
    out, dq, dk, dv out in the inputs' dtype; den float32). The per-head state (a few KiB) is left out."""
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    elements = {'_key_pass': d + dv, '_query_pass': d + dv, '_grad_query': d + dv + d, '_grad_key': 2 * (d + dv)}
    den_bytes = {'_key_pass': 0, '_query_pass': 4, '_grad_query': 4, '_grad_key': 0}
    return elements[kernel] * size + den_bytes[kernel]


def variants(target: int, widths: Sequence[int] = (32, 64, 128),
             dtypes: Sequence[str] = ('float32', 'bfloat16', 'float16'),
             key_weights: bool = False) -> Iterator[Tuple[object, str, Dict[str, object], Dict[str, int]]]:
    """(kernel, dtype, compile-time constants, launch options) for every kernel at head widths D = Dv = width on
    sm_<target>: the constants and options the launcher uses there (``launch_meta``), elu1's feature map, key
    weights on or off."""
    from linvit.ops.linear_attn import kernels as tk
    for width in widths:
        for dtype in dtypes:
            items, tile = tk.launch_meta(width, width, getattr(torch, dtype), 0, target >= 90)
            meta = dict(items)
            options = {'num_warps': meta.pop('num_warps'), 'num_stages': meta.pop('num_stages')}
            for kernel in tk.KERNELS:
                constants = dict(meta, **{_TILE_ARG[kernel.__name__]: tile})
                if 'HAS_W' in kernel.arg_names:
                    constants['HAS_W'] = key_weights
                yield kernel, dtype, constants, options


def _signature(kernel, dtype: str, constants: Dict[str, object]) -> Dict[str, str]:
    """Argument types as the launcher specialises them: tensors of the inputs' dtype, float32 buffers, ints."""
    types = {}
    for name in kernel.arg_names:
        if name in constants:
            types[name] = 'constexpr'
        elif name in _INPUT_POINTERS[kernel.__name__]:
            types[name] = '*' + TRITON_DTYPES[dtype]
        elif name.endswith('_ptr'):
            types[name] = '*fp32'
        else:
            types[name] = 'fp32' if name in _FLOAT_ARGS else 'i32'
    return types


def _ptxas() -> str:
    """The ptxas that Triton compiles with."""
    import triton
    try:
        return triton.knobs.nvidia.ptxas.path
    except AttributeError:  # Triton before knobs
        return os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'ptxas')


def ptxas_usage(ptx: str, target: int) -> Tuple[int, int, int]:
    """(registers per thread, spill-store bytes, spill-load bytes) that ptxas reports for the PTX on sm_<target>."""
    arch = f"sm_{target}a" if target >= 90 else f"sm_{target}"
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, 'kernel.ptx')
        with open(source, 'w') as f:
            f.write(ptx)
        result = subprocess.run([_ptxas(), '-v', f'--gpu-name={arch}', source, '-o', os.path.join(folder, 'k.cubin')],
                                capture_output=True, text=True, check=True)
    log = result.stderr + result.stdout
    registers = re.search(r'Used (\d+) registers', log)
    spills = re.search(r'(\d+) bytes spill stores, (\d+) bytes spill loads', log)
    if registers is None or spills is None:
        raise RuntimeError(f"could not read ptxas's usage report:\n{log}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


def dot_operand_types(ptx: str) -> Tuple[str, ...]:
    """The operand types of the PTX's matrix instructions (mma.sync, wgmma.mma_async), e.g. ('bf16',) or
    ('tf32',); ('fma',) when the dots became scalar multiply-adds (no matrix instruction)."""
    found = set()
    for line in ptx.splitlines():
        match = re.search(r'\b(?:wgmma\.mma_async|mma)\.\S*?\.(f32|f16)\.(bf16|f16|tf32|e4m3|e5m2)\.', line)
        if match:
            found.add(match.group(2))
    return tuple(sorted(found)) or ('fma',)


def compile_variant(kernel, dtype: str, constants: Dict[str, object], options: Dict[str, int],
                    target: int) -> KernelRow:
    """Compile one variant for sm_<target> and read its usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    positions = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    source = ASTSource(kernel, _signature(kernel, dtype, constants), constexprs=positions)
    compiled = triton.compile(source, target=GPUTarget('cuda', target, 32), options=options)
    ptx = compiled.asm['ptx']
    registers, spill_stores, spill_loads = ptxas_usage(ptx, target)
    width = int(constants['D'])
    return KernelRow(kernel.__name__, dtype, width, target, options['num_warps'], options['num_stages'], registers,
                     spill_stores, spill_loads, compiled.metadata.shared, dot_operand_types(ptx),
                     bytes_per_token(kernel.__name__, width, int(constants['DV']), dtype))


def report(targets: Sequence[int] = (90, 80), widths: Sequence[int] = (32, 64, 128),
           dtypes: Sequence[str] = ('float32', 'bfloat16', 'float16'), key_weights: bool = False) -> List[KernelRow]:
    """Every variant compiled for every target (a few seconds each on a CPU)."""
    return [compile_variant(kernel, dtype, constants, options, target)
            for target in targets
            for kernel, dtype, constants, options in variants(target, widths, dtypes, key_weights)]


def markdown(rows: Sequence[KernelRow]) -> str:
    """The rows as a markdown table."""
    lines = ['| target | kernel | dtype | D = Dv | warps | stages | registers | spill stores / loads B | shared KiB '
             '| dot operands | bytes / token |', '|' + '---|' * 11]
    for r in rows:
        lines.append(f"| sm_{r.target} | {r.kernel} | {r.dtype} | {r.width} | {r.warps} | {r.stages} | "
                     f"{r.registers} | {r.spill_stores} / {r.spill_loads} | {r.shared / 1024:.1f} | "
                     f"{', '.join(r.dots)} | {r.bytes_per_token} |")
    return '\n'.join(lines)
