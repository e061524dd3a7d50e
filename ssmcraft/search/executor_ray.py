"""The Ray executor: one Ray task per trial, on one machine or a cluster.

- Where: ``address="local"`` starts a private Ray instance bound to 127.0.0.1 with no
  dashboard; any other address (``host:port``, ``auto``, ``ray://...``) joins that cluster.
  A Ray session already initialised in this process (tests share one) is used as is.
  Either way the same tasks run; the log says which case it was.
- Resources: each task asks for ``cpus_per_trial`` CPUs and ``gpus_per_trial`` GPUs (a
  fraction packs trials onto one GPU; ``auto``: 0 without GPUs, else as many trials per
  GPU as their measured memory allows, ``ssmcraft.search.packing``: the first trial's
  config is probed on one GPU at the first submission, and ``Capacity.slots`` follows);
  the number of trials in flight is what the cluster holds, capped by ``max_concurrent``.
  A trial given a GPU checks that CUDA sees it before it starts.
- Failures: a trial's own exception is caught on the worker (``outcome.execute``); a
  worker that dies (killed, segfault, ``os._exit``, node lost) has its task re-run by Ray
  up to ``max_retries`` times; past that the trial fails with the reason. A trial past its
  hard time limit, counted from the start of its latest attempt (a queued trial is not
  timed), is cancelled with ``force=True``, which kills its worker.
- Reports: trials send intermediate metrics to a small actor on the driver's node (it
  must outlive any worker node); ``wait`` drains it and passes each report to the
  coordinator (the study's only writer), whose decision (go on or stop) the actor holds
  until the trial, polling, picks it up. With fidelity rungs or a pruner a trial waits for
  the answer to each report (a rung decision must not be one report late), a fraction of a
  second; otherwise no answer can stop it and it goes on at once, waiting only, before it
  returns, until its reports are in the actor, so that none is lost.
- The broker survives its worker's death: Ray restarts it (``max_restarts``) with empty
  memory and retries the calls made meanwhile. A trial waiting for an answer sends its
  report again with each poll, and every trial sends its reports again before it returns
  (``resend``): the broker keeps those it does not know, so a report that was in the dead
  broker is relayed again (the coordinator ignores a step it has seen). The coordinator
  notices the restart (``drain`` names the broker's incarnation), logs it, and pauses the
  hard-limit clock of every running trial for the time the broker may have been down (since
  it last answered a drain): a trial can spend that time waiting for it, and a restart
  (a new worker process) takes seconds, tens on a loaded machine. The clock of a trial
  whose start the dead broker held starts then.
- On a cluster the run folder must be on a filesystem every node sees, or trial folders
  (checkpoints) stay on the node that ran them; metrics come back either way.
"""
from __future__ import annotations

import math
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Callable

from ssmcraft.errors import SsmcraftError, one_line
from ssmcraft.search.executor import Capacity, Job
from ssmcraft.search.outcome import Outcome, TrialFn, count_attempts, execute, plain, squash
from ssmcraft.search.packing import AutoPacker, probe_memory, trial_slots
from ssmcraft.search.rundir import run_dir_of
from ssmcraft.search.spec import Resources

LOOPBACK = "127.0.0.1"
REPORT_POLL_S = 0.05   # how often a trial waiting for the answer to its report asks
PROBE_TIMEOUT_S = 600   # the GPU memory probe of gpus_per_trial auto (a few steps; compiles the kernels)


class ReportBroker:
    """Ray actor between running trials and the coordinator (see the module doc): holds
    the attempts that started and the reports made since the coordinator last looked,
    and the pruning decisions."""

    def __init__(self) -> None:
        self.incarnation = uuid.uuid4().hex     # a new one after each restart
        self._started: list[int] = []
        self._pending: list[tuple[int, int, dict]] = []
        self._relayed: set[tuple[int, int]] = set()     # drained, answer not yet in
        self._decisions: dict[tuple[int, int], bool] = {}

    def started(self, number: int) -> None:
        self._started.append(number)

    def report(self, number: int, step: int, metrics: dict) -> None:
        """Keep a report for the coordinator unless it is known (pending, relayed or answered):
        a re-run attempt, a resent report or a call Ray retried gets the same answer."""
        key = (number, step)
        if key not in self._decisions and key not in self._relayed and all(
                (n, s) != key for n, s, _ in self._pending):
            self._pending.append((number, step, metrics))

    def poll(self, number: int, step: int, metrics: dict) -> bool | None:
        """The answer to a report: True: stop; False: go on; None: none yet (the report is
        kept again if this broker does not know it: it was sent to a broker that died)."""
        answer = self._decisions.get((number, step))
        if answer is None:
            self.report(number, step, metrics)
        return answer

    def resend(self, number: int, reports: list[tuple[int, dict]]) -> None:
        for step, metrics in reports:
            self.report(number, step, metrics)

    def drain(self) -> tuple[str, list[int], list[tuple[int, int, dict]]]:
        out = (self.incarnation, self._started, self._pending)
        self._relayed.update((n, s) for n, s, _ in self._pending)
        self._started, self._pending = [], []
        return out

    def decide(self, number: int, step: int, stop: bool) -> None:
        self._relayed.discard((number, step))
        self._decisions.setdefault((number, step), stop)  # the first answer stands


