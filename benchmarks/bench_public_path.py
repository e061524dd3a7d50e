"""Issue 12: what users call, ``ssmcraft.compile(name)(inputs)``, against the anchors, in one process.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_public_path.py [--mamba DIR] [--out FILE]

1. Correctness of the public path against independent implementations (fp32 and bf16; output,
   final state and every gradient incl. the initial state where the anchor has one):
   DeltaNet vs FLA ``chunk_delta_rule``; GLA vs FLA ``chunk_gla`` (ours takes the decay, FLA its
   log: the gradient reaches the same leaf); Gated DeltaNet forward vs FLA
   ``chunk_gated_delta_rule``; exact Longhorn vs FLA ``fused_recurrent_delta_rule`` with the
   per-row step ``c = beta / (1 + beta k.k)`` (computed by autograd from the same leaves); the
   Mamba objective vs mamba's CUDA ``selective_scan`` (built by ``benchmarks/mamba_build.py``).
2. Timings at B=8, T=2048, bf16 (do_bench medians): ours fwd and fwd+bwd through ``obj(...)``,
   the anchor on its own layout, the ratio; the GPU-busy fraction of one ``obj`` call (torch
   profiler: kernel time / wall time of back-to-back calls) and the host time per call; then
   fwd+bwd again, ours and the anchor, with the autograd engine on the calling thread ("1t":
   ``timing.on_this_thread``).
3. Decode: tokens/s of ``LM.step`` (fused one-token kernel) for the 6-layer 20M Longhorn model of
   ``specs/longhorn_20m_bytes.yaml`` against its parallel forward; ``--graphed-decode`` adds the
   same through ``GraphedDecoder`` (``benchmarks/bench_graphs.py`` compares both, with a check).
Each check calls ``obj`` twice: the second call runs the kernels through the direct launches of
``ssmcraft.ops.common.launch`` and must match the first. ``SSMCRAFT_DIRECT_LAUNCH=0`` times the path
with every launch through Triton's launcher (the "before" of the host-overhead figures).
FLA comes from carried wheels (PYTHONPATH); mamba's extension from ``--mamba DIR``. A missing
anchor is reported as such, never silently skipped.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report, bench_ms, copy_bandwidth, random_inputs  # noqa: E402
from ssmcraft.runtime.timing import obj_calls, on_this_thread, time_calls  # noqa: E402
from ssmcraft.runtime.checking import rel_rms  # noqa: E402

import ssmcraft  # noqa: E402
from ssmcraft.errors import one_line  # noqa: E402

DEV = "cuda"
TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}     # FLA's fp32 products run in tf32


# -- anchors ---------------------------------------------------------------------------------

def load_fla():
    try:
        from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.gla import chunk_gla
        return {"delta": chunk_delta_rule, "recurrent": fused_recurrent_delta_rule, "gated": chunk_gated_delta_rule,
                "gla": chunk_gla}
    except Exception as e:  # noqa: BLE001
        print(f"# FLA unavailable: {type(e).__name__}: {e}")
        return None


def load_mamba(path):
    if not path:
        print("# mamba selective_scan: no --mamba DIR given")
        return None
    sys.path.insert(0, path)
    try:
        import selective_scan_cuda
        return selective_scan_cuda
    except Exception as e:  # noqa: BLE001
        print(f"# mamba selective_scan unavailable: {type(e).__name__}: {e}")
        return None


class SelectiveScan(torch.autograd.Function):
    """mamba's CUDA kernel (u, delta [B, D, L]; A [D, N]; B, C [B, 1, N, L]) with autograd; returns
    (out [B, D, L], last state [B, D, N])."""

    @staticmethod
    def forward(ctx, ssc, u, delta, A, Bm, C):
        out, x, *_ = ssc.fwd(u, delta, A, Bm, C, None, None, None, False)
        ctx.ssc = ssc
        ctx.save_for_backward(u, delta, A, Bm, C, x)
        return out, x[:, :, -1, 1::2]

    @staticmethod
    def backward(ctx, dout, dlast):
        u, delta, A, Bm, C, x = ctx.saved_tensors
        du, ddelta, dA, dB, dC, *_ = ctx.ssc.bwd(u, delta, A, Bm, C, None, None, None, dout.contiguous(), x,
                                                 None, None, False, False)
        return None, du, ddelta, dA, dB, dC


def mamba_layout(inputs, params):
    """Our Mamba objective's tensors ([B, T, 1, n]) in selective_scan's layout (differentiable)."""
    dt = inputs["x"].dtype           # the kernel wants u, delta, B, C in one dtype

    def bdl(t):
        return t[:, :, 0].transpose(1, 2).to(dt).contiguous()
    return (bdl(inputs["x"]), bdl(inputs["delta"]), params["A"].float().contiguous(),
            bdl(inputs["k"]).unsqueeze(1), bdl(inputs["q"]).unsqueeze(1))


def longhorn_rows(inputs):
    """FLA's per-row beta for exact Longhorn: c = beta / (1 + beta k.k)."""
    b, k = inputs["beta"].float(), inputs["k"].float()
    return (b / (1 + b * (k * k).sum(-1, keepdim=True))).to(inputs["x"].dtype)


