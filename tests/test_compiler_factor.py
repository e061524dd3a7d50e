"""The reduction factoring stage (``ssmcraft.compiler.factor``): a sum over one state dimension
whose body also varies over the other is split into smaller sums, exactly.

- on hand-made bodies: what is split (every term leaves a smaller sum) and what is kept (a term
  with a genuine [d, m] part, a term with nothing to sum);
- longhorn_2key and a held-out two-weight regression: no per-token coefficient reads a sum that
  spans [d, m] any more, ``UpdateIR.factored`` records each rewrite, ``derive`` prints it, and the
  factored update equals the unfactored one in float64 (output and final state of the generated
  reference loops on the same random inputs);
- the prologue of longhorn_2key tiles many tokens per program (no [d, m] value in its tiles);
- per token (the prologue's use): a sum of a polynomial in the keys reads the sums of its monomials.
"""
import sympy
import torch

from ssmcraft.cli import main
from ssmcraft.compiler.factor import factor_sums
from ssmcraft.compiler.spec import load_spec
from ssmcraft.compiler.structure import build_ir
from ssmcraft.compiler.symbolic import Algebra, symbolic_objective
from ssmcraft.runtime.objective import from_ir

HELD_OUT = """
name: two_weights
summary: "held out (no library spec), two associations with their own per-channel weights"
state: {S: [d, m]}
inputs:
  x: {shape: [d]}
  x2: {shape: [d]}
  k: {shape: [m]}
  k2: {shape: [m]}
  q: {shape: [m]}
  beta: {shape: [d], positive: true, bounded: true}
  gam: {shape: [d], positive: true, bounded: true}
objective: "sq(S - S_prev)/2 + wsq(S*k - x, beta)/2 + wsq(S*k2 - x2, gam)/2"
update: implicit
approximation: exact
output: "S*q"
"""


def _algebra():
    alg = Algebra(("d", "m"))
    alg.symbol("d", positive=True, integer=True)
    alg.symbol("m", positive=True, integer=True)
    sym = {n: alg.symbol(n, dims, real=True) for n, dims in
           (("x", ("d",)), ("b", ("d",)), ("k", ("m",)), ("k2", ("m",)), ("A", ("d", "m")))}
    return alg, sym


def test_a_separable_body_is_split_into_smaller_sums():
    alg, s = _algebra()
    e = alg.reduce(s["k"] * (s["b"] * s["k"] * s["x"] + s["k2"] * s["x"]), "m")
    out, done = factor_sums(alg, e)
    assert len(done) == 1 and done[0].over == "m"
    kk, kk2 = alg.reduce(s["k"] ** 2, "m"), alg.reduce(s["k"] * s["k2"], "m")
    assert sympy.expand(out - (s["b"] * s["x"] * kk + s["x"] * kk2)) == 0
    assert all(not r.dims for r in alg.reductions_in(out))      # only per-token scalars are summed


def test_a_body_with_a_two_dimensional_part_or_a_constant_term_is_kept():
    alg, s = _algebra()
    for body in (s["k"] * (s["A"] + s["b"] * s["k"] * s["x"]),      # A [d, m]: nothing to gain
                 s["b"] * s["k"] * s["x"] + s["x"]):                # x: its sum is m x, not a reduction
        e = alg.reduce(body, "m")
        out, done = factor_sums(alg, e)
        assert done == [] and out == e


def test_a_per_token_sum_of_a_polynomial_in_the_keys_is_split_into_its_monomials():
    """With ``per_token`` (the prologue's use), ``sum_m (k + k2)^2`` and ``sum_m 3 k k2`` read the same
    ``k.k2``: three sums, not four; without it, a sum that leaves no dimension is kept."""
    alg, s = _algebra()
    k, k2, b = s["k"], s["k2"], s["b"]
    e = b * alg.reduce((k + k2) ** 2, "m") + alg.reduce(3 * k * k2, "m")
    assert factor_sums(alg, e) == (e, [])
    out, _ = factor_sums(alg, e, per_token=True)
    kk, kk2, k2k2 = (alg.reduce(x, "m") for x in (k ** 2, k * k2, k2 ** 2))
    assert sympy.expand(out - (b * (kk + 2 * kk2 + k2k2) + 3 * kk2)) == 0
    assert {r.body for r in alg.reductions_in(out)} == {k ** 2, k * k2, k2 ** 2}


def _irs(text_or_name):
    spec = load_spec(text_or_name)
    return spec, build_ir(symbolic_objective(spec), factor=False), build_ir(symbolic_objective(spec))


def _max_rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _check(text_or_name, random_inputs, want_factored):
    spec, plain, ir = _irs(text_or_name)
    spans = lambda r: set(r.dims) | {r.over} == set(ir.dims)       # noqa: E731
    assert any(spans(r) for r in plain.reductions)                  # the derivation sums [d, m] bodies...
    assert not any(spans(r) for r in ir.reductions)                 # ...the factored IR does not
    assert len(ir.factored) == want_factored
    assert [c.name for c in ir.coefficients if not c.name.startswith("_t")] == \
        [c.name for c in plain.coefficients if not c.name.startswith("_t")]
    a, b = from_ir(spec, plain), from_ir(spec, ir)
    inputs, params = random_inputs(spec, B=2, T=7, H=2, sizes={"d": 5, "m": 3}, seed=3)
    S0 = torch.randn(2, 2, 5, 3, dtype=torch.float64)
    ya, Sa = a.reference(inputs, params, initial_state=S0)
    yb, Sb = b.reference(inputs, params, initial_state=S0)
    assert _max_rel(yb, ya) < 1e-12 and _max_rel(Sb, Sa) < 1e-12
    return ir


def test_longhorn_2key_is_factored_and_unchanged_numerically(random_inputs, capsys):
    ir = _check("longhorn_2key", random_inputs, 2)
    assert {(f.over, sympy.sstr(f.expr)) for f in ir.factored} == \
        {("m", "_r0*beta*x + _r2*beta*x2"), ("m", "_r1*beta*x2 + _r2*beta*x")}
    assert main(["derive", "longhorn_2key"]) == 0
    out = capsys.readouterr().out
    assert "reductions factored" in out and "sum_m k*(beta*k*x + beta*k2*x2) = _r0*beta*x + _r2*beta*x2" in out
    assert main(["derive", "longhorn_2key", "--json"]) == 0
    assert '"factored"' in capsys.readouterr().out


def test_a_held_out_two_weight_regression_is_factored_and_unchanged_numerically(random_inputs):
    _check(HELD_OUT, random_inputs, 2)


def test_an_objective_without_such_sums_keeps_its_ir():
    for name in ("longhorn", "deltanet"):
        _, plain, ir = _irs(name)
        assert ir.factored == () and ir.content_hash() == plain.content_hash()


def test_the_longhorn_2key_prologue_tiles_many_tokens_per_program(compiled, monkeypatch):
    from ssmcraft.ops.codegen import prologue as P
    from ssmcraft.ops.common.slots import bindings
    obj = compiled("longhorn_2key")
    pro = P.build(obj.ir, bindings(obj.ir))
    assert "VK" not in pro.kinds
    monkeypatch.setattr(P, "INTERPRET", False)      # the GPU's tiles: rows per program by BUDGET
    for backward in (False, True):
        R, BV, BK, _ = P._tiles(pro, 64, 64, 8 * 2048 * 16, backward)
        assert (BV, BK) == (64, 64) and R == P.BUDGET[backward] // 64 > 1
