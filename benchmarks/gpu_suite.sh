#!/usr/bin/env bash
# The whole GPU suite as N parallel pytest processes on one GPU (default 4), each taking every N-th test
# (tests/conftest.py --shard), logs under ${OUT:-.}/gpu_shard_I.log; prints each shard's summary line and
# the wall time. Usage: bash benchmarks/gpu_suite.sh [N] [extra pytest args, e.g. -m smoke]
n=${1:-4}; shift || true
out=${OUT:-.}
start=$(date +%s)
for ((i = 0; i < n; i++)); do
  python3 -m pytest -m gpu -p no:cacheprovider --shard "$i/$n" "$@" tests > "$out/gpu_shard_$i.log" 2>&1 &
done
wait
for ((i = 0; i < n; i++)); do echo "shard $i/$n: $(tail -n 1 "$out/gpu_shard_$i.log")"; done
echo "wall: $(( $(date +%s) - start )) s"
