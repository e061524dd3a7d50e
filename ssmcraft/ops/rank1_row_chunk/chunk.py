"""Chunked identity-minus-rank-1 recurrences with a per-row step, with no decay (Longhorn exact), a
per-head one (Gated Longhorn) or a per-row one (wd_longhorn, ``rowdecay.py``).

The recurrence (``ssmcraft.ops.rank1_row``), per state row ``i`` (``s_i`` a row vector over K)::

    z_t,i = s_{t-1,i} . u_t,   s_t,i = a_t s_{t-1,i} - c_t,i z_t,i v_t + p_t,i q_t,   y_t,i = oc_i (s_t,i . oq_t) + oh_i

The algebra below is written for ``a = 1``; the decay is described after it.

Over a chunk of C tokens from the start state ``H0 = S_0^T [K, V]``, with ``D = c o Z`` ([C, V]), the
per-row scalars satisfy one unit lower-triangular system per row whose matrices are shared by the
rows of a head, only the diagonal scaling ``c`` being per row::

    Z + A D = U H0 + Aq P          A = strict_lower(U V^T), Aq = strict_lower(U Q^T)   [C, C]
    O = OQ H0 - Lv D + Lq P        Lv = lower(OQ V^T), Lq = lower(OQ Q^T) (diagonal included)
    H_C = H0 - V^T D + Q^T P

So a program per (sequence * head, block of R rows) walks the chunks in order with the state tile in
registers: the products on tensor cores, and per chunk a C-step forward substitution on ``[C, R]``
tiles (``D + c o (A D) = c o (U H0 + Aq P)``), which replaces the per-token loop's chain of K-long dot
products. Where u, v and q are one tensor (Longhorn's k: ``ONE_KEY``) A = Aq and Lv = Lq, and D and P
enter only through ``E = P - D``: half the Gram matrices, one key gradient.

Backward (reverse over chunks; ``dH`` the adjoint of the chunk's end state, ``dO = oc o dY``)::

    H0  = H_C + V^T D - Q^T P                          (the start state from the stored D; Z = U H0 + Aq P - A D)
    gD  = -Lv^T dO - V dH                              (adjoint of D through the outputs and H_C)
    (I + A diag(c))^T W = c o gD                       (backward substitution: W is the adjoint of U H0 + Aq P)
    dc  = Z o (gD - A^T W),   dp = Aq^T W + Lq^T dO + Q dH,   doc = dY o O
    dA  = -strict(W D^T), dAq = strict(W P^T), dLv = -lower(dO D^T), dLq = lower(dO P^T)
    dU  = W H0^T + dA V + dAq Q,        dV = dA^T U + dLv^T OQ - D dH^T
    dQ  = dAq^T U + dLq^T OQ + P dH^T,  dOQ = dO H0^T + dLv V + dLq Q
    dH0 = dH + U^T W + OQ^T dO

The key gradients are sums over rows: each row block writes its own slice ``[NR, B, T, H, K]``, summed
on the host (as ``rank1_row`` does); so are per-head coefficients' (``[NR, B, T, H]``). The forward
of a training step stores ``D`` ([B, T, H, V] fp32, the substitution's own result, so that the
backward rebuilds exactly the states the forward walked) and the final state; nothing per chunk.

A per-head decay ``a [B, T, H]`` (as gated DeltaNet's chunked form takes it): with ``g_t`` the chunk's
cumulative log decays (``log a`` floored at ``tiles.LOG_DECAY_MIN``, so that 0 and tiny decays stay
finite) and ``gp_t = g_t - log a_t``, every matrix carries the decays between its two tokens and every
term of the start state the decays from the chunk's start::

    A, Aq *= e^{gp_t - g_tau} (tau < t),   Lv, Lq *= e^{g_t - g_tau} (tau <= t)
    U H0 -> e^{gp} o U H0,   OQ H0 -> e^g o OQ H0,   H_C = e^{g_C} H0 - V~^T D + Q~^T P,  V~ = e^{g_C - g} o V

each exponent a later sum minus an earlier one (<= 0; never ``e^{-g}`` alone), so nothing overflows.
The backward is the one above on these matrices, the keys' gradients taking the decayed adjoints
(``e^{..} o dA`` and so on). The decay's gradient is taken term by term in every chunk
(``tiles.pair_decay_grad``: each factor's coefficient times the product of the other decays in its
span), exact at tiny and zero decays, where d log a / a loses its digits; it costs two ``[C, C]``
products a chunk, beside the ``[C, K]`` ones, so no chunk takes the d log a / a shortcut. Its factors
are the decayed matrices' own (``Gp``, ``G``, with their empty products 1 exactly), and the part that
the substitution does not reach (L's pairs, the outputs' and the end state's start factors) is taken
before it, so that what it is formed from is not held through it (ptxas's spills a thread, bf16: 252
bytes; 500 with both parts after the substitution on factor matrices of their own; Longhorn's 84).
Where one tensor is both the decay and c's per-head factor (Gated Longhorn's alpha), the backward sums
its two gradients in the kernel. A chunk's start state cannot be rebuilt from its end state by
dividing by the decays: the forward of a training step stores every chunk's start state (``hs``,
``[B T / C + N, H, K, V]`` fp32: about ``4 B H T K V / C`` bytes, 268 MB at B=8 T=2048 H=16 K=V=64
C=16) and the backward reads it.

A per-row decay ``a [B, T, H, V]`` (one key, a constant readout scale): each row its own cumulative
log decays, the Gram matrices still shared per head; its kernels (``rowdecay.py``, which derives them)
take every product that carries a per-row factor between two tokens on tensor cores, the factors split
at a reference token, in chunks of mild decays, else one token at a time on the ``[C, R]`` tiles, and
store Z (not D) and every chunk's start state; with ``ROW_DECAY_SPLIT`` also one flag per (sequence,
head, row block), "every chunk mild", by which the backward runs as two launches of its kernel: the
products alone compiled where the flag is 1, the per-chunk choice where it is 0.

Packed sequences (``cu_seqlens``): a program walks its own sequence from its first row, so no chunk
straddles two sequences; states are ``[N, H, ...]``.
"""
from __future__ import annotations

