"""One training run: ``train_run(config, out_dir) -> metrics``.

AdamW (weight decay on linear/embedding matrices only), linear warmup + cosine decay,
global-norm gradient clipping, bf16 autocast on CUDA, a token budget and an optional
wall-clock limit, periodic validation on a fixed validation set (``train.val_seed``, the
same for every run seed, so runs compare on the same data).

``metrics.json`` (also the return value; NaN/inf are written as null):

    status             "ok" | "diverged" (non-finite loss or gradient) | "timeout" (hit
                       train.max_seconds before the token budget) | "pruned" (the
                       ``report`` callback asked to stop)
    reason             why a run did not finish as "ok" (else null)
    val_loss           final validation loss (null when diverged)
    train_loss_first   loss of the first step; train_loss_last: mean of the last 20 steps
    tokens, steps      consumed input tokens (batch_size * seq_len per step) and steps
    tokens_per_s       tokens / time spent in training steps (validation excluded)
    wall_s, train_s    whole run / training steps only
    peak_memory_bytes  with peak_memory_kind (cuda_max_allocated | process_max_rss)
    backend            the recurrence paths the mixers ran (``obj.backend``)
    accuracy, chance_accuracy, ...   the task's validation metrics (MQAR, passkey)
    objective, structure, n_params, device, precision, seed, task (its description)

A divergence is caught before the optimizer step, so the saved weights are the last
finite ones.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ssmcraft.errors import SpecError
from ssmcraft.layers import LM
from ssmcraft.layers.objectives import compile_objective, spec_mapping
from ssmcraft.layers.config import AttentionConfig, mixer_config
from ssmcraft.tasks import build_task
from ssmcraft.train import checkpoint, plots
from ssmcraft.train.config import resolve
from ssmcraft.train.device import autocast, peak_memory, pick_device, pick_precision, reset_peak_memory
from ssmcraft.train.schedule import lr_at, warmup_steps
from ssmcraft.train.validate import batch_loss, evaluate

log = logging.getLogger("ssmcraft.train")


def build_model(config: dict[str, Any]) -> LM:
    """The LM of a resolved config whose ``model.vocab_size`` is set.

    Mutates ``config["model"]["mixer"]``: ``objective`` (a name or path) is replaced by the
    compiled spec's mapping, so the recorded config rebuilds the same model anywhere.
    ``train.backend`` other than ``auto`` forces the objective's recurrence path.
    """
    mixer = config["model"]["mixer"]
    objective = None
    if not isinstance(mixer_config(mixer), AttentionConfig):
        objective = compile_objective(mixer.get("objective", "longhorn"))
        mixer["objective"] = spec_mapping(objective)
        backend = config["train"]["backend"]
        if backend != "auto":
            objective.prefer = backend
            log.info("recurrence path forced: %s", backend)
    return LM(checkpoint.model_config(config), objective)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights of linear layers and the embedding; not biases, norms, conv, skip or
    the objective's own params (``raw_params``)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim == 2 and "raw_params" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class _RunLog:
    """Adds a file handler for ``DIR/train.log`` to the ssmcraft logger for one run."""

    def __init__(self, out_dir: Path):
        self.handler = logging.FileHandler(out_dir / "train.log", mode="w")
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self.logger = logging.getLogger("ssmcraft")

    def __enter__(self):
        self.old_level = self.logger.level
        if self.logger.getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.old_level)
        self.handler.close()


def train_run(config: Mapping[str, Any], out_dir: str | Path, progress: bool = False,
              source: str = "<experiment>", report: Callable[[int, dict], bool] | None = None) -> dict[str, Any]:
    """Train one model as ``config`` (an experiment mapping) says; write DIR; return the metrics.

    ``progress``: show a tqdm bar (only when stderr is a terminal).
    ``report``: called after each periodic validation as ``report(step, values)`` with
    ``values`` named as in the final metrics (``val_loss``, ``accuracy``, ..., ``tokens``);
    returning True stops the run with status ``pruned`` (the metrics are those of that
    validation).
    User errors (bad config, unknown objective) raise ``SsmcraftError``; a diverging run
    does not raise, it reports ``status: "diverged"``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = resolve(config, source)
    with _RunLog(out):
        return _train(cfg, out, progress, source, report)


