"""Precision family (recursive least squares, the preconditioned delta rule) under the Triton
interpreter, in both forms of its precision (``chunk.PARALLEL``: an inverse of the covariance per
segment, then the segments in parallel; or one walk over the chunks): its float64 precision kernels
plus ``rank1_chunk`` against the covariance-form loop twin (``naive.py``: a solve per token, no
Sherman-Morrison), and library and composed objectives through the family against their float64
references (output, both final states, every gradient including both initial states', with
gradients on the final states), on odd lengths, with every output buffer poisoned with NaN; the
GPU check's case at d = m = 64, where a float32 inverse drifts; and a long sequence under strong
forgetting, where a precision chained over the whole sequence drifts and the parallel form does not."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.precision_rank1 import chunk as P  # noqa: E402
from ssmcraft.ops.precision_rank1.naive import chunked_precision, naive_precision_rank1, segment_covariances  # noqa: E402
from ssmcraft.ops.precision_rank1.parallel import CovarianceFunction, segments  # noqa: E402
from ssmcraft.ops.rank1_chunk import chunk as R1  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from helpers import assert_within, kernel_errors, kernel_inputs, rel_rms as rel  # noqa: E402

TOL = {"y": 1e-5, "R_T": 1e-5, "S_T": 1e-5, "grad": 2e-5}
F64 = torch.float64


@pytest.fixture(autouse=True, params=[True, False], ids=["parallel", "sequential"])
def _poison(monkeypatch, request):
    monkeypatch.setattr(P, "POISON", True)
    monkeypatch.setattr(R1, "POISON", True)
    monkeypatch.setattr(P, "PARALLEL", request.param)
    return request.param


# the tests whose path does not depend on the form (float64 algebra, refusals, the I/O dtypes around
# the precision) run once, in the default form
ONE_FORM = pytest.mark.parametrize("_poison", [True], indirect=True, ids=["parallel"])


def _spd(B, H, m, g):
    A = torch.randn(B, H, m, m, generator=g, dtype=F64)
    return torch.eye(m, dtype=F64) + 0.1 * A @ A.transpose(-1, -2)


# lam in [lo, lo + 0.35] (lo = 1: lam = 1, no forgetting): T = 48 is three whole precision chunks under
# strong forgetting (Gamma down to ~1e-22 within a chunk, R's condition number far past float32's reach)
@pytest.mark.parametrize("T,beta,eta,chunk,lo", [(1, False, False, 16, 0.6), (37, False, False, 16, 0.6),
                                                 (37, True, True, 32, 0.6), (70, False, True, 64, 0.6),
                                                 (48, True, True, 16, 0.05), (41, True, False, 16, 1.0)])
def test_layer_matches_its_covariance_twin(T, beta, eta, chunk, lo):
    _check_twin(T, beta, eta, chunk, lo)


@pytest.mark.parametrize("segment", [16, 64])
def test_parallel_form_matches_the_twin_at_other_segments(segment, monkeypatch, _poison):
    """Segments of one chunk each (every chunk from its own inverse), and of four chunks chained
    from one inverse, under strong forgetting (chunks cut short inside a segment) and not."""
    if not _poison:
        pytest.skip("the segment is the parallel form's")
    monkeypatch.setattr(P, "SEGMENT", segment)
    _check_twin(70, True, True, 16, 0.05)
    _check_twin(69, False, False, 32, 0.6)


def _check_twin(T, beta, eta, chunk, lo):
    g = torch.Generator().manual_seed(T)
    B, H, d, m = 2, 2, 12, 8
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)      # noqa: E731
    u = lambda: 0.2 + 0.6 * torch.rand(B, T, H, generator=g, dtype=F64)    # noqa: E731
    b = u() if beta else None
    e = (b if beta else u()) if eta else None
    lam = torch.ones(B, T, H, dtype=F64) if lo == 1 else lo + 0.35 * torch.rand(B, T, H, generator=g, dtype=F64)
    vals = [r(B, T, H, m) / 3, r(B, T, H, d), r(B, T, H, m), lam, b, e, _spd(B, H, m, g), r(B, H, d, m)]
    leaves = [None if t is None else t.clone().requires_grad_() for t in vals]
    if beta and eta:
        leaves[5] = leaves[4]              # one tensor for both (the preconditioned delta rule)
    y, RT, ST = naive_precision_rank1(*leaves)
    dy, dR, dS = r(*y.shape), r(*RT.shape), r(*ST.shape)
    dR = dR + dR.transpose(-1, -2)
    idx = [i for i, t in enumerate(vals) if t is not None and not (i == 5 and beta and eta)]
    want = torch.autograd.grad((y * dy).sum() + (RT * dR).sum() + (ST * dS).sum(), [leaves[i] for i in idx])
    mine = [None if t is None else t.detach().float().requires_grad_() for t in vals]
    if beta and eta:
        mine[5] = mine[4]
    k, x, q, lam, bb, ee, R0, S0 = mine
    y2, (RT2, ST2) = P.precision_rank1(k, x, q, lam, beta=bb, eta=ee, initial_state=(R0, S0), output_final_state=True,
                                       chunk_size=chunk)
    got = torch.autograd.grad((y2 * dy.float()).sum() + (RT2 * dR.float()).sum() + (ST2 * dS.float()).sum(),
                              [mine[i] for i in idx])
    assert rel(y2, y) < TOL["y"] and rel(RT2, RT) < TOL["R_T"] and rel(ST2, ST) < TOL["S_T"]
    names = "k x q lam beta eta R0 S0".split()
    sym = lambda t: 0.5 * (t + t.transpose(-1, -2))     # noqa: E731 - R0 is symmetric: its gradient's symmetric part
    for i, a, w in zip(idx, got, want):
        a, w = (sym(a), sym(w)) if names[i] == "R0" else (a, w)
        assert rel(a, w) < TOL["grad"], names[i]


# (lam's lower end, m, tolerance): R's condition number reaches ~1e2, ~2e7 and ~3e8, where the
# token-by-token Sherman-Morrison recurrence is off by ~1e-13, ~2e-7 and ~4e-10
@ONE_FORM
@pytest.mark.parametrize("segment", [None, 16])
@pytest.mark.parametrize("lo,m,tol", [(0.6, 8, 1e-11), (0.3, 16, 1e-6), (0.5, 64, 1e-8)])
def test_the_chunked_algebra_equals_the_token_by_token_solve(lo, m, tol, segment):
    """The kernels' chunk step (``naive.chunked_precision``: Cholesky of diag(Gamma / beta) + K P K^T,
    a rank-C Woodbury step of P, chunks cut where Gamma < 0.01; with ``segment``, P restarting from
    the covariance's inverse every 16 tokens) against the covariance loop (a solve per token) in
    float64: every gain and the final precision, unit keys, a length no chunk divides, lam in
    [lo, lo + 0.35]; as accurate as the token-by-token recurrence of the precision."""
    g = torch.Generator().manual_seed(int(100 * lo) + m)
    B, T, H = 2, 45, 2
    k = torch.randn(B, T, H, m, generator=g, dtype=F64)
    k = k / k.norm(dim=-1, keepdim=True)
    lam = lo + 0.35 * torch.rand(B, T, H, generator=g, dtype=F64)
    beta, eta = (0.2 + 0.6 * torch.rand(B, T, H, generator=g, dtype=F64) for _ in range(2))
    R0 = _spd(B, H, m, g)
    Rs = _covariances(k, lam, beta, R0)
    want = torch.stack([eta[:, t, :, None] * torch.linalg.solve(R, k[:, t]) for t, R in enumerate(Rs)], 1)
    got, PT = chunked_precision(k, lam, beta, eta, torch.linalg.inv(R0), P.PCHUNK, P.GAMMA_MIN, segment)
    assert rel(got, want) < tol and rel(PT, torch.linalg.inv(Rs[-1])) < tol


def test_a_long_sequence_under_strong_forgetting(_poison):
    """m = 64, T = 1024, unit keys, lam in [0.5, 0.85] (R's condition number up to ~1e13): the parallel
    form restarts every segment from the covariance's inverse and stays within 1e-4 of the float64
    reference (R_T within 1e-6: it is the covariance itself); the precision chained over all 64+ chunks
    accumulates every chunk's rounding, divided by each later Gamma, and ends 5e-3 off (y and R_T:
    the sequential form fails this test)."""
    if not _poison:
        pytest.skip("the sequential form drifts here (the docstring)")
    g = torch.Generator().manual_seed(0)
    T, m, d = 1024, 64, 4
    k = torch.randn(1, T, 1, m, generator=g, dtype=F64)
    k = k / k.norm(dim=-1, keepdim=True)
    lam = 0.5 + 0.35 * torch.rand(1, T, 1, generator=g, dtype=F64)
    x, q = torch.randn(1, T, 1, d, generator=g, dtype=F64), torch.randn(1, T, 1, m, generator=g, dtype=F64)
    y, RT, ST = naive_precision_rank1(k, x, q, lam, None, None, torch.eye(m, dtype=F64)[None, None],
                                      torch.zeros(1, 1, d, m, dtype=F64))
    y2, (RT2, ST2) = P.precision_rank1(k.float(), x.float(), q.float(), lam.float(), output_final_state=True)
    assert rel(y2, y) < 1e-4 and rel(ST2, ST) < 1e-4 and rel(RT2, RT) < 1e-6


@pytest.mark.parametrize("with_beta", [False, True])
def test_the_covariance_scan_matches_its_token_by_token_twin(with_beta, _poison):
    """The parallel form's scan (``CovarianceFunction``: one product per segment of 8 tokens) against
    ``naive.segment_covariances`` (R_t = lam_t R + beta_t k k^T token by token, float64) on a packed
    row with empty sequences and a partial last segment: R at every segment's first token, R_T, and
    the gradients of k, lam, beta and R0 under random cotangents on both."""
    if not _poison:
        pytest.skip("the scan is the parallel form's")
    g = torch.Generator().manual_seed(7)
    cu, H, m, C = [0, 0, 19, 27, 27, 28], 2, 8, 8
    T, N = cu[-1], len(cu) - 1
    k = torch.randn(T, H, m, generator=g, dtype=F64)
    lam = 0.3 + 0.7 * torch.rand(T, H, generator=g, dtype=F64)
    beta = 0.2 + 0.6 * torch.rand(T, H, generator=g, dtype=F64) if with_beta else None
    R0 = _spd(N, H, m, g)
    leaves = [t for t in (k, lam, beta, R0) if t is not None]
    mine = [t.float().requires_grad_() if t is not R0 else t.clone().requires_grad_() for t in leaves]
    want = [t.clone().requires_grad_() for t in leaves]
    args = lambda ts: (ts[0], ts[1], ts[2] if with_beta else None, ts[-1])      # noqa: E731
    Rs, RT = segment_covariances(*args(want), cu, C)
    starts, first = segments(cu, C)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)      # noqa: E731
    Rs2, RT2 = CovarianceFunction.apply(*args(mine), i32(cu), i32(first), len(starts) - 1, C, True)
    assert Rs2.shape == Rs.shape == (len(starts) - 1, H, m, m)
    assert rel(Rs2, Rs) < 1e-6 and rel(RT2, RT) < 1e-6
    dR, dT = torch.randn(Rs.shape, generator=g, dtype=F64), torch.randn(RT.shape, generator=g, dtype=F64)
    dR, dT = dR + dR.transpose(-1, -2), dT + dT.transpose(-1, -2)
    gw = torch.autograd.grad((Rs * dR).sum() + (RT * dT).sum(), want)
    gm = torch.autograd.grad((Rs2 * dR).sum() + (RT2 * dT).sum(), mine)
    for a, w, name in zip(gm, gw, ["k", "lam", "beta", "R0"] if with_beta else ["k", "lam", "R0"]):
        assert rel(a, w) < 1e-6, name


def test_a_second_launch_on_the_same_buffers_gives_the_same_result(monkeypatch, _poison):
    """The autotuner launches each kernel several times on the same buffers. The precision kernels
    keep P between chunks in their own output's slot (pt forward, dP0's backward) and start it afresh
    from P0 or P_T at every launch: with every kernel of the family launched twice, the outputs, both
    final states and every gradient are those of one launch (bit for bit), in both forms, on a
    sequence of several chunks."""
    g = torch.Generator().manual_seed(11)
    B, T, H, d, m = 1, 37, 2, 4, 8
    vals = [torch.randn(B, T, H, m, generator=g) / 3, torch.randn(B, T, H, d, generator=g),
            torch.randn(B, T, H, m, generator=g), 0.6 + 0.35 * torch.rand(B, T, H, generator=g),
            _spd(B, H, m, g).float(), torch.randn(B, H, d, m, generator=g)]
    cot = [torch.randn(B, T, H, d, generator=g), torch.randn(B, H, m, m, generator=g),
           torch.randn(B, H, d, m, generator=g)]

    def run():
        leaves = [t.clone().requires_grad_() for t in vals]
        k, x, q, lam, R0, S0 = leaves
        y, (RT, ST) = P.precision_rank1(k, x, q, lam, initial_state=(R0, S0), output_final_state=True)
        grads = torch.autograd.grad(sum((a * b).sum() for a, b in zip((y, RT, ST), cot)), leaves)
        return [y, RT, ST, *grads]
    once = run()
    from ssmcraft.ops.precision_rank1 import parallel as PP
    for mod in (P, PP):
        real = mod.launch

        def twice(kernel, grid, *args, real=real, **kw):
            real(kernel, grid, *args, **kw)
            real(kernel, grid, *args, **kw)
        monkeypatch.setattr(mod, "launch", twice)
    for a, b, name in zip(run(), once, "y R_T S_T dk dx dq dlam dR0 dS0".split()):
        assert torch.equal(a, b), name


def _covariances(k, lam, beta, R):
    """R_t = lam_t R_{t-1} + beta_t k_t k_t^T for every t (the list of [B, H, m, m])."""
    out = []
    for t in range(k.shape[1]):
        R = lam[:, t, :, None, None] * R + beta[:, t, :, None, None] * k[:, t, :, :, None] * k[:, t, :, None, :]
        out.append(R)
    return out


def test_no_initial_state_starts_at_the_identity():
    obj = ssmcraft.compile("rls")
    ins, _, _, g = kernel_inputs(obj, 1, 19, 2, 12, 8, seed=4)
    f = {n: t.float() for n, t in ins.items()}
    y, fin = P.precision_rank1(f["k"], f["x"], f["q"], f["lam"], output_final_state=True)
    yr, (Rr, Sr) = obj.reference(ins, None, None, True)
    assert rel(y, yr) < TOL["y"] and rel(fin[0], Rr) < TOL["R_T"] and rel(fin[1], Sr) < TOL["S_T"]


def test_no_tokens_return_the_initial_states():
    """T = 0 (a batch, and a packed row of one empty sequence): an empty output, R_T = R0, S_T = S0."""
    g = torch.Generator().manual_seed(5)
    R0, S0 = _spd(2, 2, 8, g).float(), torch.randn(2, 2, 4, 8, generator=g)
    for B, cu in ((2, None), (1, torch.tensor([0, 0, 0], dtype=torch.int32))):
        e = lambda *s: torch.randn(B, 0, 2, *s, generator=g)       # noqa: E731
        y, (RT, ST) = P.precision_rank1(e(8), e(4), e(8), torch.rand(B, 0, 2, generator=g), initial_state=(R0, S0),
                                        output_final_state=True, cu_seqlens=cu)
        assert y.shape == (B, 0, 2, 4) and rel(RT, R0) < 1e-7 and torch.equal(ST, S0)


def _objectives():
    return ["rls", "precond_delta",
            # held out of the library: the composed preconditioned step with a scalar step on a unit key
            compose_objective({"proximity": "metric", "update": "decay_explicit", "step": "scalar", "normalize": True})]


@pytest.mark.parametrize("which", range(3))
@pytest.mark.parametrize("T", [37, 65])
def test_objectives_match_the_reference(which, T):
    obj = ssmcraft.compile(_objectives()[which])
    assert P.supports(obj.ir) is None
    ins, params, S0, g = kernel_inputs(obj, 2, T, 2, 12, 8, seed=T + which)
    S0s = tuple(_spd(2, 2, 8, g) if x == "R" else S0 for x in obj.ir.states)
    errs = kernel_errors(obj, lambda o, lay: P.forward(o, lay, None, True), ins, params, S0s, g)
    assert_within(errs, TOL)


def test_the_gpu_checks_case_at_64_is_within_the_fp32_tolerance():
    """``benchmarks/check_library_gpu.py --shape 2,67,2,64,64``'s inputs (forgetting factors down to
    0.29, unit keys): R's condition number reaches ~3e6, where the float32 Sherman-Morrison path
    drifts by 1e-2; the family (float64 precision, exactly symmetric updates) stays within 1e-4."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from check_library_gpu import initial_states
    from ssmcraft.bench.run import random_inputs
    from ssmcraft.ops.common.reference import layout
    from ssmcraft.runtime.checking import reference_errors
    obj = ssmcraft.compile("rls")
    ins, params = random_inputs(obj, 2, 67, 2, 64, 64, F64, "cpu", seed=1, unit_keys=True)
    g = torch.Generator().manual_seed(2)
    S0 = initial_states(obj, 2, 2, 64, 64, g)
    cmp = reference_errors(obj, lambda i, p, s: P.forward(obj, layout(obj.ir, obj.spec, i, p, s), None, True),
                           ins, params, S0, g)
    assert_within(cmp.errors, 1e-4)


