"""Figure helpers shared by the engine's pictures (``linvit.engine.plots``) and the benchmarks' plots
(``linvit.bench.plots``), importable without the training stack.

Figures are ``matplotlib.figure.Figure`` objects, never pyplot: no global figure registry to leak memory over a long
run, no GUI backend, safe outside the main thread. matplotlib is imported only when a helper runs.
"""
from typing import IO, Any, Optional, Union

__all__ = ['cycle_colour', 'plain_log_y', 'save_png']


def cycle_colour(index: int) -> str:
    """matplotlib's default colour cycle by position: 'C0' .. 'C9', then again from 'C0'."""
    return f"C{index % 10}"


def plain_log_y(ax: Any) -> None:
    """Log y axis whose labels read 0.6, 2, 300 (matplotlib's default writes 6x10^-1 on short ranges)."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        # LogFormatter decides which ticks get a label (fewer minor ones on long ranges); this only writes them plainly
        def __call__(self, x: float, pos: Optional[int] = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ''

    ax.set_yscale('log')
    ax.yaxis.set_major_formatter(PlainLogFormatter(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.tick_params(axis='y', which='minor', labelsize=7)


def save_png(fig: Any, target: Union[str, IO[bytes]], dpi: int) -> None:
    """Render ``fig`` as PNG on a white background into a path or an open binary file (e.g. an atomic writer's)."""
    fig.savefig(target, format='png', dpi=dpi, facecolor='white')
