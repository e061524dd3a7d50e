"""Stage 2: the symbolic objective, in element form.

Every expression of the spec is lowered to a *typed element expression*: a shape
``(rows, cols)`` over the dimension names (``"1"`` for a singleton) and a sympy scalar
that gives one element. Symbols carry the dimensions they vary over (an input ``x: [d]``
is ``x`` indexed by the row index, the state ``S`` by both); a contraction (matrix
product, ``dot``, ``sq``) becomes a *reduction*: a fresh symbol ``_rN`` standing for the
sum of a body over one dimension. Because the two state dimensions have different names,
an element is a function of at most one row index and one column index, and transposes
cost nothing. This is the representation every later stage works on; sympy's own
MatrixSymbol calculus is avoided on purpose (its ``diff`` silently returns 0 on sums of
trace terms: ENV.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from ssmcraft.compiler import expr as E
from ssmcraft.compiler.functions import SCALAR_FUNCTIONS
from ssmcraft.compiler.spec import Spec
from ssmcraft.errors import SpecError


@dataclass(frozen=True)
class MetricTerm:
    """``wsq(V, coef * X)`` = ``coef * tr(V X V^T)``: ``V`` a [d, m] element expression, ``X`` the
    symbol of a square state (new or previous value); ``ssmcraft.compiler.metric`` derives from it."""
    V: sympy.Expr
    coef: sympy.Expr
    X: sympy.Symbol

ONE = "1"
MAX_EXPONENT = 16


@dataclass(frozen=True)
class Reduction:
    """``symbol = sum over `over` of body``; ``dims`` are the dimensions left free."""
    symbol: sympy.Symbol
    body: sympy.Expr
    over: str
    dims: frozenset
    metric: sympy.Symbol | None = None   # a row vector times this square matrix (``Algebra.reduce``)


@dataclass
class Algebra:
    """Symbol table and reduction registry shared by the stages of one derivation."""
    dims: tuple[str, str]
    symbol_dims: dict = field(default_factory=dict)     # Symbol -> frozenset of dim names
    reductions: dict = field(default_factory=dict)      # Symbol -> Reduction
    hidden: tuple = ()                                  # hidden dimensions (a deep memory's widths)
    _keys: dict = field(default_factory=dict)           # (body, over) -> Symbol
    _count: int = 0
    # square states (metrics): placeholder scalar -> what it stands for (``metric``)
    metrics: dict = field(default_factory=dict)         # _mq symbol -> MetricTerm: wsq(V, c X)
    square_norms: dict = field(default_factory=dict)    # _sq symbol -> Square: sq(A), A with state terms

    def symbol(self, name: str, dims=(), **assumptions) -> sympy.Symbol:
        s = sympy.Symbol(name, **assumptions)
        self.symbol_dims[s] = frozenset(dims)
        return s

    def size(self, dim: str) -> sympy.Symbol:
        return next(s for s, d in self.symbol_dims.items() if s.name == dim and not d)

    def dims_of(self, e) -> frozenset:
        out = frozenset()
        for s in e.free_symbols:
            out |= self.symbol_dims.get(s, frozenset())
        return out

    def reduce(self, body: sympy.Expr, over: str, metric: sympy.Symbol | None = None) -> sympy.Expr:
        """The sum of ``body`` over dimension ``over`` (a new or shared reduction symbol). With a
        ``metric`` (the symbol of a square [over, over] matrix P), the row vector times P instead:
        ``sum_j' body_j' P_j'j``, which keeps ``over`` (``metric.matvec``)."""
        body = sympy.sympify(body)
        if body == 0:
            return sympy.Integer(0)
        if metric is not None:
            return matvec(self, body, over, metric)
        if over not in self.dims_of(body):
            return body * self.size(over)
        # pull factors that do not vary over `over` out of the sum
        inner, outer = [], []
        for f in sympy.Mul.make_args(body):
            (inner if over in self.dims_of(f) else outer).append(f)
        body = sympy.Mul(*inner)
        key = (body, over)
        if key not in self._keys:
            dims = self.dims_of(body) - {over}
            assumptions = {"real": True}
            if body.is_nonnegative:
                assumptions = {"nonnegative": True}
            sym = self.symbol(f"_r{self._count}", dims, **assumptions)
            self._count += 1
            self.reductions[sym] = Reduction(sym, body, over, dims)
            self._keys[key] = sym
        return sympy.Mul(*outer) * self._keys[key]

    def reductions_in(self, e) -> list[Reduction]:
        """Every reduction ``e`` uses, directly or through other reductions, inner first."""
        seen: dict = {}

        def visit(x):
            for s in sorted(x.free_symbols, key=lambda s: s.name):
                if s in self.reductions and s not in seen:
                    visit(self.reductions[s].body)
                    seen[s] = self.reductions[s]
        visit(sympy.sympify(e))
        return list(seen.values())

    def depends_on(self, e, var: sympy.Symbol) -> bool:
        for s in sympy.sympify(e).free_symbols:
            if s == var or (s in self.reductions and self.depends_on(self.reductions[s].body, var)):
                return True
        return False

    def substitute(self, e, mapping: dict) -> sympy.Expr:
        """Substitute symbols in ``e`` and, consistently, inside every reduction it uses."""
        e = sympy.sympify(e)
        sub = dict(mapping)
        for r in self.reductions_in(e):
            body = r.body.xreplace(sub)
            if body != r.body:
                sub[r.symbol] = self.reduce(body, r.over, r.metric)
        return e.xreplace(sub)

    def expand(self, e) -> sympy.Expr:
        """``e`` with reductions as explicit sums and symbols indexed (``S[i, j]``), for display."""
        index = {self.dims[0]: sympy.Symbol("i"), self.dims[1]: sympy.Symbol("j")}
        index.update({h: sympy.Symbol(f"h{n}" if n else "a") for n, h in enumerate(self.hidden)})
        order = (*self.dims, *self.hidden)

        def indexed(x):
            sub = {}
            for s in x.free_symbols:
                dims = self.symbol_dims.get(s)
                if dims and s not in self.reductions:
                    sub[s] = sympy.IndexedBase(s.name)[tuple(index[d] for d in order if d in dims)]
            return x.xreplace(sub)

        def walk(x):
            sub = {}
            for s in x.free_symbols:
                if s in self.reductions:
                    r = self.reductions[s]
                    if r.metric is not None:     # (body P)_j: the row vector body times the matrix P
                        j = index[r.over]
                        sub[s] = sympy.Symbol(f"({sympy.sstr(walk(r.body))} @ {r.metric.name})[{j}]")
                        continue
                    sub[s] = sympy.Sum(walk(r.body), (index[r.over], 1, self.size(r.over)))
            return indexed(x.xreplace(sub))

        return walk(sympy.sympify(e))


