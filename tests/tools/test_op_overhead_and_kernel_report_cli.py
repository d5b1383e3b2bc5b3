"""tools/bench_op_overhead.py and tools/kernel_report.py run and print their tables; the overhead tool's reference
Function computes what the op computes (the float64 quadratic formula, gradients too)."""
import os
import subprocess
import sys

import pytest
import torch
from conftest import TOOLS_DIR, load_tool
from references import rel_err

from linvit.bench.op_overhead import PlainFunction
from linvit.ops import quadratic_linear_attention


def test_the_plain_reference_function_is_linear_attention():
    qkv = torch.randn(2, 21, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 21, 2, 8, dtype=torch.float64)
    out = PlainFunction.apply(qkv)
    (got,) = torch.autograd.grad(out, qkv, grad)
    ref_in = qkv.detach().clone().requires_grad_()
    q, k, v = ref_in.permute(2, 0, 3, 1, 4).unbind(0)
    ref = quadratic_linear_attention(q, k, v).transpose(1, 2)
    (want,) = torch.autograd.grad(ref, ref_in, grad)
    assert rel_err(out, ref) < 1e-10 and rel_err(got, want) < 1e-10


def test_op_overhead_tool_prints_its_table(capsys):
    tool = load_tool('bench_op_overhead')
    assert tool.main(['--tokens', '8', '32', '--repeats', '5', '--warmup', '2']) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith('# ')]  # a busy machine
    assert lines[0].startswith('| tokens | plain Function us | op us | op / plain')
    rows = [line.split('|')[1:-1] for line in lines[2:]]
    assert [int(r[0]) for r in rows] == [8, 32]
    for r in rows:
        plain, op, ratio = float(r[1]), float(r[2]), float(r[3])
        assert plain > 0 and op > 0 and abs(ratio - op / plain) < 0.01 * ratio + 0.01
        assert r[6].strip() == '-'  # no GPU kernels on a CPU


@pytest.mark.integration
def test_kernel_report_tool_prints_registers_spills_and_dot_types():
    env = {**os.environ, 'TRITON_INTERPRET': '0'}
    command = [sys.executable, str(TOOLS_DIR / 'kernel_report.py'), '--targets', '90', '--widths', '64',
               '--dtypes', 'bfloat16']
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith('| sm_90')]
    assert sorted(r.split('|')[2].strip() for r in rows) == ['_grad_key', '_grad_query', '_key_pass', '_query_pass']
    assert all(r.split('|')[10].strip() == 'bf16' for r in rows)
    assert '4 variants; 0 spill' in result.stdout
    refused = subprocess.run(command, capture_output=True, text=True, env={**env, 'TRITON_INTERPRET': '1'})
    assert refused.returncode == 2 and 'unset TRITON_INTERPRET' in refused.stderr
