"""Generated Python is built from checked identifiers and printed numbers; any other text is data.

Two halves, used by every code generator and every importer of generated code:

- ``escape(text)``: the one escaping function. Any text that is not a checked identifier or a
  printed number (a spec's ``source:`` label, summary, expressions shown as documentation, run
  folder paths) reaches generated source only through it, wrapped by ``comment`` (``#`` lines),
  ``docstring`` (a triple-quoted literal) or ``string`` (a one-line literal). Multi-line text stays
  multi-line in comments and docstrings and reads back exactly from literals.
- ``check(source, where, policy)``: an AST allowlist run on every generated module before it is
  imported (``ssmcraft.compiler.cache``) and on the generated sections of an exported module.
  ``GENERATED`` (reference recurrences and Triton kernels): only the statements and expressions
  such code needs; imports of math, torch, triton and their known aliases only; no builtin beyond a
  few pure ones and no name or attribute that reaches the interpreter (``open``, ``__import__``,
  ``_``-prefixed attributes, ...); torch and triton only as the root of the attributes generated
  code calls (``torch.exp``, ``triton.jit``: never ``torch.load`` or ``t = torch``); ``triton.jit``
  the only decorator. A module that fails is refused with one line (``GeneratedCodeError``) and
  never imported.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from ssmcraft.errors import SsmcraftError

# PEP 263: a comment matching this on a module's first two lines picks the source encoding
_CODING = re.compile(r"(coding)([:=])")
_SIMPLE_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


class GeneratedCodeError(SsmcraftError):
    """Generated source that fails the allowlist: refused, never imported."""


def escape(text: str) -> str:
    """``text`` as printable characters that are inert in a comment and inside a ``"``- or
    ``\"\"\"``-delimited (non-raw) string literal, where they read back as ``text``: backslash and
    ``"`` are backslash-escaped, every non-printable character (newlines of any kind, NUL, ...)
    is written as its escape, and an encoding declaration (``coding:``) is broken up."""
    out = []
    for ch in str(text):
        if ch in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[ch])
        elif not ch.isprintable():
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return _CODING.sub(lambda m: m.group(1) + ("\\x3a" if m.group(2) == ":" else "\\x3d"), "".join(out))


def comment(text: str, prefix: str = "# ") -> str:
    """``text`` as comment lines (one per line of ``text``, each starting with ``prefix``, which
    must itself start with ``#``)."""
    if not prefix.lstrip(" ").startswith("#") or not prefix.isprintable():
        raise ValueError(f"a comment prefix starts with '#', got {prefix!r}")
    return "\n".join(prefix + escape(line) for line in str(text).split("\n"))


def docstring(text: str) -> str:
    """A triple-quoted literal that reads back as ``text``, its lines on lines of their own."""
    return '"""' + "\n".join(escape(line) for line in str(text).split("\n")) + '"""'


def string(text: str) -> str:
    """A one-line string literal that reads back as ``text``."""
    return '"' + escape(text) + '"'


# -- the AST allowlist ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """What a generated module may contain."""
    name: str
    nodes: frozenset            # AST node type names
    imports: frozenset          # (module, alias or None) of ``import module [as alias]``
    from_imports: frozenset     # (module, name) of ``from module import name``
    builtins: frozenset         # unbound names a module may read
    decorators: frozenset       # decorator callables, dotted ("triton.jit")
    # the attributes a module may take of an imported module that reaches files or processes
    # (torch.load, torch.hub, triton.runtime, ...): module name -> allowed first attributes
    module_attributes: tuple = ()


_EXPRESSIONS = {
    "Expr", "Constant", "Name", "Load", "Store", "Attribute", "Subscript", "Slice", "Tuple", "List", "Dict",
    "Call", "keyword", "BinOp", "UnaryOp", "Compare", "BoolOp", "IfExp",
    "Add", "Sub", "Mult", "Div", "FloorDiv", "Mod", "Pow", "MatMult", "LShift", "RShift", "BitAnd", "BitOr",
    "BitXor", "USub", "UAdd", "Not", "Invert", "And", "Or",
    "Eq", "NotEq", "Lt", "LtE", "Gt", "GtE", "Is", "IsNot", "In", "NotIn",
}
GENERATED = Policy(
    "generated code",
    nodes=frozenset(_EXPRESSIONS | {"Module", "Import", "ImportFrom", "alias", "Assign", "AugAssign",
                                    "FunctionDef", "arguments", "arg", "Return", "If", "For", "Pass",
                                    "Break", "Continue"}),
    imports=frozenset({("math", None), ("torch", None), ("torch.nn.functional", "F"), ("triton", None),
                       ("triton.language", "tl")}),
    from_imports=frozenset({("triton.language.extra.cuda", "libdevice")}),
    builtins=frozenset({"range", "min", "max", "abs", "float", "int", "len"}),
    decorators=frozenset({"triton.jit"}),
    # torch: the elementwise functions compiler/printing.py prints (TorchPrinter), and the tensor
    # algebra of a square state's inverse (codegen's Woodbury update, metric reductions): pure
    # functions of tensors; triton: the decorator
    module_attributes=(("torch", frozenset({"exp", "log", "sqrt", "abs", "sign", "sigmoid", "matmul", "zeros_like",
                                            "broadcast_to", "cat", "eye", "linalg"})),
                       ("triton", frozenset({"jit"}))),
)

# the exported module's generated sections (declarations as data, the reference recurrence as a
# class of static methods, the export's config and provenance): GENERATED plus that class
EXPORTED = Policy(
    "an exported module's generated section",
    nodes=GENERATED.nodes | {"ClassDef"},
    imports=GENERATED.imports,
    from_imports=GENERATED.from_imports,
    builtins=GENERATED.builtins | {"__all__", "staticmethod"},
    decorators=GENERATED.decorators | {"staticmethod"},
    module_attributes=GENERATED.module_attributes,
)


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _bound_names(tree) -> set[str]:
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.split(".")[0])
    return bound


