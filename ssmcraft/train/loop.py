"""One training run: ``train_run(config, out_dir) -> metrics``.

AdamW (weight decay on linear/embedding matrices only), linear warmup + cosine decay,
global-norm gradient clipping, bf16 autocast on CUDA, a token budget and an optional
wall-clock limit, periodic validation on a fixed validation set (``train.val_seed``, the
same for every run seed, so runs compare on the same data).

Kept off the host's critical path (issue 13), so that small runs keep a GPU busy:

- batches are built on the training device from a generator seeded per run
  (``train.data_on_device``; false: built on the host and copied, the issue-5 behaviour);
  the validation batches are built on the host from ``val_seed`` (the same on every
  device) and moved once;
- loss and gradient norm stay on the device and are read back every ``train.log_every``
  steps, one transfer (1: a sync every step); a non-finite value is found at the
  read-back and the run ends ``diverged`` at the step where it first occurred, the
  reason saying how many steps later it was seen; a sticky device flag makes the fused
  AdamW skip that step and every later one, so the weights are the last finite ones;
- ``train.cuda_graphs`` (auto: on for CUDA unless ``train.compile`` is true) replays the
  forward, loss and backward from CUDA graphs (``ssmcraft.train.graphed``); or
  ``train.compile`` (auto: on for CUDA only with ``train.cuda_graphs: false``) compiles the LM
  around the recurrence (``ssmcraft.train.compiled``); evaluation sums on the device and
  reads back once;
- ``train.autograd_threads: false`` runs the backward on the training thread
  (``torch.autograd.set_multithreading_enabled(False)`` around each step's backward) instead of
  handing it to the autograd engine's device thread (PyTorch's default, kept: one pass on one lent
  H200 moved the eager step both ways, and graphed steps not at all; BENCHMARKS.md, "Training
  throughput (issue 12, item 3)").

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
    peak_memory_bytes  with peak_memory_kind (cuda_max_allocated | process_max_rss);
                       peak_memory_reserved_bytes: the CUDA allocator's peak (null off CUDA)
    compile            train.compile's record: setting, enabled, reason (and a fallback's)
    cuda_graphs        train.cuda_graphs' record: setting, enabled, reason (and a fallback's),
                       graphed_steps / eager_steps: the steps each way (all eager without graphs,
                       after a failed capture, and for a batch of another shape)
    autograd_threads   the train.autograd_threads setting
    data_device, log_every   where batches were built; steps between host read-backs
    first_step_s       the first training step (compile, kernel JIT), also counted in train_s
    steady_tokens_per_s  the rate after the first step (no compile or JIT time; null with one step)
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

from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.layers import LM
from ssmcraft.layers.objectives import compile_objective, spec_mapping
from ssmcraft.layers.config import ObjectiveMixerConfig, mixer_config
from ssmcraft.tasks import build_task
from ssmcraft.train import checkpoint, plots
from ssmcraft.train.compiled import compile_model, run_compiled_step
from ssmcraft.train.config import resolve
from ssmcraft.train.device import autocast, peak_memory, peak_reserved, pick_device, pick_precision, reset_peak_memory
from ssmcraft.train.graphed import capture_loss, graphs_decision
from ssmcraft.train.schedule import lr_at, warmup_steps
from ssmcraft.train.validate import evaluate, step_loss

log = logging.getLogger("ssmcraft.train")


def build_model(config: dict[str, Any], source: str = "<experiment>") -> LM:
    """The LM of a resolved config whose ``model.vocab_size`` is set.

    Mutates ``config["model"]["mixer"]``: ``objective`` (a name or path) is replaced by the
    compiled spec's mapping, so the recorded config rebuilds the same model anywhere.
    ``train.backend`` other than ``auto`` forces the objective's recurrence path. An objective
    that does not compile, or a mixer setting its objective or sizes refuse, is a ``SpecError``
    naming ``source`` and the mixer's key (``model.mixer.heads``, ``model.layers[1].mixer.heads``).
    """
    mixer = config["model"]["mixer"]
    objective = None
    if isinstance(mixer_config(mixer), ObjectiveMixerConfig):
        ref = mixer.get("objective", "longhorn")
        try:
            objective = compile_objective(ref)
        except SpecError as e:
            if e.source != "<dict>" or not isinstance(ref, Mapping):
                raise                      # names its own file already
            raise SpecError(source, f"model.mixer.objective.{e.key}" if e.key else "model.mixer.objective", e.problem) from None
        except SsmcraftError as e:
            raise SpecError(source, "model.mixer.objective", str(e)) from None
        mixer["objective"] = spec_mapping(objective)
        backend = config["train"]["backend"]
        if backend != "auto":
            objective.prefer = backend
            log.info("recurrence path forced: %s", backend)
    try:
        return LM(checkpoint.model_config(config), objective)
    except SpecError as e:
        if e.source != "<mixer>":
            raise
        raise SpecError(source, f"model.{e.key}", e.problem) from None


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
    threads = torch.get_num_threads()      # train.threads applies to this run only
    try:
        with _RunLog(out):
            return _train(cfg, out, progress, source, report)
    finally:
        torch.set_num_threads(threads)


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
    model = build_model(cfg, source).to(device)
    # an earlier run's results in this folder would sit beside this run's config: if this run is
    # stopped, eval and export would pair its config with the old weights (or the old metrics)
    stale = [f for f in (checkpoint.METRICS, checkpoint.HISTORY, checkpoint.WEIGHTS) if (out / f).exists()]
    for f in stale:
        (out / f).unlink()
    if stale:
        log.info("removed an earlier run's %s from %s", ", ".join(stale), out)
    checkpoint.write_json(out / checkpoint.CONFIG, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("run %s: %s (layers %s), %d params, device %s, precision %s", cfg["name"],
             model.describe()["mixer"].get("objective", "attention"), " ".join(model.layout_labels()), n_params,
             device, precision)

    steps = max(1, tc["tokens"] // (tc["batch_size"] * task.seq_len))
    warm = warmup_steps(tc["warmup"], steps)
    # fused AdamW on every device: it skips a step on the device-side flag (below), no sync
    opt = torch.optim.AdamW(param_groups(model, tc["weight_decay"]), lr=tc["lr"], betas=tuple(tc["betas"]),
                            fused=True)
    data_device = device if tc["data_on_device"] else torch.device("cpu")
    task.to(data_device)
    gen = torch.Generator(device=data_device).manual_seed(cfg["seed"] + 1)
    val_batches = [(x.to(device), y.to(device)) for x, y in  # the same on every device; moved once
                   task.fixed_batches("val", tc["eval_batches"], tc["eval_batch_size"], seed=tc["val_seed"])]
    train_model, compile_info = compile_model(model, tc["compile"], device, tc["cuda_graphs"])
    use_graphs, why = graphs_decision(tc["cuda_graphs"], device, compile_info["enabled"], source)
    graphs_info = {"setting": tc["cuda_graphs"], "enabled": use_graphs, "reason": why,
                   "graphed_steps": 0, "eager_steps": 0}
    log.info("CUDA graphs: %s", why)
    loss_fn = None          # the graphed forward+loss+backward, captured at the first step
    log.info("data built on %s; host read-back every %d step(s)", data_device, tc["log_every"])
    history: dict[str, list] = {"train": [], "val": []}
    status, reason, step = "ok", None, 0
    reset_peak_memory(device)
    bar = _progress_bar(steps) if progress and sys.stderr.isatty() else None
    model.train()
    readback = _ReadBack(device, history, bar, tc["log_every"])
    # fused AdamW skips its step while this is set (GradScaler's protocol); refreshed from
    # readback.stopped in place each step (_optimizer_step)
    opt.found_inf = torch.zeros((), dtype=torch.float32, device=device)
    t_loop, eval_s, first_step_s = time.perf_counter(), 0.0, None
    for step in range(steps):
        if tc["max_seconds"] is not None and time.perf_counter() - t_loop - eval_s >= tc["max_seconds"]:
            diverged = readback.flush()
            status, reason = ("diverged", diverged) if diverged else ("timeout", (
                f"train.max_seconds={tc['max_seconds']} reached after {readback.steps} of {steps} steps"))
            break
        lr = lr_at(step, steps, tc["lr"], warm, tc["min_lr_ratio"])
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, targets = (t.to(device, non_blocking=True) for t in task.sample("train", tc["batch_size"], None, gen))
        if graphs_info["enabled"] and step == 0:
            loss_fn = capture_loss(model, inputs, targets, device, precision, graphs_info)
        graphed = loss_fn if loss_fn is not None and loss_fn.fits(inputs, targets) else None
        graphs_info["graphed_steps" if graphed is not None else "eager_steps"] += 1

        def one_step(module):
            return _optimizer_step(module, opt, inputs, targets, amp, tc["grad_clip"], readback.stopped, graphed,
                                   engine_threads=tc["autograd_threads"])

        if step == 0 and train_model is not model:
            (loss, grad_norm), train_model = run_compiled_step(one_step, train_model, model, compile_info)
        else:
            loss, grad_norm = one_step(train_model)
        if step == 0:  # compile and kernel JIT happen here: timed on their own (one sync)
            _sync(device)
            first_step_s = time.perf_counter() - t_loop
        readback.add(step, inputs.numel(), lr, loss, grad_norm)
        evaluate_now = bool(tc["eval_every"]) and (step + 1) % tc["eval_every"] == 0 and step + 1 < steps
        diverged = readback.maybe_flush(now=step + 1 == steps or evaluate_now)
        if diverged:
            status, reason = "diverged", diverged
            break
        if evaluate_now:
            t_eval = time.perf_counter()
            last_val = _validate(model, task, val_batches, device, amp, history, step, readback.tokens)
            eval_s += time.perf_counter() - t_eval
            if report is not None and report(step + 1, _report_values(last_val, readback.tokens)):
                status, reason = "pruned", f"stopped by the report callback after step {step + 1}"
                break
    _sync(device)
    train_s = time.perf_counter() - t_loop - eval_s
    if bar is not None:
        bar.close()
    if status == "pruned":
        final = last_val
        log.info("run %s pruned after step %d", cfg["name"], step + 1)
    elif status != "diverged":
        final = _validate(model, task, val_batches, device, amp, history, step, readback.tokens)
    else:
        final = {"loss": None}
        log.warning("run %s diverged: %s", cfg["name"], reason)
    metrics = _metrics(cfg, model, task, history, final, status, reason, readback.tokens, train_s, t_start, device,
                       precision, n_params)
    steps = metrics["steps"]
    steady = (readback.tokens * (steps - 1) / steps / (train_s - first_step_s)
              if first_step_s is not None and steps > 1 and train_s > first_step_s else None)
    metrics.update(compile=compile_info, cuda_graphs=graphs_info, autograd_threads=tc["autograd_threads"],
                   data_device=str(data_device),
                   log_every=tc["log_every"], first_step_s=first_step_s, steady_tokens_per_s=steady)
    _write_outputs(cfg, model, history, metrics, out)
    return metrics


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _optimizer_step(model, opt, inputs, targets, amp, grad_clip: float,
                    stopped: torch.Tensor, graphed=None, *, engine_threads: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One AdamW step on ``(inputs, targets)`` ``[B, T]``: (loss, gradient norm), 0-dim
    tensors left on the device (no host sync). ``graphed``: a ``GraphedLoss`` that replays the
    forward, loss and backward from CUDA graphs (``train.cuda_graphs``) instead of ``model``.
    ``engine_threads`` false: this backward (eager, or the graphs' replay) runs on the calling thread
    (``train.autograd_threads``); only the step's, so a graph capture keeps PyTorch's default.

    A non-finite loss or gradient norm sets ``stopped`` (a sticky device-side flag); the
    fused AdamW skips its update while the flag is set (``opt.found_inf``, one fp32 buffer the
    run creates with the optimizer: the protocol ``GradScaler`` uses), so the weights stay the last finite ones whatever the host
    learns later (``_ReadBack``).
    """
    opt.zero_grad(set_to_none=True)
    if graphed is None:
        loss = step_loss(model, inputs, targets, amp)
    else:
        loss = graphed(inputs, targets)
    with torch.autograd.set_multithreading_enabled(engine_threads):
        loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]],
                                               grad_clip or float("inf"))
    loss = loss.detach() if graphed is None else loss.detach().clone()   # a graph's loss: its static buffer
    stopped |= ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
    opt.found_inf.copy_(stopped)
    opt.step()
    return loss, grad_norm


