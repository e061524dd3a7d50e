"""GPU checks and timings of the chunked rank-1 family (DeltaNet, Gated DeltaNet).

Run on a CUDA machine (FLA wheels installed for the anchors):

    PYTHONUNBUFFERED=1 python benchmarks/bench_rank1_chunk.py [--quick] [--no-check] [--no-time]

1. Correctness, fp32 and bf16: output, final state and every gradient (inputs and initial
   state, with a gradient on the final state too) against the float64 reference loop
   (``obj.reference``), at B=8, T=2048, H=16, K=V=64 and at T=1 and T=4097; the general slot
   form (u != v != q, decay) at kernel level; ``delta_rule`` with and without an initial state (and
   its gradient) and a final-state gradient, DeltaNet and Gated DeltaNet (``check_modes``: the
   kernels' step modes and state flags); FLA's own bf16 error printed beside ours.
2. Timings, bf16, B=8, T=2048, H=16, K=V=64 (triton.testing.do_bench, median), in one process:
   ours, FLA (chunk_delta_rule / chunk_gated_delta_rule), the naive PyTorch loop, the HBM floor
   (bytes that must move / measured copy bandwidth); and a per-kernel profile.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

SMOKE = "--smoke" in sys.argv        # CPU dry run of this script under the interpreter, tiny sizes
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ssmcraft  # noqa: E402
from ssmcraft.ops.rank1_chunk import chunk as R  # noqa: E402
from ssmcraft.ops.common.reference import layout  # noqa: E402
from checks import TOL_CHUNKED as TOL, compare, dtype_name, reference  # noqa: E402
from ssmcraft.ops.rank1_chunk.naive import naive_recurrent_rank1  # noqa: E402
from ssmcraft.runtime.checking import DELTA_RULE_CASES, delta_rule_case, over, rel_rms as rel  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
SHAPE = dict(H=2, K=16, V=16) if SMOKE else dict(H=16, K=64, V=64)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def devname():
    return torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter smoke run)"


def make_inputs(name, B, T, H, K, V, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV, dtype=torch.float64)  # noqa: E731
    nk = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    ins = {"x": r(B, T, H, V), "k": nk(r(B, T, H, K)), "q": nk(r(B, T, H, K)),
           "beta": torch.sigmoid(r(B, T, H))}
    if name == "gated_deltanet":
        ins["alpha"] = torch.sigmoid(3.0 + r(B, T, H))
    h0 = r(B, H, V, K) * 0.5
    return ins, h0


def family_call(obj):
    """Ours through the family interface (reference layout + generated coefficients + kernel)."""
    def call(inputs, params, s0):
        lay = layout(obj.ir, obj.spec, inputs, None, s0)
        return R.forward(obj, lay, obj.module.coefficients(lay.env, lay.d, lay.m), True)
    return call


def check_objective(name, B, T, seed=0, fla=None, H=None, K=None, V=None):
    H, K, V = H or SHAPE["H"], K or SHAPE["K"], V or SHAPE["V"]
    obj = ssmcraft.compile(name)
    ins, h0 = make_inputs(name, B, T, H, K, V, seed)
    t0 = time.time()
    ref = reference(obj, ins, None, h0, torch.Generator().manual_seed(seed + 1))   # once, for every dtype
    t_ref = time.time() - t0
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        cmp = compare(ref, family_call(obj), dtype)
        rows.append((f"{name} {dtype_name(dtype)} B{B} T{T} H{H} K{K} V{V}", cmp.within(TOL[dtype]), cmp.errors))
    if fla is not None and name == "deltanet":
        rows.append((f"  (FLA chunk_delta_rule bf16, for scale) T{T}", None,
                     compare(ref, fla_call(fla), torch.bfloat16).errors))
    print(f"# reference loop {name} T={T}: {t_ref:.1f} s", flush=True)
    return rows


def fla_call(fla):
    """FLA's chunk_delta_rule on our tensors (its state layout is the transpose of ours)."""
    def call(inputs, params, s0):
        o, ht = fla["delta"](inputs["q"], inputs["k"], inputs["x"], inputs["beta"], scale=1.0,
                             initial_state=s0.transpose(-1, -2).contiguous(), output_final_state=True)
        return o, ht.transpose(-1, -2)
    return call


