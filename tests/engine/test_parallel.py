"""train.py's ``parallel`` section on 2 and 4 gloo processes: a segmentation run split over 2 context ranks trains
exactly as one process does; FSDP2 trains exactly as DDP does; its sharded checkpoint resumes at 1 and 4 processes
with the weights and optimizer state it saved; activation checkpointing changes no number; and layouts that cannot run
are refused in one line.

What is checked is what the section computes, not the launcher: each process is train.py's main on a forked rank with
the environment torchrun gives its workers (tests/ranks.py ``run_train_py_ranks``). The real ``torchrun`` launch of
train.py is covered by test_train_cli (2 DDP processes, their evaluation) and test_faults (signals, elastic restarts,
an FSDP run stopped and resumed)."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from cli import run_train_py
from ranks import run_ranks, run_train_py_ranks
from references import rel_err
from safetensors.torch import load_file
from session_runs import built_once
from tiny_run import TINY_DET, TINY_MODEL, TINY_SEG

from linvit.engine import Checkpoint, ConfigError, load_config
from linvit.engine.distributed import setup_distributed
from linvit.engine.parallel import Layout, check_layout, checkpointed_blocks, full_weights, parallel_module
from linvit.engine.run import build_run, build_training, restore
from linvit.engine.tasks import build_task
from linvit.models.context import RowShards

pytestmark = pytest.mark.integration  # trains or starts interpreters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEG = ['--config', 'configs/seg_demo.yaml', *TINY_MODEL, *TINY_SEG, 'data.synthetic.val_size=3']


def _train(tmp_path, name, *overrides, processes=1):
    """A finished tiny segmentation run in tmp_path/name (train.py: in this process with one process, on forked ranks
    with torchrun's environment with several); what rank 0 printed in tmp_path/name.stdout (``_printed``)."""
    args = [*SEG, *overrides, f'output_dir={tmp_path / name}']
    results = run_train_py_ranks(processes, *args) if processes > 1 else [run_train_py(*args)]
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}: {result.stderr[-4000:]}"
    (tmp_path / f'{name}.stdout').write_text(results[0].stdout)
    return tmp_path / name


def _printed(run_dir):
    """What train.py's rank 0 printed on stdout for the run in ``run_dir``."""
    return (run_dir.parent / f'{run_dir.name}.stdout').read_text()


def _losses(run_dir):
    """The train rows' losses of metrics.csv, in order."""
    rows = (run_dir / 'metrics.csv').read_text().splitlines()
    header = rows[0].split(',')
    return [float(row.split(',')[header.index('loss')]) for row in rows[1:] if ',train,' in row]


def _assert_same_training(got, want):
    assert _losses(got) == pytest.approx(_losses(want), rel=1e-5)
    a, b = load_file(got / 'model.safetensors'), load_file(want / 'model.safetensors')
    assert sorted(a) == sorted(b)
    for name in a:
        assert rel_err(a[name], b[name]) < 1e-5, name


@pytest.fixture(scope='module')
def runs(tmp_path_factory, worker_id):
    """The runs the tests compare (only read): one process, context 2 (checkpointing every block), DDP and FSDP2 on 2
    processes, and both dimensions on 4: context 2 x data 2 with HSDP and checkpointing. Trained once per session
    (tests/session_runs.py), however pytest-xdist spreads this module's tests."""
    def build(tmp):
        _train(tmp, 'alone')
        _train(tmp, 'context', 'parallel.context=2', 'parallel.checkpoint_every=1', processes=2)
        _train(tmp, 'ddp', processes=2)
        _train(tmp, 'fsdp', 'parallel.fsdp=true', processes=2)
        _train(tmp, 'hsdp', 'parallel.context=2', 'parallel.fsdp=true', 'parallel.checkpoint_every=2', processes=4)

    folder = built_once(tmp_path_factory, worker_id, 'test_parallel', build)
    return {name: folder / name for name in ('alone', 'context', 'ddp', 'fsdp', 'hsdp')}


def test_a_run_split_over_two_context_ranks_trains_as_one_process(runs):
    _assert_same_training(runs['context'], runs['alone'])
    log = (runs['context'] / 'train.log').read_text()
    assert 'processes: mesh context=2 x data=1 over 2 process(es) (DDP; activation checkpointing every block)' in log


