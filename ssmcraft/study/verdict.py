"""Verdicts: does the small-scale result agree with the paper? Computed from numbers with
stated thresholds (no hand-written conclusions). Each returns a dict::

    {"claim": str, "verdict": "agrees" | "disagrees" | "inconclusive",
     "evidence": str, "confidence": "high" | "medium" | "low", "confidence_reason": str}

Confidence of a difference ``diff`` between two groups measured over ``n`` seeds each with
spread ``s`` (the larger sample standard deviation of the two; 0 when n == 1):
high when n >= 3 and |diff| > 2 s; medium when n >= 2 and |diff| > s; else low.
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence

AGREES, DISAGREES, INCONCLUSIVE = "agrees", "disagrees", "inconclusive"


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float, int]:
    """(mean, sample std (0 for one value), n) over the finite values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return None, 0.0, 0
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0), len(xs)


def confidence(diff: float | None, spread: float, n: int) -> tuple[str, str]:
    if diff is None:
        return "low", "no finite numbers"
    why = f"{n} seed(s), |difference| {abs(diff):.4g} vs spread {spread:.4g}"
    if n >= 3 and abs(diff) > 2 * spread:
        return "high", why + " (n >= 3 and |diff| > 2 x spread)"
    if n >= 2 and abs(diff) > spread:
        return "medium", why + " (n >= 2 and |diff| > spread)"
    return "low", why + (" (one seed: no spread estimate)" if n < 2 else " (difference within the spread)")


def _v(claim, verdict, evidence, conf) -> dict:
    return {"claim": claim, "verdict": verdict, "evidence": evidence, "confidence": conf[0],
            "confidence_reason": conf[1]}


def compare(claim: str, a_name: str, a: Sequence[float], b_name: str, b: Sequence[float], tol: float,
            higher_is_better: bool = True) -> dict:
    """Claim "a is better than b": agrees when mean(a) beats mean(b) by more than ``tol``,
    disagrees when b beats a by more than ``tol``, else inconclusive; also inconclusive when
    both have several seeds and the difference lies within the seed spread."""
    ma, sa, na = mean_std(a)
    mb, sb, nb = mean_std(b)
    if ma is None or mb is None:
        return _v(claim, INCONCLUSIVE, f"missing numbers ({a_name}: {ma}, {b_name}: {mb})", confidence(None, 0, 0))
    diff = (ma - mb) if higher_is_better else (mb - ma)
    verdict = AGREES if diff > tol else DISAGREES if diff < -tol else INCONCLUSIVE
    ev = (f"{a_name} {ma:.4g} ± {sa:.2g} vs {b_name} {mb:.4g} ± {sb:.2g} (n={na}/{nb}); "
          f"advantage of {a_name} {diff:+.4g}, tolerance {tol:g}")
    if verdict != INCONCLUSIVE and min(na, nb) >= 2 and abs(diff) <= max(sa, sb):
        verdict = INCONCLUSIVE
        ev += f"; within the seed spread {max(sa, sb):.2g}"
    return _v(claim, verdict, ev, confidence(diff, max(sa, sb), min(na, nb)))


