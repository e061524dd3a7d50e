"""Issue 2: the generated reference recurrence and the vectorised path, against hand-written
loops of the published updates, against each other, and under autograd.

The loops below are written from the papers' update rules (matrix form, state S: [d, m],
S k ~ x), deliberately in a different arithmetic form from the generated code (per-row
transition matrices, explicit identity matrices, linear solves instead of Sherman-Morrison).

Tolerances:

| comparison                                          | tolerance                  | why                                          |
|-----------------------------------------------------|----------------------------|----------------------------------------------|
| float64 reference / fast path vs hand loop (T = 7)  | rtol 1e-10, atol 1e-10     | same maths, different association: ~1e-14    |
| fast path vs reference, float64, T in 1, 7, 65      | rtol 1e-9, atol 1e-9*scale | a log2(T)-pass parallel scan re-associates    |
|                                                     |                            | products of decays: ~T * 1e-16 relative       |
| gradcheck (float64)                                 | torch defaults (atol 1e-5, | finite differences with eps 1e-6             |
|                                                     | rtol 1e-3)                 |                                              |
| bf16 inputs: y vs float64 run on the same (rounded) | rtol 1e-2, atol 1e-2*scale | one bf16 rounding of y (2^-8 = 3.9e-3) and    |
| inputs; S_T (fp32 state) vs float64                 | rtol 1e-4, atol 1e-4*scale | fp32 accumulation over T = 7 steps            |
| per-head vs shared params                           | exact (rtol 0, atol 0) /   | same arithmetic on the same values            |
|                                                     | rtol 1e-12                 |                                              |
"""
from __future__ import annotations

import pytest
import torch

import ssmcraft
from ssmcraft.compiler.library import library_names
from ssmcraft.compiler.spec import load_spec
from ssmcraft.errors import SsmcraftError

# single-state objectives (several states: the hand loop in test_compiler_multistate.py)
LIBRARY = [n for n in library_names() if not load_spec(n).states]
B, T, H, D, M = 2, 7, 2, 3, 4
LOOP_TOL = dict(rtol=1e-10, atol=1e-10)


def _outer(a, b):
    return a[..., :, None] * b[..., None, :]


def _eye(n):
    return torch.eye(n, dtype=torch.float64)


# ======================================================================================
# Hand-written loops of the published updates. Inputs [B, T, H, n] (or [B, T, H]); S [B, H, d, m].
# Each returns (y [B, T, H, d], S_T).
# ======================================================================================
def _run(step, inp, S0, read="q"):
    S, ys = S0.clone(), []
    for t in range(inp["x"].shape[1]):
        it = {n: v[:, t] for n, v in inp.items()}
        S = step(S, it)
        ys.append((S @ it[read][..., None])[..., 0])
    return torch.stack(ys, 1), S


def loop_longhorn(inp, S0, params=None):
    """Longhorn exact (Liu et al. 2025, Eq. for the implicit update, by Sherman-Morrison):
    per row i, s_i <- s_i (I - eps_i k k^T) + eps_i x_i k^T, eps_i = beta_i / (1 + beta_i k^T k)."""
    def step(S, it):
        k, x, beta = it["k"], it["x"], it["beta"]
        eps = beta / (1 + beta * (k * k).sum(-1, keepdim=True))                      # [B, H, d]
        P = _eye(k.shape[-1]) - eps[..., :, None, None] * _outer(k, k)[..., None, :, :]   # [B, H, d, m, m]
        return torch.einsum("bhim,bhimn->bhin", S, P) + _outer(eps * x, k)
    return _run(step, inp, S0)


def loop_longhorn_diag(inp, S0, params=None):
    """Longhorn as trained in the paper: S <- (1 - eps k^2) . S + (eps x) k^T."""
    def step(S, it):
        k, x, beta = it["k"], it["x"], it["beta"]
        eps = beta / (1 + beta * (k * k).sum(-1, keepdim=True))
        return (1 - _outer(eps, k * k)) * S + _outer(eps * x, k)
    return _run(step, inp, S0)


