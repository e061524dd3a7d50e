"""Chunked rank-1 family (DeltaNet, Gated DeltaNet, general per-head rank-1) under the Triton
interpreter, against the float64 reference recurrence: output, final state and every gradient
(inputs, initial state; with a gradient on the final state), buffers poisoned with NaN."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.rank1_chunk import chunk as R  # noqa: E402
from ssmcraft.ops.rank1_chunk.naive import naive_recurrent_rank1  # noqa: E402
from ssmcraft.runtime.checking import DELTA_RULE_CASES, delta_rule_case  # noqa: E402
from helpers import assert_within, kernel_errors, packed_naive, rel_rms as rel  # noqa: E402

# relative RMS error ||ours - ref|| / ||ref||, fp32 kernels vs float64 reference
TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(R, "POISON", True)
    monkeypatch.setattr(R, "INTERPRET_BV", None)
    monkeypatch.setattr(R, "CHUNK", 64)


def check(errs):
    assert_within(errs, TOL)


def test_supports():
    for name in ("deltanet", "gated_deltanet"):
        assert R.supports(ssmcraft.compile(name).ir) is None
    assert "per head" in R.supports(ssmcraft.compile("longhorn").ir)
    assert "rank1" in R.supports(ssmcraft.compile("mamba").ir)
    ir = ssmcraft.compile("gated_deltanet").ir      # past K = 128 the tiles outgrow sm_90's shared memory
    assert R.supports_sizes(ir, {ir.dims[1]: 128}, "triton") is None
    assert "K = 256 > 128" in R.supports_sizes(ir, {ir.dims[1]: 256}, "triton")


def _objective_case(name, B, T, H, d, m, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    nk = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    ins = {"x": r(B, T, H, d), "k": nk(r(B, T, H, m)), "q": nk(r(B, T, H, m)), "beta": torch.sigmoid(r(B, T, H))}
    if name == "gated_deltanet":
        ins["alpha"] = torch.sigmoid(1.0 + r(B, T, H))
    return ins, r(B, H, d, m), g


@pytest.mark.parametrize("name,T,chunk", [
    ("deltanet", 1, 64), ("deltanet", 7, 16), ("deltanet", 65, 32),
    ("gated_deltanet", 1, 16), ("gated_deltanet", 7, 64), ("gated_deltanet", 65, 64),
])
def test_objective_matches_reference(name, T, chunk, monkeypatch):
    monkeypatch.setattr(R, "CHUNK", chunk)
    obj = ssmcraft.compile(name)
    B, H, d, m = 2, 2, 24, 16
    ins, S0, g = _objective_case(name, B, T, H, d, m, seed=T)
    # the family on the reference layout and the generated coefficients, fp32 (shapes and the
    # fp32 state checked by kernel_errors)
    check(kernel_errors(obj, lambda o, lay: R.forward(o, lay, o.module.coefficients(lay.env, lay.d, lay.m), True),
                        ins, {}, S0, g))


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_objective_at_128_keys_and_values(name, monkeypatch):
    """d = m = 128 in fp32 with the GPU's tiles there: key block 128, value blocks of 32
    (``chunked._value_block`` keeps fp32 tiles within ``TILE_BYTES`` for sm_90's shared memory; its
    rule is tested in ``test_compile_sm90.py``), odd T over a partial chunk."""
    monkeypatch.setattr(R, "INTERPRET_BV", 32)
    obj = ssmcraft.compile(name)
    ins, S0, g = _objective_case(name, 1, 37, 1, 128, 128, seed=128)
    check(kernel_errors(obj, lambda o, lay: R.forward(o, lay, o.module.coefficients(lay.env, lay.d, lay.m), True),
                        ins, {}, S0, g))


@pytest.mark.parametrize("T,K,V,chunk,general,sep_u,decay,scale,bv", [
    (33, 20, 40, 32, True, True, True, True, 16),     # every slot distinct, odd K and V, 3 value blocks
    (65, 16, 24, 64, False, True, False, False, None),  # u != v, merged insert (q == v), no decay
    (40, 16, 16, 16, True, False, False, False, None),  # q != v, no decay, chunk 16
    (21, 16, 40, 16, False, False, True, True, 16),     # merged, decay, fused p scale, 3 value blocks
])
def test_general_slots(T, K, V, chunk, general, sep_u, decay, scale, bv, monkeypatch):
    monkeypatch.setattr(R, "INTERPRET_BV", bv)
    g = torch.Generator().manual_seed(T + K)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    nk = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    B, H = 1, 2
    ins = {"v": nk(r(B, T, H, K)), "u": nk(r(B, T, H, K)) if sep_u else None,
           "q": nk(r(B, T, H, K)) if general else None, "p": r(B, T, H, V), "oq": r(B, T, H, K),
           "c": torch.rand(B, T, H, generator=g, dtype=torch.float64),
           "a": 0.3 + 0.7 * torch.rand(B, T, H, generator=g, dtype=torch.float64) if decay else None,
           "h0": r(B, H, K, V), "ps": torch.randn(B, T, H, generator=g, dtype=torch.float64) if scale else None}
    names = [n for n, t in ins.items() if t is not None]
    ref_in = {n: (t.clone().requires_grad_() if t is not None else None) for n, t in ins.items()}
    o_ref, h_ref = naive_recurrent_rank1(*ref_in.values())
    do, dh = r(*o_ref.shape), r(*h_ref.shape)
    ref_g = torch.autograd.grad((o_ref * do).sum() + (h_ref * dh).sum(), [ref_in[n] for n in names])
    x = {n: (t.float().requires_grad_() if t is not None else None) for n, t in ins.items()}
    o, ht = R.chunk_rank1(x["v"], x["p"], x["c"], x["oq"], u=x["u"], q=x["q"], a=x["a"], ps=x["ps"],
                          initial_state=x["h0"], output_final_state=True, chunk_size=chunk)
    got = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dh).sum(), [x[n] for n in names])
    errs = {"y": rel(o, o_ref), "S_T": rel(ht, h_ref)}
    errs.update({f"d{n}": rel(a_, b_) for n, a_, b_ in zip(names, got, ref_g)})
    check(errs)


@pytest.mark.parametrize("K,V,general,sep_u,decay,scale,bv", [
    (20, 40, True, True, True, True, 16),       # every slot distinct, odd K and V, 3 value blocks
    (16, 24, False, True, False, False, None),  # u != v, merged insert (q == v), no decay
])
def test_packed_general_slots(K, V, general, sep_u, decay, scale, bv, monkeypatch):
    """``chunk_rank1(..., cu_seqlens=)`` on a packed row (the slots the objectives' tests leave out:
    u, q, c given) equals the float64 reference run on each sequence from its own initial state:
    output, final states [N, H, K, V] and every gradient; chunks of 16, lengths empty, 1, under,
    equal to and over a chunk."""
    monkeypatch.setattr(R, "INTERPRET_BV", bv)
    lens = [0, 17, 16, 5, 0, 1, 33]
    N, T, H = len(lens), sum(lens), 2
    g = torch.Generator().manual_seed(K + V)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    nk = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    ins = {"v": nk(r(1, T, H, K)), "u": nk(r(1, T, H, K)) if sep_u else None,
           "q": nk(r(1, T, H, K)) if general else None, "p": r(1, T, H, V), "oq": r(1, T, H, K),
           "c": torch.rand(1, T, H, generator=g, dtype=torch.float64),
           "a": 0.3 + 0.7 * torch.rand(1, T, H, generator=g, dtype=torch.float64) if decay else None,
           "h0": r(N, H, K, V), "ps": torch.randn(1, T, H, generator=g, dtype=torch.float64) if scale else None}
    names = [n for n, t in ins.items() if t is not None]
    ref_in = {n: (t.clone().requires_grad_() if t is not None else None) for n, t in ins.items()}
    o_ref, h_ref, cu = packed_naive(naive_recurrent_rank1, ref_in, lens)
    do, dh = r(*o_ref.shape), r(*h_ref.shape)
    ref_g = torch.autograd.grad((o_ref * do).sum() + (h_ref * dh).sum(), [ref_in[n] for n in names])
    x = {n: (t.float().requires_grad_() if t is not None else None) for n, t in ins.items()}
    o, ht = R.chunk_rank1(x["v"], x["p"], x["c"], x["oq"], u=x["u"], q=x["q"], a=x["a"], ps=x["ps"],
                          initial_state=x["h0"], output_final_state=True, chunk_size=16, cu_seqlens=cu)
    assert ht.shape == (N, H, K, V)
    got = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dh).sum(), [x[n] for n in names])
    errs = {"y": rel(o, o_ref), "S_T": rel(ht, h_ref)}
    errs.update({f"d{n}": rel(a_, b_) for n, a_, b_ in zip(names, got, ref_g)})
    check(errs)


def test_no_grad_path_and_empty():
    g = torch.Generator().manual_seed(0)
    v = torch.nn.functional.normalize(torch.randn(1, 5, 1, 16, generator=g), dim=-1)
    p, c = torch.randn(1, 5, 1, 16, generator=g), torch.rand(1, 5, 1, generator=g)
    with torch.no_grad():
        o, ht = R.chunk_rank1(v, p, c, v, output_final_state=False)
    ref, _ = naive_recurrent_rank1(v.double(), None, None, p.double(), v.double(), c.double(), None,
                   torch.zeros(1, 1, 16, 16, dtype=torch.float64))
    assert ht is None and rel(o, ref) < TOL["y"]
    o0, h0 = R.chunk_rank1(v[:, :0], p[:, :0], c[:, :0], v[:, :0], output_final_state=True)
    assert o0.shape == (1, 0, 1, 16) and float(h0.abs().sum()) == 0.0


def test_half_precision_pads_small_key_and_value_blocks():
    """16-bit I/O at K = 16, V = 24 runs with the key and value blocks padded to 64 (the GPU fails
    below 64 in bf16; ``common.chunked._block_floor``): masked loads keep the padding out of every
    output and gradient. The per-head
    step goes in as fp16 too (read and differentiated in its own dtype). Run in fp16:
    the interpreter's products on bf16 tiles are wrong (1e10 off, ENV.md), fp16 takes the same path."""
    assert R._key_block(16, torch.bfloat16) == 64 and R._key_block(16, torch.float16) == 64
    assert R._key_block(16, torch.float32) == 16 and R._key_block(80, torch.bfloat16) == 128
    assert R._bv(24, torch.float16, 16) == 64 and R._bv(32, torch.bfloat16, 16) == 64 and R._bv(24, torch.float32, 16) == 32
    g = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 37, 2, 16, 24
    nk = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    ins = {"v": nk(torch.randn(B, T, H, K, generator=g)), "p": torch.randn(B, T, H, V, generator=g),
           "c": torch.rand(B, T, H, generator=g), "h0": torch.randn(B, H, K, V, generator=g)}
    x = {n: (t.to(torch.float16) if n in ("v", "p", "c") else t).requires_grad_() for n, t in ins.items()}
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    o_ref, h_ref = naive_recurrent_rank1(ref["v"], None, None, ref["p"], ref["v"], ref["c"], None, ref["h0"])
    do, dh = torch.randn(*o_ref.shape, generator=g, dtype=torch.float64), torch.randn(*h_ref.shape, generator=g, dtype=torch.float64)
    ref_g = torch.autograd.grad((o_ref * do).sum() + (h_ref * dh).sum(), list(ref.values()))
    o, ht = R.chunk_rank1(x["v"], x["p"], x["c"], x["v"], initial_state=x["h0"], output_final_state=True, chunk_size=16)
    assert o.dtype == torch.float16
    got = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dh).sum(), list(x.values()))
    assert [t.dtype for t in got] == [t.dtype for t in x.values()]    # c is read and differentiated in fp16
    errs = {"y": rel(o, o_ref), "S_T": rel(ht, h_ref)}
    errs.update({f"d{n}": rel(a_, b_) for n, a_, b_ in zip(x, got, ref_g)})
    assert_within(errs, {"y": 3e-3, "S_T": 3e-3, "grad": 3e-3})     # measured 4-7e-4; a 1% padding leak fails


