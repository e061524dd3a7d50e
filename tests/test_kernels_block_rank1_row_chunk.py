"""The chunked block rank-1 family (``ssmcraft/ops/block_rank1_row_chunk/``: two states updated by one
rank-1 step of an extrapolated state, the state weights per head) under the Triton interpreter,
against float64: the per-head chunk weights against the products of transitions written out; the
public function against the readable loop (``block_rank1_row``'s ``naive.py``) under float64 autograd
(output, both final states, every gradient: keys, row coefficients per row, per head and constant,
every per-head state weight, both initial states, with cotangents on both final states); Longhorn
with momentum and held-out composed objectives of the class through ``obj()`` against the derived
update's float64 reference; outputs poisoned with NaN, lengths cut mid-chunk, several row blocks; what
the family refuses, by name, and where the dispatch puts it."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops import registry  # noqa: E402
from ssmcraft.ops.block_rank1_row.naive import naive_block_rank1  # noqa: E402
from ssmcraft.ops.block_rank1_row_chunk import chunk as CH  # noqa: E402
from ssmcraft.ops.block_rank1_row_chunk import weights as W  # noqa: E402
from ssmcraft.runtime.checking import reference_errors  # noqa: E402
from helpers import assert_within, random_inputs, rel_rms  # noqa: E402
from test_compiler_blockrank1 import _BASE, HELD_OUT  # noqa: E402
from test_compiler_multistate import ALL  # noqa: E402

# relative RMS error: fp32 kernels (tf32x3 products) vs float64 references, as block_rank1_row's tests
TOL = {"y": 1e-5, "D_T": 1e-5, "S_T": 1e-5, "grad": 5e-5}
# held out of the library: a per-head decay of the state the step starts from, the readout of both states
HEAD_DECAY = {"name": "momentum_head_decay", "state": {"D": ["d", "m"], "S": ["d", "m"]},
              "inputs": {**_BASE, "g": {"shape": [], "bounded": True}},
              "objective": {"D": "sq(D - mu*D_prev)/2 + wsq((g*S_prev + D)*k - x, beta)/2",
                            "S": "sq(S - g*S_prev - D)/2"},
              "update": "implicit", "output": "S*q + D*q"}
# held out: an explicit delta-rule step with a per-head step and a per-head momentum (c per head)
HEAD_DELTA = {**HELD_OUT["momentum_delta"], "name": "momentum_head_delta",
              "inputs": {**HELD_OUT["momentum_delta"]["inputs"], "mu": {"shape": [], "bounded": True}}}
SPECS = {"momentum_longhorn": "momentum_longhorn", "momentum_head_decay": HEAD_DECAY, "momentum_head_delta": HEAD_DELTA,
         "explicit_step": ALL["explicit_step"]}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(CH, "POISON", True)
    monkeypatch.setattr(CH, "CHUNK", 16)
    for name in ("ROWS", "STATE_ROWS", "GRAD_ROWS"):
        monkeypatch.setattr(CH, name, 16)


@pytest.mark.parametrize("how,tol", [("torch", 1e-15), ("triton", 1e-6)])
def test_weights_are_the_products_of_transitions(how, tol):
    """G, g, Hm, h, E, F of ``weights.chunk_weights`` against the products of the per-head transitions
    written out token by token, over two chunks, the second cut (T = 7, C = 4): the torch form in float64
    (exact), the kernels in fp32."""
    g = torch.Generator().manual_seed(0)
    B, T, H, C = 1, 7, 2, 4
    rnd = lambda: torch.rand(B, T, H, generator=g, dtype=torch.float64)  # noqa: E731
    A = [[rnd(), rnd()], [rnd(), rnd()]]
    e, w, r = (rnd(), rnd()), (rnd(), 1.0), (0.0, rnd())
    G, Hm, gv, hv, E, F = (x.double() for x in W.chunk_weights(A, e, w, r, B, T, H, C, A[0][0], torch.float64, how))

    def at(x, t, h):
        return torch.tensor([float(x[i][0, t, h]) if isinstance(x[i], torch.Tensor) else x[i] for i in range(2)],
                            dtype=torch.float64)

    def phi(c, k, j, h):      # the states after step k of chunk c from those after step j
        M = torch.eye(2, dtype=torch.float64)
        for s in range(j, k):
            t = c * C + s
            M = (torch.tensor([[float(A[a][b][0, t, h]) for b in range(2)] for a in range(2)], dtype=torch.float64)
                 if t < T else torch.eye(2, dtype=torch.float64)) @ M
        return M
    for h in range(H):
        for c in range(2):
            toks = [s for s in range(C) if c * C + s < T]
            for s in toks:
                t = c * C + s
                assert torch.allclose(gv[0, h, c, :, s], phi(c, s, 0, h).T @ at(e, t, h), rtol=0, atol=tol)
                assert torch.allclose(hv[0, h, c, :, s], phi(c, s + 1, 0, h).T @ at(r, t, h), rtol=0, atol=tol)
                assert torch.allclose(E[0, h, c, :, s], phi(c, C, s + 1, h) @ at(w, t, h), rtol=0, atol=tol)
                for s2 in toks:
                    wt = at(w, c * C + s2, h)
                    ref_g = at(e, t, h) @ phi(c, s, s2 + 1, h) @ wt if s2 < s else torch.tensor(0.)
                    ref_h = at(r, t, h) @ phi(c, s + 1, s2 + 1, h) @ wt if s2 <= s else torch.tensor(0.)
                    assert abs(float(G[0, h, c, s, s2] - ref_g)) <= tol
                    assert abs(float(Hm[0, h, c, s, s2] - ref_h)) <= tol
            assert torch.allclose(F[0, h, c].view(2, 2), phi(c, C, 0, h), rtol=0, atol=tol)


def test_weight_kernels_gradients():
    """The weights kernels' backward (fp32) against torch autograd through the torch form in float64: every
    per-head coefficient's gradient under random cotangents of all six weights, a chunk cut (T = 21, C = 16)."""
    g = torch.Generator().manual_seed(2)
    B, T, H, C = 2, 21, 2, 16
    leaves = [0.2 + 0.8 * torch.rand(B, T, H, generator=g, dtype=torch.float64) for _ in range(10)]
    cot = None
    grads = []
    for how, dtype in (("torch", torch.float64), ("triton", torch.float32)):
        xs = [x.detach().to(dtype).requires_grad_() for x in leaves]
        A = [[xs[0], xs[1]], [xs[2], xs[3]]]
        out = W.chunk_weights(A, (xs[4], xs[5]), (xs[6], xs[7]), (xs[8], xs[9]), B, T, H, C, xs[0], dtype, how)
        if cot is None:
            cot = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in out]
        loss = sum((o.double() * c).sum() for o, c in zip(out, cot))
        grads.append(torch.autograd.grad(loss, xs))
    errs = [rel_rms(a, b) for a, b in zip(grads[1], grads[0])]
    assert max(errs) < 1e-5, errs


