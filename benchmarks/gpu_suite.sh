#!/usr/bin/env bash
# The whole GPU suite as N parallel pytest processes on one GPU (default 4), each taking every N-th test
# (tests/conftest.py --shard), logs under ${OUT:-.}/gpu_shard_I.log; prints each shard's summary line and
# the wall time; exits non-zero if any shard failed. MARK picks the tests (default "gpu"; e.g.
# MARK="gpu and smoke"); each process gets nproc / N CPU threads (THREADS overrides). Usage: [MARK=...] bash benchmarks/gpu_suite.sh [N] [extra pytest args]
n=${1:-4}; shift || true
out=${OUT:-.}
mark=${MARK:-gpu}
# each process's CPU threads (torch's reference math, the kernel compilers) share the cores: without a
# cap every process starts one thread per core and the shards slow each other several-fold
threads=${THREADS:-$(( $(nproc) / n > 0 ? $(nproc) / n : 1 ))}
start=$(date +%s)
pids=()
for ((i = 0; i < n; i++)); do
  OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads python3 -m pytest -m "$mark" -p no:cacheprovider -rfE --shard "$i/$n" "$@" tests > "$out/gpu_shard_$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for ((i = 0; i < n; i++)); do echo "shard $i/$n: $(tail -n 1 "$out/gpu_shard_$i.log")"; done
echo "wall: $(( $(date +%s) - start )) s"
exit $status