def _launch_flags(monkeypatch, fn) -> dict:
    """The state flags and step mode the kernels were launched with while ``fn()`` ran."""
    seen = {}
    real = R.launch

    def spy(kernel, grid, *args, **kw):
        seen.update({k: v for k, v in kw.items() if k in ("HAS_H0", "STORE_HT", "HAS_DHT", "STORE_DH0", "C_MODE")})
        return real(kernel, grid, *args, **kw)
    monkeypatch.setattr(R, "launch", spy)
    fn()
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h0_kind,final,gated", DELTA_RULE_CASES)
def test_delta_rule_step_modes_and_state_flags(h0_kind, final, gated, dtype, monkeypatch):
    """DeltaNet's beta is both the step c and the insert scale ps (one tensor): the grad kernel sums
    its two gradients (C_IS_PS) and autograd sees one. Gated DeltaNet's step is alpha beta, the decay
    times ps: the kernels form it and send its gradient to both (C_IS_A_PS; the barrier before
    dps's partial is read back matters only on a GPU, where ``bench_rank1_chunk.py``'s
    ``check_modes`` runs these cases). The state flags (HAS_H0, STORE_HT, HAS_DHT, STORE_DH0) each
    take the branch that reads or writes nothing. Every output and gradient against the float64
    loop, buffers NaN-poisoned, gradients in their leaves' dtypes (fp16 runs the 16-bit path; the
    interpreter's bf16 products are wrong, ENV.md)."""
    T, chunk = (37, 16) if h0_kind != "grad" else (70, 32)
    out = {}
    flags = _launch_flags(monkeypatch, lambda: out.update(zip(("errs", "dtypes", "final_ok"), delta_rule_case(
        R.delta_rule, 2, T, 2, 16, 24, h0_kind, final, gated, dtype, chunk_size=chunk))))
    assert out["final_ok"] and all(out["dtypes"].values()), out["dtypes"]
    assert_within(out["errs"], TOL if dtype == torch.float32 else {"y": 3e-3, "S_T": 3e-3, "grad": 3e-3})
    assert flags == {"HAS_H0": h0_kind != "none", "STORE_HT": final, "HAS_DHT": final, "STORE_DH0": h0_kind == "grad",
                     "C_MODE": (R.C_IS_A_PS if gated else R.C_IS_PS).value}


