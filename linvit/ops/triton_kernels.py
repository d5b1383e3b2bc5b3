"""Triton kernels for non-causal linear attention: the forward and the closed-form backward, each fused.

The same function as ``linvit.ops.linear_attention`` (see ``linvit.ops.fused`` for the backward's formulas). With
A = phi(Q) [Nq, D], K' = w * phi(K) [N, D] (masked keys zeroed), S = K'^T [V | 1] [D, Dv + 1] and
den = A S[:, Dv] + eps * count, out = A S[:, :Dv] / den. Four kernels, two per direction:

    forward   _key_pass:     S partial sums over a contiguous range of keys      grid (chunks, B * H)
              _query_pass:   out, den for a block of queries                     grid (query blocks, B * H)
    backward  _grad_query:   dq for a block of queries, dS partial sums          grid (chunks, B * H)
              _grad_key:     dk, dv for a block of keys                          grid (key blocks, B * H)

Each program loads its q / k / v tiles once, applies the feature map (and its derivative) in registers, and
accumulates in float32. The sums over tokens (S forward, dS backward) are split into a fixed number of chunks per
head that depends only on the shapes (enough programs to fill the GPU); the chunk partials are summed by
``torch.sum`` in a fixed order: reductions are deterministic (no atomics). Inputs float32, bfloat16 or float16,
read through their strides (q, k, v may be views of timm's packed qkv projection); outputs in the inputs' dtype.
Head widths up to 128 (padded to a power of two >= 16, masked); any number of tokens.

Matmul precision: float32 inputs use exact float32 dots ("ieee"), half inputs use tf32 dots on float32 operands:
S is a sum over tokens and may exceed float16's range, so it is never cast down.

Under ``TRITON_INTERPRET=1`` (read when this module is imported) the kernels run on CPU tensors through Triton's
interpreter, which is how the tests check them without a GPU.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .fused import _eps_count

# the maps (by the id MAP the kernels take), dtypes and head widths served: linvit.ops.attention_op, which checks
# every call before it launches these kernels
__all__ = ['forward', 'backward']

_BLOCK_TOKENS = 64


@triton.jit
def _feature(x, MAP: tl.constexpr):
    """phi(x) for the map id MAP (0 elu1, 1 relu), float32 [..]."""
    if MAP == 0:
        return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))
    else:
        return tl.maximum(x, 0.0)


@triton.jit
def _feature_derivative(x, MAP: tl.constexpr):
    """phi'(x): elu1's is exp(min(x, 0)) (1 at 0, as autograd's), relu's 1 where x > 0 else 0."""
    if MAP == 0:
        return tl.exp(tl.minimum(x, 0.0))
    else:
        return tl.where(x > 0, 1.0, 0.0)


@triton.jit
def _load_state(ptr, bh, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Head bh's [D, DV + 1] float32 state (S or dS) from a contiguous [B * H, D, DV + 1] buffer, as
    (matrix [BLOCK_D, BLOCK_DV], last column [BLOCK_D]), zero-padded."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    base = ptr + bh * D * (DV + 1)
    matrix = tl.load(base + offs_d[:, None] * (DV + 1) + offs_e[None, :],
                     mask=(offs_d[:, None] < D) & (offs_e[None, :] < DV), other=0.0)
    column = tl.load(base + offs_d * (DV + 1) + DV, mask=offs_d < D, other=0.0)
    return matrix, column


@triton.jit
def _store_partial(ptr, bh, chunk, matrix, column, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr):
    """Write a chunk's partial [matrix | column] into slot (bh, chunk) of a [B * H, chunks, D, DV + 1] buffer."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    base = ptr + (bh * tl.num_programs(0) + chunk) * D * (DV + 1)
    tl.store(base + offs_d[:, None] * (DV + 1) + offs_e[None, :], matrix,
             mask=(offs_d[:, None] < D) & (offs_e[None, :] < DV))
    tl.store(base + offs_d * (DV + 1) + DV, column, mask=offs_d < D)


@triton.jit
def _load_keys(k_ptr, v_ptr, w_ptr, b, h, offs_n, in_n, skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swn,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MAP: tl.constexpr,
               HAS_W: tl.constexpr):
    """A tile of keys: (k [BLOCK_N, BLOCK_D] float32, K' = w * phi(k), v kept [BLOCK_N, BLOCK_DV] float32,
    weights w [BLOCK_N]; 1 without key weights). Masked keys (w = 0) give exact zeros in K' and v, also where their
    k or v are not finite; padding rows and columns are zero."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    in_k = in_n[:, None] & (offs_d[None, :] < D)
    x = tl.load(k_ptr + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=in_k, other=0.0)
    x = x.to(tl.float32)
    phi = tl.where(in_k, _feature(x, MAP), 0.0)
    v = tl.load(v_ptr + b * svb + h * svh + offs_n[:, None] * svn + offs_e[None, :] * svd,
                mask=in_n[:, None] & (offs_e[None, :] < DV), other=0.0)
    v = v.to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + b * swb + h * swh + offs_n * swn, mask=in_n, other=0.0)
        keep = w > 0
        phi = tl.where(keep[:, None], phi * w[:, None], 0.0)
        v = tl.where(keep[:, None], v, 0.0)
    else:
        w = tl.full((offs_n.shape[0],), 1.0, tl.float32)
    return x, phi, v, w


@triton.jit
def _key_pass(k_ptr, v_ptr, w_ptr, part_ptr, N, H, TOKENS_PER_PROG,
              skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swn,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_N: tl.constexpr, MAP: tl.constexpr, HAS_W: tl.constexpr, PRECISION: tl.constexpr):
    """part [B * H, chunks, D, DV + 1] <- [K'^T V | K'^T 1] over this program's chunk of keys."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    # 64-bit offsets: a sample's slice of a large packed projection can pass 2^31 elements
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    kv = tl.zeros((BLOCK_D, BLOCK_DV), dtype=tl.float32)
    key_sum = tl.zeros((BLOCK_D,), dtype=tl.float32)
    start = chunk * TOKENS_PER_PROG
    end = tl.minimum(start + TOKENS_PER_PROG, N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        _x, phi, v, _w = _load_keys(k_ptr, v_ptr, w_ptr, b, h, offs_n, offs_n < end, skb, skh, skn, skd,
                                    svb, svh, svn, svd, swb, swh, swn, D, DV, BLOCK_D, BLOCK_DV, MAP, HAS_W)
        kv += tl.dot(tl.trans(phi), v, input_precision=PRECISION)
        key_sum += tl.sum(phi, axis=0)
    _store_partial(part_ptr, bh, chunk, kv, key_sum, D, DV, BLOCK_D, BLOCK_DV)


@triton.jit
def _query_pass(q_ptr, s_ptr, count_ptr, out_ptr, den_ptr, NQ, H, eps_count,
                sqb, sqh, sqn, sqd, sob, soh, son, sod, scb, sch,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, MAP: tl.constexpr, HAS_W: tl.constexpr, PRECISION: tl.constexpr):
    """out [Nq, DV] = phi(q) S[:, :DV] / den, den [Nq] = phi(q) S[:, DV] + eps * count, for one block of queries.
    s: [B * H, D, DV + 1] float32 contiguous; den: [B * H, Nq] float32."""
    block = tl.program_id(0)
    bh = tl.program_id(1)
    # 64-bit offsets: a sample's slice of a large packed projection can pass 2^31 elements
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    in_m = offs_m < NQ
    s, key_sum = _load_state(s_ptr, bh, D, DV, BLOCK_D, BLOCK_DV)
    in_q = in_m[:, None] & (offs_d[None, :] < D)
    x = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :] * sqd, mask=in_q, other=0.0)
    phi = tl.where(in_q, _feature(x.to(tl.float32), MAP), 0.0)
    num = tl.dot(phi, s, input_precision=PRECISION)
    if HAS_W:
        eps_count = tl.load(count_ptr + b * scb + h * sch)
    den = tl.sum(phi * key_sum[None, :], axis=1) + eps_count
    out = num / den[:, None]
    in_o = in_m[:, None] & (offs_e[None, :] < DV)
    tl.store(out_ptr + b * sob + h * soh + offs_m[:, None] * son + offs_e[None, :] * sod,
             out.to(out_ptr.dtype.element_ty), mask=in_o)
    tl.store(den_ptr + bh * NQ + offs_m, den, mask=in_m)


