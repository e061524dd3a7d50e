"""``approximation: {minibatch: C}``: explicit and Newton steps whose data-loss gradients are taken
at the state before each chunk of C tokens.

Checked against a literal loop of the definition, built from the objective by the independent
float64 evaluator of test_compiler_derivation.py and autograd (no compiler machinery): each case
states its loss as ``retention + data`` (the terms that read ``S_prev`` and the rest) and the loop
does, for t in chunk j with ``S_c`` the state before the chunk,
  explicit: ``S_t = S_{t-1} - grad retention(S_{t-1}; S_prev = S_{t-1}) - grad data(S_c)``,
  newton:   ``S_t = S_{t-1} - (H_ret(S_{t-1}) + H_data(S_c))^-1 (g_ret(S_{t-1}) + g_data(S_c))``;
on odd lengths (T not a multiple of C), from a random initial state. The chunk-parallel PyTorch path
equals the reference loop, and its gradients (every input and the initial state) pass
``gradcheck``. Tolerances as in test_compiler_derivation.py (float64, rtol 1e-9, atol 1e-9 * scale).
"""
from __future__ import annotations

import pytest
import torch
from test_compiler_derivation import Evaluator, Val

import ssmcraft
from ssmcraft.compiler import expr as E
from ssmcraft.errors import DerivationError, SpecError, SsmcraftError

F64 = torch.float64
RTOL, ATOL = 1e-9, 1e-9
B, H, d, m = 2, 2, 3, 4
INPUTS = {"x": {"shape": ["d"]}, "k": {"shape": ["m"], "normalize": True}, "q": {"shape": ["m"]},
          "beta": {"shape": [], "bounded": True}, "alpha": {"shape": [], "bounded": True},
          "w": {"shape": ["d"], "positive": True, "bounded": True}}
# name: (update, retention (reads S_prev, may be ""), data)
CASES = {
    "deltanet": ("explicit", "", "beta*sq(S*k - x)/2"),
    "cauchy": ("explicit", "", "beta*log(1 + sq(S*k - x))/2"),
    "decayed": ("explicit", "(1 - alpha)*sq(S - alpha*S_prev)/2", "wsq(S*k - x, w)/2"),     # a . S_prev, a != 1
    "huber_newton": ("newton", "sq(S - S_prev)/2", "dot(w, sqrt(1 + had(S*k - x, S*k - x)) - ones(d))"),
    "longhorn_newton": ("newton", "sq(S - S_prev)/2", "wsq(S*k - x, w)/2"),
}


def spec_of(case, C):
    update, ret, data = CASES[case]
    return {"name": f"{case}_mb", "state": {"S": ["d", "m"]}, "inputs": INPUTS, "update": update,
            "objective": f"{ret} + {data}" if ret else data, "output": "S*q",
            **({"approximation": {"minibatch": C}} if C else {})}


def _loss(ev, text, S, S_prev):
    env = dict(ev.base)
    env.update(S=Val(S, "d", "m"), S_prev=Val(S_prev, "d", "m"))
    return ev._eval(E.parse(text), env, ()).t.reshape(())


def _grad_hess(ev, text, S, S_prev):
    """Gradient [d, m] and Hessian [d m, d m] of ``text`` in S at S (S_prev held)."""
    if not text:
        return torch.zeros(d, m, dtype=F64), torch.zeros(d * m, d * m, dtype=F64)
    X = S.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(_loss(ev, text, X, S_prev), X, create_graph=True)
    rows = []
    for i in range(d * m):
        (h,) = torch.autograd.grad(g.reshape(-1)[i], X, retain_graph=True, allow_unused=True)
        rows.append(torch.zeros(d * m, dtype=F64) if h is None else h.reshape(-1))
    return g.detach(), torch.stack(rows)


def literal(case, C, inputs, S0):
    """The definition, token by token: (y [B, T, H, d], S_T [B, H, d, m])."""
    update, ret, data = CASES[case]
    spec = ssmcraft.compile(spec_of(case, 0)).spec
    T = inputs["x"].shape[1]
    y = torch.zeros(B, T, H, d, dtype=F64)
    S_T = torch.zeros(B, H, d, m, dtype=F64)
    for b in range(B):
        for h in range(H):
            S = S0[b, h]
            for t in range(T):
                if t % C == 0:
                    S_c = S
                ev = Evaluator(spec, {"d": d, "m": m}, {n: inputs[n][b, t, h] for n in spec.inputs})
                g_r, H_r = _grad_hess(ev, ret, S, S)
                g_d, H_d = _grad_hess(ev, data, S_c, S)
                if update == "explicit":
                    S = S - g_r - g_d
                else:
                    S = S - torch.linalg.solve(H_r + H_d, (g_r + g_d).reshape(-1)).reshape(d, m)
                y[b, t, h] = ev._eval(E.parse(spec.output), {**ev.base, "S": Val(S, "d", "m")}, ()).t.reshape(-1)
            S_T[b, h] = S
    return y, S_T


def _inputs(obj, T, seed):
    from helpers import random_inputs
    inputs, _ = random_inputs(obj.spec, B=B, T=T, H=H, sizes={"d": d, "m": m}, seed=seed)
    return inputs, torch.randn(B, H, d, m, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)


@pytest.mark.parametrize("C", [1, 3, 4])
@pytest.mark.parametrize("case", CASES)
def test_minibatch_equals_the_literal_definition(case, C):
    T = 7                                                   # not a multiple of 3 or 4: a short last chunk
    obj = ssmcraft.compile(spec_of(case, C))
    inputs, S0 = _inputs(obj, T, seed=C)
    y_ref, S_ref = obj.reference(inputs, initial_state=S0)
    y, S = obj(inputs, initial_state=S0)
    assert obj.backend == "torch-vectorised"
    torch.testing.assert_close((y, S), (y_ref, S_ref), rtol=RTOL, atol=ATOL)
    y_lit, S_lit = literal(case, C, inputs, S0)
    scale = 1 + S_lit.abs().max().item()
    torch.testing.assert_close(y_ref, y_lit, rtol=RTOL, atol=ATOL * scale)
    torch.testing.assert_close(S_ref, S_lit, rtol=RTOL, atol=ATOL * scale)


