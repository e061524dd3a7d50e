"""The compose space writes second-order and deep learners: a metric proximity (the key
covariance as a square state), mini-batch updates and an MLP memory; each checked against the
library objective it coincides with, or against a literal loop of its definition (float64, rtol
1e-9 as in test_compiler_metric.py), and a search spec over them resolves trials that derive."""
from __future__ import annotations

import pytest
import torch

import ssmcraft
from ssmcraft.errors import SpecError
from ssmcraft.search.compose import compose_objective, composed_name

F64 = torch.float64
RTOL, ATOL = 1e-9, 1e-9
B, T, H, d, m = 2, 6, 2, 3, 4


def _draw(spec, seed):
    from helpers import random_inputs
    return random_inputs(spec, B=B, T=T, H=H, sizes={"d": d, "m": m}, seed=seed)[0]


def test_metric_regression_implicit_is_rls():
    obj = ssmcraft.compile(compose_objective({"proximity": "metric", "data": "regression", "step": "scalar"}))
    assert obj.name == "c_metr_regr_sstep_impl_exact" and obj.spec.square_states() == ("R",)
    inputs = _draw(obj.spec, 1)
    inputs["beta"] = torch.ones_like(inputs["beta"])             # rls is the composition with beta = 1
    rls = ssmcraft.compile("rls")
    torch.testing.assert_close(obj.reference(inputs), rls.reference({n: inputs[n] for n in rls.spec.inputs}),
                               rtol=RTOL, atol=ATOL)


def test_metric_decay_explicit_is_the_preconditioned_delta_rule():
    """S_t = S_prev - beta (S_prev k - x) (R_t^-1 k)^T with R_t = lam R_prev + k k^T, R_0 = I."""
    obj = ssmcraft.compile(compose_objective({"proximity": "metric", "step": "scalar", "update": "decay_explicit"}))
    inputs = _draw(obj.spec, 2)
    y, (R, S) = obj.reference(inputs)
    Rl, Sl = torch.eye(m, dtype=F64).expand(B, H, m, m), torch.zeros(B, H, d, m, dtype=F64)
    for t in range(T):
        k, x, q, beta, lam = (inputs[n][:, t] for n in ("k", "x", "q", "beta", "lam"))
        Rl = lam[..., None, None] * Rl + k[..., :, None] * k[..., None, :]
        Pk = torch.linalg.solve(Rl, k[..., None])[..., 0]
        r = (Sl @ k[..., None])[..., 0] - x
        Sl = Sl - beta[..., None, None] * r[..., :, None] * Pk[..., None, :]
        torch.testing.assert_close(y[:, t], (Sl @ q[..., None])[..., 0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close((R, S), (Rl, Sl), rtol=RTOL, atol=ATOL)


def test_minibatch_explicit_regression_is_the_chunked_delta_rule():
    obj = ssmcraft.compile(compose_objective({"step": "scalar", "update": "explicit", "minibatch": 4}))
    assert obj.name == "c_plain_regr_sstep_expl_mb4" and obj.ir.minibatch == 4
    inputs = _draw(obj.spec, 3)
    y, S = obj(inputs)
    Sl = torch.zeros(B, H, d, m, dtype=F64)
    for t in range(T):                          # T = 6: one whole chunk and a short one
        S_c = Sl if t % 4 == 0 else S_c
        k, x, q, beta = (inputs[n][:, t] for n in ("k", "x", "q", "beta"))
        r = (S_c @ k[..., None])[..., 0] - x
        Sl = Sl - beta[..., None, None] * r[..., :, None] * k[..., None, :]
        torch.testing.assert_close(y[:, t], (Sl @ q[..., None])[..., 0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(S, Sl, rtol=RTOL, atol=ATOL)


def test_mlp_memory_is_ttt_mlp():
    spec = compose_objective({"memory": "mlp", "step": "scalar", "update": "explicit", "normalize": True})
    assert spec["name"] == "m_plain_regr_sstep_expl_exact_n"
    obj, ttt = ssmcraft.compile(spec), ssmcraft.compile("ttt_mlp")
    inputs = _draw(obj.spec, 4)
    mine = {n: inputs[n] for n in ("x", "k", "q")} | {"eta": inputs["beta"]}      # beta is ttt_mlp's eta
    torch.testing.assert_close(obj.reference(inputs), ttt.reference(mine), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("choices,key,problem", [
    ({"memory": "mlp", "proximity": "diagonal_decay"}, "compose.proximity", "an MLP memory takes proximity"),
    ({"memory": "mlp", "update": "decay_explicit"}, "compose.update", "an MLP memory takes update explicit"),
    ({"minibatch": 8, "approximation": "diagonal"}, "compose.minibatch", "a mini-batch replaces the exact update"),
])
def test_compositions_it_cannot_write_are_refused(choices, key, problem):
    with pytest.raises(SpecError) as info:
        compose_objective(choices)
    assert info.value.key == key and problem in info.value.problem


def test_a_search_space_over_them_resolves_trials_that_derive(tmp_path):
    """A compose entry searching the new terms: every variant is written, and those the compiler
    derives run; the others are refused with the compiler's reason (a search records them as failed)."""
    import itertools
    from ssmcraft.search.spec import load_search_spec
    text = """
name: second_order
task: {name: mqar, seq_len: 16, num_kv_pairs: 2, vocab: 32}
model: {d_model: 16, n_layers: 1}
budget: {trials: 2, tokens_per_trial: 1000, seconds_per_trial: 10}
space:
  objective: {choice: [{compose: {proximity: [plain, metric], step: scalar, update: [implicit, explicit],
                                  minibatch: [0, 4], memory: [matrix, mlp]}}]}
rank: {val_loss: minimize}
"""
    path = tmp_path / "second_order.yaml"
    path.write_text(text)
    spec = load_search_spec(path)
    option = spec.objectives[0]
    names, derived, refused = set(), [], {}
    for values in itertools.product(*(v for _, v in option.terms)):
        choices = dict(zip((t for t, _ in option.terms), values))
        try:
            objective = compose_objective(choices)
        except SpecError as e:          # a composition compose cannot write (here: an MLP with the metric)
            refused[composed_name(choices)] = e.problem
            continue
        names.add(objective["name"])
        try:
            derived.append(ssmcraft.compile(objective).name)
        except SpecError as e:          # the spec stage or the derivation (DerivationError)
            refused[objective["name"]] = e.problem
    assert {"c_metr_regr_sstep_impl_exact", "c_plain_regr_sstep_expl_mb4", "m_plain_regr_sstep_expl_exact",
            "m_plain_regr_sstep_expl_mb4", "c_plain_regr_sstep_expl_exact"} <= set(derived)
    assert "needs update: implicit" in refused["c_metr_regr_sstep_expl_exact"]          # the metric is implicit
    assert "explicit or Newton steps" in refused["c_plain_regr_sstep_impl_mb4"]
    assert "an MLP memory takes proximity" in refused["m_metr_regr_sstep_impl_exact"]