import torch

from ssmcraft.ops.common.chunked import _per_head, few_keys_reason, key_sizes
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.slots import row_mode
from ssmcraft.ops.common.tuning import INTERPRET, buffer, cdiv, dot_precision, io_dtype, pow2
from ssmcraft.ops.rank1_row.recurrent import supports as rank1_row_supports
from ssmcraft.ops.rank1_row_chunk.kernels import rank1_row_chunk_bwd_kernel, rank1_row_chunk_fwd_kernel
from ssmcraft.ops.rank1_row_chunk.rowdecay import (PATH_MIXED, PATH_ONE, PATH_PRODUCTS,
                                                   rank1_row_chunk_rowdecay_bwd_kernel,
                                                   rank1_row_chunk_rowdecay_fwd_kernel)

BACKEND_NAME = "rank1-row-chunk"
POISON = False        # tests: fill every output buffer with NaN before the kernels write it
# Whether the family goes ahead of rank1_row on CUDA for a per-head decay (Gated Longhorn): measured
# faster and checked (one H200, bf16 B=8 T=2048 H=16 d=m=64, fwd / fwd+bwd ms through obj(): 0.877 /
# 3.310 here and Longhorn 0.779 / 2.618 in one process (1.26x; the kernels 2166 us backward and 879
# forward against Longhorn's 1597 and 759); rank1_row 1.078 / 4.808 in another, beside 0.915 / 3.553 here
# (``benchmarks/bench_rank1_row_chunk.py --decayed``); the decayed kernels against float64 on the GPU:
# 8.6e-6 in fp32 with tiny and zero decays, 2.6e-3 in bf16). Read at dispatch time, so a benchmark may
# flip it.
DECAY_AHEAD = True
# The smallest key size at which the family goes ahead of rank1_row on CUDA: with few keys the per-token
# loop's K-long chains are short and its one pass over the tokens wins. Measured (one H200, bf16, kernels
# alone, ``bench_rank1_row_chunk.py --no-check --shape B,T,H,K,V``), fwd / fwd+bwd ms:
#   B8 T2048 H24 K16 V64: rank1_row 0.747 / 2.112; this family R16 1.223 / 4.164, R32 0.711 / 2.624;
#   B16 T512 H4 K16 V64:  rank1_row 0.189 / 0.655; this family R32 0.163 / 0.773;
#   B8 T2048 H16 K32 V64: rank1_row 0.795 / 1.950; this family R32 0.691 / 2.983;
#   B8 T2048 H16 K64 V64: rank1_row 1.193 / 3.185; this family R32 0.744 / 2.482.
MIN_KEYS = 64
# Whether the family goes ahead of rank1_row on CUDA for a per-row decay (wd_longhorn): measured faster with
# mild chunks as products (``ROW_DECAY_FAST``). One H200, bf16 B=8 T=2048 H=16 d=m=64 through obj(), one
# process, fwd / fwd+bwd ms: 0.906 / 4.062 here without ROW_DECAY_SPLIT (its kernels 0.87 ms forward, 2.86
# ms backward), 1.005 / 5.271 on rank1_row, 1.845 / 7.626 here with the walks alone; Longhorn 0.777 / 2.617
# (so 1.55x Longhorn's, against 2.01x on rank1_row); with the products at other tiles, fwd+bwd: 32 rows and
# 8 warps 6.70, 16 rows and 4 warps 6.69, 64 rows and 8 warps 5.17. Every chunk was mild there (lam drawn as
# softplus(randn) / 2, so a >= 0.25); a chunk holding a decay below e^LOG_EXACT_DA (lam > 19) takes the
# walks, 7.6 ms if every chunk did. The kernels against float64 on the GPU (T=320 H=16 K=V=64): fp32 6.3e-7
# ordinary, 6.2e-6 mixed, 9.8e-6 tiny and zero decays; bf16 2.6e-3, 2.5e-3, 2.4e-3, and 9.6e-3 (d a) with
# every decay in (0.06, 0.1). Read at dispatch time, as DECAY_AHEAD.
ROW_DECAY_AHEAD = True
# Whether a per-row decay's mild chunks (every decay at least e^LOG_EXACT_DA: ``rowdecay.mild_chunk``) take
# tensor-core products against a reference token instead of the token-by-token walks; read at each call.
ROW_DECAY_FAST = True
# With ROW_DECAY_FAST, whether the per-row decay's backward is split in two launches of its kernel by the
# forward's flag per (sequence, head, row block), "every chunk mild" (``rowdecay.PATH``): one with only the
# products compiled, one deciding per chunk as the single kernel does; the same results bit for bit. The
# single kernel spills 704 bytes stored / 832 loaded a thread on sm_90 (``compile_sm90.py --regs --show
# PATH``), the products-only one 140 / 140, the mixed one as the single. wd_longhorn, one H200, bf16 B=8
# T=2048 H=16 d=m=64 through obj(), one process (``bench_rank1_row_chunk.py --decayed --row-split``, each
# setting twice): fwd+bwd 3.327 / 3.328 ms split, 4.001 / 3.992 not (backward kernels 2108-2111 against
# 2781-2790 us); Longhorn 2.582, so 1.29x against 1.55x. Read at each call.
ROW_DECAY_SPLIT = True
# Where u = s k (s per head: Gated Longhorn's alpha), whether the kernels form c o s (True) or the host
# does (``slots.fold_scaled_u``). Formed on the host, its passes over [B, T, H, V] took 0.22 ms of Gated
# Longhorn's 3.55 ms fwd+bwd (one H200, bf16 B=8 T=2048 H=16 d=m=64, ``bench_rank1_row_chunk.py --decayed
# --profile``: two broadcast products, the sum of dc o c over the rows for ds, one more product); in the
# kernels they cost a per-head load and, in the backward, one more per-head sum (``kernels.store_c``) and
# ~50 more bytes of spills a thread (``compile_sm90.py --regs``); not yet timed against the host's form
# (``--decayed`` times both in one process).
SCALE_IN_KERNEL = True
# The backward's key gradients: True, every row block of a head adds into one [B, T, H, K] fp32 buffer
# (atomics in L2; with two row blocks, 0 + x + y, the same sum in either order); False, each stores
# its partial [NR, B, T, H, K] and the host sums them (one more pass over NR times the gradients).
# Longhorn, one H200, bf16 B=8 T=2048 H=16 d=m=64 fwd+bwd: 2.618 ms with it, 2.678 without in another
# process (not yet compared in one); ``rank1_row``'s same choice measured 3.15 ms against 3.24.
ATOMIC_KEYS = True
CHUNK = 16            # tokens per chunk (16 or 32)
ROWS = 32             # state rows per program (16, 32 or 64)
NUM_WARPS = 4
ROW_SLOTS = ("c", "p", "oc", "oh")
KEY_SLOTS = ("u", "v", "q", "oq")


