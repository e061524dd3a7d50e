"""The Triton kernels of the precision family: the precision recurrence in float64, forward and
backward; the algorithm, shapes and host code are in ``ssmcraft.ops.precision_rank1.chunk``."""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.tiles import state_block
from ssmcraft.ops.common.tuning import tune

# float64 [K, K] tiles: more warps keep them in registers (K = 64: 32 doubles a thread at 4 warps)
_WARPS = [triton.Config({}, num_warps=w) for w in (4, 8, 16)]


@triton.jit
def _token(k, lam, beta, eta, row, ok, o_k, m_k, K: tl.constexpr, HAS_BETA: tl.constexpr, HAS_ETA: tl.constexpr):
    """One token's k [BK], lam, beta, eta in float64 (``ok`` False: zeros and ones, nothing read).
    The kernels load the next token's while the current one's step runs: the step's chain of
    reductions then never waits on memory."""
    b_k = tl.load(k + row * K + o_k, mask=m_k & ok, other=0.).to(tl.float64)
    b_lam = tl.load(lam + row, mask=ok, other=1.).to(tl.float64)
    one = tl.full([], 1., tl.float64)      # a tensor, not a constant: the kernels carry it through their loop
    b_beta = tl.load(beta + row, mask=ok, other=1.).to(tl.float64) if HAS_BETA else one
    b_eta = tl.load(eta + row, mask=ok, other=1.).to(tl.float64) if HAS_ETA else one
    return b_k, b_lam, b_beta, b_eta


@triton.jit
def _sequence(cu, i_b, T, VARLEN: tl.constexpr):
    """(first row, length) of program ``i_b``'s sequence: sequence ``i_b`` of a packed row (``cu`` its
    offsets) where VARLEN, else batch row ``i_b`` of T tokens."""
    if VARLEN:
        bos = tl.load(cu + i_b)
        return bos.to(tl.int64), tl.load(cu + i_b + 1) - bos
    else:
        return (i_b * T).to(tl.int64), T


@tune(_WARPS, key=["H", "K", "HAS_BETA", "HAS_ETA", "STORE_WS", "STORE_PT"])
@triton.jit(do_not_specialize=["T"])
def precision_fwd_kernel(k, lam, beta, eta, p0, g, w, s, pt, cu, T, H: tl.constexpr, K: tl.constexpr,
                         BK: tl.constexpr, HAS_BETA: tl.constexpr, HAS_ETA: tl.constexpr, STORE_WS: tl.constexpr,
                         STORE_PT: tl.constexpr, VARLEN: tl.constexpr):
    """Sequential over tokens, one program per (sequence, head), P [K, K] in float64 in registers:
    w = P k, s = lam + beta k.w, g = eta w / s, P <- (P - (beta / s) w w^T) / lam. STORE_WS keeps
    w and s (float64) for the backward, which rebuilds every P from them. VARLEN: sequence ``i_b``
    of a packed row, from its own P0 to its own final P."""
    i_bh = tl.program_id(0)
    i_b = i_bh // H
    i_h = i_bh % H
    o_k, m_k, _, _, m_kk, p_kk = state_block(0, 0, K, K, BK, BK)
    b_p = tl.load(p0 + i_bh.to(tl.int64) * K * K + p_kk, mask=m_kk, other=0.).to(tl.float64)
    bos, T = _sequence(cu, i_b, T, VARLEN)
    row = bos * H + i_h
    b_k, b_lam, b_beta, b_eta = _token(k, lam, beta, eta, row, T > 0, o_k, m_k, K, HAS_BETA, HAS_ETA)
    for t in range(T):
        n_k, n_lam, n_beta, n_eta = _token(k, lam, beta, eta, row + H, t + 1 < T, o_k, m_k, K, HAS_BETA, HAS_ETA)
        b_w = tl.sum(b_p * b_k[None, :], axis=1)
        b_s = b_lam + b_beta * tl.sum(b_k * b_w, axis=0)
        tl.store(g + row * K + o_k, (b_eta * b_w / b_s).to(g.dtype.element_ty), mask=m_k)
        if STORE_WS:
            tl.store(w + row * K + o_k, b_w, mask=m_k)
            tl.store(s + row, b_s)
        # v v^T with v = sqrt(beta / s) w is exactly symmetric (w_i c w_j is not): an asymmetric
        # rounding error grows as 1 / lam per token in this recurrence, a symmetric one does not
        b_v = b_w * tl.sqrt(b_beta / b_s)
        b_p = (b_p - b_v[:, None] * b_v[None, :]) / b_lam
        row += H
        b_k, b_lam, b_beta, b_eta = n_k, n_lam, n_beta, n_eta
    if STORE_PT:
        tl.store(pt + i_bh.to(tl.int64) * K * K + p_kk, b_p, mask=m_kk)


