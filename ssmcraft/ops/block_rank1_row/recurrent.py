"""Two states updated by one rank-1 step of an extrapolated state (``ssmcraft.compiler.blockrank1``;
Longhorn with momentum): host side, autograd function and the family interface of the row-tiled
kernels in ``kernels.py`` (where the recurrence, its adjoint and the state rebuild are written).

One program per (batch*head, block of BV rows) holds both state tiles in registers and loops over
time, as the per-row rank-1 family does (``ssmcraft.ops.rank1_row``): each row's step is the
Longhorn step of the extrapolated state, O(K) with one reduction, whatever the step size's layout
(per row or per head). The slots come from the IR the compiler's block stage wrote
(``a{a}{b} e{b} w{a} c u v p q oc oq oh``), bound and computed by ``ssmcraft.ops.common.slots``
(one fused prologue for the computed ones, such as Longhorn's ``c = beta / (1 + beta k.k)``); the
readout's ``oc, oh`` are applied on the host (``CallSlots.finish``), the kernels return ``S oq``.
"""
from __future__ import annotations

import torch

from ssmcraft.compiler.blockrank1 import block_rank1
from ssmcraft.ops.block_rank1_row.kernels import block_bwd_kernel, block_fwd_kernel
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.tuning import INTERPRET, buffer, cdiv, io_dtype, next_pow2
from ssmcraft.ops.rank1_row.recurrent import _dedup_contig, _groups

CHUNK = 16            # checkpoint interval of the backward (steps); its scratch keeps CHUNK/2 states of two tiles
# a chunk whose walk back (inverting the step) amplifies rounding by at most 2^DIVIDE_BITS is walked, else
# rebuilt from its checkpoint (``kernels.py``'s docstring; -1: every chunk rebuilt, inf: every one walked
# where the transition is lower triangular). 8 bits walks ~95% of the 16-step chunks of the bench's
# momentum draws (mu = sigmoid(N(2, 1)) per head) at a fp32 error ~2.5x the rebuild's; Longhorn with
# momentum's fwd+bwd, H200, B=8 T=2048 H=16 d=m=64 bf16: 7.26 ms, 9.17 with every chunk rebuilt
# (BENCHMARKS.md; ``benchmarks/bench_block_rank1.py --bits``, ``benchmarks/exp_divide_bits.py --block``)
DIVIDE_BITS = 8.0
POISON = False        # tests: fill outputs with NaN before the kernels run (unwritten -> NaN)
PREFETCH = 16         # L2 prefetch distance in steps on the GPU (0: off; always off when interpreting)
CONFIG: dict = {}     # benchmarks: {"rows": BV, "warps": num_warps, "chunk": CHUNK, "fwd_rows": the forward's BV,
                      # "keep_ahead": the backward's kept states a pair ahead} over the rules below (the kernels
                      # share no tile: z and the checkpoints are per row)

ROW_SLOTS = ("a00", "a01", "a10", "a11", "e0", "e1", "w0", "w1", "c", "p", "ro0", "ro1")
VEC_SLOTS = ("u", "v", "q", "oq")


def _new(shape, device, dtype=torch.float32):
    return buffer(shape, device, dtype, POISON)


