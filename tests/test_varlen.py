"""Packed sequences (``cu_seqlens``, FLA's convention): a packed call equals N separate calls, on
the output, every final state and every gradient (inputs, params, initial states), for the
reference loop, the CPU PyTorch path and each family with packed kernels (under the interpreter,
every kernel buffer poisoned with NaN); bad offsets give one clear error; ``obj.backend`` names the
path a packed call took."""
import pytest
import torch

import ssmcraft
from ssmcraft.errors import SsmcraftError
from ssmcraft.runtime.checking import compare, packed_reference
from helpers import assert_within, kernel_inputs, rel_rms as rel

LENS = [5, 0, 1, 13, 7]          # odd lengths, a zero-length and a one-token sequence, one over a chunk of 8


def packed_inputs(obj, lens, H=2, d=6, m=4, seed=0):
    """Float64 (inputs [1, sum(lens), H, n], params, S0 [N, H, d, m] (a tuple with several states),
    cu_seqlens int32, generator)."""
    ins, params, _, g = kernel_inputs(obj, 1, sum(lens), H, d, m, seed)
    shapes = obj.state_shapes(len(lens), H, d, m)
    S0 = tuple(torch.randn(s, generator=g, dtype=torch.float64) * 0.5 for s in shapes.values())
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return ins, params, (S0 if obj.ir.states else S0[0]), cu, g


def _flat(S):
    return S if isinstance(S, tuple) else (S,)


def grads(run, ins, params, S0, g_seed=1):
    """(y, final states, {name: grad}) of ``run(ins, params, S0) -> (y, S)`` under fixed random
    cotangents on y and on every final state."""
    leaves = {**{f"in.{k}": v for k, v in ins.items()}, **{f"p.{k}": v for k, v in params.items()},
              **{f"S0.{i}": s for i, s in enumerate(_flat(S0))}}
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
    i = {k[3:]: v for k, v in leaves.items() if k.startswith("in.")}
    p = {k[2:]: v for k, v in leaves.items() if k.startswith("p.")}
    s = tuple(v for k, v in leaves.items() if k.startswith("S0."))
    y, S = run(i, p, s if isinstance(S0, tuple) else s[0])
    g = torch.Generator().manual_seed(g_seed)
    loss = (y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64)).sum()
    for x in _flat(S):
        loss = loss + (x.double() * torch.randn(x.shape, generator=g, dtype=torch.float64)).sum()
    loss.backward()
    return y.detach(), tuple(x.detach() for x in _flat(S)), {k: v.grad for k, v in leaves.items()}


def separate(obj, ins, params, S0, cu):
    """The N sequences as N reference calls (float64), concatenated: (y, final states)."""
    ys, finals = [], []
    for n in range(len(cu) - 1):
        s, e = int(cu[n]), int(cu[n + 1])
        s0 = tuple(x[n:n + 1] for x in _flat(S0))
        y, S = obj.reference({k: v[:, s:e] for k, v in ins.items()}, params,
                             s0 if isinstance(S0, tuple) else s0[0], True)
        ys.append(y)
        finals.append(_flat(S))
    return torch.cat(ys, dim=1), tuple(torch.cat(x, dim=0) for x in zip(*finals))


def packed_errors(obj, lens, call, dtype=torch.float64, **sizes) -> dict:
    """Relative RMS errors of ``call(obj, ins, params, S0, cu) -> (y, S)`` (a packed call, inputs in
    ``dtype``) against the packed reference (each sequence its own reference loop, float64): output,
    final states and every gradient (``ssmcraft.runtime.checking``)."""
    ins, params, S0, cu, g = packed_inputs(obj, lens, **sizes)
    ref = packed_reference(obj, ins, params, S0, cu, g)
    return compare(ref, lambda i, p, s: call(obj, i, p, s, cu), dtype).errors


def _api(obj, ins, params, S0, cu):
    return obj(ins, params, S0, True, cu_seqlens=cu)


@pytest.mark.parametrize("name", ["longhorn", "gla", "mamba", "deltanet", "momentum_longhorn"])
def test_reference_packed_equals_separate(compiled, name):
    """The reference loop's packed form is exactly N reference calls (float64), written out here
    one by one."""
    obj = compiled(name)
    ins, params, S0, cu, _ = packed_inputs(obj, LENS)
    y_r, S_r, g_r = grads(lambda i, p, s: separate(obj, i, p, s, cu), ins, params, S0)
    y, S, g = grads(lambda i, p, s: obj.reference(i, p, s, True, cu_seqlens=cu), ins, params, S0)
    errs = {"y": rel(y, y_r), **{f"S_T.{i}": rel(a, b) for i, (a, b) in enumerate(zip(S, S_r))},
            **{f"grad {k}": rel(g[k], g_r[k]) for k in g_r}}
    assert_within(errs, {"y": 1e-12, "S_T.0": 1e-12, "S_T.1": 1e-12, "grad": 1e-12})


