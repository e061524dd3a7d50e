"""The exported module's entry points check their inputs (one ``SsmcraftError`` line instead of a
torch error deep inside, or a silent wrong result), refuse an unknown ``SSM_BACKEND``, and read
weights with the ``safetensors`` library: corrupt export folders are one line too.

One tiny run is trained and exported (full model and ``--layer-only``) per module, on CPU.
"""
from __future__ import annotations

import json
import random
import shutil
import sys

import numpy
import pytest
import torch


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from ssmcraft.export import export
    from ssmcraft.train import train_run

    root = tmp_path_factory.mktemp("exported")
    config = {"name": "inputs", "seed": 0,
              "task": {"name": "mqar", "vocab": 32, "seq_len": 16, "num_kv_pairs": 2},
              "model": {"d_model": 16, "n_layers": 2, "mlp_ratio": 2,
                        "mixer": {"kind": "objective", "objective": "longhorn", "state_size": 8}},
              "train": {"batch_size": 8, "tokens": 8 * 16, "eval_every": 0, "eval_batches": 1, "eval_batch_size": 8}}
    assert train_run(config, root / "run")["status"] == "ok"
    export(root / "run", root / "lm", check=False)
    export(root / "run", root / "layer", layer_only=True, check=False)
    return root


def load(folder):
    from ssmcraft.export.exporter import import_module_from

    [path] = folder.glob("*.py")
    return import_module_from(path)


@pytest.fixture(scope="module")
def lm(exported):
    mod = load(exported / "lm")
    yield mod, mod.from_pretrained(str(exported / "lm"))
    sys.modules.pop(mod.__name__, None)


@pytest.fixture(scope="module")
def layer(exported):
    mod = load(exported / "layer")
    yield mod, mod.Mixer.from_pretrained(str(exported / "layer"), layer=1)
    sys.modules.pop(mod.__name__, None)


