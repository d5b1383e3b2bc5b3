"""Atomic checkpoints (kills and exceptions mid-write), weights-only loading, RNG round trips, safetensors for timm."""
import collections
import enum
import io
import multiprocessing
import os
import pickle
import random
import signal
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import timm
import torch
import torch.nn as nn

from linvit.engine.checkpoint import (
    Checkpoint,
    CheckpointError,
    Progress,
    _check_weights_only_loadable,
    atomic_write,
    capture_rng_state,
    load_checkpoint,
    load_safetensors,
    restore_rng_state,
    save_checkpoint,
    save_model_safetensors,
)

OLD_STATE = {'epoch': 3, 'weights': torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def assert_same_tree(actual, expected, where='state'):
    assert type(actual) is type(expected), f'{where}: {type(actual)} != {type(expected)}'
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            assert_same_tree(actual[key], expected[key], f'{where}[{key!r}]')
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_tree(a, e, f'{where}[{i}]')
    else:
        assert actual == expected, where


def files_in(directory: Path):
    return sorted(p.name for p in directory.iterdir())


# --- save / load ------------------------------------------------------------------------------------------------


def test_round_trip_keeps_every_allowed_type(tmp_path):
    state = {
        'model': OrderedDict(w=torch.randn(3, 4), b=torch.zeros(4, dtype=torch.bfloat16)),
        'optimizer': {'state': {0: {'step': torch.tensor(7.0)}}, 'param_groups': [{'lr': 1e-3, 'betas': (0.9, 0.99)}]},
        'epoch': 5, 'best': 0.875, 'name': 'run', 'raw': b'\x00\x01', 'z': 1 + 2j, 'done': False, 'note': None,
        'dtype': torch.float16, 'device': torch.device('cpu'), 'size': torch.Size([2, 3]), 'tags': {'a', 'b'},
        'weight': torch.nn.Parameter(torch.ones(2)),
    }
    path = tmp_path / 'last.pth'
    save_checkpoint(path, state)
    assert_same_tree(load_checkpoint(path), state)
    # the promise is weights_only loadability, so check it with torch itself too
    assert_same_tree(torch.load(path, weights_only=True), state)
    assert files_in(tmp_path) == ['last.pth']


@pytest.mark.skipif(not torch.cuda.is_available(), reason='no CUDA')
def test_cuda_tensors_load_where_map_location_says(tmp_path):
    weights = torch.randn(3, 4, device='cuda')
    save_checkpoint(tmp_path / 'last.pth', {'weights': weights})
    on_cpu = load_checkpoint(tmp_path / 'last.pth')['weights']
    on_gpu = load_checkpoint(tmp_path / 'last.pth', map_location='cuda')['weights']
    assert on_cpu.device.type == 'cpu' and on_gpu.device.type == 'cuda'
    assert torch.equal(on_cpu, weights.cpu()) and torch.equal(on_gpu, weights)


def test_overwrite_replaces_content(tmp_path):
    path = tmp_path / 'last.pth'
    save_checkpoint(path, OLD_STATE)
    save_checkpoint(path, {'epoch': 4})
    assert load_checkpoint(path) == {'epoch': 4}
    assert files_in(tmp_path) == ['last.pth']


def test_file_permissions_follow_umask(tmp_path):
    path = tmp_path / 'last.pth'
    save_checkpoint(path, OLD_STATE)
    umask = os.umask(0)
    os.umask(umask)
    assert (path.stat().st_mode & 0o777) == (0o666 & ~umask)


@pytest.mark.parametrize('bad, where', [
    ({'rng': {'numpy': np.zeros(3)}}, "state['rng']['numpy']"),
    ({'layers': [1, {'fn': len}]}, "state['layers'][1]['fn']"),
    ({'best': np.float64(0.5)}, "state['best']"),
])
def test_refuses_what_weights_only_cannot_load_before_writing(tmp_path, bad, where):
    path = tmp_path / 'last.pth'
    save_checkpoint(path, OLD_STATE)
    with pytest.raises(TypeError, match=r'weights_only') as info:
        save_checkpoint(path, bad)
    assert where in str(info.value)
    assert_same_tree(load_checkpoint(path), OLD_STATE)
    assert files_in(tmp_path) == ['last.pth']


Pair = collections.namedtuple('Pair', 'a b')


class Colour(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize('value', [
    np.float64(1.5), np.int64(3), np.bool_(True), np.zeros(2), collections.defaultdict(list), Pair(1, 2), Colour.RED,
    frozenset([1]), range(3), slice(1, 2), len,
    torch.nn.Parameter(torch.ones(2)), {1, 2}, bytearray(b'a'), 1j, float('nan'), torch.Size([1]), torch.int8,
], ids=lambda value: type(value).__name__)
def test_the_precheck_agrees_with_the_weights_only_loader(value):
    buffer = io.BytesIO()
    torch.save({'x': value}, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
        loadable = True
    except pickle.UnpicklingError:
        loadable = False
    try:
        _check_weights_only_loadable({'x': value})
        accepted = True
    except TypeError:
        accepted = False
    assert accepted == loadable


def test_missing_checkpoint_names_the_path(tmp_path):
    path = tmp_path / 'nope' / 'last.pth'
    with pytest.raises(FileNotFoundError, match=str(path)):
        load_checkpoint(path)


def _truncated_checkpoint(path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(OLD_STATE, buffer)
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])


def _pickled_object(path: Path) -> None:
    torch.save({'model': nn.Linear(2, 2)}, path)    # a whole module: needs full unpickling


@pytest.mark.parametrize('write_bad_file', [
    _truncated_checkpoint,
    lambda path: path.write_text('epoch,step\n1,2\n'),
    lambda path: path.write_bytes(b''),
    _pickled_object,
    lambda path: torch.save([torch.zeros(1)], path),
], ids=['truncated', 'text', 'empty', 'pickled-module', 'not-a-dict'])
def test_corrupt_or_foreign_file_is_a_runtime_error_naming_the_path(tmp_path, write_bad_file):
    path = tmp_path / 'last.pth'
    write_bad_file(path)
    with pytest.raises(RuntimeError, match='is not a linvit checkpoint') as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize('write_bad_file', [
    _truncated_checkpoint,
    lambda path: path.write_text('epoch,step\n1,2\n'),
    lambda path: path.write_bytes(bytes(range(256)) * 8),
    _pickled_object,
], ids=['truncated', 'text', 'random-bytes', 'pickled-module'])
def test_a_file_that_is_not_a_checkpoint_is_one_line_without_torch_load_advice(tmp_path, write_bad_file):
    path = tmp_path / 'last.pth'
    write_bad_file(path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and message.startswith(f'{path} is not a linvit checkpoint')
    assert 'weights_only' not in message and 'trust' not in message


def test_safetensors_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match='missing.safetensors does not exist'):
        load_safetensors(tmp_path / 'missing.safetensors')
    (tmp_path / 'bad.safetensors').write_bytes(b'\x00' * 64)
    with pytest.raises(CheckpointError, match=r'bad\.safetensors is not a \.safetensors weights file'):
        load_safetensors(tmp_path / 'bad.safetensors')
    safetensors.torch.save_file({'w': torch.ones(2)}, tmp_path / 'good.safetensors')
    assert torch.equal(load_safetensors(tmp_path / 'good.safetensors')['w'], torch.ones(2))


# --- interruptions ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize('interruption', [OSError('disk full'), KeyboardInterrupt()], ids=['OSError', 'Ctrl-C'])
def test_exception_during_torch_save_keeps_old_file_and_removes_temp(tmp_path, monkeypatch, interruption):
    path = tmp_path / 'last.pth'
    save_checkpoint(path, OLD_STATE)
    real_save = torch.save

    def half_written_then_fail(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        f.write(buffer.getvalue()[:100])
        raise interruption

    monkeypatch.setattr(torch, 'save', half_written_then_fail)
    with pytest.raises(type(interruption)):
        save_checkpoint(path, {'epoch': 4, 'weights': torch.randn(1000)})
    assert_same_tree(load_checkpoint(path), OLD_STATE)
    assert files_in(tmp_path) == ['last.pth']


def test_unpicklable_object_found_by_torch_save_keeps_old_file(tmp_path, monkeypatch):
    # an object the pre-check would refuse, smuggled past it to reach torch.save's pickler
    monkeypatch.setattr('linvit.engine.checkpoint._check_weights_only_loadable', lambda obj, where='state': None)
    path = tmp_path / 'last.pth'
    save_checkpoint(path, OLD_STATE)
    with pytest.raises(Exception, match='pickle'):
        save_checkpoint(path, {'fn': lambda x: x})
    assert_same_tree(load_checkpoint(path), OLD_STATE)
    assert files_in(tmp_path) == ['last.pth']


def _write_big_checkpoint_and_pause(path: Path, marker: Path, moment: str) -> None:
    """Runs in a forked child: starts overwriting ``path``, then waits to be killed at ``moment``."""
    def pause_to_be_killed(*args, **kwargs):
        marker.touch()
        time.sleep(120)

    if moment == 'mid-write':
        real_save = torch.save

        def half_save(obj, f, *args, **kwargs):
            buffer = io.BytesIO()
            real_save(obj, buffer)
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            f.flush()
            pause_to_be_killed()

        torch.save = half_save
    else:  # the new file is written and fsynced, not yet renamed onto path
        os.replace = pause_to_be_killed
    save_checkpoint(path, {'epoch': 4, 'weights': torch.randn(2_000_000)})


@pytest.mark.skipif(not hasattr(signal, 'SIGKILL'), reason='needs SIGKILL and fork')
@pytest.mark.parametrize('moment', ['mid-write', 'before-rename'])
def test_sigkill_during_checkpoint_write_leaves_the_old_checkpoint(tmp_path, moment):
    path, marker = tmp_path / 'last.pth', tmp_path.parent / f'{tmp_path.name}-paused'
    save_checkpoint(path, OLD_STATE)
    # fork: the child starts with torch already imported (a fresh interpreter takes seconds to import it)
    child = multiprocessing.get_context('fork').Process(target=_write_big_checkpoint_and_pause,
                                                        args=(path, marker, moment))
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert child.is_alive(), f'writer exited early with code {child.exitcode}'
            assert time.monotonic() < deadline, 'writer never reached the pause'
            time.sleep(0.02)
        leftovers = [name for name in files_in(tmp_path) if name != 'last.pth']
        assert len(leftovers) == 1 and os.path.getsize(tmp_path / leftovers[0]) > 1_000_000, leftovers
    finally:
        child.kill()
        child.join()
    assert child.exitcode == -signal.SIGKILL
    assert_same_tree(load_checkpoint(path), OLD_STATE)
    # the next write cleans up what the killed one left
    save_checkpoint(path, {'epoch': 5})
    assert load_checkpoint(path) == {'epoch': 5}
    assert files_in(tmp_path) == ['last.pth']


def test_atomic_write_text_mode(tmp_path):
    path = tmp_path / 'metrics.json'
    with atomic_write(path, 'w') as f:
        f.write('{"top1": 0.5}')
    assert path.read_text(encoding='utf-8') == '{"top1": 0.5}'
    with pytest.raises(ValueError, match='mode'):
        with atomic_write(path, 'a'):
            pass


# --- RNG state --------------------------------------------------------------------------------------------------


def draw_from_every_rng():
    draws = {
        'python': [random.random() for _ in range(5)] + [random.gauss(0, 1)],
        'numpy': np.random.rand(5).tolist() + [float(np.random.standard_normal())],
        'torch': torch.rand(5).tolist() + torch.randn(3).tolist(),
    }
    if torch.cuda.is_available():
        draws['cuda'] = torch.rand(5, device='cuda').tolist()
    return draws


def fill_gaussian_caches():
    """Python's gauss and numpy's legacy normal cache the second value of each pair they draw: state to restore."""
    while random.getstate()[2] is None:
        random.gauss(0, 1)
    while not np.random.get_state()[3]:
        np.random.standard_normal()


def test_restore_rng_state_repeats_the_draws():
    fill_gaussian_caches()
    state = capture_rng_state()
    first = draw_from_every_rng()
    second = draw_from_every_rng()
    assert first != second
    restore_rng_state(state)
    assert draw_from_every_rng() == first


def test_rng_state_survives_a_checkpoint_file(tmp_path):
    fill_gaussian_caches()
    save_checkpoint(tmp_path / 'last.pth', {'rng': capture_rng_state()})
    first = draw_from_every_rng()
    draw_from_every_rng()
    restore_rng_state(load_checkpoint(tmp_path / 'last.pth')['rng'])
    assert draw_from_every_rng() == first


# --- safetensors ------------------------------------------------------------------------------------------------


def tiny_vit(**kwargs):
    return timm.create_model('vit_tiny_patch16_224', img_size=32, depth=2, num_classes=3, **kwargs)


def test_safetensors_file_loads_into_timm(tmp_path):
    torch.manual_seed(0)
    model = tiny_vit()
    with torch.no_grad():
        model.head.bias.copy_(torch.tensor([1.0, 2.0, 3.0]))    # default init is zero: make the head checkable
    path = tmp_path / 'model.safetensors'
    save_model_safetensors(model, path)

    torch.manual_seed(1)
    # custom_load=False: older timm (the GPU machine's) otherwise reads the file as the original ViT .npz
    loaded = tiny_vit(pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=3, custom_load=False))
    expected, actual = model.state_dict(), loaded.state_dict()
    assert list(actual) == list(expected)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name

    torch.manual_seed(1)
    assert not torch.equal(tiny_vit().blocks[0].attn.qkv.weight, expected['blocks.0.attn.qkv.weight'])
    assert files_in(tmp_path) == ['model.safetensors']


class TiedAndStrided(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 3, bias=False)
        self.decoder = nn.Linear(4, 3, bias=False)
        self.decoder.weight = self.encoder.weight                       # tied: one tensor under two keys
        self.register_buffer('transposed', torch.arange(12.0).reshape(3, 4).t())   # non-contiguous
        fused = torch.arange(10.0)
        self.register_buffer('first_half', fused[:5])                    # two views of one storage
        self.register_buffer('second_half', fused[5:])


@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason='no CUDA'))])
def test_safetensors_handles_tied_strided_and_aliased_tensors(tmp_path, device):
    model = TiedAndStrided().to(device)
    path = tmp_path / 'model.safetensors'
    save_model_safetensors(model, path)
    tensors = safetensors.torch.load_file(path)
    expected = model.state_dict()
    assert sorted(tensors) == sorted(expected)
    for name in expected:
        assert torch.equal(tensors[name], expected[name].cpu()), name
    TiedAndStrided().load_state_dict(tensors, strict=True)


