"""Packed sequences (``cu_seqlens``) in the families of the structure classes that the library's
objectives do not cover (``bench --classes``' ``COMPOSED``: the KDA-like layer, mini-batch steps) and
of the second-order learners (RLS, the preconditioned delta rule): a packed call under the
interpreter equals N separate float64 reference calls on the output, every final state and every
gradient (inputs and initial states), with every kernel buffer poisoned with NaN, and runs the
family's packed kernels (``+packed``)."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.bench.classes_commands import COMPOSED  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from ssmcraft.runtime.checking import compare, packed_reference  # noqa: E402
from helpers import assert_within  # noqa: E402
from test_varlen import _interpret, packed_errors, packed_inputs, packed_without_states  # noqa: E402

# odd lengths; empty first and in the middle; 5 and 1 under a chunk (a mini-batch) of 16; 17 and 33 end
# with a partial one
LENS = [0, 17, 5, 0, 1, 33]


@pytest.fixture
def poisoned(monkeypatch):
    """Every kernel buffer starts as NaN; chunks of 16 tokens and value blocks of 8 (several at d = 20)."""
    from ssmcraft.ops.minibatch_chunk import chunk as MB
    from ssmcraft.ops.precision_rank1 import chunk as PR
    from ssmcraft.ops.rank1_chunk import chunk as R1
    from ssmcraft.ops.rank1_keydecay_chunk import chunk as RK
    for mod in (RK, MB):
        monkeypatch.setattr(mod, "POISON", True)
        monkeypatch.setattr(mod, "INTERPRET_BV", 8)
    for mod in (PR, R1):
        monkeypatch.setattr(mod, "POISON", True)
    monkeypatch.setattr(RK, "CHUNK", 16)
    monkeypatch.setattr(PR, "CHUNK", 16)


@pytest.mark.parametrize("choices, family", [
    (COMPOSED["kda_like"], "rank1-keydecay-chunk"),
    (COMPOSED["minibatch_delta"], "minibatch-chunk"),                      # mini-batches of 16
    ({"update": "explicit", "minibatch": 16, "proximity": "scalar_decay"}, "minibatch-chunk"),   # a decay, per-row step
], ids=["kda_like", "minibatch_delta", "minibatch_decay"])
def test_composed_family_packed_equals_separate(choices, family, poisoned):
    """KDA-like: the per-key decay's sums, A and L restart at each sequence's start; mini-batch: each
    sequence's mini-batches start at its first token, as N separate calls take them."""
    obj = ssmcraft.compile(compose_objective(choices))
    errs = packed_errors(obj, LENS, _interpret, dtype=torch.float32, d=20, m=12)
    assert_within(errs, {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5})
    assert obj.backend == f"triton-interpret:{family}+packed"


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
@pytest.mark.parametrize("name", ["rls", "precond_delta"])
def test_precision_family_packed_equals_separate(name, parallel, poisoned, monkeypatch):
    """RLS and the preconditioned delta rule, in both forms of the precision (``PARALLEL``: the
    segments restart at each sequence's start): both final states (R, S) and the gradients of both
    initial states per sequence; each R0 symmetric positive definite (the precision is its inverse)."""
    from ssmcraft.ops.precision_rank1 import chunk as PR
    monkeypatch.setattr(PR, "PARALLEL", parallel)
    obj = ssmcraft.compile(name)
    ins, params, S0, cu, g = packed_inputs(obj, LENS, d=12, m=8)
    A = torch.randn(len(LENS), 2, 8, 8, generator=g, dtype=torch.float64)
    spd = torch.eye(8, dtype=torch.float64) + 0.1 * A @ A.transpose(-1, -2)
    S0 = tuple(spd if x == "R" else s for x, s in zip(obj.ir.states, S0))
    ref = packed_reference(obj, ins, params, S0, cu, g)
    errs = compare(ref, lambda i, p, s: _interpret(obj, i, p, s, cu), torch.float32).errors
    assert_within(errs, {"y": 1e-5, "R_T": 1e-5, "S_T": 1e-5, "grad": 2e-5})
    assert obj.backend == "triton-interpret:precision-fp64+rank1-chunk+packed"


@pytest.mark.parametrize("label", ["kda_like", "minibatch_delta", "rls"])
def test_packed_without_initial_or_final_state(label, poisoned):
    """As a training forward calls them: no initial state (each sequence starts from the objective's
    own start) and no final state asked: the output and every input's gradient equal the packed
    reference's, and no state comes back."""
    obj = ssmcraft.compile(compose_objective(COMPOSED[label]) if label in COMPOSED else label)
    errs, S = packed_without_states(obj, [0, 19, 4, 1], d=12, m=8)
    assert S is None and obj.backend.endswith("+packed")
    assert_within(errs, {"y": 1e-5, "grad": 2e-5})
