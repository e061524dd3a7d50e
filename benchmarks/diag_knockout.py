"""Where the diagonal backward's time goes: time variants of the generated kernels that leave one
stage out (results wrong on purpose, except ``base``), with one fixed configuration (BV 32, one
warp, 20 time groups, halving sums), and a profiler breakdown per kernel of ``base``. The
backward is (fwd+bwd) - fwd of the same configuration. The lent machines read no hardware
counters, so stages are located by difference.

    PYTHONPATH=$PWD python3 benchmarks/diag_knockout.py [--objectives longhorn_diag,mamba]

Variants (text edits of ``diagonal._source``'s output, compiled as their own cache entries):
- ``no_reduction``: the key gradients' value-axis sums (``_hsum``) replaced by in-thread sums over keys;
- ``no_dq`` / ``no_dk``: the query / key gradient not stored (the compiler drops its computation);
- ``no_dk_dq``: neither.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ssmcraft  # noqa: E402
from bench_diagonal import leaves_of, scan  # noqa: E402
from common import bench_ms, random_inputs  # noqa: E402
from ssmcraft.ops.diagonal import chunk as D  # noqa: E402
from ssmcraft.ops.codegen import diagonal as G  # noqa: E402

_HSUM = re.compile("(" + re.escape(G._HSUM[1]) + r"\n    \"\"\"(?:.|\n)*?\"\"\"\n)((?:    .*\n)+)")


def no_reduction(src: str) -> str:
    out = _HSUM.sub(lambda m: m.group(1) + "    return tl.sum(x, axis=0, keep_dims=True)\n", src, count=1)
    assert out != src, "no _hsum found in the generated source"
    return out


def _drop_stores(src: str, leaf: str) -> str:
    """The generated source without ``tl.store(g_<leaf> ...)`` lines, and without the ``if HSUM:`` /
    ``else:`` pairs whose only lines those were."""
    src_lines = src.split("\n")
    lines = [ln for ln in src_lines if not re.match(rf"\s+tl\.store\(g_{leaf} ", ln)]
    assert len(lines) < len(src_lines), f"no store of g_{leaf} found"
    out = []
    for ln in lines:
        if ln.strip() == "else:" and out and out[-1].strip() == "if HSUM:":
            out.pop()
            continue
        out.append(ln)
    return "\n".join(out)


VARIANTS = {"base": lambda s: s, "no_reduction": no_reduction, "no_dq": lambda s: _drop_stores(s, "q"),
            "no_dk": lambda s: _drop_stores(s, "k"), "no_dk_dq": lambda s: _drop_stores(_drop_stores(s, "k"), "q")}


def profile_kernels(fn, n=10) -> dict:
    """GPU microseconds per call of each kernel ``fn`` launches."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / n for e in prof.key_averages() if e.self_device_time_total}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objectives", default="longhorn_diag,mamba")
    args = ap.parse_args()
    original = G.source
    cfg = D.Config(BV=32, num_warps=1, NG=20, NSUB=4, HSUM=True)
    try:
        for name in args.objectives.split(","):
            obj = ssmcraft.compile(name)
            inputs, params = random_inputs(obj, 8, 2048, 1, 1536, 16, torch.bfloat16, "cuda", requires_grad=True)
            leaves = leaves_of(inputs, params)
            for vname, edit in VARIANTS.items():
                G.source = lambda plan, pad_k, ls, fast_math, edit=edit: edit(original(plan, pad_k, ls, fast_math))
                D._MODULES.clear()
                dy = torch.randn_like(scan(obj, inputs, params, config=cfg)[0])

                def fwd_bwd():
                    return torch.autograd.grad(scan(obj, inputs, params, config=cfg)[0], leaves, dy)
                fwd_bwd()
                with torch.no_grad():
                    t_f = bench_ms(lambda: scan(obj, inputs, params, config=cfg))
                t_fb = bench_ms(fwd_bwd)
                k = D.LAUNCHED["diagonal_bwd_main_kernel"]
                print(f"{name:14s} {vname:13s} fwd {t_f:.3f}  fwd+bwd {t_fb:.3f}  bwd {t_fb - t_f:.3f} ms  "
                      f"diagonal_bwd_main_kernel {k.n_regs} registers, {k.n_spills} spills", flush=True)
                if vname == "base":
                    for kname, us in sorted(profile_kernels(fwd_bwd).items(), key=lambda x: -x[1])[:10]:
                        print(f"    {kname[:48]:48s} {us:8.1f} us", flush=True)
    finally:
        G.source = original
        D._MODULES.clear()


if __name__ == "__main__":
    main()
