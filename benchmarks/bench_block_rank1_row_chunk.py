"""GPU checks and timings of the chunked block rank-1 family (``ssmcraft.ops.block_rank1_row_chunk``)
beside the per-token one (``block_rank1_row``), in one process:

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_block_rank1_row_chunk.py [--shape 8,2048,16,64,64]
        [--configs default,ATOMIC_SUMS=0+STATES_BF16=0,SPLIT_BWD=1] [--no-check] [--no-per-token]
    TRITON_INTERPRET=1 python3 benchmarks/bench_block_rank1_row_chunk.py --tiny   (the checks on CPU, small)

1. Correctness (``--check``, default on), this family forced (``chunk.AHEAD = True``) at the first
   config: Longhorn with momentum through ``obj()`` at B=2, T=1000 (the last chunk cut to 8 tokens), H=2,
   d=m=64, fp32 and bf16: output, both final states and every gradient (inputs, both initial states)
   against the derived update's float64 reference, outputs poisoned with NaN; and the public function's
   general form (four distinct keys, a full per-head transition, per-row c and per-head p) in fp32
   against the readable loop (``block_rank1_row``'s ``naive.py``) under float64 autograd.
2. Timings through ``obj()``, bf16, at ``--shape`` (``bench.classes_commands.measure``: fwd, fwd+bwd):
   DeltaNet and Longhorn (the anchors), Longhorn with momentum on ``block_rank1_row`` (``AHEAD = False``)
   and on this family (``AHEAD = True``) at each (rows per program, num_warps, chunk, ``weights.HOW``)
   config (module constants of ``chunk.py`` or ``weights.py`` set by name, ``+``-joined; ``default``: none
   changed), the first one's kernel profile (GPU us per fwd+bwd, the weights included). What decides
   ``AHEAD`` and the constants (``ROWS``, ``NUM_WARPS``, ``CHUNK``, ``SPLIT_BWD``, ``ATOMIC_SUMS``, ``HOW``, ...).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import timing_table  # noqa: E402
from checks import TOL_CHUNKED, dtype_name, reference_errors, summary  # noqa: E402

import ssmcraft  # noqa: E402
from ssmcraft.bench.classes_commands import measure  # noqa: E402
from ssmcraft.bench.run import random_inputs, random_state  # noqa: E402
from ssmcraft.ops.block_rank1_row.naive import naive_block_rank1  # noqa: E402
from ssmcraft.ops.block_rank1_row_chunk import chunk as CH  # noqa: E402
from ssmcraft.ops.block_rank1_row_chunk import weights as W  # noqa: E402
from ssmcraft.runtime.checking import rel_rms  # noqa: E402


def _parse(cfg: str) -> dict:
    """``NAME=VALUE+NAME=VALUE`` (``default``: {}) -> {name: value}, each name a constant of ``chunk.py`` or
    ``weights.py``, values int where they parse as one."""
    out = {}
    for item in (x for x in cfg.split("+") if x and x != "default"):
        name, _, val = item.partition("=")
        if not hasattr(CH, name) and not hasattr(W, name):
            raise SystemExit(f"bench_block_rank1_row_chunk.py: --configs: no constant {name!r} in chunk.py or "
                             "weights.py")
        out[name] = int(val) if val.lstrip("-").isdigit() else val
    return out


def _set(cfg: dict):
    for name, val in cfg.items():
        setattr(CH if hasattr(CH, name) else W, name, val)


def check_obj(dtype, dev, T, d) -> bool:
    """Longhorn with momentum through ``obj()`` on this family against float64 (module docstring, 1.)."""
    obj = ssmcraft.compile("momentum_longhorn")
    obj.prefer = "interpret" if dev == "cpu" else "triton"
    B, H, m = 2, 2, d
    ins, params = random_inputs(obj, B, T, H, d, m, torch.float64, torch.device(dev), seed=1)
    S0 = tuple(0.5 * s.double() for s in random_state(obj, B, H, d, m, dev, seed=2))
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s, True), ins, params, S0,
                           torch.Generator().manual_seed(3), dtype=dtype)
    ok = cmp.within(TOL_CHUNKED[dtype]) and "block-rank1-row-chunk" in obj.backend
    print(f"check momentum_longhorn {dtype_name(dtype)} via {obj.backend}: {summary(cmp, TOL_CHUNKED[dtype])}; "
          + ", ".join(f"{k} {v:.1e}" for k, v in cmp.errors.items()), flush=True)
    return ok


def check_general(dev, T, K) -> bool:
    """The public function's general form in fp32 against the readable loop in float64 (module docstring, 1.)."""
    g = torch.Generator().manual_seed(5)
    B, H, V = 1, 2, K
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dev)  # noqa: E731
    u01 = lambda lo, hi: (lo + (hi - lo) * torch.rand(B, T, H, generator=g, dtype=torch.float64)).to(dev)  # noqa: E731
    keys = [torch.nn.functional.normalize(r(B, T, H, K), dim=-1) for _ in range(3)] + [r(B, T, H, K)]
    heads = {"a00": u01(0.2, 0.8), "a01": u01(0., 0.2), "a10": u01(0.2, 0.8), "a11": u01(0.5, 1.), "e0": u01(0.2, 0.8),
             "e1": u01(0.5, 1.), "w0": u01(0.5, 1.), "w1": 0.5, "ro0": u01(0., 1.), "ro1": 1.0}
    c = torch.rand(B, T, H, V, generator=g, dtype=torch.float64).to(dev)
    p, S0 = r(B, T, H), [r(B, H, K, V) for _ in range(2)]
    dy, dS = r(B, T, H, V), [r(B, H, K, V) for _ in range(2)]
    hv = [s for s, x in heads.items() if isinstance(x, torch.Tensor)]
    leaves = [*keys, *[heads[s] for s in hv], c, p, *S0]
    names = ["u", "v", "q", "oq", *hv, "c", "p", "X0", "X1"]
    res = []
    for naive, dt in ((True, torch.float64), (False, torch.float32)):
        xs = [x.detach().to(dt).requires_grad_() for x in leaves]
        hd = {**heads, **dict(zip(hv, xs[4:4 + len(hv)]))}
        if naive:
            row = lambda x: x[..., None] if x.dim() == 4 else x[..., None, None]  # noqa: E731
            co = {s: row(x) if isinstance(x, torch.Tensor) else x for s, x in {**hd, "c": xs[-4], "p": xs[-3]}.items()}
            co.update({s: x[..., None, :] for s, x in zip(("u", "v", "q", "oq"), xs[:4])})
            co["oc"] = 1.0
            y, S = naive_block_rank1(co, 2, tuple(s.transpose(-1, -2) for s in xs[-2:]))
            S = tuple(s.transpose(-1, -2) for s in S)
        else:
            y, S = CH.block_rank1_chunk(*xs[:4], xs[-4], xs[-3], hd, initial_state=xs[-2:], output_final_state=True)
        loss = (y.double() * dy).sum() + sum((s.double() * d).sum() for s, d in zip(S, dS))
        res.append((y, S, torch.autograd.grad(loss, xs)))
    (yr, Sr, gr), (y, S, gg) = res
    errs = {"y": rel_rms(y, yr), "X0_T": rel_rms(S[0], Sr[0]), "X1_T": rel_rms(S[1], Sr[1])}
    errs.update({f"d{n}": rel_rms(a, b) for n, a, b in zip(names, gg, gr)})
    ok = all(v < TOL_CHUNKED[torch.float32] for v in errs.values())
    print(f"check public general form fp32: {'ok' if ok else 'FAIL'}; "
          + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,2048,16,64,64", help="B,T,H,d,m")
    ap.add_argument("--configs", default="default,ATOMIC_SUMS=0+STATES_BF16=0,SPLIT_BWD=1",
                    help="settings of this family, comma-separated, each NAME=VALUE+... of chunk.py/weights.py "
                    "constants or 'default'; the first also runs the checks and the profile")
    ap.add_argument("--no-per-token", dest="per_token", action="store_false",
                    help="leave out the row on block_rank1_row (AHEAD = False)")
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--tiny", action="store_true", help="the checks only, on CPU under TRITON_INTERPRET=1, small")
    args = ap.parse_args(argv)
    if args.tiny:
        from ssmcraft.ops import registry
        from ssmcraft.runtime import select
        # the interpreter keeps the registry's order (block_rank1_row first): this family alone
        select.order = lambda ir, mode: [registry.family("block_rank1_row_chunk")]
        CH.POISON, CH.ROWS = True, 16
        ok = check_obj(torch.float32, "cpu", 21, 16) & check_general("cpu", 21, 16)
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("bench_block_rank1_row_chunk.py needs a CUDA device")
        return 2
    shape = tuple(int(x) for x in args.shape.split(","))
    names = [c for c in args.configs.split(",") if c]
    configs = [_parse(c) for c in names]
    default = {name: getattr(CH if hasattr(CH, name) else W, name) for c in configs for name in c}
    ok = True
    if args.check:
        CH.AHEAD, CH.POISON = True, True
        _set(configs[0])
        for dtype in (torch.float32, torch.bfloat16):
            ok &= check_obj(dtype, "cuda", 1000, 64)
        ok &= check_general("cuda", 1000, 64)
        CH.AHEAD, CH.POISON = False, False
        _set(default)
        torch.cuda.empty_cache()
    rows = []
    runs = [("deltanet", "deltanet", None, False), ("longhorn", "longhorn", None, False)]
    if args.per_token:
        runs.append(("momentum_longhorn AHEAD=False", "momentum_longhorn", None, False))
    runs += [(f"momentum_longhorn AHEAD=True {n}", "momentum_longhorn", c, True) for n, c in zip(names, configs)]
    for label, spec, cfg, ahead in runs:
        CH.AHEAD = ahead
        if cfg is not None:
            _set(cfg)
        try:
            row = measure(label, spec, shape, torch.bfloat16, profile=cfg is configs[0])
        except Exception as e:  # noqa: BLE001: one failure is a row of the table
            row = {"spec": label, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        finally:
            CH.AHEAD = False
            _set(default)
        rows.append(row)
        print({k: v for k, v in row.items() if k != "kernels"}, flush=True)
        for name, n, us in row.get("kernels", [])[:12]:
            print(f"    {us:9.1f} us  x{n}  {name[:90]}", flush=True)
        torch.cuda.empty_cache()
    ref = {r["spec"]: r["fwd_bwd_ms"] for r in rows if "fwd_bwd_ms" in r}
    timing_table(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B,T,H,d,m = {args.shape}, bf16",
                 rows, [("run", "spec"), ("backend", "backend"), ("fwd ms", "fwd_ms"), ("fwd+bwd ms", "fwd_bwd_ms")],
                 {"x DeltaNet": ref.get("deltanet"), "x Longhorn": ref.get("longhorn")})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