def test_safetensors_keys_have_no_wrapper_prefix(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2))
    path = tmp_path / 'model.safetensors'
    save_model_safetensors(torch.compile(model), path)
    assert sorted(safetensors.torch.load_file(path)) == ['0.bias', '0.weight']


# --- the typed training checkpoint ---------------------------------------------------------------------------------


def _training_checkpoint(ema: bool = True) -> Checkpoint:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return Checkpoint(model=model.state_dict(), config='task: classification\n', class_names=['cat', 'dog'],
                      progress=Progress(step=7, epoch=1, batch_in_epoch=4, best=0.5, best_step=6),
                      optimizer=optimizer.state_dict(), scheduler={'last_epoch': 7},
                      ema={k: v + 1 for k, v in model.state_dict().items()} if ema else None,
                      rng=capture_rng_state(), world_size=2)


def test_a_checkpoint_round_trips_every_field_through_its_file(tmp_path):
    written = _training_checkpoint()
    written.save(tmp_path / 'last.pt')
    read = Checkpoint.load(tmp_path / 'last.pt')
    assert read.progress == Progress(step=7, epoch=1, batch_in_epoch=4, best=0.5, best_step=6)
    assert (read.config, read.class_names, read.world_size, read.scaler) == ('task: classification\n', ['cat', 'dog'],
                                                                           2, None)
    assert_same_tree(read.to_dict(), written.to_dict())
    assert read.evaluated_weights() is read.ema and not torch.equal(read.ema['weight'], read.model['weight'])


