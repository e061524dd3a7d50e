"""Rank-r family (``rankr``: several keys, Woodbury updates; the general generator row-tiled)
under the Triton interpreter, against the float64 reference recurrence: output, final state
and every gradient (inputs, params, initial state; with a gradient on the final state),
outputs poisoned with NaN first, several row blocks with a partial last one (d = 10 rows in
tiles of 4), odd T and T not a multiple of the checkpoint interval."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.compiler.structure import element_form  # noqa: E402
from ssmcraft.compiler.library import find_objective  # noqa: E402
from ssmcraft.ops.general import recurrent as G  # noqa: E402
from ssmcraft.ops.rankr_row import recurrent as RR  # noqa: E402
from helpers import assert_within, kernel_errors, kernel_inputs, rel_rms as rel  # noqa: E402

# relative RMS error, fp32 kernel vs float64 reference: the Woodbury coefficients are
# quotients of O(1) sums (~20 flops each), so fp32 rounding leaves ~1e-6
TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 5e-5}

def _raw(name):
    import yaml
    return yaml.safe_load(find_objective(name).read_text())


TWO_KEY = _raw("longhorn_2key")
# explicit step on two keys with a per-head step (c_rl per head) and a learned per-row param
EXPLICIT_HEAD = dict(TWO_KEY, name="rr_explicit_head", update="explicit",
                     inputs={**TWO_KEY["inputs"], "beta": {"shape": [], "bounded": True}},
                     params={"w": {"shape": ["d"], "init": "ones"}},
                     objective="beta*sq(S*k - x)/2 + beta*sq(S*k2 - x2)/2 + wsq(S, w)/8",
                     output="S*q + x")
# rank 3 with a weighted proximity over the key dimension (a non-identity diagonal)
RANK3 = dict(TWO_KEY, name="rr_rank3",
             inputs={**TWO_KEY["inputs"], "k3": {"shape": ["m"]}, "w": {"shape": ["m"], "positive": True}},
             objective="sq(had(w, S - S_prev))/2 + wsq(S*k - x, beta)/2 + wsq(S*k2 - x2, beta)/2 + sq(S*k3)/4")


# held out, on the family's own kernels (no decay): an explicit step on two keys (per-head factors,
# the cross factors c01, c10 absent, a per-row readout offset) and a three-key implicit update
# (L = R = 3, one term without a step size)
EXPLICIT_NO_DECAY = dict(TWO_KEY, name="rr_explicit_nodecay", update="explicit",
                         inputs={**TWO_KEY["inputs"], "beta": {"shape": [], "bounded": True}},
                         objective="beta*sq(S*k - x)/2 + beta*sq(S*k2 - x2)/2", output="S*q + x")
THREE_KEY = dict(TWO_KEY, name="rr_three_key",
                 inputs={**TWO_KEY["inputs"], "k3": {"shape": ["m"]}, "x3": {"shape": ["d"]}},
                 objective="sq(S - S_prev)/2 + wsq(S*k - x, beta)/2 + wsq(S*k2 - x2, beta)/2 + sq(S*k3 - x3)/2")
SPECS = {"rr_explicit_head": EXPLICIT_HEAD, "rr_rank3": RANK3, "rr_explicit_nodecay": EXPLICIT_NO_DECAY,
         "rr_three_key": THREE_KEY}
OWN = ("longhorn_2key", "rr_explicit_nodecay", "rr_three_key", "rr_rank3")     # rr_explicit_head has a decay


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(G, "POISON", True)
    monkeypatch.setattr(RR, "POISON", True)
    monkeypatch.setattr(RR, "ROW_BLOCK", 4)


def test_supports_and_dispatch():
    obj = ssmcraft.compile("longhorn_2key")
    assert obj.ir.kind == "rankr" and obj.ir.ranks() == (2, 2) and RR.supports(obj.ir) is None
    assert "rank-r" in RR.supports(ssmcraft.compile("longhorn").ir)
    assert "rank-r" not in (G.supports(obj.ir) or "rank-r") and G.supports(obj.ir) is not None
    ins, _, S0, _ = kernel_inputs(obj, 1, 3, 1, 6, 4, seed=1, unit_keys=True)
    obj.prefer = "interpret"
    y, S = obj({k: v.float() for k, v in ins.items()}, initial_state=S0.float())
    # the family's own kernels (no decay), the computed slots by the prologue
    assert RR.own_kernel_reason(obj.ir) is None and obj.backend == "triton-interpret:rankr-row+prologue"
    y_ref, S_ref = obj.reference(ins, initial_state=S0)
    assert rel(y, y_ref) < TOL["y"] and rel(S, S_ref) < TOL["S_T"]


@pytest.mark.parametrize("which,T,chunk,B", [
    ("longhorn_2key", 1, 32, 2), ("longhorn_2key", 7, 4, 2), ("longhorn_2key", 9, 3, 1), ("rr_explicit_head", 5, 2, 2),
    ("rr_rank3", 3, 2, 1), ("rr_explicit_nodecay", 6, 4, 2), ("rr_three_key", 5, 2, 1),
])
def test_matches_reference(which, T, chunk, B, monkeypatch):
    monkeypatch.setattr(G, "CHUNK", chunk)
    monkeypatch.setattr(RR, "CHUNK", chunk)
    obj = ssmcraft.compile(SPECS.get(which, which))
    assert obj.ir.kind == "rankr" and RR.supports(obj.ir) is None
    assert (RR.own_kernel_reason(obj.ir) is None) == (which in OWN), RR.own_kernel_reason(obj.ir)
    H, d, m = 1, 10, 8                         # 3 row blocks of 4, the last one partial
    ins, params, S0, g = kernel_inputs(obj, B, T, H, d, m, seed=T, unit_keys=True)
    assert_within(kernel_errors(obj, lambda o, lay: RR.forward(o, lay, None, True), ins, params, S0, g), TOL)


def test_bf16_io_and_no_initial_state():
    """bf16 inputs give a bf16 output from fp32 state (the interpreter computes in fp32 after
    loading); no initial state starts from zeros; inference path (no checkpoints)."""
    obj = ssmcraft.compile("longhorn_2key")
    ins, _, _, _ = kernel_inputs(obj, 1, 4, 2, 6, 4, seed=4, unit_keys=True)
    obj.prefer = "interpret"
    with torch.no_grad():
        y, S = obj({k: v.bfloat16() for k, v in ins.items()})
    assert y.dtype == torch.bfloat16 and obj.backend == "triton-interpret:rankr-row+prologue"
    y_ref, S_ref = obj.reference({k: v.bfloat16().double() for k, v in ins.items()})
    assert rel(y.double(), y_ref) < 1e-2 and rel(S.double(), S_ref) < 1e-5


def test_row_kernel_and_decode_share_one_derivation_and_keep_no_ir_alive(monkeypatch):
    """The rank-r row kernel and the one-token (decode) kernel are both generated from the element
    form: one derivation of the adjoint, one module. The caches are keyed by content hash (kept on
    the IR object), so a dropped IR is freed."""
    import gc
    import weakref

    from ssmcraft.ops.decode import step as decode

    builds = []
    real = G.build_step
    monkeypatch.setattr(G, "build_step", lambda ir: builds.append(ir.spec_name) or real(ir))
    monkeypatch.setattr(G, "_MODULES", {})
    obj = ssmcraft.compile(dict(TWO_KEY, name="rr_shared"))
    assert RR.supports(obj.ir) is None
    ins, _, S0, _ = kernel_inputs(obj, 1, 1, 1, 6, 4, seed=2, unit_keys=True)
    assert decode.supports_inputs(obj.ir, ins, "interpret") is None
    assert G._module(obj.ir) is G._module(element_form(obj.ir)) and len(builds) == 1
    obj.prefer = "interpret"
    y, S = obj({k: v.float() for k, v in ins.items()}, initial_state=S0.float())
    assert obj.backend == "triton-interpret:decode-fused" and len(builds) == 1
    y_ref, S_ref = obj.reference(ins, initial_state=S0)
    assert rel(y, y_ref) < TOL["y"] and rel(S, S_ref) < TOL["S_T"]
    ref = weakref.ref(obj.ir)
    del obj
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("which,T,chunk", [("longhorn_2key", 7, 4), ("rr_three_key", 5, 2)])
def test_row_blocks_sum_their_key_gradients(which, T, chunk, monkeypatch):
    """``ATOMIC_SUMS``: the own backward's three row blocks (d = 10 in blocks of 4, the last one
    partly past the rows) add their K-vector gradients into one buffer, or store partials that the
    host sums: each way every output and gradient against the float64 reference, and the two ways
    the same gradients to fp32 rounding (the order of the row blocks' additions differs)."""
    from ssmcraft.ops.common import launch as launch_mod
    from ssmcraft.ops.common.reference import layout
    monkeypatch.setattr(RR, "CHUNK", chunk)
    obj = ssmcraft.compile(SPECS.get(which, which))
    assert RR.own_kernel_reason(obj.ir) is None
    seen = []
    real = launch_mod.launch

    def spy(kernel, grid, *args, **kw):
        if kernel is RR.rankr_row_bwd_kernel:
            seen.append((grid[1], kw["ATOMIC"]))
        return real(kernel, grid, *args, **kw)
    monkeypatch.setattr(RR, "launch", spy)
    H, d, m = 1, 10, 8
    grads = {}
    for atomic in (True, False):
        monkeypatch.setattr(RR, "ATOMIC_SUMS", atomic)
        ins, params, S0, g = kernel_inputs(obj, 2, T, H, d, m, seed=T, unit_keys=True)
        errs = kernel_errors(obj, lambda o, lay: RR.forward(o, lay, None, True), ins, params, S0, g)
        assert {"dk", "dk2", "dq", "dS0"} <= set(errs), errs
        assert_within(errs, TOL)
        leaves = {n: x.float().requires_grad_() for n, x in ins.items()}
        y, S = RR.forward(obj, layout(obj.ir, obj.spec, leaves, {}, S0.float()), None, True)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float32)
        grads[atomic] = dict(zip(leaves, torch.autograd.grad((y * dy).sum() + S.sum(), list(leaves.values()))))
    assert seen == [(3, True), (3, True), (3, False), (3, False)]
    for n in grads[True]:
        assert rel(grads[True][n], grads[False][n]) < 1e-6, n