def _train(cfg: dict[str, Any], out: Path, progress: bool, source: str, report) -> dict[str, Any]:
    t_start = time.perf_counter()
    tc = cfg["train"]
    if tc["threads"]:
        torch.set_num_threads(int(tc["threads"]))
    device = pick_device(tc["device"])
    precision = pick_precision(tc["precision"], device)
    amp = lambda: autocast(device, precision)  # noqa: E731
    task = build_task(cfg["task"], source)
    if cfg["model"]["vocab_size"] is None:
        cfg["model"]["vocab_size"] = task.vocab_size
    elif cfg["model"]["vocab_size"] < task.vocab_size:
        raise SpecError(source, "model.vocab_size", f"{cfg['model']['vocab_size']} is smaller than the task's "
                        f"vocabulary {task.vocab_size}")
    torch.manual_seed(cfg["seed"])
    model = build_model(cfg).to(device)
    checkpoint.write_json(out / checkpoint.CONFIG, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("run %s: %s, %d params, device %s, precision %s", cfg["name"], model.mixers[0].describe().get(
        "objective", "attention"), n_params, device, precision)

    steps = max(1, tc["tokens"] // (tc["batch_size"] * task.seq_len))
    warm = warmup_steps(tc["warmup"], steps)
    opt = torch.optim.AdamW(param_groups(model, tc["weight_decay"]), lr=tc["lr"], betas=tuple(tc["betas"]),
                            **({"fused": True} if device.type == "cuda" else {}))
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    val_batches = task.fixed_batches("val", tc["eval_batches"], tc["eval_batch_size"], seed=tc["val_seed"])
    history: dict[str, list] = {"train": [], "val": []}
    status, reason, step = "ok", None, 0
    train_s, tokens = 0.0, 0
    reset_peak_memory(device)
    bar = _progress_bar(steps) if progress and sys.stderr.isatty() else None
    model.train()
    for step in range(steps):
        if tc["max_seconds"] is not None and train_s >= tc["max_seconds"]:
            status, reason = "timeout", f"train.max_seconds={tc['max_seconds']} reached after {step} of {steps} steps"
            break
        t0 = time.perf_counter()
        lr = lr_at(step, steps, tc["lr"], warm, tc["min_lr_ratio"])
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, targets = (t.to(device, non_blocking=True) for t in task.sample("train", tc["batch_size"], None, gen))
        loss_value, grad_norm, problem = _optimizer_step(model, opt, inputs, targets, amp, tc["grad_clip"])
        if problem is not None:
            status, reason = "diverged", f"{problem} at step {step}"
            break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_s += time.perf_counter() - t0
        tokens += inputs.numel()
        history["train"].append({"step": step, "tokens": tokens, "loss": loss_value, "lr": lr,
                                 "grad_norm": grad_norm})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens / max(train_s, 1e-9):.0f}")
        if tc["eval_every"] and (step + 1) % tc["eval_every"] == 0 and step + 1 < steps:
            last_val = _validate(model, task, val_batches, device, amp, history, step, tokens)
            if report is not None and report(step + 1, _report_values(last_val, tokens)):
                status, reason = "pruned", f"stopped by the report callback after step {step + 1}"
                break
    if bar is not None:
        bar.close()
    if status == "pruned":
        final = last_val
        log.info("run %s pruned after step %d", cfg["name"], step + 1)
    elif status != "diverged":
        final = _validate(model, task, val_batches, device, amp, history, step, tokens)
    else:
        final = {"loss": None}
        log.warning("run %s diverged: %s", cfg["name"], reason)
    metrics = _metrics(cfg, model, task, history, final, status, reason, tokens, train_s, t_start, device,
                       precision, n_params)
    _write_outputs(cfg, model, history, metrics, out)
    return metrics


def _optimizer_step(model, opt, inputs, targets, amp, grad_clip: float) -> tuple[float, float, str | None]:
    """One AdamW step on ``(inputs, targets)`` ``[B, T]``: (loss, gradient norm, problem).

    ``problem`` names a non-finite loss or gradient; then no update is applied, so the
    weights stay the last finite ones.
    """
    with amp():
        logits = model(inputs)
    loss = batch_loss(logits, targets)
    loss_value = float(loss.detach())
    if not math.isfinite(loss_value):
        return loss_value, float("nan"), f"training loss is {loss_value}"
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf")))
    if not math.isfinite(grad_norm):
        return loss_value, grad_norm, f"gradient norm is {grad_norm}"
    opt.step()
    return loss_value, grad_norm, None


def _progress_bar(steps: int):
    from tqdm import tqdm

    return tqdm(total=steps, unit="step", dynamic_ncols=True, file=sys.stderr)


def _validate(model, task, batches, device, amp, history, step, tokens) -> dict[str, float]:
    result = evaluate(model, task, batches, device, amp)
    history["val"].append({"step": step, "tokens": tokens, **result})
    extra = ", ".join(f"{k} {v:.3f}" for k, v in result.items() if k != "loss")
    log.info("step %d, %d tokens: val loss %.4f%s", step + 1, tokens, result["loss"], f", {extra}" if extra else "")
    return result


def _report_values(val: dict[str, float], tokens: int) -> dict[str, float]:
    """A validation result under the final metrics' names (``loss`` -> ``val_loss``)."""
    return {"val_loss": val["loss"], **{k: v for k, v in val.items() if k != "loss"}, "tokens": tokens}


def _metrics(cfg, model, task, history, final, status, reason, tokens, train_s, t_start, device, precision,
             n_params) -> dict[str, Any]:
    train = [r["loss"] for r in history["train"]]
    mem, mem_kind = peak_memory(device)
    mixer = model.mixers[0].describe()
    metrics = {
        "status": status, "reason": reason, "val_loss": final.get("loss"),
        "train_loss_first": train[0] if train else None,
        "train_loss_last": sum(train[-20:]) / len(train[-20:]) if train else None,
        "tokens": tokens, "steps": len(train),
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "wall_s": time.perf_counter() - t_start, "train_s": train_s,
        "peak_memory_bytes": mem, "peak_memory_kind": mem_kind,
        "backend": model.backends(), "objective": mixer.get("objective", "attention"),
        "structure": mixer.get("structure"), "n_params": n_params, "device": str(device),
        "precision": precision, "seed": cfg["seed"], "task": task.describe(), "mixer": mixer,
    }
    metrics.update({k: v for k, v in final.items() if k != "loss"})
    return metrics


def _write_outputs(cfg, model, history, metrics, out: Path) -> None:
    checkpoint.write_json(out / checkpoint.HISTORY, history)
    if cfg["train"]["save_model"]:
        checkpoint.save_weights(model, out)
    plots.loss_curve(history, out / "loss.png", title=f"{cfg['name']} ({metrics['objective']})")
    checkpoint.write_json(out / checkpoint.METRICS, metrics)
    log.info("run %s: status %s, val loss %s, %.0f tokens/s, %.1f s", cfg["name"], metrics["status"],
             "n/a" if metrics["val_loss"] is None else f"{metrics['val_loss']:.4f}",
             metrics["tokens_per_s"] or 0.0, metrics["wall_s"])
