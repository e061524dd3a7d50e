"""Triton kernels of the scalar / elementwise-decay family, generated per objective.

Recurrence (math layout, state ``S [d, m]``)::

    S_t = a_t . S_{t-1} + p_t q_t^T            (or + B_t when the input term does not factorise)
    y_t = oc_t . (S_t oq_t) + oh_t

with ``a`` of dims ``()``, ``(d,)``, ``(m,)`` or ``(d, m)``. The kernels keep the state
transposed, ``[K, V] = [m, d]`` (FLA's layout), one ``[BK, BV]`` fp32 tile per program
(``BK = K`` padded to a power of two, ``BV`` a block of values). Every coefficient is
computed in registers from its leaves (the spec's inputs, loaded per token, and params,
loaded once): the expressions are printed by :mod:`ssmcraft.kernels.triton_printer`, so
no ``[B, T, d, m]`` tensor ever exists. The backward differentiates the printed
coefficient graph symbolically (sympy partials, reverse mode), reducing over the other
state dimension inside the kernel (over ``d`` across value blocks: per-block partials
summed on the host).

Time is split into chunks of ``L = LS * NSUB`` steps and chunks into ``NG`` groups; the
grid is ``(value blocks, batch * heads, groups)``:

forward
  1. ``fwd_summary``  per group: decay product ``A_g`` and local end state ``S_g`` (zero start);
  2. ``fwd_propagate`` sequential over groups (cheap): group start states;
  3. ``fwd_main``     per group: recompute from the carried-in state, write ``y`` (and, when a
     backward follows, the chunk-start states ``[B*H, NC, K, V]``; the final state).
backward (the adjoint ``dS_{t-1} = a_t . dS_t + oq_{t-1} (oc_{t-1} dy_{t-1})^T`` runs in reverse)
  1. ``bwd_summary``  per group: decay product and local adjoint carry-out (zero carry-in);
  2. ``bwd_propagate`` sequential over groups, from ``dS_T = dht``;
  3. ``bwd_main``     per group, chunks in reverse: from the stored chunk-start state a forward
     pass over the chunk keeps each sub-chunk's start state in a per-program scratch (L2-resident);
     then, sub-chunks in reverse, the ``LS`` states of one are recomputed into registers (unrolled)
     and the adjoint stepped back through them, writing the gradients of every leaf (value-indexed
     ones in the leaf's dtype; each step's stores after the next step's loads), ``dh0`` and the
     params' partial sums. Work per token: two forward steps and one adjoint step.
``NG = 1`` skips the summary and propagate kernels (one sequential pass per value block).
Configurations (value block, warps, groups) are timed on the GPU on first use per shape
(``_fwd_candidates`` / ``_bwd_candidates``) and picked by rule under the interpreter.
Measured figures and what limits them: BENCHMARKS.md, "Diagonal".

Layout of this module, top to bottom: the kernel source generator (the kernels), the host
wrappers, the autograd Function, the public functions (``diagonal_scan``; the family
contract ``supports`` / ``forward`` / ``prepare``).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import sympy
import torch

from ssmcraft.errors import SsmcraftError, one_line
from ssmcraft.kernels.launch import launch
from ssmcraft.kernels.tuning import INTERPRET, buffer, cdiv, next_pow2
from ssmcraft.kernels.triton_printer import LIBDEVICE_IMPORT, triton_code

BACKEND_NAME = "diagonal-chunked"
_POISON = {"on": os.environ.get("SSMCRAFT_POISON") == "1"}   # tests: fill outputs with NaN first


def set_poison(on: bool) -> None:
    """Allocate every kernel output with NaN (tests check that the kernels write all of it)."""
    _POISON["on"] = bool(on)


def _fast_math() -> bool:
    """libdevice's exp in the generated source: compiled for an NVIDIA GPU (not under the
    interpreter, which has no libdevice, nor on another Triton backend)."""
    if INTERPRET:
        return False
    import triton
    return triton.runtime.driver.active.get_current_target().backend == "cuda"


# ======================================================================================
# The coefficient graph of one IR
# ======================================================================================

@dataclass
class _Leaf:
    name: str
    dims: frozenset          # subset of {"d", "m"}
    kind: str                # "tok" (per token) | "param" (time-free)
    var: str


@dataclass
class _Node:
    name: str
    expr: sympy.Expr         # a coefficient's expression, or a reduction's body
    dims: frozenset
    over: str | None         # "m" for an in-kernel reduction
    var: str


@dataclass
class _Plan:
    """What the generator and the host need to know about an IR."""
    ir: object
    leaves: dict                              # name -> _Leaf (used ones, in a fixed order)
    nodes: dict                               # name -> _Node (IR order: reductions, coefficients)
    slots: dict                               # slot -> node name | sympy number
    dims_of_name: dict = field(default_factory=dict)
    hash: str = ""                            # the IR's content hash

    @property
    def tok_leaves(self):
        return [lf for lf in self.leaves.values() if lf.kind == "tok"]

    @property
    def param_leaves(self):
        return [lf for lf in self.leaves.values() if lf.kind == "param"]


def supports(ir) -> str | None:
    """None if the diagonal kernels run ``ir``, else why not."""
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
        _plan(ir)
    except NotImplementedError as e:
        return str(e)
    return None


def _plan(ir) -> _Plan:
    row, col = ir.dims

    def norm(dims):
        return frozenset("d" if x == row else "m" for x in dims)

    table = {}                        # name -> dims of every symbol
    leaf_all = {}
    for n, dims in ir.inputs.items():
        leaf_all[n] = _Leaf(n, norm(dims), "tok", f"L_{n}")
    for n, dims in ir.params.items():
        leaf_all[n] = _Leaf(n, norm(dims), "param", f"L_{n}")
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
    return _Plan(ir, leaves, nodes, slots, table)


# ======================================================================================
# Kernel source generator
# ======================================================================================

class _Gen:
    """Prints the six kernels of one plan (``pad_k``: BK > K; ``ls`` unrolled steps per sub-chunk;
    ``fast_math``: exp as libdevice's ``fast_expf``, for GPU-compiled code, see triton_printer)."""

    def __init__(self, plan: _Plan, pad_k: bool, ls: int, fast_math: bool):
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
        return f"{ind}{tok} = (i_b.to(tl.int64) * T + {t}) * H + i_h"

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
               f"def fwd_summary({self.leaf_args()}, A_out, S_out, T, H, K, V, NC, NG, CPG, L,",
               "                BK: tl.constexpr, BV: tl.constexpr, EVEN_V: tl.constexpr):",
               '    """Per group g < NG-1: A_g = prod_t a_t and S_g = the group\'s end state from a zero start."""',
               *self.prologue(i),
               *self.param_loads(i, need),
               f"{i}S = tl.zeros([BK, BV], dtype=tl.float32)",
               f"{i}A = tl.full([BK, BV], 1.0, dtype=tl.float32)",
               f"{i}t0 = i_g * CPG * L",
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
                "def fwd_propagate(h0, A_in, S_in, h_start, H, K, V, NG, BK: tl.constexpr, BV: tl.constexpr,",
                "                  HAS_H0: tl.constexpr):",
                '    """Sequential over groups: h_start[g] = state before group g (h_start[0] = h0)."""',
                "    i_v = tl.program_id(0)",
                "    i_bh = tl.program_id(1)",
                "    ok = tl.arange(0, BK)[:, None]",
                "    ov = i_v * BV + tl.arange(0, BV)[None, :]",
                "    mkv = (ok < K) & (ov < V)",
                "    st = ok * V + ov",
                "    S = tl.zeros([BK, BV], dtype=tl.float32)",
                "    if HAS_H0:",
                "        S = tl.load(h0 + i_bh.to(tl.int64) * K * V + st, mask=mkv, other=0.0).to(tl.float32)",
                "    for g in range(0, NG):",
                "        off = (i_bh * NG + g).to(tl.int64) * K * V + st",
                "        tl.store(h_start + off, S, mask=mkv)",
                "        if g < NG - 1:",
                "            S = tl.load(A_in + off, mask=mkv, other=0.0) * S + tl.load(S_in + off, mask=mkv, other=0.0)"]

    def fwd_main(self) -> list[str]:
        need = self.need_for(("a", "p", "q", "B", "oc", "oq", "oh"))
        i = " " * 4
        return ['@triton.jit(do_not_specialize=["T", "NC", "NG", "CPG"])',
                f"def fwd_main({self.leaf_args()}, h_start, y, ckpt, ht, T, H, K, V, NC, NG, CPG, L,",
                "             BK: tl.constexpr, BV: tl.constexpr, SAVE: tl.constexpr, STORE_FINAL: tl.constexpr,",
                "             EVEN_V: tl.constexpr, EVEN_T: tl.constexpr, PREFETCH: tl.constexpr):",
                '    """Per group: from its start state, every step\'s state and output; chunk-start states',
                '    ckpt[b*H+h, c] (SAVE) and the final state (STORE_FINAL, last group). PREFETCH: the token',
                f'    leaves are loaded {_PF} steps before their step (needs L % {_PF} == 0), so a pass with few',
                '    programs per SM (one group) does not wait on memory every step."""',
                *self.prologue(i),
                *self.param_loads(i, need),
                f"{i}S = tl.load(h_start + (i_bh * NG + i_g).to(tl.int64) * K * V + st, mask=mkv, other=0.0)",
                f"{i}c0 = i_g * CPG",
                f"{i}c1 = tl.minimum(c0 + CPG, NC)",
                f"{i}if PREFETCH:   # {_PF}-deep register prefetch: set j holds step tb + j, refilled with tb + j + {_PF}",
                *self._prefetched_steps(i * 2, need),
                f"{i}else:",
                *self._chunk_head(i * 2),
                f"{i}{i}{i}for t in range(c * L, tl.minimum(c * L + L, T)):",
                *self.coefficients(i * 4, "t", ("a", "p", "q", "B", "oc", "oq", "oh")),
                *self.update(i * 4, "S", "S"),
                f"{i}{i}{i}{i}o = {self.readout('S')}",
                f"{i}{i}{i}{i}tl.store(y + tok * V + ov, o, mask=mv)",
                f"{i}if STORE_FINAL:",
                f"{i}{i}tl.store(ht + i_bh.to(tl.int64) * K * V + st, S, mask=mkv & (i_g == NG - 1))"]

    @staticmethod
    def _chunk_head(ind: str) -> list[str]:
        """fwd_main's loop over its group's chunks, storing each chunk's start state when SAVE."""
        return [f"{ind}for c in range(c0, c1):",
                f"{ind}    if SAVE:",
                f"{ind}        tl.store(ckpt + (i_bh * NC + c).to(tl.int64) * K * V + st, S, mask=mkv)"]

    def _prefetched_steps(self, ind: str, need: set) -> list[str]:
        """fwd_main's time loop with the token leaves loaded _PF steps ahead (variables suffixed by the
        set); loads past the end read step T-1 (clamped), and those steps are masked off."""
        i = " " * 4
        out = [f"{ind}t_last = T - 1"]
        for j in range(_PF):
            out += self.tok_loads(ind, f"tl.minimum(c0 * L + {j}, t_last)", need, None, f"_{j}", "tokp")
        out += [*self._chunk_head(ind), f"{ind}{i}for tb in range(c * L, c * L + L, {_PF}):"]
        body = ind + i * 2
        for j in range(_PF):
            out += [f"{body}# step tb + {j}, from set {j}",
                    f"{body}vt = (tb + {j} < T) | EVEN_T",
                    self._tok_line(body, f"tb + {j}", "tok")]
            out += self.with_set(f"_{j}", lambda: [*self.node_lines(body, need), *self.update(body, "S", "S", "vt"),
                                                   f"{body}o = {self.readout('S')}"])
            out.append(f"{body}tl.store(y + tok * V + ov, o, mask=mv & vt)")
            out += self.tok_loads(body, f"tl.minimum(tb + {j + _PF}, t_last)", need, None, f"_{j}", "tokp")
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
                f"def bwd_summary({self.leaf_args()}, dy, A_out, E_out, T, H, K, V, NC, NG, CPG, L,",
                "                BK: tl.constexpr, BV: tl.constexpr, EVEN_V: tl.constexpr):",
                '    """Per group g >= 1: A_g = prod_t a_t and E_g = a_s . dS_s at its first step s from a zero',
                '    adjoint carried in at its end."""',
                *self.prologue(i, group_offset=1),
                *self.param_loads(i, need),
                f"{i}E = tl.zeros([BK, BV], dtype=tl.float32)",
                f"{i}A = tl.full([BK, BV], 1.0, dtype=tl.float32)",
                f"{i}t0 = i_g * CPG * L",
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
                "def bwd_propagate(dht, A_in, E_in, e_end, H, K, V, NG, BK: tl.constexpr, BV: tl.constexpr,",
                "                  HAS_DHT: tl.constexpr):",
                '    """Sequential over groups in reverse: e_end[g] = adjoint carried into group g at its end."""',
                "    i_v = tl.program_id(0)",
                "    i_bh = tl.program_id(1)",
                "    ok = tl.arange(0, BK)[:, None]",
                "    ov = i_v * BV + tl.arange(0, BV)[None, :]",
                "    mkv = (ok < K) & (ov < V)",
                "    st = ok * V + ov",
                "    E = tl.zeros([BK, BV], dtype=tl.float32)",
                "    if HAS_DHT:",
                "        E = tl.load(dht + i_bh.to(tl.int64) * K * V + st, mask=mkv, other=0.0).to(tl.float32)",
                "    for gg in range(0, NG):",
                "        g = NG - 1 - gg",
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

        combine = self._combine

        def materialise(term):
            code, act, lg, P = term
            if not P:
                return term
            code, act = self.reduce(code, act, lg, lg - P)
            return code, act, lg - P, frozenset()

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
        return loads, out, stores

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
               f"def bwd_main({self.leaf_args(grads=True)}, dy, ckpt, e_end, dh0, scratch, T, H, K, V, NC, NG, CPG, L, NTOK,",
               "             BK: tl.constexpr, BV: tl.constexpr, NSUB: tl.constexpr, NEED_DH0: tl.constexpr, DOTRED: tl.constexpr,",
               "             HSUM: tl.constexpr, LOG_BK: tl.constexpr, LOG_BV: tl.constexpr, EVEN_V: tl.constexpr,",
               "             EVEN_T: tl.constexpr):",
               '    """Per group, chunks in reverse: a forward pass over the chunk from its stored start state keeps',
               f'    the start of each sub-chunk of {ls} steps (L = {ls} * NSUB) in this program\'s scratch; then, sub-chunks',
               '    in reverse, their states are recomputed into registers and the adjoint stepped back through them."""',
               *self.prologue(i),
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
                f"{i}c0 = i_g * CPG",
                f"{i}c1 = tl.minimum(c0 + CPG, NC)",
                f"{i}for cc in range(0, c1 - c0):",
                f"{i}{i}c = c1 - 1 - cc",
                f"{i}{i}s0 = tl.load(ckpt + (i_bh * NC + c).to(tl.int64) * K * V + st, mask=mkv, other=0.0)",
                f"{i}{i}tl.debug_barrier()   # the scratch's last readers are done",
                f"{i}{i}# forward through the chunk, keeping each sub-chunk's start state",
                *self._refill(i * 2),
                f"{i}{i}tl.debug_barrier()",
                f"{i}{i}for jj in range(0, NSUB):",
                f"{i}{i}{i}j = NSUB - 1 - jj",
                *self._subchunk(i * 3)]
        out += [f"{i}if NEED_DH0:",
                f"{i}{i}tl.store(dh0 + i_bh.to(tl.int64) * K * V + st, E, mask=mkv & (i_g == 0))"]
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
        """bwd_main's forward pass over a chunk from its checkpoint ``s0``: the start state of each
        sub-chunk stored in the scratch, the steps of all but the last sub-chunk taken ``LS`` at a time,
        unrolled, so that their loads are issued together. bwd_main holds about 255 registers, so 8
        warps per SM, too few to hide a load per step: a loop of single steps waited on each step's
        loads in turn. Unrolled, the backward of Longhorn diagonal and the Mamba objective took 12%
        and 11% less time on H200 (BENCHMARKS.md, "Diagonal, run 6"). The same unrolling measured
        slower in the summaries and fwd_main, which hold far fewer registers (fwd_main 64) and so
        run enough warps to hide those loads."""
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
        """bwd_main's sub-chunk ``j``: its ``LS`` states recomputed into registers from the scratch's
        start state, then the adjoint stepped back through them. Each step's stores are printed after
        the next step's loads: the compiler keeps a load after an earlier store (the pointers may
        alias), so stores printed right after their step made every step's loads wait behind them
        (7-13% slower on H200, BENCHMARKS.md "Diagonal, run 4"), and the lag also lets the adjoint
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
        doc = [f'"""Generated Triton kernels of {ir.spec_name!r} ({ir.kind}), diagonal family.', "",
               "Coefficients (computed in registers from their leaves):"]
        for nd in self.p.nodes.values():
            doc.append(f"    {nd.name} [{', '.join(sorted(nd.dims))}] = "
                       + (f"sum_m {sympy.sstr(nd.expr)}" if nd.over else sympy.sstr(nd.expr)))
        doc.append("Slots: " + ", ".join(f"{s} = {v}" for s, v in self.p.slots.items()))
        doc.append("Leaves: " + ", ".join(f"{lf.name} [{', '.join(sorted(lf.dims))}] ({lf.kind})" for lf in self.p.leaves.values()))
        doc += [f"K padded: {self.pad_k}; unrolled steps per sub-chunk LS = {self.ls}; "
                f"exp: {'libdevice.fast_expf (GPU)' if self.fast_math else 'tl.exp'}.", '"""']
        kernels = [self.fwd_summary(), self.fwd_propagate(), self.fwd_main(),
                   self.bwd_summary(), self.bwd_propagate(), self.bwd_main()]
        parts = [f"# {header}", "# Generated by ssmcraft.kernels.diagonal: edit the spec or the generator, not this file.",
                 *doc, "import triton", "import triton.language as tl",
                 *([LIBDEVICE_IMPORT] if self.fast_math else []), "", "", *_VSUM, "", *_HSUM, "",
                 f"LS = {self.ls}", f"GRAD_LEAVES = {self.grad_leaves!r}  # leaves whose gradient bwd_main writes", "", ""]
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
_PF = 4        # fwd_main's register prefetch depth (steps), when Config.PREFETCH

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
_MODULES: dict = {}
_LS_SET = os.environ.get("SSMCRAFT_DIAG_LS")   # sweeps: unrolled steps per sub-chunk (read once, at import)


