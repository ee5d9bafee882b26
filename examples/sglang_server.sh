#!/usr/bin/env bash
# SGLang with HiCache and hicache-mc as its L3 tier, against a local `hicache-mc serve`.
#
#   MODEL=meta-llama/Meta-Llama-3-8B-Instruct ./examples/sglang_server.sh
#
# Needs a GPU machine with sglang installed normally (pip install "hicache-mc[sglang]").
# Stop with Ctrl-C: the trap stops the store too (its DRAM pages go with it).
set -euo pipefail

MODEL=${MODEL:-meta-llama/Meta-Llama-3-8B-Instruct}
STORE_PORT=${STORE_PORT:-7370}
STORE_DRAM=${STORE_DRAM:-16GiB}      # DRAM tier of the store; LRU-evicted when full
SERVER_PORT=${SERVER_PORT:-30000}

# 1. The store: master + one DRAM node in one process, on 127.0.0.1 only.
hicache-mc serve --port "$STORE_PORT" --dram "$STORE_DRAM" &
STORE_PID=$!
trap 'kill $STORE_PID 2>/dev/null || true' EXIT
# Until its node has registered and a probe put went through (prefaulting 16 GiB takes a while);
# at once if the store exits (a port another process holds: it says which).
hicache-mc wait --master "127.0.0.1:${STORE_PORT}" --timeout 300 --pid "$STORE_PID"

# 2. The backend's settings: SGLang passes this JSON to HiCacheMC as storage_config.extra_config.
#    backend_name/module_path/class_name: how the `dynamic` backend finds the class.
#    interface_v1: 1  -> zero-copy batch_get_v1/batch_set_v1 straight into the host pool.
#    master           -> the store's address; every other key is in docs/sglang.md.
EXTRA_CONFIG=$(cat <<JSON
{"backend_name": "hicache_mc", "module_path": "hicache_mc.sglang", "class_name": "HiCacheMC",
 "interface_v1": 1, "master": "tcp://127.0.0.1:${STORE_PORT}", "timeout_s": 5.0}
JSON
)

# 3. The server.
#   --enable-hierarchical-cache         turn on HiCache: GPU (L1) + pinned host memory (L2) ...
#   --hicache-storage-backend dynamic   ... + an L3 loaded by module path (the CLI list is closed)
#   --hicache-storage-backend-extra-config  the JSON above
#   --page-size 64                      tokens per page = per stored object pair; 64 is the
#                                       recommended size with an L3 (larger objects, fewer keys)
#   --hicache-mem-layout page_first     host layout; each page is one contiguous K and one V
#                                       block, so pages move without a copy (page_first_direct
#                                       and page_head do too; layer_first is staged)
#   --hicache-ratio 2                   host pool = 2 x the GPU KV pool
#   --hicache-write-policy write_through  back up a page to host (and L3) after its first use
#   --hicache-storage-prefetch-policy timeout  wait for L3 hits up to a time budget per request
#   --enable-cache-report               report cached_tokens per request (check L3 hits)
#   --enable-metrics                    Prometheus metrics, including HiCacheMC.get_stats()
python -m sglang.launch_server \
  --model-path "$MODEL" --port "$SERVER_PORT" \
  --enable-hierarchical-cache \
  --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config "$EXTRA_CONFIG" \
  --page-size 64 \
  --hicache-mem-layout page_first \
  --hicache-ratio 2 \
  --hicache-write-policy write_through \
  --hicache-storage-prefetch-policy timeout \
  --enable-cache-report \
  --enable-metrics
