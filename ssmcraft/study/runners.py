"""One runner per study kind: ``run_<kind>(params, thresholds, ctx) -> result`` (see
``report.write_report`` for the result's shape). Training is ``ssmcraft.train.train_run``,
evaluation ``ssmcraft.train.eval_run.eval_run``, the search ``ssmcraft.search.run_search``.

Every run lives in ``DIR/runs/<cell>``; a cell whose ``metrics.json`` (or ``eval.json``)
already exists is read back, not re-run, so an interrupted study resumes with the same
command.
"""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ssmcraft.errors import SsmcraftError
from ssmcraft.fileio import write_text
from ssmcraft.study import verdict as V
from ssmcraft.study.iso_state import iso_state_size
from ssmcraft.study.rediscovery import census_rows, fingerprint_of, rediscoveries, row_fingerprint, space_census

log = logging.getLogger("ssmcraft.study")


@dataclass
class Context:
    out: Path
    device: str = "auto"            # train.device / EvalOptions.device
    say: Callable[[str], None] = print
    shard: tuple[int, int] | None = None    # (i, n): train only cells i, i+n, i+2n, ... (``--shard i/n``)
    cells_seen: int = 0
    owned: set = field(default_factory=set)  # run dirs this process trains and evaluates

    def claim(self, run_dir: Path) -> bool:
        """Whether this process owns the next cell (every cell when not sharded). Cells are
        numbered in the runner's fixed order, so ``n`` processes with ``--shard 0/n`` ...
        ``--shard n-1/n`` split a study without overlap; a later unsharded run reads them all back."""
        idx = self.cells_seen
        self.cells_seen += 1
        mine = self.shard is None or idx % self.shard[1] == self.shard[0]
        if mine:
            self.owned.add(run_dir)
        return mine


# ------------------------------------------------------------------ cells

def _lr_tag(lr: float) -> str:
    return f"{lr:g}".replace("+", "")


def train_cell(ctx: Context, exp: dict, rel: str, *, objective: str | dict, seed: int, m: int | None = None,
               lr: float | None = None, seq_len: int | None = None,
               batch_size: int | None = None) -> tuple[dict, Path]:
    """Train one cell with ``train_run`` (or read its metrics back); returns (metrics, run dir).
    ``objective``: a library name, "attention", or an objective spec (a mapping, e.g. a composed
    objective found by a search). A refused config (``SsmcraftError``) is recorded as status
    "error", not raised."""
    from ssmcraft.search.trial import state_bytes
    from ssmcraft.train import train_run

    run_dir = ctx.out / "runs" / rel
    done = run_dir / "metrics.json"
    mine = ctx.claim(run_dir)
    if done.is_file():
        return json.loads(done.read_text()), run_dir
    if not mine:
        return {"status": "error", "reason": f"cell of another shard (not trained by shard {ctx.shard[0]}/{ctx.shard[1]})"}, run_dir
    cfg = {"name": rel.replace("/", "_"), "seed": seed, "task": copy.deepcopy(exp["task"]),
           "model": copy.deepcopy(exp["model"]), "train": copy.deepcopy(exp.get("train", {}))}
    mixer = dict(cfg["model"].get("mixer") or {})
    if objective == "attention":
        cfg["model"]["mixer"] = {"kind": "attention", "heads": mixer.get("heads", 1)}
    else:
        mixer.update(kind="objective", objective=objective)
        if m is not None:
            mixer["state_size"] = m
        cfg["model"]["mixer"] = mixer
    if lr is not None:
        cfg["train"]["lr"] = lr
    if seq_len is not None:
        cfg["task"]["seq_len"] = seq_len
    if batch_size is not None:
        cfg["train"]["batch_size"] = batch_size
    cfg["train"]["device"] = ctx.device
    ctx.say(f"study: train {rel}")
    try:
        metrics = dict(train_run(cfg, run_dir))
    except SsmcraftError as e:
        ctx.say(f"study: {rel} refused: {e}")
        return {"status": "error", "reason": str(e)}, run_dir
    metrics["state_bytes"] = state_bytes(run_dir)
    if metrics["state_bytes"] is None:      # attention: its KV cache at the training length, fp32
        d, L = cfg["model"].get("d_model", 256), cfg["task"]["seq_len"]
        metrics["state_bytes_kv_cache"] = 2 * 4 * L * d * int(cfg["model"].get("n_layers", 1))
    write_text(done, json.dumps(metrics, default=str))
    return metrics, run_dir


def eval_cell(ctx: Context, run_dir: Path, label: str, options) -> dict:
    """``eval_run`` into ``run_dir/eval_<label>`` (or read back); a refused mitigation returns
    ``{"refused": message}``, kept in ``refused.json`` so a resumed study reads the refusal back
    (the weights may be gone by then). A summary read back has its explosion verdict recomputed
    from the recorded statistics (``state_stats.json``) with the current rule."""
    from ssmcraft.train.eval_run import eval_run

    out = run_dir / f"eval_{label.replace('=', '').replace(',', '_')}"
    done, refused = out / "eval.json", out / "refused.json"
    if done.is_file():
        return _current_rule(out, json.loads(done.read_text()))
    if refused.is_file():
        return json.loads(refused.read_text())
    if run_dir not in ctx.owned:
        return {"refused": "cell of another shard"}
    options.device = ctx.device
    try:
        return eval_run(run_dir, options, out)
    except SsmcraftError as e:
        ctx.say(f"study: {run_dir.name} {label}: refused: {e}")
        out.mkdir(parents=True, exist_ok=True)
        write_text(refused, json.dumps({"refused": str(e)}))
        return {"refused": str(e)}