def check_general(B=2, T=300, seed=3):
    H, K, V = 4 if not SMOKE else 2, SHAPE["K"], SHAPE["V"]
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV, dtype=torch.float64)  # noqa: E731
    nk = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    ins = [nk(r(B, T, H, K)), nk(r(B, T, H, K)), nk(r(B, T, H, K)), r(B, T, H, V), r(B, T, H, K),
           torch.sigmoid(r(B, T, H)), torch.sigmoid(2 + r(B, T, H)), r(B, H, K, V)]
    names = ["v", "u", "q", "p", "oq", "c", "a", "h0"]
    lv = [x.detach().requires_grad_() for x in ins]
    o_ref, h_ref = naive_recurrent_rank1(*lv)
    do, dh = r(*o_ref.shape), r(*h_ref.shape)
    g_ref = torch.autograd.grad((o_ref * do).sum() + (h_ref * dh).sum(), lv)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        lv2 = [x.to(dtype if i < 7 else torch.float32).detach().requires_grad_() for i, x in enumerate(ins)]
        v, u, q, p, oq, c, a, h0 = lv2
        o, ht = R.chunk_rank1(v, p, c, oq, u=u, q=q, a=a, initial_state=h0, output_final_state=True)
        gg = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dh).sum(), lv2)
        errs = {"y": rel(o, o_ref), "S_T": rel(ht, h_ref)}
        errs.update({f"d{n}": rel(x, y) for n, x, y in zip(names, gg, g_ref)})
        rows.append((f"general u!=v!=q, a {str(dtype)[6:]} B{B} T{T}", not over(errs, TOL[dtype]), errs))
    return rows


def check_modes(B=2, Ts=(301, 517), seed=5):
    """``delta_rule`` in every case of ``checking.DELTA_RULE_CASES`` (no initial state, one that
    wants no gradient, one that does; the final state in the loss or not; DeltaNet, c is ps, and
    Gated DeltaNet, c = a ps): the kernels' state flags and step modes, against the float64 loop."""
    H, K, V = 4 if not SMOKE else 2, SHAPE["K"], SHAPE["V"]
    rows = []
    for h0_kind, final, gated in DELTA_RULE_CASES:
        T = Ts[h0_kind == "grad"]
        for dtype in (torch.float32, torch.bfloat16):
            errs, dtypes, final_ok = delta_rule_case(R.delta_rule, B, T, H, K, V, h0_kind, final, gated, dtype,
                                                     device=DEV, seed=seed)
            ok = final_ok and all(dtypes.values()) and not over(errs, TOL[dtype])
            rows.append((f"{'gated ' if gated else ''}delta_rule h0 {h0_kind} final {final} {dtype_name(dtype)} T{T}",
                         ok, errs))
    return rows


def print_rows(rows):
    for label, ok, errs in rows:
        tag = "    " if ok is None else ("PASS" if ok else "FAIL")
        print(f"{tag} {label:44s} " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()), flush=True)


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------

