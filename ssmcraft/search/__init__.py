"""Search over objectives: an Optuna study owned by one coordinator, trials run by an
executor (in-process or Ray), ranking and reports. See docs/design.md ("Search").

    from ssmcraft.search import load_search_spec, run_search, InlineExecutor
    result = run_search(load_search_spec("specs/quickstart.yaml"), "runs/q",
                        executor=InlineExecutor())
    model = load_trial("runs/q", "best")

Importing this package imports Optuna, not Ray or torch.
"""
from ssmcraft.search.compose import compose_objective
from ssmcraft.search.coordinator import SearchResult, run_search
from ssmcraft.search.executor import InlineExecutor
from ssmcraft.search.load import find_trial, load_trial
from ssmcraft.search.spec import SearchSpec, load_search_spec

__all__ = ["compose_objective", "run_search", "SearchResult", "InlineExecutor", "find_trial",
           "load_trial", "SearchSpec", "load_search_spec"]
