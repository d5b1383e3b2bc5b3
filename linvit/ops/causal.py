"""Causal linear attention as an RNN (Katharopoulos et al. 2020), with a decay (RetNet) and data-dependent gates
(GLA), in three forms that compute one function, and bidirectional scans for images.

With features Q = phi(q), K = phi(k) [N, D], values with a ones column Va = [v | 1] [N, Dv + 1] and per-step log
multipliers a [N, Dg] (Dg = D: a gate per channel; Dg = 1: one per token; a_t = log(decay) + log(gate_t)):

    S_t = diag(exp(a_t)) S_{t-1} + K_t Va_t^T          [D, Dv + 1], S_0 = 0
    [num_t | den_t] = Q_t^T S_t,   out_t = num_t / (den_t + eps (t + 1))

i.e. out_t = sum_{j<=t} sum_c Q_tc K_jc w_tjc v_j / (same with 1 for v_j, + eps (t + 1)), with weights
w_tjc = exp(sum_{l=j+1}^{t} a_lc) <= 1. eps is relative to the mean similarity over the t + 1 keys seen, as the
non-causal core's: without decay or gate, the last row equals non-causal linear attention over the whole sequence.

Forms (``form=``):
    parallel:  the masked quadratic [N, N] (per-channel gates: [N, N, D]) form; exact, O(N^2), for short sequences.
    chunked:   quadratic inside chunks of ``chunk_size`` tokens; the states at chunk boundaries from a cumulative
               sum (no multipliers), one weighted sum over chunks (up to ``MATRIX_MAX_CHUNKS``; always when
               exporting) or a parallel (Hillis-Steele) scan over chunks: O(N L D + N D Dv + (N / L) log(N / L) D Dv)
               with the scan. Trains through
               ``ChunkedCausalScan``, an autograd Function that saves only its inputs and recomputes the states
               in backward (the paper's memory-efficient backward).
    recurrent: one step at a time (``causal_linear_attention_step``), O(D Dv) memory whatever the length.

Numerics: every weight is formed as exp of a sum of log multipliers that are <= 0: cumulative products are never
taken over the sequence (they underflow after a few thousand gates of 0.99), and the chunked form splits
exp(b_t - b_j) at chunk boundaries into factors that are each <= 1, so nothing overflows either. Log multipliers
below ``LOG_MULTIPLIER_MIN`` (gates below exp(-40) ~ 4e-18) count as that value, so a gate of exactly 0 stays finite.
Cores run in float32 (float64 for float64 inputs) with autocast off; outputs take the dtype of ``v``.
"""
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .feature_maps import FeatureMap, get_feature_map
from .linear_attention import autocast_off, compute_dtype, export_tracing

__all__ = ['causal_linear_attention', 'causal_linear_attention_step', 'CausalState', 'causal_linear_scan',
           'ChunkedCausalScan', 'bidirectional_linear_attention', 'bidirectional_linear_attention_op',
           'retention_decays', 'log_multipliers', 'grid_scan_orders', 'SCAN_ORDERS', 'CAUSAL_FORMS',
           'LOG_MULTIPLIER_MIN']

Decay = Union[None, float, Sequence[float], torch.Tensor]

CAUSAL_FORMS = ('parallel', 'chunked', 'recurrent')
SCAN_ORDERS = ('raster', 'raster+column')
LOG_MULTIPLIER_MIN = -40.0
#: per-channel gates inside a chunk are weighted as exp(b_t) * exp(-b_j), b summed from the chunk's start, in float64:
#: exp(-b_j) <= exp(40 L) stays finite in float64 (up to ~e^709) for chunks of up to 17 tokens; longer chunks form
#: the [L, L, D] weights directly (exact too, but L times the memory traffic)
FACTORED_MAX_CHUNK = 17
#: up to this many chunks, the chunk states of decays and gates come from one weighted sum over chunks (O(nc^2 D E)
#: work in one op, fast to compile) rather than the Hillis-Steele scan (O(nc log nc D E), a few ops per round):
#: for scalar multipliers (a BLAS matmul), for per-channel gates (float64 weights [nc, nc, D]), and for either
#: under torch.compile, where each unrolled scan round costs compile time (a 12-block bidirectional model with
#: per-channel gates at 512 px did not finish compiling in 11 minutes through the scan)
MATRIX_MAX_CHUNKS = 256
CHANNEL_MATRIX_MAX_CHUNKS = 64
COMPILED_MATRIX_MAX_CHUNKS = 512


def _states_by_matrix(num_chunks: int, alpha: Optional[torch.Tensor]) -> bool:
    """Whether chunk states come from the weighted sum over chunks (else the cumulative sum or the scan)."""
    if export_tracing():
        return True  # no loop over the chunk count and no slice along it: the token count stays symbolic
    if alpha is None:
        return False  # a cumulative sum: one op already
    limit = MATRIX_MAX_CHUNKS if alpha.shape[-1] == 1 else CHANNEL_MATRIX_MAX_CHUNKS
    if torch.compiler.is_compiling():
        limit = max(limit, COMPILED_MATRIX_MAX_CHUNKS)
    return num_chunks <= limit


