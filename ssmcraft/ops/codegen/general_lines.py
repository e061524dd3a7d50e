"""The general family's kernel building blocks (``ssmcraft.ops.codegen.general``): per-state variable
suffixes, the addressing of states, checkpoints (a mini-batch's anchors after the states), scratch and
packed sequences, and the lines that load, prefetch and store the step's leaves. ``step`` is
``general.Step``."""
from __future__ import annotations


def suffixes(step) -> list[str]:
    """Per-state suffix of the kernel's variables: ``sp``, ``st``, ``g`` with one state,
    ``sp0``, ``sp1``, ... with several."""
    return [""] if step.n_states == 1 else [str(i) for i in range(step.n_states)]


def checkpointed(step) -> list:
    """(index, variable) of every tile a checkpoint holds: the states, then a mini-batch's anchors."""
    sfx = suffixes(step)
    return [*enumerate(f"sp{x}" for x in sfx), *((step.n_states + i, f"ac{x}") for i, x in enumerate(sfx) if step.anchors)]


def n_checkpointed(step) -> int:
    return step.n_states * (2 if step.anchors else 1)


def anchor_reset(step, indent: str) -> list[str]:
    """A mini-batch's anchors become the running states at each MB-th step of a sequence."""
    return [f"{indent}ac{x} = tl.where(t % MB == 0, sp{x}, ac{x})" for x in suffixes(step) if step.anchors]


def scratch_slots(step) -> str:
    """Tiles per scratch block: the chunk's states, and for a mini-batch one more, the checkpoint's anchor."""
    return "(CHUNK + 1)" if step.anchors else "CHUNK"


def sbase(i: int, ns: int) -> str:
    """The (batch*head, state) index of a state tile: state i of ns, stacked after [B, H]."""
    return "i_bh.to(tl.int64)" if ns == 1 else f"(i_bh.to(tl.int64) * {ns} + {i})"


def ckbase(i: int, ns: int) -> str:
    """The index of state i's first checkpoint (``sequence_lines``'s ``ck_row``, ``c0``): checkpoints laid
    out [B, H, ns, NC, K, V], a packed row's [H, ns, NC, K, V] with every sequence's together."""
    return f"((ck_row * {ns} + {i}) * NCS + c0)" if ns > 1 else "(ck_row * NCS + c0)"


def sequence_lines(indent: str) -> list[str]:
    """The lines that give program row ``b`` its time steps: ``bos`` its first token row, ``T`` its
    length, ``NC`` its checkpoint count and (``ck_row``, ``NCS``, ``c0``) where its checkpoints start
    (``ckbase``). VARLEN: sequence ``b`` of a packed row (``CU`` its offsets, ``CO`` each sequence's
    first checkpoint, NC every sequence's checkpoints together; an empty sequence has none, and its
    first row is clamped into the row: its loads are never used); else batch row ``b``."""
    return [f"{indent}bos = b.to(tl.int64) * T",
            f"{indent}ck_row = i_bh.to(tl.int64)",
            f"{indent}c0 = 0",
            f"{indent}NCS = NC",
            f"{indent}if VARLEN:",
            f"{indent}    bos = tl.minimum(tl.load(CU + b), T - 1).to(tl.int64)",
            f"{indent}    T = tl.load(CU + b + 1) - tl.load(CU + b)",
            f"{indent}    ck_row = h.to(tl.int64)",
            f"{indent}    c0 = tl.load(CO + b)",
            f"{indent}    NC = tl.cdiv(T, CHUNK)"]


def partials_stride(indent: str) -> list[str]:
    """``NBT``, the token rows times the heads (B*T*H; a packed row's cu[N]*H): the stride of a row
    block's partial gradients of the leaves shared by the rows."""
    return [f"{indent}NBT = tl.num_programs(0).to(tl.int64) * T          # B*H*T: stride of a row block's partial gradients",
            f"{indent}if VARLEN:     # one packed row of cu[N] token rows",
            f"{indent}    NBT = tl.load(CU + tl.num_programs(0) // H).to(tl.int64) * H"]


def scr_block(i: int, ns: int) -> str:
    """The scratch block of state i of ns in program (batch*head, row block): blocks of
    ``scratch_slots * BK * BV`` ordered [B*H, NV, ns]."""
    blk = "(i_bh.to(tl.int64) * tl.num_programs(1) + i_v)"
    return blk if ns == 1 else f"({blk} * {ns} + {i})"


def _leaf_load(name, ldims, step, indent, var=None, row="row") -> str:
    """The line loading leaf ``name`` at step ``row`` (a row index of ``[B, T, H]``) into ``var``
    (default ``l_<name>``) as it lies in memory (its dtype, 1D for a vector): ``_leaf_take`` makes
    it an fp32 value over the tile where the step reads it."""
    d, m = step.dims
    v = var or f"l_{name}"
    if tuple(ldims) == (d,):
        return f"{indent}{v} = tl.load(P_{name} + {row} * V + offs_v, mask=mask_v, other=0.)"
    if tuple(ldims) == (m,):
        return f"{indent}{v} = tl.load(P_{name} + {row} * K + offs_k, mask=mask_k, other=0.)"
    if not ldims:
        return f"{indent}{v} = tl.load(P_{name} + {row})"
    # [d, m] leaf laid out [B, T, H, V, K]
    return (f"{indent}{v} = tl.load(P_{name} + {row} * V * K + offs_v[None, :] * K + offs_k[:, None], "
            f"mask=MASK, other=0.)")


