"""The Triton kernels of the chunked rank-1 family; the algorithm, shapes and the host code that
launches them are in ``ssmcraft.ops.rank1_chunk.chunk``.

Group size ``R`` (a constexpr; 1 for the rank-1 family): each token carries R rank-1 terms that all
read the state left by the previous token (``ssmcraft.ops.rankr_chunk``). The terms are laid out as
rows of a sequence of ``T * R`` term rows (term ``i`` of token ``t`` at row ``t R + i``: u, v, p, c,
ps, and the chunk buffers M, W, Up, Psi), the tokens' tensors keep ``T`` rows (oq, a, g, o, and L,
whose rows are the chunk's tokens and its columns the chunk's term rows). A chunk is ``BT`` term
rows, ``BT / R`` tokens. The masks become token-strict (a term sees the terms of earlier tokens
only), the decay acts once per token and the output is read once per token, after its R terms.
With R = 1 each branch on R compiles to the rank-1 kernel's code.

Packed sequences (``VARLEN``, a constexpr; ``ssmcraft.ops.common.rows``): B = 1 and the row holds N
sequences (``cu`` their token offsets); each parallel program runs chunk ``ci[i_c]`` (a sequence and
a chunk within it: no chunk straddles two sequences), each sequential program one sequence from
its own initial state to its own final state. A sequence's term rows start at ``R`` times its first
token. The chunk states are ``[B, H, NT, K, V]`` (NT: every sequence's chunks, when packed). With
VARLEN off, the branches compile away and the rows are the batch row's."""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.chunked import state_stage_rule
from ssmcraft.ops.common.rows import seq_chunk, state_scan
from ssmcraft.ops.common.solvers import solve_unit_lower
from ssmcraft.ops.common.tiles import (LOG_EXACT_DA, decay_after, decay_before, log_decay, pair_decay_grad,
                                       readout_grads, value_block)
from ssmcraft.ops.common.tuning import tune, warp_rule

# where the per-head step c comes from (C_MODE): its own tensor, the insert scale ps (DeltaNet's
# c = ps = beta), or the product of the decay and ps (Gated DeltaNet's c = alpha beta)
C_GIVEN = tl.constexpr(0)
C_IS_PS = tl.constexpr(1)
C_IS_A_PS = tl.constexpr(2)


@triton.jit
def _step(c, a, ps, row, m_t, C_MODE: tl.constexpr):
    """The step c of a chunk's rows [BT] in fp32, per ``C_MODE``."""
    if C_MODE == C_IS_A_PS:
        return tl.load(a + row, mask=m_t, other=0.).to(tl.float32) * tl.load(ps + row, mask=m_t, other=0.).to(tl.float32)
    elif C_MODE == C_IS_PS:
        return tl.load(ps + row, mask=m_t, other=0.).to(tl.float32)
    else:
        return tl.load(c + row, mask=m_t, other=0.).to(tl.float32)