MINIBATCH_DELTA = {"name": "delta_mb", "state": {"S": ["d", "m"]}, "update": "explicit", "output": "S*q",
                   "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"], "normalize": True}, "q": {"shape": ["m"]},
                              "beta": {"shape": [], "bounded": True}},
                   "objective": "beta*sq(S*k - x)/2", "approximation": {"minibatch": 4}}


@pytest.mark.parametrize("name, backend", [
    ("longhorn", "torch-vectorised+padded"), ("retnet", "torch-vectorised+padded"),
    ("momentum_longhorn", "torch-vectorised+padded"),                       # two states
    ("ttt_mlp", "torch-vectorised+padded"),                                 # a deep memory (hidden axes)
    ("minibatch", "torch-vectorised+per-sequence"),                         # chunks from each sequence's start
])
def test_cpu_path_packed_equals_separate(name, backend):
    """The default CPU path (vectorised PyTorch) on a packed call: the sequences as one padded batch
    whose padded steps keep each state (a mini-batch update: per sequence), and its name. Float64
    inputs; params and initial states go in as fp32 (``checking.compare``), hence 1e-6."""
    obj = ssmcraft.compile(MINIBATCH_DELTA if name == "minibatch" else name)
    errs = packed_errors(obj, LENS, _api)
    assert_within(errs, {"y": 1e-6, "grad": 1e-6})
    assert obj.backend == backend
    obj.prefer = "reference"
    packed_errors(obj, [3, 2], _api)
    assert obj.backend == "reference-loop+per-sequence"


def test_packed_without_initial_state_or_final_state(compiled):
    """No initial state: every sequence starts from zero; no final state asked: None."""
    obj = compiled("gla")
    ins, params, _, cu, _ = packed_inputs(obj, [4, 3])
    y, S = obj(ins, params, None, False, cu_seqlens=cu)
    assert S is None
    y_r, S_r = separate(obj, ins, params, torch.zeros(2, 2, 6, 4, dtype=torch.float64), cu)
    assert rel(y, y_r) < 1e-12
    _, S = obj(ins, params, None, True, cu_seqlens=cu.long())
    assert rel(S, S_r[0]) < 1e-12


def test_zero_length_sequence_keeps_its_initial_state(compiled):
    obj = compiled("longhorn")
    ins, params, S0, cu, _ = packed_inputs(obj, [3, 0, 2])
    _, S = obj(ins, params, S0, True, cu_seqlens=cu)
    assert torch.equal(S[1], S0[1])


@pytest.mark.parametrize("cu, B, rows, problem", [
    ([0, 3, 2, 5], 1, 3, "must not decrease, got 3 then 2 at index 2"),
    ([1, 3, 5], 1, 2, "must start at 0, got 1"),
    ([0, 3, 4], 1, 2, "must end at total_T = 5 (the inputs' length), got 4"),
    ([0, 2, 5], 2, 2, "must have B = 1"),
    ([0, 2, 5], 1, 3, "initial_state has 3 rows, but cu_seqlens holds N = 2 sequences"),
    ([0.0, 2.0, 5.0], 1, 2, "must be int32 or int64, got torch.float32"),
    ([5], 1, 1, "must be 1-D with N + 1 >= 2 offsets"),
])
def test_bad_offsets_are_one_clear_error(compiled, cu, B, rows, problem):
    obj = compiled("gla")
    ins, params, _, _, _ = packed_inputs(obj, [5])
    ins = {k: v.expand(B, *v.shape[1:]) for k, v in ins.items()}
    S0 = torch.zeros(rows, 2, 6, 4, dtype=torch.float64)
    offsets = torch.tensor(cu, dtype=torch.float32 if isinstance(cu[0], float) else torch.int32)
    for run in (obj, obj.reference):
        with pytest.raises(SsmcraftError) as e:
            run(ins, params, S0, True, cu_seqlens=offsets)
        assert problem in str(e.value), str(e.value)
        assert str(e.value).startswith("gla: cu_seqlens: ")


# -- families with packed kernels, under the interpreter ---------------------------------------

