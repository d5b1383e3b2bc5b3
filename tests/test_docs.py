"""Every ```python block of README.md and docs/*.md runs, so the docs cannot rot.

The blocks of one page run in order in one namespace (a page may build on its earlier blocks), in a fresh temporary
directory where ``configs/`` is the repository's (the blocks are written as if run from the repository root). Each
block is compiled with its file name and real line numbers, so a failure names the file and the line of the block
and the traceback points into the Markdown. Shell sessions are tagged ``bash`` and are not run.

Blocks may register things (a toy attention family, a feature map, a task): the registries are restored after each
page so that no page changes what the other tests see.

Printed output that a page shows is checked too. A ``print(...)`` statement whose comment starts with ``->`` states
what it prints: ``print(x.shape)   # -> torch.Size([1, 1000])``. The statement runs with its output captured, and
what it wrote must equal the text after ``->`` (both stripped; a note may follow the value after `` # ``). Every
other comment is prose and is not checked, so output that depends on randomness or the machine keeps a plain
comment.
"""
import ast
import contextlib
import io
import os
import re
import sys
import tokenize
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
_FENCE = re.compile(r'^(\s*)```(\S*)\s*$')


@dataclass(frozen=True)
class CodeBlock:
    path: Path
    line: int  # 1-based line of the block's first code line
    source: str

    @property
    def where(self) -> str:
        """'docs/models.md:42': where the block starts."""
        return self.at(self.line)

    def at(self, line: int) -> str:
        """'docs/models.md:42' for a line of this block's page (the path relative to the repository when inside)."""
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{line}"


def python_blocks(path: Path) -> List[CodeBlock]:
    """The ```python blocks of a Markdown file, in order, with the line their code starts on."""
    blocks: List[CodeBlock] = []
    language, start, lines = None, 0, []
    for number, text in enumerate(path.read_text(encoding='utf-8').splitlines(), start=1):
        fence = _FENCE.match(text)
        if language is None:
            if fence:
                language, start, lines = fence.group(2), number + 1, []
        elif fence and not fence.group(2):
            if language == 'python':
                blocks.append(CodeBlock(path, start, '\n'.join(lines) + '\n'))
            language = None
        else:
            lines.append(text)
    if language is not None:
        raise ValueError(f"{path.relative_to(ROOT)}:{start - 1}: a ``` block is never closed")
    return blocks


def test_the_block_reader_finds_python_blocks_and_their_lines(tmp_path):
    page = tmp_path / 'page.md'
    page.write_text('# t\n\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = x + 1\nprint(y)\n```\n')
    blocks = python_blocks(page)
    assert [(b.line, b.source) for b in blocks] == [(4, 'x = 1\n'), (11, 'y = x + 1\nprint(y)\n')]


def _registries() -> Dict[str, Any]:
    """The name registries a doc block may add to (restored after each page): linvit Registry objects, or dicts."""
    import linvit
    from linvit.engine import TASKS
    from linvit.ops import feature_maps
    registries = {'ATTENTION_FAMILIES': linvit.ATTENTION_FAMILIES, 'FEATURE_MAPS': feature_maps.FEATURE_MAPS,
                  'TASKS': TASKS}
    vjps = getattr(feature_maps, 'FEATURE_MAP_VJPS', None)
    if isinstance(vjps, dict):
        registries['FEATURE_MAP_VJPS'] = vjps
    return registries


@contextlib.contextmanager
def restored_registries() -> Iterator[None]:
    saved = {name: dict(registry) for name, registry in _registries().items()}
    try:
        yield
    finally:
        for name, registry in _registries().items():
            _restore(registry, saved[name])


def _restore(registry, entries: dict) -> None:
    """Put ``registry`` back to ``entries``, in their order (list_...() prints that order, and later pages check it).

    A Registry refuses to replace an entry, so it is emptied and refilled; a plain dict is cleared and updated."""
    if isinstance(registry, dict):
        registry.clear()
        registry.update(entries)
        return
    for name in list(registry):
        registry.unregister(name)
    for name, entry in entries.items():
        registry.register(name, entry)


