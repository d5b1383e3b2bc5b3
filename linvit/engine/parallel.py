"""How a run uses its processes: the ``parallel`` config section, the device mesh, and the module the step runs.

    parallel:
      context: 2           # ranks per image: each image's patch rows split over them (linvit.models.context)
      fsdp: true           # FSDP2: parameters, gradients and optimizer state sharded over the data ranks
      checkpoint_every: 1  # activation checkpointing: every k-th block recomputes its activations in backward

The world (torchrun's processes) is a ``DeviceMesh`` of shape (context, data): the data dimension is what remains of
the world size, and rank = context index x data + data index, so the ranks of one FSDP shard group are neighbours
(one node's GPUs) and the context groups, whose traffic is only the attention states and the halos, span them.

- ``context`` > 1: the model runs as ``ContextParallel``; each context group sees the same batches (the sampler and
  the per-rank random streams follow the data index), the state all-reduce and halos run on groups of their own.
- gradients are averaged over the whole world (DDP over all ranks, or FSDP2 / HSDP over the mesh). A rank's loss is
  therefore its part of its image's loss times the context size (``context_loss``): the averaged gradient is the
  one-process gradient of the data ranks' mean loss.
- ``fsdp``: ``fully_shard`` on every block and at the root (HSDP: replicated over the context dimension, sharded
  over the data one), bfloat16 parameters with float32 reductions under train.precision=bfloat16. Checkpoints save
  the sharded model and optimizer with ``torch.distributed.checkpoint`` (``save_sharded``), which loads at any world
  size; last.pt / best.pt / model.safetensors hold the consolidated weights as for any run.
- ``checkpoint_every``: non-reentrant ``torch.utils.checkpoint`` around every k-th block (the ``ContextBlock`` ones
  under context parallelism), inside FSDP's wrapping, as PyTorch's FSDP recipes order them.
"""
import logging
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig

from ..models import SegmentationModel
from ..models.context import ContextParallel, RowShards, context_unsupported_reason
from .config import ConfigError, config_section
from .distributed import DistInfo

__all__ = ['ParallelConfig', 'Layout', 'plan_layout', 'parallel_module', 'context_loss', 'checkpointed_blocks',
           'save_sharded', 'load_sharded', 'full_weights']

_logger = logging.getLogger('linvit.train')


@dataclass
class ParallelConfig:
    context: int = 1  # processes per image: its patch rows split over them (1: each process sees whole images)
    fsdp: bool = False  # shard parameters, gradients and optimizer state over the data processes (FSDP2)
    checkpoint_every: int = 0  # activation checkpointing of every k-th block (0: off, 1: every block)


config_section('parallel', ParallelConfig)


@dataclass(frozen=True)
class Layout:
    """This process's place in the run's mesh."""
    world: int
    context: int  # ranks per image
    data: int  # world // context: data-parallel replicas
    data_rank: int  # which batches this rank draws (the same for a context group)
    shards: RowShards  # its context group (alone when context == 1)
    mesh: Optional[object]  # the DeviceMesh (context, data); None on one process
    fsdp: bool
    checkpoint_every: int

    def describe(self) -> str:
        """'mesh context=2 x data=1 over 2 processes (DDP; activation checkpointing every block)'."""
        sync = ('HSDP (replicated over context, sharded over data)' if self.fsdp and self.context > 1 else
                'FSDP2 over data' if self.fsdp else 'DDP' if self.world > 1 else 'one process')
        every = self.checkpoint_every
        ac = '' if not every else f"; activation checkpointing every {'' if every == 1 else f'{every}th '}block"
        return f"mesh context={self.context} x data={self.data} over {self.world} process(es) ({sync}{ac})"


def check_layout(cfg: DictConfig, world: int, model: nn.Module, logits_rank: int) -> None:
    """ConfigError (one line) for a ``parallel`` section these processes and this model cannot run."""
    par = cfg.parallel
    if par.context < 1 or par.checkpoint_every < 0:
        raise ConfigError(f"parallel.context must be >= 1 and parallel.checkpoint_every >= 0, got "
                          f"context={par.context}, checkpoint_every={par.checkpoint_every}")
    if world % par.context:
        raise ConfigError(f"parallel.context={par.context} does not divide the {world} process(es) (torchrun "
                          f"--nnodes x --nproc_per_node): use a divisor of {world}")
    if par.context > 1:
        _check_context(cfg, model, logits_rank)
    if par.fsdp and cfg.train.ema:
        raise ConfigError("parallel.fsdp=true does not keep an EMA copy yet: set train.ema=false")
    if (par.fsdp or par.checkpoint_every) and _blocks_of(model) is None:
        raise ConfigError(f"parallel.fsdp and parallel.checkpoint_every wrap a model's blocks; model.name="
                          f"{cfg.model.name!r} has no 'blocks' list")


