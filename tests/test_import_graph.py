"""No import cycles in linvit/, and no import the layer table of docs/architecture.md does not allow: every module's
imports, read with ``ast``, form a graph without cycles whose edges between packages are all in the table.

What counts as an edge (module A -> module B): any ``import`` or ``from ... import`` statement anywhere in A's source
that names B: at module level, inside functions and methods (a function-level import still makes A depend on B,
it only delays the dependency), and under ``if TYPE_CHECKING:`` (a type-only dependency is still one). Relative
imports are resolved against A's package. ``from P import x`` is an edge to the submodule ``P.x`` when ``x`` is a
module of linvit, else to ``P`` itself (``P``'s ``__init__``, where the name is defined or re-exported).

What is not an edge: Python's implicit import of the parent packages (importing ``linvit.engine.trainer`` first
runs ``linvit/__init__.py`` and ``linvit/engine/__init__.py``). Counting those would make every package ``__init__``
that imports its submodules a cycle, which it is not: the submodules never see a half-built package unless they
import it. So ``from . import x`` in a package ``__init__`` is an ordinary edge to the submodule ``x``, and a
submodule importing a sibling (``from .sibling import f``) is an edge to that sibling, not to the package; but a
submodule importing a name from its own package (``from . import f`` with ``f`` defined in ``__init__``, or
``from linvit.engine import f`` inside ``linvit.engine.*``) is an edge to the ``__init__`` that imports it back:
a cycle, reported as one.
"""
import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

import linvit

PACKAGE_DIR = Path(linvit.__file__).resolve().parent
PACKAGE = 'linvit'
ARCHITECTURE_DOC = Path(__file__).resolve().parents[1] / 'docs' / 'architecture.md'


def module_name(path: Path, root: Path = PACKAGE_DIR, package: str = PACKAGE) -> str:
    """linvit/engine/trainer.py -> 'linvit.engine.trainer'; linvit/engine/__init__.py -> 'linvit.engine'."""
    parts = list(path.relative_to(root).with_suffix('').parts)
    if parts[-1] == '__init__':
        parts = parts[:-1]
    return '.'.join([package, *parts])


def all_modules(root: Path = PACKAGE_DIR, package: str = PACKAGE) -> Dict[str, Path]:
    """Every module of the package: dotted name -> source file."""
    return {module_name(path, root, package): path for path in sorted(root.rglob('*.py'))}


