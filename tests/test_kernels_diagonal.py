"""The diagonal-decay Triton kernels vs the reference recurrence, under TRITON_INTERPRET=1.

Every diagonal-family library objective: output, final state and EVERY gradient (each input,
each param, the initial state, with a gradient on the final state too) against the float64
reference loop, outputs NaN-poisoned first (the kernels must write all of them). Odd lengths
(1, 7, 65), padded K (m = 5 -> BK = 8), value blocks that do not divide d, several time
groups (the time-parallel passes) and per-head / shared params. GPU checks in fp32 and bf16:
benchmarks/bench_diagonal.py.
"""
import re

import pytest
import sympy
import torch

import ssmcraft
from ssmcraft.compiler.functions import sigmoid, silu, softplus
from ssmcraft.ops.diagonal import chunk as D
from ssmcraft.ops.codegen.triton_printer import triton_code
from helpers import assert_within, rel_rms as _rel
from ssmcraft.runtime.checking import reference_errors

# relative RMS error vs the float64 reference, fp32 kernel (interpreter)
TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5}

DIAGONAL = ["longhorn_diag", "mamba", "gla", "hgrn", "retnet", "linear_attention"]


def _inputs(obj, B, T, H, d, m, seed=0, per_head_params=True):
    g = torch.Generator().manual_seed(seed)
    ir = obj.ir
    size = {ir.dims[0]: d, ir.dims[1]: m}
    inputs = {}
    for n, dims in ir.inputs.items():
        t = torch.randn([B, T, H] + [size[x] for x in dims], generator=g, dtype=torch.float64)
        decl = obj.spec.inputs[n]
        if decl.bounded:
            t = torch.sigmoid(t + 1.5)
        elif decl.positive:
            t = torch.nn.functional.softplus(t)
        inputs[n] = t
    params = {}
    for n, dims in ir.params.items():
        shape = ([H] if per_head_params else []) + [size[x] for x in dims]
        t = torch.rand(shape, generator=g, dtype=torch.float64)
        params[n] = -(t + 0.2) if obj.spec.params[n].negative else t * 0.5 + 0.4
    S0 = torch.randn(B, H, d, m, generator=g, dtype=torch.float64)
    return inputs, params, S0


def _check(name, B, T, H, d, m, config, per_head_params=True, with_s0=True, final_state=True):
    obj = ssmcraft.compile(name) if isinstance(name, str) else name
    inputs, params, S0 = _inputs(obj, B, T, H, d, m, per_head_params=per_head_params)

    def ours(i, p, s0):
        """The diagonal scan on the fp32 leaves (FLA state layout inside), outputs poisoned."""
        y, S = D.diagonal_scan(obj, {**i, **p}, None if s0 is None else s0.transpose(-1, -2), final_state,
                               config=config)
        return y, (S.transpose(-1, -2) if S is not None else None)
    D.set_poison(True)
    try:
        cmp = reference_errors(obj, ours, inputs, params, S0 if with_s0 else None, torch.Generator().manual_seed(T),
                               final_state=final_state)
    finally:
        D.set_poison(False)
    assert cmp.written, f"{name}: an output or gradient has NaN (unwritten output?)"
    assert_within(cmp.errors, TOL)


