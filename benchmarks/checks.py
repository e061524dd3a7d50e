"""What the GPU checks of the kernel benchmarks share: the tolerance tables and the comparison
of a kernel with the float64 reference loop (output, final states, every gradient; the same
``ssmcraft.runtime.checking`` the kernel tests use), and one way to print its result.

Import as ``from checks import ...`` with ``benchmarks/`` on ``sys.path`` (each script does that).
"""
from __future__ import annotations

import torch

from ssmcraft.runtime.checking import Comparison, compare, reference, reference_errors  # noqa: F401

# relative RMS error of every output and gradient, kernel vs the float64 reference loop
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}            # sequential kernels (row, rank-r, general, diagonal)
TOL_CHUNKED = {torch.float32: 1e-4, torch.bfloat16: 3e-2}    # chunked kernels (bf16 tensor-core products)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def summary(cmp: Comparison, tol: float) -> str:
    """``worst 3.1e-05 (dS0), all written: ok`` (or ``FAIL``, with what failed)."""
    name, worst = cmp.worst
    bad = list(cmp.over(tol))
    verdict = "ok" if cmp.within(tol) else "FAIL" + (f" over {tol:g}: {', '.join(bad)}" if bad else "") + \
        ("" if cmp.written else " (an output or gradient left unwritten: NaN)")
    return f"worst {worst:.2e} ({name}) {verdict}"