def _current_rule(out: Path, summary: dict) -> dict:
    """Re-apply ``state_stats.detect_explosion`` to the statistics an evaluation recorded."""
    from ssmcraft.train.state_stats import detect_explosion

    stats_file = out / "state_stats.json"
    if not stats_file.is_file() or not isinstance(summary.get("state"), dict):
        return summary
    for label, entry in json.loads(stats_file.read_text()).items():
        if isinstance(entry, dict) and "stats" in entry and label in summary["state"]:
            rule = entry.get("explosion") or {}
            v = detect_explosion(entry["times"], entry["stats"], rule.get("train_len", summary.get("train_len")),
                                 rule.get("factor", 3.0), entry.get("layers"))
            summary["state"][label] = {"exploded": v["exploded"], "flags": v["flags"]}
    return summary


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path.name


def _device_of(metrics: list[dict]) -> str | None:
    return next((m.get("device") for m in metrics if m.get("device")), None)


# ------------------------------------------------------------------ 1. MQAR at equal state size

SOLVED = 0.5     # an MQAR run "solved" the task when its accuracy reaches this (runs are bimodal)


def _solved(accs) -> str:
    known = [a for a in accs if a is not None]
    return f"{sum(a >= SOLVED for a in known)}/{len(known)}"


def run_mqar_state_size(p: dict, th: dict, ctx: Context) -> dict:
    from ssmcraft.study.spec import experiment_for

    seeds = p["seeds"]
    cells: dict[str, dict[int, list[float]]] = {}
    rows, all_metrics, raw = [], [], []
    for obj in p["objectives"]:
        exp = experiment_for(p["experiment"], p.get("overrides", {}), obj)
        sizes = [None] if obj == "attention" else p["state_sizes"]
        for m in sizes:
            by_lr: dict[float, list[dict]] = {}
            for lr in p["lrs"]:
                for seed in seeds:
                    rel = f"{obj}/m{m if m is not None else 'na'}/lr{_lr_tag(lr)}/s{seed}"
                    metrics, _ = train_cell(ctx, exp, rel, objective=obj, seed=seed, m=m, lr=lr)
                    all_metrics.append(metrics)
                    by_lr.setdefault(lr, []).append(metrics)
                    raw.append({"objective": obj, "m": m, "lr": lr, "seed": seed, "status": metrics.get("status"),
                                "accuracy": metrics.get("accuracy"), "val_loss": metrics.get("val_loss")})
            best_lr = max(by_lr, key=lambda lr: V.mean_std([x.get("accuracy") for x in by_lr[lr]])[0] or -1.0)
            accs = [x.get("accuracy") for x in by_lr[best_lr]]
            mean, std, n = V.mean_std(accs)
            first = by_lr[best_lr][0]
            sb = first.get("state_bytes") or first.get("state_bytes_kv_cache")
            cells.setdefault(obj, {})[m if m is not None else 0] = [a for a in accs if a is not None]
            rows.append({"objective": obj, "m": m, "state_bytes": sb,
                         "state_kind": "KV cache at L" if first.get("state_bytes") is None else "recurrent",
                         "best_lr": best_lr, "accuracy_mean": mean, "accuracy_std": std, "seeds": n,
                         "solved": _solved(accs), "layers": exp["model"].get("n_layers"),
                         "chance": first.get("chance_accuracy"),
                         "val_loss": V.mean_std([x.get("val_loss") for x in by_lr[best_lr]])[0]})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for obj in p["objectives"]:
        rs = [r for r in rows if r["objective"] == obj and r["state_bytes"]]
        if obj == "attention":
            for r in rs:
                ax.axhline(r["accuracy_mean"] or 0, ls="--", color="gray", label=f"attention (KV {r['state_bytes']} B)")
            continue
        ax.errorbar([r["state_bytes"] for r in rs], [r["accuracy_mean"] or 0 for r in rs],
                    yerr=[r["accuracy_std"] for r in rs], marker="o", capsize=3, label=obj)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("recurrent state per sequence (bytes, fp32)")
    ax.set_ylabel("MQAR accuracy (best lr)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    ax.set_title("MQAR accuracy vs state size")
    plots = [_save(fig, ctx.out / "accuracy_vs_state_bytes.png")]
    recurrent_cells = {o: c for o, c in cells.items() if o != "attention"}
    verdicts = V.mqar_state_size(recurrent_cells, th["tol"])
    return {"tables": [{"title": "Best-lr MQAR accuracy per cell", "rows": rows,
                        "columns": ["objective", "layers", "m", "state_bytes", "state_kind", "best_lr",
                                    "accuracy_mean", "accuracy_std", "solved", "seeds", "chance", "val_loss"]},
                       {"title": "Every run", "rows": raw,
                        "columns": ["objective", "m", "lr", "seed", "status", "accuracy", "val_loss"]}],
            "plots": plots, "verdicts": verdicts, "device": _device_of(all_metrics),
            "data": {"cells": {o: {str(m): v for m, v in c.items()} for o, c in cells.items()}, "runs": raw}}


# ------------------------------------------------------------------ 2. exact vs diagonal

def run_exact_vs_diagonal(p: dict, th: dict, ctx: Context) -> dict:
    exact, diag = p["objectives"]
    acc, loss, speed_mqar, speed_text = ({o: [] for o in (exact, diag)} for _ in range(4))
    raw, all_metrics = [], []
    for obj in (exact, diag):
        for seed in p["seeds"]:
            mq, _ = train_cell(ctx, p["mqar"], f"mqar/{obj}/s{seed}", objective=obj, seed=seed)
            tx, _ = train_cell(ctx, p["text"], f"text/{obj}/s{seed}", objective=obj, seed=seed)
            all_metrics += [mq, tx]
            acc[obj].append(mq.get("accuracy"))
            loss[obj].append(tx.get("val_loss"))
            speed_mqar[obj].append(mq.get("tokens_per_s"))
            speed_text[obj].append(tx.get("tokens_per_s"))
            raw.append({"objective": obj, "seed": seed, "mqar_status": mq.get("status"),
                        "mqar_accuracy": mq.get("accuracy"), "mqar_tokens_per_s": mq.get("tokens_per_s"),
                        "text_status": tx.get("status"), "text_val_loss": tx.get("val_loss"),
                        "text_tokens_per_s": tx.get("tokens_per_s"), "backend": str(tx.get("backend"))})
    rows = []
    for obj in (exact, diag):
        row = {"objective": obj}
        for name, series in (("mqar_accuracy", acc), ("text_val_loss", loss), ("mqar_tokens_per_s", speed_mqar),
                             ("text_tokens_per_s", speed_text)):
            mean, std, n = V.mean_std(series[obj])
            row[name] = None if mean is None else f"{mean:.4g} ± {std:.2g}"
            row[f"_{name}"] = mean
            row["seeds"] = n
        row["mqar_solved"] = _solved(acc[obj])
        rows.append(row)
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.4))
    for ax, (title, series) in zip(axes, (("MQAR accuracy", acc), ("byte-LM val loss", loss),
                                          ("tokens/s (byte LM)", speed_text))):
        stats = [V.mean_std(series[o]) for o in (exact, diag)]
        ax.bar([exact, diag], [s[0] or 0 for s in stats], yerr=[s[1] for s in stats], capsize=4,
               color=["tab:blue", "tab:orange"])
        ax.set_title(title, fontsize=9)
    plots = [_save(fig, ctx.out / "exact_vs_diagonal.png")]
    ratio = None
    e, d = V.mean_std(speed_text[exact])[0], V.mean_std(speed_text[diag])[0]
    if e and d:
        ratio = d / e
    bench, bench_rows = {}, []
    if p.get("bench_shape") and ctx.shard is None:
        bench = kernel_bench([exact, diag], p["bench_shape"], ctx)
        bench_rows = [{"objective": o, **{k: b.get(k) for k in ("backend", "fwd_ms", "fwd_bwd_ms", "fwd_GBps",
                                                                 "fwd_bwd_x_floor", "skipped")}}
                      for o, b in bench.items()]
    notes = [f"speed: the diagonal kernel trains {ratio:.2f}x the tokens/s of the exact one (byte LM)"
             if ratio else "speed: not measured", "speed is tokens/s of the training step (forward + backward, "
             "validation excluded) on this device; see `ssmcraft bench` for the kernel alone"]
    return {"tables": [{"title": "Mean ± sample std over seeds", "rows": rows,
                        "columns": ["objective", "mqar_accuracy", "mqar_solved", "text_val_loss",
                                    "mqar_tokens_per_s", "text_tokens_per_s", "seeds"]},
                       {"title": "Every run", "rows": raw, "columns": list(raw[0]) if raw else []}]
            + ([{"title": f"Kernel alone (ssmcraft bench, shape B,T,H,d,m = {p['bench_shape']})", "rows": bench_rows,
                 "columns": ["objective", "backend", "fwd_ms", "fwd_bwd_ms", "fwd_GBps", "fwd_bwd_x_floor",
                             "skipped"]}] if bench_rows else []),
            "plots": plots, "verdicts": V.exact_vs_diagonal(acc, loss, exact, diag, th["acc_tol"], th["loss_tol"]),
            "notes": notes, "device": _device_of(all_metrics),
            "data": {"accuracy": acc, "val_loss": loss, "tokens_per_s_mqar": speed_mqar,
                     "tokens_per_s_text": speed_text, "diag_over_exact_speed": ratio, "runs": raw,
                     "kernel_bench": bench}}


