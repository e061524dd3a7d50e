"""Every Triton kernel an objective's fwd+bwd launches, compiled for sm_90 on a CPU-only machine:
the GPU form of the kernels (typed integers, constexpr-only branches, the first autotune config),
which the interpreter tests do not compile. A check for code paths no GPU run has covered yet.

    python3 benchmarks/compile_sm90.py gla mamba kda_like --packed 0,17,5,33

The objective runs on CPU tensors with dispatch in its CUDA mode (the family order and tile
choices of a GPU), and every ``ssmcraft.ops.common.launch.launch`` compiles its kernel for
sm_90 (Triton's bundled ptxas) instead of running it: the outputs are never written, so the
numbers mean nothing; what is checked is that each kernel compiles, with the arguments the host
code passes. ``--packed`` runs one packed call (``cu_seqlens``) of those sequence lengths.
Prints one line per distinct kernel signature (``--usage``: then its warps, registers and stack
(spilled) bytes per thread at the first autotune config); exit status 1 when any fails to compile.
"""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager

os.environ.pop("TRITON_INTERPRET", None)
os.environ["SSMCRAFT_DIRECT_LAUNCH"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ssmcraft  # noqa: E402
from ssmcraft.bench.classes_commands import class_specs  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402
from ssmcraft.ops.common import launch as L  # noqa: E402
from sass_count import resource_usage  # noqa: E402

_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64",
          torch.int32: "*i32", torch.int64: "*i64", torch.bool: "*i1", torch.uint8: "*u8"}


def _config(kernel):
    """(first autotune config's kwargs, num_warps, num_stages) and heuristics of ``kernel``'s wrappers."""
    kw, warps, stages, heur, k = {}, 4, 3, [], kernel
    while not isinstance(k, triton.runtime.jit.JITFunction):
        if hasattr(k, "configs") and k.configs:
            c = k.configs[0]
            kw.update(c.kwargs)
            warps, stages = c.num_warps, c.num_stages
        if hasattr(k, "values"):          # @triton.heuristics
            heur.append(k.values)
        k = k.fn
    return k, kw, warps, stages, heur


def _type(v, path: tuple, consts: dict):
    """The signature type of one runtime argument (a tuple: a tuple of types; a ``None`` inside it
    is a constexpr at its path)."""
    if isinstance(v, tuple):
        return tuple(_type(x, (*path, j), consts) for j, x in enumerate(v))
    if v is None:
        consts[path] = None
        return "constexpr"
    if isinstance(v, torch.Tensor):
        return _TYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i64" if abs(v) >= 2 ** 31 else "i32"
    return "fp32"


def compile_call(kernel, args, kw, seen: dict) -> None:
    fn, cfg, warps, stages, heur = _config(kernel)
    bound = dict(zip(fn.arg_names, args))
    bound.update(kw)
    bound.update(cfg)
    for h in heur:
        for name, rule in h.items():
            bound[name] = rule(bound)
    warps = bound.pop("num_warps", warps)
    stages = bound.pop("num_stages", stages)
    sig, consts = {}, {}
    for i, p in enumerate(fn.params):
        v = bound.get(p.name)
        if p.is_constexpr or v is None:
            sig[p.name], consts[p.name] = "constexpr", v
        else:
            sig[p.name] = _type(v, (i,), consts)
    key = (fn.__name__, str(sorted(sig.items())), str(sorted((str(k), str(v)) for k, v in consts.items())), warps)
    if key in seen:
        return
    try:
        k = triton.compile(triton.compiler.ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=stages))
        regs, stack = resource_usage(k.asm["cubin"])
        seen[key] = (fn.__name__, None, f"{warps} warps, {regs} registers, {stack} B stack")
    except Exception as e:  # noqa: BLE001 - the failure is the finding, reported by kernel
        seen[key] = (fn.__name__, str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__, "")


@contextmanager
def compiling(seen: dict):
    """Every ``launch`` (in every module that imported it) compiles instead of running, and dispatch
    takes CPU tensors in its CUDA mode."""
    from ssmcraft.ops.diagonal import chunk as diagonal
    from ssmcraft.runtime import select
    real_launch, real_mode, real_fast = L.launch, select._mode, diagonal._fast_math
    patched = [m for m in list(sys.modules.values()) if getattr(m, "launch", None) is real_launch]

    def fake(kernel, grid, *args, **kw):
        compile_call(kernel, args, kw, seen)
    for m in patched:
        m.launch = fake
    # the outputs are never written: host code that reads one (RLS inverts the final precision) reads
    # NaN, not uninitialised memory (zeros where fresh: a singular matrix, and an error)
    poisoned = [m for m in patched if getattr(m, "POISON", None) is False]
    for m in poisoned:
        m.POISON = True
    select._mode = lambda inputs, prefer: ("triton", "")
    diagonal._fast_math = lambda: True      # asks the (absent) CUDA driver otherwise
    try:
        yield
    finally:
        for m in patched:
            m.launch = real_launch
        for m in poisoned:
            m.POISON = False
        select._mode, diagonal._fast_math = real_mode, real_fast


def run(label: str, packed: list[int] | None, dtype, seen: dict) -> str:
    obj = ssmcraft.compile(dict(class_specs((label,)))[label])
    B, T = (1, sum(packed)) if packed else (2, 67)
    inputs, params = random_inputs(obj, B, T, 2, 64, 64, dtype, torch.device("cpu"), requires_grad=True)
    kw = {}
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(packed).cumsum(0).tolist()], dtype=torch.int32)
    with compiling(seen):
        y = obj(inputs, params, None, True, **kw)[0]
        torch.autograd.grad(y, list(inputs.values()), torch.ones_like(y), allow_unused=True)
    return obj.backend


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("objectives", nargs="+", help="library names or bench --classes labels")
    ap.add_argument("--packed", default="", help="comma-separated sequence lengths of one packed call")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--usage", action="store_true", help="each kernel's warps, registers and stack bytes")
    args = ap.parse_args(argv)
    packed = [int(x) for x in args.packed.split(",") if x] or None
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    failed = 0
    for label in args.objectives:
        seen: dict = {}
        backend = run(label, packed, dtype, seen)
        for name, err, usage in seen.values():
            failed += err is not None
            print(f"{label:<16} {backend:<34} {name:<40} {'ok' if err is None else 'FAIL: ' + err}"
                  + (f"  {usage}" if args.usage and usage else ""))
        if not seen:
            print(f"{label:<16} {backend:<34} (no Triton kernel launched)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
