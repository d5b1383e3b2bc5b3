"""Child processes under deadlines, as the GPU check and the quality check run them: each measurement or training run
in its own process (its own peak memory, its own CUDA context, killable with everything it started), stopped at its
deadline and never estimated.

    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
    code, seconds = wait_or_kill([proc], [time.time() + 60])[0]      # code None: killed at its deadline
"""
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ['Running', 'wait_or_kill', 'kill_group', 'child_env', 'process_age_s']


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process and its process group (DataLoader workers, compile workers), then reap it. The process
    must have been started with ``start_new_session=True``."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class Running:
    """A started process and when it must have ended (a time.time())."""
    proc: subprocess.Popen
    started: float
    deadline: float

    def outcome(self) -> Optional[Tuple[Optional[int], float]]:
        """None while it runs; once it exited (its return code, seconds since it started); at its deadline it is
        killed with its process group and gives (None, seconds)."""
        if self.proc.poll() is not None:
            return self.proc.returncode, time.time() - self.started
        if time.time() < self.deadline:
            return None
        kill_group(self.proc)
        return None, time.time() - self.started


def wait_or_kill(procs: Sequence[subprocess.Popen], deadlines: Sequence[float]) -> List[Tuple[Optional[int], float]]:
    """(return code, seconds until it exited) of each proc once all exited; one still running at its deadline (a
    time.time()) is killed with its process group and gives (None, seconds until then)."""
    running = [Running(proc, time.time(), deadline) for proc, deadline in zip(procs, deadlines)]
    outcomes: Dict[int, Tuple[Optional[int], float]] = {}
    while len(outcomes) < len(running):
        for i, run in enumerate(running):
            if i not in outcomes and (outcome := run.outcome()) is not None:
                outcomes[i] = outcome
        time.sleep(0.2)
    return [outcomes[i] for i in range(len(running))]


def child_env(**extra: str) -> Dict[str, str]:
    """This process's environment for a child that runs ``python -m linvit...``: unbuffered output, and the folder
    that holds the linvit this process imported first on PYTHONPATH (a checkout or site-packages alike), so that
    the child runs the same code whatever its working directory; ``extra`` variables set where not already set."""
    import linvit

    env = dict(os.environ, PYTHONUNBUFFERED='1')
    home = str(Path(linvit.__file__).resolve().parents[1])
    env['PYTHONPATH'] = os.pathsep.join([home] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
    for key, value in extra.items():
        env.setdefault(key, value)
    return env


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0 elsewhere): a budget counted from the start of a command
    line counts its imports too."""
    try:
        with open('/proc/self/stat') as f:
            start_ticks = int(f.read().rsplit(')', 1)[1].split()[19])
        with open('/proc/uptime') as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf('SC_CLK_TCK'))
    except (OSError, ValueError, IndexError):
        return 0.0
