"""``export(run_dir, out, trial=...)``: a trained trial -> a standalone folder.

::

    EXP/
      <objective>_ssm.py     the model: header (objective, derived update, provenance),
                             the layers and runtime copied from ssmcraft's source, the
                             generated recurrence, Triton kernels inline when available
                             (``<objective>_mixer.py`` with ``--layer-only``)
      config.json            model config + objective (spec mapping, IR, update) + source
      model.safetensors      the weights (only the mixers' with ``--layer-only``)
      README.md              usage

The source is a search folder and a trial (``ssmcraft.search.find_trial``: ``best`` or a
number) or a single ``ssmcraft train`` folder. The model is loaded with ssmcraft
(``ssmcraft.train.load_run``: what ``load_trial`` returns) and, unless ``check=False``,
the written module is imported and checked against it before the folder is put in place.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import re
import shutil
import sys
import textwrap
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ssmcraft.compiler import safe_source
from ssmcraft.errors import SsmcraftError
from ssmcraft.export.assemble import (ExportError, Section, bundle, dataclass_literal, literal, recurrence_section,
                                      import_problem, standalone_module, text_section)

log = logging.getLogger("ssmcraft.export")

FORMAT = "ssmcraft-export"
FORMAT_VERSION = 1
CONFIG_FILE, WEIGHTS_FILE, README_FILE = "config.json", "model.safetensors", "README.md"
VERIFY_TOL = 1e-5

# What goes into the module, in order (see ssmcraft.export.assemble.bundle).
LAYER_PLAN = [
    ("module", "ssmcraft.errors"),
    ("module", "ssmcraft.fileio"),
    ("module", "ssmcraft.config_check"),
    ("module", "ssmcraft.compiler.spec", {"only": ["InputDecl", "ParamDecl", "Spec"]}),
    ("module", "ssmcraft.compiler.slot_names"),
    ("generated", "objective"),
    ("module", "ssmcraft.ops.common.reference"),
    ("module", "ssmcraft.runtime.dispatch"),
    ("module", "ssmcraft.layers.activations"),
    ("module", "ssmcraft.layers.conv"),
    ("module", "ssmcraft.layers.params"),
    ("module", "ssmcraft.layers.mitigation"),
    ("module", "ssmcraft.layers.config"),
    ("module", "ssmcraft.layers.mixer"),
    ("module", "ssmcraft.export.runtime"),
]
LM_PLAN = LAYER_PLAN + [
    ("module", "ssmcraft.layers.attention"),
    ("module", "ssmcraft.modpath"),
    ("module", "ssmcraft.layers.module_mixer"),
    ("module", "ssmcraft.layers.lm"),
    ("module", "ssmcraft.export.runtime_lm"),
    ("generated", "tail"),
]
LAYER_PLAN = LAYER_PLAN + [("generated", "tail")]


@dataclass
class TrialSource:
    """Where the trained model comes from."""
    kind: str                 # "search" | "train"
    run_dir: Path
    model_dir: Path           # the folder with config.json + model.safetensors
    trial: int | None = None
    info: dict = field(default_factory=dict)   # trial.json (search) or {}
    metrics: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.kind == "search":
            study = self.info.get("study")
            return f"trial {self.trial} of search {study!r} ({self.run_dir})" if study else \
                f"trial {self.trial} of {self.run_dir}"
        return f"training run {self.run_dir}"


@dataclass
class ExportResult:
    out: Path
    module: Path
    files: list[Path]
    source: TrialSource
    objective: str
    structure: str
    layer_only: bool
    kernels: str              # "inline (<family>)" or "none (<why>)"
    n_params: int
    verified: dict | None = None   # {"max_abs_diff": ..., "step_max_abs_diff": ..., "prefill_max_abs_diff": ..., "shape": [...]}


# -- finding the trained model ---------------------------------------------------------------
def _read_json(path: Path) -> dict:
    """A JSON object file of the source folder, {} when absent; a corrupt one is refused."""
    from ssmcraft.train.checkpoint import read_mapping

    return read_mapping(path) if path.exists() else {}


def resolve_source(run_dir: str | Path, trial: str | int | None = None) -> TrialSource:
    """The trained model a search folder's trial (``best`` or a number; default ``best``) or
    a training folder (no ``trial``) names. Failed, pruned, unknown or unfinished trials
    raise ``SsmcraftError`` with a one-line reason."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such folder")
    if (run_dir / "run.json").is_file():
        from ssmcraft.search import find_trial

        _check_run_info(run_dir / "run.json")
        which = "best" if trial is None else trial
        if isinstance(which, str) and which != "best":
            if not which.strip().isdigit():
                raise ExportError(f"--trial must be 'best' or a trial number, got {which!r}")
            which = int(which)
        folder = Path(find_trial(run_dir, which))
        info = _read_json(folder / "trial.json")
        number = info.get("number", which if isinstance(which, int) else None)
        if number is None:
            m = re.search(r"(\d+)$", folder.name)
            number = int(m.group(1)) if m else None
        model_dir = _model_folder(folder, f"trial {number} of {run_dir}")
        return TrialSource("search", run_dir, model_dir, number, info, _read_json(model_dir / "metrics.json"))
    if (run_dir / CONFIG_FILE).is_file():
        if trial is not None:
            raise ExportError(f"{run_dir}: a training run folder, not a search folder; drop --trial")
        metrics = _read_json(run_dir / "metrics.json")
        if metrics.get("status") == "diverged":
            raise ExportError(f"{run_dir}: the run diverged ({metrics.get('reason') or 'non-finite loss'}); "
                              "nothing trained to export")
        _model_folder(run_dir, f"training run {run_dir}")
        return TrialSource("train", run_dir, run_dir, None, {}, metrics)
    raise ExportError(f"{run_dir}: neither a search folder (no run.json) nor a training run folder "
                      f"(no {CONFIG_FILE})")