def anchor_call(name, fla, ssc, inputs, params, S0=None):
    """(y [B, T, H, d], final state [B, H, d, m] or None) of the anchor on our tensors."""
    h0 = None if S0 is None else S0.transpose(-1, -2).contiguous()
    if name == "deltanet":        # FLA's chunked form refuses fp32: its recurrent form is the fp32 anchor
        f = fla["delta"] if inputs["x"].dtype != torch.float32 else fla["recurrent"]
        o, ht = f(inputs["q"], inputs["k"], inputs["x"], inputs["beta"], scale=1.0,
                  initial_state=h0, output_final_state=True)
    elif name == "gla":
        g = inputs["alpha"].float().log()
        o, ht = fla["gla"](inputs["q"], inputs["k"], inputs["x"], g, scale=1.0, initial_state=h0,
                           output_final_state=True)
    elif name == "gated_deltanet":
        g = inputs["alpha"].float().log()
        o, ht = fla["gated"](inputs["q"], inputs["k"], inputs["x"], g, inputs["beta"], scale=1.0,
                             initial_state=h0, output_final_state=True)
    elif name == "longhorn":
        o, ht = fla["recurrent"](inputs["q"], inputs["k"], inputs["x"], longhorn_rows(inputs), scale=1.0,
                                 initial_state=h0, output_final_state=True)
    elif name in ("mamba", "longhorn_diag"):
        out, last = SelectiveScan.apply(ssc, *mamba_layout(inputs, params))
        return out.transpose(1, 2)[:, :, None], last[:, None]
    else:
        raise ValueError(name)
    return o, ht.transpose(-1, -2)


# -- 1. correctness --------------------------------------------------------------------------

def check(rep, name, fla, ssc, dtype, B=2, T=300, H=2, d=64, m=32, backward=True, reference=False):
    obj = ssmcraft.compile(name)
    inputs, params = random_inputs(obj, B, T, H, d, m, torch.float32, DEV, seed=11, unit_keys=name != "mamba")
    has_h0 = name not in ("mamba",)
    leaves = {**{f"d{n}": t.to(dtype).detach().requires_grad_(backward) for n, t in inputs.items()},
              **{f"d{n}": t.detach().requires_grad_(backward) for n, t in params.items()}}
    S0 = torch.randn(B, H, d, m, device=DEV, requires_grad=backward) if has_h0 else None
    ours_in = {n: leaves[f"d{n}"] for n in inputs}
    ours_p = {n: leaves[f"d{n}"] for n in params}

    def run(fn):
        for t in [*leaves.values(), S0]:
            if t is not None:
                t.grad = None
        y, S = fn()
        out = {"y": y.detach().float(), "S_T": S.detach().float()}
        if backward:
            g = torch.Generator(device=DEV).manual_seed(5)
            (y.float() * torch.randn(y.shape, device=DEV, generator=g)).sum().backward()
            out.update({k: t.grad.detach().float() for k, t in leaves.items()})
            if S0 is not None:
                out["dS0"] = S0.grad.detach().float()
        return out
    ours = run(lambda: obj(ours_in, ours_p, S0, True))
    again = run(lambda: obj(ours_in, ours_p, S0, True))     # the kernels launched directly now (launch.py)
    repeat = max(rel_rms(again[k], ours[k]) for k in ours)
    backend = obj.backend
    try:
        theirs = run(lambda: anchor_call(name, fla, ssc, ours_in, ours_p, S0))
    except Exception as e:  # noqa: BLE001 - an anchor that refuses a case is reported, not fatal
        rep.add(section="check", objective=name, dtype=str(dtype).split(".")[-1], backend=backend, ok=False,
                worst=float("nan"), error=f"anchor: {one_line(e)}")
        return False
    errs = {k: rel_rms(ours[k], theirs[k]) for k in theirs}
    ok_key = {k: e <= TOL[dtype] for k, e in errs.items()}      # NaN compares False: not ok
    anchor_off = []
    if reference:           # the float64 reference loop on the same leaves: which side is off
        ref = run(lambda: obj.reference({n: t.double() for n, t in ours_in.items()},
                                        {n: t.double() for n, t in ours_p.items()},
                                        None if S0 is None else S0.double(), True))
        ours_ref = {k: rel_rms(ours[k], ref[k]) for k in theirs}
        anchor_ref = {k: rel_rms(theirs[k], ref[k]) for k in theirs}
        rep.add(section="check-ref", objective=name, dtype=str(dtype).split(".")[-1],
                ours_vs_ref={k: float(f"{v:.3g}") for k, v in ours_ref.items()},
                anchor_vs_ref={k: float(f"{v:.3g}") for k, v in anchor_ref.items()})
        # a disagreement is the anchor's when ours matches the reference and the anchor does not
        anchor_off = [k for k, good in ok_key.items()
                      if not good and ours_ref[k] <= TOL[dtype] and not anchor_ref[k] <= TOL[dtype]]
        ok_key.update({k: True for k in anchor_off})
    worst = max(errs.values())
    ok = all(ok_key.values()) and repeat <= TOL[dtype]
    rep.add(section="check", objective=name, dtype=str(dtype).split(".")[-1], backend=backend, worst=worst,
            ok=ok, errors={k: float(f"{v:.3g}") for k, v in errs.items()}, second_call_vs_first=repeat,
            anchor_off_by_reference=anchor_off)
    return ok


