"""Chunked rank-1 family with a per-key decay and a per-head step (a KDA-like layer, composed:
``diagonal_decay, regression, scalar step, decay_explicit``) under the Triton interpreter, against
the float64 reference: output, final state and every gradient (inputs, initial state; with a
gradient on the final state), buffers poisoned with NaN; held-out compositions of the class."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops import registry  # noqa: E402
import triton.language as tl  # noqa: E402

from ssmcraft.ops.common.tuning import warp_rule  # noqa: E402
from ssmcraft.ops.keydecay_chunk.decay_grad import DA_CONFIGS  # noqa: E402

from ssmcraft.ops.rank1_keydecay_chunk import chunk as R, kernels as KK  # noqa: E402
from ssmcraft.ops.rank1_keydecay_chunk.naive import naive_recurrent_rank1_keydecay  # noqa: E402
from ssmcraft.runtime import select as TB  # noqa: E402
from ssmcraft.runtime.checking import reference_errors  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from helpers import assert_within, kernel_errors, kernel_inputs, rel_rms as rel  # noqa: E402

# relative RMS error ||ours - ref|| / ||ref||, fp32 kernels vs float64 reference
TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5}

KDA = {"proximity": "diagonal_decay", "data": "regression", "keys": 1, "step": "scalar",
       "update": "decay_explicit", "normalize": True}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(R, "POISON", True)
    monkeypatch.setattr(R, "INTERPRET_BV", None)
    monkeypatch.setattr(R, "CHUNK", 64)


def _composed(tmp_path, **changes):
    spec = compose_objective({**KDA, **changes})
    import yaml
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return ssmcraft.compile(str(path))


def test_supports(tmp_path):
    assert R.supports(_composed(tmp_path).ir) is None
    assert R.supports(_composed(tmp_path, normalize=False).ir) is None
    assert "per key" in R.supports(ssmcraft.compile("gated_deltanet").ir)        # a per-head decay
    assert "rank1" in R.supports(ssmcraft.compile("gla").ir)
    assert "per head" in R.supports(_composed(tmp_path, step="per_channel").ir)   # beta over d
    assert R.supports_sizes(_composed(tmp_path).ir, {"m": R.MAX_K * 2}, "triton") is not None
    assert R._read_key_kind(_composed(tmp_path).ir) == R.AV         # u = alpha k: formed in the kernels


@pytest.mark.parametrize("changes,T,chunk", [
    ({}, 67, 64),                       # the KDA-like layer: two chunks, the second partial
    ({}, 7, 16),                        # T < chunk
    ({"normalize": False}, 40, 32),     # held out: keys not normalised
])
def test_composed_objective_matches_reference(tmp_path, monkeypatch, changes, T, chunk):
    monkeypatch.setattr(R, "CHUNK", chunk)
    obj = _composed(tmp_path, **changes)
    ins, params, S0, g = kernel_inputs(obj, 1, T, 2, 24, 16, seed=T)
    assert_within(kernel_errors(obj, lambda o, lay: R.forward(o, lay, o.module.coefficients(lay.env, lay.d, lay.m), True),
                                ins, params, S0, g), TOL)


def test_public_path_runs_the_family(tmp_path, monkeypatch):
    """``obj(...)`` picks the family under the interpreter (it is the only one that runs the
    structure) and matches the reference through the family's own ``prepare`` (computed u = alpha k)."""
    monkeypatch.setattr(R, "CHUNK", 16)
    obj = _composed(tmp_path)
    obj.prefer = "interpret"
    assert [f.name for f in TB.order(obj.ir, "interpret") if f.reason(obj.ir) is None] == ["decode", "rank1_keydecay_chunk"]
    ins, params, S0, g = kernel_inputs(obj, 2, 19, 2, 8, 16, seed=3)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0, g)
    assert obj.backend.startswith("triton-interpret:rank1-keydecay-chunk")
    assert cmp.written, cmp.errors
    assert_within(cmp.errors, {"y": 1e-5, "S_T": 1e-5, "grad": 5e-5})


