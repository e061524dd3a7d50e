"""The Triton kernels of the MLP memory: the sequential forward and the backward that walks each
chunk back from its end state; the algorithm, shapes and host code are in
``ssmcraft.ops.mlp_memory.recurrent``.

Tiles, one program per (batch, head), fp32 in registers: ``W1 [BH, BM]`` as declared (``[h, m]``) and
``W2`` transposed, ``W2T [BH, BD]``, so both have the hidden width on their rows: every vector over
h is a row vector of both and no layout conversion sits in the step's chain. The sequential kernels
read and write W2 (initial and final weights, checkpoints, gradients) transposed, ``[h, d]``
(``_w2t_offsets``), so that both tiles share one layout. Padded rows and columns stay zero (the
activation of a padded hidden unit is masked: ``sigmoid(0)`` is not 0).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.rows import seq_state
from ssmcraft.ops.common.tuning import tune

# ``ACT``: the activation (``recurrent.ACTIVATIONS`` names them; the host passes ``.value``)
SILU, TANH, SIGMOID = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# ``PSI``: the data term, as its derivative at the prediction (``recurrent.DATA`` names them): the
# regression residual r; a linear term's -x; pseudo-Huber's and Cauchy's r f(u) with u = r_i^2 per
# row (a per-channel loss) or u = sum_i w_i r_i^2 (a loss of the residual's norm)
REG, LIN, HUBER, CAUCHY, HUBER_NORM, CAUCHY_NORM = (tl.constexpr(0), tl.constexpr(1), tl.constexpr(2),
                                                    tl.constexpr(3), tl.constexpr(4), tl.constexpr(5))

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
def _put_ze(ptr, row, b_z, b_e, o_h, m_h, HID):
    """Store token ``row``'s z and e ``[BH]`` in one ``[B, T, H, 2, h]`` array (``_ze`` reads them back)."""
    o_2 = tl.arange(0, 2)
    tl.store(ptr + (row * 2 + o_2[None, :]) * HID + o_h[:, None], tl.join(b_z, b_e), mask=m_h[:, None])


@triton.jit
def _ze(ptr, row, o, m, N, ZE: tl.constexpr, SECOND: tl.constexpr):
    """``_vec`` of z (or e, ``SECOND``) from the forward's stored vectors: their own ``[B, T, H, h]`` arrays,
    or (ZE) both in one ``[B, T, H, 2, h]`` (``_put_ze``), ``ptr`` its start either way."""
    if ZE:
        return tl.load(ptr + (row * 2 + SECOND) * N + o, mask=m, other=0.).to(tl.float32)
    else:
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
def _w2t_offsets(o_d, o_h, D):
    """Offsets of ``W2T [BH, BD]`` in an array of W2 stored transposed, ``[h, d]`` (the host transposes
    the initial and final weights and their gradients): contiguous along d, as ``W1 [h, m]`` is along m.
    Both tiles then load into one layout, the hidden width split over the warps and each warp holding
    whole rows: the reductions over m and d (``W1 k``, ``W2^T s``) stay inside a warp, and no tile is kept
    in a second layout for the stores inside the time loop. Read as ``[d, h]``, W2's load layout (lanes
    along h, warps along d) would be carried through the loop, and W1 with it: every reduction over m or
    d would cross the warps, through shared memory."""
    return o_h[:, None] * D + o_d[None, :]


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
def _robust(u, PSI: tl.constexpr):
    """(f(u), f'(u)) of a robust loss rho(u) whose gradient in r is 2 r rho'(u) = r f(u): pseudo-Huber
    ``sqrt(1 + u) - 1`` (f = (1 + u)^(-1/2)), Cauchy ``log(1 + u) / 2`` (f = 1 / (1 + u))."""
    if (PSI == HUBER) or (PSI == HUBER_NORM):
        f = 1. / tl.sqrt(1. + u)
        return f, -0.5 * f * f * f
    else:
        f = 1. / (1. + u)
        return f, -f * f


@triton.jit
def _psi(b_r, b_x, b_rw, PSI: tl.constexpr):
    """s: the data term's gradient at the prediction, each output row weighted by w (``PSI``)."""
    if PSI == REG:
        return b_rw * b_r
    elif PSI == LIN:
        return -b_rw * b_x
    elif (PSI == HUBER) or (PSI == CAUCHY):
        f, _ = _robust(b_r * b_r, PSI)
        return b_rw * b_r * f
    else:       # the norm couples the rows: one program holds them all (the last axis: a token's, or each row's
        f, _ = _robust(tl.sum(b_rw * b_r * b_r, axis=-1, keep_dims=True), PSI)     # of a [tokens, d] tile)
        return b_rw * b_r * f


@triton.jit
def _psi_adjoint(b_ds, b_r, b_x, b_rw, PSI: tl.constexpr):
    """``_psi``'s adjoint: from the adjoint ``ds`` of s, those of (the prediction's residual r, the
    target x, the row weight w). A linear term reads no prediction: its dr is 0."""
    if PSI == REG:
        b_dr = b_ds * b_rw
        return b_dr, -b_dr, b_ds * b_r
    elif PSI == LIN:
        return tl.zeros(b_ds.shape, dtype=tl.float32), -b_ds * b_rw, -b_ds * b_x
    elif (PSI == HUBER) or (PSI == CAUCHY):
        f, f1 = _robust(b_r * b_r, PSI)
        b_dr = b_ds * b_rw * (f + 2. * b_r * b_r * f1)
        return b_dr, -b_dr, b_ds * b_r * f
    else:
        f, f1 = _robust(tl.sum(b_rw * b_r * b_r, axis=-1, keep_dims=True), PSI)
        g = tl.sum(b_ds * b_rw * b_r, axis=-1, keep_dims=True) * f1
        b_dr = b_ds * b_rw * f + 2. * g * b_rw * b_r
        return b_dr, -b_dr, b_ds * b_r * f + g * b_r * b_r


@triton.jit
def _hidden(b_w1, b_k, m_h, ACT: tl.constexpr):
    """z = W1 k, a = act(z) (0 on padded hidden units), act'(z)."""
    b_z = tl.sum(b_w1 * b_k[None, :], axis=1)
    b_a, b_a1, _ = _act(b_z, ACT)
    return b_z, tl.where(m_h, b_a, 0.), b_a1


