"""Every kernel family that takes a decay, on decays a sigmoid gate reaches in training: drawn in
(0, 1e-6) with exact zeros among them, and tiny and ordinary decays mixed in one chunk, under the
Triton interpreter against the float64 reference (``ssmcraft.runtime.checking``): output, final
state and every gradient, the decay's and the initial state's included, every buffer poisoned
with NaN. Chunks of 16 tokens over 37 (two terms a token: 32 term rows): three chunks, the last partial, the state carried across.

Library layers (Gated DeltaNet, GLA, HGRN, RetNet, Mamba) and composed objectives, each on every
family that runs it on CUDA (``KernelFamily.reason`` in mode "triton"), the row families beside the
chunked ones. The chunked families form log-decays: log 0 = -inf and a cumulative sum through it
made every output NaN; a decay's gradient formed as d log a / a was NaN at a = 0 and, below a ~ 1e-3,
rounding of d log a blown up by 1 / a. The chunked families with a kernel of their own for the exact
decay gradient (``*_bwd_da_kernel``) also run packed rows, and that kernel is shown to change the
decay's gradient alone, in the chunks holding a tiny decay alone."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.registry import BY_NAME, FAMILIES  # noqa: E402
from ssmcraft.runtime.checking import DECAY_NAMES, compare, reference, tiny_decays  # noqa: E402
from ssmcraft.runtime.select import validated_call  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from helpers import assert_within, kernel_inputs  # noqa: E402

TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5}
B, T, H, D, M = 1, 37, 2, 24, 16

SCALAR_DECAY = {"proximity": "scalar_decay", "data": "regression", "step": "scalar", "normalize": True}
OBJECTIVES = {
    "gated_deltanet": "gated_deltanet", "gla": "gla", "hgrn": "hgrn", "retnet": "retnet", "mamba": "mamba",
    # the byte-level search's objective that diverged (implicit, alpha bounded, keys normalised)
    "composed_implicit": compose_objective(dict(SCALAR_DECAY, update="implicit")),
    "composed_decay_explicit": compose_objective(dict(SCALAR_DECAY, update="decay_explicit")),
    "kda_like": compose_objective(dict(SCALAR_DECAY, proximity="diagonal_decay", update="decay_explicit")),
    "two_keys_decay_explicit": compose_objective(dict(SCALAR_DECAY, keys=2, update="decay_explicit")),
    "two_keys_implicit": compose_objective(dict(SCALAR_DECAY, keys=2, update="implicit")),
    "minibatch_regression": compose_objective(dict(SCALAR_DECAY, update="explicit", minibatch=16)),
    "minibatch_linear": compose_objective({"proximity": "scalar_decay", "data": "linear", "update": "explicit",
                                           "minibatch": 16}),
}
# (objective, family): every family that takes a decay, with the objectives it runs
CASES = [
    ("gated_deltanet", "rank1_chunk"), ("gated_deltanet", "rank1_row"), ("gated_deltanet", "rank1_row_chunk"),
    ("composed_implicit", "rank1_chunk"), ("composed_implicit", "rank1_row"), ("composed_implicit", "rank1_row_chunk"),
    ("composed_decay_explicit", "rank1_chunk"),
    ("gla", "keydecay_chunk"), ("gla", "diagonal"), ("hgrn", "keydecay_chunk"), ("hgrn", "diagonal"),
    ("retnet", "keydecay_chunk"), ("retnet", "diagonal"), ("mamba", "diagonal"),
    ("kda_like", "rank1_keydecay_chunk"),
    ("two_keys_decay_explicit", "rankr_chunk"), ("two_keys_implicit", "rankr_chunk"),
    ("minibatch_regression", "minibatch_chunk"), ("minibatch_linear", "minibatch_chunk"),
]


def _case(obj, mix, seed):
    """(inputs, params, S0, g): ``kernel_inputs``'s draws (Mamba's A made negative, in (-1.1, -0.5)),
    then the decays redrawn by ``checking.tiny_decays``."""
    ins, params, S0, g = kernel_inputs(obj, B, T, H, D, M, seed)
    if "A" in params:
        params["A"] = -(params["A"] + 0.3)
    ins, params = tiny_decays(obj, ins, params, g, mix)
    return ins, params, S0, g


@pytest.fixture(scope="module")
def objectives():
    return {}


@pytest.mark.parametrize("mix", [False, True], ids=["tiny", "mixed"])
@pytest.mark.parametrize("name,family", CASES)
def test_tiny_and_zero_decays_match_the_reference(name, family, mix, objectives, monkeypatch):
    if name not in objectives:
        objectives[name] = ssmcraft.compile(OBJECTIVES[name])
    obj, fam = objectives[name], BY_NAME[family]
    assert fam.reason(obj.ir, None, "triton") is None, f"{family} does not run {name}"
    for f in FAMILIES:      # rankr_chunk runs rank1_chunk's kernels: every family's buffers poisoned
        if f.poison is not None:
            monkeypatch.setattr(f.module, "POISON", True)
    for attr, value in (("CHUNK", 32 if family == "rankr_chunk" else 16), ("INTERPRET_BV", None)):
        if hasattr(fam.module, attr):
            monkeypatch.setattr(fam.module, attr, value)
    ins, params, S0, g = _case(obj, mix, seed=len(name) + mix)
    ref = reference(obj, ins, params, S0, g)
    assert all(bool(torch.isfinite(v).all()) for v in ref.grads.values())
    cmp = compare(ref, lambda i, p, s: validated_call(fam.prepare, obj, i, p, s, True))
    decay_grads = {f"d{n}" for n in DECAY_NAMES} | {"ddelta", "dA"}
    assert set(cmp.errors) & decay_grads, "no decay gradient compared"
    assert_within(cmp.errors, TOL)


# the chunked families whose backward rewrites d a term by term in a kernel of its own (``*_bwd_da_kernel``),
# with an objective each, the module holding its ``EXACT_DECAY_GRAD`` switch and the decay input's name
EXACT_KERNELS = [("gated_deltanet", "rank1_chunk", "rank1_chunk"), ("kda_like", "rank1_keydecay_chunk", "rank1_keydecay_chunk"),
                 ("two_keys_decay_explicit", "rankr_chunk", "rank1_chunk")]


def _chunked(name, family, objectives, monkeypatch):
    """(obj, family): ``name`` compiled, every family's buffers poisoned, chunks of 16 tokens."""
    if name not in objectives:
        objectives[name] = ssmcraft.compile(OBJECTIVES[name])
    for f in FAMILIES:
        if f.poison is not None:
            monkeypatch.setattr(f.module, "POISON", True)
    fam = BY_NAME[family]
    monkeypatch.setattr(fam.module, "CHUNK", 32 if family == "rankr_chunk" else 16)
    return objectives[name], fam