def _kernel_case(T, K, V, read, strong, seed, scale=False):
    """Float64 kernel-level inputs; ``read``: the erase's read key, "own" (a tensor of its own),
    "v" (u = v) or "av" (u = a o v, formed in the kernels); ``scale``: p's per-head scale ps."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    nk = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    B, H = 1, 2
    return {"v": nk(r(B, T, H, K)), "u": nk(r(B, T, H, K)) if read == "own" else read, "p": r(B, T, H, V),
            "oq": r(B, T, H, K), "c": torch.rand(B, T, H, generator=g, dtype=torch.float64),
            "a": torch.sigmoid(1.0 + strong * r(B, T, H, K)), "h0": r(B, H, K, V),
            "ps": r(B, T, H) if scale else None}, g


def _run_both(ins, g, chunk):
    names = [n for n, t in ins.items() if isinstance(t, torch.Tensor)]
    ref = {n: ins[n].clone().requires_grad_() for n in names}
    ours = {n: ins[n].float().clone().requires_grad_() for n in names}
    u = {"v": (None, None), "av": (ref["a"] * ref["v"], R.AV)}.get(ins["u"]) or (ref["u"], ours["u"])
    p = ref["p"] * ref["ps"][..., None] if "ps" in ref else ref["p"]
    o, hT = naive_recurrent_rank1_keydecay(ref["v"], u[0], p, ref["oq"], ref["c"], ref["a"], ref["h0"])
    do, dh = torch.randn(o.shape, generator=g, dtype=torch.float64), torch.randn(hT.shape, generator=g, dtype=torch.float64)
    ((o * do).sum() + (hT * dh).sum()).backward()
    o2, h2 = R.chunk_rank1_keydecay(ours["v"], ours["p"], ours["c"], ours["oq"], ours["a"], u=u[1], ps=ours.get("ps"),
                                    initial_state=ours["h0"], output_final_state=True, chunk_size=chunk)
    ((o2 * do.float()).sum() + (h2 * dh.float()).sum()).backward()
    assert not torch.isnan(o2).any() and not torch.isnan(h2).any()
    return {"y": rel(o2, o), "S_T": rel(h2, hT)}, {n: (ours[n].grad, ref[n].grad) for n in names}, ours, ref


@pytest.mark.parametrize("T,K,V,chunk,read,scale,bv", [
    (67, 20, 40, 64, "own", False, 16),  # u a tensor of its own, odd K and V, three value blocks, a partial chunk
    (50, 20, 24, 32, "av", True, 16),    # u = a o v (KDA), formed in the kernels; p's scale fused
    (21, 16, 16, 16, "v", False, None),  # u = v, one sub-block per chunk
])
def test_kernel_matches_naive(T, K, V, chunk, read, scale, bv, monkeypatch):
    monkeypatch.setattr(R, "INTERPRET_BV", bv)
    ins, g = _kernel_case(T, K, V, read, 1.0, seed=T + K, scale=scale)
    errs, grads, _, _ = _run_both(ins, g, chunk)
    errs.update({f"d{n}": rel(a, b) for n, (a, b) in grads.items()})
    assert_within(errs, TOL)


@pytest.mark.parametrize("T,K,V,chunk,read,scale,leaf", [
    (67, 20, 40, 64, "own", False, 4),  # every sub-block halved twice; u its own tensor, a partial chunk
    (50, 20, 24, 32, "av", True, 8),    # halved once; u = a o v, p's scale fused
    (21, 16, 16, 16, "v", False, 4),    # the chunk is one sub-block
])
def test_halved_sub_blocks_match_naive(T, K, V, chunk, read, scale, leaf, monkeypatch):
    """Leaf sizes below SUB: the sub-blocks' second halves against their first halves as
    tensor-core products, elementwise sums only on the LEAF x LEAF diagonal blocks."""
    monkeypatch.setattr(R, "LEAF_FWD", leaf)
    monkeypatch.setattr(R, "LEAF_BWD", leaf)
    monkeypatch.setattr(R, "FAST_DIAG", False)      # these decays would take the products instead
    monkeypatch.setattr(R, "INTERPRET_BV", 16)
    ins, g = _kernel_case(T, K, V, read, 1.0, seed=T + K + leaf, scale=scale)
    errs, grads, _, _ = _run_both(ins, g, chunk)
    errs.update({f"d{n}": rel(a, b) for n, (a, b) in grads.items()})
    assert_within(errs, TOL)


@pytest.mark.parametrize("fast", [False, True], ids=["halved", "products"])
def test_sub_block_references_packed(tmp_path, monkeypatch, fast):
    """Halved sub-blocks, or the diagonal sub-blocks' products (``FAST_DIAG``), in a packed row: the
    references between halves or at the sub-blocks' middle rows are read within each sequence (odd
    lengths, empty ones, chunks of 16), and the packed call equals N separate float64 reference calls
    on the output, final states and every gradient."""
    from test_varlen import _interpret, packed_errors
    monkeypatch.setattr(R, "LEAF_FWD", 4)
    monkeypatch.setattr(R, "LEAF_BWD", 4)
    monkeypatch.setattr(R, "FAST_DIAG", fast)
    monkeypatch.setattr(R, "INTERPRET_BV", 8)
    monkeypatch.setattr(R, "CHUNK", 16)
    obj = _composed(tmp_path)
    errs = packed_errors(obj, [0, 17, 5, 0, 1, 33], _interpret, dtype=torch.float32, d=20, m=12)
    assert_within(errs, {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5})
    assert obj.backend == "triton-interpret:rank1-keydecay-chunk+packed"


@pytest.mark.parametrize("strong,leaf,fast", [(8.0, 16, True), (30.0, 16, True), (30.0, 4, True), (30.0, 4, False)])
def test_strong_decays_stay_finite_and_accurate(strong, leaf, fast, monkeypatch):
    """Decays down to ~1e-10 within a chunk (log a ~ -23 per step, cumulative sums of hundreds):
    the sub-block references keep every exponent <= 0, so nothing overflows. The decay's
    gradient is checked in log space (a * da = d log a), which is what the kernels form: dividing
    by a tiny a magnifies its fp32 rounding, and any parametrisation of a in (0, 1) multiplies
    that back by a factor of order a. ``strong`` 30: log a down to ~ -100 per step, sums of a few
    steps far past fp32's exponent range, so a reference on the wrong side of a row overflows (NaN);
    with halved sub-blocks (leaves of 4) every reference sits between the rows it serves. ``fast``: the
    diagonal sub-blocks' products on (``FAST_DIAG``), which these decays must turn away."""
    monkeypatch.setattr(R, "LEAF_FWD", leaf)
    monkeypatch.setattr(R, "LEAF_BWD", leaf)
    monkeypatch.setattr(R, "FAST_DIAG", fast)
    ins, g = _kernel_case(45, 16, 24, "own", strong, seed=5)
    assert ins["a"].min() < 1e-8
    _assert_log_decay_case(ins, g, 32)


