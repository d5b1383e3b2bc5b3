"""What tools/bench_distributed.py measures: training steps of one model over several processes, per rank, for
context parallelism (``linvit.models.context``: one image's patch rows over ``context`` ranks) and for DDP against
FSDP2, with timm's softmax ViT on one process as the comparison.

    configs = plan(DistBench(model=parse_model_spec('linvit_small_patch16_224'), img_size=2048, contexts=(1, 2, 4)))
    rows = [row for config in configs for row in launch(config)]      # one dict per rank and configuration
    print(report(rows))                                               # markdown tables, ratios in the same run

Every configuration runs in processes of its own (``torch.multiprocessing`` spawn, gloo on CPU, nccl on CUDA), so
that each rank's peak memory is its own. A rank builds the model (the same seed everywhere), takes one counted
warm-up step (forward, loss, backward, AdamW step), then ``steps`` timed steps. Per rank it records:

- ``act_mib``: the bytes of the tensors autograd saved for backward during the counted forward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once by its address and its whole size (a
  saved view keeps its whole storage alive), parameters and their views left out. It is exact and does not depend
  on the allocator, unlike the process's resident memory.
- ``peak_mib``: the peak of the timed steps (``linvit.bench.memory.MemoryWatch``: RSS on CPU, tensors allocated by
  torch on CUDA), which includes the model, gradients, optimizer state and the allocator's slack.
- ``step_ms``: the median over the timed steps of forward + loss + backward + optimizer step, the ranks starting
  together (a barrier before each step).
- ``comm``: the bytes of every collective the counted step made, by category and phase, seen by a
  ``TorchDispatchMode`` at the ``c10d`` operators every eager collective goes through (all-reduce, send / recv,
  FSDP's all-gather and reduce-scatter, DDP's bucket all-reduce alike). ``payload`` is the tensor a collective is
  about (the all-reduced tensor, a sent halo, the gathered parameters, the gradients reduce-scattered); ``wire`` the
  bytes each rank sends with the ring algorithms (all-reduce 2 (p - 1) / p of the payload, all-gather and
  reduce-scatter (p - 1) / p, a send all of it).
- ``opt_mib``: the optimizer state this rank holds (its state tensors' local bytes; a DTensor's local shard).

Categories: ``state`` (the attention state all-reduce of every layer, forward and backward), ``pool`` (the
classifier's pooled token), ``halo`` (patch rows sent to the neighbouring ranks for the local-mix convolution),
``head_halo`` (the backbone rows the segmentation pyramid and head read from the neighbours), ``grads`` (DDP's bucket
all-reduce, FSDP's reduce-scatter), ``params`` (FSDP's all-gathers), ``other``. The forward's labels come from the
bench's own wrappers around this run's ``RowShards`` and ``ContextParallel`` objects (never the library's code); a
backward collective of the context group is the gradient of a forward one, of the same size, and takes its label.
"""
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..models import SegmentationModel
from ..models.context import ContextParallel, RowShards
from .memory import MemoryWatch
from .specs import ModelSpec

__all__ = ['TASKS', 'SYNCS', 'DistBench', 'DistConfig', 'plan', 'launch', 'report', 'CommCounter',
           'SavedTensorBytes', 'state_allreduce_bytes', 'ring_kv_bytes', 'cp_skip_reason', 'softmax_spec',
           'default_threads']

TASKS = ('cls', 'seg')
#: how the sync sweep keeps replicas equal: DDP (gradients all-reduced) or FSDP2 (``fully_shard`` per block and root)
SYNCS = ('ddp', 'fsdp')
#: bytes per element: the bench runs float32, and the attention state is float32 whatever the inputs
FLOAT_BYTES = 4
SEG_CLASSES = 11
#: every rank of a step waits for the others; a 2048 px step on few cores takes minutes
_TIMEOUT = timedelta(minutes=60)


