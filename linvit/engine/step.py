"""The step runner: forward + loss (eager or compiled), backward, gradient accumulation, float16 loss scaling,
gradient clipping and the optimizer step, around one model.

    step = TrainStep(model, loss_fn, optimizer, compile=True)     # one whole step per batch
    loss = step(images, targets)                                  # (compile_train_step(model, loss_fn, optimizer))

    step = TrainStep(ddp_model, loss_fn, optimizer, grad_scaler=scaler, accum_steps=4, clip_grad=1.0)
    for micro, (images, targets) in enumerate(batches):           # the trainer's loop
        loss = step.accumulate(images, targets, last=(micro + 1) % 4 == 0)
        if (micro + 1) % 4 == 0:
            step.optimizer_step()

Forward + loss is a ``linvit.fast.LossGraph`` (the compiled graph when ``compile=True``); everything after it runs
eagerly here.
"""
import contextlib
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..fast.compiler import LossFn, LossGraph

__all__ = ['TrainStep', 'compile_train_step']


class TrainStep:
    """Training steps of ``model`` on ``loss_fn``: ``step(images, targets)`` for a whole step on one batch, or
    ``accumulate`` per micro-batch and ``optimizer_step`` once per step (gradient accumulation, DDP).

    images [B, C, H, W]; the returned losses are detached 0-dim tensors on the images' device (reading one with
    ``.item()`` syncs, so log it only every few steps). The model's train/eval mode is the caller's choice.

    optimizer: stepped by ``__call__`` (when given) and ``optimizer_step``.
    compile: False runs forward + loss eagerly (the reference); True compiles it as one graph (``LossGraph``).
    amp_dtype: None (no autocast) or torch.bfloat16 / torch.float16 (autocast on the images' device type).
    grad_scaler: a ``torch.amp.GradScaler`` for float16: the loss is scaled before backward, the gradients unscaled
        before clipping, and the optimizer stepped through it.
    accum_steps: micro-batches per optimizer step in ``accumulate``: each adds grad(loss / accum_steps).
    clip_grad: clip the gradients' global norm to this before each ``optimizer_step`` (None / 0: off).
    mode, dynamic, fullgraph, backend, retain_freed_memory: as for ``linvit.fast.compile_model``.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 compile: bool = False, amp_dtype: Optional[torch.dtype] = None,
                 grad_scaler: Optional[torch.amp.GradScaler] = None, accum_steps: int = 1,
                 clip_grad: Optional[float] = None, mode: Optional[str] = None, dynamic: bool = False,
                 fullgraph: bool = True, backend: Any = 'inductor', retain_freed_memory: bool = True) -> None:
        if accum_steps < 1:
            raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
        self.graph = LossGraph(model, loss_fn, compile=compile, amp_dtype=amp_dtype, mode=mode, dynamic=dynamic,
                               fullgraph=fullgraph, backend=backend, retain_freed_memory=retain_freed_memory)
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.accum_steps = accum_steps
        self.clip_grad = clip_grad
        # the graph that gets compiled, for check_graph_breaks(step.forward_loss, images, targets)
        self.forward_loss = self.graph.forward_loss

    def loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The (compiled) forward + loss only: a 0-dim loss with its graph, for callers that run backward themselves.
        Bad image sizes raise ValueError."""
        return self.graph(images, targets)

    def __call__(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One whole step on one batch: set the gradients to None, loss, backward, and with an optimizer its step
        (unscaled and clipped as configured). Gradients are not accumulated across calls; they stay for reading."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        loss = self.loss(images, targets)
        self._backward(loss)
        if self.optimizer is not None:
            self._step_optimizer()
        return loss.detach()

    def accumulate(self, images: torch.Tensor, targets: torch.Tensor, last: bool) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch: the gradients grow by grad(loss / accum_steps).

        last: whether this micro-batch ends the step; only then does DistributedDataParallel all-reduce the
        gradients (before, its ``no_sync`` skips that). Returns the micro-batch's loss (not divided), detached.
        """
        skip_sync = not last and isinstance(self.model, DistributedDataParallel)
        with self.model.no_sync() if skip_sync else contextlib.nullcontext():
            loss = self.loss(images, targets)
            self._backward(loss / self.accum_steps)
        return loss.detach()

    def optimizer_step(self) -> None:
        """Apply the accumulated gradients (unscale for float16, clip, step, update the scaler), then set them to
        None for the next step."""
        if self.optimizer is None:
            raise RuntimeError('TrainStep.optimizer_step needs an optimizer')
        self._step_optimizer()
        self.optimizer.zero_grad(set_to_none=True)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss).backward()

    def _step_optimizer(self) -> None:
        if self.grad_scaler is not None:
            if self.clip_grad:
                self.grad_scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            if self.clip_grad:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
            self.optimizer.step()


def compile_train_step(model: nn.Module, loss_fn: LossFn, optimizer: Optional[torch.optim.Optimizer] = None,
                       **kwargs: Any) -> TrainStep:
    """``TrainStep(model, loss_fn, optimizer, compile=True, **kwargs)``: forward + loss compiled as one graph
    (``linvit.fast.LossGraph``), then backward and, with an optimizer, its step. ``step(images, targets) -> loss``
    for images [B, C, H, W]; kwargs as for ``TrainStep`` (amp_dtype, mode, dynamic, backend, ...)."""
    return TrainStep(model, loss_fn, optimizer, compile=True, **kwargs)
