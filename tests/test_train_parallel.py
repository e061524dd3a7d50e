"""Training one model over several processes and micro-batches: ``torchrun -m ssmcraft train`` with two
gloo processes follows the one-process loss curve for the same global batch; gradient accumulation
equals one big batch; the reducer's weights make uneven scored-token counts a global mean; only rank 0
writes the run folder."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ssmcraft.errors import SpecError
from ssmcraft.tasks.base import IGNORE
from ssmcraft.train import train_run
from ssmcraft.train.parallel import Processes, Reducer, check_split
from ssmcraft.train.validate import step_loss
from helpers import code_corpus, stop_after, subprocess_env, tiny_text_experiment

ENV = subprocess_env()
# float32 on CPU: the sums over the batch run in another order (two halves, then the all-reduce), so
# losses and weights agree to rounding: about 1e-7 relative per step, grown over 10 AdamW steps.
RTOL = 1e-5          # weights; the loss curves agree to 1.1e-7 (measured), held to LOSS_RTOL
LOSS_RTOL = 1e-6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return code_corpus(tmp_path_factory.mktemp("corpus"))


def config(corpus, steps=10, **train):
    return tiny_text_experiment(corpus, batch_size=8, steps=steps, seed=1, **train)


def losses(folder: Path) -> list[float]:
    return [r["loss"] for r in json.loads((folder / "history.json").read_text())["train"]]


def assert_close_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=RTOL, atol=1e-6, msg=k)


def torchrun(spec: Path, out: Path) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 -m ssmcraft train SPEC --out OUT`` (gloo on CPU), which must succeed."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "ssmcraft", "train", str(spec), "--out", str(out), "--quiet"],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_two_gloo_processes_follow_one_process(corpus, tmp_path):
    """The real command under torchrun: 2 processes of 4 rows each against 1 process of 8 rows."""
    spec = tmp_path / "exp.yaml"
    spec.write_text(json.dumps(config(corpus, checkpoint_every=4)))
    out = tmp_path / "two"
    done = torchrun(spec, out)
    assert done.stdout.count("status=ok") == 1                  # rank 0 prints for the run
    one = tmp_path / "one"
    single = train_run(config(corpus, checkpoint_every=4), one)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["processes"] == 2 and single["processes"] == 1
    assert metrics["tokens"] == single["tokens"] == 10 * 8 * 16        # the global batch is the spec's
    assert len(losses(out)) == 10
    assert losses(out) == pytest.approx(losses(one), rel=LOSS_RTOL)
    assert metrics["val_loss"] == pytest.approx(single["val_loss"], rel=RTOL)
    assert_close_weights(out, one)
    # one writer: one start line in the log, no checkpoint left, no temporary files
    assert (out / "train.log").read_text().count("precision fp32, 2 process(es)") == 1
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in one.iterdir())


def test_gradient_accumulation_equals_one_big_batch(corpus, tmp_path):
    big = train_run(config(corpus), tmp_path / "big")
    accum = train_run(config(corpus, grad_accum=4), tmp_path / "accum")
    assert accum["grad_accum"] == 4 and accum["status"] == "ok"
    assert losses(tmp_path / "accum") == pytest.approx(losses(tmp_path / "big"), rel=LOSS_RTOL)
    assert accum["val_loss"] == pytest.approx(big["val_loss"], rel=RTOL)
    assert_close_weights(tmp_path / "accum", tmp_path / "big")


def test_micro_batches_weigh_by_scored_tokens():
    """Targets with IGNORE spread unevenly over micro-batches: the summed gradient and loss are the whole
    batch's mean over scored tokens (a plain mean of micro-batch means would not be)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11))
    x = torch.randint(0, 11, (4, 5))
    y = torch.randint(0, 11, (4, 5))
    y[:2, 1:] = IGNORE                                   # the first micro-batch scores 2 tokens, the second 10
    params = list(model.parameters())
    whole = step_loss(model, x, y, torch.enable_grad)
    expected = torch.autograd.grad(whole, params)
    reducer = Reducer(params, Processes(), 2, torch.device("cpu"))
    xs, ys = reducer.split(x, y)
    assert [float(w) for w in reducer.weights] == pytest.approx([2 / 12, 10 / 12], rel=1e-7)     # float32
    for i, (xi, yi, w) in enumerate(zip(xs, ys, reducer.weights)):
        loss = step_loss(model, xi, yi, torch.enable_grad)
        (loss * w).backward()
        reducer.add(i, loss.detach() * w)
    total = reducer.finish()
    torch.testing.assert_close(total, whole.detach(), rtol=1e-6, atol=0)
    for p, g in zip(params, expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)