@pytest.fixture
def poisoned(monkeypatch):
    """Every kernel buffer of the packed families starts as NaN; small chunks so that sequences span
    several chunks, and a chunk boundary falls inside some sequences and not others."""
    from ssmcraft.ops.diagonal import chunk as DG
    from ssmcraft.ops.keydecay_chunk import chunk as KD
    from ssmcraft.ops.general import recurrent as GE
    from ssmcraft.ops.rank1_chunk import chunk as R1C
    from ssmcraft.ops.rank1_row import recurrent as R1W
    from ssmcraft.ops.rankr_chunk import chunk as RRC
    from ssmcraft.ops.rankr_row import recurrent as RRW
    monkeypatch.setattr(KD, "POISON", True)
    monkeypatch.setattr(KD, "CHUNK", 16)
    monkeypatch.setattr(R1C, "POISON", True)        # rankr_chunk's buffers too (the same host code)
    monkeypatch.setattr(R1C, "CHUNK", 16)
    monkeypatch.setattr(RRC, "CHUNK", 32)           # 16 tokens of two terms
    for mod in (R1W, GE, RRW):
        monkeypatch.setattr(mod, "POISON", True)
        monkeypatch.setattr(mod, "CHUNK", 8)     # the backward's checkpoint interval
    monkeypatch.setattr(RRW, "ROW_BLOCK", 8)     # several row blocks (d = 20: the last one partial)
    monkeypatch.setitem(GE.CONFIG, "rows", 8)
    DG.set_poison(True)
    yield
    DG.set_poison(False)


@pytest.fixture
def gpu_order(monkeypatch):
    """The families in their CUDA order (``registry.order``): the chunked WY families ahead of the
    row families for a per-head step, as a GPU dispatches them; the interpreter's order tries the
    row families first."""
    from ssmcraft.ops import registry
    from ssmcraft.runtime import select
    monkeypatch.setattr(select, "order", lambda ir, mode: registry.order(ir, "triton"))


def _interpret(obj, ins, params, S0, cu):
    obj.prefer = "interpret"
    try:
        return obj(ins, params, S0, True, cu_seqlens=cu)
    finally:
        obj.prefer = "auto"


@pytest.mark.parametrize("name, family", [("gla", "keydecay-chunked"), ("retnet", "keydecay-chunked"),
                                          ("mamba", "diagonal-chunked"), ("longhorn_diag", "diagonal-chunked")])
def test_native_family_packed_equals_separate(name, family, poisoned):
    """fp32 kernels on a packed row vs the separate float64 reference calls; lengths cross the
    chunk (16 tokens for keydecay_chunk, 16 for diagonal at K = 12: 4 unrolled steps x 4 sub-chunks),
    stay under it (5, 1) and include an empty sequence, first and in the middle."""
    obj = ssmcraft.compile(name)
    errs = packed_errors(obj, [0, 17, 5, 0, 1, 33], _interpret, dtype=torch.float32, d=20, m=12)
    assert_within(errs, {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5})
    assert obj.backend == f"triton-interpret:{family}+packed"


def _composed(name):
    from ssmcraft.bench.classes_commands import COMPOSED
    from ssmcraft.search.compose import compose_objective
    return ssmcraft.compile(compose_objective(COMPOSED[name]))


@pytest.mark.parametrize("name, family", [("deltanet", "rank1-chunk"), ("gated_deltanet", "rank1-chunk"),
                                          ("rank2_head_gated", "rankr-chunk")])
def test_chunked_delta_family_packed_equals_separate(name, family, poisoned, gpu_order):
    """The chunked WY kernels (``rank1_chunk``; ``rankr_chunk``'s two terms per token through the
    same kernels) on a packed row vs the separate float64 reference calls: chunks of 16 tokens, lengths
    a multiple of the chunk (16, 32), odd ones crossing it (17, 33), under it (5, 1), empty first and
    in the middle and last; every gradient, initial states included, and the final states."""
    obj = _composed(name) if name == "rank2_head_gated" else ssmcraft.compile(name)
    errs = packed_errors(obj, [0, 17, 16, 5, 0, 1, 33, 32, 0], _interpret, dtype=torch.float32, d=20, m=12)
    assert_within(errs, {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5})
    assert obj.backend.startswith(f"triton-interpret:{family}") and obj.backend.endswith("+packed")


@pytest.mark.parametrize("name, family", [("gla", "keydecay-chunked"), ("mamba", "diagonal-chunked"),
                                          ("gated_deltanet", "rank1-chunk"), ("longhorn", "rank1-row-chunk+prologue"),
                                          ("gated_longhorn", "rank1-row-chunk+prologue"),
                                          ("huber_longhorn", "general"), ("longhorn_2key", "rankr-row+prologue")])