def _ls_for(K: int) -> int:
    """Unrolled steps per backward sub-chunk (their states live in registers)."""
    if _LS_SET:
        return int(_LS_SET)
    return 4 if K <= 32 else 2


def generated_source(ir, K: int = 16, fast_math: bool = True) -> str:
    """The generated kernels of ``ir`` for key dim ``K`` (``fast_math``: as the GPU compiles them;
    False: as the interpreter runs them). What ``ssmcraft derive SPEC --kernel`` prints."""
    plan = _get_plan(ir)
    return _source(plan, next_pow2(K) != K, _ls_for(K), fast_math)


def _source(plan: _Plan, pad_k: bool, ls: int, fast_math: bool) -> str:
    header = f"spec: {plan.ir.spec_name}; IR {plan.hash}; fast_math={fast_math}"
    return _Gen(plan, pad_k, ls, fast_math).source(header)


def _module(plan: _Plan, BK: int, K: int):
    """The generated kernel module of ``plan`` for this K (write-once, content-hash cached)."""
    from ssmcraft.compiler import cache
    pad_k = BK != K
    ls = _ls_for(K)
    key = (plan.hash, plan.ir.spec_name, pad_k, ls)
    mod = _MODULES.get(key)
    if mod is None:
        src = _source(plan, pad_k, ls, fast_math=_fast_math())
        ck = cache.key_for("diagonal", src, str(INTERPRET))
        mod = cache.load_generated(f"diag_{plan.ir.spec_name}", ck, src)
        _MODULES[key] = mod
    return mod