@dataclass(frozen=True)
class Square:
    """A lazy [n, n] matrix: a sum of ``coef * diag(w)`` and ``coef * outer(u, v)`` terms.

    Square matrices cannot be represented element-wise (both indices would be the same
    dimension), so they are kept as terms and only ever used as factors of a product.
    """
    dim: str
    terms: tuple  # ("diag", w) | ("outer", u, v) | ("state", coef, X): a square state's symbol

    def scale(self, c):
        return Square(self.dim, tuple(
            ("diag", c * t[1]) if t[0] == "diag" else (t[0], c * t[1], t[2]) for t in self.terms))

    def transpose(self):
        return Square(self.dim, tuple(t if t[0] in ("diag", "state") else ("outer", t[2], t[1]) for t in self.terms))

    def states(self) -> list:
        """The square states in it: ``("state", coef, symbol)`` terms (``coef * X``; a square state is
        symmetric, so transposing keeps it)."""
        return [t for t in self.terms if t[0] == "state"]


@dataclass(frozen=True)
class Value:
    shape: tuple[str, str]
    expr: object   # sympy.Expr, or Square when shape is [n, n]

    @property
    def is_scalar(self):
        return self.shape == (ONE, ONE)


def _constants(e) -> list:
    """The values of ``e``'s constants: its numbers, and its outermost constant subexpressions
    (``exp(1000)``, ``2**100``) evaluated (to 5 digits: only their magnitude matters)."""
    out = list(e.atoms(sympy.Number))
    stack = [e]
    while stack:
        x = stack.pop()
        if x.is_Atom:
            continue
        if x.is_number:
            v = x.evalf(5)
            if v.is_Number:
                out.append(v)
            continue
        stack.extend(x.args)
    return out


