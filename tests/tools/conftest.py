"""Tools are scripts, not modules of the package: tests that call a tool's ``main`` in this process load it from
tools/ by file name (tools import only linvit, so nothing else needs to be on the path)."""
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

TOOLS_DIR = Path(__file__).resolve().parents[2] / 'tools'


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The benchmark tools set torch's threads for their measurement (``--threads``); a tool run in this process
    must not leave the next test with them."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def load_tool(name: str) -> ModuleType:
    """Import tools/<name>.py as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, TOOLS_DIR / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def bench() -> ModuleType:
    return load_tool('bench_attention')


@pytest.fixture(scope='module')
def prof() -> ModuleType:
    return load_tool('profile_resolution')


@pytest.fixture(scope='module')
def forward() -> ModuleType:
    return load_tool('profile_forward')


@pytest.fixture(scope='module')
def step_bench() -> ModuleType:
    return load_tool('bench_train_step')


@pytest.fixture(scope='module')
def export_tool() -> ModuleType:
    return load_tool('export_onnx')


@pytest.fixture(scope='module')
def predict_tool() -> ModuleType:
    return load_tool('predict')


@pytest.fixture(scope='module')
def causal_bench() -> ModuleType:
    return load_tool('bench_causal')


@pytest.fixture(scope='module')
def context_demo_tool() -> ModuleType:
    return load_tool('context_demo')


@pytest.fixture(scope='module')
def seg_run(tmp_path_factory, shared_run) -> Path:
    """A tiny segmentation run trained for one epoch (tiny_run's SHARED_RUNS['seg']), a copy per test module."""
    return shared_run('seg', tmp_path_factory.mktemp('seg') / 'run')
