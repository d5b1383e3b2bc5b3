"""Non-causal linear attention (Katharopoulos et al. 2020) with a float32 core.

    out_i = sum_j sim(q_i, k_j) v_j / (sum_j sim(q_i, k_j) + eps),   sim(q, k) = phi(q)^T phi(k)

computed as phi(Q) [phi(K)^T V | phi(K)^T 1] in O(N D Dv): the key sum is appended to kv as one more column, so
one query-side matmul gives the numerator (first Dv columns) and the normaliser (last column). Both sums are taken
as means over the keys (divided by the number of kept keys), so ``eps`` is relative to the mean similarity and the
output does not depend on how many padded tokens a batch carries.

Numerics: half-precision inputs are cast to float32 and the matmuls run with autocast disabled, because
kv = sum_j phi(k_j) v_j^T grows with N and overflows float16 at image-scale token counts. float64 inputs stay
float64 (for gradcheck). The result is cast back to the dtype of ``v``.
"""
from typing import Callable, NamedTuple, Optional, Union

import torch

from ..common import autocast_off, compute_dtype
from ..feature_maps import get_feature_map
from .normalizers import normalizer_spec, value_mean


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           key_mask: Optional[torch.Tensor] = None) -> None:
    """Raise ValueError unless q [B, H, Nq, D], k [B, H, N, D], v [B, H, N, Dv], key_mask [B, N] or [B, H, N]."""
    for name, t in (('q', q), ('k', k), ('v', v)):
        if t.dim() != 4:
            raise ValueError(f"linear attention expects {name} of shape [B, H, N, D], got {list(t.shape)}")
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k, v must share [B, H]: got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"q and k must share the feature width D: got q {list(q.shape)}, k {list(k.shape)}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"k and v must hold the same number of tokens N: got k {list(k.shape)}, v {list(v.shape)}")
    if key_mask is not None:
        b, h, n = k.shape[0], k.shape[1], k.shape[2]
        shape = list(key_mask.shape)
        if shape != [b, n] and shape != [b, h, n]:
            raise ValueError(f"key_mask must have shape [B, N] = {[b, n]} or [B, H, N] = {[b, h, n]}, got {shape}")


