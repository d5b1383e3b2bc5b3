"""Tools are scripts, not modules of the package: load them from tools/ by file name."""
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOLS_DIR = Path(__file__).resolve().parents[2] / 'tools'
# as when a tool runs as a script (python tools/x.py), its folder is on the path for the shared tool_cli module
sys.path.insert(0, str(TOOLS_DIR))


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
