"""Family ``precision_general`` (the metric compositions ``precision_rank1`` does not run) under the
Triton interpreter: held-out composed objectives (two keys, linear / Huber / Cauchy data terms,
implicit updates, per-channel steps) through the family against their float64 references (output,
both final states as the API returns them, every gradient including both initial states', R's
symmetric positive definite), on odd lengths, with every output buffer poisoned with NaN; and every
metric composition of the composer dispatched to a Triton family."""
import itertools

import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.errors import SsmcraftError  # noqa: E402
from ssmcraft.ops.general import recurrent as G  # noqa: E402
from ssmcraft.ops.precision_general import step as PG  # noqa: E402
from ssmcraft.ops.precision_rank1 import chunk as P  # noqa: E402
from ssmcraft.ops.rank1_chunk import chunk as R1  # noqa: E402
from ssmcraft.ops.registry import order  # noqa: E402
from ssmcraft.runtime.select import validated_call  # noqa: E402
from ssmcraft.search.compose import TERMS, compose_objective  # noqa: E402
from helpers import assert_within, kernel_errors, kernel_inputs  # noqa: E402
from test_kernels_precision_rank1 import _spd  # noqa: E402

TOL = {"y": 1e-5, "R_T": 1e-5, "S_T": 1e-5, "grad": 2e-5}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(P, "POISON", True)
    monkeypatch.setattr(G, "POISON", True)
    monkeypatch.setattr(R1, "POISON", True)          # rankr_chunk runs rank1_chunk's kernels


def _metric(data, keys, step, update):
    return compose_objective({"proximity": "metric", "data": data, "keys": keys, "step": step, "update": update,
                              "normalize": True})


