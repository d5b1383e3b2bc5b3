"""Run a function on 2 gloo processes (forked) and collect what each rank wrote as JSON: for reduction tests."""
import json
import multiprocessing
import socket
from datetime import timedelta

import torch.distributed as dist

WORLD_SIZE = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _on_rank(rank, port, fn, args, result_path):
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=30))
    try:
        result = fn(rank, *args)
        with open(result_path, 'w') as f:
            json.dump(result, f)   # NaN is written as NaN and read back as nan
    finally:
        dist.destroy_process_group()


def run_two_ranks(tmp_path, fn, *args, timeout=60):
    """[fn(0, *args), fn(1, *args)] computed in two processes of one gloo group (fn's results must be JSON)."""
    port = free_port()
    # fork: children start with torch imported and the data in memory (spawn would import everything again)
    context = multiprocessing.get_context('fork')
    paths = [tmp_path / f'rank{rank}.json' for rank in range(WORLD_SIZE)]
    workers = [context.Process(target=_on_rank, args=(rank, port, fn, args, paths[rank])) for rank in range(WORLD_SIZE)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=timeout)
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()
    assert [worker.exitcode for worker in workers] == [0] * WORLD_SIZE
    return [json.loads(path.read_text()) for path in paths]
