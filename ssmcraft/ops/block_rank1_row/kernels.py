"""Triton kernels of the block rank-1 family: two states updated by one rank-1 step of an
extrapolated state (``ssmcraft.compiler.blockrank1``), row-tiled. Row ``i`` of each state, in the
kernels' transposed tiles ``[BK, BV]``::

    U    = e0 x0 + e1 x1,          z = U . u             (one reduction over K per row)
    R    = p q - c z v                                  (the innovation, rank 1)
    x0'  = a00 x0 + a01 x1 + w0 R,  x1' = a10 x0 + a11 x1 + w1 R
    o    = (r0 x0' + r1 x1') . oq                       (the readout's ``S oq``; oc, oh on the host)

Backward (reverse time; ``g0, g1`` the adjoints of ``x0', x1'``)::

    g_a += r_a oq dy;   gR = w0 g0 + w1 g1;   e = gR . v;   gz = -c e
    dc = -z e,  dp = gR . q,  dA_ab = g_a . x_b,  dw_a = g_a . R,  de_b = gz (x_b . u),  dr_a = dy (x_a' . oq)
    du += gz U,  dv -= c z gR,  dq += p gR,  doq += dy (r0 x0' + r1 x1')   (summed over the rows)
    g0 <- a00 g0 + a10 g1 + e0 gz u,    g1 <- a01 g0 + a11 g1 + e1 gz u

The backward needs the states before every step. The forward stores ``z`` (one scalar per row
and step), both states every ``CHUNK`` steps and the final states. Chunk by chunk, one of two ways
(as the per-row rank-1 family's decayed backward, ``ssmcraft.ops.rank1_row.bwd``):

- where the transition is lower triangular (``a01`` the constant 0: the first state does not read
  the second; Longhorn with momentum, ``D' = mu D + R``, ``S' = mu D + S + R``) and the chunk's
  coefficients are mild, walked back from the chunk's exact end state (the next chunk's checkpoint
  or the final states) by inverting the step (``retreat``): ``x0 = (x0' - w0 R) / a00``,
  ``x1 = (x1' - w1 R - a10 x0) / a11``. A rounding error is amplified by the walk: per row, by
  ``E0 = prod 1/|a00|`` in the first state and ``E1 = prod 1/|a11| + sum_j |a10_j| E0_j prod_{i<=j}
  1/|a11_i|`` in the second (``E0_j`` the first state's gain over the chunk's steps from its end
  back to j, ``walk_bits``: for momentum, ``1 + sum_j mu_j E0_j``). The chunk is walked where
  ``log2 max(E0, E1)`` over the program's rows is at most ``BITS`` (``recurrent.DIVIDE_BITS``); the
  error does not carry past the chunk (the next one restarts from its exact end state);
- elsewhere (every chunk of a transition with ``a01`` not the constant 0), the states are rebuilt
  from the checkpoint with the stored ``z`` (a few multiply-adds, no reduction); the one before
  every second step is kept in the per-program scratch ``SCR [prog, CHUNK/2, 2, BK, BV]``
  (L2-resident) and the other rebuilt in registers.

One reverse loop runs both ways: it computes the walked and the rebuilt states and selects one per
chunk (a select, not a branch: a branch reassigning loop-carried tiles inside a loop has compiled
wrong on the GPU); a walked chunk skips the rebuild (a branch around its stores only) and loads no
kept state. The bound reads the chunk's ``a00, a10, a11`` as one tile each, loaded a chunk ahead.

Row coefficients come as ``rows = (A00, A01, A10, A11, E0, E1, W0, W1, C, P, R0, R1)`` with the
compile-time ``MODES`` (0 the constant of ``CONSTS``, 1 per head ``[B, T, H]``, 2 per row
``[B, T, H, V]``); a constant 0 or 1 costs nothing (``scaled``, ``combine``). The K-vector slots
``(U, Vv, Q, OQ)`` share loads and gradient buffers by ``GROUPS`` as in ``ssmcraft.ops.rank1_row``,
whose loads and gradient stores this module reuses.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.rank1_row.bwd import decay_tile, lost_bits
from ssmcraft.ops.rank1_row.fwd import load_coef, load_vecs, prefetch_l2, prefetch_slots, row_tile

# positions in ``rows``, ``MODES`` and ``CONSTS``
A00, A01, A10, A11, E0, E1, W0, W1, IC, IP, R0, R1 = (tl.constexpr(i) for i in range(12))


@triton.jit
def scaled(x, c, MODE: tl.constexpr, CONST: tl.constexpr):
    """``c x`` on a [BK, BV] tile: ``c`` a [BV] row coefficient, or the constant CONST (MODE 0)."""
    if MODE == 0:
        if CONST == 1.0:
            r = x
        else:
            r = x * CONST
    else:
        r = x * c[None, :]
    return r


@triton.jit
def plus_scaled(g, x, c, MODE: tl.constexpr, CONST: tl.constexpr):
    """``g + c x``, nothing added where ``c`` is the constant 0."""
    if (MODE == 0) and (CONST == 0.0):
        r = g
    else:
        r = g + scaled(x, c, MODE, CONST)
    return r


@triton.jit
def combine(x0, x1, c0, c1, M0: tl.constexpr, K0: tl.constexpr, M1: tl.constexpr, K1: tl.constexpr):
    """``c0 x0 + c1 x1``, a term whose coefficient is the constant 0 left out."""
    if (M0 == 0) and (K0 == 0.0):
        r = scaled(x1, c1, M1, K1)
    elif (M1 == 0) and (K1 == 0.0):
        r = scaled(x0, c0, M0, K0)
    else:
        r = scaled(x0, c0, M0, K0) + scaled(x1, c1, M1, K1)
    return r


@triton.jit
def load_rows(rows, row, V, ix, MODES: tl.constexpr, CONSTS: tl.constexpr, BV: tl.constexpr):
    """The twelve row coefficients at one step, [BV] fp32 each (a constant's is never read)."""
    return (load_coef(rows[0], row, V, ix[2], ix[3], MODES[0], CONSTS[0], BV),
            load_coef(rows[1], row, V, ix[2], ix[3], MODES[1], CONSTS[1], BV),
            load_coef(rows[2], row, V, ix[2], ix[3], MODES[2], CONSTS[2], BV),
            load_coef(rows[3], row, V, ix[2], ix[3], MODES[3], CONSTS[3], BV),
            load_coef(rows[4], row, V, ix[2], ix[3], MODES[4], CONSTS[4], BV),
            load_coef(rows[5], row, V, ix[2], ix[3], MODES[5], CONSTS[5], BV),
            load_coef(rows[6], row, V, ix[2], ix[3], MODES[6], CONSTS[6], BV),
            load_coef(rows[7], row, V, ix[2], ix[3], MODES[7], CONSTS[7], BV),
            load_coef(rows[8], row, V, ix[2], ix[3], MODES[8], CONSTS[8], BV),
            load_coef(rows[9], row, V, ix[2], ix[3], MODES[9], CONSTS[9], BV),
            load_coef(rows[10], row, V, ix[2], ix[3], MODES[10], CONSTS[10], BV),
            load_coef(rows[11], row, V, ix[2], ix[3], MODES[11], CONSTS[11], BV))


@triton.jit
def load_step(vecs, rows, Z, DY, row, K, V, ix, MODES: tl.constexpr, CONSTS: tl.constexpr,
              GROUPS: tl.constexpr, BV: tl.constexpr):
    """Everything one step reads: ((u, v, q, oq), rows, z, dy); ``Z`` / ``DY`` None: zeros."""
    vs = load_vecs(vecs, row * K, ix[0], ix[1], GROUPS)
    cf = load_rows(rows, row, V, ix, MODES, CONSTS, BV)
    z = tl.zeros([BV], dtype=tl.float32)
    if Z is not None:
        z += tl.load(Z + row * V + ix[2], mask=ix[3], other=0.)
    dy = tl.zeros([BV], dtype=tl.float32)
    if DY is not None:
        dy += tl.load(DY + row * V + ix[2], mask=ix[3], other=0.).to(tl.float32)
    return vs, cf, z, dy


@triton.jit
def prefetch_step(vecs, rows, Z, DY, row, K, V, ix, MODES: tl.constexpr, GROUPS: tl.constexpr):
    """L2 prefetch of one (future) step's tensors (the K vectors as the per-row rank-1 family's)."""
    prefetch_slots(vecs, (None, None, None), row, K, V, ix, (0, 0, 0), GROUPS)
    for i in tl.static_range(12):
        if MODES[i] == 2:
            prefetch_l2(rows[i] + row * V + ix[2])
    if Z is not None:
        prefetch_l2(Z + row * V + ix[2])
    if DY is not None:
        prefetch_l2(DY + row * V + ix[2])


@triton.jit
def extrapolated(x0, x1, cf, MODES: tl.constexpr, CONSTS: tl.constexpr):
    """U = e0 x0 + e1 x1."""
    return combine(x0, x1, cf[E0], cf[E1], MODES[E0], CONSTS[E0], MODES[E1], CONSTS[E1])


@triton.jit
def read(x0, x1, cf, MODES: tl.constexpr, CONSTS: tl.constexpr):
    """r0 x0 + r1 x1: what the readout reads with oq."""
    return combine(x0, x1, cf[R0], cf[R1], MODES[R0], CONSTS[R0], MODES[R1], CONSTS[R1])


@triton.jit
def innovation(vs, cf, z):
    """R = p q - (c z) v on a [BK, BV] tile."""
    u, v, q, oq = vs
    return q[:, None] * cf[IP][None, :] - v[:, None] * (cf[IC] * z)[None, :]


@triton.jit
def advance(x0, x1, R, cf, MODES: tl.constexpr, CONSTS: tl.constexpr):
    """(x0', x1') = A (x0, x1) + w R."""
    n0 = combine(x0, x1, cf[A00], cf[A01], MODES[A00], CONSTS[A00], MODES[A01], CONSTS[A01]) \
        + scaled(R, cf[W0], MODES[W0], CONSTS[W0])
    n1 = combine(x0, x1, cf[A10], cf[A11], MODES[A10], CONSTS[A10], MODES[A11], CONSTS[A11]) \
        + scaled(R, cf[W1], MODES[W1], CONSTS[W1])
    return n0, n1


@triton.jit
def divided(x, c, MODE: tl.constexpr, CONST: tl.constexpr):
    """``x / c`` on a [BV]-row tile; a row coefficient of 0 (masked rows load 0) divides by 1: a chunk
    with a valid 0 has an unbounded walk and is rebuilt, its quotient never selected."""
    if MODE == 0:
        if CONST == 1.0:
            r = x
        else:
            r = x / CONST
    else:
        r = x * (1. / tl.where(c == 0., 1., c))[None, :]
    return r


@triton.jit
def retreat(y0, y1, R, cf, MODES: tl.constexpr, CONSTS: tl.constexpr):
    """The states before a step from those after it, (y0, y1) = ``advance(x0, x1, R)``, where ``a01``
    is the constant 0: x0 = (y0 - w0 R) / a00, x1 = (y1 - w1 R - a10 x0) / a11."""
    x0 = divided(y0 - scaled(R, cf[W0], MODES[W0], CONSTS[W0]), cf[A00], MODES[A00], CONSTS[A00])
    r1 = y1 - scaled(R, cf[W1], MODES[W1], CONSTS[W1])
    if not ((MODES[A10] == 0) and (CONSTS[A10] == 0.0)):
        r1 -= scaled(x0, cf[A10], MODES[A10], CONSTS[A10])
    return x0, divided(r1, cf[A11], MODES[A11], CONSTS[A11])


@triton.jit
def walk_bits(rows, base, t0, T, H, h, K, V, ix, MODES: tl.constexpr, CONSTS: tl.constexpr, CHUNK: tl.constexpr,
              CP: tl.constexpr):
    """log2 of the most the walk back over the steps [t0, min(t0 + CHUNK, T)) amplifies a rounding
    error of the states, over this program's rows (the module docstring's ``max(E0, E1)``; inf or
    NaN where a coefficient it divides by is 0)."""
    a00 = decay_tile(rows[0], base, t0, T, H, h, K, V, ix, MODES[A00], CONSTS[A00], CHUNK, CP).to(tl.float32)
    a10 = decay_tile(rows[2], base, t0, T, H, h, K, V, ix, MODES[A10], CONSTS[A10], CHUNK, CP).to(tl.float32)
    a11 = decay_tile(rows[3], base, t0, T, H, h, K, V, ix, MODES[A11], CONSTS[A11], CHUNK, CP).to(tl.float32)
    j = tl.arange(0, CP)
    on = ((j < CHUNK) & (t0 + j < T))[:, None]
    l0 = -tl.log2(tl.abs(a00))
    l1 = -tl.log2(tl.abs(a11))
    m0 = tl.cumsum(l0, axis=0, reverse=True)           # log2 E0_j: the first state's gain from the end to j
    m1 = tl.cumsum(l1, axis=0, reverse=True)
    top = tl.sum(l1, axis=0)
    # E1 = 2^top + sum_j |a10_j| E0_j prod_{i <= j} 1/|a11_i|  (prod_{i <= j} = 2^(top - m1_j + l1_j))
    terms = tl.where(on & (a10 != 0.), tl.abs(a10) * tl.exp2(m0 + top[None, :] - m1 + l1), 0.)
    e1 = tl.exp2(top) + tl.sum(terms, axis=0)
    return tl.maximum(lost_bits(a00), tl.max(tl.log2(e1), axis=0))


@triton.jit
def block_fwd_kernel(
    U, Vv, Q, OQ, RA00, RA01, RA10, RA11, RE0, RE1, RW0, RW1, RC, RP, RR0, RR1,   # slots (None: a constant)
    S0, Y, ST, Z, CK,        # S0 / S_T [B, H, 2, K, V] (or None); o [B, T, H, V]; z [B, T, H, V]; ckpt [B, H, NC, 2, K, V]
    T, H, V, K, NC,
    BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr, PF: tl.constexpr,
    MODES: tl.constexpr, CONSTS: tl.constexpr, GROUPS: tl.constexpr,
):
    """One program: rows [iv*BV, iv*BV+BV) of head (b, h), both state tiles in registers; the
    slots are loaded two steps ahead, and on the GPU L2 is asked PF steps ahead."""
    i_bh = tl.program_id(0)
    b = i_bh // H
    h = i_bh % H
    ix, mask_s, tile = row_tile(V, K, BV, BK)
    vecs = (U, Vv, Q, OQ)
    rows = (RA00, RA01, RA10, RA11, RE0, RE1, RW0, RW1, RC, RP, RR0, RR1)
    base = b.to(tl.int64) * T
    x0 = tl.zeros([BK, BV], dtype=tl.float32)
    x1 = tl.zeros([BK, BV], dtype=tl.float32)
    if S0 is not None:
        x0 += tl.load(S0 + (i_bh.to(tl.int64) * 2) * K * V + tile, mask=mask_s, other=0.).to(tl.float32)
        x1 += tl.load(S0 + (i_bh.to(tl.int64) * 2 + 1) * K * V + tile, mask=mask_s, other=0.).to(tl.float32)
    ckp = CK
    if CK is not None:
        ckp = CK + i_bh.to(tl.int64) * NC * 2 * K * V
        tl.store(ckp + tile, x0, mask=mask_s)
        tl.store(ckp + K * V + tile, x1, mask=mask_s)
    # slots two steps ahead in registers
    nx1 = load_step(vecs, rows, None, None, base * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    nx2 = load_step(vecs, rows, None, None, (base + tl.minimum(1, T - 1)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    for t in range(0, T):
        row = (base + t) * H + h
        vs, cf, _z, _dy = nx1
        nx1 = nx2
        nx2 = load_step(vecs, rows, None, None, (base + tl.minimum(t + 2, T - 1)) * H + h, K, V, ix,
                        MODES, CONSTS, GROUPS, BV)
        if PF > 0:
            prefetch_step(vecs, rows, None, None, (base + tl.minimum(t + PF, T - 1)) * H + h, K, V, ix, MODES, GROUPS)
        u, v, q, oq = vs
        z = tl.sum(extrapolated(x0, x1, cf, MODES, CONSTS) * u[:, None], axis=0)
        x0, x1 = advance(x0, x1, innovation(vs, cf, z), cf, MODES, CONSTS)
        o = tl.sum(read(x0, x1, cf, MODES, CONSTS) * oq[:, None], axis=0)
        tl.store(Y + row * V + ix[2], o.to(Y.dtype.element_ty), mask=ix[3])
        if Z is not None:
            tl.store(Z + row * V + ix[2], z, mask=ix[3])
        if CK is not None:
            if (t + 1) % CHUNK == 0:
                if (t + 1) // CHUNK < NC:
                    c_at = ckp + ((t + 1) // CHUNK) * 2 * K * V
                    tl.store(c_at + tile, x0, mask=mask_s)
                    tl.store(c_at + K * V + tile, x1, mask=mask_s)
    if ST is not None:
        tl.store(ST + (i_bh.to(tl.int64) * 2) * K * V + tile, x0, mask=mask_s)
        tl.store(ST + (i_bh.to(tl.int64) * 2 + 1) * K * V + tile, x1, mask=mask_s)


@triton.jit
def tile_if(acc, x, FIRST: tl.constexpr, COND: tl.constexpr):
    """``acc + x`` where COND (``x`` alone where FIRST: nothing added yet), else ``acc``."""
    if COND:
        if FIRST:
            r = x
        else:
            r = acc + x
    else:
        r = acc
    return r


@triton.jit
def linear_grad(h0, h1, gU, x0, x1, i: tl.constexpr, ROWG: tl.constexpr):
    """The gradient of the tensor of row slot ``i`` (< 6) through the slots a_ab (``h_a . x_b``) and
    e_b (``gU . x_b``) that hold it: the left tiles summed per ``x_b``, then one reduction."""
    M0: tl.constexpr = ROWG[0] == i
    M2: tl.constexpr = ROWG[2] == i
    M4: tl.constexpr = ROWG[4] == i
    M1: tl.constexpr = ROWG[1] == i
    M3: tl.constexpr = ROWG[3] == i
    M5: tl.constexpr = ROWG[5] == i
    L0 = tile_if(h0, h0, True, M0)
    L0 = tile_if(L0, h1, not M0, M2)
    L0 = tile_if(L0, gU, not (M0 or M2), M4)
    L1 = tile_if(h0, h0, True, M1)
    L1 = tile_if(L1, h1, not M1, M3)
    L1 = tile_if(L1, gU, not (M1 or M3), M5)
    if (M0 or M2 or M4) and (M1 or M3 or M5):
        g = tl.sum(L0 * x0 + L1 * x1, axis=0)
    elif M0 or M2 or M4:
        g = tl.sum(L0 * x0, axis=0)
    else:
        g = tl.sum(L1 * x1, axis=0)
    return g


@triton.jit
def bwd_step(g0, g1, x0, x1, n0, n1, sl, t, t_hi, row, K, V, ix, grads, DM, NB, H,
             MODES: tl.constexpr, CONSTS: tl.constexpr, GROUPS: tl.constexpr, INDEX: tl.constexpr,
             ROWG: tl.constexpr):
    """Reverse step t (a no-op when t >= t_hi): ``x0, x1`` the states before it, ``n0, n1`` after
    it (the readout's only: a state it does not read is never loaded), ``g0, g1`` the adjoints of
    the states after it; stores step t's gradients, returns the adjoints before it."""
    vs, cf, z, dy = sl
    u, v, q, oq = vs
    offs_k, mask_k, offs_v, mask_v = ix
    valid = t < t_hi
    R = innovation(vs, cf, z)                   # read only by the gradients of non-constant w
    ody = oq[:, None] * dy[None, :]
    h0 = plus_scaled(g0, ody, cf[R0], MODES[R0], CONSTS[R0])
    h1 = plus_scaled(g1, ody, cf[R1], MODES[R1], CONSTS[R1])
    gR = combine(h0, h1, cf[W0], cf[W1], MODES[W0], CONSTS[W0], MODES[W1], CONSTS[W1])
    e = tl.sum(gR * v[:, None], axis=0)
    gz = -(cf[IC] * e)
    if GROUPS[1] == GROUPS[0]:
        dp = e                                  # q is v: one reduction
    else:
        dp = tl.sum(gR * q[:, None], axis=0)
    # row-slot gradients, one store per distinct tensor (a constant slot's is never computed); those
    # of a_ab (h_a . x_b) and e_b (gU . x_b) of one tensor are summed as tiles first: one reduction
    gU = u[:, None] * gz[None, :]
    gs = (tl.sum(h0 * R, axis=0), tl.sum(h1 * R, axis=0), -z * e, dp,
          dy * tl.sum(n0 * oq[:, None], axis=0), dy * tl.sum(n1 * oq[:, None], axis=0))
    for i in tl.static_range(12):
        if MODES[i] != 0:
            if ROWG[i] == i:
                if i < 6:
                    g = linear_grad(h0, h1, gU, x0, x1, i, ROWG)
                else:
                    g = gs[i - 6]
                for j in tl.static_range(max(i + 1, 6), 12):
                    if ROWG[j] == i:
                        g += gs[j - 6]
                if MODES[i] == 2:
                    tl.store(grads[i] + row * V + offs_v, g, mask=mask_v & valid)
                else:                           # per head: the row blocks add into one [B, T, H]
                    tl.atomic_add(grads[i] + row, tl.sum(tl.where(mask_v, g, 0.), axis=0), mask=valid,
                                  sem="relaxed")
    # K-vector gradients (summed over the rows), one buffer per distinct input tensor: u's is gz U,
    # v's -c z gR, q's p gR, oq's dy (read state); v and q of one tensor share a product with gR
    wv = -(cf[IC] * z)
    wq = cf[IP]
    co = read(n0, n1, cf, MODES, CONSTS) * dy[None, :]
    mk = mask_k & valid
    dm = DM + row * K + offs_k                  # [NG, B, T, H, K]: the row blocks add into it
    gstride = NB * H * K
    acc = extrapolated(x0, x1, cf, MODES, CONSTS) * gz[None, :]
    if (GROUPS[0] == 0) and (GROUPS[1] == 0):
        acc += gR * (wv + wq)[None, :]
    elif GROUPS[0] == 0:
        acc += gR * wv[None, :]
    elif GROUPS[1] == 0:
        acc += gR * wq[None, :]
    if GROUPS[2] == 0:
        acc += co
    tl.atomic_add(dm, tl.sum(acc, axis=1), mask=mk, sem="relaxed")
    if GROUPS[0] == 1:
        if GROUPS[1] == 1:
            acc1 = gR * (wv + wq)[None, :]
        else:
            acc1 = gR * wv[None, :]
        if GROUPS[2] == 1:
            acc1 += co
        tl.atomic_add(dm + INDEX[0] * gstride, tl.sum(acc1, axis=1), mask=mk, sem="relaxed")
    if GROUPS[1] == 2:
        acc2 = gR * wq[None, :]
        if GROUPS[2] == 2:
            acc2 += co
        tl.atomic_add(dm + INDEX[1] * gstride, tl.sum(acc2, axis=1), mask=mk, sem="relaxed")
    if GROUPS[2] == 3:
        tl.atomic_add(dm + INDEX[2] * gstride, tl.sum(co, axis=1), mask=mk, sem="relaxed")
    # adjoints of the states before the step
    p0 = combine(h0, h1, cf[A00], cf[A10], MODES[A00], CONSTS[A00], MODES[A10], CONSTS[A10]) \
        + scaled(gU, cf[E0], MODES[E0], CONSTS[E0])
    p1 = combine(h0, h1, cf[A01], cf[A11], MODES[A01], CONSTS[A01], MODES[A11], CONSTS[A11]) \
        + scaled(gU, cf[E1], MODES[E1], CONSTS[E1])
    return tl.where(valid, p0, g0), tl.where(valid, p1, g1)


@triton.jit
def keep_pairs(ckp, scr, vecs, rows, Z, t0, t1, base, H, h, K, V, ix, tile, mask_s, MODES: tl.constexpr,
               CONSTS: tl.constexpr, GROUPS: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr):
    """Rebuild the states of steps [t0, t1) from the checkpoint ``ckp`` with the stored z and keep
    the pair before every second step (scratch slot (t - t0) / 2)."""
    x0 = tl.load(ckp + tile, mask=mask_s, other=0.)
    x1 = tl.load(ckp + K * V + tile, mask=mask_s, other=0.)
    nx1 = load_step(vecs, rows, Z, None, (base + t0) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    nx2 = load_step(vecs, rows, Z, None, (base + tl.minimum(t0 + 1, t1 - 1)) * H + h, K, V, ix, MODES, CONSTS,
                    GROUPS, BV)
    for t in range(t0, t1):
        if (t - t0) % 2 == 0:
            tl.store(scr + ((t - t0) // 2) * 2 * BK * BV, x0)
            tl.store(scr + ((t - t0) // 2) * 2 * BK * BV + BK * BV, x1)
        vs, cf, z, _dy = nx1
        nx1 = nx2
        nx2 = load_step(vecs, rows, Z, None, (base + tl.minimum(t + 2, t1 - 1)) * H + h, K, V, ix, MODES, CONSTS,
                        GROUPS, BV)
        x0, x1 = advance(x0, x1, innovation(vs, cf, z), cf, MODES, CONSTS)


@triton.jit
def block_bwd_kernel(
    U, Vv, Q, OQ, RA00, RA01, RA10, RA11, RE0, RE1, RW0, RW1, RC, RP, RR0, RR1,   # slots (None: a constant)
    Z, CK, SCR, ST, DY, DHT,  # z; checkpoints [B, H, NC, 2, K, V]; scratch; S_T [B, H, 2, K, V]; do [B, T, H, V]; dS_T or None
    GA00, GA01, GA10, GA11, GE0, GE1, GW0, GW1, GC, GP, GR0, GR1,   # row gradients (None where constant; per head: zeros, added into)
    DM, DS0,                 # K-vector gradients [NG, B, T, H, K] (zeros: added into); dS0 [B, H, 2, K, V] or None
    T, H, V, K, NC, NB, NG,
    BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr, PF: tl.constexpr,
    MODES: tl.constexpr, CONSTS: tl.constexpr, GROUPS: tl.constexpr, INDEX: tl.constexpr,
    ROWG: tl.constexpr,      # per row slot: the first slot that is the same tensor (its gradient buffer)
    KEEP_AHEAD: tl.constexpr = True,    # the next pair's kept states loaded a pair ahead (two more live tiles)
    BITS=0.,                 # the most bits a chunk's walk may lose (the module docstring; < 0: every chunk rebuilt)
    CP: tl.constexpr = 1,    # CHUNK rounded up to a power of 2
):
    """Reverse sweep of rows [iv*BV, iv*BV+BV) of head (b, h), chunk by chunk from the last: the
    chunk walked back from its end state, or its states rebuilt from its checkpoint (every second one
    kept in SCR; the module docstring says which), then its steps in reverse, two per iteration (the
    kept state and the one rebuilt from it, or the two walked); slots are loaded two steps (one pair)
    ahead, and on the GPU L2 is asked PF steps ahead."""
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    b = i_bh // H
    h = i_bh % H
    ix, mask_s, tile = row_tile(V, K, BV, BK)
    offs_k = ix[0]
    vecs = (U, Vv, Q, OQ)
    rows = (RA00, RA01, RA10, RA11, RE0, RE1, RW0, RW1, RC, RP, RR0, RR1)
    grads = (GA00, GA01, GA10, GA11, GE0, GE1, GW0, GW1, GC, GP, GR0, GR1)
    base = b.to(tl.int64) * T
    NP: tl.constexpr = (CHUNK + 1) // 2
    scr = SCR + ((i_bh.to(tl.int64) * tl.num_programs(1) + i_v) * NP * 2) * BK * BV \
        + offs_k[:, None] * BV + tl.arange(0, BV)[None, :]
    g0 = tl.zeros([BK, BV], dtype=tl.float32)
    g1 = tl.zeros([BK, BV], dtype=tl.float32)
    if DHT is not None:
        g0 += tl.load(DHT + (i_bh.to(tl.int64) * 2) * K * V + tile, mask=mask_s, other=0.).to(tl.float32)
        g1 += tl.load(DHT + (i_bh.to(tl.int64) * 2 + 1) * K * V + tile, mask=mask_s, other=0.).to(tl.float32)
    ckp = CK + i_bh.to(tl.int64) * NC * 2 * K * V
    stp = ST + (i_bh.to(tl.int64) * 2) * K * V
    WALK: tl.constexpr = (MODES[A01] == 0) and (CONSTS[A01] == 0.0)
    if WALK:
        walk_next = walk_bits(rows, base, (NC - 1) * CHUNK, T, H, h, K, V, ix, MODES, CONSTS, CHUNK, CP) <= BITS
    for jc in range(0, NC):
        ci = NC - 1 - jc
        t0 = ci * CHUNK
        t1 = tl.minimum(t0 + CHUNK, T)
        n_kept = t1 - t0
        walk = False
        if WALK:
            walk = walk_next
            # the previous chunk's coefficients: loaded now, reduced once this chunk's steps are done
            bound = walk_bits(rows, base, tl.maximum(ci - 1, 0) * CHUNK, T, H, h, K, V, ix, MODES, CONSTS, CHUNK, CP)
            n_kept = tl.where(walk, 0, t1 - t0)
        # the exact states after the chunk: the next chunk's checkpoint, or the final states
        inner = ci + 1 < NC
        e_at = ckp + (ci + 1) * 2 * K * V + tile
        f0 = tl.load(e_at, mask=mask_s & inner, other=0.) + tl.load(stp + tile, mask=mask_s & (ci + 1 >= NC), other=0.)
        f1 = tl.load(e_at + K * V, mask=mask_s & inner, other=0.) \
            + tl.load(stp + K * V + tile, mask=mask_s & (ci + 1 >= NC), other=0.)
        if n_kept > 0:
            # a branch around stores only (it reassigns no tile the loop carries)
            keep_pairs(ckp + ci * 2 * K * V, scr, vecs, rows, Z, t0, t1, base, H, h, K, V, ix, tile, mask_s,
                       MODES, CONSTS, GROUPS, BV, BK)
        tl.debug_barrier()
        # reverse, a pair of steps (te, te + 1) per iteration, the next pair's loads issued ahead
        npair = (t1 - t0 + 1) // 2
        te = t0 + 2 * (npair - 1)
        ne = load_step(vecs, rows, Z, DY, (base + te) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
        no = load_step(vecs, rows, Z, DY, (base + tl.minimum(te + 1, t1 - 1)) * H + h, K, V, ix, MODES, CONSTS,
                       GROUPS, BV)
        kept = walk == 0                                # a walked chunk kept nothing: no load issued
        n0 = tl.zeros([BK, BV], dtype=tl.float32)
        n1 = tl.zeros([BK, BV], dtype=tl.float32)
        if KEEP_AHEAD:
            n0 = tl.load(scr + ((te - t0) // 2) * 2 * BK * BV, mask=kept, other=0.)
            n1 = tl.load(scr + ((te - t0) // 2) * 2 * BK * BV + BK * BV, mask=kept, other=0.)
        a0, a1 = f0, f1                                # the states after the pair's odd step
        for jp in range(0, npair):
            te = t0 + 2 * (npair - 1 - jp)              # the pair's even step; te + 1 may be past t1
            to = te + 1
            se, so = ne, no
            if PF > 0:
                prefetch_step(vecs, rows, Z, DY, (base + tl.maximum(te - PF, 0)) * H + h, K, V, ix, MODES, GROUPS)
                prefetch_step(vecs, rows, Z, DY, (base + tl.maximum(te + 1 - PF, 0)) * H + h, K, V, ix, MODES, GROUPS)
            if KEEP_AHEAD:
                y0, y1 = n0, n1
            else:
                y0 = tl.load(scr + ((te - t0) // 2) * 2 * BK * BV, mask=kept, other=0.)
                y1 = tl.load(scr + ((te - t0) // 2) * 2 * BK * BV + BK * BV, mask=kept, other=0.)
            tn = tl.maximum(te - 2, t0)
            ne = load_step(vecs, rows, Z, DY, (base + tn) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
            no = load_step(vecs, rows, Z, DY, (base + tl.minimum(tn + 1, t1 - 1)) * H + h, K, V, ix, MODES, CONSTS,
                           GROUPS, BV)
            if KEEP_AHEAD:
                n0 = tl.load(scr + ((tn - t0) // 2) * 2 * BK * BV, mask=kept, other=0.)
                n1 = tl.load(scr + ((tn - t0) // 2) * 2 * BK * BV + BK * BV, mask=kept, other=0.)
            Re = innovation(se[0], se[1], se[2])
            w0, w1 = advance(y0, y1, Re, se[1], MODES, CONSTS)
            if WALK:
                # walked: back over the odd step (none where it is past the chunk), then the even one
                v0, v1 = retreat(a0, a1, innovation(so[0], so[1], so[2]), so[1], MODES, CONSTS)
                v0 = tl.where(to < t1, v0, a0)
                v1 = tl.where(to < t1, v1, a1)
                u0, u1 = retreat(v0, v1, Re, se[1], MODES, CONSTS)
                w0 = tl.where(walk, v0, w0)
                w1 = tl.where(walk, v1, w1)
                y0 = tl.where(walk, u0, y0)
                y1 = tl.where(walk, u1, y1)
            g0, g1 = bwd_step(g0, g1, w0, w1, a0, a1, so, to, t1, (base + to) * H + h, K, V, ix, grads, DM, NB,
                              H, MODES, CONSTS, GROUPS, INDEX, ROWG)
            g0, g1 = bwd_step(g0, g1, y0, y1, w0, w1, se, te, t1, (base + te) * H + h, K, V, ix, grads,
                              DM, NB, H, MODES, CONSTS, GROUPS, INDEX, ROWG)
            a0, a1 = y0, y1
        if WALK:
            walk_next = bound <= BITS
        tl.debug_barrier()
    if DS0 is not None:
        tl.store(DS0 + (i_bh.to(tl.int64) * 2) * K * V + tile, g0, mask=mask_s)
        tl.store(DS0 + (i_bh.to(tl.int64) * 2 + 1) * K * V + tile, g1, mask=mask_s)