def one_line(mod, call, *texts):
    with pytest.raises(mod.SsmcraftError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message, message
    for text in texts:
        assert text in message, message


ids = torch.tensor([[1, 2, 3], [4, 5, 6]])


@pytest.mark.parametrize("case, texts", [
    (lambda m: m(ids.float()), ["Model: tokens", "int64 or int32 tensor [B, T]", "torch.float32"]),
    (lambda m: m(ids.tolist()), ["Model: tokens", "got list"]),
    (lambda m: m(ids[:, :, None]), ["expected token ids [B, T] with every size >= 1, got shape [2, 3, 1]"]),
    (lambda m: m(ids[:0]), ["got shape [0, 3]"]),
    (lambda m: m(ids[:, :0]), ["got shape [2, 0]"]),
    (lambda m: m(ids + 40), ["token id 46 is outside the vocabulary [0, 32)"]),
    (lambda m: m(ids - 2), ["token id -1 is outside the vocabulary [0, 32)"]),
    (lambda m: m.step(ids[:, 0], []), ["step: state must hold one cache per layer (2; from init_state), got 0"]),
    (lambda m: m.step(ids[:, 0], m.init_state(2)[:1]), ["got 1 entries"]),
    (lambda m: m.step(ids[:, 0], None), ["got NoneType"]),
    (lambda m: m.step(ids[:, 0], m.init_state(3)), ["step: state[0]: expected a cache from init_cache(2)"]),
    (lambda m: m.step(ids[:, 0], [None, None]), ["step: state[0]", "got NoneType"]),
    (lambda m: m.step(ids, m.init_state(2)), ["step: token_t", "[B] with every size >= 1, got shape [2, 3]"]),
    (lambda m: m.init_state(0), ["init_state: batch_size: expected an integer >= 1, got 0"]),
    (lambda m: m.init_state(True), ["got True"]),
    (lambda m: m.generate(ids, max_new_tokens=-1), ["generate: max_new_tokens: expected an integer >= 0, got -1"]),
    (lambda m: m.generate(ids, max_new_tokens=2.5), ["got 2.5"]),
    (lambda m: m.generate(ids, 2, temperature=-1.0), ["generate: temperature must be a finite number >= 0"]),
    (lambda m: m.generate(ids, 2, temperature=float("nan")), ["got nan"]),
    (lambda m: m.generate(ids, 2, temperature=1.0, top_k=0), ["generate: top_k: expected an integer >= 1"]),
    (lambda m: m.generate([], 2), ["generate: ids", "int64 or int32 tensor [T]", "torch.float32"]),
    (lambda m: m.generate(torch.zeros(0, dtype=torch.long), 2), ["expected token ids [T] with every size >= 1"]),
    (lambda m: m.generate([[1, 2], [3]], 2), ["generate: ids must be token ids [T] or [B, T]"]),
])
def test_model_inputs_are_checked(lm, case, texts):
    mod, model = lm
    one_line(mod, lambda: case(model), *texts)


def test_checked_entry_points_still_run(lm):
    mod, model = lm
    with torch.no_grad():
        logits = model(ids)
    state = model.init_state(2)
    steps = []
    for t in range(ids.shape[1]):
        with torch.no_grad():
            lt, state = model.step(ids[:, t], tuple(state))
        steps.append(lt)
    assert float((torch.stack(steps, 1) - logits).abs().max()) < 1e-5
    assert torch.equal(model.generate(ids, max_new_tokens=0), ids)
    assert model.generate(ids.numpy(), max_new_tokens=numpy.int64(1)).shape == (2, 4)   # numpy ids and counts
    out = model.generate([1, 2, 3], 4, temperature=0.7, top_k=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (7,) and torch.equal(out[:3], torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("case, texts", [
    (lambda m: m(torch.randn(2, 16)), ["Mixer: h: expected [B, T, 16] with every size >= 1, got shape [2, 16]"]),
    (lambda m: m(torch.randn(2, 3, 15)), ["got shape [2, 3, 15]"]),
    (lambda m: m(torch.randn(2, 0, 16)), ["got shape [2, 0, 16]"]),
    (lambda m: m(torch.zeros(2, 3, 16, dtype=torch.long)), ["Mixer: h: expected a floating-point tensor"]),
    (lambda m: m(torch.randn(2, 3, 16, dtype=torch.float64)), ["got torch.float64 on cpu; the layer's weights are "
                                                               "torch.float32"]),
    (lambda m: m.step(torch.randn(2, 16), m.init_cache(3)), ["Mixer.step: cache: expected a cache from init_cache(2)"]),
    (lambda m: m.step(torch.randn(2, 16), None), ["Mixer.step: cache", "got NoneType"]),
    (lambda m: m.step(torch.randn(2, 3, 16), m.init_cache(2)), ["Mixer.step: h_t: expected [B, 16]"]),
    (lambda m: m.init_cache(0), ["Mixer.init_cache: batch_size: expected an integer >= 1, got 0"]),
])
def test_mixer_inputs_are_checked(layer, case, texts):
    mod, mixer = layer
    one_line(mod, lambda: case(mixer), *texts)


def test_autocast_inputs_of_another_dtype_run(layer):
    _, mixer = layer
    h = torch.randn(2, 3, 16).bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert mixer(h).shape == (2, 3, 16)


def test_mixer_layer_index_is_checked(layer, exported):
    mod, _ = layer
    for bad in (2, -1, True, "0"):
        one_line(mod, lambda: mod.Mixer.from_pretrained(str(exported / "layer"), layer=bad), "out of range",
                 "the model has 2 layers")


def test_an_unknown_backend_is_refused_at_import(exported, monkeypatch):
    from ssmcraft.errors import SsmcraftError

    monkeypatch.setenv("SSM_BACKEND", "garbage")
    with pytest.raises(Exception) as e:
        load(exported / "lm")
    assert type(e.value).__name__ == SsmcraftError.__name__ and "\n" not in str(e.value)
    assert str(e.value) == ("SSM_BACKEND='garbage' is not a backend; choose one of auto, torch, reference, triton, "
                            "interpret (or leave it unset: auto)")
    monkeypatch.setenv("SSM_BACKEND", "reference")
    mod = load(exported / "lm")
    try:
        model = mod.from_pretrained(str(exported / "lm"))
        model(ids)
        assert model.backend == "reference-loop"
    finally:
        sys.modules.pop(mod.__name__, None)


def test_corrupt_export_folders_are_one_line(lm, exported, tmp_path):
    mod, _ = lm
    folder = tmp_path / "lm"
    shutil.copytree(exported / "lm", folder)
    weights = (folder / "model.safetensors").read_bytes()
    config = (folder / "config.json").read_bytes()
    rng = random.Random(0)
    n = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    first, second = header[names[0]]["data_offsets"], header[names[1]]["data_offsets"]
    overlapping = dict(header, **{names[1]: dict(header[names[1]], data_offsets=[first[0], first[0] + second[1] - second[0]])})
    head = json.dumps(overlapping).encode()
    head += b" " * (-len(head) % 8)
    flip = 8 + rng.randrange(n)              # a header byte: not UTF-8 any more
    hostile = [
        ("model.safetensors", weights[:len(weights) // 3], "not a readable safetensors file"),
        ("model.safetensors", b"", "not a readable safetensors file"),
        ("model.safetensors", len(head).to_bytes(8, "little") + head + weights[8 + n:], "not a readable safetensors file"),
        ("model.safetensors", weights[:flip] + b"\xff" + weights[flip + 1:], "not a readable safetensors file"),
        ("config.json", b"\xff\xfe", "config.json: not a readable JSON file"),
        ("config.json", config[: len(config) // 2], "config.json: not a readable JSON file"),
        ("config.json", b"[1, 2]", "config.json: expected an export's config"),
        ("config.json", json.dumps({"model": {"mixer": {}}, "objective": {}}).encode(),
         f"{folder / 'config.json'}: model.vocab_size: missing (required)"),
        ("config.json", json.dumps(dict(json.loads(config), model=dict(json.loads(config)["model"], d_model=24))).encode(),
         f"{folder / 'model.safetensors'} does not fit config.json"),
    ]
    for name, data, text in hostile:
        (folder / name).write_bytes(data)
        try:
            before = sorted((p.name, p.read_bytes()) for p in folder.iterdir())
            one_line(mod, lambda: mod.from_pretrained(str(folder)), text)
            assert sorted((p.name, p.read_bytes()) for p in folder.iterdir()) == before
        finally:
            (folder / "model.safetensors").write_bytes(weights)
            (folder / "config.json").write_bytes(config)


def test_a_failed_export_leaves_nothing(exported, tmp_path, monkeypatch):
    from ssmcraft.export import exporter

    def broken(*args, **kwargs):
        raise exporter.ExportError("scripted verification failure")
    monkeypatch.setattr(exporter, "verify", broken)
    out = tmp_path / "new" / "deeper" / "exp"
    with pytest.raises(exporter.ExportError, match="scripted"):
        exporter.export(exported / "run", out)
    assert list(tmp_path.iterdir()) == []               # no output, no staging folder, no parent folders
    (tmp_path / "empty").mkdir()
    with pytest.raises(exporter.ExportError, match="scripted"):
        exporter.export(exported / "run", tmp_path / "empty")
    assert list(tmp_path.iterdir()) == [tmp_path / "empty"] and list((tmp_path / "empty").iterdir()) == []
    monkeypatch.undo()
    result = exporter.export(exported / "run", tmp_path / "empty", check=False)   # an empty folder: one rename
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == sorted(f.name for f in result.files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
