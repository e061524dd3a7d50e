"""Backend selection (ssmcraft.runtime.select + dispatch), under TRITON_INTERPRET=1.

The compiled objective runs the Triton kernel on CPU tensors only when asked for
(prefer="interpret"), says which kernel ran in ``obj.backend``, and never falls back silently.
"""
import pytest
import torch

import ssmcraft
from ssmcraft.errors import SsmcraftError
from ssmcraft.ops import registry
from ssmcraft.runtime import select as TB
from helpers import rel_rms as _rel


def _inputs(obj, B=1, T=5, H=2, d=8, m=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    size = {obj.ir.dims[0]: d, obj.ir.dims[1]: m}
    out = {}
    for n, dims in obj.ir.inputs.items():
        t = torch.randn([B, T, H] + [size[x] for x in dims], generator=g)
        decl = obj.spec.inputs[n]
        out[n] = torch.sigmoid(t) if decl.bounded else torch.nn.functional.softplus(t) if decl.positive else t
    params = {n: -torch.rand([size[x] for x in dims], generator=g) - 0.5 for n, dims in obj.ir.params.items()}
    return out, params


def test_interpret_runs_the_diagonal_kernel_and_says_so():
    obj = ssmcraft.compile("mamba")
    obj.prefer = "interpret"
    inputs, params = _inputs(obj)
    S0 = torch.randn(1, 2, 8, 4)
    y, S = obj(inputs, params, S0, True)
    assert obj.backend == "triton-interpret:diagonal-chunked"
    yr, Sr = obj.reference(inputs, params, S0, True)
    assert _rel(y, yr) < 1e-5 and _rel(S, Sr) < 1e-5
    y, S = obj(inputs, params, S0, False)
    assert S is None


def test_gradients_flow_through_the_dispatched_kernel():
    obj = ssmcraft.compile("longhorn_diag")
    obj.prefer = "interpret"
    inputs, params = _inputs(obj, T=3)
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    y, _ = obj(leaves, None, None, False)
    y.square().sum().backward()
    ref = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    obj.reference(ref, None, None, False)[0].square().sum().backward()
    for k in leaves:
        assert _rel(leaves[k].grad, ref[k].grad) < 1e-5, k


def test_auto_on_cpu_uses_torch_and_forced_triton_raises():
    obj = ssmcraft.compile("gla")
    inputs, _ = _inputs(obj)
    obj.prefer = "auto"
    obj(inputs)
    assert obj.backend == "torch-vectorised"
    assert TB.select(obj, inputs, "auto") is None
    obj.prefer = "triton"
    with pytest.raises(SsmcraftError, match="no Triton kernel can run here"):
        obj(inputs)


def test_why_not_names_every_family():
    obj = ssmcraft.compile("cauchy_delta")     # nonlinear: not the diagonal family
    inputs, _ = _inputs(obj)
    obj.prefer = "interpret"
    reasons = dict(TB.families(obj, inputs, "interpret"))
    assert list(reasons) == ["decode", "keydecay_chunk", "diagonal", "rank1_row", "rankr_row", "block_rank1_row",
                             "minibatch_chunk", "general",
                             "rank1_chunk", "rank1_row_chunk", "rankr_chunk", "precision_rank1",
                             "precision_general", "rank1_keydecay_chunk", "mlp_minibatch_chunk", "mlp_memory",
                             "block_rank1_row_chunk"]
    assert "rank-r" in reasons["rankr_row"]
    assert reasons["keydecay_chunk"] is not None
    assert reasons["diagonal"] is not None
    msg = TB.why_not(obj, inputs)
    assert "diagonal:" in msg or TB.select(obj, inputs, "interpret") is not None


@pytest.mark.parametrize("name", ["gla", "retnet", "hgrn"])
def test_key_decays_run_the_keydecay_family_and_say_so(name):
    # the diagonal family stays tested on these objectives by calling it directly
    # (tests/test_kernels_diagonal.py, test_family_contract_forward_on_a_layout below)
    obj = ssmcraft.compile(name)
    obj.prefer = "interpret"
    inputs, _ = _inputs(obj, T=5)
    params = {n: torch.tensor([0.9, 0.7]) for n in obj.ir.params}
    S0 = torch.randn(1, 2, 8, 4)
    y, S = obj(inputs, params, S0, True)
    computed = "+prologue" if name == "hgrn" else ""        # HGRN's p = -x, q = f - 1: the fused prologue
    assert obj.backend == "triton-interpret:keydecay-chunked" + computed
    yr, Sr = obj.reference(inputs, params, S0, True)
    assert _rel(y, yr) < 1e-5 and _rel(S, Sr) < 1e-5
    reasons = dict(TB.families(obj, inputs, "interpret"))
    assert reasons["keydecay_chunk"] is None and reasons["diagonal"] is None


def test_refusing_family_is_skipped_by_name(monkeypatch):
    for name in ("keydecay_chunk", "diagonal"):
        monkeypatch.setattr(registry.family(name), "supports", lambda ir: "refused here")
    obj = ssmcraft.compile("retnet")
    inputs, _ = _inputs(obj)
    obj.prefer = "interpret"
    runner = TB.select(obj, inputs, "interpret")
    if runner is not None:           # another family took it: its name must say which
        assert "diagonal" not in runner.backend and "keydecay" not in runner.backend
    assert "diagonal: refused here" in TB.why_not(obj, inputs) or runner is not None


def test_rank1_per_head_prefers_chunked_on_gpu_only():
    obj = ssmcraft.compile("deltanet")
    assert [f.name for f in TB.order(obj.ir, "triton")][:4] == ["decode", "keydecay_chunk", "diagonal", "rank1_chunk"]
    assert TB.order(obj.ir, "interpret") == list(registry.FAMILIES)


def test_family_contract_forward_on_a_layout():
    from ssmcraft.ops.diagonal import chunk as diagonal
    from ssmcraft.ops.common.reference import layout
    obj = ssmcraft.compile("retnet")
    inputs, _ = _inputs(obj)
    params = {"gamma": torch.tensor([0.9, 0.7])}
    lay = layout(obj.ir, obj.spec, inputs, params, None)
    co = obj.module.coefficients(lay.env, lay.d, lay.m)
    y, S = diagonal.forward(obj, lay, co, True)
    yr, Sr = obj.reference(inputs, params, None, True)
    assert _rel(y, yr) < 1e-5 and _rel(S, Sr) < 1e-5


def test_bench_cli_needs_a_gpu():
    from ssmcraft.cli import main
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert main(["bench", "longhorn_diag", "--shape", "1,4,1,8,4"]) == 2
    assert main(["bench", "longhorn_diag", "--shape", "1,4"]) == 2
