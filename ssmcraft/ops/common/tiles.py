"""Triton helpers shared by the chunked kernels (``rank1_chunk``, ``keydecay_chunk``): the offsets
and masks of a block of a ``[K, V]`` state, of a chunk's rows and of a value block against them, and a state
block loaded or started at zero. Triton inlines them: a kernel compiles as if their lines were
written out in it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def state_block(i_k, i_v, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """Key block ``i_k`` x value block ``i_v`` of a ``[K, V]`` state: key offsets ``o_k [BK]`` and
    mask ``m_k``, value offsets ``o_v [BV]`` and mask ``m_v``, the block's mask ``m_kv [BK, BV]`` and
    its offsets inside one state ``p_kv [BK, BV]``."""
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    return o_k, m_k, o_v, m_v, m_k[:, None] & m_v[None, :], o_k[:, None] * V + o_v[None, :]


@triton.jit
def state_or_zero(ptr, i_bh, p_kv, m_kv, K, V, HAS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The fp32 block ``p_kv`` of state ``i_bh`` in ``ptr [B*H, K, V]`` when ``HAS``, else zeros (``ptr``
    unread): an initial state or a final state's gradient that may not be given."""
    if HAS:
        return tl.load(ptr + i_bh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
    else:
        return tl.zeros([BK, BV], dtype=tl.float32)


@triton.jit
def value_block(i_v, V, m_t, m_k, BV: tl.constexpr):
    """Value block ``i_v`` against a chunk's row mask ``m_t [BT]`` and a key mask ``m_k [BK]``:
    ``o_v [BV]``, ``m_v [BV]``, ``m_tv [BT, BV]`` and ``m_kv [BK, BV]``."""
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    return o_v, m_v, m_t[:, None] & m_v[None, :], m_k[:, None] & m_v[None, :]


@triton.jit
def chunk_rows(i_b, i_h, i_t, T, H, BT: tl.constexpr):
    """Chunk ``i_t``'s rows: local index ``o_i [BT]``, mask ``m_t`` (rows before T) and the flat
    (batch, time, head) row ids ``row`` (int64) of the ``[B, T, H, *]`` tensors."""
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < T
    return o_i, m_t, (i_b * T + o_t).to(tl.int64) * H + i_h


@triton.jit
def seq_rows(bos, i_h, i_t, T, H, BT: tl.constexpr):
    """``chunk_rows`` of chunk ``i_t`` of the sequence whose first row is ``bos`` (``b * T``, or its
    offset in a packed row) and whose length is T: rows past T are masked, not clamped."""
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    return o_i, o_t < T, (bos + o_t).to(tl.int64) * H + i_h


# The floor of a log-decay in the chunked kernels. A decay below e^-80 (~1.8e-35) scales the previous
# state by less than fp32's relative step (~6e-8) times 1e-27: next to the current token's term it
# contributes nothing measurable, so clamping its log there changes no fp32 output, and keeps every
# within-chunk sum finite: a decay of exactly 0 (a sigmoid gate that underflowed) has log -inf, and a
# sum through it gave exp(-inf - (-inf)) = NaN. Clamped, a chunk's sums stay within 80 BT of 0.
LOG_DECAY_FLOOR = tl.constexpr(-80.0)


@triton.jit
def log_decay(a):
    """``log a`` of a decay tile (fp32), clamped at ``LOG_DECAY_FLOOR`` (0 and tiny decays stay finite)."""
    return tl.maximum(tl.log(a), LOG_DECAY_FLOOR)


# The decay's gradient as d log a / a loses every digit below a ~ e^-3: d log a_r is a difference of
# reverse sums of O(1) terms that is itself O(a_r), and 1 / a_r blows its rounding up (and is NaN at
# a_r = 0). A chunk holding a decay below this takes it term by term instead (``pair_decay_grad``).
LOG_EXACT_DA = tl.constexpr(-3.0)


@triton.jit
def decay_ratios(b_g, b_gp, b_gt, b_gpt, o_g, o_j):
    """Products of a chunk's decays that leave token r out (tokens r on the columns): ``E [BT, BTT]``,
    e^{gp_r - g_j} for term rows j of earlier tokens (the decays strictly between them), ``Fg [BTT,
    BTT]``, e^{g_t - g_r} for tokens t >= r, ``Fgp [BT, BTT]``, e^{gp_i - g_r} for term rows i of later
    tokens. Each exponent is a later sum minus an earlier one (<= 0): no overflow, and a decay of 0 (at
    its clamped log) only ever zeroes the products it is in."""
    m_e = o_g[:, None] < o_j[None, :]
    E = tl.where(m_e, tl.exp(tl.where(m_e, b_gpt[None, :] - b_g[:, None], 0.)), 0.)
    m_f = o_j[:, None] >= o_j[None, :]
    Fg = tl.where(m_f, tl.exp(tl.where(m_f, b_gt[:, None] - b_gt[None, :], 0.)), 0.)
    m_p = o_g[:, None] > o_j[None, :]
    Fgp = tl.where(m_p, tl.exp(tl.where(m_p, b_gp[:, None] - b_gt[None, :], 0.)), 0.)
    return E, Fg, Fgp


@triton.jit
def pair_decay_grad(X, x0, F, E, b_gpt, PREC: tl.constexpr):
    """The part of d a_r [BTT] of the factors e^{g_i - g_j} (i on X's rows, j on its columns) whose
    span holds token r, each with a_r left out: sum_{i, j} F[i, r] X[i, j] E[j, r], plus the factors
    e^{g_i} from the chunk's start (coefficients ``x0`` on the rows), e^{gp_r} F[i, r] x0[i]. ``X`` and
    ``x0`` are the coefficients without their decays; F is ``Fg`` or ``Fgp`` for X's row sums."""
    Y = tl.dot(X, E, input_precision=PREC) + x0[:, None] * tl.exp(b_gpt)[None, :]
    return tl.sum(F * Y, axis=0)
