"""Chunked per-row rank-1 family (``rank1_row_chunk``: Longhorn exact and the general slot form with
``a = 1``) under the Triton interpreter, against the float64 per-row recurrence (``rank1_row``'s
``naive.py``): output, final state and every gradient (keys, row coefficients per row, per head and
constant, initial state; with a gradient on the final state), outputs poisoned with NaN first, over
several chunks, lengths cut mid-chunk and several row blocks; packed rows against separate calls;
and where the dispatch puts the family."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops import registry  # noqa: E402
from ssmcraft.ops.rank1_row.naive import naive_recurrent_rank1_row  # noqa: E402
from ssmcraft.ops.rank1_row_chunk import chunk as RC  # noqa: E402
from helpers import assert_within, kernel_errors, kernel_inputs, rel_rms as rel  # noqa: E402

# relative RMS error ||ours - ref|| / ||ref||: fp32 kernels (tf32x3 products) vs float64 references
TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(RC, "POISON", True)
    monkeypatch.setattr(RC, "CHUNK", 16)
    monkeypatch.setattr(RC, "ROWS", 16)


def check(errs):
    assert_within(errs, TOL)


def test_supports():
    for name in ("longhorn", "deltanet", "gated_longhorn", "gated_deltanet"):
        assert RC.supports(ssmcraft.compile(name).ir) is None, name
    assert RC.supports(ssmcraft.compile("wd_longhorn").ir) is None       # per row: its own test file
    assert "rank-1" in RC.supports(ssmcraft.compile("longhorn_diag").ir)


def test_dispatch_order(monkeypatch):
    """On CUDA the family goes ahead of rank1_row for a per-row step with no decay (Longhorn) and with a
    per-head decay (Gated Longhorn, ``DECAY_AHEAD``; off, rank1_row first); a per-head step (DeltaNet)
    stays on rank1_chunk; the interpreter keeps the registry's order (rank1_row first). (``decode`` runs
    one-token calls only.)"""
    def first(name, mode):
        ir = ssmcraft.compile(name).ir
        return next(f.name for f in registry.order(ir, mode) if not f.one_token and f.reason(ir) is None)
    assert first("longhorn", "triton") == "rank1_row_chunk"
    assert first("deltanet", "triton") == "rank1_chunk"
    assert first("gated_longhorn", "triton") == "rank1_row_chunk"
    assert first("gated_deltanet", "triton") == "rank1_chunk"
    assert first("longhorn", "interpret") == "rank1_row"
    monkeypatch.setattr(RC, "DECAY_AHEAD", False)
    assert first("gated_longhorn", "triton") == "rank1_row"


@pytest.mark.parametrize("K", [8, 16, 32, 64, 128])
def test_dispatch_by_key_size(K):
    """On CUDA the family refuses keys fewer than ``MIN_KEYS`` (rank1_row, measured faster there, runs
    them: the first family without a reason); the interpreter takes every size; the exporter's size check
    says the same."""
    from ssmcraft.bench.run import random_inputs
    obj = ssmcraft.compile("longhorn")
    ins, _ = random_inputs(obj, 1, 3, 1, 8, K, torch.float32, torch.device("cpu"))
    fam = registry.family("rank1_row_chunk")
    runs = [f.name for f in registry.order(obj.ir, "triton") if not f.one_token and f.reason(obj.ir, ins, "triton") is None]
    want = "rank1_row_chunk" if K >= RC.MIN_KEYS else "rank1_row"
    assert runs[0] == want, runs
    assert fam.reason(obj.ir, ins, "interpret") is None
    why = fam.size_reason(obj.ir, {"d": 8, "m": K}, "triton")
    assert (why is None) == (K >= RC.MIN_KEYS), why
    if why is not None:
        assert why == f"K = {K} < MIN_KEYS = {RC.MIN_KEYS} (rank1_row's per-token loop is faster with few keys)"


def _general(B, T, H, K, V, modes, seed):
    """Float64 leaves (u, v, q, oq, c, p, oc, oh, S0) with c, p, oc, oh per row (4-d), per head (3-d)
    or constant, as ``modes`` says."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    keys = [r(B, T, H, K) / K ** 0.5 for _ in range(3)] + [r(B, T, H, K)]
    shape = {"row": (B, T, H, V), "head": (B, T, H)}
    rows = []
    for slot, mode in zip(("c", "p", "oc", "oh"), modes):
        if mode == "const":
            rows.append(0.3 if slot != "oh" else None)
        else:
            x = r(*shape[mode])
            rows.append(torch.sigmoid(x) if slot == "c" else x)
    return keys, rows, r(B, H, K, V)


