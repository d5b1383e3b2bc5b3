"""The dense heads of ``seg.head`` (linvit.models.heads: mlp, upernet, dpt, linear): each against its paper's formula
written here with torch's own pooling and interpolation on the head's layers (float64); each exact in the bounded
forward with the smallest halos (a row off each halo fails); no graph breaks; one ONNX export of all of them with
onnxruntime parity at dynamic sizes. Training through train.py: tests/engine/test_train_seg.py."""
import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from references import rel_err
from test_bounded import _bounded_logits

import linvit
from linvit.fast import check_graph_breaks
from linvit.inference import whole_inference
from linvit.models import SEG_HEADS, SegmentationModel
from linvit.models.heads.upernet import POOL_SCALES, bin_sizes, pooled_bin_sums

HEADS = ['mlp', 'upernet', 'dpt', 'linear']


def _seg_model(head, patch=8, depth=4, dtype=torch.float32, **kwargs) -> SegmentationModel:
    """A tiny model whose every path contributes: nonzero local mixing, BatchNorm statistics that are not 0 and 1."""
    torch.manual_seed(0)
    backbone = timm.create_model('linvit_tiny_patch16_224', num_classes=0, depth=depth, embed_dim=48, num_heads=3,
                                 img_size=64, patch_size=patch, dynamic_img_size=True, local_mix=True, **kwargs)
    model = SegmentationModel(backbone, num_classes=5, head=head, neck_dim=16, head_dim=16).eval()
    for module in model.modules():
        if isinstance(module, linvit.layers.LocalMix):
            nn.init.normal_(module.conv.weight, std=0.3)
        if isinstance(module, nn.BatchNorm2d):
            nn.init.normal_(module.running_mean)
            nn.init.uniform_(module.running_var, 0.5, 2.0)
    return model.to(dtype)


def test_the_registry_holds_every_head():
    assert SEG_HEADS.names() == HEADS


# ---------------------------------------------------------------------------------------------------- formulas

def test_bin_sums_of_row_parts_add_up_to_adaptive_average_pooling():
    x = torch.randn(2, 3, 13, 17, dtype=torch.float64)
    for scale in POOL_SCALES:  # 13 and 17 rows divide by none of them but 1: bins overlap
        parts = [pooled_bin_sums(x[:, :, a:b], (a, b), 13, [scale])[0] for a, b in ((0, 4), (4, 5), (5, 13))]
        counts = bin_sizes(scale, 13)[:, None] * bin_sizes(scale, 17)[None]
        torch.testing.assert_close(sum(parts) / counts, F.adaptive_avg_pool2d(x, scale))


def _resize(x, like):
    return F.interpolate(x, size=like.shape[-2:], mode='bilinear', align_corners=False)


def _upernet_reference(head, levels):
    """mmsegmentation's UPerHead: pooling pyramid module on the coarsest level, laterals, top-down sums, FPN
    convolutions, every level at the finest, fusion, classifier."""
    coarsest = levels[-1]
    pooled = [_resize(conv(F.adaptive_avg_pool2d(coarsest, scale)), coarsest)
              for scale, conv in zip(POOL_SCALES, head.pooled)]
    laterals = [lateral(x) for lateral, x in zip(head.laterals, levels)]
    laterals.append(head.bottleneck(torch.cat([coarsest, *pooled], dim=1)))
    for i in range(len(laterals) - 1, 0, -1):
        laterals[i - 1] = laterals[i - 1] + _resize(laterals[i], laterals[i - 1])
    outputs = [conv(x) for conv, x in zip(head.fpn_convs, laterals)] + [laterals[-1]]
    fused = head.fuse(torch.cat([outputs[0]] + [_resize(x, outputs[0]) for x in outputs[1:]], dim=1))
    return head.classifier(fused)


