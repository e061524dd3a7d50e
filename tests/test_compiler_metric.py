"""States of several shapes: a square state [m, m] as the metric of another state's proximity,
carried by its inverse (Sherman-Morrison / Woodbury), so that recursive least squares is derived.

Checked against objectives evaluated without the compiler (the independent float64 evaluator of
test_compiler_derivation.py, extended here with real square matrices: ``wsq(V, X) = tr(V X V^T)``,
``sq`` of a square matrix its Frobenius norm squared):

- RLS equals the batch ridge least-squares solve ``argmin_S sum_tau w(t, tau) |S k_tau - x_tau|^2 +
  w(t, 0) |S|^2`` at every t (the issue's definition), on both the reference loop and the fast path;
- per step, each state's new value is the Newton minimiser of its own loss (autograd Hessian over
  its m*m or d*m elements), with the earlier states at their new values, and zeroes its gradient;
- five steps equal five literal stages; the fast path equals the reference; gradients reach every
  initial state (finite differences, ``gradcheck``).
Tolerances as in test_compiler_multistate.py (float64: rtol 1e-9, atol 1e-9 * scale; gradient
<= 1e-10 * its scale); the batch solve is within 1e-9 (condition numbers here <~ 1e2).
"""
from __future__ import annotations

import pytest
import torch
from test_compiler_derivation import ONE, Evaluator, Val, _scalar_t

import ssmcraft
from ssmcraft.compiler import expr as E
from ssmcraft.errors import DerivationError, SpecError, SsmcraftError

F64 = torch.float64
RTOL, ATOL, GRAD_TOL = 1e-9, 1e-9, 1e-10
B, H, d, m = 2, 2, 3, 4

INPUTS2 = {"x": {"shape": ["d"]}, "k": {"shape": ["m"]}, "q": {"shape": ["m"]}, "x2": {"shape": ["d"]},
           "k2": {"shape": ["m"]}, "lam": {"shape": [], "bounded": True}, "beta": {"shape": [], "bounded": True}}
# rank 2 everywhere: R changes by two outer products (Woodbury for its inverse) and S's data term
# has two keys (a 2 x 2 Woodbury on top of the metric)
TWO_KEY = {"name": "rls_2key", "state": {"R": {"shape": ["m", "m"], "init": {"identity": 0.5}}, "S": ["d", "m"]},
           "inputs": INPUTS2,
           "objective": {"R": "sq(R - lam*R_prev - outer(k, k) - beta*outer(k2, k2))/2",
                         "S": "lam*wsq(S - S_prev, R_prev)/2 + sq(S*k - x)/2 + beta*sq(S*k2 - x2)/2"},
           "update": "implicit", "output": "S*q"}
CASES = {"rls": "rls", "precond_delta": "precond_delta", "rls_2key": TWO_KEY}


class SquareEvaluator(Evaluator):
    """The independent evaluator with square states: ``wsq(V, X)`` with an [m, m] weight is
    ``tr(V X V^T)``."""

    def _call(self, node, env, stack) -> Val:
        if node.func == "wsq":
            v, w = (self._eval(a, env, stack) for a in node.args)
            if w.r == w.c != ONE:
                return _scalar_t(((v.t @ w.t) * v.t).sum())
        return super()._call(node, env, stack)


def _ev(spec, inputs, params, b, t, h):
    vals = {n: inputs[n][b, t, h] for n in spec.inputs}
    vals.update({n: p[h] for n, p in params.items()})
    return SquareEvaluator(spec, {"d": d, "m": m}, vals)


def _env(spec, ev, values):
    env = dict(ev.base)
    for n, v in values.items():
        r, c = spec.shape_of(n[:-5] if n.endswith("_prev") else n)
        env[n] = Val(v, r, c)
    return env


def _loss(spec, ev, text, values, name, X):
    v = ev._eval(E.parse(text), _env(spec, ev, {**values, name: X}), ())
    assert v.scalar
    return v.t.reshape(())


