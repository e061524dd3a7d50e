"""Timing what users call: shared by ``ssmcraft bench`` and the GPU benchmarks (``benchmarks/``).

- ``bench_ms``: median ms of ``triton.testing.do_bench``; ``copy_bandwidth``: the device's copy
  bandwidth (the HBM floor's denominator); ``busy``: GPU kernel time (torch profiler), wall time and
  host enqueue time per call of back-to-back calls (``wall_and_host``: medians of rounds), whose ratio
  is the GPU-busy fraction.
- ``obj_calls``: the calls to time for one objective, ``{how: {kind: fn}}``, how in ``HOWS``:
  ``eager`` is ``obj(...)``; ``graphed`` the same call replayed from CUDA graphs
  (``obj.graphed(...)``, captured once per kind with exactly the eager call's tensors and
  ``output_final_state``), its tensors copied into the graph's static inputs on every call;
  ``static`` the same graphs called on their own input buffers (``static_inputs()``: no copy-in).
  ``onethread`` is the eager ``fwd_bwd`` with the autograd engine on the calling thread
  (``torch.autograd.set_multithreading_enabled(False)``; by default PyTorch hands a CUDA backward
  to a device thread and waits for it, which costs host time on some hosts: BENCHMARKS.md, "Host
  floor"). Kinds: ``fwd`` (timed under ``torch.no_grad``; the tensors
  detached, so the graph is an inference graph that saves nothing for backward) and ``fwd_bwd``
  (the forward, then ``torch.autograd.grad`` of ``y`` under ``dy`` with respect to every tensor
  that requires grad).
- ``time_calls``: ``{"{how}_{kind}_ms": ...}`` for each call, and with ``with_busy`` the
  profiler's figures (``{how}_busy_{kind}`` = GPU time / wall time, ``{how}_host_us_{kind}``,
  ``{how}_kernel_ms_{kind}``, ``{how}_wall_ms_{kind}``).
The graphed-against-eager identity check is ``checking.graphed_against_eager``.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ssmcraft.ops.common.reference import like, states

HOWS = ("eager", "onethread", "graphed", "static")
HOW_LABELS = {"onethread": "1-thread"}      # a table's column label where it is not the name: HOW_LABELS.get(h, h)
KINDS = ("fwd", "fwd_bwd")


def bench_ms(fn, warmup: int = 10, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` (triton.testing.do_bench)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Achieved device copy bandwidth in bytes/s (read + write counted), median of do_bench."""
    n = nbytes // 4
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    return 2 * n * 4 / (bench_ms(lambda: b.copy_(a)) * 1e-3)


def wall_and_host(fn, n: int = 30, rounds: int = 5, sync: Callable = torch.cuda.synchronize) -> tuple[float, float]:
    """(wall ms per call, host enqueue us per call): medians over ``rounds`` rounds of ``n``
    back-to-back calls, each round timed from an idle device (``sync`` before) to its drain: a median
    is not carried by one slow round. It does not remove the drift of host time between processes
    (BENCHMARKS.md, "Host helpers and launch keys"), which comparisons must alternate processes to
    see through."""
    fn()
    sync()
    walls, hosts = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        sync()
        walls.append((time.perf_counter() - t0) / n * 1e3)
        hosts.append((t1 - t0) / n * 1e6)
    return statistics.median(walls), statistics.median(hosts)


def busy(fn, n: int = 30) -> tuple[float, float, float]:
    """(GPU kernel ms per call, wall ms per call, host enqueue us per call) of ``n`` back-to-back
    calls (``wall_and_host``'s medians); graph replays count where CUPTI reports their kernels."""
    from torch.profiler import ProfilerActivity, profile
    wall, host = wall_and_host(fn, n)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    gpu = sum(e.self_device_time_total for e in prof.key_averages()) / n / 1e3
    return gpu, wall, host


def on_this_thread(fn: Callable) -> Callable:
    """``fn`` run with the autograd engine on the calling thread (no device-thread handoff)."""
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            return fn()
    return run


def grad_leaves(inputs, params=None, initial_state=None) -> list[torch.Tensor]:
    """Every tensor of a call that requires grad, in the call's order (inputs, params, states)."""
    return [t for t in [*inputs.values(), *(params or {}).values(), *states(initial_state)]
            if isinstance(t, torch.Tensor) and t.requires_grad]


def detached(inputs, params=None, initial_state=None) -> tuple:
    """``(inputs, params, initial_state)`` with every tensor detached (same storage)."""
    return ({n: t.detach() for n, t in inputs.items()},
            None if params is None else {n: t.detach() for n, t in params.items()},
            like(initial_state, tuple(s.detach() for s in states(initial_state))))


def obj_calls(obj, inputs, params=None, initial_state=None, output_final_state: bool = False,
              dy: torch.Tensor | None = None, graphed: bool = False, warmup: int = 3) -> dict[str, dict[str, Callable]]:
    """``{how: {kind: fn}}`` (module docstring): ``eager`` always, ``graphed`` and ``static`` with
    ``graphed`` (capturing here: two ``obj.graphed`` calls, or one without ``dy``); ``fwd_bwd``
    only with ``dy`` (the cotangent of ``y``), and with it ``onethread`` (``fwd_bwd`` only)."""
    frozen = detached(inputs, params, initial_state)
    ofs = output_final_state
    calls = {"eager": {"fwd": lambda: obj(*frozen, ofs)[0]}}
    if dy is not None:
        leaves = grad_leaves(inputs, params, initial_state)
        calls["eager"]["fwd_bwd"] = lambda: torch.autograd.grad(obj(inputs, params, initial_state, ofs)[0], leaves, dy)
        calls["onethread"] = {"fwd_bwd": on_this_thread(calls["eager"]["fwd_bwd"])}
    if not graphed:
        return calls
    g_fwd = obj.graphed(*frozen, ofs, warmup=warmup)      # inference: captured without saving for backward
    st_fwd = g_fwd.static_inputs()
    calls["graphed"] = {"fwd": lambda: g_fwd(*frozen)[0]}
    calls["static"] = {"fwd": lambda: g_fwd(*st_fwd)[0]}
    if dy is not None:
        g_train = obj.graphed(inputs, params, initial_state, ofs, warmup=warmup)
        st_train = g_train.static_inputs()
        st_leaves = grad_leaves(*st_train)
        calls["graphed"]["fwd_bwd"] = lambda: torch.autograd.grad(g_train(inputs, params, initial_state)[0], leaves, dy)
        calls["static"]["fwd_bwd"] = lambda: torch.autograd.grad(g_train(*st_train)[0], st_leaves, dy)
    return calls


def time_calls(calls: dict[str, dict[str, Callable]], with_busy: bool = False) -> dict:
    """Each call of ``obj_calls`` timed (``bench_ms``; ``fwd`` under ``torch.no_grad``), with the
    profiler's GPU-busy figures when ``with_busy`` (module docstring for the keys)."""
    row = {}
    for how, kinds in calls.items():
        for kind, fn in kinds.items():
            with torch.set_grad_enabled(kind == "fwd_bwd"):
                row[f"{how}_{kind}_ms"] = bench_ms(fn)
                if with_busy:
                    gpu, wall, host = busy(fn)
                    row.update({f"{how}_busy_{kind}": gpu / wall, f"{how}_host_us_{kind}": host,
                                f"{how}_kernel_ms_{kind}": gpu, f"{how}_wall_ms_{kind}": wall})
    return row
