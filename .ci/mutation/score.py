#!/usr/bin/env python
"""The mutation score of a finished ``mutmut run``, and the survivors nobody has explained.

    python .ci/mutation/score.py build/mutation/mutants .ci/mutation/equivalent_mutants.md

Reads mutmut's per-file results (``mutants/**/*.py.meta``: mutant name -> exit code of its test run) and the list of
accepted equivalent mutants (every `backquoted` mutmut name in the markdown file). Prints the counts, the score
caught / (all - equivalent) and every survivor or uncovered mutant that is not on the list; exits 1 if there is one.
"""
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, Set

# mutmut's exit-code meanings (mutmut.stats.status_by_exit_code)
STATUS = {1: 'killed', 3: 'killed', 0: 'survived', 5: 'no tests', 33: 'no tests', 34: 'skipped', 36: 'timeout',
          24: 'timeout', -24: 'timeout', 152: 'timeout', 255: 'timeout', None: 'not checked'}


def results(mutants_dir: Path) -> Dict[str, str]:
    """mutant name -> status, over every mutated file."""
    out = {}
    for meta in sorted(mutants_dir.rglob('*.py.meta')):
        for name, code in json.loads(meta.read_text())['exit_code_by_key'].items():
            out[name] = STATUS.get(code, 'suspicious')
    return out


def equivalent_names(path: Path) -> Set[str]:
    return set(re.findall(r'`([\w.ǁ]+__mutmut_\d+)`', path.read_text(encoding='utf-8')))


def main(mutants_dir: str, equivalents_file: str) -> int:
    status = results(Path(mutants_dir))
    equivalent = equivalent_names(Path(equivalents_file))
    counts = Counter(status.values())
    # an equivalent mutant that ran past mutmut's time limit on a loaded machine is not caught by a test
    listed = {name for name in equivalent if status.get(name) in ('survived', 'timeout')}
    caught = counts['killed'] + counts['timeout'] - sum(status[name] == 'timeout' for name in listed)
    stale = sorted(name for name in equivalent if status.get(name) == 'killed')
    print(f"mutants {len(status)}: " + ', '.join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"score: caught {caught} / {len(status)} = {caught / max(1, len(status)):.1%}; without the {len(listed)} "
          f"listed equivalent mutants: {caught / max(1, len(status) - len(listed)):.1%}")
    open_ones = sorted(name for name, s in status.items() if s in ('survived', 'no tests', 'suspicious')
                       and name not in equivalent)
    for name in open_ones:
        print(f"unexplained {status[name]}: {name}  (mutmut show {name})")
    for name in stale:
        print(f"listed as equivalent but {status[name]} now: {name} (remove it from {equivalents_file})")
    return 1 if open_ones or stale else 0


if __name__ == '__main__':
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
