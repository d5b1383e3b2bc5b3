"""Top-k counts and confusion matrices against hand-computed tables, the meter against direct computation, and a
2-process gloo reduction."""
import math

import pytest
import torch
import torch.nn.functional as F
from ranks import WORLD_SIZE, run_two_ranks

from linvit.engine.metrics import ClassificationMeter, topk_correct

# Four classes; ks = (1, 2, 5), k=5 clamps to 4 so every sample counts.
# Per row: the ranks of the target's logit and whether it is in the top 1 / top 2 / top 4.
HAND_LOGITS = torch.tensor([
    [0.1, 2.0, 0.3, -1.0],      # target 1: highest                             -> 1 1 1
    [3.0, 0.5, 2.0, 0.0],       # target 2: second                              -> 0 1 1
    [0.0, 1.0, 2.0, 3.0],       # target 0: last                                -> 0 0 1
    [4.0, 4.0, 1.0, 0.0],       # target 2: below a tie of two others            -> 0 0 1
    [5.0, 5.0, 0.0, -1.0],      # target 0: tied for first with class 1         \  one of these two rows at top-1
    [5.0, 5.0, 0.0, -1.0],      # target 1: tied for first with class 0         /  (torch.topk picks), both at top-2
    [-2.0, -1.0, -3.0, -1.5],   # target 3: -1.5 is second among negatives      -> 0 1 1
])
HAND_TARGETS = torch.tensor([1, 2, 0, 2, 0, 1, 3])
HAND_KS = (1, 2, 5)
HAND_COUNTS = [1 + 1, 1 + 1 + 2 + 1, 7]


def reference_topk_counts(logits, targets, ks):
    """Count by rank: the target is in the top k when fewer than k classes score strictly higher (no ties here)."""
    higher = (logits > logits.gather(1, targets[:, None])).sum(dim=1)
    return [int((higher < k).sum()) for k in ks]


DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.skipif(not torch.cuda.is_available(), reason='no CUDA'))]


@pytest.mark.parametrize('device', DEVICES)
def test_topk_correct_matches_the_hand_computed_table(device):
    counts = topk_correct(HAND_LOGITS.to(device), HAND_TARGETS.to(device), ks=HAND_KS)
    assert counts.dtype == torch.int64 and counts.shape == (3,) and counts.device.type == device
    assert counts.tolist() == HAND_COUNTS


def test_topk_correct_row_by_row():
    expected_rows = [[1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 1]]
    for row, expected in enumerate(expected_rows):
        assert topk_correct(HAND_LOGITS[row:row + 1], HAND_TARGETS[row:row + 1], HAND_KS).tolist() == expected


@pytest.mark.parametrize('device', DEVICES)
def test_equal_logits_never_count_more_than_k_classes(device):
    # a collapsed model (one logit for every class) must score chance, not 100%
    logits = torch.zeros(4, 4, device=device)
    targets = torch.arange(4, device=device)
    assert topk_correct(logits, targets, ks=(1, 2, 3, 4)).tolist() == [1, 2, 3, 4]


def test_topk_correct_matches_rank_counting_on_random_logits():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 10, generator=generator)
    targets = torch.randint(0, 10, (64,), generator=generator)
    ks = (1, 3, 5, 20)
    counts = topk_correct(logits, targets, ks).tolist()
    assert counts == reference_topk_counts(logits, targets, ks)
    assert counts[0] == int((logits.argmax(1) == targets).sum())
    assert counts[-1] == 64


def test_topk_correct_in_half_precision():
    counts = topk_correct(HAND_LOGITS.to(torch.bfloat16), HAND_TARGETS, ks=HAND_KS)
    assert counts.tolist() == HAND_COUNTS


@pytest.mark.parametrize('logits, targets, ks, message', [
    (torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), (0,), 'k >= 1'),
    (torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), (), 'non-empty'),
    (torch.zeros(3), torch.zeros(3, dtype=torch.long), (1,), r'\[B, C\]'),
    (torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), (1,), 'targets'),
    (torch.zeros(3, 4), torch.zeros(3, 4), (1,), 'targets'),
])
def test_topk_correct_rejects_bad_input(logits, targets, ks, message):
    with pytest.raises(ValueError, match=message):
        topk_correct(logits, targets, ks)


def random_batch(batch_size, num_classes=7, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, num_classes, generator=generator) * 2
    targets = torch.randint(0, num_classes, (batch_size,), generator=generator)
    return logits, targets


