"""The public path of every library objective whose computed slots come from the fused prologue
(``ssmcraft.kernels.prologue``), on the GPU: ``obj(...)`` against the float64 reference loop on
the same leaves, output, final state and every gradient (inputs, params, initial state), in fp32
and bf16, every kernel output NaN-poisoned first; each case is run twice (the second call goes
through the direct launches of ``ssmcraft.kernels.launch``) and both calls are checked.

GPU:  python3 benchmarks/check_prologue.py
CPU:  TRITON_INTERPRET=1 python3 benchmarks/check_prologue.py --tiny   (smoke test of the script)

Prints one line per (objective, dtype, call) with the worst relative RMS error and where; exits 1
if one is over tolerance (fp32 1e-4, bf16 2e-2) or an output was left unwritten.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import all_written, device_name, random_inputs, rel_rms  # noqa: E402

import ssmcraft  # noqa: E402
from ssmcraft.kernels import keydecay_chunk, prologue, rank1_chunk, rank1_row  # noqa: E402

OBJECTIVES = ["longhorn", "gated_longhorn", "wd_longhorn", "gated_deltanet", "hgrn"]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def check(name, dtype, B, T, H, d, m, dev, interpret):
    obj = ssmcraft.compile(name)
    obj.prefer = "interpret" if interpret else "triton"
    ins, params = random_inputs(obj, B, T, H, d, m, torch.float64, dev, seed=3)
    if "k" in ins and name != "hgrn":
        ins["k"] = torch.nn.functional.normalize(ins["k"], dim=-1)
    ins = {k: v.to(dtype).double() for k, v in ins.items()}          # the values the kernel sees
    S0 = 0.5 * torch.randn(B, H, d, m, device=dev, dtype=torch.float64)
    g = torch.Generator(device="cpu").manual_seed(1)
    leaves_ref = {**{k: v.clone().requires_grad_() for k, v in ins.items()},
                  **{k: v.double().clone().requires_grad_() for k, v in params.items()}}
    s0_ref = S0.clone().requires_grad_()
    y_ref, S_ref = obj.reference({k: leaves_ref[k] for k in ins}, {k: leaves_ref[k] for k in params}, s0_ref, True)
    dy = torch.randn(y_ref.shape, generator=g, dtype=torch.float64).to(dev)
    dS = torch.randn(S_ref.shape, generator=g, dtype=torch.float64).to(dev)
    ref = dict(zip([*leaves_ref, "S0"], torch.autograd.grad((y_ref * dy).sum() + (S_ref * dS).sum(),
                                                             [*leaves_ref.values(), s0_ref])))
    rows = []
    for call in (1, 2):
        lv = {**{k: v.to(dtype).requires_grad_() for k, v in ins.items()},
              **{k: v.float().clone().requires_grad_() for k, v in params.items()}}
        s0 = S0.float().requires_grad_()
        y, S = obj({k: lv[k] for k in ins}, {k: lv[k] for k in params}, s0, True)
        got = dict(zip([*lv, "S0"], torch.autograd.grad((y.double() * dy).sum() + (S.double() * dS).sum(),
                                                        [*lv.values(), s0])))
        errs = {"y": rel_rms(y, y_ref), "S_T": rel_rms(S, S_ref)}
        errs.update({f"d{k}": rel_rms(got[k], ref[k]) for k in ref})
        worst = max(errs, key=lambda k: errs[k] if errs[k] == errs[k] else float("inf"))
        ok = all(e <= TOL[dtype] for e in errs.values()) and all_written(y, S, *got.values())
        rows.append(ok)
        print(f"{name:15s} {str(dtype).split('.')[-1]:9s} call {call}  {obj.backend:32s} worst {errs[worst]:.2e} "
              f"({worst})  {'ok' if ok else 'FAIL'}")
    return all(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small shapes under the interpreter (CPU)")
    args = ap.parse_args()
    interpret = args.tiny
    dev = "cpu" if args.tiny else "cuda"
    for mod in (prologue, rank1_row, rank1_chunk, keydecay_chunk):
        mod.POISON = True
    B, T, H, d, m = (1, 7, 2, 8, 4) if args.tiny else (2, 301, 3, 64, 16)
    print(f"check_prologue on {device_name()}, B={B} T={T} H={H} d={d} m={m}")
    ok = True
    for name in OBJECTIVES:
        for dtype in (torch.float32, torch.bfloat16):
            if interpret and dtype == torch.bfloat16 and name == "hgrn":
                # the interpreter runs the key-decay kernels wrong on bf16 inputs (GLA too, 1e10 off,
                # while the GPU matches FLA to 3e-3: BENCHMARKS.md): checked on the GPU only
                print(f"{name:15s} bfloat16  not checked under the interpreter (key-decay kernels, bf16)")
                continue
            ok &= check(name, dtype, B, T, H, d, m, dev, interpret)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