def _newton(spec, ev, text, values, name):
    """The minimiser of a quadratic stage loss: one Newton step from 0 with autograd's Hessian."""
    shape = tuple(spec.shape_of(name))
    n = {"d": d, "m": m}
    X0 = torch.zeros(n[shape[0]], n[shape[1]], dtype=F64, requires_grad=True)
    (g,) = torch.autograd.grad(_loss(spec, ev, text, values, name, X0), X0, create_graph=True)
    g = g.reshape(-1)
    rows = [torch.autograd.grad(g[i], X0, retain_graph=True)[0].reshape(-1) for i in range(g.numel())]
    Hm = torch.stack(rows)
    assert torch.linalg.eigvalsh((Hm + Hm.T) / 2).min() > 1e-8, f"{name}: stage loss not strictly convex"
    return (-torch.linalg.solve(Hm, g.detach())).reshape(X0.shape)


def _grad(spec, ev, text, values, name, X):
    X = X.detach().clone().requires_grad_(True)
    return torch.autograd.grad(_loss(spec, ev, text, values, name, X), X)[0]


def _output(spec, ev, new):
    return ev._eval(E.parse(spec.output), _env(spec, ev, new), ()).t.reshape(-1)


def _spd(g, n):
    A = torch.randn(n, n, generator=g, dtype=F64)
    return A @ A.T / n + 0.5 * torch.eye(n, dtype=F64)