def loop_deltanet(inp, S0, params=None):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024): S <- S (I - beta k k^T) + beta x k^T."""
    def step(S, it):
        k, x, beta = it["k"], it["x"], it["beta"][..., None, None]
        return S @ (_eye(k.shape[-1]) - beta * _outer(k, k)) + beta * _outer(x, k)
    return _run(step, inp, S0)


def loop_gla(inp, S0, params=None):
    """GLA (Yang et al. 2024): S <- S diag(alpha) + x k^T."""
    def step(S, it):
        return S @ torch.diag_embed(it["alpha"]) + _outer(it["x"], it["k"])
    return _run(step, inp, S0)


def loop_mamba(inp, S0, params):
    """Mamba's selective SSM (Gu & Dao 2023), ZOH-style: S <- exp(delta A) . S + (delta x) B^T, y = S C."""
    A = params["A"]                                       # [H, d, m] or [d, m]
    def step(S, it):
        dA = it["delta"][..., :, None] * A
        return torch.exp(dA) * S + _outer(it["delta"] * it["x"], it["k"])
    return _run(step, inp, S0)


def loop_linear_attention(inp, S0, params=None):
    """Linear attention (Katharopoulos et al. 2020): S <- S + x k^T."""
    return _run(lambda S, it: S + _outer(it["x"], it["k"]), inp, S0)


def loop_retnet(inp, S0, params):
    """RetNet (Sun et al. 2023): S <- gamma_h S + x k^T."""
    gamma = params["gamma"]                               # [H] or []
    g = gamma[:, None, None] if gamma.dim() == 1 else gamma
    return _run(lambda S, it: g * S + _outer(it["x"], it["k"]), inp, S0)


def loop_hgrn(inp, S0, params=None):
    """HGRN-2 (Qin et al. 2024): S <- S diag(f) + x (1 - f)^T."""
    return _run(lambda S, it: S @ torch.diag_embed(it["f"]) + _outer(it["x"], 1 - it["f"]), inp, S0)


def loop_gated_deltanet(inp, S0, params=None):
    """Gated DeltaNet (Yang et al. 2025): S <- alpha S (I - beta k k^T) + beta x k^T."""
    def step(S, it):
        k, x = it["k"], it["x"]
        a, b = it["alpha"][..., None, None], it["beta"][..., None, None]
        return a * S @ (_eye(k.shape[-1]) - b * _outer(k, k)) + b * _outer(x, k)
    return _run(step, inp, S0)


def _row_solve(lhs_diag, beta, k, rhs, *more):
    """Solve per row i: (lhs_diag_i I + beta_i k k^T + ...) s_i = rhs_i with torch.linalg.solve;
    ``more`` adds further (beta, k) pairs (several keys)."""
    m = k.shape[-1]
    Amat = lhs_diag[..., :, None, None] * _eye(m)
    for b, kk in [(beta, k), *zip(more[::2], more[1::2])]:
        Amat = Amat + b[..., :, None, None] * _outer(kk, kk)[..., None, :, :]
    return torch.linalg.solve(Amat, rhs[..., None])[..., 0]


def loop_gated_longhorn(inp, S0, params=None):
    """argmin ||S - alpha S_prev||^2/2 + sum_i beta_i (s_i k - x_i)^2 / 2, by a linear solve per row."""
    def step(S, it):
        k, x, beta, alpha = it["k"], it["x"], it["beta"], it["alpha"][..., None, None]
        return _row_solve(torch.ones_like(beta), beta, k, alpha * S + _outer(beta * x, k))
    return _run(step, inp, S0)


def loop_wd_longhorn(inp, S0, params=None):
    """argmin ||S - S_prev||^2/2 + sum_i lam_i ||s_i||^2/2 + beta_i (s_i k - x_i)^2/2, by a solve per row."""
    def step(S, it):
        k, x, beta, lam = it["k"], it["x"], it["beta"], it["lam"]
        return _row_solve(1 + lam, beta, k, S + _outer(beta * x, k))
    return _run(step, inp, S0)


