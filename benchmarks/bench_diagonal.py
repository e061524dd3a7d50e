"""GPU checks and timings of the diagonal-decay kernels (ssmcraft.ops.diagonal.chunk).

Run on the device (see BENCHMARKS.md, "Diagonal"):

    PYTHONUNBUFFERED=1 python benchmarks/bench_diagonal.py --out $OUT

Sections (``--sections``, default all, in this order):
  time     Longhorn diagonal, B=8 T=2048 H=1 K=16 V=1536 bf16: fwd and fwd+bwd (autotuned), the
           HBM floor from the copy bandwidth measured here, the mamba selective_scan anchor (ENV.md
           figure scaled by this run's copy bandwidth), every tuning candidate's time, registers
           and spills of each kernel;
  check    correctness vs the reference loop (output, final state, every gradient incl. the
           initial state's, with a final-state gradient), outputs NaN-poisoned first: fp32 and
           bf16 at B=8 T=2048, and T=1, T=4097;
  gla      GLA H=16 K=V=64 vs FLA chunk_gla (same run), plus a value cross-check with FLA;
  mamba    the mamba objective (exp(A delta) decay, a [d, m] param) at the Longhorn shape;
  naive    the naive PyTorch loop (obj.reference) at the Longhorn shape.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import ssmcraft  # noqa: E402
from checks import TOL, compare, dtype_name, reference  # noqa: E402
from common import Report, bench_ms, copy_bandwidth, floor_bytes, once_ms, random_inputs  # noqa: E402
from ssmcraft.runtime.checking import rel_rms  # noqa: E402
from ssmcraft.ops.diagonal import chunk as D  # noqa: E402

# ENV.md anchors (H100, copy bandwidth 4.22 TB/s there)
ENV_COPY_BW = 4.22e12
MAMBA_SCAN_FWD_MS, MAMBA_SCAN_FWD_BWD_MS = 0.42, 2.16
DEV = "cuda"


def scan(obj, inputs, params, S0=None, final=False, config=None):
    """The kernel in the reference's layout: S0/S_T [B, H, d, m]."""
    y, S = D.diagonal_scan(obj, {**inputs, **params}, None if S0 is None else S0.transpose(-1, -2), final, config)
    return y, (S.transpose(-1, -2) if S is not None else None)


def leaves_of(inputs, params):
    return [t for t in list(inputs.values()) + list(params.values()) if t.requires_grad]


def section_time(rep, name, shape, dtype=torch.bfloat16, bw=None, mamba_anchor=False):
    B, T, H, d, m = shape
    obj = ssmcraft.compile(name)
    inputs, params = random_inputs(obj, B, T, H, d, m, dtype, "cuda", requires_grad=True)
    leaves = leaves_of(inputs, params)
    with torch.no_grad():
        t_f = bench_ms(lambda: scan(obj, inputs, params))
    y = scan(obj, inputs, params)[0]
    dy = torch.randn_like(y)

    def fb():
        out = scan(obj, inputs, params)[0]
        torch.autograd.grad(out, leaves, dy)
    t_fb = bench_ms(fb)
    fwd_b = floor_bytes(inputs, params, y.numel(), y.element_size(), False)
    fb_b = floor_bytes(inputs, params, y.numel(), y.element_size(), True)
    row = dict(section="time", spec=name, shape=shape, dtype=str(dtype).split(".")[-1], fwd_ms=t_f, fwd_bwd_ms=t_fb,
               fwd_floor_ms=fwd_b / bw * 1e3, fwd_bwd_floor_ms=fb_b / bw * 1e3,
               fwd_x_floor=t_f / (fwd_b / bw * 1e3), fwd_bwd_x_floor=t_fb / (fb_b / bw * 1e3),
               fwd_GBps=fwd_b / t_f / 1e6, fwd_bwd_GBps=fb_b / t_fb / 1e6)
    if mamba_anchor:
        scale = ENV_COPY_BW / bw
        row.update(mamba_scan_fwd_ms=MAMBA_SCAN_FWD_MS * scale, mamba_scan_fwd_bwd_ms=MAMBA_SCAN_FWD_BWD_MS * scale,
                   fwd_x_mamba=t_f / (MAMBA_SCAN_FWD_MS * scale),
                   fwd_bwd_x_mamba=t_fb / (MAMBA_SCAN_FWD_BWD_MS * scale))
    rep.add(**row)
    for key, times in D.tuning_timings().items():
        if key[1] == obj.ir.content_hash() and key[2] == tuple(shape[:3]) + (m, d):
            for cfg, ms in times:
                rep.add(section="tune", spec=name, dir=key[0], cfg=repr(cfg), ms=ms, picked=D.tuned_configs().get(key) == cfg)
    return obj


