#!/usr/bin/env bash
# The whole GPU suite as N parallel pytest processes on one GPU (default 4), each taking every N-th test
# (tests/conftest.py --shard), logs under ${OUT:-.}/gpu_shard_I.log; prints each shard's summary line and
# the wall time; exits non-zero if any shard failed. MARK picks the tests (default "gpu"; e.g.
# MARK="gpu and smoke"). Usage: [MARK=...] bash benchmarks/gpu_suite.sh [N] [extra pytest args]
n=${1:-4}; shift || true
out=${OUT:-.}
mark=${MARK:-gpu}
start=$(date +%s)
pids=()
for ((i = 0; i < n; i++)); do
  python3 -m pytest -m "$mark" -p no:cacheprovider -rfE --shard "$i/$n" "$@" tests > "$out/gpu_shard_$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for ((i = 0; i < n; i++)); do echo "shard $i/$n: $(tail -n 1 "$out/gpu_shard_$i.log")"; done
echo "wall: $(( $(date +%s) - start )) s"
exit $status
