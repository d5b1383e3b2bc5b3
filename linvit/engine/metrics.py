"""The engine's metrics, accumulated on the device and summed across processes: one ``Meter`` base, one meter per task.

Every meter follows the same protocol (``Meter``): ``update`` per batch queues device work only (no ``.item()``,
no host sync); ``reduce_`` once, on every process, sums the counters over the processes (a no-op on one process);
``compute`` reads them back once. The base holds what they share: reset, allocation on the first batch's device,
the guard against reducing twice, and the device a process without data reduces on. Each meter keeps only its
statistic.

Classification: top-k accuracy and mean loss, and with ``num_classes`` a confusion matrix.

    meter = ClassificationMeter(ks=(1, 5), num_classes=C)
    for images, targets, valid in loader:           # valid: bool [B], False for the sampler's padded duplicates
        logits = model(images)                       # [B, C]
        losses = F.cross_entropy(logits, targets, reduction='none')    # [B]
        meter.update(logits, targets, losses, valid=valid)
    meter.reduce_()                                  # all_reduce(SUM) when torch.distributed is initialized
    meter.compute()                                  # {'top1': 0.71, 'top5': 0.93, 'loss': 1.02, 'count': 10000}
    meter.confusion()                                # int64 [C, C] on the CPU: rows true class, columns top-1 class

``update`` only queues device work (no ``.item()``, no host sync); ``compute`` reads the counters back once.

Padded duplicates: ``DistributedSampler`` (``drop_last=False``) repeats the first samples so every process gets the
same number; counting them would bias the metric. Pass ``valid`` (bool [B], False for a duplicate) to exclude them;
then ``loss`` must be per-sample losses [B] (the meter sums the valid ones) or a 0-d sum over the valid samples only.

Ties: a sample counts as top-k correct if its target is among the k indices ``torch.topk`` returns. When several
classes tie for the k-th place, torch.topk picks which of them are returned (an implementation detail: not
necessarily the lowest index, and it may differ between devices), exactly like ``timm.utils.accuracy``. This never
counts a tie optimistically: a model that outputs the same logit for every class scores one class per sample at
top-1, not all of them.

Semantic segmentation: a confusion matrix (rows = ground truth, columns = prediction) summed on the device.

    meter = SegmentationMeter(num_classes=K, ignore_index=255)
    for images, masks in loader:
        logits = model(images)                                                       # [B, K, H, W]
        loss_sum = F.cross_entropy(logits, masks, ignore_index=255, reduction='sum')
        meter.update(logits, masks, loss_sum)
    meter.reduce_()
    meter.compute()    # {'miou': .., 'pixel_acc': .., 'loss': .., 'pixels': .., 'per_class_iou': [K floats]}

mIoU follows mmsegmentation: IoU_c = TP / (TP + FP + FN) for every class whose union (ground truth or prediction)
is non-empty; a class absent from both is NaN in ``per_class_iou`` and left out of the mean (nanmean).

Autoregressive pretraining: ``NextPatchMeter`` sums the squared error of next-patch predictions [B, M, P] and the
targets' sum of squares; ``compute`` gives ``{'loss': MSE, 'r2': 1 - SSE / SST, 'count': images}``.

Object detection: ``DetectionMeter`` keeps every image's boxes and scores them with COCO's box AP
(``coco_box_metrics``: pycocotools' COCOeval, AP at IoU 0.50:0.95, 0.50, 0.75, by object size, and per class).
"""
import contextlib
import io
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..models.segmentation import class_ids
from .distributed import distributed_running

__all__ = ['Meter', 'topk_correct', 'ClassificationMeter', 'confusion_matrix', 'SegmentationMeter', 'NextPatchMeter',
           'coco_box_metrics', 'DetectionMeter', 'COCO_BOX_METRICS', 'MASK_PREFIX', 'mask_rles', 'coco_file_metrics',
           'coco_ground_truth', 'COCO_MAX_DETECTIONS']

Counters = Dict[str, torch.Tensor]


def float_counter_dtype(device: torch.device) -> torch.dtype:
    """float64 for sums of losses and squares; float32 on MPS, which has no float64."""
    return torch.float32 if device.type == 'mps' else torch.float64


