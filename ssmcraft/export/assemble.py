"""Build the exported module's source from ssmcraft's own source files.

The exported ``.py`` is not a second, hand-kept copy of the layers: it is the text of the
real modules (``inspect.getsource``) laid end to end, with

- every ``from ssmcraft... import`` removed (the names it imported are defined by an
  earlier section of the same file; checked here), nested ones replaced by ``pass``;
- every other import hoisted, merged and checked: only the standard library, ``torch``
  and ``safetensors`` may be imported at the top level (``triton`` is imported lazily, on CUDA);
- module docstrings turned into comments under a banner naming the source file;
- the generated reference recurrence (``CompiledObjective.source``) wrapped as a class
  namespace ``Recurrence`` (its functions become static methods), so that the runtime's
  ``module.coefficients(...)`` calls work unchanged.

Any drift that would make the bundle wrong (a name defined twice, an ssmcraft name no
section defines, a third-party import) is an ``ExportError`` at export time, not a broken
file for the user.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ssmcraft.compiler import safe_source
from ssmcraft.errors import SsmcraftError

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
ALLOWED_THIRD_PARTY = ("torch", "safetensors")   # top-level imports allowed besides the stdlib
BANNER = "# " + "=" * 86


class ExportError(SsmcraftError):
    """The export cannot be built (a source, trial or bundle problem), in one line."""


@dataclass
class Section:
    """One part of the bundle: its title, body text and the top-level names it defines."""
    title: str
    body: str
    defines: set[str] = field(default_factory=set)
    policy: safe_source.Policy | None = None   # generated text: the allowlist ``bundle`` checks it against


@dataclass
class Imports:
    """Merged top-level imports of every section (``import X [as Y]``, ``from X import a``)."""
    plain: set[str] = field(default_factory=set)                   # "import X" / "import X as Y"
    from_: dict[str, set[str]] = field(default_factory=dict)        # module -> {"a", "a as b"}
    bound: dict[str, str] = field(default_factory=dict)             # bound name -> what it refers to
    allowed: tuple[str, ...] = ALLOWED_THIRD_PARTY                  # third-party top-level imports allowed

    def add(self, node: ast.stmt, where: str) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                _check_allowed(a.name, where, self.allowed)
                bound, what = (a.asname, a.name) if a.asname else (a.name.split(".")[0], a.name.split(".")[0])
                self._bind(bound, what, where)
                self.plain.add(f"import {a.name}" + (f" as {a.asname}" if a.asname else ""))
            return
        if node.level:
            raise ExportError(f"{where}: relative import 'from {'.' * node.level}{node.module or ''}' "
                              "cannot be bundled")
        _check_allowed(node.module, where, self.allowed)
        if node.module == "__future__":
            return
        for a in node.names:
            if a.name == "*":
                raise ExportError(f"{where}: 'from {node.module} import *' cannot be bundled")
            self._bind(a.asname or a.name, f"{node.module}.{a.name}", where)
            self.from_.setdefault(node.module, set()).add(a.name + (f" as {a.asname}" if a.asname else ""))

    def _bind(self, bound: str, what: str, where: str) -> None:
        if self.bound.setdefault(bound, what) != what:
            raise ExportError(f"{where}: imports the name {bound!r} as {what}, but another section "
                              f"imports it as {self.bound[bound]}")

    def text(self) -> str:
        def std(name):
            return name.split(".")[0] in sys.stdlib_module_names

        groups: list[list[str]] = [[], []]
        for text in self.plain:
            groups[0 if std(text.split()[1]) else 1].append(text)
        for module, names in self.from_.items():
            groups[0 if std(module) else 1].append(f"from {module} import {', '.join(sorted(names))}")
        lines = ["from __future__ import annotations", ""]
        for g in groups:
            lines += sorted(g, key=lambda s: (s.startswith("from"), s)) + [""]
        return "\n".join(lines).rstrip() + "\n"


def _allowed(module: str, allowed: tuple[str, ...]) -> bool:
    """Whether an exported module may import ``module``: ``__future__``, the standard library or ``allowed``."""
    top = module.split(".")[0]
    return top == "__future__" or top in sys.stdlib_module_names or top in allowed


def _check_allowed(module: str, where: str, allowed: tuple[str, ...]) -> None:
    if _allowed(module, allowed):
        return
    raise ExportError(f"{where}: imports {module!r} at module level; the exported module may import only "
                      f"the standard library and {', '.join(allowed)}")


def _is_ssmcraft(module: str | None) -> bool:
    return module is not None and (module == "ssmcraft" or module.startswith("ssmcraft."))


def _top_level_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    out = set()
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                out.add(n.id)
    return out


def _comment(text: str) -> str:
    return "\n".join(("# " + line).rstrip() for line in text.strip("\n").splitlines())


def _relpath(module) -> str:
    path = Path(inspect.getsourcefile(module)).resolve()
    try:
        return str(path.relative_to(PACKAGE_ROOT.parent))
    except ValueError:
        return path.name


def module_section(module_name: str, imports: Imports, *, only: list[str] | None = None,
                   drop: set[str] = frozenset(), exclude: set[str] = frozenset()) -> tuple[Section, set[str]]:
    """The section for one ssmcraft module: its source with imports handled as the module
    docstring says. ``only``: keep just these top-level classes/functions. ``drop``:
    leave out top-level assignments of these names (placeholders another section sets).
    ``exclude``: leave out the top-level classes/functions of these names (with their
    decorators). With ``only`` or ``exclude``, only the imports the kept statements use are kept.

    Returns the section and the ssmcraft names it needs from other sections.
    """
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    where = _relpath(module)
    tree = ast.parse(source)
    lines = source.splitlines()
    needs: set[str] = set()
    # nested ssmcraft imports (inside functions) become `pass`; the names must be top-level here
    top = {id(n) for n in tree.body}
    replace: dict[int, tuple[int, str, set[str]]] = {}
    for child in ast.walk(tree):
        if id(child) in top or not isinstance(child, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(child, ast.Import):
            if any(_is_ssmcraft(a.name) for a in child.names):
                raise ExportError(f"{where}:{child.lineno}: 'import ssmcraft...' inside a function cannot be "
                                  "bundled; import the names with 'from ssmcraft.x import name'")
            continue
        if not _is_ssmcraft(child.module):
            continue
        if any(a.asname and a.asname != a.name for a in child.names):
            raise ExportError(f"{where}:{child.lineno}: renamed ssmcraft import cannot be bundled")
        line = lines[child.lineno - 1]
        indent = line[: len(line) - len(line.lstrip())]
        replace[child.lineno] = (child.end_lineno, f"{indent}pass  # was: from {child.module} import "
                                 f"{', '.join(a.name for a in child.names)} (defined in this file)",
                                 {a.name for a in child.names})
    out: list[str] = []
    deferred: list[ast.stmt] = []
    defines: set[str] = set()
    prev_end = 0
    body = list(tree.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        doc = body.pop(0)
        out.append(_comment(doc.value.value))
        prev_end = doc.end_lineno
    for node in body:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        gap = lines[prev_end:start - 1]
        prev_end = node.end_lineno
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.Import) and any(_is_ssmcraft(a.name) for a in node.names):
                raise ExportError(f"{where}:{node.lineno}: 'import ssmcraft' cannot be bundled; import the "
                                  "names with 'from ssmcraft.x import name'")
            deferred.append(node)
            continue
        names = _top_level_names(node)
        if only is not None and not (names & set(only)):
            continue
        if names & set(exclude) and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if drop and names and names <= drop and isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        defines |= names
        # apply nested-import replacements inside this statement
        fixed, i = [], start
        while i <= node.end_lineno:
            if i in replace:
                end, text, names_needed = replace[i]
                needs |= names_needed
                fixed.append(text)
                i = end + 1
                continue
            fixed.append(lines[i - 1])
            i += 1
        if only is None:
            out.append("\n".join(gap).strip("\n") + ("\n" if any(s.strip() for s in gap) else "") + "\n".join(fixed))
        else:
            out.append("\n".join(fixed))
    filtered = only is not None or bool(exclude)
    kept = [n for n in body if (_top_level_names(n) & defines)] if filtered else body
    used = {n.id for k in kept for n in ast.walk(k) if isinstance(n, ast.Name)}
    for node in deferred:   # with `only`/`exclude`, just the imports the kept definitions use
        if filtered and not any((a.asname or a.name.split(".")[0]) in used for a in node.names):
            continue
        if isinstance(node, ast.ImportFrom) and _is_ssmcraft(node.module):
            if any(a.asname and a.asname != a.name for a in node.names):
                raise ExportError(f"{where}:{node.lineno}: renamed ssmcraft import cannot be bundled")
            needs |= {a.name for a in node.names if not filtered or a.name in used}
        else:
            imports.add(node, f"{where}:{node.lineno}")
    if only is not None:
        missing = set(only) - defines
        if missing:
            raise ExportError(f"{where}: does not define {', '.join(sorted(missing))}")
    body_text = "\n\n\n".join(s.strip("\n") for s in out if s.strip())
    title = where + (f" ({', '.join(only)})" if only else "") + \
        (f" (without {', '.join(sorted(exclude))})" if exclude else "")
    return Section(title, body_text + "\n", defines), needs


def import_problem(source: str, where: str, allowed: tuple[str, ...] = ALLOWED_THIRD_PARTY,
                   ssmcraft: bool = False) -> str | None:
    """Why ``source`` cannot run outside ssmcraft: an import, at any depth, of something other
    than the standard library and ``allowed`` (and ssmcraft, with ``ssmcraft=True``: the bundle
    resolves those); None when there is none."""
    return _import_problem(ast.parse(source).body, where, allowed, ssmcraft)


def _import_problem(nodes: list, where: str, allowed: tuple[str, ...], ssmcraft: bool) -> str | None:
    """``import_problem`` of the statements ``nodes``."""
    for node in (n for k in nodes for n in ast.walk(k)):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        for mod in mods:
            if _allowed(mod, allowed) or (ssmcraft and _is_ssmcraft(mod)):
                continue
            return f"{where} imports {mod} at run time"
    return None


def text_section(title: str, text: str) -> Section:
    """A section of Python ``text`` (generated, not an ssmcraft module's), defining its top-level names."""
    return Section(title, text, set().union(*(_top_level_names(n) for n in ast.parse(text).body)))


def _names_used(nodes: list) -> set[str]:
    return {n.id for k in nodes for n in ast.walk(k) if isinstance(n, ast.Name)}


def _reached(tree: ast.Module, roots: set[str]) -> list[ast.stmt]:
    """The top-level statements of ``tree`` (imports aside) that define ``roots`` and, in turn, the
    names of the module that those use, in source order."""
    defs: dict[str, list[ast.stmt]] = {}
    for node in tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in _top_level_names(node):
                defs.setdefault(name, []).append(node)
    keep: dict[int, ast.stmt] = {}
    seen: set[str] = set()
    todo = [n for n in roots if n in defs]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in defs[name]:
            keep[id(node)] = node
            todo += [n for n in _names_used([node]) if n in defs and n not in seen]
    return [n for n in tree.body if id(n) in keep]


def standalone_module(module_name: str, header: str, *, exclude: set[str] = frozenset(),
                      allowed: tuple[str, ...] = ALLOWED_THIRD_PARTY, after: Section | None = None) -> str:
    """One ssmcraft module as a module of its own: the module less ``exclude``, after the
    definitions it reaches in the ssmcraft modules it imports from at the top level (and those
    reach in theirs; each module after the modules it imports, otherwise in import order), then
    ``after`` (generated text, e.g. what stands in for the excluded definitions), laid end to end
    by ``bundle`` with the same checks (so a name that only a further ssmcraft module defines, a
    name defined twice, a renamed ssmcraft import or an import outside ``allowed`` is an
    ``ExportError`` naming it). Of an imported module only what is reached comes along: a kernel
    family's module imported for another family's host code brings that code, not its own family
    contract (``prepare``, ``forward``, its constants), which would clash with the module's. Only
    the statements that come along are checked for imports (an excluded definition may import
    what the bundle cannot carry: it is not in the bundle)."""
    parsed: dict[str, tuple[ast.Module, str]] = {}

    def parse(name: str) -> tuple[ast.Module, str]:
        if name not in parsed:
            module = importlib.import_module(name)
            parsed[name] = (ast.parse(inspect.getsource(module)), _relpath(module))
        return parsed[name]

    def kept(name: str, roots: set[str]) -> list[ast.stmt]:
        tree, _ = parse(name)
        if name == module_name:
            defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            return [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))
                    and not (isinstance(n, defs) and n.name in exclude)]
        return _reached(tree, roots)

    def imports_of(name: str, nodes: list[ast.stmt], roots: set[str]) -> dict[str, set[str]]:
        """The ssmcraft modules ``nodes`` import from at the top level -> the names they use (and
        the names of ``roots`` the module imports: another module imports them from this one); the
        other top-level imports they use, and their nested imports, checked."""
        tree, where = parse(name)
        used = _names_used(nodes) | roots
        out: dict[str, set[str]] = {}
        imports = []
        for node in tree.body:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            bound = {(a.asname or a.name.split(".")[0]): a.name for a in node.names}
            if not used & set(bound):
                continue
            if isinstance(node, ast.ImportFrom) and _is_ssmcraft(node.module):
                if hasattr(importlib.import_module(node.module), "__path__"):
                    raise ExportError(f"{where}:{node.lineno}: imports from the package {node.module}; only names "
                                      "defined in a module can be bundled")
                out.setdefault(node.module, set()).update(a for b, a in bound.items() if b in used)
            imports.append(node)
        problem = _import_problem(imports + nodes, where, allowed, ssmcraft=True)
        if problem is not None:
            raise ExportError(problem)
        return out

    # the module: every definition but ``exclude``, and what ``after`` uses of the names it imports
    wanted: dict[str, set[str]] = {module_name: set() if after is None else _names_used(ast.parse(after.body).body)}
    edges: dict[str, dict[str, set[str]]] = {}
    changed = True
    while changed:          # a module may be reached from several others: until no new name is wanted
        changed = False
        for name in list(wanted):
            edges[name] = imports_of(name, kept(name, wanted[name]), wanted[name])
            for dep, names in edges[name].items():
                if not names <= wanted.setdefault(dep, set()):
                    wanted[dep] |= names
                    changed = True
    order: list[str] = []

    def visit(name: str) -> None:
        """``name``'s ssmcraft modules, theirs first (a module lands after every module it imports)."""
        for dep in edges[name]:
            if dep not in order and dep != module_name:
                visit(dep)
                order.append(dep)

    visit(module_name)
    laid_out: dict[str, str] = {}      # name -> its statement (``ast.dump``), in bundle order

    def repeated(nodes: list[ast.stmt]) -> set[str]:
        """The names of ``nodes`` that an earlier module defines by the same statement (two families'
        ``POISON = False`` and the ``_empty`` reading it): laid out once, the bundle being one namespace."""
        out = set()
        for node in nodes:
            names, text = _top_level_names(node), ast.dump(node)
            if names and all(laid_out.get(n) == text for n in names):
                out |= names
            for n in names:
                laid_out.setdefault(n, text)
        return out

    plan = []
    for dep in order:
        nodes = kept(dep, wanted[dep])
        again = repeated(nodes)
        plan.append(("module", dep, {"only": sorted(set().union(*(_top_level_names(n) for n in nodes)) - again)}))
    again = repeated(kept(module_name, set()))
    plan.append(("module", module_name, {"exclude": set(exclude) | again, "drop": again}))
    generated = {} if after is None else {"after": after}
    return bundle(header, plan + [("generated", k) for k in generated], generated, allowed)