def config(V: int) -> tuple[int, int, int]:
    """(C, R, num_warps): the module's constants (``tl.dot`` needs C, R >= 16); one warp under the
    interpreter, where warps cost only time."""
    return CHUNK, ROWS, 1 if INTERPRET else NUM_WARPS


def one_key(keys) -> bool:
    """Whether u, v and q are one tensor (Longhorn's k): the kernels' ``ONE_KEY``."""
    return keys[0] is keys[1] and keys[1] is keys[2]


def _new(shape, device, dtype=torch.float32):
    return buffer(shape, device, dtype, POISON)


def row_flags(N, H, NR, dev):
    """The per-row decay's flags, one int32 per (sequence, head, row block) (``rowdecay.PATH``): -1 where
    poisoned (neither of the split backward's kernels takes a -1), else uninitialised."""
    if POISON:
        return torch.full((N * H * NR,), -1, device=dev, dtype=torch.int32)
    return torch.empty((N * H * NR,), device=dev, dtype=torch.int32)


def start_slots(B, T, N, C):
    """Slots of the chunk-start states a decayed forward stores (``kernels.start_slot``)."""
    return B * T // C + N


def _forward(keys, a, rows, h0, V, out_dtype, *, want_state, training, cu=None, N=None, cs=None):
    """keys (u, v, q, oq) [B, T, H, K]; a [B, T, H], [B, T, H, V] or None (no decay); rows (c, p, oc, oh)
    per ``slots.row_mode``; cs: a per-head factor of c [B, T, H] or None; h0 [N, H, K, V] fp32 contiguous
    or None. Returns y [B, T, H, V], the final state
    [N, H, K, V] fp32 (with ``want_state`` or ``training``), and, when ``training``, D = c o z
    [B, T, H, V] fp32 and with a decay the chunk-start states [NS, H, K, V] fp32 (else None), and with a
    per-row decay whose backward is split (``ROW_DECAY_SPLIT``) its flags (``row_flags``; else None)."""
    u = keys[0]
    B, T, H, K = u.shape
    N = B if N is None else N
    dev = u.device
    C, R, nw = config(V)
    modes = [row_mode(x) for x in rows]
    y = _new((B, T, H, V), dev, out_dtype)
    ht = _new((N, H, K, V), dev) if (want_state or training) else None
    d = _new((B, T, H, V), dev) if training else None
    hs = _new((start_slots(B, T, N, C), H, K, V), dev) if training and a is not None else None
    if a is not None and a.dim() == 4:
        mild = row_flags(N, H, cdiv(V, R), dev) if training and ROW_DECAY_FAST and ROW_DECAY_SPLIT else None
        launch(rank1_row_chunk_rowdecay_fwd_kernel, (N * H, cdiv(V, R)), u, keys[3], a,
               *[m[2] for m in modes], h0, y, ht, d, hs, mild, cu, T, H=H, K=K, V=V, C=C, R=R, BK=pow2(K),
               MODES=tuple(m[0] for m in modes), CONSTS=tuple(m[1] for m in modes), HAS_H0=h0 is not None,
               STORE_HT=ht is not None, STORE_Z=training, PREC=dot_precision(out_dtype), VARLEN=cu is not None,
               FAST=ROW_DECAY_FAST, STORE_MILD=mild is not None, num_warps=nw)
        return y, ht, d, hs, mild
    c, p, oc, oh = (m[2] for m in modes)
    launch(rank1_row_chunk_fwd_kernel, (N * H, cdiv(V, R)), *keys, a, c, cs, p, oc, oh, h0, y, ht, d, hs, cu, T,
           H=H, K=K, V=V, C=C, R=R, BK=pow2(K), MODES=tuple(m[0] for m in modes),
           CONSTS=tuple(m[1] for m in modes), HAS_H0=h0 is not None, STORE_HT=ht is not None, STORE_D=training,
           PREC=dot_precision(out_dtype), VARLEN=cu is not None, ONE_KEY=one_key(keys), HAS_A=a is not None,
           HAS_CS=cs is not None, num_warps=nw)
    return y, ht, d, hs, None


