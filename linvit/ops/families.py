"""The other attention families of the literature as pure tensor functions: Performer FAVOR+, low-rank (Linformer
made resolution-agnostic), gated linear attention and AFT-simple. Shapes [B, H, N, D]; float32 cores with autocast
off (float64 stays float64), outputs in the dtype of ``v``; nothing here holds parameters or state.

    w = gaussian_projection(m, d, generator=g)                       # [m, d] orthogonal random features
    out = performer_attention(q, k, v, w)                            # ~ softmax(q k^T / sqrt(d)) v, O(N m d)
    out = low_rank_attention(q, k, v, grid=(h, w), num_prefix_tokens=1, size=16)   # softmax over 16x16 pooled keys
    out = gated_linear_attention(q, k, v, key_gate, feature_map='elu1')            # phi(k) * gate, then linear
    out = aft_simple(q, k, v)                                        # sigmoid(q) * sum_n softmax_n(k) v_n

Every function compiles with TorchScript (the layers call them from scripted code, and an fx-traced model calls them
as leaves of a graph that timm's tests then script): under TorchScript they run without the autocast guard, which
TorchScript takes only for a constant device, as ``linear_attention_from_features`` does; the inputs are cast to the
compute dtype either way. Feature maps are applied by the caller (``gated_linear_attention_from_features``) where a
scripted caller holds the map as a function.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .common import autocast_off, compute_dtype
from .feature_maps import get_feature_map
from .linear_attn import linear_attention_from_features

__all__ = ['gaussian_projection', 'favor_features', 'performer_attention', 'adaptive_pooling_matrix',
           'pool_patch_tokens', 'low_rank_attention', 'gated_linear_attention', 'gated_linear_attention_from_features',
           'aft_simple', 'polarity_features']


def gaussian_projection(num_features: int, dim: int, orthogonal: bool = True,
                        generator: Optional[torch.Generator] = None, device=None,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random projection [num_features, dim] for FAVOR+: rows ~ N(0, I_dim).

    orthogonal: rows drawn in blocks of ``dim`` mutually orthogonal directions (QR of a Gaussian matrix), each row
        rescaled to the norm of an independent Gaussian vector so that every row is still marginally N(0, I)
        (Choromanski et al. 2021, "Rethinking Attention with Performers", section 2.4); lower estimator variance
        than i.i.d. rows at the same count. False: i.i.d. Gaussian rows.
    """
    if num_features < 1 or dim < 1:
        raise ValueError(f"num_features and dim must be >= 1, got {num_features}, {dim}")
    if not orthogonal:
        return torch.randn(num_features, dim, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)
    blocks = []
    for _ in range(math.ceil(num_features / dim)):
        gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        # QR's sign convention biases Q; fixing the signs of R's diagonal makes Q Haar-distributed, so each
        # direction is uniform on the sphere (Mezzadri 2007)
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        blocks.append(q.T)  # rows are orthonormal directions
    directions = torch.cat(blocks)[:num_features]
    norms = torch.randn(num_features, dim, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (directions * norms).to(device=device, dtype=dtype)


def favor_features(x: torch.Tensor, projection: torch.Tensor, is_query: bool,
                   key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Positive random features of FAVOR+: x [B, H, N, D] (already scaled by D^-1/4) -> [B, H, N, m],
    phi(x) = exp(w_i . x - |x|^2 / 2 - c) / sqrt(m), with E[phi(q) . phi(k)] = exp(q . k) exp(-c_q - c_k).

    The stabiliser c keeps exp from overflowing and cancels in normalised attention: for queries the max over
    features per token, for keys one max per (batch, head) over every unmasked token and feature (a bool key_mask
    [B, N] or [B, H, N] keeps padding, whatever it holds, out of it). It is detached: it is a constant of the
    estimator, not a function to differentiate.
    """
    projected = torch.matmul(x, projection.to(x.dtype).T)                                   # [B, H, N, m]
    half_norm = x.pow(2).sum(dim=-1, keepdim=True) / 2
    if is_query:
        shift = projected.amax(dim=-1, keepdim=True)
    else:
        masked = projected
        if key_mask is not None and key_mask.dtype == torch.bool:
            keep = key_mask[:, None, :, None] if key_mask.dim() == 2 else key_mask[..., None]
            masked = projected.masked_fill(~keep, float('-inf'))
        shift = masked.amax(dim=(-2, -1), keepdim=True)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # every key masked
    return torch.exp(projected - half_norm - shift.detach()) / math.sqrt(projection.shape[0])


def performer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor,
                        eps: float = 1e-6, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Performer FAVOR+ attention: q, k [B, H, N, D], v [B, H, N, Dv], projection [m, D] -> [B, H, N, Dv].

    An estimate of softmax attention softmax(q k^T / sqrt(D)) v (its kernel exp(q.k / sqrt(D)) estimated without
    bias; the normalised output converges as m grows): q and k are
    scaled by D^-1/4, mapped by ``favor_features`` and combined by the linear-attention core (mean normaliser, eps,
    key_mask as in ``linear_attention``) in float32.
    """
    if torch.jit.is_scripting():
        return _performer(q, k, v, projection, eps, key_mask)
    with autocast_off(v.device.type):
        return _performer(q, k, v, projection, eps, key_mask)


def _performer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, eps: float,
               key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    dtype = compute_dtype(v.dtype)
    scale = q.shape[-1] ** -0.25
    phi_q = favor_features(q.to(dtype) * scale, projection.to(dtype), is_query=True)
    phi_k = favor_features(k.to(dtype) * scale, projection.to(dtype), is_query=False, key_mask=key_mask)
    out = linear_attention_from_features(phi_q, phi_k, v.to(dtype), eps, key_mask)
    return out.to(v.dtype)


def adaptive_pooling_matrix(n: int, size: int, device: Optional[torch.device] = None,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[size, n] averaging matrix of adaptive pooling from n to size positions: row i averages positions
    floor(i n / size) .. ceil((i + 1) n / size) - 1 (PyTorch's adaptive_avg_pool bins). Built from aranges of the
    (possibly symbolic) length n, so an exported graph keeps n dynamic, where adaptive_avg_pool2d is traced into
    fixed kernel sizes."""
    rows = torch.arange(size, device=device)[:, None]
    cols = torch.arange(n, device=device)[None, :]
    inside = (cols >= (rows * n) // size) & (cols < ((rows + 1) * n + size - 1) // size)
    weights = inside.to(dtype)
    return weights / weights.sum(dim=1, keepdim=True)


def pool_patch_tokens(x: torch.Tensor, grid: Tuple[int, int], num_prefix_tokens: int, size: int) -> torch.Tensor:
    """x [B, H, P + h * w, D] (P prefix tokens, then the h x w patch grid row-major) -> [B, H, P + size^2, D]: the
    patch tokens average-pooled to a size x size grid with adaptive pooling's bins (any h x w in, the same count
    out; a grid smaller than size repeats tokens), the prefix tokens kept as they are."""
    b, heads, _, d = x.shape
    h, w = grid[0], grid[1]
    prefix, patches = x[:, :, :num_prefix_tokens], x[:, :, num_prefix_tokens:]
    rows = adaptive_pooling_matrix(h, size, x.device, x.dtype)                              # [size, h]
    cols = adaptive_pooling_matrix(w, size, x.device, x.dtype)                              # [size, w]
    grid_tokens = patches.reshape(b, heads, h, w * d)
    pooled = torch.matmul(rows, grid_tokens).reshape(b, heads, size, w, d)                  # pool rows
    pooled = torch.matmul(cols, pooled)                                                     # pool columns
    return torch.cat([prefix, pooled.reshape(b, heads, size * size, d)], dim=2)


def low_rank_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Tuple[int, int],
                       num_prefix_tokens: int, size: int) -> torch.Tensor:
    """Softmax attention of every query over keys and values compressed along the token axis: q, k, v
    [B, H, N, D] with N = num_prefix_tokens + grid[0] * grid[1] -> [B, H, N, D], keys/values pooled to
    num_prefix_tokens + size^2 (``pool_patch_tokens``). Linformer (Wang et al. 2020) compresses with a learned
    N x k matrix, tied to one sequence length; pooling on the 2D patch grid (as PVT's spatial reduction) keeps one
    set of weights valid at any image size. Cost O(N size^2 D). grid: (h, w), a tuple or list."""
    if torch.jit.is_scripting():
        return _low_rank(q, k, v, grid, num_prefix_tokens, size)
    with autocast_off(v.device.type):
        return _low_rank(q, k, v, grid, num_prefix_tokens, size)


def _low_rank(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Tuple[int, int], num_prefix_tokens: int,
              size: int) -> torch.Tensor:
    dtype = compute_dtype(v.dtype)
    keys = pool_patch_tokens(k.to(dtype), grid, num_prefix_tokens, size)
    values = pool_patch_tokens(v.to(dtype), grid, num_prefix_tokens, size)
    out = F.scaled_dot_product_attention(q.to(dtype), keys, values)
    return out.to(v.dtype)


def gated_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_gate: torch.Tensor,
                           feature_map: str = 'elu1', eps: float = 1e-6,
                           key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Linear attention whose keys are gated per token and channel: q, k, key_gate [B, H, N, D] (gate values in
    (0, 1)), v [B, H, N, Dv] -> [B, H, N, Dv]; out_i = sum_j phi(q_i).(g_j * phi(k_j)) v_j / normaliser. The gate
    lets a token switch channels of its key off for every query (a data-dependent focus that plain linear
    attention lacks); a constant gate cancels in the normaliser."""
    dtype = compute_dtype(v.dtype)
    fn = get_feature_map(feature_map)
    with autocast_off(v.device.type):
        phi_q, phi_k = fn(q.to(dtype)), fn(k.to(dtype))
    return gated_linear_attention_from_features(phi_q, phi_k, v, key_gate, eps, key_mask)


def gated_linear_attention_from_features(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                                         key_gate: torch.Tensor, eps: float = 1e-6,
                                         key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gated_linear_attention`` on mapped features phi_q, phi_k [B, H, N, D] (non-negative, in the compute dtype
    of v: float32, or float64 for float64 v): key_gate [B, H, N, D], v [B, H, N, Dv] -> [B, H, N, Dv] in v's dtype.
    For callers that hold the feature map as a function (layers, which TorchScript compiles)."""
    dtype = compute_dtype(v.dtype)
    out = linear_attention_from_features(phi_q.to(dtype), phi_k.to(dtype) * key_gate.to(dtype), v.to(dtype), eps,
                                         key_mask)
    return out.to(v.dtype)


def aft_simple(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """AFT-simple (Zhai et al. 2021, "An Attention Free Transformer"): q, k, v [B, N, C] -> [B, N, C],
    out_t = sigmoid(q_t) * sum_n softmax_n(k)_n * v_n, the softmax over tokens per channel (max-subtracted, float32).
    key_mask [B, N]: bool (True = a real token) or float weights multiplying each token's exp(k)."""
    if torch.jit.is_scripting():
        return _aft(q, k, v, key_mask)
    with autocast_off(v.device.type):
        return _aft(q, k, v, key_mask)


def _aft(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    dtype = compute_dtype(v.dtype)
    keys = k.to(dtype)
    values = v.to(dtype)
    weight: Optional[torch.Tensor] = None
    if key_mask is not None:
        if key_mask.dtype == torch.bool:
            keys = keys.masked_fill(~key_mask[..., None], float('-inf'))
            values = values.masked_fill(~key_mask[..., None], 0.0)  # padding may hold NaN; weight 0 * NaN is NaN
        else:
            weight = key_mask.to(dtype)[..., None]
    shift = keys.amax(dim=1, keepdim=True).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    weights = torch.exp(keys - shift)                                                        # [B, N, C]
    if weight is not None:
        weights = weights * weight
    context = (weights * values).sum(dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True).clamp_min(1e-30)
    out = torch.sigmoid(q.to(dtype)) * context
    return out.to(v.dtype)


def polarity_features(x: torch.Tensor, power: torch.Tensor, scale: torch.Tensor
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """PolaFormer's features (Meng et al. 2025, "Polarity-aware Linear Attention"): x [B, H, N, D] split by sign,
    each part raised to a per-channel power p > 1 (which lowers the entropy of the weights):

        x+ = relu(x / scale) ** p,   x- = relu(-x / scale) ** p,   same = [x+, x-],   opposite = [x-, x+]

    same(q)^T same(k) = x+(q) x+(k) + x-(q) x-(k) sums the same-sign products of q.k, opposite(q)^T same(k) the
    opposite-sign ones that a non-negative map clips: both interactions are kept, in two streams.

    power: [H, D] (> 1), scale: [H, D] (> 0) -> (same [B, H, N, 2 D], opposite [B, H, N, 2 D]), in x's dtype.
    """
    y = x / scale[:, None, :]
    p = power[:, None, :]
    positive, negative = F.relu(y) ** p, F.relu(-y) ** p
    return torch.cat([positive, negative], dim=-1), torch.cat([negative, positive], dim=-1)
