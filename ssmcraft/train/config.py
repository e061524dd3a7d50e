"""Experiment specs: reading, ``--set`` overrides, defaults and validation.

An experiment spec (YAML) has four sections; everything but ``task`` has defaults::

    name: train_quick
    seed: 0
    task:  {name: mqar, vocab: 128, seq_len: 64, num_kv_pairs: 4}    # see ssmcraft.tasks
    model: {d_model: 64, n_layers: 2, mlp_ratio: 2,
            mixer: {kind: objective, objective: longhorn, state_size: 16}}  # ssmcraft.layers.config
    train: {batch_size: 32, tokens: 1_000_000, lr: 3.0e-3, ...}    # TRAIN_DEFAULTS below

``resolve`` returns a complete, validated mapping (every default filled in); it is what a
run directory records. The model's and the mixer's keys and values are checked here, the task's
name and keys too (``tasks.check_task``); the task's values when it is built.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from ssmcraft import yamlsafe
from ssmcraft.config_check import Checker, Field
from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.layers.config import LMConfig, number_or_same
from ssmcraft.tasks import check_task
from ssmcraft.train.schedule import SCHEDULES

TOP_DEFAULTS: dict[str, Any] = {"name": "experiment", "seed": 0}
TRAIN_DEFAULTS: dict[str, Any] = {
    "batch_size": 32,
    "tokens": 1_000_000,        # training budget in input tokens (batch_size * seq_len per step)
    "max_seconds": None,        # optional wall-clock limit of the training loop (several processes agree on it
                                # at each read-back, every log_every steps)
    "lr": 3.0e-3,
    "min_lr_ratio": 0.1,        # the schedule decays to lr * min_lr_ratio
    "warmup": 0.05,             # fraction of the steps (< 1) or a number of steps (>= 1)
    "schedule": "cosine",       # after the warmup: cosine | wsd (warmup-stable-decay: lr held, then a
                                # linear decay over the last `decay` of the steps; ssmcraft.train.schedule)
    "decay": 0.2,               # wsd only: fraction of the steps (< 1) or a number of steps (>= 1)
    "grad_accum": 1,            # micro-batches per optimizer step: batch_size is the global batch, split over
                                # processes and micro-batches (ssmcraft.train.parallel)
    "checkpoint_every": 1000,   # steps between resume checkpoints (DIR/resume.safetensors; 0: none): the same
                                # command resumes a killed run from the last one (ssmcraft.train.resume)
    "activation_checkpointing": False,   # recompute each block's activations in the backward (less memory)
    "weight_decay": 0.1,        # on matrices of linear layers and the embedding only
    "betas": [0.9, 0.95],
    "grad_clip": 1.0,           # max global gradient norm (0: off)
    "eval_every": 100,          # steps between validations (0: only at the end)
    "eval_batches": 4,
    "eval_batch_size": 64,
    "val_seed": 1234,           # the validation set is the same for every run seed
    "device": "auto",           # auto | cpu | cuda | cuda:N
    "precision": "auto",        # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    "threads": None,            # torch CPU threads (None: leave torch's default)
    "backend": "auto",          # recurrence path: auto (fastest available) | reference | torch | triton
    "save_model": True,
    "log_every": 50,            # steps between host read-backs of loss/grad norm (1: sync every step);
                                # a divergence is detected at the read-back, at most log_every - 1 steps late
    "compile": "auto",          # torch.compile of the LM around the recurrence: auto (on for CUDA only when
                                # cuda_graphs is false) | true | false
    "cuda_graphs": "auto",      # forward+loss+backward replayed from CUDA graphs: auto (on for CUDA unless
                                # compile is true) | true | false (ssmcraft.train.graphed)
    "data_on_device": True,     # build task batches on the training device (False: on the host, then copied)
    "autograd_threads": True,   # the backward handed to the autograd engine's device thread (PyTorch's
                                # default); false: run on the training thread (BENCHMARKS.md, "Host floor")
}
MODEL_DEFAULTS = {**LMConfig(vocab_size=0).to_dict(), "vocab_size": None}   # None: the task's vocabulary
SECTIONS = {"task", "model", "train"}


def load_experiment(path: str | Path) -> dict[str, Any]:
    """The mapping of an experiment YAML file (``SpecError`` naming the file on problems)."""
    p = Path(path)
    if not p.is_file():
        raise SsmcraftError(f"{path}: no such experiment file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(str(path), "", f"not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})") from None
    data = yamlsafe.load(text, str(path))
    if not isinstance(data, dict):
        raise SpecError(str(path), "", "expected a mapping at the top level")
    return data


def apply_overrides(cfg: Mapping[str, Any], overrides: Iterable[str], source: str = "--set") -> dict[str, Any]:
    """A copy of ``cfg`` with each ``dotted.key=value`` set; values parse as YAML (``1e-3``, ``[1, 2]``)."""
    out = copy.deepcopy(dict(cfg))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(source, item, "expected key=value, e.g. train.lr=1e-3")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        value = number_or_same(value)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SpecError(source, key, f"{part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _section(cfg: Mapping, name: str, defaults: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Section ``name`` of ``cfg`` (absent or empty: all defaults), its keys those of ``defaults``."""
    fields = {k: Field(default=v) for k, v in defaults.items()}
    return copy.deepcopy(Checker(source, name).section("", cfg.get(name, {}) or {}, fields))