class Meter:
    """Base of the meters: named counters on one device, summed over batches without host syncs, then over processes.

    A subclass declares its counters in ``_zeros(device) -> {name: zero tensor}``, and in ``update`` calls
    ``_check_open()`` first and then ``counters = self._counters_on(device)`` (allocated on the first batch's device
    unless ``device`` was given) before adding the batch to them; ``compute`` reads ``self._counters`` (None while no
    batch was seen). ``reduce_`` sums every counter over the processes in one float64 collective (integer counts are
    exact up to 2**53); the counters named in ``MAX_COUNTERS`` are reduced with MAX instead.
    """
    MAX_COUNTERS: Tuple[str, ...] = ()

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self._device = device
        self.reset()

    def _zeros(self, device: torch.device) -> Counters:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every update (and a previous ``reduce_``)."""
        self._counters: Optional[Counters] = None
        self._reduced = False
        if self._device is not None:
            self._counters = self._zeros(torch.device(self._device))

    def _check_open(self) -> None:
        if self._reduced:
            raise RuntimeError(f'{type(self).__name__}.update after reduce_: the counters are already global; '
                               f'reset() first')

    def _counters_on(self, device: torch.device) -> Counters:
        """The counters, allocated on ``device`` if this is the first batch."""
        if self._counters is None:
            self._counters = self._zeros(device)
        return self._counters

    @staticmethod
    def _collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
        """Where a process that saw no batch allocates its counters: a device its backend can reduce on."""
        if dist.get_backend(group) == 'nccl':
            return torch.device('cuda', torch.cuda.current_device())
        return torch.device('cpu')

    @torch.no_grad()
    def reduce_(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """Sum the counters over the processes of ``group`` (all_reduce SUM; ``MAX_COUNTERS``: MAX), in place; a
        no-op when torch.distributed is not running. Every process must call it, once, after its last ``update``
        (a process without data still takes part)."""
        if self._reduced:
            raise RuntimeError(f'{type(self).__name__}.reduce_ called twice: the counters would be summed again')
        self._reduced = True
        if not distributed_running():
            return
        if self._counters is None:
            self._counters = self._zeros(self._collective_device(group))
        counters = self._counters
        summed = [tensor for name, tensor in counters.items() if name not in self.MAX_COUNTERS]
        packed = torch.cat([tensor.double().reshape(-1) for tensor in summed])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        for tensor, values in zip(summed, packed.split([tensor.numel() for tensor in summed])):
            values = values.reshape(tensor.shape)
            tensor.copy_(values if tensor.dtype.is_floating_point else values.round())
        for name in self.MAX_COUNTERS:
            dist.all_reduce(counters[name], op=dist.ReduceOp.MAX, group=group)


def _check_ks(ks: Sequence[int]) -> None:
    if len(ks) == 0 or any(int(k) < 1 for k in ks):
        raise ValueError(f'ks must be a non-empty sequence of k >= 1, got {tuple(ks)}')


def _check_batch(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.ndim != 2:
        raise ValueError(f'logits must be [B, C], got shape {tuple(logits.shape)}')
    if targets.shape != logits.shape[:1]:
        raise ValueError(f'targets must be [B={logits.shape[0]}] class indices, got shape {tuple(targets.shape)}')
    if targets.dtype.is_floating_point:
        raise ValueError(f'targets must be integer class indices, got {targets.dtype} (soft targets: pass argmax)')


def _top_indices(logits: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """The classes of the largest logits, best first: logits [B, C] -> int64 [B, min(max(ks), C)]."""
    return logits.topk(min(max(ks), logits.shape[1]), dim=1, largest=True, sorted=True).indices


def _topk_hits(top_indices: torch.Tensor, targets: torch.Tensor, ks: Sequence[int], num_classes: int) -> torch.Tensor:
    """hits[b, i] is True when targets[b] is among the first ks[i] of ``top_indices`` [B, max_k] (``_top_indices``)
    of a batch with ``num_classes`` classes; targets [B] -> hits bool [B, len(ks)]. k > C is clamped to C."""
    # a running count along the ranks turns "target at rank r" into "target within the first r+1 ranks"
    hit_within = top_indices.eq(targets[:, None]).cumsum(dim=1) > 0                  # [B, max_k]
    # column slices, not an index tensor: building one from a list would be a host-to-device copy per batch
    return torch.stack([hit_within[:, min(k, num_classes) - 1] for k in ks], dim=1)


def topk_correct(logits: torch.Tensor, targets: torch.Tensor, ks: Sequence[int] = (1, 5)) -> torch.Tensor:
    """How many samples have their target among the top-k logits, for each k in ``ks``.

    logits [B, C] (any float dtype), targets [B] int64 class indices -> int64 [len(ks)] counts on logits' device.
    k larger than C is clamped to C (every sample counts). Ties at the k-th place are resolved by ``torch.topk``
    (see the module docstring).
    """
    _check_ks(ks)
    _check_batch(logits, targets)
    return _topk_hits(_top_indices(logits, ks), targets, ks, logits.shape[1]).sum(dim=0, dtype=torch.int64)


class ClassificationMeter(Meter):
    """Top-k accuracy and mean loss over many batches, accumulated on the logits' device without host syncs; with
    ``num_classes``, also the confusion matrix of the top-1 predictions.

    Counters (all on one device): correct int64 [len(ks)], count int64 [], loss_sum float64 [] (float32 on MPS,
    which has no float64), and with ``num_classes`` = C: confusion int64 [C, C] (rows: target, columns: top-1
    class, the same class ``top1`` counts, ties included). C is given up front rather than read off the first
    logits: a process that sees no batch still allocates a counter of the same size for ``reduce_``. Use: ``update``
    per batch, then ``reduce_`` once (sums over processes), then ``compute`` and ``confusion``.
    """

    def __init__(self, ks: Sequence[int] = (1, 5), device: Optional[torch.device] = None,
                 num_classes: Optional[int] = None):
        _check_ks(ks)
        if num_classes is not None and int(num_classes) < 1:
            raise ValueError(f'num_classes must be >= 1 (or None: no confusion matrix), got {num_classes}')
        self.ks = tuple(int(k) for k in ks)
        self.num_classes = None if num_classes is None else int(num_classes)
        super().__init__(device)

    def _zeros(self, device: torch.device) -> Counters:
        counters = {'correct': torch.zeros(len(self.ks), dtype=torch.int64, device=device),
                    'count': torch.zeros((), dtype=torch.int64, device=device),
                    'loss_sum': torch.zeros((), dtype=float_counter_dtype(device), device=device)}
        if self.num_classes is not None:
            counters['confusion'] = torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64, device=device)
        return counters

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor,
               valid: Optional[torch.Tensor] = None) -> None:
        """Add one batch.

        logits [B, C]; targets [B] int64 class indices; loss: per-sample losses [B], or a 0-d tensor holding the SUM
        of the per-sample losses over the batch's valid samples (not the mean); valid: optional bool [B], False for
        samples to leave out (a distributed sampler's padded duplicates). All on the same device. With
        ``num_classes``, C must equal it; a target outside 0..C-1 is left out of the confusion matrix only.
        """
        self._check_open()
        _check_batch(logits, targets)
        if self.num_classes is not None and logits.shape[1] != self.num_classes:
            raise ValueError(f'logits must be [B, C={self.num_classes}] (the meter\'s num_classes), got shape '
                             f'{tuple(logits.shape)}')
        if loss.ndim not in (0, 1) or (loss.ndim == 1 and loss.shape != targets.shape):
            raise ValueError(f'loss must be a 0-d sum or per-sample [B={targets.shape[0]}], got {tuple(loss.shape)}')
        if valid is not None and (valid.dtype != torch.bool or valid.shape != targets.shape):
            raise ValueError(f'valid must be bool [B={targets.shape[0]}], got {valid.dtype} {tuple(valid.shape)}')
        counters = self._counters_on(logits.device)

        top_indices = _top_indices(logits, self.ks)                                  # [B, max_k]
        hits = _topk_hits(top_indices, targets, self.ks, logits.shape[1])            # [B, len(ks)]
        if self.num_classes is not None:
            counters['confusion'] += _classification_confusion(top_indices[:, 0], targets, valid, self.num_classes)
        if valid is not None:
            hits = hits & valid[:, None]
            if loss.ndim == 1:
                loss = loss.masked_fill(~valid, 0)
        counters['correct'] += hits.sum(dim=0, dtype=torch.int64)
        counters['count'] += targets.shape[0] if valid is None else valid.sum(dtype=torch.int64)
        counters['loss_sum'] += loss.detach().sum(dtype=counters['loss_sum'].dtype)

    def compute(self) -> Dict[str, float]:
        """{'top1': fraction in [0, 1], 'top5': ..., (one 'top{k}' per k), 'loss': mean per-sample loss,
        'count': samples counted}. One host sync. With no samples, the fractions and loss are NaN and count is 0."""
        if self._counters is None:
            return {**{f'top{k}': math.nan for k in self.ks}, 'loss': math.nan, 'count': 0}
        c = self._counters
        values = torch.cat([c['correct'].double(), c['count'].double()[None], c['loss_sum'].double()[None]]).tolist()
        correct, count, loss_sum = values[:len(self.ks)], int(values[len(self.ks)]), values[len(self.ks) + 1]
        if count == 0:
            return {**{f'top{k}': math.nan for k in self.ks}, 'loss': math.nan, 'count': 0}
        return {**{f'top{k}': c / count for k, c in zip(self.ks, correct)}, 'loss': loss_sum / count, 'count': count}

    def confusion(self) -> torch.Tensor:
        """The counted samples as int64 [C, C] on the CPU: row = target class, column = top-1 predicted class (its
        trace is top1's correct count); zeros before the first batch. After ``reduce_``: over every process.
        ValueError when the meter was built without ``num_classes``."""
        if self.num_classes is None:
            raise ValueError('this ClassificationMeter keeps no confusion matrix: build it with num_classes=C')
        if self._counters is None:
            return torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64)
        return self._counters['confusion'].cpu().clone()


def _classification_confusion(predictions: torch.Tensor, targets: torch.Tensor, valid: Optional[torch.Tensor],
                              num_classes: int) -> torch.Tensor:
    """One batch's confusion counts, device-only (no host sync): predictions [B] and targets [B] class indices,
    valid optional bool [B] -> int64 [C, C], row = target, column = prediction. Samples that are not valid, or whose
    target is outside 0..C-1, land in a discarded extra bin (indexing with them would be out of bounds)."""
    targets = targets.long()
    keep = (targets >= 0) & (targets < num_classes)
    if valid is not None:
        keep = keep & valid
    cells = num_classes * num_classes
    bins = torch.where(keep, targets * num_classes + predictions, cells)
    # scatter_add_ rather than bincount: CUDA's bincount reads the input's min and max back to the host
    counts = torch.zeros(cells + 1, dtype=torch.int64, device=targets.device)
    counts.scatter_add_(0, bins, torch.ones((), dtype=torch.int64, device=targets.device).expand_as(bins))
    return counts[:cells].reshape(num_classes, num_classes)


# --- semantic segmentation --------------------------------------------------------------------------------------

_NO_BAD_VALUE = torch.iinfo(torch.int64).min   # "no out-of-range target seen", below any real value


def _check_segmentation_batch(logits: torch.Tensor, targets: torch.Tensor, num_classes: int) -> None:
    if logits.ndim != 4 or logits.shape[1] != num_classes:
        raise ValueError(f'logits must be [B, K={num_classes}, H, W], got shape {tuple(logits.shape)}')
    if targets.shape != logits.shape[:1] + logits.shape[2:]:
        raise ValueError(f'targets must be [B, H, W] = {tuple(logits.shape[:1] + logits.shape[2:])} class indices, '
                         f'got shape {tuple(targets.shape)}')
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f'targets must be integer class indices, got {targets.dtype}')


def _confusion_counts(preds: torch.Tensor, targets: torch.Tensor, num_classes: int,
                      ignore_index: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-only counting, no host sync. preds [...] in 0..K-1, targets [...] of the same shape (any integer
    dtype) -> (confusion int64 [K, K] (rows: target, columns: prediction), bad int64 [] = pixels whose target is
    neither in 0..K-1 nor ignore_index, bad_value int64 [] = the largest such target, ``_NO_BAD_VALUE`` if none).
    """
    targets = targets.reshape(-1).long()
    preds = preds.reshape(-1).long()
    labelled = targets != ignore_index
    in_range = (targets >= 0) & (targets < num_classes)
    bad = labelled & ~in_range
    cells = num_classes * num_classes
    # every pixel lands in one bin: a confusion cell, "ignored" (cells) or "bad" (cells + 1)
    # in_range excludes ignore_index: __init__ refuses an ignore_index that is a class id
    bins = torch.where(in_range, targets * num_classes + preds, cells + bad.long())
    # scatter_add_ rather than bincount: CUDA's bincount reads the input's min and max back to the host (two syncs)
    counts = torch.zeros(cells + 2, dtype=torch.int64, device=targets.device)
    counts.scatter_add_(0, bins, torch.ones((), dtype=torch.int64, device=targets.device).expand_as(bins))
    # a fill, not torch.tensor(...): a copy from host memory would be a sync
    no_bad = torch.full((), _NO_BAD_VALUE, dtype=torch.int64, device=targets.device)
    bad_value = torch.where(bad, targets, no_bad).amax() if targets.numel() else no_bad
    return counts[:cells].reshape(num_classes, num_classes), counts[cells + 1], bad_value


def _bad_target_error(bad_value: int, bad_pixels: int, num_classes: int, ignore_index: int) -> ValueError:
    return ValueError(f'target value {bad_value} is outside 0..{num_classes - 1} and is not ignore_index='
                      f'{ignore_index} ({bad_pixels} such pixels); fix the masks or num_classes / ignore_index')


def confusion_matrix(preds: torch.Tensor, targets: torch.Tensor, num_classes: int, ignore_index: int) -> torch.Tensor:
    """Pixel counts per (ground truth, prediction) pair: preds [...] int class indices, targets [...] int of the same
    shape -> int64 [K, K] on the inputs' device, row = ground-truth class, column = predicted class.

    Pixels whose target is ``ignore_index`` are not counted. A target outside 0..K-1 that is not ``ignore_index``, or
    a prediction outside 0..K-1, raises ValueError naming the value. That check reads one flag back to the host (one
    sync per call); ``SegmentationMeter`` counts without it and raises in ``compute`` instead.
    """
    if preds.shape != targets.shape:
        raise ValueError(f'preds and targets must have the same shape, got {tuple(preds.shape)} and '
                         f'{tuple(targets.shape)}')
    for name, tensor in (('preds', preds), ('targets', targets)):
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
            raise ValueError(f'{name} must be integer class indices, got {tensor.dtype}')
    bad_preds = (preds < 0) | (preds >= num_classes)
    confusion, bad, bad_value = _confusion_counts(preds.clamp(0, num_classes - 1), targets, num_classes, ignore_index)
    # the one host sync: both checks in one read-back
    any_bad_pred, bad_pixels = torch.stack([bad_preds.any().long(), bad]).tolist()
    if bad_pixels:
        raise _bad_target_error(int(bad_value), bad_pixels, num_classes, ignore_index)
    if any_bad_pred:
        raise ValueError(f'prediction value {int(preds[bad_preds][0])} is outside 0..{num_classes - 1}')
    return confusion


class SegmentationMeter(Meter):
    """Confusion matrix, summed cross-entropy and pixel count over many batches, on the device without host syncs.

    Counters (one device): confusion int64 [K, K] (rows: ground truth, columns: prediction; its sum is the number of
    counted pixels), loss_sum float64 [] (float32 on MPS), and for targets outside 0..K-1 that are not
    ``ignore_index``: bad_pixels int64 [] and bad_value int64 [] (the largest such value, reduced with MAX). Those
    are not raised in ``update`` (that would need a host sync per batch, and in a distributed run one rank raising
    alone leaves the others waiting in ``reduce_``): ``compute`` raises ValueError naming the value, on every rank.
    Use: ``update`` per batch, ``reduce_`` once (sums over processes), then ``compute``.
    """
    MAX_COUNTERS = ('bad_value',)

    def __init__(self, num_classes: int, ignore_index: int = 255, device: Optional[torch.device] = None):
        if int(num_classes) < 1:
            raise ValueError(f'num_classes must be >= 1, got {num_classes}')
        if 0 <= ignore_index < num_classes:
            raise ValueError(f'ignore_index={ignore_index} is one of the {num_classes} classes 0..{num_classes - 1}')
        self.num_classes = int(num_classes)
        self.ignore_index = int(ignore_index)
        super().__init__(device)

    def _zeros(self, device: torch.device) -> Counters:
        return {'confusion': torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64, device=device),
                'bad_pixels': torch.zeros((), dtype=torch.int64, device=device),
                'loss_sum': torch.zeros((), dtype=float_counter_dtype(device), device=device),
                'bad_value': torch.full((), _NO_BAD_VALUE, dtype=torch.int64, device=device)}

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """Add one batch.

        logits [B, K, H, W] (any float dtype; the prediction is their argmax, ``class_ids(logits)``); targets
        [B, H, W] integer class indices (``ignore_index`` = unlabelled); loss_sum: 0-d tensor, the SUM of the
        per-pixel cross-entropy over the batch's labelled pixels (``F.cross_entropy(..., ignore_index=...,
        reduction='sum')``). One device.
        """
        self._check_open()
        _check_segmentation_batch(logits, targets, self.num_classes)
        if loss_sum.ndim != 0:
            raise ValueError(f'loss_sum must be a 0-d tensor (the summed per-pixel loss), got {tuple(loss_sum.shape)}')
        counters = self._counters_on(logits.device)
        confusion, bad, bad_value = _confusion_counts(class_ids(logits), targets, self.num_classes,
                                                      self.ignore_index)
        counters['confusion'] += confusion
        counters['bad_pixels'] += bad
        torch.maximum(counters['bad_value'], bad_value, out=counters['bad_value'])
        counters['loss_sum'] += loss_sum.detach().to(counters['loss_sum'].dtype)

    def confusion(self) -> torch.Tensor:
        """The accumulated confusion matrix, int64 [K, K] (rows: ground truth, columns: prediction); zeros if empty."""
        if self._counters is None:
            return torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64)
        return self._counters['confusion'].clone()

    def compute(self) -> Dict[str, Any]:
        """{'miou': mean IoU over the classes present in ground truth or prediction, 'pixel_acc': correct / counted
        pixels, 'loss': loss_sum / counted pixels, 'pixels': counted pixels (int), 'per_class_iou': [K] floats, NaN
        for a class absent from both}. Fractions in [0, 1]; with no pixels they are NaN. One host sync. Raises
        ValueError naming the value if any target was outside 0..K-1 and not ``ignore_index``."""
        if self._counters is None:
            return _scores_from_confusion(np.zeros((self.num_classes, self.num_classes)), math.nan)
        c = self._counters
        values = torch.cat([c['confusion'].double().reshape(-1), c['bad_pixels'].double()[None],
                            c['loss_sum'].double()[None]]).tolist()
        cells = self.num_classes * self.num_classes
        bad_pixels = int(values[cells])
        if bad_pixels:
            # the value itself from the int64 counter: float64 would round a huge one
            raise _bad_target_error(int(c['bad_value']), bad_pixels, self.num_classes, self.ignore_index)
        confusion = np.asarray(values[:cells], dtype=np.float64).reshape(self.num_classes, self.num_classes)
        return _scores_from_confusion(confusion, values[cells + 1])


