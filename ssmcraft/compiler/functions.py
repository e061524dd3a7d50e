"""The scalar functions of the objective language as sympy functions.

``exp log sqrt abs`` are sympy's own; ``sigmoid softplus silu`` are defined here with
their derivatives so that sympy can differentiate and simplify through them.
"""
from __future__ import annotations

import sympy


class sigmoid(sympy.Function):
    """1 / (1 + exp(-x))."""

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return 1 / (1 + sympy.exp(-x))

    def _eval_evalf(self, prec):
        return self._eval_rewrite_as_exp(*self.args)._eval_evalf(prec)

    def fdiff(self, argindex=1):
        # sigma (1 - sigma), written so that sympy knows it is positive (a Newton step's convexity check)
        return sigmoid(self.args[0]) * sigmoid(-self.args[0])

    def _eval_is_positive(self):
        return self.args[0].is_real

    def _eval_is_real(self):
        return self.args[0].is_real


class softplus(sympy.Function):
    """log(1 + exp(x))."""

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return sympy.log(1 + sympy.exp(x))

    def _eval_evalf(self, prec):
        return self._eval_rewrite_as_exp(*self.args)._eval_evalf(prec)

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])

    def _eval_is_positive(self):
        return self.args[0].is_real

    def _eval_is_real(self):
        return self.args[0].is_real


class silu(sympy.Function):
    """x * sigmoid(x)."""

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return x / (1 + sympy.exp(-x))

    def _eval_evalf(self, prec):
        return self._eval_rewrite_as_exp(*self.args)._eval_evalf(prec)

    def fdiff(self, argindex=1):
        x = self.args[0]
        return sigmoid(x) * (1 + x * sigmoid(-x))

    def _eval_is_real(self):
        return self.args[0].is_real


SCALAR_FUNCTIONS = {
    "exp": sympy.exp,
    "log": sympy.log,
    "sqrt": sympy.sqrt,
    "abs": sympy.Abs,
    "sigmoid": sigmoid,
    "softplus": softplus,
    "silu": silu,
}