def direct_metrics(logits, targets, ks):
    counts = reference_topk_counts(logits, targets, ks)
    return {**{f'top{k}': c / len(targets) for k, c in zip(ks, counts)},
            'loss': F.cross_entropy(logits.double(), targets).item(), 'count': len(targets)}


def assert_metrics_equal(actual, expected):
    """Counts and fractions exactly; the loss to float32 precision (the meter sums float32 per-sample losses)."""
    assert actual.keys() == expected.keys()
    for key in expected:
        if key == 'loss':
            assert actual[key] == pytest.approx(expected[key], rel=1e-6), key
        else:
            assert actual[key] == expected[key], key


def test_meter_over_batches_equals_the_concatenated_batch():
    logits, targets = random_batch(50)
    losses = F.cross_entropy(logits, targets, reduction='none')
    meter = ClassificationMeter(ks=(1, 3))
    for start, end, per_sample in [(0, 7, True), (7, 27, False), (27, 50, True)]:
        loss = losses[start:end] if per_sample else losses[start:end].sum()
        meter.update(logits[start:end], targets[start:end], loss)
    meter.reduce_()   # not distributed: a no-op
    result = meter.compute()
    assert_metrics_equal(result, direct_metrics(logits, targets, (1, 3)))
    assert isinstance(result['count'], int) and result['count'] == 50
    assert 0 < result['top1'] < result['top3'] < 1


@pytest.mark.parametrize('per_sample_loss', [True, False], ids=['per-sample-loss', 'summed-loss'])
def test_meter_excludes_padded_duplicates(per_sample_loss):
    logits, targets = random_batch(7)
    padded_logits, padded_targets = torch.cat([logits, logits[:3]]), torch.cat([targets, targets[:3]])
    valid = torch.arange(10) < 7
    losses = F.cross_entropy(padded_logits, padded_targets, reduction='none')
    meter = ClassificationMeter(ks=(1, 2))
    meter.update(padded_logits, padded_targets, losses if per_sample_loss else losses[valid].sum(), valid=valid)
    assert_metrics_equal(meter.compute(), direct_metrics(logits, targets, (1, 2)))


def test_meter_counts_only_what_it_is_given():
    meter = ClassificationMeter(ks=(1, 2, 5))
    meter.update(HAND_LOGITS, HAND_TARGETS, torch.tensor(3.5))
    assert meter.compute() == {'top1': 2 / 7, 'top2': 5 / 7, 'top5': 1.0, 'loss': 0.5, 'count': 7}
    meter.reset()
    meter.update(HAND_LOGITS[:2], HAND_TARGETS[:2], torch.tensor([1.0, 2.0]))
    assert meter.compute() == {'top1': 0.5, 'top2': 1.0, 'top5': 1.0, 'loss': 1.5, 'count': 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason='no CUDA')
def test_meter_update_does_not_synchronise_with_the_host():
    logits, targets = random_batch(32)
    losses = F.cross_entropy(logits, targets, reduction='none')
    valid = torch.arange(32) < 30
    # each round: 30 valid samples of a padded batch, then the first 4 again with a summed loss
    correct = [a + b for a, b in zip(reference_topk_counts(logits[:30], targets[:30], (1, 5)),
                                     reference_topk_counts(logits[:4], targets[:4], (1, 5)))]
    loss_sum = losses[:30].double().sum().item() + losses[:4].double().sum().item()
    expected = {'top1': 3 * correct[0] / 102, 'top5': 3 * correct[1] / 102, 'loss': 3 * loss_sum / 102, 'count': 102}

    logits, targets, losses, valid = (t.cuda() for t in (logits, targets, losses, valid))
    meter = ClassificationMeter(ks=(1, 5), device='cuda', num_classes=logits.shape[1])   # the confusion counts too
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')   # any synchronising call raises
    try:
        for _ in range(3):
            meter.update(logits, targets, losses, valid=valid)
            meter.update(logits[:4], targets[:4], losses[:4].sum())
    finally:
        torch.cuda.set_sync_debug_mode('default')
    assert_metrics_equal(meter.compute(), expected)
    assert int(meter.confusion().trace()) == 3 * correct[0]