@dataclass(frozen=True)
class DistBench:
    """The whole sweep of the command line: ``contexts`` (world = context), ``syncs`` at ``sync_world`` ranks and
    context 1, ``softmax`` (a timm model at context 1 on one process; None: none)."""
    model: ModelSpec
    img_size: int = 2048
    batch: int = 1
    task: str = 'cls'
    contexts: Sequence[int] = (1, 2, 4)
    syncs: Sequence[str] = SYNCS
    sync_world: int = 2
    softmax: Optional[ModelSpec] = None
    steps: int = 3
    threads: Optional[int] = None  # per process; None: default_threads(world)
    device: str = 'cpu'


@dataclass(frozen=True)
class DistConfig:
    """One configuration: ``world`` processes, each image over ``context`` of them, gradients kept equal by
    ``sync`` ('none' on one process, 'ddp' or 'fsdp')."""
    sweep: str  # 'context', 'sync' or 'softmax': which table it belongs to
    model: ModelSpec
    img_size: int
    batch: int
    task: str
    context: int
    world: int
    sync: str
    steps: int
    threads: int
    device: str

    @property
    def label(self) -> str:
        return f"{self.model.name} {self.task} context={self.context} world={self.world} {self.sync}"


def default_threads(world: int) -> int:
    """torch threads per process: the cores this process may use, shared by ``world`` processes, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
    return max(1, cores // world)


def plan(bench: DistBench) -> List[DistConfig]:
    """The configurations of ``bench`` in the order they run: the context sweep (DDP over the context ranks, as a
    run with ``parallel.context`` and one data replica syncs them), the sync sweep, then the softmax model."""
    def config(sweep: str, model: ModelSpec, context: int, world: int, sync: str) -> DistConfig:
        return DistConfig(sweep, model, bench.img_size, bench.batch, bench.task, context, world, sync, bench.steps,
                          bench.threads or default_threads(world), bench.device)

    configs = [config('context', bench.model, c, c, 'ddp' if c > 1 else 'none') for c in bench.contexts]
    configs += [config('sync', bench.model, 1, bench.sync_world, sync) for sync in bench.syncs]
    if bench.softmax is not None:
        configs.append(config('softmax', bench.softmax, 1, 1, 'none'))
    return configs


def softmax_spec(linvit: ModelSpec, text: Optional[str]) -> Optional[ModelSpec]:
    """The softmax model of ``--softmax``: 'auto' is vit_<rest> for linvit_<rest> with those of the linvit spec's
    keyword arguments that timm's VisionTransformer takes (depth, patch_size, ...); 'none' / None: no softmax row."""
    import inspect

    from timm.models.vision_transformer import VisionTransformer

    from .specs import parse_model_spec

    if text in (None, 'none'):
        return None
    if text != 'auto':
        return parse_model_spec(text)
    name = 'vit_' + linvit.name.split('_', 1)[1]
    known = inspect.signature(VisionTransformer.__init__).parameters
    kwargs = tuple((k, v) for k, v in linvit.kwargs if k in known)
    spec = name + (':' + ','.join(f"{k}={v!r}" for k, v in kwargs) if kwargs else '')
    return ModelSpec(spec, name, kwargs)


# ---------------------------------------------------------------------------------------------------- the formulas

def state_allreduce_bytes(batch: int, heads: int, head_dim: int, value_dim: Optional[int] = None) -> int:
    """Bytes of one layer's attention state all-reduce, forward and backward together: the state [B, H, Dv + 1, D]
    and the count [B, H], float32, once each way: 2 x 4 x (B H (Dv + 1) D + B H)."""
    value_dim = head_dim if value_dim is None else value_dim
    return 2 * FLOAT_BYTES * (batch * heads * (value_dim + 1) * head_dim + batch * heads)


