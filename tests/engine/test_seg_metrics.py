"""Segmentation metrics: a confusion matrix and IoUs computed by hand, accumulation, bad targets, and a 2-process gloo
reduction against the single-process meter."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ranks import run_two_ranks

from linvit.engine.metrics import SegmentationMeter, confusion_matrix

I = 255  # noqa: E741  (ignore_index, one letter so the maps below line up)

# Four classes: 0 and 1 in ground truth and prediction, 2 only in the prediction, 3 nowhere that counts (it is only
# predicted on ignored pixels). 13 of the 16 pixels are labelled.
HAND_TARGETS = torch.tensor([
    [0, 0, 1, 1],
    [0, 0, 1, 1],
    [0, I, 1, 1],
    [I, I, 0, 1],
])
HAND_PREDS = torch.tensor([
    [0, 0, 1, 2],
    [0, 1, 1, 1],
    [2, 3, 1, 0],
    [3, 0, 0, 1],
])
# (target, prediction) pairs counted pixel by pixel from the maps above:
#   target 0: (0,0) x4 [r0c0 r0c1 r1c0 r3c2], (0,1) x1 [r1c1], (0,2) x1 [r2c0]
#   target 1: (1,1) x5 [r0c2 r1c2 r1c3 r2c2 r3c3], (1,2) x1 [r0c3], (1,0) x1 [r2c3]
HAND_CONFUSION = [
    [4, 1, 1, 0],
    [1, 5, 1, 0],
    [0, 0, 0, 0],
    [0, 0, 0, 0],
]
# IoU_c = TP / (row_c + column_c - TP):  class 0: 4 / (6 + 5 - 4);  class 1: 5 / (7 + 6 - 5);  class 2: 0 / (0 + 2 - 0)
HAND_IOU = [4 / 7, 5 / 8, 0.0, math.nan]
HAND_MIOU = (4 / 7 + 5 / 8 + 0.0) / 3
HAND_PIXEL_ACC = (4 + 5) / 13


def one_hot_logits(preds: torch.Tensor, num_classes: int, dtype=torch.float32) -> torch.Tensor:
    """[B, H, W] class indices -> logits [B, K, H, W] whose argmax is ``preds``."""
    return F.one_hot(preds, num_classes).permute(0, 3, 1, 2).to(dtype)


def reference_confusion(preds: torch.Tensor, targets: torch.Tensor, num_classes: int, ignore_index: int) -> np.ndarray:
    """Pixel by pixel in Python: independent of the tensor code."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    for p, t in zip(preds.reshape(-1).tolist(), targets.reshape(-1).tolist()):
        if t != ignore_index:
            matrix[t, p] += 1
    return matrix


def assert_per_class_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert (math.isnan(a) and math.isnan(e)) or a == pytest.approx(e, rel=1e-12), (actual, expected)


def assert_scores_equal(actual, expected):
    assert actual.keys() == expected.keys()
    assert actual['pixels'] == expected['pixels']
    assert_per_class_equal(actual['per_class_iou'], expected['per_class_iou'])
    for key in ('miou', 'pixel_acc'):
        assert actual[key] == pytest.approx(expected[key], rel=1e-12), key
    assert actual['loss'] == pytest.approx(expected['loss'], rel=1e-6)


@pytest.mark.parametrize('target_dtype', [torch.int64, torch.uint8, torch.int32])
def test_confusion_matrix_matches_the_hand_count(target_dtype):
    matrix = confusion_matrix(HAND_PREDS, HAND_TARGETS.to(target_dtype), num_classes=4, ignore_index=I)
    assert matrix.dtype == torch.int64 and matrix.tolist() == HAND_CONFUSION
    assert matrix.tolist() == reference_confusion(HAND_PREDS, HAND_TARGETS, 4, I).tolist()


def test_confusion_matrix_rows_are_ground_truth():
    # every pixel is class 0 and predicted as class 2: one count in row 0, column 2
    matrix = confusion_matrix(torch.full((2, 3), 2), torch.zeros(2, 3, dtype=torch.long), 3, I)
    assert matrix.tolist() == [[0, 0, 6], [0, 0, 0], [0, 0, 0]]


def test_confusion_matrix_on_random_maps_matches_the_pixel_loop():
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 6, (3, 9, 11), generator=generator)
    targets[targets == 5] = I                       # about a sixth ignored
    preds = torch.randint(0, 5, (3, 9, 11), generator=generator)
    matrix = confusion_matrix(preds, targets, 5, I)
    np.testing.assert_array_equal(matrix.numpy(), reference_confusion(preds, targets, 5, I))
    assert int(matrix.sum()) == int((targets != I).sum())