@triton.jit
def _back(b_w2, b_r, b_x, b_eta, b_rw, b_a1, PSI: tl.constexpr):
    """From the residual r: s = psi(r) (``_psi``), e = W2^T s, gz = eta (e . act'(z))."""
    b_s = _psi(b_r, b_x, b_rw, PSI)
    b_e = tl.sum(b_w2 * b_s[None, :], axis=1)
    return b_s, b_e, b_eta * b_e * b_a1


@triton.jit
def _add2(a, b, c, d):
    return a + c, b + d


@triton.jit
def _add3(a, b, c, d, e, f):
    return a + d, b + e, c + f


@triton.jit
def _grad(b_w1, b_w2, b_k, b_x, b_eta, b_rw, m_h, ACT: tl.constexpr, PSI: tl.constexpr):
    """One key's gradient terms at the weights ``W1, W2T``: z = W1 k, a = act(z), r = W2 a - x,
    s = psi(r) (``_psi``), e = W2^T s, gz = eta (e . act'(z)). Returns (z, a, r, s, e, gz)."""
    b_z, b_a, b_a1 = _hidden(b_w1, b_k, m_h, ACT)
    b_r = tl.sum(b_w2 * b_a[:, None], axis=0) - b_x
    b_s, b_e, b_gz = _back(b_w2, b_r, b_x, b_eta, b_rw, b_a1, PSI)
    return b_z, b_a, b_r, b_s, b_e, b_gz


@triton.jit
def _grad_pair(b_w1, b_w2, b_k, b_x, b_k2, b_x2, b_eta, b_rw, m_h, ACT: tl.constexpr, PSI: tl.constexpr):
    """``_grad`` of two keys at the same weights, their two sums over the hidden width (split over the
    warps: an exchange through shared memory) as one reduction."""
    b_z, b_a, b_a1 = _hidden(b_w1, b_k, m_h, ACT)
    b_z2, b_a2, b_a12 = _hidden(b_w1, b_k2, m_h, ACT)
    b_r, b_r2 = tl.reduce((b_w2 * b_a[:, None], b_w2 * b_a2[:, None]), 0, _add2)
    b_r -= b_x
    b_r2 -= b_x2
    b_s, b_e, b_gz = _back(b_w2, b_r, b_x, b_eta, b_rw, b_a1, PSI)
    b_s2, b_e2, b_gz2 = _back(b_w2, b_r2, b_x2, b_eta, b_rw, b_a12, PSI)
    return b_z, b_a, b_r, b_s, b_e, b_gz, b_z2, b_a2, b_r2, b_s2, b_e2, b_gz2


@triton.jit
def _step(b_w1, b_w2, b_p1, b_p2, b_k, b_x, b_k2, b_x2, b_eta, b_rw, b_c, m_h, ACT: tl.constexpr,
          PSI: tl.constexpr, HAS_DEC: tl.constexpr, AT_ANCHOR: tl.constexpr, TWO: tl.constexpr):
    """One token's step of the running weights ``W1, W2T`` with the gradient (``_grad`` of each key)
    taken at ``P1, P2T`` (the running weights themselves, or a mini-batch's anchors):
    W1 <- c W1 - gz k^T, W2 <- c W2 - eta s a^T (c: the decay, HAS_DEC; AT_ANCHOR: weight decay
    taken at the anchors, W <- W - (1 - c) P), and with a second key and target (TWO) its terms too.
    Returns (W1, W2T, z, r, e, gz, z2, r2, e2, gz2) (the second key's equal the first's without TWO)."""
    if TWO:
        b_z, b_a, b_r, b_s, b_e, b_gz, b_z2, b_a2, b_r2, b_s2, b_e2, b_gz2 = _grad_pair(
            b_p1, b_p2, b_k, b_x, b_k2, b_x2, b_eta, b_rw, m_h, ACT, PSI)
    else:
        b_z, b_a, b_r, b_s, b_e, b_gz = _grad(b_p1, b_p2, b_k, b_x, b_eta, b_rw, m_h, ACT, PSI)
        b_z2, b_a2, b_r2, b_s2, b_e2, b_gz2 = b_z, b_a, b_r, b_s, b_e, b_gz
    b_w1, b_w2 = _apply(b_w1, b_w2, b_p1, b_p2, b_k, b_k2, b_a, b_a2, b_s, b_s2, b_gz, b_gz2, b_eta, b_c, HAS_DEC,
                        AT_ANCHOR, TWO)
    return b_w1, b_w2, b_z, b_r, b_e, b_gz, b_z2, b_r2, b_e2, b_gz2


@triton.jit
def _apply(b_w1, b_w2, b_p1, b_p2, b_k, b_k2, b_a, b_a2, b_s, b_s2, b_gz, b_gz2, b_eta, b_c, HAS_DEC: tl.constexpr,
           AT_ANCHOR: tl.constexpr, TWO: tl.constexpr):
    """``_step``'s update of the running weights from each key's gradient terms (a, s, gz):
    W1 <- c W1 - gz k^T, W2 <- c W2 - eta s a^T (AT_ANCHOR: W <- W - (1 - c) P - ...)."""
    if HAS_DEC:
        if AT_ANCHOR:
            b_w1 = b_w1 - (1. - b_c) * b_p1
            b_w2 = b_w2 - (1. - b_c) * b_p2
        else:
            b_w1 = b_c * b_w1
            b_w2 = b_c * b_w2
    b_w1 -= b_gz[:, None] * b_k[None, :]
    b_w2 -= (b_eta * b_a)[:, None] * b_s[None, :]
    if TWO:
        b_w1 -= b_gz2[:, None] * b_k2[None, :]
        b_w2 -= (b_eta * b_a2)[:, None] * b_s2[None, :]
    return b_w1, b_w2


