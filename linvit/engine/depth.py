"""Monocular depth: which pixels count, the training losses, and the evaluation metrics with their meter.

Conventions (the depth task relies on them): the model predicts log-depth, ``log_pred`` [B, 1, H, W] or [B, H, W];
its depth is ``exp(log_pred)``. Targets are depth maps [B, H, W] (metres, or disparity: nothing here cares which)
with a boolean ``valid`` [B, H, W] from the caller, usually ``valid_depth(target, max_depth)``. Invalid target pixels
may hold anything (0, NaN, inf): every function masks them before a log, a division or an exp, so no NaN reaches a
value or a gradient.

Training (device work only, no host sync)::

    valid = valid_depth(target, max_depth=80.0)                  # KITTI's cap
    loss = DEPTH_LOSSES['silog'](log_pred, target, valid)        # 0-d, over the batch's valid pixels

Evaluation (the NYU / KITTI protocol: every metric per image over its valid pixels, then the mean over images)::

    meter = DepthMeter(aligned=True)                             # aligned: also after MiDaS's scale-and-shift fit
    for images, target in loader:
        log_pred = model(images)
        valid = valid_depth(target)
        meter.update(log_pred.squeeze(1).exp(), target, valid, loss_sum)   # loss_sum: 0-d sum of per-image losses
    meter.reduce_()
    meter.compute()    # {'abs_rel': .., ..., 'delta3': .., 'aligned_abs_rel': .., ..., 'loss': .., 'images': ..}
"""
import math
from typing import Callable, Dict, Optional, Tuple

import torch

from ..registry import Registry
from .metrics import Counters, Meter, float_counter_dtype

__all__ = ['valid_depth', 'silog_loss', 'l1_depth_loss', 'DEPTH_LOSSES', 'align_scale_shift', 'DEPTH_METRICS',
           'depth_metrics', 'DepthMeter', 'ALIGNED_PREFIX', 'MIN_DEPTH']

#: the metrics of one image, in the order the NYU / KITTI tables print them
DEPTH_METRICS = ('abs_rel', 'sq_rel', 'rmse', 'rmse_log', 'log10', 'delta1', 'delta2', 'delta3')
#: what precedes DEPTH_METRICS' names for the metrics after ``align_scale_shift``
ALIGNED_PREFIX = 'aligned_'
#: predictions are clamped to at least this before logs and ratios (an affine-aligned prediction can be <= 0)
MIN_DEPTH = 1e-6
#: keeps the SILog square root's gradient finite where the variance is 0 (a perfect or perfectly scaled prediction)
SILOG_EPS = 1e-12
#: a prediction whose variance over the valid pixels is below this fraction of its mean square is constant: no fit
_CONSTANT_RELATIVE_VARIANCE = 1e-12

DepthLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------------- checks

def _check_depth_map(name: str, tensor: torch.Tensor) -> None:
    if not tensor.dtype.is_floating_point:
        raise ValueError(f'{name} must be a float depth map [B, H, W], got {tensor.dtype}; convert integer depth '
                         f'(e.g. KITTI\'s uint16 PNGs of metres * 256) to metres first')
    if tensor.ndim != 3:
        raise ValueError(f'{name} must be a depth map [B, H, W], got shape {tuple(tensor.shape)}')


def _check_valid(valid: torch.Tensor, target: torch.Tensor) -> None:
    if valid.dtype != torch.bool or valid.shape != target.shape:
        raise ValueError(f'valid must be bool [B, H, W] = {tuple(target.shape)} (the target\'s shape), got '
                         f'{valid.dtype} {tuple(valid.shape)}')


