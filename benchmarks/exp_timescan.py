"""Experiment: a lanes-along-time diagonal scan (Mamba objective forward) against ours and selective_scan.

    PYTHONUNBUFFERED=1 python3 benchmarks/exp_timescan.py [--mamba DIR] [--tiny]

Math (Mamba objective, H = 1): S_t[d, m] = exp(delta_t[d] A[d, m]) S_{t-1}[d, m] + delta_t[d] x_t[d] k_t[m],
y_t[d] = sum_m S_t[d, m] q_t[m]. Inputs [B, T, 1, n] in their own dtype, A [1, d, m] fp32.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@triton.jit
def _combine(a1, b1, a2, b2):
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _program(D, N: tl.constexpr, BD: tl.constexpr, CT: tl.constexpr):
    """(batch, value offsets [BD], step offsets [CT], key offsets [N], value mask) of this program."""
    od = tl.program_id(0) * BD + tl.arange(0, BD)
    return tl.program_id(1), od, tl.arange(0, CT), tl.arange(0, N), od < D


@triton.jit
def fwd_2d(x_ptr, dt_ptr, k_ptr, q_ptr, A_ptr, y_ptr, hT_ptr, T, D,
           N: tl.constexpr, BD: tl.constexpr, CT: tl.constexpr, TMAJOR: tl.constexpr):
    """One program per (value block, batch); chunks of CT steps in order; per key a [BD, CT] scan.
    TMAJOR: x, delta, y are [B, D, T] and k, q [B, N, T] (time contiguous, so time runs along lanes);
    else the [B, T, D] / [B, T, N] layouts the tensors arrive in."""
    b, od, ot, on, dm = _program(D, N, BD, CT)
    h = tl.zeros([BD, N], tl.float32)
    for c in range(0, T, CT):
        t = c + ot
        tm = t < T
        m2 = dm[:, None] & tm[None, :]
        if TMAJOR:
            off = b * T * D + od[:, None] * T + t[None, :]
        else:
            off = b * T * D + t[None, :] * D + od[:, None]
        x = tl.load(x_ptr + off, mask=m2, other=0).to(tl.float32)
        dt = tl.load(dt_ptr + off, mask=m2, other=0).to(tl.float32)
        u = dt * x
        y = tl.zeros([BD, CT], tl.float32)
        for n in tl.static_range(N):
            An = tl.load(A_ptr + od * N + n, mask=dm, other=0)
            if TMAJOR:
                koff = b * T * N + n * T + t
            else:
                koff = b * T * N + t * N + n
            kn = tl.load(k_ptr + koff, mask=tm, other=0).to(tl.float32)
            qn = tl.load(q_ptr + koff, mask=tm, other=0).to(tl.float32)
            a = tl.exp(dt * An[:, None])
            bb = u * kn[None, :]
            hn = tl.sum(tl.where(on[None, :] == n, h, 0.0), axis=1)
            bb = tl.where(ot[None, :] == 0, bb + a * hn[:, None], bb)
            _, s = tl.associative_scan((a, bb), axis=1, combine_fn=_combine)
            y += s * qn[None, :]
            last = tl.sum(tl.where(ot[None, :] == CT - 1, s, 0.0), axis=1)
            h = tl.where(on[None, :] == n, last[:, None], h)
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=m2)
    tl.store(hT_ptr + b * N * D + on[None, :] * D + od[:, None], h, mask=dm[:, None])


@triton.jit
def fwd_3d(x_ptr, dt_ptr, k_ptr, q_ptr, A_ptr, y_ptr, hT_ptr, T, D,
           N: tl.constexpr, BD: tl.constexpr, CT: tl.constexpr):
    """As fwd_2d, with all keys in one [BD, N, CT] tile."""
    b, od, ot, on, dm = _program(D, N, BD, CT)
    A = tl.load(A_ptr + od[:, None] * N + on[None, :], mask=dm[:, None], other=0)      # [BD, N]
    h = tl.zeros([BD, N], tl.float32)
    for c in range(0, T, CT):
        t = c + ot
        tm = t < T
        m2 = dm[:, None] & tm[None, :]
        off = b * T * D + t[None, :] * D + od[:, None]
        x = tl.load(x_ptr + off, mask=m2, other=0).to(tl.float32)
        dt = tl.load(dt_ptr + off, mask=m2, other=0).to(tl.float32)
        koff = b * T * N + t[None, :] * N + on[:, None]                                 # [N, CT]
        k = tl.load(k_ptr + koff, mask=tm[None, :], other=0).to(tl.float32)
        q = tl.load(q_ptr + koff, mask=tm[None, :], other=0).to(tl.float32)
        a = tl.exp(dt[:, None, :] * A[:, :, None])                                      # [BD, N, CT]
        bb = (dt * x)[:, None, :] * k[None, :, :]
        bb = tl.where(ot[None, None, :] == 0, bb + a * h[:, :, None], bb)
        _, s = tl.associative_scan((a, bb), axis=2, combine_fn=_combine)
        y = tl.sum(s * q[None, :, :], axis=1)
        h = tl.sum(tl.where(ot[None, None, :] == CT - 1, s, 0.0), axis=2)
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=m2)
    tl.store(hT_ptr + b * N * D + on[None, :] * D + od[:, None], h, mask=dm[:, None])


def run_tmajor(x, dt, k, q, A, BD, CT, warps):
    """Transposes to time-major, runs fwd_2d on it, transposes y back (all of it timed)."""
    B, T, _, D = x.shape
    N = k.shape[-1]
    xt, dtt = (z[:, :, 0].transpose(1, 2).contiguous() for z in (x, dt))
    kt, qt = (z[:, :, 0].transpose(1, 2).contiguous() for z in (k, q))
    y = torch.empty_like(xt)
    hT = torch.full((B, 1, N, D), float("nan"), device=x.device)
    fwd_2d[(triton.cdiv(D, BD), B)](xt, dtt, kt, qt, A, y, hT, T, D, N=N, BD=BD, CT=CT, TMAJOR=True, num_warps=warps)
    return y.transpose(1, 2)[:, :, None], hT


def name(kernel) -> str:
    return "fwd_2d time-major" if kernel == "tmajor" else kernel.fn.__name__


def run(kernel, x, dt, k, q, A, BD, CT, warps):
    if kernel == "tmajor":
        return run_tmajor(x, dt, k, q, A, BD, CT, warps)
    B, T, _, D = x.shape
    N = k.shape[-1]
    y = torch.full_like(x, float("nan"))
    hT = torch.full((B, 1, N, D), float("nan"), device=x.device)
    extra = {"TMAJOR": False} if kernel is fwd_2d else {}
    kernel[(triton.cdiv(D, BD), B)](x, dt, k, q, A, y, hT, T, D, N=N, BD=BD, CT=CT, num_warps=warps, **extra)
    return y, hT


def loop(x, dt, k, q, A):
    x, dt, k, q = (t.double()[:, :, 0] for t in (x, dt, k, q))
    A = A.double()[0]
    B, T, D = x.shape
    S = torch.zeros(B, D, A.shape[1], dtype=torch.float64, device=x.device)
    ys = []
    for t in range(T):
        S = torch.exp(dt[:, t, :, None] * A) * S + (dt[:, t] * x[:, t])[:, :, None] * k[:, t, None, :]
        ys.append((S * q[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1)[:, :, None], S.transpose(1, 2)[:, None]


def inputs(B, T, D, N, dtype, dev):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(B, T, 1, D, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(B, T, 1, D, generator=g) - 2)
    k = torch.randn(B, T, 1, N, generator=g)
    q = torch.randn(B, T, 1, N, generator=g)
    A = -torch.arange(1, N + 1).float().expand(1, D, N).contiguous()
    return [t.to(dev, dtype) for t in (x, dt, k, q)] + [A.to(dev)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--mamba")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    # correctness, odd sizes
    for kern in (fwd_2d, fwd_3d, "tmajor"):
        x, dt, k, q, A = inputs(2, 37, 20, 16, torch.float32, dev)
        y, h = run(kern, x, dt, k, q, A, 4 if args.tiny else 8, 16, 4)
        yr, hr = loop(x, dt, k, q, A)
        print(f"check {name(kern)}: y {rel(y, yr):.2e} hT {rel(h, hr):.2e}")
    if args.tiny:
        return
    from triton.testing import do_bench
    import ssmcraft
    from benchmarks.bench_public_path import SelectiveScan, load_mamba, mamba_layout
    B, T, D, N = 8, 2048, 1536, 16
    x, dt, k, q, A = inputs(B, T, D, N, torch.bfloat16, dev)
    obj = ssmcraft.compile("mamba")
    ins = dict(x=x, k=k, q=q, delta=dt)
    ps = dict(A=A)
    with torch.no_grad():
        yo, ho = obj(ins, ps, None, True)
    print(f"ours (obj, {obj.backend}): {do_bench(lambda: obj(ins, ps, None, True), rep=200):.3f} ms")
    ssc = load_mamba(args.mamba)
    if ssc is not None:
        sargs = mamba_layout(ins, dict(A=A[0]))
        print(f"selective_scan fwd: {do_bench(lambda: SelectiveScan.apply(ssc, *sargs), rep=200):.3f} ms")
    for kern, BD, CT, w in [("tmajor", 1, 256, 1), ("tmajor", 2, 256, 2), ("tmajor", 4, 256, 4),
                            ("tmajor", 1, 512, 2), ("tmajor", 2, 512, 4), ("tmajor", 4, 128, 2),
                            ("tmajor", 8, 128, 4), ("tmajor", 1, 1024, 4), ("tmajor", 2, 128, 1),
                            (fwd_2d, 16, 64, 4), (fwd_2d, 16, 128, 4), (fwd_2d, 8, 128, 4), (fwd_2d, 32, 64, 4),
                            (fwd_2d, 16, 256, 8), (fwd_2d, 32, 128, 8), (fwd_2d, 64, 64, 8), (fwd_2d, 8, 256, 4),
                            (fwd_3d, 4, 64, 4), (fwd_3d, 8, 64, 8), (fwd_3d, 2, 128, 4), (fwd_3d, 4, 128, 8),
                            (fwd_3d, 8, 32, 4), (fwd_3d, 16, 32, 8)]:
        try:
            y, h = run(kern, x, dt, k, q, A, BD, CT, w)
            e = max(rel(y, yo), rel(h.transpose(-1, -2), ho))
            ms = do_bench(lambda: run(kern, x, dt, k, q, A, BD, CT, w), rep=200)
            print(f"{name(kern)} BD{BD} CT{CT} w{w}: {ms:.3f} ms (vs ours {e:.1e})")
        except Exception as ex:  # noqa: BLE001
            print(f"{name(kern)} BD{BD} CT{CT} w{w}: failed {type(ex).__name__}: {str(ex)[:200]}")


if __name__ == "__main__":
    main()