# ======================================================================================
# Host wrappers
# ======================================================================================

@dataclass(frozen=True)
class Config:
    """One launch configuration: value block, warps, number of time groups run in parallel."""
    BV: int
    num_warps: int
    NG: int        # requested groups (time parallelism); 1 = one sequential pass per block
    NSUB: int = 4  # sub-chunks per checkpointed chunk (L = LS * NSUB)
    DOTRED: bool = False  # backward: value-axis sums of tiles on tensor cores
    HSUM: bool = False    # backward: key-gradient value-axis sums by recursive halving (_hsum; BK <= BV)
    PREFETCH: bool = False  # forward: token leaves loaded _PF steps ahead (fwd_main; L % _PF == 0)


def _hsum_ok(BK: int, BV: int) -> bool:
    """Whether the halving sums (Config.HSUM) can run: every key lands on a lane of its own."""
    return BK <= BV


def _prefetch_ok(L: int) -> bool:
    """Whether fwd_main's register prefetch (Config.PREFETCH) can run: whole prefetch sets per chunk."""
    return L % _PF == 0


def check_config(cfg: Config, K: int, ls: int) -> None:
    """Refuse a configuration the kernels cannot run (before any kernel is launched)."""
    BK, L = next_pow2(K), ls * cfg.NSUB
    if cfg.HSUM and not _hsum_ok(BK, cfg.BV):
        raise SsmcraftError(f"diagonal Config.HSUM needs BK <= BV (BK = {BK}, BV = {cfg.BV})")
    if cfg.PREFETCH and not _prefetch_ok(L):
        raise SsmcraftError(f"diagonal Config.PREFETCH needs chunks of a multiple of {_PF} steps (L = {L})")


