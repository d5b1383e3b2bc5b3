"""linvit.bench.memory: the peak of the timed calls alone, the allocator setting."""
import os

import pytest
import torch

from linvit.bench import memory


@pytest.mark.skipif(not os.path.exists('/proc/self/clear_refs'), reason='needs Linux /proc to restart the peak')
def test_the_peak_is_the_timed_calls_own_not_the_warm_ups():
    """A warm-up that held 400 MiB (a compile, a first-call cache) and freed it leaves no trace in the peak."""
    watch = memory.MemoryWatch(torch.device('cpu'))
    watch.start()
    big = torch.ones(400 * 2 ** 20 // 4)  # touched pages: resident
    del big
    watch.steady()
    small = torch.ones(8 * 2 ** 20 // 4)
    result = watch.result()
    del small
    assert result['peak_mem_mib'] < watch.base + 200
    assert result['added_mem_mib'] == pytest.approx(max(0.0, result['peak_mem_mib'] - watch.base))


def test_allocator_setting_names_the_environment(monkeypatch):
    for key in memory.RETAIN_FREED_MEMORY_ENV:
        monkeypatch.delenv(key, raising=False)
    assert memory.allocator_setting() == 'system'
    for key, value in memory.RETAIN_FREED_MEMORY_ENV.items():
        monkeypatch.setenv(key, value)
    assert memory.allocator_setting() == 'retain'
    monkeypatch.setenv('MALLOC_TRIM_THRESHOLD_', '1')
    assert memory.allocator_setting() == 'custom'
