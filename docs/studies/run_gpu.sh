#!/bin/bash
# Run study specs side by side on one GPU machine (through the `device` tool), then write
# each report and pack everything but model weights into $OUT/studies.tgz.
#
#   bash docs/studies/run_gpu.sh DEADLINE_S SPEC:SHARDS [SPEC:SHARDS ...]
#
# e.g. issue 14's three searches, side by side on one H200 in at most 9 minutes:
#   bash docs/studies/run_gpu.sh 540 specs/studies/composed_search.yaml:1 \
#       specs/studies/composed_search_bytes.yaml:1 specs/studies/leave_one_out.yaml:1
#
# Each SPEC runs as SHARDS processes (`ssmcraft study SPEC --out W/NAME --shard i/SHARDS`;
# small models leave a GPU mostly idle, so several share it), then once more without --shard
# to read every cell back and write W/NAME/report.md (SHARDS 1: one plain run, which is how a
# composed search runs: it spreads its own trials through Ray). Everything stops by DEADLINE_S seconds
# after the start. Finished cells of an earlier call, carried in as .study_out/ (the unpacked
# studies.tgz), are reused, so a study cut off by the deadline resumes in the next call.
# Needs optuna + ray wheels in .whl_search/ (carried), like the search runs (BENCHMARKS.md).
set -u
T0=$(date +%s)
DEADLINE=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_search/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 \
       RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled
W=/tmp/studies
mkdir -p $W $OUT
[ -d .study_out ] && cp -r .study_out/. $W/
nvidia-smi -L
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 5000 > $W/gpu_util.csv &
SMI=$!
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
pids=()
for item in "$@"; do
  spec=${item%%:*}; n=${item##*:}; name=$(basename $spec .yaml)
  if [ "$n" = 1 ]; then     # one process: it writes its own report (the only way for a composed search)
    timeout $(( $(left) - 25 )) python3 -m ssmcraft.cli study $spec --out $W/$name > $W/${name}_report.log 2>&1 &
    pids+=($!)
    continue
  fi
  for i in $(seq 0 $((n - 1))); do
    timeout $(( $(left) - 75 )) python3 -m ssmcraft.cli study $spec --out $W/$name --shard $i/$n \
      > $W/${name}_shard$i.log 2>&1 &
    pids+=($!)
  done
done
wait "${pids[@]}"
echo "shards done after $(( $(date +%s) - T0 )) s"
for item in "$@"; do
  spec=${item%%:*}; n=${item##*:}; name=$(basename $spec .yaml)
  [ "$n" = 1 ] || timeout $(( $(left) - 25 )) python3 -m ssmcraft.cli study $spec --out $W/$name > $W/${name}_report.log 2>&1
  echo "$name: rc $? after $(( $(date +%s) - T0 )) s"; tail -n 8 $W/${name}_report.log
done
kill $SMI
python3 - $W <<'PY'
import sys
rows = [l.split(",") for l in open(sys.argv[1] + "/gpu_util.csv") if l.count(",") == 2]
u = [float(r[1].split()[0]) for r in rows]
print(f"GPU utilisation: mean {sum(u) / max(1, len(u)):.0f}% over {len(u)} samples (every 5 s)")
PY
# the returned archive must stay under 16 MiB: no weights, per-step histories or per-run plots
(cd $W && find . -type f ! -name '*.safetensors' ! -name '*.pt' ! -name history.json ! -path '*/runs/*.png' \
   ! -path '*/trials/*.png' | tar czf $OUT/studies.tgz -T -)
ls -la $OUT/studies.tgz
