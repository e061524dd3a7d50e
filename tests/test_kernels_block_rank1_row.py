"""The block rank-1 family (``ssmcraft/ops/block_rank1_row/``: two states updated by one rank-1 step
of an extrapolated state) under the Triton interpreter, through ``obj()``, against the float64
reference of the derived update: the output, both final states and every gradient (inputs, params,
both initial states, under cotangents of the output and of both final states), outputs poisoned
with NaN, odd lengths, lengths that end inside a checkpoint interval and inside a pair of the
reverse sweep; Longhorn with momentum and held-out objectives of the class (a per-row decay
read through the other state; an explicit per-head step with a per-row momentum; an explicit
step whose readout reads both states). Tolerances as
the general family's multistate tests (fp32 kernel vs float64 reference, relative RMS)."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.block_rank1_row import recurrent as R  # noqa: E402
from ssmcraft.ops.block_rank1_row.naive import naive_block_rank1  # noqa: E402
from ssmcraft.runtime.checking import reference_errors  # noqa: E402
from helpers import assert_within, random_inputs, rel_rms  # noqa: E402
from test_compiler_blockrank1 import HELD_OUT  # noqa: E402
from test_compiler_multistate import ALL  # noqa: E402

TOL = {"y": 1e-5, "D_T": 1e-5, "S_T": 1e-5, "grad": 5e-5}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(R, "POISON", True)


def _case(name, T, seed, B=2, H=2, d=12, m=8):
    obj = ssmcraft.compile(HELD_OUT.get(name) or ALL.get(name) or name)
    ins, params = random_inputs(obj.spec, B=B, T=T, H=H, sizes={"d": d, "m": m}, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    S0 = tuple(0.5 * torch.randn(B, H, d, m, generator=g, dtype=torch.float64) for _ in obj.spec.states)
    obj.prefer = "interpret"
    return obj, ins, params, S0, g


@pytest.mark.parametrize("name,T,chunk", [("momentum_longhorn", 1, 16), ("momentum_longhorn", 9, 4),
                                          ("momentum_longhorn", 12, 4), ("momentum_longhorn", 11, 5),
                                          ("momentum_decay", 9, 4), ("momentum_delta", 7, 3),
                                          ("explicit_step", 8, 4)])
def test_matches_reference(name, T, chunk, monkeypatch):
    """chunk: the checkpoint interval (T = 9 at 4: a last chunk of one step; 11 at 5: odd chunks,
    whose reverse sweep ends on a pair's single step)."""
    monkeypatch.setattr(R, "CHUNK", chunk)
    obj, ins, params, S0, g = _case(name, T, seed=T)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0, g)
    assert obj.backend.startswith("triton-interpret:block-rank1-row")
    assert [k for k in cmp.errors if k.endswith("_T")] == ["D_T", "S_T"]
    assert {"dD0", "dS0", "dmu", "dbeta", "dk", "dx", "dq"} <= set(cmp.errors)
    assert_within(cmp.errors, TOL)


@pytest.mark.parametrize("rows,fwd_rows,ahead", [(4, 8, True), (8, 2, False)])
def test_row_blocks(rows, fwd_rows, ahead, monkeypatch):
    """Several row blocks per head, the last one partly past the rows (d = 12), and a forward on
    other blocks than the backward: the K-vector and per-head gradients are sums over the blocks;
    ``ahead``: the backward's kept states loaded a pair ahead or when used."""
    monkeypatch.setattr(R, "CONFIG", {"rows": rows, "fwd_rows": fwd_rows, "chunk": 4, "keep_ahead": ahead})
    obj, ins, params, S0, g = _case("momentum_decay", 7, seed=11)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0, g)
    assert_within(cmp.errors, TOL)


def test_without_states():
    """No initial state and no final state: the backward runs with the output's cotangent only."""
    obj, ins, params, _, g = _case("momentum_longhorn", 6, seed=2)
    cmp = reference_errors(obj, lambda i, p, s: (obj(i, p, None, False)[0], None), ins, params, None, g,
                           final_state=False)
    assert obj.backend.startswith("triton-interpret:block-rank1-row")
    assert_within(cmp.errors, TOL)


