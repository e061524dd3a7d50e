"""Where a packed call's host time goes, counted on CPU: per family, one packed call (N sequences)
against the padded batch of the same sequences, forward and forward+backward, under the Triton
interpreter. Per call it counts, from ssmcraft's own code (the caller's frame under ``ssmcraft/``):

- host reads: tensor values brought to Python (``tolist``, ``item``, ``int()``, ``bool()``,
  ``float()``, ``numpy``, ``nonzero``, ``cpu``): each one waits for the GPU queue on a GPU;
- host-built tensors: ``torch.tensor(<Python data>)``, a copy from host memory per call;
- torch ops (each one kernel launch on a GPU, views and metadata not counted);
- Triton kernel launches.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/count_packed_host.py [--n 8]

The families are tried in their CUDA order (``registry.order(ir, "triton")``: the chunked WY
family ahead of the row family), as a GPU picks them. The offsets are CPU tensors here, which
``varlen.check`` reads under ``SSMCRAFT_CHECK_OFFSETS=auto``; ``SSMCRAFT_CHECK_OFFSETS=never``
counts what a call with offsets on a GPU does under ``auto``. The GPU timings of the same calls: ``benchmarks/check_varlen_gpu.py``.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import ssmcraft  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ssmcraft")
ROOT = os.path.realpath(ROOT) + os.sep
TORCH = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
READS = {"tolist", "item", "__int__", "__index__", "__bool__", "__float__", "numpy", "nonzero", "cpu"}
FREE = {"__get__", "__set__", "size", "dim", "numel", "stride", "data_ptr", "is_contiguous", "element_size",
        "__len__", "__repr__", "__format__", "__hash__", "__eq__", "dtype", "device", "shape", "requires_grad",
        "is_floating_point", "storage_offset", "untyped_storage", "__torch_function__", "grad_fn",
        "view", "reshape", "__getitem__", "unsqueeze", "squeeze", "transpose", "expand", "contiguous",
        "split", "unbind", "chunk", "t", "permute", "flatten", "unflatten", "narrow", "select", "detach",
        "requires_grad_", "_is_view", "is_complex", "get_device", "__iter__"}


def _from_ssmcraft() -> str | None:
    """The first frame outside torch: its file when it is ssmcraft's, else None."""
    f = sys._getframe(2)
    while f is not None and os.path.realpath(f.f_code.co_filename).startswith(TORCH):
        f = f.f_back
    path = os.path.realpath(f.f_code.co_filename) if f is not None else ""
    return path if path.startswith(ROOT) else None


class Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.c = collections.Counter()
        self.where = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        where = _from_ssmcraft()
        if where is not None:
            if name in READS:
                self.c["host reads"] += 1
                f = sys._getframe(1)
                while f is not None and not os.path.realpath(f.f_code.co_filename).startswith(ROOT):
                    f = f.f_back
                self.where[f"{os.path.relpath(f.f_code.co_filename, ROOT)}:{f.f_code.co_name} {name}"] += 1
            elif name == "tensor" and args and not isinstance(args[0], torch.Tensor):
                self.c["host-built tensors"] += 1
            elif name not in FREE:
                self.c["torch ops"] += 1
        return func(*args, **kwargs)


def _count_launches():
    from triton.runtime.interpreter import InterpretedFunction
    counter = {"n": 0}
    run = InterpretedFunction.run

    def counted(self, *a, **k):
        counter["n"] += 1
        return run(self, *a, **k)
    InterpretedFunction.run = counted
    return counter


def one(obj, ins, params, kw, backward: bool, launches) -> dict:
    leaves = {k: v.detach().requires_grad_(backward) for k, v in ins.items()}
    obj(leaves, params, None, False, **kw)             # the first call picks the path and compiles
    launches["n"] = 0
    with Count() as c:
        y, _ = obj(leaves, params, None, False, **kw)
        if backward:
            y.float().sum().backward()
    return {**c.c, "triton launches": launches["n"], "where": dict(c.where), "backend": obj.backend}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8, help="sequences in the packed row")
    ap.add_argument("--names", default="mamba,gla,gated_deltanet")
    args = ap.parse_args(argv)
    launches = _count_launches()
    from ssmcraft.ops import registry
    from ssmcraft.runtime import select
    select.order = lambda ir, mode: registry.order(ir, "triton")
    lens = [(37 * (i + 1)) % 90 + 1 for i in range(args.n)]
    H, D, M = 2, 16, 16
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    print(f"N = {args.n} sequences, lengths {lens}, H={H} d={D} m={M}, fp32, TRITON_INTERPRET=1, "
          f"SSMCRAFT_CHECK_OFFSETS={os.environ.get('SSMCRAFT_CHECK_OFFSETS', 'auto')}")
    print(f"{'call':28s} {'host reads':>10s} {'host-built':>10s} {'torch ops':>9s} {'launches':>8s}  backend")
    for name in args.names.split(","):
        obj = ssmcraft.compile(name)
        obj.prefer = "interpret"
        ins, params = random_inputs(obj, len(lens), max(lens), H, D, M, torch.float32, "cpu", seed=4)
        packed = {k: torch.cat([v[i, :n] for i, n in enumerate(lens)])[None].contiguous() for k, v in ins.items()}
        for label, x, kw in (("packed", packed, {"cu_seqlens": cu}), ("padded", ins, {})):
            for bwd in (False, True):
                r = one(obj, x, params, kw, bwd, launches)
                call = f"{name} {label} {'fwd+bwd' if bwd else 'fwd'}"
                print(f"{call:28s} {r.get('host reads', 0):10d} {r.get('host-built tensors', 0):10d} "
                      f"{r.get('torch ops', 0):9d} {r['triton launches']:8d}  {r['backend']}")
                for w, n in r["where"].items():
                    print(f"{'':30s}{n} x {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
