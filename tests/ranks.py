"""Run a function on N gloo processes (forked) and collect what each rank returned: for reduction and
context-parallel tests. Tensors travel back through torch.save, so results may hold them."""
import multiprocessing
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

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


def run_ranks(tmp_path, fn, *args, world_size=WORLD_SIZE, timeout=120):
    """[fn(0, *args), ..., fn(world_size - 1, *args)] computed in as many processes of one gloo group."""
    port = free_port()
    # fork: children start with torch imported and the data in memory (spawn would import everything again)
    context = multiprocessing.get_context('fork')
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