@triton.jit
def _grad_query(q_ptr, g_ptr, o_ptr, den_ptr, s_ptr, dq_ptr, part_ptr, NQ, H, TOKENS_PER_PROG,
                sqb, sqh, sqn, sqd, sgb, sgh, sgn, sgd, sob, soh, son, sod, sdb, sdh, sdn, sdd,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, MAP: tl.constexpr, PRECISION: tl.constexpr):
    """For this program's chunk of queries, with G' = [g / den | -rowsum(g * out) / den]:
    dq = phi'(q) * (G' S^T) and part [B * H, chunks, D, DV + 1] <- phi(q)^T G' (the chunk's share of dS)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    # 64-bit offsets: a sample's slice of a large packed projection can pass 2^31 elements
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    s, key_sum = _load_state(s_ptr, bh, D, DV, BLOCK_D, BLOCK_DV)
    grad_kv = tl.zeros((BLOCK_D, BLOCK_DV), dtype=tl.float32)
    grad_key_sum = tl.zeros((BLOCK_D,), dtype=tl.float32)
    start = chunk * TOKENS_PER_PROG
    end = tl.minimum(start + TOKENS_PER_PROG, NQ)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < end
        in_q = in_m[:, None] & (offs_d[None, :] < D)
        in_o = in_m[:, None] & (offs_e[None, :] < DV)
        x = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :] * sqd, mask=in_q, other=0.0)
        x = x.to(tl.float32)
        phi = tl.where(in_q, _feature(x, MAP), 0.0)
        g = tl.load(g_ptr + b * sgb + h * sgh + offs_m[:, None] * sgn + offs_e[None, :] * sgd, mask=in_o, other=0.0)
        o = tl.load(o_ptr + b * sob + h * soh + offs_m[:, None] * son + offs_e[None, :] * sod, mask=in_o, other=0.0)
        den = tl.load(den_ptr + bh * NQ + offs_m, mask=in_m, other=1.0)
        g_over_den = g.to(tl.float32) / den[:, None]
        # the quotient rule's second term: the gradient at the normaliser column of A S
        grad_den = -tl.sum(g_over_den * o.to(tl.float32), axis=1)
        grad_phi = tl.dot(g_over_den, tl.trans(s), input_precision=PRECISION) + grad_den[:, None] * key_sum[None, :]
        dq = _feature_derivative(x, MAP) * grad_phi
        tl.store(dq_ptr + b * sdb + h * sdh + offs_m[:, None] * sdn + offs_d[None, :] * sdd,
                 dq.to(dq_ptr.dtype.element_ty), mask=in_q)
        grad_kv += tl.dot(tl.trans(phi), g_over_den, input_precision=PRECISION)
        grad_key_sum += tl.sum(phi * grad_den[:, None], axis=0)
    _store_partial(part_ptr, bh, chunk, grad_kv, grad_key_sum, D, DV, BLOCK_D, BLOCK_DV)


@triton.jit
def _grad_key(k_ptr, v_ptr, w_ptr, ds_ptr, dk_ptr, dv_ptr, N, H,
              skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swn,
              sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_N: tl.constexpr, MAP: tl.constexpr, HAS_W: tl.constexpr, PRECISION: tl.constexpr):
    """For one block of keys, with dS [D, DV + 1] = phi(Q)^T G': dK' = V dS[:, :DV]^T + dS[:, DV],
    dk = phi'(k) * w * dK', dv = K' dS[:, :DV]; masked keys get exactly zero gradients."""
    block = tl.program_id(0)
    bh = tl.program_id(1)
    # 64-bit offsets: a sample's slice of a large packed projection can pass 2^31 elements
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    in_n = offs_n < N
    grad_kv, grad_key_sum = _load_state(ds_ptr, bh, D, DV, BLOCK_D, BLOCK_DV)
    in_k = in_n[:, None] & (offs_d[None, :] < D)
    in_v = in_n[:, None] & (offs_e[None, :] < DV)
    x, phi, v, w = _load_keys(k_ptr, v_ptr, w_ptr, b, h, offs_n, in_n, skb, skh, skn, skd, svb, svh, svn, svd,
                              swb, swh, swn, D, DV, BLOCK_D, BLOCK_DV, MAP, HAS_W)
    grad_phi = tl.dot(v, tl.trans(grad_kv), input_precision=PRECISION) + grad_key_sum[None, :]
    dk = _feature_derivative(x, MAP) * grad_phi
    dv = tl.dot(phi, grad_kv, input_precision=PRECISION)
    if HAS_W:
        keep = w > 0
        dk = tl.where(keep[:, None], dk * w[:, None], 0.0)
        dv = tl.where(keep[:, None], dv, 0.0)
    tl.store(dk_ptr + b * sdkb + h * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd,
             dk.to(dk_ptr.dtype.element_ty), mask=in_k)
    tl.store(dv_ptr + b * sdvb + h * sdvh + offs_n[:, None] * sdvn + offs_e[None, :] * sdvd,
             dv.to(dv_ptr.dtype.element_ty), mask=in_v)


