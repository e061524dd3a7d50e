"""GPU checks and timings of the per-row rank-1 family (Longhorn exact; also wd/gated Longhorn,
DeltaNet, Gated DeltaNet through the same kernels).

Run on a CUDA machine (FLA wheels installed for the anchor):

    PYTHONUNBUFFERED=1 python benchmarks/bench_rank1_row.py [--no-check] [--no-time] [--quick]

1. Correctness, fp32 and bf16 (``--check``): output, final state and every gradient (inputs and
   initial state, with a gradient on the final state) against the float64 reference loop
   (``obj.reference``, on the bf16-rounded inputs for bf16) for Longhorn exact at B=8, T=2048,
   H=1, K=16, V=1536, and at T=1 and T=4097; the other rank-1 objectives at a small shape.
2. Timings, bf16, B=8, T=2048 (``triton.testing.do_bench``, median), in one process: our kernel
   (config sweep; sequential and time-chunked forward), the full path (coefficients in PyTorch +
   kernel), our diagonal Longhorn (``ssmcraft.ops.diagonal.chunk``), FLA
   ``fused_recurrent_delta_rule`` with beta [B,T,H,V] at H=24, K=16, V=64 and ours on the same
   recurrence, the naive PyTorch loop, the HBM floor (bytes / measured copy bandwidth).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ssmcraft  # noqa: E402
from ssmcraft.ops.rank1_row import recurrent as R  # noqa: E402
from ssmcraft.ops.common.reference import layout  # noqa: E402
from checks import TOL, dtype_name, reference_errors, summary  # noqa: E402
from ssmcraft.runtime.checking import rel_rms as rel  # noqa: E402

DEV = "cuda"
LINES: list[str] = []


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LINES.append(s)


def make_inputs(obj, B, T, H, K, V, seed, dtype=torch.float64):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ins = {}
    for n, dims in obj.ir.inputs.items():
        decl = obj.spec.inputs[n]
        shape = (B, T, H) + tuple(V if x == obj.ir.dims[0] else K for x in dims)
        x = torch.randn(*shape, generator=g, device=DEV, dtype=torch.float64)
        if decl.bounded:
            x = torch.sigmoid(x + (2.0 if n == "alpha" else 0.0))
        elif decl.positive:
            x = torch.nn.functional.softplus(x)
        if decl.normalize:
            x = x / x.norm(dim=-1, keepdim=True)
        elif n == "k":
            x = x / K ** 0.5
        ins[n] = x.to(dtype)
    h0 = (torch.randn(B, H, V, K, generator=g, device=DEV, dtype=torch.float64) * 0.5).to(torch.float32)
    return ins, h0


def run_ours(obj, ins, h0, want_state=True):
    lay = layout(obj.ir, obj.spec, ins, None, h0)
    if obj.ir.kind in ("general", "nonlinear"):
        from ssmcraft.ops.general import recurrent as G
        y, S = G.forward(obj, lay, None, want_state)
        return y.to(lay.out_dtype), S
    co = obj.module.coefficients(lay.env, lay.d, lay.m)
    y, S = R.forward(obj, lay, co, want_state)
    return y.to(lay.out_dtype), S


def check(obj, B, T, H, K, V, dtype, seed=0):
    ins64, h0 = make_inputs(obj, B, T, H, K, V, seed)
    ins = {k: v.to(dtype).double() for k, v in ins64.items()}       # the reference on the rounded inputs
    cmp = reference_errors(obj, lambda i, p, s: run_ours(obj, i, s), ins, None, h0.double(),
                           torch.Generator().manual_seed(seed + 1), dtype)
    ok = cmp.within(TOL[dtype])
    say(f"check {obj.name:15s} {dtype_name(dtype):8s} B={B} T={T} H={H} K={K} V={V}: max rel err "
        f"{cmp.worst[1]:.2e} ({', '.join(f'{k} {v:.1e}' for k, v in cmp.errors.items())}) "
        f"{'ok' if ok else summary(cmp, TOL[dtype])}")
    return ok


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth():
    x = torch.empty(512 * 2 ** 20 // 4, device=DEV, dtype=torch.float32)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / (ms * 1e-3)


def longhorn_kernel_args(B, T, H, K, V, dtype, seed=0):
    """Kernel-level tensors of Longhorn exact: c, p per row (fp32, as the backend makes them)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(B, T, H, V, generator=g, device=DEV).to(dtype)
    k = (torch.randn(B, T, H, K, generator=g, device=DEV) / K ** 0.5).to(dtype)
    q = torch.randn(B, T, H, K, generator=g, device=DEV).to(dtype)
    beta = torch.sigmoid(torch.randn(B, T, H, V, generator=g, device=DEV)).to(dtype)
    return x, k, q, beta


