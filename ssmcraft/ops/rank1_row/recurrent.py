"""Identity-minus-rank-1 recurrences with a per-row (or per-head) step: Triton kernels.

Family ``rank1`` of the IR (``ssmcraft/compiler/ir.py``). Row ``i`` of the state
``S [V, K]`` (math layout ``[d, m]``; kernels' public state is FLA's ``[B, H, K, V]``)::

    z_i   = s_{t-1,i} . u_t                      (a scalar per row)
    s_t,i = a_i s_{t-1,i} - c_i z_i v_t + p_i q_t
    y_t,i = oc_i (s_t,i . oq_t) + oh_i

with ``u, v, q, oq`` vectors over K shared by the rows of a head and ``a, c, p, oc, oh``
per row (``[B, T, H, V]``), per head (``[B, T, H]``) or constants; the decay ``a`` may also be
per key (``[B, T, H, K]``, ``key_decay``: ``s_t,i = a o s_{t-1,i} - ...``, one vector
broadcast over the rows of a head: a GLA-style decay with a per-row step). Longhorn exact is
``a = 1, c = beta / (1 + beta k.k), u = v = q = k, p = c x, oq = q``; DeltaNet and Gated
DeltaNet are the per-head special cases. Each row costs O(K) per step, the same as the
diagonal scan, and rows are independent: the kernels run one program per
(batch*head, block of BV rows), hold the state tile in registers, transposed ``[BK, BV]`` so
that a row's K values sit in one or two threads (reductions over K in registers), and loop
over time. The loop is latency bound, not bandwidth bound (Longhorn's forward moves 0.15 GB:
0.04 ms at HBM speed, against ~2048 dependent steps), so each loop iteration runs 4 steps
with a 4-step-deep register prefetch plus an L2 prefetch further ahead.

Backward (reverse time; ``ds`` the adjoint of ``s_t,i``)::

    ds    += oc_i dy_i oq                         (readout)
    e_i    = ds . v,   dc_i = -z_i e_i,   dp_i = ds . q,   da_i = ds . s_{t-1,i}
                                                  (per key: da += sum_i ds_i o s_{t-1,i})
    du    -= sum_i c_i e_i s_{t-1,i},   dv -= sum_i c_i z_i ds_i,   dq += sum_i p_i ds_i
    doq   += sum_i oc_i dy_i s_t,i,     doc_i = dy_i (s_t,i . oq)
    ds     = a_i ds - c_i e_i u          (adjoint of s_{t-1,i}; per key a o ds)

The backward needs ``s_{t-1}`` at every step without storing ``[B, T, V, K]``: the forward
stores ``z`` (one scalar per row and step), the state every ``CHUNK`` steps (``DECAY_CHUNK`` with
a decay) and the final state, and the backward rebuilds ``s_{t-1}`` exactly from the stored ``z``
(``a == 1``: ``s_{t-1} = s_t + c z v - p q``; with a decay: forward from the chunk's checkpoint,
keeping every second state in an L2-resident scratch; ``rank1_row_bwd`` says how).

Kernels: ``rank1_row_fwd`` (the forward, the time-chunked forward's phases, the loads the
backward shares) and ``rank1_row_bwd``; this module is their host side, autograd function and
the family interface.

Packed sequences (``cu_seqlens``, ``ssmcraft.ops.common.varlen``): the grid's batch rows are the
sequences, each program taking its sequence's first row and length from the offsets and its
checkpoints at its first chunk's index (``fwd.seq_rows``, under the ``VARLEN`` constexpr: the
unpacked kernels compile as before); states are ``[N, H, ...]``.

Reductions over rows (gradients of ``u, v, q, oq`` and of per-head coefficients) are
written per row block and summed on the host. Inputs that are the same tensor (Longhorn's
``u = v = q = k``) are loaded once and their gradients accumulated in one buffer.

A time-parallel forward (``chunked_forward``) is also here: per time segment it forms
each row's K x K transition product and local end state, propagates the segment start
states, then reruns the sequential kernel on all segments at once. It does K times more
work per row and step (a K x K product instead of a K-vector); at B=8, V=1536 the
sequential kernel already has 384+ programs to fill the chip, and the chunked form measured
28x slower (14.9 ms vs 0.535 ms, BENCHMARKS.md), so the family runs the sequential kernel;
``chunked_forward`` stays for measurement and for few-program shapes.
"""
from __future__ import annotations


