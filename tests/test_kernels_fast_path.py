"""The public fast path ``obj(...)``, under TRITON_INTERPRET=1:

- the path is chosen once per call signature: a repeated call does no sympy work, no family
  probing and no validation (the families' ``supports`` are not called again);
- slots that are plain inputs reach the kernel as the caller's tensors, in their own dtype (no
  fp32 copies); computed slots come from their own generated function;
- one-token calls (decode) run the fused element-form kernel, for every library objective, and
  match the float64 reference on the output, the final state and every gradient (inputs,
  params, initial state), with the kernel's outputs poisoned by NaN first;
- GLA's decay goes to the kernels as is (their log is taken in the kernels, log_space=False).
"""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.compiler.library import library_names  # noqa: E402
from ssmcraft.compiler.spec import load_spec  # noqa: E402
from ssmcraft.compiler.structure import element_form  # noqa: E402
from ssmcraft.ops.general import recurrent as G  # noqa: E402
from ssmcraft.ops.keydecay_chunk import chunk as KD  # noqa: E402
from ssmcraft.ops.rank1_chunk import chunk as RC  # noqa: E402
from ssmcraft.ops import registry  # noqa: E402
from ssmcraft.runtime import select as TB  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from ssmcraft.ops.common.slots import bindings  # noqa: E402
from ssmcraft.runtime.checking import reference_errors  # noqa: E402
from helpers import assert_within, random_inputs, rel_rms  # noqa: E402

TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 5e-5}


def _interpret(name):
    obj = ssmcraft.compile(name)
    obj.prefer = "interpret"
    return obj


def _spy(monkeypatch, module, name, positional):
    """Wrap ``module.name``: the returned dict fills with the arguments of each call, by name."""
    seen, real = {}, getattr(module, name)

    def spy(*args, **kw):
        seen.update(dict(zip(positional, args)), **kw)
        return real(*args, **kw)
    monkeypatch.setattr(module, name, spy)
    return seen


def test_path_is_chosen_once_per_signature(monkeypatch):
    obj = _interpret("longhorn_diag")
    inputs, params = random_inputs(obj.spec, T=5, dtype=torch.float32)
    obj(inputs, params)
    calls = []
    for fam in registry.FAMILIES:
        real = fam.supports
        monkeypatch.setattr(fam, "supports", lambda ir, real=real: calls.append(ir) or real(ir))
    import ssmcraft.ops.common.reference as R
    import ssmcraft.runtime.dispatch as D
    for module in (R, D):                  # dispatch imports them by name
        for fname in ("layout", "validate"):
            real = getattr(module, fname)
            monkeypatch.setattr(module, fname, lambda *a, real=real, fname=fname, **k: calls.append(fname) or real(*a, **k))
    y1, _ = obj(inputs, params)
    y2, _ = obj({k: v.clone() for k, v in inputs.items()}, params)
    assert calls == [] and torch.equal(y1, y2)
    assert obj.backend == "triton-interpret:diagonal-chunked"
    # a new signature (another T) chooses again, and validates once
    inputs3, params3 = random_inputs(obj.spec, T=4, dtype=torch.float32)
    obj(inputs3, params3)
    assert calls.count("validate") == 1 and len(calls) > 1
    n = len(calls)
    obj(inputs3, params3)
    assert len(calls) == n


def test_a_new_prefer_or_interpret_setting_is_a_new_signature(monkeypatch):
    obj = _interpret("gla")
    inputs, _ = random_inputs(obj.spec, T=3, dtype=torch.float32)
    obj(inputs)
    assert obj.backend.startswith("triton-interpret:")
    obj.prefer = "torch"
    obj(inputs)
    assert obj.backend == "torch-vectorised"
    obj.prefer = "reference"
    obj(inputs)
    assert obj.backend == "reference-loop" and len(obj._paths) == 3
    monkeypatch.setenv("TRITON_INTERPRET", "0")        # the interpreter setting is part of the signature
    obj(inputs)
    assert obj.backend == "reference-loop" and len(obj._paths) == 4


