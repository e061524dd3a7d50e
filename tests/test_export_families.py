"""Export of the families whose kernels an exported module could not carry before: ``rankr_chunk``
(a two-key Woodbury update with a per-head step), ``minibatch_chunk`` (a composed mini-batch DeltaNet
with a decay), ``precision_rank1`` (``rls``), ``mlp_memory`` (``ttt_mlp``) and ``mlp_minibatch_chunk`` (a composed
MLP memory in mini-batches of 16 with a decay). For each, a tiny LM
exports with that family's kernels inline; in a fresh process where ssmcraft, sympy and yaml cannot be
imported, the module loads, its kernels run under the interpreter and reproduce the original model's
logits, and the hashes it recorded are checked: a config naming another IR is refused, and so is
another IR by the roles the family read off the IR at export (``ssmcraft.ops.family.recorded_match``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from test_export_bundle import FRESH_PROCESS, source  # noqa: E402

SPECS = {
    "rankr_chunk": compose_objective({"data": "regression", "keys": 2, "step": "scalar", "normalize": True,
                                      "proximity": "plain", "update": "implicit"}),
    "minibatch_chunk": compose_objective({"update": "explicit", "minibatch": 16, "proximity": "scalar_decay",
                                          "step": "scalar", "normalize": True}),
    "precision_rank1": "rls",
    "mlp_memory": "ttt_mlp",
    "mlp_minibatch_chunk": compose_objective({"memory": "mlp", "update": "explicit", "minibatch": 16,
                                              "proximity": "scalar_decay", "data": "huber", "step": "per_channel",
                                              "normalize": True}),
}
BACKENDS = {"rankr_chunk": "rankr-chunk", "minibatch_chunk": "minibatch-chunk",
            "precision_rank1": "precision-fp64+rank1-chunk", "mlp_memory": "mlp-memory",
            "mlp_minibatch_chunk": "mlp-minibatch-chunk"}
T = 37          # two mini-batches and a partial one; rankr's 32-token chunks, one and a part

FRESH = FRESH_PROCESS + textwrap.dedent(r'''
    folder, T = sys.argv[1], int(sys.argv[2])
    mod = load(folder)
    model = mod.from_pretrained(folder)
    ids = torch.randint(0, model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    mod.OBJECTIVE.prefer = "interpret"
    logits = model(ids)
    out = {"backend": model.backend, "logits": logits.tolist()}
    kernels = mod.OBJECTIVE._load_kernels()
    if hasattr(kernels, "_MATCHED_IR"):
        class Other:
            def content_hash(self):
                return "0" * 16
        try:
            kernels.match(Other())
            out["other_ir"] = "accepted"
        except ValueError as e:
            out["other_ir"] = str(e)
        out["own_ir"] = kernels.match(mod.OBJECTIVE.ir)
    config = json.load(open(os.path.join(folder, "config.json")))
    config["objective"]["ir_hash"] = "0" * 16
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    try:
        mod.from_pretrained(folder)
        out["other_config"] = "accepted"
    except mod.SsmcraftError as e:
        out["other_config"] = str(e)
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.parametrize("family", list(SPECS))
def test_exported_module_runs_the_family_without_ssmcraft(family, tmp_path):
    from ssmcraft.export.exporter import export_model
    from ssmcraft.layers import LM, LMConfig

    obj = ssmcraft.compile(SPECS[family])
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=24, d_model=16, n_layers=1, mlp_ratio=2,
                   mixer={"kind": "objective", "objective": dict(obj.spec.raw), "heads": 2, "state_size": 4})
    model = LM(cfg, obj).eval()
    result = export_model(model, tmp_path / "exp", source(tmp_path), check=True)
    assert result.kernels == f"inline ({family})", result.kernels
    assert result.verified["max_abs_diff"] < 1e-5, result.verified      # its PyTorch path, in ssmcraft
    ids = torch.randint(0, 24, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)
    proc = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "exp"), str(T)], capture_output=True,
                          text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert res["backend"] == f"triton-interpret:{BACKENDS[family]}", res["backend"]
    got = torch.tensor(res["logits"])
    assert got.shape == want.shape and (got - want).abs().max() < 1e-4, (got - want).abs().max()
    digest = obj.ir.content_hash()
    assert res["other_config"].endswith(f"its objective ({obj.spec.name}, IR {'0' * 16}) is not the one this module "
                                        f"was exported with ({obj.spec.name}, IR {digest})"), res["other_config"]
    if family == "rankr_chunk":         # reads only the laid-out coefficients: nothing recorded
        assert "other_ir" not in res
        return
    from ssmcraft.ops import registry
    what = {"minibatch_chunk": "mini-batch", "precision_rank1": "precision", "mlp_memory": "MLP memory",
            "mlp_minibatch_chunk": "MLP memory's mini-batch"}[family]
    assert res["other_ir"] == f"the {what} kernels were exported for IR {digest}, not {'0' * 16}", res["other_ir"]
    assert res["own_ir"] == json.loads(json.dumps(registry.family(family).module.match(obj.ir)))
