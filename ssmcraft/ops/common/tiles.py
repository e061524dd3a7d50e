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
