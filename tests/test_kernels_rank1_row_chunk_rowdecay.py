"""The chunked per-row rank-1 family with a decay per state row (``rank1_row_chunk/rowdecay.py``:
wd_longhorn's ``1 / (1 + lambda)``, a composed objective's per-channel decay) under the Triton
interpreter, against the float64 per-row recurrence (``rank1_row``'s ``naive.py``) and the objectives'
float64 references: output, final state and every gradient (the decay's per row, the keys', the row
coefficients' per row, per head and constant, the initial state's), outputs poisoned with NaN, over
several chunks, lengths cut mid-chunk, several row blocks, tiny and zero decays; packed rows against
separate calls; what ``supports`` takes and refuses."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.rank1_row.naive import naive_recurrent_rank1_row  # noqa: E402
from ssmcraft.ops.rank1_row_chunk import chunk as RC  # noqa: E402
from ssmcraft.ops.rank1_row_chunk import rowdecay as RD  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from helpers import assert_within, kernel_errors, kernel_inputs, rel_rms as rel  # noqa: E402
from test_kernels_rank1_row_chunk import TOL, _as_ref, _general, _only_this_family, decay_errors  # noqa: E402

# a held-out composition: a decay per value channel (one per row of S), Longhorn's implicit step
CHANNEL = {"proximity": "channel_decay", "data": "regression", "step": "per_channel", "update": "implicit"}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(RC, "POISON", True)
    monkeypatch.setattr(RC, "CHUNK", 16)
    monkeypatch.setattr(RC, "ROWS", 16)


def _row_decays(shape, decay, g):
    """Float64 decays of ``shape``: "ordinary" in (0.3, 1); "low" in (0.06, 0.1), just above
    e^LOG_EXACT_DA (mild, but 16 of them span more than ``rowdecay.FAST_SPAN``); "tiny" as
    ``checking.tiny_decays`` draws them (below 1e-6, 15 % exact zeros, half ordinary mixed in), different
    in every row; "mixed": ordinary, with tiny ones (as "tiny") in the first 16 tokens and, in tokens 16 to
    31, in the rows from 16 on: chunks of 16 and row blocks of 16 where the scaled products run and where
    the walks do (``rowdecay.mild_chunk``), in one call."""
    a = 0.3 + 0.7 * torch.rand(shape, generator=g, dtype=torch.float64)
    if decay == "low":
        return 0.06 + 0.04 * torch.rand(shape, generator=g, dtype=torch.float64)
    if decay in ("tiny", "mixed"):
        tiny = torch.exp(-14 - 50 * torch.rand(shape, generator=g, dtype=torch.float64))
        tiny = torch.where(torch.rand(shape, generator=g) < 0.15, torch.zeros_like(tiny), tiny)
        where = torch.rand(shape, generator=g) < 0.5
        if decay == "mixed":
            where[:, 16:] = False
            where[:, 16:32, :, 16:] = True
        a = torch.where(where, tiny, a)
    return a


# (T, C, R, V, modes of c, p, oc, oh, decays): several chunks cut mid-chunk, one token, chunks of 32,
# several row blocks (the last cut), per-head and constant coefficients, tiny and zero decays
CASES = [
    (37, 16, 16, 20, ("row", "row", "const", "row"), "ordinary"),
    (1, 16, 16, 12, ("row", "row", "const", "const"), "ordinary"),
    (40, 32, 16, 12, ("row", "row", "const", "const"), "ordinary"),
    (23, 16, 16, 40, ("head", "row", "const", "head"), "ordinary"),
    (19, 16, 32, 20, ("row", "head", "const", "row"), "ordinary"),
    (17, 16, 16, 12, ("const", "const", "const", "const"), "ordinary"),
    (37, 16, 16, 20, ("row", "row", "const", "row"), "tiny"),
    (50, 32, 16, 20, ("head", "row", "const", "const"), "tiny"),
    (37, 16, 16, 20, ("row", "row", "const", "row"), "mixed"),
    (45, 16, 16, 20, ("row", "head", "const", "const"), "mixed"),
    (37, 16, 16, 20, ("row", "row", "const", "const"), "low"),
    (40, 32, 16, 12, ("row", "row", "const", "const"), "low"),
]


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("T,C,R,V,modes,decay", CASES)
def test_row_decay_matches_reference(T, C, R, V, modes, decay, split, monkeypatch):
    """A per-row decay with one key against the float64 recurrence: output, final state and every
    gradient (the decay's and the initial state's included), outputs and the forward's flags poisoned,
    with the backward split in two kernels (``ROW_DECAY_SPLIT``) and as one."""
    monkeypatch.setattr(RC, "ROW_DECAY_SPLIT", split)
    monkeypatch.setattr(RC, "CHUNK", C)
    monkeypatch.setattr(RC, "ROWS", R)
    B, H, K = 2, 2, 8
    keys, rows, S0 = _general(B, T, H, K, V, modes, seed=T)
    keys = [keys[0]] * 3 + keys[3:]
    a = _row_decays((B, T, H, V), decay, torch.Generator().manual_seed(T + 1))
    errs = decay_errors(keys, a, rows, S0)
    assert_within(errs, TOL)


def test_scaled_products_run_per_chunk_and_row_block(monkeypatch):
    """The scaled products (``ROW_DECAY_FAST``) change the output's last bits exactly where a chunk of a
    row block is mild: with the "mixed" decays, the first chunk (tiny decays in every row) and the second
    chunk's second row block (tiny ones there) equal the walks' output bit for bit, the other chunks and
    row blocks do not; both within the float64 tolerance (``test_row_decay_matches_reference``)."""
    B, T, H, K, V = 1, 37, 2, 8, 20
    keys, rows, S0 = _general(B, T, H, K, V, ("row", "row", "const", "const"), seed=8)
    a = _row_decays((B, T, H, V), "mixed", torch.Generator().manual_seed(9)).float()
    k, oq = keys[0].float(), keys[3].float()
    ys = []
    for fast in (True, False):
        monkeypatch.setattr(RC, "ROW_DECAY_FAST", fast)
        with torch.no_grad():
            ys.append(RC.rank1_row_chunk(k, k, k, oq, rows[0].float(), rows[1].float(), initial_state=S0.float(),
                                         a=a)[0])
    same = ys[0] == ys[1]
    assert bool(same[:, :16].all()) and bool(same[:, 16:32, :, 16:].all())
    assert not bool(same[:, 16:32, :, :16].all()) and not bool(same[:, 32:].all())


def test_split_backward_runs_each_program_on_its_path(monkeypatch):
    """The split backward (``ROW_DECAY_SPLIT``): with tiny decays only in head 1's second row block and
    second chunk, the forward's flags (poisoned first) say "every chunk mild" for the other three
    (head, row block) programs and not for that one; the products-only kernel writes exactly those three
    (the decay's gradient still NaN-poisoned in the fourth after it) and walks no chunk, the mixed kernel
    the fourth, its one chunk with tiny decays walked and its two others as products; every gradient
    equals the one kernel's bit for bit, and the last chunk of every program (mild) differs from the
    walks' (products there in both kernels). With every flag forced to 1, the products-only kernel takes
    products in every chunk of all four (the walks not in it)."""
    B, T, H, K, V = 1, 37, 2, 8, 20                 # chunks of 16, row blocks of 16: 2 x 2 programs
    keys, rows, S0 = _general(B, T, H, K, V, ("row", "row", "const", "const"), seed=8)
    g = torch.Generator().manual_seed(9)
    a = _row_decays((B, T, H, V), "ordinary", g)
    a[:, 16:32, 1, 16:] = _row_decays((B, 16, V - 16), "tiny", g)
    a = a.float()
    k, oq, c, p, h0 = keys[0].float(), keys[3].float(), rows[0].float(), rows[1].float(), S0.float()
    flags, after_products, paths = [], [], []
    real_flags, real_launch = RC.row_flags, RC.launch
    chunk_calls = {path: [] for path in (RD.PATH_PRODUCTS.value, RD.PATH_MIXED.value)}

    def spy_flags(*args):
        f = real_flags(*args)
        assert bool((f == -1).all())
        flags.append(f)
        return f

    def spy_launch(kernel, grid, *args, **kw):
        paths.append(kw.get("PATH"))
        if forced and kw.get("PATH") == RD.PATH_PRODUCTS.value:
            args[15].fill_(1)                           # the flags
        real_launch(kernel, grid, *args, **kw)
        if kw.get("PATH") == RD.PATH_PRODUCTS.value:
            after_products.append(args[11].clone())   # da

    def spy_chunk(name):         # under the interpreter the kernels call the module's functions
        real = getattr(RD, name)

        def call(*args):
            if paths[-1] in chunk_calls:
                chunk_calls[paths[-1]].append(name)
            return real(*args)
        monkeypatch.setattr(RD, name, call)
    monkeypatch.setattr(RC, "row_flags", spy_flags)
    monkeypatch.setattr(RC, "launch", spy_launch)
    spy_chunk("scaled_adjoints")
    spy_chunk("decayed_adjoints")

    def grads(fast, split):
        monkeypatch.setattr(RC, "ROW_DECAY_FAST", fast)
        monkeypatch.setattr(RC, "ROW_DECAY_SPLIT", split)
        leaves = [x.clone().requires_grad_() for x in (k, oq, a, c, p, h0)]
        y, S = RC.rank1_row_chunk(leaves[0], leaves[0], leaves[0], leaves[1], *leaves[3:5],
                                  initial_state=leaves[5], output_final_state=True, a=leaves[2])
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(10))
        return torch.autograd.grad((y * dy).sum() + S.sum(), leaves)
    forced = False
    split, one, walks = grads(True, True), grads(True, False), grads(False, False)
    assert len(flags) == 1 and flags[0].tolist() == [1, 1, 1, 0]
    assert len(after_products) == 1
    # 3 programs x 3 chunks as products; 1 program: chunks 2 and 0 as products, chunk 1 walked
    assert chunk_calls[RD.PATH_PRODUCTS.value] == ["scaled_adjoints"] * 9
    assert chunk_calls[RD.PATH_MIXED.value] == ["scaled_adjoints", "decayed_adjoints", "scaled_adjoints"]
    nan = torch.isnan(after_products[0])
    assert bool(nan[:, :, 1, 16:].all()) and not bool(nan[:, :, 0].any()) and not bool(nan[:, :, 1, :16].any())
    assert all(torch.equal(x, r) for x, r in zip(split, one))
    da, da_walks = split[2], walks[2]
    for h, r in ((0, slice(0, 16)), (0, slice(16, V)), (1, slice(0, 16)), (1, slice(16, V))):
        assert not torch.equal(da[:, 32:, h, r], da_walks[:, 32:, h, r])
    assert all(bool(torch.isfinite(x).all()) for x in split)
    # every flag forced to 1: the products-only kernel takes the fourth program too, products in every chunk
    forced = True
    chunk_calls[RD.PATH_PRODUCTS.value].clear()
    grads(True, True)
    assert chunk_calls[RD.PATH_PRODUCTS.value] == ["scaled_adjoints"] * 12


def test_row_decay_no_grad_path_and_refusals():
    """Inference returns no state and the training call's output; a per-row decay with three keys or a
    readout scale that is a tensor is refused with the reason."""
    B, T, H, K, V = 1, 21, 2, 8, 16
    keys, rows, S0 = _general(B, T, H, K, V, ("row", "row", "const", "const"), seed=5)
    k, oq = keys[0].float(), keys[3].float()
    c, p = rows[0].float(), rows[1].float()
    a = _row_decays((B, T, H, V), "ordinary", torch.Generator().manual_seed(6)).float()
    y1, S1 = RC.rank1_row_chunk(k, k, k, oq, c, p, initial_state=S0.float(), output_final_state=True, a=a)
    with torch.no_grad():
        y2, S2 = RC.rank1_row_chunk(k, k, k, oq, c, p, initial_state=S0.float(), a=a)
    assert S2 is None and torch.equal(y1, y2)
    with pytest.raises(ValueError, match="per-row decay a .* takes one key"):
        RC.rank1_row_chunk(k, keys[1].float(), k, oq, c, p, a=a)
    with pytest.raises(ValueError, match="constant readout scale"):
        RC.rank1_row_chunk(k, k, k, oq, c, p, oc=torch.ones(B, T, H), a=a)


def test_supports_per_row_decays():
    """wd_longhorn and a per-channel decay composed with Longhorn's step run here; a per-row decay with a
    readout scale per row does not (the reason says why); a decay per key neither."""
    assert RC.supports(ssmcraft.compile("wd_longhorn").ir) is None
    assert RC.supports(ssmcraft.compile(compose_objective(CHANNEL)).ir) is None
    spec = dict(compose_objective(CHANNEL), name="gated_readout", output="diag(o)*S*q")
    spec["inputs"] = dict(spec["inputs"], o={"shape": ["d"]})
    assert RC.supports(ssmcraft.compile(spec).ir) == ("a per-row decay runs with one key and a constant readout "
                                                      "scale only: the readout scale oc is not a constant")
    assert "per key" in RC.supports(ssmcraft.compile(compose_objective(dict(CHANNEL, proximity="diagonal_decay"))).ir)


def test_row_decay_dispatch(monkeypatch):
    """On CUDA wd_longhorn and the held-out per-channel decay go to this family ahead of rank1_row
    (``ROW_DECAY_AHEAD``, measured faster with the mild chunks' products); off, rank1_row runs them."""
    from ssmcraft.ops import registry

    def first(spec):
        ir = ssmcraft.compile(spec).ir
        return next(f.name for f in registry.order(ir, "triton") if not f.one_token and f.reason(ir) is None)
    assert first("wd_longhorn") == first(compose_objective(CHANNEL)) == "rank1_row_chunk"
    monkeypatch.setattr(RC, "ROW_DECAY_AHEAD", False)
    assert first("wd_longhorn") == first(compose_objective(CHANNEL)) == "rank1_row"


@pytest.mark.parametrize("name,T", [("wd_longhorn", 1), ("wd_longhorn", 35), ("channel", 33)])
def test_row_decay_objectives_through_obj(name, T, monkeypatch):
    """wd_longhorn (a = 1 / (1 + lam) per row) and the held-out per-channel decay through ``obj()`` on
    this family (the prologue's computed slots, k read once): output, final state and every gradient
    against the objective's float64 reference."""
    from ssmcraft.runtime.checking import reference_errors
    _only_this_family(monkeypatch)
    obj = ssmcraft.compile(compose_objective(CHANNEL) if name == "channel" else name)
    obj.prefer = "interpret"
    calls, real = [], RC._Rank1RowChunkFunction.apply
    monkeypatch.setattr(RC._Rank1RowChunkFunction, "apply", lambda *a: calls.append(a) or real(*a))
    ins, params, S0, g = kernel_inputs(obj, 2, T, 2, 20, 8, seed=T)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0, g)
    assert calls[0][0] is calls[0][1] is calls[0][2] and calls[0][4].dim() == 4
    assert obj.backend == "triton-interpret:rank1-row-chunk+prologue"
    assert cmp.written, cmp.errors
    assert {"dk", "dx", "dbeta", "dq", "dS0", "S_T"} <= set(cmp.errors), cmp.errors
    assert ("dlam" if name == "wd_longhorn" else "dalpha") in cmp.errors, cmp.errors
    assert_within(cmp.errors, TOL)


def test_wd_longhorn_on_reference_layout():
    """The exported module's path (the generated coefficients on the reference layout)."""
    obj = ssmcraft.compile("wd_longhorn")
    ins, params, S0, g = kernel_inputs(obj, 2, 33, 2, 20, 8, seed=6)
    assert_within(kernel_errors(obj, lambda o, lay: RC.forward(o, lay, o.module.coefficients(lay.env, lay.d, lay.m),
                                                               True), ins, params, S0, g), TOL)


def test_packed_row_decay_equals_separate(monkeypatch):
    """The per-channel decay on a packed row through ``obj()`` (lengths under, at and across chunks of 16,
    empty sequences first and in the middle): equal to the separate float64 reference calls, every
    gradient, outputs poisoned."""
    from ssmcraft.runtime.checking import compare, packed_reference
    from test_varlen import _interpret, packed_inputs
    _only_this_family(monkeypatch)
    obj = ssmcraft.compile(compose_objective(CHANNEL))
    lens = [0, 17, 5, 0, 16, 35]
    ins, params, S0, cu, g = packed_inputs(obj, lens, d=20, m=8)
    ref = packed_reference(obj, ins, params, S0, cu, g)
    errs = compare(ref, lambda i, p, s: _interpret(obj, i, p, s, cu), torch.float32).errors
    assert obj.backend == "triton-interpret:rank1-row-chunk+prologue+packed"
    assert {"dk", "dx", "dbeta", "dalpha", "dS0", "S_T"} <= set(errs), errs
    assert_within(errs, TOL)


def test_packed_tiny_row_decays_equal_separate():
    """The kernels on a packed row (``cu_seqlens``: lengths under, at and across chunks of 16, empty
    sequences first and in the middle) with tiny and zero decays among ordinary ones, against the float64
    recurrence run on each sequence alone: outputs, final states and every gradient. (Objectives with a
    per-row decay derive terms such as ``c x / alpha``, whose own float64 reference is NaN at 0.)"""
    lens = [0, 17, 5, 0, 16, 35]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    N, T, H, K, V = len(lens), sum(lens), 2, 8, 20
    keys, rows, _ = _general(1, T, H, K, V, ("row", "head", "const", "row"), seed=9)
    k, oq = keys[0], keys[3]
    S0 = torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    a = _row_decays((1, T, H, V), "tiny", torch.Generator().manual_seed(11))
    leaves = [k, oq, a, rows[0], rows[1], rows[3], S0]
    for x in leaves:
        x.requires_grad_()
    ys, Ss = [], []
    for i in range(N):
        s = slice(int(cu[i]), int(cu[i + 1]))
        if lens[i] == 0:            # an empty sequence: its final state is its initial one
            Ss.append(S0[i:i + 1])
            continue
        y_i, S_i = naive_recurrent_rank1_row(k[:, s], k[:, s], k[:, s], oq[:, s], a[:, s],
                                             *[_as_ref(x if x is None or not isinstance(x, torch.Tensor) else x[:, s],
                                                       1, lens[i], H, V, j == 3) for j, x in enumerate(rows)],
                                             S0[i:i + 1])
        ys.append(y_i)
        Ss.append(S_i)
    y_ref, S_ref = torch.cat(ys, 1), torch.cat(Ss, 0)
    g = torch.Generator().manual_seed(12)
    dy = torch.randn(y_ref.shape, generator=g, dtype=torch.float64)
    dS = torch.randn(S_ref.shape, generator=g, dtype=torch.float64)
    ref_g = torch.autograd.grad((y_ref * dy).sum() + (S_ref * dS).sum(), leaves)
    assert all(bool(torch.isfinite(x).all()) for x in ref_g)
    f32 = [x.detach().float().requires_grad_() for x in leaves]
    fk, foq, fa, fc, fp, foh, fS0 = f32
    y, S = RC.rank1_row_chunk(fk, fk, fk, foq, fc, fp, rows[2], foh, initial_state=fS0, output_final_state=True,
                              cu_seqlens=cu, a=fa)
    got = torch.autograd.grad((y.double() * dy).sum() + (S.double() * dS).sum(), f32)
    errs = {"y": rel(y, y_ref), "S_T": rel(S, S_ref)}
    errs.update({f"d{n}": rel(x, r) for n, x, r in zip(("k", "oq", "a", "c", "p", "oh", "S0"), got, ref_g)})
    assert_within(errs, TOL)


@pytest.mark.parametrize("decay", [None, "head", "row"])
def test_atomic_key_sums_equal_the_host_sums(decay, monkeypatch):
    """Two row blocks adding their key gradients into one buffer (``ATOMIC_KEYS``) give the host's sum of
    their partials bit for bit (0 + x + y is x + y), with no decay, a per-head or a per-row one."""
    B, T, H, K, V = 1, 37, 2, 8, 20                 # 20 rows in blocks of 16: two row blocks
    keys, rows, S0 = _general(B, T, H, K, V, ("row", "row", "const", "const"), seed=3)
    g = torch.Generator().manual_seed(4)
    a = None if decay is None else _row_decays((B, T, H, V) if decay == "row" else (B, T, H), "ordinary", g).float()
    k, oq = keys[0].float(), keys[3].float()
    out = []
    for atomic in (True, False):
        monkeypatch.setattr(RC, "ATOMIC_KEYS", atomic)
        kk, qq = k.clone().requires_grad_(), oq.clone().requires_grad_()
        y, S = RC.rank1_row_chunk(kk, kk, kk, qq, rows[0].float(), rows[1].float(), initial_state=S0.float(),
                                  output_final_state=True, a=a)
        out.append(torch.autograd.grad(y.sum() + S.sum(), [kk, qq]))
    assert all(torch.equal(x, r) for x, r in zip(*out))
    assert all(bool(torch.isfinite(x).all()) and bool(x.abs().sum() > 0) for x in out[0])
