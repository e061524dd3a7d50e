"""Build mamba's CUDA ``selective_scan`` (the anchor of ``bench_public_path.py`` and
``bench_train_mixers.py``) from a mamba checkout, for sm_90, fp32 and bf16 inputs, real weights.

    python3 benchmarks/mamba_build.py MAMBA_CHECKOUT OUT_DIR     # ~90 s on 16 cores
    python3 benchmarks/bench_public_path.py --mamba OUT_DIR

mamba's sources are not part of this repository: pass a checkout of state-spaces/mamba. Its
``csrc/selective_scan`` is copied to ``OUT_DIR/csrc`` and trimmed to what the benchmarks use
(the fp16 and complex-weight instantiations are dropped from the dispatch and not compiled, which
halves the build), then built with ``torch.utils.cpp_extension.load`` and mamba's own nvcc flags.
"""
from __future__ import annotations

import glob
import os
import shutil
import sys
import time


def trim(csrc: str) -> None:
    """Drop the fp16 and complex-weight variants (files and dispatch branches)."""
    for f in set(glob.glob(os.path.join(csrc, "*fp16*")) + glob.glob(os.path.join(csrc, "*complex*"))):
        os.remove(f)
    for f in glob.glob(os.path.join(csrc, "selective_scan_fwd_*.cu")):
        lines = [line for line in open(f).read().splitlines() if "complex_t>" not in line]
        open(f, "w").write("\n".join(lines) + "\n")
    cpp = os.path.join(csrc, "selective_scan.cpp")
    s = open(cpp).read()
    half = ("    if (ITYPE == at::ScalarType::Half) {                                            \\\n"
            "        using input_t = at::Half;                                                   \\\n"
            "        __VA_ARGS__();                                                              \\\n"
            "    } else if (ITYPE == at::ScalarType::BFloat16) {")
    cplx = ("    } else if (WTYPE == at::ScalarType::ComplexFloat) {                              \\\n"
            "        using weight_t = c10::complex<float>;                                        \\\n"
            "        __VA_ARGS__();                                                               \\\n"
            "    } else {")
    if half not in s or cplx not in s:
        raise SystemExit("selective_scan.cpp's dispatch macros are not the expected ones: build the full extension instead")
    s = s.replace(half, "    if (ITYPE == at::ScalarType::BFloat16) {").replace(cplx, "    } else {")
    open(cpp, "w").write(s)


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    checkout, out = sys.argv[1], sys.argv[2]
    src = os.path.join(checkout, "csrc", "selective_scan")
    csrc = os.path.join(out, "csrc")
    shutil.rmtree(csrc, ignore_errors=True)
    shutil.copytree(src, csrc)
    trim(csrc)
    from torch.utils.cpp_extension import load
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    t0 = time.time()
    nvcc = ["-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "--expt-relaxed-constexpr",
            "--expt-extended-lambda", "--use_fast_math", "--threads", "4", "-lineinfo"]
    nvcc += [f"-U__CUDA_NO_{t}_{k}__" for t in ("HALF", "BFLOAT16", "BFLOAT162") for k in ("OPERATORS", "CONVERSIONS")]
    mod = load(name="selective_scan_cuda", build_directory=out, extra_include_paths=[csrc],
               sources=sorted(glob.glob(os.path.join(csrc, "*.cu"))) + [os.path.join(csrc, "selective_scan.cpp")],
               extra_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=nvcc)
    print(f"built {mod.__file__} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