def problem(source: str, policy: Policy = GENERATED, extern: frozenset | set = frozenset()) -> str | None:
    """Why ``source`` fails ``policy`` (``line N: ...``), or None. ``extern``: names the module may
    read that another part of the same file defines."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return f"line {e.lineno}: does not parse ({e.msg})"
    except (ValueError, MemoryError, RecursionError) as e:
        return f"does not parse ({type(e).__name__})"
    readable = _bound_names(tree) | set(policy.builtins) | set(extern)
    modules = dict(policy.module_attributes)
    # an imported module's name is only ever the root of an attribute (``torch.exp``): never a value
    # passed on (``t = torch``), rebound, or read without an attribute
    roots = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        kind = type(node).__name__
        if kind not in policy.nodes:
            return f"line {line}: {kind} is not allowed in {policy.name}"
        if isinstance(node, ast.Import):
            bad = [a for a in node.names if (a.name, a.asname) not in policy.imports]
            if bad:
                what = bad[0].name + (f" as {bad[0].asname}" if bad[0].asname else "")
                known = ", ".join(m + (f" as {a}" if a else "") for m, a in sorted(policy.imports, key=str))
                return f"line {line}: imports {what}; {policy.name} may import only {known}"
        elif isinstance(node, ast.ImportFrom):
            bad = [a.name for a in node.names if (node.module, a.name) not in policy.from_imports or node.level]
            if bad:
                return f"line {line}: imports {bad[0]} from {node.module}, which {policy.name} may not"
        elif isinstance(node, ast.Name):
            if node.id.startswith("__") and node.id not in policy.builtins:
                return f"line {line}: the name {node.id!r} is not allowed in {policy.name}"
            if node.id in modules and (not isinstance(node.ctx, ast.Load) or id(node) not in roots):
                return f"line {line}: the module {node.id!r} used other than as torch.name / triton.name"
            if isinstance(node.ctx, ast.Load) and node.id not in readable:
                return f"line {line}: reads {node.id!r}, which {policy.name} neither defines nor may use"
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            return f"line {line}: the attribute {node.attr!r} is not allowed in {policy.name}"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and node.attr not in modules[node.value.id]:
            return f"line {line}: {node.value.id}.{node.attr} is not allowed in {policy.name}"
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            for d in node.decorator_list:
                name = _dotted(d.func if isinstance(d, ast.Call) else d)
                if name not in policy.decorators:
                    return f"line {d.lineno}: decorator {ast.unparse(d)[:60]!r} is not allowed in {policy.name}"
    return None


def check(source: str, where: str, policy: Policy = GENERATED, extern: frozenset | set = frozenset()) -> None:
    """Refuse ``source`` (``GeneratedCodeError``: one line naming ``where``) unless it passes ``policy``."""
    why = problem(source, policy, extern)
    if why is not None:
        raise GeneratedCodeError(f"{where}: refused to import generated code: {why}")
