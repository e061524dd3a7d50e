"""Per-row rank-1 family (Longhorn exact, wd/gated Longhorn, DeltaNet, Gated DeltaNet, and the
general slot form) under the Triton interpreter, against float64 references: output, final
state and every gradient (inputs, initial state; with a gradient on the final state), outputs
poisoned with NaN first."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.rank1_row import recurrent as R  # noqa: E402
from ssmcraft.ops.rank1_row.naive import naive_recurrent_rank1_row  # noqa: E402
from helpers import assert_within, kernel_errors, random_inputs, rel_rms as rel  # noqa: E402

# relative RMS error ||ours - ref|| / ||ref||: fp32 kernels vs float64 references
TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(R, "POISON", True)
    monkeypatch.setattr(R, "CHUNK", 64)
    monkeypatch.setattr(R, "DECAY_CHUNK", 64)
    R.set_config()


def check(errs):
    assert_within(errs, TOL)


def test_supports():
    for name in ("longhorn", "wd_longhorn", "gated_longhorn", "deltanet", "gated_deltanet"):
        assert R.supports(ssmcraft.compile(name).ir) is None, name
    assert "rank-1" in R.supports(ssmcraft.compile("longhorn_diag").ir)
    assert "rank-1" in R.supports(ssmcraft.compile("cauchy_delta").ir)


def _inputs(obj, B, T, H, d, m, seed):
    """Inputs per declaration, an initial state and the generator for further draws."""
    ins, _ = random_inputs(obj.spec, B=B, T=T, H=H, sizes=dict(zip(obj.ir.dims, (d, m))), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return ins, torch.randn(B, H, d, m, generator=g, dtype=torch.float64), g


# held out (no library objective): a per-row decay and a per-head one on the same layer (Longhorn's
# regression with a weighted decayed proximity), and an explicit step with a per-row decay
GATED_WD = {"name": "gated_wd_longhorn", "state": {"S": ["d", "m"]},
            "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"]}, "q": {"shape": ["m"]},
                       "beta": {"shape": ["d"], "positive": True, "bounded": True},
                       "alpha": {"shape": [], "bounded": True}, "lam": {"shape": ["d"], "positive": True}},
            "objective": "sq(S - alpha*S_prev)/2 + wsq(S, lam)/2 + wsq(S*k - x, beta)/2",
            "update": "implicit", "approximation": "exact", "output": "S*q"}
DECAY_DELTA = dict(GATED_WD, name="decay_delta", update="explicit",
                   inputs={"x": {"shape": ["d"]}, "k": {"shape": ["m"]}, "q": {"shape": ["m"]},
                           "beta": {"shape": [], "bounded": True}, "w": {"shape": ["d"], "bounded": True}},
                   objective="beta*sq(S*k - x)/2 + wsq(S, w)/2")
HELD_OUT = {"gated_wd_longhorn": GATED_WD, "decay_delta": DECAY_DELTA}

# (objective, T, checkpoint chunk): T = 1, odd T, T spanning several checkpoint chunks; a == 1
# objectives run the exact state reconstruction, the others (a decay) the states rebuilt from the
# checkpoints and kept every second step: chunks of odd length (5) and ones cut by T test that
# a reverse pair cut at the chunk start reads the right kept state
CASES = [
    ("longhorn", 1, 64), ("longhorn", 7, 4), ("longhorn", 65, 64),
    ("wd_longhorn", 7, 4), ("wd_longhorn", 13, 5), ("gated_longhorn", 1, 64), ("gated_longhorn", 9, 4),
    ("gated_longhorn", 11, 6), ("deltanet", 7, 4), ("gated_deltanet", 7, 4), ("gated_deltanet", 10, 3),
    ("gated_wd_longhorn", 9, 5), ("decay_delta", 8, 3),
]


@pytest.mark.parametrize("name,T,chunk", CASES)
def test_objective_matches_reference(name, T, chunk, monkeypatch):
    monkeypatch.setattr(R, "CHUNK", chunk)
    monkeypatch.setattr(R, "DECAY_CHUNK", chunk)
    obj = ssmcraft.compile(HELD_OUT.get(name, name))
    assert obj.ir.kind == "rank1" and R.supports(obj.ir) is None
    B, H, d, m = (1 if T > 32 else 2), 1, 20, 8
    ins, S0, g = _inputs(obj, B, T, H, d, m, seed=T)
    # the family on the reference layout and the generated coefficients, fp32 (shapes and the
    # fp32 state checked by kernel_errors)
    check(kernel_errors(obj, lambda o, lay: R.forward(o, lay, o.module.coefficients(lay.env, lay.d, lay.m), True),
                        ins, {}, S0, g))


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("name,T,chunk", [("longhorn", 7, 4), ("wd_longhorn", 13, 5), ("gated_longhorn", 11, 6)])
def test_row_blocks_sum_their_key_gradients(name, T, chunk, atomic, monkeypatch):
    """``ATOMIC_SUMS``: the backward's three row blocks (V = 20 in blocks of 8, the last one partly
    past the rows) add their K-vector gradients into one buffer (``atomic``) or store partials for
    the host to sum: every output and gradient against the float64 reference, with and without a
    decay."""
    monkeypatch.setattr(R, "ATOMIC_SUMS", (atomic, atomic))
    monkeypatch.setattr(R, "CHUNK", chunk)
    monkeypatch.setattr(R, "DECAY_CHUNK", chunk)
    R.set_config(fwd=(8, 1), bwd=(8, 1))
    obj = ssmcraft.compile(name)
    ins, S0, g = _inputs(obj, 2, T, 1, 20, 8, seed=T)
    errs = kernel_errors(obj, lambda o, lay: R.forward(o, lay, o.module.coefficients(lay.env, lay.d, lay.m), True),
                         ins, {}, S0, g)
    R.set_config()
    assert {"dk", "dq", "dS0"} <= set(errs), errs
    check(errs)


def test_general_slots_fla_layout(monkeypatch):
    """Distinct u, v, q, oq; per-head a and c; per-row p, oc, oh; initial state in FLA layout."""
    monkeypatch.setattr(R, "CHUNK", 4)
    monkeypatch.setattr(R, "DECAY_CHUNK", 4)
    B, T, H, K, V = 2, 6, 2, 8, 12
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ref = [r(B, T, H, K) for _ in range(4)] + [torch.sigmoid(r(B, T, H)), torch.sigmoid(r(B, T, H)),
                                                r(B, T, H, V), r(B, T, H, V), r(B, T, H, V), r(B, H, K, V)]
    ref = [x.requires_grad_() for x in ref]
    ours = [x.detach().float().requires_grad_() for x in ref]
    y_ref, S_ref = naive_recurrent_rank1_row(*ref)
    dy, dS = torch.randn_like(y_ref), torch.randn_like(S_ref)
    ref_g = torch.autograd.grad((y_ref * dy).sum() + (S_ref * dS).sum(), ref)
    u, v, q, oq, a, c, p, oc, oh, S0 = ours
    y, S = R.rank1_row_recurrence(u, v, q, oq, c, p, a=a, oc=oc, oh=oh, initial_state=S0, output_final_state=True)
    assert S.shape == (B, H, K, V)
    got = torch.autograd.grad((y.double() * dy).sum() + (S.double() * dS).sum(), ours)
    errs = {"y": rel(y, y_ref), "S_T": rel(S, S_ref)}
    errs.update({f"d{i}": rel(x_, y_) for i, (x_, y_) in enumerate(zip(got, ref_g))})
    check(errs)


def test_shared_key_gradients_and_no_grad_path():
    """u = v = q passed as one tensor: one gradient buffer; inference skips the side outputs."""
    B, T, H, K, V = 1, 5, 1, 8, 10
    g = torch.Generator().manual_seed(2)
    k = torch.randn(B, T, H, K, generator=g).requires_grad_()
    oq = torch.randn(B, T, H, K, generator=g)
    c = torch.sigmoid(torch.randn(B, T, H, V, generator=g))
    p = torch.randn(B, T, H, V, generator=g)
    y, S = R.rank1_row_recurrence(k, k, k, oq, c, p, output_final_state=True)
    (gk,) = torch.autograd.grad(y.sum() + S.sum(), [k])
    k2 = k.detach().double().requires_grad_()
    y2, S2 = naive_recurrent_rank1_row(k2, k2, k2, oq.double(), torch.ones(B, T, H).double(), c.double(), p.double(),
                   torch.ones(B, T, H).double(), torch.zeros(B, T, H, V).double(), torch.zeros(B, H, K, V).double())
    (gk2,) = torch.autograd.grad(y2.sum() + S2.sum(), [k2])
    check({"y": rel(y, y2), "S_T": rel(S, S2), "dk": rel(gk, gk2)})
    with torch.no_grad():
        y3, S3 = R.rank1_row_recurrence(k, k, k, oq, c, p, output_final_state=False)
    assert S3 is None and torch.equal(y3, y.detach())


def test_chunked_forward_matches_sequential():
    B, T, H, K, V = 1, 11, 1, 8, 12
    g = torch.Generator().manual_seed(3)
    k = torch.randn(B, T, H, K, generator=g) / K ** 0.5
    q = torch.randn(B, T, H, K, generator=g)
    beta = torch.sigmoid(torch.randn(B, T, H, V, generator=g))
    x = torch.randn(B, T, H, V, generator=g)
    c = beta / (1 + beta * (k ** 2).sum(-1, keepdim=True))
    p = c * x
    h0 = torch.randn(B, H, V, K, generator=g)
    y1, S1 = R.rank1_row_recurrence(k, k, k, q, c, p, initial_state=h0, output_final_state=True, state_layout="math")
    y2, S2 = R.chunked_forward(k, k, k, q, c, p, initial_state=h0, segment=4)
    check({"y": rel(y2, y1), "S_T": rel(S2, S1)})


@pytest.mark.parametrize("name", ["gated_longhorn", "gated_wd_longhorn"])
def test_per_head_key_scale_moves_into_the_erase_step(name, monkeypatch):
    """Gated Longhorn's ``u = alpha k`` (a per-head scale of another key slot) through ``obj()`` on
    this family: the kernel gets ``u`` as the same tensor as ``v`` (``k`` read once, one gradient sum
    over the rows less) with ``alpha`` in ``c``; output, final state and every gradient against the
    float64 reference, outputs NaN-poisoned, over two checkpoint chunks."""
    from ssmcraft.ops import registry
    from ssmcraft.runtime import select as TB
    from ssmcraft.runtime.checking import reference_errors
    monkeypatch.setattr(TB, "order", lambda ir, mode: [registry.family("rank1_row")])
    monkeypatch.setattr(R, "DECAY_CHUNK", 8)
    obj = ssmcraft.compile(HELD_OUT.get(name, name))
    obj.prefer = "interpret"
    calls, real = [], R._Rank1RowFunction.apply
    monkeypatch.setattr(R._Rank1RowFunction, "apply", lambda *a: calls.append(a) or real(*a))
    ins, params = random_inputs(obj.spec, B=2, T=13, H=2, sizes={obj.spec.dims[0]: 20, obj.spec.dims[1]: 8})
    S0 = torch.randn(2, 2, 20, 8, dtype=torch.float64)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0, torch.Generator().manual_seed(5))
    u, v = calls[0][:2]
    assert u is v and obj.backend == "triton-interpret:rank1-row+prologue"
    assert cmp.written, cmp.errors
    check(cmp.errors)


# A decayed chunk is walked back dividing by the decay where the decays lose few bits over it, else
# rebuilt from its checkpoint (``bwd``'s docstring). T = 27 in chunks of 4 (the last cut at 3):
# steps 0-11 and 16-19 strong (a in [0.02, 0.05]: some 20 bits per chunk, walked they would lose the
# fp32 result), 12-15 mild except one row (key) of the first row block, 20-26 mild (a in [0.97, 1]).
STRONG = [(0, 12), (16, 20)]
MILD_FROM = 20


def _decays(shape, g, mixed_at):
    """``shape`` [B, T, H(, n)] decays as laid out above; ``mixed_at`` (a row or key index, or None
    per head) the one strong row of steps 12-15."""
    a = 0.97 + 0.03 * torch.rand(shape, generator=g, dtype=torch.float64)
    for s, e in STRONG:
        a[:, s:e] = 0.02 + 0.03 * torch.rand(a[:, s:e].shape, generator=g, dtype=torch.float64)
    if mixed_at is not None:
        a[:, 12:16, :, mixed_at] = 0.03
    return a


def _decayed_run(mode, bits, monkeypatch, seed=7):
    """(errors against the float64 loop, our gradient of the decay: it reads the states): Longhorn's
    step, a decay per head, per row or per key (``mode``), distinct read key, initial state, gradients
    on y and S_T; outputs poisoned."""
    monkeypatch.setattr(R, "DECAY_CHUNK", 4)
    monkeypatch.setattr(R, "DIVIDE_BITS", bits)
    R.set_config(fwd=(8, 1), bwd=(8, 1))          # three row blocks at V = 20: the decision is per program
    B, T, H, K, V = 2, 27, 2, 8, 20
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    shape = {"head": (B, T, H), "row": (B, T, H, V), "key": (B, T, H, K)}[mode]
    a = _decays(shape, g, None if mode == "head" else 2)
    beta = torch.sigmoid(r(B, T, H, V))
    c = beta / (1 + beta)
    leaves = [k, r(B, T, H, K), a, c, c * r(B, T, H, V), r(B, T, H, V), r(B, H, K, V)]
    ref = [x.clone().requires_grad_() for x in leaves]
    kr, qr, ar, cr, pr, ohr, Sr = ref
    y_ref, S_ref = naive_recurrent_rank1_row(kr, kr, kr, qr, ar, cr, pr, torch.ones(B, T, H, dtype=torch.float64),
                                             ohr, Sr, key_decay=mode == "key")
    dy, dS = r(*y_ref.shape), r(*S_ref.shape)
    ref_g = torch.autograd.grad((y_ref * dy).sum() + (S_ref * dS).sum(), ref)
    ours = [x.detach().float().requires_grad_() for x in leaves]
    ko, qo, ao, co, po, oho, So = ours
    y, S = R.rank1_row_recurrence(ko, ko, ko, qo, co, po, a=ao, oh=oho, initial_state=So, output_final_state=True,
                                  key_decay=mode == "key")
    got = torch.autograd.grad((y.double() * dy).sum() + (S.double() * dS).sum(), ours)
    errs = {"y": rel(y, y_ref), "S_T": rel(S, S_ref)}
    errs.update({f"d{n}": rel(x_, y_) for n, x_, y_ in zip(("k", "q", "a", "c", "p", "oh", "S0"), got, ref_g)})
    R.set_config()
    return errs, got[2]


@pytest.mark.parametrize("mode,one_loop", [("head", True), ("row", True), ("key", True), ("row", False)])
def test_decayed_chunks_walked_where_mild_and_rebuilt_where_strong(mode, one_loop, monkeypatch):
    """Both ways in one sequence against the float64 loop (output, final state, every gradient: keys,
    read key, the decay, the step, the input, the output bias, the initial state), and which way each
    chunk took: the mild chunks at the end (the reverse sweep's first) give bit for bit the gradients
    of a run that walks every chunk and not those of one that rebuilds every chunk; walking every
    chunk loses the strong chunks' gradients, so the default run rebuilt them. Both kernel forms: one
    reverse loop selecting the way per state, and a loop per way."""
    monkeypatch.setattr(R, "ONE_LOOP", one_loop)
    errs, da = _decayed_run(mode, R.DIVIDE_BITS, monkeypatch)
    check(errs)
    errs_walk, da_walk = _decayed_run(mode, float("inf"), monkeypatch)
    errs_rebuild, da_rebuild = _decayed_run(mode, -1.0, monkeypatch)
    check(errs_rebuild)
    assert max(v for n, v in errs_walk.items() if n.startswith("d")) > 1e-3, errs_walk
    assert torch.equal(da[:, MILD_FROM:], da_walk[:, MILD_FROM:])
    assert not torch.equal(da[:, MILD_FROM:], da_rebuild[:, MILD_FROM:])


@pytest.mark.parametrize("name,decay", [("gated_longhorn", "alpha"), ("wd_longhorn", "lam")])
def test_packed_mixed_decays_equal_separate(name, decay, monkeypatch):
    """A packed row through ``obj()`` whose sequences' chunks (of 4) walk and rebuild: decays near 1
    (alpha in [0.97, 1], lam in [0, 0.03]) except steps 4-7 of every sequence (alpha 0.05, lam 20),
    lengths under, at and across chunks, an empty sequence first and in the middle; equal to the
    separate float64 reference calls (output, final states, every gradient incl. the decay's and the
    initial states'), outputs poisoned."""
    from ssmcraft.runtime.checking import compare, packed_reference
    from test_varlen import _interpret, packed_inputs
    monkeypatch.setattr(R, "DECAY_CHUNK", 4)
    R.set_config(fwd=(8, 1), bwd=(8, 1))
    obj = ssmcraft.compile(name)
    lens = [0, 17, 5, 0, 3, 11]
    ins, params, S0, cu, g = packed_inputs(obj, lens, d=20, m=8)
    x = torch.rand(ins[decay].shape, generator=g, dtype=torch.float64)
    mild, strong = (0.97 + 0.03 * x, 0.05) if decay == "alpha" else (0.03 * x, 20.0)
    steps = torch.cat([torch.arange(n) for n in lens])
    ins[decay] = torch.where(((steps >= 4) & (steps < 8)).view(1, -1, *[1] * (x.dim() - 2)), strong, mild)
    ref = packed_reference(obj, ins, params, S0, cu, g)
    errs = compare(ref, lambda i, p, s: _interpret(obj, i, p, s, cu), torch.float32).errors
    R.set_config()
    assert obj.backend == "triton-interpret:rank1-row+prologue+packed"
    assert {f"d{decay}", "dS0", "dk", "S_T"} <= set(errs), errs
    check(errs)
