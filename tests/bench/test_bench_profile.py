"""linvit.bench.profile: configurations, one measured in this process (against a scripted clock), in a child process,
and failures as rows."""
import json
import os

import pytest
from scripted_clock import ScriptedClock

from linvit.bench import profile
from linvit.bench.memory import allocator_setting
from linvit.bench.report import CSV_FIELDS
from linvit.bench.specs import parse_model_spec


def test_sweep_is_size_major_with_floors():
    configs = profile.build_configs(['linvit_tiny_patch16_224', 'vit_tiny_patch16_224'], [(512, 512), (224, 224)],
                                    floors='linvit', modes=['eager'])
    assert [(c.height, c.model.label) for c in configs] == [
        (224, 'linvit_tiny_patch16_224'), (224, 'vit_tiny_patch16_224'), (224, 'floor(linvit_tiny_patch16_224)'),
        (512, 'linvit_tiny_patch16_224'), (512, 'vit_tiny_patch16_224'), (512, 'floor(linvit_tiny_patch16_224)')]


def test_training_step_is_measured_in_process():
    spec = parse_model_spec('linvit_tiny_patch16_224:depth=1')
    config = profile.Config(spec, 32, 48, 2, 'bfloat16', 'eager', 'training', 'cpu', 1, 2)
    result = profile.measure(config)
    assert result['tokens'] == 7 and result['img_per_s'] == pytest.approx(2e3 / result['median_ms'])
    assert result['p90_ms'] >= result['median_ms'] > 0 and result['first_call_ms'] > 0
    # the calls' own peak sits on top of the memory held after building, within the process's peak
    assert result['added_mem_mib'] >= 0 and result['base_mem_mib'] > 50
    assert result['peak_mem_mib'] >= result['base_mem_mib'] + result['added_mem_mib'] - 1e-6
    assert result['machine'].endswith(f"{os.cpu_count()} CPUs")


def test_failures_become_rows(capsys):
    spec = parse_model_spec('no_such_model_anywhere')
    config = profile.Config(spec, 32, 32, 1, 'float32', 'eager', 'inference', 'cpu', 1, 1)
    row = profile.run_config(config, timeout=0.01)
    assert row['status'] == 'timeout' and row['model'] == 'no_such_model_anywhere'
    assert profile.child_main(config.to_json()) == 0  # in this process: an unknown model is an error row
    result = json.loads(capsys.readouterr().out.strip().split(profile.RESULT_MARK)[1])
    assert result['status'] == 'error' and 'no_such_model_anywhere' in result['error']


def test_without_retain_freed_memory_the_child_keeps_the_parents_allocator_setting(monkeypatch):
    """A child asked to retain freed memory says 'retain' in its CSV row: tools/profile_resolution.py's end-to-end
    test (tests/tools/test_profile_resolution_cli.py), whose children run with --retain-freed-memory."""
    import linvit.bench.memory as memory
    monkeypatch.setattr(memory, 'retaining_freed_memory', lambda: False)  # the parent's environment alone
    spec = parse_model_spec('linvit_tiny_patch16_224:depth=1')
    config = profile.Config(spec, 32, 32, 1, 'float32', 'eager', 'inference', 'cpu', 1, 1)
    inherited = profile.run_config(config, timeout=300)
    assert (inherited['status'], inherited['allocator']) == ('ok', allocator_setting())  # the parent's own
    assert 'allocator' in CSV_FIELDS


# 2 warm-up calls, then 10 timed: median (30 + 35) / 2, nearest-rank p90 the 9th smallest (50, not the largest)
FORWARD_MS = [500., 50., 30., 10., 20., 50., 40., 35., 25., 15., 45., 60.]


@pytest.mark.parametrize('workload', ['inference', 'training'])
@pytest.mark.parametrize('spec, floor, tokens', [
    ('linvit_tiny_patch16_224:depth=1,reg_tokens=4', False, 1 + 4 + 2 * 3),  # class token, registers, 2x3 patches
    ('linvit_tiny_patch16_224:depth=1,reg_tokens=4', True, 1 + 4 + 2 * 3),
    ('vit_tiny_patch16_224:depth=1,class_token=False,global_pool=avg', False, 2 * 3),
])
def test_measure_reports_the_forward_times_per_image_and_the_token_count(monkeypatch, spec, floor, tokens, workload):
    clock = ScriptedClock(lambda name, is_floor, h, w, i: FORWARD_MS[i])
    clock.install(monkeypatch, profile)
    model = parse_model_spec(spec)
    config = profile.Config(model.as_floor() if floor else model, 32, 48, 2, 'float32', 'eager', workload, 'cpu', 2,
                            10)
    result = profile.child_result(config)
    assert result['status'] == 'ok', result.get('error')
    assert result['tokens'] == tokens
    assert (result['first_call_ms'], result['median_ms'], result['p90_ms']) == pytest.approx((500., 32.5, 50.))
    assert result['img_per_s'] == pytest.approx(2 / 0.0325)  # batch 2 in 32.5 ms
    # the model (its floor when asked) saw [batch, 3, H, W] images, warm-up + repeats times
    assert clock.inputs == [(model.name, floor, (2, 3, 32, 48))] * 12


def test_measure_restarts_the_peak_between_warm_up_and_timed_calls(monkeypatch):
    events = []

    class SpyWatch(profile.MemoryWatch):
        def start(self) -> None:
            events.append('start')
            super().start()

        def steady(self) -> None:
            events.append('steady')
            super().steady()

    monkeypatch.setattr(profile, 'MemoryWatch', SpyWatch)
    spec = parse_model_spec('linvit_tiny_patch16_224:depth=1')
    profile.measure(profile.Config(spec, 32, 32, 1, 'float32', 'eager', 'training', 'cpu', 1, 1))
    assert events == ['start', 'steady']
