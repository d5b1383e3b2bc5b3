"""Triton kernels for non-causal linear attention: the forward and the closed-form backward, two passes each.

The same function as ``linvit.ops.linear_attention`` (see ``linvit.ops.linear_attn.function`` for the backward's
formulas). With A = phi(Q) [Nq, D], K' = w * phi(K) [N, D] (masked keys zeroed), the state
S^T = [V | 1]^T K' [Dv + 1, D] (its last row is the key sum z) and den = A z + eps * count, out = A S[:, :Dv] / den.
Four kernels, two per direction, each on a grid (programs per head, B * H) whose programs walk a contiguous range
of tokens in tiles:

    forward   _key_pass:     partial S^T over the program's keys
              _query_pass:   sums the partials (program 0 of a head stores S^T), then out, den for its queries
    backward  _grad_query:   dq for the program's queries, partial dS^T
              _grad_key:     sums the dS^T partials, then dk, dv for its keys

The halves run on their own too (``state``, ``apply`` and their backwards, for ``linvit::linear_attention_state`` /
``_apply``): the key pass with its partials summed into the state, the query pass reading a given state as its one
partial (scaled per head by 1 / max(count, 1), as the fused forward scales by 1 / N), and the backward passes with
the gradient at the state as their one partial.

Partial sums are reduced by their consumer in a fixed order: deterministic, no atomics, no extra launch. The number
of programs per head depends only on the shapes and the GPU (enough programs to fill it, at most ``MAX_CHUNKS`` so
the consumers' sums stay small next to the tokens they read).

Precision: tiles are loaded in the inputs' dtype; the feature map (and its derivative) runs in float32 registers;
the dots take operands in the inputs' dtype (bfloat16 / float16 tensor cores; exact float32 dots for float32 inputs)
and accumulate in float32. S, z, den and every sum over tokens stay float32 in memory. Where the state is a dot
operand it is first scaled to a mean (times 1 / N), so a half-precision cast cannot overflow however many tokens
there are: out = (A S / N) / (den / N) is the same quotient. Outputs are written in the inputs' dtype through their
strides (q, k, v may be views of timm's packed qkv projection). Head widths up to 128 (padded to a power of two
>= 16, masked); any number of tokens. The backward reads neither the output nor anything but the saved S and den:
the quotient rule's rowsum(g * out) is recomputed as rowsum(A * (G S^T)) / den from a product it needs anyway.

Under ``TRITON_INTERPRET=1`` (read when this module is imported) the kernels run on CPU tensors through Triton's
interpreter, which is how the tests check them without a GPU. ``linvit.bench.kernel_report`` compiles every variant
for sm_90 and sm_80 without a GPU and reports registers, spills and the dots' operand types.
"""
import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .backend import KERNEL_FEATURE_MAPS
from .function import _eps_count

# the maps (by the branch MAP the kernels take, KERNEL_FEATURE_MAPS), dtypes and head widths served:
# linvit.ops.linear_attn.backend, which checks every call before it launches these kernels
__all__ = ['forward', 'backward', 'state', 'state_backward', 'apply', 'apply_backward', 'KERNELS', 'launch_meta']

_BLOCK_TOKENS = 64
#: the most programs per head of a pass: each consumer program sums this many [Dv + 1, D] float32 partials
MAX_CHUNKS = 16


#: the branches of _feature and _feature_derivative, by name (KERNEL_FEATURE_MAPS gives each map's)
_ELU1 = tl.constexpr(KERNEL_FEATURE_MAPS['elu1'])
_RELU = tl.constexpr(KERNEL_FEATURE_MAPS['relu'])


@triton.jit
def _feature(x, MAP: tl.constexpr):
    """phi(x) for the map branch MAP (_ELU1, _RELU), float32 [..]; any other MAP does not compile."""
    tl.static_assert((MAP == _ELU1) or (MAP == _RELU), "MAP names no feature map of the kernels")
    if MAP == _ELU1:
        return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))
    else:
        return tl.maximum(x, 0.0)


@triton.jit
def _feature_derivative(phi, MAP: tl.constexpr):
    """phi'(x) read off phi = phi(x) (float32), so x need not stay in registers: elu1's exp(min(x, 0)) is
    min(phi, 1) (1 at 0, as autograd's), relu's is 1 where phi > 0 else 0; any other MAP does not compile."""
    tl.static_assert((MAP == _ELU1) or (MAP == _RELU), "MAP names no feature map of the kernels")
    if MAP == _ELU1:
        return tl.minimum(phi, 1.0)
    else:
        return tl.where(phi > 0, 1.0, 0.0)