def test_bindings_of_library_layers():
    b = bindings(ssmcraft.compile("deltanet").ir)
    assert (b["u"].kind, b["u"].leaf) == ("leaf", "k") and b["v"] == b["u"] and b["q"] == b["u"]
    assert (b["c"].kind, b["c"].leaf) == ("leaf", "beta") and (b["p"].kind, b["p"].scale, b["p"].leaf) == ("scaled", "beta", "x")
    assert (b["a"].kind, b["a"].value) == ("const", 1.0)
    g = bindings(ssmcraft.compile("gla").ir)
    assert (g["a"].leaf, g["p"].leaf, g["q"].leaf, g["oq"].leaf) == ("alpha", "x", "k", "q")
    lh = bindings(ssmcraft.compile("longhorn").ir)
    assert lh["c"].kind == "computed" and lh["p"].kind == "computed" and lh["u"].leaf == "k"
    gd = bindings(ssmcraft.compile("gated_deltanet").ir)
    assert (gd["c"].kind, {gd["c"].leaf, gd["c"].scale}) == ("product", {"alpha", "beta"})      # alpha * beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deltanet_slots_reach_the_kernel_uncopied(monkeypatch, dtype):
    obj = _interpret("deltanet")
    monkeypatch.setattr(TB, "order", lambda ir, mode: [registry.family("rank1_chunk")])
    seen = _spy(monkeypatch, RC, "chunk_rank1", ("v", "p", "c", "oq"))
    inputs, _ = random_inputs(obj.spec, T=5, sizes={"d": 8, "m": 4}, dtype=dtype)
    y, _ = obj(inputs)
    assert obj.backend == "triton-interpret:rank1-chunk" and y.dtype == dtype
    assert seen["v"] is inputs["k"] and seen["u"] is None and seen["q"] is None      # u = v = q = k, read once
    assert seen["p"] is inputs["x"] and seen["ps"] is inputs["beta"] and seen["c"] is inputs["beta"]
    assert seen["oq"] is inputs["q"] and seen["a"] is None


def test_gla_decay_reaches_the_kernel_as_is(monkeypatch):
    obj = _interpret("gla")
    seen = _spy(monkeypatch, KD, "chunk_key_decay", ("q", "k", "v", "g"))
    monkeypatch.setattr(KD, "CHUNK", 16)
    inputs, _ = random_inputs(obj.spec, T=21, sizes={"d": 8, "m": 4}, dtype=torch.bfloat16)
    obj(inputs)
    assert obj.backend == "triton-interpret:keydecay-chunked"
    assert seen["g"] is inputs["alpha"] and seen["log_space"] is False
    assert seen["v"] is inputs["x"] and seen["k"] is inputs["k"] and seen["q"] is inputs["q"]


@pytest.mark.parametrize("log_space", [True, False])
def test_key_decay_log_space_and_linear_decay_agree(monkeypatch, log_space):
    monkeypatch.setattr(KD, "POISON", True)
    g = torch.Generator().manual_seed(3)
    B, T, H, K, V = 2, 19, 2, 8, 16
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    a = 0.5 + 0.5 * torch.rand(B, T, H, K, generator=g, dtype=torch.float64)
    h0 = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    leaves64 = [q, k, v, a, h0]
    ref = [t.clone().requires_grad_(True) for t in leaves64]
    # float64 reference: h_t = diag(a_t) h_{t-1} + k_t v_t^T, o_t = h_t^T q_t
    h, outs = ref[4], []
    for t in range(T):
        h = ref[3][:, t, :, :, None] * h + ref[1][:, t, :, :, None] * ref[2][:, t, :, None, :]
        outs.append((h * ref[0][:, t, :, :, None]).sum(-2))
    o_ref, ht_ref = torch.stack(outs, 1), h
    mine = [t.float().clone().requires_grad_(True) for t in leaves64]
    o, ht = KD.chunk_key_decay(mine[0], mine[1], mine[2], mine[3] if not log_space else mine[3].log(),
                               initial_state=mine[4], output_final_state=True, chunk_size=16, log_space=log_space)
    w = torch.randn(o.shape, generator=g, dtype=torch.float64)
    ((o.double() * w).sum() + ht.double().square().sum()).backward()
    ((o_ref * w).sum() + ht_ref.square().sum()).backward()
    errs = {"y": rel_rms(o, o_ref), "S_T": rel_rms(ht, ht_ref)}
    errs.update({f"d{n}": rel_rms(a_.grad, b_.grad) for n, a_, b_ in zip("qkvah", mine, ref)})
    assert_within(errs, TOL)


# read from the specs (no compilation at collection time: generated modules belong to the
# session's cache folder, set up by conftest's fixture)
SINGLE_STATE = [n for n in library_names() if not load_spec(n).states]