# one table: (objective, B, T, H, d, m, config)
CASES = [
    ("longhorn_diag", 1, 1, 2, 12, 5, D.Config(BV=16, num_warps=1, NG=1, NSUB=1, HSUM=True)),  # K padded, halving sums
    ("longhorn_diag", 2, 7, 1, 12, 5, D.Config(BV=8, num_warps=1, NG=1, NSUB=1)),     # 2 value blocks, d % BV != 0
    ("longhorn_diag", 2, 7, 1, 12, 5, D.Config(BV=8, num_warps=1, NG=1, NSUB=1, HSUM=True)),
    ("longhorn_diag", 1, 65, 1, 8, 4, D.Config(BV=8, num_warps=1, NG=3, NSUB=1)),     # 9 chunks in 3 groups
    ("longhorn_diag", 2, 32, 1, 16, 4, D.Config(BV=8, num_warps=1, NG=2, NSUB=2, HSUM=True)),  # V % BV = T % L = 0: no masks
    ("mamba", 1, 19, 2, 6, 4, D.Config(BV=8, num_warps=1, NG=2, NSUB=1)),             # [H, d, m] param A
    ("mamba", 1, 19, 2, 6, 4, D.Config(BV=8, num_warps=1, NG=2, NSUB=1, HSUM=True)),
    ("mamba", 1, 21, 2, 6, 4, D.Config(BV=8, num_warps=1, NG=1, NSUB=2, PREFETCH=True)),   # fwd: 4-step prefetch, tail
    ("longhorn_diag", 2, 32, 1, 16, 4, D.Config(BV=8, num_warps=1, NG=2, NSUB=2, PREFETCH=True)),  # prefetch, even T
    # the backward's unrolled refill with a sub-chunk that ends past T
    ("longhorn_diag", 1, 18, 1, 8, 4, D.Config(BV=8, num_warps=1, NG=2, NSUB=2)),
    ("mamba", 2, 37, 1, 8, 4, D.Config(BV=8, num_warps=1, NG=2, NSUB=4, HSUM=True)),
    ("gla", 1, 7, 2, 8, 4, D.Config(BV=8, num_warps=1, NG=1, NSUB=1, HSUM=True)),
    ("hgrn", 2, 9, 1, 8, 4, D.Config(BV=8, num_warps=1, NG=2, NSUB=1)),
    ("retnet", 1, 13, 2, 8, 4, D.Config(BV=8, num_warps=1, NG=2, NSUB=1)),
    ("linear_attention", 1, 1, 1, 8, 4, D.Config(BV=8, num_warps=1, NG=1, NSUB=1)),
    ("longhorn_diag", 1, 9, 1, 32, 16, D.Config(BV=16, num_warps=1, NG=2, NSUB=1, DOTRED=True)),  # sums on "tensor cores"
]


@pytest.mark.parametrize("name,B,T,H,d,m,config", CASES, ids=[f"{c[0]}-T{c[2]}-NG{c[6].NG}{'-dot' if c[6].DOTRED else ''}{'-hsum' if c[6].HSUM else ''}"
                              f"{'-pf' if c[6].PREFETCH else ''}"
                              for c in CASES])
def test_kernel_matches_reference(name, B, T, H, d, m, config):
    _check(name, B, T, H, d, m, config)


def test_shared_params_and_no_initial_state():
    # retnet's gamma and mamba's A given without a head axis (shared by every head), no S0
    _check("retnet", 1, 5, 2, 8, 4, D.Config(BV=8, num_warps=1, NG=1, NSUB=1), per_head_params=False, with_s0=False)


def test_rule_config_and_default_sub_chunks():
    # the interpreter's rule config (no config given) with the GPU's sub-chunk layout (NSUB=4)
    _check("longhorn_diag", 1, 7, 1, 8, 4, None)


def test_mitigated_decay_real_power_and_sign():
    # Stuffed Mamba's retention scaling: a -> sign(a) |a|^1.5 (its derivative has DiracDelta -> 0)
    obj = ssmcraft.compile("longhorn_diag").mitigated(retention=1.5, insertion=0.5)
    _check(obj, 1, 5, 1, 8, 4, D.Config(BV=8, num_warps=1, NG=1, NSUB=1))


def test_every_diagonal_library_objective_is_supported():
    for name in DIAGONAL:
        assert D.supports(ssmcraft.compile(name).ir) is None, name
    for name in ("longhorn", "deltanet", "cauchy_delta"):
        assert D.supports(ssmcraft.compile(name).ir) is not None, name


def test_zero_length_and_forward_only():
    obj = ssmcraft.compile("longhorn_diag")
    inputs, params, S0 = _inputs(obj, 1, 0, 1, 8, 4)
    y, S = D.diagonal_scan(obj, {k: v.float() for k, v in inputs.items()}, S0.float().transpose(-1, -2), True)
    assert y.shape == (1, 0, 1, 8) and torch.equal(S, S0.float().transpose(-1, -2))
    inputs, params, S0 = _inputs(obj, 1, 3, 1, 8, 4)
    with torch.no_grad():
        y, S = D.diagonal_scan(obj, {k: v.float() for k, v in inputs.items()}, None, False)
    yr, _ = obj.reference(inputs, params, None, False)
    assert S is None and _rel(y, yr) < TOL["y"]


@pytest.mark.parametrize("with_s0", [False, True])
def test_groups_carry_without_a_final_state_gradient(with_s0):
    """NG > 1 with no final-state cotangent (``output_final_state=False``: the backward's carry across
    groups starts from zero, ``HAS_DHT`` off), with or without an initial state (``HAS_H0``): 10
    chunks in 3 groups, the last partial."""
    _check("mamba", 2, 37, 1, 8, 4, D.Config(BV=8, num_warps=1, NG=3, NSUB=1), with_s0=with_s0, final_state=False)


