"""Optuna sampler and pruner from a spec's ``sampler:`` / ``pruner:`` (every option is
filled in by ``ssmcraft.search.spec`` and passed explicitly, so a change of Optuna's
defaults cannot change a study)."""
from __future__ import annotations

import warnings

import optuna

from ssmcraft.search.spec import Component


def build_sampler(c: Component, seed: int | None = None) -> optuna.samplers.BaseSampler:
    """The sampler of ``c``; ``seed`` replaces its seed (a resumed study, ``coordinator.resumed_seed``)."""
    o = c.options if seed is None else {**c.options, "seed": seed}
    if c.name == "tpe":
        with warnings.catch_warnings():
            # ``group`` is marked experimental; it is what makes multivariate TPE work on
            # the conditional space of composed objectives
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(
                seed=o["seed"], n_startup_trials=o["n_startup_trials"],
                n_ei_candidates=o["n_ei_candidates"], multivariate=o["multivariate"],
                group=o["group"], constant_liar=o["constant_liar"])
    if c.name == "nsga2":
        return optuna.samplers.NSGAIISampler(
            seed=o["seed"], population_size=o["population_size"], mutation_prob=o["mutation_prob"],
            crossover_prob=o["crossover_prob"], swapping_prob=o["swapping_prob"])
    if c.name == "random":
        return optuna.samplers.RandomSampler(seed=o["seed"])
    raise ValueError(f"unknown sampler {c.name!r}")  # the spec loader rejects these first


def build_pruner(c: Component) -> optuna.pruners.BasePruner:
    o = c.options
    if c.name == "none":
        return optuna.pruners.NopPruner()
    if c.name == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=o["n_startup_trials"], n_warmup_steps=o["n_warmup_steps"],
            interval_steps=o["interval_steps"], n_min_trials=o["n_min_trials"])
    if c.name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=o["min_resource"], reduction_factor=o["reduction_factor"],
            min_early_stopping_rate=o["min_early_stopping_rate"], bootstrap_count=o["bootstrap_count"])
    raise ValueError(f"unknown pruner {c.name!r}")


def describe(c: Component) -> str:
    return f"{c.name}(" + ", ".join(f"{k}={v}" for k, v in c.options.items()) + ")"
