"""Independent float64 references for the linear-attention tests, written from the formulas.

Nothing here imports linvit: a wrong feature map, normaliser or layer option in the library cannot leak into the
reference it is compared against. Everything computes in float64 and builds the full [Nq, N] similarity matrix.

Test modules import this file as ``references``: pytest puts tests/ on sys.path (``pythonpath`` in pyproject.toml).
"""
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from linvit.ops import quadratic_linear_attention

# ---- feature maps: x [..., D] -> [..., D], non-negative ----


def elu1_ref(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise."""
    return torch.where(x > 0, x + 1.0, torch.exp(x))


def relu_ref(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0)."""
    return torch.where(x > 0, x, torch.zeros_like(x))


def focused_ref(x: torch.Tensor, power: float = 3.0) -> torch.Tensor:
    """||r|| * r^p / ||r^p|| with r = relu(x); rows with no positive entry map to zeros.

    The zero rows are selected with a safe denominator so that gradients stay finite (0 / 0 never evaluated).
    """
    r = relu_ref(x)
    rp = r ** power
    rp_norm = rp.norm(dim=-1, keepdim=True)
    has_positive = rp_norm > 0
    safe = torch.where(has_positive, rp_norm, torch.ones_like(rp_norm))
    return torch.where(has_positive, r.norm(dim=-1, keepdim=True) * rp / safe, torch.zeros_like(rp))


def relu2_ref(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU: max(x, 0)^2."""
    return relu_ref(x) ** 2


#: the float64 formula of every fixed feature map linvit registers; the shared tests take the map names from
#: linvit.ops.FEATURE_MAPS and fail for a map without an entry here
FEATURE_MAP_REFS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    'elu1': elu1_ref,
    'relu': relu_ref,
    'focused': focused_ref,
    'relu2': relu2_ref,
}


# ---- attention ----


def key_weights_ref(key_mask: Optional[torch.Tensor], b: int, h: int, n: int) -> torch.Tensor:
    """key_mask None, [B, N] or [B, H, N] (bool keeps a key; float is its weight) -> float64 weights [B, H, N]."""
    if key_mask is None:
        return torch.ones(b, h, n, dtype=torch.float64)
    w = key_mask.to(torch.float64)
    if w.dim() == 2:
        w = w[:, None, :]
    return w.expand(b, h, n)


# ---- the LinearAttention layer ----


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim (biased variance), float64."""
    centred = x - x.mean(-1, keepdim=True)
    out = centred / torch.sqrt(centred.square().mean(-1, keepdim=True) + eps) * weight.double()
    return out if bias is None else out + bias.double()


def linear_ref(x: torch.Tensor, state: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """x @ W^T + b for the Linear stored as ``name.weight`` / ``name.bias`` in state (bias optional)."""
    out = x @ state[f'{name}.weight'].double().T
    bias = state.get(f'{name}.bias')
    return out if bias is None else out + bias.double()


def local_mix_ref(v_tokens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grid: List[int],
                  num_prefix_tokens: int) -> torch.Tensor:
    """Depthwise k x k neighbourhood sum (zero padding) over the patch grid, as shifted sums, no convolution op.

    v_tokens: [B, N, C] with N = num_prefix_tokens + gh * gw; weight: [C, 1, k, k]; bias: [C] -> [B, N, C] with
    zeros for the prefix tokens.
    """
    b, n, c = v_tokens.shape
    gh, gw = grid
    k = weight.shape[-1]
    r = k // 2
    patches = v_tokens[:, num_prefix_tokens:].reshape(b, gh, gw, c)
    padded = F.pad(patches, (0, 0, r, r, r, r))  # zero rows/columns around the grid: [B, gh + 2r, gw + 2r, C]
    out = bias.double().expand(b, gh, gw, c).clone()
    for di in range(k):
        for dj in range(k):
            # output (i, j) reads input (i + di - r, j + dj - r), i.e. padded (i + di, j + dj): cross-correlation
            out = out + weight[:, 0, di, dj].double() * padded[:, di:di + gh, dj:dj + gw]
    return torch.cat([torch.zeros(b, num_prefix_tokens, c, dtype=torch.float64), out.reshape(b, gh * gw, c)], 1)


def linear_attention_layer_ref(state: Dict[str, torch.Tensor], x: torch.Tensor, num_heads: int,
                               feature_map: str = 'elu1', eps: float = 1e-6, norm_eps: float = 1e-5,
                               key_mask: Optional[torch.Tensor] = None, grid: Optional[List[int]] = None,
                               num_prefix_tokens: int = 1) -> torch.Tensor:
    """LinearAttention's forward in float64 from its state_dict, written from timm's Attention plus the math.

    x: [B, N, dim], key_mask: [B, N] or [B, H, N] weights -> [B, N, dim_out]. Options are read from which
    parameters exist: ``q_norm.weight`` (qk_norm, LayerNorm), ``local_mix.conv.weight`` (depthwise branch on V,
    needs ``grid``), ``norm.weight`` (scale_norm, LayerNorm on the attention output), ``gate.weight`` (sigmoid
    gate computed from x). Order as in timm: attention (+ local term), norm, gate, proj.
    """
    x = x.double()
    b, n, _ = x.shape
    attn_dim = state['qkv.weight'].shape[0] // 3
    head_dim = attn_dim // num_heads
    qkv = linear_ref(x, state, 'qkv')  # [B, N, 3 * H * Dh], ordered (q|k|v, head, d)
    q, k, v = (t.reshape(b, n, num_heads, head_dim).transpose(1, 2) for t in qkv.split(attn_dim, dim=-1))
    if 'q_norm.weight' in state:
        q = layer_norm_ref(q, state['q_norm.weight'], state.get('q_norm.bias'), norm_eps)
        k = layer_norm_ref(k, state['k_norm.weight'], state.get('k_norm.bias'), norm_eps)
    out = quadratic_linear_attention(q, k, v, FEATURE_MAP_REFS[feature_map], eps, key_mask)  # [B, H, N, Dh]
    out = out.transpose(1, 2).reshape(b, n, attn_dim)
    if 'local_mix.conv.weight' in state:
        out = out + local_mix_ref(qkv[..., 2 * attn_dim:], state['local_mix.conv.weight'],
                                  state['local_mix.conv.bias'], grid, num_prefix_tokens)
    if 'norm.weight' in state:
        out = layer_norm_ref(out, state['norm.weight'], state.get('norm.bias'), norm_eps)
    if 'gate.weight' in state:
        out = out * torch.sigmoid(linear_ref(x, state, 'gate'))
    return linear_ref(out, state, 'proj')


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (Frobenius norms over the whole tensor)."""
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


# ---- the other attention families, written from their papers' formulas (float64, quadratic where it applies) ----


def favor_ref(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """Performer's positive random features without any stabiliser: exp(w_i . x - |x|^2 / 2) / sqrt(m), float64."""
    x, w = x.double(), projection.double()
    return torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2) / w.shape[0] ** 0.5


def performer_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor,
                  eps: float = 1e-6) -> torch.Tensor:
    """FAVOR+ as an explicit N x N matrix: A = phi(q d^-1/4) phi(k d^-1/4)^T, out = mean_j A_ij v_j / (mean_j A_ij
    + eps), float64 [B, H, N, Dv]."""
    scale = q.shape[-1] ** -0.25
    sim = favor_ref(q.double() * scale, projection) @ favor_ref(k.double() * scale, projection).transpose(-2, -1)
    n = k.shape[-2]
    return (sim @ v.double() / n) / (sim.sum(-1, keepdim=True) / n + eps)


def softmax_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in float64."""
    logits = q.double() @ k.double().transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(logits, dim=-1) @ v.double()


def adaptive_pool_ref(x: torch.Tensor, grid: Tuple[int, int], prefix: int, size: int) -> torch.Tensor:
    """x [B, H, prefix + h*w, D] -> [B, H, prefix + size*size, D]: bin (i, j) averages rows floor(i h / size) ..
    ceil((i + 1) h / size) - 1 and the same columns (PyTorch's adaptive pooling bins), written as loops."""
    h, w = grid
    patches = x[:, :, prefix:].double().reshape(*x.shape[:2], h, w, x.shape[-1])
    rows = []
    for i in range(size):
        r0, r1 = (i * h) // size, -((-(i + 1) * h) // size)
        for j in range(size):
            c0, c1 = (j * w) // size, -((-(j + 1) * w) // size)
            rows.append(patches[:, :, r0:r1, c0:c1].mean(dim=(2, 3)))
    return torch.cat([x[:, :, :prefix].double(), torch.stack(rows, dim=2)], dim=2)


def low_rank_ref(q, k, v, grid, prefix: int, size: int) -> torch.Tensor:
    """Softmax attention of every query over keys and values pooled on the patch grid, float64."""
    return softmax_attention_ref(q, adaptive_pool_ref(k, grid, prefix, size), adaptive_pool_ref(v, grid, prefix, size))


def gated_ref(q, k, v, gate, feature_map: str = 'elu1', eps: float = 1e-6) -> torch.Tensor:
    """Linear attention with gated keys: A_ij = phi(q_i) . (g_j * phi(k_j)), out = mean_j A_ij v_j /
    (mean_j A_ij + eps), float64."""
    phi = FEATURE_MAP_REFS[feature_map]
    sim = phi(q.double()) @ (gate.double() * phi(k.double())).transpose(-2, -1)
    n = k.shape[-2]
    return (sim @ v.double() / n) / (sim.sum(-1, keepdim=True) / n + eps)


def aft_simple_ref(q, k, v) -> torch.Tensor:
    """AFT-simple: out_t = sigmoid(q_t) * sum_n exp(k_n) v_n / sum_n exp(k_n) per channel, q, k, v [B, N, C],
    float64 (no max subtraction: the tests keep k small)."""
    weights = torch.exp(k.double())
    context = (weights * v.double()).sum(1, keepdim=True) / weights.sum(1, keepdim=True)
    return torch.sigmoid(q.double()) * context


# ---- causal and bidirectional (decayed / gated) linear attention: explicit products of multipliers, float64 ----


def _multipliers_ref(b: int, h: int, n: int, decay, gate) -> torch.Tensor:
    """Per-step multipliers m [B, H, N, Dg] = decay_h * gate (1 without either), float64."""
    m = torch.ones(b, h, n, 1, dtype=torch.float64)
    if decay is not None:
        m = m * torch.as_tensor(decay, dtype=torch.float64).reshape(-1).expand(h).reshape(1, h, 1, 1)
    if gate is not None:
        m = m * gate.double()
    return m


def causal_ref(q, k, v, feature_map: str = 'elu1', decay=None, gate=None, eps: float = 1e-6) -> torch.Tensor:
    """out_t = sum_{j<=t} sum_c phi(q_t)_c phi(k_j)_c w_tjc v_j / (same with v = 1 + eps (t + 1)), where
    w_tjc = prod_{l=j+1}^{t} decay_h gate_lc, built by explicit products over each pair (float64)."""
    phi = FEATURE_MAP_REFS[feature_map]
    b, h, n, _ = q.shape
    m = _multipliers_ref(b, h, n, decay, gate)
    w = torch.zeros(b, h, n, n, m.shape[-1], dtype=torch.float64)
    for t in range(n):
        for j in range(t + 1):
            w[:, :, t, j] = m[:, :, j + 1:t + 1].prod(dim=2)
    pq, pk = phi(q.double()), phi(k.double())
    sim = torch.einsum('bhtc,bhjc,bhtjc->bhtj', pq, pk, w.expand(-1, -1, -1, -1, pq.shape[-1]))
    seen = torch.arange(1, n + 1, dtype=torch.float64).reshape(n, 1)
    return (sim @ v.double()) / (sim.sum(-1, keepdim=True) + eps * seen)


def bidirectional_ref(q, k, v, feature_map: str = 'elu1', decay=None, gate=None, eps: float = 1e-6,
                      orders=None) -> torch.Tensor:
    """out_i = sum_j w_ij phi(q_i)^T phi(k_j) v_j / (sum_j w_ij phi(q_i)^T phi(k_j) + eps N |orders|), w_ij summed
    over the token orders; in one order, the product of the multipliers of the tokens passed going from j to i
    (i included, j not), per channel (float64, loops over pairs)."""
    phi = FEATURE_MAP_REFS[feature_map]
    b, h, n, _ = q.shape
    m = _multipliers_ref(b, h, n, decay, gate)
    orders = orders if orders is not None else [torch.arange(n)]
    w = torch.zeros(b, h, n, n, m.shape[-1], dtype=torch.float64)
    for order in orders:
        order = [int(i) for i in order]
        position = {token: p for p, token in enumerate(order)}
        for i in range(n):
            for j in range(n):
                pi, pj = position[i], position[j]
                passed = order[pj + 1:pi + 1] if pj <= pi else order[pi:pj]
                w[:, :, i, j] += m[:, :, passed].prod(dim=2) if passed else 1.0
    pq, pk = phi(q.double()), phi(k.double())
    sim = torch.einsum('bhtc,bhjc,bhtjc->bhtj', pq, pk, w.expand(-1, -1, -1, -1, pq.shape[-1]))
    return (sim @ v.double()) / (sim.sum(-1, keepdim=True) + eps * n * len(orders))


# ---- the 2025 recipe: normalisers, the norm-times-direction map, polarity-aware attention ----


def normalized_weights_ref(sim: torch.Tensor, key_weights: torch.Tensor, normalizer: str,
                           eps: float = 1e-6) -> torch.Tensor:
    """The weight of key j for query i, [B, H, Nq, N], from the papers' formulas (float64). sim [B, H, Nq, N] holds
    phi(q_i)^T phi(k_j), key_weights [B, H, N] the keys' weights w_j (0: dropped), C = sum_j w_j and
    s_i = sum_j w_j sim_ij / C:

    - divide: w_j sim_ij / (sum_j w_j sim_ij + eps C);
    - inline (InLine): w_j (sim_ij - s_i + 1) / C: the mean similarity subtracted and 1 / N added;
    - mala (MALA): w_j (beta_i sim_ij - gamma_i) / C with beta_i = 1 + 1 / (s_i + eps), gamma_i = s_i.
    """
    w = key_weights.double().unsqueeze(-2)                   # [B, H, 1, N]
    count = w.sum(-1, keepdim=True).clamp_min(1e-300)        # [B, H, 1, 1]
    s = (sim * w).sum(-1, keepdim=True) / count              # [B, H, Nq, 1]
    if normalizer == 'divide':
        return w * sim / (s * count + eps * count)
    if normalizer == 'inline':
        return w * (sim - s + 1.0) / count
    if normalizer == 'mala':
        return w * ((1.0 + 1.0 / (s + eps)) * sim - s) / count
    raise ValueError(f"no reference for normalizer {normalizer!r}")


def normalized_attention_ref(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, normalizer: str,
                             key_weights: Optional[torch.Tensor] = None, eps: float = 1e-6) -> torch.Tensor:
    """sum_j weight_ij v_j with ``normalized_weights_ref``'s weights: phi_q [B, H, Nq, F], phi_k [B, H, N, F],
    v [B, H, N, Dv], key_weights [B, H, N] (None: all 1) -> [B, H, Nq, Dv] float64. Dropped keys' values are zeroed
    first (they may be non-finite)."""
    b, h, n = phi_k.shape[:3]
    w = torch.ones(b, h, n, dtype=torch.float64) if key_weights is None else key_weights.double()
    v = torch.where(w.unsqueeze(-1) > 0, v.double(), 0.0)
    phi_k = torch.where(w.unsqueeze(-1) > 0, phi_k.double(), 0.0)
    return normalized_weights_ref(phi_q.double() @ phi_k.transpose(-2, -1), w, normalizer, eps) @ v


def norm_direction_ref(x: torch.Tensor, sharpness: torch.Tensor) -> torch.Tensor:
    """NaLaFormer-style map, float64: ||x|| * [cos(t), sin(t)] ** (1 + a_h ||x|| / sqrt(D)), t = pi / 4 (1 + x / ||x||)
    (cos and sin of angles in [0, pi / 2], clamped at 0 against rounding); x [B, H, N, D], sharpness a [H] ->
    [B, H, N, 2 D]; a zero row maps to zeros."""
    x = x.double()
    norm = x.pow(2).sum(-1, keepdim=True).sqrt()
    unit = torch.where(norm > 0, x / torch.where(norm > 0, norm, 1.0), 0.0)
    angle = 0.25 * torch.pi * (1.0 + unit)
    exponent = 1.0 + sharpness.double().reshape(-1, 1, 1) * norm / x.shape[-1] ** 0.5
    parts = [torch.exp(exponent * torch.log(f(angle).clamp_min(1e-300))) for f in (torch.cos, torch.sin)]
    return norm * torch.cat(parts, dim=-1)


def polarity_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, power: torch.Tensor, scale: torch.Tensor,
                 normalizer: str = 'divide', eps: float = 1e-6) -> torch.Tensor:
    """PolaFormer's attention, float64, from the sign products of q and k: with y = x / scale and p the power
    ([H, D] each), sim_same_ij = sum_d (y+_qd y+_kd)^p + (y-_qd y-_kd)^p and sim_opposite_ij = sum_d (y+_qd y-_kd)^p
    + (y-_qd y+_kd)^p (y+ = max(y, 0), y- = max(-y, 0)); the first half of v's channels takes the same-sign weights,
    the second half the opposite-sign ones, each normalised on its own. q, k, v [B, H, N, D] -> [B, H, N, D]."""
    yq, yk = q.double() / scale.double()[:, None], k.double() / scale.double()[:, None]
    p = power.double()[:, None]
    qp, qn, kp, kn = (torch.clamp(t, min=0.0) ** p for t in (yq, -yq, yk, -yk))
    same = torch.einsum('bhid,bhjd->bhij', qp, kp) + torch.einsum('bhid,bhjd->bhij', qn, kn)
    opposite = torch.einsum('bhid,bhjd->bhij', qp, kn) + torch.einsum('bhid,bhjd->bhij', qn, kp)
    half = v.shape[-1] // 2
    w = torch.ones(v.shape[:3], dtype=torch.float64)
    return torch.cat([normalized_weights_ref(same, w, normalizer, eps) @ v[..., :half].double(),
                      normalized_weights_ref(opposite, w, normalizer, eps) @ v[..., half:].double()], dim=-1)


# ---- a layer's projections, written out (the layer tests compare its mixing with the references above) ----


def random_layer(cls, dim: int, num_heads: int, seed: int = 0, **options):
    """A float64 ``cls(dim, num_heads=..., qkv_bias=True, **options)`` with every parameter drawn from N(0, 0.3^2),
    so that no tensor sits at an initial value that could hide a term (a zero gate, an identity map)."""
    torch.manual_seed(seed)
    layer = cls(dim, num_heads=num_heads, qkv_bias=True, **options).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer


def layer_qkv_ref(layer, x: torch.Tensor) -> torch.Tensor:
    """q, k, v stacked [3, B, H, N, D] in float64 from the layer's qkv weight and bias: x [B, N, dim]."""
    qkv = x.double() @ layer.qkv.weight.double().T + layer.qkv.bias.double()
    b, n = x.shape[:2]
    return qkv.reshape(b, n, 3, layer.num_heads, layer.head_dim).permute(2, 0, 3, 1, 4)


def layer_projection_ref(layer, out: torch.Tensor) -> torch.Tensor:
    """The layer's output projection of the mixed heads out [B, H, N, D] -> [B, N, dim_out], float64."""
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d) @ layer.proj.weight.double().T + layer.proj.bias.double()
