"""Every Triton kernel an objective's fwd+bwd launches, compiled for sm_90 on a CPU-only machine:
the GPU form of the kernels (typed integers, constexpr-only branches, the first autotune config the
autotuner's pruning keeps), which the interpreter tests do not compile. A check for code paths no
GPU run has covered yet.
Arguments are specialised as Triton's launcher does (pointers 16-byte aligned and ints divisible by
16 carry that hint, an int equal to 1 is a constexpr): without the hints loads are not vectorised,
layouts differ from the GPU's, and so do the register and spill figures (mlp_cauchy_2key's
MLP-memory forward at 4 warps read 32 registers and 15.5 KB of spills without them, 255 registers
and 1 KB with them).

    python3 benchmarks/compile_sm90.py gla mamba kda_like --packed 0,17,5,33

The objective runs on CPU tensors with dispatch in its CUDA mode (the family order and tile
choices of a GPU), and every ``ssmcraft.ops.common.launch.launch`` compiles its kernel for
sm_90 (Triton's bundled ptxas) instead of running it: the outputs are never written, so the
numbers mean nothing; what is checked is that each kernel compiles, with the arguments the host
code passes. ``--packed`` runs one packed call (``cu_seqlens``) of those sequence lengths; ``--decay-ahead`` puts
``rank1_row_chunk`` ahead of ``rank1_row`` for a per-row decay (its ``rowdecay.py`` kernels);
``--block-chunk-ahead`` puts ``block_rank1_row_chunk`` ahead of ``block_rank1_row``; ``--no-row-split`` runs
that per-row decay's backward as one kernel (its ``ROW_DECAY_SPLIT`` off); ``--show PATH,...`` prints those
constexprs' values after a kernel's name (``name[PATH=1]``: which specialisation of one source a line is).
Prints one line per distinct kernel signature; exit status 1 when any fails to compile or needs more
shared memory per block (the compiled kernel's ``metadata.shared``, which Triton's launcher checks
against the device's limit) than ``SM90_SHARED_LIMIT``. An autotuned kernel whose first config is
over the limit has its other configs compiled too (the autotuner skips a config that is out of
resources): it fails only when none fits. ``--shape B,T,H,d,m`` sets the sizes (default
2,67,2,64,64). ``--regs`` adds each kernel's shared bytes (``smem``), and its registers per thread
and spill bytes from Triton's bundled ptxas (``-v``) on the kernel's PTX: the figures the GPU's own
load would report.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager

os.environ.pop("TRITON_INTERPRET", None)
os.environ["SSMCRAFT_DIRECT_LAUNCH"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.runtime.jit import find_paths_if, get_iterable_path  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ssmcraft  # noqa: E402
from ssmcraft.bench.classes_commands import class_specs  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402
from ssmcraft.ops.common import launch as L  # noqa: E402

SHOW: tuple[str, ...] = ()      # constexprs printed after a kernel's name (``--show``)
# shared memory one block may use on sm_90 (H100, H200) when it opts in: 227 KB, the "maximum amount
# of shared memory per thread block" of compute capability 9.0 in CUDA's programming guide (its
# "Technical Specifications per Compute Capability" table), and the "Hardware limit" Triton's
# OutOfResources error gives on an H200
SM90_SHARED_LIMIT = 232448


def _config(kernel, call: dict, i: int = 0):
    """(the JIT function, autotune config ``i``'s kwargs, num_warps, num_stages, heuristics of
    ``kernel``'s wrappers, number of autotune configs) for a launch with the arguments ``call``: the
    configs the autotuner's ``early_config_prune`` keeps, as it would."""
    kw, warps, stages, heur, k, n = {}, 4, 3, [], kernel, 1
    while not isinstance(k, triton.runtime.jit.JITFunction):
        if hasattr(k, "configs") and k.configs:
            configs = k.early_config_prune(k.configs, {}, **call) if k.early_config_prune else k.configs
            c = configs[i]
            kw.update(c.kwargs)
            warps, stages, n = c.num_warps, c.num_stages, len(configs)
        if hasattr(k, "values"):          # @triton.heuristics
            heur.append(k.values)
        k = k.fn
    return k, kw, warps, stages, heur, n


def _specialised(v, p) -> tuple:
    """(signature type, alignment key) of one runtime argument as Triton's launcher specialises it for
    the parameter ``p``: pointers 16-byte aligned and ints divisible by 16 get ``tt.divisibility`` (the
    key ``"D"``), an int equal to 1 becomes a constexpr; a tuple gives a tuple of each."""
    from triton._C.libtriton import native_specialize_impl
    return native_specialize_impl(BaseBackend, v, False, not p.do_not_specialize,
                                  not p.do_not_specialize_on_alignment)


def ptxas_usage(ptx: str) -> str:
    """``regs N, spills S/L bytes`` of one kernel's PTX (``ptxas -v`` for sm_90a)."""
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if out.returncode or not regs:
        return f"ptxas: {text.strip().splitlines()[-1] if text.strip() else out.returncode}"
    return f"regs {regs.group(1)}, spills {spill.group(1)}/{spill.group(2)} bytes" if spill else f"regs {regs.group(1)}"


def compile_call(kernel, args, kw, seen: dict, regs: bool = False) -> None:
    """Compiles one launch's kernel into ``seen`` (``{signature: (name, error or None, usage)}``, the
    signature of its first autotune config): that config, and the next ones while each is over
    ``SM90_SHARED_LIMIT`` (the autotuner skips those)."""
    i, over = 0, []
    while True:
        key, n, name, err, usage, shared = _compile_config(kernel, args, kw, regs, i, seen if i == 0 else None)
        if i == 0:
            first = key
        if key is None or shared is None or shared <= SM90_SHARED_LIMIT or i + 1 == n:
            break
        over.append(f"config {i}: smem {shared}")
        i += 1
    if key is None:         # seen
        return
    if shared is not None and shared > SM90_SHARED_LIMIT:
        err = f"smem {shared} > {SM90_SHARED_LIMIT} (the sm_90 limit per block)" + (
            f"; every config is over ({', '.join(over)})" if over else "")
    elif over and regs:
        usage += f" in config {i} ({', '.join(over)} over the limit)"
    seen[first] = (name, err, usage)


def _compile_config(kernel, args, kw, regs: bool, i: int, seen: dict | None):
    """(signature key, number of configs, name, error or None, usage, shared bytes or None) of autotune
    config ``i`` of one launch's kernel; key None when ``seen`` holds its signature already."""
    bound = dict(zip(L._jit(kernel).arg_names, args))
    bound.update(kw)
    fn, cfg, warps, stages, heur, n = _config(kernel, bound, i)
    bound.update(cfg)
    for h in heur:
        for name, rule in h.items():
            bound[name] = rule(bound)
    warps = bound.pop("num_warps", warps)
    stages = bound.pop("num_stages", stages)
    sig, consts, attrs = {}, {}, {}
    for j, p in enumerate(fn.params):
        v = bound.get(p.name)
        if p.is_constexpr or v is None:
            sig[p.name], consts[p.name] = "constexpr", v
            continue
        sig[p.name], key = _specialised(v, p)
        # the constexprs and alignment hints inside the argument, by path (Triton's ``_pack_args``)
        consts.update({(j, *q): get_iterable_path(v, q) if q else v
                       for q in find_paths_if(sig[p.name], lambda _, t: t == "constexpr")})
        attrs.update({(j, *q): BaseBackend.parse_attr(get_iterable_path(key, q) if q else key)
                      for q in find_paths_if(key, lambda _, a: isinstance(a, str))})
    key = (fn.__name__, str(sorted(sig.items())), str(sorted((str(k), str(v)) for k, v in consts.items())), warps, stages)
    if seen is not None and key in seen:
        return None, n, None, None, "", None
    name = fn.__name__ + "".join(f"[{c}={consts[c]}]" for c in SHOW if c in consts)
    try:
        compiled = triton.compile(triton.compiler.ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
        shared = compiled.metadata.shared
        return key, n, name, None, f"smem {shared}, {ptxas_usage(compiled.asm['ptx'])}" if regs else "", shared
    except Exception as e:  # noqa: BLE001 - the failure is the finding, reported by kernel
        return key, n, name, str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__, "", None


@contextmanager
def compiling(seen: dict, regs: bool = False):
    """Every ``launch`` (in every module that imported it) compiles instead of running, and dispatch
    takes CPU tensors in its CUDA mode; ``regs``: with ptxas's register and spill figures."""
    from ssmcraft.ops.diagonal import chunk as diagonal
    from ssmcraft.runtime import select
    real_launch, real_mode, real_fast = L.launch, select._mode, diagonal._fast_math
    patched = [m for m in list(sys.modules.values()) if getattr(m, "launch", None) is real_launch]

    def fake(kernel, grid, *args, **kw):
        compile_call(kernel, args, kw, seen, regs)
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


def run(label: str, packed: list[int] | None, dtype, seen: dict, regs: bool = False,
        shape: tuple = (2, 67, 2, 64, 64)) -> str:
    obj = ssmcraft.compile(dict(class_specs((label,)))[label])
    B, T, H, d, m = shape
    B, T = (1, sum(packed)) if packed else (B, T)
    inputs, params = random_inputs(obj, B, T, H, d, m, dtype, torch.device("cpu"), requires_grad=True)
    kw = {}
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(packed).cumsum(0).tolist()], dtype=torch.int32)
    with compiling(seen, regs):
        y = obj(inputs, params, None, True, **kw)[0]
        torch.autograd.grad(y, list(inputs.values()), torch.ones_like(y), allow_unused=True)
    return obj.backend


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("objectives", nargs="+", help="library names or bench --classes labels")
    ap.add_argument("--packed", default="", help="comma-separated sequence lengths of one packed call")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--shape", default="2,67,2,64,64", help="B,T,H,d,m (B and T: unless --packed)")
    ap.add_argument("--regs", action="store_true", help="print each kernel's shared bytes, registers and spills (ptxas -v)")
    ap.add_argument("--decay-ahead", action="store_true",
                    help="rank1_row_chunk ahead of rank1_row for a per-row decay too (its ROW_DECAY_AHEAD)")
    ap.add_argument("--block-chunk-ahead", action="store_true",
                    help="block_rank1_row_chunk ahead of block_rank1_row (its AHEAD)")
    ap.add_argument("--no-row-split", action="store_true",
                    help="a per-row decay's rank1_row_chunk backward as one kernel (its ROW_DECAY_SPLIT off)")
    ap.add_argument("--show", default="", help="comma-separated constexprs to print after each kernel's name")
    args = ap.parse_args(argv)
    global SHOW
    SHOW = tuple(n for n in args.show.split(",") if n)
    if args.block_chunk_ahead:
        from ssmcraft.ops.block_rank1_row_chunk import chunk as block_chunk
        block_chunk.AHEAD = True
    if args.decay_ahead:
        from ssmcraft.ops.rank1_row_chunk import chunk as row_chunk
        row_chunk.ROW_DECAY_AHEAD = True
    if args.no_row_split:
        from ssmcraft.ops.rank1_row_chunk import chunk as row_chunk
        row_chunk.ROW_DECAY_SPLIT = False
    packed = [int(x) for x in args.packed.split(",") if x] or None
    shape = tuple(int(x) for x in args.shape.split(",")) if re.fullmatch(r"\d+(,\d+){4}", args.shape) else None
    if shape is None or 0 in shape:
        print(f"compile_sm90.py: --shape {args.shape!r} is not five positive integers B,T,H,d,m", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    failed = 0
    for label in args.objectives:
        seen: dict = {}
        backend = run(label, packed, dtype, seen, args.regs, shape)
        for name, err, usage in seen.values():
            failed += err is not None
            print(f"{label:<16} {backend:<34} {name:<40} {'ok' if err is None else 'FAIL: ' + err}"
                  + (f" ({usage})" if usage else ""))
        if not seen:
            print(f"{label:<16} {backend:<34} (no Triton kernel launched)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
