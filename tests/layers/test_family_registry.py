"""The attention family as the unit of change: each family declares itself once (``FamilySpec``) and everything reads
that declaration. A toy family registered here, from the test, works through timm.create_model, convert_to_linear,
a training config, ONNX export, print(model) and softmax-checkpoint loading without touching the library; the
built-in declarations are complete (checked against state-dict diffs with timm's Attention); old names still work
and warn."""
import math
import os
import re

import pytest
import timm
import torch
import torch.nn as nn
from references import FEATURE_MAP_REFS
from timm.layers import Attention
from tiny_run import TINY_RUN

import linvit
from linvit.layers import (
    ATTENTION_FAMILIES,
    FamilySpec,
    LinearAttention,
    attention_layer,
    linear_only_parameter_names,
    list_attention_families,
    load_softmax_state_dict,
    register_family,
    unregister_family,
)
from linvit.models import BLOCK_TYPES, block_types
from linvit.ops import quadratic_linear_attention

DIM, HEADS = 48, 3
TINY = dict(depth=2, img_size=32, patch_size=8, embed_dim=DIM, num_heads=HEADS, local_mix=False)


class ToyAttention(LinearAttention):
    """A toy family: plain linear attention whose output [B, N, H * D] is scaled per channel by a learned vector
    ``toy_scale`` [H * D] that starts at the option ``scale_init``."""

    family = FamilySpec('toy', options={'scale_init': 1.0}, feature_map=True, tensors=('toy_scale',))

    def __init__(self, dim: int, scale_init: float = 1.0, **kwargs) -> None:
        super().__init__(dim, **kwargs)
        self.scale_init = scale_init
        weight = self.qkv.weight
        self.toy_scale = nn.Parameter(torch.full((self.attn_dim,), float(scale_init), device=weight.device,
                                                 dtype=weight.dtype))

    def mix(self, qkv, key_mask, x, feat_size):
        return super().mix(qkv, key_mask, x, feat_size) * self.toy_scale


@pytest.fixture
def toy():
    """The toy family, registered for one test (nothing of the library knows it otherwise)."""
    register_family(ToyAttention)
    yield ToyAttention
    unregister_family('toy')