# -- the generated recurrence --------------------------------------------------------------
def recurrence_section(source: str, name: str = "Recurrence") -> Section:
    """The generated reference module (``CompiledObjective.source``) as a class namespace.

    Top-level constants become class attributes, functions static methods. The generated
    functions may only use their arguments, ``torch``, ``F`` and builtins (checked), since a
    class body's names are not visible inside its methods.
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    header = [ln for ln in lines[: tree.body[0].lineno - 1] if ln.startswith("#")] if tree.body else []
    parts: list[str] = []
    consts: set[str] = set()
    funcs: list[ast.FunctionDef] = []
    doc = None
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str) \
                and doc is None and not parts:
            doc = node.value.value
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            text = ast.unparse(node)
            if text not in ("import math", "import torch", "import torch.nn.functional as F"):
                raise ExportError(f"generated recurrence: unexpected import {text!r}")
            continue
        seg = "\n".join(lines[node.lineno - 1:node.end_lineno])
        if isinstance(node, ast.Assign):
            consts |= _top_level_names(node)
            parts.append(_indent(seg))
        elif isinstance(node, ast.FunctionDef):
            if node.decorator_list:
                raise ExportError(f"generated recurrence: decorated function {node.name!r}")
            funcs.append(node)
            parts.append(_indent("@staticmethod\n" + seg))
        else:
            raise ExportError(f"generated recurrence: unexpected statement at line {node.lineno}")
    allowed = {"math", "torch", "F"} | set(dir(builtins))
    module_names = consts | {f.name for f in funcs}
    for f in funcs:
        local = {a.arg for a in f.args.args} | {n.id for n in ast.walk(f) if isinstance(n, ast.Name)
                                                 and isinstance(n.ctx, ast.Store)}
        for n in ast.walk(f):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local and n.id not in allowed:
                what = "module-level name" if n.id in module_names else "name"
                raise ExportError(f"generated recurrence: {f.name}() uses the {what} {n.id!r}, which a class "
                                  "namespace cannot provide")
    cls = [f"class {name}:"]
    if doc is not None:
        cls.append(_indent(safe_source.docstring(doc.rstrip() + "\n")))
    cls.append("\n\n".join(parts))
    body = "\n".join(header) + ("\n" if header else "") + "\n".join(cls) + "\n"
    return Section("generated reference recurrence (ssmcraft.compiler.codegen)", body, {name})


def _indent(text: str, n: int = 4) -> str:
    pad = " " * n
    return "\n".join(pad + ln if ln.strip() else "" for ln in text.splitlines())


def literal(value, indent: int = 0) -> str:
    """A readable Python literal of JSON-like data (dicts, lists, tuples, str, numbers, None)."""
    import pprint

    text = pprint.pformat(value, indent=1, width=100, sort_dicts=False)
    ast.literal_eval(text)   # what we print must read back as data
    if indent:
        text = _indent(text, indent).lstrip()
    return text


def dataclass_literal(obj, indent: int = 0) -> str:
    """``Cls(field=value, ...)`` for a dataclass instance whose fields are data or dataclasses."""
    import dataclasses

    pad = " " * (indent + 4)

    def is_default(f, v) -> bool:
        if f.default is not dataclasses.MISSING:
            return v == f.default
        if f.default_factory is not dataclasses.MISSING:
            return v == f.default_factory()
        return False

    fields = [f for f in dataclasses.fields(obj)
              if f.init and f.repr and not is_default(f, getattr(obj, f.name))]
    flat = []
    for f in fields:
        v = getattr(obj, f.name)
        flat.append(f"{f.name}={dataclass_literal(v) if dataclasses.is_dataclass(v) else repr(v)}")
    one_line = f"{type(obj).__name__}({', '.join(flat)})"
    if len(one_line) + indent <= 100 and "\n" not in one_line:
        try:
            ast.parse(one_line, mode="eval")
            return one_line
        except SyntaxError:
            pass
    args = []
    for f in fields:
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            text = dataclass_literal(v, indent + 4)
        elif isinstance(v, dict) and v and all(dataclasses.is_dataclass(x) for x in v.values()):
            inner = ",\n".join(f"{pad}    {k!r}: {dataclass_literal(x, indent + 8)}" for k, x in v.items())
            text = "{\n" + inner + f"\n{pad}}}"
        else:
            text = literal(v, indent + 4)
        args.append(f"{pad}{f.name}={text}")
    return f"{type(obj).__name__}(\n" + ",\n".join(args) + f"\n{' ' * indent})"


# -- the whole file ------------------------------------------------------------------------
def bundle(header: str, plan: list, generated: dict[str, Section],
           allowed: tuple[str, ...] = ALLOWED_THIRD_PARTY) -> str:
    """Lay the sections of ``plan`` end to end; returns the module text.

    ``plan`` items: ``("module", name, {"only": [...], "exclude": {...}, "drop": {...}})`` for an
    ssmcraft module (``module_section``'s arguments), or ``("generated", key)`` for ``generated[key]``.
    Generated sections may reassign
    names a runtime module declares as placeholders (those placeholder lines are dropped).
    ``allowed``: the third-party packages the module may import at the top level.
    """
    imports = Imports(allowed=allowed)
    if generated:
        imports.plain.add("import math")   # the generated recurrence uses math for dimension-size constants
    sections: list[Section] = []
    needs: dict[str, set[str]] = {}
    generated_names = set().union(*(s.defines for s in generated.values())) if generated else set()
    for item in plan:
        if item[0] == "generated":
            sections.append(generated[item[1]])
            continue
        _, name, opts = item if len(item) == 3 else (*item, {})
        drop = set(opts.get("drop", ())) | (generated_names if name.startswith("ssmcraft.export.") else set())
        section, need = module_section(name, imports, only=opts.get("only"), drop=drop,
                                       exclude=set(opts.get("exclude", ())))
        sections.append(section)
        needs[section.title] = need
    seen: dict[str, str] = {}
    for s in sections:
        for n in s.defines:
            if n in seen:
                raise ExportError(f"export bundle: {n!r} is defined by both {seen[n]} and {s.title}")
            if n in imports.bound:
                raise ExportError(f"export bundle: {n!r} is defined by {s.title} and also imported")
            seen[n] = s.title
    for title, need in needs.items():
        missing = sorted(need - set(seen))
        if missing:
            raise ExportError(f"export bundle: {title} imports {', '.join(missing)} from ssmcraft, which no "
                              "section of the exported module defines")
    for s in sections:
        if s.policy is not None:
            safe_source.check(s.body, f"export bundle: {s.title}", s.policy,
                              extern=set(seen) | set(imports.bound))
    parts = ([header.rstrip() + "\n"] if header.strip() else []) + [imports.text()]
    for s in sections:
        parts.append(f"\n{BANNER}\n{safe_source.comment(s.title)}\n{BANNER}\n{s.body.strip()}\n")
    text = "\n".join(parts)
    _check_statements(text, header, imports.text(), sections)
    compile(text, "<exported module>", "exec")   # a syntax error here is our bug, caught before writing
    return text


def _check_statements(text: str, header: str, imports: str, sections: list[Section]) -> None:
    """Every statement of the bundle is one of its sections' (the header adds at most a docstring:
    its other lines are comments), so no label, path or spec text pasted into comments or literals
    has become code. A failure here is an ssmcraft bug, caught before the module is written."""
    def statements(source: str, where: str) -> list[str]:
        try:
            return [ast.dump(n) for n in ast.parse(source).body]
        except SyntaxError as e:
            raise ExportError(f"export bundle: {where} does not parse (line {e.lineno}: {e.msg}); "
                              "an ssmcraft bug, please report it") from None

    head = statements(header, "the header")
    if len(head) > 1 or (head and not head[0].startswith("Expr(value=Constant(value=")):
        raise ExportError("export bundle: the header holds code, not only comments and a docstring")
    expected = head + statements(imports, "the imports")
    for s in sections:
        expected += statements(s.body, s.title)
    if statements(text, "the module") != expected:
        raise ExportError("export bundle: the module's statements are not its sections' (text pasted "
                          "into a comment or a literal became code); an ssmcraft bug, please report it")