def _config(V: int, K: int, which: str = "bwd") -> tuple[int, int]:
    """(BV, num_warps) of the forward or backward (``which``): interpreter one large tile (``CONFIG``
    still forces one); GPU small row blocks on one warp, as the per-row
    rank-1 family (B*H*V/BV programs fill the chip, a step has no cross-warp sync), with a tile of
    256 elements (BK * BV) per state: the backward holds eight state tiles live (two states, their
    adjoints, a kept pair and the pair rebuilt from it), and at 512 (K = 64, 8 rows) it spills
    (sm_90, offline: 255 registers and 296 stack bytes, against 251 and none at 4 rows)."""
    bv = CONFIG.get("rows", min(next_pow2(V), 64) if INTERPRET else max(2, 256 // next_pow2(K)))
    return (CONFIG.get("fwd_rows", bv) if which == "fwd" else bv), CONFIG.get("warps", 1)


def _row_groups(tens) -> tuple:
    """Per row slot, the first slot holding the same tensor (itself for a number)."""
    return tuple(next(j for j in range(i + 1) if t is not None and tens[j] is t) if t is not None else i
                 for i, t in enumerate(tens))


def _mode(x):
    """(mode, const, tensor): 0 a number, 1 per head [B, T, H], 2 per row [B, T, H, V]."""
    if not isinstance(x, torch.Tensor):
        return 0, float(x), None
    return (2 if x.dim() == 4 else 1), 0.0, x


class _BlockFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, V, out_dtype, output_final_state, S0, u, v, q, oq, *rows):
        """S0: [B, H, 2, K, V] fp32 or None; rows: the twelve ``ROW_SLOTS`` (tensor or number).
        Returns o [B, T, H, V] (``(r0 S0 + r1 S1) oq``) and S_T [B, H, 2, K, V] fp32 (or None)."""
        B, T, H, K = u.shape
        dev = u.device
        BV, nw = _config(V, K, "fwd")
        chunk = CONFIG.get("chunk", CHUNK)
        NC = max(1, cdiv(T, chunk))
        ms = [_mode(x) for x in rows]
        modes, consts, tens = tuple(m[0] for m in ms), tuple(m[1] for m in ms), [m[2] for m in ms]
        training = any(isinstance(x, torch.Tensor) and x.requires_grad for x in (S0, u, v, q, oq, *rows))
        o = _new((B, T, H, V), dev, out_dtype)
        ST = _new((B, H, 2, K, V), dev) if (output_final_state or training) else None
        Z = _new((B, T, H, V), dev) if training else None
        CK = _new((B, H, NC, 2, K, V), dev) if training else None
        if T > 0:
            launch(block_fwd_kernel, (B * H, cdiv(V, BV)), u, v, q, oq, *tens, S0, o, ST, Z, CK, T, H, V, K, NC,
                   BV=BV, BK=next_pow2(K), CHUNK=chunk, PF=0 if INTERPRET else PREFETCH, MODES=modes, CONSTS=consts,
                   GROUPS=tuple(_groups((u, v, q, oq))), num_warps=nw)
        elif ST is not None:
            ST.copy_(S0 if S0 is not None else torch.zeros_like(ST))
        ctx.save_for_backward(S0, u, v, q, oq, Z, CK, ST, *tens)
        ctx.meta = (V, modes, consts, chunk, S0 is not None, _row_groups(tens))
        return o, (ST if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dST):
        S0, u, v, q, oq, Z, CK, ST, *tens = ctx.saved_tensors
        V, modes, consts, chunk, has_s0, rowg = ctx.meta
        B, T, H, K = u.shape
        dev = u.device
        BV, nw = _config(V, K)
        BK, NV = next_pow2(K), cdiv(V, BV)
        NC = max(1, cdiv(T, chunk))
        groups = _groups((u, v, q, oq))
        distinct = [0] + [i for i, g in zip((1, 2, 3), groups) if g == i]
        index = {slot: distinct.index(slot) if slot in distinct else 0 for slot in range(4)}
        NG = len(distinct)
        # one gradient buffer per distinct row tensor (Longhorn with momentum: mu is a00, a10 and e0)
        # (per-head ones and the K-vector ones are sums over the row blocks, added into zeros by the kernel)
        gbufs = [None if m == 0 or g != i else _new((B, T, H, V), dev) if m == 2 else torch.zeros(B, T, H, device=dev)
                 for i, (m, g) in enumerate(zip(modes, rowg))]
        DM = torch.zeros(NG, B, T, H, K, device=dev)
        DS0 = _new((B, H, 2, K, V), dev) if has_s0 and ctx.needs_input_grad[3] else None
        if T > 0:
            SCR = torch.empty(B * H * NV * ((chunk + 1) // 2) * 2 * BK * BV, device=dev, dtype=torch.float32)
            launch(block_bwd_kernel, (B * H, NV), u, v, q, oq, *tens, Z, CK, SCR, ST,
                   do.contiguous() if do is not None else None, dST.contiguous() if dST is not None else None,
                   *gbufs, DM, DS0, T, H, V, K, NC, B * T, NG,
                   BV=BV, BK=BK, CHUNK=chunk, PF=0 if INTERPRET else PREFETCH, MODES=modes, CONSTS=consts,
                   GROUPS=tuple(groups), INDEX=(index[1], index[2], index[3]), ROWG=rowg,
                   KEEP_AHEAD=bool(CONFIG.get("keep_ahead", True)), BITS=float(DIVIDE_BITS), CP=next_pow2(chunk),
                   num_warps=nw)
        elif DS0 is not None:
            DS0.copy_(dST if dST is not None else torch.zeros_like(DS0))
        vec = [DM[index[0]]] + [DM[index[s]] if g == s else None for s, g in zip((1, 2, 3), groups)]
        vec = [g.to(x.dtype) if g is not None else None for g, x in zip(vec, (u, v, q, oq))]
        row = []
        for buf, t in zip(gbufs, tens):
            row.append(buf.to(t.dtype) if buf is not None else None)
        return (None, None, None, DS0, *vec, *row)


def block_recurrence(u, v, q, oq, rows: dict, initial_state=None, output_final_state=False):
    """Two states, row ``i`` of each (FLA layout: the states are ``[B, H, K, V]``)::

        U = e0 x0 + e1 x1,  z = U . u,  R = p q - c z v,  x_a' = a_a0 x0 + a_a1 x1 + w_a R,  o = (r0 x0' + r1 x1') . oq

    Args:
        u, v, q, oq: ``[B, T, H, K]`` (the same tensor for equal slots is read once).
        rows: slot -> ``[B, T, H, V]`` (per row), ``[B, T, H]`` (per head) or a number, for the slots
            ``a00 a01 a10 a11 e0 e1 w0 w1 c p ro0 ro1`` (absent: ``a`` the identity, ``e0`` 0, ``e1`` 1, ``w`` 1,
            ``ro0`` 0, ``ro1`` 1).
        initial_state: a pair of ``[B, H, K, V]`` or None.
    Returns ``o [B, T, H, V]`` (dtype of ``u``) and the final pair (fp32) or None."""
    default = {"a00": 1.0, "a01": 0.0, "a10": 0.0, "a11": 1.0, "e0": 0.0, "e1": 1.0, "w0": 1.0, "w1": 1.0, "ro0": 0.0,
               "ro1": 1.0}
    vals = _dedup_contig([rows.get(s, default.get(s)) for s in ROW_SLOTS])
    u, v, q, oq = _dedup_contig((u, v, q, oq))
    S0 = None if initial_state is None else torch.stack(tuple(initial_state), 2).float().contiguous()
    V = next(x.shape[3] for x in vals if isinstance(x, torch.Tensor) and x.dim() == 4) if S0 is None else S0.shape[-1]
    o, ST = _BlockFunction.apply(V, io_dtype(u.dtype), output_final_state, S0, u, v, q, oq, *vals)
    return o, (None if ST is None else tuple(ST.unbind(2)))


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if ``ir`` runs on this family's kernels, else the reason."""
    form = block_rank1(ir)
    if isinstance(form, str):
        return form
    if form.n_states != 2:
        return f"{form.n_states} states; the kernels carry two"
    d, m = ir.dims
    if "p" not in ir.slots:
        return "no input term (p q^T)"
    for slot in (*ROW_SLOTS, "oc", "oh"):
        co = ir.coefficient(slot)
        if co is not None and tuple(co.dims) not in ((), (d,)):
            return f"slot {slot!r} varies over {co.dims}; this kernel takes () or ({d},)"
    for slot in VEC_SLOTS:
        co = ir.coefficient(slot)
        if co is None or tuple(co.dims) not in ((), (m,)):
            return f"slot {slot!r} is missing or not a vector over {m}"
    return None


def prepare(obj, lay):
    """The family's runner for one call signature (``lay`` from ``reference.validate``): leaf slots
    go to the kernels as the caller's tensors, computed ones from the fused prologue
    (``slots.slot_runner``). Returns ``fn(inputs, params, initial_state, output_final_state)``,
    states a tuple of ``[B, H, d, m]`` per state (declaration order)."""
    from ssmcraft.ops.common.slots import slot_runner
    out_dtype = io_dtype(lay.out_dtype)
    d = lay.d

    def run(cs, initial_state, output_final_state):
        u, v, q, oq = _dedup_contig(tuple(cs.get(s) for s in VEC_SLOTS))
        rows = _dedup_contig([cs.get(s) for s in ROW_SLOTS])
        S0 = None
        if initial_state is not None:
            S0 = torch.stack(tuple(initial_state), 2).transpose(-1, -2).float().contiguous()
        o, ST = _BlockFunction.apply(d, out_dtype, output_final_state, S0, u, v, q, oq, *rows)
        y = cs.finish(o).to(lay.out_dtype)
        return y, (None if ST is None else tuple(ST.transpose(-1, -2).unbind(2)))
    return slot_runner(obj, lay, run)
