"""Triton kernels of the per-row rank-1 family's forward (``ssmcraft.ops.rank1_row.recurrent`` has the
recurrence, the host side and the reasons behind the layout), and the loads its backward shares.

Arguments are grouped so that a helper takes a handful of them: ``vecs = (U, Vv, Q, OQ)`` the
K-vector slots, ``rows = (A, C, P, OC, OH)`` the row coefficients (``None`` where the slot is a
constant), ``ix = (offs_k, mask_k, offs_v, mask_v)`` a program's tile indices; the compile-time
``MODES`` (per row coefficient: 0 the constant of ``CONSTS``, 1 per head, 2 per row; the decay
``a`` also 3: per key, a ``[B,T,H,K]`` vector that scales the state's columns) and
``GROUPS`` (for v, q, oq: the index of the first of u, v, q, oq that is the same tensor, so a
shared key is loaded once). A pointer passed as ``None`` is a compile-time absence (no initial
state, no side output), not a flag plus a stand-in tensor.
"""
from __future__ import annotations

import triton
import triton.language as tl

# positions in ``rows``, ``MODES`` and ``CONSTS``
IA, IC, IP, IOC, IOH = (tl.constexpr(i) for i in range(5))


@triton.jit
def load_coef(ptr, row, V, offs_v, mask_v, MODE: tl.constexpr, CONST: tl.constexpr, BV: tl.constexpr):
    """A row coefficient at one step (``row`` = (b*T + t)*H + h) as a [BV] fp32 vector."""
    if MODE == 2:
        x = tl.load(ptr + row * V + offs_v, mask=mask_v, other=0.).to(tl.float32)
    elif MODE == 1:
        x = tl.zeros([BV], dtype=tl.float32) + tl.load(ptr + row).to(tl.float32)
    else:
        x = tl.zeros([BV], dtype=tl.float32) + CONST
    return x


@triton.jit
def load_decay(ptr, row, K, V, ix, MODE: tl.constexpr, CONST: tl.constexpr, BV: tl.constexpr):
    """The decay ``a`` at one step: a [BV] fp32 row vector (``load_coef``), or per key
    (``MODE`` 3) a [BK] fp32 key vector."""
    if MODE == 3:
        x = tl.load(ptr + row * K + ix[0], mask=ix[1], other=0.).to(tl.float32)
    else:
        x = load_coef(ptr, row, V, ix[2], ix[3], MODE, CONST, BV)
    return x


@triton.jit
def load_vecs(vecs, base, offs_k, mask_k, GROUPS: tl.constexpr):
    """u, v, q, oq at one step ([BK] fp32 each), each distinct tensor loaded once."""
    u = tl.load(vecs[0] + base + offs_k, mask=mask_k, other=0.).to(tl.float32)
    if GROUPS[0] == 0:
        v = u
    else:
        v = tl.load(vecs[1] + base + offs_k, mask=mask_k, other=0.).to(tl.float32)
    if GROUPS[1] == 0:
        q = u
    elif GROUPS[1] == 1:
        q = v
    else:
        q = tl.load(vecs[2] + base + offs_k, mask=mask_k, other=0.).to(tl.float32)
    if GROUPS[2] == 0:
        oq = u
    elif GROUPS[2] == 1:
        oq = v
    elif GROUPS[2] == 2:
        oq = q
    else:
        oq = tl.load(vecs[3] + base + offs_k, mask=mask_k, other=0.).to(tl.float32)
    return u, v, q, oq


