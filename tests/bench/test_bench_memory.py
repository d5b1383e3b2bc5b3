"""linvit.bench.memory: the peak of the timed calls alone, the allocator setting."""
import json
import os
import subprocess
import sys

import pytest

from linvit.bench import memory

_PEAK_AFTER_A_BIG_WARM_UP = r'''
import json, torch
from linvit.bench import memory
watch = memory.MemoryWatch(torch.device('cpu'))
watch.start()
big = torch.ones(400 * 2 ** 20 // 4)  # touched pages: resident
del big
watch.steady()
small = torch.ones(8 * 2 ** 20 // 4)
result = watch.result()
del small
print(json.dumps({'base': watch.base, **result}))
'''


@pytest.mark.skipif(not os.path.exists('/proc/self/clear_refs'), reason='needs Linux /proc to restart the peak')
@pytest.mark.integration
def test_the_peak_is_the_timed_calls_own_not_the_warm_ups():
    """A warm-up that held 400 MiB (a compile, a first-call cache) and freed it leaves no trace in the peak.

    In a fresh interpreter with glibc's own thresholds: once linvit's fast path made glibc keep freed memory (as it
    has in a test process that compiled a model), freed pages stay resident by design."""
    env = {k: v for k, v in os.environ.items() if k not in memory.RETAIN_FREED_MEMORY_ENV}
    out = subprocess.run([sys.executable, '-c', _PEAK_AFTER_A_BIG_WARM_UP], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result['peak_mem_mib'] < result['base'] + 200
    assert result['added_mem_mib'] == pytest.approx(max(0.0, result['peak_mem_mib'] - result['base']))


def test_allocator_setting_names_the_environment(monkeypatch):
    for key in memory.RETAIN_FREED_MEMORY_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(memory, 'retaining_freed_memory', lambda: False)  # whatever this process's fast path did
    assert memory.allocator_setting() == 'system'
    for key, value in memory.RETAIN_FREED_MEMORY_ENV.items():
        monkeypatch.setenv(key, value)
    assert memory.allocator_setting() == 'retain'
    monkeypatch.setenv('MALLOC_TRIM_THRESHOLD_', '1')
    assert memory.allocator_setting() == 'custom'
