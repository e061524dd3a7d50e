"""Identity-minus-rank-1 recurrences with a per-row (or per-head) step: Triton kernels.

Family ``rank1`` of the IR (``ssmcraft/compiler/ir.py``). Row ``i`` of the state
``S [V, K]`` (math layout ``[d, m]``; kernels' public state is FLA's ``[B, H, K, V]``)::

    z_i   = s_{t-1,i} . u_t                      (a scalar per row)
    s_t,i = a_i s_{t-1,i} - c_i z_i v_t + p_i q_t
    y_t,i = oc_i (s_t,i . oq_t) + oh_i

with ``u, v, q, oq`` vectors over K shared by the rows of a head and ``a, c, p, oc, oh``
per row (``[B, T, H, V]``), per head (``[B, T, H]``) or constants. Longhorn exact is
``a = 1, c = beta / (1 + beta k.k), u = v = q = k, p = c x, oq = q``; DeltaNet and Gated
DeltaNet are the per-head special cases. Each row costs O(K) per step, the same as the
diagonal scan, and rows are independent: the kernels run one program per
(batch*head, block of BV rows), hold the state tile in registers, transposed ``[BK, BV]`` so
that a row's K values sit in one or two threads (reductions over K in registers), and loop
over time. The loop is latency bound, not bandwidth bound (Longhorn's forward moves 0.15 GB:
0.04 ms at HBM speed, against ~2048 dependent steps), so each loop iteration runs 4 steps
with a 4-step-deep register prefetch plus an L2 prefetch further ahead.

Backward (reverse time; ``ds`` the adjoint of ``s_t,i``)::

    ds    += oc_i dy_i oq                         (readout)
    e_i    = ds . v,   dc_i = -z_i e_i,   dp_i = ds . q,   da_i = ds . s_{t-1,i}
    du    -= sum_i c_i e_i s_{t-1,i},   dv -= sum_i c_i z_i ds_i,   dq += sum_i p_i ds_i
    doq   += sum_i oc_i dy_i s_t,i,     doc_i = dy_i (s_t,i . oq)
    ds     = a_i ds - c_i e_i u          (adjoint of s_{t-1,i})

The backward needs ``s_{t-1}`` at every step without storing ``[B, T, V, K]``:

- ``a == 1`` (Longhorn, DeltaNet): the forward stores ``z`` (one scalar per row and
  step) and the backward rebuilds ``s_{t-1} = s_t + c z v - p q`` exactly from the stored
  ``z`` (no matrix inverse), resetting to a stored checkpoint every ``CHUNK`` steps;
- otherwise: the forward stores the state every ``CHUNK`` steps and the backward
  recomputes each chunk's states into a per-program scratch buffer ``[CHUNK, BV, K]``
  (L2-resident) and walks it backwards.

Reductions over rows (gradients of ``u, v, q, oq`` and of per-head coefficients) are
written per row block and summed on the host. Inputs that are the same tensor (Longhorn's
``u = v = q = k``) are loaded once and their gradients accumulated in one buffer.

A time-parallel forward (``chunked_forward``) is also here: per time segment it forms
each row's K x K transition product and local end state, propagates the segment start
states, then reruns the sequential kernel on all segments at once. It does K times more
work per row and step (a K x K product instead of a K-vector); at B=8, V=1536 the
sequential kernel already has 384+ programs to fill the chip, and the chunked form measured
28x slower (14.9 ms vs 0.535 ms, BENCHMARKS.md), so the family runs the sequential kernel;
``chunked_forward`` stays for measurement and for few-program shapes.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.tuning import INTERPRET, buffer, cdiv, io_dtype, next_pow2

CHUNK = 64            # checkpoint interval of the backward (steps)

# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def _load_row(ptr, base_row, base_head, offs_v, mask_v, MODE: tl.constexpr, CONST: tl.constexpr, BV: tl.constexpr):
    """A per-row coefficient at one step as a [BV] fp32 vector.
    MODE 0: the constant CONST; 1: per head (ptr + base_head); 2: per row (ptr + base_row + offs_v)."""
    if MODE == 2:
        x = tl.load(ptr + base_row + offs_v, mask=mask_v, other=0.).to(tl.float32)
    elif MODE == 1:
        x = tl.zeros([BV], dtype=tl.float32) + tl.load(ptr + base_head).to(tl.float32)
    else:
        x = tl.zeros([BV], dtype=tl.float32) + CONST
    return x


@triton.jit
def _load_vecs(U, Vv, Q, OQ, base_m, offs_k, mask_k,
               G_V: tl.constexpr, G_Q: tl.constexpr, G_OQ: tl.constexpr):
    """u, v, q, oq at one step ([BK] fp32 each); G_* name the slot whose tensor is reused
    (0 u, 1 v, 2 q, 3 own)."""
    u = tl.load(U + base_m + offs_k, mask=mask_k, other=0.).to(tl.float32)
    if G_V == 0:
        v = u
    else:
        v = tl.load(Vv + base_m + offs_k, mask=mask_k, other=0.).to(tl.float32)
    if G_Q == 0:
        q = u
    elif G_Q == 1:
        q = v
    else:
        q = tl.load(Q + base_m + offs_k, mask=mask_k, other=0.).to(tl.float32)
    if G_OQ == 0:
        oq = u
    elif G_OQ == 1:
        oq = v
    elif G_OQ == 2:
        oq = q
    else:
        oq = tl.load(OQ + base_m + offs_k, mask=mask_k, other=0.).to(tl.float32)
    return u, v, q, oq


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the cache lines behind ``ptrs`` (no register result is waited on)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_step(U, Vv, Q, OQ, A, C, P, row, offs_k, offs_v,
                   MODE_A: tl.constexpr, MODE_C: tl.constexpr, MODE_P: tl.constexpr,
                   G_V: tl.constexpr, G_Q: tl.constexpr, G_OQ: tl.constexpr, K, V):
    """L2 prefetch of one (future) step's inputs; addresses past the end are clamped by the caller."""
    _prefetch_l2(U + row * K + offs_k)
    if G_V == 1:
        _prefetch_l2(Vv + row * K + offs_k)
    if G_Q == 2:
        _prefetch_l2(Q + row * K + offs_k)
    if G_OQ == 3:
        _prefetch_l2(OQ + row * K + offs_k)
    if MODE_A == 2:
        _prefetch_l2(A + row * V + offs_v)
    if MODE_C == 2:
        _prefetch_l2(C + row * V + offs_v)
    if MODE_P == 2:
        _prefetch_l2(P + row * V + offs_v)


@triton.jit
def _load_set(U, Vv, Q, OQ, A, C, P, OC, OH, b, t, t_last, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
              MODE_A: tl.constexpr, MODE_C: tl.constexpr, MODE_P: tl.constexpr, MODE_OC: tl.constexpr,
              MODE_OH: tl.constexpr, A_CONST: tl.constexpr, C_CONST: tl.constexpr, P_CONST: tl.constexpr,
              OC_CONST: tl.constexpr, OH_CONST: tl.constexpr,
              G_V: tl.constexpr, G_Q: tl.constexpr, G_OQ: tl.constexpr, BV: tl.constexpr):
    """All slot values of step min(t, t_last) (a clamped step is a harmless reload)."""
    row = (b.to(tl.int64) * T + tl.minimum(t, t_last)) * H + h
    u, v, q, oq = _load_vecs(U, Vv, Q, OQ, row * K, offs_k, mask_k, G_V, G_Q, G_OQ)
    a = _load_row(A, row * V, row, offs_v, mask_v, MODE_A, A_CONST, BV)
    c = _load_row(C, row * V, row, offs_v, mask_v, MODE_C, C_CONST, BV)
    p = _load_row(P, row * V, row, offs_v, mask_v, MODE_P, P_CONST, BV)
    oc = _load_row(OC, row * V, row, offs_v, mask_v, MODE_OC, OC_CONST, BV)
    oh = _load_row(OH, row * V, row, offs_v, mask_v, MODE_OH, OH_CONST, BV)
    return u, v, q, oq, a, c, p, oc, oh


