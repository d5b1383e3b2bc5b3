"""Feature maps against their closed forms in float64, and the registry that names them.

The maps come from ``linvit.ops.FEATURE_MAPS``: a newly registered fixed map is checked here (and in the attention,
fused-Function and layer tests) without a line of these files changing; only its float64 formula joins
``tests/references.py``.
"""

import pytest
import torch
from references import FEATURE_MAP_REFS

from linvit.ops import (
    FEATURE_MAPS,
    FeatureMapSpec,
    elu1,
    feature_map_spec,
    focused,
    get_feature_map,
    list_feature_maps,
    register_feature_map,
    relu,
    unregister_feature_map,
)

FIXED_MAPS = list_feature_maps(learnable=False)
INPLACE_MAPS = [name for name in FIXED_MAPS if feature_map_spec(name).inplace is not None]


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


@pytest.mark.parametrize('name', FIXED_MAPS)
def test_maps_are_non_negative_and_finite_on_zero_rows(name):
    phi = get_feature_map(name)
    x = torch.cat([_sample(), -_sample().abs(), torch.zeros(4, 7, 16, dtype=torch.float64)])
    y = phi(x)
    assert y.shape == x.shape
    assert torch.isfinite(y).all()
    assert bool((y >= 0).all())


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['fp64', 'fp32'])
@pytest.mark.parametrize('name', FIXED_MAPS)
def test_registered_maps_match_the_shared_references(name, dtype):
    """The registry entries equal the formulas the attention tests use, incl. all-negative and all-zero rows."""
    x = torch.cat([_sample(), -_sample(seed=1).abs(), torch.zeros(1, 7, 16, dtype=torch.float64)])
    x[0, 0, :3] = torch.tensor([1e-3, -1e-3, 0.0])  # entries near the kink at 0
    assert name in FEATURE_MAP_REFS, f"add the float64 formula of feature map {name!r} to tests/references.py"
    got = get_feature_map(name)(x.to(dtype)).double()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(got, FEATURE_MAP_REFS[name](x), rtol=tol, atol=tol)


def test_the_shipped_feature_maps():
    """The one place that pins the shipped set, on purpose: the other tests take the names from the registry."""
    assert list_feature_maps() == ['elu1', 'relu', 'focused', 'relu2', 'hedgehog', 'nala']
    assert [name for name in list_feature_maps() if feature_map_spec(name).kernel_id is not None] == ['elu1', 'relu']


def test_unknown_feature_map_names_the_closest_and_the_known_ones():
    with pytest.raises(ValueError) as info:
        get_feature_map('relu3')
    assert "unknown feature_map 'relu3'; did you mean 'relu', 'relu2' or 'elu1'?" in str(info.value)
    for name in list_feature_maps():
        assert name in str(info.value)


def test_a_registered_spec_is_resolved_by_name_and_unregistered():
    def softplus(x):
        return torch.nn.functional.softplus(x)

    spec = register_feature_map(FeatureMapSpec('test_softplus', softplus))
    try:
        assert get_feature_map('test_softplus') is softplus and 'test_softplus' in list_feature_maps()
        assert feature_map_spec('test_softplus') is spec and not spec.learnable
    finally:
        assert unregister_feature_map('test_softplus') is spec
    assert 'test_softplus' not in FEATURE_MAPS


def test_register_feature_map_rejects_duplicates_and_bare_functions():
    with pytest.raises(ValueError, match="feature_map 'elu1' is already registered"):
        register_feature_map(FeatureMapSpec('elu1', elu1))
    with pytest.raises(TypeError, match='takes a FeatureMapSpec'):
        register_feature_map('softplus')


def test_a_spec_declares_a_function_or_a_module_and_only_a_fixed_map_has_forms():
    with pytest.raises(ValueError, match='exactly one of them'):
        FeatureMapSpec('neither')
    with pytest.raises(ValueError, match='exactly one of them'):
        FeatureMapSpec('both', relu, module=torch.nn.Identity)
    with pytest.raises(ValueError, match=r"cannot declare \['kernel_id'\]"):
        FeatureMapSpec('learnable', module=torch.nn.Identity, kernel_id=3)
    with pytest.raises(ValueError, match='uses only with with_vjp'):
        FeatureMapSpec('half', relu, derivative_from_output=lambda phi: phi > 0)


def test_a_learnable_map_has_no_function_to_call():
    with pytest.raises(ValueError, match="'hedgehog' is learnable"):
        get_feature_map('hedgehog')


def test_elu1_gradient_matches_elu_including_zero():
    x = torch.cat([_sample().flatten(), torch.zeros(3, dtype=torch.float64)]).requires_grad_()
    elu1(x).sum().backward()
    expected = torch.where(x.detach() > 0, torch.ones_like(x), torch.exp(x.detach()))  # elu's derivative, 1 at 0
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('name', INPLACE_MAPS)
def test_inplace_maps_write_the_map_into_their_input(name):
    x = torch.cat([_sample(), torch.zeros(1, 7, 16, dtype=torch.float64)])
    target = x.clone()
    out = feature_map_spec(name).inplace(target)
    assert out.data_ptr() == target.data_ptr()
    torch.testing.assert_close(target, FEATURE_MAP_REFS[name](x), rtol=1e-12, atol=1e-12)


def test_focused_keeps_its_direction_for_tiny_float32_inputs():
    """r^3 of values near 1e-15 underflows float32: the map scales rows by their max before the power."""
    x = _sample(shape=(3, 16)) * 1e-15
    expected = FEATURE_MAP_REFS['focused'](x)  # float64
    got = focused(x.float()).double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-21)
    assert (expected.abs().amax(-1) > 1e-16).all()  # not a zero row in disguise