def _check_context(cfg: DictConfig, model: nn.Module, logits_rank: int) -> None:
    par = cfg.parallel
    if logits_rank not in (2, 4):  # the task first: its model (a detector, ...) is no ViT the split could take
        raise ConfigError(f"parallel.context={par.context}: context parallelism of task={cfg.task!r} (its model "
                          f"{type(model).__name__}) is not supported; it splits each image's patch rows and the "
                          f"per-image loss of classification or the per-pixel loss of segmentation over the "
                          f"processes: use parallel.context=1 (the processes then share the data)")
    reason = context_unsupported_reason(model)
    if reason is not None:
        raise ConfigError(f"parallel.context={par.context} cannot split model.name={cfg.model.name!r}: {reason}")
    backbone = model.backbone if isinstance(model, SegmentationModel) else model
    rows = cfg.data.img_size // backbone.patch_embed.patch_size[0]
    if par.context > rows:
        raise ConfigError(f"parallel.context={par.context} is more processes than the {rows} patch rows of "
                          f"data.img_size={cfg.data.img_size}: use at most {rows}")
    if cfg.get('seg') is not None and logits_rank == 4 and cfg.seg.dice_weight > 0:
        raise ConfigError(f"parallel.context={par.context} splits the loss over pixels; the dice term of "
                          f"seg.dice_weight={cfg.seg.dice_weight} is not split yet: set seg.dice_weight=0")
    if cfg.train.compile:
        raise ConfigError(f"parallel.context={par.context} runs its collectives eagerly: set train.compile=false")


def plan_layout(cfg: DictConfig, info: DistInfo, model: nn.Module, logits_rank: int) -> Layout:
    """The run's mesh from cfg.parallel and torchrun's world (checked first: ``check_layout``)."""
    check_layout(cfg, info.world_size, model, logits_rank)
    par = cfg.parallel
    context, data = par.context, info.world_size // par.context
    mesh, shards = None, RowShards(None)
    if info.world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(info.device.type, (context, data), mesh_dim_names=('context', 'data'))
        shards = RowShards(_context_group(info.rank, context, data))
    return Layout(world=info.world_size, context=context, data=data, data_rank=info.rank % data, shards=shards,
                  mesh=mesh, fsdp=bool(par.fsdp) and info.world_size > 1, checkpoint_every=par.checkpoint_every)


def _context_group(rank: int, context: int, data: int) -> Optional[dist.ProcessGroup]:
    """This rank's context group, a process group of its own (no other collective is ordered with its all-reduces
    and halo exchanges); every rank creates every group, as ``new_group`` requires."""
    mine = None
    for index in range(data):
        group = dist.new_group([c * data + index for c in range(context)])
        if rank % data == index:
            mine = group
    return mine if context > 1 else None


def checkpointed_blocks(blocks: List[nn.Module], every: int) -> List[nn.Module]:
    """The blocks activation checkpointing wraps: every ``every``-th (the last of each group of ``every``)."""
    return [block for index, block in enumerate(blocks) if every and (index + 1) % every == 0]


def _blocks_of(module: nn.Module) -> Optional[nn.Module]:
    """The block list the step runs: a ContextParallel's, a SegmentationModel's backbone's, or the model's (None for
    a model without one)."""
    if isinstance(module, ContextParallel):
        return module.blocks
    blocks = getattr(module.backbone if isinstance(module, SegmentationModel) else module, 'blocks', None)
    return blocks if isinstance(blocks, (nn.ModuleList, nn.Sequential)) else None


