"""Issue 12: training throughput of the 20M byte LM (``specs/longhorn_20m_bytes.yaml``'s model) with
the Longhorn, Mamba, GLA and DeltaNet mixers, and the same LM with an anchor kernel swapped into
the mixer's recurrence (FLA for GLA / DeltaNet / exact Longhorn, mamba's selective_scan for Mamba).

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_train_mixers.py [--mamba DIR] [--no-anchors] [--out FILE]

One training step = forward, loss, backward, AdamW step, bf16 autocast (as ``ssmcraft train`` on
CUDA with ``train.cuda_graphs: false``; ``--one-thread``: the backward on the calling thread,
``train.autograd_threads: false``), B=16, T=512 random bytes; tokens/s over 20 steps after 5
warm-up steps. The anchors replace only ``obj(inputs, params)`` inside each mixer (projections, conv, gate and MLP are the
same code), so the gap between a row and its anchor row is the recurrence's share.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report  # noqa: E402
from ssmcraft.errors import one_line  # noqa: E402

DEV = "cuda"
MIXERS = ("longhorn", "mamba", "gla", "deltanet")


def build(objective: str):
    """The byte LM of ``specs/longhorn_20m_bytes.yaml`` (6 x d512, 20M parameters with Longhorn) with
    ``objective``'s mixer, random weights."""
    from ssmcraft.layers.config import LMConfig
    from ssmcraft.layers.lm import LM
    cfg = LMConfig.from_dict({"vocab_size": 256, "d_model": 512, "n_layers": 6, "mlp_ratio": 2,
                              "mixer": {"kind": "objective", "objective": objective, "heads": 1, "state_size": 16}})
    return LM(cfg).to(DEV)


def anchor_recurrence(objective: str, mamba_dir: str | None):
    """fn(inputs, params) -> y [B, T, H, d] computing the objective with an external kernel."""
    if objective == "gla":
        from fla.ops.gla import chunk_gla
        return lambda i, p: chunk_gla(i["q"], i["k"], i["x"], i["alpha"].float().log(), scale=1.0)[0]
    if objective in ("deltanet", "longhorn"):
        from fla.ops.delta_rule import fused_recurrent_delta_rule
        if objective == "deltanet":     # K = 16: FLA's chunked form faults at this K (ENV.md)
            return lambda i, p: fused_recurrent_delta_rule(i["q"], i["k"], i["x"], i["beta"], scale=1.0)[0]

        from bench_public_path import longhorn_rows
        return lambda i, p: fused_recurrent_delta_rule(i["q"], i["k"], i["x"], longhorn_rows(i), scale=1.0)[0]
    if objective == "mamba":
        sys.path.insert(0, mamba_dir or "")
        import selective_scan_cuda as ssc

        from bench_public_path import SelectiveScan, mamba_layout

        def mamba(i, p):
            A = p["A"][0] if p["A"].dim() == 3 else p["A"]
            out, _ = SelectiveScan.apply(ssc, *mamba_layout(i, {"A": A}))
            return out.transpose(1, 2)[:, :, None]
        return mamba
    raise ValueError(objective)


def swap(lm, fn, label):
    for m in lm.mixers:
        def recur(inputs, params, state=None, m=m):
            m.last_backend = label
            return fn(inputs, params), None
        m._recur = recur


def tokens_per_s(lm, B=16, T=512, steps=20, warmup=5, graphs=False, engine_threads=True) -> tuple[float, float]:
    """(tokens/s, peak GiB) of training steps; ``graphs``: forward, loss and backward replayed from
    CUDA graphs (``ssmcraft.train.graphed.GraphedLoss``, what ``train.cuda_graphs`` runs);
    ``engine_threads``: the backward handed to the autograd engine's device thread (PyTorch's
    default; False: run on this thread, ``train.autograd_threads: false``)."""
    from ssmcraft.train.device import autocast
    from ssmcraft.train.validate import step_loss
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-4)
    g = torch.Generator(device=DEV).manual_seed(0)
    data = torch.randint(0, 256, (steps + warmup, B, T + 1), device=DEV, generator=g)
    torch.cuda.reset_peak_memory_stats()
    graphed = None
    if graphs:
        from ssmcraft.train.graphed import GraphedLoss
        graphed = GraphedLoss(lm, data[0, :, :-1], data[0, :, 1:], torch.device(DEV), "bf16")

    amp = (lambda: autocast(torch.device(DEV), "bf16"))

    def step(batch):
        if graphed is not None:
            loss = graphed(batch[:, :-1], batch[:, 1:])
        else:                   # the loop's eager step
            loss = step_loss(lm, batch[:, :-1], batch[:, 1:], amp)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.autograd.set_multithreading_enabled(engine_threads):    # per thread: this one's steps
        for i in range(warmup):
            step(data[i])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            step(data[warmup + i])
        torch.cuda.synchronize()
    return B * T * steps / (time.perf_counter() - t0), torch.cuda.max_memory_allocated() / 2**30


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mamba", help="directory holding mamba's built selective_scan_cuda extension")
    ap.add_argument("--no-anchors", action="store_true")
    ap.add_argument("--only", help="comma-separated mixers (default: all four)")
    ap.add_argument("--one-thread", action="store_true",
                    help="run the backward on the calling thread (train.autograd_threads: false)")
    ap.add_argument("--out")
    args = ap.parse_args()
    rep = Report("bench_train_mixers")
    for name in (args.only.split(",") if args.only else MIXERS):
        torch.manual_seed(0)
        lm = build(name)
        tps, mem = tokens_per_s(lm, engine_threads=not args.one_thread)
        rep.add(mixer=name, path="ssmcraft", backend=lm.backends(), tokens_per_s=tps, peak_GiB=mem,
                params_M=sum(p.numel() for p in lm.parameters()) / 1e6)
        if args.no_anchors:
            continue
        try:
            torch.manual_seed(0)
            lm = build(name)
            swap(lm, anchor_recurrence(name, args.mamba), f"anchor:{name}")
            tps_a, mem_a = tokens_per_s(lm, engine_threads=not args.one_thread)
            rep.add(mixer=name, path="anchor kernel", backend=lm.backends(), tokens_per_s=tps_a, peak_GiB=mem_a,
                    ours_over_anchor=tps / tps_a)
        except Exception as e:  # noqa: BLE001
            rep.add(mixer=name, path="anchor kernel", error=one_line(e))
    rep.write(args.out)


if __name__ == "__main__":
    main()
