"""linvit.fast.allocator: glibc keeps freed memory once the CPU fast path runs, and the user's settings win.

The allocator is process-wide, so its behaviour is measured in fresh interpreters: the minor page faults of touching
a 64 MiB tensor a second time (16,384 pages when its memory went back to the system, none when it was kept).
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import linvit.fast.compiler as compiler
from linvit.bench.memory import allocator_setting
from linvit.engine.step import TrainStep
from linvit.fast import compile_model
from linvit.fast.allocator import GLIBC_THRESHOLD_ENV, _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason='glibc only: other C libraries are left alone')

_REFAULTS = r'''
import json, resource, sys, torch
from linvit.fast.allocator import retain_freed_memory, retaining_freed_memory

def refaults():
    torch.ones(16 * 2 ** 20).sum()  # 64 MiB, touched, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 * 2 ** 20).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

first = refaults()
applied = retain_freed_memory()
print(json.dumps({'before': first, 'applied': applied, 'again': retain_freed_memory(),
                  'retaining': retaining_freed_memory(), 'after': refaults()}))
'''


def _run_refaults(env: dict) -> dict:
    out = subprocess.run([sys.executable, '-c', _REFAULTS], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env_without_thresholds() -> dict:
    return {k: v for k, v in os.environ.items() if k not in GLIBC_THRESHOLD_ENV}


@pytest.mark.integration
def test_freed_memory_is_kept_after_the_call():
    result = _run_refaults(_env_without_thresholds())
    pages = 16 * 2 ** 20 * 4 // 4096
    assert result['before'] >= pages * 0.9  # glibc's default: the block went back to the system
    assert result['applied'] and result['again'] and result['retaining']
    assert result['after'] < pages * 0.05


@pytest.mark.parametrize('name', GLIBC_THRESHOLD_ENV)
@pytest.mark.integration
def test_thresholds_from_the_environment_are_left_alone(name):
    result = _run_refaults({**_env_without_thresholds(), name: str(2 ** 20)})
    assert not result['applied'] and not result['retaining']


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(images.mean(dim=(2, 3)))


@pytest.fixture
def retain_calls(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(compiler, '_retain_freed_memory', lambda: calls.append(1) or True)
    return calls


@pytest.mark.parametrize('retain', [True, False])
def test_compiled_models_and_training_steps_retain_on_cpu_unless_told_not_to(retain_calls, retain):
    images, targets = torch.randn(2, 3, 4, 4), torch.tensor([0, 1])
    compile_model(_Tiny(), backend='eager', retain_freed_memory=retain)(images)
    assert len(retain_calls) == int(retain)
    TrainStep(_Tiny(), nn.functional.cross_entropy, retain_freed_memory=retain)(images, targets)  # eager step
    assert len(retain_calls) == 2 * int(retain)


def test_a_training_step_of_a_model_that_takes_targets_keeps_glibcs_defaults(retain_calls):
    """torchvision's detectors allocate data-dependent shapes: retained memory would fragment and grow every step."""
    class _TakesTargets(_Tiny):
        takes_targets = True

        def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return super().forward(images)

    images, targets = torch.randn(2, 3, 4, 4), torch.tensor([0, 1])
    TrainStep(_TakesTargets(), nn.functional.cross_entropy)(images, targets)
    assert retain_calls == []
    TrainStep(_Tiny(), nn.functional.cross_entropy)(images, targets)
    assert retain_calls == [1]


def test_profile_rows_report_the_retained_allocator(monkeypatch):
    import linvit.bench.memory as memory
    for name in GLIBC_THRESHOLD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(memory, 'retaining_freed_memory', lambda: False)
    assert allocator_setting() == 'system'
    monkeypatch.setattr(memory, 'retaining_freed_memory', lambda: True)
    assert allocator_setting() == 'retain'
    monkeypatch.setenv('MALLOC_TRIM_THRESHOLD_', '1')
    assert allocator_setting() == 'custom'
