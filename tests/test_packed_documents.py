"""Packed documents in the byte LM: the causal conv, the objective mixer, attention and the whole LM
restart at document boundaries (a packed row equals the documents run one by one; changing one
document leaves the others' outputs unchanged), the text task marks document starts and does not
score the prediction of a document's first byte from the previous one, and training packs by
default."""
import json

import pytest
import torch

from ssmcraft.errors import SpecError
from ssmcraft.layers.config import LMConfig
from ssmcraft.layers.conv import CausalConv1d
from ssmcraft.layers.lm import DOC_START, LM, document_offsets
from ssmcraft.tasks import IGNORE, build_task
from ssmcraft.tasks.corpus import load_corpus
from helpers import tiny_text_experiment

LENS = [5, 1, 2, 9]        # one document shorter than the conv window (k = 4), one of one token


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def test_conv_restarts_at_each_document():
    torch.manual_seed(0)
    conv = CausalConv1d(6, 4)
    x = torch.randn(1, sum(LENS), 6)
    packed = conv(x, _cu(LENS))
    alone = torch.cat([conv(part) for part in x.split(LENS, dim=1)], dim=1)
    assert torch.allclose(packed, alone, atol=1e-6)
    assert not torch.allclose(conv(x), alone, atol=1e-3)       # the plain conv does see across


def _lm(mixer=None, layers=None):
    torch.manual_seed(0)
    cfg = {"vocab_size": 256, "d_model": 16, "n_layers": 2, "mlp_ratio": 2,
           "mixer": mixer or {"kind": "objective", "objective": "gla", "state_size": 4}}
    if layers is not None:
        cfg["layers"] = layers
    return LM(LMConfig.from_dict(cfg)).double()


def _flagged(docs):
    """Documents laid end to end in one row, each first token flagged DOC_START."""
    return torch.cat([torch.cat([d[:1] + DOC_START, d[1:]]) for d in docs])[None]


@pytest.mark.parametrize("mixer, layers", [
    (None, None),
    ({"kind": "objective", "objective": "longhorn", "state_size": 4}, None),
    (None, [{"at": [0], "mixer": {"kind": "attention", "heads": 2}}]),                 # a hybrid stack
    (None, [{"at": [0], "mixer": {"kind": "attention", "heads": 2, "window": 3}}]),
])
def test_lm_documents_do_not_leak(mixer, layers):
    """Logits of a packed row equal each document run alone; changing document 1 changes no other
    document's logits."""
    lm = _lm(mixer, layers)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in LENS]
    lm.documents = True
    packed = lm(_flagged(docs))
    lm.documents = False
    alone = torch.cat([lm(d[None]) for d in docs], dim=1)
    assert torch.allclose(packed, alone, atol=1e-10)
    lm.documents = True
    changed = lm(_flagged([torch.randint(0, 256, (LENS[0],), generator=g), *docs[1:]]))
    assert torch.equal(changed[:, LENS[0]:], packed[:, LENS[0]:])
    assert not torch.allclose(changed[:, :LENS[0]], packed[:, :LENS[0]])


def test_rows_start_documents_and_offsets_span_the_batch():
    tokens = torch.tensor([[1, 2, 3 + DOC_START, 4], [5 + DOC_START, 6, 7, 8 + DOC_START]])
    ids, cu = document_offsets(tokens)
    assert torch.equal(ids, torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))
    assert cu.tolist() == [0, 2, 4, 7, 8] and cu.dtype == torch.int32


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"A" * 300)
    (tmp_path / "b.txt").write_bytes(b"B" * 200)
    (tmp_path / "c.txt").write_bytes(b"C" * 100)
    return tmp_path


def test_corpus_records_document_starts(folder):
    assert load_corpus(str(folder)).starts == [0, 301, 502]


def test_text_task_flags_document_starts_and_ignores_the_cross_document_target(folder):
    task = build_task({"name": "text", "corpus": str(folder), "seq_len": 64, "val_fraction": 0.2, "block_size": 1000})
    assert task.documents and task.describe()["pack"] is True
    x, y = task.sample("train", 64, generator=torch.Generator().manual_seed(0))
    flagged = x >= DOC_START
    byte = torch.where(flagged, x - DOC_START, x)
    assert bool(flagged.any())
    assert set(byte[flagged].tolist()) <= {ord("B"), ord("C")}            # the first byte of b.txt, c.txt
    # the target of the token before a document start is ignored; every other target is the next byte
    assert torch.equal(y[:, :-1] == IGNORE, flagged[:, 1:])
    keep = y[:, :-1] != IGNORE
    assert torch.equal(y[:, :-1][keep], byte[:, 1:][keep])
    plain = build_task({"name": "text", "corpus": str(folder), "seq_len": 64, "val_fraction": 0.2,
                        "block_size": 1000, "pack": False})
    x, y = plain.sample("train", 8, generator=torch.Generator().manual_seed(0))
    assert not plain.documents and bool((x < 256).all()) and torch.equal(x[:, 1:], y[:, :-1])


def test_split_seams_are_document_starts(folder):
    """A training block that follows a validation block starts a document: the bytes before it
    in the training split were not adjacent to it in the corpus."""
    from ssmcraft.tasks.text import document_starts
    train, val = document_starts(600, [0], 0.5, 100)      # blocks 1, 3, 5 are validation
    assert train.nonzero().flatten().tolist() == [0, 100, 200]
    assert val.nonzero().flatten().tolist() == [0, 100, 200]


def test_pack_must_be_a_bool(folder):
    with pytest.raises(SpecError, match="pack"):
        build_task({"name": "text", "corpus": str(folder), "pack": "yes"})


def test_training_packs_by_default(folder, tmp_path):
    """A tiny run on a three-document corpus trains with packed documents and says so."""
    from ssmcraft.train import load_run, train_run
    cfg = tiny_text_experiment(str(folder), batch_size=4, steps=3)
    cfg["model"]["mixer"]["objective"] = "gla"
    train_run(cfg, tmp_path / "run")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["task"]["pack"] is True
    assert metrics["status"] == "ok", metrics.get("status")
    lm = load_run(tmp_path / "run", "cpu")
    assert lm.documents is False            # a loaded model reads plain tokens unless told


def test_cuda_graphs_are_off_for_packed_documents():
    """Boundaries change every batch, which a captured graph cannot replay: auto turns graphs off
    (saying why), true is refused naming both keys."""
    from ssmcraft.train.graphed import graphs_decision
    cuda = torch.device("cuda")
    assert graphs_decision("auto", cuda, False, documents=True) == \
        (False, "train.cuda_graphs auto: off for packed documents (task.pack: boundaries change every batch)")
    with pytest.raises(SpecError, match="train.cuda_graphs: true cannot capture packed documents"):
        graphs_decision(True, cuda, False, documents=True)
    assert graphs_decision("auto", cuda, False)[0] is True
