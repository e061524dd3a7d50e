"""Chunked identity-minus-rank-r recurrences with a per-head step (two-key explicit, decay-explicit
and Woodbury-implicit updates; DeltaProduct-like).

The family (``rankr`` IR whose row factors ``c_rl`` are one number per head, decay ``a`` per head)::

    S_t = a_t S_{t-1} - sum_{r,l} c_rl (S_{t-1} u_l) v_r^T + sum_r p_r v_r^T,     y_t = S_t oq_t

Every term reads ``S_{t-1}``: a SUM of rank-1 terms, not a product of Householder factors as in
DeltaProduct. ``sum_{r,l} c_rl v_r u_l^T = sum_r v_r (sum_l c_rl u_l)^T``, so with the effective read
keys ``u'_r = sum_l c_rl u_l`` (folded on the host: R x L per-head products, autograd through
them; the Woodbury solve of an implicit update is already in the ``c_rl``) the transition is
``I - sum_r v_r u'_r^T`` and the update, in the kernels' transpose ``H = S^T [K, V]``::

    H_t = a_t H_{t-1} - sum_i c_ti v_ti (u_ti^T H_{t-1}) + sum_i v_ti (ps_ti p_ti)^T,   o_t = H_t^T oq_t

Where the ``c_rl`` are diagonal (explicit, decay-explicit) no fold is needed: ``u_i = u_ii``,
``c_ti = c_ii`` (DeltaNet's ``c = ps = beta`` fused as in ``rank1_chunk``); after a fold ``c = 1``.

The kernels are ``rank1_chunk``'s with the group size ``R`` (``ssmcraft.ops.rank1_chunk.kernels``):
the R terms of token t are the term rows ``t R + i`` of a sequence of ``T R`` rows, masks
token-strict (the terms of one token do not see each other), the decay once per token, the output
read once per token after its R terms. The WY / UT algorithm is ``rank1_chunk.chunk``'s on the
term rows. Up to four keys: R = 3 runs as four terms, the fourth zero (``_group``). Shapes:
``chunk_rankr``'s docstring. GPU checks and timings: ``benchmarks/bench_rankr_chunk.py``.
"""
from __future__ import annotations

import torch

from ssmcraft.ops.common.readout import finish_laid_out
from ssmcraft.ops.common.rows import packed_chunks
from ssmcraft.ops.common.tuning import IO_DTYPES, io_dtype
from ssmcraft.ops.rank1_chunk.chunk import C_GIVEN, C_IS_PS, Rank1ChunkFunction, _per_head, as_operand
from ssmcraft.ops.rank1_chunk.chunk import supports_inputs, supports_sizes  # noqa: F401 - its kernels' K limit

CHUNK = 64                          # chunk size (term rows) used by the family
BACKEND_NAME = "rankr-chunk"


def _group(R: int) -> int:
    """Term rows per token in the kernels: R, or 4 for R = 3 (a zero fourth term: its keys and value are
    0, so it reads, erases and inserts nothing; the kernels' token-row tiles need a power of two)."""
    return 4 if R == 3 else R


def _term_rows(x, B, T, H, R, n, dtype):
    """Per-token terms as the contiguous ``[B, T * G, H, n]`` term rows in ``dtype`` (term i of token t
    at row t G + i, ``G = _group(R)``, zero terms after the R given), in one copy: ``x`` a
    ``[B, T, H, R, n]`` tensor or a sequence of R tensors broadcastable to ``[B, T, H, n]``."""
    G = _group(R)
    if isinstance(x, (list, tuple)):
        zero = torch.zeros((), dtype=dtype, device=x[0].device)
        x = torch.stack([t.expand(B, T, H, n).to(dtype) for t in x] + [zero.expand(B, T, H, n)] * (G - R), dim=2)
    else:
        x = as_operand(x, (B, T, H, R, n), dtype)
        x = torch.nn.functional.pad(x, (0, 0, 0, G - R)) if G > R else x
        x = x.transpose(2, 3)                                                            # [B, T, G, H, n]
    return x.reshape(B, T * G, H, n).contiguous()       # contiguous: at T = 1 the reshape is a strided view