def _check_run_info(path: Path) -> None:
    """A search folder's run.json names its study and storage; a corrupt one is one line here, before
    the search machinery opens the storage it names."""
    info = _read_json(path)
    storage = info.get("storage")
    if not (isinstance(info.get("study"), str) and isinstance(storage, dict) and isinstance(storage.get("kind"), str)):
        raise ExportError(f"{path}: expected a search's run.json (a 'study' name and a 'storage' mapping with a "
                          "'kind'); the file is corrupt")


def _model_folder(folder: Path, what: str) -> Path:
    """The folder holding the checkpoint: ``folder`` itself or one sub-folder of it."""
    for cand in [folder, *sorted(p for p in folder.iterdir() if p.is_dir())] if folder.is_dir() else []:
        if (cand / WEIGHTS_FILE).is_file() and (cand / CONFIG_FILE).is_file():
            return cand
    raise ExportError(f"{what}: no trained checkpoint ({CONFIG_FILE} + {WEIGHTS_FILE}) in {folder}")


# -- the Triton kernels, when ssmcraft has them ----------------------------------------------
# The kernel families of ``ssmcraft.ops.registry``, in the order ssmcraft's Triton backend tries them
# on CUDA; a family is exported through its ``forward(obj, lay, co, output_final_state)``.
KERNEL_IMPORTS = ("torch", "triton")     # what the inline kernel text may import besides the stdlib


def _module_path(fam) -> str:
    return fam.module.__name__.replace(".", "/") + ".py"


def _family_text(fam, obj, sizes: dict) -> str:
    """The family's kernel module as a module of its own, built by the bundle machinery
    (``assemble.standalone_module``): the ssmcraft modules it imports from (its direct launcher
    ``ssmcraft/ops/common/launch.py``: stdlib, torch and triton only) pasted ahead of it, the module
    less ``fam.export_exclude`` (at least its ``prepare``: ssmcraft's per-signature fast path,
    ``ssmcraft.runtime.dispatch``; the exported ``Objective`` calls the family's ``forward``), then
    the family's ``export_tail`` for ``obj``, where it generates its kernels per objective."""
    after = None
    if fam.export_tail is not None:
        after = text_section(*fam.export_tail(obj, sizes))
    return standalone_module(fam.module.__name__, "", exclude=set(fam.export_exclude), allowed=KERNEL_IMPORTS,
                             after=after)


