"""Diagnose rank1_chunk at small key dims on the GPU (the K < 32 refusal in ``supports_sizes``).

    python3 benchmarks/diag_rank1_smallk.py [K ...]      (checks; each case with CUDA_LAUNCH_BLOCKING=1)
    python3 benchmarks/diag_rank1_smallk.py --time       (fwd+bwd at the 20M byte LM's shape)

Each case runs in its own process (an illegal memory access poisons the CUDA context): DeltaNet
through ``rank1_chunk.delta_rule`` at B2 T300 H2 V64, fp32 and bf16, against a float64 loop on the
same leaves (output, final state, dq, dk, dx, dbeta, dS0), outputs NaN-poisoned first.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch


def loop(q, k, x, beta, h0):
    q, k, x, beta, S = (t.double() for t in (q, k, x, beta, h0))
    ys = []
    for t in range(q.shape[1]):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        S = S - bt * kt[..., :, None] * (kt[..., None, :] @ S) + bt * kt[..., :, None] * x[:, t, :, None, :]
        ys.append((q[:, t, :, None, :] @ S)[..., 0, :])
    return torch.stack(ys, 1), S


def case(K: int, dtype: str) -> dict:
    from ssmcraft.kernels import rank1_chunk as R
    R.POISON = True
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 2, 300, 2, 64
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    x = torch.randn(B, T, H, V, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    h0 = torch.randn(B, H, K, V, generator=g)
    leaves = [t.to("cuda", dt).requires_grad_(True) for t in (q, k, x, beta)]
    s0 = h0.cuda().requires_grad_(True)
    o, ht = R.delta_rule(*leaves, initial_state=s0, output_final_state=True)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [*leaves, s0])
    torch.cuda.synchronize()
    ref = [t.double().cpu().requires_grad_(True) for t in (q, k, x, beta, h0)]
    ref[:4] = [t.to(dt).double().detach().requires_grad_(True) for t in ref[:4]]
    yr, Sr = loop(*ref)
    rg = torch.autograd.grad((yr * do.cpu().double()).sum() + (Sr * dht.cpu().double()).sum(), ref)
    out = {}
    for name, a, b in [("y", o, yr), ("S_T", ht, Sr), *zip(("dq", "dk", "dx", "dbeta", "dS0"), grads, rg)]:
        a = a.double().cpu()
        out[name] = float("nan") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()
    return out


def timing():
    """DeltaNet fwd+bwd at the 20M byte LM's shape (B16 T512 H1 K16 V512, bf16): the chunked kernel
    against ``obj()`` (whatever family it picks) and FLA's recurrent kernel when importable."""
    from triton.testing import do_bench

    import ssmcraft
    from ssmcraft.kernels import rank1_chunk as R
    B, T, H, K, V = 16, 512, 1, 16, 512
    dt = torch.bfloat16
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=dt) for _ in range(2))
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(dt)
    x = torch.randn(B, T, H, V, device="cuda", dtype=dt)
    beta = torch.rand(B, T, H, device="cuda", dtype=dt)
    leaves = [t.requires_grad_(True) for t in (q, k, x, beta)]
    dy = torch.randn(B, T, H, V, device="cuda", dtype=dt)
    obj = ssmcraft.compile("deltanet")
    rows = {"rank1_chunk.delta_rule": lambda: R.delta_rule(*leaves)[0],
            "obj()": lambda: obj(dict(q=q, k=k, x=x, beta=beta))[0]}
    try:
        from fla.ops.delta_rule import fused_recurrent_delta_rule
        rows["FLA fused_recurrent"] = lambda: fused_recurrent_delta_rule(q, k, x, beta, scale=1.0)[0]
    except ImportError as e:
        print(f"# FLA unavailable: {e}")
    for name, f in rows.items():
        f()
        fb = do_bench(lambda: torch.autograd.grad(f(), leaves, dy), rep=200)
        with torch.no_grad():
            fw = do_bench(f, rep=200)
        extra = f" ({obj.backend})" if name == "obj()" else ""
        print(f"B{B} T{T} H{H} K{K} V{V} bf16 {name}{extra}: fwd {fw:.3f} ms, fwd+bwd {fb:.3f} ms")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--time":
        timing()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        print(json.dumps(case(int(sys.argv[2]), sys.argv[3])))
        return
    Ks = [int(a) for a in sys.argv[1:]] or [16, 32, 64]
    for K in Ks:
        for dtype in ("float32", "bfloat16"):
            r = subprocess.run([sys.executable, __file__, "--case", str(K), dtype], capture_output=True, text=True,
                               env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
            if r.returncode == 0:
                res = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"K={K:3d} {dtype:9s} " + " ".join(f"{n} {v:.1e}" for n, v in res.items()))
            else:
                err = [ln for ln in r.stderr.splitlines() if "File" in ln and "ssmcraft" in ln or "Error" in ln][-8:]
                print(f"K={K:3d} {dtype:9s} FAILED rc={r.returncode}:\n    " + "\n    ".join(err))


if __name__ == "__main__":
    main()