@functools.lru_cache(maxsize=256)
def flags(cfg: Config, K: int, T: int, V: int, ls: int) -> Mapping[str, object]:
    """The compile-time flags of one launch (each kernel takes its subset): no value mask when
    BV divides V, no time mask when the chunk length divides T, the halving sums, the prefetch.
    Checked and built once per (config, shape): a repeated call only looks them up."""
    check_config(cfg, K, ls)
    BK = next_pow2(K)
    return MappingProxyType(dict(EVEN_V=V % cfg.BV == 0, EVEN_T=T % (ls * cfg.NSUB) == 0, HSUM=cfg.HSUM,
                                 PREFETCH=cfg.PREFETCH, LOG_BK=BK.bit_length() - 1, LOG_BV=cfg.BV.bit_length() - 1))


def _pick_flags(f: Mapping, *names) -> dict:
    return {n: f[n] for n in names}


def _alloc(shape, dtype, device):
    return buffer(shape, device, dtype, _POISON["on"])


def _groups(NC: int, NG: int):
    NG = max(1, min(NG, NC))
    CPG = cdiv(NC, NG)
    return cdiv(NC, CPG), CPG


def _leaf_args(plan, leaves, H, grads=None):
    args = []
    for lf in plan.leaves.values():
        t = leaves[lf.name]
        args.append(t)
        if lf.kind == "param":
            per_head = t.dim() == len(lf.dims) + 1 and t.shape[0] == H and H > 1
            args.append(int(t[0].numel()) if per_head else 0)
    if grads is not None:
        args += [grads[lf.name] if grads.get(lf.name) is not None else leaves[lf.name] for lf in plan.leaves.values()]
    return args