def triton_kernel_source(obj, sizes: dict | None = None) -> tuple[str | None, str]:
    """(kernel module text or None, a phrase: which family is inline, or why none is).

    The text is the first kernel family, in the order ssmcraft's Triton backend tries them on
    CUDA, that supports the objective's IR and imports nothing but the standard library,
    torch and triton: the family module with the ssmcraft modules it imports and without its
    ``prepare`` and with the kernels generated for this objective where the family generates
    them per objective with sympy (``_family_text``); plus ``FAMILY = name``. ``sizes``:
    the layer's per-head sizes ``{"d": ..., "m": ...}``. The exported ``Objective`` calls
    the family's ``forward(obj, lay, co, output_final_state)`` on CUDA.
    """
    from ssmcraft.ops import registry

    reasons, first = [], None
    for fam in registry.order(obj.ir, "triton"):
        name = fam.name
        if fam.forward is None:
            # a family that chains other families' kernels (through its own host code) has no one
            # module to inline: name it, so the phrase says why ssmcraft's kernel is not in the export
            if not fam.one_token and fam.reason(obj.ir) is None:
                first = first or name
                reasons.append(f"{name} runs it, but chains several families' kernels and has no single "
                               "kernel module to inline")
            continue
        why = fam.reason(obj.ir)
        if why is None and sizes:     # known faults at some sizes on CUDA
            why = fam.size_reason(obj.ir, {obj.ir.dims[0]: sizes.get("d"), obj.ir.dims[1]: sizes.get("m")}, "triton")
        if why is not None:
            continue
        first = first or name
        generated = fam.export_tail is not None
        try:
            text = _family_text(fam, obj, dict(sizes or {}))
        except SsmcraftError as e:
            reasons.append(f"{name}: {e}")
            continue
        if not text:
            continue
        # a bundle's modules were each checked as it was assembled; a family's own text is checked here
        problem = import_problem(text, _module_path(fam), KERNEL_IMPORTS) if generated else None
        if problem is not None:
            reasons.append(f"{name} supports it, but {problem}")
            continue
        how = "bundled with the ssmcraft modules it imports" if not generated else \
            "with the kernels generated for this objective"
        text = (f"# Triton kernels for {obj.spec.name!r}: {_module_path(fam)} (family {name}), {how}.\n"
                + text.rstrip() + f"\n\n\nFAMILY = {name!r}\n")
        compile(text, f"<triton kernels {name}>", "exec")
        note = "" if first == name else f"; ssmcraft itself runs {first}, which cannot be exported: {reasons[0]}"
        return text, f"inline ({name}{note})"
    if not reasons:
        return None, f"none (no Triton kernel family of this ssmcraft runs structure {obj.ir.kind})"
    return None, "none (" + "; ".join(reasons) + ")"


# -- writing ------------------------------------------------------------------------------------
def module_stem(name: str, layer_only: bool) -> str:
    stem = re.sub(r"[^0-9a-zA-Z_]+", "_", name).strip("_").lower() or "objective"
    if stem[0].isdigit():
        stem = "m_" + stem
    return f"{stem}_{'mixer' if layer_only else 'ssm'}"


def _version() -> str:
    try:
        from ssmcraft import __version__
    except ImportError:  # pragma: no cover
        return "?"
    return __version__


def _git() -> str | None:
    try:
        from ssmcraft.search.provenance import git_describe
    except ImportError:
        return None
    return git_describe()