def loop_cauchy_delta(inp, S0, params=None):
    """One gradient step on beta/2 log(1 + ||S k - x||^2): S <- S - beta (S k - x) k^T / (1 + ||S k - x||^2)."""
    def step(S, it):
        k, x, beta = it["k"], it["x"], it["beta"][..., None, None]
        r = (S @ k[..., None])[..., 0] - x
        return S - beta * _outer(r, k) / (1 + (r * r).sum(-1))[..., None, None]
    return _run(step, inp, S0)


def loop_longhorn_2key(inp, S0, params=None):
    """argmin ||S - S_prev||^2/2 + sum_i beta_i ((s_i k - x_i)^2 + (s_i k2 - x2_i)^2)/2, by a solve per row."""
    def step(S, it):
        k, k2, x, x2, beta = it["k"], it["k2"], it["x"], it["x2"], it["beta"]
        return _row_solve(torch.ones_like(beta), beta, k, S + _outer(beta * x, k) + _outer(beta * x2, k2), beta, k2)
    return _run(step, inp, S0)


def loop_huber_longhorn(inp, S0, params=None):
    """One Newton step from S_prev on ||S - S_prev||^2/2 + sum_i beta_i (sqrt(1 + r_i^2) - 1), r = S k - x:
    gradient beta_i r_i / sqrt(1 + r_i^2) k, Hessian I + beta_i (1 + r_i^2)^(-3/2) k k^T, per row."""
    def step(S, it):
        k, x, beta = it["k"], it["x"], it["beta"]
        r = (S @ k[..., None])[..., 0] - x
        grad = _outer(beta * r / torch.sqrt(1 + r * r), k)
        return S - _row_solve(torch.ones_like(beta), beta * (1 + r * r) ** -1.5, k, grad)
    return _run(step, inp, S0)


LOOPS = {
    "longhorn_2key": loop_longhorn_2key, "huber_longhorn": loop_huber_longhorn,
    "longhorn": loop_longhorn, "longhorn_diag": loop_longhorn_diag, "deltanet": loop_deltanet,
    "gla": loop_gla, "mamba": loop_mamba, "linear_attention": loop_linear_attention, "retnet": loop_retnet,
    "hgrn": loop_hgrn, "gated_deltanet": loop_gated_deltanet, "gated_longhorn": loop_gated_longhorn,
    "wd_longhorn": loop_wd_longhorn, "cauchy_delta": loop_cauchy_delta,
}
REQUIRED = ["longhorn", "longhorn_diag", "deltanet", "gla", "mamba"]


def _case(compiled, random_inputs, name, *, T=T, seed=0, dtype=torch.float64, sizes=None, Bn=B, Hn=H):
    obj = compiled(name)
    sizes = sizes or {obj.spec.dims[0]: D, obj.spec.dims[1]: M}
    inputs, params = random_inputs(obj.spec, B=Bn, T=T, H=Hn, sizes=sizes, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 100)
    S0 = torch.randn(Bn, Hn, sizes[obj.spec.dims[0]], sizes[obj.spec.dims[1]], generator=g, dtype=torch.float64).to(dtype)
    return obj, inputs, params, S0


def test_every_library_objective_has_a_hand_loop():
    assert set(REQUIRED) <= set(LIBRARY)
    assert set(LIBRARY) <= set(LOOPS), f"no hand loop for {sorted(set(LIBRARY) - set(LOOPS))}"


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_reference_equals_published_loop(name, compiled, random_inputs):
    if name not in LIBRARY:
        pytest.skip(f"{name} not in the library")
    obj, inputs, params, S0 = _case(compiled, random_inputs, name, seed=3)
    y_ref, S_ref = obj.reference(inputs, params, initial_state=S0)
    y_loop, S_loop = LOOPS[name](inputs, S0, params)
    torch.testing.assert_close(y_ref, y_loop, **LOOP_TOL)
    torch.testing.assert_close(S_ref, S_loop, **LOOP_TOL)
    y_fast, S_fast = obj(inputs, params, initial_state=S0)
    assert isinstance(obj.backend, str) and obj.backend
    torch.testing.assert_close(y_fast, y_loop, **LOOP_TOL)
    torch.testing.assert_close(S_fast, S_loop, **LOOP_TOL)
    # without an initial state the loops start from zeros
    y0, S0_T = obj.reference(inputs, params)
    y0_loop, S0_loop = LOOPS[name](inputs, torch.zeros_like(S0), params)
    torch.testing.assert_close(y0, y0_loop, **LOOP_TOL)
    torch.testing.assert_close(S0_T, S0_loop, **LOOP_TOL)