def test_public_function_matches_the_naive_loop():
    """``block_recurrence`` in FLA's layout, per-row and per-head row slots and a constant, against
    the readable loop (``naive.py``) in float64."""
    g = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 7, 2, 8, 12
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    q = torch.randn(B, T, H, K, generator=g)
    mu = 0.2 + 0.6 * torch.rand(B, T, H, generator=g)
    c = torch.rand(B, T, H, V, generator=g)
    p = torch.randn(B, T, H, V, generator=g)
    gam = 0.5 + 0.5 * torch.rand(B, T, H, V, generator=g)
    S0 = tuple(torch.randn(B, H, K, V, generator=g) for _ in range(2))
    rows = {"a00": mu, "a01": 0.0, "a10": mu, "a11": gam, "e0": mu, "e1": gam, "w0": 1.0, "w1": 0.5, "c": c, "p": p,
            "ro0": 0.5, "ro1": gam}
    y, S = R.block_recurrence(k, k, k, q, rows, initial_state=S0, output_final_state=True)
    row = lambda x: x.double()[..., None] if x.dim() == 4 else x.double()[..., None, None]  # noqa: E731
    co = {s: row(x) if isinstance(x, torch.Tensor) else x for s, x in rows.items()}
    co.update({"u": k.double()[..., None, :], "v": k.double()[..., None, :], "q": k.double()[..., None, :],
               "oq": q.double()[..., None, :], "oc": 1.0})
    y_ref, S_ref = naive_block_rank1(co, 2, tuple(s.double().transpose(-1, -2) for s in S0))
    assert rel_rms(y, y_ref) < 1e-6
    assert all(rel_rms(a.transpose(-1, -2), b) < 1e-6 for a, b in zip(S, S_ref))


def test_refuses_by_name():
    """An update without the form goes to the general family, with this family's reason."""
    from ssmcraft.runtime import select
    obj = ssmcraft.compile("longhorn")
    assert "several states" in R.supports(obj.ir)
    obj = ssmcraft.compile(ALL["grid10"])
    reasons = dict(select.families(obj, None, "interpret"))
    assert "block rank-1" in reasons["block_rank1_row"] and reasons["general"] is None


# Where the first state does not read the second (a01 = 0), a chunk is walked back by inverting the
# step where that amplifies rounding by few bits, else rebuilt from its checkpoint (``kernels.py``'s
# docstring). T = 6 chunks + 3 steps (the last chunk cut, the reverse sweep's first pair a single step):
# chunks 0-2 and 4 strong (the coefficient divided by in [0.02, 0.05]: some 20 bits per chunk of 4,
# walked they would lose the fp32 result), chunk 3 mild except one row of the first row block (per row
# coefficients; per head: mild), chunks 5 on mild (in [0.97, 1]).
STRONG_CHUNKS = (0, 1, 2, 4)
MIXED_CHUNK, MILD_CHUNK = 3, 5
# objective, the input divided by (the slot it fills), whether it is per row
WALKED = {"momentum_longhorn": ("mu", False),      # a00 = a10 = e0 per head, a11 = 1
          "momentum_delta": ("mu", True),          # a00 = a10 per row
          "momentum_decay": ("g", True)}           # a11 = e1 per row (mu mild)


def _mixed(shape, chunk, g, per_row):
    """Coefficients in (0, 1] laid out as above along T (axis 1); ``per_row``: row 2 strong in the
    mixed chunk."""
    x = 0.97 + 0.03 * torch.rand(shape, generator=g, dtype=torch.float64)
    for c in STRONG_CHUNKS:
        x[:, c * chunk:(c + 1) * chunk] = 0.02 + 0.03 * torch.rand(x[:, c * chunk:(c + 1) * chunk].shape, generator=g,
                                                                   dtype=torch.float64)
    if per_row:
        x[:, MIXED_CHUNK * chunk:(MIXED_CHUNK + 1) * chunk, :, 2] = 0.03
    return x


def _walked_run(name, chunk, bits, monkeypatch):
    """(errors against the float64 reference, our gradient of the divided input) through ``obj()``:
    initial states, cotangents on y and both final states, outputs poisoned, three row blocks of 4
    (d = 12): the decision is per program."""
    monkeypatch.setattr(R, "DIVIDE_BITS", bits)
    monkeypatch.setattr(R, "CONFIG", {"rows": 4, "chunk": chunk})
    T = 6 * chunk + 3
    obj, ins, params, S0, g = _case(name, T, seed=5, B=1)
    key, per_row = WALKED[name]
    ins[key] = _mixed(ins[key].shape, chunk, g, per_row)
    if "mu" in ins and key != "mu":
        ins["mu"] = 0.97 + 0.03 * torch.rand(ins["mu"].shape, generator=g, dtype=torch.float64)
    got = []

    def call(i, p, s):
        i[key].register_hook(got.append)
        return obj(i, p, s, True)
    cmp = reference_errors(obj, call, ins, params, S0, g)
    assert obj.backend.startswith("triton-interpret:block-rank1-row")
    return cmp.errors, got[0]