def _setup(case, T, seed):
    from helpers import random_inputs
    obj = ssmcraft.compile(CASES[case])
    inputs, params = random_inputs(obj.spec, B=B, T=T, H=H, sizes={"d": d, "m": m}, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    S0 = tuple(torch.stack([torch.stack([_spd(g, m) for _ in range(H)]) for _ in range(B)])
               if obj.spec.shape_of(x) == ("m", "m") else torch.randn(B, H, d, m, generator=g, dtype=F64)
               for x in obj.spec.states)
    return obj, inputs, params, S0


def _weights(lam, t):
    """w(t, tau) = prod_{s = tau+1..t} lam_s for tau = 0..t, and w(t, 0)'s ridge prod_{s <= t} lam_s
    (tokens numbered from 0: the ridge sits before the first token)."""
    w = torch.stack([lam[tau + 1:t + 1].prod() for tau in range(t + 1)])
    return w, lam[:t + 1].prod()


def test_rls_equals_batch_least_squares_at_every_t():
    from helpers import random_inputs
    obj = ssmcraft.compile("rls")
    T = 9
    inputs, _ = random_inputs(obj.spec, B=B, T=T, H=H, sizes={"d": d, "m": m}, seed=3)
    g = torch.Generator().manual_seed(4)
    inputs["lam"] = 0.3 + 0.7 * torch.rand(B, T, H, generator=g, dtype=F64)
    inputs["lam"][:, :, 0] = 1.0                       # no forgetting on head 0: the (0, 1] edge
    for y, (R, S) in (obj.reference(inputs), obj(inputs)):
        for b in range(B):
            for h in range(H):
                K, X, lam = inputs["k"][b, :, h], inputs["x"][b, :, h], inputs["lam"][b, :, h]
                for t in range(T):
                    w, ridge = _weights(lam, t)
                    A = (K[:t + 1].T * w) @ K[:t + 1] + ridge * torch.eye(m, dtype=F64)
                    S_t = torch.linalg.solve(A, (X[:t + 1].T * w @ K[:t + 1]).T).T      # S A = sum w x k^T
                    torch.testing.assert_close(y[b, t, h], S_t @ inputs["q"][b, t, h], rtol=RTOL, atol=ATOL)
                torch.testing.assert_close(S[b, h], S_t, rtol=RTOL, atol=ATOL)
                torch.testing.assert_close(R[b, h], A, rtol=RTOL, atol=ATOL)     # the state returned as declared
    assert obj.backend == "torch-vectorised"


@pytest.mark.parametrize("case", CASES)
def test_each_state_minimises_its_own_loss(case):
    obj, inputs, params, S0 = _setup(case, T=1, seed=5)
    spec = obj.spec
    y, S_T = obj.reference(inputs, params, initial_state=S0)
    for b in range(B):
        for h in range(H):
            ev = _ev(spec, inputs, params, b, 0, h)
            values = {f"{x}_prev": S0[i][b, h] for i, x in enumerate(spec.states)}
            new = {x: S_T[i][b, h] for i, x in enumerate(spec.states)}
            for name, text in zip(spec.states, spec.objectives):
                prev = values[f"{name}_prev"]
                g_scale = _grad(spec, ev, text, values, name, prev).norm() + _grad(spec, ev, text, values, name, 0 * prev).norm()
                assert _grad(spec, ev, text, values, name, new[name]).norm() <= GRAD_TOL * g_scale
                want = _newton(spec, ev, text, values, name)
                torch.testing.assert_close(new[name], want, rtol=RTOL, atol=ATOL * (1 + prev.abs().max().item()))
                values[name] = new[name]
            torch.testing.assert_close(y[b, 0, h], _output(spec, ev, new), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", CASES)
def test_five_steps_equal_the_literal_stages(case):
    T = 5
    obj, inputs, params, S0 = _setup(case, T=T, seed=9)
    spec = obj.spec
    y, S_T = obj.reference(inputs, params, initial_state=S0)
    y_v, S_v = obj(inputs, params, initial_state=S0)
    assert obj.backend == "torch-vectorised"
    torch.testing.assert_close((y_v, S_v), (y, S_T), rtol=RTOL, atol=ATOL)
    for b in range(B):
        for h in range(H):
            state = {x: S0[i][b, h] for i, x in enumerate(spec.states)}
            for t in range(T):
                ev = _ev(spec, inputs, params, b, t, h)
                values = {f"{x}_prev": v for x, v in state.items()}
                for name, text in zip(spec.states, spec.objectives):
                    values[name] = _newton(spec, ev, text, values, name)
                state = {x: values[x] for x in spec.states}
                scale = 1 + max(v.abs().max().item() for v in state.values())
                torch.testing.assert_close(y[b, t, h], _output(spec, ev, state), rtol=RTOL, atol=ATOL * scale)
            for i, x in enumerate(spec.states):
                torch.testing.assert_close(S_T[i][b, h], state[x], rtol=RTOL, atol=ATOL * scale)


def test_default_initial_state_is_the_declared_one():
    obj, inputs, params, S0 = _setup("rls_2key", T=4, seed=2)
    start = obj.initial_states(B, H, d, m, dtype=F64)
    torch.testing.assert_close(start[0], 0.5 * torch.eye(m, dtype=F64).expand(B, H, m, m))
    assert not start[1].any()
    torch.testing.assert_close(obj.reference(inputs), obj.reference(inputs, initial_state=start), rtol=0, atol=0)
    assert obj.state_shapes(B, H, d, m) == {"R": (B, H, m, m), "S": (B, H, d, m)}
    assert obj.state_elements(H, d, m) == H * (m * m + d * m)


def test_gradients_reach_every_initial_state_and_input():
    obj, inputs, params, S0 = _setup("rls", T=3, seed=6)
    small = {k: v[:1, :, :1].clone().requires_grad_(True) for k, v in inputs.items()}
    R0, S0_ = (s[:1, :1].clone().requires_grad_(True) for s in S0)

    def f(R0, S0_, *xs):
        y, (R, S) = obj(dict(zip(small, xs)), initial_state=(R0, S0_))
        return y, R, S
    assert torch.autograd.gradcheck(f, (R0, S0_, *small.values()), eps=1e-6, atol=1e-7)


def test_initial_state_shapes_are_checked():
    obj, inputs, params, S0 = _setup("rls", T=2, seed=1)
    with pytest.raises(SsmcraftError, match=r"initial_state\[0\] \(R\) must be \[B, H, m, m\]"):
        obj.reference(inputs, initial_state=(S0[0][..., :1].squeeze(-1), S0[1]))
    with pytest.raises(SsmcraftError, match=r"initial_state\[0\] \(R\) has m = 3, but another tensor has m = 4"):
        obj.reference(inputs, initial_state=(S0[0][..., :3, :3], S0[1]))


def test_ir_and_derive_name_the_inverse():
    ir = ssmcraft.compile("rls").ir
    js = ir.to_json()
    assert js["state_shapes"] == {"R": ["m", "m"], "S": ["d", "m"]} and js["inits"] == {"R": {"identity": 1.0}}
    assert js["inverses"] == [{"state": "R", "alpha": "lam", "terms": [["1", "k", "k"]]}]
    assert [r["metric"] for r in js["state_reductions"] if "metric" in r] == ["_inv_R_prev"]
    assert ir.kind == "nonlinear"
    assert "state_shapes" not in ssmcraft.compile("momentum_longhorn").ir.to_json()     # one shape: IR unchanged


def test_triton_general_family_refuses_square_states():
    from ssmcraft.ops.general import recurrent as general
    reason = general.supports(ssmcraft.compile("rls").ir)
    assert reason is not None and "square states (R: [m, m]" in reason


BASE = {"name": "bad", "state": {"R": {"shape": ["m", "m"], "init": {"identity": 1.0}}, "S": ["d", "m"]},
        "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"]}, "q": {"shape": ["m"]},
                   "lam": {"shape": [], "bounded": True}, "z": {"shape": []}},
        "objective": {"R": "sq(R - lam*R_prev - outer(k, k))/2", "S": "lam*wsq(S - S_prev, R_prev)/2 + sq(S*k - x)/2"},
        "update": "implicit", "output": "S*q"}


