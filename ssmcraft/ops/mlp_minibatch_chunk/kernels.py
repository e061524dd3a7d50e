"""The Triton kernels of the MLP memory's mini-batch form on tensor cores: a forward sequential over
chunks and a backward over the chunks in reverse; the algorithm, shapes and host code are in
``ssmcraft.ops.mlp_minibatch_chunk.chunk``.

One program per (batch or sequence, head). The anchors (the weights before a chunk) are held as the
sequential kernels hold the weights (``ssmcraft.ops.mlp_memory.kernels``): ``P1 [BH, BM]`` as declared
(``[h, m]``) and ``W2`` transposed, ``P2T [BH, BD]``; a chunk's tokens are the rows of ``[BC, *]`` tiles
(keys ``[BC, BM]``, targets ``[BC, BD]``, hidden ``[BC, BH]``), rows past the chunk or the sequence
masked to zero with a step of 0, so that they add nothing. The activation, the data term and its
adjoint are the sequential kernels' own (``_act``, ``_psi``, ``_psi_adjoint``). A third kernel,
``mlp_chunk_exact_dc_kernel``, takes the decay's gradient term by term in the chunks that hold a tiny or
zero decay.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.rows import seq_state
from ssmcraft.ops.common.tiles import LOG_EXACT_DA, decay_after, decay_before, log_decay, pair_decay_grad
from ssmcraft.ops.common.tuning import pow2, tune
from ssmcraft.ops.mlp_memory.kernels import _act, _program, _psi, _psi_adjoint, _put, _weights

_CHUNK_KEY = ["H", "D", "M", "HID", "C", "ACT", "PSI", "HAS_ETA", "HAS_RW", "HAS_DEC", "AT_ANCHOR", "TWO"]
# (chunk block BC, warps): 8 warps halve each thread's share of the big tiles (the anchors and, in the
# backward, their adjoints: [h, m]-sized fp32 tiles, 64 registers a thread each at 4 warps, h = 2m = 128)
_CHUNK_CONFIGS = [triton.Config({"BC": bc}, num_warps=w)
                  for bc, w in ((16, 4), (32, 4), (64, 4), (16, 8), (32, 8), (64, 8))]


def _chunk_rule(configs, nargs=None, **kw):
    """``early_config_prune``: the block of the chunk's rows is the mini-batch's power of two. 8 warps split
    the N dimension of each product over two warpgroups; Triton 3.6 on Hopper miscompiles products whose
    N is 16 at 8 warps with fp32 I/O (three-pass tf32; BENCHMARKS.md, "Key-decay chunked"), so there a
    chunk of 16 runs in a block of 32 at 8 warps, and 8 warps need blocks of >= 32 over d, m and h."""
    bc = pow2(kw["C"])
    fp32 = kw["PREC"] == "tf32x3"
    out = []
    for c in configs:
        b, w = c.kwargs["BC"], c.num_warps
        if w == 4 and b == bc:
            out.append(c)
        elif w == 8 and not fp32 and b == bc:
            out.append(c)
        elif w == 8 and fp32 and b == max(bc, 32) and min(kw["BD"], kw["BM"], kw["BH"]) >= 32:
            out.append(c)
    return out


@triton.jit
def _tile(ptr, rows, ok, o, m, N):
    """Rows ``rows [BC]`` of a ``[B, T, H, N]`` tensor as fp32 ``[BC, BN]`` (0 where ``ok`` or ``m`` is False)."""
    return tl.load(ptr + rows[:, None] * N + o[None, :], mask=ok[:, None] & m[None, :], other=0.).to(tl.float32)


@triton.jit
def _per_token(ptr, rows, ok, other, HAS: tl.constexpr):
    """A per-head input at ``rows`` as fp32 ``[BC]`` (``other`` where ``ok`` is False; without one,
    1 on the chunk's tokens and ``other`` past them)."""
    if HAS:
        return tl.load(ptr + rows, mask=ok, other=other).to(tl.float32)
    else:
        return tl.where(ok, 1., other)


@triton.jit
def _two_sum(a_hi, a_lo, b_hi, b_lo):
    """A scan's step of a sum carried with its rounding error: (hi, lo) with hi + lo the exact sum of
    a_hi + b_hi (Knuth's two-sum) plus the operands' errors."""
    s = a_hi + b_hi
    bb = s - a_hi
    return s, a_lo + b_lo + ((a_hi - (s - bb)) + (b_hi - bb))


@triton.jit
def _log_sums(c):
    """g = cumsum(log c) over the chunk (log c clamped, ``tiles.log_decay``) as (rounded sums, their
    rounding errors): ``_coefs``' comment says why."""
    return tl.associative_scan((log_decay(c), tl.zeros_like(c)), 0, _two_sum)


@triton.jit
def _coefs(c, o_c, BC: tl.constexpr, HAS_DEC: tl.constexpr, AT_ANCHOR: tl.constexpr):
    """The chunk's weights of its anchors from each token's decay ``c [BC]`` (1 past the chunk): the
    running weights W_t = al_t P - sum_{s<=t} Dm[t, s] eta_s G_s, G_s the gradient at P of token s.
    A decay of the running weights (HAS_DEC): g = cumsum(log c) (log c clamped: ``tiles.log_decay``; every
    exponent a later sum minus an earlier one, <= 0), al = e^g, Dm[t, s] = e^(g_t - g_s);
    weight decay at the anchors (AT_ANCHOR, W_t = W_{t-1} - (1 - c_t) P - ...): al = 1 - cumsum(1 - c),
    Dm = 1; none: al = 1, Dm = 1; Dm is 0 above its diagonal. Returns (g, al, Dm, the weights after the
    chunk's last token: aL = al_{BC-1}, dL = Dm[BC-1, :])."""
    tri = o_c[:, None] >= o_c[None, :]
    last = o_c == BC - 1
    if HAS_DEC and not AT_ANCHOR:
        # g as a rounded sum and its rounding error (hi + lo): tiny decays make |g| hundreds, and a
        # difference of two rounded sums over ordinary decays after them would carry their rounding
        # (ulp(300) ~ 3e-5) as every factor's error; hi_t - hi_s is exact where the sums are close
        hi, lo = _log_sums(c)
        hl = tl.sum(tl.where(last, hi, 0.), axis=0)
        ll = tl.sum(tl.where(last, lo, 0.), axis=0)
        b_d = tl.where(tri, (hi[:, None] - hi[None, :]) + (lo[:, None] - lo[None, :]), float("-inf"))
        g = hi + lo
        return g, tl.exp(g), tl.exp(b_d), tl.exp(hl + ll), tl.exp((hl - hi) + (ll - lo))
    elif HAS_DEC:
        al = 1. - tl.cumsum(1. - c, axis=0)
        return (c, al, tl.where(tri, 1., 0.), tl.sum(tl.where(last, al, 0.), axis=0), tl.full(c.shape, 1., tl.float32))
    else:
        one = tl.full(c.shape, 1., tl.float32)
        return c, one, tl.where(tri, 1., 0.), tl.sum(tl.where(last, one, 0.), axis=0), one


@triton.jit
def _terms(b_p1, b_p2, b_k, b_x, b_eta, b_rw, m_h, ACT: tl.constexpr, PSI: tl.constexpr, PREC: tl.constexpr):
    """One key's gradient terms of a chunk at the anchors ``P1, P2T``, a row per token: Z = K P1^T,
    A = act(Z), R = A P2^T - X, S = w . psi(R), E = S P2, GZ = eta (E . act'(Z)), SE = eta S.
    Returns (Z, A, act'(Z), act''(Z), R, S, E, GZ, SE)."""
    b_z = tl.dot(b_k, tl.trans(b_p1), input_precision=PREC)
    b_a, b_a1, b_a2 = _act(b_z, ACT)
    b_a = tl.where(m_h[None, :], b_a, 0.)
    b_r = tl.dot(b_a, b_p2, input_precision=PREC) - b_x
    b_s = _psi(b_r, b_x, b_rw, PSI)
    b_e = tl.dot(b_s, tl.trans(b_p2), input_precision=PREC)
    return b_z, b_a, b_a1, b_a2, b_r, b_s, b_e, b_eta[:, None] * b_e * b_a1, b_eta[:, None] * b_s


@triton.jit
def _inputs(x, k, rw, k2, x2, rows, ok, o_d, m_d, o_m, m_m, D, M, HAS_RW: tl.constexpr, TWO: tl.constexpr):
    """A chunk's keys and targets as tiles (K, X, K2, X2: the second pair zeros without TWO) and its row
    weight ``[BC, BD]`` (1 without one)."""
    b_k, b_x = _tile(k, rows, ok, o_m, m_m, M), _tile(x, rows, ok, o_d, m_d, D)
    if TWO:
        b_k2, b_x2 = _tile(k2, rows, ok, o_m, m_m, M), _tile(x2, rows, ok, o_d, m_d, D)
    else:
        b_k2, b_x2 = b_k, b_x
    if HAS_RW:
        b_rw = _tile(rw, rows, ok, o_d, m_d, D)
    else:
        b_rw = tl.full([], 1., tl.float32)
    return b_k, b_x, b_k2, b_x2, b_rw


@triton.jit
def _chunk_rows(bos, i_h, i_c, T, H, C: tl.constexpr, BC: tl.constexpr):
    """Chunk ``i_c``'s token offsets ``[BC]``, row ids (int64) and which rows are tokens of it."""
    tl.static_assert(BC >= C, "the chunk's block must hold its C tokens")
    o_c = tl.arange(0, BC)
    t = i_c * C + o_c
    ok = (o_c < C) & (t < T)
    return o_c, (bos + t).to(tl.int64) * H + i_h, ok


@tune(_CHUNK_CONFIGS, key=_CHUNK_KEY + ["STORE", "STORE_T"], prune=_chunk_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def mlp_chunk_fwd_kernel(x, k, q, eta, rw, dec, k2, x2, w1, w2, y, w1t, w2t, ck1, ck2, cu, co, T, NT,
                         H: tl.constexpr, D: tl.constexpr, M: tl.constexpr, HID: tl.constexpr, C: tl.constexpr,
                         BC: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, ACT: tl.constexpr,
                         PSI: tl.constexpr, HAS_ETA: tl.constexpr, HAS_RW: tl.constexpr, HAS_DEC: tl.constexpr,
                         AT_ANCHOR: tl.constexpr, TWO: tl.constexpr, STORE: tl.constexpr, STORE_T: tl.constexpr,
                         PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Sequential over chunks of C tokens from the anchors P (``_coefs``, ``_terms``):

        Zq = al . Q P1^T - (Dm . Q K^T) GZ,  Aq = act(Zq),  Y = al . Aq P2^T - (Dm . Aq A^T) SE
        P1 <- aL P1 - GZ^T diag(dL) K,       P2T <- aL P2T - A^T diag(dL) SE

    (a second key and target, TWO: their terms join each sum). STORE (training): every chunk's anchors
    (``ck1 [B*H, NT, h, m]``, ``ck2 [B*H, NT, d, h]``), which the backward reads; STORE_T: the final
    weights. VARLEN: program ``i_b`` runs sequence ``i_b`` of a packed row (``seq_state``)."""
    i_bh, i_b, i_h, o_d, m_d, o_m, m_m, o_h, m_h, p1, m1, p2, m2 = _program(H, D, M, HID, BD, BM, BH)
    b_p1, b_p2 = _weights(w1, w2, i_bh, p1, m1, p2, m2, D, M, HID, True, BD, BM, BH)
    bos, T, NT, c0 = seq_state(cu, co, i_b, i_h, T, NT, H, C, VARLEN)
    for i_c in range(NT):
        if STORE:
            _put(ck1, ck2, c0 + i_c, b_p1, b_p2, p1, m1, p2, m2, D, M, HID)
        o_c, rows, ok = _chunk_rows(bos, i_h, i_c, T, H, C, BC)
        b_k, b_x, b_k2, b_x2, b_rw = _inputs(x, k, rw, k2, x2, rows, ok, o_d, m_d, o_m, m_m, D, M, HAS_RW, TWO)
        b_q = _tile(q, rows, ok, o_m, m_m, M)
        b_eta = _per_token(eta, rows, ok, 0., HAS_ETA)
        _, b_al, b_dm, b_aL, b_dL = _coefs(_per_token(dec, rows, ok, 1., HAS_DEC), o_c, BC, HAS_DEC, AT_ANCHOR)
        _, b_a, _, _, _, _, _, b_gz, b_se = _terms(b_p1, b_p2, b_k, b_x, b_eta, b_rw, m_h, ACT, PSI, PREC)
        b_zq = b_al[:, None] * tl.dot(b_q, tl.trans(b_p1), input_precision=PREC)
        b_zq -= tl.dot(b_dm * tl.dot(b_q, tl.trans(b_k), input_precision=PREC), b_gz, input_precision=PREC)
        if TWO:
            _, b_a2, _, _, _, _, _, b_gz2, b_se2 = _terms(b_p1, b_p2, b_k2, b_x2, b_eta, b_rw, m_h, ACT, PSI, PREC)
            b_zq -= tl.dot(b_dm * tl.dot(b_q, tl.trans(b_k2), input_precision=PREC), b_gz2, input_precision=PREC)
        b_aq, _, _ = _act(b_zq, ACT)
        b_aq = tl.where(m_h[None, :], b_aq, 0.)
        b_y = b_al[:, None] * tl.dot(b_aq, b_p2, input_precision=PREC)
        b_y -= tl.dot(b_dm * tl.dot(b_aq, tl.trans(b_a), input_precision=PREC), b_se, input_precision=PREC)
        b_p1 = b_aL * b_p1 - tl.dot(tl.trans(b_gz * b_dL[:, None]), b_k, input_precision=PREC)
        b_p2 = b_aL * b_p2 - tl.dot(tl.trans(b_a * b_dL[:, None]), b_se, input_precision=PREC)
        if TWO:
            b_y -= tl.dot(b_dm * tl.dot(b_aq, tl.trans(b_a2), input_precision=PREC), b_se2, input_precision=PREC)
            b_p1 -= tl.dot(tl.trans(b_gz2 * b_dL[:, None]), b_k2, input_precision=PREC)
            b_p2 -= tl.dot(tl.trans(b_a2 * b_dL[:, None]), b_se2, input_precision=PREC)
        tl.store(y + rows[:, None] * D + o_d[None, :], b_y.to(y.dtype.element_ty), mask=ok[:, None] & m_d[None, :])
    if STORE_T:
        _put(w1t, w2t, i_bh, b_p1, b_p2, p1, m1, p2, m2, D, M, HID)


@triton.jit
def _end_key(b_g1, b_g2, b_k, b_a, b_gz, b_se, b_dL, PREC: tl.constexpr):
    """One key's share of the end weights' adjoint (G1, G2 those of the weights after the chunk) through
    their terms -GZ^T diag(dL) K and -A^T diag(dL) SE: (dK, dGZ, dA, dSE: this key's, started; d dL)."""
    b_kg = tl.dot(b_k, tl.trans(b_g1), input_precision=PREC)
    b_ag = tl.dot(b_a, b_g2, input_precision=PREC)
    b_ddl = -tl.sum(b_gz * b_kg, axis=1) - tl.sum(b_se * b_ag, axis=1)
    return (-b_dL[:, None] * tl.dot(b_gz, b_g1, input_precision=PREC), -b_dL[:, None] * b_kg,
            -b_dL[:, None] * tl.dot(b_se, tl.trans(b_g2), input_precision=PREC), -b_dL[:, None] * b_ag, b_ddl)


@triton.jit
def _readout_key(b_dy, b_dzq, b_q, b_aq, b_k, b_gz, b_qk, b_aa, b_dma, b_dm, b_dq, b_dd, b_dk, b_dgz, b_da, b_dse,
                 PREC: tl.constexpr):
    """One key's share of the readout's adjoint (the terms -(Dm . QK) GZ of Zq and -(Dm . AA) SE of Y,
    QK = Q K^T, AA = Aq A^T, with dMa = -dY SE^T), with dZq known, added to (dQ, dD: Dm's adjoint; dK,
    dGZ, dA, dSE: this key's)."""
    b_dmq = -tl.dot(b_dzq, tl.trans(b_gz), input_precision=PREC)
    b_dgz -= tl.dot(tl.trans(b_dm * b_qk), b_dzq, input_precision=PREC)
    b_dq += tl.dot(b_dmq * b_dm, b_k, input_precision=PREC)
    b_dk += tl.dot(tl.trans(b_dmq * b_dm), b_q, input_precision=PREC)
    b_dse -= tl.dot(tl.trans(b_dm * b_aa), b_dy, input_precision=PREC)
    b_da += tl.dot(tl.trans(b_dma * b_dm), b_aq, input_precision=PREC)
    b_dd += b_dmq * b_qk + b_dma * b_aa
    return b_dq, b_dd, b_dk, b_dgz, b_da, b_dse


@triton.jit
def _key_adjoint(b_g1, b_g2, b_p1, b_p2, b_k, b_x, b_rw, b_eta, b_z, b_r, b_e, b_dk, b_dgz, b_da, b_dse, m_h,
                 ACT: tl.constexpr, PSI: tl.constexpr, PREC: tl.constexpr):
    """The rest of one key's adjoint: ``_terms``' at the anchors (its Z, R, E kept: the rest is
    elementwise), from the adjoints of its GZ, SE and A. Adds the anchors' share to ``G1, G2``; returns
    (G1, G2, dK, dX, dw, d eta)."""
    b_a, b_a1, b_a2 = _act(b_z, ACT)
    b_a = tl.where(m_h[None, :], b_a, 0.)
    b_s = _psi(b_r, b_x, b_rw, PSI)
    # GZ = eta (E . act'(Z)), SE = eta S, E = S P2
    b_deta = tl.sum(b_dse * b_s, axis=1) + tl.sum(b_dgz * b_e * b_a1, axis=1)
    b_de = b_dgz * b_eta[:, None] * b_a1
    b_dz = b_dgz * b_eta[:, None] * b_e * b_a2
    b_ds = b_eta[:, None] * b_dse + tl.dot(b_de, b_p2, input_precision=PREC)
    b_g2 += tl.dot(tl.trans(b_de), b_s, input_precision=PREC)
    # S = w . psi(R), R = A P2^T - X, A = act(Z), Z = K P1^T
    b_dr, b_dx, b_dw = _psi_adjoint(b_ds, b_r, b_x, b_rw, PSI)
    b_da += tl.dot(b_dr, tl.trans(b_p2), input_precision=PREC)
    b_g2 += tl.dot(tl.trans(b_a), b_dr, input_precision=PREC)
    b_dz = tl.where(m_h[None, :], b_dz + b_da * b_a1, 0.)
    b_dk += tl.dot(b_dz, b_p1, input_precision=PREC)
    b_g1 += tl.dot(tl.trans(b_dz), b_k, input_precision=PREC)
    return b_g1, b_g2, b_dk, b_dx, b_dw, b_deta


@tune(_CHUNK_CONFIGS, key=_CHUNK_KEY + ["HAS_DHT", "STORE_DH0"], prune=_chunk_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def mlp_chunk_bwd_kernel(x, k, q, eta, rw, dec, k2, x2, dy, ck1, ck2, dw1t, dw2t, dx, dk, dq, deta, drw, ddec, dk2,
                         dx2, dw1, dw2, xs, xs0, cu, co, T, NT, H: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
                         HID: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
                         BH: tl.constexpr, ACT: tl.constexpr, PSI: tl.constexpr, HAS_ETA: tl.constexpr,
                         HAS_RW: tl.constexpr, HAS_DEC: tl.constexpr, AT_ANCHOR: tl.constexpr, TWO: tl.constexpr,
                         HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """The chunks in reverse, each from its stored anchors (no replay): the chunk's forward again, then
    its adjoint. G1, G2: the adjoints of the weights after the chunk (the final weights' for the last),
    read first where the end weights aL P - ... reach the chunk's terms (``_end_key``), then turned in
    place into the adjoints of its anchors, which are the previous chunk's end weights: the first
    chunk's is the initial weights' gradient (two [h, m]-sized tiles carried, not four). The decay's
    gradient: through g (``_coefs``: d log c is the reverse cumulative sum of dg, dc = d log c / c;
    a chunk holding a tiny or zero decay keeps its coefficients in ``xs, xs0`` for ``mlp_chunk_exact_dc_kernel``);
    weight decay's, through al = 1 - cumsum(1 - c)."""
    i_bh, i_b, i_h, o_d, m_d, o_m, m_m, o_h, m_h, p1, m1, p2, m2 = _program(H, D, M, HID, BD, BM, BH)
    b_g1, b_g2 = _weights(dw1t, dw2t, i_bh, p1, m1, p2, m2, D, M, HID, HAS_DHT, BD, BM, BH)
    bos, T, NT, c0 = seq_state(cu, co, i_b, i_h, T, NT, H, C, VARLEN)
    for i in range(NT):
        i_c = NT - 1 - i
        b_p1, b_p2 = _weights(ck1, ck2, c0 + i_c, p1, m1, p2, m2, D, M, HID, True, BD, BM, BH)
        o_c, rows, ok = _chunk_rows(bos, i_h, i_c, T, H, C, BC)
        b_k, b_x, b_k2, b_x2, b_rw = _inputs(x, k, rw, k2, x2, rows, ok, o_d, m_d, o_m, m_m, D, M, HAS_RW, TWO)
        b_q = _tile(q, rows, ok, o_m, m_m, M)
        b_dy = _tile(dy, rows, ok, o_d, m_d, D)
        b_eta = _per_token(eta, rows, ok, 0., HAS_ETA)
        b_c = _per_token(dec, rows, ok, 1., HAS_DEC)
        b_g, b_al, b_dm, b_aL, b_dL = _coefs(b_c, o_c, BC, HAS_DEC, AT_ANCHOR)
        # the forward's terms again, and the end weights' adjoint through them
        b_z, b_a, _, _, b_r, _, b_e, b_gz, b_se = _terms(b_p1, b_p2, b_k, b_x, b_eta, b_rw, m_h, ACT, PSI, PREC)
        b_dk, b_dgz, b_da, b_dse, b_ddl = _end_key(b_g1, b_g2, b_k, b_a, b_gz, b_se, b_dL, PREC)
        if TWO:
            b_z2, b_a_2, _, _, b_r2, _, b_e2, b_gz2, b_se2 = _terms(b_p1, b_p2, b_k2, b_x2, b_eta, b_rw, m_h, ACT, PSI,
                                                                    PREC)
            b_dk2, b_dgz2, b_da2, b_dse2, b_ddl2 = _end_key(b_g1, b_g2, b_k2, b_a_2, b_gz2, b_se2, b_dL, PREC)
            b_ddl += b_ddl2
        b_dal_last = tl.sum(tl.sum(b_g1 * b_p1, axis=1), axis=0) + tl.sum(tl.sum(b_g2 * b_p2, axis=1), axis=0)
        b_g1 = b_aL * b_g1
        b_g2 = b_aL * b_g2
        # the readout: Y = al . Aq P2^T - (Dm . Aq A^T) SE, Zq = al . Q P1^T - (Dm . Q K^T) GZ
        b_qp = tl.dot(b_q, tl.trans(b_p1), input_precision=PREC)
        b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        b_zq = b_al[:, None] * b_qp - tl.dot(b_dm * b_qk, b_gz, input_precision=PREC)
        if TWO:
            b_qk2 = tl.dot(b_q, tl.trans(b_k2), input_precision=PREC)
            b_zq -= tl.dot(b_dm * b_qk2, b_gz2, input_precision=PREC)
        b_aq, b_aq1, _ = _act(b_zq, ACT)
        b_aq = tl.where(m_h[None, :], b_aq, 0.)
        b_dal = tl.sum(b_dy * tl.dot(b_aq, b_p2, input_precision=PREC), axis=1)
        b_g2 += tl.dot(tl.trans(b_aq), b_al[:, None] * b_dy, input_precision=PREC)
        b_daq = b_al[:, None] * tl.dot(b_dy, tl.trans(b_p2), input_precision=PREC)
        b_dd = tl.zeros([BC, BC], dtype=tl.float32)
        b_aa = tl.dot(b_aq, tl.trans(b_a), input_precision=PREC)
        b_dma = -tl.dot(b_dy, tl.trans(b_se), input_precision=PREC)
        b_daq += tl.dot(b_dma * b_dm, b_a, input_precision=PREC)
        if TWO:
            b_aa2 = tl.dot(b_aq, tl.trans(b_a_2), input_precision=PREC)
            b_dma2 = -tl.dot(b_dy, tl.trans(b_se2), input_precision=PREC)
            b_daq += tl.dot(b_dma2 * b_dm, b_a_2, input_precision=PREC)
        b_dzq = tl.where(m_h[None, :], b_daq * b_aq1, 0.)
        b_g1 += tl.dot(tl.trans(b_al[:, None] * b_dzq), b_q, input_precision=PREC)
        b_dq = b_al[:, None] * tl.dot(b_dzq, b_p1, input_precision=PREC)
        b_dal += tl.sum(b_dzq * b_qp, axis=1)
        b_dq, b_dd, b_dk, b_dgz, b_da, b_dse = _readout_key(b_dy, b_dzq, b_q, b_aq, b_k, b_gz, b_qk, b_aa, b_dma,
                                                            b_dm, b_dq, b_dd, b_dk, b_dgz, b_da, b_dse, PREC)
        if TWO:
            b_dq, b_dd, b_dk2, b_dgz2, b_da2, b_dse2 = _readout_key(
                b_dy, b_dzq, b_q, b_aq, b_k2, b_gz2, b_qk2, b_aa2, b_dma2, b_dm, b_dq, b_dd, b_dk2, b_dgz2, b_da2, b_dse2,
                PREC)
        tl.store(dq + rows[:, None] * M + o_m[None, :], b_dq.to(dq.dtype.element_ty), mask=ok[:, None] & m_m[None, :])
        # the gradient terms at the anchors
        b_g1, b_g2, b_dk, b_dx, b_dw, b_deta = _key_adjoint(b_g1, b_g2, b_p1, b_p2, b_k, b_x, b_rw, b_eta, b_z, b_r,
                                                            b_e, b_dk, b_dgz, b_da, b_dse, m_h, ACT, PSI, PREC)
        tl.store(dk + rows[:, None] * M + o_m[None, :], b_dk.to(dk.dtype.element_ty), mask=ok[:, None] & m_m[None, :])
        tl.store(dx + rows[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=ok[:, None] & m_d[None, :])
        if TWO:
            b_g1, b_g2, b_dk2, b_dx2, b_dw2, b_deta2 = _key_adjoint(b_g1, b_g2, b_p1, b_p2, b_k2, b_x2, b_rw, b_eta,
                                                                    b_z2, b_r2, b_e2, b_dk2, b_dgz2, b_da2, b_dse2,
                                                                    m_h, ACT, PSI, PREC)
            tl.store(dk2 + rows[:, None] * M + o_m[None, :], b_dk2.to(dk2.dtype.element_ty),
                     mask=ok[:, None] & m_m[None, :])
            tl.store(dx2 + rows[:, None] * D + o_d[None, :], b_dx2.to(dx2.dtype.element_ty),
                     mask=ok[:, None] & m_d[None, :])
            b_dw += b_dw2
            b_deta += b_deta2
        if HAS_ETA:
            tl.store(deta + rows, b_deta.to(deta.dtype.element_ty), mask=ok)
        if HAS_RW:
            tl.store(drw + rows[:, None] * D + o_d[None, :], b_dw.to(drw.dtype.element_ty),
                     mask=ok[:, None] & m_d[None, :])
        if HAS_DEC:
            last = o_c == BC - 1
            if AT_ANCHOR:
                # al = 1 - cumsum(lam), lam = 1 - c: d lam = -revcumsum(d al), dc = -d lam
                b_dc = tl.cumsum(b_dal + tl.where(last, b_dal_last, 0.), axis=0, reverse=True)
            else:
                # al = e^g, Dm = e^(g_t - g_s), dL = e^(gL - g): dg, then d log c = revcumsum(dg) and
                # dc = d log c / c. A chunk holding a decay under e^LOG_EXACT_DA keeps the factors'
                # coefficients (``_exact_dc``): the second launch takes its dc term by term
                b_ddm = b_dd * b_dm
                b_dg = b_dal * b_al + tl.sum(b_ddm, axis=1) - tl.sum(b_ddm, axis=0) - b_ddl * b_dL
                b_dg += tl.where(last, b_dal_last * b_aL + tl.sum(b_ddl * b_dL, axis=0), 0.)
                b_dc = tl.cumsum(b_dg, axis=0, reverse=True) / b_c
                _keep_coefs(xs, xs0, c0 + i_c, b_c, b_dd, b_dal, b_ddl, b_dal_last, o_c, C)
            tl.store(ddec + rows, b_dc.to(ddec.dtype.element_ty), mask=ok)
    if STORE_DH0:
        _put(dw1, dw2, i_bh, b_g1, b_g2, p1, m1, p2, m2, D, M, HID)


@triton.jit
def _keep_coefs(xs, xs0, i_n, b_c, b_dd, b_dal, b_ddl, b_dal_last, o_c, C: tl.constexpr):
    """Where the chunk holds a decay below e^LOG_EXACT_DA, its decay factors' coefficients for
    ``mlp_chunk_exact_dc_kernel``, chunk ``i_n`` of ``xs [*, C, C]`` (dD) and ``xs0 [*, 2, C]`` (d al,
    with d aL on the row of token C - 1, whose sum is the chunk's last; the end weights' d dL); masked
    stores of tiles the backward holds anyway, so that the common chunk's code is as without them."""
    keep = tl.where(o_c < C, tl.min(log_decay(b_c), axis=0), 0.) < LOG_EXACT_DA    # the rows of its C tokens
    tl.store(xs + (i_n * C + o_c[:, None]) * C + o_c[None, :], b_dd, mask=keep[:, None] & (o_c < C)[None, :])
    tl.store(xs0 + i_n * 2 * C + o_c, b_dal + tl.where(o_c == C - 1, b_dal_last, 0.), mask=keep)
    tl.store(xs0 + (i_n * 2 + 1) * C + o_c, b_ddl, mask=keep)


@triton.jit(do_not_specialize=["T", "NT"])
def mlp_chunk_exact_dc_kernel(dec, xs, xs0, ddec, cu, co, T, NT, H: tl.constexpr, C: tl.constexpr,
                              BC: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """The second launch of a decay's gradient: the chunks holding a decay below e^LOG_EXACT_DA (the
    others only read their decays) rewrite dc term by term, where the backward's d log c / c has lost
    its digits (and is NaN at c = 0): each factor's coefficient (``_keep_coefs``) times the product of
    the other decays in its span, c_r left out (``tiles.pair_decay_grad``; Dm's, and al's from the
    chunk's start). A kernel apart: in the backward, this code made ptxas spill more in every chunk."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    bos, T, NT, c0 = seq_state(cu, co, i_b, i_h, T, NT, H, C, VARLEN)
    for i_c in range(NT):
        o_c, rows, ok = _chunk_rows(bos, i_h, i_c, T, H, C, BC)
        b_c = tl.load(dec + rows, mask=ok, other=1.).to(tl.float32)
        b_la = log_decay(b_c)
        if tl.min(b_la, axis=0) < LOG_EXACT_DA:
            i_n = c0 + i_c
            m_c = o_c < C
            X = tl.load(xs + (i_n * C + o_c[:, None]) * C + o_c[None, :], mask=m_c[:, None] & m_c[None, :], other=0.)
            # the end weights' dL = Dm[last, :]: their coefficients join the row of token C - 1
            X += tl.where((o_c == C - 1)[:, None], tl.load(xs0 + (i_n * 2 + 1) * C + o_c, mask=m_c, other=0.)[None, :],
                          0.)
            x0 = tl.load(xs0 + i_n * 2 * C + o_c, mask=m_c, other=0.)
            hi, lo = _log_sums(b_c)
            b_g = hi + lo
            b_gp = b_g - b_la
            E = decay_before(b_g, b_gp, o_c, o_c)
            F = decay_after(b_g, b_g, o_c[:, None] >= o_c[None, :], o_c[:, None] == o_c[None, :])
            b_dc = pair_decay_grad(X, x0, F, E, b_gp, PREC)
            tl.store(ddec + rows, b_dc.to(ddec.dtype.element_ty), mask=ok)