# one of each form, data term, key count and step shape (not the library's objectives)
CASES = [("regression", 2, "scalar", "decay_explicit"), ("linear", 1, "per_channel", "decay_explicit"),
         ("huber", 1, "scalar", "decay_explicit"), ("cauchy", 2, "per_channel", "decay_explicit"),
         ("regression", 1, "per_channel", "implicit"), ("regression", 2, "scalar", "implicit"),
         ("regression", 2, "per_channel", "implicit"),
         ("linear", 2, "per_channel", "implicit"), ("linear", 1, "scalar", "implicit"),
         # a per-head step, linear in S: the memory on rank1_chunk (one key), rankr_chunk (two)
         ("regression", 1, "scalar", "implicit"), ("linear", 1, "scalar", "decay_explicit"),
         ("linear", 2, "scalar", "decay_explicit"), ("huber", 2, "scalar", "decay_explicit")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("T", [1, 37])
def test_composed_objectives_match_the_reference(case, T):
    obj = ssmcraft.compile(_metric(*case))
    assert P.supports(obj.ir) is not None and PG.supports(obj.ir) is None
    ins, params, S0, g = kernel_inputs(obj, 2, T, 2, 12, 8, seed=T + CASES.index(case))
    if case[0] == "linear" and case[3] == "implicit":
        # its gain (lam R_{t-1})^-1 k is the precision's R_t^-1 k over 1 - k^T R_t^-1 k, which scales the
        # gains' float32 rounding by up to 1e3 at forgetting factors in (0.2, 0.8) on 8-dim keys (the
        # step.py docstring): forgetting in (0.9, 1), where R stays filled
        ins["lam"] = 0.9 + (ins["lam"] - 0.2) / 6
    S0s = tuple(_spd(2, 2, 8, g) if x == "R" else S0 for x in obj.ir.states)

    def run(o, lay):
        return validated_call(PG.prepare, o, {n: v for n, v in lay_inputs(o, lay).items()}, None,
                              tuple(s.float() for s in lay.S0), True)
    errs = kernel_errors(obj, run, ins, params, S0s, g)
    assert_within(errs, TOL)


def lay_inputs(obj, lay):
    """The layout's inputs in the API layout ([B, T, H, n] or [B, T, H])."""
    B, T, H = lay.B, lay.T, lay.H
    return {n: lay.env[n].reshape(B, T, H) if not dims else lay.env[n].reshape(B, T, H, -1)
            for n, dims in obj.ir.inputs.items()}


def _compositions():
    for data, keys, step, update in itertools.product(TERMS["data"], (1, 2), TERMS["step"], TERMS["update"]):
        try:
            yield ssmcraft.compile(_metric(data, keys, step, update))
        except SsmcraftError:           # the compiler refuses it (e.g. an implicit robust loss)
            continue


def test_every_metric_composition_picks_a_triton_family():
    names = []
    for obj in _compositions():
        fam = next((f.name for f in order(obj.ir, "triton") if f.name != "decode" and f.reason(obj.ir) is None), None)
        assert fam in ("precision_rank1", "precision_general"), (obj.name, fam)
        names.append(obj.name)
    assert len(names) == 24


def test_dispatch_runs_the_family_and_says_so():
    obj = ssmcraft.compile(_metric("huber", 2, "per_channel", "decay_explicit"))
    obj.prefer = "interpret"
    ins, _, S0, g = kernel_inputs(obj, 1, 21, 2, 8, 8, seed=1)
    S0s = tuple(_spd(1, 2, 8, g) if x == "R" else S0 for x in obj.ir.states)
    y, fin = obj({k: v.float() for k, v in ins.items()}, None, tuple(s.float() for s in S0s), True)
    assert obj.backend == "triton-interpret:precision-fp64+general"
    yr, finr = obj.reference(ins, None, S0s, True)
    assert (y.double() - yr).norm() / yr.norm() < 1e-5
    for a, b in zip(fin, finr):
        assert (a.double() - b).norm() / b.norm() < 1e-5


@pytest.mark.parametrize("keys, step", [(1, "rank1-chunk"), (2, "rankr-chunk")])
def test_the_per_head_steps_linear_in_s_run_chunked(keys, step):
    obj = ssmcraft.compile(_metric("regression", keys, "scalar", "implicit"))
    obj.prefer = "interpret"
    ins, _, S0, g = kernel_inputs(obj, 1, 21, 2, 8, 8, seed=2)
    y, _ = obj({k: v.float() for k, v in ins.items()}, None, None, False)
    assert obj.backend == f"triton-interpret:precision-fp64+{step}"
    yr, _ = obj.reference(ins, None, None, False)
    assert (y.double() - yr).norm() / yr.norm() < 1e-5


def test_other_structures_are_refused():
    assert "no square state" in PG.supports(ssmcraft.compile("deltanet").ir)


# odd lengths; empty first and in the middle; 5 and 1 under a chunk of 16; 17 and 33 end with a partial one
LENS = [0, 17, 5, 0, 1, 33]


@pytest.mark.parametrize("case, step", [(("huber", 2, "per_channel", "decay_explicit"), "general"),
                                        (("regression", 2, "scalar", "implicit"), "rankr-chunk"),
                                        (("regression", 1, "scalar", "implicit"), "rank1-chunk")],
                         ids=["huber2-channel", "implicit2", "implicit1-chunked"])
def test_packed_equals_separate(case, step, monkeypatch):
    """A packed row (``cu_seqlens``) against N separate float64 reference calls: both final states and
    the gradients of both initial states per sequence, R0 symmetric positive definite; the precision
    (two keys: two tokens per step) and the step run the row natively (``+packed``)."""
    from ssmcraft.runtime.checking import compare, packed_reference
    from test_varlen import _interpret, packed_inputs
    monkeypatch.setattr(P, "CHUNK", 16)
    obj = ssmcraft.compile(_metric(*case))
    ins, params, S0, cu, g = packed_inputs(obj, LENS, d=12, m=8)
    S0 = tuple(_spd(len(LENS), 2, 8, g) if x == "R" else s for x, s in zip(obj.ir.states, S0))
    ref = packed_reference(obj, ins, params, S0, cu, g)
    errs = compare(ref, lambda i, p, s: _interpret(obj, i, p, s, cu), torch.float32).errors
    assert_within(errs, TOL)
    assert obj.backend == f"triton-interpret:precision-fp64+{step}+packed"


def test_packed_without_initial_or_final_state():
    """As a training forward calls it: each sequence from the objective's own start (R = I, S = 0), no
    final state asked."""
    from test_varlen import packed_without_states
    obj = ssmcraft.compile(_metric("cauchy", 1, "scalar", "decay_explicit"))
    errs, S = packed_without_states(obj, [0, 19, 4, 1], d=12, m=8)
    assert S is None and obj.backend == "triton-interpret:precision-fp64+general+packed"
    assert_within(errs, {"y": 1e-5, "grad": 2e-5})


def test_a_step_of_no_known_form_is_refused_by_name():
    """A metric proximity whose data step reads the precision through the query, not the key: R's
    structure fits, no form of the step does, and the family says so."""
    spec = _metric("regression", 1, "scalar", "decay_explicit")
    spec["objective"]["S"] = spec["objective"]["S"].replace("dot(S*k, residual)", "dot(S*q, residual)")
    obj = ssmcraft.compile(spec)
    assert "the memory's update is none of" in PG.supports(obj.ir)
    assert P.supports(obj.ir) is not None


def _precond2(update):
    """Held out of the composer: the preconditioned delta rule with two keys, beta both the covariance's
    weight of each key and the step (R's weights not 1), as a gradient step or the implicit minimiser."""
    S = ("wsq(S - S_prev, R)/2 + beta*dot(S*k, r1) + beta*dot(S*k2, r2)" if update == "step" else
         "lam*wsq(S - S_prev, R_prev)/2 + beta*sq(S*k - x)/2 + beta*sq(S*k2 - x2)/2")
    return {"name": f"precond2_{update}",
            "state": {"R": {"shape": ["m", "m"], "init": {"identity": 1.0}}, "S": ["d", "m"]},
            "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"], "normalize": True}, "q": {"shape": ["m"]},
                       "beta": {"shape": [], "bounded": True}, "lam": {"shape": [], "bounded": True},
                       "k2": {"shape": ["m"], "normalize": True}, "x2": {"shape": ["d"]}},
            **({"let": {"r1": "S_prev*k - x", "r2": "S_prev*k2 - x2"}} if update == "step" else {}),
            "objective": {"R": "sq(R - lam*R_prev - beta*outer(k, k) - beta*outer(k2, k2))/2", "S": S},
            "update": "implicit", "output": "S*q"}


@pytest.mark.parametrize("update", ["step", "implicit"])
def test_weighted_keys_match_the_reference(update):
    obj = ssmcraft.compile(_precond2(update))
    assert PG.match(obj.ir)["cs"] == ["beta", "beta"]
    ins, params, S0, g = kernel_inputs(obj, 2, 37, 2, 12, 8, seed=5)
    S0s = tuple(_spd(2, 2, 8, g) if x == "R" else S0 for x in obj.ir.states)
    errs = kernel_errors(obj, lambda o, lay: validated_call(PG.prepare, o, lay_inputs(o, lay), None,
                                                            tuple(s.float() for s in lay.S0), True),
                         ins, params, S0s, g)
    assert_within(errs, TOL)