def test_hand_loops_are_discriminating(compiled, random_inputs):
    """The exact and diagonal Longhorn loops (and DeltaNet vs Gated DeltaNet with alpha) differ:
    a comparison against them cannot pass by accident."""
    obj, inputs, params, S0 = _case(compiled, random_inputs, "longhorn", seed=3)
    y_exact, _ = loop_longhorn(inputs, S0)
    y_diag, _ = loop_longhorn_diag(inputs, S0)
    assert (y_exact - y_diag).abs().max() > 1e-3
    y_ref, _ = obj.reference(inputs, initial_state=S0)
    assert (y_ref - y_diag).abs().max() > 1e-3


@pytest.mark.parametrize("T_", [1, 7, 65])
@pytest.mark.parametrize("name", LIBRARY)
def test_fast_path_equals_reference(name, T_, compiled, random_inputs):
    obj, inputs, params, S0 = _case(compiled, random_inputs, name, T=T_, seed=T_)
    y_ref, S_ref = obj.reference(inputs, params, initial_state=S0)
    y, S = obj(inputs, params, initial_state=S0)
    assert y.shape == (B, T_, H, D) and S.shape == (B, H, D, M)
    assert y.dtype == S.dtype == torch.float64
    scale = 1 + y_ref.abs().max().item()
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-9 * scale)
    torch.testing.assert_close(S, S_ref, rtol=1e-9, atol=1e-9 * (1 + S_ref.abs().max().item()))
    # and without an initial state
    y_ref0, S_ref0 = obj.reference(inputs, params)
    y0, S0_ = obj(inputs, params)
    torch.testing.assert_close(y0, y_ref0, rtol=1e-9, atol=1e-9 * scale)
    torch.testing.assert_close(S0_, S_ref0, rtol=1e-9, atol=1e-9 * (1 + S_ref0.abs().max().item()))


