"""``ssmcraft bench --graphed`` and ``benchmarks/bench_graphs.py``'s obj() section on CPU: the refusals
(no CUDA, ``--layer``), the plumbing (every captured call is an eager call's signature; eager,
graphed and static timed for fwd and fwd+bwd; the identity check run), the identity check itself
(``checking.graphed_against_eager``: exact on a faithful capture, failing on a wrong one), with CUDA's
capture replaced by the captured function itself as in ``tests/test_graphs.py``. The captures and
timings themselves run on a GPU (``ssmcraft bench ... --graphed``, ``benchmarks/bench_graphs.py``)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import ssmcraft
from ssmcraft.cli import main
from ssmcraft.errors import SsmcraftError
from ssmcraft.bench import commands, run
from ssmcraft.runtime import dispatch
from ssmcraft.runtime import graphs
from ssmcraft.runtime import timing
from ssmcraft.runtime.checking import graphed_against_eager, rel_max
from ssmcraft.runtime.graphs import _entries, call_signature

ROOT = Path(__file__).resolve().parents[1]


def test_graphed_without_cuda_is_one_line_error_and_no_eager_run(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    monkeypatch.setattr(dispatch, "run_fast", lambda *a, **k: ran.append(a))
    assert main(["bench", "deltanet", "--shape", "1,4,1,8,4", "--graphed"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not ran
    assert err == ("ssmcraft bench: error: --graphed: CUDA graphs need a CUDA device; torch.cuda.is_available() "
                   "is false on this machine\n")


def test_layer_graphed_is_refused_before_anything_runs(capsys):
    assert main(["bench", "deltanet", "--shape", "1,4,1,8,4", "--layer", "--graphed"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ssmcraft bench: error: --layer --graphed: the mixer has no "
                                                   "graphed form of its own")
    assert "train.cuda_graphs" in err and "Traceback" not in err


@pytest.fixture
def capture_is_the_function(monkeypatch):
    """CUDA's capture replaced by the captured function (runs on CPU); the captured signatures recorded."""
    made = []

    def capture(fn, sample, **kw):
        assert kw["num_warmup_iters"] == 3 and kw["allow_unused_input"] is True
        made.append(fn.__self__.signature)
        return fn
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    monkeypatch.setattr(graphs, "require_cuda", lambda entries, what="graphed": None)
    return made


@pytest.fixture
def timed_calls(monkeypatch):
    """``timing.bench_ms`` replaced by one run of the call (a GPU as far as run_bench can tell, fake
    copy bandwidth): returns the list of ``(grad enabled, {the engine's multithreading flag at each
    torch.autograd.grad in the call})`` per timed call; the fake time of call i is 0.25 * (i + 2)."""
    timed, engine, real_grad = [], [], torch.autograd.grad

    def grad_spy(*a, **k):
        engine.append(torch._C._is_multithreading_enabled())
        return real_grad(*a, **k)

    def fake_bench(fn, *a, **k):
        n = len(engine)
        fn()
        timed.append((torch.is_grad_enabled(), set(engine[n:])))
        return 0.25 + 0.25 * len(timed)
    monkeypatch.setattr(torch.autograd, "grad", grad_spy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "bench_ms", fake_bench)
    monkeypatch.setattr(timing, "copy_bandwidth", lambda dev: 1e12)
    return timed


def _eager_signatures(monkeypatch) -> list:
    """Every ``obj()`` call's signature (eager calls and the captured function's calls alike)."""
    seen, real = [], dispatch.run_fast

    def spy(obj, inputs, params, initial_state, output_final_state):
        seen.append(call_signature(_entries(inputs, params, initial_state), output_final_state))
        return real(obj, inputs, params, initial_state, output_final_state)
    monkeypatch.setattr(dispatch, "run_fast", spy)
    return seen