def header_text(obj, source: TrialSource, stem: str, layer_only: bool, kernels: str) -> str:
    spec = obj.spec
    what = "objective mixer layer" if layer_only else "language model"
    # spec text, paths and labels are data: they reach the module only through safe_source
    lines = [
        f"# {stem}.py: a trained ssmcraft {what}, exported as a standalone PyTorch module.",
        "#",
        *(safe_source.comment(ln, "#   " if i else "# ") for i, ln in enumerate(textwrap.wrap(
            f"Objective: {spec.name}" + (f": {' '.join(spec.summary.split())}" if spec.summary else ""), width=94))),
        safe_source.comment(f"loss L(S) = {spec.objective}    (update: {spec.update}, approximation: "
                            f"{spec.approximation})", "#   "),
        safe_source.comment(f"output    = {spec.output}", "#   "),
        f"#   structure: {obj.ir.kind}",
        "# Derived update (S_t = argmin L for implicit updates, one gradient step for explicit):",
        safe_source.comment(obj.update, "#   "),
        safe_source.comment(f"Trained in: {source.label}"),
    ]
    m = source.metrics
    figures = [f"{k}={m[k]:.4g}" for k in ("val_loss", "accuracy", "tokens_per_s") if isinstance(m.get(k), (int, float))]
    if figures:
        lines.append(f"#   {', '.join(figures)}")
    git = _git()
    lines += [
        safe_source.comment(f"Exported by ssmcraft {_version()}" + (f" (git {git})" if git else "") +
                            f", torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}."),
        "# Needs: torch and safetensors (the weights). Optional: triton (CUDA kernels). Everything below the",
        "# imports is ssmcraft's own source, copied section by section (banners name the file), plus the",
        "# generated recurrence for this objective.",
        safe_source.comment(f"Triton kernels: {kernels}."),   # a family's reason may quote an error
    ]
    if layer_only:
        doc = [
            f"The {spec.name} objective mixer, standalone (from {source.label}).",
            "",
            "    import torch",
            f"    from {stem} import Mixer",
            "    layer = Mixer()                     # fresh, with the exported configuration (or Mixer(d_model=...))",
            "    layer = Mixer.from_pretrained()     # trained layer 0 from the folder of this file (layer=i, path)",
            "    y = layer(torch.randn(2, 10, layer.d_model))   # [B, T, d_model] -> [B, T, d_model]",
            "",
            "The recurrence runs the Triton kernels on CUDA when they are inline and triton imports, else the",
            "vectorised PyTorch path; ``layer.last_backend`` says which ran.",
            "",
        ]
    else:
        doc = [
            f"The {spec.name} language model, standalone (from {source.label}).",
            "",
            "    import torch",
            f"    from {stem} import from_pretrained",
            "    model = from_pretrained()        # config.json + model.safetensors next to this file (or a path)",
            "    logits = model(torch.tensor([[1, 2, 3]]))               # [B, T] -> [B, T, vocab]",
            "    state = model.init_state(1)                             # constant-size recurrent state",
            "    logits_t, state = model.step(torch.tensor([4]), state)  # one token: [B] -> [B, vocab]",
            "    logits, state = model.prefill(torch.tensor([[1, 2, 3]]))  # a prompt in one parallel pass, then step",
            "    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8)",
            "",
            "The recurrence runs the Triton kernels on CUDA when they are inline and triton imports, else the",
            "vectorised PyTorch path; ``model.backend`` says which ran (also logged).",
            "``Mixer`` is the mixer layer alone, to drop into another model.",
            "",
        ]
    return "\n".join(lines) + "\n" + safe_source.docstring("\n".join(doc)) + "\n"


def generated_sections(obj, model_config: dict, provenance: dict, kernel_text: str | None,
                       layer_only: bool = False) -> dict[str, Section]:
    rec = recurrence_section(obj.source)
    ir = obj.ir.to_json()
    objective_body = "\n\n".join([
        "# The objective's declarations (what the layer's projections produce), from the spec.\n"
        f"SPEC = {dataclass_literal(obj.spec)}",
        f"# The derived update's IR, as data (ssmcraft derive {obj.spec.name} --json).\nIR = {literal(ir)}",
        f"UPDATE = {safe_source.docstring(obj.update)}",
        rec.body.rstrip(),
        "# The Triton kernels (forward and backward) for this objective, written to a file and imported on\n"
        "# first use on CUDA (Triton reads kernel source from files). None: CPU/PyTorch paths only.\n"
        f"TRITON_SOURCE = {safe_source.docstring(kernel_text) if kernel_text else 'None'}",
    ])
    objective = Section(f"the objective {obj.spec.name!r}: declarations, IR and generated recurrence",
                        objective_body + "\n", {"SPEC", "IR", "UPDATE", "TRITON_SOURCE"} | rec.defines,
                        safe_source.EXPORTED)
    tail_body = "\n\n".join([
        f"MODEL_CONFIG = {literal(model_config)}",
        f"EXPORT = {literal(provenance)}",
        "OBJECTIVE = Objective(SPEC, IR, Recurrence, TRITON_SOURCE, UPDATE, EXPORT['ir_hash'])",
        "__all__ = " + repr(["Mixer", "Objective", "OBJECTIVE", "MODEL_CONFIG", "EXPORT", "load_safetensors",
                             "save_safetensors"] + ([] if layer_only else ["Model", "from_pretrained"])),
    ])
    tail = Section("this export: model config, provenance, the objective instance", tail_body + "\n",
                   {"MODEL_CONFIG", "EXPORT", "OBJECTIVE", "__all__"}, safe_source.EXPORTED)
    return {"objective": objective, "tail": tail}


