"""The fused prologue of the computed slots (``ssmcraft.ops.codegen.prologue``), under TRITON_INTERPRET=1:

- for every library objective with a computed slot, the kernel against the objective's generated
  eager ``coefficients`` (float64, from the same leaf values) on every computed slot and, under
  random upstream gradients, on every leaf's gradient (inputs and params, per head or shared);
  fp32 and bf16 leaves, odd sizes, every output and gradient buffer poisoned by NaN first;
- the sums the generated kernels take, counted in their source against the number derived by
  hand (one sum per product of keys the slots read, one adjoint sum over the rows per such
  product and per per-head leaf), and a slot equal to another stored once;
- the public path: Longhorn's ``obj(...)`` through the rank1_row family takes the prologue (the
  eager coefficients are never called), says so in ``obj.backend``, chooses it once per call
  signature, and matches the reference loop on the output, the final state and every gradient
  (initial state included); where the prologue cannot be generated the eager path runs, by name.
"""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.compiler.library import library_names  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from ssmcraft.ops.codegen import prologue as P  # noqa: E402
from ssmcraft.ops.rank1_row import recurrent as RR  # noqa: E402
from ssmcraft.ops import registry  # noqa: E402
from ssmcraft.runtime import select as TB  # noqa: E402
from ssmcraft.ops.common.slots import bindings, computed_slots  # noqa: E402
from ssmcraft.runtime.checking import compare, reference  # noqa: E402
from helpers import assert_within, random_inputs, rel_rms  # noqa: E402

# every library objective with a computed slot (checked against the library below)
COMPUTED = ["gated_longhorn", "hgrn", "longhorn", "longhorn_2key", "longhorn_diag", "mamba", "momentum_longhorn",
            "wd_longhorn"]
SIZES = dict(B=2, T=5, H=3)
# the slots are fp32 arithmetic on exactly upcast leaves; a bf16 gradient is converted once when
# stored: within one bf16 ulp, 2**-7 of the value per element (the interpreter truncates fp32 ->
# bf16 instead of rounding to nearest as the GPU does: half an ulp there)
TOL = {torch.float32: {"slot": 1e-5, "grad": 1e-5}, torch.bfloat16: {"slot": 1e-5, "grad": 2 ** -7}}


# held out (no library spec): a composed two-key regression with one step per head, so that the
# Woodbury factors c_rl are per head and only the inputs p_r vary over the rows
TWO_KEY_SCALAR = compose_objective({"keys": 2, "step": "scalar"})


def test_the_list_is_every_library_objective_with_a_computed_slot(compiled):
    found = sorted(n for n in library_names() if any(b.kind == "computed" for b in bindings(compiled(n).ir).values()))
    assert found == COMPUTED


def _eager(obj, inputs, params, B, T, H, d, m):
    """The generated coefficients in float64 on the same values: slot -> [B, T, H, *dims]."""
    ir = obj.ir
    size = {ir.dims[0]: d, ir.dims[1]: m}
    env = {}
    for n, dims in ir.inputs.items():
        env[n] = inputs[n].reshape(B, T, H, d if ir.dims[0] in dims else 1, m if ir.dims[1] in dims else 1)
    for n, dims in ir.params.items():
        t = params[n]
        heads = t.shape[0] if t.dim() == len(dims) + 1 else 1
        env[n] = t.reshape(1, 1, heads, d if ir.dims[0] in dims else 1, m if ir.dims[1] in dims else 1)
    values = obj.module.coefficients(env, d, m)
    out = {}
    for s, b in bindings(ir).items():
        if b.kind == "computed":
            v = values[s].expand(B, T, H, values[s].shape[3], values[s].shape[4])
            out[s] = v.reshape(B, T, H, *[size[x] for x in b.dims])
    return out


def _grads(fn, leaves, g):
    """(slots, {leaf: gradient}) of ``fn(leaves)`` under upstream gradients drawn from ``g``."""
    for t in leaves.values():
        t.grad = None
    out = fn(leaves)
    ws = {s: torch.randn(v.shape, generator=g, dtype=torch.float64) for s, v in sorted(out.items())}
    sum((out[s].double() * w).sum() for s, w in ws.items()).backward()
    return out, {n: t.grad for n, t in leaves.items()}


