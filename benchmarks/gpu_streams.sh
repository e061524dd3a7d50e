#!/usr/bin/env bash
# One device call on a machine of several GPUs, one command per GPU at once: checks on one card, timings on
# another, so that a round's GPU work fits one call. Timings taken on different cards are compared within a
# command (one process) only, as everywhere in BENCHMARKS.md.
#
#   bash benchmarks/gpu_streams.sh LIMIT_S "command for GPU 0" ["command for GPU 1" ...]
#
# Command i runs with CUDA_VISIBLE_DEVICES=i and stops at LIMIT_S seconds; its output goes to
# $OUT/stream_i.txt and its last lines are printed after all have ended. FLA 0.6.0 wheels in .whl/
# (optional) are installed to /tmp/site for the anchors.
set -u
OUT=${OUT:-/tmp/gpu_streams}
mkdir -p "$OUT"
limit=$1; shift
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/fla ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=index,name --format=csv,noheader
n=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
[ $# -le "$n" ] || { echo "gpu_streams: $# commands for $n GPUs" >&2; exit 2; }
start=$SECONDS
i=0
for cmd in "$@"; do
    (CUDA_VISIBLE_DEVICES=$i timeout "$limit" bash -c "$cmd" > "$OUT/stream_$i.txt" 2>&1
     echo "stream $i rc=$? at $((SECONDS - start)) s" >> "$OUT/stream_$i.txt") &
    i=$((i + 1))
done
wait
for j in $(seq 0 $((i - 1))); do
    echo "===== stream $j"
    tail -n "${TAIL:-40}" "$OUT/stream_$j.txt"
done
