"""The Triton kernels of the chunked rank-1 family with a per-key decay; the algorithm, its
stability, shapes and the host code that launches them are in ``ssmcraft.ops.rank1_keydecay_chunk.chunk``."""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.solvers import solve_unit_lower
from ssmcraft.ops.keydecay_chunk.decay_grad import DA_CONFIGS, key_block_chunk
from ssmcraft.ops.common.tiles import LOG_EXACT_DA, key_decay_grad, log_decay, readout_grads, seq_rows, value_block
from ssmcraft.ops.common.tuning import tune, warp_rule
from ssmcraft.ops.common.rows import seq_chunk, state_scan

# the erase's read key u (U_MODE): its own tensor, or u = a o v (KDA: the erase reads the decayed
# state), read as v e^{g} in place of u e^{gp}, so u is never formed
U_GIVEN = tl.constexpr(0)
U_IS_AV = tl.constexpr(1)


# ----------------------------------------------------------------------------------------
# gated intra-chunk products: P[t, s] = sum_k x_tk y_sk e^{gx_tk - g_sk}, s <= t
# ----------------------------------------------------------------------------------------

@triton.jit
def _rows_at(ptr, bos, i_h, i_t, s, T, H, K: tl.constexpr, o_k, m_k, BT: tl.constexpr, other):
    """Entries (s, o_k) of a ``[B, T, H, K]`` tensor, fp32, at chunk-local times ``s`` of the
    sequence whose first row is ``bos`` (``rows.seq_chunk``) and whose length is T; ``s``, ``o_k`` and
    ``m_k`` broadcast against each other (a tile of any rank). Rows past T read ``other``."""
    t = i_t * BT + s
    rows = (bos + tl.minimum(t, T - 1)).to(tl.int64) * H + i_h
    return tl.load(ptr + rows * K + o_k, mask=(t < T) & m_k, other=other).to(tl.float32)


@triton.jit
def _g_at(g, a, bos, i_h, i_t, s, T, H, K: tl.constexpr, o_k, m_k, BT: tl.constexpr, SHIFT: tl.constexpr):
    """The cumulative log-decay at chunk-local times ``s`` (``_rows_at``'s broadcasting): g (SHIFT
    false) or gp = g - log a (SHIFT), read with rows clamped into [0, T-1] so that past T it stays
    flat, as the chunk's own sums do."""
    t = i_t * BT + s
    rows = (bos + tl.minimum(t, T - 1)).to(tl.int64) * H + i_h
    b_g = tl.load(g + rows * K + o_k, mask=m_k, other=0.)
    if SHIFT:
        b_a = tl.load(a + rows * K + o_k, mask=(t < T) & m_k, other=1.)
        b_g = b_g - log_decay(b_a.to(tl.float32))
    return b_g


@triton.jit
def _ref(b_g, o_i, r):
    """Row ``r`` of the chunk's cumulative sums ``b_g [BT, BK]`` as a [BK] vector: a sub-block
    boundary, the reference point of the off-diagonal blocks."""
    return tl.sum(tl.where((o_i == r)[:, None], b_g, 0.), axis=0)


