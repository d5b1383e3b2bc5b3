"""Depth losses and metrics against numpy written here, pixel masks against a hand-drawn map, the scale-and-shift fit
against numpy.linalg.lstsq, and the meter against the mean of per-image numpy metrics."""
import math

import numpy as np
import pytest
import torch

from linvit.engine.depth import (
    DEPTH_LOSSES,
    DEPTH_METRICS,
    DepthMeter,
    align_scale_shift,
    depth_metrics,
    l1_depth_loss,
    silog_loss,
    valid_depth,
)
from linvit.fast import check_graph_breaks

NAN, INF = math.nan, math.inf
MAX_DEPTH = 10.0

# two images of 3 x 4 pixels; invalid: 0, NaN, inf, a negative depth and, with MAX_DEPTH, 12.0 (10.0 is kept: <=)
TARGET = np.array([
    [[1.0, 2.0, 0.0, 4.0],
     [NAN, 3.0, 5.0, 12.0],
     [2.5, INF, 1.5, 6.0]],
    [[0.5, 0.0, 7.0, 9.5],
     [2.0, -1.0, 3.5, 8.0],
     [NAN, 1.2, 10.0, 0.8]],
])
T, F = True, False
HAND_VALID = np.array([
    [[T, T, F, T],
     [F, T, T, F],
     [T, F, T, T]],
    [[T, F, T, T],
     [T, F, T, T],
     [F, T, T, T]],
])
# predicted depth: -0.3 on a valid pixel exercises the clamp at 1e-6; NaN and 0 sit on invalid pixels only
PRED = np.array([
    [[1.2, 1.7, NAN, 4.5],
     [0.0, 3.3, 4.1, 11.0],
     [2.0, 9.0, 1.6, 7.5]],
    [[0.45, 3.0, 6.0, 12.0],
     [-0.3, 1.0, 3.0, 8.8],
     [5.0, 1.5, 9.0, 0.7]],
])
# an image with no valid pixel at all
EMPTY_TARGET = np.array([[[0.0, NAN, INF, -2.0],
                          [0.0, 0.0, NAN, INF],
                          [-1.0, 0.0, 0.0, 0.0]]])


