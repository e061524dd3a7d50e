"""Triton kernel of the per-row rank-1 family's backward (the adjoint is derived in
``ssmcraft.ops.rank1_row.recurrent``'s docstring; argument groups as in ``rank1_row_fwd``).

The reverse sweep needs ``s_{t-1}`` at every step. The forward stores ``z = s_{t-1} . u`` (one
scalar per row and step), the state every ``CHUNK`` steps and the final state. Then:

- ``SCR`` None (``a == 1``: Longhorn, DeltaNet): ``s_{t-1} = s_t + c z v - p q`` exactly from
  the stored ``z``, reset to the stored checkpoint at every chunk start;
- otherwise (a decay), chunk by chunk (``CHUNK`` = ``DECAY_CHUNK`` steps), one of two ways:
  - where the chunk's decays are mild, by the same walk divided by the decay,
    ``s_{t-1} = (s_t + c z v - p q) / a``, from the chunk's end state (the next chunk's checkpoint or
    the final state, both exact). Dividing by ``a`` amplifies a rounding error by ``1/|a|`` per step,
    so over the chunk by at most ``prod 1/|a|`` (per row or per key: the largest over the program's
    rows or keys); the walk is taken where that bound is at most ``2^BITS``
    (``recurrent.DIVIDE_BITS``: bits of fp32 lost, far fewer than bf16 I/O loses), and the error
    does not carry past the chunk (the next chunk restarts from its exact end state);
  - elsewhere, the states are rebuilt from the chunk's checkpoint with the stored ``z``
    (``s_t = a s_{t-1} - c z v + p q``: no reduction, so each step is a few multiply-adds on loads
    issued four steps at a time) and every second one is kept in the per-program scratch
    ``SCR [prog, CHUNK/2 + 1, BK, BV]`` (each tile contiguous, whole cache lines; in the checkpoints'
    [K, V] layout a tile is BK separate pieces of BV floats, and the backward measured slower). The
    reverse loop reads a pair's first state back and rebuilds the second in registers from the
    slots it has loaded for the step anyway (keeping every fourth state instead held four state
    tiles live and spilled registers at K = 64).
  The bound is a product of the decays of the chunk's steps, which the kernel loads (one tile per
  chunk, a chunk ahead) and reduces while the previous chunk runs. ``ONE_LOOP`` (the default,
  ``recurrent.ONE_LOOP``): both ways run one reverse loop, which computes the quotient and the
  rebuilt state and selects one (``state_before``); else a reverse loop per way, each running no
  step in a chunk of the other way. With a loop per way, a launch whose chunks mixed the ways ran
  slower on the GPU than with every chunk on either way (gated Longhorn, 1.7% of its chunks
  rebuilt: 5.69 ms fwd+bwd against 4.40 all walked and 6.17 all rebuilt; BENCHMARKS.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.rank1_row.fwd import (IA, IC, IOC, IP, decayed, load_coef, load_decay, load_slots, prefetch_l2,
                                            prefetch_slots, identity_unless, row_tile, seq_rows, transition)


@triton.jit
def load_bwd_slots(vecs, rows, DY, Z, row, K, V, ix, MODES: tl.constexpr, CONSTS: tl.constexpr,
                   GROUPS: tl.constexpr, BV: tl.constexpr):
    """Everything one reverse step reads: (u, v, q, oq, a, c, p, oc, dy, z)."""
    u, v, q, oq, a, c, p, oc, oh = load_slots(vecs, rows, row, K, V, ix, MODES, CONSTS, GROUPS, BV)
    dy = tl.load(DY + row * V + ix[2], mask=ix[3], other=0.).to(tl.float32)
    z = tl.load(Z + row * V + ix[2], mask=ix[3], other=0.)
    return u, v, q, oq, a, c, p, oc, dy, z


@triton.jit
def load_transition(vecs, rows, Z, row, K, V, ix, MODES: tl.constexpr, CONSTS: tl.constexpr,
                    GROUPS: tl.constexpr, BV: tl.constexpr):
    """What the state update with a stored z reads: (a, c, z, v, q, p)."""
    v = tl.load(vecs[GROUPS[0]] + row * K + ix[0], mask=ix[1], other=0.).to(tl.float32)
    if GROUPS[1] == GROUPS[0]:
        q = v
    else:
        q = tl.load(vecs[GROUPS[1]] + row * K + ix[0], mask=ix[1], other=0.).to(tl.float32)
    a = load_decay(rows[IA], row, K, V, ix, MODES[IA], CONSTS[IA], BV)
    c = load_coef(rows[IC], row, V, ix[2], ix[3], MODES[IC], CONSTS[IC], BV)
    p = load_coef(rows[IP], row, V, ix[2], ix[3], MODES[IP], CONSTS[IP], BV)
    z = tl.load(Z + row * V + ix[2], mask=ix[3], other=0.)
    return a, c, z, v, q, p


@triton.jit
def rebuild(s, sl, valid, QV: tl.constexpr, KD: tl.constexpr = False):
    """The state after the step of slot set ``sl`` (a reverse set), or ``s`` where not ``valid``."""
    u, v, q, oq, a, c, p, oc, dy, z = sl
    a, c, p = identity_unless(valid, a, c, p)
    return transition(s, a, c, z, v, q, p, QV, KD)


@triton.jit
def state_before(st, sl, rebuilt, walk, KEPT: tl.constexpr, QV: tl.constexpr, DIVIDE: tl.constexpr = False,
                 KD: tl.constexpr = False):
    """s_{t-1}: s_t + c z v - p q (``QV``: q is v), divided by ``a`` where ``DIVIDE`` (per key where
    ``KD``); ``KEPT``: ``rebuilt`` instead, or (``DIVIDE`` too) that where not ``walk``."""
    u, v, q, oq, a, c, p, oc, dy, z = sl
    if KEPT and not DIVIDE:
        sp = rebuilt
    else:
        if QV:
            sp = st + v[:, None] * (c * z - p)[None, :]
        else:
            sp = st + v[:, None] * (c * z)[None, :] - q[:, None] * p[None, :]
        if DIVIDE:
            # masked rows and keys load a = 0 and hold a zero state: divided by 1 there (not inf * 0); a
            # chunk with a valid a of 0 is rebuilt (an unbounded gain), its quotient never selected
            sp = decayed(1. / tl.where(a == 0., 1., a), sp, KD)
        if KEPT:
            sp = tl.where(walk, sp, rebuilt)
    return sp


@triton.jit
def decay_tile(A, base, t0, T, H, h, K, V, ix, MODE: tl.constexpr, CONST: tl.constexpr, CHUNK: tl.constexpr,
               CP: tl.constexpr):
    """The decays of the steps [t0, min(t0 + CHUNK, T)) of this program's rows as a [CP, BV] tile (per
    key [CP, BK]; per head or a constant [CP, 1]; CP = CHUNK rounded up to a power of 2), 1 past
    them and outside the tile's rows or keys."""
    j = tl.arange(0, CP)
    on = (j < CHUNK) & (t0 + j < T)
    row = (base + tl.where(on, t0 + j, 0)) * H + h
    if MODE == 3:
        x = tl.load(A + row[:, None] * K + ix[0][None, :], mask=on[:, None] & ix[1][None, :], other=1.)
    elif MODE == 2:
        x = tl.load(A + row[:, None] * V + ix[2][None, :], mask=on[:, None] & ix[3][None, :], other=1.)
    elif MODE == 1:
        x = tl.load(A + row, mask=on, other=1.)[:, None]
    else:
        x = tl.where(on, CONST, 1.)[:, None]
    return x


