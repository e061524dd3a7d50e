"""Offline instruction counts of the generated diagonal kernels: no GPU needed.

Triton compiles the GPU form of an objective's generated source (``fast_math``: libdevice exp) for
sm_90 on this machine with its bundled ptxas, and ``nvdisasm`` reads the cubin. Printed per kernel:
registers, spilled bytes, and for each loop (a backward branch) its instruction count and most
frequent opcodes. This is how BENCHMARKS.md's "Diagonal, run 3" table was made; a change to the
generator can be weighed here before any device time is spent.

    python3 benchmarks/sass_count.py --objective mamba --kernels diagonal_fwd_main_kernel,diagonal_bwd_main_kernel
    python3 benchmarks/sass_count.py --objective longhorn_diag --no-hsum --no-even

Runs in a process without the Triton interpreter (it unsets ``TRITON_INTERPRET``). Shapes follow
the timed case (K=16, one warp, 32-wide value blocks, bf16 value-indexed I/O, fp32 key-indexed
inputs and params, as ``diagonal_scan`` passes them).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# compiled kernels only: the interpreter patches triton.language for the whole process, so this
# runs in a process of its own (tests start it as a subprocess)
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from ssmcraft.errors import SsmcraftError  # noqa: E402
from ssmcraft.ops.common.tuning import next_pow2  # noqa: E402

INT_ARGS = {"T", "H", "K", "V", "NC", "NG", "CPG", "L", "NTOK"}
K = 16          # the timed case's key dim (the generated source and the flags must agree on it)


def load(objective: str):
    """(plan, module) of ``objective``'s generated source as the GPU compiles it (fast_math), imported
    once (the file exists only while importing)."""
    import ssmcraft
    from ssmcraft.compiler.cache import import_file
    from ssmcraft.ops.diagonal import chunk as D
    ir = ssmcraft.compile(objective).ir
    with tempfile.TemporaryDirectory(prefix="sass_count_") as d:
        path, text = Path(d) / "gen.py", D.generated_source(ir, K, fast_math=True)
        path.write_text(text)
        mod = import_file(path, "sass_count_gen", text)
    return D._get_plan(ir), mod


def _signature(fn, plan_leaves: dict, io: str, consts: dict) -> tuple[dict, dict]:
    """Argument types and alignment hints of one generated kernel (pointers 16-byte aligned, K and V
    divisible by 16, as Triton specialises them at launch)."""
    sig, attrs = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
            continue
        if a in ("cu", "co", "gi"):  # packed sequences' offsets and time-group table (unread unless VARLEN)
            sig[a] = "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
            continue
        if a in INT_ARGS or a.startswith("hs_"):
            sig[a] = "i32"
            if a in ("K", "V"):
                attrs[(i,)] = [["tt.divisibility", 16]]
            continue
        leaf = plan_leaves.get(a[2:]) if a.startswith(("p_", "g_")) else None
        # value-indexed token leaves and their gradients come in the inputs' dtype (key-indexed: fp32)
        value_io = a in ("y", "dy") or (leaf is not None and leaf.kind == "tok" and "d" in leaf.dims)
        sig[a] = f"*{io}" if value_io else "*fp32"
        attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


@dataclass
class Count:
    kernel: str
    registers: int
    spill_bytes: int
    loops: list        # [(instructions, Counter of opcodes)], innermost first as nvdisasm lists them


def sm90(fn, sig: dict, consts: dict, attrs: dict, warps: int) -> tuple[int, int, str]:
    """(registers, stack bytes, SASS text) of ``fn`` compiled for sm_90 (Triton's bundled ptxas,
    cuobjdump and nvdisasm; no GPU needed)."""
    k = triton.compile(triton.compiler.ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps))
    return (*resource_usage(k.asm["cubin"]), _cubin_tool("nvdisasm", k.asm["cubin"], "-c"))


def _cubin_tool(tool: str, cubin: bytes, *flags: str) -> str:
    """The text ``tool`` (Triton's bundled ``cuobjdump`` or ``nvdisasm``) prints for ``cubin``."""
    bindir = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([os.path.join(bindir, tool), *flags, path], capture_output=True, text=True,
                              check=True).stdout


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread: the spills) of a compiled kernel's cubin."""
    usage = _cubin_tool("cuobjdump", cubin, "--dump-resource-usage")
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def compile_count(loaded, kernel: str, BV: int = 32, warps: int = 1, io: str = "bf16",
                  hsum: bool = True, even: bool = True, prefetch: bool = False, varlen: bool = False) -> Count:
    """Compile one kernel of a ``load``-ed GPU source for sm_90 and count its SASS. The compile-time
    flags come from ``diagonal.flags`` (which refuses what the kernels cannot run), on a shape whose
    T and V divide the chunk and the value block when ``even``."""
    from ssmcraft.ops.diagonal import chunk as D
    plan, mod = loaded
    fn = getattr(mod, kernel)
    BK, ls = next_pow2(K), D._ls_for(K)
    cfg = D.Config(BV=BV, num_warps=warps, NG=1, NSUB=D._nsub(K), HSUM=hsum, PREFETCH=prefetch)
    L = ls * cfg.NSUB
    known = dict(BK=BK, BV=BV, SAVE=True, STORE_FINAL=True, NSUB=cfg.NSUB, NEED_DH0=True, DOTRED=False, VARLEN=varlen,
                 HAS_H0=True, HAS_DHT=True, **D.flags(cfg, K, 128 * L + (not even), 48 * BV + (not even), ls))
    consts = {k: v for k, v in known.items() if k in fn.arg_names}
    sig, attrs = _signature(fn, plan.leaves, io, consts)
    regs, stack, sass = sm90(fn, sig, consts, attrs, warps)
    return Count(kernel, regs, stack, loops(sass))