def tensor(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def as_float32(values):
    """The values a float32 tensor holds, in float64: what the numpy references must see (1.5 / 1.2 is 1.25 in
    float64 but 1.2499999 after rounding 1.2 to float32, on the delta1 threshold)."""
    return np.asarray(values, dtype=np.float32).astype(np.float64)


def numpy_valid(target, max_depth):
    with np.errstate(invalid='ignore'):
        return np.isfinite(target) & (target > 0) & (target <= max_depth)


def numpy_silog(log_pred, target, valid, variance_focus):
    g = log_pred[valid] - np.log(target[valid])
    return math.sqrt(np.mean(g ** 2) - variance_focus * np.mean(g) ** 2)


def numpy_image_metrics(pred, target, valid):
    """One image's eight metrics, the NYU / KITTI definitions on its valid pixels; NaN when it has none."""
    if not valid.any():
        return {name: NAN for name in DEPTH_METRICS}
    p, t = np.maximum(pred[valid], 1e-6), target[valid]
    ratio = np.maximum(p / t, t / p)
    return {'abs_rel': np.mean(np.abs(p - t) / t), 'sq_rel': np.mean((p - t) ** 2 / t),
            'rmse': math.sqrt(np.mean((p - t) ** 2)), 'rmse_log': math.sqrt(np.mean((np.log(p) - np.log(t)) ** 2)),
            'log10': np.mean(np.abs(np.log10(p) - np.log10(t))), 'delta1': np.mean(ratio < 1.25),
            'delta2': np.mean(ratio < 1.25 ** 2), 'delta3': np.mean(ratio < 1.25 ** 3)}


def numpy_lstsq_fit(pred, target, valid):
    """(scale, shift) of one image by numpy.linalg.lstsq on [pred, 1] over its valid pixels."""
    design = np.stack([pred[valid], np.ones(valid.sum())], axis=1)
    (scale, shift), *_ = np.linalg.lstsq(design, target[valid], rcond=None)
    return scale, shift


def log_pred_batch():
    """Log-depth near the targets' logs, plus noise: float64 [2, 3, 4], finite everywhere."""
    rng = np.random.default_rng(0)
    return np.log(np.nan_to_num(np.abs(TARGET), nan=1.0, posinf=1.0) + 0.5) + rng.normal(0.0, 0.3, TARGET.shape)


# ---------------------------------------------------------------------------------------------------- valid pixels

def test_valid_depth_marks_finite_positive_pixels_up_to_max_depth():
    assert np.array_equal(valid_depth(tensor(TARGET), max_depth=MAX_DEPTH).numpy(), HAND_VALID)
    uncapped = HAND_VALID.copy()
    uncapped[0, 1, 3] = True  # 12.0: beyond the cap only
    assert np.array_equal(valid_depth(tensor(TARGET)).numpy(), uncapped)


# ---------------------------------------------------------------------------------------------------- losses

@pytest.mark.parametrize('variance_focus', [0.85, 0.5, 1.0])
def test_silog_loss_equals_numpy(variance_focus):
    log_pred = log_pred_batch()
    loss = silog_loss(tensor(log_pred), tensor(TARGET), torch.from_numpy(HAND_VALID), variance_focus)
    assert loss.ndim == 0
    assert loss.item() == pytest.approx(numpy_silog(log_pred, TARGET, HAND_VALID, variance_focus), rel=1e-5)


def test_silog_loss_gradient_equals_the_analytic_one():
    """d loss / d log_pred_i = (g_i - variance_focus * mean(g)) / (n * loss) on valid pixels, 0 elsewhere."""
    log_pred_np = log_pred_batch()
    log_pred = tensor(log_pred_np, torch.float64).requires_grad_()
    silog_loss(log_pred, tensor(TARGET, torch.float64), torch.from_numpy(HAND_VALID), 0.85).backward()
    g = log_pred_np[HAND_VALID] - np.log(TARGET[HAND_VALID])
    expected = np.zeros_like(log_pred_np)
    expected[HAND_VALID] = (g - 0.85 * g.mean()) / (g.size * numpy_silog(log_pred_np, TARGET, HAND_VALID, 0.85))
    np.testing.assert_allclose(log_pred.grad.numpy(), expected, rtol=1e-9, atol=1e-12)


def test_l1_depth_loss_equals_numpy_and_takes_a_channel_dimension():
    log_pred = log_pred_batch()
    expected = np.mean(np.abs(np.exp(log_pred[HAND_VALID]) - TARGET[HAND_VALID]))
    valid = torch.from_numpy(HAND_VALID)
    assert l1_depth_loss(tensor(log_pred), tensor(TARGET), valid).item() == pytest.approx(expected, rel=1e-6)
    with_channel = l1_depth_loss(tensor(log_pred)[:, None], tensor(TARGET), valid)
    assert with_channel.item() == pytest.approx(expected, rel=1e-6)


def test_silog_with_full_variance_focus_ignores_a_global_scale():
    log_pred, target, valid = tensor(log_pred_batch()), tensor(TARGET), torch.from_numpy(HAND_VALID)
    scaled = log_pred + math.log(3.7)
    assert silog_loss(scaled, target, valid, 1.0).item() == pytest.approx(
        silog_loss(log_pred, target, valid, 1.0).item(), rel=1e-5)
    # the property is not vacuous: with the default focus the scale is seen
    assert silog_loss(scaled, target, valid).item() > 1.5 * silog_loss(log_pred, target, valid).item()


@pytest.mark.parametrize('name', ['silog', 'l1'])
def test_a_batch_without_valid_pixels_gives_zero_with_a_finite_gradient(name):
    log_pred = torch.zeros(1, 1, 3, 4, requires_grad=True)
    target = tensor(EMPTY_TARGET)
    loss = DEPTH_LOSSES[name](log_pred, target, valid_depth(target))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(log_pred.grad, torch.zeros_like(log_pred))


@pytest.mark.parametrize('name', ['silog', 'l1'])
def test_invalid_zero_targets_and_huge_invalid_predictions_keep_the_gradient_finite(name):
    """Invalid pixels hold 0 / NaN / inf / negative targets and a log-depth of 1000 (exp overflows): none reaches a
    gradient, the prediction's or that of a target that requires one (a teacher's depth)."""
    log_pred_np = log_pred_batch()
    log_pred_np[~HAND_VALID] = 1000.0
    log_pred = tensor(log_pred_np).requires_grad_()
    target = tensor(TARGET).requires_grad_()
    DEPTH_LOSSES[name](log_pred, target, torch.from_numpy(HAND_VALID)).backward()
    for grad in (log_pred.grad.numpy(), target.grad.numpy()):
        assert np.isfinite(grad).all() and (grad[~HAND_VALID] == 0).all() and (grad[HAND_VALID] != 0).any()


def test_silog_of_a_perfect_prediction_is_near_zero_with_a_finite_gradient():
    log_pred_np = np.where(HAND_VALID, np.log(np.where(HAND_VALID, TARGET, 1.0)), 0.0)
    log_pred = tensor(log_pred_np).requires_grad_()
    loss = silog_loss(log_pred, tensor(TARGET), torch.from_numpy(HAND_VALID))
    loss.backward()
    assert loss.item() < 1e-3 and torch.isfinite(log_pred.grad).all()


def test_the_registry_holds_both_losses_with_their_defaults():
    assert DEPTH_LOSSES.names() == ['silog', 'l1']
    log_pred, target, valid = tensor(log_pred_batch()), tensor(TARGET), torch.from_numpy(HAND_VALID)
    assert DEPTH_LOSSES['silog'](log_pred, target, valid).item() == pytest.approx(
        numpy_silog(log_pred_batch(), TARGET, HAND_VALID, 0.85), rel=1e-5)


# ---------------------------------------------------------------------------------------------------- metrics

def test_every_metric_of_every_image_equals_numpy_and_an_empty_image_is_nan():
    target = as_float32(np.concatenate([TARGET, EMPTY_TARGET]))
    pred = as_float32(np.concatenate([PRED, PRED[:1]]))
    valid = numpy_valid(target, MAX_DEPTH)
    metrics = depth_metrics(tensor(pred), tensor(target), torch.from_numpy(valid))
    assert list(metrics) == list(DEPTH_METRICS)
    for image in range(3):
        expected = numpy_image_metrics(pred[image], target[image], valid[image])
        for name in DEPTH_METRICS:
            assert metrics[name].dtype == torch.float64 and metrics[name].shape == (3,)
            actual = metrics[name][image].item()
            if image == 2:
                assert math.isnan(actual), name
            else:
                assert actual == pytest.approx(expected[name], rel=1e-12), (name, image)


# ---------------------------------------------------------------------------------------------------- alignment

def test_align_scale_shift_recovers_an_exact_affine_prediction():
    scale, shift = 2.5, -0.7
    pred = np.where(HAND_VALID, (TARGET - shift) / scale, NAN)  # invalid pixels hold NaN: they must not count
    aligned, scales, shifts = align_scale_shift(tensor(pred, torch.float64), tensor(TARGET, torch.float64),
                                                torch.from_numpy(HAND_VALID))
    np.testing.assert_allclose(scales.numpy(), [scale, scale], rtol=1e-12)
    np.testing.assert_allclose(shifts.numpy(), [shift, shift], rtol=1e-12)
    np.testing.assert_allclose(aligned.numpy()[HAND_VALID], TARGET[HAND_VALID], rtol=1e-12)


def test_align_scale_shift_equals_lstsq_on_a_noisy_prediction():
    rng = np.random.default_rng(1)
    pred = as_float32(np.where(HAND_VALID, 0.4 * np.nan_to_num(TARGET) + 1.0, 0.0) + rng.normal(0.0, 0.2, TARGET.shape))
    target = as_float32(TARGET)
    aligned, scales, shifts = align_scale_shift(tensor(pred), tensor(target), torch.from_numpy(HAND_VALID))
    for image in range(2):
        scale, shift = numpy_lstsq_fit(pred[image], target[image], HAND_VALID[image])
        assert scales[image].item() == pytest.approx(scale, rel=1e-10)
        assert shifts[image].item() == pytest.approx(shift, rel=1e-10)
        np.testing.assert_allclose(aligned[image].numpy(), scale * pred[image] + shift, rtol=1e-10)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_align_scale_shift_keeps_identity_without_a_unique_fit(dtype):
    """Image 0 has one valid pixel, image 1 a constant prediction: s = 1, t = 0, the prediction unchanged. In float64
    the mean of nine 0.1s is not exactly 0.1, so the variance is a rounding residue, not 0: still constant."""
    valid = HAND_VALID.copy()
    valid[0] = False
    valid[0, 0, 1] = True
    pred = PRED.copy()
    pred[1] = 0.1
    aligned, scales, shifts = align_scale_shift(tensor(pred, dtype), tensor(TARGET, dtype), torch.from_numpy(valid))
    assert scales.tolist() == [1.0, 1.0] and shifts.tolist() == [0.0, 0.0]
    np.testing.assert_array_equal(aligned.numpy()[valid], tensor(pred, dtype).double().numpy()[valid])


# ---------------------------------------------------------------------------------------------------- the meter

def meter_batches():
    """Two batches: TARGET's two images, then an image without a valid pixel and a third counted image."""
    second_target = np.concatenate([EMPTY_TARGET, 1.3 * TARGET[1:]])
    second_pred = np.concatenate([PRED[:1], 1.1 * PRED[1:] + 0.2])
    return [(as_float32(PRED), as_float32(TARGET), 1.5), (as_float32(second_pred), as_float32(second_target), 0.75)]


def numpy_meter_means(aligned):
    """The mean over every image with a valid pixel of its numpy metrics (after lstsq when ``aligned``)."""
    rows = []
    for pred, target, _ in meter_batches():
        valid = numpy_valid(target, MAX_DEPTH)
        for image in range(len(target)):
            if valid[image].any():
                p = pred[image]
                if aligned:
                    scale, shift = numpy_lstsq_fit(p, target[image], valid[image])
                    p = scale * p + shift
                rows.append(numpy_image_metrics(p, target[image], valid[image]))
    return {name: np.mean([row[name] for row in rows]) for name in DEPTH_METRICS}, len(rows)


def filled_meter(aligned):
    meter = DepthMeter(aligned=aligned)
    for pred, target, loss_sum in meter_batches():
        target = tensor(target)
        meter.update(tensor(pred), target, valid_depth(target, MAX_DEPTH), torch.tensor(loss_sum))
    return meter


@pytest.mark.parametrize('aligned', [False, True])
def test_meter_means_the_numpy_metrics_over_images_with_valid_pixels(aligned):
    meter = filled_meter(aligned)
    result = meter.compute()
    expected, images = numpy_meter_means(aligned=False)
    assert images == 3 and result['images'] == 3
    assert result['loss'] == pytest.approx((1.5 + 0.75) / 3)
    for name in DEPTH_METRICS:
        assert result[name] == pytest.approx(expected[name], rel=1e-12), name
    aligned_keys = {f'aligned_{name}' for name in DEPTH_METRICS}
    assert set(result) == {*DEPTH_METRICS, 'loss', 'images', *(aligned_keys if aligned else ())}
    if aligned:
        expected_aligned, _ = numpy_meter_means(aligned=True)
        for name in DEPTH_METRICS:
            assert result[f'aligned_{name}'] == pytest.approx(expected_aligned[name], rel=1e-9), name
    meter.reduce_()
    assert meter.compute() == result  # one process: reduce_ changes nothing


def test_meter_without_counted_images_gives_nan_and_zero_images():
    for meter in (DepthMeter(), DepthMeter(aligned=True, device='cpu')):
        if meter.aligned:  # counters allocated, but the only image has no valid pixel
            target = tensor(EMPTY_TARGET)
            meter.update(tensor(PRED[:1]), target, valid_depth(target), torch.tensor(0.0))
        result = meter.compute()
        assert result['images'] == 0 and math.isnan(result['loss'])
        assert all(math.isnan(result[name]) for name in meter.keys)


# ---------------------------------------------------------------------------------------------------- no host sync

@pytest.mark.parametrize('name', ['silog_loss', 'l1_depth_loss', 'depth_metrics', 'align_scale_shift',
                                  'DepthMeter.update'])
def test_device_work_traces_as_one_graph_without_a_host_sync(name):
    """dynamo breaks the graph at a host read (.item(), a branch on a tensor value): one graph means none."""
    target = tensor(TARGET)
    valid = valid_depth(target, MAX_DEPTH)
    pred = tensor(np.nan_to_num(PRED))
    calls = {'silog_loss': (silog_loss, (pred.log()[:, None], target, valid)),
             'l1_depth_loss': (l1_depth_loss, (pred.log(), target, valid)),
             'depth_metrics': (depth_metrics, (pred, target, valid)),
             'align_scale_shift': (align_scale_shift, (pred, target, valid)),
             'DepthMeter.update': (DepthMeter(aligned=True, device='cpu').update,
                                   (pred, target, valid, torch.tensor(1.0)))}
    fn, args = calls[name]
    report = check_graph_breaks(fn, *args)
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)


