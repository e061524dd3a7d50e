"""Data-parallel training throughput: the 20M byte LM (specs/longhorn_20m_bytes.yaml) trained for a fixed
number of steps on 1 process and on N (``torchrun --nproc_per_node N -m ssmcraft train``), tokens/s of
each and the ratio.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_ddp.py --procs 2 --steps 200 --out DIR   # 2 GPUs, ~3 min
    python3 benchmarks/bench_ddp.py --tiny --out DIR                                      # CPU (gloo) smoke run

Each run is the real command with the spec's settings (CUDA graphs on, bf16 autocast) and
``--set train.tokens=...`` for ``--steps`` steps, no time limit, no checkpoints. ``--scaling weak``
(the default) gives every process the spec's batch (16 rows of 512 bytes): the global batch is
``16 * N``, the usual multi-GPU throughput figure; ``--scaling strong`` keeps the spec's global batch
(each of N processes takes 16 / N rows: the same optimisation as one GPU, less work per GPU). The
figure is ``steady_tokens_per_s`` from each run's metrics.json: global tokens over the training time
after the first step (the first step's graph capture and kernel JIT left out), with ``tokens_per_s``
(all steps) beside it. Prints a short table and writes ``DIR/bench_ddp.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "specs" / "longhorn_20m_bytes.yaml"
BATCH, SEQ = 16, 512            # the spec's train.batch_size and task.seq_len
TINY = ["train.device=cpu", "train.threads=1", "task.seq_len=64", "task.max_bytes=400000", "model.d_model=32",
        "model.n_layers=1", "train.eval_batches=1", "train.eval_batch_size=4"]


def run(procs: int, steps: int, batch: int, seq: int, extra: list[str], out: Path) -> dict:
    """One training run of ``steps`` steps at global batch ``batch`` over ``procs`` processes; its metrics."""
    sets = [f"train.batch_size={batch}", f"train.tokens={steps * batch * seq}", "train.max_seconds=null",
            "train.checkpoint_every=0", "train.eval_every=0", *extra]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs),
               "-m", "ssmcraft", "train", str(SPEC), "--out", str(out), "--quiet", "--fresh"]
    command += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{procs} process(es) failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads((out / "metrics.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="processes (GPUs) of the parallel run")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--scaling", choices=("weak", "strong"), default="weak",
                        help="weak: the spec's batch per process; strong: the spec's batch in all")
    parser.add_argument("--tiny", action="store_true", help="a small CPU model over gloo (a smoke run)")
    parser.add_argument("--out", default=None, help="folder for the runs and bench_ddp.json (default: a temp dir)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_ddp_"))
    out.mkdir(parents=True, exist_ok=True)
    batch, seq, extra = (4, 64, TINY) if args.tiny else (BATCH, SEQ, [])
    steps = min(args.steps, 10) if args.tiny else args.steps
    rep = Report("bench_ddp")
    rep.set("spec", str(SPEC.relative_to(REPO)) + (" (tiny, CPU)" if args.tiny else ""))
    rep.set("scaling", args.scaling)
    rates = {}
    for procs in (1, args.procs):
        global_batch = batch * procs if args.scaling == "weak" else batch
        m = run(procs, steps, global_batch, seq, extra, out / f"procs{procs}")
        rates[procs] = m["steady_tokens_per_s"]
        rep.add(processes=procs, global_batch=global_batch, steps=m["steps"], device=m["device"],
                steady_tokens_per_s=m["steady_tokens_per_s"], tokens_per_s=m["tokens_per_s"],
                first_step_s=m["first_step_s"], graphed_steps=m["cuda_graphs"]["graphed_steps"],
                train_loss_last=m["train_loss_last"], peak_memory_GiB=m["peak_memory_bytes"] / 2 ** 30)
    rep.set("ratio", rates[args.procs] / rates[1])
    rep.set("target", f">= {0.9 * args.procs:.2g}x (90% of linear)")
    rep.write(str(out / "bench_ddp.json"))


if __name__ == "__main__":
    main()
