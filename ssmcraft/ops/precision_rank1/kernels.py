"""The Triton kernels of the precision family: the chunked precision recurrence in float64, forward
and backward; the algebra, shapes and host code are in ``ssmcraft.ops.precision_rank1.chunk``."""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.tiles import state_block
from ssmcraft.ops.common.tuning import tune

# float64 [K, K] tiles (P and, backward, its gradient): more warps keep them in registers. ptxas gives
# the backward at 8 or 16 warps only 64 registers a thread unless told it may use more (then it spills
# 10 KB a thread instead of 2.4 KB, sm_90, K = 64). A fourth config, 4 warps capped at 168 registers
# (three programs an SM, the forward spilling ~0.3 KB a thread), won at no key on an H200: 4 warps
# uncapped did (B=8 T=2048 H=16 and the checks' H=2, both forms)
_WARPS = [triton.Config({}, num_warps=4), triton.Config({}, num_warps=8, maxnreg=255),
          triton.Config({}, num_warps=16, maxnreg=128)]


@triton.jit
def _sequence(cu, i_b, T, VARLEN: tl.constexpr):
    """(first row, length) of program ``i_b``'s sequence: sequence ``i_b`` of a packed row (``cu`` its
    offsets) where VARLEN, else batch row ``i_b`` of T tokens."""
    if VARLEN:
        bos = tl.load(cu + i_b)
        return bos.to(tl.int64), tl.load(cu + i_b + 1) - bos
    else:
        return (i_b * T).to(tl.int64), T


@triton.jit
def _chunk(k, lam, beta, eta, bos, i_h, s0, n, H: tl.constexpr, K: tl.constexpr, o_k, m_k,
           BC: tl.constexpr, HAS_BETA: tl.constexpr, HAS_ETA: tl.constexpr, KT: tl.constexpr):
    """The n (<= BC) tokens from token s0: their rows (``row [BC]``, int64, and mask ``m_t``) and k
    ([BC, BK], or its transpose [BK, BC] where KT), lam, beta, eta [BC] in float64. Rows past n read
    as k = 0, lam = beta = 1, eta = 0: a token that changes nothing (its pivot is its Gamma, its gain
    and its share of every product zero)."""
    o_c = tl.arange(0, BC)
    m_t = o_c < n
    row = (bos + s0 + o_c).to(tl.int64) * H + i_h
    if KT:
        b_k = tl.load(k + row[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.).to(tl.float64)
    else:
        b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.).to(tl.float64)
    b_lam = tl.load(lam + row, mask=m_t, other=1.).to(tl.float64)
    if HAS_BETA:
        b_beta = tl.load(beta + row, mask=m_t, other=1.).to(tl.float64)
    else:
        b_beta = tl.full([BC], 1., tl.float64)
    if HAS_ETA:
        b_eta = tl.load(eta + row, mask=m_t, other=0.).to(tl.float64)
    else:
        b_eta = tl.where(m_t, 1., 0.).to(tl.float64)
    return row, m_t, b_k, b_lam, b_beta, b_eta


@triton.jit
def _pick(x, o_c, j):
    """Entry ``j`` of a vector ``x [BC]`` (a masked sum: registers cannot be indexed)."""
    return tl.sum(tl.where(o_c == j, x, 0.), axis=0)


