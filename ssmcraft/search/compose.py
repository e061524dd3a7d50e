"""Objectives composed from term choices: the part of the search space that is not a list
of named models.

An online-learning objective is a proximity term (how far the new state may move from
the old one) plus a data term (what the state should predict from one or two key/value
pairs), minimised exactly (``implicit``), by one gradient step (``explicit``), by one
Newton step (``newton``), or by decaying first and then taking one gradient step of the
data term (``decay_explicit``); optionally with the transition replaced by its diagonal.
``compose_objective`` turns one choice per term into an objective spec dict in the public
format of docs/design.md ("The objective spec"); the compiler, not this module, decides whether
the result derives (today: no closed form for a non-quadratic ``implicit`` loss or for two
keys ``implicit``, and no ``update: newton`` yet; a search records such a trial as failed
with the compiler's reason and goes on).

The terms (``TERMS`` lists every allowed value, the first being the default; a term left
out takes its default, so every composition written before a term existed keeps its name
and spec). ``r = S*k - x`` is the residual, ``w`` the step ``beta``:

==============  ==================================================================
proximity       ``plain``: ``sq(S - S_prev)/2``;
                ``scalar_decay``: ``sq(S - alpha*S_prev)/2``, ``alpha`` of shape [];
                ``diagonal_decay``: ``sq(S - had(T(alpha), S_prev))/2``, ``alpha`` [m]
                (a decay per key channel, GLA-style);
                ``channel_decay``: ``sq(S - diag(alpha)*S_prev)/2``, ``alpha`` [d]
                (a decay per value channel, one per row of S);
                ``weight_decay``: ``sq(S - S_prev)/2 + lam*sq(S)/2``, ``lam`` of shape [].
                ``alpha`` and ``lam`` are bounded inputs, in (0, 1).
data            ``regression``: ``beta*sq(r)/2`` (scalar step) or ``wsq(r, beta)/2``
                (per-channel step);
                ``linear``: ``- beta*dot(S*k, x)`` or ``- dot(S*k, had(beta, x))``;
                ``huber`` (pseudo-Huber): ``beta*(sqrt(1 + sq(r)) - 1)`` or, per channel,
                ``dot(beta, sqrt(ones(d) + had(r, r)) - ones(d))``;
                ``cauchy``: ``beta*log(1 + sq(r))/2`` or, per channel,
                ``dot(beta, log(ones(d) + had(r, r)))/2``. With a scalar step the robust
                losses act on the residual's norm (``cauchy_delta`` in the library), with a
                per-channel step on each channel's residual, weighted by its step.
keys            ``1`` | ``2``: a second key/value pair ``k2`` [m], ``x2`` [d] adds the same
                data term on ``S*k2 - x2`` with the same step (a rank-2 update).
step            ``per_channel`` (``beta`` [d], one per value channel) or ``scalar``
                (``beta`` of shape [], one per head); positive and bounded.
update          ``implicit``: the minimiser; ``explicit``: one gradient step of the whole
                objective from ``S_prev``; ``newton``: one Newton step from ``S_prev`` (the
                compiler's ``update: newton``); ``decay_explicit``: ``S_t = A - grad l(A)``,
                the data term's gradient step taken from the proximity's own minimiser
                ``A`` (``S_prev``, ``alpha*S_prev``, ``had(T(alpha), S_prev)``,
                ``diag(alpha)*S_prev``, ``S_prev/(1 + lam)``): decay first, then the data
                step, Gated DeltaNet's order. It is written as the minimiser of
                ``sq(S - A)/2 + <S, grad l(A)>`` (``update: implicit``; the gradient
                spelled out with ``A`` in a ``let:``), as the library writes Gated DeltaNet.
approximation   ``exact`` | ``diagonal``
normalize       ``false`` | ``true``: L2-normalise the keys (``k``, and ``k2``).
minibatch       ``0`` (none) or a chunk size C: ``approximation: {minibatch: C}``, the data
                loss's gradient taken at the state before each chunk (explicit and Newton
                updates; with the approximation exact).
memory          ``matrix``: the state ``S [d, m]``; ``mlp``: a two-layer MLP memory
                ``x ~ W2 silu(W1 k)`` (``W1 [h, m]``, ``W2 [d, h]``, ``h = 2m``, both from the
                rectangular identity), each weight stepped on the data loss with the other
                at its previous value (proximity ``plain``, ``scalar_decay`` as
                ``sq(W - alpha*W_prev)/2`` or ``weight_decay`` as ``lam*sq(W)/2``).
==============  ==================================================================

``proximity: metric`` makes the key covariance ``R = lam R_prev + sum k k^T`` (a square state
from ``I``) the metric of the proximity, ``lam*wsq(S - S_prev, R_prev)/2``: with a regression
data term and ``update: implicit`` it is recursive least squares (``rls`` in the library, with
``beta = 1``); with ``decay_explicit`` the data step is preconditioned by the new ``R``'s
inverse, ``wsq(S - S_prev, R)/2 + <S, grad l(S_prev)>`` (``precond_delta``'s form).

Gated DeltaNet is ``scalar_decay, regression, scalar, decay_explicit, normalize``; Longhorn
is ``plain, regression, per_channel, implicit``; DeltaNet is ``plain, regression, scalar,
explicit, normalize`` (tests/test_search_compose.py checks each by derived update).
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

from ssmcraft.errors import SpecError
from ssmcraft.errors import quote as shown

# term -> allowed values; the first one is the default when a term is left out
TERMS: dict[str, tuple[Any, ...]] = {
    "proximity": ("plain", "scalar_decay", "diagonal_decay", "channel_decay", "weight_decay", "metric"),
    "data": ("regression", "linear", "huber", "cauchy"),
    "keys": (1, 2),
    "step": ("per_channel", "scalar"),
    "update": ("implicit", "explicit", "newton", "decay_explicit"),
    "approximation": ("exact", "diagonal"),
    "normalize": (False, True),
    "minibatch": (0, 4, 8, 16, 32, 64),
    "memory": ("matrix", "mlp"),
}

# proximity -> (term, its minimiser A: where decay_explicit takes the data step, {input: declaration})
_PROXIMITY = {
    "plain": ("sq(S - S_prev)/2", "S_prev", {}),
    "scalar_decay": ("sq(S - alpha*S_prev)/2", "alpha*S_prev", {"alpha": {"shape": [], "bounded": True}}),
    "diagonal_decay": ("sq(S - had(T(alpha), S_prev))/2", "had(T(alpha), S_prev)",
                       {"alpha": {"shape": ["m"], "bounded": True}}),
    "channel_decay": ("sq(S - diag(alpha)*S_prev)/2", "diag(alpha)*S_prev", {"alpha": {"shape": ["d"], "bounded": True}}),
    "weight_decay": ("sq(S - S_prev)/2 + lam*sq(S)/2", "S_prev/(1 + lam)",
                     {"lam": {"shape": [], "positive": True, "bounded": True}}),
    # the key covariance R = lam R_prev + sum k k^T (a square state, from I) as the proximity's metric:
    # recursive least squares (``_metric``)
    "metric": ("lam*wsq(S - S_prev, R_prev)/2", "S_prev", {"lam": {"shape": [], "bounded": True}}),
}
# (data, step) -> the loss of one pair as a template in {r} (the residual), {k} and {x}
_LOSS = {
    ("regression", "scalar"): "beta*sq({r})/2",
    ("regression", "per_channel"): "wsq({r}, beta)/2",
    ("linear", "scalar"): "- beta*dot(S*{k}, {x})",
    ("linear", "per_channel"): "- dot(S*{k}, had(beta, {x}))",
    ("huber", "scalar"): "beta*(sqrt(1 + sq({r})) - 1)",
    ("huber", "per_channel"): "dot(beta, sqrt(ones(d) + had({r}, {r})) - ones(d))",
    ("cauchy", "scalar"): "beta*log(1 + sq({r}))/2",
    ("cauchy", "per_channel"): "dot(beta, log(ones(d) + had({r}, {r})))/2",
}
# (data, step) -> <S, grad of that loss at A>, {r} now the residual at A (a let: name)
_LINEARISED = {
    ("regression", "scalar"): "beta*dot(S*{k}, {r})",
    ("regression", "per_channel"): "dot(S*{k}, had(beta, {r}))",
    ("linear", "scalar"): _LOSS[("linear", "scalar")],
    ("linear", "per_channel"): _LOSS[("linear", "per_channel")],
    ("huber", "scalar"): "beta*dot(S*{k}, {r})/sqrt(1 + sq({r}))",
    ("huber", "per_channel"): "dot(S*{k}, had(beta, {r})/sqrt(ones(d) + had({r}, {r})))",
    ("cauchy", "scalar"): "beta*dot(S*{k}, {r})/(1 + sq({r}))",
    ("cauchy", "per_channel"): "dot(S*{k}, had(beta, {r})/(ones(d) + had({r}, {r})))",
}
_PAIRS = {1: (("k", "x", "residual"),), 2: (("k", "x", "residual"), ("k2", "x2", "residual2"))}
_WORDS = {
    "plain": "no decay",
    "scalar_decay": "a scalar decay",
    "diagonal_decay": "a per-key-channel decay",
    "channel_decay": "a per-value-channel decay",
    "weight_decay": "weight decay",
    "metric": "the key covariance as the metric (recursive least squares)",
    "regression": "online regression",
    "linear": "a linear (Hebbian) data term",
    "huber": "pseudo-Huber regression",
    "cauchy": "Cauchy regression",
    "scalar": "a per-head step size",
    "per_channel": "a per-channel step size",
    "implicit": "implicit",
    "explicit": "explicit",
    "newton": "Newton",
    "decay_explicit": "decay-then-explicit",
}
_ABBREV = {
    "plain": "plain", "scalar_decay": "sdec", "diagonal_decay": "ddec", "channel_decay": "cdec",
    "weight_decay": "wdec", "metric": "metr", "regression": "regr", "linear": "lin", "huber": "hubr", "cauchy": "caur",
    "scalar": "sstep", "per_channel": "cstep", "implicit": "impl", "explicit": "expl", "newton": "newt",
    "decay_explicit": "dexp", "exact": "exact", "diagonal": "diag",
}


def check_choices(choices: Mapping[str, Any], source: str = "<dict>", key: str = "compose") -> dict:
    """Return ``choices`` completed with the defaults, or raise ``SpecError`` naming the
    first unknown term or value."""
    if not isinstance(choices, Mapping):
        raise SpecError(source, key, f"expected a mapping of term choices, got {type(choices).__name__}")
    unknown = sorted(map(str, set(choices) - set(TERMS)))
    if unknown:
        raise SpecError(source, f"{key}.{unknown[0][:60]}", f"unknown term; terms: {', '.join(TERMS)}")
    out = {}
    for term, allowed in TERMS.items():
        value = choices.get(term, allowed[0])
        # bool is an int subclass: compare types too, so that 1 is not taken for True
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise SpecError(source, f"{key}.{term}",
                            f"{shown(value)} is not one of {', '.join(map(repr, allowed))}")
        out[term] = value
    if out["minibatch"] and out["approximation"] != "exact":
        raise SpecError(source, f"{key}.minibatch", f"a mini-batch replaces the exact update; approximation "
                        f"{out['approximation']} cannot go with it")
    return out


def composed_name(choices: Mapping[str, Any]) -> str:
    """A stable, readable identifier for a composition (at most 32 characters, as the
    compiler wants), e.g. ``c_sdec_regr_cstep_impl_exact_n`` (``_n``: normalised keys;
    ``regr2``: two key/value pairs)."""
    c = check_choices(choices)
    parts = [_ABBREV[c[t]] for t in ("proximity", "data", "step", "update", "approximation")]
    if c["keys"] != 1:
        parts[1] += str(c["keys"])
    if c["minibatch"]:
        parts[-1] = f"mb{c['minibatch']}"
    prefix = "m" if c["memory"] == "mlp" else "c"       # m_: an MLP memory
    return "_".join([prefix, *parts] + (["n"] if c["normalize"] else []))


def _join(terms: list[str]) -> str:
    """Terms joined by `` + ``, a term that starts with ``-`` by a space."""
    out = terms[0]
    for t in terms[1:]:
        out += f" {t}" if t.startswith("-") else f" + {t}"
    return out


def compose_terms(choices: Mapping[str, Any]) -> dict[str, Any]:
    """The pieces of a composition as spec text: ``let`` and ``objective`` (what the spec's
    ``let:`` and ``objective:`` hold), and ``anchor`` (the proximity's minimiser A) and ``data``
    (the data loss at S), from which the tests check that ``decay_explicit`` is a data step
    from A."""
    c = check_choices(choices)
    proximity, anchor, _ = _PROXIMITY[c["proximity"]]
    pairs = _PAIRS[c["keys"]]
    if c["memory"] == "mlp":
        return _mlp_terms(c)
    data = _join([_LOSS[(c["data"], c["step"])].format(r=f"S*{k} - {x}", k=k, x=x) for k, x, _ in pairs])
    let: dict[str, str] = {}
    if c["update"] == "decay_explicit":
        let["anchor"] = anchor
        for k, x, r in pairs:
            let[r] = f"anchor*{k} - {x}"
        linear = [_LINEARISED[(c["data"], c["step"])].format(r=r, k=k, x=x) for k, x, r in pairs]
        # with the metric: the preconditioned step, sq(S - A) measured by the new R (precond_delta)
        objective = _join(["wsq(S - anchor, R)/2" if c["proximity"] == "metric" else "sq(S - anchor)/2", *linear])
    else:
        objective = _join([proximity, data])
    return {"anchor": anchor, "data": data, "let": let, "objective": objective}


def compose_objective(choices: Mapping[str, Any]) -> dict:
    """Objective spec dict (docs/design.md format) for one choice per term; missing terms take
    their defaults (``TERMS``). Raises ``SpecError`` on an unknown term or value.

    >>> compose_objective({"proximity": "plain", "data": "regression",
    ...                    "step": "per_channel"})["objective"]
    'sq(S - S_prev)/2 + wsq(S*k - x, beta)/2'
    """
    c = check_choices(choices)
    terms = compose_terms(c)
    key: dict[str, Any] = {"shape": ["m"]}
    if c["normalize"]:
        key["normalize"] = True
    inputs: dict[str, Any] = {"x": {"shape": ["d"]}, "k": key, "q": {"shape": ["m"]}}
    step_shape = [] if c["step"] == "scalar" else ["d"]
    inputs["beta"] = {"shape": step_shape, "positive": True, "bounded": True}
    inputs.update(copy.deepcopy(_PROXIMITY[c["proximity"]][2]))
    if c["keys"] == 2:
        inputs["k2"] = dict(key)
        inputs["x2"] = {"shape": ["d"]}
    summary = (f"composed: {_WORDS[c['update']]} {_WORDS[c['data']]} with {_WORDS[c['step']]}, "
               f"{_WORDS[c['proximity']]}, {c['approximation']} transition"
               + (", two key/value pairs" if c["keys"] == 2 else "")
               + (", normalised keys" if c["normalize"] else "")
               + (f", mini-batches of {c['minibatch']}" if c["minibatch"] else "")
               + (", a two-layer MLP memory" if c["memory"] == "mlp" else ""))
    spec = {
        "name": composed_name(c),
        "summary": summary,
        "state": {"S": ["d", "m"]},
        "inputs": inputs,
        **({"let": terms["let"]} if terms["let"] else {}),
        "objective": terms["objective"],
        # decay_explicit is written as the minimiser of its linearised objective
        "update": "implicit" if c["update"] == "decay_explicit" else c["update"],
        "approximation": {"minibatch": c["minibatch"]} if c["minibatch"] else c["approximation"],
        "output": "S*q",
    }
    if c["proximity"] == "metric" and c["memory"] == "matrix":
        spec["state"] = {"R": {"shape": ["m", "m"], "init": {"identity": 1.0}}, "S": ["d", "m"]}
        spec["objective"] = {"R": _join(["sq(R - lam*R_prev", *[f"- outer({k}, {k})" for k, _, _ in _PAIRS[c["keys"]]]])
                                  + ")/2", "S": terms["objective"]}
        spec["update"] = {"R": "implicit", "S": spec["update"]}       # R is always its loss's minimiser
    if c["memory"] == "mlp":
        spec.update(hidden={"h": "2*m"}, output="W2*silu(W1*q)",
                    state={"W1": {"shape": ["h", "m"], "init": {"identity": 1.0}},
                           "W2": {"shape": ["d", "h"], "init": {"identity": 1.0}}},
                    objective=terms["objective"])
    return spec


# memory: mlp -- proximity -> (per-weight term in {W}, its input declarations): the weights W1 [h, m]
# and W2 [d, h] of x ~ W2 silu(W1 k), each stepped on the data loss with the other at its previous value
_MLP_PROXIMITY = {"plain": "", "scalar_decay": "sq({W} - alpha*{W}_prev)/2", "weight_decay": "lam*sq({W})/2"}


def _mlp_terms(c: dict) -> dict:
    """``compose_terms`` of an MLP memory (``memory: mlp``): per weight its loss."""
    if c["proximity"] not in _MLP_PROXIMITY:
        raise SpecError("<compose>", "compose.proximity", f"an MLP memory takes proximity "
                        f"{', '.join(_MLP_PROXIMITY)}; {c['proximity']} needs a [d, m] state")
    if c["update"] == "decay_explicit":
        raise SpecError("<compose>", "compose.update", "an MLP memory takes update explicit (or newton, implicit: the "
                        "compiler decides); decay_explicit is written for a [d, m] state")
    objective = {}
    for W, pred in (("W1", "W2_prev*silu(W1*{k})"), ("W2", "W2*silu(W1_prev*{k})")):
        data = [_LOSS[(c["data"], c["step"])].replace("S*{k}", pred).format(r=f"{pred} - {{x}}".format(k=k, x=x), k=k, x=x)
                for k, x, _ in _PAIRS[c["keys"]]]
        prox = _MLP_PROXIMITY[c["proximity"]].format(W=W)
        objective[W] = _join(([prox] if prox else []) + data)
    return {"anchor": "", "data": "", "let": {}, "objective": objective}
