"""The compiled fast path: ``torch.compile(fullgraph=True)`` for inference and for a training step.

Eager PyTorch stays the default and the exact reference; this module is the one place that compiles a linvit (or
any timm ViT) model, for the tools now and the training engine later.

    fast_model = compile_model(model)                       # inference: images [B, 3, H, W] -> logits
    step = compile_train_step(model, loss_fn, optimizer)    # training: loss = step(images, targets)
    report = check_graph_breaks(model, images)              # dynamo's view: graphs, breaks and their reasons

Contract of the compiled code (what ``check_graph_breaks``, ``find_host_tensors`` and ``find_forward_side_effects``
check, and what CUDA graphs need): one graph per call (``fullgraph=True``, zero graph breaks); no host-device
syncs in forward (no ``.item()``, no Python branch on tensor values, no tensor created on the CPU for a CUDA
input); no in-place writes to inputs, parameters or buffers and no RNG draws or attribute changes in an eval
forward. With those, ``mode="reduce-overhead"`` captures CUDA graphs on CUDA inputs.

Resolution policy (shapes of the image batch [B, C, H, W]):

- ``dynamic=False`` (default): static shapes. Every new (B, H, W) compiles a specialised graph once, the first time
  it is seen, and reuses it afterwards (recompilation is not automatic-dynamic: sizes stay static). The compiled
  function's recompile limit is ``RECOMPILE_LIMIT`` shapes (dynamo's default is 8), cached side by side; one more
  raises with fullgraph=True (runs eagerly with fullgraph=False). Best for a fixed set of sizes (benchmarks,
  CUDA graphs, which need static shapes anyway).
- ``dynamic=True``: H and W are marked dynamic (``torch._dynamo.mark_dynamic``) on every call, so one graph with
  symbolic H and W serves every size, plus one for the model's construction grid if it is seen (timm returns
  the position embedding unresampled there, a branch on the size); the batch size stays static until it
  changes once (then dynamo makes it dynamic too). The model must take any size without specialising it: a timm
  ViT built with ``dynamic_img_size=True, dynamic_img_pad=True`` (timm's PatchEmbed formats H and W into its
  divisibility message when not padding, which makes them constants). Other models are rejected with a
  ValueError rather than silently recompiled per size. Training caveat (torch 2.14): the backward of timm's
  antialiased bicubic position-embedding resampling has no meta kernel for symbolic sizes, so a dynamic training
  step of a ViT with a trainable learned position embedding cannot compile; ``compile_train_step`` rejects it up
  front with a ValueError (train with static shapes, the default, or freeze the position embedding).

Inductor options: unless a ``mode`` is given, every compile turns inductor's convolution-driven layout optimisation
off (it made the attention features channels-last) and adds ``UnfuseCpuBiasAdd``, a post-grad pass that splits a
linear layer's bias add off the CPU addmm into the pointwise kernel that follows it (see ``_inductor_options``).

Mixed precision: ``amp_dtype`` turns on ``torch.autocast(device_type=<the input's device type>, dtype=amp_dtype)``
inside the compiled region; the linear-attention core disables autocast itself and runs in float32.
"""
import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn
from timm.layers import Attention
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import is_pointwise_use

from .layers import LinearAttention, NoMixingAttention
from .models.linvit import check_image_size

__all__ = ['RECOMPILE_LIMIT', 'CompiledModel', 'TrainStep', 'GraphReport', 'UnfuseCpuBiasAdd', 'compile_model',
           'compile_train_step', 'check_graph_breaks', 'find_host_tensors', 'find_forward_side_effects', 'make_floor']

#: how many static shapes (graphs) one compiled model or train step may hold; dynamo's default is 8
RECOMPILE_LIMIT = 64

# modes in which inductor captures CUDA graphs for CUDA inputs
_CUDAGRAPH_MODES = ('reduce-overhead', 'max-autotune')

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_dynamic_hw(model: nn.Module) -> None:
    """ValueError if ``model`` is a timm ViT whose patch embedding would specialise H and W to constants.

    A fixed ``img_size`` checks H and W for equality; without ``dynamic_img_pad`` timm's PatchEmbed formats H and W
    into its divisibility message, which also turns them into constants. Padding skips that check (and pads
    nothing for sizes the patch divides).
    """
    patch_embed = getattr(model, 'patch_embed', None)
    if patch_embed is None:
        return
    if getattr(patch_embed, 'strict_img_size', False) or not getattr(patch_embed, 'dynamic_img_pad', True):
        raise ValueError(f"dynamic=True needs a model that takes any image size without specialising it: create it "
                         f"with dynamic_img_size=True and dynamic_img_pad=True (this one has img_size="
                         f"{tuple(patch_embed.img_size)}, strict_img_size={patch_embed.strict_img_size}, "
                         f"dynamic_img_pad={patch_embed.dynamic_img_pad}), or use dynamic=False (one static graph "
                         f"per resolution)")


