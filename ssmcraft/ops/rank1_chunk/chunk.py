"""Chunked identity-minus-rank-1 recurrences with a per-head step (DeltaNet, Gated DeltaNet).

The family (``rank1`` IR, per-head step ``c`` and per-head decay ``a``):

    S_t = a_t S_{t-1} - c_t (S_{t-1} u_t) v_t^T + p_t q_t^T        S [d, m] = "V x K"
    y_t = S_t oq_t

Kernels keep the transpose ``H = S^T`` ([K, V], FLA's layout):

    H_t = a_t H_{t-1} - c_t v_t (u_t^T H_{t-1}) + q_t p_t^T,        o_t = H_t^T oq_t

DeltaNet: u = v = q = k, c = beta, p = beta x, a = 1.  Gated DeltaNet: a = alpha, c = alpha beta.
An optional per-head scale ``ps`` of p is fused (p = ps x), so DeltaNet's beta x costs no pass;
``C_MODE`` reads c as its own tensor, as ps itself (DeltaNet: one gradient, summed in the kernel)
or as a ps (Gated DeltaNet: formed in the kernels), so neither runs a PyTorch op around the kernels.

Algorithm (WY / UT transform, per chunk of BT tokens, local index t, state H0 at the chunk's
start; g_t = sum_{r<=t} log a_r within the chunk, gp_t = g_{t-1}, Gamma[t,s] = e^{g_t-g_s}):

    A  = strict_lower( c_t (u_t . v_s) e^{gp_t - g_s} )     [BT, BT]
    M  = (I + A)^{-1}          unit lower triangular; three levels of block forward substitution
                               (4, 16, 64) written as tensor-core products (_solve_unit_lower)
    W  = M diag(c e^{gp}) U                                  [BT, K]
    Up = M P                 if q == v (merged: the insert and erase keys coincide)
       = -M B P              otherwise, B = strict_lower( c_t (u_t . q_s) e^{gp_t - g_s} )
    Psi = Up - W H0                                          [BT, V]  ("v_new" in FLA)
    O   = diag(e^g) OQ H0 + L Psi (+ Lq P)                   L = tril(OQ V^T o Gamma), Lq with Q
    H_C = e^{g_last} H0 + Vbar^T Psi (+ Qbar^T P)            Vbar = diag(e^{g_last - g}) V

Kernels, top to bottom: ``_prep_kernel`` (parallel over chunks: A, M, W, Up, L), the
sequential ``_state_fwd_kernel`` (state across chunks, outputs, and for training the chunk
states and Psi), ``_state_bwd_kernel`` (reverse recurrence of dH, dPsi) and ``_grad_kernel``
(parallel over chunks: every input's gradient, the WY backward, the decay's gradient through
the reverse cumulative sum of d g). Nothing of size [B, T, K, V] is stored: the forward of a
training step keeps the chunk states [B, NT, H, K, V] (T / BT times smaller) and Psi, so the
backward does not rerun the sequential forward (FLA recomputes both).

Backward, per chunk with dO and dH_C (gradient at the chunk's end):
    dPsi = L^T dO + Vbar dH_C,   dH0 = e^{g_last} dH_C + (e^g OQ)^T dO - W^T dPsi
    dW = -dPsi H0^T,  dP = M^T dPsi (merged),  dM = dPsi P^T + dW (diag(c e^{gp}) U)^T,
    dA = -M^T dM M^T (strict lower), then u, v, c, g through A's and W's entries, and
    d log a_r = sum_{t>=r} dg_t + sum_{t>r} dgp_t.

Shapes (kernel level, FLA layout): v, u, q, oq [B, T, H, K]; p [B, T, H, V]; c, a [B, T, H];
initial_state / final state [B, H, K, V] (fp32); output [B, T, H, V]. I/O in float32,
bfloat16 or float16; the state and every reduction in float32. Requires a > 0.
Measured figures: BENCHMARKS.md, "Rank-1 per head (chunked)".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.tiles import chunk_rows, state_block, state_or_zero, value_block
from ssmcraft.ops.common.tuning import INTERPRET, IO_DTYPES, buffer, cdiv, dot_precision, io_dtype, pow2, tune, warp_rule

INTERPRET_BV: int | None = None     # value-block size under the interpreter (tests set it small)
POISON = False                      # tests: fill every buffer with NaN before the kernels write it
CHUNK = 64                          # chunk size used by ``forward``
BACKEND_NAME = "rank1-chunk"


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------

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
def _chunk_decay(g, row, m_t, i_b, i_h, i_t, T, H: tl.constexpr, BT: tl.constexpr):
    """The within-chunk log-decay sums ``g`` at the chunk's rows and at its last row (``gl``), and
    the factors ``e^{gl - g}`` (0 past T)."""
    b_g = tl.load(g + row, mask=m_t, other=0.)
    last = tl.minimum(T, i_t * BT + BT) - 1
    b_gl = tl.load(g + (i_b * T + last).to(tl.int64) * H + i_h)
    return b_g, b_gl, tl.where(m_t, tl.exp(b_gl - b_g), 0.)


@triton.jit
def _neumann4(Mi, Ao, PREC: tl.constexpr):
    """(D + Ao)^{-1} from Mi = D^{-1} when N = Mi Ao is nilpotent of order 4 (at most four
    diagonal blocks of D per block of the next level): (I - N)(I + N^2) D^{-1}. This is block
    forward substitution, written as tensor-core products."""
    N = tl.dot(Mi, Ao, input_precision=PREC)
    X = Mi + tl.dot(tl.dot(N, N, input_precision=PREC), Mi, input_precision=PREC)
    return X - tl.dot(N, X, input_precision=PREC)


@triton.jit
def _solve_unit_lower(A, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^{-1} for A [BT, BT] strictly lower triangular (fp32), BT in {16, 32, 64}.

    Three levels of block forward substitution, each exact because a block holds at most four
    blocks of the level below: 4 x 4 diagonal blocks as (I - A4)(I + A4^2) (A4^4 = 0), then
    16 x 16, then 64 x 64 blocks by :func:`_neumann4`. Only matrix products: no serial
    row-by-row loop (which costs a cross-warp reduction per row).
    """
    o = tl.arange(0, BT)
    r = o[:, None] // 4
    cc = o[None, :] // 4
    eye = (o[:, None] == o[None, :]).to(tl.float32)
    A4 = tl.where(r == cc, A, 0.)
    X = eye + tl.dot(A4, A4, input_precision=PREC)
    Mi = X - tl.dot(A4, X, input_precision=PREC)                     # 4 x 4 blocks
    Mi = _neumann4(Mi, tl.where(((r // 4) == (cc // 4)) & (r != cc), A, 0.), PREC)   # 16 x 16
    if BT > 16:
        Mi = _neumann4(Mi, tl.where((r // 4) != (cc // 4), A, 0.), PREC)           # 64 x 64
    return Mi


@tune([triton.Config({}, num_warps=w) for w in (4, 8)],
       key=["H", "K", "V", "BT", "HAS_A", "GENERAL", "HAS_PS", "C_MODE"], prune=warp_rule)
@triton.jit(do_not_specialize=["T"])
def _prep_kernel(u, v, q, p, ps, oq, c, a, M, W, Up, L, Lq, g,
                 T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 HAS_A: tl.constexpr, GENERAL: tl.constexpr, HAS_PS: tl.constexpr,
                 C_MODE: tl.constexpr, PREC: tl.constexpr):
    """Per chunk: M = (I + A)^{-1} [BT per token], W [K], Up [V], L (and Lq) [BT], g.
    C_MODE (``C_GIVEN``, ``C_IS_PS``, ``C_IS_A_PS``): where the step c comes from."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    DT = W.dtype.element_ty
    o_i, m_t, row = chunk_rows(i_b, i_h, i_t, T, H, BT)
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tt = m_t[:, None] & (o_i < BT)[None, :]
    lower = o_i[:, None] > o_i[None, :]
    incl = o_i[:, None] >= o_i[None, :]

    b_c = _step(c, a, ps, row, m_t, C_MODE)
    if HAS_A:
        b_la = tl.log(tl.load(a + row, mask=m_t, other=1.).to(tl.float32))
        b_g = tl.cumsum(b_la, axis=0)
        b_gp = b_g - b_la
        tl.store(g + row, b_g, mask=m_t)
        b_ch = b_c * tl.exp(b_gp)
    else:
        b_ch = b_c
    # L = tril(OQ V^T o Gamma) (and Lq with Q)
    b_v = tl.load(v + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
    b_oq = tl.load(oq + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
    b_L = tl.dot(b_oq, tl.trans(b_v), input_precision=PREC)
    if HAS_A:
        b_L = b_L * tl.exp(tl.where(incl, b_g[:, None] - b_g[None, :], 0.))
    b_L = tl.where(incl, b_L, 0.)
    tl.store(L + row[:, None] * BT + o_i[None, :], b_L.to(DT), mask=m_tt)
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
    b_M = _solve_unit_lower(b_A, BT, PREC)
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
        for bv, w, s in ((32, 4, 2), (64, 4, 2))],
       key=["H", "K", "V", "BT", "HAS_A", "GENERAL", "HAS_PS", "WRITE_O", "STORE_H", "HAS_H0", "STORE_HT"])
@triton.jit(do_not_specialize=["T", "NT"])
def _state_fwd_kernel(v, q, p, ps, oq, W, Up, L, Lq, g, h0, o, hs, psi, ht,
                      T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_A: tl.constexpr, GENERAL: tl.constexpr, HAS_PS: tl.constexpr,
                      WRITE_O: tl.constexpr, STORE_H: tl.constexpr, HAS_H0: tl.constexpr,
                      STORE_HT: tl.constexpr, PREC: tl.constexpr):
    """Sequential over chunks, one program per (value block, batch, head). HAS_H0: start from
    ``h0`` (else from zero, ``h0`` unread); STORE_HT: write the final state to ``ht``."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    DT = W.dtype.element_ty
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(0, i_v, K, V, BK, BV)
    b_h = state_or_zero(h0, i_bh, p_kv, m_kv, K, V, HAS_H0, BK, BV)

    for i_t in range(NT):
        o_i, m_t, row = chunk_rows(i_b, i_h, i_t, T, H, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        if STORE_H:
            base = ((i_b * NT + i_t) * H + i_h).to(tl.int64) * K * V
            tl.store(hs + base + p_kv, b_h.to(DT), mask=m_kv)
        b_hd = b_h.to(DT)
        b_w = tl.load(W + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_psi = tl.load(Up + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_psi -= tl.dot(b_w, b_hd, input_precision=PREC)
        if STORE_H:
            tl.store(psi + row[:, None] * V + o_v[None, :], b_psi.to(DT), mask=m_tv)
        b_psid = b_psi.to(DT)
        if HAS_A:
            b_g, b_gl, b_dec = _chunk_decay(g, row, m_t, i_b, i_h, i_t, T, H, BT)
        if WRITE_O:
            b_oq = tl.load(oq + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            b_o = tl.dot(b_oq, b_hd, input_precision=PREC)
            if HAS_A:
                b_o = b_o * tl.exp(b_g)[:, None]
            b_L = tl.load(L + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.)
            b_o += tl.dot(b_L, b_psid, input_precision=PREC)
            if GENERAL:
                b_p = tl.load(p + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
                if HAS_PS:
                    b_p = (b_p.to(tl.float32) * tl.load(ps + row, mask=m_t, other=0.)[:, None]).to(DT)
                b_Lq = tl.load(Lq + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.)
                b_o += tl.dot(b_Lq, b_p, input_precision=PREC)
            tl.store(o + row[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
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
        for bv, w, s in ((32, 4, 2), (64, 4, 2))],
       key=["H", "K", "V", "BT", "HAS_A", "HAS_DHT", "STORE_DH0"])
@triton.jit(do_not_specialize=["T", "NT"])
def _state_bwd_kernel(v, oq, W, L, g, do, dht, dhs, dpsi, dh0,
                      T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_A: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                      PREC: tl.constexpr):
    """Reverse over chunks: dH at each chunk's end, dPsi = L^T dO + Vbar dH, and
    dH0 = e^{g_last} dH + (e^g OQ)^T dO - W^T dPsi. HAS_DHT: start from ``dht`` (else from zero,
    ``dht`` unread); STORE_DH0: write dH0 to ``dh0``."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    DT = W.dtype.element_ty
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(0, i_v, K, V, BK, BV)
    b_dh = state_or_zero(dht, i_bh, p_kv, m_kv, K, V, HAS_DHT, BK, BV)

    for j in range(NT):
        i_t = NT - 1 - j
        o_i, m_t, row = chunk_rows(i_b, i_h, i_t, T, H, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        base = ((i_b * NT + i_t) * H + i_h).to(tl.int64) * K * V
        tl.store(dhs + base + p_kv, b_dh.to(DT), mask=m_kv)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_L = tl.load(L + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.)
        b_vk = tl.load(v + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_oq = tl.load(oq + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_w = tl.load(W + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        if HAS_A:
            b_g, b_gl, b_dec = _chunk_decay(g, row, m_t, i_b, i_h, i_t, T, H, BT)
            b_vk = (b_vk.to(tl.float32) * b_dec[:, None]).to(DT)
            b_oq = (b_oq.to(tl.float32) * tl.exp(b_g)[:, None]).to(DT)
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
       key=["H", "K", "V", "BT", "HAS_A", "GENERAL", "U_IS_V", "HAS_PS", "C_MODE"], prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def _grad_kernel(u, v, q, p, ps, oq, c, a, g, M, L, Lq, hs, dhs, psi, dpsi, do,
                 du, dv, dq, dp, dps, doq, dc, da,
                 T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 HAS_A: tl.constexpr, GENERAL: tl.constexpr, U_IS_V: tl.constexpr,
                 HAS_PS: tl.constexpr, C_MODE: tl.constexpr, PREC: tl.constexpr):
    """Per chunk: gradients of u, v, q, p, oq, c, a from the chunk states h, their
    gradients dh (at the chunk's end), Psi and dPsi. Three phases keep few tiles live:
    (1) dW, dM-part and dp over value blocks, (2) the WY backward, (3) readout/state terms.
    C_MODE: c given (``dc`` written), c = ps (DeltaNet's beta: its two gradients summed into ``dc``)
    or c = a ps (Gated DeltaNet's alpha beta: dc goes to ``da`` and ``dps``, ``dc`` unwritten)."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    DT = M.dtype.element_ty
    o_i, m_t, row = chunk_rows(i_b, i_h, i_t, T, H, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    lower = o_i[:, None] > o_i[None, :]
    incl = o_i[:, None] >= o_i[None, :]
    base = ((i_b * NT + i_t) * H + i_h).to(tl.int64) * K * V

    b_M = tl.load(M + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.)
    b_c = _step(c, a, ps, row, m_t, C_MODE)
    if HAS_A:
        b_g, b_gl, b_dec = _chunk_decay(g, row, m_t, i_b, i_h, i_t, T, H, BT)
        b_a = tl.load(a + row, mask=m_t, other=1.).to(tl.float32)
        b_gp = b_g - tl.log(b_a)
        b_ch = b_c * tl.exp(b_gp)
        b_dgv = tl.zeros([BT], dtype=tl.float32)
        b_dgp = tl.zeros([BT], dtype=tl.float32)
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
        b_Lq = tl.load(Lq + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.)
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
            b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
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
    b_Anc = tl.dot(b_u, tl.trans(b_v), input_precision=PREC)
    if HAS_A:
        Gp = tl.exp(tl.where(lower, b_gp[:, None] - b_g[None, :], 0.))
        b_Anc = b_Anc * Gp
    b_Anc = tl.where(lower, b_Anc, 0.)
    b_dcc += tl.sum(b_dA * b_Anc, axis=1)
    b_dAc = b_dA * b_c[:, None]
    if HAS_A:
        X = b_dAc * b_Anc
        b_dgp += tl.sum(X, axis=1)
        b_dgv -= tl.sum(X, axis=0)
        b_dAc = b_dAc * Gp
    b_dAcd = b_dAc.to(DT)
    b_duu += tl.dot(b_dAcd, b_v, input_precision=PREC)
    b_dvv = tl.dot(tl.trans(b_dAcd), b_u, input_precision=PREC)
    if GENERAL:
        b_dcc += tl.sum(b_dB * b_Bnc, axis=1)
        b_dBc = b_dB * b_c[:, None]
        if HAS_A:
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
        # them live through phase 2 spilled 48 bytes more and took 9% longer on an H200; so did an
        # fp32 scratch for the partial (8 bytes more): in 16 bits the partial is rounded once more,
        # as autograd's sum of two 16-bit gradients did before (BENCHMARKS.md, rank-1 chunked)
        tl.debug_barrier()
        b_dps = tl.load(dps + row, mask=m_t, other=0.).to(tl.float32)
        b_dps += b_dcc * tl.load(a + row, mask=m_t, other=1.).to(tl.float32)
        tl.store(dps + row, b_dps.to(dps.dtype.element_ty), mask=m_t)
        b_dac = b_dcc * tl.load(ps + row, mask=m_t, other=0.).to(tl.float32)
    else:
        tl.store(dc + row, b_dcc.to(dc.dtype.element_ty), mask=m_t)

    # ---- phase 3: readout (O = e^g OQ h + L Psi) and state (Vbar^T Psi) terms ---------
    b_dOQ = tl.zeros([BT, BK], dtype=tl.float32)
    b_dLv = tl.zeros([BT, BT], dtype=tl.float32)
    b_dVb = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v, m_v, m_tv, m_kv = value_block(i_v, V, m_t, m_k, BV)
        b_h = tl.load(hs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dh = tl.load(dhs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_psi = tl.load(psi + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_dOQ += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_dLv += tl.dot(b_do, tl.trans(b_psi), input_precision=PREC)
        b_dVb += tl.dot(b_psi, tl.trans(b_dh), input_precision=PREC)
        if HAS_A:
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)

    b_oq = tl.load(oq + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
    if HAS_A:
        b_dOQ = b_dOQ * tl.exp(b_g)[:, None]
        b_dgv += tl.sum(b_dOQ * b_oq.to(tl.float32), axis=1)
        b_L = tl.load(L + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.).to(tl.float32)
        X = b_dLv * b_L
        b_dgv += tl.sum(X, axis=1) - tl.sum(X, axis=0)
        Gm = tl.exp(tl.where(incl, b_g[:, None] - b_g[None, :], 0.))
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
            b_dgv += tl.sum(X, axis=1) - tl.sum(X, axis=0)
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
        b_dgv += tl.where(i_t * BT + o_i == tl.minimum(T, i_t * BT + BT) - 1, b_dgl, 0.)   # at the last row
        b_dla = tl.cumsum(b_dgv, axis=0, reverse=True) + tl.cumsum(b_dgp, axis=0, reverse=True) - b_dgp
        b_da = b_dla / b_a
        if C_MODE == C_IS_A_PS:
            b_da += b_dac
        tl.store(da + row, b_da.to(da.dtype.element_ty), mask=m_t)
    tl.store(dv + row[:, None] * K + o_k[None, :], b_dvv.to(dv.dtype.element_ty), mask=m_tk)
    tl.store(doq + row[:, None] * K + o_k[None, :], b_doq.to(doq.dtype.element_ty), mask=m_tk)


# ----------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------

def _launch_opts(V: int) -> dict:
    """Config chosen by rule under the interpreter (multi-config autotune fails there)."""
    if not INTERPRET:
        return {}
    return {"BV": _bv(V)}


def _bv(V: int) -> int:
    """Value block of the parallel kernels (and of the sequential ones under the interpreter)."""
    if INTERPRET:
        return INTERPRET_BV or pow2(V)
    return min(pow2(V), 64)


def _key_block(K: int, dtype) -> int:
    """The padded key block. bf16 products with a key block below 64 fail on an H200 with
    Triton 3.6: an illegal memory access in ``_grad_kernel`` at K = 32 and NaN outputs at K = 16,
    while fp32 (tf32x3) is right at every K (``benchmarks/diag_rank1_smallk.py``, which runs fp32
    and bf16). There the key block is padded to 64: the loads are masked, so the extra key columns
    are zeros. fp16 is padded too, by analogy with bf16 (the same 16-bit dot path; not measured).
    The rule is the same under the interpreter, so the CPU tests run the padded kernels."""
    if dtype == torch.float32:
        return pow2(K)
    return pow2(K, lo=64)


def _empty(*shape, device, dtype):
    return buffer(shape, device, dtype, POISON)


def _empty_like(t):
    return _empty(*t.shape, device=t.device, dtype=t.dtype)


def _c_mode(c, a, ps) -> int:
    """``C_MODE`` of a call: c None means c = a ps (both given), c that is ps the same tensor."""
    if c is None:
        if a is None or ps is None:
            raise ValueError("chunk_rank1: c = None stands for c = a * ps and needs both a and ps")
        return C_IS_A_PS.value
    return C_IS_PS.value if ps is c else C_GIVEN.value


def _operands(v, u, q, ps, c, a):
    """``(u, q, ps, c, a)`` as the kernels take them: the tensor, or a stand-in for a pointer the
    constexprs leave unread (u or q that is v; ps, a, or c where ``C_IS_A_PS`` forms it)."""
    cc = a if c is None else c
    return (v if u is None else u, v if q is None else q, cc if ps is None else ps, cc,
            cc if a is None else a)


def _fwd(v, u, q, p, ps, oq, c, a, h0, output_final_state, store_states, c_mode, BT):
    B, T, H, K = v.shape
    V = p.shape[-1]
    dt = p.dtype
    dev = p.device
    NT = cdiv(T, BT)
    BK = _key_block(K, dt)
    general = q is not None
    has_a = a is not None
    has_ps = ps is not None
    uu, qq, pss, cc, aa = _operands(v, u, q, ps, c, a)
    prec = dot_precision(dt)
    M = _empty(B, T, H, BT, device=dev, dtype=dt)
    L = _empty(B, T, H, BT, device=dev, dtype=dt)
    Lq = _empty(B, T, H, BT, device=dev, dtype=dt) if general else L
    W = _empty(B, T, H, K, device=dev, dtype=dt)
    Up = _empty(B, T, H, V, device=dev, dtype=dt)
    g = _empty(B, T, H, device=dev, dtype=torch.float32) if has_a else cc
    launch(_prep_kernel, (NT, B * H), uu, v, qq, p, pss, oq, cc, aa, M, W, Up, L, Lq, g, T, H=H, K=K, V=V, BT=BT, BK=BK,
           BV=_bv(V), HAS_A=has_a, GENERAL=general, HAS_PS=has_ps, C_MODE=c_mode, PREC=prec)
    o = _empty(B, T, H, V, device=dev, dtype=dt)
    hs = _empty(B, NT, H, K, V, device=dev, dtype=dt) if store_states else o
    psi = _empty(B, T, H, V, device=dev, dtype=dt) if store_states else o
    ht = _empty(B, H, K, V, device=dev, dtype=torch.float32) if output_final_state else o
    # no h0 or no final state: a flag, not a zero state filled and read or a state written unread
    launch(_state_fwd_kernel, lambda meta: (cdiv(V, meta["BV"]), B * H),
        v, qq, p, pss, oq, W, Up, L, Lq, g, o if h0 is None else h0, o, hs, psi, ht, T, NT,
        H=H, K=K, V=V, BT=BT, BK=BK, HAS_A=has_a, GENERAL=general, HAS_PS=has_ps, WRITE_O=True,
        STORE_H=store_states, HAS_H0=h0 is not None, STORE_HT=output_final_state, PREC=prec,
        **_launch_opts(V))
    saved = (M, L, Lq, W, g, hs, psi)
    return o, (ht if output_final_state else None), saved


def _bwd(v, u, q, p, ps, oq, c, a, saved, do, dht, need_dh0, c_mode, BT):
    B, T, H, K = v.shape
    V = p.shape[-1]
    dt = p.dtype
    NT = cdiv(T, BT)
    BK = _key_block(K, dt)
    general = q is not None
    has_a = a is not None
    M, L, Lq, W, g, hs, psi = saved
    prec = dot_precision(dt)
    do = do.contiguous().to(dt)
    dhs = _empty_like(hs)
    dpsi = _empty_like(psi)
    dh0 = _empty(B, H, K, V, device=v.device, dtype=torch.float32) if need_dh0 else dhs
    has_dht = dht is not None
    launch(_state_bwd_kernel, lambda meta: (cdiv(V, meta["BV"]), B * H),
        v, oq, W, L, g, do, dht.contiguous().float() if has_dht else do, dhs, dpsi, dh0, T, NT,
        H=H, K=K, V=V, BT=BT, BK=BK, HAS_A=has_a, HAS_DHT=has_dht, STORE_DH0=need_dh0, PREC=prec,
        **_launch_opts(V))
    uu, qq, pss, cc, aa = _operands(v, u, q, ps, c, a)
    dv = _empty_like(v)
    du = _empty_like(v) if u is not None else dv
    dq = _empty_like(v) if general else dv
    dp = _empty_like(p)
    doq = _empty_like(oq)
    has_ps = ps is not None
    want_dps = has_ps and c_mode != C_IS_PS.value      # c is ps: its one gradient is dc
    da = _empty_like(a) if has_a else None
    dc = _empty_like(c) if c is not None else da       # c = a ps: no dc (never written)
    dps = _empty_like(ps) if want_dps else dc
    launch(_grad_kernel, (NT, B * H),
        uu, v, qq, p, pss, oq, cc, aa, g, M, L, Lq, hs, dhs, psi, dpsi, do,
        du, dv, dq, dp, dps, doq, dc, da if has_a else dc, T, NT, H=H, K=K, V=V, BT=BT, BK=BK,
        BV=_bv(V), HAS_A=has_a, GENERAL=general, U_IS_V=u is None, HAS_PS=has_ps, C_MODE=c_mode, PREC=prec)
    return (dv, du if u is not None else None, dq if general else None, dp, dps if want_dps else None, doq,
            dc if c is not None else None, da, dh0 if need_dh0 else None)


# ----------------------------------------------------------------------------------------
# autograd Function
# ----------------------------------------------------------------------------------------

class Rank1ChunkFunction(torch.autograd.Function):
    """(v, u|None, q|None, p, ps|None, oq, c|None, a|None, h0|None) -> (o, ht|None);
    u/q None mean "= v", ps None means 1, c per ``c_mode`` (``_c_mode``)."""

    @staticmethod
    def forward(ctx, v, u, q, p, ps, oq, c, a, h0, c_mode, output_final_state, chunk_size):
        train = any(ctx.needs_input_grad[:9])
        ctx.c_mode = c_mode
        ctx.set_materialize_grads(False)     # an unused output's gradient stays None: no zero tensor read
        o, ht, saved = _fwd(v, u, q, p, ps, oq, c, a, h0, output_final_state, train, c_mode, chunk_size)
        if train:
            ctx.save_for_backward(v, u, q, p, ps, oq, c, a, *saved)
        ctx.chunk_size = chunk_size
        ctx.need_dh0 = h0 is not None and ctx.needs_input_grad[8]
        return o, (ht if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        v, u, q, p, ps, oq, c, a, *saved = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(p)
        grads = _bwd(v, u, q, p, ps, oq, c, a, saved, do, dht, ctx.need_dh0, ctx.c_mode, ctx.chunk_size)
        return (*grads, None, None, None)


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------


def chunk_rank1(v, p, c, oq, *, u=None, q=None, a=None, ps=None, initial_state=None,
                output_final_state: bool = False, chunk_size: int = 64):
    """H_t = a_t H_{t-1} - c_t v_t (u_t^T H_{t-1}) + q_t (ps_t p_t)^T;  o_t = H_t^T oq_t.

    Args:
        v:  erase key [B, T, H, K] (also u and q where those are None).
        p:  inserted value [B, T, H, V].
        ps: per-head scale of p [B, T, H] or None (= 1); fused, so that e.g. DeltaNet's
            beta x costs no extra pass.
        c:  per-head step [B, T, H], or None for c = a ps (Gated DeltaNet's alpha beta: the
            product is taken in the kernels and its gradient goes to a and ps). c, a and ps are
            read in their own dtype (fp32, bf16 or fp16) and their gradients written in it; c
            that is ps, one tensor (DeltaNet's beta), is read once and gets one gradient.
        oq: readout key [B, T, H, K].
        u:  read key of the erase [B, T, H, K] or None (= v).
        q:  insert key [B, T, H, K] or None (= v: the merged delta-rule form).
        a:  per-head decay [B, T, H], > 0, or None (= 1).
        initial_state: [B, H, K, V] (any float dtype; kept fp32) or None.
        output_final_state: also return the state [B, H, K, V] (fp32).
        chunk_size: 16, 32 or 64.
    Returns:
        o [B, T, H, V] in p's dtype, final state [B, H, K, V] fp32 or None.
    """
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    dt = p.dtype
    if dt not in IO_DTYPES:
        raise ValueError(f"chunk_rank1: I/O dtype must be one of {IO_DTYPES}, got {dt}")
    B, T, H, K = v.shape
    V = p.shape[-1]
    c_mode = _c_mode(c, a, ps)      # refused at every length; ``hc`` below is ``hps`` exactly when c is ps
    if T == 0:
        o = p.new_zeros(B, 0, H, V)
        S = initial_state.float() if initial_state is not None else p.new_zeros(B, H, K, V, dtype=torch.float32)
        return o, (S if output_final_state else None)

    def prep(t, shape, dtype=dt):
        """``t`` as a contiguous ``shape`` tensor in ``dtype``. No op, and no autograd node, where it
        already is one."""
        if t is None:
            return None
        if t.shape != shape:
            t = t.expand(*shape)
        if t.dtype != dtype:
            t = t.to(dtype)
        return t.contiguous()
    kshape, hshape = (B, T, H, K), (B, T, H)
    head = (lambda t: None if t is None else prep(t, hshape, io_dtype(t.dtype)))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    hps = head(ps)
    hc = hps if c is ps else head(c)      # one tensor stays one (C_IS_PS) whatever prep does to it
    o, ht = Rank1ChunkFunction.apply(prep(v, kshape), prep(u, kshape), prep(q, kshape), prep(p, (B, T, H, V)),
                                     hps, prep(oq, kshape), hc, head(a), h0,
                                     c_mode, output_final_state, chunk_size)
    return o, ht


def delta_rule(q, k, x, beta, alpha=None, *, initial_state=None, output_final_state: bool = False,
               chunk_size: int = 64):
    """(Gated) DeltaNet in FLA's convention: S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t x_t^T
    (state [K, V]), o_t = S_t^T q_t.  q, k [B, T, H, K]; x [B, T, H, V]; beta, alpha [B, T, H];
    initial_state [B, H, K, V].  Returns o [B, T, H, V], final state [B, H, K, V] fp32 or None."""
    return chunk_rank1(k, x, beta if alpha is None else None, q, a=alpha, ps=beta, initial_state=initial_state,
                       output_final_state=output_final_state, chunk_size=chunk_size)


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if this family runs ``ir``, else the reason it does not."""
    if ir.kind != "rank1":
        return f"{ir.spec_name}: structure {ir.kind!r}, not rank1"
    if ir.readout is not None:
        return f"{ir.spec_name}: element-wise readout"

    def dims(slot):
        co = ir.coefficient(slot)
        return None if co is None else tuple(co.dims)
    if dims("c") != ():
        return f"{ir.spec_name}: step c has dims {dims('c')}, not per head ()"
    if dims("a") not in (None, ()):
        return f"{ir.spec_name}: decay a has dims {dims('a')}, not per head ()"
    for s in ("u", "v", "q", "oq"):
        if dims(s) != ("m",):
            return f"{ir.spec_name}: slot {s} has dims {dims(s)}, not (m,)"
    if "p" not in ir.slots or dims("p") not in ((), ("d",)):
        return f"{ir.spec_name}: input term is not p q^T with p of dims (d,)"
    if dims("oc") not in (None, (), ("d",)):
        return f"{ir.spec_name}: readout scale oc has dims {dims('oc')}"
    if "oh" in ir.slots and dims("oh") not in ((), ("d",)):
        return f"{ir.spec_name}: readout offset oh has dims {dims('oh')}"
    return None


def _split_p(ir):
    """(s, x) when p's expression is s * x with s a per-head input/param and x a (d,) one."""
    co = ir.coefficient("p")
    if co is None or co.dims != ("d",):
        return None
    dims = {**ir.inputs, **ir.params}
    # the expression is sympy here and its printed text in an exported module: read the text
    names = str(co.expr).replace(" ", "").split("*")
    if len(names) != 2 or not all(n in dims for n in names):
        return None
    s = [n for n in names if tuple(dims[n]) == ()]
    x = [n for n in names if tuple(dims[n]) == ("d",)]
    return (s[0], x[0]) if len(s) == 1 and len(x) == 1 else None


def _per_head(x, B, T, H, device, one_is_none=False):
    """A per-head slot as [B, T, H]: a ``[B, T, H]`` tensor as it is, a laid-out one
    (``[B|1, T|1, H|1, 1, 1]``) broadcast, a number filled in (None for a decay of 1 when ``one_is_none``)."""
    if isinstance(x, torch.Tensor):
        return x if x.dim() == 3 else x.expand(B, T, H, 1, 1).reshape(B, T, H)
    return None if one_is_none and float(x) == 1.0 else torch.full((B, T, H), float(x), device=device)


def forward(obj, lay, co, output_final_state):
    """Run the family on laid-out coefficients (see ssmcraft.ops.common.reference.layout).

    co: slot -> tensor [B|1, T|1, H|1, r, c] or number. Returns (y [B, T, H, d] in lay.dtype,
    S_T [B, H, d, m] fp32 or None); autograd reaches every slot tensor and lay.S0.
    """
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    io = io_dtype(lay.out_dtype)
    dev = next(t for t in co.values() if isinstance(t, torch.Tensor)).device

    def key(x):
        return x.expand(B, T, H, 1, m).reshape(B, T, H, m)
    v = key(co["v"])
    u = None if co["u"] is co["v"] else key(co["u"])
    q = None if co["q"] is co["v"] else key(co["q"])
    oq = key(co["oq"])
    ps = None
    split = _split_p(obj.ir)
    if split is not None:           # p = s x with s per head, x a (d,) input: scale fused in the kernel
        ps, p = _per_head(lay.env[split[0]], B, T, H, dev), lay.env[split[1]]
    else:
        p = co["p"]
        p = p if isinstance(p, torch.Tensor) else torch.full((), float(p), device=dev)   # no host copy
    p = p.expand(B, T, H, d, 1).reshape(B, T, H, d)
    c = _per_head(co["c"], B, T, H, dev)
    a = _per_head(co.get("a", 1), B, T, H, dev, one_is_none=True)
    h0 = None if lay.S0 is None else lay.S0.transpose(-1, -2)
    o, ht = chunk_rank1(v, p.to(io), c, oq, u=u, q=q, a=a, ps=ps, initial_state=h0,
                        output_final_state=output_final_state, chunk_size=CHUNK)
    y = o.to(lay.dtype)
    oc = co.get("oc", 1)
    if isinstance(oc, torch.Tensor):
        y = y * oc.expand(B, T, H, oc.shape[-2], 1).reshape(B, T, H, oc.shape[-2])
    elif float(oc) != 1.0:
        y = y * float(oc)
    oh = co.get("oh")
    if oh is not None:
        y = y + (oh.reshape(*oh.shape[:3], -1) if isinstance(oh, torch.Tensor) else float(oh))
    S = None if ht is None else ht.transpose(-1, -2)
    return y, S


def prepare(obj, lay):
    """The family's runner for one call signature (``lay``: sizes and dtypes, from
    ``reference.validate``): slots that are plain inputs go to the kernel as they are, in their own
    dtype (DeltaNet: no PyTorch op besides the kernels); others are computed (``slots.CallSlots``).
    Returns ``fn(inputs, params, initial_state, output_final_state) -> (y [B,T,H,d], S_T [B,H,d,m] | None)``."""
    from ssmcraft.ops.common.slots import bindings, slot_runner
    binds = bindings(obj.ir)
    B, T, H = lay.B, lay.T, lay.H
    out_dtype = lay.out_dtype
    io = io_dtype(out_dtype)
    same = {s: binds[s].kind == "leaf" and binds[s] == binds["v"] for s in ("u", "q")}
    c, a, pb = binds["c"], binds.get("a"), binds["p"]
    # Gated DeltaNet's c = alpha beta with alpha the decay and beta p's scale: taken in the kernels
    c_is_a_ps = (c.kind == "product" and a is not None and a.kind == "leaf" and pb.kind == "scaled"
                 and {c.leaf, c.scale} == {a.leaf, pb.scale})

    def run(cs, initial_state, output_final_state):
        v = cs.get("v")
        u = None if same["u"] else cs.get("u")
        q = None if same["q"] else cs.get("q")
        ps, p = cs.split("p")
        o, ht = chunk_rank1(v, p.to(io), None if c_is_a_ps else _per_head(cs.get("c"), B, T, H, cs.device),
                            cs.get("oq"), u=u, q=q, a=_per_head(cs.get("a", 1.0), B, T, H, cs.device, one_is_none=True),
                            ps=ps,
                            initial_state=None if initial_state is None else initial_state.transpose(-1, -2),
                            output_final_state=output_final_state, chunk_size=CHUNK)
        return cs.finish(o).to(out_dtype), (None if ht is None else ht.transpose(-1, -2))
    return slot_runner(obj, lay, run)
