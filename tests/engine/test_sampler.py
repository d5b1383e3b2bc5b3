"""Training and evaluation samplers: shards, padding, resume position, augmentation seeds."""
import pytest

from linvit.engine.sampler import ResumableSampler, ShardSampler, augmentation_seed


def _epoch(size, batch, rank=0, world=1, epoch=0, start=0, seed=0):
    sampler = ResumableSampler(size, batch, seed=seed, rank=rank, world_size=world)
    sampler.set_epoch(epoch, start)
    return list(sampler)


def test_one_epoch_is_a_permutation_in_whole_batches():
    keys = _epoch(10, 3)
    indices = [index for index, _ in keys]
    assert len(indices) == 9 and len(set(indices)) == 9 and set(indices) <= set(range(10))
    assert indices != sorted(indices)
    assert _epoch(10, 3, epoch=1) != keys and _epoch(10, 3, epoch=0) == keys


def test_ranks_split_a_padded_order_without_overlap():
    # 7 samples on 2 ranks: the order is padded to 8 by wrapping, each rank takes every other position
    ranks = [_epoch(7, 2, rank=r, world=2) for r in range(2)]
    single = [index for index, _ in _epoch(7, 1)]  # the same seed and epoch: the same permutation
    padded = single + single[:1]
    assert [index for index, _ in ranks[0]] == padded[0::2][:4]
    assert [index for index, _ in ranks[1]] == padded[1::2][:4]
    seeds = [seed for rank in ranks for _, seed in rank]
    assert len(set(seeds)) == len(seeds)  # every draw of the epoch has its own augmentation seed


def test_resuming_at_a_batch_continues_the_same_order():
    full = _epoch(20, 4, epoch=3)
    assert _epoch(20, 4, epoch=3, start=2) == full[8:]
    with pytest.raises(ValueError, match='outside'):
        _epoch(20, 4, start=6)


def test_too_small_dataset_is_an_error():
    with pytest.raises(ValueError, match='fewer than one batch of data.batch_size=8'):
        ResumableSampler(5, 8)


def test_augmentation_seed_is_32_bit_and_distinct():
    seeds = {augmentation_seed(0, e, p) for e in range(3) for p in range(1000)}
    assert len(seeds) == 3000 and all(0 <= s < 2 ** 32 for s in seeds)


def test_shards_cover_the_set_exactly_once():
    shards = [list(ShardSampler(7, r, 3)) for r in range(3)]
    assert sorted(i for shard in shards for i, _ in shard) == list(range(7))
    assert all(seed == 0 for shard in shards for _, seed in shard)
    assert [len(ShardSampler(7, r, 3)) for r in range(3)] == [3, 2, 2]
