"""benchmarks/bench_search_gpu.py without running a search: the modes set the issue-5
settings through the spec's own keys, the wall time is fixed, and nvidia-smi's samples
are summarised (or said to be missing)."""
from __future__ import annotations

import importlib.util
from argparse import Namespace
from pathlib import Path

import yaml

from ssmcraft.search import load_search_spec

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_search_gpu", ROOT / "benchmarks" / "bench_search_gpu.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
BASE = yaml.safe_load((ROOT / "specs" / "search_mqar_gpu.yaml").read_text())


def args(device="cuda"):
    return Namespace(seconds=150.0, trial_seconds=40.0, grace=30.0, device=device)


def test_before_is_the_issue5_settings_and_after_the_spec_as_written():
    before, after = bench.mode_spec(BASE, "before", args()), bench.mode_spec(BASE, "after", args())
    assert before["resources"]["gpus_per_trial"] == 1 and after["resources"]["gpus_per_trial"] == "auto"
    assert (before["train"]["compile"], before["train"]["data_on_device"], before["train"]["log_every"]) == (
        False, False, 1)
    assert after["train"] == BASE["train"] and after["model"] == BASE["model"]
    for s in (before, after):
        assert s["budget"]["total_seconds"] == 150.0 and s["budget"]["trials"] >= 10_000
        load_search_spec(s, source="bench")                       # both are valid specs
    assert BASE["budget"]["total_seconds"] == 150                 # the base is not modified


def test_cpu_smoke_shrinks_and_never_asks_for_a_gpu():
    for mode in bench.MODES:
        s = bench.mode_spec(BASE, mode, args("cpu"))
        assert s["resources"]["gpus_per_trial"] == 0 and s["model"]["d_model"] == 32
    assert bench.mode_spec(BASE, "before", args("cpu"))["train"]["log_every"] == 1


def test_sampler_summary(tmp_path):
    sampler = bench.Sampler(tmp_path / "smi.csv")
    sampler.available = True
    (tmp_path / "smi.csv").write_text("0, 500\n80, 9000\n100, 9100\n[N/A], 1\n60, 8000\n")
    s = sampler.summary()
    assert s == {"gpu_util_mean": 60.0, "gpu_busy_fraction": 0.75, "gpu_mem_used_mib_max": 9100, "samples": 4}
    sampler.available = False
    assert sampler.summary()["gpu_util_mean"] is None


def test_table_rows_and_missing_nvidia_smi():
    row = {"mode": "after", "trials_ok": 12, "trials_other": 1, "span_s": 180.0, "trials_per_hour": 240.0,
           "tokens_per_s_all": 1.5e6, "gpu_util_mean": None, "gpu_busy_fraction": None,
           "packing": {"trials_per_gpu": 8}, "first_step_s_mean": 12.34}
    text = bench.table([row], smi=False)
    assert "| after | 12 (1) | 180 s | 240 | 1500000 | n/a | n/a | 8 | 12.3 s |" in text
    assert "nvidia-smi not found" in text


def test_sync_check_config_is_a_valid_experiment_and_cpu_skips_it():
    from ssmcraft.train.config import resolve

    cfg = resolve(bench.sync_config(BASE, 40, "cpu"), "bench")
    assert cfg["train"]["tokens"] == 40 * 64 * 256 and cfg["model"]["mixer"]["objective"] == "longhorn"
    assert cfg["train"]["log_every"] == BASE["train"]["log_every"]
    import torch

    if not torch.cuda.is_available():
        assert bench.sync_check(BASE) is None
