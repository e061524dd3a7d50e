"""Triton kernels of the chunked per-row rank-1 family with a decay per state row (``a [B, T, H, V]``:
wd_longhorn's ``1 / (1 + lambda)``), one key (``u = v = q = k``) and a constant readout scale (``chunk.py``
has the algebra; ``kernels.py`` the helpers).

Per row i its own cumulative log-decays over the chunk, ``g`` and ``gp = g - log a`` ([C, R] tiles, each
token's log floored at ``tiles.LOG_DECAY_MIN``); the Gram matrices ``A = strict(K K^T)`` and
``L = lower(OQ K^T)`` stay shared by the rows of a head, and every product that carries a per-row factor
``e^{g_t - g_tau}`` between two tokens is taken on the ``[C, R]`` tiles one token at a time, with
accumulators multiplied by each token's decay as the walk passes it (never ``e^{-g}``: every factor is a
product of decays, <= 1, so nothing overflows at tiny or zero decays and no ``[C, C, R]`` tile exists).
An accumulator row that is complete is left alone from then on ("frozen": the decay multiplies only the
rows still to come), so that one tile holds every token's result when the walk ends.

Split backward. The forward also stores, per (sequence, head, row block), whether every chunk took the
products (``mild``, int32); the backward then launches the same kernel twice (``PATH``): once with the
products alone compiled, its programs returning at once where the flag is 0, and once deciding per
chunk, returning at once where it is 1 (the same sums in the same order: bit for bit the one kernel's).

Forward per chunk (E = P - D, Z the per-row scalar ``s_{t-1,i} . k_t``)::

    E + c o (A_i E) = P - c o (e^gp o K H0)          one walk: Ac = A_i E, Lc = L_i E
    Z = e^gp o (K H0) + A_i E,   O = e^g o (OQ H0) + L_i E,   H_C = e^{g_C} o H0 + K^T (e^{g_C - g} o E)

The forward of a training step stores Z (``[B, T, H, V]`` fp32; ``D = c o Z``, ``E = P - D``) and every
chunk's start state (``hs``, as the per-head decay does). The backward walks each chunk once from its
last token: the adjoint of E, ``gE = L_i^T dO + e^{g_C - g} o (K dH)``, and the substitution's adjoint
``W`` (``W + A_i^T (c o W) = gE``) in one accumulator (they decay alike); then, at each token r, the
decay's gradient term by term: ``da_r = sum_{tau < r} F_r[tau] Acc_r[tau] + e^{gp_r} acc0_r`` with
``F_r[tau] = e^{gp_r - g_tau} E_tau`` (the coefficients before r, decayed to just before it) and
``Acc_r`` the accumulator's rows before r (the coefficients after r, decayed back to it: outputs,
substitution and the end state), ``acc0`` the same for the start state's terms (``e^gp o K H0``,
``e^g o OQ H0``, ``e^{g_C} H0``); a_r is left out of every product, so it is exact at a = 0. The shared
matrices' gradients, ``dA[r, tau] = -sum_i (c o W)[r, i] F_r[tau, i]`` and ``dL[r, tau] = sum_i dO[r, i]
e^{g_r - g_tau} E[tau, i]``, are sums over the rows formed in the same walk.

Mild chunks as products. Row i's factor between two tokens splits, ``e^{gp_t - g_tau} = e^{gp_t - m}
e^{m - g_tau}`` for any reference m: ``A_i = diag(e^{gp - m}) A diag(e^{m - g})`` and ``L_i = diag(e^{g - m})
L diag(e^{m - g})``, the Gram matrices shared, the diagonal factors ``[C, R]`` tiles. So a chunk of a row
block whose decays are all at least e^LOG_EXACT_DA and whose exponents against m (g at its middle token,
per row) stay within FAST_SPAN (``mild_chunk``, decided per chunk and row block as the kernels run) takes
every product on tensor cores, with one substitution on [C, R] tiles each way (``kernels.solve``) in place
of the walks (``scaled_walk``, ``scaled_adjoints``), and the decay's gradient as d log a / a: with every
factor a sum of log-decays, d log a_r is the sum of the terms whose factors span token r, which collapses
to reverse sums over the chunk of per-token terms (``scaled_adjoints``), and 1 / a <= e^3 keeps its
digits. The other chunks (a tiny or zero decay among their rows) take the walks above, exact there.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.tiles import LOG_EXACT_DA, log_decay, state_block, state_or_zero
from ssmcraft.ops.rank1_row_chunk.kernels import (chunk_at, chunk_masks, key_tile, program, put, row_tile, solve,
                                                  start_slot, store_rows)

# A chunk of a program's rows takes the scaled products (``mild_chunk``) where every exponent against its
# reference, ``g - m`` and ``gp - m``, is at most this in size: each factor e^{+-(g - m)} is then at most
# e^30, and a product of two (the masked upper entries of the [C, C] products included) stays far inside
# fp32's range. With every decay at least e^LOG_EXACT_DA and m at the middle token of a chunk of 16, no
# exponent exceeds 3 * 8 = 24: the bound turns chunks away only at C = 32.
FAST_SPAN = tl.constexpr(30.0)
# The backward's ``PATH``: one kernel deciding per chunk (``mild_chunk``), or split in two launches of
# the same source by the forward's flag per (sequence, head, row block), "every chunk mild": one runs
# only the programs whose flag is 1 with the products alone compiled (the walks' tiles, live beside the
# products', made the one kernel spill: ``chunk.ROW_DECAY_SPLIT``), the other only those whose flag is
# 0, deciding per chunk.
PATH_ONE = tl.constexpr(0)
PATH_PRODUCTS = tl.constexpr(1)
PATH_MIXED = tl.constexpr(2)


@triton.jit
def row_decays(a, rows, o_v, m_t, m_v, V, o_c, C: tl.constexpr):
    """A chunk's per-row decays from ``a [B, T, H, V]`` (1 at padded tokens and rows): ``e = a`` (as
    e^{log a}, floored), the cumulative logs ``g`` and ``gp = g - log a`` [C, R], and g's last row [R]."""
    b_la = log_decay(tl.load(a + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                             other=1.).to(tl.float32))
    b_g = tl.cumsum(b_la, axis=0)
    b_gl = tl.sum(tl.where((o_c == C - 1)[:, None], b_g, 0.), axis=0)
    return tl.exp(b_la), b_g, b_g - b_la, b_gl