@tune(_WARPS, key=["H", "K", "HAS_BETA", "HAS_ETA", "HAS_DPT"])
@triton.jit(do_not_specialize=["T"])
def precision_bwd_kernel(k, lam, beta, eta, w, s, pt, dg, dpt, dk, dlam, dbeta, deta, dp0, cu,
                         T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                         HAS_BETA: tl.constexpr, HAS_ETA: tl.constexpr, HAS_DPT: tl.constexpr,
                         VARLEN: tl.constexpr):
    """Reverse over tokens from the final P: each earlier P rebuilt from the stored w and s,
    P_{t-1} = lam P_t + (beta / s) w w^T (a contraction: rounding does not grow backwards), and the
    adjoint of the forward step (float64): k's, lam's, beta's, eta's gradients, then the initial P's,
    kept symmetric (the gradient with respect to a symmetric P; ``dpt`` must be symmetric). VARLEN as
    the forward."""
    i_bh = tl.program_id(0)
    i_b = i_bh // H
    i_h = i_bh % H
    o_k, m_k, _, _, m_kk, p_kk = state_block(0, 0, K, K, BK, BK)
    b_p = tl.load(pt + i_bh.to(tl.int64) * K * K + p_kk, mask=m_kk, other=0.).to(tl.float64)
    if HAS_DPT:
        b_dp = tl.load(dpt + i_bh.to(tl.int64) * K * K + p_kk, mask=m_kk, other=0.).to(tl.float64)
    else:
        b_dp = tl.zeros([BK, BK], dtype=tl.float64)
    bos, T = _sequence(cu, i_b, T, VARLEN)
    row = (bos + T - 1) * H + i_h
    b_k, b_lam, b_beta, b_eta = _token(k, lam, beta, eta, row, T > 0, o_k, m_k, K, HAS_BETA, HAS_ETA)
    b_w = tl.load(w + row * K + o_k, mask=m_k & (T > 0), other=0.)
    b_s = tl.load(s + row, mask=T > 0, other=1.)
    b_dg = tl.load(dg + row * K + o_k, mask=m_k & (T > 0), other=0.).to(tl.float64)
    for j in range(T):
        nxt = j + 1 < T
        n_k, n_lam, n_beta, n_eta = _token(k, lam, beta, eta, row - H, nxt, o_k, m_k, K, HAS_BETA, HAS_ETA)
        n_w = tl.load(w + (row - H) * K + o_k, mask=m_k & nxt, other=0.)
        n_s = tl.load(s + row - H, mask=nxt, other=1.)
        n_dg = tl.load(dg + (row - H) * K + o_k, mask=m_k & nxt, other=0.).to(tl.float64)
        b_c = b_beta / b_s
        b_a = tl.sum(b_w * b_dg, axis=0)
        b_v1 = tl.sum(b_dp * b_w[None, :], axis=1)          # dP w (dP symmetric)
        b_dc = -tl.sum(b_w * b_v1, axis=0) / b_lam
        b_ds = -(b_eta * b_a + b_beta * b_dc) / (b_s * b_s)
        tl.store(dlam + row, (-tl.sum(tl.sum(b_p * b_dp, axis=1), axis=0) / b_lam + b_ds).to(dlam.dtype.element_ty))
        if HAS_BETA:
            tl.store(dbeta + row, (b_dc / b_s + b_ds * tl.sum(b_k * b_w, axis=0)).to(dbeta.dtype.element_ty))
        if HAS_ETA:
            tl.store(deta + row, (b_a / b_s).to(deta.dtype.element_ty))
        b_v = b_w * tl.sqrt(b_c)
        b_p = b_lam * b_p + b_v[:, None] * b_v[None, :]
        b_dw = -(2. * b_c / b_lam) * b_v1 + (b_eta / b_s) * b_dg + (b_ds * b_beta) * b_k
        b_dk = tl.sum(b_p * b_dw[:, None], axis=0) + (b_ds * b_beta) * b_w
        tl.store(dk + row * K + o_k, b_dk.to(dk.dtype.element_ty), mask=m_k)
        # the symmetric part of dw k^T: P is symmetric, so only dP's symmetric part reaches k, lam and
        # beta; its antisymmetric part would grow as 1 / lam per token and its rounding with it
        b_dp = b_dp / b_lam + 0.5 * (b_dw[:, None] * b_k[None, :] + b_k[:, None] * b_dw[None, :])
        row -= H
        b_k, b_lam, b_beta, b_eta, b_w, b_s, b_dg = n_k, n_lam, n_beta, n_eta, n_w, n_s, n_dg
    tl.store(dp0 + i_bh.to(tl.int64) * K * K + p_kk, b_dp, mask=m_kk)