def test_native_family_packed_without_final_state(name, family, poisoned, gpu_order):
    """No final state asked (as a training forward calls it): the output and every input's gradient
    equal the packed reference's, and no state comes back."""
    obj = ssmcraft.compile(name)
    errs, S = packed_without_states(obj, [0, 19, 4], d=20, m=12)
    assert S is None and obj.backend == f"triton-interpret:{family}+packed"
    assert_within(errs, {"y": 1e-5, "grad": 2e-5})


def packed_without_states(obj, lens, d, m):
    """A packed call under the interpreter with no initial state (each sequence starts from the
    objective's own start) and no final state asked, as a training forward calls it: (relative
    errors of the output and every input's gradient against the packed float64 reference, the
    state that came back)."""
    ins, params, _, cu, g = packed_inputs(obj, lens, d=d, m=m)
    dy = torch.randn(1, sum(lens), 2, d, generator=g, dtype=torch.float64)

    def run(call, dtype):
        x = {k: v.to(dtype).requires_grad_() for k, v in ins.items()}
        y, S = call(x)
        return y, S, torch.autograd.grad((y.double() * dy).sum(), list(x.values()))
    y_r, _, g_r = run(lambda x: obj.reference(x, params, None, True, cu_seqlens=cu), torch.float64)
    obj.prefer = "interpret"
    y, S, g = run(lambda x: obj(x, params, None, False, cu_seqlens=cu), torch.float32)
    return {"y": rel(y, y_r), **{f"d{k}": rel(a, b) for k, a, b in zip(ins, g, g_r)}}, S


@pytest.mark.parametrize("name, family", [
    ("longhorn", "rank1-row"), ("gated_longhorn", "rank1-row"), ("wd_longhorn", "rank1-row"),
    ("cauchy_delta", "general"),                  # the rows summed in the step: one row block
    ("huber_longhorn", "general"),                # nonlinear, row-tiled
    ("momentum_longhorn", "general"),             # two states
    ("longhorn_2key", "rankr-row"),               # the family's own kernels (no decay)
    ("rr_explicit_head", "rankr-row"),            # a decay: the generated kernels, row-tiled
])
def test_sequential_family_packed_equals_separate(name, family, poisoned):
    """The sequential kernels (``rank1_row``: exact Longhorn, a per-row decay, weight decay; the
    generated ``general`` ones; ``rankr_row``'s own and generated) on a packed row, one program row
    per sequence, in row blocks of 8 where the rows are independent: lengths over the backward's
    checkpoint interval (8 here), odd, 0 and 1, an empty sequence first, in the middle and last."""
    from test_kernels_rankr_row import SPECS
    obj = ssmcraft.compile(SPECS.get(name, name))
    errs = packed_errors(obj, [0, 17, 5, 0, 1, 33, 0], _interpret, dtype=torch.float32, d=20, m=12)
    assert_within(errs, {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5})
    assert obj.backend.startswith(f"triton-interpret:{family}") and obj.backend.endswith("+packed")


def test_family_without_packed_kernels_runs_each_sequence_and_says_why(monkeypatch):
    """Exact Longhorn with ``rank1_row`` (and ``rank1_row_chunk``, which runs it too) declared without
    packed kernels, under the interpreter: each sequence runs the row kernel on its own, equal to the
    separate reference calls, and the backend names both."""
    from ssmcraft.ops.registry import family
    assert family("keydecay_chunk").varlen is None and family("diagonal").varlen is None
    assert family("rank1_row").varlen is None and family("rank1_row_chunk").varlen is None
    monkeypatch.setattr(family("rank1_row"), "varlen", "no packed-sequence (cu_seqlens) kernels")
    monkeypatch.setattr(family("rank1_row_chunk"), "varlen", "no packed-sequence (cu_seqlens) kernels")
    obj = ssmcraft.compile("longhorn")
    errs = packed_errors(obj, [0, 5, 1, 3], _interpret, dtype=torch.float32)
    assert_within(errs, {"y": 1e-5, "grad": 2e-5})
    assert obj.backend == ("triton-interpret:rank1-row+prologue+per-sequence (no packed kernel: rank1_row: "
                           "no packed-sequence (cu_seqlens) kernels; rank1_row_chunk: no packed-sequence (cu_seqlens) "
                           "kernels; no later family runs it)")


def test_all_sequences_empty(compiled):
    """total_T = 0: no output rows, and every final state is its initial state."""
    obj = ssmcraft.compile("gla")
    ins, params, S0, cu, _ = packed_inputs(obj, [0, 0])
    y, S = obj(ins, params, S0, True, cu_seqlens=cu)
    assert y.shape == (1, 0, 2, 6) and torch.equal(S, S0)
