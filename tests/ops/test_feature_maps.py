"""Feature maps against their closed forms in float64."""

import pytest
import torch
from references import FEATURE_MAP_REFS

from linvit.ops import (
    FEATURE_MAPS,
    INPLACE_FEATURE_MAPS,
    elu1,
    focused,
    get_feature_map,
    get_inplace_feature_map,
    list_feature_maps,
    register_feature_map,
    relu,
)


def _sample(shape=(4, 7, 16), scale=3.0, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def test_elu1_closed_form():
    x = _sample()
    expected = torch.where(x > 0, x + 1.0, torch.exp(x))
    torch.testing.assert_close(elu1(x), expected, rtol=1e-12, atol=1e-12)


def test_relu_closed_form():
    x = _sample()
    torch.testing.assert_close(relu(x), torch.where(x > 0, x, torch.zeros_like(x)), rtol=0, atol=0)


@pytest.mark.parametrize('power', [1.0, 2.0, 3.0, 5.0])
def test_focused_closed_form(power):
    x = _sample()
    r = x.clamp_min(0)
    rp = r ** power
    expected = r.norm(dim=-1, keepdim=True) * rp / rp.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(focused(x, power), expected, rtol=1e-12, atol=1e-12)


def test_focused_keeps_norm_and_sharpens():
    x = _sample().abs() + 0.1
    y = focused(x, 3.0)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    # the largest entry's share of the row grows with the power: the map is more peaked than its input
    share_in = x.amax(-1) / x.sum(-1)
    share_out = y.amax(-1) / y.sum(-1)
    assert bool((share_out > share_in).all())


def test_focused_large_values_do_not_overflow_float32():
    x = _sample(scale=1.0) * 1e14  # r ** 3 would be ~1e42, past float32's 3.4e38
    expected = focused(x.double(), 3.0)
    got = focused(x.float(), 3.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize('name', sorted(FEATURE_MAPS))
def test_maps_are_non_negative_and_finite_on_zero_rows(name):
    phi = get_feature_map(name)
    x = torch.cat([_sample(), -_sample().abs(), torch.zeros(4, 7, 16, dtype=torch.float64)])
    y = phi(x)
    assert y.shape == x.shape
    assert torch.isfinite(y).all()
    assert bool((y >= 0).all())


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['fp64', 'fp32'])
@pytest.mark.parametrize('name', sorted(FEATURE_MAPS))
def test_registered_maps_match_the_shared_references(name, dtype):
    """The registry entries equal the formulas the attention tests use, incl. all-negative and all-zero rows."""
    x = torch.cat([_sample(), -_sample(seed=1).abs(), torch.zeros(1, 7, 16, dtype=torch.float64)])
    x[0, 0, :3] = torch.tensor([1e-3, -1e-3, 0.0])  # entries near the kink at 0
    got = get_feature_map(name)(x.to(dtype)).double()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(got, FEATURE_MAP_REFS[name](x), rtol=tol, atol=tol)


def test_unknown_feature_map_lists_known_ones():
    with pytest.raises(ValueError) as info:
        get_feature_map('softmaxish')
    for name in list_feature_maps():
        assert name in str(info.value)
    assert 'softmaxish' in str(info.value)


def test_registered_feature_map_is_resolved_by_name(monkeypatch):
    monkeypatch.setattr('linvit.ops.feature_maps.FEATURE_MAPS', dict(FEATURE_MAPS))  # registration is global

    def softplus(x):
        return torch.nn.functional.softplus(x)

    assert register_feature_map('test_softplus', softplus) is softplus
    assert get_feature_map('test_softplus') is softplus and 'test_softplus' in list_feature_maps()


def test_register_feature_map_rejects_duplicates():
    with pytest.raises(ValueError, match='elu1'):
        register_feature_map('elu1', elu1)


def test_elu1_gradient_matches_elu_including_zero():
    x = torch.cat([_sample().flatten(), torch.zeros(3, dtype=torch.float64)]).requires_grad_()
    elu1(x).sum().backward()
    expected = torch.where(x.detach() > 0, torch.ones_like(x), torch.exp(x.detach()))  # elu's derivative, 1 at 0
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('name', sorted(INPLACE_FEATURE_MAPS))
def test_inplace_maps_write_the_map_into_their_input(name):
    x = torch.cat([_sample(), torch.zeros(1, 7, 16, dtype=torch.float64)])
    expected = get_feature_map(name)(x)
    target = x.clone()
    out = get_inplace_feature_map(name)(target)
    assert out.data_ptr() == target.data_ptr()
    torch.testing.assert_close(target, expected, rtol=1e-12, atol=1e-12)


def test_maps_without_inplace_form_report_none():
    assert get_inplace_feature_map('focused') is None
    with pytest.raises(ValueError, match='softmaxish'):
        get_inplace_feature_map('softmaxish')


def test_focused_keeps_its_direction_for_tiny_float32_inputs():
    """r^3 of values near 1e-15 underflows float32: the map scales rows by their max before the power."""
    x = _sample(shape=(3, 16)) * 1e-15
    expected = FEATURE_MAP_REFS['focused'](x)  # float64
    got = focused(x.float()).double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-21)
    assert (expected.abs().amax(-1) > 1e-16).all()  # not a zero row in disguise