def _assert_log_decay_case(ins, g, chunk):
    """The kernels against the naive loop with the decay's gradient compared in log space (a * da)."""
    errs, grads, ours, ref = _run_both(ins, g, chunk)
    errs.update({f"d{n}": rel(a, b) for n, (a, b) in grads.items() if n != "a"})
    errs["dlog_a"] = rel(ours["a"].grad * ours["a"].detach(), ref["a"].grad * ref["a"].detach())
    assert_within(errs, {"y": 1e-5, "S_T": 1e-5, "grad": 1e-4})


@pytest.mark.parametrize("T,K,V,chunk,sub,read,scale", [
    (67, 20, 40, 64, 16, "own", False),     # u its own tensor (row exponent gp), a partial chunk
    (50, 20, 24, 32, 16, "av", True),       # u = a o v (KDA), p's scale fused
    (45, 16, 24, 32, 32, "av", False),      # the chunk is one sub-block of 32 rows
    (21, 16, 16, 16, 16, "v", False),       # the chunk is one sub-block
])
@pytest.mark.parametrize("span", [1e9, -1.0], ids=["products", "elementwise"])
def test_diagonal_sub_blocks_both_paths_match_naive(T, K, V, chunk, sub, read, scale, span, monkeypatch):
    """Every program on one path of the diagonal sub-blocks (``FAST_DIAG``): their tensor-core products
    against each sub-block's middle row (a span bound no decay exceeds) or the elementwise sums (a
    bound every program exceeds), forward and backward, against the float64 loop."""
    monkeypatch.setattr(R, "FAST_DIAG", True)
    monkeypatch.setattr(R, "SUB", sub)
    monkeypatch.setattr(KK, "FAST_DIAG_SPAN", tl.constexpr(span))
    monkeypatch.setattr(R, "INTERPRET_BV", 16)
    ins, g = _kernel_case(T, K, V, read, 1.0, seed=T + K, scale=scale)
    errs, grads, _, _ = _run_both(ins, g, chunk)
    errs.update({f"d{n}": rel(a, b) for n, (a, b) in grads.items()})
    assert_within(errs, TOL)


def test_diagonal_products_need_their_span_bound(monkeypatch):
    """Without the span bound, decays down to ~1e-40 per step overflow the products' factors (the
    elementwise sums are what keeps such chunks finite): the bound is what the fast path relies on,
    and the tests above that lift it do reach the products."""
    monkeypatch.setattr(R, "FAST_DIAG", True)
    monkeypatch.setattr(KK, "FAST_DIAG_SPAN", tl.constexpr(1e9))
    ins, g = _kernel_case(45, 16, 24, "own", 30.0, seed=5)
    with pytest.raises(AssertionError):
        _assert_log_decay_case(ins, g, 32)


