"""ssmcraft: write a recurrent layer's online-learning objective, get its recurrence,
kernels, a search over objectives and an exportable module.

    import ssmcraft
    obj = ssmcraft.compile("objectives/longhorn.yaml")
    print(obj.update)
    y, S_T = obj(inputs)

Attributes are imported lazily so that ``import ssmcraft`` stays cheap.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "compile": ("ssmcraft.runtime.objective", "compile"),
    "CompiledObjective": ("ssmcraft.runtime.objective", "CompiledObjective"),
    "load_spec": ("ssmcraft.compiler.spec", "load_spec"),
    "load_trial": ("ssmcraft.search.load", "load_trial"),
    "SsmcraftError": ("ssmcraft.errors", "SsmcraftError"),
    "SpecError": ("ssmcraft.errors", "SpecError"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'ssmcraft' has no attribute {name!r}")


__all__ = list(_LAZY)