# -- 2. timings ------------------------------------------------------------------------------

CASES = [  # objective, (H, d, m), anchor label
    ("deltanet", (16, 64, 64), "FLA chunk_delta_rule"),
    ("gla", (16, 64, 64), "FLA chunk_gla"),
    ("mamba", (1, 1536, 16), "mamba selective_scan"),
    ("longhorn_diag", (1, 1536, 16), "mamba selective_scan (Mamba inputs)"),
    ("longhorn", (24, 64, 16), "FLA fused_recurrent_delta_rule"),
    ("gated_deltanet", (16, 64, 64), "FLA chunk_gated_delta_rule (fwd only)"),
]


def case_inputs(name, H, d, m, B=8, T=2048, dt=torch.bfloat16, device=DEV):
    """(objective, inputs, params) of a timing case: random leaves that require grad, unit keys for
    exact Longhorn (the delta-rule specs declare theirs normalised; the step is only stable then)."""
    obj = ssmcraft.compile(name)
    inputs, params = random_inputs(obj, B, T, H, d, m, dt, device, requires_grad=True, unit_keys=name == "longhorn")
    return obj, inputs, params


def timings(rep, fla, ssc, B=8, T=2048, only=None):
    dt = torch.bfloat16
    for name, (H, d, m), anchor in CASES:
        if only and name not in only:
            continue
        obj, inputs, params = case_inputs(name, H, d, m, B, T, dt)
        dy = torch.randn_like(obj(inputs, params, None, False)[0])
        t = time_calls(obj_calls(obj, inputs, params, None, False, dy), with_busy=True)     # eager obj()
        f_ms, fb_ms = t["eager_fwd_ms"], t["eager_fwd_bwd_ms"]
        row = dict(section="time", objective=name, shape=f"B{B} T{T} H{H} d{d} m{m} bf16", backend=obj.backend,
                   ours_fwd_ms=f_ms, ours_fwd_bwd_ms=fb_ms, gpu_busy_fwd=t["eager_busy_fwd"],
                   gpu_busy_fwd_bwd=t["eager_busy_fwd_bwd"], host_us_fwd=t["eager_host_us_fwd"],
                   host_us_fwd_bwd=t["eager_host_us_fwd_bwd"], anchor=anchor,
                   ours_fwd_bwd_1t_ms=t["onethread_fwd_bwd_ms"], gpu_busy_fwd_bwd_1t=t["onethread_busy_fwd_bwd"],
                   host_us_fwd_bwd_1t=t["onethread_host_us_fwd_bwd"])
        try:
            if anchor.startswith("FLA") and fla is None or anchor.startswith("mamba") and ssc is None:
                raise RuntimeError("anchor not available")
            if name == "longhorn_diag":       # selective_scan on the same shape, with Mamba's inputs
                mo = ssmcraft.compile("mamba")
                a_in, a_p = random_inputs(mo, B, T, H, d, m, dt, DEV, requires_grad=True)
            else:
                a_in, a_p = inputs, params
            a_name = "mamba" if name == "longhorn_diag" else name
            args = mamba_layout(a_in, a_p) if a_name == "mamba" else None
            a_leaves = [t.detach().requires_grad_(True) for t in args] if args else None

            def a_fwd():
                if args is not None:
                    return SelectiveScan.apply(ssc, *a_leaves)[0]
                return anchor_call(a_name, fla, ssc, a_in, a_p)[0]
            a_y = a_fwd()
            a_dy = torch.randn_like(a_y)
            grads_of = a_leaves if args is not None else [t for t in [*a_in.values(), *a_p.values()] if t.requires_grad]
            with torch.no_grad():
                row["anchor_fwd_ms"] = bench_ms(a_fwd)
            if name != "gated_deltanet":
                a_fb = lambda: torch.autograd.grad(a_fwd(), grads_of, a_dy)  # noqa: E731
                row["anchor_fwd_bwd_ms"] = bench_ms(a_fb)
                row["ratio_fwd_bwd"] = fb_ms / row["anchor_fwd_bwd_ms"]
                row["anchor_fwd_bwd_1t_ms"] = bench_ms(on_this_thread(a_fb))
                row["ratio_fwd_bwd_1t"] = row["ours_fwd_bwd_1t_ms"] / row["anchor_fwd_bwd_1t_ms"]
            row["ratio_fwd"] = f_ms / row["anchor_fwd_ms"]
        except Exception as e:  # noqa: BLE001
            row["anchor_error"] = one_line(e)
        rep.add(**row)


