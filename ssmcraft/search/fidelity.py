"""Multi-fidelity search on tokens seen: asynchronous successive halving (ASHA, Li et al.
2020) and its Hyperband brackets, decided by the coordinator.

Why here and not an Optuna pruner: searches rank on several objectives and Optuna 5
forbids pruners on multi-objective trials; the coordinator is the study's only writer
anyway, so it keeps the rungs itself (in trial user attrs) and answers each trial's
reports. Spec block (every key; defaults after ``=``)::

    fidelity:
      kind: successive_halving        # or hyperband
      min_tokens: 100_000             # the first rung; rung k at min_tokens * eta**k
      eta: 3                          # = 3; the top 1/eta of a rung goes on
      metric: val_loss                # = val_loss; a value train_run reports at validation
      direction: minimize             # = the rank's direction for metric, else minimize

How a trial goes through the rungs:

- rungs are the token counts ``min_tokens * eta**k`` below ``budget.tokens_per_trial``
  (the full budget is the last, implicit rung), rounded to whole steps of ``batch_size *
  seq_len``. The search sets ``train.eval_every`` to the steps of the trial's first rung,
  so a validation falls on every rung (``train.eval_every`` is then not the spec's to
  set); a trial that goes on past the last rung keeps validating at that interval (with
  eta 3 and 3 rungs, 27 validations in a full-budget run: their cost is in the figures);
- at its first report at or past a rung's tokens, the trial's ``metric`` is placed
  among every value recorded at that rung of its bracket so far (itself included; ties
  go to the older trial): in the top ``max(1, n // eta)`` it goes on, otherwise it is
  stopped and told PRUNED with the reason ("rung 1 (3,072 tokens): val_loss 2.31 not in
  the top 1/3 of 9 (cutoff 2.05)"). This is ASHA's *stopping* form (as in Optuna's
  ``SuccessiveHalvingPruner`` and Ray Tune's ``ASHAScheduler``): a trial that goes on
  keeps training in the same run (same weights, optimiser and learning-rate schedule,
  which is planned for the full budget), so nothing is trained twice and no rung waits
  for others. The first trials at a rung always go on (n < eta);
- ``hyperband`` adds brackets: bracket b starts at rung b (bracket 0 is successive
  halving from ``min_tokens``; the last bracket trains every trial to the full budget).
  Trials are spread over brackets in Hyperband's proportions ``ceil((R+1)/(R-b+1) *
  eta**(R-b))`` (R rungs), interleaved, by trial number: deterministic;
- only trials that reached the full budget are COMPLETE, so the Pareto front and the
  leaderboard's ranking are over full-budget trials only; stopped trials keep their rung
  records (user attr ``rungs``) and are listed as pruned;
- decisions are records: each rung a trial reaches is stored on it (value, tokens,
  place, decision) when decided. A trial re-queued after its coordinator was killed
  (``requeue_of``) is the same candidate: a rung its earlier run already decided is
  neither re-counted nor re-decided (the stored decision is replayed), so a resumed
  driver loses and repeats no rung decision. Its training restarts from the first token
  (``train_run`` has no resume; the run is deterministic for a seed on CPU);
- with the in-process executor the decisions depend only on the trial sequence:
  deterministic. With Ray they depend on the order trials reach a rung (asynchronous,
  as in ASHA); each rung report waits for its decision, so a stopped trial trains no
  token past its rung.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from ssmcraft.search.outcome import is_number

FIDELITY_KINDS = ("successive_halving", "hyperband")


@dataclass(frozen=True)
class Fidelity:
    kind: str
    min_tokens: int
    eta: int
    metric: str
    direction: str

    def rung_tokens(self, full_tokens: int) -> list[int]:
        """The rungs below the full budget, in tokens (at least one, checked by the spec)."""
        out, t = [], self.min_tokens
        while t < full_tokens:
            out.append(t)
            t *= self.eta
        return out

    def brackets(self, full_tokens: int) -> list[int]:
        """Hyperband's number of trials per bracket (one bracket for successive halving)."""
        r = len(self.rung_tokens(full_tokens))
        if self.kind == "successive_halving":
            return [1]
        return [math.ceil((r + 1) / (r - b + 1) * self.eta ** (r - b)) for b in range(r + 1)]

    def bracket_of(self, candidate: int, full_tokens: int) -> int:
        """The bracket of a candidate (its first trial's number): Hyperband's proportions,
        interleaved (smooth weighted round robin), the same for the same number."""
        weights = self.brackets(full_tokens)
        order = sorted(((i + 0.5) / n, b) for b, n in enumerate(weights) for i in range(n))
        return order[candidate % len(order)][1]