@triton.jit
def _cholesky_inverse(a, o_c, BC: tl.constexpr):
    """The lower Cholesky factor L of a symmetric positive definite ``a [BC, BC]`` (float64) and L^-1.

    Both right-looking, column j of L and row j of L^-1 in the same iteration: column j of L is
    column j of the trailing Schur complement over the square root of its pivot, then the outer
    product leaves the next complement; row j of L^-1 is row j of Y (the identity less the rows of
    L^-1 found so far, each times its column of L) over that pivot's root, then Y loses column j of
    L times it. The pivots come from a vector of the complement's diagonal, updated alongside, so
    that the four reductions of an iteration (column and row j of ``a``, the pivot, row j of Y) are
    independent and the iteration's dependent chain is one reduction, a square root and a division
    (IEEE: ``tl.math.rsqrt`` is ``rsqrt.approx.f64`` on sm_90). ``a`` is symmetrised first and each
    column read twice, as a column and as a row (equal, ``a`` staying exactly symmetric): the outer
    product needs it along both axes, and a second reduction within a warp is cheaper than moving the
    vector between the two layouts. Every tile stays in ``a``'s layout (the dot's: a tile each warp
    holds whole, so that the reductions stay within a warp)."""
    a = _sym(a)
    eye = o_c[:, None] == o_c[None, :]
    b_l = a * 0.
    b_y = tl.where(eye, 1., b_l)
    b_x = b_l
    b_dg = tl.sum(tl.where(eye, a, 0.), axis=1)          # the trailing complement's diagonal
    for j in range(BC):
        col = tl.sum(tl.where(o_c[None, :] == j, a, 0.), axis=1)
        row = tl.sum(tl.where(o_c[:, None] == j, a, 0.), axis=0)
        y = tl.sum(tl.where(o_c[:, None] == j, b_y, 0.), axis=0)
        inv = 1. / tl.sqrt(_pick(b_dg, o_c, j))
        l_r = tl.where(o_c >= j, col * inv, 0.)
        l_c = tl.where(o_c >= j, row * inv, 0.)
        x = y * inv
        b_l = tl.where(o_c[None, :] == j, l_r[:, None], b_l)
        b_x = tl.where(o_c[:, None] == j, x[None, :], b_x)
        b_y = b_y - tl.where(o_c[:, None] > j, l_r[:, None] * x[None, :], 0.)
        b_dg = b_dg - l_r * l_r
        a = a - l_r[:, None] * l_c[None, :]
    return b_l, b_x


@triton.jit
def _sym(x):
    return 0.5 * (x + tl.trans(x))


@tune(_WARPS, key=["H", "K", "BC", "HAS_BETA", "HAS_ETA", "STORE", "VARLEN"])
@triton.jit(do_not_specialize=["T", "TS"])
def precision_fwd_kernel(k, lam, beta, eta, p0, g, v, lc, li, starts, pt, cu, T, TS, H: tl.constexpr,
                         K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, TAU: tl.constexpr,
                         HAS_BETA: tl.constexpr, HAS_ETA: tl.constexpr, STORE: tl.constexpr, VARLEN: tl.constexpr):
    """One program per (sequence, head), sequential over chunks, P [K, K] in float64 (kept in the
    program's slot of ``pt`` between chunks, which ends holding the final P).
    A chunk is the longest run of at most BC tokens whose forgetting Gamma (the product of its lam)
    stays >= TAU (at least one token). Per chunk (``chunk.py``'s algebra): A = diag(Gamma / beta) +
    K P K^T, its Cholesky factor L, V = L^-1 K P, gains G = diag(eta / (beta diag(L))) V,
    P <- (P - V^T V) / Gamma_C. STORE keeps V, L and L^-1 (float64) and the chunks' first tokens
    (``starts [N * H, TS]``: the chunks' starts, then the sequence's length) for the backward, which
    rebuilds every P from them."""
    i_bh = tl.program_id(0)
    i_b = i_bh // H
    i_h = i_bh % H
    o_k, m_k, _, _, m_kk, p_kk = state_block(0, 0, K, K, BK, BK)
    o_c = tl.arange(0, BC)
    eye = o_c[:, None] == o_c[None, :]
    # P lives in this program's slot of pt between chunks, read back where needed (carried in
    # registers, it and its dot-operand copy take half of them); the slot starts from P0 at every
    # launch, so that the autotuner's reruns agree. Symmetrised: the parallel form's P0 (a batched
    # inverse) is symmetric up to rounding only
    p_p = pt + i_bh.to(tl.int64) * K * K + p_kk
    tl.store(p_p, _sym(tl.load(p0 + i_bh.to(tl.int64) * K * K + p_kk, mask=m_kk, other=0.).to(tl.float64)), mask=m_kk)
    tl.debug_barrier()
    bos, T = _sequence(cu, i_b, T, VARLEN)
    p_st = starts + i_bh.to(tl.int64) * TS
    s0 = T * 0
    n_ch = T * 0
    while s0 < T:
        # every [chunk, key] tile transposed ([BK, BC]): the chained dots spread their warps along the
        # first dimension, where 16 rows would sit in every warp whole (4x the registers and the products)
        row, m_t, b_kt, b_lam, b_beta, b_eta = _chunk(k, lam, beta, eta, bos, i_h, s0, T - s0, H, K, o_k, m_k, BC,
                                                       HAS_BETA, HAS_ETA, True)
        # the cut: where Gamma would fall below TAU, the chunk's rounding (at P's scale at its start,
        # divided by Gamma at its end) would outgrow the token-by-token recurrence's
        n = tl.maximum(tl.min(tl.where(tl.cumprod(b_lam, 0) < TAU, o_c, BC), axis=0), 1)
        m_t = m_t & (o_c < n)
        b_kt = tl.where(m_t[None, :], b_kt, 0.)
        b_lam = tl.where(m_t, b_lam, 1.)
        b_beta = tl.where(m_t, b_beta, 1.)
        b_eta = tl.where(m_t, b_eta, 0.)
        b_gam = tl.cumprod(b_lam, 0)
        b_ut = tl.dot(tl.load(p_p, mask=m_kk, other=0.), b_kt)          # U^T = P K^T (P symmetric)
        b_a = tl.dot(tl.trans(b_kt), b_ut) + tl.where(eye, (b_gam / b_beta)[:, None], 0.)
        b_l, b_li = _cholesky_inverse(b_a, o_c, BC)
        b_vt = tl.dot(b_ut, tl.trans(b_li))                             # V^T = U^T L^-T
        b_c = tl.sum(tl.where(eye, b_l, 0.), axis=1)
        m_kt = m_k[:, None] & m_t[None, :]
        tl.store(g + row[None, :] * K + o_k[:, None],
                 ((b_eta / (b_beta * b_c))[None, :] * b_vt).to(g.dtype.element_ty), mask=m_kt)
        if STORE:
            tl.store(v + row[None, :] * K + o_k[:, None], b_vt, mask=m_kt)
            tl.store(lc + row[:, None] * BC + o_c[None, :], b_l, mask=m_t[:, None])
            tl.store(li + row[:, None] * BC + o_c[None, :], b_li, mask=m_t[:, None])
            tl.store(p_st + n_ch, s0)
        # V^T V symmetrised: an asymmetric rounding error would grow as 1 / Gamma per chunk
        b_w = _sym(tl.dot(b_vt, tl.trans(b_vt)))
        b_p = (tl.load(p_p, mask=m_kk, other=0.) - b_w) / _pick(b_gam, o_c, BC - 1)
        tl.debug_barrier()      # every thread has read P
        tl.store(p_p, b_p, mask=m_kk)
        tl.debug_barrier()      # and stored its part of the next one
        s0 += tl.minimum(n, T - s0)
        n_ch += 1
    if STORE:
        tl.store(p_st + n_ch, T)
        tl.store(p_st + TS - 1, n_ch)


