"""The project's own error types: every user-facing failure is one of these.

The CLI prints ``str(error)`` on one line and exits with status 2; it never shows a
traceback for these.
"""
from __future__ import annotations


def one_line(e: BaseException) -> str:
    """``Type: first line`` of an error, the line cut to 300 characters (a record's or a log
    line's reason)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _cut(text: str, limit: int) -> str:
    """``text`` on one line (a newline written as ``\\n``), at most ``limit`` characters."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 3] + "..."


class SsmcraftError(Exception):
    """Base class of every error ssmcraft raises on purpose."""


class SpecError(SsmcraftError):
    """A malformed spec: names the file (or ``<text>``/``<dict>``), the key and the problem."""

    def __init__(self, source: str, key: str, problem: str):
        # a key or a problem may quote what the spec holds, which may be of any length
        self.source = source
        self.key = _cut(key, 200)
        self.problem = _cut(problem, 600)
        key, problem = self.key, self.problem
        super().__init__(f"{source}: {key}: {problem}" if key else f"{source}: {problem}")

    def __reduce__(self):   # picklable, so errors cross process and Ray worker boundaries
        return (type(self), (self.source, self.key, self.problem))


class DerivationError(SpecError):
    """The spec is well formed but its update cannot be derived as asked."""
