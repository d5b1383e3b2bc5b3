"""LocalMix on its own: defaults, refused options and how it finds the patch grid of a token sequence."""
import pytest
import torch
from references import local_mix_ref, rel_err

from linvit.layers import LocalMix
from linvit.layers.local_mix import resolve_token_grid
from linvit.layers.weights import linear_only_parameter_names


def test_defaults_are_a_3x3_depthwise_convolution_after_one_prefix_token():
    mix = LocalMix(8)
    assert mix.kernel_size == 3 and mix.num_prefix_tokens == 1 and mix.grid_size is None
    assert mix.conv.weight.shape == (8, 1, 3, 3) and mix.conv.padding == (1, 1) and mix.conv.groups == 8


@pytest.mark.parametrize('kwargs, message', [
    (dict(kernel_size=4), r'^local mixing kernel_size must be a positive odd number, got 4$'),
    (dict(kernel_size=-1), r'^local mixing kernel_size must be a positive odd number, got -1$'),
    (dict(num_prefix_tokens=-1), r'^num_prefix_tokens must be >= 0, got -1$'),
])
def test_options_that_cannot_work_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalMix(8, **kwargs)


@pytest.mark.parametrize('n_tokens, prefix, grid_size, feat_size, expected', [
    (1 + 6, 1, None, [2, 3], (2, 3)),      # the forward's grid wins
    (1 + 6, 1, (3, 2), None, (3, 2)),      # then the construction grid, when its size fits
    (1 + 9, 1, (3, 2), None, (3, 3)),      # then a square
    (2, 1, None, None, (1, 1)),            # a single patch is a 1 x 1 square
    (16, 0, None, None, (4, 4)),           # no prefix tokens
])
def test_the_token_grid_is_the_given_one_or_the_only_square(n_tokens, prefix, grid_size, feat_size, expected):
    assert resolve_token_grid(n_tokens, prefix, grid_size, feat_size) == expected


@pytest.mark.parametrize('n_tokens, prefix, feat_size, message', [
    (1, 1, None, r'cannot infer the token grid of 1 tokens \(1 prefix \+ 0 patch tokens\)'),
    (1 + 6, 1, None, r'cannot infer the token grid of 7 tokens \(1 prefix \+ 6 patch tokens\) with grid_size=None'),
    (1 + 6, 1, [3, 3], r'feat_size=\[3, 3\] does not match 7 tokens with 1 prefix tokens: expected \(H, W\) with '
                       r'H \* W = 6'),
    (1 + 6, 1, [6], r'feat_size=\[6\] does not match'),
])
def test_a_grid_that_cannot_be_found_is_named(n_tokens, prefix, feat_size, message):
    with pytest.raises(ValueError, match=message):
        resolve_token_grid(n_tokens, prefix, None, feat_size)


def _random_mix(channels, kernel_size, prefix, seed=0):
    mix = LocalMix(channels, kernel_size, prefix)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mix.conv.weight.copy_(torch.randn(mix.conv.weight.shape, generator=g))
        mix.conv.bias.copy_(torch.randn(mix.conv.bias.shape, generator=g))
    return mix


@pytest.mark.parametrize('kernel_size', [1, 3, 5])
def test_the_term_is_the_zero_padded_neighbourhood_sum(kernel_size):
    """forward(v) against shifted sums in float64 (tests/references.py) on a non-square 3 x 5 grid, 2 heads."""
    mix = _random_mix(2 * 4, kernel_size, prefix=2)
    v = torch.randn(2, 2, 2 + 15, 4, generator=torch.Generator().manual_seed(1))  # [B, H, N, Dv]
    v_tokens = v.transpose(1, 2).reshape(2, 17, 8)  # head-major channels, as the attention output
    expected = local_mix_ref(v_tokens.double(), mix.conv.weight, mix.conv.bias, [3, 5], 2)
    assert rel_err(mix(v, [3, 5]), expected) < 1e-6


def test_add_to_leaves_out_alone_under_autograd_and_adds_in_place_without_it():
    mix = _random_mix(8, 3, prefix=1)
    v = torch.randn(1, 2, 1 + 9, 4)
    out = torch.randn(1, 10, 8, requires_grad=True)
    before = out.detach().clone()
    summed = mix.add_to(out, v)
    assert torch.equal(out.detach(), before) and summed is not out
    torch.testing.assert_close(summed, before + mix(v), rtol=0, atol=0)
    with torch.no_grad():
        owned = before.clone()
        assert mix.add_to(owned, v) is owned
        torch.testing.assert_close(owned, before + mix(v), rtol=1e-6, atol=1e-6)


class _AddsLocalTerm(torch.nn.Module):
    """An attention-like caller: some output, then the local term added to it (as LinearAttention.forward)."""

    def __init__(self, mix: LocalMix) -> None:
        super().__init__()
        self.mix = mix

    def forward(self, out: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.mix.add_to(out * 2.0, v, [3, 5])


@pytest.mark.compiler
def test_an_fx_graph_traced_without_autograd_keeps_the_local_term():
    """Traced under no_grad, the graph takes the out-of-place sum: the in-place add into a slice of out has a value
    nothing reads, which dead-code elimination (torchvision's and timm's feature extraction run it) removed along
    with the convolution."""
    mix = _random_mix(8, 3, prefix=2)
    out = torch.randn(2, 17, 8, generator=torch.Generator().manual_seed(2))
    v = torch.randn(2, 2, 17, 4, generator=torch.Generator().manual_seed(3))
    expected = out.double() * 2 + local_mix_ref(v.transpose(1, 2).reshape(2, 17, 8).double(), mix.conv.weight,
                                                mix.conv.bias, [3, 5], 2)
    with torch.no_grad():
        graph = torch.fx.symbolic_trace(_AddsLocalTerm(mix))
        graph.graph.eliminate_dead_code()
        graph.recompile()
        assert rel_err(graph(out, v), expected) < 1e-6
        assert rel_err(torch.jit.script(_AddsLocalTerm(mix))(out, v), expected) < 1e-6


def test_linear_only_parameter_names_of_a_bare_local_mix():
    assert linear_only_parameter_names(LocalMix(8, 3, 1, (2, 2))) == ['conv.bias', 'conv.weight']
