"""Iso-state sizing: the state size ``m`` at which a model carries a given number of state values
(used by the study runners and checked when a study spec is loaded)."""
from __future__ import annotations

from ssmcraft.errors import SsmcraftError


def iso_state_size(model: dict, objective: str | dict, elements: int) -> int | None:
    """The largest state size ``m`` at which ``model`` with ``objective`` carries at most ``elements``
    numbers of state per sequence (``LM.state_elements``, every state counted: ``[d, m]`` ones grow
    linearly in ``m``, a square ``[m, m]`` one or an MLP memory's ``[2m, m]`` quadratically, so ``m``
    is searched, not solved for); None for attention (its cache grows with the context).
    ``SsmcraftError`` when even ``m = 1`` carries more."""
    from ssmcraft.layers import LM, LMConfig

    if objective == "attention":
        return None

    def count(m: int) -> int:
        mixer = {**model.get("mixer", {}), "kind": "objective", "objective": objective, "state_size": m}
        n = LM(LMConfig.from_dict({**model, "vocab_size": 2, "mixer": mixer})).state_elements()
        if n is None:
            raise SsmcraftError(f"iso-state: the model with {_named(objective)} has a layer whose cache grows with "
                                "the context (full attention); state_elements cannot be matched")
        return n

    one = count(1)
    if one > elements:
        raise SsmcraftError(f"iso-state: {_named(objective)} carries {one} numbers of state at m = 1, more than "
                            f"state_elements = {elements}")
    lo, hi = 1, 2                       # count(lo) fits; grow hi until it does not, then bisect
    while count(hi) <= elements:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= elements else (lo, mid)
    return lo


def _named(objective: str | dict) -> str:
    return objective if isinstance(objective, str) else str(objective.get("name", "the objective"))