def _block_width(width: int) -> int:
    """Tile width for a head width: a power of two >= 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(width))


def _num_warps(block_d: int, block_dv: int) -> int:
    # a 128 x 128 float32 accumulator needs 64 registers a thread at 8 warps
    return 8 if block_d * block_dv > 64 * 64 else 4


def _num_stages(block_d: int, block_dv: int) -> int:
    """Software-pipelining depth of the token loops: Triton's default 3, or 2 for heads wider than 64 (the float32
    backward's query tile at D = Dv = 128 needs 172 KiB of shared memory at 3 stages, 139 KiB at 2; sm_80 has 163)."""
    return 3 if block_d * block_dv <= 64 * 64 else 2


def _tile_tokens(block_d: int, block_dv: int) -> int:
    """Tokens per tile: 64, or 32 for heads wider than 64 (the backward's key tile at D = Dv = 128 and 64 tokens
    needs 160 KiB of shared memory, more than GPUs before Hopper have)."""
    return _BLOCK_TOKENS if block_d * block_dv <= 64 * 64 else _BLOCK_TOKENS // 2


def _precision(dtype: torch.dtype) -> str:
    return 'ieee' if dtype == torch.float32 else 'tf32'


def _programs_per_head(device: torch.device) -> int:
    """How many programs the token-sum passes aim for in all (chunks * B * H): a few per multiprocessor."""
    if device.type == 'cuda':
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another: fewer, longer programs are faster


