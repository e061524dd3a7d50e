"""Reading YAML that may come from anyone: the one loader every spec reader uses.

``load(text, source)`` parses with PyYAML's safe constructors (plain data only) and refuses,
with one ``SpecError`` line naming ``source``:

- a duplicate key in a mapping (a silent overwrite hides typos) or a key that is not a plain name;
- aliases that expand to more than ``MAX_NODES`` nodes in all (a kilobyte of nested aliases, the
  "billion laughs", would otherwise expand to gigabytes) and an alias inside the node it names
  (a recursive structure);
- nesting deeper than ``MAX_DEPTH``;
- text longer than ``MAX_BYTES``.

The bound is on the expanded document, counted as it is composed, before any value is built.
"""
from __future__ import annotations

from typing import Any

import yaml
from yaml.events import AliasEvent

from ssmcraft.errors import SpecError

MAX_BYTES = 200_000
MAX_NODES = 100_000
MAX_DEPTH = 64


class _Refused(yaml.YAMLError):
    def __init__(self, problem: str, mark=None):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with duplicate keys refused and the expanded size and depth bounded."""

    def __init__(self, stream):
        super().__init__(stream)
        self._sizes: dict[int, int] = {}     # id(node) -> node count of its expansion (done nodes only)
        self._depth = 0

    def compose_node(self, parent, index):
        alias = self.check_event(AliasEvent)
        mark = self.peek_event().start_mark
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels", mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        size = self._sizes.get(id(node))
        if size is None:
            if alias:
                raise _Refused("an alias inside the node it names (a recursive structure)", mark)
            children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
                node.value if isinstance(node, yaml.SequenceNode) else []
            size = 1 + sum(self._sizes[id(c)] for c in children)
            self._sizes[id(node)] = size
        if size > MAX_NODES:
            raise _Refused(f"aliases expand to more than {MAX_NODES:,} values", mark)
        return node

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":    # ``<<: *base``: merged by the safe constructor
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise yaml.constructor.ConstructorError(None, None, f"a key must be a plain name, got "
                                                        f"{type(key).__name__}", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {str(key)[:80]!r}",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load(text: str, source: str) -> Any:
    """The data of YAML ``text``; any problem is one ``SpecError`` naming ``source``."""
    if len(text) > MAX_BYTES:
        raise SpecError(source, "", f"larger than {MAX_BYTES // 1000} kB")
    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - Loader is a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(source, "", f"invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise SpecError(source, "", "invalid YAML: nested too deeply") from None
