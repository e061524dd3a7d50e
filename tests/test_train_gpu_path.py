"""The GPU-friendly training path, exercised on CPU: batches built by torch ops on the
generator's device (the vectorised passkey builder is the per-example text, byte for
byte), host read-back every ``train.log_every`` steps with divergence found late but the
weights those of the first bad step, ``train.compile`` (the compiled path with
Dynamo and AOT autograd, and its loud fallback; its decision is tested with
``train.cuda_graphs``' in tests/test_graphs.py), and the config checks."""
from __future__ import annotations

import pytest
import torch

from ssmcraft.errors import SpecError
from ssmcraft.tasks import build_task
from ssmcraft.tasks.passkey import passkey_batch, passkey_text
from ssmcraft.train import load_run, loop, train_run
from ssmcraft.train.config import resolve
from helpers import poison_step


def mqar_config(**train):
    return {"name": "tiny", "seed": 0,
            "task": {"name": "mqar", "vocab": 64, "seq_len": 32, "num_kv_pairs": 4},
            "model": {"d_model": 32, "n_layers": 1, "mlp_ratio": 2,
                      "mixer": {"kind": "objective", "objective": "longhorn", "state_size": 8}},
            "train": {"batch_size": 8, "tokens": 8 * 32 * 10, "eval_every": 0, "eval_batches": 1,
                      "eval_batch_size": 8, **train}}


@pytest.mark.parametrize("seq_len", [300, 401])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0, None])
def test_vectorised_passkey_is_the_per_example_text(seq_len, depth):
    g = torch.Generator().manual_seed(seq_len)
    depths = torch.rand(6, generator=g) if depth is None else depth
    inputs, targets, keys = passkey_batch(6, seq_len, depths, 5, g)
    for b in range(6):
        key = bytes(48 + int(c) for c in keys[b])
        text, _ = passkey_text(seq_len, float(depths[b]) if depth is None else depth, key)
        assert bytes(inputs[b].tolist()) + bytes([int(targets[b, -1])]) == text


@pytest.mark.parametrize("task", [{"name": "mqar", "vocab": 64, "seq_len": 32, "num_kv_pairs": 4},
                                  {"name": "passkey", "seq_len": 300}])
def test_batches_are_made_on_the_generators_device_and_repeat_per_seed(task):
    t = build_task(task)
    a = t.sample("train", 4, generator=torch.Generator(device="cpu").manual_seed(3))
    b = t.sample("train", 4, generator=torch.Generator(device="cpu").manual_seed(3))
    c = t.sample("train", 4, generator=torch.Generator(device="cpu").manual_seed(4))
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[0], c[0])
    assert a[0].device.type == "cpu" and a[0].dtype == torch.int64


def test_text_task_moved_once_slices_where_its_data_is(tmp_path):
    (tmp_path / "a.py").write_text("".join(f"x{i} = {i}\n" for i in range(3000)))
    task = build_task({"name": "text", "corpus": str(tmp_path), "seq_len": 16, "block_size": 512})
    g = torch.Generator().manual_seed(0)
    before = task.sample("train", 3, generator=g)
    assert task.to("cpu") is task
    again = task.sample("train", 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(before[0], again[0]) and torch.equal(before[0][:, 1:], before[1][:, :-1])


def test_divergence_seen_late_keeps_the_weights_of_the_first_bad_step(tmp_path, monkeypatch):
    """log_every 4: NaN at step 5 is read back after step 7, the reason says so, and the
    steps in between changed nothing: the weights equal a per-step-sync run's."""
    poison_step(monkeypatch, 6)
    late = train_run(mqar_config(log_every=4, tokens=8 * 32 * 8), tmp_path / "late")
    poison_step(monkeypatch, 6)
    sync = train_run(mqar_config(log_every=1, tokens=8 * 32 * 8), tmp_path / "sync")
    assert late["status"] == sync["status"] == "diverged"
    assert late["reason"] == ("training loss is nan at step 5 (seen at the read-back 2 step(s) later, "
                              "train.log_every=4)")
    assert sync["reason"] == "training loss is nan at step 5"
    assert late["steps"] == sync["steps"] == 5 and late["tokens"] == sync["tokens"] == 5 * 8 * 32
    a, b = load_run(tmp_path / "late").state_dict(), load_run(tmp_path / "sync").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.isfinite(v).all() for v in a.values())
    assert late["log_every"] == 4 and late["data_device"] == "cpu"


