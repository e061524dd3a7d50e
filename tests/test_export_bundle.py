"""Export internals: the bundle built from ssmcraft's source, every library objective through
an export, the weights reader/writer (the safetensors library), and the inline Triton kernels under
the interpreter (CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ssmcraft.errors import SsmcraftError

LIBRARY = ("linear_attention", "retnet", "gla", "mamba", "hgrn", "deltanet", "gated_deltanet", "longhorn",
           "longhorn_diag", "gated_longhorn", "wd_longhorn", "cauchy_delta")


def tiny_lm(compiled, name, heads=1, n_layers=1, seed=0, state_size=4):
    from ssmcraft.layers import LM, LMConfig

    torch.manual_seed(seed)
    cfg = LMConfig(vocab_size=24, d_model=16, n_layers=n_layers, mlp_ratio=2,
                   mixer={"kind": "objective", "objective": dict(compiled(name).spec.raw), "heads": heads,
                          "state_size": state_size})
    return LM(cfg, compiled(name)).eval()


def source(tmp_path):
    from ssmcraft.export.exporter import TrialSource

    return TrialSource("train", tmp_path / "run", tmp_path / "run")


@pytest.mark.parametrize("name", LIBRARY)
def test_every_library_objective_exports_and_reproduces(compiled, name, tmp_path):
    from ssmcraft.export.exporter import export_model

    model = tiny_lm(compiled, name, heads=2)
    result = export_model(model, tmp_path / "exp", source(tmp_path), check=True)
    v = result.verified
    assert v["max_abs_diff"] < 1e-5 and v["step_max_abs_diff"] < 1e-5 and v["prefill_max_abs_diff"] < 1e-5, v
    assert v["backend"] == "torch-vectorised"
    assert result.structure == compiled(name).ir.kind


def test_layer_only_bundle_has_no_lm(compiled, tmp_path):
    from ssmcraft.export.exporter import export_model

    model = tiny_lm(compiled, "gated_deltanet", n_layers=2)
    result = export_model(model, tmp_path / "exp", source(tmp_path), layer_only=True)
    text = result.module.read_text()
    assert "class Mixer(ObjectiveMixer)" in text and "class LM(" not in text and "class Model(" not in text
    assert result.verified["layers"] == 2 and result.verified["max_abs_diff"] < 1e-5
    assert result.verified["prefill_max_abs_diff"] < 1e-5


def test_bundle_refuses_missing_and_duplicate_definitions(compiled):
    from ssmcraft.export import exporter
    from ssmcraft.export.assemble import ExportError, bundle

    obj = compiled("longhorn")
    gen = exporter.generated_sections(obj, {}, {"ir_hash": "x"}, None)
    plan = [p for p in exporter.LAYER_PLAN if p[:2] != ("module", "ssmcraft.layers.conv")]
    with pytest.raises(ExportError, match="CausalConv1d"):
        bundle("# header", plan, gen)
    with pytest.raises(ExportError, match="defined by both"):
        bundle("# header", exporter.LAYER_PLAN + [("module", "ssmcraft.layers.conv")], gen)
    text = bundle("# header", exporter.LAYER_PLAN, gen)
    assert "from ssmcraft" not in "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith(("#", "pass")))


def test_generated_recurrence_becomes_a_class(compiled):
    from ssmcraft.export.assemble import ExportError, recurrence_section

    obj = compiled("mamba")
    ns = {"torch": torch, "F": torch.nn.functional}
    exec(recurrence_section(obj.source).body, ns)   # noqa: S102 - our own generated text
    rec = ns["Recurrence"]
    assert rec.KIND == obj.module.KIND and rec.SLOTS == obj.module.SLOTS
    env = {"x": torch.randn(2, 3, 1, 4, 1), "k": torch.randn(2, 3, 1, 1, 5), "q": torch.randn(2, 3, 1, 1, 5),
           "delta": torch.rand(2, 3, 1, 4, 1), "A": -torch.rand(1, 1, 1, 4, 5)}
    a, b = rec.coefficients(env, 4, 5), obj.module.coefficients(env, 4, 5)
    assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
    bad = obj.source + "\n\nHELPER = 2\n\n\ndef extra(env, d, m):\n    return HELPER\n"
    with pytest.raises(ExportError, match="HELPER"):
        recurrence_section(bad)


def test_weights_reader_and_writer_round_trip_and_refuse_malformed_files(tmp_path):
    from safetensors.torch import load_file, save_file

    from ssmcraft.export.runtime import load_safetensors, save_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=g).half(), "f64": torch.randn(4, generator=g).double(),
        "i64": torch.arange(-3, 6), "i32": torch.arange(5, dtype=torch.int32), "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "strided": torch.randn(4, 6, generator=g)[:, ::2],
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "lib.safetensors"), metadata={"a": "b"})
    save_safetensors(tensors, tmp_path / "ours.safetensors", {"a": "b"})
    assert (tmp_path / "ours.safetensors").stat().st_mode & 0o777 == 0o666 & ~_umask()   # as any file it writes
    for path in ("lib.safetensors", "ours.safetensors"):
        for reader in (load_safetensors, load_file):
            got = reader(str(tmp_path / path))
            assert set(got) == set(tensors)
            for k, v in tensors.items():
                assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), (path, k)
    # a header whose byte ranges overlap or are shifted reads as non-finite garbage with a lenient
    # reader: the library refuses it, and the reader says so in one line naming the file
    data = (tmp_path / "ours.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    for name, change in (("overlap", lambda h: h["f64"].update(data_offsets=h["f32"]["data_offsets"][:1] + [
                             h["f32"]["data_offsets"][0] + 32])),
                         ("shifted", lambda h: h["f32"].update(data_offsets=[o + 4 for o in h["f32"]["data_offsets"]]))):
        bad = json.loads(json.dumps(header))
        change(bad)
        head = json.dumps(bad).encode()
        head += b" " * (-len(head) % 8)
        (tmp_path / f"{name}.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + data[8 + n:])
        with pytest.raises(SsmcraftError) as e:
            load_safetensors(tmp_path / f"{name}.safetensors")
        assert f"{name}.safetensors: not a readable safetensors file" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 12)
    with pytest.raises(SsmcraftError, match="bad.safetensors: not a readable safetensors file"):
        load_safetensors(tmp_path / "bad.safetensors")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# the head of a script run in a fresh process, where ssmcraft and the compiler's packages cannot be
# imported: ``load(folder)`` imports the exported module of an export folder from its file
FRESH_PROCESS = textwrap.dedent(r'''
    import importlib.util, json, os, sys
    for blocked in ("ssmcraft", "yaml", "sympy", "optuna"):
        sys.modules[blocked] = None
    import torch
    torch.set_grad_enabled(False)


    def load(folder):
        [name] = [f[:-3] for f in os.listdir(folder) if f.endswith(".py")]
        spec = importlib.util.spec_from_file_location(name, os.path.join(folder, name + ".py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
''')

INTERPRETED = FRESH_PROCESS + textwrap.dedent(r'''
    out = {}
    for folder in sys.argv[1:]:
        mod = load(folder)
        name = mod.__name__
        model = mod.from_pretrained(folder)
        ids = torch.randint(0, model.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
        ref = model(ids)
        mod.OBJECTIVE.prefer = "interpret"
        got = model(ids)
        backend = model.backend
        state = model.init_state(2)
        steps = []
        for t in range(3):
            lt, state = model.step(ids[:, t], state)
            steps.append(lt)
        out[name] = {"diff": float((got - ref).abs().max()), "backend": backend,
                     "step_diff": float((torch.stack(steps, 1) - ref[:, :3]).abs().max())}
    print("RESULT " + json.dumps(out))
''')


def test_inline_triton_kernels_under_the_interpreter(compiled, tmp_path):
    pytest.importorskip("triton")
    from ssmcraft.export.exporter import export_model

    folders = []
    # Longhorn's chunked family runs keys of rank1_row_chunk.MIN_KEYS or more; with 4, rank1_row
    families = {"longhorn": "rank1_row_chunk", "wd_longhorn": "rank1_row", "deltanet": "rank1_chunk",
                "gla": "keydecay_chunk", "longhorn_diag": "diagonal", "mamba": "diagonal"}   # diagonal: generated
    for name, family in families.items():
        result = export_model(tiny_lm(compiled, name, heads=2, state_size=64 if name == "longhorn" else 4),
                              tmp_path / name, source(tmp_path), check=False)
        assert result.kernels == f"inline ({family})", result.kernels     # the family ssmcraft itself runs
        folders.append(str(tmp_path / name))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETED, *folders], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    for name, r in res.items():
        assert r["backend"].startswith("triton-interpret:"), (name, r)
        assert r["diff"] < 1e-4 and r["step_diff"] < 1e-4, (name, r)


FAMILY_LIKE = '''"""A kernel family stand-in."""
from __future__ import annotations

import functools
import os

from ssmcraft.ops.common.launch import launch


@functools.lru_cache(
    maxsize=2,
)
def prepare(obj, lay):
    from ssmcraft.ops.common.slots import CallSlots
    return CallSlots, functools


def forward(obj, lay, co, output_final_state):
    return launch, os.sep
'''


def test_standalone_module_bundles_imports_and_leaves_out_excluded_definitions(tmp_path, monkeypatch):
    """The inline kernel text is built by the bundle machinery: the ssmcraft modules a family
    imports are pasted ahead of it, an excluded function goes with its multi-line decorator,
    its nested ssmcraft import and the imports only it used; third-party imports are refused."""
    from ssmcraft.export.assemble import ExportError, import_problem, standalone_module, text_section

    (tmp_path / "fam_like.py").write_text(FAMILY_LIKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = standalone_module("fam_like", "# head", exclude={"prepare"}, allowed=("torch", "triton"))
    assert text.startswith("# head\n") and "\nfrom __future__ import annotations\n" in text
    assert "prepare" not in text.replace("(without prepare)", "") and "lru_cache" not in text
    assert "import functools" not in text and "import os" in text and "CallSlots" not in text
    assert "# ssmcraft/ops/common/launch.py (" in text and "def launch(" in text and "from ssmcraft" not in text
    ns: dict = {}
    exec(compile(text, "fam_like_bundled", "exec"), ns)   # noqa: S102 - our own bundle
    assert ns["forward"](None, None, None, False) == (ns["launch"], os.sep)
    with pytest.raises(ExportError, match="ops/common/launch.py imports triton at run time"):
        standalone_module("fam_like", "", exclude={"prepare"})
    with_sympy = FAMILY_LIKE.replace("import os\n", "import os\n\nimport sympy\n")
    (tmp_path / "fam_sympy.py").write_text(with_sympy.replace("return launch, os.sep", "return launch, sympy"))
    with pytest.raises(ExportError, match="fam_sympy.py imports sympy at run time"):
        standalone_module("fam_sympy", "", exclude={"prepare"}, allowed=("torch", "triton"))
    # an import only an excluded definition uses is not in the bundle, so it is no problem
    (tmp_path / "fam_prepare_only.py").write_text(with_sympy.replace("return CallSlots, functools",
                                                                      "return CallSlots, sympy"))
    text = standalone_module("fam_prepare_only", "", exclude={"prepare"}, allowed=("torch", "triton"))
    assert "import sympy" not in text
    with pytest.raises(ExportError, match="fam_prepare_only.py imports sympy at run time"):
        standalone_module("fam_prepare_only", "", exclude=set(), allowed=("torch", "triton"))
    assert import_problem("def f():\n    import yaml\n", "x.py") == "x.py imports yaml at run time"
    # generated text after the module (diagonal's kernels and contract) stands in for what was left out...
    after = text_section("stand-in", "def prepare(obj, lay):\n    return 'generated'\n")
    ns = {}
    exec(compile(standalone_module("fam_like", "", exclude={"prepare"}, allowed=("torch", "triton"), after=after),
                 "fam_like_after", "exec"), ns)   # noqa: S102 - our own bundle
    assert ns["prepare"](None, None) == "generated"
    with pytest.raises(ExportError, match="'prepare' is defined by both"):   # ...never silently over a kept one
        standalone_module("fam_like", "", exclude=set(), allowed=("torch", "triton"), after=after)
    assert import_problem("import torch\nfrom ssmcraft.x import y\n", "x.py", ssmcraft=True) is None


FAMILY_ON_RANK1 = '''"""A family built on another family's host code."""
from __future__ import annotations

