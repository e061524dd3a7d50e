"""Search throughput and GPU utilisation, with and without the busy-GPU trial settings, in one command.

Runs the search spec once per mode, each for a fixed wall time (``budget.total_seconds``:
no new trial after it; trials in flight finish), while ``nvidia-smi`` samples the GPU in
the background, and prints one table: mode, trials finished, span, trials/hour, mean GPU
utilisation, fraction of samples with the GPU busy, tokens/s summed over trials.

Modes (the spec's own keys, so the comparison is honest):

- ``before``: the issue-5 settings: ``resources.gpus_per_trial: 1`` (one trial per GPU),
  ``train.compile: false``, ``train.cuda_graphs: false``, ``train.data_on_device: false``
  (batches built on the host, copied each step), ``train.log_every: 1`` (a host sync every step);
- ``after``: the spec as written (``specs/search_mqar_gpu.yaml``: packed trials, device data,
  read-back every 50 steps, the training defaults: CUDA graphs on CUDA);
- ``after-compile``: ``after`` with ``train.cuda_graphs: false`` (so ``train.compile: auto``
  compiles: the default until CUDA graphs);
- ``after-eager``: ``after`` with neither.

On the GPU machine (optuna and ray installed)::

    python benchmarks/bench_search_gpu.py --seconds 150 --out $OUT/bench_search

First (on CUDA, unless ``--no-sync-check``) it counts the host syncs of one 40-step
training run of the spec's first objective, by Python line (``torch.cuda`` sync debug
mode): a line counted about 40 times is a per-step sync left somewhere.

``--device cpu`` is a smoke test anywhere: the model is shrunk (printed), trials run on
CPU, and without ``nvidia-smi`` the GPU columns say so. Each mode's run folder (with
``packing.json``), its spec and the samples stay under ``--out``; ``results.json`` holds
the table.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "before": {("resources", "gpus_per_trial"): 1, ("train", "compile"): False, ("train", "cuda_graphs"): False,
               ("train", "data_on_device"): False, ("train", "log_every"): 1},
    "after": {},
    "after-compile": {("train", "cuda_graphs"): False},
    "after-eager": {("train", "compile"): False, ("train", "cuda_graphs"): False},
}
CPU_SMOKE = {  # --device cpu: a model small enough to finish trials in seconds on two cores
    ("task",): {"name": "mqar", "vocab": 256, "seq_len": 64, "num_kv_pairs": 4},
    ("model", "d_model"): 32, ("model", "n_layers"): 1, ("train", "batch_size"): 8,
    ("train", "eval_batch_size"): 8, ("train", "eval_batches"): 1, ("train", "log_every"): 10,
    ("budget", "tokens_per_trial"): 8 * 64 * 30, ("resources", "gpus_per_trial"): 0,
}
SMI_QUERY = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-lms", "500"]


def set_path(spec: dict, path: tuple, value) -> None:
    node = spec
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def mode_spec(base: dict, mode: str, args) -> dict:
    """The spec one mode runs: the mode's settings, a fixed wall time, trials not capped."""
    spec = copy.deepcopy(base)
    spec["name"] = f"{base['name']}_{mode.replace('-', '_')}"
    changes = {**CPU_SMOKE, **MODES[mode]} if args.device == "cpu" else dict(MODES[mode])
    if args.device == "cpu":
        changes[("resources", "gpus_per_trial")] = 0
    for path, value in changes.items():
        set_path(spec, path, value)
    spec["budget"].update(trials=100_000, total_seconds=args.seconds, seconds_per_trial=args.trial_seconds,
                          timeout_grace=args.grace)
    return spec


class Sampler:
    """``nvidia-smi -lms 500`` in the background, to a CSV; absent nvidia-smi: says so."""

    def __init__(self, path: Path):
        self.path, self.proc, self.file = path, None, None
        self.available = shutil.which("nvidia-smi") is not None

    def __enter__(self):
        if self.available:
            self.file = open(self.path, "w")
            self.proc = subprocess.Popen(SMI_QUERY, stdout=self.file, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.file.close()

    def summary(self) -> dict:
        if not self.available:
            return {"gpu_util_mean": None, "gpu_busy_fraction": None, "gpu_mem_used_mib_max": None, "samples": 0}
        util, mem = [], []
        for line in self.path.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
                util.append(int(parts[0]))
                mem.append(int(parts[1]))
        n = len(util)
        return {"gpu_util_mean": sum(util) / n if n else None,
                "gpu_busy_fraction": sum(u > 0 for u in util) / n if n else None,
                "gpu_mem_used_mib_max": max(mem) if mem else None, "samples": n}


def trial_outcomes(run_dir: Path) -> list[dict]:
    out = []
    for info in sorted((run_dir / "trials").glob("*/trial.json")):
        outcome = json.loads(info.read_text()).get("outcome")
        if outcome is not None:
            out.append(outcome)
    return out


def run_mode(base: dict, mode: str, args, out: Path) -> dict:
    folder = out / mode
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(mode_spec(base, mode, args), sort_keys=False))
    run_dir = folder / "run"
    cmd = [sys.executable, "-m", "ssmcraft.cli", "search", str(spec_path), "--out", str(run_dir), "--no-plots",
           "--executor", args.executor]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print(f"[{mode}] {' '.join(cmd)}", flush=True)
    with Sampler(folder / "nvidia_smi.csv") as sampler, open(folder / "search.log", "w") as log:
        t0 = time.monotonic()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                timeout=args.seconds + args.trial_seconds + args.grace + 300).returncode
        except subprocess.TimeoutExpired:   # killed; the trials that finished still count
            rc = "killed: past its time limit"
        span = time.monotonic() - t0
    outcomes = trial_outcomes(run_dir)
    ok = [o for o in outcomes if o.get("status") == "complete"]
    tokens = sum((o.get("metrics") or {}).get("tokens") or 0 for o in outcomes)
    first = [(o.get("metrics") or {}).get("first_step_s") for o in ok]
    first = [f for f in first if isinstance(f, (int, float))]
    packing = run_dir / "packing.json"
    row = {"mode": mode, "rc": rc, "trials_ok": len(ok), "trials_other": len(outcomes) - len(ok),
           "span_s": span, "trials_per_hour": len(ok) / span * 3600, "tokens_per_s_all": tokens / span,
           "first_step_s_mean": sum(first) / len(first) if first else None,
           "packing": json.loads(packing.read_text())["current"] if packing.is_file() else None,
           "compile": [(o.get("metrics") or {}).get("compile") for o in ok[:1]],
           **sampler.summary()}
    if rc != 0:
        print(f"[{mode}] search exited with {rc}; see {folder / 'search.log'}", flush=True)
    return row