def ring_kv_bytes(context: int, batch: int, tokens: int, heads: int, head_dim: int) -> float:
    """Bytes one rank sends per layer in ring attention over ``context`` ranks, forward and backward together: the
    forward passes its K and V block on (context - 1) times, (context - 1) x 2 x B x N_local x H x D x 4 bytes with
    N_local = tokens / context; the backward moves K, V and their gradients dK, dV, twice that."""
    forward = (context - 1) * 2 * batch * (tokens / context) * heads * head_dim * FLOAT_BYTES
    return 3 * forward


def cp_skip_reason(device: str) -> str:
    """Why PyTorch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``: ring attention
    over SDPA) has no row in this run."""
    if device.startswith('cuda'):
        return ("PyTorch context parallelism: not run; this tool does not yet wire timm's ViT into "
                "context_parallel's ring attention (its token buffers are made inside forward)")
    return ("PyTorch context parallelism: skipped on CPU; context_parallel's ring attention replaces only the CUDA "
            "SDPA kernels (flash, efficient, cudnn), and SDPA on CPU runs _scaled_dot_product_flash_attention_for_cpu")


# ------------------------------------------------------------------------------------------------ counting tools

class SavedTensorBytes:
    """Bytes of the storages autograd saves for backward while active (``with counter:`` around a forward). Each
    storage counts once, whole; the storages of ``module``'s parameters (and of their views: a transposed weight)
    are not activations and are left out, looked up when a tensor is saved, since FSDP2 registers unsharded
    parameters of fresh storage for the forward of each block."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.storages: Dict[Tuple[str, int], int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, nn.Parameter) or tensor.device.type == 'meta':
            return tensor
        ptr = _storage_ptr(tensor)
        if ptr is not None and ptr not in self._param_storages():
            self.storages[(str(tensor.device), ptr)] = tensor.untyped_storage().nbytes()
        return tensor

    def _param_storages(self) -> set:
        return {_storage_ptr(_local(p)) for p in self.module.parameters()}

    def __enter__(self) -> 'SavedTensorBytes':
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _storage_ptr(tensor: torch.Tensor) -> Optional[int]:
    """The address of the tensor's storage; None for a subclass without one, or FSDP's freed unsharded storage."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2's parameters and optimizer state), else the tensor."""
    return tensor.to_local() if hasattr(tensor, 'to_local') else tensor


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a c10d operator's argument (a tensor or nested lists of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


@dataclass
class CommRecord:
    """One collective: its category, phase ('forward', 'backward', 'optimizer'), c10d operator, payload and the
    bytes this rank puts on the wire with the ring algorithm."""
    category: str
    phase: str
    op: str
    payload: int
    wire: float


