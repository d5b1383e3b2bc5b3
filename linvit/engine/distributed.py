"""Processes and devices: one code path for one CPU, one GPU, or ``torchrun --nproc_per_node N`` processes.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; with WORLD_SIZE > 1 the process group is created with gloo on CPU
and nccl on CUDA (one GPU per local rank). Only rank 0 writes the run directory.

Elastic restarts (``torchrun --max-restarts N``): when a worker dies, torchrun stops the others (SIGTERM) and starts
the whole worker group again, TORCHELASTIC_RESTART_COUNT one higher. Each attempt's process group meets under a
prefix of its own in torchrun's store (``elastic_attempt``): the agent's store outlives the attempts, and without
the prefix a new worker could read the address a dead one published and fail with 'gloo: connection refused'.

SIGTERM (``Termination``): what schedulers (SLURM, Kubernetes) and torchrun send before killing a job. During the
training steps it is a request, agreed by all processes at the next step boundary, to save a checkpoint and stop;
elsewhere it stops the run at once (``SigtermReceived``), with nothing new to save.
"""
import contextlib
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ['DistInfo', 'distributed_running', 'setup_distributed', 'cleanup_distributed', 'resolve_device',
           'all_reduce_mean', 'all_reduce_max', 'barrier', 'broadcast_from_main', 'elastic_attempt', 'elastic_launch',
           'Termination', 'SigtermReceived', 'TERMINATION']

_logger = logging.getLogger('linvit.train')


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def distributed_running() -> bool:
    """Whether this process is part of a torch.distributed process group (torchrun with several ranks)."""
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError as error:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from error


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """'auto' -> cuda:<local_rank> when CUDA is available, else cpu; 'cuda' -> cuda:<local_rank>; others as given."""
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if device == 'cuda':
        device = f'cuda:{local_rank}'
    resolved = torch.device(device)
    if resolved.type == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device=cpu or device=auto")
    return resolved


def elastic_attempt() -> Optional[int]:
    """Which start of torchrun's worker group this process belongs to (TORCHELASTIC_RESTART_COUNT: 0 the first, 1
    after one restart, ...); None outside torchrun."""
    value = os.environ.get('TORCHELASTIC_RESTART_COUNT')
    return None if value is None else _env_int('TORCHELASTIC_RESTART_COUNT', 0)


def elastic_launch() -> Optional[str]:
    """What names this torchrun launch in each of its attempts (None outside torchrun): its run id
    (TORCHELASTIC_RUN_ID: ``--rdzv_id``, a fresh uuid with ``--standalone``), or, for a static rendezvous without an
    id (torchrun's default 'none'), this node's agent, host and process id (the workers' parent, which restarts
    them). Rank 0's is the one that counts (``broadcast_from_main``): a static rendezvous keeps rank 0 on node 0."""
    if elastic_attempt() is None:
        return None
    run_id = os.environ.get('TORCHELASTIC_RUN_ID', 'none')
    return run_id if run_id not in ('', 'none') else f"{socket.gethostname()}:{os.getppid()}"


def _process_group_store(rank: int, world_size: int) -> dist.Store:
    """Where the process group meets: torchrun's env:// store (MASTER_ADDR:MASTER_PORT), under a prefix of this
    attempt. torchrun's agent keeps one store for all the attempts of a launch (TORCHELASTIC_USE_AGENT_STORE), and
    init_process_group files every attempt's gloo addresses under the same keys: a restarted worker could read the
    address of a worker that died and fail at random with 'gloo: connection refused' (or wait forever)."""
    store, _, _ = next(dist.rendezvous('env://', rank=rank, world_size=world_size))
    return dist.PrefixStore(f'linvit/attempt{elastic_attempt() or 0}', store)


def setup_distributed(device: str = 'auto') -> DistInfo:
    """Read torchrun's environment, pick the device, and create the process group when there are several ranks."""
    rank, world_size = _env_int('RANK', 0), _env_int('WORLD_SIZE', 1)
    local_rank = _env_int('LOCAL_RANK', 0)
    resolved = resolve_device(device, local_rank)
    if resolved.type == 'cuda':
        torch.cuda.set_device(resolved)
    if world_size > 1 and not distributed_running():
        backend = 'nccl' if resolved.type == 'cuda' else 'gloo'
        dist.init_process_group(backend=backend, store=_process_group_store(rank, world_size), rank=rank,
                                world_size=world_size, device_id=resolved if resolved.type == 'cuda' else None)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=resolved)


