"""Running one trial function on a worker and turning whatever happens into data.

A trial function is ``fn(config: dict, out_dir: Path, report) -> dict``:

- ``config`` is the trial's config (``ssmcraft.search.space.build_config``);
- ``out_dir`` is the trial's own folder (``trial.json`` and ``attempts.log`` in it belong
  to the search, the rest to the trial: checkpoint, metrics, curves);
- ``report(step, metrics) -> bool`` sends intermediate metrics to the coordinator and
  returns True when the trial should stop early (pruned); the trial then returns
  ``{"status": "pruned", ...}``. ``step`` is the trial's progress counter, increasing
  (``train_run``: the optimizer step), the pruner's step; ``metrics`` the values so far
  and ``tokens``, the tokens trained so far: a search with ``fidelity:`` measures its
  rungs in tokens, and a report there without a number ``tokens`` fails the trial, with
  that reason (the step is not taken for a token count);
- the returned dict holds the metrics (``val_loss``, ...), a ``status`` (``ok``,
  ``diverged``, ``timeout``, ``pruned``; absent means ok) and optionally ``reason``,
  ``state_bytes``, ``kernel_hash``, ``backend``, ``device``.

``execute`` never raises for a trial's own failure: an exception becomes
``Outcome.error``, a one-line reason (``classify_exception``), with the traceback saved
to ``out_dir/error.txt``. What kills the worker itself is reported by the executor.
"""
from __future__ import annotations

import math
import operator
import os
import signal
import socket
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ssmcraft.errors import DerivationError, SpecError
from ssmcraft.fileio import write_text
from ssmcraft.search.provenance import code_version

TrialFn = Callable[[dict, Path, Callable[[int, dict], bool]], dict]
Report = Callable[[int, dict], bool]
ATTEMPTS_FILE = "attempts.log"
ERROR_FILE = "error.txt"


class TrialTimeout(Exception):
    """Raised inside a trial running in the coordinator's process when its time is up."""


@dataclass
class Outcome:
    """What came back from one trial: ``metrics`` when the function returned, ``error``
    (a one-line reason) when it raised or its worker died."""
    metrics: dict | None = None
    error: str | None = None
    wall_s: float | None = None
    attempts: int | None = None
    host: dict = field(default_factory=dict)
    code_version: dict | None = None


def no_report(step: int, metrics: dict) -> bool:
    """The ``report`` a trial gets when nothing listens: never prunes."""
    return False


def squash(text: str, limit: int = 500) -> str:
    """``text`` on one line (whitespace runs collapsed), cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_out_of_memory(e: BaseException) -> bool:
    """MemoryError, torch's/Ray's ``OutOfMemoryError``, a CUDA "out of memory" or the CPU allocator's
    "can't allocate memory"."""
    text = str(e).lower()
    return (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"
            or "out of memory" in text or "can't allocate memory" in text)


def classify_exception(e: BaseException) -> str:
    """One-line failure reason, its first word the kind: ``timeout``, ``objective``
    (the compiler's message), ``out of memory`` or ``error``."""
    msg = squash(str(e))
    if isinstance(e, TrialTimeout):
        return f"timeout: {msg}"
    if isinstance(e, DerivationError):
        return f"objective does not derive: {msg}"
    if isinstance(e, SpecError):
        return f"objective invalid: {msg}"
    if is_out_of_memory(e):
        return f"out of memory: {type(e).__name__}: {msg}"
    return f"error: {type(e).__name__}: {msg}"


def plain(value: Any) -> Any:
    """``value`` as JSON-able data (numpy/torch scalars -> numbers; other objects -> str)."""
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    try:
        return operator.index(value)
    except TypeError:
        pass
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``TrialTimeout`` in the main thread after ``seconds`` (SIGALRM). Only the
    in-process executor uses it; Ray kills the worker instead."""
    if seconds is None:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the in-process time limit needs the main thread (SIGALRM)")

    def on_alarm(signum, frame):
        raise TrialTimeout(f"no result within {seconds:g} s (hard limit)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def count_attempts(out_dir: Path) -> int | None:
    try:
        return len((out_dir / ATTEMPTS_FILE).read_text().splitlines())
    except OSError:
        return None


def execute(trial_fn: TrialFn, config: dict, out_dir: Path, report: Report = no_report,
            *, time_limit_s: float | None = None, host: dict | None = None) -> Outcome:
    """Run ``trial_fn`` once in this process and return its ``Outcome``.

    Each call appends a line to ``out_dir/attempts.log`` first, so a trial re-run after
    its worker died shows how many times it started.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    host = {"hostname": socket.gethostname(), "pid": os.getpid(), **(host or {})}
    with open(out_dir / ATTEMPTS_FILE, "a") as f:
        f.write(f"{time.time():.3f} {host['hostname']} {host['pid']}\n")
    outcome = Outcome(attempts=count_attempts(out_dir), host=host, code_version=code_version())
    start = time.perf_counter()
    try:
        with time_limit(time_limit_s):
            result = trial_fn(config, out_dir, report)
        if not isinstance(result, dict):
            raise TypeError(f"the trial function returned {type(result).__name__}, not a dict of metrics")
        outcome.metrics = plain(result)
    except Exception as e:  # a trial's own failure is data, not a crash of the search
        outcome.error = classify_exception(e)
        try:
            write_text(out_dir / ERROR_FILE, "".join(traceback.format_exception(e)))
        except OSError:     # the folder was deleted while the trial ran: the coordinator says so
            pass
    outcome.wall_s = time.perf_counter() - start
    return outcome


@dataclass(frozen=True)
class Verdict:
    """How the coordinator records an ``Outcome``: ``state`` complete | pruned | failed,
    the ranking ``values`` (complete only) and the failure or pruning ``reason``."""
    state: str
    values: tuple[float, ...] | None = None
    reason: str | None = None


def judge(outcome: Outcome, metrics: list[str]) -> Verdict:
    """Complete when the trial returned a finite value for every ranking metric with
    status ok, or with status timeout (training stopped at ``train.max_seconds``: it is
    ranked on what it reached, and ``reason`` says so); otherwise pruned or failed, with
    the reason."""
    if outcome.error is not None:
        return Verdict("failed", reason=outcome.error)
    m = outcome.metrics or {}
    status, detail = m.get("status", "ok"), m.get("reason")
    suffix = f": {squash(detail)}" if detail else ""
    if status == "pruned":
        return Verdict("pruned", reason=f"pruned{suffix}")
    if status == "diverged":
        return Verdict("failed", reason=f"diverged{suffix or ': non-finite loss'}")
    if status not in ("ok", "timeout"):
        return Verdict("failed", reason=f"error: unknown status {status!r}{suffix}")
    note = None
    if status == "timeout":
        note = f"timeout: stopped after {m.get('tokens', '?')} tokens (train.max_seconds)"
    missing = [k for k in metrics if k not in m]
    if missing:
        return Verdict("failed", reason=note or f"error: metric {missing[0]!r} missing; the trial "
                                                f"returned {', '.join(sorted(m)) or 'nothing'}")
    bad = [k for k in metrics if not is_number(m[k])]
    if bad:
        return Verdict("failed", reason=f"diverged: {bad[0]} is {m[bad[0]]!r}")
    return Verdict("complete", values=tuple(float(m[k]) for k in metrics), reason=note)
