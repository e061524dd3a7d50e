"""The GPU form of the generated diagonal kernels compiles for sm_90 on a CPU-only machine
(benchmarks/sass_count.py: Triton's bundled ptxas, nvdisasm), and the offline counts show what the
backward's halving sums (Config.HSUM) buy. The interpreter tests run the same kernels' logic; this
covers what only the GPU form has (libdevice's exp, the constexpr-only paths)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _counts(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sass_count.py"), "--json", *args],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return {c["kernel"]: c for c in json.loads(out.stdout.strip().splitlines()[-1])}


def _main_loop(c):
    return max(c["loops"], key=lambda lp: lp["instructions"])


def _step_loop(c):
    """diagonal_fwd_main_kernel's time loop: the smallest loop of more than 20 instructions."""
    return min((lp for lp in c["loops"] if lp["instructions"] > 20), key=lambda lp: lp["instructions"])


def test_gpu_source_compiles_and_each_change_cuts_the_backward():
    fast = _counts("--objective", "mamba", "--kernels", "diagonal_fwd_main_kernel,diagonal_bwd_main_kernel")
    tl_sum = _counts("--objective", "mamba", "--kernels", "diagonal_bwd_main_kernel", "--no-hsum")
    masked = _counts("--objective", "mamba", "--kernels", "diagonal_bwd_main_kernel", "--no-even")
    assert fast["diagonal_fwd_main_kernel"]["spill_bytes"] == 0
    # measured 24 B (BENCHMARKS.md "Diagonal, run 4": lagged stores, bf16 gradient stores); a blow-up fails
    assert fast["diagonal_bwd_main_kernel"]["spill_bytes"] <= 64, fast["diagonal_bwd_main_kernel"]["spill_bytes"]
    # the forward step's exp is one MUFU.EX2 per state element (16 per thread), no denormal fix-up
    step = _step_loop(fast["diagonal_fwd_main_kernel"])
    assert step["ops"].get("MUFU") == 16 and "FSETP" not in step["ops"], step
    h, s, m = _main_loop(fast["diagonal_bwd_main_kernel"]), _main_loop(tl_sum["diagonal_bwd_main_kernel"]), _main_loop(masked["diagonal_bwd_main_kernel"])
    # halving alone: tl.sum does 16 keys x 5 butterfly levels per sum, halving 8 + 4 + 2 + 1 + 1
    assert h["ops"]["SHFL"] * 4 <= s["ops"]["SHFL"], (h["ops"]["SHFL"], s["ops"]["SHFL"])
    assert h["instructions"] < 0.8 * s["instructions"], (h["instructions"], s["instructions"])
    # the masks alone (value and time) cost a selection per element and step
    assert h["instructions"] < 0.85 * m["instructions"], (h["instructions"], m["instructions"])
    assert h["ops"].get("FSEL", 0) < m["ops"].get("FSEL", 0)


def test_the_prefetched_forward_compiles_without_spilling():
    # Config.PREFETCH is the forward the tuner picks for Mamba (BENCHMARKS.md "Diagonal, run 3"):
    # its 4 prefetch sets stay in registers, and each step issues one MUFU.EX2 per state element
    pf = _counts("--objective", "mamba", "--kernels", "diagonal_fwd_main_kernel", "--prefetch")["diagonal_fwd_main_kernel"]
    assert pf["spill_bytes"] == 0, pf["spill_bytes"]
    body = _step_loop(pf)
    assert body["ops"].get("MUFU") == 4 * 16, body     # the loop body is the 4 prefetched steps


def test_packed_sequence_form_compiles_for_sm90():
    """The main kernels with VARLEN (per-sequence offsets loaded from ``cu``/``co``): a form the
    interpreter runs with Python ints where the GPU compiles typed values."""
    packed = _counts("--objective", "mamba", "--varlen", "--kernels", "diagonal_fwd_main_kernel,diagonal_bwd_main_kernel")
    assert set(packed) == {"diagonal_fwd_main_kernel", "diagonal_bwd_main_kernel"}
    assert packed["diagonal_fwd_main_kernel"]["spill_bytes"] == 0