@triton.jit
def load_slots(vecs, rows, row, K, V, ix, MODES: tl.constexpr, CONSTS: tl.constexpr, GROUPS: tl.constexpr,
               BV: tl.constexpr):
    """Every slot at one step: (u, v, q, oq, a, c, p, oc, oh)."""
    u, v, q, oq = load_vecs(vecs, row * K, ix[0], ix[1], GROUPS)
    a = load_decay(rows[IA], row, K, V, ix, MODES[IA], CONSTS[IA], BV)
    c = load_coef(rows[IC], row, V, ix[2], ix[3], MODES[IC], CONSTS[IC], BV)
    p = load_coef(rows[IP], row, V, ix[2], ix[3], MODES[IP], CONSTS[IP], BV)
    oc = load_coef(rows[IOC], row, V, ix[2], ix[3], MODES[IOC], CONSTS[IOC], BV)
    oh = load_coef(rows[IOH], row, V, ix[2], ix[3], MODES[IOH], CONSTS[IOH], BV)
    return u, v, q, oq, a, c, p, oc, oh


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the cache lines behind ``ptrs`` (no register result is waited on)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_slots(vecs, rows, row, K, V, ix, MODES: tl.constexpr, GROUPS: tl.constexpr):
    """L2 prefetch of one (future) step's slot tensors; the caller clamps ``row`` to the sequence."""
    prefetch_l2(vecs[0] + row * K + ix[0])
    if GROUPS[0] == 1:
        prefetch_l2(vecs[1] + row * K + ix[0])
    if GROUPS[1] == 2:
        prefetch_l2(vecs[2] + row * K + ix[0])
    if GROUPS[2] == 3:
        prefetch_l2(vecs[3] + row * K + ix[0])
    if MODES[IA] == 2:
        prefetch_l2(rows[IA] + row * V + ix[2])
    if MODES[IA] == 3:
        prefetch_l2(rows[IA] + row * K + ix[0])
    if MODES[IC] == 2:
        prefetch_l2(rows[IC] + row * V + ix[2])
    if MODES[IP] == 2:
        prefetch_l2(rows[IP] + row * V + ix[2])


@triton.jit
def row_tile(V, K, BV: tl.constexpr, BK: tl.constexpr):
    """A program's tile: ``ix = (offs_k, mask_k, offs_v, mask_v)`` of rows [iv*BV, iv*BV+BV)
    (``iv`` program axis 1), its state mask and the offsets of a [K, V] state tile."""
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    mask_v = offs_v < V
    mask_k = offs_k < K
    return (offs_k, mask_k, offs_v, mask_v), mask_k[:, None] & mask_v[None, :], offs_k[:, None] * V + offs_v[None, :]