def cleanup_distributed() -> None:
    """Destroy this process's process group, if it has one (nothing on one process): what ends a torchrun process
    after its run, so that it exits without a leaked group (``train.py``'s main calls it, whatever the outcome).
    ``train`` itself leaves the group alone: a caller may run several trainings in one group."""
    if distributed_running():
        dist.destroy_process_group()


def all_reduce_mean(value: torch.Tensor, info: Optional[DistInfo] = None) -> torch.Tensor:
    """The mean of ``value`` over all ranks (a copy; ``value`` itself is unchanged); itself on one process."""
    if not distributed_running():
        return value.clone()
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of ``value`` over all ranks (a copy); itself on one process."""
    out = value.detach().clone()
    if distributed_running():
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def broadcast_from_main(value: Any) -> Any:
    """Rank 0's ``value`` (a picklable object) on every rank, so that all take the decision rank 0 took; ``value``
    itself on one process."""
    if not distributed_running():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if distributed_running():
        dist.barrier()


class SigtermReceived(KeyboardInterrupt):
    """SIGTERM stopped the run where no checkpoint could be written; the message says why (the trainer turns it into
    its one line: what is kept and how to continue)."""


class Termination:
    """SIGTERM as a request to stop cleanly, for one process or all of torchrun's.

        with TERMINATION.handling():                 # around a training (train): SIGTERM is caught
            with TERMINATION.deferred():             # the steps: SIGTERM waits for a step boundary
                ...; if TERMINATION.agreed(): save a checkpoint, stop

    Outside ``deferred`` a SIGTERM raises ``SigtermReceived`` at once (setup, the final evaluation: there is no step
    to save). Inside it, the signal only sets a flag; ``agreed`` all-reduces the flags at a step boundary, so every
    process sees the same answer at the same step (a scheduler signals every process, torchrun forwards its own
    SIGTERM to the workers, and a signal sent to one worker stops them all) and none waits in a collective for a
    process that left. A second SIGTERM before that boundary stops at once, without a checkpoint.
    """

    def __init__(self) -> None:
        self.received = False  # a SIGTERM arrived since ``handling`` began
        self._deferring = False
        self._group = None  # the CPU (gloo) group of the flag's all-reduce; None: the default group is gloo

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """Catch SIGTERM while the block runs (the main thread only: Python delivers signals there); the previous
        handler comes back after it."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, self._handle)
        self.received = False
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """While the block runs, SIGTERM waits for ``agreed`` at a step boundary. Every process enters it together
        (on nccl it creates the flag's gloo group)."""
        if distributed_running() and dist.get_backend() != 'gloo':
            self._group = dist.new_group(backend='gloo')  # the flag stays on the CPU: no device sync per step
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            if self._group is not None and distributed_running():
                dist.destroy_process_group(self._group)
            self._group = None

    def _handle(self, signum: int, frame: object) -> None:
        if self._deferring and not self.received:
            self.received = True
            _logger.warning("SIGTERM received: the run saves a checkpoint at the next step boundary and stops (a "
                            "second SIGTERM stops it at once, without one)")
            return
        self.received = True
        raise SigtermReceived("a second SIGTERM before the next step boundary" if self._deferring
                              else "SIGTERM outside the training steps (setup or an evaluation)")

    def agreed(self) -> bool:
        """Whether any process received SIGTERM: the same answer on every process (one all-reduce of a flag over
        the CPU). A process that received one and finds the others gone raises ``SigtermReceived`` (no checkpoint
        can be agreed on)."""
        if not distributed_running():
            return self.received
        flag = torch.tensor([int(self.received)], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        except RuntimeError as error:  # a peer died (torchrun then stops the rest with SIGTERM)
            if not self.received:
                raise
            raise SigtermReceived(f"SIGTERM while another process had stopped ({str(error).splitlines()[0][:120]})"
                                  ) from None
        return bool(flag.item())


#: the process's SIGTERM handling (one per process, as signal handlers are)
TERMINATION = Termination()
