"""Whole-image and sliding-window inference: equal where the model is local, window positions and coverage counted
by hand, batching, padding, and the errors that name what to change."""
import pytest
import torch
import torch.nn as nn

from linvit.inference import (
    _coverage,
    pad_to_multiple,
    segment,
    sliding_window_inference,
    whole_inference,
    window_starts,
)

K = 3


def local_model(seed=0) -> nn.Module:
    """Per-pixel logits (no mixing between pixels): sliding windows must reproduce the whole image exactly."""
    torch.manual_seed(seed)
    return nn.Conv2d(3, K, kernel_size=1).double()


class GlobalModel(nn.Module):
    """conv1x1(x) + conv1x1(mean of x over the image): every output pixel depends on every input pixel."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.local = nn.Conv2d(3, K, kernel_size=1).double()
        self.glob = nn.Conv2d(3, K, kernel_size=1, bias=False).double()

    def forward(self, x):
        return self.local(x) + self.glob(x.mean(dim=(2, 3), keepdim=True))


class Recorder(nn.Module):
    """Records each call's input shape and, from coordinate channels (0: row index, 1: column index), the top-left
    position of every window it sees. Returns ``inner(x)`` or ones [b, K, h, w]."""

    def __init__(self, inner=None):
        super().__init__()
        self.inner = inner
        self.shapes, self.positions = [], []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        self.positions += [(int(crop[0, 0, 0]), int(crop[1, 0, 0])) for crop in x]
        return self.inner(x) if self.inner is not None else x.new_ones(x.shape[0], K, *x.shape[-2:])


def coordinate_images(batch: int, height: int, width: int) -> torch.Tensor:
    """[batch, 3, H, W] float64: channel 0 = row index, 1 = column index, 2 = image index."""
    rows = torch.arange(height, dtype=torch.float64)[:, None].expand(height, width)
    cols = torch.arange(width, dtype=torch.float64)[None, :].expand(height, width)
    return torch.stack([torch.stack([rows, cols, torch.full_like(rows, b)]) for b in range(batch)])


def random_images(batch, height, width, seed=1):
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def assert_exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


# --- (a) a local model: slide == whole ----------------------------------------------------------------------------

@pytest.mark.parametrize('height, width, window, stride', [
    (10, 10, 4, 3),              # starts 0, 3, 6: overlap 1
    (17, 23, 8, 5),              # not divisible by the stride: last window edge-aligned
    (16, 16, 8, 8),              # tiling without overlap
    (5, 7, 8, 4),                # smaller than the window: padded up to it
    (6, 30, 8, 3),               # rectangular, smaller than the window in one dimension only
    (9, 30, (4, 6), (2, 5)),     # rectangular window and stride
    (12, 12, 12, 1),             # a single window
], ids=lambda v: str(v).replace(' ', ''))
def test_local_model_slide_equals_whole(height, width, window, stride):
    model = local_model()
    images = random_images(2, height, width)
    whole = whole_inference(model, images)
    slide = sliding_window_inference(model, images, window, stride, batch_size=3)
    assert slide.shape == (2, K, height, width) and slide.dtype == torch.float64
    assert_exact(slide, whole)
    assert_exact(whole, model(images))


def test_local_model_slide_equals_whole_with_a_pad_multiple():
    model = Recorder(local_model())
    images = random_images(1, 13, 21)
    whole = whole_inference(model, images, pad_multiple=8)
    assert model.shapes == [(1, 3, 16, 24)], 'the model sees the padded image'
    slide = sliding_window_inference(model, images, window=8, stride=6, pad_multiple=8)
    assert whole.shape == slide.shape == (1, K, 13, 21)
    assert_exact(slide, whole)
    assert_exact(whole, model.inner(images))


# --- (b) a model with global mixing --------------------------------------------------------------------------------

def constant_image(height, width, rgb=(0.5, -1.0, 2.0)):
    return torch.tensor(rgb, dtype=torch.float64).reshape(1, 3, 1, 1).expand(1, 3, height, width).contiguous()


@pytest.mark.parametrize('height, width, window, stride', [(12, 16, 8, 4), (20, 11, (8, 11), (5, 3))])
def test_global_model_on_a_constant_image_without_padding(height, width, window, stride):
    # every window sees the same mean as the whole image
    model = GlobalModel()
    images = constant_image(height, width)
    assert_exact(sliding_window_inference(model, images, window, stride), whole_inference(model, images))


@torch.no_grad()
def test_global_model_on_a_constant_image_with_padding():
    model = GlobalModel()
    images = constant_image(6, 6)
    slide = sliding_window_inference(model, images, window=8, stride=4)
    # both see the 6 x 6 image padded with zeros to 8 x 8
    assert_exact(slide, whole_inference(model, images, pad_multiple=8))
    # by hand: the padded window's mean is the colour times 36 / 64
    colour = images[:, :, :1, :1]
    expected = model.local(colour) + model.glob(colour * 36 / 64)
    assert_exact(slide, expected.expand(1, K, 6, 6))
    # and unpadded whole-image inference sees the colour itself: a small, known difference
    difference = (slide - whole_inference(model, images)).abs().max()
    assert difference == pytest.approx(model.glob(colour * 28 / 64).abs().max().item(), rel=1e-9)


def test_global_model_on_a_real_image_differs_between_slide_and_whole():
    model = GlobalModel()
    images = random_images(1, 16, 16) + torch.linspace(-2, 2, 16, dtype=torch.float64)[:, None]
    slide = sliding_window_inference(model, images, window=8, stride=4)
    whole = whole_inference(model, images)
    assert (slide - whole).abs().max() > 1e-2, 'windows see different means than the whole image'


# --- (c) window positions and coverage -----------------------------------------------------------------------------

def test_window_starts_by_hand():
    assert window_starts(10, 4, 3) == [0, 3, 6]           # ceil(6 / 3) + 1 = 3 windows, the last ends at 10
    assert window_starts(11, 4, 3) == [0, 3, 6, 7]        # ceil(7 / 3) + 1 = 4; 9 would pass the edge -> 11 - 4
    assert window_starts(3, 4, 3) == [0]                  # smaller than the window
    assert window_starts(4, 4, 1) == [0]
    assert window_starts(8, 4, 4) == [0, 4]
    assert window_starts(9, 4, 4) == [0, 4, 5]


def test_coverage_counts_by_hand():
    # windows [0, 4), [3, 7), [6, 10), [7, 11) over 11 rows
    assert _coverage(11, 4, [0, 3, 6, 7]).tolist() == [1, 1, 1, 2, 1, 1, 2, 2, 2, 2, 1]


def test_the_model_sees_the_hand_enumerated_windows():
    model = Recorder()
    images = coordinate_images(1, 11, 10)
    result = sliding_window_inference(model, images, window=4, stride=3, batch_size=4)
    hand = [(y, x) for y in (0, 3, 6, 7) for x in (0, 3, 6)]
    assert sorted(model.positions) == sorted(hand)
    assert all(shape[1:] == (3, 4, 4) for shape in model.shapes)
    # a model returning ones averages to exactly one everywhere
    assert torch.equal(result, torch.ones(1, K, 11, 10, dtype=torch.float64))
    # coverage recounted from the recorded windows
    count = torch.zeros(11, 10, dtype=torch.int64)
    for y, x in model.positions:
        count[y:y + 4, x:x + 4] += 1
    assert count[:, 0].tolist() == [1, 1, 1, 2, 1, 1, 2, 2, 2, 2, 1]
    assert count[0].tolist() == [1, 1, 1, 2, 1, 1, 2, 1, 1, 1]


def test_overlapping_logits_are_averaged():
    # each window's logits = its top row index (the minimum of channel 0): a pixel gets the mean over its windows
    def top_row(x):
        return x[:, :1].amin(dim=(2, 3), keepdim=True).expand(x.shape[0], K, *x.shape[-2:])

    result = sliding_window_inference(top_row, coordinate_images(1, 11, 5), window=(4, 5), stride=(3, 5))
    # rows: 0-2 only [0, 4) -> 0; 3: [0, 4) [3, 7) -> 1.5; 4-5: [3, 7) -> 3; 6: [3, 7) [6, 10) -> 4.5;
    #       7-9: [6, 10) [7, 11) -> 6.5; 10: [7, 11) -> 7
    expected_rows = [0, 0, 0, 1.5, 3, 3, 4.5, 6.5, 6.5, 6.5, 7]
    assert result[0, 0, :, 0].tolist() == expected_rows
    assert torch.equal(result, torch.tensor(expected_rows, dtype=torch.float64)[:, None].expand(1, K, 11, 5))


# --- (d) segment(): modes, defaults and errors ----------------------------------------------------------------------

def test_whole_mode_refuses_large_images_before_running_the_model():
    model = Recorder()
    with pytest.raises(ValueError) as error:
        segment(model, coordinate_images(1, 12, 20), 'whole', max_pixels=200)
    message = str(error.value)
    for part in ('12 x 20', '240 pixels', 'seg.eval.max_pixels=200', 'seg.eval.mode=slide',
                 'raise seg.eval.max_pixels'):
        assert part in message
    assert model.shapes == [], 'the model must not run'
    assert segment(model, coordinate_images(1, 12, 20), 'whole', max_pixels=240).shape == (1, K, 12, 20)


def test_segment_modes_agree_with_the_functions():
    model = local_model()
    images = random_images(1, 19, 13)
    assert_exact(segment(model, images, 'whole', pad_multiple=4), whole_inference(model, images, pad_multiple=4))
    assert_exact(segment(model, images, 'slide', window=8, stride=5, batch_size=2, pad_multiple=4),
                 sliding_window_inference(model, images, 8, 5, pad_multiple=4))


@pytest.mark.parametrize('window, pad_multiple, size, expected_starts', [
    (12, 1, 20, [0, 8]),         # stride 12 * 2 // 3 = 8
    (12, 4, 20, [0, 8]),         # 8 is already a multiple of 4
    (16, 16, 40, [0, 16, 24]),   # 10 rounded down to a multiple of 16 is 0 -> at least 16
    (24, 8, 40, [0, 16]),        # 16
    (15, 5, 40, [0, 10, 20, 25]),   # 10
])
def test_default_stride(window, pad_multiple, size, expected_starts):
    model = Recorder()
    segment(model, coordinate_images(1, size, window), 'slide', window=window, pad_multiple=pad_multiple)
    assert sorted({y for y, _ in model.positions}) == expected_starts


@pytest.mark.parametrize('kwargs, message', [
    (dict(mode='tiles', window=8), r"unknown .*'tiles'.*whole, slide"),
    (dict(mode='slide'), 'seg.eval.window'),
    (dict(mode='slide', window=10, pad_multiple=4), r'window \(10, 10\) must be divisible by pad_multiple=4'),
    (dict(mode='slide', window=8, stride=9), r'stride \(9, 9\) must be in 1..window'),
    (dict(mode='slide', window=8, stride=0), 'stride'),
    (dict(mode='slide', window=8, stride=4, batch_size=0), 'batch_size'),
    (dict(mode='slide', window=(8, 8, 8)), 'pair'),
])
def test_segment_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        segment(local_model(), random_images(1, 16, 16), **kwargs)


def test_a_model_breaking_the_contract_is_named():
    with pytest.raises(ValueError, match=r'logits \[b, K, h, w\]'):
        whole_inference(nn.Conv2d(3, K, kernel_size=2, stride=2).double(), random_images(1, 8, 8))


# --- (e) batching, dtypes, autograd --------------------------------------------------------------------------------

def test_batch_size_changes_nothing_but_the_calls():
    images = coordinate_images(2, 14, 11)
    one, five = Recorder(local_model()), Recorder(local_model())
    by_one = sliding_window_inference(one, images, window=6, stride=4, batch_size=1)
    by_five = sliding_window_inference(five, images, window=6, stride=4, batch_size=5)
    # rows start at 0, 4, 8 (ceil(8 / 4) + 1 = 3); columns at 0, 4 and the edge-aligned 5: 9 windows per image
    hand = [(y, x) for y in (0, 4, 8) for x in (0, 4, 5)]
    assert len(one.shapes) == 18 and [s[0] for s in five.shapes] == [5, 5, 5, 3]
    assert sorted(one.positions) == sorted(five.positions) == sorted(hand * 2)
    assert_exact(by_five, by_one)
    assert_exact(by_one, whole_inference(one.inner, images))


def test_low_precision_models_give_float32_logits():
    model = nn.Conv2d(3, K, kernel_size=1).to(torch.bfloat16)
    images = random_images(1, 10, 10).to(torch.bfloat16)
    for logits in (whole_inference(model, images), sliding_window_inference(model, images, 4, 3)):
        assert logits.dtype == torch.float32 and logits.shape == (1, K, 10, 10)
        torch.testing.assert_close(logits, model(images).float(), rtol=1e-2, atol=1e-2)


def test_works_with_and_without_gradients():
    model = local_model()
    images = random_images(1, 9, 9)
    with torch.no_grad():
        no_grad = sliding_window_inference(model, images, 4, 3)
    assert not no_grad.requires_grad
    logits = sliding_window_inference(model, images, 4, 3)
    logits.sum().backward()
    # d(sum of averaged logits)/d(bias_k) = number of pixels, whatever the overlaps
    torch.testing.assert_close(model.bias.grad, torch.full((K,), 81.0, dtype=torch.float64))


def test_empty_batch():
    assert sliding_window_inference(local_model(), random_images(0, 9, 9), 4, 3).shape == (0, K, 9, 9)


# --- (f) padding ---------------------------------------------------------------------------------------------------

def test_pad_to_multiple_values():
    images = torch.arange(15, dtype=torch.float32).reshape(1, 1, 3, 5)
    padded = pad_to_multiple(images, 4, value=-1.0)
    assert padded.shape == (1, 1, 4, 8)
    assert padded[0, 0].tolist() == [
        [0, 1, 2, 3, 4, -1, -1, -1],
        [5, 6, 7, 8, 9, -1, -1, -1],
        [10, 11, 12, 13, 14, -1, -1, -1],
        [-1, -1, -1, -1, -1, -1, -1, -1],
    ]
    assert pad_to_multiple(images, 1) is images
    assert pad_to_multiple(images[..., :4], 2).shape == (1, 1, 4, 4)
    assert pad_to_multiple(torch.zeros(2, 3, 16, 32), 16).shape == (2, 3, 16, 32)
    with pytest.raises(ValueError, match='multiple'):
        pad_to_multiple(images, 0)
    with pytest.raises(ValueError, match=r'\[B, C, H, W\]'):
        pad_to_multiple(images[0], 2)
