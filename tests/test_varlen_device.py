"""Packed calls whose host code reads no offset: the chunk and group tables built on the device
(``rows.device_chunks``), the diagonal family's packed scan split into time groups that never
straddle two sequences, the offsets' checks (``varlen.CHECK``), and a packed forward+backward that
brings no tensor value to the host (counted by ``benchmarks/count_packed_host.py``'s mode)."""
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ssmcraft
from ssmcraft.bench.run import random_inputs
from ssmcraft.errors import SsmcraftError
from ssmcraft.ops.common import rows, varlen
from helpers import assert_within
from test_varlen import _composed, _interpret, gpu_order, packed_errors, poisoned  # noqa: F401 - fixtures

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from count_packed_host import Count  # noqa: E402

MANY_SHORT = [1, 0, 2, 3, 1, 1, 0, 4, 2, 1, 5, 0, 1, 3, 2, 1, 1, 0, 2, 1]     # 20 sequences, 31 tokens


def _random_lens(n, seed):
    return torch.randint(0, 30, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("lens, BT", [([5, 0, 1, 13, 7], 4), ([0, 0, 0], 8), ([16, 16], 16), (MANY_SHORT, 2),
                                      ([0, 40, 0], 16), ([7], 1), (_random_lens(300, 1), 8),
                                      (_random_lens(600, 2), 64), (_random_lens(700, 3), 1)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_device_chunks_match_the_host_tables(lens, BT, dtype):
    """The device tables (one kernel: several blocks of 256 offsets and chunks past 300 sequences)
    list the host tables' chunks, then ``(0, -1)`` up to the bound ``total_T // BT + N``; each
    sequence's first chunk is the same."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype)
    host = varlen.chunks(cu.tolist(), cu, BT)
    dev = rows.device_chunks(cu, int(cu[-1]), BT, cu.device)
    assert dev.N == host.N and dev.NT == int(cu[-1]) // BT + len(lens)
    assert torch.equal(dev.ci[:host.NT], host.ci)
    assert torch.equal(dev.ci[host.NT:], torch.tensor([[0, -1]] * (dev.NT - host.NT), dtype=torch.int32).reshape(-1, 2))
    assert torch.equal(dev.co, host.co) and torch.equal(dev.cu, cu.to(torch.int32))


def test_unchecked_bad_offsets_stay_inside_the_row():
    """Offsets left unchecked (on a GPU, ``CHECK`` auto) that break the layout are clamped into the
    row before the tables are built: every chunk lies inside ``[0, total_T)``."""
    cu = torch.tensor([3, 50, 20, 9], dtype=torch.int32)       # starts late, runs past 30, decreases
    ch = rows.device_chunks(cu, 30, 8, cu.device)
    assert ch.cu.tolist() == [0, 30, 30, 30]
    live = ch.ci[:, 1] >= 0
    assert ch.ci[live].tolist() == [[0, 0], [0, 1], [0, 2], [0, 3]]


@pytest.mark.parametrize("mode, on_gpu, raises", [("auto", False, True), ("always", False, True),
                                                  ("never", False, False), ("auto", True, False)])
def test_which_offsets_are_checked(monkeypatch, mode, on_gpu, raises):
    """``check`` reads and checks the values where ``CHECK`` says: CPU offsets under ``auto`` and
    ``always``, none under ``never``; offsets on a GPU (stood in for by a 'meta' tensor, which holds
    no values: a read would fail) are left unread under ``auto``. The layout is checked in every mode."""
    monkeypatch.setattr(varlen, "CHECK", mode)
    x = torch.zeros(1, 10, 2, 3)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)                  # ends at 9, not at total_T = 10
    if on_gpu:
        cu = cu.to("meta")
    if raises:
        with pytest.raises(SsmcraftError, match=r"^gla: cu_seqlens: must end at total_T = 10"):
            varlen.check("gla", cu, {"k": x}, None)
    else:
        assert varlen.check("gla", cu, {"k": x}, None) == 2
    with pytest.raises(SsmcraftError, match=r"^gla: cu_seqlens: must be int32 or int64"):
        varlen.check("gla", cu.float(), {"k": x}, None)
    with pytest.raises(SsmcraftError, match=r"initial_state has 3 rows, but cu_seqlens holds N = 2"):
        varlen.check("gla", cu, {"k": x}, torch.zeros(3, 2, 3, 3))


def test_an_unknown_check_mode_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(varlen, "CHECK", "sometimes")
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(SsmcraftError, match=r"^gla: SSMCRAFT_CHECK_OFFSETS must be one of auto, always, never, "
                                            r"got 'sometimes'$"):
        varlen.check("gla", cu, {"k": torch.zeros(1, 10, 2, 3)}, None)


def test_bad_cpu_offsets_are_one_clear_error_from_the_objective(compiled):
    """Through the public call, offsets on the CPU that decrease: one ``SsmcraftError`` naming the
    objective and the problem, before any kernel runs (``CHECK`` auto, the default)."""
    obj = ssmcraft.compile("gla")
    x = {k: torch.randn(1, 9, 2, n) for k, n in (("q", 4), ("k", 4), ("v", 3))}
    with pytest.raises(SsmcraftError) as e:
        obj(x, None, None, True, cu_seqlens=torch.tensor([0, 6, 4, 9], dtype=torch.int32))
    assert str(e.value).startswith("gla: cu_seqlens: ") and "must not decrease" in str(e.value)


@pytest.fixture
def groups(monkeypatch):
    """The diagonal family's packed scan in several time groups of one chunk each under the
    interpreter too (whose rule runs one group): every sequence longer than a chunk is split, the
    summaries and the carried states cross group boundaries inside sequences and reset at theirs."""
    from ssmcraft.ops.diagonal import chunk as DG
    rule = DG._rule_config
    monkeypatch.setattr(DG, "_rule_config", lambda K, V, B, H, T: replace(rule(K, V, B, H, T), NG=64))


@pytest.mark.parametrize("name", ["mamba", "longhorn_diag"])
@pytest.mark.parametrize("lens", [[0, 17, 5, 0, 1, 33], [40], MANY_SHORT])
def test_diagonal_packed_groups_equal_separate(name, lens, poisoned, groups):   # noqa: F811
    """The diagonal family's packed kernels with a sequence split into several groups (chunks of 16
    tokens at K = 12), empty sequences first and inside, one-token ones, and many short ones: the
    output, final states and every gradient (inputs, params, initial states) equal the separate
    float64 reference calls; every kernel buffer starts as NaN."""
    obj = ssmcraft.compile(name)
    errs = packed_errors(obj, lens, _interpret, dtype=torch.float32, d=20, m=12)
    assert_within(errs, {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5})
    assert obj.backend == "triton-interpret:diagonal-chunked+packed"


@pytest.mark.parametrize("name, family", [("gla", "keydecay-chunked"), ("retnet", "keydecay-chunked"),
                                          ("deltanet", "rank1-chunk"), ("gated_deltanet", "rank1-chunk"),
                                          ("rank2_head_gated", "rankr-chunk")])
def test_chunked_packed_many_short_sequences(name, family, poisoned, gpu_order):   # noqa: F811
    """Twenty sequences of 0 to 5 tokens (chunks of 16): most chunks of the bounded grid lie past
    the last one and exit; the results equal the separate reference calls."""
    obj = _composed(name) if name == "rank2_head_gated" else ssmcraft.compile(name)
    errs = packed_errors(obj, MANY_SHORT, _interpret, dtype=torch.float32, d=20, m=12)
    assert_within(errs, {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5})
    assert obj.backend.startswith(f"triton-interpret:{family}") and obj.backend.endswith("+packed")


@pytest.mark.parametrize("name, family", [("mamba", "diagonal-chunked"), ("gla", "keydecay-chunked"),
                                          ("gated_deltanet", "rank1-chunk")])
def test_packed_call_reads_nothing_to_the_host(monkeypatch, name, family, gpu_order, groups):   # noqa: F811
    """A packed forward+backward of the families training uses, with offsets treated as a GPU's
    (``CHECK`` never: a CPU tensor is read otherwise), brings no tensor value to the host from
    ssmcraft's code and builds no tensor from host data; a second call after the first (which picks
    the path) is counted."""
    monkeypatch.setattr(varlen, "CHECK", "never")
    obj = ssmcraft.compile(name)
    obj.prefer = "interpret"
    lens = [0, 9, 20, 1]
    ins, params = random_inputs(obj, 1, sum(lens), 2, 8, 12, torch.float32, "cpu", seed=1)
    x = {k: v.detach().requires_grad_() for k, v in ins.items()}
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    y, _ = obj(x, params, None, False, cu_seqlens=cu)
    y.sum().backward()
    with Count() as c:
        y, _ = obj(x, params, None, False, cu_seqlens=cu)
        y.sum().backward()
    assert obj.backend == f"triton-interpret:{family}+packed"
    assert c.c["host reads"] == 0 and c.c["host-built tensors"] == 0, (dict(c.c), dict(c.where))
    assert c.c["torch ops"] > 0           # the mode saw the call