def _leaf_take(name, ldims, step, indent) -> str:
    """``l_<name>``, the step's fp32 value over the tile, from the value loaded a step ahead
    (``n_<name>``). Converted here, not at the load: a vector's conversion to the tile's layout
    goes through shared memory and waits for the load, which at the load would stall every step
    for the full memory latency; here it waits on a load issued a step before."""
    d, m = step.dims
    bcast = "[None, :]" if tuple(ldims) == (d,) else "[:, None]" if tuple(ldims) == (m,) else ""
    return f"{indent}l_{name} = n_{name}.to(tl.float32){bcast}"


def _leaf_prefetch(name, ldims, step, indent, row) -> list[str]:
    """An L2 prefetch of leaf ``name`` at step ``row`` (nothing waits on it). Scalars are left
    out: a head's scalars of several steps share one cache line."""
    d, m = step.dims
    if tuple(ldims) == (d,):
        return [f"{indent}prefetch_l2(P_{name} + {row} * V + offs_v)"]
    if tuple(ldims) == (m,):
        return [f"{indent}prefetch_l2(P_{name} + {row} * K + offs_k)"]
    if not ldims:
        return []
    return [f"{indent}prefetch_l2(P_{name} + {row} * V * K + offs_v[None, :] * K + offs_k[:, None])"]


def loads_ahead(step, indent, row_next) -> list[str]:
    """Lines that take this step's leaves from the values loaded one step ahead (``n_<name>``)
    and load the next step's (at ``row_next``): the loads' latency overlaps the step's work
    instead of starting its dependency chain."""
    take = [_leaf_take(n, ld, step, indent) for n, ld, _ in step.leaves]
    return take + [_leaf_load(n, ld, step, indent, f"n_{n}", row_next) for n, ld, _ in step.leaves]


def first_loads(step, indent, row) -> list[str]:
    """The loads ahead of a loop's first step (``loads_ahead``), at ``row`` (an expression)."""
    return [f"{indent}row_n = {row}", *(_leaf_load(n, ld, step, indent, f"n_{n}", "row_n") for n, ld, _ in step.leaves)]


def prefetches(step, indent, row, dy=False) -> list[str]:
    """L2 prefetches of every leaf (and ``DY`` if ``dy``) at step ``row``."""
    lines = [line for n, ld, _ in step.leaves for line in _leaf_prefetch(n, ld, step, indent, row)]
    return lines + ([f"{indent}prefetch_l2(DY + {row} * V + offs_v)"] if dy else [])


def dy_load(indent, var, row) -> str:
    """The load of the output's cotangent at step ``row`` as it lies in memory (see ``_leaf_take``)."""
    return f"{indent}{var} = tl.load(DY + {row} * V + offs_v, mask=mask_v, other=0.)"


def leaf_store(name, ldims, step, value, indent) -> list[str]:
    """The lines that write leaf ``name``'s gradient at this step, in its buffer's dtype. A leaf
    shared by the rows (over ``m`` or per head) gets one value per row block: ``ATOMIC``, every
    block adds it into one fp32 buffer; else each stores its partial at its block's offset
    (``partials_stride``) for the host to sum."""
    d, m = step.dims
    if tuple(ldims) == (d,):
        return [f"{indent}tl.store(D_{name} + row * V + offs_v, tl.sum({value} + ZR, axis=0).to(D_{name}.dtype.element_ty), "
                "mask=mask_v)"]
    if tuple(ldims) in ((m,), ()):
        if ldims:
            ptr, val, mask = "row * K + offs_k", f"tl.sum({value} + ZC, axis=1)", ", mask=mask_k"
        else:
            ptr, val, mask = "row", f"tl.sum(tl.sum({value} + Z11, axis=1), axis=0)", ""
        block = f"i_v * NBT{' * K' if ldims else ''}"
        return [f"{indent}if ATOMIC:",
                f"{indent}    tl.atomic_add(D_{name} + {ptr}, {val}{mask}, sem=\"relaxed\")",
                f"{indent}else:",
                f"{indent}    tl.store(D_{name} + {block} + {ptr}, ({val}).to(D_{name}.dtype.element_ty){mask})"]
    return [f"{indent}tl.store(D_{name} + row * V * K + offs_v[None, :] * K + offs_k[:, None], "
            f"({value} + Z2).to(D_{name}.dtype.element_ty), mask=MASK)"]


IN1, IN2, IN3 = " " * 8, " " * 12, " " * 16
PREAMBLE = [
    "    i_bh = tl.program_id(0)",
    "    i_v = tl.program_id(1)",
    "    b = i_bh // H",
    "    h = i_bh % H",
    "    offs_v = i_v * BV + tl.arange(0, BV)",
    "    offs_k = tl.arange(0, BK)",
    "    mask_v = (offs_v < V) | EVEN      # EVEN (BK == K, BV divides V): no padding, the masks fold away",
    "    mask_k = (offs_k < K) | EVEN",
    "    MASK = mask_k[:, None] & mask_v[None, :]",
    "    tile = offs_k[:, None] * V + offs_v[None, :]",
    "    V_f = V * 1.0",
    "    K_f = K * 1.0",
    "    ZR = tl.zeros([1, BV], dtype=tl.float32)",
    "    ZC = tl.zeros([BK, 1], dtype=tl.float32)",
    "    Z2 = tl.zeros([BK, BV], dtype=tl.float32)",
    "    Z11 = tl.zeros([1, 1], dtype=tl.float32)",
]


# generated code imports nothing but triton (``ssmcraft.compiler.safe_source``): its own copy of
# the L2 prefetch (``ssmcraft.ops.rank1_row.fwd.prefetch_l2``)
PREFETCH_L2 = [
    "@triton.jit",
    "def prefetch_l2(ptrs):",
    '    """Ask L2 for the cache lines behind ``ptrs`` (no register result is waited on)."""',
    '    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],',
    "                              dtype=tl.int32, is_pure=False, pack=1)",
]