def kernel_bench(objectives: list[str], shape: list[int], ctx: Context) -> dict[str, dict]:
    """``ssmcraft bench``'s measurement (``run_bench``) per objective; on a machine without
    CUDA (or ``--device cpu``) each is recorded as skipped with the reason."""
    from ssmcraft.bench.run import run_bench

    out = {}
    for obj in objectives:
        if ctx.device == "cpu":
            out[obj] = {"skipped": "--device cpu: kernel timings need CUDA"}
            continue
        try:
            out[obj] = run_bench(obj, tuple(shape))
        except (SsmcraftError, ImportError, RuntimeError) as e:
            out[obj] = {"skipped": str(e).splitlines()[0][:200]}
        ctx.say(f"study: bench {obj}: {out[obj].get('fwd_bwd_ms', out[obj].get('skipped'))}")
    return out


# ------------------------------------------------------------------ 3. extrapolation

def _eval_options(p: dict, mitigation=None):
    from ssmcraft.train.eval_run import EvalOptions

    return EvalOptions(extrapolate=p["extrapolate"], mitigation=mitigation, **p.get("eval", {}))


def run_extrapolation(p: dict, th: dict, ctx: Context) -> dict:
    from ssmcraft.layers.mitigation import Mitigation

    rows, curves, all_metrics = [], {}, []
    per_seed: dict[tuple[str, str], list[dict]] = {}
    for obj in p["objectives"]:
        for seed in p["seeds"]:
            metrics, run_dir = train_cell(ctx, p["experiment"], f"{obj}/s{seed}", objective=obj, seed=seed)
            all_metrics.append(metrics)
            if metrics.get("status") in ("error", "diverged"):
                per_seed.setdefault((obj, "plain"), []).append({"refused": f"training {metrics.get('status')}: "
                                                                           f"{metrics.get('reason')}"})
                continue
            settings = [("plain", None)] + [(t, Mitigation.parse(t)) for t in p["mitigations"]]
            for label, mit in settings:
                s = eval_cell(ctx, run_dir, label, _eval_options(p, mit))
                if "refused" in s:
                    per_seed.setdefault((obj, label), []).append(s)
                    continue
                key = "plain" if mit is None else mit.label()
                c = s["loss_by_position"]["curves"][key]
                st = s["state"].get(key) if isinstance(s.get("state"), dict) else None
                per_seed.setdefault((obj, label), []).append(
                    {"within": c["loss_within_train_len"], "beyond": c["extrapolation_loss"],
                     "exploded": None if st is None else st["exploded"],
                     "flags": 0 if st is None else len(st["flags"])})
                if seed == p["seeds"][0]:
                    curves[(obj, label)] = (c["positions"], c["loss"])
    L = p["experiment"]["task"].get("seq_len")
    for (obj, label), results in per_seed.items():
        ok = [r for r in results if "refused" not in r]
        if not ok:
            rows.append({"objective": obj, "setting": label, "refused": results[0]["refused"], "within": None,
                         "beyond": None, "exploded": None})
            continue
        within = V.mean_std([r["within"] for r in ok])
        beyond = V.mean_std([r["beyond"] for r in ok])
        exploded_flags = [r["exploded"] for r in ok if r["exploded"] is not None]
        rows.append({"objective": obj, "setting": label, "refused": None, "within": within[0], "beyond": beyond[0],
                     "beyond_std": beyond[1], "ratio": (beyond[0] / within[0]) if within[0] and beyond[0] else None,
                     "exploded": any(exploded_flags) if exploded_flags else None,    # None: not traced (window)
                     "explosion_flags": sum(r["flags"] for r in ok), "seeds": len(ok)})
    plt = _plt()
    plots = []
    for mode in ("plain", "mitigated"):
        keys = [k for k in curves if (k[1] == "plain") == (mode == "plain")]
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for obj, label in keys:
            xs, ys = curves[(obj, label)]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], label=f"{obj} ({label})")
        if L:
            ax.axvline(L, color="gray", ls=":", label="training length")
        ax.set_xlabel("position")
        ax.set_ylabel("loss (nats/byte)")
        ax.set_title(f"loss by position to {p['extrapolate']}x L ({mode})")
        ax.legend(fontsize=7)
        plots.append(_save(fig, ctx.out / f"loss_by_position_{mode}.png"))
    verdicts = V.extrapolation(rows, th["max_ratio"], th["improve_tol"], len(p["seeds"]))
    refusals = [f"{r['objective']} {r['setting']}: {r['refused']}" for r in rows if r.get("refused")]
    return {"tables": [{"title": f"Loss within L vs in the last L of {p['extrapolate']}x L", "rows": rows,
                        "columns": ["objective", "setting", "within", "beyond", "beyond_std", "ratio", "exploded",
                                    "explosion_flags", "seeds", "refused"]}],
            "plots": plots, "verdicts": verdicts, "device": _device_of(all_metrics),
            "notes": ["refused (recorded, not run): " + r for r in refusals],
            "data": {"rows": rows, "train_len": L}}


