"""benchmarks/compare_searches.py on two synthetic composed-search results: trials grouped by the
family CUDA dispatch picks for their objective, medians as ratios to the run's Longhorn, the spread,
the front's objectives outside the library, and a clear exit on a file that is not a study."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("compare_searches", ROOT / "benchmarks" / "compare_searches.py")
cmp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cmp)


def row(objective, tps, *, pareto=False, same_as="", status="complete", structure="rank1"):
    return {"objective": objective, "status": status, "pareto": pareto, "same_as": same_as or None,
            "metric.tokens_per_s": tps, "metric.structure": structure, "objective_spec": SPECS[objective]}


def library_spec(name: str) -> str:
    return json.dumps(yaml.safe_load((ROOT / "objectives" / f"{name}.yaml").read_text()))


SPECS = {n: library_spec(n) for n in ("longhorn", "deltanet", "mamba")}


def study(path: Path, rows: list[dict]) -> str:
    path.write_text(json.dumps({"study": "composed_search", "date": "d", "device": "cuda", "command": "c",
                                "wall_s": 1.0, "tables": [{"title": "Pareto front", "rows": []},
                                                          {"title": "All finished trials (same_as: ...)",
                                                           "rows": rows}]}))
    return str(path)


def test_groups_by_family_with_ratios_to_longhorn_and_the_spread(tmp_path):
    rows = [row("longhorn", 100.0, pareto=True, same_as="longhorn"), row("longhorn", 300.0, same_as="longhorn"),
            row("deltanet", 50.0, same_as="deltanet"), row("mamba", 400.0, pareto=True, structure="diagonal_decay"),  # no same_as: as if composed
            row("mamba", 1e9, status="failed")]
    s = cmp.summarise(cmp.trials(study(tmp_path / "a.json", rows))[1], {})
    fam = s["by"]["family"]["groups"]
    assert s["anchor_tokens_per_s"] == 200.0 and s["trials"] == 4
    assert fam["rank1_row_chunk"] == {"trials": 2, "median_tokens_per_s": 200.0, "x_longhorn": 1.0}
    assert fam["rank1_chunk"]["x_longhorn"] == 0.25 and fam["diagonal"]["x_longhorn"] == 2.0
    assert s["by"]["family"]["spread"] == 8.0
    assert s["front_not_in_library"] == ["mamba"] and s["front"] == ["longhorn", "mamba"]


def test_main_writes_the_report_and_refuses_a_file_that_is_not_a_study(tmp_path, capsys):
    a = study(tmp_path / "a.json", [row("longhorn", 100.0, same_as="longhorn"), row("deltanet", 50.0)])
    b = study(tmp_path / "b.json", [row("longhorn", 400.0, same_as="longhorn"), row("deltanet", 400.0)])
    assert cmp.main(["--pair", f"x:{a}:{b}", "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| rank1_chunk | 1 | 1 | 50 | 400 | 0.50 | 1.00 |" in text
    assert "before 2.00x, after 1.00x" in text
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tables": [{"title": "something else", "rows": []}]}))
    assert cmp.main(["--pair", f"x:{bad}:{b}"]) == 2
    assert "not a composed_search study" in capsys.readouterr().err
