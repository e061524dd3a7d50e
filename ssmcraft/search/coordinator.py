"""The coordinator: the one process that owns the Optuna study (ask/tell), hands trials
to an executor as stateless jobs, and records what comes back.

Invariants, and how they hold when the coordinator is killed (SIGKILL) and started again
with the same command:

- only the coordinator writes the study; executors and trials return data;
- a trial counts once it is told (COMPLETE, PRUNED or FAIL): told trials are never re-run,
  and every tell is on disk before the next trial is asked for (the journal fsyncs);
- a trial left RUNNING by a coordinator that is gone is *stale*: it is re-queued first
  (``enqueue_trial`` with its params and seed), then failed with the reason; a re-queue
  is recorded on the new trial (``requeue_of``), so a coordinator killed between the two
  steps does not re-queue it twice. Who is gone is the study's to say, not a host's or a
  path's (``ssmcraft.search.lease``): with the folder's journal, every running trial is
  the lock holder's; on an RDB, those of coordinators whose lease lapsed;
- a resumed study never samples a point again: its sampler is reseeded from the spec's
  seed and the number of trials the study holds (``resumed_seed``), so it does not replay
  the random sequence of the first run;
- the journal is checked on open (``storage``), and every folder under ``trials/`` must
  name a trial of the study, so trial numbers and folders are never reused;
- with ``fidelity:`` the coordinator also decides at each rung which trials go on
  (``ssmcraft.search.fidelity``); every decision is on the trial before the trial hears it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import optuna
import yaml
from optuna.trial import TrialState

from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.fileio import write_text
from ssmcraft.runtime.lookup import compile_objective
from ssmcraft.search import fidelity as fid
from ssmcraft.search import lease, reports
from ssmcraft.search.executor import Capacity, Executor, Job
from ssmcraft.search.objectives import check_objectives
from ssmcraft.search.outcome import Outcome, TrialFn, Verdict, classify_exception, is_number, judge
from ssmcraft.search.provenance import code_version
from ssmcraft.search.rundir import (RUN_INFO, SPEC_COPY, TRIAL_INFO, check_trial_folders, journal_trial_numbers,
                                    read_run_info, trial_dir, write_json)
from ssmcraft.search.samplers import build_pruner, build_sampler, describe
from ssmcraft.search.space import build_config, check_experiment, objective_of, param_names, suggest
from ssmcraft.search.spec import SearchSpec, spec_hash
from ssmcraft.search.storage import RunLock, mask_url, open_storage
from ssmcraft.search.trial import train_trial

STATES = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED, "failed": TrialState.FAIL}
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
POLL_S = 0.2


def answers_matter(spec) -> bool:
    """Whether a report's answer can stop a trial of ``spec``: a fidelity rung, or a pruner (which
    implies a single metric). A Ray trial then waits for the answer; otherwise every answer is
    "go on" and the trial does not wait (its reports are still recorded)."""
    return spec.fidelity is not None or spec.pruner.name != "none"


@dataclass
class SearchResult:
    study: optuna.Study
    out_dir: Path
    storage: str                       # which storage ran, in words
    executor: str                      # which executor ran, in words
    counts: dict[str, int] = field(default_factory=dict)   # complete / pruned / failed
    requeued: list[int] = field(default_factory=list)      # stale trials re-queued on start
    stopped: str = ""                  # why the loop ended
    reports: list[str] = field(default_factory=list)       # files written / skipped, in words


def counts_toward_budget(t: optuna.trial.FrozenTrial) -> bool:
    return t.state in FINISHED and not t.user_attrs.get("stale", False)


def run_search(spec: SearchSpec, out_dir: str | Path, *, executor: Executor,
               trial_fn: TrialFn = train_trial, storage_url: str | None = None,
               compile_fn: Callable[[dict], Any] | None = compile_objective,
               plots: bool = True, log: Callable[[str], None] = print) -> SearchResult:
    """Run (or resume) the search ``spec`` in ``out_dir`` until ``budget.trials`` trials
    are finished or ``budget.total_seconds`` has passed.

    ``compile_fn`` checks every objective variant before the first trial (None skips the
    check; each trial still compiles its own objective). Resuming needs the same spec
    (``budget.trials`` and ``budget.total_seconds`` may differ).
    """
    if trial_fn is train_trial:     # ssmcraft's own training reads the task/model/train sections
        check_experiment(spec)
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:
        raise SsmcraftError(f"{out_dir}: cannot be the run folder ({getattr(e, 'strerror', None) or e})") from None
    with RunLock(out_dir):
        _refuse_other_study(spec, out_dir)
        if compile_fn is not None:
            log(f"objectives: {check_objectives(spec, compile_fn).summary()}")
        else:
            log("objectives: variants not checked before the search (each trial compiles its own)")
        can_report = getattr(trial_fn, "can_report", None)
        if spec.pruner.name != "none" and can_report is not None and not can_report():
            raise SpecError(spec.source, "pruner", "the trial function cannot report intermediate "
                                                   "values (train_run takes no report=); remove the pruner")
        if storage_url is None:     # a damaged or lost journal is refused before anything is repaired or created
            check_trial_folders(out_dir, journal_trial_numbers(out_dir, spec.name))
        storage, storage_desc = open_storage(out_dir, storage_url, writer=True, log=log)
        driver, shared = lease.new_driver_id(), storage_url is not None
        study = _open_study(spec, storage, out_dir, log, driver=driver if shared else None)
        requeued = recover_stale(study, storage, own_all=not shared, log=log)
        write_json(out_dir / RUN_INFO, {
            "study": spec.name, "spec": SPEC_COPY, "started": time.time(),
            "storage": ({"kind": "journal"} if storage_url is None else
                        {"kind": "rdb", "url": mask_url(storage_url),
                         "password_hidden": mask_url(storage_url) != storage_url})})
        held = (lease.Lease(storage, storage.get_study_id_from_name(spec.name), driver, out_dir, log).start()
                if shared else None)
        try:
            capacity = executor.start(spec.resources)
            log(f"search: study {spec.name!r}, storage: {storage_desc}; executor: {capacity.description}")
            log(f"search: sampler {describe(spec.sampler)}; pruner {describe(spec.pruner)}")
            # on a shared RDB another coordinator may stop while this one runs: look again now and then
            recheck = (lambda: recover_stale(study, storage, own_all=False, log=log)) if shared else None
            loop = _Loop(spec, study, out_dir, executor, capacity, trial_fn, driver, log, recheck)
            stopped = loop.run()
        finally:
            executor.close()
            if held is not None:
                held.close()
        trials = study.get_trials(deepcopy=False)
        counts = {k: sum(t.state == s and counts_toward_budget(t) for t in trials) for k, s in STATES.items()}
        written = reports.write_reports(study, out_dir, plots=plots)
        return SearchResult(study, out_dir, storage_desc, capacity.description, counts,
                            requeued, stopped, written)


def _refuse_other_study(spec: SearchSpec, out_dir: Path) -> None:
    """A folder holds one study: a spec of another name would create a second one beside it and
    write over its trial folders, ``run.json`` and ``search.yaml``."""
    if not (out_dir / RUN_INFO).is_file():
        return
    try:
        held = read_run_info(out_dir).get("study")
    except SsmcraftError:           # a damaged run.json: the study it named is the storage's to say
        held = None
    if held is not None and held != spec.name:
        raise SsmcraftError(f"{out_dir} holds study {held!r}, and the spec names {spec.name!r}; use another "
                            f"--out, or --resume without SPEC to continue {held!r} with its own spec ({SPEC_COPY})")


def resumed_seed(seed: int, n_trials: int, driver: str | None = None) -> int:
    """The sampler seed of a coordinator that finds ``n_trials`` trials in its study: a
    32-bit hash of the spec's seed and ``n_trials`` (and, on a shared RDB, the coordinator's
    ``driver`` id, as two coordinators may start at the same count). A coordinator that
    samples anything adds a trial first, so no later start reuses its seed: a resumed
    search never replays the random sequence of an earlier run, and resuming the same
    journal twice from the same state samples the same points."""
    key = f"{seed}:{n_trials}" + (f":{driver}" if driver else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")


def _open_study(spec: SearchSpec, storage, out_dir: Path, log, driver: str | None = None) -> optuna.Study:
    """Load the study of this spec from ``storage`` (its sampler reseeded, ``resumed_seed``),
    or create it (its sampler seeded with the spec's seed). Refuses a run folder whose
    ``trials/`` holds a folder the study has no trial for (``check_trial_folders``)."""
    sampler, pruner = build_sampler(spec.sampler), build_pruner(spec.pruner)
    digest = spec_hash(spec.raw)
    try:
        study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError:
        check_trial_folders(out_dir, set())
        study = optuna.create_study(study_name=spec.name, storage=storage, sampler=sampler,
                                    pruner=pruner, directions=spec.directions)
        _stamp(study, spec, digest, out_dir)
        log(f"search: created study {spec.name!r}")
        return study
    trials = study.get_trials(deepcopy=False)
    check_trial_folders(out_dir, {t.number for t in trials})
    stored = study.user_attrs.get("spec_sha256")
    if stored is None and not study.trials:  # created by a coordinator killed right after
        _stamp(study, spec, digest, out_dir)
    elif stored != digest:
        raise SsmcraftError(f"{out_dir}: study {spec.name!r} was created from a different spec "
                            f"(sha256 {str(stored)[:12]} vs {digest[:12]}); use another --out, or "
                            f"--resume without SPEC to continue it with its own spec ({SPEC_COPY})")
    done = sum(counts_toward_budget(t) for t in study.get_trials(deepcopy=False))
    log(f"search: resuming study {spec.name!r}: {done} of {spec.budget.trials} trials finished")
    if trials:
        seed = resumed_seed(spec.sampler.options["seed"], len(trials), driver)
        study.sampler = build_sampler(spec.sampler, seed=seed)
        log(f"search: sampler reseeded ({seed}) from its seed and the {len(trials)} trials in the study, "
            f"so that it does not replay the points it sampled")
    return study


def _stamp(study: optuna.Study, spec: SearchSpec, digest: str, out_dir: Path) -> None:
    """Record on a new study what it was created from; keep a copy of the spec."""
    write_text(out_dir / SPEC_COPY, yaml.safe_dump(spec.raw, sort_keys=False))
    for key, value in {"metrics": spec.metrics, "param_names": param_names(spec), "spec": spec.raw,
                       "spec_base": str(spec.base), "code_version": code_version(),
                       "spec_sha256": digest}.items():  # the hash last: it marks the study complete
        study.set_user_attr(key, value)


def recover_stale(study: optuna.Study, storage, *, own_all: bool, log) -> list[int]:
    """Fail the RUNNING trials left behind by coordinators that are gone, re-queueing each
    first with its params and seed; returns their numbers. ``own_all``: the storage is the
    run folder's journal, whose lock this coordinator holds, so every running trial was
    left by a coordinator that is gone; otherwise a trial is stale when its owner's lease
    lapsed (``lease.gone``)."""
    trials = study.get_trials(deepcopy=False)
    already = {t.user_attrs["requeue_of"] for t in trials if "requeue_of" in t.user_attrs}
    study_id = storage.get_study_id_from_name(study.study_name)
    leases = {} if own_all else study.user_attrs
    stale, alive = [], {}
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        owner = t.user_attrs.get("owner")
        if not own_all and not lease.gone(leases, owner):
            alive.setdefault(owner, []).append(t.number)
            continue
        if t.number not in already:
            attrs = {"requeue_of": t.number, "candidate": t.user_attrs.get("candidate", t.number)}
            if "seed" in t.user_attrs:
                attrs["seed"] = t.user_attrs["seed"]
            study.enqueue_trial(t.params, user_attrs=attrs)
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, "stale", True)
        storage.set_trial_user_attr(trial_id, "status", "failed")
        storage.set_trial_user_attr(trial_id, "reason", "stale: its coordinator stopped while it ran; re-queued")
        study.tell(t.number, state=TrialState.FAIL)
        stale.append(t.number)
    if stale:
        log(f"search: {len(stale)} trial(s) left running by a stopped coordinator failed and re-queued: {stale}")
    for owner, numbers in alive.items():
        log(f"search: running trial(s) {numbers} belong to {lease.describe(leases, owner)}, which is alive; "
            f"left to it (re-queued once its lease lapses, {lease.LEASE_S:g} s without a heartbeat)")
    return stale


class _Loop:
    """Keeps the executor full, records outcomes, rewrites the leaderboard as it goes."""

    def __init__(self, spec: SearchSpec, study: optuna.Study, out_dir: Path, executor: Executor,
                 capacity: Capacity, trial_fn: TrialFn, owner: str, log,
                 recheck: Callable[[], list[int]] | None = None) -> None:
        self.spec, self.study, self.out_dir = spec, study, out_dir
        self.executor, self.capacity, self.trial_fn = executor, capacity, trial_fn
        self.owner, self.log, self.recheck = owner, log, recheck
        self.running: dict[int, optuna.Trial] = {}
        self.reported: dict[int, set[int]] = {}
        self.plans: dict[int, fid.Plan] = {}         # trial -> its rungs (fidelity)
        self.stopped_at: dict[int, str] = {}         # trial -> why a rung stopped it
        self.broken: dict[int, str] = {}             # trial -> how its reports broke the contract (failed)
        self.driver_code = code_version()

    def run(self) -> str:
        spec = self.spec
        finished = sum(counts_toward_budget(t) for t in self.study.get_trials(deepcopy=False))
        deadline = None if spec.budget.total_seconds is None else time.monotonic() + spec.budget.total_seconds
        stopped = f"{spec.budget.trials} trials finished"
        next_check = time.monotonic() + lease.BEAT_S
        while True:
            if self.recheck is not None and time.monotonic() >= next_check:
                self.recheck()
                next_check = time.monotonic() + lease.BEAT_S
            while len(self.running) < self.capacity.slots and finished + len(self.running) < spec.budget.trials:
                if deadline is not None and time.monotonic() > deadline:
                    stopped = f"total time budget ({spec.budget.total_seconds:g} s) reached"
                    break
                finished += self._start_one()
            if not self.running:
                return stopped
            for job, outcome in self.executor.wait(POLL_S):
                self._record(self.running.pop(job.number), job, outcome)
                finished += 1
                reports.write_leaderboard(self.study, self.out_dir)

    def _start_one(self) -> int:
        """Ask for a trial and submit it; returns 1 when it failed before it could start."""
        trial = self.study.ask()
        trial.set_user_attr("owner", self.owner)
        try:
            params = suggest(trial, self.spec)
            seed = trial.user_attrs.get("seed", self.spec.seed + trial.number)
            config = build_config(self.spec, params, seed=seed, device=self.capacity.device)
        except Exception as e:  # e.g. an objective file that disappeared: failed, never left running
            self._tell(trial, "failed", None, {"status": "failed", "reason": classify_exception(e)})
            return 1
        out = trial_dir(self.out_dir, trial.number)
        if out.exists():    # a new number with a folder: the storage lost trials while this ran
            check_trial_folders(self.out_dir, {t.number for t in self.study.get_trials(deepcopy=False)} - {trial.number})
        out.mkdir(parents=True)
        objective = objective_of(config)
        candidate = trial.user_attrs.get("candidate", trial.number)
        attrs = {"seed": seed, "candidate": candidate, "objective": objective.get("name"),
                 "objective_spec": objective, "trial_dir": str(out.relative_to(self.out_dir))}
        if self.spec.fidelity is not None:
            self.plans[trial.number] = plan = fid.plan(self.spec.fidelity, config, candidate)
            attrs["fidelity"] = plan.as_attr()
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        write_json(out / TRIAL_INFO, {
            "study": self.spec.name, "number": trial.number, "seed": seed, "params": params,
            "objective": objective.get("name"), "config": config, "driver_code_version": self.driver_code,
            "requeue_of": trial.user_attrs.get("requeue_of"), "fidelity": attrs.get("fidelity")})
        self.running[trial.number] = trial
        self.executor.submit(Job(trial.number, self.trial_fn, config, out,
                                 lambda step, metrics, t=trial: self._on_report(t, step, metrics),
                                 self.spec.budget.hard_timeout, await_answers=answers_matter(self.spec)))
        return 0

    def _on_report(self, trial: optuna.Trial, step: int, metrics: dict) -> bool:
        """An intermediate report: a rung (fidelity), or for single-metric studies a value
        for the pruner; record it, say whether to stop."""
        if self.spec.fidelity is not None:
            return self._on_rung(trial, step, metrics)
        if not self.spec.single_metric:
            return False
        value = metrics.get(self.spec.metrics[0])
        steps = self.reported.setdefault(trial.number, set())
        if is_number(value) and step not in steps:  # a re-run attempt reports steps again
            steps.add(step)
            trial.report(float(value), int(step))
        return trial.should_prune()

    def _on_rung(self, trial: optuna.Trial, step: int, metrics: dict) -> bool:
        """The first report at or past the trial's next rung decides that rung (or replays
        the decision an earlier run of the same candidate recorded); returns True to stop."""
        plan, fidelity = self.plans[trial.number], self.spec.fidelity
        records = list(trial.user_attrs.get("rungs", []))
        if len(records) >= len(plan.tokens):
            return False
        tokens = metrics.get("tokens")
        if not is_number(tokens):      # the contract (ssmcraft.search.outcome): rungs are in tokens
            self.broken[trial.number] = (
                f"error: its report at step {step} has no number 'tokens' (it sent "
                f"{', '.join(sorted(metrics)) or 'nothing'}); fidelity rungs are measured in tokens: "
                f"report(step, {{'tokens': tokens_so_far, {fidelity.metric!r}: value}})")
            return True
        if tokens < plan.tokens[len(records)]:
            return False
        rung = plan.bracket + len(records)
        candidate = trial.user_attrs["candidate"]
        trials = self.study.get_trials(deepcopy=False)
        earlier = fid.recorded(trials, candidate).get(rung)
        if earlier is not None:
            record = {**earlier, "replayed": True}
        else:
            others = fid.rung_table(trials, plan.bracket, rung)
            others.pop(candidate, None)
            record = fid.decide(fidelity, rung, int(tokens), candidate, metrics.get(fidelity.metric),
                                others).as_attr()
        trial.set_user_attr("rungs", records + [record])
        if record["go_on"]:
            return False
        self.stopped_at[trial.number] = record["reason"]
        return True

    def _record(self, trial: optuna.Trial, job: Job, outcome: Outcome) -> None:
        verdict = judge(outcome, self.spec.metrics)
        folder_gone = not job.out_dir.is_dir()
        if folder_gone:     # its checkpoint and files are lost, whatever it returned
            verdict = Verdict("failed", reason=f"error: its folder {job.out_dir.relative_to(self.out_dir)} was "
                                               f"deleted while it ran (it returned: {verdict.reason or verdict.state})")
        elif trial.number in self.broken:
            verdict = Verdict("failed", reason=self.broken.pop(trial.number))
        elif verdict.state == "pruned" and trial.number in self.stopped_at:
            verdict = dataclasses.replace(verdict, reason=f"stopped at {self.stopped_at.pop(trial.number)}")
        if (outcome.attempts or 1) > 1:
            retried = f"retried: {outcome.attempts} attempts (the worker of each earlier one died)"
            verdict = dataclasses.replace(verdict, reason="; ".join(filter(None, (verdict.reason, retried))))
        metrics = outcome.metrics or {}
        record = {"status": verdict.state, "reason": verdict.reason, "metrics": metrics,
                  "wall_s": outcome.wall_s, "attempts": outcome.attempts, "host": outcome.host,
                  "code_version": outcome.code_version, "kernel_hash": metrics.get("kernel_hash"),
                  "state_bytes": metrics.get("state_bytes")}
        self._tell(trial, verdict.state, verdict.values, record)
        if not folder_gone:
            info_path = job.out_dir / TRIAL_INFO
            write_json(info_path, {**_read_json(info_path), "outcome": record})
        values = ", ".join(f"{m}={v:.4g}" for m, v in zip(self.spec.metrics, verdict.values or ()))
        wall = f"{outcome.wall_s:.1f} s" if outcome.wall_s is not None else "?"
        said = "; ".join(x for x in (values, verdict.reason) if x)
        self.log(f"trial {trial.number:>3} {verdict.state:<8} {trial.user_attrs.get('objective', '?')}  "
                 f"{said}  ({wall})")
        self._refuse_unrankable(trial, outcome, metrics)

    def _refuse_unrankable(self, trial: optuna.Trial, outcome: Outcome, metrics: dict) -> None:
        """A trial that trained to its end (status ok, or timeout at ``seconds_per_trial``) without a
        ranking metric, or with one that is not a number at all (NaN is a number: a divergence), shows a
        ``rank:`` key that no trial will return: stop rather than spend the budget on it."""
        if outcome.error is not None or metrics.get("status", "ok") not in ("ok", "timeout"):
            return
        for k in self.spec.metrics:
            v = metrics.get(k)
            problem = ("returned no such metric" if k not in metrics else
                       f"returned {v!r}, not a number" if isinstance(v, bool) or not isinstance(v, (int, float)) else None)
            if problem:
                raise SsmcraftError(f"{self.spec.source}: rank.{k}: trial {trial.number} trained to its end and {problem} "
                                    f"(it returned {', '.join(sorted(metrics)) or 'nothing'}), so no trial can be ranked; "
                                    f"search stopped (fix rank: and use another --out)")

    def _tell(self, trial: optuna.Trial, state: str, values, record: dict) -> None:
        for key, value in record.items():
            trial.set_user_attr(key, value)
        self.study.tell(trial, values=list(values) if values else None, state=STATES[state])


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
