"""Mini-batch updates (``approximation: {minibatch: C}``) on the general family's fused kernels, under
the Triton interpreter: held-out compositions of the compose space that no chunked family runs (huber
and cauchy data, a decay per key or per channel, Newton steps, two keys, per-channel steps), with chunk
sizes that do and do not divide the backward's checkpoint interval, and lengths that are not multiples
of either. Output, final state and every gradient (initial state included) against the float64
reference (``ssmcraft.runtime.checking``), outputs NaN-poisoned; packed rows against separate
reference calls; and the CUDA dispatch of sampled mini-batch compositions.
"""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops import registry  # noqa: E402
from ssmcraft.ops.general import recurrent as G  # noqa: E402
from ssmcraft.search.compose import check_choices, compose_objective  # noqa: E402
from helpers import assert_within, kernel_errors, kernel_inputs  # noqa: E402

TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 5e-5}       # as tests/test_kernels_general.py


def _compiled(choices: dict, C: int):
    """The composition with a mini-batch of C (the compose space draws C from a few sizes; the
    compiler takes any)."""
    spec = compose_objective(check_choices({**choices, "minibatch": 16}))
    spec["approximation"] = {"minibatch": C}
    return ssmcraft.compile(spec)


def cuda_family(ir) -> str | None:
    """The family CUDA dispatch picks for training calls (``decode`` runs one-token calls only)."""
    return next((f.name for f in registry.order(ir, "triton") if f.name != "decode" and f.reason(ir) is None), None)


# (choices, C, T, checkpoint interval, rows per program); T odd: never a multiple of C, and shorter
# or longer than the interval; C above, below and not dividing the interval
CASES = [
    (dict(data="huber", proximity="plain", step="per_channel", update="explicit"), 3, 11, 4, 4),
    (dict(data="cauchy", proximity="diagonal_decay", step="scalar", update="explicit"), 5, 13, 4, None),
    (dict(data="linear", proximity="channel_decay", step="scalar", update="explicit"), 16, 21, 8, 4),
    (dict(data="regression", proximity="diagonal_decay", step="per_channel", update="newton"), 5, 7, 8, 4),
    (dict(data="huber", proximity="weight_decay", step="per_channel", update="explicit", keys=2), 3, 17, 8, 4),
    (dict(data="huber", proximity="scalar_decay", step="per_channel", update="newton"), 16, 9, 4, None),
    (dict(data="linear", proximity="plain", step="scalar", update="newton", keys=2), 5, 19, 16, 4),
    (dict(data="cauchy", proximity="channel_decay", step="per_channel", update="explicit", keys=2), 3, 5, 8, None),
]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(G, "POISON", True)


@pytest.mark.parametrize("choices,C,T,chunk,rows", CASES)
def test_matches_reference(choices, C, T, chunk, rows, monkeypatch):
    monkeypatch.setattr(G, "CHUNK", chunk)
    if rows:        # several row blocks (d = 12: the last one partial)
        monkeypatch.setitem(G.CONFIG, "rows", rows)
    obj = _compiled({**choices, "normalize": True}, C)
    assert obj.ir.minibatch == C and G.supports(obj.ir) is None
    assert cuda_family(obj.ir) == "general", registry.family("minibatch_chunk").reason(obj.ir)
    ins, params, S0, g = kernel_inputs(obj, 2, T, 2, 12, 8, seed=T)
    assert_within(kernel_errors(obj, lambda o, lay: G.forward(o, lay, None, True), ins, params, S0, g), TOL)


# two states, each stepped explicitly with its data gradient at its anchor: D's data term reads the
# other state's previous value, S's is a Cauchy loss (the update sums over the rows: one row block)
TWO_STATES = {"name": "momentum_cauchy_mb", "state": {"D": ["d", "m"], "S": ["d", "m"]},
              "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"], "normalize": True}, "q": {"shape": ["m"]},
                         "beta": {"shape": ["d"], "positive": True}, "mu": {"shape": [], "bounded": True}},
              "objective": {"D": "sq(D - mu*D_prev)/2 + wsq((S_prev + D)*k - x, beta)/4",
                            "S": "sq(S - S_prev - D)/2 + log(1 + sq(S*k - x))/4"},
              "update": "explicit", "output": "S*q + D*q"}


@pytest.mark.parametrize("C,T,chunk", [(3, 11, 4), (5, 13, 3)])
def test_two_states_match_reference(C, T, chunk, monkeypatch):
    """Every state's anchor carried, checkpointed and given its adjoint (``_D_c``, ``_S_c``)."""
    monkeypatch.setattr(G, "CHUNK", chunk)
    obj = ssmcraft.compile({**TWO_STATES, "approximation": {"minibatch": C}})
    assert obj.ir.states == ("D", "S") and G.supports(obj.ir) is None
    assert {"_D_c", "_S_c"} <= {s.name for r in obj.ir.state_reductions for s in r.body.free_symbols}
    ins, params, S0, g = kernel_inputs(obj, 2, T, 2, 6, 4, seed=T)
    assert_within(kernel_errors(obj, lambda o, lay: G.forward(o, lay, None, True), ins, params, (S0, 0.5 * S0.flip(-1)), g),
                  TOL)