def mqar_state_size(cells: dict[str, dict[int, list[float]]], tol: float) -> list[dict]:
    """``cells[objective][m]``: best-lr MQAR accuracy per seed.

    1. Longhorn (best of longhorn / longhorn_diag) >= Mamba at equal state size: per m,
       Longhorn's mean minus Mamba's; agrees when it is > -tol at a majority of sizes,
       disagrees when it is < -tol at a majority.
    2. Accuracy grows with state size (Zoology): per recurrent objective, mean accuracy at the
       largest m minus at the smallest; agrees when > tol for a majority of objectives,
       disagrees when < -tol for a majority."""
    out = []
    longhorns = [o for o in ("longhorn", "longhorn_diag") if o in cells]
    claim1 = "Longhorn recalls at least as well as Mamba at equal state size (Longhorn paper, MQAR)"
    if longhorns and "mamba" in cells:
        sizes = sorted(set.intersection(*(set(cells[o]) for o in [*longhorns, "mamba"])))
        margins, spreads, ns = [], [], []
        for m in sizes:
            best = max(longhorns, key=lambda o: mean_std(cells[o][m])[0] or 0.0)
            ml, sl, nl = mean_std(cells[best][m])
            mm, sm, nm = mean_std(cells["mamba"][m])
            if ml is None or mm is None:
                continue
            margins.append((m, ml - mm))
            spreads.append(max(sl, sm))
            ns.append(min(nl, nm))
        wins = sum(d > -tol for _, d in margins)
        losses = sum(d < -tol for _, d in margins)
        verdict = AGREES if margins and wins > len(margins) / 2 else DISAGREES if losses > len(margins) / 2 \
            else INCONCLUSIVE
        ev = "; ".join(f"m={m}: Longhorn - Mamba = {d:+.3f}" for m, d in margins) + f" (tolerance {tol:g})"
        worst = min(margins, key=lambda t: abs(t[1]))[1] if margins else None
        out.append(_v(claim1, verdict, ev or "no comparable cells",
                      confidence(worst, max(spreads, default=0.0), min(ns, default=0))))
    else:
        out.append(_v(claim1, INCONCLUSIVE, "needs longhorn (or longhorn_diag) and mamba in the grid",
                      confidence(None, 0, 0)))
    claim2 = "MQAR accuracy grows with state size (Zoology / Longhorn protocol)"
    growth, spreads, ns = [], [], []
    for o, by_m in cells.items():
        if o == "attention" or len(by_m) < 2:
            continue
        lo, hi = min(by_m), max(by_m)
        a, sa, na = mean_std(by_m[lo])
        b, sb, nb = mean_std(by_m[hi])
        if a is None or b is None:
            continue
        growth.append((o, b - a))
        spreads.append(max(sa, sb))
        ns.append(min(na, nb))
    if growth:
        up = sum(g > tol for _, g in growth)
        down = sum(g < -tol for _, g in growth)
        verdict = AGREES if up > len(growth) / 2 else DISAGREES if down > len(growth) / 2 else INCONCLUSIVE
        ev = "; ".join(f"{o}: {g:+.3f} from smallest to largest m" for o, g in growth) + f" (tolerance {tol:g})"
        typical = statistics.median(g for _, g in growth)
        out.append(_v(claim2, verdict, ev, confidence(typical, max(spreads), min(ns))))
    else:
        out.append(_v(claim2, INCONCLUSIVE, "needs at least two state sizes", confidence(None, 0, 0)))
    return out


def exact_vs_diagonal(acc: dict[str, list[float]], loss: dict[str, list[float]], exact: str, diagonal: str,
                      acc_tol: float, loss_tol: float) -> list[dict]:
    """The rebuttal's toy result: the exact Longhorn recalls better than the diagonal one; and
    (the reviewers' question) whether it also models bytes better."""
    return [
        compare(f"exact Longhorn ({exact}) beats the diagonal approximation ({diagonal}) on MQAR accuracy "
                "(Longhorn rebuttal)", exact, acc[exact], diagonal, acc[diagonal], acc_tol),
        compare(f"exact Longhorn ({exact}) reaches a lower byte-LM validation loss than {diagonal} "
                "(reviewers' open question; no published answer)", exact, loss[exact], diagonal, loss[diagonal],
                loss_tol, higher_is_better=False),
    ]


def extrapolates(within: float | None, beyond: float | None, exploded: bool, max_ratio: float) -> bool | None:
    """Loss beyond the training length at most ``max_ratio`` x the loss within it, no explosion."""
    if within is None or beyond is None or not math.isfinite(beyond) or within <= 0:
        return None if within is None else False
    return beyond / within <= max_ratio and not bool(exploded)


