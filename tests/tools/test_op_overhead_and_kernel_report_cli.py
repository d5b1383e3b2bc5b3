"""tools/bench_op_overhead.py runs and prints its table, and its reference Function computes what the op computes (the
float64 quadratic formula, gradients too); tools/kernel_report.py refuses the Triton interpreter (its table is
checked in tests/ops/test_triton_compile.py, by the interpreter that compiles the kernels)."""
import torch
from conftest import load_tool
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


def test_kernel_report_tool_refuses_the_triton_interpreter(capsys, monkeypatch):
    """The interpreter compiles nothing: with TRITON_INTERPRET=1 the tool says so and exits 2 before compiling."""
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    assert load_tool('kernel_report').main(['--targets', '90', '--widths', '64', '--dtypes', 'bfloat16']) == 2
    captured = capsys.readouterr()
    assert 'unset TRITON_INTERPRET' in captured.err and captured.out == ''
