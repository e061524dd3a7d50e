"""What the coordinator needs from an executor, and the in-process one.

An executor runs stateless trial jobs and hands back their ``Outcome``s; it never
touches the study. Both executors share this interface, so the coordinator has one code
path:

- ``start(resources) -> Capacity``: acquire workers; how many trials run at once, on
  which device, described in words for the log;
- ``submit(job)``: start a trial (returns at once);
- ``wait(timeout) -> [(job, outcome)]``: the trials that finished, waiting at most
  ``timeout`` seconds; pass reports (pruning) between trials and coordinator meanwhile;
  enforce each job's hard time limit;
- ``close()``: release what ``start`` acquired.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from ssmcraft.search.outcome import Outcome, TrialFn, execute
from ssmcraft.search.spec import Resources


@dataclass
class Job:
    """One trial to run: everything a stateless worker needs, and the coordinator's
    report handler (``on_report(step, metrics) -> prune``)."""
    number: int
    trial_fn: TrialFn
    config: dict
    out_dir: Path
    on_report: Callable[[int, dict], bool]
    time_limit_s: float
    await_answers: bool     # a report needs its own answer before the trial goes on (coordinator.answers_matter)


@dataclass
class Capacity:
    """What ``start`` acquired. ``slots`` may change while the search runs (the Ray
    executor sets it once it has measured how many trials fit a GPU, and lowers it when a
    trial needed more): the coordinator reads it before each submission."""
    slots: int            # trials at once
    device: str           # "cpu", "cuda" or "auto": what trials are told to train on (train.device)
    description: str      # for the log: which executor, where, with what


class Executor(Protocol):
    def start(self, resources: Resources) -> Capacity: ...
    def submit(self, job: Job) -> None: ...
    def wait(self, timeout: float) -> list[tuple[Job, Outcome]]: ...
    def close(self) -> None: ...


class InlineExecutor:
    """Runs each trial in the coordinator's own process, one at a time: for tests,
    debugging and machines without Ray. The hard time limit is a SIGALRM in the main
    thread; a trial that kills its process (``os._exit``, a segfault) kills the search,
    which then resumes from its storage when started again."""

    def __init__(self) -> None:
        self._queue: deque[Job] = deque()

    def start(self, resources: Resources) -> Capacity:
        gpus = resources.gpus_per_trial
        # auto: training picks the GPU when there is one (and reports the device it used)
        device = "auto" if gpus is None else "cuda" if gpus > 0 else "cpu"
        return Capacity(1, device, f"inline (in this process, one trial at a time, device {device})")

    def submit(self, job: Job) -> None:
        self._queue.append(job)

    def wait(self, timeout: float) -> list[tuple[Job, Outcome]]:
        if not self._queue:
            return []
        job = self._queue.popleft()
        return [(job, execute(job.trial_fn, job.config, job.out_dir, job.on_report,
                              time_limit_s=job.time_limit_s))]

    def close(self) -> None:
        self._queue.clear()