def extrapolation(rows: list[dict], max_ratio: float, improve_tol: float, n_seeds: int) -> list[dict]:
    """``rows``: {objective, setting ("plain" or a mitigation label), within, beyond, exploded,
    refused}. Claims: Longhorn extrapolates to N x L (Longhorn paper); Mamba/GLA trained at L
    degrade beyond L (Stuffed Mamba); a training-free mitigation lowers the loss beyond L
    (Stuffed Mamba)."""
    plain = {r["objective"]: r for r in rows if r["setting"] == "plain" and not r.get("refused")}
    conf_n = ("low", f"{n_seeds} seed(s); loss ratio threshold {max_ratio:g}") if n_seeds < 2 else \
        ("medium", f"{n_seeds} seeds (mean over seeds); loss ratio threshold {max_ratio:g}")
    out = []

    def ratio(r):
        return None if r["within"] in (None, 0) or r["beyond"] is None else r["beyond"] / r["within"]

    if "longhorn" in plain:
        r = plain["longhorn"]
        ok = extrapolates(r["within"], r["beyond"], r["exploded"], max_ratio)
        out.append(_v("Longhorn trained at L extrapolates to the evaluated length (Longhorn paper: 16x)",
                      INCONCLUSIVE if ok is None else AGREES if ok else DISAGREES,
                      f"longhorn: loss beyond/within = {ratio(r)}, state explosion {r['exploded']}", conf_n))
    others = [o for o in ("mamba", "gla") if o in plain]
    if others:
        bad = {o: extrapolates(plain[o]["within"], plain[o]["beyond"], plain[o]["exploded"], max_ratio) for o in others}
        known = {o: b for o, b in bad.items() if b is not None}
        degrade = sum(not b for b in known.values())
        verdict = INCONCLUSIVE if not known else AGREES if degrade > len(known) / 2 else DISAGREES
        ev = "; ".join(f"{o}: ratio {ratio(plain[o])}, explosion {plain[o]['exploded']}" for o in others)
        out.append(_v("Mamba / GLA trained at L degrade beyond L (Stuffed Mamba)", verdict, ev, conf_n))
    helped, tried = [], []
    for r in rows:
        if r["setting"] == "plain" or r.get("refused") or r["objective"] not in plain:
            continue
        p = plain[r["objective"]]
        if p["beyond"] is None or r["beyond"] is None:
            continue
        tried.append(r)
        if r["beyond"] < p["beyond"] - improve_tol:
            helped.append(f"{r['objective']} {r['setting']}: {p['beyond']:.3f} -> {r['beyond']:.3f}")
    if tried:
        degraded = [o for o, p in plain.items()
                    if extrapolates(p["within"], p["beyond"], p["exploded"], max_ratio) is False]
        verdict = AGREES if helped else DISAGREES if degraded else INCONCLUSIVE   # nothing to mitigate
        ev = ("lowered the loss beyond L: " + "; ".join(helped) if helped else
              f"no mitigation lowered the loss beyond L by more than {improve_tol:g}") + \
             f" ({len(tried)} applicable settings; degraded without mitigation: {', '.join(degraded) or 'none'})"
        out.append(_v("a training-free mitigation lowers the loss beyond L (Stuffed Mamba)", verdict, ev, conf_n))
    return out


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict:
    """Least-squares ``y = slope x + intercept`` and R^2 (None when fewer than 2 points)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return {"slope": None, "intercept": None, "r2": None, "n": n}
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    return {"slope": slope, "intercept": intercept, "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0, "n": n}


def min_safe_length(exploded_by_length: dict[int, bool | None]) -> int | None:
    """Shortest training length L such that no run at L or any longer tested length exploded
    (None: every tested length, or the longest, exploded)."""
    best = None
    for L in sorted(exploded_by_length, reverse=True):
        if exploded_by_length[L] is False:
            best = L
        else:
            break
    return best


def state_capacity(points: dict[int, int | None], min_points: int, min_r2: float, n_seeds: int) -> tuple[dict, dict]:
    """``points[m]``: shortest explosion-free training length (None: not reached). Stuffed
    Mamba: it grows linearly with m. Agrees when >= min_points sizes have a length and the fit
    has slope > 0 and R^2 >= min_r2; disagrees when it has slope <= 0 or R^2 < min_r2;
    inconclusive with fewer points. Returns (verdict, fit)."""
    have = sorted((m, L) for m, L in points.items() if L is not None)
    fit = linear_fit([m for m, _ in have], [L for _, L in have])
    claim = "the shortest explosion-free training length grows linearly with state size (Stuffed Mamba)"
    censored = [m for m, L in points.items() if L is None]
    ev = (f"points (m, L): {have}; not reached within the tested lengths: {censored or 'none'}; fit slope "
          f"{fit['slope']}, R^2 {fit['r2']} (need >= {min_points:g} points, slope > 0, R^2 >= {min_r2:g})")
    if len(have) < min_points:
        verdict = INCONCLUSIVE
    elif fit["slope"] is not None and fit["slope"] > 0 and fit["r2"] >= min_r2:
        verdict = AGREES
    else:
        verdict = DISAGREES
    conf = ("low", f"{n_seeds} seed(s), {len(have)} point(s)") if len(have) < 4 or n_seeds < 2 else \
        ("medium", f"{n_seeds} seeds, {len(have)} points, R^2 {fit['r2']:.3f}")
    return _v(claim, verdict, ev, conf), fit


def composed_search(front: list[dict]) -> dict:
    """``front``: Pareto-front rows {objective, same_as, ...} (``same_as``: the library layer the
    objective derives to, None for a new one). The issue's claim: a search over composed
    objectives puts an objective that is not in the library on the Pareto front."""
    novel = [r["objective"] for r in front if r.get("same_as") is None]
    claim = "the Pareto front of a search over composed objectives holds an objective not in the library"
    named = [r.get("objective") + (f" (= {r['same_as']})" if r.get("same_as") not in (None, r.get("objective")) else "")
             for r in front]
    ev = f"front: {named}; not in the library: {novel or 'none'}"
    conf = ("low", f"{len(front)} trial(s) on the front, one seed per trial")
    if not front:
        return _v(claim, INCONCLUSIVE, "no complete trial", conf)
    return _v(claim, AGREES if novel else DISAGREES, ev, conf)


def rediscovery(rows: list[dict]) -> dict:
    """``rows``: one per layer left out of the library (``rediscovery.census_rows``). The claim:
    with these layers removed, the search rediscovers each from the pieces, by derived
    update. Agrees when every one was drawn and trained (a ranked trial derived it); disagrees when
    one was not, though the space holds it; inconclusive when the space cannot express one (then
    the search could not)."""
    claim = ("with " + ", ".join(r["left_out"] for r in rows) + " left out of the library, the search "
             "rediscovers each from the composed pieces (same derived update)")
    parts = []
    for r in rows:
        odds = (f"uniform sampling expects the first draw at trial {r['uniform_expected_trials']} and draws it "
                f"within this budget with chance {r['p_uniform_within_budget']}")
        if not r["variants_in_space"]:
            parts.append(f"{r['left_out']}: not expressible in this space")
        elif r["rediscovered"]:
            parts.append(f"{r['left_out']}: first drawn at trial {r['first_drawn']}, first trained at trial "
                         f"{r['first_trained']} ({odds}), trained {r['times_trained']}x, best rank "
                         f"{r['best_rank']} of {r['of_ranked']}{', on the Pareto front' if r['on_front'] else ''}")
        elif r["first_drawn"] is not None:
            parts.append(f"{r['left_out']}: drawn {r['times_drawn']}x (first at trial {r['first_drawn']}) but no "
                         f"such trial finished ({odds})")
        else:
            parts.append(f"{r['left_out']}: not drawn ({odds})")
    conf = ("low", "one search, one seed per trial; the first-trial count depends on the sampler's seed")
    if not rows:
        return _v(claim, INCONCLUSIVE, "nothing left out", conf)
    if any(not r["variants_in_space"] for r in rows):
        return _v(claim, INCONCLUSIVE, "; ".join(parts), conf)
    return _v(claim, AGREES if all(r["rediscovered"] for r in rows) else DISAGREES, "; ".join(parts), conf)


# ------------------------------------------------------------------ paired comparisons over seeds

def sign_test_p(wins: int, n: int) -> float:
    """One-sided sign test: the chance of at least ``wins`` wins in ``n`` fair coin flips (ties
    dropped before counting ``n``); 1.0 when ``n`` is 0."""
    return sum(math.comb(n, i) for i in range(wins, n + 1)) / 2 ** n if n else 1.0


def bootstrap_ci(diffs: Sequence[float], resamples: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of ``diffs`` (deterministic: a seeded generator);
    None for no values. With a handful of seeds it is as coarse as the seeds: read it with the
    sign test."""
    import random

    xs = [float(d) for d in diffs]
    if not xs:
        return None
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    tail = (1 - level) / 2
    return means[int(tail * (resamples - 1))], means[int(round((1 - tail) * (resamples - 1)))]