def test_the_registries_come_back_whole_and_in_order_after_a_page():
    before = {name: list(registry.items()) for name, registry in _registries().items()}
    with restored_registries():
        for registry in _registries().values():  # what a page could do: drop a shipped name, add its own
            first = next(iter(registry))
            if isinstance(registry, dict):
                registry.pop(first)
                registry['a_doc_page_name'] = object()
            else:
                registry.unregister(first)
                registry.register('a_doc_page_name', object())
    assert {name: list(registry.items()) for name, registry in _registries().items()} == before


class OutputMismatch(AssertionError):
    """A print wrote something other than what its ``# -> value`` comment shows."""


_EXPECTED_OUTPUT_CHECK = '__expect_output__'  # the name the rewritten blocks call; a dunder no doc block uses


def expected_value(comment: str) -> Optional[str]:
    """'True' for the comment '# -> True  # a note'; None for a comment that states no output."""
    text = comment[1:].strip()
    if not text.startswith('->'):
        return None
    return text[2:].split(' # ', 1)[0].strip()


def expected_outputs(source: str) -> Dict[int, str]:
    """Line -> expected output, for every ``# -> value`` comment of ``source``."""
    comments = (token for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT)
    return {token.start[0]: value for token in comments if (value := expected_value(token.string)) is not None}


@contextlib.contextmanager
def expect_output(where: str, expected: str) -> Iterator[None]:
    """Capture what the body prints, pass it on to the real stdout, and fail unless it is ``expected``."""
    with contextlib.redirect_stdout(io.StringIO()) as written:
        yield
    printed = written.getvalue()
    sys.stdout.write(printed)
    if printed.strip() != expected:
        raise OutputMismatch(f"{where}: the print writes {printed.strip()!r}, but its comment shows {expected!r}")


def _is_print(statement: ast.stmt) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            and isinstance(statement.value.func, ast.Name) and statement.value.func.id == 'print')


class _CheckPrintedOutput(ast.NodeTransformer):
    """Wraps each print statement that carries a ``# -> value`` comment in ``with expect_output(where, value):``.

    The comment may sit on any line of a multi-line print; one in a loop is checked on every pass."""

    def __init__(self, block: CodeBlock, expectations: Dict[int, str]):
        self.block, self.unclaimed = block, dict(expectations)

    def visit_Expr(self, statement: ast.Expr) -> ast.stmt:
        lines = [line for line in range(statement.lineno, statement.end_lineno + 1) if line in self.unclaimed]
        if not lines or not _is_print(statement):
            return statement
        if len(lines) > 1:
            raise ValueError(f"{self.block.at(lines[1])}: one print statement has two '# ->' comments")
        check = ast.Call(ast.Name(_EXPECTED_OUTPUT_CHECK, ast.Load()),
                         [ast.Constant(self.block.at(lines[0])), ast.Constant(self.unclaimed.pop(lines[0]))], [])
        return ast.fix_missing_locations(ast.copy_location(ast.With([ast.withitem(check)], [statement]), statement))


def compile_block(block: CodeBlock):
    """The block's code, with its real file and line numbers, and its ``# -> value`` comments turned into checks."""
    source = '\n' * (block.line - 1) + block.source
    rewrite = _CheckPrintedOutput(block, expected_outputs(source))
    tree = rewrite.visit(ast.parse(source, str(block.path)))
    if rewrite.unclaimed:  # a check that checks nothing would pass for ever: refuse it
        line = min(rewrite.unclaimed)
        raise ValueError(f"{block.at(line)}: a '# ->' comment belongs on a print(...) statement, as its output")
    return compile(tree, str(block.path), 'exec')


def run_page(blocks: List[CodeBlock]) -> None:
    """Run ``blocks`` in order in one namespace; AssertionError naming file:line of the first block that fails."""
    namespace: Dict[str, object] = {'__name__': '__doc_page__', _EXPECTED_OUTPUT_CHECK: expect_output}
    for block in blocks:
        code = compile_block(block)
        try:
            exec(code, namespace)
        except OutputMismatch as mismatch:
            raise AssertionError(f"the python block at {block.where} prints something else: {mismatch}") from None
        except Exception as error:  # noqa: BLE001 (any failure of a doc block is a test failure naming it)
            details = ''.join(traceback.format_exception(type(error), error, error.__traceback__)[-6:])
            raise AssertionError(f"the python block at {block.where} fails: {type(error).__name__}: {error}\n"
                                 f"{details}") from error


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize('path', [p for p in DOC_FILES if python_blocks(p)], ids=_page_id)
def test_python_blocks_run(path, tmp_path):
    os.symlink(ROOT / 'configs', tmp_path / 'configs')
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with restored_registries():
            run_page(python_blocks(path))
    finally:
        os.chdir(cwd)