def test_compiled_training_matches_eager(tmp_path, monkeypatch):
    """train.compile true on CPU through Dynamo + AOT autograd (the ``aot_eager`` backend:
    Inductor's C++ build takes a minute here; the GPU runs Inductor), the recurrence a
    graph break: the same losses as eager."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend="aot_eager"))
    eager = train_run(mqar_config(compile=False, tokens=8 * 32 * 3, save_model=False), tmp_path / "eager")
    compiled = train_run(mqar_config(compile=True, tokens=8 * 32 * 3, save_model=False), tmp_path / "compiled")
    assert compiled["compile"] == {"setting": True, "enabled": True, "reason": "train.compile is true",
                                   "opaque_recurrences": 1}
    assert eager["compile"]["enabled"] is False
    assert compiled["train_loss_last"] == pytest.approx(eager["train_loss_last"], rel=1e-5)


def test_a_failed_compile_falls_back_loudly(tmp_path, monkeypatch, caplog):
    from torch._inductor.exc import InvalidCxxCompiler

    class Broken(torch.nn.Module):
        def forward(self, x):
            try:
                raise OSError("g++: not found\nsecond line")
            except OSError as e:          # as Inductor does: its own type, the OS error as the cause
                raise InvalidCxxCompiler() from e

    monkeypatch.setattr(torch, "compile", lambda model, **kw: Broken())
    m = train_run(mqar_config(compile=True, tokens=8 * 32 * 2, save_model=False), tmp_path)
    assert m["status"] == "ok" and m["steps"] == 2
    assert m["compile"]["enabled"] is False
    assert m["compile"]["fallback"].startswith("torch.compile failed: InvalidCxxCompiler: No working C++ compiler")
    assert "torch.compile failed at the first step" in (tmp_path / "train.log").read_text()


def test_a_model_error_at_the_first_compiled_step_is_not_a_compile_failure(tmp_path, monkeypatch):
    """Only the compiler's own error types fall back; the model's error is raised as it is."""
    from ssmcraft.train.compiled import is_compile_error

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("CUDA out of memory (the model's, not the compiler's)")

    monkeypatch.setattr(torch, "compile", lambda model, **kw: Broken())
    with pytest.raises(RuntimeError, match="the model's, not the compiler's"):
        train_run(mqar_config(compile=True, tokens=8 * 32 * 2, save_model=False), tmp_path)
    from torch._inductor.exc import InvalidCxxCompiler
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = InvalidCxxCompiler()
    assert is_compile_error(wrapped) and not is_compile_error(RuntimeError("plain"))


@pytest.mark.parametrize("key, value, message", [
    ("compile", "yes", "train.compile: expected auto, true or false"),
    ("log_every", 0, "train.log_every: expected a positive integer"),
    ("data_on_device", "no", "train.data_on_device: expected true or false"),
    ("autograd_threads", "auto", "train.autograd_threads: expected true or false"),
    ("compile", 1, "train.compile: expected auto, true or false, got 1"),     # not taken for true
    ("data_on_device", 0, "train.data_on_device: expected true or false, got 0"),   # nor 0 for false
    ("backend", "cuda", "train.backend: expected auto, reference, torch, triton or interpret, got 'cuda'"),
    ("precision", True, "train.precision: expected auto, fp32 or bf16, got True"),
])
def test_bad_settings_are_named(key, value, message):
    with pytest.raises(SpecError, match=message):
        resolve(mqar_config(**{key: value}), "x.yaml")


def test_found_inf_is_one_buffer_refreshed_each_step():
    """The divergence flag reaches fused AdamW through one fp32 buffer per run, set in place."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    stopped = torch.zeros((), dtype=torch.bool)
    x, y = torch.randn(2, 5, 3), torch.randint(0, 4, (2, 5))
    opt.found_inf = torch.ones((), dtype=torch.float32)      # as _train creates it; the step refreshes it
    loop._optimizer_step(model, opt, x, y, lambda: torch.enable_grad(), 1.0, stopped, engine_threads=True)
    flag = opt.found_inf
    assert flag.dtype == torch.float32 and float(flag) == 0.0
    before = model.weight.detach().clone()
    stopped.fill_(True)                      # a non-finite value seen earlier: later steps change nothing
    loop._optimizer_step(model, opt, x, y, lambda: torch.enable_grad(), 1.0, stopped, engine_threads=True)
    assert opt.found_inf is flag and float(flag) == 1.0 and torch.equal(model.weight, before)


class _EngineSpy(torch.autograd.Function):
    """Identity whose backward records whether the autograd engine may use its device threads."""
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _EngineSpy.seen.append(torch._C._is_multithreading_enabled())
        return g


class _SpiedLinear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(_EngineSpy.apply(x))


@pytest.mark.parametrize("threads", [True, False])
def test_the_step_backward_takes_the_engine_flag_asked_for(threads):
    """The step's backward runs under train.autograd_threads' flag; the caller's flag is back after."""
    torch.manual_seed(0)
    model = _SpiedLinear(3, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    opt.found_inf = torch.zeros((), dtype=torch.float32)
    x, y = torch.randn(2, 5, 3, requires_grad=True), torch.randint(0, 4, (2, 5))
    _EngineSpy.seen.clear()
    loop._optimizer_step(model, opt, x, y, lambda: torch.enable_grad(), 1.0, torch.zeros((), dtype=torch.bool),
                         engine_threads=threads)
    assert _EngineSpy.seen == [threads] and torch._C._is_multithreading_enabled()


@pytest.mark.parametrize("threads", [True, False])
def test_a_run_passes_and_records_its_autograd_threads(tmp_path, monkeypatch, threads):
    """Every step of a run gets train.autograd_threads, and metrics.json records it."""
    seen, real = [], loop._optimizer_step

    def spy(*a, **k):
        seen.append(k["engine_threads"])
        return real(*a, **k)
    monkeypatch.setattr(loop, "_optimizer_step", spy)
    m = train_run(mqar_config(autograd_threads=threads, tokens=8 * 32 * 2, save_model=False), tmp_path)
    assert seen == [threads, threads] and m["autograd_threads"] is threads