def _as_ref(x, B, T, H, V, per_row=False):
    """A row coefficient as the naive loop takes it: a tensor, ``[B, T, H, V]`` where ``per_row`` (its oh)."""
    if x is None:
        return torch.zeros(B, T, H, V, dtype=torch.float64)
    if not isinstance(x, torch.Tensor):
        x = torch.full((B, T, H), x, dtype=torch.float64)
    return x[..., None].expand(B, T, H, V) if per_row and x.dim() == 3 else x


# (T, C, R, V, modes of c, p, oc, oh): T = 1, T cut mid-chunk over several chunks, a chunk of 32 tokens,
# several row blocks with the last one cut, per-head and constant coefficients
CASES = [
    (1, 16, 16, 12, ("row", "row", "row", "row")),
    (37, 16, 16, 20, ("row", "row", "row", "row")),
    (40, 32, 16, 12, ("row", "row", "const", "const")),
    (23, 16, 16, 40, ("head", "row", "head", "head")),
    (19, 16, 32, 20, ("row", "head", "const", "row")),
    (17, 16, 16, 12, ("const", "const", "row", "const")),
]


@pytest.mark.parametrize("T,C,R,V,modes", CASES)
def test_general_slots_match_reference(T, C, R, V, modes, monkeypatch):
    monkeypatch.setattr(RC, "CHUNK", C)
    monkeypatch.setattr(RC, "ROWS", R)
    B, H, K = 2, 2, 8
    keys, rows, S0 = _general(B, T, H, K, V, modes, seed=T)
    leaves = [x for x in (*keys, *rows, S0) if isinstance(x, torch.Tensor)]
    for x in leaves:
        x.requires_grad_()
    f32 = {id(x): x.detach().float().requires_grad_() for x in leaves}
    ours = lambda x: f32[id(x)] if isinstance(x, torch.Tensor) else x  # noqa: E731
    ones = torch.ones(B, T, H, dtype=torch.float64)
    y_ref, S_ref = naive_recurrent_rank1_row(*keys, ones, *[_as_ref(x, B, T, H, V, i == 3) for i, x in enumerate(rows)], S0)
    dy, dS = torch.randn_like(y_ref), torch.randn_like(S_ref)
    ref_g = torch.autograd.grad((y_ref * dy).sum() + (S_ref * dS).sum(), leaves)
    y, S = RC.rank1_row_chunk(*[ours(x) for x in keys], *[ours(x) for x in rows], initial_state=ours(S0),
                              output_final_state=True)
    assert y.shape == (B, T, H, V) and S.shape == (B, H, K, V) and S.dtype == torch.float32
    got = torch.autograd.grad((y.double() * dy).sum() + (S.double() * dS).sum(), [f32[id(x)] for x in leaves])
    errs = {"y": rel(y, y_ref), "S_T": rel(S, S_ref)}
    errs.update({f"d{i}": rel(a, b) for i, (a, b) in enumerate(zip(got, ref_g))})
    check(errs)


