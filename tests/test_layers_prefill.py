"""Parallel prefill: a prompt through the chunked (parallel) path gives the caches ``step`` would
have left, so prefill + k steps equals k + T single steps and the full forward: the mixer, the LM
(hybrids with full and sliding-window attention included) and the Triton interpreter's chunked
kernels."""
from __future__ import annotations

import pytest
import torch
from helpers import decode_all

import ssmcraft
from ssmcraft.errors import SsmcraftError
from ssmcraft.layers import LM, LMConfig, Mitigation
from ssmcraft.layers.attention import KVCache
from ssmcraft.layers.config import mixer_config
from ssmcraft.layers.mixer import ObjectiveMixer, RecurrentCache
from ssmcraft.ops import registry
from ssmcraft.runtime import select

OBJ = {"kind": "objective", "objective": "longhorn", "heads": 2, "state_size": 4}
SWA = {"kind": "attention", "heads": 2, "window": 3}
FULL = {"kind": "attention", "heads": 2}
K = 3                                              # tokens decoded after the prompt


def _mixer(objective, conv_kernel=4, dtype=torch.float64, obj=None):
    torch.manual_seed(0)
    cfg = mixer_config({**OBJ, "objective": objective, "conv_kernel": conv_kernel})
    return ObjectiveMixer(cfg, 16, obj).to(dtype)


def _steps(mixer, h, cache):
    ys = []
    for t in range(h.shape[1]):
        y, cache = mixer.step(h[:, t], cache)
        ys.append(y)
    return torch.stack(ys, 1), cache


def _assert_same_cache(a, b, **tol):
    """Two caches of one mixer (objective: conv window and states; attention: keys, values, position)."""
    if isinstance(a, RecurrentCache):
        torch.testing.assert_close(a.conv, b.conv, **tol)
        states_a, states_b = (s if isinstance(s, tuple) else (s,) for s in (a.state, b.state))
        assert len(states_a) == len(states_b)
        for sa, sb in zip(states_a, states_b):
            torch.testing.assert_close(sa, sb, **tol)
        return
    assert isinstance(a, KVCache) and a.k.shape == b.k.shape
    torch.testing.assert_close(a.k, b.k, **tol)
    torch.testing.assert_close(a.v, b.v, **tol)
    assert int(a.pos) == int(b.pos) and type(a.pos) is type(b.pos)


