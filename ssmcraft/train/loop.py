"""One training run: ``train_run(config, out_dir) -> metrics``.

AdamW (weight decay on linear/embedding matrices only), linear warmup + cosine decay or
warmup-stable-decay (``train.schedule``), global-norm gradient clipping, bf16 autocast on CUDA, a
token budget and an optional wall-clock limit, periodic validation on a fixed validation set
(``train.val_seed``, the same for every run seed, so runs compare on the same data).

One model over several processes (``torchrun --nproc_per_node N -m ssmcraft train``), the global
batch split over processes and ``train.grad_accum`` micro-batches: ``ssmcraft.train.parallel``.
A checkpoint every ``train.checkpoint_every`` steps, which the same command resumes after a kill
(``ssmcraft.train.resume``). ``train.activation_checkpointing``: ``ssmcraft.train.recompute``.

Kept off the host's critical path, so that small runs keep a GPU busy:

- batches are built on the training device from a generator seeded per run
  (``train.data_on_device``; false: built on the host and copied);
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
  handing it to the autograd engine's device thread (PyTorch's default, kept: measurements moved
  the eager step both ways, and graphed steps not at all; BENCHMARKS.md, "Training throughput").

``metrics.json`` (also the return value; NaN/inf are written as null):

    status             "ok" | "diverged" (non-finite loss or gradient) | "timeout" (hit
                       train.max_seconds before the token budget) | "pruned" (the
                       ``report`` callback asked to stop)
    reason             why a run did not finish as "ok" (else null)
    val_loss           final validation loss (null when diverged)
    train_loss_first   loss of the first step; train_loss_last: mean of the last 20 steps
    tokens, steps      consumed input tokens (batch_size * seq_len per step: the global batch) and
                       steps, over the whole run (a resumed run's included)
    tokens_per_s       tokens / time spent in training steps (validation and checkpoints excluded),
                       of this process's steps (a resumed run's rate leaves out those before the resume)
    wall_s, train_s    whole run / training steps only (this process)
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
    processes, grad_accum, schedule   processes training the model, micro-batches per step, the lr schedule
    resumed_from_step  the checkpoint's step this run continued from (null: started afresh)
    backend            the recurrence paths the mixers ran (``obj.backend``)
    accuracy, chance_accuracy, ...   the task's validation metrics (MQAR, passkey)
    objective, structure, n_params, device, precision, seed, task (its description)
    artefacts          the hashes of config.json's objective and model sections, the update IR and
                       model.safetensors, checked on load (``ssmcraft.train.record``)

A divergence is caught before the optimizer step, so the saved weights are the last
finite ones.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Mapping

import torch

from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.layers import LM
from ssmcraft.tasks import build_task
from ssmcraft.train import checkpoint, parallel, plots, record, resume
from ssmcraft.train.compiled import compile_model, run_compiled_step
from ssmcraft.train.config import resolve
from ssmcraft.train.device import autocast, peak_memory, peak_reserved, pick_precision, reset_peak_memory
from ssmcraft.train.graphed import capture_loss, graphs_decision
from ssmcraft.train.recompute import recompute_blocks
from ssmcraft.train.schedule import lr_at, warmup_steps
from ssmcraft.train.validate import evaluate, step_loss

log = logging.getLogger("ssmcraft.train")


def build_model(config: dict[str, Any], source: str = "<experiment>") -> LM:
    """The LM of a resolved config whose ``model.vocab_size`` is set (``checkpoint.build_lm``:
    ``model.mixer.objective`` becomes the compiled spec's mapping, errors name ``source``).
    ``train.backend`` other than ``auto`` forces the objective's recurrence path."""
    model = checkpoint.build_lm(config, source)
    backend = config["train"]["backend"]
    if backend != "auto" and model.objective is not None:
        model.objective.prefer = backend
        log.info("recurrence path forced: %s", backend)
    return model


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
    """Adds a file handler for ``DIR/train.log`` to the ssmcraft logger for one run (``append``: a resumed
    run's lines follow the killed one's)."""

    def __init__(self, out_dir: Path, append: bool = False):
        self.handler = logging.FileHandler(out_dir / "train.log", mode="a" if append else "w")
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
              source: str = "<experiment>", report: Callable[[int, dict], bool] | None = None,
              fresh: bool = False) -> dict[str, Any]:
    """Train one model as ``config`` (an experiment mapping) says; write DIR; return the metrics.

    ``progress``: show a tqdm bar (only when stderr is a terminal).
    ``report``: called after each periodic validation as ``report(step, values)`` with
    ``values`` named as in the final metrics (``val_loss``, ``accuracy``, ..., ``tokens``);
    returning True stops the run with status ``pruned`` (the metrics are those of that
    validation).
    ``fresh``: start over where DIR holds a resume checkpoint (``ssmcraft.train.resume``); without it
    the checkpoint is resumed when its config matches this one, and refused (``SpecError``) when not.
    Several processes (``ssmcraft.train.parallel``, e.g. under torchrun) train one model; only rank 0
    writes DIR, every rank returns the metrics.
    User errors (bad config, unknown objective) raise ``SsmcraftError``; a diverging run
    does not raise, it reports ``status: "diverged"``.
    """
    out = Path(out_dir)
    cfg = resolve(config, source)
    threads = torch.get_num_threads()      # train.threads applies to this run only
    procs = parallel.start(cfg["train"]["device"], source)
    try:
        return _train(cfg, out, progress and procs.writer, source, report, fresh, procs)
    finally:
        torch.set_num_threads(threads)
        procs.close()