@triton.jit
def lost_bits(tile):
    """log2 of the most a reverse walk divided by ``decay_tile``'s decays can amplify a rounding error:
    max over rows (keys) of sum over steps of -log2 |a| (inf where an a is 0)."""
    return tl.max(tl.sum(-tl.log2(tl.abs(tile.to(tl.float32))), axis=0), axis=0)


@triton.jit
def store_row_grad(ptr, row, V, part, offs_v, mask_v, valid, g, MODE: tl.constexpr):
    """Gradient of a row coefficient: per row -> [B,T,H,V] at ``row``; per head -> the row block's
    partial sum at ``part`` of [NV,B,T,H]. ``mask_v`` masks rows, ``valid`` the whole step."""
    if MODE == 2:
        tl.store(ptr + row * V + offs_v, g, mask=mask_v & valid)
    elif MODE == 1:
        tl.store(ptr + part, tl.sum(tl.where(mask_v, g, 0.), axis=0), mask=valid)


@triton.jit
def put(ptr, x, mask, ATOMIC: tl.constexpr):
    """Store ``x``, or add it into what is there (``ATOMIC``: the row blocks of a head share ``ptr``)."""
    if ATOMIC:
        tl.atomic_add(ptr, x, mask=mask, sem="relaxed")
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def bwd_step(ds, st, sp, sl, t, t_lo, row, K, V, ix, grads, DM, i_v, NB, H, NG,
             MODES: tl.constexpr, GROUPS: tl.constexpr, INDEX: tl.constexpr, BV: tl.constexpr,
             ATOMIC: tl.constexpr = False):
    """One reverse step (a no-op when t < t_lo): ``st`` is s_t, ``sp`` s_{t-1}, ``ds`` the adjoint
    of s_t from later steps; stores step t's gradients; returns (adjoint of s_{t-1}, s_{t-1}).
    ``ATOMIC``: the K-vector gradients are added into one ``DM [NG, B, T, H, K]`` (else each row block
    stores its partial in ``DM [NV, NG, B, T, H, K]``)."""
    u, v, q, oq, a, c, p, oc, dy, z = sl
    offs_k, mask_k, offs_v, mask_v = ix
    valid = t >= t_lo
    wo = oc * dy
    ds_in = ds
    ds = ds + oq[:, None] * wo[None, :]
    e = tl.sum(ds * v[:, None], axis=0)
    part = i_v * NB * H + row                  # [NV, B, T, H] partials of per-head coefficients
    if MODES[IC] != 0:
        store_row_grad(grads[IC], row, V, part, offs_v, mask_v, valid, -z * e, MODES[IC])
    if MODES[IP] != 0:
        store_row_grad(grads[IP], row, V, part, offs_v, mask_v, valid, tl.sum(ds * q[:, None], axis=0), MODES[IP])
    if MODES[IOC] != 0:
        store_row_grad(grads[IOC], row, V, part, offs_v, mask_v, valid, dy * tl.sum(st * oq[:, None], axis=0),
                       MODES[IOC])
    if MODES[IA] == 3:
        # per key: this row block's partial of sum_i ds_i * s_{t-1,i}, [NV, B, T, H, K]
        tl.store(grads[IA] + (i_v * NB * H + row) * K + offs_k, tl.sum(ds * sp, axis=1), mask=mask_k & valid)
    elif MODES[IA] != 0:
        store_row_grad(grads[IA], row, V, part, offs_v, mask_v, valid, tl.sum(ds * sp, axis=0), MODES[IA])
    # K-vector gradients, one row-reduction per distinct input tensor
    wu = -(c * e)          # coefficient of s_{t-1} in du
    wv = -(c * z)          # coefficient of ds in dv
    d0 = tl.zeros([BV], dtype=tl.float32)
    if GROUPS[0] == 0:
        d0 += wv
    if GROUPS[1] == 0:
        d0 += p
    g0 = sp * wu[None, :] + ds * d0[None, :]
    if GROUPS[2] == 0:
        g0 += st * wo[None, :]
    mk = mask_k & valid
    if ATOMIC:
        dm = DM + row * K + offs_k
    else:
        dm = DM + (i_v * NG * NB * H + row) * K + offs_k
    gstride = NB * H * K
    put(dm, tl.sum(g0, axis=1), mk, ATOMIC)
    if GROUPS[0] == 1:
        d1 = wv
        if GROUPS[1] == 1:
            d1 += p
        g1 = ds * d1[None, :]
        if GROUPS[2] == 1:
            g1 += st * wo[None, :]
        put(dm + INDEX[0] * gstride, tl.sum(g1, axis=1), mk, ATOMIC)
    if GROUPS[1] == 2:
        g2 = ds * p[None, :]
        if GROUPS[2] == 2:
            g2 += st * wo[None, :]
        put(dm + INDEX[1] * gstride, tl.sum(g2, axis=1), mk, ATOMIC)
    if GROUPS[2] == 3:
        put(dm + INDEX[2] * gstride, tl.sum(st * wo[None, :], axis=1), mk, ATOMIC)
    # adjoint of s_{t-1}
    ds = tl.where(valid, decayed(a, ds, MODES[IA] == 3) - u[:, None] * (c * e)[None, :], ds_in)
    st = tl.where(valid, sp, st)
    return ds, st


