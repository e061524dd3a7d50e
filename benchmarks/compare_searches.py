"""Two runs of the same composed search side by side: how tokens/s spreads across kernel families and
structure classes in each, and which objectives not in the library reach the Pareto front. CPU only
(it reads the studies' ``results.json`` and derives each objective to name its family):

    python3 benchmarks/compare_searches.py --pair LABEL:BEFORE/results.json:AFTER/results.json [--pair ...]
        [--out DIR]     # writes DIR/report.md and DIR/comparison.json

Each trial's family is the one CUDA dispatch picks for its objective in this tree
(``family_coverage.family_of``): the kernels the "after" run used. The "before" run's kernels are
whatever its tree had; its trials are grouped by the same families so that each family's row shows
what the new kernels changed for the same objectives. Raw tokens/s depend on what shared the GPU with
the search (other searches, trials packed per GPU), so every figure is also given as a ratio to the
median tokens/s of the library's Longhorn trials in the same run, the anchor every search here holds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ssmcraft  # noqa: E402
from ssmcraft.errors import SsmcraftError  # noqa: E402
from family_coverage import family_of  # noqa: E402

ANCHOR = "longhorn"
TRIALS_TABLE = "All finished trials"


def trials(path: str) -> tuple[dict, list[dict]]:
    """(the study's header fields, its completed trials) from a study's results.json."""
    with open(path) as f:
        res = json.load(f)
    table = next((t for t in res["tables"] if t["title"].startswith(TRIALS_TABLE)), None)
    if table is None:
        raise SsmcraftError(f"{path}: no table {TRIALS_TABLE!r} (not a composed_search study's results.json)")
    rows = [r for r in table["rows"] if r.get("status") == "complete" and r.get("metric.tokens_per_s")]
    return {k: res.get(k) for k in ("study", "date", "device", "command", "wall_s")}, rows


def family(spec_json: str, cache: dict) -> str:
    """The family CUDA dispatch picks for a trial's objective (recorded as JSON in the trial)."""
    if spec_json not in cache:
        try:
            fam, _ = family_of(ssmcraft.compile(json.loads(spec_json)).ir)
            cache[spec_json] = fam or "PyTorch path"
        except SsmcraftError as e:
            cache[spec_json] = f"does not derive here ({str(e)[:60]})"
    return cache[spec_json]


def summarise(rows: list[dict], cache: dict) -> dict:
    """Per family and per structure: trials, median tokens/s, median ratio to the run's Longhorn; the
    spread (largest / smallest family median); the front's objectives outside the library."""
    anchor = [r["metric.tokens_per_s"] for r in rows if r["objective"] == ANCHOR]
    ref = statistics.median(anchor) if anchor else None
    out = {"trials": len(rows), "anchor_tokens_per_s": ref, "by": {}}
    for key, of in (("family", lambda r: family(r["objective_spec"], cache)),
                    ("structure", lambda r: r.get("metric.structure") or "?")):
        groups: dict[str, list[float]] = {}
        for r in rows:
            groups.setdefault(of(r), []).append(r["metric.tokens_per_s"])
        table = {g: {"trials": len(v), "median_tokens_per_s": statistics.median(v),
                     "x_longhorn": statistics.median(v) / ref if ref else None} for g, v in groups.items()}
        meds = [t["median_tokens_per_s"] for t in table.values()]
        out["by"][key] = {"groups": table, "spread": max(meds) / min(meds) if meds else None}
    out["front_not_in_library"] = sorted({r["objective"] for r in rows if r.get("pareto") and not r.get("same_as")})
    out["front"] = [r["objective"] for r in rows if r.get("pareto")]
    return out


def fmt(v, spec=".3g"):
    return "—" if v is None else format(v, spec)


def report(pairs: list[tuple[str, dict, dict, dict, dict]]) -> str:
    lines = ["# Composed searches before and after the per-class kernels", "",
             "Written by `benchmarks/compare_searches.py` from two runs of each search (same spec, same "
             "budget: `budget.total_seconds`, trials and seconds per trial). Family: the one CUDA dispatch "
             f"picks in this tree. `x {ANCHOR}`: median tokens/s over the run's median {ANCHOR} trial.", ""]
    for label, hb, sb, ha, sa in pairs:
        lines += [f"## {label}", "",
                  f"- before: {hb['date']}, {hb['device']}, {sb['trials']} trials, {ANCHOR} "
                  f"{fmt(sb['anchor_tokens_per_s'], '.3g')} tokens/s",
                  f"- after: {ha['date']}, {ha['device']}, {sa['trials']} trials, {ANCHOR} "
                  f"{fmt(sa['anchor_tokens_per_s'], '.3g')} tokens/s", ""]
        for key in ("family", "structure"):
            gb, ga = sb["by"][key]["groups"], sa["by"][key]["groups"]
            lines += [f"| {key} | trials before | trials after | tokens/s before | tokens/s after | "
                      f"x {ANCHOR} before | x {ANCHOR} after |", "|---|---|---|---|---|---|---|"]
            for g in sorted(set(gb) | set(ga)):
                b, a = gb.get(g, {}), ga.get(g, {})
                lines.append(f"| {g} | {b.get('trials', 0)} | {a.get('trials', 0)} | "
                             f"{fmt(b.get('median_tokens_per_s'))} | {fmt(a.get('median_tokens_per_s'))} | "
                             f"{fmt(b.get('x_longhorn'), '.2f')} | {fmt(a.get('x_longhorn'), '.2f')} |")
            lines += ["", f"Spread of the {key} medians (largest / smallest): before "
                          f"{fmt(sb['by'][key]['spread'], '.2f')}x, after {fmt(sa['by'][key]['spread'], '.2f')}x.", ""]
        lines += [f"Pareto front before: {', '.join(sb['front']) or 'none'}; not in the library: "
                  f"{', '.join(sb['front_not_in_library']) or 'none'}.",
                  f"Pareto front after: {', '.join(sa['front']) or 'none'}; not in the library: "
                  f"{', '.join(sa['front_not_in_library']) or 'none'}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", action="append", required=True, help="LABEL:BEFORE.json:AFTER.json")
    ap.add_argument("--out", default="", help="folder for report.md and comparison.json")
    args = ap.parse_args(argv)
    cache: dict = {}
    pairs, data = [], {}
    for p in args.pair:
        try:
            label, before, after = p.split(":")
        except ValueError:
            ap.error(f"--pair {p!r}: expected LABEL:BEFORE.json:AFTER.json")
        try:
            (hb, rb), (ha, ra) = trials(before), trials(after)
        except (OSError, ValueError, KeyError, SsmcraftError) as e:
            print(f"compare_searches: --pair {label}: {e}", file=sys.stderr)
            return 2
        sb, sa = summarise(rb, cache), summarise(ra, cache)
        pairs.append((label, hb, sb, ha, sa))
        data[label] = {"before": {**hb, **sb}, "after": {**ha, **sa}}
    text = report(pairs)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "comparison.json"), "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
