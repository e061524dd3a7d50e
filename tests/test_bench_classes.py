"""``ssmcraft bench --classes`` on CPU: every composed class derives and compiles to the structure it
stands for, the table's ratio column, and the refusals (no CUDA, arguments of the other mode). The
timings themselves run on a GPU (``ssmcraft bench --classes``, ``benchmarks/bench_classes.py``)."""
from __future__ import annotations

import pytest
import torch

import ssmcraft
from ssmcraft.bench import classes_commands as classes
from ssmcraft.cli import main

# the structure each composed class must compile to (what makes it a class of its own)
KIND = {"kda_like": "rank1", "rank2_head": "rankr", "rank2_head_gated": "rankr", "minibatch_delta": "general",
        "minibatch_huber": "nonlinear",
        "huber_channel_gated": "nonlinear", "cauchy_channel": "nonlinear", "mlp_huber_minibatch": "nonlinear",
        "mlp_cauchy_2key": "nonlinear", "metric_rank2": "nonlinear",
        "metric_huber": "nonlinear", "metric_implicit": "nonlinear", "metric_implicit_channel": "nonlinear"}


def test_every_composed_class_is_listed_with_its_structure():
    assert set(classes.COMPOSED) == set(KIND)


@pytest.mark.parametrize("label", sorted(KIND))
def test_composed_class_compiles_to_its_structure(label):
    (ref, _), (got, spec) = classes.class_specs((label,))
    assert (ref, got) == (classes.REFERENCE, label)
    obj = ssmcraft.compile(spec)
    assert obj.ir.kind == KIND[label]


def test_default_rows_are_deltanet_then_the_library_then_the_composed():
    from ssmcraft.compiler.library import library_names
    labels = [label for label, _ in classes.class_specs()]
    assert labels[0] == "deltanet" and labels.count("deltanet") == 1
    assert set(labels) == set(library_names()) | set(classes.COMPOSED)
    assert labels[-len(classes.COMPOSED):] == list(classes.COMPOSED)
    assert [label for label, _ in classes.class_specs(composed=False)] == [
        "deltanet", *[n for n in library_names() if n != "deltanet"]]


def test_table_ratio_is_to_deltanet_and_errors_are_rows():
    rows = [{"spec": "deltanet", "kind": "rank1", "backend": "b", "fwd_ms": 0.25, "fwd_bwd_ms": 0.8},
            {"spec": "x", "kind": "rankr", "backend": "c", "fwd_ms": 1.0, "fwd_bwd_ms": 2.0},
            {"spec": "y", "error": "RuntimeError: boom"}]
    lines = classes.table(rows)
    assert lines[2] == "| deltanet | rank1 | b | 0.250 | 0.800 | 1.00 |"
    assert lines[3] == "| x | rankr | c | 1.000 | 2.000 | 2.50 |"
    assert lines[4] == "| y | - | RuntimeError: boom | - | - | - |"


def test_classes_without_cuda_is_one_line_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--classes"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no CUDA device" in err


@pytest.mark.parametrize("argv, words", [
    (["bench", "--classes", "deltanet"], "takes no SPEC"),
    (["bench", "--classes", "--layer"], "takes no SPEC"),
    (["bench"], "needs an objective SPEC"),
    (["bench", "deltanet", "--only", "gla"], "go with --classes"),
])
def test_mixed_arguments_are_refused(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err