def show_shape(shape) -> str:
    r, c = shape
    if r == ONE and c == ONE:
        return "scalar"
    if c == ONE:
        return f"[{r}]"
    if r == ONE:
        return f"T([{c}])"
    return f"[{r}, {c}]"


class Lowering:
    """Lowers AST nodes of one spec to ``Value`` s over a shared ``Algebra``."""

    def __init__(self, spec: Spec, algebra: Algebra | None = None):
        self.spec = spec
        d, m = spec.dims
        self.alg = algebra or Algebra(spec.dims, hidden=tuple(h[0] for h in spec.hidden))
        alg = self.alg
        self.env: dict[str, Value] = {}
        for dim in spec.axes():
            self.env[dim] = Value((ONE, ONE), alg.symbol(dim, (), positive=True, integer=True))
        self.square: dict = {}              # square state -> (new, previous) symbols (not element-form)
        for state in spec.state_names():
            if state in spec.square_states():
                self.square[state] = tuple(sympy.Symbol(n, real=True) for n in (state, spec.prev_name(state)))
                for sym in self.square[state]:
                    self.env[sym.name] = Value((m, m), Square(m, (("state", sympy.Integer(1), sym),)))
                continue
            shape = spec.shape_of(state)
            for name in (state, spec.prev_name(state)):
                self.env[name] = Value(shape, alg.symbol(name, shape, real=True))
        for name, decl in spec.inputs.items():
            assume = {"positive": True} if (decl.positive or decl.bounded) else {"real": True}
            self.env[name] = Value(_vector_shape(decl.shape), alg.symbol(name, decl.shape, **assume))
        for name, decl in spec.params.items():
            assume = {"positive": True} if decl.positive else {"negative": True} if decl.negative else {"real": True}
            self.env[name] = Value(_matrix_shape(decl.shape), alg.symbol(name, decl.shape, **assume))
        self._let_text = dict(spec.let)
        self._lowering_lets: list[str] = []
        self.key = ""

    @property
    def state(self) -> sympy.Symbol:
        return self.env[self.spec.state].expr

    @property
    def state_prev(self) -> sympy.Symbol:
        return self.env[self.spec.prev_name(self.spec.state)].expr

    def state_of(self, name: str) -> tuple[sympy.Symbol, sympy.Symbol]:
        """(new, previous) symbols of one state."""
        if name in self.square:
            return self.square[name]
        return self.env[name].expr, self.env[self.spec.prev_name(name)].expr

    # -- entry point ---------------------------------------------------------------
    def lower_text(self, key: str, text: str) -> Value:
        self.key = key
        tree = E.parse(text)
        value = self.lower(tree)
        exprs = [] if isinstance(value.expr, Square) else [sympy.sympify(value.expr)]
        exprs += [r.body for e in exprs for r in self.alg.reductions_in(e)]
        if any(e.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo) for e in exprs):
            raise SpecError(self.spec.source, key, "the expression is undefined: it divides by zero, "
                            "takes log(0) or is otherwise not finite")
        if any(e.has(sympy.I) for e in exprs):
            raise SpecError(self.spec.source, key, "the expression is not real: it takes a square root, a "
                            "fractional power or the log of a negative constant")
        for e in exprs:
            for c in _constants(e):
                if c != 0 and not (E.CONSTANT_RANGE[0] <= abs(c) <= E.CONSTANT_RANGE[1]):
                    raise SpecError(self.spec.source, key, f"a constant folds to {sympy.Float(c, 3)}, out of the range "
                                    f"{E.CONSTANT_RANGE[0]:g} to {E.CONSTANT_RANGE[1]:g} that literals are held to")
        if isinstance(value.expr, Square):
            self.fail(tree, f"the result is an [{value.shape[0]}, {value.shape[1]}] matrix, which is only supported as a factor of a product")
        return value

    def fail(self, node, problem: str):
        raise SpecError(self.spec.source, self.key, f"{problem} (in '{E.unparse(node)}', column {node.pos + 1})")

    # -- the rules -----------------------------------------------------------------
    def lower(self, node) -> Value:
        if isinstance(node, E.Num):
            return Value((ONE, ONE), sympy.Rational(node.value.numerator, node.value.denominator))
        if isinstance(node, E.Name):
            return self.name(node)
        if isinstance(node, E.Neg):
            v = self.lower(node.operand)
            return Value(v.shape, v.expr.scale(-1) if isinstance(v.expr, Square) else -v.expr)
        if isinstance(node, E.BinOp):
            if node.op == "**":
                return self.power(node)
            a, b = self.lower(node.left), self.lower(node.right)
            if node.op == "*":
                return self.matmul(node, a, b)
            if node.op == "/":
                if isinstance(b.expr, Square):
                    self.fail(node, "cannot divide by a square matrix")
                if isinstance(a.expr, Square):
                    if not b.is_scalar:
                        self.fail(node, "a square matrix can only be divided by a scalar")
                    return Value(a.shape, a.expr.scale(1 / b.expr))
                return self.elementwise(node, a, b, lambda x, y: x / y)
            if node.op in "+-":
                sign = 1 if node.op == "+" else -1
                if isinstance(a.expr, Square) or isinstance(b.expr, Square):
                    if a.shape != b.shape or not (isinstance(a.expr, Square) and isinstance(b.expr, Square)):
                        self.fail(node, f"cannot add {show_shape(a.shape)} and {show_shape(b.shape)}")
                    return Value(a.shape, Square(a.expr.dim, a.expr.terms + b.expr.scale(sign).terms))
                return self.elementwise(node, a, b, lambda x, y: x + sign * y)
        if isinstance(node, E.Call):
            return self.call(node)
        raise AssertionError(f"unknown node {node!r}")

    def name(self, node: E.Name) -> Value:
        if node.id in self.env:
            return self.env[node.id]
        if node.id in self._let_text:
            if node.id in self._lowering_lets:
                self.fail(node, f"'let' definitions refer to each other in a cycle: {' -> '.join(self._lowering_lets + [node.id])}")
            self._lowering_lets.append(node.id)
            key = self.key
            self.key = f"let.{node.id}"
            value = self.lower(E.parse(self._let_text[node.id]))
            self.key = key
            self._lowering_lets.pop()
            self.env[node.id] = value
            return value
        self.fail(node, f"unknown name {node.id!r}")

    def constant(self, node):
        """Fold a numeric subexpression (numbers, unary minus, + - * /) to a Fraction, or None."""
        if isinstance(node, E.Num):
            return node.value
        if isinstance(node, E.Neg):
            v = self.constant(node.operand)
            return None if v is None else -v
        if isinstance(node, E.BinOp) and node.op in "+-*/":
            a, b = self.constant(node.left), self.constant(node.right)
            if a is None or b is None or (node.op == "/" and b == 0):
                return None
            return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[node.op]
        return None

    def power(self, node: E.BinOp) -> Value:
        base = self.lower(node.left)
        value = self.constant(node.right)
        if value is None:
            self.fail(node, "the exponent of '**' must be a number")
        if abs(value) > MAX_EXPONENT or (value.denominator not in (1, 2, 3, 4)):
            self.fail(node, f"exponent {value} not allowed (integers or halves/thirds/quarters up to {MAX_EXPONENT})")
        if isinstance(base.expr, Square):
            self.fail(node, "powers of square matrices are not supported")
        return Value(base.shape, base.expr ** sympy.Rational(value.numerator, value.denominator))

    def broadcast(self, node, a: Value, b: Value) -> tuple[str, str]:
        """The shape of an elementwise combination (scalars and vectors broadcast by name)."""
        for v in (a, b):
            if isinstance(v.expr, Square):
                self.fail(node, f"an [{v.shape[0]}, {v.shape[1]}] matrix is only supported as a factor of a product")
        if a.shape == b.shape or b.is_scalar:
            return a.shape
        if a.is_scalar:
            return b.shape
        mats = [v.shape for v in (a, b) if ONE not in v.shape]
        vecs = [v.shape for v in (a, b) if ONE in v.shape]
        if len(mats) == 1 and len(vecs) == 1:
            vdim = vecs[0][0] if vecs[0][0] != ONE else vecs[0][1]
            if vdim in mats[0]:
                return mats[0]
        hint = " (use outer(a, b) for an outer product)" if not mats else ""
        self.fail(node, f"shapes {show_shape(a.shape)} and {show_shape(b.shape)} do not match{hint}")

    def elementwise(self, node, a: Value, b: Value, op) -> Value:
        shape = self.broadcast(node, a, b)
        return Value(shape, op(a.expr, b.expr))

    def matmul(self, node, a: Value, b: Value) -> Value:
        if a.is_scalar or b.is_scalar:
            s, other = (a, b) if a.is_scalar else (b, a)
            if isinstance(other.expr, Square):
                return Value(other.shape, other.expr.scale(s.expr))
            return Value(other.shape, s.expr * other.expr)
        for v in (a, b):
            if isinstance(v.expr, Square) and v.expr.states():
                self._square_state_misuse(node, v)
        (r, n1), (n2, c) = a.shape, b.shape
        if n1 != n2:
            self.fail(node, f"cannot multiply {show_shape(a.shape)} by {show_shape(b.shape)}: inner dimensions {n1} and {n2} differ"
                      + (" (use dot(a, b) or had(a, b))" if ONE in a.shape and ONE in b.shape else ""))
        if isinstance(b.expr, Square):
            if isinstance(a.expr, Square):
                self.fail(node, "products of two square matrices are not supported")
            total = sympy.Integer(0)
            for t in b.expr.terms:
                if t[0] == "diag":
                    total += a.expr * t[1]
                else:  # a * u * T(v)
                    total += self.alg.reduce(a.expr * t[1], n1) * t[2]
            return Value((r, c), total)
        if isinstance(a.expr, Square):
            total = sympy.Integer(0)
            for t in a.expr.terms:
                if t[0] == "diag":
                    total += t[1] * b.expr
                else:  # u * (T(v) * b)
                    total += t[1] * self.alg.reduce(t[2] * b.expr, n1)
            return Value((r, c), total)
        if n1 == ONE:
            if r == c:
                return Value((r, c), Square(r, (("outer", a.expr, b.expr),)))
            return Value((r, c), a.expr * b.expr)
        if r == c and r != ONE:
            self.fail(node, f"the product is an [{r}, {c}] matrix, which is only supported as a factor of a product")
        return Value((r, c), self.alg.reduce(a.expr * b.expr, n1))

    def total(self, e, shape) -> sympy.Expr:
        for dim in shape:
            if dim != ONE:
                e = self.alg.reduce(e, dim)
        return e

    def call(self, node: E.Call) -> Value:
        f = node.func
        args = [self.lower(a) for a in node.args]
        if f == "ones":
            arg = node.args[0]
            if not isinstance(arg, E.Name) or arg.id not in self.spec.axes():
                self.fail(node, f"ones() takes a dimension name ({', '.join(self.spec.axes())})")
            return Value((arg.id, ONE), sympy.Integer(1))
        if f == "T":
            v = args[0]
            expr = v.expr.transpose() if isinstance(v.expr, Square) else v.expr
            return Value((v.shape[1], v.shape[0]), expr)
        if f in ("sq", "wsq") and any(isinstance(a.expr, Square) and a.expr.states() for a in args):
            return self.metric_call(node, f, args)
        for a in args:
            if isinstance(a.expr, Square):
                if a.expr.states():
                    self._square_state_misuse(node, a)
                self.fail(node, f"{f}() of an [{a.shape[0]}, {a.shape[1]}] matrix is not supported")
        if f in SCALAR_FUNCTIONS:
            return Value(args[0].shape, SCALAR_FUNCTIONS[f](args[0].expr))
        if f == "sq":
            return Value((ONE, ONE), self.total(args[0].expr ** 2, args[0].shape))
        if f == "wsq":
            v, w = args
            shape = self.broadcast(node, v, w)
            if shape != v.shape:
                self.fail(node, f"the weight {show_shape(w.shape)} does not fit the vector {show_shape(v.shape)}")
            return Value((ONE, ONE), self.total(w.expr * v.expr ** 2, v.shape))
        if f == "dot":
            a, b = args
            if set(a.shape) != set(b.shape) or sorted(a.shape) != sorted(b.shape):
                self.fail(node, f"dot() needs two arguments of the same shape, got {show_shape(a.shape)} and {show_shape(b.shape)}")
            return Value((ONE, ONE), self.total(a.expr * b.expr, a.shape))
        if f == "had":
            return self.elementwise(node, args[0], args[1], lambda x, y: x * y)
        if f == "outer":
            a, b = args
            for v in (a, b):
                if v.shape[1] != ONE and v.shape[0] != ONE or v.is_scalar:
                    self.fail(node, f"outer() takes two vectors, got {show_shape(v.shape)}")
            ra = a.shape[0] if a.shape[0] != ONE else a.shape[1]
            rb = b.shape[0] if b.shape[0] != ONE else b.shape[1]
            if ra == rb:
                return Value((ra, rb), Square(ra, (("outer", a.expr, b.expr),)))
            return Value((ra, rb), a.expr * b.expr)
        if f == "diag":
            v = args[0]
            if ONE not in v.shape or v.is_scalar:
                self.fail(node, f"diag() takes a vector, got {show_shape(v.shape)}")
            n = v.shape[0] if v.shape[0] != ONE else v.shape[1]
            return Value((n, n), Square(n, (("diag", v.expr),)))
        self.fail(node, f"unknown function {f!r}")


    # -- square states (metrics) ---------------------------------------------------------
    def _square_state_misuse(self, node, v: Value):
        names = ", ".join(t[2].name for t in v.expr.states())
        self.fail(node, f"a square state ({names}) is only read as the metric of wsq(V, {names}) or inside sq() "
                  "in its own loss")

    def metric_call(self, node, f: str, args) -> Value:
        """``sq(A)`` of a square expression with state terms (a square state's own loss), or
        ``wsq(V, c X)`` with a square state X as the metric of a [d, m] ``V``: a scalar placeholder
        symbol registered on the algebra (``Algebra.square_norms`` / ``Algebra.metrics``), which
        ``ssmcraft.compiler.metric`` derives from."""
        alg = self.alg
        if f == "sq":
            sym = sympy.Symbol(f"_sq{len(alg.square_norms)}", nonnegative=True)
            alg.square_norms[sym] = args[0].expr
            return Value((ONE, ONE), sym)
        v, w = args
        if isinstance(v.expr, Square) or v.shape != self.spec.dims:
            self.fail(node, f"wsq(V, X) with a square state X takes a [{', '.join(self.spec.dims)}] matrix V, "
                      f"got {show_shape(v.shape)}")
        if not isinstance(w.expr, Square) or len(w.expr.terms) != 1:
            self.fail(node, "the metric of wsq(V, X) is one square state times a scalar")
        _, coef, X = w.expr.terms[0]
        sym = sympy.Symbol(f"_mq{len(alg.metrics)}", real=True)
        alg.metrics[sym] = MetricTerm(sympy.sympify(v.expr), coef, X)
        return Value((ONE, ONE), sym)