def test_data_parallel_evaluation_equals_one_process_evaluation(runs, tmp_path):
    # 3 validation images over 2 ranks: the confusion matrices of unequal shards are summed, nothing counted twice
    ddp = json.loads((runs['ddp'] / 'metrics.json').read_text())
    assert ddp['pixels'] == 3 * 32 * 32
    single = run_train_py('--eval-only', str(runs['ddp'] / 'last.pt'), '--out', str(tmp_path / 'single'))
    assert single.returncode == 0, single.stderr[-3000:]
    alone = json.loads((tmp_path / 'single' / 'metrics.json').read_text())
    assert alone.pop('per_class_iou') == pytest.approx(ddp.pop('per_class_iou'), rel=1e-6)
    assert alone == pytest.approx(ddp, rel=1e-6)
    assert 'miou=' in _printed(runs['ddp']) and 'per_class_iou.background=' in _printed(runs['ddp'])  # rank 0 printed


def test_fsdp2_trains_as_ddp_and_saves_whole_weights_and_its_shards(runs):
    _assert_same_training(runs['fsdp'], runs['ddp'])
    assert 'FSDP2 over data' in (runs['fsdp'] / 'train.log').read_text()
    last = Checkpoint.load(runs['fsdp'] / 'last.pt')
    assert last.optimizer is None and last.sharded == f'last.dcp/step{last.progress.step:06d}'
    assert os.listdir(runs['fsdp'] / 'last.dcp') == [os.path.basename(last.sharded)]  # older steps' are gone
    weights = load_file(runs['fsdp'] / 'model.safetensors')  # consolidated: what one process loads
    assert sorted(weights) == sorted(last.model)
    assert all(torch.equal(last.model[name], weights[name]) for name in weights)


def test_context_and_data_dimensions_together_train_as_ddp_over_the_data(runs):
    _assert_same_training(runs['hsdp'], runs['ddp'])  # context 2 x data 2 (HSDP) vs data 2: the same batches
    assert 'mesh context=2 x data=2 over 4 process(es) (HSDP' in (runs['hsdp'] / 'train.log').read_text()


