"""YAML for specs: safe types only, and bounded, so that no file can make loading (or a
message about what was loaded) slow, huge or a traceback.

- PyYAML's safe constructors only (no Python objects);
- a key given twice in one mapping is an error naming the key (a silent overwrite hides
  typos), and keys are plain scalars (merge keys, ``<<: *base``, load as YAML defines them);
- the text is at most ``MAX_BYTES``; the document, with every alias expanded, at most
  ``MAX_NODES`` nodes and ``MAX_DEPTH`` levels deep (a kilobyte of nested aliases expands
  to billions of nodes); a recursive alias is refused;
- every failure is one ``SpecError`` line naming the source and, where known, the line.
"""
from __future__ import annotations

from typing import Any

import yaml

from ssmcraft.errors import SpecError, quote

MAX_BYTES = 1_000_000
MAX_NODES = 100_000
MAX_DEPTH = 64


class _Loader(yaml.SafeLoader):
    """Safe loader that refuses duplicate and non-scalar keys."""


def _construct_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":    # ``<<: *base``: merged by the safe constructor
            continue
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(None, None, "a key must be a plain name, not a "
                                                    f"{key_node.id}", key_node.start_mark)
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {quote(key)}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _where(mark) -> str:
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def _check_bounds(root: yaml.Node) -> None:
    """Refuse a document whose alias-expanded form has more than ``MAX_NODES`` nodes or more
    than ``MAX_DEPTH`` levels, or an alias inside its own anchor. Each node is visited once
    (sizes of shared nodes are remembered), so the check costs the size of the text."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else
                    node.value if isinstance(node, yaml.SequenceNode) else [])
        if done:
            open_.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
            if size[key] > MAX_NODES:
                raise yaml.YAMLError(f"the document expands to more than {MAX_NODES:,} values (aliases "
                                     f"repeat what they name){_where(node.start_mark)}")
            if depth[key] > MAX_DEPTH:
                raise yaml.YAMLError(f"nested more than {MAX_DEPTH} levels deep{_where(node.start_mark)}")
            continue
        if key in size:
            continue
        if key in open_:
            raise yaml.YAMLError(f"an alias refers to a node that contains it{_where(node.start_mark)}")
        open_.add(key)
        if len(open_) > MAX_DEPTH:
            raise yaml.YAMLError(f"nested more than {MAX_DEPTH} levels deep{_where(node.start_mark)}")
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


def load(text: str, source: str) -> Any:
    """The YAML document in ``text`` (None when empty); ``source`` names it in errors."""
    if len(text) > MAX_BYTES:
        raise SpecError(source, "", f"larger than {MAX_BYTES:,} characters; a spec is a few kilobytes")
    loader = None
    try:
        loader = _Loader(text)      # refuses characters YAML does not allow (a NUL) at once
        node = loader.get_single_node()
        if node is None:
            return None
        _check_bounds(node)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        where = _where(e.problem_mark)
        raise SpecError(source, "", f"invalid YAML{where}: {(e.problem or e.context or 'unreadable')[:200]}") from None
    except yaml.YAMLError as e:
        raise SpecError(source, "", f"invalid YAML: {str(e).splitlines()[0][:200] if str(e) else 'unreadable'}") from None
    except RecursionError:      # the composer recurses once per level, before the bound is checked
        raise SpecError(source, "", f"invalid YAML: nested more than {MAX_DEPTH} levels deep") from None
    finally:
        if loader is not None:
            loader.dispose()