@triton.jit
def _adjoint(b_g1, b_g2, b_w1, b_w2, b_k, b_z, b_r, b_x, b_e, b_eta, b_rw, m_h, ACT: tl.constexpr, PSI: tl.constexpr):
    """One key's share of the step's adjoint at the weights its gradient was taken at (G1, G2 the
    adjoints of the weights after it, G2 kept transposed as W2): dgz = -eta G1 k, de = dgz . act'(z),
    ds = -eta G2 a + W2 de, (dr, dx, dw) = ``_psi_adjoint``(ds), da = -eta G2^T s + W2^T dr,
    dz = dgz . e . act''(z) + da . act'(z).
    Returns (dk, dr, dx, dw, d eta, dz, de, s, a); the caller adds dz k^T to G1 and s de^T + dr a^T to G2."""
    b_a, b_a1, b_a2 = _act(b_z, ACT)
    b_a = tl.where(m_h, b_a, 0.)
    b_gz = b_e * b_a1
    b_s = _psi(b_r, b_x, b_rw, PSI)
    # (sums over one axis of two tiles taken as one: the step's chain of reductions is its latency)
    b_gk = tl.sum(b_g1 * b_k[None, :], axis=1)
    b_g2s = tl.sum(b_g2 * b_s[None, :], axis=1)
    b_dgz = -b_eta * b_gk
    b_de = b_dgz * b_a1
    b_ds = tl.sum(b_w2 * b_de[:, None] - b_eta * b_g2 * b_a[:, None], axis=0)
    b_dr, b_dx, b_dw = _psi_adjoint(b_ds, b_r, b_x, b_rw, PSI)
    b_da = -b_eta * b_g2s + tl.sum(b_w2 * b_dr[None, :], axis=1)
    b_dz = b_dgz * b_e * b_a2 + b_da * b_a1
    b_dk = tl.sum(b_w1 * b_dz[:, None] - b_eta * b_g1 * b_gz[:, None], axis=0)
    # d eta = -(gz . G1 k + s . G2 a) = -(gz . G1 k + a . G2^T s)
    return b_dk, b_dr, b_dx, b_dw, -tl.sum(b_gz * b_gk + b_a * b_g2s, axis=0), b_dz, b_de, b_s, b_a


@tune(_WARPS, key=["H", "D", "M", "HID", "ACT", "PSI", "HAS_ETA", "HAS_RW", "HAS_DEC", "TWO", "MB", "STORE", "STORE_T",
                   "FUSE"])
