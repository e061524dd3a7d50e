"""Sympy printers for generated code: PyTorch (reference recurrence) and Triton (kernels).

Both print element expressions whose symbols are tensors laid out for broadcasting
(row-indexed ``[..., d, 1]``, column-indexed ``[..., 1, m]``, both ``[..., d, m]``,
per-head scalars ``[..., 1, 1]``), so one expression serves any leading shape.
"""
from __future__ import annotations

import sympy
from sympy.printing.pycode import PythonCodePrinter


class TorchPrinter(PythonCodePrinter):
    """Prints element expressions as PyTorch tensor code."""

    _torch_functions = {"exp": "torch.exp", "log": "torch.log", "sqrt": "torch.sqrt", "Abs": "torch.abs",
                        "sign": "torch.sign", "sigmoid": "torch.sigmoid", "softplus": "F.softplus", "silu": "F.silu"}

    def _print_number(self, expr):
        return repr(float(expr))

    @staticmethod
    def _on_host(expr) -> bool:
        """True when only dimension sizes (python ints in generated code) appear."""
        return bool(expr.free_symbols) and all(s.is_integer for s in expr.free_symbols)

    def _print_host(self, expr):
        return "(" + sympy.pycode(expr.rewrite(sympy.exp), fully_qualified_modules=True) + ")"

    _print_Exp1 = _print_Pi = _print_NumberSymbol = _print_number

    def _print_Function(self, expr):
        if expr.is_number:
            return self._print_number(expr)
        if self._on_host(expr):
            return self._print_host(expr)
        name = type(expr).__name__
        if name in self._torch_functions:
            return f"{self._torch_functions[name]}({self._print(expr.args[0])})"
        raise NotImplementedError(f"no PyTorch printing for {name}")

    _print_exp = _print_log = _print_Abs = _print_sign = _print_Function

    def _print_sqrt(self, expr):
        if expr.is_number:
            return self._print_number(expr)
        if self._on_host(expr):
            return self._print_host(expr)
        return f"torch.sqrt({self._print(expr.args[0])})"

    def _print_Pow(self, expr, rational=False):
        if expr.is_number and not expr.is_Rational:
            return self._print_number(expr)
        if self._on_host(expr):
            return self._print_host(expr)
        base, exp = expr.args
        if exp == sympy.Rational(1, 2):
            return f"torch.sqrt({self._print(base)})"
        if exp == -1:
            return f"1/{self.parenthesize(base, sympy.printing.precedence.PRECEDENCE['Pow'])}"
        return super()._print_Pow(expr, rational=rational)

    def _print_Integer(self, expr):
        # torch takes a Python int operand only within int64; a larger constant is a float
        return str(expr.p) if abs(expr.p) < 2 ** 63 else repr(float(expr.p))

    def _print_Rational(self, expr):
        return f"({expr.p}/{expr.q})"

    def _print_Symbol(self, expr):
        return expr.name


def torch_code(e) -> str:
    return TorchPrinter({"fully_qualified_modules": False}).doprint(e)
