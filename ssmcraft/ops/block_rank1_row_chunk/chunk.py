"""Chunked block rank-1 recurrences (``ssmcraft.compiler.blockrank1``: Longhorn with momentum) whose
state weights are per head: host side, autograd function and the family interface.

The recurrence (``ssmcraft.ops.block_rank1_row``), row i of each of the two states ``x_a`` [m]::

    U = sum_b e_b x_b,   z = U . u,   R = p q - c z v,   x_a' = sum_b A_ab x_b + w_a R,   y = (sum_a r_a x_a') . oq

with ``A_ab, e_b, w_a, r_a`` per head (``[B, T, H]``) or constant, ``c, p`` per row or per head and
``u, v, q, oq`` shared by the rows of a head. The joint update is linear in the states, so over a chunk
of C tokens from the start states ``X_0``, with ``Phi`` the chunk's products of transitions and the
per-head weights of ``weights.py`` (``G, g, Hm, h, E, F``), the per-row scalars ``z`` solve one unit
lower-triangular system per row, the matrices shared by the rows of a head (``D = c o z``, [C, R])::

    z + M D = g0 o (U X0_0) + g1 o (U X0_1) + Mq P      M = (U V^T) o G, Mq = (U Q^T) o G  (strict)
    Y = h0 o (OQ X0_0) + h1 o (OQ X0_1) + Lq P - Lv D   Lv = (OQ V^T) o Hm, Lq = (OQ Q^T) o Hm (incl.)
    X_a,C = F_a0 X0_0 + F_a1 X0_1 + (Q o E_a)^T P - (V o E_a)^T D

the chunked per-row rank-1 system (``ssmcraft.ops.rank1_row_chunk``) with a general per-head weight in
place of its decay factors. One program per (batch * head, block of R rows) walks the chunks with both
state tiles in registers (``kernels.py``); the forward of a training step stores each chunk's start
states (fp32, or bf16 at bf16 I/O: ``STATES_BF16``) and D. The backward walks the chunks in reverse from
them (``W`` the adjoint of the substitution's right side, ``dO`` of the outputs, ``dX_a`` of the chunk's
end states)::

    gD = -Lv^T dO - sum_a E_a o (V dX_a);   (I + c o M^T) W = c o gD      (backward substitution)
    dc = z o (gD - M^T W),   dp = Mq^T W + Lq^T dO + sum_a E_a o (Q dX_a)
    dM = -strict(W D^T), dMq = strict(W P^T), dLv = -incl(dO D^T), dLq = incl(dO P^T)
    dG = dM o (U V^T) + dMq o (U Q^T),  dHm = dLv o (OQ V^T) + dLq o (OQ Q^T),  dg_b = rows(W o U X0_b),
    dh_b = rows(dO o OQ X0_b),  dE_a = rows(P o Q dX_a - D o V dX_a),  dF_ab = sum(dX_a o X0_b)
    dX0_b = sum_a F_ab dX_a + U^T (g_b o W) + OQ^T (h_b o dO)

(``rows``: summed over the rows), and the keys' gradients as ``rank1_row_chunk``'s with the weighted
matrices. Only the ``dX`` recurrence is sequential (W's substitution and the last line): with
``SPLIT_BWD`` one walk carries just that and stores each chunk's ``dX_a``, and the rest runs with one
program per chunk. The weights' and keys' gradients are sums over the rows: each row block adds its share into one
zeroed buffer (``ATOMIC_SUMS``) or writes its own slice, summed on the host; torch autograd takes the
weights' through ``weights.chunk_weights`` (its kernels' backward) to the per-head coefficients (Longhorn
with momentum's mu). The per-head row coefficients' gradients are per-block slices summed on the host.
"""
from __future__ import annotations

import torch

from ssmcraft.ops.block_rank1_row.recurrent import supports as block_rank1_row_supports
from ssmcraft.ops.block_rank1_row_chunk.kernels import (block_chunk_bwd_kernel, block_chunk_bwd_state_kernel,
                                                        block_chunk_fwd_kernel)
from ssmcraft.ops.block_rank1_row_chunk.weights import chunk_weights
from ssmcraft.ops.common.chunked import few_keys_reason, key_sizes
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.slots import row_mode
from ssmcraft.ops.common.tuning import INTERPRET, buffer, cdiv, dot_precision, io_dtype, pow2
from ssmcraft.ops.rank1_row_chunk.chunk import key_sum, one_key

