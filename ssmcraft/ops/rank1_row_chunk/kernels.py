"""Triton kernels of the chunked per-row rank-1 family (``chunk.py`` has the algebra).

One program per (sequence * head, block of R state rows), sequential over chunks of C tokens, the
state tile ``H = S^T [BK, R]`` (FLA's ``[K, V]`` layout) in registers. Tiles over a chunk are
``[C, R]`` (token, row) for the per-row scalars (z, c, p, outputs) and ``[C, BK]`` for the keys.
Every product is ``tl.dot`` in fp32 operands (``PREC``: tf32x3 for fp32 I/O, one tf32 pass for
16-bit I/O); the only per-token chain is the C-step substitution on ``[C, R]`` tiles.
Row coefficients (``c, p, oc, oh``) come per row (``[B, T, H, V]``, mode 2), per head
(``[B, T, H]``, mode 1) or as a constant (mode 0, ``CONSTS``); padded tokens read as 0, so that a
chunk cut by the sequence's end contributes nothing.
A per-head decay (``HAS_A``, ``a [B, T, H]``) enters as the chunk's cumulative log decays ``g`` (read
as 0 at padded tokens, so a cut chunk's last row holds its last token's sum) through factors
``e^{g_t - g_tau}`` with t later than tau, never ``e^{-g}`` alone (``chunk.py``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.tiles import decay_after, log_decay, pair_decay_grad, state_block, state_or_zero
from ssmcraft.ops.rank1_row.bwd import put


@triton.jit
def row_tile(ptr, CONST, MODE: tl.constexpr, rows, o_v, m_t, m_v, V, C: tl.constexpr, R: tl.constexpr):
    """``[C, R]`` fp32 tile of a row coefficient at token rows ``rows`` (``(bos + t) * H + h``, int64);
    0 at padded tokens and rows."""
    m = m_t[:, None] & m_v[None, :]
    if MODE == 2:
        x = tl.load(ptr + rows[:, None] * V + o_v[None, :], mask=m, other=0.).to(tl.float32)
    elif MODE == 1:
        x = tl.load(ptr + rows, mask=m_t, other=0.).to(tl.float32)[:, None] + tl.zeros([C, R], dtype=tl.float32)
        x = tl.where(m, x, 0.)
    else:
        x = tl.where(m, CONST, 0.)
    return x


@triton.jit
def head_scale(ptr, rows, m_t, HAS: tl.constexpr):
    """``[C]`` fp32 per-head factor of c at token rows ``rows`` (0 at padded tokens), or 1. where none."""
    if HAS:
        return tl.load(ptr + rows, mask=m_t, other=0.).to(tl.float32)
    else:
        return 1.


@triton.jit
def key_tile(ptr, rows, o_k, m_t, m_k, K: tl.constexpr):
    """``[C, BK]`` fp32 tile of a key slot at token rows ``rows``; 0 at padded tokens and keys."""
    return tl.load(ptr + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.).to(tl.float32)


@triton.jit
def store_rows(ptr, x, MODE: tl.constexpr, rows, o_v, m_t, m_v, V, i_r, NTOK):
    """A row coefficient's gradient ``x [C, R]``: per row into ``[B, T, H, V]``; per head summed over
    the block's rows into this row block's slice ``i_r`` of ``[NR, B * T * H]``; nothing for a constant."""
    if MODE == 2:
        tl.store(ptr + rows[:, None] * V + o_v[None, :], x, mask=m_t[:, None] & m_v[None, :])
    elif MODE == 1:
        tl.store(ptr + i_r.to(tl.int64) * NTOK + rows, tl.sum(tl.where(m_v[None, :], x, 0.), 1), mask=m_t)


@triton.jit
def store_c(dc, dcs, x, c, cs, CONST, MODE: tl.constexpr, HAS_CS: tl.constexpr, CS_IS_A: tl.constexpr, rows, o_v,
            m_t, m_v, V, i_r, NTOK, C: tl.constexpr, R: tl.constexpr):
    """The gradients of c from ``x [C, R]``, the gradient of the product c o cs (``HAS_CS``: cs [B, T, H]
    c's per-head factor): c's by ``store_rows`` (x cs) and cs's summed over the block's rows into its
    slice ``i_r`` of dcs [NR, B * T * H] (x c; c's and cs's tiles loaded again here rather than held
    through the backward's products, where registers are short). ``CS_IS_A``: cs is the decay itself
    (Gated Longhorn's alpha, both the decay and u's scale): cs's gradient [C] is returned, for the caller
    to add to the decay's, and nothing is stored to dcs; else 0."""
    if HAS_CS:
        store_rows(dc, x * head_scale(cs, rows, m_t, HAS_CS)[:, None], MODE, rows, o_v, m_t, m_v, V, i_r, NTOK)
        x = x * row_tile(c, CONST, MODE, rows, o_v, m_t, m_v, V, C, R)
        if CS_IS_A:
            return tl.sum(tl.where(m_v[None, :], x, 0.), 1)
        else:
            store_rows(dcs, x, 1, rows, o_v, m_t, m_v, V, i_r, NTOK)
            return 0.
    else:
        store_rows(dc, x, MODE, rows, o_v, m_t, m_v, V, i_r, NTOK)
        return 0.


@triton.jit
def program(cu, T, H: tl.constexpr, VARLEN: tl.constexpr):
    """This program's (sequence * head, row block, head, its sequence's first row, the sequence's
    length): batch row ``i_b``, or sequence ``i_b`` of a packed row."""
    i_bh = tl.program_id(0)
    i_b = i_bh // H
    if VARLEN:
        bos = tl.load(cu + i_b).to(tl.int64)
        T_s = (tl.load(cu + i_b + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_b.to(tl.int64) * T
        T_s = T
    return i_bh, tl.program_id(1), i_bh % H, bos, T_s


@triton.jit
def chunk_at(t0, o_c, bos, T_s, i_h, o_v, m_v, H: tl.constexpr, V: tl.constexpr):
    """The chunk of tokens from ``t0`` of a sequence (first row ``bos``, length ``T_s``): its token mask
    ``m_t`` [C], rows ``(bos + t) * H + h`` [C], and the mask and offsets of its [C, R] row tiles."""
    m_t = t0 + o_c < T_s
    rows = (bos + t0 + o_c) * H + i_h
    return m_t, rows, m_t[:, None] & m_v[None, :], rows[:, None] * V + o_v[None, :]


@triton.jit
def chunk_masks(C: tl.constexpr):
    """Token offsets of a chunk and its [C, C] masks over (t, tau): tau < t, and tau <= t."""
    o_c = tl.arange(0, C)
    return o_c, o_c[:, None] > o_c[None, :], o_c[:, None] >= o_c[None, :]


@triton.jit
def chunk_decays(a, rows, m_t, o_c, strict, incl, C: tl.constexpr):
    """A chunk's decay factors from its per-head decays ``a`` (1 at padded tokens): the cumulative logs
    ``g`` and ``gp`` (through the token before) [C], ``Gp [C, C] = e^{gp_t - g_tau}`` (tau < t, else 0),
    ``G = e^{g_t - g_tau}`` (tau <= t, else 0), and ``e^g``, ``e^gp``, ``e^{g_last - g}`` [C], ``e^g_last``:
    every exponent a later sum minus an earlier one (<= 0). The empty products (Gp's tau = t - 1, G's
    diagonal) are 1 exactly, as ``tiles.decay_before`` and ``decay_after`` make them, so that Gp and G are
    also the decay gradient's factors (``decay_grad_gp``, ``decay_grad_g``)."""
    b_la = log_decay(tl.load(a + rows, mask=m_t, other=1.).to(tl.float32))
    b_g = tl.cumsum(b_la, axis=0)
    b_gp = b_g - b_la
    b_gl = tl.sum(tl.where(o_c == C - 1, b_g, 0.), axis=0)
    Gp = decay_after(b_gp, b_g, strict, o_c[:, None] == o_c[None, :] + 1)
    G = decay_after(b_g, b_g, incl, o_c[:, None] == o_c[None, :])
    return b_g, b_gp, Gp, G, tl.exp(b_g), tl.exp(b_gp), tl.exp(b_gl - b_g), tl.exp(b_gl)


@triton.jit
def decayed(x, f, HAS_A: tl.constexpr):
    """``x * f`` with a decay, else ``x`` untouched (``f`` then a placeholder)."""
    if HAS_A:
        return x * f
    else:
        return x


@triton.jit
def start_slot(hs, i_bh, bos, t0, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr):
    """The address of the start state of the chunk at ``t0`` of the sequence whose first row is ``bos``
    in ``hs [NS, H, K, V]``: slot ``bos // C + i_b + t0 // C``, so that the sequences of a batch or a
    packed row (each taking at most ``len // C + 1`` slots) never overlap, ``NS = B T // C + N``."""
    slot = bos // C + i_bh // H + t0 // C
    return hs + (slot * H + i_bh % H) * K * V


@triton.jit
def solve(b_g, b_c, b_M, o_c, C: tl.constexpr, R: tl.constexpr, REVERSE: tl.constexpr):
    """W [C, R] solving W + c o (M W) = G row by row, M [C, C] shared by the rows: strictly lower
    (first token first) or, ``REVERSE``, strictly upper (last token first). Row t of G is final once
    the rows before it are done, so G itself becomes W; each step reads one row and one column of M."""
    for j in range(C):
        t = C - 1 - j if REVERSE else j
        sel = o_c == t
        w_t = tl.sum(tl.where(sel[:, None], b_g, 0.), 0)
        m_t = tl.sum(tl.where(sel[None, :], b_M, 0.), 1)
        b_g -= b_c * m_t[:, None] * w_t[None, :]
    return b_g


@triton.jit
def rank1_row_chunk_fwd_kernel(u, v, q, oq, a, c, cs, p, oc, oh, h0, y, ht, d, hs, cu, T,
                               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                               R: tl.constexpr, BK: tl.constexpr, MODES: tl.constexpr, CONSTS: tl.constexpr,
                               HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_D: tl.constexpr,
                               PREC: tl.constexpr, VARLEN: tl.constexpr, ONE_KEY: tl.constexpr,
                               HAS_A: tl.constexpr, HAS_CS: tl.constexpr):
    """y [B, T, H, V] = oc o (S_t oq_t) + oh; d [B, T, H, V] fp32 = c o (S_{t-1} u_t) (``STORE_D``); the final
    state ht [N, H, K, V] fp32 (``STORE_HT``) from h0 [N, H, K, V] (``HAS_H0``). MODES/CONSTS: of
    (c, p, oc, oh). ``ONE_KEY``: u, v and q are one tensor (Longhorn's k; v and q unread): A = Aq,
    Lv = Lq, and D enters only through E = P - D. ``HAS_A``: a per-head decay a [B, T, H]; with
    ``STORE_D`` every chunk's start state goes to hs (``start_slot``) for the backward. ``HAS_CS``: c is
    the product of c and a per-head factor cs [B, T, H] (Gated Longhorn's alpha of u = alpha k)."""
    i_bh, i_r, i_h, bos, T_s = program(cu, T, H, VARLEN)
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(0, i_r, K, V, BK, R)
    o_c, strict, incl = chunk_masks(C)
    b_h = state_or_zero(h0, i_bh, p_kv, m_kv, K, V, HAS_H0, BK, R)
    for t0 in range(0, T_s, C):
        m_t = t0 + o_c < T_s
        rows = (bos + t0 + o_c) * H + i_h
        b_u = key_tile(u, rows, o_k, m_t, m_k, K)
        b_oq = key_tile(oq, rows, o_k, m_t, m_k, K)
        b_c = row_tile(c, CONSTS[0], MODES[0], rows, o_v, m_t, m_v, V, C, R)
        if HAS_CS:
            b_c = b_c * head_scale(cs, rows, m_t, HAS_CS)[:, None]
        b_p = row_tile(p, CONSTS[1], MODES[1], rows, o_v, m_t, m_v, V, C, R)
        b_uh = tl.dot(b_u, b_h, input_precision=PREC)
        b_oh = tl.dot(b_oq, b_h, input_precision=PREC)
        if HAS_A:
            if STORE_D:
                tl.store(start_slot(hs, i_bh, bos, t0, H, K, V, C) + p_kv, b_h, mask=m_kv)
            # decayed: A and Aq carry e^{gp_t - g_tau}, Lv and Lq e^{g_t - g_tau}, H0's terms e^gp and e^g,
            # the end state's e^{g_last - g_tau}
            b_g, b_gp, Gp, G, b_eg, b_egp, b_ebar, b_egl = chunk_decays(a, rows, m_t, o_c, strict, incl, C)
            b_uh = b_uh * b_egp[:, None]
            b_oh = b_oh * b_eg[:, None]
        # A[t, tau] = u_t . v_tau, Aq[t, tau] = u_t . q_tau (tau < t): shared by every row of the head
        if ONE_KEY:
            b_A = tl.where(strict, tl.dot(b_u, tl.trans(b_u), input_precision=PREC), 0.)
            if HAS_A:
                b_A = b_A * Gp
            b_x = b_uh + tl.dot(b_A, b_p, input_precision=PREC)
        else:
            b_vk = key_tile(v, rows, o_k, m_t, m_k, K)
            b_q = key_tile(q, rows, o_k, m_t, m_k, K)
            b_A = tl.where(strict, tl.dot(b_u, tl.trans(b_vk), input_precision=PREC), 0.)
            b_Aq = tl.where(strict, tl.dot(b_u, tl.trans(b_q), input_precision=PREC), 0.)
            if HAS_A:
                b_A = b_A * Gp
                b_Aq = b_Aq * Gp
            b_x = b_uh + tl.dot(b_Aq, b_p, input_precision=PREC)
        # z = X - A D with D = c o z, X = U H0 + Aq P: D + c o (A D) = c o X, one token per step on [C, R]
        b_d = solve(b_c * b_x, b_c, b_A, o_c, C, R, False)
        # O = OQ H0 - Lv D + Lq P, Lv[t, tau] = oq_t . v_tau, Lq = oq_t . q_tau (tau <= t);
        # H_C = H0 - V^T D + Q^T P
        if ONE_KEY:
            b_e = b_p - b_d
            b_L = tl.where(incl, tl.dot(b_oq, tl.trans(b_u), input_precision=PREC), 0.)
            if HAS_A:
                b_L = b_L * G
                b_h = b_h * b_egl + tl.dot(tl.trans(b_u * b_ebar[:, None]), b_e, input_precision=PREC)
            else:
                b_h += tl.dot(tl.trans(b_u), b_e, input_precision=PREC)
            b_o = b_oh + tl.dot(b_L, b_e, input_precision=PREC)
        else:
            b_Lv = tl.where(incl, tl.dot(b_oq, tl.trans(b_vk), input_precision=PREC), 0.)
            b_Lq = tl.where(incl, tl.dot(b_oq, tl.trans(b_q), input_precision=PREC), 0.)
            if HAS_A:
                b_Lv = b_Lv * G
                b_Lq = b_Lq * G
                b_h = (b_h * b_egl - tl.dot(tl.trans(b_vk * b_ebar[:, None]), b_d, input_precision=PREC)
                       + tl.dot(tl.trans(b_q * b_ebar[:, None]), b_p, input_precision=PREC))
            else:
                b_h = (b_h - tl.dot(tl.trans(b_vk), b_d, input_precision=PREC)
                       + tl.dot(tl.trans(b_q), b_p, input_precision=PREC))
            b_o = b_oh - tl.dot(b_Lv, b_d, input_precision=PREC) + tl.dot(b_Lq, b_p, input_precision=PREC)
        b_o = b_o * row_tile(oc, CONSTS[2], MODES[2], rows, o_v, m_t, m_v, V, C, R)
        if MODES[3] != 0 or CONSTS[3] != 0.0:
            b_o += row_tile(oh, CONSTS[3], MODES[3], rows, o_v, m_t, m_v, V, C, R)
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = rows[:, None] * V + o_v[None, :]
        tl.store(y + p_tv, b_o.to(y.dtype.element_ty), mask=m_tv)
        if STORE_D:
            tl.store(d + p_tv, b_d, mask=m_tv)
    if STORE_HT:
        tl.store(ht + i_bh.to(tl.int64) * K * V + p_kv, b_h, mask=m_kv)


# d a [C] of a chunk is taken term by term (``tiles.pair_decay_grad``: each factor's coefficient times the
# product of the other decays in its span, exact at tiny and zero decays), in two parts, each where its
# coefficients are at hand. Coefficients without their decays, summed over the block's rows. The factors
# are ``chunk_decays``' own: Gp holds the decays after token r up to before row t's token
# (``tiles.decay_after``'s Fgp), G those up to row t's token (Fg), Gp^T those strictly between a term row
# and r (``tiles.decay_before``'s E).

@triton.jit
def decay_grad_gp(X_p, x0p, b_gp, Gp, PREC: tl.constexpr):
    """d a's part of the pairs e^{gp_t - g_tau} (coefficients ``X_p``) and the start factors e^gp_t (``x0p``)."""
    return pair_decay_grad(X_p, x0p, Gp, tl.trans(Gp), b_gp, PREC)


@triton.jit
def decay_grad_g(X_g, x0g, b_gp, Gp, G, PREC: tl.constexpr):
    """d a's part of the pairs e^{g_t - g_tau} (coefficients ``X_g``, the end state's factors folded into the
    last row) and the start factors e^g_t (``x0g``)."""
    return pair_decay_grad(X_g, x0g, G, tl.trans(Gp), b_gp, PREC)


@triton.jit
def start_out_coef(b_oq, b_doh, b_hdh, o_c, C: tl.constexpr):
    """x0g [C] of ``decay_grad_g``: the coefficients of e^g_t in the outputs (dO . (OQ H0) per token, taken
    as OQ . (dO H0^T), whose product doq needs anyway) and of e^g_last in the end state (``b_hdh`` =
    dH . H0, the last token's)."""
    return tl.sum(b_oq * b_doh, axis=1) + tl.where(o_c == C - 1, b_hdh, 0.)


@triton.jit
def rank1_row_chunk_bwd_kernel(u, v, q, oq, a, c, cs, p, oc, d, ht, hs, dy, dht, du, dv, dq, doq, da, dc, dcs, dp,
                               doc, dh0,
                               cu, T, NTOK, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                               R: tl.constexpr, BK: tl.constexpr, MODES: tl.constexpr, CONSTS: tl.constexpr,
                               HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
                               VARLEN: tl.constexpr, ONE_KEY: tl.constexpr, HAS_A: tl.constexpr,
                               HAS_CS: tl.constexpr, ATOMIC: tl.constexpr, CS_IS_A: tl.constexpr):
    """Reverse over chunks from the final state ht (each chunk's start state rebuilt exactly from its
    end state and the stored D: H0 = H_C + V^T D - Q^T P; z = X - A D where dc needs it; ``HAS_A``: read
    from the forward's hs, as the decays cannot be divided out). Writes this row block's slice of
    du, dv, dq, doq [NR, B, T, H, K] (``ONE_KEY``: du holds the three key slots' sum, dv and dq are
    unwritten), of da [NR, B * T * H] (``HAS_A``), the row coefficients' gradients (``store_rows``) and dh0.
    With a decay the products below take the decayed matrices (``chunk_decays``) and the undecayed
    adjoints ``G o dM`` for the keys. ``HAS_CS``: c's per-head factor cs, its gradient (summed over the
    block's rows) into this row block's slice of dcs [NR, B * T * H] (``store_c``), or, ``CS_IS_A`` (cs
    is the decay a), added into da's."""
    i_bh, i_r, i_h, bos, T_s = program(cu, T, H, VARLEN)
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(0, i_r, K, V, BK, R)
    o_c, strict, incl = chunk_masks(C)
    if not HAS_A:
        b_h = tl.load(ht + i_bh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.)
    b_dh = state_or_zero(dht, i_bh, p_kv, m_kv, K, V, HAS_DHT, BK, R)
    key_base = 0 if ATOMIC else i_r.to(tl.int64) * NTOK * K
    NC = tl.cdiv(T_s, C)
    for j_c in range(0, NC):
        t0 = (NC - 1 - j_c) * C
        m_t, rows, m_tv, p_tv = chunk_at(t0, o_c, bos, T_s, i_h, o_v, m_v, H, V)
        b_u = key_tile(u, rows, o_k, m_t, m_k, K)
        b_oq = key_tile(oq, rows, o_k, m_t, m_k, K)
        b_c = row_tile(c, CONSTS[0], MODES[0], rows, o_v, m_t, m_v, V, C, R)
        if HAS_CS:
            b_c = b_c * head_scale(cs, rows, m_t, HAS_CS)[:, None]
        b_p = row_tile(p, CONSTS[1], MODES[1], rows, o_v, m_t, m_v, V, C, R)
        b_oc = row_tile(oc, CONSTS[2], MODES[2], rows, o_v, m_t, m_v, V, C, R)
        b_d = tl.load(d + p_tv, mask=m_tv, other=0.)
        b_dy = tl.load(dy + p_tv, mask=m_tv, other=0.).to(tl.float32)
        b_do = b_oc * b_dy
        b_dht = tl.trans(b_dh)
        p_tk = key_base + rows[:, None] * K + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        if HAS_A:
            b_h0 = tl.load(start_slot(hs, i_bh, bos, t0, H, K, V, C) + p_kv, mask=m_kv, other=0.)
            # the end state's coefficient of e^g_last (``start_out_coef``), taken first: fewer tiles are live
            b_hdh = tl.sum(tl.sum(b_dh * b_h0, 1), 0)
            b_g, b_gp, Gp, G, b_eg, b_egp, b_ebar, b_egl = chunk_decays(a, rows, m_t, o_c, strict, incl, C)
            b_eg, b_egp, b_ebar = b_eg[:, None], b_egp[:, None], b_ebar[:, None]
        else:
            Gp, G, b_eg, b_egp, b_ebar, b_egl = 1., 1., 1., 1., 1., 1.   # unread: ``decayed`` returns x as it is
        if ONE_KEY:
            b_e = b_p - b_d
            if not HAS_A:
                # the chunk's start state from its end state
                b_h0 = b_h - tl.dot(tl.trans(b_u), b_e, input_precision=PREC)
            b_Au = tl.where(strict, tl.dot(b_u, tl.trans(b_u), input_precision=PREC), 0.)
            b_Lu = tl.where(incl, tl.dot(b_oq, tl.trans(b_u), input_precision=PREC), 0.)
            b_uh = tl.dot(b_u, b_h0, input_precision=PREC)
            b_ud = tl.dot(b_u, b_dh, input_precision=PREC)
            b_A = decayed(b_Au, Gp, HAS_A)
            b_L = decayed(b_Lu, G, HAS_A)
            if MODES[2] != 0:
                b_oh = tl.dot(b_oq, b_h0, input_precision=PREC)
                store_rows(doc, b_dy * (decayed(b_oh, b_eg, HAS_A) + tl.dot(b_L, b_e, input_precision=PREC)), MODES[2],
                           rows, o_v, m_t, m_v, V, i_r, NTOK)
            # adjoint of D = c o z through the outputs and the end state
            b_gd = -tl.dot(tl.trans(b_L), b_do, input_precision=PREC) - decayed(b_ud, b_ebar, HAS_A)
            if HAS_A:
                # the decay's factors that the substitution does not reach, before it, so that what they are
                # formed from dies before it: L's pairs, O's start terms and the end state's (the last row's)
                b_dL = tl.where(incl, tl.dot(b_do, tl.trans(b_e), input_precision=PREC), 0.)
                b_Xg = b_dL * b_Lu
                b_Xg = tl.where((o_c == C - 1)[:, None], b_Xg + tl.sum(b_ud * b_e, axis=1)[None, :], b_Xg)
                b_doh = tl.dot(b_do, tl.trans(b_h0), input_precision=PREC)
                b_da = decay_grad_g(b_Xg, start_out_coef(b_oq, b_doh, b_hdh, o_c, C), b_gp, Gp, G, PREC)
            b_AT = tl.trans(b_A)
            b_w = solve(b_c * b_gd, b_c, b_AT, o_c, C, R, True)
            # dp = Aq^T W + Lq^T dO + Q dH = A^T W - gD, and dc = Z o (gD - A^T W) = -Z o dp
            b_dp = tl.dot(b_AT, b_w, input_precision=PREC) - b_gd
            if MODES[0] != 0 or HAS_CS:
                b_z = decayed(b_uh, b_egp, HAS_A) + tl.dot(b_A, b_e, input_precision=PREC)
                b_dcs = store_c(dc, dcs, -b_z * b_dp, c, cs, CONSTS[0], MODES[0], HAS_CS, CS_IS_A, rows, o_v, m_t,
                                m_v, V, i_r, NTOK, C, R)
            if MODES[1] != 0:
                store_rows(dp, b_dp, MODES[1], rows, o_v, m_t, m_v, V, i_r, NTOK)
            # A (as both A and Aq) and L (as Lv and Lq) see D and P only through E = P - D
            b_dA = tl.where(strict, tl.dot(b_w, tl.trans(b_e), input_precision=PREC), 0.)
            if HAS_A:
                # A's pairs and X's start terms
                b_da += decay_grad_gp(b_dA * b_Au, tl.sum(b_w * b_uh, axis=1), b_gp, Gp, PREC)
                if CS_IS_A:
                    b_da += b_dcs
                tl.store(da + i_r.to(tl.int64) * NTOK + rows, b_da, mask=m_t)
            else:
                b_dL = tl.where(incl, tl.dot(b_do, tl.trans(b_e), input_precision=PREC), 0.)
            b_dA = decayed(b_dA, Gp, HAS_A)
            b_dL = decayed(b_dL, G, HAS_A)
            b_du = (tl.dot(decayed(b_w, b_egp, HAS_A), tl.trans(b_h0), input_precision=PREC)
                    + tl.dot(decayed(b_e, b_ebar, HAS_A), b_dht, input_precision=PREC)
                    + tl.dot(b_dA + tl.trans(b_dA), b_u, input_precision=PREC)
                    + tl.dot(tl.trans(b_dL), b_oq, input_precision=PREC))
            if not HAS_A:
                b_doh = tl.dot(b_do, tl.trans(b_h0), input_precision=PREC)
            b_doq = decayed(b_doh, b_eg, HAS_A) + tl.dot(b_dL, b_u, input_precision=PREC)
            put(du + p_tk, b_du, m_tk, ATOMIC)
        else:
            b_vk = key_tile(v, rows, o_k, m_t, m_k, K)
            b_q = key_tile(q, rows, o_k, m_t, m_k, K)
            if not HAS_A:
                b_h0 = (b_h + tl.dot(tl.trans(b_vk), b_d, input_precision=PREC)
                        - tl.dot(tl.trans(b_q), b_p, input_precision=PREC))
            b_Au = tl.where(strict, tl.dot(b_u, tl.trans(b_vk), input_precision=PREC), 0.)
            b_Aqu = tl.where(strict, tl.dot(b_u, tl.trans(b_q), input_precision=PREC), 0.)
            b_Lvu = tl.where(incl, tl.dot(b_oq, tl.trans(b_vk), input_precision=PREC), 0.)
            b_Lqu = tl.where(incl, tl.dot(b_oq, tl.trans(b_q), input_precision=PREC), 0.)
            b_vd = tl.dot(b_vk, b_dh, input_precision=PREC)
            b_qd = tl.dot(b_q, b_dh, input_precision=PREC)
            b_A = decayed(b_Au, Gp, HAS_A)
            b_Aq = decayed(b_Aqu, Gp, HAS_A)
            b_Lv = decayed(b_Lvu, G, HAS_A)
            b_Lq = decayed(b_Lqu, G, HAS_A)
            b_uh = tl.dot(b_u, b_h0, input_precision=PREC)
            if MODES[2] != 0:
                b_oh = tl.dot(b_oq, b_h0, input_precision=PREC)
                b_o = (decayed(b_oh, b_eg, HAS_A) - tl.dot(b_Lv, b_d, input_precision=PREC)
                       + tl.dot(b_Lq, b_p, input_precision=PREC))
                store_rows(doc, b_dy * b_o, MODES[2], rows, o_v, m_t, m_v, V, i_r, NTOK)
            b_gd = -tl.dot(tl.trans(b_Lv), b_do, input_precision=PREC) - decayed(b_vd, b_ebar, HAS_A)
            b_AT = tl.trans(b_A)
            b_w = solve(b_c * b_gd, b_c, b_AT, o_c, C, R, True)
            if MODES[0] != 0 or HAS_CS:
                b_z = (decayed(b_uh, b_egp, HAS_A) + tl.dot(b_Aq, b_p, input_precision=PREC)
                       - tl.dot(b_A, b_d, input_precision=PREC))
                b_dcs = store_c(dc, dcs, b_z * (b_gd - tl.dot(b_AT, b_w, input_precision=PREC)), c, cs, CONSTS[0],
                                MODES[0], HAS_CS, CS_IS_A, rows, o_v, m_t, m_v, V, i_r, NTOK, C, R)
            b_dA = tl.where(strict, -tl.dot(b_w, tl.trans(b_d), input_precision=PREC), 0.)
            b_dAq = tl.where(strict, tl.dot(b_w, tl.trans(b_p), input_precision=PREC), 0.)
            b_dLv = tl.where(incl, -tl.dot(b_do, tl.trans(b_d), input_precision=PREC), 0.)
            b_dLq = tl.where(incl, tl.dot(b_do, tl.trans(b_p), input_precision=PREC), 0.)
            if MODES[1] != 0:
                b_dp = (tl.dot(tl.trans(b_Aq), b_w, input_precision=PREC)
                        + tl.dot(tl.trans(b_Lq), b_do, input_precision=PREC) + decayed(b_qd, b_ebar, HAS_A))
                store_rows(dp, b_dp, MODES[1], rows, o_v, m_t, m_v, V, i_r, NTOK)
            b_h0t = tl.trans(b_h0)
            if HAS_A:
                b_doh = tl.dot(b_do, b_h0t, input_precision=PREC)
                b_Xg = b_dLv * b_Lvu + b_dLq * b_Lqu
                b_x7 = tl.sum(b_qd * b_p - b_vd * b_d, axis=1)
                b_Xg = tl.where((o_c == C - 1)[:, None], b_Xg + b_x7[None, :], b_Xg)
                b_da = (decay_grad_gp(b_dA * b_Au + b_dAq * b_Aqu, tl.sum(b_w * b_uh, axis=1), b_gp, Gp, PREC)
                        + decay_grad_g(b_Xg, start_out_coef(b_oq, b_doh, b_hdh, o_c, C), b_gp, Gp, G, PREC))
                if CS_IS_A:
                    b_da += b_dcs
                tl.store(da + i_r.to(tl.int64) * NTOK + rows, b_da, mask=m_t)
            b_dA = decayed(b_dA, Gp, HAS_A)
            b_dAq = decayed(b_dAq, Gp, HAS_A)
            b_dLv = decayed(b_dLv, G, HAS_A)
            b_dLq = decayed(b_dLq, G, HAS_A)
            b_du = (tl.dot(decayed(b_w, b_egp, HAS_A), b_h0t, input_precision=PREC)
                    + tl.dot(b_dA, b_vk, input_precision=PREC) + tl.dot(b_dAq, b_q, input_precision=PREC))
            b_dv = (tl.dot(tl.trans(b_dA), b_u, input_precision=PREC)
                    + tl.dot(tl.trans(b_dLv), b_oq, input_precision=PREC)
                    - tl.dot(decayed(b_d, b_ebar, HAS_A), b_dht, input_precision=PREC))
            b_dq = (tl.dot(tl.trans(b_dAq), b_u, input_precision=PREC)
                    + tl.dot(tl.trans(b_dLq), b_oq, input_precision=PREC)
                    + tl.dot(decayed(b_p, b_ebar, HAS_A), b_dht, input_precision=PREC))
            if not HAS_A:
                b_doh = tl.dot(b_do, b_h0t, input_precision=PREC)
            b_doq = (decayed(b_doh, b_eg, HAS_A)
                     + tl.dot(b_dLv, b_vk, input_precision=PREC) + tl.dot(b_dLq, b_q, input_precision=PREC))
            put(du + p_tk, b_du, m_tk, ATOMIC)
            put(dv + p_tk, b_dv, m_tk, ATOMIC)
            put(dq + p_tk, b_dq, m_tk, ATOMIC)
        put(doq + p_tk, b_doq, m_tk, ATOMIC)
        # adjoint of the chunk's start state: the end state's, the substitution's right side, the outputs
        b_dh = (decayed(b_dh, b_egl, HAS_A) + tl.dot(tl.trans(b_u), decayed(b_w, b_egp, HAS_A), input_precision=PREC)
                + tl.dot(tl.trans(b_oq), decayed(b_do, b_eg, HAS_A), input_precision=PREC))
        if not HAS_A:
            b_h = b_h0
    if STORE_DH0:
        tl.store(dh0 + i_bh.to(tl.int64) * K * V + p_kv, b_dh, mask=m_kv)
