"""Classification metrics accumulated on the device: top-k accuracy and mean loss, summed across processes.

    meter = ClassificationMeter(ks=(1, 5))
    for images, targets, valid in loader:           # valid: bool [B], False for the sampler's padded duplicates
        logits = model(images)                       # [B, C]
        losses = F.cross_entropy(logits, targets, reduction='none')    # [B]
        meter.update(logits, targets, losses, valid=valid)
    meter.reduce_()                                  # all_reduce(SUM) when torch.distributed is initialized
    meter.compute()                                  # {'top1': 0.71, 'top5': 0.93, 'loss': 1.02, 'count': 10000}

``update`` only queues device work (no ``.item()``, no host sync); ``compute`` reads the counters back once.

Padded duplicates: ``DistributedSampler`` (``drop_last=False``) repeats the first samples so every process gets the
same number; counting them would bias the metric. Pass ``valid`` (bool [B], False for a duplicate) to exclude them;
then ``loss`` must be per-sample losses [B] (the meter sums the valid ones) or a 0-d sum over the valid samples only.

Ties: a sample counts as top-k correct if its target is among the k indices ``torch.topk`` returns. When several
classes tie for the k-th place, torch.topk picks which of them are returned (an implementation detail: not
necessarily the lowest index, and it may differ between devices), exactly like ``timm.utils.accuracy``. This never
counts a tie optimistically: a model that outputs the same logit for every class scores one class per sample at
top-1, not all of them.
"""
import math
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ['topk_correct', 'ClassificationMeter']


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


def _topk_hits(logits: torch.Tensor, targets: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """hits[b, i] is True when targets[b] is among the top-ks[i] logits of row b. logits [B, C], targets [B] ->
    hits bool [B, len(ks)]. k > C is clamped to C."""
    num_classes = logits.shape[1]
    max_k = min(max(ks), num_classes)
    top_indices = logits.topk(max_k, dim=1, largest=True, sorted=True).indices       # [B, max_k]
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
    return _topk_hits(logits, targets, ks).sum(dim=0, dtype=torch.int64)


class ClassificationMeter:
    """Top-k accuracy and mean loss over many batches, accumulated on the logits' device without host syncs.

    Counters (all on one device): correct int64 [len(ks)], count int64 [], loss_sum float64 [] (float32 on MPS,
    which has no float64). Use: ``update`` per batch, then ``reduce_`` once (sums over processes), then ``compute``.
    """

    def __init__(self, ks: Sequence[int] = (1, 5), device: Optional[torch.device] = None):
        _check_ks(ks)
        self.ks = tuple(int(k) for k in ks)
        self._device = device
        self.reset()

    def reset(self) -> None:
        """Forget every update (and a previous ``reduce_``)."""
        self._correct: Optional[torch.Tensor] = None
        self._count: Optional[torch.Tensor] = None
        self._loss_sum: Optional[torch.Tensor] = None
        self._reduced = False
        if self._device is not None:
            self._allocate(torch.device(self._device))

    def _allocate(self, device: torch.device) -> None:
        loss_dtype = torch.float32 if device.type == 'mps' else torch.float64
        self._correct = torch.zeros(len(self.ks), dtype=torch.int64, device=device)
        self._count = torch.zeros((), dtype=torch.int64, device=device)
        self._loss_sum = torch.zeros((), dtype=loss_dtype, device=device)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor,
               valid: Optional[torch.Tensor] = None) -> None:
        """Add one batch.

        logits [B, C]; targets [B] int64 class indices; loss: per-sample losses [B], or a 0-d tensor holding the SUM
        of the per-sample losses over the batch's valid samples (not the mean); valid: optional bool [B], False for
        samples to leave out (a distributed sampler's padded duplicates). All on the same device.
        """
        if self._reduced:
            raise RuntimeError('ClassificationMeter.update after reduce_: the counters are already global; reset() '
                               'first')
        _check_batch(logits, targets)
        if loss.ndim not in (0, 1) or (loss.ndim == 1 and loss.shape != targets.shape):
            raise ValueError(f'loss must be a 0-d sum or per-sample [B={targets.shape[0]}], got {tuple(loss.shape)}')
        if valid is not None and (valid.dtype != torch.bool or valid.shape != targets.shape):
            raise ValueError(f'valid must be bool [B={targets.shape[0]}], got {valid.dtype} {tuple(valid.shape)}')
        if self._correct is None:
            self._allocate(logits.device)

        hits = _topk_hits(logits, targets, self.ks)                                  # [B, len(ks)]
        if valid is not None:
            hits = hits & valid[:, None]
            if loss.ndim == 1:
                loss = loss.masked_fill(~valid, 0)
        self._correct += hits.sum(dim=0, dtype=torch.int64)
        self._count += targets.shape[0] if valid is None else valid.sum(dtype=torch.int64)
        self._loss_sum += loss.detach().sum(dtype=self._loss_sum.dtype)

    def _collective_device(self, group: Optional[dist.ProcessGroup]) -> torch.device:
        if self._correct is not None:
            return self._correct.device
        # a process that saw no batch still has to take part, on a device its backend can reduce
        if dist.get_backend(group) == 'nccl':
            return torch.device('cuda', torch.cuda.current_device())
        return torch.device('cpu')

    @torch.no_grad()
    def reduce_(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """Sum the counters over the processes of ``group`` (all_reduce SUM), in place; a no-op when
        torch.distributed is not initialized. Every process must call it; call it once, after the last ``update``.
        """
        if self._reduced:
            raise RuntimeError('ClassificationMeter.reduce_ called twice: the counters would be summed again')
        self._reduced = True
        if not (dist.is_available() and dist.is_initialized()):
            return
        if self._correct is None:
            self._allocate(self._collective_device(group))
        # one collective for all counters; float64 holds integer counts exactly up to 2**53
        packed = torch.cat([self._correct.double(), self._count.double()[None], self._loss_sum.double()[None]])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        num_ks = len(self.ks)
        self._correct.copy_(packed[:num_ks].round())
        self._count.copy_(packed[num_ks].round())
        self._loss_sum.copy_(packed[num_ks + 1])

    def compute(self) -> Dict[str, float]:
        """{'top1': fraction in [0, 1], 'top5': ..., (one 'top{k}' per k), 'loss': mean per-sample loss,
        'count': samples counted}. One host sync. With no samples, the fractions and loss are NaN and count is 0."""
        if self._correct is None:
            return {**{f'top{k}': math.nan for k in self.ks}, 'loss': math.nan, 'count': 0}
        values = torch.cat([self._correct.double(), self._count.double()[None], self._loss_sum.double()[None]]).tolist()
        correct, count, loss_sum = values[:len(self.ks)], int(values[len(self.ks)]), values[len(self.ks) + 1]
        if count == 0:
            return {**{f'top{k}': math.nan for k in self.ks}, 'loss': math.nan, 'count': 0}
        return {**{f'top{k}': c / count for k, c in zip(self.ks, correct)}, 'loss': loss_sum / count, 'count': count}