@triton.jit
def _sum_states(ptr, first, count, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr):
    """The sum, in slot order, of ``count`` [DV + 1, D] float32 states at slots first.. of a contiguous buffer, as
    (matrix [BLOCK_DV, BLOCK_D] of rows < DV, row DV [BLOCK_D]), zero-padded. Rows are D floats: aligned loads."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    size = (DV + 1) * D
    base = ptr + first.to(tl.int64) * size
    in_matrix = (offs_e[:, None] < DV) & (offs_d[None, :] < D)
    matrix = tl.zeros((BLOCK_DV, BLOCK_D), dtype=tl.float32)
    row = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for slot in range(count):
        matrix += tl.load(base + slot * size + offs_e[:, None] * D + offs_d[None, :], mask=in_matrix, other=0.0)
        row += tl.load(base + slot * size + DV * D + offs_d, mask=offs_d < D, other=0.0)
    return matrix, row


@triton.jit
def _store_state(ptr, slot, matrix, row, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
    """Write [matrix ; row] ([DV + 1, D] float32) into ``slot`` of a contiguous buffer of such states."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    base = ptr + slot.to(tl.int64) * ((DV + 1) * D)
    tl.store(base + offs_e[:, None] * D + offs_d[None, :], matrix,
             mask=(offs_e[:, None] < DV) & (offs_d[None, :] < D))
    tl.store(base + DV * D + offs_d, row, mask=offs_d < D)