def readme_text(stem: str, obj, source: TrialSource, layer_only: bool, kernels: str, n_params: int,
                out_name: str) -> str:
    if layer_only:
        usage = [
            f"import sys, torch; sys.path.insert(0, {out_name!r}); from {stem} import Mixer",
            f"layer = Mixer.from_pretrained({out_name!r})  # trained layer 0; Mixer() for a fresh one",
            "y = layer(torch.randn(2, 16, layer.d_model))  # [B, T, d_model] -> [B, T, d_model]",
        ]
    else:
        usage = [
            f"import sys, torch; sys.path.insert(0, {out_name!r}); from {stem} import from_pretrained",
            f"model = from_pretrained({out_name!r})",
            "print(model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=16), model.backend)",
        ]
    lines = [
        f"# {stem}: {'the ' + obj.spec.name + ' mixer layer' if layer_only else obj.spec.name + ' language model'}",
        "",
        f"Exported by ssmcraft from {source.label}. Needs only `torch` and `safetensors` (and `triton` for the "
        "CUDA kernels).",
        "",
        "```python",
        *usage,
        "```",
        "",
        "Files:",
        "",
        f"- `{stem}.py`: the {'mixer' if layer_only else 'model'} (readable; its header shows the objective, the "
        "derived update and where it was trained).",
        f"- `{CONFIG_FILE}`: model config and objective (spec, IR, update); `{WEIGHTS_FILE}`: the weights "
        f"({n_params:,} parameters{', mixers only' if layer_only else ''}), read with the `safetensors` library.",
        "",
        f"Objective `{obj.spec.name}` ({obj.ir.kind}):",
        "",
        "```",
        *obj.update.splitlines(),
        "```",
        "",
        (f"Backend: on CUDA the inline Triton kernels ({kernels}) run, elsewhere the vectorised PyTorch "
         "recurrence. " if kernels.startswith("inline") else
         f"Backend: the vectorised PyTorch recurrence, on CPU and CUDA (Triton kernels: {kernels}). ")
        + ("`layer.last_backend`" if layer_only else "`model.backend`") + " says which ran; set "
        "`SSM_BACKEND=torch|reference|triton` to force one.",
    ]
    if not layer_only:
        lines += ["", "Recurrent inference with a constant-size state: `state = model.init_state(batch)`, then "
                  "`logits, state = model.step(token, state)` per token; `logits, state = model.prefill(tokens)` "
                  "runs a prompt in one parallel pass and returns the state to step on from (`generate` does this)."]
    else:
        lines += ["", "Recurrent use: `cache = layer.init_cache(batch)`, then `y_t, cache = layer.step(h_t, cache)`; "
                  "`y, cache = layer.prefill(h)` runs a prompt in parallel and returns the cache to step on from."]
    return "\n".join(lines) + "\n"


def import_module_from(path: Path, name: str | None = None):
    """Import a Python file under a fresh module name (removed from sys.modules by the caller)."""
    from ssmcraft.compiler.cache import import_file
    # the bundle checked the module when it assembled it (assemble.bundle: its generated sections
    # against safe_source.EXPORTED, every statement a section's)
    return import_file(path, name or f"_ssmcraft_export_check_{uuid.uuid4().hex[:8]}", path.read_text(encoding="utf-8"),
                       policy=None)


PREFILL = 7    # verify's prompt length: odd, longer than the default conv window, shorter than the check's sequence


