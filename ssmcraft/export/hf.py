"""``ssmcraft export --format hf``: a trained LM -> a folder ``transformers`` loads.

::

    EXP/
      config.json                  the transformers config: model_type, auto_map, sizes, the
                                   ssmcraft model config and objective, the weights' SHA-256
      configuration_ssmcraft.py    SsmcraftConfig (ssmcraft/export/hf_configuration.py)
      modeling_ssmcraft.py         SsmcraftForCausalLM + SsmcraftCache (ssmcraft/export/hf_modeling.py)
      <objective>_ssm.py           the exported module (ssmcraft.export.exporter): layers,
                                   recurrence, kernels; the modeling file imports it
      model.safetensors            the module's weights, named as SsmcraftForCausalLM's ("model." + the module's)
      tokenizer.json, tokenizer_config.json   a byte-level tokenizer, when the model is byte-level
      README.md                    usage

``AutoModelForCausalLM.from_pretrained(EXP, trust_remote_code=True)`` loads it. The two remote-code
files are ssmcraft's own modules copied as they are, their ssmcraft imports turned into relative
imports of the exported module (whose names are checked to exist) and the config file's placeholder
``MODULE_SHA256`` set to the module's hash (a hex string literal); nothing else is generated, and no
spec text reaches them (it is data in config.json). Unless ``check=False`` the folder is loaded with
``transformers`` before it is put in place and compared with the exported module: logits, and
greedy generation token for token.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import sys
import uuid
from pathlib import Path
from typing import Callable

import torch

from ssmcraft.compiler import safe_source
from ssmcraft.fileio import file_sha256
from ssmcraft.export.assemble import ExportError, _is_ssmcraft, _top_level_names, import_problem
from ssmcraft.export.exporter import (CONFIG_FILE, README_FILE, WEIGHTS_FILE, ExportResult, TrialSource, _check_out,
                                      _put_in_place, _read_json, _remove_empty, _save_weights, export_model,
                                      import_module_from, resolve_source)
from ssmcraft.export.runtime import load_safetensors

INSTALL = "pip install 'ssmcraft[hf]'"
CONFIG_MODULE = "ssmcraft.export.hf_configuration"
REMOTE_CODE = {"configuration_ssmcraft.py": CONFIG_MODULE, "modeling_ssmcraft.py": "ssmcraft.export.hf_modeling"}
REMOTE_IMPORTS = ("torch", "safetensors", "transformers")   # what the remote-code files may import
PREFIX = "model."            # SsmcraftForCausalLM holds the exported Model as ``self.model``
# tasks whose tokens are bytes (one token per byte, vocabulary 256): the folder gets a byte tokenizer
BYTE_TASKS = ("text", "passkey")
BYTE_VOCAB = 256
VERIFY_TOL = 1e-5
VERIFY_NEW_TOKENS = 12


def require_transformers():
    """``transformers``, or an ``ExportError`` saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ExportError(f"--format hf needs the transformers package, which is not installed; {INSTALL}") from None
    return transformers


# -- the remote-code files ---------------------------------------------------------------------
def remote_code(module_name: str, stem: str, bundle_names: set[str], constants: dict[str, str] | None = None) -> str:
    """The source of ssmcraft's ``module_name`` with each top-level ``from ssmcraft.x import names``
    made ``from .<stem> import names`` (``.configuration_ssmcraft`` for the config module); every
    name must be one the exported module defines, and nothing else may be imported but the standard
    library, torch, safetensors and transformers. ``constants``: top-level names the module assigns
    a placeholder, given a string value here (a literal through ``safe_source.string``)."""
    path = Path(importlib.util.find_spec(module_name).origin)
    where = f"ssmcraft/export/{path.name}"
    source = path.read_text(encoding="utf-8")
    problem = import_problem(source, where, REMOTE_IMPORTS, ssmcraft=True)
    if problem is not None:
        raise ExportError(problem)
    tree = ast.parse(source)
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _is_ssmcraft(node.module) and id(node) not in top:
            raise ExportError(f"{where}:{node.lineno}: an ssmcraft import inside a function cannot become a "
                              "relative import")
    lines = source.splitlines()
    constants = dict(constants or {})
    for node in reversed(tree.body):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id in constants:
            lines[node.lineno - 1:node.end_lineno] = [f"{target.id} = {safe_source.string(constants.pop(target.id))}"]
            continue
        if not (isinstance(node, ast.ImportFrom) and _is_ssmcraft(node.module)):
            continue
        names = [a.name for a in node.names]
        if any(a.asname for a in node.names):
            raise ExportError(f"{where}:{node.lineno}: a renamed ssmcraft import cannot become a relative import")
        target = "configuration_ssmcraft" if node.module == CONFIG_MODULE else stem
        missing = sorted(set(names) - bundle_names) if target == stem else []
        if missing:
            raise ExportError(f"{where}:{node.lineno}: imports {', '.join(missing)} from {node.module}, which the "
                              f"exported module {stem}.py does not define")
        lines[node.lineno - 1:node.end_lineno] = [f"from .{target} import {', '.join(names)}"]
    if constants:
        raise ExportError(f"{where}: assigns no placeholder {', '.join(sorted(constants))} to set")
    text = "\n".join(lines) + "\n"
    compile(text, where, "exec")
    return text