def atomic_keys(NR: int) -> bool:
    """Whether the backward's row blocks add their key gradients into one buffer (``ATOMIC_KEYS``)."""
    return ATOMIC_KEYS and NR > 1


def key_grad(B, T, H, K, NR, atomic, dev):
    """A key gradient's buffer: [B, T, H, K] zeros the row blocks add into (``atomic``), else one
    partial per row block [NR, B, T, H, K]."""
    return torch.zeros((B, T, H, K), device=dev) if atomic else _new((NR, B, T, H, K), dev)


def key_sum(g, atomic):
    """The key gradient [B, T, H, K] from ``key_grad``'s buffer after the backward."""
    return g if atomic else g.sum(0) if g.shape[0] > 1 else g[0]


def _backward(keys, a, rows, d, ht, hs, dy, dht, need_dh0, out_dtype, cu=None, cs=None, cs_is_a=False, mild=None):
    """The gradients (keys, a, rows (c, p, oc), initial state) of ``_forward``'s call, and cs's [B, T, H].
    With a per-row decay (``rowdecay.py``): one key, ``d`` the forward's Z, the decay's gradient per row
    [B, T, H, V], whole. ``cs_is_a``: cs is the per-head decay itself (Gated Longhorn's alpha): the kernel
    adds cs's gradient into a's (one buffer, one sum over the row blocks) and cs's is None. ``mild``: the
    per-row decay's flags from the forward (its backward split in two launches) or None (one launch)."""
    u = keys[0]
    B, T, H, K = u.shape
    N, V = ht.shape[0], ht.shape[-1]
    dev = u.device
    C, R, nw = config(V)
    NR = cdiv(V, R)
    modes = [row_mode(x) for x in rows[:3]]
    per_row = a is not None and a.dim() == 4
    single = one_key(keys)
    # one key in three slots: its one gradient (the three slots' sum) in du, none for v and q
    atomic = atomic_keys(NR)
    dkeys = [None if single and slot in ("v", "q") else key_grad(B, T, H, K, NR, atomic, dev) for slot in KEY_SLOTS]
    # the row coefficients' gradients; no readout scale's with a per-row decay (a constant there)
    drows = [_new((B, T, H, V), dev) if m[0] == 2 else _new((NR, B * T * H), dev) if m[0] == 1 else None
             for m in modes[:2 if per_row else 3]]
    dh0 = _new((N, H, K, V), dev) if need_dh0 else None
    da = None if a is None else _new((B, T, H, V) if per_row else (NR, B * T * H), dev)
    dcs = None if cs is None or cs_is_a else _new((NR, B * T * H), dev)
    c, p, oc = (m[2] for m in modes)
    common = dict(H=H, K=K, V=V, C=C, R=R, BK=pow2(K), MODES=tuple(m[0] for m in modes),
                  CONSTS=tuple(m[1] for m in modes), HAS_DHT=dht is not None, STORE_DH0=need_dh0,
                  PREC=dot_precision(out_dtype), VARLEN=cu is not None, ATOMIC=atomic, num_warps=nw)
    dht = None if dht is None else dht.float().contiguous()
    if per_row:
        dy = dy.contiguous()
        for path in (PATH_ONE,) if mild is None else (PATH_PRODUCTS, PATH_MIXED):
            launch(rank1_row_chunk_rowdecay_bwd_kernel, (N * H, NR), u, keys[3], a, c, p, d, hs, dy, dht,
                   dkeys[0], dkeys[3], da, *drows, dh0, mild, cu, T, B * T * H, FAST=ROW_DECAY_FAST,
                   PATH=path.value, **common)
    else:
        launch(rank1_row_chunk_bwd_kernel, (N * H, NR), *keys, a, c, cs, p, oc, d, ht, hs, dy.contiguous(), dht,
               *dkeys[:4], da, drows[0], dcs, *drows[1:], dh0, cu, T, B * T * H, ONE_KEY=single,
               HAS_A=a is not None, HAS_CS=cs is not None, CS_IS_A=cs_is_a, **common)
    dkeys = [None if g is None else key_sum(g, atomic) for g in dkeys]
    drows = [None if g is None else g if m[0] == 2 else g.sum(0).view(B, T, H) for g, m in zip(drows, modes)]
    heads = [None if g is None or g.dim() == 4 else g.sum(0).view(B, T, H) for g in (da, dcs)]
    return dkeys, da if per_row else heads[0], drows + [None] * (3 - len(drows)), dh0, heads[1]