def _leaves(B, T, H, K, V, c_mode, p_mode, seed):
    """Float64 leaves: four distinct keys, a full per-head transition (a01 != 0), per-head extrapolation,
    write and read weights, c and p per row ("row"), per head ("head") or constant, two initial states."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    u01 = lambda lo, hi: lo + (hi - lo) * torch.rand(B, T, H, generator=g, dtype=torch.float64)  # noqa: E731
    keys = [torch.nn.functional.normalize(r(B, T, H, K), dim=-1) for _ in range(3)] + [r(B, T, H, K)]
    heads = {"a00": u01(0.2, 0.8), "a01": u01(0., 0.2), "a10": u01(0.2, 0.8), "a11": u01(0.5, 1.), "e0": u01(0.2, 0.8),
             "e1": u01(0.5, 1.), "w0": u01(0.5, 1.), "w1": 0.5, "ro0": u01(0., 1.), "ro1": 1.0}
    shape = {"row": (B, T, H, V), "head": (B, T, H)}
    c = 0.3 if c_mode == "const" else torch.rand(*shape[c_mode], generator=g, dtype=torch.float64)
    p = -0.7 if p_mode == "const" else r(*shape[p_mode])
    return keys, heads, c, p, [r(B, H, K, V) for _ in range(2)]


def _naive(keys, heads, c, p, S0):
    """``naive_block_rank1`` on the public function's arguments (FLA layout in and out)."""
    row = lambda x: x[..., None] if x.dim() == 4 else x[..., None, None]  # noqa: E731
    co = {s: row(x) if isinstance(x, torch.Tensor) else x for s, x in {**heads, "c": c, "p": p}.items()}
    co.update({s: x[..., None, :] for s, x in zip(("u", "v", "q", "oq"), keys)})
    co["oc"] = 1.0
    y, S = naive_block_rank1(co, 2, tuple(s.transpose(-1, -2) for s in S0))
    return y, tuple(s.transpose(-1, -2) for s in S)


