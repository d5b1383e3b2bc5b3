"""linvit.bench.cli: the crossover rule and --dtype's precision names."""
import argparse

import pytest

from linvit.bench.cli import crossover, precision_arg


def test_crossover_is_the_start_of_the_final_winning_run():
    assert crossover([(224, 1, 2), (512, 3, 2), (768, 1, 2), (1024, 5, 2), (2048, 9, 1)]) == 1024
    assert crossover([(224, 2, 1), (512, 3, 2)]) == 224
    assert crossover([(224, 1, 2), (512, 2, 2)]) is None  # a tie is no win
    assert crossover([(224, 1, 2), (512, 3, None)]) == 512  # softmax out of memory: linvit wins
    assert crossover([(224, 3, 2), (512, None, 1)]) is None


def test_dtype_takes_torch_names_only():
    assert precision_arg('bfloat16') == 'bfloat16'
    for other in ('bf16', 'int8'):
        with pytest.raises(argparse.ArgumentTypeError, match=f"--dtype='{other}' is not a precision; expected one of "
                                                             f"\\['float32', 'bfloat16', 'float16'\\]"):
            precision_arg(other)