@triton.jit
def store_checkpoint(CKP, stride, s, t, valid, NC, tile, mask_s, CHUNK: tl.constexpr):
    """After step t: the state before step t+1 as checkpoint (t+1)/CHUNK when that is one
    (checkpoint j, at ``CKP + j * stride``, holds the state before step j*CHUNK)."""
    if CKP is not None:
        if (t + 1) % CHUNK == 0:
            if ((t + 1) // CHUNK < NC) & valid:
                tl.store(CKP + ((t + 1) // CHUNK) * stride + tile, s, mask=mask_s)


@triton.jit
def seq_rows(CU, CO, i_bh, b, h, T, NC, CHUNK: tl.constexpr, VARLEN: tl.constexpr):
    """Program row ``b``'s time steps: (its first token row (int64), its length, the int64 index of its
    first checkpoint, its checkpoint count). VARLEN: sequence ``b`` of a packed row (``CU`` its
    offsets, ``CO`` each sequence's first checkpoint in ``[H, NC, K, V]``, NC every sequence's
    checkpoints together, T the packed row's length: an empty sequence has no checkpoint, and its
    first row is clamped into the row, as its loads are never used);
    else batch row ``b`` of ``T`` steps, checkpoints ``[B, H, NC, K, V]``."""
    if VARLEN:
        bos = tl.load(CU + b).to(tl.int64)
        T_s = tl.load(CU + b + 1) - tl.load(CU + b)
        return tl.minimum(bos, T - 1), T_s, h.to(tl.int64) * NC + tl.load(CO + b), tl.cdiv(T_s, CHUNK)
    else:
        return b.to(tl.int64) * T, T, i_bh.to(tl.int64) * NC, NC


@triton.jit
def decayed(a, s, KD: tl.constexpr):
    """a s on a [BK, BV] tile: ``a`` per row ([BV]), or per key ([BK], ``KD``)."""
    if KD:
        x = a[:, None] * s
    else:
        x = a[None, :] * s
    return x


@triton.jit
def transition(s, a, c, z, v, q, p, QV: tl.constexpr, KD: tl.constexpr = False):
    """s_t = a s_{t-1} - (c z) v + p q on a [BK, BV] tile, given z = s_{t-1} . u; ``QV``: q is v
    (Longhorn's keys), one product per element: a s + (p - c z) v. ``KD``: ``a`` per key."""
    if QV:
        return decayed(a, s, KD) + v[:, None] * (p - c * z)[None, :]
    return decayed(a, s, KD) - v[:, None] * (c * z)[None, :] + q[:, None] * p[None, :]


@triton.jit
def identity_unless(valid, a, c, p):
    """(a, c, p) of a step, or of the identity step (1, 0, 0) where not ``valid``: a skipped step
    selects on row vectors instead of on the state tile."""
    return tl.where(valid, a, 1.), tl.where(valid, c, 0.), tl.where(valid, p, 0.)


@triton.jit
def fwd_step(s, sl, t, t_end, row, V, ix, Y, Z, CKP, ck_index, NC, tile, mask_s, CHUNK: tl.constexpr,
             QV: tl.constexpr, KD: tl.constexpr = False):
    """One step (a no-op when t >= t_end) on the slot set ``sl``: update s, store y (and z, and
    the checkpoint ``CKP + ck_index * K * V`` every CHUNK steps)."""
    u, v, q, oq, a, c, p, oc, oh = sl
    offs_v, mask_v = ix[2], ix[3]
    valid = t < t_end
    z = tl.sum(s * u[:, None], axis=0)
    a, c, p = identity_unless(valid, a, c, p)
    s = transition(s, a, c, z, v, q, p, QV, KD)
    y = oc * tl.sum(s * oq[:, None], axis=0) + oh
    tl.store(Y + row * V + offs_v, y.to(Y.dtype.element_ty), mask=mask_v & valid)
    if Z is not None:
        tl.store(Z + row * V + offs_v, z, mask=mask_v & valid)
    store_checkpoint(CKP, ck_index, s, t, valid, NC, tile, mask_s, CHUNK)
    return s


@triton.jit
def rank1_row_fwd_kernel(
    U, Vv, Q, OQ, A, C, P, OC, OH,            # slots ([B,T,H,K] / [B,T,H,V] / [B,T,H]; None: a constant)
    S0, s0_sb, s0_sh, s0_sg, s0_sk, s0_sv,    # initial state(s) [B,H,(NSEG),K,V] via strides, or None
    Y, ST, Z, CK,                             # y [B,T,H,V]; S_T [B,H,K,V]; z [B,T,H,V]; ckpt [B,H,NC,K,V] (or None)
    CU, CO,                                   # VARLEN: offsets [N+1], each sequence's first checkpoint [N]
    T, H, V, K, SEG, NC,
    BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr, PF: tl.constexpr,
    MODES: tl.constexpr, CONSTS: tl.constexpr, GROUPS: tl.constexpr, VARLEN: tl.constexpr = False,
):
    """One program: rows [iv*BV, iv*BV+BV) of head (b, h), steps [seg*SEG, seg*SEG+SEG).
    VARLEN: program row ``b`` is sequence ``b`` of a packed row (``seq_rows``), SEG >= its length.

    The state tile is held transposed, [BK, BV], so that each row's K values sit in few
    threads (reductions over K in registers). The loop runs 4 steps per iteration with a
    4-step-deep register prefetch (set j is refilled with step t+4+j right after step t+j
    consumed it) and, on the GPU, an L2 prefetch PF steps ahead: the recurrence is latency
    bound, so the loads must be in flight long before their step.
    """
    i_bh = tl.program_id(0)
    i_s = tl.program_id(2)
    b = i_bh // H
    h = i_bh % H
    ix, mask_s, tile = row_tile(V, K, BV, BK)
    offs_k, offs_v = ix[0], ix[2]
    vecs = (U, Vv, Q, OQ)
    rows = (A, C, P, OC, OH)
    QV: tl.constexpr = GROUPS[1] == GROUPS[0]
    KD: tl.constexpr = MODES[IA] == 3
    base, T, cb, NC = seq_rows(CU, CO, i_bh, b, h, T, NC, CHUNK, VARLEN)
    t_begin = i_s * SEG
    t_end = tl.minimum(t_begin + SEG, T)
    t_last = t_end - 1
    if VARLEN:
        t_last = tl.maximum(t_last, 0)     # an empty sequence's loads read row base, never used

    s = tl.zeros([BK, BV], dtype=tl.float32)
    if S0 is not None:
        p_s0 = S0 + b.to(tl.int64) * s0_sb + h * s0_sh + i_s * s0_sg + offs_k[:, None] * s0_sk + offs_v[None, :] * s0_sv
        s += tl.load(p_s0, mask=mask_s, other=0.).to(tl.float32)
    CKP = CK
    if CK is not None:
        CKP = CK + cb * K * V
        if i_s == 0:
            if (NC > 0) | (not VARLEN):               # an empty sequence has no checkpoint
                tl.store(CKP + tile, s, mask=mask_s)  # checkpoint 0 is the initial state

    s0_ = load_slots(vecs, rows, (base + tl.minimum(t_begin + 0, t_last)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    s1_ = load_slots(vecs, rows, (base + tl.minimum(t_begin + 1, t_last)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    s2_ = load_slots(vecs, rows, (base + tl.minimum(t_begin + 2, t_last)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    s3_ = load_slots(vecs, rows, (base + tl.minimum(t_begin + 3, t_last)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    for tb in range(t_begin, t_end, 4):
        if PF > 0:
            prefetch_slots(vecs, rows, (base + tl.minimum(tb + PF, t_last)) * H + h, K, V, ix, MODES, GROUPS)
            prefetch_slots(vecs, rows, (base + tl.minimum(tb + PF + 2, t_last)) * H + h, K, V, ix, MODES, GROUPS)
        row = (base + tb) * H + h
        s = fwd_step(s, s0_, tb + 0, t_end, row, V, ix, Y, Z, CKP, K * V, NC, tile, mask_s, CHUNK, QV, KD)
        s0_ = load_slots(vecs, rows, (base + tl.minimum(tb + 4, t_last)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
        s = fwd_step(s, s1_, tb + 1, t_end, row + H, V, ix, Y, Z, CKP, K * V, NC, tile, mask_s, CHUNK, QV, KD)
        s1_ = load_slots(vecs, rows, (base + tl.minimum(tb + 5, t_last)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
        s = fwd_step(s, s2_, tb + 2, t_end, row + 2 * H, V, ix, Y, Z, CKP, K * V, NC, tile, mask_s, CHUNK, QV, KD)
        s2_ = load_slots(vecs, rows, (base + tl.minimum(tb + 6, t_last)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
        s = fwd_step(s, s3_, tb + 3, t_end, row + 3 * H, V, ix, Y, Z, CKP, K * V, NC, tile, mask_s, CHUNK, QV, KD)
        s3_ = load_slots(vecs, rows, (base + tl.minimum(tb + 7, t_last)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    if ST is not None:
        tl.store(ST + i_bh.to(tl.int64) * K * V + tile, s, mask=mask_s)


@triton.jit
def rank1_row_segment_kernel(
    U, Vv, Q, OQ, A, C, P,
    PR, LOC,                                   # [B*H, NSEG, K, K, V], [B*H, NSEG, K, V]
    T, H, V, K, SEG, NSEG,
    BV: tl.constexpr, BK: tl.constexpr, MODES: tl.constexpr, CONSTS: tl.constexpr, GROUPS: tl.constexpr,
):
    """Time-chunked forward, phase 1: per segment, each row's transition product
    P_i = M_{t0} ... M_{t1-1} (M = a I - c u v^T, s_t = s_{t-1} M + p q^T), held as
    pm[r, j, i] = (P_i)_{rj}, and the segment's end state from a zero start."""
    i_bh = tl.program_id(0)
    i_s = tl.program_id(2)
    b = i_bh // H
    h = i_bh % H
    ix, mask_s, tile = row_tile(V, K, BV, BK)
    offs_k, mask_k, offs_v, mask_v = ix
    vecs = (U, Vv, Q, OQ)
    rows = (A, C, P, None, None)
    eye = (offs_k[:, None] == offs_k[None, :]).to(tl.float32)
    pm = tl.zeros([BK, BK, BV], dtype=tl.float32) + eye[:, :, None]
    s = tl.zeros([BK, BV], dtype=tl.float32)
    t0 = i_s * SEG
    t1 = tl.minimum(t0 + SEG, T)
    for t in range(t0, t1):
        u, v, q, oq, a, c, p, oc, oh = load_slots(vecs, rows, (b.to(tl.int64) * T + t) * H + h, K, V, ix,
                                                  MODES, CONSTS, GROUPS, BV)
        z = tl.sum(s * u[:, None], axis=0)
        s = transition(s, a, c, z, v, q, p, GROUPS[1] == GROUPS[0])
        pu = tl.sum(pm * u[None, :, None], axis=1)                         # [BK(r), BV]
        pm = a[None, None, :] * pm - (pu * c[None, :])[:, None, :] * v[None, :, None]
    base = (i_bh.to(tl.int64) * NSEG + i_s) * K
    tl.store(LOC + (base + offs_k[:, None]) * V + offs_v[None, :], s, mask=mask_s)
    p_pr = PR + ((base + offs_k[:, None, None]) * K + offs_k[None, :, None]) * V + offs_v[None, None, :]
    tl.store(p_pr, pm, mask=mask_k[:, None, None] & mask_s[None, :, :])


@triton.jit
def rank1_row_propagate_kernel(
    S0, s0_sb, s0_sh, s0_sk, s0_sv, PR, LOC, SS,
    H, V, K, NSEG,
    BV: tl.constexpr, BK: tl.constexpr,
):
    """Time-chunked forward, phase 2: segment start states SS[g] = SS[g-1] P_{g-1} + local end
    (``S0`` None: a zero initial state)."""
    i_bh = tl.program_id(0)
    b = i_bh // H
    h = i_bh % H
    ix, mask_s, tile = row_tile(V, K, BV, BK)
    offs_k, mask_k, offs_v, mask_v = ix
    s = tl.zeros([BK, BV], dtype=tl.float32)
    if S0 is not None:
        s += tl.load(S0 + b.to(tl.int64) * s0_sb + h * s0_sh + offs_k[:, None] * s0_sk + offs_v[None, :] * s0_sv,
                     mask=mask_s, other=0.).to(tl.float32)
    for g in range(0, NSEG):
        base = (i_bh.to(tl.int64) * NSEG + g) * K
        tl.store(SS + (base + offs_k[:, None]) * V + offs_v[None, :], s, mask=mask_s)
        pm = tl.load(PR + ((base + offs_k[:, None, None]) * K + offs_k[None, :, None]) * V + offs_v[None, None, :],
                     mask=mask_k[:, None, None] & mask_s[None, :, :], other=0.)
        loc = tl.load(LOC + (base + offs_k[:, None]) * V + offs_v[None, :], mask=mask_s, other=0.)
        s = tl.sum(s[:, None, :] * pm, axis=0) + loc
