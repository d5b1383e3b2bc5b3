"""The Triton kernels compile for real GPUs (Hopper sm_90 and Ampere sm_80) on a machine without one: the
interpreter runs the kernels' arithmetic but accepts code the compiler rejects (types across branches, dot shapes,
shared memory). Each variant must fit the target's shared memory per block."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the largest dynamic shared memory one block may use (CUDA programming guide: 227 KiB on sm_90, 163 KiB on sm_80)
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


# (target, head widths): every width on Hopper, the widest (most shared memory) on Ampere; float32 and bfloat16
# (float16 compiles through the same code as bfloat16). About a minute on 2 cores.
PLAN = ((90, (32, 128)), (80, (128,)))
DTYPES = ('fp32', 'bf16')


def _compile(target: int, widths) -> list:
    env = {**os.environ, 'TRITON_INTERPRET': '0'}
    script = Path(__file__).with_name('compile_triton_kernels.py')
    command = [sys.executable, str(script), str(target), 'widths', *map(str, widths), 'dtypes', *DTYPES]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{')]


@pytest.fixture(scope='module')
def compiled():
    return [record for target, widths in PLAN for record in _compile(target, widths)]


def test_every_kernel_variant_compiles_for_sm90_and_sm80(compiled):
    kernels = {'_key_pass', '_query_pass', '_grad_query', '_grad_key'}
    for target, widths in PLAN:
        for dtype in DTYPES:
            for width in widths:
                got = {r['kernel'] for r in compiled if (r['target'], r['dtype'], r['width']) == (target, dtype, width)}
                assert got == kernels, (target, dtype, width, got)


def test_shared_memory_fits_each_target(compiled):
    for record in compiled:
        assert record['shared'] <= SHARED_LIMIT[record['target']], record