@triton.jit
def row_of(x, sel):
    """Row ``sel`` (a one-hot [C] mask) of a [C, n] tile, as [n]."""
    return tl.sum(tl.where(sel[:, None], x, 0.), axis=0)


@triton.jit
def col_of(x, sel):
    """Column ``sel`` (a one-hot [C] mask) of a [n, C] tile, as [n]."""
    return tl.sum(tl.where(sel[None, :], x, 0.), axis=1)


@triton.jit
def mild_chunk(b_g, b_gp, o_c, C: tl.constexpr, FAST: tl.constexpr):
    """The reference of a chunk's scaled products, ``m [R]`` = g at the chunk's middle token, row by row,
    and whether the chunk takes them (a scalar; never without ``FAST``): every decay of its rows at least
    e^LOG_EXACT_DA (so that 1 / a <= e^3 and d log a / a keeps its digits) and every |g - m|, |gp - m|
    within FAST_SPAN."""
    m = row_of(b_g, o_c == C // 2 - 1)
    span = tl.maximum(tl.abs(b_g - m[None, :]), tl.abs(b_gp - m[None, :]))
    mild = (b_g - b_gp >= LOG_EXACT_DA) & (span <= FAST_SPAN)
    return m, (tl.min(tl.min(mild.to(tl.int32), axis=1), axis=0) > 0) & FAST


@triton.jit
def scaled_walk(b_b, b_c, b_A, b_L, b_e, b_g, b_gp, m, o_c, C: tl.constexpr, R: tl.constexpr, PREC: tl.constexpr):
    """``decayed_walk``'s ``A_i E`` and ``L_i E`` for a mild chunk (``mild_chunk``), with X = e^{m - g} o E:
    A_i E = e^{gp - m} o (A X), L_i E = e^{g - m} o (L X), and X solves ``X + (c / a) o (A X) = e^{m - g} o b``
    (``kernels.solve``: the rows share A; e^{gp - m} e^{m - g} = 1 / a)."""
    b_x = solve(b_b * tl.exp(m[None, :] - b_g), b_c / b_e, b_A, o_c, C, R, False)
    return (tl.exp(b_gp - m[None, :]) * tl.dot(b_A, b_x, input_precision=PREC),
            tl.exp(b_g - m[None, :]) * tl.dot(b_L, b_x, input_precision=PREC))


@triton.jit
def decayed_walk(b_b, b_c, b_A, b_L, b_e, o_c, C: tl.constexpr, R: tl.constexpr):
    """``E + c o (A_i E) = b`` token by token, A_i[t, tau] = A[t, tau] e^{gp_t - g_tau} (tau < t) per row:
    returns ``A_i E`` and ``L_i E`` [C, R] (L_i[t, tau] = L[t, tau] e^{g_t - g_tau}, tau <= t), so that
    E = b - c o (A_i E). ``b_e`` [C, R]: each token's decay per row."""
    b_ae = tl.zeros([C, R], dtype=tl.float32)
    b_le = tl.zeros([C, R], dtype=tl.float32)
    for t in range(C):
        sel = o_c == t
        w = row_of(b_b - b_c * b_ae, sel)           # E_t: row t of A_i E is complete
        e_t = row_of(b_e, sel)
        # rows after t take a_t on what they hold, then token t's term; rows up to t are complete
        b_ae = b_ae * tl.where(o_c[:, None] > t, e_t[None, :], 1.) + col_of(b_A, sel)[:, None] * w[None, :]
        b_le = b_le * tl.where(o_c[:, None] >= t, e_t[None, :], 1.) + col_of(b_L, sel)[:, None] * w[None, :]
    return b_ae, b_le


@triton.jit
def decayed_adjoints(b_E, b_c, b_e, b_g, b_gp, b_A, b_L, b_uh, b_do, b_doh, b_kdh, b_h0dh, o_c, C: tl.constexpr,
                     R: tl.constexpr):
    """A chunk's backward walk from its last token at any decay: ``(W, dA, dL, da)``, the substitution's
    adjoint [C, R], the shared matrices' gradients [C, C] and the decay's [C, R] (the module's docstring).
    ``b_doh``: dO o (OQ H0), undecayed; ``b_kdh``: K dH; ``b_h0dh``: sum_k H0 o dH [R]."""
    # acc's rows up to r hold, at step r, the coefficients after r decayed back to r: the outputs'
    # (L_i^T dO), the end state's (K dH, started with) and the substitution's (-A_i^T (c o W)); acc0 the
    # start state's terms likewise (one value a row)
    b_acc = b_kdh
    b_acc0 = b_h0dh
    b_dAT = tl.zeros([C, C], dtype=tl.float32)
    b_dLT = tl.zeros([C, C], dtype=tl.float32)
    b_da = tl.zeros([C, R], dtype=tl.float32)
    for j in range(C):
        r = C - 1 - j
        sel = o_c == r
        before = o_c[:, None] < r
        do_r = row_of(b_do, sel)
        b_acc += row_of(b_L, sel)[:, None] * do_r[None, :]
        b_acc0 += row_of(b_doh, sel)
        e_r = row_of(b_e, sel)
        gp_r = row_of(b_gp, sel)
        wc_r = row_of(b_c, sel) * row_of(b_acc, sel)          # (c o W)_r: W's row r is complete
        # F_r: E before r decayed to just before r (a_r left out)
        b_F = tl.where(before, tl.exp(tl.where(before, gp_r[None, :] - b_g, 0.)), 0.) * b_E
        b_da = tl.where(sel[:, None], (tl.sum(b_F * b_acc, axis=0) + tl.exp(gp_r) * b_acc0)[None, :], b_da)
        b_dAT = tl.where(sel[None, :], -tl.sum(b_F * wc_r[None, :], axis=1)[:, None], b_dAT)
        b_dLT = tl.where(sel[None, :], tl.sum(tl.where(sel[:, None], b_E, b_F * e_r[None, :]) * do_r[None, :],
                                              axis=1)[:, None], b_dLT)
        b_acc = b_acc * tl.where(before, e_r[None, :], 1.) - row_of(b_A, sel)[:, None] * wc_r[None, :]
        b_acc0 = b_acc0 * e_r - row_of(b_uh, sel) * wc_r
    return b_acc, tl.trans(b_dAT), tl.trans(b_dLT), b_da


@triton.jit
def scaled_adjoints(b_E, b_z, b_c, b_e, b_g, b_gp, b_gl, m, b_A, b_L, b_do, b_doh, b_kdh, b_h0dh, strict, incl, o_c,
                    C: tl.constexpr, R: tl.constexpr, PREC: tl.constexpr):
    """``decayed_adjoints`` for a mild chunk (``mild_chunk``) as products against the reference m, with
    X = e^{m - g} o E and Y = e^{gp - m} o c o W: the adjoint of E ``gE = e^{m - g} o (L^T (e^{g - m} o dO))
    + e^{g_C - g} o (K dH)``; Y solves ``Y + (c / a) o (A^T Y) = e^{gp - m} o c o gE`` (``kernels.solve``)
    and ``W = gE - e^{m - g} o (A^T Y)``; ``dA = -strict(Y X^T)``, ``dL = lower(e^{g - m} o dO X^T)``; the
    decay's gradient d log a / a, d log a_r the sum of the terms whose factors span token r: with O the
    unscaled output and Z = e^gp o K H0 + A_i E, ``sum_{t >= r} (dO o O - E o W)_t - sum_{t > r} (c o W o Z)_t
    + H_C . dH`` (the end state's factor e^{g_C} spans every token)."""
    b_kg = tl.exp(b_g - m[None, :])
    b_ki = tl.exp(m[None, :] - b_g)
    b_ebar = tl.exp(b_gl[None, :] - b_g)
    b_inva = 1. / b_e
    b_x = b_ki * b_E
    b_dok = b_do * b_kg
    b_gE = b_ki * tl.dot(tl.trans(b_L), b_dok, input_precision=PREC) + b_ebar * b_kdh
    b_AT = tl.trans(b_A)
    b_y = solve(b_c * tl.exp(b_gp - m[None, :]) * b_gE, b_c * b_inva, b_AT, o_c, C, R, True)
    b_w = b_gE - b_ki * tl.dot(b_AT, b_y, input_precision=PREC)
    b_xt = tl.trans(b_x)
    b_dA = -tl.where(strict, tl.dot(b_y, b_xt, input_precision=PREC), 0.)
    b_dL = tl.where(incl, tl.dot(b_dok, b_xt, input_precision=PREC), 0.)
    b_dgp = -b_c * b_w * b_z
    b_dg = b_doh * tl.exp(b_g) + b_dok * tl.dot(b_L, b_x, input_precision=PREC) - b_E * b_w + b_dgp
    b_hdh = tl.exp(b_gl) * b_h0dh + tl.sum(b_ebar * b_E * b_kdh, axis=0)
    b_da = (tl.cumsum(b_dg, axis=0, reverse=True) - b_dgp + b_hdh[None, :]) * b_inva
    return b_w, b_dA, b_dL, b_da


@triton.jit
def rank1_row_chunk_rowdecay_fwd_kernel(k, oq, a, c, p, oc, oh, h0, y, ht, z, hs, mild, cu, T,
                                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                                        R: tl.constexpr, BK: tl.constexpr, MODES: tl.constexpr,
                                        CONSTS: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                                        STORE_Z: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr,
                                        FAST: tl.constexpr, STORE_MILD: tl.constexpr):
    """y [B, T, H, V] = oc (S_t oq_t) + oh with ``s_t,i = a_t,i s_{t-1,i} - c_t,i (s_{t-1,i} . k_t) k_t
    + p_t,i k_t``; a [B, T, H, V]; MODES/CONSTS of (c, p, oc, oh), oc constant (MODES[2] == 0). The
    final state ht [N, H, K, V] fp32 (``STORE_HT``) from h0 (``HAS_H0``); ``STORE_Z``: z [B, T, H, V]
    fp32 = s_{t-1} . k_t and every chunk's start state in hs (``kernels.start_slot``). ``FAST``: mild
    chunks take the scaled products (``mild_chunk``), the others the decayed walk. ``STORE_MILD``: mild
    [N * H * NR] int32 = 1 where every chunk of this program's rows was mild, else 0 (the split backward's
    ``PATH``)."""
    i_bh, i_r, i_h, bos, T_s = program(cu, T, H, VARLEN)
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(0, i_r, K, V, BK, R)
    o_c, strict, incl = chunk_masks(C)
    b_h = state_or_zero(h0, i_bh, p_kv, m_kv, K, V, HAS_H0, BK, R)
    n_walked = tl.zeros([], dtype=tl.int32)
    for t0 in range(0, T_s, C):
        m_t, rows, m_tv, p_tv = chunk_at(t0, o_c, bos, T_s, i_h, o_v, m_v, H, V)
        if STORE_Z:
            tl.store(start_slot(hs, i_bh, bos, t0, H, K, V, C) + p_kv, b_h, mask=m_kv)
        b_u = key_tile(k, rows, o_k, m_t, m_k, K)
        b_oq = key_tile(oq, rows, o_k, m_t, m_k, K)
        b_c = row_tile(c, CONSTS[0], MODES[0], rows, o_v, m_t, m_v, V, C, R)
        b_p = row_tile(p, CONSTS[1], MODES[1], rows, o_v, m_t, m_v, V, C, R)
        b_e, b_g, b_gp, b_gl = row_decays(a, rows, o_v, m_t, m_v, V, o_c, C)
        b_uh = tl.dot(b_u, b_h, input_precision=PREC) * tl.exp(b_gp)
        b_A = tl.where(strict, tl.dot(b_u, tl.trans(b_u), input_precision=PREC), 0.)
        b_L = tl.where(incl, tl.dot(b_oq, tl.trans(b_u), input_precision=PREC), 0.)
        b_b = b_p - b_c * b_uh
        m, fast = mild_chunk(b_g, b_gp, o_c, C, FAST)
        n_walked += tl.where(fast, 0, 1)
        if fast:
            b_ae, b_le = scaled_walk(b_b, b_c, b_A, b_L, b_e, b_g, b_gp, m, o_c, C, R, PREC)
        else:
            b_ae, b_le = decayed_walk(b_b, b_c, b_A, b_L, b_e, o_c, C, R)
        b_E = b_b - b_c * b_ae
        b_o = tl.dot(b_oq, b_h, input_precision=PREC) * tl.exp(b_g) + b_le
        b_h = b_h * tl.exp(b_gl)[None, :] + tl.dot(tl.trans(b_u), b_E * tl.exp(b_gl[None, :] - b_g),
                                                    input_precision=PREC)
        b_o = b_o * CONSTS[2]
        if MODES[3] != 0 or CONSTS[3] != 0.0:
            b_o += row_tile(oh, CONSTS[3], MODES[3], rows, o_v, m_t, m_v, V, C, R)
        tl.store(y + p_tv, b_o.to(y.dtype.element_ty), mask=m_tv)
        if STORE_Z:
            tl.store(z + p_tv, b_uh + b_ae, mask=m_tv)
    if STORE_HT:
        tl.store(ht + i_bh.to(tl.int64) * K * V + p_kv, b_h, mask=m_kv)
    if STORE_MILD:
        tl.store(mild + i_bh * tl.num_programs(1) + i_r, (n_walked == 0).to(tl.int32))


@triton.jit
def rank1_row_chunk_rowdecay_bwd_kernel(k, oq, a, c, p, z, hs, dy, dht, dk, doq, da, dc, dp, dh0, mild,
                                        cu, T, NTOK,
                                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                                        R: tl.constexpr, BK: tl.constexpr, MODES: tl.constexpr,
                                        CONSTS: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                                        PREC: tl.constexpr, VARLEN: tl.constexpr,
                                        ATOMIC: tl.constexpr, FAST: tl.constexpr, PATH: tl.constexpr):
    """Reverse over chunks, each from its stored start state and Z. Writes this row block's slice of dk
    and doq [NR, B, T, H, K], da [B, T, H, V] (per row: whole), the row coefficients' gradients
    (``kernels.store_rows``) and dh0 [N, H, K, V]. ``FAST``: mild chunks (``mild_chunk``) take
    ``scaled_adjoints``, the others ``decayed_adjoints``. ``PATH`` (``PATH_ONE``): every program, each
    chunk deciding; ``PATH_PRODUCTS``: only the programs whose ``mild`` flag (the forward's) is 1, every
    chunk as products (the walks not compiled); ``PATH_MIXED``: only those whose flag is 0."""
    i_bh, i_r, i_h, bos, T_s = program(cu, T, H, VARLEN)
    if PATH != PATH_ONE:
        flag = tl.load(mild + i_bh * tl.num_programs(1) + i_r)
        if PATH == PATH_PRODUCTS:
            skip = flag != 1
        else:
            skip = flag != 0
        if skip:
            return
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(0, i_r, K, V, BK, R)
    o_c, strict, incl = chunk_masks(C)
    b_dh = state_or_zero(dht, i_bh, p_kv, m_kv, K, V, HAS_DHT, BK, R)
    key_base = 0 if ATOMIC else i_r.to(tl.int64) * NTOK * K
    NC = tl.cdiv(T_s, C)
    for j_c in range(0, NC):
        t0 = (NC - 1 - j_c) * C
        m_t, rows, m_tv, p_tv = chunk_at(t0, o_c, bos, T_s, i_h, o_v, m_v, H, V)
        b_h0 = tl.load(start_slot(hs, i_bh, bos, t0, H, K, V, C) + p_kv, mask=m_kv, other=0.)
        b_u = key_tile(k, rows, o_k, m_t, m_k, K)
        b_oq = key_tile(oq, rows, o_k, m_t, m_k, K)
        b_c = row_tile(c, CONSTS[0], MODES[0], rows, o_v, m_t, m_v, V, C, R)
        b_p = row_tile(p, CONSTS[1], MODES[1], rows, o_v, m_t, m_v, V, C, R)
        b_z = tl.load(z + p_tv, mask=m_tv, other=0.)
        b_do = tl.load(dy + p_tv, mask=m_tv, other=0.).to(tl.float32) * CONSTS[2]
        b_e, b_g, b_gp, b_gl = row_decays(a, rows, o_v, m_t, m_v, V, o_c, C)
        b_E = b_p - b_c * b_z
        b_uh = tl.dot(b_u, b_h0, input_precision=PREC)
        b_A = tl.where(strict, tl.dot(b_u, tl.trans(b_u), input_precision=PREC), 0.)
        b_L = tl.where(incl, tl.dot(b_oq, tl.trans(b_u), input_precision=PREC), 0.)
        b_kdh = tl.dot(b_u, b_dh, input_precision=PREC)
        b_h0dh = tl.sum(b_h0 * b_dh, axis=0)
        b_doh = b_do * tl.dot(b_oq, b_h0, input_precision=PREC)
        m, fast = mild_chunk(b_g, b_gp, o_c, C, FAST)
        if PATH == PATH_PRODUCTS:
            fast = True                     # a compile-time True: only the products are compiled
        if fast:
            b_w, b_dA, b_dL, b_da = scaled_adjoints(b_E, b_z, b_c, b_e, b_g, b_gp, b_gl, m, b_A, b_L, b_do, b_doh,
                                                    b_kdh, b_h0dh, strict, incl, o_c, C, R, PREC)
        else:
            b_w, b_dA, b_dL, b_da = decayed_adjoints(b_E, b_c, b_e, b_g, b_gp, b_A, b_L, b_uh, b_do, b_doh, b_kdh,
                                                     b_h0dh, o_c, C, R)
        tl.store(da + p_tv, b_da, mask=m_tv)
        if MODES[0] != 0:                                   # W, the adjoint of P - c o UH
            store_rows(dc, -b_w * b_z, MODES[0], rows, o_v, m_t, m_v, V, i_r, NTOK)
        if MODES[1] != 0:
            store_rows(dp, b_w, MODES[1], rows, o_v, m_t, m_v, V, i_r, NTOK)
        b_duh = -b_c * b_w * tl.exp(b_gp)                   # adjoints of K H0 and OQ H0, undecayed
        b_dohh = b_do * tl.exp(b_g)
        b_dk = (tl.dot(b_duh, tl.trans(b_h0), input_precision=PREC)
                + tl.dot(b_E * tl.exp(b_gl[None, :] - b_g), tl.trans(b_dh), input_precision=PREC)
                + tl.dot(b_dA + tl.trans(b_dA), b_u, input_precision=PREC)
                + tl.dot(tl.trans(b_dL), b_oq, input_precision=PREC))
        b_doq = tl.dot(b_dohh, tl.trans(b_h0), input_precision=PREC) + tl.dot(b_dL, b_u, input_precision=PREC)
        p_tk = key_base + rows[:, None] * K + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        put(dk + p_tk, b_dk, m_tk, ATOMIC)
        put(doq + p_tk, b_doq, m_tk, ATOMIC)
        b_dh = (b_dh * tl.exp(b_gl)[None, :] + tl.dot(tl.trans(b_u), b_duh, input_precision=PREC)
                + tl.dot(tl.trans(b_oq), b_dohh, input_precision=PREC))
    if STORE_DH0:
        tl.store(dh0 + i_bh.to(tl.int64) * K * V + p_kv, b_dh, mask=m_kv)
