"""Linearization: a trained softmax ViT (the teacher) becomes linear attention (the student), one stage per run.

``task: linearize`` runs two stages (``linvit.engine.linearize`` chains them and writes the report); this module is
one stage, chosen by ``linearize.stage``:

- ``attention`` (stage 1, attention transfer): the student is the teacher converted with ``linearize.convert``.
  Only the tensors the conversion added (a learnable feature map, local mixing, a family's gates) train, plus the
  q / k projections with ``linearize.train_qk``. The frozen teacher runs once per batch (in the batch mixer,
  outside the trained graph); forward hooks keep each attention layer's input and output, and every student layer
  is trained to map the teacher's input to the teacher's output: the layers learn independently, on the hidden
  states the teacher itself produces. Optionally (``linearize.attention_weights_loss``) the student's attention
  weights on a few queries are also pulled towards softmax's.
- ``finetune`` (stage 2): every tensor of the student trains on the task's own loss plus distillation from the
  teacher (logits at temperature T; per-pixel class distributions for segmentation), with the whole engine (AMP,
  EMA, resume, torchrun, compiled step, pictures). The teacher's outputs are computed in the batch mixer too.

Evaluation and pictures are the underlying task's (``linearize.task``, classification or segmentation), on the
student. The teacher sees the student's images at its own training size when its model has a fixed size
(``teacher_input`` in the report), at the student's size when it takes any size (segmentation backbones).
"""
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset

from ...layers import LinearAttention, linear_only_parameter_names
from ...models.convert import attention_sites, convert_to_linear
from ...precision import PRECISIONS
from ..config import ConfigError
from ..metrics import Meter
from ..run_files import find_run_files, load_weights, read_weights
from .base import TASKS, Task, register_task

__all__ = ['LinearizeTask', 'teacher_weights_path', 'AttentionTransfer', 'DistillationLoss', 'attention_transfer_loss',
           'ResizedInput', 'student_of', 'vit_of', 'transfer_pairs', 'linear_attention_weights',
           'softmax_attention_weights']


#: the error of a linearization without a teacher
NO_TEACHER = ("task=linearize needs linearize.teacher: a run directory of train.py or a weights file (.pth / .pt / "
              ".safetensors) of a softmax timm ViT")


def teacher_weights_path(teacher: str) -> str:
    """The weights file of ``linearize.teacher``: a run directory's evaluated weights (model.safetensors, best.pt or
    last.pt), or the file itself. FileNotFoundError when there is none."""
    if os.path.isdir(teacher):
        return find_run_files(teacher).weights_path
    if not os.path.isfile(teacher):
        raise FileNotFoundError(f"linearize.teacher {teacher!r} does not exist (expected a run directory of train.py "
                                f"or a weights file .pth / .pt / .safetensors)")
    return teacher


def student_of(model: nn.Module) -> nn.Module:
    """The student inside a stage-1 wrapper (``AttentionTransfer``), or the model itself."""
    return model.student if isinstance(model, AttentionTransfer) else model


def vit_of(model: nn.Module) -> nn.Module:
    """The ViT a task's model is built on: a segmentation model's backbone, else the model itself."""
    return getattr(model, 'backbone', model)


def transfer_pairs(teacher: nn.Module, student: nn.Module) -> List[str]:
    """Paths of the attention layers stage 1 trains: where the teacher has softmax attention and the student linear
    (blocks the student keeps softmax in, ``softmax_blocks``, are identical and skipped)."""
    teacher_sites = dict(attention_sites(teacher))
    return [path for path, module in attention_sites(student)
            if isinstance(module, LinearAttention) and path in teacher_sites
            and not isinstance(teacher_sites[path], LinearAttention)]


def query_positions(n_tokens: int, count: int, device: torch.device) -> torch.Tensor:
    """``count`` evenly spaced token indices in [0, n_tokens) (all of them when count >= n_tokens): int64 [count]."""
    count = min(count, n_tokens)
    return torch.linspace(0, n_tokens - 1, count, device=device).round().long()