def _geometry(shape, cfg: Config, mod):
    """(L, NC, NG, CPG, NV, kw, flags) of one launch configuration: chunk length, chunks, groups,
    chunks per group, value blocks, the block-size keywords every kernel takes, the compile-time flags."""
    B, T, H, K, V = shape
    L = mod.LS * cfg.NSUB
    NC = cdiv(T, L)
    NG, CPG = _groups(NC, cfg.NG)
    kw = dict(BK=next_pow2(K), BV=cfg.BV, num_warps=cfg.num_warps)
    return L, NC, NG, CPG, cdiv(V, cfg.BV), kw, flags(cfg, K, T, V, mod.LS)


def _forward(plan, leaves, h0, shape, out_dtype, want_final, save, cfg: Config, mod):
    B, T, H, K, V = shape
    L, NC, NG, CPG, NV, kw, f = _geometry(shape, cfg, mod)
    dev = next(iter(leaves.values())).device
    largs = _leaf_args(plan, leaves, H)
    if NG > 1:
        gA = torch.empty(B * H, NG, K, V, dtype=torch.float32, device=dev)
        gS = torch.empty_like(gA)
        _launch(mod, "fwd_summary", (NV, B * H, NG - 1), *largs, gA, gS, T, H, K, V, NC, NG, CPG, L, **kw,
                **_pick_flags(f, "EVEN_V"))
        h_start = torch.empty_like(gA)
        _launch(mod, "fwd_propagate", (NV, B * H), h0 if h0 is not None else gA, gA, gS, h_start, H, K, V, NG,
                                       HAS_H0=h0 is not None, **kw)
    else:
        h_start = h0 if h0 is not None else torch.zeros(B * H, 1, K, V, dtype=torch.float32, device=dev)
    y = _alloc((B, T, H, V), out_dtype, dev)
    ckpt = _alloc((B * H, NC, K, V), torch.float32, dev) if save else y
    ht = _alloc((B * H, K, V), torch.float32, dev) if want_final else y
    _launch(mod, "fwd_main", (NV, B * H, NG), *largs, h_start, y, ckpt, ht, T, H, K, V, NC, NG, CPG, L,
                                  SAVE=save, STORE_FINAL=want_final, **kw, **_pick_flags(f, "EVEN_V", "EVEN_T", "PREFETCH"))
    return y, (ht if want_final else None), (ckpt if save else None)