def test_shared_key_and_no_grad_path():
    """u = v = q passed as one tensor (Longhorn's k): its gradient is the sum of the three slots'; no
    initial state and no final-state gradient; inference returns no state and the same output."""
    B, T, H, K, V = 1, 21, 1, 8, 16
    g = torch.Generator().manual_seed(2)
    k = torch.randn(B, T, H, K, generator=g).requires_grad_()
    oq = torch.randn(B, T, H, K, generator=g)
    c = torch.sigmoid(torch.randn(B, T, H, V, generator=g))
    p = torch.randn(B, T, H, V, generator=g)
    y, S = RC.rank1_row_chunk(k, k, k, oq, c, p, output_final_state=True)
    (gk,) = torch.autograd.grad(y.sum(), [k])
    k2 = k.detach().double().requires_grad_()
    y2, S2 = naive_recurrent_rank1_row(k2, k2, k2, oq.double(), torch.ones(B, T, H).double(), c.double(), p.double(),
                                       torch.ones(B, T, H).double(), torch.zeros(B, T, H, V).double(),
                                       torch.zeros(B, H, K, V).double())
    (gk2,) = torch.autograd.grad(y2.sum(), [k2])
    check({"y": rel(y, y2), "S_T": rel(S, S2), "dk": rel(gk, gk2)})
    with torch.no_grad():
        y3, S3 = RC.rank1_row_chunk(k, k, k, oq, c, p)
    assert S3 is None and torch.equal(y3, y.detach())


@pytest.mark.parametrize("name,T", [("longhorn", 1), ("longhorn", 33), ("deltanet", 20)])
def test_objective_on_reference_layout(name, T):
    """The generated coefficients on the reference layout (the exported module's path: Longhorn's per-row
    c and p, DeltaNet's per-head c), against the objective's float64 reference: output, final state,
    every input's and the initial state's gradient."""
    obj = ssmcraft.compile(name)
    ins, params, S0, g = kernel_inputs(obj, 2, T, 2, 20, 8, seed=T)
    check(kernel_errors(obj, lambda o, lay: RC.forward(o, lay, o.module.coefficients(lay.env, lay.d, lay.m), True),
                        ins, params, S0, g))


def _only_this_family(monkeypatch):
    from ssmcraft.runtime import select as TB
    monkeypatch.setattr(TB, "order", lambda ir, mode: [registry.family("rank1_row_chunk")])


def test_longhorn_through_obj(monkeypatch):
    """Longhorn through ``obj()`` on this family (the computed c, p from the prologue; k read once)."""
    from ssmcraft.runtime.checking import reference_errors
    _only_this_family(monkeypatch)
    obj = ssmcraft.compile("longhorn")
    obj.prefer = "interpret"
    calls, real = [], RC._Rank1RowChunkFunction.apply
    monkeypatch.setattr(RC._Rank1RowChunkFunction, "apply", lambda *a: calls.append(a) or real(*a))
    ins, params, S0, g = kernel_inputs(obj, 2, 35, 2, 20, 8, seed=4)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0, g)
    assert calls[0][0] is calls[0][1] is calls[0][2]
    assert obj.backend == "triton-interpret:rank1-row-chunk+prologue"
    assert cmp.written, cmp.errors
    assert {"dk", "dx", "dbeta", "dq", "dS0", "S_T"} <= set(cmp.errors), cmp.errors
    check(cmp.errors)


def test_packed_equals_separate(monkeypatch):
    """A packed row through ``obj()``: lengths under, at and across chunks (of 16), empty sequences
    first and in the middle; equal to the separate float64 reference calls (output, final states,
    every gradient), outputs poisoned."""
    from ssmcraft.runtime.checking import compare, packed_reference
    from test_varlen import _interpret, packed_inputs
    _only_this_family(monkeypatch)
    obj = ssmcraft.compile("longhorn")
    lens = [0, 17, 5, 0, 16, 35]
    ins, params, S0, cu, g = packed_inputs(obj, lens, d=20, m=8)
    ref = packed_reference(obj, ins, params, S0, cu, g)
    errs = compare(ref, lambda i, p, s: _interpret(obj, i, p, s, cu), torch.float32).errors
    assert obj.backend == "triton-interpret:rank1-row-chunk+prologue+packed"
    assert {"dk", "dx", "dbeta", "dS0", "S_T"} <= set(errs), errs
    check(errs)