@pytest.mark.parametrize("T,c_mode,p_mode,single", [(21, "row", "head", False), (5, "head", "row", False),
                                                    (32, "row", "const", False), (17, "const", "row", False),
                                                    (21, "row", "row", True), (7, "head", "head", True)])
@pytest.mark.parametrize("atomic,split", [(True, True), (False, True), (True, False), (False, False)])
def test_public_function_against_float64_autograd(T, c_mode, p_mode, single, atomic, split, monkeypatch):
    """Output, both final states and every gradient against the readable loop in float64: lengths cut
    mid-chunk (21, 17: chunks of 16), one short chunk (5, 7) and exact chunks (32); d = 20 rows on blocks
    of 16 (the last one partly past the rows): the key, per-head and weight gradients are sums over the
    blocks, added by the blocks into one buffer (``atomic``: ``ATOMIC_SUMS``) or summed on the host. The
    backward as a state pass then one program per chunk (``split``: ``SPLIT_BWD``, for T > 16) or one walk.
    ``single``: u, v and q one tensor (the kernels' ``ONE_KEY`` form, as Longhorn's k), its gradient the
    three slots' sum."""
    monkeypatch.setattr(CH, "ATOMIC_SUMS", atomic)
    monkeypatch.setattr(CH, "SPLIT_BWD", split)
    B, H, K, V = 1, 2, 8, 20
    keys, heads, c, p, S0 = _leaves(B, T, H, K, V, c_mode, p_mode, seed=T)
    if single:
        keys = [keys[0]] * 3 + keys[3:]
    g = torch.Generator().manual_seed(T + 1)
    dy = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    dS = [torch.randn(B, H, K, V, generator=g, dtype=torch.float64) for _ in range(2)]
    names = ["u", "v", "q", "oq", *[s for s, x in heads.items() if isinstance(x, torch.Tensor)], "c", "p", "X0", "X1"]
    leaves = [*keys, *[x for x in heads.values() if isinstance(x, torch.Tensor)], c, p, *S0]
    leaves = [x if isinstance(x, torch.Tensor) and not (single and n in ("v", "q")) else None
              for n, x in zip(names, leaves)]
    outs = []
    for naive, dtype in ((True, torch.float64), (False, torch.float32)):
        xs = [None if x is None else x.detach().to(dtype).requires_grad_() for x in leaves]
        it = iter(xs[4:4 + sum(isinstance(x, torch.Tensor) for x in heads.values())])
        hd = {s: next(it) if isinstance(x, torch.Tensor) else x for s, x in heads.items()}
        cc, pp = (xs[-4] if xs[-4] is not None else c), (xs[-3] if xs[-3] is not None else p)
        ks = [xs[0]] * 3 + [xs[3]] if single else xs[:4]
        if naive:
            y, S = _naive(ks, hd, cc, pp, xs[-2:])
        else:
            y, S = CH.block_rank1_chunk(*ks, cc, pp, hd, initial_state=xs[-2:], output_final_state=True)
        loss = (y.double() * dy).sum() + sum((s.double() * d).sum() for s, d in zip(S, dS))
        wrt = [x for x in xs if x is not None]
        outs.append((y, S, torch.autograd.grad(loss, wrt)))
    (y_ref, S_ref, g_ref), (y, S, g_got) = outs
    assert torch.isfinite(y).all() and rel_rms(y, y_ref) < TOL["y"]
    assert all(rel_rms(a, b) < TOL["S_T"] for a, b in zip(S, S_ref))
    got_names = [n for n, x in zip(names, leaves) if x is not None]
    errs = {n: rel_rms(a, b) for n, a, b in zip(got_names, g_got, g_ref)}
    assert set(got_names) >= {"u", "oq", "a00", "a01", "a10", "a11", "e0", "e1", "w0", "ro0", "X0", "X1"}
    assert all(e < TOL["grad"] for e in errs.values()), errs