def kernel_info(rep, out_dir, tag):
    for kname, k in D.LAUNCHED.items():
        try:
            info = dict(section="kernel", tag=tag, kernel=kname, n_regs=getattr(k, "n_regs", None),
                        n_spills=getattr(k, "n_spills", None), warps=k.metadata.num_warps if hasattr(k, "metadata") else None)
            ttgir = k.asm.get("ttgir", "") if hasattr(k, "asm") else ""
            layouts = [ln.split("=", 1)[1].strip()[:160] for ln in ttgir.splitlines() if ln.startswith("#blocked") or ln.startswith("#linear")]
            info["layouts"] = layouts[:4]
            rep.add(**info)
            if out_dir and kname in ("diagonal_fwd_main_kernel", "diagonal_bwd_main_kernel") and ttgir:
                with open(os.path.join(out_dir, f"{tag}_{kname}.ttgir"), "w") as f:
                    f.write(ttgir)
        except Exception as e:   # introspection is best-effort
            rep.add(section="kernel", tag=tag, kernel=kname, error=str(e)[:200])


def section_check(rep, name, shape, dtype, config):
    """Kernel vs the float64 reference loop on the kernel's values: y, S_T and every gradient
    (inputs, params, S0), dS_T given; outputs NaN-poisoned."""
    B, T, H, d, m = shape
    obj = ssmcraft.compile(name)
    inputs, params = random_inputs(obj, B, T, H, d, m, dtype, DEV, seed=1)
    S0 = torch.randn(B, H, d, m, device=DEV)
    cfg = D._rule_config(m, d, B, H, T) if config == "rule" else None
    ref = reference(obj, {k: v.double() for k, v in inputs.items()}, {k: v.double() for k, v in params.items()},
                    S0.double(), torch.Generator().manual_seed(2))
    D.set_poison(True)
    try:
        cmp = compare(ref, lambda i, p, s: scan(obj, i, p, s, True, cfg), dtype)
    finally:
        D.set_poison(False)
    tol = TOL[dtype]
    ok = cmp.within(tol)
    rep.add(section="check", spec=name, shape=shape, dtype=dtype_name(dtype), config=config,
            ok=ok, all_written=cmp.written, worst=cmp.worst[1], tol=tol, **cmp.errors)
    del ref
    torch.cuda.empty_cache()
    return ok


def section_gla(rep, bw, fla=True):
    B, T, H, K, V = 8, 2048, 16, 64, 64
    obj = section_time(rep, "gla", (B, T, H, V, K), bw=bw)
    if not fla:
        return
    try:
        from fla.ops.gla import chunk_gla
    except Exception as e:
        rep.add(section="gla", fla="unavailable", error=str(e)[:200])
        return
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(B, T, H, K, generator=g).cuda().bfloat16().requires_grad_(True)
    k = (torch.randn(B, T, H, K, generator=g) / math.sqrt(K)).cuda().bfloat16().requires_grad_(True)
    v = torch.randn(B, T, H, V, generator=g).cuda().bfloat16().requires_grad_(True)
    alpha = torch.sigmoid(torch.randn(B, T, H, K, generator=g) + 2.0).cuda()
    gl = torch.log(alpha).bfloat16().requires_grad_(True)
    with torch.no_grad():
        t_f = bench_ms(lambda: chunk_gla(q, k, v, gl, scale=1.0)[0])
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)

    def fb():
        o = chunk_gla(q, k, v, gl, scale=1.0)[0]
        torch.autograd.grad(o, [q, k, v, gl], do)
    t_fb = bench_ms(fb)
    ours = [r for r in rep.data["rows"] if r.get("section") == "time" and r.get("spec") == "gla"][-1]
    rep.add(section="gla", anchor="fla.chunk_gla", fla_fwd_ms=t_f, fla_fwd_bwd_ms=t_fb,
            ours_fwd_ms=ours["fwd_ms"], ours_fwd_bwd_ms=ours["fwd_bwd_ms"],
            fwd_x_fla=ours["fwd_ms"] / t_f, fwd_bwd_x_fla=ours["fwd_bwd_ms"] / t_fb)
    # values: same math (g = log alpha, no query scale)
    with torch.no_grad():
        o_fla = chunk_gla(q, k, v, gl, scale=1.0)[0]
        o_ours = scan(obj, {"x": v, "k": k, "q": q, "alpha": gl.float().exp().bfloat16()}, {})[0]
    rep.add(section="gla", crosscheck_rel_rms_vs_fla=rel_rms(o_ours, o_fla))