import torch

from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.slots import fold_scaled_u, row_mode
from ssmcraft.ops.rank1_row.bwd import rank1_row_bwd_kernel
from ssmcraft.ops.rank1_row.fwd import rank1_row_fwd_kernel, rank1_row_propagate_kernel, rank1_row_segment_kernel
from ssmcraft.ops.common.tuning import INTERPRET, buffer, cdiv, io_dtype, next_pow2

CHUNK = 64            # checkpoint interval of the backward (steps), a == 1
# with a decay the backward keeps every second state of a chunk in a scratch of CHUNK/2 state tiles
# per program, which shorter chunks keep in L2 (8 steps: 8 MB for the 1024 programs of B=8, H=16,
# d=m=64; 64 steps: 67 MB) at the price of more checkpoints (K V floats per head every 8 steps) and
# of a restart per chunk; wd_longhorn's fwd+bwd at that shape, H200: 6.49 / 6.28 / 6.06 ms at
# 64 / 16 / 8 steps (BENCHMARKS.md)
DECAY_CHUNK = 8
# with a decay, a chunk whose reversal divided by the decays amplifies rounding by at most 2^DIVIDE_BITS
# (the product of 1/|a| over its steps) walks back from its end state as a == 1 does, without the
# rebuild; the others are rebuilt (``bwd``'s docstring). 6 bits: the walk's fp32 error is ~6x the
# rebuild's (~1e-6, far below what bf16 I/O rounds away) and it walks ~99% of wd_longhorn's chunks, where 4 bits
# walked too few to pay for the selection (BENCHMARKS.md, `benchmarks/exp_divide_bits.py`)
DIVIDE_BITS = 6.0
ONE_LOOP = True       # benchmarks: False runs a reverse loop per way (``bwd``'s docstring)
# the backward's K-vector gradients, (without a decay, with one): True, every row block of a head adds into
# one [NG, B, T, H, K] buffer (atomics in L2); False, each stores its partial and the host sums the NV
# partials (one more pass over NV times the gradients). H200, B=8 T=2048 H=16 d=m=64 bf16, fwd+bwd, one
# process (BENCHMARKS.md): Longhorn 3.15 ms with atomics, 3.24 without; wd / gated Longhorn 6.66 / 5.69 with,
# 5.21 / 4.77 without (the decayed kernel spills more with atomics)
ATOMIC_SUMS = (True, False)

# ----------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------

def default_config(BH: int, V: int, K: int, which: str = "fwd") -> tuple[int, int]:
    """(BV, num_warps). Interpreter: one large tile (few programs run fastest). GPU: small row
    blocks so that B*H*V/BV programs fill the chip, one warp so that the per-step chain has no
    cross-warp step: at K=16 the forward is best at BV=32 and the backward at BV=16; at K=64
    (``benchmarks/sweep_rank1_row.py``) BV=8 on one warp for Longhorn and its decayed variants alike
    (BENCHMARKS.md, "Rank-1 per row" and "Structure classes through ``obj()``", have the sweeps)."""
    if INTERPRET:
        return min(next_pow2(V), 64), 1
    BK = next_pow2(K)
    if BK <= 16:
        return (32, 1) if which == "fwd" else (16, 1)
    if BK <= 32:
        return 16, 1
    return 8, 1


_CONFIG_OVERRIDE: dict = {}


def set_config(fwd=None, bwd=None):
    """Force (BV, num_warps) for the forward / backward kernels (benchmarks); None resets."""
    _CONFIG_OVERRIDE["fwd"] = fwd
    _CONFIG_OVERRIDE["bwd"] = bwd


def _config(which, BH, V, K):
    return _CONFIG_OVERRIDE.get(which) or default_config(BH, V, K, which)


ROW_SLOTS = ("a", "c", "p", "oc", "oh")
VEC_SLOTS = ("u", "v", "q", "oq")


def _groups(vecs):
    """For v, q, oq: index (0..3) of the first of (u, v, q, oq) that is the same tensor."""
    out = []
    for i in (1, 2, 3):
        g = i
        for j in range(i):
            if vecs[j] is vecs[i]:
                g = j
                break
        out.append(g)
    return out


POISON = False        # tests: fill outputs with NaN before the kernels run (unwritten -> NaN)
PREFETCH = 16         # L2 prefetch distance in steps on the GPU (0: off; always off when interpreting)