def _chunking(n_tokens: int, heads: int, device: torch.device) -> Tuple[int, int]:
    """(tokens per program, number of chunks) for a token-sum pass over n_tokens per head, B * H = heads.
    Depends only on the shapes and the device, so the summation order is the same on every call."""
    blocks = triton.cdiv(max(n_tokens, 1), _BLOCK_TOKENS)
    chunks = min(blocks, max(1, triton.cdiv(_programs_per_head(device), heads)))
    tokens = triton.cdiv(blocks, chunks) * _BLOCK_TOKENS
    return tokens, triton.cdiv(max(n_tokens, 1), tokens)


def _weights(key_weight: Optional[torch.Tensor], k: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int, int]]:
    """key_weight None or float32 [B, H|1, N] -> (a tensor to pass, its (b, h, n) strides; h stride 0 if shared)."""
    if key_weight is None:
        return k, (0, 0, 0)  # never read (HAS_W is off)
    h_stride = 0 if key_weight.shape[1] == 1 else key_weight.stride(1)
    return key_weight, (key_weight.stride(0), h_stride, key_weight.stride(2))


def _normaliser_eps(eps: float, n_keys: int, key_weight: Optional[torch.Tensor],
                    unused: torch.Tensor) -> Tuple[float, torch.Tensor, int, int]:
    """The normaliser's eps term as the query pass takes it: (eps * N, ``unused`` as a pointer it never reads, 0, 0)
    without key weights, else (0, eps * the kept weight [B, H|1, 1, 1] of ``linvit.ops.fused``, its b and h
    strides)."""
    if key_weight is None:
        return eps * n_keys, unused, 0, 0  # a real tensor: None pointers differ across Triton versions
    count = _eps_count(eps, n_keys, key_weight.unsqueeze(-1))
    return 0.0, count, count.stride(0), 0 if count.shape[1] == 1 else count.stride(1)


