"""Search over objectives: an Optuna study owned by one coordinator, trials run by an
executor (in-process or Ray), ranking and reports. See docs/design.md ("Search").

    from ssmcraft.search import load_search_spec, run_search, InlineExecutor
    result = run_search(load_search_spec("specs/quickstart.yaml"), "runs/q",
                        executor=InlineExecutor())
    model = load_trial("runs/q", "best")

The names below are loaded on first use, so that ``ssmcraft.search.compose`` (composing an
objective spec: pure text) imports without Optuna, as on a machine that only runs kernels;
the coordinator, the executors and the spec reader import Optuna, never Ray or torch.
"""
from importlib import import_module

_LAZY = {"compose_objective": "compose", "run_search": "coordinator", "SearchResult": "coordinator",
         "InlineExecutor": "executor", "find_trial": "load", "load_trial": "load",
         "SearchSpec": "spec", "load_search_spec": "spec"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ssmcraft.search' has no attribute {name!r}")
    return getattr(import_module(f"ssmcraft.search.{_LAZY[name]}"), name)
