"""Where the decay backward of the per-row rank-1 family spends its time: variants of
``rank1_row_bwd`` with a part removed (timing only, the results are wrong), wd_longhorn's
fwd+bwd through ``obj()`` at B=8 T=2048 H=16 K=V=64, bf16. Run on a CUDA machine:

    python3 benchmarks/exp_rank1_row_bwd.py
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ssmcraft.ops.rank1_row import bwd as rank1_row_bwd, recurrent as R  # noqa: E402
from sweep_rank1_row import calls, timed  # noqa: E402

SRC = open(rank1_row_bwd.__file__).read()
VARIANTS = {
    "as is": [],
    "no keep pass": [("            keep_states(ckp", "            pass  # keep_states(ckp"),
                     ("                        MODES, CONSTS, GROUPS, BV, BK, PF)\n", "")],
    "no kept-state loads": [("                x1 = tl.load(scr + (jt // 2) * BK * BV + kept_tile(BK, BV))",
                             "                x1 = st"),
                            ("                x3 = tl.load(scr + (jt // 2 + 1) * BK * BV + kept_tile(BK, BV))",
                             "                x3 = st")],
}


def variant(name, edits, folder):
    src = SRC
    for a, b in edits:
        assert a in src, (name, a)
        src = src.replace(a, b)
    path = os.path.join(folder, f"bwd_{abs(hash(name))}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"bwd_{abs(hash(name))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.rank1_row_bwd_kernel


def main():
    VARIANTS["no keep pass, no loads"] = VARIANTS["no keep pass"] + VARIANTS["no kept-state loads"]
    folder = tempfile.mkdtemp()
    for obj_name in ("longhorn", "wd_longhorn", "gated_longhorn"):
        _, c = calls(obj_name, (8, 2048, 16, 64, 64))
        for name, edits in VARIANTS.items():
            if obj_name == "longhorn" and edits:
                continue
            R.rank1_row_bwd_kernel = variant(name, edits, folder)
            f, fb = timed(c)
            print(f"{obj_name:15s} {name:24s} fwd {f:.3f} fwd+bwd {fb:.3f} ms", flush=True)
        R.rank1_row_bwd_kernel = rank1_row_bwd.rank1_row_bwd_kernel


if __name__ == "__main__":
    main()
