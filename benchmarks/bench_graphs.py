"""Issue 12, host overhead: eager against CUDA-graph replay, for ``obj()``, training and decoding.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_graphs.py --out DIR      # H200: about 5-8 minutes
    python3 benchmarks/bench_graphs.py --tiny --out DIR                  # CPU or GPU smoke run

1. ``obj()`` of deltanet, gated_deltanet, gla, mamba and exact longhorn at bf16 B=8 T=2048 (the
   shapes and inputs of ``bench_public_path.CASES`` / ``case_inputs``): wall ms of the forward (no
   grad) and forward+backward, eager ``obj(...)`` (its forward+backward also with the autograd
   engine on the calling thread, "1-thread") against ``obj.graphed(...)`` on the caller's
   tensors and on the graph's own buffers ("static"); per call the GPU-busy fraction and the host
   time (``ssmcraft.runtime.timing``: ``obj_calls``, ``time_calls``, ``busy``, the same code as
   ``ssmcraft bench --graphed``). Then correctness (``checking.graphed_against_eager``): with an
   initial state that requires grad and ``output_final_state=True``, the graphed call's ``y``,
   ``S_T`` and every gradient (initial state included) against eager's, relative max error
   (target: exact, or <= 1e-6).
2. Training tokens/s of the 20M byte LM (``bench_train_mixers.build``/``tokens_per_s``: B16 T512,
   bf16 autocast, AdamW) with the longhorn, mamba, deltanet and gla mixers, eager against
   ``train.cuda_graphs``' ``GraphedLoss``, each with the backward handed to the autograd engine's
   device thread and on the calling thread (``train.autograd_threads: false``); and the first step's loss and every parameter gradient,
   graphed against eager.
3. Decode tokens/s of the 6-layer 20M Longhorn LM at batch 1 and 16 (``bench_public_path.decode``),
   eager ``LM.step`` against ``GraphedDecoder``; and 16 tokens' logits, graphed against eager.

Prints a short table; writes ``DIR/bench_graphs.json``. ``--tiny``: small shapes and few steps. On a
machine without CUDA every part is recorded as skipped, with why; what runs without a GPU (the
refusals, the decode body over static buffers against eager ``LM.step``, GraphedCall's bookkeeping)
is tested in ``tests/test_graphs.py``, and the obj() section's timing plumbing and identity check
(capture stubbed) in ``tests/test_bench_graphed.py``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_public_path import CASES, case_inputs, decode  # noqa: E402
from bench_train_mixers import build, tokens_per_s  # noqa: E402
from common import Report, random_state  # noqa: E402
from ssmcraft.errors import one_line  # noqa: E402
from ssmcraft.runtime.checking import graphed_against_eager, rel_max  # noqa: E402
from ssmcraft.runtime.timing import HOWS, obj_calls, time_calls  # noqa: E402

OBJECTIVES = ("deltanet", "gated_deltanet", "gla", "mamba", "longhorn")
MIXERS = ("longhorn", "mamba", "deltanet", "gla")


def obj_cases():
    """[(objective, (H, d, m))] of the obj() section, in ``OBJECTIVES`` order (shapes from
    ``bench_public_path.CASES``)."""
    shapes = {name: hdm for name, hdm, _ in CASES}
    return [(name, shapes[name]) for name in OBJECTIVES]


# -- 1. obj() -----------------------------------------------------------------------------------

def obj_rows(rep, name, H, d, m, B, T, device="cuda"):
    """One objective's row: eager, graphed and static timed (fwd, fwd+bwd, GPU busy), then the check.
    ``device``: CUDA here; the tests run it on CPU with the capture and the timers stubbed."""
    obj, inputs, params = case_inputs(name, H, d, m, B, T, device=device)
    dy = torch.randn_like(obj(inputs, params, None, False)[0])
    row = dict(section="obj", objective=name, shape=f"B{B} T{T} H{H} d{d} m{m} bf16", backend=obj.backend)
    row.update(time_calls(obj_calls(obj, inputs, params, None, False, dy, graphed=True), with_busy=True))
    S0 = random_state(obj, B, H, d, m, device, requires_grad=True)
    row.update(graphed_against_eager(obj, inputs, params, S0))
    rep.add(**row)


# -- 2. training --------------------------------------------------------------------------------

def train_rows(rep, name, steps, warmup):
    row = dict(section="train", mixer=name)
    for how, graphs, threads in (("eager", False, True), ("eager_1t", False, False), ("graphed", True, True),
                                 ("graphed_1t", True, False)):
        torch.manual_seed(0)
        lm = build(name)
        row[f"{how}_tokens_per_s"], row[f"{how}_peak_GiB"] = tokens_per_s(lm, steps=steps, warmup=warmup, graphs=graphs,
                                                                          engine_threads=threads)
    row["speedup"] = row["graphed_tokens_per_s"] / row["eager_tokens_per_s"]
    row["backend"] = lm.backends()
    row.update(train_check(name))
    rep.add(**row)


def train_check(name, B=16, T=512) -> dict:
    """The loss and every parameter gradient of one step: graphed (``GraphedLoss``) against eager."""
    from ssmcraft.train.graphed import GraphedLoss, _LossModule
    torch.manual_seed(0)
    lm = build(name)
    batch = torch.randint(0, 256, (B, T + 1), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    x, y = batch[:, :-1], batch[:, 1:]
    params = [p for p in lm.parameters() if p.requires_grad]

    loss_module = _LossModule(lm, torch.device("cuda"), "bf16")      # what GraphedLoss captures, run eager

    def eager_step():
        loss = loss_module(x, y)
        return loss.detach(), grads(loss)

    def grads(loss):            # an unused parameter's gradient as zeros (the graph returns None for it)
        gs = torch.autograd.grad(loss, params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g.clone() for g, p in zip(gs, params)]

    def worst_of(a, b):
        return max([rel_max(a[0], b[0]), *(rel_max(u, v) for u, v in zip(a[1], b[1]))])
    eager = eager_step()
    floor = worst_of(eager_step(), eager)          # eager against itself (cuBLAS may not repeat bitwise)
    graphed = GraphedLoss(lm, x, y, torch.device("cuda"), "bf16")
    loss = graphed(x, y)
    mine = (loss.detach().clone(), grads(loss))
    worst = worst_of(mine, eager)
    return {"check_loss_eager": eager[0].item(), "check_loss_graphed": mine[0].item(), "check_worst_rel": worst,
            "check_eager_repeat_rel": floor, "check_ok": worst <= max(1e-6, floor)}


# -- 3. decode ----------------------------------------------------------------------------------

def decode_check(lm, B, n=16) -> dict:
    """n tokens' logits from zero caches: graphed decoder against eager ``LM.step`` (bf16 autocast)."""
    from ssmcraft.layers.graphed_decode import GraphedDecoder
    tokens = torch.randint(0, 256, (B, n), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    dec = GraphedDecoder(lm, B, autocast_dtype=torch.bfloat16)
    caches, worst = lm.init_cache(B), 0.0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for t in range(n):
            logits, caches = lm.step(tokens[:, t], caches)
            worst = max(worst, rel_max(dec.step(tokens[:, t]), logits))
    return {"section": "decode-check", "batch": B, "tokens": n, "worst_rel": worst, "ok": worst <= 1e-6}


def guarded(rep, part, fn, *args, **kw):
    """Run one part; a failure is recorded as an ``error`` row (with where it was raised) and the
    benchmark goes on with the next part."""
    import traceback
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001: reported, not hidden
        where = traceback.extract_tb(e.__traceback__)[-3:]
        rep.add(section="error", part=part, error=one_line(e),
                where=[f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in where])


def table(rep):
    rows = rep.data["rows"]
    print("\n# obj() bf16 (1-thread: eager fwd+bwd, the autograd engine on the calling thread; static: the "
          "graph's own input buffers, no copy-in): objective | fwd ms eager / graphed / static | "
          "fwd+bwd ms eager / 1-thread / graphed / static | host us fwd / fwd+bwd eager, 1-thread (fwd+bwd), "
          "graphed, static | GPU busy fwd+bwd eager / 1-thread / graphed / static | check")
    for r in (r for r in rows if r.get("section") == "obj"):
        fwd_hows = [h for h in HOWS if f"{h}_fwd_ms" in r]         # onethread times fwd+bwd only
        print(f"{r['objective']:14s} | " + " / ".join(f"{r[f'{h}_fwd_ms']:.3f}" for h in fwd_hows) + " | "
              + " / ".join(f"{r[f'{h}_fwd_bwd_ms']:.3f}" for h in HOWS) + " | "
              + ", ".join(" / ".join(f"{r[f'{h}_host_us_{k}']:.0f}" for k in ("fwd", "fwd_bwd") if f"{h}_{k}_ms" in r)
                          for h in HOWS) + " | "
              + " / ".join(f"{r[f'{h}_busy_fwd_bwd']:.2f}" for h in HOWS) + " | "
              f"{'exact' if r['check_exact'] else format(r['check_worst_rel'], '.1e')} "
              f"{'PASS' if r['check_ok'] else 'FAIL'}")
    print("# training tokens/s (20M byte LM, B16 T512 bf16; 1t: the backward on the calling thread, "
          "train.autograd_threads: false): mixer | eager | eager 1t | graphed | graphed 1t | speedup (graphed / eager) | check")
    for r in (r for r in rows if r.get("section") == "train"):
        print(f"{r['mixer']:9s} | {r['eager_tokens_per_s']:.0f} | {r['eager_1t_tokens_per_s']:.0f} | "
              f"{r['graphed_tokens_per_s']:.0f} | {r['graphed_1t_tokens_per_s']:.0f} | "
              f"{r['speedup']:.2f}x | {r['check_worst_rel']:.1e} {'PASS' if r['check_ok'] else 'FAIL'}")
    print("# decode tokens/s: batch | eager | graphed | logits check")
    dec = {(r["batch"], r["graphed"]): r["decode_tokens_per_s"] for r in rows if r.get("section") == "decode"}
    checks = {r["batch"]: r for r in rows if r.get("section") == "decode-check"}
    for B in sorted({b for b, _ in dec}):
        c = checks.get(B)
        print(f"B={B:3d} | {dec.get((B, False), float('nan')):.0f} | {dec.get((B, True), float('nan')):.0f} | "
              + (f"{c['worst_rel']:.1e} {'PASS' if c['ok'] else 'FAIL'}" if c else "-"))
    for r in (r for r in rows if r.get("section") in ("skipped", "error")):
        verdict = "PASS" if r.get("ok") else r.get("why", r.get("error", "FAIL"))
        print(f"# {r['section']}: {r.get('part')}: {verdict}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for bench_graphs.json")
    ap.add_argument("--tiny", action="store_true", help="small shapes, few steps (a smoke run; without CUDA every part is skipped)")
    ap.add_argument("--only", help="comma-separated parts: obj, train, decode (default: all)")
    args = ap.parse_args()
    parts = set(args.only.split(",")) if args.only else {"obj", "train", "decode"}
    rep = Report("bench_graphs (host overhead)")
    cuda = torch.cuda.is_available()
    B, T = (2, 256) if args.tiny else (8, 2048)
    if not cuda:
        for part in sorted(parts):
            rep.add(section="skipped", part=part, why="CUDA graphs need a CUDA device; torch.cuda.is_available() "
                                                      "is false here")
    else:
        if "obj" in parts:
            for name, (H, d, m) in obj_cases():
                guarded(rep, f"obj {name}", obj_rows, rep, name, H, d, m, B, T)
        if "train" in parts:
            for name in MIXERS[:1] if args.tiny else MIXERS:
                guarded(rep, f"train {name}", train_rows, rep, name, 3 if args.tiny else 20, 2 if args.tiny else 5)
        if "decode" in parts:
            lm = build("longhorn")
            for graphed in (False, True):
                guarded(rep, f"decode graphed={graphed}", decode, rep, 8 if args.tiny else 128, graphed,
                        parallel=False, lm=lm)
            for batch in (1, 16):
                guarded(rep, f"decode check B={batch}", lambda b: rep.add(**decode_check(lm, b)), batch)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        rep.write(str(Path(args.out) / "bench_graphs.json"))
    table(rep)


if __name__ == "__main__":
    main()
