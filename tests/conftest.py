"""Without a GPU, run linvit's Triton kernels through Triton's interpreter (CPU tensors, numpy), so the kernel tests
check the same kernel code a GPU compiles. Set before any kernel module is imported: Triton reads it when it
decorates a kernel. On a machine with CUDA the kernels compile for the GPU and the CUDA-only tests run too.

Also here: the small runs several modules read, trained once per session (``shared_run``), and the ``integration``
marker on every test that trains or starts interpreters (docs/testing.md: the quick subset leaves them out)."""
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')

# Inductor's CPU code without its SIMD vector classes: on a fresh machine (no compile cache) g++ takes half the time
# over it, and the compiles of the suite were 2.5 of its minutes there. What the tests compare (compiled against eager,
# one graph, the library's passes and ops inside the graph) does not depend on how inductor vectorises its loops; the
# GPU check compiles the real thing. The environment carries it to the processes a test starts.
os.environ.setdefault('TORCHINDUCTOR_VEC_ISA_OK', '0')

# Under pytest-xdist (make test runs one worker per core) each worker gets its share of the cores: torch's default of
# one intra-op thread per core in every worker would oversubscribe them. The environment carries the share to the
# train.py processes a test starts, so a resumed run computes with the same thread count as the run it continues.
_XDIST_WORKERS = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
if _XDIST_WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)
    os.environ['OMP_NUM_THREADS'] = str(_THREADS)
    torch.set_num_threads(_THREADS)


# ---------------------------------------------------------------------------------------------------- shared runs

def _shared_runs_folder(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """One folder for the whole session: under pytest-xdist the workers' base folders share a parent."""
    base = tmp_path_factory.getbasetemp()
    return (base if worker_id == 'master' else base.parent) / 'shared_runs'


@pytest.fixture(scope='session')
def shared_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Callable[[str, Path], Path]:
    """``shared_run(name, dest)``: a copy in ``dest`` of the finished run ``tiny_run.SHARED_RUNS[name]``, trained once
    per test session however many modules and pytest-xdist workers ask for it (the first trains it under a file
    lock, the others wait and copy). Each caller gets its own copy, so a test may write into its run."""
    from filelock import FileLock
    from tiny_run import SHARED_RUNS

    from linvit.engine import load_config, train

    folder = _shared_runs_folder(tmp_path_factory, worker_id)
    folder.mkdir(parents=True, exist_ok=True)

    def copy(name: str, dest: Path) -> Path:
        trained, done = folder / name, folder / f'{name}.done'
        with FileLock(str(folder / f'{name}.lock')):
            if not done.exists():
                shutil.rmtree(trained, ignore_errors=True)
                train(load_config(None, [*SHARED_RUNS[name], f'output_dir={trained}']))
                done.touch()
        shutil.copytree(trained, dest)
        return dest

    return copy


#: fixtures that train a run: a test that uses one is an integration test (``-m "not integration"`` leaves it out)
TRAINING_FIXTURES = frozenset({'shared_run', 'tiny_config', 'seg_run', 'seg_config', 'ema_run', 'teacher_dir'})


def pytest_collection_modifyitems(items: list) -> None:
    """Mark integration tests: a module that trains or starts interpreters declares it (``pytestmark``); a test
    elsewhere that uses a training fixture is marked here."""
    for item in items:
        if TRAINING_FIXTURES & set(getattr(item, 'fixturenames', ())):
            item.add_marker(pytest.mark.integration)
