"""Where a chunked program's rows are: a batch row of ``T`` tokens, or one sequence of a packed row
(``cu_seqlens``, ``ssmcraft.ops.common.varlen``), whose chunks never straddle two sequences. The
chunked kernels (``keydecay_chunk``, ``rank1_chunk``) index every ``[B, T, H, *]`` tensor from the
sequence's first row ``bos`` (``row_ids``), and every per-chunk buffer ``[B, H, NT, ...]`` from the
index of the sequence's first chunk; Triton inlines these helpers.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.tiles import state_block, state_or_zero
from ssmcraft.ops.common.tuning import cdiv


@triton.jit
def row_ids(bos, i_h, t, T, H):
    """Row ids (int64) of time steps ``t`` of the sequence starting at row ``bos`` (``b * T``, or its
    offset in a packed row) clamped into [0, T-1] (rows past the end repeat the last one, so that
    cumulative sums stay flat there)."""
    return (bos + tl.maximum(tl.minimum(t, T - 1), 0)).to(tl.int64) * H + i_h


@triton.jit
def seq_state(cu, co, i_b, i_h, T, NT, H: tl.constexpr, BT: tl.constexpr, VARLEN: tl.constexpr):
    """The state kernels' sequence ``i_b``: (its first row ``bos``, its length, its chunk count, the
    int64 index of its first chunk in the per-chunk buffers ``[B, H, NT, ...]``). VARLEN: sequence
    ``i_b`` of a packed row (``cu`` its offsets, ``co`` each sequence's first chunk, NT every
    sequence's chunks together); else row ``i_b`` of the batch."""
    if VARLEN:
        bos = tl.load(cu + i_b)
        T_s = tl.load(cu + i_b + 1) - bos
        return bos, T_s, tl.cdiv(T_s, BT), i_h.to(tl.int64) * NT + tl.load(co + i_b)
    else:
        return i_b * T, T, NT, (i_b * H + i_h).to(tl.int64) * NT


@triton.jit
def seq_chunk(cu, ci, i_c, i_b, i_h, T, NT, H: tl.constexpr, VARLEN: tl.constexpr):
    """The parallel kernels' chunk ``i_c`` (grid index): (its sequence's first row ``bos`` and
    length, the chunk's index within the sequence, the int64 index of the sequence's first chunk in
    the per-chunk buffers). VARLEN: ``ci [NT, 2]`` holds each chunk's (sequence, index within it),
    so that no chunk straddles two sequences; else chunk ``i_c`` of batch row ``i_b``. A grid sized by
    a bound on the chunk count (``varlen.device_chunks``) marks the chunks past the last with the
    index ``-1`` within the sequence: the kernel returns at once where ``i_t < 0``."""
    if VARLEN:
        n = tl.load(ci + 2 * i_c)
        i_t = tl.load(ci + 2 * i_c + 1)
        bos = tl.load(cu + n)
        return bos, tl.load(cu + n + 1) - bos, i_t, i_h.to(tl.int64) * NT + i_c - i_t
    else:
        return i_b * T, T, i_c, (i_b * H + i_h).to(tl.int64) * NT


@triton.jit
def state_program(H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """This program's (key block, value block, batch * head, batch, head) in the state kernels' grid
    (key block x value block, batch * head)."""
    i_kv = tl.program_id(0)
    i_bh = tl.program_id(1)
    NV = tl.cdiv(V, BV)
    return i_kv // NV, i_kv % NV, i_bh, i_bh // H, i_bh % H


def sequences(B, T, BT, packed, ref):
    """(N sequences, NT chunks (per batch row, or of the whole packed row), the kernels' packing
    arguments): ``packed`` a ``Chunks`` (``ssmcraft.ops.common.varlen``) or None (``ref`` stands in for its pointers, unread)."""
    if packed is None:
        return B, cdiv(T, BT), {"cu": ref, "co": ref, "ci": ref, "VARLEN": False}
    return packed.N, packed.NT, {"cu": packed.cu, "co": packed.co, "ci": packed.ci, "VARLEN": True}


def packed_args(args, *names):
    return {n: args[n] for n in (*names, "VARLEN")}


@triton.jit
def state_scan(start, cu, co, T, NT, H: tl.constexpr, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               HAS_START: tl.constexpr, VARLEN: tl.constexpr):
    """The opening of a kernel that carries one value block of a ``[K, V]`` state across a sequence's
    chunks of ``BT`` rows, on the grid (value blocks, sequences x heads): ``i_bh`` (int64) and the head
    ``i_h``; the block's offsets and masks ``o_k, m_k, o_v, m_v, m_kv, p_kv`` (``tiles.state_block``);
    the fp32 block it starts from (of ``start [B*H, K, V]`` when ``HAS_START``, else zeros: an initial
    state, or a final state's gradient for a reverse scan); and its sequence's first row, length,
    chunk count and first chunk's index (``seq_state``)."""
    i_bh = tl.program_id(1)
    i_h = i_bh % H
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_block(0, tl.program_id(0), K, V, BK, BV)
    b_h = state_or_zero(start, i_bh, p_kv, m_kv, K, V, HAS_START, BK, BV)
    bos, T, n_t, cb = seq_state(cu, co, i_bh // H, i_h, T, NT, H, BT, VARLEN)
    return i_bh.to(tl.int64), i_h, o_k, m_k, o_v, m_v, m_kv, p_kv, b_h, bos, T, n_t, cb