def _new(shape, device, dtype=torch.float32):
    return buffer(shape, device, dtype, POISON)


def _prefetch_distance() -> int:
    return 0 if INTERPRET else int(PREFETCH)


def _contig(x):
    return x if x is None or not isinstance(x, torch.Tensor) else x.contiguous()


KEY_DECAY = 3          # the decay's mode when it is per key ([B, T, H, K])


def _modes(xs, key_decay=False):
    """(MODES, CONSTS, tensors) of row coefficients for the kernels (``slots.row_mode`` of each; the
    first, the decay, ``KEY_DECAY`` when ``key_decay``)."""
    ms = [row_mode(x) for x in xs]
    if key_decay:
        ms[0] = (KEY_DECAY, 0.0, xs[0])
    return tuple(m[0] for m in ms), tuple(m[1] for m in ms), [m[2] for m in ms]


def _exact_inverse(a) -> bool:
    """Whether s_{t-1} follows from s_t without dividing by a decay (a == 1)."""
    mode, const, _ = row_mode(a)
    return mode == 0 and const == 1.0


def chunk_of(a) -> int:
    """The backward's checkpoint interval for the decay ``a`` (``CHUNK`` or ``DECAY_CHUNK``)."""
    return CHUNK if _exact_inverse(a) else DECAY_CHUNK


def sequences(B, T, chunk, packed):
    """(program rows N, checkpoints NC per row (unpacked) or of the whole packed row, the kernels'
    ``VARLEN`` flag, their (CU, CO) pointers): ``packed`` the ``varlen.Chunks`` of a packed row at
    the checkpoint interval ``chunk`` (each sequence's checkpoints are its chunks' start states;
    ``packing``), or None."""
    if packed is None:
        return B, max(1, cdiv(T, chunk)), dict(VARLEN=False), (None, None)
    return packed.N, packed.NT, dict(VARLEN=True), (packed.cu, packed.co)


def checkpoints(B, H, NC, K, V, packed, dev):
    """The checkpoint buffer ([B, H, NC, K, V]; a packed row's [H, NC, K, V], every sequence's
    checkpoints together) of ``sequences``' NC."""
    return _new((B, H, NC, K, V) if packed is None else (H, max(1, NC), K, V), dev)


def _forward(u, v, q, oq, a, c, p, oc, oh, S0, V, out_dtype, *, want_state, training, packed=None,
             key_decay=False):
    """S0: [B, H, V, K] (math layout, any strides) or None. Returns y [B,T,H,V], S_T [B,H,K,V]
    fp32 (with ``want_state`` or ``training``), and when ``training`` z [B,T,H,V] fp32 and the
    checkpoints [B,H,NC,K,V] fp32. ``packed``: a packed row's ``Chunks`` (``_sequences``; B = 1,
    N sequences): S0 and S_T are [N, ...] and the checkpoints [H, NC, K, V]. ``key_decay``: ``a`` is
    [B, T, H, K], a decay per key."""
    B, T, H, K = u.shape
    dev = u.device
    chunk = chunk_of(a)
    N, NC, flag, seq = sequences(B, T, chunk, packed)
    BV, nw = _config("fwd", N * H, V, K)
    modes, consts, rows = _modes((a, c, p, oc, oh), key_decay)
    y = _new((B, T, H, V), dev, out_dtype)
    ST = _new((N, H, K, V), dev) if (want_state or training) else None
    Z = _new((B, T, H, V), dev) if training else None
    CK = checkpoints(B, H, NC, K, V, packed, dev) if training else None
    if S0 is not None:
        S0 = S0.transpose(-1, -2).contiguous()     # [N, H, K, V], like every state tile
    s0_strides = (H * K * V, K * V, 0, V, 1) if S0 is not None else (0,) * 5
    if T > 0:
        launch(rank1_row_fwd_kernel, (N * H, cdiv(V, BV), 1),
               u, v, q, oq, *rows, S0, *s0_strides, y, ST, Z, CK, *seq, T, H, V, K, T, NC,
               BV=BV, BK=next_pow2(K), CHUNK=chunk, PF=_prefetch_distance(),
               MODES=modes, CONSTS=consts, GROUPS=tuple(_groups((u, v, q, oq))), num_warps=nw, **flag)
    elif ST is not None:
        ST.copy_(S0 if S0 is not None else torch.zeros_like(ST))
    return y, ST, Z, CK


