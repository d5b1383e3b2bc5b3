"""The teacher-student pieces a linearization trains with (``linvit.engine.tasks.linearize``): its stage-1 model and
loss (attention transfer: every linear attention layer learns to map the teacher's input of that layer to the
teacher's output), its stage-2 loss (distillation), the attention weights both kinds of layer give, and the hooks
that collect the teacher's hidden states; with a feature weight, its stage-2 model (``FeatureAlignment``: the
student's output and its last block's tokens, which the loss aligns with the teacher's).

    pairs = transfer_pairs(teacher, student)                    # paths of the layers stage 1 trains
    model = AttentionTransfer(student, pairs)                   # inputs [B, L, N, C] -> (outputs [B, L, N, C], None)
    loss = attention_transfer_loss(0.0)(model(inputs), (teacher_outputs, None))
    loss = DistillationLoss(task_loss, weight=0.5, temperature=2.0)(student_logits, (labels, teacher_logits))
    model = FeatureAlignment(student, last_block(student))     # images -> (logits, tokens [B, N, C])
    loss = DistillationLoss(task_loss, 0.5, 2.0, feature_weight=1.0)(model(images), (labels, logits, tokens))
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...layers import LinearAttention
from ...models.convert import attention_sites
from ..config import ConfigError

__all__ = ['student_of', 'vit_of', 'transfer_pairs', 'last_block', 'rotary_embeddings', 'query_positions',
           'softmax_attention_weights', 'linear_attention_weights', 'StudentWrapper', 'AttentionTransfer',
           'FeatureAlignment', 'relative_squared_error', 'attention_transfer_loss', 'DistillationLoss', 'ResizedInput',
           'HiddenStates', 'row_mask_hook']


def student_of(model: nn.Module) -> nn.Module:
    """The student inside a stage's wrapper (``AttentionTransfer``, ``FeatureAlignment``), or the model itself."""
    return model.student if isinstance(model, StudentWrapper) else model


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


def last_block(model: nn.Module) -> str:
    """The path of the block that holds ``model``'s last attention layer ('blocks.11', 'backbone.blocks.11'): its
    output tokens are the features a dense head reads."""
    sites = attention_sites(model)
    if not sites:
        raise ConfigError(f"{type(model).__name__} has no attention layer whose block's features could be aligned")
    return sites[-1][0].rpartition('.')[0]


def rotary_embeddings(model: nn.Module, paths: Sequence[str], run: Callable[[], Any]) -> List[Optional[torch.Tensor]]:
    """The rotary embedding (``rope``) each attention layer at ``paths`` receives while ``run()`` runs ``model``
    once (None for a layer that gets none): what timm's RoPE models (the Eva family) pass their attention for the
    size ``run`` feeds. Eval-mode embeddings depend only on the patch grid, so one run gives them for every batch."""
    seen: Dict[int, Optional[torch.Tensor]] = {}

    def keeper(index: int) -> Callable:
        def keep(module: nn.Module, args: Tuple, kwargs: Dict[str, Any]) -> None:
            seen[index] = kwargs.get('rope')
        return keep

    handles = [model.get_submodule(path).register_forward_pre_hook(keeper(i), with_kwargs=True)
               for i, path in enumerate(paths)]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return [seen.get(i) for i in range(len(paths))]


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


class StudentWrapper(nn.Module):
    """A stage's model around the student whose state dict is the student's (checkpoints and model.safetensors hold
    the student's keys, as any run's)."""

    def __init__(self, student: nn.Module) -> None:
        super().__init__()
        self.student = student

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        return self.student.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.student.load_state_dict(state_dict, strict=strict, assign=assign)