def _backward(plan, leaves, dy, dht, ckpt, need_dh0, shape, cfg: Config, mod, needs):
    B, T, H, K, V = shape
    L, NC, NG, CPG, NV, kw, f = _geometry(shape, cfg, mod)
    dev = dy.device
    largs = _leaf_args(plan, leaves, H)
    if NG > 1:
        gA = torch.empty(B * H, NG, K, V, dtype=torch.float32, device=dev)
        gE = torch.empty_like(gA)
        _launch(mod, "bwd_summary", (NV, B * H, NG - 1), *largs, dy, gA, gE, T, H, K, V, NC, NG, CPG, L, **kw,
                **_pick_flags(f, "EVEN_V"))
        e_end = torch.empty_like(gA)
        _launch(mod, "bwd_propagate", (NV, B * H), dht if dht is not None else gA, gA, gE, e_end, H, K, V, NG,
                                       HAS_DHT=dht is not None, **kw)
    else:
        e_end = dht if dht is not None else torch.zeros(B * H, 1, K, V, dtype=torch.float32, device=dev)
    NTOK = B * T * H
    raw = {}
    scratch = torch.empty(1, dtype=torch.float32, device=dev)
    gargs = []
    for lf in plan.leaves.values():
        n = {frozenset({"d", "m"}): V * K, frozenset({"d"}): V, frozenset({"m"}): K, frozenset(): 1}[lf.dims]
        if lf.kind == "param":       # small: always written (zero where unused)
            raw[lf.name] = _alloc((NG, 1 if "d" in lf.dims else NV, B, H, n), torch.float32, dev)
        elif lf.name in mod.GRAD_LEAVES:
            # value-indexed: written once, in the leaf's own dtype; key-indexed: fp32 partial sums per
            # value block (summed below; those leaves are fp32, see diagonal_scan). A gradient nobody
            # needs is still stored by the kernel: it gets a throwaway buffer (never poisoned)
            gshape, dtype = ((NTOK * n,), leaves[lf.name].dtype) if "d" in lf.dims else ((NV, NTOK * n), torch.float32)
            if needs.get(lf.name):
                raw[lf.name] = _alloc(gshape, dtype, dev)
            else:
                gargs.append(torch.empty(gshape, dtype=dtype, device=dev))
                continue
        gargs.append(raw.get(lf.name, scratch))
    dh0 = _alloc((B * H, K, V), torch.float32, dev) if need_dh0 else scratch
    scratch = torch.empty(NV * B * H * NG * cfg.NSUB * kw["BK"] * cfg.BV, dtype=torch.float32, device=dev)
    _launch(mod, "bwd_main", (NV, B * H, NG), *largs, *gargs, dy, ckpt, e_end, dh0, scratch, T, H, K, V, NC, NG, CPG, L, NTOK,
                                  NSUB=cfg.NSUB, NEED_DH0=need_dh0, DOTRED=cfg.DOTRED, **kw,
                                  **_pick_flags(f, "HSUM", "LOG_BK", "LOG_BV", "EVEN_V", "EVEN_T"))
    out = {}
    for lf in plan.leaves.values():
        g = raw.get(lf.name)
        t = leaves[lf.name]
        if g is None:
            if needs.get(lf.name):
                out[lf.name] = torch.zeros(t.shape, dtype=torch.float32, device=dev)
            continue
        if lf.kind == "tok":
            if "d" not in lf.dims:
                g = g.sum(0)
            out[lf.name] = g.view(t.shape)
        else:
            g = g.sum((0, 1, 2))                           # [H, n]
            if not (t.dim() == len(lf.dims) + 1 and t.shape[0] == H and H > 1):
                g = g.sum(0)
            out[lf.name] = g.reshape(t.shape)
    return out, (dh0 if need_dh0 else None)


# -- configuration: rule under the interpreter, measured on the GPU --------------------

_TUNED: dict = {}
_TIMINGS: dict = {}        # key -> [(Config, ms)] measured by _pick
LAUNCHED: dict = {}        # kernel name -> the last launch's compiled kernel (registers, spills, IR)


def _launch(mod, name, grid, *args, **kw):
    LAUNCHED[name] = launch(getattr(mod, name), grid, *args, **kw)


