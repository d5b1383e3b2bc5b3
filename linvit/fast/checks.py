"""What the compiled code must satisfy, checked: graph breaks, host tensors, and side effects of a forward.

See ``linvit.fast`` for the contract (one graph per call, no host-device syncs, no state changes in an eval forward)
these functions check; ``tests/test_fast.py`` runs them on every registered model and attention option.
"""
import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from .compiler import LossFn

__all__ = ['GraphReport', 'check_graph_breaks', 'find_host_tensors', 'find_forward_side_effects']


@dataclass
class GraphReport:
    """What dynamo captured from one call: ``graph_count`` graphs, split by ``graph_break_count`` breaks.

    ``break_reasons`` holds one line per break (reason and user frame). A fully compilable call has graph_count 1
    and graph_break_count 0.
    """
    graph_count: int
    graph_break_count: int
    break_reasons: List[str] = field(default_factory=list)
    op_count: int = 0

    def __str__(self) -> str:
        lines = [f"{self.graph_count} graph(s), {self.graph_break_count} graph break(s), {self.op_count} ops"]
        lines += [f"  break: {reason}" for reason in self.break_reasons]
        return '\n'.join(lines)


def _describe_break(reason: Any) -> str:
    frames = getattr(reason, 'user_stack', None) or []
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ''
    return f"{str(getattr(reason, 'reason', reason)).strip().splitlines()[0]}{where}"


def check_graph_breaks(fn: Callable, *args, **kwargs) -> GraphReport:
    """Run ``fn(*args, **kwargs)`` once under ``torch._dynamo.explain`` and report its graphs and graph breaks.

    fn: a model or any callable (e.g. ``TrainStep.forward_loss`` for the training graph). Dynamo traces without
    compiling (no inductor), so this is cheap. Note: explain resets dynamo, dropping every cached compiled graph.
    """
    out = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = [_describe_break(reason) for reason in out.break_reasons]
    return GraphReport(graph_count=out.graph_count, graph_break_count=max(out.graph_break_count, len(reasons)),
                       break_reasons=reasons, op_count=out.op_count)


def find_host_tensors(model: nn.Module, *inputs: torch.Tensor, loss_fn: Optional[LossFn] = None,
                      targets: Optional[torch.Tensor] = None, device: str = 'cuda') -> List[str]:
    """Graph nodes that create tensors on another device than ``device`` (e.g. a CPU tensor in a CUDA forward).

    A copy of ``model`` and the inputs are moved to fake tensors on ``device`` (no such hardware is needed: only
    shapes and devices are propagated), the forward (or ``loss_fn(model(*inputs), targets)``) is traced by dynamo
    with fullgraph=True, and every graph value whose device is not ``device`` is returned as 'node: device'.
    Empty means no host tensors are created (each would be a host-to-device copy, and breaks CUDA graphs).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs: List[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        graphs.append(gm)
        return gm.forward

    fake_model = copy.deepcopy(model)  # outside the fake mode: a real copy, whose tensors .to() then fakes
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_model = fake_model.to(device)
        fake_inputs = [x.to(device) for x in inputs]
        fake_targets = targets.to(device) if targets is not None else None

        def run(*xs: torch.Tensor) -> Any:
            out = fake_model(*xs)
            return loss_fn(out, fake_targets) if loss_fn is not None else out

        torch._dynamo.reset()
        try:
            torch.compile(run, backend=capture, fullgraph=True, dynamic=False)(*fake_inputs)
        finally:
            torch._dynamo.reset()
    expected = torch.device(device)
    found = []
    for gm in graphs:
        for node in gm.graph.nodes:
            value = node.meta.get('example_value')
            values = value if isinstance(value, (tuple, list)) else [value]
            for v in values:
                if isinstance(v, torch.Tensor) and v.device.type != expected.type:
                    found.append(f"{node.format_node()}: {v.device}")
    return found


_MISSING = object()


def _plain_state(module: nn.Module) -> Dict[str, Any]:
    """A module's non-tensor attributes of plain types (counters, flags, cached sizes): what forward must not change."""
    plain = (bool, int, float, str, tuple, type(None))
    return {k: v for k, v in vars(module).items() if isinstance(v, plain) and not k.startswith('_')}


def find_forward_side_effects(model: nn.Module, *inputs: torch.Tensor) -> List[str]:
    """Run ``model(*inputs)`` eagerly under no_grad and list what it changed besides returning outputs.

    Checked: in-place writes to inputs, parameters and buffers (their version counters), draws from the CPU or
    CUDA random generators, and plain (non-tensor) attributes of any submodule. CUDA graphs replay none of these
    correctly, and exports freeze them: an eval-mode forward must change nothing. Empty means none found.
    """
    tensors = {f"input {i}": x for i, x in enumerate(inputs)}
    tensors.update({f"parameter {n}": p for n, p in model.named_parameters()})
    tensors.update({f"buffer {n}": b for n, b in model.named_buffers()})
    versions = {name: t._version for name, t in tensors.items()}
    attrs = {name: _plain_state(m) for name, m in model.named_modules()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    with torch.no_grad():
        model(*inputs)
    effects = [f"{name} written in place" for name, t in tensors.items() if t._version != versions[name]]
    if not torch.equal(torch.get_rng_state(), cpu_rng):
        effects.append("CPU random generator advanced")
    if torch.cuda.is_available() and any(not torch.equal(a, b)
                                         for a, b in zip(torch.cuda.get_rng_state_all(), cuda_rng)):
        effects.append("CUDA random generator advanced")
    for name, module in model.named_modules():
        before, after = attrs[name], _plain_state(module)
        changed = sorted(k for k in set(after) | set(before) if after.get(k, _MISSING) != before.get(k, _MISSING))
        effects += [f"attribute {name + '.' if name else ''}{k} changed" for k in changed]
    return effects
