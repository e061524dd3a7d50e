"""The key-decay family's decay gradient where dg / a has lost its digits: ``keydecay_chunk_bwd_da_kernel``,
launched after ``chunk.keydecay_chunk_bwd_dg_kernel`` when the kernels take the decay itself
(``log_space=False``), rewrites dL/da term by term in the chunks holding a decay below e^-3; and the
program layout the per-key-block backward kernels share (``key_block_chunk``). The algorithm and the
host code are in ``ssmcraft.ops.keydecay_chunk.chunk``."""
from __future__ import annotations

import triton
import triton.language as tl

from ssmcraft.ops.common.rows import row_ids, seq_chunk
from ssmcraft.ops.common.tiles import LOG_EXACT_DA, key_decay_grad, log_decay, value_block
from ssmcraft.ops.common.tuning import tune, warp_rule

# per (key block, chunk): a loop over the block's keys, each a [BT, BT] x [BT, BT] product
DA_CONFIGS = [triton.Config({"BK": bk}, num_warps=w, num_stages=2) for bk in (16, 32) for w in (4, 8)]


@triton.jit
def key_block_chunk(cu, ci, T, NT, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     VARLEN: tl.constexpr):
    """The program (key block, chunk, batch x head) of the per-key-block backward kernels: the chunk's
    index and its sequence's first chunk (``rows.seq_chunk``), its rows (``o_i``, mask ``m_t``, ids
    ``row``), the key block's keys (``o_k``, ``m_k``) and the [BT, BK] tile's offsets ``p`` and mask ``m``
    in a ``[B, T, H, K]`` tensor."""
    i_bh = tl.program_id(2)
    bos, T, i_t, cb = seq_chunk(cu, ci, tl.program_id(1), i_bh // H, i_bh % H, T, NT, H, VARLEN)
    o_i = tl.arange(0, BT)
    m_t = (i_t * BT + o_i) < T
    row = row_ids(bos, i_bh % H, i_t * BT + o_i, T, H)
    o_k = tl.program_id(0) * BK + tl.arange(0, BK)
    m_k = o_k < K
    return i_t, cb, o_i, m_t, row, o_k, m_k, row[:, None] * K + o_k[None, :], m_t[:, None] & m_k[None, :]


@tune(DA_CONFIGS, key=["H", "K", "V", "BT"], prune=warp_rule)
@triton.jit(do_not_specialize=["T", "NT", "V_run"])
def keydecay_chunk_bwd_da_kernel(da, a, q, k, v, do, dA, hs, dhs, cu, ci, T, NT, V_run, H: tl.constexpr,
                                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                                 BV: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """Per (key block, chunk) holding a decay below e^LOG_EXACT_DA (others return at once): dL/da
    rewritten term by term (``_exact_decay_grad``), where dg / a has lost its digits (and is NaN at a =
    0). A kernel of its own, launched after ``keydecay_chunk_bwd_dg_kernel``, so that the common case's
    kernel keeps its registers (with this branch inside, ptxas spilled 9 kB there)."""
    i_t, cb, o_i, m_t, row, o_k, m_k, p, m = key_block_chunk(cu, ci, T, NT, H, K, BT, BK, VARLEN)
    if i_t < 0:      # a chunk past the packed row's last (rows.seq_chunk)
        return
    b_la = log_decay(tl.load(a + p, mask=m, other=1.).to(tl.float32))
    if tl.min(tl.min(b_la, axis=1), axis=0) < LOG_EXACT_DA:
        b_da = _exact_decay_grad(q, k, v, do, dA, hs, dhs, b_la, row, m_t, o_i, o_k, m_k, (cb + i_t) * K * V,
                                 V_run, K, V, BT, BK, BV, PREC)
        tl.store(da + p, b_da, mask=m)


@triton.jit
def _exact_decay_grad(q, k, v, do, dA, hs, dhs, b_la, row, m_t, o_i, o_k, m_k, base, V_run, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """dL/da [BT, BK] of one chunk and key block, term by term: da_tk = sum_v dh_t[k, v] h_{t-1}[k, v],
    with h_{t-1} = e^{gp_t} h0 + sum_{j<t} e^{gp_t - b_j} k_j v_j^T and dh_t = e^{bl - b_t} dH +
    sum_{i>=t} e^{b_i - b_t} q_i dO_i^T written out (per key: ``tiles.pair_decay_grad``), so that every
    product of decays leaves a_t out: finite and exact at a_t = 0, where dg / a is not. One key at a
    time: the factors differ per key."""
    b_Q = tl.zeros([BT, BK], dtype=tl.float32)      # dO h0^T
    b_P = tl.zeros([BT, BK], dtype=tl.float32)      # V dH^T
    b_hd = tl.zeros([BK], dtype=tl.float32)         # sum_v h0 dH
    for i_v in range(tl.cdiv(V_run, BV)):
        o_v, m_v, m_tv, m_kv = value_block(i_v, V, m_t, m_k, BV)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_h = tl.load(hs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.).to(tl.float32)
        b_dh = tl.load(dhs + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.).to(tl.float32)
        b_Q += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_P += tl.dot(b_v, tl.trans(b_dh), input_precision=PREC)
        b_hd += tl.sum(b_h * b_dh, axis=1)
    m_tk = m_t[:, None] & m_k[None, :]
    b_DV = tl.load(dA + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.)
    b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_b = tl.cumsum(b_la, axis=0)                   # rows past T: log 1 = 0, the sums stay flat
    b_bl = tl.sum(tl.where((o_i == BT - 1)[:, None], b_b, 0.), axis=0)
    return key_decay_grad(b_DV, b_q, b_k, b_q * b_Q, b_k * b_P, b_hd, b_b, b_b - b_la, b_bl, o_i, False, BK, PREC)