def test_several_states_leave_one_token_calls_to_the_general_family():
    from ssmcraft.ops.decode import step as decode
    several = [n for n in library_names() if n not in SINGLE_STATE]
    assert several, "the library has a several-state objective (momentum_longhorn)"
    for n in several:
        assert "several states" in decode.supports(ssmcraft.compile(n).ir)


@pytest.mark.parametrize("name", SINGLE_STATE)
def test_one_token_calls_run_the_fused_kernel(monkeypatch, name):
    monkeypatch.setattr(G, "POISON", True)
    obj = _interpret(name)
    inputs, params = random_inputs(obj.spec, B=3, T=1, sizes={obj.spec.dims[0]: 5, obj.spec.dims[1]: 3})
    S0 = torch.randn(3, 2, 5, 3, dtype=torch.float64)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), inputs, params, S0, torch.Generator().manual_seed(7))
    assert obj.backend == "triton-interpret:decode-fused"
    assert cmp.written, cmp.errors
    assert_within(cmp.errors, TOL)


def test_longer_calls_do_not_take_the_decode_kernel():
    obj = _interpret("deltanet")
    inputs, _ = random_inputs(obj.spec, T=2, dtype=torch.float32)
    obj(inputs)
    assert "decode" not in obj.backend
    from ssmcraft.ops.decode import step as decode
    assert "T = 1" in decode.supports_inputs(obj.ir, inputs, "interpret")


def test_element_form_is_the_same_recurrence():
    for name in ("longhorn", "gated_deltanet", "mamba", "gla", "longhorn_2key"):
        obj = ssmcraft.compile(name)
        eir = element_form(obj.ir)
        assert eir.kind == "general" and eir.state_update is not None
        n_keys = {"rank1": 1, "rankr": obj.ir.ranks()[0]}.get(obj.ir.kind, 0)    # one S_prev u_l per key
        assert len(eir.state_reductions) == n_keys
    ir = ssmcraft.compile("cauchy_delta").ir
    assert element_form(ir) is ir


@pytest.mark.parametrize("name,family", [("longhorn", "rank1_row"), ("wd_longhorn", "rank1_row"),
                                         ("gated_deltanet", "rank1_chunk"), ("gated_deltanet", "rank1_row"),
                                         ("hgrn", "keydecay_chunk"),
                                         ("retnet", "keydecay_chunk"), ("cauchy_delta", "general"),
                                         ("longhorn_2key", "rankr_row"), ("composed_2key_scalar_step", "rankr_row")])
def test_prepared_runners_with_computed_slots_match_the_reference(monkeypatch, name, family):
    """Families' specialised runners where some slots are expressions (Longhorn's c and p, Gated
    DeltaNet's c = alpha beta, HGRN's p = -x) or per-head params (RetNet's gamma), and the fused
    sequential kernels (general, row-tiled rank-r) on the caller's tensors: output, final state and
    every gradient against the float64 reference, outputs poisoned."""
    from ssmcraft.ops.rank1_row import recurrent as RR
    monkeypatch.setattr(TB, "order", lambda ir, mode: [registry.family(family)])
    monkeypatch.setattr(RR, "POISON", True)
    monkeypatch.setattr(KD, "POISON", True)
    monkeypatch.setattr(G, "POISON", True)
    monkeypatch.setattr(RC, "POISON", True)
    monkeypatch.setattr(KD, "CHUNK", 16)
    monkeypatch.setattr(RC, "CHUNK", 16)
    # held out: two keys with one step per head (per-head Woodbury factors, computed by the prologue)
    obj = _interpret(compose_objective({"keys": 2, "step": "scalar"}) if name == "composed_2key_scalar_step" else name)
    sizes = {obj.spec.dims[0]: 8, obj.spec.dims[1]: 4}
    inputs, params = random_inputs(obj.spec, B=2, T=19, sizes=sizes)
    S0 = torch.randn(2, 2, 8, 4, dtype=torch.float64)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), inputs, params, S0, torch.Generator().manual_seed(7))
    kernel = {"rank1_row": "rank1-row", "rank1_chunk": "rank1-chunk", "keydecay_chunk": "keydecay-chunked",
              "general": "general", "rankr_row": "rankr-row"}[family]
    computed = any(b.kind == "computed" for b in bindings(obj.ir).values())
    assert obj.backend == f"triton-interpret:{kernel}" + ("+prologue" if computed else "")
    assert cmp.written, cmp.errors
    assert_within(cmp.errors, TOL)