@tune(_WARPS, key=["H", "K", "BC", "HAS_BETA", "HAS_ETA", "HAS_DPT", "VARLEN", "DR"])
@triton.jit(do_not_specialize=["T", "TS"])
def precision_bwd_kernel(k, lam, beta, eta, v, lc, li, starts, pt, dg, dpt, dk, dlam, dbeta, deta, dp0, cu,
                         T, TS, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
                         HAS_BETA: tl.constexpr, HAS_ETA: tl.constexpr, HAS_DPT: tl.constexpr,
                         VARLEN: tl.constexpr, DR: tl.constexpr):
    """Reverse over the forward's chunks (``starts``) from the final P: each chunk's P rebuilt from the next one and the stored
    V, P = Gamma_C P_next + V^T V (a contraction: rounding does not grow backwards), then the adjoint
    of the forward's chunk step (float64; the Cholesky factor's through L^-T Phi(L^T dL) L^-1):
    k's, lam's, beta's, eta's gradients, then the initial P's, kept symmetric (the gradient with
    respect to a symmetric P; ``dpt`` must be symmetric). VARLEN as the forward. DR: the initial P
    was the inverse of a covariance R (the parallel form's segments): store R's gradient instead,
    -P dP P, with P as rebuilt here (in the program, where a pass in PyTorch reads both from memory).
    The rebuilt P waits in the program's slot of ``dp0`` between chunks."""
    i_bh = tl.program_id(0)
    i_b = i_bh // H
    i_h = i_bh % H
    o_k, m_k, _, _, m_kk, p_kk = state_block(0, 0, K, K, BK, BK)
    o_c = tl.arange(0, BC)
    eye = o_c[:, None] == o_c[None, :]
    # P lives in this program's slot of dp0 between chunks (read back where needed, the gradient
    # overwriting it at the end; it starts from pt at every launch): carried in registers beside dP,
    # it and its dot-operand copy spill
    p_p = dp0 + i_bh.to(tl.int64) * K * K + p_kk
    tl.store(p_p, tl.load(pt + i_bh.to(tl.int64) * K * K + p_kk, mask=m_kk, other=0.), mask=m_kk)
    tl.debug_barrier()
    if HAS_DPT:
        b_dp = tl.load(dpt + i_bh.to(tl.int64) * K * K + p_kk, mask=m_kk, other=0.).to(tl.float64)
    else:
        b_dp = tl.zeros([BK, BK], dtype=tl.float64)
    bos, T = _sequence(cu, i_b, T, VARLEN)
    p_st = starts + i_bh.to(tl.int64) * TS
    n_ch = tl.load(p_st + TS - 1)
    for j in range(n_ch):
        s0 = tl.load(p_st + n_ch - 1 - j)
        # [chunk, key] tiles transposed, as in the forward
        row, m_t, b_kt, b_lam, b_beta, b_eta = _chunk(k, lam, beta, eta, bos, i_h, s0, tl.load(p_st + n_ch - j) - s0,
                                                       H, K, o_k, m_k, BC, HAS_BETA, HAS_ETA, True)
        m_kt = m_k[:, None] & m_t[None, :]
        b_vt = tl.load(v + row[None, :] * K + o_k[:, None], mask=m_kt, other=0.)
        b_dgt = tl.load(dg + row[None, :] * K + o_k[:, None], mask=m_kt, other=0.).to(tl.float64)
        pad = eye & ~m_t[:, None]        # rows past the sequence: a unit diagonal (their factor's value is never read)
        b_l = tl.where(pad, 1., tl.load(lc + row[:, None] * BC + o_c[None, :], mask=m_t[:, None], other=0.))
        b_li = tl.where(pad, 1., tl.load(li + row[:, None] * BC + o_c[None, :], mask=m_t[:, None], other=0.))
        b_gam = tl.cumprod(b_lam, 0)
        gam_c = _pick(b_gam, o_c, BC - 1)
        b_c = tl.sum(tl.where(eye, b_l, 0.), axis=1)
        b_h = b_eta / (b_beta * b_c)
        # G = diag(h) V, P_next = (P - V^T V) / Gamma_C (dP symmetric: (V dP)^T = dP V^T)
        b_dvt = (-2. / gam_c) * tl.dot(b_dp, b_vt) + b_h[None, :] * b_dgt
        b_hb = tl.sum(b_dgt * b_vt, axis=0)
        b_deta = b_hb / (b_beta * b_c)
        b_dbeta = -b_hb * b_h / b_beta
        # V = L^-1 U (U = K P), L = chol(A), A = diag(Gamma / beta) + U K^T
        b_dut = tl.dot(b_dvt, b_li)                                     # dU^T = dV^T L^-1
        b_dl = tl.where(o_c[:, None] >= o_c[None, :], -tl.dot(tl.trans(b_dut), b_vt), 0.)
        b_dl += tl.where(eye, (-b_hb * b_h / b_c)[:, None], 0.)
        b_x = tl.dot(tl.trans(b_l), b_dl)
        b_phi = tl.where(o_c[:, None] > o_c[None, :], b_x, tl.where(eye, 0.5 * b_x, 0.))
        b_da = _sym(tl.dot(tl.dot(tl.trans(b_li), b_phi), b_li))
        b_dad = tl.sum(tl.where(eye, b_da, 0.), axis=1)
        # Gamma_C divides P_next: its gradient; then P = Gamma_C P_next + V^T V replaces P_next in its slot
        b_p = tl.load(p_p, mask=m_kk, other=0.)
        dgam_c = -tl.sum(tl.sum(b_dp * b_p, axis=1), axis=0) / gam_c
        b_p = tl.dot(b_vt, tl.trans(b_vt), gam_c * b_p, out_dtype=tl.float64)
        tl.debug_barrier()          # every thread has read P_next
        tl.store(p_p, b_p, mask=m_kk)
        # dK^T = P dU^T + 2 U^T dA (both symmetric), U^T = V^T L^T
        b_dkt = tl.dot(b_p, b_dut) + 2. * tl.dot(b_vt, tl.dot(tl.trans(b_l), b_da))
        tl.store(dk + row[None, :] * K + o_k[:, None], b_dkt.to(dk.dtype.element_ty), mask=m_kt)
        # Gamma_t = prod_{s <= t} lam_s; Gamma_C also divides P_next
        b_dgam = b_dad / b_beta + tl.where(o_c == BC - 1, dgam_c, 0.)
        b_dlam = tl.cumsum(b_dgam * b_gam, 0, reverse=True) / b_lam
        tl.store(dlam + row, b_dlam.to(dlam.dtype.element_ty), mask=m_t)
        if HAS_BETA:
            tl.store(dbeta + row, (b_dbeta - b_dad * b_gam / (b_beta * b_beta)).to(dbeta.dtype.element_ty), mask=m_t)
        if HAS_ETA:
            tl.store(deta + row, b_deta.to(deta.dtype.element_ty), mask=m_t)
        # dP / Gamma_C + K^T dA K + (K^T dU + dU^T K) / 2, symmetrised: sym(dP / Gamma_C + (K^T dA + dU^T) K)
        # (dA symmetric). Its antisymmetric rounding would grow as 1 / Gamma per chunk, unlike the
        # symmetric part, which the next chunks' updates contract
        b_dp = _sym(tl.dot(tl.dot(b_kt, b_da) + b_dut, tl.trans(b_kt), b_dp / gam_c, out_dtype=tl.float64))
        tl.debug_barrier()          # P stored by every thread before the next chunk reads it
    if DR:
        b_p = tl.load(p_p, mask=m_kk, other=0.)
        b_dp = -tl.dot(tl.dot(b_p, b_dp, out_dtype=tl.float64), b_p, out_dtype=tl.float64)
        tl.debug_barrier()          # every thread has read P before its slot takes the gradient
    tl.store(dp0 + i_bh.to(tl.int64) * K * K + p_kk, b_dp, mask=m_kk)