def test_empty_meter_computes_nan():
    result = ClassificationMeter().compute()
    assert result['count'] == 0 and math.isnan(result['top1']) and math.isnan(result['loss'])
    meter = ClassificationMeter(ks=(1,))
    meter.update(HAND_LOGITS[:2], HAND_TARGETS[:2], torch.ones(2), valid=torch.zeros(2, dtype=torch.bool))
    result = meter.compute()
    assert result['count'] == 0 and math.isnan(result['top1'])


def test_meter_refuses_to_count_twice():
    meter = ClassificationMeter()
    meter.update(HAND_LOGITS, HAND_TARGETS, torch.tensor(1.0))
    meter.reduce_()
    with pytest.raises(RuntimeError, match='twice'):
        meter.reduce_()
    with pytest.raises(RuntimeError, match='reset'):
        meter.update(HAND_LOGITS, HAND_TARGETS, torch.tensor(1.0))
    meter.reset()
    meter.update(HAND_LOGITS, HAND_TARGETS, torch.tensor(1.0))
    assert meter.compute()['count'] == 7


@pytest.mark.parametrize('loss, valid, message', [
    (torch.ones(3), None, 'loss'),
    (torch.ones(7, 1), None, 'loss'),
    (torch.ones(7), torch.ones(7), 'valid'),
    (torch.ones(7), torch.ones(6, dtype=torch.bool), 'valid'),
])
def test_meter_rejects_bad_input(loss, valid, message):
    with pytest.raises(ValueError, match=message):
        ClassificationMeter().update(HAND_LOGITS, HAND_TARGETS, loss, valid=valid)


# --- confusion matrix -------------------------------------------------------------------------------------------

# Three classes, clear winners (no ties); row = target, column = the largest logit.
CONFUSION_LOGITS = torch.tensor([
    [2.0, 0.1, 0.3],     # target 0 -> 0
    [0.2, 1.5, 0.1],     # target 0 -> 1
    [0.0, 0.1, 3.0],     # target 2 -> 2
    [1.0, 0.0, 0.5],     # target 1 -> 0
    [0.3, 0.2, 0.9],     # target 1 -> 2, a padded duplicate (valid False): not counted
    [0.1, 0.9, 0.0],     # target 1 -> 1
])
CONFUSION_TARGETS = torch.tensor([0, 0, 2, 1, 1, 1])
CONFUSION_VALID = torch.tensor([True, True, True, True, False, True])
HAND_CONFUSION = [[1, 1, 0],
                  [1, 1, 0],
                  [0, 0, 1]]


def reference_confusion(logits, targets, num_classes):
    """Sample by sample, in plain Python: row target, column argmax."""
    matrix = [[0] * num_classes for _ in range(num_classes)]
    for row, target in zip(logits.tolist(), targets.tolist()):
        matrix[target][row.index(max(row))] += 1
    return matrix


def test_confusion_matches_the_hand_count_over_split_batches():
    meter = ClassificationMeter(ks=(1, 2), num_classes=3)
    assert meter.confusion().tolist() == [[0] * 3] * 3, 'empty before the first batch'
    losses = F.cross_entropy(CONFUSION_LOGITS, CONFUSION_TARGETS, reduction='none')
    for part in (slice(0, 2), slice(2, 6)):
        meter.update(CONFUSION_LOGITS[part], CONFUSION_TARGETS[part], losses[part], valid=CONFUSION_VALID[part])
    confusion = meter.confusion()
    assert confusion.dtype == torch.int64 and confusion.device.type == 'cpu'
    assert confusion.tolist() == HAND_CONFUSION
    # the existing metrics are unchanged by the extra counter
    result = meter.compute()
    assert set(result) == {'top1', 'top2', 'loss', 'count'} and result['count'] == 5 and result['top1'] == 3 / 5


def test_confusion_trace_is_top1_even_with_ties():
    # HAND_LOGITS has ties for first place: the confusion's column must be the class top1 counted
    meter = ClassificationMeter(ks=(1,), num_classes=4)
    meter.update(HAND_LOGITS, HAND_TARGETS, torch.tensor(1.0))
    confusion = meter.confusion()
    assert int(confusion.trace()) == HAND_COUNTS[0] and int(confusion.sum()) == 7
    assert confusion.sum(dim=1).tolist() == [2, 2, 2, 1], 'row sums: samples per target'


def test_confusion_on_random_batches_matches_the_sample_loop():
    logits, targets = random_batch(50)
    meter = ClassificationMeter(ks=(1,), num_classes=7)
    meter.update(logits, targets, torch.tensor(0.0))
    assert meter.confusion().tolist() == reference_confusion(logits, targets, 7)