@triton.jit
def keep_states(ckp, scr, vecs, rows, Z, t0, t1, n, base, H, h, K, V, ix, tile, mask_s,
                MODES: tl.constexpr, CONSTS: tl.constexpr, GROUPS: tl.constexpr, BV: tl.constexpr,
                BK: tl.constexpr, PF: tl.constexpr):
    """Rebuild the states of steps [t0, t1) from the checkpoint ``ckp`` with the stored z and keep
    the state before the lower step of each reverse pair (steps t1-2j-2, t1-2j-1; the last pair
    cut at t0) in scratch slot j; ``n`` (t1 - t0 or 0) is the loop's trip count, 0 where the chunk
    is not rebuilt."""
    sp = tl.load(ckp + tile, mask=mask_s, other=0.)
    QV: tl.constexpr = GROUPS[1] == GROUPS[0]
    KD: tl.constexpr = MODES[IA] == 3
    t_hi = t1 - 1
    # four steps per iteration, the next iteration's loads issued before this one's updates
    l0 = load_transition(vecs, rows, Z, (base + t0) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    l1 = load_transition(vecs, rows, Z, (base + tl.minimum(t0 + 1, t_hi)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    l2 = load_transition(vecs, rows, Z, (base + tl.minimum(t0 + 2, t_hi)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    l3 = load_transition(vecs, rows, Z, (base + tl.minimum(t0 + 3, t_hi)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    for tb in range(t0, t0 + n, 4):
        if PF > 0:
            rowf = (base + tl.minimum(tb + PF, t_hi)) * H + h
            prefetch_slots(vecs, rows, rowf, K, V, ix, MODES, GROUPS)
            prefetch_l2(Z + rowf * V + ix[2])
        sp = keep_step(sp, l0, tb, t0, t1, scr, QV, BK, BV, KD)
        l0 = load_transition(vecs, rows, Z, (base + tl.minimum(tb + 4, t_hi)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
        sp = keep_step(sp, l1, tb + 1, t0, t1, scr, QV, BK, BV, KD)
        l1 = load_transition(vecs, rows, Z, (base + tl.minimum(tb + 5, t_hi)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
        sp = keep_step(sp, l2, tb + 2, t0, t1, scr, QV, BK, BV, KD)
        l2 = load_transition(vecs, rows, Z, (base + tl.minimum(tb + 6, t_hi)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
        sp = keep_step(sp, l3, tb + 3, t0, t1, scr, QV, BK, BV, KD)
        l3 = load_transition(vecs, rows, Z, (base + tl.minimum(tb + 7, t_hi)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)


@triton.jit
def kept_tile(BK: tl.constexpr, BV: tl.constexpr):
    """Offsets of a kept state in its scratch slot (a contiguous [BK, BV] tile; outside the state's
    mask it holds the zeros the masked loads gave the tile)."""
    return tl.arange(0, BK)[:, None] * BV + tl.arange(0, BV)[None, :]


@triton.jit
def keep_step(sp, lt, t, t0, t1, scr, QV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              KD: tl.constexpr = False):
    """``keep_states``' step t: keep s_{t-1} if t starts a reverse pair, then apply step t."""
    a, c, z, v, q, p = lt
    valid = t < t1
    tl.store(scr + ((t1 - 1 - t) // 2) * BK * BV + kept_tile(BK, BV), sp,
             mask=valid & (((t1 - t) % 2 == 0) | (t == t0)))
    a, c, p = identity_unless(valid, a, c, p)
    return transition(sp, a, c, z, v, q, p, QV, KD)


@triton.jit
def reverse_steps(ds, st, scr, walk, n, t0, t1, base, H, h, K, V, ix, vecs, rows, DY, Z, grads, DM, i_v, NB, NG,
                  MODES: tl.constexpr, CONSTS: tl.constexpr, GROUPS: tl.constexpr, INDEX: tl.constexpr,
                  BV: tl.constexpr, BK: tl.constexpr, PF: tl.constexpr, KEPT: tl.constexpr, DIVIDE: tl.constexpr,
                  ATOMIC: tl.constexpr = False):
    """The chunk [t0, t1)'s steps in reverse, ``s_{t-1}`` as ``state_before`` says (``KEPT``: the kept
    states are read, where not ``walk`` if ``DIVIDE`` too); ``n`` (t1 - t0 or 0) is the loop's trip
    count. Four steps per iteration with a 4-step register prefetch of the slots, as in the forward.
    Returns (adjoint, state) before the chunk."""
    QV: tl.constexpr = GROUPS[1] == GROUPS[0]
    KD: tl.constexpr = MODES[IA] == 3
    offs_v = ix[2]
    kept = kept_tile(BK, BV)
    s0_ = load_bwd_slots(vecs, rows, DY, Z, (base + t1 - 1) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    s1_ = load_bwd_slots(vecs, rows, DY, Z, (base + tl.maximum(t1 - 2, t0)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    s2_ = load_bwd_slots(vecs, rows, DY, Z, (base + tl.maximum(t1 - 3, t0)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    s3_ = load_bwd_slots(vecs, rows, DY, Z, (base + tl.maximum(t1 - 4, t0)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    for jt in range(0, n, 4):
        t = t1 - 1 - jt
        if PF > 0:
            rowf = (base + tl.maximum(t - PF, 0)) * H + h
            prefetch_slots(vecs, rows, rowf, K, V, ix, MODES, GROUPS)
            prefetch_l2(DY + rowf * V + offs_v)
            prefetch_l2(Z + rowf * V + offs_v)
        x0, x1, x2, x3 = st, st, st, st
        if KEPT:
            # a walked chunk has kept nothing: no load issued (masked), the rebuilt state not selected
            x1 = tl.load(scr + (jt // 2) * BK * BV + kept, mask=(kept >= 0) & ((walk == 0) | (not DIVIDE)), other=0.)
            x0 = rebuild(x1, s1_, t - 1 >= t0, QV, KD)
        row = (base + t) * H + h
        ds, st = bwd_step(ds, st, state_before(st, s0_, x0, walk, KEPT, QV, DIVIDE, KD), s0_, t, t0, row, K, V,
                          ix, grads, DM, i_v, NB, H, NG, MODES, GROUPS, INDEX, BV, ATOMIC)
        s0_ = load_bwd_slots(vecs, rows, DY, Z, (base + tl.maximum(t - 4, t0)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
        ds, st = bwd_step(ds, st, state_before(st, s1_, x1, walk, KEPT, QV, DIVIDE, KD), s1_, t - 1, t0, row - H,
                          K, V, ix, grads, DM, i_v, NB, H, NG, MODES, GROUPS, INDEX, BV, ATOMIC)
        s1_ = load_bwd_slots(vecs, rows, DY, Z, (base + tl.maximum(t - 5, t0)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
        if KEPT:
            # past the chunk's start (t - 2 < t0) the slot is stale: read, never used
            x3 = tl.load(scr + (jt // 2 + 1) * BK * BV + kept, mask=(kept >= 0) & ((walk == 0) | (not DIVIDE)),
                         other=0.)
            x2 = rebuild(x3, s3_, t - 3 >= t0, QV, KD)
        ds, st = bwd_step(ds, st, state_before(st, s2_, x2, walk, KEPT, QV, DIVIDE, KD), s2_, t - 2, t0,
                          row - 2 * H, K, V, ix, grads, DM, i_v, NB, H, NG, MODES, GROUPS, INDEX, BV, ATOMIC)
        s2_ = load_bwd_slots(vecs, rows, DY, Z, (base + tl.maximum(t - 6, t0)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
        ds, st = bwd_step(ds, st, state_before(st, s3_, x3, walk, KEPT, QV, DIVIDE, KD), s3_, t - 3, t0,
                          row - 3 * H, K, V, ix, grads, DM, i_v, NB, H, NG, MODES, GROUPS, INDEX, BV, ATOMIC)
        s3_ = load_bwd_slots(vecs, rows, DY, Z, (base + tl.maximum(t - 7, t0)) * H + h, K, V, ix, MODES, CONSTS, GROUPS, BV)
    return ds, st


@triton.jit
def rank1_row_bwd_kernel(
    U, Vv, Q, OQ, A, C, P, OC,                # slots (A .. OC None where a constant)
    Z, CK, SCR, ST, DY, DHT,                  # z, checkpoints, scratch (None: a == 1), S_T, dy, dS_T (or None)
    DA, DC, DP, DOC, DM, DS0,                 # gradients (None where not wanted); DM [NV, NG, B, T, H, K]
    CU, CO,                                   # VARLEN: offsets [N+1], each sequence's first checkpoint [N]
    T, H, V, K, NC, NV, NB, NG,
    BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr, PF: tl.constexpr,
    MODES: tl.constexpr, CONSTS: tl.constexpr, GROUPS: tl.constexpr,
    INDEX: tl.constexpr,                      # for v, q, oq: the DM group index of its tensor
    VARLEN: tl.constexpr = False,
    BITS=0.,                                  # a decay: the most bits a chunk's walk divided by it may lose
    CP: tl.constexpr = 1,                     # a decay: CHUNK rounded up to a power of 2
    ONE_LOOP: tl.constexpr = True,            # a decay: one reverse loop for both ways (else one per way)
    ATOMIC: tl.constexpr = False,             # DM [NG, B, T, H, K] added into by every row block (``bwd_step``)
):
    """Reverse-time adjoint sweep for rows [iv*BV, iv*BV+BV) of head (b, h); tiles [BK, BV];
    ``s_{t-1}`` as the module docstring says. VARLEN: program row ``b`` is sequence ``b`` of a packed
    row (``seq_rows``)."""
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    b = i_bh // H
    h = i_bh % H
    ix, mask_s, tile = row_tile(V, K, BV, BK)
    vecs = (U, Vv, Q, OQ)
    rows = (A, C, P, OC, None)
    grads = (DA, DC, DP, DOC)
    base, T, cb, NC = seq_rows(CU, CO, i_bh, b, h, T, NC, CHUNK, VARLEN)
    REBUILT: tl.constexpr = SCR is not None

    ds = tl.zeros([BK, BV], dtype=tl.float32)
    if DHT is not None:
        ds += tl.load(DHT + i_bh.to(tl.int64) * K * V + tile, mask=mask_s, other=0.).to(tl.float32)
    st = tl.zeros([BK, BV], dtype=tl.float32)
    if T > 0:
        st += tl.load(ST + i_bh.to(tl.int64) * K * V + tile, mask=mask_s, other=0.)
    ckp = CK + cb * K * V
    scr = SCR
    if REBUILT:
        # CHUNK/2 + 1 slots: a group's second pair past a chunk's start reads a slot it does not use
        scr = SCR + ((i_bh.to(tl.int64) * NV + i_v) * ((CHUNK + 1) // 2 + 1)) * BK * BV
        walk_next = lost_bits(decay_tile(A, base, (NC - 1) * CHUNK, T, H, h, K, V, ix, MODES[IA], CONSTS[IA],
                                         CHUNK, CP)) <= BITS

    for jc in range(0, NC):
        ci = NC - 1 - jc
        t0 = ci * CHUNK
        t1 = tl.minimum(t0 + CHUNK, T)
        if PF > 0:
            prefetch_l2(ckp + tl.maximum(ci - 1, 0) * K * V + tile)     # the next chunk's checkpoint
        walk = True
        n = t1 - t0
        if REBUILT:
            walk = walk_next
            # the previous chunk's decays: loaded now, reduced once this chunk's steps are done
            dec = decay_tile(A, base, tl.maximum(ci - 1, 0) * CHUNK, T, H, h, K, V, ix, MODES[IA], CONSTS[IA],
                             CHUNK, CP)
            # the chunk's way is a trip count (the rebuild's loops run no step in a walked chunk) and, in
            # ONE_LOOP, a select per state, not a branch: a branch reassigning loop-carried tiles inside a
            # loop has compiled wrong on the GPU
            n_kept = tl.where(walk, 0, t1 - t0)
            if n_kept > 0:
                # a walked chunk neither reads its checkpoint nor preloads the rebuild's slots (a branch
                # around stores only: it reassigns no tile the loop carries)
                keep_states(ckp + ci * K * V, scr, vecs, rows, Z, t0, t1, n_kept, base, H, h, K, V, ix, tile,
                            mask_s, MODES, CONSTS, GROUPS, BV, BK, PF)
            tl.debug_barrier()
            if not ONE_LOOP:
                ds, st = reverse_steps(ds, st, scr, walk, n_kept, t0, t1, base, H, h, K, V, ix, vecs, rows, DY, Z,
                                       grads, DM, i_v, NB, NG, MODES, CONSTS, GROUPS, INDEX, BV, BK, PF, True, False, ATOMIC)
                n = t1 - t0 - n_kept
        ds, st = reverse_steps(ds, st, scr, walk, n, t0, t1, base, H, h, K, V, ix, vecs, rows, DY, Z, grads, DM,
                               i_v, NB, NG, MODES, CONSTS, GROUPS, INDEX, BV, BK, PF, REBUILT and ONE_LOOP, REBUILT, ATOMIC)
        if REBUILT:
            walk_next = lost_bits(dec) <= BITS
        # the exact state at the chunk start: a walk's rounding does not carry into the next chunk (a
        # rebuilt chunk ends on its first kept state, this checkpoint itself)
        st = tl.load(ckp + ci * K * V + tile, mask=mask_s, other=0.)
    if DS0 is not None:
        tl.store(DS0 + i_bh.to(tl.int64) * K * V + tile, ds, mask=mask_s)