def section_naive(rep, shape):
    B, T, H, d, m = shape
    obj = ssmcraft.compile("longhorn_diag")
    inputs, params = random_inputs(obj, B, T, H, d, m, torch.float32, "cuda", requires_grad=True)
    with torch.no_grad():
        t_f = once_ms(lambda: obj.reference(inputs, params, None, False), reps=1)
    dy = torch.randn(B, T, H, d, device="cuda")

    def fb():
        y = obj.reference(inputs, params, None, False)[0]
        torch.autograd.grad(y, leaves_of(inputs, params), dy)
    t_fb = once_ms(fb, reps=1)
    ours = [r for r in rep.data["rows"] if r.get("section") == "time" and r.get("spec") == "longhorn_diag"]
    row = dict(section="naive", spec="longhorn_diag", anchor="obj.reference (PyTorch loop, fp32)", fwd_ms=t_f, fwd_bwd_ms=t_fb)
    if ours:
        row.update(ours_x_naive_fwd=ours[0]["fwd_ms"] / t_f, ours_x_naive_fwd_bwd=ours[0]["fwd_bwd_ms"] / t_fb)
    rep.add(**row)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="directory for diag.json and IR dumps")
    ap.add_argument("--sections", default="time,check,gla,mamba,naive")
    ap.add_argument("--no-fla", action="store_true", help="time our GLA only (FLA's autotuning compiles for minutes)")
    args = ap.parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    rep = Report("bench_diagonal")
    sections = args.sections.split(",")
    bw = copy_bandwidth("cuda")
    rep.set("copy_bandwidth_GBps", bw / 1e9)
    lh = (8, 2048, 1, 1536, 16)
    ok = True
    jobs = []
    lh_checks = [((8, 2048, 1, 1536, 16), torch.float32, "rule"), ((8, 2048, 1, 1536, 16), torch.bfloat16, "auto"),
                 ((8, 1, 1, 1536, 16), torch.float32, "rule"), ((8, 4097, 1, 1536, 16), torch.float32, "rule"),
                 ((8, 4097, 1, 1536, 16), torch.bfloat16, "rule")]
    if "time" in sections:
        jobs.append(("time", lambda: (section_time(rep, "longhorn_diag", lh, bw=bw, mamba_anchor=True),
                                      kernel_info(rep, args.out, "longhorn_bf16"))))
    if "check" in sections:
        for shape, dt, cfg in lh_checks:
            jobs.append(("check", lambda s=shape, d=dt, c=cfg: section_check(rep, "longhorn_diag", s, d, c)))
    if "naive" in sections:
        jobs.append(("naive", lambda: section_naive(rep, lh)))
    if "gla" in sections:
        jobs.append(("gla", lambda: (section_gla(rep, bw, fla=not args.no_fla), kernel_info(rep, None, "gla_bf16"))))
    if "check" in sections:
        jobs.append(("check", lambda: section_check(rep, "gla", (2, 300, 4, 64, 64), torch.bfloat16, "rule")))
    if "mamba" in sections:
        jobs.append(("mamba", lambda: section_time(rep, "mamba", lh, bw=bw, mamba_anchor=True)))
    if "check" in sections:
        jobs.append(("check", lambda: section_check(rep, "mamba", (4, 777, 2, 256, 16), torch.float32, "rule")))
        jobs.append(("check", lambda: section_check(rep, "longhorn_diag", (2, 333, 4, 100, 12), torch.float32, "rule")))
        jobs.append(("check", lambda: section_check(rep, "gla", (2, 300, 4, 64, 64), torch.float32, "rule")))
    for name, job in jobs:
        try:
            r = job()
            if r is False:
                ok = False
        except Exception as e:
            ok = False
            rep.add(section=name, error=f"{type(e).__name__}: {str(e)[:500]}")
            traceback.print_exc()
        rep.write(os.path.join(args.out, "diag.json") if args.out else None)
    rep.set("all_checks_ok", ok)
    rep.write(os.path.join(args.out, "diag.json") if args.out else None)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