class _Rank1RowChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, v, q, oq, a, c, p, oc, oh, h0, V, out_dtype, output_final_state, cu, N, cs):
        keys, rows = (u, v, q, oq), (c, p, oc, oh)
        training = any(isinstance(x, torch.Tensor) and x.requires_grad for x in (*keys, a, *rows, h0, cs))
        y, ht, d, hs, mild = _forward(keys, a, rows, h0, V, out_dtype, want_state=output_final_state,
                                      training=training, cu=cu, N=N, cs=cs)
        ctx.set_materialize_grads(False)
        ctx.row_consts = [None if isinstance(x, torch.Tensor) else x for x in (c, p, oc)]
        ctx.save_for_backward(*keys, a, *[x if isinstance(x, torch.Tensor) else None for x in (c, p, oc)], d, ht, hs,
                              cu, cs, mild)
        ctx.oh_dim = oh.dim() if isinstance(oh, torch.Tensor) else None
        ctx.out_dtype = out_dtype
        ctx.h0_dtype = None if h0 is None else h0.dtype
        # one tensor as the decay and c's factor (Gated Longhorn's alpha): one gradient, summed in the kernel
        ctx.cs_is_a = cs is not None and cs is a
        return y, (ht if output_final_state else None)

    @staticmethod
    def backward(ctx, dy, dht):
        u, v, q, oq, a, tc, tp, toc, d, ht, hs, cu, cs, mild = ctx.saved_tensors
        rows = [t if t is not None else k for t, k in zip((tc, tp, toc), ctx.row_consts)]
        if dy is None:
            dy = torch.zeros(*u.shape[:3], ht.shape[-1], device=u.device, dtype=torch.float32)
        need_dh0 = ctx.needs_input_grad[9]
        dkeys, da, drows, dh0, dcs = _backward((u, v, q, oq), a, rows, d, ht, hs, dy, dht, need_dh0, ctx.out_dtype,
                                               cu, cs, ctx.cs_is_a, mild)
        doh = None
        if ctx.oh_dim == 4:
            doh = dy
        elif ctx.oh_dim == 3:
            doh = dy.float().sum(-1)
        grads = [None if g is None or not isinstance(x, torch.Tensor) else g.to(x.dtype)
                 for g, x in zip((*dkeys, da, *drows, dcs), (u, v, q, oq, a, *rows[:3], cs))]
        return (*grads[:8], doh, None if dh0 is None else dh0.to(ctx.h0_dtype), None, None, None, None, None,
                grads[8])