class _ReadBack:
    """Per-step loss and gradient norm kept on the device, read back every ``every`` steps
    in one transfer (the only host sync of the training loop); the history, token count and
    progress bar are updated then. A non-finite value found at a read-back ends the run as
    ``diverged`` at the step where it first occurred (detected at most ``every - 1`` steps
    later; the steps in between changed nothing: ``_optimizer_step``)."""

    def __init__(self, device: torch.device, history: dict, bar, every: int):
        self.history, self.bar, self.every = history, bar, every
        self.stopped = torch.zeros((), dtype=torch.bool, device=device)
        self.pending: list[tuple[int, int, float, torch.Tensor, torch.Tensor]] = []
        self.tokens = self.steps = 0

    def add(self, step: int, n_tokens: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.pending.append((step, n_tokens, lr, loss, grad_norm))

    def maybe_flush(self, now: bool) -> str | None:
        """``flush`` when ``now`` or ``every`` steps are pending."""
        return self.flush() if now or len(self.pending) >= self.every else None

    def flush(self) -> str | None:
        """Read back the pending steps; the divergence reason at a non-finite value, else None."""
        if not self.pending:
            return None
        values = torch.stack([torch.stack([loss.float(), gn.float()]) for *_, loss, gn in self.pending]).tolist()
        pending, self.pending = self.pending, []
        for (step, n_tokens, lr, _, _), (loss, grad_norm) in zip(pending, values):
            problem = (f"training loss is {loss}" if not math.isfinite(loss) else
                       f"gradient norm is {grad_norm}" if not math.isfinite(grad_norm) else None)
            if problem is not None:
                late = pending[-1][0] - step
                return f"{problem} at step {step}" + (f" (seen at the read-back {late} step(s) later, "
                                                      f"train.log_every={self.every})" if late else "")
            self.tokens += n_tokens
            self.steps += 1
            self.history["train"].append({"step": step, "tokens": self.tokens, "loss": loss, "lr": lr,
                                          "grad_norm": grad_norm})
            if self.bar is not None:
                self.bar.update(1)
        if self.bar is not None and self.history["train"]:
            self.bar.set_postfix(loss=f"{self.history['train'][-1]['loss']:.3f}")
        return None


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
    mixer = model.describe()["mixer"]
    metrics = {
        "status": status, "reason": reason, "val_loss": final.get("loss"),
        "train_loss_first": train[0] if train else None,
        "train_loss_last": sum(train[-20:]) / len(train[-20:]) if train else None,
        "tokens": tokens, "steps": len(train),
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "wall_s": time.perf_counter() - t_start, "train_s": train_s,
        "peak_memory_bytes": mem, "peak_memory_kind": mem_kind, "peak_memory_reserved_bytes": peak_reserved(device),
        "backend": model.backends(), "objective": mixer.get("objective", "attention"),
        "structure": mixer.get("structure"), "n_params": n_params, "device": str(device),
        "precision": precision, "seed": cfg["seed"], "task": task.describe(), "mixer": mixer,
        "layout": model.layout_labels(), "state_elements": model.state_elements(),
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