def _backward(saved, groups, dy, dht, needs_ds0, packed=None, key_decay=False):
    (u, v, q, oq, a, c, p, oc, Z, CK, ST, V) = saved
    B, T, H, K = u.shape
    dev = u.device
    chunk = chunk_of(a)
    N, NC, flag, seq = sequences(B, T, chunk, packed)
    BV, nw = _config("bwd", N * H, V, K)
    BK = next_pow2(K)
    NV = cdiv(V, BV)
    distinct = [0] + [i for i, g in zip((1, 2, 3), groups) if g == i]
    index = {slot: distinct.index(slot) if slot in distinct else 0 for slot in range(4)}
    NG = len(distinct)
    modes, consts, rows = _modes((a, c, p, oc), key_decay)

    def row_buf(mode):
        if mode == KEY_DECAY:
            return _new((NV, B, T, H, K), dev)
        if mode == 2:
            return _new((B, T, H, V), dev)
        if mode == 1:
            return _new((NV, B, T, H), dev)
        return None

    bufs = [row_buf(m) for m in modes]
    atomic = bool(ATOMIC_SUMS[0 if _exact_inverse(a) else 1]) and NV > 1
    DM = torch.zeros((NG, B, T, H, K), device=dev) if atomic else _new((NV, NG, B, T, H, K), dev)
    DS0 = _new((N, H, K, V), dev) if needs_ds0 else None
    # the decay path's kept states: one per reverse pair of steps of a chunk, per program
    SCR = None if _exact_inverse(a) else _new((N * H * NV * (cdiv(chunk, 2) + 1) * BK * BV,), dev)
    if dht is not None:
        # [B, H, V, K] -> contiguous [B, H, K, V]: the same layout as every other state tile
        dht = dht.transpose(-1, -2).contiguous()
    if T > 0 or DS0 is not None:
        launch(rank1_row_bwd_kernel, (N * H, NV),
               u, v, q, oq, *rows, Z, CK, SCR, ST, dy.contiguous(), dht, *bufs, DM, DS0, *seq,
               T, H, V, K, NC if T > 0 else 0, NV, B * T, NG,
               BV=BV, BK=BK, CHUNK=chunk, PF=_prefetch_distance(), MODES=modes + (0,), CONSTS=consts + (0.0,),
               GROUPS=tuple(groups), INDEX=(index[1], index[2], index[3]), BITS=float(DIVIDE_BITS),
               CP=next_pow2(chunk), ONE_LOOP=bool(ONE_LOOP), ATOMIC=atomic, num_warps=nw, **flag)
    dm = DM if atomic else DM.sum(0) if NV > 1 else DM[0]
    vec_grads = [dm[index[0]]] + [dm[index[slot]] if g == slot else None for slot, g in zip((1, 2, 3), groups)]
    row_grads = [buf.sum(0) if buf is not None and m in (1, KEY_DECAY) else buf for buf, m in zip(bufs, modes)]
    return vec_grads, row_grads, (DS0.transpose(-1, -2) if DS0 is not None else None)


# ----------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------

class _Rank1RowFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, v, q, oq, a, c, p, oc, oh, S0, V, out_dtype, output_final_state, packed=None,
                key_decay=False):
        training = any(isinstance(x, torch.Tensor) and x.requires_grad for x in (u, v, q, oq, a, c, p, oc, oh, S0))
        y, ST, Z, CK = _forward(u, v, q, oq, a, c, p, oc, oh, S0, V, out_dtype,
                                want_state=output_final_state, training=training, packed=packed, key_decay=key_decay)
        ctx.packed = packed
        ctx.key_decay = key_decay
        ctx.groups = _groups((u, v, q, oq))
        ctx.s0_dtype = S0.dtype if S0 is not None else None
        ctx.row_consts = [None if isinstance(x, torch.Tensor) else x for x in (a, c, p, oc)]
        tensors = [x if isinstance(x, torch.Tensor) else None for x in (a, c, p, oc)]
        ctx.save_for_backward(u, v, q, oq, *tensors, Z, CK, ST)
        ctx.V = V
        ctx.oh_kind = None if oh is None or not isinstance(oh, torch.Tensor) else oh.dim()
        ctx.has_s0 = S0 is not None
        return y, (ST.transpose(-1, -2) if output_final_state else None)

    @staticmethod
    def backward(ctx, dy, dST):
        u, v, q, oq, ta, tc, tp, toc, Z, CK, ST = ctx.saved_tensors
        a, c, p, oc = [t if t is not None else k for t, k in zip((ta, tc, tp, toc), ctx.row_consts)]
        if dy is None:
            dy = torch.zeros(u.shape[0], u.shape[1], u.shape[2], ctx.V, device=u.device, dtype=torch.float32)
        vec, row, dS0 = _backward((u, v, q, oq, a, c, p, oc, Z, CK, ST, ctx.V), ctx.groups, dy, dST,
                                  needs_ds0=ctx.has_s0 and ctx.needs_input_grad[9], packed=ctx.packed,
                                  key_decay=ctx.key_decay)
        if dS0 is not None:
            dS0 = dS0.to(ctx.s0_dtype)
        doh = None
        if ctx.oh_kind == 4:
            doh = dy
        elif ctx.oh_kind == 3:
            doh = dy.float().sum(-1)
        cast = [g.to(x.dtype) if g is not None and isinstance(x, torch.Tensor) else None
                for g, x in zip(vec + row, (u, v, q, oq, a, c, p, oc))]
        return (*cast, doh, dS0, None, None, None, None, None)


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------

