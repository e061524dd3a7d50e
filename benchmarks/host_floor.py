"""Issue 12: what one host-side operation costs on this machine, the floor under ``obj(...)``'s
host time. Times (host only, no synchronisation inside the loop; microseconds per call, median of
5 rounds of N calls):

- ``torch.empty`` of 1 MiB on the GPU (the caching allocator, no driver call expected);
- one small PyTorch kernel (``x.add_(1)`` on 1 KiB);
- one trivial Triton kernel through ``kernel[grid](...)`` (Triton's launcher) and through
  ``ssmcraft.ops.common.launch.launch`` (the compiled kernel's launcher, direct);
- the same kernel replayed 20 times inside one CUDA graph (per kernel);
- the autograd engine alone: ``torch.autograd.grad`` through an ``autograd.Function`` whose
  forward and backward launch nothing, on a GPU tensor (the engine hands the backward to its
  device thread and waits) and on a CPU tensor (run on the calling thread); through one whose
  backward launches 4 small PyTorch kernels, or 4 direct Triton launches; and one small
  PyTorch kernel each way (``x * 2``); "engine on this thread" is the same call under
  ``torch.autograd.set_multithreading_enabled(False)`` (``timing.on_this_thread``);
- DeltaNet ``obj()`` fwd and fwd+bwd (both ways) at B=8, T=2048 (bf16; ``commands.random_inputs``, the calls
  of ``timing.obj_calls``), with the count of Triton kernels launched directly vs through Triton during it
  (``launch.stats``): the public path's host time per call;
- where that fwd+bwd's host time goes (``segments``; median us of 60 calls, both ways): from the call to
  ``Rank1ChunkFunction.forward``, its body, from its return to the backward's start (the rest of the
  forward, ``autograd.grad``'s own work and, by default, the handoff to the engine's device thread), the
  backward's body, and from its end to ``autograd.grad``'s return (timestamps taken by wrapping the
  Function's forward and backward for the measurement);
- each of that fwd+bwd's kernel launches replayed alone (``launch_parts``): ``launch()`` whole, its launch
  key, its argument list and grid, and the compiled kernel's launcher; and ``torch.empty`` of each buffer the
  fwd+bwd allocates.

    PYTHONUNBUFFERED=1 python3 benchmarks/host_floor.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from unittest import mock

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ssmcraft  # noqa: E402
from ssmcraft.ops.common import launch as L  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402
from ssmcraft.runtime.timing import obj_calls, on_this_thread, wall_and_host  # noqa: E402
from ssmcraft.ops.rank1_chunk import chunk as R  # noqa: E402


class _Nothing(torch.autograd.Function):
    """Forward and backward that launch no kernel: what the autograd engine costs by itself."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _Launches(torch.autograd.Function):
    """A backward that calls ``launch_one(g)`` four times: what four kernels cost inside the engine."""
    @staticmethod
    def forward(ctx, x, launch_one):
        ctx.launch_one = launch_one
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        for _ in range(4):
            ctx.launch_one(g)
        return g, None


