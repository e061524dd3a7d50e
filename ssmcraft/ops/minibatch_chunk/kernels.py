"""The Triton kernels of the chunked mini-batch family; the algorithm, shapes and the host code that
launches them are in ``ssmcraft.ops.minibatch_chunk.chunk``."""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.tiles import (LOG_EXACT_DA, decay_after, decay_before, log_decay, pair_decay_grad, seq_rows,
                                       state_block)
from ssmcraft.ops.common.tuning import tune, warp_rule
from ssmcraft.ops.common.rows import seq_chunk, state_scan


@triton.jit
def _decays(a, row, m_t, o_i, BT: tl.constexpr, HAS_G: tl.constexpr):
    """The chunk's log-decay sums ``g_t = sum_{r<=t} log a_r`` [BT] (from the chunk's first row; 0 past
    T), the last row's ``gl``, the within-chunk factors ``Gam[t, s] = e^{g_t - g_s}`` on ``s <= t`` (0
    elsewhere and past T) and ``e^{gl - g}`` (0 past T). Without a decay: zeros, ones on the lower
    triangle, ones."""
    incl = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    if HAS_G:
        b_la = log_decay(tl.load(a + row, mask=m_t, other=1.).to(tl.float32))
        b_g = tl.cumsum(b_la, axis=0)
        # gl is the cumulative sum's own last entry (rows past T add 0), not a sum in another order:
        # e^{gl - g_last} is then exactly 1 however large the sums grow (tiny decays: hundreds)
        b_gl = tl.sum(tl.where(o_i == BT - 1, b_g, 0.), axis=0)
        # the exponent is masked before exp: past T or above the diagonal it could overflow
        b_gam = tl.exp(tl.where(incl, b_g[:, None] - b_g[None, :], float("-inf")))
        b_dec = tl.exp(tl.where(m_t, b_gl - b_g, float("-inf")))
    else:
        b_g = tl.zeros([BT], dtype=tl.float32)
        b_gl = 0.
        b_gam = tl.where(incl, 1., 0.)
        b_dec = tl.where(m_t, 1., 0.)
    return b_g, b_gl, b_gam, b_dec


@triton.jit
def _start_weights(lam, row, m_t, b_g, b_gl, b_gam, b_dec, HAS_G: tl.constexpr, HAS_L: tl.constexpr):
    """The weight of the chunk's start state in each row's state, ``w_t = e^{g_t} - sum_{s<=t} Gam[t, s]
    lam_s`` [BT] (``lam``: the per-head anchor decay ``- lam_t S_c``, 0 without HAS_L), the last row's
    ``wl`` and the chunk's ``lam`` [BT] (0 past T)."""
    if HAS_G:
        b_eg = tl.exp(b_g)
        b_el = tl.exp(b_gl)
    else:
        b_eg = tl.full(b_g.shape, 1., tl.float32)
        b_el = 1.
    if HAS_L:
        b_lam = tl.load(lam + row, mask=m_t, other=0.).to(tl.float32)
        b_w = b_eg - tl.sum(b_gam * b_lam[None, :], axis=1)
        b_wl = b_el - tl.sum(b_dec * b_lam, axis=0)
    else:
        b_lam = tl.zeros(b_g.shape, dtype=tl.float32)
        b_w = b_eg
        b_wl = b_el
    return b_w, b_wl, b_lam