class AttentionTransfer(StudentWrapper):
    """The stage-1 model: the student's attention layers at ``paths``, each applied to the teacher's input of that
    layer. forward(inputs [B, L, N, C]) -> (outputs [B, L, N, C], weights [B, L, H, Q, N] or None).

    ropes: per layer, the rotary embedding the teacher's layer received (``rotary_embeddings``; None where it got
    none), passed to the student's layer as the model would pass it. They are buffers outside the state dict."""

    def __init__(self, student: nn.Module, paths: Sequence[str], queries: int = 0,
                 ropes: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
        super().__init__(student)
        self.paths = list(paths)
        self.queries = queries
        ropes = list(ropes) if ropes is not None else [None] * len(self.paths)
        if queries and any(rope is not None for rope in ropes):
            raise ConfigError("linearize.attention_weights_loss > 0 compares attention weights, which rotary linear "
                              "attention (a RoPE teacher) forms with rotated features that need not be positive; "
                              "set linearize.attention_weights_loss=0")
        for index, rope in enumerate(ropes):
            self.register_buffer(f"rope{index}", rope, persistent=False)

    def layers(self) -> List[nn.Module]:
        return [self.student.get_submodule(path) for path in self.paths]

    def _layer_output(self, index: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rope = getattr(self, f"rope{index}")
        return layer(x) if rope is None else layer(x, rope=rope)

    def forward(self, inputs: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        layers = self.layers()
        outputs = torch.stack([self._layer_output(i, layer, inputs[:, i]) for i, layer in enumerate(layers)], dim=1)
        if not self.queries:
            return outputs, None
        positions = query_positions(inputs.shape[2], self.queries, inputs.device)
        weights = torch.stack([linear_attention_weights(layer, inputs[:, i], positions)
                               for i, layer in enumerate(layers)], dim=1)
        return outputs, weights


class FeatureAlignment(StudentWrapper):
    """The stage-2 model when the loss aligns features: forward(images) -> (the student's output, the output tokens
    [B, N, C] of its block at ``path``, kept by a forward hook during that forward)."""

    def __init__(self, student: nn.Module, path: str) -> None:
        super().__init__(student)
        self.path = path
        self._tokens: Dict[str, torch.Tensor] = {}
        student.get_submodule(path).register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: Tuple, output: torch.Tensor) -> None:
        self._tokens['out'] = output

    def forward(self, images: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        output = self.student(images)
        return output, self._tokens.pop('out')


def relative_squared_error(student: torch.Tensor, teacher: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """mean((student - teacher)^2) / mean(teacher^2) over ``dims``, in float32 (scale-free: a layer or feature of any
    magnitude counts alike)."""
    error = (student.float() - teacher.float()).pow(2).mean(dim=tuple(dims))
    return error / teacher.float().pow(2).mean(dim=tuple(dims)).clamp_min(1e-12)


def attention_transfer_loss(weights_loss: float) -> Callable[[Any, Any], torch.Tensor]:
    """The stage-1 loss of (student outputs, weights) against (teacher outputs, teacher weights): the mean over
    layers of the squared error relative to the teacher output's mean square (so every layer counts alike, whatever
    its scale), plus ``weights_loss`` x the cross-entropy of the student's attention weights to the teacher's."""

    def loss_fn(outputs: Tuple[torch.Tensor, Optional[torch.Tensor]],
                targets: Tuple[torch.Tensor, Optional[torch.Tensor]]) -> torch.Tensor:
        student, student_weights = outputs
        teacher, teacher_weights = targets
        loss = relative_squared_error(student, teacher, dims=(0, 2, 3)).mean()
        if weights_loss > 0 and student_weights is not None:
            ce = -(teacher_weights * student_weights.clamp_min(1e-12).log()).sum(dim=-1).mean()
            loss = loss + weights_loss * ce
        return loss

    return loss_fn


class DistillationLoss(nn.Module):
    """Stage 2: (1 - w) task_loss(student, labels) + w T^2 KL(softmax(teacher / T) || softmax(student / T)), plus
    ``feature_weight`` x the relative squared error of the student's tokens to the teacher's when it is > 0.

    Classification: logits [B, K]; segmentation: [B, K, H, W], the KL per pixel averaged over the labelled ones
    (targets != ignore_index). outputs = the student's logits, or (logits, tokens [B, N, C]) with a feature weight
    (``FeatureAlignment``); targets = (the task's targets, the teacher's logits[, the teacher's tokens])."""

    def __init__(self, task_loss: Callable, weight: float, temperature: float, ignore_index: Optional[int] = None,
                 feature_weight: float = 0.0):
        super().__init__()
        if not 0 <= weight <= 1:
            raise ConfigError(f"linearize.distill_weight must be in [0, 1], got {weight}")
        if temperature <= 0:
            raise ConfigError(f"linearize.temperature must be > 0, got {temperature}")
        if feature_weight < 0:
            raise ConfigError(f"linearize.feature_weight must be >= 0, got {feature_weight}")
        self.task_loss = task_loss
        self.weight = weight
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.feature_weight = feature_weight

    def forward(self, outputs: Any, targets: Tuple) -> torch.Tensor:
        if self.feature_weight > 0:
            (outputs, tokens), (labels, teacher, teacher_tokens) = outputs, targets
            features = relative_squared_error(tokens, teacher_tokens, dims=(0, 1, 2))
            return self._distilled(outputs, labels, teacher) + self.feature_weight * features
        labels, teacher = targets
        return self._distilled(outputs, labels, teacher)

    def _distilled(self, outputs: torch.Tensor, labels: Any, teacher: torch.Tensor) -> torch.Tensor:
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


class HiddenStates:
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


def row_mask_hook(mask: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook that zeroes the rows of a parameter's gradient where ``mask`` is 0."""
    return lambda grad: grad * mask.to(grad.dtype)