@pytest.mark.parametrize("mix", [False, True], ids=["tiny", "mixed"])
@pytest.mark.parametrize("name,family,switch", EXACT_KERNELS)
def test_packed_tiny_decays_match_the_reference(name, family, switch, mix, objectives, monkeypatch):
    """A packed row (lengths over, at and under the chunk of 16 tokens, empty ones first and in the
    middle) on tiny and zero decays against the separate float64 reference calls: the exact kernel's
    chunks are each sequence's own, its decay sums restart at each sequence's start."""
    from ssmcraft.ops import registry
    from ssmcraft.runtime import select
    from ssmcraft.runtime.checking import packed_reference
    obj, _ = _chunked(name, family, objectives, monkeypatch)
    monkeypatch.setattr(select, "order", lambda ir, mode: registry.order(ir, "triton"))     # the CUDA order
    lens = [0, 17, 16, 5, 0, 1, 33]
    ins, params, _, g = kernel_inputs(obj, 1, sum(lens), H, D, M, seed=len(name) + 7 * mix)
    S0 = kernel_inputs(obj, len(lens), 1, H, D, M, seed=3)[2]
    ins, params = tiny_decays(obj, ins, params, g, mix)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    obj.prefer = "interpret"
    try:
        cmp = compare(packed_reference(obj, ins, params, S0, cu, g), lambda i, p, s: obj(i, p, s, True, cu_seqlens=cu))
    finally:
        obj.prefer = "auto"
    assert obj.backend == f"triton-interpret:{family.replace('_', '-')}+packed"
    assert set(cmp.errors) >= {"y", "S_T", "dS0", *(f"d{n}" for n in ins)}, sorted(cmp.errors)
    assert_within(cmp.errors, TOL)


