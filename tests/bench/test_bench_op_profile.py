"""linvit.bench.op_profile: a step's time by kind of operation, from torch.profiler (call counts are exact; times
are only compared where one op is far larger than the rest)."""
import pytest
import torch
import torch.nn.functional as F

from linvit.bench import op_profile
from linvit.bench.specs import parse_model_spec
from linvit.bench.train_step import _inference_steps, build_models


@pytest.mark.parametrize('name, category', [
    ('aten::bmm', 'matmul'), ('aten::addmm', 'matmul'), ('aten::mm', 'matmul'),
    ('sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64', 'matmul'), ('nvjet_hsh_128x256_64x4', 'matmul'),
    ('aten::mkldnn_convolution', 'convolution'), ('aten::convolution_backward', 'convolution'),
    ('void cudnn::engines_precompiled::nhwc_depthwise_conv_kernel', 'convolution'),
    ('linvit::linear_attention_qkv', 'attention'), ('_key_pass', 'attention'), ('_grad_key', 'attention'),
    ('aten::_scaled_dot_product_flash_attention', 'attention'), ('flash_fwd_kernel', 'attention'),
    ('aten::native_layer_norm', 'normalisation'), ('aten::native_layer_norm_backward', 'normalisation'),
    ('aten::copy_', 'copies and casts'), ('aten::_to_copy', 'copies and casts'), ('aten::clone', 'copies and casts'),
    ('void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>', 'copies and casts'),
    ('graph_0_cpp_fused_clone_convolution_permute_select_slice_view_0', 'fused (compiled)'),
    ('triton_poi_fused__to_copy_add_0', 'fused (compiled)'),
    ('triton_red_fused_native_layer_norm_1', 'fused (compiled)'),
    ('aten::gelu', 'other'), ('aten::add', 'other'), ('## Call CompiledFxGraph abc ##', 'other'),
])
def test_names_fall_into_their_category(name, category):
    assert op_profile.categorize(name) == category
    assert category in op_profile.CATEGORIES


def test_profile_counts_each_op_per_step_and_adds_up_by_category():
    x, y = torch.randn(256, 256), torch.randn(256, 256)
    image, weight = torch.randn(1, 4, 16, 16), torch.randn(4, 1, 3, 3)

    def step():
        torch.mm(x, y)
        F.layer_norm(x, (256,))
        x.clone()

    def convolutions():
        F.conv2d(image, weight, padding=1, groups=4)
        F.conv2d(image, weight, padding=1, groups=4)

    profiles = op_profile.profile_steps({'step': step, 'conv': convolutions}, steps=3, device='cpu')
    calls = {op.name: op.calls for op in profiles['step'].ops}
    assert calls['aten::mm'] == 1.0 and calls['aten::clone'] == 1.0
    by_category = profiles['step'].by_category
    assert set(by_category) == set(op_profile.CATEGORIES)
    assert by_category['matmul'] > 0 and by_category['normalisation'] > 0 and by_category['copies and casts'] > 0
    assert by_category['convolution'] == 0 and by_category['attention'] == 0
    assert profiles['step'].total_ms == pytest.approx(sum(op.ms for op in profiles['step'].ops))
    assert [op.ms for op in profiles['step'].ops] == sorted((op.ms for op in profiles['step'].ops), reverse=True)
    conv_ops = {op.name: op for op in profiles['conv'].ops}
    assert conv_ops['aten::convolution'].calls == 2.0
    # self time: the dispatching wrappers cost next to nothing, the kernel-running op holds the time
    leaf = conv_ops.get('aten::mkldnn_convolution') or conv_ops['aten::_convolution']
    assert leaf.ms > 2 * conv_ops['aten::conv2d'].ms
    assert profiles['conv'].by_category['convolution'] > 0 and profiles['conv'].by_category['matmul'] == 0


def test_linvit_local_mix_adds_one_convolution_per_block_to_its_floor():
    models = build_models(parse_model_spec('linvit_tiny_patch16_224:depth=2'), None, 32, 32, 'cpu', train=False)
    profiles = op_profile.profile_steps(_inference_steps(models, torch.randn(1, 3, 32, 32), 'eager', 'float32'),
                                        steps=2, device='cpu')
    convolutions = {kind: {op.name: op.calls for op in p.ops}['aten::convolution'] for kind, p in profiles.items()}
    assert convolutions == {'linvit': 3.0, 'floor': 1.0}  # the patch embedding, and linvit's local-mix branches


def test_table_gives_each_category_the_difference_to_the_floor_and_the_top_ops():
    def profile(ops):
        return op_profile.StepProfile([op_profile.OpTime(name, op_profile.categorize(name), ms, calls)
                                       for name, ms, calls in ops])

    profiles = {'linvit': profile([('aten::mm', 10.0, 4), ('aten::convolution', 2.5, 3), ('aten::gelu', 0.5, 2)]),
                'floor': profile([('aten::mm', 9.0, 4), ('aten::convolution', 1.0, 1)])}
    lines = op_profile.format_profile(profiles, top=2)
    rows = {line.split()[0]: line.split()[-3:] for line in lines[1:8]}
    assert rows['matmul'] == ['10.00', '9.00', '+1.00']
    assert rows['convolution'] == ['2.50', '1.00', '+1.50']
    assert rows['other'] == ['0.50', '0.00', '+0.50']
    assert lines[8].split()[-3:] == ['13.00', '10.00', '+3.00']  # total
    assert lines[9].startswith('top 2 ops of linvit')
    assert [line.split()[-1] for line in lines[10:]] == ['aten::mm', 'aten::convolution']
    assert lines[10].split()[:2] == ['10.000', '4.0']


def test_steps_must_be_positive():
    with pytest.raises(ValueError, match='steps must be >= 1'):
        op_profile.profile_steps({'noop': lambda: None}, steps=0, device='cpu')
