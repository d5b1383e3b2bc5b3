"""No import cycles in linvit/: every module's imports, read with ``ast``, form a graph without cycles.

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
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set

import linvit

PACKAGE_DIR = Path(linvit.__file__).resolve().parent
PACKAGE = 'linvit'


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


def test_engine_lists_its_tasks_right_after_import():
    """A fresh interpreter: importing linvit.engine alone registers every built-in task (other tests import more)."""
    code = 'import linvit.engine as e; print(sorted(e.TASKS)); print(sorted(t.name for t in e.TASKS.values()))'
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout.split('\n')
    expected = str(['autoregressive', 'classification', 'linearize', 'segmentation'])
    assert out[0] == expected and out[1] == expected