# the parallel form's covariance scan: one [K, K] float64 tile a program, one product per segment.
# 8 warps first (sm_90, K = 64: the backward keeps its tiles in 255 registers with ~0.1 KB of stack;
# at 4 warps ptxas spills 1.3-3.3 KB a thread)
_SCAN_WARPS = [triton.Config({}, num_warps=8), triton.Config({}, num_warps=4)]


@triton.jit
def _segment(k, lam, beta, bos, i_h, s0, n, H: tl.constexpr, K: tl.constexpr, o_k, m_k, C: tl.constexpr,
             HAS_BETA: tl.constexpr):
    """``_chunk``'s n (<= C) tokens from token s0 (no eta), plus the weights' suffix products
    prod_{s > t} lam_s [C] and the segment's Gamma: w_t = beta_t prod_{s > t} lam_s weighs k_t k_t^T
    (rows past n: k = 0, no term)."""
    row, m_t, b_k, b_lam, b_beta, b_eta = _chunk(k, lam, beta, beta, bos, i_h, s0, n, H, K, o_k, m_k, C, HAS_BETA,
                                                 False, False)
    inc = tl.cumprod(b_lam, 0, reverse=True)           # prod_{s >= t} lam_s
    gam = tl.sum(tl.where(tl.arange(0, C) == 0, inc, 0.), axis=0)
    return row, m_t, b_k, b_lam, b_beta, inc / b_lam, gam