def test_the_file_is_the_plain_dict_layout_train_py_has_always_written(tmp_path):
    """Files keep their layout: a plain dict that torch.load(weights_only=True) reads, and such a dict loads."""
    _training_checkpoint(ema=False).save(tmp_path / 'new.pt')
    state = load_checkpoint(tmp_path / 'new.pt')
    assert sorted(state) == ['class_names', 'config', 'ema', 'model', 'optimizer', 'progress', 'rng', 'scaler',
                             'scheduler', 'sharded', 'version', 'world_size']
    assert state['progress'] == {'step': 7, 'epoch': 1, 'batch_in_epoch': 4, 'best': 0.5, 'best_step': 6}
    weights = {'weight': torch.ones(2, 3)}
    save_checkpoint(tmp_path / 'old.pt', {'config': 'seed: 1\n', 'model': weights, 'class_names': [0, 1],
                                          'progress': {'step': 3, 'epoch': 0, 'batch_in_epoch': 3, 'best': 0.25,
                                                       'best_step': 2}})
    old = Checkpoint.load(tmp_path / 'old.pt')
    assert old.progress.step == 3 and old.class_names == ['0', '1'] and old.ema is None
    assert old.evaluated_weights() is old.model and old.world_size == 1


def test_a_file_without_model_weights_is_not_a_checkpoint(tmp_path):
    save_checkpoint(tmp_path / 'other.pt', {'weights': torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"other\.pt is not a linvit training checkpoint: it has no 'model'"):
        Checkpoint.load(tmp_path / 'other.pt')
    with pytest.raises(FileNotFoundError, match='does not exist'):
        Checkpoint.load(tmp_path / 'missing.pt')


def test_a_checkpoint_that_cannot_be_written_leaves_the_previous_one(tmp_path):
    path = tmp_path / 'last.pt'
    _training_checkpoint().save(path)
    broken = _training_checkpoint()
    broken.scheduler = {'not loadable': np.float64(1.0)}
    with pytest.raises(TypeError, match='numpy'):
        broken.save(path)
    assert Checkpoint.load(path).scheduler == {'last_epoch': 7} and files_in(tmp_path) == ['last.pt']


def test_ctrl_c_during_a_checkpoint_write_waits_for_the_whole_file(tmp_path, monkeypatch):
    """A SIGINT that arrives while torch.save writes is delivered after the file is complete and in place, as the
    KeyboardInterrupt train.py turns into its one line (before: torch.save's RuntimeError and a traceback)."""
    import os
    import signal
    path = tmp_path / 'last.pt'
    real_save = torch.save

    def save_interrupted(state, f):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the write
        real_save(state, f)

    # Ctrl-C as in a terminal, whether or not this suite was started with SIGINT ignored (in the background)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(torch, 'save', save_interrupted)
    with pytest.raises(KeyboardInterrupt):
        try:
            save_checkpoint(path, {'step': 7, 'weights': torch.arange(4.0)})
        finally:
            signal.signal(signal.SIGINT, previous)
    loaded = load_checkpoint(path)
    assert loaded['step'] == 7 and torch.equal(loaded['weights'], torch.arange(4.0))
