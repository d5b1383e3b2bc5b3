"""tools/bench_distributed.py (linvit.bench.distributed) on a tiny model: one run of its main over context 1 and 2 and
DDP against FSDP2 at two gloo ranks, whose counted bytes are checked against formulas written out here, not read
from the library. The ranks are forked from this process rather than spawned: what is counted (saved tensors,
collectives, optimizer state) does not depend on how a rank's interpreter started, and each of the 7 spawned ranks
spent ~5 s of CPU importing torch, timm and linvit again."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from linvit.bench.distributed import ring_kv_bytes, state_allreduce_bytes

TOOL = Path(__file__).resolve().parents[2] / 'tools' / 'bench_distributed.py'
# linvit-Tiny widths: 3 heads of 64; 2 blocks; 64 px in patches of 8: an 8 x 8 grid and the class token
HEADS, HEAD_DIM, DEPTH, WIDTH, GRID, TOKENS = 3, 64, 2, 192, 8, 8 * 8 + 1
MODEL = f'linvit_tiny_patch16_224:depth={DEPTH},patch_size=8'


def _tool():
    spec = importlib.util.spec_from_file_location('bench_distributed', TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _forked(fn, args=(), nprocs=1, join=True, daemon=False, start_method='spawn'):
    """torch.multiprocessing.spawn with forked processes: they start with torch and linvit imported."""
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, daemon=daemon, start_method='fork')


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    """(printed text, {(sweep, context, sync): [rows by rank]}) of one tiny run."""
    out = tmp_path_factory.mktemp('dist') / 'rows.json'
    capture = pytest.MonkeyPatch()
    lines = []
    capture.setattr('builtins.print', lambda *a, **k: lines.append(' '.join(map(str, a))))
    capture.setattr(mp, 'spawn', _forked)
    try:
        code = _tool().main(['--model', MODEL, '--img-size', '64', '--context', '1', '2', '--sync', 'ddp', 'fsdp',
                             '--softmax', 'none', '--steps', '1', '--threads', '1', '--json', str(out)])
    finally:
        capture.undo()
    assert code == 0, '\n'.join(lines)
    rows = {}
    for row in json.loads(out.read_text()):
        rows.setdefault((row['sweep'], row['context'], row['sync']), []).append(row)
    return '\n'.join(lines), rows


def test_the_state_all_reduce_is_one_state_each_way_per_layer(run):
    _, rows = run
    # [B, H, Dv + 1, D] float32 sums and [B, H] counts, all-reduced once forward and once backward
    per_direction = (1 * HEADS * (HEAD_DIM + 1) * HEAD_DIM + 1 * HEADS) * 4
    assert state_allreduce_bytes(1, HEADS, HEAD_DIM) == 2 * per_direction
    for row in rows[('context', 2, 'ddp')]:
        state = row['comm']['state']
        assert state['forward_calls'] == state['backward_calls'] == DEPTH
        assert state['payload'] == DEPTH * 2 * per_direction
    assert rows[('context', 1, 'none')][0]['comm'] == {}  # one process: no collective at all


def test_each_rank_sends_one_halo_row_per_layer_each_way(run):
    _, rows = run
    # two ranks of 4 patch rows, the 3 x 3 local mix: one row of 8 patches x 192 floats to the neighbour forward,
    # and the gradient of the row received back in the backward
    for row in rows[('context', 2, 'ddp')]:
        assert row['comm']['halo']['payload'] == DEPTH * 2 * GRID * WIDTH * 4
        assert set(row['comm']) == {'state', 'halo', 'pool', 'grads'}


def test_context_2_saves_less_for_backward_per_rank_than_one_process(run):
    _, rows = run
    one = rows[('context', 1, 'none')][0]['act_mib']
    assert all(0 < row['act_mib'] < one for row in rows[('context', 2, 'ddp')])


def test_ring_attention_bytes_follow_the_kv_formula(run):
    text, _ = run
    # K and V of this rank's 65 / 2 tokens, 3 heads of 64 floats, passed on once (context - 1); backward: K, V, dK, dV
    forward = 1 * 2 * 1 * (TOKENS / 2) * HEADS * HEAD_DIM * 4
    assert ring_kv_bytes(2, 1, TOKENS, HEADS, HEAD_DIM) == 3 * forward
    assert ring_kv_bytes(1, 1, TOKENS, HEADS, HEAD_DIM) == 0
    assert ring_kv_bytes(4, 2, TOKENS, HEADS, HEAD_DIM) == 3 * 3 * 2 * 2 * (TOKENS / 4) * HEADS * HEAD_DIM * 4
    context_2 = next(line for line in text.splitlines() if line.startswith('| 2 | 2 |'))
    assert f"| {3 * forward:.0f} |" in context_2 and f"| {2 * (HEADS * 65 * 64 + HEADS) * 4} |" in context_2


def test_fsdp2_steps_as_ddp_with_half_the_optimizer_state(run):
    text, rows = run
    ddp, fsdp = rows[('sync', 1, 'ddp')], rows[('sync', 1, 'fsdp')]
    # every step's loss on every rank: the parameters after each step are the same
    assert [x for r in fsdp for x in r['losses']] == pytest.approx([x for r in ddp for x in r['losses']], rel=1e-5)
    assert sum(r['opt_mib'] for r in fsdp) == pytest.approx(ddp[0]['opt_mib'], rel=1e-3)
    assert all(r['opt_mib'] < 0.6 * ddp[0]['opt_mib'] for r in fsdp)
    assert set(fsdp[0]['comm']) == {'params', 'grads'} and set(ddp[0]['comm']) == {'grads'}
    # FSDP's unsharded parameters, saved by the linear layers, are parameters, not activations
    assert fsdp[0]['act_mib'] == pytest.approx(ddp[0]['act_mib'], rel=1e-3)
    assert 'PyTorch context parallelism: skipped on CPU' in text


def test_bad_arguments_are_usage_errors():
    with pytest.raises(SystemExit):
        _tool().parse_args(['--steps', '0'])
