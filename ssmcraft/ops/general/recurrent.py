"""Family ``general``: run the fused sequential kernels of a general or nonlinear update
(``general`` / ``nonlinear`` IR kinds), generated per objective by ``ssmcraft.ops.codegen.general``
(where the kernels, their grid and the derived backward are described), and cached by the content
hash of the update's element form.
"""
from __future__ import annotations

import torch

from ssmcraft.compiler import cache
from ssmcraft.compiler.structure import element_form
from ssmcraft.ops.codegen.general import Step, build_step, kernel_source
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.tuning import INTERPRET, buffer, cdiv, io_dtype, next_pow2

CHUNK = 16               # checkpoint interval of the backward (steps; CONFIG["chunk"] over it): the
                         # scratch of every program's chunk, B*H*CHUNK*K*V fp32, stays in L2 (32 MB at
                         # B=8 H=16 K=V=64; H100 bf16 T=2048 fwd+bwd ms, 32 -> 16: huber_longhorn 8.09 ->
                         # 7.41, cauchy_delta 6.82 -> 6.42; H200, huber_longhorn 5.74 -> 4.98)
POISON = False           # tests: allocate outputs with NaN
PREFETCH = 16            # L2 prefetch distance of the forward on the GPU (steps; 0: off, and always off when interpreting)
CONFIG: dict = {}        # benchmarks and tests: {"rows": rows per program, "warps": num_warps, "chunk": CHUNK} over the rules below
# the backward's gradients of leaves shared by the rows (over m or per head) with several row blocks:
# True, every block adds into one fp32 buffer (atomics in L2), cast once to the leaf's dtype; False,
# each stores its partial [NV, ...] and the host sums them (one more pass over NV times the gradients).
# H200, bf16, B=8 T=2048 H=16 d=m=64, fwd+bwd, one process (``benchmarks/bench_general.py``):
# huber_longhorn 4.98 ms with atomics, 5.38 without (its backward kernel alone 3.79 / 4.00 ms)
ATOMIC_SUMS = True


_MODULES: dict = {}    # content hash of the element form -> (step, module, source)


def _module(ir):
    """(Step, generated module, source) of ``ir``'s fused kernels, cached by the content hash
    of its element form (``structure.element_form``, kept on the IR: ``UpdateIR.memo``), so
    that a structured IR and its element form (the rank-r family and the one-token decode
    family of one objective) share one derivation of the adjoint and one module."""
    ir = element_form(ir)
    key = ir.content_hash()
    if key not in _MODULES:
        step = build_step(ir)
        header = f"spec: {ir.spec_name} ({ir.source}); IR {key}"
        source = kernel_source(ir, step, header)
        mod = cache.load_generated(f"general_{ir.spec_name}", cache.key_for("general", source), source)
        _MODULES[key] = (step, mod, source)
    return _MODULES[key]


def generated_source(ir) -> str:
    """The generated kernels of ``ir`` (its element form); what ``ssmcraft derive SPEC --kernel`` prints."""
    return _module(ir)[2]


# ----------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------

def _new(shape, device, dtype=torch.float32):
    return buffer(shape, device, dtype, POISON)


def _warps(BK, BV, V):
    """num_warps: one warp for a block of a row-tiled state (the per-step reductions over the key
    stay in the warp: shuffles, no barrier), else by the tile's size. H200, bf16, B=8 T=2048 H=16
    d=m=64, checkpoints every 32 steps (``benchmarks/bench_general.py --sweep``), fwd / fwd+bwd ms:
    huber_longhorn at 8 rows 1.73 / 11.0 on 1 warp, 1.75 / 15.5 on 2; 4 rows on 1 warp 1.85 /
    17.5; cauchy_delta (one program per head, a [64, 64] tile) 1.72 / 7.7 on 4 warps, 2.02 / 11.6
    on 8, 2.40 / 17.7 on 16."""
    if INTERPRET:
        return 1
    if "warps" in CONFIG:
        return CONFIG["warps"]
    n = BK * BV
    if BV < next_pow2(V) and n <= 1024:
        return 1
    return 4 if n <= 4096 else 8 if n <= 16384 else 16