@tune(_SCAN_WARPS, key=["H", "K", "C", "HAS_BETA"])
@triton.jit
def covariance_fwd_kernel(k, lam, beta, r0, r, rt, cu, so, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                          C: tl.constexpr, HAS_BETA: tl.constexpr):
    """One program per (sequence, head) of a packed row (``cu`` its offsets, ``so`` each sequence's
    first segment), over its segments of C tokens in order: R [K, K] (float64, from R0) is stored at
    each segment's first token (``r [n_segments, H, K, K]``), then R <- Gamma R + K^T diag(w) K; the
    last R is the final covariance (``rt``)."""
    i_nh = tl.program_id(0)
    i_n = i_nh // H
    i_h = i_nh % H
    o_k, m_k, _, _, m_kk, p_kk = state_block(0, 0, K, K, BK, BK)
    b_r = tl.load(r0 + i_nh.to(tl.int64) * K * K + p_kk, mask=m_kk, other=0.).to(tl.float64)
    bos = tl.load(cu + i_n).to(tl.int64)
    T = tl.load(cu + i_n + 1).to(tl.int64) - bos
    first = tl.load(so + i_n).to(tl.int64)
    for j in range(tl.cdiv(T, C)):
        row, m_t, b_k, b_lam, b_beta, suf, gam = _segment(k, lam, beta, bos, i_h, j * C, T - j * C, H, K, o_k, m_k,
                                                          C, HAS_BETA)
        tl.store(r + ((first + j) * H + i_h) * K * K + p_kk, b_r, mask=m_kk)
        b_r = tl.dot(tl.trans(b_k * (b_beta * suf)[:, None]), b_k, gam * b_r, out_dtype=tl.float64)
    tl.store(rt + i_nh.to(tl.int64) * K * K + p_kk, b_r, mask=m_kk)