def rank1_row_recurrence(u, v, q, oq, c, p, a=1.0, oc=1.0, oh=None, initial_state=None,
                         output_final_state=False, state_layout="fla", key_decay=False):
    """Identity-minus-rank-1 recurrence, per row ``i`` of the state::

        s_t,i = a_i s_{t-1,i} - c_i (s_{t-1,i} . u_t) v_t + p_i q_t,   y_t,i = oc_i (s_t,i . oq_t) + oh_i

    Args:
        u, v, q, oq: ``[B, T, H, K]`` (pass the same tensor for equal slots, e.g. Longhorn's
            ``u = v = q = k``: it is read once and its gradient accumulated once).
        c, p, a, oc, oh: ``[B, T, H, V]`` (per row), ``[B, T, H]`` (per head) or a float
            (``oh`` may be None).
        initial_state: ``[B, H, K, V]`` (``state_layout="fla"``) or ``[B, H, V, K]`` ("math").
        key_decay: ``a`` is ``[B, T, H, K]``, a decay per key (``s_t,i = a o s_{t-1,i} - ...``).
        output_final_state: also return the final state (fp32, same layout).
    Returns:
        ``y [B, T, H, V]`` (dtype of ``u``), final state or None.
    Longhorn exact: ``c = beta / (1 + beta (k.k))``, ``p = c x``, ``u = v = q = k``, ``oq = q_read``.
    """
    S0 = initial_state
    if S0 is not None and state_layout == "fla":
        S0 = S0.transpose(-1, -2)
    u, v, q, oq = _dedup_contig((u, v, q, oq))
    a, c, p, oc, oh = _dedup_contig((a, c, p, oc, oh))
    rows = (p, c, oc, oh) if key_decay else (p, c, a, oc, oh)
    V = next(x.shape[3] for x in rows if isinstance(x, torch.Tensor) and x.dim() == 4) \
        if S0 is None else S0.shape[2]
    y, ST = _Rank1RowFunction.apply(u, v, q, oq, a, c, p, oc, oh, S0, V, u.dtype, output_final_state, None,
                                    key_decay)
    if ST is not None and state_layout == "fla":
        ST = ST.transpose(-1, -2)
    return y, ST


def _dedup_contig(xs):
    out = []
    for i, x in enumerate(xs):
        j = next((j for j in range(i) if xs[j] is x and isinstance(x, torch.Tensor)), None)
        out.append(out[j] if j is not None else _contig(x))
    return out