def _check(monkeypatch, name, dtype, per_head_params=True):
    monkeypatch.setattr(P, "POISON", True)
    obj = ssmcraft.compile(name)
    d, m = 7, 5
    inputs, params = random_inputs(obj.spec, **SIZES, sizes={obj.spec.dims[0]: d, obj.spec.dims[1]: m}, dtype=dtype,
                                   per_head_params=per_head_params)
    leaves = {**{f"in.{k}": v.requires_grad_(True) for k, v in inputs.items()},
              **{f"param.{k}": v.requires_grad_(True) for k, v in params.items()}}
    split = lambda lv: ({k[3:]: v for k, v in lv.items() if k.startswith("in.")},      # noqa: E731
                        {k[6:]: v for k, v in lv.items() if k.startswith("param.")})
    got, dgot = _grads(lambda lv: computed_slots(obj, *split(lv)), leaves, torch.Generator().manual_seed(5))
    ref_leaves = {k: v.detach().double().requires_grad_(True) for k, v in leaves.items()}
    ref, dref = _grads(lambda lv: _eager(obj, *split(lv), **SIZES, d=d, m=m), ref_leaves,
                       torch.Generator().manual_seed(5))
    assert sorted(got) == sorted(ref) and all(v.dtype == torch.float32 for v in got.values())
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in ref.items()}
    used = {n for b in bindings(obj.ir).values() for n in b.needs}
    for k, t in leaves.items():     # a leaf the computed slots read gets a gradient in its dtype, the others none
        assert (dgot[k] is not None) == (k.split(".", 1)[1] in used), k
        assert dgot[k] is None or (dgot[k].dtype == t.dtype and dgot[k].shape == t.shape), k
    errs = {f"slot.{s}": rel_rms(got[s], ref[s]) for s in ref}
    errs.update({f"d{k}": rel_rms(dgot[k], dref[k]) for k in leaves if dgot[k] is not None})
    assert_within(errs, {"grad": TOL[dtype]["grad"], **{k: TOL[dtype]["slot"] for k in errs if k.startswith("slot.")}})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", COMPUTED)
