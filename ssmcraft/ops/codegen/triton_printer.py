"""A sympy -> Triton printer for per-token coefficient expressions.

The kernels compute coefficients in registers from their leaves (inputs and params loaded
as tiles); this module prints one element expression as Triton code. Symbols are renamed
through ``names`` (symbol name -> kernel variable), numbers are printed as float literals
(every kernel value is fp32), and the objective language's scalar functions map to:

=============  ================================================================
sympy          Triton
=============  ================================================================
exp, log       ``tl.exp``, ``tl.log``; exp with ``fast_math`` (GPU code only): libdevice's
               ``fast_expf``, i.e. ``ex2.approx.ftz``. ``tl.exp`` is the same approximation plus
               a denormal fix-up (2-4 more instructions per element); ftz flushes results below
               1.2e-38 to zero. ``exp(c * x)`` prints as ``libdevice.exp2(x * (c * log2 e))`` when
               ``c`` is the cheap factor to scale: the factors whose symbols all lie in the first
               set of ``scaled`` that has some and leaves a non-constant factor ``x`` unscaled
               (else nothing is saved; the diagonal kernels pass, in order, the values a
               thread holds one of, such as Mamba's per-column ``delta``: one multiply per step
               and thread, not per element; then the params, scaled once before the time loop,
               at the cost of a second register copy). The interpreter has no libdevice, so it
               always prints ``tl.exp``.
               log stays ``tl.log`` (libdevice's accurate ``logf``): ``lg2.approx`` has an
               absolute error near 1e-7, too coarse for log-decays close to 0.
sqrt           ``tl.sqrt`` (also ``x**(1/2)``; ``x**(-1/2)`` -> ``1.0/tl.sqrt(x)``)
Abs, sign      ``tl.abs``, ``tl.where(x > 0, 1, tl.where(x < 0, -1, 0))``
sigmoid        ``tl.sigmoid``
softplus       ``tl.where(x > 20, x, tl.log(1 + tl.exp(min(x, 20))))`` (torch's threshold)
silu           ``x * tl.sigmoid(x)``
x**n           repeated products for integer ``|n| <= 4``, ``tl.exp(n * tl.log(x))`` otherwise
Max, Min       ``tl.maximum``, ``tl.minimum``
DiracDelta     ``0.0`` (appears in derivatives of sign; torch's sign has zero gradient)
=============  ================================================================

``triton_code(expr, names, fast_math, scaled)`` is the entry point (a module printed with ``fast_math``
imports ``LIBDEVICE_IMPORT``); ``free_names(expr)`` lists its symbols.
"""
from __future__ import annotations

import math

import sympy
from sympy.printing.precedence import PRECEDENCE, precedence
from sympy.printing.str import StrPrinter

LOG2E = 1.0 / math.log(2.0)