def rank1_row_chunk(u, v, q, oq, c, p, oc=1.0, oh=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, out_dtype=None, a=None, c_scale=None):
    """``s_t,i = a s_{t-1,i} - c_i (s_{t-1,i} . u_t) v_t + p_i q_t``, ``y_t,i = oc_i (s_t,i . oq_t) + oh_i``
    (``rank1_row_recurrence`` with a per-head or per-row decay), chunked.

    Args:
        u, v, q, oq: ``[B, T, H, K]`` (the same tensor may fill several slots).
        a: the decay, ``[B, T, H]`` (per head), ``[B, T, H, V]`` (per row: one key, u = v = q, and a
            constant ``oc``), a float or None (no decay).
        c_scale: a per-head factor of c ``[B, T, H]`` or None: the step is c o c_scale, formed in the
            kernels (Gated Longhorn's alpha of u = alpha k, ``slots.fold_scaled_u``'s product, without its
            passes over ``[B, T, H, V]`` on the host); not with a per-row decay.
        c, p, oc, oh: ``[B, T, H, V]`` (per row), ``[B, T, H]`` (per head) or a float (``oh`` may be None).
        initial_state: ``[B, H, K, V]`` (FLA's layout) or None.
        cu_seqlens: offsets ``[N + 1]`` of N sequences packed in one row (B = 1); states are then
            ``[N, H, K, V]``.
    Returns ``y [B, T, H, V]`` (``out_dtype``, else the dtype of ``u``), the final state ``[B, H, K, V]`` fp32 or None."""
    V = next((x.shape[3] for x in (p, c, oc, oh) if isinstance(x, torch.Tensor) and x.dim() == 4), None)
    if V is None:
        if initial_state is None:
            raise ValueError("rank1_row_chunk: no per-row coefficient and no initial state give the row count V")
        V = initial_state.shape[-1]
    N = None
    if cu_seqlens is not None:
        N = cu_seqlens.numel() - 1
        cu_seqlens = cu_seqlens.to(torch.int32)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    keys = [x.contiguous() for x in (u, v, q, oq)]
    keys = [next(keys[j] for j in range(4) if (u, v, q, oq)[j] is x) for x in (u, v, q, oq)]
    rows = [x.contiguous() if isinstance(x, torch.Tensor) else x for x in (c, p, oc, oh)]
    if a is not None and not isinstance(a, torch.Tensor):
        a = None if float(a) == 1.0 else torch.full(u.shape[:3], float(a), device=u.device, dtype=torch.float32)
    if a is not None and a.dim() == 4:
        if not one_key(keys) or isinstance(oc, torch.Tensor):
            raise ValueError("rank1_row_chunk: a per-row decay a [B, T, H, V] takes one key (u, v and q one "
                             "tensor) and a constant readout scale oc")
    elif a is not None and a.dim() != 3:
        raise ValueError(f"rank1_row_chunk: the decay a must be per head [B, T, H] or per row [B, T, H, V], got "
                         f"shape {tuple(a.shape)}")
    a = None if a is None else a.contiguous()
    if c_scale is not None and a is not None and a.dim() == 4:
        raise ValueError("rank1_row_chunk: c_scale with a per-row decay: pass c times c_scale as c")
    return _Rank1RowChunkFunction.apply(*keys, a, *rows, h0, V, io_dtype(out_dtype or u.dtype), output_final_state,
                                        cu_seqlens, N, None if c_scale is None else c_scale.contiguous())


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def _decay(ir):
    """The IR's decay coefficient, or None where there is none (``a == 1``)."""
    a = ir.coefficient("a") if ir.kind == "rank1" else None
    return None if a is None or (tuple(a.dims) == () and a.expr == 1) else a


