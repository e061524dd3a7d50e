#!/usr/bin/env bash
# One device session over the whole tree, in two calls on the same warm machine (FLA's compiled
# kernels stay in Triton's disk cache between them):
#   bash benchmarks/gpu_round.sh checks    # correctness of every class on the GPU; FLA compiles beside
#   bash benchmarks/gpu_round.sh timings   # the class table, then each family against its FLA anchor
# Each writes its logs to $OUT (the device tool's folder) and prints a summary. FLA 0.6.0 wheels in
# .whl/ (optional) are installed to /tmp/site for the anchors.
set -u
OUT=${OUT:-/tmp/gpu_round}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/fla ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
start=$SECONDS
left() { local r=$(( $1 - (SECONDS - start) )); echo $(( r > 5 ? r : 5 )); }   # seconds left of a phase budget of $1

case "${1:-}" in
checks)
    (timeout 420 python3 benchmarks/bench_kda.py --fla-warmup --fla-configs 1 > "$OUT/fla_kda_warm.txt" 2>&1) &
    (timeout 420 python3 benchmarks/bench_rankr_chunk.py --no-check --warm --only decay_explicit --fla-configs 1 \
        > "$OUT/fla_gdp_warm.txt" 2>&1) &
    timeout 120 python3 benchmarks/check_varlen_gpu.py --only "${VARLEN_ONLY:-rls,ttt_mlp,kda_like,minibatch_delta}" \
        --no-time > "$OUT/varlen.txt" 2>&1 &
    timeout 330 python3 benchmarks/check_library_gpu.py --jobs "${JOBS:-8}" ${CHECK_ONLY:+--only "$CHECK_ONLY"} \
        > "$OUT/checks.txt" 2>&1
    echo "checks rc=$? at $((SECONDS - start)) s"
    timeout "$(left 480)" python3 benchmarks/bench_kda.py --only-check > "$OUT/kda_check.txt" 2>&1
    echo "kda check rc=$? at $((SECONDS - start)) s"
    wait
    grep -c " ok$" "$OUT/checks.txt"; grep -v " ok$" "$OUT/checks.txt" | tail -n +2
    cat "$OUT/varlen.txt" "$OUT/kda_check.txt"; tail -2 "$OUT"/fla_*_warm.txt
    ;;
timings)
    timeout 300 python3 benchmarks/bench_classes.py --classes --out "$OUT/classes.json" > "$OUT/classes.txt" 2>&1
    echo "classes rc=$? at $((SECONDS - start)) s"
    timeout "$(left 400)" python3 benchmarks/bench_kda.py --no-check --leaf 16/16,16/4 --fla-configs 1 \
        > "$OUT/kda.txt" 2>&1
    echo "kda rc=$? at $((SECONDS - start)) s"
    timeout "$(left 500)" python3 benchmarks/bench_rankr_chunk.py --no-check --only explicit,decay_explicit \
        --fla-configs 1 > "$OUT/gdp.txt" 2>&1
    echo "gdp rc=$? at $((SECONDS - start)) s"
    if [ -n "${EXTRA:-}" ]; then
        timeout "$(left 540)" bash -c "$EXTRA" > "$OUT/extra.txt" 2>&1
        echo "extra rc=$? at $((SECONDS - start)) s"
    fi
    grep "^|" "$OUT/classes.txt"; grep "^|\|/ FLA" "$OUT/kda.txt"; grep "^|" "$OUT/gdp.txt"
    ;;
*)
    echo "usage: bash benchmarks/gpu_round.sh checks|timings" >&2
    exit 2
    ;;
esac