def test_diagonal_paths_mixed_in_one_call(monkeypatch):
    """Ordinary decays in the first chunks and strong ones (down to ~1e-10) in the last, one call: each
    program picks its own path of the diagonal sub-blocks (products, or elementwise sums where the
    span bound fails), and the whole agrees with the float64 loop."""
    monkeypatch.setattr(R, "FAST_DIAG", True)
    ins, g = _kernel_case(70, 16, 24, "av", 1.0, seed=9, scale=True)
    strong, _ = _kernel_case(70, 16, 24, "av", 30.0, seed=10)
    ins["a"][:, 64:] = strong["a"][:, 64:]
    assert ins["a"][:, :64].min() > 1e-3 and ins["a"][:, 64:].min() < 1e-8
    _assert_log_decay_case(ins, g, 32)


# the key blocks the GPU's autotuner may pick for the exact decay gradient's kernel at 32 keys (its
# configs as its prune keeps them): under the interpreter the launch passes the family's key block instead
DA_KEY_BLOCKS = sorted({c.kwargs["BK"] for c in warp_rule(DA_CONFIGS, None, K=32)})


def _da_key_block(monkeypatch, bk, products=None):
    """Launch ``rank1_keydecay_chunk_bwd_da_kernel`` with key block ``bk``; with ``products`` (a list),
    record there the operands of every tensor-core product it forms: (dtype, shape) of each side."""
    from triton.runtime import interpreter as TI
    launch, dot, inside = R.launch, TI.InterpreterBuilder.create_dot, []

    def create_dot(self, a, b, *rest):
        if inside and products is not None:
            products.append(((a.dtype, a.data.shape), (b.dtype, b.data.shape)))
        return dot(self, a, b, *rest)

    def launch_at(kernel, grid, *args, **kw):
        if kernel is not KK.rank1_keydecay_chunk_bwd_da_kernel:
            return launch(kernel, grid, *args, **kw)
        inside.append(kernel)
        try:
            return launch(kernel, grid, *args, **{**kw, "BK": bk})
        finally:
            inside.clear()
    monkeypatch.setattr(TI.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(R, "launch", launch_at)


@pytest.mark.parametrize("bk", DA_KEY_BLOCKS)
def test_decay_gradient_kernel_takes_no_narrow_16bit_products(bk, monkeypatch):
    """bf16 I/O, chunks of 64, decays that send every chunk through the exact decay gradient's kernel, at
    each key block its autotuner may pick: no tensor-core product on 16-bit tiles with a side below
    ``chunked._block_floor``, the least block of a 16-bit product on Hopper. On bf16 tiles at a key block
    of 16 the kernel gave NaN in d alpha on an H200 at chunks of 64, in half the runs (none at 32 or 64,
    none on fp32 tiles); the interpreter computes such products right, so the operands are what is checked."""
    from ssmcraft.ops.common.chunked import _block_floor
    products = []
    _da_key_block(monkeypatch, bk, products)
    monkeypatch.setattr(R, "FAST_DIAG", False)
    ins, g = _kernel_case(67, 32, 24, "av", 1.0, seed=11, scale=True)
    ins["a"][:, [3, 65]] = 1e-20                # a tiny decay at every key of each chunk: every program takes it
    x = {n: t.to(torch.bfloat16).requires_grad_() for n, t in ins.items() if isinstance(t, torch.Tensor)}
    o, hT = R.chunk_rank1_keydecay(x["v"], x["p"], x["c"], x["oq"], x["a"], u=R.AV, ps=x["ps"], initial_state=x["h0"],
                                   output_final_state=True, chunk_size=64)
    (o.float().sum() + hT.sum()).backward()
    # chunks x heads x key blocks x (four over value blocks and M, two per key in the term-by-term sums)
    assert len(products) == 2 * 2 * (32 // bk) * (4 + 2 * bk)
    narrow = [(ta, tb) for ta, tb in products
              if any(dt.primitive_bitwidth == 16 and min(shape) < _block_floor(torch.bfloat16) for dt, shape in (ta, tb))]
    assert not narrow, narrow


@pytest.mark.parametrize("bk,mix", [(DA_KEY_BLOCKS[0], False), (DA_KEY_BLOCKS[-1], True)], ids=["tiny", "mixed"])
def test_decay_gradient_kernel_at_its_key_blocks(bk, mix, monkeypatch):
    """The exact decay gradient at the least and the largest key block its autotuner may pick, on the
    path where the GPU gave NaN in d alpha: chunks of 64, the elementwise diagonal sub-blocks, tiny and
    zero decays (``checking.tiny_decays``), a partial last chunk, every buffer poisoned; the KDA-like layer
    against the float64 reference, d alpha itself (not in log space)."""
    from ssmcraft.runtime.checking import compare, reference, tiny_decays
    from ssmcraft.runtime.select import validated_call
    _da_key_block(monkeypatch, bk)
    monkeypatch.setattr(R, "FAST_DIAG", False)
    obj = ssmcraft.compile(compose_objective(KDA))
    ins, params, S0, g = kernel_inputs(obj, 1, 67, 2, 24, 32, seed=5)
    ins, params = tiny_decays(obj, ins, params, g, mix)
    cmp = compare(reference(obj, ins, params, S0, g),
                  lambda i, p, s: validated_call(registry.family("rank1_keydecay_chunk").prepare, obj, i, p, s, True))
    assert "dalpha" in cmp.errors
    # y: chunk sums of log-decays down to -80 a step reach thousands, whose fp32 ulp is each factor's
    # relative error (chunk.py, "Exponents"): 1.2e-5 measured with mixed decays, 8.7e-8 with tiny ones alone
    assert_within(cmp.errors, {**TOL, "y": 2e-5})


def test_registered():
    assert registry.family("rank1_keydecay_chunk").backend == R.BACKEND_NAME


def test_kda_slots_reach_the_kernel_uncopied(tmp_path, monkeypatch):
    """The KDA-like layer's inputs go to the kernels as the caller's tensors: u = alpha k and
    p = beta x are formed in the kernels, beta is one tensor for c and p's scale."""
    from helpers import random_inputs
    obj = _composed(tmp_path)
    obj.prefer = "interpret"
    seen, real = {}, R.chunk_rank1_keydecay

    def spy(*args, **kw):
        seen.update(dict(zip(("v", "p", "c", "oq", "a"), args)), **kw)
        return real(*args, **kw)
    monkeypatch.setattr(R, "chunk_rank1_keydecay", spy)
    monkeypatch.setattr(R, "CHUNK", 16)
    inputs, _ = random_inputs(obj.spec, T=5, sizes={"d": 8, "m": 4}, dtype=torch.float32)
    obj(inputs)
    assert obj.backend == "triton-interpret:rank1-keydecay-chunk"
    assert seen["v"] is inputs["k"] and seen["u"] == R.AV and seen["a"] is inputs["alpha"]
    assert seen["p"] is inputs["x"] and seen["ps"] is inputs["beta"] and seen["c"] is inputs["beta"]
    assert seen["oq"] is inputs["q"]


def test_exported_layer_runs_the_family(tmp_path):
    """A tiny LM with the KDA-like layer exports with this family's kernels inlined, and the
    standalone module (no ssmcraft importable) matches its own reference path under the interpreter."""
    import json
    import os
    import subprocess
    import sys

    from ssmcraft.export.exporter import export_model
    from ssmcraft.layers import LM, LMConfig
    from test_export_bundle import INTERPRETED, source

    obj = _composed(tmp_path)
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=24, d_model=16, n_layers=1, mlp_ratio=2,
                   mixer={"kind": "objective", "objective": dict(obj.spec.raw), "heads": 2, "state_size": 4})
    result = export_model(LM(cfg, obj).eval(), tmp_path / "kda", source(tmp_path), check=False)
    assert result.kernels == "inline (rank1_keydecay_chunk)", result.kernels
    proc = subprocess.run([sys.executable, "-c", INTERPRETED, str(tmp_path / "kda")], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [res] = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:]).values()
    assert res["backend"] == "triton-interpret:rank1-keydecay-chunk", res
    assert res["diff"] < 1e-4 and res["step_diff"] < 1e-4, res


@pytest.mark.parametrize("file,changes", [("kda_like.yaml", {}), ("kda_like_unnormalized.yaml", {"normalize": False})])
def test_benchmark_specs_are_the_compositions(file, changes):
    """``benchmarks/bench_kda.py`` reads the composed specs from files: they are what
    ``compose_objective`` writes."""
    import yaml
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "specs" / file
    assert yaml.safe_load(path.read_text()) == compose_objective({**KDA, **changes})