@pytest.mark.parametrize("name,family,switch", EXACT_KERNELS)
def test_the_exact_kernel_writes_only_the_decay_gradient(name, family, switch, objectives, monkeypatch):
    """Three chunks of 16 tokens, the middle one holding tiny and zero decays among ordinary ones, the
    others ordinary only: with the exact decay gradient's kernel and without it (``EXACT_DECAY_GRAD``),
    the output, the final state and every gradient but the decay's are equal bit for bit, and so is the
    decay's in the ordinary chunks; in the middle one the kernel's differs, and is finite (its values:
    ``test_tiny_and_zero_decays_match_the_reference``). The kernel runs once per backward (not at all
    with the switch off), and of the tensors it is passed it changes ``da`` alone."""
    import importlib
    obj, fam = _chunked(name, family, objectives, monkeypatch)
    mod = importlib.import_module(f"ssmcraft.ops.{switch}.chunk")
    da_kernel = getattr(importlib.import_module(f"ssmcraft.ops.{switch}.kernels"), f"{switch}_bwd_da_kernel")
    changed = []

    def spy(kernel, grid, *args, **kw):
        if kernel is not da_kernel:
            return launch(kernel, grid, *args, **kw)
        before = {k: t.clone() for k, t in kw.items() if isinstance(t, torch.Tensor)}
        launch(kernel, grid, *args, **kw)
        changed.append({k for k, t in before.items() if not torch.equal(t.nan_to_num(7.), kw[k].nan_to_num(7.))})
    launch = mod.launch
    monkeypatch.setattr(mod, "launch", spy)
    ins, params, S0, g = kernel_inputs(obj, B, 48, H, D, M, seed=11)
    tiny, _ = tiny_decays(obj, ins, params, g, True)
    (dname,) = [n for n in ins if n in DECAY_NAMES]
    a = 0.3 + 0.7 * torch.rand(ins[dname].shape, generator=g, dtype=torch.float64)
    a[:, 16:32] = tiny[dname][:, 16:32]
    ins[dname] = a
    assert (a[:, 16:32] == 0).any() and not (a[:, :16] < 0.3).any() and not (a[:, 32:] < 0.3).any()
    dy = torch.randn(B, 48, H, D, generator=g, dtype=torch.float64).float()
    dS = torch.randn(B, H, D, M, generator=g, dtype=torch.float64).float()

    def run(exact):
        monkeypatch.setattr(mod, "EXACT_DECAY_GRAD", exact)
        x = {k: v.float().requires_grad_() for k, v in ins.items()}
        s0 = S0.float().requires_grad_()
        y, S = validated_call(fam.prepare, obj, x, {k: v.float() for k, v in params.items()}, s0, True)
        grads = torch.autograd.grad((y * dy).sum() + (S * dS).sum(), [*x.values(), s0])
        return {"y": y, "S_T": S, **{f"d{k}": gr for k, gr in zip([*x, "S0"], grads)}}
    on = run(True)
    assert changed == [{"da"}], changed
    off = run(False)
    assert len(changed) == 1
    da = f"d{dname}"
    for k in on:
        if k != da:
            assert torch.equal(on[k], off[k]), k
    for rows in (slice(0, 16), slice(32, 48)):
        assert torch.equal(on[da][:, rows], off[da][:, rows])
    assert torch.isfinite(on[da]).all()
    assert not torch.equal(on[da][:, 16:32], off[da][:, 16:32])
