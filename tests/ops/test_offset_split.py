"""Feature maps declared in parts (psi + offset, in-place psi): the parts reassemble phi exactly."""
import pytest
import torch

from linvit.ops import (
    FEATURE_MAP_PARTS,
    get_feature_map,
    linear_attention_from_features,
    quadratic_linear_attention,
    split_feature_map,
)


@pytest.mark.parametrize('name', sorted(FEATURE_MAP_PARTS))
def test_split_reassembles_the_map(name):
    x = torch.randn(3, 5, 16, dtype=torch.float64) * 3
    parts = split_feature_map(name)
    expected = get_feature_map(name)(x)
    torch.testing.assert_close(parts.psi(x) + parts.offset, expected, rtol=1e-12, atol=1e-12)
    inplace_input = x.clone()
    torch.testing.assert_close(parts.psi_inplace(inplace_input) + parts.offset, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('mask', ['none', 'bool', 'float'])
@pytest.mark.parametrize('name', sorted(FEATURE_MAP_PARTS))
def test_offset_in_the_core_equals_the_whole_map(name, mask):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 21, 8, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    v = torch.randn(2, 3, 21, 5, generator=g, dtype=torch.float64)
    weights = torch.rand(2, 3, 21, generator=g)
    key_mask = {'none': None, 'bool': torch.rand(2, 21, generator=g) > 0.4,
                'float': weights.masked_fill(torch.rand(2, 3, 21, generator=g) > 0.7, 0)}[mask]
    parts = split_feature_map(name)
    split = linear_attention_from_features(parts.psi(q), parts.psi(k), v, 1e-6, key_mask, parts.offset)
    ref = quadratic_linear_attention(q, k, v, feature_map=name, eps=1e-6, key_mask=key_mask)
    torch.testing.assert_close(split, ref, rtol=1e-10, atol=1e-12)
