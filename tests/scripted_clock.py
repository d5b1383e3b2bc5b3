"""A scripted clock for the benchmark tests: every model forward moves it by a time the test chose, so the
latency, throughput and ratio columns have values computed without timing anything."""
from typing import Callable, List, Optional, Tuple

import timm

from linvit.layers import NoMixingAttention


class ScriptedClock:
    """Stands in for a module's ``time`` (e.g. linvit.timing's); ``perf_counter`` reads a clock that only model
    forwards move."""

    def __init__(self, forward_ms: Optional[Callable[[str, bool, int, int, int], float]] = None):
        """forward_ms(model name, is_floor, height, width, call index) -> milliseconds of one forward of a model
        built by ``install``'s create_model (None: something else moves ``now``)."""
        self.now = 0.0
        self.forward_ms = forward_ms
        self.inputs: List[Tuple[str, bool, Tuple[int, ...]]] = []

    def perf_counter(self) -> float:
        return self.now

    def install(self, monkeypatch, target) -> None:
        """Route ``target.time`` to this clock and make every model ``timm.create_model`` builds move it."""
        real_create = timm.create_model
        clock = self

        def create_model(name, *args, **kwargs):
            model = real_create(name, *args, **kwargs)
            calls = []

            def advance(module, inputs):
                images = inputs[0]
                floor = any(isinstance(m, NoMixingAttention) for m in module.modules())
                clock.inputs.append((name, floor, tuple(images.shape)))
                clock.now += clock.forward_ms(name, floor, images.shape[-2], images.shape[-1], len(calls)) / 1e3
                calls.append(None)

            model.register_forward_pre_hook(advance)
            return model

        monkeypatch.setattr(target, 'time', self)
        monkeypatch.setattr(timm, 'create_model', create_model)


def in_process(profile):
    """linvit.bench.profile.run_config without a subprocess: the same row, measured (or failing) in this process."""
    def run_config(config, timeout, retain_freed_memory=False):
        return {**profile.base_row(config), **profile.child_result(config)}
    return run_config


def float_cells(line: str) -> List[float]:
    """The numbers of a printed table line: '12.50', '0.67x' -> 12.5, 0.67."""
    return [float(cell.rstrip('x')) for cell in line.split()]

