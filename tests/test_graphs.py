"""CUDA graphs on CPU: the refusals (CPU tensors, another call signature, graphed
decoding of a growing cache), ``train.cuda_graphs``' decision and its record, and the parts of
the captured work that run without a graph: the decode step over static buffers
(``StaticDecodeState``, what ``GraphedDecoder`` captures) against eager ``LM.step``, and the
captured training loss module against the eager loss. The captures themselves run on a GPU:
``benchmarks/bench_graphs.py`` checks them against eager ``obj()``, training and decoding."""
from __future__ import annotations

import json

import pytest
import torch

import ssmcraft
from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.runtime.graphs import _entries, call_signature, require_cuda, signature_difference
from ssmcraft.layers import LM, LMConfig
from ssmcraft.layers.graphed_decode import GraphedDecoder, StaticDecodeState
from ssmcraft.train import train_run
from ssmcraft.train.compiled import compile_decision
from ssmcraft.train.config import resolve
from ssmcraft.train.device import autocast
from ssmcraft.train.graphed import GraphedLoss, _LossModule, graphs_decision
from ssmcraft.train.validate import batch_loss

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _inputs(B=2, T=5, H=2, d=4, m=3, grad=False):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(B, T, H, k, generator=g).requires_grad_(grad) for n, k in (("x", d), ("k", m), ("q", m))}


def test_graphed_refuses_cpu_tensors():
    obj = ssmcraft.compile("longhorn")
    ins = _inputs()
    ins["beta"] = torch.rand(2, 5, 2, 4)
    with pytest.raises(SsmcraftError, match="CUDA graphs need a CUDA device"):
        obj.graphed(ins)