def resolve(cfg: Mapping[str, Any], source: str = "<experiment>") -> dict[str, Any]:
    """The complete experiment mapping with defaults filled in; structural errors are ``SpecError``."""
    Checker(source).mapping("", cfg, tuple(sorted(SECTIONS | set(TOP_DEFAULTS))))
    if "task" not in cfg or not isinstance(cfg["task"], Mapping) or "name" not in cfg["task"]:
        raise SpecError(source, "task", "missing (required): a mapping with a task name")
    out = {k: cfg.get(k, v) for k, v in TOP_DEFAULTS.items()}
    if isinstance(out["seed"], bool) or not isinstance(out["seed"], int):
        raise SpecError(source, "seed", f"expected an integer, got {out['seed']!r}")
    out["task"] = copy.deepcopy(dict(cfg["task"]))
    out["model"] = _section(cfg, "model", MODEL_DEFAULTS, source)
    out["train"] = _section(cfg, "train", TRAIN_DEFAULTS, source)
    _check_train(out["train"], source)
    LMConfig.from_dict({**out["model"], "vocab_size": out["model"]["vocab_size"] or 1}, source, "model")
    check_task(out["task"], source)
    return out


GRAPHS_WITH_COMPILE = ("true together with train.compile true: choose one (the graphs capture the eager step; "
                       "set train.compile: false or auto)")
GRAPHS_WITH_RECOMPUTE = ("true together with train.activation_checkpointing true: choose one (set "
                         "train.cuda_graphs: false or auto)")


def _check_train(t: dict[str, Any], source: str) -> None:
    def positive(key, integer=False, allow_zero=False):
        v = t[key] = number_or_same(t[key])
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v > 0 or (allow_zero and v == 0))
        if not ok or (integer and float(v) != int(v)):
            raise SpecError(source, f"train.{key}", f"expected a {'non-negative' if allow_zero else 'positive'} "
                            f"{'integer' if integer else 'number'}, got {v!r}")
        if integer:
            t[key] = int(v)

    for key in ("batch_size", "tokens", "eval_batches", "eval_batch_size"):
        positive(key, integer=True)
    positive("eval_every", integer=True, allow_zero=True)
    positive("log_every", integer=True)
    positive("grad_accum", integer=True)
    positive("checkpoint_every", integer=True, allow_zero=True)
    if t["batch_size"] % t["grad_accum"]:
        raise SpecError(source, "train.grad_accum", f"{t['grad_accum']} does not divide train.batch_size "
                        f"{t['batch_size']} (the global batch) into equal micro-batches")

    def one_of(key, allowed: tuple):
        """``t[key]`` is one of ``allowed``; a bool matches only itself (0 and 1 are refused)."""
        v = t[key]
        if not any(v is a if isinstance(a, bool) else v == a for a in allowed):
            words = [str(a).lower() if isinstance(a, bool) else a for a in allowed]
            raise SpecError(source, f"train.{key}", f"expected {', '.join(words[:-1])} or {words[-1]}, got {v!r}")

    one_of("compile", ("auto", True, False))
    one_of("cuda_graphs", ("auto", True, False))
    if t["cuda_graphs"] is True and t["compile"] is True:
        raise SpecError(source, "train.cuda_graphs", GRAPHS_WITH_COMPILE)
    one_of("activation_checkpointing", (True, False))
    if t["cuda_graphs"] is True and t["activation_checkpointing"] is True:
        raise SpecError(source, "train.cuda_graphs", GRAPHS_WITH_RECOMPUTE)
    one_of("autograd_threads", (True, False))
    one_of("schedule", SCHEDULES)
    one_of("data_on_device", (True, False))
    for key in ("lr", "grad_clip", "weight_decay", "warmup", "min_lr_ratio", "decay"):
        positive(key, allow_zero=key != "lr")
    t["betas"] = [number_or_same(b) for b in t["betas"]] if isinstance(t["betas"], list) else t["betas"]
    if t["max_seconds"] is not None:
        positive("max_seconds")
    one_of("backend", ("auto", "reference", "torch", "triton", "interpret"))
    one_of("precision", ("auto", "fp32", "bf16"))
    if not (isinstance(t["betas"], list) and len(t["betas"]) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in t["betas"])):
        raise SpecError(source, "train.betas", f"expected [beta1, beta2], each in [0, 1), got {t['betas']!r}")
    if t["threads"] is not None:
        positive("threads", integer=True)
    if not isinstance(t["device"], str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", t["device"]):
        raise SpecError(source, "train.device", f"expected auto, cpu, cuda or cuda:N, got {t['device']!r}")