def test_generated_source_is_readable():
    obj = ssmcraft.compile("longhorn_diag")
    from ssmcraft.ops.codegen import diagonal as G

    plan = G.plan(obj.ir)
    src = G._Gen(plan, pad_k=False, ls=8, fast_math=False).source("test")
    for kernel in ("diagonal_fwd_summary_kernel", "diagonal_fwd_propagate_kernel", "diagonal_fwd_main_kernel", "diagonal_bwd_summary_kernel", "diagonal_bwd_propagate_kernel", "diagonal_bwd_main_kernel"):
        assert f"def {kernel}(" in src
    assert "_a [d, m] = -_c*k**2 + 1" in src           # the coefficient table in the docstring
    assert "N_a = 1.0 - N_c*(L_k*L_k)" in src            # a computed in registers from its leaves
    compile(src, "generated", "exec")


def test_every_step_load_of_the_backward_carries_its_time_mask():
    """diagonal_bwd_main_kernel's refill and sub-chunk steps past T must not read: the interpreter does not see an
    out-of-bounds load, and the kernels' results do not depend on what such a step reads (its state
    only starts sub-chunks wholly past T, whose every store is masked), so this is checked on the source."""
    for name in ("longhorn_diag", "mamba"):
        src = D.generated_source(ssmcraft.compile(name).ir)
        body = src[src.index("def diagonal_bwd_main_kernel("):]
        loads = [ln for ln in body.splitlines() if "tl.load(" in ln and re.search(r"\br?tok\d\b", ln)]
        assert any("rtok0" in ln for ln in loads) and any("tok0" in ln and "rtok0" not in ln for ln in loads)
        for ln in loads:
            pre, k = re.search(r"\b(r?)tok(\d)\b", ln).groups()
            assert "mask=" in ln and re.search(rf"\b{pre}v{k}\b", ln.split("mask=")[1]), ln


def test_gpu_source_uses_fast_exp_and_the_interpreter_source_does_not():
    ir = ssmcraft.compile("mamba").ir
    gpu, cpu = D.generated_source(ir, fast_math=True), D.generated_source(ir, fast_math=False)
    # delta is one value per thread ([1, BV]) and A sixteen ([BK, BV]): delta is scaled by log2 e
    assert "N_a = libdevice.exp2(L_A * (L_delta * 1.4426950408889634))" in gpu
    assert "from triton.language.extra.cuda import libdevice" in gpu
    assert "N_a = tl.exp(L_delta*L_A)" in cpu and "libdevice" not in cpu


@pytest.mark.parametrize("expr,expected", [
    ("exp(A*delta)", "libdevice.exp2(delta * (A * 1.4426950408889634))"),
    ("exp(-A*delta*x)", "libdevice.exp2((-delta*x) * (A * 1.4426950408889634))"),
    ("exp(-delta)", "libdevice.fast_expf(-delta)"),            # no factor to scale
    ("exp(A)", "libdevice.fast_expf(A)"),                      # not a product
    ("exp(A*g)", "libdevice.exp2(A * (g * 1.4426950408889634))"),  # the first set (g) wins over A
    ("exp(A*g*delta)", "libdevice.exp2((A*delta) * (g * 1.4426950408889634))"),
    ("exp(-g)", "libdevice.fast_expf(-g)"),                    # all of it in one set: nothing to save
])
def test_printer_fast_exp(expr, expected):
    assert triton_code(sympy.sympify(expr), fast_math=True, scaled=({"g"}, {"A"})) == expected


def test_printer_fast_exp_values():
    # the GPU forms, evaluated with numpy stand-ins for libdevice, equal exp of the objective's argument
    import numpy as np
    from types import SimpleNamespace
    env = {"libdevice": SimpleNamespace(exp2=np.exp2, fast_expf=np.exp), "A": -0.7, "delta": 1.3, "x": 0.4}
    for expr in ("exp(A*delta)", "exp(-A*delta*x)", "exp(-delta)", "A*exp(2*A*delta)"):
        code = triton_code(sympy.sympify(expr), fast_math=True, scaled=({"x"}, {"A"}))
        want = float(sympy.sympify(expr).subs({"A": -0.7, "delta": 1.3, "x": 0.4}))
        assert abs(eval(code, env) - want) < 1e-12 * abs(want), (expr, code)


