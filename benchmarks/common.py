"""Shared helpers for the kernel benchmark scripts (run on the GPU through the `device` tool).

Timing (`bench_ms`: triton.testing.do_bench median, from ``ssmcraft.runtime.timing``, which also
has `busy`, the GPU-busy fraction and host time per call; `once_ms`: CUDA events, for slow anchors
such as the naive PyTorch loop), the HBM floor (`copy_bandwidth`, `floor_bytes`) and a small
JSON/stdout `Report`. Error metrics and reference checks: ``ssmcraft.runtime.checking`` and
``checks.py``.
Import as ``from common import ...`` with ``benchmarks/`` on ``sys.path`` (each script does that).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import time

import torch

from ssmcraft.bench.run import floor_bytes, random_inputs, random_state  # noqa: F401
from ssmcraft.runtime.timing import bench_ms, copy_bandwidth  # noqa: F401


def once_ms(fn, reps: int = 2) -> float:
    """Median of ``reps`` timed calls after one warm-up (CUDA events); for anchors too slow for do_bench."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "?"
    except Exception:
        return "?"


class Report:
    """Collects rows, prints them as they come, writes JSON at the end."""

    def __init__(self, name: str):
        self.data = {"name": name, "date": _dt.datetime.now().isoformat(timespec="seconds"),
                     "device": device_name(), "torch": torch.__version__, "git": git_rev(),
                     "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "rows": []}
        self.t0 = time.time()
        print(f"# {name}: {self.data['device']}, torch {torch.__version__}, {self.data['date']}", flush=True)

    def add(self, **row):
        row["t_s"] = round(time.time() - self.t0, 1)
        self.data["rows"].append(row)
        print("  " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)

    def set(self, key, value):
        self.data[key] = value
        print(f"  {key}: {_fmt(value)}", flush=True)

    def write(self, path: str | None):
        if path:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(self.data, f, indent=1, default=str)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def timing_table(title: str, rows: list, columns: list, ratios: dict | None = None, after=None) -> None:
    """Print ``title`` and a markdown table of timing ``rows`` (dicts, as ``classes_commands.measure``
    returns them): one column per ``(header, key)`` of ``columns`` (floats as ``%.3f``, a missing key as
    -), then one per ``header: ms`` of ``ratios``, the row's ``fwd_bwd_ms`` over ms (- where either is
    missing). A row holding ``"error"`` prints it in the first column keyed ``fwd_ms`` and - after it.
    ``after(row)``: extra lines printed under a row."""
    heads = [h for h, _ in columns] + list(ratios or {})
    print(f"\n{title}")
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        cells, failed = [], False
        for _, key in columns:
            if failed:
                cells.append("-")
            elif "error" in r and key == "fwd_ms":
                cells.append(r["error"][:80])
                failed = True
            else:
                v = r.get(key, "-")
                cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        fb = None if "error" in r else r.get("fwd_bwd_ms")
        cells += [f"{fb / ms:.2f}" if fb and ms else "-" for ms in (ratios or {}).values()]
        print("| " + " | ".join(cells) + " |")
        for line in (after(r) if after else ()):
            print(line)


def bound_fla_autotune(keep: int) -> int:
    """Cut every FLA autotuner to at most ``keep`` configs, so that its first call compiles a few
    configs per kernel rather than every one (minutes at this shape). Kept: 4 or 8 warps and 2 or 3
    stages where the list has them (FLA's own choices at this shape are among those), 4 warps and
    2 stages first. Prints and returns the number of autotuners cut."""
    from triton.runtime.autotuner import Autotuner
    cut = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if not isinstance(obj, Autotuner) or len(obj.configs) <= keep:
                continue
            pref = [c for c in obj.configs if c.num_warps in (4, 8) and c.num_stages in (2, 3)] or obj.configs
            pref.sort(key=lambda c: (c.num_warps != 4, c.num_stages != 2))
            obj.configs = pref[:keep]
            cut += 1
    print(f"FLA autotune bounded to {keep} configs per kernel ({cut} autotuners cut)", flush=True)
    return cut
