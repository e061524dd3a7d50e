"""Hybrid stacks: objective, full-attention and sliding-window layers placed per layer
(``model.layers``): decode equals the parallel pass, training, evaluation and export work, and a
bad layout is one error naming its key."""
from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import decode_all

from ssmcraft.errors import SpecError
from ssmcraft.layers import LM, LMConfig, Mitigation
from ssmcraft.layers.attention import AttentionMixer
from ssmcraft.layers.config import AttentionConfig, layer_mixers

OBJ = {"kind": "objective", "objective": "longhorn", "heads": 2, "state_size": 4}
SWA = {"kind": "attention", "heads": 2, "window": 3}
FULL = {"kind": "attention", "heads": 2}
# layers 0..4: objective, full attention, swa, objective, swa
HYBRID = [{"at": [1], "mixer": FULL}, {"at": [2, -1], "mixer": SWA}]


def _lm(layers=HYBRID, n_layers=5, mixer=OBJ):
    torch.manual_seed(0)
    return LM(LMConfig(vocab_size=40, d_model=16, n_layers=n_layers, mlp_ratio=2.0, mixer=mixer,
                       layers=layers)).double()


def test_layout_places_mixers_at_indices_and_every_nth():
    cfg = LMConfig(vocab_size=8, n_layers=7, mixer=OBJ,
                   layers=[{"every": 3, "mixer": FULL}, {"at": [0, -1], "mixer": SWA}])
    kinds = [(where, m.get("window", m["kind"])) for where, m in layer_mixers(cfg)]
    assert kinds == [("layers[1].mixer", 3), ("mixer", "objective"), ("layers[0].mixer", "attention"),
                     ("mixer", "objective"), ("mixer", "objective"), ("layers[0].mixer", "attention"),
                     ("layers[1].mixer", 3)]
    assert _lm().layout_labels() == ["objective", "attention", "swa3", "objective", "swa3"]
    assert _lm().recurrent_layers == [0, 3]


def test_hybrid_step_by_step_equals_parallel():
    lm = _lm()
    T = 9                                      # longer than the window: the bounded cache drops tokens
    tokens = torch.randint(0, 40, (2, T))
    stepped, caches = decode_all(lm, tokens)
    torch.testing.assert_close(stepped, lm(tokens), rtol=1e-9, atol=1e-10)
    assert caches[2].k.shape[2] == 3 and caches[1].k.shape[2] == T   # window-bounded vs growing cache


def test_sliding_window_attention_matches_a_per_query_softmax():
    torch.manual_seed(1)
    layer = AttentionMixer(AttentionConfig(heads=2, window=3), 8).double()
    h = torch.randn(1, 7, 8, dtype=torch.float64)
    y = layer(h)
    pos = torch.arange(7)
    q, k, v = layer._qkv(h, pos)
    rows = []
    for i in range(7):
        lo = max(0, i - 2)                    # the window: keys lo..i
        w = torch.softmax(q[:, :, i:i + 1] @ k[:, :, lo:i + 1].transpose(-1, -2) / math.sqrt(4), -1)
        rows.append(w @ v[:, :, lo:i + 1])
    ref = layer.out_proj(torch.cat(rows, 2).transpose(1, 2).reshape(1, 7, 8))
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)
    full = AttentionMixer(AttentionConfig(heads=2), 8).double()
    full.load_state_dict(layer.state_dict())
    assert (full(h) - y).abs().max() > 1e-3    # the window changes the outputs beyond 3 tokens


def test_state_size_counts_recurrent_states_and_windows():
    lm = _lm(layers=[{"at": [1], "mixer": SWA}], n_layers=2)
    d = 2 * 16 // 2
    assert lm.state_elements() == 2 * d * 4 + 2 * 3 * 16      # objective H*d*m + swa 2*window*d_model
    assert _lm().state_elements() is None                       # a full-attention layer's cache grows


def test_mitigation_applies_to_recurrent_layers_only():
    lm = _lm()
    lm.set_mitigation(Mitigation(insertion=0.5))
    assert [m.mitigation.insertion for i, m in enumerate(lm.mixers) if i in lm.recurrent_layers] == [0.5, 0.5]
    lm(torch.randint(0, 40, (1, 4)))


@pytest.mark.parametrize("layers, key, problem", [
    ([{"at": [5], "mixer": FULL}], "model.layers[0].at", "out of range"),
    ([{"at": [1], "every": 2, "mixer": FULL}], "model.layers[0]", "exactly one of"),
    ([{"at": [1]}], "model.layers[0].mixer", "missing"),
    ([{"at": [1], "mixer": FULL, "where": 1}], "model.layers[0].where", "unknown key"),
    ([{"at": [1], "mixer": FULL}, {"every": 1, "mixer": SWA}], "model.layers[1]", "placed by model.layers[0]"),
    ([{"every": 9, "mixer": FULL}], "model.layers[0]", "places no layer"),
    ([{"every": 2, "offset": 2, "mixer": FULL}], "model.layers[0].offset", "below every"),
    ([{"at": [1], "mixer": {"kind": "attention", "window": -1}}], "model.layers[0].mixer.window", ">= 0"),
    ([{"at": [1], "mixer": {"kind": "objective", "objective": "mamba"}}], "model.layers[0].mixer.kind",
     "objective layers are model.mixer"),
    ({"at": 1}, "model.layers", "expected a list"),
    (["attention"], "model.layers[0]", "expected a mapping"),
])
def test_bad_layout_is_one_error_naming_the_key(layers, key, problem):
    with pytest.raises(SpecError) as e:
        LMConfig.from_dict({"vocab_size": 8, "n_layers": 5, "mixer": OBJ, "layers": layers})
    assert e.value.key == key and problem in e.value.problem