def _launch_options(q: torch.Tensor, v: torch.Tensor, map_id: int) -> Tuple[dict, int]:
    """(the kernels' shared meta-parameters and launch options, tokens per tile) for q [.., D] and v [.., Dv]."""
    D, DV = q.shape[-1], v.shape[-1]
    block_d, block_dv = _block_width(D), _block_width(DV)
    meta = dict(D=D, DV=DV, BLOCK_D=block_d, BLOCK_DV=block_dv, MAP=map_id, PRECISION=_precision(q.dtype),
                num_warps=_num_warps(block_d, block_dv), num_stages=_num_stages(block_d, block_dv))
    return meta, _tile_tokens(block_d, block_dv)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, map_id: int, eps: float,
            key_weight: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Writes out [B, H, Nq, Dv] (any strides, the inputs' dtype) from q [B, H, Nq, D], k [B, H, N, D],
    v [B, H, N, Dv] (any strides) and key_weight None or float32 [B, H|1, N]; returns (S [B, H, D, Dv + 1],
    den [B, H, Nq, 1]), float32, for the backward."""
    B, H, NQ, D = q.shape
    N, DV = k.shape[2], v.shape[3]
    heads = B * H
    meta, tile = _launch_options(q, v, map_id)
    w, w_strides = _weights(key_weight, k)
    tokens, chunks = _chunking(N, heads, q.device)
    part = torch.empty(heads, chunks, D, DV + 1, dtype=torch.float32, device=q.device)
    _key_pass[(chunks, heads)](k, v, w, part, N, H, tokens, *k.stride(), *v.stride(), *w_strides,
                               BLOCK_N=tile, HAS_W=key_weight is not None, **meta)
    s = part.sum(dim=1)  # [B * H, D, Dv + 1], a fixed-order reduction
    eps_count, count, count_b, count_h = _normaliser_eps(eps, N, key_weight, s)
    den = torch.empty(heads, NQ, dtype=torch.float32, device=q.device)
    _query_pass[(triton.cdiv(NQ, tile), heads)](
        q, s, count, out, den, NQ, H, eps_count, *q.stride(), *out.stride(), count_b, count_h,
        BLOCK_M=tile, HAS_W=key_weight is not None, **meta)
    return s.view(B, H, D, DV + 1), den.view(B, H, NQ, 1)


def backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             s: torch.Tensor, den: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, map_id: int,
             key_weight: Optional[torch.Tensor]) -> None:
    """Writes dq, dk, dv (shapes of q, k, v, any strides) from grad and out [B, H, Nq, Dv] (any strides), the
    forward's S [B, H, D, Dv + 1] and den [B, H, Nq, 1] (float32, contiguous) and key_weight as in ``forward``."""
    B, H, NQ, D = q.shape
    N, DV = k.shape[2], v.shape[3]
    heads = B * H
    meta, tile = _launch_options(q, v, map_id)
    s, den = s.contiguous(), den.contiguous()
    tokens, chunks = _chunking(NQ, heads, q.device)
    part = torch.empty(heads, chunks, D, DV + 1, dtype=torch.float32, device=q.device)
    _grad_query[(chunks, heads)](q, grad, out, den, s, dq, part, NQ, H, tokens, *q.stride(), *grad.stride(),
                                 *out.stride(), *dq.stride(), BLOCK_M=tile, **meta)
    grad_s = part.sum(dim=1)
    w, w_strides = _weights(key_weight, k)
    _grad_key[(triton.cdiv(N, tile), heads)](
        k, v, w, grad_s, dk, dv, N, H, *k.stride(), *v.stride(), *w_strides, *dk.stride(), *dv.stride(),
        BLOCK_N=tile, HAS_W=key_weight is not None, **meta)
