"""The Triton kernels compile for real GPUs (Hopper sm_90 and Ampere sm_80) on a machine without one, as
``tools/kernel_report.py`` reports them: the interpreter runs the kernels' arithmetic but accepts code the compiler
rejects (types across branches, dot shapes, shared memory), and only the compiled code shows register spills and the
dots' operand types. Each variant must fit the target's shared memory per block; the half-precision variants must
run their dots on bf16 / f16 tensor-core instructions (not tf32: float32 operands) without spilling on sm_90, and on
sm_80 up to D = 64. ``make triton-compat`` runs this file with the GPU machine's Triton."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # starts an interpreter that compiles for two GPU targets

# the largest dynamic shared memory one block may use (CUDA programming guide: 227 KiB on sm_90, 163 KiB on sm_80)
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
KERNELS = {'_key_pass', '_query_pass', '_grad_query', '_grad_key'}
# (target, head widths, dtypes): every width on Hopper, the common and the widest on Ampere. About 30 s on 2 cores.
PLAN = ((90, (32, 64, 128), ('float32', 'bfloat16', 'float16')), (80, (64, 128), ('float32', 'bfloat16')))
# the one variant that still spills: sm_80's mma.sync keeps the backward query pass's D = 128 tiles in registers
SPILL_ALLOWED = {(80, 128, '_grad_query')}

_SCRIPT = """
import dataclasses, json, sys
from linvit.bench.kernel_report import report
for target, widths, dtypes in json.loads(sys.argv[1]):
    for row in report([target], widths, dtypes, key_weights=target == 90):
        print(json.dumps(dataclasses.asdict(row)), flush=True)
"""


@pytest.fixture(scope='module')
def compiled():
    env = {**os.environ, 'TRITON_INTERPRET': '0'}  # the interpreter compiles nothing; the flag is read on import
    result = subprocess.run([sys.executable, '-c', _SCRIPT, json.dumps(PLAN)], capture_output=True, text=True,
                            env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{')]


def test_every_kernel_variant_compiles_for_sm90_and_sm80(compiled):
    for target, widths, dtypes in PLAN:
        for dtype in dtypes:
            for width in widths:
                got = {r['kernel'] for r in compiled if (r['target'], r['dtype'], r['width']) == (target, dtype, width)}
                assert got == KERNELS, (target, dtype, width, got)


def test_shared_memory_fits_each_target(compiled):
    for record in compiled:
        assert record['shared'] <= SHARED_LIMIT[record['target']], record


def test_half_precision_dots_run_on_half_precision_tensor_cores(compiled):
    want = {'bfloat16': ['bf16'], 'float16': ['f16']}
    for record in compiled:
        if record['dtype'] in want:
            assert record['dots'] == want[record['dtype']], record


def test_half_precision_variants_do_not_spill(compiled):
    for record in compiled:
        if record['dtype'] != 'float32' and (record['target'], record['width'], record['kernel']) not in SPILL_ALLOWED:
            assert record['spill_stores'] == 0 and record['spill_loads'] == 0, record
