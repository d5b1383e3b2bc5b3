"""The segmentation model: pyramid levels from the right blocks at the right strides, any ViT backbone, every
parameter trained, no graph breaks; its losses against direct float64 computations."""
import copy
import itertools

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F

import linvit  # noqa: F401  (registers linvit_* with timm)
from linvit.engine.tasks.segmentation import SegmentationLoss, dice_loss
from linvit.fast import check_graph_breaks
from linvit.models import SegmentationModel
from linvit.models.segmentation import class_ids, default_feature_blocks

BACKBONES = ['linvit_tiny_patch16_224', 'vit_tiny_patch16_224']
DEPTH, WIDTH, HEADS, PATCH = 4, 48, 3, 8


def tiny_backbone(name, depth=DEPTH, **kwargs):
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=0, img_size=32, dynamic_img_size=True, depth=depth, embed_dim=WIDTH,
                             num_heads=HEADS, patch_size=PATCH, **kwargs)


@pytest.mark.parametrize('name', BACKBONES)
def test_logits_have_the_input_size_and_every_parameter_learns(name):
    model = SegmentationModel(tiny_backbone(name), num_classes=5, neck_dim=16, head_dim=16)
    images = torch.randn(2, 3, 40, 56)  # not the img_size it was created at, not square
    logits = model(images)
    assert logits.shape == (2, 5, 40, 56)
    logits.square().mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


@pytest.mark.parametrize('blocks, expected_levels',
                         [([], [0, 1, 2, 3]), ([1], [1, 1, 1, 1]), ([0, 0, 2, -1], [0, 0, 2, 3])],
                         ids=['default-4-spaced', 'vitdet-one-block', 'chosen-with-negative'])
def test_pyramid_levels_come_from_the_named_blocks(blocks, expected_levels):
    backbone = tiny_backbone('linvit_tiny_patch16_224')
    reference = copy.deepcopy(backbone)  # the model prunes its backbone in place
    model = SegmentationModel(backbone, num_classes=3, neck_dim=16, head_dim=16, feature_blocks=blocks).eval()
    reference.eval()
    images = torch.randn(1, 3, 32, 48)
    with torch.no_grad():
        every_block = reference.forward_intermediates(images, indices=DEPTH, norm=False, intermediates_only=True)
        expected = model.neck([every_block[i] for i in expected_levels])
        pyramid = model.forward_features(images)
    for level, (got, want) in enumerate(zip(pyramid, expected)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"pyramid level {level}")
    # and the levels differ when their blocks do (the comparison above can fail)
    if len(set(expected_levels)) > 1:
        wrong = model.neck([every_block[DEPTH - 1 - i] for i in expected_levels])
        assert not torch.allclose(wrong[0], pyramid[0], atol=1e-3)


# ---------------------------------------------------------------- neck and head against a float64 reference

# every parameter of the neck and head (ViTDet's simple feature pyramid, SegFormer's all-MLP decoder): convolutions
# followed by a LayerNorm carry no bias
NECK_HEAD_PARAMETERS = sorted(
    [f'neck.input_norms.{i}.{p}' for i in range(4) for p in ('weight', 'bias')]
    + [f'neck.rescales.0.{j}.{p}' for j in (0, 1, 3) for p in ('weight', 'bias')]
    + ['neck.rescales.1.weight', 'neck.rescales.1.bias']
    + [f'neck.projections.{i}.{j}.weight' for i in range(4) for j in range(4)]
    + [f'neck.projections.{i}.{j}.bias' for i in range(4) for j in (1, 3)]
    + [f'head.projections.{i}.{p}' for i in range(4) for p in ('weight', 'bias')]
    + ['head.fuse.0.weight', 'head.fuse.1.weight', 'head.fuse.1.bias', 'head.classifier.weight',
       'head.classifier.bias'])