def chunked_forward(u, v, q, oq, c, p, a=1.0, oc=1.0, oh=None, initial_state=None, segment=256, config=None):
    """Time-parallel forward of ``rank1_row_recurrence`` (no autograd): phase 1 per-segment
    K x K transition products per row, phase 2 propagation of the segment start states,
    phase 3 the sequential kernel on all segments at once.

    Shapes as ``rank1_row_recurrence``; ``initial_state`` ``[B, H, V, K]`` (math layout).
    Returns ``(y [B, T, H, V], S_T [B, H, V, K] fp32)``."""
    u, v, q, oq = _dedup_contig((u, v, q, oq))
    a, c, p, oc, oh = _dedup_contig((a, c, p, oc, oh))
    B, T, H, K = u.shape
    V = p.shape[3]
    dev = u.device
    BV, nw = config or _config("fwd", B * H, V, K)
    BK = next_pow2(K)
    NV = cdiv(V, BV)
    NSEG = max(1, cdiv(T, segment))
    modes, consts, rows = _modes((a, c, p, oc, oh))
    groups = tuple(_groups((u, v, q, oq)))
    PR = _new((B * H, NSEG, K, K, V), dev)
    LOC = _new((B * H, NSEG, K, V), dev)
    SS = _new((B * H, NSEG, K, V), dev)
    S0 = initial_state
    launch(rank1_row_segment_kernel, (B * H, NV, NSEG), u, v, q, oq, *rows[:3], PR, LOC, T, H, V, K, segment, NSEG,
           BV=BV, BK=BK, MODES=modes, CONSTS=consts, GROUPS=groups, num_warps=max(nw, 4))
    s0_strides = (S0.stride(0), S0.stride(1), S0.stride(3), S0.stride(2)) if S0 is not None else (0,) * 4
    launch(rank1_row_propagate_kernel, (B * H, NV), S0, *s0_strides, PR, LOC, SS, H, V, K, NSEG,
           BV=BV, BK=BK, num_warps=nw)
    y = _new((B, T, H, V), dev, u.dtype)
    # phase 3: every segment from its start state
    launch(rank1_row_fwd_kernel, (B * H, NV, NSEG),
           u, v, q, oq, *rows, SS, H * NSEG * K * V, NSEG * K * V, K * V, V, 1, y, None, None, None, None, None,
           T, H, V, K, segment, 1, BV=BV, BK=BK, CHUNK=CHUNK, PF=_prefetch_distance(),
           MODES=modes, CONSTS=consts, GROUPS=groups, num_warps=nw)
    # the final state: the last segment's start state through the last segment
    ST = (SS[:, -1].unsqueeze(2) * PR[:, -1]).sum(1) + LOC[:, -1]
    return y, ST.view(B, H, K, V).transpose(-1, -2)


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def is_key_decay(ir) -> bool:
    """Whether ``ir``'s decay ``a`` varies over the key dimension (the kernels' ``KEY_DECAY``)."""
    co = ir.coefficient("a")
    return co is not None and tuple(co.dims) == (ir.dims[1],)


def supports(ir) -> str | None:
    """None if ``ir`` runs on this family's kernels, else the reason."""
    if ir.kind != "rank1":
        return f"not a rank-1 update ({ir.kind})"
    if ir.readout is not None:
        return "the readout is not of the form oc . (S oq) + oh"
    if "B" in ir.slots or "p" not in ir.slots:
        return "the input term does not factor as p q^T"
    d, m = ir.dims
    allowed = {"a": ((), (d,), (m,)), "c": ((), (d,)), "p": ((), (d,)), "oc": ((), (d,)), "oh": ((), (d,)),
               "u": ((), (m,)), "v": ((), (m,)), "q": ((), (m,)), "oq": ((), (m,))}
    for slot, dims_ok in allowed.items():
        co = ir.coefficient(slot)
        if co is None:
            if slot in ("oh",):
                continue
            if slot in ("a", "oc"):
                continue
            return f"slot {slot!r} is missing"
        if tuple(co.dims) not in dims_ok:
            return f"slot {slot!r} varies over {co.dims}; this kernel takes {' or '.join(map(str, dims_ok))}"
    if is_key_decay(ir) and tuple(ir.coefficient("c").dims) != (d,):
        # the KDA-like form: chunked on tensor cores by rank1_keydecay_chunk, which this family would
        # shadow (it comes first in the registry's order)
        return "a decay per key runs here with a per-row step only (a per-head step: rank1_keydecay_chunk)"
    return None


def _as_vec(x, B, T, H, m, ref):
    """[B|1, T|1, H|1, 1, m|1] tensor or number -> [B, T, H, m]."""
    if not isinstance(x, torch.Tensor):
        return torch.full((B, T, H, m), float(x), device=ref.device, dtype=ref.dtype)
    return x.expand(B, T, H, x.shape[3], m).reshape(B, T, H, m)


