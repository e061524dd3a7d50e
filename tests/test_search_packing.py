"""gpus_per_trial auto: how many trials share a GPU, from measured memory (fake numbers:
no GPU here), how a finished trial's larger peak lowers it, and the Ray executor asking
Ray for the fraction (on a local Ray instance that declares two GPUs it does not have)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from ssmcraft.search import load_search_spec, run_search
from ssmcraft.search.executor_ray import RayExecutor
from ssmcraft.search.packing import (CONTEXT_BYTES, PACKING_FILE, SAFETY, AutoPacker, adapt, gpu_fraction, plan,
                                     probe_config, trial_peak_bytes, trial_slots)
from ssmcraft.search.spec import Resources
from ssmcraft.search.testing import quadratic, tiny_spec

GIB = 2**30
H200 = 141 * GIB


def test_plan_packs_by_memory_and_says_why():
    p = plan(4 * GIB, H200, max_per_gpu=64, cpu_slots_per_gpu=64)
    expected = int(H200 * 0.95 // (4 * GIB * SAFETY + CONTEXT_BYTES))
    assert p.trials_per_gpu == expected == 23
    assert "bound by memory" in p.reason and "23 by memory" in p.reason
    assert p.gpu_fraction * p.trials_per_gpu <= 1.0 < p.gpu_fraction * (p.trials_per_gpu + 1)


@pytest.mark.parametrize("cap, cpus, bound", [(8, 64, "resources.max_trials_per_gpu"), (64, 5, "CPUs")])
def test_plan_is_capped_by_the_spec_and_the_cpus(cap, cpus, bound):
    p = plan(1 * GIB, H200, max_per_gpu=cap, cpu_slots_per_gpu=cpus)
    assert p.trials_per_gpu == min(cap, cpus) and f"bound by {bound}" in p.reason
    assert p.gpu_fraction == gpu_fraction(min(cap, cpus))


def test_a_trial_larger_than_the_gpu_still_runs_alone():
    p = plan(200 * GIB, H200, max_per_gpu=8, cpu_slots_per_gpu=8)
    assert p.trials_per_gpu == 1 and p.gpu_fraction == 1.0 and "may not fit" in p.reason


def test_gpu_fraction_lets_k_trials_fit_in_rays_precision():
    for k in range(1, 40):
        f = gpu_fraction(k)
        assert round(f, 4) == f and f * k <= 1.0 and (k == 1 or f * (k + 1) > 1.0 - 1e-3)


def test_adapt_only_lowers_and_only_when_a_trial_needed_more():
    p = plan(4 * GIB, H200, max_per_gpu=64, cpu_slots_per_gpu=64)
    assert adapt(p, 3 * GIB, max_per_gpu=64, cpu_slots_per_gpu=64) is None          # smaller: keep
    assert adapt(p, 4 * GIB + 1, max_per_gpu=64, cpu_slots_per_gpu=64) is None      # same share: keep
    lower = adapt(p, 10 * GIB, max_per_gpu=64, cpu_slots_per_gpu=64)
    assert lower.trials_per_gpu < p.trials_per_gpu and lower.peak_bytes == 10 * GIB
    assert "a trial peaked at 10.00 GiB" in lower.reason


def test_trial_peak_reads_gpu_metrics_only():
    assert trial_peak_bytes({"peak_memory_kind": "process_max_rss", "peak_memory_bytes": 5}) is None
    assert trial_peak_bytes({"peak_memory_kind": "cuda_max_allocated", "peak_memory_bytes": 5,
                             "peak_memory_reserved_bytes": 9}) == 9
    assert trial_peak_bytes(None) is None


def test_probe_config_is_a_short_uncompiled_run():
    cfg = {"task": {"name": "mqar", "seq_len": 64}, "train": {"batch_size": 16, "compile": "auto", "tokens": 10**9}}
    probe = probe_config(cfg)
    assert probe["train"]["tokens"] == 3 * 16 * 64 and probe["train"]["compile"] is False
    assert probe["train"]["save_model"] is False and cfg["train"]["tokens"] == 10**9       # a copy
    # the task's and training's own defaults (mqar: seq_len 64; batch_size from TRAIN_DEFAULTS)
    from ssmcraft.search.fidelity import tokens_per_step
    from ssmcraft.tasks.mqar import DEFAULTS
    from ssmcraft.train.config import TRAIN_DEFAULTS
    bare = probe_config({"task": {"name": "mqar"}})
    assert bare["train"]["tokens"] == 3 * TRAIN_DEFAULTS["batch_size"] * DEFAULTS["seq_len"] \
        == 3 * tokens_per_step({"task": {"name": "mqar"}, "train": {}})


def test_auto_packer_probes_once_adapts_and_records(tmp_path):
    lines = []
    packer = AutoPacker(Resources(cpus_per_trial=2, max_trials_per_gpu=8), cpus=12, gpus=1, log=lines.append)
    assert packer.slots() == 1                                                # before the probe
    calls = []

    def probe(config):
        calls.append(config)
        return {"peak_bytes": 2 * GIB, "gpu_bytes": H200, "device_name": "fake", "status": "ok"}

    first = packer.first({"x": 1}, tmp_path, probe)
    assert packer.first({"x": 2}, tmp_path, probe) is first and len(calls) == 1
    assert first.trials_per_gpu == 6 and packer.slots() == 6 and "bound by CPUs" in first.reason
    assert not packer.observe({"peak_memory_kind": "cuda_max_allocated", "peak_memory_bytes": GIB})
    assert packer.observe({"peak_memory_kind": "cuda_max_allocated", "peak_memory_bytes": 40 * GIB})
    assert packer.packing.trials_per_gpu == 2 and packer.slots() == 2
    record = json.loads((tmp_path / PACKING_FILE).read_text())
    assert [d["kind"] for d in record["decisions"]] == ["probe", "adapt"]
    assert record["current"]["trials_per_gpu"] == 2 and record["decisions"][0]["probe"]["peak_bytes"] == 2 * GIB
    assert any("packing (adapt)" in line for line in lines)


@pytest.mark.parametrize("cpus, cpt, gpu_slots, cap, want", [
    (8, 1, None, None, 8), (8, 3, None, None, 2), (8, 1, 2, None, 2), (8, 1, 6, 4, 4), (8, 2.5, 12, None, 3),
    (1, 2, None, None, 0), (16, 1, 0, None, 0),
])
def test_one_slot_formula(cpus, cpt, gpu_slots, cap, want):
    """The Ray executor and the packer count trials at once with one function: the CPUs' share,
    within the GPUs' and max_concurrent (0 when the cluster cannot hold one trial)."""
    assert trial_slots(cpus, cpt, gpu_slots, cap) == want


