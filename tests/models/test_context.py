"""Context parallelism (linvit.models.context) against the one-process model: the outputs, the loss and every
parameter gradient of a training step, on 1, 2 and 4 gloo processes, for classification (class token and mean pool,
register tokens, local mix) and segmentation (the MLP head, and UPerNet, whose global pooling sums over the ranks),
with patch rows that do not divide over the ranks."""
import pytest
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from references import rel_err

import linvit
from linvit.models import SegmentationModel
from linvit.models.context import ContextParallel, RowShards, split_rows

CLS_CASES = {
    'class-token-local-mix': dict(local_mix=True),
    'registers-mean-pool': dict(reg_tokens=2, class_token=False, global_pool='avg', local_mix=True,
                                feature_map='relu'),
}


def _backbone(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model('linvit_tiny_patch16_224', depth=3, img_size=64, patch_size=8, dynamic_img_size=True,
                              **{'num_classes': 5, **kwargs})
    for module in model.modules():  # the local branch starts at zero: give it weights, so it is tested
        if isinstance(module, linvit.layers.LocalMix):
            torch.nn.init.normal_(module.conv.weight, std=0.3)
    return model


SEG_CASES = {'segmentation': 'mlp', 'upernet': 'upernet'}


def _segmenter(head: str) -> SegmentationModel:
    backbone = _backbone(local_mix=True, num_classes=0)
    torch.manual_seed(1)
    model = SegmentationModel(backbone, num_classes=4, head=head, neck_dim=16, head_dim=16,
                              feature_blocks=[0, 1, 2, 2])
    model.head.dropout.p = 0.0  # a random channel mask would make the step depend on the RNG's position
    return model


def _model(case: str) -> torch.nn.Module:
    return _segmenter(SEG_CASES[case]) if case in SEG_CASES else _backbone(**CLS_CASES[case])


def _batch(case: str, rows: int):
    """Images with ``rows`` patch rows (8 px each) and their targets."""
    generator = torch.Generator().manual_seed(3)
    images = torch.randn(2, 3, rows * 8, 48, generator=generator)
    if case in SEG_CASES:
        targets = torch.randint(0, 4, (2, rows * 8, 48), generator=generator)
        targets[0, :5] = 255  # unlabelled pixels count in no rank's loss
        return images, targets
    return images, torch.tensor([1, 3])


def _one_process_step(case: str, rows: int):
    """(loss, {name: grad}) of the plain model."""
    model = _model(case).train()
    images, targets = _batch(case, rows)
    loss = F.cross_entropy(model(images), targets, ignore_index=255)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _context_step(rank: int, case: str, rows: int):
    """This rank's part of the loss and its parameter gradients under ContextParallel over the whole world."""
    model = _model(case).train()
    images, targets = _batch(case, rows)
    cp = ContextParallel(model, RowShards(dist.group.WORLD))
    logits = cp(images)
    if case in SEG_CASES:  # this rank's pixels' share of the mean over all labelled pixels
        y0, y1 = cp.pixel_rows(images)
        labelled = (targets != 255).sum()
        loss = F.cross_entropy(logits, targets[:, y0:y1], ignore_index=255, reduction='sum') / labelled
    else:  # the same logits on every rank: each computes an equal share
        loss = F.cross_entropy(logits, targets) / dist.get_world_size()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _sum(results):
    loss = sum(r[0] for r in results)
    names = set().union(*(r[1] for r in results))
    return loss, {name: sum(r[1][name] for r in results if name in r[1]) for name in names}


@pytest.mark.parametrize('case, world_size, rows', [
    *((case, world_size, rows) for case in [*CLS_CASES, 'segmentation'] for world_size, rows in [(2, 5), (4, 7)]),
    ('upernet', 3, 7)])
def test_a_context_parallel_step_equals_the_one_process_step(tmp_path, case, world_size, rows):
    want_loss, want_grads = _one_process_step(case, rows)
    got_loss, got_grads = _sum(run_ranks(tmp_path, _context_step, case, rows, world_size=world_size))
    assert rel_err(got_loss, want_loss) < 1e-5
    assert sorted(got_grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        assert rel_err(got_grads[name], grad) < 1e-5, name


@pytest.mark.parametrize('case', [*CLS_CASES, *SEG_CASES])
def test_one_context_rank_is_the_plain_forward(case):
    model = _model(case).eval()
    images, _ = _batch(case, 6)
    with torch.no_grad():
        assert rel_err(ContextParallel(model)(images), model(images)) < 1e-5


def test_rows_split_as_evenly_as_they_divide():
    assert split_rows(7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert split_rows(8, 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match='4 context ranks need at least 4 patch rows, the image has 3'):
        split_rows(3, 4)


def _halo_rows(rank: int, halo: int):
    """Rows r of a 7-row image hold the value r; this rank's band with ``halo`` rows each side, and the gradient its
    rows get when every output row's gradient is 1."""
    shards = RowShards(dist.group.WORLD)
    r0, r1 = shards.bounds(7)[rank]
    rows = torch.arange(r0, r1, dtype=torch.float32).view(1, -1, 1).requires_grad_()
    out, top, bottom = shards.exchange_rows(rows, 7, halo, halo)
    out.sum().backward()
    return out.detach().flatten().tolist(), top, bottom, rows.grad.flatten().tolist()


def test_halo_rows_come_from_the_ranks_that_hold_them(tmp_path):
    results = run_ranks(tmp_path, _halo_rows, 3, world_size=4)  # bands 0-1, 2-3, 4-5, 6: a halo spans ranks
    bounds = split_rows(7, 4)
    for (out, top, bottom, grad), (r0, r1) in zip(results, bounds):
        first, last = max(r0 - 3, 0), min(r1 + 3, 7)
        assert out == [float(r) for r in range(first, last)] and (top, bottom) == (r0 - first, last - r1)
        # each row's gradient: how many ranks' outputs hold it (its own and every band within 3 rows)
        want = [sum(1 for a, b in bounds if max(a - 3, 0) <= r < min(b + 3, 7)) for r in range(r0, r1)]
        assert grad == [float(g) for g in want]


def test_what_cannot_split_is_refused_in_one_line():
    with pytest.raises(ValueError, match="global_pool='max'"):
        ContextParallel(_backbone(global_pool='max', class_token=False))
    with pytest.raises(ValueError, match='softmax attention'):
        ContextParallel(_backbone(softmax_blocks=[1]))
    with pytest.raises(ValueError, match='pos_drop_rate=0.1'):
        ContextParallel(_backbone(pos_drop_rate=0.1))
