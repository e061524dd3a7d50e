"""Stage 0 of the compiler: the expression language's tokenizer and parser.

A hand-written recursive-descent parser for the grammar of docs/design.md. It builds a small
AST and never evaluates anything: spec text cannot run code. Limits on length, nesting
depth, literal size and exponents keep hostile input cheap to reject.

    expr  := term (("+" | "-") term)*
    term  := unary (("*" | "/") unary)*
    unary := ("-" | "+") unary | power
    power := atom ("**" unary)?
    atom  := NUMBER | NAME | NAME "(" expr ("," expr)* ")" | "(" expr ")"
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

MAX_LENGTH = 4000
MAX_DEPTH = 48
MAX_NODES = 2000
MAX_NUMBER_DIGITS = 24
MAX_DECIMAL_EXPONENT = 30
# the magnitudes every nonzero constant of a lowered expression is held to: literals, and what their
# products and powers fold to ((1e30)**16 would otherwise keep sympy's factoring busy for minutes)
CONSTANT_RANGE = (10.0 ** -(MAX_DECIMAL_EXPONENT + 1), 10.0 ** (MAX_DECIMAL_EXPONENT + 1))

FUNCTIONS = {
    # name: number of arguments
    "T": 1, "sq": 1, "wsq": 2, "dot": 2, "outer": 2, "had": 2, "diag": 1, "ones": 1,
    "exp": 1, "log": 1, "sigmoid": 1, "softplus": 1, "silu": 1, "sqrt": 1, "abs": 1,
}

# ASCII only: digits of other scripts (Arabic-Indic five looks like "o") are not numbers, and
# whitespace is ASCII whitespace
_TOKEN = re.compile(
    r"\s*(?:(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op>\*\*|[-+*/(),]))",
    re.ASCII,
)
_SPACE = " \t\n\r\f\v"


class ParseError(ValueError):
    """A syntax error at a character position (0-based)."""

    def __init__(self, message: str, pos: int):
        self.pos = pos
        super().__init__(f"{message} (at column {pos + 1})")


@dataclass(frozen=True)
class Num:
    value: Fraction
    pos: int


@dataclass(frozen=True)
class Name:
    id: str
    pos: int


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple
    pos: int


@dataclass(frozen=True)
class BinOp:
    op: str  # + - * / **
    left: object
    right: object
    pos: int


@dataclass(frozen=True)
class Neg:
    operand: object
    pos: int


Node = Num | Name | Call | BinOp | Neg


def tokenize(text: str) -> list[tuple[str, str, int]]:
    """Split ``text`` into (kind, value, position) tokens; kind is number, name or op."""
    if len(text) > MAX_LENGTH:
        raise ParseError(f"expression longer than {MAX_LENGTH} characters", MAX_LENGTH)
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip(_SPACE) == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            rest = text[pos:].lstrip(_SPACE)
            raise ParseError(f"unexpected character {rest[:1]!r}", len(text) - len(rest))
        kind = m.lastgroup
        value = m.group(kind)
        start = m.start(kind)
        if kind == "number" and len(value) > MAX_NUMBER_DIGITS:
            raise ParseError(f"number literal longer than {MAX_NUMBER_DIGITS} characters", start)
        if kind == "number" and "e" in value.lower() and abs(int(value.lower().split("e")[1])) > MAX_DECIMAL_EXPONENT:
            raise ParseError(f"number literal out of range (decimal exponent beyond {MAX_DECIMAL_EXPONENT})", start)
        if kind == "name" and value.startswith("_"):
            raise ParseError(f"names may not start with '_': {value!r}", start)
        tokens.append((kind, value, start))
        pos = m.end()
    tokens.append(("end", "", len(text)))
    return tokens


class _Parser:
    def __init__(self, text: str):
        self.tokens = tokenize(text)
        self.i = 0
        self.depth = 0
        self.nodes = 0

    # -- helpers -----------------------------------------------------------------
    def peek(self):
        return self.tokens[self.i]

    def take(self):
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def expect(self, value: str):
        kind, v, pos = self.take()
        if v != value or kind != "op":
            found = "end of expression" if kind == "end" else repr(v)
            raise ParseError(f"expected {value!r}, found {found}", pos)

    def node(self, n):
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise ParseError(f"expression has more than {MAX_NODES} nodes", n.pos)
        return n

    def enter(self, pos: int):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ParseError(f"expression nested deeper than {MAX_DEPTH} levels", pos)

    # -- grammar -------------------------------------------------------------------
    def parse(self):
        tree = self.expr()
        kind, v, pos = self.peek()
        if kind != "end":
            raise ParseError(f"unexpected {v!r}", pos)
        return tree

    def expr(self):
        self.enter(self.peek()[2])
        left = self.term()
        while self.peek()[0] == "op" and self.peek()[1] in "+-" and self.peek()[1] != "":
            _, op, pos = self.take()
            left = self.node(BinOp(op, left, self.term(), pos))
        self.depth -= 1
        return left

    def term(self):
        left = self.unary()
        while self.peek()[0] == "op" and self.peek()[1] in ("*", "/"):
            _, op, pos = self.take()
            left = self.node(BinOp(op, left, self.unary(), pos))
        return left

    def unary(self):
        kind, v, pos = self.peek()
        if kind == "op" and v in ("-", "+"):
            self.take()
            self.enter(pos)
            operand = self.unary()
            self.depth -= 1
            return operand if v == "+" else self.node(Neg(operand, pos))
        return self.power()

    def power(self):
        base = self.atom()
        if self.peek()[0] == "op" and self.peek()[1] == "**":
            _, _, pos = self.take()
            self.enter(pos)
            exponent = self.unary()
            self.depth -= 1
            return self.node(BinOp("**", base, exponent, pos))
        return base

    def atom(self):
        kind, v, pos = self.take()
        if kind == "number":
            return self.node(Num(Fraction(v), pos))
        if kind == "name":
            if self.peek()[0] == "op" and self.peek()[1] == "(":
                if v not in FUNCTIONS:
                    raise ParseError(f"unknown function {v!r}; known: {', '.join(sorted(FUNCTIONS))}", pos)
                self.take()
                self.enter(pos)
                args = [self.expr()]
                while self.peek()[1] == "," and self.peek()[0] == "op":
                    self.take()
                    args.append(self.expr())
                self.expect(")")
                self.depth -= 1
                if len(args) != FUNCTIONS[v]:
                    raise ParseError(f"{v}() takes {FUNCTIONS[v]} argument(s), got {len(args)}", pos)
                return self.node(Call(v, tuple(args), pos))
            if v in FUNCTIONS:
                raise ParseError(f"function {v!r} used without arguments", pos)
            return self.node(Name(v, pos))
        if kind == "op" and v == "(":
            self.enter(pos)
            inner = self.expr()
            self.expect(")")
            self.depth -= 1
            return inner
        found = "end of expression" if kind == "end" else repr(v)
        raise ParseError(f"expected a number, name or '(', found {found}", pos)


def parse(text: str) -> Node:
    """Parse an expression of the objective language into an AST (no evaluation)."""
    if not isinstance(text, str):
        raise ParseError(f"expected an expression string, got {type(text).__name__}", 0)
    if not text.strip():
        raise ParseError("empty expression", 0)
    return _Parser(text).parse()


def names(tree: Node) -> set[str]:
    """Every identifier the tree refers to (function names excluded)."""
    if isinstance(tree, Name):
        return {tree.id}
    if isinstance(tree, Call):
        return set().union(*(names(a) for a in tree.args))
    if isinstance(tree, BinOp):
        return names(tree.left) | names(tree.right)
    if isinstance(tree, Neg):
        return names(tree.operand)
    return set()


def unparse(tree: Node) -> str:
    """Fully parenthesised text of a tree (for messages and round-trip tests)."""
    if isinstance(tree, Num):
        return str(tree.value)
    if isinstance(tree, Name):
        return tree.id
    if isinstance(tree, Call):
        return f"{tree.func}({', '.join(unparse(a) for a in tree.args)})"
    if isinstance(tree, Neg):
        return f"(-{unparse(tree.operand)})"
    return f"({unparse(tree.left)} {tree.op} {unparse(tree.right)})"