def _one_key_reason(ir) -> str | None:
    """Why the keys of ``ir`` are not one tensor in the kernels (u, v and q the same input, u perhaps
    times a per-head scale, which ``slots.fold_scaled_u`` folds into c), or None."""
    from ssmcraft.ops.common.slots import bindings
    b = bindings(ir)
    v, q, u = b.get("v"), b.get("q"), b.get("u")
    if v is None or v.kind != "leaf" or q != v or not (u == v or (u.kind == "scaled" and u.leaf == v.leaf)):
        return "u, v and q are not one key input (u may carry a per-head scale)"
    return None


def supports(ir) -> str | None:
    """None if this family runs ``ir``: what ``rank1_row`` runs (a rank-1 update, step ``c`` and input
    ``p`` per row or per head, one key per slot shared by the rows, the readout ``oc (S oq) + oh``)
    with no decay, a per-head one, or a per-row one where the keys are one input and ``oc`` a
    constant (``rowdecay.py``); else the reason."""
    a = _decay(ir)
    if a is not None and tuple(a.dims) not in ((), (ir.dims[0],)):
        return f"a decay per key (a varies over {a.dims}): this family runs a per-head or per-row decay"
    if a is not None and tuple(a.dims) == (ir.dims[0],):
        oc = ir.coefficient("oc")
        why = _one_key_reason(ir) or (None if oc is None or tuple(oc.dims) == () and oc.expr.is_number
                                      else "the readout scale oc is not a constant")
        if why is not None:
            return f"a per-row decay runs with one key and a constant readout scale only: {why}"
    return rank1_row_supports(ir)


def supports_sizes(ir, sizes: dict, mode: str) -> str | None:
    """On CUDA, refuse keys fewer than ``MIN_KEYS`` (``rank1_row``, next in the order, was measured
    faster there and runs everything this family does); the interpreter takes any size."""
    return few_keys_reason(ir, sizes, mode, MIN_KEYS, "rank1_row")


def supports_inputs(ir, inputs, mode) -> str | None:
    """``supports_sizes`` on the sizes of these inputs (the Triton backend's hook)."""
    return supports_sizes(ir, key_sizes(ir, inputs), mode)