def _decay_case(B, T, H, K, V, modes, one_key, decay, seed):
    """Float64 leaves with a per-head decay ``a [B, T, H]``: ``decay`` "ordinary" in (0.3, 1), "tiny"
    drawn as ``checking.tiny_decays`` draws them (below 1e-6, 15 % exact zeros, half ordinary mixed in)."""
    keys, rows, S0 = _general(B, T, H, K, V, modes, seed)
    if one_key:
        keys = [keys[0]] * 3 + keys[3:]
    g = torch.Generator().manual_seed(seed + 1)
    a = 0.3 + 0.7 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    if decay == "tiny":
        tiny = torch.exp(-14 - 50 * torch.rand(B, T, H, generator=g, dtype=torch.float64))
        tiny = torch.where(torch.rand(B, T, H, generator=g) < 0.15, torch.zeros_like(tiny), tiny)
        a = torch.where(torch.rand(B, T, H, generator=g) < 0.5, tiny, a)
    return keys, a, rows, S0


# (T, C, R, V, modes of c, p, oc, oh, one key, decays): several chunks cut mid-chunk, one token, chunks of
# 32, several row blocks, per-head and constant coefficients, the shared key (Gated Longhorn's form), tiny
# and zero decays among ordinary ones
DECAY_CASES = [
    (37, 16, 16, 20, ("row", "row", "row", "row"), False, "ordinary"),
    (37, 16, 16, 20, ("row", "row", "row", "row"), True, "ordinary"),
    (1, 16, 16, 12, ("row", "row", "row", "row"), True, "ordinary"),
    (40, 32, 16, 12, ("row", "row", "const", "const"), False, "ordinary"),
    (23, 16, 16, 40, ("head", "row", "head", "head"), True, "ordinary"),
    (19, 16, 32, 20, ("row", "head", "const", "row"), False, "ordinary"),
    (37, 16, 16, 20, ("row", "row", "row", "row"), False, "tiny"),
    (37, 16, 16, 20, ("row", "row", "row", "row"), True, "tiny"),
]


@pytest.mark.parametrize("T,C,R,V,modes,one_key,decay", DECAY_CASES)
def test_decay_matches_reference(T, C, R, V, modes, one_key, decay, monkeypatch):
    """A per-head decay against the float64 recurrence: output, final state and every gradient (the
    decay's and the initial state's included), outputs poisoned with NaN."""
    monkeypatch.setattr(RC, "CHUNK", C)
    monkeypatch.setattr(RC, "ROWS", R)
    B, H, K = 2, 2, 8
    keys, a, rows, S0 = _decay_case(B, T, H, K, V, modes, one_key, decay, seed=T + 3 * one_key)
    check(decay_errors(keys, a, rows, S0))


def decay_errors(keys, a, rows, S0):
    """Relative errors of the family in fp32 on float64 leaves (keys [B, T, H, K], a decay, rows as
    ``_general`` gives them, S0 [B, H, K, V]) against the float64 recurrence on them: output, final state
    and every distinct leaf's gradient (``d0``... in order of first use; ``da`` the decay's)."""
    B, T, H, _ = keys[0].shape
    V = S0.shape[-1]
    leaves = list({id(x): x for x in (*keys, a, *rows, S0) if isinstance(x, torch.Tensor)}.values())
    for x in leaves:
        x.requires_grad_()
    f32 = {id(x): x.detach().float().requires_grad_() for x in leaves}
    ours = lambda x: f32[id(x)] if isinstance(x, torch.Tensor) else x  # noqa: E731
    y_ref, S_ref = naive_recurrent_rank1_row(*keys, a, *[_as_ref(x, B, T, H, V, i == 3) for i, x in enumerate(rows)],
                                             S0)
    dy, dS = torch.randn_like(y_ref), torch.randn_like(S_ref)
    ref_g = torch.autograd.grad((y_ref * dy).sum() + (S_ref * dS).sum(), leaves)
    assert all(bool(torch.isfinite(x).all()) for x in ref_g)
    y, S = RC.rank1_row_chunk(*[ours(x) for x in keys], *[ours(x) for x in rows], initial_state=ours(S0),
                              output_final_state=True, a=ours(a))
    got = torch.autograd.grad((y.double() * dy).sum() + (S.double() * dS).sum(), [f32[id(x)] for x in leaves])
    errs = {"y": rel(y, y_ref), "S_T": rel(S, S_ref)}
    errs.update({f"d{i}": rel(x, r) for i, (x, r) in enumerate(zip(got, ref_g))})
    errs["da"] = errs[f"d{[id(x) for x in leaves].index(id(a))}"]
    return errs


