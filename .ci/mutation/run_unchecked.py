#!/usr/bin/env python
"""Finish a `mutmut run` faster: run its unchecked mutants (or named ones) and write the verdicts into its results.

    cd build/mutation/mutants && ../../../.venv/bin/python ../../../.ci/mutation/run_unchecked.py [--unchecked] [NAME]

mutmut generates the mutants and records a verdict per mutant in ``mutants/**/*.py.meta``; `score.py` and
`mutmut results` read them. Its runner picks each mutant's tests by coverage and, here, spends 17-50 s on each of the
mutants it leaves for last (the ones every model test covers). This script runs one pytest per mutant, forked from a
parent that has already imported torch and timm, over the mutated package's own tests first and then the other two
packages' (``pytest -x``, the same deselections as setup.cfg): 2-15 s for a killed mutant on 2 cores, the whole
selection (about 70 s) for a survivor. Without names it runs every mutant that has no verdict; with names (or fnmatch
patterns) it re-runs those, e.g. survivors after new tests (copy the tests into mutants/tests first); with
``--unchecked`` and patterns, only the matching ones without a verdict (finishing a ``make mutation MUTANTS=...``
run). Verdicts: pytest's exit code (1 killed, 0 survived, 5 no tests), a run past TIMEOUT_S is a timeout.
"""
import fnmatch
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List

os.environ.setdefault('OMP_NUM_THREADS', '1')  # one thread per forked run: WORKERS runs share the cores
sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

# as tests/conftest.py does, but before timm imports Triton here (Triton reads it when it is first imported, and the
# forked runs inherit this parent's Triton): without a GPU the kernel tests run under Triton's interpreter
if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')
import pytest  # noqa: E402
import timm  # noqa: E402,F401  (imported once here, not in every forked run)

SELECTION = ['-x', '-q', '-p', 'no:cacheprovider', '-m', 'not compiler', '-k',
             'not (base_patch16 and (forward_backward or features_only))']
TEST_ORDER = {'ops': ['tests/ops', 'tests/layers', 'tests/models'],
              'layers': ['tests/layers', 'tests/ops', 'tests/models'],
              'models': ['tests/models', 'tests/layers', 'tests/ops']}
WORKERS = int(os.environ.get('MUTATION_WORKERS', '2'))
TIMEOUT_S = 300
TIMEOUT_CODE = 36  # mutmut's exit code for a timeout (score.py reads it as one)


def load_results() -> Dict[Path, dict]:
    """meta file -> its parsed JSON (mutant name -> exit code under 'exit_code_by_key')."""
    return {meta: json.loads(meta.read_text()) for meta in sorted(Path('linvit').rglob('*.py.meta'))}


def select(results: Dict[Path, dict], patterns: List[str], unchecked_only: bool = False) -> List[str]:
    """Names of the mutants without a verdict, or of those matching ``patterns`` (names or fnmatch patterns), of
    these only the ones without a verdict if ``unchecked_only``."""
    codes = {name: code for data in results.values() for name, code in data['exit_code_by_key'].items()}
    if not patterns:
        return [name for name, code in codes.items() if code is None]
    return [name for name, code in codes.items() if any(fnmatch.fnmatch(name, p) for p in patterns)
            and (code is None or not unchecked_only)]


def run_one(name: str) -> None:
    """In the forked child: switch the mutant on, run the tests, exit with pytest's code."""
    os.environ['MUTANT_UNDER_TEST'] = name
    signal.alarm(TIMEOUT_S)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os._exit(int(pytest.main(SELECTION + TEST_ORDER[name.split('.')[1]])))


def run_clean() -> int:
    """Exit code of the whole selection with no mutant on, in a forked child like the mutant runs."""
    pid = os.fork()
    if pid == 0:
        os.environ['MUTANT_UNDER_TEST'] = ''
        os._exit(int(pytest.main(SELECTION + TEST_ORDER['models'])))
    return verdict(os.waitpid(pid, 0)[1])


def verdict(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return TIMEOUT_CODE if code == -signal.SIGALRM else code


def record(results: Dict[Path, dict], name: str, code: int) -> None:
    for meta, data in results.items():
        if name in data['exit_code_by_key']:
            data['exit_code_by_key'][name] = code
            meta.write_text(json.dumps(data))
            return


def main(patterns: List[str], unchecked_only: bool = False) -> None:
    results = load_results()
    if not results:
        sys.exit("no mutmut results here: run this in the mutants/ directory of a `mutmut run` copy")
    queue = select(results, patterns, unchecked_only)
    # as mutmut does: the tests must pass with no mutant switched on, or every mutant would count as killed
    if run_clean() != 0:
        sys.exit("the tests fail without a mutant (run them in this directory to see why); no verdicts written")
    print(f"{len(queue)} mutants to run with {WORKERS} workers", flush=True)
    running = {}
    counts = {}
    while queue or running:
        while queue and len(running) < WORKERS:
            name = queue.pop(0)
            pid = os.fork()
            if pid == 0:
                run_one(name)
            running[pid] = (name, time.time())
        pid, status = os.wait()
        name, start = running.pop(pid)
        code = verdict(status)
        record(results, name, code)
        counts[code] = counts.get(code, 0) + 1
        if code != 1:
            print(f"exit {code} ({time.time() - start:.0f} s): {name}", flush=True)
    print(f"done: exit codes {dict(sorted(counts.items()))}", flush=True)


if __name__ == '__main__':
    args = sys.argv[1:]
    main([a for a in args if a != '--unchecked'], '--unchecked' in args)