def _vector_shape(shape: tuple[str, ...]) -> tuple[str, str]:
    return (ONE, ONE) if not shape else (shape[0], ONE)


def _matrix_shape(shape: tuple[str, ...]) -> tuple[str, str]:
    if len(shape) == 2:
        return (shape[0], shape[1])
    return _vector_shape(shape)


@dataclass(frozen=True)
class SymbolicObjective:
    """Stage 2's result: the loss and the readout as element expressions."""
    spec: Spec
    lowering: Lowering
    loss: sympy.Expr       # scalar (with several states: the sum of their losses, for display)
    output: sympy.Expr     # one element of y (varies over the output dimension)
    losses: tuple = ()     # several states: (state name, its loss) in declaration order

    @property
    def algebra(self) -> Algebra:
        return self.lowering.alg

    def matrix_form(self) -> str:
        """The loss written with explicit sums (readable, for ``ssmcraft derive``)."""
        return sympy.sstr(self.algebra.expand(self.loss))


def symbolic_objective(spec: Spec) -> SymbolicObjective:
    """Lower the spec's objective and output; check they are a scalar and a vector over rows."""
    low = Lowering(spec)
    for name, text in spec.let:
        low.key = f"let.{name}"
        low.name(E.Name(name, 0))
    if spec.states:
        return _multi_state_objective(spec, low)
    loss = low.lower_text("objective", spec.objective)
    if not loss.is_scalar:
        raise SpecError(spec.source, "objective", f"the objective must be a scalar, got a {show_shape(loss.shape)} value")
    if not low.alg.depends_on(loss.expr, low.state):
        raise SpecError(spec.source, "objective", f"the objective does not depend on the state {spec.state}")
    out = _output(spec, low)
    if not low.alg.depends_on(out, low.state):
        raise SpecError(spec.source, "output", f"the output does not read the state {spec.state}")
    return SymbolicObjective(spec, low, sympy.sympify(loss.expr), out)