@tune(_SCAN_WARPS, key=["H", "K", "C", "HAS_BETA", "HAS_DRT"])
@triton.jit
def covariance_bwd_kernel(k, lam, beta, r, dr, drt, dk, dlam, dbeta, dr0, cu, so, H: tl.constexpr, K: tl.constexpr,
                          BK: tl.constexpr, C: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DRT: tl.constexpr):
    """The adjoint of ``covariance_fwd_kernel``, its segments in reverse: A = dL/dR after the segment
    (from the final covariance's gradient), then k's, lam's and beta's gradients through
    Gamma R + K^T diag(w) K (R read back from ``r``), and A <- Gamma A + (the gradient of the R the
    forward stored there, ``dr``); the last A is R0's gradient."""
    i_nh = tl.program_id(0)
    i_n = i_nh // H
    i_h = i_nh % H
    o_k, m_k, _, _, m_kk, p_kk = state_block(0, 0, K, K, BK, BK)
    if HAS_DRT:
        b_a = tl.load(drt + i_nh.to(tl.int64) * K * K + p_kk, mask=m_kk, other=0.).to(tl.float64)
    else:
        b_a = tl.zeros([BK, BK], dtype=tl.float64)
    bos = tl.load(cu + i_n).to(tl.int64)
    T = tl.load(cu + i_n + 1).to(tl.int64) - bos
    first = tl.load(so + i_n).to(tl.int64)
    n_seg = tl.cdiv(T, C)
    for jj in range(n_seg):
        j = n_seg - 1 - jj
        row, m_t, b_k, b_lam, b_beta, suf, gam = _segment(k, lam, beta, bos, i_h, j * C, T - j * C, H, K, o_k, m_k,
                                                          C, HAS_BETA)
        p_seg = ((first + j) * H + i_h) * K * K + p_kk
        b_r = tl.load(r + p_seg, mask=m_kk, other=0.)
        # R' = Gamma R + K^T diag(w) K: dK = diag(w) K (A + A^T), dw_t = k_t^T A k_t, dGamma = <A, R>
        b_ka = tl.dot(b_k, b_a + tl.trans(b_a), out_dtype=tl.float64)
        b_w = b_beta * suf
        b_dw = 0.5 * tl.sum(b_ka * b_k, axis=1)
        dgam = tl.sum(tl.sum(b_a * b_r, axis=1), axis=0)
        tl.store(dk + row[:, None] * K + o_k[None, :], (b_w[:, None] * b_ka).to(dk.dtype.element_ty),
                 mask=m_t[:, None] & m_k[None, :])
        # w_t = beta_t prod_{s > t} lam_s, Gamma = prod_s lam_s: lam_s's share of both over lam_s
        b_x = b_dw * b_w
        b_dlam = (tl.cumsum(b_x, 0) - b_x + dgam * gam) / b_lam
        tl.store(dlam + row, b_dlam.to(dlam.dtype.element_ty), mask=m_t)
        if HAS_BETA:
            tl.store(dbeta + row, (b_dw * suf).to(dbeta.dtype.element_ty), mask=m_t)
        b_a = gam * b_a + tl.load(dr + p_seg, mask=m_kk, other=0.)
    tl.store(dr0 + i_nh.to(tl.int64) * K * K + p_kk, b_a, mask=m_kk)
