"""linvit.engine.step.TrainStep against plain PyTorch written out by hand: a whole step, gradient accumulation,
clipping and the float16 scaler's order (unscale before clipping)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from linvit.engine.step import TrainStep


def tiny_model(seed: int = 0) -> nn.Module:
    """images [B, 3, 4, 4] -> logits [B, 5]."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.GELU(), nn.Linear(16, 5))


def batch(size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, 4, 4, generator=generator), torch.randint(0, 5, (size,), generator=generator)


def assert_same_parameters(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_a_whole_step_is_zero_grad_loss_backward_and_optimizer_step():
    model, reference = tiny_model(), tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    step = TrainStep(model, F.cross_entropy, opt)
    for seed in range(3):
        images, labels = batch(8, seed)
        loss = step(images, labels)
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(reference(images), labels)
        ref_loss.backward()
        ref_opt.step()
        assert loss.shape == () and not loss.requires_grad
        torch.testing.assert_close(loss, ref_loss.detach())
        assert_same_parameters(model, reference)


@pytest.mark.parametrize('clip_grad', [None, 0.05])
def test_accumulated_micro_batches_step_like_their_mean_loss(clip_grad):
    model = tiny_model()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    step = TrainStep(model, F.cross_entropy, opt, accum_steps=3, clip_grad=clip_grad)
    for seed in range(2):
        micro = [batch(4, 10 * seed + i) for i in range(3)]
        losses = [step.accumulate(images, labels, last=i == 2) for i, (images, labels) in enumerate(micro)]
        step.optimizer_step()
        assert all(p.grad is None for p in model.parameters())  # cleared for the next step
        # the reference: the mean of the three micro-batch losses, one backward, clipped by hand
        ref_opt.zero_grad()
        ref_losses = [F.cross_entropy(reference(images), labels) for images, labels in micro]
        torch.stack(ref_losses).mean().backward()
        if clip_grad:
            grads = [p.grad for p in reference.parameters()]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            for g in grads:
                g.mul_(min(1.0, clip_grad / (float(norm) + 1e-6)))
        ref_opt.step()
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses).detach())
        assert_same_parameters(model, reference)


class _RecordingScaler:
    """A GradScaler stand-in that scales by 4 and records the order of its calls."""

    def __init__(self) -> None:
        self.calls = []

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self.calls.append('scale')
        return loss * 4

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append('unscale_')
        for group in optimizer.param_groups:
            for p in group['params']:
                p.grad.div_(4)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append('step')
        optimizer.step()

    def update(self) -> None:
        self.calls.append('update')


def test_the_scaler_scales_the_loss_and_is_unscaled_before_clipping():
    model = tiny_model()
    reference = copy.deepcopy(model)
    scaler = _RecordingScaler()
    step = TrainStep(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.5), grad_scaler=scaler,
                     clip_grad=0.05)
    images, labels = batch(8, 0)
    step.accumulate(images, labels, last=True)
    step.optimizer_step()
    assert scaler.calls == ['scale', 'unscale_', 'step', 'update']
    F.cross_entropy(reference(images), labels).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert_same_parameters(model, reference)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match='accum_steps'):
        TrainStep(tiny_model(), F.cross_entropy, accum_steps=0)
    with pytest.raises(RuntimeError, match='optimizer'):
        TrainStep(tiny_model(), F.cross_entropy).optimizer_step()
