"""``benchmarks/bench_prefill.py --tiny`` on CPU: it builds the spec's model at a small size, times
both paths and finds them in agreement (the last prompt logits, every cache and the decode steps
after). The timing itself is a GPU figure (the script's docstring)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench_prefill():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_prefill", ROOT / "benchmarks" / "bench_prefill.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_times_both_paths_and_they_agree(tmp_path, capsys):
    _bench_prefill().main(["--tiny", "--tokens", "9", "--reps", "1", "--decode", "3", "--out", str(tmp_path)])
    [row] = json.loads((tmp_path / "bench_prefill.json").read_text())["rows"]
    assert row["model"].startswith("2 x d32 longhorn") and row["tokens"] == 9 and row["batch"] == 1
    assert row["prefill_ms"] > 0 and row["token_loop_ms"] > 0
    assert abs(row["speedup"] - row["token_loop_ms"] / row["prefill_ms"]) < 1e-6 * row["speedup"]
    assert row["logits_rel_err"] < 1e-5 and row["cache_rel_err"] < 1e-5 and row["decode_rel_err"] < 1e-5, row
    assert row["prefill_backend"] == ["torch-vectorised"] and row["step_backend"] == ["torch-vectorised"]
    assert "speedup:" in capsys.readouterr().out