def test_prologue_matches_the_eager_coefficients(monkeypatch, name, dtype):
    _check(monkeypatch, name, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prologue_of_a_held_out_two_key_objective(monkeypatch, dtype):
    _check(monkeypatch, TWO_KEY_SCALAR, dtype)


def _sums(source: str, kernel: str) -> tuple[int, int]:
    """(sums over the keys, sums over the rows) that the generated ``kernel`` takes."""
    body = source.split(f"def {kernel}(")[1].split("@triton.jit")[0]
    return body.count("tl.sum(") - body.count("axis=1"), body.count("axis=1")


@pytest.mark.parametrize("name,forward,backward", [
    # Woodbury's 2 x 2 solve reads the three products of the keys, k.k, k2.k2 and k.k2: three sums
    # over m, recomputed by the backward. Every slot varies over the rows, so the adjoint of each
    # product, sum_d sum_s G_s ds/d(k.k), is one sum over d (three), and dk = 2 k d(k.k) + k2 d(k.k2)
    # takes none; x, x2 and beta vary over the rows: their gradients take none either
    ("longhorn_2key", (3, 0), (3, 3)),
    # the same products; the factors c_rl are per head (no sum), the inputs p_r vary over the rows:
    # one sum over d per product (from the p_r), and one for the per-head beta's gradient
    (TWO_KEY_SCALAR, (3, 0), (3, 4)),
    # Longhorn: k.k, and its adjoint from c and p together
    ("longhorn", (1, 0), (1, 1)),
])
def test_each_product_of_keys_and_its_adjoint_is_one_sum(name, forward, backward):
    obj = ssmcraft.compile(name)
    _, _, source = P.module(obj.ir, bindings(obj.ir))
    assert _sums(source, "prologue_fwd_kernel") == forward
    assert _sums(source, "prologue_bwd_kernel") == backward


def test_a_slot_equal_to_another_is_stored_once(monkeypatch):
    """longhorn_2key's c10 is c01 (the Woodbury inverse is symmetric): one store, one tensor, and
    its upstream gradient still counts (``_check`` draws one per slot)."""
    monkeypatch.setattr(P, "POISON", True)
    obj = ssmcraft.compile("longhorn_2key")
    pro, _, source = P.module(obj.ir, bindings(obj.ir))
    assert pro.aliases == {"c10": "c01"} and [s for s, _, _ in pro.slots] == ["c00", "c01", "c11", "p0", "p1"]
    fwd = source.split("def prologue_fwd_kernel(")[1].split("@triton.jit")[0]
    assert fwd.count("tl.store(") == 5 and "O_c10" not in fwd
    assert "GO_c10" in source.split("def prologue_bwd_kernel(")[1]
    inputs, _ = random_inputs(obj.spec, **SIZES, sizes={"d": 7, "m": 5})
    out = computed_slots(obj, inputs)
    assert out["c10"].data_ptr() == out["c01"].data_ptr() and torch.equal(out["c10"], out["c01"])


def test_generated_source_is_deterministic():
    """Built twice from scratch (new algebra, new reductions), the same text: it is cached by its hash."""
    obj = ssmcraft.compile("longhorn_2key")
    texts = {P.kernel_source(obj.ir, P.build(obj.ir, bindings(obj.ir)), "h") for _ in range(2)}
    assert len(texts) == 1


def test_shared_params_gradients_are_summed_over_heads(monkeypatch):
    """Mamba's ``A [d, m]`` given once for every head (a [d, m] computed slot ``a = exp(A delta)``)."""
    _check(monkeypatch, "mamba", torch.float32, per_head_params=False)


def test_generated_source_is_readable_and_cached():
    obj = ssmcraft.compile("longhorn")
    pro, mod, source = P.module(obj.ir, bindings(obj.ir))
    assert P.module(obj.ir, bindings(obj.ir))[1] is mod
    assert [s for s, _, _ in pro.slots] == ["c", "p"] and [lf.name for lf in pro.leaves] == ["x", "k", "beta"]
    assert "spec: longhorn" in source and "def prologue_fwd_kernel(" in source and "def prologue_bwd_kernel(" in source
    assert "c ['d'] = beta/(_r0*beta + 1)" in source


def _longhorn_end_to_end(monkeypatch, obj):
    """``obj(...)`` (Longhorn, rank1_row) against the reference loop; returns (inputs, S0, the
    number of calls of the eager generated coefficients during the fast call, forward and backward)."""
    monkeypatch.setattr(TB, "order", lambda ir, mode: [registry.family("rank1_row")])
    monkeypatch.setattr(RR, "POISON", True)
    monkeypatch.setattr(P, "POISON", True)
    eager, calls = obj.module.coefficients, []
    monkeypatch.setattr(obj.module, "coefficients", lambda *a: calls.append(1) or eager(*a))
    obj.prefer = "interpret"
    inputs, params = random_inputs(obj.spec, **SIZES, sizes={"d": 7, "m": 5})
    S0 = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    ref = reference(obj, inputs, {}, S0, torch.Generator().manual_seed(7))
    calls.clear()                           # count the fast call's eager coefficients only
    seen = {}

    def call(i, p, s):
        seen.update(inputs=i, S0=s)
        return obj(i, p, s, True)
    cmp = compare(ref, call)
    n_eager = len(calls)
    assert set(cmp.errors) == {"y", "S_T", "dx", "dk", "dq", "dbeta", "dS0"} and cmp.written, cmp.errors
    assert_within(cmp.errors, {"y": 1e-5, "S_T": 1e-5, "grad": 5e-5})
    return seen["inputs"], seen["S0"], n_eager


def test_longhorn_public_path_takes_the_prologue(monkeypatch):
    obj = ssmcraft.compile("longhorn")
    inputs, S0, n_eager = _longhorn_end_to_end(monkeypatch, obj)
    assert obj.backend == "triton-interpret:rank1-row+prologue"
    assert n_eager == 0                     # no eager coefficients, forward or backward
    # chosen once per call signature: a repeated call builds nothing and hashes nothing
    calls = []
    monkeypatch.setattr(P, "module", lambda *a: calls.append("module"))
    monkeypatch.setattr(type(obj.ir), "content_hash", lambda self: calls.append("hash"))
    obj(inputs, None, S0)
    assert calls == [] and obj.backend == "triton-interpret:rank1-row+prologue"


def test_without_a_prologue_the_eager_path_runs_by_name(monkeypatch):
    """An objective whose coefficients the Triton printer cannot print keeps the generated eager
    coefficients, and the backend says so."""
    def refuse(ir, binds):
        raise NotImplementedError("no Triton printing for the function f")
    monkeypatch.setattr(P, "module", refuse)
    obj = ssmcraft.compile("longhorn")
    _, _, n_eager = _longhorn_end_to_end(monkeypatch, obj)
    assert obj.backend == "triton-interpret:rank1-row+eager-coefficients" and n_eager == 1
    # `ssmcraft derive --kernel` says so too, rather than failing on the prologue it cannot print
    from ssmcraft.runtime.select import kernel_source
    fam, sources = kernel_source(obj)
    assert fam == "rank1_row" and "no Triton prologue (no Triton printing for the function f)" in sources[0][1]