class TritonPrinter(StrPrinter):
    """Prints an element expression as a Triton (``tl.*``) expression over fp32 values."""

    def __init__(self, names: dict | None = None, fast_math: bool = False, scaled=()):
        super().__init__({"order": "none"})
        self.names = dict(names or {})
        self.fast_math = fast_math
        self.scaled = tuple(frozenset(g) for g in scaled)
        self.exp_fn = "libdevice.fast_expf" if fast_math else "tl.exp"

    # -- atoms -------------------------------------------------------------------------
    def _print_Symbol(self, expr):
        return self.names.get(expr.name, expr.name)

    _print_Dummy = _print_Symbol

    def _print_Integer(self, expr):
        return f"{int(expr)}.0"

    def _print_Rational(self, expr):
        return repr(float(expr.p) / float(expr.q))

    def _print_Float(self, expr):
        return repr(float(expr))

    def _print_Half(self, expr):
        return "0.5"

    def _print_One(self, expr):
        return "1.0"

    def _print_Zero(self, expr):
        return "0.0"

    def _print_NegativeOne(self, expr):
        return "-1.0"

    def _print_Exp1(self, expr):
        return repr(float(sympy.E))

    def _print_Pi(self, expr):
        return repr(float(sympy.pi))

    def _print_Infinity(self, expr):
        return 'float("inf")'

    def _print_NegativeInfinity(self, expr):
        return 'float("-inf")'

    # -- arithmetic --------------------------------------------------------------------
    def _print_Pow(self, expr, rational=False):
        base, e = expr.args
        b = self.parenthesize(base, PRECEDENCE["Mul"] + 1)
        if e == sympy.Rational(1, 2):
            return f"tl.sqrt({self._print(base)})"
        if e == sympy.Rational(-1, 2):
            return f"(1.0 / tl.sqrt({self._print(base)}))"
        if e.is_Integer and 0 < int(e) <= 4:
            return "(" + "*".join([b] * int(e)) + ")"
        if e.is_Integer and -4 <= int(e) < 0:
            return "(1.0 / (" + "*".join([b] * -int(e)) + "))"
        if e == 0:
            return "1.0"
        if e.is_Rational and e.q == 2 and abs(e.p) <= 9:     # x**(n/2) as x**(n//2) * sqrt(x): exact, no exp/log
            root = "*".join([b] * (abs(e.p) // 2) + [f"tl.sqrt({self._print(base)})"])
            return f"({root})" if e > 0 else f"(1.0 / ({root}))"
        # real powers of a base the spec declares positive (or of an Abs)
        return f"{self.exp_fn}({self._print(e)} * tl.log({self._print(base)}))"

    def _print_Mul(self, expr):
        # sympy's StrPrinter prints x/y for negative powers; keep that, but never emit an
        # integer division and parenthesise denominators
        return super()._print_Mul(expr)

    def _print_Relational(self, expr):
        return f"({self._print(expr.lhs)} {expr.rel_op} {self._print(expr.rhs)})"

    # -- functions ---------------------------------------------------------------------
    def _unary(self, fn, expr):
        return f"{fn}({self._print(expr.args[0])})"

    def _print_exp(self, expr):
        arg = expr.args[0]
        if self.fast_math and isinstance(arg, sympy.Mul):
            # exp(c * x) with c a cheap factor to scale (its symbols in a set of ``scaled``, first set
            # first): exp2(x * (c * log2 e)), one multiply by log2 e per c, not per element
            for group in self.scaled:
                cheap = [f for f in arg.args if f.free_symbols and {s.name for s in f.free_symbols} <= group]
                others = [f for f in arg.args if f not in cheap]
                if cheap and any(f.free_symbols for f in others):   # else nothing to save
                    rest = sympy.Mul(*others)
                    c = self.parenthesize(sympy.Mul(*cheap), PRECEDENCE["Mul"])
                    return f"libdevice.exp2({self.parenthesize(rest, PRECEDENCE['Mul'])} * ({c} * {LOG2E!r}))"
        return self._unary(self.exp_fn, expr)

    def _print_log(self, expr):
        return self._unary("tl.log", expr)

    def _print_sqrt(self, expr):
        return self._unary("tl.sqrt", expr)

    def _print_Abs(self, expr):
        return self._unary("tl.abs", expr)

    def _print_sign(self, expr):
        x = self._print(expr.args[0])
        return f"tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, 0.0))"

    def _print_DiracDelta(self, expr):
        # d sign(x)/dx: zero almost everywhere (torch's sign has a zero gradient too)
        return "0.0"

    def _print_Heaviside(self, expr):
        x = self._print(expr.args[0])
        return f"tl.where({x} > 0, 1.0, tl.where({x} < 0, 0.0, 0.5))"

    def _print_Max(self, expr):
        out = self._print(expr.args[0])
        for a in expr.args[1:]:
            out = f"tl.maximum({out}, {self._print(a)})"
        return out

    def _print_Min(self, expr):
        out = self._print(expr.args[0])
        for a in expr.args[1:]:
            out = f"tl.minimum({out}, {self._print(a)})"
        return out

    def _print_Function(self, expr):
        name = type(expr).__name__
        x = self._print(expr.args[0]) if expr.args else ""
        if name == "sigmoid":
            return f"tl.sigmoid({x})"
        if name == "softplus":
            return f"tl.where({x} > 20.0, {x}, tl.log(1.0 + {self.exp_fn}(tl.minimum({x}, 20.0))))"
        if name == "silu":
            return f"(({x}) * tl.sigmoid({x}))"
        raise NotImplementedError(f"no Triton printing for the function {name}")

    def emptyPrinter(self, expr):
        raise NotImplementedError(f"no Triton printing for {type(expr).__name__}: {expr}")

    def parenthesize(self, item, level, strict=False):
        if precedence(item) < level or (not strict and precedence(item) <= level) or (
                isinstance(item, sympy.Number) and item.is_negative):
            return f"({self._print(item)})"
        return self._print(item)


LIBDEVICE_IMPORT = "from triton.language.extra.cuda import libdevice"


def triton_code(expr, names: dict | None = None, fast_math: bool = False, scaled=()) -> str:
    """The Triton expression of a sympy element expression (symbols renamed by ``names``;
    ``fast_math``: exp through libdevice's ftz approximations, for GPU-compiled code, with the
    factor of an exponent whose symbols all lie in the first matching set of ``scaled`` scaled by log2 e)."""
    return TritonPrinter(names, fast_math, scaled).doprint(sympy.sympify(expr))


def free_names(expr) -> set[str]:
    """Names of the free symbols of ``expr``."""
    return {s.name for s in sympy.sympify(expr).free_symbols}