def paired(a: dict[int, float | None], b: dict[int, float | None], tol: float, higher_is_better: bool,
           resamples: int = 2000) -> dict:
    """``a`` against ``b``, each seed -> metric, paired by seed over the seeds where both are finite.
    ``diff`` is a's advantage per seed (positive: a is better). ``outcome``: "better" when at least
    two seeds pair, the mean advantage exceeds ``tol`` and the bootstrap interval lies above 0,
    "worse" when the mirror holds, else "tie"; ``p_better`` / ``p_worse``: one-sided sign tests of the wins and losses (seeds whose
    advantage is within ``tol`` count as ties and are dropped)."""
    seeds = sorted(s for s in a if s in b and a[s] is not None and b[s] is not None
                   and math.isfinite(a[s]) and math.isfinite(b[s]))
    diffs = [(a[s] - b[s]) if higher_is_better else (b[s] - a[s]) for s in seeds]
    wins, losses = sum(d > tol for d in diffs), sum(d < -tol for d in diffs)
    ci = bootstrap_ci(diffs, resamples)
    mean = statistics.fmean(diffs) if diffs else None
    outcome = "tie"                 # one seed has no interval to speak of: it decides nothing
    if len(diffs) >= 2 and mean > tol and ci[0] > 0:
        outcome = "better"
    elif len(diffs) >= 2 and mean < -tol and ci[1] < 0:
        outcome = "worse"
    return {"n": len(diffs), "mean_diff": mean, "ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None,
            "wins": wins, "losses": losses, "p_better": sign_test_p(wins, wins + losses),
            "p_worse": sign_test_p(losses, wins + losses), "outcome": outcome}