def byte_tokenizer(transformers, folder: Path) -> None:
    """A tokenizer whose token ``b`` is the byte ``b`` (what the byte-level tasks train on), written
    with ``tokenizers`` as ``tokenizer.json`` + ``tokenizer_config.json``: no remote code. The bytes
    are spelled with GPT-2's printable byte alphabet so that the ByteLevel pre-tokenizer and decoder
    turn text into UTF-8 bytes and back. It has no special tokens: every id is a byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(BYTE_VOCAB)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # a recurrent model has no context limit; 2**30 tells tools (lm-eval) so without the "unset" sentinel
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 30)
    fast.save_pretrained(str(folder))


def hf_config(export_config: dict, stem: str, weights_sha256: str, dtype: str) -> dict:
    """config.json: what transformers reads, then the export's own record (model config, objective,
    source, metrics)."""
    model = export_config["model"]
    return {
        "architectures": ["SsmcraftForCausalLM"],
        "model_type": "ssmcraft",
        "auto_map": {"AutoConfig": "configuration_ssmcraft.SsmcraftConfig",
                     "AutoModelForCausalLM": "modeling_ssmcraft.SsmcraftForCausalLM"},
        "vocab_size": model["vocab_size"], "hidden_size": model["d_model"], "num_hidden_layers": model["n_layers"],
        "tie_word_embeddings": True, "use_cache": True, "dtype": dtype,
        "module": f"{stem}.py", "weights_sha256": weights_sha256,
        "ssmcraft": model,
        **{k: export_config[k] for k in ("objective", "source", "metrics", "exported_by")},
    }


def readme_text(stem: str, objective: str, label: str, byte_level: bool, out_name: str) -> str:
    load = [
        "from transformers import AutoModelForCausalLM" + (", AutoTokenizer" if byte_level else ""),
        f"model = AutoModelForCausalLM.from_pretrained({out_name!r}, trust_remote_code=True)",
    ]
    if byte_level:
        load += [f"tok = AutoTokenizer.from_pretrained({out_name!r}, trust_remote_code=True)",
                 "ids = tok('def f(x):', return_tensors='pt').input_ids",
                 "print(tok.decode(model.generate(ids, max_new_tokens=32, do_sample=False)[0]))"]
    else:
        load += ["import torch", "print(model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=16, do_sample=False))"]
    lines = [
        f"# {stem}: the {objective} language model for transformers", "",
        f"Exported by ssmcraft from {label}. Needs `torch`, `safetensors` and `transformers` "
        f"(`{INSTALL}`); `triton` for the CUDA kernels.", "",
        "```python", *load, "```", "",
        "`generate` runs the prompt in one parallel pass and the new tokens through the recurrent step, with a "
        "cache (`SsmcraftCache`) that holds every layer's state: its size does not grow with the new tokens "
        "(attention layers aside). Batches must not be padded on the left (a recurrent state cannot skip "
        "tokens): generate one prompt at a time, or prompts of one length.", "",
        f"`{WEIGHTS_FILE}` is checked against the SHA-256 in `{CONFIG_FILE}` before it is loaded.",
        f"`{stem}.py` is the exported module (also usable on its own: see its header).",
    ]
    if byte_level:
        lines += ["", "Tokenizer: one token per byte of UTF-8 text (ids 0..255), no special tokens.", "",
                  "lm-eval-harness:", "", "```",
                  f"lm_eval --model hf --model_args pretrained={out_name},trust_remote_code=True,prefix_token_id=10 "
                  "--tasks TASKS --batch_size 1", "```", "",
                  "`prefix_token_id=10`: the tokenizer has no BOS/EOS token (every id is a byte), so lm-eval "
                  "needs a token to start an empty context with; a newline is the natural one for text. Tasks that "
                  "generate until an end-of-text token need one too, which a byte model does not have."]
    return "\n".join(lines) + "\n"


# -- writing ------------------------------------------------------------------------------------
def export_run(run_dir: str | Path, out: str | Path, trial: str | int | None = None, **options) -> ExportResult:
    """``export_hf`` of a search folder's trial or a training run folder (``exporter.resolve_source``)."""
    from ssmcraft.train import load_run

    require_transformers()
    source = resolve_source(run_dir, trial)
    _check_out(Path(out), options.get("overwrite", False))
    return export_hf(load_run(source.model_dir), out, source, **options)


def is_byte_level(source: TrialSource, vocab_size: int) -> bool:
    """Whether the run trained on bytes: its task is one of ``BYTE_TASKS`` (read from its config.json)."""
    task = _read_json(Path(source.model_dir) / CONFIG_FILE).get("task")
    return isinstance(task, dict) and task.get("name") in BYTE_TASKS and vocab_size == BYTE_VOCAB


