"""General / nonlinear family (fused sequential kernel, symbolically derived backward) under
the Triton interpreter, against the float64 reference recurrence: output, final state and
every gradient (inputs, params, initial state; with a gradient on the final state), outputs
poisoned with NaN first."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.codegen import general as GC  # noqa: E402
from ssmcraft.ops.general import recurrent as G  # noqa: E402
from helpers import assert_within, kernel_errors, kernel_inputs, rel_rms as rel  # noqa: E402

# relative RMS error ||ours - ref|| / ||ref||, fp32 kernel vs float64 reference. The derived
# adjoint of a quotient update (Cauchy) cancels terms of size ~1 in fp32: its gradients land
# near 5e-6, hence the looser gradient tolerance.
TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 5e-5}

BASE = {"state": {"S": ["d", "m"]}, "update": "explicit", "approximation": "exact", "output": "S*q",
        "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"], "normalize": True}, "q": {"shape": ["m"]},
                   "beta": {"shape": [], "bounded": True}}}
# a linear update that couples rows (kind "general") and a nonlinear one with a param
COL_DELTA = dict(BASE, name="col_delta", summary="test: explicit step on a column regression",
                 objective="beta*sq(T(S)*x - k)/2")
COL_CAUCHY = dict(BASE, name="col_cauchy", summary="test: Cauchy column regression with a weighted decay",
                  objective="beta*log(1 + sq(T(S)*x - k))/2 + sq(S*w)/2",
                  params={"w": {"shape": ["m"], "init": "ones"}})


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(G, "POISON", True)
    monkeypatch.setattr(G, "CHUNK", 32)


def _compile(which):
    return ssmcraft.compile(which)


def test_supports_and_source():
    obj = _compile("cauchy_delta")
    assert obj.ir.kind == "nonlinear" and G.supports(obj.ir) is None
    assert _compile(COL_DELTA).ir.kind == "general" and G.supports(_compile(COL_DELTA).ir) is None
    assert "general/nonlinear" in G.supports(_compile("longhorn").ir)
    step, mod, source = G._module(obj.ir)
    assert "spec: cauchy_delta" in source and "def general_fwd_kernel" in source and "def general_bwd_kernel" in source
    assert hasattr(mod, "general_fwd_kernel") and hasattr(mod, "general_bwd_kernel")


def test_printer_keeps_denominators():
    import sympy
    x, y, b = sympy.symbols("x y b")
    code = GC._triton_code(-b * x / (1 + y), {})
    assert eval(code, {"x": 1.3, "y": 0.7, "b": -2.1}) == pytest.approx(float((-b * x / (1 + y)).subs({x: 1.3, y: 0.7, b: -2.1})))


@pytest.mark.parametrize("expr,expected", [("x**(3/2)", "(x*tl.sqrt(x))"), ("x**(-5/2)", "(1.0 / (x*x*tl.sqrt(x)))"),
                                           ("(1 + y)**(3/2)", "((1.0 + y)*tl.sqrt(1.0 + y))")])
def test_printer_half_integer_powers(expr, expected):
    """x**(n/2) printed as products and one square root (a Newton step's curvature, huber_longhorn's
    (1 + r^2)^(3/2)), exact where exp(n/2 log x) rounds twice, and evaluating as the power does."""
    import math

    import sympy
    x, y = sympy.symbols("x y", positive=True)
    e = sympy.sympify(expr, locals={"x": x, "y": y})
    code = GC._triton_code(e, {})
    assert code == expected
    env = {"tl": type("tl", (), {"sqrt": staticmethod(math.sqrt)})}
    assert eval(code, env, {"x": 1.7, "y": 0.3}) == pytest.approx(float(e.subs({x: 1.7, y: 0.3})), rel=1e-14)


def test_reciprocals_invert_each_denominator_once():
    """Negative powers of bases that read nothing ignored become powers of one new symbol per
    base (the half-integer ones of its square root's); a base that reads an ignored symbol keeps
    its division; substituted back, the value is unchanged."""
    import sympy
    a, b, c, s = sympy.symbols("a b c s", positive=True)
    exprs = [s / (a * (1 + b)) + s**2 / (1 + b)**2, a / (1 + b)**sympy.Rational(3, 2) + c / (1 + s)]
    inverses: dict = {}
    out = GC._reciprocals(exprs, {s}, inverses)
    assert set(inverses) == {a, 1 + b, sympy.sqrt(1 + b)}
    left = [p for e in out for p in sympy.preorder_traversal(e) if p.is_Pow and p.exp < 0]
    assert left == [1 / (1 + s)]
    back = {r: 1 / base for base, r in inverses.values()}
    vals = {a: 1.3, b: 0.4, c: -0.7, s: 2.2}
    for e, o in zip(exprs, out):
        assert float(o.subs(back).subs(vals)) == pytest.approx(float(e.subs(vals)), rel=1e-14)


def test_simplest_keeps_what_the_printer_prints():
    """An update's coefficient is simplified where that takes fewer operations and brings in no
    function the coefficient did not read (``sqrt(x^2)`` of a real ``x`` stays: simplify writes
    ``Abs``); one over the size limit is left as it is."""
    import sympy
    x, b, r0 = sympy.symbols("x b r0", real=True)
    u = 1 + x**2
    newton = (r0 * b**2 * x - b * x * (r0 * b + u**sympy.Rational(3, 2))) / (sympy.sqrt(u) * (r0 * b + u**sympy.Rational(3, 2)))
    out = GC._simplest(newton)
    assert sympy.count_ops(out) < sympy.count_ops(newton)
    vals = {x: 0.7, b: 1.3, r0: 2.1}
    assert float(out.subs(vals)) == pytest.approx(float(newton.subs(vals)), rel=1e-14)
    assert GC._simplest(sympy.sqrt(x**2) + x) == sympy.sqrt(x**2) + x
    assert GC._simplest(newton, most=5) is newton


def _reverse_step(source: str) -> list[str]:
    """The code lines (comments dropped) of the backward kernel's reverse loop over a chunk's steps."""
    body = source[source.index("def general_bwd_kernel"):]
    body = body[body.index("for jt in range"):body.index("if STORE_DS0")]
    return [line.split("#")[0] for line in body.splitlines()[1:]]


def test_newton_adjoint_divides_once_per_denominator():
    """huber_longhorn's update is derived as ``S_prev + k c`` with its Newton coefficient simplified,
    ``c = -beta r u / D`` (``r = S k - x``, ``u = 1 + r^2``, ``D = r0 beta + u^(3/2)``), so its reverse
    step divides once, by ``D``, as a reciprocal the rest of the step multiplies by, and recomputes
    the state as ``S_prev + k * coefficient`` (no per-element product by ``D * (1/D)``); the key
    gradient's one sum of the tile over the rows holds only the terms that read a tile (``2 k sum_d
    B`` with a per-row ``B`` is summed over the rows as per-row values, not as ``2 k B`` over the
    tile); and the adjoint never sums ``G S_prev`` over the keys (the quotient form's derivative has
    such terms, which cancel)."""
    lines = _reverse_step(G.generated_source(_compile("huber_longhorn").ir))
    divisions = [line for line in lines if "/" in line]
    assert len(divisions) == 1 and all("(1.0 / (" in line and line.count("/") == 1 for line in divisions)
    (st,) = [line for line in lines if line.strip().startswith("st = ")]
    assert "tl.where(MASK, sp + l_k*(" in st and "/" not in st
    (dk,) = [line for line in lines if "tl.atomic_add(D_k" in line]
    tile_sum = dk[dk.index("tl.where(MASK, "):dk.index(", 0.0), axis=1")]
    assert "sp*(" in tile_sum and "g*(" in tile_sum and "l_k" not in tile_sum
    assert not [line for line in lines if "sp*g" in line or "g*sp" in line]


@pytest.mark.parametrize("which,T,chunk", [
    ("cauchy_delta", 1, 32), ("cauchy_delta", 7, 4), ("cauchy_delta", 33, 16),
    ("col_delta", 7, 4), ("col_cauchy", 9, 4),
])
def test_matches_reference(which, T, chunk, monkeypatch):
    monkeypatch.setattr(G, "CHUNK", chunk)
    obj = _compile({"col_delta": COL_DELTA, "col_cauchy": COL_CAUCHY}.get(which, which))
    B, H, d, m = (1, 1, 12, 8) if T > 16 else (2, 2, 12, 8)
    ins, params, S0, g = kernel_inputs(obj, B, T, H, d, m, seed=T)
    assert_within(kernel_errors(obj, lambda o, lay: G.forward(o, lay, None, True), ins, params, S0, g), TOL)


def test_kernel_level_fla_layout():
    """general_scan: FLA layout ([B, H, K, V] states), no initial state, inference path."""
    obj = _compile("cauchy_delta")
    B, T, H, d, m = 1, 5, 1, 12, 8
    ins, _, _, _ = kernel_inputs(obj, B, T, H, d, m, seed=5)
    y_ref, S_ref = obj.reference(ins, None, None)
    with torch.no_grad():
        y, S = G.general_scan(obj, {k: v.float() for k, v in ins.items()}, output_final_state=True)
    assert S.shape == (B, H, m, d)
    assert rel(y, y_ref) < TOL["y"] and rel(S.transpose(-1, -2), S_ref) < TOL["S_T"]