@triton.jit
def _step(c, row, o_v, m_tv, m_t, V: tl.constexpr, C_ROW: tl.constexpr):
    """The step of the chunk's rows as a [BT, BV] (per row) or [BT, 1] (per head) fp32 block."""
    if C_ROW:
        return tl.load(c + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
    else:
        return tl.load(c + row, mask=m_t, other=0.).to(tl.float32)[:, None]


@tune([triton.Config({"BV": bv}, num_warps=w, num_stages=s)
       for bv, w, s in ((32, 4, 2), (64, 4, 2), (32, 2, 2))],
      key=["H", "K", "V", "BT", "HAS_G", "HAS_L", "HAS_U", "C_ROW", "STORE_H", "HAS_H0", "STORE_HT"])
@triton.jit(do_not_specialize=["T", "NT"])
def minibatch_fwd_kernel(u, v, p, c, oq, a, lam, h0, o, hs, ht, cu, co,
                         T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         HAS_G: tl.constexpr, HAS_L: tl.constexpr, HAS_U: tl.constexpr,
                         C_ROW: tl.constexpr, STORE_H: tl.constexpr,
                         HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr,
                         VARLEN: tl.constexpr):
    """Sequential over chunks, one program per (value block, sequence, head): per chunk from its start
    state H0, Rc = c . (U H0 - P), O = w . (OQ H0) - (OQ V^T . Gam) Rc, H = wl H0 - Vbar^T Rc.
    STORE_H keeps every chunk's start state (fp32) for the backward. VARLEN: sequence ``i_b`` of a
    packed row (``rows.seq_state``: its mini-batches start at its first token); else batch row ``i_b``."""
    DT = o.dtype.element_ty
    i_bh, i_h, o_k, m_k, o_v, m_v, m_kv, p_kv, b_h, bos, T, n_t, cb = state_scan(
        h0, cu, co, T, NT, H, K, V, BT, BK, BV, HAS_H0, VARLEN)
    for i_t in range(n_t):
        o_i, m_t, row = seq_rows(bos, i_h, i_t, T, H, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        if STORE_H:
            tl.store(hs + (cb + i_t) * K * V + p_kv, b_h, mask=m_kv)
        b_hd = b_h.to(DT)
        if HAS_U:
            b_u = tl.load(u + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_v = tl.load(v + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_oq = tl.load(oq + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_p = tl.load(p + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        if HAS_U:
            b_rc = (tl.dot(b_u, b_hd, input_precision=PREC) - b_p) * _step(c, row, o_v, m_tv, m_t, V, C_ROW)
        else:
            b_rc = -b_p * _step(c, row, o_v, m_tv, m_t, V, C_ROW)
        b_rcd = b_rc.to(DT)
        b_g, b_gl, b_gam, b_dec = _decays(a, row, m_t, o_i, BT, HAS_G)
        b_a = (tl.dot(b_oq, tl.trans(b_v), input_precision=PREC) * b_gam).to(DT)
        b_o = tl.dot(b_oq, b_hd, input_precision=PREC)
        if HAS_G or HAS_L:
            b_w, b_wl, b_lam = _start_weights(lam, row, m_t, b_g, b_gl, b_gam, b_dec, HAS_G, HAS_L)
            b_o = b_o * b_w[:, None]
        b_o -= tl.dot(b_a, b_rcd, input_precision=PREC)
        tl.store(o + row[:, None] * V + o_v[None, :], b_o.to(DT), mask=m_tv)
        b_vbar = (b_v.to(tl.float32) * b_dec[:, None]).to(DT)
        if HAS_G or HAS_L:
            b_h *= b_wl
        b_h -= tl.dot(tl.trans(b_vbar), b_rcd, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_bh.to(tl.int64) * K * V + p_kv, b_h, mask=m_kv)


@tune([triton.Config({"BV": bv}, num_warps=w, num_stages=s)
       for bv, w, s in ((32, 4, 2), (64, 4, 2), (32, 2, 2))],
      key=["H", "K", "V", "BT", "HAS_G", "HAS_L", "HAS_U", "C_ROW", "HAS_DHT", "STORE_DH0"])
@triton.jit(do_not_specialize=["T", "NT"])
def minibatch_bwd_state_kernel(u, v, c, oq, a, lam, do, dht, dhs, dh0, cu, co,
                               T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                               HAS_G: tl.constexpr, HAS_L: tl.constexpr, HAS_U: tl.constexpr,
                               C_ROW: tl.constexpr, HAS_DHT: tl.constexpr,
                               STORE_DH0: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Reverse over chunks: the gradient dH1 at each chunk's end (kept in ``dhs``), then the one at
    its start, dH0 = wl dH1 + (w OQ)^T dO + U^T (c . dRc) with dRc = -(OQ V^T . Gam)^T dO - Vbar dH1
    (no forward state is read: the chunk's map from H0 is affine with a state-free linear part)."""
    DT = do.dtype.element_ty
    i_bh, i_h, o_k, m_k, o_v, m_v, m_kv, p_kv, b_dh, bos, T, n_t, cb = state_scan(
        dht, cu, co, T, NT, H, K, V, BT, BK, BV, HAS_DHT, VARLEN)
    for j in range(n_t):
        i_t = n_t - 1 - j
        o_i, m_t, row = seq_rows(bos, i_h, i_t, T, H, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        tl.store(dhs + (cb + i_t) * K * V + p_kv, b_dh, mask=m_kv)
        if HAS_U:
            b_u = tl.load(u + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_v = tl.load(v + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_oq = tl.load(oq + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_g, b_gl, b_gam, b_dec = _decays(a, row, m_t, o_i, BT, HAS_G)
        b_a = (tl.dot(b_oq, tl.trans(b_v), input_precision=PREC) * b_gam).to(DT)
        b_vbar = (b_v.to(tl.float32) * b_dec[:, None]).to(DT)
        b_drc = -tl.dot(tl.trans(b_a), b_do, input_precision=PREC) - tl.dot(b_vbar, b_dh.to(DT), input_precision=PREC)
        b_dr = (b_drc * _step(c, row, o_v, m_tv, m_t, V, C_ROW)).to(DT)
        if HAS_G or HAS_L:
            b_w, b_wl, b_lam = _start_weights(lam, row, m_t, b_g, b_gl, b_gam, b_dec, HAS_G, HAS_L)
            b_dh *= b_wl
            b_oq = (b_oq.to(tl.float32) * b_w[:, None]).to(DT)
        if HAS_U:
            b_dh += tl.dot(tl.trans(b_oq), b_do, input_precision=PREC) \
                + tl.dot(tl.trans(b_u), b_dr, input_precision=PREC)
        else:
            # no prediction: the chunk's residuals do not read H0
            b_dh += tl.dot(tl.trans(b_oq), b_do, input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_bh.to(tl.int64) * K * V + p_kv, b_dh, mask=m_kv)


@tune([triton.Config({}, num_warps=w) for w in (4, 8)],
      key=["H", "K", "V", "BT", "HAS_G", "HAS_L", "HAS_U", "C_ROW"], prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def minibatch_bwd_grad_kernel(u, v, p, c, oq, a, lam, hs, dhs, do, du, dv, dp, dc, doq, da, dlam, cu, ci,
                              T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                              BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              HAS_G: tl.constexpr, HAS_L: tl.constexpr, HAS_U: tl.constexpr,
                              C_ROW: tl.constexpr, PREC: tl.constexpr,
                              VARLEN: tl.constexpr):
    """Parallel over chunks (whole key and value blocks): every input's gradient from the chunk's
    start state H0 (``hs``) and the gradient at its end dH1 (``dhs``); the decays' through the start
    weights w (and g).
    VARLEN: the chunk is one of a packed row's (``rows.seq_chunk``); T is its sequence's length."""
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, T, i_t, cb = seq_chunk(cu, ci, tl.program_id(0), i_b, i_h, T, NT, H, VARLEN)
    DT = do.dtype.element_ty
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(0, 0, K, V, BK, BV)
    o_i, m_t, row = seq_rows(bos, i_h, i_t, T, H, BT)
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    base = (cb + i_t) * K * V
    b_h0 = tl.load(hs + base + p_kv, mask=m_kv, other=0.)
    b_dh1 = tl.load(dhs + base + p_kv, mask=m_kv, other=0.)
    b_h0d = b_h0.to(DT)
    if HAS_U:
        b_u = tl.load(u + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
    b_v = tl.load(v + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
    b_oq = tl.load(oq + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
    b_p = tl.load(p + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
    b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
    b_c = _step(c, row, o_v, m_tv, m_t, V, C_ROW)
    if HAS_U:
        b_r = tl.dot(b_u, b_h0d, input_precision=PREC) - b_p
    else:
        b_r = -b_p
    b_rc = b_r * b_c
    b_g, b_gl, b_gam, b_dec = _decays(a, row, m_t, o_i, BT, HAS_G)
    b_araw = tl.dot(b_oq, tl.trans(b_v), input_precision=PREC)
    b_a = b_araw * b_gam
    b_vbar = b_v.to(tl.float32) * b_dec[:, None]
    # dRc = -A^T dO - Vbar dH1; R's and c's gradients, P's and U's
    b_drc = -tl.dot(tl.trans(b_a.to(DT)), b_do, input_precision=PREC) \
        - tl.dot(b_vbar.to(DT), b_dh1.to(DT), input_precision=PREC)
    b_dr = b_drc * b_c
    if C_ROW:
        tl.store(dc + row[:, None] * V + o_v[None, :], (b_r * b_drc).to(dc.dtype.element_ty), mask=m_tv)
    else:
        tl.store(dc + row, tl.sum(b_r * b_drc, axis=1).to(dc.dtype.element_ty), mask=m_t)
    tl.store(dp + row[:, None] * V + o_v[None, :], (-b_dr).to(dp.dtype.element_ty), mask=m_tv)
    if HAS_U:
        b_du = tl.dot(b_dr.to(DT), tl.trans(b_h0d), input_precision=PREC)
        tl.store(du + row[:, None] * K + o_k[None, :], b_du.to(du.dtype.element_ty), mask=m_tk)
    # O = w (OQ H0) - A Rc:  OQ's gradient, and A's (to OQ and V)
    b_dof = b_do.to(tl.float32)
    if HAS_G or HAS_L:
        b_w, b_wl, b_lam = _start_weights(lam, row, m_t, b_g, b_gl, b_gam, b_dec, HAS_G, HAS_L)
        b_dof = b_dof * b_w[:, None]
    b_doq = tl.dot(b_dof.to(DT), tl.trans(b_h0d), input_precision=PREC)
    b_da = -tl.dot(b_do, tl.trans(b_rc.to(DT)), input_precision=PREC)       # [BT, BT]
    b_daraw = (b_da * b_gam).to(DT)
    b_doq += tl.dot(b_daraw, b_v, input_precision=PREC)
    b_dv = tl.dot(tl.trans(b_daraw), b_oq, input_precision=PREC)
    # H1 = e^{gl} H0 - Vbar^T Rc:  Vbar's gradient
    b_dvbar = -tl.dot(b_rc.to(DT), tl.trans(b_dh1.to(DT)), input_precision=PREC)   # [BT, BK]
    b_dv += b_dvbar * b_dec[:, None]
    tl.store(doq + row[:, None] * K + o_k[None, :], b_doq.to(doq.dtype.element_ty), mask=m_tk)
    tl.store(dv + row[:, None] * K + o_k[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tk)
    if HAS_G or HAS_L:
        # the start weights w_t (of H0 in the readout) and wl = w_last (in H1 = wl H0 - ...)
        last = tl.minimum(T, i_t * BT + BT) - 1 - i_t * BT
        b_oh = tl.dot(b_oq, b_h0d, input_precision=PREC)
        b_dw = tl.sum(b_oh * b_do.to(tl.float32), axis=1)
        b_dw += tl.where(o_i == last, tl.sum(tl.sum(b_h0 * b_dh1, axis=1), axis=0), 0.)
        b_dw = tl.where(m_t, b_dw, 0.)
        # w_t = e^{g_t} - sum_{s<=t} Gam[t, s] lam_s: lam_s's gradient is -(Gam^T dw)_s
        b_gdw = tl.sum(b_gam * b_dw[:, None], axis=0)
    if HAS_L:
        tl.store(dlam + row, (-b_gdw).to(dlam.dtype.element_ty), mask=m_t)
    if HAS_G:
        # through w (dw_t/dg_t = w_t, dw_t/dg_s = Gam[t, s] lam_s), Gam (g_t - g_s) and Vbar (gl - g_s)
        b_dgam = b_da * b_a
        b_wv = tl.sum(b_dvbar * b_vbar, axis=1)
        b_dg = b_dw * b_w + b_lam * b_gdw + tl.sum(b_dgam, axis=1) - tl.sum(b_dgam, axis=0) - b_wv
        b_dg = tl.where(m_t, b_dg + tl.where(o_i == last, tl.sum(b_wv, axis=0), 0.), 0.)
        # g_t = sum_{r<=t} log a_r: d log a_r = sum_{t>=r} dg_t, then d a = d log a / a; or, with a decay
        # under e^LOG_EXACT_DA in the chunk, d a term by term: Gam's pairs (A's dA A_raw and w's
        # -dw_t lam_s), w's e^{g_t} (dw) and Vbar's e^{gl - g_s} (dVbar . v), each without a_r
        b_dla = tl.sum(b_dg, axis=0) - tl.cumsum(b_dg, axis=0) + b_dg
        b_at = tl.load(a + row, mask=m_t, other=1.).to(tl.float32)
        b_la = log_decay(b_at)
        if tl.min(b_la, axis=0) < LOG_EXACT_DA:
            b_gp = b_g - b_la
            E = decay_before(b_g, b_gp, o_i, o_i)
            Fg = decay_after(b_g, b_g, o_i[:, None] >= o_i[None, :], o_i[:, None] == o_i[None, :])
            b_dae = pair_decay_grad(b_da * b_araw - b_dw[:, None] * b_lam[None, :], b_dw, Fg, E, b_gp, PREC)
            b_dae += tl.exp(b_gl - b_g) * tl.sum(E * tl.sum(b_dvbar * b_v.to(tl.float32), axis=1)[:, None], axis=0)
        else:
            b_dae = b_dla / b_at
        tl.store(da + row, b_dae.to(da.dtype.element_ty), mask=m_t)
