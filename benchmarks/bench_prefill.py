"""Parallel prefill against the token loop: a prompt through ``LM.prefill`` (one parallel pass, the
recurrence's chunked/row kernel) against ``LM.step`` over every token from ``init_cache``.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_prefill.py --out DIR     # GPU: 2,048 tokens, batch 1
    python3 benchmarks/bench_prefill.py --tiny                           # CPU or GPU smoke run

The model is ``specs/longhorn_20m_bytes.yaml``'s (6 x d512 exact Longhorn, byte vocabulary, random
weights; ``--spec`` names another experiment file). Both paths run under ``torch.no_grad`` (and
bf16 autocast on CUDA; ``--fp32`` turns it off). Prints the wall time of each, the ratio (target
on the GPU: >= 20x) and how far apart they land: the last prompt token's logits and every layer's
cache after the prompt, then ``--decode`` greedy steps from each (relative max errors,
``ssmcraft.runtime.checking.rel_max``). ``--tiny``: d_model 32, 2 layers, 64 tokens, for checking
the script on a CPU. Writes ``DIR/bench_prefill.json`` with ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report  # noqa: E402
from ssmcraft.layers.config import LMConfig  # noqa: E402
from ssmcraft.layers.lm import LM  # noqa: E402
from ssmcraft.runtime.checking import rel_max  # noqa: E402
from ssmcraft.tasks.text import VOCAB  # noqa: E402
from ssmcraft.train.config import load_experiment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = {"d_model": 32, "n_layers": 2}


def build(spec: str, tiny: bool, device: str) -> LM:
    """The spec's model (byte vocabulary), random weights, in eval mode on ``device``."""
    model = dict(load_experiment(spec)["model"])
    if tiny:
        model.update(TINY)
    torch.manual_seed(0)
    return LM(LMConfig.from_dict({**model, "vocab_size": VOCAB}, spec, "model")).to(device).eval()


def token_loop(lm: LM, tokens: torch.Tensor):
    """Today's prompt path: ``LM.step`` per token from fresh caches -> (last logits, caches)."""
    caches = lm.init_cache(tokens.shape[0])
    for t in range(tokens.shape[1]):
        logits, caches = lm.step(tokens[:, t], caches)
    return logits, caches


def prefill(lm: LM, tokens: torch.Tensor):
    logits, caches = lm.prefill(tokens)
    return logits[:, -1], caches


def timed_s(fn, reps: int, device: str) -> tuple[float, object]:
    """Median wall seconds of ``reps`` calls after one warm-up, and the last call's result."""
    out = fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def cache_tensors(caches) -> list[torch.Tensor]:
    """Every tensor of a list of per-layer caches (conv windows, states, keys and values)."""
    out = []
    for cache in caches:
        for value in vars(cache).values():
            out += [v for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, torch.Tensor)]
    return out


def agreement(lm: LM, a, b, steps: int) -> dict:
    """Relative max errors between two (last logits, caches) results, and between ``steps`` greedy
    decode steps continued from each."""
    (la, ca), (lb, cb) = a, b
    row = {"logits_rel_err": rel_max(la.float(), lb.float()),
           "cache_rel_err": max(rel_max(x.float(), y.float()) for x, y in zip(cache_tensors(ca), cache_tensors(cb)))}
    worst = 0.0
    for _ in range(steps):
        tok = lb.argmax(-1)
        la, ca = lm.step(tok, ca)
        lb, cb = lm.step(tok, cb)
        worst = max(worst, rel_max(la.float(), lb.float()))
    row["decode_rel_err"] = worst
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "specs" / "longhorn_20m_bytes.yaml"))
    ap.add_argument("--tiny", action="store_true", help="d_model 32, 2 layers, 64 tokens (a CPU smoke run)")
    ap.add_argument("--tokens", type=int, default=None, help="prompt length (default 2048, 64 with --tiny)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="timed calls of each path (median; after one warm-up)")
    ap.add_argument("--decode", type=int, default=16, help="greedy steps compared after the prompt")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast on CUDA")
    ap.add_argument("--out", default=None, help="folder for bench_prefill.json")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T = args.tokens or (64 if args.tiny else 2048)
    lm = build(args.spec, args.tiny, device)
    rep = Report("bench_prefill")
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" and not args.fp32
                else contextlib.nullcontext())
    tokens = torch.randint(0, VOCAB, (args.batch, T), device=device, generator=torch.Generator(device).manual_seed(0))
    with torch.no_grad(), autocast:
        pre_s, pre = timed_s(lambda: prefill(lm, tokens), args.reps, device)
        prefill_backend = lm.backends()
        loop_s, loop = timed_s(lambda: token_loop(lm, tokens), max(1, min(args.reps, 2)), device)
        step_backend = lm.backends()
        agree = agreement(lm, pre, loop, args.decode)
    n_params = sum(p.numel() for p in lm.parameters())
    rep.add(model=f"{len(lm.blocks)} x d{lm.cfg.d_model} {lm.describe()['mixer']['objective']}, "
            f"{n_params / 1e6:.2f}M params", batch=args.batch, tokens=T,
            precision="fp32" if device == "cpu" or args.fp32 else "bf16-autocast",
            prefill_ms=pre_s * 1e3, token_loop_ms=loop_s * 1e3, speedup=loop_s / pre_s,
            prefill_tokens_per_s=args.batch * T / pre_s, loop_tokens_per_s=args.batch * T / loop_s,
            prefill_backend=prefill_backend, step_backend=step_backend, **agree)
    rep.set("speedup", loop_s / pre_s)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        rep.write(os.path.join(args.out, "bench_prefill.json"))


if __name__ == "__main__":
    main()