def test_a_number_is_refused_by_place(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # reach the per-tensor check
    with pytest.raises(SsmcraftError, match=r"params\['A'\] is a float; CUDA graphs need"):
        require_cuda([("params['A']", 0.5)])
    with pytest.raises(SsmcraftError, match=r"initial_state is on cpu; CUDA graphs need a CUDA device"):
        require_cuda([("initial_state", torch.zeros(1))])


def test_signature_differences_are_named():
    ins = _inputs()
    base = call_signature(_entries(ins, None, torch.zeros(2, 2, 4, 3)), True)
    assert signature_difference(base, call_signature(_entries(ins, None, torch.zeros(2, 2, 4, 3)), True)) is None
    longer = {n: torch.zeros(2, 7, *t.shape[2:]) for n, t in ins.items()}
    assert signature_difference(base, call_signature(_entries(longer, None, torch.zeros(2, 2, 4, 3)), True)) == (
        "inputs['x']: shape [2, 7, 2, 4] (captured [2, 5, 2, 4]); inputs['k']: shape [2, 7, 2, 3] "
        "(captured [2, 5, 2, 3]); inputs['q']: shape [2, 7, 2, 3] (captured [2, 5, 2, 3])")
    bf = {**ins, "k": ins["k"].bfloat16()}
    assert signature_difference(base, call_signature(_entries(bf, None, torch.zeros(2, 2, 4, 3)), True)) == (
        "inputs['k']: dtype torch.bfloat16 (captured torch.float32)")
    grad = call_signature(_entries(ins, None, torch.zeros(2, 2, 4, 3, requires_grad=True)), False)
    assert signature_difference(base, grad) == ("initial_state: requires_grad True (captured False); "
                                                "output_final_state is False (captured True)")
    no_state = call_signature(_entries(ins, None, None), True)
    assert signature_difference(base, no_state) == "the tensors differ: captured with inputs['x'], inputs['k'], " \
                                                   "inputs['q'], initial_state; missing initial_state"
    reordered = {"k": ins["k"], "x": ins["x"], "q": ins["q"]}
    swapped = call_signature(_entries(reordered, None, torch.zeros(2, 2, 4, 3)), True)
    assert signature_difference(base, swapped).startswith("the tensors come in another order")
    two = call_signature(_entries(ins, {"A": torch.zeros(4, 3)}, (torch.zeros(1), torch.zeros(1))), True)
    assert [r[0] for r in two[:-1]] == ["inputs['x']", "inputs['k']", "inputs['q']", "params['A']",
                                        "initial_state[0]", "initial_state[1]"]


def test_graphs_decision_and_compile_interplay():
    assert graphs_decision(False, CUDA, False) == (False, "train.cuda_graphs is false")
    assert graphs_decision("auto", CPU, False) == (
        False, "train.cuda_graphs auto: not applicable on cpu (CUDA graphs need a CUDA device)")
    assert graphs_decision("auto", CUDA, False) == (True, "train.cuda_graphs auto: on for CUDA")
    assert graphs_decision("auto", CUDA, True)[0] is False
    assert graphs_decision(True, CUDA, False) == (True, "train.cuda_graphs is true")
    with pytest.raises(SpecError, match="train.cuda_graphs: true needs a CUDA device; this run is on cpu"):
        graphs_decision(True, CPU, False, "x.yaml")
    with pytest.raises(SpecError, match="true together with train.compile true"):
        graphs_decision(True, CUDA, True)
    # graphs forced on: compile's auto steps aside; compile's explicit true stays (and is refused above)
    assert compile_decision("auto", CUDA, True)[0] is False
    assert compile_decision("auto", CUDA, "auto")[0] is False          # the default on CUDA: graphs, not compile
    assert "cuda_graphs is auto" in compile_decision("auto", CUDA, "auto")[1]
    assert compile_decision("auto", CUDA, False) == (True, "train.compile auto: on for CUDA with train.cuda_graphs false")
    assert compile_decision("auto", CPU, "auto") == (False, "train.compile auto: off on cpu")
    assert compile_decision(True, CUDA, True) == (True, "train.compile is true")
    assert compile_decision(True, CPU, "auto")[0] and not compile_decision(False, CUDA, False)[0]


def _mqar(**train):
    return {"name": "tiny", "seed": 0, "task": {"name": "mqar", "vocab": 64, "seq_len": 32, "num_kv_pairs": 4},
            "model": {"d_model": 32, "n_layers": 1, "mixer": {"kind": "objective", "objective": "longhorn",
                                                              "state_size": 8}},
            "train": {"batch_size": 4, "tokens": 4 * 32 * 2, "eval_every": 0, "eval_batches": 1,
                      "eval_batch_size": 4, "save_model": False, **train}}


def test_train_records_the_decision_and_refuses_true_on_cpu(tmp_path):
    m = train_run(_mqar(device="cpu"), tmp_path / "auto")
    assert m["status"] == "ok"
    assert m["cuda_graphs"] == {"setting": "auto", "enabled": False, "graphed_steps": 0, "eager_steps": m["steps"],
                                "reason": "train.cuda_graphs auto: not applicable on cpu (CUDA graphs need a CUDA "
                                          "device)"}
    assert "CUDA graphs: train.cuda_graphs auto: not applicable on cpu" in (tmp_path / "auto" / "train.log").read_text()
    with pytest.raises(SpecError, match="train.cuda_graphs: true needs a CUDA device"):
        train_run(_mqar(device="cpu", cuda_graphs=True), tmp_path / "true")
    with pytest.raises(SpecError, match="train.cuda_graphs: expected auto, true or false, got 'on'"):
        train_run(_mqar(cuda_graphs="on"), tmp_path / "bad")
    # the config-only conflict is refused by the config check, before a model or batch is built
    with pytest.raises(SpecError, match="x.yaml: train.cuda_graphs: true together with train.compile true"):
        resolve(_mqar(cuda_graphs=True, compile=True), "x.yaml")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_captured_loss_module_is_the_eager_loss(precision):
    """What ``GraphedLoss`` captures: the loss and every parameter gradient of the eager step, under
    the run's autocast (bf16: CPU autocast here, the captured module's with its cache off)."""
    torch.manual_seed(0)
    lm = LM(LMConfig(vocab_size=30, d_model=16, n_layers=2, mixer={"kind": "objective", "objective": "mamba",
                                                                    "heads": 2, "state_size": 4}))
    x, y = torch.randint(0, 30, (3, 9)), torch.randint(0, 30, (3, 9))
    with autocast(CPU, precision):
        logits = lm(x)
    assert logits.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    eager = batch_loss(logits, y)
    ge = torch.autograd.grad(eager, list(lm.parameters()))
    mod = _LossModule(lm, CPU, precision)
    assert list(mod.parameters()) == list(lm.parameters())      # make_graphed_callables differentiates these
    mine = mod(x, y)
    gm = torch.autograd.grad(mine, list(lm.parameters()))
    assert torch.equal(mine, eager) and all(torch.equal(a, b) for a, b in zip(ge, gm))


MIXERS = {"longhorn": {"kind": "objective", "objective": "longhorn", "heads": 2, "state_size": 4},
          "momentum_longhorn": {"kind": "objective", "objective": "momentum_longhorn", "heads": 2, "state_size": 4}}


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_static_decode_state_follows_eager_step(name):
    """The captured decode body: static token and caches updated in place give eager ``step``'s
    logits token by token (several states included); ``reset`` and ``load`` restart a sequence."""
    torch.manual_seed(0)
    lm = LM(LMConfig(vocab_size=40, d_model=16, n_layers=2, mixer=MIXERS[name])).double()
    tokens = torch.randint(0, 40, (3, 7))
    static = StaticDecodeState(lm, 3)
    ids = [id(c.conv) for c in static.caches]
    caches = lm.init_cache(3)
    for run in range(2):
        for t in range(7):
            logits, caches = lm.step(tokens[:, t], caches)
            static.token.copy_(tokens[:, t])
            assert torch.equal(static.advance(), logits)
        assert [id(c.conv) for c in static.caches] == ids          # the same buffers, written in place
        static.reset()
        caches = lm.init_cache(3)
    _, prefix = lm.step(tokens[:, 0], lm.init_cache(3))
    static.load(prefix)
    static.token.copy_(tokens[:, 1])
    assert torch.equal(static.advance(), lm.step(tokens[:, 1], prefix)[0])


def test_graphed_decoding_refusals(monkeypatch):
    lm = LM(LMConfig(vocab_size=40, d_model=16, n_layers=1, mixer={"kind": "attention", "heads": 2}))
    with pytest.raises(SsmcraftError, match="layer 0 has a KVCache .* only objective mixers"):
        StaticDecodeState(lm, 2)
    lm = LM(LMConfig(vocab_size=40, d_model=16, n_layers=1, mixer=MIXERS["longhorn"]))
    with pytest.raises(SsmcraftError, match="graphed decoding: CUDA graphs need a CUDA device"):
        GraphedDecoder(lm, 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # a GPU machine: the CPU model is named
    with pytest.raises(SsmcraftError, match="graphed decoding: the model is on cpu; CUDA graphs need a CUDA device"):
        GraphedDecoder(lm, 2)
    with pytest.raises(SsmcraftError, match="train.cuda_graphs: the model is on cpu; CUDA graphs need a CUDA device"):
        GraphedLoss(lm, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), CPU, "fp32")


def test_graphed_training_path_capture_failure_is_recorded_or_raised(tmp_path, monkeypatch):
    """The loop's graphed branch with the decision forced on (CPU): ``GraphedLoss`` refuses CPU, so
    under ``auto`` the failure is recorded as ``fallback`` and every step runs eager; under ``true``
    the run raises."""
    from ssmcraft.train import loop

    monkeypatch.setattr(loop, "graphs_decision", lambda setting, *a: (True, "forced on for the test"))
    m = train_run(_mqar(device="cpu"), tmp_path / "auto")
    assert m["status"] == "ok" and m["steps"] == 2
    info = m["cuda_graphs"]
    assert info["enabled"] is False and info["reason"] == "forced on for the test"
    assert info["fallback"].startswith("capture failed: SsmcraftError: train.cuda_graphs: CUDA graphs need a "
                                       "CUDA device") and info["fallback"].endswith("; ran eager")
    assert info["graphed_steps"] == 0 and info["eager_steps"] == 2        # every step ran eager
    assert "CUDA graph capture of the training step failed" in (tmp_path / "auto" / "train.log").read_text()
    with pytest.raises(SsmcraftError, match="train.cuda_graphs: capturing the training step failed: SsmcraftError"):
        train_run(_mqar(device="cpu", cuda_graphs=True), tmp_path / "true")


def test_graphed_training_path_steps_through_the_captured_loss(tmp_path, monkeypatch):
    """The loop's graphed branch with the real ``GraphedLoss`` and CUDA's capture replaced by the
    captured function itself (``make_graphed_callables`` -> ``_LossModule``, called directly):
    captured once at step 0, every step counted as graphed, the per-step losses and the final
    validation those of the eager run."""
    from ssmcraft.train import graphed, loop

    made = []

    def capture(fn, sample, **kw):
        assert isinstance(fn, _LossModule) and kw["num_warmup_iters"] == 3
        made.append(tuple(sample[0].shape))
        return fn

    eager = train_run(_mqar(device="cpu", tokens=4 * 32 * 3), tmp_path / "eager")
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    monkeypatch.setattr(graphed, "require_cuda", lambda entries, what="graphed": None)
    monkeypatch.setattr(loop, "graphs_decision", lambda setting, *a: (True, "forced on for the test"))
    m = train_run(_mqar(device="cpu", tokens=4 * 32 * 3), tmp_path / "graphed")
    assert made == [(4, 32)]                                    # captured once, at the first step
    assert m["cuda_graphs"] == {"setting": "auto", "enabled": True, "reason": "forced on for the test",
                                "graphed_steps": 3, "eager_steps": 0}
    assert m["steps"] == 3 and m["status"] == "ok" and eager["cuda_graphs"]["enabled"] is False
    history = [json.loads((tmp_path / run / "history.json").read_text())["train"] for run in ("eager", "graphed")]
    assert [r["loss"] for r in history[1]] == [r["loss"] for r in history[0]] and len(history[0]) == 3
    assert m["val_loss"] == eager["val_loss"]


def _call_tensors(obj, B=2, T=5, H=2, d=4, m=3, with_state=True, seed=0):
    """Random inputs, params and (several) initial state(s) for ``obj``, all requiring grad."""
    g = torch.Generator().manual_seed(seed)
    size = {"d": d, "m": m}

    def rand(*shape):
        return (torch.rand(*shape, generator=g) * 0.5 + 0.25).double().requires_grad_()

    inputs = {n: rand(B, T, H, *(size[s] for s in dims)) for n, dims in obj.ir.inputs.items()}
    params = {n: rand(H, *(size[s] for s in dims)) for n, dims in obj.ir.params.items()}
    n_states = len(obj.ir.states)
    S0 = None
    if with_state:
        S0 = tuple(rand(B, H, d, m) for _ in range(n_states)) if n_states else rand(B, H, d, m)
    return inputs, params, S0


def _flat(inputs, params, S0):
    return [*inputs.values(), *params.values(), *(S0 if isinstance(S0, tuple) else () if S0 is None else (S0,))]


@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("name", ["longhorn", "momentum_longhorn", "mamba"])
def test_graphed_call_bookkeeping_is_obj(name, with_state, monkeypatch):
    """``GraphedCall`` with the capture replaced by the captured function itself (so it runs on
    CPU): the flat order and its unflattening (params ``{}`` -> None, one state or a tuple), the
    packing of several final states, ``static_inputs()``: outputs and every gradient (the initial
    state's included) equal ``obj()``'s."""
    from ssmcraft.runtime import graphs

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", lambda f, sample, **kw: f)
    monkeypatch.setattr(graphs, "require_cuda", lambda entries, what="graphed": None)
    obj = ssmcraft.compile(name)
    obj.prefer = "torch"
    inputs, params, S0 = _call_tensors(obj, with_state=with_state)
    g = obj.graphed(inputs, params, S0, output_final_state=True)
    for call_params in (params, None) if not params else (params,):
        y, S = g(inputs, call_params, S0)
        y_ref, S_ref = obj(inputs, params or None, S0, True)
        assert torch.equal(y, y_ref)
        assert type(S) is type(S_ref) and (len(S) == len(obj.ir.states) if isinstance(S, tuple) else True)
        finals = S if isinstance(S, tuple) else (S,)
        finals_ref = S_ref if isinstance(S_ref, tuple) else (S_ref,)
        assert all(torch.equal(a, b) for a, b in zip(finals, finals_ref, strict=True))
        leaves = _flat(inputs, params, S0)
        out = (y * 1.3).sum() + sum((s * 0.7).sum() for s in finals)
        ref = (y_ref * 1.3).sum() + sum((s * 0.7).sum() for s in finals_ref)
        for a, b in zip(torch.autograd.grad(out, leaves), torch.autograd.grad(ref, leaves), strict=True):
            assert torch.equal(a, b)
    s_inputs, s_params, s_S0 = g.static_inputs()
    assert list(s_inputs) == list(inputs) and (s_params is None) == (not params)
    assert (s_S0 is None) == (S0 is None) and isinstance(s_S0, tuple) == isinstance(S0, tuple)
    for mine, theirs in zip(_flat(s_inputs, s_params or {}, s_S0), _flat(inputs, params, S0), strict=True):
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr() and mine.requires_grad
    assert torch.equal(g(s_inputs, s_params, s_S0)[0], y_ref)
    with pytest.raises(SsmcraftError, match="another signature than the one captured"):
        g(inputs, params, S0, output_final_state=False)
    if S0 is None:              # the same signature through the full check: an empty state tuple for None
        assert torch.equal(g(inputs, params, ())[0], y_ref)
    with pytest.raises(SsmcraftError, match="the tensors come in another order"):
        g(dict(reversed(list(inputs.items()))), params, S0)
    longer = {n: t.detach()[:, :3].requires_grad_() for n, t in inputs.items()}
    with pytest.raises(SsmcraftError, match=r"inputs\['x'\]: shape \[2, 3, 2, 4\] \(captured \[2, 5, 2, 4\]\)"):
        g(longer, params, S0)


def test_static_decode_state_load_refuses_caches_that_do_not_fit():
    """``load`` checks the layer count and every shape: a batch-1 prefill is not broadcast into a
    batch-3 decoder, and a missing layer is not dropped."""
    torch.manual_seed(0)
    lm = LM(LMConfig(vocab_size=40, d_model=16, n_layers=2, mixer=MIXERS["momentum_longhorn"]))
    static = StaticDecodeState(lm, 3)
    with pytest.raises(SsmcraftError, match=r"layer 0's cache .* has shapes \[\[1, "):
        static.load(lm.init_cache(1))
    with pytest.raises(SsmcraftError, match="1 layer cache\\(s\\) given; this model has 2"):
        static.load(lm.init_cache(3)[:1])
    static.load(lm.init_cache(3))


def test_graphed_call_names_a_number_where_a_tensor_was_captured(monkeypatch):
    """A call passing a number where a tensor was captured gets ``require_cuda``'s message for that place."""
    from ssmcraft.runtime import graphs

    real = graphs.require_cuda
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", lambda f, sample, **kw: f)
    monkeypatch.setattr(graphs, "require_cuda", lambda entries, what="graphed": None)
    obj = ssmcraft.compile("mamba")
    inputs, params, S0 = _call_tensors(obj)
    g = obj.graphed(inputs, params, S0)
    monkeypatch.setattr(graphs, "require_cuda", real)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SsmcraftError, match=r"mamba: graphed: params\['A'\] is a float; CUDA graphs need a CUDA "
                                            r"device and tensors"):
        g(inputs, {"A": 0.5}, S0)


def test_warmup_below_one_is_refused():
    """No silent ``max(1, warmup)``: the warm-up compiles and tunes outside the capture."""
    lm = LM(LMConfig(vocab_size=40, d_model=16, n_layers=1, mixer=MIXERS["longhorn"]))
    x = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(SsmcraftError, match=r"longhorn: graphed: warmup must be an integer >= 1 .*got 0"):
        ssmcraft.compile("longhorn").graphed(_inputs(), warmup=0)
    with pytest.raises(SsmcraftError, match=r"graphed decoding: warmup must be an integer >= 1 .*got -1"):
        GraphedDecoder(lm, 2, warmup=-1)
    with pytest.raises(SsmcraftError, match=r"train.cuda_graphs: warmup must be an integer >= 1 .*got 0"):
        GraphedLoss(lm, x, x, CPU, "fp32", warmup=0)
