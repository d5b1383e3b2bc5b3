"""Samplers whose order depends only on (seed, epoch, rank), so a resumed run sees exactly the batches it would have.

``ResumableSampler`` (training) shuffles with a generator seeded from (seed, epoch), pads the order to a multiple
of the world size by wrapping around (every rank must run the same number of steps under DDP), gives rank r the
positions r, r + world, ..., and can start at any batch of the epoch. It yields (index, augmentation seed) keys:
datasets seed each sample's augmentation from that key, so augmentation does not depend on which DataLoader worker
loads the sample, nor on how many workers there are. ``ShardSampler`` (evaluation) splits the dataset into
disjoint, unpadded, unshuffled shards, so metrics summed over ranks count every sample exactly once.
"""
from typing import Iterator, Tuple

import torch
from torch.utils.data import Sampler

from .config import ConfigError

__all__ = ['ResumableSampler', 'ShardSampler', 'augmentation_seed']

_MIX = 0x9E3779B1  # odd constant: distinct (seed, epoch, position) triples give distinct 32-bit seeds in practice


def augmentation_seed(seed: int, epoch: int, position: int) -> int:
    """A 32-bit seed for one sample draw, a function of the run seed, the epoch and the position in the epoch."""
    return ((seed * _MIX + epoch) * _MIX + position) % (2 ** 32)


class ResumableSampler(Sampler[Tuple[int, int]]):
    """Training order for one rank: ``batches_per_epoch`` whole batches of ``batch_size`` keys (index, aug_seed).

    size: dataset length; seed: the run seed; shuffle: permute per epoch; rank / world_size: this process's share.
    The last incomplete batch of a rank's share is dropped (as DataLoader(drop_last=True) would).
    Call ``set_epoch(epoch, start_batch)`` before iterating.
    """

    def __init__(self, size: int, batch_size: int, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1) -> None:
        if size < 1:
            raise ValueError("the training set is empty")
        per_rank = -(-size // world_size)
        if per_rank < batch_size:
            raise ConfigError(f"the training set has {size} samples, {per_rank} per process, fewer than one batch of "
                              f"data.batch_size={batch_size}; lower data.batch_size")
        self.size = size
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.batches_per_epoch = per_rank // batch_size
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch {start_batch} is outside the epoch's {self.batches_per_epoch} batches")
        self.epoch = epoch
        self.start_batch = start_batch

    def _epoch_order(self) -> torch.Tensor:
        if self.shuffle:
            generator = torch.Generator().manual_seed(augmentation_seed(self.seed, self.epoch, 2 ** 31))
            order = torch.randperm(self.size, generator=generator)
        else:
            order = torch.arange(self.size)
        padded = -(-self.size // self.world_size) * self.world_size
        if padded > self.size:
            order = torch.cat([order, order[:padded - self.size]])
        return order

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        order = self._epoch_order().tolist()  # one conversion, not a tensor index per sample
        first = self.start_batch * self.batch_size
        last = self.batches_per_epoch * self.batch_size
        for position in range(first, last):
            global_position = position * self.world_size + self.rank
            yield order[global_position], augmentation_seed(self.seed, self.epoch, global_position)

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size


class ShardSampler(Sampler[Tuple[int, int]]):
    """Evaluation order for one rank: keys (index, 0) for indices rank, rank + world, ... (no padding, no shuffling).

    The fixed seed keeps evaluation from drawing a seed from torch's global generator, which would shift the
    training run's random stream (dropout, drop path) whenever it evaluates.
    """

    def __init__(self, size: int, rank: int = 0, world_size: int = 1) -> None:
        self.size = size
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        return ((index, 0) for index in range(self.rank, self.size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))