def _sign_confidence(p: float, n: int) -> tuple[str, str]:
    """high when the one-sided sign test gives p <= 0.05 (at least 5 seeds, all one way), medium
    when p <= 0.2 (3 seeds all one way), else low."""
    why = f"sign test p = {p:.3g} over {n} paired seed(s)"
    if p <= 0.05:
        return "high", why + " (p <= 0.05)"
    if p <= 0.2:
        return "medium", why + " (p <= 0.2)"
    return "low", why + " (p > 0.2: too few seeds, or they disagree)"


def beats_all(claim: str, pairs: dict[str, dict[str, dict]], metric: str) -> dict:
    """``pairs[challenger][baseline]``: ``paired`` comparisons. Agrees when some challenger is
    better than every baseline; disagrees when every challenger that has paired seeds is worse
    than at least one baseline (a challenger none of whose runs finished, e.g. every one diverged,
    is named in the evidence and left out: it can neither win nor lose); else inconclusive.
    Confidence: the sign test of the comparisons that decide it (the weakest of them: the largest p)."""
    def show(c, b, r):
        if r["mean_diff"] is None:
            return f"{c} vs {b}: no paired seeds"
        return (f"{c} vs {b}: {metric} advantage {r['mean_diff']:+.4g} (95% bootstrap {r['ci_low']:+.3g}..{r['ci_high']:+.3g}), "
                f"{r['wins']}/{r['n']} seeds better, {r['outcome']}")

    untrained = [c for c, rows in pairs.items() if not any(r["n"] for r in rows.values())]
    pairs = {c: rows for c, rows in pairs.items() if c not in untrained}
    ev = "; ".join([show(c, b, r) for c, rows in pairs.items() for b, r in rows.items()]
                   + [f"{c}: no finished run to pair, left out" for c in untrained])
    winners = [c for c, rows in pairs.items() if rows and all(r["outcome"] == "better" for r in rows.values())]
    if winners:
        best = min(winners, key=lambda c: max(r["p_better"] for r in pairs[c].values()))
        deciding = pairs[best].values()
        p = max(r["p_better"] for r in deciding)
        return _v(claim, AGREES, ev, _sign_confidence(p, min(r["n"] for r in deciding)))
    beaten = {c: [r for r in rows.values() if r["outcome"] == "worse"] for c, rows in pairs.items()}
    if pairs and all(beaten.values()):
        # each challenger's clearest defeat; the verdict is as sure as the least clear of those
        deciding = [min(rs, key=lambda r: r["p_worse"]) for rs in beaten.values()]
        p = max(r["p_worse"] for r in deciding)
        return _v(claim, DISAGREES, ev, _sign_confidence(p, min(r["n"] for r in deciding)))
    return _v(claim, INCONCLUSIVE, ev or "no comparisons",
              ("low", "no challenger is better than every baseline, and not every challenger is worse than one"))
