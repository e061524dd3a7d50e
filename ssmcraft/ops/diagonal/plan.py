"""The coefficient graph of one IR that the diagonal family's generator fills
(``ssmcraft.ops.codegen.diagonal.plan``) and its host code reads: the leaves (the spec's inputs,
loaded per token, and params, loaded once) and the nodes the kernels compute from them.

Standard library only: an exported module carries a plan as data beside its generated kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PREFETCH_DEPTH = 4        # diagonal_fwd_main_kernel's register prefetch depth (steps), when Config.PREFETCH


@dataclass
class Leaf:
    name: str
    dims: frozenset          # subset of {"d", "m"}
    kind: str                # "tok" (per token) | "param" (time-free)
    var: str


@dataclass
class Plan:
    """What the generator and the host need to know about an IR."""
    ir: object
    leaves: dict                              # name -> Leaf (used ones, in a fixed order)
    nodes: dict                               # name -> _Node (IR order: reductions, coefficients)
    slots: dict                               # slot -> node name | sympy number
    dims_of_name: dict = field(default_factory=dict)
    hash: str = ""                            # the IR's content hash

    @property
    def tok_leaves(self):
        return [lf for lf in self.leaves.values() if lf.kind == "tok"]

    @property
    def param_leaves(self):
        return [lf for lf in self.leaves.values() if lf.kind == "param"]