@triton.jit
def _halves(g, bos, i_h, i_t, o_i, T, H, K: tl.constexpr, o_k, m_k, BT: tl.constexpr, P: tl.constexpr):
    """Level P of the split inside the sub-blocks: the pairs (t, s) in one block of P rows with t in
    its second half and s in its first (``pair [BT, BT]``), the halves' row masks ``hi`` and ``lo``
    [BT], and the reference ``Rg [BT, BK]``: g at each block's row P/2 - 1, between the halves, so
    that e^{g_t - Rg} (t in hi, and gp_t = g_{t-1} too) and e^{Rg - g_s} (s in lo) have exponents <= 0."""
    hi = (o_i % P) >= P // 2
    lo = (o_i % P) < P // 2
    pair = ((o_i[:, None] // P) == (o_i[None, :] // P)) & hi[:, None] & lo[None, :]
    Rg = _g_at(g, g, bos, i_h, i_t, ((o_i // P) * P + P // 2 - 1)[:, None], T, H, K, o_k[None, :], m_k[None, :], BT,
               False)
    return pair, hi, lo, Rg


# The diagonal sub-blocks as one tensor-core product against g at each sub-block's middle row (``_mid``),
# where every |g - that reference| of the program's rows and keys is at most this: the factors are then
# at most e^30 each, and every product of two, the discarded upper entries included, stays far inside
# fp32's (and bf16's) range. Larger spans (strong decays, a = 0) take the elementwise sums.
FAST_DIAG_SPAN = tl.constexpr(30.0)


@triton.jit
def _mid(g, bos, i_h, i_t, o_i, T, H, K: tl.constexpr, o_k, m_k, BT: tl.constexpr, SUB: tl.constexpr, b_g1, b_g2,
         b_g3):
    """The reference of the fast diagonal sub-blocks, ``Rm [BT, BK]``: g at the middle row of each row's
    sub-block (rows clamped into the sequence as ``_g_at`` reads them), and whether the exponents
    ``b_g1 - Rm``, ``b_g2 - Rm`` and ``b_g3 - Rm`` all stay within ``FAST_DIAG_SPAN`` (a scalar)."""
    Rm = _g_at(g, g, bos, i_h, i_t, ((o_i // SUB) * SUB + SUB // 2 - 1)[:, None], T, H, K, o_k[None, :], m_k[None, :],
               BT, False)
    span = tl.maximum(tl.maximum(tl.abs(b_g1 - Rm), tl.abs(b_g2 - Rm)), tl.abs(b_g3 - Rm))
    return Rm, tl.max(tl.max(span, axis=1), axis=0) <= FAST_DIAG_SPAN


@triton.jit
def _same_block(o_i, SUB: tl.constexpr):
    """[BT, BT]: the pairs (t, s) in one sub-block."""
    return (o_i[:, None] // SUB) == (o_i[None, :] // SUB)


@triton.jit
def _lower_diag_fast(A, L, b_x, b_gx, b_q, b_y, b_gy, Rm, o_i, SUB: tl.constexpr, SAME_G: tl.constexpr,
                     DT: tl.constexpr, PREC: tl.constexpr):
    """``gated_lower``'s diagonal sub-blocks as products against ``Rm`` (``_mid``), for a program whose
    exponents all stay within FAST_DIAG_SPAN: (x e^{gx - Rm}) (y e^{Rm - gy})^T, kept on the pairs s < t
    (A) and s <= t (L) of each sub-block."""
    same = _same_block(o_i, SUB)
    ys = tl.trans((b_y * tl.exp(Rm - b_gy)).to(DT))
    e = tl.exp(b_gy - Rm)
    L = tl.where(same & (o_i[:, None] >= o_i[None, :]), tl.dot((b_q * e).to(DT), ys, input_precision=PREC), L)
    if not SAME_G:
        e = tl.exp(b_gx - Rm)
    A = tl.where(same & (o_i[:, None] > o_i[None, :]), tl.dot((b_x * e).to(DT), ys, input_precision=PREC), A)
    return A, L


@triton.jit
def _lower_diag_exact(A, L, b_x, b_gx, b_q, b_y, b_gy, y, g, bos, i_h, i_t, o_i, T, H, K: tl.constexpr, o_k, m_k,
                      BT: tl.constexpr, SUB: tl.constexpr, LEVELS: tl.constexpr, SAME_G: tl.constexpr,
                      DT: tl.constexpr, PREC: tl.constexpr):
    """``gated_lower``'s diagonal sub-blocks at any decay: LEVELS halvings (``_halves``), then the
    LEAF x LEAF diagonal blocks summed column by column with the exact exponents."""
    for lv in tl.static_range(LEVELS):
        pair, hi, lo, Rg = _halves(g, bos, i_h, i_t, o_i, T, H, K, o_k, m_k, BT, SUB >> lv)
        ys = tl.where(lo[:, None], b_y * tl.exp(tl.where(lo[:, None], Rg - b_gy, 0.)), 0.).to(DT)
        e = tl.where(hi[:, None], tl.exp(tl.where(hi[:, None], b_gy - Rg, 0.)), 0.)
        L = tl.where(pair, tl.dot((b_q * e).to(DT), tl.trans(ys), input_precision=PREC), L)
        if not SAME_G:
            e = tl.where(hi[:, None], tl.exp(tl.where(hi[:, None], b_gx - Rg, 0.)), 0.)
        A = tl.where(pair, tl.dot((b_x * e).to(DT), tl.trans(ys), input_precision=PREC), A)
    LEAF: tl.constexpr = SUB >> LEVELS
    for j in range(LEAF):
        s = (o_i // LEAF) * LEAF + j
        incl = s <= o_i
        y_s = _rows_at(y, bos, i_h, i_t, s[:, None], T, H, K, o_k[None, :], m_k[None, :], BT, 0.)
        g_s = _g_at(g, g, bos, i_h, i_t, s[:, None], T, H, K, o_k[None, :], m_k[None, :], BT, False)
        e = y_s * tl.exp(tl.where(incl[:, None], b_gy - g_s, 0.))
        at = o_i[None, :] == s[:, None]
        L = tl.where(at & incl[:, None], tl.sum(b_q * e, axis=1)[:, None], L)
        if not SAME_G:
            e = y_s * tl.exp(tl.where(incl[:, None], b_gx - g_s, 0.))
        A = tl.where(at & (s < o_i)[:, None], tl.sum(b_x * e, axis=1)[:, None], A)
    return A, L


@triton.jit
def gated_lower(b_x, b_gx, b_q, b_y, b_gy, y, g, bos, i_h, i_t, T, H, K: tl.constexpr, o_k, m_k,
                BT: tl.constexpr, SUB: tl.constexpr, LEVELS: tl.constexpr, SAME_G: tl.constexpr, FAST: tl.constexpr,
                DT: tl.constexpr, PREC: tl.constexpr):
    """(A, L) [BT, BT] fp32 against one column side y: A[t, s] = sum_k x_tk y_sk e^{gx_tk - g_sk}
    for s < t and L[t, s] = sum_k q_tk y_sk e^{g_tk - g_sk} for s <= t.

    ``b_x, b_gx`` and ``b_q`` the row sides (gx <= g at the same row: ``gp``, or ``g`` itself when
    SAME_G, and then every exponential is shared), ``b_y, b_gy`` the column side at the chunk's
    rows; ``y`` and ``g`` the same in memory, read again for the diagonal sub-blocks. Off-diagonal
    sub-blocks (row block I, columns before it) are tensor-core products against the reference
    R_I = g at row SUB I - 1, both exponents <= 0. Inside the sub-blocks, LEVELS halvings
    (``_halves``: blocks of SUB, SUB/2, ... rows, second half against first half) are tensor-core
    products the same way, and the diagonal blocks of SUB / 2^LEVELS rows left are summed column by
    column with the exact e^{gx_t - g_s}, s <= t (exponent <= 0). FAST: a program whose exponents
    against each sub-block's middle row all stay within FAST_DIAG_SPAN (``_mid``) takes the diagonal
    sub-blocks as one product instead (``_lower_diag_fast``)."""
    o_i = tl.arange(0, BT)
    blk = o_i // SUB
    A = tl.zeros([BT, BT], dtype=tl.float32)
    L = tl.zeros([BT, BT], dtype=tl.float32)
    for I in tl.static_range(1, BT // SUB):
        R = _ref(b_gy, o_i, I * SUB - 1)
        rows = blk == I
        cols = o_i < I * SUB
        ys = tl.where(cols[:, None], b_y * tl.exp(tl.where(cols[:, None], R[None, :] - b_gy, 0.)), 0.).to(DT)
        e = tl.where(rows[:, None], tl.exp(tl.where(rows[:, None], b_gy - R[None, :], 0.)), 0.)
        L += tl.dot((b_q * e).to(DT), tl.trans(ys), input_precision=PREC)
        if not SAME_G:
            e = tl.where(rows[:, None], tl.exp(tl.where(rows[:, None], b_gx - R[None, :], 0.)), 0.)
        A += tl.dot((b_x * e).to(DT), tl.trans(ys), input_precision=PREC)
    if FAST:
        Rm, fast = _mid(g, bos, i_h, i_t, o_i, T, H, K, o_k, m_k, BT, SUB, b_gy, b_gx, b_gy)
        if fast:
            A, L = _lower_diag_fast(A, L, b_x, b_gx, b_q, b_y, b_gy, Rm, o_i, SUB, SAME_G, DT, PREC)
        else:
            A, L = _lower_diag_exact(A, L, b_x, b_gx, b_q, b_y, b_gy, y, g, bos, i_h, i_t, o_i, T, H, K, o_k, m_k, BT,
                                     SUB, LEVELS, SAME_G, DT, PREC)
    else:
        A, L = _lower_diag_exact(A, L, b_x, b_gx, b_q, b_y, b_gy, y, g, bos, i_h, i_t, o_i, T, H, K, o_k, m_k, BT,
                                 SUB, LEVELS, SAME_G, DT, PREC)
    return A, L


@triton.jit
def gated_grads(D, b_c, Ds, c, b_y, b_gxr, b_x, b_gxc, b_gy, y, x, g, a, row, m_t, bos, i_h, i_t, T, H,
                K: tl.constexpr, o_k, m_k, BT: tl.constexpr, SUB: tl.constexpr, LEVELS: tl.constexpr,
                UNROLL: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr, STRICT: tl.constexpr,
                FAST: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """The two gradients through a ``gated_lower`` product with a lower triangular D [BT, BT] (fp32;
    strictly lower when STRICT), both [BT, BK]:

        Y_t = sum_{s<=t} D[t, s] y_s e^{gxr_t - g_s}     (its row side)
        Z_s = sum_{t>=s} Dc[t, s] x_t e^{gxc_t - g_s}    (its column side)

    with Dc = diag(c) D when SCALE (``b_c [BT]``: c at the chunk's rows), else D (``b_c`` unread).

    Off-diagonal sub-blocks are tensor-core products with the forward's references: R_I = g at row
    SUB I - 1 for the row side's row block I, g at J's last row for the column side's column block
    J (every exponent <= 0); inside the sub-blocks, LEVELS halvings (``_halves``) likewise. The
    diagonal blocks of SUB / 2^LEVELS rows left are summed elementwise with the exact exponents,
    UNROLL in-block offsets per step for both sides (2 UNROLL independent chains): D's
    entries from ``Ds`` (D in memory, ``[B, T, H, BT]``, this chunk's rows ``row``), times ``c`` at
    row t when SCALE, and ``y``, ``x`` and ``g`` (gxc: ``gp`` from ``g`` and ``a`` when SHIFT, else
    ``g``) read again at the step's rows. FAST: a program whose exponents against each sub-block's middle
    row all stay within FAST_DIAG_SPAN (``_mid``) takes the diagonal sub-blocks as one product per side
    instead (``_grads_diag_fast``)."""
    o_i = tl.arange(0, BT)
    blk = o_i // SUB
    Y = tl.zeros(b_y.shape, dtype=tl.float32)
    Z = tl.zeros(b_x.shape, dtype=tl.float32)
    for I in tl.static_range(1, BT // SUB):
        R = _ref(b_gy, o_i, I * SUB - 1)
        rows = blk == I
        cols = o_i < I * SUB
        ys = tl.where(cols[:, None], b_y * tl.exp(tl.where(cols[:, None], R[None, :] - b_gy, 0.)), 0.)
        Dm = tl.where(rows[:, None] & cols[None, :], D, 0.)
        part = tl.dot(Dm.to(DT), ys.to(DT), input_precision=PREC)
        Y += tl.where(rows[:, None], part * tl.exp(tl.where(rows[:, None], b_gxr - R[None, :], 0.)), 0.)
    for J in tl.static_range(0, BT // SUB - 1):
        R = _ref(b_gy, o_i, J * SUB + SUB - 1)
        rows = o_i >= (J + 1) * SUB
        cols = blk == J
        xs = tl.where(rows[:, None], b_x * tl.exp(tl.where(rows[:, None], b_gxc - R[None, :], 0.)), 0.)
        Dm = tl.where(rows[:, None] & cols[None, :], D, 0.)
        if SCALE:
            Dm = Dm * b_c[:, None]
        part = tl.dot(tl.trans(Dm.to(DT)), xs.to(DT), input_precision=PREC)
        Z += tl.where(cols[:, None], part * tl.exp(tl.where(cols[:, None], R[None, :] - b_gy, 0.)), 0.)
    if FAST:
        Rm, fast = _mid(g, bos, i_h, i_t, o_i, T, H, K, o_k, m_k, BT, SUB, b_gy, b_gxr, b_gxc)
        if fast:
            Y, Z = _grads_diag_fast(Y, Z, D, b_c, b_y, b_gxr, b_x, b_gxc, b_gy, Rm, o_i, SUB, SCALE, DT, PREC)
        else:
            Y, Z = _grads_diag_exact(Y, Z, D, b_c, Ds, c, b_y, b_gxr, b_x, b_gxc, b_gy, y, x, g, a, row, m_t, bos,
                                     i_h, i_t, o_i, T, H, K, o_k, m_k, BT, SUB, 0, 1, SHIFT, SCALE, STRICT, DT, PREC)
    else:
        Y, Z = _grads_diag_exact(Y, Z, D, b_c, Ds, c, b_y, b_gxr, b_x, b_gxc, b_gy, y, x, g, a, row, m_t, bos, i_h,
                                 i_t, o_i, T, H, K, o_k, m_k, BT, SUB, LEVELS, UNROLL, SHIFT, SCALE, STRICT, DT, PREC)
    return Y, Z


@triton.jit
def _grads_diag_fast(Y, Z, D, b_c, b_y, b_gxr, b_x, b_gxc, b_gy, Rm, o_i, SUB: tl.constexpr, SCALE: tl.constexpr,
                     DT: tl.constexpr, PREC: tl.constexpr):
    """``gated_grads``' diagonal sub-blocks as products against ``Rm`` (``_mid``), for a program whose
    exponents all stay within FAST_DIAG_SPAN: D's sub-block diagonal (lower triangular already) against
    y e^{Rm - gy}, times e^{gxr - Rm} by row (Y), and its transpose against x e^{gxc - Rm}, times
    e^{Rm - gy} by column (Z)."""
    Dm = tl.where(_same_block(o_i, SUB), D, 0.)
    up = tl.exp(Rm - b_gy)
    Y += tl.dot(Dm.to(DT), (b_y * up).to(DT), input_precision=PREC) * tl.exp(b_gxr - Rm)
    if SCALE:
        Dm = Dm * b_c[:, None]
    Z += tl.dot(tl.trans(Dm.to(DT)), (b_x * tl.exp(b_gxc - Rm)).to(DT), input_precision=PREC) * up
    return Y, Z


@triton.jit
def _grads_diag_exact(Y, Z, D, b_c, Ds, c, b_y, b_gxr, b_x, b_gxc, b_gy, y, x, g, a, row, m_t, bos, i_h, i_t, o_i, T, H,
                      K: tl.constexpr, o_k, m_k, BT: tl.constexpr, SUB: tl.constexpr, LEVELS: tl.constexpr,
                      UNROLL: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr, STRICT: tl.constexpr,
                      DT: tl.constexpr, PREC: tl.constexpr):
    """``gated_grads``' diagonal sub-blocks at any decay: LEVELS halvings (``_halves``), then the
    LEAF x LEAF diagonal blocks summed elementwise with the exact exponents, UNROLL in-block offsets
    per step."""
    for lv in tl.static_range(LEVELS):
        pair, hi, lo, Rg = _halves(g, bos, i_h, i_t, o_i, T, H, K, o_k, m_k, BT, SUB >> lv)
        Dm = tl.where(pair, D, 0.)
        ys = tl.where(lo[:, None], b_y * tl.exp(tl.where(lo[:, None], Rg - b_gy, 0.)), 0.)
        part = tl.dot(Dm.to(DT), ys.to(DT), input_precision=PREC)
        Y += tl.where(hi[:, None], part * tl.exp(tl.where(hi[:, None], b_gxr - Rg, 0.)), 0.)
        if SCALE:
            Dm = Dm * b_c[:, None]
        xs = tl.where(hi[:, None], b_x * tl.exp(tl.where(hi[:, None], b_gxc - Rg, 0.)), 0.)
        part = tl.dot(tl.trans(Dm.to(DT)), xs.to(DT), input_precision=PREC)
        Z += tl.where(lo[:, None], part * tl.exp(tl.where(lo[:, None], Rg - b_gy, 0.)), 0.)
    LEAF: tl.constexpr = SUB >> LEVELS
    ok_k = o_k[None, :]
    mk = m_k[None, :]
    for j0 in range(0, LEAF, UNROLL):
        for jj in tl.static_range(UNROLL):
            s = (o_i // LEAF) * LEAF + j0 + jj      # the step's in-block time, per row of the tile
            # row side: column s of every row t
            ok = (s < o_i) if STRICT else (s <= o_i)
            d = tl.load(Ds + row * BT + s, mask=m_t & ok, other=0.)
            g_s = _g_at(g, a, bos, i_h, i_t, s[:, None], T, H, K, ok_k, mk, BT, False)
            y_s = _rows_at(y, bos, i_h, i_t, s[:, None], T, H, K, ok_k, mk, BT, 0.)
            Y += tl.where(ok[:, None], d[:, None] * y_s * tl.exp(tl.where(ok[:, None], b_gxr - g_s, 0.)), 0.)
            # column side: row s of every column (o_i indexes the columns here)
            ok = (s > o_i) if STRICT else (s >= o_i)
            ts = i_t * BT + s
            rows_s = (bos + tl.minimum(ts, T - 1)).to(tl.int64) * H + i_h
            d = tl.load(Ds + rows_s * BT + o_i, mask=(ts < T) & ok, other=0.)
            if SCALE:
                d = d * tl.load(c + rows_s, mask=ts < T, other=0.).to(tl.float32)
            if SHIFT:
                g_s = g_s - log_decay(tl.load(a + rows_s[:, None] * K + ok_k, mask=(ts < T)[:, None] & mk, other=1.)
                                   .to(tl.float32))
            x_s = _rows_at(x, bos, i_h, i_t, s[:, None], T, H, K, ok_k, mk, BT, 0.)
            Z += tl.where(ok[:, None], d[:, None] * x_s * tl.exp(tl.where(ok[:, None], g_s - b_gy, 0.)), 0.)
    return Y, Z


@triton.jit
def _decays(g, row, m_tk, o_k, m_k, bos, i_h, i_t, T, H, K: tl.constexpr, BT: tl.constexpr):
    """The chunk's cumulative log-decays ``g [BT, BK]`` (0 past T), their value at the chunk's last
    row ``gl [BK]`` and the factors e^{gl - g} (0 past T)."""
    b_g = tl.load(g + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
    last = tl.minimum(T, i_t * BT + BT) - 1
    b_gl = tl.load(g + ((bos + last).to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)
    return b_g, b_gl, tl.where(m_tk, tl.exp(tl.where(m_tk, b_gl[None, :] - b_g, 0.)), 0.)


@triton.jit
def _read_key(u, b_v, b_g, b_gp, p_tk, m_tk, U_MODE: tl.constexpr):
    """The erase's read key and its exponent, (x, gx) with u_t e^{gp_t} = x_t e^{gx_t}: (u, gp),
    or (v, g) where u = a o v."""
    if U_MODE == U_IS_AV:
        return b_v, b_g
    else:
        return tl.load(u + p_tk, mask=m_tk, other=0.).to(tl.float32), b_gp


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------

@tune([triton.Config({}, num_warps=w) for w in (4, 8)],
      key=["H", "K", "V", "BT", "SUB", "LEVELS", "FAST", "U_MODE", "HAS_PS"], prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def rank1_keydecay_chunk_prep_kernel(u, v, p, ps, oq, c, a, g, M, W, Up, L, cu, ci,
                                     T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                     SUB: tl.constexpr, LEVELS: tl.constexpr, FAST: tl.constexpr,
                                     U_MODE: tl.constexpr, HAS_PS: tl.constexpr, PREC: tl.constexpr,
                                     VARLEN: tl.constexpr):
    """Per chunk: g (cumulative log-decay), A, M = (I + A)^{-1}, W [K], Up [V], L [BT].
    HAS_PS: p is scaled by the per-head ``ps`` here (KDA's beta x), so ps x is never formed.
    VARLEN: the chunk is one of a packed row's (``rows.seq_chunk``); T is then its sequence's length."""
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, T, i_t, _ = seq_chunk(cu, ci, tl.program_id(0), i_b, i_h, T, NT, H, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.device_chunks)
        return
    DT = W.dtype.element_ty
    o_i, m_t, row = seq_rows(bos, i_h, i_t, T, H, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    m_tt = m_t[:, None] & (o_i < BT)[None, :]
    p_tk = row[:, None] * K + o_k[None, :]

    b_la = log_decay(tl.load(a + p_tk, mask=m_tk, other=1.).to(tl.float32))
    b_g = tl.cumsum(b_la, axis=0)
    tl.store(g + p_tk, b_g, mask=m_tk)
    b_gp = b_g - b_la
    tl.debug_barrier()       # the diagonal sub-blocks read g back, across the program's threads

    b_c = tl.load(c + row, mask=m_t, other=0.).to(tl.float32)
    b_v = tl.load(v + p_tk, mask=m_tk, other=0.).to(tl.float32)
    b_x, b_gx = _read_key(u, b_v, b_g, b_gp, p_tk, m_tk, U_MODE)
    b_oq = tl.load(oq + p_tk, mask=m_tk, other=0.).to(tl.float32)
    b_A, b_L = gated_lower(b_x, b_gx, b_oq, b_v, b_g, v, g, bos, i_h, i_t, T, H, K, o_k, m_k, BT, SUB, LEVELS,
                           U_MODE == U_IS_AV, FAST, DT, PREC)
    tl.store(L + row[:, None] * BT + o_i[None, :], b_L.to(DT), mask=m_tt)
    b_M = solve_unit_lower(b_A * b_c[:, None], BT, PREC)
    tl.store(M + row[:, None] * BT + o_i[None, :], b_M.to(DT), mask=m_tt)
    b_Md = b_M.to(DT)
    b_cu = (b_x * tl.exp(b_gx) * b_c[:, None]).to(DT)
    tl.store(W + p_tk, tl.dot(b_Md, b_cu, input_precision=PREC).to(DT), mask=m_tk)
    if HAS_PS:
        b_ps = tl.load(ps + row, mask=m_t, other=0.).to(tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_p = tl.load(p + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        if HAS_PS:
            b_p = b_p.to(tl.float32) * b_ps[:, None]
        tl.store(Up + row[:, None] * V + o_v[None, :], tl.dot(b_Md, b_p.to(DT), input_precision=PREC).to(DT), mask=m_tv)


@tune([triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv, w, s in ((32, 4, 2), (64, 4, 2))],
      key=["H", "K", "V", "BT", "STORE_H", "HAS_H0", "STORE_HT"])
@triton.jit(do_not_specialize=["T", "NT"])
def rank1_keydecay_chunk_fwd_state_kernel(v, oq, W, Up, L, g, h0, o, hs, psi, ht, cu, co,
                                          T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                          BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                          STORE_H: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                                          PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Sequential over chunks, one program per (value block, sequence * head): Psi = Up - W H0,
    O = (OQ e^g) H0 + L Psi, H_C = e^{gl} H0 + (V e^{gl - g})^T Psi. STORE_H: keep the chunk
    states and Psi for the backward; HAS_H0 / STORE_HT: read h0 / write the final state.
    VARLEN: sequence ``i_b`` of a packed row (``rows.seq_state``); else batch row ``i_b``."""
    DT = W.dtype.element_ty
    i_bh, i_h, o_k, m_k, o_v, m_v, m_kv, p_kv, b_h, bos, T, n_t, cb = state_scan(
        h0, cu, co, T, NT, H, K, V, BT, BK, BV, HAS_H0, VARLEN)
    for i_t in range(n_t):
        o_i, m_t, row = seq_rows(bos, i_h, i_t, T, H, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_tk = row[:, None] * K + o_k[None, :]
        p_tv = row[:, None] * V + o_v[None, :]
        if STORE_H:
            tl.store(hs + (cb + i_t) * K * V + p_kv, b_h.to(DT), mask=m_kv)
        b_hd = b_h.to(DT)
        b_psi = tl.load(Up + p_tv, mask=m_tv, other=0.).to(tl.float32)
        b_psi -= tl.dot(tl.load(W + p_tk, mask=m_tk, other=0.), b_hd, input_precision=PREC)
        if STORE_H:
            tl.store(psi + p_tv, b_psi.to(DT), mask=m_tv)
        b_psid = b_psi.to(DT)
        b_g, b_gl, b_dec = _decays(g, row, m_tk, o_k, m_k, bos, i_h, i_t, T, H, K, BT)
        b_oq = (tl.load(oq + p_tk, mask=m_tk, other=0.).to(tl.float32) * tl.exp(b_g)).to(DT)
        b_o = tl.dot(b_oq, b_hd, input_precision=PREC)
        b_o += tl.dot(tl.load(L + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.), b_psid,
                      input_precision=PREC)
        tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
        b_vb = (tl.load(v + p_tk, mask=m_tk, other=0.).to(tl.float32) * b_dec).to(DT)
        b_h = b_h * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_vb), b_psid, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_bh.to(tl.int64) * K * V + p_kv, b_h, mask=m_kv)


@tune([triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv, w, s in ((32, 4, 2), (64, 4, 2))],
      key=["H", "K", "V", "BT", "HAS_DHT", "STORE_DH0"])
@triton.jit(do_not_specialize=["T", "NT"])
def rank1_keydecay_chunk_bwd_state_kernel(v, oq, W, L, g, do, dht, dhs, dpsi, dh0, cu, co,
                                          T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                          BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                          HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
                                          VARLEN: tl.constexpr):
    """Reverse over chunks: dH at each chunk's end (``dhs``), dPsi = L^T dO + (V e^{gl - g}) dH,
    and dH0 = e^{gl} dH + (OQ e^g)^T dO - W^T dPsi. VARLEN as the forward."""
    DT = W.dtype.element_ty
    i_bh, i_h, o_k, m_k, o_v, m_v, m_kv, p_kv, b_dh, bos, T, n_t, cb = state_scan(
        dht, cu, co, T, NT, H, K, V, BT, BK, BV, HAS_DHT, VARLEN)
    for j in range(n_t):
        i_t = n_t - 1 - j
        o_i, m_t, row = seq_rows(bos, i_h, i_t, T, H, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_tk = row[:, None] * K + o_k[None, :]
        p_tv = row[:, None] * V + o_v[None, :]
        tl.store(dhs + (cb + i_t) * K * V + p_kv, b_dh.to(DT), mask=m_kv)
        b_g, b_gl, b_dec = _decays(g, row, m_tk, o_k, m_k, bos, i_h, i_t, T, H, K, BT)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.)
        b_vb = (tl.load(v + p_tk, mask=m_tk, other=0.).to(tl.float32) * b_dec).to(DT)
        b_oq = (tl.load(oq + p_tk, mask=m_tk, other=0.).to(tl.float32) * tl.exp(b_g)).to(DT)
        b_L = tl.load(L + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.)
        b_dpsi = tl.dot(tl.trans(b_L), b_do, input_precision=PREC)
        b_dpsi += tl.dot(b_vb, b_dh.to(DT), input_precision=PREC)
        b_dpsid = b_dpsi.to(DT)
        tl.store(dpsi + p_tv, b_dpsid, mask=m_tv)
        b_dh = b_dh * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_oq), b_do, input_precision=PREC)
        b_dh -= tl.dot(tl.trans(tl.load(W + p_tk, mask=m_tk, other=0.)), b_dpsid, input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_bh.to(tl.int64) * K * V + p_kv, b_dh, mask=m_kv)


@triton.jit
def _grad_program(cu, ci, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, T, NT, BT: tl.constexpr,
                  BK: tl.constexpr, VARLEN: tl.constexpr):
    """A chunk's program in the gradient kernels' grid (chunk, batch * head): (i_t, bos, T, i_h,
    o_i, m_t, row, o_k, m_k, m_tk, p_tk, m_tt, base) with ``bos`` and T its sequence's first row and
    length (``rows.seq_chunk``), ``base`` the offset of its chunk state. ``i_t < 0``: a chunk past the
    packed row's last (``rows.device_chunks``), where the caller returns."""
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, T, i_t, cb = seq_chunk(cu, ci, tl.program_id(0), i_b, i_h, T, NT, H, VARLEN)
    o_i, m_t, row = seq_rows(bos, i_h, i_t, T, H, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    m_tt = m_t[:, None] & (o_i < BT)[None, :]
    base = (cb + i_t) * K * V
    return i_t, bos, T, i_h, o_i, m_t, row, o_k, m_k, m_tk, row[:, None] * K + o_k[None, :], m_tt, base


@tune([triton.Config({}, num_warps=w) for w in (4, 8)],
      key=["H", "K", "V", "BT", "SUB", "LEVELS", "UNROLL", "FAST", "U_MODE", "HAS_PS"], prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def rank1_keydecay_chunk_bwd_wy_kernel(u, v, p, ps, c, a, g, M, hs, dpsi, Ds, du, dp, dps, dc, dvs, dlas, cu, ci,
                                       T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                       SUB: tl.constexpr, LEVELS: tl.constexpr, UNROLL: tl.constexpr,
                                       FAST: tl.constexpr, U_MODE: tl.constexpr, HAS_PS: tl.constexpr,
                                       PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Per chunk, the gradients through the WY transform (Psi = M P - W H0, W = M diag(c) U e^{gp},
    M = (I + A)^{-1}): dp (and dps), dc, du (or, where u = a o v, its share of dv and d log a),
    and this half's share of dv and d log a, kept in fp32 (``dvs``, ``dlas``) for
    ``rank1_keydecay_chunk_bwd_out_kernel``. The backward is split in two kernels so that fewer
    tiles are live in each. dA stays in ``Ds`` (per chunk row, fp32)."""
    i_t, bos, T, i_h, o_i, m_t, row, o_k, m_k, m_tk, p_tk, m_tt, base = _grad_program(cu, ci, H, K, V, T, NT, BT,
                                                                                     BK, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.device_chunks)
        return
    DT = M.dtype.element_ty
    lower = o_i[:, None] > o_i[None, :]
    b_M = tl.load(M + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.)

    # dPsi H0^T (= -dW), dPsi P^T and dP = M^T dPsi, over value blocks
    b_nW = tl.zeros([BT, BK], dtype=tl.float32)
    b_dPM = tl.zeros([BT, BT], dtype=tl.float32)
    if HAS_PS:
        b_ps = tl.load(ps + row, mask=m_t, other=0.).to(tl.float32)
        b_dps = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v, m_v, m_tv, m_kv = value_block(i_v, V, m_t, m_k, BV)
        p_tv = row[:, None] * V + o_v[None, :]
        b_h = tl.load(hs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dpsi = tl.load(dpsi + p_tv, mask=m_tv, other=0.)
        b_p = tl.load(p + p_tv, mask=m_tv, other=0.)
        b_dp = tl.dot(tl.trans(b_M), b_dpsi, input_precision=PREC)
        if HAS_PS:
            b_p0 = b_p.to(tl.float32)
            b_dps += tl.sum(b_dp * b_p0, axis=1)
            b_dp = b_dp * b_ps[:, None]
            b_p = b_p0 * b_ps[:, None]
        b_nW += tl.dot(b_dpsi, tl.trans(b_h), input_precision=PREC)
        b_dPM += tl.dot(b_dpsi, tl.trans(b_p.to(DT)), input_precision=PREC)
        tl.store(dp + p_tv, b_dp.to(dp.dtype.element_ty), mask=m_tv)
    if HAS_PS:
        tl.store(dps + row, b_dps.to(dps.dtype.element_ty), mask=m_t)

    b_c = tl.load(c + row, mask=m_t, other=0.).to(tl.float32)
    # flat past T, as in the forward: the sub-block references stay at or above every later row's
    b_g = _g_at(g, a, bos, i_h, i_t, o_i[:, None], T, H, K, o_k[None, :], m_k[None, :], BT, False)
    b_gp = b_g - log_decay(tl.load(a + p_tk, mask=m_tk, other=1.).to(tl.float32))
    b_v = tl.load(v + p_tk, mask=m_tk, other=0.).to(tl.float32)
    b_x, b_gx = _read_key(u, b_v, b_g, b_gp, p_tk, m_tk, U_MODE)
    b_ug = b_x * tl.exp(b_gx)
    b_dWd = (-b_nW).to(DT)
    b_T1 = tl.dot(tl.trans(b_M), b_dWd, input_precision=PREC)            # d(diag(c) U e^{gp})
    b_dc = tl.sum(b_T1 * b_ug, axis=1)
    b_du = b_T1 * b_c[:, None] * tl.exp(b_gx)      # d x and d gx: (u, gp), or (v, g) where u = a o v
    b_dgx = b_T1 * b_c[:, None] * b_ug
    b_dM = b_dPM + tl.dot(b_dWd, tl.trans((b_ug * b_c[:, None]).to(DT)), input_precision=PREC)
    b_X = tl.dot(tl.trans(b_M), b_dM.to(DT), input_precision=PREC)
    b_dA = tl.where(lower, -tl.dot(b_X.to(DT), tl.trans(b_M), input_precision=PREC), 0.)
    # A[t, s] = c_t sum_k u_tk v_sk e^{gp_tk - g_sk}
    tl.store(Ds + row[:, None] * BT + o_i[None, :], b_dA, mask=m_tt)
    tl.debug_barrier()       # the diagonal sub-blocks read dA back, across the program's threads
    if U_MODE == U_IS_AV:
        b_Y, b_Z = gated_grads(b_dA, b_c, Ds, c, b_v, b_gx, b_x, b_gx, b_g, v, v, g, a, row, m_t, bos,
                               i_h, i_t, T, H, K, o_k, m_k, BT, SUB, LEVELS, UNROLL, False, True, True, FAST, DT, PREC)
    else:
        b_Y, b_Z = gated_grads(b_dA, b_c, Ds, c, b_v, b_gx, b_x, b_gx, b_g, v, u, g, a, row, m_t, bos,
                               i_h, i_t, T, H, K, o_k, m_k, BT, SUB, LEVELS, UNROLL, True, True, True, FAST, DT, PREC)
    b_dc += tl.sum(b_Y * b_x, axis=1)
    b_du += b_Y * b_c[:, None]
    b_dgx += b_Y * b_c[:, None] * b_x
    tl.store(dc + row, b_dc.to(dc.dtype.element_ty), mask=m_t)
    if U_MODE == U_IS_AV:
        b_dla = tl.cumsum(b_dgx - b_v * b_Z, axis=0, reverse=True)
        b_Z += b_du
    else:
        # g_t = sum_{r<=t} log a_r and gp_t = sum_{r<t} log a_r within the chunk
        b_dla = tl.cumsum(-b_v * b_Z, axis=0, reverse=True) + tl.cumsum(b_dgx, axis=0, reverse=True) - b_dgx
        tl.store(du + p_tk, b_du.to(du.dtype.element_ty), mask=m_tk)
    tl.store(dvs + p_tk, b_Z, mask=m_tk)
    tl.store(dlas + p_tk, b_dla, mask=m_tk)


@tune([triton.Config({}, num_warps=w) for w in (4, 8)], key=["H", "K", "V", "BT", "SUB", "LEVELS", "UNROLL", "FAST"],
      prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def rank1_keydecay_chunk_bwd_out_kernel(v, oq, a, g, hs, dhs, psi, do, Ds, dvs, dlas, dv, doq, da, cu, ci,
                                        T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                        SUB: tl.constexpr, LEVELS: tl.constexpr, UNROLL: tl.constexpr,
                                        FAST: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Per chunk, the gradients through the readout O = (OQ e^g) H0 + L Psi and the state's
    (V e^{gl - g})^T Psi: doq, and dv and da (as d log a / a) with the WY half's shares (``dvs``, ``dlas``)
    added. dL goes to ``Ds`` (per chunk row, fp32: the host passes a buffer other than the WY kernel's
    where ``rank1_keydecay_chunk_bwd_da_kernel`` reads both)."""
    i_t, bos, T, i_h, o_i, m_t, row, o_k, m_k, m_tk, p_tk, m_tt, base = _grad_program(cu, ci, H, K, V, T, NT, BT,
                                                                                     BK, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.device_chunks)
        return
    DT = psi.dtype.element_ty
    incl = o_i[:, None] >= o_i[None, :]
    b_dOQ, b_dL, b_dVb, b_hdh = readout_grads(hs, dhs, psi, do, base, row, row, m_t, m_t, o_k, m_k, V, True, BT, BT,
                                              BK, BV, PREC)
    b_g = _g_at(g, a, bos, i_h, i_t, o_i[:, None], T, H, K, o_k[None, :], m_k[None, :], BT, False)
    b_v = tl.load(v + p_tk, mask=m_tk, other=0.).to(tl.float32)
    b_oq = tl.load(oq + p_tk, mask=m_tk, other=0.).to(tl.float32)
    b_doq = b_dOQ * tl.exp(b_g)
    b_dL = tl.where(incl, b_dL, 0.)
    tl.store(Ds + row[:, None] * BT + o_i[None, :], b_dL, mask=m_tt)
    tl.debug_barrier()       # the diagonal sub-blocks read dL back, across the program's threads
    b_Yl, b_dv = gated_grads(b_dL, m_t, Ds, oq, b_v, b_g, b_oq, b_g, b_g, v, oq, g, a, row, m_t, bos, i_h, i_t, T, H, K,
                             o_k, m_k, BT, SUB, LEVELS, UNROLL, False, False, False, FAST, DT, PREC)
    b_doq += b_Yl
    tl.store(doq + p_tk, b_doq.to(doq.dtype.element_ty), mask=m_tk)
    b_dg = b_doq * b_oq
    last = tl.minimum(T, i_t * BT + BT) - 1
    b_gl = tl.load(g + ((bos + last).to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)
    b_a = tl.load(a + p_tk, mask=m_tk, other=1.).to(tl.float32)
    b_dVb = b_dVb * tl.where(m_tk, tl.exp(tl.where(m_tk, b_gl[None, :] - b_g, 0.)), 0.)
    b_dv += b_dVb
    b_dg -= (b_dv * b_v)          # the column side of L and the state term: -v (Zl + dVb e^{gl - g})
    b_dgl = tl.sum(b_dVb * b_v, axis=0) + tl.exp(b_gl) * b_hdh
    # g_t = sum_{r<=t} log a_r, gl = sum_r log a_r over the chunk's rows
    b_dla = tl.cumsum(b_dg, axis=0, reverse=True) + b_dgl[None, :] + tl.load(dlas + p_tk, mask=m_tk, other=0.)
    tl.store(da + p_tk, (b_dla / b_a).to(da.dtype.element_ty), mask=m_tk)
    b_dv += tl.load(dvs + p_tk, mask=m_tk, other=0.)
    tl.store(dv + p_tk, b_dv.to(dv.dtype.element_ty), mask=m_tk)


@tune(DA_CONFIGS, key=["H", "K", "V", "BT", "U_MODE"], prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def rank1_keydecay_chunk_bwd_da_kernel(da, a, u, v, c, oq, M, hs, dhs, psi, dpsi, do, Ds, Dl, cu, ci, T, NT,
                                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                                       BK: tl.constexpr, BV: tl.constexpr, U_MODE: tl.constexpr, PREC: tl.constexpr,
                                       VARLEN: tl.constexpr):
    """Per (key block, chunk) holding a decay below e^LOG_EXACT_DA (others return at once): d a rewritten
    term by term, per key (``tiles.key_decay_grad``: each factor's coefficient times the other decays in
    its span), where d log a / a has lost its digits (and is NaN at a = 0). From what the backward kept:
    A's pairs dA c x v (dA in ``Ds``) and W's start factors T1 c x, row exponent gx (g where u = a o v,
    else gp); L's pairs dL oq v (dL in ``Dl``), O's start factors dOQ oq with the state's h0 . dH at the
    last row (its e^{gl} is O's there) and Vbar's end factors dVb v: T1 = -M^T dPsi h0^T, dOQ = dO h0^T
    and dVb = Psi dH^T taken again over value blocks, as the gradient kernels form them. A kernel of its
    own, launched after ``rank1_keydecay_chunk_bwd_out_kernel``, that writes nothing but ``da``: with
    the term-by-term sums inside the gradient kernels, ptxas spilled 30 to 60 % more in every chunk."""
    i_t, cb, o_i, m_t, row, o_k, m_k, p, m = key_block_chunk(cu, ci, T, NT, H, K, BT, BK, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.seq_chunk)
        return
    b_la = log_decay(tl.load(a + p, mask=m, other=1.).to(tl.float32))
    if tl.min(tl.min(b_la, axis=1), axis=0) < LOG_EXACT_DA:
        base = (cb + i_t) * K * V
        b_nW = tl.zeros([BT, BK], dtype=tl.float32)      # dPsi h0^T (= -dW)
        b_dOQ = tl.zeros([BT, BK], dtype=tl.float32)     # dO h0^T
        b_dVb = tl.zeros([BT, BK], dtype=tl.float32)     # Psi dH^T
        b_hdh = tl.zeros([BK], dtype=tl.float32)         # sum_v h0 dH
        # every product on fp32 tiles: N is a config's key block (16 or 32), below the least block of a
        # 16-bit product on Hopper (``chunked._block_floor``); on bf16 tiles at a key block of 16 (the
        # autotuner's usual pick) this kernel gave NaN in d a on an H200 at chunks of 64, in half the runs
        for i_v in range(tl.cdiv(V, BV)):
            o_v, m_v, m_tv, m_kv = value_block(i_v, V, m_t, m_k, BV)
            p_tv = row[:, None] * V + o_v[None, :]
            p_kv = base + o_k[:, None] * V + o_v[None, :]
            b_h = tl.load(hs + p_kv, mask=m_kv, other=0.).to(tl.float32)
            b_dh = tl.load(dhs + p_kv, mask=m_kv, other=0.).to(tl.float32)
            b_nW += tl.dot(tl.load(dpsi + p_tv, mask=m_tv, other=0.).to(tl.float32), tl.trans(b_h), input_precision=PREC)
            b_dOQ += tl.dot(tl.load(do + p_tv, mask=m_tv, other=0.).to(tl.float32), tl.trans(b_h), input_precision=PREC)
            b_dVb += tl.dot(tl.load(psi + p_tv, mask=m_tv, other=0.).to(tl.float32), tl.trans(b_dh), input_precision=PREC)
            b_hdh += tl.sum(b_h * b_dh, axis=1)
        b_M = tl.load(M + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.).to(tl.float32)
        b_T1 = tl.dot(tl.trans(b_M), -b_nW, input_precision=PREC)
        b_g = tl.cumsum(b_la, axis=0)                   # rows past T: log 1 = 0, the sums stay flat
        b_gp = b_g - b_la
        b_gl = tl.sum(tl.where((o_i == BT - 1)[:, None], b_g, 0.), axis=0)
        b_v = tl.load(v + p, mask=m, other=0.).to(tl.float32)
        if U_MODE == U_IS_AV:
            b_x = b_v
        else:
            b_x = tl.load(u + p, mask=m, other=0.).to(tl.float32)
        b_xc = b_x * tl.load(c + row, mask=m_t, other=0.).to(tl.float32)[:, None]
        b_zero = tl.zeros([BK], dtype=tl.float32)
        b_da = key_decay_grad(tl.load(Ds + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.), b_xc, b_v,
                              b_T1 * b_xc, tl.zeros_like(b_v), b_zero, b_g, b_gp, b_gl, o_i, U_MODE == U_GIVEN, BK,
                              PREC)
        b_oq = tl.load(oq + p, mask=m, other=0.).to(tl.float32)
        b_da += key_decay_grad(tl.load(Dl + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.), b_oq, b_v,
                               b_dOQ * b_oq, b_dVb * b_v, b_hdh, b_g, b_gp, b_gl, o_i, False, BK, PREC)
        tl.store(da + p, b_da.to(da.dtype.element_ty), mask=m)
