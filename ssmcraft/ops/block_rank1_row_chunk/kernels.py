"""Triton kernels of the chunked block rank-1 family (``chunk.py`` has the algebra).

One program per (batch * head, block of R state rows), sequential over chunks of C tokens, both state
tiles ``X_a^T [BK, R]`` (FLA's ``[K, V]`` layout) in registers; the backward's gradients either inside
that walk or, after a walk of the state adjoints alone, with one program per chunk. The per-head chunk weights
(``G, Hm [C, C]``, ``g, h, E [2, C]``, ``F [4]``: ``weights.py``, formed by the last two kernels of this file) come
in one set per (batch * head, chunk); the chunk kernels never see the transition itself, so any per-head
2 x 2 transition, extrapolation, write and read weights run on the same code. Tiles and helpers are the
chunked per-row rank-1 family's (``ssmcraft.ops.rank1_row_chunk.kernels``: row and key tiles, the
chunk's masks, the C-step substitution on ``[C, R]`` tiles); products are ``tl.dot`` in fp32 operands
(``PREC``). Padded tokens read as 0 (keys, row coefficients, weights), so a chunk cut by the sequence's
end contributes nothing.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.tiles import state_block, state_or_zero
from ssmcraft.ops.rank1_row.bwd import put
from ssmcraft.ops.rank1_row_chunk.kernels import chunk_masks, key_tile, program, row_tile, solve, store_rows


@triton.jit
def chunk_weights(Gw, Hw, gw, hw, Ew, Fw, wb, o_c, C: tl.constexpr):
    """The chunk's per-head weights at chunk slot ``wb`` (int64): G, Hm [C, C]; g0, g1, h0, h1, E0, E1 [C];
    F00, F01, F10, F11 (scalars)."""
    p_cc = wb * C * C + o_c[:, None] * C + o_c[None, :]
    p_2c = wb * 2 * C + o_c
    return (tl.load(Gw + p_cc), tl.load(Hw + p_cc), tl.load(gw + p_2c), tl.load(gw + p_2c + C), tl.load(hw + p_2c),
            tl.load(hw + p_2c + C), tl.load(Ew + p_2c), tl.load(Ew + p_2c + C), tl.load(Fw + wb * 4),
            tl.load(Fw + wb * 4 + 1), tl.load(Fw + wb * 4 + 2), tl.load(Fw + wb * 4 + 3))


@triton.jit
def _walk_start(ptr, HAS: tl.constexpr, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                R: tl.constexpr, BK: tl.constexpr):
    """A walk's program (batch * head, row block): ``program``'s indices, ``state_block``'s offsets and
    masks, ``chunk_masks``' and the pair of state tiles it starts from (``ptr [B*H*2, K, V]``, zeros without
    ``HAS``)."""
    i_bh, i_r, i_h, bos, T_s = program(None, T, H, False)
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(0, i_r, K, V, BK, R)
    o_c, strict, incl = chunk_masks(C)
    b_0 = state_or_zero(ptr, i_bh * 2, p_kv, m_kv, K, V, HAS, BK, R)
    b_1 = state_or_zero(ptr, i_bh * 2 + 1, p_kv, m_kv, K, V, HAS, BK, R)
    return i_bh, i_r, i_h, bos, T_s, o_k, m_k, o_v, m_v, m_kv, p_kv, o_c, strict, incl, b_0, b_1


@triton.jit
def block_chunk_fwd_kernel(u, v, q, oq, c, p, Gw, Hw, gw, hw, Ew, Fw, h0, y, ht, d, hs, T, NC,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                           BK: tl.constexpr, MODES: tl.constexpr, CONSTS: tl.constexpr, HAS_H0: tl.constexpr,
                           STORE_HT: tl.constexpr, TRAINING: tl.constexpr, PREC: tl.constexpr,
                           ONE_KEY: tl.constexpr):
    """y [B, T, H, V] = (sum_a r_a X_a,t) oq_t (the readout's weights folded in h, Hm); the final states
    ht [B*H*2, K, V] fp32 (``STORE_HT``) from h0 (same layout, ``HAS_H0``). ``TRAINING``: also d = c o z
    [B, T, H, V] fp32 and each chunk's start states hs [B*H*NC*2, K, V] (fp32, or bf16: ``chunk.STATES_BF16``)
    for the backward.
    MODES/CONSTS: of (c, p) (``slots.row_mode``). ``ONE_KEY``: u, v and q are one tensor (Longhorn's k; v
    and q unread): M = Mq, Lv = Lq, and D enters only through P - D."""
    (i_bh, i_r, i_h, bos, T_s, o_k, m_k, o_v, m_v, m_kv, p_kv, o_c, strict, incl, b_x0,
     b_x1) = _walk_start(h0, HAS_H0, T, H, K, V, C, R, BK)
    for i_c in range(0, NC):
        t0 = i_c * C
        m_t = t0 + o_c < T_s
        rows = (bos + t0 + o_c) * H + i_h
        wb = i_bh.to(tl.int64) * NC + i_c
        if TRAINING:
            tl.store(hs + wb * 2 * K * V + p_kv, b_x0.to(hs.dtype.element_ty), mask=m_kv)
            tl.store(hs + (wb * 2 + 1) * K * V + p_kv, b_x1.to(hs.dtype.element_ty), mask=m_kv)
        b_u = key_tile(u, rows, o_k, m_t, m_k, K)
        b_oq = key_tile(oq, rows, o_k, m_t, m_k, K)
        b_c = row_tile(c, CONSTS[0], MODES[0], rows, o_v, m_t, m_v, V, C, R)
        b_p = row_tile(p, CONSTS[1], MODES[1], rows, o_v, m_t, m_v, V, C, R)
        b_G, b_Hm, b_g0, b_g1, b_h0, b_h1, b_E0, b_E1, f00, f01, f10, f11 = chunk_weights(Gw, Hw, gw, hw, Ew, Fw,
                                                                                           wb, o_c, C)
        b_ux = (b_g0[:, None] * tl.dot(b_u, b_x0, input_precision=PREC)
                + b_g1[:, None] * tl.dot(b_u, b_x1, input_precision=PREC))
        b_ox = (b_h0[:, None] * tl.dot(b_oq, b_x0, input_precision=PREC)
                + b_h1[:, None] * tl.dot(b_oq, b_x1, input_precision=PREC))
        # z + M D = g0 o U X0 + g1 o U X1 + Mq P, D = c o z: M = (U V^T) o G, Mq = (U Q^T) o G (tau < t);
        # O = h0 o OQ X0 + h1 o OQ X1 + Lq P - Lv D: Lv = (OQ V^T) o Hm, Lq = (OQ Q^T) o Hm (tau <= t);
        # X_a,C = F_a0 X0 + F_a1 X1 + (Q o E_a)^T P - (V o E_a)^T D
        if ONE_KEY:
            b_M = tl.where(strict, tl.dot(b_u, tl.trans(b_u), input_precision=PREC), 0.) * b_G
            b_d = solve(b_c * (b_ux + tl.dot(b_M, b_p, input_precision=PREC)), b_c, b_M, o_c, C, R, False)
            b_e = b_p - b_d
            b_L = tl.where(incl, tl.dot(b_oq, tl.trans(b_u), input_precision=PREC), 0.) * b_Hm
            b_o = b_ox + tl.dot(b_L, b_e, input_precision=PREC)
            b_n0 = f00 * b_x0 + f01 * b_x1 + tl.dot(tl.trans(b_u * b_E0[:, None]), b_e, input_precision=PREC)
            b_x1 = f10 * b_x0 + f11 * b_x1 + tl.dot(tl.trans(b_u * b_E1[:, None]), b_e, input_precision=PREC)
        else:
            b_v = key_tile(v, rows, o_k, m_t, m_k, K)
            b_q = key_tile(q, rows, o_k, m_t, m_k, K)
            b_M = tl.where(strict, tl.dot(b_u, tl.trans(b_v), input_precision=PREC), 0.) * b_G
            b_Mq = tl.where(strict, tl.dot(b_u, tl.trans(b_q), input_precision=PREC), 0.) * b_G
            b_d = solve(b_c * (b_ux + tl.dot(b_Mq, b_p, input_precision=PREC)), b_c, b_M, o_c, C, R, False)
            b_Lv = tl.where(incl, tl.dot(b_oq, tl.trans(b_v), input_precision=PREC), 0.) * b_Hm
            b_Lq = tl.where(incl, tl.dot(b_oq, tl.trans(b_q), input_precision=PREC), 0.) * b_Hm
            b_o = b_ox + tl.dot(b_Lq, b_p, input_precision=PREC) - tl.dot(b_Lv, b_d, input_precision=PREC)
            b_n0 = (f00 * b_x0 + f01 * b_x1 + tl.dot(tl.trans(b_q * b_E0[:, None]), b_p, input_precision=PREC)
                    - tl.dot(tl.trans(b_v * b_E0[:, None]), b_d, input_precision=PREC))
            b_x1 = (f10 * b_x0 + f11 * b_x1 + tl.dot(tl.trans(b_q * b_E1[:, None]), b_p, input_precision=PREC)
                    - tl.dot(tl.trans(b_v * b_E1[:, None]), b_d, input_precision=PREC))
        b_x0 = b_n0
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = rows[:, None] * V + o_v[None, :]
        tl.store(y + p_tv, b_o.to(y.dtype.element_ty), mask=m_tv)
        if TRAINING:
            tl.store(d + p_tv, b_d, mask=m_tv)
    if STORE_HT:
        tl.store(ht + (i_bh.to(tl.int64) * 2) * K * V + p_kv, b_x0, mask=m_kv)
        tl.store(ht + (i_bh.to(tl.int64) * 2 + 1) * K * V + p_kv, b_x1, mask=m_kv)


@triton.jit
def _adjoint(b_u, b_kv, b_oq, b_c, b_do, b_dx0, b_dx1, b_G, b_Hm, b_E0, b_E1, o_c, strict, incl,
             C: tl.constexpr, R: tl.constexpr, PREC: tl.constexpr):
    """The adjoint of D through the outputs and the end states, ``gD = -Lv^T dO - sum_a E_a o (V dX_a)``,
    and W solving ``(I + c o M^T) W = c o gD`` (``b_kv``: V, the tile of u where ``ONE_KEY``). Returns
    (W, gD, strict(U V^T), incl(OQ V^T), V dX0, V dX1)."""
    b_uv = tl.where(strict, tl.dot(b_u, tl.trans(b_kv), input_precision=PREC), 0.)
    b_ov = tl.where(incl, tl.dot(b_oq, tl.trans(b_kv), input_precision=PREC), 0.)
    b_vd0 = tl.dot(b_kv, b_dx0, input_precision=PREC)
    b_vd1 = tl.dot(b_kv, b_dx1, input_precision=PREC)
    b_gd = (-tl.dot(tl.trans(b_ov * b_Hm), b_do, input_precision=PREC) - b_E0[:, None] * b_vd0
            - b_E1[:, None] * b_vd1)
    b_w = solve(b_c * b_gd, b_c, tl.trans(b_uv * b_G), o_c, C, R, True)
    return b_w, b_gd, b_uv, b_ov, b_vd0, b_vd1


@triton.jit
def _start_adjoints(b_dx0, b_dx1, b_w, b_do, b_u, b_oq, b_g0, b_g1, b_h0, b_h1, f00, f01, f10, f11,
                    PREC: tl.constexpr):
    """The adjoints of the chunk's start states from its end states' and W, dO:
    ``dX0_b = sum_a F_ab dX_a + U^T (g_b o W) + OQ^T (h_b o dO)``."""
    b_n0 = (f00 * b_dx0 + f10 * b_dx1 + tl.dot(tl.trans(b_u), b_g0[:, None] * b_w, input_precision=PREC)
            + tl.dot(tl.trans(b_oq), b_h0[:, None] * b_do, input_precision=PREC))
    b_n1 = (f01 * b_dx0 + f11 * b_dx1 + tl.dot(tl.trans(b_u), b_g1[:, None] * b_w, input_precision=PREC)
            + tl.dot(tl.trans(b_oq), b_h1[:, None] * b_do, input_precision=PREC))
    return b_n0, b_n1


@triton.jit
def block_chunk_bwd_state_kernel(u, v, oq, c, Gw, Hw, gw, hw, Ew, Fw, dy, dht, dxs, dh0, T, NC,
                                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                                 R: tl.constexpr, BK: tl.constexpr, MODES: tl.constexpr, CONSTS: tl.constexpr,
                                 HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
                                 ONE_KEY: tl.constexpr):
    """The backward's sequential part alone: reverse over chunks from the final states' adjoints dht
    (``HAS_DHT``), storing each chunk's end-state adjoints in dxs [B*H*NC*2, K, V] fp32 (the layout of the
    forward's hs, its dtype) and the initial states' in dh0 (``STORE_DH0``); per chunk only W's substitution and
    the state adjoints' products. ``block_chunk_bwd_kernel`` with ``PER_CHUNK`` then forms every gradient,
    one program per chunk."""
    (i_bh, i_r, i_h, bos, T_s, o_k, m_k, o_v, m_v, m_kv, p_kv, o_c, strict, incl, b_dx0,
     b_dx1) = _walk_start(dht, HAS_DHT, T, H, K, V, C, R, BK)
    for j_c in range(0, NC):
        i_c = NC - 1 - j_c
        m_t = i_c * C + o_c < T_s
        rows = (bos + i_c * C + o_c) * H + i_h
        wb = i_bh.to(tl.int64) * NC + i_c
        tl.store(dxs + wb * 2 * K * V + p_kv, b_dx0.to(dxs.dtype.element_ty), mask=m_kv)
        tl.store(dxs + (wb * 2 + 1) * K * V + p_kv, b_dx1.to(dxs.dtype.element_ty), mask=m_kv)
        b_u = key_tile(u, rows, o_k, m_t, m_k, K)
        if ONE_KEY:
            b_kv = b_u
        else:
            b_kv = key_tile(v, rows, o_k, m_t, m_k, K)
        b_oq = key_tile(oq, rows, o_k, m_t, m_k, K)
        b_c = row_tile(c, CONSTS[0], MODES[0], rows, o_v, m_t, m_v, V, C, R)
        b_do = tl.load(dy + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)
        b_do = b_do.to(tl.float32)
        b_G, b_Hm, b_g0, b_g1, b_h0, b_h1, b_E0, b_E1, f00, f01, f10, f11 = chunk_weights(Gw, Hw, gw, hw, Ew, Fw,
                                                                                           wb, o_c, C)
        b_w = _adjoint(b_u, b_kv, b_oq, b_c, b_do, b_dx0, b_dx1, b_G, b_Hm, b_E0, b_E1, o_c, strict, incl, C, R,
                       PREC)[0]
        b_dx0, b_dx1 = _start_adjoints(b_dx0, b_dx1, b_w, b_do, b_u, b_oq, b_g0, b_g1, b_h0, b_h1, f00, f01, f10,
                                       f11, PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_bh.to(tl.int64) * 2) * K * V + p_kv, b_dx0, mask=m_kv)
        tl.store(dh0 + (i_bh.to(tl.int64) * 2 + 1) * K * V + p_kv, b_dx1, mask=m_kv)


@triton.jit
def block_chunk_bwd_kernel(u, v, q, oq, c, p, Gw, Hw, gw, hw, Ew, Fw, d, hs, dy, dht, dxs,
                           du, dv, dq, doq, dc, dp, dGw, dHw, dgw, dhw, dEw, dFw, dh0, T, NC, NTOK, NW,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                           BK: tl.constexpr, MODES: tl.constexpr, CONSTS: tl.constexpr, HAS_DHT: tl.constexpr,
                           STORE_DH0: tl.constexpr, PREC: tl.constexpr, ONE_KEY: tl.constexpr,
                           ATOMIC: tl.constexpr, PER_CHUNK: tl.constexpr):
    """Reverse over chunks from the final states' adjoints dht (``HAS_DHT``), each chunk's start states
    read from the forward's hs (exact), D from its d. Writes this row block's slice ``i_r`` of the key
    gradients du, dv, dq, doq [NR, B, T, H, K] (sums over its rows), of the weights' gradients dGw, dHw
    [NR, NW, C, C], dgw, dhw, dEw [NR, NW, 2, C], dFw [NR, NW, 4] (NW = B*H*NC), the row coefficients'
    gradients (``store_rows``: per row, or this block's slice of [NR, B*T*H]) and dh0 [B*H*2, K, V].
    ``ONE_KEY``: du holds the three key slots' sum, dv and dq are unwritten. ``ATOMIC``: the key and weight
    gradients have no row-block axis (``[B, T, H, K]``, ``[NW, ...]``, zeroed): every row block adds into them.
    ``PER_CHUNK``: one program per (batch * head * chunk, row block), the chunk's end-state adjoints read
    from dxs (``block_chunk_bwd_state_kernel``'s), no state adjoints carried or stored: the gradients'
    products run in parallel over the chunks instead of inside the sequential walk."""
    if PER_CHUNK:
        i_bh = tl.program_id(0) // NC
        j_lo = NC - 1 - tl.program_id(0) % NC
        j_hi = j_lo + 1
    else:
        i_bh = tl.program_id(0)
        j_lo = 0
        j_hi = NC
    i_r, i_h, bos, T_s = tl.program_id(1), i_bh % H, (i_bh // H).to(tl.int64) * T, T
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(0, i_r, K, V, BK, R)
    o_c, strict, incl = chunk_masks(C)
    b_dx0 = state_or_zero(dht, i_bh * 2, p_kv, m_kv, K, V, HAS_DHT and not PER_CHUNK, BK, R)
    b_dx1 = state_or_zero(dht, i_bh * 2 + 1, p_kv, m_kv, K, V, HAS_DHT and not PER_CHUNK, BK, R)
    key_base = 0 if ATOMIC else i_r.to(tl.int64) * NTOK * K
    wbase = 0 if ATOMIC else i_r.to(tl.int64) * NW
    for j_c in range(j_lo, j_hi):
        i_c = NC - 1 - j_c
        t0 = i_c * C
        m_t = t0 + o_c < T_s
        rows = (bos + t0 + o_c) * H + i_h
        wb = i_bh.to(tl.int64) * NC + i_c
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = rows[:, None] * V + o_v[None, :]
        if PER_CHUNK:
            b_dx0 = tl.load(dxs + wb * 2 * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
            b_dx1 = tl.load(dxs + (wb * 2 + 1) * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
        b_x0 = tl.load(hs + wb * 2 * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
        b_x1 = tl.load(hs + (wb * 2 + 1) * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
        b_u = key_tile(u, rows, o_k, m_t, m_k, K)
        b_oq = key_tile(oq, rows, o_k, m_t, m_k, K)
        b_c = row_tile(c, CONSTS[0], MODES[0], rows, o_v, m_t, m_v, V, C, R)
        b_p = row_tile(p, CONSTS[1], MODES[1], rows, o_v, m_t, m_v, V, C, R)
        b_d = tl.load(d + p_tv, mask=m_tv, other=0.)
        b_do = tl.load(dy + p_tv, mask=m_tv, other=0.).to(tl.float32)
        b_G, b_Hm, b_g0, b_g1, b_h0, b_h1, b_E0, b_E1, f00, f01, f10, f11 = chunk_weights(Gw, Hw, gw, hw, Ew, Fw,
                                                                                           wb, o_c, C)
        b_uh0 = tl.dot(b_u, b_x0, input_precision=PREC)
        b_uh1 = tl.dot(b_u, b_x1, input_precision=PREC)
        # the weights' gradients that need no key products: g, h and F (sums over this block's rows)
        p_cc = (wbase + wb) * C * C + o_c[:, None] * C + o_c[None, :]
        p_2c = (wbase + wb) * 2 * C + o_c
        put(dhw + p_2c, tl.sum(b_do * tl.dot(b_oq, b_x0, input_precision=PREC), 1), None, ATOMIC)
        put(dhw + p_2c + C, tl.sum(b_do * tl.dot(b_oq, b_x1, input_precision=PREC), 1), None, ATOMIC)
        p_f = (wbase + wb) * 4
        put(dFw + p_f, tl.sum(tl.sum(b_dx0 * b_x0, 1), 0), None, ATOMIC)
        put(dFw + p_f + 1, tl.sum(tl.sum(b_dx0 * b_x1, 1), 0), None, ATOMIC)
        put(dFw + p_f + 2, tl.sum(tl.sum(b_dx1 * b_x0, 1), 0), None, ATOMIC)
        put(dFw + p_f + 3, tl.sum(tl.sum(b_dx1 * b_x1, 1), 0), None, ATOMIC)
        b_o0 = b_h0[:, None] * b_do
        b_o1 = b_h1[:, None] * b_do
        b_dx0t = tl.trans(b_dx0)
        b_dx1t = tl.trans(b_dx1)
        p_tk = key_base + rows[:, None] * K + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        if ONE_KEY:
            # M = Mq, Lv = Lq: D and P enter through E' = P - D; dp = M^T W - gD and dc = -z o dp
            b_w, b_gd, b_uu, b_ou, b_ud0, b_ud1 = _adjoint(b_u, b_u, b_oq, b_c, b_do, b_dx0, b_dx1, b_G, b_Hm, b_E0,
                                                           b_E1, o_c, strict, incl, C, R, PREC)
            b_M = b_uu * b_G
            b_e = b_p - b_d
            b_dp = tl.dot(tl.trans(b_M), b_w, input_precision=PREC) - b_gd
            if MODES[0] != 0:
                b_z = b_g0[:, None] * b_uh0 + b_g1[:, None] * b_uh1 + tl.dot(b_M, b_e, input_precision=PREC)
                store_rows(dc, -b_z * b_dp, MODES[0], rows, o_v, m_t, m_v, V, i_r, NTOK)
            if MODES[1] != 0:
                store_rows(dp, b_dp, MODES[1], rows, o_v, m_t, m_v, V, i_r, NTOK)
            b_dA = tl.where(strict, tl.dot(b_w, tl.trans(b_e), input_precision=PREC), 0.)
            b_dL = tl.where(incl, tl.dot(b_do, tl.trans(b_e), input_precision=PREC), 0.)
            put(dGw + p_cc, b_dA * b_uu, None, ATOMIC)
            put(dHw + p_cc, b_dL * b_ou, None, ATOMIC)
            put(dEw + p_2c, tl.sum(b_e * b_ud0, 1), None, ATOMIC)
            put(dEw + p_2c + C, tl.sum(b_e * b_ud1, 1), None, ATOMIC)
            b_dA = b_dA * b_G
            b_dL = b_dL * b_Hm
            b_du = (tl.dot(tl.trans(b_dA), b_u, input_precision=PREC)
                    + tl.dot(tl.trans(b_dL), b_oq, input_precision=PREC)
                    + tl.dot(b_e * b_E0[:, None], b_dx0t, input_precision=PREC)
                    + tl.dot(b_e * b_E1[:, None], b_dx1t, input_precision=PREC))
            b_doq = tl.dot(b_dL, b_u, input_precision=PREC)
            b_dM = b_dA
        else:
            b_v = key_tile(v, rows, o_k, m_t, m_k, K)
            b_q = key_tile(q, rows, o_k, m_t, m_k, K)
            b_w, b_gd, b_uv, b_ov, b_vd0, b_vd1 = _adjoint(b_u, b_v, b_oq, b_c, b_do, b_dx0, b_dx1, b_G, b_Hm, b_E0,
                                                           b_E1, o_c, strict, incl, C, R, PREC)
            b_uq = tl.where(strict, tl.dot(b_u, tl.trans(b_q), input_precision=PREC), 0.)
            b_oqq = tl.where(incl, tl.dot(b_oq, tl.trans(b_q), input_precision=PREC), 0.)
            b_M = b_uv * b_G
            b_MT = tl.trans(b_M)
            b_Mq = b_uq * b_G
            b_Lq = b_oqq * b_Hm
            b_qd0 = tl.dot(b_q, b_dx0, input_precision=PREC)
            b_qd1 = tl.dot(b_q, b_dx1, input_precision=PREC)
            if MODES[0] != 0:
                b_z = (b_g0[:, None] * b_uh0 + b_g1[:, None] * b_uh1 + tl.dot(b_Mq, b_p, input_precision=PREC)
                       - tl.dot(b_M, b_d, input_precision=PREC))
                store_rows(dc, b_z * (b_gd - tl.dot(b_MT, b_w, input_precision=PREC)), MODES[0], rows, o_v, m_t,
                           m_v, V, i_r, NTOK)
            if MODES[1] != 0:
                b_dp = (tl.dot(tl.trans(b_Mq), b_w, input_precision=PREC)
                        + tl.dot(tl.trans(b_Lq), b_do, input_precision=PREC)
                        + b_E0[:, None] * b_qd0 + b_E1[:, None] * b_qd1)
                store_rows(dp, b_dp, MODES[1], rows, o_v, m_t, m_v, V, i_r, NTOK)
            b_dM = tl.where(strict, -tl.dot(b_w, tl.trans(b_d), input_precision=PREC), 0.)
            b_dMq = tl.where(strict, tl.dot(b_w, tl.trans(b_p), input_precision=PREC), 0.)
            b_dLv = tl.where(incl, -tl.dot(b_do, tl.trans(b_d), input_precision=PREC), 0.)
            b_dLq = tl.where(incl, tl.dot(b_do, tl.trans(b_p), input_precision=PREC), 0.)
            put(dGw + p_cc, b_dM * b_uv + b_dMq * b_uq, None, ATOMIC)
            put(dHw + p_cc, b_dLv * b_ov + b_dLq * b_oqq, None, ATOMIC)
            put(dEw + p_2c, tl.sum(b_p * b_qd0 - b_d * b_vd0, 1), None, ATOMIC)
            put(dEw + p_2c + C, tl.sum(b_p * b_qd1 - b_d * b_vd1, 1), None, ATOMIC)
            b_dM = b_dM * b_G
            b_dMq = b_dMq * b_G
            b_dLv = b_dLv * b_Hm
            b_dLq = b_dLq * b_Hm
            b_du = tl.dot(b_dMq, b_q, input_precision=PREC)
            b_dv = (tl.dot(tl.trans(b_dM), b_u, input_precision=PREC)
                    + tl.dot(tl.trans(b_dLv), b_oq, input_precision=PREC)
                    - tl.dot(b_d * b_E0[:, None], b_dx0t, input_precision=PREC)
                    - tl.dot(b_d * b_E1[:, None], b_dx1t, input_precision=PREC))
            b_dq = (tl.dot(tl.trans(b_dMq), b_u, input_precision=PREC)
                    + tl.dot(tl.trans(b_dLq), b_oq, input_precision=PREC)
                    + tl.dot(b_p * b_E0[:, None], b_dx0t, input_precision=PREC)
                    + tl.dot(b_p * b_E1[:, None], b_dx1t, input_precision=PREC))
            b_doq = tl.dot(b_dLv, b_v, input_precision=PREC) + tl.dot(b_dLq, b_q, input_precision=PREC)
            put(dv + p_tk, b_dv, m_tk, ATOMIC)
            put(dq + p_tk, b_dq, m_tk, ATOMIC)
        # the terms of the keys' gradients both forms share: W through U X0 (g), dO through OQ X0 (h), dM's v
        b_w0 = b_g0[:, None] * b_w
        b_w1 = b_g1[:, None] * b_w
        put(dgw + p_2c, tl.sum(b_w * b_uh0, 1), None, ATOMIC)
        put(dgw + p_2c + C, tl.sum(b_w * b_uh1, 1), None, ATOMIC)
        if ONE_KEY:
            b_kv = b_u
        else:
            b_kv = b_v
        b_x0 = tl.load(hs + wb * 2 * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
        b_x1 = tl.load(hs + (wb * 2 + 1) * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
        b_du += (tl.dot(b_w0, tl.trans(b_x0), input_precision=PREC) + tl.dot(b_w1, tl.trans(b_x1), input_precision=PREC)
                 + tl.dot(b_dM, b_kv, input_precision=PREC))
        b_doq += (tl.dot(b_o0, tl.trans(b_x0), input_precision=PREC)
                  + tl.dot(b_o1, tl.trans(b_x1), input_precision=PREC))
        put(du + p_tk, b_du, m_tk, ATOMIC)
        put(doq + p_tk, b_doq, m_tk, ATOMIC)
        if not PER_CHUNK:
            # adjoints of the chunk's start states: through the end states, the right side and the outputs
            b_dx0, b_dx1 = _start_adjoints(b_dx0, b_dx1, b_w, b_do, b_u, b_oq, b_g0, b_g1, b_h0, b_h1, f00, f01,
                                           f10, f11, PREC)
    if STORE_DH0 and not PER_CHUNK:
        tl.store(dh0 + (i_bh.to(tl.int64) * 2) * K * V + p_kv, b_dx0, mask=m_kv)
        tl.store(dh0 + (i_bh.to(tl.int64) * 2 + 1) * K * V + p_kv, b_dx1, mask=m_kv)


# ----------------------------------------------------------------------------------------
# the per-head chunk weights (``weights.py``): one program per (batch * head, chunk), the columns of the
# forward substitution Y_k = A_{k-1} Y_{k-1} + rhs_k on lanes (C write columns, then the 2 start columns)
# ----------------------------------------------------------------------------------------

@triton.jit
def _pick(x, o, k):
    """``x[k]`` of a vector ``x`` over offsets ``o``."""
    return tl.sum(tl.where(o == k, x, 0.), 0)


@triton.jit
def _head_coefs(co, rows, m_t, NTOK):
    """The chunk's per-head coefficients from ``co [10, B*T*H]`` (a00 a01 a10 a11 e0 e1 w0 w1 r0 r1):
    past the sequence's end the transition is the identity and e, w, r are 0."""
    a00 = tl.load(co + rows, mask=m_t, other=1.)
    a01 = tl.load(co + NTOK + rows, mask=m_t, other=0.)
    a10 = tl.load(co + 2 * NTOK + rows, mask=m_t, other=0.)
    a11 = tl.load(co + 3 * NTOK + rows, mask=m_t, other=1.)
    e0 = tl.load(co + 4 * NTOK + rows, mask=m_t, other=0.)
    e1 = tl.load(co + 5 * NTOK + rows, mask=m_t, other=0.)
    w0 = tl.load(co + 6 * NTOK + rows, mask=m_t, other=0.)
    w1 = tl.load(co + 7 * NTOK + rows, mask=m_t, other=0.)
    r0 = tl.load(co + 8 * NTOK + rows, mask=m_t, other=0.)
    r1 = tl.load(co + 9 * NTOK + rows, mask=m_t, other=0.)
    return a00, a01, a10, a11, e0, e1, w0, w1, r0, r1


@triton.jit
def _advance(y0, y1, a00, a01, a10, a11, w0, w1, o_c, o_j, k):
    """Y_k from Y_{k-1} (k >= 1): the transition of token k-1 and its write in column k-1."""
    b00, b01, b10, b11 = _pick(a00, o_c, k - 1), _pick(a01, o_c, k - 1), _pick(a10, o_c, k - 1), _pick(a11, o_c, k - 1)
    col = o_j == k - 1
    n0 = b00 * y0 + b01 * y1 + tl.where(col, _pick(w0, o_c, k - 1), 0.)
    n1 = b10 * y0 + b11 * y1 + tl.where(col, _pick(w1, o_c, k - 1), 0.)
    return n0, n1


@triton.jit
def _weights_program(T, NC, H: tl.constexpr, C: tl.constexpr, CP: tl.constexpr):
    """A weight kernel's program (batch*head, chunk): the chunk's token lanes ``o_c`` and their mask,
    the lanes ``o_j`` (C write lanes, then the two start lanes), the tokens' rows of the per-head
    coefficients, the chunk's index into the weight buffers ``wb``, the write and start lane masks, and
    the substitution's start (the identity on the start lanes)."""
    i_bh, i_c = tl.program_id(0), tl.program_id(1)
    o_c = tl.arange(0, C)
    o_j = tl.arange(0, CP)
    m_t = i_c * C + o_c < T
    rows = ((i_bh // H).to(tl.int64) * T + i_c * C + o_c) * H + i_bh % H
    m_w, m_s = o_j < C, (o_j >= C) & (o_j < C + 2)
    return (o_c, o_j, m_t, rows, i_bh.to(tl.int64) * NC + i_c, m_w, m_s, tl.where(o_j == C, 1., 0.),
            tl.where(o_j == C + 1, 1., 0.))


@triton.jit
def block_weights_fwd_kernel(co, Gw, Hw, gw, hw, Ew, Fw, T, NC, NTOK, H: tl.constexpr, C: tl.constexpr,
                             CP: tl.constexpr):
    """G, Hm [B*H*NC, C, C], g, h, E [B*H*NC, 2, C], F [B*H*NC, 4] of ``weights.py`` from the per-head
    coefficients ``co`` [10, B*T*H]; CP >= C + 2 lanes."""
    o_c, o_j, m_t, rows, wb, m_w, m_s, y0, y1 = _weights_program(T, NC, H, C, CP)
    a00, a01, a10, a11, e0, e1, w0, w1, r0, r1 = _head_coefs(co, rows, m_t, NTOK)
    for k in range(0, C + 1):
        if k >= 1:
            y0, y1 = _advance(y0, y1, a00, a01, a10, a11, w0, w1, o_c, o_j, k)
            # Hm[k-1, s'] = r_{k-1} . Phi(k, s'+1) w_s',  h[b, k-1] = r_{k-1} . Phi(k, 0)[:, b]
            hk = _pick(r0, o_c, k - 1) * y0 + _pick(r1, o_c, k - 1) * y1
            tl.store(Hw + wb * C * C + (k - 1) * C + o_j, hk, mask=m_w)
            tl.store(hw + wb * 2 * C + (o_j - C) * C + (k - 1), hk, mask=m_s)
        if k < C:
            # G[k, s'] = e_k . Phi(k, s'+1) w_s',  g[b, k] = e_k . Phi(k, 0)[:, b]
            gk = _pick(e0, o_c, k) * y0 + _pick(e1, o_c, k) * y1
            tl.store(Gw + wb * C * C + k * C + o_j, gk, mask=m_w)
            tl.store(gw + wb * 2 * C + (o_j - C) * C + k, gk, mask=m_s)
    tl.store(Ew + wb * 2 * C + o_j, y0, mask=m_w)
    tl.store(Ew + wb * 2 * C + C + o_j, y1, mask=m_w)
    tl.store(Fw + wb * 4 + (o_j - C), y0, mask=m_s)
    tl.store(Fw + wb * 4 + 2 + (o_j - C), y1, mask=m_s)


@triton.jit
def _out_grad(M, v, wb, k, o_j, m_w, m_s, C: tl.constexpr):
    """Row k of an output's gradient over the lanes: ``M [.., C, C]``'s row k on the write lanes and
    ``v [.., 2, C]``'s column k on the two start lanes."""
    x = tl.load(M + wb * C * C + k * C + o_j, mask=m_w, other=0.)
    return x + tl.load(v + wb * 2 * C + (o_j - C) * C + k, mask=m_s, other=0.)


@triton.jit
def block_weights_bwd_kernel(co, dGw, dHw, dgw, dhw, dEw, dFw, dco, T, NC, NTOK, H: tl.constexpr,
                             C: tl.constexpr, CP: tl.constexpr, CK: tl.constexpr):
    """The gradients of the per-head coefficients ``dco`` [10, B*T*H] from those of the weights: the
    substitution's states recomputed into [CK, CP] tiles (CK >= C + 1), then its adjoint in reverse."""
    o_c, o_j, m_t, rows, wb, m_w, m_s, y0, y1 = _weights_program(T, NC, H, C, CP)
    a00, a01, a10, a11, e0, e1, w0, w1, r0, r1 = _head_coefs(co, rows, m_t, NTOK)
    o_k = tl.arange(0, CK)
    Y0 = tl.where(o_k[:, None] == 0, y0[None, :], 0.)
    Y1 = tl.where(o_k[:, None] == 0, y1[None, :], 0.)
    for k in range(1, C + 1):
        y0, y1 = _advance(y0, y1, a00, a01, a10, a11, w0, w1, o_c, o_j, k)
        Y0 = tl.where(o_k[:, None] == k, y0[None, :], Y0)
        Y1 = tl.where(o_k[:, None] == k, y1[None, :], Y1)
    # lambda: the adjoint of Y_k; first the end state's (E, F)
    l0 = tl.load(dEw + wb * 2 * C + o_j, mask=m_w, other=0.) + tl.load(dFw + wb * 4 + (o_j - C), mask=m_s, other=0.)
    l1 = (tl.load(dEw + wb * 2 * C + C + o_j, mask=m_w, other=0.)
          + tl.load(dFw + wb * 4 + 2 + (o_j - C), mask=m_s, other=0.))
    z = tl.zeros([C], dtype=tl.float32)
    da00, da01, da10, da11, de0, de1, dw0, dw1, dr0, dr1 = z, z, z, z, z, z, z, z, z, z
    for j in range(0, C + 1):
        k = C - j
        y0 = tl.sum(tl.where(o_k[:, None] == k, Y0, 0.), 0)
        y1 = tl.sum(tl.where(o_k[:, None] == k, Y1, 0.), 0)
        sel = o_c == k
        if k < C:
            dG = _out_grad(dGw, dgw, wb, k, o_j, m_w, m_s, C)
            de0 = tl.where(sel, tl.sum(dG * y0, 0), de0)
            de1 = tl.where(sel, tl.sum(dG * y1, 0), de1)
            l0 += _pick(e0, o_c, k) * dG
            l1 += _pick(e1, o_c, k) * dG
        if k >= 1:
            sel = o_c == k - 1
            dHk = _out_grad(dHw, dhw, wb, k - 1, o_j, m_w, m_s, C)
            dr0 = tl.where(sel, tl.sum(dHk * y0, 0), dr0)
            dr1 = tl.where(sel, tl.sum(dHk * y1, 0), dr1)
            l0 += _pick(r0, o_c, k - 1) * dHk
            l1 += _pick(r1, o_c, k - 1) * dHk
            # Y_k = A_{k-1} Y_{k-1} + w_{k-1} in column k-1
            p0 = tl.sum(tl.where(o_k[:, None] == k - 1, Y0, 0.), 0)
            p1 = tl.sum(tl.where(o_k[:, None] == k - 1, Y1, 0.), 0)
            da00 = tl.where(sel, tl.sum(l0 * p0, 0), da00)
            da01 = tl.where(sel, tl.sum(l0 * p1, 0), da01)
            da10 = tl.where(sel, tl.sum(l1 * p0, 0), da10)
            da11 = tl.where(sel, tl.sum(l1 * p1, 0), da11)
            col = o_j == k - 1
            dw0 = tl.where(sel, tl.sum(tl.where(col, l0, 0.), 0), dw0)
            dw1 = tl.where(sel, tl.sum(tl.where(col, l1, 0.), 0), dw1)
            b00, b01 = _pick(a00, o_c, k - 1), _pick(a01, o_c, k - 1)
            b10, b11 = _pick(a10, o_c, k - 1), _pick(a11, o_c, k - 1)
            n0 = b00 * l0 + b10 * l1
            l1 = b01 * l0 + b11 * l1
            l0 = n0
    tl.store(dco + rows, da00, mask=m_t)
    tl.store(dco + NTOK + rows, da01, mask=m_t)
    tl.store(dco + 2 * NTOK + rows, da10, mask=m_t)
    tl.store(dco + 3 * NTOK + rows, da11, mask=m_t)
    tl.store(dco + 4 * NTOK + rows, de0, mask=m_t)
    tl.store(dco + 5 * NTOK + rows, de1, mask=m_t)
    tl.store(dco + 6 * NTOK + rows, dw0, mask=m_t)
    tl.store(dco + 7 * NTOK + rows, dw1, mask=m_t)
    tl.store(dco + 8 * NTOK + rows, dr0, mask=m_t)
    tl.store(dco + 9 * NTOK + rows, dr1, mask=m_t)