# -- 3. decode ---------------------------------------------------------------------------------

def decode(rep, steps=128, graphed=False, batches=(1, 16), lm=None, parallel=True):
    """Decode tokens/s of ``LM.step`` under bf16 autocast; ``graphed``: through ``GraphedDecoder``
    (the whole step one CUDA graph replay); ``parallel``: also the parallel forward at T=2048."""
    if lm is None:
        from bench_train_mixers import build
        lm = build("longhorn")          # the 6-layer 20M Longhorn byte LM of specs/longhorn_20m_bytes.yaml
    n_params = sum(p.numel() for p in lm.parameters())
    for B in batches:
        tok = torch.randint(0, 256, (B,), device=DEV)
        if graphed:
            from ssmcraft.layers.graphed_decode import GraphedDecoder
            dec = GraphedDecoder(lm, B, autocast_dtype=torch.bfloat16)

            def one():
                dec.step(tok)
        else:
            caches = [lm.init_cache(B)]

            def one():
                caches[0] = lm.step(tok, caches[0])[1]
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(4):
                one()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                one()
            torch.cuda.synchronize()
            dec_tps = B * steps / (time.perf_counter() - t0)
            row = dict(section="decode", model=f"{len(lm.blocks)} x d{lm.cfg.d_model} Longhorn, "
                       f"{n_params / 1e6:.1f}M params", batch=B, graphed=graphed, decode_tokens_per_s=dec_tps,
                       backend=lm.backends())
            if parallel:
                tokens = torch.randint(0, 256, (B, 2048), device=DEV)
                par_ms = bench_ms(lambda: lm(tokens), warmup=2, rep=10)
                row["parallel_tokens_per_s"] = B * 2048 / (par_ms * 1e-3)
        rep.add(**row)