def _scores_from_confusion(confusion: np.ndarray, loss_sum: float) -> Dict[str, Any]:
    """The ``SegmentationMeter.compute`` dict from a confusion matrix [K, K] (rows: ground truth, columns:
    prediction) and the summed per-pixel loss. IoU_c = TP / (TP + FP + FN) = C[c, c] / (row_c + column_c - C[c, c]);
    NaN where that union is 0; mIoU is their nanmean (NaN when every class is NaN)."""
    confusion = np.asarray(confusion, dtype=np.float64)
    true_positive = np.diag(confusion)
    union = confusion.sum(axis=1) + confusion.sum(axis=0) - true_positive
    with np.errstate(invalid='ignore', divide='ignore'):
        per_class: List[float] = np.where(union > 0, true_positive / union, math.nan).tolist()
    present = [iou for iou in per_class if not math.isnan(iou)]
    pixels = int(round(confusion.sum()))
    return {
        'miou': sum(present) / len(present) if present else math.nan,
        'pixel_acc': float(true_positive.sum()) / pixels if pixels else math.nan,
        'loss': loss_sum / pixels if pixels else math.nan,
        'pixels': pixels,
        'per_class_iou': per_class,
    }


# --- autoregressive pretraining ---------------------------------------------------------------------------------

class NextPatchMeter(Meter):
    """Squared error, target sum of squares, value count and image count over many batches, summed on the device
    (float64; float32 on MPS) without host syncs; ``reduce_`` sums them over processes, ``compute`` reads them once.

    ``loss`` is SSE / values (the mean squared error, the training loss's definition over the whole set), so no
    separate loss sum is kept.
    """

    def _zeros(self, device: torch.device) -> Counters:
        return {'sums': torch.zeros(4, dtype=float_counter_dtype(device), device=device)}  # [sse, sst, values, images]

    @torch.no_grad()
    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        """Add one batch: predictions and targets [B, M, P] of the same shape (``align_next_patch``)."""
        self._check_open()
        if predictions.shape != targets.shape or predictions.ndim != 3:
            raise ValueError(f"predictions and targets must be [B, M, P] of one shape, got {tuple(predictions.shape)} "
                             f"and {tuple(targets.shape)}")
        sums = self._counters_on(predictions.device)['sums']
        dtype = sums.dtype
        sums[0] += (predictions.to(dtype) - targets.to(dtype)).square().sum()
        sums[1] += targets.to(dtype).square().sum()
        sums[2] += targets.numel()
        sums[3] += targets.shape[0]

    def compute(self) -> Dict[str, float]:
        """{'loss': SSE / values, 'r2': 1 - SSE / SST, 'count': images}. One host sync; NaN and 0 with no data."""
        if self._counters is None:
            return {'loss': math.nan, 'r2': math.nan, 'count': 0}
        sse, sst, values, images = self._counters['sums'].double().tolist()
        if values == 0:
            return {'loss': math.nan, 'r2': math.nan, 'count': 0}
        return {'loss': sse / values, 'r2': 1.0 - sse / sst if sst > 0 else math.nan, 'count': int(round(images))}


