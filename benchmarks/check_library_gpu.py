"""Every library objective and composed structure class (``ssmcraft bench --classes``'s
``COMPOSED``) through ``obj()`` on the GPU against its float64 reference loop, in one
process: the output, the final state(s) and every gradient (initial states included), in fp32 and
bf16, at an odd length, with the family that ran named. The GPU check of the kernel families as
they are laid out and dispatched (``ssmcraft.ops.registry``).

    PYTHONUNBUFFERED=1 python3 benchmarks/check_library_gpu.py [--shape 2,67,2,32,32] [--only a,b]
    python3 benchmarks/check_library_gpu.py --tiny-decays mixed --only gated_deltanet,gla,kda_like

``--tiny-decays tiny`` (or ``mixed``) redraws every decay where a sigmoid gate reaches in training,
below 1e-6 with exact zeros (mixed: half of them ordinary, in the same chunks):
``ssmcraft.runtime.checking.tiny_decays``, what ``tests/test_kernels_tiny_decays.py`` runs on the CPU.

Each check runs in a process of its own, so that a kernel fault (an illegal memory access
poisons the CUDA context) fails that check alone. Exit status 1 when any check fails; objectives
no Triton family runs show the PyTorch path that ran (``torch-vectorised``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ssmcraft  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402
from ssmcraft.bench.classes_commands import COMPOSED, class_specs  # noqa: E402
from ssmcraft.compiler.library import library_names  # noqa: E402
from ssmcraft.runtime.checking import reference_errors, tiny_decays  # noqa: E402

from checks import TOL_CHUNKED, dtype_name  # noqa: E402


def initial_states(obj, B, H, d, m, g):
    """Random initial state(s) of the declared shapes (float64, small), a tuple with several."""
    square = set(obj.spec.square_states())
    states = []
    for x, shape in obj.state_shapes(B, H, d, m).items():
        s = 0.1 * torch.randn(*shape, generator=g, dtype=torch.float64)
        if x in square:        # a metric state stays symmetric positive definite
            s = torch.eye(shape[-1], dtype=torch.float64) + s @ s.transpose(-1, -2)
        states.append(s)
    states = tuple(states)
    return states if len(states) > 1 else states[0]


# inputs drawn inside an objective's stated stable region (its spec's summary), where the default
# draws leave it and the float64 reference itself diverges: input -> rescaling
_UNIT = {"x": lambda x: torch.nn.functional.normalize(x, dim=-1)}
STABLE_REGION = {"ttt_mlp": _UNIT, "mlp_huber_minibatch": _UNIT, "mlp_cauchy_2key": {"x": _UNIT["x"], "x2": _UNIT["x"]}}


def check(name: str, shape, dtype, device: str, decays: str = "") -> tuple[str, str, bool]:
    B, T, H, d, m = shape
    obj = ssmcraft.compile(dict(class_specs((name,)))[name])
    ins, params = random_inputs(obj, B, T, H, d, m, torch.float64, "cpu", seed=1, unit_keys=True)
    ins.update({n: f(ins[n]) for n, f in STABLE_REGION.get(name, {}).items()})
    g = torch.Generator().manual_seed(2)
    if decays:
        ins, params = tiny_decays(obj, ins, params, g, decays == "mixed")
    S0 = initial_states(obj, B, H, d, m, g)
    ins = {k: v.to(device) for k, v in ins.items()}
    params = {k: v.to(device) for k, v in params.items()}
    S0 = tuple(s.to(device) for s in S0) if isinstance(S0, tuple) else S0.to(device)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, p, s), ins, params, S0, g, dtype)
    tol = TOL_CHUNKED[dtype]
    ok = cmp.within(tol)
    worst, err = cmp.worst
    verdict = "ok" if ok else f"FAIL {cmp.over(tol)}"
    return obj.backend, f"worst {err:.2e} ({worst}) {verdict}", ok


def child(name: str, dtype, args) -> tuple[str, str, bool]:
    """One check in a fresh process: (backend, result, ok); a crash is a failed check with its last line."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{name}:{dtype_name(dtype)}", "--shape", args.shape,
           "--device", args.device, *(["--tiny-decays", args.tiny_decays] if args.tiny_decays else [])]
    run = subprocess.run(cmd, capture_output=True, text=True)
    last = (run.stdout.strip().splitlines() or [""])[-1]
    if "\t" in last:
        backend, text = last.split("\t", 1)
        return backend, text, run.returncode == 0
    err = (run.stderr.strip().splitlines() or ["no output"])[-1]
    return "-", f"FAIL (exit {run.returncode}): {err[:200]}", False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="2,67,2,32,32", help="B,T,H,d,m")
    ap.add_argument("--only", default="")
    ap.add_argument("--device", default="cuda", help="cpu checks the PyTorch paths (a smoke test of this script)")
    ap.add_argument("--one", default="", help="NAME:DTYPE: run one check in this process (what each child runs)")
    ap.add_argument("--jobs", type=int, default=1, help="checks run at once (each in its own process); printed in order")
    ap.add_argument("--tiny-decays", default="", choices=("", "tiny", "mixed"),
                    help="decays below 1e-6 with exact zeros (mixed: with ordinary ones in the same chunks)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_library_gpu: needs a CUDA device", file=sys.stderr)
        return 2
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.one:
        name, dt = args.one.split(":")
        backend, text, ok = check(name, shape, getattr(torch, dt), args.device, args.tiny_decays)
        print(f"{backend}\t{text}")
        return 0 if ok else 1
    names = [n for n in args.only.split(",") if n] or [*library_names(), *COMPOSED]
    failed = []
    print(f"{'objective':<20} {'dtype':<9} {'backend':<34} result")
    cases = [(name, dtype) for name in names for dtype in (torch.float32, torch.bfloat16)]
    # children are independent processes: several at once share the GPU while others compile
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = pool.map(lambda c: child(*c, args), cases)
        for (name, dtype), (backend, text, ok) in zip(cases, results):
            print(f"{name:<20} {dtype_name(dtype):<9} {backend:<34} {text}", flush=True)
            if not ok:
                failed.append(f"{name}/{dtype_name(dtype)}")
    print(f"{len(names) * 2 - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
