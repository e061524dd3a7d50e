"""GPU checks and timings of the chunked rank-r family (two-key compositions with a per-head step).

Run on a CUDA machine (FLA wheels installed for the gated DeltaProduct anchor):

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_rankr_chunk.py [--no-check] [--no-time] [--row]
        [--shape 8,2048,16,64,64] [--smallk]

``--smoke``: the correctness part on the CPU under the Triton interpreter at tiny sizes (a dry run of
this script; the families in their CUDA order).

1. Correctness, fp32 and bf16, at a small shape: ``chunk_rankr`` against its float64 loop
   (``naive_recurrent_rankr``; R = 2 and 4, a decay, separate read keys, an initial state and a
   final-state gradient, odd lengths), and the composed objectives through ``obj()`` (CUDA
   dispatch: the backend must be ``rankr-chunk``) against ``obj.reference``: output, final state,
   every gradient.
2. Timings through ``obj()``, bf16, at ``--shape`` (``timing.obj_calls`` + ``timing.time_calls``, as
   ``bench_classes.py``), in one process: DeltaNet (the ratio's reference), Gated DeltaNet, the
   composed rank-2 layers, FLA's ``chunk_gated_delta_product`` (two Householder factors, the same
   shape) where FLA is installed, gated and ungated (``g=None``: DeltaProduct; on Triton 3.4-3.7.0
   on Hopper FLA refuses the gated backward, not the ungated one); ``--row`` adds the composed layers on ``rankr_row`` (what ran them
   before this family).
3. ``--smallk``: DeltaNet bf16 with an initial state at K = V = 32 on ``rank1_chunk``, in a child
   process (an illegal memory access ends the CUDA context), and what it printed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

SMOKE = "--smoke" in sys.argv        # CPU dry run under the interpreter, tiny sizes
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ssmcraft  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402
from ssmcraft.ops import registry  # noqa: E402
from ssmcraft.ops.rankr_chunk import chunk as RC  # noqa: E402
from ssmcraft.ops.rankr_chunk.naive import naive_recurrent_rankr  # noqa: E402
from ssmcraft.runtime import select, timing  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from ssmcraft.runtime.checking import rel_rms as rel  # noqa: E402
from common import bound_fla_autotune  # noqa: E402
from checks import TOL_CHUNKED, dtype_name, reference_errors, summary  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
TOL = {**TOL_CHUNKED, torch.float16: TOL_CHUNKED[torch.bfloat16]}
SMALL = dict(H=2, d=16, m=16) if SMOKE else dict(H=4, d=64, m=64)
TWO = {"data": "regression", "keys": 2, "step": "scalar", "normalize": True}
COMPOSED = {
    "explicit": dict(TWO, proximity="plain", update="explicit"),
    "decay_explicit": dict(TWO, proximity="scalar_decay", update="decay_explicit"),
    "implicit": dict(TWO, proximity="plain", update="implicit"),
    "implicit_decay": dict(TWO, proximity="scalar_decay", update="implicit"),
}


def check_kernel(R, T, dtype, decay, sep_u, chunk=64, B=2, seed=0) -> bool:
    H, K, V = SMALL["H"], SMALL["m"], SMALL["d"]
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV, dtype=torch.float64)  # noqa: E731
    nk = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    rand = lambda *s: torch.rand(*s, generator=g, device=DEV, dtype=torch.float64)  # noqa: E731
    ins = {"v": nk(r(B, T, H, R, K)), "u": nk(r(B, T, H, R, K)) if sep_u else None, "p": r(B, T, H, R, V),
           "oq": nk(r(B, T, H, K)), "c": rand(B, T, H, R) / R, "a": 0.9 + 0.1 * rand(B, T, H) if decay else None,
           "h0": r(B, H, K, V) * 0.5, "ps": None}
    names = [n for n, t in ins.items() if t is not None]
    ref_in = {n: (t.clone().requires_grad_() if t is not None else None) for n, t in ins.items()}
    o_ref, h_ref = naive_recurrent_rankr(*ref_in.values())
    do, dh = r(*o_ref.shape), r(*h_ref.shape)
    ref_g = torch.autograd.grad((o_ref * do).sum() + (h_ref * dh).sum(), [ref_in[n] for n in names])
    x = {n: (t.to(torch.float32 if n in ("h0", "c", "a") else dtype).requires_grad_() if t is not None else None)
         for n, t in ins.items()}
    o, ht = RC.chunk_rankr(x["v"], x["p"], x["c"], x["oq"], u=x["u"], a=x["a"], initial_state=x["h0"],
                           output_final_state=True, chunk_size=chunk)
    got = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dh).sum(), [x[n] for n in names])
    errs = {"y": rel(o, o_ref), "S_T": rel(ht, h_ref), **{f"d{n}": rel(a_, b_) for n, a_, b_ in zip(names, got, ref_g)}}
    worst = max(errs, key=lambda k: errs[k] if errs[k] == errs[k] else float("inf"))
    ok = all(e <= TOL[dtype] for e in errs.values())
    print(f"  kernel R={R} T={T} {dtype_name(dtype)} decay={decay} sep_u={sep_u}: worst {errs[worst]:.2e} ({worst}) "
          f"{'ok' if ok else 'FAIL ' + str(errs)}")
    return ok


def check_objective(which, T, dtype, B=2, seed=1) -> bool:
    H, d, m = SMALL["H"], SMALL["d"], SMALL["m"]
    obj = ssmcraft.compile(compose_objective(COMPOSED[which]))
    ins, params = random_inputs(obj, B, T, H, d, m, torch.float64, torch.device(DEV), seed=seed)
    g = torch.Generator().manual_seed(seed)
    S0 = torch.randn(B, H, d, m, generator=g, dtype=torch.float64).to(DEV) * 0.3
    if SMOKE:
        obj.prefer = "interpret"
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0, g, dtype)
    ok = cmp.within(TOL[dtype]) and obj.backend.split("+")[0] in ("triton:rankr-chunk", "triton-interpret:rankr-chunk")
    print(f"  {which} T={T} {dtype_name(dtype)} [{obj.backend}]: {summary(cmp, TOL[dtype])}")
    return ok


def time_obj(spec, shape, dtype, label, exclude=(), warm=False, profile=False) -> dict:
    """fwd and fwd+bwd ms through ``obj()`` (families in ``exclude`` left out of the CUDA order);
    ``warm``: one call of each, untimed (compiles the kernels); ``profile``: also the GPU kernels of
    one fwd+bwd (``bench_classes.kernel_profile``)."""
    B, T, H, d, m = shape
    obj = ssmcraft.compile(spec)
    real = select.order
    select.order = (lambda ir, mode: [f for f in real(ir, mode) if f.name not in exclude])
    try:
        inputs, params = random_inputs(obj, B, T, H, d, m, dtype, torch.device("cuda"), requires_grad=True)
        y = obj(inputs, params, None, False)[0]
        calls = timing.obj_calls(obj, inputs, params, None, False, torch.randn_like(y))
        calls.pop("onethread", None)
        if warm:
            with torch.no_grad():
                calls["eager"]["fwd"]()
            calls["eager"]["fwd_bwd"]()
            torch.cuda.synchronize()
            return {"label": label, "backend": obj.backend}
        t = timing.time_calls(calls)
        row = {"label": label, "backend": obj.backend, "fwd": t["eager_fwd_ms"], "fwd_bwd": t["eager_fwd_bwd_ms"]}
        if profile:
            from ssmcraft.bench.classes_commands import kernel_profile
            row["kernels"] = kernel_profile(calls["eager"]["fwd_bwd"])
    finally:
        select.order = real
    return row


def time_kernels_alone(shape, dtype, R=2) -> dict:
    """``chunk_rankr`` on ready term tensors (no slots, no stacking), the delta-rule form with a decay:
    what the kernels cost without the host side."""
    B, T, H, d, m = shape
    dev = "cuda"
    v = torch.nn.functional.normalize(torch.randn(B, T, H, R, m, device=dev), dim=-1).to(dtype).requires_grad_()
    p = torch.randn(B, T, H, R, d, device=dev, dtype=dtype).requires_grad_()
    q = torch.nn.functional.normalize(torch.randn(B, T, H, m, device=dev), dim=-1).to(dtype).requires_grad_()
    beta = torch.rand(B, T, H, device=dev, dtype=dtype).requires_grad_()
    a = (0.9 + 0.1 * torch.rand(B, T, H, device=dev)).to(dtype).requires_grad_()
    run = (lambda: RC.chunk_rankr(v, p, beta, q, a=a, ps=beta)[0])
    with torch.no_grad():
        fwd = timing.bench_ms(run)
    dy = torch.randn(B, T, H, d, device=dev, dtype=dtype)
    return {"label": f"chunk_rankr alone (R={R}, decay, c = ps)", "backend": "kernels", "fwd": fwd,
            "fwd_bwd": timing.bench_ms(lambda: torch.autograd.grad(run(), [v, p, q, beta, a], dy))}


def time_fla_gdp(shape, dtype, keep: int = 0, gated: bool = True) -> dict:
    """FLA's chunk_gated_delta_product, two Householder factors, at the same shape, with a log-space
    gate or without one (``g=None``, FLA's DeltaProduct); its autotuners cut to ``keep`` configs first
    (``common.bound_fla_autotune``; 0: all)."""
    from fla.ops.gated_delta_product import chunk_gated_delta_product
    if keep:
        bound_fla_autotune(keep)
    B, T, H, d, m = shape
    n = 2
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(B, T, H, m, device=dev), dim=-1).to(dtype).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(B, T * n, H, m, device=dev), dim=-1).to(dtype).requires_grad_()
    v = torch.randn(B, T * n, H, d, device=dev, dtype=dtype).requires_grad_()
    beta = torch.rand(B, T * n, H, device=dev, dtype=dtype).sigmoid().requires_grad_()
    gl = torch.nn.functional.logsigmoid(torch.rand(B, T, H, device=dev, dtype=torch.float32) + 3).requires_grad_()
    leaves = [q, k, v, gl, beta] if gated else [q, k, v, beta]
    run = (lambda: chunk_gated_delta_product(q, k, v, gl if gated else None, beta, num_householder=n)[0])
    row = {"label": f"FLA chunk_gated_delta_product (2 factors{'' if gated else ', g=None'})",
           "backend": "fla 0.6.0", "gated": gated}
    with torch.no_grad():
        row["fwd"] = timing.bench_ms(run)
    dy = torch.randn(B, T, H, d, device=dev, dtype=dtype)
    try:
        row["fwd_bwd"] = timing.bench_ms(lambda: torch.autograd.grad(run(), leaves, dy))
    except Exception as e:  # noqa: BLE001: FLA's backward refusing this Triton is a result to report
        row["fwd_bwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
    return row


SMALLK = r"""
import torch, ssmcraft
from ssmcraft.ops.rank1_chunk import chunk as R
g = torch.Generator(device="cuda").manual_seed(0)
B, T, H, K = 2, 300, 4, 32
k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
x = torch.randn(B, T, H, K, device="cuda", generator=g).bfloat16().requires_grad_()
beta = torch.rand(B, T, H, device="cuda", generator=g).bfloat16().requires_grad_()
h0 = torch.randn(B, H, K, K, device="cuda", generator=g).requires_grad_()
print("key block", R._key_block(K, torch.bfloat16), flush=True)
o, ht = R.delta_rule(q, k, x, beta, initial_state=h0, output_final_state=True)
torch.cuda.synchronize(); print("forward ok", flush=True)
torch.autograd.grad((o.float().sum() + ht.sum()), [q, k, x, beta, h0])
torch.cuda.synchronize(); print("backward ok", flush=True)
obj = ssmcraft.compile("deltanet")
ins = {"x": x.detach(), "k": k.detach(), "q": q.detach(), "beta": beta.detach()}
S0 = h0.detach().transpose(-1, -2).contiguous().requires_grad_()
ins = {n: t.clone().requires_grad_() for n, t in ins.items()}
y, S = obj(ins, None, S0, True)
torch.autograd.grad(y.float().sum() + S.sum(), [*ins.values(), S0])
torch.cuda.synchronize(); print("obj() fwd+bwd ok, backend", obj.backend, flush=True)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,2048,16,64,64", help="B,T,H,d,m")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--row", action="store_true", help="also time the composed layers on rankr_row")
    ap.add_argument("--smallk", action="store_true", help="DeltaNet bf16 + initial state at K = V = 32 (child process)")
    ap.add_argument("--only", default="", help=f"comma-separated composed layers to time (of {', '.join(COMPOSED)}); "
                    "DeltaNet is always timed")
    ap.add_argument("--no-fla", action="store_true", help="leave FLA's gated DeltaProduct out")
    ap.add_argument("--fla-configs", type=int, default=0,
                    help="autotune configs kept per FLA kernel (0: all; its first call then takes minutes)")
    ap.add_argument("--warm", action="store_true", help="run each timed call once, untimed (compile only)")
    ap.add_argument("--profile", action="store_true", help="GPU kernels of one fwd+bwd of each composed layer")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run of the checks under the interpreter")
    args = ap.parse_args(argv)
    if SMOKE:      # the families in their CUDA order, as a GPU would try them
        select.order = (lambda ir, mode, real=registry.order: real(ir, "triton"))
    elif not torch.cuda.is_available():
        print("bench_rankr_chunk.py needs a CUDA device")
        return 2
    else:
        print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    ok = True
    if not args.no_check:
        print("-- correctness (relative RMS vs float64; tolerance fp32 1e-4, bf16 3e-2)", flush=True)
        cases = ((2, 1, True, False), (2, 37, True, True)) if SMOKE else \
            ((2, 1, True, False), (2, 257, True, True), (4, 129, False, True), (2, 1000, True, False))
        # the interpreter's products on bf16 tiles are wrong (ENV.md): fp16 stands in for bf16 there
        for dtype in (torch.float16 if SMOKE else torch.bfloat16, torch.float32):
            for R, T, decay, sep_u in cases:
                ok &= check_kernel(R, T, dtype, decay, sep_u)
            for which in COMPOSED:
                ok &= check_objective(which, 21 if SMOKE else 301, dtype)
        print("correctness:", "ok" if ok else "FAIL", flush=True)
    if not args.no_time and not SMOKE:
        shape = tuple(int(x) for x in args.shape.split(","))
        bf = torch.bfloat16
        only = [w for w in args.only.split(",") if w]
        unknown = [w for w in only if w not in COMPOSED]
        if unknown:
            print(f"bench_rankr_chunk.py: --only: unknown layer {unknown[0]!r}; layers: {', '.join(COMPOSED)}")
            return 2
        todo = [("deltanet", lambda: time_obj("deltanet", shape, bf, "deltanet", warm=args.warm))]
        if not only:
            todo.append(("gated_deltanet", lambda: time_obj("gated_deltanet", shape, bf, "gated_deltanet",
                                                            warm=args.warm)))
        for which, spec in COMPOSED.items():
            if only and which not in only:
                continue
            todo.append((which, lambda w=which, sp=spec: time_obj(compose_objective(sp), shape, bf, w, warm=args.warm,
                                                                 profile=args.profile)))
            if args.row:
                todo.append((which + " (rankr_row)", lambda w=which, sp=spec: time_obj(
                    compose_objective(sp), shape, bf, w + " (rankr_row)", exclude=("rankr_chunk",), warm=args.warm)))
        if not args.warm:
            todo.append(("kernels", lambda: time_kernels_alone(shape, bf)))
        if not args.no_fla:
            todo.append(("fla", lambda: time_fla_gdp(shape, bf, args.fla_configs)))
            todo.append(("fla ungated", lambda: time_fla_gdp(shape, bf, args.fla_configs, gated=False)))
        rows = []
        t0 = time.time()
        for label, fn in todo:       # each row printed as it comes: a run cut short keeps what it measured
            try:
                r = fn()
            except ImportError as e:
                print(f"{label}: FLA not installed ({e})", flush=True)
                continue
            rows.append(r)
            print(f"[{time.time() - t0:6.1f} s] {r['label']} [{r['backend']}]"
                  + ("" if args.warm else f": fwd {r['fwd']:.3f} ms, fwd+bwd "
                     + (f"{r['fwd_bwd']:.3f} ms" if "fwd_bwd" in r else r.get("fwd_bwd_error", "-"))), flush=True)
            for k, c, us in r.get("kernels", [])[:10]:
                print(f"   {us:9.1f} us  x{c:<3d} {k[:100]}", flush=True)
            torch.cuda.empty_cache()
        if args.warm:
            return 0 if ok else 1
        ref = next((r["fwd_bwd"] for r in rows if r["label"] == "deltanet"), None)
        fla = {r["gated"]: r for r in rows if r["backend"] == "fla 0.6.0"}
        print(f"\n{torch.cuda.get_device_name()}, shape B,T,H,d,m = {args.shape}, bf16, through obj(); "
              f"ratios: fwd and fwd+bwd / deltanet's fwd+bwd, / FLA's DeltaProduct of the same gating "
              f"(a layer with a decay against the gated one; same process)")
        print("| layer | backend | fwd ms | fwd+bwd ms | x deltanet | FLA fwd ratio | FLA fwd+bwd ratio |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            fb = r.get("fwd_bwd")
            fbs = f"{fb:.3f}" if fb is not None else r.get("fwd_bwd_error", "-")[:90]
            composed = r["label"].split(" ")[0] in COMPOSED
            anchor = fla.get("decay" in r["label"], {}) if composed else {}
            afb = anchor.get("fwd_bwd")
            print(f"| {r['label']} | {r['backend']} | {r['fwd']:.3f} | {fbs} | "
                  f"{fb / ref if fb and ref else float('nan'):.2f} | "
                  f"{r['fwd'] / anchor['fwd'] if anchor else float('nan'):.2f} | "
                  f"{fb / afb if fb and afb else float('nan'):.2f} |")
    if args.smallk:
        print("\n-- DeltaNet bf16, initial state, K = V = 32 (rank1_chunk), child process", flush=True)
        try:
            # CUDA_LAUNCH_BLOCKING: the fault is raised at the launch that makes it; the autotuner names
            # each kernel and config it benchmarks
            p = subprocess.run([sys.executable, "-c", SMALLK], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CUDA_LAUNCH_BLOCKING": "1",
                                    "TRITON_PRINT_AUTOTUNING": "1"})
            err = [ln for ln in p.stderr.splitlines() if "Warning" not in ln and "warn" not in ln]
            where = [ln for i, ln in enumerate(err) if "ssmcraft" in ln or (i and "ssmcraft" in err[i - 1])]
            print(f"exit {p.returncode}\n{p.stdout[-2500:]}\n" + "\n".join(where + ["..."] + err[-6:]))
        except subprocess.TimeoutExpired as e:
            print(f"no answer in {e.timeout} s (hung)\n{(e.stdout or b'')[-2000:]!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