def test_a_failed_probe_packs_nothing_and_says_so(tmp_path):
    packer = AutoPacker(Resources(max_concurrent=3), cpus=8, gpus=2, log=lambda line: None)

    def probe(config):
        raise RuntimeError("CUDA out of memory\nmore")

    p = packer.first({}, tmp_path, probe)
    assert p.trials_per_gpu == 1 and "memory probe failed (RuntimeError: CUDA out of memory)" in p.reason
    assert packer.slots() == 2                                   # one per GPU
    assert json.loads((tmp_path / PACKING_FILE).read_text())["current"]["gpu_fraction"] == 1.0


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
@pytest.mark.xdist_group("ray")
def test_ray_executor_asks_ray_for_the_packed_fraction(tmp_path):
    """A local Ray instance declaring 2 GPUs (there are none): the probe is faked, so the
    plan is 3 per GPU by the spec's cap; each trial is given a GPU id by Ray and then, as
    it must, fails because CUDA sees no GPU. The path that ran: Ray scheduling with
    num_gpus 0.3333, not training on a GPU."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray session of another test module is still up")
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="warning",
             _node_ip_address="127.0.0.1")
    try:
        executor = RayExecutor(log=lambda line: None)
        executor._probe = lambda config: {"peak_bytes": GIB, "gpu_bytes": H200}
        # the trials fail as soon as they run; their time limit also counts the start of their Ray
        # workers (three processes importing torch), slow on a 2-core machine that runs the suite in parallel
        spec = load_search_spec(tiny_spec(resources={"cpus_per_trial": 0.25, "max_trials_per_gpu": 3,
                                                     "max_retries": 0},
                                          budget={"trials": 3, "tokens_per_trial": 1000, "seconds_per_trial": 60}))
        result = run_search(spec, tmp_path, executor=executor, trial_fn=quadratic, compile_fn=None,
                            plots=False, log=lambda line: None)
    finally:
        ray.shutdown()
    record = json.loads((tmp_path / PACKING_FILE).read_text())
    assert record["current"]["trials_per_gpu"] == 3 and record["current"]["gpu_fraction"] == 0.3333
    assert record["decisions"][0]["slots"] == 6                    # 2 GPUs x 3, within 8 CPU slots
    reasons = [t.user_attrs["reason"] for t in result.study.trials]
    assert all(t.user_attrs["host"]["gpu_share"] == 0.3333 for t in result.study.trials)
    assert len(reasons) == 3 and all("was given GPU" in r and "CUDA sees none" in r for r in reasons), reasons


def test_probe_runs_the_cut_config_and_a_cpu_run_measures_nothing(monkeypatch, tmp_path):
    """probe_memory's own path on CPU (the GPU's properties faked): the short run trains,
    reports no GPU peak, and the packer then packs nothing, saying why."""
    import types

    import torch

    from ssmcraft.search.packing import probe_memory

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=H200, name="fake"))
    config = {"name": "probe", "seed": 0, "task": {"name": "mqar", "vocab": 64, "seq_len": 32, "num_kv_pairs": 4},
              "model": {"d_model": 16, "n_layers": 1, "mixer": {"kind": "objective", "objective": "longhorn",
                                                                  "state_size": 8}},
              "train": {"batch_size": 4, "tokens": 10**9, "device": "cpu"}}
    found = probe_memory(config)
    assert found == {"peak_bytes": None, "gpu_bytes": H200, "device_name": "fake", "status": "ok"}
    packer = AutoPacker(Resources(), cpus=4, gpus=1, log=lambda line: None)
    assert "memory probe measured nothing" in packer.first(config, tmp_path, lambda c: found).reason