def _experiment(layers, n_layers=3):
    return {"name": "hybrid", "seed": 0,
            "task": {"name": "mqar", "vocab": 32, "seq_len": 16, "num_kv_pairs": 2},
            "model": {"d_model": 16, "n_layers": n_layers, "mlp_ratio": 2,
                      "mixer": {"kind": "objective", "objective": "longhorn", "state_size": 8}, "layers": layers},
            "train": {"batch_size": 8, "tokens": 8 * 16 * 6, "eval_every": 0, "eval_batches": 1,
                      "eval_batch_size": 8}}


def test_bad_layout_from_the_cli_exits_2_with_one_line(tmp_path, capsys):
    import yaml
    from ssmcraft.cli import main

    spec = tmp_path / "x.yaml"
    spec.write_text(yaml.safe_dump(_experiment([{"at": [1], "mixer": {"kind": "attention", "heads": 3}}])))
    assert main(["train", str(spec), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.layers[0].mixer.heads" in err[0] and str(spec) in err[0]


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    from ssmcraft.train import train_run

    out = tmp_path_factory.mktemp("hybrid") / "run"
    metrics = train_run(_experiment([{"at": [1], "mixer": SWA}, {"at": [2], "mixer": FULL}]), out)
    return out, metrics


def test_hybrid_trains_on_cpu(hybrid_run):
    out, metrics = hybrid_run
    assert metrics["status"] == "ok" and math.isfinite(metrics["val_loss"])
    assert metrics["layout"] == ["objective", "swa3", "attention"]
    assert metrics["mixer"]["objective"] == "longhorn"
    assert metrics["train_loss_last"] < metrics["train_loss_first"]


def test_hybrid_eval_traces_recurrent_layers_only(hybrid_run, tmp_path):
    from ssmcraft.train.eval_run import EvalOptions, eval_run

    out, _ = hybrid_run
    summary = eval_run(out, EvalOptions(extrapolate=2, batches=1, batch_size=2, state_batch_size=2,
                                        mitigation=Mitigation(insertion=0.9)), tmp_path / "e")
    assert summary["state"]["plain"]["layers"] == [0]
    assert set(summary["state"]["plain"]["not_traced"]) == {"1", "2"}
    stats = json.loads((tmp_path / "e" / "state_stats.json").read_text())["plain"]
    assert len(stats["stats"]["norm"]) == 1 and stats["layers"] == [0]
    assert math.isfinite(summary["extrapolation_loss_2x"])


def test_hybrid_export_reproduces_outputs_and_decodes(hybrid_run, tmp_path):
    from ssmcraft.export import export
    from ssmcraft.export.exporter import import_module_from
    from ssmcraft.train import load_run

    out, _ = hybrid_run
    result = export(out, tmp_path / "exp")
    assert result.verified["max_abs_diff"] <= 1e-5 and result.verified["step_max_abs_diff"] <= 1e-5
    mod = import_module_from(result.module)
    model = mod.from_pretrained(str(tmp_path / "exp"))
    ref = load_run(out).float().eval()
    ids = torch.randint(0, 32, (2, 20))                    # past the window and the training length
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=1e-5)
    assert [type(b.mixer).__name__ for b in model.blocks] == ["ObjectiveMixer", "AttentionMixer", "AttentionMixer"]
    assert model.blocks[1].mixer.window == 3 and model.blocks[2].mixer.window == 0
    with torch.no_grad():                                  # the exported prefill (past the window), then steps
        logits, state = model.prefill(ids[:, :7])
        more = []
        for t in range(7, 20):
            lt, state = model.step(ids[:, t], state)
            more.append(lt)
        torch.testing.assert_close(torch.cat([logits, torch.stack(more, 1)], 1), ref(ids), rtol=0, atol=1e-5)
        generated = model.generate(ids[0, :7], max_new_tokens=4)
        assert torch.equal(generated[7:], ref(generated[None, :-1])[0, 6:].argmax(-1))
    wrong = r"step: state\[1\]: expected an attention cache .*\[2, 2, 3, 8\]\), got keys shape \[2, 2, 20, 8\]"
    with pytest.raises(Exception, match=wrong):
        model.step(ids[:, 0], [state[0], state[2], state[2]])
    layer = export(out, tmp_path / "layer", layer_only=True)
    assert layer.verified["layers"] == 1
    lmod = import_module_from(layer.module)
    with pytest.raises(Exception, match="layer 1 is not an objective mixer"):
        lmod.Mixer.from_pretrained(str(tmp_path / "layer"), layer=1)


def test_graphed_decode_state_holds_a_hybrid_with_sliding_windows():
    """The body ``GraphedDecoder`` captures (static caches updated in place) follows eager decoding
    of objective and sliding-window layers past the window; full attention is refused."""
    from ssmcraft.errors import SsmcraftError
    from ssmcraft.layers.graphed_decode import StaticDecodeState

    lm = _lm(layers=[{"at": [1, 2], "mixer": SWA}], n_layers=3)
    tokens = torch.randint(0, 40, (2, 8))
    static = StaticDecodeState(lm, 2)
    slots = static.caches[1].k.data_ptr()
    eager, _ = decode_all(lm, tokens)
    for t in range(8):
        static.token.copy_(tokens[:, t])
        assert torch.equal(static.advance(), eager[:, t])
    assert static.caches[1].k.data_ptr() == slots and int(static.caches[1].pos) == 8
    with pytest.raises(SsmcraftError, match="layer 1 has a KVCache"):
        StaticDecodeState(_lm(), 2)