@triton.jit
def _noop(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def host_us(fn, n=200):
    return wall_and_host(fn, n)[1]


def main():
    dev = "cuda"
    x = torch.zeros(256, device=dev)
    rows = {"torch.empty 1 MiB": host_us(lambda: torch.empty(1 << 18, device=dev)),
            "torch kernel (x.add_(1))": host_us(lambda: x.add_(1)),
            "triton kernel[grid](...)": host_us(lambda: _noop[(1,)](x, 256, BLOCK=256)),
            "triton via launch() (direct)": host_us(lambda: L.launch(_noop, (1,), x, 256, BLOCK=256))}
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _noop[(1,)](x, 256, BLOCK=256)
        with torch.cuda.graph(g):
            for _ in range(20):
                _noop[(1,)](x, 256, BLOCK=256)
    torch.cuda.current_stream().wait_stream(s)
    rows["CUDA graph replay, per kernel of 20"] = host_us(g.replay, n=50) / 20
    rows["direct launches / through Triton (noop)"] = f"{L.stats(_noop)}"

    def both(label, fn, n=200):
        """``fn``'s host us as PyTorch runs it, then with the engine on this thread."""
        rows[label] = host_us(fn, n=n)
        rows[f"{label}, engine on this thread"] = host_us(on_this_thread(fn), n=n)
    a = torch.zeros(256, device=dev, requires_grad=True)
    ga = torch.ones(256, device=dev)
    both("autograd.grad, Function with no kernels", lambda: torch.autograd.grad(_Nothing.apply(a), a, ga))
    a_cpu, ga_cpu = torch.zeros(256, requires_grad=True), torch.ones(256)
    rows["autograd.grad, Function with no kernels (CPU tensor)"] = host_us(
        lambda: torch.autograd.grad(_Nothing.apply(a_cpu), a_cpu, ga_cpu))
    both("autograd.grad, backward of 4 torch kernels",
         lambda: torch.autograd.grad(_Launches.apply(a, lambda g: g.add_(1)), a, ga))
    both("autograd.grad, backward of 4 direct Triton launches",
         lambda: torch.autograd.grad(_Launches.apply(a, lambda g: L.launch(_noop, (1,), g, g.numel(), BLOCK=256)), a, ga))
    rows["autograd.grad of x * 2 (one kernel each way)"] = host_us(lambda: torch.autograd.grad(a * 2, a, ga))

    obj = ssmcraft.compile("deltanet")
    B, T, H, K = 8, 2048, 16, 64
    ins, params = random_inputs(obj, B, T, H, K, K, torch.bfloat16, dev, requires_grad=True)
    calls = obj_calls(obj, ins, params, dy=torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16))
    with torch.no_grad():
        rows["deltanet obj() fwd"] = host_us(calls["eager"]["fwd"], n=30)
    both("deltanet obj() fwd+bwd", calls["eager"]["fwd_bwd"], n=30)
    rows["deltanet kernels: direct / through Triton"] = {
        k: L.stats(getattr(R, k)) for k in ("rank1_chunk_prep_kernel", "rank1_chunk_fwd_state_kernel", "rank1_chunk_bwd_state_kernel", "rank1_chunk_bwd_grad_kernel")}
    from triton import knobs
    rows["triton launch hooks installed"] = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    for k, v in rows.items():
        print(f"{k:45s} {v:8.1f} us" if isinstance(v, float) else f"{k:45s} {v}")
    print("\ndeltanet fwd+bwd host time by segment (median us of 60 calls):")
    for label, fn in (("eager", calls["eager"]["fwd_bwd"]), ("engine on this thread", calls["onethread"]["fwd_bwd"])):
        print(f"  {label:22s} " + "  ".join(f"{k} {v:6.1f}" for k, v in segments(fn).items()))
    print("\ndeltanet fwd+bwd's launches replayed alone (us):")
    for name, row in launch_parts(calls["eager"]["fwd_bwd"]):
        print(f"  {name:18s} " + "  ".join(f"{k} {v:5.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))


def segments(fn, n: int = 60) -> dict:
    """Median us per segment of ``fn`` (a DeltaNet fwd+bwd) over ``n`` calls (module docstring), timed
    by wrapping ``Rank1ChunkFunction``'s forward and backward for the duration."""
    stamp = {}

    def timed(f, enter, leave):
        def run(ctx, *args):
            stamp[enter] = time.perf_counter_ns()
            out = f(ctx, *args)
            stamp[leave] = time.perf_counter_ns()
            return out
        return staticmethod(run)
    F = R.Rank1ChunkFunction
    with mock.patch.object(F, "forward", timed(F.forward, "f0", "f1")), \
            mock.patch.object(F, "backward", timed(F.backward, "b0", "b1")):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        spans = {k: [] for k in ("to forward", "forward", "forward to backward", "backward", "to return", "total")}
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fn()
            t1 = time.perf_counter_ns()
            for k, (a, b) in {"to forward": (t0, stamp["f0"]), "forward": (stamp["f0"], stamp["f1"]),
                              "forward to backward": (stamp["f1"], stamp["b0"]), "backward": (stamp["b0"], stamp["b1"]),
                              "to return": (stamp["b1"], t1), "total": (t0, t1)}.items():
                spans[k].append((b - a) / 1e3)
        torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in spans.items()}


def launch_parts(fn) -> list:
    """[(kernel name, {part: us})] for each launch of one ``fn()`` (recorded through a spy on
    ``rank1_chunk.launch``), replayed alone after it (``launch.direct_parts``), then
    ``("torch.empty <shape>", ...)`` for each buffer it allocated (a spy on ``rank1_chunk._empty``)."""
    launches, buffers = [], []
    empty = R._empty

    def record_launch(kernel, grid, *args, **kw):
        launches.append((kernel, grid, args, kw))
        return L.launch(kernel, grid, *args, **kw)

    def record_empty(*shape, device, dtype):
        buffers.append((shape, dtype, device))
        return empty(*shape, device=device, dtype=dtype)
    with mock.patch.object(R, "launch", record_launch), mock.patch.object(R, "_empty", record_empty):
        fn()
    torch.cuda.synchronize()
    out = []
    for kernel, grid, args, kw in launches:
        parts, n_args = L.direct_parts(kernel, grid, *args, **kw)
        out.append((L._jit(kernel).fn.__name__, {"launch()": host_us(lambda: L.launch(kernel, grid, *args, **kw)),
                                                 **{k: host_us(f) for k, f in parts.items()}, "arguments": n_args}))
    for shape, dtype, device in buffers:
        out.append((f"torch.empty {tuple(shape)}", {"us": host_us(lambda: torch.empty(shape, device=device, dtype=dtype))}))
    return out


if __name__ == "__main__":
    main()