def _key_weights(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """key_mask [B, N] or [B, H, N] (bool: True keeps the key; float: a weight >= 0) -> weights [B, H|1, N]."""
    w = key_mask.to(dtype)
    if w.dim() == 2:
        w = w.unsqueeze(1)
    return w


def linear_attention_from_features(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, eps: float = 1e-6,
                                   key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The attention core on mapped features, all in one dtype (float32 or float64) with autocast disabled.

    phi_q: [B, H, Nq, D], phi_k: [B, H, N, D] (non-negative), v: [B, H, N, Dv], key_mask: [B, N] or [B, H, N]
    -> [B, H, Nq, Dv] in the dtype of the inputs. Masked keys (False or weight 0) contribute nothing, even when
    their values are not finite.
    """
    if torch.jit.is_scripting():
        # TorchScript only accepts a constant autocast device; scripted models run the core as traced dtypes say
        return _core(phi_q, phi_k, v, eps, key_mask)
    if v.device.type == 'meta':
        # autocast has no meta device (it raises "unsupported scalarType"); meta tensors carry shapes only, and
        # the inputs already hold the compute dtype, so the core gives the right output shape and dtype
        return _core(phi_q, phi_k, v, eps, key_mask)
    with torch.autocast(device_type=v.device.type, enabled=False):
        return _core(phi_q, phi_k, v, eps, key_mask)


class AttentionState(NamedTuple):
    """What linear attention keeps of its keys: the sums over (kept, weighted) keys j, in float32 (float64 for
    float64 inputs).

    sums: [B, H, Dv + 1, F]: rows 0..Dv-1 are sum_j w_j v_j phi(k_j)^T, the last row sum_j w_j phi(k_j)^T (the
        normaliser's key sum): the transposed [phi(K)^T V | phi(K)^T 1] of the module docstring.
    count: [B, H]: sum_j w_j, the number of kept keys (what eps is relative to).

    States of disjoint sets of keys add field by field (``add_states``): a sequence read chunk by chunk, or split
    across processes, has the state of the whole sequence, and ``linear_attention_apply`` gives every query the
    output it would have had with all keys at once.
    """
    sums: torch.Tensor
    count: torch.Tensor


def add_states(a: AttentionState, b: AttentionState) -> AttentionState:
    """The state of the union of two disjoint sets of keys."""
    return AttentionState(a.sums + b.sums, a.count + b.count)


def state_from_features(phi_k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor] = None,
                        value_features: Optional[torch.Tensor] = None) -> AttentionState:
    """The key half of the core, in the inputs' dtype (float32 or float64) with autocast left to the caller.

    phi_k: [B, H, N, F] (non-negative), v: [B, H, N, Dv], key_mask: [B, N] or [B, H, N] -> AttentionState with
    sums [B, H, Dv + 1, F] and count [B, H]. Masked keys contribute nothing, even when their values are not finite.
    value_features: [B, H, N, F] features that the value rows sum instead of phi_k (the rotated ones of
    ``linvit.ops.rotary``); the normaliser row always sums phi_k.
    """
    b, h, n = phi_k.shape[0], phi_k.shape[1], phi_k.shape[2]
    if key_mask is None:
        count = phi_k.new_full((b, h), float(n))
    else:
        w = _key_weights(key_mask, phi_k.dtype)  # [B, H|1, N]
        keep = (w > 0).unsqueeze(-1)
        phi_k = torch.where(keep, phi_k * w.unsqueeze(-1), 0.0)
        if value_features is not None:
            value_features = torch.where(keep, value_features * w.unsqueeze(-1), 0.0)
        v = torch.where(keep, v, 0.0)
        count = w.sum(dim=-1).expand(b, h)
    summed = phi_k if value_features is None else value_features
    sums = torch.cat([v.transpose(-2, -1) @ summed, phi_k.sum(dim=-2).unsqueeze(-2)], dim=-2)
    return AttentionState(sums, count)


def apply_to_features(phi_q: torch.Tensor, state: AttentionState, eps: float,
                      value_features: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The query half of the core: phi_q [B, H, Nq, F] and a state of [B, H, Dv + 1, F] sums -> [B, H, Nq, Dv],
    num / (den + eps * count) with [num | den] = phi(q) sums^T. With every key masked (count 0) num and den are 0,
    and a tiny count keeps 0 / (0 + eps * count) at 0. value_features [B, H, Nq, F]: the features the numerator
    takes instead of phi_q (the rotated ones of ``linvit.ops.rotary``); the normaliser always takes phi_q.

    The state's transpose is a view (its rows stay contiguous): the query-side matmul with an odd Dv + 1 columns
    measured 20% faster at 16k tokens (MKL) in this layout than with a contiguous [F, Dv + 1] matrix.
    """
    dv = state.sums.shape[-2] - 1
    count = state.count.clamp_min(1e-30)[..., None, None]
    if value_features is not None:
        num = value_features @ state.sums[..., :dv, :].transpose(-2, -1)
        den = phi_q @ state.sums[..., dv:, :].transpose(-2, -1)
        return num / (den + eps * count)
    out1 = phi_q @ state.sums.transpose(-2, -1)
    return out1[..., :dv] / (out1[..., dv:] + eps * count)


def _core(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, eps: float,
          key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The whole core: the query half applied to the key half's state. The means of the module docstring are
    (sum / count) / (sum / count + eps) = sum / (sum + eps * count): scaling eps instead of the sums saves an op."""
    return apply_to_features(phi_q, state_from_features(phi_k, v, key_mask), eps)


def normalized_attention_from_features(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                                       normalizer: str = 'divide', eps: float = 1e-6,
                                       key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The core on mapped features with any normaliser of ``NORMALIZERS`` (``linvit.ops.linear_attn.normalizers``:
    a, s and v_bar as means over the kept keys, combined by the normaliser), autocast disabled.

    phi_q: [B, H, Nq, F], phi_k: [B, H, N, F], v: [B, H, N, Dv] in one dtype (float32 or float64), key_mask: [B, N]
    or [B, H, N] -> [B, H, Nq, Dv] in that dtype. 'divide' gives what ``linear_attention_from_features`` gives.
    """
    combine = normalizer_spec(normalizer).combine
    with autocast_off(v.device.type):
        state = state_from_features(phi_k, v, key_mask)
        count = state.count.clamp_min(1e-30)[..., None, None]
        means = (phi_q @ state.sums.transpose(-2, -1)) / count  # [a | s]
        weights = None if key_mask is None else _key_weights(key_mask, v.dtype)
        dv = v.shape[-1]
        return combine(means[..., :dv], means[..., dv:], value_mean(v, weights, count), eps)


def _phi(feature_map: Union[str, Callable[[torch.Tensor], torch.Tensor], None]) -> Callable:
    if feature_map is None:
        return lambda x: x  # the inputs are already mapped features (a learnable map's output)
    return get_feature_map(feature_map) if isinstance(feature_map, str) else feature_map


def check_state_inputs(k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor]) -> None:
    """Raise ValueError unless k [B, H, N, D], v [B, H, N, Dv] and key_mask None, [B, N] or [B, H, N]."""
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"linear_attention_state expects k [B, H, N, D] and v [B, H, N, Dv] with the same B, H, N; "
                         f"got k {list(k.shape)}, v {list(v.shape)}")
    check_attention_inputs(k, k, v, key_mask)


def check_apply_inputs(q: torch.Tensor, state: AttentionState) -> None:
    """Raise ValueError unless q [B, H, Nq, D] and a state of sums [B, H, Dv + 1, F] and count [B, H] share B, H."""
    sums = state.sums
    if q.dim() != 4 or sums.dim() != 4 or q.shape[:2] != sums.shape[:2] or list(state.count.shape) != list(q.shape[:2]):
        raise ValueError(f"linear_attention_apply expects q [B, H, Nq, D] and a state of sums [B, H, Dv + 1, F] and "
                         f"count [B, H] with the same B, H; got q {list(q.shape)}, sums {list(sums.shape)}, count "
                         f"{list(state.count.shape)}")


def check_state_features(phi_q: torch.Tensor, sums: torch.Tensor) -> None:
    """Raise ValueError unless the mapped queries [.., F] have the state's F features."""
    if phi_q.shape[-1] != sums.shape[-1]:
        raise ValueError(f"the mapped queries have {phi_q.shape[-1]} features and the state {sums.shape[-1]} "
                         f"(sums {list(sums.shape)}): were they made with the same feature map?")


def pytorch_state(k: torch.Tensor, v: torch.Tensor,
                  feature_map: Union[str, Callable[[torch.Tensor], torch.Tensor], None] = 'elu1',
                  key_mask: Optional[torch.Tensor] = None) -> AttentionState:
    """``linear_attention_state`` (checked inputs) on the PyTorch path, differentiated by plain autograd: any map,
    a function or None (k holds features already), and a key mask that may require grad."""
    dtype = compute_dtype(v.dtype)
    with autocast_off(v.device.type):
        return state_from_features(_phi(feature_map)(k.to(dtype)), v.to(dtype), key_mask)


def pytorch_apply(q: torch.Tensor, state: AttentionState,
                  feature_map: Union[str, Callable[[torch.Tensor], torch.Tensor], None] = 'elu1',
                  eps: float = 1e-6, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``linear_attention_apply`` (checked inputs) on the PyTorch path, differentiated by plain autograd."""
    with autocast_off(q.device.type):
        phi_q = _phi(feature_map)(q.to(state.sums.dtype))
        check_state_features(phi_q, state.sums)
        out = apply_to_features(phi_q, state, eps)
    return out.to(out_dtype or q.dtype)


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     feature_map: Union[str, Callable[[torch.Tensor], torch.Tensor]] = 'elu1', eps: float = 1e-6,
                     key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Non-causal linear attention.

    Args:
        q: [B, H, Nq, D] queries.
        k: [B, H, N, D] keys.
        v: [B, H, N, Dv] values; Dv may differ from D.
        feature_map: a name from ``FEATURE_MAPS`` or a function [..., D] -> non-negative [..., D].
        eps: added to the (mean) normaliser; keeps rows whose similarities are all 0 finite (they output 0).
        key_mask: optional [B, N] or [B, H, N]; bool True keeps a key, a float is a per-key weight >= 0.
            Masked keys are dropped exactly: the output equals that of the unpadded sequence.

    Returns:
        [B, H, Nq, Dv] in the dtype of ``v``; computed in float32 (float64 for float64 inputs).
    """
    check_attention_inputs(q, k, v, key_mask)
    phi = get_feature_map(feature_map) if isinstance(feature_map, str) else feature_map
    dtype = compute_dtype(v.dtype)
    out = linear_attention_from_features(phi(q.to(dtype)), phi(k.to(dtype)), v.to(dtype), eps, key_mask)
    return out.to(v.dtype)