@ONE_FORM
def test_bf16_at_a_long_length_is_within_the_gpu_checks_tolerance(monkeypatch):
    """``benchmarks/bench_rls.py``'s bf16 check case at one (batch, head) (T = 1029, d = m = 64, unit
    keys, lam = sigmoid(N(2, 1))) against the float64 reference on the unrounded values, within the
    GPU checks' bf16 tolerance (``checks.TOL_CHUNKED``), and the memory's chunked step run on fp32
    operands: with its tiles in bf16 its chunk's inverse and W are off by up to 7.3e-2 on the GPU
    (``chunk.py``'s docstring). The interpreter computes no bf16 product as the GPU does, so on the
    CPU the dtypes are what this test can see of that path."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from check_library_gpu import initial_states
    from checks import TOL_CHUNKED
    from ssmcraft.bench.run import random_inputs
    from ssmcraft.runtime.checking import reference_errors
    seen = []

    def spy(v, p, c, oq, **kw):
        seen.append({v.dtype, p.dtype, oq.dtype, kw["u"].dtype})
        return R1.chunk_rank1(v, p, c, oq, **kw)
    monkeypatch.setattr(P, "chunk_rank1", spy)
    obj = ssmcraft.compile("rls")
    obj.prefer = "interpret"
    ins, params = random_inputs(obj, 1, 1029, 1, 64, 64, F64, "cpu", seed=1, unit_keys=True)
    g = torch.Generator().manual_seed(2)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params,
                           initial_states(obj, 1, 1, 64, 64, g), g, torch.bfloat16)
    assert seen == [{torch.float32}]
    assert_within(cmp.errors, TOL_CHUNKED[torch.bfloat16])


def test_dispatch_runs_the_family_and_says_so():
    obj = ssmcraft.compile("precond_delta")
    obj.prefer = "interpret"
    ins, _, S0, g = kernel_inputs(obj, 1, 21, 2, 8, 8, seed=1)
    ins = {k: v.float() for k, v in ins.items()}
    S0s = (_spd(1, 2, 8, g).float(), S0.float())
    y, (RT, ST) = obj(ins, None, S0s, True)
    assert obj.backend == "triton-interpret:precision-fp64+rank1-chunk"
    # the reference in float64 on the same values (in float32 its Sherman-Morrison inverse drifts)
    yr, (Rr, Sr) = obj.reference({k: v.double() for k, v in ins.items()}, None, tuple(s.double() for s in S0s), True)
    assert rel(y, yr) < 1e-5 and rel(RT, Rr) < 1e-5 and rel(ST, Sr) < 1e-5


@ONE_FORM
@pytest.mark.parametrize("choices,why", [
    ({"proximity": "metric", "step": "scalar"}, "the update is not R_t = lam R + beta k k^T"),
    ({"proximity": "metric"}, "not one target over d"),
])
def test_refusals_say_why(choices, why):
    assert why in P.supports(ssmcraft.compile(compose_objective(choices)).ir)


@ONE_FORM
def test_key_dimensions_past_64_are_refused_by_name():
    obj = ssmcraft.compile("rls")
    assert P.supports_sizes(obj.ir, {"m": 64}, "triton") is None
    assert "K = 128 > 64" in P.supports_sizes(obj.ir, {"m": 128}, "triton")
    ins, _, _, _ = kernel_inputs(obj, 1, 3, 1, 4, 128, seed=0)
    assert "K = 128 > 64" in P.supports_inputs(obj.ir, ins, "triton")


@ONE_FORM
def test_other_structures_are_refused():
    assert "no square state" in P.supports(ssmcraft.compile("deltanet").ir)