@pytest.mark.parametrize("backward", [True, False])
def test_bench_graphed_times_the_eager_calls_signatures(backward, capture_is_the_function, timed_calls, monkeypatch,
                                                        capsys):
    """run_bench(graphed=True) on CPU tensors (the torch path): the graphs are captured with exactly the
    signatures of eager calls (fwd on detached tensors, fwd+bwd on the leaves, the check with an initial
    state and output_final_state); eager, graphed and static timed per kind, with GPU busy; the check
    exact; the table prints every figure next to eager's."""
    timed = timed_calls
    monkeypatch.setattr(timing, "busy", lambda fn, n=30: (fn(), (0.5, 1.0, 12.0))[1])
    seen = _eager_signatures(monkeypatch)
    res = run.run_bench("gated_deltanet", (2, 5, 2, 4, 3), "fp32", backward=backward, graphed=True,
                             device="cpu", prefer="torch")
    made = capture_is_the_function
    assert len(made) == (3 if backward else 2)             # fwd, fwd+bwd, the check
    assert set(made) <= set(seen)                           # every capture is an eager call's signature
    fwd_sig = made[0]
    assert all(row[4] is False for row in fwd_sig[:-1]) and fwd_sig[-1] == ("output_final_state", False)
    if backward:
        assert all(row[4] is True for row in made[1][:-1]) and made[1][-1] == ("output_final_state", False)
    check_sig = made[-1]
    assert check_sig[-2][0] == "initial_state" and check_sig[-1] == ("output_final_state", True)
    kinds = ("fwd", "fwd_bwd") if backward else ("fwd",)
    calls = [(how, kind) for how in timing.HOWS for kind in kinds if how != "onethread" or kind == "fwd_bwd"]
    for how, kind in calls:
        assert res[f"{how}_{kind}_ms"] > 0 and res[f"{how}_busy_{kind}"] == 0.5
        assert res[f"{how}_host_us_{kind}"] == 12.0
    assert "onethread_fwd_ms" not in res and ("onethread_fwd_bwd_ms" in res) == backward
    # fwd under no_grad; only onethread's fwd+bwd with the autograd engine on the calling thread
    assert timed == [(kind == "fwd_bwd", {how != "onethread"} if kind == "fwd_bwd" else set()) for how, kind in calls]
    assert res["fwd_ms"] == res["eager_fwd_ms"] and ("fwd_bwd_ms" in res) == backward
    assert res["check_ok"] and res["check_exact"] and not res["check_missing"]
    expected = {"y", "S_T"} | ({"dx", "dk", "dq", "dbeta", "dalpha", "dS0"} if backward else set())
    assert set(res["check_errors"]) == expected
    commands._print(res)
    out = capsys.readouterr().out
    assert "CUDA graphs (obj.graphed" in out and "    eager  1-thread   graphed    static" in out
    assert "fwd+bwd, 1 thread" not in out               # with --graphed only in the table's column
    for kind, label in (("fwd", "fwd ms"), ("fwd_bwd", "fwd+bwd ms"))[:len(kinds)]:
        assert f"  {label:18s} " + " ".join(f"{res[f'{h}_{kind}_ms']:9.3f}" if f"{h}_{kind}_ms" in res else f"{'-':>9s}"
                                            for h in timing.HOWS) + "\n" in out
    assert "check graphed vs eager (y, S_T" in out and "exact PASS" in out


def test_bench_times_fwd_bwd_both_ways_without_graphs(timed_calls, capsys):
    """Plain run_bench (no --graphed): fwd+bwd timed as PyTorch runs it and with the autograd engine on
    the calling thread, both printed; nothing graphed."""
    res = run.run_bench("gated_deltanet", (2, 5, 2, 4, 3), "fp32", device="cpu", prefer="torch")
    # fwd (no grad), eager fwd+bwd, 1-thread fwd+bwd
    assert timed_calls == [(False, set()), (True, {True}), (True, {False})]
    assert (res["fwd_ms"], res["fwd_bwd_ms"], res["onethread_fwd_bwd_ms"]) == (0.5, 0.75, 1.0)
    assert "graphed" not in res and "graphed_fwd_ms" not in res
    commands._print(res)
    out = capsys.readouterr().out
    assert "  fwd+bwd, 1 thread     1.000 ms" in out and "CUDA graphs" not in out


def test_graphed_against_eager_fails_on_a_wrong_capture(monkeypatch):
    """The identity check can fail: a capture whose replay is off by 1e-3 in y is named, not passed."""
    def capture(fn, sample, **kw):
        def wrong(*flat):
            y, *rest = fn(*flat)
            return (y * (1 + 1e-3), *rest)
        return wrong
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    monkeypatch.setattr(graphs, "require_cuda", lambda entries, what="graphed": None)
    obj = ssmcraft.compile("deltanet")
    obj.prefer = "torch"
    inputs, params = run.random_inputs(obj, 2, 5, 2, 4, 3, torch.float32, "cpu", requires_grad=True)
    S0 = run.random_state(obj, 2, 2, 4, 3, "cpu", requires_grad=True)
    res = graphed_against_eager(obj, inputs, params, S0)
    assert not res["check_ok"] and not res["check_exact"]
    assert res["check_errors"]["y"] == pytest.approx(1e-3, rel=1e-6) and res["check_errors"]["S_T"] == 0.0
    assert res["check_errors"]["dS0"] > 1e-5 and res["check_eager_repeat_rel"] == 0.0    # y's error reaches dS0


def test_rel_max():
    a = torch.tensor([1.0, -4.0])
    assert rel_max(a, a) == 0.0 and rel_max(torch.zeros(2), torch.zeros(2)) == 0.0
    assert rel_max(torch.tensor([1.0, -3.0]), a) == 0.25
    assert rel_max(torch.tensor([float("nan"), -4.0]), a) != rel_max(torch.tensor([float("nan"), -4.0]), a)