def _with(**kw):
    import copy
    spec = copy.deepcopy(BASE)
    for key, value in kw.items():
        if "__" in key:
            a, b = key.split("__")
            spec[a][b] = value
        else:
            spec[key] = value
    return spec


BAD = [
    ("identity_on_dm", _with(state={"R": {"shape": ["m", "m"], "init": {"identity": 1.0}},
                                    "S": {"shape": ["d", "m"], "init": {"identity": 1.0}}}),
     SpecError, "state.S.init", "identity needs a square state"),
    ("init_unknown", _with(state={"R": {"shape": ["m", "m"], "init": "ones"}, "S": ["d", "m"]}),
     SpecError, "state.R.init", r"expected zeros or \{identity: c\}"),
    ("square_over_rows", _with(state={"R": ["d", "d"], "S": ["d", "m"]}),
     SpecError, "state.R", r"over the key dimension, \[m, m\]"),
    ("all_square", _with(state={"R": ["m", "m"], "P": ["m", "m"]}), SpecError, "state", "every state is square"),
    ("output_reads_square", _with(output="S*q + R*k"), SpecError, "output", "reads the square state R"),
    ("explicit_square", _with(update={"R": "explicit", "S": "implicit"}), SpecError, "update.R",
     "updated implicitly"),
    ("square_in_product", _with(objective__S="sq(S*R_prev*k - x)/2"), SpecError, "objective.S",
     r"only read as the metric of wsq\(V, R_prev\)"),
    ("zero_init_metric", _with(state={"R": ["m", "m"], "S": ["d", "m"]}), DerivationError, "objective.R",
     "must start positive definite"),
    ("diag_change", _with(objective__R="sq(R - lam*R_prev - diag(k))/2"), DerivationError, "objective.R",
     "diagonal term"),
    ("not_symmetric", _with(objective__R="sq(R - lam*R_prev - outer(k, q))/2"), DerivationError, "objective.R",
     "not symmetric"),
    ("sign_unknown", _with(objective__R="sq(R - lam*R_prev - z*outer(k, k))/2"), DerivationError, "objective.R",
     "not known to be non-negative"),
    ("decay_sign_unknown", _with(objective__R="sq(R - z*R_prev - outer(k, k))/2"), DerivationError, "objective.R",
     "decay z is not known to be positive"),
    ("reads_element_state", _with(objective__R="sq(R - lam*R_prev - outer(T(S_prev)*x, k))/2"), DerivationError,
     "objective.R", "reads S_prev"),
    ("metric_explicit", _with(update={"R": "implicit", "S": "explicit"}), DerivationError, "objective.S",
     "needs update: implicit"),
    ("metric_plus_plain_proximity", _with(objective__S="lam*wsq(S - S_prev, R_prev)/2 + sq(S - S_prev)/2"),
     DerivationError, "objective.S", "curves every element of S"),
    ("two_metrics", _with(objective__S="lam*wsq(S - S_prev, R_prev)/2 + wsq(S, R)/2"), DerivationError,
     "objective.S", "two metrics"),
    ("nonlinear_metric_use", _with(objective__S="exp(wsq(S - S_prev, R_prev)) + sq(S*k - x)/2"), DerivationError,
     "objective.S", "enter the loss linearly"),
]