@pytest.mark.parametrize("name", LIBRARY)
def test_output_final_state_false(name, compiled, random_inputs):
    obj, inputs, params, S0 = _case(compiled, random_inputs, name, T=3)
    y_full, _ = obj.reference(inputs, params, initial_state=S0)
    for run in (obj.reference, obj):
        y, S = run(inputs, params, initial_state=S0, output_final_state=False)
        assert S is None
        torch.testing.assert_close(y, y_full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", LIBRARY)
def test_bf16_inputs_give_bf16_outputs(name, compiled, random_inputs):
    obj, inputs, params, S0 = _case(compiled, random_inputs, name, seed=9)
    bf = {n: v.to(torch.bfloat16) for n, v in inputs.items()}
    pbf = {n: v.to(torch.bfloat16) for n, v in params.items()}
    S0bf = S0.to(torch.float32)
    # the same (rounded) values in float64: only the arithmetic and the final rounding differ
    in64 = {n: v.double() for n, v in bf.items()}
    p64 = {n: v.double() for n, v in pbf.items()}
    y64, S64 = obj.reference(in64, p64, initial_state=S0bf.double())
    for run in (obj.reference, obj):
        y, S = run(bf, pbf, initial_state=S0bf)
        assert y.dtype == torch.bfloat16, f"{run}: y is {y.dtype}"
        assert S.dtype == torch.float32, f"{run}: the state is {S.dtype} (fp32 state expected)"
        ys = 1 + y64.abs().max().item()
        torch.testing.assert_close(y.double(), y64, rtol=1e-2, atol=1e-2 * ys)
        torch.testing.assert_close(S.double(), S64, rtol=1e-4, atol=1e-4 * (1 + S64.abs().max().item()))


def _gradcheck_fn(obj, names, pnames, fast):
    def f(*tensors):
        inputs = dict(zip(names, tensors[:len(names)]))
        params = dict(zip(pnames, tensors[len(names):len(names) + len(pnames)]))
        S0 = tensors[-1]
        run = obj if fast else obj.reference
        return run(inputs, params, initial_state=S0)
    return f


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("name", LIBRARY)
def test_gradcheck(name, path, compiled, random_inputs):
    """Gradients wrt every input, every param (per head) and the initial state."""
    obj = compiled(name)
    spec = obj.spec
    Hn = 2 if spec.params else 1
    _, inputs, params, S0 = _case(compiled, random_inputs, name, T=3, Bn=1, Hn=Hn, sizes={spec.dims[0]: 2, spec.dims[1]: 3}, seed=4)
    names, pnames = list(inputs), list(params)
    tensors = [inputs[n].clone().requires_grad_() for n in names] + [params[n].clone().requires_grad_() for n in pnames]
    tensors.append(S0.clone().requires_grad_())
    f = _gradcheck_fn(obj, names, pnames, path == "fast")
    full = name in REQUIRED
    assert torch.autograd.gradcheck(f, tuple(tensors), fast_mode=not full)
    # every tensor receives a nonzero gradient (nothing is silently detached)
    y, S = f(*tensors)
    grads = torch.autograd.grad((y.sum() + S.sum()), tensors, allow_unused=True)
    for label, gr in zip(names + pnames + ["initial_state"], grads):
        assert gr is not None and gr.abs().sum() > 0, f"no gradient reaches {label}"


@pytest.mark.parametrize("name", ["mamba", "retnet"])
def test_per_head_params(name, compiled, random_inputs):
    obj, inputs, params, S0 = _case(compiled, random_inputs, name, seed=12)
    (pname,) = params
    P = params[pname]                                 # [H, *shape], different per head
    assert not torch.equal(P[0], P[1])
    for run in (obj.reference, obj):
        # shared == per-head copies == a leading 1
        shared = P[0]
        y_s, S_s = run(inputs, {pname: shared}, initial_state=S0)
        y_e, S_e = run(inputs, {pname: shared.expand(H, *shared.shape).clone()}, initial_state=S0)
        y_1, S_1 = run(inputs, {pname: shared[None]}, initial_state=S0)
        for a, b in ((y_s, y_e), (S_s, S_e), (y_s, y_1), (S_s, S_1)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
        # per head: head h uses P[h] and only P[h]
        y, S = run(inputs, {pname: P}, initial_state=S0)
        for h in range(H):
            sl = {n: v[:, :, h:h + 1] for n, v in inputs.items()}
            y_h, S_h = run(sl, {pname: P[h]}, initial_state=S0[:, h:h + 1])
            torch.testing.assert_close(y[:, :, h:h + 1], y_h, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(S[:, h:h + 1], S_h, rtol=1e-12, atol=1e-12)
        # the two heads' params matter: using P[0] everywhere changes head 1
        assert (y[:, :, 1] - y_s[:, :, 1]).abs().max() > 1e-6
        y_loop, S_loop = LOOPS[name](inputs, S0, {pname: P})
        torch.testing.assert_close(y, y_loop, **LOOP_TOL)


def test_params_with_random_init_must_be_passed(compiled, random_inputs):
    """A param with a random initialiser (Mamba's A: s4d_real) has no default in the reference:
    the call says so with the project's error, not a KeyError."""
    obj, inputs, params, S0 = _case(compiled, random_inputs, "mamba", T=2)
    with pytest.raises(SsmcraftError, match="A"):
        obj.reference(inputs)


def test_time_length_zero(compiled, random_inputs):
    """T = 0: empty outputs and the initial state returned unchanged."""
    for name in ("longhorn", "gla"):
        obj, inputs, params, S0 = _case(compiled, random_inputs, name, T=0)
        for run in (obj.reference, obj):
            y, S = run(inputs, params, initial_state=S0)
            assert y.shape == (B, 0, H, D)
            torch.testing.assert_close(S, S0, rtol=0, atol=0)


DEGENERATE = {
    # pure retention: no input term at all (p = 0), S_t = S_prev diag(alpha)
    "retention_only": ("sq(S - had(T(alpha), S_prev))/2",
                       lambda S, it: S * it["alpha"][..., None, :]),
    # the minimiser ignores S_prev entirely (a = 0): S_t = x k^T
    "no_memory": ("sq(S)/2 - dot(S*k, x)",
                  lambda S, it: _outer(it["x"], it["k"])),
    # the minimiser is S_prev itself (both terms vanish there): S_t = S_prev
    "identity": ("sq(S - S_prev)/2 + sq((S - S_prev)*outer(k, q))/2",
                 lambda S, it: S),
}


@pytest.mark.parametrize("case", sorted(DEGENERATE))
def test_degenerate_updates_run_on_both_paths(case, random_inputs):
    """Updates whose decay or input term is a constant (0 or 1) are valid recurrences; both paths
    must run them (a constant coefficient is a Python number, not a tensor, in generated code)."""
    import yaml
    from ssmcraft.compiler.library import find_objective
    raw = yaml.safe_load(find_objective("gla").read_text())
    text, step = DEGENERATE[case]
    obj = ssmcraft.compile({**raw, "name": case, "objective": text})
    inputs, params = random_inputs(obj.spec, B=B, T=5, H=H, seed=2)
    S0 = torch.randn(B, H, D, M, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    y_loop, S_loop = _run(step, inputs, S0)
    for run in (obj.reference, obj):
        y, S = run(inputs, params, initial_state=S0)
        torch.testing.assert_close(y, y_loop, **LOOP_TOL)
        torch.testing.assert_close(S, S_loop, **LOOP_TOL)


@pytest.mark.parametrize("name", LIBRARY)
def test_fast_path_gradients_equal_reference_gradients_long_T(name, compiled, random_inputs):
    """T = 65 crosses the vectorised path's chunk boundary (64): its backward must equal the
    reference loop's backward for every input, param and the initial state."""
    obj, inputs, params, S0 = _case(compiled, random_inputs, name, T=65, seed=65, Bn=1)
    names, pnames = list(inputs), list(params)
    grads = []
    for run in (obj.reference, obj):
        tensors = [inputs[n].clone().requires_grad_() for n in names] + [params[n].clone().requires_grad_() for n in pnames]
        S_init = S0.clone().requires_grad_()
        y, S = run(dict(zip(names, tensors[:len(names)])), dict(zip(pnames, tensors[len(names):])), initial_state=S_init)
        wy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=y.dtype)
        wS = torch.randn(S.shape, generator=torch.Generator().manual_seed(3), dtype=S.dtype)
        grads.append(torch.autograd.grad((y * wy).sum() + (S * wS).sum(), [*tensors, S_init]))
    for label, a, b in zip(names + pnames + ["initial_state"], *grads):
        scale = 1 + a.abs().max().item()
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9 * scale, msg=lambda m: f"d/d{label}: {m}")


@pytest.mark.parametrize("name,says", [("linear_attention", "the identity"), ("longhorn", "rank-1 erase")])
def test_retention_refusal_names_the_transition(name, says):
    """No decay to scale: the refusal says what the transition is instead (identity for linear
    attention, identity minus a rank-1 erase for Longhorn)."""
    with pytest.raises(SsmcraftError, match=says):
        ssmcraft.compile(name).mitigated(retention=0.9)
    assert ssmcraft.compile(name).mitigated(insertion=0.5).ir.kind == ssmcraft.compile(name).ir.kind
