"""benchmarks/diag_knockout.py's variants edit what they name in the generated diagonal kernels, and
every variant is still valid Python (the GPU run compiles them; here only their text is checked)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import ssmcraft  # noqa: E402
from ssmcraft.ops.diagonal import chunk as D  # noqa: E402


@pytest.mark.parametrize("objective", ["longhorn_diag", "mamba"])
def test_each_variant_removes_what_it_names(objective):
    import diag_knockout as K
    src = D.generated_source(ssmcraft.compile(objective).ir)
    stores = {leaf: src.count(f"tl.store(g_{leaf} ") for leaf in "kq"}
    assert stores["k"] > 0 and stores["q"] > 0
    for name, edit in K.VARIANTS.items():
        out = edit(src)
        compile(out, f"{objective}:{name}", "exec")
        left = {leaf: out.count(f"tl.store(g_{leaf} ") for leaf in "kq"}
        assert left["k"] == (0 if "dk" in name else stores["k"]) and left["q"] == (0 if "dq" in name else stores["q"])
        assert ("return tl.sum(x, axis=0, keep_dims=True)" in out) == (name == "no_reduction")
        assert (out == src) == (name == "base")