@pytest.mark.parametrize("case,spec,error,key,problem", BAD, ids=[c[0] for c in BAD])
def test_square_state_refusals(case, spec, error, key, problem):
    with pytest.raises(error) as info:
        ssmcraft.compile(spec)
    assert info.value.key == key
    assert __import__("re").search(problem, info.value.problem), info.value.problem


def test_cli_refuses_with_one_line(tmp_path):
    import subprocess
    import sys
    import yaml
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_with(objective__R="sq(R - lam*R_prev - diag(k))/2")))
    r = subprocess.run([sys.executable, "-m", "ssmcraft.cli", "derive", str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "objective.R" in r.stderr and "diagonal term" in r.stderr


@pytest.mark.parametrize("objective,per_head", [("longhorn", 8 * 4), ("momentum_longhorn", 2 * 8 * 4),
                                                ("rls", 8 * 4 + 4 * 4), ("ttt_mlp", 8 * 4 + 8 * 8)])
def test_state_bytes_count_every_state(tmp_path, objective, per_head):
    """A run's state_bytes (search trials, studies) count every state of every mixer: fp32, two layers of
    H = 2 heads of d = 16 / 2 = 8 (expand 1), m = 4 (ttt_mlp: h = 2m = 8)."""
    import json
    from ssmcraft.search.trial import state_bytes
    model = {"vocab_size": 32, "d_model": 16, "n_layers": 2,
             "mixer": {"kind": "objective", "objective": objective, "heads": 2, "state_size": 4, "expand": 1}}
    (tmp_path / "config.json").write_text(json.dumps({"task": {"name": "mqar"}, "model": model}))
    assert state_bytes(tmp_path) == 4 * 2 * 2 * per_head


@pytest.mark.parametrize("case", ["rls", "rls_2key"])
def test_the_carried_inverse_stays_exactly_symmetric(case):
    """The generated step updates the inverse as ``P - W^T M W`` symmetrised (Sherman-Morrison for one
    term, Woodbury for two): after many float32 steps P equals its transpose bit for bit (an asymmetric
    rounding error would grow as 1 / lam per token)."""
    obj = ssmcraft.compile(CASES[case])
    g = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=g)    # noqa: E731
    P = torch.linalg.inv(torch.eye(m) + 0.1 * (lambda A: A @ A.transpose(-1, -2))(r(B, H, m, m)))
    prev = (0.5 * (P + P.transpose(-1, -2)), r(B, H, d, m))
    for _ in range(40):
        env = {"x": r(B, H, d, 1), "x2": r(B, H, d, 1), "k": r(B, H, 1, m) / 2, "k2": r(B, H, 1, m) / 2,
               "q": r(B, H, 1, m), "lam": 0.5 + 0.4 * torch.rand(B, H, 1, 1, generator=g),
               "beta": torch.rand(B, H, 1, 1, generator=g)}
        prev = obj.module.step(prev, {n: env[n] for n in obj.spec.inputs}, {}, d, m)
    assert torch.isfinite(prev[0]).all() and torch.equal(prev[0], prev[0].transpose(-1, -2))


@pytest.mark.parametrize("name", ["rls", "precond_delta"])
def test_pytorch_path_is_float32_accurate_at_64(name):
    """The GPU check's case (``benchmarks/check_library_gpu.py --shape 2,67,2,64,64``: forgetting
    factors down to ~0.3, unit keys, R's condition number ~3e6) on the PyTorch path with float32
    inputs: the inverse carried in float64, the step's inputs cast once, keep the output, both final
    states and every gradient (lam's included) within 1e-4 of the float64 reference. In float32 the
    inverse drifted by 2e-2 and lam's gradient by 2e-2 (RLS) to 4e-2 (the preconditioned delta rule)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from check_library_gpu import initial_states
    from helpers import assert_within

    from ssmcraft.bench.run import random_inputs
    from ssmcraft.runtime.checking import reference_errors
    obj = ssmcraft.compile(name)
    ins, params = random_inputs(obj, 2, 67, 2, 64, 64, F64, "cpu", seed=1, unit_keys=True)
    g = torch.Generator().manual_seed(2)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, initial_states(obj, 2, 2, 64, 64, g),
                           g)
    assert obj.backend == "torch-vectorised"
    assert_within(cmp.errors, 1e-4)
