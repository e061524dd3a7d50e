#!/usr/bin/env bash
# A device session over the whole tree, one call per phase (each fits a 10-minute call):
#   bash benchmarks/gpu_round.sh checks   # every class against float64 on the GPU (fp32, bf16, packed), while
#                                         # FLA's anchors compile beside them; then the KDA-like layer against
#                                         # FLA's chunk_kda and rank-2 per head against its gated DeltaProduct
#   bash benchmarks/gpu_round.sh table    # the structure-class table (ssmcraft bench --classes), then $EXTRA
# Environment: CHECK_ONLY / VARLEN_ONLY limit the checks and TABLE_ONLY the table (comma lists; TABLE_S its
# time limit), JOBS the checks run at once, PHASE_S the seconds the table phase may take,
# EXTRA a command run last in the table phase. Logs go to $OUT (the device tool's folder); a summary is
# printed. FLA 0.6.0 wheels in .whl/ (optional) are installed to /tmp/site for the anchors.
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
mark() { echo "$1 rc=$2 at $((SECONDS - start)) s"; }

case "${1:-}" in
checks)
    # FLA's kernels take minutes to compile: in their own processes, beside the checks
    (timeout 330 python3 benchmarks/bench_kda.py --fla-warmup --fla-configs 1 > "$OUT/fla_kda_warm.txt" 2>&1) &
    (timeout 330 python3 benchmarks/bench_rankr_chunk.py --no-check --warm --only decay_explicit --fla-configs 1 \
        > "$OUT/fla_gdp_warm.txt" 2>&1) &
    (timeout 150 python3 benchmarks/check_varlen_gpu.py ${VARLEN_ONLY:+--only "$VARLEN_ONLY"} --no-time \
        > "$OUT/varlen.txt" 2>&1) &
    (timeout 150 python3 benchmarks/bench_kda.py --only-check > "$OUT/kda_check.txt" 2>&1) &
    timeout 300 python3 benchmarks/check_library_gpu.py --jobs "${JOBS:-8}" ${CHECK_ONLY:+--only "$CHECK_ONLY"} \
        > "$OUT/checks.txt" 2>&1
    mark checks $?
    wait
    mark warm-up 0
    timeout "$(left 420)" python3 benchmarks/bench_kda.py --no-check --leaf 16/16,16/4 --fla-configs 1 \
        > "$OUT/kda.txt" 2>&1
    mark kda $?
    timeout "$(left 540)" python3 benchmarks/bench_rankr_chunk.py --no-check --only explicit,decay_explicit \
        --fla-configs 1 > "$OUT/gdp.txt" 2>&1
    mark gdp $?
    echo "checks within tolerance: $(grep -c ' ok$' "$OUT/checks.txt")"; grep -v " ok$" "$OUT/checks.txt" | tail -n +2
    grep -v "^ok" "$OUT/varlen.txt"; grep -c "^ok" "$OUT/varlen.txt"; tail -3 "$OUT/kda_check.txt"
    grep "^|\|/ FLA" "$OUT/kda.txt"; grep "^|" "$OUT/gdp.txt"
    ;;
table)
    timeout "${TABLE_S:-330}" python3 benchmarks/bench_classes.py --classes ${TABLE_ONLY:+--only "$TABLE_ONLY"} \
        --out "$OUT/classes.json" > "$OUT/classes.txt" 2>&1
    mark classes $?
    if [ -n "${EXTRA:-}" ]; then
        timeout "$(left "${PHASE_S:-540}")" bash -c "$EXTRA" > "$OUT/extra.txt" 2>&1
        mark extra $?
        tail -40 "$OUT/extra.txt"
    fi
    grep "^|" "$OUT/classes.txt"
    ;;
*)
    echo "usage: bash benchmarks/gpu_round.sh checks|table" >&2
    exit 2
    ;;
esac