def test_anchor_adjoint_reaches_the_initial_state():
    """The anchor carries gradient: with C = T every step reads only the initial state through its
    data term, so dropping the anchor's adjoint would leave dS0 as the retention's product alone."""
    obj = _compiled(dict(data="huber", proximity="plain", step="scalar", update="explicit", normalize=True), 6)
    _, _, source = G._module(obj.ir)
    assert "MB: tl.constexpr" in source and "ga = ga + " in source and "tl.where(first, ga, 0.0)" in source
    ins, params, S0, g = kernel_inputs(obj, 1, 6, 1, 8, 4, seed=3)
    assert_within(kernel_errors(obj, lambda o, lay: G.forward(o, lay, None, True), ins, params, S0, g), TOL)


def test_without_minibatch_the_source_has_no_anchor():
    """An exact update's kernels are what they were: no anchor, no MB argument."""
    _, _, source = G._module(ssmcraft.compile("huber_longhorn").ir)
    assert "MB" not in source and "ac =" not in source


@pytest.mark.parametrize("choices,C", [
    (dict(data="huber", proximity="diagonal_decay", step="per_channel", update="explicit"), 5),
    (dict(data="cauchy", proximity="plain", step="scalar", update="explicit", keys=2), 3),
])
def test_packed_equals_separate(choices, C, monkeypatch):
    """A packed row through ``obj()`` (lengths odd, empty, under and over C and the checkpoint
    interval): each sequence's mini-batches count from its own start."""
    from test_varlen import _interpret, packed_errors
    monkeypatch.setattr(G, "CHUNK", 8)
    monkeypatch.setitem(G.CONFIG, "rows", 4)
    obj = _compiled({**choices, "normalize": True}, C)
    errs = packed_errors(obj, [0, 17, 5, 0, 1, 12], _interpret, dtype=torch.float32, d=6, m=4)
    assert obj.backend == "triton-interpret:general+packed"
    assert_within(errs, TOL)


def _family_coverage():
    """``benchmarks/family_coverage.py`` as a module (its sampler and its CUDA dispatch rule)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "family_coverage.py"
    spec = importlib.util.spec_from_file_location("family_coverage", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_minibatch_compositions_run_on_triton(seed):
    """The first mini-batch compositions on a matrix memory of ``family_coverage.py``'s sample at
    ``seed`` are each picked by a Triton family on CUDA: ``minibatch_chunk`` where it matches them,
    else ``general``."""
    from ssmcraft.errors import SsmcraftError
    cov = _family_coverage()
    seen = []
    for choices in cov.sample(0, seed):
        if not choices["minibatch"] or choices["memory"] != "matrix":
            continue
        try:
            obj = ssmcraft.compile(compose_objective(check_choices(choices)))
        except SsmcraftError:
            continue             # a composition the compiler refuses is not a layer
        fam, why = cov.family_of(obj.ir)
        chunked = registry.family("minibatch_chunk").reason(obj.ir) is None
        assert fam == ("minibatch_chunk" if chunked else "general"), (choices, fam, why)
        seen.append(fam)
        if len(seen) == 3:
            break
    assert len(seen) == 3


def test_one_token_and_longer_calls_through_obj():
    """``obj()`` on CPU tensors under the interpreter: a one-token call runs the fused decode kernel
    (a call's first token starts a mini-batch, as in the reference), a longer one the general family."""
    from helpers import rel_rms as rel
    obj = _compiled(dict(data="huber", proximity="diagonal_decay", step="per_channel", update="explicit",
                         normalize=True), 16)
    obj.prefer = "interpret"
    for T, backend in ((1, "triton-interpret:decode-fused"), (5, "triton-interpret:general")):
        ins, _, S0, _ = kernel_inputs(obj, 2, T, 2, 6, 4, seed=T)
        ins = {k: v.float() for k, v in ins.items()}
        y, S = obj(ins, None, S0.float(), True)
        assert obj.backend == backend
        yr, Sr = obj.reference(ins, None, S0.float(), True)
        assert rel(y, yr) < TOL["y"] and rel(S, Sr) < TOL["S_T"]


# held-out compositions the GPU check and the class table read from files (``--only FILE``)
SPEC_FILES = {"minibatch_cauchy_keydecay.yaml": dict(proximity="diagonal_decay", data="cauchy", keys=1, step="scalar",
                                                     update="explicit", minibatch=16, normalize=True),
              "minibatch_newton_2key.yaml": dict(proximity="channel_decay", data="regression", keys=2, step="per_channel",
                                                 update="newton", minibatch=16, normalize=True)}


@pytest.mark.parametrize("file", sorted(SPEC_FILES))
def test_benchmark_specs_are_the_compositions(file):
    """``benchmarks/specs``' mini-batch files are what ``compose_objective`` writes, and the general
    family is the one CUDA dispatch picks for them."""
    from pathlib import Path

    import yaml
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "specs" / file
    spec = yaml.safe_load(path.read_text())
    assert spec == compose_objective(check_choices(SPEC_FILES[file]))
    assert cuda_family(ssmcraft.compile(spec).ir) == "general"