# ------------------------------------------------------------------ 4. state capacity

def run_state_capacity(p: dict, th: dict, ctx: Context) -> dict:
    obj = p["objective"]
    raw, all_metrics, points = [], [], {}
    for m in p["state_sizes"]:
        by_len: dict[int, bool | None] = {}
        for L in p["train_lengths"]:
            flags = []
            # tokens_per_batch: the same tokens per step at every L (batch = tokens_per_batch // L), so
            # every length sees the same number of steps and tokens (Stuffed Mamba's protocol)
            batch = max(1, p["tokens_per_batch"] // L) if p.get("tokens_per_batch") else None
            for seed in p["seeds"]:
                metrics, run_dir = train_cell(ctx, p["experiment"], f"m{m}/L{L}/s{seed}", objective=obj, seed=seed,
                                              m=m, seq_len=L, batch_size=batch)
                all_metrics.append(metrics)
                exploded = None
                if metrics.get("status") not in ("error", "diverged"):
                    s = eval_cell(ctx, run_dir, "plain", _eval_options(p))
                    if "refused" not in s and isinstance(s.get("state"), dict) and "plain" in s["state"]:
                        exploded = bool(s["state"]["plain"]["exploded"])
                raw.append({"m": m, "train_len": L, "seed": seed, "status": metrics.get("status"),
                            "val_loss": metrics.get("val_loss"), "exploded": exploded})
                flags.append(exploded)
            known = [f for f in flags if f is not None]
            by_len[L] = None if not known else any(known)       # any seed exploding counts
        points[m] = V.min_safe_length(by_len)
    verdict, fit = V.state_capacity(points, int(th["min_points"]), th["min_r2"], len(p["seeds"]))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    have = [(m, L) for m, L in points.items() if L is not None]
    ax.scatter([m for m, _ in have], [L for _, L in have], label="shortest explosion-free L")
    cens = [m for m, L in points.items() if L is None]
    if cens:
        top = max(p["train_lengths"])
        ax.scatter(cens, [top] * len(cens), marker="^", color="red", label=f"> {top} (not reached)")
    if fit["slope"] is not None:
        xs = sorted(points)
        ax.plot(xs, [fit["slope"] * x + fit["intercept"] for x in xs], "--",
                label=f"fit L = {fit['slope']:.3g} m + {fit['intercept']:.3g} (R² {fit['r2']:.2f})")
    ax.set_xlabel("state size m")
    ax.set_ylabel("training length")
    ax.set_title(f"state capacity ({obj})")
    ax.legend(fontsize=7)
    plots = [_save(fig, ctx.out / "state_capacity.png")]
    rows = [{"m": m, "shortest_explosion_free_len": L} for m, L in points.items()]
    return {"tables": [{"title": "Shortest training length with no state explosion", "rows": rows,
                        "columns": ["m", "shortest_explosion_free_len"]},
                       {"title": "Every run", "rows": raw,
                        "columns": ["m", "train_len", "seed", "status", "val_loss", "exploded"]}],
            "plots": plots, "verdicts": [verdict], "device": _device_of(all_metrics),
            "notes": [f"fit: {fit}", "a length counts as explosion-free when no seed's run at it, nor at any "
                      "longer tested length, flags an explosion (ssmcraft.train.state_stats rule)"],
            "data": {"points": {str(m): L for m, L in points.items()}, "fit": fit, "runs": raw}}


# ------------------------------------------------------------------ 5. composed search

def run_composed_search(p: dict, th: dict, ctx: Context, base: Path) -> dict:
    import optuna

    from ssmcraft.runtime.lookup import compile_objective
    from ssmcraft.search import reports
    from ssmcraft.search.coordinator import run_search
    from ssmcraft.search.executor import InlineExecutor
    from ssmcraft.search.spec import load_search_spec
    from ssmcraft.search.trial import train_trial

    raw = copy.deepcopy(p["search"])
    if ctx.device != "auto":
        res = raw.setdefault("resources", {})
        if ctx.device == "cpu":
            res["gpus_per_trial"] = 0
        elif not res.get("gpus_per_trial"):
            res["gpus_per_trial"] = 1
    spec = load_search_spec(raw, source="study search", base=base)
    if p["executor"] == "ray":
        from ssmcraft.search.executor_ray import RayExecutor

        executor = RayExecutor("local")
    else:
        executor = InlineExecutor()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    result = run_search(spec, ctx.out / "search", executor=executor, trial_fn=train_trial,
                        compile_fn=compile_objective, plots=True, log=ctx.say)
    table = reports.rows(result.study)
    metric_cols = [f"metric.{m}" for m in spec.metrics]
    leave_out = list(p.get("leave_out") or [])
    library, fingerprints, derived = _library() - set(leave_out), {}, {}
    for r in table:      # library membership by derived update, not by name
        r["same_as"] = library_match(r, library, compile_objective, fingerprints, derived)
        r["in_library"] = r["same_as"] is not None
    front = [r for r in table if r["pareto"]]
    novel = [r for r in table if r["rank"] is not None and not r["in_library"]]
    best = novel[0] if novel else None
    update_text, notes = None, []
    if best is not None and best.get("objective_spec"):
        compiled = compile_objective(json.loads(best["objective_spec"]))
        update_text = str(compiled.update)
        write_text(ctx.out / "best_composed_update.txt",
                   f"# trial {best['trial']}: {best['objective']}\n"
                   f"# {json.loads(best['objective_spec']).get('objective')}\n{update_text}\n")
        notes.append(f"best non-library objective: trial {best['trial']} {best['objective']} (rank {best['rank']}, "
                     f"{'on' if best['pareto'] else 'not on'} the Pareto front); derived update in "
                     "best_composed_update.txt and below")
    plt = _plt()
    plots = []
    if len(spec.metrics) >= 2:
        done = [r for r in table if r["rank"] is not None]
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in done:
            x, y = r.get(metric_cols[1]), r.get(metric_cols[0])
            if x is None or y is None:
                continue
            ax.scatter(x, y, color="tab:red" if r["pareto"] else "tab:gray",
                       marker="*" if not r["in_library"] else "o", s=60)
            ax.annotate(r["objective"], (x, y), fontsize=6)
        ax.set_xlabel(spec.metrics[1])
        ax.set_ylabel(spec.metrics[0])
        ax.set_title("trials (red: Pareto front, *: not in the library)")
        plots.append(_save(fig, ctx.out / "pareto.png"))
    device = next((r.get("metric.device") for r in table if r.get("metric.device")), None)
    result_tables = [{"title": "Pareto front", "rows": front,
                      "columns": ["rank", "trial", "objective", "same_as", *metric_cols, "state_bytes"]},
                     {"title": "All finished trials (same_as: the library layer whose derived update it is)",
                      "rows": table, "columns": ["rank", "trial", "status", "objective", "same_as", "pareto",
                                                 *metric_cols, "reason"]}]
    if update_text:
        notes.append("derived update of the best non-library objective:\n\n```\n" + update_text + "\n```")
    verdicts = [V.composed_search(front)]
    rediscovery = None
    if leave_out:
        result_tables.insert(0, _rediscovery_table(spec, table, leave_out, compile_objective, derived))
        rediscovery = result_tables[0]["rows"]
        verdicts.append(V.rediscovery(rediscovery))
    confirm_rows = []
    if p.get("confirm") and best is not None:
        confirm_rows = confirm_on_other_task(ctx, p, best, next((r for r in table if r["rank"] is not None
                                                                  and r["in_library"]), None))
        task = p["confirm"]["task"].get("name")
        result_tables.append({"title": f"Confirmation on {task} (same model and budget for both)",
                              "rows": confirm_rows, "columns": ["objective", "in_library", "m", "val_loss_mean",
                                                                "val_loss_std", "accuracy_mean", "seeds",
                                                                "tokens_per_s"]})
    return {"tables": result_tables, "plots": plots, "verdicts": verdicts,
            "notes": notes, "device": device or executor_device(result),
            "data": {"front": front, "best_non_library": best, "update": update_text, "counts": result.counts,
                     "search_dir": "search", "confirm": confirm_rows, "leave_out": leave_out,
                     "rediscovery": rediscovery}}


def _rediscovery_table(spec, table: list[dict], leave_out: list[str], compile_fn, derived: dict) -> dict:
    """Leave-one-out: for each layer left out of the library, the odds that the space holds it
    (a census of every objective the space can select, derived) next to what the search did."""
    targets = {name: fingerprint_of(name, compile_fn, derived) for name in leave_out}
    census = space_census(spec, targets, compile_fn, derived)
    found = rediscoveries(table, targets, compile_fn, derived)
    ranked = sum(1 for r in table if r["rank"] is not None)
    rows = census_rows(census, found, len(table), ranked)
    for r in rows:
        r["space_variants"] = census["variants"]
    return {"title": f"Leave-one-out rediscovery (left out of the library: {', '.join(leave_out)}; the space "
                     f"selects {census['variants']} distinct objectives, {census['underivable']} of which do not derive)",
            "rows": rows, "columns": ["left_out", "variants_in_space", "p_per_uniform_trial", "uniform_expected_trials",
                                      "p_uniform_within_budget", "rediscovered", "first_drawn", "first_trained",
                                      "times_drawn", "times_trained", "best_rank", "of_ranked", "on_front"]}


def confirm_on_other_task(ctx: Context, p: dict, novel: dict, library_best: dict | None) -> list[dict]:
    """Train the best non-library objective and the best library one (by search rank) on the
    ``confirm`` experiment (the other task: byte-level text after an MQAR search, MQAR after a
    text search), each at its trial's state size, ``confirm_seeds`` seeds."""
    rows = []
    for r in (novel, library_best):
        if r is None:
            continue
        obj = json.loads(r["objective_spec"]) if not r["in_library"] else (r["same_as"] or r["objective"])
        m = r.get("param.m")
        losses, speeds, accs = [], [], []
        for seed in p["confirm_seeds"]:
            metrics, _ = train_cell(ctx, p["confirm"], f"confirm/{r['objective']}/s{seed}", objective=obj, seed=seed,
                                    m=int(m) if m is not None else None)
            losses.append(metrics.get("val_loss"))
            speeds.append(metrics.get("tokens_per_s"))
            accs.append(metrics.get("accuracy"))
        mean, std, n = V.mean_std(losses)
        rows.append({"objective": r["objective"], "in_library": r["in_library"], "m": m,
                     "val_loss_mean": mean, "val_loss_std": std, "seeds": n,
                     "accuracy_mean": V.mean_std(accs)[0], "tokens_per_s": V.mean_std(speeds)[0]})
    return rows


def _library() -> set[str]:
    from ssmcraft.compiler.library import library_names

    return set(library_names())


def library_match(row: dict, library: set[str], compile_fn, fingerprints: dict, cache: dict | None = None) -> str | None:
    """The library layer a trial's objective is (by name, or by derived update), or None.
    ``fingerprints`` (update fingerprint -> library name) is filled on first use; pass the same
    dict for every row of a table (and the same ``cache`` of derived fingerprints)."""
    if row.get("objective") in library:
        return row["objective"]
    if not row.get("objective_spec"):
        return None
    if not fingerprints:
        for name in sorted(library):
            fp = fingerprint_of(name, compile_fn, cache)
            if fp is not None:
                fingerprints[fp] = name
    return fingerprints.get(row_fingerprint(row, compile_fn, cache))


def executor_device(result) -> str:
    return result.executor


# ------------------------------------------------------------------ MAD's protocol

def run_mad(p: dict, th: dict, ctx: Context) -> dict:
    """MAD's protocol over ``objectives``: every (task, level) of ``spec.mad_cells``, each learning
    rate and seed; a level's accuracy is that of its best learning rate (mean over seeds), a task's
    score the mean over its levels, the MAD score the mean over the tasks (``tasks.mad.levels``).
    ``state_size`` fixes ``m`` of every objective (MAD compares at the same state size)."""
    from ssmcraft.study.spec import mad_cells
    from ssmcraft.tasks.mad import task_score

    cells = mad_cells(p)
    level_rows, score_rows, raw, all_metrics = [], [], [], []
    for obj in p["objectives"]:
        accs: dict[str, dict[str, float]] = {}
        state = None
        m = p["state_size"] if p["state_elements"] is None else iso_state_size(p["model"], obj, p["state_elements"])
        for task, label, task_cfg in cells:
            exp = {"task": task_cfg, "model": p["model"], "train": p["train"]}
            by_lr: dict[float, list[dict]] = {}
            for lr in p["lrs"]:
                for seed in p["seeds"]:
                    rel = f"{obj}/{task}/{label}/lr{_lr_tag(lr)}/s{seed}"
                    metrics, _ = train_cell(ctx, exp, rel, objective=obj, seed=seed, m=m, lr=lr)
                    all_metrics.append(metrics)
                    by_lr.setdefault(lr, []).append(metrics)
                    raw.append({"objective": obj, "task": task, "level": label, "lr": lr, "seed": seed,
                                "status": metrics.get("status"), "accuracy": metrics.get("accuracy")})
                    state = state if state is not None else metrics.get("state_bytes")
            mean = {lr: V.mean_std([x.get("accuracy") for x in runs])[0] for lr, runs in by_lr.items()}
            best = max(mean, key=lambda lr: -1.0 if mean[lr] is None else mean[lr])
            accs.setdefault(task, {})[label] = mean[best] or 0.0
            level_rows.append({"objective": obj, "task": task, "level": label, "best_lr": best,
                               "accuracy": mean[best]})
        scores = {task: task_score(accs[task], task, list(accs[task])) for task in p["tasks"]}
        score_rows.append({"objective": obj, "m": m, "state_bytes": state, **scores,
                           "mad_score": sum(scores.values()) / len(scores)})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.2 * (len(p["tasks"]) + 1) + 2, 3.5))
    columns = [*p["tasks"], "mad_score"]
    width = 0.8 / max(1, len(score_rows))
    for i, row in enumerate(score_rows):
        ax.bar([c + i * width for c in range(len(columns))], [row[c] for c in columns], width, label=row["objective"])
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(columns))], columns, rotation=30, ha="right", fontsize=7)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("accuracy (mean over levels)")
    ax.legend(fontsize=7)
    ax.set_title("MAD scores")
    plots = [_save(fig, ctx.out / "mad_scores.png")]
    notes = [f"levels: {p['levels']} ({len(cells)} task configurations per objective); a level's accuracy is its "
             "best learning rate's, mean over the seeds that finished; a level where every run failed counts as accuracy 0"]
    if p["state_size"] is not None:
        notes.append(f"every objective at state_size m = {p['state_size']} (state_bytes: fp32 state per sequence)")
    if p["state_elements"] is not None:
        notes.append(f"iso-state: each objective's m is the largest whose model carries at most {p['state_elements']} "
                     "numbers of state per sequence (LM.state_elements); attention's cache grows with the context")
    return {"tables": [{"title": "MAD score per objective (mean accuracy over levels, then over tasks)",
                        "rows": score_rows, "columns": ["objective", "m", "state_bytes", *p["tasks"], "mad_score"]},
                       {"title": "Accuracy per level (best learning rate)", "rows": level_rows,
                        "columns": ["objective", "task", "level", "best_lr", "accuracy"]},
                       {"title": "Every run", "rows": raw,
                        "columns": ["objective", "task", "level", "lr", "seed", "status", "accuracy"]}],
            "plots": plots, "verdicts": [], "notes": notes, "device": _device_of(all_metrics),
            "data": {"scores": score_rows, "levels": level_rows}}


