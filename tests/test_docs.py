"""Every ```python block of README.md and docs/*.md runs, so the docs cannot rot.

The blocks of one page run in order in one namespace (a page may build on its earlier blocks), in a fresh temporary
directory where ``configs/`` is the repository's (the blocks are written as if run from the repository root). Each
block is compiled with its file name and real line numbers, so a failure names the file and the line of the block
and the traceback points into the Markdown. Shell sessions are tagged ``bash`` and are not run.

Blocks may register things (a toy attention family, a feature map, a task): the registries are restored after each
page so that no page changes what the other tests see.
"""
import contextlib
import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List

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
        """'docs/models.md:42' (the path relative to the repository when it is inside)."""
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


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


def _registries() -> Dict[str, dict]:
    """The name registries a doc block may add to (restored after each page)."""
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
            registry.clear()
            registry.update(saved[name])


def run_page(blocks: List[CodeBlock]) -> None:
    """Run ``blocks`` in order in one namespace; AssertionError naming file:line of the first block that fails."""
    namespace: Dict[str, object] = {'__name__': '__doc_page__'}
    for block in blocks:
        code = compile('\n' * (block.line - 1) + block.source, str(block.path), 'exec')
        try:
            exec(code, namespace)
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
