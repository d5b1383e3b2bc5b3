"""The Triton kernels compile for real GPUs (Hopper sm_90 and Ampere sm_80) on a machine without one, as
``tools/kernel_report.py`` reports them: the interpreter runs the kernels' arithmetic but accepts code the compiler
rejects (types across branches, dot shapes, shared memory), and only the compiled code shows register spills and the
dots' operand types. Each variant must fit the target's shared memory per block; the half-precision variants must
run their dots on bf16 / f16 tensor-core instructions (not tf32: float32 operands) without spilling on sm_90, and on
sm_80 up to D = 64. The same interpreter runs tools/kernel_report.py's main, whose table is checked here too (its
refusal of the Triton interpreter: tests/tools/test_op_overhead_and_kernel_report_cli.py). ``make triton-compat``
runs this file with the GPU machine's Triton over every variant (``LINVIT_TRITON_COMPAT=full``); ``make test`` compiles
a representative subset, since each variant costs ~5 s of CPU to compile on a machine without Triton's cache."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts an interpreter that compiles for two GPU targets

TOOL = Path(__file__).resolve().parents[2] / 'tools' / 'kernel_report.py'

# the largest dynamic shared memory one block may use (CUDA programming guide: 227 KiB on sm_90, 163 KiB on sm_80)
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
KERNELS = {'_key_pass', '_query_pass', '_grad_query', '_grad_key'}
# (target, head widths, dtypes), each a cross product. The full plan: every width on Hopper, the common and the widest
# on Ampere (~60 s of CPU without a cache). The suite's: every dtype at the common width on Hopper, and the widest
# width, whose tiles are the ones that spill or overflow shared memory, in bfloat16 on both targets.
FULL_PLAN = ((90, (32, 64, 128), ('float32', 'bfloat16', 'float16')), (80, (64, 128), ('float32', 'bfloat16')))
SUITE_PLAN = ((90, (64,), ('float32', 'bfloat16', 'float16')), (90, (128,), ('bfloat16',)), (80, (128,), ('bfloat16',)))
PLAN = FULL_PLAN if os.environ.get('LINVIT_TRITON_COMPAT') == 'full' else SUITE_PLAN
# the one variant that still spills: sm_80's mma.sync keeps the backward query pass's D = 128 tiles in registers
SPILL_ALLOWED = {(80, 128, '_grad_query')}

# the report tool's printed table follows this line of the script's output
TOOL_MARK = '# tools/kernel_report.py'
_SCRIPT = """
import dataclasses, importlib.util, json, sys
from linvit.bench.kernel_report import report
for target, widths, dtypes in json.loads(sys.argv[1]):
    for row in report([target], widths, dtypes, key_weights=target == 90):
        print(json.dumps(dataclasses.asdict(row)), flush=True)
spec = importlib.util.spec_from_file_location('kernel_report', sys.argv[2])
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
print(sys.argv[3], flush=True)
sys.exit(tool.main(['--targets', '90', '--widths', '64', '--dtypes', 'bfloat16']))
"""


@pytest.fixture(scope='module')
def run():
    """(the compiled variants' records, what tools/kernel_report.py printed for sm_90, D = 64, bfloat16): one
    interpreter for both (~5 s of CPU each to import torch and Triton)."""
    env = {**os.environ, 'TRITON_INTERPRET': '0'}  # the interpreter compiles nothing; the flag is read on import
    result = subprocess.run([sys.executable, '-c', _SCRIPT, json.dumps(PLAN), str(TOOL), TOOL_MARK],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    records, printed = result.stdout.split(TOOL_MARK + '\n')
    return [json.loads(line) for line in records.splitlines() if line.startswith('{')], printed


@pytest.fixture(scope='module')
def compiled(run):
    return run[0]


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


def test_kernel_report_tool_prints_registers_spills_and_dot_types(run):
    _, printed = run
    rows = [line for line in printed.splitlines() if line.startswith('| sm_90')]
    assert sorted(r.split('|')[2].strip() for r in rows) == ['_grad_key', '_grad_query', '_key_pass', '_query_pass']
    assert all(r.split('|')[10].strip() == 'bf16' for r in rows)
    assert '4 variants; 0 spill' in printed