_INSTR = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^\.(L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`?\(?\.(L_x_\d+)")


def loops(sass: str) -> list:
    """(instruction count, opcode Counter) of each loop: the code from a label to a branch back to it."""
    instrs, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            for lab in pending:
                labels[lab] = len(instrs)
            pending = []
            instrs.append((m.group(2), line))
    out = []
    for i, (_, line) in enumerate(instrs):
        m = _BRANCH.search(line)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            body = instrs[labels[m.group(1)]:i + 1]
            out.append((len(body), collections.Counter(op for op, _ in body)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objective", default="mamba")
    ap.add_argument("--kernels", default="diagonal_fwd_summary_kernel,diagonal_fwd_main_kernel,diagonal_bwd_summary_kernel,diagonal_bwd_main_kernel")
    ap.add_argument("--BV", type=int, default=32)
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--io", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--no-hsum", action="store_true", help="backward key sums by tl.sum (Config.HSUM off)")
    ap.add_argument("--no-even", action="store_true", help="keep the value and time masks (EVEN_V/EVEN_T off)")
    ap.add_argument("--prefetch", action="store_true", help="diagonal_fwd_main_kernel with its register prefetch (Config.PREFETCH)")
    ap.add_argument("--varlen", action="store_true", help="the main kernels' packed-sequence form (VARLEN)")
    ap.add_argument("--json", action="store_true", help="print one JSON list (kernel, registers, spills, loops)")
    args = ap.parse_args(argv)
    loaded = load(args.objective)
    try:
        counts = [compile_count(loaded, kernel, args.BV, args.warps, args.io, not args.no_hsum, not args.no_even,
                                prefetch=args.prefetch, varlen=args.varlen)
                  for kernel in args.kernels.split(",")]
    except SsmcraftError as e:
        print(f"sass_count: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([dict(kernel=c.kernel, registers=c.registers, spill_bytes=c.spill_bytes,
                               loops=[dict(instructions=n, ops=dict(ops)) for n, ops in c.loops]) for c in counts]))
        return 0
    for c in counts:
        print(f"{args.objective} {c.kernel}: {c.registers} registers, {c.spill_bytes} bytes spilled")
        for n, ops in c.loops:
            print(f"  loop: {n} instructions; " + ", ".join(f"{op} {k}" for op, k in ops.most_common(8)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