def _warps(BK: int, BV: int) -> int:
    """Warps along the value axis first (every thread then holds whole key columns, so sums over
    K stay in registers), more only past 16 state elements per thread (then K is split)."""
    return max(1, BV // 32, BK * BV // 512)


def _nsub(K: int) -> int:
    return 4 if K <= 32 else 8


def _rule_config(K: int, V: int, B: int, H: int, T: int) -> Config:
    """The interpreter's configuration (large tiles, one group), and the GPU's default: 32-wide value
    blocks, warps along V, about 24 programs per SM (the measured best on H200, BENCHMARKS.md)."""
    BK = next_pow2(K)
    if INTERPRET:
        BV = min(next_pow2(V), 64)
        warps, NG = 1, 1
    else:
        BV = 32 if V >= 32 else next_pow2(V)
        warps, NG = _warps(BK, BV), 2 * _parallel_groups(B, H, V, BV, T, _ls_for(K), _nsub(K))
    return Config(BV=BV, num_warps=warps, NG=NG, NSUB=_nsub(K), HSUM=_hsum_ok(BK, BV))


def _parallel_groups(B, H, V, BV, T, ls, nsub, target=132 * 12):
    """Enough time groups that the grid has about ``target`` programs."""
    progs = B * H * cdiv(V, BV)
    NC = cdiv(T, ls * nsub)
    return max(1, min(NC, cdiv(target, progs)))


def _fwd_candidates(K, V, B, H, T):
    """Forward: 32-wide value blocks (warps along V) with 1x, 2x, 4x the rule's time groups, and
    64-wide blocks; each with and without the register prefetch. Measured on H200 (BENCHMARKS.md):
    32-wide with ~24 programs per SM won; 64 and 128 columns per warp issue fewer instructions but
    lose on latency, and one- or two-group passes (no summary sweep) took 1.8-2x the best."""
    BK = next_pow2(K)
    ls, nsub = _ls_for(K), _nsub(K)
    NC = cdiv(T, ls * nsub)
    prefetch = (False, True) if _prefetch_ok(ls * nsub) else (False,)
    out = []
    for BV, mult in ((32, (1, 2, 4)), (64, (1, 2))):
        if BV > max(32, next_pow2(V)):
            continue
        ngp = _parallel_groups(B, H, V, BV, T, ls, nsub)
        for NG in sorted({_groups(NC, g * ngp)[0] for g in mult}):
            out += [Config(BV, _warps(BK, BV), NG, nsub, PREFETCH=pf) for pf in prefetch]
    return out


def _bwd_candidates(K, V, B, H, T):
    """Backward: 32- and 64-wide value blocks, 1x and 2x the rule's time groups. The key gradients'
    value-axis sums go by recursive halving where BK <= BV (Config.HSUM): tl.sum measured 20-39%
    slower in every configuration on H200, and sums on tensor cores (Config.DOTRED) 1.6-2.2x slower
    (BENCHMARKS.md, "Diagonal")."""
    BK = next_pow2(K)
    ls, nsub = _ls_for(K), _nsub(K)
    NC = cdiv(T, ls * nsub)
    out = []
    for BV in (32, 64):
        if BV > max(32, next_pow2(V)):
            continue
        ngp = _parallel_groups(B, H, V, BV, T, ls, nsub)
        for NG in sorted({_groups(NC, g)[0] for g in (ngp, 2 * ngp)}):
            out.append(Config(BV, _warps(BK, BV), NG, nsub, HSUM=_hsum_ok(BK, BV)))
    return out


def _pick(key, candidates, run):
    """Time ``run(cfg)`` for each of ``candidates()`` (CUDA only) and remember the fastest; a call
    whose key was tuned before only looks it up."""
    if key in _TUNED:
        return _TUNED[key]
    cands = candidates()
    import triton.testing
    best, best_t = None, float("inf")
    times = _TIMINGS.setdefault(key, [])
    for cfg in cands:
        try:
            ms = triton.testing.do_bench(lambda: run(cfg), warmup=3, rep=15)
        except SsmcraftError:    # a candidate the kernels refuse (check_config) is a bug in the list
            raise
        except Exception as e:   # a config that fails to compile or launch is skipped
            times.append((cfg, f"failed: {one_line(e)}"))
            continue
        times.append((cfg, ms))
        if ms < best_t:
            best, best_t = cfg, ms
    if best is None:
        raise RuntimeError("no diagonal-kernel configuration ran")
    _TUNED[key] = best
    return best


def tuned_configs() -> dict:
    """The configurations picked so far: key -> Config."""
    return dict(_TUNED)


def tuning_timings() -> dict:
    """Every candidate timed so far: key -> [(Config, ms or failure)]."""
    return {k: list(v) for k, v in _TIMINGS.items()}


# ======================================================================================
# Autograd Function
# ======================================================================================

class _DiagonalScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, names, shape, out_dtype, want_final, config, h0, *tensors):
        leaves = dict(zip(names, tensors))
        B, T, H, K, V = shape
        mod = _module(plan, next_pow2(K), K)
        save = bool(any(ctx.needs_input_grad))
        cfg = config or _fwd_config(plan, leaves, h0, shape, out_dtype, want_final, save, mod)
        y, ht, ckpt = _forward(plan, leaves, h0, shape, out_dtype, want_final, save, cfg, mod)
        ctx.plan, ctx.names, ctx.shape, ctx.config, ctx.has_h0 = plan, names, shape, config, h0 is not None
        if save:
            ctx.save_for_backward(ckpt, *tensors)
        if ht is not None:
            ht = ht.view(B, H, K, V)
        else:
            ht = y.new_zeros(0)
        return y, ht

    @staticmethod
    def backward(ctx, dy, dht):
        ckpt, *tensors = ctx.saved_tensors
        plan, shape = ctx.plan, ctx.shape
        B, T, H, K, V = shape
        leaves = dict(zip(ctx.names, tensors))
        mod = _module(plan, next_pow2(K), K)
        dy = dy.contiguous()
        dht = dht.reshape(B * H, 1, K, V).float().contiguous() if dht is not None and dht.numel() else None
        needs = {n: ctx.needs_input_grad[7 + i] for i, n in enumerate(ctx.names)}
        need_dh0 = ctx.has_h0 and ctx.needs_input_grad[6]

        def run(cfg):
            return _backward(plan, leaves, dy, dht, ckpt, need_dh0, shape, cfg, mod, needs)

        cfg = ctx.config
        if cfg is None:
            if dy.is_cuda:
                key = ("bwd", plan.hash, shape, dy.dtype, tuple(t.dtype for t in tensors))
                cfg = _pick(key, lambda: _bwd_candidates(K, V, B, H, T), run)
            else:
                cfg = _rule_config(K, V, B, H, T)
        grads, dh0 = run(cfg)
        out = [grads.get(n) for n in ctx.names]
        out = [g.to(t.dtype) if g is not None else None for g, t in zip(out, tensors)]
        if dh0 is not None:
            dh0 = dh0.view(B * H, 1, K, V)
        return (None, None, None, None, None, None, dh0, *out)


def _fwd_config(plan, leaves, h0, shape, out_dtype, want_final, save, mod):
    B, T, H, K, V = shape
    dev = next(iter(leaves.values())).device
    if dev.type != "cuda":
        return _rule_config(K, V, B, H, T)
    key = ("fwd", plan.hash, shape, out_dtype, tuple(t.dtype for t in leaves.values()), save, want_final)
    return _pick(key, lambda: _fwd_candidates(K, V, B, H, T),
                 lambda cfg: _forward(plan, leaves, h0, shape, out_dtype, want_final, save, cfg, mod))


# ======================================================================================
# Public functions
# ======================================================================================

_PLANS: dict = {}      # (content hash, spec name) -> plan (the hash is kept on the IR: UpdateIR.memo)


def _get_plan(ir) -> _Plan:
    key = (ir.content_hash(), ir.spec_name)
    if key not in _PLANS:
        reason = supports(ir)
        if reason:
            raise SsmcraftError(f"{ir.spec_name}: {reason}")
        _PLANS[key] = _plan(ir)
        _PLANS[key].hash = key[0]
    return _PLANS[key]


