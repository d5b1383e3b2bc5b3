"""Compile every linvit Triton kernel ahead of time for a GPU target, without a GPU, and print one JSON line per
kernel variant: {"kernel", "dtype", "target", "warps", "shared"} (shared memory bytes). Run without
TRITON_INTERPRET (the interpreter does not compile). Used by tests/ops/test_triton_compile.py.

    python tests/ops/compile_triton_kernels.py 90 80     # compute capabilities
"""
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from linvit.ops import triton_kernels as tk

DTYPES = {'float32': 'fp32', 'bfloat16': 'bf16', 'float16': 'fp16'}  # fp16 compiles as bf16 does: tests pick two
INPUT_POINTERS = {'_key_pass': ('k_ptr', 'v_ptr'), '_query_pass': ('q_ptr', 'out_ptr'),
                  '_grad_query': ('q_ptr', 'g_ptr', 'o_ptr', 'dq_ptr'),
                  '_grad_key': ('k_ptr', 'v_ptr', 'dk_ptr', 'dv_ptr')}


def signature(fn, dtype: str, constants: dict) -> dict:
    """Argument types as the launcher would specialise them: tensors of the inputs' dtype, float32 buffers, ints."""
    types = {}
    for name in fn.arg_names:
        if name in constants:
            types[name] = 'constexpr'
        elif name in INPUT_POINTERS[fn.__name__]:
            types[name] = '*' + dtype
        elif name.endswith('_ptr'):
            types[name] = '*fp32'
        else:
            types[name] = 'fp32' if name == 'eps_count' else 'i32'
    return types


def variants(widths=(32, 64, 128), dtypes=('fp32', 'bf16', 'fp16')):
    for width in widths:
        for dtype in dtypes:
            block = tk._block_width(width)
            base = dict(D=width, DV=width, BLOCK_D=block, BLOCK_DV=block, MAP=0 if width != 64 else 1,
                        PRECISION='ieee' if dtype == 'fp32' else 'tf32')
            tile = tk._tile_tokens(block, block)
            yield tk._key_pass, dtype, dict(base, BLOCK_N=tile, HAS_W=True), block
            yield tk._query_pass, dtype, dict(base, BLOCK_M=tile, HAS_W=width == 32), block
            yield tk._grad_query, dtype, dict(base, BLOCK_M=tile), block
            yield tk._grad_key, dtype, dict(base, BLOCK_N=tile, HAS_W=width != 32), block


def main(capabilities, widths=(32, 64, 128), dtypes=('fp32', 'bf16', 'fp16')) -> None:
    for capability in capabilities:
        target = GPUTarget('cuda', capability, 32)
        for fn, dtype, constants, block in variants(widths, dtypes):
            positions = {(fn.arg_names.index(k),): v for k, v in constants.items()}
            warps = tk._num_warps(block, block)
            options = {'num_warps': warps, 'num_stages': tk._num_stages(block, block)}
            compiled = triton.compile(ASTSource(fn, signature(fn, dtype, constants), constexprs=positions),
                                      target=target, options=options)
            print(json.dumps({'kernel': fn.__name__, 'dtype': dtype, 'width': constants['D'], 'target': capability,
                              'warps': warps, 'shared': compiled.metadata.shared}), flush=True)


if __name__ == '__main__':
    # arguments: capabilities, then optionally 'widths' and head widths, 'dtypes' and dtypes (fp32 bf16 fp16)
    args = sys.argv[1:]
    groups = {'widths': [], 'dtypes': []}
    capabilities, current = [], None
    for arg in args:
        if arg in groups:
            current = groups[arg]
        elif current is None:
            capabilities.append(int(arg))
        else:
            current.append(arg)
    main(capabilities or [90], tuple(int(w) for w in groups['widths']) or (32, 64, 128),
         tuple(groups['dtypes']) or ('fp32', 'bf16', 'fp16'))