@triton.jit
def _load_keys(k_ptr, v_ptr, w_ptr, b, h, offs_n, in_n, skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swn,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MAP: tl.constexpr,
               HAS_W: tl.constexpr):
    """A tile of keys: (phi(k) [BLOCK_N, BLOCK_D] float32, K' = w * phi(k) and v [BLOCK_N, BLOCK_DV] in the inputs'
    dtype, weights w [BLOCK_N]; 1 without key weights). Masked keys (w = 0) give exact zeros in K' and v, also
    where their k or v are not finite; padding rows and columns are zero."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    in_k = in_n[:, None] & (offs_d[None, :] < D)
    x = tl.load(k_ptr + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=in_k, other=0.0)
    phi = tl.where(in_k, _feature(x.to(tl.float32), MAP), 0.0)
    weighted = phi
    v = tl.load(v_ptr + b * svb + h * svh + offs_n[:, None] * svn + offs_e[None, :] * svd,
                mask=in_n[:, None] & (offs_e[None, :] < DV), other=0.0)
    if HAS_W:
        w = tl.load(w_ptr + b * swb + h * swh + offs_n * swn, mask=in_n, other=0.0)
        keep = w > 0
        weighted = tl.where(keep[:, None], phi * w[:, None], 0.0)
        v = tl.where(keep[:, None], v, 0.0)
    else:
        w = tl.full((offs_n.shape[0],), 1.0, tl.float32)
    return phi, weighted.to(k_ptr.dtype.element_ty), v, w


@triton.jit
def _load_queries(q_ptr, b, h, offs_m, in_m, sqb, sqh, sqn, sqd, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  MAP: tl.constexpr):
    """phi(q) [BLOCK_M, BLOCK_D] float32 of a tile of queries; padding rows and columns are zero."""
    offs_d = tl.arange(0, BLOCK_D)
    in_q = in_m[:, None] & (offs_d[None, :] < D)
    x = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :] * sqd, mask=in_q, other=0.0)
    return tl.where(in_q, _feature(x.to(tl.float32), MAP), 0.0)


@triton.jit
def _key_pass(k_ptr, v_ptr, w_ptr, part_ptr, N, H, TOKENS_PER_PROG,
              skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swn,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_N: tl.constexpr, MAP: tl.constexpr, HAS_W: tl.constexpr, PRECISION: tl.constexpr):
    """part [B * H, programs, DV + 1, D] <- [V | 1]^T K' over this program's range of keys."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    # 64-bit offsets: a sample's slice of a large packed projection can pass 2^31 elements
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    kv_t = tl.zeros((BLOCK_DV, BLOCK_D), dtype=tl.float32)
    key_sum = tl.zeros((BLOCK_D,), dtype=tl.float32)
    start = chunk * TOKENS_PER_PROG
    end = tl.minimum(start + TOKENS_PER_PROG, N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        _phi, phi, v, _w = _load_keys(k_ptr, v_ptr, w_ptr, b, h, offs_n, offs_n < end, skb, skh, skn, skd,
                                    svb, svh, svn, svd, swb, swh, swn, D, DV, BLOCK_D, BLOCK_DV, MAP, HAS_W)
        kv_t = tl.dot(tl.trans(v), phi, kv_t, input_precision=PRECISION)
        # the key sum of the same (rounded) features as the numerator's: a constant v comes out exactly
        key_sum += tl.sum(phi.to(tl.float32), axis=0)
    _store_state(part_ptr, bh * tl.num_programs(0) + chunk, kv_t, key_sum, D, DV, BLOCK_D, BLOCK_DV)


@triton.jit
def _query_pass(q_ptr, part_ptr, s_ptr, count_ptr, out_ptr, den_ptr, NQ, H, KEY_CHUNKS, TOKENS_PER_PROG, inv_n,
                eps_count, sqb, sqh, sqn, sqd, sob, soh, son, sod, scb, sch,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, MAP: tl.constexpr, HAS_W: tl.constexpr, PRECISION: tl.constexpr):
    """S^T = the sum of the key pass's KEY_CHUNKS partials (stored to s [B * H, DV + 1, D] by program 0), then for
    this program's range of queries out = phi(q) S[:, :DV] / den and den [B * H, Nq] = phi(q) z + eps * count."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    # 64-bit offsets: a sample's slice of a large packed projection can pass 2^31 elements
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    s_t, key_sum = _sum_states(part_ptr, bh * KEY_CHUNKS, KEY_CHUNKS, D, DV, BLOCK_D, BLOCK_DV)
    if chunk == 0:
        _store_state(s_ptr, bh, s_t, key_sum, D, DV, BLOCK_D, BLOCK_DV)
    if HAS_W:
        eps_count = tl.load(count_ptr + b * scb + h * sch)
    # the mean state as the dot's operand (times 1 / N: no overflow in a half-precision cast), [BLOCK_D, BLOCK_DV]
    s_mean = tl.trans((s_t * inv_n).to(q_ptr.dtype.element_ty))
    offs_e = tl.arange(0, BLOCK_DV)
    start = chunk * TOKENS_PER_PROG
    end = tl.minimum(start + TOKENS_PER_PROG, NQ)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < end
        phi = _load_queries(q_ptr, b, h, offs_m, in_m, sqb, sqh, sqn, sqd, D, BLOCK_D, MAP).to(q_ptr.dtype.element_ty)
        num_mean = tl.dot(phi, s_mean, input_precision=PRECISION)
        den = tl.sum(phi.to(tl.float32) * key_sum[None, :], axis=1) + eps_count
        out = num_mean / (den * inv_n)[:, None]
        tl.store(out_ptr + b * sob + h * soh + offs_m[:, None] * son + offs_e[None, :] * sod,
                 out.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & (offs_e[None, :] < DV))
        tl.store(den_ptr + bh.to(tl.int64) * NQ + offs_m, den, mask=in_m)


@triton.jit
def _grad_query(q_ptr, g_ptr, den_ptr, s_ptr, dq_ptr, part_ptr, NQ, H, TOKENS_PER_PROG, inv_n,
                sqb, sqh, sqn, sqd, sgb, sgh, sgn, sgd, sdb, sdh, sdn, sdd,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, MAP: tl.constexpr, PRECISION: tl.constexpr):
    """For this program's range of queries, with the mean state S_m = S / N, den_m = den / N, G = g / den_m and
    P = G S_m^T: dq = phi'(q) * (P - rowsum(phi(q) * P) / den_m * z_m), and part [B * H, programs, DV + 1, D]
    <- [G | -rowsum(phi(q) * P) / den_m]^T phi(q), this range's share of the gradient at S_m^T. g is the upstream
    gradient [Nq, DV] (any strides)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    # 64-bit offsets: a sample's slice of a large packed projection can pass 2^31 elements
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    s_t, key_sum = _sum_states(s_ptr, bh, 1, D, DV, BLOCK_D, BLOCK_DV)
    s_mean_t = (s_t * inv_n).to(q_ptr.dtype.element_ty)  # [BLOCK_DV, BLOCK_D]
    key_mean = key_sum * inv_n
    grad_s_t = tl.zeros((BLOCK_DV, BLOCK_D), dtype=tl.float32)
    grad_key_sum = tl.zeros((BLOCK_D,), dtype=tl.float32)
    start = chunk * TOKENS_PER_PROG
    end = tl.minimum(start + TOKENS_PER_PROG, NQ)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < end
        phi32 = _load_queries(q_ptr, b, h, offs_m, in_m, sqb, sqh, sqn, sqd, D, BLOCK_D, MAP)
        g = tl.load(g_ptr + b * sgb + h * sgh + offs_m[:, None] * sgn + offs_e[None, :] * sgd,
                    mask=in_m[:, None] & (offs_e[None, :] < DV), other=0.0)
        den_mean = tl.load(den_ptr + bh.to(tl.int64) * NQ + offs_m, mask=in_m, other=1.0) * inv_n
        # 1 / den_m scales rows after the dot (P) and phi before it (dS): g / den_m in half precision would
        # overflow where den_m ~ eps (relu rows without features), phi / den_m cannot (phi ~ 0 there)
        p = tl.dot(g, s_mean_t, input_precision=PRECISION) / den_mean[:, None]  # [BLOCK_M, BLOCK_D]
        # the quotient rule's second term, -rowsum(g * out) / den_m, without reading out
        grad_den = -tl.sum(phi32 * p, axis=1) / den_mean
        dq = _feature_derivative(phi32, MAP) * (p + grad_den[:, None] * key_mean[None, :])
        tl.store(dq_ptr + b * sdb + h * sdh + offs_m[:, None] * sdn + offs_d[None, :] * sdd,
                 dq.to(dq_ptr.dtype.element_ty), mask=in_m[:, None] & (offs_d[None, :] < D))
        phi_over_den = (phi32 / den_mean[:, None]).to(q_ptr.dtype.element_ty)
        grad_s_t = tl.dot(tl.trans(g), phi_over_den, grad_s_t, input_precision=PRECISION)
        grad_key_sum += tl.sum(phi32 * grad_den[:, None], axis=0)
    _store_state(part_ptr, bh * tl.num_programs(0) + chunk, grad_s_t, grad_key_sum, D, DV, BLOCK_D, BLOCK_DV)


@triton.jit
def _grad_key(k_ptr, v_ptr, w_ptr, part_ptr, dk_ptr, dv_ptr, N, H, QUERY_CHUNKS, TOKENS_PER_PROG, inv_n,
              skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swn,
              sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_N: tl.constexpr, MAP: tl.constexpr, HAS_W: tl.constexpr, PRECISION: tl.constexpr):
    """dS^T = the sum of _grad_query's QUERY_CHUNKS partials / N (the gradient at S^T), then for this program's
    range of keys: dK' = V dS[:, :DV]^T + dS[:, DV], dk = phi'(k) * w * dK', dv = K' dS[:, :DV]; masked keys get
    exactly zero gradients."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    # 64-bit offsets: a sample's slice of a large packed projection can pass 2^31 elements
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    grad_s_t, grad_key_sum = _sum_states(part_ptr, bh * QUERY_CHUNKS, QUERY_CHUNKS, D, DV, BLOCK_D, BLOCK_DV)
    grad_s_t = (grad_s_t * inv_n).to(k_ptr.dtype.element_ty)  # [BLOCK_DV, BLOCK_D]
    grad_key_sum = grad_key_sum * inv_n
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    start = chunk * TOKENS_PER_PROG
    end = tl.minimum(start + TOKENS_PER_PROG, N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_n = offs_n < end
        phi32, phi, v, w = _load_keys(k_ptr, v_ptr, w_ptr, b, h, offs_n, in_n, skb, skh, skn, skd, svb, svh, svn, svd,
                                  swb, swh, swn, D, DV, BLOCK_D, BLOCK_DV, MAP, HAS_W)
        grad_phi = tl.dot(v, grad_s_t, input_precision=PRECISION) + grad_key_sum[None, :]
        dk = _feature_derivative(phi32, MAP) * grad_phi
        dv = tl.dot(phi, tl.trans(grad_s_t), input_precision=PRECISION)
        if HAS_W:
            keep = w > 0
            dk = tl.where(keep[:, None], dk * w[:, None], 0.0)
            dv = tl.where(keep[:, None], dv, 0.0)
        tl.store(dk_ptr + b * sdkb + h * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd,
                 dk.to(dk_ptr.dtype.element_ty), mask=in_n[:, None] & (offs_d[None, :] < D))
        tl.store(dv_ptr + b * sdvb + h * sdvh + offs_n[:, None] * sdvn + offs_e[None, :] * sdvd,
                 dv.to(dv_ptr.dtype.element_ty), mask=in_n[:, None] & (offs_e[None, :] < DV))


#: every kernel, for the ahead-of-time report (linvit.bench.kernel_report)
KERNELS = (_key_pass, _query_pass, _grad_query, _grad_key)


def _block_width(width: int) -> int:
    """Tile width for a head width: a power of two >= 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(width))


