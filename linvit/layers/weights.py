"""Loading softmax-attention checkpoints into models that use LinearAttention."""
import logging
from typing import List, Mapping

import torch
import torch.nn as nn

from .local_mix import LocalMix

_logger = logging.getLogger(__name__)


def _family_only_keys(module: nn.Module) -> List[str]:
    """State-dict keys (relative to ``module``) that its attention family adds to timm's Attention."""
    if isinstance(module, LocalMix):
        return list(module.state_dict())
    if getattr(module, 'key_gate', None) is not None:  # gated linear attention: key and output gates
        return [f"{name}.{key}" for name in ('key_gate', 'gate') for key in getattr(module, name).state_dict()]
    if getattr(module, 'scan_gate', None) is not None:  # bidirectional attention's data-dependent gate
        return [f"scan_gate.{key}" for key in module.scan_gate.state_dict()]
    if 'projection' in getattr(module, '_buffers', {}):  # Performer's random features
        return ['projection']
    return []


def linear_only_parameter_names(model: nn.Module) -> List[str]:
    """State-dict keys of branches that only linear attention has (a softmax checkpoint cannot provide them):
    local mixing, the gated family's gates, Performer's random features."""
    names = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        names.extend(prefix + key for key in _family_only_keys(module))
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
