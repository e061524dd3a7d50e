"""The general family run row-tiled (several programs per head, each owning a block of rows)
for row-separable nonlinear and several-state updates, under the Triton interpreter, against the
float64 reference recurrence: output, final state(s) and every gradient (inputs, params, initial
states; with a gradient on the final state), outputs poisoned with NaN first, odd T and a T that
is not a multiple of the checkpoint interval. Held-out composed objectives (``search.compose``)
of the classes the row tiling serves, beside the library's. Tolerances as
tests/test_kernels_general.py."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.general import recurrent as G  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from helpers import assert_within, kernel_errors, kernel_inputs  # noqa: E402

TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 5e-5}

# held out: no library objective is either
HUBER_DECAY = compose_objective(dict(proximity="channel_decay", data="huber", step="per_channel",
                                     update="decay_explicit"))
CAUCHY_CHANNEL = compose_objective(dict(proximity="scalar_decay", data="cauchy", step="per_channel",
                                        update="explicit"))
SPECS = {"huber_decay": HUBER_DECAY, "cauchy_channel": CAUCHY_CHANNEL}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(G, "POISON", True)


@pytest.mark.parametrize("which,T,chunk,rows", [
    ("huber_longhorn", 9, 4, 4), ("huber_longhorn", 1, 32, 8), ("huber_decay", 7, 4, 4),
    ("cauchy_channel", 9, 4, 8), ("momentum_longhorn", 7, 4, 4),
])
def test_row_tiled_matches_reference(which, T, chunk, rows, monkeypatch):
    """d = 12 rows in blocks of 4 (3 programs per head) or 8 (the last block half masked)."""
    monkeypatch.setattr(G, "CHUNK", chunk)
    monkeypatch.setattr(G, "CONFIG", {"rows": rows})
    obj = ssmcraft.compile(SPECS.get(which, which))
    assert G.row_sums(G._module(obj.ir)[0]) == []
    B, H, d, m = 2, 2, 12, 8
    assert G.rows_per_program(obj.ir, d, m) == rows
    ins, params, S0, g = kernel_inputs(obj, B, T, H, d, m, seed=T + rows)
    if obj.spec.states and len(obj.spec.states) > 1:
        S0 = tuple(0.5 * torch.randn(B, H, d, m, generator=g, dtype=torch.float64) for _ in obj.spec.states)
    errs = kernel_errors(obj, lambda o, lay: G.forward(o, lay, None, True), ins, params, S0, g)
    tol = {**TOL, **{k: TOL["S_T"] for k in errs if k.endswith("_T")}}
    assert_within(errs, tol)


def test_rows_by_rule(monkeypatch):
    """Row-separable updates are tiled by rows on the GPU (about 512 state values per program, all
    states counted, at least 8 rows); one whose step sums over the rows (cauchy_delta: |S k - x|^2) keeps every row
    in one program; the interpreter runs one block of rows (fewest programs)."""
    huber, cauchy = ssmcraft.compile("huber_longhorn"), ssmcraft.compile("cauchy_delta")
    momentum = ssmcraft.compile("momentum_longhorn")
    assert G.row_sums(G._module(cauchy.ir)[0]) and G.rows_per_program(cauchy.ir, 64, 64) is None
    monkeypatch.setattr(G, "INTERPRET", True)
    assert G.rows_per_program(huber.ir, 64, 64) == 64
    monkeypatch.setattr(G, "INTERPRET", False)
    assert G.rows_per_program(cauchy.ir, 64, 64) is None
    assert G.rows_per_program(huber.ir, 64, 64) == 8 and G.rows_per_program(huber.ir, 64, 16) == 32
    assert G.rows_per_program(huber.ir, 4, 64) == 4
    assert G.rows_per_program(momentum.ir, 64, 64) == 8
    assert G._warps(64, 16, 64) == 1 and G._warps(64, 64, 64) == 4


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("which,shared", [("huber_longhorn", ["k", "q"]), ("cauchy_channel", ["k", "q", "alpha"])])
def test_row_blocks_sum_shared_gradients(which, shared, atomic, monkeypatch):
    """``ATOMIC_SUMS``: the gradients of the leaves shared by the rows (the keys; cauchy_channel's
    per-head decay, a scalar) from d = 12 rows in blocks of 8 (the second half masked), added into
    one buffer by every row block (``atomic``) or stored as partials for the host to sum, against the
    float64 reference; the per-row gradients are written in the leaves' dtype either way."""
    monkeypatch.setattr(G, "CHUNK", 4)
    monkeypatch.setattr(G, "CONFIG", {"rows": 8})
    monkeypatch.setattr(G, "ATOMIC_SUMS", atomic)
    obj = ssmcraft.compile(SPECS.get(which, which))
    assert [n for n, dims, _ in G._module(obj.ir)[0].leaves if obj.ir.dims[0] not in dims] == shared
    launched = []
    real = G.launch

    def spy(kernel, grid, *args, **kw):
        launched.append((kernel.__name__ if hasattr(kernel, "__name__") else str(kernel), grid, kw.get("ATOMIC")))
        return real(kernel, grid, *args, **kw)
    monkeypatch.setattr(G, "launch", spy)
    B, T, H, d, m = 2, 6, 2, 12, 8
    ins, params, S0, g = kernel_inputs(obj, B, T, H, d, m, seed=3)
    errs = kernel_errors(obj, lambda o, lay: G.forward(o, lay, None, True), ins, params, S0, g)
    assert [(grid, at) for name, grid, at in launched if "bwd" in name] == [((B * H, 2), atomic)]
    assert {f"d{n}" for n in shared} <= set(errs), (shared, errs)
    assert_within(errs, TOL)


def test_gradients_written_in_the_leaves_dtype(monkeypatch):
    """bf16 leaves, two row blocks: the backward writes the per-row gradients in bf16 itself and casts
    the added shared ones once; each is the fp32 run's gradient on the same (bf16-exact) values in
    bf16: the kernel's arithmetic is fp32 either way. The shared ones are cast by torch (equal to
    the fp32 gradient's cast); the per-row ones within one bf16 ulp of the fp32 gradient (the
    interpreter's conversion to bf16 does not round to nearest as the GPU's does)."""
    monkeypatch.setattr(G, "CHUNK", 4)
    monkeypatch.setattr(G, "CONFIG", {"rows": 8})
    obj = ssmcraft.compile("huber_longhorn")
    B, T, H, d, m = 1, 6, 2, 16, 8
    ins, _, _, g = kernel_inputs(obj, B, T, H, d, m, seed=5)
    exact = {n: x.to(torch.bfloat16) for n, x in ins.items()}
    dy = torch.randn(B, T, H, d, generator=g).to(torch.bfloat16)
    grads = {}
    for dt in (torch.float32, torch.bfloat16):
        leaves = {n: x.to(dt).requires_grad_() for n, x in exact.items()}
        y, _ = G.general_scan(obj, leaves)
        grads[dt] = dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy.to(y.dtype))))
    for n, got in grads[torch.bfloat16].items():
        want = grads[torch.float32][n]
        assert got.dtype == torch.bfloat16 and want.dtype == torch.float32, n
        if n in ("k", "q"):
            assert torch.equal(got, want.to(torch.bfloat16)), n
        else:
            assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -7).all(), n
