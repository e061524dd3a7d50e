"""``DIR/report.md`` and ``DIR/results.json`` of a study."""
from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any, Sequence

from ssmcraft.fileio import write_text

SECTIONS = ("## Setup", "## Results", "## Plots", "## Agreement with the paper")


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    if not rows:
        return "_(no rows)_"
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _clean(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_report(out: Path, *, spec, scale: str, device: str, command: str, result: dict[str, Any],
                 wall_s: float) -> tuple[Path, Path]:
    """``result``: {"tables": [{"title", "rows", "columns"}], "plots": [file names in out],
    "verdicts": [verdict dicts], "notes": [str], "data": {...}}."""
    out = Path(out)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Study: {spec.name} ({spec.kind})", "",
             f"- date: {date}", f"- device: {device}", f"- scale: {scale}", f"- command: `{command}`",
             f"- spec: `{spec.source}`", f"- wall time: {wall_s:.1f} s", ""]
    if spec.claim:
        lines += [f"> Paper's claim: {spec.claim}", ""]
    if scale == "smoke":
        lines += ["**Smoke scale**: tiny models and a few steps, to check the pipeline; the numbers say "
                  "nothing about the papers.", ""]
    lines += ["## Setup", "", "```json", json.dumps(_clean(spec.params(scale)), indent=1, sort_keys=True)[:4000],
              "```", "", "Verdict thresholds: " + (", ".join(f"{k}={v:g}" for k, v in spec.thresholds.items())
                                                  or "none"), "", "## Results", ""]
    for t in result.get("tables", []):
        lines += [f"### {t['title']}", "", markdown_table(t["rows"], t["columns"]), ""]
    lines += ["## Plots", ""]
    lines += [f"![{p}]({p})" for p in result.get("plots", [])] or ["_(none)_"]
    lines += ["", "## Agreement with the paper", "",
              "Computed from the numbers above with the stated thresholds (ssmcraft.study.verdict).", ""]
    for v in result.get("verdicts", []):
        lines += [f"- **{v['verdict'].upper()}**: {v['claim']}", f"  - evidence: {v['evidence']}",
                  f"  - confidence: {v['confidence']} ({v['confidence_reason']})"]
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    report = out / "report.md"
    write_text(report, "\n".join(lines) + "\n")
    results = out / "results.json"
    payload = {"study": spec.name, "kind": spec.kind, "scale": scale, "date": date, "device": device,
               "command": command, "spec": spec.source, "params": spec.params(scale),
               "thresholds": spec.thresholds, "wall_s": wall_s, "tables": result.get("tables", []),
               "plots": result.get("plots", []), "verdicts": result.get("verdicts", []),
               "notes": result.get("notes", []), "data": result.get("data", {})}
    write_text(results, json.dumps(_clean(payload), indent=1, default=str))
    return report, results
