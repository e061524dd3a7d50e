"""Where a chunked program's rows are: a batch row of ``T`` tokens, or one sequence of a packed row
(``cu_seqlens``, ``ssmcraft.ops.common.varlen``), whose chunks never straddle two sequences. The
chunked kernels (``keydecay_chunk``, ``rank1_chunk``) index every ``[B, T, H, *]`` tensor from the
sequence's first row ``bos`` (``row_ids``), and every per-chunk buffer ``[B, H, NT, ...]`` from the
index of the sequence's first chunk; Triton inlines these helpers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.tiles import state_block, state_or_zero
from ssmcraft.ops.common.varlen import Chunks, check
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
    a bound on the chunk count (``rows.device_chunks``) marks the chunks past the last with the
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


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["N", "T", "NT", "BT", "STEPS"])
def chunk_tables_kernel(cu_in, cu, co, ci, N, T, NT, BT, STEPS, BLOCK: tl.constexpr):
    """One program builds a packed row's chunk tables (``varlen.Chunks``) from its offsets, in three
    passes over blocks: (1) ``cu [N + 1]`` the offsets clamped into [0, T], from 0 to T and made
    non-decreasing (checked ones pass unchanged); (2) ``co [N + 1]`` the chunks of the sequences
    before each (``co[N]``: all of them); (3) ``ci [NT, 2]`` each chunk's (sequence, index within
    it) by a binary search of ``co`` in ``STEPS`` halvings, ``(0, -1)`` past the last chunk."""
    o = tl.arange(0, BLOCK)
    top = tl.load(cu_in) * 0
    for s in range(0, N + 1, BLOCK):
        i = s + o
        x = tl.minimum(tl.maximum(tl.load(cu_in + i, mask=i <= N, other=0).to(tl.int64), 0), T).to(tl.int32)
        x = tl.where(i == 0, 0, tl.where(i == N, T, x))
        x = tl.maximum(tl.associative_scan(x, 0, _larger), top.to(tl.int32))
        tl.store(cu + i, x, mask=i <= N)
        top = tl.max(tl.where(i <= N, x, 0), 0).to(top.dtype)
    tl.debug_barrier()          # the offsets just stored are read by every thread below
    done = tl.load(cu_in) * 0
    for s in range(0, N + 1, BLOCK):
        i = s + o
        a = tl.load(cu + i, mask=i < N, other=0)
        n_c = (tl.load(cu + i + 1, mask=i < N, other=0) - a + BT - 1) // BT
        tl.store(co + i, done.to(tl.int32) + tl.cumsum(n_c, 0) - n_c, mask=i <= N)
        done = (done + tl.sum(n_c, 0)).to(done.dtype)
    tl.debug_barrier()
    total = tl.load(co + N)
    for s in range(0, NT, BLOCK):
        c = s + o
        lo = tl.zeros([BLOCK], dtype=tl.int32)
        hi = tl.zeros([BLOCK], dtype=tl.int32) + N
        for _ in range(0, STEPS):           # lo: how many of co[1..N] are <= c, i.e. c's sequence
            go = lo < hi
            mid = (lo + hi) // 2
            right = go & (tl.load(co + 1 + mid, mask=go, other=0) <= c)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(go & (~right), mid, hi)
        live = c < total
        n = tl.where(live, lo, 0)
        j = tl.where(live, c - tl.load(co + n, mask=live, other=0), -1)
        tl.store(ci + 2 * c, n, mask=c < NT)
        tl.store(ci + 2 * c + 1, j, mask=c < NT)


def chunk_tables(cu_seqlens: torch.Tensor, T: int, BT: int, NT: int, device):
    """(cu [N + 1], ci [NT, 2], co [N]) int32 on ``device``: ``chunk_tables_kernel``'s tables of the
    offsets ``cu_seqlens`` at chunk size ``BT``, one launch, no offset read; ``NT`` bounds the chunks."""
    N = cu_seqlens.numel() - 1
    src = cu_seqlens.to(device=device, non_blocking=True)
    cu = torch.empty(N + 1, dtype=torch.int32, device=device)
    co = torch.empty(N + 1, dtype=torch.int32, device=device)
    ci = torch.empty(NT, 2, dtype=torch.int32, device=device)
    launch(chunk_tables_kernel, (1,), src, cu, co, ci, N, T, NT, BT, N.bit_length() + 1, BLOCK=256, num_warps=4)
    return cu, ci, co[:N]


def device_chunks(cu_seqlens: torch.Tensor, T: int, BT: int, device) -> Chunks:
    """``Chunks`` at chunk size ``BT`` built on ``device`` by one kernel launch, no offset read
    (``chunk_tables``): ``NT`` is the bound ``T // BT + N`` (each sequence has at most one partial
    chunk), and the entries of ``ci`` past the last chunk are ``(0, -1)``: a kernel on a grid of ``NT``
    chunks returns at once where the index within the sequence is negative. The offsets are clamped
    into ``[0, T]`` and made non-decreasing first (a no-op on checked ones; an unchecked bad one
    cannot reach outside the inputs)."""
    N = cu_seqlens.numel() - 1
    NT = T // BT + N
    cu, ci, co = chunk_tables(cu_seqlens, T, BT, NT, device)
    return Chunks(cu, ci, co, N, NT)


def packed_chunks(name: str, cu_seqlens, token, initial_state, tokens_per_chunk: int, label: str = "token"):
    """The ``Chunks`` of a packed call of the chunked families (``cu_seqlens`` checked by ``varlen.check``
    against the token tensor ``token`` ``[1, total_T, ...]``, named ``label`` in its errors, and
    ``initial_state`` ``[N, ...]``), built on the token's device (``device_chunks``), or None for an
    unpacked one."""
    if cu_seqlens is None:
        return None
    check(name, cu_seqlens, {label: token}, initial_state)
    return device_chunks(cu_seqlens, token.shape[1], tokens_per_chunk, token.device)
