"""The Triton kernels of the MLP memory: the sequential forward and the backward that walks each
chunk back from its end state; the algorithm, shapes and host code are in
``ssmcraft.ops.mlp_memory.recurrent``.

Tiles, one program per (batch, head), fp32 in registers: ``W1 [BH, BM]`` as declared (``[h, m]``) and
``W2`` transposed, ``W2T [BH, BD]``, so both have the hidden width on their rows: every vector over
h is a row vector of both and no layout conversion sits in the step's chain. Padded rows and
columns stay zero (the activation of a padded hidden unit is masked: ``sigmoid(0)`` is not 0).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.rows import seq_state
from ssmcraft.ops.common.tuning import tune

# ``ACT``: the activation (``recurrent.ACTIVATIONS`` names them; the host passes ``.value``)
SILU, TANH, SIGMOID = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)

_WARPS = [triton.Config({}, num_warps=w) for w in (4, 8, 16)]


@triton.jit
def _act(z, ACT: tl.constexpr):
    """(act(z), act'(z), act''(z)) elementwise."""
    if ACT == SILU:
        s = tl.sigmoid(z)
        ds = s * (1. - s)
        return z * s, s + z * ds, ds * (2. + z * (1. - 2. * s))
    elif ACT == TANH:
        a = 2. * tl.sigmoid(2. * z) - 1.
        da = 1. - a * a
        return a, da, -2. * a * da
    else:
        s = tl.sigmoid(z)
        ds = s * (1. - s)
        return s, ds, ds * (1. - 2. * s)


@triton.jit
def _vec(ptr, row, o, m, N):
    """Row ``row`` of a ``[B, T, H, N]`` tensor as fp32 ``[BN]`` (0 past N, or where ``m`` is False)."""
    return tl.load(ptr + row * N + o, mask=m, other=0.).to(tl.float32)


@triton.jit
def _opt_vec(ptr, row, o, m, N, HAS: tl.constexpr):
    """``_vec`` when ``HAS`` (the second key and target), else zeros (nothing read)."""
    if HAS:
        return tl.load(ptr + row * N + o, mask=m, other=0.).to(tl.float32)
    else:
        return tl.zeros(o.shape, dtype=tl.float32)


@triton.jit
def _row_weight(w, row, o_d, m, D, HAS_RW: tl.constexpr):
    """Token ``row``'s weight of each output row ``[BD]`` as fp32 (1 without one; nothing read where ``m``
    is False)."""
    if HAS_RW:
        return tl.load(w + row * D + o_d, mask=m, other=0.).to(tl.float32)
    else:
        return tl.full([], 1., tl.float32)


@triton.jit
def _step_of(eta, row, ok, HAS_ETA: tl.constexpr):
    """Token ``row``'s step as fp32 (1 without one; nothing read where ``ok`` is False)."""
    if HAS_ETA:
        return tl.load(eta + row, mask=ok, other=1.).to(tl.float32)
    else:
        return tl.full([], 1., tl.float32)      # a tensor: the kernels carry it through their loops


@triton.jit
def _program(H, D, M, HID, BD: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr):
    """This program's index ``i_bh`` (int64) and (batch or sequence, head) ``i_b, i_h``; offsets and
    masks ``o_d, m_d [BD]``, ``o_m, m_m [BM]``, ``o_h, m_h [BH]``; and those of a pair of weights:
    ``p1, m1`` of ``W1 [h, m]`` as the ``[BH, BM]`` tile, ``p2, m2`` of ``W2 [d, h]`` as ``W2T [BH, BD]``."""
    i_bh = tl.program_id(0)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    o_h = tl.arange(0, BH)
    m_d, m_m, m_h = o_d < D, o_m < M, o_h < HID
    return (i_bh.to(tl.int64), i_bh // H, i_bh % H, o_d, m_d, o_m, m_m, o_h, m_h, o_h[:, None] * M + o_m[None, :],
            m_h[:, None] & m_m[None, :], o_d[None, :] * HID + o_h[:, None], m_h[:, None] & m_d[None, :])


@triton.jit
def _weights(w1, w2, i, p1, m1, p2, m2, D, M, HID, HAS: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
             BH: tl.constexpr):
    """Pair ``i`` of weights ``w1 [*, h, m]``, ``w2 [*, d, h]`` as fp32 tiles ``W1 [BH, BM]``, ``W2T [BH, BD]``
    when ``HAS``, else zeros (nothing read): initial weights, chunk end states, final weights' gradients."""
    if HAS:
        return (tl.load(w1 + i * HID * M + p1, mask=m1, other=0.).to(tl.float32),
                tl.load(w2 + i * D * HID + p2, mask=m2, other=0.).to(tl.float32))
    else:
        return tl.zeros([BH, BM], dtype=tl.float32), tl.zeros([BH, BD], dtype=tl.float32)


@triton.jit
def _put(w1, w2, i, b_w1, b_w2, p1, m1, p2, m2, D, M, HID):
    """Store the tiles ``W1``, ``W2T`` as pair ``i`` of ``w1 [*, h, m]``, ``w2 [*, d, h]`` (``_weights``' inverse)."""
    tl.store(w1 + i * HID * M + p1, b_w1, mask=m1)
    tl.store(w2 + i * D * HID + p2, b_w2, mask=m2)


@triton.jit
def _grad(b_w1, b_w2, b_k, b_x, b_eta, b_rw, m_h, ACT: tl.constexpr):
    """One key's gradient terms at the weights ``W1, W2T``: z = W1 k, a = act(z), r = W2 a - x,
    s = w . r, e = W2^T s, gz = eta (e . act'(z)). Returns (z, a, r, s, e, gz)."""
    b_z = tl.sum(b_w1 * b_k[None, :], axis=1)
    b_a, b_a1, _ = _act(b_z, ACT)
    b_a = tl.where(m_h, b_a, 0.)
    b_r = tl.sum(b_w2 * b_a[:, None], axis=0) - b_x
    b_s = b_r * b_rw
    b_e = tl.sum(b_w2 * b_s[None, :], axis=1)
    return b_z, b_a, b_r, b_s, b_e, b_eta * b_e * b_a1


@triton.jit
def _step(b_w1, b_w2, b_k, b_x, b_k2, b_x2, b_eta, b_rw, b_c, m_h, ACT: tl.constexpr, HAS_DEC: tl.constexpr,
          TWO: tl.constexpr):
    """One token's step from the previous weights (``_grad`` of each key at them): W1 <- c W1 - gz k^T,
    W2 <- c W2 - eta s a^T (c: the decay, HAS_DEC), and with a second key and target (TWO) its terms
    too. Returns (W1, W2T, z, r, e, gz, z2, r2, e2, gz2) (the second key's equal the first's without
    TWO)."""
    b_z, b_a, b_r, b_s, b_e, b_gz = _grad(b_w1, b_w2, b_k, b_x, b_eta, b_rw, m_h, ACT)
    if TWO:
        b_z2, b_a2, b_r2, b_s2, b_e2, b_gz2 = _grad(b_w1, b_w2, b_k2, b_x2, b_eta, b_rw, m_h, ACT)
    else:
        b_z2, b_a2, b_r2, b_s2, b_e2, b_gz2 = b_z, b_a, b_r, b_s, b_e, b_gz
    if HAS_DEC:
        b_w1 = b_c * b_w1
        b_w2 = b_c * b_w2
    b_w1 -= b_gz[:, None] * b_k[None, :]
    b_w2 -= (b_eta * b_a)[:, None] * b_s[None, :]
    if TWO:
        b_w1 -= b_gz2[:, None] * b_k2[None, :]
        b_w2 -= (b_eta * b_a2)[:, None] * b_s2[None, :]
    return b_w1, b_w2, b_z, b_r, b_e, b_gz, b_z2, b_r2, b_e2, b_gz2


@triton.jit
def _adjoint(b_g1, b_g2, b_w1, b_w2, b_k, b_z, b_r, b_e, b_eta, b_rw, m_h, ACT: tl.constexpr):
    """One key's share of the step's adjoint at the weights before the token (G1, G2 the adjoints of
    the weights after it, G2 kept transposed as W2): dgz = -eta G1 k, de = dgz . act'(z),
    ds = -eta G2 a + W2 de, dr = w . ds, da = -eta G2^T s + W2^T dr, dz = dgz . e . act''(z) + da . act'(z).
    Returns (dk, dr, ds, d eta, dz, de, s, a); the caller adds dz k^T to G1 and s de^T + dr a^T to G2."""
    b_a, b_a1, b_a2 = _act(b_z, ACT)
    b_a = tl.where(m_h, b_a, 0.)
    b_gz = b_e * b_a1
    b_s = b_r * b_rw
    # (sums over one axis of two tiles taken as one: the step's chain of reductions is its latency)
    b_gk = tl.sum(b_g1 * b_k[None, :], axis=1)
    b_g2s = tl.sum(b_g2 * b_s[None, :], axis=1)
    b_dgz = -b_eta * b_gk
    b_de = b_dgz * b_a1
    b_ds = tl.sum(b_w2 * b_de[:, None] - b_eta * b_g2 * b_a[:, None], axis=0)
    b_dr = b_ds * b_rw
    b_da = -b_eta * b_g2s + tl.sum(b_w2 * b_dr[None, :], axis=1)
    b_dz = b_dgz * b_e * b_a2 + b_da * b_a1
    b_dk = tl.sum(b_w1 * b_dz[:, None] - b_eta * b_g1 * b_gz[:, None], axis=0)
    # d eta = -(gz . G1 k + s . G2 a) = -(gz . G1 k + a . G2^T s)
    return b_dk, b_dr, b_ds, -tl.sum(b_gz * b_gk + b_a * b_g2s, axis=0), b_dz, b_de, b_s, b_a


@tune(_WARPS, key=["H", "D", "M", "HID", "ACT", "HAS_ETA", "HAS_RW", "HAS_DEC", "TWO", "STORE", "STORE_T"])
@triton.jit(do_not_specialize=["T", "NT"])
def mlp_memory_fwd_kernel(x, k, q, eta, rw, dec, k2, x2, w1, w2, y, w1t, w2t, cz, cr, ce, cz2, cr2, ce2, ck1, ck2, cu,
                          co, T, NT,
                          H: tl.constexpr, D: tl.constexpr, M: tl.constexpr, HID: tl.constexpr, BD: tl.constexpr,
                          BM: tl.constexpr, BH: tl.constexpr, CHUNK: tl.constexpr, ACT: tl.constexpr, HAS_ETA: tl.constexpr,
                          HAS_RW: tl.constexpr, HAS_DEC: tl.constexpr, TWO: tl.constexpr, STORE: tl.constexpr,
                          STORE_T: tl.constexpr, VARLEN: tl.constexpr):
    """Sequential over tokens. Per token, with W1, W2 the previous weights, ``_step``:
    z = W1 k, a = act(z), r = W2 a - x, s = w . r, e = W2^T s; W1 <- c W1 - eta (e . act'(z)) k^T,
    W2 <- c W2 - eta s a^T; y = W2 act(W1 q) with the new weights (w: the loss's weight of each output
    row, HAS_RW; else 1 and s = r; c: the per-head decay, HAS_DEC; else 1; TWO: a second key and
    target ``k2, x2``, whose terms at the same previous weights join the step). STORE (training): z, r, e
    (of each key) per token and the weights after every chunk's last token (``ck1 [B*H, NT, h, m]``,
    ``ck2 [B*H, NT, d, h]``), which the backward starts each chunk from. VARLEN: program ``i_b`` runs sequence ``i_b`` of a packed row
    (``cu`` its offsets, ``co`` each sequence's first chunk; ``ssmcraft.ops.common.rows.seq_state``)."""
    i_bh, i_b, i_h, o_d, m_d, o_m, m_m, o_h, m_h, p1, m1, p2, m2 = _program(H, D, M, HID, BD, BM, BH)
    b_w1, b_w2 = _weights(w1, w2, i_bh, p1, m1, p2, m2, D, M, HID, True, BD, BM, BH)
    bos, T, NT, c0 = seq_state(cu, co, i_b, i_h, T, NT, H, CHUNK, VARLEN)
    row = bos.to(tl.int64) * H + i_h
    # each token's inputs are loaded while the previous token's step runs: the step's chain of
    # reductions then never waits on memory
    ok = T > 0
    b_k, b_x = _vec(k, row, o_m, m_m & ok, M), _vec(x, row, o_d, m_d & ok, D)
    b_q, b_eta = _vec(q, row, o_m, m_m & ok, M), _step_of(eta, row, ok, HAS_ETA)
    b_rw, b_c = _row_weight(rw, row, o_d, m_d & ok, D, HAS_RW), _step_of(dec, row, ok, HAS_DEC)
    b_k2, b_x2 = _opt_vec(k2, row, o_m, m_m & ok, M, TWO), _opt_vec(x2, row, o_d, m_d & ok, D, TWO)
    for t in range(T):
        ok = t + 1 < T
        n_k, n_x = _vec(k, row + H, o_m, m_m & ok, M), _vec(x, row + H, o_d, m_d & ok, D)
        n_q, n_eta = _vec(q, row + H, o_m, m_m & ok, M), _step_of(eta, row + H, ok, HAS_ETA)
        n_rw, n_c = _row_weight(rw, row + H, o_d, m_d & ok, D, HAS_RW), _step_of(dec, row + H, ok, HAS_DEC)
        n_k2, n_x2 = _opt_vec(k2, row + H, o_m, m_m & ok, M, TWO), _opt_vec(x2, row + H, o_d, m_d & ok, D, TWO)
        # the readout's W1 q off the step's chain: (c W1 - eta gz k^T) q = c W1 q - eta gz (k . q)
        b_zq = tl.sum(b_w1 * b_q[None, :], axis=1)
        if HAS_DEC:
            b_zq *= b_c
        b_w1, b_w2, b_z, b_r, b_e, b_gz, b_z2, b_r2, b_e2, b_gz2 = _step(b_w1, b_w2, b_k, b_x, b_k2, b_x2, b_eta, b_rw,
                                                                         b_c, m_h, ACT, HAS_DEC, TWO)
        b_zq -= b_gz * tl.sum(b_k * b_q, axis=0)
        if TWO:
            b_zq -= b_gz2 * tl.sum(b_k2 * b_q, axis=0)
        b_aq, _, _ = _act(b_zq, ACT)
        b_aq = tl.where(m_h, b_aq, 0.)
        tl.store(y + row * D + o_d, tl.sum(b_w2 * b_aq[:, None], axis=0).to(y.dtype.element_ty), mask=m_d)
        if STORE:
            tl.store(cz + row * HID + o_h, b_z, mask=m_h)
            tl.store(cr + row * D + o_d, b_r, mask=m_d)
            tl.store(ce + row * HID + o_h, b_e, mask=m_h)
            if TWO:
                tl.store(cz2 + row * HID + o_h, b_z2, mask=m_h)
                tl.store(cr2 + row * D + o_d, b_r2, mask=m_d)
                tl.store(ce2 + row * HID + o_h, b_e2, mask=m_h)
            if ((t + 1) % CHUNK == 0) | (t + 1 == T):
                _put(ck1, ck2, c0 + t // CHUNK, b_w1, b_w2, p1, m1, p2, m2, D, M, HID)
        row += H
        b_k, b_x, b_q, b_eta, b_rw, b_c, b_k2, b_x2 = n_k, n_x, n_q, n_eta, n_rw, n_c, n_k2, n_x2
    if STORE_T:
        _put(w1t, w2t, i_bh, b_w1, b_w2, p1, m1, p2, m2, D, M, HID)


@tune(_WARPS, key=["H", "D", "M", "HID", "ACT", "HAS_ETA", "HAS_RW", "HAS_DEC", "TWO", "HAS_DHT", "STORE_DH0"])
@triton.jit(do_not_specialize=["T", "NT"])
def mlp_memory_bwd_kernel(x, k, q, eta, rw, dec, k2, x2, w1, w2, dy, cz, cr, ce, cz2, cr2, ce2, ck1, ck2, dw1t, dw2t,
                          dx, dk, dq, deta, drw, ddec, dk2, dx2, dw1, dw2, cu, co, T, NT, H: tl.constexpr,
                          D: tl.constexpr, M: tl.constexpr,
                          HID: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, CHUNK: tl.constexpr,
                          ACT: tl.constexpr, HAS_ETA: tl.constexpr, HAS_RW: tl.constexpr, HAS_DEC: tl.constexpr,
                          TWO: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, VARLEN: tl.constexpr):
    """Chunks in reverse, each from the weights after its last token (the forward's checkpoint), token
    by token back to its start: the readout's adjoint at W_t, then W_{t-1} = W_t + eta (e . act'(z))
    k^T and W2_{t-1} = W2_t + eta s a^T from the stored z, r, e (s = w . r), then the step's adjoint
    at W_{t-1} (``_adjoint``, once per key with TWO): G1 += dz k^T, G2 += s de^T + dr a^T. Rounding
    drift of the walk back is bounded by one chunk: every chunk restarts from its stored end state.
    With a decay c (HAS_DEC) the walk back would divide by c, amplifying rounding by 1/c a token, so
    the weights before token t are instead replayed forward (``_step``) from the chunk's start (the
    previous chunk's end state, or the initial weights ``w1, w2``): O(CHUNK) steps a token; the adjoint then scales G1, G2 by c and
    dc = <G1, W1_{t-1}> + <G2, W2_{t-1}>. VARLEN: as the forward."""
    i_bh, i_b, i_h, o_d, m_d, o_m, m_m, o_h, m_h, p1, m1, p2, m2 = _program(H, D, M, HID, BD, BM, BH)
    b_g1, b_g2 = _weights(dw1t, dw2t, i_bh, p1, m1, p2, m2, D, M, HID, HAS_DHT, BD, BM, BH)
    bos, T, NT, c0 = seq_state(cu, co, i_b, i_h, T, NT, H, CHUNK, VARLEN)
    # token t - 1's inputs and stored vectors are loaded while token t's adjoint runs (as the forward)
    row = (bos + T - 1).to(tl.int64) * H + i_h
    ok = T > 0
    b_q, b_dy, b_k = _vec(q, row, o_m, m_m & ok, M), _vec(dy, row, o_d, m_d & ok, D), _vec(k, row, o_m, m_m & ok, M)
    b_z, b_r = _vec(cz, row, o_h, m_h & ok, HID), _vec(cr, row, o_d, m_d & ok, D)
    b_e = _vec(ce, row, o_h, m_h & ok, HID)
    b_eta = _step_of(eta, row, ok, HAS_ETA)
    b_rw, b_c = _row_weight(rw, row, o_d, m_d & ok, D, HAS_RW), _step_of(dec, row, ok, HAS_DEC)
    b_k2, b_z2 = _opt_vec(k2, row, o_m, m_m & ok, M, TWO), _opt_vec(cz2, row, o_h, m_h & ok, HID, TWO)
    b_r2, b_e2 = _opt_vec(cr2, row, o_d, m_d & ok, D, TWO), _opt_vec(ce2, row, o_h, m_h & ok, HID, TWO)
    first = (bos.to(tl.int64) * H + i_h)
    for i in range(NT):
        i_c = NT - 1 - i
        b_w1, b_w2 = _weights(ck1, ck2, c0 + i_c, p1, m1, p2, m2, D, M, HID, True, BD, BM, BH)
        end = tl.minimum(T, (i_c + 1) * CHUNK)
        for j in range(end - i_c * CHUNK):
            t = end - 1 - j
            ok = t > 0
            n_q, n_dy = _vec(q, row - H, o_m, m_m & ok, M), _vec(dy, row - H, o_d, m_d & ok, D)
            n_k, n_z = _vec(k, row - H, o_m, m_m & ok, M), _vec(cz, row - H, o_h, m_h & ok, HID)
            n_r, n_e = _vec(cr, row - H, o_d, m_d & ok, D), _vec(ce, row - H, o_h, m_h & ok, HID)
            n_eta = _step_of(eta, row - H, ok, HAS_ETA)
            n_rw, n_c = _row_weight(rw, row - H, o_d, m_d & ok, D, HAS_RW), _step_of(dec, row - H, ok, HAS_DEC)
            n_k2, n_z2 = _opt_vec(k2, row - H, o_m, m_m & ok, M, TWO), _opt_vec(cz2, row - H, o_h, m_h & ok, HID, TWO)
            n_r2, n_e2 = _opt_vec(cr2, row - H, o_d, m_d & ok, D, TWO), _opt_vec(ce2, row - H, o_h, m_h & ok, HID, TWO)
            # the readout y = W2 act(W1 q) at the weights after token t
            b_aq, b_aq1, _ = _act(tl.sum(b_w1 * b_q[None, :], axis=1), ACT)
            b_aq = tl.where(m_h, b_aq, 0.)
            b_dzq = tl.sum(b_w2 * b_dy[None, :], axis=1) * b_aq1
            tl.store(dq + row * M + o_m, tl.sum(b_w1 * b_dzq[:, None], axis=0).to(dq.dtype.element_ty), mask=m_m)
            b_g1 += b_dzq[:, None] * b_q[None, :]
            b_g2 += b_aq[:, None] * b_dy[None, :]
            # back to the weights before token t
            if HAS_DEC:
                if i_c == 0:
                    b_w1, b_w2 = _weights(w1, w2, i_bh, p1, m1, p2, m2, D, M, HID, True, BD, BM, BH)
                else:
                    b_w1, b_w2 = _weights(ck1, ck2, c0 + i_c - 1, p1, m1, p2, m2, D, M, HID, True, BD, BM, BH)
                for u in range(i_c * CHUNK, t):
                    r_u = first + u * H
                    b_w1, b_w2, _, _, _, _, _, _, _, _ = _step(
                        b_w1, b_w2, _vec(k, r_u, o_m, m_m, M), _vec(x, r_u, o_d, m_d, D),
                        _opt_vec(k2, r_u, o_m, m_m, M, TWO), _opt_vec(x2, r_u, o_d, m_d, D, TWO),
                        _step_of(eta, r_u, True, HAS_ETA), _row_weight(rw, r_u, o_d, m_d, D, HAS_RW),
                        _step_of(dec, r_u, True, HAS_DEC), m_h, ACT, HAS_DEC, TWO)
                tl.store(ddec + row, (tl.sum(tl.sum(b_g1 * b_w1, axis=1), axis=0)
                                      + tl.sum(tl.sum(b_g2 * b_w2, axis=1), axis=0)).to(ddec.dtype.element_ty))
            else:
                b_a, b_a1, _ = _act(b_z, ACT)
                b_w1 += (b_eta * b_e * b_a1)[:, None] * b_k[None, :]
                b_w2 += (b_eta * tl.where(m_h, b_a, 0.))[:, None] * (b_r * b_rw)[None, :]
                if TWO:
                    b_a, b_a1, _ = _act(b_z2, ACT)
                    b_w1 += (b_eta * b_e2 * b_a1)[:, None] * b_k2[None, :]
                    b_w2 += (b_eta * tl.where(m_h, b_a, 0.))[:, None] * (b_r2 * b_rw)[None, :]
            # the step's adjoint at the weights before token t
            b_dk, b_dr, b_ds, b_deta, b_dz, b_de, b_s, b_a = _adjoint(b_g1, b_g2, b_w1, b_w2, b_k, b_z, b_r, b_e, b_eta,
                                                                      b_rw, m_h, ACT)
            tl.store(dk + row * M + o_m, b_dk.to(dk.dtype.element_ty), mask=m_m)
            tl.store(dx + row * D + o_d, (-b_dr).to(dx.dtype.element_ty), mask=m_d)
            b_drw = b_ds * b_r
            if TWO:
                b_dk2, b_dr2, b_ds2, b_deta2, b_dz2, b_de2, b_s2, b_a2 = _adjoint(
                    b_g1, b_g2, b_w1, b_w2, b_k2, b_z2, b_r2, b_e2, b_eta, b_rw, m_h, ACT)
                tl.store(dk2 + row * M + o_m, b_dk2.to(dk2.dtype.element_ty), mask=m_m)
                tl.store(dx2 + row * D + o_d, (-b_dr2).to(dx2.dtype.element_ty), mask=m_d)
                b_deta += b_deta2
                b_drw += b_ds2 * b_r2
            if HAS_ETA:
                tl.store(deta + row, b_deta.to(deta.dtype.element_ty))
            if HAS_RW:
                tl.store(drw + row * D + o_d, b_drw.to(drw.dtype.element_ty), mask=m_d)
            if HAS_DEC:
                b_g1 = b_c * b_g1
                b_g2 = b_c * b_g2
            b_g1 += b_dz[:, None] * b_k[None, :]
            b_g2 += b_de[:, None] * b_s[None, :] + b_a[:, None] * b_dr[None, :]
            if TWO:
                b_g1 += b_dz2[:, None] * b_k2[None, :]
                b_g2 += b_de2[:, None] * b_s2[None, :] + b_a2[:, None] * b_dr2[None, :]
            row -= H
            b_q, b_dy, b_k, b_z, b_r, b_e, b_eta, b_rw, b_c = n_q, n_dy, n_k, n_z, n_r, n_e, n_eta, n_rw, n_c
            b_k2, b_z2, b_r2, b_e2 = n_k2, n_z2, n_r2, n_e2
    if STORE_DH0:
        _put(dw1, dw2, i_bh, b_g1, b_g2, p1, m1, p2, m2, D, M, HID)
