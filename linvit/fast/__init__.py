"""The compiled fast path: ``torch.compile(fullgraph=True)`` for inference and for a training step.

Eager PyTorch stays the default and the exact reference; this package is the one place that compiles a linvit (or
any timm ViT) model, for the tools and the training engine.

    fast_model = compile_model(model)                       # inference: images [B, 3, H, W] -> logits
    graph = LossGraph(model, loss_fn, compile=True)         # training: loss = graph(images, targets), with autograd
    report = check_graph_breaks(model, images)              # dynamo's view: graphs, breaks and their reasons

Where the code lives: ``linvit.fast.compiler`` (torch.compile with linvit's inductor options, ``CompiledModel``,
``LossGraph``) and ``linvit.fast.checks`` (the contract's checks); this package imports only torch, timm and the
layers below it. A whole compiled training step (backward, accumulation, loss scaling, the optimizer step around a
``LossGraph``) is the engine's: ``linvit.engine.compile_train_step`` (the ``train`` extra).

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
  step of a ViT with a trainable learned position embedding cannot compile; ``LossGraph`` rejects it up
  front with a ValueError (train with static shapes, the default, or freeze the position embedding).

Inductor options: unless a ``mode`` is given, every compile turns inductor's convolution-driven layout optimisation
off (it made the attention features channels-last) and adds ``UnfuseCpuBiasAdd``, a post-grad pass that splits a
linear layer's bias add off the CPU addmm into the pointwise kernel that follows it (see
``linvit.fast.compiler._inductor_options``).

Allocator (CPU): ``compile_model`` (on its first CPU call) and training steps (``LossGraph``, ``TrainStep``, eager or
compiled, on CPU) make glibc keep freed memory in the process (``retain_freed_memory``; ``linvit.fast.allocator``
says why and what it costs). Pass ``retain_freed_memory=False`` to leave the allocator as it is; thresholds set in the
environment (``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_``) are never overridden.

Mixed precision: ``amp_dtype`` turns on ``torch.autocast(device_type=<the input's device type>, dtype=amp_dtype)``
inside the compiled region; the linear-attention core disables autocast itself and runs in float32.
"""
from .allocator import retain_freed_memory
from .checks import GraphReport, check_graph_breaks, find_forward_side_effects, find_host_tensors
from .compiler import RECOMPILE_LIMIT, CompiledModel, LossFn, LossGraph, UnfuseCpuBiasAdd, compile_model

__all__ = ['RECOMPILE_LIMIT', 'CompiledModel', 'LossFn', 'LossGraph', 'GraphReport', 'UnfuseCpuBiasAdd',
           'compile_model', 'check_graph_breaks', 'find_host_tensors', 'find_forward_side_effects',
           'retain_freed_memory']