@torch.no_grad()
def verify(module_path: Path, folder: Path, reference_model, layer_only: bool, seed: int = 0) -> dict:
    """Import the written module and compare it with ssmcraft's model (fp32, CPU)."""
    mod = import_module_from(module_path)
    was_training = reference_model.training
    try:
        gen = torch.Generator().manual_seed(seed)
        ref = reference_model.float().cpu().eval()
        if layer_only:
            out = {"layers": len(ref.recurrent_layers)}
            worst, worst_step, worst_prefill = 0.0, 0.0, 0.0
            for i in ref.recurrent_layers:
                block = ref.blocks[i]
                mixer = mod.Mixer.from_pretrained(str(folder), layer=i)
                h = torch.randn(2, 12, mixer.d_model, generator=gen)
                worst = max(worst, float((mixer(h) - block.mixer(h)).abs().max()))
                cache = mixer.init_cache(2)
                steps = []
                for t in range(h.shape[1]):
                    y_t, cache = mixer.step(h[:, t], cache)
                    steps.append(y_t)
                worst_step = max(worst_step, float((torch.stack(steps, 1) - mixer(h)).abs().max()))
                y_pre, cache = mixer.prefill(h[:, :PREFILL])          # a prompt, then its continuation
                y_more, _ = mixer.prefill(h[:, PREFILL:], cache)
                prefilled = torch.cat([y_pre, y_more], 1)
                worst_prefill = max(worst_prefill, float((prefilled - torch.stack(steps, 1)).abs().max()))
            out.update(max_abs_diff=worst, step_max_abs_diff=worst_step, prefill_max_abs_diff=worst_prefill,
                       shape=[2, 12])
        else:
            model = mod.from_pretrained(str(folder))
            vocab = ref.cfg.vocab_size
            ids = torch.randint(0, vocab, (2, 16), generator=gen)
            logits = model(ids)
            diff = float((logits - ref(ids)).abs().max())
            state = model.init_state(2)
            steps = []
            for t in range(ids.shape[1]):
                lt, state = model.step(ids[:, t], state)
                steps.append(lt)
            step_diff = float((torch.stack(steps, 1) - logits).abs().max())
            prefilled, state = model.prefill(ids[:, :PREFILL])        # a prompt, then steps from its state
            for t in range(PREFILL, ids.shape[1]):
                lt, state = model.step(ids[:, t], state)
                prefilled = torch.cat([prefilled, lt[:, None]], 1)
            out = {"max_abs_diff": diff, "step_max_abs_diff": step_diff, "shape": list(ids.shape),
                   "prefill_max_abs_diff": float((prefilled - torch.stack(steps, 1)).abs().max()),
                   "backend": model.backend}
    finally:
        sys.modules.pop(mod.__name__, None)
        reference_model.train(was_training)
    if not out["max_abs_diff"] <= VERIFY_TOL * 10:
        raise ExportError(f"the exported module does not reproduce ssmcraft's model: max |diff| "
                          f"{out['max_abs_diff']:.3g} (an ssmcraft bug; please report it)")
    if not out["step_max_abs_diff"] <= 1e-3:
        raise ExportError(f"the exported module's step-by-step outputs differ from its parallel forward by "
                          f"{out['step_max_abs_diff']:.3g} (an ssmcraft bug; please report it)")
    if not out["prefill_max_abs_diff"] <= 1e-3:
        raise ExportError(f"the exported module's prefill and steps differ from its step-by-step outputs by "
                          f"{out['prefill_max_abs_diff']:.3g} (an ssmcraft bug; please report it)")
    return out


def exported_model_config(model) -> dict:
    """The model config an export records: the LM's, with every mixer's config (the stack's and
    each placement rule's) filled with its defaults, so the export does not depend on them."""
    from ssmcraft.layers.config import mixer_config

    config = dict(model.cfg.to_dict())
    config["mixer"] = _plain(dataclasses.asdict(mixer_config(config["mixer"])))
    config["layers"] = [{**rule, "mixer": _plain(dataclasses.asdict(mixer_config(rule["mixer"])))}
                        for rule in config["layers"]]
    return config


def _save_weights(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    from ssmcraft.export.runtime import save_safetensors

    save_safetensors(tensors, str(path), {"format": "pt", **metadata})


def export(run_dir: str | Path, out: str | Path, trial: str | int | None = None, *, layer_only: bool = False,
           name: str | None = None, check: bool = True, overwrite: bool = False,
           log_fn: Callable[[str], None] | None = None) -> ExportResult:
    """Export a trained model (see the module docstring); returns what was written."""
    from ssmcraft.train import load_run

    out = Path(out)
    source = resolve_source(run_dir, trial)
    _check_out(out, overwrite)
    model = load_run(source.model_dir)
    return export_model(model, out, source, layer_only=layer_only, name=name, check=check, overwrite=overwrite,
                        log_fn=log_fn)


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a folder; choose another --out")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out}: exists and is not empty; choose another --out or pass --force")


