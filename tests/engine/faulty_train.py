"""train.py with a fault injected right after its first checkpoint, for the tests of SIGTERM and elastic restarts
(``tests/engine/test_faults.py``). Run as train.py is, with FAULT=<what>:<rank> in the environment:

    term        SIGTERM to this process (a scheduler's signal)
    term-group  SIGTERM to this process's group: itself and its DataLoader workers (SLURM signals them all); start
                it in a session of its own
    term-agent  SIGTERM to the parent, torchrun's agent (which forwards it to every worker)
    kill        SIGKILL to this process (a worker that dies: torchrun restarts the worker group)

Only the process of that RANK, in torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0 or unset), faults, once.
Several faults, comma-separated (FAULT=kill:0,kill:1), are one per attempt: the n-th faults in torchrun's attempt n
(restart n), right after that attempt's first checkpoint.
"""
import os
import runpy
import signal
import sys

from linvit.engine import trainer

_SIGNALS = {'term': signal.SIGTERM, 'term-agent': signal.SIGTERM, 'term-group': signal.SIGTERM, 'kill': signal.SIGKILL}
_save_checkpoint = trainer._save_checkpoint
_faulted = []


def _save_then_fault(*args, **kwargs):
    _save_checkpoint(*args, **kwargs)
    faults = os.environ['FAULT'].split(',')
    attempt = int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))
    if _faulted or attempt >= len(faults):
        return
    what, _, rank = faults[attempt].partition(':')
    if os.environ.get('RANK', '0') != rank:
        return
    _faulted.append(what)
    if what == 'term-group':
        os.killpg(os.getpgrp(), _SIGNALS[what])
    else:
        os.kill(os.getppid() if what == 'term-agent' else os.getpid(), _SIGNALS[what])


trainer._save_checkpoint = _save_then_fault
if __name__ == '__main__':
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.argv[0] = os.path.join(root, 'train.py')
    runpy.run_path(sys.argv[0], run_name='__main__')
