"""The benchmark scripts' shared timing table (``benchmarks/common.py``'s ``timing_table``): columns,
ratios to the anchors, error rows and extra lines, as the GPU scripts print them."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

from common import timing_table  # noqa: E402


def test_timing_table_columns_ratios_and_errors(capsys):
    rows = [{"spec": "deltanet", "backend": "triton:rank1-chunk", "fwd_ms": 0.25, "fwd_bwd_ms": 0.5},
            {"spec": "longhorn", "backend": "triton:rank1-row-chunk", "fwd_ms": 0.75, "fwd_bwd_ms": 2.0, "k": [1]},
            {"spec": "broken", "error": "RuntimeError: out of memory"}]
    timing_table("H200, bf16", rows, [("run", "spec"), ("backend", "backend"), ("fwd ms", "fwd_ms"),
                                      ("fwd+bwd ms", "fwd_bwd_ms")],
                 {"x DeltaNet": 0.5, "x absent": None},
                 after=lambda r: [f"|   {r['spec']} kernels |"] if "k" in r else [])
    assert capsys.readouterr().out.splitlines() == [
        "", "H200, bf16",
        "| run | backend | fwd ms | fwd+bwd ms | x DeltaNet | x absent |",
        "|---|---|---|---|---|---|",
        "| deltanet | triton:rank1-chunk | 0.250 | 0.500 | 1.00 | - |",
        "| longhorn | triton:rank1-row-chunk | 0.750 | 2.000 | 4.00 | - |",
        "|   longhorn kernels |",
        "| broken | - | RuntimeError: out of memory | - | - | - |"]