@pytest.mark.parametrize("states_bf16", [True, False])
@pytest.mark.parametrize("split", [True, False])
def test_bf16_io_against_float64(states_bf16, split, monkeypatch):
    """bf16 keys, row coefficients and output (the kernels' products in fp32 from bf16 loads) against
    float64: the chunk states handed between the passes stored bf16 (``STATES_BF16``) or fp32, every
    gradient within the chunked kernels' bf16 tolerance (``benchmarks/checks.py``'s ``TOL_CHUNKED``), T = 37
    (three chunks, the last cut), the backward in two passes (``split``) or one walk."""
    monkeypatch.setattr(CH, "STATES_BF16", states_bf16)
    monkeypatch.setattr(CH, "SPLIT_BWD", split)
    B, T, H, K, V = 1, 37, 2, 16, 20
    keys, heads, c, p, S0 = _leaves(B, T, H, K, V, "row", "row", seed=11)
    keys = [keys[0]] * 3 + keys[3:]
    g = torch.Generator().manual_seed(12)
    dy = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    dS = [torch.randn(B, H, K, V, generator=g, dtype=torch.float64) for _ in range(2)]
    leaves = [keys[0], keys[3], heads["a00"], c, p, *S0]
    states = []       # the dtypes of the [B, H, NC, 2, K, V] buffers: hs, then the state pass's dxs
    real = CH._new
    monkeypatch.setattr(CH, "_new", lambda shape, *a: (len(shape) == 6 and states.append(a[1])) or real(shape, *a))
    outs = []
    for naive, dtype in ((True, torch.float64), (False, torch.bfloat16)):
        xs = [x.detach().to(dtype if i in (0, 1, 3, 4) else torch.float64 if naive else torch.float32).requires_grad_()
              for i, x in enumerate(leaves)]
        hd = {**heads, "a00": xs[2]}
        ks = [xs[0]] * 3 + [xs[1]]
        y, S = (_naive(ks, hd, xs[3], xs[4], xs[5:]) if naive else
                CH.block_rank1_chunk(*ks, xs[3], xs[4], hd, initial_state=xs[5:], output_final_state=True))
        loss = (y.double() * dy).sum() + sum((s.double() * d).sum() for s, d in zip(S, dS))
        outs.append((y, S, torch.autograd.grad(loss, xs)))
    assert states == [torch.bfloat16 if states_bf16 else torch.float32] * (2 if split else 1)
    (y_ref, S_ref, g_ref), (y, S, g_got) = outs
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    errs = {"y": rel_rms(y, y_ref), **{f"S{i}": rel_rms(a, b) for i, (a, b) in enumerate(zip(S, S_ref))},
            **{n: rel_rms(a, b) for n, a, b in zip(("k", "oq", "a00", "c", "p", "X0", "X1"), g_got, g_ref)}}
    assert all(e < 3e-2 for e in errs.values()), errs


def test_without_states():
    """No initial state, no final state: the forward starts at zero and the backward runs with the
    output's cotangent only."""
    B, T, H, K, V = 2, 19, 1, 8, 16
    keys, heads, c, p, _ = _leaves(B, T, H, K, V, "row", "row", seed=3)
    zeros = [torch.zeros(B, H, K, V, dtype=torch.float64)] * 2
    y_ref, _ = _naive(keys, heads, c, p, zeros)
    xs = [x.float().requires_grad_() for x in keys]
    y, S = CH.block_rank1_chunk(*xs, c.float(), p.float(), {s: x.float() if isinstance(x, torch.Tensor) else x
                                                            for s, x in heads.items()})
    assert S is None and rel_rms(y, y_ref) < TOL["y"]
    dy = torch.randn(B, T, H, V, dtype=torch.float64)
    (y.double() * dy).sum().backward()
    ks = [x.detach().requires_grad_() for x in keys]
    ((_naive(ks, heads, c, p, zeros)[0] * dy).sum()).backward()
    assert all(rel_rms(a.grad, b.grad) < TOL["grad"] for a, b in zip(xs, ks))