# ------------------------------------------------------------------ challengers against baselines at equal state

# the two tasks of an ``equal_state`` study: (metric, higher is better, threshold)
EQUAL_STATE_TASKS = {"mqar": ("accuracy", True, "acc_tol"), "text": ("val_loss", False, "loss_tol")}


def run_equal_state(p: dict, th: dict, ctx: Context) -> dict:
    """Every challenger and baseline on MQAR and on bytes, each at the largest ``m`` whose model
    carries at most ``state_elements[task]`` numbers of state (``iso_state_size``: every state
    counted), ``seeds`` seeds each at the experiment's own learning rate (``overrides[label]`` merged
    over both tasks' experiments for that objective). Each challenger is
    compared with each baseline paired by seed (``verdict.paired``); the claim per task is that
    some challenger beats every baseline (``verdict.beats_all``)."""
    from ssmcraft.study.spec import experiment_for, objective_label, objective_value

    roles = [("challenger", o) for o in p["challengers"]] + [("baseline", o) for o in p["baselines"]]
    rows, raw, pair_rows, verdicts, all_metrics = [], [], [], [], []
    values: dict[str, dict[str, dict[int, float | None]]] = {}
    for task, (metric, higher, tol_key) in EQUAL_STATE_TASKS.items():
        for role, entry in roles:
            label, obj = objective_label(entry), objective_value(entry)
            exp = experiment_for(p[task], p["overrides"], label)
            m = iso_state_size(exp["model"], obj, p["state_elements"][task])
            got = values.setdefault(task, {}).setdefault(label, {})
            runs = []
            for seed in p["seeds"]:
                metrics, _ = train_cell(ctx, exp, f"{task}/{label}/s{seed}", objective=obj, seed=seed, m=m)
                all_metrics.append(metrics)
                runs.append(metrics)
                got[seed] = metrics.get(metric)
                raw.append({"task": task, "objective": label, "seed": seed, "m": m, "status": metrics.get("status"),
                            metric: metrics.get(metric), "tokens_per_s": metrics.get("tokens_per_s"),
                            "reason": metrics.get("reason")})
            mean, std, n = V.mean_std(list(got.values()))
            first = next((r for r in runs if r.get("state_bytes")), {})
            rows.append({"task": task, "objective": label, "role": role, "m": m,
                         "state_bytes": first.get("state_bytes"), "metric": metric, "mean": mean, "std": std,
                         "seeds": n, "solved": _solved(got.values()) if task == "mqar" else None,
                         "tokens_per_s": V.mean_std([r.get("tokens_per_s") for r in runs])[0]})
        pairs = {}
        for c in p["challengers"]:
            cl = objective_label(c)
            for b in p["baselines"]:
                bl = objective_label(b)
                r = V.paired(values[task][cl], values[task][bl], th[tol_key], higher, p["resamples"])
                pairs.setdefault(cl, {})[bl] = r
                pair_rows.append({"task": task, "challenger": cl, "baseline": bl, **r})
        names = ", ".join(objective_label(b) for b in p["baselines"])
        what = "MQAR accuracy" if task == "mqar" else "byte-level validation loss (nats/byte)"
        verdicts.append(V.beats_all(f"on {what} at equal state (every state counted), a second-order or "
                                    f"mini-batch learner beats every baseline ({names})", pairs, metric))
    plots = [_equal_state_plot(ctx, values, rows)]
    notes = [f"iso-state: on each task every objective runs at the largest m whose model carries at most "
             f"state_elements = {p['state_elements']} numbers of state per sequence (every state counted, "
             "square and MLP states included); state_bytes is that state in fp32",
             "paired: seed s of a challenger against seed s of a baseline (same data order and initialisation "
             f"seed); a comparison is better/worse when the mean advantage passes the threshold and its 95% "
             f"percentile bootstrap interval ({p['resamples']} resamples) excludes 0; the confidence is the one-sided "
             "sign test of the deciding comparisons (high: p <= 0.05, medium: p <= 0.2)"]
    return {"tables": [{"title": "Mean ± sample std over seeds at equal state", "rows": rows,
                        "columns": ["task", "objective", "role", "m", "state_bytes", "metric", "mean", "std",
                                    "solved", "seeds", "tokens_per_s"]},
                       {"title": "Paired comparisons (advantage of the challenger; positive is better)",
                        "rows": pair_rows, "columns": ["task", "challenger", "baseline", "n", "mean_diff", "ci_low",
                                                       "ci_high", "wins", "losses", "p_better", "p_worse", "outcome"]},
                       {"title": "Every run", "rows": raw,
                        "columns": ["task", "objective", "seed", "m", "status", "accuracy", "val_loss",
                                    "tokens_per_s", "reason"]}],
            "plots": plots, "verdicts": verdicts, "notes": notes, "device": _device_of(all_metrics),
            "data": {"values": {t: {o: {str(s): v for s, v in by.items()} for o, by in objs.items()}
                                for t, objs in values.items()}, "pairs": pair_rows, "runs": raw}}


def _equal_state_plot(ctx: Context, values: dict, rows: list[dict]) -> str:
    """Per task, every seed's number per objective (dots) and the mean (bar)."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(values), figsize=(5 * len(values), 3.6))
    for ax, (task, objs) in zip(list(axes) if len(values) > 1 else [axes], values.items()):
        names = list(objs)
        for i, name in enumerate(names):
            xs = [v for v in objs[name].values() if v is not None]
            role = next(r["role"] for r in rows if r["task"] == task and r["objective"] == name)
            ax.bar(i, V.mean_std(xs)[0] or 0, color="tab:orange" if role == "challenger" else "tab:blue", alpha=0.6)
            ax.plot([i] * len(xs), xs, "k.", ms=4)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
        ax.set_title(f"{task}: {EQUAL_STATE_TASKS[task][0]} (orange: challengers)", fontsize=9)
    return _save(fig, ctx.out / "equal_state.png")


RUNNERS = {"mqar_state_size": run_mqar_state_size, "exact_vs_diagonal": run_exact_vs_diagonal,
           "extrapolation": run_extrapolation, "state_capacity": run_state_capacity,
           "composed_search": run_composed_search, "mad": run_mad,
           "equal_state": run_equal_state}