def per_row_step(ir) -> bool:
    """Where this family goes ahead of ``rank1_row`` on CUDA: what it supports with a step per row (a
    per-head step runs on ``rank1_chunk``, which goes ahead of both), with a per-head decay only where
    ``DECAY_AHEAD``, with a per-row one only where ``ROW_DECAY_AHEAD``."""
    if supports(ir) is not None or ir.is_per_head_step():
        return False
    a = _decay(ir)
    return a is None or (ROW_DECAY_AHEAD if tuple(a.dims) else DECAY_AHEAD)


def forward(obj, lay, co, output_final_state):
    """Run the family on laid-out coefficients ``co`` (slot -> [B|1, T|1, H|1, r, c] or number).
    Returns (y [B, T, H, d] in lay.dtype, S_T [B, H, d, m] fp32 or None)."""
    ir = obj.ir
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    d_dim = ir.dims[0]
    ref = next(x for x in co.values() if isinstance(x, torch.Tensor))
    keys = {}
    for slot in KEY_SLOTS:
        x = co[slot]
        same = next((keys[s] for s in keys if co[s] is x and isinstance(x, torch.Tensor)), None)
        keys[slot] = same if same is not None else (
            x.expand(B, T, H, 1, m).reshape(B, T, H, m) if isinstance(x, torch.Tensor)
            else torch.full((B, T, H, m), float(x), device=ref.device, dtype=ref.dtype))
    rows = []
    for slot in ROW_SLOTS:
        x = co.get(slot, 1.0 if slot == "oc" else None)
        if isinstance(x, torch.Tensor):      # laid out [B|1, T|1, H|1, d|1, 1]: per row, or per head
            x = (x.expand(B, T, H, d, 1).reshape(B, T, H, d) if tuple(ir.coefficient(slot).dims) == (d_dim,)
                 else _per_head(x, B, T, H, x.device))
        rows.append(float(x) if isinstance(x, (int, float)) else x)
    a = co.get("a", 1.0)
    if isinstance(a, torch.Tensor):
        a = (a.expand(B, T, H, d, 1).reshape(B, T, H, d) if tuple(ir.coefficient("a").dims) == (d_dim,)
             else _per_head(a, B, T, H, a.device))
    else:
        a = float(a)
    h0 = None if lay.S0 is None else lay.S0.transpose(-1, -2)
    y, ST = rank1_row_chunk(*keys.values(), *rows, initial_state=h0, output_final_state=output_final_state, a=a)
    return y.to(lay.dtype), (None if ST is None else ST.transpose(-1, -2))


def prepare(obj, lay):
    """The family's runner for one call signature: key slots go to the kernels as the caller's tensors
    (Longhorn's ``u = v = q = k`` is one tensor), computed row coefficients (Longhorn's
    ``c = beta / (1 + beta k.k)``, ``p = c x``) from ``slots.computed_path``.
    Returns ``fn(inputs, params, initial_state, output_final_state, cu_seqlens=None)``."""
    from ssmcraft.ops.common.slots import fold_scaled_u, scaled_u, slot_runner
    from ssmcraft.ops.common.varlen import check
    out_dtype = io_dtype(lay.out_dtype)

    def run(cs, initial_state, output_final_state, cu_seqlens=None):
        keys = [cs.get(s) for s in KEY_SLOTS[1:]]
        rows = [cs.get(s, 1.0 if s == "oc" else None) for s in ROW_SLOTS]
        a = cs.get("a", 1.0)
        c_scale = None
        if SCALE_IN_KERNEL and not (isinstance(a, torch.Tensor) and a.dim() == 4):
            u, c_scale = scaled_u(cs, keys)                  # the kernels form c o s
        else:                                                # c o s formed here (the per-row kernels take it)
            u, rows[0] = fold_scaled_u(cs, keys, rows[0])
        keys = [u, *keys]
        if cu_seqlens is not None:
            check(obj.name, cu_seqlens, cs.inputs, initial_state)
        h0 = None if initial_state is None else initial_state.transpose(-1, -2)
        y, ST = rank1_row_chunk(*keys, *rows, initial_state=h0, output_final_state=output_final_state,
                                cu_seqlens=cu_seqlens, out_dtype=out_dtype, a=a, c_scale=c_scale)
        return y.to(lay.out_dtype), (None if ST is None else ST.transpose(-1, -2))
    return slot_runner(obj, lay, run)
