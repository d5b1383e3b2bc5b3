"""Checkpoints that survive a crash at any moment, RNG state that survives ``torch.load(weights_only=True)``, and
model weights as a ``.safetensors`` file that ``timm.create_model(..., pretrained=True)`` loads.

    Checkpoint(config=yaml_text, model=model.state_dict(), progress=Progress(step=40)).save(run_dir / 'last.pt')
    checkpoint = Checkpoint.load(run_dir / 'last.pt')      # a training checkpoint, typed
    checkpoint.progress.step, checkpoint.evaluated_weights() # 40, its EMA weights when it has them
    save_checkpoint(run_dir / 'other.pt', {'model': model.state_dict(), 'rng': capture_rng_state(), 'epoch': 3})
    state = load_checkpoint(run_dir / 'other.pt')            # any dict of weights-only data
    restore_rng_state(state['rng'])
    save_model_safetensors(model, run_dir / 'model.safetensors')
    overlay = dict(file=str(run_dir / 'model.safetensors'), num_classes=10, custom_load=False)
    model = timm.create_model(name, pretrained=True, num_classes=10, pretrained_cfg_overlay=overlay)

Every file is written through ``atomic_write``: into a temporary file in the destination's directory, flushed and
fsynced, renamed onto the destination with ``os.replace`` (atomic on POSIX and Windows), then the directory is
fsynced so the rename itself is durable. A crash, ``KeyboardInterrupt`` or SIGKILL at any moment leaves the
destination either as the old complete file or as the new complete one. An exception removes the temporary file;
a SIGKILL cannot, so the next write to the same destination removes what an earlier killed write left behind.

Checkpoints are loaded with ``weights_only=True`` (no arbitrary code runs on load), so ``save_checkpoint`` accepts
only what that loader accepts and checks it before writing anything: tensors, dict, OrderedDict, list, tuple, set,
str, bytes, int, float, complex, bool, None, ``torch.dtype``, ``torch.device``, ``torch.Size`` (exactly these types:
a numpy scalar, namedtuple, enum or defaultdict is refused). Anything else is refused with the key path that holds
it, instead of producing a checkpoint that cannot be resumed.
"""
import contextlib
import logging
import math
import os
import pickle
import random
import re
import signal
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Dict, Iterator, List, Optional, Union

import numpy as np
import torch
import torch.nn as nn

__all__ = ['CheckpointError', 'Checkpoint', 'Progress', 'CHECKPOINT_VERSION', 'atomic_write', 'atomic_path',
           'save_checkpoint', 'load_checkpoint', 'load_safetensors', 'capture_rng_state', 'restore_rng_state',
           'save_model_safetensors', 'unwrap_model']

_logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

_TMP_SUFFIX = '.tmp'
# exact types: subclasses (np.float64 of float, namedtuple of tuple, IntEnum of int, defaultdict of dict) pickle by
# their own class, which the weights-only loader refuses
_WEIGHTS_ONLY_LEAVES = frozenset({str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype,
                                  torch.device, torch.Size})
_WEIGHTS_ONLY_CONTAINERS = frozenset({dict, OrderedDict, list, tuple, set})


class CheckpointError(RuntimeError):
    """A file that is not a linvit checkpoint or weights file (or whose weights do not fit the model); the one-line
    message names the file and what was expected."""


def _temp_prefix(path: Path) -> str:
    # hidden and named after the destination, so leftovers of a killed write are recognisable and removable
    return f'.{path.name}.'


def _remove_stale_temp_files(path: Path) -> None:
    for stale in path.parent.glob(f'{_temp_prefix(path)}*{_TMP_SUFFIX}'):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
            _logger.info('removed %s, left behind by an interrupted write of %s', stale, path)


def _fsync_directory(directory: Path) -> None:
    # makes the rename durable on POSIX; Windows cannot open a directory, and its rename is durable without it
    if os.name == 'nt':
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_path_for(path: Path) -> Path:
    return path.with_name(f'{_temp_prefix(path)}{uuid.uuid4().hex[:12]}{_TMP_SUFFIX}')


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, 'O_BINARY', 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replacing_on_success(tmp: Path, path: Path) -> Iterator[None]:
    try:
        yield
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_directory(path.parent)


