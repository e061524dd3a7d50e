"""State statistics over time and state-explosion detection (Stuffed Mamba, section 4).

For each layer and head the recurrent state ``S_t [d, m]`` is summarised over time by
``norm`` (Frobenius), ``mean`` and ``var`` (over its d*m entries), averaged over the batch.

Explosion rule: for a statistic ``s(t)`` let ``scale = max |s(t)|`` over positions within the
training length. The (layer, head, statistic) explodes when ``|s(t)| > f * scale`` for a
position beyond the training length, or when ``s(t)`` stops being finite; ``f = factor`` for
``norm`` (linear in the state) and ``factor**2`` for ``var`` (quadratic), so one factor means
the same growth of the state for both. The flag records the ratio ``max_beyond / scale`` and
the first position that crossed.

``mean`` is recorded (ratio included) but does not flag (``FLAGGING``): it is a signed average
of d*m entries whose maximum within the training length can sit near zero, so its ratio
measures cancellation, not growth. In the first GPU studies (docs/studies/) it alone crossed
3x in two runs whose norm grew less than 2x and variance less than 4x (threshold 9x).
"""
from __future__ import annotations

import math
from typing import Any

import torch

STATS = ("norm", "mean", "var")
POWER = {"norm": 1, "mean": 1, "var": 2}     # how each statistic scales with the state
FLAGGING = ("norm", "var")                     # the statistics whose growth counts as explosion


def state_statistics(states: torch.Tensor) -> dict[str, torch.Tensor]:
    """states ``[B, T', H, d, m]`` -> stat name -> ``[T', H]`` (float64, batch-averaged)."""
    s = states.detach().to(torch.float64).flatten(3)                    # [B, T', H, d*m]
    return {"norm": s.norm(dim=-1).mean(0), "mean": s.mean(-1).mean(0),
            "var": s.var(-1, unbiased=False).mean(0)}


def detect_explosion(times: list[int], stats: dict[str, list[list[list[float]]]], train_len: int,
                     factor: float = 3.0, layers: list[int] | None = None) -> dict[str, Any]:
    """Apply the module's rule to ``stats[name][layer][head]`` series sampled at ``times``.

    ``layers``: the model's layer index of each series (a hybrid traces its recurrent layers
    only); default ``0, 1, ...``.
    Returns ``{"exploded": bool, "factor", "train_len", "flags": [...], "ratios": ...}`` where
    each flag is ``{layer, head, stat, ratio, first_position}`` and ``ratios[stat][i][head]``
    (``i`` the series' position) is ``max beyond / max within`` (None when nothing lies beyond
    the training length).
    """
    within = [i for i, t in enumerate(times) if t <= train_len]
    beyond = [i for i, t in enumerate(times) if t > train_len]
    flags, ratios = [], {}
    for name, per_layer in stats.items():
        ratios[name] = []
        for i, heads in enumerate(per_layer):
            layer = layers[i] if layers is not None else i
            row = []
            for head, series in enumerate(heads):
                ratio, first = _ratio(series, within, beyond, times, factor ** POWER.get(name, 1))
                row.append(ratio)
                if first is not None and name in FLAGGING:
                    flags.append({"layer": layer, "head": head, "stat": name, "ratio": ratio,
                                  "first_position": first, "nonfinite": not math.isfinite(ratio)})
            ratios[name].append(row)
    return {"exploded": bool(flags), "factor": factor, "train_len": train_len, "flags": flags, "ratios": ratios}


def _ratio(series, within, beyond, times, factor) -> tuple[float | None, int | None]:
    """(max |beyond| / max |within|, first position over the threshold or None)."""
    if not beyond:
        return None, None
    scale = max((abs(series[i]) for i in within if math.isfinite(series[i])), default=0.0)
    tiny = 1e-30
    first, top = None, 0.0
    for i in beyond:
        v = series[i]
        over = not math.isfinite(v) or abs(v) > factor * max(scale, tiny)
        if over and first is None:
            first = times[i]
        top = math.inf if not math.isfinite(v) else max(top, abs(v))
    return (top / max(scale, tiny) if math.isfinite(top) else math.inf), first