def bench(fn, grad_to_none=None):
    if SMOKE:
        t0 = time.time()
        fn()
        return (time.time() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")


def copy_bandwidth():
    x = torch.empty(1 << (12 if SMOKE else 28), dtype=torch.bfloat16, device=DEV).normal_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() * 2 / (ms * 1e-3)


def timings(fla, B=8, T=2048):
    H, K, V = SHAPE["H"], SHAPE["K"], SHAPE["V"]
    bw = copy_bandwidth()
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    e = 2  # bf16
    tok = B * T * H
    fwd_bytes = tok * (2 * K + 2 * V) * e + tok * e          # q, k, x, o; beta
    bwd_bytes = fwd_bytes + tok * (2 * K + 2 * V) * e + tok * e + tok * V * e  # + do, dq, dk, dx, dbeta
    floor_f, floor_fb = fwd_bytes / bw * 1e3, bwd_bytes / bw * 1e3
    g = torch.Generator(device=DEV).manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, device=DEV, dtype=torch.bfloat16)  # noqa: E731
    nk = lambda x: (x.float() / x.float().norm(dim=-1, keepdim=True)).to(torch.bfloat16)  # noqa: E731
    q, k, x = nk(mk(B, T, H, K)), nk(mk(B, T, H, K)), mk(B, T, H, V)
    beta = torch.sigmoid(mk(B, T, H).float()).to(torch.bfloat16)
    alpha = torch.sigmoid(3 + mk(B, T, H).float())
    do = mk(B, T, H, V)
    res = {}
    print(f"\n## timings: B={B} T={T} H={H} K={K} V={V} bf16, {devname()}")
    print(f"{'':44s} {'fwd ms':>9s} {'fwd+bwd ms':>11s}", flush=True)

    def put(kname, f, b):
        res[kname] = (f, b)
        print(f"{kname:44s} {f:9.3f} {b:11.3f}", flush=True)

    def try_bench(fn, leaves=None):
        try:
            return bench(fn, leaves)
        except Exception as e:  # noqa: BLE001
            print(f"# failed: {str(e).splitlines()[0][:150]}", flush=True)
            return float("nan")

    def fb(f, leaves):
        def run():
            o = f(*leaves)
            o.backward(do)
        return run

    leaves = [t.clone().requires_grad_() for t in (q, k, x, beta)]
    ours = lambda q_, k_, x_, b_: R.delta_rule(q_, k_, x_, b_)[0]  # noqa: E731
    put("deltanet ours", bench(lambda: ours(q, k, x, beta)), bench(fb(ours, leaves), leaves))
    if fla:
        theirs = lambda q_, k_, x_, b_: fla["delta"](q_, k_, x_, b_, scale=1.0)[0]  # noqa: E731
        put("deltanet FLA chunk_delta_rule", bench(lambda: theirs(q, k, x, beta)), bench(fb(theirs, leaves), leaves))
    # through the objective interface (layout + generated coefficients + kernel)
    obj = ssmcraft.compile("deltanet")

    def via_obj(q_, k_, x_, b_):
        lay = layout(obj.ir, obj.spec, {"x": x_, "k": k_, "q": q_, "beta": b_}, None, None)
        co = obj.module.coefficients(lay.env, lay.d, lay.m)
        return R.forward(obj, lay, co, False)[0]
    put("deltanet ours via objective (layout+coef)", bench(lambda: via_obj(q, k, x, beta)),
        bench(fb(via_obj, leaves), leaves))
    # gated
    la = alpha.clone()
    leaves_g = [t.clone().requires_grad_() for t in (q, k, x, beta)] + [la.clone().requires_grad_()]
    ours_g = lambda q_, k_, x_, b_, a_: R.delta_rule(q_, k_, x_, b_, a_)[0]  # noqa: E731
    put("gated ours", bench(lambda: ours_g(q, k, x, beta, alpha)), bench(fb(ours_g, leaves_g), leaves_g))
    if fla:
        theirs_g = lambda q_, k_, x_, b_, a_: fla["gated"](q_, k_, x_, a_.log(), b_, scale=1.0)[0]  # noqa: E731
        put("gated FLA chunk_gated_delta_rule", try_bench(lambda: theirs_g(q, k, x, beta, alpha)),
            try_bench(fb(theirs_g, leaves_g), leaves_g))
    # naive loop (one run each; bf16 inputs, fp32 compute)
    lv = {"x": x, "k": k, "q": q, "beta": beta}
    sync()
    t0 = time.time()
    obj.reference(lv)
    sync()
    t1 = time.time()
    lvg = {n: t.clone().requires_grad_() for n, t in lv.items()}
    y, _ = obj.reference(lvg)
    y.backward(do)
    sync()
    t2 = time.time()
    put("naive PyTorch loop (obj.reference)", (t1 - t0) * 1e3, (t2 - t1) * 1e3)
    put("HBM floor", floor_f, floor_fb)
    if fla:
        a, b = res["deltanet ours"], res["deltanet FLA chunk_delta_rule"]
        print(f"DeltaNet ours/FLA: fwd {a[0] / b[0]:.2f}x  fwd+bwd {a[1] / b[1]:.2f}x")
        a, b = res["gated ours"], res["gated FLA chunk_gated_delta_rule"]
        print(f"Gated DeltaNet ours/FLA: fwd {a[0] / b[0]:.2f}x  fwd+bwd {a[1] / b[1]:.2f}x")
    a = res["deltanet ours"]
    print(f"DeltaNet ours/HBM floor: fwd {a[0] / floor_f:.1f}x  fwd+bwd {a[1] / floor_fb:.1f}x", flush=True)
    return res, (q, k, x, beta, do)


def profile(fla, tensors):
    q, k, x, beta, do = tensors
    from torch.profiler import ProfilerActivity, profile as prof
    for label, f in [("ours", lambda *a: R.delta_rule(*a)[0]),
                     ("FLA", (lambda *a: fla["delta"](*a, scale=1.0)[0]) if fla else None)]:
        if f is None:
            continue
        leaves = [t.clone().requires_grad_() for t in (q, k, x, beta)]
        for _ in range(3):
            f(*leaves).backward(do)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                f(*leaves).backward(do)
            torch.cuda.synchronize()
        print(f"\n## per-kernel ({label}, 5 x fwd+bwd)")
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


