"""Trial functions that train nothing, for testing the search machinery and for trying
a cluster or a spec without training (``ssmcraft search SPEC --trial-function
ssmcraft.search.testing:quadratic``). Like ``optuna.testing``, shipped so that workers on
any node can import them.

Each follows the trial function contract of ``ssmcraft.search.outcome``. Behaviour that
depends on the trial reads its number from ``out_dir/trial.json``.
"""
from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from ssmcraft.search.outcome import count_attempts
from ssmcraft.search.space import objective_of


def trial_number(out_dir: Path) -> int:
    return json.loads((Path(out_dir) / "trial.json").read_text())["number"]


def _numbers(node, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a config tree, by dotted path."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_numbers(v, f"{prefix}{k}."))
        return out
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return {prefix[:-1]: float(node)}
    return {}


def quadratic(config: dict, out_dir: Path, report) -> dict:
    """Deterministic metrics from the config: a smooth function of the numeric model and
    train settings plus a per-objective offset; reports 4 intermediate values on the way."""
    x = {**_numbers(config["model"], "model."), **_numbers(config["train"], "train.")}
    name = objective_of(config)["name"]
    offset = sum(map(ord, name)) % 7 / 7
    loss = 1.0 + offset + sum((math.log10(abs(v) + 1e-12) % 1 - 0.5) ** 2 for v in x.values())
    tokens = int(config["train"]["tokens"])
    for i in range(1, 5):
        if report(tokens * i // 4, {"val_loss": loss * (1 + 1 / i), "tokens": tokens * i // 4}):
            return {"status": "pruned", "tokens": tokens * i // 4}
    return {"val_loss": loss, "tokens_per_s": 1000.0 / (1 + offset), "tokens": tokens,
            "state_bytes": 4 * int(x.get("model.mixer.state_size", 16)) * 64}


@dataclass
class Scripted:
    """``quadratic``, except for the trials named in ``script`` (trial number -> what to
    do): ``raise``, ``nan``, ``oom``, ``diverged``, ``time_limit`` (metrics with status
    timeout, as training returns at ``train.max_seconds``), ``sleep`` (``sleep_s`` seconds),
    ``exit`` (kill the worker process), ``exit_once`` (kill it on the first attempt only),
    ``bad_curve`` (report poor intermediate values, ``steps`` times, ``sleep_s`` apart),
    ``kill_pid`` (like ``bad_curve`` with good values, and after its first report SIGKILL
    the process whose pid is in the file ``pid_file``: another process of the search).
    Every trial sleeps ``delay_s`` first."""
    script: dict[int, str] = field(default_factory=dict)
    sleep_s: float = 30.0
    delay_s: float = 0.0
    steps: int = 20
    pid_file: str | None = None

    def __call__(self, config: dict, out_dir: Path, report) -> dict:
        time.sleep(self.delay_s)
        action = self.script.get(trial_number(out_dir))
        if action == "raise":
            raise ValueError("scripted failure")
        if action == "oom":
            raise MemoryError("scripted: CUDA out of memory. Tried to allocate 2.00 GiB")
        if action == "nan":
            return {"val_loss": float("nan"), "tokens": 1}
        if action == "diverged":
            return {"status": "diverged", "reason": "loss became inf at step 3", "tokens": 3}
        if action == "time_limit":
            return {**quadratic(config, out_dir, report), "status": "timeout", "tokens": 7}
        if action == "sleep":
            time.sleep(self.sleep_s)
        if action == "exit" or (action == "exit_once" and count_attempts(Path(out_dir)) == 1):
            os._exit(3)
        if action in ("bad_curve", "kill_pid"):
            loss = 100.0 if action == "bad_curve" else 0.5
            for i in range(1, self.steps + 1):
                if report(i * 1000, {"val_loss": loss, "tokens": i * 1000}):
                    return {"status": "pruned", "tokens": i * 1000}
                if action == "kill_pid" and i == 1:
                    os.kill(int(Path(self.pid_file).read_text()), signal.SIGKILL)
                time.sleep(self.sleep_s)
            return {"val_loss": loss, "tokens": self.steps * 1000}
        return quadratic(config, out_dir, report)


def curve(config: dict, out_dir: Path, report) -> dict:
    """``quadratic``'s final loss reached along a straight learning curve, reported like
    ``train_run`` does: after every ``train.eval_every`` steps of ``batch_size * seq_len``
    tokens (``report(step, {"val_loss", "tokens"})``), stopping when told to; sleeps
    ``train.sleep_s`` (default 0, not part of the loss) spread over the steps. For
    multi-fidelity tests."""
    from ssmcraft.search.fidelity import tokens_per_step

    train = {k: v for k, v in config["train"].items() if k != "sleep_s"}
    final = quadratic({**config, "train": train}, out_dir, lambda step, metrics: False)
    full, per_step = int(config["train"]["tokens"]), tokens_per_step(config)
    steps, every = max(1, full // per_step), int(config["train"].get("eval_every", 100))
    pause = float(config["train"].get("sleep_s", 0.0)) / steps
    for step in range(1, steps + 1):
        time.sleep(pause)
        tokens = step * per_step
        loss = final["val_loss"] + 1.0 - tokens / full
        if every and step % every == 0 and step < steps and report(step, {"val_loss": loss, "tokens": tokens}):
            return {"status": "pruned", "reason": f"stopped after step {step}", "val_loss": loss, "tokens": tokens}
    return {**final, "tokens": steps * per_step}


def sleepy(config: dict, out_dir: Path, report) -> dict:
    """``quadratic`` after sleeping ``config["train"]["sleep_s"]`` seconds (default 0.5):
    a trial slow enough to kill a coordinator in the middle of."""
    time.sleep(float(config["train"].get("sleep_s", 0.5)))
    return quadratic(config, out_dir, report)


def tiny_spec(**overrides) -> dict:
    """A small valid search spec over composed objectives only (needs no objective
    library), for tests and for trying the machinery; top-level keys in ``overrides``
    replace the defaults."""
    spec = {
        "name": "tiny",
        "task": {"name": "mqar", "seq_len": 32},
        "model": {"d_model": 16, "n_layers": 1},
        "budget": {"trials": 4, "tokens_per_trial": 1000, "seconds_per_trial": 5, "timeout_grace": 2},
        "space": {
            "objective": {"choice": [{"compose": {"proximity": ["plain", "scalar_decay"],
                                                  "step": ["scalar", "per_channel"]}}]},
            "m": {"int": [8, 32], "step": 8},
            "lr": {"float": [1.0e-4, 1.0e-2], "log": True},
        },
        "rank": {"val_loss": "minimize"},
        "sampler": {"name": "tpe", "n_startup_trials": 2},
        "resources": {"max_retries": 1},
    }
    spec.update(overrides)
    return spec


def search_tiny(out_dir, trial_fn=quadratic, *, storage_url: str | None = None, plots: bool = False,
                logs: list | None = None, compile_fn=None, **overrides):
    """``run_search`` of ``tiny_spec(**overrides)`` in ``out_dir`` with the in-process executor;
    its log lines go to ``logs`` when given."""
    from ssmcraft.search.coordinator import run_search
    from ssmcraft.search.executor import InlineExecutor
    from ssmcraft.search.spec import load_search_spec

    return run_search(load_search_spec(tiny_spec(**overrides)), out_dir, executor=InlineExecutor(),
                      trial_fn=trial_fn, storage_url=storage_url, compile_fn=compile_fn, plots=plots,
                      log=logs.append if logs is not None else lambda line: None)