def _dpt_reference(head, levels):
    """DPT: per-level 3x3 projection, fusion blocks from the coarsest level (path + unit(lateral), unit, 1x1), each
    path resized to the next finer level, output convolution, classifier."""
    def unit(u, x):
        return x + u.conv2(F.relu(u.conv1(F.relu(x))))
    laterals = [project(x) for project, x in zip(head.projections, levels)]
    path = None
    for level in range(len(levels) - 1, -1, -1):
        block = head.fusions[level]
        lateral = laterals[level]
        fused = lateral if path is None else _resize(path, lateral) + unit(block.lateral_unit, lateral)
        path = block.out_conv(unit(block.unit, fused))
    return head.classifier(head.output(path))


def _mlp_reference(head, levels):
    projected = [project(x) for project, x in zip(head.projections, levels)]
    return head.classifier(head.fuse(torch.cat([projected[0]] + [_resize(x, projected[0]) for x in projected[1:]],
                                               dim=1)))


def _linear_reference(head, levels):
    """DINOv2's linear probe: BatchNorm (running statistics), 1x1 convolution."""
    norm = head.norm
    x = (levels[0] - norm.running_mean[:, None, None]) / torch.sqrt(norm.running_var[:, None, None] + norm.eps)
    return F.conv2d(x * norm.weight[:, None, None] + norm.bias[:, None, None], head.classifier.weight,
                    head.classifier.bias)


REFERENCES = {'mlp': _mlp_reference, 'upernet': _upernet_reference, 'dpt': _dpt_reference,
              'linear': _linear_reference}


@pytest.mark.parametrize('head', HEADS)
def test_each_head_is_its_papers_formula(head):
    model = _seg_model(head, dtype=torch.float64)
    images = torch.randn(2, 3, 72, 56, dtype=torch.float64)  # a 9 x 7 grid: the coarsest level pools 4 of 9 rows
    with torch.no_grad():
        levels = model.forward_features(images)
        got = model.head(levels)
        expected = REFERENCES[head](model.head, levels)
    assert got.shape == (2, 5, *levels[0].shape[-2:])
    assert rel_err(got, expected) < 1e-12


def test_the_linear_probe_reads_the_blocks_raw_maps_concatenated():
    backbone = timm.create_model('linvit_tiny_patch16_224', num_classes=0, depth=4, embed_dim=48, num_heads=3,
                                 img_size=64, patch_size=8, dynamic_img_size=True)
    reference = timm.create_model('linvit_tiny_patch16_224', num_classes=0, depth=4, embed_dim=48, num_heads=3,
                                  img_size=64, patch_size=8, dynamic_img_size=True)
    reference.load_state_dict(backbone.state_dict())
    model = SegmentationModel(backbone, num_classes=3, head='linear', feature_blocks=[-4, -3, -2, -1]).eval()
    assert model.head.norm.num_features == 4 * 48 and model.strides == [8.0]
    images = torch.randn(1, 3, 32, 48)
    with torch.no_grad():
        blocks = reference.eval().forward_intermediates(images, indices=4, norm=False, intermediates_only=True)
        (level,) = model.forward_features(images)
    torch.testing.assert_close(level, torch.cat(blocks, dim=1))
    last = SegmentationModel(timm.create_model('linvit_tiny_patch16_224', num_classes=0, depth=4, embed_dim=48,
                                               num_heads=3, img_size=64, patch_size=8, dynamic_img_size=True),
                             num_classes=3, head='linear')
    assert last.level_blocks == [3] and last.head.norm.num_features == 48  # default: the last block
    with pytest.raises(ValueError, match='names a block twice'):
        SegmentationModel(reference, num_classes=3, head='linear', feature_blocks=[3, -1])


# ---------------------------------------------------------------------------------------------------- bounded

@pytest.mark.parametrize('head', HEADS)
@pytest.mark.parametrize('patch, size, rows', [(8, (136, 64), 4), (8, (100, 61), 3), (8, (88, 72), 1),
                                               (16, (200, 120), 6)])
