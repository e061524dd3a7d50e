"""Objectives composed from term choices: the part of the search space that is not a list
of named models.

An online-learning objective is a proximity term (how far the new state may move from
the old one) plus a data term (what the state should predict), minimised exactly
(``implicit``) or by one gradient step (``explicit``), optionally with the transition
replaced by its diagonal. ``compose_objective`` turns one choice per term into an
objective spec dict in the public format of DESIGN.md ("The objective spec"); the
compiler, not this module, decides whether the result derives.

The terms (``TERMS`` lists every allowed value, the first being the default):

==============  ==================================================================
proximity       ``plain``: ``sq(S - S_prev)/2``;
                ``scalar_decay``: ``sq(S - alpha*S_prev)/2`` with ``alpha`` of shape [];
                ``diagonal_decay``: ``sq(S - had(T(alpha), S_prev))/2``, ``alpha`` [m]
                (a decay per key channel, GLA-style). ``alpha`` is bounded.
data            ``regression``: ``beta*sq(S*k - x)/2`` (scalar step) or
                ``wsq(S*k - x, beta)/2`` (per-channel step);
                ``linear``: ``- beta*dot(S*k, x)`` or ``- dot(S*k, had(beta, x))``.
step            ``scalar`` (``beta`` of shape [], one per head) or ``per_channel``
                (``beta`` [d], one per value channel); positive and bounded.
update          ``implicit`` | ``explicit``
approximation   ``exact`` | ``diagonal``
normalize       ``false`` | ``true``: L2-normalise the key ``k``.
==============  ==================================================================
"""
from __future__ import annotations

from typing import Any, Mapping

from ssmcraft.errors import SpecError

# term -> allowed values; the first one is the default when a term is left out
TERMS: dict[str, tuple[Any, ...]] = {
    "proximity": ("plain", "scalar_decay", "diagonal_decay"),
    "data": ("regression", "linear"),
    "step": ("per_channel", "scalar"),
    "update": ("implicit", "explicit"),
    "approximation": ("exact", "diagonal"),
    "normalize": (False, True),
}

_PROXIMITY = {
    "plain": "sq(S - S_prev)/2",
    "scalar_decay": "sq(S - alpha*S_prev)/2",
    "diagonal_decay": "sq(S - had(T(alpha), S_prev))/2",
}
_DATA = {  # (data, step) -> term
    ("regression", "scalar"): "beta*sq(S*k - x)/2",
    ("regression", "per_channel"): "wsq(S*k - x, beta)/2",
    ("linear", "scalar"): "- beta*dot(S*k, x)",
    ("linear", "per_channel"): "- dot(S*k, had(beta, x))",
}
_WORDS = {
    "plain": "no decay",
    "scalar_decay": "a scalar decay",
    "diagonal_decay": "a per-key-channel decay",
    "regression": "online regression",
    "linear": "a linear (Hebbian) data term",
    "scalar": "a per-head step size",
    "per_channel": "a per-channel step size",
}
_ABBREV = {
    "plain": "plain", "scalar_decay": "sdec", "diagonal_decay": "ddec",
    "regression": "regr", "linear": "lin", "scalar": "sstep", "per_channel": "cstep",
    "implicit": "impl", "explicit": "expl", "exact": "exact", "diagonal": "diag",
}


def check_choices(choices: Mapping[str, Any], source: str = "<dict>", key: str = "compose") -> dict:
    """Return ``choices`` completed with the defaults, or raise ``SpecError`` naming the
    first unknown term or value."""
    if not isinstance(choices, Mapping):
        raise SpecError(source, key, f"expected a mapping of term choices, got {type(choices).__name__}")
    unknown = sorted(set(choices) - set(TERMS))
    if unknown:
        raise SpecError(source, f"{key}.{unknown[0]}", f"unknown term; terms: {', '.join(TERMS)}")
    out = {}
    for term, allowed in TERMS.items():
        value = choices.get(term, allowed[0])
        # bool is an int subclass: compare types too, so that 1 is not taken for True
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise SpecError(source, f"{key}.{term}",
                            f"{value!r} is not one of {', '.join(map(repr, allowed))}")
        out[term] = value
    return out


def composed_name(choices: Mapping[str, Any]) -> str:
    """A stable, readable identifier for a composition (at most 32 characters, as the
    compiler wants), e.g. ``c_sdec_regr_cstep_impl_exact_n`` (``_n``: normalised keys)."""
    c = check_choices(choices)
    parts = [_ABBREV[c[t]] for t in ("proximity", "data", "step", "update", "approximation")]
    return "_".join(["c", *parts] + (["n"] if c["normalize"] else []))


def compose_objective(choices: Mapping[str, Any]) -> dict:
    """Objective spec dict (DESIGN.md format) for one choice per term; missing terms take
    their defaults (``TERMS``). Raises ``SpecError`` on an unknown term or value.

    >>> compose_objective({"proximity": "plain", "data": "regression",
    ...                    "step": "per_channel"})["objective"]
    'sq(S - S_prev)/2 + wsq(S*k - x, beta)/2'
    """
    c = check_choices(choices)
    key: dict[str, Any] = {"shape": ["m"]}
    if c["normalize"]:
        key["normalize"] = True
    inputs: dict[str, Any] = {"x": {"shape": ["d"]}, "k": key, "q": {"shape": ["m"]}}
    step_shape = [] if c["step"] == "scalar" else ["d"]
    inputs["beta"] = {"shape": step_shape, "positive": True, "bounded": True}
    if c["proximity"] != "plain":
        inputs["alpha"] = {"shape": [] if c["proximity"] == "scalar_decay" else ["m"], "bounded": True}
    data = _DATA[(c["data"], c["step"])]
    objective = f"{_PROXIMITY[c['proximity']]} {data}" if data.startswith("-") else \
        f"{_PROXIMITY[c['proximity']]} + {data}"
    summary = (f"composed: {c['update']} {_WORDS[c['data']]} with {_WORDS[c['step']]}, "
               f"{_WORDS[c['proximity']]}, {c['approximation']} transition"
               + (", normalised keys" if c["normalize"] else ""))
    return {
        "name": composed_name(c),
        "summary": summary,
        "state": {"S": ["d", "m"]},
        "inputs": inputs,
        "objective": objective,
        "update": c["update"],
        "approximation": c["approximation"],
        "output": "S*q",
    }