@triton.jit(do_not_specialize=["T", "NT"])
def mlp_memory_fwd_kernel(x, k, q, eta, rw, dec, k2, x2, w1, w2, y, w1t, w2t, cz, cr, ce, cz2, cr2, ce2, ck1, ck2, cu,
                          co, T, NT,
                          H: tl.constexpr, D: tl.constexpr, M: tl.constexpr, HID: tl.constexpr, BD: tl.constexpr,
                          BM: tl.constexpr, BH: tl.constexpr, CHUNK: tl.constexpr, ACT: tl.constexpr,
                          PSI: tl.constexpr, HAS_ETA: tl.constexpr, HAS_RW: tl.constexpr, HAS_DEC: tl.constexpr,
                          TWO: tl.constexpr, MB: tl.constexpr, AT_ANCHOR: tl.constexpr, STORE: tl.constexpr,
                          STORE_T: tl.constexpr, VARLEN: tl.constexpr, FUSE: tl.constexpr):
    """Sequential over tokens. Per token, with W1, W2 the previous weights, ``_step``:
    z = W1 k, a = act(z), r = W2 a - x, s = w . psi(r), e = W2^T s; W1 <- c W1 - eta (e . act'(z)) k^T,
    W2 <- c W2 - eta s a^T; y = W2 act(W1 q) with the new weights (w: the loss's weight of each output
    row, HAS_RW; else 1; psi: the data term, PSI; c: the per-head decay, HAS_DEC; else 1; TWO: a
    second key and target ``k2, x2``, whose terms at the same weights join the step). MB (a mini-batch
    of MB tokens, counted from each sequence's start): z, r, e are taken at the anchors P1, P2, the
    weights before the token's mini-batch, and the decay at the running weights (AT_ANCHOR: weight
    decay, a data term too, at the anchors). STORE (training): z, r, e (of each key) per token and the
    weights after every chunk's last token (``ck1 [B*H, NT, h, m]``, ``ck2 [B*H, NT, h, d]``), which
    the backward starts each chunk from (with MB, CHUNK is a multiple of MB). VARLEN: program ``i_b``
    runs sequence ``i_b`` of a packed row (``cu`` its offsets, ``co`` each sequence's first chunk;
    ``ssmcraft.ops.common.rows.seq_state``).

    FUSE (without MB): token t - 1's readout and token t's gradient read the same weights, so each pair
    of their sums is one reduction (over m: W1 q and W1 k; over h, across the warps: W2 act(W1 q) and
    W2 a), and the last token's readout follows the loop; else each token's readout follows its step
    (W1 q off the step's chain through k . q)."""
    i_bh, i_b, i_h, o_d, m_d, o_m, m_m, o_h, m_h, p1, m1, p2, m2 = _program(H, D, M, HID, BD, BM, BH)
    p2 = _w2t_offsets(o_d, o_h, D)
    b_w1, b_w2 = _weights(w1, w2, i_bh, p1, m1, p2, m2, D, M, HID, True, BD, BM, BH)
    b_p1, b_p2 = b_w1, b_w2
    FUSED: tl.constexpr = FUSE and not MB
    bos, T, NT, c0 = seq_state(cu, co, i_b, i_h, T, NT, H, CHUNK, VARLEN)
    row = bos.to(tl.int64) * H + i_h
    # each token's inputs are loaded while the previous token's step runs: the step's chain of
    # reductions then never waits on memory
    ok = T > 0
    b_k, b_x = _vec(k, row, o_m, m_m & ok, M), _vec(x, row, o_d, m_d & ok, D)
    b_q, b_eta = _vec(q, row, o_m, m_m & ok, M), _step_of(eta, row, ok, HAS_ETA)
    b_rw, b_c = _row_weight(rw, row, o_d, m_d & ok, D, HAS_RW), _step_of(dec, row, ok, HAS_DEC)
    b_k2, b_x2 = _opt_vec(k2, row, o_m, m_m & ok, M, TWO), _opt_vec(x2, row, o_d, m_d & ok, D, TWO)
    b_qp = tl.zeros([BM], dtype=tl.float32)         # FUSED: the previous token's query (none before the first)
    for t in range(T):
        ok = t + 1 < T
        n_k, n_x = _vec(k, row + H, o_m, m_m & ok, M), _vec(x, row + H, o_d, m_d & ok, D)
        n_q, n_eta = _vec(q, row + H, o_m, m_m & ok, M), _step_of(eta, row + H, ok, HAS_ETA)
        n_rw, n_c = _row_weight(rw, row + H, o_d, m_d & ok, D, HAS_RW), _step_of(dec, row + H, ok, HAS_DEC)
        n_k2, n_x2 = _opt_vec(k2, row + H, o_m, m_m & ok, M, TWO), _opt_vec(x2, row + H, o_d, m_d & ok, D, TWO)
        if FUSED:
            # the previous token's readout and this token's gradient, both at the weights before this token
            if TWO:
                b_zq, b_z, b_z2 = tl.reduce((b_w1 * b_qp[None, :], b_w1 * b_k[None, :], b_w1 * b_k2[None, :]), 1,
                                            _add3)
            else:
                b_zq, b_z = tl.reduce((b_w1 * b_qp[None, :], b_w1 * b_k[None, :]), 1, _add2)
                b_z2 = b_z
            b_aq, _, _ = _act(b_zq, ACT)
            b_aq = tl.where(m_h, b_aq, 0.)
            b_a, b_a1, _ = _act(b_z, ACT)
            b_a = tl.where(m_h, b_a, 0.)
            if TWO:
                b_a2, b_a12, _ = _act(b_z2, ACT)
                b_a2 = tl.where(m_h, b_a2, 0.)
                b_yp, b_r, b_r2 = tl.reduce((b_w2 * b_aq[:, None], b_w2 * b_a[:, None], b_w2 * b_a2[:, None]), 0,
                                            _add3)
            else:
                b_a2, b_a12 = b_a, b_a1
                b_yp, b_r = tl.reduce((b_w2 * b_aq[:, None], b_w2 * b_a[:, None]), 0, _add2)
                b_r2 = b_r
            tl.store(y + (row - H) * D + o_d, b_yp.to(y.dtype.element_ty), mask=m_d & (t > 0))
            b_r -= b_x
            b_s, b_e, b_gz = _back(b_w2, b_r, b_x, b_eta, b_rw, b_a1, PSI)
            if TWO:
                b_r2 -= b_x2
                b_s2, b_e2, b_gz2 = _back(b_w2, b_r2, b_x2, b_eta, b_rw, b_a12, PSI)
            else:
                b_s2, b_e2, b_gz2 = b_s, b_e, b_gz
            b_w1, b_w2 = _apply(b_w1, b_w2, b_w1, b_w2, b_k, b_k2, b_a, b_a2, b_s, b_s2, b_gz, b_gz2, b_eta, b_c,
                                HAS_DEC, False, TWO)
            b_qp = b_q
        else:
            b_w1, b_w2, b_z, b_r, b_e, b_z2, b_r2, b_e2, b_p1, b_p2 = _fwd_token(
                b_w1, b_w2, b_p1, b_p2, b_k, b_x, b_q, b_k2, b_x2, b_eta, b_rw, b_c, y, row, t, o_d, m_d, m_h, D,
                ACT, PSI, HAS_DEC, AT_ANCHOR, TWO, MB)
        if STORE:
            tl.store(cr + row * D + o_d, b_r, mask=m_d)
            if TWO:
                tl.store(cr2 + row * D + o_d, b_r2, mask=m_d)
            if FUSED:
                # z and e side by side, one store: each store of a vector over h waits on its own
                # conversion to the store's layout (through shared memory, two barriers)
                _put_ze(cz, row, b_z, b_e, o_h, m_h, HID)
                if TWO:
                    _put_ze(cz2, row, b_z2, b_e2, o_h, m_h, HID)
            else:
                tl.store(cz + row * HID + o_h, b_z, mask=m_h)
                tl.store(ce + row * HID + o_h, b_e, mask=m_h)
                if TWO:
                    tl.store(cz2 + row * HID + o_h, b_z2, mask=m_h)
                    tl.store(ce2 + row * HID + o_h, b_e2, mask=m_h)
            if ((t + 1) % CHUNK == 0) | (t + 1 == T):
                _put(ck1, ck2, c0 + t // CHUNK, b_w1, b_w2, p1, m1, p2, m2, D, M, HID)
        row += H
        b_k, b_x, b_q, b_eta, b_rw, b_c, b_k2, b_x2 = n_k, n_x, n_q, n_eta, n_rw, n_c, n_k2, n_x2
    if FUSED:
        # the last token's readout, at the final weights
        b_aq, _, _ = _act(tl.sum(b_w1 * b_qp[None, :], axis=1), ACT)
        b_aq = tl.where(m_h, b_aq, 0.)
        tl.store(y + (row - H) * D + o_d, tl.sum(b_w2 * b_aq[:, None], axis=0).to(y.dtype.element_ty),
                 mask=m_d & (T > 0))
    if STORE_T:
        _put(w1t, w2t, i_bh, b_w1, b_w2, p1, m1, p2, m2, D, M, HID)


@triton.jit
def _fwd_token(b_w1, b_w2, b_p1, b_p2, b_k, b_x, b_q, b_k2, b_x2, b_eta, b_rw, b_c, y, row, t, o_d, m_d, m_h, D,
               ACT: tl.constexpr, PSI: tl.constexpr, HAS_DEC: tl.constexpr, AT_ANCHOR: tl.constexpr,
               TWO: tl.constexpr, MB: tl.constexpr):
    """The forward's token ``t`` with its readout after its step (``_step``; the unfused forward, and every
    mini-batch): stores y; returns (W1, W2T, z, r, e, z2, r2, e2, P1, P2T)."""
    if MB:
        # a select, not a branch: the anchors are loop-carried tiles (a branch that reassigns them
        # gave wrong final weights on an H100 with Triton 3.6, while the interpreter agreed)
        fresh = t % MB == 0
        b_p1, b_p2 = tl.where(fresh, b_w1, b_p1), tl.where(fresh, b_w2, b_p2)
    else:
        b_p1, b_p2 = b_w1, b_w2
    # the readout's W1 q off the step's chain: (c W1 - eta gz k^T) q = c W1 q - eta gz (k . q)
    b_zq = tl.sum(b_w1 * b_q[None, :], axis=1)
    if HAS_DEC:
        if AT_ANCHOR:
            b_zq -= (1. - b_c) * tl.sum(b_p1 * b_q[None, :], axis=1)
        else:
            b_zq *= b_c
    b_w1, b_w2, b_z, b_r, b_e, b_gz, b_z2, b_r2, b_e2, b_gz2 = _step(b_w1, b_w2, b_p1, b_p2, b_k, b_x, b_k2, b_x2,
                                                                     b_eta, b_rw, b_c, m_h, ACT, PSI, HAS_DEC,
                                                                     AT_ANCHOR, TWO)
    # k . q as a sum over a row of the weights' layout: inside a warp (a vector of its own layout
    # spreads over all warps, and its sum waits on shared memory)
    b_zq -= b_gz * tl.sum(b_k[None, :] * b_q[None, :], axis=1)
    if TWO:
        b_zq -= b_gz2 * tl.sum(b_k2[None, :] * b_q[None, :], axis=1)
    b_aq, _, _ = _act(b_zq, ACT)
    b_aq = tl.where(m_h, b_aq, 0.)
    tl.store(y + row * D + o_d, tl.sum(b_w2 * b_aq[:, None], axis=0).to(y.dtype.element_ty), mask=m_d)
    return b_w1, b_w2, b_z, b_r, b_e, b_z2, b_r2, b_e2, b_p1, b_p2


@triton.jit
def _readout_adjoint(b_g1, b_g2, b_w1, b_w2, b_q, b_dy, m_h, ACT: tl.constexpr):
    """The readout y = W2 act(W1 q) at the weights after a token: (G1, G2 with its adjoint added, dq)."""
    b_aq, b_aq1, _ = _act(tl.sum(b_w1 * b_q[None, :], axis=1), ACT)
    b_aq = tl.where(m_h, b_aq, 0.)
    b_dzq = tl.sum(b_w2 * b_dy[None, :], axis=1) * b_aq1
    b_g1 += b_dzq[:, None] * b_q[None, :]
    b_g2 += b_aq[:, None] * b_dy[None, :]
    return b_g1, b_g2, tl.sum(b_w1 * b_dzq[:, None], axis=0)


@triton.jit
def _unstep(b_w1, b_w2, b_k, b_x, b_z, b_r, b_e, b_k2, b_x2, b_z2, b_r2, b_e2, b_eta, b_rw, m_h, ACT: tl.constexpr,
            PSI: tl.constexpr, TWO: tl.constexpr):
    """Add back a token's step terms from each key's stored z, r, e: W1 += eta (e . act'(z)) k^T,
    W2 += eta s a^T."""
    b_a, b_a1, _ = _act(b_z, ACT)
    b_w1 += (b_eta * b_e * b_a1)[:, None] * b_k[None, :]
    b_w2 += (b_eta * tl.where(m_h, b_a, 0.))[:, None] * _psi(b_r, b_x, b_rw, PSI)[None, :]
    if TWO:
        b_a, b_a1, _ = _act(b_z2, ACT)
        b_w1 += (b_eta * b_e2 * b_a1)[:, None] * b_k2[None, :]
        b_w2 += (b_eta * tl.where(m_h, b_a, 0.))[:, None] * _psi(b_r2, b_x2, b_rw, PSI)[None, :]
    return b_w1, b_w2


@triton.jit
def _store_inner(ptr, row, b_g1, b_g2, b_w1, b_w2):
    """Store <G1, W1> + <G2, W2> (a decay's gradient) at ``ptr + row``."""
    tl.store(ptr + row, (tl.sum(tl.sum(b_g1 * b_w1, axis=1), axis=0)
                         + tl.sum(tl.sum(b_g2 * b_w2, axis=1), axis=0)).to(ptr.dtype.element_ty))


@triton.jit
def _token_adjoint(b_g1, b_g2, b_p1, b_p2, b_k, b_x, b_z, b_r, b_e, b_k2, b_x2, b_z2, b_r2, b_e2, b_eta, b_rw,
                   dk, dx, dk2, dx2, deta, drw, row, o_d, m_d, o_m, m_m, m_h, D, M, ACT: tl.constexpr,
                   PSI: tl.constexpr, HAS_ETA: tl.constexpr, HAS_RW: tl.constexpr, TWO: tl.constexpr):
    """The step's adjoint at the weights ``P1, P2T`` its gradient was taken at (``_adjoint`` of each
    key; G1, G2 the adjoints of the weights after the token): stores the token's dk, dx, d eta, dw
    (and dk2, dx2) and returns the adjoint the step hands to P: (dz k^T, s de^T + dr a^T) over the keys."""
    b_dk, b_dr, b_dx, b_drw, b_deta, b_dz, b_de, b_s, b_a = _adjoint(b_g1, b_g2, b_p1, b_p2, b_k, b_z, b_r, b_x, b_e,
                                                                     b_eta, b_rw, m_h, ACT, PSI)
    tl.store(dk + row * M + o_m, b_dk.to(dk.dtype.element_ty), mask=m_m)
    tl.store(dx + row * D + o_d, b_dx.to(dx.dtype.element_ty), mask=m_d)
    b_h1 = b_dz[:, None] * b_k[None, :]
    b_h2 = b_de[:, None] * b_s[None, :] + b_a[:, None] * b_dr[None, :]
    if TWO:
        b_dk2, b_dr2, b_dx2, b_drw2, b_deta2, b_dz2, b_de2, b_s2, b_a2 = _adjoint(
            b_g1, b_g2, b_p1, b_p2, b_k2, b_z2, b_r2, b_x2, b_e2, b_eta, b_rw, m_h, ACT, PSI)
        tl.store(dk2 + row * M + o_m, b_dk2.to(dk2.dtype.element_ty), mask=m_m)
        tl.store(dx2 + row * D + o_d, b_dx2.to(dx2.dtype.element_ty), mask=m_d)
        b_deta += b_deta2
        b_drw += b_drw2
        b_h1 += b_dz2[:, None] * b_k2[None, :]
        b_h2 += b_de2[:, None] * b_s2[None, :] + b_a2[:, None] * b_dr2[None, :]
    if HAS_ETA:
        tl.store(deta + row, b_deta.to(deta.dtype.element_ty))
    if HAS_RW:
        tl.store(drw + row * D + o_d, b_drw.to(drw.dtype.element_ty), mask=m_d)
    return b_h1, b_h2


@triton.jit
def _bwd_inputs(q, dy, k, cz, cr, ce, x, eta, rw, dec, k2, cz2, cr2, ce2, x2, row, ok, o_d, m_d, o_m, m_m, o_h, m_h,
                D, M, HID, NX: tl.constexpr, HAS_ETA: tl.constexpr, HAS_RW: tl.constexpr, HAS_DEC: tl.constexpr,
                TWO: tl.constexpr, ZE: tl.constexpr):
    """The backward's vectors of the token at ``row`` (zeros where ``ok`` is False): its inputs q, dy, k
    (x only where the data term reads it, NX), eta, w, c, the second key's, and the forward's z, r, e
    (``_ze``; without a second key its z2, e2 are zeros)."""
    if TWO:
        z2, e2 = _ze(cz2, row, o_h, m_h & ok, HID, ZE, 0), _ze(ce2, row, o_h, m_h & ok, HID, ZE, ZE)
    else:
        z2, e2 = tl.zeros([o_h.shape[0]], dtype=tl.float32), tl.zeros([o_h.shape[0]], dtype=tl.float32)
    return (_vec(q, row, o_m, m_m & ok, M), _vec(dy, row, o_d, m_d & ok, D), _vec(k, row, o_m, m_m & ok, M),
            _ze(cz, row, o_h, m_h & ok, HID, ZE, 0), _vec(cr, row, o_d, m_d & ok, D),
            _ze(ce, row, o_h, m_h & ok, HID, ZE, ZE), _opt_vec(x, row, o_d, m_d & ok, D, NX),
            _step_of(eta, row, ok, HAS_ETA), _row_weight(rw, row, o_d, m_d & ok, D, HAS_RW),
            _step_of(dec, row, ok, HAS_DEC), _opt_vec(k2, row, o_m, m_m & ok, M, TWO), z2,
            _opt_vec(cr2, row, o_d, m_d & ok, D, TWO), e2, _opt_vec(x2, row, o_d, m_d & ok, D, TWO and NX))


@triton.jit
def _lost_bits(dec, rows, m):
    """log2 of the most a walk back divided by the decays at ``rows`` (where ``m``) can amplify a rounding
    error: the sum of -log2 |c| (inf where a c is 0)."""
    return tl.sum(-tl.log2(tl.abs(tl.load(dec + rows, mask=m, other=1.).to(tl.float32))), axis=0)


@triton.jit
def _replay(b_w1, b_w2, lo, hi, k, x, k2, x2, eta, rw, dec, first, H, o_d, m_d, o_m, m_m, m_h, D, M,
            ACT: tl.constexpr, PSI: tl.constexpr, HAS_ETA: tl.constexpr, HAS_RW: tl.constexpr,
            HAS_DEC: tl.constexpr, AT_ANCHOR: tl.constexpr, TWO: tl.constexpr, MB: tl.constexpr):
    """The forward's steps of tokens lo..hi-1 (rows ``first + u H``) from the running weights before
    token lo, each mini-batch's anchors taken every MB tokens from lo (without MB, the previous
    weights): the weights after token hi - 1."""
    b_p1, b_p2 = b_w1, b_w2
    for u in range(lo, hi):
        if MB:
            fresh = (u - lo) % MB == 0          # a select, as in the forward
            b_p1, b_p2 = tl.where(fresh, b_w1, b_p1), tl.where(fresh, b_w2, b_p2)
        else:
            b_p1, b_p2 = b_w1, b_w2
        r_u = first + u * H
        b_w1, b_w2, _, _, _, _, _, _, _, _ = _step(
            b_w1, b_w2, b_p1, b_p2, _vec(k, r_u, o_m, m_m, M), _vec(x, r_u, o_d, m_d, D),
            _opt_vec(k2, r_u, o_m, m_m, M, TWO), _opt_vec(x2, r_u, o_d, m_d, D, TWO),
            _step_of(eta, r_u, True, HAS_ETA), _row_weight(rw, r_u, o_d, m_d, D, HAS_RW),
            _step_of(dec, r_u, True, HAS_DEC), m_h, ACT, PSI, HAS_DEC, AT_ANCHOR, TWO)
    return b_w1, b_w2


@tune(_WARPS, key=["H", "D", "M", "HID", "ACT", "PSI", "HAS_ETA", "HAS_RW", "HAS_DEC", "TWO", "MB", "HAS_DHT",
                   "STORE_DH0", "ZE"])
@triton.jit(do_not_specialize=["T", "NT"])
def mlp_memory_bwd_kernel(x, k, q, eta, rw, dec, k2, x2, w1, w2, dy, cz, cr, ce, cz2, cr2, ce2, ck1, ck2, dw1t, dw2t,
                          dx, dk, dq, deta, drw, ddec, dk2, dx2, dw1, dw2, cu, co, T, NT, BITS, H: tl.constexpr,
                          D: tl.constexpr, M: tl.constexpr, HID: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
                          BH: tl.constexpr, CHUNK: tl.constexpr, BC: tl.constexpr, ACT: tl.constexpr,
                          PSI: tl.constexpr, HAS_ETA: tl.constexpr, HAS_RW: tl.constexpr, HAS_DEC: tl.constexpr,
                          TWO: tl.constexpr, MB: tl.constexpr, AT_ANCHOR: tl.constexpr, HAS_DHT: tl.constexpr,
                          STORE_DH0: tl.constexpr, VARLEN: tl.constexpr, ZE: tl.constexpr):
    """Chunks in reverse, each from the weights after its last token (the forward's checkpoint), token
    by token back to its start: the readout's adjoint at W_t, then W_{t-1} = W_t + eta (e . act'(z))
    k^T and W2_{t-1} = W2_t + eta s a^T from the stored z, r, e (s = w . psi(r)), then the step's
    adjoint (``_token_adjoint``). Rounding drift of the walk back is bounded by one chunk: every chunk
    restarts from its stored end state. With a decay c (HAS_DEC) the walk back divides by c,
    W_{t-1} = (W_t + eta (...)) / c, amplifying rounding by 1/|c| a token: a chunk is walked where
    its decays amplify it by at most 2^BITS (the sum of -log2 |c| over its tokens, ``_lost_bits``);
    in the others the weights before token t are replayed forward (``_step``) from the chunk's start
    (the previous chunk's end state, or the initial weights ``w1, w2``), about CHUNK / 2 steps a
    token. The adjoint then scales G1, G2 by c and dc = <G1, W1_{t-1}> + <G2, W2_{t-1}>. BC: CHUNK's
    power of 2 (the chunk's decays as one vector).

    MB (a mini-batch of MB tokens; CHUNK is a multiple of MB): each mini-batch of a chunk, last first,
    replays its anchors P (the weights before it) from the chunk's start; the step's adjoint at P
    accumulates into P's adjoint over the mini-batch, which joins the running weights' at its first
    token; the weights walk back (or, with a decay, replay from P, which are exactly the weights
    before the mini-batch), and the mini-batch ends at W = P. AT_ANCHOR (weight decay at the anchors,
    W_t = W_{t-1} - (1 - c) P - ...): dc = <G, P>, and P's adjoint takes -(1 - c) G.
    VARLEN: as the forward.

    ZE (without MB): the forward stored z and e together (its FUSE form, ``_put_ze``)."""
    i_bh, i_b, i_h, o_d, m_d, o_m, m_m, o_h, m_h, p1, m1, p2, m2 = _program(H, D, M, HID, BD, BM, BH)
    p2 = _w2t_offsets(o_d, o_h, D)
    b_g1, b_g2 = _weights(dw1t, dw2t, i_bh, p1, m1, p2, m2, D, M, HID, HAS_DHT, BD, BM, BH)
    bos, T, NT, c0 = seq_state(cu, co, i_b, i_h, T, NT, H, CHUNK, VARLEN)
    first = (bos.to(tl.int64) * H + i_h)
    if MB:
        for i in range(NT):
            i_c = NT - 1 - i
            t_lo = i_c * CHUNK
            end = tl.minimum(T, t_lo + CHUNK)
            n_mb = tl.cdiv(end - t_lo, MB)
            b_w1, b_w2 = _weights(ck1, ck2, c0 + i_c, p1, m1, p2, m2, D, M, HID, True, BD, BM, BH)
            for jj in range(n_mb):
                lo = t_lo + (n_mb - 1 - jj) * MB
                hi = tl.minimum(end, lo + MB)
                # this mini-batch's anchors: the running weights before it, replayed from the chunk's start
                if i_c == 0:
                    b_p1, b_p2 = _weights(w1, w2, i_bh, p1, m1, p2, m2, D, M, HID, True, BD, BM, BH)
                else:
                    b_p1, b_p2 = _weights(ck1, ck2, c0 + i_c - 1, p1, m1, p2, m2, D, M, HID, True, BD, BM, BH)
                b_p1, b_p2 = _replay(b_p1, b_p2, t_lo, lo, k, x, k2, x2, eta, rw, dec, first, H, o_d, m_d, o_m, m_m,
                                     m_h, D, M, ACT, PSI, HAS_ETA, HAS_RW, HAS_DEC, AT_ANCHOR, TWO, MB)
                b_h1 = tl.zeros([BH, BM], dtype=tl.float32)
                b_h2 = tl.zeros([BH, BD], dtype=tl.float32)
                for j in range(hi - lo):
                    t = hi - 1 - j
                    row = first + t * H
                    b_k, b_x = _vec(k, row, o_m, m_m, M), _vec(x, row, o_d, m_d, D)
                    b_z, b_r = _vec(cz, row, o_h, m_h, HID), _vec(cr, row, o_d, m_d, D)
                    b_e = _vec(ce, row, o_h, m_h, HID)
                    b_k2, b_x2 = _opt_vec(k2, row, o_m, m_m, M, TWO), _opt_vec(x2, row, o_d, m_d, D, TWO)
                    b_z2, b_r2 = _opt_vec(cz2, row, o_h, m_h, HID, TWO), _opt_vec(cr2, row, o_d, m_d, D, TWO)
                    b_e2 = _opt_vec(ce2, row, o_h, m_h, HID, TWO)
                    b_eta, b_c = _step_of(eta, row, True, HAS_ETA), _step_of(dec, row, True, HAS_DEC)
                    b_rw = _row_weight(rw, row, o_d, m_d, D, HAS_RW)
                    b_g1, b_g2, b_dq = _readout_adjoint(b_g1, b_g2, b_w1, b_w2, _vec(q, row, o_m, m_m, M),
                                                        _vec(dy, row, o_d, m_d, D), m_h, ACT)
                    tl.store(dq + row * M + o_m, b_dq.to(dq.dtype.element_ty), mask=m_m)
                    # back to the running weights before token t
                    if HAS_DEC and not AT_ANCHOR:
                        b_w1, b_w2 = _replay(b_p1, b_p2, lo, t, k, x, k2, x2, eta, rw, dec, first, H, o_d, m_d, o_m,
                                             m_m, m_h, D, M, ACT, PSI, HAS_ETA, HAS_RW, HAS_DEC, AT_ANCHOR, TWO, MB)
                        _store_inner(ddec, row, b_g1, b_g2, b_w1, b_w2)
                    else:
                        b_w1, b_w2 = _unstep(b_w1, b_w2, b_k, b_x, b_z, b_r, b_e, b_k2, b_x2, b_z2, b_r2, b_e2, b_eta,
                                             b_rw, m_h, ACT, PSI, TWO)
                        if HAS_DEC:
                            b_w1 += (1. - b_c) * b_p1
                            b_w2 += (1. - b_c) * b_p2
                            _store_inner(ddec, row, b_g1, b_g2, b_p1, b_p2)
                    b_d1, b_d2 = _token_adjoint(b_g1, b_g2, b_p1, b_p2, b_k, b_x, b_z, b_r, b_e, b_k2, b_x2, b_z2, b_r2,
                                                b_e2, b_eta, b_rw, dk, dx, dk2, dx2, deta, drw, row, o_d, m_d, o_m, m_m,
                                                m_h, D, M, ACT, PSI, HAS_ETA, HAS_RW, TWO)
                    b_h1 += b_d1
                    b_h2 += b_d2
                    if HAS_DEC:
                        if AT_ANCHOR:
                            b_h1 -= (1. - b_c) * b_g1
                            b_h2 -= (1. - b_c) * b_g2
                        else:
                            b_g1 = b_c * b_g1
                            b_g2 = b_c * b_g2
                b_g1 += b_h1
                b_g2 += b_h2
                b_w1, b_w2 = b_p1, b_p2
    else:
        NX: tl.constexpr = PSI == LIN      # a linear term's s reads the target
        # token t - 1's inputs and stored vectors are loaded while token t's adjoint runs (as the forward)
        row = (bos + T - 1).to(tl.int64) * H + i_h
        (b_q, b_dy, b_k, b_z, b_r, b_e, b_x, b_eta, b_rw, b_c, b_k2, b_z2, b_r2, b_e2, b_x2) = _bwd_inputs(
            q, dy, k, cz, cr, ce, x, eta, rw, dec, k2, cz2, cr2, ce2, x2, row, T > 0, o_d, m_d, o_m, m_m, o_h, m_h,
            D, M, HID, NX, HAS_ETA, HAS_RW, HAS_DEC, TWO, ZE)
        for i in range(NT):
            i_c = NT - 1 - i
            b_w1, b_w2 = _weights(ck1, ck2, c0 + i_c, p1, m1, p2, m2, D, M, HID, True, BD, BM, BH)
            lo = i_c * CHUNK
            end = tl.minimum(T, lo + CHUNK)
            if HAS_DEC:
                o_c = tl.arange(0, BC)
                walk = _lost_bits(dec, first + (lo + o_c) * H, o_c < end - lo) <= BITS
            for j in range(end - lo):
                t = end - 1 - j
                (n_q, n_dy, n_k, n_z, n_r, n_e, n_x, n_eta, n_rw, n_c, n_k2, n_z2, n_r2, n_e2, n_x2) = _bwd_inputs(
                    q, dy, k, cz, cr, ce, x, eta, rw, dec, k2, cz2, cr2, ce2, x2, row - H, t > 0, o_d, m_d,
                    o_m, m_m, o_h, m_h, D, M, HID, NX, HAS_ETA, HAS_RW, HAS_DEC, TWO, ZE)
                # the readout y = W2 act(W1 q) at the weights after token t
                b_g1, b_g2, b_dq = _readout_adjoint(b_g1, b_g2, b_w1, b_w2, b_q, b_dy, m_h, ACT)
                tl.store(dq + row * M + o_m, b_dq.to(dq.dtype.element_ty), mask=m_m)
                # back to the weights before token t
                if HAS_DEC:
                    # walked: W_{t-1} = (W_t + the step's terms) / c
                    b_v1, b_v2 = _unstep(b_w1, b_w2, b_k, b_x, b_z, b_r, b_e, b_k2, b_x2, b_z2, b_r2, b_e2, b_eta,
                                         b_rw, m_h, ACT, PSI, TWO)
                    # rebuilt: replayed from the chunk's start; a walked chunk loads nothing and replays no
                    # step (masks and a trip count: selects, not branches, as the mini-batch's anchors)
                    rebuild = walk == 0
                    if i_c == 0:
                        b_w1, b_w2 = _weights(w1, w2, i_bh, p1, m1 & rebuild, p2, m2 & rebuild, D, M, HID, True,
                                              BD, BM, BH)
                    else:
                        b_w1, b_w2 = _weights(ck1, ck2, c0 + i_c - 1, p1, m1 & rebuild, p2, m2 & rebuild, D, M,
                                              HID, True, BD, BM, BH)
                    b_w1, b_w2 = _replay(b_w1, b_w2, lo, tl.where(walk, lo, t), k, x, k2, x2, eta, rw, dec, first, H,
                                         o_d, m_d, o_m, m_m, m_h, D, M, ACT, PSI, HAS_ETA, HAS_RW, HAS_DEC, False, TWO,
                                         0)
                    b_w1 = tl.where(walk, b_v1 / b_c, b_w1)
                    b_w2 = tl.where(walk, b_v2 / b_c, b_w2)
                    _store_inner(ddec, row, b_g1, b_g2, b_w1, b_w2)
                else:
                    b_w1, b_w2 = _unstep(b_w1, b_w2, b_k, b_x, b_z, b_r, b_e, b_k2, b_x2, b_z2, b_r2, b_e2, b_eta,
                                         b_rw, m_h, ACT, PSI, TWO)
                # the step's adjoint at the weights before token t
                b_d1, b_d2 = _token_adjoint(b_g1, b_g2, b_w1, b_w2, b_k, b_x, b_z, b_r, b_e, b_k2, b_x2, b_z2, b_r2,
                                            b_e2, b_eta, b_rw, dk, dx, dk2, dx2, deta, drw, row, o_d, m_d, o_m, m_m,
                                            m_h, D, M, ACT, PSI, HAS_ETA, HAS_RW, TWO)
                if HAS_DEC:
                    b_g1 = b_c * b_g1
                    b_g2 = b_c * b_g2
                b_g1 += b_d1
                b_g2 += b_d2
                row -= H
                b_q, b_dy, b_k, b_z, b_r, b_e, b_eta, b_rw, b_c = n_q, n_dy, n_k, n_z, n_r, n_e, n_eta, n_rw, n_c
                b_k2, b_z2, b_r2, b_e2, b_x, b_x2 = n_k2, n_z2, n_r2, n_e2, n_x, n_x2
    if STORE_DH0:
        _put(dw1, dw2, i_bh, b_g1, b_g2, p1, m1, p2, m2, D, M, HID)