def run_on_worker(trial_fn: TrialFn, config: dict, out_dir: str, number: int,
                  broker, wants_gpu: bool, await_answers: bool) -> Outcome:
    """The Ray task: say it started, check the GPU it was given, ``outcome.execute``.

    ``await_answers``: a report waits for the coordinator's answer to it (a rung or the pruner
    decides at that report); otherwise (no answer can stop the trial) it goes on at once."""
    import ray

    broker.started.remote(number)
    sent: list[tuple[int, dict]] = []

    def report(step: int, metrics: dict) -> bool:
        step, metrics = int(step), plain(metrics)
        sent.append((step, metrics))
        broker.report.remote(number, step, metrics)
        if not await_answers:       # recorded; no answer can stop this trial
            return False
        while (stop := ray.get(broker.poll.remote(number, step, metrics))) is None:
            time.sleep(REPORT_POLL_S)
        return stop

    host = {"node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
    if wants_gpu:
        import torch

        if not host["gpu_ids"] or not torch.cuda.is_available():
            return Outcome(error=f"error: this trial was given GPU {host['gpu_ids']} but CUDA sees none "
                                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})",
                           host=host)
        host["device_name"] = torch.cuda.get_device_name(0)
    outcome = execute(trial_fn, config, Path(out_dir), report, host=host)
    # an actor runs one caller's calls in order: once this call is done, every report is in the
    # broker (sent again to one that restarted meanwhile), so the driver finds them all when it
    # sees this task done (``wait``)
    if sent:
        ray.get(broker.resend.remote(number, sent))
    return outcome


def check_reachable(address: str, timeout: float = 10.0) -> None:
    """Refuse a cluster address ``host:port`` (or ``ray://host:port``) where nothing accepts a
    connection: ``ray.init`` would wait there without end, logging retries. ``auto`` and other forms
    are left to Ray."""
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise SsmcraftError(f"Ray address {address}: nothing answers there ({e.strerror or e}); "
                            f"is `ray start --head` running on that machine?") from None


def connect(address: str, *, num_cpus: int | None = None, log: Callable[[str], None] = print) -> bool:
    """Initialise Ray for the search; returns whether this call started it (and so
    whether ``close`` must shut it down).

    A local instance is kept on loopback by its node address and
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (ENV.md: without it Ray swaps 127.0.0.1 for a
    public interface), which Ray reads when it is first imported: this function sets it
    before importing Ray, and refuses to run when Ray, imported earlier without it, bound
    elsewhere anyway.
    """
    if address == "local":
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    elif num_cpus is not None:
        raise SsmcraftError("num_cpus applies to a local Ray instance only, not to a cluster")
    if address != "local":
        check_reachable(address)
    import ray

    if ray.is_initialized():
        log(f"ray: using the Ray session already initialised in this process "
            f"({ray.get_runtime_context().gcs_address})")
        return False
    kwargs: dict = {"include_dashboard": False, "logging_level": "warning"}
    if address == "local":
        kwargs.update(num_cpus=num_cpus, _node_ip_address=LOOPBACK)
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SsmcraftError(f"Ray address {address}: {one_line(e)}") from None
    gcs = ray.get_runtime_context().gcs_address
    if address != "local":
        log(f"ray: connected to the Ray cluster at {gcs}")
        return True
    if not gcs.startswith(LOOPBACK + ":"):
        ray.shutdown()
        raise SsmcraftError(f"the local Ray instance bound to {gcs}, not to loopback (Ray was imported "
                            f"before ssmcraft could set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; set it "
                            f"in the environment); refusing to run")
    log(f"ray: started a local Ray instance at {gcs} (loopback only, no dashboard)")
    return True


