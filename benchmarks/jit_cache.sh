#!/usr/bin/env bash
# Carry compiled kernels between device machines (each starts bare; FlashInfer's JIT costs
# 25-80 s a module). Device side, after `source .gpu/b/env.sh`:
#   bash benchmarks/jit_cache.sh save $OUT     FlashInfer .so files + FA4 cache -> $OUT/jit.tar.xz
#   bash benchmarks/jit_cache.sh load DIR      DIR/jit.tar.xz -> FlashInfer's AOT dir (loaded
#                                              without a build) and FA4's cache dir
# The archive carries key.txt (mstar_attn.warmup.cache_key(): FlashInfer, FA4, torch and CUDA versions,
# GPU architecture); load refuses an archive built under another key (its kernels would be stale):
# nothing is loaded, and the kernels compile on first use (or in `python -m mstar_attn warmup`).
set -euo pipefail
key=$(python3 -c "from mstar_attn.warmup import cache_key; print(cache_key())")
aot=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)")
fa4=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-/tmp/gpu-jit/fa4}
case "$1" in
  save)
    stage=$(mktemp -d); mkdir -p "$stage/aot" "$stage/fa4"
    for so in $(find "${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer" -path '*cached_ops/*' -name '*.so' 2>/dev/null); do
      name=$(basename "$so" .so); mkdir -p "$stage/aot/$name"; cp "$so" "$stage/aot/$name/"
    done
    [[ -d $aot ]] && cp -r "$aot"/. "$stage/aot/" 2>/dev/null || true
    [[ -d $fa4 ]] && cp -r "$fa4"/. "$stage/fa4/" || true
    echo "$key" > "$stage/key.txt"
    tar cf - -C "$stage" . | xz -T0 -6 > "$2/jit.tar.xz"; du -h "$2/jit.tar.xz"; echo "key: $key" ;;
  load)
    [[ -f $2/jit.tar.xz ]] || { echo "no $2/jit.tar.xz"; exit 0; }
    stage=$(mktemp -d); xz -d -T0 < "$2/jit.tar.xz" | tar xf - -C "$stage"
    built=$(cat "$stage/key.txt" 2>/dev/null || echo "no key")
    if [[ $built != "$key" ]]; then
      echo "jit cache: not loaded: built for '$built', this machine is '$key' (kernels compile on first use)"; exit 0
    fi
    mkdir -p "$aot" "$fa4"; cp -r "$stage/aot/." "$aot/"; cp -r "$stage/fa4/." "$fa4/"
    echo "jit cache: $(ls "$aot" | wc -l) FlashInfer modules, $(ls "$fa4" | wc -l) FA4 entries" ;;
esac
