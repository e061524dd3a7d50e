"""``ssmcraft export --format hf``: the folder loads with ``AutoModelForCausalLM`` (trust_remote_code),
its logits and ``generate`` (greedy and seeded sampling, with the cache) equal the exported module's,
for a byte LM (with its tokenizer) and a hybrid stack; tampered weights or config are refused; the
command says how to install transformers when it is missing."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import code_corpus, subprocess_env, tiny_text_experiment

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'ssmcraft[hf]')")

SWA = {"kind": "attention", "heads": 2, "window": 3}
FULL = {"kind": "attention", "heads": 2}
NEW = 24                         # new tokens per generate: past the sliding window and the training length


def _train_byte_lm(root):
    from ssmcraft.train import train_run

    (root / "corpus").mkdir()
    config = tiny_text_experiment(code_corpus(root / "corpus"), batch_size=4, steps=3)
    config["train"]["eval_every"] = 0
    assert train_run(config, root / "byte")["status"] == "ok"
    return root / "byte"


def _random_hybrid(root):
    """A freshly initialised hybrid (objective, sliding-window and full attention layers) of another
    objective: its greedy continuations vary (a barely trained byte LM's are mostly spaces), and it
    is no byte-level run, so its folder has no tokenizer."""
    from ssmcraft.export.exporter import TrialSource
    from ssmcraft.train.checkpoint import build_lm

    torch.manual_seed(0)
    model = build_lm({"model": {"vocab_size": 256, "d_model": 16, "n_layers": 3, "mlp_ratio": 2,
                                "mixer": {"kind": "objective", "objective": "mamba", "state_size": 4},
                                "layers": [{"at": [1], "mixer": SWA}, {"at": [2], "mixer": FULL}]}})
    (root / "hybrid").mkdir()
    return model.eval(), TrialSource("train", root / "hybrid", root / "hybrid")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """name -> (the --format hf folder, the standalone export of the same model)."""
    from ssmcraft.cli import main
    from ssmcraft.export.exporter import export_model
    from ssmcraft.export.hf import export_hf

    root = tmp_path_factory.mktemp("hf")
    run = _train_byte_lm(root)
    assert main(["export", str(run), "--out", str(root / "byte_hf"), "--format", "hf"]) == 0
    assert main(["export", str(run), "--out", str(root / "byte_module")]) == 0
    model, source = _random_hybrid(root)
    result = export_hf(model, root / "hybrid_hf", source)
    assert result.verified["hf_generate_equal"] and result.verified["hf_tokenizer"] is None
    assert not (root / "hybrid_hf" / "tokenizer.json").exists()
    export_model(model, root / "hybrid_module", source)
    return {name: (root / f"{name}_hf", root / f"{name}_module") for name in ("byte", "hybrid")}


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()


def _module(folder):
    from ssmcraft.export.exporter import import_module_from

    [path] = [p for p in folder.glob("*.py")]
    return import_module_from(path).from_pretrained(str(folder))


@pytest.mark.parametrize("name", ["byte", "hybrid"])
@torch.no_grad()
def test_hf_model_matches_the_exported_module(exports, name):
    hf_dir, module_dir = exports[name]
    hf, module = _load(hf_dir), _module(module_dir)
    assert type(hf).__name__ == "SsmcraftForCausalLM" and hf.config.model_type == "ssmcraft"
    if name == "hybrid":
        assert [type(b.mixer).__name__ for b in hf.model.blocks] == ["ObjectiveMixer", "AttentionMixer", "AttentionMixer"]
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hf(ids).logits, module(ids), rtol=0, atol=1e-5)
    prompt = ids[:, :5]
    greedy = hf.generate(prompt, max_new_tokens=NEW, do_sample=False)
    assert greedy.shape == (2, 5 + NEW)
    assert torch.equal(greedy, module.generate(prompt, NEW))
    torch.manual_seed(123)
    sampled = hf.generate(prompt, max_new_tokens=NEW, do_sample=True, temperature=0.9, top_k=40)
    torch.manual_seed(123)
    assert torch.equal(sampled, module.generate(prompt, NEW, temperature=0.9, top_k=40))
    assert not torch.equal(sampled, greedy)           # sampling took another path: the comparison above tests it
    if name == "hybrid":                              # greedy tokens that vary: the comparison tests them
        assert len(set(greedy[:, 5:].flatten().tolist())) > NEW // 3


@torch.no_grad()
def test_generate_prefills_once_then_steps_from_the_cache(exports):
    hf = _load(exports["hybrid"][0])
    calls = {"prefill": 0, "step": 0, "forward": 0}
    for what in calls:
        original = getattr(hf.model, what)

        def counted(*args, _original=original, _what=what, **kwargs):
            calls[_what] += 1
            return _original(*args, **kwargs)
        setattr(hf.model, what, counted)
    out = hf.generate(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 13)
    assert calls == {"prefill": 1, "step": 5, "forward": 0}    # the last new token needs no step


@torch.no_grad()
def test_beam_search_reorders_the_cache(exports, monkeypatch):
    """Beam search with the cache (prefill, steps, rows reordered per step) picks what it picks
    re-running the whole sequence each step without one."""
    hf = _load(exports["hybrid"][0])
    cache_class = type(hf(torch.tensor([[1]]), use_cache=True).cache)
    picks = []
    monkeypatch.setattr(cache_class, "reorder_cache",
                        lambda self, idx, _reorder=cache_class.reorder_cache: (picks.append(idx.tolist()),
                                                                               _reorder(self, idx)))
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    options = {"max_new_tokens": 8, "num_beams": 3, "num_return_sequences": 2, "do_sample": False}
    cached = hf.generate(prompt, use_cache=True, **options)
    assert torch.equal(cached, hf.generate(prompt, use_cache=False, **options))
    assert any(p != sorted(p) or len(set(p)) < len(p) for p in picks)     # the beams were reordered


@torch.no_grad()
def test_left_padding_is_refused_and_save_pretrained_reloads(exports, tmp_path):
    hf = _load(exports["byte"][0])
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]])
    # the exported module's own SsmcraftError (the folder's code does not import ssmcraft)
    with pytest.raises(Exception, match="padding .* with a cache: a recurrent state cannot skip tokens") as e:
        hf.generate(ids, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), max_new_tokens=2)
    assert type(e.value).__name__ == "SsmcraftError"
    with pytest.raises(Exception, match="pads on the left or has gaps"):
        hf(ids, attention_mask=torch.tensor([[1, 0, 1], [1, 1, 1]]), use_cache=False)
    right = hf(ids, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]), use_cache=False).logits
    torch.testing.assert_close(right, hf(ids, use_cache=False).logits, rtol=0, atol=0)
    with torch.enable_grad():                           # a step of fine-tuning, then save and load it back
        hf.train()
        out = hf(ids, labels=ids)
        assert out.cache is None                        # training runs the parallel pass, no cache
        out.loss.backward()
        with torch.no_grad():
            for p in hf.parameters():
                p -= 0.1 * p.grad
        hf.eval()
    hf.save_pretrained(tmp_path / "tuned")
    again = _load(tmp_path / "tuned")
    torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=0)
    assert not torch.equal(again(ids).logits, _load(exports["byte"][0])(ids).logits)


@torch.no_grad()
def test_byte_tokenizer_and_text_generation(exports):
    from transformers import AutoTokenizer

    hf_dir, module_dir = exports["byte"]
    tok = AutoTokenizer.from_pretrained(str(hf_dir), trust_remote_code=True)
    text = "def f(x):\n    return 'é ✓'"
    ids = tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(text.encode("utf-8"))
    out = _load(hf_dir).generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, _module(module_dir).generate(ids, 8))
    assert tok.decode(out[0, :ids.shape[1]]) == text
    assert not (exports["byte"][0] / "special_tokens_map.json").exists() or tok.all_special_ids == []


def test_tampered_weights_and_config_are_refused(exports, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    hf_dir = exports["byte"][0]
    bad = tmp_path / "bad_weights"
    shutil.copytree(hf_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.norm_f.weight"] = tensors["model.norm_f.weight"] + 1
    save_file(tensors, str(bad / "model.safetensors"), {"format": "pt"})
    with pytest.raises(Exception, match=r"model\.safetensors: SHA-256 [0-9a-f]{64} is not the weights_sha256 "
                                        r"config\.json records .*the weights were changed after export"):
        _load(bad)
    wrong = tmp_path / "bad_config"
    shutil.copytree(hf_dir, wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["objective"]["ir_hash"] = "0" * 16
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"config\.json: objective\.ir_hash '0{16}' is not the IR this module was "
                                        "exported with"):
        _load(wrong)


def test_remote_code_imports_only_names_the_module_defines():
    from ssmcraft.export.assemble import ExportError
    from ssmcraft.export.hf import remote_code

    text = remote_code("ssmcraft.export.hf_modeling", "gla_ssm", {"SsmcraftError", "file_sha256", "EXPORT", "WEIGHTS_FILE", "Model"})
    assert "from .gla_ssm import Model" in text and "from .configuration_ssmcraft import SsmcraftConfig" in text
    assert "ssmcraft." not in "".join(l for l in text.splitlines() if l.startswith(("from", "import")))
    config = remote_code("ssmcraft.export.hf_configuration", "gla_ssm", set(), {"MODULE_SHA256": "ab\"\n12"})
    assert 'MODULE_SHA256 = "ab\\"\\n12"' in config                   # a string literal, whatever the value
    with pytest.raises(ExportError, match="assigns no placeholder NOPE to set"):
        remote_code("ssmcraft.export.hf_configuration", "gla_ssm", set(), {"NOPE": "1"})
    with pytest.raises(ExportError, match=r"imports Model from ssmcraft\.export\.runtime_lm, which the exported "
                                          r"module gla_ssm\.py does not define"):
        remote_code("ssmcraft.export.hf_modeling", "gla_ssm", {"SsmcraftError", "file_sha256", "EXPORT", "WEIGHTS_FILE"})


def test_cli_refusals_are_one_line_and_write_nothing(exports, tmp_path, monkeypatch, capsys):
    from ssmcraft.cli import main

    run = exports["byte"][0].parent / "byte"          # the training run folder
    assert main(["export", str(run), "--out", str(tmp_path / "z"), "--format", "hf", "--name", "modeling_ssmcraft"]) == 2
    assert "--name 'modeling_ssmcraft' is the name of a transformers file of the folder" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)          # importing it now raises ImportError
    assert main(["export", str(run), "--out", str(tmp_path / "x"), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--format hf needs the transformers package, which is not installed; "
                        "pip install 'ssmcraft[hf]'") and "\n" not in err
    assert main(["export", str(run), "--out", str(tmp_path / "y"), "--format", "hf", "--layer-only"]) == 2
    assert "drop it for --format hf" in capsys.readouterr().err
    assert not any((tmp_path / x).exists() for x in "xyz")


def test_the_core_never_imports_transformers():
    # ssmcraft.export.hf too: the command imports it first, then says how to install transformers when missing
    code = ("import sys, ssmcraft.cli, ssmcraft.export.exporter, ssmcraft.export.commands, ssmcraft.export.hf, "
            "ssmcraft.train\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=subprocess_env())


def test_the_folder_loads_without_ssmcraft(exports):
    """The folder's code is its own: transformers loads and runs it with ssmcraft unimportable (sympy
    stays: torch itself imports it)."""
    code = ("import sys\n"
            "sys.modules['ssmcraft'] = None\n"
            "import torch\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "path = sys.argv[1]\n"
            "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()\n"
            "tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)\n"
            "ids = tok('def f(x):', return_tensors='pt').input_ids\n"
            "out = model.generate(ids, max_new_tokens=4, do_sample=False)\n"
            "print('GENERATED', out.shape[1], sorted(n for n, m in sys.modules.items() if n.startswith('ssmcraft') and m is not None))\n")
    run = subprocess.run([sys.executable, "-c", code, str(exports["byte"][0])], capture_output=True, text=True,
                         env=subprocess_env())
    assert run.returncode == 0, run.stderr[-2000:]
    assert "GENERATED 13 []" in run.stdout