def test_bounded_segmentation_equals_the_plain_forward(head, patch, size, rows):
    model = _seg_model(head, patch)
    images = torch.randn(1, 3, *size)  # odd grids (17 and 13 rows), a side the patch does not divide, 1-row tiles
    with torch.no_grad():
        plain = whole_inference(model, images, pad_multiple=patch)
    bounded = _bounded_logits(model, images, rows)
    assert bounded.shape == plain.shape
    assert rel_err(bounded, plain) < 1e-5


def _halo_cases():
    cases = []
    for name in HEADS:
        head = SEG_HEADS.get(name)
        cases += [(name, level) for level, halo in enumerate(head.halos) if halo > 0]
        if head.finest_halo > 0:
            cases.append((name, 'finest'))
    return cases


@pytest.mark.parametrize('head, level', _halo_cases())
def test_each_halo_is_the_smallest_exact_one(monkeypatch, head, level):
    """One patch row less for a level (one row of the finest level less around the rows the logits read) and the
    tiles read rows they lack or that their convolutions got wrong; on a grid of 17 rows, where max pooling drops a
    row of the coarsest level and stretches it. In float64: a far row's error reaches DPT's logits damped to ~1e-6
    of them, which float32's rounding would hide."""
    model = _seg_model(head, dtype=torch.float64)
    images = torch.randn(1, 3, 136, 64, dtype=torch.float64)
    with torch.no_grad():
        plain = whole_inference(model, images, pad_multiple=8)
    head_class = type(model.head)
    if level == 'finest':
        monkeypatch.setattr(head_class, 'finest_halo', head_class.finest_halo - 1)
    else:
        halos = list(head_class.halos)
        halos[level] -= 1
        monkeypatch.setattr(head_class, 'halos', tuple(halos))
    try:
        got = _bounded_logits(model, images, 4)
    except RuntimeError as error:
        assert 'halo is too small' in str(error)
        return
    assert rel_err(got, plain) > 1e-10  # exact tiles agree to ~1e-15


# ---------------------------------------------------------------------------------------------------- compile, ONNX

@pytest.mark.compiler
@pytest.mark.parametrize('head', HEADS)
def test_each_head_compiles_as_one_graph_at_a_non_square_size(head):
    model = _seg_model(head, depth=2)
    torch._dynamo.reset()
    report = check_graph_breaks(model, torch.randn(1, 3, 40, 56))
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)
    torch._dynamo.reset()


class _EveryHead(nn.Module):
    """The new heads on one depth-1 backbone: images -> their logits at the input size, concatenated over channels, so
    that one export and one onnxruntime check covers them all (an export costs ~10 s of CPU, mostly the backbone's)."""

    input_multiple = 8

    def __init__(self) -> None:
        super().__init__()
        self.pyramid = _seg_model('upernet', depth=1)  # its backbone and neck feed the pyramid heads
        self.heads = nn.ModuleList([self.pyramid.head, _seg_model('dpt', depth=1).head])
        self.linear = _seg_model('linear', depth=1).head  # reads block 0's raw map, the one block there is
        self.num_classes = 3 * self.pyramid.num_classes

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        (block,) = self.pyramid.backbone.forward_intermediates(images, indices=[0], norm=False, output_fmt='NCHW',
                                                              intermediates_only=True)
        levels = [self.pyramid.level(index, {0: block}) for index in range(4)]
        logits = [head(levels) for head in self.heads] + [self.linear([block])]
        return torch.cat([F.interpolate(x, size=images.shape[-2:], mode='bilinear', align_corners=False)
                          for x in logits], dim=1)


@pytest.mark.compiler
def test_every_head_exports_to_onnx_at_dynamic_sizes(tmp_path):
    from linvit.export import export_onnx
    model = _EveryHead().eval()
    report = export_onnx(model, tmp_path / 'heads.onnx', img_size=64,
                         check_sizes=[(64, 64), (40, 72), (87, 49)])  # the last one padded: 11 x 7 patches
    assert report.ok and [(c.height, c.width) for c in report.checks] == [(64, 64), (40, 72), (87, 49)], report