def _output(spec: Spec, low: Lowering) -> sympy.Expr:
    out = low.lower_text("output", spec.output)
    d = spec.dims[0]
    if out.shape not in ((d, ONE), (ONE, d)):
        raise SpecError(spec.source, "output", f"the output must be a vector over {d} (like {spec.state}*q), got {show_shape(out.shape)}")
    return sympy.sympify(out.expr)


def _multi_state_objective(spec: Spec, low: Lowering) -> SymbolicObjective:
    """Several states: one scalar loss per state, each depending on its own state; the output
    reads at least one. (What a loss or the output may not read, a later state's new value or
    an ``X_prev``, directly or through a ``let``, the spec stage checks: ``spec._reads``.)"""
    alg, src = low.alg, spec.source
    losses = []
    for name, text in zip(spec.states, spec.objectives):
        key = f"objective.{name}"
        loss = low.lower_text(key, text)
        if not loss.is_scalar:
            raise SpecError(src, key, f"the loss must be a scalar, got a {show_shape(loss.shape)} value")
        if name in low.square:
            check_square_loss(spec, low, name, key, loss.expr)
        elif not alg.depends_on(loss.expr, low.state_of(name)[0]) and not any(
                alg.depends_on(alg.metrics[p].V, low.state_of(name)[0]) for p in loss.expr.free_symbols if p in alg.metrics):
            raise SpecError(src, key, f"the loss does not depend on the state {name}")
        losses.append((name, sympy.sympify(loss.expr)))
    out = _output(spec, low)
    if not any(alg.depends_on(out, low.state_of(x)[0]) for x in spec.states):
        raise SpecError(src, "output", f"the output reads none of the states {', '.join(spec.states)}")
    return SymbolicObjective(spec, low, sympy.Add(*(e for _, e in losses)), out, tuple(losses))