# ---------------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize('call, words', [
    (lambda: valid_depth(torch.zeros(2, 3, 4, dtype=torch.int32)), 'target must be a float depth map'),
    (lambda: valid_depth(torch.ones(3, 4)), r'target must be a depth map \[B, H, W\], got shape \(3, 4\)'),
    (lambda: valid_depth(torch.ones(2, 3, 4), max_depth=0.0), 'max_depth must be > 0'),
    (lambda: silog_loss(torch.zeros(2, 2, 3, 4), torch.ones(2, 3, 4), torch.ones(2, 3, 4, dtype=torch.bool)),
     r'log_pred must be .* got torch.float32 \(2, 2, 3, 4\)'),
    (lambda: l1_depth_loss(torch.zeros(2, 3, 4), torch.ones(2, 3, 4), torch.ones(2, 3, 4)),
     r'valid must be bool \[B, H, W\] = \(2, 3, 4\)'),
    (lambda: depth_metrics(torch.ones(2, 3, 5), torch.ones(2, 3, 4), torch.ones(2, 3, 4, dtype=torch.bool)),
     r"pred must have the target's shape \(2, 3, 4\), got \(2, 3, 5\)"),
    (lambda: DepthMeter().update(torch.ones(1, 3, 4), torch.ones(1, 3, 4), torch.ones(1, 3, 4, dtype=torch.bool),
                                 torch.ones(1)), r'loss_sum must be a 0-d tensor'),
])
def test_bad_input_is_one_line_naming_what_was_expected(call, words):
    with pytest.raises(ValueError, match=words) as info:
        call()
    assert '\n' not in str(info.value)
