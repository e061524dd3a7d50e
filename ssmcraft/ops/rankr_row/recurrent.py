"""Diagonal-plus-rank-r recurrences with per-row (or per-head) factors: the ``rankr`` IR kind.

Several keys or regression terms (``objectives/longhorn_2key.yaml``, Woodbury updates, explicit
steps on several keys). Row ``i`` of the state ``S [V, K]`` (math layout ``[d, m]``; the
public state is FLA's ``[B, H, K, V]``)::

    z_l,i = s_{t-1,i} . u_l                               (L <= 4 scalars per row)
    s_t,i = a_i s_{t-1,i} - sum_{r,l} c_rl,i z_l,i v_r + B_i
    y_t,i = oc_i (s_t,i . oq) + oh_i

Without a decay (``a == 1``: ``longhorn_2key``), with the input term in the span of the ``v_r``
and key slots over the key dimension, the family runs its own kernels
(``rankr_row_kernels``: ``rank1_row``'s layout and exact reconstruction of ``s_{t-1}`` from the
stored ``z_l``, generalised to L, R <= 4 with the per-step work unrolled at compile time; backend
``rankr-row+<computed slots' path>``). Any other rank-r update runs
``ssmcraft.ops.general.recurrent``'s fused sequential generator row-tiled (backend ``rankr-row``): one program per (batch*head, block of ``BV`` rows), the state tile
``[BK, BV]`` in registers, a loop over time; the update is printed from the IR's slots in
element form (``ssmcraft.compiler.structure.element_form``) with every coefficient (the
Woodbury ``c_rl``, e.g.) inlined by the Triton printer, and the backward is the symbolically derived adjoint of that step
(checkpoints every ``general.CHUNK`` steps, recomputed into scratch). Gradients of leaves
shared by the rows (keys, per-head values) are written per row block and summed on the host.

Why per-row and not chunked: as for ``rank1_row`` (see its docstring and BENCHMARKS.md), a
chunked form multiplies the per-row work by K (a K x K transition product per row and
segment instead of L K-vector dot products), and Longhorn-style shapes (V = 1536, K = 16)
already give hundreds of programs; the per-row step costs O(L K) per row, L + R dot
products, the same order as the rank-1 kernel.
"""
from __future__ import annotations

import torch

from ssmcraft.ops.general import recurrent as general
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.slots import row_mode
from ssmcraft.ops.rank1_row.recurrent import (_config, _dedup_contig, _prefetch_distance, checkpoints,
                                              sequences)
from ssmcraft.ops.rankr_row.kernels import rankr_row_bwd_kernel, rankr_row_fwd_kernel
from ssmcraft.ops.common.tuning import INTERPRET, buffer, cdiv, io_dtype, next_pow2

BACKEND_NAME = "rankr-row"
ROW_BLOCK: int | None = None      # rows per program; None: by rule (tests set it to tile rows)
CHUNK = 64                        # checkpoint interval of the own kernels' backward (steps)
POISON = False                    # tests: fill the own kernels' outputs with NaN first
# the own backward's K-vector gradients: True, every row block of a head adds into one fp32
# [NKV, B, T, H, K] buffer (atomics in L2, ``rank1_row``'s ``ATOMIC_SUMS``); False, each stores its
# partial in [NV, NKV, B, T, H, K] and the host sums the NV partials (at d = m = 64, 8 row blocks:
# 1.6 GB written and read again). H200, bf16 longhorn_2key at B=8 T=2048 H=16, fwd+bwd through obj(),
# one process (BENCHMARKS.md): 5.17 ms with atomics, 5.65 without (the host sum alone 0.46 ms)
ATOMIC_SUMS = True


def supports(ir) -> str | None:
    """None if ``ir`` runs on this family's kernel, else the reason."""
    if ir.kind != "rankr":
        return f"not a rank-r update ({ir.kind})"
    try:
        step, _, _ = general._module(ir)
    except NotImplementedError as e:
        return f"cannot print the update for Triton: {e}"
    over_rows = general.row_sums(step)
    if over_rows:
        return f"the step sums over the rows ({', '.join(over_rows)}), so rows cannot be tiled"
    return None


