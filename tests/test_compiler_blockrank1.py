"""The compiler's block rank-1 stage (``ssmcraft/compiler/blockrank1.py``): which several-state
updates it recognises as one rank-1 step of an extrapolated state, the slots it writes for Longhorn
with momentum, and, numerically, that the recurrence of those slots (``ops/block_rank1_row/naive.py``)
is the derived update: float64, against ``obj.reference`` (the element updates the derivation
gives), for the library objective, held-out ones and the multistate test grid."""
import subprocess
import sys

import pytest
import sympy
import torch

import ssmcraft
from ssmcraft.compiler import blockrank1
from ssmcraft.compiler.api import derive
from ssmcraft.ops.block_rank1_row.naive import naive_block_rank1
from ssmcraft.ops.common.reference import layout
from helpers import random_inputs, rel_rms
from test_compiler_multistate import ALL

_BASE = {"x": {"shape": ["d"]}, "k": {"shape": ["m"], "normalize": True}, "q": {"shape": ["m"]},
         "beta": {"shape": ["d"], "positive": True}, "mu": {"shape": [], "bounded": True}}
# held out of the library: a per-row decay of the state the step starts from, read through D
DECAY = {"name": "momentum_decay", "state": {"D": ["d", "m"], "S": ["d", "m"]},
         "inputs": {**_BASE, "g": {"shape": ["d"], "bounded": True}},
         "objective": {"D": "sq(D - mu*D_prev)/2 + wsq((had(g, S_prev) + D)*k - x, beta)/2",
                       "S": "sq(S - had(g, S_prev) - D)/2"},
         "update": "implicit", "output": "D*q"}
# held out: an explicit step of the delta rule with a per-head step and a per-row momentum
EXPLICIT = {"name": "momentum_delta", "state": {"D": ["d", "m"], "S": ["d", "m"]},
            "inputs": {**_BASE, "k": {"shape": ["m"]}, "beta": {"shape": [], "positive": True},
                       "mu": {"shape": ["d"], "bounded": True}},
            "objective": {"D": "sq(D - had(mu, D_prev))/2 + dot(beta, sq((S_prev + D)*k - x))/2",
                          "S": "sq(S - S_prev - D)/2"},
            "update": {"D": "explicit", "S": "implicit"}, "output": "S*q"}
HELD_OUT = {"momentum_decay": DECAY, "momentum_delta": EXPLICIT}
# the several-state objectives of tests/test_compiler_multistate.py that have the form
WITH_FORM = {"momentum_longhorn", "explicit_step", "grid00"}


def _expr(ir, slot):
    return ir.expanded_coefficients()[ir.slots[slot]]


def test_momentum_longhorn_slots():
    """U = S_prev + mu D_prev, one erase along k with Longhorn's step, D = S - S_prev: the slots."""
    ir = ssmcraft.compile("momentum_longhorn").ir
    assert ir.kind == "general" and ir.block
    got = {s: _expr(ir, s) for s in ("a00", "a01", "a10", "a11", "e0", "e1", "w0", "w1", "ro0", "ro1")}
    assert {s: sympy.sstr(e) for s, e in got.items()} == {"a00": "mu", "a01": "0", "a10": "mu", "a11": "1",
                                                          "e0": "mu", "e1": "1", "w0": "1", "w1": "1",
                                                          "ro0": "0", "ro1": "1"}
    assert [sympy.sstr(_expr(ir, s)) for s in ("u", "v", "q", "oq", "oc")] == ["k", "k", "k", "q", "1"]
    c, p = _expr(ir, "c"), _expr(ir, "p")
    assert sympy.sstr(c) == "beta/(_r0*beta + 1)" and sympy.sstr(sympy.simplify(p / c)) == "x"
    assert [(r.name, sympy.sstr(r.body)) for r in ir.reductions] == [("_r0", "k**2")]
    assert blockrank1.block_rank1(ir).n_states == 2


def test_which_updates_have_the_form():
    """The multistate grid: the form where every erase is along one key and of rank 1 over the
    states, a reason elsewhere (single-state objectives and nonlinear updates included)."""
    have = set()
    for name, spec in ALL.items():
        dv = derive(spec)
        found = blockrank1.find(dv.symbolic, dv.ir)
        if not isinstance(found, str):
            have.add(name)
            assert dv.ir.block and dv.ir.slots == found.slots
        else:
            assert not dv.ir.block and isinstance(blockrank1.block_rank1(dv.ir), str)
    assert have == WITH_FORM
    assert "not of rank 1" in blockrank1.find(*_so_ir(ALL["grid01"]))
    assert "more than one key" in blockrank1.find(*_so_ir(ALL["grid10"]))
    assert "several-state" in blockrank1.find(*_so_ir("longhorn"))
    for name in HELD_OUT.values():
        assert ssmcraft.compile(name).ir.block


def _so_ir(spec):
    dv = derive(spec)
    return dv.symbolic, dv.ir


@pytest.mark.parametrize("name", sorted(WITH_FORM | set(HELD_OUT)))
def test_slot_recurrence_is_the_derived_update(name):
    """The block recurrence on the slots' values (the generated coefficients) equals the derived
    update's reference, output and both final states, to float64 rounding."""
    obj = ssmcraft.compile(HELD_OUT.get(name) or ALL[name])
    form = blockrank1.block_rank1(obj.ir)
    B, T, H, d, m = 2, 6, 2, 5, 4
    ins, params = random_inputs(obj.spec, B=B, T=T, H=H, sizes={"d": d, "m": m}, seed=3)
    g = torch.Generator().manual_seed(4)
    S0 = tuple(torch.randn(B, H, d, m, generator=g, dtype=torch.float64) for _ in obj.spec.states)
    y_ref, S_ref = obj.reference(ins, params, S0)
    lay = layout(obj.ir, obj.spec, ins, params, S0)
    values = obj.module.coefficients(lay.env, d, m)
    co = {slot: values[slot] for slot in obj.ir.slots}
    y, S = naive_block_rank1(co, form.n_states, S0)
    assert rel_rms(y, y_ref) < 1e-12
    assert all(rel_rms(a, b) < 1e-12 for a, b in zip(S, S_ref))


def test_other_irs_are_unchanged():
    """The stage adds nothing to an update without the form (its IR hash is the classifier's)."""
    from ssmcraft.compiler.spec import load_spec
    from ssmcraft.compiler.structure import build_ir
    from ssmcraft.compiler.symbolic import symbolic_objective
    for name in ("longhorn", "deltanet"):
        so = symbolic_objective(load_spec(name))
        ir = build_ir(so)
        assert blockrank1.attach(so, ir) is ir
    so = symbolic_objective(load_spec("momentum_longhorn"))
    ir = build_ir(so)
    assert blockrank1.attach(so, ir).content_hash() != ir.content_hash() and not ir.block


def test_derive_prints_the_form():
    out = subprocess.run([sys.executable, "-m", "ssmcraft.cli", "derive", "momentum_longhorn"],
                         capture_output=True, text=True, check=True).stdout
    assert "block rank-1 form" in out
    assert "U = (mu)*D_prev + (1)*S_prev" in out
    assert "S_t = (mu)*D_prev + (1)*S_prev + (1)*R" in out and "y = (1)*sum_m ((1)*S)*(q)" in out
    out = subprocess.run([sys.executable, "-m", "ssmcraft.cli", "derive", "longhorn"],
                         capture_output=True, text=True, check=True).stdout
    assert "block rank-1" not in out
