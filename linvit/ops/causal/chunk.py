"""The chunked form of causal linear attention: quadratic inside chunks of ``chunk_size`` tokens, the states at chunk
boundaries from a cumulative sum (no multipliers), one weighted sum over chunks (up to ``MATRIX_MAX_CHUNKS``; always
when exporting) or a parallel (Hillis-Steele) scan over chunks: O(N L D + N D Dv + (N / L) log(N / L) D Dv) with the
scan. Trains through ``ChunkedCausalScan``, an autograd Function that saves only its inputs and recomputes the
states in backward (the paper's memory-efficient backward).

Numerics: exp(b_t - b_j) is split at chunk boundaries into factors that are each <= 1, so nothing overflows over any
number of chunks (see ``common`` for the multipliers).
"""
import math
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ..common import export_tracing
from .naive import _pair_weights, _tril, _weighted_scores

__all__ = ['ChunkedCausalScan', 'chunked_scan', 'default_chunk_size', 'CHUNK_SIZE', 'CHANNEL_GATE_CHUNK_SIZE',
           'MATRIX_MAX_CHUNKS', 'CHANNEL_MATRIX_MAX_CHUNKS', 'COMPILED_MATRIX_MAX_CHUNKS', 'FACTORED_MAX_CHUNK']


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


#: default chunk sizes: per-channel gates weigh the pairs inside a chunk by float64 factors, which stay finite for
#: chunks of up to FACTORED_MAX_CHUNK tokens (longer ones need [L, L, D] weights: measured at 4k tokens, that
#: product alone was 3x slower at L = 64 than at L = 16); scalar multipliers only need [L, L]
CHUNK_SIZE = 64


CHANNEL_GATE_CHUNK_SIZE = 16


def default_chunk_size(a: Optional[torch.Tensor], head_dim: int) -> int:
    """The chunk size for log multipliers ``a`` [.., Dg]: smaller for per-channel gates (Dg = D > 1)."""
    return CHANNEL_GATE_CHUNK_SIZE if a is not None and a.shape[-1] == head_dim and head_dim > 1 else CHUNK_SIZE


def chunked_scan(phi_q: torch.Tensor, phi_k: torch.Tensor, va: torch.Tensor, a: Optional[torch.Tensor],
                 chunk_size: Optional[int] = None) -> torch.Tensor:
    """The unnormalised causal scan on features by chunks, out_t = Q_t^T S_t: phi_q, phi_k [B, H, N, D], va
    [B, H, N, E], a [B|1, H, N|1, Dg] or None -> [B, H, N, E]; chunk_size None: ``default_chunk_size``."""
    return ChunkedCausalScan.apply(phi_q, phi_k, va, a, chunk_size or default_chunk_size(a, phi_q.shape[-1]))
