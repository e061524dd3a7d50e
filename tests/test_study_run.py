"""Every study kind end to end at smoke scale on the CPU: the shipped spec runs, writes
report.md (date, device, command, table, plots, verdict section) and results.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssmcraft.cli import main
from ssmcraft.study.commands import run_study
from ssmcraft.study.report import SECTIONS

SPECS = Path(__file__).resolve().parent.parent / "specs" / "studies"
VERDICTS = {"agrees", "disagrees", "inconclusive"}


def _check(out: Path, kind: str) -> dict:
    report = (out / "report.md").read_text()
    for section in SECTIONS:
        assert section in report, section
    for field in ("- date: ", "- device: cpu", "- command: `ssmcraft study", "|---|"):
        assert field in report, field
    results = json.loads((out / "results.json").read_text())
    for key in ("study", "kind", "scale", "date", "device", "command", "params", "thresholds", "tables", "plots",
                "verdicts", "data"):
        assert key in results, key
    assert results["kind"] == kind and results["scale"] == "smoke"
    assert results["verdicts"] and all(v["verdict"] in VERDICTS for v in results["verdicts"])
    assert all(v["confidence"] in ("high", "medium", "low") for v in results["verdicts"])
    for v in results["verdicts"]:
        assert f"**{v['verdict'].upper()}**" in report
    assert results["plots"]
    for png in results["plots"]:
        assert (out / png).is_file() and (out / png).stat().st_size > 1000
        assert f"]({png})" in report
    return results


@pytest.mark.parametrize("kind", ["mqar_state_size", "exact_vs_diagonal", "state_capacity"])
def test_study_runs_at_smoke_scale(kind, tmp_path):
    run_study(SPECS / f"{kind}.yaml", tmp_path, device="cpu", scale="smoke", say=lambda s: None)
    results = _check(tmp_path, kind)
    if kind == "mqar_state_size":
        cells = results["tables"][0]["rows"]
        assert {r["objective"] for r in cells} == {"longhorn_diag", "mamba", "attention"}
        assert all(r["state_bytes"] for r in cells)
        assert {r["objective"]: r["layers"] for r in cells}["attention"] == 2          # the spec's override
        assert all(r["layers"] == 1 for r in cells if r["objective"] != "attention")
        assert all("/" in r["solved"] for r in cells)
        assert (tmp_path / "accuracy_vs_state_bytes.png").is_file()
    elif kind == "exact_vs_diagonal":
        assert set(results["data"]["accuracy"]) == {"longhorn", "longhorn_diag"}
        assert all(len(v) == 2 for v in results["data"]["val_loss"].values())        # two seeds each
        assert "±" in (tmp_path / "report.md").read_text()
        assert all("skipped" in b for b in results["data"]["kernel_bench"].values())     # --device cpu
    else:
        assert set(results["data"]["points"]) == {"2", "4"}
        assert "fit" in results["data"]


def test_extrapolation_records_mitigations_and_resumes(tmp_path):
    run_study(SPECS / "extrapolation.yaml", tmp_path, device="cpu", scale="smoke", say=lambda s: None)
    results = _check(tmp_path, "extrapolation")
    rows = results["data"]["rows"]
    settings = {(r["objective"], r["setting"]) for r in rows}
    for obj in ("longhorn_diag", "mamba"):
        for s in ("plain", "retention=0.9,insertion=1", "window=8"):
            assert (obj, s) in settings
    for r in rows:      # every setting either ran (a loss beyond L) or records its refusal
        assert r["beyond"] is not None or r["refused"]
    refused = {r["setting"]: r["refused"] for r in rows if r["objective"] == "longhorn"}
    assert "rank-1" in refused["retention=0.9,insertion=1"] and "rank1" in refused["window=8"]
    # the same command again reads every cell back instead of training, refusals included (the
    # weights may be gone by then: a study resumed elsewhere carries only its records)
    for weights in tmp_path.rglob("model.safetensors"):
        weights.unlink()
    said = []
    again = run_study(SPECS / "extrapolation.yaml", tmp_path, device="cpu", scale="smoke", say=said.append)
    assert not [s for s in said if s.startswith("study: train")]
    rows2 = json.loads(again["results"].read_text())["data"]["rows"]
    assert {(r["objective"], r["setting"]): r["refused"] for r in rows2} == \
        {(r["objective"], r["setting"]): r["refused"] for r in rows}


def test_composed_search_via_cli_writes_front_and_update(tmp_path, capsys):
    out = tmp_path / "cs"
    assert main(["study", str(SPECS / "composed_search.yaml"), "--out", str(out), "--device", "cpu",
                 "--scale", "smoke", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "report.md" in printed
    results = _check(out, "composed_search")
    assert results["tables"][0]["title"] == "Pareto front" and results["tables"][0]["rows"]
    assert results["data"]["counts"]["complete"] >= 1
    best = results["data"]["best_non_library"]
    if best is not None:     # a composed objective finished: its derived update is written out
        assert (out / "best_composed_update.txt").read_text().count("S_t") >= 1
        assert "S_t =" in (out / "report.md").read_text()
        confirm = results["data"]["confirm"]        # re-trained on byte-level text next to the best library layer
        assert confirm[0]["objective"] == best["objective"] and not confirm[0]["in_library"]
        assert all(r["val_loss_mean"] is not None for r in confirm)
        assert (out / "runs" / "confirm" / best["objective"] / "s0" / "metrics.json").is_file()
    assert (out / "search" / "leaderboard.csv").is_file()


def test_cli_check_and_errors(tmp_path, capsys):
    assert main(["study", str(SPECS / "state_capacity.yaml"), "--out", str(tmp_path), "--check"]) == 0
    printed = capsys.readouterr().out
    assert "valid state_capacity study" in printed and "full: 16 training runs, at most 64 min" in printed
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nkind: nope\nsmoke: {}\nfull: {}\n")
    assert main(["study", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "unknown study kind" in capsys.readouterr().err


def test_shards_split_cells_without_overlap_then_plain_run_reports(tmp_path):
    trained = {}
    for i in range(2):
        said = []
        done = run_study(SPECS / "state_capacity.yaml", tmp_path, device="cpu", scale="smoke", say=said.append,
                         shard=(i, 2))
        assert done["report"] is None and not (tmp_path / "report.md").exists()
        trained[i] = {s.split()[-1] for s in said if s.startswith("study: train")}
        evals = [p for p in (tmp_path / "runs").rglob("eval_plain/eval.json")]
        assert len(evals) == sum(len(v) for v in trained.values())     # each shard evaluates only its cells
    assert trained[0] and trained[1] and not trained[0] & trained[1]
    assert len(trained[0] | trained[1]) == 4                               # 2 m x 2 L
    said = []
    run_study(SPECS / "state_capacity.yaml", tmp_path, device="cpu", scale="smoke", say=said.append)
    assert not [s for s in said if s.startswith("study: train")]         # everything read back
    _check(tmp_path, "state_capacity")


def test_shard_argument_and_search_refusal(tmp_path, capsys):
    from ssmcraft.study.commands import parse_shard

    assert parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "-1/2", "a/b", "1"):
        with pytest.raises(Exception, match="shard"):
            parse_shard(bad)
    assert main(["study", str(SPECS / "composed_search.yaml"), "--out", str(tmp_path), "--scale", "smoke",
                 "--device", "cpu", "--shard", "0/2"]) == 2
    assert "--shard does not apply" in capsys.readouterr().err