# ---------------------------------------------------------------------------------------------------- detection

#: COCOeval.stats' first six entries, by the names metrics.json gives them (masks: the same with 'mask_' before)
COCO_BOX_METRICS = ('ap', 'ap50', 'ap75', 'ap_small', 'ap_medium', 'ap_large')
#: what precedes COCO_BOX_METRICS' names for the masks' AP (``DetectionMeter`` of a detector with masks)
MASK_PREFIX = 'mask_'
#: a detector's mask probabilities at or above this are the object's pixels (torchvision's Mask R-CNN convention)
MASK_THRESHOLD = 0.5
#: COCOeval's default maxDets[-1]: the detections of an image and class that AP counts
COCO_MAX_DETECTIONS = 100
#: one image's objects: 'boxes' [N, 4] (x1, y1, x2, y2 in pixels), 'labels' [N] (classes 1..K, as torchvision's
#: detectors and linvit.data.detection give them), for detections 'scores' [N]; with masks, 'masks': their COCO
#: run-length encodings (``mask_rles``), one per object
Boxes = Dict[str, Any]


def _xywh(boxes: torch.Tensor) -> List[List[float]]:
    """[N, 4] x1, y1, x2, y2 -> COCO's [x, y, width, height] rows."""
    boxes = boxes.detach().double().cpu()
    return torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1).tolist()


