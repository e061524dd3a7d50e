"""On a CUDA device: an exported module's CUDA path equals its CPU path.

For each objective, a small LM (random init, seeded) is exported with
``ssmcraft.export.exporter.export_model`` (which itself checks the written module against
ssmcraft's model on the CPU), then the *exported module* is imported and run:

- ``cpu``      fp32 on the CPU (the vectorised PyTorch path): the reference;
- ``cuda32``   fp32 on CUDA, default backend (the inline Triton kernels when the export
               carries them, else the vectorised PyTorch path on the GPU): max |diff| must be
               within fp32 tolerance (TF32 off);
- ``cuda_torch`` fp32 on CUDA with ``SSM_BACKEND=torch`` (no kernels), same tolerance;
- ``bf16``     bf16 autocast on CUDA (what training uses): within bf16 tolerance
               (relative L2 error of the logits and top-1 agreement);
- ``bf16w``    bf16 weights on CUDA (``from_pretrained(dtype=torch.bfloat16)``), same;
- ``step``     recurrent decoding on CUDA (fp32) equals the parallel forward on CUDA;
- ``grad``     parameter gradients on CUDA (the kernels' backward) equal the CPU's (fp32);
- ``vs_ssmcraft`` the exported CUDA path equals ssmcraft's own model on CUDA (same backend
               expected: the exported module carries the kernel family ssmcraft runs);
- ``own_bf16`` ssmcraft's own model under bf16 autocast, same tolerance: when ``bf16`` fails
               and this fails too, the problem is in ssmcraft's kernel, not in the export.

Also times the fp32 CUDA forward with each backend (median of a few runs). Prints one
line per check and exits 1 if any fails::

    python benchmarks/export_gpu_check.py                     # longhorn, deltanet, mamba, gla
    python benchmarks/export_gpu_check.py --objectives longhorn --B 8 --T 2048 --d-model 256
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FP32_TOL = 2e-4            # max |diff| / max(1, max |ref|), fp32 CUDA vs fp32 CPU
BF16_REL_TOL = 3e-2        # ||diff||_2 / ||ref||_2 with bf16 compute
BF16_TOP1_MIN = 0.95       # share of positions whose argmax agrees with fp32 CPU
STEP_TOL = 2e-4


def build_export(name: str, args, folder: Path):
    import ssmcraft
    from ssmcraft.export.exporter import TrialSource, export_model
    from ssmcraft.layers import LM, LMConfig

    obj = ssmcraft.compile(name)
    torch.manual_seed(args.seed)
    heads = args.heads if args.heads else (4 if obj.ir.is_per_head_step() else 1)
    cfg = LMConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, mlp_ratio=2,
                   mixer={"kind": "objective", "objective": dict(obj.spec.raw), "heads": heads,
                          "state_size": args.m})
    model = LM(cfg, obj).eval()
    src = TrialSource("train", Path(f"<random init, seed {args.seed}>"), folder)
    result = export_model(model, folder, src, check=True, log_fn=lambda _m: None)
    return result, model


def import_module(path: Path):
    name = f"exported_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    ref, got = ref.float().cpu(), got.float().cpu()
    diff = (got - ref)
    return {"max_abs": float(diff.abs().max()), "scale": float(ref.abs().max()),
            "rel_l2": float(diff.norm() / ref.norm().clamp_min(1e-30)),
            "top1": float((got.argmax(-1) == ref.argmax(-1)).float().mean())}


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


@torch.no_grad()
def check_one(name: str, args, root: Path, rows: list) -> list[dict]:
    """Appends this objective's rows to ``rows`` as they come (so a crash keeps the earlier
    ones); returns []."""
    result, own = build_export(name, args, root / name)
    mod = import_module(result.module)
    ids = torch.randint(0, args.vocab, (args.B, args.T), generator=torch.Generator().manual_seed(1))

    def row(check, metrics, ok, extra=""):
        rows.append({"objective": name, "structure": result.structure, "check": check, "ok": bool(ok),
                     **metrics, "note": extra})

    cpu = mod.from_pretrained(str(result.out))
    ref = cpu(ids)
    gpu = mod.from_pretrained(str(result.out), device="cuda")
    ids_c = ids.cuda()
    mod.OBJECTIVE.prefer = "auto"
    out = gpu(ids_c)
    backend = gpu.backend
    m = compare(ref, out)
    row("cuda32", m, m["max_abs"] <= FP32_TOL * max(1.0, m["scale"]), f"backend {backend}; kernels {result.kernels}")
    t_auto = timed(lambda: gpu(ids_c))
    mod.OBJECTIVE.prefer = "torch"
    out_t = gpu(ids_c)
    m = compare(ref, out_t)
    t_torch = timed(lambda: gpu(ids_c))
    row("cuda_torch", m, m["max_abs"] <= FP32_TOL * max(1.0, m["scale"]), f"backend {gpu.backend}")
    mod.OBJECTIVE.prefer = "auto"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_b = gpu(ids_c)
    m = compare(ref, out_b)
    row("bf16", m, m["rel_l2"] <= BF16_REL_TOL and m["top1"] >= BF16_TOP1_MIN, f"autocast; backend {gpu.backend}")
    own = own.cuda()                       # ssmcraft's own model and dispatch on the same GPU
    out_own = own(ids_c)
    m = compare(out_own, out)
    row("vs_ssmcraft", m, m["max_abs"] <= FP32_TOL * max(1.0, m["scale"]),
        f"ssmcraft {sorted(own.backends())} vs exported {backend}")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_own_b = own(ids_c)
    m = compare(ref, out_own_b)
    row("own_bf16", m, m["rel_l2"] <= BF16_REL_TOL and m["top1"] >= BF16_TOP1_MIN,
        f"ssmcraft's own model, autocast ({sorted(own.backends())}): tells an export bug from a kernel one")
    gpu_bf = mod.from_pretrained(str(result.out), device="cuda", dtype=torch.bfloat16)
    try:
        out_w = gpu_bf(ids_c)
        m = compare(ref, out_w)
        row("bf16w", m, m["rel_l2"] <= BF16_REL_TOL and m["top1"] >= BF16_TOP1_MIN, f"bf16 weights; backend {gpu_bf.backend}")
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        row("bf16w", {}, False, f"{type(e).__name__}: {str(e)[:200]}")
    T_step = min(args.T, args.step_T)
    state = gpu.init_state(args.B)
    steps = []
    for t in range(T_step):
        lt, state = gpu.step(ids_c[:, t], state)
        steps.append(lt)
    m = compare(out[:, :T_step], torch.stack(steps, 1))
    row("step", m, m["max_abs"] <= STEP_TOL * max(1.0, m["scale"]), f"{T_step} steps; backend {gpu.backend}")
    # gradients (fine-tuning the exported model): the kernels' backward vs autograd on the CPU
    Tg = min(args.T, 128)
    grads = []
    for model, dev in ((cpu, "cpu"), (gpu, "cuda")):
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = torch.nn.functional.cross_entropy(model(ids[:, :Tg].to(dev)).flatten(0, 1).float(),
                                                     ids[:, :Tg].roll(-1, 1).flatten().to(dev))
            loss.backward()
        grads.append(torch.cat([p.grad.flatten().float().cpu() for p in model.parameters() if p.grad is not None]))
    diff = grads[1] - grads[0]
    rel = float(diff.norm() / grads[0].norm().clamp_min(1e-30))
    row("grad", {"max_abs": float(diff.abs().max()), "scale": float(grads[0].abs().max()), "rel_l2": rel, "top1": 1.0},
        rel <= 1e-4, f"all parameter gradients, T={Tg}; backend {gpu.backend}")
    rows.append({"objective": name, "structure": result.structure, "check": "time", "ok": True,
                 "note": f"fp32 forward B={args.B} T={args.T}: {backend} {t_auto:.2f} ms, "
                         f"torch-vectorised {t_torch:.2f} ms"})
    return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objectives", default="longhorn,deltanet,mamba,gla")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=512)
    p.add_argument("--step-T", type=int, default=64, help="tokens decoded step by step")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--m", type=int, default=16, help="state size")
    p.add_argument("--heads", type=int, default=0, help="0: 4 for per-head-step objectives, else 1")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--in-process", action="store_true", help="check every objective in this process")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args, _ = p.parse_known_args(argv)
    if not torch.cuda.is_available():
        print("export_gpu_check: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if not args.quiet:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    names = [n.strip() for n in args.objectives.split(",") if n.strip()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if len(names) > 1 and not args.in_process:
            # one process per objective: a CUDA fault (illegal address) poisons its process only
            for name in names:
                part = Path(tmp) / f"{name}.json"
                cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                       "--objectives", name, "--json", str(part), "--quiet"]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if part.exists():
                    rows += json.loads(part.read_text())
                if proc.returncode not in (0, 1) or not part.exists():
                    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
                    rows.append({"objective": name, "check": "process", "ok": False,
                                 "note": f"exit {proc.returncode}: {tail[:400]}"})
        else:
            for name in names:
                try:
                    rows += check_one(name, args, Path(tmp), rows)
                except Exception as e:  # noqa: BLE001 - one objective's failure is a row, not the end
                    rows.append({"objective": name, "check": "error", "ok": False,
                                 "note": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str))
    if args.quiet:
        return 1 if any(not r["ok"] for r in rows) else 0
    for r in rows:
        figures = "" if "max_abs" not in r else (f"max|d| {r['max_abs']:.2e} (|ref| {r['scale']:.2f})  "
                                                  f"rel {r['rel_l2']:.2e}  top1 {r['top1']:.3f}  ")
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['objective']:<12} {r['check']:<10} {figures}{r.get('note', '')}")
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} ok, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