def _head_rows(x, B, T, H, R):
    """A per-head factor as ``[B, T * G, H]`` term rows in its own dtype (fp32, bf16 or fp16): ``x``
    ``[B, T, H]`` (every term's), ``[B, T, H, R]`` or a sequence of R ``[B, T, H]`` tensors."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return _term_rows([t.unsqueeze(-1) for t in x], B, T, H, R, 1, io_dtype(x[0].dtype)).squeeze(-1)
    if x.dim() == 3:        # every term's: the same in the zero terms too (they multiply zero keys)
        x = x.unsqueeze(-1).expand(B, T, H, _group(R))
        R = _group(R)
    return _term_rows(x.unsqueeze(-1), B, T, H, R, 1, io_dtype(x.dtype)).squeeze(-1)


def chunk_rankr(v, p, c, oq, *, u=None, a=None, ps=None, initial_state=None, output_final_state: bool = False,
                chunk_size: int = 64, cu_seqlens=None):
    """H_t = a_t H_{t-1} - sum_i c_ti v_ti (u_ti^T H_{t-1}) + sum_i v_ti (ps_ti p_ti)^T;  o_t = H_t^T oq_t.

    The terms go to the kernels as ``T * R`` term rows (``[B, T, H, R, n] -> [B, T * R, H, n]``, one copy;
    R = 3 as 4, with a zero fourth term);
    each term argument (v, u, p; c, ps where per term) is a ``[B, T, H, R, ...]`` tensor or a sequence of
    R per-term tensors ``[B, T, H, ...]`` (stacked straight into term rows).

    Args:
        v:  the R erase (and insert) keys of each token [B, T, H, R, K].
        p:  the R inserted values [B, T, H, R, V].
        c:  per-head step [B, T, H] (every term's) or [B, T, H, R]. c that is ps (one tensor, the
            delta rule's beta) is read once and gets one gradient.
        oq: readout key [B, T, H, K].
        u:  read keys of the erase [B, T, H, R, K] or None (= v).
        a:  per-head decay [B, T, H], > 0, or None (= 1); once per token.
        ps: per-head scale of p, [B, T, H] or [B, T, H, R], or None (= 1); fused.
        initial_state: [B, H, K, V] (any float dtype; kept fp32) or None.
        output_final_state: also return the state [B, H, K, V] (fp32).
        chunk_size: 16, 32 or 64 term rows, at least 16 tokens: ``chunk_size / R >= 16`` (R = 3 counts 4).
        cu_seqlens: int32/int64 token offsets [N + 1] of N sequences packed in one row (B = 1, FLA's
            convention, as ``chunk_rank1``'s); initial and final states are then [N, H, K, V], and
            no chunk straddles two sequences: the result equals N separate calls.
    Returns:
        o [B, T, H, V] in p's dtype, final state [B, H, K, V] ([N, H, K, V] packed) fp32 or None.
    """
    seq = isinstance(v, (list, tuple))
    dt = (p[0] if seq else p).dtype
    if dt not in IO_DTYPES:
        raise ValueError(f"chunk_rankr: I/O dtype must be one of {IO_DTYPES}, got {dt}")
    B, T, H, K = oq.shape
    R = len(v) if seq else v.shape[3]
    V = (p[0] if seq else p).shape[-1]
    if chunk_size not in (16, 32, 64) or R not in (1, 2, 3, 4) or chunk_size // _group(R) < 16:
        raise ValueError(f"chunk_rankr: {R} terms per token need a chunk of 16, 32 or 64 term rows with at "
                         f"least 16 tokens, got chunk_size {chunk_size}")
    if c is None:
        raise ValueError("chunk_rankr: the step c is required (1 where the keys carry it)")
    packed = packed_chunks("chunk_rankr", cu_seqlens, oq, initial_state, chunk_size // _group(R))
    if T == 0:
        N = B if packed is None else packed.N
        o = oq.new_zeros(B, 0, H, V, dtype=dt)
        S = initial_state.float() if initial_state is not None else oq.new_zeros(N, H, K, V, dtype=torch.float32)
        return o, (S if output_final_state else None)
    hps = _head_rows(ps, B, T, H, R)
    hc = hps if c is ps else _head_rows(c, B, T, H, R)      # one tensor stays one (C_IS_PS)
    c_mode = C_IS_PS.value if c is ps else C_GIVEN.value
    h0 = None if initial_state is None else initial_state.float().contiguous()
    a = None if a is None else as_operand(a, (B, T, H), io_dtype(a.dtype))
    rows = (lambda x, n: None if x is None else _term_rows(x, B, T, H, R, n, dt))
    return Rank1ChunkFunction.apply(rows(v, K), rows(u, K), None, rows(p, V), hps, as_operand(oq, (B, T, H, K), dt),
                                    hc, a, h0, c_mode, output_final_state, chunk_size, _group(R), packed)


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if this family runs ``ir``, else the reason it does not."""
    if ir.kind != "rankr":
        return f"{ir.spec_name}: structure {ir.kind!r}, not rankr"
    if ir.readout is not None:
        return f"{ir.spec_name}: element-wise readout"
    if "B" in ir.slots:
        return f"{ir.spec_name}: the input term is not in the span of the v_r"
    L, R = ir.ranks()
    if R > 4 or L > 4:
        return f"{ir.spec_name}: {R} erase keys and {L} read keys; the chunked kernels take at most 4 of each"

    def dims(slot):
        co = ir.coefficient(slot)
        return None if co is None else tuple(co.dims)
    for slot in ir.erase_slots():
        if dims(slot) != ():
            return f"{ir.spec_name}: step {slot} has dims {dims(slot)}, not per head ()"
    if dims("a") not in (None, ()):
        return f"{ir.spec_name}: decay a has dims {dims('a')}, not per head ()"
    for slot in [f"u{l}" for l in range(L)] + [f"v{r}" for r in range(R)] + ["oq"]:
        if dims(slot) != ("m",):
            return f"{ir.spec_name}: slot {slot} has dims {dims(slot)}, not (m,)"
    for slot in ir.input_slots() + ["oc", "oh"]:
        if dims(slot) not in (None, (), ("d",)):
            return f"{ir.spec_name}: slot {slot} has dims {dims(slot)}, not (d,) or per head"
    return None


def per_head_step(ir) -> bool:
    """A rank-r update whose row factors ``c_rl`` are one number per head: on CUDA the chunked kernel
    is the fast one, so it is tried before ``rankr_row``."""
    return ir.kind == "rankr" and ir.is_per_head_step()


def _diagonal(ir) -> bool:
    """True when the row factors are ``c_rr`` only (no fold: each term keeps its read key ``u_r``)."""
    L, R = ir.ranks()
    return L == R and all(s[1] == s[2] for s in ir.erase_slots())


def _layout_args(ir, binds, get, split, same, B, T, H, d, m, dev, io):
    """``chunk_rankr``'s (v, p, c, oq, u, a, ps) from slot values: ``get(slot, default)`` gives a
    tensor in FLA layout (``[B, T, H, n]``, ``[B, T, H]``) or a number, ``split(slot)`` a ``p{r}`` as
    (per-head scale or None, vector), ``same(slot, slot)`` whether two slots hold one value.
    ``binds``: the slots' ``Binding``s, which tell where a per-head scale is fused in the kernels, or
    None (laid-out coefficients, an exported module's ``forward``: nothing is fused)."""
    L, R = ir.ranks()

    v = [get(f"v{r}") for r in range(R)]
    # p_r = ps x_r with one per-head scale for every term: the scale is fused in the kernels
    parts = [split(s) for s in (f"p{r}" for r in range(R))] if len(ir.input_slots()) == R else None
    if parts and all(b is not None for b, _ in parts) and len({binds[f"p{r}"].scale for r in range(R)}) == 1:
        ps, xs = parts[0][0], [x for _, x in parts]
    else:
        ps, xs = None, [get(f"p{r}", 0.0) for r in range(R)]
    # a per-head or constant p_r is the same value in every row
    p = [(x.unsqueeze(-1) if x.dim() == 3 else x) if isinstance(x, torch.Tensor) else torch.full((1,), float(x), device=dev)
         for x in xs]

    def head(slot, default):
        return _per_head(get(slot, default), B, T, H, dev)
    if _diagonal(ir):
        cs = [f"c{r}{r}" for r in range(R)]
        if ps is not None and all(binds[s].kind == "leaf" and binds[s].leaf == binds["p0"].scale for s in cs):
            c = ps                                             # the delta rule's beta: C_IS_PS
        elif all(same(s, cs[0]) for s in cs):
            c = head("c00", 0.0)
        else:
            c = [head(s, 0.0) for s in cs]
        u = None if all(same(f"u{r}", f"v{r}") for r in range(R)) else [get(f"u{r}") for r in range(R)]
    else:   # fold the row factors into the read keys: u'_r = sum_l c_rl u_l, c = 1
        us = torch.stack([get(f"u{l}").float().expand(B, T, H, m) for l in range(L)], dim=3)     # [B, T, H, L, m]
        cf = torch.stack([torch.stack([head(f"c{r}{l}", 0.0).float() for l in range(L)], dim=-1)
                          for r in range(R)], dim=-2)                                             # [B, T, H, R, L]
        u = torch.matmul(cf, us).to(io)                                                          # [B, T, H, R, m]
        c = torch.ones((), device=dev).expand(B, T, H)
    a = _per_head(get("a", 1.0), B, T, H, dev, one_is_none=True)
    return v, [x.to(io) for x in p], c, get("oq"), u, a, ps


def forward(obj, lay, co, output_final_state):
    """Run the family on laid-out coefficients (``ssmcraft.ops.common.reference.layout``; an exported
    module's path): ``co`` slot -> tensor ``[B|1, T|1, H|1, r, c]`` or number. Returns (y [B, T, H, d]
    in lay.dtype, S_T [B, H, d, m] fp32 or None); autograd reaches every slot tensor and lay.S0."""
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    io = io_dtype(lay.out_dtype)
    dev = next(t for t in co.values() if isinstance(t, torch.Tensor)).device

    def get(slot, default=None):
        x = co.get(slot, default)
        if not isinstance(x, torch.Tensor):
            return x
        if x.shape[-2:] == (1, 1):                       # per head
            return x.expand(B, T, H, 1, 1).reshape(B, T, H)
        n = x.shape[-2] * x.shape[-1]                    # a vector over d ([.., d, 1]) or m ([.., 1, m])
        return x.expand(B, T, H, *x.shape[-2:]).reshape(B, T, H, n)
    v, p, c, oq, u, a, ps = _layout_args(obj.ir, None, get, lambda s: (None, get(s)), lambda s, t: co[s] is co[t],
                                         B, T, H, d, m, dev, io)
    h0 = None if lay.S0 is None else lay.S0.transpose(-1, -2)
    o, ht = chunk_rankr(v, p, c, oq, u=u, a=a, ps=ps, initial_state=h0,
                        output_final_state=output_final_state, chunk_size=CHUNK)
    S = None if ht is None else ht.transpose(-1, -2)
    return finish_laid_out(o.to(lay.dtype), co, B, T, H), S


def prepare(obj, lay):
    """The family's runner for one call signature (``lay`` from ``reference.validate``): slots that
    are plain inputs go to the kernels as they are, computed ones by ``slots.computed_path``.
    Returns ``fn(inputs, params, initial_state, output_final_state) -> (y [B,T,H,d], S_T [B,H,d,m] | None)``."""
    from ssmcraft.ops.common.slots import bindings, slot_runner
    binds = bindings(obj.ir)
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    out_dtype = lay.out_dtype
    io = io_dtype(out_dtype)

    def run(cs, initial_state, output_final_state, cu_seqlens=None):
        v, p, c, oq, u, a, ps = _layout_args(obj.ir, binds, cs.get, cs.split, lambda s, t: binds[s] == binds[t],
                                             B, T, H, d, m, cs.device, io)
        o, ht = chunk_rankr(v, p, c, oq, u=u, a=a, ps=ps,
                            initial_state=None if initial_state is None else initial_state.transpose(-1, -2),
                            output_final_state=output_final_state, chunk_size=CHUNK, cu_seqlens=cu_seqlens)
        return cs.finish(o).to(out_dtype), (None if ht is None else ht.transpose(-1, -2))
    return slot_runner(obj, lay, run)

