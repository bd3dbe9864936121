#!/usr/bin/env bash
# One device call's worth of GPU evidence (each part fits the 10-minute limit of a call), after the bundle is
# staged (`bash .gpu/a/stage.sh`, then `source .gpu/b/env.sh`). Everything lands under $OUT (at most 8 files come
# back: logs are concatenated). Usage: bash benchmarks/gpu_session.sh PART
#   verify   the smoke tier (one process), then the full GPU suite (6 processes), then the kernels this run
#            compiled as $OUT/jit.part.* (cat them back into jit.tar.xz: the shared cache's refresh)
#   demos    token-tree speculation, piecewise-compiled demos (Llama, Gemma-2, BART on FlashInfer and FA4),
#            gpt-oss on both backends, each with graphs: $OUT/demos.log (those past 440 s skipped, and named)
#   bench    tree verify vs chain verify, the compiled 1B-class step, op dispatch on CUDA, host work per step
#            (names after `bench` pick some: tree_verify compiled_step op_dispatch host_step)
#   check    the full suite (no smoke tier) beside the demos in two lanes (full and piecewise compile):
#            one call for correctness evidence when device time is short (demo times then share the host)
set -uo pipefail
out=${OUT:?set OUT}
start=$(date +%s)
demos() {  # LOG LIMIT "ARGS;ARGS;...": each demo in turn, LIMIT s each; none starts past 440 s of the call's 600
  local log=$1 limit=$2 r; : > "$log"
  IFS=';' read -ra runs <<< "$3"
  for r in "${runs[@]}"; do
    if (( $(date +%s) - start > 440 )); then echo "\$ python -m mstar_attn demo $r: skipped (time)" >> "$log"; continue; fi
    echo "\$ python -m mstar_attn demo $r" >> "$log"
    timeout "$limit" python3 -m mstar_attn demo $r >> "$log" 2>&1 || echo "(exit $?)" >> "$log"
  done; }
save_jit() {  # the kernels this machine compiled, as $out/jit.part.* (cat them back into jit.tar.xz)
  mkdir -p /tmp/jit && bash benchmarks/jit_cache.sh save /tmp/jit > /dev/null && split -b 15M /tmp/jit/jit.tar.xz "$out/jit.part."; }
compiled() {  # every family x backend with --compile MODE, ';'-separated
  local m b list=""
  for m in llama gemma2 bart; do for b in flashinfer flash_attn; do list+=";--model $m --backend $b --compile $1 --graphs"; done; done
  echo "${list#;}"; }
case "${1:-}" in
  verify)
    timeout 150 python3 -m pytest -m smoke -p no:cacheprovider -rfE tests > "$out/smoke.log" 2>&1
    echo "smoke: $(tail -n 1 "$out/smoke.log") ($(( $(date +%s) - start )) s wall)" | tee "$out/summary.txt"
    mkdir -p /tmp/full
    OUT=/tmp/full timeout 330 bash benchmarks/gpu_suite.sh 6 --durations=40 | tee -a "$out/summary.txt"
    cat /tmp/full/gpu_shard_*.log > "$out/full.log"
    save_jit
    ;;
  demos)
    demos "$out/demos.log" 150 "--speculate 4 --tree 2 --backend flashinfer;$(compiled piecewise);--model gpt_oss --backend flashinfer;--model gpt_oss --backend flash_attn"
    grep -E '^\$|matches|graph breaks|piece graphs|speed' "$out/demos.log" > "$out/demos_summary.txt"
    ;;
  bench)  # (json + md each, one log: 8 files)
    log="$out/bench.log"; : > "$log"; shift; want=" ${*:-tree_verify compiled_step op_dispatch host_step} "
    for b in "150 tree_verify $out" "240 compiled_step $out" "60 op_dispatch --device cuda --out $out" "120 host_step $out a,c"; do
      set -- $b; limit=$1; shift
      [[ $want == *" $1 "* ]] || continue
      echo "\$ python -m benchmarks.$*" >> "$log"; timeout "$limit" python3 -m benchmarks."$@" >> "$log" 2>&1 || echo "(exit $?)" >> "$log"
    done
    tail -n 40 "$log"
    ;;
  check)
    mkdir -p /tmp/full
    (OUT=/tmp/full timeout 540 bash benchmarks/gpu_suite.sh 6 --durations=40 > /tmp/full/summary.txt 2>&1) &
    suite=$!
    demos /tmp/lane_full.log 170 "--speculate 4 --tree 2 --backend flashinfer;--speculate 4 --tree 2 --backend flash_attn;$(compiled full)" & first=$!
    demos /tmp/lane_piece.log 170 "$(compiled piecewise)"; wait "$first"; wait "$suite"
    cat /tmp/full/summary.txt > "$out/summary.txt"; cat /tmp/full/gpu_shard_*.log > "$out/full.log"
    cat /tmp/lane_full.log /tmp/lane_piece.log > "$out/demos.log"
    grep -E '^\$|matches|graph breaks|piece graphs|speed|graphs  |Error|error' "$out/demos.log" > "$out/demos_summary.txt"
    save_jit
    echo "check: $(( $(date +%s) - start )) s"; cat "$out/summary.txt"; tail -n 30 "$out/demos_summary.txt"
    ;;
  *) echo "usage: bash benchmarks/gpu_session.sh verify|demos|bench [names]|check"; exit 2 ;;
esac