def _toy_reference(layer: ToyAttention, x: torch.Tensor) -> torch.Tensor:
    """The toy layer written out in float64: qkv, normalised linear attention with the layer's map (``references``),
    times toy_scale, then the output projection. x [B, N, dim] -> [B, N, dim]."""
    x = x.double()
    b, n, _ = x.shape
    qkv = x @ layer.qkv.weight.double().T
    if layer.qkv.bias is not None:
        qkv = qkv + layer.qkv.bias.double()
    q, k, v = (t.reshape(b, n, HEADS, DIM // HEADS).transpose(1, 2) for t in qkv.split(DIM, dim=-1))
    mixed = quadratic_linear_attention(q, k, v, FEATURE_MAP_REFS[layer.feature_map_name], layer.eps)
    mixed = mixed.transpose(1, 2).reshape(b, n, DIM)
    mixed = mixed * layer.toy_scale.double()
    return mixed @ layer.proj.weight.double().T + layer.proj.bias.double()


def _randomise(module: nn.Module, seed: int = 0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return module


def _tokens(n: int = 17, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, n, DIM, generator=torch.Generator().manual_seed(seed))


def test_a_toy_family_builds_through_timm_create_model_and_prints_its_options(toy):
    assert 'toy' in linvit.list_attention_families() and linvit.ATTENTION_FAMILIES['toy'] is toy
    model = timm.create_model('linvit_tiny_patch16_224', attn_family='toy', attn_options={'scale_init': 0.5}, **TINY)
    layer = model.blocks[0].attn
    assert isinstance(layer, toy) and model.attn_family == 'toy' and layer.feature_map_name == 'relu'
    assert torch.equal(layer.toy_scale, torch.full((DIM,), 0.5))
    text = repr(model)
    assert "family='toy'" in text and 'scale_init=0.5' in text and "feature_map='relu'" in text
    _randomise(layer)
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), _toy_reference(layer, x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"unknown toy attention options \['low_rank_size'\]"):
        timm.create_model('linvit_tiny_patch16_224', attn_family='toy', attn_options={'low_rank_size': 2}, **TINY)
    with pytest.raises(ValueError, match='ToyAttention has no causal form'):
        timm.create_model('linvit_tiny_patch16_224', attn_family='toy', causal=True, depth=1)


def test_a_toy_family_converts_a_timm_vit_and_loads_a_softmax_checkpoint(toy):
    vit = timm.create_model('vit_tiny_patch16_224', depth=2, img_size=32, patch_size=8, embed_dim=DIM,
                            num_heads=HEADS)
    softmax_state = {k: v.clone() for k, v in vit.state_dict().items()}
    linvit.convert_to_linear(vit, attn_family='toy', attn_options={'scale_init': 2.0})
    layer = vit.blocks[1].attn
    assert isinstance(layer, toy) and torch.equal(layer.toy_scale, torch.full((DIM,), 2.0))
    assert set(vit.state_dict()) == set(softmax_state) | {f'blocks.{i}.attn.toy_scale' for i in range(2)}
    for key, value in softmax_state.items():
        assert torch.equal(vit.state_dict()[key], value), key
    x = _tokens(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), _toy_reference(layer, x), rtol=1e-5, atol=1e-6)

    fresh = timm.create_model('linvit_tiny_patch16_224', attn_family='toy', attn_options={'scale_init': 3.0},
                              num_classes=1000, **TINY)
    kept = load_softmax_state_dict(fresh, softmax_state)
    assert kept == [f'blocks.{i}.attn.toy_scale' for i in range(2)]
    assert torch.equal(fresh.blocks[0].attn.toy_scale, torch.full((DIM,), 3.0))
    assert torch.equal(fresh.blocks[0].attn.qkv.weight, softmax_state['blocks.0.attn.qkv.weight'])


@pytest.mark.integration
def test_a_toy_family_is_selected_by_a_training_config(toy, tmp_path):
    from safetensors.torch import load_file

    from linvit.engine import load_config, train
    path = tmp_path / 'toy.yaml'
    path.write_text('model:\n  name: linvit_tiny_patch16_224\n  kwargs:\n    depth: 2\n    embed_dim: 48\n'
                    '    num_heads: 3\n    patch_size: 8\n    attn_options:\n      scale_init: 0.5\n')
    cfg = load_config(str(path), ['model.kwargs.attn_family=toy', *TINY_RUN, 'train.max_steps=2',
                                  'data.synthetic.train_size=16', 'data.synthetic.val_size=8',
                                  f'output_dir={tmp_path / "run"}'])
    metrics = train(cfg)
    assert math.isfinite(metrics['loss'])
    with open(os.path.join(cfg.output_dir, 'config.yaml')) as f:
        assert 'attn_family: toy' in f.read()
    weights = load_file(os.path.join(cfg.output_dir, 'model.safetensors'))
    scale = weights['blocks.0.attn.toy_scale']
    assert scale.shape == (DIM,) and not torch.equal(scale, torch.full((DIM,), 0.5))  # trained from its option


@pytest.mark.compiler
def test_a_toy_family_exports_to_onnx(toy, tmp_path):
    ort = pytest.importorskip('onnxruntime')
    from linvit.export import export_onnx
    torch.manual_seed(0)
    # one block (TINY has 2): the toy layer's export is what is checked
    model = timm.create_model('linvit_tiny_patch16_224', attn_family='toy', num_classes=5, dynamic_img_size=True,
                              **{**TINY, 'depth': 1})
    _randomise(model.blocks[0].attn, seed=3)
    model.eval()
    report = export_onnx(model, tmp_path / 'toy.onnx', img_size=32, check_sizes=[(32, 32)])
    assert report.ok and len(report.checks) == 1
    session = ort.InferenceSession(str(tmp_path / 'toy.onnx'), providers=['CPUExecutionProvider'])
    images = torch.randn(2, 3, 48, 40, generator=torch.Generator().manual_seed(4))
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: images.numpy()})[0])
    with torch.no_grad():
        torch.testing.assert_close(got, model(images), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the built-in declarations are complete

#: options under which a family builds every tensor it may declare (its optional branches on)
EVERY_TENSOR = {'bidirectional': {'data_gate': True}}


@pytest.mark.parametrize('name', linvit.list_attention_families())
def test_declared_tensors_are_exactly_what_the_family_adds_to_timm_attention(name):
    cls = ATTENTION_FAMILIES[name]
    timm_keys = set(Attention(DIM, num_heads=HEADS).state_dict())
    for options in ({}, EVERY_TENSOR.get(name, {})):
        layer = attention_layer(name, **options)(DIM, num_heads=HEADS)
        added = set(layer.state_dict()) - timm_keys
        assert sorted(added) == linear_only_parameter_names(layer), (name, options)
        assert set(timm_keys) <= set(layer.state_dict())
    for tensor in cls.family.tensors:  # no stale declaration: with every branch on, each one exists
        assert getattr(layer, tensor) is not None, tensor
    for option in cls.family.options:  # kept as attributes (print(model) reads them)
        assert hasattr(layer, option), option
    assert isinstance(cls.family, FamilySpec) and cls.family.name == name


@pytest.mark.parametrize('name', [name for name in linvit.list_attention_families() if name != 'linear'])
def test_every_family_tensor_takes_the_requested_dtype_and_device(name):
    cls, options = ATTENTION_FAMILIES[name], EVERY_TENSOR.get(name, {})
    for key, param in cls(DIM, num_heads=HEADS, dtype=torch.float64, **options).named_parameters():
        assert param.dtype == torch.float64, key
    meta = cls(DIM, num_heads=HEADS, device='meta', **options)
    for key, tensor in [*meta.named_parameters(), *meta.named_buffers()]:
        assert tensor.device.type == 'meta', key


@pytest.mark.parametrize('name', linvit.list_attention_families())
def test_declared_feature_map_and_causal_form_are_what_the_family_accepts(name):
    spec = ATTENTION_FAMILIES[name].family
    if spec.feature_map:
        model = timm.create_model('linvit_tiny_patch16_224', attn_family=name, feature_map='relu', depth=1)
        assert model.blocks[0].attn.feature_map_name == 'relu' and model.feature_map == 'relu'
    else:
        with pytest.raises(ValueError, match=f"attn_family='{name}' uses no feature map"):
            timm.create_model('linvit_tiny_patch16_224', attn_family=name, feature_map='relu', depth=1)
    if spec.causal:
        assert ATTENTION_FAMILIES[name](DIM, num_heads=HEADS, causal=True).causal
    else:
        with pytest.raises(ValueError, match='has no causal form'):
            ATTENTION_FAMILIES[name](DIM, num_heads=HEADS, causal=True)


def test_unknown_families_name_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown attn_family 'nope'; known: linear, "):
        timm.create_model('linvit_tiny_patch16_224', attn_family='nope', depth=1)
    with pytest.raises(ValueError, match=r"'relu' is a feature map: attn_family='linear', feature_map='relu'"):
        linvit.convert_to_linear(timm.create_model('vit_tiny_patch16_224', depth=1), attn_family='relu')
    with pytest.raises(ValueError, match="unknown attn_family 'nope'"):
        attention_layer('nope')


def test_a_declaration_must_match_its_constructor():
    class Undeclared(LinearAttention):
        pass

    with pytest.raises(TypeError, match='must declare its attention family'):
        register_family(Undeclared)

    class WrongDefault(LinearAttention):
        family = FamilySpec('wrong_default', options={'width': 2})

        def __init__(self, dim: int, width: int = 3, **kwargs) -> None:
            super().__init__(dim, **kwargs)

    with pytest.raises(TypeError, match='declares option width=2'):
        register_family(WrongDefault)

    class Unlisted(LinearAttention):
        family = FamilySpec('unlisted')

        def __init__(self, dim: int, width: int = 3, **kwargs) -> None:
            super().__init__(dim, **kwargs)

    with pytest.raises(TypeError, match=r"takes \['width'\], which its FamilySpec does not declare"):
        register_family(Unlisted)

    class Duplicate(LinearAttention):
        family = FamilySpec('performer')

    with pytest.raises(ValueError, match="'performer' is already registered \\(by PerformerAttention\\)"):
        register_family(Duplicate)
    assert ATTENTION_FAMILIES['performer'] is not Duplicate


def test_the_shipped_families():
    """The one place that pins the shipped set, on purpose: the other tests take the names from the registry."""
    assert linvit.list_attention_families() == ['linear', 'aft', 'bidirectional', 'gated', 'linformer', 'performer',
                                                'polar']


def test_a_declaration_is_read_only_and_names_real_tensors():
    with pytest.raises(ValueError, match="must be an identifier, got 'two words'"):
        FamilySpec('two words')
    spec = FamilySpec('frozen', options={'width': 2}, tensors=['gate'])
    assert spec.tensors == ('gate',)
    with pytest.raises(TypeError):
        spec.options['width'] = 3

    class MissingTensor(LinearAttention):
        family = FamilySpec('missing_tensor', tensors=('nothing',))

    with pytest.raises(AttributeError, match="MissingTensor declares the tensor 'nothing', but has no attribute"):
        linear_only_parameter_names(MissingTensor(DIM, num_heads=HEADS))

    class NotATensor(LinearAttention):
        family = FamilySpec('not_a_tensor', tensors=('num_heads',))

    with pytest.raises(TypeError, match='NotATensor.num_heads is declared as a tensor but is a int'):
        linear_only_parameter_names(NotATensor(DIM, num_heads=HEADS))
    with pytest.raises(ValueError, match="unknown attn_family 'never_registered'"):
        unregister_family('never_registered')


def test_block_types():
    assert set(BLOCK_TYPES) == {'linear', 'softmax'}
    assert block_types(3, (1,)) == ('linear', 'softmax', 'linear')


# ---- the registry's errors ----


def test_an_unknown_family_lists_the_known_ones_and_a_feature_map_name_gets_a_hint():
    known = ', '.join(list_attention_families())
    message = f"unknown attn_family 'nonesuch'; known: {known}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        attention_layer('nonesuch')
    with pytest.raises(ValueError, match="unknown attn_family 'performr'; did you mean 'performer'?"):
        attention_layer('performr')
    hint = "('relu' is a feature map: attn_family='linear', feature_map='relu')"
    with pytest.raises(ValueError, match=f"known: {re.escape(known)} {re.escape(hint)}$"):
        attention_layer('relu')


def test_a_declaration_error_says_what_the_constructor_has_instead():
    class MissingOption(LinearAttention):
        family = FamilySpec('missing_option', options={'width': 2, 'scale': 1.0})

        def __init__(self, dim: int, scale: float = 1.0, **kwargs) -> None:
            super().__init__(dim, **kwargs)

    class WrongDefault(LinearAttention):
        family = FamilySpec('wrong_default', options={'width': 2})

        def __init__(self, dim: int, width: int = 3, **kwargs) -> None:
            super().__init__(dim, **kwargs)

    for cls, found in ((MissingOption, 'no such keyword'), (WrongDefault, 'default 3')):
        message = f"{cls.__name__} declares option width=2 in its FamilySpec, but its constructor has {found}"
        with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
            register_family(cls)


def test_a_constructor_without_kwargs_keeps_its_own_arguments_undeclared():
    # like the plain 'linear' family: arguments it does not pass on to a base are not family options
    class Explicit(LinearAttention):
        family = FamilySpec('explicit')

        def __init__(self, dim: int, num_heads: int = 8) -> None:
            super().__init__(dim, num_heads=num_heads)

    try:
        assert register_family(Explicit) is Explicit and ATTENTION_FAMILIES['explicit'] is Explicit
    finally:
        unregister_family('explicit')


def test_attention_layer_refuses_an_unknown_feature_map_before_any_layer_is_built():
    message = f"unknown feature_map 'nonesuch'; known: {', '.join(linvit.list_feature_maps())}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        attention_layer('gated', feature_map='nonesuch')
    assert attention_layer('gated', feature_map=None)(DIM, num_heads=HEADS).feature_map_name == 'elu1'


def test_attention_layer_defaults_to_plain_linear_attention():
    layer = attention_layer(feature_map='relu')(DIM, num_heads=HEADS)
    assert type(layer).family.name == 'linear' and layer.feature_map_name == 'relu'
