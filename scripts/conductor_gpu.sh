#!/usr/bin/env bash
# Two real SGLang servers on one GPU machine, HiCache with hicache-mc as their L3, behind
# `hicache-mc conductor`; then a short multi-turn workload through it and what it decided.
#
#   scripts/conductor_gpu.sh                      # Qwen/Qwen2.5-0.5B-Instruct, GPUs 0 and 1
#   MODEL=/models/Llama-3.1-8B-Instruct GPUS="0 0" scripts/conductor_gpu.sh
#
# Needs: SGLang 0.5.23+ and hicache-mc installed in one environment (pip install ".[sglang]"
# and ".[conductor]" from this checkout; docs/conductor-server.md), the model (a local folder, or a
# Hugging Face name the machine can download). Environment knobs: MODEL, GPUS (one id per
# server; "0 0" puts both on GPU 0 with half the memory each), BASE_PORT (default 31000),
# PAGE (64), DRAM (the store's, 8GiB), TURNS (4), CONVERSATIONS (8), WORKDIR (a temp folder).
# Everything it starts is stopped when it exits; logs stay in WORKDIR.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
read -r -a GPU_IDS <<< "${GPUS:-0 1}"
BASE_PORT=${BASE_PORT:-31000}
PAGE=${PAGE:-64}
DRAM=${DRAM:-8GiB}
TURNS=${TURNS:-4}
CONVERSATIONS=${CONVERSATIONS:-8}
WORKDIR=${WORKDIR:-$(mktemp -d -t hicache-mc-conductor-XXXX)}
PY=${PYTHON:-python3}
MASTER_PORT=$((BASE_PORT))
CONDUCTOR_PORT=$((BASE_PORT + 1))
PIDS=()

cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "logs: $WORKDIR"
}
trap cleanup EXIT

wait_http() {   # URL, what, seconds
  local end=$((SECONDS + $3))
  until curl -sf -o /dev/null "$1"; do
    if (( SECONDS > end )); then echo "$2 did not come up; see $WORKDIR" >&2; exit 1; fi
    sleep 2
  done
}

echo "== the store (hicache-mc serve, $DRAM) on 127.0.0.1:$MASTER_PORT"
setsid hicache-mc serve --port "$MASTER_PORT" --dram "$DRAM" --metrics-port 0 \
  > "$WORKDIR/store.log" 2>&1 & PIDS+=($!)
hicache-mc wait --master "tcp://127.0.0.1:$MASTER_PORT" --timeout 120

SERVERS=()
MEM=0.80; [[ ${#GPU_IDS[@]} -gt 1 && "${GPU_IDS[0]}" == "${GPU_IDS[1]}" ]] && MEM=0.40
for i in "${!GPU_IDS[@]}"; do
  port=$((BASE_PORT + 10 + 10 * i)); events=$((port + 1)); replay=$((port + 2))
  echo "== SGLang server s$i on GPU ${GPU_IDS[$i]}, http://127.0.0.1:$port (events $events, replay $replay)"
  CUDA_VISIBLE_DEVICES=${GPU_IDS[$i]} setsid $PY -m sglang.launch_server --model-path "$MODEL" \
    --host 127.0.0.1 --port "$port" --mem-fraction-static "$MEM" --page-size "$PAGE" \
    --enable-hierarchical-cache --hicache-ratio 2 --hicache-mem-layout page_first \
    --hicache-storage-backend hicache_mc \
    --hicache-storage-backend-extra-config "{\"master\":\"tcp://127.0.0.1:$MASTER_PORT\"}" \
    --kv-events-config "{\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$events\",\"bind\":true,\"replay_endpoint\":\"tcp://127.0.0.1:$replay\"}" \
    --enable-cache-report --enable-metrics \
    > "$WORKDIR/s$i.log" 2>&1 & PIDS+=($!)
  SERVERS+=("s$i=http://127.0.0.1:$port")
done
for i in "${!GPU_IDS[@]}"; do wait_http "http://127.0.0.1:$((BASE_PORT + 10 + 10 * i))/health" "s$i" 900; done

# the deployment's key namespace, as the backend logs it (the conductor's L3 view follows it)
NAMESPACE=$(grep -o "namespace [0-9a-f@A-Za-z_.-]*, master" "$WORKDIR/s0.log" | head -1 | cut -d' ' -f2 | tr -d ,)
echo "== namespace $NAMESPACE"

# the served model's tokenizer folder: the model folder itself, or its Hugging Face snapshot
TOKENIZER=$($PY - "$MODEL" <<'PY'
import os, sys
m = sys.argv[1]
if os.path.isdir(m):
    print(m)
else:
    from huggingface_hub import snapshot_download
    print(snapshot_download(m, allow_patterns=["tokenizer*", "*.json", "*.jinja", "*.model", "*.txt"]))
PY
)
echo admin > "$WORKDIR/admin.key"
echo "== hicache-mc conductor on http://127.0.0.1:$CONDUCTOR_PORT"
setsid hicache-mc -v conductor --port "$CONDUCTOR_PORT" --worker-urls "${SERVERS[@]}" \
  --tokenizer "$TOKENIZER" --l3-master "tcp://127.0.0.1:$MASTER_PORT" --l3-namespace "$NAMESPACE" \
  --admin-key-file "$WORKDIR/admin.key" > "$WORKDIR/conductor.log" 2>&1 & PIDS+=($!)
wait_http "http://127.0.0.1:$CONDUCTOR_PORT/ready" conductor 120

echo "== $CONVERSATIONS conversations x $TURNS turns through the conductor"
$PY - "$CONDUCTOR_PORT" "$CONVERSATIONS" "$TURNS" <<'PY'
import json, sys, time, urllib.request
port, convs, turns = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
url = f"http://127.0.0.1:{port}"

def post(path, doc):
    req = urllib.request.Request(url + path, data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.headers, json.loads(r.read())

history = {c: [{"role": "system", "content": f"You are assistant number {c}. " + "Be thorough. " * 200}]
           for c in range(convs)}
print(f"{'conv':>4} {'turn':>4} {'worker':>8} {'pred_ttft_ms':>12} {'e2e_ms':>8} {'prompt':>7} {'cached':>7}")
for t in range(turns):
    for c in range(convs):
        history[c].append({"role": "user", "content": f"Question {t} of conversation {c}: tell me more."})
        t0 = time.monotonic()
        headers, doc = post("/v1/chat/completions", {"model": "m", "messages": history[c], "max_tokens": 32,
                                                     "temperature": 0})
        e2e = (time.monotonic() - t0) * 1e3
        history[c].append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
        u = doc["usage"]
        print(f"{c:>4} {t:>4} {headers['X-Conductor-Worker']:>8} "
              f"{float(headers['X-Conductor-Predicted-TTFT']) * 1e3:>12.1f} {e2e:>8.1f} "
              f"{u['prompt_tokens']:>7} {(u.get('prompt_tokens_details') or {}).get('cached_tokens', 0):>7}")
PY

echo "== what the conductor saw"
curl -s "http://127.0.0.1:$CONDUCTOR_PORT/metrics" | grep -E "^hicache_mc_conductor_(decisions_total|worker_healthy|worker_events_live|events_batches|index_blocks|index_bytes_per_block|cached_tokens_total|ttft_error_seconds_(sum|count))" || true
curl -s -H "Authorization: Bearer admin" "http://127.0.0.1:$CONDUCTOR_PORT/workers"; echo
