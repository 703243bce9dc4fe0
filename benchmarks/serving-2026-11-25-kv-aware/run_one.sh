#!/bin/bash
# One run of benchmarks/serving-2026-11-25-kv-aware.md, from the repository root:
#   benchmarks/serving-2026-11-25-kv-aware/run_one.sh LABEL PREFILL_POLICY DECODE_POLICY \
#       KV_TOKENS_PER_NODE SESSIONS [more gateway flags]
# Starts a 2P2D pd-cluster, runs the conversation workload, keeps the gateway's cache metrics.
# OUT_ROOT (default: this folder) is where the run's folder goes; later reports set it.
# THINK (default 0.5) is the think time between a session's turns, in seconds; RATE (default
# inf: all at once) is how many sessions start a second.
set -u
export OMP_NUM_THREADS=1
LABEL=$1; PP=$2; DP=$3; MTT=$4; N=$5; shift 5
OUT=${OUT_ROOT:-benchmarks/serving-2026-11-25-kv-aware}/$LABEL
mkdir -p "$OUT"
PORT=$(.venv/bin/python -c "from engine.ports import free_port; print(free_port())")
.venv/bin/pd-cluster --prefill 2 --decode 2 --port "$PORT" --max-total-tokens "$MTT" \
  --gateway-args "--prefill-policy $PP --decode-policy $DP $*" > "$OUT/cluster.log" 2>&1 &
CPID=$!
for _ in $(seq 600); do grep -q "ready:" "$OUT/cluster.log" && break; sleep 0.5; done
.venv/bin/python -m scripts.serving.bench_serving --base-url "http://127.0.0.1:$PORT" \
  --dataset conversation --num-prompts "$N" --multiturn-turns 6 --conversation-system-len 1024 \
  --random-input-len 64 --random-output-len 32 --think-time "${THINK:-0.5}" \
  --request-rate "${RATE:-inf}" --ignore-eos --seed 1 \
  --label "$LABEL" --no-progress --output-file "$OUT/result.json" > "$OUT/bench.txt" 2>&1
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^pdserve_gateway_(cached_tokens|prompt_tokens|local_prefills|kv_event|kv_index|node_cached|node_prompt)" > "$OUT/metrics.txt"
kill -INT $CPID; wait $CPID