@pytest.mark.parametrize("expr,expected", [
    ("1 - c*k**2", "1.0 - c*(k*k)"),
    ("exp(A*delta)", "tl.exp(A*delta)"),
    ("sqrt(x)/y**2", "tl.sqrt(x)/(y*y)"),
    ("x**(-1/2)", "(1.0 / tl.sqrt(x))"),
    ("log(Abs(x))", "tl.log(tl.abs(x))"),
])
def test_printer(expr, expected):
    assert triton_code(sympy.sympify(expr)) == expected


def test_printer_functions_evaluate_like_torch():
    import math
    x = sympy.Symbol("x", real=True)
    env = {"tl": _TlNumpy}
    for e, ref in [(sigmoid(x), lambda v: 1 / (1 + math.exp(-v))), (softplus(x), lambda v: math.log1p(math.exp(v))),
                   (silu(x), lambda v: v / (1 + math.exp(-v))), (x ** sympy.Rational(3, 2), lambda v: v ** 1.5),
                   (sympy.sign(x) * sympy.Abs(x) ** 0.5, lambda v: math.copysign(abs(v) ** 0.5, v))]:
        code = triton_code(e)
        for v in (0.3, 1.7, 3.0):
            assert abs(eval(code, env, {"x": v}) - ref(v)) < 1e-9, (e, code)


class _TlNumpy:
    """tl.* stand-ins for evaluating printed scalar code in plain Python."""
    import math as _m
    exp = staticmethod(_m.exp)
    log = staticmethod(_m.log)
    sqrt = staticmethod(_m.sqrt)
    abs = staticmethod(abs)
    minimum = staticmethod(min)
    maximum = staticmethod(max)

    @staticmethod
    def sigmoid(v):
        import math
        return 1 / (1 + math.exp(-v))

    @staticmethod
    def where(c, a, b):
        return a if c else b


def test_a_config_the_kernels_cannot_run_is_refused_before_any_launch():
    import re
    from ssmcraft.errors import SsmcraftError
    obj = ssmcraft.compile("longhorn_diag")
    inputs, params, S0 = _inputs(obj, 1, 5, 1, 8, 8)
    config = D.Config(BV=4, num_warps=1, NG=1, NSUB=1, HSUM=True)
    D.LAUNCHED.clear()
    with pytest.raises(SsmcraftError, match=re.escape("HSUM needs BK <= BV (BK = 8, BV = 4)")):
        D.diagonal_scan(obj, {k: v.float() for k, v in inputs.items()}, None, False, config)
    assert not D.LAUNCHED


def test_prefetch_needs_chunks_of_a_multiple_of_its_depth():
    from ssmcraft.errors import SsmcraftError
    with pytest.raises(SsmcraftError, match="PREFETCH needs chunks of a multiple of 4 steps"):
        D.check_config(D.Config(BV=8, num_warps=1, NG=1, NSUB=1, PREFETCH=True), 64, 2)   # LS 2 x NSUB 1


def test_the_autotuner_skips_a_failing_config_and_reraises_a_refused_one(monkeypatch):
    """A candidate that fails to compile or launch is recorded and skipped; one that check_config
    refuses (SsmcraftError) stops the tuning: the candidate list is wrong."""
    import triton.testing
    from ssmcraft.errors import SsmcraftError
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    monkeypatch.setattr(D, "_TUNED", {})
    monkeypatch.setattr(D, "_TIMINGS", {})

    def run(cfg):
        if cfg == "broken":
            raise RuntimeError("out of resources\nsecond line")
        if cfg == "refused":
            raise SsmcraftError("diagonal Config.HSUM needs BK <= BV")
    assert D._pick("k1", lambda: ["broken", "fine"], run) == "fine"
    assert D._TIMINGS["k1"] == [("broken", "failed: RuntimeError: out of resources"), ("fine", 1.0)]
    with pytest.raises(SsmcraftError, match="HSUM needs"):
        D._pick("k2", lambda: ["fine", "refused"], run)


@pytest.mark.parametrize("K, V, B, H, T", [(16, 1536, 8, 1, 2048), (16, 64, 2, 16, 301), (64, 64, 8, 16, 2048),
                                           (5, 100, 1, 3, 7), (128, 32, 1, 1, 65)])
def test_every_autotuner_candidate_is_a_config_the_kernels_run(K, V, B, H, T):
    """_pick re-raises a refused config (a bug in the lists), so every candidate must pass check_config."""
    fwd, bwd = D._fwd_candidates(K, V, B, H, T), D._bwd_candidates(K, V, B, H, T)
    assert fwd and bwd
    for cfg in fwd + bwd:
        D.check_config(cfg, K, D._ls_for(K))


