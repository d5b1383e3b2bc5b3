"""Markdown tables of the GPU and quality checks' reports: cells formatted or '-' for a value not measured."""
from typing import List, Optional, Sequence

__all__ = ['fmt', 'md_table']


def fmt(value: Optional[float], spec: str) -> str:
    """``format(value, spec)``, or '-' for None (not measured: cut, skipped or failed)."""
    return '-' if value is None else format(value, spec)


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    """The lines of a markdown table: the header, its rule, one line per row."""
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    return lines + ['| ' + ' | '.join(row) + ' |' for row in rows]
