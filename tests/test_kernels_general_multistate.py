"""Issue 14: the general/nonlinear kernel family with several states (each its own [K, V]
tile, checkpoint and adjoint) under the Triton interpreter, against the float64 reference
recurrence: output, every final state and every gradient (inputs, params, each initial
state; with a gradient on each final state), outputs poisoned with NaN first, odd T and a
T that is not a multiple of the checkpoint interval. Tolerances as tests/test_kernels_general.py
(relative RMS, fp32 kernel vs float64 reference)."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.general import recurrent as G  # noqa: E402
from helpers import assert_within, kernel_errors, random_inputs, rel_rms as rel  # noqa: E402
from test_compiler_multistate import GRID, SECOND_MOMENT  # noqa: E402

TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 5e-5}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(G, "POISON", True)


@pytest.mark.parametrize("which,T,chunk,rows", [("momentum_longhorn", 1, 32, None), ("momentum_longhorn", 9, 4, None),
                                                ("second_moment", 7, 4, None), ("momentum_longhorn", 9, 4, 4)])
def test_matches_reference(which, T, chunk, rows, monkeypatch):
    """rows: rows per program (row tiling, as the rank-r family runs it; valid here because
    momentum_longhorn's step sums over m only), None for one row block."""
    monkeypatch.setattr(G, "CHUNK", chunk)
    obj = ssmcraft.compile({"second_moment": SECOND_MOMENT}.get(which, which))
    if rows is not None:
        assert G.row_sums(G._module(obj.ir)[0]) == []
    B, H, d, m = 2, 2, 12, 8
    ins, params = random_inputs(obj.spec, B=B, T=T, H=H, sizes={"d": d, "m": m}, seed=T)
    g = torch.Generator().manual_seed(T + 100)
    S0 = tuple(0.5 * torch.randn(B, H, d, m, generator=g, dtype=torch.float64) for _ in obj.spec.states)

    def run(o, lay):
        y, S = G.forward(o, lay, None, True, row_block=rows)
        assert isinstance(S, tuple) and len(S) == len(S0)
        return y, S
    errs = kernel_errors(obj, run, ins, params, S0, g)   # shapes, fp32 states, every gradient
    assert [k for k in errs if k.endswith("_T")] == [f"{x}_T" for x in obj.spec.states]
    assert_within(errs, {**TOL, **{f"{x}_T": TOL["S_T"] for x in obj.spec.states}})


def test_dispatch_and_fla_layout():
    """obj(...) picks the general kernel under the interpreter for a two-state update that is not
    one rank-1 step of an extrapolated state (it reads the states along two keys: momentum_longhorn
    itself runs on the block rank-1 family); general_scan takes a tuple of [B, H, K, V] states and
    returns one."""
    obj = ssmcraft.compile(GRID["grid10"])
    B, T, H, d, m = 1, 5, 1, 12, 8
    ins, _ = random_inputs(obj.spec, B=B, T=T, H=H, sizes={"d": d, "m": m}, seed=5)
    S0 = tuple(torch.randn(B, H, d, m, dtype=torch.float64) for _ in range(2))
    y_ref, S_ref = obj.reference(ins, None, S0)
    obj.prefer = "interpret"
    try:
        y, S = obj({k: v.float() for k, v in ins.items()}, None, tuple(s.float() for s in S0))
    finally:
        obj.prefer = "auto"
    assert obj.backend == "triton-interpret:general"
    assert rel(y, y_ref) < TOL["y"] and all(rel(a, b) < TOL["S_T"] for a, b in zip(S, S_ref))
    with torch.no_grad():
        y2, S2 = G.general_scan(obj, {k: v.float() for k, v in ins.items()},
                                initial_state=tuple(s.float().transpose(-1, -2) for s in S0), output_final_state=True)
    assert isinstance(S2, tuple) and S2[1].shape == (B, H, m, d)
    assert rel(y2, y_ref) < TOL["y"] and all(rel(a.transpose(-1, -2), b) < TOL["S_T"] for a, b in zip(S2, S_ref))