def parallel_module(model: nn.Module, layout: Layout, amp_dtype: Optional[torch.dtype],
                    device: torch.device) -> nn.Module:
    """The module the training step runs: ``model`` split over its context group (context > 1), its blocks
    checkpointed, then synchronised over the world: FSDP2 / HSDP (``layout.fsdp``) or DDP (several processes)."""
    module = ContextParallel(model, layout.shards) if layout.context > 1 else model
    blocks = _blocks_of(module) if layout.checkpoint_every or layout.fsdp else None
    if layout.checkpoint_every:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        chosen = set(id(block) for block in checkpointed_blocks(list(blocks), layout.checkpoint_every))
        for index, block in enumerate(blocks):
            if id(block) in chosen:
                blocks[index] = checkpoint_wrapper(block)
    if layout.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = layout.mesh if layout.context > 1 else layout.mesh['data']
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if amp_dtype == torch.bfloat16 else MixedPrecisionPolicy()
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, shard_placement_fn=_placement(layout.data))
        # a ContextParallel reaches each block twice (its ContextBlock and the model's own list): the root leaves
        # the blocks' parameters to their groups
        shared = {p for block in blocks for p in block.parameters()} if layout.context > 1 else None
        return fully_shard(module, mesh=mesh, mp_policy=policy, ignored_params=shared,
                           shard_placement_fn=_placement(layout.data))
    if layout.world > 1:
        from torch.nn.parallel import DistributedDataParallel
        # its own group: the gradient all-reduces then never interleave with the context groups' collectives
        group = dist.new_group(list(range(layout.world))) if layout.context > 1 else None
        return DistributedDataParallel(module, device_ids=[device.index] if device.type == 'cuda' else None,
                                       process_group=group)
    return module


def _placement(parts: int) -> Callable:
    """FSDP2's choice of the dimension each parameter is sharded on, over ``parts`` ranks: the longest one they
    divide (dimension 0, padded, when none is). The position embedding [1, N, dim] and the class token have one row,
    which dimension 0 cannot split: one rank would hold them whole, which at 2048 px is a quarter of linvit-S."""
    from torch.distributed.tensor import Shard

    def placement(parameter: nn.Parameter):
        even = [d for d in range(parameter.dim()) if parameter.shape[d] % parts == 0]
        return Shard(max(even, key=lambda d: parameter.shape[d]) if even else 0)
    return placement


def context_loss(loss_fn: Callable, module: nn.Module, layout: Layout, logits_rank: int,
                 ignore_index: int = -100) -> Callable:
    """The loss a rank minimises under context parallelism: its part of its image's loss, times the context size
    (gradients are averaged over every rank). A classifier's logits are the same on every rank: each takes the
    whole loss. Segmentation: the cross-entropy summed over this rank's labelled pixels / all labelled pixels of the
    batch. With context 1, ``loss_fn`` itself."""
    if layout.context == 1 or logits_rank == 2:
        return loss_fn
    cp = module.module if hasattr(module, 'module') and isinstance(module.module, ContextParallel) else module
    if not isinstance(cp, ContextParallel):  # FSDP keeps the module itself
        raise TypeError(f"context_loss needs the ContextParallel module, got {type(module).__name__}")

    def pixel_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """logits [B, K, y1 - y0, W] of this rank's rows, targets [B, H, W] of the whole images -> 0-dim."""
        y0, y1 = y0_y1(targets)
        labelled = (targets != ignore_index).sum().clamp_(min=1)
        part = F.cross_entropy(logits.float(), targets[:, y0:y1], ignore_index=ignore_index, reduction='sum')
        return part * layout.context / labelled

    def y0_y1(targets: torch.Tensor):
        ph = cp.backbone.patch_embed.patch_size[0]
        r0, r1 = cp.shards.bounds(-(-targets.shape[-2] // ph))[cp.shards.rank]
        return r0 * ph, min(r1 * ph, targets.shape[-2])

    return pixel_loss


# ---------------------------------------------------------------------------------------------------- checkpoints

def full_weights(model: nn.Module) -> dict:
    """The model's whole state_dict on every rank (every rank calls it: FSDP gathers the shards): what
    model.safetensors, the consolidated checkpoints and evaluation use."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def save_sharded(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of the model and optimizer into ``folder`` (torch.distributed.checkpoint), in
    a layout that ``load_sharded`` reads at any world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({'model': model_state, 'optimizer': optimizer_state}, checkpoint_id=folder,
             no_dist=not dist.is_initialized())


def load_sharded(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what ``save_sharded`` wrote (at any world size, sharded or not) into ``model`` and ``optimizer``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {'model': model_state, 'optimizer': optimizer_state}
    with warnings.catch_warnings():  # one process loading shards of several is what this function is for
        warnings.filterwarnings('ignore', message='torch.distributed is .*single process')
        dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state['model'], optim_state_dict=state['optimizer'])