@functools.cache
def launch_meta(d: int, dv: int, dtype: torch.dtype, map_id: int,
                hopper: bool = True) -> Tuple[Tuple[Tuple[str, object], ...], int]:
    """(the kernels' shared compile-time parameters and launch options as items, tokens per tile) for head widths
    D, Dv, inputs of ``dtype``, the feature map id and the GPU generation (Hopper's wgmma keeps its accumulators
    lighter on registers than Ampere's mma): computed once per combination, not per call.

    8 warps everywhere: at 4, a 64-token half-precision tile spills in the backward's query pass on sm_90 (255
    registers). Half-precision heads up to 64 take 3 pipeline stages and 64-token tiles on Hopper, 32 before (64
    spill in the backward on sm_80); wider heads, and float32 (whose exact dots run as scalar multiply-adds),
    32-token tiles and 2 stages. That keeps every half variant free of spills on sm_90, and on sm_80 up to D = 64,
    and every variant within sm_80's 163 KiB of shared memory (``tools/kernel_report.py``, Triton 3.6 and 3.8)."""
    if map_id not in KERNEL_FEATURE_MAPS.values():
        raise ValueError(f"map_id {map_id!r} is no feature-map branch of the kernels ({KERNEL_FEATURE_MAPS})")
    block_d, block_dv = _block_width(d), _block_width(dv)
    small = dtype != torch.float32 and block_d * block_dv <= 64 * 64
    meta = dict(D=d, DV=dv, BLOCK_D=block_d, BLOCK_DV=block_dv, MAP=map_id,
                PRECISION='ieee' if dtype == torch.float32 else 'tf32', num_warps=8, num_stages=3 if small else 2)
    return tuple(meta.items()), _BLOCK_TOKENS if small and hopper else _BLOCK_TOKENS // 2


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _hopper(device: torch.device) -> bool:
    """Whether the kernels compile for Hopper or later (sm_90+): the interpreter counts as Hopper."""
    return device.type != 'cuda' or _capability(_device_index(device)) >= 9