def test_the_global_batch_must_split_evenly():
    check_split(8, 2, 2, "x.yaml")
    with pytest.raises(SpecError) as e:
        check_split(6, 2, 2, "x.yaml")
    assert str(e.value) == ("x.yaml: train.batch_size: 6 does not split into 2 process(es) x 2 micro-batch(es) "
                            "(train.grad_accum) of equal size")


def test_one_named_gpu_is_refused_for_several_processes(monkeypatch):
    """Under torchrun each process takes cuda:LOCAL_RANK: a spec naming one GPU is refused before any
    process group starts."""
    from ssmcraft.train import parallel

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SpecError) as e:
        parallel.start("cuda:1", "x.yaml")
    assert str(e.value) == ("x.yaml: train.device: cuda:1 names one GPU, but this run has 2 processes, each on "
                            "cuda:LOCAL_RANK (use auto or cuda)")
    assert not torch.distributed.is_initialized()


def test_the_graphed_step_takes_micro_batches(corpus, tmp_path, monkeypatch):
    """The loop's graphed branch with micro-batches (CUDA's capture replaced by the captured function, as
    tests/test_graphs.py does): captured once for the micro-batch shape, every step graphed, the losses
    those of the eager run with the same micro-batches."""
    from ssmcraft.train import graphed, loop
    from ssmcraft.train.graphed import _LossModule

    made = []

    def capture(fn, sample, **kw):
        assert isinstance(fn, _LossModule)
        made.append(tuple(sample[0].shape))
        return fn

    eager = train_run(config(corpus, steps=4, grad_accum=2), tmp_path / "eager")
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    monkeypatch.setattr(graphed, "require_cuda", lambda entries, what="graphed": None)
    monkeypatch.setattr(loop, "graphs_decision", lambda setting, *a: (True, "forced on for the test"))
    m = train_run(config(corpus, steps=4, grad_accum=2), tmp_path / "graphed")
    assert made == [(4, 16)]                     # 8 rows in 2 micro-batches
    assert m["cuda_graphs"]["graphed_steps"] == 4 and m["cuda_graphs"]["eager_steps"] == 0
    assert losses(tmp_path / "graphed") == losses(tmp_path / "eager")


def test_a_one_process_checkpoint_resumes_on_two(corpus, tmp_path, monkeypatch):
    """The checkpoint holds the global batch's data position, so a run stopped on one process finishes on
    two with the uninterrupted run's curve (to rounding)."""
    spec = tmp_path / "exp.yaml"
    spec.write_text(json.dumps(config(corpus, checkpoint_every=4)))
    stop_after(monkeypatch, 8)
    with pytest.raises(KeyboardInterrupt):
        train_run(config(corpus, checkpoint_every=4), tmp_path / "run")
    torchrun(spec, tmp_path / "run")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 8 and metrics["processes"] == 2
    monkeypatch.undo()
    train_run(config(corpus, checkpoint_every=4), tmp_path / "whole")
    assert losses(tmp_path / "run")[:8] == losses(tmp_path / "whole")[:8]          # the one-process steps, exactly
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "whole"), rel=LOSS_RTOL)
    assert_close_weights(tmp_path / "run", tmp_path / "whole")