def _heads(attn: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, N, D] of attention layer ``attn`` (timm's Attention or LinearAttention) on tokens x [B, N, C],
    after its q / k norms."""
    B, N, _ = x.shape
    q, k, _ = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return attn.q_norm(q), attn.k_norm(k)


def softmax_attention_weights(attn: nn.Module, x: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Softmax attention weights of timm's ``Attention`` for the query tokens ``queries`` [Q] over all keys:
    x [B, N, C] -> float32 [B, H, Q, N] (rows sum to 1)."""
    q, k = _heads(attn, x)
    logits = (q[:, :, queries].float() * attn.scale) @ k.float().transpose(-2, -1)
    return logits.softmax(dim=-1)


def linear_attention_weights(attn: LinearAttention, x: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """The weights linear attention gives each key, phi(q)^T phi(k_j) / (sum_j phi(q)^T phi(k_j) + eps N), for the
    query tokens ``queries`` [Q]: x [B, N, C] -> float32 [B, H, Q, N] (the local-mix branch is not part of them)."""
    q, k = _heads(attn, x)
    phi_q = attn.feature_map(q[:, :, queries].float())
    phi_k = attn.feature_map(k.float())
    sims = phi_q @ phi_k.transpose(-2, -1)
    return sims / (sims.sum(dim=-1, keepdim=True) + attn.eps * k.shape[-2])


class AttentionTransfer(nn.Module):
    """The stage-1 model: the student's attention layers at ``paths``, each applied to the teacher's input of that
    layer. forward(inputs [B, L, N, C]) -> (outputs [B, L, N, C], weights [B, L, H, Q, N] or None).

    Its state dict is the student's (checkpoints and model.safetensors hold the student's keys, as any run's)."""

    def __init__(self, student: nn.Module, paths: Sequence[str], queries: int = 0) -> None:
        super().__init__()
        self.student = student
        self.paths = list(paths)
        self.queries = queries

    def layers(self) -> List[nn.Module]:
        return [self.student.get_submodule(path) for path in self.paths]

    def forward(self, inputs: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        layers = self.layers()
        outputs = torch.stack([layer(inputs[:, i]) for i, layer in enumerate(layers)], dim=1)
        if not self.queries:
            return outputs, None
        positions = query_positions(inputs.shape[2], self.queries, inputs.device)
        weights = torch.stack([linear_attention_weights(layer, inputs[:, i], positions)
                               for i, layer in enumerate(layers)], dim=1)
        return outputs, weights

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        return self.student.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.student.load_state_dict(state_dict, strict=strict, assign=assign)


def attention_transfer_loss(weights_loss: float) -> Callable[[Any, Any], torch.Tensor]:
    """The stage-1 loss of (student outputs, weights) against (teacher outputs, teacher weights): the mean over
    layers of the squared error relative to the teacher output's mean square (so every layer counts alike, whatever
    its scale), plus ``weights_loss`` x the cross-entropy of the student's attention weights to the teacher's."""

    def loss_fn(outputs: Tuple[torch.Tensor, Optional[torch.Tensor]],
                targets: Tuple[torch.Tensor, Optional[torch.Tensor]]) -> torch.Tensor:
        student, student_weights = outputs
        teacher, teacher_weights = targets
        error = (student.float() - teacher.float()).pow(2).mean(dim=(0, 2, 3))
        scale = teacher.float().pow(2).mean(dim=(0, 2, 3)).clamp_min(1e-12)
        loss = (error / scale).mean()
        if weights_loss > 0 and student_weights is not None:
            ce = -(teacher_weights * student_weights.clamp_min(1e-12).log()).sum(dim=-1).mean()
            loss = loss + weights_loss * ce
        return loss

    return loss_fn


class DistillationLoss(nn.Module):
    """Stage 2: (1 - w) task_loss(student, labels) + w T^2 KL(softmax(teacher / T) || softmax(student / T)).

    Classification: logits [B, K]; segmentation: [B, K, H, W], the KL per pixel averaged over the labelled ones
    (targets != ignore_index). targets = (the task's targets, the teacher's logits)."""

    def __init__(self, task_loss: Callable, weight: float, temperature: float, ignore_index: Optional[int] = None):
        super().__init__()
        if not 0 <= weight <= 1:
            raise ConfigError(f"linearize.distill_weight must be in [0, 1], got {weight}")
        if temperature <= 0:
            raise ConfigError(f"linearize.temperature must be > 0, got {temperature}")
        self.task_loss = task_loss
        self.weight = weight
        self.temperature = temperature
        self.ignore_index = ignore_index

    def forward(self, outputs: torch.Tensor, targets: Tuple[Any, torch.Tensor]) -> torch.Tensor:
        labels, teacher = targets
        t = self.temperature
        log_student = F.log_softmax(outputs.float() / t, dim=1)
        log_teacher = F.log_softmax(teacher.float() / t, dim=1)
        kl = F.kl_div(log_student, log_teacher, reduction='none', log_target=True).sum(dim=1)  # [B] or [B, H, W]
        if self.ignore_index is not None:
            valid = (labels != self.ignore_index).to(kl.dtype)
            kl = (kl * valid).sum() / valid.sum().clamp_min(1.0)
        else:
            kl = kl.mean()
        return (1 - self.weight) * self.task_loss(outputs, labels) + self.weight * t * t * kl


class ResizedInput(nn.Module):
    """model(resize(images, size)): a fixed-size teacher fed the student's images at its own size (bilinear,
    antialiased). size None: the images as they come."""

    def __init__(self, model: nn.Module, size: Optional[int]) -> None:
        super().__init__()
        self.model = model
        self.size = size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.size is None or tuple(images.shape[-2:]) == (self.size, self.size):
            return self.model(images)
        return self.model(F.interpolate(images, size=(self.size, self.size), mode='bilinear', align_corners=False,
                                        antialias=True))


class _HiddenStates:
    """Forward hooks on the teacher's attention layers at ``paths`` that keep each one's input and output."""

    def __init__(self, teacher: nn.Module, paths: Sequence[str]) -> None:
        self.modules = [teacher.get_submodule(path) for path in paths]
        self.inputs: Dict[int, torch.Tensor] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        for index, module in enumerate(self.modules):
            module.register_forward_hook(self._hook(index))

    def _hook(self, index: int) -> Callable:
        def keep(module: nn.Module, args: Tuple, output: torch.Tensor) -> None:
            self.inputs[index], self.outputs[index] = args[0], output
        return keep

    def take(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inputs, outputs) [B, L, N, C] of the last forward, in layer order."""
        count = len(self.modules)
        inputs = torch.stack([self.inputs[i] for i in range(count)], dim=1)
        outputs = torch.stack([self.outputs[i] for i in range(count)], dim=1)
        self.inputs.clear()
        self.outputs.clear()
        return inputs, outputs


def _row_mask_hook(mask: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook that zeroes the rows of a parameter's gradient where ``mask`` is 0."""
    return lambda grad: grad * mask.to(grad.dtype)


@register_task
class LinearizeTask(Task):
    """One stage of a linearization (``linearize.stage``: 'attention' or 'finetune'); the data, metrics and pictures
    are those of the task ``linearize.task``. ``linvit.engine.linearize`` resolves the teacher into the config
    (model.*, seg.*, linearize.task, linearize.teacher_img_size) before the stages run."""
    name = 'linearize'

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        lin = cfg.linearize
        if not lin.teacher:
            raise ConfigError(NO_TEACHER)
        self.base = TASKS[lin.task](cfg)
        self.main_metric = self.base.main_metric
        self.metric_columns = self.base.metric_columns
        self.teacher: Optional[nn.Module] = None
        self.paths: List[str] = []
        self._teacher_state: Optional[Dict[str, torch.Tensor]] = None

    # ---------------------------------------------------------------- data and models

    def build_datasets(self, mean: Sequence[float], std: Sequence[float],
                       with_train: bool = True) -> Tuple[Optional[Dataset], Dataset, List[str]]:
        return self.base.build_datasets(mean, std, with_train)

    def teacher_size(self) -> Optional[int]:
        """The size the teacher is fed at: its training size when its model has a fixed size; None when it takes
        any size (it then sees the student's images as they are)."""
        if self.cfg.linearize.task == 'segmentation':
            return None  # segmentation backbones are built with dynamic_img_size
        return self.cfg.linearize.teacher_img_size or self.cfg.data.img_size

    def base_model(self, num_classes: int, img_size: int) -> nn.Module:
        """The underlying task's model (the teacher's architecture) for ``img_size`` px images, without weights."""
        with_size = OmegaConf.merge(self.cfg, {'data': {'img_size': img_size}, 'model': {'pretrained_file': None}})
        builder = type(self.base)(with_size)
        model = builder.build_model(num_classes)
        # what building taught the task (segmentation: its class count, which its meter needs) holds for this size too
        vars(self.base).update({key: value for key, value in vars(builder).items() if key != 'cfg'})
        return model

    def build_teacher(self, num_classes: int) -> nn.Module:
        """The frozen teacher in eval mode, its weights loaded from ``linearize.teacher``."""
        lin = self.cfg.linearize
        teacher = self.base_model(num_classes, lin.teacher_img_size or self.cfg.data.img_size)
        load_weights(teacher, self._teacher_weights(), f"teacher {teacher_weights_path(lin.teacher)}")
        if any(isinstance(module, LinearAttention) for module in teacher.modules()):
            raise ConfigError(f"linearize.teacher {lin.teacher} already uses linear attention; the teacher must be a "
                              f"softmax ViT")
        for parameter in teacher.parameters():
            parameter.requires_grad_(False)
        return teacher.eval()

    def build_student(self, num_classes: int, img_size: Optional[int] = None, with_weights: bool = True) -> nn.Module:
        """The teacher's architecture at ``img_size`` (default data.img_size) with the teacher's weights (position
        embeddings resampled), converted with ``linearize.convert``; with ``linearize.student_weights`` (stage 2
        after stage 1) those weights instead; ``with_weights=False``: the converted architecture only."""
        lin = self.cfg.linearize
        student = self.base_model(num_classes, img_size or self.cfg.data.img_size)
        if with_weights and lin.student_weights is None:
            load_weights(student, self._teacher_weights(), f"teacher {lin.teacher} (into the student)")
        options = OmegaConf.to_container(lin.convert) if isinstance(lin.convert, DictConfig) else dict(lin.convert)
        try:
            convert_to_linear(vit_of(student), **options)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"linearize.convert={options}: {error}") from error
        if with_weights and lin.student_weights is not None:
            weights, _ = read_weights(lin.student_weights)
            load_weights(student, weights, lin.student_weights)
        return student

    def _teacher_weights(self) -> Dict[str, torch.Tensor]:
        """The teacher's weights, read from its file once (the teacher and the student both start from them)."""
        if self._teacher_state is None:
            self._teacher_state, _ = read_weights(teacher_weights_path(self.cfg.linearize.teacher))
        return self._teacher_state

    def build_model(self, num_classes: int) -> nn.Module:
        """Stage 'attention': the AttentionTransfer wrapper around the student; 'finetune': the student itself;
        'all' (a finished linearization's saved config): the student's architecture only, for its trained weights
        (evaluation, prediction, export: the teacher is not needed)."""
        if self.cfg.linearize.stage == 'all':
            return self.build_student(num_classes, with_weights=False)
        self.teacher = self.build_teacher(num_classes)
        student = self.build_student(num_classes)
        self._teacher_state = None  # both models hold their copies now
        if self.cfg.linearize.stage != 'attention':
            return student
        self.paths = transfer_pairs(self.teacher, student)
        if not self.paths:
            raise ConfigError("linearize: the student has no linear attention layer to train in stage 1 (every block "
                              "kept softmax attention)")
        self._freeze_for_attention_transfer(student)
        queries = self.cfg.linearize.attention_queries if self.cfg.linearize.attention_weights_loss > 0 else 0
        return AttentionTransfer(student, self.paths, queries)

    def _freeze_for_attention_transfer(self, student: nn.Module) -> None:
        """Stage 1 trains what the conversion added (``linear_only_parameter_names``: learnable maps, local mixing,
        gates) and, with linearize.train_qk, the q and k rows of each trained layer's qkv projection (a gradient
        mask keeps the v rows fixed); everything else is frozen."""
        added = set(linear_only_parameter_names(student))
        for name, parameter in student.named_parameters():
            parameter.requires_grad_(name in added)
        if self.cfg.linearize.train_qk:
            for path in self.paths:
                self._train_qk_rows(student.get_submodule(path))
        if not any(parameter.requires_grad for parameter in student.parameters()):
            convert = dict(self.cfg.linearize.convert)
            raise ConfigError(f"linearize stage 1 has nothing to train: linearize.convert={convert} adds no tensors "
                              f"(use feature_map: hedgehog or local_mix: true) and linearize.train_qk is off; or skip "
                              f"stage 1 with linearize.attention_epochs=0")

    @staticmethod
    def _train_qk_rows(attn: LinearAttention) -> None:
        rows = attn.qkv.out_features
        keep = torch.ones(rows, device=attn.qkv.weight.device)
        keep[2 * rows // 3:] = 0  # the v projection: its outputs feed the teacher-identical values
        for parameter in attn.qkv.parameters():
            parameter.requires_grad_(True)
            parameter.register_hook(_row_mask_hook(keep.view((-1,) + (1,) * (parameter.dim() - 1))))

    # ---------------------------------------------------------------- losses and the teacher's targets

    def train_loss(self) -> Callable:
        lin = self.cfg.linearize
        if lin.stage == 'attention':
            return attention_transfer_loss(lin.attention_weights_loss)
        ignore = self.cfg.data.ignore_index if lin.task == 'segmentation' else None
        return DistillationLoss(self.base.train_loss(), lin.distill_weight, lin.temperature, ignore)

    def _autocast(self, device: torch.device) -> Any:
        precision = self.cfg.train.precision
        dtype = None if precision == 'float32' else PRECISIONS[precision]
        return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None)

    def _teacher_on(self, device: torch.device) -> nn.Module:
        teacher = self.teacher
        if next(teacher.parameters()).device != device:
            teacher.to(device)
        return teacher

    def batch_mixer(self, num_classes: int) -> Optional[Callable]:
        if self.cfg.linearize.stage == 'attention':
            return self._attention_targets()
        return self._distillation_targets(self.base.batch_mixer(num_classes))

    def _attention_targets(self) -> Callable:
        """images -> (the teacher's attention inputs [B, L, N, C], (its outputs, its weights on the queries))."""
        hidden = _HiddenStates(self.teacher, self.paths)
        resized = ResizedInput(self.teacher, self.teacher_size())
        lin = self.cfg.linearize

        @torch.no_grad()
        def mix(images: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, Tuple]:
            self._teacher_on(images.device)
            with self._autocast(images.device):
                resized(images)
            inputs, outputs = hidden.take()
            weights = None
            if lin.attention_weights_loss > 0:
                positions = query_positions(inputs.shape[2], lin.attention_queries, inputs.device)
                weights = torch.stack([softmax_attention_weights(module, inputs[:, i], positions)
                                       for i, module in enumerate(hidden.modules)], dim=1)
            return inputs.float(), (outputs.float(), weights)

        return mix

    def _distillation_targets(self, base_mixer: Optional[Callable]) -> Callable:
        """(images, targets) -> (images, (targets, the teacher's logits on those images)), after the task's own
        mixing (Mixup: the teacher sees the mixed images)."""
        resized = ResizedInput(self.teacher, self.teacher_size())

        @torch.no_grad()
        def mix(images: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, Tuple]:
            if base_mixer is not None:
                images, targets = base_mixer(images, targets)
            self._teacher_on(images.device)
            with self._autocast(images.device):
                teacher = resized(images).float()
            if teacher.dim() == 4 and teacher.shape[-2:] != images.shape[-2:]:
                teacher = F.interpolate(teacher, size=images.shape[-2:], mode='bilinear', align_corners=False)
            return images, (targets, teacher)

        return mix

    # ---------------------------------------------------------------- evaluation: the underlying task's, on the student

    def eval_batch_size(self) -> int:
        return self.base.eval_batch_size()

    def new_meter(self, device: torch.device) -> Meter:
        return self.base.new_meter(device)

    def evaluate_batch(self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor, meter: Meter) -> None:
        self.base.evaluate_batch(student_of(model), images, targets, meter)

    def final_metrics(self, computed: Dict[str, float]) -> Dict[str, float]:
        return self.base.final_metrics(computed)

    def save_pictures(self, model: nn.Module, dataset: Dataset, class_names: List[str], png_path: str,
                      mean: Sequence[float], std: Sequence[float], device: torch.device, autocast: Callable) -> None:
        self.base.save_pictures(student_of(model), dataset, class_names, png_path, mean, std, device, autocast)

    def describe_evaluation(self) -> str:
        return self.base.describe_evaluation()

    def plot_evaluation(self, meter: Meter, class_names: List[str], png_path: str) -> bool:
        return self.base.plot_evaluation(meter, class_names, png_path)
