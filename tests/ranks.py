"""Run a function on N gloo processes (forked) and collect what each rank returned: for reduction and
context-parallel tests. Tensors travel back through torch.save, so results may hold them.

``run_train_py_ranks`` runs train.py's main on N forked processes that get the environment torchrun gives its
workers: ``torchrun --standalone --nproc_per_node N train.py ARGS`` without the launcher's interpreters."""
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from typing import List

import torch
import torch.distributed as dist
from cli import run_train_py, train_py

WORLD_SIZE = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _on_rank(rank, world_size, port, fn, args, result_path):
    torch.set_num_threads(1)  # N processes on 2 cores: one thread each, or they wait for each other
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        torch.save(fn(rank, *args), result_path)
    finally:
        dist.destroy_process_group()


_FORKSERVER = None


def _rank_context() -> multiprocessing.context.BaseContext:
    """Where the ranks are forked from: a server process of this test process, started once with torch and linvit
    imported (``forkserver``). Forking the test process itself would be cheaper, but once a test in it has traced a
    model (dynamo, an export) autograd's thread pool may exist, and a forked child's backward then fails ("Unable to
    handle autograd's threading in combination with fork-based multiprocessing"), depending on which tests the
    pytest-xdist worker ran before."""
    global _FORKSERVER
    if _FORKSERVER is None:
        _FORKSERVER = multiprocessing.get_context('forkserver')
        _FORKSERVER.set_forkserver_preload(['torch', 'torch.distributed', 'timm', 'linvit', 'ranks'])
    return _FORKSERVER


def run_ranks(tmp_path, fn, *args, world_size=WORLD_SIZE, timeout=120):
    """[fn(0, *args), ..., fn(world_size - 1, *args)] computed in as many processes of one gloo group."""
    port = free_port()
    context = _rank_context()
    paths = [tmp_path / f'rank{rank}.pt' for rank in range(world_size)]
    workers = [context.Process(target=_on_rank, args=(rank, world_size, port, fn, args, paths[rank]))
               for rank in range(world_size)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=timeout)
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()
    assert [worker.exitcode for worker in workers] == [0] * world_size
    return [torch.load(path, weights_only=False) for path in paths]


def run_two_ranks(tmp_path, fn, *args, timeout=60):
    """[fn(0, *args), fn(1, *args)] in two processes of one gloo group."""
    return run_ranks(tmp_path, fn, *args, world_size=2, timeout=timeout)


def _train_py_rank(env, args, result_path):
    result = run_train_py(*args, env=env)
    with open(result_path, 'wb') as f:
        pickle.dump(result, f)
    sys.exit(result.returncode)  # the rank's exit status, as torchrun's agent sees it


#: seconds the other ranks get to end after one failed (they may wait for it in a collective: torchrun stops them too)
FAILED_RANK_GRACE = 10


def run_train_py_ranks(world_size: int, *args: str, timeout: float = 300) -> List[subprocess.CompletedProcess]:
    """What ``torchrun --standalone --nproc_per_node=world_size train.py *args`` computes, without its interpreters
    (the launcher's and one per worker, ~5 s of CPU each): train.py's main (tests/cli.py ``run_train_py``) on
    ``world_size`` forked processes, each with the environment torchrun's agent gives its workers (ranks, sizes, the
    first attempt of a fresh launch id, one OMP thread) and the agent's store served from this process, where the
    workers' process group meets as under torchrun (TORCHELASTIC_USE_AGENT_STORE). Returns each rank's
    returncode, stdout and stderr, rank 0's first. As torchrun does, the others are stopped when one fails (after
    ``FAILED_RANK_GRACE`` seconds), and all after ``timeout`` seconds: a rank stopped so returns its exit code and
    no output. The launcher itself (restarts, signals) is for tests that start torchrun."""
    store = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)  # the agent's (port 0: a free one)
    launch = {'GROUP_RANK': '0', 'ROLE_NAME': 'default', 'LOCAL_WORLD_SIZE': str(world_size),
              'WORLD_SIZE': str(world_size), 'GROUP_WORLD_SIZE': '1', 'ROLE_WORLD_SIZE': str(world_size),
              'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(store.port), 'TORCHELASTIC_RESTART_COUNT': '0',
              'TORCHELASTIC_MAX_RESTARTS': '0', 'TORCHELASTIC_RUN_ID': uuid.uuid4().hex,
              'TORCHELASTIC_USE_AGENT_STORE': 'True', 'OMP_NUM_THREADS': '1'}
    train_py()  # loaded here, once, with its imports: the forked ranks start with them
    context = multiprocessing.get_context('fork')
    with tempfile.TemporaryDirectory() as folder:
        paths = [os.path.join(folder, f'rank{rank}.pkl') for rank in range(world_size)]
        workers = [context.Process(target=_train_py_rank, args=(
            {**launch, 'RANK': str(rank), 'LOCAL_RANK': str(rank), 'ROLE_RANK': str(rank)}, args, paths[rank]))
            for rank in range(world_size)]
        for worker in workers:
            worker.start()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            alive = [worker.sentinel for worker in workers if worker.is_alive()]  # once: a rank may end meanwhile
            if not alive:
                break
            multiprocessing.connection.wait(alive, timeout=end - time.monotonic())
            if any(worker.exitcode not in (None, 0) for worker in workers):
                end = min(end, time.monotonic() + FAILED_RANK_GRACE)
        for worker in workers:
            if worker.is_alive():
                worker.kill()
            worker.join()
        results = []
        for rank, (worker, path) in enumerate(zip(workers, paths)):
            if os.path.exists(path):
                with open(path, 'rb') as f:
                    results.append(pickle.load(f))
            else:
                results.append(subprocess.CompletedProcess(['train.py', *args], worker.exitcode, '',
                                                           f'rank {rank} ended with exit code {worker.exitcode} '
                                                           f'without a result (stopped after another failed, or '
                                                           f'after {timeout} s)'))
    del store  # the agent's store ends with its workers
    return results
