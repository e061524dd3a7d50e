"""The project's own error types: every user-facing failure is one of these.

The CLI prints ``str(error)`` on one line and exits with status 2; it never shows a
traceback for these.
"""
from __future__ import annotations

import reprlib


def one_line(e: BaseException) -> str:
    """``Type: first line`` of an error, the line cut to 300 characters (a record's or a log
    line's reason)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def clip(text, limit: int = 300) -> str:
    """``text`` on one line (line breaks and other unprintable characters written as escapes), cut
    to about ``limit`` characters with a note of how many more there were: what a one-line message
    shows of text that came from a user."""
    text = str(text)
    head = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text[:limit])
    if len(head) > limit or len(text) > limit:
        return f"{head[:limit]}... ({len(text):,} characters)"
    return head


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxset = 3, 6, 6, 6, 6
_SHORT.maxlong = _SHORT.maxother = 60


def quote(value, limit: int = 80) -> str:
    """``repr(value)`` for a message, cut to about ``limit`` characters (``clip``); a container is
    shown a few levels and items deep (``reprlib``), so a deeply nested or self-containing value
    is quoted as quickly as a small one."""
    text = repr(value) if isinstance(value, str) else _SHORT.repr(value)
    return clip(text, limit)


class SsmcraftError(Exception):
    """Base class of every error ssmcraft raises on purpose."""


class SpecError(SsmcraftError):
    """A malformed spec: names the file (or ``<text>``/``<dict>``), the key and the problem."""

    def __init__(self, source: str, key: str, problem: str):
        self.source = source
        self.key = key
        self.problem = problem
        # bounded: a message quotes user text (a label, a key, a value) but stays one short line
        where, key_text, problem_text = clip(source, 500), clip(key, 200), clip(problem, 600)
        super().__init__(f"{where}: {key_text}: {problem_text}" if key else f"{where}: {problem_text}")

    def __reduce__(self):   # picklable, so errors cross process and Ray worker boundaries
        return (type(self), (self.source, self.key, self.problem))


class DerivationError(SpecError):
    """The spec is well formed but its update cannot be derived as asked."""