@pytest.mark.parametrize('bad_value', [4, 7, -1, 254])
def test_confusion_matrix_names_a_bad_target(bad_value):
    targets = HAND_TARGETS.clone()
    targets[1, 2] = bad_value
    with pytest.raises(ValueError, match=rf'target value {bad_value} is outside 0\.\.3 and is not ignore_index=255'):
        confusion_matrix(HAND_PREDS, targets, 4, I)


def test_confusion_matrix_rejects_bad_input():
    with pytest.raises(ValueError, match='prediction value 9'):
        confusion_matrix(torch.tensor([0, 9]), torch.tensor([0, 1]), 4, I)
    with pytest.raises(ValueError, match='same shape'):
        confusion_matrix(torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long), 4, I)
    with pytest.raises(ValueError, match='integer'):
        confusion_matrix(torch.zeros(3, dtype=torch.long), torch.zeros(3), 4, I)


def test_meter_scores_of_the_hand_map():
    meter = SegmentationMeter(num_classes=4, ignore_index=I)
    meter.update(one_hot_logits(HAND_PREDS[None], 4, torch.bfloat16), HAND_TARGETS[None], torch.tensor(6.5))
    meter.reduce_()   # not distributed: a no-op
    assert meter.confusion().tolist() == HAND_CONFUSION
    result = meter.compute()
    assert result['pixels'] == 13 and isinstance(result['pixels'], int)
    assert result['miou'] == pytest.approx(HAND_MIOU, rel=1e-12)
    assert result['pixel_acc'] == pytest.approx(HAND_PIXEL_ACC, rel=1e-12)
    assert result['loss'] == pytest.approx(6.5 / 13, rel=1e-12)
    assert_per_class_equal(result['per_class_iou'], HAND_IOU)
    assert isinstance(result['per_class_iou'], list)


def test_meter_over_batches_equals_one_batch_and_the_direct_loss():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 6, 7, 9, generator=generator)
    targets = torch.randint(0, 6, (5, 7, 9), generator=generator)
    targets[:, :2, :3] = I

    def loss_sum(lo, ta):
        return F.cross_entropy(lo, ta, ignore_index=I, reduction='sum')

    whole = SegmentationMeter(6)
    whole.update(logits, targets, loss_sum(logits, targets))
    split = SegmentationMeter(6)
    for start, end in [(0, 1), (1, 4), (4, 5)]:
        split.update(logits[start:end], targets[start:end], loss_sum(logits[start:end], targets[start:end]))
    assert torch.equal(split.confusion(), whole.confusion())
    np.testing.assert_array_equal(whole.confusion().numpy(), reference_confusion(logits.argmax(1), targets, 6, I))
    expected = whole.compute()
    assert_scores_equal(split.compute(), expected)
    assert expected['loss'] == pytest.approx(F.cross_entropy(logits.double(), targets, ignore_index=I).item(),
                                             rel=1e-6)
    assert expected['pixels'] == 5 * (7 * 9 - 6)
    assert 0 <= expected['miou'] <= 1 and 0 <= expected['pixel_acc'] <= 1


def test_meter_perfect_and_empty():
    meter = SegmentationMeter(3)
    targets = torch.tensor([[[0, 1], [1, I]]])
    meter.update(one_hot_logits(targets.clamp(max=2), 3), targets, torch.tensor(0.0))
    result = meter.compute()
    # class 2 is absent from both: NaN, left out of the mean, so a perfect prediction scores 1
    assert result['miou'] == 1.0 and result['pixel_acc'] == 1.0 and result['pixels'] == 3
    assert_per_class_equal(result['per_class_iou'], [1.0, 1.0, math.nan])

    empty = SegmentationMeter(3).compute()
    assert empty['pixels'] == 0 and all(math.isnan(empty[k]) for k in ('miou', 'pixel_acc', 'loss'))
    assert len(empty['per_class_iou']) == 3 and all(math.isnan(v) for v in empty['per_class_iou'])
    all_ignored = SegmentationMeter(3)
    all_ignored.update(torch.zeros(1, 3, 2, 2), torch.full((1, 2, 2), I), torch.tensor(0.0))
    assert all_ignored.compute()['pixels'] == 0 and math.isnan(all_ignored.compute()['miou'])


def test_meter_raises_on_a_bad_target_in_compute():
    meter = SegmentationMeter(4)
    meter.update(one_hot_logits(HAND_PREDS[None], 4), HAND_TARGETS[None], torch.tensor(1.0))   # fine
    targets = HAND_TARGETS.clone()
    targets[0, 0], targets[3, 3] = 9, 6
    meter.update(one_hot_logits(HAND_PREDS[None], 4), targets[None], torch.tensor(1.0))        # queued, no raise
    with pytest.raises(ValueError, match=r'target value 9 is outside 0\.\.3 .*\(2 such pixels\)'):
        meter.compute()