def time_all(args):
    B, T, H, K, V = 8, 2048, 1, 16, 1536
    dt = torch.bfloat16
    bw = copy_bandwidth()
    say(f"copy bandwidth (read+write) {bw / 1e12:.2f} TB/s")
    x, k, q, beta = longhorn_kernel_args(B, T, H, K, V, dt)
    # kernel-level Longhorn exact: c = beta/(1+beta k.k), p = c x computed once (fp32, like the backend)
    kk = (k.float() ** 2).sum(-1, keepdim=True)
    c = (beta.float() / (1 + beta.float() * kk)).contiguous()
    p = (c * x.float()).contiguous()
    res = {}

    def fwd_fn():
        return R.rank1_row_recurrence(k, k, k, q, c, p)[0]

    cg, pg, kg, qg = [t.detach().clone().requires_grad_() for t in (c, p, k, q)]
    dy = torch.randn(B, T, H, V, device=DEV, dtype=dt)

    def fb_fn():
        y = R.rank1_row_recurrence(kg, kg, kg, qg, cg, pg)[0]
        return torch.autograd.grad(y, (cg, pg, kg, qg), dy)

    fwd_cfgs = [(8, 1, 16), (16, 1, 0), (16, 1, 16), (16, 1, 32), (32, 1, 16), (16, 2, 16), (32, 2, 16)]
    bwd_cfgs = [(8, 1, 16), (8, 1, 0), (16, 1, 16), (32, 1, 16), (32, 2, 16)]
    if args.quick:
        fwd_cfgs, bwd_cfgs = fwd_cfgs[1:3], bwd_cfgs[1:2]
    best_f = (1e9, None)
    for BV, nw, pf in fwd_cfgs:
        R.set_config(fwd=(BV, nw))
        R.PREFETCH = pf
        ms = bench(fwd_fn)
        say(f"  fwd  BV={BV:3d} warps={nw} prefetch={pf:2d}: {ms:.3f} ms")
        best_f = min(best_f, (ms, (BV, nw, pf)))
    R.set_config(fwd=best_f[1][:2])
    R.PREFETCH = best_f[1][2]
    res["fwd"] = best_f[0]
    # forward with the training side outputs (z, checkpoints), then the backward alone
    best_b = (1e9, None)
    for BV, nw, pf in bwd_cfgs:
        R.set_config(fwd=best_f[1][:2], bwd=(BV, nw))
        R.PREFETCH = pf
        ms = bench(fb_fn)
        say(f"  fwd+bwd  bwd BV={BV:3d} warps={nw} prefetch={pf:2d}: {ms:.3f} ms")
        best_b = min(best_b, (ms, (BV, nw, pf)))
    R.set_config(fwd=best_f[1][:2], bwd=best_b[1][:2])
    R.PREFETCH = best_b[1][2]
    res["fb"] = bench(fb_fn, rep=400)
    say(f"best: fwd {best_f[1]} {res['fwd']:.3f} ms; fwd+bwd (bwd {best_b[1]}) {res['fb']:.3f} ms")

    # time-parallel (chunked) forward
    R.PREFETCH = best_f[1][2]
    for seg in ((256,) if args.quick or args.no_naive else (128, 256, 512)):
        ms = bench(lambda: R.chunked_forward(k, k, k, q, c, p, segment=seg, config=best_f[1][:2]))
        say(f"  chunked fwd segment={seg}: {ms:.3f} ms (sequential {res['fwd']:.3f})")
        res[f"chunked{seg}"] = ms
    y1 = fwd_fn()
    y2 = R.chunked_forward(k, k, k, q, c, p, segment=256, config=best_f[1][:2])[0]
    say(f"  chunked vs sequential output rel diff {rel(y2.float(), y1.float()):.1e}")

    # full path: inputs -> coefficients (PyTorch) -> kernel, gradients to the inputs
    obj = ssmcraft.compile("longhorn")
    ins = {"x": x, "k": k, "q": q, "beta": beta}
    insg = {n: t.detach().clone().requires_grad_() for n, t in ins.items()}
    res["full_fwd"] = bench(lambda: run_ours(obj, ins, None, False)[0])
    res["full_fb"] = bench(lambda: torch.autograd.grad(run_ours(obj, insg, None, False)[0], list(insg.values()), dy))
    say(f"full path (coefficients in PyTorch + kernel): fwd {res['full_fwd']:.3f} ms, fwd+bwd {res['full_fb']:.3f} ms")

    # our diagonal Longhorn (helper KA's kernel), same inputs
    try:
        from ssmcraft.ops.diagonal import chunk as D
        from ssmcraft.runtime.select import validated_call
        objd = ssmcraft.compile("longhorn_diag")
        res["diag_fwd"] = bench(lambda: validated_call(D.prepare, objd, ins, None, None, False)[0])
        res["diag_fb"] = bench(lambda: torch.autograd.grad(validated_call(D.prepare, objd, insg, None, None, False)[0],
                                                           list(insg.values()), dy))
        say(f"diagonal Longhorn (ssmcraft.ops.diagonal.chunk): fwd {res['diag_fwd']:.3f} ms, "
            f"fwd+bwd {res['diag_fb']:.3f} ms")
    except Exception as e:   # noqa: BLE001 - report and go on
        say(f"diagonal Longhorn: not run ({type(e).__name__}: {str(e)[:200]})")

    # HBM floor: inputs read once, outputs written once (bf16), forward and forward+backward
    n_v, n_k = B * T * H * V, B * T * H * K
    fwd_bytes = 2 * (3 * n_v + 2 * n_k)            # x, beta, y; k, q
    fb_bytes = fwd_bytes + 2 * (5 * n_v + 4 * n_k)  # + read x, beta, dy; write dx, dbeta; k, q and dk, dq
    res["floor_fwd"] = fwd_bytes / bw * 1e3
    res["floor_fb"] = fb_bytes / bw * 1e3
    say(f"HBM floor: fwd {res['floor_fwd']:.3f} ms, fwd+bwd {res['floor_fb']:.3f} ms")

    # FLA anchor: fused_recurrent_delta_rule with beta [B, T, H, V] at H=24, K=16, V=64 (exact
    # Longhorn without the 1/(1 + beta k.k) normalisation); ours on the same recurrence
    Ha, Ka, Va = 24, 16, 64
    xa, ka, qa, ba = longhorn_kernel_args(B, T, Ha, Ka, Va, dt, seed=3)
    dya = torch.randn(B, T, Ha, Va, device=DEV, dtype=dt)
    try:
        from fla.ops.delta_rule import fused_recurrent_delta_rule as frd
        fg = [t.detach().clone().requires_grad_() for t in (qa, ka, xa, ba)]
        res["fla_fwd"] = bench(lambda: frd(qa, ka, xa, ba, scale=1.0)[0])
        res["fla_fb"] = bench(lambda: torch.autograd.grad(frd(*fg, scale=1.0)[0], fg, dya))
        say(f"FLA fused_recurrent_delta_rule H={Ha} K={Ka} V={Va} beta[B,T,H,V]: fwd {res['fla_fwd']:.3f} ms, "
            f"fwd+bwd {res['fla_fb']:.3f} ms")
        yf = frd(qa, ka, xa, ba, scale=1.0)[0]
    except Exception as e:   # noqa: BLE001
        say(f"FLA: not run ({type(e).__name__}: {str(e)[:200]})")
        yf = None
    ca = ba.float().contiguous()
    pa = (ba.float() * xa.float()).contiguous()
    og = [t.detach().clone().requires_grad_() for t in (ka, qa, ca, pa)]
    for cfg in ((8, 1), (16, 1)):
        R.set_config(fwd=cfg, bwd=cfg)
        f_ms = bench(lambda: R.rank1_row_recurrence(ka, ka, ka, qa, ca, pa)[0])
        fb_ms = bench(lambda: torch.autograd.grad(
            R.rank1_row_recurrence(og[0], og[0], og[0], og[1], og[2], og[3])[0], og, dya))
        say(f"ours on the FLA anchor's recurrence (BV, warps)={cfg}: fwd {f_ms:.3f} ms, fwd+bwd {fb_ms:.3f} ms")
        res.setdefault("anchor_fwd", f_ms)
        res["anchor_fwd"] = min(res["anchor_fwd"], f_ms)
        res.setdefault("anchor_fb", fb_ms)
        res["anchor_fb"] = min(res["anchor_fb"], fb_ms)
    if yf is not None:
        yo = R.rank1_row_recurrence(ka, ka, ka, qa, ca, pa)[0]
        say(f"  ours vs FLA output rel diff {rel(yo.float(), yf.float()):.1e}")
    R.set_config(fwd=best_f[1][:2], bwd=best_b[1][:2])

    # general kernel (fused sequential, derived backward): Cauchy delta rule at DeltaNet's shape
    try:
        cd = ssmcraft.compile("cauchy_delta")
        Hc, Kc = 16, 64
        cin, _ = make_inputs(cd, B, T, Hc, Kc, Kc, 7, dtype=dt)
        cing = {n: t.detach().clone().requires_grad_() for n, t in cin.items()}
        dyc = torch.randn(B, T, Hc, Kc, device=DEV, dtype=dt)
        res["cauchy_fwd"] = bench(lambda: run_ours(cd, cin, None, False)[0])
        res["cauchy_fb"] = bench(lambda: torch.autograd.grad(run_ours(cd, cing, None, False)[0], list(cing.values()), dyc))
        say(f"general kernel, cauchy_delta H={Hc} K=V={Kc}: fwd {res['cauchy_fwd']:.3f} ms, fwd+bwd {res['cauchy_fb']:.3f} ms")
    except Exception as e:   # noqa: BLE001
        say(f"general kernel timing: not run ({type(e).__name__}: {str(e)[:200]})")

    # naive PyTorch loop (obj.reference): one run each after one warm-up
    if not (args.quick or args.no_naive):
        Tn = T

        def naive():
            return obj.reference(ins, None, None, False)[0]

        def naive_fb():
            return torch.autograd.grad(obj.reference(insg, None, None, False)[0], list(insg.values()), dy)
        for name, fn in (("naive_fwd", naive), ("naive_fb", naive_fb)):
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            res[name] = (time.perf_counter() - t0) * 1e3
        say(f"naive PyTorch loop (T={Tn}): fwd {res['naive_fwd']:.1f} ms, fwd+bwd {res['naive_fb']:.1f} ms")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-naive", action="store_true", help="skip the naive loop and the segment sweep")
    args = ap.parse_args()
    say(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}")
    ok = True
    if not args.no_check:
        lh = ssmcraft.compile("longhorn")
        for dt in (torch.float32, torch.bfloat16):
            ok &= check(lh, 8, 2048, 1, 16, 1536, dt)
        ok &= check(lh, 8, 1, 1, 16, 1536, torch.float32)
        ok &= check(lh, 2, 4097, 1, 16, 1536, torch.float32)
        ok &= check(lh, 2, 4097, 1, 16, 1536, torch.bfloat16)
        for name in ("wd_longhorn", "gated_longhorn", "deltanet", "gated_deltanet"):
            o = ssmcraft.compile(name)
            K = 16 if "longhorn" in name else 64
            ok &= check(o, 2, 300, 2, K, 192, torch.float32)
            ok &= check(o, 2, 300, 2, K, 192, torch.bfloat16)
        cd = ssmcraft.compile("cauchy_delta")
        ok &= check(cd, 2, 300, 2, 64, 64, torch.float32)
        ok &= check(cd, 2, 300, 2, 64, 64, torch.bfloat16)
        ok &= check(cd, 1, 1, 2, 64, 64, torch.float32)
        say(f"checks: {'all passed' if ok else 'FAILURES'}")
    if not args.no_time:
        res = time_all(args)
        say("")
        say("| what (B=8, T=2048, bf16) | fwd ms | fwd+bwd ms |")
        say("|---|---|---|")
        say(f"| Longhorn exact, ours (kernel, sequential) | {res['fwd']:.3f} | {res['fb']:.3f} |")
        say(f"| Longhorn exact, ours (full path: PyTorch coefficients + kernel) | {res['full_fwd']:.3f} | {res['full_fb']:.3f} |")
        for key in sorted(k for k in res if k.startswith("chunked")):
            say(f"| Longhorn exact, ours, time-chunked fwd ({key[7:]}) | {res[key]:.3f} | - |")
        if "diag_fwd" in res:
            say(f"| Longhorn diagonal, ours | {res['diag_fwd']:.3f} | {res['diag_fb']:.3f} |")
            say(f"| ratio exact (full path) / diagonal | {res['full_fwd'] / res['diag_fwd']:.2f} | "
                f"{res['full_fb'] / res['diag_fb']:.2f} |")
            say(f"| ratio exact (kernel) / diagonal | {res['fwd'] / res['diag_fwd']:.2f} | "
                f"{res['fb'] / res['diag_fb']:.2f} |")
        say(f"| HBM floor (Longhorn exact, bf16 I/O) | {res['floor_fwd']:.3f} | {res['floor_fb']:.3f} |")
        if "fla_fwd" in res:
            say(f"| FLA fused_recurrent_delta_rule H24 K16 V64 | {res['fla_fwd']:.3f} | {res['fla_fb']:.3f} |")
        say(f"| ours, same recurrence H24 K16 V64 | {res['anchor_fwd']:.3f} | {res['anchor_fb']:.3f} |")
        if "cauchy_fwd" in res:
            say(f"| cauchy_delta (general kernel) H16 K=V=64 | {res['cauchy_fwd']:.3f} | {res['cauchy_fb']:.3f} |")
        if "naive_fwd" in res:
            say(f"| naive PyTorch loop (obj.reference) | {res['naive_fwd']:.1f} | {res['naive_fb']:.1f} |")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_rank1_row.txt"), "w") as f:
            f.write("\n".join(LINES) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