def mask_rles(masks: torch.Tensor) -> List[Dict[str, Any]]:
    """Binary masks [N, H, W] (bool or 0/1) -> N COCO run-length encodings (pycocotools.mask.encode)."""
    from pycocotools import mask as mask_utils
    pixels = masks.detach().to('cpu', torch.uint8).numpy()
    return mask_utils.encode(np.asfortranarray(pixels.transpose(1, 2, 0))) if len(pixels) else []


def _objects(image: Boxes, iou_type: str, category_ids: Optional[Sequence[int]] = None) -> List[Dict[str, Any]]:
    """One image's objects as COCO annotation fields: bbox, or segmentation and its area; category_id the label, or
    ``category_ids[label - 1]``."""
    labels = [int(label) if category_ids is None else int(category_ids[label - 1])
              for label in image['labels'].tolist()]
    if iou_type == 'bbox':
        return [{'category_id': label, 'bbox': box, 'area': box[2] * box[3]}
                for box, label in zip(_xywh(image['boxes']), labels)]
    from pycocotools import mask as mask_utils
    return [{'category_id': label, 'segmentation': rle, 'area': float(mask_utils.area(rle))}
            for rle, label in zip(image['masks'], labels)]


def _coco_images(targets: Sequence[Boxes], detections: Sequence[Boxes]) -> List[Dict[str, Any]]:
    """COCO's image entries, ids 1..: with masks, each image's height and width (pycocotools reads masks by them),
    taken from its masks' encodings (an image with no mask at all has none to read)."""
    images = []
    for image_id, (target, found) in enumerate(zip(targets, detections), start=1):
        rles = [*target.get('masks', ()), *found.get('masks', ())]
        size = {'height': int(rles[0]['size'][0]), 'width': int(rles[0]['size'][1])} if rles else {}
        images.append({'id': image_id, **size})
    return images