def generated_source(ir) -> str | None:
    """The generated row-tiled kernel where it runs ``ir`` (``ssmcraft derive SPEC --kernel``); None
    where the family's own kernels run it: then what is generated for ``ir`` is the prologue of its
    computed slots (``ssmcraft.runtime.select.kernel_source``)."""
    return general.generated_source(ir) if own_kernel_reason(ir) is not None else None


def row_block(V: int, K: int) -> int:
    """Rows per program: all rows under the interpreter (fewest programs), else a tile of
    about 1024 fp32 state values per program (H200, ``longhorn_2key`` at K=16, bf16: fwd+bwd
    36 ms with 64 rows, 52 ms with 128, 39-40 ms with 16-32; the forward is 4.6-5.3 ms at any
    block; BENCHMARKS.md, "Several states and rank-r")."""
    full = next_pow2(V)
    if ROW_BLOCK is not None:
        return min(ROW_BLOCK, full)
    if INTERPRET:
        return full
    return min(full, max(16, 1024 // next_pow2(K)))


def own_kernel_reason(ir) -> str | None:
    """None if the family's own kernels (``rankr_row_kernels``) run ``ir``, else why the generated
    row-tiled kernel runs it instead."""
    d, m = ir.dims
    a = ir.coefficient("a")
    if a is not None and not (a.expr.is_number and float(a.expr) == 1.0):
        return "a decay (a != 1): s_{t-1} cannot be rebuilt from s_t without dividing by it"
    if "B" in ir.slots:
        return "the input term is not in the span of the v_r"
    L, R = ir.ranks()
    for slot in [f"u{l}" for l in range(L)] + [f"v{r}" for r in range(R)] + ["oq"]:
        co = ir.coefficient(slot)
        if co is None or tuple(co.dims) != (m,):
            return f"slot {slot!r} is not a key vector"
    for slot in ir.erase_slots() + ir.input_slots() + ["oc", "oh"]:
        co = ir.coefficient(slot)
        if co is not None and tuple(co.dims) not in ((), (d,)):
            return f"slot {slot!r} varies over {co.dims}"
    return None


def _new(shape, device, dtype=torch.float32):
    return buffer(shape, device, dtype, POISON)


def _block(V, K, which):
    return (ROW_BLOCK, 1) if ROW_BLOCK is not None else _config(which, 1, V, K)


def _distinct(vecs):
    """(distinct tensors, index of each of ``vecs`` among them), by identity."""
    kv, index = [], []
    for x in vecs:
        j = next((i for i, y in enumerate(kv) if y is x), None)
        if j is None:
            kv.append(x)
            j = len(kv) - 1
        index.append(j)
    return kv, index


class _RankRRowFunction(torch.autograd.Function):
    """``items``: u_0..u_{L-1}, v_0..v_{R-1}, oq ([B,T,H,K] tensors), c_00..c_{R-1,L-1} (row-major),
    p_0..p_{R-1}, oc, oh (each [B,T,H,V], [B,T,H] or a number), then S0 ([B,H,V,K] or None).
    ``packed``: the ``varlen.Chunks`` of a packed row at ``CHUNK`` (``rank1_row``'s ``packing``;
    B = 1, S0 and S_T [N, ...]) or None."""

    @staticmethod
    def forward(ctx, L, R, V, out_dtype, output_final_state, packed, *items):
        vecs, c, p = items[:L + R + 1], items[L + R + 1:L + R + 1 + R * L], items[L + R + 1 + R * L:L + R + 1 + R * L + R]
        oc, oh, S0 = items[-3:]
        kv, index = _distinct(vecs)
        B, T, H, K = kv[0].shape
        dev = kv[0].device
        training = any(isinstance(x, torch.Tensor) and x.requires_grad for x in items)
        BV, nw = _block(V, K, "fwd")
        N, NC, flag, seq = sequences(B, T, CHUNK, packed)
        cm, cc, ct = _modes_of(c)
        pm, pc, pt = _modes_of(p)
        om, occ, ot = _modes_of((oc, oh))
        y = _new((B, T, H, V), dev, out_dtype)
        ST = _new((N, H, K, V), dev) if (output_final_state or training) else None
        Z = _new((L, B, T, H, V), dev) if training else None
        CK = checkpoints(B, H, NC, K, V, packed, dev) if training else None
        s0 = S0.transpose(-1, -2).contiguous() if S0 is not None else None      # [N, H, K, V]
        if T > 0:
            launch(rankr_row_fwd_kernel, (N * H, cdiv(V, BV)), tuple(kv), tuple(ct), tuple(pt), ot[0], ot[1], s0,
                   y, ST, Z, CK, *seq, T, H, V, K, NC, B * T * H * V,
                   BV=BV, BK=next_pow2(K), CHUNK=CHUNK, PF=_prefetch_distance(), NKV=len(kv), L=L, R=R,
                   UI=tuple(index[:L]), VI=tuple(index[L:L + R]), OQI=index[L + R], CM=cm, CC=cc, PM=pm, PC=pc,
                   OM=om, OCC=occ, num_warps=nw, **flag)
        elif ST is not None:
            ST.copy_(s0 if s0 is not None else torch.zeros_like(ST))
        consts = [None if isinstance(x, torch.Tensor) else x for x in (*c, *p, oc)]
        oh_dim = oh.dim() if isinstance(oh, torch.Tensor) else None
        ctx.meta = (L, R, V, index, consts, oh_dim, S0 is not None, S0.dtype if S0 is not None else None,
                    [x.dtype if isinstance(x, torch.Tensor) else None for x in items])
        ctx.save_for_backward(*kv, *[x if isinstance(x, torch.Tensor) else None for x in (*c, *p, oc)], Z, CK, ST)
        ctx.packed = packed
        return y, (ST.transpose(-1, -2) if output_final_state else None)

    @staticmethod
    def backward(ctx, dy, dST):
        L, R, V, index, consts, oh_dim, has_s0, s0_dtype, dtypes = ctx.meta
        saved = ctx.saved_tensors
        nkv = max(index) + 1
        kv = saved[:nkv]
        rows = [t if t is not None else k for t, k in zip(saved[nkv:nkv + R * L + R + 1], consts)]
        c, p, oc = rows[:R * L], rows[R * L:R * L + R], rows[-1]
        Z, CK, ST = saved[-3:]
        B, T, H, K = kv[0].shape
        dev = kv[0].device
        BV, nw = _block(V, K, "bwd")
        NV = cdiv(V, BV)
        N, NC, flag, seq = sequences(B, T, CHUNK, ctx.packed)
        if dy is None:
            dy = torch.zeros(B, T, H, V, device=dev)
        cm, cc, ct = _modes_of(c)
        pm, pc, pt = _modes_of(p)
        om, occ, ot = _modes_of((oc, None))

        def row_buf(mode):
            return _new((B, T, H, V), dev) if mode == 2 else (_new((NV, B, T, H), dev) if mode == 1 else None)

        dcs, dps, doc = [row_buf(m) for m in cm], [row_buf(m) for m in pm], row_buf(om[0])
        atomic = bool(ATOMIC_SUMS) and NV > 1
        DM = torch.zeros((nkv, B, T, H, K), device=dev) if atomic else _new((NV, nkv, B, T, H, K), dev)
        needs_ds0 = has_s0 and ctx.needs_input_grad[-1]
        DS0 = _new((N, H, K, V), dev) if needs_ds0 else None
        dht = dST.transpose(-1, -2).contiguous() if dST is not None else None
        if T > 0 or DS0 is not None:
            launch(rankr_row_bwd_kernel, (N * H, NV), tuple(kv), tuple(ct), tuple(pt), ot[0], Z, CK, ST,
                   dy.contiguous(), dht, tuple(dcs), tuple(dps), doc, DM, DS0, *seq, T, H, V, K, NC if T > 0 else 0,
                   NV, B * T, B * T * H * V,
                   BV=BV, BK=next_pow2(K), CHUNK=CHUNK, PF=_prefetch_distance(), NKV=nkv, L=L, R=R,
                   UI=tuple(index[:L]), VI=tuple(index[L:L + R]), OQI=index[L + R], CM=cm, CC=cc, PM=pm, PC=pc,
                   OM=om, OCC=occ, ATOMIC=atomic, num_warps=nw, **flag)
        dm = DM if atomic else DM.sum(0) if NV > 1 else DM[0]
        seen, vec_grads = set(), []
        for j in index:
            vec_grads.append(dm[j] if j not in seen else None)    # a shared tensor's gradient once
            seen.add(j)
        row = [g.sum(0) if g is not None and m == 1 else g for g, m in zip(dcs + dps + [doc], cm + pm + om[:1])]
        doh = None if oh_dim is None else (dy if oh_dim == 4 else dy.float().sum(-1))
        ds0 = DS0.transpose(-1, -2).to(s0_dtype) if DS0 is not None else None
        grads = [g.to(dt) if g is not None and dt is not None else None for g, dt in zip(vec_grads + row + [doh],
                                                                                          dtypes[:-1])]
        return (None, None, None, None, None, None, *grads, ds0)


def _modes_of(xs):
    """(modes, constants, tensors or None) of row factors (``slots.row_mode``)."""
    ms = [row_mode(x) for x in xs]
    return tuple(m[0] for m in ms), tuple(m[1] for m in ms), [m[2] for m in ms]


def _own_slots(ir, get):
    """The kernel's items from ``get(slot, default)``: key vectors, c factors (0 where absent),
    p factors, oc (1), oh (None)."""
    L, R = ir.ranks()
    vecs = [get(f"u{l}", None) for l in range(L)] + [get(f"v{r}", None) for r in range(R)] + [get("oq", None)]
    rows = [get(f"c{r}{l}", 0.0) for r in range(R) for l in range(L)] + [get(f"p{r}", 0.0) for r in range(R)]
    return (*_dedup_contig(vecs), *_dedup_contig(rows + [get("oc", 1.0), get("oh", None)]))


def _run_own(ir, items, S0, V, out_dtype, output_final_state, packed=None):
    L, R = ir.ranks()
    return _RankRRowFunction.apply(L, R, V, out_dtype, output_final_state, packed, *items, S0)


def forward(obj, lay, co, output_final_state):
    """Family contract: (y [B, T, H, d] in lay.dtype, S_T [B, H, d, m] fp32 or None). The own
    kernels take the generated coefficients ``co`` (computed here when None); the generated
    row-tiled kernel computes everything from the layout's leaves."""
    ir = obj.ir
    if own_kernel_reason(ir) is not None:
        return general.forward(obj, lay, co, output_final_state, row_block=row_block(lay.d, lay.m))
    from ssmcraft.ops.rank1_row.recurrent import _as_row, _as_vec
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    co = co if co is not None else obj.module.coefficients(lay.env, d, m)
    ref = next(v for v in co.values() if isinstance(v, torch.Tensor))
    made: dict = {}

    def get(slot, default):
        if slot not in co:
            return default
        x = co[slot]
        key = (id(x), slot[0] in "uvo" and slot != "oc" and slot != "oh")
        if key not in made:
            if key[1]:
                made[key] = _as_vec(x, B, T, H, m, ref).contiguous()
            else:
                cf = ir.coefficient(slot)
                made[key] = _as_row(x, B, T, H, d, tuple(cf.dims) == (ir.dims[0],))
        return made[key]
    y, ST = _run_own(ir, _own_slots(ir, get), lay.S0, d, torch.float32, output_final_state)
    return y.to(lay.dtype), ST


def prepare(obj, lay):
    """The family's runner for one call signature: the own kernels on the slots (computed ones by
    ``slots.computed_path``: one fused prologue kernel), or ``general.runner`` row-tiled
    (``row_block``) where ``own_kernel_reason`` says why not. Either takes ``cu_seqlens=`` (a packed
    row, one program row per sequence)."""
    ir = obj.ir
    if own_kernel_reason(ir) is not None:
        return general.runner(obj, ir, lay, row_block=row_block(lay.d, lay.m))
    from ssmcraft.ops.common.slots import slot_runner
    from ssmcraft.ops.rank1_row.recurrent import packing
    d, out_dtype = lay.d, io_dtype(lay.out_dtype)

    def run(cs, initial_state, output_final_state, cu_seqlens=None):
        packed = None if cu_seqlens is None else packing(obj.name, cu_seqlens, cs.inputs, initial_state, CHUNK)
        y, ST = _run_own(ir, _own_slots(ir, cs.get), initial_state, d, out_dtype, output_final_state, packed)
        return y.to(lay.out_dtype), ST
    return slot_runner(obj, lay, run)
