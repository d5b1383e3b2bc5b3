"""How linvit compiles: ``torch.compile`` with linvit's inductor options, the resolution policy, and the two compiled
objects, ``CompiledModel`` (inference) and ``LossGraph`` (forward + loss of a training step).

``linvit.fast`` is the public entry and documents the contract, the resolution policy and the inductor options; this
module holds their code, so the engine's step runner (``linvit.engine.step``) builds on it without importing
``linvit.fast``'s public surface.
"""
import inspect
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn as nn
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import is_pointwise_use

from ..models.linvit import check_image_size
from .allocator import retain_freed_memory as _retain_freed_memory

__all__ = ['RECOMPILE_LIMIT', 'LossFn', 'UnfuseCpuBiasAdd', 'CompiledModel', 'compile_model', 'LossGraph']

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


def _retain_on_cpu(enabled: bool, images: torch.Tensor) -> None:
    """glibc keeps freed memory from here on (``linvit.fast.allocator``) when ``enabled`` and the images are on CPU."""
    if enabled and images.device.type == 'cpu':
        _retain_freed_memory()


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
    retain_freed_memory: on the first call with CPU images, make glibc keep freed memory in the process
    (``linvit.fast.allocator``), so calls do not refault their buffers.
    """

    def __init__(self, model: nn.Module, mode: Optional[str] = None, dynamic: bool = False, fullgraph: bool = True,
                 backend: Any = 'inductor', retain_freed_memory: bool = True) -> None:
        super().__init__()
        if dynamic:
            _check_dynamic_hw(model)
        self.module = model
        self.mode = mode
        self.dynamic = dynamic
        self.retain_freed_memory = retain_freed_memory
        # held outside the module tree (object.__setattr__), so parameters() and state_dict() list the model once
        object.__setattr__(self, 'compiled', _compile(model, mode, dynamic, fullgraph, backend))

    def forward(self, images: torch.Tensor, *args, **kwargs) -> Any:
        # sizes the model rejects raise its own ValueError here; inside the graph dynamo would bury it
        check_image_size(self.module, images)
        _retain_on_cpu(self.retain_freed_memory, images)
        if self.dynamic:
            _mark_hw_dynamic(images)
        if _uses_cudagraphs(self.mode):
            # a new step: outputs of the previous replay may be overwritten (they are not inputs of this one)
            torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(images, *args, **kwargs)


def compile_model(model: nn.Module, mode: Optional[str] = None, dynamic: bool = False, fullgraph: bool = True,
                  backend: Any = 'inductor', retain_freed_memory: bool = True) -> CompiledModel:
    """Compile ``model``'s forward for inference (or any forward-only use): images [B, C, H, W] -> model output.

    mode: torch.compile's mode (None, 'reduce-overhead' for CUDA graphs on CUDA, 'max-autotune', ...). With None
        the compile also gets linvit's inductor options (no layout optimisation, the CPU bias pass); torch.compile
        takes a mode or options, not both.
    dynamic: False = one static graph per (B, H, W); True = H and W symbolic (see ``linvit.fast``'s resolution policy).
    fullgraph: True makes any graph break an error instead of a silent split.
    backend: torch.compile's backend ('inductor'; 'eager' / 'aot_eager' to debug tracing only).
    retain_freed_memory: True makes glibc keep freed memory in the process once CPU images arrive
        (``linvit.fast.allocator.retain_freed_memory``, process-wide): without it the same compiled ViT-S at
        1024 px refaulted 0 to 61k pages per call, depending on the heap's history. False leaves the allocator alone.
    Compilation is lazy: it happens on the first call with each new shape.
    """
    return CompiledModel(model, mode=mode, dynamic=dynamic, fullgraph=fullgraph, backend=backend,
                         retain_freed_memory=retain_freed_memory)


def takes_targets(model: nn.Module) -> bool:
    """Whether ``model`` (or the module a DistributedDataParallel wraps) is called with the targets in training: a
    ``takes_targets = True`` attribute."""
    return bool(getattr(getattr(model, 'module', model), 'takes_targets', False))


class LossGraph:
    """Forward and loss of a training step as one graph, compiled or eager.

    ``graph(images [B, C, H, W], targets) -> loss``: the 0-dim ``loss_fn(model(images), targets)`` with its autograd
    graph; the caller runs backward (compiled: AOTAutograd's compiled backward graph) and the optimizer
    (``linvit.engine.step.TrainStep`` does both). Sizes the model rejects raise its own ValueError before compiled
    code runs. The model's train/eval mode is the caller's choice.

    compile: False runs the same code eagerly (the reference); True compiles ``forward_loss`` with ``fullgraph``.
    amp_dtype: None (no autocast) or torch.bfloat16 / torch.float16 (autocast on the images' device type).
    mode, dynamic, fullgraph, backend, retain_freed_memory: as for ``compile_model`` (the allocator setting holds
        for eager steps too: eager training refaults its activations and their gradients just the same).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, compile: bool = False,
                 amp_dtype: Optional[torch.dtype] = None, mode: Optional[str] = None, dynamic: bool = False,
                 fullgraph: bool = True, backend: Any = 'inductor', retain_freed_memory: bool = True) -> None:
        if compile and dynamic:
            _check_dynamic_hw(model)
            _check_dynamic_training(model)
        self.model = model
        self.loss_fn = loss_fn
        self.amp_dtype = amp_dtype
        self.compiled = compile
        self.mode = mode
        self.dynamic = dynamic
        self.retain_freed_memory = retain_freed_memory
        self._forward_loss = _compile(self.forward_loss, mode, dynamic, fullgraph, backend) if compile \
            else self.forward_loss

    def forward_loss(self, images: torch.Tensor, targets: Any) -> torch.Tensor:
        """loss_fn(model(images), targets) under autocast(amp_dtype) when set: the function that gets compiled. A
        model that computes its losses itself (``takes_targets``: torchvision's detectors) is called with the
        targets too, and loss_fn reduces what it returns."""
        with torch.autocast(device_type=images.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            outputs = self.model(images, targets) if takes_targets(self.model) else self.model(images)
            return self.loss_fn(outputs, targets)

    def __call__(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        check_image_size(self.model, images)
        # a model that takes targets (torchvision's detectors) allocates data-dependent shapes every step: a heap that
        # is never trimmed fragments and grows without bound there (Mask R-CNN on a 2-core CPU: 1.3 GB -> 5.1 GB in
        # 12 steps, against a steady 1.3 GB with glibc's defaults), so glibc keeps its defaults for it
        _retain_on_cpu(self.retain_freed_memory and not takes_targets(self.model), images)
        if self.compiled and self.dynamic:
            _mark_hw_dynamic(images)
        if self.compiled and _uses_cudagraphs(self.mode):
            torch.compiler.cudagraph_mark_step_begin()
        return self._forward_loss(images, targets)