def _train(cfg: dict[str, Any], out: Path, progress: bool, source: str, report, fresh: bool,
           procs: parallel.Processes) -> dict[str, Any]:
    t_start = time.perf_counter()
    tc = cfg["train"]
    if tc["threads"]:
        torch.set_num_threads(int(tc["threads"]))
    precision = pick_precision(tc["precision"], procs.device)
    task, model = _build(cfg, source, procs.device)
    parallel.check_split(tc["batch_size"], procs.world, tc["grad_accum"], source)
    saved = None if fresh else resume.read_state(out)
    if saved is not None:       # refused before anything in DIR changes
        resume.check_config(saved[0], cfg, out / resume.FILE, source)
    if procs.writer:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SsmcraftError(f"{out}: cannot be created as the run folder ({e.strerror or type(e).__name__})") \
                from None
    with _RunLog(out, append=saved is not None) if procs.writer else contextlib.nullcontext():
        written = _start_files(cfg, out, resumed=saved is not None) if procs.writer else None
        run = _setup(cfg, task, model, procs, precision, source, saved)
        run.out, run.written = out, written
        _loop(run, report, progress)
        return _finish(run, t_start)


def _build(cfg: dict[str, Any], source: str, device: torch.device):
    """(task, model on ``device``); fills in ``model.vocab_size`` and the objective's mapping in ``cfg``."""
    task = build_task(cfg["task"], source)
    if cfg["model"]["vocab_size"] is None:
        cfg["model"]["vocab_size"] = task.vocab_size
    elif cfg["model"]["vocab_size"] < task.vocab_size:
        raise SpecError(source, "model.vocab_size", f"{cfg['model']['vocab_size']} is smaller than the task's "
                        f"vocabulary {task.vocab_size}")
    torch.manual_seed(cfg["seed"])
    model = build_model(cfg, source).to(device)
    model.documents = bool(getattr(task, "documents", False))      # packed documents (tasks.text)
    return task, model


def _start_files(cfg: dict[str, Any], out: Path, resumed: bool) -> dict[str, Any]:
    """The writer's files as a run starts: ``config.json``, after removing an earlier run's results (and, on
    a fresh start, its resume checkpoint). Returns config.json as a loader will read it back (hashed
    into the run's record)."""
    # an earlier run's results in this folder would sit beside this run's config: if this run is
    # stopped, eval and export would pair its config with the old weights (or the old metrics)
    names = (checkpoint.METRICS, checkpoint.HISTORY, checkpoint.WEIGHTS) + (() if resumed else (resume.FILE,))
    stale = [f for f in names if (out / f).exists()]
    for f in stale:
        (out / f).unlink()
    if stale:
        log.info("removed an earlier run's %s from %s", ", ".join(stale), out)
    checkpoint.write_json(out / checkpoint.CONFIG, cfg)
    return checkpoint.read_json(out / checkpoint.CONFIG)