def test_constant_decay_and_no_grad_path():
    """A constant decay (a float) equals the same decay as a tensor; inference stores no chunk states
    and returns the training call's output."""
    B, T, H, K, V = 1, 21, 2, 8, 16
    keys, a, rows, S0 = _decay_case(B, T, H, K, V, ("row", "row", "const", "const"), True, "ordinary", seed=5)
    f = [x.float() if isinstance(x, torch.Tensor) else x for x in (*keys, *rows)]
    y1, S1 = RC.rank1_row_chunk(*f, initial_state=S0.float(), output_final_state=True, a=0.7)
    y2, S2 = RC.rank1_row_chunk(*f, initial_state=S0.float(), output_final_state=True,
                                a=torch.full((B, T, H), 0.7))
    assert torch.equal(y1, y2) and torch.equal(S1, S2)
    y_ref, S_ref = naive_recurrent_rank1_row(*keys, torch.full((B, T, H), 0.7, dtype=torch.float64),
                                             *[_as_ref(x, B, T, H, V, i == 3) for i, x in enumerate(rows)], S0)
    check({"y": rel(y1, y_ref), "S_T": rel(S1, S_ref)})
    with pytest.raises(ValueError, match=r"per head \[B, T, H\] or per row \[B, T, H, V\], got shape \(1, 21\)"):
        RC.rank1_row_chunk(*f, a=torch.full((B, T), 0.7))


@pytest.mark.parametrize("T", [1, 35])
def test_gated_longhorn_through_obj(T, monkeypatch):
    """Gated Longhorn through ``obj()`` on this family: u = alpha k folded into the step, so k is read
    once (one key); output, final state and every gradient (alpha's and the initial state's included)
    against the objective's float64 reference."""
    from ssmcraft.runtime.checking import reference_errors
    _only_this_family(monkeypatch)
    obj = ssmcraft.compile("gated_longhorn")
    obj.prefer = "interpret"
    calls, real = [], RC._Rank1RowChunkFunction.apply
    monkeypatch.setattr(RC._Rank1RowChunkFunction, "apply", lambda *a: calls.append(a) or real(*a))
    ins, params, S0, g = kernel_inputs(obj, 2, T, 2, 20, 8, seed=T)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0, g)
    assert calls[0][0] is calls[0][1] is calls[0][2] and calls[0][4] is not None
    assert calls[0][-1] is not None and calls[0][-1].shape == (2, T, 2)     # alpha of u = alpha k: c's factor
    assert obj.backend == "triton-interpret:rank1-row-chunk+prologue"
    assert cmp.written, cmp.errors
    assert {"dk", "dx", "dbeta", "dalpha", "dq", "dS0", "S_T"} <= set(cmp.errors), cmp.errors
    check(cmp.errors)


def test_gated_longhorn_on_reference_layout():
    obj = ssmcraft.compile("gated_longhorn")
    ins, params, S0, g = kernel_inputs(obj, 2, 33, 2, 20, 8, seed=6)
    check(kernel_errors(obj, lambda o, lay: RC.forward(o, lay, o.module.coefficients(lay.env, lay.d, lay.m), True),
                        ins, params, S0, g))