def host_profile(only=None, n=20):
    """cProfile of ``n`` fwd+bwd calls of the ``only`` objectives (default DeltaNet and Longhorn
    diagonal): host time only, where the Python time per call goes."""
    names = only or ("deltanet", "longhorn_diag")
    import cProfile
    import pstats
    for name, (H, d, m), _ in [c for c in CASES if c[0] in names]:
        obj, inputs, params = case_inputs(name, H, d, m)
        leaves = [t for t in [*inputs.values(), *params.values()] if t.requires_grad]
        dy = torch.randn_like(obj(inputs, params, None, False)[0])

        def fwd_bwd():
            torch.autograd.grad(obj(inputs, params, None, False)[0], leaves, dy)
        fwd_bwd()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            fwd_bwd()
        pr.disable()
        torch.cuda.synchronize()
        print(f"\n## host profile: {name} fwd+bwd x {n}")
        pstats.Stats(pr).sort_stats("tottime").print_stats(24)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mamba", help="directory holding mamba's built selective_scan_cuda extension")
    ap.add_argument("--out", help="write the report as JSON here")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--graphed-decode", action="store_true",
                    help="also decode through GraphedDecoder (the step one CUDA graph replay)")
    ap.add_argument("--bf16-only", action="store_true", help="correctness checks in bf16 only")
    ap.add_argument("--only", help="comma-separated objectives: time, check and host-profile only these")
    ap.add_argument("--fp32-chunked", action="store_true", help="also check FLA's chunked kernels in fp32 (slow)")
    ap.add_argument("--host-profile", action="store_true", help="cProfile the host side of obj() fwd+bwd")
    ap.add_argument("--no-anchors", action="store_true", help="time ours only (FLA and mamba not loaded)")
    args = ap.parse_args()
    rep = Report("bench_public_path")
    rep.set("copy_bandwidth_GBps", copy_bandwidth(torch.device(DEV)) / 1e9)
    fla, ssc = (None, None) if args.no_anchors else (load_fla(), load_mamba(args.mamba))
    only = set(args.only.split(",")) if args.only else None
    want = (lambda n: only is None or n in only)
    if not args.no_time:
        timings(rep, fla, ssc, only=only)
    if not args.no_decode:
        decode(rep)
        if args.graphed_decode:
            decode(rep, graphed=True, parallel=False)
    if args.host_profile:
        host_profile(only)
    if not args.no_check:
        # FLA's chunked kernels autotune for minutes in fp32: --fp32-chunked adds those cases
        for dt in ((torch.float32, torch.bfloat16) if not args.bf16_only else (torch.bfloat16,)):
            if fla is not None:
                if want("deltanet"):
                    check(rep, "deltanet", fla, ssc, dt, d=64, m=64)
                if dt != torch.float32 or args.fp32_chunked:
                    if want("gla"):
                        check(rep, "gla", fla, ssc, dt, d=64, m=64)
                    if want("gated_deltanet"):
                        check(rep, "gated_deltanet", fla, ssc, dt, d=64, m=64, backward=False)
                if want("longhorn"):
                    check(rep, "longhorn", fla, ssc, dt, H=4, d=64, m=16, reference=True)
            if ssc is not None and want("mamba"):
                check(rep, "mamba", fla, ssc, dt, H=1, d=256, m=16)
    rep.write(args.out)
    print("\n# summary (bf16, B=8, T=2048): objective | ours fwd / fwd+bwd ms | anchor fwd / fwd+bwd ms | "
          "ratio fwd / fwd+bwd | GPU busy fwd / fwd+bwd | host us; then fwd+bwd with the autograd engine on the "
          "calling thread (1t): ours / anchor ms, ratio, GPU busy, host us")
    for r in rep.data["rows"]:
        if r.get("section") == "time":
            print(f"{r['objective']:15s} | {r['ours_fwd_ms']:.3f} / {r['ours_fwd_bwd_ms']:.3f} | "
                  f"{r.get('anchor_fwd_ms', float('nan')):.3f} / {r.get('anchor_fwd_bwd_ms', float('nan')):.3f} | "
                  f"{r.get('ratio_fwd', float('nan')):.2f} / {r.get('ratio_fwd_bwd', float('nan')):.2f} | "
                  f"{r['gpu_busy_fwd']:.2f} / {r['gpu_busy_fwd_bwd']:.2f} | {r['host_us_fwd']:.0f} / {r['host_us_fwd_bwd']:.0f} "
                  f"| {r['backend']} {r.get('anchor_error', '')}")
            print(f"{'':15s}   1t: {r['ours_fwd_bwd_1t_ms']:.3f} / {r.get('anchor_fwd_bwd_1t_ms', float('nan')):.3f} | "
                  f"{r.get('ratio_fwd_bwd_1t', float('nan')):.2f} | {r['gpu_busy_fwd_bwd_1t']:.2f} | "
                  f"{r['host_us_fwd_bwd_1t']:.0f}")
        elif r.get("section") == "check":
            print(f"check {r['objective']:15s} {r['dtype']:9s} worst {r['worst']:.2e} "
                  f"second call vs first {r.get('second_call_vs_first', float('nan')):.1e} {'PASS' if r['ok'] else 'FAIL'}"
                  + (f" (the anchor is off on {r['anchor_off_by_reference']}: ours matches the float64 reference)"
                     if r.get("anchor_off_by_reference") else ""))
        elif r.get("section") == "decode":
            print(f"decode B={r['batch']}{' graphed' if r['graphed'] else ''}: {r['decode_tokens_per_s']:.0f} tok/s "
                  f"(parallel {r.get('parallel_tokens_per_s', float('nan')):.0f})")


if __name__ == "__main__":
    main()
