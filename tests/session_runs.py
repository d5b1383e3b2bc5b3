"""Runs a module's tests read, built once per test session however its tests are spread over pytest-xdist's workers
(``make test``'s ``--dist worksteal`` may run a module's tests on both): the first worker to ask builds them under a
file lock, the others wait for it and read the same folder. For runs that several ranks train (tests/ranks.py), which
``shared_run`` (tests/conftest.py, one process each) does not build. The tests only read them.

    def build(folder): ...                     # writes the runs into folder
    folder = built_once(tmp_path_factory, worker_id, 'parallel', build)
"""
import shutil
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock


def built_once(tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str,
               build: Callable[[Path], None]) -> Path:
    """The folder ``build(folder)`` filled, built by the first caller of this test session (xdist workers share the
    parent of their base folders)."""
    base = tmp_path_factory.getbasetemp()
    root = (base if worker_id == 'master' else base.parent) / 'session_runs'
    root.mkdir(parents=True, exist_ok=True)
    folder, done = root / name, root / f'{name}.done'
    with FileLock(str(root / f'{name}.lock')):
        if not done.exists():  # a build that failed left no mark: the next caller builds again (and fails as loudly)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder
