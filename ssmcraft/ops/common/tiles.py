"""Triton helpers shared by the chunked kernels (``rank1_chunk``, ``keydecay_chunk``): the offsets
and masks of a block of a ``[K, V]`` state, of a chunk's rows and of a value block against them, and a state
block loaded or started at zero; the floored log of a decay, and a decay's gradient taken term by
term (each factor's coefficient times the product of the other decays in its span) where d log a / a
would have lost its digits; the WY families' products over value blocks for the gradients through
the readout and the state. Triton inlines them: a kernel compiles as if their lines were written
out in it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def state_block(i_k, i_v, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """Key block ``i_k`` x value block ``i_v`` of a ``[K, V]`` state: key offsets ``o_k [BK]`` and
    mask ``m_k``, value offsets ``o_v [BV]`` and mask ``m_v``, the block's mask ``m_kv [BK, BV]`` and
    its offsets inside one state ``p_kv [BK, BV]``."""
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    return o_k, m_k, o_v, m_v, m_k[:, None] & m_v[None, :], o_k[:, None] * V + o_v[None, :]


@triton.jit
def state_or_zero(ptr, i_bh, p_kv, m_kv, K, V, HAS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The fp32 block ``p_kv`` of state ``i_bh`` in ``ptr [B*H, K, V]`` when ``HAS``, else zeros (``ptr``
    unread): an initial state or a final state's gradient that may not be given."""
    if HAS:
        return tl.load(ptr + i_bh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
    else:
        return tl.zeros([BK, BV], dtype=tl.float32)


@triton.jit
def value_block(i_v, V, m_t, m_k, BV: tl.constexpr):
    """Value block ``i_v`` against a chunk's row mask ``m_t [BT]`` and a key mask ``m_k [BK]``:
    ``o_v [BV]``, ``m_v [BV]``, ``m_tv [BT, BV]`` and ``m_kv [BK, BV]``."""
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    return o_v, m_v, m_t[:, None] & m_v[None, :], m_k[:, None] & m_v[None, :]


@triton.jit
def chunk_rows(i_b, i_h, i_t, T, H, BT: tl.constexpr):
    """Chunk ``i_t``'s rows: local index ``o_i [BT]``, mask ``m_t`` (rows before T) and the flat
    (batch, time, head) row ids ``row`` (int64) of the ``[B, T, H, *]`` tensors."""
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < T
    return o_i, m_t, (i_b * T + o_t).to(tl.int64) * H + i_h


@triton.jit
def seq_rows(bos, i_h, i_t, T, H, BT: tl.constexpr):
    """``chunk_rows`` of chunk ``i_t`` of the sequence whose first row is ``bos`` (``b * T``, or its
    offset in a packed row) and whose length is T: rows past T are masked, not clamped."""
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    return o_i, o_t < T, (bos + o_t).to(tl.int64) * H + i_h


# The floor of a log-decay in the chunked kernels. A decay below e^-80 (~1.8e-35) scales the previous
# state by less than fp32's relative step (~6e-8) times 1e-27: next to the current token's term it
# contributes nothing measurable, so clamping its log there changes no fp32 output, and keeps every
# within-chunk sum finite: a decay of exactly 0 (a sigmoid gate that underflowed) has log -inf, and a
# sum through it gave exp(-inf - (-inf)) = NaN. Clamped, a chunk's sums stay within 80 BT of 0.
LOG_DECAY_MIN = -80.0
LOG_DECAY_FLOOR = tl.constexpr(LOG_DECAY_MIN)


@triton.jit
def log_decay(a):
    """``log a`` of a decay tile (fp32), clamped at ``LOG_DECAY_FLOOR`` (0 and tiny decays stay finite)."""
    return tl.maximum(tl.log(a), LOG_DECAY_FLOOR)


# The decay's gradient as d log a / a loses every digit below a ~ e^-3: d log a_r is a difference of
# reverse sums of O(1) terms that is itself O(a_r), and 1 / a_r blows its rounding up (and is NaN at
# a_r = 0). A chunk holding a decay below this takes it term by term instead (``pair_decay_grad``).
LOG_EXACT_DA = tl.constexpr(-3.0)


@triton.jit
def decay_before(b_g, b_gpt, o_g, o_j):
    """``E [BT, BTT]``: e^{gp_r - g_j}, the decays strictly between term row j and token r (columns),
    for rows j of tokens before r, else 0. The exponent is a later sum minus an earlier one (<= 0): no
    overflow, and a decay of 0 (at its clamped log) only ever zeroes the products it is in. An empty
    product (j of the token before r) is 1 exactly: its exponent, a difference of two sums of hundreds
    at tiny decays, carries their rounding (~1e-5), as a factor's error."""
    m_e = o_g[:, None] < o_j[None, :]
    b_e = tl.where(m_e, tl.exp(tl.where(m_e, b_gpt[None, :] - b_g[:, None], 0.)), 0.)
    return tl.where(o_g[:, None] + 1 == o_j[None, :], 1., b_e)


@triton.jit
def decay_after(b_gr, b_gt, m_f, m_one):
    """``F [rows, BTT]``: e^{gr_i - g_r}, the decays after token r (columns) up to row i's sum ``gr``
    (g, or gp for the decays before row i's token), where ``m_f`` (row i's token after r, or at r for
    gr = g), else 0; an exponent <= 0, as ``decay_before``'s; 1 exactly where ``m_one`` (the empty
    products, as ``decay_before``'s)."""
    return tl.where(m_one, 1., tl.where(m_f, tl.exp(tl.where(m_f, b_gr[:, None] - b_gt[None, :], 0.)), 0.))


@triton.jit
def pair_decay_grad(X, x0, F, E, b_gpt, PREC: tl.constexpr):
    """The part of d a_r [BTT] of the factors e^{g_i - g_j} (i on X's rows, j on its columns) whose
    span holds token r, each with a_r left out: sum_{i, j} F[i, r] X[i, j] E[j, r], plus the factors
    e^{g_i} from the chunk's start (coefficients ``x0`` on the rows), e^{gp_r} F[i, r] x0[i]. ``X`` and
    ``x0`` are the coefficients without their decays; F is ``Fg`` or ``Fgp`` for X's row sums."""
    Y = tl.dot(X, E, input_precision=PREC) + x0[:, None] * tl.exp(b_gpt)[None, :]
    return tl.sum(F * Y, axis=0)


@triton.jit
def key_decay_grad(X, xr, xc, x0, x7, hd, b_g, b_gp, b_gl, o_i, ROW_GP: tl.constexpr, BK: tl.constexpr,
                   PREC: tl.constexpr):
    """d a [BT, BK] of a chunk whose decay varies per key, term by term (``pair_decay_grad`` for each key
    k, a_r left out of every product): the pair factors e^{gr_i - g_j} with coefficients
    X[i, j] xr[i, k] xc[j, k] and the start factors e^{gr_i} with x0[i, k] (gr: gp if ROW_GP, else g),
    the end factors e^{gl - g_j} with x7[j, k] and e^{gl} with hd[k]. All coefficients without their
    decays; ``b_g``, ``b_gp`` [BT, BK] the chunk's sums and ``b_gl`` [BK] their last row."""
    o_c = tl.arange(0, BK)
    b_da = tl.zeros_like(b_g)
    for c in range(BK):
        sel = (o_c == c)[None, :]
        g_c = tl.sum(tl.where(sel, b_g, 0.), axis=1)
        gp_c = tl.sum(tl.where(sel, b_gp, 0.), axis=1)
        E = decay_before(g_c, gp_c, o_i, o_i)
        Xc = tl.sum(tl.where(sel, xr, 0.), axis=1)[:, None] * X * tl.sum(tl.where(sel, xc, 0.), axis=1)[None, :]
        if ROW_GP:
            F = decay_after(gp_c, g_c, o_i[:, None] > o_i[None, :], o_i[:, None] == o_i[None, :] + 1)
        else:
            F = decay_after(g_c, g_c, o_i[:, None] >= o_i[None, :], o_i[:, None] == o_i[None, :])
        b_d = pair_decay_grad(Xc, tl.sum(tl.where(sel, x0, 0.), axis=1), F, E, gp_c, PREC)
        b_end = tl.sum(E * tl.sum(tl.where(sel, x7, 0.), axis=1)[:, None], axis=0) + \
            tl.exp(gp_c) * tl.sum(tl.where(o_c == c, hd, 0.), axis=0)
        b_d += tl.exp(tl.sum(tl.where(o_c == c, b_gl, 0.), axis=0) - g_c) * b_end
        b_da += tl.where(sel, b_d[:, None], 0.)
    return b_da


@triton.jit
def readout_grads(hs, dhs, psi, do, base, row, trow, m_t, m_j, o_k, m_k, V, HAS_A: tl.constexpr, BT: tl.constexpr,
                  BTT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """A chunk's products over value blocks for the WY families' gradients through the readout O = L Psi +
    (OQ h0, decayed) and the state's Vbar^T Psi: dO h0^T [BTT, BK], dO Psi^T [BTT, BT], Psi dH^T [BT, BK]
    and, with a decay (``HAS_A``), sum_v h0 dH [BK]. ``hs`` / ``dhs`` + ``base``: the chunk's state and
    its gradient [K, V]; Psi [BT rows ``row``], dO [BTT rows ``trow``] (the same rows where a token
    has one term)."""
    b_dOQ = tl.zeros([BTT, BK], dtype=tl.float32)
    b_dLv = tl.zeros([BTT, BT], dtype=tl.float32)
    b_dVb = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v, m_v, m_tv, m_kv = value_block(i_v, V, m_t, m_k, BV)
        b_h = tl.load(hs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dh = tl.load(dhs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_psi = tl.load(psi + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_do = tl.load(do + trow[:, None] * V + o_v[None, :], mask=m_j[:, None] & m_v[None, :], other=0.)
        b_dOQ += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_dLv += tl.dot(b_do, tl.trans(b_psi), input_precision=PREC)
        b_dVb += tl.dot(b_psi, tl.trans(b_dh), input_precision=PREC)
        if HAS_A:
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    return b_dOQ, b_dLv, b_dVb, b_hdh
