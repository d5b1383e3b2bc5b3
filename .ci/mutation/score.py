#!/usr/bin/env python
"""The mutation score of a finished ``mutmut run``, and the survivors nobody has explained.

    python .ci/mutation/score.py build/mutation/mutants .ci/mutation/equivalent_mutants.md [PATTERN ...]

Reads mutmut's per-file results (``mutants/**/*.py.meta``: mutant name -> exit code of its test run) and the list of
accepted equivalent mutants (every `backquoted` mutmut name in the markdown file). Prints the counts, the score
killed / (checked - equivalent), the timeouts, and every survivor or uncovered mutant that is not on the list; exits
1 if there is one, or if a mutant was not checked. With PATTERNs (fnmatch over mutant names, e.g.
'linvit.layers.families.*'), only the matching mutants count: the score of a run restricted to those modules
(`mutmut run PATTERN ...`).
"""
import fnmatch
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, Sequence, Set

# mutmut's exit-code meanings (mutmut.stats.status_by_exit_code)
STATUS = {1: 'killed', 3: 'killed', 0: 'survived', 5: 'no tests', 33: 'no tests', 34: 'skipped', 36: 'timeout',
          24: 'timeout', -24: 'timeout', 152: 'timeout', 255: 'timeout', None: 'not checked'}


def results(mutants_dir: Path, patterns: Sequence[str] = ()) -> Dict[str, str]:
    """mutant name -> status, over every mutated file (or the mutants matching one of ``patterns``)."""
    out = {}
    for meta in sorted(mutants_dir.rglob('*.py.meta')):
        for name, code in json.loads(meta.read_text())['exit_code_by_key'].items():
            if not patterns or any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
                out[name] = STATUS.get(code, 'suspicious')
    return out


def equivalent_names(path: Path) -> Set[str]:
    return set(re.findall(r'`([\w.ǁ]+__mutmut_\d+)`', path.read_text(encoding='utf-8')))


def main(mutants_dir: str, equivalents_file: str, patterns: Sequence[str] = ()) -> int:
    status = results(Path(mutants_dir), patterns)
    equivalent = equivalent_names(Path(equivalents_file))
    counts = Counter(status.values())
    checked = len(status) - counts['not checked']
    listed = {name for name in equivalent if status.get(name) in ('survived', 'timeout')}
    # mutmut counts a timeout as caught (a mutant that loops forever); on a slow or loaded machine a surviving
    # mutant whose tests take long also runs past the limit, so timeouts get their own column and both scores
    timeouts = sorted(name for name, s in status.items() if s == 'timeout' and name not in equivalent)
    killed = counts['killed']
    denominator = max(1, checked - len(listed))
    print(f"mutants {len(status)}: " + ', '.join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"score over the {checked} checked, without the {len(listed)} listed equivalent mutants: killed "
          f"{killed} / {denominator} = {killed / denominator:.1%}; counting the {len(timeouts)} other timeouts as "
          f"caught (mutmut's convention): {(killed + len(timeouts)) / denominator:.1%}")
    stale = sorted(name for name in equivalent if status.get(name) == 'killed')
    open_ones = sorted(name for name, s in status.items() if s in ('survived', 'no tests', 'suspicious')
                       and name not in equivalent)
    for name in open_ones:
        print(f"unexplained {status[name]}: {name}  (mutmut show {name})")
    for name in timeouts:
        print(f"timeout (no verdict; rerun alone to decide): {name}")
    for name in stale:
        print(f"listed as equivalent but {status[name]} now: {name} (remove it from {equivalents_file})")
    return 1 if open_ones or stale or counts['not checked'] else 0


if __name__ == '__main__':
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