@triton.jit
def _fwd_step(s, u, v, q, oq, a, c, p, oc, oh, t, t_end, b, T, H, h, V, K, NC, i_bh, offs_v, mask_v, tile, mask_s,
              Y, Z, CK, CHUNK: tl.constexpr, STORE_Z: tl.constexpr, STORE_CK: tl.constexpr):
    """One step of the recurrence (no-op when t >= t_end): update s, store y (and z, checkpoint)."""
    valid = t < t_end
    row = (b.to(tl.int64) * T + t) * H + h
    z = tl.sum(s * u[:, None], axis=0)
    s_new = a[None, :] * s - v[:, None] * (c * z)[None, :] + q[:, None] * p[None, :]
    s = tl.where(valid, s_new, s)
    y = oc * tl.sum(s * oq[:, None], axis=0) + oh
    tl.store(Y + row * V + offs_v, y.to(Y.dtype.element_ty), mask=mask_v & valid)
    if STORE_Z:
        tl.store(Z + row * V + offs_v, z, mask=mask_v & valid)
    if STORE_CK:
        # checkpoint j holds the state before step j*CHUNK
        if (t + 1) % CHUNK == 0:
            if ((t + 1) // CHUNK < NC) & valid:
                tl.store(CK + (i_bh.to(tl.int64) * NC + (t + 1) // CHUNK) * K * V + tile, s, mask=mask_s)
    return s


@triton.jit
def _fwd_kernel(
    U, Vv, Q, OQ, A, C, P, OC, OH,            # slots ([B,T,H,K] / [B,T,H,V] / [B,T,H])
    S0, s0_sb, s0_sh, s0_sg, s0_sk, s0_sv,    # initial state(s) [B,H,(NSEG),K,V] via strides
    Y, ST, Z, CK,                             # y [B,T,H,V]; S_T [B,H,K,V]; z [B,T,H,V]; ckpt [B,H,NC,K,V]
    T, H, V, K, SEG, NC,
    BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr, PF: tl.constexpr,
    MODE_A: tl.constexpr, MODE_C: tl.constexpr, MODE_P: tl.constexpr, MODE_OC: tl.constexpr, MODE_OH: tl.constexpr,
    A_CONST: tl.constexpr, C_CONST: tl.constexpr, P_CONST: tl.constexpr, OC_CONST: tl.constexpr, OH_CONST: tl.constexpr,
    G_V: tl.constexpr, G_Q: tl.constexpr, G_OQ: tl.constexpr,
    HAS_S0: tl.constexpr, STORE_ST: tl.constexpr, STORE_Z: tl.constexpr, STORE_CK: tl.constexpr,
):
    """One program: rows [iv*BV, iv*BV+BV) of head (b, h), steps [seg*SEG, seg*SEG+SEG).

    The state tile is held transposed, [BK, BV], so that each row's K values sit in one or
    two threads (reductions over K are in registers). The loop is unrolled by 4 with a
    4-step-deep register prefetch (set j is refilled with step t+4+j right after step t+j
    consumed it) and, on the GPU, an L2 prefetch PF steps ahead: the recurrence is latency
    bound, so the loads must be in flight long before their step.
    """
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_s = tl.program_id(2)
    b = i_bh // H
    h = i_bh % H
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    mask_v = offs_v < V
    mask_k = offs_k < K
    mask_s = mask_k[:, None] & mask_v[None, :]
    tile = offs_k[:, None] * V + offs_v[None, :]
    t_begin = i_s * SEG
    t_end = tl.minimum(t_begin + SEG, T)
    t_last = t_end - 1

    s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        p_s0 = S0 + b.to(tl.int64) * s0_sb + h * s0_sh + i_s * s0_sg + offs_k[:, None] * s0_sk + offs_v[None, :] * s0_sv
        s += tl.load(p_s0, mask=mask_s, other=0.).to(tl.float32)
    if STORE_CK:
        if i_s == 0:
            # checkpoint 0 is the initial state
            tl.store(CK + i_bh.to(tl.int64) * NC * K * V + tile, s, mask=mask_s)

    u0, v0, q0, oq0, a0, c0, p0, oc0, oh0 = _load_set(
        U, Vv, Q, OQ, A, C, P, OC, OH, b, t_begin + 0, t_last, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
        MODE_A, MODE_C, MODE_P, MODE_OC, MODE_OH, A_CONST, C_CONST, P_CONST, OC_CONST, OH_CONST, G_V, G_Q, G_OQ, BV)
    u1, v1, q1, oq1, a1, c1, p1, oc1, oh1 = _load_set(
        U, Vv, Q, OQ, A, C, P, OC, OH, b, t_begin + 1, t_last, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
        MODE_A, MODE_C, MODE_P, MODE_OC, MODE_OH, A_CONST, C_CONST, P_CONST, OC_CONST, OH_CONST, G_V, G_Q, G_OQ, BV)
    u2, v2, q2, oq2, a2, c2, p2, oc2, oh2 = _load_set(
        U, Vv, Q, OQ, A, C, P, OC, OH, b, t_begin + 2, t_last, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
        MODE_A, MODE_C, MODE_P, MODE_OC, MODE_OH, A_CONST, C_CONST, P_CONST, OC_CONST, OH_CONST, G_V, G_Q, G_OQ, BV)
    u3, v3, q3, oq3, a3, c3, p3, oc3, oh3 = _load_set(
        U, Vv, Q, OQ, A, C, P, OC, OH, b, t_begin + 3, t_last, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
        MODE_A, MODE_C, MODE_P, MODE_OC, MODE_OH, A_CONST, C_CONST, P_CONST, OC_CONST, OH_CONST, G_V, G_Q, G_OQ, BV)
    for tb in range(t_begin, t_end, 4):
        if PF > 0:
            rowf = ((b.to(tl.int64) * T + tl.minimum(tb + PF, t_last)) * H + h)
            _prefetch_step(U, Vv, Q, OQ, A, C, P, rowf, offs_k, offs_v, MODE_A, MODE_C, MODE_P,
                           G_V, G_Q, G_OQ, K, V)
            rowf2 = ((b.to(tl.int64) * T + tl.minimum(tb + PF + 2, t_last)) * H + h)
            _prefetch_step(U, Vv, Q, OQ, A, C, P, rowf2, offs_k, offs_v, MODE_A, MODE_C, MODE_P,
                           G_V, G_Q, G_OQ, K, V)
        s = _fwd_step(s, u0, v0, q0, oq0, a0, c0, p0, oc0, oh0, tb + 0, t_end, b, T, H, h, V, K, NC, i_bh,
                      offs_v, mask_v, tile, mask_s, Y, Z, CK, CHUNK, STORE_Z, STORE_CK)
        u0, v0, q0, oq0, a0, c0, p0, oc0, oh0 = _load_set(
            U, Vv, Q, OQ, A, C, P, OC, OH, b, tb + 4, t_last, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
            MODE_A, MODE_C, MODE_P, MODE_OC, MODE_OH, A_CONST, C_CONST, P_CONST, OC_CONST, OH_CONST, G_V, G_Q, G_OQ, BV)
        s = _fwd_step(s, u1, v1, q1, oq1, a1, c1, p1, oc1, oh1, tb + 1, t_end, b, T, H, h, V, K, NC, i_bh,
                      offs_v, mask_v, tile, mask_s, Y, Z, CK, CHUNK, STORE_Z, STORE_CK)
        u1, v1, q1, oq1, a1, c1, p1, oc1, oh1 = _load_set(
            U, Vv, Q, OQ, A, C, P, OC, OH, b, tb + 5, t_last, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
            MODE_A, MODE_C, MODE_P, MODE_OC, MODE_OH, A_CONST, C_CONST, P_CONST, OC_CONST, OH_CONST, G_V, G_Q, G_OQ, BV)
        s = _fwd_step(s, u2, v2, q2, oq2, a2, c2, p2, oc2, oh2, tb + 2, t_end, b, T, H, h, V, K, NC, i_bh,
                      offs_v, mask_v, tile, mask_s, Y, Z, CK, CHUNK, STORE_Z, STORE_CK)
        u2, v2, q2, oq2, a2, c2, p2, oc2, oh2 = _load_set(
            U, Vv, Q, OQ, A, C, P, OC, OH, b, tb + 6, t_last, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
            MODE_A, MODE_C, MODE_P, MODE_OC, MODE_OH, A_CONST, C_CONST, P_CONST, OC_CONST, OH_CONST, G_V, G_Q, G_OQ, BV)
        s = _fwd_step(s, u3, v3, q3, oq3, a3, c3, p3, oc3, oh3, tb + 3, t_end, b, T, H, h, V, K, NC, i_bh,
                      offs_v, mask_v, tile, mask_s, Y, Z, CK, CHUNK, STORE_Z, STORE_CK)
        u3, v3, q3, oq3, a3, c3, p3, oc3, oh3 = _load_set(
            U, Vv, Q, OQ, A, C, P, OC, OH, b, tb + 7, t_last, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
            MODE_A, MODE_C, MODE_P, MODE_OC, MODE_OH, A_CONST, C_CONST, P_CONST, OC_CONST, OH_CONST, G_V, G_Q, G_OQ, BV)
    if STORE_ST:
        tl.store(ST + i_bh.to(tl.int64) * K * V + tile, s, mask=mask_s)


@triton.jit
def _store_row_grad(ptr, base_row, part_head, offs_v, mask_v, valid, g, MODE: tl.constexpr):
    """Gradient of a row coefficient: per row -> [B,T,H,V]; per head -> partial [NV,B,T,H].
    ``mask_v`` masks rows, ``valid`` the whole step."""
    if MODE == 2:
        tl.store(ptr + base_row + offs_v, g, mask=mask_v & valid)
    elif MODE == 1:
        tl.store(ptr + part_head, tl.sum(tl.where(mask_v, g, 0.), axis=0), mask=valid)


@triton.jit
def _load_bwd_set(U, Vv, Q, OQ, A, C, P, OC, DY, Z, scr, b, t, t_lo, t0, T, H, h, K, V,
                  offs_k, mask_k, offs_v, mask_v,
                  MODE_A: tl.constexpr, MODE_C: tl.constexpr, MODE_P: tl.constexpr, MODE_OC: tl.constexpr,
                  A_CONST: tl.constexpr, C_CONST: tl.constexpr, P_CONST: tl.constexpr, OC_CONST: tl.constexpr,
                  G_V: tl.constexpr, G_Q: tl.constexpr, G_OQ: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                  INVERT: tl.constexpr):
    """Everything step max(t, t_lo) of the backward reads: slots, dy, and z (INVERT) or the
    stored s_{t-1} (scratch)."""
    tc = tl.maximum(t, t_lo)
    row = (b.to(tl.int64) * T + tc) * H + h
    u, v, q, oq = _load_vecs(U, Vv, Q, OQ, row * K, offs_k, mask_k, G_V, G_Q, G_OQ)
    a = _load_row(A, row * V, row, offs_v, mask_v, MODE_A, A_CONST, BV)
    c = _load_row(C, row * V, row, offs_v, mask_v, MODE_C, C_CONST, BV)
    p = _load_row(P, row * V, row, offs_v, mask_v, MODE_P, P_CONST, BV)
    oc = _load_row(OC, row * V, row, offs_v, mask_v, MODE_OC, OC_CONST, BV)
    dy = tl.load(DY + row * V + offs_v, mask=mask_v, other=0.).to(tl.float32)
    if INVERT:
        zs = tl.load(Z + row * V + offs_v, mask=mask_v, other=0.)
    else:
        zs = tl.load(scr + (tc - t0) * BK * BV)
    return u, v, q, oq, a, c, p, oc, dy, zs


@triton.jit
def _bwd_step(ds, st, u, v, q, oq, a, c, p, oc, dy, zs, t, t_lo, b, T, H, h, V, K, NB, NG, i_v,
              offs_v, mask_v, offs_k, mask_k,
              DA, DC, DP, DOC, DM, BV: tl.constexpr,
              MODE_A: tl.constexpr, MODE_C: tl.constexpr, MODE_P: tl.constexpr, MODE_OC: tl.constexpr,
              G_V: tl.constexpr, G_Q: tl.constexpr, G_OQ: tl.constexpr,
              I_V: tl.constexpr, I_Q: tl.constexpr, I_OQ: tl.constexpr, INVERT: tl.constexpr):
    """One reverse step (no-op when t < t_lo): st is s_t, ds the adjoint of s_t from later
    steps; stores step t's gradients; returns (adjoint of s_{t-1}, s_{t-1})."""
    valid = t >= t_lo
    row = (b.to(tl.int64) * T + t) * H + h
    if INVERT:
        z = zs
        sp = st + v[:, None] * (c * z)[None, :] - q[:, None] * p[None, :]
    else:
        sp = zs
        z = tl.sum(sp * u[:, None], axis=0)
        st = a[None, :] * sp - v[:, None] * (c * z)[None, :] + q[:, None] * p[None, :]
    wo = oc * dy
    ds_in = ds
    ds = ds + oq[:, None] * wo[None, :]
    e = tl.sum(ds * v[:, None], axis=0)
    part_head = (i_v * NB + b.to(tl.int64) * T + t) * H + h      # [NV, B, T, H] partials
    if MODE_C != 0:
        _store_row_grad(DC, row * V, part_head, offs_v, mask_v, valid, -z * e, MODE_C)
    if MODE_P != 0:
        _store_row_grad(DP, row * V, part_head, offs_v, mask_v, valid, tl.sum(ds * q[:, None], axis=0), MODE_P)
    if MODE_OC != 0:
        _store_row_grad(DOC, row * V, part_head, offs_v, mask_v, valid, dy * tl.sum(st * oq[:, None], axis=0), MODE_OC)
    if MODE_A != 0:
        _store_row_grad(DA, row * V, part_head, offs_v, mask_v, valid, tl.sum(ds * sp, axis=0), MODE_A)
    # K-vector gradients, one row-reduction per distinct input tensor
    wu = -(c * e)          # coefficient of s_{t-1} in du
    wv = -(c * z)          # coefficient of ds in dv
    wq = p                 # coefficient of ds in dq
    d0 = tl.zeros([BV], dtype=tl.float32)
    if G_V == 0:
        d0 += wv
    if G_Q == 0:
        d0 += wq
    g0 = sp * wu[None, :] + ds * d0[None, :]
    if G_OQ == 0:
        g0 += st * wo[None, :]
    mk = mask_k & valid
    dm = DM + (((i_v * NG) * NB + b.to(tl.int64) * T + t) * H + h) * K + offs_k
    tl.store(dm, tl.sum(g0, axis=1), mask=mk)
    if G_V == 1:
        d1 = wv
        if G_Q == 1:
            d1 += wq
        g1 = ds * d1[None, :]
        if G_OQ == 1:
            g1 += st * wo[None, :]
        tl.store(dm + I_V * NB * H * K, tl.sum(g1, axis=1), mask=mk)
    if G_Q == 2:
        g2 = ds * wq[None, :]
        if G_OQ == 2:
            g2 += st * wo[None, :]
        tl.store(dm + I_Q * NB * H * K, tl.sum(g2, axis=1), mask=mk)
    if G_OQ == 3:
        tl.store(dm + I_OQ * NB * H * K, tl.sum(st * wo[None, :], axis=1), mask=mk)
    # adjoint of s_{t-1}
    ds_new = a[None, :] * ds - u[:, None] * (c * e)[None, :]
    ds = tl.where(valid, ds_new, ds_in)
    st = tl.where(valid, sp, st)
    return ds, st


@triton.jit
def _bwd_kernel(
    U, Vv, Q, OQ, A, C, P, OC,
    Z, CK, SCR, ST, DY, DHT, dht_sb, dht_sh, dht_sk, dht_sv,
    DA, DC, DP, DOC, DM, DS0,
    T, H, V, K, NC, NV, NB, NG,
    BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr, PF: tl.constexpr,
    MODE_A: tl.constexpr, MODE_C: tl.constexpr, MODE_P: tl.constexpr, MODE_OC: tl.constexpr,
    A_CONST: tl.constexpr, C_CONST: tl.constexpr, P_CONST: tl.constexpr, OC_CONST: tl.constexpr,
    G_V: tl.constexpr, G_Q: tl.constexpr, G_OQ: tl.constexpr,
    I_V: tl.constexpr, I_Q: tl.constexpr, I_OQ: tl.constexpr,   # buffer index of each slot's group
    INVERT: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DS0: tl.constexpr,
):
    """Reverse-time adjoint sweep for rows [iv*BV, iv*BV+BV) of head (b, h); tiles [BK, BV].

    INVERT (a == 1): s_{t-1} = s_t + c z v - p q from the stored z, reset to the stored
    checkpoint at every chunk start. Otherwise each chunk's states are recomputed from its
    checkpoint into SCR [prog, CHUNK, BK, BV] and read back in reverse. The reverse loop is
    unrolled by 4 with a 4-step register prefetch, as in the forward.
    """
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    b = i_bh // H
    h = i_bh % H
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    mask_v = offs_v < V
    mask_k = offs_k < K
    mask_s = mask_k[:, None] & mask_v[None, :]
    tile = offs_k[:, None] * V + offs_v[None, :]

    ds = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        p_dht = DHT + b.to(tl.int64) * dht_sb + h * dht_sh + offs_k[:, None] * dht_sk + offs_v[None, :] * dht_sv
        ds += tl.load(p_dht, mask=mask_s, other=0.).to(tl.float32)
    st = tl.zeros([BK, BV], dtype=tl.float32)
    if INVERT:
        st += tl.load(ST + i_bh.to(tl.int64) * K * V + tile, mask=mask_s, other=0.)
    scr = SCR + ((i_bh.to(tl.int64) * NV + i_v) * CHUNK) * BK * BV \
        + offs_k[:, None] * BV + tl.arange(0, BV)[None, :]

    for jc in range(0, NC):
        ci = NC - 1 - jc
        t0 = ci * CHUNK
        t1 = tl.minimum(t0 + CHUNK, T)
        if not INVERT:
            # recompute this chunk's states s_{t-1}, t in [t0, t1), into the scratch buffer
            sp = tl.load(CK + (i_bh.to(tl.int64) * NC + ci) * K * V + tile, mask=mask_s, other=0.)
            for t in range(t0, t1):
                row = ((b.to(tl.int64) * T + t) * H + h)
                u, v, q, oq = _load_vecs(U, Vv, Q, OQ, row * K, offs_k, mask_k, G_V, G_Q, G_OQ)
                a = _load_row(A, row * V, row, offs_v, mask_v, MODE_A, A_CONST, BV)
                c = _load_row(C, row * V, row, offs_v, mask_v, MODE_C, C_CONST, BV)
                p = _load_row(P, row * V, row, offs_v, mask_v, MODE_P, P_CONST, BV)
                tl.store(scr + (t - t0) * BK * BV, sp)
                z = tl.sum(sp * u[:, None], axis=0)
                sp = a[None, :] * sp - v[:, None] * (c * z)[None, :] + q[:, None] * p[None, :]
            tl.debug_barrier()
        u0, v0, q0, oq0, a0, c0, p0, oc0, dy0, zs0 = _load_bwd_set(
            U, Vv, Q, OQ, A, C, P, OC, DY, Z, scr, b, t1 - 1, t0, t0, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
            MODE_A, MODE_C, MODE_P, MODE_OC, A_CONST, C_CONST, P_CONST, OC_CONST, G_V, G_Q, G_OQ, BV, BK, INVERT)
        u1, v1, q1, oq1, a1, c1, p1, oc1, dy1, zs1 = _load_bwd_set(
            U, Vv, Q, OQ, A, C, P, OC, DY, Z, scr, b, t1 - 2, t0, t0, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
            MODE_A, MODE_C, MODE_P, MODE_OC, A_CONST, C_CONST, P_CONST, OC_CONST, G_V, G_Q, G_OQ, BV, BK, INVERT)
        u2, v2, q2, oq2, a2, c2, p2, oc2, dy2, zs2 = _load_bwd_set(
            U, Vv, Q, OQ, A, C, P, OC, DY, Z, scr, b, t1 - 3, t0, t0, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
            MODE_A, MODE_C, MODE_P, MODE_OC, A_CONST, C_CONST, P_CONST, OC_CONST, G_V, G_Q, G_OQ, BV, BK, INVERT)
        u3, v3, q3, oq3, a3, c3, p3, oc3, dy3, zs3 = _load_bwd_set(
            U, Vv, Q, OQ, A, C, P, OC, DY, Z, scr, b, t1 - 4, t0, t0, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
            MODE_A, MODE_C, MODE_P, MODE_OC, A_CONST, C_CONST, P_CONST, OC_CONST, G_V, G_Q, G_OQ, BV, BK, INVERT)
        for jt in range(0, t1 - t0, 4):
            t = t1 - 1 - jt
            if PF > 0:
                rowf = ((b.to(tl.int64) * T + tl.maximum(t - PF, 0)) * H + h)
                _prefetch_step(U, Vv, Q, OQ, A, C, P, rowf, offs_k, offs_v, MODE_A, MODE_C, MODE_P,
                               G_V, G_Q, G_OQ, K, V)
                _prefetch_l2(DY + rowf * V + offs_v)
                if INVERT:
                    _prefetch_l2(Z + rowf * V + offs_v)
            ds, st = _bwd_step(ds, st, u0, v0, q0, oq0, a0, c0, p0, oc0, dy0, zs0, t, t0, b, T, H, h, V, K, NB, NG,
                               i_v, offs_v, mask_v, offs_k, mask_k, DA, DC, DP, DOC, DM, BV,
                               MODE_A, MODE_C, MODE_P, MODE_OC, G_V, G_Q, G_OQ, I_V, I_Q, I_OQ, INVERT)
            u0, v0, q0, oq0, a0, c0, p0, oc0, dy0, zs0 = _load_bwd_set(
                U, Vv, Q, OQ, A, C, P, OC, DY, Z, scr, b, t - 4, t0, t0, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
                MODE_A, MODE_C, MODE_P, MODE_OC, A_CONST, C_CONST, P_CONST, OC_CONST, G_V, G_Q, G_OQ, BV, BK, INVERT)
            ds, st = _bwd_step(ds, st, u1, v1, q1, oq1, a1, c1, p1, oc1, dy1, zs1, t - 1, t0, b, T, H, h, V, K, NB, NG,
                               i_v, offs_v, mask_v, offs_k, mask_k, DA, DC, DP, DOC, DM, BV,
                               MODE_A, MODE_C, MODE_P, MODE_OC, G_V, G_Q, G_OQ, I_V, I_Q, I_OQ, INVERT)
            u1, v1, q1, oq1, a1, c1, p1, oc1, dy1, zs1 = _load_bwd_set(
                U, Vv, Q, OQ, A, C, P, OC, DY, Z, scr, b, t - 5, t0, t0, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
                MODE_A, MODE_C, MODE_P, MODE_OC, A_CONST, C_CONST, P_CONST, OC_CONST, G_V, G_Q, G_OQ, BV, BK, INVERT)
            ds, st = _bwd_step(ds, st, u2, v2, q2, oq2, a2, c2, p2, oc2, dy2, zs2, t - 2, t0, b, T, H, h, V, K, NB, NG,
                               i_v, offs_v, mask_v, offs_k, mask_k, DA, DC, DP, DOC, DM, BV,
                               MODE_A, MODE_C, MODE_P, MODE_OC, G_V, G_Q, G_OQ, I_V, I_Q, I_OQ, INVERT)
            u2, v2, q2, oq2, a2, c2, p2, oc2, dy2, zs2 = _load_bwd_set(
                U, Vv, Q, OQ, A, C, P, OC, DY, Z, scr, b, t - 6, t0, t0, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
                MODE_A, MODE_C, MODE_P, MODE_OC, A_CONST, C_CONST, P_CONST, OC_CONST, G_V, G_Q, G_OQ, BV, BK, INVERT)
            ds, st = _bwd_step(ds, st, u3, v3, q3, oq3, a3, c3, p3, oc3, dy3, zs3, t - 3, t0, b, T, H, h, V, K, NB, NG,
                               i_v, offs_v, mask_v, offs_k, mask_k, DA, DC, DP, DOC, DM, BV,
                               MODE_A, MODE_C, MODE_P, MODE_OC, G_V, G_Q, G_OQ, I_V, I_Q, I_OQ, INVERT)
            u3, v3, q3, oq3, a3, c3, p3, oc3, dy3, zs3 = _load_bwd_set(
                U, Vv, Q, OQ, A, C, P, OC, DY, Z, scr, b, t - 7, t0, t0, T, H, h, K, V, offs_k, mask_k, offs_v, mask_v,
                MODE_A, MODE_C, MODE_P, MODE_OC, A_CONST, C_CONST, P_CONST, OC_CONST, G_V, G_Q, G_OQ, BV, BK, INVERT)
        if INVERT:
            # exact state at the chunk start (stops rounding from accumulating)
            st = tl.load(CK + (i_bh.to(tl.int64) * NC + ci) * K * V + tile, mask=mask_s, other=0.)
    if STORE_DS0:
        tl.store(DS0 + i_bh.to(tl.int64) * K * V + tile, ds, mask=mask_s)


@triton.jit
def _segment_kernel(
    U, Vv, Q, OQ, A, C, P,
    PR, LOC,                                   # [B*H, NSEG, K, K, V], [B*H, NSEG, K, V]
    T, H, V, K, SEG, NSEG,
    BV: tl.constexpr, BK: tl.constexpr,
    MODE_A: tl.constexpr, MODE_C: tl.constexpr, MODE_P: tl.constexpr,
    A_CONST: tl.constexpr, C_CONST: tl.constexpr, P_CONST: tl.constexpr,
    G_V: tl.constexpr, G_Q: tl.constexpr, G_OQ: tl.constexpr,
):
    """Chunked forward, phase 1: per segment, each row's transition product
    P_i = M_{t0} ... M_{t1-1} (M = a I - c u v^T, s_t = s_{t-1} M + p q^T), held as
    pm[r, j, i] = (P_i)_{rj}, and the segment's end state from a zero start."""
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_s = tl.program_id(2)
    b = i_bh // H
    h = i_bh % H
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    mask_v = offs_v < V
    mask_k = offs_k < K
    eye = (offs_k[:, None] == offs_k[None, :]).to(tl.float32)
    pm = tl.zeros([BK, BK, BV], dtype=tl.float32) + eye[:, :, None]
    s = tl.zeros([BK, BV], dtype=tl.float32)
    t0 = i_s * SEG
    t1 = tl.minimum(t0 + SEG, T)
    for t in range(t0, t1):
        row = ((b.to(tl.int64) * T + t) * H + h)
        u, v, q, oq = _load_vecs(U, Vv, Q, OQ, row * K, offs_k, mask_k, G_V, G_Q, G_OQ)
        a = _load_row(A, row * V, row, offs_v, mask_v, MODE_A, A_CONST, BV)
        c = _load_row(C, row * V, row, offs_v, mask_v, MODE_C, C_CONST, BV)
        p = _load_row(P, row * V, row, offs_v, mask_v, MODE_P, P_CONST, BV)
        z = tl.sum(s * u[:, None], axis=0)
        s = a[None, :] * s - v[:, None] * (c * z)[None, :] + q[:, None] * p[None, :]
        pu = tl.sum(pm * u[None, :, None], axis=1)                         # [BK(r), BV]
        pm = a[None, None, :] * pm - (pu * c[None, :])[:, None, :] * v[None, :, None]
    base = (i_bh.to(tl.int64) * NSEG + i_s) * K
    mask_s = mask_k[:, None] & mask_v[None, :]
    tl.store(LOC + (base + offs_k[:, None]) * V + offs_v[None, :], s, mask=mask_s)
    p_pr = PR + ((base + offs_k[:, None, None]) * K + offs_k[None, :, None]) * V + offs_v[None, None, :]
    tl.store(p_pr, pm, mask=mask_k[:, None, None] & mask_s[None, :, :])


@triton.jit
def _propagate_kernel(
    S0, s0_sb, s0_sh, s0_sk, s0_sv, PR, LOC, SS,
    H, V, K, NSEG,
    BV: tl.constexpr, BK: tl.constexpr, HAS_S0: tl.constexpr,
):
    """Chunked forward, phase 2: segment start states SS[g] = SS[g-1] P_{g-1} + local end."""
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    b = i_bh // H
    h = i_bh % H
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, BK)
    mask_v = offs_v < V
    mask_k = offs_k < K
    mask_s = mask_k[:, None] & mask_v[None, :]
    s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        s += tl.load(S0 + b.to(tl.int64) * s0_sb + h * s0_sh + offs_k[:, None] * s0_sk + offs_v[None, :] * s0_sv,
                     mask=mask_s, other=0.).to(tl.float32)
    for g in range(0, NSEG):
        base = (i_bh.to(tl.int64) * NSEG + g) * K
        tl.store(SS + (base + offs_k[:, None]) * V + offs_v[None, :], s, mask=mask_s)
        pm = tl.load(PR + ((base + offs_k[:, None, None]) * K + offs_k[None, :, None]) * V + offs_v[None, None, :],
                     mask=mask_k[:, None, None] & mask_s[None, :, :], other=0.)
        loc = tl.load(LOC + (base + offs_k[:, None]) * V + offs_v[None, :], mask=mask_s, other=0.)
        s = tl.sum(s[:, None, :] * pm, axis=0) + loc


# ----------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------

def default_config(BH: int, V: int, K: int, which: str = "fwd") -> tuple[int, int]:
    """(BV, num_warps). Interpreter: one large tile (few programs run fastest). GPU: one warp
    per program so that the per-step chain has no cross-warp step, and small row blocks so
    that B*H*V/BV programs fill the chip. Measured on an H200 at B=8, T=2048, K=16, V=1536
    (BENCHMARKS.md, "Rank-1 per row", run 2): forward best at BV=32 (0.535 ms; 16: 0.577,
    8: 0.575, 2 warps: 0.78-0.90), backward best at BV=16 (fwd+bwd 1.98 ms; 8: 2.73, 32: 2.10)."""
    if INTERPRET:
        return min(next_pow2(V), 64), 1
    BK = next_pow2(K)
    if BK <= 16:
        return (32, 1) if which == "fwd" else (16, 1)
    if BK <= 32:
        return 16, 1
    return 16, 2


_CONFIG_OVERRIDE: dict = {}


def set_config(fwd=None, bwd=None):
    """Force (BV, num_warps) for the forward / backward kernels (benchmarks); None resets."""
    _CONFIG_OVERRIDE["fwd"] = fwd
    _CONFIG_OVERRIDE["bwd"] = bwd


def _config(which, BH, V, K):
    return _CONFIG_OVERRIDE.get(which) or default_config(BH, V, K, which)


ROW_SLOTS = ("a", "c", "p", "oc", "oh")
VEC_SLOTS = ("u", "v", "q", "oq")


def _row_mode(x):
    """(mode, const, tensor) of a row coefficient: 0 constant, 1 per head, 2 per row."""
    if x is None:
        return 0, 0.0, None
    if not isinstance(x, torch.Tensor):
        return 0, float(x), None
    return (2 if x.dim() == 4 else 1), 0.0, x


def _groups(vecs):
    """For v, q, oq: index (0..3) of the first of (u, v, q, oq) that is the same tensor."""
    out = []
    for i in (1, 2, 3):
        g = i
        for j in range(i):
            if vecs[j] is vecs[i]:
                g = j
                break
        out.append(g)
    return out


POISON = False        # tests: fill outputs with NaN before the kernels run (unwritten -> NaN)
PREFETCH = 16         # L2 prefetch distance in steps on the GPU (0: off; always off when interpreting)


def _new(shape, device, dtype=torch.float32):
    return buffer(shape, device, dtype, POISON)


def _prefetch_distance() -> int:
    return 0 if INTERPRET else int(PREFETCH)


def _dummy(device):
    return torch.empty(1, device=device, dtype=torch.float32)


def _contig(x):
    return x if x is None or not isinstance(x, torch.Tensor) else x.contiguous()


def _forward(u, v, q, oq, a, c, p, oc, oh, S0, V, out_dtype, *, want_state, training):
    """S0: [B, H, V, K] (math layout, any strides) or None.
    Returns y [B,T,H,V], S_T [B,H,K,V] fp32, z [B,T,H,V] fp32, checkpoints [B,H,NC,K,V] fp32."""
    B, T, H, K = u.shape
    dev = u.device
    BV, nw = _config("fwd", B * H, V, K)
    BK = next_pow2(K)
    NV = cdiv(V, BV)
    G_V, G_Q, G_OQ = _groups((u, v, q, oq))
    modes = {n: _row_mode(x) for n, x in zip(ROW_SLOTS, (a, c, p, oc, oh))}
    invert = modes["a"][0] == 0 and modes["a"][1] == 1.0
    NC = max(1, cdiv(T, CHUNK))
    y = _new((B, T, H, V), dev, out_dtype)
    ST = _new((B, H, K, V), dev) if (want_state or (training and invert)) else None
    Z = _new((B, T, H, V), dev) if (training and invert) else None
    CK = _new((B, H, NC, K, V), dev) if training else None
    d = _dummy(dev)
    if S0 is not None:
        S0 = S0.transpose(-1, -2).contiguous()     # [B, H, K, V], like every state tile
    s0 = S0 if S0 is not None else d
    s0_strides = (H * K * V, K * V, 0, V, 1) if S0 is not None else (0,) * 5
    grid = (B * H, NV, 1)
    if T > 0:
        launch(_fwd_kernel, grid,
            u, v, q, oq, *[(modes[n][2] if modes[n][2] is not None else d) for n in ROW_SLOTS],
            s0, *s0_strides,
            y, ST if ST is not None else d, Z if Z is not None else d, CK if CK is not None else d,
            T, H, V, K, T, NC,
            BV=BV, BK=BK, CHUNK=CHUNK, PF=_prefetch_distance(),
            MODE_A=modes["a"][0], MODE_C=modes["c"][0], MODE_P=modes["p"][0], MODE_OC=modes["oc"][0],
            MODE_OH=modes["oh"][0],
            A_CONST=modes["a"][1], C_CONST=modes["c"][1], P_CONST=modes["p"][1], OC_CONST=modes["oc"][1],
            OH_CONST=modes["oh"][1],
            G_V=G_V, G_Q=G_Q, G_OQ=G_OQ,
            HAS_S0=S0 is not None, STORE_ST=ST is not None, STORE_Z=Z is not None, STORE_CK=CK is not None,
            num_warps=nw,
        )
    elif ST is not None:
        ST.copy_(S0 if S0 is not None else torch.zeros_like(ST))
    return y, ST, Z, CK


def _backward(saved, groups, dy, dht, needs_ds0):
    (u, v, q, oq, a, c, p, oc, Z, CK, ST, V) = saved
    B, T, H, K = u.shape
    dev = u.device
    BV, nw = _config("bwd", B * H, V, K)
    BK = next_pow2(K)
    NV = cdiv(V, BV)
    NC = max(1, cdiv(T, CHUNK))
    G_V, G_Q, G_OQ = groups
    distinct = [0] + [i for i, g in zip((1, 2, 3), (G_V, G_Q, G_OQ)) if g == i]
    index = {slot: distinct.index(slot) if slot in distinct else 0 for slot in range(4)}
    NG = len(distinct)
    modes = {n: _row_mode(x) for n, x in zip(ROW_SLOTS[:4], (a, c, p, oc))}
    invert = Z is not None
    f32 = dict(device=dev, dtype=torch.float32)

    def row_buf(n):
        mode = modes[n][0]
        if mode == 2:
            return _new((B, T, H, V), dev)
        if mode == 1:
            return _new((NV, B, T, H), dev)
        return None

    bufs = {n: row_buf(n) for n in ROW_SLOTS[:4]}
    DM = _new((NV, NG, B, T, H, K), dev)
    DS0 = _new((B, H, K, V), dev) if needs_ds0 else None
    SCR = None if invert else torch.empty(B * H * NV * CHUNK * BV * BK, **f32)
    d = _dummy(dev)
    dy = dy.contiguous()
    if dht is not None:
        # [B, H, V, K] -> contiguous [B, H, K, V]: the same layout as every other state tile
        dht = dht.transpose(-1, -2).contiguous()
    dht_strides = (H * K * V, K * V, V, 1) if dht is not None else (0,) * 4
    if T > 0 or DS0 is not None:
        launch(_bwd_kernel, (B * H, NV),
            u, v, q, oq, *[(modes[n][2] if modes[n][2] is not None else d) for n in ROW_SLOTS[:4]],
            Z if Z is not None else d, CK, SCR if SCR is not None else d, ST if ST is not None else d,
            dy, dht if dht is not None else d, *dht_strides,
            *[(bufs[n] if bufs[n] is not None else d) for n in ROW_SLOTS[:4]], DM, DS0 if DS0 is not None else d,
            T, H, V, K, NC if T > 0 else 0, NV, B * T, NG,
            BV=BV, BK=BK, CHUNK=CHUNK, PF=_prefetch_distance(),
            MODE_A=modes["a"][0], MODE_C=modes["c"][0], MODE_P=modes["p"][0], MODE_OC=modes["oc"][0],
            A_CONST=modes["a"][1], C_CONST=modes["c"][1], P_CONST=modes["p"][1], OC_CONST=modes["oc"][1],
            G_V=G_V, G_Q=G_Q, G_OQ=G_OQ, I_V=index[1], I_Q=index[2], I_OQ=index[3],
            INVERT=invert, HAS_DHT=dht is not None, STORE_DS0=DS0 is not None,
            num_warps=nw,
        )
    dm = DM.sum(0) if NV > 1 else DM[0]
    vec_grads = [dm[index[0]]]
    for slot, g in zip((1, 2, 3), (G_V, G_Q, G_OQ)):
        vec_grads.append(dm[index[slot]] if g == slot else None)
    row_grads = []
    for n in ROW_SLOTS[:4]:
        buf = bufs[n]
        row_grads.append(buf.sum(0) if buf is not None and buf.dim() == 4 and modes[n][0] == 1 else buf)
    return vec_grads, row_grads, (DS0.transpose(-1, -2) if DS0 is not None else None)


# ----------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------

class _Rank1RowFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, v, q, oq, a, c, p, oc, oh, S0, V, out_dtype, output_final_state):
        training = any(isinstance(x, torch.Tensor) and x.requires_grad for x in (u, v, q, oq, a, c, p, oc, oh, S0))
        y, ST, Z, CK = _forward(u, v, q, oq, a, c, p, oc, oh, S0, V, out_dtype,
                                want_state=output_final_state, training=training)
        ctx.groups = _groups((u, v, q, oq))
        ctx.s0_dtype = S0.dtype if S0 is not None else None
        ctx.row_consts = [None if isinstance(x, torch.Tensor) else x for x in (a, c, p, oc)]
        tensors = [x if isinstance(x, torch.Tensor) else None for x in (a, c, p, oc)]
        ctx.save_for_backward(u, v, q, oq, *tensors, Z, CK, ST)
        ctx.V = V
        ctx.oh_kind = None if oh is None or not isinstance(oh, torch.Tensor) else oh.dim()
        ctx.has_s0 = S0 is not None
        return y, (ST.transpose(-1, -2) if output_final_state else None)

    @staticmethod
    def backward(ctx, dy, dST):
        u, v, q, oq, ta, tc, tp, toc, Z, CK, ST = ctx.saved_tensors
        a, c, p, oc = [t if t is not None else k for t, k in zip((ta, tc, tp, toc), ctx.row_consts)]
        if dy is None:
            dy = torch.zeros(u.shape[0], u.shape[1], u.shape[2], ctx.V, device=u.device, dtype=torch.float32)
        vec, row, dS0 = _backward((u, v, q, oq, a, c, p, oc, Z, CK, ST, ctx.V), ctx.groups, dy, dST,
                                  needs_ds0=ctx.has_s0 and ctx.needs_input_grad[9])
        if dS0 is not None:
            dS0 = dS0.to(ctx.s0_dtype)
        doh = None
        if ctx.oh_kind == 4:
            doh = dy
        elif ctx.oh_kind == 3:
            doh = dy.float().sum(-1)
        cast = [g.to(x.dtype) if g is not None and isinstance(x, torch.Tensor) else None
                for g, x in zip(vec + row, (u, v, q, oq, a, c, p, oc))]
        return (*cast, doh, dS0, None, None, None)


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------

def rank1_row_recurrence(u, v, q, oq, c, p, a=1.0, oc=1.0, oh=None, initial_state=None,
                         output_final_state=False, state_layout="fla"):
    """Identity-minus-rank-1 recurrence, per row ``i`` of the state::

        s_t,i = a_i s_{t-1,i} - c_i (s_{t-1,i} . u_t) v_t + p_i q_t,   y_t,i = oc_i (s_t,i . oq_t) + oh_i

    Args:
        u, v, q, oq: ``[B, T, H, K]`` (pass the same tensor for equal slots, e.g. Longhorn's
            ``u = v = q = k``: it is read once and its gradient accumulated once).
        c, p, a, oc, oh: ``[B, T, H, V]`` (per row), ``[B, T, H]`` (per head) or a float
            (``oh`` may be None).
        initial_state: ``[B, H, K, V]`` (``state_layout="fla"``) or ``[B, H, V, K]`` ("math").
        output_final_state: also return the final state (fp32, same layout).
    Returns:
        ``y [B, T, H, V]`` (dtype of ``u``), final state or None.
    Longhorn exact: ``c = beta / (1 + beta (k.k))``, ``p = c x``, ``u = v = q = k``, ``oq = q_read``.
    """
    S0 = initial_state
    if S0 is not None and state_layout == "fla":
        S0 = S0.transpose(-1, -2)
    u, v, q, oq = _dedup_contig((u, v, q, oq))
    a, c, p, oc, oh = _dedup_contig((a, c, p, oc, oh))
    V = next(x.shape[3] for x in (p, c, a, oc, oh) if isinstance(x, torch.Tensor) and x.dim() == 4) \
        if S0 is None else S0.shape[2]
    y, ST = _Rank1RowFunction.apply(u, v, q, oq, a, c, p, oc, oh, S0, V, u.dtype, output_final_state)
    if ST is not None and state_layout == "fla":
        ST = ST.transpose(-1, -2)
    return y, ST


def _dedup_contig(xs):
    out = []
    for i, x in enumerate(xs):
        j = next((j for j in range(i) if xs[j] is x and isinstance(x, torch.Tensor)), None)
        out.append(out[j] if j is not None else _contig(x))
    return out


def chunked_forward(u, v, q, oq, c, p, a=1.0, oc=1.0, oh=None, initial_state=None, segment=256, config=None):
    """Time-parallel forward of ``rank1_row_recurrence`` (no autograd): phase 1 per-segment
    K x K transition products per row, phase 2 propagation of the segment start states,
    phase 3 the sequential kernel on all segments at once.

    Shapes as ``rank1_row_recurrence``; ``initial_state`` ``[B, H, V, K]`` (math layout).
    Returns ``(y [B, T, H, V], S_T [B, H, V, K] fp32)``."""
    u, v, q, oq = _dedup_contig((u, v, q, oq))
    a, c, p, oc, oh = _dedup_contig((a, c, p, oc, oh))
    B, T, H, K = u.shape
    V = p.shape[3]
    dev = u.device
    BV, nw = config or _config("fwd", B * H, V, K)
    BK = next_pow2(K)
    NV = cdiv(V, BV)
    NSEG = max(1, cdiv(T, segment))
    G_V, G_Q, G_OQ = _groups((u, v, q, oq))
    modes = {n: _row_mode(x) for n, x in zip(ROW_SLOTS, (a, c, p, oc, oh))}
    d = _dummy(dev)
    rows = [(modes[n][2] if modes[n][2] is not None else d) for n in ROW_SLOTS]
    PR = _new((B * H, NSEG, K, K, V), dev)
    LOC = _new((B * H, NSEG, K, V), dev)
    SS = _new((B * H, NSEG, K, V), dev)
    S0 = initial_state
    cm = dict(MODE_A=modes["a"][0], MODE_C=modes["c"][0], MODE_P=modes["p"][0],
              A_CONST=modes["a"][1], C_CONST=modes["c"][1], P_CONST=modes["p"][1], G_V=G_V, G_Q=G_Q, G_OQ=G_OQ)
    launch(_segment_kernel, (B * H, NV, NSEG), u, v, q, oq, *rows[:3], PR, LOC, T, H, V, K, segment, NSEG,
           BV=BV, BK=BK, num_warps=max(nw, 4), **cm)
    s0_strides = (S0.stride(0), S0.stride(1), S0.stride(3), S0.stride(2)) if S0 is not None else (0,) * 4
    launch(_propagate_kernel, (B * H, NV), S0 if S0 is not None else d, *s0_strides, PR, LOC, SS, H, V, K, NSEG,
           BV=BV, BK=BK, HAS_S0=S0 is not None, num_warps=nw)
    y = _new((B, T, H, V), dev, u.dtype)
    # phase 3: every segment from its start state
    launch(_fwd_kernel, (B * H, NV, NSEG),
        u, v, q, oq, *rows, SS, H * NSEG * K * V, NSEG * K * V, K * V, V, 1,
        y, d, d, d, T, H, V, K, segment, 1,
        BV=BV, BK=BK, CHUNK=CHUNK, PF=_prefetch_distance(), OH_CONST=modes["oh"][1], OC_CONST=modes["oc"][1],
        MODE_OC=modes["oc"][0], MODE_OH=modes["oh"][0],
        HAS_S0=True, STORE_ST=False, STORE_Z=False, STORE_CK=False, num_warps=nw, **cm)
    # the final state: the last segment's start state through the last segment
    ST = (SS[:, -1].unsqueeze(2) * PR[:, -1]).sum(1) + LOC[:, -1]
    return y, ST.view(B, H, K, V).transpose(-1, -2)


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if ``ir`` runs on this family's kernels, else the reason."""
    if ir.kind != "rank1":
        return f"not a rank-1 update ({ir.kind})"
    if ir.readout is not None:
        return "the readout is not of the form oc . (S oq) + oh"
    if "B" in ir.slots or "p" not in ir.slots:
        return "the input term does not factor as p q^T"
    d, m = ir.dims
    allowed = {"a": ((), (d,)), "c": ((), (d,)), "p": ((), (d,)), "oc": ((), (d,)), "oh": ((), (d,)),
               "u": ((), (m,)), "v": ((), (m,)), "q": ((), (m,)), "oq": ((), (m,))}
    for slot, dims_ok in allowed.items():
        co = ir.coefficient(slot)
        if co is None:
            if slot in ("oh",):
                continue
            if slot in ("a", "oc"):
                continue
            return f"slot {slot!r} is missing"
        if tuple(co.dims) not in dims_ok:
            return f"slot {slot!r} varies over {co.dims}; this kernel takes {' or '.join(map(str, dims_ok))}"
    return None


def _as_vec(x, B, T, H, m, ref):
    """[B|1, T|1, H|1, 1, m|1] tensor or number -> [B, T, H, m]."""
    if not isinstance(x, torch.Tensor):
        return torch.full((B, T, H, m), float(x), device=ref.device, dtype=ref.dtype)
    return x.expand(B, T, H, x.shape[3], m).reshape(B, T, H, m)


def _as_row(x, B, T, H, d, per_row):
    """[B|1, T|1, H|1, d|1, 1] tensor -> [B, T, H, d] (per row) or [B, T, H] (per head); numbers pass."""
    if not isinstance(x, torch.Tensor):
        return float(x)
    if per_row:
        return x.expand(B, T, H, d, x.shape[4]).reshape(B, T, H, d)
    return x.expand(B, T, H, 1, 1).reshape(B, T, H)


def forward(obj, lay, co, output_final_state):
    """Run the family's kernel on laid-out coefficients ``co`` (slot -> [B,T,H,r,c] or number).
    Returns (y [B, T, H, d] in lay.dtype, S_T [B, H, d, m] fp32 or None)."""
    ir = obj.ir
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    ref = next(v for v in co.values() if isinstance(v, torch.Tensor))
    prepared: dict = {}

    def prep(slot, fn):
        x = co.get(slot)
        for other, y in prepared.items():
            if co.get(other) is x and isinstance(x, torch.Tensor) and y[0] == fn:
                return y[1]
        out = fn(x)
        prepared[slot] = (fn, out)
        return out

    def vec(x):
        return _as_vec(x, B, T, H, m, ref).contiguous()

    row_fns = {}
    for slot in ROW_SLOTS:
        cf = ir.coefficient(slot)
        per_row = cf is not None and tuple(cf.dims) == (ir.dims[0],)
        row_fns[slot] = (lambda pr: (lambda x: _contig(_as_row(x, B, T, H, d, pr))))(per_row)
    u = prep("u", vec)
    v = prep("v", vec)
    q = prep("q", vec)
    oq = prep("oq", vec)
    vals = {}
    for slot in ROW_SLOTS:
        if slot not in co:
            vals[slot] = 1.0 if slot in ("a", "oc") else None
        else:
            vals[slot] = prep(slot, row_fns[slot])
    compute = torch.float32
    y, ST = _Rank1RowFunction.apply(u, v, q, oq, vals["a"], vals["c"], vals["p"], vals["oc"], vals["oh"],
                                    lay.S0, d, compute, output_final_state)
    return y.to(lay.dtype), ST


def prepare(obj, lay):
    """The family's runner for one call signature (``lay`` from ``reference.validate``): the key
    slots (``u, v, q, oq``) go to the kernel as the caller's tensors, in their own dtype (Longhorn's
    ``u = v = q = k`` is read once); the row coefficients that are expressions (Longhorn's
    ``c = beta / (1 + beta k.k)``, ``p = c x``) are computed from only the leaves they need, in fp32
    (``slots.computed_path``: one fused prologue kernel).
    Returns ``fn(inputs, params, initial_state, output_final_state)``."""
    from ssmcraft.ops.common.slots import slot_runner
    d, out_dtype = lay.d, io_dtype(lay.out_dtype)

    def run(cs, initial_state, output_final_state):
        u, v, q, oq = _dedup_contig(tuple(cs.get(s) for s in VEC_SLOTS))
        rows = [cs.get(s, 1.0 if s in ("a", "oc") else None) for s in ROW_SLOTS]
        a, c, p, oc, oh = _dedup_contig(rows)
        y, ST = _Rank1RowFunction.apply(u, v, q, oq, a, c, p, oc, oh, initial_state, d, out_dtype,
                                        output_final_state)
        return y.to(lay.out_dtype), ST
    return slot_runner(obj, lay, run)
