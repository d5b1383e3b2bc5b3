"""linvit.bench.attention: the crossover rule and the floor layer it compares against."""
import torch
from timm.layers import Attention

from linvit.bench.attention import crossover
from linvit.layers import NoMixingAttention


def _rows(pairs):
    return [{'tokens': n, 'softmax_ms': s, 'linear_ms': lin} for n, s, lin in pairs]


def test_crossover_is_the_start_of_the_final_winning_run():
    assert crossover(_rows([(49, 1, 2), (196, 2, 1), (256, 3, 4), (576, 9, 5), (1024, 30, 9)])) == 576
    assert crossover(_rows([(49, 1, 0.5), (196, 2, 1)])) == 49
    assert crossover(_rows([(49, 1, 2), (196, 2, 3)])) is None


def test_floor_returns_projected_values():
    torch.manual_seed(0)
    softmax = Attention(32, 4, qkv_bias=True)
    floor = NoMixingAttention(32, 4, qkv_bias=True)
    floor.load_state_dict(softmax.state_dict())
    x = torch.randn(2, 9, 32)
    v = x @ softmax.qkv.weight[64:].T + softmax.qkv.bias[64:]
    torch.testing.assert_close(floor(x), v @ softmax.proj.weight.T + softmax.proj.bias)