def test_meter_refuses_bad_input_and_double_counting():
    with pytest.raises(ValueError, match='ignore_index=1'):
        SegmentationMeter(3, ignore_index=1)
    meter = SegmentationMeter(4)
    logits = one_hot_logits(HAND_PREDS[None], 4)
    with pytest.raises(ValueError, match=r'K=4'):
        meter.update(logits[:, :3], HAND_TARGETS[None], torch.tensor(1.0))
    with pytest.raises(ValueError, match='targets'):
        meter.update(logits, HAND_TARGETS, torch.tensor(1.0))
    with pytest.raises(ValueError, match='loss_sum'):
        meter.update(logits, HAND_TARGETS[None], torch.ones(1))
    meter.update(logits, HAND_TARGETS[None], torch.tensor(1.0))
    meter.reduce_()
    with pytest.raises(RuntimeError, match='twice'):
        meter.reduce_()
    with pytest.raises(RuntimeError, match='reset'):
        meter.update(logits, HAND_TARGETS[None], torch.tensor(1.0))
    meter.reset()
    assert meter.compute()['pixels'] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason='no CUDA')
def test_meter_update_does_not_synchronise_with_the_host():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 16, 16, generator=generator)
    targets = torch.randint(0, 5, (2, 16, 16), generator=generator)
    targets[:, 0] = I
    loss_sum = F.cross_entropy(logits, targets, ignore_index=I, reduction='sum')
    expected = SegmentationMeter(5)
    for _ in range(3):
        expected.update(logits, targets, loss_sum)

    logits, targets, loss_sum = logits.cuda(), targets.cuda(), loss_sum.cuda()
    meter = SegmentationMeter(5, device='cuda')
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')   # any synchronising call raises
    try:
        for _ in range(3):
            meter.update(logits, targets, loss_sum)
    finally:
        torch.cuda.set_sync_debug_mode('default')
    assert_scores_equal(meter.compute(), expected.compute())


# --- two processes ----------------------------------------------------------------------------------------------

NUM_CLASSES = 5


def random_segmentation_data(seed=3):
    """Six images [6, K, 6, 8] of logits with targets [6, 6, 8] (some ignored) and per-image loss sums [6]."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, NUM_CLASSES, 6, 8, generator=generator)
    targets = torch.randint(0, NUM_CLASSES, (6, 6, 8), generator=generator)
    targets[targets.eq(0) & (torch.rand(6, 6, 8, generator=generator) < 0.5)] = I
    losses = torch.stack([F.cross_entropy(logits[i:i + 1], targets[i:i + 1], ignore_index=I, reduction='sum')
                          for i in range(6)])
    return logits, targets, losses


def reduce_on_rank(rank, shards):
    meter = SegmentationMeter(NUM_CLASSES, ignore_index=I)
    for logits, targets, loss_sum in shards[rank]:
        meter.update(logits, targets, loss_sum)
    meter.reduce_()
    try:
        return meter.compute()
    except ValueError as error:
        return {'error': str(error)}


@pytest.mark.parametrize('split', ['interleaved', 'rank1-without-data'])
def test_two_processes_reduce_to_the_single_process_result(tmp_path, split):
    logits, targets, losses = random_segmentation_data()
    indices = {0: [0, 2, 4], 1: [1, 3, 5]} if split == 'interleaved' else {0: list(range(6)), 1: []}
    shards = {rank: [(logits[i:i + 1], targets[i:i + 1], losses[i]) for i in index]
              for rank, index in indices.items()}
    results = run_two_ranks(tmp_path, reduce_on_rank, shards)

    single = SegmentationMeter(NUM_CLASSES, ignore_index=I)
    single.update(logits, targets, losses.sum())
    expected = single.compute()
    np.testing.assert_array_equal(single.confusion().numpy(),
                                  reference_confusion(logits.argmax(1), targets, NUM_CLASSES, I))
    for result in results:
        assert_scores_equal(result, expected)


def test_a_bad_target_on_one_rank_raises_on_every_rank(tmp_path):
    logits, targets, losses = random_segmentation_data()
    targets[3, 0, 0] = 17
    shards = {0: [(logits[:3], targets[:3], losses[:3].sum())], 1: [(logits[3:], targets[3:], losses[3:].sum())]}
    results = run_two_ranks(tmp_path, reduce_on_rank, shards)
    for result in results:
        assert 'target value 17 is outside 0..4' in result['error']