BACKEND_NAME = "block-rank1-row-chunk"
POISON = False        # tests: fill every output buffer with NaN before the kernels write it
# Figures below: one H200, bf16, B=8 T=2048 H=16 d=m=64, Longhorn with momentum's fwd+bwd through obj(),
# all in one process (DeltaNet 0.680 ms, Longhorn 2.576 there): ``benchmarks/bench_block_rank1_row_chunk.py
# --no-per-token``, each setting named in ``--configs``.
# Whether the family goes ahead of block_rank1_row on CUDA, read at dispatch time: 5.07 ms here against
# 7.26 on block_rank1_row (another process: ``--configs default``); 4.64 ms here with the defaults below.
AHEAD = True
# The smallest key size at which it goes ahead: with few keys the per-token loop wins, as for one state
# (``rank1_row_chunk.MIN_KEYS``, whose K = 32 measurement sets this one's too). Measured, one H200, bf16,
# B=8 T=2048 H=24 K=16 V=64, fwd+bwd through obj(), one process: 4.843 ms here, 3.707 on block_rank1_row
# (``bench_block_rank1_row_chunk.py --no-check --shape 8,2048,24,16,64``)
MIN_KEYS = 64
# The backward's key and weight gradients (sums over the row blocks): True, the row blocks of a head add
# into one zeroed fp32 buffer each (atomics in L2; with two row blocks, 0 + x + y, the same sum in either
# order); False, each stores its slice [NR, ...] and the host sums them (eight reduces, ~205 us in an
# earlier profile). With STATES_BF16: 4.641 ms; both off: 4.720 (the two not timed apart).
ATOMIC_SUMS = True
# The backward in two passes: True, a sequential walk that carries only the state adjoints (W's
# substitution and the adjoints' products per chunk: ``kernels.block_chunk_bwd_state_kernel``, its
# programs STATE_ROWS rows x STATE_WARPS) and stores each chunk's end-state adjoints (as much memory as
# the forward's start states), then every gradient with one program per (chunk, GRAD_ROWS rows)
# (``block_chunk_bwd_kernel``'s ``PER_CHUNK``); False, one walk forms everything (B*H*V/ROWS programs).
# Sequences of one chunk take the single walk. Measured slower: 4.909 ms split (the state walk 942 us, the
# per-chunk gradients 2312 us: their products, not the walk's latency, are the cost) against 4.641 in one
# walk; split with 16 gradient rows 6.538, 8 warps 6.810, 64 rows x 8 warps 5.432, fp32 states 5.795.
SPLIT_BWD = False
STATE_ROWS = 32
STATE_WARPS = 4
GRAD_ROWS = 32
GRAD_WARPS = 4
# The chunk states one pass hands the next (the forward's start states for the backward, the state pass's
# end-state adjoints for the gradients' programs), at bf16 I/O: True, stored bf16 (half the traffic of
# the largest buffers: 512 MiB each in fp32 at the shape above); False, fp32. Each walk carries its
# states in fp32 registers, so the rounding enters one chunk's gradients and does not accumulate; fp32
# I/O keeps fp32. Split backward: 4.909 ms against 5.795 with fp32 states; its bf16 check against float64
# (``bench_block_rank1_row_chunk.py``, B2 T1000 H2 d=m=64) worst 2.27e-2 (S_T), within TOL_CHUNKED's 3e-2.
STATES_BF16 = True
CHUNK = 16            # tokens per chunk
ROWS = 32             # state rows per program (tl.dot needs >= 16)
NUM_WARPS = 4
# the per-head state weights: the transition, the extrapolation, the write and the read
HEAD_SLOTS = ("a00", "a01", "a10", "a11", "e0", "e1", "w0", "w1", "ro0", "ro1")
ROW_SLOTS = ("c", "p")
KEY_SLOTS = ("u", "v", "q", "oq")
DEFAULTS = {"a00": 1.0, "a01": 0.0, "a10": 0.0, "a11": 1.0, "e0": 0.0, "e1": 1.0, "w0": 1.0, "w1": 1.0, "ro0": 0.0,
            "ro1": 1.0}


