"""Autoregressive pretraining (``task: autoregressive``): next-patch pixel prediction in raster order with causal
linear attention.

Katharopoulos et al. (2020) generate images autoregressively with causal linear attention; here a ``linvit_*`` model
built with ``causal=True`` (token i attends to tokens <= i; the prefix tokens come first) and ``global_pool=''``
outputs one vector of ``P = p * p * C`` values per token, and the output at each position regresses the next patch's
pixels. Targets are MAE's ``norm_pix_loss`` targets: each patch's pixels minus the patch's mean, divided by
sqrt(var + 1e-6), so the loss is about shape within a patch, not its brightness.

    images [B, C, H, W] -> outputs = model(images)                 [B, npt + N, P]   (N = (H / p) * (W / p))
    targets = normalized_patch_targets(images, p)                   [B, N, P]
    predictions = next_patch_predictions(outputs, npt, N)          [B, N, P]  (npt >= 1: class token -> patch 0)

The same weights then fine-tune for classification with non-causal attention (``model.pretrained_file`` pointing at
the run's ``model.safetensors``): only the mask changes, and the AR head is dropped for a classifier.

Metrics: ``loss`` (mean squared error per predicted value, in normalised units) and ``r2`` = 1 - SSE / SST with
SST the targets' sum of squares: 0 for predicting every patch's mean, 1 for exact predictions (the main metric).
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset

from ..checkpoint import atomic_write
from ..config import ConfigError
from ..metrics import NextPatchMeter
from .base import Task, create_model_from_config, register_task

__all__ = ['AutoregressiveTask', 'patchify', 'unpatchify', 'normalized_patch_targets',
           'next_patch_predictions', 'align_next_patch', 'next_patch_loss', 'AR_MODEL_KWARGS']

PatchSize = Union[int, Sequence[int]]

#: what the task passes to timm.create_model besides model.kwargs (a user's model.kwargs may not contradict them)
AR_MODEL_KWARGS: Dict[str, Any] = dict(global_pool='', causal=True, local_mix=False)
#: model.kwargs the task refuses, with the reason (checked before the model is built)
_REFUSED = {
    'causal': "task=autoregressive predicts the next patch, so attention must be causal (the task sets causal=True)",
    'local_mix': "the local-mixing convolution sees neighbouring patches, including later ones, which leaks the "
                 "patch to be predicted (the task sets local_mix=False)",
    'global_pool': "task=autoregressive needs one output per token (the task sets global_pool='')",
    'num_classes': "the head's width is the patch's pixel count p * p * C (the task sets it)",
}
NORM_EPS = 1e-6
PICTURE_COUNT = 4


def _pair(patch: PatchSize) -> Tuple[int, int]:
    if isinstance(patch, int):
        return patch, patch
    ph, pw = (int(v) for v in patch)
    return ph, pw


def patchify(images: torch.Tensor, patch: PatchSize) -> torch.Tensor:
    """images [B, C, H, W] -> patches [B, N, ph * pw * C], N = (H / ph) * (W / pw).

    Patches in raster order (left to right, then top to bottom: the order of a ViT's patch tokens); the
    ph * pw * C values of a patch ordered (row in patch, column in patch, channel), as MAE's ``patchify``.
    H and W must be multiples of the patch size (ValueError otherwise).
    """
    ph, pw = _pair(patch)
    batch, channels, height, width = images.shape
    if height % ph or width % pw:
        raise ValueError(f"image size {height}x{width} is not a multiple of the patch size {ph}x{pw}")
    gh, gw = height // ph, width // pw
    x = images.reshape(batch, channels, gh, ph, gw, pw)
    x = x.permute(0, 2, 4, 3, 5, 1)                                     # [B, gh, gw, ph, pw, C]
    return x.reshape(batch, gh * gw, ph * pw * channels)


def unpatchify(patches: torch.Tensor, patch: PatchSize, height: int, width: int) -> torch.Tensor:
    """patches [B, N, ph * pw * C] (``patchify``'s layout) -> images [B, C, height, width]."""
    ph, pw = _pair(patch)
    batch, count, values = patches.shape
    gh, gw = height // ph, width // pw
    channels = values // (ph * pw)
    if gh * gw != count or channels * ph * pw != values:
        raise ValueError(f"{count} patches of {values} values do not make a {height}x{width} image of "
                         f"{ph}x{pw} patches")
    x = patches.reshape(batch, gh, gw, ph, pw, channels).permute(0, 5, 1, 3, 2, 4)   # [B, C, gh, ph, gw, pw]
    return x.reshape(batch, channels, height, width)


def _patch_statistics(patches: torch.Tensor, eps: float = NORM_EPS) -> Tuple[torch.Tensor, torch.Tensor]:
    """patches [B, N, P] -> (mean [B, N, 1], sqrt(var + eps) [B, N, 1]), population variance."""
    mean = patches.mean(dim=-1, keepdim=True)
    var = patches.var(dim=-1, unbiased=False, keepdim=True)
    return mean, (var + eps).sqrt()


def normalized_patch_targets(images: torch.Tensor, patch: PatchSize, eps: float = NORM_EPS) -> torch.Tensor:
    """images [B, C, H, W] -> float32 targets [B, N, ph * pw * C]: ``patchify(images)``, each patch minus its mean,
    divided by sqrt(its variance (unbiased=False) + eps) (MAE's norm_pix_loss targets)."""
    patches = patchify(images.float(), patch)
    mean, std = _patch_statistics(patches, eps)
    return (patches - mean) / std


def next_patch_predictions(outputs: torch.Tensor, num_prefix_tokens: int, num_patches: int) -> torch.Tensor:
    """The outputs that predict a patch: outputs [B, num_prefix_tokens + N, P] -> [B, M, P].

    The output at a position predicts the patch after it. With prefix tokens (npt >= 1) the last prefix token
    predicts patch 0, so outputs[:, npt - 1 : npt - 1 + N] predict patches 0..N-1 (M = N; the last patch's output
    predicts nothing). Without (npt = 0), outputs[:, :N - 1] predict patches 1..N-1 (M = N - 1): compare them with
    targets[:, N - M:].
    """
    if outputs.ndim != 3 or outputs.shape[1] != num_prefix_tokens + num_patches:
        raise ValueError(f"outputs must be [B, {num_prefix_tokens} prefix + {num_patches} patch tokens, P], got "
                         f"{tuple(outputs.shape)}")
    if num_prefix_tokens >= 1:
        return outputs[:, num_prefix_tokens - 1:num_prefix_tokens - 1 + num_patches]
    return outputs[:, :num_patches - 1]


def align_next_patch(outputs: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(predictions [B, M, P], their targets [B, M, P]) from outputs [B, npt + N, P] and targets [B, N, P]; the
    prefix-token count npt is the difference of the token counts (see ``next_patch_predictions``)."""
    num_patches = targets.shape[1]
    num_prefix_tokens = outputs.shape[1] - num_patches
    if num_prefix_tokens < 0 or outputs.shape[-1] != targets.shape[-1]:
        raise ValueError(f"outputs {tuple(outputs.shape)} do not fit patch targets {tuple(targets.shape)}: expected "
                         f"[B, prefix + {num_patches}, {targets.shape[-1]}]")
    predictions = next_patch_predictions(outputs, num_prefix_tokens, num_patches)
    return predictions, targets[:, num_patches - predictions.shape[1]:]


def next_patch_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error (float32, 0-dim) of the next-patch predictions in outputs [B, npt + N, P] against the
    normalised patch targets [B, N, P], over every predicted value."""
    predictions, targets = align_next_patch(outputs, targets)
    return F.mse_loss(predictions.float(), targets.float())


def _token_layout(model: nn.Module) -> Tuple[Tuple[int, int], int]:
    """(patch size (ph, pw), prefix-token count) of a ViT."""
    return _pair(model.patch_embed.patch_size), int(model.num_prefix_tokens)


@register_task
class AutoregressiveTask(Task):
    """Next-patch pixel regression with a causal ``linvit_*`` model on the classification datasets (labels unused)."""
    name = 'autoregressive'
    main_metric = 'r2'
    metric_columns = ('r2',)
    not_predicted = ("an autoregressive model predicts next patches: run it with model.recurrent_init / "
                     "recurrent_step, or fine-tune it for classification, see configs/cls_from_ar_demo.yaml")

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        self.patch_size: Optional[Tuple[int, int]] = None

    def build_datasets(self, mean: Sequence[float], std: Sequence[float],
                       with_train: bool = True) -> Tuple[Optional[Dataset], Dataset, List[str]]:
        from ...data import build_classification_datasets  # here: albumentations is a heavy import
        return build_classification_datasets(self.cfg.data, mean, std, with_train)

    def _check_model_config(self) -> None:
        name = self.cfg.model.name
        if not name.split('.')[0].startswith('linvit_'):
            raise ConfigError(f"model.name={name!r}: task=autoregressive needs a linvit_* model (causal linear "
                              f"attention, one output per token); see timm.list_models('linvit_*')")
        kwargs = self.cfg.model.kwargs
        kwargs = OmegaConf.to_container(kwargs) if isinstance(kwargs, DictConfig) else dict(kwargs)
        for key, why in _REFUSED.items():
            if key in kwargs and not (key in AR_MODEL_KWARGS and kwargs[key] == AR_MODEL_KWARGS[key]):
                raise ConfigError(f"model.kwargs.{key}={kwargs[key]!r} does not fit task=autoregressive: {why}; "
                                  f"remove it")
        if kwargs.get('patch_drop_rate'):
            raise ConfigError(f"model.kwargs.patch_drop_rate={kwargs['patch_drop_rate']!r} does not fit "
                              f"task=autoregressive: dropped tokens break the raster order the next-patch targets "
                              f"follow")

    def build_model(self, num_classes: int) -> nn.Module:
        """The causal model with a head of p * p * C outputs per token (``num_classes``, the dataset's, is unused)."""
        self._check_model_config()
        # the head's width needs the patch size, which the model's builder knows: read it off a weightless copy
        probe_cfg = OmegaConf.merge(self.cfg.model, {'pretrained_file': None, 'floor': False,
                                                     'grad_checkpointing': False})
        with torch.device('meta'):
            probe = create_model_from_config(probe_cfg, 0, self.cfg.data.img_size, extra_kwargs=AR_MODEL_KWARGS)
        patch, _ = _token_layout(probe)
        outputs = patch[0] * patch[1] * int(probe.patch_embed.proj.in_channels)
        del probe
        model = create_model_from_config(self.cfg.model, outputs, self.cfg.data.img_size,
                                         extra_kwargs=AR_MODEL_KWARGS)
        if _token_layout(model)[0] != patch or getattr(model.head, 'out_features', None) != outputs:
            raise RuntimeError(f"{self.cfg.model.name}: expected a head of {outputs} outputs per token for "
                               f"{patch[0]}x{patch[1]} patches, got {model.head}")
        self.patch_size = patch
        return model

    def train_loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return next_patch_loss

    def batch_mixer(self, num_classes: int) -> Optional[Callable]:
        """Replaces the labels by the normalised patch targets of the (augmented) images, on the device."""
        if self.patch_size is None:
            raise RuntimeError('AutoregressiveTask.batch_mixer needs build_model first (it reads the patch size)')
        patch = self.patch_size

        def to_patch_targets(images: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
            return images, normalized_patch_targets(images, patch)
        return to_patch_targets

    def new_meter(self, device: torch.device) -> NextPatchMeter:
        return NextPatchMeter(device=device)

    def evaluate_batch(self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
                       meter: NextPatchMeter) -> None:
        patch, _ = _token_layout(model)
        meter.update(*align_next_patch(model(images).float(), normalized_patch_targets(images, patch)))

    @torch.no_grad()
    def save_pictures(self, model: nn.Module, dataset: Dataset, class_names: List[str], png_path: str,
                      mean: Sequence[float], std: Sequence[float], device: torch.device, autocast: Any) -> None:
        """Input | teacher-forced prediction, one row per image: every patch predicted from the true patches before
        it, de-normalised with the true patch's mean and std (patch 0 from the prefix token; without prefix tokens
        patch 0 is left grey)."""
        from matplotlib.figure import Figure  # here: matplotlib is a heavy import

        count = min(PICTURE_COUNT, len(dataset))
        images = torch.stack([dataset[(i, 0)][0] for i in range(count)])             # [n, C, H, W]
        patch, num_prefix_tokens = _token_layout(model)
        with autocast():
            outputs = model(images.to(device)).float().cpu()
        patches = patchify(images.float(), patch)                                    # [n, N, P]
        patch_mean, patch_std = _patch_statistics(patches)
        predictions = next_patch_predictions(outputs, num_prefix_tokens, patches.shape[1])
        drawn = torch.zeros_like(patches) + patches.mean(dim=(1, 2), keepdim=True)    # grey where nothing predicts
        first = patches.shape[1] - predictions.shape[1]
        drawn[:, first:] = predictions * patch_std[:, first:] + patch_mean[:, first:]
        drawn = unpatchify(drawn, patch, images.shape[2], images.shape[3])
        mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(1, -1, 1, 1)
        std_t = torch.as_tensor(std, dtype=torch.float32).reshape(1, -1, 1, 1)
        pictures = [(x * std_t + mean_t).clamp(0, 1).permute(0, 2, 3, 1).numpy() for x in (images.float(), drawn)]

        fig = Figure(figsize=(4.6, 2.3 * max(count, 1)), layout='constrained')
        axes = fig.subplots(max(count, 1), 2, squeeze=False)
        for row in range(count):
            for column, title in enumerate(('input', 'next-patch prediction')):
                axes[row, column].imshow(pictures[column][row], vmin=0, vmax=1, interpolation='nearest')
                axes[row, column].set_title(title, fontsize=9)
        for ax in axes.ravel():
            ax.set_axis_off()
        with atomic_write(png_path) as f:
            fig.savefig(f, format='png', dpi=100, facecolor='white')
