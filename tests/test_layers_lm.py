"""The small LM: step-by-step generation equals the parallel pass; configs round-trip."""
import json

import pytest
import torch

from ssmcraft.errors import SpecError
from ssmcraft.layers import LM, LMConfig, Mitigation
from ssmcraft.errors import SsmcraftError

MIXERS = {
    "longhorn": {"kind": "objective", "objective": "longhorn", "heads": 2, "state_size": 4},
    "deltanet": {"kind": "objective", "objective": "deltanet", "heads": 2, "state_size": 8},
    "attention": {"kind": "attention", "heads": 2},
}


def _lm(mixer, mlp_ratio=2.0):
    torch.manual_seed(0)
    return LM(LMConfig(vocab_size=40, d_model=16, n_layers=2, mlp_ratio=mlp_ratio, mixer=mixer)).double()


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_step_by_step_equals_parallel(name):
    lm = _lm(MIXERS[name])
    tokens = torch.randint(0, 40, (3, 10))
    parallel = lm(tokens)
    assert parallel.shape == (3, 10, 40)
    caches, outs = lm.init_cache(3), []
    for t in range(10):
        logits, caches = lm.step(tokens[:, t], caches)
        outs.append(logits)
    torch.testing.assert_close(torch.stack(outs, 1), parallel, rtol=1e-9, atol=1e-10)


def test_no_mlp_blocks_and_tied_head():
    lm = _lm(MIXERS["longhorn"], mlp_ratio=0)
    assert all(b.mlp is None for b in lm.blocks)
    names = [n for n, _ in lm.named_parameters()]
    assert not any("head" in n for n in names)                  # the output layer is the embedding


def test_config_round_trips_through_json():
    cfg = LMConfig(vocab_size=40, d_model=16, n_layers=2, mixer=MIXERS["longhorn"])
    again = LMConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


@pytest.mark.parametrize("mixer, key", [
    ({"kind": "objective", "objective": "longhorn", "stat_size": 4}, "model.mixer.stat_size"),
    ({"kind": "attention", "heads": 2, "state_size": 4}, "model.mixer.state_size"),
    ({"kind": "rnn"}, "model.mixer.kind"),
])
def test_bad_mixer_config_names_the_key(mixer, key):
    with pytest.raises(SpecError) as e:
        LMConfig.from_dict({"vocab_size": 10, "mixer": mixer})
    assert e.value.key == key


def test_attention_refuses_mitigations_and_state_traces():
    lm = _lm(MIXERS["attention"])
    with pytest.raises(SsmcraftError, match="no recurrent state"):
        lm.set_mitigation(Mitigation(retention=0.5))
    lm.set_mitigation(None)
    with pytest.raises(SsmcraftError, match="no recurrent state"):
        lm.mixers[0].trace_states(torch.zeros(1, 4, 16, dtype=torch.float64))