def diagonal_scan(objective, tensors: dict, initial_state=None, output_final_state: bool = False,
                  config: Config | None = None):
    """Run the generated diagonal-decay kernel of ``objective`` (a CompiledObjective, UpdateIR or
    library name) in FLA's layout.

    tensors: the spec's inputs, ``[B, T, H, V]`` for d-indexed (values, per-channel
      coefficients), ``[B, T, H, K]`` for m-indexed (keys, queries, key gates), ``[B, T, H]`` for
      per-head scalars, in fp32 or bf16; and params of their declared shape or ``[H, *shape]``
      (a ``[d, m]`` param is ``[V, K]``). Params left out take their constant init.
    initial_state: ``[B, H, K, V]`` (fp32 preferred) or None.
    Returns ``(o [B, T, H, V]`` in the first input's dtype, ``final_state [B, H, K, V]`` fp32 or None).
    Differentiable in every tensor and the initial state (gradient on the final state too).
    """
    ir, spec_params = _as_ir(objective)
    plan = _get_plan(ir)
    first = next(iter(ir.inputs))
    x0 = tensors[first]
    B, T, H = x0.shape[:3]
    K = V = None
    for n, dims in list(ir.inputs.items()) + list(ir.params.items()):
        if n not in tensors:
            continue
        t = tensors[n]
        sz = t.shape[3:] if n in ir.inputs else t.shape[t.dim() - len(dims):]
        for dim, s in zip(dims, sz):
            if dim == ir.dims[0]:
                V = int(s)
            else:
                K = int(s)
    if initial_state is not None:
        K, V = int(initial_state.shape[2]), int(initial_state.shape[3])
    if K is None or V is None:
        raise SsmcraftError(f"{ir.spec_name}: cannot tell K and V from the tensors given (pass initial_state)")
    out_dtype = x0.dtype if x0.dtype.is_floating_point else torch.float32
    leaves = {}
    for lf in plan.leaves.values():
        if lf.name in tensors:
            t = tensors[lf.name]
        else:
            t = _default_param(ir, spec_params, lf, K, V, x0.device)
        if lf.kind == "param" and lf.dims == frozenset({"d", "m"}) and t.shape[-2:] != (V, K):
            t = t.reshape(*t.shape[:-2], V, K)
        if "d" not in lf.dims and t.dtype != torch.float32:
            # key-indexed and per-head leaves are small (no V axis): fp32 saves the kernel a
            # conversion per element and step (every thread loads the whole key vector)
            t = t.float()
        leaves[lf.name] = t.contiguous()
    if T == 0:
        y = x0.new_zeros(B, 0, H, V, dtype=out_dtype)
        S = initial_state.float() if initial_state is not None else x0.new_zeros(B, H, K, V, dtype=torch.float32)
        return y, (S if output_final_state else None)
    h0 = None if initial_state is None else initial_state.float().contiguous().reshape(B * H, 1, K, V)
    names = list(leaves)
    y, ht = _DiagonalScan.apply(plan, names, (B, T, H, K, V), out_dtype, bool(output_final_state), config, h0,
                                *[leaves[n] for n in names])
    return y, (ht if output_final_state else None)


def _default_param(ir, spec_params, lf, K, V, device):
    from ssmcraft.kernels.reference import constant_param
    shape = [V, K] if lf.dims == frozenset({"d", "m"}) else [V] if lf.dims == {"d"} else [K] if lf.dims == {"m"} else []
    return constant_param((spec_params or {}).get(lf.name), shape, device, f"{ir.spec_name}: param {lf.name!r}")


def _as_ir(objective):
    """(UpdateIR, the spec's param declarations or None) of a CompiledObjective, IR or library name."""
    if hasattr(objective, "ir"):
        return objective.ir, objective.spec.params
    if isinstance(objective, str):
        import ssmcraft
        return _as_ir(ssmcraft.compile(objective))
    return objective, None


# -- the family contract (ssmcraft.kernels.triton_backend) ----------------------------

def _call_tensors(inputs: dict, params: dict | None) -> dict:
    """The kernel's tensors: the inputs as given, params as tensors (``diagonal_scan`` fills the
    constant-init params not given)."""
    dev = next(iter(inputs.values())).device
    tensors = dict(inputs)
    for k, v in (params or {}).items():
        tensors[k] = v if isinstance(v, torch.Tensor) else torch.as_tensor(v, device=dev)
    return tensors


def prepare(obj, lay):
    """The family's runner for one call signature (``lay`` from ``reference.validate``, which has
    checked the shapes once): the tensors go to the kernel as given, in their own dtype."""
    out_dtype = lay.out_dtype

    def fn(inputs, params, initial_state, output_final_state):
        s0 = None if initial_state is None else initial_state.transpose(-1, -2)
        y, S = diagonal_scan(obj, _call_tensors(inputs, params), s0, output_final_state)
        return y.to(out_dtype), (S.transpose(-1, -2) if S is not None else None)
    return fn


def forward(obj, lay, co, output_final_state: bool):
    """Family contract: run on a reference ``Layout`` (its env leaves; ``co`` is not used: the kernel
    computes the coefficients itself). Returns (y [B,T,H,d] lay.out_dtype, S_T [B,H,d,m] fp32 or None)."""
    ir = obj.ir
    tensors = {}
    for n, dims in ir.inputs.items():
        t = lay.env[n]                                        # [B, T, H, r, c]
        tensors[n] = t.reshape(lay.B, lay.T, lay.H, *([t.shape[3] * t.shape[4]] if dims else []))
    for n, dims in ir.params.items():
        t = lay.env[n]                                        # [1, 1, heads, r, c]
        heads = t.shape[2]
        shape = [lay.d if x == ir.dims[0] else lay.m for x in dims]
        tensors[n] = t.reshape(heads, *shape) if heads > 1 else t.reshape(*shape) if shape else t.reshape(())
    s0 = None if lay.S0 is None else lay.S0.transpose(-1, -2)
    y, S = diagonal_scan(obj, tensors, s0, output_final_state)
    return y.to(lay.out_dtype), (S.transpose(-1, -2) if S is not None else None)
