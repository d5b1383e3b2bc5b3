"""The Triton kernels' feature maps come from a named table (``KERNEL_FEATURE_MAPS``: ``FeatureMapSpec.kernel_id``
-> the kernels' branch): every registered kernel_id has a branch, and an id the kernels do not know fails loudly (at
the check, at the call, at launch and at compile time), never falling back to another map's branch."""
import pytest
import torch

from linvit.ops import (
    FEATURE_MAPS,
    FeatureMapSpec,
    elu1,
    feature_map_spec,
    kernel_unsupported_reason,
    linear_attention_op,
    register_feature_map,
    triton_interpreting,
    unregister_feature_map,
)
from linvit.ops.linear_attn.backend import KERNEL_FEATURE_MAPS, check_kernel_feature_maps, kernel_feature_map

needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreting()),
                                   reason="the Triton kernels need CUDA or TRITON_INTERPRET=1")
DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'


def test_every_registered_kernel_id_has_a_branch_of_its_own():
    check_kernel_feature_maps()
    ids = [spec.kernel_id for spec in FEATURE_MAPS.values() if spec.kernel_id is not None]
    assert ids and set(ids) <= set(KERNEL_FEATURE_MAPS)
    assert len(set(KERNEL_FEATURE_MAPS.values())) == len(KERNEL_FEATURE_MAPS)  # no two names share a branch
    assert [kernel_feature_map(feature_map_spec(name).kernel_id) for name in ('elu1', 'relu')] == [0, 1]


@pytest.fixture
def unknown_kernel_map():
    """elu1 declaring a kernel branch the kernels do not have."""
    spec = feature_map_spec('elu1')
    name = 'elu1_with_unknown_kernel'
    register_feature_map(FeatureMapSpec(name, elu1, with_vjp=spec.with_vjp, kernel_id='softplus'))
    yield name
    unregister_feature_map(name)


def test_an_unknown_kernel_id_fails_the_check_and_the_reason(unknown_kernel_map):
    with pytest.raises(ValueError, match=r"kernel_id 'softplus' names no feature map of the Triton kernels"):
        check_kernel_feature_maps()
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="'softplus'"):
        kernel_unsupported_reason(q, q, q, unknown_kernel_map)


@needs_kernels
def test_an_unknown_kernel_id_fails_the_call_instead_of_computing_another_map(unknown_kernel_map):
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match="'softplus'"):
        linear_attention_op(q, k, v, unknown_kernel_map, backend='triton')


@needs_kernels
@pytest.mark.parametrize('map_id', [2, -1, 'relu'])
def test_an_unknown_branch_fails_at_launch_and_at_compile_time(map_id):
    from linvit.ops.linear_attn import kernels
    with pytest.raises(ValueError, match='no feature-map branch'):
        kernels.launch_meta(16, 16, torch.float32, map_id)
    if not isinstance(map_id, int):
        return
    meta = dict(kernels.launch_meta(16, 16, torch.float32, 0)[0], MAP=map_id)
    k, v = torch.randn(1, 1, 8, 16, device=DEVICE), torch.randn(1, 1, 8, 16, device=DEVICE)
    part = torch.zeros(1, 1, 17, 16, device=DEVICE)
    with pytest.raises(Exception, match='MAP names no feature map of the kernels'):
        kernels._key_pass[(1, 1)](k, v, k, part, 8, 1, 32, *k.stride(), *v.stride(), 0, 0, 0, BLOCK_N=32,
                                  HAS_W=False, **meta)