def _as_row(x, B, T, H, d, per_row):
    """[B|1, T|1, H|1, d|1, 1] tensor -> [B, T, H, d] (per row) or [B, T, H] (per head); numbers pass."""
    if not isinstance(x, torch.Tensor):
        return float(x)
    if per_row:
        return x.expand(B, T, H, d, x.shape[4]).reshape(B, T, H, d)
    return x.expand(B, T, H, 1, 1).reshape(B, T, H)


def forward(obj, lay, co, output_final_state):
    """Run the family's kernel on laid-out coefficients ``co`` (slot -> [B,T,H,r,c] or number).
    Returns (y [B, T, H, d] in lay.dtype, S_T [B, H, d, m] fp32 or None)."""
    ir = obj.ir
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    ref = next(v for v in co.values() if isinstance(v, torch.Tensor))
    prepared: dict = {}

    def prep(slot, fn):
        x = co.get(slot)
        for other, y in prepared.items():
            if co.get(other) is x and isinstance(x, torch.Tensor) and y[0] == fn:
                return y[1]
        out = fn(x)
        prepared[slot] = (fn, out)
        return out

    def vec(x):
        return _as_vec(x, B, T, H, m, ref).contiguous()

    key_decay = is_key_decay(ir)
    row_fns = {}
    for slot in ROW_SLOTS:
        cf = ir.coefficient(slot)
        per_row = cf is not None and tuple(cf.dims) == (ir.dims[0],)
        row_fns[slot] = (lambda pr: (lambda x: _contig(_as_row(x, B, T, H, d, pr))))(per_row)
    u = prep("u", vec)
    v = prep("v", vec)
    q = prep("q", vec)
    oq = prep("oq", vec)
    vals = {}
    for slot in ROW_SLOTS:
        if slot not in co:
            vals[slot] = 1.0 if slot in ("a", "oc") else None
        else:
            vals[slot] = prep(slot, vec if slot == "a" and key_decay else row_fns[slot])
    compute = torch.float32
    y, ST = _Rank1RowFunction.apply(u, v, q, oq, vals["a"], vals["c"], vals["p"], vals["oc"], vals["oh"],
                                    lay.S0, d, compute, output_final_state, None, key_decay)
    return y.to(lay.dtype), ST


def prepare(obj, lay):
    """The family's runner for one call signature (``lay`` from ``reference.validate``): the key
    slots (``u, v, q, oq``) go to the kernel as the caller's tensors, in their own dtype (Longhorn's
    ``u = v = q = k`` is read once); the row coefficients that are expressions (Longhorn's
    ``c = beta / (1 + beta k.k)``, ``p = c x``) are computed from only the leaves they need, in fp32
    (``slots.computed_path``: one fused prologue kernel).
    Returns ``fn(inputs, params, initial_state, output_final_state, cu_seqlens=None)``: with
    ``cu_seqlens`` a packed row (``ssmcraft.ops.common.varlen``), one program row per sequence."""
    from ssmcraft.ops.common.slots import slot_runner
    d, out_dtype = lay.d, io_dtype(lay.out_dtype)
    key_decay = is_key_decay(obj.ir)

    def run(cs, initial_state, output_final_state, cu_seqlens=None):
        keys = [cs.get(s) for s in VEC_SLOTS[1:]]
        rows = [cs.get(s, 1.0 if s in ("a", "oc") else None) for s in ROW_SLOTS]
        u, rows[1] = fold_scaled_u(cs, keys, rows[1])
        u, v, q, oq = _dedup_contig((u, *keys))
        a, c, p, oc, oh = _dedup_contig(rows)
        packed = None if cu_seqlens is None else packing(obj.name, cu_seqlens, cs.inputs, initial_state, chunk_of(a))
        y, ST = _Rank1RowFunction.apply(u, v, q, oq, a, c, p, oc, oh, initial_state, d, out_dtype,
                                        output_final_state, packed, key_decay)
        return y.to(lay.out_dtype), ST
    return slot_runner(obj, lay, run)


def packing(name: str, cu_seqlens, inputs: dict, initial_state, chunk: int):
    """A packed call's ``Chunks`` at the checkpoint interval ``chunk`` (its offsets checked and read
    once)."""
    from ssmcraft.ops.common.varlen import chunks, offsets     # packed calls are ssmcraft's, not the export's
    cu = offsets(name, cu_seqlens, inputs, initial_state)
    return chunks(cu, cu_seqlens.to(next(iter(inputs.values())).device), chunk)