def _program_target(device: torch.device) -> int:
    """How many programs a pass aims for in all (programs per head * B * H): two per multiprocessor on a GPU
    (queried once per device); one under the interpreter, which runs programs one after another."""
    if device.type == 'cuda':
        return 2 * _multiprocessors(_device_index(device))
    return 1


def _split(n_tokens: int, heads: int, tile: int, device: torch.device) -> Tuple[int, int]:
    """(tokens per program, programs per head) for a pass over n_tokens per head, B * H = heads: whole tiles per
    program. Depends only on the shapes and the device, so the summation order is the same on every call."""
    tiles = triton.cdiv(max(n_tokens, 1), tile)
    programs = max(1, min(tiles, MAX_CHUNKS, _program_target(device) // heads))
    tokens = triton.cdiv(tiles, programs) * tile
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
    without key weights, else (0, eps * the kept weight [B, H|1, 1, 1] of ``linvit.ops.linear_attn.function``, its
    b and h strides)."""
    if key_weight is None:
        return eps * n_keys, unused, 0, 0  # a real tensor: None pointers differ across Triton versions
    count = _eps_count(eps, n_keys, key_weight.unsqueeze(-1))
    return 0.0, count, count.stride(0), 0 if count.shape[1] == 1 else count.stride(1)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, map_id: int, eps: float,
            key_weight: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Writes out [B, H, Nq, Dv] (any strides, the inputs' dtype) from q [B, H, Nq, D], k [B, H, N, D],
    v [B, H, N, Dv] (any strides) and key_weight None or float32 [B, H|1, N]; returns (S^T [B, H, Dv + 1, D],
    den [B, H, Nq, 1]), float32 sums, for the backward."""
    B, H, NQ, D = q.shape
    N, DV = k.shape[2], v.shape[3]
    heads = B * H
    items, tile = launch_meta(D, DV, q.dtype, map_id, _hopper(q.device))
    meta = dict(items)
    has_w = key_weight is not None
    w, w_strides = _weights(key_weight, k)
    key_tokens, key_chunks = _split(N, heads, tile, q.device)
    part = torch.empty(heads, key_chunks, DV + 1, D, dtype=torch.float32, device=q.device)
    _key_pass[(key_chunks, heads)](k, v, w, part, N, H, key_tokens, *k.stride(), *v.stride(), *w_strides,
                                   BLOCK_N=tile, HAS_W=has_w, **meta)
    s_t = torch.empty(heads, DV + 1, D, dtype=torch.float32, device=q.device)
    den = torch.empty(heads, NQ, dtype=torch.float32, device=q.device)
    eps_count, count, count_b, count_h = _normaliser_eps(eps, N, key_weight, s_t)
    query_tokens, query_chunks = _split(NQ, heads, tile, q.device)
    _query_pass[(query_chunks, heads)](
        q, part, s_t, count, out, den, NQ, H, key_chunks, query_tokens, 1.0 / N, eps_count, *q.stride(),
        *out.stride(), count_b, count_h, BLOCK_M=tile, HAS_W=has_w, **meta)
    return s_t.view(B, H, DV + 1, D), den.view(B, H, NQ, 1)


def backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s_t: torch.Tensor,
             den: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, map_id: int,
             key_weight: Optional[torch.Tensor]) -> None:
    """Writes dq, dk, dv (shapes of q, k, v, any strides) from grad [B, H, Nq, Dv] (any strides), the forward's
    S^T [B, H, Dv + 1, D] and den [B, H, Nq, 1] (float32, contiguous) and key_weight as in ``forward``."""
    B, H, NQ, D = q.shape
    N, DV = k.shape[2], v.shape[3]
    heads = B * H
    items, tile = launch_meta(D, DV, q.dtype, map_id, _hopper(q.device))
    meta = dict(items)
    query_tokens, query_chunks = _split(NQ, heads, tile, q.device)
    part = torch.empty(heads, query_chunks, DV + 1, D, dtype=torch.float32, device=q.device)
    _grad_query[(query_chunks, heads)](q, grad, den, s_t, dq, part, NQ, H, query_tokens, 1.0 / N, *q.stride(),
                                       *grad.stride(), *dq.stride(), BLOCK_M=tile, **meta)
    w, w_strides = _weights(key_weight, k)
    key_tokens, key_chunks = _split(N, heads, tile, q.device)
    _grad_key[(key_chunks, heads)](
        k, v, w, part, dk, dv, N, H, query_chunks, key_tokens, 1.0 / N, *k.stride(), *v.stride(), *w_strides,
        *dk.stride(), *dv.stride(), BLOCK_N=tile, HAS_W=key_weight is not None, **meta)


# ---------------------------------------------------------------- the two halves on their own (state and apply)


def state(k: torch.Tensor, v: torch.Tensor, map_id: int, key_weight: Optional[torch.Tensor]) -> torch.Tensor:
    """The key pass alone: the summed state [B, H, Dv + 1, D] (float32; rows as ``AttentionState.sums``) of
    k [B, H, N, D], v [B, H, N, Dv] (any strides) with key_weight None or float32 [B, H|1, N]."""
    B, H, N, D = k.shape
    DV = v.shape[3]
    heads = B * H
    items, tile = launch_meta(D, DV, k.dtype, map_id, _hopper(k.device))
    w, w_strides = _weights(key_weight, k)
    key_tokens, key_chunks = _split(N, heads, tile, k.device)
    part = torch.empty(heads, key_chunks, DV + 1, D, dtype=torch.float32, device=k.device)
    _key_pass[(key_chunks, heads)](k, v, w, part, N, H, key_tokens, *k.stride(), *v.stride(), *w_strides,
                                   BLOCK_N=tile, HAS_W=key_weight is not None, **dict(items))
    return part.sum(dim=1).view(B, H, DV + 1, D)


def state_backward(grad_sums: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                   map_id: int, key_weight: Optional[torch.Tensor]) -> None:
    """Writes dk, dv (shapes of k, v, any strides) from the gradient at the state, grad_sums [B, H, Dv + 1, D]
    (float32): the backward's key pass with that gradient as its one partial."""
    B, H, N, D = k.shape
    DV = v.shape[3]
    heads = B * H
    items, tile = launch_meta(D, DV, k.dtype, map_id, _hopper(k.device))
    part = grad_sums.contiguous()  # [B * H, 1, DV + 1, D] in memory: one partial per head
    w, w_strides = _weights(key_weight, k)
    key_tokens, key_chunks = _split(N, heads, tile, k.device)
    _grad_key[(key_chunks, heads)](
        k, v, w, part, dk, dv, N, H, 1, key_tokens, 1.0, *k.stride(), *v.stride(), *w_strides, *dk.stride(),
        *dv.stride(), BLOCK_N=tile, HAS_W=key_weight is not None, **dict(items))


def _mean_state(sums: torch.Tensor, count: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sums / c contiguous, c [B, H, 1, 1]) with c = max(count, 1): the state as the passes' dot operand takes it,
    scaled like a mean so that a half-precision cast cannot overflow (the key pass's 1 / N, per head)."""
    scale = count.clamp_min(1.0)[..., None, None]
    return (sums / scale).contiguous(), scale


def apply(q: torch.Tensor, sums: torch.Tensor, count: torch.Tensor, out: torch.Tensor, map_id: int,
          eps: float) -> torch.Tensor:
    """The query pass alone: writes out [B, H, Nq, Dv] (any strides and dtype) for q [B, H, Nq, D] (any strides)
    attending to the state sums [B, H, Dv + 1, D] and count [B, H] (float32); returns den [B, H, Nq, 1] (float32)
    divided by max(count, 1), which ``apply_backward`` reads."""
    B, H, NQ, D = q.shape
    DV = sums.shape[2] - 1
    heads = B * H
    items, tile = launch_meta(D, DV, q.dtype, map_id, _hopper(q.device))
    s_mean, scale = _mean_state(sums, count)
    # eps * count on the scale of the mean state: den / c = A z / c + eps * count / c
    eps_count = (eps * count.clamp_min(1e-30) / scale[..., 0, 0]).contiguous()
    s_t = torch.empty(heads, DV + 1, D, dtype=torch.float32, device=q.device)  # program 0's copy (not read)
    den = torch.empty(heads, NQ, dtype=torch.float32, device=q.device)
    query_tokens, query_chunks = _split(NQ, heads, tile, q.device)
    _query_pass[(query_chunks, heads)](
        q, s_mean, s_t, eps_count, out, den, NQ, H, 1, query_tokens, 1.0, 0.0, *q.stride(), *out.stride(),
        *eps_count.stride(), BLOCK_M=tile, HAS_W=True, **dict(items))
    return den.view(B, H, NQ, 1)


def apply_backward(grad: torch.Tensor, q: torch.Tensor, sums: torch.Tensor, count: torch.Tensor, den: torch.Tensor,
                   dq: torch.Tensor, map_id: int) -> torch.Tensor:
    """Writes dq (shape of q, any strides) from grad [B, H, Nq, Dv] (any strides), the state and ``apply``'s den;
    returns the gradient at the state sums [B, H, Dv + 1, D] (float32)."""
    B, H, NQ, D = q.shape
    DV = sums.shape[2] - 1
    heads = B * H
    items, tile = launch_meta(D, DV, q.dtype, map_id, _hopper(q.device))
    s_mean, scale = _mean_state(sums, count)
    query_tokens, query_chunks = _split(NQ, heads, tile, q.device)
    part = torch.empty(heads, query_chunks, DV + 1, D, dtype=torch.float32, device=q.device)
    _grad_query[(query_chunks, heads)](q, grad, den.contiguous(), s_mean, dq, part, NQ, H, query_tokens, 1.0,
                                       *q.stride(), *grad.stride(), *dq.stride(), BLOCK_M=tile, **dict(items))
    # the partials hold c times the gradient at the sums (den / c in their denominators)
    return part.sum(dim=1).view(B, H, DV + 1, D) / scale