class CommCounter(TorchDispatchMode):
    """Records every ``c10d`` operator run while active (see the module docstring for the categories). ``label``
    names the collectives made inside it (the outermost label wins); ``phase`` is set by the step."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.records: List[CommRecord] = []
        self.phase = 'forward'
        self._labels: List[str] = []
        self._forward_sizes: Dict[Tuple[str, int], str] = {}

    @contextmanager
    def label(self, category: str) -> Iterator[None]:
        self._labels.append(category)
        try:
            yield
        finally:
            self._labels.pop()

    def labelled(self, category: str, fn: Callable) -> Callable:
        """``fn`` whose collectives count as ``category``."""
        def wrapper(*args, **kwargs):
            with self.label(category):
                return fn(*args, **kwargs)
        return wrapper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == 'c10d':
            self._record(func.__name__.split('.')[0], args)
        return func(*args, **(kwargs or {}))

    def _record(self, op: str, args: Sequence[Any]) -> None:
        p = self.world
        if op in ('_allgather_base_', 'allgather_into_tensor_coalesced'):
            category, payload, wire = 'params', _nbytes(args[0]), _nbytes(args[0]) * (p - 1) / p
        elif op in ('_reduce_scatter_base_', 'reduce_scatter_tensor_coalesced'):
            category, payload, wire = 'grads', _nbytes(args[1]), _nbytes(args[1]) * (p - 1) / p
        elif op in ('send', 'recv_', 'allreduce_'):
            category, payload = None, _nbytes(args[0])
            # a rank's received bytes are its peers' sent ones
            wire = {'send': payload, 'recv_': 0.0, 'allreduce_': 2 * (p - 1) / p * payload}[op]
            op = op.rstrip('_')
        else:
            category, payload = 'other', _nbytes(args[0]) if args else 0
            wire = float(payload)
        if category is None:
            category = self._context_category(op, sum(t.numel() for t in _tensors(args[0])))
        self.records.append(CommRecord(category, self.phase, op, payload, wire))

    def _context_category(self, op: str, numel: int) -> str:
        """The label of an all-reduce, send or receive: its own in the forward; in the backward, that of the forward
        collective it is the gradient of (an all-reduce's gradient has its size; a halo's sent gradient is the size
        of the rows received in the forward, and the other way round)."""
        if self.phase == 'forward':
            # the context forward's only collective outside the labelled methods: the classifier's pooled token
            category = self._labels[0] if self._labels else 'pool' if op == 'allreduce' else 'other'
            twin = {'send': 'recv', 'recv': 'send'}.get(op, op)
            self._forward_sizes[(twin, numel)] = category
            return category
        if self._labels:  # DDP's comm hook
            return self._labels[0]
        return self._forward_sizes.get((op, numel), 'other')

    def summary(self) -> Dict[str, Dict[str, float]]:
        """{category: {'payload', 'wire', 'forward_calls', 'backward_calls'}} over the records (sends only for
        halos' payload: what this rank sent)."""
        out: Dict[str, Dict[str, float]] = {}
        for r in self.records:
            entry = out.setdefault(r.category, {'payload': 0, 'wire': 0.0, 'forward_calls': 0, 'backward_calls': 0})
            entry['payload'] += r.payload if r.op != 'recv' else 0
            entry['wire'] += r.wire
            if r.phase in ('forward', 'backward') and r.op != 'recv':
                entry[f"{r.phase}_calls"] += 1
        return out


# ------------------------------------------------------------------------------------------------- one rank's step

@dataclass
class _Rig:
    """What a rank steps: the module called on images, the optimizer, its own loss part, and the attention geometry
    of the model (for the formulas)."""
    module: nn.Module
    optimizer: torch.optim.Optimizer
    loss_part: Callable[[torch.Tensor], torch.Tensor]  # logits -> this rank's part of the batch loss
    heads: int = 0
    head_dim: int = 0
    layers: int = 0
    tokens: int = 0
    params: List[torch.Tensor] = field(default_factory=list)


def _device(config: DistConfig, rank: int) -> torch.device:
    if config.device.startswith('cuda'):
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device('cuda', torch.cuda.current_device())
    return torch.device(config.device)


def _build_model(config: DistConfig, device: torch.device) -> nn.Module:
    """The model of ``config`` on ``device``, the same weights on every rank (seed 0)."""
    torch.manual_seed(0)
    kwargs = dict(config.model.kwargs)
    kwargs.update(img_size=config.img_size, dynamic_img_size=True)
    if config.task == 'seg':
        backbone = timm.create_model(config.model.name, num_classes=0, **kwargs)
        model = SegmentationModel(backbone, SEG_CLASSES)
    else:
        model = timm.create_model(config.model.name, **kwargs)
    return model.to(device).train()


def _batch(config: DistConfig, data_rank: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Images [B, 3, S, S] and targets ([B] classes or [B, S, S] pixel classes) of one data rank (the context ranks
    of an image share it)."""
    generator = torch.Generator().manual_seed(1000 + data_rank)
    size, batch = config.img_size, config.batch
    images = torch.randn(batch, 3, size, size, generator=generator)
    classes = SEG_CLASSES if config.task == 'seg' else 1000
    shape = (batch, size, size) if config.task == 'seg' else (batch,)
    targets = torch.randint(0, classes, shape, generator=generator)
    return images.to(device), targets.to(device)


def _loss_part(config: DistConfig, module: nn.Module, images: torch.Tensor,
               targets: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """logits -> this rank's part of the loss: parts summed over the context ranks make the image's loss (a
    classifier's equal shares; segmentation: the rank's own pixels over all pixels)."""
    if config.task == 'seg' and isinstance(module, ContextParallel):
        y0, y1 = module.pixel_rows(images)
        return lambda logits: F.cross_entropy(logits, targets[:, y0:y1], reduction='sum') / targets.numel()
    return lambda logits: F.cross_entropy(logits, targets) / config.context


def _attention_geometry(model: nn.Module, img_size: int) -> Dict[str, int]:
    """heads, head_dim, the attention layers a forward runs and the tokens of one image (patches + prefix)."""
    backbone = model.backbone if isinstance(model, SegmentationModel) else model
    attn = backbone.blocks[0].attn
    heads = attn.num_heads
    patch = backbone.patch_embed.patch_size
    grid = math.ceil(img_size / patch[0]) * math.ceil(img_size / patch[1])
    layers = max(model.take_blocks) + 1 if isinstance(model, SegmentationModel) else len(backbone.blocks)
    return dict(heads=heads, head_dim=getattr(attn, 'head_dim', 0), layers=layers,
                tokens=grid + backbone.num_prefix_tokens)


def _sync(module: nn.Module, config: DistConfig, device: torch.device, counter: CommCounter) -> nn.Module:
    """``module`` wrapped as ``config.sync`` says: DDP (its bucket all-reduces labelled 'grads') or FSDP2."""
    if config.sync == 'fsdp':  # as train.py's parallel.fsdp=true wraps it
        from torch.distributed.device_mesh import init_device_mesh

        from ..engine.parallel import Layout, parallel_module
        mesh = init_device_mesh(device.type, (1, config.world), mesh_dim_names=('context', 'data'))
        layout = Layout(world=config.world, context=1, data=config.world, data_rank=dist.get_rank(),
                        shards=RowShards(None), mesh=mesh, fsdp=True, checkpoint_every=0)
        return parallel_module(module, layout, None, device)
    if config.sync == 'ddp' and config.world > 1:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        def counted_allreduce(state: dist.ProcessGroup,
                              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            # DDP's own all-reduce, labelled; DDP checks a hook's parameter names and return annotation
            with counter.label('grads'):
                return allreduce_hook(state, bucket)

        ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == 'cuda' else None)
        ddp.register_comm_hook(dist.group.WORLD, counted_allreduce)
        return ddp
    return module


def _rig(config: DistConfig, rank: int, device: torch.device, counter: CommCounter) -> Tuple[_Rig, torch.Tensor]:
    """The rank's model, wrapped, its optimizer and loss, and its images."""
    model = _build_model(config, device)
    module: nn.Module = model
    if config.context > 1:
        shards = RowShards(dist.group.WORLD)
        # the bench's own labels on this run's objects, the outermost winning; the library's code is untouched
        shards.reduce_state = counter.labelled('state', shards.reduce_state)
        shards.exchange_rows = counter.labelled('halo', shards.exchange_rows)
        module = ContextParallel(model, shards)
        module._segment = counter.labelled('head_halo', module._segment)
    images, targets = _batch(config, rank // config.context, device)
    loss_part = _loss_part(config, module, images, targets)
    wrapped = _sync(module, config, device, counter)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    rig = _Rig(wrapped, optimizer, loss_part, params=list(wrapped.parameters()),
               **_attention_geometry(model, config.img_size))
    return rig, images


def _step(rig: _Rig, images: torch.Tensor, world: int, counter: Optional[CommCounter] = None,
          saved: Optional[SavedTensorBytes] = None) -> float:
    """One training step; returns this rank's loss part. Gradients are averaged over the world by DDP / FSDP, so
    the rank backpropagates its part times the world: the average is then the gradient of the summed parts."""
    def phase(name: str) -> None:
        if counter is not None:
            counter.phase = name

    phase('forward')
    with saved or nullcontext():
        logits = rig.module(images)
    part = rig.loss_part(logits)
    phase('backward')
    (part * world).backward()
    phase('optimizer')
    rig.optimizer.step()
    rig.optimizer.zero_grad(set_to_none=True)
    return part.item()


def _local_bytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state this rank holds (AdamW: exp_avg, exp_avg_sq, step), DTensors by their shard."""
    return sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def _sync_device(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def measure(config: DistConfig, rank: int, device: torch.device) -> Dict[str, Any]:
    """This rank's row for ``config`` (module docstring): one counted warm-up step, then ``steps`` timed ones."""
    counter = CommCounter(config.world)
    rig, images = _rig(config, rank, device, counter)
    watch = MemoryWatch(device)
    watch.start()
    saved = SavedTensorBytes(rig.module)
    with counter:
        losses = [_step(rig, images, config.world, counter, saved)]
    watch.steady()
    times = []
    for _ in range(config.steps):
        dist.barrier()
        _sync_device(device)
        start = time.perf_counter()
        losses.append(_step(rig, images, config.world))
        _sync_device(device)
        times.append(time.perf_counter() - start)
    mem = watch.result()
    return dict(asdict(config), model=config.model.spec, rank=rank, act_mib=saved.bytes / 2 ** 20,
                peak_mib=mem['peak_mem_mib'], step_ms=1e3 * statistics.median(times) if times else None,
                opt_mib=_optimizer_bytes(rig.optimizer) / 2 ** 20,
                param_mib=sum(_local_bytes(p) for p in rig.params) / 2 ** 20, losses=losses,
                comm=counter.summary(), heads=rig.heads, head_dim=rig.head_dim, layers=rig.layers,
                tokens=rig.tokens)


# ------------------------------------------------------------------------------------------------------- processes

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _worker(rank: int, config: DistConfig, port: int, out_dir: str) -> None:
    """One rank of ``config``: joins the process group, measures, writes its row to out_dir/rank<r>.json."""
    torch.set_num_threads(config.threads)
    # the depthwise local-mix weight [C, 1, k, k]: its gradient's stride differs from DDP's bucket view only on the
    # size-1 dimension, the same memory layout, about which DDP warns once per rank
    warnings.filterwarnings('ignore', message='Grad strides do not match bucket view strides')
    device = _device(config, rank)
    backend = 'nccl' if device.type == 'cuda' else 'gloo'
    dist.init_process_group(backend, init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=config.world,
                            timeout=_TIMEOUT)
    try:
        row = measure(config, rank, device)
        with open(os.path.join(out_dir, f'rank{rank}.json'), 'w') as f:
            json.dump(row, f)
    finally:
        dist.destroy_process_group()


def launch(config: DistConfig) -> List[Dict[str, Any]]:
    """The rows of every rank of ``config``, measured in ``config.world`` fresh processes; one row with ``error``
    (the failure's last line) and ``traceback`` (the failed rank's) when a rank failed."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix='bench_distributed_') as out_dir:
        try:
            mp.spawn(_worker, args=(config, _free_port(), out_dir), nprocs=config.world, join=True)
        except Exception as exc:  # a failed configuration is a row of the table, not the end of the sweep
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            return [dict(asdict(config), model=config.model.spec, rank=0, error=last, traceback=str(exc))]
        rows = []
        for rank in range(config.world):
            with open(os.path.join(out_dir, f'rank{rank}.json')) as f:
                rows.append(json.load(f))
    return rows


# ---------------------------------------------------------------------------------------------------------- report

def _mib(value: Optional[float]) -> str:
    return '-' if value is None else f"{value:.1f}"


def _ratio(value: Optional[float], base: Optional[float]) -> str:
    return '-' if value is None or not base else f"{value / base:.2f}"


def _comm(row: Dict[str, Any], category: str, key: str = 'payload') -> float:
    return row.get('comm', {}).get(category, {}).get(key, 0)


def _group(rows: Sequence[Dict[str, Any]]) -> Dict[Tuple, List[Dict[str, Any]]]:
    """Rows by configuration (sweep, model, context, world, sync), in the order they ran."""
    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row['sweep'], row['model'], row['context'], row['world'], row['sync']), []).append(row)
    return groups


def _worst(ranks: Sequence[Dict[str, Any]], key: str) -> Optional[float]:
    """The largest value of ``key`` over the ranks: a step is as slow, and a machine must be as large, as its
    worst rank."""
    values = [r[key] for r in ranks if r.get(key) is not None]
    return max(values) if values else None


def _per_layer(ranks: Sequence[Dict[str, Any]], category: str) -> Optional[float]:
    """Bytes of ``category`` per attention layer, forward + backward, of the rank that sent the most."""
    first = ranks[0]
    if not first.get('layers'):
        return None
    return max(_comm(r, category) for r in ranks) / first['layers']


def _context_line(ranks: Sequence[Dict[str, Any]], base: Optional[Dict[str, Any]]) -> str:
    first = ranks[0]
    if 'error' in first:
        return f"| {first['context']} | {first['world']} | failed: {first['error']} |"
    act, step = _worst(ranks, 'act_mib'), _worst(ranks, 'step_ms')
    b, h, d, c = first['batch'], first['heads'], first['head_dim'], first['context']
    formula = state_allreduce_bytes(b, h, d) if c > 1 else 0
    ring = ring_kv_bytes(c, b, first['tokens'], h, d)
    cells = [c, first['world'], _mib(act), _ratio(act, base and base['act']), _mib(_worst(ranks, 'peak_mib')),
             _mib(step), _ratio(step, base and base['step']), f"{_per_layer(ranks, 'state') or 0:.0f}",
             f"{formula:.0f}", f"{_per_layer(ranks, 'halo') or 0:.0f}", f"{ring:.0f}",
             _mib(max(_comm(r, 'head_halo') for r in ranks) / 2 ** 20),
             _mib(max(_comm(r, 'grads', 'wire') for r in ranks) / 2 ** 20),
             _mib(max(sum(v['wire'] for v in r.get('comm', {}).values()) for r in ranks) / 2 ** 20)]
    return '| ' + ' | '.join(map(str, cells)) + ' |'


CONTEXT_HEADER = ('| context | ranks | act MiB/rank | act / ctx1 | peak MiB/rank | step ms | step / ctx1 | '
                  'state B/layer | formula B/layer | halo B/layer | ring K/V B/layer | head halo MiB | '
                  'grads wire MiB | all wire MiB |')
SYNC_HEADER = ('| sync | ranks | step ms | step / ddp | opt-state MiB/rank | opt / ddp | param MiB/rank | '
               'act MiB/rank | peak MiB/rank | params wire MiB | grads wire MiB | loss after steps | loss - ddp |')


def _context_table(groups: Dict[Tuple, List[Dict[str, Any]]]) -> List[str]:
    lines = [CONTEXT_HEADER, '|' + '---|' * (CONTEXT_HEADER.count('|') - 1)]
    base = None
    for key, ranks in groups.items():
        if key[0] != 'context':
            continue
        if key[2] == 1 and 'error' not in ranks[0]:
            base = {'act': _worst(ranks, 'act_mib'), 'step': _worst(ranks, 'step_ms')}
        lines.append(_context_line(ranks, base))
    return lines


def _summed_loss(ranks: Sequence[Dict[str, Any]]) -> float:
    """The last step's loss: the ranks' parts summed, over the data replicas averaged (the objective DDP and FSDP
    average the gradients of)."""
    first = ranks[0]
    replicas = first['world'] // first['context']
    return sum(r['losses'][-1] for r in ranks) / replicas


def _sync_table(groups: Dict[Tuple, List[Dict[str, Any]]]) -> List[str]:
    lines = [SYNC_HEADER, '|' + '---|' * (SYNC_HEADER.count('|') - 1)]
    base = None
    for key, ranks in groups.items():
        if key[0] != 'sync':
            continue
        first = ranks[0]
        if 'error' in first:
            lines.append(f"| {first['sync']} | {first['world']} | failed: {first['error']} |")
            continue
        step, opt, loss = _worst(ranks, 'step_ms'), _worst(ranks, 'opt_mib'), _summed_loss(ranks)
        if first['sync'] == 'ddp':
            base = {'step': step, 'opt': opt, 'loss': loss}
        delta = f"{loss - base['loss']:.2e}" if base else '-'
        cells = [first['sync'], first['world'], _mib(step), _ratio(step, base and base['step']), _mib(opt),
                 _ratio(opt, base and base['opt']), _mib(_worst(ranks, 'param_mib')), _mib(_worst(ranks, 'act_mib')),
                 _mib(_worst(ranks, 'peak_mib')), _mib(max(_comm(r, 'params', 'wire') for r in ranks) / 2 ** 20),
                 _mib(max(_comm(r, 'grads', 'wire') for r in ranks) / 2 ** 20), f"{loss:.6f}", delta]
        lines.append('| ' + ' | '.join(map(str, cells)) + ' |')
    return lines


def _softmax_lines(groups: Dict[Tuple, List[Dict[str, Any]]]) -> List[str]:
    """The softmax model's row against context 1 of the linvit model."""
    base = next((r[0] for k, r in groups.items() if k[0] == 'context' and k[2] == 1 and 'error' not in r[0]), None)
    lines = []
    for key, ranks in groups.items():
        if key[0] != 'softmax':
            continue
        row = ranks[0]
        if 'error' in row:
            lines.append(f"- softmax {row['model']}: failed: {row['error']}")
            continue
        lines.append(f"- softmax {row['model']} on one process: act {_mib(row['act_mib'])} MiB "
                     f"({_ratio(row['act_mib'], base and base['act_mib'])} x linvit context 1), peak "
                     f"{_mib(row['peak_mib'])} MiB, step {_mib(row['step_ms'])} ms "
                     f"({_ratio(row['step_ms'], base and base['step_ms'])} x linvit context 1)")
    return lines


def report(rows: Sequence[Dict[str, Any]], device: str = 'cpu') -> str:
    """Markdown: the context sweep's table, the sync sweep's, the softmax comparison, and the formulas."""
    groups = _group(rows)
    sweeps = {key[0] for key in groups}
    out: List[str] = []
    if 'context' in sweeps:
        out += ['### Context parallelism (DDP over the context ranks)', '', *_context_table(groups), '']
    if 'sync' in sweeps:
        out += ['### DDP vs FSDP2 (context 1)', '', *_sync_table(groups), '']
    out += ['### Comparisons', '', *_softmax_lines(groups), f"- {cp_skip_reason(device)}", '',
            'act: bytes saved for backward (per storage, parameters left out); peak: RSS (CPU) or allocated '
            '(CUDA) of the timed steps; step: median ms of forward + backward + AdamW step, worst rank; B/layer: '
            'bytes per attention layer, forward + backward, payload of the rank that sent the most; formula: '
            '2 x 4 x (B H (Dv + 1) D + B H); ring K/V: 3 x (context - 1) x 2 x B x (N / context) x H x D x 4 '
            '(forward K, V; backward K, V, dK, dV); wire: bytes a rank sends with ring algorithms.']
    return '\n'.join(out)

