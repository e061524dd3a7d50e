"""Triton kernels of the rank-r per-row family without a decay (``a == 1``: several-key Longhorn),
written out like ``rank1_row``'s (``ssmcraft.ops.rankr_row.recurrent`` has the recurrence and the host
side). Row ``i``, per step::

    z_l = s_{t-1} . u_l,   g_r = p_r - sum_l c_rl z_l,   s_t = s_{t-1} + sum_r g_r v_r
    y   = oc (s_t . oq) + oh

Backward (``ds`` the adjoint of ``s_t``, readout added first)::

    e_r = ds . v_r,   dp_r = e_r,   dc_rl = -z_l e_r,   dz_l = -sum_r c_rl e_r
    du_l += dz_l s_{t-1},   dv_r += g_r ds,   doq += oc dy s_t,   ds <- ds + sum_l dz_l u_l

and ``s_{t-1} = s_t - sum_r g_r v_r`` exactly from the stored ``z`` (no decay to divide by),
reset to a checkpoint every ``CHUNK`` steps. Argument groups: ``kv`` the distinct K-vector tensors,
``UI``/``VI``/``OQI`` (compile time) the index in ``kv`` of each ``u_l``, ``v_r`` and ``oq``;
``cs`` the ``R*L`` factors ``c_rl`` (row-major over r) and ``ps`` the ``R`` factors ``p_r``, each
with a mode (0 constant, 1 per head, 2 per row) and a constant, as in ``rank1_row_fwd``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.rank1_row.bwd import put, store_row_grad
from ssmcraft.ops.rank1_row.fwd import load_coef, prefetch_l2, row_tile, seq_rows, store_checkpoint


@triton.jit
def load_kv(kv, row, K, offs_k, mask_k, NKV: tl.constexpr):
    """Every distinct K-vector tensor at one step ([BK] fp32 each)."""
    out = ()
    for j in tl.static_range(NKV):
        out = out + (tl.load(kv[j] + row * K + offs_k, mask=mask_k, other=0.).to(tl.float32),)
    return out


@triton.jit
def load_coefs(ptrs, row, V, offs_v, mask_v, N: tl.constexpr, MODES: tl.constexpr, CONSTS: tl.constexpr,
               BV: tl.constexpr):
    out = ()
    for j in tl.static_range(N):
        out = out + (load_coef(ptrs[j], row, V, offs_v, mask_v, MODES[j], CONSTS[j], BV),)
    return out


@triton.jit
def load_step(kv, cs, ps, oc, oh, row, K, V, ix, NKV: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
              CM: tl.constexpr, CC: tl.constexpr, PM: tl.constexpr, PC: tl.constexpr, OM: tl.constexpr,
              OCC: tl.constexpr, BV: tl.constexpr):
    """What a step reads: (K-vectors, c factors, p factors, oc, oh); ``oc``/``oh`` as
    (pointer or None, mode, constant)."""
    return (load_kv(kv, row, K, ix[0], ix[1], NKV), load_coefs(cs, row, V, ix[2], ix[3], R * L, CM, CC, BV),
            load_coefs(ps, row, V, ix[2], ix[3], R, PM, PC, BV),
            load_coef(oc, row, V, ix[2], ix[3], OM[0], OCC[0], BV), load_coef(oh, row, V, ix[2], ix[3], OM[1], OCC[1], BV))


@triton.jit
def prefetch_step(kv, cs, ps, row, K, V, ix, NKV: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                  CM: tl.constexpr, PM: tl.constexpr):
    for j in tl.static_range(NKV):
        prefetch_l2(kv[j] + row * K + ix[0])
    for j in tl.static_range(R * L):
        if CM[j] == 2:
            prefetch_l2(cs[j] + row * V + ix[2])
    for j in tl.static_range(R):
        if PM[j] == 2:
            prefetch_l2(ps[j] + row * V + ix[2])


@triton.jit
def inputs_g(c, p, z, L: tl.constexpr, R: tl.constexpr):
    """g_r = p_r - sum_l c_rl z_l for every r."""
    g = ()
    for r in tl.static_range(R):
        gr = p[r]
        for l in tl.static_range(L):
            gr = gr - c[r * L + l] * z[l]
        g = g + (gr,)
    return g


@triton.jit
def add_terms(s, vs, coef, VI: tl.constexpr, R: tl.constexpr, SIGN: tl.constexpr):
    """s + SIGN * sum_r vs[VI[r]] coef_r (an outer product per r; the sign on the row vector, so that
    each term is one multiply-add on the tile)."""
    for r in tl.static_range(R):
        s = s + vs[VI[r]][:, None] * (SIGN * coef[r])[None, :]
    return s


@triton.jit
def zero_unless(valid, xs, N: tl.constexpr):
    """The row vectors ``xs`` or zeros where not ``valid``: a skipped step's terms vanish, so that it
    selects on row vectors instead of on the state tiles (``rank1_row``'s ``identity_unless``)."""
    out = ()
    for j in tl.static_range(N):
        out = out + (tl.where(valid, xs[j], 0.),)
    return out


@triton.jit
def fwd_step(s, sl, t, t_end, row, V, ix, Y, Z, ZS, CKP, KV_, NC, tile, mask_s,
             L: tl.constexpr, R: tl.constexpr, VI: tl.constexpr, UI: tl.constexpr, OQI: tl.constexpr,
             CHUNK: tl.constexpr):
    """One step (a no-op when t >= t_end): update s, store y, z (``Z``) and the checkpoint."""
    kvs, c, p, oc, oh = sl
    offs_v, mask_v = ix[2], ix[3]
    valid = t < t_end
    z = ()
    for l in tl.static_range(L):
        z = z + (tl.sum(s * kvs[UI[l]][:, None], axis=0),)
    s = add_terms(s, kvs, zero_unless(valid, inputs_g(c, p, z, L, R), R), VI, R, 1.0)
    y = oc * tl.sum(s * kvs[OQI][:, None], axis=0) + oh
    tl.store(Y + row * V + offs_v, y.to(Y.dtype.element_ty), mask=mask_v & valid)
    if Z is not None:
        for l in tl.static_range(L):
            tl.store(Z + l * ZS + row * V + offs_v, z[l], mask=mask_v & valid)
    store_checkpoint(CKP, KV_, s, t, valid, NC, tile, mask_s, CHUNK)
    return s


@triton.jit
def rankr_row_fwd_kernel(
    kv, cs, ps, OC, OH, S0, Y, ST, Z, CK, CU, CO,
    T, H, V: tl.constexpr, K: tl.constexpr, NC, ZS,
    BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr, PF: tl.constexpr,
    NKV: tl.constexpr, L: tl.constexpr, R: tl.constexpr, UI: tl.constexpr, VI: tl.constexpr, OQI: tl.constexpr,
    CM: tl.constexpr, CC: tl.constexpr, PM: tl.constexpr, PC: tl.constexpr, OM: tl.constexpr, OCC: tl.constexpr,
    VARLEN: tl.constexpr = False,
):
    """One program: rows [iv*BV, iv*BV+BV) of head (b, h), the state tile [BK, BV] in registers;
    two steps per iteration with a 2-step register prefetch (at K = 64 the K-vectors of a step
    take many registers) and an L2 prefetch PF steps ahead. S0, ST [B,H,K,V], Z [L,B,T,H,V]
    (``ZS`` = B*T*H*V), CK [B,H,NC,K,V]; None where not wanted. VARLEN: program row ``b`` is
    sequence ``b`` of a packed row (``rank1_row``'s ``seq_rows``)."""
    i_bh = tl.program_id(0)
    b = i_bh // H
    h = i_bh % H
    ix, mask_s, tile = row_tile(V, K, BV, BK)
    base, T, cb, NC = seq_rows(CU, CO, i_bh, b, h, T, NC, CHUNK, VARLEN)
    t_last = T - 1
    if VARLEN:
        t_last = tl.maximum(t_last, 0)     # an empty sequence's loads read row base, never used
    s = tl.zeros([BK, BV], dtype=tl.float32)
    if S0 is not None:
        s += tl.load(S0 + i_bh.to(tl.int64) * K * V + tile, mask=mask_s, other=0.).to(tl.float32)
    CKP = CK
    if CK is not None:
        CKP = CK + cb * K * V
        if (NC > 0) | (not VARLEN):                    # an empty sequence has no checkpoint
            tl.store(CKP + tile, s, mask=mask_s)       # checkpoint 0 is the initial state
    a0 = load_step(kv, cs, ps, OC, OH, base * H + h, K, V, ix, NKV, L, R, CM, CC, PM, PC, OM, OCC, BV)
    a1 = load_step(kv, cs, ps, OC, OH, (base + tl.minimum(1, t_last)) * H + h, K, V, ix, NKV, L, R, CM, CC, PM, PC,
                   OM, OCC, BV)
    for tb in range(0, T, 2):
        if PF > 0:
            prefetch_step(kv, cs, ps, (base + tl.minimum(tb + PF, t_last)) * H + h, K, V, ix, NKV, L, R, CM, PM)
        row = (base + tb) * H + h
        s = fwd_step(s, a0, tb, T, row, V, ix, Y, Z, ZS, CKP, K * V, NC, tile, mask_s, L, R, VI, UI, OQI, CHUNK)
        a0 = load_step(kv, cs, ps, OC, OH, (base + tl.minimum(tb + 2, t_last)) * H + h, K, V, ix, NKV, L, R,
                       CM, CC, PM, PC, OM, OCC, BV)
        s = fwd_step(s, a1, tb + 1, T, row + H, V, ix, Y, Z, ZS, CKP, K * V, NC, tile, mask_s, L, R, VI, UI, OQI,
                     CHUNK)
        a1 = load_step(kv, cs, ps, OC, OH, (base + tl.minimum(tb + 3, t_last)) * H + h, K, V, ix, NKV, L, R,
                       CM, CC, PM, PC, OM, OCC, BV)
    if ST is not None:
        tl.store(ST + i_bh.to(tl.int64) * K * V + tile, s, mask=mask_s)


@triton.jit
def load_bwd_step(kv, cs, ps, OC, DY, Z, ZS, row, K, V, ix, NKV: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                  CM: tl.constexpr, CC: tl.constexpr, PM: tl.constexpr, PC: tl.constexpr, OM: tl.constexpr,
                  OCC: tl.constexpr, BV: tl.constexpr):
    """What a reverse step reads: (K-vectors, c, p, oc, dy, z)."""
    kvs, c, p, oc, oh = load_step(kv, cs, ps, OC, None, row, K, V, ix, NKV, L, R, CM, CC, PM, PC, OM, OCC, BV)
    dy = tl.load(DY + row * V + ix[2], mask=ix[3], other=0.).to(tl.float32)
    z = ()
    for l in tl.static_range(L):
        z = z + (tl.load(Z + l * ZS + row * V + ix[2], mask=ix[3], other=0.),)
    return kvs, c, p, oc, dy, z


@triton.jit
def bwd_step(ds, st, sl, t, t_lo, row, K, V, ix, dcs, dps, DOC, DM, i_v, NB, H,
             NKV: tl.constexpr, L: tl.constexpr, R: tl.constexpr, UI: tl.constexpr, VI: tl.constexpr,
             OQI: tl.constexpr, CM: tl.constexpr, PM: tl.constexpr, OM: tl.constexpr, BV: tl.constexpr,
             BK: tl.constexpr, ATOMIC: tl.constexpr):
    """One reverse step (a no-op when t < t_lo): ``st`` is s_t, ``ds`` the adjoint of s_t from
    later steps; stores step t's gradients; returns (adjoint of s_{t-1}, s_{t-1}). ``ATOMIC``: the
    K-vector gradients are added into one ``DM [NKV, B, T, H, K]`` shared by the row blocks (else
    each row block stores its partial in ``DM [NV, NKV, B, T, H, K]``)."""
    kvs, c, p, oc, dy, z = sl
    offs_k, mask_k, offs_v, mask_v = ix
    valid = t >= t_lo
    g = zero_unless(valid, inputs_g(c, p, z, L, R), R)
    sp = add_terms(st, kvs, g, VI, R, -1.0)
    wo = tl.where(valid, oc * dy, 0.)
    ds = ds + kvs[OQI][:, None] * wo[None, :]
    e = ()
    for r in tl.static_range(R):
        e = e + (tl.sum(ds * kvs[VI[r]][:, None], axis=0),)
    dz = ()
    for l in tl.static_range(L):
        dzl = tl.zeros([BV], dtype=tl.float32)
        for r in tl.static_range(R):
            dzl = dzl - c[r * L + l] * e[r]
        dz = dz + (tl.where(valid, dzl, 0.),)
    part = i_v * NB * H + row                  # [NV, B, T, H] partials of per-head factors
    for r in tl.static_range(R):
        if PM[r] != 0:
            store_row_grad(dps[r], row, V, part, offs_v, mask_v, valid, e[r], PM[r])
        for l in tl.static_range(L):
            if CM[r * L + l] != 0:
                store_row_grad(dcs[r * L + l], row, V, part, offs_v, mask_v, valid, -z[l] * e[r], CM[r * L + l])
    if OM[0] != 0:
        store_row_grad(DOC, row, V, part, offs_v, mask_v, valid, dy * tl.sum(st * kvs[OQI][:, None], axis=0), OM[0])
    # K-vector gradients, one row-reduction per distinct tensor
    mk = mask_k & valid
    blk = i_v
    if ATOMIC:
        blk = 0
    for j in tl.static_range(NKV):
        acc = tl.zeros([BK, BV], dtype=tl.float32)
        for l in tl.static_range(L):
            if UI[l] == j:
                acc += sp * dz[l][None, :]
        for r in tl.static_range(R):
            if VI[r] == j:
                acc += ds * g[r][None, :]
        if OQI == j:
            acc += st * wo[None, :]
        put(DM + ((blk * NKV + j) * NB * H + row) * K + offs_k, tl.sum(acc, axis=1), mk, ATOMIC)
    # a skipped step (g, wo, dz zero) leaves ds and the state as they were
    return add_terms(ds, kvs, dz, UI, L, 1.0), sp


@triton.jit
def rankr_row_bwd_kernel(
    kv, cs, ps, OC, Z, CK, ST, DY, DHT, dcs, dps, DOC, DM, DS0, CU, CO,
    T, H, V: tl.constexpr, K: tl.constexpr, NC, NV, NB, ZS,
    BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr, PF: tl.constexpr,
    NKV: tl.constexpr, L: tl.constexpr, R: tl.constexpr, UI: tl.constexpr, VI: tl.constexpr, OQI: tl.constexpr,
    CM: tl.constexpr, CC: tl.constexpr, PM: tl.constexpr, PC: tl.constexpr, OM: tl.constexpr, OCC: tl.constexpr,
    VARLEN: tl.constexpr = False, ATOMIC: tl.constexpr = False,
):
    """Reverse-time sweep for rows [iv*BV, iv*BV+BV) of head (b, h): s_{t-1} rebuilt exactly from
    the stored z, reset to the checkpoint at every chunk start; two steps per iteration with a
    2-step register prefetch. VARLEN: program row ``b`` is sequence ``b`` of a packed row."""
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    b = i_bh // H
    h = i_bh % H
    ix, mask_s, tile = row_tile(V, K, BV, BK)
    offs_v = ix[2]
    base, T, cb, NC = seq_rows(CU, CO, i_bh, b, h, T, NC, CHUNK, VARLEN)
    ds = tl.zeros([BK, BV], dtype=tl.float32)
    if DHT is not None:
        ds += tl.load(DHT + i_bh.to(tl.int64) * K * V + tile, mask=mask_s, other=0.).to(tl.float32)
    st = tl.zeros([BK, BV], dtype=tl.float32)
    if T > 0:
        st += tl.load(ST + i_bh.to(tl.int64) * K * V + tile, mask=mask_s, other=0.)
    ckp = CK + cb * K * V
    for jc in range(0, NC):
        ci = NC - 1 - jc
        t0 = ci * CHUNK
        t1 = tl.minimum(t0 + CHUNK, T)
        b0 = load_bwd_step(kv, cs, ps, OC, DY, Z, ZS, (base + t1 - 1) * H + h, K, V, ix, NKV, L, R, CM, CC, PM, PC,
                           OM, OCC, BV)
        b1 = load_bwd_step(kv, cs, ps, OC, DY, Z, ZS, (base + tl.maximum(t1 - 2, t0)) * H + h, K, V, ix, NKV, L, R,
                           CM, CC, PM, PC, OM, OCC, BV)
        for jt in range(0, t1 - t0, 2):
            t = t1 - 1 - jt
            if PF > 0:
                rowf = (base + tl.maximum(t - PF, 0)) * H + h
                prefetch_step(kv, cs, ps, rowf, K, V, ix, NKV, L, R, CM, PM)
                prefetch_l2(DY + rowf * V + offs_v)
                for l in tl.static_range(L):
                    prefetch_l2(Z + l * ZS + rowf * V + offs_v)
            row = (base + t) * H + h
            ds, st = bwd_step(ds, st, b0, t, t0, row, K, V, ix, dcs, dps, DOC, DM, i_v, NB, H,
                              NKV, L, R, UI, VI, OQI, CM, PM, OM, BV, BK, ATOMIC)
            b0 = load_bwd_step(kv, cs, ps, OC, DY, Z, ZS, (base + tl.maximum(t - 2, t0)) * H + h, K, V, ix, NKV, L,
                               R, CM, CC, PM, PC, OM, OCC, BV)
            ds, st = bwd_step(ds, st, b1, t - 1, t0, row - H, K, V, ix, dcs, dps, DOC, DM, i_v, NB, H,
                              NKV, L, R, UI, VI, OQI, CM, PM, OM, BV, BK, ATOMIC)
            b1 = load_bwd_step(kv, cs, ps, OC, DY, Z, ZS, (base + tl.maximum(t - 3, t0)) * H + h, K, V, ix, NKV, L,
                               R, CM, CC, PM, PC, OM, OCC, BV)
        # the exact state at the chunk start (the reconstruction's rounding does not accumulate)
        st = tl.load(ckp + ci * K * V + tile, mask=mask_s, other=0.)
    if DS0 is not None:
        tl.store(DS0 + i_bh.to(tl.int64) * K * V + tile, ds, mask=mask_s)