@pytest.mark.parametrize("case", CASES)
def test_chunks_of_one_are_the_plain_update(case):
    plain, mb = ssmcraft.compile(spec_of(case, 0)), ssmcraft.compile(spec_of(case, 1))
    inputs, S0 = _inputs(plain, 5, seed=2)
    torch.testing.assert_close(mb(inputs, initial_state=S0), plain.reference(inputs, initial_state=S0),
                               rtol=RTOL, atol=ATOL)


def test_chunk_parallel_form_and_ir():
    kinds = {c: ssmcraft.compile(spec_of(c, 3)).ir for c in CASES}
    assert {c: ir.kind for c, ir in kinds.items()} == {"deltanet": "general", "cauchy": "nonlinear",
                                                      "decayed": "general", "huber_newton": "nonlinear",
                                                      "longhorn_newton": "general"}
    # every case is a . S_prev + G(S_c): a = 1, except the decayed retention's 1 - (1 - alpha)**2
    assert {c: str(ir.minibatch_decay) for c, ir in kinds.items()} == {
        "deltanet": "1", "cauchy": "1", "decayed": "alpha*(2 - alpha)", "huber_newton": "1", "longhorn_newton": "1"}
    js = kinds["deltanet"].to_json()
    assert js["minibatch"] == 3 and [r["body"] for r in js["state_reductions"]] == ["_S_c*k"]
    assert "minibatch" not in ssmcraft.compile(spec_of("deltanet", 0)).ir.to_json()


@pytest.mark.parametrize("case", ["decayed", "huber_newton"])
def test_gradients_reach_the_inputs_and_the_initial_state(case):
    obj = ssmcraft.compile(spec_of(case, 2))
    inputs, S0 = _inputs(obj, 5, seed=4)
    leaves = {k: v[:1, :, :1].clone().requires_grad_(True) for k, v in inputs.items()}
    S0 = S0[:1, :1].clone().requires_grad_(True)

    def f(S0, *xs):
        return obj(dict(zip(leaves, xs)), initial_state=S0)
    assert torch.autograd.gradcheck(f, (S0, *leaves.values()), eps=1e-6, atol=1e-7)


def test_general_runs_it_and_recurrent_steps_equal_parallel_mode():
    """The generated general kernels run a nonlinear mini-batch update (they carry the anchor); the
    mixer's one-token steps carry the chunk's starting state and its inputs so far (ChunkCache) and
    equal parallel mode, chunks aligned to the first token; T = 11 with C = 4."""
    from ssmcraft.ops.general import recurrent as general
    from ssmcraft.layers import ObjectiveMixer, ObjectiveMixerConfig
    from ssmcraft.layers.mixer import ChunkCache
    obj = ssmcraft.compile(spec_of("cauchy", 4))
    assert obj.ir.minibatch == 4 and general.supports(obj.ir) is None
    torch.manual_seed(0)
    mixer = ObjectiveMixer(ObjectiveMixerConfig(objective=spec_of("cauchy", 4), heads=2, state_size=4), 16, obj).double()
    h = torch.randn(2, 11, 16, dtype=F64)
    parallel = mixer(h)
    cache, outs, held = mixer.init_cache(2), [], []
    for t in range(11):
        y, cache = mixer.step(h[:, t], cache)
        outs.append(y)
        assert isinstance(cache.state, ChunkCache)
        held.append(next(iter(cache.state.inputs.values())).shape[1] if cache.state.inputs else 0)
    torch.testing.assert_close(torch.stack(outs, 1), parallel, rtol=1e-9, atol=1e-10)
    assert held == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]


def _bad(**kw):
    spec = spec_of("deltanet", 4)
    spec.update(kw)
    return spec


@pytest.mark.parametrize("spec,error,key,problem", [
    (_bad(update="implicit"), SpecError, "approximation.minibatch", "explicit or Newton steps"),
    (_bad(approximation={"minibatch": 0}), SpecError, "approximation.minibatch", "an integer 1..4096"),
    (_bad(approximation={"minibatch": 2.5}), SpecError, "approximation.minibatch", "an integer"),
    (_bad(approximation={"chunk": 2}), SpecError, "approximation.chunk", "unknown key"),
    (_bad(state={"D": ["d", "m"], "S": ["d", "m"]}, objective={"D": "sq(D - D_prev)/2", "S": "beta*sq(S*k - x)/2"},
          update={"D": "implicit", "S": "explicit"}), SpecError, "approximation.minibatch", "explicit or Newton steps"),
    (_bad(objective="sq(S - S_prev)/2 + beta*dot(S*k, S_prev*k - x)"), DerivationError, "approximation.minibatch",
     "has none"),
])
def test_minibatch_refusals(spec, error, key, problem):
    with pytest.raises(error) as info:
        ssmcraft.compile(spec)
    assert info.value.key == key and problem in info.value.problem, info.value


def test_derive_prints_the_minibatch(capsys):
    from ssmcraft.cli import main
    import yaml
    assert main(["derive", yaml.safe_dump(spec_of("cauchy", 8))]) == 0
    out = capsys.readouterr().out
    assert "approximation: {minibatch: 8}" in out and "gradient at _S_c, the state before the token's chunk" in out
    assert "[4] structure: nonlinear" in out and "_S_c" in out.split("[4]")[1]