def test_a_failing_block_is_named_by_file_and_line(tmp_path):
    page = tmp_path / 'page.md'
    page.write_text('intro\n\n```python\nx = 1\n```\n\n```python\nx = 2\nundefined_name\n```\n')
    with pytest.raises(AssertionError) as info:
        run_page(python_blocks(page))
    assert f"{page}:8" in str(info.value) and 'NameError' in str(info.value)
    assert 'line 9' in str(info.value)  # the traceback points at the Markdown line of the failing statement


def _page(tmp_path, code: str) -> List[CodeBlock]:
    """The blocks of a page whose one python block is ``code`` (first code line: line 4)."""
    page = tmp_path / 'page.md'
    page.write_text(f"intro\n\n```python\n{code}```\n")
    return python_blocks(page)


def test_a_comment_states_output_only_after_an_arrow():
    assert expected_value('# -> torch.Size([1, 1000])') == 'torch.Size([1, 1000])'
    assert expected_value('#->  True   # padded keys are dropped exactly') == 'True'
    assert expected_value('# -> ') == ''
    assert expected_value('# stride-16 maps') is None
    assert expected_value('# [B, N, C] -> [B, N, C]') is None


def test_printed_output_that_matches_its_comments_passes(tmp_path, capsys):
    run_page(_page(tmp_path, "x = [1, 2]\n"
                             "print(x)   # -> [1, 2]\n"
                             "print(x,\n"
                             "      len(x))   # -> [1, 2] 2  # a multi-line print\n"
                             "for i in range(2):\n"
                             "    print('same')   # -> same\n"
                             "print(x[0])   # prose, not checked\n"))
    assert capsys.readouterr().out == '[1, 2]\n[1, 2] 2\nsame\nsame\n1\n'  # checked output still reaches stdout


def test_a_print_that_writes_something_else_fails_with_the_line_and_both_values(tmp_path):
    with pytest.raises(AssertionError) as info:
        run_page(_page(tmp_path, "print(1 + 1)   # -> 2\n"
                                 "print(sorted(['b', 'a']),\n"
                                 "      3)   # -> ['a', 'b'] 4\n"))
    message = str(info.value)
    assert f"{tmp_path / 'page.md'}:6" in message, message
    assert repr("['a', 'b'] 3") in message and repr("['a', 'b'] 4") in message, message


def test_a_loop_is_checked_on_every_pass(tmp_path):
    with pytest.raises(AssertionError, match=r"page.md:5: the print writes '1', but its comment shows '0'"):
        run_page(_page(tmp_path, "for i in range(2):\n    print(i)   # -> 0\n"))


@pytest.mark.parametrize('code', ["x = 1   # -> 1\n", "def f():\n    return 1   # -> 1\n",
                                  "print(1,   # -> 1\n      2)   # -> 1 2\n"],
                         ids=['not-a-print', 'a-return', 'two-arrows'])
def test_an_arrow_comment_that_checks_no_single_print_is_refused(tmp_path, code):
    with pytest.raises(ValueError, match=r"page.md:(4|5): .*'# ->'"):
        run_page(_page(tmp_path, code))


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / 'README.md').read_text(encoding='utf-8')
    missing = [p.name for p in sorted((ROOT / 'docs').glob('*.md')) if f"(docs/{p.name}" not in readme]
    assert not missing, f"README.md links no docs page {missing}"


def test_relative_links_between_pages_resolve():
    broken = []
    for path in DOC_FILES:
        for target in re.findall(r'\]\(([^)#:\s]+\.md)(?:#[^)]*)?\)', path.read_text(encoding='utf-8')):
            if not (path.parent / target).is_file():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to missing pages: {broken}"
