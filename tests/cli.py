"""``python train.py ARGS`` run in the test process: what a user's command line prints and returns, without the five
seconds of CPU a fresh interpreter spends on its imports.

    result = run_train_py('--config', 'configs/cls_demo.yaml', 'output_dir=...')
    result.returncode, result.stdout, result.stderr          # as subprocess.run(..., capture_output=True) gives them

train.py's ``main`` runs from the repository root with stdout and stderr captured, its log lines formatted as
train.py formats them (``logging.basicConfig`` does nothing under pytest, which holds handlers of its own), warnings
shown as a fresh interpreter shows them (once per place), one torch thread (as the suite's subprocesses get:
OMP_NUM_THREADS=1), and ``env`` set in ``os.environ`` for the call. An exception that escapes ``main`` ends as
Python ends a script: its traceback on stderr and status 1. Tests of the process itself (a signal, torchrun, a fresh
import) start an interpreter instead.
"""
import contextlib
import importlib.util
import io
import logging
import os
import subprocess
import traceback
import warnings
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Dict, Iterator, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
#: train.py's log format (its logging.basicConfig)
LOG_FORMAT, LOG_DATE = '%(asctime)s %(levelname)s %(message)s', '%H:%M:%S'


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py imported as a module named ``name`` (tools are scripts: their ``main(argv)`` runs in the test
    process)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / 'tools' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=1)
def train_py() -> ModuleType:
    """train.py loaded as a module (once: it only defines functions)."""
    spec = importlib.util.spec_from_file_location('train_py_under_test', ROOT / 'train.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _environment(env: Dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _log_to(stream: io.StringIO) -> Iterator[None]:
    """The root logger writes INFO and above to ``stream`` in train.py's format, as in a fresh process."""
    root, handler = logging.getLogger(), logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE))
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO if os.environ.get('RANK', '0') == '0' else logging.WARNING)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@contextlib.contextmanager
def _warnings_to(stream: io.StringIO) -> Iterator[None]:
    """Warnings go to ``stream`` with a fresh interpreter's filter (once per place), not to pytest's record."""
    with warnings.catch_warnings():
        warnings.simplefilter('default')
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: stream.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        yield


def _status(exit_code: object) -> int:
    """A SystemExit's code as the shell sees it (argparse exits 2 after its message)."""
    if exit_code is None:
        return 0
    return exit_code if isinstance(exit_code, int) else 1


def run_train_py(*args: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``python train.py *args`` in this process (module docstring): returncode, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    cwd, threads = os.getcwd(), torch.get_num_threads()
    torch.set_num_threads(1)
    os.chdir(ROOT)
    try:
        with _environment(env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                _log_to(err), _warnings_to(err):
            try:
                code = train_py().main(list(args))
            except SystemExit as done:
                code = _status(done.code)
            except Exception:  # a bug: Python would print the traceback and exit 1
                traceback.print_exc(file=err)
                code = 1
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(['train.py', *args], code, out.getvalue(), err.getvalue())