@pytest.mark.parametrize("decay", ["ordinary", "tiny"])
def test_packed_decay_equals_separate(decay, monkeypatch):
    """Gated Longhorn on a packed row through ``obj()`` (lengths under, at and across chunks of 16, empty
    sequences first and in the middle; ordinary or tiny and zero decays): equal to the separate float64
    reference calls, every gradient, outputs poisoned; the chunk-start states of the sequences never overlap."""
    from ssmcraft.runtime.checking import compare, packed_reference, tiny_decays
    from test_varlen import _interpret, packed_inputs
    _only_this_family(monkeypatch)
    obj = ssmcraft.compile("gated_longhorn")
    lens = [0, 17, 5, 0, 16, 35]
    ins, params, S0, cu, g = packed_inputs(obj, lens, d=20, m=8)
    if decay == "tiny":
        ins, params = tiny_decays(obj, ins, params, g, True)
    ref = packed_reference(obj, ins, params, S0, cu, g)
    errs = compare(ref, lambda i, p, s: _interpret(obj, i, p, s, cu), torch.float32).errors
    assert obj.backend == "triton-interpret:rank1-row-chunk+prologue+packed"
    assert {"dk", "dx", "dbeta", "dalpha", "dS0", "S_T"} <= set(errs), errs
    check(errs)


@pytest.mark.parametrize("c_mode,one_key,decay", [("row", True, "own"), ("head", False, "own"), ("const", True, None),
                                                  ("row", False, None), ("row", True, "scale"),
                                                  ("head", False, "scale")])
def test_c_scale_equals_the_product(c_mode, one_key, decay):
    """``c_scale`` (a per-head factor of c formed in the kernels) against c times it formed by autograd on
    the host: output, final state and every gradient, the factor's own included (c per row, per head or
    a constant; one key or three; with a per-head decay of its own, none, or the factor itself as the
    decay, Gated Longhorn's alpha, whose two gradients the kernel sums); over two row blocks, a cut chunk."""
    B, T, H, K, V = 2, 23, 2, 8, 20
    keys, rows, S0 = _general(B, T, H, K, V, (c_mode, "row", "const", "const"), seed=7)
    if one_key:
        keys = [keys[0]] * 3 + keys[3:]
    g = torch.Generator().manual_seed(8)
    s = (0.2 + 0.8 * torch.rand(B, T, H, generator=g, dtype=torch.float64))
    a = (0.3 + 0.7 * torch.rand(B, T, H, generator=g, dtype=torch.float64)).float() if decay == "own" else None
    dy = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    out = []
    for in_kernel in (True, False):
        leaves = {id(x): x.detach().float().requires_grad_() for x in (*keys, s, S0, *rows)
                  if isinstance(x, torch.Tensor)}
        f = lambda x: leaves[id(x)] if isinstance(x, torch.Tensor) else x  # noqa: E731
        c = f(rows[0])
        dec = f(s) if decay == "scale" else a
        if in_kernel:
            y, S = RC.rank1_row_chunk(*[f(x) for x in keys], c, f(rows[1]), initial_state=f(S0),
                                      output_final_state=True, a=dec, c_scale=f(s))
        else:
            cs = c * (f(s)[..., None] if isinstance(c, torch.Tensor) and c.dim() == 4 else f(s))
            y, S = RC.rank1_row_chunk(*[f(x) for x in keys], cs, f(rows[1]), initial_state=f(S0),
                                      output_final_state=True, a=dec)
        grads = torch.autograd.grad((y.double() * dy).sum() + S.double().sum(), list(leaves.values()))
        out.append((y, S, *grads))
    errs = {f"out{i}": rel(x, r) for i, (x, r) in enumerate(zip(*out))}
    assert_within({"y": errs.pop("out0"), "S_T": errs.pop("out1"), **{f"d{k}": v for k, v in errs.items()}},
                  {"y": 1e-6, "S_T": 1e-6, "grad": 1e-6})
