"""Declaring and checking a config section: the one way every spec and config of ssmcraft is read.

A section is a table of ``Field`` s (name -> check, default, allowed values); ``Checker.section``
fills it from the mapping the user gave, refusing unknown keys, reporting missing required ones
and checking each value. Every failure is one ``SpecError(source, dotted.key, problem)`` line:

::

    c = Checker("run.yaml", "budget")
    budget = c.section("", raw["budget"], {
        "trials": Field(lambda c, k, v: c.number(k, v, integer=True, min=1)),   # required
        "timeout_grace": Field(lambda c, k, v: c.number(k, v, min=0), default=30.0),
        "executor": Field(default="inline", choices=("inline", "ray")),
    })
    # a problem reads: run.yaml: budget.trials: must be >= 1, got 0

The value checks (``mapping``, ``string``, ``number``, ``positive``, ``one_of``, ``boolean``,
``seq``) return the value they accept, so a field's check is one expression.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ssmcraft.errors import SpecError, quote

INT_MAX = 2 ** 63 - 1        # integers reach Optuna, torch and JSON: 64 bits
REQUIRED = object()          # a ``Field`` default: the key must be given
ABSENT = object()            # a ``Field`` default: a key not given is left out of the section


def kind_of(value: Any) -> str:
    """What a value is, for a message (``null`` for YAML's empty value)."""
    return "null" if value is None else type(value).__name__


def finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:       # an int beyond the float range
        return False


@dataclass(frozen=True)
class Field:
    """One key of a section: ``check(checker, dotted_key, value) -> value`` (None: any value),
    its ``default`` (``REQUIRED``: none; ``ABSENT``: left out when not given) and, where it is a closed set, the ``choices``."""
    check: Callable[["Checker", str, Any], Any] | None = None
    default: Any = REQUIRED
    choices: tuple | None = None

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


class Checker:
    """Checks bound to one source (a file, ``<dict>``) and a key prefix, so every error names the
    file and the full dotted key."""

    def __init__(self, source: str, prefix: str = ""):
        self.source, self.prefix = source, prefix

    def key(self, key: str) -> str:
        """``key`` under this checker's prefix."""
        return f"{self.prefix}.{key}" if self.prefix and key else (key or self.prefix)

    def fail(self, key: str, problem: str):
        raise SpecError(self.source, self.key(key), problem)

    def under(self, key: str) -> "Checker":
        """A checker for the section at ``key``."""
        return Checker(self.source, self.key(key))

    # -- sections ----------------------------------------------------------------------------
    def section(self, key: str, given: Any, fields: Mapping[str, Field], *, extra: tuple[str, ...] = (),
                unknown: str = "unknown key", missing: str = "missing (required)") -> dict:
        """``given`` (a mapping) checked against ``fields``: unknown keys refused (``extra``: keys
        allowed but not returned, e.g. a ``name`` read elsewhere), required keys present, each
        value checked; the others take (a copy of) their defaults. ``unknown`` / ``missing``: how a message
        about a wrong or absent key begins."""
        given = self.mapping(key, given)
        allowed = tuple(fields) + tuple(k for k in extra if k not in fields)
        for k in given:
            if k not in allowed:
                self.fail(self._sub(key, k), f"{unknown}; allowed: {', '.join(map(str, allowed))}")
        out = {}
        for name, f in fields.items():
            sub = self._sub(key, name)
            if name not in given:
                if f.required:
                    self.fail(sub, missing)
                if f.default is not ABSENT:
                    out[name] = copy.deepcopy(f.default)
                continue
            value = given[name]
            if f.choices is not None:
                *head, last = map(str, f.choices)
                self.one_of(sub, value, f.choices, f"{', '.join(head)} or {last}" if head else last)
            out[name] = f.check(self, sub, value) if f.check is not None else value
        return out

    @staticmethod
    def _sub(key: str, name: Any) -> str:
        return f"{key}.{name}" if key else str(name)

    # -- values ------------------------------------------------------------------------------
    def mapping(self, key: str, value: Any, allowed: tuple[str, ...] | None = None) -> dict:
        """``value`` as a dict; with ``allowed``, a key outside it is refused."""
        if not isinstance(value, Mapping):
            self.fail(key, f"expected a mapping, got {kind_of(value)}")
        if allowed is not None:
            for k in value:
                if k not in allowed:
                    self.fail(self._sub(key, k), f"unknown key; allowed: {', '.join(allowed)}")
        return dict(value)

    def string(self, key: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            self.fail(key, f"expected a non-empty string, got {quote(value)}")
        return value

    def number(self, key: str, value: Any, *, integer: bool = False, min: float | None = None,
               above: float | None = None, max: float | None = None) -> float:
        """``value`` if it is a number (an integer) within the bounds. Integers fit 64 bits; a
        float key takes any finite float, so an integer past the float range (YAML reads ``1``
        and 400 zeros as one) is refused."""
        ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok or (not integer and not finite(value)):
            self.fail(key, f"expected {'an integer' if integer else 'a finite number'}, got {quote(value)}")
        if integer and abs(value) > INT_MAX:
            self.fail(key, f"must be at most {INT_MAX} in size (64 bits), got {quote(value)}")
        if max is not None and value > max:
            self.fail(key, f"must be <= {max}, got {quote(value)}")
        if min is not None and value < min:
            self.fail(key, f"must be >= {min}, got {quote(value)}")
        if above is not None and value <= above:
            self.fail(key, f"must be > {above}, got {quote(value)}")
        return value

    def positive(self, key: str, value: Any, *, integer: bool = False):
        """A positive integer, or a positive number (returned as a float)."""
        if integer:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self.fail(key, f"expected a positive integer, got {quote(value)}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            self.fail(key, f"expected a positive number, got {quote(value)}")
        return float(value)

    def one_of(self, key: str, value: Any, allowed: tuple, words: str | None = None):
        """``value`` if it is one of ``allowed`` (a value of another type is refused, not looked
        up: a list or a mapping is not hashable); ``words`` says what is expected."""
        if not isinstance(value, (str, int, float)) or value not in allowed:
            self.fail(key, f"expected {words or 'one of ' + ', '.join(map(str, allowed))}, got {quote(value)}")
        return value

    def boolean(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {quote(value)}")
        return value

    def seq(self, key: str, value: Any, item: Callable[[str, Any], Any], min_len: int = 1) -> list:
        """A list of at least ``min_len`` items, each through ``item(key[i], value)``."""
        if not isinstance(value, list) or len(value) < min_len:
            self.fail(key, f"expected a list of at least {min_len} item(s), got {quote(value)}")
        return [item(f"{key}[{i}]", x) for i, x in enumerate(value)]