def _only_this_family(monkeypatch):
    from ssmcraft.runtime import select as TB
    monkeypatch.setattr(TB, "order", lambda ir, mode: [registry.family("block_rank1_row_chunk")])


@pytest.mark.parametrize("name,T", [("momentum_longhorn", 35), ("momentum_longhorn", 9),
                                    ("momentum_head_decay", 21), ("momentum_head_delta", 13),
                                    ("explicit_step", 18)])
def test_through_obj(name, T, monkeypatch):
    """Longhorn with momentum and held-out composed objectives of the class (a per-head decay read
    through the other state with a readout of both states; an explicit delta-rule step with a per-head
    step and momentum; the multistate tests' explicit step) through ``obj()`` on this family, against
    the derived update's float64 reference: output, both final states and every gradient (inputs, both
    initial states)."""
    _only_this_family(monkeypatch)
    obj = ssmcraft.compile(SPECS[name])
    ins, params = random_inputs(obj.spec, B=2, T=T, H=2, sizes={"d": 20, "m": 8}, seed=T)
    g = torch.Generator().manual_seed(T + 100)
    S0 = tuple(0.5 * torch.randn(2, 2, 20, 8, generator=g, dtype=torch.float64) for _ in obj.spec.states)
    obj.prefer = "interpret"
    calls, real = [], CH._BlockChunkFunction.apply
    monkeypatch.setattr(CH._BlockChunkFunction, "apply", lambda *a: calls.append(a) or real(*a))
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0, g)
    assert obj.backend.startswith("triton-interpret:block-rank1-row-chunk")
    assert calls[0][0] is calls[0][1] is calls[0][2]      # k in u, v and q: the kernels' ONE_KEY form
    assert [k for k in cmp.errors if k.endswith("_T")] == ["D_T", "S_T"]
    assert {"dD0", "dS0", "dk", "dx", "dq"} <= set(cmp.errors), cmp.errors
    if name == "momentum_longhorn":
        assert {"dmu", "dbeta"} <= set(cmp.errors)
    assert_within(cmp.errors, TOL)


def test_refuses_by_name():
    """Per-row state weights (a per-row decay or momentum: the products of transitions would differ per
    row), a single state and the general grid's forms are refused with the reason."""
    assert "per head" in CH.supports(ssmcraft.compile(HELD_OUT["momentum_decay"]).ir)
    assert "'a00' varies" in CH.supports(ssmcraft.compile(HELD_OUT["momentum_delta"]).ir)
    assert "several states" in CH.supports(ssmcraft.compile("longhorn").ir)
    assert "block rank-1" in CH.supports(ssmcraft.compile(ALL["grid10"]).ir)
    for name in SPECS.values():
        assert CH.supports(ssmcraft.compile(name).ir) is None


def test_dispatch_order(monkeypatch):
    """On CUDA the family goes ahead of block_rank1_row only where ``AHEAD``; the interpreter keeps the
    registry's order (block_rank1_row first); a per-row momentum stays on block_rank1_row."""
    def first(spec, mode):
        ir = ssmcraft.compile(spec).ir
        return next(f.name for f in registry.order(ir, mode) if not f.one_token and f.reason(ir) is None)
    monkeypatch.setattr(CH, "AHEAD", False)
    assert first("momentum_longhorn", "triton") == "block_rank1_row"
    monkeypatch.setattr(CH, "AHEAD", True)
    assert first("momentum_longhorn", "triton") == "block_rank1_row_chunk"
    assert first(HEAD_DECAY, "triton") == "block_rank1_row_chunk"
    assert first(HELD_OUT["momentum_delta"], "triton") == "block_rank1_row"
    assert first("momentum_longhorn", "interpret") == "block_rank1_row"