def _setup(cfg, task, model, procs, precision: str, source: str, saved) -> SimpleNamespace:
    """Everything the steps share: optimizer, data, validation set, compile and graph decisions, the
    gradient reducer; a resume checkpoint's state put back."""
    tc, device = cfg["train"], procs.device
    n_params = sum(p.numel() for p in model.parameters())
    log.info("run %s: %s (layers %s), %d params, device %s, precision %s, %d process(es)", cfg["name"],
             model.describe()["mixer"].get("objective", "attention"), " ".join(model.layout_labels()), n_params,
             device, precision, procs.world)
    steps = max(1, tc["tokens"] // (tc["batch_size"] * task.seq_len))
    # fused AdamW on every device: it skips a step on the device-side flag (below), no sync
    opt = torch.optim.AdamW(param_groups(model, tc["weight_decay"]), lr=tc["lr"], betas=tuple(tc["betas"]),
                            fused=True)
    data_device = device if tc["data_on_device"] else torch.device("cpu")
    task.to(data_device)
    gen = torch.Generator(device=data_device).manual_seed(cfg["seed"] + 1)
    history: dict[str, list] = {"train": [], "val": []}
    readback = _ReadBack(device, history, None, tc["log_every"])
    start = 0
    if saved is not None:
        meta, tensors = saved
        resume.restore(meta, tensors, model, opt, gen, device)
        history.update(meta["history"])
        start, readback.tokens, readback.steps = meta["step"], meta["tokens"], len(history["train"])
        log.info("resumed after step %d of %d (%d tokens) from %s", start, steps, readback.tokens, resume.FILE)
    procs.same_start(model)
    if tc["activation_checkpointing"]:
        log.info("activation checkpointing: %d block(s) recomputed in the backward", recompute_blocks(model))
    val_batches = [(x.to(device), y.to(device)) for x, y in  # the same on every device; moved once
                   task.fixed_batches("val", tc["eval_batches"], tc["eval_batch_size"], seed=tc["val_seed"])]
    train_model, compile_info = compile_model(model, tc["compile"], device, tc["cuda_graphs"])
    use_graphs, why = graphs_decision(tc["cuda_graphs"], device, compile_info["enabled"], source,
                                      tc["activation_checkpointing"], model.documents)
    log.info("CUDA graphs: %s", why)
    log.info("data built on %s; host read-back every %d step(s)", data_device, tc["log_every"])
    params = [p for g in opt.param_groups for p in g["params"]]
    reducer = (parallel.Reducer(params, procs, tc["grad_accum"], device)
               if procs.world > 1 or tc["grad_accum"] > 1 else None)
    if reducer is not None:
        log.info("global batch of %d rows: %d process(es) x %d micro-batch(es) of %d; the gradients summed in one "
                 "all-reduce after the step", tc["batch_size"], procs.world, tc["grad_accum"],
                 tc["batch_size"] // (procs.world * tc["grad_accum"]))
    # fused AdamW skips its step while this is set (GradScaler's protocol); refreshed from
    # readback.stopped in place each step (_optimizer_step)
    opt.found_inf = torch.zeros((), dtype=torch.float32, device=device)
    return SimpleNamespace(
        cfg=cfg, tc=tc, device=device, precision=precision, amp=lambda: autocast(device, precision), task=task,
        model=model, train_model=train_model, opt=opt, gen=gen, data_device=data_device, val_batches=val_batches,
        steps=steps, warm=warmup_steps(tc["warmup"], steps), history=history, readback=readback, start=start,
        start_tokens=readback.tokens, start_steps=readback.steps, procs=procs, reducer=reducer, n_params=n_params,
        compile_info=compile_info,
        graphs_info={"setting": tc["cuda_graphs"], "enabled": use_graphs, "reason": why, "graphed_steps": 0,
                     "eager_steps": 0},
        loss_fn=None,           # the graphed forward+loss+backward, captured at the first step
        status="ok", reason=None, last_val=None, first_step_s=None, aside_s=0.0)


def _time_up(r, t_loop: float) -> bool:
    limit = r.tc["max_seconds"]
    return limit is not None and time.perf_counter() - t_loop - r.aside_s >= limit


def _loop(r: SimpleNamespace, report, progress: bool) -> None:
    """The training steps from ``r.start``; sets ``r.status`` and ``r.reason`` where a run stops early.

    One process checks the time limit before every step; several agree on it at each read-back (a
    process that stopped alone would leave the others waiting in a collective)."""
    tc, procs, readback = r.tc, r.procs, r.readback
    readback.bar = _progress_bar(r.steps, r.start) if progress and sys.stderr.isatty() else None
    reset_peak_memory(r.device)
    r.model.train()
    r.t_loop = time.perf_counter()       # aside_s: validation and checkpoints, not counted as training time
    step = r.start
    for step in range(r.start, r.steps):
        if procs.world == 1 and _time_up(r, r.t_loop):
            _stop_for_time(r)
            break
        lr, n_tokens, loss, grad_norm = _step(r, step)
        if step == r.start:  # compile and kernel JIT happen here: timed on their own (one sync)
            _sync(r.device)
            r.first_step_s = time.perf_counter() - r.t_loop
        readback.add(step, n_tokens, lr, loss, grad_norm)
        last = step + 1 == r.steps
        evaluate_now = bool(tc["eval_every"]) and (step + 1) % tc["eval_every"] == 0 and not last
        save_now = bool(tc["checkpoint_every"]) and (step + 1) % tc["checkpoint_every"] == 0 and not last
        due = last or evaluate_now or save_now or readback.due()
        diverged = readback.flush() if due else None
        if diverged:
            r.status, r.reason = "diverged", diverged
            break
        if due and not last and procs.world > 1 and procs.any(_time_up(r, r.t_loop)):
            _stop_for_time(r)
            break
        t_aside = time.perf_counter()
        if evaluate_now:
            r.last_val = _validate(r.model, r.task, r.val_batches, r.device, r.amp, r.history, step, readback.tokens)
            if report is not None and procs.writers(procs.writer and bool(
                    report(step + 1, _report_values(r.last_val, readback.tokens)))):
                r.status, r.reason = "pruned", f"stopped by the report callback after step {step + 1}"
                break
        if save_now and procs.writer:
            path = resume.save_state(r.out, step=step + 1, cfg=r.cfg, model=r.model, opt=r.opt, data=r.gen,
                                     device=r.device, history=r.history, tokens=readback.tokens, world=procs.world)
            log.info("checkpoint after step %d: %s", step + 1, path)
        r.aside_s += time.perf_counter() - t_aside
    r.step = step


def _stop_for_time(r: SimpleNamespace) -> None:
    diverged = r.readback.flush()
    r.status, r.reason = ("diverged", diverged) if diverged else ("timeout", (
        f"train.max_seconds={r.tc['max_seconds']} reached after {r.readback.steps} of {r.steps} steps"))


def _step(r: SimpleNamespace, step: int):
    """One optimizer step of the global batch: (lr, its input tokens, loss, gradient norm); the last two
    0-dim tensors on the device."""
    tc = r.tc
    lr = lr_at(step, r.steps, tc["lr"], r.warm, tc["min_lr_ratio"], tc["schedule"], tc["decay"])
    for group in r.opt.param_groups:
        group["lr"] = lr
    inputs, targets = r.task.sample("train", tc["batch_size"], None, r.gen)
    n_tokens = inputs.numel()
    if r.reducer is None:
        inputs, targets = (t.to(r.device, non_blocking=True) for t in (inputs, targets))
        first = inputs, targets
    else:
        inputs, targets = r.reducer.split(inputs, targets)
        first = inputs[0], targets[0]
    if r.graphs_info["enabled"] and step == r.start:
        r.loss_fn = capture_loss(r.model, *first, r.device, r.precision, r.graphs_info)
    graphed = r.loss_fn if r.loss_fn is not None and r.loss_fn.fits(*first) else None
    r.graphs_info["graphed_steps" if graphed is not None else "eager_steps"] += 1

    def one_step(module):
        return _optimizer_step(module, r.opt, inputs, targets, r.amp, tc["grad_clip"], r.readback.stopped, graphed,
                               engine_threads=tc["autograd_threads"], reducer=r.reducer)

    if step == r.start and r.train_model is not r.model:
        (loss, grad_norm), r.train_model = run_compiled_step(one_step, r.train_model, r.model, r.compile_info)
    else:
        loss, grad_norm = one_step(r.train_model)
    return lr, n_tokens, loss, grad_norm


def _finish(r: SimpleNamespace, t_start: float) -> dict[str, Any]:
    """The final validation, the metrics, and (the writer) the run's files; the resume checkpoint goes."""
    _sync(r.device)
    train_s = time.perf_counter() - r.t_loop - r.aside_s
    if r.readback.bar is not None:
        r.readback.bar.close()
    if r.status == "pruned":
        final = r.last_val
        log.info("run %s pruned after step %d", r.cfg["name"], r.step + 1)
    elif r.status != "diverged":
        final = _validate(r.model, r.task, r.val_batches, r.device, r.amp, r.history, r.step, r.readback.tokens)
    else:
        final = {"loss": None}
        log.warning("run %s diverged: %s", r.cfg["name"], r.reason)
    run_tokens = r.readback.tokens - r.start_tokens        # this process's share of the run, for its rates
    metrics = _metrics(r.cfg, r.model, r.task, r.history, final, r.status, r.reason, r.readback.tokens, run_tokens,
                       train_s, t_start, r.device, r.precision, r.n_params)
    run_steps = r.readback.steps - r.start_steps
    steady = (run_tokens * (run_steps - 1) / run_steps / (train_s - r.first_step_s)
              if r.first_step_s is not None and run_steps > 1 and train_s > r.first_step_s else None)
    metrics.update(compile=r.compile_info, cuda_graphs=r.graphs_info, autograd_threads=r.tc["autograd_threads"],
                   data_device=str(r.data_device), log_every=r.tc["log_every"], first_step_s=r.first_step_s,
                   steady_tokens_per_s=steady, processes=r.procs.world, grad_accum=r.tc["grad_accum"],
                   schedule=r.tc["schedule"], resumed_from_step=r.start or None)
    if r.procs.writer:
        _write_outputs(r.cfg, r.written, r.model, r.history, metrics, r.out)
        resume.discard(r.out)
    return metrics


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _optimizer_step(model, opt, inputs, targets, amp, grad_clip: float,
                    stopped: torch.Tensor, graphed=None, *, engine_threads: bool,
                    reducer: parallel.Reducer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One AdamW step on ``(inputs, targets)`` ``[B, T]``: (loss, gradient norm), 0-dim
    tensors left on the device (no host sync). ``graphed``: a ``GraphedLoss`` that replays the
    forward, loss and backward from CUDA graphs (``train.cuda_graphs``) instead of ``model``.
    ``engine_threads`` false: this backward (eager, or the graphs' replay) runs on the calling thread
    (``train.autograd_threads``); only the step's, so a graph capture keeps PyTorch's default.
    ``reducer``: ``inputs`` and ``targets`` are lists, this process's micro-batches (``Reducer.split``),
    whose weighted gradients and losses the reducer sums over micro-batches and processes; the loss is
    then the global batch's.

    A non-finite loss or gradient norm sets ``stopped`` (a sticky device-side flag); the
    fused AdamW skips its update while the flag is set (``opt.found_inf``, one fp32 buffer the
    run creates with the optimizer: the protocol ``GradScaler`` uses), so the weights stay the last finite ones whatever the host
    learns later (``_ReadBack``).
    """
    opt.zero_grad(set_to_none=True)
    if reducer is None:
        loss = _backward(model, inputs, targets, amp, graphed, engine_threads)
    else:
        for i, (x, y, weight) in enumerate(zip(inputs, targets, reducer.weights)):
            reducer.add(i, _backward(model, x, y, amp, graphed, engine_threads, weight) * weight)
        loss = reducer.finish()
    grad_norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]],
                                               grad_clip or float("inf"))
    stopped |= ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
    opt.found_inf.copy_(stopped)
    opt.step()
    return loss, grad_norm


def _backward(model, inputs, targets, amp, graphed, engine_threads: bool, weight=None) -> torch.Tensor:
    """The forward and backward of one batch (the loss times ``weight`` where given); the loss, detached."""
    loss = step_loss(model, inputs, targets, amp) if graphed is None else graphed(inputs, targets)
    with torch.autograd.set_multithreading_enabled(engine_threads):
        (loss if weight is None else loss * weight).backward()
    return loss.detach() if graphed is None else loss.detach().clone()   # a graph's loss: its static buffer


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

    def due(self) -> bool:
        """Whether ``every`` steps are pending (time to ``flush``)."""
        return len(self.pending) >= self.every

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


def _progress_bar(steps: int, done: int):
    from tqdm import tqdm

    return tqdm(total=steps, initial=done, unit="step", dynamic_ncols=True, file=sys.stderr)


def _validate(model, task, batches, device, amp, history, step, tokens) -> dict[str, float]:
    result = evaluate(model, task, batches, device, amp)
    history["val"].append({"step": step, "tokens": tokens, **result})
    extra = ", ".join(f"{k} {v:.3f}" for k, v in result.items() if k != "loss")
    log.info("step %d, %d tokens: val loss %.4f%s", step + 1, tokens, result["loss"], f", {extra}" if extra else "")
    return result


def _report_values(val: dict[str, float], tokens: int) -> dict[str, float]:
    """A validation result under the final metrics' names (``loss`` -> ``val_loss``)."""
    return {"val_loss": val["loss"], **{k: v for k, v in val.items() if k != "loss"}, "tokens": tokens}


def _metrics(cfg, model, task, history, final, status, reason, tokens, run_tokens, train_s, t_start, device,
             precision, n_params) -> dict[str, Any]:
    """The run's figures; ``tokens`` over the whole run, ``run_tokens`` those this process trained (a resumed
    run's rate leaves out the steps before the checkpoint)."""
    train = [r["loss"] for r in history["train"]]
    mem, mem_kind = peak_memory(device)
    mixer = model.describe()["mixer"]
    metrics = {
        "status": status, "reason": reason, "val_loss": final.get("loss"),
        "train_loss_first": train[0] if train else None,
        "train_loss_last": sum(train[-20:]) / len(train[-20:]) if train else None,
        "tokens": tokens, "steps": len(train),
        "tokens_per_s": run_tokens / train_s if train_s > 0 else None,
        "wall_s": time.perf_counter() - t_start, "train_s": train_s,
        "peak_memory_bytes": mem, "peak_memory_kind": mem_kind, "peak_memory_reserved_bytes": peak_reserved(device),
        "backend": model.backends(), "objective": mixer.get("objective", "attention"),
        "structure": mixer.get("structure"), "n_params": n_params, "device": str(device),
        "precision": precision, "seed": cfg["seed"], "task": task.describe(), "mixer": mixer,
        "layout": model.layout_labels(), "state_elements": model.state_elements(),
    }
    metrics.update({k: v for k, v in final.items() if k != "loss"})
    return metrics


def _write_outputs(cfg, written: dict, model, history, metrics, out: Path) -> None:
    """history.json, the weights, the loss plot, then metrics.json with the artefacts' hashes
    (``ssmcraft.train.record``; ``written``: config.json as read back)."""
    checkpoint.write_json(out / checkpoint.HISTORY, history)
    weights = checkpoint.save_weights(model, out) if cfg["train"]["save_model"] else None
    metrics[record.KEY] = record.artefacts_record(written, model, weights)
    plots.loss_curve(history, out / "loss.png", title=f"{cfg['name']} ({metrics['objective']})")
    checkpoint.write_json(out / checkpoint.METRICS, metrics)
    log.info("run %s: status %s, val loss %s, %.0f tokens/s, %.1f s", cfg["name"], metrics["status"],
             "n/a" if metrics["val_loss"] is None else f"{metrics['val_loss']:.4f}",
             metrics["tokens_per_s"] or 0.0, metrics["wall_s"])
