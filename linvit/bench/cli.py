"""What the benchmark command lines share: the help formatter that shows every default, ``--dtype`` parsing,
``--threads`` and the busy-machine warning, the check that a CUDA device asked for exists, and the crossover of two
speed curves."""
import argparse
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from linvit.timing import CpuLoad, cpu_load

__all__ = ['HelpFormatter', 'crossover', 'precision_arg', 'THREADS_HELP', 'threads_arg', 'busy_warning',
           'MeasurementThreads', 'measurement_threads', 'missing_cuda_device', 'exit_without_cuda_device']

THREADS_HELP = ("torch CPU threads of the measurement: a number, or 'auto': the cores other processes leave free "
                "when it starts (the 1-minute load average), at most torch's default of one per core. More threads "
                "than free cores wait for the busy ones at every op, and times and ratios become noise")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the docstring's layout and ends every option's help with its default: '(default: float32)'. Options
    whose default is None say what that means in their own help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ''
        default = action.default
        if default is None or default is argparse.SUPPRESS or '(default' in text:
            return text
        if default is False:  # a flag
            return f"{text} (default: off)"
        shown = ' '.join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def precision_arg(text: str) -> str:
    """argparse ``type`` of ``--dtype``: a precision name of ``linvit.precision`` (float32, bfloat16, float16);
    anything else is a usage error listing them."""
    from linvit.precision import resolve_precision

    try:
        return resolve_precision(text, '--dtype')
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def crossover(points: Sequence[Tuple[Any, Optional[float], Optional[float]]]) -> Optional[Any]:
    """First key from which ``a`` beats ``b`` at that and every later key; points = (key, a speed, b speed) sorted by
    size, larger speed is better. A missing ``b`` (out of memory or time) counts as a win for ``a``, a missing ``a``
    as a loss."""
    result = None
    for key, a, b in reversed(points):
        if a is None or (b is not None and a <= b):
            break
        result = key
    return result


def threads_arg(text: str) -> Union[str, int]:
    """argparse ``type`` of ``--threads``: 'auto' or a whole number >= 1."""
    if text == 'auto':
        return text
    try:
        threads = int(text)
    except ValueError:
        threads = 0
    if threads < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of threads >= 1, got {text!r}")
    return threads


def busy_warning(load: Optional[CpuLoad], threads: int) -> Optional[str]:
    """The one line a measurement with ``threads`` CPU threads prints when other processes keep the cores it needs
    busy (what the load was, what to do); None when the cores are free or the load is unknown."""
    if load is None or not load.busy(threads):
        return None
    advice = (f"rerun with --threads {load.fair_threads} or free the cores" if threads > load.fair_threads
              else "free the cores (none is free)")
    return (f"WARNING busy machine: {load.describe()} and this measurement uses {threads} thread(s), more than the "
            f"{load.free_cores} free core(s): its times and ratios are noise; {advice}")


@dataclass(frozen=True)
class MeasurementThreads:
    """The torch threads a measurement uses, whether ``--threads auto`` chose them, and the CPU load when it
    started (None on a GPU, or where the system has no load average)."""
    threads: int
    auto: bool
    load: Optional[CpuLoad]

    def note(self) -> str:
        """'2 threads (auto: the free cores), load average 3.0 on 4 cores' for the table's heading."""
        text = f"{self.threads} thread(s)" + (' (auto: the free cores)' if self.auto and self.load else '')
        if self.load:
            text += f", load average {self.load.load_average:.1f} on {self.load.cores} cores"
        return text

    def warning(self) -> Optional[str]:
        return busy_warning(self.load, self.threads)

    def warning_lines(self, prefix: str = '# ') -> List[str]:
        """The warning as a line of a report (none when the cores are free)."""
        warning = self.warning()
        return [prefix + warning] if warning else []

    def apply(self) -> 'MeasurementThreads':
        """Set torch's threads in this process (a measurement in this process); returns self."""
        torch.set_num_threads(self.threads)
        return self


def measurement_threads(requested: Union[str, int], device: str) -> MeasurementThreads:
    """The threads a measurement on ``device`` uses: ``requested``, or for 'auto' the cores other processes leave
    free on a CPU (torch's default on a GPU, whose host threads only launch work); the load is read on a CPU
    only. Nothing is set here: ``apply()`` in the process that measures."""
    on_cpu = str(device).startswith('cpu')
    load = cpu_load() if on_cpu else None
    if requested != 'auto':
        return MeasurementThreads(int(requested), False, load)
    default = torch.get_num_threads()
    return MeasurementThreads(min(default, load.fair_threads) if load else default, True, load)


def missing_cuda_device(device: str) -> Optional[str]:
    """Why the CUDA device ``device`` ('cuda', 'cuda:1') cannot be used here, in words; None for a device that
    exists or one that is not CUDA."""
    if not str(device).startswith('cuda'):
        return None
    try:
        index = torch.device(device).index or 0
    except RuntimeError:
        return f"--device {device} is not a torch device (expected 'cpu', 'cuda' or 'cuda:N')"
    if not torch.cuda.is_available():
        return f"--device {device}: there is no CUDA device on this machine (torch.cuda.is_available() is False)"
    if index >= torch.cuda.device_count():
        return (f"--device {device}: there is no CUDA device {index} on this machine (torch sees "
                f"{torch.cuda.device_count()})")
    return None


def exit_without_cuda_device(parser: argparse.ArgumentParser, device: str) -> None:
    """For the checks that default to a CUDA device: exit with status 2, like a usage error, and one line on stderr
    when ``device`` is a CUDA device this machine does not have, naming the CPU run of the same code."""
    missing = missing_cuda_device(device)
    if missing:
        parser.exit(2, f"{parser.prog}: error: {missing}; the same code runs on this CPU at tiny sizes with "
                       f"--device cpu --quick\n")