def _bench_graphs():
    spec = importlib.util.spec_from_file_location("bench_graphs", ROOT / "benchmarks" / "bench_graphs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_graphs_obj_row_of_gated_deltanet_on_cpu(capture_is_the_function, monkeypatch, capsys):
    """bench_graphs' obj() row for Gated DeltaNet with the capture and the timers stubbed: every
    figure of the table and a passing, exact identity check over y, S_T and every gradient (dS0 too)."""
    bg = _bench_graphs()
    monkeypatch.setattr(timing, "bench_ms", lambda fn, *a, **k: (fn(), 1.0)[1])
    monkeypatch.setattr(timing, "busy", lambda fn, n=30: (fn(), (0.9, 1.0, 20.0))[1])
    rep = bg.Report("test")
    bg.obj_rows(rep, "gated_deltanet", 2, 4, 3, 2, 5, device="cpu")
    row = rep.data["rows"][0]
    assert row["objective"] == "gated_deltanet" and len(capture_is_the_function) == 3
    assert row["check_ok"] and row["check_exact"]
    assert set(row["check_errors"]) == {"y", "S_T", "dx", "dk", "dq", "dbeta", "dalpha", "dS0"}
    bg.table(rep)
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("gated_deltanet |")]
    assert line == ["gated_deltanet | 1.000 / 1.000 / 1.000 | 1.000 / 1.000 / 1.000 / 1.000 | 20 / 20, 20, 20 / 20, "
                    "20 / 20 | 0.90 / 0.90 / 0.90 / 0.90 | exact PASS"]


def test_graphed_against_eager_covers_several_states(capture_is_the_function):
    """Two states (momentum Longhorn): both final states and both initial states' gradients compared."""
    obj = ssmcraft.compile("momentum_longhorn")
    obj.prefer = "torch"
    inputs, params = run.random_inputs(obj, 2, 5, 2, 4, 3, torch.float32, "cpu", requires_grad=True)
    S0 = run.random_state(obj, 2, 2, 4, 3, "cpu", requires_grad=True)
    assert isinstance(S0, tuple) and len(S0) == 2
    res = graphed_against_eager(obj, inputs, params, S0)
    assert res["check_ok"] and res["check_exact"]
    assert {"y", "D_T", "S_T", "dD0", "dS0"} <= set(res["check_errors"]) and not res["check_missing"]


def test_a_failed_capture_is_one_line_naming_what(monkeypatch, capsys):
    """A capture that raises (an unsafe op, say) reaches the user as one line naming what was captured."""
    def capture(fn, sample, **kw):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    monkeypatch.setattr(graphs, "require_cuda", lambda entries, what="graphed": None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SsmcraftError, match=r"^--graphed: capturing obj\(\) \(fwd, fwd\+bwd\) failed: "
                                                            r"RuntimeError: operation not permitted when stream is "
                                                            r"capturing$"):
        run.run_bench("deltanet", (1, 3, 1, 4, 3), "fp32", graphed=True, device="cpu", prefer="torch")


def test_check_names_what_eager_cannot_compute(capture_is_the_function):
    """Eager values that are not finite (a diverging recurrence) fail the check by name, not by NaN
    comparing false somewhere."""
    obj = ssmcraft.compile("deltanet")
    obj.prefer = "torch"
    inputs, params = run.random_inputs(obj, 2, 5, 2, 4, 3, torch.float32, "cpu", requires_grad=True)
    S0 = run.random_state(obj, 2, 2, 4, 3, "cpu")
    with torch.no_grad():
        S0[0, 0, 0, 0] = float("inf")
    res = graphed_against_eager(obj, inputs, params, S0.requires_grad_())
    assert not res["check_ok"] and {"y", "S_T"} <= set(res["check_nonfinite"])


def test_bench_inputs_follow_the_spec():
    """``normalize: true`` inputs are unit vectors (the delta rule's step is stable then), bounded ones in (0, 1)."""
    obj = ssmcraft.compile("gated_deltanet")
    inputs, _ = run.random_inputs(obj, 2, 7, 3, 4, 5, torch.float32, "cpu")
    for n in ("k", "q"):
        assert torch.allclose(inputs[n].norm(dim=-1), torch.ones(2, 7, 3))
    assert all(bool(((inputs[n] > 0) & (inputs[n] < 1)).all()) for n in ("beta", "alpha"))


def test_wall_and_host_take_the_median_round_and_sync_each_round(monkeypatch):
    """One slow round (a shared host's hiccup) does not move the figures; each round ends in a sync,
    which the wall time includes and the host time does not."""
    import time
    clock = [0.0]
    calls, syncs = [0], []

    def fn():                      # 1 ms of host per call, 100 ms in the second timed round
        calls[0] += 1
        clock[0] += 0.1 if 12 <= calls[0] <= 21 else 0.001

    def sync():                    # the device drains 2 ms after the last enqueue
        syncs.append(calls[0])
        clock[0] += 0.002

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    wall_ms, host_us = timing.wall_and_host(fn, n=10, rounds=5, sync=sync)
    assert syncs == [1, 11, 21, 31, 41, 51]             # after the warm call and after each round
    assert host_us == pytest.approx(1000.0) and wall_ms == pytest.approx(1.2)