def export_hf(model, out: str | Path, source: TrialSource, *, name: str | None = None, check: bool = True,
              overwrite: bool = False, log_fn: Callable[[str], None] | None = None) -> ExportResult:
    """Write the ``transformers`` folder of an ssmcraft ``LM`` (already loaded) to ``out`` (see the
    module docstring); returns what was written, ``verified`` with the transformers comparison."""
    transformers = require_transformers()
    if name is not None and f"{name}.py" in REMOTE_CODE:
        raise ExportError(f"--name {name!r} is the name of a transformers file of the folder; choose another")
    out = Path(out)
    _check_out(out, overwrite)
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]   # removed again on failure
    stage = out.parent / f".{out.name}.hf-{uuid.uuid4().hex[:12]}"
    try:
        module = export_model(model, stage / "module", source, name=name, check=check, log_fn=lambda _m: None)
        folder = stage / "hf"
        folder.mkdir()
        stem = module.module.stem
        text = (stage / "module" / module.module.name).read_text(encoding="utf-8")
        (folder / module.module.name).write_text(text, encoding="utf-8")
        names = set().union(*(_top_level_names(n) for n in ast.parse(text).body))
        constants = {"MODULE_SHA256": file_sha256(folder / module.module.name)}
        for file, module_name in REMOTE_CODE.items():
            text = remote_code(module_name, stem, names, constants if module_name == CONFIG_MODULE else None)
            (folder / file).write_text(text, encoding="utf-8")
        export_config = json.loads((stage / "module" / CONFIG_FILE).read_text())
        weights = {PREFIX + k: v for k, v in load_safetensors(stage / "module" / WEIGHTS_FILE).items()}
        _save_weights(weights, folder / WEIGHTS_FILE, {"objective": module.objective, "source": source.label,
                                                        "ir_hash": export_config["objective"]["ir_hash"]})
        config = hf_config(export_config, stem, file_sha256(folder / WEIGHTS_FILE),
                           str(next(iter(weights.values())).dtype).removeprefix("torch."))
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, allow_nan=False) + "\n")
        byte_level = is_byte_level(source, config["vocab_size"])
        if byte_level:
            byte_tokenizer(transformers, folder)
        (folder / README_FILE).write_text(readme_text(stem, module.objective, source.label, byte_level, str(out)))
        checked = {**module.verified, **verify_hf(folder, stem, byte_level)} if check else None
        files = [out / f.name for f in sorted(folder.iterdir())]
        _put_in_place(folder, out)
    except BaseException:
        for parent in made:
            _remove_empty(parent)
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    (log_fn or (lambda _m: None))(f"exported {source.label} for transformers -> {out}")
    return ExportResult(out, out / module.module.name, files, source, module.objective, module.structure, False,
                        module.kernels, module.n_params, checked)


@torch.no_grad()
def verify_hf(folder: Path, stem: str, byte_level: bool, seed: int = 0) -> dict:
    """Load ``folder`` with ``transformers`` (trust_remote_code) and compare it with the exported module
    loaded on its own: logits on random ids, and greedy ``generate`` token for token (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    mod = import_module_from(folder / f"{stem}.py")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()          # a check, not a download: no progress bar on the command line
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
        ref = mod.Model(hf.config.ssmcraft)
        ref.load_state_dict({k[len(PREFIX):]: v for k, v in hf.state_dict().items()}, strict=True)
        ref.eval()
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, hf.config.vocab_size, (2, 9), generator=gen)
        diff = float((hf(ids).logits - ref(ids)).abs().max())
        ours = hf.generate(ids, max_new_tokens=VERIFY_NEW_TOKENS, do_sample=False)
        theirs = ref.generate(ids, VERIFY_NEW_TOKENS)
        same = bool(torch.equal(ours, theirs))
        tokenizer = verify_tokenizer(folder) if byte_level else None
    finally:
        sys.modules.pop(mod.__name__, None)
        if bars:
            hf_logging.enable_progress_bar()
    if not diff <= VERIFY_TOL:
        raise ExportError(f"the transformers model does not reproduce the exported module: max |diff| {diff:.3g} "
                          "(an ssmcraft bug; please report it)")
    if not same:
        raise ExportError("the transformers model's greedy generate differs from the exported module's "
                          "(an ssmcraft bug; please report it)")
    return {"hf_max_abs_diff": diff, "hf_generate_equal": same, "hf_shape": list(ids.shape),
            "hf_new_tokens": VERIFY_NEW_TOKENS, "hf_tokenizer": tokenizer}


def verify_tokenizer(folder: Path) -> str:
    """The written tokenizer maps text to its UTF-8 bytes and back."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    text = "def f(x):\n\treturn 'h\u00e9llo \u2713'\x00"
    ids = tok(text).input_ids
    if ids != list(text.encode("utf-8")) or tok.decode(ids) != text:
        raise ExportError("the byte tokenizer does not map text to its UTF-8 bytes and back (an ssmcraft bug; "
                          "please report it)")
    return "bytes round trip"