def test_tiny_and_zero_weights(monkeypatch):
    """Momentum and decay where a sigmoid reaches in training (below 1e-6, 15 % exact zeros, half of
    them ordinary among them): the chunk's products of transitions are formed by substitution, nothing
    divided or logged, so the output, both final states and every gradient stay as close to the float64
    reference as with ordinary values."""
    _only_this_family(monkeypatch)
    obj = ssmcraft.compile(HEAD_DECAY)
    B, T, H = 2, 37, 2
    ins, params = random_inputs(obj.spec, B=B, T=T, H=H, sizes={"d": 20, "m": 8}, seed=7)
    g = torch.Generator().manual_seed(8)
    for name in ("mu", "g"):
        a = torch.exp(-14 - 50 * torch.rand(B, T, H, generator=g, dtype=torch.float64))
        a = torch.where(torch.rand(B, T, H, generator=g) < 0.15, torch.zeros_like(a), a)
        ins[name] = torch.where(torch.rand(B, T, H, generator=g) < 0.5,
                                0.3 + 0.7 * torch.rand(B, T, H, generator=g, dtype=torch.float64), a)
    S0 = tuple(0.5 * torch.randn(B, H, 20, 8, generator=g, dtype=torch.float64) for _ in obj.spec.states)
    obj.prefer = "interpret"
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0, g)
    assert obj.backend.startswith("triton-interpret:block-rank1-row-chunk")
    assert {"dmu", "dg", "dD0", "dS0"} <= set(cmp.errors), cmp.errors
    assert_within(cmp.errors, TOL)


@pytest.mark.parametrize("split", [False, True])
def test_kernels_compile_for_sm90(split):
    """The family's kernels in their GPU form (``benchmarks/compile_sm90.py``, CPU only), as Longhorn with
    momentum's fwd+bwd launches them with the family ahead, fp32 and bf16 products: the backward in one
    walk, or (``split``: ``SPLIT_BWD``) the state pass and the per-chunk gradients."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    bench = os.path.join(root, "benchmarks")
    kernels = {"block_chunk_fwd_kernel", "block_chunk_bwd_kernel", "block_weights_fwd_kernel",
               "block_weights_bwd_kernel"} | ({"block_chunk_bwd_state_kernel"} if split else set())
    for dtype in ("bf16", "fp32"):
        code = (f"import sys; sys.path.insert(0, {bench!r}); import compile_sm90; "
                "from ssmcraft.ops.block_rank1_row_chunk import chunk; "
                f"chunk.SPLIT_BWD = {split}; "
                f"sys.exit(compile_sm90.main(['momentum_longhorn', '--block-chunk-ahead', '--dtype', {dtype!r}]))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
        assert out.returncode == 0, out.stdout + out.stderr[-2000:]
        rows = {line.split()[2]: line.split(None, 3)[3] for line in out.stdout.splitlines()}
        assert {k for k in rows if k.startswith("block_")} == kernels, out.stdout
        assert set(rows.values()) == {"ok"}, out.stdout
        assert "triton:block-rank1-row-chunk" in out.stdout


def test_packed_rows_refused_by_name():
    """No packed-sequence kernels: the family says so (``KernelFamily.varlen``), so ``runtime.packed``,
    which picks the first family whose ``varlen`` is None, never sends it a packed call."""
    fam = registry.family("block_rank1_row_chunk")
    assert fam.varlen is not None and "cu_seqlens" in fam.varlen


@pytest.mark.parametrize("K", [16, 64])
def test_dispatch_by_key_size(K, monkeypatch):
    """On CUDA the family refuses keys fewer than ``MIN_KEYS`` (block_rank1_row, measured faster there,
    runs them); the interpreter takes every size; the size check says why."""
    from ssmcraft.bench.run import random_inputs as bench_inputs
    monkeypatch.setattr(CH, "AHEAD", True)
    obj = ssmcraft.compile("momentum_longhorn")
    ins, _ = bench_inputs(obj, 1, 3, 1, 8, K, torch.float32, torch.device("cpu"))
    runs = [f.name for f in registry.order(obj.ir, "triton") if not f.one_token and f.reason(obj.ir, ins, "triton") is None]
    assert runs[0] == ("block_rank1_row_chunk" if K >= CH.MIN_KEYS else "block_rank1_row"), runs
    fam = registry.family("block_rank1_row_chunk")
    assert fam.reason(obj.ir, ins, "interpret") is None
    why = fam.size_reason(obj.ir, {"d": 8, "m": K}, "triton")
    assert (why is None) == (K >= CH.MIN_KEYS), why
    if why is not None:
        assert why == f"K = {K} < MIN_KEYS = {CH.MIN_KEYS} (block_rank1_row's per-token loop is faster with few keys)"
