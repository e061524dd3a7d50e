"""Key-decay chunked family (GLA, RetNet, HGRN, linear attention) under the Triton interpreter,
fp32, against the float64 reference recurrence: output, final state and EVERY gradient (inputs,
params, initial state; with a gradient on the final state too), every kernel buffer poisoned
with NaN first. Odd lengths cross chunk boundaries at chunk sizes 16, 32 and 64; K and V are
padded (m = 12 -> 16, d = 20 -> 32); strongly decaying gates (log alpha down to -5 per step)
check the stability claim. GPU checks in fp32 and bf16: benchmarks/bench_keydecay_chunk.py."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.keydecay_chunk import chunk as KD  # noqa: E402
from ssmcraft.runtime.select import validated_call  # noqa: E402
from ssmcraft.runtime.checking import reference_errors  # noqa: E402
from ssmcraft.ops.keydecay_chunk.naive import naive_recurrent_key_decay  # noqa: E402
from helpers import assert_within, random_inputs, rel_rms as rel  # noqa: E402

# relative RMS error ||ours - ref|| / ||ref||, fp32 kernels vs float64 reference. With strongly
# decaying gates the gate's gradient is compared as d(log alpha) = alpha * d alpha, the kernel's own
# variable: the reverse-cumsum identity gives d(log alpha) to fp32 *absolute* accuracy
# (eps * sum |q dq - k dk|), which the chain rule d alpha = d(log alpha) / alpha then divides by
# alpha (down to e^-5 here), so d alpha's relative error there measures that division, not the kernel.
TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(KD, "POISON", True)
    monkeypatch.setattr(KD, "INTERPRET_BV", None)
    monkeypatch.setattr(KD, "INTERPRET_BK", None)
    monkeypatch.setattr(KD, "CHUNK", 64)


def test_supports():
    for name in ("gla", "retnet", "hgrn", "linear_attention"):
        assert KD.supports(ssmcraft.compile(name).ir) is None, name
    assert "key dimension" in KD.supports(ssmcraft.compile("longhorn_diag").ir)
    assert "key dimension" in KD.supports(ssmcraft.compile("mamba").ir)      # a = exp(A delta) over (d, m)
    assert "rank1" in KD.supports(ssmcraft.compile("deltanet").ir)
    real_decay = ssmcraft.compile({
        "name": "signed_decay", "state": {"S": ["d", "m"]},
        "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"]}, "q": {"shape": ["m"]}},
        "params": {"gamma": {"shape": [], "init": "ones"}},
        "objective": "sq(S - gamma*S_prev)/2 - dot(S*k, x)", "update": "implicit", "output": "S*q"})
    assert "not provably positive" in KD.supports(real_decay.ir)


def _check_objective(name, T, chunk, monkeypatch, B=1, H=2, d=20, m=12, strong=False):
    monkeypatch.setattr(KD, "CHUNK", chunk)
    obj = ssmcraft.compile(name)
    ins, params = random_inputs(obj.spec, B=B, T=T, H=H, sizes={"d": d, "m": m}, seed=T + chunk)
    g = torch.Generator().manual_seed(T)
    if strong:      # log alpha uniform in (-5, -0.01): e^{b_i - b_j} spans e^-320 .. 1 within a chunk
        ins["alpha"] = torch.exp(-0.01 - 4.99 * torch.rand(ins["alpha"].shape, generator=g, dtype=torch.float64))
    S0 = torch.randn(B, H, d, m, generator=g, dtype=torch.float64)

    def ours(inputs, params, s0):
        """Ours through the family's validated entry (prepare's runner), fp32."""
        y, S = validated_call(KD.prepare, obj, inputs, params, s0, True)
        assert y.dtype == torch.float32 and S.dtype == torch.float32
        return y, S
    # with strong gates, d(log alpha) = dalpha * alpha is compared
    cmp = reference_errors(obj, ours, ins, params, S0, g, grad_scale={"alpha": ins["alpha"]} if strong else None)
    assert_within(cmp.errors, TOL)


@pytest.mark.parametrize("name,T,chunk", [
    ("gla", 1, 64), ("gla", 7, 16), ("gla", 65, 64), ("gla", 130, 32),
    ("retnet", 1, 16), ("retnet", 130, 64),
    ("hgrn", 7, 64), ("hgrn", 65, 32),
    ("linear_attention", 130, 64),
])
def test_objective_matches_reference(name, T, chunk, monkeypatch):
    _check_objective(name, T, chunk, monkeypatch)


@pytest.mark.parametrize("T,chunk", [(130, 64)])
def test_strongly_decaying_gates(T, chunk, monkeypatch):
    _check_objective("gla", T, chunk, monkeypatch, strong=True)


@pytest.mark.parametrize("T,K,V,chunk,bk,bv,with_h0,with_dht,B,H", [
    (70, 20, 40, 64, 16, 16, True, True, 1, 2),      # 2 key blocks x 3 value blocks in the sequential kernels
    (33, 16, 24, 32, None, 16, False, False, 1, 2),  # no initial state, no final-state gradient
    # training shapes (one head, small K, d_inner values), with the blocks the GPU's autotuner
    # can pick: key blocks of 32 / 64 larger than K, several value blocks of 32 / 64
    (130, 16, 256, 64, 64, 64, False, False, 2, 1),
    (70, 8, 128, 64, 32, 64, False, False, 2, 1),
    (77, 4, 96, 64, 32, 32, True, True, 2, 2),
])
def test_kernel_level(T, K, V, chunk, bk, bv, with_h0, with_dht, B, H, monkeypatch):
    monkeypatch.setattr(KD, "INTERPRET_BK", bk)
    monkeypatch.setattr(KD, "INTERPRET_BV", bv)
    g = torch.Generator().manual_seed(T + K)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ins = [r(B, T, H, K), r(B, T, H, K), r(B, T, H, V),
           -2.0 * torch.rand(B, T, H, K, generator=g, dtype=torch.float64)]
    h0 = r(B, H, K, V) if with_h0 else torch.zeros(B, H, K, V, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in ins + [h0]]
    o_ref, h_ref = naive_recurrent_key_decay(*ref_in)
    do = r(*o_ref.shape)
    dh = r(*h_ref.shape) if with_dht else torch.zeros_like(h_ref)
    ref_g = torch.autograd.grad((o_ref * do).sum() + (h_ref * dh).sum(), ref_in if with_h0 else ref_in[:4])
    x = [t.float().requires_grad_() for t in ins]
    s = h0.float().requires_grad_() if with_h0 else None
    o, ht = KD.chunk_key_decay(*x, initial_state=s, output_final_state=True, chunk_size=chunk)
    loss = (o.double() * do).sum() + ((ht.double() * dh).sum() if with_dht else 0.)
    got = torch.autograd.grad(loss, x + ([s] if with_h0 else []))
    errs = {"y": rel(o, o_ref), "S_T": rel(ht, h_ref)}
    errs.update({f"d{n}": rel(a, b) for n, a, b in zip(["q", "k", "v", "g", "h0"], got, ref_g)})
    assert_within(errs, TOL)


def test_no_grad_path_and_empty():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 1, 16, generator=g) for _ in range(3))
    lg = -torch.rand(1, 5, 1, 16, generator=g)
    with torch.no_grad():
        o, ht = KD.chunk_key_decay(q, k, v, lg, output_final_state=False)
    ref, _ = naive_recurrent_key_decay(q.double(), k.double(), v.double(), lg.double(), torch.zeros(1, 1, 16, 16, dtype=torch.float64))
    assert ht is None and rel(o, ref) < TOL["y"]
    o0, h0 = KD.chunk_key_decay(q[:, :0], k[:, :0], v[:, :0], lg[:, :0], output_final_state=True)
    assert o0.shape == (1, 0, 1, 16) and float(h0.abs().sum()) == 0.0


def test_config_rule():
    """The configs the GPU's autotuner may compile and time (it runs every config it keeps):
    Triton 3.6 faulted (illegal memory access) with 8 warps at a key block of 16, so 8 warps are
    pruned by rule below a key block of 64 (BENCHMARKS.md, "Key-decay chunked", run 3), and key
    blocks larger than the padded K are dropped."""
    par, intra = KD.PAR_CONFIGS, KD.INTRA_CONFIGS
    for K in (4, 8, 16, 32, 48, 64, 128, 256):
        bk = KD.pow2(K)
        kept = KD.warp_rule(par, {}, H=1, K=K, V=256, BT=64, BC=16, BK=bk)
        assert {c.kwargs["BV"] for c in kept} == {32, 64}, K
        assert any(c.num_warps == 8 for c in kept) == (bk >= 64), K
        kept = KD.warp_rule(intra, {}, H=1, K=K, BT=64, BC=16)
        assert kept and max(c.kwargs["BK"] for c in kept) == min(bk, 64), K
        assert all(c.num_warps < 8 for c in kept)