@dataclass(frozen=True)
class Plan:
    """One trial's rungs: its bracket and the rungs it is judged at (tokens actually
    trained at each: whole steps)."""
    bracket: int
    tokens: tuple[int, ...]
    eval_every: int | None       # steps; None: the bracket has no rung (full budget only)

    def as_attr(self) -> dict:
        return {"bracket": self.bracket, "rung_tokens": list(self.tokens), "eval_every": self.eval_every}


def tokens_per_step(config: dict) -> int:
    """Input tokens per training step of a trial config: ``batch_size * seq_len``, with
    the training and task defaults filled in (no task is built)."""
    from ssmcraft.tasks import task_class
    from ssmcraft.train.config import TRAIN_DEFAULTS

    task = config["task"]
    seq_len = task.get("seq_len")
    if seq_len is None:
        seq_len = task_class(task["name"]).options.get("seq_len")
    if seq_len is None:             # a length the task derives from its other options
        seq_len = task_class(task["name"]).from_config(task).seq_len
    return int(config["train"].get("batch_size", TRAIN_DEFAULTS["batch_size"])) * int(seq_len)


def plan(fidelity: Fidelity, config: dict, candidate: int) -> Plan:
    """The rungs of the trial ``config`` (``train.tokens`` its full budget) for the
    candidate numbered ``candidate``; sets ``train.eval_every`` on ``config``."""
    full = int(config["train"]["tokens"])
    bracket = fidelity.bracket_of(candidate, full)
    per_step = tokens_per_step(config)
    base = max(1, round(fidelity.min_tokens / per_step))
    total_steps = max(1, full // per_step)
    steps = [base * fidelity.eta ** k for k in range(bracket, len(fidelity.rung_tokens(full)))]
    steps = [s for s in steps if s < total_steps]  # the train loop validates before its last step only
    if not steps:
        return Plan(bracket, (), None)
    config["train"]["eval_every"] = steps[0]  # every later rung is a multiple of the first
    return Plan(bracket, tuple(s * per_step for s in steps), steps[0])


@dataclass(frozen=True)
class Decision:
    rung: int
    tokens: int
    value: float | None
    go_on: bool
    place: int           # 1-based place among the rung's values
    of: int              # values at the rung, this one included
    reason: str

    def as_attr(self) -> dict:
        return {"rung": self.rung, "tokens": self.tokens, "value": self.value, "go_on": self.go_on,
                "place": self.place, "of": self.of, "reason": self.reason}


def decide(fidelity: Fidelity, rung: int, tokens: int, candidate: int, value: Any,
           others: dict[int, float]) -> Decision:
    """Place ``value`` of ``candidate`` among ``others`` (candidate -> value already at this
    rung of its bracket): in the top ``max(1, n // eta)`` it goes on."""
    label = f"rung {rung} ({tokens:,} tokens)"
    if not is_number(value):
        return Decision(rung, tokens, None, False, len(others) + 1, len(others) + 1,
                        f"{label}: {fidelity.metric} is {value!r}")
    values = {**others, candidate: float(value)}
    sign = 1.0 if fidelity.direction == "minimize" else -1.0
    order = sorted(values, key=lambda c: (sign * values[c], c))
    keep = max(1, len(values) // fidelity.eta)
    place = order.index(candidate)
    cutoff = values[order[keep - 1]]
    verdict = "in" if place < keep else "not in"
    reason = (f"{label}: {fidelity.metric} {value:.4g} {verdict} the top 1/{fidelity.eta} of {len(values)} "
              f"(place {place + 1}; cutoff {cutoff:.4g})")
    return Decision(rung, tokens, float(value), place < keep, place + 1, len(values), reason)


def rung_table(trials: Iterable, bracket: int, rung: int) -> dict[int, float]:
    """Candidate -> value recorded at ``rung`` of ``bracket`` by the study's trials (a
    candidate is a trial and its re-queues: user attr ``candidate``)."""
    table: dict[int, float] = {}
    for t in trials:
        plan_attr = t.user_attrs.get("fidelity")
        if plan_attr is None or plan_attr["bracket"] != bracket:
            continue
        for record in t.user_attrs.get("rungs", []):
            if record["rung"] == rung and record["value"] is not None:
                table[t.user_attrs.get("candidate", t.number)] = record["value"]
    return table


def recorded(trials: Iterable, candidate: int) -> dict[int, dict]:
    """Rung -> the decision recorded for ``candidate`` by its earlier (stale) runs."""
    return {r["rung"]: r for t in trials if t.user_attrs.get("candidate", t.number) == candidate
            for r in t.user_attrs.get("rungs", [])}