def _resolve_relative(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    base = module.split('.') if is_package else module.split('.')[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return '.'.join(base + ([target] if target else []))


def imported_modules(module: str, path: Path, modules: Set[str]) -> Set[str]:
    """The linvit modules that ``module`` (source at ``path``) imports anywhere in its source."""
    found: Set[str] = set()
    is_package = path.name == '__init__.py'
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif source in modules:
                    found.add(source)
    found.discard(module)
    return found


def import_graph(root: Path = PACKAGE_DIR, package: str = PACKAGE) -> Dict[str, Set[str]]:
    """module -> the package's modules it imports."""
    modules = all_modules(root, package)
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle [a, b, ..., a] of ``graph`` (depth-first search, deterministic order), or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: finished
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_linvit_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 20 and 'linvit.engine.trainer' in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in linvit/: " + ' -> '.join(cycle)


def test_the_cycle_finder_sees_function_level_and_package_imports(tmp_path):
    """The checker itself, on a toy package: a function-level import closes a cycle; a package __init__ importing
    its submodules, and siblings importing each other one way, do not."""
    pkg = tmp_path / 'toy'
    (pkg / 'sub').mkdir(parents=True)
    (pkg / '__init__.py').write_text('from . import a, b\nfrom .sub import c\n')
    (pkg / 'a.py').write_text('from .b import f\n')
    (pkg / 'b.py').write_text('def f():\n    return 1\n')
    (pkg / 'sub' / '__init__.py').write_text('from .c import g\n')
    (pkg / 'sub' / 'c.py').write_text('from ..a import f\n\ndef g():\n    return f()\n')
    graph = import_graph(pkg, 'toy')
    assert graph['toy'] == {'toy.a', 'toy.b', 'toy.sub.c'}
    assert graph['toy.sub.c'] == {'toy.a'}
    assert find_cycle(graph) is None
    (pkg / 'b.py').write_text('def f():\n    from .sub.c import g\n    return g\n')
    assert find_cycle(import_graph(pkg, 'toy')) == ['toy.a', 'toy.b', 'toy.sub.c', 'toy.a']
    (pkg / 'b.py').write_text('def f():\n    return 1\n')
    (pkg / 'a.py').write_text('from . import VERSION\n')  # a name the package __init__ defines: an edge to it
    assert find_cycle(import_graph(pkg, 'toy')) == ['toy', 'toy.a', 'toy']


# ---------------------------------------------------------------------------------------------------------------
# the layer table: docs/architecture.md's `| package | job | may import |` table, read as the rules it states

@dataclass
class LayerTable:
    """The rules of the table: package -> the packages it may import (besides itself and the leaves)."""
    allowed: Dict[str, Set[str]]
    leaves: Set[str]

    @property
    def packages(self) -> Set[str]:
        return set(self.allowed) | self.leaves


_BACKTICKED = re.compile(r'`([^`]+)`')


def _cells(line: str) -> List[str]:
    return [cell.strip() for cell in line.strip().strip('|').split('|')]


def _table_lines(text: str) -> List[str]:
    """The body rows of the first markdown table whose header is ``| package | job | may import |``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('|') and
                  _cells(line) == ['package', 'job', 'may import']), None)
    assert start is not None, "no '| package | job | may import |' table"
    body = []
    for line in lines[start + 2:]:  # past the header and its |---| line
        if not line.startswith('|'):
            break
        body.append(line)
    return body


def _in_package(name: str, root: str) -> bool:
    return name == root or name.startswith(root + '.')


def _allowed_packages(cell: str, package: str, root: str) -> Optional[Set[str]]:
    """The packages a 'may import' cell names; None for 'nothing' (a leaf). Items: `linvit...` names, 'the leaves'
    (always allowed), 'nothing'; anything else fails, so that the column stays machine-readable."""
    if cell == 'nothing':
        return None
    allowed: Set[str] = set()
    for item in (part.strip() for part in cell.split(',')):
        named = _BACKTICKED.fullmatch(item)
        if named and _in_package(named.group(1), root):
            allowed.add(named.group(1))
        else:
            assert item == 'the leaves', f"{package}: may import {item!r}: expected `linvit...`, 'the leaves' or " \
                                          f"'nothing'"
    return allowed


def parse_layer_table(text: str, root: str = PACKAGE) -> LayerTable:
    """The table's rules. A row whose package cell names no `linvit...` package (tools/, train.py) is about code
    outside the package and is not a rule; a row may name several packages (the leaves' row does)."""
    table = LayerTable({}, set())
    for line in _table_lines(text):
        names_cell, _, may_import = _cells(line)
        packages = [name for name in _BACKTICKED.findall(names_cell) if _in_package(name, root)]
        for package in packages:
            assert package not in table.packages, f"{package} has two rows"
            allowed = _allowed_packages(may_import, package, root)
            if allowed is None:
                table.leaves.add(package)
            else:
                table.allowed[package] = allowed
    return table


def package_of(module: str, packages: Set[str]) -> Optional[str]:
    """The table's package that holds ``module``: the longest table name equal to it or above it (None: no row)."""
    candidates = [p for p in packages if module == p or module.startswith(p + '.')]
    return max(candidates, key=len) if candidates else None


def layer_violations(graph: Dict[str, Set[str]], table: LayerTable) -> List[str]:
    """'a -> b (package of a may not import package of b)' for every edge the table does not allow; a module outside
    every row is one too. A leaf may import nothing of the package, not even another leaf."""
    problems = []
    packages = table.packages
    for module in sorted(graph):
        own = package_of(module, packages)
        if own is None:
            problems.append(f"{module}: its package has no row in the layer table")
            continue
        for target in sorted(graph[module]):
            other = package_of(target, packages)
            if other == own:
                continue
            allowed = set() if own in table.leaves else table.allowed[own] | table.leaves
            if other not in allowed:
                problems.append(f"{module} -> {target} ({own} may not import {other})")
    return problems


def test_every_import_in_linvit_is_allowed_by_the_layer_table():
    table = parse_layer_table(ARCHITECTURE_DOC.read_text())
    assert {'linvit.ops', 'linvit.engine', 'linvit.bench', 'linvit.timing'} <= table.packages
    modules = all_modules()
    missing = sorted(p for p in table.packages if p not in modules)
    assert not missing, f"the layer table names packages that do not exist: {missing}"
    named = {p: (allowed - table.leaves) for p, allowed in table.allowed.items()}
    unknown = sorted(a for allowed in named.values() for a in allowed if a not in table.packages)
    assert not unknown, f"the layer table allows packages that have no row: {unknown}"
    cycle = find_cycle(named)
    assert cycle is None, "the layer table itself goes upward: " + ' -> '.join(cycle)
    problems = layer_violations(import_graph(), table)
    assert not problems, "imports the layer table of docs/architecture.md does not allow:\n" + '\n'.join(problems)


def test_the_layer_check_sees_upward_and_leaf_imports(tmp_path):
    """The checker itself, on a toy package and table: allowed edges pass; a function-level import upward, a leaf
    importing a layer and a module in no row are reported; an unreadable cell fails."""
    doc = """| package | job | may import |
|---|---|---|
| `toy.low` | the bottom | the leaves |
| `toy.high` | the top | `toy.low`, the leaves |
| `toy.leaf` | a leaf | nothing |
| `tools/` | not a rule | the library |
"""
    table = parse_layer_table(doc, 'toy')
    assert table.allowed == {'toy.low': set(), 'toy.high': {'toy.low'}} and table.leaves == {'toy.leaf'}
    pkg = tmp_path / 'toy'
    (pkg / 'low').mkdir(parents=True)
    (pkg / 'high').mkdir()
    (pkg / '__init__.py').write_text('')
    (pkg / 'leaf.py').write_text('import os\n')
    (pkg / 'low' / '__init__.py').write_text('from ..leaf import os\n')
    (pkg / 'low' / 'a.py').write_text('from . import b\n')
    (pkg / 'low' / 'b.py').write_text('X = 1\n')
    (pkg / 'high' / '__init__.py').write_text('from toy.low.a import b\n')
    graph = {m: deps for m, deps in import_graph(pkg, 'toy').items() if m != 'toy'}
    assert layer_violations(graph, table) == []
    (pkg / 'low' / 'b.py').write_text('def f():\n    from toy.high import b\n    return b\n')
    (pkg / 'leaf.py').write_text('from .low import b\n')
    (pkg / 'extra.py').write_text('')
    graph = {m: deps for m, deps in import_graph(pkg, 'toy').items() if m != 'toy'}
    assert layer_violations(graph, table) == [
        'toy.extra: its package has no row in the layer table',
        'toy.leaf -> toy.low.b (toy.leaf may not import toy.low)',
        'toy.low.b -> toy.high (toy.low may not import toy.high)']
    with pytest.raises(AssertionError, match='may import'):
        parse_layer_table(doc.replace('`toy.low`, the leaves', 'low things'), 'toy')


@pytest.mark.integration
def test_engine_lists_its_tasks_right_after_import():
    """A fresh interpreter: importing linvit.engine alone registers every built-in task (other tests import more)."""
    code = 'import linvit.engine as e; print(sorted(e.TASKS)); print(sorted(t.name for t in e.TASKS.values()))'
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout.split('\n')
    expected = str(['autoregressive', 'classification', 'depth', 'detection', 'linearize', 'segmentation'])
    assert out[0] == expected and out[1] == expected