def config() -> tuple[int, int, int]:
    """(C, R, num_warps): the module's constants; one warp under the interpreter."""
    return CHUNK, ROWS, 1 if INTERPRET else NUM_WARPS


def _new(shape, device, dtype=torch.float32):
    return buffer(shape, device, dtype, POISON)


def states_dtype(out_dtype) -> torch.dtype:
    """The dtype of the chunk states the passes hand on (``STATES_BF16``)."""
    return torch.bfloat16 if STATES_BF16 and out_dtype == torch.bfloat16 else torch.float32


def atomic_sums(NR: int) -> bool:
    """Whether the backward's row blocks add their key and weight gradients into one buffer (``ATOMIC_SUMS``)."""
    return ATOMIC_SUMS and NR > 1


def sum_buf(shape, NR: int, atomic: bool, dev):
    """A gradient the row blocks sum: zeros they add into (``atomic``), else one slice per block
    ``[NR, *shape]``; ``rank1_row_chunk.chunk.key_sum`` takes it to the sum."""
    return torch.zeros(tuple(shape), device=dev) if atomic else _new((NR, *shape), dev)


class _BlockChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, v, q, oq, c, p, Gw, Hw, gw, hw, Ew, Fw, h0, V, out_dtype, output_final_state):
        """keys [B, T, H, K]; c, p per ``slots.row_mode``; the weights ``[B, H, NC, ...]`` fp32
        (``weights.chunk_weights``); h0 [B, H, 2, K, V] fp32 or None. Returns y [B, T, H, V] (``(sum_a r_a X_a)
        oq``) and the final states [B, H, 2, K, V] fp32 (or None)."""
        B, T, H, K = u.shape
        dev = u.device
        C, R, nw = config()
        NC = Gw.shape[2]
        rows = (c, p)
        modes = [row_mode(x) for x in rows]
        training = any(isinstance(x, torch.Tensor) and x.requires_grad
                       for x in (u, v, q, oq, c, p, Gw, Hw, gw, hw, Ew, Fw, h0))
        y = _new((B, T, H, V), dev, out_dtype)
        ht = _new((B, H, 2, K, V), dev) if (output_final_state or training) else None
        d = _new((B, T, H, V), dev) if training else None
        hs = _new((B, H, NC, 2, K, V), dev, states_dtype(out_dtype)) if training else None
        launch(block_chunk_fwd_kernel, (B * H, cdiv(V, R)), u, v, q, oq, *[m[2] for m in modes], Gw, Hw, gw, hw, Ew,
               Fw, h0, y, ht, d, hs, T, NC, H=H, K=K, V=V, C=C, R=R, BK=pow2(K), MODES=tuple(m[0] for m in modes),
               CONSTS=tuple(m[1] for m in modes), HAS_H0=h0 is not None, STORE_HT=ht is not None, TRAINING=training,
               PREC=dot_precision(out_dtype), ONE_KEY=one_key((u, v, q)), num_warps=nw)
        ctx.set_materialize_grads(False)
        ctx.row_consts = [None if isinstance(x, torch.Tensor) else x for x in rows]
        ctx.save_for_backward(u, v, q, oq, *[x if isinstance(x, torch.Tensor) else None for x in rows],
                              Gw, Hw, gw, hw, Ew, Fw, d, hs)
        ctx.meta = (V, out_dtype, None if h0 is None else h0.dtype)
        return y, (ht if output_final_state else None)

    @staticmethod
    def backward(ctx, dy, dht):
        u, v, q, oq, tc, tp, Gw, Hw, gw, hw, Ew, Fw, d, hs = ctx.saved_tensors
        V, out_dtype, h0_dtype = ctx.meta
        rows = [t if t is not None else k for t, k in zip((tc, tp), ctx.row_consts)]
        B, T, H, K = u.shape
        dev = u.device
        C, R, nw = config()
        NC, NW = Gw.shape[2], B * H * Gw.shape[2]
        split = SPLIT_BWD and T > C
        # the gradients' programs: per (batch * head * chunk, row block) after the state pass, else the walk's
        RG, nwg = (GRAD_ROWS, 1 if INTERPRET else GRAD_WARPS) if split else (R, nw)
        NR = cdiv(V, RG)
        if dy is None:
            dy = torch.zeros(B, T, H, V, device=dev, dtype=torch.float32)
        dy = dy.contiguous()
        dht = None if dht is None else dht.float().contiguous()
        modes = [row_mode(x) for x in rows]
        mode_kw = dict(H=H, K=K, V=V, C=C, BK=pow2(K), MODES=tuple(m[0] for m in modes),
                       CONSTS=tuple(m[1] for m in modes), PREC=dot_precision(out_dtype), ONE_KEY=one_key((u, v, q)))

        def row_buf(mode):
            return _new((B, T, H, V), dev) if mode == 2 else _new((NR, B * T * H), dev) if mode == 1 else None
        # one key in three slots: its one gradient (the three slots' sum) in du, none for v and q
        atomic = atomic_sums(NR)
        dkeys = [None if mode_kw["ONE_KEY"] and slot in ("v", "q") else sum_buf((B, T, H, K), NR, atomic, dev)
                 for slot in KEY_SLOTS]
        drows = [row_buf(m[0]) for m in modes]
        dws = [sum_buf(x.shape, NR, atomic, dev) for x in (Gw, Hw, gw, hw, Ew, Fw)]
        need_dh0 = ctx.needs_input_grad[12]
        dh0 = _new((B, H, 2, K, V), dev) if need_dh0 else None
        dxs = None
        if split:
            dxs = _new(hs.shape, dev, hs.dtype)
            launch(block_chunk_bwd_state_kernel, (B * H, cdiv(V, STATE_ROWS)), u, v, oq, modes[0][2], Gw, Hw, gw, hw,
                   Ew, Fw, dy, dht, dxs, dh0, T, NC, R=STATE_ROWS, HAS_DHT=dht is not None,
                   STORE_DH0=need_dh0, num_warps=1 if INTERPRET else STATE_WARPS, **mode_kw)
        launch(block_chunk_bwd_kernel, (B * H * NC if split else B * H, NR), u, v, q, oq, *[m[2] for m in modes], Gw,
               Hw, gw, hw, Ew, Fw, d, hs, dy, dht, dxs, *dkeys, *drows, *dws, dh0, T, NC, B * T * H, NW, R=RG,
               HAS_DHT=dht is not None, STORE_DH0=need_dh0, ATOMIC=atomic, PER_CHUNK=split, num_warps=nwg, **mode_kw)
        dkeys = [None if g is None else key_sum(g, atomic).to(x.dtype) for g, x in zip(dkeys, (u, v, q, oq))]
        drows = [None if g is None or not isinstance(x, torch.Tensor) else
                 (g if m[0] == 2 else g.sum(0).view(B, T, H)).to(x.dtype) for g, m, x in zip(drows, modes, rows)]
        dws = [key_sum(g, atomic) for g in dws]
        return (*dkeys, *drows, *dws, None if dh0 is None else dh0.to(h0_dtype), None, None, None)


