"""The generator of the diagonal family's kernels: from an objective's IR to Triton source.

``plan`` reads the IR (sympy) into the coefficient graph the kernels compute (leaves, nodes,
slots); ``_Gen`` prints the six kernels of ``ssmcraft.ops.diagonal.chunk`` (its docstring says what
they do); ``source`` is the module text. Only ssmcraft itself runs this: the kernels and their
host code (``diagonal.py``) need no sympy, so an exported module carries the text this writes
(``ssmcraft.ops.diagonal.chunk.export_tail``).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ssmcraft.compiler import safe_source
from ssmcraft.ops.diagonal.plan import PREFETCH_DEPTH, Leaf, Plan
from ssmcraft.ops.codegen.triton_printer import LIBDEVICE_IMPORT, triton_code


@dataclass
class _Node:
    name: str
    expr: sympy.Expr         # a coefficient's expression, or a reduction's body
    dims: frozenset
    over: str | None         # "m" for an in-kernel reduction
    var: str


def unsupported(ir) -> str | None:
    """None if the diagonal kernels run ``ir``, else why not (``diagonal.supports``)."""
    if ir.kind not in ("scalar_decay", "diagonal_decay"):
        return f"the diagonal family runs scalar/elementwise decays, not {ir.kind}"
    if ir.readout is not None:
        return "the readout is not of the form oc . (S oq) + oh"
    for slot in ("a", "oc", "oq"):
        if slot not in ir.slots:
            return f"slot {slot!r} missing"
    if not (("p" in ir.slots and "q" in ir.slots) or "B" in ir.slots):
        return "no input term (p q^T or B)"
    row, _ = ir.dims
    for r in ir.reductions:
        if r.over == row:
            return f"reduction {r.name} over {row} (a value dimension) is not fused into the kernel"
    try:
        plan(ir)
    except NotImplementedError as e:
        return str(e)
    return None


def plan(ir) -> Plan:
    row, col = ir.dims

    def norm(dims):
        return frozenset("d" if x == row else "m" for x in dims)

    table = {}                        # name -> dims of every symbol
    leaf_all = {}
    for n, dims in ir.inputs.items():
        leaf_all[n] = Leaf(n, norm(dims), "tok", f"L_{n}")
    for n, dims in ir.params.items():
        leaf_all[n] = Leaf(n, norm(dims), "param", f"L_{n}")
    for lf in leaf_all.values():
        table[lf.name] = lf.dims
    node_all = {}
    for r in ir.reductions:
        dims = frozenset().union(*[table[s.name] for s in r.body.free_symbols]) - {"m"}
        node_all[r.name] = _Node(r.name, r.body, dims, "m", "N" + r.name)
        table[r.name] = dims
    for c in ir.coefficients:
        dims = frozenset().union(*[table[s.name] for s in c.expr.free_symbols]) if c.expr.free_symbols else frozenset()
        node_all[c.name] = _Node(c.name, c.expr, dims, None, "N" + c.name)
        table[c.name] = dims
    slots = {}
    for slot in ("a", "p", "q", "B", "oc", "oq", "oh"):
        if slot not in ir.slots or ir.slots[slot] is None:
            continue
        name = ir.slots[slot]
        node = node_all[name]
        slots[slot] = node.expr if node.expr.is_number else name
    # keep only what the slots need
    need, stack = set(), [v for v in slots.values() if isinstance(v, str)]
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        if n in node_all:
            stack += [s.name for s in node_all[n].expr.free_symbols]
    leaves = {n: lf for n, lf in leaf_all.items() if n in need}
    nodes = {n: nd for n, nd in node_all.items() if n in need}
    names = {lf.name: lf.var for lf in leaves.values()} | {nd.name: nd.var for nd in nodes.values()}
    for nd in nodes.values():
        triton_code(nd.expr, names)              # raises NotImplementedError if unprintable
        for s in nd.expr.free_symbols:
            triton_code(sympy.diff(nd.expr, s), names)
    return Plan(ir, leaves, nodes, slots, table)


# ======================================================================================
# Kernel source generator
# ======================================================================================

# the propagate kernels' first lines: one program per (value block, batch * head), one state tile
_PROPAGATE_HEAD = ["    i_v = tl.program_id(0)",
                   "    i_bh = tl.program_id(1)",
                   "    ok = tl.arange(0, BK)[:, None]",
                   "    ov = i_v * BV + tl.arange(0, BV)[None, :]",
                   "    mkv = (ok < K) & (ov < V)",
                   "    st = ok * V + ov"]


class _Gen:
    """Prints the six kernels of one plan (``pad_k``: BK > K; ``ls`` unrolled steps per sub-chunk;
    ``fast_math``: exp as libdevice's ``fast_expf``, for GPU-compiled code, see triton_printer)."""

    def __init__(self, plan: Plan, pad_k: bool, ls: int, fast_math: bool):
        self.p = plan
        self.pad_k = pad_k
        self.ls = ls
        self.fast_math = fast_math
        self.names = {lf.name: lf.var for lf in plan.leaves.values()} | {nd.name: nd.var for nd in plan.nodes.values()}
        # exp(c x): scale c by log2 e where a thread holds one value of it (a [1, BV] column or a
        # scalar: one multiply per step), else where it is a param (once, before the time loops)
        self.scaled = (frozenset(lf.name for lf in plan.leaves.values() if "m" not in lf.dims),
                       frozenset(lf.name for lf in plan.param_leaves))

    # -- small printers ----------------------------------------------------------------
    def code(self, e) -> str:
        return triton_code(e, self.names, self.fast_math, self.scaled)

    def msum(self, x: str) -> str:
        if self.pad_k:
            x = f"tl.where(mk, {x}, 0.0)"
        return f"tl.sum({x}, axis=0, keep_dims=True)"

    @staticmethod
    def dsum(x: str, tile: bool = False) -> str:
        if tile:   # [BK, BV] -> [BK, 1]: on tensor cores when DOTRED (see _vsum)
            return f"_vsum(tl.where(mv, {x}, 0.0), BV, DOTRED)"
        return f"tl.sum(tl.where(mv, {x}, 0.0), axis=1, keep_dims=True)"

    def dims(self, e) -> frozenset:
        if isinstance(e, str):
            return self.p.dims_of_name[e]
        return frozenset().union(*[self.p.dims_of_name[s.name] for s in e.free_symbols]) if e.free_symbols else frozenset()

    def reduce(self, code: str, actual: frozenset, logical: frozenset, target: frozenset):
        """Sum ``code`` (values of dims ``logical``, materialised over ``actual``) down to ``target``."""
        for dim in sorted(logical - target):
            if dim in actual:
                code = self.dsum(code, tile="m" in actual) if dim == "d" else self.msum(code)
                actual = actual - {dim}
            else:   # broadcast along dim: the sum is a count times the value
                code = f"({code}) * {'nvv' if dim == 'd' else 'K'}"
        return code, actual

    def slot(self, s: str) -> str:
        v = self.p.slots.get(s)
        if v is None:
            return None
        return self.code(v) if not isinstance(v, str) else self.p.nodes[v].var

    def slot_dims(self, s: str) -> frozenset:
        v = self.p.slots[s]
        return self.dims(v)

    def need_for(self, slots) -> set:
        need, stack = set(), [self.p.slots[s] for s in slots if isinstance(self.p.slots.get(s), str)]
        while stack:
            n = stack.pop()
            if n in need:
                continue
            need.add(n)
            if n in self.p.nodes:
                stack += [s.name for s in self.p.nodes[n].expr.free_symbols]
        return need

    # -- pieces of kernels -------------------------------------------------------------
    def leaf_args(self, grads: bool = False) -> str:
        args = []
        for lf in self.p.leaves.values():
            args.append(f"p_{lf.name}")
            if lf.kind == "param":
                args.append(f"hs_{lf.name}")
        if grads:
            for lf in self.p.leaves.values():
                args.append(f"g_{lf.name}")
        return ", ".join(args)

    def prologue(self, ind: str, group_offset: int = 0) -> list[str]:
        g = "tl.program_id(2)" + (f" + {group_offset}" if group_offset else "")
        return [f"{ind}i_v = tl.program_id(0)",
                f"{ind}i_bh = tl.program_id(1)",
                f"{ind}i_g = {g}",
                f"{ind}i_b = i_bh // H",
                f"{ind}i_h = i_bh % H",
                f"{ind}bos = i_b.to(tl.int64) * T                # the sequence's first row",
                f"{ind}ok = tl.arange(0, BK)[:, None]          # [BK, 1]  key index (state dim m)",
                f"{ind}ov = i_v * BV + tl.arange(0, BV)[None, :]  # [1, BV]  value index (state dim d)",
                f"{ind}mk = ok < K",
                f"{ind}mv = (ov < V) | EVEN_V                  # EVEN_V: V % BV == 0, no value mask",
                f"{ind}mkv = mk & mv",
                f"{ind}nvv = tl.minimum(V - i_v * BV, BV).to(tl.float32)",
                f"{ind}st = ok * V + ov                            # offsets inside one [K, V] state"]

    def param_loads(self, ind: str, need: set) -> list[str]:
        out = []
        for lf in self.p.param_leaves:
            if lf.name not in need:
                continue
            idx, mask = self._index(lf.dims)
            m = "" if mask == "True" else f", mask={mask}, other=0.0"
            out.append(f"{ind}{lf.var} = tl.load(p_{lf.name} + i_h * hs_{lf.name} + {idx}{m}).to(tl.float32)")
        return out

    def _index(self, dims):
        """(offset, mask) of a leaf's tile; no key mask when BK == K (keeps the loads vectorised)."""
        if dims == {"d", "m"}:
            return "(ov * K + ok)", "mkv" if self.pad_k else "mv"
        if dims == {"d"}:
            return "ov", "mv"
        if dims == {"m"}:
            return "ok", "mk" if self.pad_k else "True"
        return "0", "True"

    @staticmethod
    def _width(dims):
        return {frozenset({"d"}): "V", frozenset({"m"}): "K", frozenset(): "1"}[frozenset(dims)]

    @staticmethod
    def _tok_line(ind: str, t: str, tok: str) -> str:
        """The line defining ``tok``, the flat (batch, time, head) index of step ``t``."""
        return f"{ind}{tok} = (bos + {t}) * H + i_h"

    def tok_loads(self, ind: str, t: str | None, need: set, tmask: str | None, suffix: str = "",
                  tok: str = "tok") -> list[str]:
        """Lines loading step ``t``'s token leaves into their variables (``suffix``: a prefetch set's);
        ``t`` None: the token index ``tok`` is defined already."""
        out = [self._tok_line(ind, t, tok)] if t is not None else []
        for lf in self.p.tok_leaves:
            if lf.name not in need:
                continue
            idx, mask = self._index(lf.dims)
            w = self._width(lf.dims)
            off = f"{tok} * {w} + {idx}" if w != "1" else tok
            if tmask is not None:
                mask = f"{mask} & {tmask}" if mask != "True" else tmask
            m = "" if mask == "True" else f", mask={mask}, other=0.0"
            out.append(f"{ind}{lf.var}{suffix} = tl.load(p_{lf.name} + {off}{m}).to(tl.float32)")
        return out

    def with_set(self, suffix: str, lines):
        """``lines()`` printed with the token leaves read from prefetch set ``suffix``'s variables."""
        saved = self.names
        self.names = saved | {lf.name: lf.var + suffix for lf in self.p.tok_leaves}
        try:
            return lines()
        finally:
            self.names = saved

    def node_lines(self, ind: str, need: set) -> list[str]:
        out = []
        for nd in self.p.nodes.values():
            if nd.name not in need:
                continue
            if nd.over == "m":
                body = self.code(nd.expr)
                if "m" in self.dims(nd.expr):
                    out.append(f"{ind}{nd.var} = {self.msum(body)}")
                else:
                    out.append(f"{ind}{nd.var} = ({body}) * K")
            else:
                out.append(f"{ind}{nd.var} = {self.code(nd.expr)}")
        return out

    def coefficients(self, ind: str, t: str, slots, tmask=None, tok: str = "tok") -> list[str]:
        need = self.need_for(slots)
        return self.tok_loads(ind, t, need, tmask, tok=tok) + self.node_lines(ind, need)

    def input_term(self) -> str:
        if "B" in self.p.slots:
            return self.slot("B")
        return f"{self.slot('q')} * {self.slot('p')}"

    def update(self, ind: str, s_in: str, s_out: str, tmask: str | None = None) -> list[str]:
        a = self.slot("a")
        new = f"{s_in} + {self.input_term()}" if self.p.slots["a"] == 1 else f"{a} * {s_in} + {self.input_term()}"
        if tmask is not None:
            new = f"tl.where({tmask}, {new}, {s_in})"
        return [f"{ind}{s_out} = {new}"]

    def readout(self, S: str) -> str:
        oq = self.slot("oq")
        y = self.msum(f"{S} * {oq}")
        oc = self.slot("oc")
        y = f"{y} * {oc}" if self.p.slots["oc"] != 1 else y
        if "oh" in self.p.slots:
            y = f"{y} + {self.slot('oh')}"
        return y

    # -- kernels -----------------------------------------------------------------------
    def fwd_summary(self) -> list[str]:
        need = self.need_for(("a", "p", "q", "B"))
        i = " " * 4
        out = ['@triton.jit(do_not_specialize=["T", "NC", "NG", "CPG"])',
               f"def diagonal_fwd_summary_kernel({self.leaf_args()}, A_out, S_out, cu, co, gi, T, H, K, V, NC, NG, CPG, L,",
               "                BK: tl.constexpr, BV: tl.constexpr, EVEN_V: tl.constexpr, VARLEN: tl.constexpr):",
               '    """Per group g < NG-1: A_g = prod_t a_t and S_g = the group\'s end state from a zero start."""',
               *self.prologue(i),
               *self.packed_sequence(i),
               *self.param_loads(i, need),
               f"{i}S = tl.zeros([BK, BV], dtype=tl.float32)",
               f"{i}A = tl.full([BK, BV], 1.0, dtype=tl.float32)",
               f"{i}t0 = i_gs * CPG * L",
               f"{i}t1 = tl.minimum(t0 + CPG * L, T)",
               f"{i}for t in range(t0, t1):",
               *self.coefficients(i * 2, "t", ("a", "p", "q", "B")),
               *self.update(i * 2, "S", "S"),
               f"{i}{i}A = A * {self.slot('a')}" if self.p.slots["a"] != 1 else f"{i}{i}pass",
               f"{i}off = (i_bh * NG + i_g).to(tl.int64) * K * V + st",
               f"{i}tl.store(A_out + off, A, mask=mkv)",
               f"{i}tl.store(S_out + off, S, mask=mkv)"]
        return out

    @staticmethod
    def fwd_propagate() -> list[str]:
        return ['@triton.jit(do_not_specialize=["NG"])',
                "def diagonal_fwd_propagate_kernel(h0, A_in, S_in, h_start, gi, H, K, V, NG, BK: tl.constexpr, BV: tl.constexpr,",
                "                  HAS_H0: tl.constexpr, VARLEN: tl.constexpr):",
                '    """Sequential over groups: h_start[g] = state before group g (h_start[0] = h0). VARLEN: the',
                '    groups of every sequence of a packed row (``gi``), each sequence\'s first from its own h0."""',
                *_PROPAGATE_HEAD,
                "    S = tl.zeros([BK, BV], dtype=tl.float32)",
                "    if HAS_H0:",
                "        S = tl.load(h0 + i_bh.to(tl.int64) * K * V + st, mask=mkv, other=0.0).to(tl.float32)",
                "    for g in range(0, NG):",
                "        if VARLEN:",
                "            n = tl.load(gi + 2 * g)",
                "            S0 = tl.zeros([BK, BV], dtype=tl.float32)",
                "            if HAS_H0:",
                "                S0 = tl.load(h0 + (n * H + i_bh).to(tl.int64) * K * V + st, mask=mkv, other=0.0).to(tl.float32)",
                "            S = tl.where(tl.load(gi + 2 * g + 1) == 0, S0, S)      # a sequence's first group",
                "        off = (i_bh * NG + g).to(tl.int64) * K * V + st",
                "        tl.store(h_start + off, S, mask=mkv)",
                "        if g < NG - 1:",
                "            S = tl.load(A_in + off, mask=mkv, other=0.0) * S + tl.load(S_in + off, mask=mkv, other=0.0)"]

    @staticmethod
    def packed_sequence(ind: str) -> list[str]:
        """The group kernels' lines that place program (row ``i_bh``, group ``i_g``): its first row
        ``bos``, its sequence's length ``T`` and chunk count ``NC``, the index ``cb`` of the sequence's
        first chunk among the checkpoints ``[rows, NC, K, V]``, the group's index ``i_gs`` within its
        sequence, and the row ``i_sh`` of the sequence's states (h0, ht, dh0). VARLEN: a packed row
        (B = 1, program rows the heads) whose groups never straddle two sequences: ``gi [NG, 2]``
        holds each group's (sequence, index within it), ``-1`` past the last group (the program returns),
        ``cu`` the offsets and ``co`` each sequence's first chunk (``rows.device_chunks``); else
        group ``i_g`` of batch row ``i_b``."""
        return [f"{ind}cb = i_bh.to(tl.int64) * NC                 # the sequence's first checkpoint",
                f"{ind}i_gs = i_g",
                f"{ind}i_sh = i_bh",
                f"{ind}if VARLEN:",
                f"{ind}    n = tl.load(gi + 2 * i_g)",
                f"{ind}    i_gs = tl.load(gi + 2 * i_g + 1)",
                f"{ind}    bos = tl.load(cu + n).to(tl.int64)",
                f"{ind}    T = tl.load(cu + n + 1) - tl.load(cu + n)",
                f"{ind}    cb = i_h.to(tl.int64) * NC + tl.load(co + n)",
                f"{ind}    NC = tl.cdiv(T, L)",
                f"{ind}    i_sh = n * H + i_h",
                f"{ind}if i_gs < 0:      # a group past the packed row's last",
                f"{ind}    return"]

    def fwd_main(self) -> list[str]:
        need = self.need_for(("a", "p", "q", "B", "oc", "oq", "oh"))
        i = " " * 4
        return ['@triton.jit(do_not_specialize=["T", "NC", "NG", "CPG"])',
                f"def diagonal_fwd_main_kernel({self.leaf_args()}, h_start, y, ckpt, ht, cu, co, gi, T, H, K, V, NC, NG, CPG, L,",
                "             BK: tl.constexpr, BV: tl.constexpr, SAVE: tl.constexpr, STORE_FINAL: tl.constexpr,",
                "             EVEN_V: tl.constexpr, EVEN_T: tl.constexpr, PREFETCH: tl.constexpr, VARLEN: tl.constexpr):",
                '    """Per group: from its start state, every step\'s state and output; chunk-start states',
                '    ckpt[b*H+h, c] (SAVE) and the final state (STORE_FINAL, last group). PREFETCH: the token',
                f'    leaves are loaded {PREFETCH_DEPTH} steps before their step (needs L % {PREFETCH_DEPTH} == 0), so a pass with few',
                '    programs per SM (one group) does not wait on memory every step."""',
                *self.prologue(i),
                *self.packed_sequence(i),
                *self.param_loads(i, need),
                f"{i}S = tl.load(h_start + (i_bh * NG + i_g).to(tl.int64) * K * V + st, mask=mkv, other=0.0)",
                f"{i}c0 = i_gs * CPG",
                f"{i}c1 = tl.minimum(c0 + CPG, NC)",
                f"{i}if PREFETCH:   # {PREFETCH_DEPTH}-deep register prefetch: set j holds step tb + j, refilled with tb + j + {PREFETCH_DEPTH}",
                *self._prefetched_steps(i * 2, need),
                f"{i}else:",
                *self._chunk_head(i * 2),
                f"{i}{i}{i}for t in range(c * L, tl.minimum(c * L + L, T)):",
                *self.coefficients(i * 4, "t", ("a", "p", "q", "B", "oc", "oq", "oh")),
                *self.update(i * 4, "S", "S"),
                f"{i}{i}{i}{i}o = {self.readout('S')}",
                f"{i}{i}{i}{i}tl.store(y + tok * V + ov, o, mask=mv)",
                f"{i}if STORE_FINAL:",
                f"{i}{i}tl.store(ht + i_sh.to(tl.int64) * K * V + st, S, mask=mkv & (c1 >= NC))   # the sequence's last group"]

    @staticmethod
    def _chunk_head(ind: str) -> list[str]:
        """diagonal_fwd_main_kernel's loop over its group's chunks, storing each chunk's start state when SAVE."""
        return [f"{ind}for c in range(c0, c1):",
                f"{ind}    if SAVE:",
                f"{ind}        tl.store(ckpt + (cb + c) * K * V + st, S, mask=mkv)"]

    def _prefetched_steps(self, ind: str, need: set) -> list[str]:
        """diagonal_fwd_main_kernel's time loop with the token leaves loaded PREFETCH_DEPTH steps ahead (variables suffixed by the
        set); loads past the end read step T-1 (clamped), and those steps are masked off."""
        i = " " * 4
        out = [f"{ind}t_last = T - 1"]
        for j in range(PREFETCH_DEPTH):
            out += self.tok_loads(ind, f"tl.minimum(c0 * L + {j}, t_last)", need, None, f"_{j}", "tokp")
        out += [*self._chunk_head(ind), f"{ind}{i}for tb in range(c * L, c * L + L, {PREFETCH_DEPTH}):"]
        body = ind + i * 2
        for j in range(PREFETCH_DEPTH):
            out += [f"{body}# step tb + {j}, from set {j}",
                    f"{body}vt = (tb + {j} < T) | EVEN_T",
                    self._tok_line(body, f"tb + {j}", "tok")]
            out += self.with_set(f"_{j}", lambda: [*self.node_lines(body, need), *self.update(body, "S", "S", "vt"),
                                                   f"{body}o = {self.readout('S')}"])
            out.append(f"{body}tl.store(y + tok * V + ov, o, mask=mv & vt)")
            out += self.tok_loads(body, f"tl.minimum(tb + {j + PREFETCH_DEPTH}, t_last)", need, None, f"_{j}", "tokp")
        return out

    @staticmethod
    def _dy_load(ind: str, tmask: str, tok: str = "tok") -> str:
        """The line loading step ``tok``'s output cotangent into ``dyt`` (fp32)."""
        return f"{ind}dyt = tl.load(dy + {tok} * V + ov, mask=mv{' & ' + tmask if tmask else ''}, other=0.0).to(tl.float32)"

    def _ocdy(self, ind: str) -> str:
        """The line defining ``ocdy`` = oc . dy (the readout's adjoint is R = oq (oc dy)^T)."""
        return f"{ind}ocdy = {'dyt' if self.p.slots['oc'] == 1 else self.slot('oc') + ' * dyt'}"

    def bwd_summary(self) -> list[str]:
        need = self.need_for(("a", "oc", "oq"))
        i = " " * 4
        a = self.slot("a")
        return ['@triton.jit(do_not_specialize=["T", "NC", "NG", "CPG"])',
                f"def diagonal_bwd_summary_kernel({self.leaf_args()}, dy, A_out, E_out, cu, co, gi, T, H, K, V, NC, NG, CPG, L,",
                "                BK: tl.constexpr, BV: tl.constexpr, EVEN_V: tl.constexpr, VARLEN: tl.constexpr):",
                '    """Per group g >= 1: A_g = prod_t a_t and E_g = a_s . dS_s at its first step s from a zero',
                '    adjoint carried in at its end."""',
                *self.prologue(i, group_offset=1),
                *self.packed_sequence(i),
                *self.param_loads(i, need),
                f"{i}E = tl.zeros([BK, BV], dtype=tl.float32)",
                f"{i}A = tl.full([BK, BV], 1.0, dtype=tl.float32)",
                f"{i}t0 = i_gs * CPG * L",
                f"{i}t1 = tl.minimum(t0 + CPG * L, T)",
                f"{i}for tt in range(0, t1 - t0):",
                f"{i}{i}t = t1 - 1 - tt",
                *self.coefficients(i * 2, "t", ("a", "oc", "oq")),
                self._dy_load(i * 2, ""),
                self._ocdy(i * 2),
                f"{i}{i}dS = E + {self.slot('oq')} * ocdy",
                f"{i}{i}E = {a} * dS" if self.p.slots["a"] != 1 else f"{i}{i}E = dS",
                f"{i}{i}A = A * {a}" if self.p.slots["a"] != 1 else f"{i}{i}pass",
                f"{i}off = (i_bh * NG + i_g).to(tl.int64) * K * V + st",
                f"{i}tl.store(A_out + off, A, mask=mkv)",
                f"{i}tl.store(E_out + off, E, mask=mkv)"]

    @staticmethod
    def bwd_propagate() -> list[str]:
        return ['@triton.jit(do_not_specialize=["NG"])',
                "def diagonal_bwd_propagate_kernel(dht, A_in, E_in, e_end, gi, H, K, V, NG, BK: tl.constexpr, BV: tl.constexpr,",
                "                  HAS_DHT: tl.constexpr, VARLEN: tl.constexpr):",
                '    """Sequential over groups in reverse: e_end[g] = adjoint carried into group g at its end. VARLEN:',
                '    the groups of every sequence of a packed row (``gi``), each sequence\'s last from its own dht."""',
                *_PROPAGATE_HEAD,
                "    E = tl.zeros([BK, BV], dtype=tl.float32)",
                "    if HAS_DHT:",
                "        E = tl.load(dht + i_bh.to(tl.int64) * K * V + st, mask=mkv, other=0.0).to(tl.float32)",
                "    for gg in range(0, NG):",
                "        g = NG - 1 - gg",
                "        if VARLEN:",
                "            n = tl.load(gi + 2 * g)",
                "            E0 = tl.zeros([BK, BV], dtype=tl.float32)",
                "            if HAS_DHT:",
                "                E0 = tl.load(dht + (n * H + i_bh).to(tl.int64) * K * V + st, mask=mkv, other=0.0).to(tl.float32)",
                "            after = tl.load(gi + 2 * tl.minimum(g + 1, NG - 1) + 1)     # the next group's index in its sequence",
                "            E = tl.where((g == NG - 1) | (after <= 0), E0, E)           # a sequence's last group",
                "        off = (i_bh * NG + g).to(tl.int64) * K * V + st",
                "        tl.store(e_end + off, E, mask=mkv)",
                "        if g > 0:",
                "            E = tl.load(A_in + off, mask=mkv, other=0.0) * E + tl.load(E_in + off, mask=mkv, other=0.0)"]

    def bwd_step(self, ind: str, k: int) -> tuple[list, list, list]:
        """One reverse step at time ``t{k}`` (valid if ``v{k}``, token ``tok{k}``; states ``s{k}`` before
        it and ``s{k+1}`` after it): reads E (the adjoint a_{t+1} . dS_{t+1}),
        writes E = a_t . dS_t, the gradients of the per-token leaves, and accumulates the params'.
        Returns (loads, compute, stores); the stores read only this step's named values (``gl_*_{k}``,
        ``tok{k}``, ``v{k}``), so they can be printed after the next step's loads.

        Adjoints are terms ``(code, actual dims, logical dims, pending dims)``: the value is the sum
        of ``code`` over its pending dims. Reductions are deferred through single-use nodes (the
        chain rule's factors are constant along pending dims), so each leaf's gradient costs one
        reduction per group of terms rather than one per path."""
        p = self.p
        tv, tok, s_prev, s_cur = f"v{k}", f"tok{k}", f"s{k}", f"s{k + 1}"
        need = self.need_for(("a", "p", "q", "B", "oc", "oq", "oh"))
        loads = self.tok_loads(ind, None, need, tv, tok=tok) + [self._dy_load(ind, tv, tok)]
        out = self.node_lines(ind, need) + [self._ocdy(ind)]
        out.append(f"{ind}dS = E + {self.slot('oq')} * ocdy")
        full = frozenset({"d", "m"})
        adj: dict[str, list] = {}

        def slot_term(slot, code, act, lg):
            v = p.slots.get(slot)
            if isinstance(v, str):
                adj.setdefault(v, []).append((code, act, lg, lg - self.dims(v)))

        slot_term("a", f"dS * {s_prev}", full, full)
        if "B" in p.slots:
            slot_term("B", "dS", full, full)
        else:
            slot_term("p", f"dS * {self.slot('q')}", full, full)
            slot_term("q", f"dS * {self.slot('p')}", full, full)
        slot_term("oq", f"{s_cur} * ocdy", full, full)
        if isinstance(p.slots.get("oc"), str):
            out.append(f"{ind}ys = {self.msum(s_cur + ' * ' + self.slot('oq'))}")
            slot_term("oc", "dyt * ys", frozenset({"d"}), frozenset({"d"}))
        if "oh" in p.slots:
            slot_term("oh", "dyt", frozenset({"d"}), frozenset({"d"}))
        a = self.slot("a")
        out.append(f"{ind}E = tl.where({tv}, {a} * dS, E)" if p.slots["a"] != 1 else f"{ind}E = tl.where({tv}, dS, E)")

        combine, materialise = self._combine, self._materialise

        # reverse mode through the coefficient graph
        for nd in reversed(list(p.nodes.values())):
            if not adj.get(nd.name):
                continue
            terms = combine(adj[nd.name])
            kids = []
            for s in sorted(nd.expr.free_symbols, key=lambda s: s.name):
                J = sympy.diff(nd.expr, s)
                if J != 0:
                    kids.append((s.name, J))
            if len(kids) > 1 or len(terms) > 1:      # used more than once: reduce once, name it
                mats = [materialise(tm) for tm in terms]
                g = f"G{nd.var}"
                out.append(f"{ind}{g} = " + " + ".join(f"({c})" for c, _, _, _ in mats))
                terms = [(g, frozenset().union(*[m[1] for m in mats]), nd.dims, frozenset())]
            extra = frozenset({"m"}) if nd.over == "m" else frozenset()
            for name, J in kids:
                jd = self.dims(J)
                for tm in terms:
                    if (jd | extra) & tm[3]:
                        tm = materialise(tm)
                    code, act, lg, P = tm
                    code = code if J == 1 else f"({code}) * ({self.code(J)})"
                    lg = lg | nd.dims | jd | extra
                    act = act | jd
                    P = P | ((lg - P) - self.dims(name))
                    adj.setdefault(name, []).append((code, act, lg, P))
        self.grad_leaves = [lf.name for lf in p.leaves.values() if adj.get(lf.name)]
        stores = self._leaf_gradients(ind, k, adj, out)
        return loads, out, stores

    def _materialise(self, term):
        """An adjoint term with its pending dims summed out."""
        code, act, lg, P = term
        if not P:
            return term
        code, act = self.reduce(code, act, lg, lg - P)
        return code, act, lg - P, frozenset()

    def _leaf_gradients(self, ind: str, k: int, adj: dict, out: list) -> list[str]:
        """Each leaf's gradient at step ``k`` from its adjoint terms: a param's accumulated (lines
        appended to ``out``), a token leaf's computed into ``gl_<leaf>_<k>`` (``out``) and stored by
        the returned lines."""
        p, combine, materialise = self.p, self._combine, self._materialise
        tv, tok = f"v{k}", f"tok{k}"
        stores = []
        for lf in p.leaves.values():
            terms = adj.get(lf.name)
            if not terms:
                continue
            groups = combine(terms)
            mats = [materialise(tm) for tm in groups]
            gsum = " + ".join(f"({c})" for c, _, _, _ in mats)
            idx, mask = self._index(lf.dims)
            if lf.kind == "param":
                out.append(f"{ind}acc_{lf.name} += tl.where({tv}, {gsum}, 0.0)")
                continue
            val = f"gl_{lf.name}_{k}"
            w = self._width(lf.dims)
            base = f"{tok} * {w} + {idx}" if w != "1" else tok
            if "d" not in lf.dims:   # partial sum over this value block
                base = f"i_v.to(tl.int64) * NTOK * {w} + {base}"
            m = f"{mask} & {tv}" if mask != "True" else tv
            store = f"tl.store(g_{lf.name} + {base}{'' if lf.dims else ' + zero11'}, {val}, mask={m})"
            tile = self._one_tile_sum(groups, lf)
            if tile is None:
                out.append(f"{ind}{val} = {gsum}")
                stores.append(f"{ind}{store}")
                continue
            # the gradient is one value-axis sum of a [BK, BV] tile: by halving when HSUM
            hbase = f"i_v.to(tl.int64) * NTOK * K + {tok} * K + hm"
            out += [f"{ind}if HSUM:",
                    f"{ind}    {val} = _hsum(tl.where(mv, {tile}, 0.0), BK, BV, LOG_BK, LOG_BV)",
                    f"{ind}else:",
                    f"{ind}    {val} = {gsum}"]
            stores += [f"{ind}if HSUM:",
                       f"{ind}    tl.store(g_{lf.name} + {hbase}, {val}, mask=hmask & {tv})",
                       f"{ind}else:",
                       f"{ind}    {store}"]
        return stores

    @staticmethod
    def _combine(terms):
        """Adjoint terms grouped by their pending dims, each group's codes summed."""
        groups: dict = {}
        for code, act, lg, P in terms:
            groups.setdefault(P, []).append((code, act, lg))
        return [(" + ".join(f"({c})" for c, _, _ in g), frozenset().union(*[x for _, x, _ in g]),
                 frozenset().union(*[x for _, _, x in g]), P) for P, g in groups.items()]

    @staticmethod
    def _one_tile_sum(groups, lf):
        """The [BK, BV] tile whose value-axis sum is all of a key-indexed token leaf's gradient
        (``groups``: its adjoint terms, ``_combine``d), or None (then it is printed as others are)."""
        if lf.kind != "tok" or lf.dims != frozenset({"m"}):
            return None
        if len(groups) != 1:
            return None
        code, act, lg, P = groups[0]
        if P != frozenset({"d"}) or act != frozenset({"d", "m"}) or lg != frozenset({"d", "m"}):
            return None
        return code

    def bwd_main(self) -> list[str]:
        p = self.p
        need = self.need_for(("a", "p", "q", "B", "oc", "oq", "oh"))
        i = " " * 4
        ls = self.ls
        out = ['@triton.jit(do_not_specialize=["T", "NC", "NG", "CPG", "NTOK"])',
               f"def diagonal_bwd_main_kernel({self.leaf_args(grads=True)}, dy, ckpt, e_end, dh0, scratch, cu, co, gi, T, H, K, V, NC, NG, CPG, L,",
               "             NTOK, BK: tl.constexpr, BV: tl.constexpr, NSUB: tl.constexpr, NEED_DH0: tl.constexpr,",
               "             DOTRED: tl.constexpr, HSUM: tl.constexpr, LOG_BK: tl.constexpr, LOG_BV: tl.constexpr,",
               "             EVEN_V: tl.constexpr, EVEN_T: tl.constexpr, VARLEN: tl.constexpr):",
               '    """Per group, chunks in reverse: a forward pass over the chunk from its stored start state keeps',
               f'    the start of each sub-chunk of {ls} steps (L = {ls} * NSUB) in this program\'s scratch; then, sub-chunks',
               '    in reverse, their states are recomputed into registers and the adjoint stepped back through them."""',
               *self.prologue(i),
               *self.packed_sequence(i),
               *self.param_loads(i, need),
               f"{i}zero11 = tl.zeros([1, 1], dtype=tl.int64)",
               f"{i}if HSUM:   # the key whose value-axis sum lane j of _hsum holds, and the lanes that store it",
               f"{i}    hm = tl.arange(0, BV)[None, :] >> (LOG_BV - LOG_BK)",
               f"{i}    hmask = ((tl.arange(0, BV)[None, :] & ((BV >> LOG_BK) - 1)) == 0) & (hm < K)"]
        for lf in p.param_leaves:
            shape = {frozenset({"d", "m"}): "[BK, BV]", frozenset({"d"}): "[1, BV]", frozenset({"m"}): "[BK, 1]",
                     frozenset(): "[1, 1]"}[lf.dims]
            out.append(f"{i}acc_{lf.name} = tl.zeros({shape}, dtype=tl.float32)")
        out += [f"{i}E = tl.load(e_end + (i_bh * NG + i_g).to(tl.int64) * K * V + st, mask=mkv, other=0.0)",
                f"{i}# this program's scratch: the NSUB sub-chunk start states of the chunk in hand",
                f"{i}pid = (i_g * tl.num_programs(1) + i_bh) * tl.num_programs(0) + i_v",
                f"{i}scr = scratch + pid.to(tl.int64) * (NSUB * BK * BV)",
                f"{i}sc = tl.arange(0, BK)[:, None] * BV + tl.arange(0, BV)[None, :]",
                f"{i}c0 = i_gs * CPG",
                f"{i}c1 = tl.minimum(c0 + CPG, NC)",
                f"{i}for cc in range(0, c1 - c0):",
                f"{i}{i}c = c1 - 1 - cc",
                f"{i}{i}s0 = tl.load(ckpt + (cb + c) * K * V + st, mask=mkv, other=0.0)",
                f"{i}{i}tl.debug_barrier()   # the scratch's last readers are done",
                f"{i}{i}# forward through the chunk, keeping each sub-chunk's start state",
                *self._refill(i * 2),
                f"{i}{i}tl.debug_barrier()",
                f"{i}{i}for jj in range(0, NSUB):",
                f"{i}{i}{i}j = NSUB - 1 - jj",
                *self._subchunk(i * 3)]
        out += [f"{i}if NEED_DH0:",
                f"{i}{i}tl.store(dh0 + i_sh.to(tl.int64) * K * V + st, E, mask=mkv & (i_gs == 0))"]
        for lf in p.param_leaves:
            if lf.name not in [n for n in p.leaves]:
                continue
            idx, mask = self._index(lf.dims)
            w = {frozenset({"d", "m"}): "V * K", frozenset({"d"}): "V", frozenset({"m"}): "K", frozenset(): "1"}[lf.dims]
            nvp = "1" if "d" in lf.dims else "tl.num_programs(0)"
            blk = "0" if "d" in lf.dims else "i_v"
            out.append(f"{i}off_{lf.name} = ((i_g * {nvp} + {blk}) * (tl.num_programs(1)) + i_bh).to(tl.int64) * {w}")
            store_mask = mask if mask != "True" else "None"
            if lf.dims:
                out.append(f"{i}tl.store(g_{lf.name} + off_{lf.name} + {idx}, acc_{lf.name}, mask={store_mask})")
            else:
                out.append(f"{i}tl.store(g_{lf.name} + off_{lf.name} + zero11, acc_{lf.name})")
        return out

    def _refill(self, ind: str) -> list[str]:
        """diagonal_bwd_main_kernel's forward pass over a chunk from its checkpoint ``s0``: the start state of each
        sub-chunk stored in the scratch, the steps of all but the last sub-chunk taken ``LS`` at a time,
        unrolled, so that their loads are issued together. The backward main kernel holds about 255
        registers, so 8 warps per SM, too few to hide a load per step: a loop of single steps waits
        on each step's loads in turn; unrolled, the backward is faster (BENCHMARKS.md, "Diagonal").
        The same unrolling is slower in the summaries and the forward main kernel, which hold far
        fewer registers and so run enough warps to hide those loads."""
        ls = self.ls
        out = [f"{ind}for j in range(0, NSUB - 1):",
               f"{ind}    tl.store(scr + j * (BK * BV) + sc, s0)"]
        for k in range(ls):
            out += self._masked_step(ind + "    ", k, "r", "s0", "s0")
        return out + [f"{ind}tl.store(scr + (NSUB - 1) * (BK * BV) + sc, s0)"]

    def _masked_step(self, ind: str, k: int, pre: str, s_in: str, s_out: str) -> list[str]:
        """Step ``k`` of sub-chunk ``j`` forward, ``s_in`` -> ``s_out``, masked past T (its loads and
        its update). Names: the refill's (``pre`` "r") are ``r{k}``, ``rv{k}``, ``rtok{k}``; the
        sub-chunk recompute's (``pre`` "") ``t{k}``, ``v{k}``, ``tok{k}``, which the adjoint's steps
        read again."""
        t, v, tok = f"{pre or 't'}{k}", f"{pre}v{k}", f"{pre}tok{k}"
        return [f"{ind}{t} = c * L + j * {self.ls} + {k}", f"{ind}{v} = ({t} < T) | EVEN_T   # EVEN_T: T % L == 0",
                *self.coefficients(ind, t, ("a", "p", "q", "B"), tmask=v, tok=tok),
                *self.update(ind, s_in, s_out, tmask=v)]

    def _subchunk(self, ind: str) -> list[str]:
        """diagonal_bwd_main_kernel's sub-chunk ``j``: its ``LS`` states recomputed into registers from the scratch's
        start state, then the adjoint stepped back through them. Each step's stores are printed after
        the next step's loads: the compiler keeps a load after an earlier store (the pointers may
        alias), so stores printed right after their step make every step's loads wait behind them
        (slower: BENCHMARKS.md, "Diagonal"), and the lag also lets the adjoint
        share the last steps' loads and exps with the recompute."""
        ls = self.ls
        out = [f"{ind}s0 = tl.load(scr + j * (BK * BV) + sc)",
               f"{ind}# the sub-chunk's {ls} states, in registers"]
        for k in range(ls):
            out += self._masked_step(ind, k, "", f"s{k}", f"s{k + 1}")
        out.append(f"{ind}# the adjoint, back through them; each step's stores after the next step's loads")
        pending = []
        for k in reversed(range(ls)):
            loads, compute, stores = self.bwd_step(ind, k)
            out += [f"{ind}# step t{k}", *loads, *pending, *compute]
            pending = stores
        return out + pending

    def source(self, header: str) -> str:
        ir = self.p.ir
        doc = [f"Generated Triton kernels of {ir.spec_name!r} ({ir.kind}), diagonal family.", "",
               "Coefficients (computed in registers from their leaves):"]
        for nd in self.p.nodes.values():
            doc.append(f"    {nd.name} [{', '.join(sorted(nd.dims))}] = "
                       + (f"sum_m {sympy.sstr(nd.expr)}" if nd.over else sympy.sstr(nd.expr)))
        doc.append("Slots: " + ", ".join(f"{s} = {v}" for s, v in self.p.slots.items()))
        doc.append("Leaves: " + ", ".join(f"{lf.name} [{', '.join(sorted(lf.dims))}] ({lf.kind})" for lf in self.p.leaves.values()))
        doc += [f"K padded: {self.pad_k}; unrolled steps per sub-chunk LS = {self.ls}; "
                f"exp: {'libdevice.fast_expf (GPU)' if self.fast_math else 'tl.exp'}.", ""]
        kernels = [self.fwd_summary(), self.fwd_propagate(), self.fwd_main(),
                   self.bwd_summary(), self.bwd_propagate(), self.bwd_main()]
        parts = [safe_source.comment(header), "# Generated by ssmcraft.ops.codegen.diagonal: edit the spec or the generator, not this file.",
                 safe_source.docstring("\n".join(doc)), "import triton", "import triton.language as tl",
                 *([LIBDEVICE_IMPORT] if self.fast_math else []), "", "", *_VSUM, "", *_HSUM, "",
                 f"LS = {self.ls}", f"GRAD_LEAVES = {self.grad_leaves!r}  # leaves whose gradient diagonal_bwd_main_kernel writes", "", ""]
        for k in kernels:
            parts += k + ["", ""]
        return "\n".join(parts)


_VSUM = ['@triton.jit',
         'def _vsum(x, BV: tl.constexpr, DOTRED: tl.constexpr):',
         '    """Sum of a [BK, BV] tile over its value axis -> [BK, 1]. DOTRED: as x @ e0 on tensor cores',
         '    (tf32x3, about fp32-accurate), the cross-lane adds done by the MMA instead of 5 shuffle levels."""',
         '    if DOTRED:',
         '        e0 = (tl.arange(0, BV)[:, None] * 0 + (tl.arange(0, 16)[None, :] == 0)).to(tl.float32)',
         '        return tl.sum(tl.dot(x, e0, input_precision="tf32x3"), axis=1, keep_dims=True)',
         '    else:',
         '        return tl.sum(x, axis=1, keep_dims=True)',
         '']

_HSUM = ['@triton.jit',
         'def _hsum(x, BK: tl.constexpr, BV: tl.constexpr, LOG_BK: tl.constexpr, LOG_BV: tl.constexpr):',
         '    """Sum of a [BK, BV] tile over its value axis by recursive halving (BK <= BV, powers of two):',
         '    returns [1, BV] where lane j holds key j >> (LOG_BV - LOG_BK). Each of the LOG_BK halving levels',
         '    keeps one half of the keys and trades the other with the partner lane j ^ dist, then',
         '    LOG_BV - LOG_BK butterfly levels finish the sum: BK - 1 + LOG_BV - LOG_BK lane exchanges',
         '    (tl.gather inside a warp: shuffles) where tl.sum does BK * LOG_BV."""',
         '    j = tl.arange(0, BV)[None, :]',
         '    for lvl in tl.static_range(LOG_BK):',
         '        a, b = tl.split(tl.permute(tl.reshape(x, [2, BK >> (lvl + 1), BV]), (1, 2, 0)))',
         '        hi = (j & (BV >> (lvl + 1))) != 0',
         '        x = tl.where(hi, b, a) + tl.gather(tl.where(hi, a, b), tl.broadcast_to(j ^ (BV >> (lvl + 1)),',
         '                                                                         [BK >> (lvl + 1), BV]), axis=1)',
         '    for lvl in tl.static_range(LOG_BV - LOG_BK):',
         '        x = x + tl.gather(x, j ^ (BV >> (LOG_BK + lvl + 1)), axis=1)',
         '    return x',
         '']


def source(plan: Plan, pad_k: bool, ls: int, fast_math: bool) -> str:
    """The kernel module's text of ``plan`` (``pad_k``: BK > K; ``ls`` unrolled steps per sub-chunk;
    ``fast_math``: libdevice's exp, as the GPU compiles it; False: ``tl.exp``, as the interpreter runs it)."""
    header = f"spec: {plan.ir.spec_name}; IR {plan.hash}; fast_math={fast_math}"
    return _Gen(plan, pad_k, ls, fast_math).source(header)