@pytest.mark.parametrize("name,chunk", [("momentum_longhorn", 4), ("momentum_delta", 4), ("momentum_decay", 4),
                                        ("momentum_longhorn", 5)])
def test_chunks_walked_where_mild_and_rebuilt_where_strong(name, chunk, monkeypatch):
    """Both ways in one sequence against the float64 reference (output, both final states, every
    gradient incl. both initial states'), and which way each chunk took: the mild chunks at the end
    (the reverse sweep's first) give bit for bit the gradient of the divided input of a run that walks
    every chunk and not that of one that rebuilds every chunk; walking every chunk loses the strong
    chunks' gradients, so the default run rebuilt them. Chunks of 4 and of 5 (odd: pairs cut at the
    chunk's start)."""
    errs, dx = _walked_run(name, chunk, R.DIVIDE_BITS, monkeypatch)
    assert_within(errs, TOL)
    assert {"dD0", "dS0", "D_T", "S_T", "dmu"} <= set(errs), errs
    errs_walk, dx_walk = _walked_run(name, chunk, float("inf"), monkeypatch)
    errs_rebuild, dx_rebuild = _walked_run(name, chunk, -1.0, monkeypatch)
    assert_within(errs_rebuild, TOL)
    assert max(v for n, v in errs_walk.items() if n.startswith("d")) > 1e-3, errs_walk
    mild = MILD_CHUNK * chunk
    assert torch.equal(dx[:, mild:], dx_walk[:, mild:])
    assert not torch.equal(dx[:, mild:], dx_rebuild[:, mild:])


@pytest.mark.parametrize("bits", [float("inf"), -1.0])
def test_full_transition_is_rebuilt(bits, monkeypatch):
    """A transition whose first state reads the second (``a01`` a per-head tensor, not the constant 0)
    has no walk back of this form: every chunk is rebuilt whatever the bound, and the gradients of
    every slot tensor and both initial states match the readable loop's (float64 autograd)."""
    monkeypatch.setattr(R, "DIVIDE_BITS", bits)
    monkeypatch.setattr(R, "CONFIG", {"rows": 4, "chunk": 4})
    g = torch.Generator().manual_seed(1)
    B, T, H, K, V = 1, 11, 2, 8, 12
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    mu = 0.5 + 0.4 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    a01 = 0.2 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    c = torch.rand(B, T, H, V, generator=g, dtype=torch.float64)
    p = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    S0 = [torch.randn(B, H, K, V, generator=g, dtype=torch.float64) for _ in range(2)]
    leaves = [k, q, mu, a01, c, p, *S0]
    dy = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    dS = [torch.randn(B, H, K, V, generator=g, dtype=torch.float64) for _ in range(2)]

    def run(k, q, mu, a01, c, p, D0, X0, naive):
        rows = {"a00": mu, "a01": a01, "a10": mu, "a11": 1.0, "e0": mu, "e1": 1.0, "w0": 1.0, "w1": 1.0, "c": c,
                "p": p, "ro0": 0.0, "ro1": 1.0}
        if not naive:
            return R.block_recurrence(k, k, k, q, rows, initial_state=(D0, X0), output_final_state=True)
        row = lambda x: x[..., None] if x.dim() == 4 else x[..., None, None]  # noqa: E731
        co = {s: row(x) if isinstance(x, torch.Tensor) else x for s, x in rows.items()}
        co.update({"u": k[..., None, :], "v": k[..., None, :], "q": k[..., None, :], "oq": q[..., None, :], "oc": 1.0})
        y, S = naive_block_rank1(co, 2, (D0.transpose(-1, -2), X0.transpose(-1, -2)))
        return y, tuple(s.transpose(-1, -2) for s in S)

    grads = []
    for naive, dtype in ((True, torch.float64), (False, torch.float32)):
        xs = [x.detach().to(dtype).requires_grad_() for x in leaves]
        y, S = run(*xs, naive)
        loss = (y.double() * dy).sum() + sum((s.double() * d).sum() for s, d in zip(S, dS))
        grads.append(torch.autograd.grad(loss, xs))
    for name, ours, ref in zip(("k", "q", "mu", "a01", "c", "p", "D0", "S0"), grads[1], grads[0]):
        assert rel_rms(ours, ref) < 5e-5, name