def block_rank1_chunk(u, v, q, oq, c, p, heads: dict, initial_state=None, output_final_state=False,
                      out_dtype=None):
    """Two states, row ``i`` of each (FLA layout: the states are ``[B, H, K, V]``), chunked::

        U = e0 x0 + e1 x1,  z = U . u,  R = p q - c z v,  x_a' = a_a0 x0 + a_a1 x1 + w_a R,  o = (r0 x0' + r1 x1') . oq

    Args:
        u, v, q, oq: ``[B, T, H, K]``.
        c, p: ``[B, T, H, V]`` (per row), ``[B, T, H]`` (per head) or a number.
        heads: slot -> ``[B, T, H]`` (per head) or a number, for ``a00 a01 a10 a11 e0 e1 w0 w1 ro0 ro1``
            (absent: ``DEFAULTS``: A the identity, ``e = (0, 1)``, ``w = (1, 1)``, ``r = (0, 1)``).
        initial_state: a pair of ``[B, H, K, V]`` or None.
    Returns ``o [B, T, H, V]`` (``out_dtype``, else the dtype of ``u``) and the final pair (fp32) or None."""
    unknown = set(heads) - set(HEAD_SLOTS)
    if unknown:
        raise ValueError(f"block_rank1_chunk: unknown per-head slots {sorted(unknown)}; known: {', '.join(HEAD_SLOTS)}")
    B, T, H, K = u.shape
    val = {s: heads.get(s, DEFAULTS[s]) for s in HEAD_SLOTS}
    for s, x in val.items():
        if isinstance(x, torch.Tensor) and tuple(x.shape) != (B, T, H):
            raise ValueError(f"block_rank1_chunk: slot {s!r} must be per head [B, T, H] = {[B, T, H]}, "
                             f"got {list(x.shape)}")
    V = next((x.shape[3] for x in (c, p) if isinstance(x, torch.Tensor) and x.dim() == 4), None)
    if V is None:
        if initial_state is None:
            raise ValueError("block_rank1_chunk: no per-row coefficient and no initial state give the row count V")
        V = initial_state[0].shape[-1]
    C = config()[0]
    weights = chunk_weights([[val["a00"], val["a01"]], [val["a10"], val["a11"]]], (val["e0"], val["e1"]),
                            (val["w0"], val["w1"]), (val["ro0"], val["ro1"]), B, T, H, C, u)
    weights = [x.contiguous() for x in weights]
    keys = [x.contiguous() for x in (u, v, q, oq)]
    keys = [next(keys[j] for j in range(4) if (u, v, q, oq)[j] is x) for x in (u, v, q, oq)]
    rows = [x.contiguous() if isinstance(x, torch.Tensor) else x for x in (c, p)]
    h0 = None if initial_state is None else torch.stack(tuple(initial_state), 2).float().contiguous()
    y, ST = _BlockChunkFunction.apply(*keys, *rows, *weights, h0, V, io_dtype(out_dtype or u.dtype),
                                      output_final_state)
    return y, (None if ST is None else tuple(ST.unbind(2)))


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if this family runs ``ir``: what ``block_rank1_row`` runs (the block form with two states, an
    input term ``p q^T``, row slots per row or per head, ``u, v, q, oq`` vectors over the columns) with
    the state weights (transition, extrapolation, write, read) per head or constant; else the reason."""
    why = block_rank1_row_supports(ir)
    if why is not None:
        return why
    for slot in HEAD_SLOTS:
        co = ir.coefficient(slot)
        if co is not None and tuple(co.dims) != ():
            return (f"slot {slot!r} varies over {co.dims}: this family takes the state weights per head "
                    f"(the chunk's products of transitions are shared by the rows)")
    return None


def supports_sizes(ir, sizes: dict, mode: str) -> str | None:
    """On CUDA, refuse keys fewer than ``MIN_KEYS`` (``block_rank1_row`` runs them, and everything this
    family does)."""
    return few_keys_reason(ir, sizes, mode, MIN_KEYS, "block_rank1_row")


def supports_inputs(ir, inputs, mode) -> str | None:
    """``supports_sizes`` on the sizes of these inputs (the Triton backend's hook)."""
    return supports_sizes(ir, key_sizes(ir, inputs), mode)


def ahead(ir) -> bool:
    """Where this family goes ahead of ``block_rank1_row`` on CUDA: what it supports, where ``AHEAD``."""
    return AHEAD and supports(ir) is None


def prepare(obj, lay):
    """The family's runner for one call signature: key slots as the caller's tensors, computed ones
    (Longhorn with momentum's ``c = beta / (1 + beta k.k)``, ``p = c x``) from ``slots.computed_path``;
    the readout's ``oc, oh`` on the host (``CallSlots.finish``). Returns ``fn(inputs, params,
    initial_state, output_final_state)``, states a tuple of ``[B, H, d, m]`` (declaration order)."""
    from ssmcraft.ops.common.slots import slot_runner
    out_dtype = io_dtype(lay.out_dtype)

    def run(cs, initial_state, output_final_state):
        keys = [cs.get(s) for s in KEY_SLOTS]
        heads = {s: cs.get(s, DEFAULTS[s]) for s in HEAD_SLOTS}
        h0 = None if initial_state is None else tuple(s.transpose(-1, -2) for s in initial_state)
        o, ST = block_rank1_chunk(*keys, cs.get("c"), cs.get("p"), heads, initial_state=h0,
                                  output_final_state=output_final_state, out_dtype=out_dtype)
        y = cs.finish(o).to(lay.out_dtype)
        return y, (None if ST is None else tuple(s.transpose(-1, -2) for s in ST))
    return slot_runner(obj, lay, run)