@contextlib.contextmanager
def atomic_write(path: PathLike, mode: str = 'wb') -> Iterator[IO]:
    """Open a temporary file next to ``path`` for writing; on a clean exit it replaces ``path`` atomically.

    ``mode`` is ``'wb'`` or ``'w'`` (text, UTF-8). The file gets the permissions a plain ``open`` would give. If the
    block raises (any exception, including ``KeyboardInterrupt``), the temporary file is removed, ``path`` is left
    untouched and the exception propagates.
    """
    if mode not in ('wb', 'w'):
        raise ValueError(f"atomic_write: mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path).absolute()
    _remove_stale_temp_files(path)
    tmp = _temp_path_for(path)
    with _replacing_on_success(tmp, path):
        with open(tmp, mode.replace('w', 'x'), **({} if 'b' in mode else {'encoding': 'utf-8'})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Like ``atomic_write``, for writers that take a file name: yields the temporary path to write to, then fsyncs
    it and replaces ``path`` with it atomically (or removes it if the block raises)."""
    path = Path(path).absolute()
    _remove_stale_temp_files(path)
    tmp = _temp_path_for(path)
    with _replacing_on_success(tmp, path):
        yield tmp
        _fsync_file(tmp)


def _check_weights_only_loadable(obj: Any, where: str = 'state') -> None:
    if isinstance(obj, torch.Tensor) or type(obj) in _WEIGHTS_ONLY_LEAVES:
        return
    if type(obj) not in _WEIGHTS_ONLY_CONTAINERS:
        raise TypeError(f'{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which '
                        'torch.load(weights_only=True) refuses; store tensors, dicts, lists, tuples, str, int, float, '
                        'bool or None (numpy arrays and scalars: torch.from_numpy(...) or .item(); numpy RNG: '
                        'capture_rng_state())')
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_weights_only_loadable(key, f'a key of {where}')
            _check_weights_only_loadable(value, f'{where}[{key!r}]')
    else:
        for i, value in enumerate(obj):
            _check_weights_only_loadable(value, f'{where}[{i}]')


def save_checkpoint(path: PathLike, state: Dict[str, Any]) -> None:
    """Write ``state`` to ``path`` with ``torch.save``, atomically (see ``atomic_write``).

    ``state`` may hold only what ``torch.load(weights_only=True)`` loads (see the module docstring); anything else
    raises TypeError before a byte is written. Tensors are saved from their devices and load onto the
    ``map_location`` given to ``load_checkpoint``.
    """
    if not isinstance(state, dict):
        raise TypeError(f'save_checkpoint: state must be a dict, got {type(state).__name__}')
    _check_weights_only_loadable(state)
    with _ctrl_c_held(), atomic_write(path) as f:
        torch.save(state, f)


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """SIGINT (Ctrl-C) waits until the block is done, then arrives as usual. A KeyboardInterrupt raised inside
    torch.save's zip writer turns into its RuntimeError ("unexpected pos"), a traceback instead of train.py's
    one-line interrupt; held, the checkpoint is written whole and the interrupt follows. The handler is swapped
    rather than the signal masked: any of torch's threads may receive a process's signal. Python's handlers belong
    to the main thread, so elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)  # now, to the handler that was there before


def load_checkpoint(path: PathLike, map_location: Any = 'cpu') -> Dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` with ``torch.load(weights_only=True)``.

    Raises FileNotFoundError naming ``path`` if it does not exist, and CheckpointError (a RuntimeError) naming
    ``path`` if it is not a loadable checkpoint (truncated, corrupt, another format, or objects outside the
    weights-only allowlist), in one line: torch.load's own advice (weights_only=False) would run the file's code.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f'checkpoint {path} does not exist')
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (IsADirectoryError, PermissionError):
        raise
    except Exception as e:
        raise CheckpointError(f'{path} is not a linvit checkpoint or is corrupt: {_unreadable_because(e)}') from e
    if not isinstance(state, dict):
        raise CheckpointError(f'{path} is not a linvit checkpoint: it holds a {type(state).__name__}, not a dict')
    return state


#: the layout ``Checkpoint.save`` writes (version 1: the dict ``Checkpoint.to_dict`` documents)
CHECKPOINT_VERSION = 1


@dataclass
class Progress:
    """Where a run is: optimizer steps done, the epoch, the micro-batches of that epoch already consumed (a multiple
    of train.accum_steps; the sampler resumes there), and the best evaluation so far (main metric, its step)."""
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    best: float = -math.inf
    best_step: int = -1


@dataclass
class Checkpoint:
    """A training checkpoint (``last.pt`` / ``best.pt``): what continues a run exactly, and what rebuilds its model.

    On disk it is the plain dict of ``to_dict`` (tensors, dicts, lists, str, numbers: what
    ``torch.load(weights_only=True)`` reads), written crash-safely by ``save_checkpoint``; ``load`` reads every file
    train.py has written so far (keys a file lacks take the defaults below).
    """
    model: Dict[str, torch.Tensor]  # the model's state_dict (the bare model: no DDP / compile prefixes)
    config: Optional[str] = None  # the run's resolved config, YAML (config_to_yaml); train.py's files all have it
    class_names: Optional[List[str]] = None
    progress: Progress = field(default_factory=Progress)
    optimizer: Optional[Dict[str, Any]] = None  # optimizer.state_dict()
    scheduler: Optional[Dict[str, Any]] = None  # scheduler.state_dict() (kept; the schedule is rebuilt from config)
    scaler: Optional[Dict[str, Any]] = None  # the float16 GradScaler's state_dict
    ema: Optional[Dict[str, torch.Tensor]] = None  # the EMA copy's state_dict (train.ema)
    rng: Optional[Dict[str, Any]] = None  # capture_rng_state()
    world_size: int = 1  # processes that trained it (another count changes the data order)
    # a sharded run's (parallel.fsdp): the folder beside this file that holds its model and optimizer shards
    # (torch.distributed.checkpoint, any world size); ``model`` then holds the consolidated weights, ``optimizer`` None
    sharded: Optional[str] = None
    version: int = CHECKPOINT_VERSION

    def evaluated_weights(self) -> Dict[str, torch.Tensor]:
        """The weights its run evaluates and exports: the EMA weights when it has them, else the model's."""
        return self.ema if self.ema is not None else self.model

    def to_dict(self) -> Dict[str, Any]:
        """The on-disk layout: {'version', 'config', 'class_names', 'model', 'ema', 'optimizer', 'scheduler',
        'scaler', 'progress': {'step', 'epoch', 'batch_in_epoch', 'best', 'best_step'}, 'rng', 'world_size',
        'sharded'}."""
        p = self.progress
        return {'version': self.version, 'config': self.config,
                'class_names': list(self.class_names) if self.class_names is not None else None,
                'model': self.model, 'ema': self.ema, 'optimizer': self.optimizer, 'scheduler': self.scheduler,
                'scaler': self.scaler,
                'progress': {'step': p.step, 'epoch': p.epoch, 'batch_in_epoch': p.batch_in_epoch, 'best': p.best,
                             'best_step': p.best_step},
                'rng': self.rng, 'world_size': self.world_size, 'sharded': self.sharded}

    @classmethod
    def from_dict(cls, state: Dict[str, Any]) -> 'Checkpoint':
        names = state.get('class_names')
        return cls(model=state['model'], config=state.get('config'),
                   class_names=[str(n) for n in names] if names is not None else None,
                   progress=Progress(**state.get('progress', {})), optimizer=state.get('optimizer'),
                   scheduler=state.get('scheduler'), scaler=state.get('scaler'), ema=state.get('ema'),
                   rng=state.get('rng'), world_size=int(state.get('world_size', 1)), sharded=state.get('sharded'),
                   version=int(state.get('version', CHECKPOINT_VERSION)))

    def save(self, path: PathLike) -> None:
        """Write it to ``path`` atomically: a crash at any moment leaves the previous file whole."""
        save_checkpoint(path, self.to_dict())

    @classmethod
    def load(cls, path: PathLike, map_location: Any = 'cpu') -> 'Checkpoint':
        """The checkpoint at ``path``: FileNotFoundError if it is missing, CheckpointError (one line naming the file)
        if it is not a torch file of plain data or holds no model weights."""
        state = load_checkpoint(path, map_location)
        if not isinstance(state.get('model'), dict):
            raise CheckpointError(f"{path} is not a linvit training checkpoint: it has no 'model' weights (expected a "
                                  f"best.pt / last.pt that train.py wrote, or a .safetensors weights file)")
        return cls.from_dict(state)


def load_safetensors(path: PathLike) -> Dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file; FileNotFoundError or CheckpointError (one line) naming ``path``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f'weights file {path} does not exist')
    try:
        return load_file(path)
    except SafetensorError as e:
        raise CheckpointError(f'{path} is not a .safetensors weights file or is corrupt ({_first_line(e)})') from e


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _unreadable_because(error: Exception) -> str:
    """Why torch.load(weights_only=True) refused a file, in a few words (its own message is a page of advice)."""
    if isinstance(error, pickle.UnpicklingError):
        refused = re.search(r'GLOBAL (\S+)', str(error))
        if refused:
            return f'it holds a {refused.group(1)} object, which only a full (code-running) unpickling can load'
        return 'it is not a torch file of tensors and plain data'
    return f'torch.load cannot read it ({type(error).__name__}: {_first_line(error)})'


def _capture_python_rng() -> Dict[str, Any]:
    version, internal_state, gauss_next = random.getstate()
    # internal_state: 624 words of the Mersenne Twister (< 2**32) and the position, all exact in int64
    return {'version': version, 'state': torch.tensor(internal_state, dtype=torch.int64), 'gauss_next': gauss_next}


def _restore_python_rng(state: Dict[str, Any]) -> None:
    random.setstate((state['version'], tuple(int(x) for x in state['state'].tolist()), state['gauss_next']))


def _capture_numpy_rng() -> Dict[str, Any]:
    bit_generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {'bit_generator': str(bit_generator), 'keys': torch.from_numpy(keys.astype(np.int64)), 'pos': int(pos),
            'has_gauss': int(has_gauss), 'cached_gaussian': float(cached_gaussian)}


def _restore_numpy_rng(state: Dict[str, Any]) -> None:
    keys = state['keys'].numpy().astype(np.uint32)
    np.random.set_state((state['bit_generator'], keys, state['pos'], state['has_gauss'], state['cached_gaussian']))


def _restore_cuda_rng(states: list) -> None:
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(states) != available:
        _logger.warning('the checkpoint holds CUDA RNG states for %d devices, this process sees %d; restoring the '
                        'first %d', len(states), available, min(len(states), available))
    for index, device_state in enumerate(states[:available]):
        torch.cuda.set_rng_state(device_state.cpu(), index)


def capture_rng_state() -> Dict[str, Any]:
    """The state of python's ``random``, numpy's global RNG, torch's CPU RNG and every visible CUDA device's RNG.

    Returns a dict of tensors, ints, floats, str and None that ``save_checkpoint`` accepts and
    ``torch.load(weights_only=True)`` loads: ``{'python': ..., 'numpy': ..., 'torch': uint8 tensor,
    'cuda': [uint8 tensor per device]}`` ('cuda' only when CUDA is available).
    """
    state = {'python': _capture_python_rng(), 'numpy': _capture_numpy_rng(), 'torch': torch.get_rng_state()}
    if torch.cuda.is_available():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Set every RNG ``capture_rng_state`` captured back to the captured state (after a round trip through a file).

    CUDA states are restored per device index; a different device count restores the common ones and warns.
    """
    _restore_python_rng(state['python'])
    _restore_numpy_rng(state['numpy'])
    torch.set_rng_state(state['torch'].cpu())
    if 'cuda' in state:
        _restore_cuda_rng(state['cuda'])


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare model inside DistributedDataParallel / DataParallel (``.module``) and ``torch.compile``
    (``._orig_mod``) wrappers, so saved keys carry no ``module.`` / ``_orig_mod.`` prefix."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, '_orig_mod') and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def _standalone_cpu_tensors(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    # safetensors refuses tensors that share memory (tied weights, views of one buffer) and non-contiguous ones;
    # copying gives every key its own storage, so the file loads with strict=True into a fresh model
    seen_storages = set()
    tensors = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        if storage in seen_storages or not tensor.is_contiguous() or tensor.device.type != 'cpu':
            tensor = tensor.to('cpu', copy=True, memory_format=torch.contiguous_format)
        seen_storages.add(storage)
        tensors[name] = tensor
    return tensors


def save_model_safetensors(model: nn.Module, path: PathLike) -> None:
    """Write the model's ``state_dict`` (of the model inside any DDP / compile wrapper) to a ``.safetensors`` file,
    atomically.

    Every key is stored, tied or aliased tensors as separate copies, so the file loads with strict key matching,
    with ``safetensors.torch.load_file(path)`` or with timm::

        timm.create_model(name, pretrained=True, num_classes=n,
                          pretrained_cfg_overlay=dict(file=path, num_classes=n, custom_load=False))

    ``num_classes`` in the overlay: timm silently drops the classifier weights when the model's class count differs
    from its pretrained_cfg's. ``custom_load=False``: timm before 1.0.31 keeps the name's ``custom_load`` (the
    original ViT .npz reader for e.g. vit_tiny_patch16_224) for an overlaid file, and fails to read it.
    ``path`` should end in ``.safetensors``: timm picks the format by extension.
    """
    from safetensors.torch import save_file

    if Path(path).suffix != '.safetensors':
        _logger.warning('%s does not end in .safetensors; timm will try to read it as a pickle', path)
    tensors = _standalone_cpu_tensors(unwrap_model(model).state_dict())
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata={'format': 'pt'})