def retention_decays(num_heads: int) -> torch.Tensor:
    """RetNet's per-head decays gamma_h = 1 - 2^(-5 - h) for h < 8 heads, spread over the same range (1/32 .. 1/4096
    forgetting per step) for more heads: [num_heads] float64, from short-range to long-range heads."""
    exponents = torch.linspace(5.0, 12.0, num_heads, dtype=torch.float64) if num_heads > 8 else \
        torch.arange(5, 5 + num_heads, dtype=torch.float64)
    return 1.0 - torch.pow(2.0, -exponents)


def _decay_logs(decay: Decay, num_heads: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    """decay None, a float or per-head values in (0, 1] -> log(decay) as [1, H, 1, 1] (None for no decay).

    Python numbers are checked here; tensors only on the CPU (checking a GPU tensor would wait for the device)."""
    if decay is None:
        return None
    if isinstance(decay, torch.Tensor):
        gamma = decay.to(device=device, dtype=dtype)
        check = gamma.device.type == 'cpu' and not gamma.requires_grad and not torch.compiler.is_compiling()
        values = gamma.reshape(-1).tolist() if check else []
    else:
        values = [float(decay)] if isinstance(decay, (int, float)) else [float(d) for d in decay]
        gamma = torch.tensor(values, dtype=dtype, device=device)
    if not all(0.0 < value <= 1.0 for value in values):
        raise ValueError(f"decay values must lie in (0, 1], got {values}")
    if gamma.dim() == 0 or gamma.numel() == 1:
        gamma = gamma.reshape(1).expand(num_heads)
    if gamma.shape != (num_heads,):
        raise ValueError(f"decay must be a float or hold one value per head ({num_heads}), got shape "
                         f"{list(gamma.shape)}")
    return torch.log(gamma).view(1, num_heads, 1, 1)


def log_multipliers(q: torch.Tensor, decay: Decay = None, gate: Optional[torch.Tensor] = None,
                    log_gate: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The per-step log multipliers a = log(decay) + log(gate) in the compute dtype, or None without either.

    q: [B, H, N, D] (for shapes, dtype and device). decay: None, a float or [H] values in (0, 1]. gate: values in
    [0, 1] of shape [B, H, N, D] (per channel) or [B, H, N, 1] (per token); or log_gate: its log (<= 0), same shapes.
    Returns [B|1, H, N|1, D|1], clamped below at LOG_MULTIPLIER_MIN.
    """
    if gate is not None and log_gate is not None:
        raise ValueError("pass gate or log_gate, not both")
    dtype = compute_dtype(q.dtype)
    b, h, n, d = q.shape
    out = _decay_logs(decay, h, dtype, q.device)
    if gate is not None or log_gate is not None:
        name, given = ('gate', gate) if gate is not None else ('log_gate', log_gate)
        if given.dim() != 4 or list(given.shape[:3]) != [b, h, n] or given.shape[3] not in (1, d):
            raise ValueError(f"{name} must have shape [B, H, N, D] = {[b, h, n, d]} or [B, H, N, 1], got "
                             f"{list(given.shape)}")
        given = given.to(dtype)
        logs = torch.log(given) if gate is not None else given
        out = logs if out is None else out + logs
    if out is None:
        return None
    return out.clamp_min(LOG_MULTIPLIER_MIN)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (('q', q), ('k', k), ('v', v)):
        if t.dim() != 4:
            raise ValueError(f"causal linear attention expects {name} of shape [B, H, N, D], got {list(t.shape)}")
    if q.shape != k.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q and k must be [B, H, N, D] and v [B, H, N, Dv] with the same B, H, N: got q "
                         f"{list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """v [..., N, Dv] -> [v | 1] [..., N, Dv + 1]: one matmul gives numerator and normaliser."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def _normalize(out1: torch.Tensor, eps: float, count: Union[torch.Tensor, int]) -> torch.Tensor:
    """[num | den] [..., Dv + 1] -> num / (den + eps * count), count the keys each row has seen ([N, 1] or a number)."""
    return out1[..., :-1] / (out1[..., -1:] + eps * count)


def _steps_seen(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[N, 1]: 1, ..., N (keys each causal row has seen)."""
    return torch.arange(1, n + 1, dtype=dtype, device=device).unsqueeze(-1)


# ---------------------------------------------------------------------------------------------- the three forms


def _tril(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] bool, True where j <= t (row t, column j)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def _pair_weights(b: torch.Tensor) -> torch.Tensor:
    """Cumulative log multipliers b [..., L, Dg] -> w [..., L, L, Dg], w[t, j] = exp(b_t - b_j) for j <= t, else 0.

    The difference is masked before exp, so the j > t entries (positive exponents) never overflow."""
    diff = b.unsqueeze(-2) - b.unsqueeze(-3)  # [..., t, j, Dg]
    return torch.exp(diff.masked_fill(~_tril(b.shape[-2], b.device).unsqueeze(-1), -math.inf))


def _weighted_scores(phi_q: torch.Tensor, phi_k: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
    """sum_c Q_tc K_jc w_tjc -> [..., L, L] (w None: causal mask only; w [..., L, L, 1]: scalar weights)."""
    if w is None:
        return (phi_q @ phi_k.transpose(-2, -1)).masked_fill(~_tril(phi_q.shape[-2], phi_q.device), 0.0)
    if w.shape[-1] == 1:
        return (phi_q @ phi_k.transpose(-2, -1)) * w.squeeze(-1)
    return torch.einsum('...tc,...jc,...tjc->...tj', phi_q, phi_k, w)


def _parallel_scan(phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor,
                   a: Optional[torch.Tensor]) -> torch.Tensor:
    """The masked quadratic form: [B, H, N, D] x2, va [B, H, N, E], a [B|1, H, N|1, Dg] or None -> [B, H, N, E]."""
    w = None
    if a is not None:
        n = phi_q.shape[-2]
        w = _pair_weights(torch.cumsum(a.expand(*a.shape[:2], n, a.shape[-1]), dim=-2))
    return _weighted_scores(phi_q, phi_k, w) @ va


def _recurrent_scan(phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor,
                    a: Optional[torch.Tensor]) -> torch.Tensor:
    """One token at a time through the state S [B, H, D, E]: the RNN form, O(D E) memory per step."""
    b, h, n, d = phi_q.shape
    state = phi_q.new_zeros(b, h, d, va.shape[-1])
    outs = []
    for t in range(n):
        a_t = None if a is None else a[:, :, min(t, a.shape[2] - 1)]
        state = _advance(state, phi_k[:, :, t], va[:, :, t], a_t)
        outs.append((phi_q[:, :, t].unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outs, dim=2)


def _advance(state: torch.Tensor, phi_k_t: torch.Tensor, va_t: torch.Tensor,
             a_t: Optional[torch.Tensor]) -> torch.Tensor:
    """S <- diag(exp(a_t)) S + K_t Va_t^T: state [B, H, D, E], phi_k_t [B, H, D], va_t [B, H, E], a_t [B|1, H, Dg]."""
    if a_t is not None:
        state = state * torch.exp(a_t).unsqueeze(-1)
    return state + phi_k_t.unsqueeze(-1) * va_t.unsqueeze(-2)


def _pad_to_chunks(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, H, N, X] -> [B, H, nc, L, X], zero-padded at the end to a whole number of chunks."""
    # padded even by 0 tokens, to an explicit count of at least 2 chunks: no branch on the length and no size-1
    # chunk dimension, whose layout torch.export would specialise, so an exported graph keeps N symbolic
    n = t.shape[2]
    if torch.jit.is_tracing():
        # torch.jit.trace (torch.onnx's TorchScript exporter) records sizes as tensors, which sym_max does not take;
        # that exporter keeps only the batch dynamic, so the token count is a constant of its graph anyway
        n = int(n)
    if isinstance(n, int):
        # a static length (also under torch.compile: torch 2.11's dynamo broke the graph on sym_max of plain ints
        # inside an autograd.Function)
        num_chunks = max(2, (n + chunk - 1) // chunk)
    else:
        num_chunks = torch.sym_max(2, (n + chunk - 1) // chunk)
    t = F.pad(t, (0, 0, 0, num_chunks * chunk - n))
    return t.reshape(t.shape[0], t.shape[1], num_chunks, chunk, t.shape[-1])


def _unchunk(t: torch.Tensor, n: int) -> torch.Tensor:
    """[B, H, nc, L, X] -> [B, H, N, X] (padding dropped)."""
    return t.flatten(2, 3).narrow(2, 0, n)


def _inclusive_state_scan(u: torch.Tensor, alpha: Optional[torch.Tensor]) -> torch.Tensor:
    """E_c = diag(exp(alpha_c)) E_{c-1} + u_c over chunks c, all at once.

    u: [B, H, nc, D, E], consumed (updated in place); alpha: [B, H, nc, Dg] (<= 0) or None (then a cumulative
    sum). Hillis-Steele: log2(nc)
    rounds, each combining every chunk with the one 2^r before it; the multipliers are exp of sums of log values
    <= 0, so nothing overflows over any number of chunks."""
    if alpha is None:
        return torch.cumsum(u, dim=2)
    nc = u.shape[2]
    # in place: u is a fresh buffer of the caller's (inside the autograd Function, nothing else holds it) and alpha
    # a small copy; each round's carried terms are computed from the previous round's values before the update
    alpha = alpha.clone()
    shift = 1
    while shift < nc:
        carried = torch.exp(alpha[:, :, shift:]).unsqueeze(-1) * u[:, :, :-shift]
        carried_alpha = alpha[:, :, :-shift].clone()
        u[:, :, shift:] += carried
        alpha[:, :, shift:] += carried_alpha
        shift *= 2
    return u


def _exclusive_state_matrix(u: torch.Tensor, alpha: Optional[torch.Tensor]) -> torch.Tensor:
    """The states before each chunk, S_c = sum_{k<c} exp(C_{c-1} - C_k) u_k (C the cumulative sum of alpha, in
    float64 so that differences of long sums keep their precision), as one weighted sum over chunks.

    Shape-agnostic: no loop whose length depends on the chunk count and no slice along the chunks, so an exported
    graph keeps N symbolic (a slice of one chunk would be specialised). O(nc^2 D E) work in one op: used when
    exporting and up to ``MATRIX_MAX_CHUNKS`` chunks (see ``_states_by_matrix``)."""
    b, h, nc, d, e = u.shape
    before = _tril(nc, u.device).tril(-1)
    if alpha is None:
        return (before.to(u.dtype) @ u.reshape(b, h, nc, d * e)).reshape(b, h, nc, d, e)
    cumulative = torch.cumsum(alpha.double(), dim=2)  # [B, H, nc, Dg]
    # C_{c-1} by shifting, not as C_c - alpha_c: that would round with chunk c's values, which chunk c must not see
    previous = F.pad(cumulative, (0, 0, 1, 0)).narrow(2, 0, nc)
    diff = previous.unsqueeze(3) - cumulative.unsqueeze(2)  # C_{c-1} - C_k: [B, H, c, k, Dg]
    weights = torch.exp(diff.masked_fill(~before.unsqueeze(-1), -math.inf)).to(u.dtype)
    if alpha.shape[-1] == 1:
        return (weights.squeeze(-1) @ u.reshape(b, h, nc, d * e)).reshape(b, h, nc, d, e)
    return torch.einsum('bhckd,bhkde->bhcde', weights, u)


class _Chunks(NamedTuple):
    """The chunked views of one call: q, k [B, H, nc, L, D], va [B, H, nc, L, E]; with multipliers, b the log
    multipliers summed from each chunk's start [B, H, nc, L, Dg], the chunk totals [B, H, nc, Dg] and the factors
    every product needs, from_start = exp(b) and to_end = exp(total - b) [B, H, nc, L, Dg] (each <= 1)."""
    q: torch.Tensor
    k: torch.Tensor
    va: torch.Tensor
    b: Optional[torch.Tensor]
    total: Optional[torch.Tensor]
    from_start: Optional[torch.Tensor]
    to_end: Optional[torch.Tensor]


def _split_chunks(phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor, a: Optional[torch.Tensor],
                  chunk: int) -> _Chunks:
    b = total = from_start = to_end = None
    if a is not None:
        n = phi_q.shape[2]
        a = a.expand(phi_q.shape[0], phi_q.shape[1], n, a.shape[-1])
        b = torch.cumsum(_pad_to_chunks(a, chunk), dim=-2)
        total = b[..., -1, :]
        from_start = torch.exp(b)
        to_end = torch.exp(total.unsqueeze(-2) - b)
    return _Chunks(_pad_to_chunks(phi_q, chunk), _pad_to_chunks(phi_k, chunk), _pad_to_chunks(va, chunk), b, total,
                   from_start, to_end)


def _keys_to_chunk_end(c: _Chunks) -> torch.Tensor:
    """K_j * exp(total - b_j): each key weighted to the end of its chunk (factors <= 1) [B, H, nc, L, D]."""
    return c.k if c.b is None else c.k * c.to_end


def _queries_from_chunk_start(c: _Chunks) -> torch.Tensor:
    """Q_t * exp(b_t): each query weighted from its chunk's start (factors <= 1) [B, H, nc, L, D]."""
    return c.q if c.b is None else c.q * c.from_start


def _states_before_chunks(c: _Chunks, k_end: torch.Tensor) -> torch.Tensor:
    """S_c, the state after every token before chunk c [B, H, nc, D, E] (zero for the first chunk)."""
    if _states_by_matrix(c.q.shape[2], c.total):
        return _exclusive_state_matrix(k_end.transpose(-2, -1) @ c.va, c.total)
    ends = _inclusive_state_scan(k_end.transpose(-2, -1) @ c.va, c.total)
    return torch.cat([torch.zeros_like(ends[:, :, :1]), ends[:, :, :-1]], dim=2)


def _channel_factors(c: _Chunks) -> Tuple[torch.Tensor, torch.Tensor]:
    """(Q exp(b), K exp(-b)) in float64 [B, H, nc, L, D]: their products are the per-channel weights w_tjc for
    j <= t (see FACTORED_MAX_CHUNK). Entries with j > t are large but finite and are masked after the product."""
    b = c.b.double()
    return c.q.double() * torch.exp(b), c.k.double() * torch.exp(-b)


def _factored(c: _Chunks) -> bool:
    return c.b is not None and c.b.shape[-1] > 1 and c.q.shape[-2] <= FACTORED_MAX_CHUNK


class _IntraWeights(NamedTuple):
    """How pairs inside a chunk are weighted: nothing (no multipliers), ``w`` [.., L, L, Dg] (_pair_weights), or
    per-channel float64 ``factors`` (Q exp(b), K exp(-b)) (_channel_factors). Formed once per forward or backward."""
    w: Optional[torch.Tensor]
    factors: Optional[Tuple[torch.Tensor, torch.Tensor]]


def _intra_weights(c: _Chunks) -> _IntraWeights:
    if c.b is None:
        return _IntraWeights(None, None)
    if _factored(c):
        return _IntraWeights(None, _channel_factors(c))
    return _IntraWeights(_pair_weights(c.b), None)


def _intra_scores(c: _Chunks, intra: _IntraWeights) -> torch.Tensor:
    """P_tj = sum_c Q_tc K_jc w_tjc for the pairs inside each chunk (0 for j > t): [B, H, nc, L, L]."""
    if intra.factors is not None:
        q64, k64 = intra.factors
        return (q64 @ k64.transpose(-2, -1)).masked_fill(~_tril(c.q.shape[-2], c.q.device), 0.0).to(c.q.dtype)
    return _weighted_scores(c.q, c.k, intra.w)


def _intra_grads(c: _Chunks, intra: _IntraWeights, pair_grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Intra-chunk parts of dQ_t = sum_j G_tj w_tj * K_j and dK_j = sum_t G_tj w_tj * Q_t, with G [.., t, j] already
    zero for j > t."""
    if c.b is None:
        return pair_grad @ c.k, pair_grad.transpose(-2, -1) @ c.q
    if intra.factors is not None:
        q64, k64 = intra.factors
        g64 = pair_grad.double()
        b = c.b.double()
        d_q = torch.exp(b) * (g64 @ k64)
        d_k = torch.exp(-b) * (g64.transpose(-2, -1) @ q64)
        return d_q.to(c.q.dtype), d_k.to(c.k.dtype)
    w = intra.w
    if w.shape[-1] == 1:
        weighted = pair_grad * w.squeeze(-1)
        return weighted @ c.k, weighted.transpose(-2, -1) @ c.q
    return (torch.einsum('...tj,...tjc,...jc->...tc', pair_grad, w, c.k),
            torch.einsum('...tj,...tjc,...tc->...jc', pair_grad, w, c.q))


def _chunked_forward(phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor, a: Optional[torch.Tensor],
                     chunk: int) -> torch.Tensor:
    """[num | den] of the chunked form: intra-chunk quadratic + queries times the state before their chunk."""
    c = _split_chunks(phi_q, phi_k, va, a, chunk)
    states = _states_before_chunks(c, _keys_to_chunk_end(c))
    out = _intra_scores(c, _intra_weights(c)) @ c.va + _queries_from_chunk_start(c) @ states
    return _unchunk(out, phi_q.shape[2])


def _states_after_chunks(c: _Chunks, grad: torch.Tensor) -> torch.Tensor:
    """R_c = sum over later chunks c' of exp(totals strictly between) (Q exp(b))^T dO [B, H, nc, D, E]: what
    the queries after chunk c ask of a key at its end (the backward pass's reverse-time state)."""
    per_chunk = _queries_from_chunk_start(c).transpose(-2, -1) @ grad
    total = None if c.total is None else c.total.flip(2)
    if _states_by_matrix(c.q.shape[2], c.total):
        return _exclusive_state_matrix(per_chunk.flip(2), total).flip(2)
    from_right = _inclusive_state_scan(per_chunk.flip(2), total).flip(2)
    return torch.cat([from_right[:, :, 1:], torch.zeros_like(from_right[:, :, :1])], dim=2)


def _chunked_backward(grad: torch.Tensor, phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor,
                      a: Optional[torch.Tensor], chunk: int, need_a: bool
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of sum(grad * [num | den]) w.r.t. phi_q, phi_k, va and a, recomputing the chunk states.

    With G_tj = dO_t . Va_j and weights w: dQ_t = sum_j G_tj w_tj * K_j, dK_j = sum_t G_tj w_tj * Q_t,
    dVa_j = sum_t (Q_t . w_tj K_j) dO_t, each as intra-chunk products plus one matmul with the forward state
    (dQ) or the reverse state (dK, dVa); and with B the global cumulative log multipliers (w_tj = exp(B_t - B_j)),
    dB_t = Q_t * dQ_t - K_t * dK_t, so da_l = sum_{t >= l} dB_t.
    """
    n = phi_q.shape[2]
    c = _split_chunks(phi_q, phi_k, va, a, chunk)
    g = _pad_to_chunks(grad, chunk)
    k_end = _keys_to_chunk_end(c)
    before = _states_before_chunks(c, k_end)
    after = _states_after_chunks(c, g)
    intra = _intra_weights(c)
    d_va = _intra_scores(c, intra).transpose(-2, -1) @ g + k_end @ after
    pair_grad = (g @ c.va.transpose(-2, -1)).masked_fill(~_tril(chunk, g.device), 0.0)  # G [.., t, j], j <= t
    d_q, d_k = _intra_grads(c, intra, pair_grad)
    inter_q = g @ before.transpose(-2, -1)
    inter_k = c.va @ after.transpose(-2, -1)
    if c.b is not None:
        inter_q = inter_q * c.from_start
        inter_k = inter_k * c.to_end
    d_q = _unchunk(d_q + inter_q, n)
    d_k = _unchunk(d_k + inter_k, n)
    d_a = None
    if need_a:
        d_b = phi_q * d_q - phi_k * d_k
        if a.shape[-1] == 1:
            d_b = d_b.sum(dim=-1, keepdim=True)
        d_a = d_b.flip(2).cumsum(dim=2).flip(2)
        d_a = d_a.sum_to_size(a.shape)
    return d_q, d_k, _unchunk(d_va, n), d_a


class ChunkedCausalScan(torch.autograd.Function):
    """[num | den] = the chunked causal scan of (phi_q, phi_k, va, a) with the memory-efficient backward.

    Saves only its inputs (phi_q, phi_k [B, H, N, D], va [B, H, N, E], a [B|1, H, N|1, Dg]); backward recomputes
    the chunk states forward in time (for dQ) and backward in time (for dK, dVa), as the paper's Algorithm 1 does
    per token. No [N, D, E] tensor is ever kept. Traceable by dynamo (no graph break under torch.compile).
    """

    @staticmethod
    def forward(ctx, phi_q, phi_k, va, a, chunk):
        ctx.chunk = chunk
        ctx.save_for_backward(phi_q, phi_k, va, a)
        return _chunked_forward(phi_q, phi_k, va, a, chunk)

    @staticmethod
    def backward(ctx, grad):
        phi_q, phi_k, va, a = ctx.saved_tensors
        need_a = a is not None and ctx.needs_input_grad[3]
        d_q, d_k, d_va, d_a = _chunked_backward(grad.contiguous(), phi_q, phi_k, va, a, ctx.chunk, need_a)
        return d_q, d_k, d_va, d_a, None


def _check_form(form: str, chunk_size: Optional[int]) -> None:
    if form not in CAUSAL_FORMS:
        raise ValueError(f"form must be one of {list(CAUSAL_FORMS)}, got {form!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")


#: default chunk sizes: per-channel gates weigh the pairs inside a chunk by float64 factors, which stay finite for
#: chunks of up to FACTORED_MAX_CHUNK tokens (longer ones need [L, L, D] weights: measured at 4k tokens, that
#: product alone was 3x slower at L = 64 than at L = 16); scalar multipliers only need [L, L]
CHUNK_SIZE = 64
CHANNEL_GATE_CHUNK_SIZE = 16


def default_chunk_size(a: Optional[torch.Tensor], head_dim: int) -> int:
    """The chunk size for log multipliers ``a`` [.., Dg]: smaller for per-channel gates (Dg = D > 1)."""
    return CHANNEL_GATE_CHUNK_SIZE if a is not None and a.shape[-1] == head_dim and head_dim > 1 else CHUNK_SIZE


def causal_linear_scan(phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor, a: Optional[torch.Tensor] = None,
                       form: str = 'chunked', chunk_size: Optional[int] = None) -> torch.Tensor:
    """The unnormalised causal scan on features, in one dtype with autocast off: out_t = Q_t^T S_t.

    phi_q, phi_k: [B, H, N, D] (non-negative); va: [B, H, N, E] (values, usually with a ones column);
    a: log multipliers [B|1, H, N|1, Dg] (Dg in {1, D}, <= 0) or None. Returns [B, H, N, E].
    """
    _check_form(form, chunk_size)
    if form == 'parallel':
        return _parallel_scan(phi_q, phi_k, va, a)
    if form == 'recurrent':
        return _recurrent_scan(phi_q, phi_k, va, a)
    return ChunkedCausalScan.apply(phi_q, phi_k, va, a, chunk_size or default_chunk_size(a, phi_q.shape[-1]))


def _features(q: torch.Tensor, k: torch.Tensor, feature_map: Union[str, FeatureMap]
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    phi = get_feature_map(feature_map) if isinstance(feature_map, str) else feature_map
    dtype = compute_dtype(q.dtype)
    return phi(q.to(dtype)), phi(k.to(dtype))


def causal_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            feature_map: Union[str, FeatureMap] = 'elu1', decay: Decay = None,
                            gate: Optional[torch.Tensor] = None, eps: float = 1e-6, form: str = 'chunked',
                            chunk_size: Optional[int] = None, log_gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal linear attention: token t attends to tokens 0..t (see the module docstring for the formula).

    Args:
        q, k: [B, H, N, D]; v: [B, H, N, Dv].
        feature_map: a name in ``FEATURE_MAPS`` or a function [..., D] -> non-negative [..., D].
        decay: None, a float or [H] per-head values in (0, 1] (RetNet's gamma; may require grad).
        gate: data-dependent forget gate in [0, 1], [B, H, N, D] (per channel, GLA) or [B, H, N, 1] (per token);
            or ``log_gate``, its log (<= 0, e.g. logsigmoid of a projection), which keeps tiny gates exact.
        eps: added to the normaliser times the number of keys seen.
        form: 'parallel', 'chunked' or 'recurrent' (same function; see the module docstring).
        chunk_size: tokens per chunk of the chunked form (any N; the last chunk is padded); None: 64, or 16 with
            per-channel gates (``default_chunk_size``).

    Returns:
        [B, H, N, Dv] in the dtype of ``v``, computed in float32 (float64 for float64 inputs).
    """
    _check_qkv(q, k, v)
    _check_form(form, chunk_size)
    dtype = compute_dtype(v.dtype)
    with autocast_off(v.device.type):
        a = log_multipliers(q, decay, gate, log_gate)
        phi_q, phi_k = _features(q, k, feature_map)
        out1 = causal_linear_scan(phi_q, phi_k, _with_ones(v.to(dtype)), a, form, chunk_size)
        out = _normalize(out1, eps, _steps_seen(q.shape[2], dtype, v.device))
    return out.to(v.dtype)


class CausalState(NamedTuple):
    """The recurrent state after ``steps`` tokens: kv = sum_j w_j phi(k_j) [v_j | 1]^T, [B, H, D, Dv + 1], in the
    compute dtype. Its size does not depend on how many tokens it has seen."""
    kv: torch.Tensor
    steps: int


def causal_linear_attention_step(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
                                 state: Optional[CausalState] = None,
                                 feature_map: Union[str, FeatureMap] = 'elu1', decay: Decay = None,
                                 gate_t: Optional[torch.Tensor] = None, eps: float = 1e-6,
                                 log_gate_t: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, CausalState]:
    """One step of the recurrent form: (out_t, new state) for the next token.

    q_t, k_t: [B, H, D]; v_t: [B, H, Dv]; state: None before the first token; gate_t / log_gate_t: [B, H, D] or
    [B, H, 1]. Feeding tokens 0..N-1 in order gives causal_linear_attention's rows. Returns out_t [B, H, Dv] in the
    dtype of ``v_t`` and the state (constant size).
    """
    if q_t.dim() != 3 or k_t.shape != q_t.shape or v_t.dim() != 3 or v_t.shape[:2] != q_t.shape[:2]:
        raise ValueError(f"a step takes q_t, k_t [B, H, D] and v_t [B, H, Dv] with the same B, H: got q_t "
                         f"{list(q_t.shape)}, k_t {list(k_t.shape)}, v_t {list(v_t.shape)}")
    dtype = compute_dtype(v_t.dtype)
    b, h, d = q_t.shape
    with autocast_off(v_t.device.type):
        gate = None if gate_t is None else gate_t.unsqueeze(2)
        log_gate = None if log_gate_t is None else log_gate_t.unsqueeze(2)
        a = log_multipliers(q_t.unsqueeze(2), decay, gate, log_gate)
        phi_q, phi_k = _features(q_t, k_t, feature_map)
        kv = state.kv if state is not None else torch.zeros(b, h, d, v_t.shape[-1] + 1, dtype=dtype,
                                                                device=v_t.device)
        steps = state.steps if state is not None else 0
        kv = _advance(kv, phi_k, _with_ones(v_t.to(dtype)), None if a is None else a[:, :, 0])
        out = _normalize((phi_q.unsqueeze(-2) @ kv).squeeze(-2), eps, steps + 1)
    return out.to(v_t.dtype), CausalState(kv, steps + 1)


# ---------------------------------------------------------------------------------------------- bidirectional


def _bidirectional_scan(phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor, a: Optional[torch.Tensor],
                        chunk_size: Optional[int]) -> torch.Tensor:
    """[num | den] of a forward and a backward causal scan over one token order, the diagonal counted once.

    The backward scan runs the causal scan on the reversed sequence (its multipliers reversed too), so the weight
    between tokens i and j is the product of the multipliers of the tokens passed going from j to i, i included
    and j not, in either direction."""
    forward = causal_linear_scan(phi_q, phi_k, va, a, 'chunked', chunk_size)
    a_rev = a if a is None or a.shape[2] == 1 else a.flip(2)
    backward = causal_linear_scan(phi_q.flip(2), phi_k.flip(2), va.flip(2), a_rev, 'chunked', chunk_size).flip(2)
    diagonal = (phi_q * phi_k).sum(dim=-1, keepdim=True) * va
    return forward + backward - diagonal


def _check_scan_orders(orders: str) -> None:
    if orders not in SCAN_ORDERS:
        raise ValueError(f"scan orders must be one of {list(SCAN_ORDERS)}, got {orders!r}")


def grid_scan_orders(grid: Tuple[int, int], num_prefix_tokens: int, orders: str = 'raster+column',
                     device: Optional[torch.device] = None) -> List[torch.Tensor]:
    """Token orders over prefix tokens + an H x W patch grid: 'raster' (row by row, the sequence order) and, with
    'raster+column', also column by column; prefix tokens come first in both. Each a LongTensor [prefix + H * W]."""
    # an fx leaf of the bidirectional layers that TorchScript compiles: it cannot read the global SCAN_ORDERS (the
    # layers check their scan orders when they are built)
    if not torch.jit.is_scripting():
        _check_scan_orders(orders)
    h, w = grid[0], grid[1]
    raster = torch.arange(num_prefix_tokens + h * w, device=device)
    if orders == 'raster':
        return [raster]
    column = torch.arange(h * w, device=device).reshape(h, w).transpose(0, 1).reshape(-1) + num_prefix_tokens
    return [raster, torch.cat([raster[:num_prefix_tokens], column])]


def _take_tokens(t: Optional[torch.Tensor], order: torch.Tensor) -> Optional[torch.Tensor]:
    if t is None or t.shape[2] == 1:
        return t
    return t.index_select(2, order)


def bidirectional_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   feature_map: Union[str, FeatureMap] = 'elu1', decay: Decay = None,
                                   gate: Optional[torch.Tensor] = None, eps: float = 1e-6,
                                   chunk_size: Optional[int] = None,
                                   orders: Optional[List[torch.Tensor]] = None,
                                   log_gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Non-causal decayed / gated linear attention as forward + backward scans (Vision-RWKV, ViG style):

        out_i = sum_j w_ij phi(q_i)^T phi(k_j) v_j / (sum_j w_ij phi(q_i)^T phi(k_j) + eps N |orders|)

    with w_ij (per channel for per-channel gates) summed over the token orders: in one order, the product of the
    multipliers (decay times gate) of the tokens passed going from j to i, i included and j not (decay only:
    gamma^|i - j|); the diagonal counts once per order. Every token sees every other at linear cost, with more
    weight nearby: locality without a window.

    Args:
        q, k: [B, H, N, D]; v: [B, H, N, Dv]; feature_map, decay, gate / log_gate, eps: as causal_linear_attention.
        orders: token orders to scan, each a permutation LongTensor [N] (e.g. raster and column order of a patch
            grid); None: the given order only.

    Returns:
        [B, H, N, Dv] in the dtype of ``v``.
    """
    _check_qkv(q, k, v)
    _check_form('chunked', chunk_size)
    n = q.shape[2]
    orders = orders if orders is not None else [torch.arange(n, device=q.device)]
    for order in orders:
        if order.shape != (n,):
            raise ValueError(f"each order must be a permutation of the N = {n} tokens, got shape {list(order.shape)}")
    dtype = compute_dtype(v.dtype)
    with autocast_off(v.device.type):
        a = log_multipliers(q, decay, gate, log_gate)
        phi_q, phi_k = _features(q, k, feature_map)
        va = _with_ones(v.to(dtype))
        total = None
        for order in orders:
            scanned = _bidirectional_scan(_take_tokens(phi_q, order), _take_tokens(phi_k, order),
                                          _take_tokens(va, order), _take_tokens(a, order), chunk_size)
            back = scanned.index_select(2, torch.argsort(order))
            total = back if total is None else total + back
        out = total[..., :-1] / (total[..., -1:] + eps * n * len(orders))
    return out.to(v.dtype)


# ---------------------------------------------------------------------------------------------- TorchScript


@torch.library.custom_op('linvit::bidirectional_linear_attention', mutates_args=())
def _bidirectional_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str,
                      decay: Optional[List[float]], log_gate: Optional[torch.Tensor], eps: float,
                      chunk_size: Optional[int], orders: List[torch.Tensor]) -> torch.Tensor:
    return bidirectional_linear_attention(q, k, v, feature_map, decay=decay, eps=eps, chunk_size=chunk_size,
                                          orders=orders, log_gate=log_gate)


@_bidirectional_op.register_fake
def _(q, k, v, feature_map, decay, log_gate, eps, chunk_size, orders):
    return v.new_empty(v.shape)


def _bidirectional_op_setup(ctx, inputs, output):
    q, k, v, feature_map, decay, log_gate, eps, chunk_size, orders = inputs
    ctx.save_for_backward(q, k, v, log_gate, *orders)
    ctx.options = (feature_map, decay, eps, chunk_size)


def _bidirectional_op_backward(ctx, grad):
    """Recomputes the forward with autograd on (its chunked scans keep only their inputs anyway) and differentiates
    it: the op serves TorchScript, where it is one node; eager and fx code call the Python function directly."""
    q, k, v, log_gate, *orders = ctx.saved_tensors
    feature_map, decay, eps, chunk_size = ctx.options
    needs = ctx.needs_input_grad
    tensors = [q, k, v, log_gate]
    wanted = [i for i, t in enumerate(tensors) if t is not None and needs[(0, 1, 2, 5)[i]]]
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(i in wanted) if t is not None else None for i, t in enumerate(tensors)]
        out = bidirectional_linear_attention(leaves[0], leaves[1], leaves[2], feature_map, decay=decay, eps=eps,
                                             chunk_size=chunk_size, orders=orders, log_gate=leaves[3])
        grads = torch.autograd.grad(out, [leaves[i] for i in wanted], grad) if wanted else ()
    result: List[Optional[torch.Tensor]] = [None] * 4
    for i, g in zip(wanted, grads):
        result[i] = g
    # one entry per input, a list for the list of orders (they get no gradient)
    return result[0], result[1], result[2], None, None, result[3], None, None, [None] * len(orders)


_bidirectional_op.register_autograd(_bidirectional_op_backward, setup_context=_bidirectional_op_setup)


def bidirectional_linear_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: str,
                                      decay: Optional[List[float]], log_gate: Optional[torch.Tensor], eps: float,
                                      chunk_size: Optional[int], orders: List[torch.Tensor]) -> torch.Tensor:
    """``bidirectional_linear_attention`` with arguments TorchScript takes (a feature-map name, decays as a list of
    floats or None, the token orders): the layers' call, an fx leaf. Eager and fx-traced code run the Python
    function (its chunked scans train with the memory-efficient backward); TorchScript, which compiles neither an
    autograd Function nor the Python function's argument unions, calls the registered op
    ``torch.ops.linvit.bidirectional_linear_attention`` (the same function; its backward recomputes the forward)."""
    if torch.jit.is_scripting():
        return torch.ops.linvit.bidirectional_linear_attention(q, k, v, feature_map, decay, log_gate, eps, chunk_size,
                                                               orders)
    return bidirectional_linear_attention(q, k, v, feature_map, decay=decay, eps=eps, chunk_size=chunk_size,
                                          orders=orders, log_gate=log_gate)
