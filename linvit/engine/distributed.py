"""Processes and devices: one code path for one CPU, one GPU, or ``torchrun --nproc_per_node N`` processes.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; with WORLD_SIZE > 1 the process group is created with gloo on CPU
and nccl on CUDA (one GPU per local rank). Only rank 0 writes the run directory.
"""
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ['DistInfo', 'distributed_running', 'setup_distributed', 'cleanup_distributed', 'resolve_device',
           'all_reduce_mean', 'all_reduce_max', 'barrier']


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


def setup_distributed(device: str = 'auto') -> DistInfo:
    """Read torchrun's environment, pick the device, and create the process group when there are several ranks."""
    rank, world_size = _env_int('RANK', 0), _env_int('WORLD_SIZE', 1)
    local_rank = _env_int('LOCAL_RANK', 0)
    resolved = resolve_device(device, local_rank)
    if resolved.type == 'cuda':
        torch.cuda.set_device(resolved)
    if world_size > 1 and not distributed_running():
        backend = 'nccl' if resolved.type == 'cuda' else 'gloo'
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                device_id=resolved if resolved.type == 'cuda' else None)
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


def barrier() -> None:
    if distributed_running():
        dist.barrier()
