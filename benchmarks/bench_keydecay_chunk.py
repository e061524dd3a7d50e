"""GPU checks and timings of the key-decay chunked family (GLA, RetNet, HGRN).

Run on a CUDA machine (FLA 0.6.0 wheels on PYTHONPATH for the anchor):

    PYTHONUNBUFFERED=1 python benchmarks/bench_keydecay_chunk.py --out $OUT [--no-fla] [--smoke]

1. Correctness, fp32 and bf16, outputs and every kernel buffer NaN-poisoned first: output, final
   state and every gradient (inputs, params, initial state; with a final-state gradient) against
   the float64 reference loop (``obj.reference``), gla at B=8 T=2048 H=16 K=V=64, T=1 and T=4097;
   retnet and hgrn at B=2 T=300.
2. Timings, bf16, B=8 T=2048 H=16 K=V=64 (triton.testing.do_bench medians), one process: ours
   (kernel function ``chunk_key_decay``), ours through ``ssmcraft.compile("gla")(...)`` (layout +
   generated coefficients + kernel, the backend it reports), FLA ``chunk_gla``, the diagonal
   family on gla (``diagonal.diagonal_scan``), the HBM floor (bytes / measured copy bandwidth);
   then a per-kernel GPU-time profile (torch.profiler) of ours and FLA.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv        # CPU dry run under the interpreter, tiny sizes
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import ssmcraft  # noqa: E402
from checks import TOL_CHUNKED as TOL, compare, dtype_name, reference  # noqa: E402
from common import Report, bench_ms, copy_bandwidth, floor_bytes, random_inputs  # noqa: E402
from ssmcraft.runtime.checking import rel_rms as rel  # noqa: E402
from ssmcraft.ops.keydecay_chunk import chunk as KD  # noqa: E402
from ssmcraft.runtime.select import validated_call  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def bench(fn):
    """do_bench median on the GPU; one timed call under --smoke (the interpreter)."""
    if SMOKE:
        t0 = time.time()
        fn()
        return (time.time() - t0) * 1e3
    return bench_ms(fn, warmup=25, rep=200)


def copy_bw():
    if SMOKE:
        x = torch.empty(1 << 12, dtype=torch.float32, device=DEV).normal_()
        y = torch.empty_like(x)
        return 2 * x.numel() * 4 / (bench(lambda: y.copy_(x)) * 1e-3)
    return copy_bandwidth(DEV, 1 << 30)


# ------------------------------------------------------------------------------------------
# correctness
# ------------------------------------------------------------------------------------------

def check(rep, name, B, T, H, d, m, seed=0):
    obj = ssmcraft.compile(name)
    ins, params = random_inputs(obj, B, T, H, d, m, torch.float64, DEV, seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    S0 = (0.5 * torch.randn(B, H, d, m, generator=g, dtype=torch.float64)).to(DEV)
    t0 = time.time()
    ref = reference(obj, ins, params, S0, g)          # once, for both dtypes
    t_ref = time.time() - t0
    ok_all = True
    for dtype in (torch.float32, torch.bfloat16):
        KD.POISON = True
        try:
            cmp = compare(ref, lambda i, p, s: validated_call(KD.prepare, obj, i, p, s, True), dtype)
        finally:
            KD.POISON = False
        ok = cmp.within(TOL[dtype])
        ok_all &= ok
        rep.add(section="check", spec=name, B=B, T=T, H=H, d=d, m=m, dtype=dtype_name(dtype), ok=ok,
                all_written=cmp.written, worst=cmp.worst[1], ref_s=round(t_ref, 1), **cmp.errors)
    del ref
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return ok_all


# ------------------------------------------------------------------------------------------
# timings
# ------------------------------------------------------------------------------------------

def timings(rep, bw, fla, B, T, H, K, V, do_diag=True):
    obj = ssmcraft.compile("gla")
    ins, _ = random_inputs(obj, B, T, H, V, K, torch.bfloat16, DEV, seed=0)
    x, k, q, alpha = ins["x"], ins["k"], ins["q"], ins["alpha"]
    gl = torch.log(alpha.float())                       # our kernel's g: fp32
    do = torch.randn(B, T, H, V, device=DEV, dtype=torch.bfloat16)
    res = {}

    def put(key, f_ms, fb_ms, **extra):
        res[key] = (f_ms, fb_ms)
        rep.add(section="time", what=key, fwd_ms=f_ms, fwd_bwd_ms=fb_ms, **extra)

    def fwd_bwd(f, leaves):
        def run():
            o = f(*leaves)
            torch.autograd.grad(o, leaves, do)
        return run

    # ours, kernel function
    leaves = [t.clone().requires_grad_() for t in (q, k, x, gl)]
    ours = lambda q_, k_, v_, g_: KD.chunk_key_decay(q_, k_, v_, g_)[0]  # noqa: E731
    t0 = time.time()
    with torch.no_grad():
        ours(q, k, x, gl)
    fwd_bwd(ours, leaves)()
    sync()
    rep.set("ours_first_call_s (compile + autotune)", time.time() - t0)
    with torch.no_grad():
        tf = bench(lambda: ours(q, k, x, gl))
    put("ours chunk_key_decay (g fp32)", tf, bench(fwd_bwd(ours, leaves)))

    # ours through the objective interface
    obj.prefer = "interpret" if SMOKE else "auto"
    oleaves = [t.clone().requires_grad_() for t in (x, k, q, alpha)]

    def via_obj(x_, k_, q_, a_):
        return obj({"x": x_, "k": k_, "q": q_, "alpha": a_}, None, None, False)[0]
    with torch.no_grad():
        via_obj(x, k, q, alpha)
    rep.set("objective backend", obj.backend)
    with torch.no_grad():
        tf = bench(lambda: via_obj(x, k, q, alpha))
    put("ours via ssmcraft.compile('gla')(...)", tf, bench(fwd_bwd(via_obj, oleaves)), backend=obj.backend)

    # HBM floor: q, k, x, alpha (bf16) read, o written [+ do read, 4 gradients written]
    fl = {k_: v for k_, v in ins.items()}
    put("HBM floor", floor_bytes(fl, {}, B * T * H * V, 2, False) / bw * 1e3,
        floor_bytes(fl, {}, B * T * H * V, 2, True) / bw * 1e3)

    if fla is not None:
        gb = gl.bfloat16()
        fleaves = [t.clone().requires_grad_() for t in (q, k, x, gb)]
        theirs = lambda q_, k_, v_, g_: fla(q_, k_, v_, g_, scale=1.0)[0]  # noqa: E731
        t0 = time.time()
        try:
            fwd_bwd(theirs, fleaves)()
            sync()
            rep.set("fla_first_call_s (autotune)", time.time() - t0)
            with torch.no_grad():
                tf = bench(lambda: theirs(q, k, x, gb))
            put("FLA chunk_gla (g bf16)", tf, bench(fwd_bwd(theirs, fleaves)))
            with torch.no_grad():
                rep.set("crosscheck ours vs FLA output (rel RMS, bf16)", rel(ours(q, k, x, gl), theirs(q, k, x, gb)))
        except Exception as e:  # noqa: BLE001
            rep.add(section="time", what="FLA chunk_gla", error=str(e)[:300])

    if do_diag:
        from ssmcraft.ops.diagonal import chunk as D
        dleaves = [t.clone().requires_grad_() for t in (x, k, q, alpha)]

        def diag(x_, k_, q_, a_):
            return D.diagonal_scan(obj, {"x": x_, "k": k_, "q": q_, "alpha": a_}, None, False)[0]
        t0 = time.time()
        fwd_bwd(diag, dleaves)()
        sync()
        rep.set("diagonal_first_call_s (autotune)", time.time() - t0)
        with torch.no_grad():
            tf = bench(lambda: diag(x, k, q, alpha))
        put("diagonal family on gla (diagonal_scan)", tf, bench(fwd_bwd(diag, dleaves)))

    a = res["ours chunk_key_decay (g fp32)"]
    if "FLA chunk_gla (g bf16)" in res:
        b = res["FLA chunk_gla (g bf16)"]
        rep.set("ours / FLA", f"fwd {a[0] / b[0]:.2f}x  fwd+bwd {a[1] / b[1]:.2f}x")
    f = res["HBM floor"]
    rep.set("ours / HBM floor", f"fwd {a[0] / f[0]:.1f}x  fwd+bwd {a[1] / f[1]:.1f}x")
    print(f"\n## timings: B={B} T={T} H={H} K={K} V={V} bf16 I/O, {rep.data['device']}")
    print(f"{'what':48s} {'fwd ms':>9s} {'fwd+bwd ms':>11s}")
    for key, (f_, b_) in res.items():
        print(f"{key:48s} {f_:9.3f} {b_:11.3f}")
    return (q, k, x, gl, do)


def stress(rep, name, B, T, H, d, m, n):
    """n forward+backward calls in bf16 at one shape, back to back (the way the autotuner's timing
    and a training loop launch the kernels), then one synchronisation: an intermittent fault shows
    up here as an error."""
    obj = ssmcraft.compile(name)
    ins, params = random_inputs(obj, B, T, H, d, m, torch.bfloat16, DEV, seed=1)
    li = {k: v.detach().requires_grad_() for k, v in ins.items()}
    lp = {k: v.float().detach().requires_grad_() for k, v in params.items()}
    t0 = time.time()
    for _ in range(n):
        y, S = validated_call(KD.prepare, obj, li, lp, None, True)
        torch.autograd.grad(y.float().sum() + S.sum(), [*li.values(), *lp.values()])
    sync()
    ok = bool(torch.isfinite(y.float()).all())
    rep.add(section="stress", spec=name, B=B, T=T, H=H, d=d, m=m, dtype="bfloat16", calls=n, ok=ok,
            seconds=round(time.time() - t0, 2))
    print(f"stress {name} B{B} T{T} H{H} d{d} m{m} bf16: {n} fwd+bwd calls {'ok' if ok else 'NON-FINITE'}")
    return ok


def profile(rep, fla, tensors):
    from torch.profiler import ProfilerActivity, profile as prof
    q, k, x, gl, do = tensors
    cands = [("ours", lambda *a: KD.chunk_key_decay(*a)[0], gl)]
    if fla is not None:
        cands.append(("FLA", lambda *a: fla(*a, scale=1.0)[0], gl.bfloat16()))
    for label, f, g in cands:
        leaves = [t.clone().requires_grad_() for t in (q, k, x, g)]
        for _ in range(3):
            torch.autograd.grad(f(*leaves), leaves, do)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                torch.autograd.grad(f(*leaves), leaves, do)
            torch.cuda.synchronize()
        for ev in p.key_averages():
            us = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0.0))
            if us > 0:
                rep.add(section="profile", who=label, kernel=ev.key[:70], calls=ev.count // 5, us_per_fwd_bwd=us / 5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-diag", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--stress", type=int, default=0,
                    help="with --training-shapes: that many bf16 fwd+bwd calls back to back at each training shape")
    ap.add_argument("--training-shapes", action="store_true",
                    help="also check the shapes a training run feeds the kernel (H=1, small K, long and odd T)")
    args = ap.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "keydecay.json") if args.out else None
    rep = Report("bench_keydecay_chunk")
    fla = None
    if not (args.no_fla or SMOKE):
        try:
            from fla.ops.gla import chunk_gla as fla
        except Exception as e:  # noqa: BLE001
            rep.set("FLA unavailable", str(e)[:200])
    ok = True
    shape = (1, 40, 2, 16, 16) if SMOKE else (8, 2048, 16, 64, 64)
    bw = copy_bw()
    rep.set("copy_bandwidth_GBps", bw / 1e9)
    try:
        if not args.no_timing:
            tensors = timings(rep, bw, fla, *shape, do_diag=not args.no_diag)
            rep.write(out)
            if not SMOKE:
                profile(rep, fla, tensors)
    except Exception:
        ok = False
        traceback.print_exc()
    rep.write(out)
    if not args.no_check:
        B, T, H, K, V = shape
        cases = [("gla", B, T, H, V, K), ("gla", B, 1, H, V, K), ("gla", B, 2 * T + 1, H, V, K),
                 ("retnet", 2, 300 if not SMOKE else 21, 4, V, K), ("hgrn", 2, 300 if not SMOKE else 21, 4, V, K)]
        if args.training_shapes:     # (spec, B, T, H, d, m) as the mixer calls it: one head, d = d_inner
            cases += [("gla", 4, 256, 1, 256, 16), ("gla", 8, 64, 1, 128, 8), ("gla", 2, 4096, 1, 512, 16),
                      ("gla", 3, 333, 2, 96, 4), ("retnet", 4, 256, 1, 256, 16), ("hgrn", 4, 256, 1, 256, 16)]
        for case in cases:
            try:
                ok &= check(rep, *case)
            except Exception:
                ok = False
                traceback.print_exc()
            rep.write(out)
        if args.training_shapes and args.stress:
            for case in cases[5:]:
                try:
                    ok &= stress(rep, *case, n=args.stress)
                except Exception:
                    ok = False
                    traceback.print_exc()
                rep.write(out)
        print("\n## correctness vs float64 reference (relative RMS; tol fp32 1e-4, bf16 3e-2)")
        for r in rep.data["rows"]:
            if r.get("section") == "check":
                errs = {k: v for k, v in r.items() if k in ("y", "S_T") or (k.startswith("d") and k != "dtype" and k != "d")}
                print(f"{'PASS' if r['ok'] else 'FAIL'} {r['spec']:7s} {r['dtype']:8s} B{r['B']} T{r['T']:<5d} worst={r['worst']:.1e}  "
                      + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
    rep.set("all_checks_ok", ok)
    rep.write(out)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