def test_unused_final_state_reads_no_gradient_and_one_beta_stays_one(monkeypatch):
    """A final state returned but left out of the loss reaches the backward as None (no zero dH_T
    materialised and read: HAS_DHT off), and a beta that ``chunk_rank1`` must convert (fp64, or not
    contiguous) is converted once and stays one tensor (C_IS_PS: no second gradient summed by
    autograd)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 20, 2, 16, 8
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1) for _ in range(2))
    x = torch.randn(B, T, H, V, generator=g, requires_grad=True)

    def run(beta):
        o, ht = R.delta_rule(q, k, x, beta, output_final_state=True, chunk_size=16)
        assert ht is not None
        o.sum().backward()
    beta = torch.rand(B, T, H, generator=g, requires_grad=True)
    assert _launch_flags(monkeypatch, lambda: run(beta)) == {"HAS_H0": False, "STORE_HT": True, "HAS_DHT": False,
                                                          "STORE_DH0": False, "C_MODE": R.C_IS_PS.value}
    b64 = beta.detach().double().requires_grad_()
    assert _launch_flags(monkeypatch, lambda: run(b64))["C_MODE"] == R.C_IS_PS.value
    base = torch.rand(B, H, T, generator=g, requires_grad=True)
    assert _launch_flags(monkeypatch, lambda: run(base.transpose(1, 2)))["C_MODE"] == R.C_IS_PS.value
    assert b64.grad is not None and b64.grad.dtype == torch.float64 and base.grad is not None