def layer_norm_2d_ref(x, weight, bias, eps=1e-6):
    """LayerNorm over the channels of [B, C, H, W] at every pixel (biased variance), float64."""
    mean = x.mean(1, keepdim=True)
    var = (x - mean).square().mean(1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight[:, None, None] + bias[:, None, None]


def gelu_ref(x):
    return 0.5 * x * (1 + torch.erf(x / 2 ** 0.5))


def neck_and_head_ref(state, features, out_size):
    """ViTDet's pyramid and SegFormer's head from the state dict, float64: 4 maps [B, C, h, w] at the patch stride
    -> logits [B, K, *out_size]. Resampling: x4 = deconv, LN, GELU, deconv; x2 = deconv; x1; x0.5 = 2x2 max pool."""
    w = {k: v.double() for k, v in state.items()}
    pyramid = []
    for i, x in enumerate(features):
        x = layer_norm_2d_ref(x.double(), w[f'neck.input_norms.{i}.weight'], w[f'neck.input_norms.{i}.bias'])
        if i == 0:
            x = F.conv_transpose2d(x, w['neck.rescales.0.0.weight'], w['neck.rescales.0.0.bias'], stride=2)
            x = gelu_ref(layer_norm_2d_ref(x, w['neck.rescales.0.1.weight'], w['neck.rescales.0.1.bias']))
            x = F.conv_transpose2d(x, w['neck.rescales.0.3.weight'], w['neck.rescales.0.3.bias'], stride=2)
        elif i == 1:
            x = F.conv_transpose2d(x, w['neck.rescales.1.weight'], w['neck.rescales.1.bias'], stride=2)
        elif i == 3:
            x = F.max_pool2d(x, 2)
        p = f'neck.projections.{i}'
        x = layer_norm_2d_ref(F.conv2d(x, w[f'{p}.0.weight']), w[f'{p}.1.weight'], w[f'{p}.1.bias'])
        x = layer_norm_2d_ref(F.conv2d(x, w[f'{p}.2.weight'], padding=1), w[f'{p}.3.weight'], w[f'{p}.3.bias'])
        pyramid.append(x)
    size = pyramid[0].shape[-2:]
    levels = [F.conv2d(x, w[f'head.projections.{i}.weight'], w[f'head.projections.{i}.bias'])
              for i, x in enumerate(pyramid)]
    levels = [F.interpolate(x, size=size, mode='bilinear', align_corners=False) for x in levels]
    fused = F.conv2d(torch.cat(levels, 1), w['head.fuse.0.weight'])
    fused = gelu_ref(layer_norm_2d_ref(fused, w['head.fuse.1.weight'], w['head.fuse.1.bias']))
    logits = F.conv2d(fused, w['head.classifier.weight'], w['head.classifier.bias'])
    return F.interpolate(logits, size=out_size, mode='bilinear', align_corners=False)


def test_neck_and_head_match_a_float64_reference_written_from_the_papers():
    model = SegmentationModel(tiny_backbone('linvit_tiny_patch16_224'), num_classes=5, neck_dim=16, head_dim=12)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith('backbone.')}
    assert sorted(state) == NECK_HEAD_PARAMETERS
    # kernel sizes: 2x2 stride-2 deconvolutions, 1x1 then 3x3 projections, 1x1 head convolutions
    assert state['neck.rescales.0.0.weight'].shape == (WIDTH, WIDTH // 2, 2, 2)
    assert state['neck.rescales.0.3.weight'].shape == (WIDTH // 2, WIDTH // 4, 2, 2)
    assert state['neck.rescales.1.weight'].shape == (WIDTH, WIDTH // 2, 2, 2)
    assert [state[f'neck.projections.{i}.0.weight'].shape for i in range(4)] == [
        (16, WIDTH // 4, 1, 1), (16, WIDTH // 2, 1, 1), (16, WIDTH, 1, 1), (16, WIDTH, 1, 1)]
    assert {state[f'neck.projections.{i}.2.weight'].shape for i in range(4)} == {(16, 16, 3, 3)}
    assert {state[f'head.projections.{i}.weight'].shape for i in range(4)} == {(12, 16, 1, 1)}
    assert state['head.fuse.0.weight'].shape == (12, 4 * 12, 1, 1)
    assert state['head.classifier.weight'].shape == (5, 12, 1, 1)
    torch.manual_seed(1)
    with torch.no_grad():  # no LayerNorm is an identity, no bias zero
        for name, p in model.named_parameters():
            if not name.startswith('backbone.'):
                p.add_(torch.randn_like(p) * 0.3)
    model.eval()
    images = torch.randn(2, 3, 40, 56)  # a 5 x 7 grid: odd sides, so max pooling drops a row and a column
    with torch.no_grad():
        features = model.backbone.forward_intermediates(images, indices=model.take_blocks, norm=False,
                                                        intermediates_only=True)
        expected = neck_and_head_ref(model.state_dict(), features, (40, 56))
        logits = model(images).double()
    err = ((logits - expected).norm() / expected.norm()).item()
    assert err < 1e-5, f"rel err {err:.2e}"


def test_pyramid_strides_are_quarter_half_one_and_two_patches():
    model = SegmentationModel(tiny_backbone('linvit_tiny_patch16_224'), num_classes=3, neck_dim=16, head_dim=16)
    pyramid = model.forward_features(torch.randn(1, 3, 32, 64))
    assert [tuple(level.shape[-2:]) for level in pyramid] == [(16, 32), (8, 16), (4, 8), (2, 4)]
    assert all(level.shape[1] == 16 for level in pyramid)


@pytest.mark.parametrize('name', BACKBONES)
def test_unused_blocks_norm_and_classifier_are_pruned(name):
    backbone = timm.create_model(name, num_classes=10, img_size=32, dynamic_img_size=True, depth=DEPTH,
                                 embed_dim=WIDTH, num_heads=HEADS, patch_size=PATCH)  # with its classifier
    model = SegmentationModel(backbone, num_classes=3, feature_blocks=[1])
    assert len(model.backbone.blocks) == 2
    assert isinstance(model.backbone.norm, torch.nn.Identity) and isinstance(model.backbone.head, torch.nn.Identity)
    assert not [k for k in model.state_dict() if k.startswith(('backbone.norm', 'backbone.head'))]
    assert model.input_multiple == PATCH and model.num_classes == 3


def test_defaults_are_128_wide_and_one_class_is_allowed():
    model = SegmentationModel(tiny_backbone('linvit_tiny_patch16_224'), num_classes=1)
    assert model.neck.projections[0][0].out_channels == 128 and model.head.fuse[0].out_channels == 128
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 1, 32, 32)
    with pytest.raises(ValueError, match='a segmentation model needs num_classes >= 1, got 0'):
        SegmentationModel(tiny_backbone('linvit_tiny_patch16_224'), num_classes=0)


def test_default_feature_blocks_are_evenly_spaced():
    assert default_feature_blocks(12) == [2, 5, 8, 11]
    assert default_feature_blocks(6) == [1, 2, 4, 5]
    assert default_feature_blocks(1) == [0, 0, 0, 0]


@pytest.mark.parametrize('blocks, message', [([0, 1], 'must name 1 block'), ([7], 'block 7 does not exist'),
                                             ([-5], 'block -5 does not exist'), ([4], 'block 4 does not exist')])
def test_bad_feature_blocks_are_named(blocks, message):
    with pytest.raises(ValueError, match=message) as error:
        SegmentationModel(tiny_backbone('linvit_tiny_patch16_224'), num_classes=3, feature_blocks=blocks)
    if 'exist' in message:
        assert str(error.value).endswith(f"in a backbone of depth {DEPTH} (valid: 0..3 or -4..-1)")


def test_the_first_and_last_blocks_can_be_named_from_either_end():
    model = SegmentationModel(tiny_backbone('linvit_tiny_patch16_224'), num_classes=3, feature_blocks=[-4, 0, 3, -1])
    assert model.level_blocks == [0, 0, 3, 3]


def test_unknown_head_is_named():
    with pytest.raises(ValueError, match=r"unknown seg\.head 'fancy'; known: mlp"):
        SegmentationModel(tiny_backbone('linvit_tiny_patch16_224'), num_classes=3, head='fancy')


@pytest.mark.compiler
@pytest.mark.parametrize('name', BACKBONES)
def test_forward_and_loss_compile_without_graph_breaks(name):
    model = SegmentationModel(tiny_backbone(name), num_classes=4, neck_dim=16, head_dim=16)
    loss_fn = SegmentationLoss(ignore_index=255, dice_weight=0.5)
    targets = torch.randint(0, 4, (2, 32, 48))
    report = check_graph_breaks(lambda x: loss_fn(model(x), targets), torch.randn(2, 3, 32, 48))
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)


# ---------------------------------------------------------------------------------------------------- losses

def reference_cross_entropy(logits, targets, ignore_index):
    """Mean over labelled pixels of -log softmax(logits)[target], in float64 with numpy, pixel by pixel."""
    logits = logits.double().numpy()
    targets = targets.numpy()
    total, count = 0.0, 0
    for b, y, x in np.ndindex(*targets.shape):
        target = targets[b, y, x]
        if target == ignore_index:
            continue
        row = logits[b, :, y, x]
        total += np.log(np.exp(row - row.max()).sum()) + row.max() - row[target]
        count += 1
    return total / count


def reference_dice(logits, targets, ignore_index, smooth=1.0):
    """1 - (2 |P & T| + s) / (|P| + |T| + s) per class over labelled pixels, averaged over classes (float64 loops)."""
    probs = torch.softmax(logits.double(), dim=1).numpy()
    targets = targets.numpy()
    losses = []
    for k in range(probs.shape[1]):
        intersection = cardinality = 0.0
        for b, y, x in np.ndindex(*targets.shape):
            if targets[b, y, x] == ignore_index:
                continue
            t = float(targets[b, y, x] == k)
            intersection += probs[b, k, y, x] * t
            cardinality += probs[b, k, y, x] + t
        losses.append(1 - (2 * intersection + smooth) / (cardinality + smooth))
    return float(np.mean(losses))


def seg_batch(seed=0, classes=4, ignore_fraction=0.25):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, classes, 5, 6, generator=generator) * 3
    targets = torch.randint(0, classes, (2, 5, 6), generator=generator)
    ignored = torch.rand(2, 5, 6, generator=generator) < ignore_fraction
    return logits, targets.masked_fill(ignored, 255)


def test_cross_entropy_counts_only_labelled_pixels():
    logits, targets = seg_batch()
    got = SegmentationLoss(ignore_index=255)(logits, targets)
    assert got.item() == pytest.approx(reference_cross_entropy(logits, targets, 255), rel=1e-6)


def test_dice_matches_the_per_class_formula():
    logits, targets = seg_batch(seed=1)
    assert dice_loss(logits, targets, 255).item() == pytest.approx(reference_dice(logits, targets, 255), rel=1e-6)


def test_dice_weight_adds_dice_to_cross_entropy():
    logits, targets = seg_batch(seed=2)
    got = SegmentationLoss(ignore_index=255, dice_weight=0.7)(logits, targets).item()
    expected = reference_cross_entropy(logits, targets, 255) + 0.7 * reference_dice(logits, targets, 255)
    assert got == pytest.approx(expected, rel=1e-6)


def test_perfect_prediction_has_near_zero_dice():
    targets = torch.tensor([[[0, 1], [2, 255]]])
    logits = torch.nn.functional.one_hot(targets.clamp(max=2), 3).permute(0, 3, 1, 2).float() * 50
    assert dice_loss(logits, targets, 255).item() == pytest.approx(0.0, abs=1e-6)


def test_negative_dice_weight_is_refused():
    with pytest.raises(ValueError, match='seg.dice_weight must be >= 0'):
        SegmentationLoss(dice_weight=-1)


def test_class_ids_are_the_first_largest_logit_of_each_pixel():
    """Against a loop over the pixels, with ties (the first class wins, as argmax) and the class dimension anywhere."""
    logits = torch.randint(0, 3, (2, 5, 4, 6)).float()  # few values: many ties
    expected = torch.empty(2, 4, 6, dtype=torch.int64)
    for b, y, x in itertools.product(range(2), range(4), range(6)):
        values = logits[b, :, y, x].tolist()
        expected[b, y, x] = values.index(max(values))
    assert torch.equal(class_ids(logits), expected)
    assert torch.equal(class_ids(logits[0], dim=0), expected[0])
    assert class_ids(logits).dtype == torch.int64
