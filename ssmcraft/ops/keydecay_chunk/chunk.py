"""Chunked recurrences with a decay over the key dimension (GLA, RetNet, HGRN): Triton kernels on tensor cores.

The family (``scalar_decay`` / ``diagonal_decay`` IR whose decay varies over ``m`` at most)::

    S_t = S_{t-1} diag(a_t) + p_t q_t^T        S [d, m] = "V x K",  a_t > 0 of dims () or (m,)
    y_t = oc_t . (S_t oq_t) + oh_t

Kernels keep the transpose ``h = S^T`` ([K, V], FLA's layout) and take, per token,
``q = oq`` (readout key), ``k = q`` (insert key), ``v = p`` (inserted value) and
``g = log a`` (fp32, ``[B, T, H, K]``)::

    h_t = diag(e^{g_t}) h_{t-1} + k_t v_t^T,        o_t = h_t^T q_t

GLA: ``k = k, v = x, g = log alpha``; RetNet: ``g = log gamma`` broadcast over K; HGRN:
``k = f - 1, v = -x, g = log f``; linear attention: ``g = 0``. ``oc`` and ``oh`` are applied
to ``o`` in PyTorch, and the coefficients come from the generated reference module, so
autograd carries their gradients to the spec's inputs and params.

Chunked form (chunk of BT tokens, local index i, ``b_i = sum_{r<=i} g_r`` the within-chunk
cumulative sum, ``bl = b_{last}``, ``h0`` the state at the chunk's start)::

    o_i   = (q_i e^{b_i})^T h0 + sum_{j<=i} A_ij v_j,   A_ij = sum_k q_ik k_jk e^{b_ik - b_jk}
    h_end = diag(e^{bl}) h0 + (k e^{bl - b})^T V

Stability. ``g <= 0`` (a <= 1) makes ``b`` non-increasing, so every exponential below has a
non-positive exponent and never overflows (a factor that underflows is one whose true value is
below the float range). ``A`` is built from sub-blocks of BC = 16 rows: for row block I and an
earlier column block, with ``r_I`` = b at the first row of I,
``A[I, J] = (q_I e^{b_I - r_I}) (k_J e^{r_I - b_J})^T`` (both exponents <= 0), a tensor-core
product; the diagonal 16 x 16 blocks are summed elementwise with ``e^{b_i - b_j}``, j <= i
(exponent <= 0). Backward products against ``dA`` use the same references (``dq``) or
``s_J`` = b at the last row of J (``dk``). For a > 1 the same factors are the true growth
factors within one chunk (at most a^BT), finite whenever the recurrence itself is.
Precision: ``gc`` stores cumulative sums restarted in every 16-row sub-block, and every exponent
is formed as a sum of such block-local sums and block totals (the reference points are the
sub-block boundaries), never as a difference of two chunk-long sums: a chunk-long sum of strong
decays reaches |b| ~ 320 whose fp32 ulp (3e-5) would otherwise be the error of every factor.

Backward (per chunk, ``dO``, ``dH`` = gradient of ``h_end``; ``dA_ij = dO_i . v_j``, j <= i)::

    dv  = A^T dO + (k e^{bl-b}) dH
    dq  = e^b o (dO h0^T) + [sum_{j<=i} dA_ij k_j e^{b_i - b_j}]
    dk  = e^{bl-b} o (V dH^T) + [sum_{i>=j} dA_ij q_i e^{b_i - b_j}]
    dh0 = e^{bl} o dH + (q e^b)^T dO                      (the reverse recurrence over chunks)

Gradient of the decay (the reverse cumulative-sum identity). Every use of ``b_ik`` is a factor
``e^{+b_ik}`` next to ``q_ik`` or ``e^{-b_ik}`` next to ``k_ik``, except through ``bl``. So,
treating ``b`` and ``bl`` as independent,
``dL/db_ik = q_ik dq_ik - k_ik dk_ik`` (the diagonal term ``i = j`` of A cancels, as it should)
and ``dL/dbl_k = e^{bl_k} sum_v h0[k, v] dH[k, v] + sum_j k_jk e^{bl_k - b_jk} (v_j . dH[k, :])``.
Since ``b_i = sum_{r<=i} g_r`` and ``bl = sum_r g_r`` over the chunk's tokens,

    dg_r = sum_{i >= r} (q_i dq_i - k_i dk_i) + dL/dbl          (reverse cumsum within the chunk)

Kernels, top to bottom. Forward: ``keydecay_chunk_fwd_state_kernel`` (sequential over chunks per (key block,
value block, head): the block-local cumulative sums ``gc``, the chunk-start states
``hs [B, H, NT, K, V]`` and the final state), ``keydecay_chunk_intra_a_kernel`` (per (chunk, sub-block): the
rows of A, stored ``[B, T, H, BT]`` in the I/O dtype) and ``keydecay_chunk_apply_kernel`` (per (value
block, chunk): o). Backward: ``keydecay_chunk_bwd_state_kernel`` (reverse over chunks: ``dhs``, the state
gradient at each chunk's end, and dh0), ``keydecay_chunk_apply_kernel`` again (dv, the transposed products),
``keydecay_chunk_bwd_inter_kernel`` (per chunk, over value blocks: dA, the state terms of dq and dk, dL/dbl) and
``keydecay_chunk_bwd_intra_kernel`` (per (key block, chunk x sub-block): the intra-chunk terms of dq and dk on
[BC, BK] tiles, and dg's reverse cumulative sum within the sub-block) and ``keydecay_chunk_bwd_dg_kernel`` (per
(key block, chunk): adds the later sub-blocks' totals and dL/dbl to dg); with the decay itself as input
(``log_space=False``), ``keydecay_chunk_bwd_da_kernel`` then rewrites dL/da term by term in the chunks
holding a decay below e^-3. Saved for the backward: the inputs, g, ``gc`` (the size of g), ``hs`` and A
``[B, T, H, BT]``; no ``[B, T, d, m]`` tensor is formed.

Shapes (kernel level, FLA layout): q, k, g [B, T, H, K]; v [B, T, H, V]; initial / final state
[B, H, K, V] fp32; output [B, T, H, V] in v's dtype. I/O fp32, bf16 or fp16; state, cumulative
sums and every reduction fp32. Measured figures: BENCHMARKS.md, "Key-decay chunked".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmcraft.ops.common.chunked import key_size_reason, key_sizes
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.tiles import log_decay, state_block, state_or_zero, value_block
from ssmcraft.ops.common.rows import packed_args, packed_chunks, row_ids, seq_chunk, seq_state, sequences, state_program
from ssmcraft.ops.common.tuning import INTERPRET, IO_DTYPES, buffer, cdiv, dot_precision, io_dtype, pow2, tune, warp_rule
from ssmcraft.ops.keydecay_chunk.decay_grad import key_block_chunk, keydecay_chunk_bwd_da_kernel

INTERPRET_BV: int | None = None     # value block under the interpreter (tests set it small)
INTERPRET_BK: int | None = None     # key block of the sequential kernels under the interpreter
POISON = False                      # tests: fill every output buffer with NaN before the kernels write it
CHUNK = 64                          # chunk size used by the family entry points (tests set 16 / 32)
SUB = 16                            # sub-block of the intra-chunk matrix (BC)
MAX_K = 256                         # whole key rows live in registers in the parallel kernels
BACKEND_NAME = "keydecay-chunked"


PAR_CONFIGS = [triton.Config({"BV": bv}, num_warps=w, num_stages=2) for bv in (64, 32) for w in (4, 8)]
INTRA_CONFIGS = [triton.Config({"BK": bk}, num_warps=w, num_stages=2) for bk in (16, 32, 64) for w in (1, 2, 4)]
A_CONFIGS = [triton.Config({}, num_warps=w, num_stages=2) for w in (1, 2, 4)]


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------

@tune([triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
        for bk, bv, w, s in ((64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 2, 2))],
       key=["H", "K", "V", "BT", "BC", "HAS_H0"])
@triton.jit(do_not_specialize=["T", "NT"])
def keydecay_chunk_fwd_state_kernel(k, v, g, h0, gc, hs, ht, cu, co, T, NT,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, PREC: tl.constexpr,
                      LOG_G: tl.constexpr, VARLEN: tl.constexpr):
    """Sequential over chunks, one program per (key block x value block, batch * head):
    gc = cumulative sums of g within each BC-row sub-block (key rows are independent, so
    blocks over K are too), hs[chunk] = state at the chunk's start, ht = final state.
    LOG_G: the tensor holds the decay a itself and g = log a is taken here."""
    i_k, i_v, i_bh, i_b, i_h = state_program(H, V, BV)
    DT = hs.dtype.element_ty
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(i_k, i_v, K, V, BK, BV)
    b_h = state_or_zero(h0, i_bh, p_kv, m_kv, K, V, HAS_H0, BK, BV)
    bos, T, n_t, cb = seq_state(cu, co, i_b, i_h, T, NT, H, BT, VARLEN)
    for i_t in range(n_t):
        o_i = tl.arange(0, BT)
        m_t = i_t * BT + o_i < T
        row = row_ids(bos, i_h, i_t * BT + o_i, T, H)
        m_tk = m_t[:, None] & m_k[None, :]
        tl.store(hs + (cb + i_t) * K * V + p_kv, b_h.to(DT), mask=m_kv)
        b_g = _log_decay(g + row[:, None] * K + o_k[None, :], m_tk, LOG_G)
        if i_v == 0:      # block-local cumulative sums (rows past T: g = 0)
            b_lc = tl.reshape(tl.cumsum(tl.reshape(b_g, (BT // BC, BC, BK)), axis=1), (BT, BK))
            tl.store(gc + row[:, None] * K + o_k[None, :], b_lc, mask=m_tk)
        b_bl = tl.sum(b_g, axis=0)                                   # bl
        b_sx = tl.cumsum(b_g, axis=0, reverse=True) - b_g            # bl - b_j, summed directly
        b_kk = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_kd = (b_kk * tl.exp(b_sx)).to(DT)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.).to(DT)
        b_h = b_h * tl.exp(b_bl)[:, None] + tl.dot(tl.trans(b_kd), b_v, input_precision=PREC)
    tl.store(ht + i_bh.to(tl.int64) * K * V + p_kv, b_h, mask=m_kv)


@triton.jit
def _log_decay(ptr, mask, LOG_G: tl.constexpr):
    """The log-decay tile at ``ptr`` in fp32 (0 where masked); LOG_G: the memory holds a, take log."""
    if LOG_G:
        return log_decay(tl.load(ptr, mask=mask, other=1.).to(tl.float32))
    return tl.load(ptr, mask=mask, other=0.).to(tl.float32)


@triton.jit
def _refrow_ids(gc, bos, i_h, t0, T, H, K: tl.constexpr, o_i, o_k, m_k, BC: tl.constexpr, OFF: tl.constexpr):
    """[BT, BK] tile of gc at row (i // BC) * BC + OFF of each row i's sub-block (clamped)."""
    r = row_ids(bos, i_h, t0 + (o_i // BC) * BC + OFF, T, H)
    return tl.load(gc + r[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)


@triton.jit
def _ref_vec(gc, bos, i_h, t, T, H, K: tl.constexpr, o_k, m_k):
    """[BK] row of gc at time t (clamped)."""
    return tl.load(gc + row_ids(bos, i_h, t, T, H) * K + o_k, mask=m_k, other=0.)


@triton.jit
def _tot(gc, bos, i_h, t0, M: tl.constexpr, T, H, K: tl.constexpr, o_k, m_k, BC: tl.constexpr):
    """[BK] sum of g over sub-block M of the chunk starting at t0 (0 if the block starts past T)."""
    s = _ref_vec(gc, bos, i_h, t0 + M * BC + BC - 1, T, H, K, o_k, m_k)
    return tl.where(t0 + M * BC < T, s, 0.)


@triton.jit
def _chunk_sums(gc, b_lc, bos, i_h, t0, T, H, K: tl.constexpr, o_i, o_k, m_k,
                BT: tl.constexpr, BC: tl.constexpr):
    """From the block-local sums lc (each a direct sum, never a difference of large ones):
    b = the chunk's prefix sums b_i, sx = bl - b_j, and bl."""
    b_own = _refrow_ids(gc, bos, i_h, t0, T, H, K, o_i, o_k, m_k, BC, BC - 1)
    blk = (o_i // BC)[:, None]
    b_pre = tl.zeros_like(b_lc)
    b_post = tl.zeros_like(b_lc)
    b_bl = tl.zeros_like(_ref_vec(gc, bos, i_h, t0, T, H, K, o_k, m_k))
    for M in tl.static_range(BT // BC):
        b_t = _tot(gc, bos, i_h, t0, M, T, H, K, o_k, m_k, BC)[None, :]
        b_pre += tl.where(blk > M, b_t, 0.)
        b_post += tl.where(blk < M, b_t, 0.)
        b_bl += tl.sum(b_t, axis=0)
    return b_pre + b_lc, b_post + (b_own - b_lc), b_bl


@triton.jit
def _subrow_ids(p, bos, i_h, t, T, H, K: tl.constexpr, o_k, m_k):
    """[BC, BK] fp32 tile of a [B, T, H, K] tensor at the times t (rows past T: 0)."""
    r = row_ids(bos, i_h, t, T, H)
    return tl.load(p + r[:, None] * K + o_k[None, :], mask=(t < T)[:, None] & m_k[None, :], other=0.).to(tl.float32)


@triton.jit
def _causal(A, row, m_t, o_i, BT: tl.constexpr, DT: tl.constexpr):
    """The chunk's [BT, BT] block of A (rows ``row``), lower triangle incl. the diagonal, in DT."""
    mask = m_t[:, None] & (o_i[:, None] >= o_i[None, :])
    return tl.load(A + row[:, None] * BT + o_i[None, :], mask=mask, other=0.).to(DT)


@triton.jit
def _key_to_ref(k, gc, bos, i_h, t0, J, b_s, T, H, K: tl.constexpr, o_c, o_k, m_k, BC: tl.constexpr):
    """Sub-block J of k scaled to a later reference R (the b just before the sub-block being
    built): k_j e^{R - b_j} = k_j e^{(tot_J - lc_j) + s}, with ``b_s`` the sum of g over the whole
    sub-blocks between J and R (every exponent <= 0 for g <= 0). Returns that [BC, BK] fp32 tile and
    tot_J, the [BK] sum of g over J (added to ``b_s`` before the next J down)."""
    t_J = t0 + J * BC + o_c
    b_kJ = _subrow_ids(k, bos, i_h, t_J, T, H, K, o_k, m_k)
    b_lJ = tl.load(gc + row_ids(bos, i_h, t_J, T, H)[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
    b_oJ = _ref_vec(gc, bos, i_h, t0 + J * BC + BC - 1, T, H, K, o_k, m_k)
    return b_kJ * tl.exp(b_oJ[None, :] - b_lJ + b_s[None, :]), b_oJ


@tune(A_CONFIGS, key=["H", "K", "BT", "BC"], prune=warp_rule)
@triton.jit(do_not_specialize=["T"])
def keydecay_chunk_intra_a_kernel(q, k, gc, A, cu, ci, T, NT, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Per (chunk, sub-block I): the rows of I in A[i, j] = sum_k q_ik k_jk e^{b_ik - b_jk}, j <= i.
    Columns of earlier blocks J are tensor-core products (q e^{b - R_I}) (k_J e^{R_I - b_J})^T with
    R_I = b just before block I (both exponents <= 0); the diagonal block is summed elementwise.
    Entries above the diagonal are not written (readers mask them)."""
    NC: tl.constexpr = BT // BC
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    I = i_c % NC
    bos, T, i_t, _ = seq_chunk(cu, ci, i_c // NC, i_b, i_h, T, NT, H, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.seq_chunk)
        return
    t0 = i_t * BT
    DT = A.dtype.element_ty
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    t_I = t0 + I * BC + o_c
    m_I = t_I < T
    r_I = row_ids(bos, i_h, t_I, T, H)
    b_q = _subrow_ids(q, bos, i_h, t_I, T, H, K, o_k, m_k)
    b_lc = tl.load(gc + r_I[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
    b_qs = (b_q * tl.exp(b_lc)).to(DT)                    # q e^{b_i - R_I}
    b_s = tl.zeros([BK], dtype=tl.float32)                # sum of g over the whole blocks after J, before I
    for jj in range(I):
        J = I - 1 - jj
        b_kt, b_oJ = _key_to_ref(k, gc, bos, i_h, t0, J, b_s, T, H, K, o_c, o_k, m_k, BC)    # k_j e^{R_I - b_j}
        b_kt = b_kt.to(DT)
        b_a = tl.dot(b_qs, tl.trans(b_kt), input_precision=PREC)
        tl.store(A + r_I[:, None] * BT + J * BC + o_c[None, :], b_a.to(DT), mask=m_I[:, None])
        b_s += b_oJ
    b_d = tl.zeros([BC, BC], dtype=tl.float32)
    for c in range(BC):          # diagonal block: e^{b_i - b_c} = e^{lc_i - lc_c}, c <= i
        t_c = t0 + I * BC + c
        r_c = row_ids(bos, i_h, t_c, T, H)
        b_kc = tl.load(k + r_c * K + o_k, mask=m_k & (t_c < T), other=0.).to(tl.float32)
        b_lcc = tl.load(gc + r_c * K + o_k, mask=m_k, other=0.)
        low = (o_c >= c)[:, None]
        b_e = tl.exp(tl.where(low, b_lc - b_lcc[None, :], 0.))
        b_ac = tl.sum(tl.where(low, b_q * b_kc[None, :] * b_e, 0.), axis=1)
        b_d = tl.where(o_c[None, :] == c, b_ac[:, None], b_d)
    tl.store(A + r_I[:, None] * BT + I * BC + o_c[None, :], b_d.to(DT), mask=m_I[:, None])


@tune(PAR_CONFIGS, key=["H", "K", "V", "BT", "BC", "BWD"], prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def keydecay_chunk_apply_kernel(key, x, gc, st, A, out, cu, ci, T, NT,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, BWD: tl.constexpr, PREC: tl.constexpr,
                        VARLEN: tl.constexpr):
    """Per (value block, chunk), the two products of a chunk's rows with its state and A:
    forward (BWD=False): o  = (q e^b) h0 + A v            key = q, x = v,  st = hs;
    backward (BWD=True): dv = (k e^{bl - b}) dH + A^T dO   key = k, x = dO, st = dhs."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, T, i_t, cb = seq_chunk(cu, ci, tl.program_id(1), i_b, i_h, T, NT, H, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.seq_chunk)
        return
    DT = x.dtype.element_ty
    o_i = tl.arange(0, BT)
    t0 = i_t * BT
    m_t = (t0 + o_i) < T
    row = row_ids(bos, i_h, t0 + o_i, T, H)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    b_key = _subrow_ids(key, bos, i_h, t0 + o_i, T, H, K, o_k, m_k)
    b_lc = tl.load(gc + row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
    b_b, b_sx, b_bl = _chunk_sums(gc, b_lc, bos, i_h, t0, T, H, K, o_i, o_k, m_k, BT, BC)
    b_A = _causal(A, row, m_t, o_i, BT, DT)
    if BWD:
        b_key = (b_key * tl.exp(b_sx)).to(DT)
        b_A = tl.trans(b_A)
    else:
        b_key = (b_key * tl.exp(b_b)).to(DT)
    b_st = tl.load(st + (cb + i_t) * K * V + o_k[:, None] * V + o_v[None, :],
                   mask=m_k[:, None] & m_v[None, :], other=0.)
    b_x = tl.load(x + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(DT)
    b_o = tl.dot(b_key, b_st.to(DT), input_precision=PREC)
    b_o += tl.dot(b_A, b_x, input_precision=PREC)
    tl.store(out + row[:, None] * V + o_v[None, :], b_o.to(out.dtype.element_ty), mask=m_tv)


@tune([triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
        for bk, bv, w, s in ((64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 2, 2))],
       key=["H", "K", "V", "BT", "HAS_DHT"])
@triton.jit(do_not_specialize=["T", "NT"])
def keydecay_chunk_bwd_state_kernel(q, g, do, dht, dhs, dh0, cu, co, T, NT,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, PREC: tl.constexpr,
                      LOG_G: tl.constexpr, VARLEN: tl.constexpr):
    """Reverse over chunks: dhs[chunk] = gradient of the state at the chunk's end;
    dH <- e^{bl} o dH + (q e^b)^T dO; dh0 = the gradient of the initial state."""
    i_k, i_v, i_bh, i_b, i_h = state_program(H, V, BV)
    DT = dhs.dtype.element_ty
    o_i = tl.arange(0, BT)
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(i_k, i_v, K, V, BK, BV)
    b_dh = state_or_zero(dht, i_bh, p_kv, m_kv, K, V, HAS_DHT, BK, BV)
    bos, T, n_t, cb = seq_state(cu, co, i_b, i_h, T, NT, H, BT, VARLEN)
    for j in range(n_t):
        i_t = n_t - 1 - j
        t0 = i_t * BT
        o_t = t0 + o_i
        m_t = o_t < T
        row = row_ids(bos, i_h, o_t, T, H)
        tl.store(dhs + (cb + i_t) * K * V + p_kv, b_dh.to(DT), mask=m_kv)
        b_g = _log_decay(g + row[:, None] * K + o_k[None, :], m_t[:, None] & m_k[None, :], LOG_G)
        b_b = tl.cumsum(b_g, axis=0)
        b_bl = tl.sum(b_g, axis=0)
        b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.).to(tl.float32)
        b_qe = (b_q * tl.exp(b_b)).to(DT)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.).to(DT)
        b_dh = b_dh * tl.exp(b_bl)[:, None] + tl.dot(tl.trans(b_qe), b_do, input_precision=PREC)
    tl.store(dh0 + i_bh.to(tl.int64) * K * V + p_kv, b_dh, mask=m_kv)


@tune(PAR_CONFIGS, key=["H", "K", "V", "BT", "BC"], prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT", "V_run"])
def keydecay_chunk_bwd_inter_kernel(q, k, v, gc, hs, dhs, do, dA, dqi, dki, dbl, cu, ci, T, NT, V_run,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Per chunk, summing over value blocks: dA = dO V^T (lower triangle), the state terms
    dq = e^b o (dO h0^T), dk = e^{bl - b} o (V dH^T) (fp32 scratch, finished by the intra kernel)
    and dL/dbl = sum_j k_j o dk_j + e^{bl} o sum_v h0 dH.

    ``V_run`` (= V) is a runtime argument on purpose, the loop's bound: with a compile-time trip count (>= 2)
    Triton 3.6 miscompiles this software-pipelined loop (num_stages=2) on Hopper (sm_90) with bf16
    I/O, and dA = dO V^T comes out wrong (at V = 256, K = 16, 32; every config); with the trip count
    known only at run time, or num_stages=1, it is exact (BENCHMARKS.md, "Key-decay chunked")."""
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, T, i_t, cb = seq_chunk(cu, ci, tl.program_id(0), i_b, i_h, T, NT, H, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.seq_chunk)
        return
    DT = do.dtype.element_ty
    o_i = tl.arange(0, BT)
    t0 = i_t * BT
    m_t = (t0 + o_i) < T
    row = row_ids(bos, i_h, t0 + o_i, T, H)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    base = (cb + i_t) * K * V
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dqh = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkh = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V_run, BV)):
        o_v, m_v, m_tv, m_kv = value_block(i_v, V, m_t, m_k, BV)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(DT)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(DT)
        b_h = tl.load(hs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dh = tl.load(dhs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dA += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_dqh += tl.dot(b_do, tl.trans(b_h.to(DT)), input_precision=PREC)
        b_dkh += tl.dot(b_v, tl.trans(b_dh.to(DT)), input_precision=PREC)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    b_dA = tl.where(o_i[:, None] >= o_i[None, :], b_dA, 0.)
    tl.store(dA + row[:, None] * BT + o_i[None, :], b_dA, mask=m_t[:, None])
    b_lc = tl.load(gc + row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
    b_b, b_sx, b_bl = _chunk_sums(gc, b_lc, bos, i_h, t0, T, H, K, o_i, o_k, m_k, BT, BC)
    b_dk = b_dkh * tl.exp(b_sx)
    tl.store(dqi + row[:, None] * K + o_k[None, :], b_dqh * tl.exp(b_b), mask=m_tk)
    tl.store(dki + row[:, None] * K + o_k[None, :], b_dk, mask=m_tk)
    b_k = _subrow_ids(k, bos, i_h, t0 + o_i, T, H, K, o_k, m_k)
    b_dbl = tl.sum(b_k * b_dk, axis=0) + tl.exp(b_bl) * b_hdh
    tl.store(dbl + (cb + i_t) * K + o_k, b_dbl, mask=m_k)


@tune(INTRA_CONFIGS, key=["H", "K", "BT", "BC"], prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def keydecay_chunk_bwd_intra_kernel(q, k, gc, dA, dqi, dki, dq, dk, dgl, dbt, cu, ci, T, NT,
                      H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Per (key block, chunk x sub-block I): dq, dk of the rows of I = the inter terms plus
    dq_i += sum_{j<=i} dA_ij k_j e^{b_i - b_j},  dk_j += sum_{i>=j} dA_ij q_i e^{b_i - b_j}
    (earlier / later blocks as tensor-core products against references at the block boundaries,
    the diagonal block elementwise). Then db = q o dq - k o dk: ``dgl`` gets its reverse cumulative
    sum within I and ``dbt`` its total over I (``keydecay_chunk_bwd_dg_kernel`` adds the later blocks' totals).
    Key columns are independent."""
    NC: tl.constexpr = BT // BC
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, T, i_t, cb = seq_chunk(cu, ci, i_c // NC, i_b, i_h, T, NT, H, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.seq_chunk)
        return
    I = i_c % NC
    DT = q.dtype.element_ty
    t0 = i_t * BT
    o_c = tl.arange(0, BC)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    t_I = t0 + I * BC + o_c
    m_I = t_I < T
    r_I = row_ids(bos, i_h, t_I, T, H)
    m_Ik = m_I[:, None] & m_k[None, :]
    p_I = r_I[:, None] * K + o_k[None, :]
    b_q = _subrow_ids(q, bos, i_h, t_I, T, H, K, o_k, m_k)
    b_k = _subrow_ids(k, bos, i_h, t_I, T, H, K, o_k, m_k)
    b_lc = tl.load(gc + p_I, mask=m_k[None, :], other=0.)
    b_own = _ref_vec(gc, bos, i_h, t0 + I * BC + BC - 1, T, H, K, o_k, m_k)
    # dq from the blocks J < I: dA[I, J] (k_J e^{R_I - b_J}), then e^{b_i - R_I}
    b_dqo = tl.zeros([BC, BK], dtype=tl.float32)
    b_s = tl.zeros([BK], dtype=tl.float32)
    for jj in range(I):
        b_kt, b_oJ = _key_to_ref(k, gc, bos, i_h, t0, I - 1 - jj, b_s, T, H, K, o_c, o_k, m_k, BC)
        b_kt = b_kt.to(DT)
        b_da = tl.load(dA + r_I[:, None] * BT + (I - 1 - jj) * BC + o_c[None, :], mask=m_I[:, None], other=0.).to(DT)
        b_dqo += tl.dot(b_da, b_kt, input_precision=PREC)
        b_s += b_oJ
    # dk from the blocks J > I: dA[J, I]^T (q_J e^{b_J - R_{I+1}}), then e^{R_{I+1} - b_j}
    b_dko = tl.zeros([BC, BK], dtype=tl.float32)
    b_s = tl.zeros([BK], dtype=tl.float32)
    for J in range(I + 1, NC):
        t_J = t0 + J * BC + o_c
        r_J = row_ids(bos, i_h, t_J, T, H)
        b_qJ = _subrow_ids(q, bos, i_h, t_J, T, H, K, o_k, m_k)
        b_lJ = tl.load(gc + r_J[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
        b_qt = (b_qJ * tl.exp(b_lJ + b_s[None, :])).to(DT)
        b_da = tl.load(dA + r_J[:, None] * BT + I * BC + o_c[None, :], mask=(t_J < T)[:, None], other=0.).to(DT)
        b_dko += tl.dot(tl.trans(b_da), b_qt, input_precision=PREC)
        b_s += _ref_vec(gc, bos, i_h, t0 + J * BC + BC - 1, T, H, K, o_k, m_k)
    b_dq = tl.load(dqi + p_I, mask=m_Ik, other=0.) + tl.exp(b_lc) * b_dqo
    b_dk = tl.load(dki + p_I, mask=m_Ik, other=0.) + tl.exp(b_own[None, :] - b_lc) * b_dko
    # diagonal block: partner row c; one exponential serves dq (c <= i) and dk (c >= i)
    for c in range(BC):
        t_c = t0 + I * BC + c
        r_c = row_ids(bos, i_h, t_c, T, H)
        m_c = m_k & (t_c < T)
        b_qc = tl.load(q + r_c * K + o_k, mask=m_c, other=0.).to(tl.float32)
        b_kc = tl.load(k + r_c * K + o_k, mask=m_c, other=0.).to(tl.float32)
        b_lcc = tl.load(gc + r_c * K + o_k, mask=m_k, other=0.)
        b_dac = tl.load(dA + r_I * BT + I * BC + c, mask=m_I, other=0.)               # dA[i, c]
        b_dar = tl.load(dA + r_c * BT + I * BC + o_c, mask=m_I & (t_c < T), other=0.)  # dA[c, i]
        low = (o_c >= c)[:, None]
        up = (o_c <= c)[:, None]
        b_x = b_lc - b_lcc[None, :]
        b_e = tl.exp(tl.where(low, b_x, tl.where(up, -b_x, 0.)))
        b_dq += tl.where(low, b_dac[:, None] * b_kc[None, :] * b_e, 0.)
        b_dk += tl.where(up, b_dar[:, None] * b_qc[None, :] * b_e, 0.)
    b_db = b_q * b_dq - b_k * b_dk
    tl.store(dq + p_I, b_dq.to(dq.dtype.element_ty), mask=m_Ik)
    tl.store(dk + p_I, b_dk.to(dk.dtype.element_ty), mask=m_Ik)
    tl.store(dgl + p_I, tl.cumsum(b_db, axis=0, reverse=True), mask=m_Ik)
    tl.store(dbt + ((cb + i_t) * NC + I) * K + o_k, tl.sum(b_db, axis=0), mask=m_k)


@tune(INTRA_CONFIGS, key=["H", "K", "BT", "BC"], prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT"])
def keydecay_chunk_bwd_dg_kernel(dgl, dbt, dbl, dg, g, cu, ci, T, NT, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr, BK: tl.constexpr, LOG_G: tl.constexpr, VARLEN: tl.constexpr):
    """Per (key block, chunk): dg_r = dgl_r (the sum within r's sub-block) + the totals of db over the
    later sub-blocks + dL/dbl, that is dg_r = sum_{i >= r} (q_i dq_i - k_i dk_i) + dL/dbl within the
    chunk. (A separate output, not dg += ...: the autotuner launches a kernel many times.)
    LOG_G: g holds the decay a, and the gradient stored is dL/da = dg / a (``keydecay_chunk_bwd_da_kernel``
    then rewrites the chunks where that has lost its digits)."""
    NC: tl.constexpr = BT // BC
    i_t, cb, o_i, m_t, row, o_k, m_k, p, m = key_block_chunk(cu, ci, T, NT, H, K, BT, BK, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.seq_chunk)
        return
    base = (cb + i_t) * K
    b_off = tl.zeros([BT, BK], dtype=tl.float32) + tl.load(dbl + base + o_k, mask=m_k, other=0.)[None, :]
    blk = (o_i // BC)[:, None]
    for M in tl.static_range(1, NC):
        b_t = tl.load(dbt + (base * NC + M * K) + o_k, mask=m_k, other=0.)
        b_off += tl.where(blk < M, b_t[None, :], 0.)
    b_dg = tl.load(dgl + p, mask=m, other=0.) + b_off
    if LOG_G:
        b_dg = b_dg / tl.load(g + p, mask=m, other=1.).to(tl.float32)
    tl.store(dg + p, b_dg, mask=m)


# ----------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------

def _state_opts(K: int, V: int) -> dict:
    """Blocks of the sequential kernels, chosen by rule under the interpreter (autotuned on a GPU)."""
    if not INTERPRET:
        return {}
    return {"BK": INTERPRET_BK or pow2(K), "BV": INTERPRET_BV or pow2(V)}


def _par_opts(V: int) -> dict:
    """Value block of the parallel kernels, by rule under the interpreter."""
    if not INTERPRET:
        return {}
    return {"BV": INTERPRET_BV or pow2(V)}


def _intra_opts(K: int) -> dict:
    """Key block of the backward's per-key-block kernels, by rule under the interpreter (at most the
    padded K)."""
    if not INTERPRET:
        return {}
    return {"BK": min(INTERPRET_BK or pow2(K), pow2(K))}


def _par_grid(V, NT, BH):
    return lambda meta: (cdiv(V, meta["BV"]), NT, BH)


def _state_grid(K, V, BH):
    return lambda meta: (cdiv(K, meta["BK"]) * cdiv(V, meta["BV"]), BH)


def _empty(*shape, device, dtype):
    return buffer(shape, device, dtype, POISON)


def _fwd(q, k, v, g, h0, BT, log_g=False, packed=None):
    """o [B,T,H,V] (v's dtype), ht [N,H,K,V] fp32, gc [B,T,H,K] fp32, hs [B,H,NT,K,V],
    A [B,T,H,BT] (the intra-chunk matrix, lower triangle written; kept for the backward). ``packed``:
    the ``Chunks`` of a packed row (B = 1, N sequences), else None (N = B)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt, dev = v.dtype, v.device
    N, NT, seq = sequences(B, T, BT, packed, k)
    prec = dot_precision(dt)
    gc = _empty(B, T, H, K, device=dev, dtype=torch.float32)
    hs = _empty(B, H, NT, K, V, device=dev, dtype=dt)
    ht = _empty(N, H, K, V, device=dev, dtype=torch.float32)
    launch(keydecay_chunk_fwd_state_kernel, _state_grid(K, V, N * H),
           k=k, v=v, g=g, h0=h0 if h0 is not None else ht, gc=gc, hs=hs, ht=ht, T=T, NT=NT, H=H, K=K, V=V, BT=BT,
           BC=min(SUB, BT), HAS_H0=h0 is not None, PREC=prec, LOG_G=log_g, **packed_args(seq, "cu", "co"),
           **_state_opts(K, V))
    BC, BK = min(SUB, BT), pow2(K)
    A = _empty(B, T, H, BT, device=dev, dtype=dt)
    launch(keydecay_chunk_intra_a_kernel, (NT * (BT // BC), B * H),
           q=q, k=k, gc=gc, A=A, T=T, NT=NT, H=H, K=K, BT=BT, BC=BC, BK=BK, PREC=prec, **packed_args(seq, "cu", "ci"))
    o = _empty(B, T, H, V, device=dev, dtype=dt)
    launch(keydecay_chunk_apply_kernel, _par_grid(V, NT, B * H),
           key=q, x=v, gc=gc, st=hs, A=A, out=o, T=T, NT=NT, H=H, K=K, V=V, BT=BT, BC=BC, BK=BK, BWD=False, PREC=prec,
           **packed_args(seq, "cu", "ci"), **_par_opts(V))
    return o, ht, gc, hs, A


def _bwd(q, k, v, g, gc, hs, A, do, dht, BT, log_g=False, packed=None):
    """(dq, dk, dv in the I/O dtype; dg fp32 [B,T,H,K]; dh0 fp32 [N,H,K,V]); ``packed`` as ``_fwd``."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt, dev = v.dtype, v.device
    N, NT, seq = sequences(B, T, BT, packed, k)
    prec = dot_precision(dt)
    do = do.to(dt).contiguous()
    has_dht = dht is not None
    dht = dht.float().contiguous() if has_dht else hs
    dhs = _empty(B, H, NT, K, V, device=dev, dtype=dt)
    dh0 = _empty(N, H, K, V, device=dev, dtype=torch.float32)
    launch(keydecay_chunk_bwd_state_kernel, _state_grid(K, V, N * H),
           q=q, g=g, do=do, dht=dht, dhs=dhs, dh0=dh0, T=T, NT=NT, H=H, K=K, V=V, BT=BT, HAS_DHT=has_dht, PREC=prec,
           LOG_G=log_g, **packed_args(seq, "cu", "co"), **_state_opts(K, V))
    BC, BK = min(SUB, BT), pow2(K)
    dv = _empty(B, T, H, V, device=dev, dtype=dt)
    launch(keydecay_chunk_apply_kernel, _par_grid(V, NT, B * H),
           key=k, x=do, gc=gc, st=dhs, A=A, out=dv, T=T, NT=NT, H=H, K=K, V=V, BT=BT, BC=BC, BK=BK, BWD=True,
           PREC=prec, **packed_args(seq, "cu", "ci"), **_par_opts(V))
    dA = _empty(B, T, H, BT, device=dev, dtype=torch.float32)
    dqi = _empty(B, T, H, K, device=dev, dtype=torch.float32)
    dki = _empty(B, T, H, K, device=dev, dtype=torch.float32)
    dbl = _empty(B, H, NT, K, device=dev, dtype=torch.float32)
    launch(keydecay_chunk_bwd_inter_kernel, (NT, B * H),
           q=q, k=k, v=v, gc=gc, hs=hs, dhs=dhs, do=do, dA=dA, dqi=dqi, dki=dki, dbl=dbl, T=T, NT=NT, V_run=V, H=H,
           K=K, V=V, BT=BT, BC=BC, BK=BK, PREC=prec, **packed_args(seq, "cu", "ci"), **_par_opts(V))
    dq = _empty(B, T, H, K, device=dev, dtype=dt)
    dk = _empty(B, T, H, K, device=dev, dtype=dt)
    dgl = _empty(B, T, H, K, device=dev, dtype=torch.float32)      # dg within each sub-block
    dbt = _empty(B, H, NT * (BT // BC), K, device=dev, dtype=torch.float32)
    grid = lambda meta: (cdiv(K, meta["BK"]), NT * (BT // BC), B * H)  # noqa: E731
    launch(keydecay_chunk_bwd_intra_kernel, grid,
           q=q, k=k, gc=gc, dA=dA, dqi=dqi, dki=dki, dq=dq, dk=dk, dgl=dgl, dbt=dbt, T=T, NT=NT, H=H, K=K, BT=BT,
           BC=BC, PREC=prec, **packed_args(seq, "cu", "ci"), **_intra_opts(K))
    dg = _empty(B, T, H, K, device=dev, dtype=torch.float32)
    grid = lambda meta: (cdiv(K, meta["BK"]), NT, B * H)  # noqa: E731
    launch(keydecay_chunk_bwd_dg_kernel, grid,
           dgl=dgl, dbt=dbt, dbl=dbl, dg=dg, g=g, T=T, NT=NT, H=H, K=K, BT=BT, BC=BC, LOG_G=log_g,
           **packed_args(seq, "cu", "ci"), **_intra_opts(K))
    if log_g:   # the decay itself: dL/da rewritten where dg / a has lost its digits
        launch(keydecay_chunk_bwd_da_kernel, grid,
               da=dg, a=g, q=q, k=k, v=v, do=do, dA=dA, hs=hs, dhs=dhs, T=T, NT=NT, V_run=V, H=H, K=K, V=V, BT=BT,
               BV=min(pow2(V), 64), PREC=prec, **packed_args(seq, "cu", "ci"), **_intra_opts(K))
    return dq, dk, dv, dg, dh0


# ----------------------------------------------------------------------------------------
# autograd Function
# ----------------------------------------------------------------------------------------

class KeyDecayChunkFunction(torch.autograd.Function):
    """(q, k, v, g, h0|None) -> (o, ht|None), FLA layout; gradients for all five (and via dht)."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, output_final_state, chunk_size, log_g=False, packed=None):
        o, ht, gc, hs, A = _fwd(q, k, v, g, h0, chunk_size, log_g, packed)
        if any(ctx.needs_input_grad[:5]):
            ctx.save_for_backward(q, k, v, g, gc, hs, A)
        ctx.chunk_size, ctx.log_g, ctx.packed = chunk_size, log_g, packed
        ctx.has_h0 = h0 is not None
        return o, (ht if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, gc, hs, A = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, dg, dh0 = _bwd(q, k, v, g, gc, hs, A, do, dht, ctx.chunk_size, ctx.log_g, ctx.packed)
        return dq, dk, dv, dg.to(g.dtype), (dh0 if ctx.has_h0 else None), None, None, None, None


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------


def chunk_key_decay(q, k, v, g, *, initial_state=None, output_final_state: bool = False,
                    chunk_size: int = 64, log_space: bool = True, cu_seqlens=None):
    """h_t = diag(exp(g_t)) h_{t-1} + k_t v_t^T;  o_t = h_t^T q_t  (FLA's chunk_gla with scale 1).

    Args:
        q: readout key [B, T, H, K].
        k: insert key [B, T, H, K].
        v: inserted value [B, T, H, V]; its dtype (fp32, bf16 or fp16) is the I/O dtype.
        g: log decay [B, T, H, K] (any float dtype; used in fp32). g <= 0 is the stable regime.
            With ``log_space=False`` it is the decay a >= 0 itself: the kernels take its log as they
            load it (floored at -80, ``common.tiles.log_decay``) and return dL/da (no log-space copy is
            made), term by term in a chunk holding a decay below e^-3 (``_exact_decay_grad``): exact at
            tiny decays and at a = 0. ``forward`` (the objectives' path) passes the decay this way.
        initial_state: [B, H, K, V] (kept fp32) or None.
        output_final_state: also return the state [B, H, K, V] (fp32).
        chunk_size: 16, 32 or 64.
        cu_seqlens: int32/int64 offsets [N + 1] of N sequences packed in one row (B = 1, FLA's
            convention, checked by ``ssmcraft.ops.common.varlen.offsets``); initial and final states
            are then [N, H, K, V], and no chunk straddles two sequences.
    Returns:
        o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32 or None. Differentiable in
        q, k, v, g and initial_state (a gradient on the final state flows back too).
    """
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    dt = v.dtype
    if dt not in IO_DTYPES:
        raise ValueError(f"chunk_key_decay: I/O dtype must be one of {IO_DTYPES}, got {dt}")
    B, T, H, K = k.shape
    V = v.shape[-1]
    if K > MAX_K:
        raise ValueError(f"chunk_key_decay: K = {K} > {MAX_K} is not supported")
    packed = packed_chunks("chunk_key_decay", cu_seqlens, v, initial_state, chunk_size, "v")
    N = B if packed is None else packed.N
    if T == 0:
        o = v.new_zeros(B, 0, H, V)
        S = initial_state.float() if initial_state is not None else v.new_zeros(N, H, K, V, dtype=torch.float32)
        return o, (S if output_final_state else None)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, ht = KeyDecayChunkFunction.apply(q.to(dt).contiguous(), k.to(dt).contiguous(), v.contiguous(),
                                        g.contiguous(), h0, output_final_state, chunk_size, not log_space, packed)
    return o, ht


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if this family runs ``ir``, else the reason it does not."""
    name = ir.spec_name
    if ir.kind not in ("scalar_decay", "diagonal_decay"):
        return f"{name}: structure {ir.kind!r}, not a scalar or diagonal decay"
    if ir.readout is not None:
        return f"{name}: element-wise readout (not oc . (S oq) + oh)"
    if "B" in ir.slots or "p" not in ir.slots or "q" not in ir.slots:
        return f"{name}: the input term does not factor as p q^T"
    d, m = ir.dims

    def dims(slot):
        co = ir.coefficient(slot)
        return None if co is None else tuple(co.dims)
    a = ir.coefficient("a")
    if a is None:
        return f"{name}: no decay slot a"
    if dims("a") not in ((), (m,)):
        return f"{name}: decay a varies over {dims('a')}; this family takes a decay over the key dimension ({m},) or a scalar"
    if a.expr.is_positive is not True:
        return f"{name}: decay a = {a.expr} is not provably positive (log a is needed); declare its inputs positive or bounded"
    if dims("p") not in ((), (d,)):
        return f"{name}: p varies over {dims('p')}, not ({d},)"
    if dims("q") != (m,):
        return f"{name}: q varies over {dims('q')}, not ({m},)"
    if dims("oq") != (m,):
        return f"{name}: readout key oq varies over {dims('oq')}, not ({m},)"
    if dims("oc") not in (None, (), (d,)):
        return f"{name}: readout scale oc varies over {dims('oc')}"
    if "oh" in ir.slots and dims("oh") not in ((), (d,)):
        return f"{name}: readout offset oh varies over {dims('oh')}"
    return None


def supports_sizes(ir, sizes: dict, mode: str) -> str | None:
    """Refuse a key dimension too large for the parallel kernels' register tiles."""
    return key_size_reason(ir, sizes, MAX_K)


def supports_inputs(ir, inputs, mode) -> str | None:
    """``supports_sizes`` on the sizes of these inputs (the Triton backend's hook)."""
    return supports_sizes(ir, key_sizes(ir, inputs), mode)


def _tok(x, B, T, H, n, ref):
    """A slot value ([B|1, T|1, H|1, r, c] tensor or number) -> [B, T, H, n] (broadcast)."""
    if not isinstance(x, torch.Tensor):
        return torch.full((B, T, H, n), float(x), device=ref.device, dtype=ref.dtype)
    return x.expand(B, T, H, *x.shape[3:]).reshape(B, T, H, -1).expand(B, T, H, n)


def forward(obj, lay, co, output_final_state):
    """Run the family on laid-out coefficients (see ssmcraft.ops.common.reference.layout).

    co: slot -> tensor [B|1, T|1, H|1, r, c] or number. Returns (y [B, T, H, d] in lay.dtype,
    S_T [B, H, d, m] fp32 or None); autograd reaches every slot tensor and lay.S0.
    """
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    io = io_dtype(lay.out_dtype)
    ref = next(t for t in list(co.values()) + list(lay.env.values()) if isinstance(t, torch.Tensor))
    a = co["a"]
    # the decay itself (``log_space=False``): the kernels take its log, floored (``tiles.log_decay``), and
    # return dL/da, exact at tiny and zero decays
    if isinstance(a, torch.Tensor):
        g = a.float()
    else:
        g = torch.full((), float(a), device=ref.device)     # no host-to-device copy (CUDA graphs)
    g = _tok(g, B, T, H, m, ref.float())
    k = _tok(co["q"], B, T, H, m, ref).to(io)
    q = _tok(co["oq"], B, T, H, m, ref).to(io)
    v = _tok(co["p"], B, T, H, d, ref).to(io)
    h0 = None if lay.S0 is None else lay.S0.transpose(-1, -2)
    o, ht = chunk_key_decay(q, k, v, g, initial_state=h0, output_final_state=output_final_state,
                            chunk_size=CHUNK, log_space=False)
    y = o.to(lay.dtype)
    oc = co.get("oc", 1)
    if isinstance(oc, torch.Tensor):
        y = y * _tok(oc, B, T, H, d, ref)
    elif float(oc) != 1.0:
        y = y * float(oc)
    oh = co.get("oh")
    if oh is not None:
        y = y + (_tok(oh, B, T, H, d, ref) if isinstance(oh, torch.Tensor) else float(oh))
    S = None if ht is None else ht.transpose(-1, -2)
    return y, S


def prepare(obj, lay):
    """The family's runner for one call signature (``lay`` from ``reference.validate``): slots that
    are plain inputs go to the kernels as they are, in their own dtype; the decay ``a`` is passed
    as is and its log taken inside the kernels (``log_space=False``). GLA runs with no PyTorch op
    besides the kernels. Returns ``fn(inputs, params, initial_state, output_final_state)``."""
    from ssmcraft.ops.common.slots import slot_runner
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    out_dtype = lay.out_dtype
    io = io_dtype(out_dtype)

    def vec(x, n, device):
        """A slot as [B, T, H, n] (per-head values and numbers broadcast)."""
        if not isinstance(x, torch.Tensor):
            return torch.full((B, T, H, n), float(x), device=device, dtype=torch.float32)
        return x.unsqueeze(-1).expand(B, T, H, n) if x.dim() == 3 else x

    def run(cs, initial_state, output_final_state, cu_seqlens=None):
        dev = cs.device
        a = vec(cs.get("a"), m, dev)
        o, ht = chunk_key_decay(vec(cs.get("oq"), m, dev).to(io), vec(cs.get("q"), m, dev).to(io),
                                vec(cs.get("p"), d, dev).to(io), a,
                                initial_state=None if initial_state is None else initial_state.transpose(-1, -2),
                                output_final_state=output_final_state, chunk_size=CHUNK, log_space=False,
                                cu_seqlens=cu_seqlens)
        return cs.finish(o).to(out_dtype), (None if ht is None else ht.transpose(-1, -2))
    return slot_runner(obj, lay, run)