def test_confusion_leaves_out_targets_that_are_not_classes():
    meter = ClassificationMeter(ks=(1,), num_classes=3)
    meter.update(CONFUSION_LOGITS[:3], torch.tensor([0, 7, -1]), torch.tensor(0.0))
    assert meter.confusion().tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert meter.compute()['count'] == 3


def test_confusion_needs_num_classes_and_logits_of_that_width():
    with pytest.raises(ValueError, match='num_classes=C'):
        ClassificationMeter().confusion()
    with pytest.raises(ValueError, match='num_classes'):
        ClassificationMeter(num_classes=0)
    with pytest.raises(ValueError, match='C=5'):
        ClassificationMeter(num_classes=5).update(CONFUSION_LOGITS, CONFUSION_TARGETS, torch.tensor(0.0))


# --- two processes ----------------------------------------------------------------------------------------------

NUM_SAMPLES, KS = 15, (1, 3)


def sampler_shards(logits, targets, empty_rank=None):
    """Split like DistributedSampler(shuffle=False, drop_last=False): pad the index list to a multiple of the world
    size with its first indices, give rank r every world_size-th index from r. Per rank: batches of at most 5 as
    (logits [b, C], targets [b], per-sample losses [b], valid [b])."""
    if empty_rank is not None:   # every sample on the other rank
        indices_per_rank = {empty_rank: [], 1 - empty_rank: list(range(NUM_SAMPLES))}
    else:
        padded = list(range(NUM_SAMPLES)) + list(range(-NUM_SAMPLES % WORLD_SIZE))
        indices_per_rank = {rank: padded[rank::WORLD_SIZE] for rank in range(WORLD_SIZE)}
    shards = {}
    for rank, indices in indices_per_rank.items():
        # position p of the padded list is a duplicate when p >= NUM_SAMPLES
        positions = torch.tensor([rank + WORLD_SIZE * i for i in range(len(indices))], dtype=torch.long)
        valid = positions < NUM_SAMPLES if empty_rank is None else torch.ones(len(indices), dtype=torch.bool)
        index = torch.tensor(indices, dtype=torch.long)
        batch_logits, batch_targets = logits[index], targets[index]
        losses = F.cross_entropy(batch_logits, batch_targets, reduction='none')
        shards[rank] = [(batch_logits[s:s + 5], batch_targets[s:s + 5], losses[s:s + 5], valid[s:s + 5])
                        for s in range(0, len(indices), 5)]
    return shards


def reduce_on_rank(rank, shards, num_classes=None):
    meter = ClassificationMeter(ks=KS, num_classes=num_classes)
    for logits, targets, losses, valid in shards[rank]:
        meter.update(logits, targets, losses, valid=valid)
    meter.reduce_()
    if num_classes is None:
        return meter.compute()
    return {'metrics': meter.compute(), 'confusion': meter.confusion().tolist()}


@pytest.mark.parametrize('empty_rank', [None, 1], ids=['padded-duplicate', 'rank1-without-data'])
def test_two_processes_reduce_to_the_single_process_result(tmp_path, empty_rank):
    logits, targets = random_batch(NUM_SAMPLES, seed=1)
    results = run_two_ranks(tmp_path, reduce_on_rank, sampler_shards(logits, targets, empty_rank))

    single = ClassificationMeter(ks=KS)
    single.update(logits, targets, F.cross_entropy(logits, targets, reduction='none'))
    expected = single.compute()
    assert_metrics_equal(expected, direct_metrics(logits, targets, KS))
    for result in results:
        assert_metrics_equal(result, expected)


@pytest.mark.parametrize('empty_rank', [None, 1], ids=['padded-duplicate', 'rank1-without-data'])
def test_two_processes_reduce_the_confusion_matrix(tmp_path, empty_rank):
    logits, targets = random_batch(NUM_SAMPLES, seed=1)
    num_classes = logits.shape[1]
    results = run_two_ranks(tmp_path, reduce_on_rank, sampler_shards(logits, targets, empty_rank), num_classes)
    # every sample once: the padded duplicate is not counted, and a rank without data still takes part
    expected = reference_confusion(logits, targets, num_classes)
    assert sum(map(sum, expected)) == NUM_SAMPLES
    for result in results:
        assert result['confusion'] == expected
        assert_metrics_equal(result['metrics'], direct_metrics(logits, targets, KS))