# ------------------------------------------------------------------------------------------
# compile warm-up: every kernel variant the run needs, compiled in parallel processes into
# Triton's on-disk cache (the cache key does not depend on T or B, so tiny inputs suffice)
# ------------------------------------------------------------------------------------------

WARM_MODES = [(dt, gen, has_a, train)
              for dt, gen, has_a, train in [("bf16", 0, 0, 1), ("bf16", 0, 0, 0), ("bf16", 0, 1, 1), ("bf16", 0, 1, 0),
                                            ("bf16", 1, 1, 1), ("fp32", 0, 0, 1), ("fp32", 0, 1, 1), ("fp32", 1, 1, 1)]]


def _warm_one(mode):
    dt, general, has_a, train = mode
    dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    t0 = time.time()
    B, T, H, K, V = 1, 130, 16, 64, 64
    mk = lambda *s: torch.randn(*s, device=DEV, dtype=dtype).requires_grad_(bool(train))  # noqa: E731
    v, p, oq = mk(B, T, H, K), mk(B, T, H, V), mk(B, T, H, K)
    u = mk(B, T, H, K) if general else None
    q = mk(B, T, H, K) if general else None
    c = torch.rand(B, T, H, device=DEV).requires_grad_(bool(train))
    a = torch.rand(B, T, H, device=DEV).requires_grad_(bool(train)) if has_a else None
    ps = None if general else torch.rand(B, T, H, device=DEV).requires_grad_(bool(train))
    with torch.set_grad_enabled(bool(train)):
        o, ht = R.chunk_rank1(v, p, c, oq, u=u, q=q, a=a, ps=ps, output_final_state=True)
        if train:
            (o.float().sum() + ht.sum()).backward()
    sync()
    return f"{mode}: {time.time() - t0:.0f} s"


def warm(modes=WARM_MODES):
    import multiprocessing as mp
    t0 = time.time()
    with mp.get_context("spawn").Pool(len(modes)) as pool:
        for line in pool.imap_unordered(_warm_one, modes):
            print("# warm", line, flush=True)
    print(f"# warm-up (parallel compile) {time.time() - t0:.0f} s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="checks at T=2048 only")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-warm", action="store_true")
    ap.add_argument("--fla-check", action="store_true", help="also print FLA's bf16 error (compiles more FLA variants)")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run (interpreter, tiny sizes)")
    ap.add_argument("--training-shapes", action="store_true",
                    help="checks only, at the shapes a training run feeds the kernel (one head, small K, d_inner values)")
    args = ap.parse_args()
    print(f"# device {devname()}, torch {torch.__version__}, triton {triton.__version__}")
    fla = None
    try:
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        fla = {"delta": chunk_delta_rule, "gated": chunk_gated_delta_rule}
    except Exception as e:  # noqa: BLE001
        print(f"# FLA unavailable: {e}")
    if not (args.no_warm or SMOKE or args.training_shapes):     # the warm-up compiles the standard shape only
        warm(WARM_MODES if not args.no_check else [m for m in WARM_MODES if m[0] == "bf16" and not m[1]])
    t0 = time.time()
    if not args.no_check:
        rows = []
        Ts = (20, 1) if SMOKE else ((2048,) if args.quick else (2048, 1, 4097))
        if args.training_shapes:     # (B, T, H, K, V) as the mixer calls it
            shapes = [(1, 20, 1, 8, 48)] if SMOKE else [(4, 256, 1, 16, 256), (8, 64, 1, 8, 128), (2, 1000, 1, 16, 512),
                                                        (3, 333, 2, 16, 96), (4, 256, 1, 32, 256)]
            for B, T, H, K, V in shapes:
                for name in ("deltanet", "gated_deltanet"):
                    rows += check_objective(name, B, T, H=H, K=K, V=V)
            Ts = ()
        for T in Ts:
            for name in ("deltanet", "gated_deltanet"):
                rows += check_objective(name, 1 if SMOKE else 8, T, fla=fla if args.fla_check else None)
        if not args.training_shapes:
            rows += check_general(*((1, 20) if SMOKE else ()))
            rows += check_modes(*((1, (20, 37)) if SMOKE else ()))
        print(f"\n## correctness vs float64 reference (relative RMS error; tol fp32 {TOL[torch.float32]:g}, "
              f"bf16 {TOL[torch.bfloat16]:g})")
        print_rows(rows)
        print(f"# checks took {time.time() - t0:.0f} s", flush=True)
    if not args.no_time:
        res, tensors = timings(fla, *((1, 40) if SMOKE else ()))
        if not (args.no_profile or SMOKE):
            profile(fla, tensors)


if __name__ == "__main__":
    main()