def _coco_ground_truth(targets: Sequence[Boxes], images: List[Dict[str, Any]], num_classes: int,
                       iou_type: str) -> Dict[str, Any]:
    """The ground truth as a COCO dataset dict: ``images`` (``_coco_images``), category ids 1..K (the labels)."""
    annotations = [{**fields, 'id': 0, 'image_id': image_id, 'iscrowd': 0}
                   for image_id, target in enumerate(targets, start=1) for fields in _objects(target, iou_type)]
    for number, annotation in enumerate(annotations, start=1):
        annotation['id'] = number
    return {'images': images, 'annotations': annotations,
            'categories': [{'id': c} for c in range(1, num_classes + 1)]}


def _coco_detections(detections: Sequence[Boxes], iou_type: str, image_ids: Sequence[Any],
                     category_ids: Optional[Sequence[int]] = None) -> List[Dict[str, Any]]:
    """COCO results rows {image_id, category_id, bbox or segmentation, area, score} of each image's detections."""
    return [{**fields, 'image_id': image_id, 'score': float(score)}
            for image_id, found in zip(image_ids, detections)
            for fields, score in zip(_objects(found, iou_type, category_ids), found['scores'].tolist())]


def _quietly_evaluated(ground_truth: Any, found: List[Dict[str, Any]], iou_type: str, max_detections: int,
                       image_ids: Optional[Sequence[Any]] = None) -> Any:
    """COCOeval of the results rows ``found`` against the pycocotools COCO ``ground_truth``, evaluated, accumulated
    and summarised (its printing swallowed), with ``max_detections`` as maxDets[-1] and, when given, only the images
    ``image_ids``."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        results = ground_truth.loadRes(found) if found else COCO()
        if not found:  # loadRes refuses an empty list: no detection scores 0 where there is ground truth
            results.dataset = {'images': ground_truth.dataset['images'], 'annotations': [],
                               'categories': ground_truth.dataset['categories']}
            results.createIndex()
        evaluation = COCOeval(ground_truth, results, iou_type)
        # COCOeval sorts maxDets and evaluates at the largest: [1, 10, M], or [1, M, M] below 10
        evaluation.params.maxDets = [1, min(10, int(max_detections)), int(max_detections)]
        if image_ids is not None:
            evaluation.params.imgIds = sorted(set(image_ids))
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return evaluation


def _metrics_of(evaluation: Any, class_names: Sequence[str], images: int) -> Dict[str, Any]:
    """metrics.json's names for COCOeval's AP (stats[0:6]) and each class's AP."""
    stats = list(evaluation.stats[:6])
    # COCOeval.summarize reads stats[0] at maxDets=100 whatever params.maxDets says (-1 when 100 is not among
    # them); the others at maxDets[-1]: stats[0] the same way, as COCOeval's own _summarize computes it
    stats[0] = _mean_precision(evaluation.eval['precision'][:, :, :, 0, -1])
    metrics: Dict[str, Any] = {name: _coco_value(value) for name, value in zip(COCO_BOX_METRICS, stats)}
    metrics['per_class_ap'] = _per_class_ap(evaluation, class_names)
    metrics['images'] = images
    return metrics


