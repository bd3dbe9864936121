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
case "${1:-}" in
  verify)
    s=$(date +%s)
    timeout 150 python3 -m pytest -m smoke -p no:cacheprovider -rfE tests > "$out/smoke.log" 2>&1
    echo "smoke: $(tail -n 1 "$out/smoke.log") ($(( $(date +%s) - s )) s wall)" | tee "$out/summary.txt"
    mkdir -p /tmp/full
    OUT=/tmp/full timeout 330 bash benchmarks/gpu_suite.sh 6 --durations=40 | tee -a "$out/summary.txt"
    cat /tmp/full/gpu_shard_*.log > "$out/full.log"
    mkdir -p /tmp/jit && bash benchmarks/jit_cache.sh save /tmp/jit > /dev/null && split -b 15M /tmp/jit/jit.tar.xz "$out/jit.part."
    ;;
  demos)
    log="$out/demos.log"; : > "$log"
    start=$(date +%s)
    run() {  # (one demo; past 440 s of the call's 600 the rest are skipped, and the log says so)
      if (( $(date +%s) - start > 440 )); then echo "\$ python -m mstar_attn demo $*: skipped (time)" >> "$log"; return; fi
      echo "\$ python -m mstar_attn demo $*" >> "$log"
      timeout 150 python3 -m mstar_attn demo "$@" >> "$log" 2>&1 || echo "(exit $?)" >> "$log"; }
    run --speculate 4 --tree 2 --backend flashinfer
    for m in llama gemma2 bart; do
      for b in flashinfer flash_attn; do run --model "$m" --backend "$b" --compile piecewise --graphs; done
    done
    run --model gpt_oss --backend flashinfer
    run --model gpt_oss --backend flash_attn
    grep -E '^\$|matches|graph breaks|piece graphs|speed' "$log" > "$out/demos_summary.txt"
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
    s=$(date +%s); mkdir -p /tmp/full
    (OUT=/tmp/full timeout 540 bash benchmarks/gpu_suite.sh 6 --durations=40 > /tmp/full/summary.txt 2>&1) &
    suite=$!
    lane() {  # (log, then demo argument lists separated by ';'; none starts past 420 s)
      local log=$1; shift; : > "$log"
      IFS=';' read -ra runs <<< "$*"
      for r in "${runs[@]}"; do
        if (( $(date +%s) - s > 420 )); then echo "\$ python -m mstar_attn demo $r: skipped (time)" >> "$log"; continue; fi
        echo "\$ python -m mstar_attn demo $r" >> "$log"
        timeout 170 python3 -m mstar_attn demo $r >> "$log" 2>&1 || echo "(exit $?)" >> "$log"
      done; }
    full="--speculate 4 --tree 2 --backend flashinfer"; piece=""
    for m in llama gemma2 bart; do for b in flashinfer flash_attn; do
      full+=";--model $m --backend $b --compile full --graphs"; piece+=";--model $m --backend $b --compile piecewise --graphs"
    done; done
    lane /tmp/lane_full.log "$full" & first=$!
    lane /tmp/lane_piece.log "${piece#;}"; wait "$first"; wait "$suite"
    cat /tmp/full/summary.txt > "$out/summary.txt"; cat /tmp/full/gpu_shard_*.log > "$out/full.log"
    cat /tmp/lane_full.log /tmp/lane_piece.log > "$out/demos.log"
    grep -E '^\$|matches|graph breaks|piece graphs|speed|Error|error' "$out/demos.log" > "$out/demos_summary.txt"
    mkdir -p /tmp/jit && bash benchmarks/jit_cache.sh save /tmp/jit > /dev/null && split -b 15M /tmp/jit/jit.tar.xz "$out/jit.part."
    echo "check: $(( $(date +%s) - s )) s"; cat "$out/summary.txt"; tail -n 30 "$out/demos_summary.txt"
    ;;
  *) echo "usage: bash benchmarks/gpu_session.sh verify|demos|bench [names]|check"; exit 2 ;;
esac
