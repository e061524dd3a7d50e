"""Per-row rank-1 family with a decay per KEY (``a`` over ``m``, one vector scaling the state's
columns, with a per-row step): the composed objectives ``{proximity: diagonal_decay, data:
regression, step: per_channel}`` (explicit, decay-then-explicit, implicit) and a held-out objective
of the class, through ``obj()`` under the Triton interpreter against the float64 reference: output,
final state and every gradient (the decay's and the initial state's included), outputs poisoned
with NaN, several row blocks (the decay's gradient is summed over them) and checkpoint chunks cut
by odd lengths; a packed call equals the separate reference calls."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.rank1_row import recurrent as R  # noqa: E402
from ssmcraft.ops.rank1_row.naive import naive_recurrent_rank1_row  # noqa: E402
from ssmcraft.runtime.checking import reference_errors  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from helpers import assert_within, random_inputs, rel_rms as rel  # noqa: E402
from test_varlen import _interpret, packed_errors  # noqa: E402

TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5}


def _composed(update, normalize=True):
    return compose_objective({"proximity": "diagonal_decay", "data": "regression", "step": "per_channel",
                              "update": update, "normalize": normalize})


# held out (neither the library nor the compose space): a per-key decay times a per-head gate, a
# separate read key, one explicit step of a per-channel regression
GATED_KEYDECAY = {"name": "gated_keydecay_longhorn", "state": {"S": ["d", "m"]},
                  "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"], "normalize": True}, "q": {"shape": ["m"]},
                             "beta": {"shape": ["d"], "positive": True, "bounded": True},
                             "alpha": {"shape": ["m"], "bounded": True}, "g": {"shape": [], "bounded": True}},
                  "objective": "sq(S - had(T(alpha), g*S_prev))/2 + wsq(S*k - x, beta)/2",
                  "update": "explicit", "approximation": "exact", "output": "S*q"}
SPECS = {"explicit": lambda: _composed("explicit"), "decay_explicit": lambda: _composed("decay_explicit"),
         "implicit": lambda: _composed("implicit"), "held_out": lambda: GATED_KEYDECAY}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """NaN-filled outputs; row blocks of 8 (three at d = 20) so the per-key gradient crosses them."""
    monkeypatch.setattr(R, "POISON", True)
    monkeypatch.setattr(R, "DECAY_CHUNK", 5)
    R.set_config(fwd=(8, 1), bwd=(8, 1))
    yield
    R.set_config()


def test_supports_key_decay():
    """Every rank-1 composition of a per-key decay and a per-channel step (``newton`` derives a rank-2
    update), keys normalised or not, and the held-out objective."""
    specs = [_composed(u, n) for u in ("implicit", "explicit", "decay_explicit") for n in (False, True)]
    for spec in specs + [GATED_KEYDECAY]:
        name = spec["name"]
        ir = ssmcraft.compile(spec).ir
        assert ir.coefficient("a").dims == (ir.dims[1],) and R.supports(ir) is None, name
        assert R.is_key_decay(ir), name
    assert not R.is_key_decay(ssmcraft.compile("wd_longhorn").ir)
    # with a per-head step the KDA-like layer stays on its chunked family
    from ssmcraft.bench.classes_commands import COMPOSED
    assert "per-head step" in R.supports(ssmcraft.compile(compose_objective(COMPOSED["kda_like"])).ir)


# odd lengths: under the 4-step unroll, within a chunk of 5 and across several (13: the last chunk cut
# at 3); T = 1 runs the decode kernel
@pytest.mark.parametrize("name,T", [("explicit", 3), ("explicit", 13), ("decay_explicit", 7),
                                    ("decay_explicit", 13), ("implicit", 9), ("held_out", 11)])
def test_key_decay_through_obj_matches_reference(name, T):
    obj = ssmcraft.compile(SPECS[name]())
    obj.prefer = "interpret"
    B, H, d, m = 2, 2, 20, 8
    ins, params = random_inputs(obj.spec, B=B, T=T, H=H, sizes={obj.spec.dims[0]: d, obj.spec.dims[1]: m}, seed=T)
    S0 = torch.randn(B, H, d, m, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0,
                           torch.Generator().manual_seed(5))
    assert obj.backend == "triton-interpret:rank1-row+prologue"
    assert cmp.written, cmp.errors
    assert {"dalpha", "dS0", "dbeta", "dk"} <= set(cmp.errors)
    assert_within(cmp.errors, TOL)


def test_key_decay_slot_form_against_naive():
    """The public function with ``key_decay``: distinct u, v, q, oq, per-row c, p, oc, oh, K != V,
    against the naive loop (float64)."""
    B, T, H, K, V = 2, 7, 2, 8, 12
    g = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ref = [r(B, T, H, K) for _ in range(4)] + [torch.sigmoid(r(B, T, H, K)), torch.sigmoid(r(B, T, H, V)),
                                                r(B, T, H, V), r(B, T, H, V), r(B, T, H, V), r(B, H, K, V)]
    ref = [x.requires_grad_() for x in ref]
    ours = [x.detach().float().requires_grad_() for x in ref]
    y_ref, S_ref = naive_recurrent_rank1_row(*ref, key_decay=True)
    dy, dS = torch.randn_like(y_ref), torch.randn_like(S_ref)
    ref_g = torch.autograd.grad((y_ref * dy).sum() + (S_ref * dS).sum(), ref)
    u, v, q, oq, a, c, p, oc, oh, S0 = ours
    y, S = R.rank1_row_recurrence(u, v, q, oq, c, p, a=a, oc=oc, oh=oh, initial_state=S0, output_final_state=True,
                                  key_decay=True)
    got = torch.autograd.grad((y.double() * dy).sum() + (S.double() * dS).sum(), ours)
    errs = {"y": rel(y, y_ref), "S_T": rel(S, S_ref)}
    errs.update({f"grad {n}": rel(x_, y_) for n, x_, y_ in zip("u v q oq a c p oc oh S0".split(), got, ref_g)})
    assert_within(errs, TOL)


@pytest.mark.parametrize("name", ["explicit", "decay_explicit"])
def test_key_decay_packed_equals_separate(name):
    """A packed row (an empty sequence first and in the middle, lengths under, at and across the
    checkpoint chunk of 5) equals the separate float64 reference calls, on the packed kernels."""
    obj = ssmcraft.compile(SPECS[name]())
    errs = packed_errors(obj, [0, 17, 5, 0, 1, 11], _interpret, dtype=torch.float32, d=20, m=8)
    assert_within(errs, TOL)
    assert obj.backend == "triton-interpret:rank1-row+prologue+packed"


def test_key_decay_compiles_for_sm90(tmp_path):
    """The GPU form (``benchmarks/compile_sm90.py``: the per-key branches are constexpr-only, which
    the interpreter does not check) of a composed spec file, unpacked and packed."""
    import yaml
    from test_compile_sm90 import _kernels, _run
    spec = tmp_path / "keydecay_row.yaml"
    spec.write_text(yaml.safe_dump(_composed("decay_explicit")))
    for packed in ((), ("--packed", "0,17,5,33")):
        rc, out, err = _run(str(spec), *packed)
        assert rc == 0, out + err[-2000:]
        assert {line.split()[1] for line in out.splitlines()} == {"triton:rank1-row+prologue" + ("+packed" if packed else "")}
        assert {k for (_, k) in _kernels(out)} >= {"rank1_row_fwd_kernel", "rank1_row_bwd_kernel"}
        assert set(_kernels(out).values()) == {"ok"}