def coco_box_metrics(detections: Sequence[Boxes], targets: Sequence[Boxes], class_names: Sequence[str],
                     iou_type: str = 'bbox', max_detections: int = COCO_MAX_DETECTIONS) -> Dict[str, Any]:
    """COCO AP (pycocotools' COCOeval: IoU 0.50:0.95, small / medium / large by area, up to ``max_detections``
    detections per image and class: COCOeval's maxDets[-1]) of ``detections`` against ``targets``, one entry of each
    per image, labels 1..K naming ``class_names[label - 1]``. The targets are the whole ground truth: no crowds, and
    objects sized by their boxes in the pixels given (for a COCO annotation file's own crowds, areas and ids:
    ``coco_file_metrics``). ``iou_type`` 'bbox' matches boxes; 'segm' matches the 'masks' (run-length encodings,
    ``mask_rles``) and sizes objects by their mask's area.

    Returns {'ap', 'ap50', 'ap75', 'ap_small', 'ap_medium', 'ap_large': floats, 'per_class_ap': {name: AP over IoU
    0.50:0.95}, 'images': count}. Where COCO has nothing to average (no ground truth of that class or size) the value
    is NaN (COCOeval's -1); no detection at all scores 0 where there is ground truth."""
    from pycocotools.coco import COCO

    if len(detections) != len(targets):
        raise ValueError(f"coco_box_metrics: {len(detections)} images of detections for {len(targets)} of targets")
    ground_truth = COCO()
    ground_truth.dataset = _coco_ground_truth(targets, _coco_images(targets, detections), len(class_names), iou_type)
    with contextlib.redirect_stdout(io.StringIO()):
        ground_truth.createIndex()
    found = _coco_detections(detections, iou_type, range(1, len(detections) + 1))
    return _metrics_of(_quietly_evaluated(ground_truth, found, iou_type, max_detections), class_names, len(targets))


def coco_ground_truth(annotation_file: str) -> Any:
    """pycocotools' COCO of ``annotation_file``, with an 'area' for every annotation that has none: its box's
    (COCOeval sizes objects by 'area'; it is what COCO's loadRes gives a result without one)."""
    from pycocotools.coco import COCO
    with contextlib.redirect_stdout(io.StringIO()):
        ground_truth = COCO(annotation_file)
    for annotation in ground_truth.dataset['annotations']:
        if 'area' not in annotation:
            annotation['area'] = annotation['bbox'][2] * annotation['bbox'][3]
    return ground_truth


def coco_file_metrics(annotation_file: str, detections: Sequence[Boxes], image_ids: Sequence[Any],
                      class_names: Sequence[str], category_ids: Sequence[int], iou_type: str = 'bbox',
                      max_detections: int = COCO_MAX_DETECTIONS, ground_truth: Any = None) -> Dict[str, Any]:
    """COCOeval of ``detections`` (one per image of ``image_ids``, the annotation file's image ids; boxes and masks
    in the image's own pixels, as the file's width and height give them; labels 1..K, label i being category
    ``category_ids[i - 1]`` named ``class_names[i - 1]``) against the annotation file itself: its crowds are ignore
    regions, its objects sized by their 'area' (``coco_ground_truth``), AP over the evaluated images only. What
    pycocotools gives for the file and a results file of these detections; the same keys as ``coco_box_metrics``.
    ``ground_truth``: the file already loaded by ``coco_ground_truth`` (boxes and masks read it once)."""
    if len(detections) != len(image_ids):
        raise ValueError(f"coco_file_metrics: {len(detections)} images of detections for {len(image_ids)} image ids")
    ground_truth = ground_truth if ground_truth is not None else coco_ground_truth(annotation_file)
    found = _coco_detections(detections, iou_type, image_ids, category_ids)
    evaluation = _quietly_evaluated(ground_truth, found, iou_type, max_detections, image_ids)
    return _metrics_of(evaluation, class_names, len(set(image_ids)))


def _coco_value(value: float) -> float:
    return math.nan if value < 0 else float(value)


def _mean_precision(values: np.ndarray) -> float:
    """The mean of a COCOeval precision table's defined entries (-1 marks the undefined), or -1 with none."""
    values = values[values > -1]
    return float(values.mean()) if values.size else -1.0


def _per_class_ap(evaluation: Any, class_names: Sequence[str]) -> Dict[str, float]:
    """Each class's AP over the IoU thresholds (all areas, maxDets[-1] detections): the mean of its precision
    table's defined entries, as COCOeval.summarize averages them over classes. Classes in the order of COCOeval's
    category ids (sorted), which is the labels' order."""
    precision = evaluation.eval['precision']  # [IoU thresholds, recall points, classes, areas, max detections]
    return {str(name): _coco_value(_mean_precision(precision[:, :, index, 0, -1]))
            for index, name in enumerate(class_names)}


