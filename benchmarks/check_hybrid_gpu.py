"""Hybrid stacks and the new tasks on the GPU: every registered task builds its batches on the CUDA
generator's device; a hybrid (objective, sliding-window and full attention layers) trains with
``train.cuda_graphs: true`` on a Zoology variant and a MAD task; its step-by-step decode equals its
forward; graphed decoding holds objective and sliding-window layers; its export reproduces it.

GPU:  python3 benchmarks/check_hybrid_gpu.py --out /tmp/hybrid_check
CPU:  python3 benchmarks/check_hybrid_gpu.py --tiny --out /tmp/hybrid_check   (no CUDA graphs)

Prints one line per check; exits 1 if one fails.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ssmcraft.tasks import TASKS, build_task
from ssmcraft.train import load_run, train_run

HYBRID = {"d_model": 64, "n_layers": 4, "mlp_ratio": 2,
          "mixer": {"kind": "objective", "objective": "gated_deltanet", "heads": 2, "state_size": 32, "expand": 1},
          "layers": [{"at": [1], "mixer": {"kind": "attention", "heads": 2, "window": 32}},
                     {"at": [3], "mixer": {"kind": "attention", "heads": 2}}]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU, small budgets")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    out, ok = Path(args.out), True

    def check(name: str, passed: bool, detail: str) -> None:
        nonlocal ok
        ok &= bool(passed)
        print(f"{'ok  ' if passed else 'FAIL'} {name}: {detail}", flush=True)

    g = torch.Generator(device=device).manual_seed(0)
    for name in sorted(TASKS):
        if name == "text":
            continue
        task = build_task({"name": name, "num_train_examples": None} if "num_train_examples" in TASKS[name].options
                          else {"name": name})
        x, y = task.sample("train", 4, generator=g)
        check(f"task {name}", x.device.type == device and y.device.type == device,
              f"batch {list(x.shape)} built on {x.device}")

    tokens = 64 * 128 * 2 if args.tiny else 2_000_000
    for task in ({"name": "mqar_forgetting", "vocab": 256, "seq_len": 128, "num_kv_pairs": 8, "num_updates": 4},
                 {"name": "in_context_recall", "vocab": 16, "seq_len": 128,
                  "num_train_examples": 256 if args.tiny else 12_800}):
        run = out / task["name"]
        train = {"batch_size": 64, "tokens": tokens, "lr": 3e-3, "eval_every": 0, "device": device, "eval_batches": 2,
                 "cuda_graphs": "auto" if args.tiny else True}
        m = train_run({"name": f"hybrid-{task['name']}", "seed": 0, "task": task, "model": HYBRID, "train": train}, run)
        graphs = m.get("cuda_graphs", {})
        check(f"train hybrid on {task['name']}", m["status"] == "ok" and (args.tiny or graphs.get("graphed_steps", 0) > 0),
              f"status {m['status']}, layout {m['layout']}, val_loss {m['val_loss']:.3f}, accuracy "
              f"{m.get('accuracy', float('nan')):.3f}, {m['tokens_per_s']:.0f} tokens/s, graphed steps "
              f"{graphs.get('graphed_steps')}, eager {graphs.get('eager_steps')}, device {m['device']}")

    model = load_run(out / "mqar_forgetting", device).float().eval()
    ids = torch.randint(0, 256, (2, 80), device=device)
    with torch.no_grad():
        full = model(ids)
        caches, steps = model.init_cache(2), []
        for t in range(ids.shape[1]):
            logits, caches = model.step(ids[:, t], caches)
            steps.append(logits)
    diff = float((torch.stack(steps, 1) - full).abs().max() / full.abs().max())
    check("decode equals forward", diff < 1e-4, f"max |step - forward| / max |forward| = {diff:.2e} over 80 tokens "
          f"(window 32: the sliding-window cache holds {caches[1].k.shape[2]} tokens)")

    if not args.tiny:
        from ssmcraft.layers import LM, LMConfig
        from ssmcraft.layers.graphed_decode import GraphedDecoder

        swa_only = {**HYBRID, "layers": HYBRID["layers"][:1]}
        lm = LM(LMConfig(vocab_size=256, **swa_only)).to(device).eval()
        dec = GraphedDecoder(lm, 2)
        with torch.no_grad():
            caches, worst = lm.init_cache(2), 0.0
            for t in range(ids.shape[1]):
                eager, caches = lm.step(ids[:, t], caches)
                worst = max(worst, float((dec.step(ids[:, t]) - eager).abs().max()))
        check("graphed decoding of objective + sliding-window layers", worst < 1e-4,
              f"max |graphed - eager| over 80 tokens: {worst:.2e}")

    from ssmcraft.export import export

    result = export(out / "mqar_forgetting", out / "export", overwrite=True)
    check("export reproduces the hybrid", result.verified["max_abs_diff"] <= 1e-4,
          f"max |diff| {result.verified['max_abs_diff']:.2e}, step {result.verified['step_max_abs_diff']:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