from ssmcraft.ops.common.tuning import buffer
from ssmcraft.ops.rank1_chunk.chunk import chunk_rank1

POISON = False      # the same statement as rank1_chunk's, comment aside
BACKEND_NAME = "on-rank1"


def _empty(*shape, device, dtype):
    return buffer(shape, device, dtype, POISON)


def forward(obj, lay, co, output_final_state):
    return chunk_rank1, _empty
'''


def test_standalone_module_brings_what_it_reaches_of_another_family(tmp_path, monkeypatch):
    """A family module that imports another family's host code (``precision_rank1`` and ``rankr_chunk``
    run ``rank1_chunk``'s function) brings what that code reaches, not the other family's contract
    (its ``forward``, ``prepare``, ``BACKEND_NAME``), which would clash; a statement both modules
    define alike is laid out once."""
    from ssmcraft.export.assemble import standalone_module

    (tmp_path / "fam_on_rank1.py").write_text(FAMILY_ON_RANK1)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = standalone_module("fam_on_rank1", "", exclude={"prepare"}, allowed=("torch", "triton"))
    assert text.count("\ndef forward(") == 1 and "def prepare(" not in text and "def supports(" not in text
    assert text.count("BACKEND_NAME =") == 1 and "def delta_rule(" not in text
    assert text.count("\nPOISON = False") == 1 and text.count("def _empty(") == 1
    assert "def chunk_rank1(" in text and "class Rank1ChunkFunction" in text
    assert "def rank1_chunk_fwd_state_kernel(" in text
    ns: dict = {}
    exec(compile(text, "fam_on_rank1_bundled", "exec"), ns)   # noqa: S102 - our own bundle
    assert ns["BACKEND_NAME"] == "on-rank1"
    assert ns["forward"](None, None, None, False) == (ns["chunk_rank1"], ns["_empty"])


def test_inline_kernel_text_is_the_family_without_prepare(compiled):
    from ssmcraft.export.exporter import triton_kernel_source

    assert triton_kernel_source(compiled("longhorn"), {"d": 8, "m": 4})[1] == "inline (rank1_row)"   # few keys
    text, phrase = triton_kernel_source(compiled("longhorn"), {"d": 8, "m": 64})
    assert phrase == "inline (rank1_row_chunk)", phrase
    assert "def prepare(" not in text and "def forward(" in text and "def launch(" in text
    assert "from ssmcraft" not in text and text.rstrip().endswith("FAMILY = 'rank1_row_chunk'")


def test_no_inline_kernel_names_the_chaining_family_that_runs_it():
    import ssmcraft
    from ssmcraft.export.exporter import triton_kernel_source
    from ssmcraft.search.compose import compose_objective

    obj = ssmcraft.compile(compose_objective({"proximity": "metric", "data": "huber", "keys": 2, "step": "per_channel",
                                              "update": "decay_explicit", "normalize": True}))
    text, phrase = triton_kernel_source(obj, {"d": 8, "m": 4})
    assert text is None
    assert phrase.startswith("none (precision_general runs it, but chains several families' kernels"), phrase
    assert "no Triton kernel family of this ssmcraft runs" not in phrase