def sync_config(base: dict, steps: int, device: str) -> dict:
    """The experiment config of the sync check: the spec's sections, its first named
    objective and first state size, ``steps`` steps."""
    objective = next(o for o in base["space"]["objective"]["choice"] if isinstance(o, str))
    m = base["space"].get("m", {}).get("choice", [16])[0]
    task = base["task"]
    return {"name": "sync_check", "seed": 0, "task": task,
            "model": {**base["model"], "mixer": {**base["model"].get("mixer", {}), "objective": objective,
                                                 "state_size": m}},
            "train": {**base.get("train", {}), "tokens": steps * base["train"]["batch_size"] * task["seq_len"],
                      "save_model": False, "device": device}}


def sync_check(base: dict, steps: int = 40) -> list[tuple[str, int]] | None:
    """Host syncs of one training run of the spec's first named objective on the GPU, with
    ``torch.cuda.set_sync_debug_mode("warn")``: ``[(where, count)]``, most frequent first
    (``where`` is the Python line that synchronised). A location counted about ``steps``
    times is a per-step sync; the read-back shows up once per ``train.log_every`` steps."""
    import warnings

    import torch

    from ssmcraft.train import train_run

    if not torch.cuda.is_available():
        return None
    config = sync_config(base, steps, "cuda")
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_run(config, Path(tmp))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{Path(w.filename).name}:{w.lineno}"
            counts[where] = counts.get(where, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def secs(x) -> str:
    return "n/a" if x is None else f"{x:.1f} s"


def table(rows: list[dict], smi: bool) -> str:
    lines = ["| mode | trials finished (other) | span | trials/hour | tokens/s, all trials | mean GPU utilisation "
             "| samples with GPU busy | trials per GPU | first step (compile, JIT) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        util = "n/a" if r["gpu_util_mean"] is None else f"{r['gpu_util_mean']:.0f}%"
        k = r["packing"]["trials_per_gpu"] if r["packing"] else "-"
        lines.append(f"| {r['mode']} | {r['trials_ok']} ({r['trials_other']}) | {r['span_s']:.0f} s | "
                     f"{r['trials_per_hour']:.0f} | {r['tokens_per_s_all']:.0f} | {util} | "
                     f"{pct(r['gpu_busy_fraction'])} | {k} | {secs(r['first_step_s_mean'])} |")
    if not smi:
        lines.append("\nnvidia-smi not found on this machine: GPU utilisation not sampled (n/a).")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, default=ROOT / "specs" / "search_mqar_gpu.yaml")
    p.add_argument("--seconds", type=float, default=150.0, help="wall time per mode (budget.total_seconds)")
    p.add_argument("--trial-seconds", type=float, default=40.0, help="budget.seconds_per_trial")
    p.add_argument("--grace", type=float, default=30.0, help="budget.timeout_grace")
    p.add_argument("--modes", default="before,after", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run with a shrunk model (any machine)")
    p.add_argument("--executor", choices=("ray", "inline"), default="ray")
    p.add_argument("--no-sync-check", action="store_true",
                   help="skip the count of host syncs in one training run (CUDA sync debug mode)")
    p.add_argument("--out", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_search_gpu_"))
    base = yaml.safe_load(args.spec.read_text())
    if args.device == "cpu":
        print("cpu smoke: model shrunk to " + ", ".join(f"{'.'.join(k)}={v}" for k, v in CPU_SMOKE.items()))
    smi = shutil.which("nvidia-smi") is not None
    if not smi:
        print("nvidia-smi not found: GPU utilisation will not be sampled; trials/hour still measured")
    if args.device == "cuda" and not args.no_sync_check:
        found = sync_check(base)
        print("host syncs in one 40-step training run (sync debug mode; where: count):")
        print("  " + ("CUDA not available here" if found is None else ", ".join(f"{w}: {n}" for w, n in found[:12])
                      or "none"), flush=True)
    rows = [run_mode(base, mode, args, out) for mode in modes]
    (out / "results.json").write_text(json.dumps({"spec": str(args.spec), "args": vars(args) | {
        "spec": str(args.spec), "out": str(out)}, "rows": rows}, indent=2, default=str))
    print(f"\nspec {args.spec.name}, {args.seconds:g} s per mode, device {args.device}, executor {args.executor}; "
          f"runs under {out}")
    print(table(rows, smi))
    for r in rows:
        if r["packing"]:
            print(f"[{r['mode']}] packing: {r['packing']['reason']}")
        if r["compile"] and r["compile"][0]:
            print(f"[{r['mode']}] compile: {r['compile'][0]}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