# -- square states (``ssmcraft.compiler.metric`` derives their updates) --------------------------

def matvec(alg, body, over: str, P: sympy.Symbol):
    """``sum_j' body_j' P_j'j``: ``body`` (varying over ``over``, the key dimension) as a row vector
    times the square matrix ``P``; factors that do not vary over ``over`` are pulled out. A new or
    shared reduction symbol (``Reduction.metric`` is ``P``) over the same dimensions as ``body``."""
    inner, outer = [], []
    for f in sympy.Mul.make_args(sympy.sympify(body)):
        (inner if over in alg.dims_of(f) else outer).append(f)
    body = sympy.Mul(*inner)
    key = (body, over, P)
    if key not in alg._keys:
        dims = alg.dims_of(body) | {over}
        sym = alg.symbol(f"_r{alg._count}", dims, real=True)
        alg._count += 1
        alg.reductions[sym] = Reduction(sym, body, over, dims, metric=P)
        alg._keys[key] = sym
    return sympy.Mul(*outer) * alg._keys[key]


def _holders(alg, e, registry) -> list:
    return sorted((s for s in sympy.sympify(e).free_symbols if s in registry), key=lambda s: s.name)


def _linear_in(e, holders, what: str, fail):
    """``e = sum_p c_p p + rest`` with every ``c_p`` free of the placeholders: {p: c_p}, rest."""
    coefs = {}
    for p in holders:
        c = sympy.diff(e, p)
        if c.free_symbols & set(holders):
            fail(f"{what} must enter the loss linearly (times a coefficient), not inside another function")
        coefs[p] = c
    return coefs, sympy.expand(e).xreplace({p: 0 for p in holders})


def check_square_loss(spec, low, name: str, key: str, loss) -> None:
    """The symbolic stage's checks of a square state's loss: ``sum_i c_i sq(A_i)`` with state terms
    in the ``A_i``, the state's new value among them, no metric term (``wsq(V, X)``)."""
    alg = low.alg

    def fail(problem):
        raise SpecError(spec.source, key, problem)
    if _holders(alg, loss, alg.metrics):
        fail(f"the loss of the square state {name} cannot hold a metric term wsq(V, X)")
    holders = _holders(alg, loss, alg.square_norms)
    _linear_in(loss, holders, "sq() of a square expression", fail)
    new = low.square[name][0]
    if not any(t[2] == new for p in holders for t in alg.square_norms[p].states()):
        fail(f"the loss does not depend on the square state {name}: write it as sq({name} - ...)/2")