@pytest.mark.parametrize("name", ["mamba", "longhorn_diag"])
def test_bf16_inputs_give_bf16_gradients_written_by_the_kernel(name, monkeypatch):
    # bf16 leaves: y and every gradient come back in bf16, within one bf16 rounding of the fp32 run
    # on the same values (the kernel stores the value-indexed gradients in bf16 itself, no fp32
    # copy; the interpreter's cast truncates where the GPU's rounds to nearest, hence not equal)
    obj = ssmcraft.compile(name)
    inputs, params, S0 = _inputs(obj, 1, 9, 1, 8, 4)
    cfg = D.Config(BV=8, num_warps=1, NG=2, NSUB=1, HSUM=True)
    kernel_dtypes = {}     # the gradients as the kernel's host wrapper returns them, before any cast
    real = D._backward

    def spy(*args, **kw):
        grads, dh0 = real(*args, **kw)
        kernel_dtypes.update({n: g.dtype for n, g in grads.items()})
        return grads, dh0

    monkeypatch.setattr(D, "_backward", spy)
    runs = {}
    for dt in (torch.bfloat16, torch.float32):
        leaves = {k: v.to(torch.bfloat16).to(dt).requires_grad_() for k, v in {**inputs, **params}.items()}
        y, _ = D.diagonal_scan(obj, leaves, None, False, cfg)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(dt)
        grads = torch.autograd.grad(y, list(leaves.values()), dy)
        runs[dt] = (y, dict(zip(leaves, grads)))
        if dt == torch.bfloat16:
            value_indexed = [n for n, dims in obj.ir.inputs.items() if obj.ir.dims[0] in dims]
            assert value_indexed and all(kernel_dtypes[n] == torch.bfloat16 for n in value_indexed), kernel_dtypes
    (yb, gb), (yf, gf) = runs[torch.bfloat16], runs[torch.float32]

    def one_rounding(a, b):
        return torch.all((a.float() - b).abs() <= 2.0 ** -7 * b.abs()).item()

    assert yb.dtype == torch.bfloat16 and one_rounding(yb, yf)
    for n in gb:
        assert gb[n].dtype == torch.bfloat16, n
        assert one_rounding(gb[n], gf[n]), n


def test_each_backward_steps_stores_come_after_the_next_steps_loads():
    # the lag of BENCHMARKS.md "Diagonal, run 4" (7-13% of the backward): the compiler keeps a load
    # after an earlier store, so a step's stores printed before the next step's loads would stall them
    src = D.generated_source(ssmcraft.compile("mamba").ir, 16, fast_math=True)
    bwd = src[src.index("def diagonal_bwd_main_kernel"):]
    for k in range(D._ls_for(16) - 1, 0, -1):
        store = bwd.index(f"tl.store(g_x + tok{k} ")
        assert bwd.index(f"dyt = tl.load(dy + tok{k - 1} ") < store < bwd.index(f"gl_x_{k - 1} = "), k
    assert bwd.index("tl.store(g_x + tok0 ") > bwd.index("gl_x_0 = ")


def test_mamba_kernels_match_the_naive_slot_loop():
    """The generated kernels of the Mamba objective against the family's readable twin
    (``ops/diagonal/naive.py``) on its slots: a = exp(delta A), p = delta x, q = k, oq = q."""
    from ssmcraft.ops.diagonal.naive import naive_recurrent_diagonal
    obj = ssmcraft.compile("mamba")
    B, T, H, V, K = 2, 9, 2, 6, 4
    g = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, k, q = r(B, T, H, V), r(B, T, H, K), r(B, T, H, K)
    delta, A = torch.nn.functional.softplus(r(B, T, H, V)), -torch.rand(H, V, K, generator=g)
    h0 = r(B, H, K, V)
    y, hT = D.diagonal_scan(obj, {"x": x, "k": k, "q": q, "delta": delta, "A": A}, h0, output_final_state=True)
    a = torch.exp(delta.double()[..., None, :] * A.double().transpose(-1, -2))          # [B, T, H, K, V]
    y_ref, h_ref = naive_recurrent_diagonal(a, (delta * x).double(), k.double(), q.double(), h0.double())
    assert _rel(y.double(), y_ref) < 1e-5 and _rel(hT.double(), h_ref) < 1e-5
