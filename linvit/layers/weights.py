"""Loading softmax-attention checkpoints into models that use LinearAttention."""
import logging
from typing import List, Mapping

import torch
import torch.nn as nn

from .family import declared_state_keys
from .feature_map import LearnableFeatureMap
from .linear_attention import LinearAttention
from .local_mix import LocalMix

_logger = logging.getLogger(__name__)


def _declared_linear_only_keys(module: nn.Module) -> List[str]:
    """State-dict keys (relative to ``module``) that ``module`` itself declares as linear-attention-only: an
    attention family's ``FamilySpec.tensors``, local mixing's ``LocalMix.linear_only_tensors``, a learnable feature
    map's ``linear_only_tensors``."""
    if isinstance(module, LinearAttention):
        return declared_state_keys(module, type(module).family.tensors)
    if isinstance(module, LocalMix):
        return declared_state_keys(module, LocalMix.linear_only_tensors)
    if isinstance(module, LearnableFeatureMap):
        return declared_state_keys(module, type(module).linear_only_tensors)
    return []


def linear_only_parameter_names(model: nn.Module) -> List[str]:
    """State-dict keys of branches that only linear attention has (a softmax checkpoint cannot provide them):
    local mixing and the tensors each attention family declares (gates, Performer's random features, ...)."""
    names = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        names.extend(prefix + key for key in _declared_linear_only_keys(module))
    return sorted(names)


def load_softmax_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> List[str]:
    """Load a softmax model's state_dict strictly, except for linear-attention-only branches.

    Every key of ``state_dict`` must exist in ``model`` with the same shape, and every parameter of ``model`` must
    come from ``state_dict`` unless it belongs to a branch that softmax attention does not have (the zero-initialised
    local-mixing convolutions); those keep their initial values. Returns the names of the parameters that were not
    loaded (also logged at INFO). Raises RuntimeError naming any other missing or unexpected key.
    """
    allowed_missing = set(linear_only_parameter_names(model))
    result = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in result.missing_keys if k not in allowed_missing]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"softmax state_dict does not fit the model: missing keys {missing}, "
                           f"unexpected keys {list(result.unexpected_keys)}")
    kept = sorted(result.missing_keys)
    if kept:
        _logger.info("kept initial values of linear-attention-only parameters: %s", ", ".join(kept))
    return kept