def _check_pair(pred_name: str, pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> None:
    """pred and target: float [B, H, W] of one shape; valid: bool of that shape."""
    _check_depth_map('target', target)
    _check_depth_map(pred_name, pred)
    if pred.shape != target.shape:
        raise ValueError(f'{pred_name} must have the target\'s shape {tuple(target.shape)}, got {tuple(pred.shape)}')
    _check_valid(valid, target)


def _log_depth_map(log_pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log_pred [B, 1, H, W] or [B, H, W] -> [B, H, W], checked against target [B, H, W]."""
    _check_depth_map('target', target)
    if log_pred.ndim == 4 and log_pred.shape[1] == 1:
        log_pred = log_pred[:, 0]
    if log_pred.shape != target.shape or not log_pred.dtype.is_floating_point:
        raise ValueError(f'log_pred must be float log-depth [B, 1, H, W] or [B, H, W] with target\'s [B, H, W] = '
                         f'{tuple(target.shape)}, got {log_pred.dtype} {tuple(log_pred.shape)}')
    return log_pred


def valid_depth(target: torch.Tensor, max_depth: Optional[float] = None) -> torch.Tensor:
    """The pixels that carry a depth: target float [B, H, W] -> bool [B, H, W], True where the target is finite and
    > 0 and, with ``max_depth``, <= max_depth (KITTI evaluates up to 80 m)."""
    _check_depth_map('target', target)
    if max_depth is not None and not max_depth > 0:
        raise ValueError(f'max_depth must be > 0 (or None: no cap), got {max_depth}')
    valid = torch.isfinite(target) & (target > 0)
    return valid if max_depth is None else valid & (target <= max_depth)


# ---------------------------------------------------------------------------------------------------- losses

def _loss_dtype(tensor: torch.Tensor) -> torch.dtype:
    """At least float32: a bf16 / fp16 prediction under autocast would lose the small differences SILog measures."""
    return torch.promote_types(tensor.dtype, torch.float32)


def _log_errors(log_pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """g = log_pred - log(target) on valid pixels, 0 elsewhere: [B, H, W] float32 (or float64)."""
    dtype = _loss_dtype(log_pred)
    # masked before the log: log(0) = -inf on an invalid pixel would give a target that requires grad (a teacher's
    # depth) a NaN gradient there, 0 * inf, even though the where drops the value
    log_target = torch.log(torch.where(valid, target.to(dtype), 1.0))
    return torch.where(valid, log_pred.to(dtype) - log_target, 0.0)


def silog_loss(log_pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
               variance_focus: float = 0.85) -> torch.Tensor:
    """The scale-invariant log loss of BTS / AdaBins / Depth Anything over the valid pixels of the whole batch:
    sqrt(mean(g^2) - variance_focus * mean(g)^2) with g = log_pred - log(target).

    log_pred float [B, 1, H, W] or [B, H, W]; target float [B, H, W]; valid bool [B, H, W] -> 0-d float32 (float64
    for float64 input). variance_focus = 1 makes it blind to a global scale of the prediction. A batch without a
    valid pixel gives 0, still attached to the graph. No host sync.
    """
    log_pred = _log_depth_map(log_pred, target)
    _check_valid(valid, target)
    g = _log_errors(log_pred, target, valid)
    count = valid.sum()
    pixels = count.clamp(min=1).to(g.dtype)
    mean_g = g.sum() / pixels
    variance = g.square().sum() / pixels - variance_focus * mean_g.square()
    # rounding can make a zero variance slightly negative; eps keeps sqrt's gradient finite at 0
    loss = torch.sqrt(variance.clamp(min=0) + SILOG_EPS)
    return torch.where(count > 0, loss, torch.zeros_like(loss))


def l1_depth_loss(log_pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """mean |exp(log_pred) - target| over the valid pixels of the whole batch: shapes as ``silog_loss`` -> 0-d
    float32 (float64 for float64 input); 0, attached to the graph, without a valid pixel. No host sync."""
    log_pred = _log_depth_map(log_pred, target)
    _check_valid(valid, target)
    dtype = _loss_dtype(log_pred)
    # masked before the exp: an overflow to inf on an invalid pixel would make its (zero) gradient 0 * inf = NaN
    depth = torch.exp(torch.where(valid, log_pred.to(dtype), 0.0))
    errors = torch.where(valid, (depth - torch.where(valid, target.to(dtype), 0.0)).abs(), 0.0)
    return errors.sum() / valid.sum().clamp(min=1).to(dtype)


#: name -> loss(log_pred, target, valid) -> 0-d; the depth task's ``loss`` choices
DEPTH_LOSSES: Registry[DepthLoss] = Registry('depth.loss')
DEPTH_LOSSES.register('silog', silog_loss)
DEPTH_LOSSES.register('l1', l1_depth_loss)


# ---------------------------------------------------------------------------------------------------- evaluation

def _masked_mean(values: torch.Tensor, valid: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Per image, the mean of ``values`` [B, H, W] over ``valid`` [B, H, W]: -> [B], NaN where ``count`` [B] is 0."""
    sums = torch.where(valid, values, 0.0).sum(dim=(1, 2))
    return torch.where(count > 0, sums / count.clamp(min=1), math.nan)


def align_scale_shift(pred: torch.Tensor, target: torch.Tensor,
                      valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MiDaS's affine-invariant alignment: per image the least-squares s, t minimising the sum over valid pixels of
    (s * pred + t - target)^2, in closed form.

    pred, target float [B, H, W]; valid bool [B, H, W] -> (aligned = s * pred + t [B, H, W], scale [B], shift [B]),
    all float64 (float32 on MPS, which has no float64). An image with fewer than 2 valid pixels, or whose prediction
    is constant over them, has no unique fit and keeps s = 1, t = 0. No host sync.
    """
    _check_pair('pred', pred, target, valid)
    dtype = float_counter_dtype(pred.device)
    count = valid.sum(dim=(1, 2)).to(dtype)
    p = torch.where(valid, pred.to(dtype), 0.0)
    t = torch.where(valid, target.to(dtype), 0.0)
    # centred sums rather than the raw normal equations: n * sum(p^2) - sum(p)^2 cancels badly for far-from-0 depths
    mean_p = p.sum(dim=(1, 2)) / count.clamp(min=1)
    mean_t = t.sum(dim=(1, 2)) / count.clamp(min=1)
    dp = torch.where(valid, p - mean_p[:, None, None], 0.0)
    dt = torch.where(valid, t - mean_t[:, None, None], 0.0)
    variance = dp.square().sum(dim=(1, 2))
    fits = (count >= 2) & (variance > _CONSTANT_RELATIVE_VARIANCE * p.square().sum(dim=(1, 2)))
    scale = torch.where(fits, (dp * dt).sum(dim=(1, 2)) / torch.where(fits, variance, 1.0), 1.0)
    shift = torch.where(fits, mean_t - scale * mean_p, 0.0)
    return scale[:, None, None] * pred.to(dtype) + shift[:, None, None], scale, shift


def depth_metrics(pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The eight NYU / KITTI metrics of every image over its valid pixels.

    pred (depth, not log), target float [B, H, W]; valid bool [B, H, W] -> {name in DEPTH_METRICS: [B] float64
    (float32 on MPS)}: abs_rel = mean(|p - t| / t), sq_rel = mean((p - t)^2 / t), rmse = sqrt(mean((p - t)^2)),
    rmse_log = sqrt(mean((ln p - ln t)^2)), log10 = mean(|log10 p - log10 t|), delta_i = the fraction of pixels with
    max(p / t, t / p) < 1.25^i. p is clamped below at ``MIN_DEPTH`` first. An image without a valid pixel has NaN in
    every metric. No host sync.
    """
    _check_pair('pred', pred, target, valid)
    dtype = float_counter_dtype(pred.device)
    count = valid.sum(dim=(1, 2)).to(dtype)
    # 1 on invalid pixels keeps every log and ratio finite there; _masked_mean drops them anyway
    p = torch.where(valid, pred.to(dtype).clamp(min=MIN_DEPTH), 1.0)
    t = torch.where(valid, target.to(dtype), 1.0)
    error = p - t
    log_error = torch.log(p) - torch.log(t)
    ratio = torch.maximum(p / t, t / p)
    metrics = {
        'abs_rel': _masked_mean(error.abs() / t, valid, count),
        'sq_rel': _masked_mean(error.square() / t, valid, count),
        'rmse': _masked_mean(error.square(), valid, count).sqrt(),
        'rmse_log': _masked_mean(log_error.square(), valid, count).sqrt(),
        'log10': _masked_mean((torch.log10(p) - torch.log10(t)).abs(), valid, count),
    }
    for i in (1, 2, 3):
        metrics[f'delta{i}'] = _masked_mean((ratio < 1.25 ** i).to(dtype), valid, count)
    return {name: metrics[name] for name in DEPTH_METRICS}


class DepthMeter(Meter):
    """The mean over images of every image's ``depth_metrics`` (images with at least one valid pixel), and the mean
    per-image loss, summed on the device without host syncs.

    Counters (one device): sums float64 [M] (float32 on MPS) of the M metrics per image, in the order of ``keys``
    (DEPTH_METRICS, then with ``aligned`` the same after ``align_scale_shift``, prefixed 'aligned_'), loss_sum
    float64 [], images int64 []. Use: ``update`` per batch, ``reduce_`` once (sums over processes), ``compute``.
    """

    def __init__(self, aligned: bool = False, device: Optional[torch.device] = None) -> None:
        self.aligned = bool(aligned)
        self.keys: Tuple[str, ...] = DEPTH_METRICS + (
            tuple(ALIGNED_PREFIX + name for name in DEPTH_METRICS) if self.aligned else ())
        super().__init__(device)

    def _zeros(self, device: torch.device) -> Counters:
        dtype = float_counter_dtype(device)
        return {'sums': torch.zeros(len(self.keys), dtype=dtype, device=device),
                'loss_sum': torch.zeros((), dtype=dtype, device=device),
                'images': torch.zeros((), dtype=torch.int64, device=device)}

    def _image_metrics(self, pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[B, M] metrics per image, columns in the order of ``keys``."""
        metrics = depth_metrics(pred, target, valid)
        columns = [metrics[name] for name in DEPTH_METRICS]
        if self.aligned:
            aligned = depth_metrics(align_scale_shift(pred, target, valid)[0], target, valid)
            columns += [aligned[name] for name in DEPTH_METRICS]
        return torch.stack(columns, dim=1)

    @torch.no_grad()
    def update(self, pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """Add one batch.

        pred: predicted depth (not log) float [B, H, W]; target float [B, H, W]; valid bool [B, H, W]; loss_sum: 0-d,
        the SUM of the batch's per-image losses. One device. Images without a valid pixel are not counted (their
        metrics are NaN); a NaN prediction on a valid pixel makes the metrics NaN rather than being left out.
        """
        self._check_open()
        _check_pair('pred', pred, target, valid)
        if loss_sum.ndim != 0:
            raise ValueError(f'loss_sum must be a 0-d tensor (the sum of the per-image losses), got '
                             f'{tuple(loss_sum.shape)}')
        counters = self._counters_on(pred.device)
        counted = valid.flatten(1).any(dim=1)                                             # [B]
        per_image = self._image_metrics(pred, target, valid)                              # [B, M]
        counters['sums'] += torch.where(counted[:, None], per_image, 0.0).sum(dim=0).to(counters['sums'].dtype)
        counters['loss_sum'] += loss_sum.detach().to(counters['loss_sum'].dtype)
        counters['images'] += counted.sum(dtype=torch.int64)

    def compute(self) -> Dict[str, float]:
        """{metric: mean over the counted images, for every name in ``keys``, 'loss': loss_sum / images, 'images':
        counted images (int)}. One host sync. With no image the metrics and loss are NaN and images is 0."""
        if self._counters is None:
            return self._empty()
        c = self._counters
        values = torch.cat([c['sums'].double(), c['loss_sum'].double()[None], c['images'].double()[None]]).tolist()
        images = int(values[-1])
        if images == 0:
            return self._empty()
        means = {name: total / images for name, total in zip(self.keys, values)}
        return {**means, 'loss': values[-2] / images, 'images': images}

    def _empty(self) -> Dict[str, float]:
        return {**{name: math.nan for name in self.keys}, 'loss': math.nan, 'images': 0}