def _restored(rank, run_dir, world_size, *overrides):
    """(whole weights, whole optimizer state) of the run in ``run_dir`` restored from its last.pt on this rank of
    ``world_size`` processes, sharded as its config says."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    checkpoint = Checkpoint.load(run_dir / 'last.pt')
    cfg = load_config(run_dir / 'config.yaml', [f'output_dir={run_dir}', *overrides])
    run = build_run(cfg, setup_distributed('cpu'))
    training = build_training(run)
    restore(run, training, checkpoint)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    optimizer = get_optimizer_state_dict(run.model, training.optimizer, options=StateDictOptions(full_state_dict=True))
    return {k: v.cpu() for k, v in full_weights(run.model).items()}, optimizer['state']


@pytest.mark.parametrize('world_size', [1, 4])
def test_a_sharded_checkpoint_of_two_processes_resumes_at_one_and_four(runs, tmp_path, monkeypatch, world_size):
    saved = Checkpoint.load(runs['fsdp'] / 'last.pt')
    if world_size == 1:
        monkeypatch.chdir(ROOT)
        for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
            monkeypatch.delenv(name, raising=False)
        results = [_restored(0, runs['fsdp'], 1)]
    else:
        results = run_ranks(tmp_path, _restored, runs['fsdp'], world_size, world_size=world_size)
    reference = results[0][1]
    assert reference and all(float(state['exp_avg'].abs().sum()) > 0 for state in reference.values())
    for weights, optimizer in results:
        assert sorted(weights) == sorted(saved.model)
        assert all(torch.equal(weights[name], saved.model[name].cpu()) for name in weights)
        for key, state in optimizer.items():  # every rank holds the same whole state, as the other world size does
            assert torch.equal(state['exp_avg'], reference[key]['exp_avg'])
    if world_size == 4:
        one = _restored_alone(runs['fsdp'], monkeypatch)
        for key, state in reference.items():
            assert torch.equal(state['exp_avg_sq'], one[key]['exp_avg_sq'])


def _restored_alone(run_dir, monkeypatch, *overrides):
    monkeypatch.chdir(ROOT)
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        monkeypatch.delenv(name, raising=False)
    return _restored(0, run_dir, 1, *overrides)[1]


# ---------------------------------------------------------------------------------------------------- layouts

def _cfg(*overrides):
    return load_config(os.path.join(ROOT, 'configs/seg_demo.yaml'), [*TINY_MODEL, *TINY_SEG, *overrides])


def _check(world, *overrides):
    cfg = _cfg(*overrides)
    task = build_task(cfg)
    check_layout(cfg, world, task.build_model(3), task.logits_rank)


@pytest.mark.parametrize('world, overrides, words', [
    (3, ['parallel.context=2'], 'parallel.context=2 does not divide the 3 process(es)'),
    (8, ['parallel.context=8'], 'parallel.context=8 is more processes than the 4 patch rows of data.img_size=32'),
    (2, ['parallel.context=2', 'model.kwargs.softmax_blocks=[1]'], 'block 1 has Attention (softmax attention)'),
    (2, ['parallel.context=2', 'model.kwargs.attn_family=gated'], "attn_family='gated', which has no state form"),
    (2, ['parallel.context=2', 'seg.dice_weight=0.5'], 'set seg.dice_weight=0'),
    (2, ['parallel.context=2', 'train.compile=true'], 'set train.compile=false'),
    (2, ['parallel.fsdp=true', 'train.ema=true'], 'set train.ema=false'),
    (1, ['parallel.checkpoint_every=-1'], 'parallel.checkpoint_every >= 0'),
])
def test_layouts_that_cannot_run_are_refused_in_one_line(world, overrides, words):
    with pytest.raises(ValueError, match=None) as error:
        _check(world, *overrides)
    assert words in str(error.value) and '\n' not in str(error.value)


def test_context_parallelism_of_a_detector_is_refused_naming_what_is_unsupported():
    cfg = load_config(os.path.join(ROOT, 'configs/det_demo.yaml'), [*TINY_MODEL, *TINY_DET, 'parallel.context=2'])
    task = build_task(cfg)
    with pytest.raises(ConfigError) as refused:
        check_layout(cfg, 2, task.build_model(3), task.logits_rank)
    assert str(refused.value).startswith("parallel.context=2: context parallelism of task='detection' (its model "
                                         "FasterRCNN) is not supported;")
    assert 'not a timm ViT' not in str(refused.value) and 'use parallel.context=1' in str(refused.value)


def test_train_py_refuses_a_layout_in_one_line(tmp_path):
    result = run_train_py(*SEG, 'parallel.context=2', f'output_dir={tmp_path / "x"}')
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "train.py: config error: parallel.context=2 does not divide the 1 process(es) (torchrun --nnodes x "
        "--nproc_per_node): use a divisor of 1")
    assert not (tmp_path / 'x').exists()


# ---------------------------------------------------------------------------------------------------- checkpointing

def _saved_bytes(model, images):
    """Bytes of the tensors autograd saves for backward in one forward (each storage once), and the gradients."""
    seen = {}

    def pack(tensor):
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(images).square().mean()
    loss.backward()
    return sum(seen.values()), {n: p.grad for n, p in model.named_parameters()}


def test_activation_checkpointing_recomputes_every_kth_block_and_changes_no_gradient():
    import timm
    torch.manual_seed(0)
    plain = timm.create_model('linvit_tiny_patch16_224', depth=4, img_size=64, patch_size=8, num_classes=3)
    checkpointed = timm.create_model('linvit_tiny_patch16_224', depth=4, img_size=64, patch_size=8, num_classes=3)
    checkpointed.load_state_dict(plain.state_dict())
    layout = Layout(world=1, context=1, data=1, data_rank=0, shards=RowShards(None), mesh=None, fsdp=False,
                    checkpoint_every=2)
    module = parallel_module(checkpointed, layout, None, torch.device('cpu'))
    assert checkpointed_blocks(list(range(4)), 2) == [1, 3]
    assert [type(block).__name__ for block in module.blocks] == ['LinearAttentionBlock', 'CheckpointWrapper'] * 2
    assert sorted(module.state_dict()) == sorted(plain.state_dict())  # saved weights keep their names
    images = torch.randn(2, 3, 64, 64)
    full, want = _saved_bytes(plain, images)
    kept, got = _saved_bytes(module, images)
    assert kept < 0.75 * full  # two of four blocks keep only their input
    for name, grad in want.items():
        assert rel_err(got[name.replace('blocks.1.', 'blocks.1._checkpoint_wrapped_module.')
                            .replace('blocks.3.', 'blocks.3._checkpoint_wrapped_module.')], grad) < 1e-6


def test_one_process_runs_the_model_itself():
    model = nn.Linear(2, 2)
    layout = Layout(world=1, context=1, data=1, data_rank=0, shards=RowShards(None), mesh=None, fsdp=False,
                    checkpoint_every=0)
    assert parallel_module(model, layout, None, torch.device('cpu')) is model
    assert not dist.is_initialized()


def test_resuming_warns_only_when_the_data_order_changes(runs, monkeypatch, caplog):
    # the context run: 2 processes, one data replica, whose batches one process draws the same
    caplog.set_level('WARNING', logger='linvit.train')
    _restored_alone(runs['context'], monkeypatch, 'parallel.context=1')
    assert 'data order differs' not in caplog.text
    _restored_alone(runs['ddp'], monkeypatch)  # 2 data replicas on 1
    assert ('resuming a run of 2 data process(es) x data.batch_size=8 x train.accum_steps=1 (global batch 16) as 1 '
            'data process(es) x data.batch_size=8 x train.accum_steps=1 (global batch 8): the data order differs'
            ) in caplog.text
