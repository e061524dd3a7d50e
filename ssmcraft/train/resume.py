"""Resumable training: ``DIR/resume.safetensors``, the state a killed run continues from.

Written by the run's writer every ``train.checkpoint_every`` steps (``fileio.write_bytes``:
atomic, so a kill mid-write leaves the previous one), and removed when the run writes its final
results. It holds everything the next steps depend on, so a resumed run reaches the weights an
uninterrupted one does (bitwise on CPU):

- tensors: the model's state (``model.*``), AdamW's state (``opt.<index>.<name>``, its step
  counters included), the data generator's state (``rng.data``: the position in the data stream)
  and torch's global generators (``rng.torch``, ``rng.cuda``);
- metadata ``ssmcraft.resume`` (JSON): the steps done, the run's resolved config, the optimizer's
  parameter groups, the token count and the loss history so far, the number of processes.

The learning rate is a function of the step (``schedule``), so it needs no state. Resuming checks
the checkpoint against the run's config: any difference but the settings in ``FREE`` (which
change how a step runs, not what it computes) is refused with one line naming the first key.
Under several processes every one restores the same state: the data generator is the same
everywhere (``parallel``); the number of processes may differ from the checkpoint's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from ssmcraft.errors import SpecError, SsmcraftError, one_line
from ssmcraft.fileio import write_bytes

FILE = "resume.safetensors"
_META = "ssmcraft.resume"
# how steps run, not what they compute: the same math (grad_accum, like the number of processes, up to
# float rounding; bitwise needs these and the thread count unchanged)
FREE = frozenset({"threads", "log_every", "autograd_threads", "compile", "cuda_graphs", "checkpoint_every",
                  "max_seconds", "activation_checkpointing", "grad_accum"})


def save_state(out: Path, *, step: int, cfg: dict, model: torch.nn.Module, opt: torch.optim.Optimizer,
               data: torch.Generator, device: torch.device, history: dict, tokens: int, world: int) -> Path:
    """Write the state after ``step`` steps (module docstring)."""
    tensors = {f"model.{k}": v.detach() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    for index, state in opt_state["state"].items():
        tensors.update({f"opt.{index}.{name}": torch.as_tensor(v) for name, v in state.items()})
    tensors["rng.data"] = data.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    if device.type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    meta = {"step": step, "config": cfg, "opt_groups": opt_state["param_groups"], "history": history,
            "tokens": tokens, "world_size": world}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    path = Path(out) / FILE
    write_bytes(path, save(tensors, metadata={_META: json.dumps(meta)}))
    return path


def read_state(out: Path) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(metadata, tensors) of ``DIR/resume.safetensors``, or None without one; an unreadable file is an
    ``SsmcraftError`` (one line)."""
    path = Path(out) / FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {})[_META])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise SsmcraftError(f"{path}: not a readable resume checkpoint ({one_line(e)}); remove it or run with "
                            "--fresh") from None
    return meta, tensors


def check_config(meta: dict, cfg: dict, path: Path, source: str) -> None:
    """Refuse (``SpecError``, one line) a run whose config differs from the checkpoint's but in ``FREE``."""
    for key, then, now in _differences(meta["config"], json.loads(json.dumps(cfg))):   # tuples read back as lists
        if key.startswith("train.") and key.split(".")[1] in FREE:
            continue
        raise SpecError(source, key, f"{_show(then)} in {path} (after step {meta['step']}), {_show(now)} now: "
                        "resume with the run's settings, or start it again with --fresh")


def _differences(a: Any, b: Any, prefix: str = ""):
    """(dotted key, a's value, b's value) wherever two JSON-like values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            yield from _differences(a.get(k, _MISSING), b.get(k, _MISSING), f"{prefix}{k}.")
        return
    if a != b:
        yield prefix.rstrip("."), a, b


class _Missing:
    def __repr__(self):
        return "absent"


_MISSING = _Missing()


def _show(value: Any) -> str:
    return "absent" if value is _MISSING else json.dumps(value)[:80]


def restore(meta: dict, tensors: dict[str, torch.Tensor], model: torch.nn.Module, opt: torch.optim.Optimizer,
            data: torch.Generator, device: torch.device) -> None:
    """Put the checkpoint's model, optimizer and generator states back."""
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        if key.startswith("opt."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = v
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["opt_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})
    data.set_state(tensors["rng.data"])
    torch.set_rng_state(tensors["rng.torch"])
    if device.type == "cuda" and "rng.cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.cuda"], device)


def discard(out: Path) -> None:
    """Remove the checkpoint (the run wrote its final results, or starts afresh)."""
    (Path(out) / FILE).unlink(missing_ok=True)