def _prefetch() -> int:
    return 0 if INTERPRET else PREFETCH


def rows_per_program(ir, V: int, K: int) -> int | None:
    """Rows per program for ``ir``'s kernels at ``[V, K]``: None (every row in one program) if the
    step or its adjoint sums over the rows (``row_sums``: e.g. ``cauchy_delta``'s ``|S k - x|^2``),
    else a block of rows, so that B*H*V/rows programs share the chip. Row-separable updates are the
    nonlinear ones whose loss is per row (``huber_longhorn``) and several-state ones whose every
    state's row depends only on the same row of the states (``momentum_longhorn``). About 512
    fp32 state values per program on one warp, at least 8 rows: B*H*d/rows programs of one warp
    leave about one warp per scheduler at d=64, and the step is bound by its latency, so more
    programs of fewer rows pay (``benchmarks/bench_general.py --sweep``, H200, bf16, B=8 T=2048
    H=16 d=m=64, fwd / fwd+bwd ms, one process, Longhorn 0.78 / 2.62): huber_longhorn 0.92 / 4.61
    with 8 rows, 0.98 / 4.85 with 16. momentum_longhorn (two states; H100): 1.67 / 12.1 with 8 rows,
    1.59 / 27.1 with 16 (its backward spills). Measured at K=64 only; a mini-batch update's anchors
    count as states (not measured on a GPU yet)."""
    step = _module(ir)[0]
    if row_sums(step):
        return None
    full = next_pow2(V)
    if "rows" in CONFIG:
        return min(CONFIG["rows"], full)
    if INTERPRET:
        return full
    tiles = step.n_states * (2 if step.anchors else 1)     # a mini-batch's anchors are tiles of their own
    return min(full, max(8, 512 // (next_pow2(K) * tiles)))


def _stacked(ir) -> tuple:
    """Several states travel stacked as one tensor [B, H, n, ...]; one state as [B, H, ...]."""
    return (len(ir.states),) if ir.states else ()


def _stack_states(ir, S0):
    """A tuple of per-state tensors [B, H, r, c] -> one [B, H, n, r, c] (None stays None)."""
    if S0 is None or not ir.states:
        return S0
    return torch.stack(tuple(S0), dim=2)


def _unstack_states(ir, S):
    return tuple(S.unbind(2)) if (S is not None and ir.states) else S


def _sequences(B, T, chunk, packed, ref):
    """(program rows N, checkpoints NC per row (unpacked) or of the whole packed row, the kernels'
    packing arguments ``CU, CO, VARLEN``): ``packed`` (offsets as ints, their device tensor) of a
    packed row (``ssmcraft.ops.common.varlen``; each sequence's checkpoints are its chunks' start
    states) or None (``ref`` stands in for the unread pointers)."""
    if packed is None:
        return B, max(1, cdiv(T, chunk)), dict(CU=ref, CO=ref, VARLEN=False)
    from ssmcraft.ops.common.varlen import chunks     # packed calls are ssmcraft's, not the export's
    ch = chunks(packed[0], packed[1].to(ref.device), chunk)
    return ch.N, ch.NT, dict(CU=ch.cu, CO=ch.co, VARLEN=True)


def _checkpoints(B, H, step, NC, K, V, packed, dev):
    """The checkpoint buffer: [B, H, (n,) NC, K, V]; a packed row's [H, (n,) NC, K, V]; n counts the
    states and a mini-batch's anchors (``codegen.general._checkpointed``), none when it is 1."""
    n = step.n_states * (2 if step.anchors else 1)
    ns = (n,) if n > 1 else ()
    return _new((B, H, *ns, NC, K, V) if packed is None else (H, *ns, max(1, NC), K, V), dev)


def _minibatch(ir, step) -> dict:
    """The kernels' mini-batch argument (``MB``, the chunk size), for an update that reads its anchors."""
    return {"MB": ir.minibatch} if step.anchors else {}


def _grad_buffer(x, shared: bool, NV: int, atomic: bool):
    """The backward kernel's gradient buffer of leaf ``x``: in ``x``'s dtype where the kernel writes
    each value once (a per-row leaf; a shared one with one row block: ``[1, ...]``), else fp32, zeroed
    for the row blocks to add into (``atomic``) or ``[NV, ...]`` partials."""
    if not shared:
        return _new(x.shape, x.device, x.dtype)
    if atomic:
        return torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    return _new((NV, *x.shape), x.device, x.dtype if NV == 1 else torch.float32)


class _GeneralFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ir, shape, out_dtype, output_final_state, packed, S0, *leaves):
        """shape: (B, T, H, K, V, BV), BV the rows per program (``next_power_of_2(V)``: one block);
        ``packed``: (offsets, cu_seqlens) of a packed row (B = 1; S0 and S_T [N, ...]) or None."""
        step, mod, _ = _module(ir)
        B, T, H, K, V, BV = shape
        dev = leaves[0].device
        BK, NV = next_pow2(K), cdiv(V, BV)
        chunk = CONFIG.get("chunk", CHUNK)
        d = torch.empty(1, device=dev)
        N, NC, seq = _sequences(B, T, chunk, packed, d)
        ns = _stacked(ir)                  # () for one state, (n,) for n states stacked after [B, H]
        training = any(x.requires_grad for x in leaves) or (S0 is not None and S0.requires_grad)
        y = _new((B, T, H, V), dev, out_dtype)
        ST = _new((N, H, *ns, K, V), dev)
        CK = _checkpoints(B, H, step, NC, K, V, packed, dev) if training else None
        S0c = S0.transpose(-1, -2).contiguous().float() if S0 is not None else None    # [N, H, K, V]
        if T > 0:
            launch(mod.general_fwd_kernel, (N * H, NV), *leaves, S0c if S0c is not None else d, y, ST,
                   CK if CK is not None else d, seq["CU"], seq["CO"], T, H, V, K, NC, BV=BV, BK=BK, CHUNK=chunk,
                   HAS_S0=S0c is not None, STORE_ST=True, STORE_CK=CK is not None, PF=_prefetch(),
                   EVEN=K == BK and V % BV == 0, VARLEN=seq["VARLEN"], num_warps=_warps(BK, BV, V),
                   **_minibatch(ir, step))
        else:
            ST.copy_(S0c if S0c is not None else torch.zeros_like(ST))
        ctx.save_for_backward(CK, *leaves)
        ctx.ir, ctx.shape, ctx.has_s0, ctx.chunk, ctx.packed = ir, shape, S0 is not None, chunk, packed
        ctx.s0_dtype = S0.dtype if S0 is not None else None
        return y, (ST.transpose(-1, -2) if output_final_state else None)

    @staticmethod
    def backward(ctx, dy, dST):
        CK, *leaves = ctx.saved_tensors
        step, mod, _ = _module(ctx.ir)
        B, T, H, K, V, BV = ctx.shape
        dev = leaves[0].device
        BK, NV = next_pow2(K), cdiv(V, BV)
        chunk = ctx.chunk
        d = torch.empty(1, device=dev)
        N, NC, seq = _sequences(B, T, chunk, ctx.packed, d)
        d_dim = ctx.ir.dims[0]
        shared = [d_dim not in dims for _, dims, _ in step.leaves]     # over m or per head: per row block
        atomic = bool(ATOMIC_SUMS) and NV > 1
        grads = [_grad_buffer(x, sh, NV, atomic) for sh, x in zip(shared, leaves)]
        ns = _stacked(ctx.ir)
        DS0 = _new((N, H, *ns, K, V), dev) if ctx.has_s0 else None
        slots = chunk + (1 if step.anchors else 0)       # codegen.general_lines.scratch_slots
        SCR = torch.empty(N * H * NV * (ns[0] if ns else 1) * slots * BK * BV, device=dev, dtype=torch.float32)
        dht = dST.transpose(-1, -2).contiguous() if dST is not None else None
        if dy is None:
            dy = torch.zeros(B, T, H, V, device=dev)
        if T > 0:
            launch(mod.general_bwd_kernel, (N * H, NV), *leaves, *grads, CK, SCR, dy.contiguous(),
                   dht if dht is not None else d, DS0 if DS0 is not None else d, seq["CU"], seq["CO"], T, H, V, K, NC,
                   BV=BV, BK=BK, CHUNK=chunk, HAS_DHT=dht is not None, STORE_DS0=DS0 is not None, PF=_prefetch(),
                   EVEN=K == BK and V % BV == 0, VARLEN=seq["VARLEN"], ATOMIC=atomic, num_warps=_warps(BK, BV, V),
                   **_minibatch(ctx.ir, step))
        elif DS0 is not None:
            DS0.copy_(dht if dht is not None else torch.zeros_like(DS0))
        dS0 = DS0.transpose(-1, -2).to(ctx.s0_dtype) if DS0 is not None else None
        grads = [(g if atomic else g.sum(0) if NV > 1 else g[0]) if sh else g for sh, g in zip(shared, grads)]
        return (None, None, None, None, None, dS0, *[g.to(x.dtype) for g, x in zip(grads, leaves)])


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------

def general_scan(objective, tensors: dict, initial_state=None, output_final_state: bool = False):
    """Run the generated kernel of a general/nonlinear ``objective`` (CompiledObjective or
    library name) in FLA's layout.

    tensors: the spec's inputs and params, d-indexed ``[B, T, H, V]``, m-indexed
      ``[B, T, H, K]``, scalars ``[B, T, H]`` (params may be given in these expanded forms or of
      their declared shape / ``[H, *shape]``); fp32 or bf16.
    initial_state: ``[B, H, K, V]`` or None (several states: a tuple of them, declaration order).
    Returns ``(y [B, T, H, V]`` in the first input's dtype, ``S_T [B, H, K, V]`` fp32 (a tuple with
    several states) or None).
    """
    obj = objective
    if isinstance(objective, str):
        from ssmcraft.compiler.api import derive
        obj = derive(objective)
    ir = obj.ir
    d, m = ir.dims
    first = tensors[next(iter(ir.inputs))]
    B, T, H = first.shape[:3]
    K = V = None
    for n, dims in ir.inputs.items():
        for dim, s in zip(dims, tensors[n].shape[3:]):
            if dim == d:
                V = s
            else:
                K = s
    initial_state = _stack_states(ir, initial_state)
    if initial_state is not None:
        K, V = initial_state.shape[-2], initial_state.shape[-1]
    leaves = []
    for n, dims in list(ir.inputs.items()) + list(ir.params.items()):
        t = tensors[n]
        full = (B, T, H) + tuple(V if x == d else K for x in dims)
        if tuple(t.shape) != full:
            t = t.reshape((1, 1, t.shape[0] if t.dim() > len(dims) else 1) + t.shape[t.dim() - len(dims):])
            t = t.expand(full)
        leaves.append(t.contiguous())
    S0 = initial_state.transpose(-1, -2) if initial_state is not None else None
    out_dtype = io_dtype(first.dtype)
    BV = rows_per_program(ir, V, K) or next_pow2(V)
    y, S = _GeneralFunction.apply(ir, (B, T, H, K, V, BV), out_dtype, output_final_state,
                                  None, S0, *leaves)
    return y, _unstack_states(ir, S.transpose(-1, -2) if S is not None else None)


def row_sums(step: Step) -> list[str]:
    """The reductions over the rows (``d``) in the step, its readout and their adjoints, by name:
    with none, the rows are independent and the kernel may run row-tiled (``NV > 1``)."""
    exprs = [*step.Fs, step.readout, *step.dS_prevs, *step.dAs, *step.dS_ros]
    return sorted({r.symbol.name for e in exprs for r in step.alg.reductions_in(e) if r.over == step.dims[0]})


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if ``ir`` runs on this family's kernel, else the reason. It runs every general or nonlinear
    update of ``[d, m]`` states, one or several, exact or mini-batch (``approximation: {minibatch:
    C}``, any C: each state's anchor carried beside it); it refuses states of other shapes (an MLP
    memory's weights, a square state carried by its inverse) and updates the Triton printer cannot
    print."""
    if ir.kind not in ("general", "nonlinear"):
        return f"not a general/nonlinear update ({ir.kind})"
    if ir.state_shapes and not ir.inverses:
        return (f"states of several shapes ({', '.join(f'{x}: [{chr(44).join(ir.shape_of(x))}]' for x in ir.states)}) "
                "do not fit the kernel's one [K, V] tile per state")
    if ir.inverses:
        return (f"square states ({', '.join(x for x, _, _ in ir.inverses)}: [m, m], carried by their inverses) do not "
                "fit the kernel's one [K, V] tile per state")
    try:
        step, _, _ = _module(ir)
    except NotImplementedError as e:
        return f"cannot print the update for Triton: {e}"
    return None


def runner(obj, ir, lay, row_block=None):
    """A runner for one call signature (``lay`` from ``reference.validate``: sizes and dtypes) of
    the fused kernel of ``ir`` (``obj.ir``, or its element form for decode): the leaves go to the
    kernel as the caller's tensors, in their own dtype (params broadcast to ``[B, T, H, *]``), with no
    per-call validation or layout. ``row_block``: rows per program (None: all rows in one).
    Returns ``fn(inputs, params, initial_state, output_final_state, cu_seqlens=None) -> (y [B,T,H,d],
    S_T)``: with ``cu_seqlens`` a packed row (``ssmcraft.ops.common.varlen``), one program row per
    sequence, each from its own initial state."""
    from ssmcraft.ops.common.slots import CallSlots, NO_COMPUTED
    names = [*ir.inputs, *ir.params]
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    BV = row_block or next_pow2(d)
    out_dtype = io_dtype(lay.out_dtype)

    def fn(inputs, params, initial_state, output_final_state, cu_seqlens=None):
        cs = CallSlots(obj, {}, inputs, params, B, T, H, d, m, NO_COMPUTED)
        leaves = [cs.leaf(n).contiguous() for n in names]
        packed = None
        if cu_seqlens is not None:
            from ssmcraft.ops.common.varlen import offsets
            packed = (offsets(obj.name, cu_seqlens, inputs, initial_state), cu_seqlens)
        y, S = _GeneralFunction.apply(ir, (B, T, H, m, d, BV), out_dtype, output_final_state, packed,
                                      _stack_states(ir, initial_state), *leaves)
        return y.to(lay.out_dtype), _unstack_states(ir, S)
    return fn


def prepare(obj, lay):
    """The family's runner for one call signature (see ``runner``; rows per program by ``rows_per_program``)."""
    return runner(obj, obj.ir, lay, row_block=rows_per_program(obj.ir, lay.d, lay.m))


def forward(obj, lay, co, output_final_state, row_block=None):
    """Family contract: the kernel computes everything from the layout's leaves (``co`` unused).
    ``row_block``: rows per program (a power of 2; None: ``rows_per_program``'s rule).
    Returns (y [B, T, H, d] in lay.dtype, S_T [B, H, d, m] fp32 or None)."""
    ir = obj.ir
    d, m = ir.dims
    B, T, H, V, K = lay.B, lay.T, lay.H, lay.d, lay.m
    leaves = []
    for n, dims in list(ir.inputs.items()) + list(ir.params.items()):
        t = lay.env[n]                                           # [B|1, T|1, H|1, r, c]
        t = t.expand(B, T, H, t.shape[3], t.shape[4])
        if tuple(dims) == (d,):
            t = t.reshape(B, T, H, V)
        elif tuple(dims) == (m,):
            t = t.reshape(B, T, H, K)
        elif not dims:
            t = t.reshape(B, T, H)
        leaves.append(t.contiguous())
    BV = row_block or rows_per_program(ir, V, K) or next_pow2(V)
    S0 = _stack_states(ir, lay.S0)
    y, S = _GeneralFunction.apply(ir, (B, T, H, K, V, BV), torch.float32, output_final_state, None, S0, *leaves)
    return y.to(lay.dtype), _unstack_states(ir, S)