def describe_ray_error(e: Exception, attempts: int | None) -> str:
    """One-line reason for a task that did not return an ``Outcome``."""
    import ray.exceptions as rex

    tries = f" ({attempts} attempts)" if attempts else ""
    if isinstance(e, rex.OutOfMemoryError):
        return f"out of memory: Ray's memory monitor killed the worker{tries}: {squash(str(e), 300)}"
    if isinstance(e, (rex.WorkerCrashedError, rex.NodeDiedError, rex.LocalRayletDiedError)):
        return f"worker died{tries}: {_typed(e)}"
    if isinstance(e, rex.RayTaskError):  # the task itself failed before execute() ran
        return f"error: on the worker: {_typed(e.cause if e.cause is not None else e)}"
    return f"error: {_typed(e)}"


def _typed(e: BaseException) -> str:
    """``Type: message`` with the whole message on one line: Ray's own messages put the cause after a
    first line that only names the task (so ``errors.one_line``'s first line would lose it), and a
    task's exception (``RayTaskError.cause``) may span lines too."""
    return f"{type(e).__name__}: {squash(str(e), 300)}"


class RayExecutor:
    """See the module doc. ``num_cpus`` sizes a local instance (default: all cores)."""

    def __init__(self, address: str = "local", *, num_cpus: int | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.address = address
        self.num_cpus = num_cpus
        self.log = log
        self._owns_session = False
        self._task = None
        self._broker = None
        self._incarnation: str | None = None    # the broker's, as last seen
        self._drained_at = 0.0                  # when the broker last answered a drain (was last seen alive)
        self._wants_gpu = False
        self._running: dict = {}  # ObjectRef -> job
        self._started: dict[int, float] = {}  # trial number -> start of its latest attempt
        self._packer: AutoPacker | None = None  # gpus_per_trial auto on GPUs
        self._capacity: Capacity | None = None
        self._shares: dict[int, float] = {}     # trial number -> Ray num_gpus (packed trials)
        self._probe_cpus = 1.0

    def start(self, resources: Resources) -> Capacity:
        self._owns_session = connect(self.address, num_cpus=self.num_cpus, log=self.log)
        import ray  # after connect(), which sets Ray's environment first
        total = ray.cluster_resources()
        cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
        gpt = resources.gpus_per_trial
        self._packer = None
        if gpt is None:  # auto: packed on GPUs (one per GPU until the probe), else CPU trials
            self._packer = AutoPacker(resources, cpus, gpus, self.log) if gpus >= 1 else None
            gpt = 1.0 if gpus >= 1 else 0.0
        if gpt > 0 and gpus == 0:
            raise SsmcraftError(f"resources.gpus_per_trial is {gpt:g} but the Ray cluster has no GPU")
        slots = trial_slots(cpus, resources.cpus_per_trial, math.floor(gpus / gpt) if gpt > 0 else None,
                            resources.max_concurrent)
        if slots < 1:
            raise SsmcraftError(f"the Ray cluster ({cpus:g} CPUs, {gpus:g} GPUs) cannot hold one trial "
                                f"({resources.cpus_per_trial:g} CPUs, {gpt:g} GPUs)")
        self._wants_gpu = gpt > 0
        # a GPU trial gets a fresh worker process (max_calls=1): a reused one would keep the
        # CUDA context of the GPU it saw first; CPU trials reuse workers (0: no limit)
        self._task = ray.remote(num_cpus=resources.cpus_per_trial, num_gpus=gpt,
                                max_calls=1 if gpt > 0 else 0, max_retries=resources.max_retries,
                                retry_exceptions=False)(run_on_worker)
        self._new_broker()
        device = "cuda" if gpt > 0 else "cpu"
        self._probe_cpus = resources.cpus_per_trial
        share = "GPUs packed from measured memory" if self._packer is not None else f"{gpt:g} GPU"
        self._capacity = Capacity(slots, device, (
            f"ray ({cpus:g} CPUs, {gpus:g} GPUs; {slots} trials at a time, each "
            f"{resources.cpus_per_trial:g} CPU and {share}; up to {resources.max_retries} "
            f"retries when a worker dies)"))
        return self._capacity

    def _new_broker(self) -> None:
        """Start the report broker on this node: restarted by Ray when its worker dies, the
        calls made meanwhile retried (module doc)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._broker = ray.remote(num_cpus=0, scheduling_strategy=here, max_restarts=-1,
                                  max_task_retries=-1)(ReportBroker).remote()
        self._incarnation = None
        self._drained_at = time.monotonic()

    def submit(self, job: Job) -> None:
        task = self._task
        if self._packer is not None:
            packing = self._packer.first(job.config, run_dir_of(job.out_dir), self._probe)
            self._capacity.slots = self._packer.slots()
            task = task.options(num_gpus=packing.gpu_fraction)
            self._shares[job.number] = packing.gpu_fraction
        ref = task.remote(job.trial_fn, job.config, str(job.out_dir), job.number, self._broker, self._wants_gpu,
                          job.await_answers)
        self._running[ref] = job

    def wait(self, timeout: float) -> list[tuple[Job, Outcome]]:
        import ray

        if not self._running:
            return []
        refs = list(self._running)
        ray.wait(refs, num_returns=1, timeout=timeout)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        # the hard limits are judged at this moment, when the tasks not in ``ready`` were seen
        # unfinished: the drain below can wait long for a restarting broker, and a task that
        # returns meanwhile has its result, not a timeout
        now = time.monotonic()
        # a finished task's reports are all in the broker (the task waits for its last one
        # before it returns): relay them while the task still counts as running, so none is lost
        self._relay_reports()
        done: list[tuple[Job, Outcome]] = []
        for ref in ready:
            job = self._running.pop(ref)
            started = self._started.pop(job.number, now)
            try:
                outcome = ray.get(ref)
            except ray.exceptions.RayError as e:
                outcome = Outcome(error=describe_ray_error(e, count_attempts(job.out_dir)),
                                  wall_s=now - started, attempts=count_attempts(job.out_dir))
            done.append((job, self._with_share(job, outcome)))
            if self._packer is not None and self._packer.observe(outcome.metrics):
                self._capacity.slots = self._packer.slots()
        for ref, job in list(self._running.items()):
            started = self._started.get(job.number)
            if started is not None and now - started > job.time_limit_s:
                ray.cancel(ref, force=True)
                del self._running[ref], self._started[job.number]
                done.append((job, self._with_share(job, Outcome(
                    error=f"timeout: no result within {job.time_limit_s:g} s (hard limit); its worker was killed",
                    wall_s=now - started, attempts=count_attempts(job.out_dir)))))
        return done

    def _with_share(self, job: Job, outcome: Outcome) -> Outcome:
        """``outcome`` with the GPU share Ray gave the trial (packed trials) in its host record."""
        share = self._shares.pop(job.number, None)
        if share is not None:
            outcome.host = {**(outcome.host or {}), "gpu_share": share}
        return outcome

    def _probe(self, config: dict) -> dict:
        """``packing.probe_memory(config)`` as a Ray task on one whole GPU (a fresh worker)."""
        import ray

        task = ray.remote(num_cpus=self._probe_cpus, num_gpus=1, max_calls=1, max_retries=0)(probe_memory)
        ref = task.remote(config)
        try:
            return ray.get(ref, timeout=PROBE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)   # it would hold its GPU; the packer records the failure
            raise
        except ray.exceptions.RayTaskError as e:   # its first line names only the task: say the cause
            raise RuntimeError(describe_ray_error(e, None)) from e

    def _relay_reports(self) -> None:
        import ray

        if self._broker is None:
            return
        jobs = {job.number: job for job in self._running.values()}
        try:
            incarnation, started, reports = ray.get(self._broker.drain.remote())
            drained_at, self._drained_at = self._drained_at, time.monotonic()
        except ray.exceptions.RayActorError as e:   # not restartable (killed for good): the trials' reports fail them
            self.log(f"search: the report broker is gone ({describe_ray_error(e, None)}); a new one takes "
                     f"the next trials' reports")
            self._new_broker()
            return
        if incarnation != self._incarnation:
            if self._incarnation is not None:
                self.log("search: the report broker restarted (its worker died); running trials send their "
                         "reports again")
                # a running trial may have waited for the broker (an answer, its last resend) since it was
                # last seen alive: that time is not the trial's. Those whose start the dead broker held are
                # timed from now.
                down_s = self._drained_at - drained_at
                for number in jobs:
                    self._started[number] = self._started.get(number, drained_at) + down_s
            self._incarnation = incarnation
        for number in started:
            if number in jobs:
                self._started[number] = time.monotonic()
        for number, step, metrics in reports:
            job = jobs.get(number)
            if job is not None:     # every answer is kept: a re-run attempt's reports are not passed on again
                self._broker.decide.remote(number, step, bool(job.on_report(step, metrics)))

    def close(self) -> None:
        import ray

        for ref in list(self._running):
            ray.cancel(ref, force=True)
        self._running.clear()
        self._started.clear()
        if self._broker is not None:
            ray.kill(self._broker)
            self._broker = None
        if self._owns_session:
            ray.shutdown()
            self._owns_session = False