@pytest.mark.parametrize("objective", ["longhorn", "mamba", "gla", "momentum_longhorn"])
@pytest.mark.parametrize("T", [1, 2, 7])          # 1, 2: shorter than the conv kernel (4)
def test_mixer_prefill_equals_steps_and_forward(objective, T):
    mixer = _mixer(objective)
    h = torch.randn(2, T + K, 16, dtype=torch.float64)
    with torch.no_grad():
        y_pre, cache = mixer.prefill(h[:, :T])
        y_more, cache_pre = _steps(mixer, h[:, T:], cache)
        y_steps, cache_steps = _steps(mixer, h, mixer.init_cache(2))
        full = mixer(h)
        _, cache_prompt = _steps(mixer, h[:, :T], mixer.init_cache(2))
    assert mixer.last_backend == "torch-vectorised"
    _assert_same_cache(cache, cache_prompt, rtol=1e-10, atol=1e-12)
    _assert_same_cache(cache_pre, cache_steps, rtol=1e-10, atol=1e-12)
    got = torch.cat([y_pre, y_more], 1)
    torch.testing.assert_close(got, y_steps, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("conv_kernel", [0, 2])
def test_mixer_prefill_continues_a_cache(conv_kernel):
    """Prefilling in two pieces (the second from the first's cache) is one prefill; no conv too."""
    mixer = _mixer("momentum_longhorn", conv_kernel=conv_kernel)
    h = torch.randn(2, 9, 16, dtype=torch.float64)
    with torch.no_grad():
        y1, cache = mixer.prefill(h[:, :4])
        y2, cache = mixer.prefill(h[:, 4:], cache)
        y, whole = mixer.prefill(h)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(y, mixer(h), rtol=1e-10, atol=1e-12)
    _assert_same_cache(cache, whole, rtol=1e-10, atol=1e-12)


def _lm(layers, n_layers, mixer=OBJ):
    torch.manual_seed(0)
    return LM(LMConfig(vocab_size=40, d_model=16, n_layers=n_layers, mlp_ratio=2.0, mixer=mixer,
                       layers=layers)).double()


HYBRID = [{"at": [1], "mixer": FULL}, {"at": [2, -1], "mixer": SWA}]   # objective, full, swa3, objective, swa3


@pytest.mark.parametrize("mixer,layers,n_layers", [
    (OBJ, [], 2),
    ({**OBJ, "objective": "momentum_longhorn"}, [], 2),
    (OBJ, HYBRID, 5),
    ({**OBJ, "objective": "momentum_longhorn"}, HYBRID, 5),
])
@pytest.mark.parametrize("T", [1, 2, 3, 8])      # shorter than, as long as and past the window of 3
def test_lm_prefill_then_steps_equals_single_steps_and_forward(mixer, layers, n_layers, T):
    lm = _lm(layers, n_layers, mixer)
    tokens = torch.randint(0, 40, (2, T + K))
    with torch.no_grad():
        logits, caches = lm.prefill(tokens[:, :T])
        more = []
        for t in range(T, T + K):
            lt, caches = lm.step(tokens[:, t], caches)
            more.append(lt)
        stepped, stepped_caches = decode_all(lm, tokens)
        full = lm(tokens)
    got = torch.cat([logits, torch.stack(more, 1)], 1)
    torch.testing.assert_close(got, stepped, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-10)
    assert len(caches) == n_layers
    for a, b in zip(caches, stepped_caches):
        _assert_same_cache(a, b, rtol=1e-9, atol=1e-10)


def test_sliding_window_ring_holds_the_last_window_tokens():
    """Prefilled past the window, each slot ``p % window`` holds the key of position ``p`` among
    the last ``window`` ones; shorter, the unwritten slots stay zero."""
    lm = _lm(HYBRID, 5)
    swa = lm.blocks[2].mixer
    h = torch.randn(1, 7, 16, dtype=torch.float64)
    with torch.no_grad():
        _, cache = swa.prefill(h)
        _, keys, _ = swa._qkv(h, torch.arange(7))
        _, short = swa.prefill(h[:, :2])
    assert cache.k.shape[2] == 3 and int(cache.pos) == 7
    for p in (4, 5, 6):
        torch.testing.assert_close(cache.k[:, :, p % 3], keys[:, :, p])
    assert int(short.pos) == 2 and torch.equal(short.k[:, :, 2], torch.zeros_like(short.k[:, :, 2]))


@pytest.mark.parametrize("name,kernel", [("deltanet", "rank1-chunk"), ("gla", "keydecay-chunked"),
                                         ("longhorn", "rank1-row")])
def test_prefill_under_the_triton_interpreter(monkeypatch, name, kernel):
    """The prompt runs the Triton kernel a GPU would choose (interpreted; chunked for the chunked
    families), the decode steps the one-token kernel; both equal the reference loop run token by
    token."""
    monkeypatch.setattr(select, "order", lambda ir, mode: registry.order(ir, "triton"))
    obj = ssmcraft.compile(name)
    obj.prefer = "interpret"
    mixer = _mixer(name, dtype=torch.float32, obj=obj)
    T = 5
    h = torch.randn(2, T + 2, 16)
    with torch.no_grad():
        y_pre, cache = mixer.prefill(h[:, :T])
        prefill_backend = mixer.last_backend
        y_more, cache = _steps(mixer, h[:, T:], cache)
        obj.prefer = "reference"
        y_ref, cache_ref = _steps(mixer, h, mixer.init_cache(2))
    assert prefill_backend.startswith(f"triton-interpret:{kernel}"), prefill_backend
    torch.testing.assert_close(torch.cat([y_pre, y_more], 1), y_ref, rtol=1e-4, atol=1e-5)
    _assert_same_cache(cache, cache_ref, rtol=1e-4, atol=1e-5)


def test_prefill_refusals_are_one_line():
    mixer = _mixer("longhorn")
    mixer.set_mitigation(Mitigation(window=4))
    with pytest.raises(SsmcraftError, match="sliding-window mitigation has no recurrent mode"):
        mixer.prefill(torch.randn(1, 5, 16, dtype=torch.float64))
    swa = _lm(HYBRID, 5).blocks[2].mixer
    h = torch.randn(1, 2, 16, dtype=torch.float64)
    _, cache = swa.prefill(h)
    with pytest.raises(SsmcraftError, match="attention prefill starts from an empty cache"):
        swa.prefill(h, cache)


def test_prefill_under_autocast_keeps_the_cache_dtypes_step_keeps():
    """bf16 autocast: the prefilled caches have ``init_cache``'s dtypes (the weights'), as the
    caches ``step`` leaves, so decoding and graphed decoding's static buffers see one layout."""
    torch.manual_seed(0)
    lm = LM(LMConfig(vocab_size=40, d_model=16, n_layers=3, mlp_ratio=2.0, mixer={**OBJ, "objective": "momentum_longhorn"},
                     layers=[{"at": [1], "mixer": FULL}, {"at": [2], "mixer": SWA}]))
    tokens = torch.randint(0, 40, (2, 6))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits, caches = lm.prefill(tokens)
        stepped, stepped_caches = decode_all(lm, tokens)
    for a, b in zip(caches, stepped_caches):
        for name, value in vars(a).items():
            other = vars(b)[name]
            assert type(value) is type(other), name
            for x, y in zip(*(v if isinstance(v, tuple) else (v,) for v in (value, other))):
                assert getattr(x, "dtype", None) == getattr(y, "dtype", None), (name, x, y)
    assert caches[0].conv.dtype == torch.float32 and caches[2].k.dtype == torch.float32
    torch.testing.assert_close(logits.float(), stepped.float(), rtol=0.05, atol=0.02)


def test_module_mixers_prefill_by_their_hook():
    """A module mixer with a ``prefill`` hook prefills in a hybrid; one without it is one line."""
    ema = {"kind": "module", "module": "examples.mixers:EMAMixer", "options": {"decay": 0.8, "width": 6}}
    lm = _lm([{"at": [1], "mixer": ema}], 3)
    tokens = torch.randint(0, 40, (2, 5 + K))
    with torch.no_grad():
        logits, caches = lm.prefill(tokens[:, :5])
        more = []
        for t in range(5, 5 + K):
            lt, caches = lm.step(tokens[:, t], caches)
            more.append(lt)
        stepped, stepped_caches = decode_all(lm, tokens)
    torch.testing.assert_close(torch.cat([logits, torch.stack(more, 1)], 1), stepped, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(caches[1], stepped_caches[1], rtol=1e-9, atol=1e-10)
    fla = _lm([], 1, {"kind": "module", "module": "example_mixer:fla_like", "d_model_arg": "hidden_size"})
    with pytest.raises(SsmcraftError, match=r"example_mixer:fla_like has no prefill\(\); parallel prefill needs"):
        fla.prefill(tokens)


def test_graphed_decoding_continues_a_prefill():
    """The static caches of graphed decoding load a prefill's caches (objective layers and a
    sliding window past its length) and step on as eager decoding does."""
    from ssmcraft.layers.graphed_decode import StaticDecodeState

    lm = _lm([{"at": [1], "mixer": SWA}], 2)
    tokens = torch.randint(0, 40, (2, 5 + K))
    with torch.no_grad():
        static = StaticDecodeState(lm, 2)
        static.load(lm.prefill(tokens[:, :5])[1])
        stepped, _ = decode_all(lm, tokens)
        for t in range(5, 5 + K):
            static.token.copy_(tokens[:, t])
            torch.testing.assert_close(static.advance(), stepped[:, t], rtol=1e-9, atol=1e-10)