def _check_dynamic_training(model: nn.Module) -> None:
    """ValueError if a dynamic-shape training step of ``model`` would crash inductor: a trainable learned position
    embedding that timm resamples per size (``dynamic_img_size``). In torch 2.14 the backward of that antialiased
    bicubic resampling has no meta kernel for symbolic sizes, so the compile fails deep inside the compiler."""
    for name, module in model.named_modules():
        pos_embed = getattr(module, 'pos_embed', None)
        resampled = getattr(module, 'dynamic_img_size', False)
        if isinstance(pos_embed, nn.Parameter) and pos_embed.requires_grad and resampled:
            where = f"{name}.pos_embed" if name else 'pos_embed'
            raise ValueError(f"a dynamic=True training step cannot compile for a model whose learned position "
                             f"embedding ({where}, resampled to each image size) is trained: in torch 2.14 the "
                             f"backward of its antialiased bicubic resampling has no symbolic-size kernel. Use "
                             f"dynamic=False (one static graph per image size), freeze it with "
                             f"{where}.requires_grad_(False), or build the model with pos_embed='none'")


def _mark_hw_dynamic(images: torch.Tensor) -> None:
    """Mark the last two dims (H, W) of ``images`` [..., H, W] dynamic for the next compiled call."""
    torch._dynamo.mark_dynamic(images, [images.dim() - 2, images.dim() - 1])


def _uses_cudagraphs(mode: Optional[str]) -> bool:
    return mode is not None and mode.startswith(_CUDAGRAPH_MODES)