@triton.jit
def group_rows(bos, i_h, i_t, T, H, BT: tl.constexpr, R: tl.constexpr):
    """Chunk ``i_t`` of ``BT`` term rows (``R`` per token) of the sequence of T tokens whose first
    token is row ``bos`` (``b * T`` in a batch): the term rows' local index ``o_i``, mask ``m_t``
    (rows of the sequence) and ids ``row`` (int64) in ``[B, T*R, H, *]``; each term row's token
    within the chunk ``o_g`` and that token's id ``vtrow`` in ``[B, T, H, *]``; the chunk's token
    rows ``o_j``, mask ``m_j`` and ids ``trow``. R = 1: tokens and term rows coincide."""
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < T * R
    row = (bos * R + o_t).to(tl.int64) * H + i_h
    if R == 1:
        return o_i, m_t, row, o_i, row, o_i, m_t, row
    else:
        o_j = tl.arange(0, BT // R)
        o_s = i_t * (BT // R) + o_j
        return (o_i, m_t, row, o_i // R, (bos + i_t * (BT // R) + o_i // R).to(tl.int64) * H + i_h, o_j, o_s < T,
                (bos + o_s).to(tl.int64) * H + i_h)


@triton.jit
def _per_token(x, o_g, o_j, R: tl.constexpr):
    """A term-row vector ``x [BT]`` summed over each token's R rows: ``[BT / R]``."""
    if R == 1:
        return x
    else:
        return tl.sum(tl.where(o_g[None, :] == o_j[:, None], x[None, :], 0.), axis=1)


@triton.jit
def _chunk_decay(g, vtrow, m_t, bos, i_h, i_t, T, H: tl.constexpr, BTT: tl.constexpr):
    """The within-chunk log-decay sums ``g`` at the chunk's term rows (their tokens' ``vtrow``) and
    at its last token (``gl``; ``BTT`` tokens per chunk), and the factors ``e^{gl - g}`` (0 past the end).
    Rows past the end take ``gl`` (no decay there, as the forward's sums have it): with 0 there, a
    factor e^{g_t - g_s} from such a row overflows once the sums pass -88, and inf times its zero
    cotangent is NaN."""
    last = tl.minimum(T, i_t * BTT + BTT) - 1
    b_gl = tl.load(g + (bos + last).to(tl.int64) * H + i_h)
    b_g = tl.where(m_t, tl.load(g + vtrow, mask=m_t, other=0.), b_gl)
    return b_g, b_gl, tl.where(m_t, tl.exp(b_gl - b_g), 0.)


@tune([triton.Config({}, num_warps=w) for w in (4, 8)],
       key=["H", "K", "V", "BT", "HAS_A", "GENERAL", "HAS_PS", "C_MODE", "R", "VARLEN"], prune=warp_rule)
@triton.jit(do_not_specialize=["T"])
def rank1_chunk_prep_kernel(u, v, q, p, ps, oq, c, a, M, W, Up, L, Lq, g, cu, ci,
                 T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 HAS_A: tl.constexpr, GENERAL: tl.constexpr, HAS_PS: tl.constexpr,
                 C_MODE: tl.constexpr, PREC: tl.constexpr, R: tl.constexpr = 1, VARLEN: tl.constexpr = False):
    """Per chunk: M = (I + A)^{-1} [BT per term row], W [K], Up [V], L (and Lq) [BT per token], g
    (per token). C_MODE (``C_GIVEN``, ``C_IS_PS``, ``C_IS_A_PS``): where the step c comes from.
    R: terms per token (``C_IS_A_PS`` and GENERAL with R = 1 only)."""
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, T, i_t, _ = seq_chunk(cu, ci, tl.program_id(0), i_b, i_h, T, 0, H, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.device_chunks)
        return
    DT = W.dtype.element_ty
    o_i, m_t, row, o_g, vtrow, o_j, m_j, trow = group_rows(bos, i_h, i_t, T, H, BT, R)
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tt = m_t[:, None] & (o_i < BT)[None, :]
    lower = o_g[:, None] > o_g[None, :]
    incl = o_j[:, None] >= o_g[None, :]

    b_c = _step(c, a, ps, row, m_t, C_MODE)
    if HAS_A:
        b_la = log_decay(tl.load(a + vtrow, mask=m_t, other=1.).to(tl.float32))
        if R == 1:
            b_g = tl.cumsum(b_la, axis=0)
            b_gt = b_g
        else:   # the decay once per token: counted at its first term row
            b_g = tl.cumsum(tl.where(o_i % R == 0, b_la, 0.), axis=0)
            b_gt = tl.cumsum(log_decay(tl.load(a + trow, mask=m_j, other=1.).to(tl.float32)), axis=0)
        b_gp = b_g - b_la
        tl.store(g + trow, b_gt, mask=m_j)
        b_ch = b_c * tl.exp(b_gp)
    else:
        b_ch = b_c
    # L = tril(OQ V^T o Gamma) (and Lq with Q): token rows x term rows
    b_v = tl.load(v + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
    b_oq = tl.load(oq + trow[:, None] * K + o_k[None, :], mask=m_j[:, None] & (o_k < K)[None, :], other=0.)
    b_L = tl.dot(b_oq, tl.trans(b_v), input_precision=PREC)
    if HAS_A:
        b_L = b_L * tl.exp(tl.where(incl, b_gt[:, None] - b_g[None, :], 0.))
    b_L = tl.where(incl, b_L, 0.)
    tl.store(L + trow[:, None] * BT + o_i[None, :], b_L.to(DT), mask=m_j[:, None] & (o_i < BT)[None, :])
    if GENERAL:
        b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_Lq = tl.dot(b_oq, tl.trans(b_q), input_precision=PREC)
        if HAS_A:
            b_Lq = b_Lq * tl.exp(tl.where(incl, b_g[:, None] - b_g[None, :], 0.))
        b_Lq = tl.where(incl, b_Lq, 0.)
        tl.store(Lq + row[:, None] * BT + o_i[None, :], b_Lq.to(DT), mask=m_tt)

    # A = strict_lower(c_t (u_t . v_s) e^{gp_t - g_s}), M = (I + A)^{-1}
    b_u = tl.load(u + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
    b_A = tl.dot(b_u, tl.trans(b_v), input_precision=PREC)
    if HAS_A:
        b_A = b_A * tl.exp(tl.where(lower, b_gp[:, None] - b_g[None, :], 0.))
    b_A = tl.where(lower, b_A * b_c[:, None], 0.)
    b_M = solve_unit_lower(b_A, BT, PREC)
    tl.store(M + row[:, None] * BT + o_i[None, :], b_M.to(DT), mask=m_tt)
    b_Md = b_M.to(DT)
    b_cu = (b_u.to(tl.float32) * b_ch[:, None]).to(DT)
    b_W = tl.dot(b_Md, b_cu, input_precision=PREC)
    tl.store(W + row[:, None] * K + o_k[None, :], b_W.to(DT), mask=m_tk)

    if GENERAL:
        b_B = tl.dot(b_u, tl.trans(b_q), input_precision=PREC)
        if HAS_A:
            b_B = b_B * tl.exp(tl.where(lower, b_gp[:, None] - b_g[None, :], 0.))
        b_B = tl.where(lower, b_B * b_c[:, None], 0.)
        b_X = (-tl.dot(b_M, b_B, input_precision=PREC)).to(DT)      # -M B
    else:
        b_X = b_Md
    if HAS_PS:
        b_ps = tl.load(ps + row, mask=m_t, other=0.).to(tl.float32)

    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_p = tl.load(p + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        if HAS_PS:
            b_p = (b_p.to(tl.float32) * b_ps[:, None]).to(DT)
        b_up = tl.dot(b_X, b_p, input_precision=PREC)
        tl.store(Up + row[:, None] * V + o_v[None, :], b_up.to(DT), mask=m_tv)


@tune([triton.Config({"BV": bv}, num_warps=w, num_stages=s)
        for bv, w, s in ((32, 4, 2), (64, 4, 2), (32, 4, 1))],
       key=["H", "K", "V", "BT", "HAS_A", "GENERAL", "HAS_PS", "WRITE_O", "STORE_H", "HAS_H0", "STORE_HT", "R", "VARLEN"], prune=state_stage_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def rank1_chunk_fwd_state_kernel(v, q, p, ps, oq, W, Up, L, Lq, g, h0, o, hs, psi, ht, cu, co,
                      T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_A: tl.constexpr, GENERAL: tl.constexpr, HAS_PS: tl.constexpr,
                      WRITE_O: tl.constexpr, STORE_H: tl.constexpr, HAS_H0: tl.constexpr,
                      STORE_HT: tl.constexpr, PREC: tl.constexpr, R: tl.constexpr = 1,
                      VARLEN: tl.constexpr = False):
    """Sequential over chunks, one program per (value block, sequence, head). HAS_H0: start from
    ``h0`` (else from zero, ``h0`` unread); STORE_HT: write the final state to ``ht``."""
    DT = W.dtype.element_ty
    i_bh, i_h, o_k, m_k, o_v, m_v, m_kv, p_kv, b_h, bos, T, n_t, cb = state_scan(
        h0, cu, co, T, NT, H, K, V, BT // R, BK, BV, HAS_H0, VARLEN)

    for i_t in range(n_t):
        o_i, m_t, row, o_g, vtrow, o_j, m_j, trow = group_rows(bos, i_h, i_t, T, H, BT, R)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        if STORE_H:
            tl.store(hs + (cb + i_t) * K * V + p_kv, b_h.to(DT), mask=m_kv)
        b_hd = b_h.to(DT)
        b_w = tl.load(W + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_psi = tl.load(Up + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_psi -= tl.dot(b_w, b_hd, input_precision=PREC)
        if STORE_H:
            tl.store(psi + row[:, None] * V + o_v[None, :], b_psi.to(DT), mask=m_tv)
        b_psid = b_psi.to(DT)
        if HAS_A:
            b_g, b_gl, b_dec = _chunk_decay(g, vtrow, m_t, bos, i_h, i_t, T, H, BT // R)
        if WRITE_O:
            b_oq = tl.load(oq + trow[:, None] * K + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0.)
            b_o = tl.dot(b_oq, b_hd, input_precision=PREC)
            if HAS_A:
                if R == 1:
                    b_gt = b_g
                else:
                    b_gt = tl.where(m_j, tl.load(g + trow, mask=m_j, other=0.), b_gl)
                b_o = b_o * tl.exp(b_gt)[:, None]
            b_L = tl.load(L + trow[:, None] * BT + o_i[None, :], mask=m_j[:, None], other=0.)
            b_o += tl.dot(b_L, b_psid, input_precision=PREC)
            if GENERAL:
                b_p = tl.load(p + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
                if HAS_PS:
                    b_p = (b_p.to(tl.float32) * tl.load(ps + row, mask=m_t, other=0.)[:, None]).to(DT)
                b_Lq = tl.load(Lq + trow[:, None] * BT + o_i[None, :], mask=m_j[:, None], other=0.)
                b_o += tl.dot(b_Lq, b_p, input_precision=PREC)
            tl.store(o + trow[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_j[:, None] & m_v[None, :])
        b_vk = tl.load(v + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        if HAS_A:
            b_h *= tl.exp(b_gl)
            b_vk = (b_vk.to(tl.float32) * b_dec[:, None]).to(DT)
        b_h += tl.dot(tl.trans(b_vk), b_psid, input_precision=PREC)
        if GENERAL:
            b_qk = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            if HAS_A:
                b_qk = (b_qk.to(tl.float32) * b_dec[:, None]).to(DT)
            if not WRITE_O:
                b_p = tl.load(p + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
                if HAS_PS:
                    b_p = (b_p.to(tl.float32) * tl.load(ps + row, mask=m_t, other=0.)[:, None]).to(DT)
            b_h += tl.dot(tl.trans(b_qk), b_p, input_precision=PREC)

    if STORE_HT:
        tl.store(ht + i_bh.to(tl.int64) * K * V + p_kv, b_h, mask=m_kv)


@tune([triton.Config({"BV": bv}, num_warps=w, num_stages=s)
        for bv, w, s in ((32, 4, 2), (64, 4, 2), (32, 4, 1))],
       key=["H", "K", "V", "BT", "HAS_A", "HAS_DHT", "STORE_DH0", "R", "VARLEN"], prune=state_stage_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def rank1_chunk_bwd_state_kernel(v, oq, W, L, g, do, dht, dhs, dpsi, dh0, cu, co,
                      T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_A: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                      PREC: tl.constexpr, R: tl.constexpr = 1, VARLEN: tl.constexpr = False):
    """Reverse over chunks: dH at each chunk's end, dPsi = L^T dO + Vbar dH, and
    dH0 = e^{g_last} dH + (e^g OQ)^T dO - W^T dPsi. HAS_DHT: start from ``dht`` (else from zero,
    ``dht`` unread); STORE_DH0: write dH0 to ``dh0``."""
    DT = W.dtype.element_ty
    i_bh, i_h, o_k, m_k, o_v, m_v, m_kv, p_kv, b_dh, bos, T, n_t, cb = state_scan(
        dht, cu, co, T, NT, H, K, V, BT // R, BK, BV, HAS_DHT, VARLEN)

    for j in range(n_t):
        i_t = n_t - 1 - j
        o_i, m_t, row, o_g, vtrow, o_j, m_j, trow = group_rows(bos, i_h, i_t, T, H, BT, R)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        tl.store(dhs + (cb + i_t) * K * V + p_kv, b_dh.to(DT), mask=m_kv)
        b_do = tl.load(do + trow[:, None] * V + o_v[None, :], mask=m_j[:, None] & m_v[None, :], other=0.)
        b_L = tl.load(L + trow[:, None] * BT + o_i[None, :], mask=m_j[:, None], other=0.)
        b_vk = tl.load(v + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_oq = tl.load(oq + trow[:, None] * K + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0.)
        b_w = tl.load(W + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        if HAS_A:
            b_g, b_gl, b_dec = _chunk_decay(g, vtrow, m_t, bos, i_h, i_t, T, H, BT // R)
            b_vk = (b_vk.to(tl.float32) * b_dec[:, None]).to(DT)
            if R == 1:
                b_gt = b_g
            else:
                b_gt = tl.where(m_j, tl.load(g + trow, mask=m_j, other=0.), b_gl)
            b_oq = (b_oq.to(tl.float32) * tl.exp(b_gt)[:, None]).to(DT)
        b_dpsi = tl.dot(tl.trans(b_L), b_do, input_precision=PREC)
        b_dpsi += tl.dot(b_vk, b_dh.to(DT), input_precision=PREC)
        b_dpsid = b_dpsi.to(DT)
        tl.store(dpsi + row[:, None] * V + o_v[None, :], b_dpsid, mask=m_tv)
        if HAS_A:
            b_dh *= tl.exp(b_gl)
        b_dh += tl.dot(tl.trans(b_oq), b_do, input_precision=PREC)
        b_dh -= tl.dot(tl.trans(b_w), b_dpsid, input_precision=PREC)

    if STORE_DH0:
        tl.store(dh0 + i_bh.to(tl.int64) * K * V + p_kv, b_dh, mask=m_kv)


@tune([triton.Config({}, num_warps=w) for w in (4, 8)],
       key=["H", "K", "V", "BT", "HAS_A", "GENERAL", "U_IS_V", "HAS_PS", "C_MODE", "R", "VARLEN", "EXACT"],
       prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def rank1_chunk_bwd_grad_kernel(u, v, q, p, ps, oq, c, a, g, M, L, Lq, hs, dhs, psi, dpsi, do,
                 du, dv, dq, dp, dps, doq, dc, da, xp, xb, xq, xw, cu, ci,
                 T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 HAS_A: tl.constexpr, GENERAL: tl.constexpr, U_IS_V: tl.constexpr,
                 HAS_PS: tl.constexpr, C_MODE: tl.constexpr, PREC: tl.constexpr, R: tl.constexpr = 1,
                 VARLEN: tl.constexpr = False, EXACT: tl.constexpr = False):
    """Per chunk: gradients of u, v, q, p, oq, c, a from the chunk states h, their
    gradients dh (at the chunk's end), Psi and dPsi. Three phases keep few tiles live:
    (1) dW, dM-part and dp over value blocks, (2) the WY backward, (3) readout/state terms.
    C_MODE: c given (``dc`` written), c = ps (DeltaNet's beta: its two gradients summed into ``dc``)
    or c = a ps (Gated DeltaNet's alpha beta: dc goes to ``da`` and ``dps``, ``dc`` unwritten).
    d a is written as d log a / a; EXACT: a chunk holding a decay below e^LOG_EXACT_DA (``_tiny_chunk``)
    also stores what the coefficients of its decay factors are formed from that only the WY backward
    has, fp32 and without their decays: per term row ``xp`` dA c and ``xb`` dB c [BT], ``xw`` [3] (W's
    dch c, Qbar's q . dQb, dc ps); per token ``xq`` dLq [BT]; ``rank1_chunk_bwd_da_kernel`` then
    rewrites d a term by term. Only stores of tiles live here anyway branch on the chunk: with the
    term-by-term sums inside, ptxas spilled twice as much in every chunk (and with phase 3's
    coefficients stored too, 40 % more)."""
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, T, i_t, cb = seq_chunk(cu, ci, tl.program_id(0), i_b, i_h, T, NT, H, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.device_chunks)
        return
    DT = M.dtype.element_ty
    o_i, m_t, row, o_g, vtrow, o_j, m_j, trow = group_rows(bos, i_h, i_t, T, H, BT, R)
    BTT: tl.constexpr = BT // R
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    m_jk = m_j[:, None] & m_k[None, :]
    lower = o_g[:, None] > o_g[None, :]
    incl = o_j[:, None] >= o_g[None, :]
    base = (cb + i_t) * K * V

    b_M = tl.load(M + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.)
    b_c = _step(c, a, ps, row, m_t, C_MODE)
    if HAS_A:
        b_g, b_gl, b_dec = _chunk_decay(g, vtrow, m_t, bos, i_h, i_t, T, H, BTT)
        b_a = tl.load(a + vtrow, mask=m_t, other=1.).to(tl.float32)
        b_gp = b_g - log_decay(b_a)
        if EXACT:
            b_tiny = _tiny_chunk(b_a)
        b_ch = b_c * tl.exp(b_gp)
        b_dgv = tl.zeros([BT], dtype=tl.float32)
        b_dgp = tl.zeros([BT], dtype=tl.float32)
        # the tokens' g
        if R == 1:
            b_gt = b_g
        else:
            b_gt = tl.where(m_j, tl.load(g + trow, mask=m_j, other=0.), b_gl)
    else:
        b_ch = b_c

    # ---- phase 1: dW (as dPsi h^T), dPsi P^T, dp -------------------------------------
    if GENERAL:
        b_u = tl.load(u + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_Bnc = tl.dot(b_u, tl.trans(b_q), input_precision=PREC)
        if HAS_A:
            b_Bnc = b_Bnc * tl.exp(tl.where(lower, b_gp[:, None] - b_g[None, :], 0.))
        b_Bnc = tl.where(lower, b_Bnc, 0.)
        b_B = b_Bnc * b_c[:, None]
        b_nMB = (-tl.dot(b_M.to(tl.float32), b_B, input_precision=PREC)).to(DT)
        b_Lq = tl.load(Lq + trow[:, None] * BT + o_i[None, :], mask=m_j[:, None], other=0.)
        b_qd = b_q
        if HAS_A:
            b_qd = (b_q.to(tl.float32) * b_dec[:, None]).to(DT)
        b_dQb = tl.zeros([BT, BK], dtype=tl.float32)
        b_dLq = tl.zeros([BT, BT], dtype=tl.float32)
    b_dW = tl.zeros([BT, BK], dtype=tl.float32)      # dPsi h^T  (= -dW)
    b_dPM = tl.zeros([BT, BT], dtype=tl.float32)     # dPsi P^T
    if HAS_PS:
        b_ps = tl.load(ps + row, mask=m_t, other=0.).to(tl.float32)
        b_dps = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v, m_v, m_tv, m_kv = value_block(i_v, V, m_t, m_k, BV)
        b_h = tl.load(hs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dpsi = tl.load(dpsi + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_p = tl.load(p + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        if HAS_PS:
            b_p0 = b_p.to(tl.float32)
            b_p = (b_p0 * b_ps[:, None]).to(DT)
        b_dW += tl.dot(b_dpsi, tl.trans(b_h), input_precision=PREC)
        b_dPM += tl.dot(b_dpsi, tl.trans(b_p), input_precision=PREC)
        if GENERAL:
            b_dh = tl.load(dhs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
            b_do = tl.load(do + trow[:, None] * V + o_v[None, :], mask=m_j[:, None] & m_v[None, :], other=0.)
            b_dp = tl.dot(tl.trans(b_nMB), b_dpsi, input_precision=PREC)
            b_dp += tl.dot(tl.trans(b_Lq), b_do, input_precision=PREC)
            b_dp += tl.dot(b_qd, b_dh, input_precision=PREC)
            b_dQb += tl.dot(b_p, tl.trans(b_dh), input_precision=PREC)
            b_dLq += tl.dot(b_do, tl.trans(b_p), input_precision=PREC)
        else:
            b_dp = tl.dot(tl.trans(b_M), b_dpsi, input_precision=PREC)
        if HAS_PS:
            b_dps += tl.sum(b_dp * b_p0, axis=1)
            b_dp = b_dp * b_ps[:, None]
        tl.store(dp + row[:, None] * V + o_v[None, :], b_dp.to(dp.dtype.element_ty), mask=m_tv)
    if HAS_PS and C_MODE != C_IS_PS:   # c = a ps: a partial sum, finished in phase 2
        tl.store(dps + row, b_dps, mask=m_t)
    if GENERAL:
        if EXACT:
            if b_tiny:  # Lq's factors e^{g_t - g_s}: dLq (times oq . q), Qbar's e^{g_last - g_s}: q . dQb
                tl.store(xq + trow[:, None] * BT + o_i[None, :], b_dLq, mask=m_j[:, None])
                tl.store(xw + row * 3 + 1, tl.sum(b_q.to(tl.float32) * b_dQb, axis=1), mask=m_t)

    # ---- phase 2: WY backward: W = M diag(ch) U, Up = M P (or -M B P), M = (I + A)^{-1}
    if not GENERAL:
        b_u = tl.load(u + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
    b_v = tl.load(v + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
    b_u32 = b_u.to(tl.float32)
    b_dWd = (-b_dW).to(DT)
    b_cu = (b_u32 * b_ch[:, None]).to(DT)
    if GENERAL:
        b_dMBd = (-b_dPM).to(DT)
        b_dM = tl.dot(b_dMBd, tl.trans(b_B.to(DT)), input_precision=PREC)
        b_dM += tl.dot(b_dWd, tl.trans(b_cu), input_precision=PREC)
        b_dB = tl.where(lower, tl.dot(tl.trans(b_M), b_dMBd, input_precision=PREC), 0.)
    else:
        b_dM = b_dPM + tl.dot(b_dWd, tl.trans(b_cu), input_precision=PREC)
    b_dcu = tl.dot(tl.trans(b_M), b_dWd, input_precision=PREC)
    b_duu = b_dcu * b_ch[:, None]
    b_dch = tl.sum(b_dcu * b_u32, axis=1)
    if HAS_A:
        b_dcc = b_dch * tl.exp(b_gp)
        b_dgp += b_dch * b_ch
    else:
        b_dcc = b_dch
    b_T1 = tl.dot(tl.trans(b_M), b_dM.to(DT), input_precision=PREC)
    b_dA = tl.where(lower, -tl.dot(b_T1.to(DT), tl.trans(b_M), input_precision=PREC), 0.)
    b_Araw = tl.dot(b_u, tl.trans(b_v), input_precision=PREC)
    b_Anc = b_Araw
    if HAS_A:
        Gp = tl.exp(tl.where(lower, b_gp[:, None] - b_g[None, :], 0.))
        b_Anc = b_Araw * Gp
    b_Anc = tl.where(lower, b_Anc, 0.)
    b_dcc += tl.sum(b_dA * b_Anc, axis=1)
    b_dAc = b_dA * b_c[:, None]
    if HAS_A:
        X = b_dAc * b_Anc
        b_dgp += tl.sum(X, axis=1)
        b_dgv -= tl.sum(X, axis=0)
        if EXACT:
            if b_tiny:  # A's factors e^{gp_t - g_s}: dA c (times u . v), W's e^{gp_t} (c e^{gp}): dch c
                tl.store(xp + row[:, None] * BT + o_i[None, :], b_dAc, mask=m_t[:, None])
                tl.store(xw + row * 3, b_dch * b_c, mask=m_t)
        b_dAc = b_dAc * Gp
    b_dAcd = b_dAc.to(DT)
    b_duu += tl.dot(b_dAcd, b_v, input_precision=PREC)
    b_dvv = tl.dot(tl.trans(b_dAcd), b_u, input_precision=PREC)
    if GENERAL:
        b_dcc += tl.sum(b_dB * b_Bnc, axis=1)
        b_dBc = b_dB * b_c[:, None]
        if HAS_A:
            if EXACT:
                if b_tiny:  # B's factors e^{gp_t - g_s}: dB c (times u . q)
                    tl.store(xb + row[:, None] * BT + o_i[None, :], b_dBc, mask=m_t[:, None])
            X = b_dBc * b_Bnc
            b_dgp += tl.sum(X, axis=1)
            b_dgv -= tl.sum(X, axis=0)
            b_dBc = b_dBc * Gp
        b_dBcd = b_dBc.to(DT)
        b_duu += tl.dot(b_dBcd, b_q, input_precision=PREC)
        b_dqq = tl.dot(tl.trans(b_dBcd), b_u, input_precision=PREC)
    if U_IS_V:
        b_dvv += b_duu
    else:
        tl.store(du + row[:, None] * K + o_k[None, :], b_duu.to(du.dtype.element_ty), mask=m_tk)
    if C_MODE == C_IS_PS:
        b_dcc += b_dps
    if C_MODE == C_IS_A_PS:
        # c = a ps: dc ps goes to a at the end; dc a is added to the dps stored in phase 1, read back
        # after a barrier (the rows are this program's own), and a and ps are read again. Keeping
        # them live through phase 2 spills more and is slower; so is an fp32 scratch for the
        # partial: in 16 bits the partial is rounded once more, as autograd's sum of two 16-bit
        # gradients is (BENCHMARKS.md, "Rank-1 per head (chunked)")
        tl.debug_barrier()
        b_dps = tl.load(dps + row, mask=m_t, other=0.).to(tl.float32)
        b_dps += b_dcc * tl.load(a + row, mask=m_t, other=1.).to(tl.float32)
        tl.store(dps + row, b_dps.to(dps.dtype.element_ty), mask=m_t)
        b_dac = b_dcc * tl.load(ps + row, mask=m_t, other=0.).to(tl.float32)
        if EXACT:
            if b_tiny:  # dc ps, no decay factor: added as it is
                tl.store(xw + row * 3 + 2, b_dac, mask=m_t)
    else:
        tl.store(dc + row, b_dcc.to(dc.dtype.element_ty), mask=m_t)

    # ---- phase 3: readout (O = e^g OQ h + L Psi) and state (Vbar^T Psi) terms ---------
    b_dOQ, b_dLv, b_dVb, b_hdh = readout_grads(hs, dhs, psi, do, base, row, trow, m_t, m_j, o_k, m_k, V, HAS_A, BT,
                                                BTT, BK, BV, PREC)

    b_oq = tl.load(oq + trow[:, None] * K + o_k[None, :], mask=m_jk, other=0.)
    if HAS_A:
        b_dOQ = b_dOQ * tl.exp(b_gt)[:, None]
        b_dgt = tl.sum(b_dOQ * b_oq.to(tl.float32), axis=1)     # d g at the chunk's tokens
        b_L = tl.load(L + trow[:, None] * BT + o_i[None, :], mask=m_j[:, None], other=0.).to(tl.float32)
        X = b_dLv * b_L
        b_dgt += tl.sum(X, axis=1)
        b_dgv -= tl.sum(X, axis=0)
        Gm = tl.exp(tl.where(incl, b_gt[:, None] - b_g[None, :], 0.))
        b_dLv = tl.where(incl, b_dLv * Gm, 0.)
        b_dVb = b_dVb * b_dec[:, None]
        Y = tl.sum(b_v.to(tl.float32) * b_dVb, axis=1)
        b_dgv -= Y
        b_dgl = tl.exp(b_gl) * tl.sum(b_hdh, axis=0) + tl.sum(Y, axis=0)
    else:
        b_dLv = tl.where(incl, b_dLv, 0.)
    b_dLvd = b_dLv.to(DT)
    b_doq = b_dOQ + tl.dot(b_dLvd, b_v, input_precision=PREC)
    b_dvv += b_dVb + tl.dot(tl.trans(b_dLvd), b_oq, input_precision=PREC)

    if GENERAL:
        if HAS_A:
            X = b_dLq * b_Lq.to(tl.float32)
            b_dgt += tl.sum(X, axis=1)
            b_dgv -= tl.sum(X, axis=0)
            b_dLq = tl.where(incl, b_dLq * Gm, 0.)
            b_dQb = b_dQb * b_dec[:, None]
            Y = tl.sum(b_q.to(tl.float32) * b_dQb, axis=1)
            b_dgv -= Y
            b_dgl += tl.sum(Y, axis=0)
        else:
            b_dLq = tl.where(incl, b_dLq, 0.)
        b_dLqd = b_dLq.to(DT)
        b_doq += tl.dot(b_dLqd, b_q, input_precision=PREC)
        b_dqq += tl.dot(tl.trans(b_dLqd), b_oq, input_precision=PREC) + b_dQb
        tl.store(dq + row[:, None] * K + o_k[None, :], b_dqq.to(dq.dtype.element_ty), mask=m_tk)

    if HAS_A:
        # d g and d gp per token (a token's R term rows share its g and gp), then the reverse sums
        b_dgt += _per_token(b_dgv, o_g, o_j, R)
        b_dgt += tl.where(i_t * BTT + o_j == tl.minimum(T, i_t * BTT + BTT) - 1, b_dgl, 0.)   # at the last token
        b_dgp = _per_token(b_dgp, o_g, o_j, R)
        b_dla = tl.cumsum(b_dgt, axis=0, reverse=True) + tl.cumsum(b_dgp, axis=0, reverse=True) - b_dgp
        if R == 1:
            b_da = b_dla / b_a
        else:
            b_da = b_dla / tl.load(a + trow, mask=m_j, other=1.).to(tl.float32)
        if C_MODE == C_IS_A_PS:
            b_da += b_dac
        tl.store(da + trow, b_da.to(da.dtype.element_ty), mask=m_j)
    tl.store(dv + row[:, None] * K + o_k[None, :], b_dvv.to(dv.dtype.element_ty), mask=m_tk)
    tl.store(doq + trow[:, None] * K + o_k[None, :], b_doq.to(doq.dtype.element_ty), mask=m_jk)


@triton.jit
def _tiny_chunk(b_a):
    """Whether a chunk's decays ``b_a`` (its rows', 1 past its end) hold one below e^LOG_EXACT_DA, where d log
    a / a has lost its digits (and is NaN at a = 0): the chunks whose d a ``rank1_chunk_bwd_da_kernel``
    rewrites. One test for both kernels, so that the second reads what the first stored."""
    return tl.min(log_decay(b_a.to(tl.float32)), axis=0) < LOG_EXACT_DA


@tune([triton.Config({}, num_warps=w) for w in (8, 4)],
      key=["H", "K", "V", "BT", "GENERAL", "U_IS_V", "C_MODE", "R", "VARLEN"], prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def rank1_chunk_bwd_da_kernel(u, v, q, oq, a, g, hs, dhs, psi, do, xp, xb, xq, xw, da, cu, ci, T, NT,
                              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                              BV: tl.constexpr, GENERAL: tl.constexpr, U_IS_V: tl.constexpr, C_MODE: tl.constexpr,
                              PREC: tl.constexpr, R: tl.constexpr = 1, VARLEN: tl.constexpr = False):
    """Per chunk holding a decay below e^LOG_EXACT_DA (others return at once): d a rewritten term by term,
    each decay factor's coefficient times the product of the other decays in its span
    (``tiles.pair_decay_grad``): A's and B's e^{gp_t - g_s} and W's e^{gp_t} (rows: term rows; their
    coefficients from what ``rank1_chunk_bwd_grad_kernel`` stored with EXACT), L's and Lq's
    e^{g_t - g_s} and O's e^{g_t} (rows: tokens; dO Psi^T, dO h^T taken again over value blocks,
    ``tiles.readout_grads``), Vbar's and Qbar's e^{g_last - g_s} as L's at the last token and the state's
    e^{g_last} as O's there; plus dc ps where c = a ps. Launched after the gradient kernel, it writes
    nothing but ``da``."""
    i_bh = tl.program_id(1)
    i_h = i_bh % H
    bos, T, i_t, cb = seq_chunk(cu, ci, tl.program_id(0), i_bh // H, i_h, T, NT, H, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.device_chunks)
        return
    o_i, m_t, row, o_g, vtrow, o_j, m_j, trow = group_rows(bos, i_h, i_t, T, H, BT, R)
    b_at = tl.load(a + trow, mask=m_j, other=1.).to(tl.float32)
    if _tiny_chunk(b_at):
        BTT: tl.constexpr = BT // R
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_g, b_gl, b_dec = _chunk_decay(g, vtrow, m_t, bos, i_h, i_t, T, H, BTT)
        b_gp = b_g - log_decay(tl.load(a + vtrow, mask=m_t, other=1.).to(tl.float32))
        if R == 1:
            b_gt = b_g
            b_gpt = b_gp
        else:
            b_gt = tl.where(m_j, tl.load(g + trow, mask=m_j, other=0.), b_gl)
            b_gpt = b_gt - log_decay(b_at)
        E = decay_before(b_g, b_gpt, o_g, o_j)
        b_v = tl.load(v + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        if GENERAL:
            b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        # the term rows' factors: A's (and B's) pairs, W's from the chunk's start
        if U_IS_V:
            b_u = b_v
        else:
            b_u = tl.load(u + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        lower = o_g[:, None] > o_g[None, :]
        b_X = tl.load(xp + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.) * \
            tl.where(lower, tl.dot(b_u, tl.trans(b_v), input_precision=PREC), 0.)
        if GENERAL:
            b_X += tl.load(xb + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.) * \
                tl.where(lower, tl.dot(b_u, tl.trans(b_q), input_precision=PREC), 0.)
        Fgp = decay_after(b_gp, b_gt, o_g[:, None] > o_j[None, :], o_g[:, None] == o_j[None, :] + 1)
        b_da = pair_decay_grad(b_X, tl.load(xw + row * 3, mask=m_t, other=0.), Fgp, E, b_gpt, PREC)
        # the tokens' factors: L's (and Lq's) pairs with Vbar's (and Qbar's) at the last token, O's from the
        # chunk's start with the state's at the last token
        b_dOQ, b_dLv, b_dVb, b_hdh = readout_grads(hs, dhs, psi, do, (cb + i_t) * K * V, row, trow, m_t, m_j, o_k,
                                                    m_k, V, True, BT, BTT, BK, BV, PREC)
        incl = o_j[:, None] >= o_g[None, :]
        at_last = i_t * BTT + o_j == tl.minimum(T, i_t * BTT + BTT) - 1
        b_oq = tl.load(oq + trow[:, None] * K + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0.)
        b_x0 = tl.sum(b_dOQ * b_oq.to(tl.float32), axis=1) + tl.where(at_last, tl.sum(b_hdh, axis=0), 0.)
        b_x7 = tl.sum(b_v.to(tl.float32) * b_dVb, axis=1)
        b_X = b_dLv * tl.where(incl, tl.dot(b_oq, tl.trans(b_v), input_precision=PREC), 0.)
        if GENERAL:
            b_X += tl.load(xq + trow[:, None] * BT + o_i[None, :], mask=m_j[:, None], other=0.) * \
                tl.where(incl, tl.dot(b_oq, tl.trans(b_q), input_precision=PREC), 0.)
            b_x7 += tl.load(xw + row * 3 + 1, mask=m_t, other=0.)
        b_X = tl.where(at_last[:, None], b_X + b_x7[None, :], b_X)
        Fg = decay_after(b_gt, b_gt, o_j[:, None] >= o_j[None, :], o_j[:, None] == o_j[None, :])
        b_da += pair_decay_grad(b_X, b_x0, Fg, E, b_gpt, PREC)
        if C_MODE == C_IS_A_PS:     # R = 1: the term rows are the tokens
            b_da += tl.load(xw + row * 3 + 2, mask=m_t, other=0.)
        tl.store(da + trow, b_da.to(da.dtype.element_ty), mask=m_j)