def export_model(model, out: str | Path, source: TrialSource, *, layer_only: bool = False, name: str | None = None,
                 check: bool = True, overwrite: bool = False,
                 log_fn: Callable[[str], None] | None = None) -> ExportResult:
    """Write the export of an ssmcraft ``LM`` (already loaded) to ``out``; ``source`` says
    where it came from (provenance, header and README)."""
    say = log_fn or log.info
    out = Path(out)
    _check_out(out, overwrite)
    modules = [f"layer {i} ({m.cfg.module})" for i, m in enumerate(model.mixers) if m.describe()["kind"] == "module"]
    if modules:
        raise ExportError(f"{source.label}: {', '.join(modules)} is a module mixer, whose code an export cannot carry; "
                          "export writes models built from objective and attention mixers")
    obj = getattr(model, "objective", None)
    if obj is None:
        raise ExportError(f"{source.label}: the model has no objective mixer; export writes objective mixers "
                          "(nothing to derive for attention)")
    run_config = _read_json(Path(source.model_dir) / CONFIG_FILE)
    model_config = exported_model_config(model)
    stem = name or module_stem(obj.spec.name, layer_only)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", stem):
        raise ExportError(f"--name {stem!r} is not a Python module name")
    mixer = model.mixers[model.recurrent_layers[0]]
    kernel_text, kernels = triton_kernel_source(obj, {"d": mixer.d, "m": mixer.m})
    ir_hash = obj.ir.content_hash()
    provenance = {
        "objective": obj.spec.name, "structure": obj.ir.kind, "ir_hash": ir_hash,
        "source": {"kind": source.kind, "run_dir": str(source.run_dir), "trial": source.trial,
                   "model_dir": str(source.model_dir), "study": source.info.get("study"),
                   "seed": source.info.get("seed", run_config.get("seed")),
                   "params": source.info.get("params")},
        "layer_only": layer_only, "ssmcraft": _version(), "git": _git(), "torch": torch.__version__,
    }
    text = bundle(header_text(obj, source, stem, layer_only, kernels), LAYER_PLAN if layer_only else LM_PLAN,
                  generated_sections(obj, model_config, provenance, kernel_text, layer_only))
    state = model.state_dict()
    weights = {k: v for k, v in state.items() if not layer_only or re.match(r"blocks\.\d+\.mixer\.", k)}
    n_params = sum(v.numel() for v in weights.values())
    metrics = {k: v for k, v in source.metrics.items()
               if isinstance(v, (int, float, str, bool)) or v is None}
    config = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "module": f"{stem}.py", "layer_only": layer_only,
        "model": model_config,
        "objective": {"name": obj.spec.name, "summary": obj.spec.summary, "structure": obj.ir.kind,
                      "ir_hash": ir_hash, "update": obj.update, "spec": _plain(obj.spec.raw),
                      "ir": obj.ir.to_json()},
        "source": provenance["source"], "metrics": metrics,
        "exported_by": {"ssmcraft": _version(), "git": provenance["git"], "torch": torch.__version__,
                        "kernels": kernels},
    }
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]   # removed again on failure
    stage = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:12]}"
    try:
        stage.mkdir(parents=True)
    except OSError as e:
        raise ExportError(f"{out}: cannot write beside it ({e.strerror or type(e).__name__}: {e.filename})") from None
    try:
        module_path = stage / f"{stem}.py"
        module_path.write_text(text, encoding="utf-8")
        (stage / CONFIG_FILE).write_text(json.dumps(config, indent=2, allow_nan=False) + "\n")
        _save_weights(weights, stage / WEIGHTS_FILE, {"format": "pt", "objective": obj.spec.name,
                                                      "source": source.label, "ir_hash": ir_hash})
        (stage / README_FILE).write_text(readme_text(stem, obj, source, layer_only, kernels, n_params,
                                                     str(out)))
        checked = verify(module_path, stage, model, layer_only) if check else None
        files = [out / f.name for f in sorted(stage.iterdir())]
        _put_in_place(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for folder in made:
            _remove_empty(folder)
        raise
    result = ExportResult(out, out / f"{stem}.py", files, source, obj.spec.name, obj.ir.kind, layer_only,
                          kernels, n_params, checked)
    say(f"exported {source.label}: {obj.spec.name} ({obj.ir.kind}), {n_params:,} parameters -> {out}")
    return result


def _put_in_place(stage: Path, out: Path) -> None:
    """Move the finished export from ``stage`` to ``out``: one rename when ``out`` is absent or an
    empty folder (a reader sees no export or all of it), else (``--force``) file by file."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        os.replace(stage, out)
        return
    for f in sorted(stage.iterdir()):
        os.replace(f, out / f.name)
    stage.rmdir()


def _remove_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:          # not empty (another writer) or gone: leave it
        pass


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value):
        return _plain(dataclasses.asdict(value))
    return value