class DetectionMeter(Meter):
    """COCO box AP over many batches, and mask AP when the detections and targets have masks. Unlike the other
    meters it keeps every image's objects on the host (COCO's matching is a host computation over variable-length
    lists): ``update`` copies the boxes to the CPU and run-length encodes the masks, ``reduce_`` gathers them from
    every process (all_gather_object), ``compute`` runs COCOeval once (twice with masks).

        meter = DetectionMeter(class_names)
        meter.update(detector(images), targets)   # lists of {'boxes' [N, 4] xyxy, 'labels' [N] 1..K(, 'scores' [N])
                                                  # (, 'masks': detections [N, 1, H, W] probabilities, targets
                                                  # [N, H, W] 0/1)}
        meter.reduce_()
        meter.compute()                           # {'ap': .., 'ap50': .., ..., 'per_class_ap': {name: ..}, 'images'}
                                                  # (, 'mask_ap', 'mask_ap50', ..., 'mask_per_class_ap')

    Two kinds of ground truth. Without ``annotation_file`` the targets are it (``coco_box_metrics``: the built-in
    shapes). With it, the ground truth is that COCO annotation file (``coco_file_metrics``: its crowds, areas, ids):
    each target needs only its 'image_id' (the file's), and the detections must be in the image's own pixels, labels
    1..K mapped to ``category_ids``; an image met twice (a sampler's padded duplicate) counts once.
    ``max_detections``: COCOeval's maxDets[-1], the detections of each image and class that AP counts.
    """

    def __init__(self, class_names: Sequence[str], max_detections: int = COCO_MAX_DETECTIONS,
                 annotation_file: Optional[str] = None, category_ids: Optional[Sequence[int]] = None) -> None:
        self.class_names = list(class_names)
        self.max_detections = int(max_detections)
        self.annotation_file = annotation_file
        self.category_ids = list(category_ids) if category_ids is not None else list(range(1, len(class_names) + 1))
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self._detections: List[Boxes] = []
        self._targets: List[Boxes] = []

    def _zeros(self, device: torch.device) -> Counters:
        return {}

    @torch.no_grad()
    def update(self, detections: Sequence[Boxes], targets: Sequence[Boxes],
               valid: Optional[Sequence[bool]] = None) -> None:
        """Add one batch: per image, the detector's boxes (with 'scores') and the ground truth (with an annotation
        file: its 'image_id'); ``valid`` False marks a sampler's padded duplicate, left out."""
        self._check_open()
        if len(detections) != len(targets):
            raise ValueError(f"DetectionMeter.update: {len(detections)} images of detections for {len(targets)} of "
                             f"targets")
        keep = [True] * len(targets) if valid is None else [bool(v) for v in valid]
        target_keys = ('image_id',) if self.annotation_file else ('boxes', 'labels')
        for found, target, kept in zip(detections, targets, keep):
            if kept:
                self._detections.append(_on_host(found, ('boxes', 'labels', 'scores'),
                                                 lambda masks: masks[:, 0] >= MASK_THRESHOLD))
                self._targets.append(_on_host(target, target_keys, lambda masks: masks,
                                              with_masks=not self.annotation_file))

    @torch.no_grad()
    def reduce_(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """Gather every process's images (in rank order) on every process; a no-op on one process."""
        if self._reduced:
            raise RuntimeError('DetectionMeter.reduce_ called twice: the images would be gathered again')
        self._reduced = True
        if not distributed_running():
            return
        gathered: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (self._detections, self._targets), group=group)
        self._detections = [found for part, _ in gathered for found in part]
        self._targets = [target for _, part in gathered for target in part]

    def compute(self) -> Dict[str, Any]:
        if not self._targets:
            return {**{name: math.nan for name in COCO_BOX_METRICS}, 'per_class_ap': {}, 'images': 0}
        with_masks = all('masks' in image for image in self._detections) and (
            self.annotation_file is not None or all('masks' in image for image in self._targets))
        iou_types = ('bbox', 'segm') if with_masks else ('bbox',)
        scores = self._file_metrics(iou_types) if self.annotation_file else [
            coco_box_metrics(self._detections, self._targets, self.class_names, iou_type, self.max_detections)
            for iou_type in iou_types]
        metrics = scores[0]
        if with_masks:
            metrics.update({MASK_PREFIX + name: scores[1][name] for name in (*COCO_BOX_METRICS, 'per_class_ap')})
        return metrics

    def _file_metrics(self, iou_types: Sequence[str]) -> List[Dict[str, Any]]:
        """``coco_file_metrics`` for each IoU type, each image once (the first time it was met)."""
        first: Dict[int, Boxes] = {}
        for found, target in zip(self._detections, self._targets):
            first.setdefault(int(target['image_id']), found)
        ground_truth = coco_ground_truth(self.annotation_file)
        return [coco_file_metrics(self.annotation_file, list(first.values()), list(first), self.class_names,
                                  self.category_ids, iou_type, self.max_detections, ground_truth)
                for iou_type in iou_types]


def _on_host(image: Boxes, keys: Sequence[str], binary: Any, with_masks: bool = True) -> Boxes:
    """``image``'s ``keys`` on the CPU, and its masks (when it has them and ``with_masks``) made binary by
    ``binary`` and run-length encoded: a few bytes per object instead of a full-size mask."""
    kept = {key: image[key].detach().cpu() for key in keys}
    if with_masks and 'masks' in image:
        kept['masks'] = mask_rles(binary(image['masks']))
    return kept
