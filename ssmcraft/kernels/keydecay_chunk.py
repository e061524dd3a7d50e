"""Chunked recurrences with a decay over the key dimension (GLA, RetNet, HGRN): Triton kernels
on tensor cores.

The family (``scalar_decay`` / ``diagonal_decay`` IR whose decay varies over ``m`` at most)::

    S_t = S_{t-1} diag(a_t) + p_t q_t^T        S [d, m] = "V x K",  a_t > 0 of dims () or (m,)
    y_t = oc_t . (S_t oq_t) + oh_t

Kernels keep the transpose ``h = S^T`` ([K, V], FLA's layout) and take, per token,
``q = oq`` (readout key), ``k = q`` (insert key), ``v = p`` (inserted value) and
``g = log a`` (fp32, ``[B, T, H, K]``)::

    h_t = diag(e^{g_t}) h_{t-1} + k_t v_t^T,        o_t = h_t^T q_t

GLA: ``k = k, v = x, g = log alpha``; RetNet: ``g = log gamma`` broadcast over K; HGRN:
``k = f - 1, v = -x, g = log f``; linear attention: ``g = 0``. ``oc`` and ``oh`` are applied
to ``o`` in PyTorch, and the coefficients come from the generated reference module, so
autograd carries their gradients to the spec's inputs and params.

Chunked form (chunk of BT tokens, local index i, ``b_i = sum_{r<=i} g_r`` the within-chunk
cumulative sum, ``bl = b_{last}``, ``h0`` the state at the chunk's start)::

    o_i   = (q_i e^{b_i})^T h0 + sum_{j<=i} A_ij v_j,   A_ij = sum_k q_ik k_jk e^{b_ik - b_jk}
    h_end = diag(e^{bl}) h0 + (k e^{bl - b})^T V

Stability. ``g <= 0`` (a <= 1) makes ``b`` non-increasing, so every exponential below has a
non-positive exponent and never overflows (a factor that underflows is one whose true value is
below the float range). ``A`` is built from sub-blocks of BC = 16 rows: for row block I and an
earlier column block, with ``r_I`` = b at the first row of I,
``A[I, J] = (q_I e^{b_I - r_I}) (k_J e^{r_I - b_J})^T`` (both exponents <= 0), a tensor-core
product; the diagonal 16 x 16 blocks are summed elementwise with ``e^{b_i - b_j}``, j <= i
(exponent <= 0). Backward products against ``dA`` use the same references (``dq``) or
``s_J`` = b at the last row of J (``dk``). For a > 1 the same factors are the true growth
factors within one chunk (at most a^BT), finite whenever the recurrence itself is.
Precision: ``gc`` stores cumulative sums restarted in every 16-row sub-block, and every exponent
is formed as a sum of such block-local sums and block totals (the reference points are the
sub-block boundaries), never as a difference of two chunk-long sums: a chunk-long sum of strong
decays reaches |b| ~ 320 whose fp32 ulp (3e-5) would otherwise be the error of every factor.

Backward (per chunk, ``dO``, ``dH`` = gradient of ``h_end``; ``dA_ij = dO_i . v_j``, j <= i)::

    dv  = A^T dO + (k e^{bl-b}) dH
    dq  = e^b o (dO h0^T) + [sum_{j<=i} dA_ij k_j e^{b_i - b_j}]
    dk  = e^{bl-b} o (V dH^T) + [sum_{i>=j} dA_ij q_i e^{b_i - b_j}]
    dh0 = e^{bl} o dH + (q e^b)^T dO                      (the reverse recurrence over chunks)

Gradient of the decay (the reverse cumulative-sum identity). Every use of ``b_ik`` is a factor
``e^{+b_ik}`` next to ``q_ik`` or ``e^{-b_ik}`` next to ``k_ik``, except through ``bl``. So,
treating ``b`` and ``bl`` as independent,
``dL/db_ik = q_ik dq_ik - k_ik dk_ik`` (the diagonal term ``i = j`` of A cancels, as it should)
and ``dL/dbl_k = e^{bl_k} sum_v h0[k, v] dH[k, v] + sum_j k_jk e^{bl_k - b_jk} (v_j . dH[k, :])``.
Since ``b_i = sum_{r<=i} g_r`` and ``bl = sum_r g_r`` over the chunk's tokens,

    dg_r = sum_{i >= r} (q_i dq_i - k_i dk_i) + dL/dbl          (reverse cumsum within the chunk)

Kernels, top to bottom: ``_fwd_state_kernel`` (sequential over chunks per (key block, value
block, head): the block-local cumulative sums ``gc``, the chunk-start states ``hs [B, H, NT, K, V]`` and the
final state), ``_fwd_out_kernel`` (parallel over chunks: A and o), ``_bwd_state_kernel`` (reverse
over chunks: ``dhs``, the state gradient at each chunk's end, and dh0) and ``_bwd_grad_kernel``
(parallel over chunks: recomputes A, then dq, dk, dv, dg). Saved for the backward: the inputs,
g, ``gc`` (the size of g) and ``hs``; the [B, T, H, BT] matrix A is recomputed, not stored.

Shapes (kernel level, FLA layout): q, k, g [B, T, H, K]; v [B, T, H, V]; initial / final state
[B, H, K, V] fp32; output [B, T, H, V] in v's dtype. I/O fp32, bf16 or fp16; state, cumulative
sums and every reduction fp32. Measured figures: BENCHMARKS.md, "Key-decay chunked".
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERPRET_BV: int | None = None     # value block under the interpreter (tests set it small)
INTERPRET_BK: int | None = None     # key block of the sequential kernels under the interpreter
POISON = False                      # tests: fill every output buffer with NaN before the kernels write it
CHUNK = 64                          # chunk size used by the family entry points (tests set 16 / 32)
SUB = 16                            # sub-block of the intra-chunk matrix (BC)
MAX_K = 256                         # whole key rows live in registers in the parallel kernels
BACKEND_NAME = "keydecay-chunked"


def _tune(configs, key, prune=None):
    """Autotune on a GPU; under the interpreter the launcher passes a config chosen by rule.
    ``prune(configs, nargs, **kwargs)`` drops configs by rule before any is compiled or timed
    (the autotuner runs every config it keeps, so a config that faults kills the process even
    when it would not have won)."""
    if _INTERPRET:
        return lambda fn: fn
    return triton.autotune(configs=configs, key=key,
                           prune_configs_by={"early_config_prune": prune} if prune else None)


GRAD_CONFIGS = [triton.Config({"BV": bv}, num_warps=w, num_stages=s)
                for bv, w, s in ((64, 4, 1), (64, 8, 1), (32, 4, 1))]


def grad_configs(configs, nargs=None, **kw):
    """Configs of ``_bwd_grad_kernel`` that may run at these constexprs (the autotuner's
    ``early_config_prune``; ``BK`` is the padded key block).

    With 8 warps (two warpgroups splitting the N dimension of each tensor-core product), Triton 3.6
    on an H200 miscompiles the products whose N is the key block (dO H^T, V dH^T, dA K, dA^T Q)
    when BK = 16 (every K <= 16): compute-sanitizer reports "Invalid __shared__ read of size 1024
    bytes" and the launch faults with an illegal memory access (seen with fp32 I/O; the bf16 launch
    ran clean under the sanitizer, but bf16 at BK = 16 still faults intermittently, cause open, so
    it is pruned there too). 4 warps run clean under the sanitizer at BK = 16. 8 warps are kept
    only for BK >= 64, where every GPU check has run them (BENCHMARKS.md, "Key-decay chunked", run 3)."""
    if kw.get("BK", 64) < 64:
        return [c for c in configs if c.num_warps < 8]
    return list(configs)


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------

@triton.jit
def _rows(i_b, i_h, t, T, H):
    """Row ids (int64) of time steps ``t`` clamped into [0, T-1] (rows past the end repeat the
    last one, so that cumulative sums stay flat there)."""
    return (i_b * T + tl.maximum(tl.minimum(t, T - 1), 0)).to(tl.int64) * H + i_h


@_tune([triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
        for bk, bv, w, s in ((64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 2, 2))],
       key=["H", "K", "V", "BT", "BC", "HAS_H0"])
@triton.jit(do_not_specialize=["T", "NT"])
def _fwd_state_kernel(k, v, g, h0, gc, hs, ht, T, NT,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, PREC: tl.constexpr):
    """Sequential over chunks, one program per (key block x value block, batch * head):
    gc = cumulative sums of g within each BC-row sub-block (key rows are independent, so
    blocks over K are too), hs[chunk] = state at the chunk's start, ht = final state."""
    i_kv = tl.program_id(0)
    i_bh = tl.program_id(1)
    NV = tl.cdiv(V, BV)
    i_k = i_kv // NV
    i_v = i_kv % NV
    i_b = i_bh // H
    i_h = i_bh % H
    DT = hs.dtype.element_ty
    o_i = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]

    if HAS_H0:
        b_h = tl.load(h0 + i_bh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_t in range(NT):
        o_t = i_t * BT + o_i
        m_t = o_t < T
        row = (i_b * T + o_t).to(tl.int64) * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        tl.store(hs + (i_bh.to(tl.int64) * NT + i_t) * K * V + p_kv, b_h.to(DT), mask=m_kv)
        b_g = tl.load(g + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        if i_v == 0:      # block-local cumulative sums (rows past T: g = 0)
            b_lc = tl.reshape(tl.cumsum(tl.reshape(b_g, (BT // BC, BC, BK)), axis=1), (BT, BK))
            tl.store(gc + row[:, None] * K + o_k[None, :], b_lc, mask=m_tk)
        b_bl = tl.sum(b_g, axis=0)                                   # bl
        b_sx = tl.cumsum(b_g, axis=0, reverse=True) - b_g            # bl - b_j, summed directly
        b_kk = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_kd = (b_kk * tl.exp(b_sx)).to(DT)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.).to(DT)
        b_h = b_h * tl.exp(b_bl)[:, None] + tl.dot(tl.trans(b_kd), b_v, input_precision=PREC)
    tl.store(ht + i_bh.to(tl.int64) * K * V + p_kv, b_h, mask=m_kv)


@triton.jit
def _ref_rows(gc, i_b, i_h, t0, T, H, K: tl.constexpr, o_i, o_k, m_k, BC: tl.constexpr, OFF: tl.constexpr):
    """[BT, BK] tile of gc at row (i // BC) * BC + OFF of each row i's sub-block (clamped)."""
    r = _rows(i_b, i_h, t0 + (o_i // BC) * BC + OFF, T, H)
    return tl.load(gc + r[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)


@triton.jit
def _ref_vec(gc, i_b, i_h, t, T, H, K: tl.constexpr, o_k, m_k):
    """[BK] row of gc at time t (clamped)."""
    return tl.load(gc + _rows(i_b, i_h, t, T, H) * K + o_k, mask=m_k, other=0.)


@triton.jit
def _tot(gc, i_b, i_h, t0, M: tl.constexpr, T, H, K: tl.constexpr, o_k, m_k, BC: tl.constexpr):
    """[BK] sum of g over sub-block M of the chunk starting at t0 (0 if the block starts past T)."""
    s = _ref_vec(gc, i_b, i_h, t0 + M * BC + BC - 1, T, H, K, o_k, m_k)
    return tl.where(t0 + M * BC < T, s, 0.)


@triton.jit
def _chunk_sums(gc, b_lc, i_b, i_h, t0, T, H, K: tl.constexpr, o_i, o_k, m_k,
                BT: tl.constexpr, BC: tl.constexpr):
    """From the block-local sums lc (each a direct sum, never a difference of large ones):
    b = the chunk's prefix sums b_i, sx = bl - b_j, bl, and own = the total of each row's block."""
    b_own = _ref_rows(gc, i_b, i_h, t0, T, H, K, o_i, o_k, m_k, BC, BC - 1)
    blk = (o_i // BC)[:, None]
    b_pre = tl.zeros_like(b_lc)
    b_post = tl.zeros_like(b_lc)
    b_bl = tl.zeros_like(_ref_vec(gc, i_b, i_h, t0, T, H, K, o_k, m_k))
    for M in tl.static_range(BT // BC):
        b_t = _tot(gc, i_b, i_h, t0, M, T, H, K, o_k, m_k, BC)[None, :]
        b_pre += tl.where(blk > M, b_t, 0.)
        b_post += tl.where(blk < M, b_t, 0.)
        b_bl += tl.sum(b_t, axis=0)
    return b_pre + b_lc, b_post + (b_own - b_lc), b_bl, b_own


@triton.jit
def _kt(b_k, b_lc, b_own, gc, i_b, i_h, t0, I: tl.constexpr, T, H, K: tl.constexpr, o_i, o_k, m_k,
        BC: tl.constexpr, DT: tl.constexpr):
    """k_j e^{R_I - b_j} for rows j before sub-block I (0 elsewhere); R_I = b just before block I.
    The exponent (tot_J - lc_j) + sum of the whole blocks between is a sum of g's, <= 0 for g <= 0."""
    blk = (o_i // BC)[:, None]
    before = blk < I
    b_x = b_own - b_lc
    for M in tl.static_range(1, I):
        b_x += tl.where(blk < M, _tot(gc, i_b, i_h, t0, M, T, H, K, o_k, m_k, BC)[None, :], 0.)
    return tl.where(before, b_k * tl.exp(tl.where(before, b_x, 0.)), 0.).to(DT)


@triton.jit
def _intra_offdiag(b_qs, b_k, b_lc, b_own, gc, i_b, i_h, t0, T, H, K: tl.constexpr, o_i, o_k, m_k,
                   BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """Off-diagonal sub-blocks of A: rows of block I against the columns before it, as tensor-core
    products of (q e^{b - R_I}) (b_qs = q e^{lc}, for every row) and (k e^{R_I - b})."""
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for I in tl.static_range(1, BT // BC):
        b_kt = _kt(b_k, b_lc, b_own, gc, i_b, i_h, t0, I, T, H, K, o_i, o_k, m_k, BC, DT)
        b_a = tl.dot(b_qs, tl.trans(b_kt), input_precision=PREC)
        b_A += tl.where(((o_i // BC) == I)[:, None], b_a, 0.)
    return b_A


@_tune([triton.Config({"BV": bv}, num_warps=w, num_stages=s)
        for bv, w, s in ((64, 4, 2), (64, 8, 2), (32, 4, 2))],
       key=["H", "K", "V", "BT", "BC"])
@triton.jit(do_not_specialize=["T", "NT"])
def _fwd_out_kernel(q, k, v, gc, hs, o, T, NT,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Per chunk: A (lower triangular incl. the diagonal) and o = (q e^b) h0 + A v."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    DT = o.dtype.element_ty
    o_i = tl.arange(0, BT)
    t0 = i_t * BT
    o_t = t0 + o_i
    m_t = o_t < T
    row = _rows(i_b, i_h, o_t, T, H)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_lc = tl.load(gc + row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
    b_b, b_sx, b_bl, b_own = _chunk_sums(gc, b_lc, i_b, i_h, t0, T, H, K, o_i, o_k, m_k, BT, BC)

    b_qs = (b_q * tl.exp(b_lc)).to(DT)
    b_A = _intra_offdiag(b_qs, b_k, b_lc, b_own, gc, i_b, i_h, t0, T, H, K, o_i, o_k, m_k, BT, BC, DT, PREC)
    # diagonal sub-blocks: column j = g(i) = (i // BC) * BC + c of row i, j <= i
    for c in range(BC):
        o_g = (o_i // BC) * BC + c
        m_g = (t0 + o_g) < T
        r_g = _rows(i_b, i_h, t0 + o_g, T, H)
        b_kg = tl.load(k + r_g[:, None] * K + o_k[None, :], mask=m_g[:, None] & m_k[None, :], other=0.).to(tl.float32)
        b_bg = tl.load(gc + r_g[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
        low = ((o_i % BC) >= c)[:, None]
        b_e = tl.exp(tl.where(low, b_lc - b_bg, 0.))
        b_ac = tl.sum(tl.where(low, b_q * b_kg * b_e, 0.), axis=1)
        b_A = tl.where((o_i[None, :] == o_g[:, None]) & low, b_ac[:, None], b_A)

    b_Ad = b_A.to(DT)
    b_qe = (b_q * tl.exp(b_b)).to(DT)
    base = (i_bh.to(tl.int64) * NT + i_t) * K * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        b_h = tl.load(hs + base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(DT)
        b_o = tl.dot(b_qe, b_h.to(DT), input_precision=PREC)
        b_o += tl.dot(b_Ad, b_v, input_precision=PREC)
        tl.store(o + row[:, None] * V + o_v[None, :], b_o.to(DT), mask=m_tv)


@_tune([triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
        for bk, bv, w, s in ((64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 2, 2))],
       key=["H", "K", "V", "BT", "HAS_DHT"])
@triton.jit(do_not_specialize=["T", "NT"])
def _bwd_state_kernel(q, g, do, dht, dhs, dh0, T, NT,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, PREC: tl.constexpr):
    """Reverse over chunks: dhs[chunk] = gradient of the state at the chunk's end;
    dH <- e^{bl} o dH + (q e^b)^T dO; dh0 = the gradient of the initial state."""
    i_kv = tl.program_id(0)
    i_bh = tl.program_id(1)
    NV = tl.cdiv(V, BV)
    i_k = i_kv // NV
    i_v = i_kv % NV
    i_b = i_bh // H
    i_h = i_bh % H
    DT = dhs.dtype.element_ty
    o_i = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]

    if HAS_DHT:
        b_dh = tl.load(dht + i_bh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
    else:
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    for j in range(NT):
        i_t = NT - 1 - j
        t0 = i_t * BT
        o_t = t0 + o_i
        m_t = o_t < T
        row = _rows(i_b, i_h, o_t, T, H)
        tl.store(dhs + (i_bh.to(tl.int64) * NT + i_t) * K * V + p_kv, b_dh.to(DT), mask=m_kv)
        b_g = tl.load(g + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.).to(tl.float32)
        b_b = tl.cumsum(b_g, axis=0)
        b_bl = tl.sum(b_g, axis=0)
        b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.).to(tl.float32)
        b_qe = (b_q * tl.exp(b_b)).to(DT)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.).to(DT)
        b_dh = b_dh * tl.exp(b_bl)[:, None] + tl.dot(tl.trans(b_qe), b_do, input_precision=PREC)
    tl.store(dh0 + i_bh.to(tl.int64) * K * V + p_kv, b_dh, mask=m_kv)


@_tune(GRAD_CONFIGS, key=["H", "K", "V", "BT", "BC"], prune=grad_configs)
@triton.jit(do_not_specialize=["T", "NT"])
def _bwd_grad_kernel(q, k, v, gc, hs, dhs, do, dq, dk, dv, dg, T, NT,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Per chunk: recompute A, then dq, dk, dg (phase 1: value-axis products; phase 2: intra-chunk
    terms and the decay's gradient) and dv (phase 3)."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    DT = q.dtype.element_ty
    o_i = tl.arange(0, BT)
    t0 = i_t * BT
    o_t = t0 + o_i
    m_t = o_t < T
    row = _rows(i_b, i_h, o_t, T, H)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    base = (i_bh.to(tl.int64) * NT + i_t) * K * V
    b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_lc = tl.load(gc + row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
    b_b, b_sx, b_bl, b_own = _chunk_sums(gc, b_lc, i_b, i_h, t0, T, H, K, o_i, o_k, m_k, BT, BC)

    # ---- phase 1: dA = dO V^T, dO h0^T, V dH^T, sum_v h0 dH ------------------------------
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dqh = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkh = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(DT)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(DT)
        b_h = tl.load(hs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dh = tl.load(dhs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dA += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_dqh += tl.dot(b_do, tl.trans(b_h.to(DT)), input_precision=PREC)
        b_dkh += tl.dot(b_v, tl.trans(b_dh.to(DT)), input_precision=PREC)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    b_dA = tl.where(o_i[:, None] >= o_i[None, :], b_dA, 0.)

    # ---- phase 2: A; dq, dk (inter + intra); dg --------------------------------------------
    b_eq = tl.exp(b_lc)              # e^{b_i - R_I}, R_I = b just before row i's block
    b_ek = tl.exp(b_own - b_lc)      # e^{R_{J+1} - b_j}
    b_qs = (b_q * b_eq).to(DT)
    b_A = _intra_offdiag(b_qs, b_k, b_lc, b_own, gc, i_b, i_h, t0, T, H, K, o_i, o_k, m_k, BT, BC, DT, PREC)
    b_dqo = tl.zeros([BT, BK], dtype=tl.float32)
    b_dko = tl.zeros([BT, BK], dtype=tl.float32)
    b_dAt = tl.trans(b_dA)
    blk = (o_i // BC)[:, None]
    for I in tl.static_range(1, BT // BC):
        # dq of block I from the columns before it: dA[I, :I] (k e^{R_I - b})
        b_kt = _kt(b_k, b_lc, b_own, gc, i_b, i_h, t0, I, T, H, K, o_i, o_k, m_k, BC, DT)
        b_dqo += tl.dot(tl.where(blk == I, b_dA, 0.).to(DT), b_kt, input_precision=PREC)
        # dk of block J = I - 1 from the rows after it: dA[I:, J]^T (q e^{b - R_I})
        after = blk >= I
        b_x = b_lc
        for M in tl.static_range(I, BT // BC):
            b_x += tl.where(blk > M, _tot(gc, i_b, i_h, t0, M, T, H, K, o_k, m_k, BC)[None, :], 0.)
        b_qt = tl.where(after, b_q * tl.exp(tl.where(after, b_x, 0.)), 0.).to(DT)
        b_dko += tl.dot(tl.where(blk == I - 1, b_dAt, 0.).to(DT), b_qt, input_precision=PREC)
    b_ebl = tl.exp(b_sx)                                                                  # e^{bl - b}
    b_dkh = b_dkh * b_ebl
    b_dq = tl.exp(b_b) * b_dqh + b_eq * b_dqo
    b_dk = b_dkh + b_ek * b_dko
    # diagonal sub-blocks: partner row g(i) = (i // BC) * BC + c; one exponential serves
    # A and dq (g <= i: e^{b_i - b_g}) and dk (g >= i: e^{b_g - b_i})
    for c in range(BC):
        o_g = (o_i // BC) * BC + c
        m_g = (t0 + o_g) < T
        r_g = _rows(i_b, i_h, t0 + o_g, T, H)
        m_gk = m_g[:, None] & m_k[None, :]
        b_kg = tl.load(k + r_g[:, None] * K + o_k[None, :], mask=m_gk, other=0.).to(tl.float32)
        b_qg = tl.load(q + r_g[:, None] * K + o_k[None, :], mask=m_gk, other=0.).to(tl.float32)
        b_bg = tl.load(gc + r_g[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
        low = ((o_i % BC) >= c)[:, None]
        up = ((o_i % BC) <= c)[:, None]
        b_x = b_lc - b_bg
        b_e = tl.exp(tl.where(low, b_x, tl.where(up, -b_x, 0.)))
        sel = o_i[None, :] == o_g[:, None]
        b_ac = tl.sum(tl.where(low, b_q * b_kg * b_e, 0.), axis=1)
        b_A = tl.where(sel & low, b_ac[:, None], b_A)
        b_dag = tl.sum(tl.where(sel, b_dA, 0.), axis=1)        # dA[i, g(i)]
        b_dga = tl.sum(tl.where(sel, b_dAt, 0.), axis=1)       # dA[g(i), i]
        b_dq += tl.where(low, b_dag[:, None] * b_kg * b_e, 0.)
        b_dk += tl.where(up, b_dga[:, None] * b_qg * b_e, 0.)
    b_dbl = tl.sum(b_k * b_dkh, axis=0) + tl.exp(b_bl) * b_hdh
    b_db = b_q * b_dq - b_k * b_dk
    b_dg = tl.cumsum(b_db, axis=0, reverse=True) + b_dbl[None, :]
    tl.store(dq + row[:, None] * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + row[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + row[:, None] * K + o_k[None, :], b_dg.to(dg.dtype.element_ty), mask=m_tk)

    # ---- phase 3: dv = A^T dO + (k e^{bl - b}) dH ---------------------------------------------
    b_Ad = b_A.to(DT)
    b_kd = (b_k * b_ebl).to(DT)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(DT)
        b_dh = tl.load(dhs + base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.)
        b_dv = tl.dot(tl.trans(b_Ad), b_do, input_precision=PREC)
        b_dv += tl.dot(b_kd, b_dh.to(DT), input_precision=PREC)
        tl.store(dv + row[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)


# ----------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------

def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))



def _prec(dtype) -> str:
    # fp32 I/O: three-pass tf32 (fp32-accurate); bf16/fp16 I/O: the operands are bf16/fp16
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _state_opts(K: int, V: int) -> dict:
    """Blocks of the sequential kernels, chosen by rule under the interpreter (autotuned on a GPU)."""
    if not _INTERPRET:
        return {}
    return {"BK": INTERPRET_BK or _pow2(K), "BV": INTERPRET_BV or _pow2(V)}


def _par_opts(V: int) -> dict:
    """Value block of the parallel kernels, by rule under the interpreter."""
    if not _INTERPRET:
        return {}
    return {"BV": INTERPRET_BV or _pow2(V)}


def _state_grid(K, V, BH):
    return lambda meta: (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]), BH)


def _empty(*shape, device, dtype):
    if POISON:
        return torch.full(shape, float("nan"), device=device, dtype=dtype)
    return torch.empty(*shape, device=device, dtype=dtype)


def _fwd(q, k, v, g, h0, BT):
    """o [B,T,H,V] (v's dtype), ht [B,H,K,V] fp32, gc [B,T,H,K] fp32, hs [B,H,NT,K,V]."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt, dev = v.dtype, v.device
    NT = triton.cdiv(T, BT)
    prec = _prec(dt)
    gc = _empty(B, T, H, K, device=dev, dtype=torch.float32)
    hs = _empty(B, H, NT, K, V, device=dev, dtype=dt)
    ht = _empty(B, H, K, V, device=dev, dtype=torch.float32)
    _fwd_state_kernel[_state_grid(K, V, B * H)](
        k, v, g, h0 if h0 is not None else ht, gc, hs, ht, T, NT,
        H=H, K=K, V=V, BT=BT, BC=min(SUB, BT), HAS_H0=h0 is not None, PREC=prec, **_state_opts(K, V))
    o = _empty(B, T, H, V, device=dev, dtype=dt)
    _fwd_out_kernel[(NT, B * H)](q, k, v, gc, hs, o, T, NT, H=H, K=K, V=V, BT=BT, BC=min(SUB, BT),
                                 BK=_pow2(K), PREC=prec, **_par_opts(V))
    return o, ht, gc, hs


def _bwd(q, k, v, g, gc, hs, do, dht, BT):
    """(dq, dk, dv in the I/O dtype; dg fp32 [B,T,H,K]; dh0 fp32 [B,H,K,V])."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt, dev = v.dtype, v.device
    NT = triton.cdiv(T, BT)
    prec = _prec(dt)
    do = do.to(dt).contiguous()
    has_dht = dht is not None
    dht = dht.float().contiguous() if has_dht else hs
    dhs = _empty(B, H, NT, K, V, device=dev, dtype=dt)
    dh0 = _empty(B, H, K, V, device=dev, dtype=torch.float32)
    _bwd_state_kernel[_state_grid(K, V, B * H)](
        q, g, do, dht, dhs, dh0, T, NT, H=H, K=K, V=V, BT=BT, HAS_DHT=has_dht, PREC=prec, **_state_opts(K, V))
    dq = _empty(B, T, H, K, device=dev, dtype=dt)
    dk = _empty(B, T, H, K, device=dev, dtype=dt)
    dv = _empty(B, T, H, V, device=dev, dtype=dt)
    dg = _empty(B, T, H, K, device=dev, dtype=torch.float32)
    _bwd_grad_kernel[(NT, B * H)](q, k, v, gc, hs, dhs, do, dq, dk, dv, dg, T, NT, H=H, K=K, V=V, BT=BT,
                                  BC=min(SUB, BT), BK=_pow2(K), PREC=prec, **_par_opts(V))
    return dq, dk, dv, dg, dh0


# ----------------------------------------------------------------------------------------
# autograd Function
# ----------------------------------------------------------------------------------------

class KeyDecayChunkFunction(torch.autograd.Function):
    """(q, k, v, g, h0|None) -> (o, ht|None), FLA layout; gradients for all five (and via dht)."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, output_final_state, chunk_size):
        o, ht, gc, hs = _fwd(q, k, v, g, h0, chunk_size)
        if any(ctx.needs_input_grad[:5]):
            ctx.save_for_backward(q, k, v, g, gc, hs)
        ctx.chunk_size = chunk_size
        ctx.has_h0 = h0 is not None
        return o, (ht if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, gc, hs = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, dg, dh0 = _bwd(q, k, v, g, gc, hs, do, dht, ctx.chunk_size)
        return dq, dk, dv, dg, (dh0 if ctx.has_h0 else None), None, None


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------

_IO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def chunk_key_decay(q, k, v, g, *, initial_state=None, output_final_state: bool = False,
                    chunk_size: int = 64):
    """h_t = diag(exp(g_t)) h_{t-1} + k_t v_t^T;  o_t = h_t^T q_t  (FLA's chunk_gla with scale 1).

    Args:
        q: readout key [B, T, H, K].
        k: insert key [B, T, H, K].
        v: inserted value [B, T, H, V]; its dtype (fp32, bf16 or fp16) is the I/O dtype.
        g: log decay [B, T, H, K] (any float dtype; used in fp32). g <= 0 is the stable regime.
        initial_state: [B, H, K, V] (kept fp32) or None.
        output_final_state: also return the state [B, H, K, V] (fp32).
        chunk_size: 16, 32 or 64.
    Returns:
        o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32 or None. Differentiable in
        q, k, v, g and initial_state (a gradient on the final state flows back too).
    """
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    dt = v.dtype
    if dt not in _IO_DTYPES:
        raise ValueError(f"chunk_key_decay: I/O dtype must be one of {_IO_DTYPES}, got {dt}")
    B, T, H, K = k.shape
    V = v.shape[-1]
    if K > MAX_K:
        raise ValueError(f"chunk_key_decay: K = {K} > {MAX_K} is not supported")
    if T == 0:
        o = v.new_zeros(B, 0, H, V)
        S = initial_state.float() if initial_state is not None else v.new_zeros(B, H, K, V, dtype=torch.float32)
        return o, (S if output_final_state else None)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, ht = KeyDecayChunkFunction.apply(q.to(dt).contiguous(), k.to(dt).contiguous(), v.contiguous(),
                                        g.float().contiguous(), h0, output_final_state, chunk_size)
    return o, ht


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.kernels.triton_backend)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if this family runs ``ir``, else the reason it does not."""
    name = ir.spec_name
    if ir.kind not in ("scalar_decay", "diagonal_decay"):
        return f"{name}: structure {ir.kind!r}, not a scalar or diagonal decay"
    if ir.readout is not None:
        return f"{name}: element-wise readout (not oc . (S oq) + oh)"
    if "B" in ir.slots or "p" not in ir.slots or "q" not in ir.slots:
        return f"{name}: the input term does not factor as p q^T"
    d, m = ir.dims

    def dims(slot):
        co = ir.coefficient(slot)
        return None if co is None else tuple(co.dims)
    a = ir.coefficient("a")
    if a is None:
        return f"{name}: no decay slot a"
    if dims("a") not in ((), (m,)):
        return f"{name}: decay a varies over {dims('a')}; this family takes a decay over the key dimension ({m},) or a scalar"
    if a.expr.is_positive is not True:
        return f"{name}: decay a = {a.expr} is not provably positive (log a is needed); declare its inputs positive or bounded"
    if dims("p") not in ((), (d,)):
        return f"{name}: p varies over {dims('p')}, not ({d},)"
    if dims("q") != (m,):
        return f"{name}: q varies over {dims('q')}, not ({m},)"
    if dims("oq") != (m,):
        return f"{name}: readout key oq varies over {dims('oq')}, not ({m},)"
    if dims("oc") not in (None, (), (d,)):
        return f"{name}: readout scale oc varies over {dims('oc')}"
    if "oh" in ir.slots and dims("oh") not in ((), (d,)):
        return f"{name}: readout offset oh varies over {dims('oh')}"
    return None


def supports_sizes(ir, sizes: dict, mode: str) -> str | None:
    """Refuse a key dimension too large for the parallel kernels' register tiles."""
    K = sizes.get(ir.dims[1])
    if K is not None and K > MAX_K:
        return f"K = {K} > {MAX_K} (whole key rows are held in registers)"
    return None


def supports_inputs(ir, inputs, mode) -> str | None:
    """``supports_sizes`` on the sizes of these inputs (the Triton backend's hook)."""
    m = ir.dims[1]
    sizes = {m: inputs[n].shape[-1] for n, dims in ir.inputs.items() if tuple(dims) == (m,) and n in inputs}
    return supports_sizes(ir, sizes, mode)


def _tok(x, B, T, H, n, ref):
    """A slot value ([B|1, T|1, H|1, r, c] tensor or number) -> [B, T, H, n] (broadcast)."""
    if not isinstance(x, torch.Tensor):
        return torch.full((B, T, H, n), float(x), device=ref.device, dtype=ref.dtype)
    return x.expand(B, T, H, *x.shape[3:]).reshape(B, T, H, -1).expand(B, T, H, n)


def forward(obj, lay, co, output_final_state):
    """Run the family on laid-out coefficients (see ssmcraft.kernels.reference.layout).

    co: slot -> tensor [B|1, T|1, H|1, r, c] or number. Returns (y [B, T, H, d] in lay.dtype,
    S_T [B, H, d, m] fp32 or None); autograd reaches every slot tensor and lay.S0.
    """
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    io = lay.out_dtype if lay.out_dtype in _IO_DTYPES else torch.float32
    ref = next(t for t in list(co.values()) + list(lay.env.values()) if isinstance(t, torch.Tensor))
    a = co["a"]
    if isinstance(a, torch.Tensor):
        g = torch.log(a.float())
    else:
        g = torch.tensor(float(a), device=ref.device).log()
    g = _tok(g, B, T, H, m, ref.float())
    k = _tok(co["q"], B, T, H, m, ref).to(io)
    q = _tok(co["oq"], B, T, H, m, ref).to(io)
    v = _tok(co["p"], B, T, H, d, ref).to(io)
    h0 = None if lay.S0 is None else lay.S0.transpose(-1, -2)
    o, ht = chunk_key_decay(q, k, v, g, initial_state=h0, output_final_state=output_final_state,
                            chunk_size=CHUNK)
    y = o.to(lay.dtype)
    oc = co.get("oc", 1)
    if isinstance(oc, torch.Tensor):
        y = y * _tok(oc, B, T, H, d, ref)
    elif float(oc) != 1.0:
        y = y * float(oc)
    oh = co.get("oh")
    if oh is not None:
        y = y + (_tok(oh, B, T, H, d, ref) if isinstance(oh, torch.Tensor) else float(oh))
    S = None if ht is None else ht.transpose(-1, -2)
    return y, S


def forward_inputs(obj, inputs: dict, params: dict | None, initial_state, output_final_state: bool):
    """The backend's entry: layout + generated coefficients (PyTorch) + the chunked kernel.
    Returns (y [B, T, H, d] in the inputs' dtype, S_T [B, H, d, m] fp32 or None)."""
    from ssmcraft.kernels.reference import layout
    lay = layout(obj.ir, obj.spec, inputs, params, initial_state)
    co = obj.module.coefficients(lay.env, lay.d, lay.m)
    y, S = forward(obj, lay, co, output_final_state)
    return y.to(lay.out_dtype), S