class UnfuseCpuBiasAdd(CustomGraphPass):
    """Inductor post-grad pass: on CPU, ``addmm(bias, a, b)`` whose users are all pointwise becomes ``mm(a, b) + bias``.

    The CPU addmm first broadcasts the bias into its whole output and then accumulates the product onto it (beta=1):
    one extra write and read of an [N, out] buffer. Split off, the bias add fuses into the pointwise kernel that
    follows anyway (GELU after fc1, the residual add after proj and fc2), so the pass removes a full memory pass per
    linear layer; inductor already does this on GPUs. On a 2-core CPU, ViT-S fc1's bias broadcast alone took 19 ms
    per block at 16k tokens, and whole compiled ViT-S models (linvit, floor, timm softmax) ran 1-8% faster with the
    pass from 224 to 2048 px. Only float32/float64 addmm with alpha = beta = 1 and a 1-D bias is rewritten: in half
    precision the fused form rounds once instead of twice.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.find_nodes(op='call_function', target=torch.ops.aten.addmm.default)):
            if self._rewritable(node):
                bias, mat1, mat2 = node.args[:3]
                with graph.inserting_before(node):
                    product = graph.call_function(torch.ops.aten.mm.default, (mat1, mat2))
                    product.meta.update(node.meta)
                    biased = graph.call_function(torch.ops.aten.add.Tensor, (product, bias))
                    biased.meta.update(node.meta)
                node.replace_all_uses_with(biased)
                graph.erase_node(node)

    @staticmethod
    def _rewritable(node: torch.fx.Node) -> bool:
        if node.kwargs.get('alpha', 1) != 1 or node.kwargs.get('beta', 1) != 1 or len(node.args) != 3:
            return False
        out, bias = node.meta.get('val'), getattr(node.args[0], 'meta', {}).get('val')
        if not isinstance(out, torch.Tensor) or not isinstance(bias, torch.Tensor):
            return False
        if out.device.type != 'cpu' or out.dtype not in (torch.float32, torch.float64) or bias.dtype != out.dtype:
            return False
        if bias.dim() != 1 or out.dim() != 2 or bias.shape[0] != out.shape[1]:
            return False
        return bool(node.users) and all(is_pointwise_use(user) for user in node.users)

    def uuid(self) -> str:
        return 'linvit-unfuse-cpu-bias-add-v1'


_UNFUSE_CPU_BIAS_ADD = UnfuseCpuBiasAdd()


def _inductor_options(mode: Optional[str], backend: Any) -> Optional[Dict[str, Any]]:
    """Per-compile inductor options, unless a mode is given (torch.compile takes a mode or options, not both).

    - ``layout_optimization`` off: on CPU, inductor turns every 4-D intermediate channels-last as soon as a graph
      holds one convolution (the patch embedding), which laid the [B, H, N, D] attention features out with the
      heads innermost, so MKL's bmm copied them head by head. linvit asks for channels-last itself where it
      convolves (``LocalMix``). Measured in one process (ViT-S, 2-core CPU): linvit/floor 0.88x -> 0.92x at 2048 px
      without local mixing, and 0.75x -> 0.89x at 224 px with it; the floors' times did not change.
    - the CPU bias pass ``UnfuseCpuBiasAdd``, unless the user set a global post-grad pass of their own.
    """
    if backend != 'inductor' or mode is not None:
        return None
    options: Dict[str, Any] = {'layout_optimization': False}
    if inductor_config.post_grad_custom_post_pass is None:
        options['post_grad_custom_post_pass'] = _UNFUSE_CPU_BIAS_ADD
    return options


def _compile(fn: Callable, mode: Optional[str], dynamic: bool, fullgraph: bool, backend: Any) -> Callable:
    # dynamic=False compiles fully static graphs; dynamic=True leaves the choice to dynamo (None) so that only the
    # dims marked dynamic (H, W) are symbolic, rather than every dim (dynamic=True would make the batch symbolic)
    kwargs: Dict[str, Any] = dict(mode=mode, dynamic=None if dynamic else False, fullgraph=fullgraph, backend=backend,
                                  options=_inductor_options(mode, backend))
    if 'recompile_limit' in inspect.signature(torch.compile).parameters:
        kwargs['recompile_limit'] = RECOMPILE_LIMIT  # for this compiled function only (torch >= 2.10)
    else:
        config = torch._dynamo.config  # older torch: raise the global limit (never lower it)
        name = 'recompile_limit' if hasattr(config, 'recompile_limit') else 'cache_size_limit'
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    return torch.compile(fn, **kwargs)


class CompiledModel(nn.Module):
    """A model and its compiled forward; ``module`` is the eager model (same parameters), the exact reference.

    forward(images [B, C, H, W], *args, **kwargs) -> whatever ``module`` returns (e.g. logits [B, num_classes]),
    computed by the compiled graph. Grad mode is the caller's: wrap inference in ``torch.inference_mode()``.
    With a CUDA-graph mode on CUDA, an output is overwritten by the next call: clone it to keep it.
    """

    def __init__(self, model: nn.Module, mode: Optional[str] = None, dynamic: bool = False, fullgraph: bool = True,
                 backend: Any = 'inductor') -> None:
        super().__init__()
        if dynamic:
            _check_dynamic_hw(model)
        self.module = model
        self.mode = mode
        self.dynamic = dynamic
        # held outside the module tree (object.__setattr__), so parameters() and state_dict() list the model once
        object.__setattr__(self, 'compiled', _compile(model, mode, dynamic, fullgraph, backend))

    def forward(self, images: torch.Tensor, *args, **kwargs) -> Any:
        # sizes the model rejects raise its own ValueError here; inside the graph dynamo would bury it
        check_image_size(self.module, images)
        if self.dynamic:
            _mark_hw_dynamic(images)
        if _uses_cudagraphs(self.mode):
            # a new step: outputs of the previous replay may be overwritten (they are not inputs of this one)
            torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(images, *args, **kwargs)


def compile_model(model: nn.Module, mode: Optional[str] = None, dynamic: bool = False, fullgraph: bool = True,
                  backend: Any = 'inductor') -> CompiledModel:
    """Compile ``model``'s forward for inference (or any forward-only use): images [B, C, H, W] -> model output.

    mode: torch.compile's mode (None, 'reduce-overhead' for CUDA graphs on CUDA, 'max-autotune', ...). With None
        the compile also gets linvit's inductor options (no layout optimisation, the CPU bias pass); torch.compile
        takes a mode or options, not both.
    dynamic: False = one static graph per (B, H, W); True = H and W symbolic (see the module's resolution policy).
    fullgraph: True makes any graph break an error instead of a silent split.
    backend: torch.compile's backend ('inductor'; 'eager' / 'aot_eager' to debug tracing only).
    Compilation is lazy: it happens on the first call with each new shape.
    """
    return CompiledModel(model, mode=mode, dynamic=dynamic, fullgraph=fullgraph, backend=backend)


class TrainStep:
    """One training step: forward and loss as one (compiled or eager) graph, backward, optional optimizer step.

    ``step(images [B, C, H, W], targets) -> loss`` (a detached 0-dim tensor on the images' device: reading it with
    ``.item()`` syncs, so log it only every few steps). A step sets the gradients to None, computes
    ``loss_fn(model(images), targets)``, runs backward (compiled: AOTAutograd's compiled backward graph), and, with
    an optimizer, steps it (through ``grad_scaler`` when given, for float16). The model's train/eval mode is the
    caller's choice. Gradients are not accumulated across steps.

    compile: False runs the same code eagerly (the reference); True compiles ``forward_loss`` with ``fullgraph``.
    amp_dtype: None (no autocast) or torch.bfloat16 / torch.float16 (autocast on the images' device type).
    mode, dynamic, fullgraph, backend: as for ``compile_model``.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 compile: bool = False, amp_dtype: Optional[torch.dtype] = None,
                 grad_scaler: Optional[torch.amp.GradScaler] = None, mode: Optional[str] = None,
                 dynamic: bool = False, fullgraph: bool = True, backend: Any = 'inductor') -> None:
        if compile and dynamic:
            _check_dynamic_hw(model)
            _check_dynamic_training(model)
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.amp_dtype = amp_dtype
        self.grad_scaler = grad_scaler
        self.compiled = compile
        self.mode = mode
        self.dynamic = dynamic
        self._forward_loss = _compile(self.forward_loss, mode, dynamic, fullgraph, backend) if compile \
            else self.forward_loss

    def forward_loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """loss_fn(model(images), targets) under autocast(amp_dtype) when set: the graph that gets compiled."""
        with torch.autocast(device_type=images.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            return self.loss_fn(self.model(images), targets)

    def loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The (compiled) forward + loss only: a 0-dim loss with its graph, for callers that run backward and the
        optimizer themselves (gradient accumulation, clipping, DDP's no_sync). Bad image sizes raise ValueError."""
        check_image_size(self.model, images)
        if self.compiled and self.dynamic:
            _mark_hw_dynamic(images)
        if self.compiled and _uses_cudagraphs(self.mode):
            torch.compiler.cudagraph_mark_step_begin()
        return self._forward_loss(images, targets)

    def __call__(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        loss = self.loss(images, targets)
        if self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
            if self.optimizer is not None:
                self.grad_scaler.step(self.optimizer)
                self.grad_scaler.update()
        else:
            loss.backward()
            if self.optimizer is not None:
                self.optimizer.step()
        return loss.detach()


def compile_train_step(model: nn.Module, loss_fn: LossFn, optimizer: Optional[torch.optim.Optimizer] = None,
                       **kwargs) -> TrainStep:
    """``TrainStep(model, loss_fn, optimizer, compile=True, **kwargs)``: forward + loss compiled as one graph."""
    return TrainStep(model, loss_fn, optimizer, compile=True, **kwargs)


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


def _is_attention(module: nn.Module) -> bool:
    """timm's own softmax ``Attention`` (exactly: subclasses may compute something else) or a linvit LinearAttention."""
    return type(module) is Attention or isinstance(module, LinearAttention)


def make_floor(model: nn.Module) -> nn.Module:
    """Turn ``model`` into its performance floor, in place: every attention layer becomes a NoMixingAttention.

    Each timm ``Attention`` and linvit ``LinearAttention`` (softmax, linear and hybrid models alike) is replaced by
    a ``NoMixingAttention`` that reuses its qkv / norm / gate / proj / proj_drop modules (same Parameter objects),
    so the floor keeps the full projection cost and drops token mixing (and any local-mixing branch). Returns
    ``model``; ValueError if it has no such attention layer.
    """
    targets = [(name, module) for name, module in model.named_modules() if _is_attention(module)]
    if not targets:
        raise ValueError(f"make_floor found no timm Attention or linvit LinearAttention in {type(model).__name__}")
    if targets[0][0] == '':
        raise ValueError("make_floor replaces attention layers inside a model; got an attention layer itself")
    for name, attn in targets:
        qkv = attn.qkv
        # built on the meta device (no allocation); its projections are then replaced by the attention's own
        floor = NoMixingAttention(qkv.in_features, num_heads=attn.num_heads, attn_head_dim=attn.head_dim,
                                  device='meta')
        floor.attn_dim = qkv.out_features // 3
        floor.qkv, floor.norm, floor.gate, floor.proj, floor.proj_drop = \
            qkv, attn.norm, attn.gate, attn.proj, attn.proj_drop
        floor.train(attn.training)
        parent_name, _, child = name.rpartition('.')
        setattr(model.get_submodule(parent_name) if parent_name else model, child, floor)
    return model
